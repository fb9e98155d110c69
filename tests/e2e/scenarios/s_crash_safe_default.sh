# Scenario s: crash-safe by default, tried as a user would, with the README's CLI section and
# no flags: `uzram create --size 2G`, mkswap, swapon; a hog of 2x the memory available on heap
# pages; kill -9 of the daemon while it swaps out; then `uzram recover DEV`. The standby that
# `create` starts by default takes the device over by itself; `uzram recover` must then say
# so and exit 0, the hog must verify every word, and nothing may hang.
# The kill and `uzram recover` are run by crashkill (resident in memory, started before the
# kill: see scenario r), `uzram recover` right after the killed daemon is gone, as a user
# typing it would: its output goes to a file on the never-swapped root.
. /e2e/lib.sh
begin s_crash_safe_default
standby_pids() {
  for _p in /proc/[0-9]*; do
    { tr '\0' ' ' < "$_p/cmdline"; } 2>/dev/null | grep -q 'recover --wait --kee[p]' && echo "${_p#/proc/}"
  done
}
AVAIL0=$(mem_avail_mib)
echo 0 > /proc/sys/vm/compact_unevictable_allowed
if uzram_create --default --size 2G; then
  # the standby is started once the device serves, and makes its memory then: wait for it
  # before sizing the hog against what is left
  i=0; while [ -z "$(standby_pids)" ] && [ $i -lt 100 ]; do i=$((i + 1)); usleep 100000; done
  SB=$(standby_pids)
  [ -n "$SB" ] && ok "create started a standby by default (pid $SB)" || fail_check "no standby after a plain create"
  sleep 3
  AVAIL=$(mem_avail_mib)
  HOG=${UZ_hog_mib:-$((AVAIL * ${UZ_hog_pct:-200} / 100 + 16))}
  say "  MemAvailable ${AVAIL0} MiB before the device, ${AVAIL} MiB with its daemon and standby -> hog ${HOG} MiB"
  check "mkswap" mkswap "$DEV" && check "swapon --discard" swapon -d "$DEV"
  PID=$(daemon_pid "$DEV")
  hangwatch "${UZ_hangwatch_secs:-400}" uzram &
  WPID=$!
  : > /tmp/hog.out
  rm -f /tmp/s-recover.out
  # kill once a quarter of the hog went out to swap; `uzram recover` right after (gap 0)
  timeout -s KILL "$IO_TMO" crashkill -p "$DEV" pswpout $((HOG * 256 / 4)) "$PID" 0 \
    sh -c "uzram recover $DEV > /tmp/s-recover.out 2>&1" > /dev/console 2>&1 &
  CPID=$!
  timeout -s KILL "$IO_TMO" hog "$HOG" 1 2 > /tmp/hog.out 2>&1 &
  HPID=$!
  wait $CPID; crc=$?
  [ $crc = 0 ] && ok "killed during swap-out; uzram recover exited 0" \
    || fail_check "crashkill/uzram recover rc=$crc: $(tr '\n' ' ' < /tmp/s-recover.out 2>/dev/null | head -c 300)"
  sed 's/^/    recover| /' /tmp/s-recover.out 2>/dev/null
  grep -q 'nothing to recover' /tmp/s-recover.out \
    && ok "uzram recover says the standby has taken the device over" \
    || fail_check "uzram recover did not say the device was taken over already"
  wait $HPID; hrc=$?
  kill $WPID 2>/dev/null
  sed 's/^/    | /' /tmp/hog.out
  [ $hrc = 0 ] && ok "hog: every word verified across the crash" || fail_check "hog rc=$hrc"
  grep -q ' 0 bad words' /tmp/hog.out || fail_check "hog reported bad words"
  NEW=$(daemon_pid "$DEV")
  [ -n "$NEW" ] && [ "$NEW" != "$PID" ] && ok "a new daemon ($NEW) serves $DEV" || fail_check "no new daemon serves $DEV"
  [ -n "$(standby_pids)" ] && ok "a standby waits again for the next crash" || fail_check "no standby after the takeover"
  fails=$(stat_field "$DEV" checksum_failures)
  [ "${fails:-x}" = 0 ] && ok "no page failed its checksum" || fail_check "checksum_failures=${fails:-?}"
  check "swapoff" swapoff "$DEV"
  uzram_destroy "$DEV"
  i=0; while [ -n "$(standby_pids)" ] && [ $i -lt 100 ]; do i=$((i + 1)); usleep 100000; done
  [ -z "$(standby_pids)" ] && ok "the standby ended with its device" || fail_check "a standby outlived its device"
  n=$(tail -n +2 /proc/sysvipc/shm | wc -l)
  [ "$n" = 0 ] && ok "no shared memory left" || { fail_check "$n shared memory segments left"; cat /proc/sysvipc/shm; }
fi
end

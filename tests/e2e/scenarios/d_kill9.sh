# Scenario d: kill -9 of a daemon, then `uzram recover`. With ublk user recovery the device
# stays, its I/O paused, and the store stays in shared memory: I/O in flight at the kill must
# finish once a new daemon took over, with every byte right; `uzram list` and `uzram status`
# show the device while its daemon is gone; the new daemon's counters go on from the dead
# one's; `uzram destroy` deletes such a device without hanging, and its shared memory goes
# with it.
. /e2e/lib.sh
# paused_anon: anon_kib of the last takeover line in the daemons' logs (KiB of private memory
# the new daemon took between the crash and serving); waits up to 5 s for the line, which the
# daemon's log thread writes a moment after it serves
paused_anon() {
  for _i in 1 2 3 4 5; do
    _a=$(cat /run/uzram/*.log 2>/dev/null | tr -d '\033' | sed 's/\[[0-9;]*m//g' | grep -a 'paused_ms=' | tail -1 | grep -o 'anon_kib=[0-9]*' | cut -d= -f2)
    [ -n "$_a" ] && { echo "$_a"; return 0; }
    sleep 1
  done
}
begin d_kill9
shm_segments() { tail -n +2 /proc/sysvipc/shm | wc -l; }
standby_pids() {
  for _p in /proc/[0-9]*; do
    { tr '\0' ' ' < "$_p/cmdline"; } 2>/dev/null | grep -q 'recover --wait --kee[p]' && echo "${_p#/proc/}"
  done
}
if uzram_create --size 64M; then
  check "fio write 0..16M" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=16M VONLY=0
  # The daemon saves its counts for the next one every second.
  sleep 2
  W1=$(stat_field "$DEV" write_requests)
  PID=$(daemon_pid "$DEV")
  if [ -z "$PID" ]; then
    fail_check "no process holds /dev/ublkc${DEV#/dev/ublkb} open"
  else
    timeout -s KILL "$IO_TMO" env DEV="$DEV" OFFSET=16M LEN=48M VONLY=0 fio --output-format=terse "$E2E/fio/region.fio" > /tmp/d-fio.out 2>&1 &
    FPID=$!
    sleep 1
    say "  daemon pid $PID; kill -9 during a fio write"
    t=$(up)
    kill -9 "$PID"
    wait_gone "$PID" || fail_check "daemon $PID still alive 10s after SIGKILL"
    [ -b "$DEV" ] && ok "$DEV stays after kill -9" || fail_check "$DEV is gone after kill -9"
    run_t "$TMO" /tmp/d.out uzram list; rc=$?
    sed 's/^/    | /' /tmp/d.out
    [ $rc = 0 ] && grep -q "$DEV" /tmp/d.out && grep -q "uzram recover" /tmp/d.out \
      && ok "uzram list shows $DEV waiting for recovery (${RUN_SECS}s)" \
      || fail_check "uzram list: rc=$rc, no line for $DEV waiting for recovery"
    run_t "$TMO" /tmp/d.out uzram status "$DEV"; rc=$?
    sed 's/^/    | /' /tmp/d.out | head -12
    [ $rc = 0 ] && grep -q "daemon gone" /tmp/d.out && ok "uzram status shows the daemon gone (${RUN_SECS}s)" \
      || fail_check "uzram status: rc=$rc, does not say the daemon is gone"
    kill -0 $FPID 2>/dev/null && ok "the in-flight fio waits (paused, not failed)" \
      || fail_check "the in-flight fio ended while no daemon ran: $(head -c 300 /tmp/d-fio.out)"
    check "uzram recover $DEV" uzram recover "$DEV"
    # what the new daemon took from the system between the crash and serving (its log)
    A1=$(paused_anon)
    wait $FPID; frc=$?
    say "  I/O paused for $(since "$t")s (kill -9 to the end of the in-flight fio)"
    [ $frc = 0 ] && ok "the in-flight fio finished after the recovery" \
      || { fail_check "in-flight fio rc=$frc"; sed 's/^/    | /' /tmp/d-fio.out | tail -5; }
    check "fio verify 0..16M (written before the kill)" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=16M VONLY=1
    check "fio verify 16M..64M (in flight at the kill)" fio_job region.fio DEV="$DEV" OFFSET=16M LEN=48M VONLY=1
    PID2=$(daemon_pid "$DEV")
    [ -n "$PID2" ] && [ "$PID2" != "$PID" ] && ok "new daemon $PID2 serves $DEV" || fail_check "no new daemon serves $DEV"
    # A second kill with no I/O in flight: the next daemon's count is exactly this one's.
    # Half the device discarded first, so the store holds less than its peak: the peak
    # (mem_used_max) goes on too, not from what the next daemon finds.
    check "blkdiscard 0..32M" blkdiscard -o 0 -l $((32 * 1048576)) "$DEV"
    sleep 2
    W2=$(stat_field "$DEV" write_requests)
    M2=$(stat_field "$DEV" mem_used_max)
    U2=$(stat_field "$DEV" mem_used_total)
    # This time the recovery waits, started before the kill (`uzram recover --wait`). The
    # running daemon's log goes: the only takeover line left is then the next daemon's.
    rm -f /run/uzram/*.log
    UZRAM_LOG=info timeout -s KILL "$IO_TMO" uzram recover --wait "$DEV" > /tmp/d-wait.out 2>&1 &
    RPID=$!
    sleep 1
    kill -9 "$PID2"; wait_gone "$PID2"
    wait $RPID; rc=$?
    [ $rc = 0 ] && [ -n "$(daemon_pid "$DEV")" ] && ok "uzram recover --wait, started before the kill, recovered $DEV" \
      || { fail_check "uzram recover --wait: rc=$rc, $DEV served by '$(daemon_pid "$DEV")'"; tail -5 /tmp/d-wait.out; }
    # A daemon started before the crash made its heap and I/O buffers then: in the pause it
    # takes far less memory from the system than one started after (docs/recovery.md)
    A2=$(paused_anon)
    [ -n "$A1" ] && [ -n "$A2" ] && [ $((A2 * 2)) -lt "$A1" ] \
      && ok "memory taken in the pause: $A2 KiB by the daemon started before the crash, $A1 KiB by the one started after" \
      || fail_check "memory taken in the pause: '$A2' KiB started before the crash, '$A1' KiB after (want less than half)"
    W3=$(stat_field "$DEV" write_requests)
    M3=$(stat_field "$DEV" mem_used_max)
    [ -n "$W1" ] && [ "$W1" -gt 0 ] && [ -n "$W2" ] && [ "$W2" -gt "$W1" ] && [ "$W3" = "$W2" ] \
      && ok "write_requests go on across daemons: $W1 before the first kill, $W2 before the second, $W3 after it" \
      || fail_check "write_requests did not go on across the crashes: '$W1', then '$W2', then '$W3'"
    [ -n "$M2" ] && [ -n "$U2" ] && [ "$M2" -gt "$U2" ] && [ "$M3" = "$M2" ] \
      && ok "mem_used_max goes on across daemons: $M2 before the kill (holding $U2), $M3 after it" \
      || fail_check "mem_used_max did not go on: '$M2' (holding '$U2') before the kill, '$M3' after it"
    PID3=$(daemon_pid "$DEV")
    # A third kill, and the orphan destroyed instead of recovered.
    kill -9 "$PID3"; wait_gone "$PID3"
    run_t "$TMO" /tmp/d.out uzram destroy "$DEV"; rc=$?
    [ $rc = 0 ] && ok "uzram destroy of a device whose daemon died (${RUN_SECS}s)" \
      || fail_check "uzram destroy: rc=$rc in ${RUN_SECS}s: $(tr '\n' ' ' < /tmp/d.out | head -c 300)"
    i=0; while [ -e "$DEV" ] && [ $i -lt 100 ]; do i=$((i + 1)); usleep 100000; done
    [ -e "$DEV" ] && fail_check "$DEV still present after destroy" || ok "$DEV is gone"
    n=$(shm_segments)
    [ "$n" = 0 ] && ok "its shared memory is gone" || { fail_check "$n shared memory segments left"; cat /proc/sysvipc/shm; }
    run_t "$TMO" /tmp/d.out uzram list; rc=$?
    [ $rc = 0 ] && ! grep -q ublkb /tmp/d.out && ok "uzram list shows no device" || fail_check "uzram list after destroy: rc=$rc $(head -c 200 /tmp/d.out)"
    if uzram_create --size 16M; then
      check "fio on a device created after the crash" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=8M VONLY=0
      # a waiting recovery whose device is destroyed instead recovers nothing, and says so
      UZRAM_LOG=info timeout -s KILL "$TMO" uzram recover --wait "$DEV" > /tmp/d-wait.out 2>&1 &
      RPID=$!
      sleep 1
      uzram_destroy "$DEV"
      wait $RPID; rc=$?
      [ $rc = 0 ] && grep -q "nothing to recover" /tmp/d-wait.out && ok "uzram recover --wait exits 0 when its device is destroyed" \
        || { fail_check "uzram recover --wait on a destroyed device: rc=$rc"; tail -5 /tmp/d-wait.out; }
    fi
    # A device made as a user makes it (with its standby, the default) recovers by itself,
    # crash after crash, and its standby ends with it. The second crash is a signal that dumps
    # core, its daemon allowed a core of any size: the daemon forbids dumps (its memory is
    # everyone's swap), so none is written and the standby takes over as after a kill -9.
    CORE_PATTERN=$(cat /proc/sys/kernel/core_pattern)
    mkdir -p /tmp/cores && rm -f /tmp/cores/*
    echo '/tmp/cores/core.%e.%p' > /proc/sys/kernel/core_pattern
    ulimit -c unlimited
    if uzram_create --default --size 16M; then
      check "fio write 0..8M (standby device)" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=8M VONLY=0
      for n in 1 2; do
        P=$(daemon_pid "$DEV")
        t=$(up)
        sig=KILL; [ $n = 2 ] && sig=ABRT
        kill -s $sig "$P"; wait_gone "$P"
        i=0
        while N=$(daemon_pid "$DEV"); { [ -z "$N" ] || [ "$N" = "$P" ]; } && [ $i -lt 200 ]; do
          i=$((i + 1)); usleep 50000
        done
        [ -n "$N" ] && [ "$N" != "$P" ] && ok "crash $n: the standby started a new daemon ($N) $(since "$t") s after the kill" \
          || fail_check "crash $n: no new daemon for $DEV 10 s after the kill"
        # returns once the device serves again
        check "crash $n: fio verify 0..8M" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=8M VONLY=1
        say "  crash $n: served and verified $(since "$t") s after the kill (SIG$sig)"
      done
      _c=$(ls /tmp/cores)
      [ -z "$_c" ] && ok "SIGABRT, with cores allowed, left no core file of the daemon" \
        || fail_check "the daemon dumped core: $(ls -l /tmp/cores | tail -n +2 | tr -s ' ' | head -c 200)"
      SB=$(standby_pids)
      [ -n "$SB" ] && ok "its standby waits (pid $SB)" || fail_check "no uzram recover --wait --keep process"
      uzram_destroy "$DEV"
      i=0; while [ -n "$(standby_pids)" ] && [ $i -lt 100 ]; do i=$((i + 1)); usleep 100000; done
      [ -z "$(standby_pids)" ] && ok "the standby ended with its device" \
        || fail_check "a standby still runs 10 s after its device was destroyed: $(standby_pids)"
      # its waiting daemon gave the room back when the daemon went, holding the per-CPU free
      # lists short for it; with the device gone it puts the kernel's default back (a
      # setting the boot made is left alone)
      _f=$(cat /proc/sys/vm/percpu_pagelist_high_fraction)
      _f0=$(pcp_fraction_boot)
      [ "$_f" = "$_f0" ] && ok "per-CPU free lists at the boot's setting ($_f0) after the destroy" \
        || fail_check "vm.percpu_pagelist_high_fraction is $_f after the destroy, not $_f0"
      dmesg | grep -a 'uzram::cmd::recover' | tail -3 | sed 's/^/    kmsg| /'
    fi
    ulimit -c 0
    echo "$CORE_PATTERN" > /proc/sys/kernel/core_pattern
    rm -rf /tmp/cores
  fi
  dmesg | grep -i ublk | tail -8 | sed 's/^/    dmesg| /'
fi
end

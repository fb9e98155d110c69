# Scenario r: daemon crashes under swap. A hog of >= 2x the memory available (with the daemon
# running) goes through swap on the device; its daemon is killed (-9) twice and `uzram recover
# --wait`, started before each kill, starts a new one each time:
#   1. while the hog still fills, once a quarter of it went out to swap (kill during writes);
#   2. in the hog's verification pass, once a third of it came back in.
# Every word must verify, the hog must live, and the kernel must log no I/O error for the
# device. The I/O pause of each crash is printed (crashkill -p): from the kill until the device
# completed a request again, and until a read of it issued once the killed daemon was gone
# completed; and when `uzram recover` returned, which is later: the new daemon publishes its
# records after it serves.
# The kill and the recovery are run by crashkill, started before the kill and locked in memory:
# this shell's own pages may be in swap on the device, and it would wait for them with
# everything else (see tests/e2e/hog/crashkill.c). The recovery is started before the kill
# too, for the same reason: a process started after it needs free pages to start at all, and
# a crash under this load may leave none (seen on 7.3: docs/recovery.md).
. /e2e/lib.sh
begin r_recover
swap_errors() { dmesg | grep -ciE 'error.*ublkb|ublkb.*error|swap-device'; }
# crash WHAT COUNTER DELTA: kill the device's daemon once /proc/vmstat COUNTER grew by DELTA
# pages (from now), then `uzram recover`; checks the result. Runs in the background until
# `crash_done`.
crash() {
  CW=$1
  # (to the console: a file's new page would need memory, which is what may have run out)
  # (UZRAM_LOG=info: `uzram recover` prints where its part of the pause went)
  UZRAM_LOG=info timeout -s KILL "$IO_TMO" crashkill -p "$DEV" "$2" "$3" "$(daemon_pid "$DEV")" -1 uzram recover --wait "$DEV" > /dev/console 2>&1 &
  CPID=$!
}
crash_done() {
  wait $CPID
  _rc=$?
  [ $_rc = 0 ] && ok "$CW: killed, recovered (crashkill's line above has the pause)" \
    || { fail_check "$CW: crashkill/uzram recover rc=$_rc"; tail -n 20 /run/uzram/*.log; }
  # the new daemon's own account of the pause, step by step (ms); its log is written by a
  # thread of its own, so the line may come a moment after `uzram recover` returned
  for _i in 1 2 3 4 5; do
    _p=$(cat /run/uzram/*.log | tr -d '\033' | sed 's/\[[0-9;]*m//g' | grep -a 'paused_ms=' | tail -1 | grep -o 'paused_ms=.*')
    # (the last crash's daemon's log is replaced by the new one's after its report)
    [ -n "$_p" ] && [ "$_p" != "${PREV_P:-}" ] && break
    sleep 1
  done
  say "  $CW: daemon: ${_p:-no paused_ms line in /run/uzram/*.log}"
  # a killed daemon slow to exit: its room given back once its first thread was gone
  _d=$(cat /run/uzram/*.log | tr -d '\033' | sed 's/\[[0-9;]*m//g' | grep -a 'first thread is gone' | tail -1)
  [ -z "$_d" ] || say "  $CW: ${_d#*INFO }"
  # the recovery held the per-CPU free lists short to give its room back; the new daemon
  # puts the kernel's default back once it serves (memory/free_lists.rs), and a setting the
  # boot made is left alone
  _f0=$(pcp_fraction_boot)
  _f=$(pcp_fraction_settles "$_f0") && ok "$CW: per-CPU free lists back to the boot's setting ($_f0)" \
    || fail_check "$CW: vm.percpu_pagelist_high_fraction is $_f after the recovery, not $_f0"
  # the takeover ran realtime (memory/realtime.rs) and put every thread back once it served
  case "$_p" in
    "${PREV_P:-}") fail_check "$CW: the new daemon's serving line never came" ;;
    *realtime=true*) ok "$CW: the takeover ran at realtime priority" ;;
    *) fail_check "$CW: the takeover did not run at realtime priority (${_p%% steps=*})" ;;
  esac
  PREV_P=$_p
  _dp=$(daemon_pid "$DEV")
  _pol=$(for _s in /proc/"$_dp"/task/*/stat; do sed 's/.*) //' "$_s" | cut -d' ' -f39; done)
  _rt=$(printf '%s\n' "$_pol" | grep -c '^[1-9]')
  if [ -z "$_dp" ] || [ -z "$_pol" ]; then fail_check "$CW: no threads of the new daemon to look at"
  elif [ "$_rt" = 0 ]; then ok "$CW: no thread of the new daemon is left realtime ($(printf '%s\n' "$_pol" | wc -l) threads)"
  else fail_check "$CW: $_rt threads of the new daemon still realtime (scheduling policy not 0)"; fi
  # its direct writes to stdout and stderr (libublk's eprintln!, a panic message) go through
  # a pipe into its lossy log queue, not to the log file on tmpfs, whose page may be in swap
  # on the device it takes over (a takeover once hung there: src/stdio_route.rs)
  _o="$(readlink /proc/"$_dp"/fd/1) $(readlink /proc/"$_dp"/fd/2)"
  case "$_o" in
    "pipe:"*" pipe:"*) ok "$CW: the new daemon's stdout and stderr go through its log queue ($_o)" ;;
    *) fail_check "$CW: the new daemon's stdout and stderr are '$_o', not its log queue's pipe" ;;
  esac
  # what the new daemon allocated to start (the recovery room must cover it: docs/recovery.md)
  say "  $CW: new daemon's memory: $(grep -E '^(RssAnon|VmLck|VmPTE)' "/proc/$_dp/status" | tr -s ' \t\n' ' ')"
  kill -0 $HPID 2>/dev/null && ok "$CW: the hog is alive" \
    || { say "  $CW: the hog is no longer running"; dmesg | grep -iE 'out of memory|oom-kill|killed process' | tail -3 | sed 's/^/    dmesg| /'; }
  say "  $CW: $(tail -1 /tmp/hog.out)"
}
if hog_swap_device; then
  e0=$(swap_errors)
  PAGES=$((HOG * 256))
  # if the hog makes no progress for WATCH s, print the daemon's threads and blocked tasks
  hangwatch "${UZ_hangwatch_secs:-400}" uzram &
  WPID=$!
  : > /tmp/hog.out
  crash "kill during the fill" pswpout $((PAGES / 4))
  timeout -s KILL "$IO_TMO" hog "$HOG" 1 2 > /tmp/hog.out 2>&1 &
  HPID=$!
  crash_done
  wait_holding $HPID /tmp/hog.out
  crash "kill during verification" pswpin $((PAGES / 3))
  crash_done
  wait $HPID
  hrc=$?
  kill $WPID 2>/dev/null
  sed 's/^/    | /' /tmp/hog.out
  [ $hrc = 0 ] && ok "hog: every word verified across both crashes" || fail_check "hog rc=$hrc"
  grep -q ' 0 bad words' /tmp/hog.out || fail_check "hog reported bad words"
  e1=$(swap_errors)
  [ "$e1" = "$e0" ] && ok "no I/O error for the device in the kernel log" \
    || { fail_check "$((e1 - e0)) new kernel log lines about the device"; dmesg | grep -iE 'error.*ublkb|ublkb.*error|swap-device' | tail -5; }
  timeout -s KILL "$TMO" uzram status "$DEV" | grep -E 'pid|queue_mode|pages_stored|failed' | sed 's/^/    | /'
  check "swapoff" swapoff "$DEV"
  uzram_destroy "$DEV"
fi
end

# Scenario d: kill -9 of a daemon. Nothing may hang: I/O to the orphaned device, `uzram list`,
# `uzram status` and `uzram destroy` must all return within their time limits. What the device
# does afterwards (I/O errors? still present? cleaned up by destroy?) is printed as OBSERVED lines.
. /e2e/lib.sh
begin d_kill9
if uzram_create --size 64M; then
  check "fio write 0..16M" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=16M VONLY=0
  PID=$(daemon_pid "$DEV")
  if [ -z "$PID" ]; then
    fail_check "no process holds /dev/ublkc${DEV#/dev/ublkb} open"
  else
    # I/O in flight when the daemon dies: it must end (with errors) within its time limit
    timeout -s KILL 60 env DEV="$DEV" OFFSET=16M LEN=48M VONLY=0 fio --output-format=terse "$E2E/fio/region.fio" > /tmp/d-fio.out 2>&1 &
    FPID=$!
    sleep 1
    say "  daemon pid $PID ($(tr '\0' ' ' < /proc/$PID/cmdline)); kill -9 during a fio write"
    t=$(up)
    kill -9 "$PID"
    wait $FPID; frc=$?
    say "  OBSERVED in-flight fio after kill: rc=$frc, ended $(since "$t")s after the kill: $(grep -m1 -iE 'error|err=' /tmp/d-fio.out | head -c 200)"
    [ $frc -ge 124 ] && fail_check "in-flight I/O hung (fio killed by its 60 s limit)"
    i=0
    while kill -0 "$PID" 2>/dev/null && [ $i -lt 100 ]; do i=$((i + 1)); usleep 100000; done
    kill -0 "$PID" 2>/dev/null && fail_check "daemon $PID still alive 10s after SIGKILL"
    # dd on a vanished node would create a regular file in /dev: test -b first
    i=0
    while [ -b "$DEV" ] && [ $i -lt 20 ]; do
      run_t 30 /tmp/d.out dd if="$DEV" of=/dev/null bs=4k count=1 iflag=direct; rc=$?
      say "  OBSERVED direct read after kill: rc=$rc in ${RUN_SECS}s: $(tr '\n' ' ' < /tmp/d.out | head -c 200)"
      [ $rc -ge 124 ] && { fail_check "read hung"; break; }
      run_t 30 /tmp/d.out dd if=/dev/zero of="$DEV" bs=4k count=1 oflag=direct conv=notrunc; rc=$?
      say "  OBSERVED direct write after kill: rc=$rc in ${RUN_SECS}s: $(tr '\n' ' ' < /tmp/d.out | head -c 200)"
      [ $rc -ge 124 ] && { fail_check "write hung"; break; }
      i=$((i + 1)); usleep 250000
    done
    say "  OBSERVED block device after kill: $([ -b "$DEV" ] && echo present || echo gone); char: $(ls /dev/ublkc* 2>&1 | tr '\n' ' '); /sys/block: $(ls /sys/block | tr '\n' ' '); ublk-char: $(ls /sys/class/ublk-char 2>/dev/null | tr '\n' ' ')"
    run_t "$TMO" /tmp/d.out uzram list; rc=$?
    say "  OBSERVED uzram list: rc=$rc in ${RUN_SECS}s"; sed 's/^/    | /' /tmp/d.out
    [ $rc -ge 124 ] && fail_check "uzram list hung"
    run_t "$TMO" /tmp/d.out uzram status "$DEV"; rc=$?
    say "  OBSERVED uzram status: rc=$rc in ${RUN_SECS}s: $(tr '\n' ' ' < /tmp/d.out | head -c 300)"
    [ $rc -ge 124 ] && fail_check "uzram status hung"
    run_t "$TMO" /tmp/d.out uzram destroy "$DEV"; rc=$?
    say "  OBSERVED uzram destroy: rc=$rc in ${RUN_SECS}s: $(tr '\n' ' ' < /tmp/d.out | head -c 300)"
    [ $rc -ge 124 ] && fail_check "uzram destroy hung"
    sleep 1
    say "  OBSERVED after destroy: block device $([ -b "$DEV" ] && echo present || echo gone); char: $(ls /dev/ublkc* 2>&1 | tr '\n' ' '); ublk-char: $(ls /sys/class/ublk-char 2>/dev/null | tr '\n' ' ')"
    [ -e "$DEV" ] && [ ! -b "$DEV" ] && { fail_check "$DEV is not a block device"; rm -f "$DEV"; }
    run_t "$TMO" /tmp/d.out uzram list; rc=$?
    say "  OBSERVED uzram list after destroy: rc=$rc"; sed 's/^/    | /' /tmp/d.out
    [ $rc -ge 124 ] && fail_check "uzram list hung"
    # a new device must still be creatable after the crash
    if uzram_create --size 16M; then
      check "fio on a device created after the crash" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=8M VONLY=0
      uzram_destroy "$DEV"
    fi
  fi
  dmesg | grep -i ublk | tail -8 | sed 's/^/    dmesg| /'
fi
end

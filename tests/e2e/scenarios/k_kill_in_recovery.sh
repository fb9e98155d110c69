# Scenario k: a crash during a recovery. A daemon is killed (-9), and the daemon that
# `uzram recover` starts is killed too, in the middle of its takeover: after it sent
# START_USER_RECOVERY, before its queues serve (tests/e2e/hog/recoverkill.c kills it the
# moment it holds /dev/ublkcN open). A second `uzram recover` must bring the device back with
# every byte written before the first kill. Run on 7.x only: 6.12 refuses any recovery after
# such a kill (its START_USER_RECOVERY needs a ready queue, and the interrupted recovery had
# reset them all; docs/recovery.md, gaps), so there the device is lost.
. /e2e/lib.sh
begin k_kill_in_recovery
if uzram_create --size 64M; then
  C=/dev/ublkc${DEV#/dev/ublkb}
  dd if=/dev/urandom of=/tmp/k.dat bs=1M count=16 2>/dev/null
  check "write 16 MiB of random data" dd if=/tmp/k.dat of="$DEV" bs=1M oflag=direct
  # The kill must land inside the recovery: if the new daemon served first (recoverkill
  # looks every 0.5 ms), the device is recovered as usual and the kill is tried again.
  hit=0
  for attempt in 1 2 3; do
    PID=$(daemon_pid "$DEV")
    [ -n "$PID" ] || { fail_check "no daemon holds $C"; break; }
    recoverkill "$C" > /tmp/k-rk.out 2>&1 &
    RK=$!
    kill -9 "$PID"
    wait_gone "$PID" || { fail_check "daemon $PID still alive 10 s after SIGKILL"; break; }
    timeout -s KILL "$TMO" uzram recover "$DEV" > /tmp/k1.out 2>&1
    rc=$?
    if [ $rc != 0 ]; then
      wait $RK
      say "  attempt $attempt: $(cat /tmp/k-rk.out); the interrupted uzram recover failed (rc=$rc): $(grep -a 'rror' /tmp/k1.out | tail -1 | cut -c1-240)"
      hit=1
      break
    fi
    sleep 1
    kill $RK 2>/dev/null
    wait $RK
    say "  attempt $attempt: the recovery served before the kill ($(cat /tmp/k-rk.out | tr '\n' ' '))"
    # killed just after it served: a plain crash, recovered the usual way
    _p=$(daemon_pid "$DEV") || { _p=; }
    [ -n "$_p" ] || check "uzram recover after the late kill" uzram recover "$DEV"
  done
  if [ $hit = 1 ]; then
    run_t "$TMO" /tmp/k.out uzram status "$DEV"; rc=$?
    [ $rc = 0 ] && grep -q "daemon gone" /tmp/k.out && ok "uzram status shows the daemon gone after the interrupted recovery" \
      || fail_check "uzram status: rc=$rc, does not say the daemon is gone: $(head -c 300 /tmp/k.out)"
    if check "uzram recover $DEV (after the interrupted one)" uzram recover "$DEV"; then
      dd if="$DEV" of=/tmp/k.back bs=1M count=16 iflag=direct 2>/dev/null
      cmp -s /tmp/k.dat /tmp/k.back && ok "every byte written before the first kill reads back" \
        || fail_check "the device's first 16 MiB differ from what was written"
    fi
  else
    fail_check "no kill landed inside a recovery in 3 attempts"
  fi
  uzram_destroy "$DEV"
fi
end

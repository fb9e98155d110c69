# Scenario u: ublk's user copy (--user-copy on, UBLK_F_USER_COPY): the kernel copies a
# request's data only when the daemon asks (pread/pwrite on /dev/ublkcN). The GPU backend
# takes it by default, and no guest has a GPU, so here the CPU backend runs every path it
# changes: writes (through the bounce buffer), reads handed back with pwrite, reads of
# written-back pages finished on the queue's ring and then handed back, and a daemon killed
# mid-write whose successor must serve the device the way it was made. On 7.3 it also shows
# that user copy moves `auto` off batch mode (which cannot have it).
. /e2e/lib.sh
begin u_user_copy
# this scenario's queue mode is its own, whatever the boot expects of the others
# shellcheck disable=SC2034 # read by uzram_create (lib.sh)
UZ_expect_queue_mode=
WB=$(scratch_disk)
SRC=/tmp/u.src
programs_source "$SRC" 8388608
wb_args=
[ -n "$WB" ] && [ -b "$WB" ] && wb_args="--writeback-device $WB"
# shellcheck disable=SC2086 # wb_args is two words or none
if uzram_create --size 96M --user-copy on $wb_args; then
  uc=$(stat_field "$DEV" queue_user_copy); m=$(status_str "$DEV" queue_mode)
  [ "$uc" = 1 ] && ok "queue_user_copy 1 (queue_mode $m)" || fail_check "queue_user_copy '$uc' with --user-copy on"
  if kernel_has_batch_io; then
    [ "$m" != batch ] && ok "user copy took auto off batch ($m)" || fail_check "queue_mode batch with user copy"
  fi
  if fio_job verify.fio DEV="$DEV" SIZE=32M > /dev/null; then
    ok "fio verify.fio (32M, 4k/64k/mixed sizes, trims) with user copy (${RUN_SECS}s)"
  else
    fail_check "fio verify.fio with user copy: rc=$? after ${RUN_SECS}s"; tail -20 /tmp/fio.out
  fi
  if [ -n "$wb_args" ] && [ "$MIB" -ge 4 ]; then
    # at 64 MiB, past what fio wrote
    check "write $MIB MiB of programs at 64 MiB (direct)" dd if="$SRC" of="$DEV" bs=1M count="$MIB" seek=64 oflag=direct
    run_t "$TMO" /tmp/u.out uzram idle "$DEV" --all
    run_t 300 /tmp/u.out uzram writeback "$DEV" --type idle --json
    say "    | $(cat /tmp/u.out)"
    bd=$(stat_field "$DEV" bd_count)
    [ "${bd:-0}" -gt 0 ] && ok "bd_count $bd written back" || fail_check "nothing written back: $(cat /tmp/u.out)"
    r0=$(stat_field "$DEV" bd_reads)
    got=$(dd if="$DEV" bs=1M skip=64 count="$MIB" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    r1=$(stat_field "$DEV" bd_reads)
    [ "$got" = "$WANT" ] && [ "${r1:-0}" -gt "${r0:-0}" ] \
      && ok "written-back pages read back through the disk and pwrite: sha256 right, bd_reads $r0 -> $r1" \
      || fail_check "read back of written-back pages: sha256 $got (want $WANT), bd_reads $r0 -> $r1"
  else
    say "  no blank scratch disk or too few programs: the written-back read path is left out"
  fi
  # kill -9 mid-write: the new daemon serves the device with user copy (its flags are the
  # device's), and every byte written before and during the kill verifies
  P=$(daemon_pid "$DEV")
  timeout -s KILL "$IO_TMO" env DEV="$DEV" OFFSET=32M LEN=32M VONLY=0 fio --output-format=terse "$E2E/fio/region.fio" > /tmp/u-fio.out 2>&1 &
  F=$!
  sleep 1
  kill -9 "$P"; wait_gone "$P" || fail_check "daemon $P still alive 10s after SIGKILL"
  check "uzram recover $DEV" uzram recover "$DEV"
  wait $F; frc=$?
  [ $frc = 0 ] && ok "the fio in flight at the kill finished after the recovery" \
    || { fail_check "in-flight fio rc=$frc"; tail -5 /tmp/u-fio.out; }
  check "fio verify 32M..64M (in flight at the kill)" fio_job region.fio DEV="$DEV" OFFSET=32M LEN=32M VONLY=1
  uc=$(stat_field "$DEV" queue_user_copy)
  [ "$uc" = 1 ] && ok "the recovered daemon serves with user copy too" || fail_check "queue_user_copy '$uc' after the recovery"
  if [ -n "$wb_args" ] && [ "$MIB" -ge 4 ]; then
    got=$(dd if="$DEV" bs=1M skip=64 count="$MIB" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
    [ "$got" = "$WANT" ] && ok "the programs read back after the recovery" || fail_check "after the recovery sha256 $got, want $WANT"
  fi
  timeout -s KILL "$TMO" uzram status "$DEV" | grep -E 'queue_|bd_|failed' | sed 's/^/    | /'
  uzram_destroy "$DEV"
fi
# what cannot be had is refused, with the reason
if kernel_has_batch_io; then
  expect_refused "user copy with batch mode" "batch" uzram create --size 16M --no-standby --user-copy on --queue-mode batch
fi
expect_refused "an unknown user-copy value" "auto, on or off" uzram create --size 16M --no-standby --user-copy sometimes
end

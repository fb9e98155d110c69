# Scenario a: create -> fio crc32c verify (random writes with interleaved verify reads, 4k, 64k,
# mixed sizes, trim-then-write) -> the same with the daemon stopped and continued -> discard a
# range, it reads back as zeros and the data around it still verifies -> destroy; its queue
# threads pinned to their queues' CPUs, and with `--queue-affinity any` on any CPU; a link
# planted in libublk's run directory, not followed.
. /e2e/lib.sh
begin a_fio_verify
SIZE_MIB=${UZ_fio_dev_mib:-256}
JOB_MIB=${UZ_fio_job_mib:-64}
if uzram_create --size "${SIZE_MIB}M"; then
  bytes=$(blockdev --getsize64 "$DEV")
  [ "$bytes" = $((SIZE_MIB * 1048576)) ] && ok "size $bytes bytes" || fail_check "size $bytes, expected $((SIZE_MIB * 1048576))"
  q_=/sys/block/${DEV#/dev/}/queue
  lb=$(cat "$q_/logical_block_size"); pb=$(cat "$q_/physical_block_size")
  [ "$lb" = 4096 ] && [ "$pb" = 4096 ] && ok "4096-byte logical/physical blocks" || fail_check "block sizes logical=$lb physical=$pb, want 4096"
  # Where the queue threads run: libublk pins each to the CPUs the kernel maps to its queue
  # (as many queues as CPUs here: one each), and the cpu backend keeps that
  # (`queue-affinity = auto`); `uzram bench` pins its stand-ins the same way.
  nq=$(stat_field "$DEV" queues); per=$(stat_field "$DEV" io_threads_per_queue)
  if [ "$(nproc)" -ge 2 ] && [ "${nq:-0}" = "$(nproc)" ] && [ -n "$per" ]; then
    got=$(single_cpu_threads "$(daemon_pid "$DEV")")
    [ "$got" = $((nq * per)) ] && ok "$got queue threads, each pinned to its queue's CPU ($nq queues, $per threads each)" \
      || fail_check "$got threads pinned to one CPU, want $((nq * per)) ($nq queues x $per threads)"
  else
    say "  (queue pinning not checked: $(nproc) CPUs, ${nq:-?} queues)"
  fi
  if fio_job verify.fio DEV="$DEV" SIZE="${JOB_MIB}M" > /dev/null; then
    ok "fio verify.fio on $DEV (${RUN_SECS}s): $(awk -F';' '{printf "%s ", $3}' /tmp/fio.out)"
  else
    fail_check "fio verify.fio rc=$? after ${RUN_SECS}s"; tail -30 /tmp/fio.out
  fi
  # A daemon stopped and continued (kill -STOP, a debugger attaching) serves on: each stop cuts
  # its queues' waits in io_uring_enter short (EINTR), which once ended every per-request
  # queue thread (the daemon then deleted the device) and made a batch queue stop it.
  P=$(daemon_pid "$DEV")
  fio_job verify.fio DEV="$DEV" SIZE=32M > /dev/null & F=$!
  n=0
  while kill -0 $F 2>/dev/null && [ $n -lt 100 ]; do
    kill -STOP "$P"; usleep 20000; kill -CONT "$P"; usleep 30000; n=$((n + 1))
  done
  wait $F; frc=$?
  [ $frc = 0 ] && [ $n -ge 5 ] && [ "$(daemon_pid "$DEV")" = "$P" ] \
    && ok "fio verify.fio (32M) with the daemon $P stopped and continued $n times" \
    || fail_check "fio verify.fio with the daemon stopped and continued $n times: rc=$frc, $DEV served by '$(daemon_pid "$DEV")' (was $P)"
  half=$((SIZE_MIB / 2)); q=$((SIZE_MIB / 8))
  check "fio write 0..${half}M" fio_job region.fio DEV="$DEV" OFFSET=0 LEN="${half}M" VONLY=0
  before=$(stat_field "$DEV" orig_data_size)
  check "blkdiscard ${q}M..$((2 * q))M" blkdiscard -o $((q * 1048576)) -l $((q * 1048576)) "$DEV"
  after=$(stat_field "$DEV" orig_data_size)
  say "  orig_data_size before/after discard: $before / $after"
  if [ -n "$before" ] && [ -n "$after" ] && [ "$after" -lt "$before" ]; then ok "discard freed data"; else fail_check "orig_data_size did not drop after discard ($before -> $after)"; fi
  zero=$(dd if=/dev/zero bs=1M count=$q 2>/dev/null | md5sum | cut -c1-32)
  got=$(timeout -s KILL "$IO_TMO" dd if="$DEV" bs=1M skip=$q count=$q iflag=direct 2>/dev/null | md5sum | cut -c1-32)
  [ "$got" = "$zero" ] && ok "discarded range reads zeros" || fail_check "discarded range does not read back as zeros"
  check "fio verify 0..${q}M after discard" fio_job region.fio DEV="$DEV" OFFSET=0 LEN="${q}M" VONLY=1
  check "fio verify $((2 * q))M..${half}M after discard" fio_job region.fio DEV="$DEV" OFFSET="$((2 * q))M" LEN="$((half - 2 * q))M" VONLY=1
  timeout -s KILL "$TMO" uzram status "$DEV" | sed 's/^/    | /'
  uzram_destroy "$DEV"
fi
# `queue-affinity = any` (the gpu backend's `auto`): once libublk pinned them, the daemon lets
# its queue threads run on any of its CPUs, and the device serves as before.
if [ "$(nproc)" -ge 2 ] && uzram_create --size 32M --queue-affinity any; then
  got=$(single_cpu_threads "$(daemon_pid "$DEV")")
  [ "$got" = 0 ] && ok "--queue-affinity any: no thread pinned to one CPU" \
    || fail_check "--queue-affinity any: $got threads still pinned to one CPU"
  check "fio write 0..16M (queue threads anywhere)" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=16M VONLY=0
  check "fio verify 0..16M (queue threads anywhere)" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=16M VONLY=1
  uzram_destroy "$DEV"
fi
# libublk makes /run/ublksrvd 0777 where it finds none and writes a device's JSON file there
# through whatever is at its name: a link planted as 0009.json would have root's file
# truncated and overwritten. The daemon makes the directory root's alone first.
mkdir -p /run/ublksrvd && chmod 0777 /run/ublksrvd
echo "root's own file" > /tmp/victim
ln -sf /tmp/victim /run/ublksrvd/0009.json
if uzram_create --size 16M --id 9; then
  [ "$(cat /tmp/victim)" = "root's own file" ] && ok "a link planted at libublk's file name: its target untouched" \
    || fail_check "the file behind a link planted at /run/ublksrvd/0009.json was overwritten: $(head -c 200 /tmp/victim)"
  mode=$(stat -c %a /run/ublksrvd)
  [ "$mode" = 700 ] && [ -f /run/ublksrvd/0009.json ] && [ ! -L /run/ublksrvd/0009.json ] \
    && ok "/run/ublksrvd made root's alone (700), the device's file a plain one" \
    || fail_check "/run/ublksrvd mode $mode, 0009.json: $(ls -l /run/ublksrvd/0009.json 2>&1)"
  uzram_destroy "$DEV"
fi
rm -f /tmp/victim
end

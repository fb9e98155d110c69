# Scenario q: a crash with a saturated queue, the case that left a device paused for good in a
# CI run (docs/recovery.md, Gaps). A server killed while it held every request of a queue
# leaves no fetch command for io_uring to cancel, and 6.12 learns of the death only when one
# of those requests times out (the disk's io_timeout); until then the device stays LIVE and
# no recovery can start. uzram sets io_timeout to 1000 ms (crates/uzram/src/ublk/tuning.rs,
# checked in the systemd test). Here ublk_null --hold (a device made for user recovery, as
# uzram's are, whose queue takes requests and completes none) holds all 4 requests of its one
# queue when it is killed: with the 1000 ms timeout the kernel must quiesce the device within
# 5 s; with the kernel's default 30 s the time is printed (6.12: about 30 s; newer kernels see
# the exit at once). Each device is deleted after, which fails the held reads.
. /e2e/lib.sh
begin q_quiesce_saturated
DEPTH=4
# held_kill TIMEOUT_MS: a held device with that io_timeout, DEPTH+2 readers, kill -9 of the
# server once the queue is full; sets QMS (kill to QUIESCED, ms; empty if not in 60 s)
held_kill() {
  QMS=
  ublk_null --hold --queues 1 --depth $DEPTH --size-mib 64 > /tmp/qnull.out 2>&1 &
  _np=$!
  _dev=
  for _i in $(seq 100); do
    _dev=$(grep -m1 '^/dev/ublkb' /tmp/qnull.out || true)
    [ -n "$_dev" ] && [ -b "$_dev" ] && break
    _dev=; usleep 100000
  done
  if [ -z "$_dev" ]; then
    fail_check "ublk_null --hold did not start: $(head -c 300 /tmp/qnull.out | tr '\n' ' ')"
    kill -KILL $_np 2>/dev/null; return 1
  fi
  _id=${_dev#/dev/ublkb}
  # before any request starts: a request's timer is armed with the timeout it started under
  echo "$1" > "/sys/block/ublkb$_id/queue/io_timeout"
  _rd=
  for _i in $(seq $((DEPTH + 2))); do
    dd if="$_dev" of=/dev/null bs=4096 count=1 skip=$((_i * 256)) iflag=direct 2>/dev/null &
    _rd="$_rd $!"
  done
  # the queue is full once DEPTH reads are in flight; then a moment for the server to take
  # them (their completions reach its thread as it waits)
  _i=0
  while [ "$(awk '{print $1}' "/sys/block/ublkb$_id/inflight")" -lt $DEPTH ] && [ $_i -lt 100 ]; do
    _i=$((_i + 1)); usleep 100000
  done
  sleep 1
  _infl=$(awk '{print $1}' "/sys/block/ublkb$_id/inflight")
  [ "$(ublk_null --state "$_id")" = LIVE ] || fail_check "$_dev is not LIVE before the kill"
  _t=$(up)
  kill -KILL $_np
  _i=0
  while [ $_i -lt 600 ]; do
    if [ "$(ublk_null --state "$_id" 2>/dev/null)" = QUIESCED ]; then
      QMS=$(awk -v a="$_t" -v b="$(up)" 'BEGIN{printf "%d", (b-a)*1000}'); break
    fi
    _i=$((_i + 1)); usleep 100000
  done
  say "  io_timeout $1 ms, $_infl reads in flight at the kill: QUIESCED ${QMS:-not within 60 s} ${QMS:+ms after it}"
  wait $_np 2>/dev/null
  run_t "$TMO" /tmp/qdel.out ublk_null --delete "$_id" \
    || fail_check "ublk_null --delete $_id: $(head -c 300 /tmp/qdel.out | tr '\n' ' ')"
  for _p in $_rd; do wait "$_p" 2>/dev/null; done
  [ -e "$_dev" ] && fail_check "$_dev still there after its deletion"
  return 0
}
held_kill 1000
if [ -n "$QMS" ] && [ "$QMS" -le 5000 ]; then
  ok "with io_timeout 1000 ms a crash with a full queue lets the device quiesce in $QMS ms"
else
  fail_check "with io_timeout 1000 ms the device quiesced ${QMS:+after $QMS ms}${QMS:-not within 60 s} (want <= 5000 ms)"
fi
held_kill 30000
if [ -n "$QMS" ]; then
  ok "with the kernel's default io_timeout (30 s) the same crash quiesced in $QMS ms ($(uname -r))"
else
  fail_check "with the kernel's default io_timeout the device did not quiesce within 60 s"
fi
end

# Scenario b: uzram as swap under memory pressure. A hog of >= 2x the guest's available memory,
# filled with non-zero compressible pages, every word verified; `uzram status` must show
# compressed data (0 < compr_data_size < orig_data_size) while the hog's pages are swapped out.
. /e2e/lib.sh
begin b_swap
if hog_swap_device; then
  cat /proc/swaps
  out0=$(awk '/pswpout/{print $2}' /proc/vmstat)
  t0=$(up)
  # if the hog makes no progress for WATCH s, print the daemon's threads and blocked tasks
  hangwatch "${UZ_hangwatch_secs:-400}" uzram &
  WPID=$!
  # hog: fill, hold 5 s (status is read then, with the pages in swap), verify every word
  : > /tmp/hog.out
  timeout -s KILL "$IO_TMO" hog "$HOG" 1 5 > /tmp/hog.out 2>&1 &
  HPID=$!
  wait_holding $HPID /tmp/hog.out
  orig=$(stat_field "$DEV" orig_data_size)
  compr=$(stat_field "$DEV" compr_data_size)
  say "  while swapped out: orig_data_size=$orig compr_data_size=$compr"
  if [ -n "$orig" ] && [ -n "$compr" ] && [ "$compr" -gt 0 ] && [ "$compr" -lt "$orig" ]; then
    ok "compressed: ratio $(awk -v o="$orig" -v c="$compr" 'BEGIN{printf "%.2f", o/c}')"
  else
    fail_check "status does not show compressed data (orig=$orig compr=$compr)"
  fi
  timeout -s KILL "$TMO" uzram status "$DEV" | sed 's/^/    | /'
  wait $HPID
  hrc=$?
  kill $WPID 2>/dev/null
  sed 's/^/    | /' /tmp/hog.out
  out1=$(awk '/pswpout/{print $2}' /proc/vmstat)
  say "  hog wall time $(since "$t0")s, pswpout +$((out1 - out0)) pages, pswpin $(awk '/pswpin/{print $2}' /proc/vmstat)"
  # direct reclaim (the hog's own allocations waiting on reclaim): where an OOM kill comes from
  say "  $(grep -E '^(allocstall_dma32|allocstall_normal|pgscan_direct|pgsteal_direct|pgscan_kswapd|oom_kill) ' /proc/vmstat | tr '\n' ' ')"
  [ $hrc = 0 ] && ok "hog: every word verified" || fail_check "hog rc=$hrc"
  grep -q ' 0 bad words' /tmp/hog.out || fail_check "hog reported bad words"
  [ $((out1 - out0)) -gt $((AVAIL * 256 / 2)) ] && ok "swapped out $(((out1 - out0) / 256)) MiB" \
    || fail_check "only $(((out1 - out0) / 256)) MiB swapped out; no real memory pressure"
  # A queue thread that faults in a new page under pressure can deadlock the device (daemon's
  # fault_guard), so its memory is populated before serving. Compaction may still migrate
  # locked pages, and touching one mid-move counts as a fault that allocates nothing; the
  # scenario turns that off (vm.compact_unevictable_allowed=0, as for real-time loads) so the
  # count measures the daemon. A handful is tolerated; dozens mean a path that allocates.
  qpf=$(stat_field "$DEV" queue_page_faults)
  # What the queue loops met under the hog (retries.rs): told, not checked.
  say "  queue_retried_waits=$(stat_field "$DEV" queue_retried_waits) queue_failed_commands=$(stat_field "$DEV" queue_failed_commands)"
  grep -hE "ublk command of the queue failed|keeps failing|io_uring failed" /run/uzram/*.log 2>/dev/null | tail -5 | sed 's/^/    | /'
  say "  queue_page_faults=$qpf; $(grep -E '^(compact_migrate_scanned|compact_isolated|thp_collapse_alloc) ' /proc/vmstat | tr '\n' ' ')"
  [ -n "$qpf" ] && [ "$qpf" -le 8 ] && ok "queue threads took $qpf page faults while serving (<= 8)" \
    || fail_check "queue threads took ${qpf:-?} page faults while serving"
  timeout -s KILL "$TMO" uzram list | sed 's/^/    | /'
  log_tail_stays "$DEV"
  check "swapoff" swapoff "$DEV"
  uzram_destroy "$DEV"
fi
end

# The README's main job, inside the guest: a uzram device as swap under memory pressure.
# Create a device, mkswap + swapon (with discard, as `uzram swap-on` and the unit swap), run a
# memory hog of 2x the available memory (non-zero, compressible pages), show `uzram list` and
# `uzram status` while its pages are swapped out, verify every word, swapoff, destroy. Exit 0
# iff all of that worked. The device and the hog are sized as scenario b sizes them
# (lib.sh, hog_swap_device): the hog against the memory available once the daemon runs, the
# device a quarter larger than the hog. Sized before the daemon, with a device of exactly the
# hog's size, the daemon's reserves and the hog's compressed pages did not fit: the OOM
# killer took the hog in its fill (6.12, 2026-11-28).
. /e2e/lib.sh
begin demo
if hog_swap_device; then
  t0=$(up)
  : > /tmp/hog.out
  timeout -s KILL "$IO_TMO" hog "$HOG" 1 5 > /tmp/hog.out 2>&1 &
  HPID=$!
  wait_holding $HPID /tmp/hog.out
  echo "\$ free -m"; free -m
  echo "\$ cat /proc/swaps"; cat /proc/swaps
  echo "\$ uzram list"; timeout -s KILL "$TMO" uzram list || fail_check "uzram list"
  echo "\$ uzram status $DEV"; timeout -s KILL "$TMO" uzram status "$DEV" || fail_check "uzram status"
  orig=$(stat_field "$DEV" orig_data_size); compr=$(stat_field "$DEV" compr_data_size)
  if [ -n "$orig" ] && [ -n "$compr" ] && [ "$compr" -gt 0 ] && [ "$compr" -lt "$orig" ]; then
    ok "$((orig / 1048576)) MiB of swapped pages held in $((compr / 1048576)) MiB (ratio $(awk -v o="$orig" -v c="$compr" 'BEGIN{printf "%.2f", o/c}'))"
  else
    fail_check "status does not show compressed data (orig=$orig compr=$compr)"
  fi
  wait $HPID && ok "memory hog: every word verified ($(since "$t0")s)" || fail_check "memory hog failed"
  cat /tmp/hog.out
  grep -E 'pswpin|pswpout' /proc/vmstat | tr '\n' ' '; echo
  check "swapoff $DEV" swapoff "$DEV"
  uzram_destroy "$DEV"
fi
end

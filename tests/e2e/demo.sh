# The README's main job, inside the guest: a uzram device as swap under memory pressure.
# Create a device, mkswap + swapon, run a memory hog of 2x the available memory (non-zero,
# compressible pages), show `uzram list` and `uzram status` while its pages are swapped out,
# verify every word, swapoff, destroy. Exit 0 iff all of that worked.
. /e2e/lib.sh
begin demo
AVAIL=$(mem_avail_mib)
HOG=${UZ_hog_mib:-$((AVAIL * 2))}
say "MemAvailable ${AVAIL} MiB; device ${HOG} MiB; memory hog ${HOG} MiB"
if uzram_create --size "${HOG}M"; then
  check "mkswap $DEV" mkswap "$DEV"
  check "swapon $DEV" swapon "$DEV"
  t0=$(up)
  : > /tmp/hog.out
  timeout -s KILL "$IO_TMO" hog "$HOG" 1 5 > /tmp/hog.out 2>&1 &
  HPID=$!
  while ! grep -q holding /tmp/hog.out && kill -0 $HPID 2>/dev/null; do usleep 200000; done
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

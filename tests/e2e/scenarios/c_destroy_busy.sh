# Scenario c: destroy of a device in use (an open fd; active swap) is refused with a message,
# nothing is lost (data written before the refusal still verifies) and the device keeps working.
. /e2e/lib.sh
begin c_destroy_busy
if uzram_create --size 128M; then
  check "fio write 0..64M" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=64M VONLY=0
  exec 3<"$DEV"
  expect_refused "destroy with an open fd" 'in use|busy|open|holder' uzram destroy "$DEV"
  [ -b "$DEV" ] && ok "$DEV still present" || fail_check "$DEV vanished after a refused destroy"
  check "data verifies after the refusal (fd open)" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=64M VONLY=1
  exec 3<&-
  # another process holds the device open (not the destroying process itself)
  # shellcheck disable=SC2217 # the redirect is the point: sleep just keeps the fd open
  sleep 600 < "$DEV" &
  HOLDER=$!
  usleep 200000
  expect_refused "destroy --all while another process has it open" 'in use|busy|open|holder' uzram destroy --all
  kill $HOLDER; wait $HOLDER 2>/dev/null
  check "data verifies after destroy --all refusal" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=64M VONLY=1

  check "fio write 64M..128M" fio_job region.fio DEV="$DEV" OFFSET=64M LEN=64M VONLY=0
  check "mkswap (first 64M)" mkswap "$DEV" 65536
  check "swapon" swapon "$DEV"
  grep -q "^$DEV " /proc/swaps && ok "swap active" || fail_check "$DEV not in /proc/swaps"
  expect_refused "destroy with swap active" 'swap' uzram destroy "$DEV"
  expect_refused "destroy --all with swap active" 'swap|in use|busy' uzram destroy --all
  grep -q "^$DEV " /proc/swaps && ok "swap still active" || fail_check "swap went away after a refused destroy"
  check "data beyond the swap area verifies with swap active" fio_job region.fio DEV="$DEV" OFFSET=64M LEN=64M VONLY=1
  check "swapoff" swapoff "$DEV"
  check "device still writable and verifies after the refusals" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=64M VONLY=0
  check "... and reads back" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=64M VONLY=1
  uzram_destroy "$DEV"
fi
end

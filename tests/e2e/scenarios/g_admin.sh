# Scenario g: what administrators and monitoring see. A device made with --metrics-textfile:
# the daemon writes the Prometheus file (and again as the numbers change), `uzram status
# --prometheus` agrees with `--json`, and the file goes with the device; `uzram list` with
# zramctl's flags; swap through /dev/zram-uzram/ublkbN (the path systemd never picks for
# hibernation) counts as active swap, and swapoff through /dev/ublkbN ends it.
. /e2e/lib.sh
begin g_admin
MDIR=/run/uzram-metrics
PROM=$MDIR/uzram-g.prom
mkdir -p "$MDIR"
expect_refused "a metrics file in a missing directory" 'does not exist' \
  uzram create --size 64M --metrics-textfile /nonexistent/dir/uzram.prom
if uzram_create --size 128M --metrics-textfile "$PROM"; then
  N=${DEV#/dev/}
  check "fio write 0..64M" fio_job region.fio DEV="$DEV" OFFSET=0 LEN=64M VONLY=0
  want=$(stat_field "$DEV" orig_data_size)
  # written at start, rewritten every 15 s: within 20 s it must hold the new numbers
  i=0; got=
  while [ $i -lt 40 ]; do
    got=$(awk -v d="$N" '$1 == "uzram_orig_data_bytes{device=\"" d "\"}" {print $2}' "$PROM" 2>/dev/null)
    [ -n "$want" ] && [ "$got" = "$want" ] && break
    i=$((i + 1)); usleep 500000
  done
  [ -n "$want" ] && [ "$got" = "$want" ] && ok "$PROM: uzram_orig_data_bytes $got = orig_data_size of status --json" \
    || fail_check "$PROM holds uzram_orig_data_bytes '$got', status --json orig_data_size '$want'"
  grep -E '^(# (HELP|TYPE) )?uzram_(orig_data_bytes|mem_used_bytes|failed_writes_total)[ {]' "$PROM" | sed 's/^/    | /'
  ls -A "$MDIR" | grep -q tmp && fail_check "a temporary file is left in $MDIR: $(ls -A "$MDIR" | tr '\n' ' ')" \
    || ok "only $(ls -A "$MDIR" | tr '\n' ' ')in $MDIR"
  run_t "$TMO" /tmp/prom.out uzram status "$DEV" --prometheus
  rc=$?
  sed -n '1,9p' /tmp/prom.out | sed 's/^/    | /'
  types=$(grep -c '^# TYPE ' /tmp/prom.out); samples=$(grep -c '^uzram_' /tmp/prom.out)
  [ $rc = 0 ] && grep -q "^uzram_orig_data_bytes{device=\"$N\"} $want\$" /tmp/prom.out && [ "$types" = "$samples" ] \
    && ok "status --prometheus: $samples metrics, each with HELP/TYPE, orig_data_bytes $want" \
    || fail_check "status --prometheus: rc=$rc, $types TYPE lines for $samples samples"

  run_t "$TMO" /tmp/list.out uzram list
  sed 's/^/    | /' /tmp/list.out
  [ "$(head -1 /tmp/list.out | tr -s ' ')" = "NAME ALGORITHM DISKSIZE DATA COMPR TOTAL STREAMS MOUNTPOINT" ] \
    && ok "uzram list prints zramctl's default columns" || fail_check "uzram list header: $(head -1 /tmp/list.out)"
  run_t "$TMO" /tmp/list.out uzram list -o NAME,DATA,TOTAL,COMP-RATIO,MIGRATED,BACKEND -b -n
  sed 's/^/    | /' /tmp/list.out
  [ "$(awk -v d="$DEV" '$1 == d {print $2}' /tmp/list.out)" = "$want" ] && [ "$(wc -l < /tmp/list.out)" = 1 ] \
    && ok "list -o ... -b -n: one row, DATA in bytes = $want" || fail_check "list -o ... -b -n: $(cat /tmp/list.out)"
  expect_refused "list -o with an unknown column" 'unknown column: SIZE' uzram list -o NAME,SIZE

  A=/dev/zram-uzram/$N
  [ -b "$A" ] && ok "the daemon made $A" || fail_check "no block device $A"
  check "mkswap (first 64M)" mkswap "$DEV" 65536
  check "swapon through $A" swapon "$A"
  grep -q "^$A " /proc/swaps && ok "/proc/swaps lists $A" || fail_check "/proc/swaps: $(cat /proc/swaps | tr '\n' ' ')"
  run_t "$TMO" /tmp/list.out uzram list -o NAME,MOUNTPOINT --raw -n
  grep -q "^$DEV \[SWAP\]\$" /tmp/list.out && ok "list shows $DEV as [SWAP]" || fail_check "list: $(cat /tmp/list.out)"
  expect_refused "destroy while swap is on $A" 'swap' uzram destroy "$DEV"
  check "swapoff $DEV (activated as $A)" swapoff "$DEV"
  grep -q "^$A " /proc/swaps && fail_check "$A still in /proc/swaps" || ok "swap off"
  uzram_destroy "$DEV"
  i=0
  while { [ -e "$PROM" ] || [ -e "$A" ]; } && [ $i -lt 100 ]; do i=$((i + 1)); usleep 100000; done
  [ -e "$PROM" ] && fail_check "$PROM outlived the device" || ok "$PROM removed with the device"
  [ -e "$A" ] && fail_check "$A outlived the device" || ok "$A removed with the device"
fi
end

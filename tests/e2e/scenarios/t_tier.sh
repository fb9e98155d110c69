# Scenario t: the cold tier in RAM. Real bytes (the guest's own programs: code, tables, text)
# written to a device made with recompress-algorithm; nothing is idle yet, so `uzram
# recompress` tries nothing; `uzram idle` marks every page idle and `uzram recompress` then
# rewrites them as zstd: the device holds less memory and every byte reads back (direct I/O,
# past the page cache). A second device recompresses by itself: idle age 0, so its first tick
# (a minute) takes every page, and `uzram status` counts the pages by age.
. /e2e/lib.sh
begin t_tier
SRC=/tmp/t_tier.src
# shellcheck disable=SC2046 # the guest's programs, as files (busybox's head takes bytes, no M)
cat $(find /usr/local/bin /usr/bin /bin /sbin -type f 2>/dev/null) 2>/dev/null | head -c 25165824 > "$SRC"
MIB=$(( $(stat -c %s "$SRC") / 1048576 ))
[ "$MIB" -ge 8 ] || fail_check "only $MIB MiB of programs in the guest to write"
sum() { dd if="$1" bs=1M count="$MIB" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1; }
WANT=$(head -c $((MIB * 1048576)) "$SRC" | sha256sum | cut -d' ' -f1)
say "  source: $MIB MiB of the guest's programs"
json_field() { tr -d ' \n' < "$1" | sed -n "s/.*\"$2\":\([0-9][0-9]*\).*/\1/p"; }

if uzram_create --size 64M --recompress-algorithm zstd:3 --recompress-idle-age 1h; then
  check "write $MIB MiB (direct)" dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct
  before=$(stat_field "$DEV" mem_used_total)
  run_t "$TMO" /tmp/t.out uzram recompress "$DEV" --json
  tried=$(json_field /tmp/t.out tried)
  [ "$tried" = 0 ] && ok "recompress before anything is idle: nothing tried" \
    || fail_check "recompress of young pages: $(cat /tmp/t.out)"
  run_t "$TMO" /tmp/t.out uzram idle "$DEV" --all
  grep -q 'pages marked idle' /tmp/t.out && ok "uzram idle: $(cat /tmp/t.out)" || fail_check "uzram idle: $(cat /tmp/t.out)"
  run_t 300 /tmp/t.out uzram recompress "$DEV" --type idle --json
  rc=$?
  rewritten=$(json_field /tmp/t.out rewritten); after=$(json_field /tmp/t.out mem_used_after)
  say "    | $(cat /tmp/t.out)"
  if [ $rc = 0 ] && [ "${rewritten:-0}" -gt 0 ] && [ "${after:-0}" -gt 0 ] && [ $((after * 100)) -le $((before * 90)) ]; then
    ok "recompressed $rewritten pages: mem_used_total $before -> $after bytes"
  else
    fail_check "recompress: rc=$rc, rewritten '${rewritten}', mem_used_total $before -> '${after}'"
  fi
  [ "$(stat_field "$DEV" recompressed_pages)" = "$rewritten" ] && ok "status: recompressed_pages $rewritten" \
    || fail_check "status recompressed_pages $(stat_field "$DEV" recompressed_pages), the pass rewrote $rewritten"
  [ "$(stat_field "$DEV" recompress_rewritten_pages)" = "$rewritten" ] && ok "status: recompress_rewritten_pages $rewritten" \
    || fail_check "status recompress_rewritten_pages $(stat_field "$DEV" recompress_rewritten_pages), the pass rewrote $rewritten"
  got=$(sum "$DEV")
  [ "$got" = "$WANT" ] && ok "every byte reads back (sha256 $got)" || fail_check "read back sha256 $got, wrote $WANT"
  run_t "$TMO" /tmp/t.out uzram recompress "$DEV" --type huge --algorithm lz4
  grep -q 'writes zstd' /tmp/t.out && ok "recompress --algorithm lz4 refused" || fail_check "recompress --algorithm lz4: $(cat /tmp/t.out)"
  uzram_destroy "$DEV"
fi

if uzram_create --size 64M --recompress-algorithm zstd --recompress-idle-age 0s; then
  check "write $MIB MiB (direct)" dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct
  stored=$(stat_field "$DEV" pages_stored)
  i=0; n=0
  # the daemon's first tick comes a minute after it started
  while [ $i -lt 100 ]; do
    n=$(stat_field "$DEV" recompressed_pages)
    [ "${n:-0}" -gt 0 ] && break
    i=$((i + 1)); sleep 1
  done
  [ "${n:-0}" -gt 0 ] && ok "the daemon recompressed $n of $stored pages by itself" \
    || fail_check "no page recompressed 100 s after the writes"
  young=$(stat_field "$DEV" pages_age_under_10m)
  [ "${young:-0}" = "$stored" ] && ok "status counts the $stored pages as used 1-10 minutes ago" \
    || fail_check "pages_age_under_10m '$young', pages_stored $stored"
  got=$(sum "$DEV")
  [ "$got" = "$WANT" ] && ok "every byte reads back" || fail_check "read back sha256 $got, wrote $WANT"
  uzram_destroy "$DEV"
fi
rm -f "$SRC"
end

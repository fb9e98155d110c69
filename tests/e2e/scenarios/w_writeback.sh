# Scenario w: writeback to a partition (the guest's blank virtio disk, used whole). Real bytes
# (the guest's programs) written to a device with --writeback-device; `uzram idle` marks
# them idle, then fresh pages are written; `uzram writeback --type idle` moves only the idle
# ones to the disk, packed (fewer blocks than pages) and sealed; they read back through the
# disk (bd_reads) with every byte right (direct I/O, past the page cache). A byte changed on
# the disk is an I/O error, not other data, and so are blocks rolled back to an older sealing
# of the same pages at the same places. Overwritten pages leave the disk. Then kill -9
# during a writeback pass and `uzram recover`: every byte reads back, from RAM or the disk;
# and kill -9 during a read-back from the disk: the read waits and ends right.
# Then a daily budget holds across a crash, and a write at the mem-limit makes room by writeback.
. /e2e/lib.sh
begin w_writeback
WB=$(scratch_disk)
SRC=/tmp/w.src
programs_source "$SRC" 16777216
sum() { dd if="$1" bs=1M count="$MIB" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1; }
json_field() { tr -d ' \n' < "$1" | sed -n "s/.*\"$2\":\([0-9][0-9]*\).*/\1/p"; }
# A RAID member whose first MiB and last block are zeros (an md superblock 1.0, 8 KiB from
# the disk's end): refused and left as it was; the command the refusal gives clears it.
if [ -n "$WB" ] && [ -b "$WB" ]; then
  _blocks=$(( $(blockdev --getsize64 "$WB") / 4096 ))
  { printf '\374\116\053\251'; head -c 4092 /dev/zero; } > /tmp/w.md
  dd if=/dev/zero of="$WB" bs=1M count=1 oflag=direct 2>/dev/null
  dd if=/dev/zero of="$WB" bs=4096 count=1 seek=$((_blocks - 1)) oflag=direct 2>/dev/null
  dd if=/tmp/w.md of="$WB" bs=4096 count=1 seek=$((_blocks - 2)) oflag=direct conv=notrunc 2>/dev/null
  md_block() { dd if="$WB" bs=4096 count=1 skip=$((_blocks - 2)) iflag=direct 2>/dev/null; }
  expect_refused "a RAID member as backing device" "not uzram's: its first or last MiB" \
    uzram create --size 64M --writeback-device "$WB"
  md_block | cmp -s - /tmp/w.md && ok "the refused disk's superblock is unchanged" \
    || fail_check "the refused disk's superblock was changed"
  _clear=$(tr '\n' ' ' < /tmp/refused.out | sed -n 's/.*clear it with `\([^`]*\)`.*/\1/p')
  if [ -n "$_clear" ] && sh -c "$_clear" 2>/dev/null && [ "$(md_block | tr -d '\0' | wc -c)" = 0 ]; then
    ok "the refusal's command clears the disk: $_clear"
  else
    fail_check "the refusal's command did not clear the superblock: '$_clear'"
  fi
fi
if [ -z "$WB" ] || [ ! -b "$WB" ]; then
  fail_check "no blank disk with serial uzramscratch in this guest"
elif [ "$MIB" -lt 8 ]; then
  fail_check "only $MIB MiB of programs in the guest to write"
elif uzram_create --size 64M --writeback-device "$WB"; then
  say "  source: $MIB MiB of the guest's programs; backing device $WB"
  check "write $MIB MiB (direct)" dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct
  run_t "$TMO" /tmp/w.out uzram idle "$DEV" --all
  grep -q 'pages marked idle' /tmp/w.out && ok "uzram idle: $(cat /tmp/w.out)" || fail_check "uzram idle: $(cat /tmp/w.out)"
  # fresh pages after the mark: they are not idle and stay in RAM
  check "write 4 MiB more at 48 MiB (direct)" dd if="$SRC" of="$DEV" bs=1M count=4 seek=48 oflag=direct
  before=$(stat_field "$DEV" mem_used_total)
  run_t 300 /tmp/w.out uzram writeback "$DEV" --type idle --json
  rc=$?
  say "    | $(cat /tmp/w.out)"
  pages=$(json_field /tmp/w.out pages); blocks=$(json_field /tmp/w.out blocks)
  after=$(json_field /tmp/w.out mem_used_after)
  if [ $rc = 0 ] && [ "${pages:-0}" -gt 0 ] && [ "${blocks:-0}" -gt 0 ] && [ "${after:-0}" -lt "$before" ]; then
    ok "wrote back $pages pages in $blocks blocks ($((blocks * 4096 * 100 / (pages * 4096)))% of a block a page); memory $before -> $after bytes"
  else
    fail_check "writeback: rc=$rc, $(cat /tmp/w.out)"
  fi
  [ "${blocks:-0}" -lt "${pages:-0}" ] && ok "packed: fewer blocks than pages" || fail_check "$blocks blocks for $pages pages"
  [ "$(stat_field "$DEV" bd_count)" = "$pages" ] && ok "bd_count $pages" || fail_check "bd_count $(stat_field "$DEV" bd_count), wrote back $pages"
  [ "$(stat_field "$DEV" bd_writes)" = "$blocks" ] && ok "bd_writes $blocks" || fail_check "bd_writes $(stat_field "$DEV" bd_writes), wrote $blocks"
  run_t "$TMO" /tmp/w.out uzram writeback "$DEV" --type idle --json
  [ "$(json_field /tmp/w.out pages)" = 0 ] && ok "the pages written after the mark are not idle: none go" \
    || fail_check "a second pass: $(cat /tmp/w.out)"
  got=$(sum "$DEV")
  [ "$got" = "$WANT" ] && ok "every byte reads back from the disk (sha256 $got)" || fail_check "read back sha256 $got, wrote $WANT"
  reads=$(stat_field "$DEV" bd_reads)
  [ "${reads:-0}" -gt 0 ] && ok "bd_reads $reads" || fail_check "bd_reads '${reads}' after reading written-back pages"
  # one byte of the disk's first block changed: the page there fails, no other data comes back
  dd if="$WB" of=/tmp/w.b0 bs=4096 count=1 iflag=direct 2>/dev/null
  b=$(dd if=/tmp/w.b0 bs=1 skip=100 count=1 2>/dev/null | od -An -tu1 | tr -d ' ')
  # shellcheck disable=SC2059 # an octal escape made on purpose
  printf "\\$(printf %o $(( (b ^ 32) & 255 )))" | dd of=/tmp/w.b0 bs=1 seek=100 count=1 conv=notrunc 2>/dev/null
  dd if=/tmp/w.b0 of="$WB" bs=4096 count=1 oflag=direct conv=notrunc 2>/dev/null
  if dd if="$DEV" of=/dev/null bs=4096 count=256 iflag=direct 2>/tmp/w.err; then
    fail_check "the first MiB read back whole after its disk block was changed"
  else
    grep -qi 'error' /tmp/w.err && ok "a changed disk block: the read fails ($(tail -1 /tmp/w.err))" || fail_check "dd failed without an I/O error: $(cat /tmp/w.err)"
  fi
  f=$(stat_field "$DEV" bd_failures); c=$(stat_field "$DEV" checksum_failures)
  [ "${f:-0}" -gt 0 ] && [ "${c:-0}" -gt 0 ] && ok "bd_failures $f, checksum_failures $c" || fail_check "bd_failures '$f', checksum_failures '$c'"
  # overwritten pages leave the disk
  check "overwrite $MIB MiB with zeros" dd if=/dev/zero of="$DEV" bs=1M count="$MIB" oflag=direct
  [ "$(stat_field "$DEV" bd_count)" = 0 ] && ok "bd_count 0 after the overwrite" || fail_check "bd_count $(stat_field "$DEV" bd_count) after the overwrite"

  # A disk rolled back: someone who can write the partition kept the sealed blocks of 1 MiB
  # of noise (stored raw: every page the same length), and after the same pages were sealed
  # again at the same places writes the old blocks back. Their tags are good under the key;
  # the nonce floors (kept across the takeover) make them an I/O error. A takeover before
  # each pass starts both at the disk's first free block, 0 (every block is free here), so
  # the second pass seals each page where the first did.
  restart() {
    PID=$(daemon_pid "$DEV")
    kill -9 "$PID"
    wait_gone "$PID" || fail_check "daemon $PID still alive 10s after SIGKILL"
    check "uzram recover $DEV ($1)" uzram recover "$DEV"
    # the new daemon gives every unused block back a second after it serves; a block whose
    # discard is in flight is not free, and the pass must find block 0 free
    sleep 3
  }
  noise_pass() {
    head -c 1048576 /dev/urandom > /tmp/w.noise
    dd if=/tmp/w.noise of="$DEV" bs=1M count=1 oflag=direct 2>/dev/null
    run_t "$TMO" /tmp/w.out uzram idle "$DEV" --all
    run_t 300 /tmp/w.out uzram writeback "$DEV" --type idle --json
    json_field /tmp/w.out blocks
  }
  check "zero the 4 MiB at 48 MiB (only the noise may go)" dd if=/dev/zero of="$DEV" bs=1M count=4 seek=48 oflag=direct
  restart "before the first noise pass"
  n1=$(noise_pass)
  dd if="$WB" of=/tmp/w.old bs=4096 count="${n1:-1}" iflag=direct 2>/dev/null
  restart "before the second noise pass"
  n2=$(noise_pass)
  if [ "${n1:-0}" -gt 0 ] && [ "$n1" = "$n2" ] && ! dd if="$WB" bs=4096 count="$n1" iflag=direct 2>/dev/null | cmp -s - /tmp/w.old; then
    f0=$(stat_field "$DEV" bd_failures)
    dd if=/tmp/w.old of="$WB" bs=4096 count="$n1" oflag=direct conv=notrunc 2>/dev/null
    if dd if="$DEV" of=/dev/null bs=4096 count=256 iflag=direct 2>/tmp/w.err; then
      fail_check "1 MiB read back whole from disk blocks rolled back to an older sealing"
    else
      f=$(stat_field "$DEV" bd_failures)
      [ "${f:-0}" -gt "${f0:-0}" ] && ok "blocks rolled back to an older sealing: the read fails ($(tail -1 /tmp/w.err)), bd_failures $f0 -> $f" \
        || fail_check "the rolled-back read failed, but bd_failures stayed '$f'"
    fi
  else
    fail_check "the two noise passes did not seal at the same places ($n1 and $n2 blocks)"
  fi
  check "overwrite 1 MiB with zeros" dd if=/dev/zero of="$DEV" bs=1M count=1 oflag=direct

  # kill -9 while a writeback pass runs; then uzram recover
  check "write $MIB MiB again (direct)" dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct
  run_t "$TMO" /tmp/w.out uzram idle "$DEV" --all
  PID=$(daemon_pid "$DEV")
  uzram writeback "$DEV" --type idle > /tmp/w.pass 2>&1 &
  usleep 100000
  kill -9 "$PID"
  wait_gone "$PID" || fail_check "daemon $PID still alive 10s after SIGKILL"
  wait
  say "  killed daemon $PID during a writeback pass: $(head -c 200 /tmp/w.pass | tr '\n' ' ')"
  check "uzram recover $DEV" uzram recover "$DEV"
  got=$(sum "$DEV")
  [ "$got" = "$WANT" ] && ok "every byte reads back after the crash ($(stat_field "$DEV" bd_count) pages on the disk)" \
    || fail_check "read back sha256 $got after the crash, wrote $WANT"
  # ages start young in a new daemon: mark them again
  run_t "$TMO" /tmp/w.out uzram idle "$DEV" --all
  run_t 300 /tmp/w.out uzram writeback "$DEV" --type idle --json
  say "    | $(cat /tmp/w.out)"
  more=$(json_field /tmp/w.out pages)
  got=$(sum "$DEV")
  [ "${more:-0}" -gt 0 ] && [ "$got" = "$WANT" ] \
    && ok "the recovered daemon writes back $more more pages and reads every byte back with the kept key" \
    || fail_check "after the recovered daemon's pass of '${more}' pages: read back sha256 $got, wrote $WANT"
  # kill -9 while written-back pages are read from the disk: the read waits, paused, and
  # ends with every byte right once `uzram recover` took over
  PID=$(daemon_pid "$DEV")
  ( sum "$DEV" > /tmp/w.sum ) &
  RPID=$!
  usleep 300000
  kill -9 "$PID"
  wait_gone "$PID" || fail_check "daemon $PID still alive 10s after SIGKILL"
  kill -0 $RPID 2>/dev/null && say "  killed daemon $PID during a read-back" || say "  note: the read-back ended before the kill"
  check "uzram recover $DEV" uzram recover "$DEV"
  wait $RPID
  got=$(cat /tmp/w.sum)
  [ "$got" = "$WANT" ] && ok "the read-back in flight at the kill ended with every byte right" \
    || fail_check "read-back across kill -9: sha256 $got, wrote $WANT"
  uzram_destroy "$DEV"
fi

# A daily budget of 64 KiB on a backing file (created 0600; the ramfs root has no direct
# I/O, so through the page cache): passes stop at it, and it holds after kill -9 and
# `uzram recover`, because its count is on disk.
BF=/tmp/w-budget.wb
rm -f "$BF"
if [ "$MIB" -ge 8 ] && uzram_create --size 64M --writeback-device "$BF" --writeback-limit 64K/day; then
  m=$(stat -c %a "$BF" 2>/dev/null)
  [ "$m" = 600 ] && ok "backing file $BF created with mode 600" || fail_check "backing file mode '$m'"
  check "write $MIB MiB (direct)" dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct
  run_t "$TMO" /tmp/w.out uzram idle "$DEV" --all
  run_t 300 /tmp/w.out uzram writeback "$DEV" --json
  say "    | $(cat /tmp/w.out)"
  pages=$(json_field /tmp/w.out pages); blocks=$(json_field /tmp/w.out blocks)
  [ "${pages:-0}" -gt 0 ] && [ "${blocks:-99}" -le 16 ] && ok "the pass stopped at the budget: $pages pages in $blocks blocks" \
    || fail_check "budget pass: $(cat /tmp/w.out)"
  run_t 300 /tmp/w.out uzram writeback "$DEV" --json
  [ "$(json_field /tmp/w.out pages)" = 0 ] && ok "a second pass writes nothing: $(json_field /tmp/w.out budget_left_bytes) bytes left today" \
    || fail_check "second pass past the budget: $(cat /tmp/w.out)"
  PID=$(daemon_pid "$DEV")
  kill -9 "$PID"; wait_gone "$PID"
  check "uzram recover $DEV" uzram recover "$DEV"
  run_t "$TMO" /tmp/w.out uzram idle "$DEV" --all
  run_t 300 /tmp/w.out uzram writeback "$DEV" --json
  [ "$(json_field /tmp/w.out pages)" = 0 ] && ok "after kill -9 and recover the day's budget is still spent" \
    || fail_check "the budget did not hold across the restart: $(cat /tmp/w.out)"
  got=$(sum "$DEV")
  [ "$got" = "$WANT" ] && ok "every byte reads back" || fail_check "read back sha256 $got, wrote $WANT"
  uzram_destroy "$DEV"
fi

# mem-limit with writeback: a write that finds the store at its limit asks for room, and the
# daemon writes its oldest pages back before the write goes on (down to 75 % of the limit),
# so 14 MiB go into 8 MiB in one run of writes without a failed one; the same writes without
# a backing device hit the limit.
if [ "$MIB" -ge 8 ] && uzram_create --size 64M --mem-limit 8M --writeback-device "$WB"; then
  check "$MIB MiB written at once under an 8 MiB mem-limit" dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct
  used=$(stat_field "$DEV" mem_used_total); n=$(stat_field "$DEV" bd_count); fw=$(stat_field "$DEV" failed_writes)
  [ "${n:-0}" -gt 0 ] && [ "${used:-99999999}" -le 8388608 ] && [ "${fw:-1}" = 0 ] \
    && ok "$n pages written back for room; mem_used_total $used; failed_writes 0" \
    || fail_check "bd_count '$n', mem_used_total '$used', failed_writes '$fw' under an 8 MiB limit"
  got=$(sum "$DEV")
  [ "$got" = "$WANT" ] && ok "every byte reads back" || fail_check "read back sha256 $got, wrote $WANT"
  uzram_destroy "$DEV"
fi
if [ "$MIB" -ge 8 ] && uzram_create --size 64M --mem-limit 8M; then
  dd if="$SRC" of="$DEV" bs=1M count="$MIB" oflag=direct 2>/tmp/w.dd \
    && fail_check "$MIB MiB fit in 8 MiB without writeback" \
    || ok "without a backing device the writes hit the limit: $(grep -i error /tmp/w.dd | head -1)"
  uzram_destroy "$DEV"
fi
rm -f "$SRC" /tmp/w.b0 "$BF"
end

# Scenario l: swap on a device with a mem-limit far below what a hog of 3x the available
# memory swaps out. With a backing device (the guest's blank virtio disk) the writes that
# find the store at its limit ask for room, the oldest pages are written back, and the hog
# fills and verifies every word, reading pages back from the disk; without one, the same hog
# hits the limit: writes fail (failed_writes) and the store stays within it, while the guest
# goes on (the hog runs in a memory cgroup of half the memory available, below). The daily
# budget is
# lifted (--writeback-limit none): the hog's fill and verify pass move more than the default
# 1 GiB a day through the disk, and at the budget writes fail as without a backing device.
. /e2e/lib.sh
begin l_limit_hog
WB=$(scratch_disk)
LIMIT_MIB=${UZ_limit_mib:-64}
echo 0 > /proc/sys/vm/compact_unevictable_allowed
[ -z "${UZ_watermark_scale_factor:-}" ] || echo "$UZ_watermark_scale_factor" > /proc/sys/vm/watermark_scale_factor
# run_hog SECS SIZE [WATCH [STALL]]: the hog, killed after SECS, with a watch for hangs after
# WATCH seconds, or as soon as swap stood still for STALL seconds (in cgroup HOG_CGROUP when
# set); sets HRC and prints its lines. Under TCG the hog's pages cross the emulated disk
# both ways (sealed and opened in emulated code): its fill and verify take minutes.
run_hog() {
  _w=
  if [ -n "${3:-}" ]; then hangwatch "$3" uzram ${4:+"$4"} & _w=$!; fi
  # hog -t, not timeout: without a backing device the swap device refuses writes, and on
  # 7.3 timeout's own pages, swapped out, never came back to run its kill (hog.c).
  if [ -n "${HOG_CGROUP:-}" ]; then
    # shellcheck disable=SC2016 # $$ is the inner shell's, which becomes the hog
    sh -c 'echo $$ > "$0/cgroup.procs" && exec hog -t "$1" "$2" 1' "$HOG_CGROUP" "$1" "$2" > /tmp/l.hog 2>&1
  else
    hog -t "$1" "$2" 1 > /tmp/l.hog 2>&1
  fi
  HRC=$?
  [ -z "$_w" ] || kill $_w 2>/dev/null
  sed 's/^/    | /' /tmp/l.hog
}
if [ -z "$WB" ] || [ ! -b "$WB" ]; then
  fail_check "no blank disk with serial uzramscratch in this guest"
else
  AVAIL0=$(mem_avail_mib)
  SIZE_MIB=$((AVAIL0 * 4))
  if uzram_create --size "${SIZE_MIB}M" --mem-limit "${LIMIT_MIB}M" --writeback-device "$WB" --writeback-limit none; then
    AVAIL=$(mem_avail_mib)
    HOG=$((AVAIL * 3))
    say "  MemAvailable ${AVAIL} MiB with the daemon -> hog ${HOG} MiB; device ${SIZE_MIB} MiB, mem-limit ${LIMIT_MIB} MiB, backing $WB"
    check "mkswap" mkswap "$DEV" && check "swapon --discard" swapon -d "$DEV"
    out0=$(awk '/pswpout/{print $2}' /proc/vmstat)
    t0=$(up)
    # The hog's own limit (uzram.limit_hog_secs): in clean-clone CI it took 420-620 s, and
    # 903 s (killed at 900, still verifying: 92 % swapped back in) in a 7.3 boot while the
    # host also ran cargo test; the watch dumps the threads' stacks at 600 s either way.
    # The watch also fires once swap stood still for 20 s: the keeper's stalls that the
    # device recovered from after a minute froze it meanwhile (known-gaps.md).
    run_hog "${UZ_limit_hog_secs:-1200}" "$HOG" "${UZ_hangwatch_secs:-600}" "${UZ_hangwatch_stall:-20}"
    out1=$(awk '/pswpout/{print $2}' /proc/vmstat)
    say "  hog wall time $(since "$t0")s, pswpout +$(((out1 - out0) / 256)) MiB, pswpin $(awk '/pswpin/{print $2}' /proc/vmstat)"
    [ $HRC = 0 ] && grep -q ' 0 bad words' /tmp/l.hog && ok "a hog of 3x the memory filled and verified every word" \
      || fail_check "hog rc=$HRC with writeback under mem-limit"
    used=$(stat_field "$DEV" mem_used_total); bd=$(stat_field "$DEV" bd_count)
    bw=$(stat_field "$DEV" bd_writes); br=$(stat_field "$DEV" bd_reads); fw=$(stat_field "$DEV" failed_writes)
    say "  mem_used_total $used, bd_count $bd, bd_writes $bw, bd_reads $br, failed_writes $fw"
    say "  room thread: $(cat /run/uzram/*.log 2>/dev/null | grep -ac 'written back for memory') passes logged; last: $(cat /run/uzram/*.log 2>/dev/null | tr -d '\033' | grep -a 'written back for memory' | tail -1 | cut -c1-200)"
    [ "${used:-99999999999}" -le $((LIMIT_MIB * 1048576)) ] && ok "the store stayed within its ${LIMIT_MIB} MiB limit" \
      || fail_check "mem_used_total '$used' over the ${LIMIT_MIB} MiB limit"
    [ "${bw:-0}" -gt 0 ] && [ "${br:-0}" -gt 0 ] && ok "pages went to the disk ($bw blocks) and came back from it ($br reads)" \
      || fail_check "bd_writes '$bw', bd_reads '$br': the disk was not used"
    # A write waits up to 3 s for the room thread's step (daemon/room.rs); under TCG a step
    # has taken longer now and then (28 of the writes in one 7.3 boot after r, s and k; none
    # in the 6.12 runs), and the kernel retries a write that failed. At most 1 % may fail;
    # without a backing device nearly all of them do.
    wr=$(stat_field "$DEV" write_requests)
    if [ "${fw:-1}" = 0 ]; then
      ok "no write failed"
    elif [ "${wr:-0}" -gt 0 ] && [ $((${fw:-1} * 100)) -le "$wr" ]; then
      ok "$fw of $wr writes waited past 3 s for room and failed (the kernel retried them), at most 1 %"
    else
      fail_check "failed_writes '$fw' of '$wr' with writeback (pool_refused_blocks $(stat_field "$DEV" pool_refused_blocks), pool_take_timeouts $(stat_field "$DEV" pool_take_timeouts))"
    fi
    [ "${fw:-0}" = 0 ] || cat /run/uzram/*.log 2>/dev/null | tr -d '\033' | grep -a 'WARN\|ERROR' | tail -5 | cut -c1-300 | sed 's/^/    | /'
    check "swapoff" swapoff "$DEV"
    uzram_destroy "$DEV"
  fi
  # the same hog without a backing device hits the limit. The swap device then refuses
  # writes, and reclaim that can only swap to it finds nothing to free: system-wide, under a
  # hog of 3x memory, that livelocked the guest (7.3: the hog sat in a page allocation stall
  # past its SIGKILL; a 6.12 boot went silent until its timeout). So this hog runs in a
  # memory cgroup of half the memory available: the reclaim its writes force stays in the
  # cgroup, retrying the refused swap writes, while the rest of the guest (the daemon, the
  # hog's locked parent, this shell) keeps the other half and runs. The cgroup's OOM killer
  # did not fire in the runs (reclaim keeps retrying); the hog's parent kills it at its
  # timeout (uzram.nolimit_hog_secs, 60 s: the hog needs minutes to fill under TCG anyway,
  # so what is checked is that writes failed at the limit, the store stayed within it, and
  # the guest went on). uzram.l_without=0 leaves it out.
  if [ "${UZ_l_without:-1}" != 1 ]; then
    say "  without a backing device: not run (uzram.l_without=0)"
  elif ! cgroup_for_hog lhog "$((AVAIL / 2))"; then
    fail_check "no memory cgroup for the hog without a backing device"
  elif uzram_create --size "${SIZE_MIB}M" --mem-limit "${LIMIT_MIB}M"; then
    check "mkswap" mkswap "$DEV" && check "swapon --discard" swapon -d "$DEV"
    ooms0=$(dmesg | grep -c 'Memory cgroup out of memory')
    HOG_CGROUP=/sys/fs/cgroup/lhog run_hog "${UZ_nolimit_hog_secs:-60}" "$HOG" 120
    fw=$(stat_field "$DEV" failed_writes)
    ooms=$(( $(dmesg | grep -c 'Memory cgroup out of memory') - ooms0 ))
    say "  without writeback: hog rc=$HRC, failed_writes $fw, cgroup OOM kills $ooms, pswpout $(awk '/pswpout/{print $2}' /proc/vmstat)"
    [ "${fw:-0}" -gt 0 ] && ok "without a backing device the writes hit the limit ($fw failed)" \
      || fail_check "failed_writes '$fw' under a ${LIMIT_MIB} MiB limit without writeback"
    [ $HRC = 137 ] && ok "the hog, held at the limit, was killed and the guest went on (rc $HRC)" \
      || fail_check "the hog without writeback ended with rc $HRC, not killed (137)"
    used=$(stat_field "$DEV" mem_used_total)
    [ "${used:-99999999999}" -le $((LIMIT_MIB * 1048576)) ] && ok "the store stayed within its ${LIMIT_MIB} MiB limit ($used bytes)" \
      || fail_check "mem_used_total '$used' over the ${LIMIT_MIB} MiB limit without writeback"
    swapoff "$DEV" 2>/dev/null
    uzram_destroy "$DEV"
    rmdir /sys/fs/cgroup/lhog 2>/dev/null
  fi
fi
end

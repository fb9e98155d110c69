# Side-by-side benchmark (printed, not asserted): zram.ko from the same kernel package vs uzram
# in the same boot, same sizes, same fio jobs (fio/bench.fio) and the same swap hog. Each rep
# runs zram then uzram, so both see the same host load. Prints "BENCH rep=R dev=D metric=M
# value=V" lines; scripts/bench-guest tabulates them.
# Kernel args: uzram.reps (default 1), uzram.bench_mib (device size, default 512),
#   uzram.bench_runtime (seconds per time-based fio job, default 10), uzram.hog_mib,
#   uzram.bench_parts (fio,swap: what runs, default both; null adds the fio jobs on a ublk
#     device that stores nothing, /bin/ublk_null, after uzram's: the transport's floor, in
#     uzram's per-queue mode (dev null) and, where the kernel has it, its batch mode (dev
#     null_batch)),
#   uzram.page_cluster (vm.page-cluster for every swap run; default: the kernel's, 3),
#   uzram.swap_variants: more uzram swap runs per rep, each with other settings, to compare:
#     VARIANT[/VARIANT...], VARIANT = KEY=VALUE[+KEY=VALUE...], KEY one of page_cluster
#     (vm.page-cluster), max_sectors_kb (the ublk disk's queue/max_sectors_kb), queues, depth,
#     queue_mode (uzram create flags), nice (added to the nice value, 0, of every daemon
#     thread once it serves), lru_gen (written to /sys/kernel/mm/lru_gen/enabled for the run:
#     n turns the multi-generational LRU off, y on; put back after), discard (1: swapon
#     -d, as `uzram swap-on` and the unit swap; the plain runs swap without it, as
#     zram's do). Each gives the metric swap_hog_s[VARIANT].
#   uzram.queue_mode, uzram.queues, uzram.depth: every uzram device (lib.sh create_flags).
#   uzram.trace_vmscan=1: in-kernel histograms (tracefs hist triggers, nothing streamed) of
#     reclaim's tracepoints over each swap run, printed after its vmstat deltas: throttling
#     by reason, the inactive-list passes by priority, direct reclaim entries, pages written.
. /e2e/lib.sh
REPS=${UZ_reps:-1}
SIZE_MIB=${UZ_bench_mib:-512}
RUNTIME=${UZ_bench_runtime:-10}
PARTS=${UZ_bench_parts:-fio,swap}
AVAIL=$(mem_avail_mib)
PC_DEFAULT=$(cat /proc/sys/vm/page-cluster)
[ -z "${UZ_page_cluster:-}" ] || PC_DEFAULT=$UZ_page_cluster
rc=0

# what the kernel does on every syscall and context switch here (emulated, so it counts)
say "bench: CPU mitigations: $(grep -H . /sys/devices/system/cpu/vulnerabilities/* 2>/dev/null | grep -v ':Not affected' | sed 's|.*/||' | tr '\n' ';')"
say "bench: THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null), lru_gen $(cat /sys/kernel/mm/lru_gen/enabled 2>/dev/null), swappiness $(cat /proc/sys/vm/swappiness)"
while read -r m; do
  grep -q "^$m " /proc/modules || insmod "/lib/modules/$m.ko" || { say "insmod $m failed"; exit 1; }
done < /lib/modules/load-order
[ -e /sys/block/zram0 ] || { say "zram0 missing after insmod zram"; exit 1; }

# The hog: twice what is available while a uzram device of the swap size runs (its
# pre-faulted block pool and recovery room are memory the hog cannot have), the same hog for
# zram and uzram. Sized before the daemon ran, uzram's runs on 7.3 (page-cluster 5) ran out
# of memory in the verify pass, and the OOM killer took the hog, then init. The swap device
# has a quarter to spare, as in scenario b (lib.sh hog_swap_device).
HOG=${UZ_hog_mib:-$((AVAIL * 2))}
case ",$PARTS," in
  *,swap,*)
    if [ -z "${UZ_hog_mib:-}" ] && uzram_create --size "$((HOG * 5 / 4))M" > /dev/null; then
      HOG=$(($(mem_avail_mib) * 2))
      uzram_destroy "$DEV" > /dev/null
    fi ;;
esac
SWAP_MIB=$((HOG * 5 / 4))
say "bench: device ${SIZE_MIB} MiB, fio runtime ${RUNTIME}s, swap device ${SWAP_MIB} MiB, hog ${HOG} MiB (MemAvailable ${AVAIL} MiB without a daemon), ${REPS} rep(s), parts ${PARTS}, vm.page-cluster ${PC_DEFAULT}, uzram flags: $(create_flags)${UZ_swap_variants:+, swap variants ${UZ_swap_variants}}"

emit() { echo "BENCH rep=$1 dev=$2 metric=$3 value=$4"; }
zram_up() {  # MIB -> DEV=/dev/zram0
  echo 1 > /sys/block/zram0/reset
  echo lz4 > /sys/block/zram0/comp_algorithm
  echo "${1}M" > /sys/block/zram0/disksize
  DEV=/dev/zram0
}
zram_down() { echo 1 > /sys/block/zram0/reset; }
uz_up() { uzram_create --size "${1}M"; }
uz_down() { uzram_destroy "$1" > /dev/null; }
has() { case ",$PARTS," in *",$1,"*) return 0 ;; esac; return 1; }

# fio_bench REP NAME: the jobs of bench.fio on $DEV
fio_bench() {
  if ! fio_job bench.fio DEV="$DEV" SIZE="${SIZE_MIB}M" RUNTIME="$RUNTIME" > /dev/null; then
    say "fio bench on $DEV failed"; tail -20 /tmp/fio.out; rc=1; return
  fi
  awk -F';' -v r="$1" -v d="$2" '
    function out(m, v) { printf "BENCH rep=%s dev=%s metric=%s value=%s\n", r, d, m, v }
    $3=="seqwrite-1m"       { out("seqwrite_1m_MBps", sprintf("%.1f", $48*1024/1e6)) }
    $3=="randwrite-4k-qd1"  { out("randwrite_4k_qd1_iops", sprintf("%.0f", $49)) }
    $3=="randwrite-4k-qd32" { out("randwrite_4k_qd32_iops", sprintf("%.0f", $49)) }
    $3=="randread-4k-qd1"   { out("randread_4k_qd1_iops", sprintf("%.0f", $8)) }
    $3=="randread-4k-qd32"  { out("randread_4k_qd32_iops", sprintf("%.0f", $8)) }
    $3=="seqread-1m"        { out("seqread_1m_MBps", sprintf("%.1f", $7*1024/1e6)) }
  ' /tmp/fio.out
}
# vm_counts: the /proc/vmstat counters the swap diagnosis prints
vm_counts() { awk '$1 ~ /^(pswpin|pswpout|pgmajfault|allocstall_normal|allocstall_movable|pgscan_kswapd|pgscan_direct|pgsteal_kswapd|pgsteal_direct|workingset_refault_anon|pgscan_anon|pgscan_file|pgsteal_file|pgrotated|nr_vmscan_write|nr_vmscan_immediate_reclaim|thp_swpout|thp_swpout_fallback|thp_fault_alloc|pgactivate|pgdeactivate)$/ {printf "%s=%s ", $1, $2}' /proc/vmstat; }
# task_times PID: "CPU SYS", the CPU seconds (user + system, all threads) PID has used and
# their system part (in the kernel on the task's behalf: for the daemon, the ublk transport
# and its copies of the I/O data), from one read of its stat; empty if it is gone
task_times() { [ -n "$1" ] && awk '{printf "%.2f %.2f", ($14 + $15) / 100, $15 / 100}' "/proc/$1/stat" 2>/dev/null; }
# cpu_delta BEFORE AFTER: AFTER - BEFORE seconds, one decimal
cpu_delta() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.1f", b - a}'; }
# the tracepoints traced with uzram.trace_vmscan=1, EVENT:TRIGGER a line (a histogram
# sums at most two fields beside its hit count, and one event takes one histogram per key:
# one line per pair, each with its own key)
TR=/sys/kernel/tracing
VMSCAN_HISTS="mm_vmscan_throttled:hist:keys=reason:vals=hitcount,usec_timeout,usec_delayed
mm_vmscan_lru_shrink_inactive:hist:keys=priority:vals=nr_scanned,nr_reclaimed
mm_vmscan_lru_shrink_inactive:hist:keys=nid:vals=nr_writeback,nr_immediate
mm_vmscan_lru_shrink_inactive:hist:keys=reclaim_flags:vals=nr_dirty,nr_ref_keep
mm_vmscan_direct_reclaim_begin:hist:keys=order:vals=hitcount
mm_vmscan_write_folio:hist:keys=reclaim_flags:vals=hitcount"
trace_start() {
  [ -n "${UZ_trace_vmscan:-}" ] || return 0
  [ -e "$TR/events/vmscan" ] || mount -t tracefs nodev "$TR" 2>/dev/null || { say "  trace: no tracefs"; return 0; }
  echo "$VMSCAN_HISTS" | while IFS= read -r _l; do
    echo "${_l#*:}" >> "$TR/events/vmscan/${_l%%:*}/trigger" 2>/dev/null || say "  trace: ${_l%%:*} refused ${_l#*:}"
  done
}
# trace_stop LABEL: prints each event's histograms (its hist file, once: an event's lines are
# together) with entries and totals, then removes every trigger
trace_stop() {
  [ -n "${UZ_trace_vmscan:-}" ] && [ -e "$TR/events/vmscan" ] || return 0
  _seen=
  echo "$VMSCAN_HISTS" | while IFS= read -r _l; do
    _f=$TR/events/vmscan/${_l%%:*}
    if [ -e "$_f/hist" ] && [ "$_seen" != "$_f" ]; then
      _seen=$_f
      grep -E '^\{|^ *(Hits|Entries|Dropped):' "$_f/hist" | head -48 | while IFS= read -r _x; do say "  $1 ${_l%%:*}: $_x"; done
    fi
    echo "!${_l#*:}" >> "$_f/trigger" 2>/dev/null
  done
}
# How many requests the kernel keeps in flight on the uzram disk while the hog swaps (so how
# many of a queue's request buffers its writes land in, which `uzram bench
# --request-buffers` stands in for): /sys/block/DEV/inflight (reads, writes; the whole disk,
# all queues) every 10 ms, a background loop; zram has no queue (it serves in the caller).
# inflight_stop ends the loop, as the hog ends, so that the hog's wall time holds none of
# the report's work; inflight_report REP NAME SUFFIX then emits the disk's queue count, the
# percentage of samples with writes in flight and, over those, the median, 90th percentile
# and most writes in flight.
inflight_start() {
  _ifp=
  [ "$1" = uzram ] || return 0
  _iff=/sys/block/${DEV#/dev/}/inflight
  [ -r "$_iff" ] || return 0
  ( while read -r _r _w < "$_iff"; do echo "$_w"; sleep 0.01; done ) > /tmp/inflight.txt 2>/dev/null &
  _ifp=$!
}
inflight_stop() {
  [ -n "$_ifp" ] || return 0
  kill "$_ifp" 2>/dev/null; wait "$_ifp" 2>/dev/null
}
inflight_report() {
  [ -n "$_ifp" ] || return 0
  _ifp=
  emit "$1" "$2" "inflight_queues$3" "$(ls -d "/sys/block/${DEV#/dev/}/mq/"* 2>/dev/null | wc -l)"
  sort -n /tmp/inflight.txt | awk -v r="$1" -v d="$2" -v s="$3" '
    function out(m, v) { printf "BENCH rep=%s dev=%s metric=%s%s value=%s\n", r, d, m, s, v }
    { n++ } $1 > 0 { b[++k] = $1 }
    END {
      out("inflight_samples", n)
      if (n == 0) exit
      out("inflight_write_pct", sprintf("%.1f", 100 * k / n))
      if (k == 0) exit
      i = int(k * 0.9 + 0.5); if (i < 1) i = 1
      out("inflight_writes_p50", b[int((k + 1) / 2)])
      out("inflight_writes_p90", b[i])
      out("inflight_writes_max", b[k])
    }'
}
# swap_bench REP NAME [SUFFIX]: mkswap + swapon $DEV, the hog (fill + verify), swapoff; wall
# times as swap_hog_s$SUFFIX (and its fill and verify parts) and swapoff_s$SUFFIX. Where the
# time went, as CPU seconds: the hog's own (faults, direct reclaim, zram's compression),
# kswapd's, and the daemon's (uzram; its I/O copies in the kernel included); the per-task
# times are exact, unlike /proc/stat's tick samples, which miss ticks under TCG; the daemon's
# system part is printed too (swap_daemon_sys_s). The vmstat
# counters of vm_counts are printed as deltas.
swap_bench() {
  if ! { mkswap "$DEV" > /dev/null && swapon ${SWAPON_DISCARD:+-d} "$DEV"; }; then say "swapon $DEV failed"; rc=1; return; fi
  _vm0=$(vm_counts)
  _kp=$(pidof kswapd0); _k0=$(task_times "$_kp")
  _dp=; [ "$2" = uzram ] && _dp=$(daemon_pid "$DEV"); _d0=$(task_times "$_dp")
  trace_start
  inflight_start "$2"
  t=$(up)
  if ! timeout -s KILL "$IO_TMO" hog "$HOG" 1 > /tmp/hog.out 2>&1; then
    say "hog on $2 failed"; cat /tmp/hog.out; rc=1
  fi
  inflight_stop
  emit "$1" "$2" "swap_hog_s$3" "$(since "$t")"
  emit "$1" "$2" "swap_fill_s$3" "$(sed -n 's/^hog: filled .* in \([0-9.]*\)s$/\1/p' /tmp/hog.out)"
  emit "$1" "$2" "swap_verify_s$3" "$(sed -n 's/^hog: verify pass 1 took \([0-9.]*\)s$/\1/p' /tmp/hog.out)"
  emit "$1" "$2" "swap_hog_cpu_s$3" "$(awk '/^hog: cpu/{printf "%.1f", $3 + $5}' /tmp/hog.out)"
  _k1=$(task_times "$_kp"); _d1=$(task_times "$_dp")
  [ -z "$_kp" ] || emit "$1" "$2" "swap_kswapd_cpu_s$3" "$(cpu_delta "${_k0%% *}" "${_k1%% *}")"
  [ -z "$_dp" ] || emit "$1" "$2" "swap_daemon_cpu_s$3" "$(cpu_delta "${_d0%% *}" "${_d1%% *}")"
  [ -z "$_dp" ] || emit "$1" "$2" "swap_daemon_sys_s$3" "$(cpu_delta "${_d0##* }" "${_d1##* }")"
  say "  $2$3 vmstat deltas: $(vm_counts | awk -v before="$_vm0" '
    BEGIN { n = split(before, b, " "); for (i = 1; i <= n; i++) { split(b[i], kv, "="); v[kv[1]] = kv[2] } }
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); printf "%s +%d ", kv[1], kv[2] - v[kv[1]] } }')"
  trace_stop "$2$3"
  inflight_report "$1" "$2" "$3"
  t=$(up)
  swapoff "$DEV" || { say "swapoff $DEV failed"; rc=1; }
  emit "$1" "$2" "swapoff_s$3" "$(since "$t")"
}
# uz_swap REP VARIANT: a uzram device with VARIANT's settings (see above), its swap run
uz_swap() {
  _pc=$PC_DEFAULT; _ms=; _nice=; _lg=; SWAPON_DISCARD=; _sv_qm=${UZ_queue_mode:-}; _sv_q=${UZ_queues:-}; _sv_d=${UZ_depth:-}
  for _kv in $(echo "$2" | tr '+' ' '); do
    case $_kv in
      page_cluster=*) _pc=${_kv#*=} ;;
      max_sectors_kb=*) _ms=${_kv#*=} ;;
      queue_mode=*) UZ_queue_mode=${_kv#*=} ;;
      queues=*) UZ_queues=${_kv#*=} ;;
      depth=*) UZ_depth=${_kv#*=} ;;
      nice=*) _nice=${_kv#*=} ;;
      lru_gen=*) _lg=${_kv#*=} ;;
      discard=1) SWAPON_DISCARD=1 ;;
      discard=0) ;;
      *) say "unknown swap variant setting $_kv"; rc=1; return ;;
    esac
  done
  echo "$_pc" > /proc/sys/vm/page-cluster
  _lg0=
  if [ -n "$_lg" ]; then
    _lg0=$(cat /sys/kernel/mm/lru_gen/enabled 2>/dev/null || true)
    echo "$_lg" > /sys/kernel/mm/lru_gen/enabled || { say "lru_gen $_lg refused"; rc=1; }
  fi
  if uz_up "$SWAP_MIB"; then
    if [ -n "$_ms" ]; then
      echo "$_ms" > "/sys/block/${DEV#/dev/}/queue/max_sectors_kb" || { say "max_sectors_kb $_ms refused"; rc=1; }
    fi
    if [ -n "$_nice" ]; then
      _np=$(daemon_pid "$DEV")
      # nice is per thread: every thread of the daemon, by id (one word each, so unquoted)
      # shellcheck disable=SC2046
      renice -n "$_nice" -p $(ls "/proc/$_np/task") > /dev/null || { say "renice $_nice refused"; rc=1; }
    fi
    say "  uzram swap run${2:+ [$2]}: discard ${SWAPON_DISCARD:-0}, lru_gen $(cat /sys/kernel/mm/lru_gen/enabled 2>/dev/null), page-cluster $(cat /proc/sys/vm/page-cluster), max_sectors_kb $(cat "/sys/block/${DEV#/dev/}/queue/max_sectors_kb"), $(create_flags)"
    swap_bench "$1" uzram "${2:+[$2]}"
    uz_down "$DEV"
  else
    rc=1
  fi
  UZ_queue_mode=$_sv_qm; UZ_queues=$_sv_q; UZ_depth=$_sv_d; SWAPON_DISCARD=
  [ -z "$_lg0" ] || echo "$_lg0" > /sys/kernel/mm/lru_gen/enabled
  echo "$PC_DEFAULT" > /proc/sys/vm/page-cluster
}

r=1
while [ $r -le "$REPS" ]; do
  if has fio; then
    zram_up "$SIZE_MIB"; fio_bench $r zram; zram_down
    if uz_up "$SIZE_MIB"; then fio_bench $r uzram; uz_down "$DEV"; else rc=1; fi
  fi
  if has null; then
    if null_up "$SIZE_MIB"; then fio_bench $r null; null_down || rc=1; else rc=1; fi
    # batch mode where the kernel has it (UBLK_F_BATCH_IO, 7.0+)
    if null_up "$SIZE_MIB" --batch; then
      fio_bench $r null_batch; null_down || rc=1
    elif kernel_has_batch_io; then
      rc=1
    fi
  fi
  if has swap; then
    echo "$PC_DEFAULT" > /proc/sys/vm/page-cluster
    zram_up "$SWAP_MIB"; swap_bench $r zram
    echo "    zram mm_stat after swap: $(cat /sys/block/zram0/mm_stat)"; zram_down
    uz_swap $r ""
    for v in $(echo "${UZ_swap_variants:-}" | tr '/' ' '); do uz_swap $r "$v"; done
  fi
  r=$((r + 1))
done
exit $rc

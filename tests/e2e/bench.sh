# Side-by-side benchmark (issue 3 item 6; printed, not asserted): zram.ko from the same kernel
# package vs uzram in the same boot, same sizes, same fio jobs (fio/bench.fio) and the same swap
# hog. Prints "BENCH rep=R dev=D metric=M value=V" lines; scripts/bench-guest tabulates them.
# Kernel args: uzram.reps (default 1), uzram.bench_mib (device size, default 512),
# uzram.bench_runtime (seconds per time-based fio job, default 10), uzram.hog_mib.
. /e2e/lib.sh
REPS=${UZ_reps:-1}
SIZE_MIB=${UZ_bench_mib:-512}
RUNTIME=${UZ_bench_runtime:-10}
AVAIL=$(mem_avail_mib)
HOG=${UZ_hog_mib:-$((AVAIL * 2))}
SWAP_MIB=$HOG
rc=0
say "bench: device ${SIZE_MIB} MiB, fio runtime ${RUNTIME}s, swap device ${SWAP_MIB} MiB, hog ${HOG} MiB (MemAvailable ${AVAIL} MiB), ${REPS} rep(s)"

for m in $(cat /lib/modules/load-order); do
  grep -q "^$m " /proc/modules || insmod "/lib/modules/$m.ko" || { say "insmod $m failed"; exit 1; }
done
[ -e /sys/block/zram0 ] || { say "zram0 missing after insmod zram"; exit 1; }

emit() { echo "BENCH rep=$1 dev=$2 metric=$3 value=$4"; }
zram_up() {  # MIB -> DEV=/dev/zram0
  echo 1 > /sys/block/zram0/reset
  echo lz4 > /sys/block/zram0/comp_algorithm
  echo "${1}M" > /sys/block/zram0/disksize
  DEV=/dev/zram0
}
zram_down() { echo 1 > /sys/block/zram0/reset; }
uz_up() { uzram_create --size "${1}M" > /dev/null; }
uz_down() { uzram_destroy "$1" > /dev/null; }

# fio_bench REP NAME: the four jobs of bench.fio on $DEV
fio_bench() {
  if ! fio_job bench.fio DEV="$DEV" SIZE="${SIZE_MIB}M" RUNTIME="$RUNTIME" > /dev/null; then
    say "fio bench on $DEV failed"; tail -20 /tmp/fio.out; rc=1; return
  fi
  awk -F';' -v r="$1" -v d="$2" '
    $3=="seqwrite-1m"  {printf "BENCH rep=%s dev=%s metric=seqwrite_1m_MBps value=%.1f\n", r, d, $48*1024/1e6}
    $3=="randwrite-4k" {printf "BENCH rep=%s dev=%s metric=randwrite_4k_iops value=%.0f\n", r, d, $49}
    $3=="randread-4k"  {printf "BENCH rep=%s dev=%s metric=randread_4k_iops value=%.0f\n", r, d, $8}
    $3=="seqread-1m"   {printf "BENCH rep=%s dev=%s metric=seqread_1m_MBps value=%.1f\n", r, d, $7*1024/1e6}
  ' /tmp/fio.out
}
# swap_bench REP NAME: mkswap + swapon $DEV, the hog (fill + verify), swapoff; wall times
swap_bench() {
  mkswap "$DEV" > /dev/null && swapon "$DEV" || { say "swapon $DEV failed"; rc=1; return; }
  t=$(up)
  if ! timeout -s KILL "$IO_TMO" hog "$HOG" 1 > /tmp/hog.out 2>&1; then
    say "hog on $2 failed"; cat /tmp/hog.out; rc=1
  fi
  emit "$1" "$2" swap_hog_s "$(since "$t")"
  t=$(up)
  swapoff "$DEV" || { say "swapoff $DEV failed"; rc=1; }
  emit "$1" "$2" swapoff_s "$(since "$t")"
}

r=1
while [ $r -le "$REPS" ]; do
  zram_up "$SIZE_MIB"; fio_bench $r zram; zram_down
  uz_up "$SIZE_MIB" && { fio_bench $r uzram; uz_down "$DEV"; } || rc=1
  zram_up "$SWAP_MIB"; swap_bench $r zram
  echo "    zram mm_stat after swap: $(cat /sys/block/zram0/mm_stat)"; zram_down
  uz_up "$SWAP_MIB" && { swap_bench $r uzram; uz_down "$DEV"; } || rc=1
  r=$((r + 1))
done
exit $rc

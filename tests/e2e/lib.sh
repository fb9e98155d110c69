# Helpers sourced by the guest scenarios (busybox sh). Each scenario calls begin NAME, then
# check/expect_* as often as it likes, then end, which prints "SCENARIO NAME PASS|FAIL".
E2E=${E2E:-/e2e}
TMO=${UZ_cmd_timeout:-60}          # seconds any single uzram command may take
IO_TMO=${UZ_io_timeout:-300}       # seconds a fio or hog run may take

up() { cut -d' ' -f1 /proc/uptime; }
say() { echo "UZRAM-E2E [$(up)s] $*"; }
since() { awk -v a="$1" -v b="$(up)" 'BEGIN{printf "%.2f", b-a}'; }
mem_avail_mib() { awk '/MemAvailable/{print int($2/1024)}' /proc/meminfo; }

begin() {
  SC_NAME=$1; SC_FAIL=0; SC_T0=$(up)
  say "--- scenario $SC_NAME"
}
# fail_check WHAT: record a failed check (the scenario keeps going, so later checks still report).
fail_check() { SC_FAIL=1; say "  FAIL: $*"; }
ok() { say "  ok: $*"; }
end() {
  if [ "$SC_FAIL" = 0 ]; then r=PASS; else r=FAIL; fi
  echo "SCENARIO $SC_NAME $r ($(since "$SC_T0")s)"
  [ "$SC_FAIL" = 0 ]
}

# run_t SECS OUTFILE CMD...: run with a time limit, stdout+stderr to OUTFILE; returns CMD's rc
# (124..143 when killed by the limit). Sets RUN_SECS.
run_t() {
  _s=$1; _o=$2; shift 2; _a=$(up)
  timeout -s KILL "$_s" "$@" > "$_o" 2>&1
  _rc=$?
  RUN_SECS=$(since "$_a")
  return $_rc
}
# check WHAT CMD...: CMD (a program, or a shell function that limits its own time) must exit 0
# within IO_TMO; prints its output on failure.
check() {
  _w=$1; shift
  case $(type "$1" 2>/dev/null) in
    *function*) _t=$(up); "$@" > /tmp/check.out 2>&1; _rc=$?; RUN_SECS=$(since "$_t") ;;
    *) run_t "$IO_TMO" /tmp/check.out "$@"; _rc=$? ;;
  esac
  if [ $_rc = 0 ]; then ok "$_w (${RUN_SECS}s)"; return 0; fi
  fail_check "$_w: rc=$_rc after ${RUN_SECS}s: $*"
  sed 's/^/    | /' /tmp/check.out | tail -40
  return 1
}
# expect_refused WHAT PATTERN CMD...: CMD must exit != 0 (not by the time limit) within TMO and
# print a message matching the egrep PATTERN (case-insensitive).
expect_refused() {
  _w=$1; _p=$2; shift 2
  run_t "$TMO" /tmp/refused.out "$@"
  _rc=$?
  _msg=$(head -c 300 /tmp/refused.out | tr '\n' ' ')
  if [ $_rc = 0 ]; then fail_check "$_w: exit 0, expected a refusal: $* -> $_msg"; return 1; fi
  if [ $_rc -ge 124 ]; then fail_check "$_w: killed after ${RUN_SECS}s (hang?): $*"; return 1; fi
  if ! grep -qiE "$_p" /tmp/refused.out; then
    fail_check "$_w: rc=$_rc but message does not match /$_p/: $_msg"; return 1
  fi
  ok "$_w: rc=$_rc: $_msg"
}

# Queue settings from the kernel command line, added to every uzram_create: uzram.queue_mode
# (--queue-mode), uzram.queues, uzram.depth; uzram.checksums=off (--no-checksums, for the
# benchmark: TCG emulates the CRC's carry-less multiplications slowly, see
# docs/bench/2026-12-guest.md). uzram.expect_queue_mode: the mode `uzram status` must then
# show (scripts/test checks that each kernel gets the mode it should).
create_flags() {
  [ -z "${UZ_queue_mode:-}" ] || printf -- '--queue-mode %s ' "$UZ_queue_mode"
  [ -z "${UZ_queues:-}" ] || printf -- '--queues %s ' "$UZ_queues"
  [ -z "${UZ_depth:-}" ] || printf -- '--depth %s ' "$UZ_depth"
  [ "${UZ_checksums:-on}" != off ] || printf -- '--no-checksums '
}
# uzram_create [--default] ARGS...: sets DEV (path printed alone on stdout) or fails the
# check; checks the queue mode against uzram.expect_queue_mode. Without --default the device
# gets no standby (--no-standby): the scenarios measure memory with the daemon alone, and the
# ones that crash a daemon start their recovery themselves. --default creates it as a user
# would, with its standby.
uzram_create() {
  DEV=
  _sb=--no-standby
  [ "${1:-}" = --default ] && { _sb=; shift; }
  # shellcheck disable=SC2046 # create_flags is a list of words
  run_t "$TMO" /tmp/create.out uzram create "$@" $_sb $(create_flags)
  _rc=$?
  _out=$(grep -E '^/dev/ublkb[0-9]+$' /tmp/create.out | head -1)
  if [ $_rc != 0 ] || [ -z "$_out" ] || [ ! -b "$_out" ]; then
    fail_check "uzram create $*: rc=$_rc after ${RUN_SECS}s, output: $(head -c 400 /tmp/create.out | tr '\n' ' ') ... $(grep -v ' INFO ' /tmp/create.out | tail -c 600 | tr '\n' ' ')"
    return 1
  fi
  if [ "$(grep -c . /tmp/create.out)" != 1 ] && [ "$(head -1 /tmp/create.out)" != "$_out" ]; then
    say "  note: create printed more than the path: $(head -c 200 /tmp/create.out | tr '\n' ' ')"
  fi
  DEV=$_out
  _m=$(status_str "$DEV" queue_mode)
  ok "uzram create $* $(create_flags)-> $DEV (${RUN_SECS}s), queue_mode ${_m:-?}, io_threads_per_queue $(stat_field "$DEV" io_threads_per_queue), ring flags $(stat_field "$DEV" queue_ring_setup_flags)"
  if [ -n "${UZ_expect_queue_mode:-}" ] && [ "$_m" != "$UZ_expect_queue_mode" ]; then
    fail_check "queue_mode is '$_m', expected '$UZ_expect_queue_mode' on $(uname -r)"
  fi
}
# uzram_destroy DEV: destroy must succeed and the block device must disappear.
uzram_destroy() {
  check "uzram destroy $1" uzram destroy "$1" || return 1
  _i=0
  while [ -e "$1" ]; do
    _i=$((_i + 1)); [ $_i -gt 200 ] && { fail_check "$1 still present 10s after destroy"; return 1; }
    usleep 50000
  done
  ok "$1 is gone"
}
# stat_field DEV FIELD: a number from `uzram status DEV --json`, whether the JSON holds it as
# "FIELD": N or as {"name": "FIELD", "value": N}.
stat_field() {
  _j=$(timeout -s KILL "$TMO" uzram status "$1" --json 2>/dev/null | tr -d ' \n\t')
  _v=$(echo "$_j" | sed -n "s/.*\"name\":\"$2\",\"value\":\([0-9][0-9]*\).*/\1/p")
  [ -n "$_v" ] || _v=$(echo "$_j" | sed -n "s/.*\"$2\":\([0-9][0-9]*\).*/\1/p")
  echo "$_v"
}
# status_str DEV FIELD: a top-level string of `uzram status DEV --json`.
status_str() {
  timeout -s KILL "$TMO" uzram status "$1" --json 2>/dev/null | tr -d ' \n\t' | sed -n "s/.*\"$2\":\"\([^\"]*\)\".*/\1/p"
}
# wait_gone PID: waits up to 10 s for PID to be gone; fails if it is still there.
wait_gone() { _i=0; while kill -0 "$1" 2>/dev/null && [ $_i -lt 100 ]; do _i=$((_i + 1)); usleep 100000; done; ! kill -0 "$1" 2>/dev/null; }
# daemon_pid DEV: the process that holds /dev/ublkcN open (the daemon serving DEV).
daemon_pid() {
  _c=/dev/ublkc${1#/dev/ublkb}
  for _f in /proc/[0-9]*/fd/*; do
    [ "$(readlink "$_f" 2>/dev/null)" = "$_c" ] && { _p=${_f#/proc/}; echo "${_p%%/fd/*}"; return 0; }
  done
  return 1
}
# daemon_log PID: the log file process PID writes (its open file under /run/uzram ending in .log).
daemon_log() {
  for _f in /proc/"$1"/fd/*; do
    _l=$(readlink "$_f" 2>/dev/null) || continue
    case $_l in /run/uzram/*.log) echo "$_l"; return 0 ;; esac
  done
  return 1
}
# log_tail_stays DEV: pushes the log of DEV's daemon out to swap as reclaim would (pageout);
# the page holding its end must stay in memory (pinned_log.rs): were it swapped out, a
# daemon that crashed while its log writer waited for it could never exit. A file of the
# scenario's own on the same tmpfs, pushed with it, must go, or the push proved nothing.
log_tail_stays() {
  _lp=$(daemon_pid "$1") && _log=$(daemon_log "$_lp") || { fail_check "no log file of the daemon of $1"; return; }
  for _i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do cat /e2e/lib.sh; done | head -c 65536 > /run/pageout-control
  # Reclaim takes only pages on the LRU lists; a page written lately may still sit in a
  # CPU's batch of pages to add (and 7.x's MADV_PAGEOUT drains none): compaction drains them
  # all. Right after the hog a push on 7.3 sometimes moved no page at all (1 boot of 3; the
  # next try did): it is tried again, up to 30 times a second apart, until it moves the file.
  _t=0
  while :; do
    echo 1 > /proc/sys/vm/compact_memory
    _po=$(pageout "$_log" /run/pageout-control) || { fail_check "pageout $_log failed"; return; }
    _cs=$(echo "$_po" | grep '^/run/pageout-control ' | sed -n 's/.* swapped=\([0-9]*\) .*/\1/p')
    [ "${_cs:-0}" -lt 8 ] && [ $_t -lt 30 ] || break
    _t=$((_t + 1)); sleep 1
  done
  rm -f /run/pageout-control
  echo "$_po" | sed "s/^/    | pageout (after $_t more tries): /"
  case $(echo "$_po" | grep "^$_log ") in
    *last_swapped=0) ok "the log's last page stayed in memory" ;;
    *) fail_check "the log's last page went to swap" ;;
  esac
  [ -n "$_cs" ] && [ "$_cs" -ge 8 ] && ok "the same push sent $_cs of a file's 16 pages to swap" \
    || fail_check "the push sent ${_cs:-?} of a file's 16 pages to swap: it proved nothing"
}
# single_cpu_threads PID: how many threads of PID may run on one CPU only (libublk pins each
# queue thread to its queue's CPUs: one each with as many queues as CPUs); io_uring's workers
# are left out.
single_cpu_threads() {
  _n=0
  for _t in /proc/"$1"/task/*; do
    case "$(cat "$_t/comm" 2>/dev/null)" in iou-*) continue ;; esac
    _l=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$_t/status" 2>/dev/null)
    case "$_l" in *[,-]* | "") ;; *) _n=$((_n + 1)) ;; esac
  done
  echo "$_n"
}
# fio_job FILE VAR=VALUE...: run a fio job file with a time limit; prints fio's terse output
# (also kept in /tmp/fio.out) and returns fio's exit status.
fio_job() {
  _j=$E2E/fio/$1; shift
  for _kv in "$@"; do
    # fio would create a regular file where a vanished device node was
    case $_kv in DEV=*) [ -b "${_kv#DEV=}" ] || { echo "fio_job: ${_kv#DEV=} is not a block device"; return 1; } ;; esac
  done
  run_t "$IO_TMO" /tmp/fio.out env "$@" fio --output-format=terse --terse-version=3 "$_j"
  _frc=$?
  cat /tmp/fio.out
  return $_frc
}

# kernel_has_batch_io: whether the running kernel's ublk driver has UBLK_F_BATCH_IO (7.0+),
# which ublk_null --batch needs
kernel_has_batch_io() { [ "$(uname -r | cut -d. -f1)" -ge 7 ]; }
# null_up MIB [--batch] -> DEV, NULL_PID: a ublk_null device (crates/uzram/examples/ublk_null.rs,
# the benchmark's transport floor) with uzram's default queue count (one a CPU, at most 4) and
# depth, or uzram.queues and uzram.depth; fails, with ublk_null's output, if it exits or has no
# device after 10 s.
null_up() {
  _nq=${UZ_queues:-$(nproc)}; [ "$_nq" -le 4 ] || _nq=4
  ublk_null ${2:-} --queues "$_nq" --depth "${UZ_depth:-64}" --size-mib "$1" > /tmp/null.out 2>&1 &
  NULL_PID=$!
  for _i in $(seq 100); do
    DEV=$(grep -m1 '^/dev/ublkb' /tmp/null.out || true)
    [ -n "$DEV" ] && [ -b "$DEV" ] && { say "ublk_null${2:+ $2}: $DEV, $_nq queue(s) of depth ${UZ_depth:-64}"; return 0; }
    kill -0 "$NULL_PID" 2>/dev/null || break
    usleep 100000
  done
  say "ublk_null${2:+ $2} did not start: $(head -c 400 /tmp/null.out | tr '\n' ' ')"
  kill -KILL "$NULL_PID" 2>/dev/null; wait "$NULL_PID" 2>/dev/null
  return 1
}
# null_down: stops ublk_null (SIGTERM) and returns its exit status; 137 if it was still there
# after 10 s (then killed).
null_down() {
  kill -TERM "$NULL_PID" 2>/dev/null
  ( sleep 10; kill -KILL "$NULL_PID" 2>/dev/null ) &
  _wd=$!
  wait "$NULL_PID"; _nrc=$?
  kill "$_wd" 2>/dev/null; wait "$_wd" 2>/dev/null
  return $_nrc
}

# pcp_fraction_boot: vm.percpu_pagelist_high_fraction as the boot set it: the kernel's default
# (0), or the value the kernel command line gave (scripts/test's 7.3 boots hold the per-CPU
# free lists short, as the systemd unit does). A recovery holds them short only from the
# default and puts the default back (memory/free_lists.rs): r and d expect this value after.
pcp_fraction_boot() {
  _v=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^sysctl\.vm\.percpu_pagelist_high_fraction=//p' | tail -1)
  echo "${_v:-0}"
}

# pcp_fraction_settles WANT: waits up to 5 s for vm.percpu_pagelist_high_fraction to read WANT
# (a new daemon puts the lists back once it serves, not at once); prints the last value read,
# and succeeds iff it was WANT.
pcp_fraction_settles() {
  for _i in 1 2 3 4 5; do
    _pv=$(cat /proc/sys/vm/percpu_pagelist_high_fraction)
    [ "$_pv" = "$1" ] && break
    sleep 1
  done
  echo "$_pv"
  [ "$_pv" = "$1" ]
}

# programs_source FILE BYTES: up to BYTES of the guest's programs in FILE (real bytes, as
# files hold them); sets MIB (the whole MiB in it) and WANT (the sha256 of those MiB).
programs_source() {
  # shellcheck disable=SC2046 # the programs, as files (busybox's head takes bytes, no M)
  cat $(find /usr/local/bin /usr/bin /bin /sbin -type f 2>/dev/null) 2>/dev/null | head -c "$2" > "$1"
  MIB=$(( $(stat -c %s "$1") / 1048576 ))
  WANT=$(head -c $((MIB * 1048576)) "$1" | sha256sum | cut -d' ' -f1)
}
# scratch_disk: the guest's blank virtio disk for writeback (serial uzramscratch, given by
# scripts/guest/run-vm), or nothing.
scratch_disk() {
  for _d in /sys/block/vd*; do
    [ "$(cat "$_d/serial" 2>/dev/null)" = uzramscratch ] && echo "/dev/${_d##*/}"
  done
}
# hog_swap_device: swap (with discard) on a new device sized for a hog of 2x the memory that
# is available once the daemon runs; sets DEV, AVAIL0 (MiB available before the daemon),
# AVAIL (with it), HOG and SIZE_MIB, or fails the check.
# - The hog is sized against what is available once the daemon runs: its pre-faulted reserves
#   (a 64 MiB block pool, stacks, heap headroom) are memory the hog cannot have. Sized before,
#   the hog's compressed pages plus those reserves left a few MiB, and the OOM killer took the
#   hog at its first swap-ins (two CI runs on 6.12).
# - The device holds the largest such hog with a quarter to spare: a device of exactly the
#   hog's size filled up in two 7.3 per-io-daemon runs (more pages swapped out than the hog
#   has), no write had failed, and the OOM killer took the hog.
# - Discard, as `uzram swap-on` and the unit swap (zram-generator's default): without it a
#   ublk device never hears of freed swap slots, so the store keeps their stale pages until the
#   slot is written again; with more slots than the hog needs those grew the daemon by 130 MiB
#   in a verify pass (OOM on 6.12). On 7.3 it is the other way round: with discard the OOM
#   killer took b's hog in 5 of 5 runs, without it b passed. What the logs show: the verify
#   pass swaps out 1.4-1.6x the hog's pages, the daemon's locked memory grows to 410-430 MiB
#   of the guest's 458, and the kernel then fails to allocate a swap cluster table
#   (swap_cluster_alloc_table, __GFP_HIGH|__GFP_NOMEMALLOC, new in 7.x) while swapping out,
#   so the hog cannot be swapped and is killed. vm.min_free_kbytes=16384 did not help. The
#   free pages that allocation could not reach sat on the per-CPU lists; with those held
#   short (sysctl.vm.percpu_pagelist_high_fraction=524288, as the unit sets it) the 7.3 boots
#   swap with discard again (README, swap tuning). (Those runs had a hog of 2x; the 7.3 boots
#   run 1.75x.) uzram.swap_discard=0 swaps without discard, for comparison.
# - uzram.hog_pct (default 200): the hog as a percentage of that memory. The 7.3 boots use
#   175: at 200 the OOM killer took b's hog in its verify pass in 1 of the 6 7.3 boots of
#   this release's CI runs, with swap half free (a swap-in's readahead found no page: reclaim
#   could not free the hog's pages fast enough while their writes waited on the daemon;
#   6.12 passes at 200). A gap of uzram's swap-out speed, not hidden: README, known gaps.
# - vm.compact_unevictable_allowed=0: see scenario b's queue_page_faults check.
# - uzram.watermark_scale_factor (unset: the kernel's 10): vm.watermark_scale_factor, the gap
#   between the watermarks at which kswapd starts and stops reclaiming, in 0.01 % of memory.
#   A ublk device's swap writes complete only when the daemon answers, so pages under
#   writeback cannot be freed at once as zram's can; at the default gap of 0.1 % (0.65 MiB in
#   this guest) the hog's own allocations do most of the reclaim, and in one CI boot on 7.3
#   (per-io-daemon, a then b) the OOM killer took b's hog 8 s into its fill with 66 MiB in
#   swap. The 7.3 boots pass 200 (scripts/test). Four interleaved pairs of that boot:
#   hog 52.7-57.1 s at 10, 47.7-50.3 s at 200; pgscan_direct 0.82-1.00 million against
#   0.62-0.84; allocstall 70-87 against 52-83; no OOM in either (README, swap tuning).
# cgroup_for_hog NAME MIB: a memory cgroup /sys/fs/cgroup/NAME whose memory.max is MIB
# (cgroup2 mounted if it is not); false when the kernel has none.
cgroup_for_hog() {
  [ -e /sys/fs/cgroup/cgroup.controllers ] || mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || return 1
  grep -qw memory /sys/fs/cgroup/cgroup.controllers || return 1
  echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
  mkdir -p "/sys/fs/cgroup/$1" && echo "$2M" > "/sys/fs/cgroup/$1/memory.max"
}
hog_swap_device() {
  AVAIL0=$(mem_avail_mib)
  SIZE_MIB=${UZ_swap_dev_mib:-$(((AVAIL0 * 2 + 16) * 5 / 4))}
  echo 0 > /proc/sys/vm/compact_unevictable_allowed
  [ -z "${UZ_watermark_scale_factor:-}" ] || echo "$UZ_watermark_scale_factor" > /proc/sys/vm/watermark_scale_factor
  uzram_create --size "${SIZE_MIB}M" || return 1
  AVAIL=$(mem_avail_mib)
  HOG=${UZ_hog_mib:-$((AVAIL * ${UZ_hog_pct:-200} / 100 + 16))}
  say "  MemAvailable ${AVAIL0} MiB before the daemon, ${AVAIL} MiB with it -> hog ${HOG} MiB, device ${SIZE_MIB} MiB"
  if [ "${UZ_swap_discard:-1}" = 1 ]; then
    check "mkswap" mkswap "$DEV" && check "swapon --discard" swapon -d "$DEV"
  else
    check "mkswap" mkswap "$DEV" && check "swapon (no discard)" swapon "$DEV"
  fi
  return 0
}
# wait_holding PID OUT: until the hog PID, writing to OUT, has filled its memory (or died).
wait_holding() {
  _i=0
  while ! grep -q 'holding' "$2"; do
    kill -0 "$1" 2>/dev/null || break
    _i=$((_i + 1)); [ $_i -gt $((IO_TMO * 10)) ] && break
    usleep 100000
  done
}

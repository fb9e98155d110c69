# Scenario n: ublk_null, the benchmark's transport floor (crates/uzram/examples/ublk_null.rs;
# README, "The transport's floor"), does what the benchmark takes from it: its device appears,
# completes 4 KiB random and 128 KiB sequential reads and writes at depth with the lengths
# asked for, and is deleted when ublk_null is stopped, which then exits 0. In both of uzram's
# loops where the kernel has them: per-queue everywhere, --batch where the driver offers
# UBLK_F_BATCH_IO (7.0+); elsewhere --batch is refused before any device exists. It tests the
# benchmark's tool, not uzram's data path.
. /e2e/lib.sh
begin n_null_floor
ndev() { ls /dev/ublkb* 2>/dev/null | wc -l; }
null_serves() {  # [--batch]
  if ! null_up 64 "$@"; then fail_check "ublk_null${1:+ $1} did not start"; return; fi
  _d=$DEV; _l="ublk_null${1:+ $1}"
  check "$_l: 4K random and 128K sequential I/O on $_d" fio_job null.fio DEV="$_d"
  null_down; _rc=$?
  if [ $_rc = 0 ]; then ok "$_l stopped (exit 0)"; else
    fail_check "$_l exited $_rc after SIGTERM: $(tail -c 300 /tmp/null.out | tr '\n' ' ')"; fi
  _i=0; while [ -e "$_d" ] && [ $_i -lt 50 ]; do _i=$((_i + 1)); usleep 100000; done
  if [ -e "$_d" ]; then fail_check "$_d still present 5 s after $_l stopped"; else ok "$_d deleted"; fi
}
null_serves
if kernel_has_batch_io; then
  null_serves --batch
else
  _n=$(ndev)
  expect_refused "ublk_null --batch on $(uname -r)" 'UBLK_F_BATCH_IO' ublk_null --batch --size-mib 64
  if [ "$(ndev)" = "$_n" ]; then ok "no device added by the refused --batch"; else
    fail_check "the refused --batch left a device: $(ls /dev/ublkb* | tr '\n' ' ')"; fi
fi
end

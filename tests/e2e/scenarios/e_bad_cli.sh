# Scenario e: bad CLI input exits != 0 with a message that names the problem.
# Runs first, while no device exists (it unloads ublk_drv for the "module absent" check).
. /e2e/lib.sh
begin e_bad_cli
expect_refused "size 0" 'size' uzram create --size 0
expect_refused "absurd size" 'size|too (large|big)|exceed|memory' uzram create --size 1000000T
expect_refused "unparsable size" 'size|invalid' uzram create --size 12Q
# a size whose page table alone the guest cannot hold (a typo: T for G), refused before any
# memory is taken, with the largest size that fits
_n0=$(tail -n +2 /proc/sysvipc/shm | wc -l)
expect_refused "a device the host cannot hold" 'RAM.*largest device that fits' uzram create --size 16T
expect_refused "a memory limit below the page table" 'mem-limit.*page table' uzram create --size 1G --mem-limit 4K
_n1=$(tail -n +2 /proc/sysvipc/shm | wc -l)
[ "$_n1" = "$_n0" ] && ok "no shared memory taken by the refused creates" \
  || fail_check "$((_n1 - _n0)) shared memory segments made by refused creates"
# check-config refuses what the daemon refuses (exit 255: an invalid file), and reads only
# regular files (a FIFO no one writes to once held it, and the generator at boot, forever)
printf 'size = "16T"\n' > /tmp/e-big.toml
rm -f /tmp/e-fifo.toml && mkfifo /tmp/e-fifo.toml
for _c in "/tmp/e-big.toml:RAM" "/dev/zero:a character device, not a regular file" "/tmp/e-fifo.toml:a FIFO, not a regular file"; do
  run_t "$TMO" /tmp/refused.out uzram check-config --config "${_c%%:*}"; _rc=$?
  [ $_rc = 255 ] && grep -q "${_c#*:}" /tmp/refused.out \
    && ok "check-config ${_c%%:*}: rc=255 in ${RUN_SECS}s: $(head -c 200 /tmp/refused.out | tr '\n' ' ')" \
    || fail_check "check-config ${_c%%:*}: rc=$_rc, $(head -c 300 /tmp/refused.out | tr '\n' ' ')"
done
rm -f /tmp/e-fifo.toml
expect_refused "unknown algorithm" 'algorithm|foo' uzram create --size 64M --algorithm foo
expect_refused "gpu backend without a GPU" 'gpu|cuda|nvidia' uzram create --size 64M --backend gpu
expect_refused "GPU recompressor without a GPU" 'lz4-gpu.*recompress-algorithm zstd' uzram create --size 64M --recompress-algorithm lz4-gpu
expect_refused "nvCOMP recompressor without a GPU" 'zstd-gpu.*recompress-algorithm zstd' uzram create --size 64M --recompress-algorithm zstd-gpu
expect_refused "unknown queue mode" 'queue mode.*turbo' uzram create --size 64M --queue-mode turbo
# a mode asked for by name that the kernel lacks is refused, not silently replaced (6.12)
if [ "${UZ_expect_queue_mode:-}" = per-queue ]; then
  expect_refused "batch queue mode without UBLK_F_BATCH_IO" 'UBLK_F_BATCH_IO' uzram create --size 64M --queue-mode batch
  expect_refused "per-io-daemon without UBLK_F_PER_IO_DAEMON" 'UBLK_F_PER_IO_DAEMON' uzram create --size 64M --queue-mode per-io-daemon
fi
expect_refused "status of an unknown device" 'ublkb7|no such|not found|unknown' uzram status /dev/ublkb7
expect_refused "destroy of an unknown device" 'ublkb7|no such|not found|unknown' uzram destroy /dev/ublkb7
if su -s /bin/sh nobody -c 'test "$(id -u)" = 65534'; then
  expect_refused "not root" 'root|permission|privilege' su -s /bin/sh nobody -c 'uzram create --size 64M'
else
  fail_check "cannot run a command as nobody (su)"
fi
# A backing device with far more blocks than the guest can keep records for (a sparse file
# of 1 TiB, as a large partition would be: 3 GiB of nonce floors and use counts): refused
# once it is open, and the device and store made before are gone again.
_n0=$(tail -n +2 /proc/sysvipc/shm | wc -l)
truncate -s 1099511627776 /tmp/e-huge.wb && chmod 600 /tmp/e-huge.wb
expect_refused "a backing device whose records the guest cannot hold" 'writeback-device /tmp/e-huge.wb.*smaller partition' \
  uzram create --size 64M --writeback-device /tmp/e-huge.wb
i=0
while [ "$(tail -n +2 /proc/sysvipc/shm | wc -l)" != "$_n0" ] && [ $i -lt 100 ]; do
  i=$((i + 1)); usleep 50000
done
_n1=$(tail -n +2 /proc/sysvipc/shm | wc -l)
[ "$_n1" = "$_n0" ] && ok "no shared memory left by the create refused for its backing device" \
  || fail_check "$((_n1 - _n0)) shared memory segments left by the create refused for its backing device"
rm -f /tmp/e-huge.wb
# A file of root's named by mistake (mode 0600, one name, as a key file is): it holds data
# that is neither zeros nor uzram's label, so it is refused and left as it was.
(umask 077 && head -c 6000 /bin/sh > /tmp/e-data.wb)
_sum=$(sha256sum < /tmp/e-data.wb)
expect_refused "a backing file holding someone's data" "writeback-device /tmp/e-data.wb holds data that is not uzram's.*rm /tmp/e-data.wb" \
  uzram create --size 64M --writeback-device /tmp/e-data.wb
[ "$(sha256sum < /tmp/e-data.wb)" = "$_sum" ] && ok "the refused backing file is unchanged ($(stat -c %s /tmp/e-data.wb) bytes)" \
  || fail_check "the refused backing file was changed: $(stat -c %s /tmp/e-data.wb) bytes"
rm -f /tmp/e-data.wb
# A writeback file deep in a system tree, or reached through a link into one: the unit's
# drop-in would open that directory to the daemon.
expect_refused "a writeback file under /etc" 'system directory' \
  uzram create --size 64M --writeback-device /etc/systemd/e-wb.wb
ln -s /run /tmp/e-link && expect_refused "a writeback file through a link into /run" 'system directory' \
  uzram create --size 64M --writeback-device /tmp/e-link/e-wb.wb
rm -f /tmp/e-link
if [ -n "$(ls /dev/ublkb* 2>/dev/null)" ]; then
  fail_check "a device exists after refused creates: $(ls /dev/ublkb*)"
fi
if rmmod ublk_drv; then
  expect_refused "ublk module absent" 'ublk_drv|modprobe|ublk-control' uzram create --size 64M
  insmod /lib/modules/ublk_drv.ko || fail_check "re-insmod ublk_drv"
  i=0
  while [ ! -e /dev/ublk-control ]; do
    i=$((i + 1)); [ $i -gt 200 ] && { fail_check "/dev/ublk-control did not come back"; break; }
    usleep 50000
  done
else
  fail_check "could not rmmod ublk_drv to test the module-absent message"
fi
end

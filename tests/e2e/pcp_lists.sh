# Measurement (run by hand: scripts/e2e pcp_lists): where the pages of a freed 48 MiB range
# go, as a recovery's room does when it is given back (memory/free_lists.rs). Frees 48 MiB of
# tmpfs on CPU 0 twice at each setting of vm.percpu_pagelist_high_fraction: the kernel's
# default (0) and the one a recovery holds (1048576), and prints each CPU's free list
# (count/limit/batch of /proc/zoneinfo) and MemFree right after. Fails unless, held short,
# the pages show in MemFree at once (at least 40 of the 48 MiB).
. /e2e/lib.sh
begin pcp_lists
pcp() {
  awk '/^Node/{z=$4} /cpu:/{c=$2} /count:/{cnt=$2} /high:/{h=$2} /batch:/{ if (z=="DMA32"||z=="Normal") printf "%s/cpu%s %s/%s/%s  ", z, c, cnt, h, $2 }' /proc/zoneinfo
  awk '/MemFree/{printf " MemFree %d KiB", $2}' /proc/meminfo
}
free_kib() { awk '/MemFree/{print $2}' /proc/meminfo; }
mkdir -p /dev/shm
mount -t tmpfs tmpfs /dev/shm 2>/dev/null
OLD=$(cat /proc/sys/vm/percpu_pagelist_high_fraction)
for F in 0 1048576 0 1048576; do
  echo $F > /proc/sys/vm/percpu_pagelist_high_fraction
  say "fraction $F: before $(pcp)"
  taskset -c 0 dd if=/dev/zero of=/dev/shm/room bs=1M count=48 2>/dev/null
  sleep 1
  f0=$(free_kib)
  say "  48 MiB filled: $(pcp)"
  taskset -c 0 rm /dev/shm/room
  f1=$(free_kib)
  say "  freed: $(pcp)  (MemFree +$(( (f1 - f0) / 1024 )) MiB)"
  sleep 2
  say "  2 s later: $(pcp)  (MemFree +$(( ($(free_kib) - f0) / 1024 )) MiB)"
  if [ $F != 0 ]; then
    [ $(( (f1 - f0) / 1024 )) -ge 40 ] && ok "held short: the freed pages count as free at once" \
      || fail_check "held short, only $(( (f1 - f0) / 1024 )) MiB of 48 counted free at once"
  fi
done
echo "$OLD" > /proc/sys/vm/percpu_pagelist_high_fraction
end

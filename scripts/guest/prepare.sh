# Sourced by the scripts that boot the guest (e2e, demo, bench-guest, stress-swap,
# e2e-systemd); needs ROOT set to the repository root.
# guest_prepare PREFIX: fetches the kernel GUEST_KERNEL (a name of scripts/guest/kernels, default
# 6.12) and builds the guest's binaries. Sets KDIR, KERNEL (its vmlinuz), KPIN (its line of
# scripts/guest/kernels: exact packages and versions), WORK (a fresh /tmp/PREFIX.XXXXXX, per
# run, so concurrent runs do not collide) and BINS. Under set -e a failed download or build
# stops the caller. Removing WORK is the caller's choice (trap 'rm -rf "${WORK:-}"' EXIT before
# calling).
# What every 7.x boot passes (the harness's settings for the newer kernel; scripts/test says
# why each is there, above its T73): a hog of 1.75x, kswapd's head start, and the per-CPU free
# lists held short, as the unit holds them.
# shellcheck disable=SC2034 # for the sourcing script
GUEST_7X_ARGS="uzram.hog_pct=175 uzram.watermark_scale_factor=200 sysctl.vm.percpu_pagelist_high_fraction=524288"
guest_prepare() {
  KDIR=$("$ROOT/scripts/guest/fetch-kernel" "${GUEST_KERNEL:-6.12}")
  # shellcheck disable=SC2034 # KERNEL, KPIN and IMGS are for the sourcing script
  KERNEL=$(find "$KDIR" -path '*/boot/vmlinuz-*' -o -path '*/modules/*/vmlinuz' | head -1)
  # shellcheck disable=SC2034
  KPIN=$(cut -d' ' -f1-3 "$KDIR/pin")
  WORK=$(mktemp -d "/tmp/$1.XXXXXX")
  "$ROOT/scripts/guest/build-bins" > "$WORK/bins"
  mapfile -t BINS < "$WORK/bins"
}

# guest_images: after guest_prepare, builds the standard initramfs (and the fio disk image)
# into WORK; sets IMGS, the images to hand to run-vm after the kernel.
guest_images() {
  "$ROOT/scripts/guest/build-initramfs" "$KDIR" "$WORK/initramfs.cpio.gz" "${BINS[@]}" > "$WORK/imgs"
  # shellcheck disable=SC2034
  mapfile -t IMGS < "$WORK/imgs"
}

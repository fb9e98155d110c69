//! Block-layer settings of the device once its disk exists.
//!
//! Writeback throttling (wbt) is on by default for a blk-mq disk like ours. It limits swap
//! writes in flight and shrinks that limit whenever completions look slow, which under memory
//! pressure parks kswapd, the pool keeper and every allocating task in `wbt_wait` while the
//! daemon has nothing to do (seen in the guest). zram, a bio-based disk, is never throttled:
//! a RAM device gains nothing from it, so it is turned off here.

use std::path::PathBuf;

/// Applies the settings to `/sys/block/ublkb<id>`; each failure is logged, none is fatal
/// (an older kernel may lack the knob; the device still works, only slower under pressure).
pub fn tune(id: u32) {
    let dir = PathBuf::from(format!("/sys/block/ublkb{id}/queue"));
    // 0 turns wbt off for this disk.
    let wbt = dir.join("wbt_lat_usec");
    match std::fs::write(&wbt, "0") {
        Ok(()) => tracing::info!(path = %wbt.display(), "writeback throttling off"),
        Err(err) => tracing::warn!(
            path = %wbt.display(),
            error = %err,
            "turning writeback throttling off failed: swap writes may stall under pressure"
        ),
    }
}

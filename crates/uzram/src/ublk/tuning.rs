//! Block-layer settings of the device once its disk exists.
//!
//! Writeback throttling (wbt) is on by default for a blk-mq disk like ours. It limits swap
//! writes in flight and shrinks that limit whenever completions look slow, which under memory
//! pressure parks kswapd, the pool keeper and every allocating task in `wbt_wait` while the
//! daemon has nothing to do (seen in the guest). zram, a bio-based disk, is never throttled:
//! a RAM device gains nothing from it, so it is turned off here.
//!
//! The request timeout (`io_timeout`, 30 s by default) is set short. While the daemon lives
//! the kernel only re-arms it (a slow request is never failed). After a crash on 6.12 it is
//! what frees a queue whose every request the dead daemon had taken: such a queue gets no
//! cancel callback, so the device stays live, and no new daemon can take it over, until one
//! of those requests times out (seen in the guest as a standby that waited 30 s and more).

use std::path::PathBuf;

/// The request timeout set on the disk, in milliseconds: the longest a crash can leave the
/// device waiting for the kernel to quiesce it (module doc).
pub const IO_TIMEOUT_MS: u32 = 1000;

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
    let timeout = dir.join("io_timeout");
    match std::fs::write(&timeout, IO_TIMEOUT_MS.to_string()) {
        Ok(()) => {
            tracing::info!(path = %timeout.display(), ms = IO_TIMEOUT_MS, "request timeout set")
        }
        Err(err) => tracing::warn!(
            path = %timeout.display(),
            error = %err,
            "setting the request timeout failed: after a crash the device may wait up to 30 s for a takeover"
        ),
    }
}

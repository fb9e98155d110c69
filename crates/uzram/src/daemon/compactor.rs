//! Gives the store's freed memory back: compacts the arena when freed holes pile up.
//!
//! A swapped-out page that is swapped in (or discarded) leaves a hole in its arena segment.
//! Holes are reused by later pages of the same size class, but after a burst of swap-ins most
//! of them may never be: the segments stay, and so does their memory. Compaction slides the
//! live pages down and releases the emptied segments to the block pool, whose keeper gives
//! blocks beyond its reserve back to the system (`pool::trim`). zsmalloc does the same from
//! a shrinker; here a thread checks the holes every second, once no block has been taken from
//! the pool for a few seconds (the holes themselves show that the store shrank).

use std::sync::Arc;
use std::time::{Duration, Instant};

use uzram_core::store::PageStore;

/// How often the holes are measured.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// The least time between two compactions: each stops every queue for its duration (tens of
/// milliseconds per GiB stored), so a store that frees and refills at a steady rate should
/// not compact every second.
const MIN_INTERVAL: Duration = Duration::from_secs(3);
/// Holes below this many bytes are not worth stopping the queues for.
const MIN_HOLE_BYTES: u64 = 8 << 20;

/// Whether `holes` free bytes among `segments` bytes of arena call for compaction: at least
/// `MIN_HOLE_BYTES`, and a quarter of the segments.
pub fn worth_compacting(holes: u64, segments: u64) -> bool {
    holes >= MIN_HOLE_BYTES && holes.saturating_mul(4) >= segments
}

/// Runs forever on its own thread (set up as an I/O-path thread: it holds the shard locks
/// that the queue threads wait for, so it must not fault into reclaim meanwhile).
pub fn keep(store: Arc<PageStore>) {
    let mut last: Option<Instant> = None;
    loop {
        std::thread::sleep(CHECK_EVERY);
        // Only once the store stopped growing: during a swap-out storm holes are refilled by
        // new pages anyway, and a stop-the-world pass would stall the queues when they are
        // needed most.
        if last.is_some_and(|t| t.elapsed() < MIN_INTERVAL)
            || super::pool::quiet_for() < super::pool::QUIET_AFTER
        {
            continue;
        }
        let memory = store.memory();
        if !worth_compacting(memory.free_hole_bytes, memory.segment_bytes) {
            continue;
        }
        let started = Instant::now();
        let pages = store.compact();
        last = Some(Instant::now());
        tracing::info!(
            holes = memory.free_hole_bytes,
            segments = memory.segment_bytes,
            released_pages = pages,
            ms = started.elapsed().as_millis() as u64,
            "arena compacted"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compacts_only_large_and_dense_holes() {
        assert!(!worth_compacting(0, 0));
        assert!(!worth_compacting(MIN_HOLE_BYTES - 1, MIN_HOLE_BYTES));
        assert!(worth_compacting(MIN_HOLE_BYTES, 4 * MIN_HOLE_BYTES));
        assert!(!worth_compacting(MIN_HOLE_BYTES, 4 * MIN_HOLE_BYTES + 1));
        assert!(worth_compacting(1 << 30, 2 << 30));
    }
}

//! Gives the store's freed memory back: compacts the arena when freed holes pile up.
//!
//! A swapped-out page that is swapped in (or discarded) leaves a hole in its arena segment.
//! Holes are reused by later pages of the same size class, but after a burst of swap-ins most
//! of them may never be: the segments stay, and so does their memory. Compaction slides the
//! live pages down and releases the emptied segments to the block pool, whose keeper gives
//! blocks beyond its reserve back to the system (`pool::trim`). zsmalloc does the same from
//! a shrinker; here a thread checks every second, and compacts (and lets the pool give memory
//! back) only once nothing has been written for a few seconds and pages were freed since.

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

/// How long no page may have been written before memory goes back.
const QUIET_AFTER: Duration = Duration::from_secs(3);

/// Whether the store has stopped growing and shrank: no page written for `QUIET_AFTER` and
/// fewer pages stored than at its peak since writes last resumed after memory went back. A
/// pause in a swap storm (a hog holding its pages, nothing freed) is not such a time.
///
/// The peak, not the count at the last write: the store is sampled once a second, and when
/// the last writes and the frees that follow (a hog exiting, its slots discarded) fall into
/// the same second, the count at the last write already has the frees in it, and memory
/// would never go back.
#[derive(Debug)]
pub struct Shrinking {
    writes: u64,
    peak: u64,
    since: Instant,
    gave_back: bool,
}

impl Shrinking {
    pub fn new(writes: u64, pages: u64, now: Instant) -> Self {
        Shrinking {
            writes,
            peak: pages,
            since: now,
            gave_back: false,
        }
    }

    /// Takes the store's write count and stored pages now; returns whether memory may go back.
    pub fn update(&mut self, writes: u64, pages: u64, now: Instant) -> bool {
        if writes != self.writes {
            if self.gave_back {
                // Writes resumed after memory went back: a new period, measured from here.
                *self = Shrinking::new(writes, pages, now);
            } else {
                self.writes = writes;
                self.since = now;
                self.peak = self.peak.max(pages);
            }
            return false;
        }
        self.peak = self.peak.max(pages);
        let give_back = now.duration_since(self.since) >= QUIET_AFTER && pages < self.peak;
        self.gave_back |= give_back;
        give_back
    }
}

/// Runs forever on its own thread (set up as an I/O-path thread: it holds the shard locks
/// that the queue threads wait for, so it must not fault into reclaim meanwhile). It also
/// tells the pool keeper when memory may go back (`pool::set_give_back`).
pub fn keep(store: Arc<PageStore>) {
    let mut last: Option<Instant> = None;
    let stats = store.stats();
    let mut shrinking = Shrinking::new(stats.writes, stats.pages_stored, Instant::now());
    loop {
        std::thread::sleep(CHECK_EVERY);
        let stats = store.stats();
        let give_back = shrinking.update(stats.writes, stats.pages_stored, Instant::now());
        crate::memory::pool::set_give_back(give_back);
        if !give_back || last.is_some_and(|t| t.elapsed() < MIN_INTERVAL) {
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

    #[test]
    fn memory_goes_back_only_after_quiet_frees() {
        let t0 = Instant::now();
        let mut s = Shrinking::new(100, 500, t0);
        // A hog holding its pages: no writes, nothing freed.
        assert!(!s.update(100, 500, t0 + QUIET_AFTER * 2));
        // Frees, but writes go on (a swap storm reusing slots).
        assert!(!s.update(150, 400, t0 + QUIET_AFTER * 3));
        assert!(!s.update(150, 400, t0 + QUIET_AFTER * 3 + QUIET_AFTER / 2));
        // No writes since, and pages freed: discards after the hog exited.
        assert!(s.update(150, 100, t0 + QUIET_AFTER * 4 + QUIET_AFTER / 2));
        // Writes resume after memory went back: the new period's peak is measured afresh, so
        // the next hold (nothing freed since the writes resumed) gives nothing back.
        assert!(!s.update(200, 300, t0 + QUIET_AFTER * 5));
        assert!(!s.update(200, 300, t0 + QUIET_AFTER * 7));
    }

    #[test]
    fn frees_in_the_same_second_as_the_last_write_still_count() {
        let t0 = Instant::now();
        let mut s = Shrinking::new(100, 500, t0);
        // One sample sees the hog's last writes and its exit's discards together.
        assert!(!s.update(120, 20, t0 + CHECK_EVERY));
        assert!(!s.update(120, 20, t0 + CHECK_EVERY * 2));
        assert!(s.update(120, 20, t0 + CHECK_EVERY + QUIET_AFTER));
    }
}

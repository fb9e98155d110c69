//! The arena's segments, found without any lock shared between them.
//!
//! A two-level table: a fixed top level of chunk slots, sized for the most segments the
//! store can need, and chunks of [`CHUNK`] segment slots allocated as the arena grows (and
//! kept). Each segment slot has its own reader-writer lock: reading or writing objects takes
//! only the lock of the segment they are in, so readers, installers and writers that use
//! different segments never touch a common cache line, and adding or releasing a segment
//! stops nobody else. (A single lock over the segment list did: installers holding it
//! across a batch made a waiting `grow` block every reader for hundreds of microseconds.)

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{OnceLock, PoisonError, RwLock, RwLockReadGuard};

use crate::CoreError;

/// Bytes per segment: the unit in which the arena takes memory from the system, and the
/// one a persistent store's [`SegmentHome`](super::SegmentHome) hands out.
pub(crate) const SEGMENT_SIZE: usize = 64 * 1024;

/// A segment's bytes, as little-endian words written and read with relaxed atomic accesses.
pub(crate) type Segment = Box<[AtomicU64]>;

/// Segment slots per chunk.
const CHUNK: usize = 64;
/// Bytes the segment table grows by at once (a chunk of slots): memory held, but outside
/// the room a staged page holds ([`super::STAGED_PAGE_ROOM`]).
#[cfg(test)]
pub(crate) const GROWTH_BYTES: u64 = (CHUNK * std::mem::size_of::<Slot>()) as u64;

type Slot = RwLock<Option<Segment>>;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct SegmentTable {
    chunks: Box<[OnceLock<Box<[Slot]>>]>,
    /// Chunks allocated so far (read on every release of the arena's lock).
    made: AtomicUsize,
}

impl SegmentTable {
    /// A table for up to `max_segments` segments (rounded up to whole chunks).
    pub(crate) fn new(max_segments: usize) -> Self {
        Self {
            chunks: (0..max_segments.div_ceil(CHUNK).max(1))
                .map(|_| OnceLock::new())
                .collect(),
            made: AtomicUsize::new(0),
        }
    }

    /// Most segments the table can hold.
    pub(crate) fn capacity(&self) -> usize {
        self.chunks.len() * CHUNK
    }

    /// Bytes the table takes: the top level and every chunk allocated so far.
    pub(crate) fn bytes(&self) -> u64 {
        let chunk = CHUNK * std::mem::size_of::<Slot>();
        let chunks = self.made.load(Relaxed);
        (self.chunks.len() * std::mem::size_of::<OnceLock<Box<[Slot]>>>() + chunks * chunk) as u64
    }

    /// Bytes one more segment at index `i` would add to [`SegmentTable::bytes`].
    pub(crate) fn growth_bytes(&self, i: usize) -> u64 {
        match self.chunks.get(i / CHUNK) {
            Some(c) if c.get().is_none() => (CHUNK * std::mem::size_of::<Slot>()) as u64,
            _ => 0,
        }
    }

    fn slot(&self, i: usize) -> Option<&Slot> {
        self.chunks.get(i / CHUNK)?.get()?.get(i % CHUNK)
    }

    /// Puts `segment` at index `i`, allocating its chunk if needed (fallibly: the table
    /// grows while serving I/O). The caller serializes growth (the arena's bookkeeping lock).
    pub(crate) fn install(&self, i: usize, segment: Segment) -> Result<(), CoreError> {
        self.install_or_hand_back(i, segment).map_err(|(e, _)| e)
    }

    /// [`SegmentTable::install`], handing `segment` back when it fails: a segment taken over
    /// from an earlier process is not this process's to free.
    pub(crate) fn install_or_hand_back(
        &self,
        i: usize,
        segment: Segment,
    ) -> Result<(), (CoreError, Segment)> {
        let Some(cell) = self.chunks.get(i / CHUNK) else {
            return Err((CoreError::NoMemory, segment));
        };
        if cell.get().is_none() {
            let mut slots: Vec<Slot> = Vec::new();
            if slots.try_reserve_exact(CHUNK).is_err() || refused_for_a_test() {
                return Err((CoreError::NoMemory, segment));
            }
            slots.extend((0..CHUNK).map(|_| RwLock::new(None)));
            // Growth is serialized, so nobody else can have set it meanwhile.
            if cell.set(slots.into_boxed_slice()).is_ok() {
                self.made.fetch_add(1, Relaxed);
            }
        }
        let Some(slot) = self.slot(i) else {
            return Err((CoreError::NoMemory, segment));
        };
        *slot.write().unwrap_or_else(PoisonError::into_inner) = Some(segment);
        Ok(())
    }

    /// Drops segment `i` (its memory goes back to the allocator). Nobody may hold objects
    /// in it.
    pub(crate) fn release(&self, i: usize) {
        if let Some(slot) = self.slot(i) {
            *slot.write().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }

    /// Lets go of every segment without freeing it (its memory belongs to someone else:
    /// see the arena's `Drop`).
    pub(crate) fn forget_all(&mut self) {
        for chunk in self.chunks.iter_mut().filter_map(OnceLock::get_mut) {
            for slot in chunk.iter_mut() {
                let segment = slot
                    .get_mut()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                std::mem::forget(segment);
            }
        }
    }

    /// Segment `i`, read-locked.
    pub(crate) fn read(&self, i: usize) -> Option<SegmentGuard<'_>> {
        let guard = self.slot(i)?.read().unwrap_or_else(PoisonError::into_inner);
        guard.is_some().then_some(SegmentGuard(guard))
    }

    /// A cursor for a run of accesses that mostly stay in one segment.
    pub(crate) fn cursor(&self) -> Cursor<'_> {
        Cursor {
            table: self,
            at: usize::MAX,
            guard: None,
        }
    }
}

/// A read-locked segment.
pub(crate) struct SegmentGuard<'a>(RwLockReadGuard<'a, Option<Segment>>);

impl SegmentGuard<'_> {
    /// The segment's words.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        self.0.as_deref().unwrap_or(&[])
    }
}

/// Keeps the last segment used read-locked until another one is needed.
pub(crate) struct Cursor<'a> {
    table: &'a SegmentTable,
    at: usize,
    guard: Option<SegmentGuard<'a>>,
}

impl Cursor<'_> {
    /// The words of segment `i` (empty if there is no such segment).
    pub(crate) fn words(&mut self, i: usize) -> &[AtomicU64] {
        if self.at != i {
            self.guard = None;
            self.guard = self.table.read(i);
            self.at = i;
        }
        self.guard.as_ref().map_or(&[], SegmentGuard::words)
    }
}

/// Whether a test makes this chunk's allocation fail (the store tests' hook).
fn refused_for_a_test() -> bool {
    #[cfg(test)]
    return super::tests::failing_alloc();
    #[cfg(not(test))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    fn segment(fill: u64) -> Segment {
        (0..8).map(|_| AtomicU64::new(fill)).collect()
    }

    #[test]
    fn segments_come_and_go_across_chunks() {
        let t = SegmentTable::new(3 * CHUNK);
        assert_eq!(t.capacity(), 3 * CHUNK);
        let base = t.bytes();
        assert!(t.read(0).is_none());
        assert!(t.growth_bytes(0) > 0);
        t.install(0, segment(1)).unwrap();
        assert_eq!(t.growth_bytes(1), 0);
        assert!(t.bytes() > base);
        t.install(CHUNK + 5, segment(2)).unwrap();
        assert_eq!(t.read(0).unwrap().words()[3].load(Relaxed), 1);
        assert_eq!(t.read(CHUNK + 5).unwrap().words()[0].load(Relaxed), 2);
        assert!(t.read(CHUNK + 4).is_none());
        let mut c = t.cursor();
        assert_eq!(c.words(0).len(), 8);
        assert_eq!(c.words(7).len(), 0);
        assert_eq!(c.words(CHUNK + 5)[7].load(Relaxed), 2);
        t.release(0);
        assert!(t.read(0).is_none());
        assert!(matches!(
            t.install(3 * CHUNK, segment(0)),
            Err(CoreError::NoMemory)
        ));
    }
}

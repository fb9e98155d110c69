//! A store that outlives its process: the page table and the arena's segments live in memory
//! the caller keeps (the daemon: a locked SysV shared memory segment), so a new process can
//! take the store over after the old one died at any instant.
//!
//! Why that is safe without a log: every change the store makes is ordered so that memory as
//! a killed process leaves it (a prefix of each thread's stores) is a consistent store:
//! - a page's new bytes (and the checksum after them) are written into free arena space
//!   before its 8-byte entry is switched to them (one aligned store), and the old bytes are
//!   freed only after;
//! - a segment is placed (its home records where it is) before any object in it is handed
//!   out, and is removed from the home before its memory is given back;
//! - compaction moves one object at a time into free space that does not overlap it, and
//!   points the entry at the new place before it moves the next one.
//!
//! Everything else (free lists, counters, the frontier) is rebuilt from the entries by
//! [`PageStore::recover`](super::PageStore::recover). Fill words that do not fit an entry are
//! not kept in the side map (which lives in the process): such pages are compressed.
//! Pages that were staged (for a GPU) are recovered from the staging the dead process left
//! when the caller kept it too ([`crate::batch::StagedCopy`]); otherwise they become
//! `Slot::Lost` (`entry.rs`) and fail reads until written again.

use std::fmt::Debug;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// An arena segment's memory: [`SEGMENT_BYTES`] / 8 words.
pub type SegmentWords = Box<[AtomicU64]>;

/// Where a persistent store's arena segments come from and where they are recorded. A
/// home that builds [`SegmentWords`] over memory it keeps (the daemon: blocks of a shared
/// memory segment) must make the global allocator free them correctly, since the store
/// drops segments it releases.
pub trait SegmentHome: Send + Sync + Debug {
    /// Memory for a new segment ([`SEGMENT_BYTES`] / 8 words), or `None` when there is none
    /// right now (the write that needed it fails with `NoMemory` and can be retried).
    fn alloc(&self) -> Option<SegmentWords>;
    /// Segment `index` now lives at `at` (its first word). Called before any object in it
    /// is handed out.
    fn placed(&self, index: usize, at: *const AtomicU64);
    /// Segment `index` is going away; called before its memory is freed.
    fn removed(&self, index: usize);
    /// Segment `index` as recorded by `placed` (in this or an earlier process), taken over.
    fn find(&self, index: usize) -> Option<SegmentWords>;
    /// Whether its segments outlive the store (a daemon's shared memory, which the next
    /// daemon takes over): a store dropped whole then lets go of them without freeing them.
    /// Segments it releases one by one are freed all the same.
    fn outlives_the_store(&self) -> bool {
        false
    }
    /// A segment `find` returned that the store did not take (its takeover failed): freed
    /// only where the home's segments end with the store. A daemon's segments are the next
    /// daemon's store: freed, such a block went back to the block pool, whose free-list link
    /// overwrote its first object.
    fn hand_back(&self, segment: SegmentWords) {
        if self.outlives_the_store() {
            std::mem::forget(segment);
        }
    }
}

/// Bytes of one arena segment (the unit a [`SegmentHome`] hands out).
pub const SEGMENT_BYTES: usize = super::segments::SEGMENT_SIZE;

/// What a persistent store is built on.
#[derive(Debug)]
pub struct Persistence {
    /// The page table's memory: [`super::PageStore::table_len`] words, kept for the rest of
    /// the process (and, by the caller, beyond it). Nothing else may write them while a store
    /// built on them lives.
    pub table: &'static [AtomicU64],
    /// The segments' memory and directory.
    pub home: Arc<dyn SegmentHome>,
}

/// What [`super::PageStore::recover`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Pages that hold data (stored or same-filled).
    pub pages_stored: u64,
    /// Pages that were staged when the old process died, read from its staging and
    /// installed.
    pub settled_pages: u64,
    /// Pages that were staged when the old process died and whose staged copy was not
    /// there: their content is gone and reads of them fail until they are written again.
    pub lost_pages: u64,
    /// Entries that are none this store writes (damage: a word zeroed or changed), or that
    /// name a fill word the old process kept in its own memory: their pages are lost, and
    /// reads of them fail until they are written again. The rest of the store is taken
    /// over.
    pub damaged_entries: u64,
    /// Arena segments taken over.
    pub segments: usize,
}

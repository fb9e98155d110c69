//! Objects whose page was given new content, with their room given back later, in a batch.
//!
//! A GPU ring's writer that stages a rewritten page would otherwise free the page's old
//! object on the spot: the arena's lock for each request, taken by every queue thread, with
//! the installers holding it for whole slots at a time. At 16 queues that made a rewrite
//! cost the queue threads 3.7 times the CPU of a first write (docs/bench/gpu-runs.md, run
//! 315). [`Arena::defer`] counts such an object instead, and [`Arena::free_replaced`]
//! frees a slot's worth under one acquisition of the lock, when the slot is installed.
//!
//! Until then the object is still the arena's:
//! - Compaction counts it (`Compaction::objects` is what the page table names), moves only
//!   what the table names, and so reclaims it; the era it bumps makes the later free of
//!   such an object a no-op.
//! - So does the memory limit, as it counted the hole a freed object left: the arena's
//!   memory is its segments, whole.
//!
//! The counts change only where compaction cannot be between two steps: a deferral under
//! the shard lock of the entry that named the object (compaction holds every shard's), a
//! free under the arena's lock (compaction holds it). So compaction, which waits for the
//! arena's objects to equal the table's plus the deferred ones, never runs while an object
//! is between its reservation and its entry, as before.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::{class_of, Arena, CLASS_GRANULE};

/// An object a staged write replaced, to be given back with [`Arena::free_replaced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Replaced {
    handle: u64,
    len: u16,
    /// Compactions before it was replaced: one since means compaction reclaimed it.
    era: u64,
}

impl Replaced {
    /// The two words a ring keeps it in (private memory), the first never 0.
    pub(crate) fn to_words(self) -> [u64; 2] {
        [self.handle + 1, (self.era << 16) | u64::from(self.len)]
    }

    /// What [`Replaced::to_words`] made; `None` for a first word of 0 (nothing kept).
    pub(crate) fn from_words(words: [u64; 2]) -> Option<Self> {
        let handle = words[0].checked_sub(1)?;
        Some(Self {
            handle,
            len: (words[1] & 0xffff) as u16,
            era: words[1] >> 16,
        })
    }
}

/// The replaced objects not given back yet.
#[derive(Debug, Default)]
pub(super) struct Deferred {
    objects: AtomicU64,
    /// Their bytes, rounded to their classes.
    bytes: AtomicU64,
    /// Compactions so far.
    era: AtomicU64,
}

impl Arena {
    /// Counts the object of `len` bytes at `handle`, which no page entry names any more, as
    /// replaced: it stays the arena's until [`Arena::free_replaced`]. The caller holds the
    /// write lock of the shard whose entry named it, and took the entry off it under that
    /// lock.
    pub(crate) fn defer(&self, handle: u64, len: usize) -> Replaced {
        let d = &self.deferred;
        d.objects.fetch_add(1, Relaxed);
        d.bytes
            .fetch_add((class_of(len) * CLASS_GRANULE) as u64, Relaxed);
        Replaced {
            handle,
            // An object is at most a raw page and its checksum.
            len: u16::try_from(len).unwrap_or(u16::MAX),
            era: d.era.load(Relaxed),
        }
    }

    /// Gives back the room of replaced objects under one acquisition of the lock; those a
    /// compaction reclaimed since they were replaced are skipped.
    pub(crate) fn free_replaced(&self, objects: impl IntoIterator<Item = Replaced>) {
        let mut objects = objects.into_iter().peekable();
        if objects.peek().is_none() {
            return;
        }
        let mut meta = self.lock_meta();
        let d = &self.deferred;
        let era = d.era.load(Relaxed);
        for r in objects.filter(|r| r.era == era) {
            let len = usize::from(r.len);
            d.objects.fetch_sub(1, Relaxed);
            d.bytes
                .fetch_sub((class_of(len) * CLASS_GRANULE) as u64, Relaxed);
            self.free_locked(&mut meta, r.handle, len);
        }
    }

    /// Bytes of replaced objects not given back yet, rounded to their classes.
    pub(crate) fn deferred_bytes(&self) -> u64 {
        self.deferred.bytes.load(Relaxed)
    }

    /// Replaced objects not given back yet. Exact while the caller holds the arena's lock
    /// and every shard's; a snapshot otherwise.
    pub(crate) fn deferred_objects(&self) -> u64 {
        self.deferred.objects.load(Relaxed)
    }

    /// After a compaction, which moved only the objects the table names: the replaced ones
    /// are the free room now, and a later free of one of them is a no-op. Under the arena's
    /// lock and every shard's.
    pub(super) fn forget_deferred(&self) {
        let d = &self.deferred;
        d.objects.store(0, Relaxed);
        d.bytes.store(0, Relaxed);
        d.era.fetch_add(1, Relaxed);
    }
}

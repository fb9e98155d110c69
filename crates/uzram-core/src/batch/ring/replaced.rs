//! The objects each slot's staged pages replaced in the store, kept in the ring's private
//! memory until the slot is installed, and then given back to the arena under one
//! acquisition of its lock (`arena/replaced.rs` says why).
//!
//! A writer keeps the objects of the indices its lease holds, so no two threads ever keep
//! one index's at once; an installer takes a slot's when the slot is its own, after every
//! writer let go of its lease (the lease word's release, then the slot's hand-off under the
//! ring's mutex, order the writes before its reads).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::store::Replaced;

/// Two words per index of every slot: [`Replaced::to_words`], or zeros.
pub(super) struct ReplacedBooks {
    words: Box<[AtomicU64]>,
    slot_pages: usize,
}

impl ReplacedBooks {
    pub(super) fn new(slots: usize, slot_pages: usize) -> Self {
        Self {
            words: (0..slots * slot_pages * 2)
                .map(|_| AtomicU64::new(0))
                .collect(),
            slot_pages,
        }
    }

    /// The memory the books take.
    pub(super) fn bytes(&self) -> usize {
        std::mem::size_of_val(&*self.words)
    }

    /// Keeps `replaced` for `index` of `slot` (the caller's lease holds that index).
    pub(super) fn keep(&self, slot: usize, index: usize, replaced: Replaced) {
        let at = (slot * self.slot_pages + index) * 2;
        if let Some([a, b]) = self.words.get(at..at + 2) {
            let [wa, wb] = replaced.to_words();
            a.store(wa, Relaxed);
            b.store(wb, Relaxed);
        }
    }

    /// Takes what the first `pages` indices of `slot` keep, leaving them empty.
    pub(super) fn take(&self, slot: usize, pages: usize) -> impl Iterator<Item = Replaced> + '_ {
        let at = slot * self.slot_pages * 2;
        let end = at + pages.min(self.slot_pages) * 2;
        self.words
            .get(at..end)
            .unwrap_or_default()
            .chunks_exact(2)
            .filter_map(|w| {
                if w[0].load(Relaxed) == 0 {
                    return None;
                }
                Replaced::from_words([w[0].swap(0, Relaxed), w[1].swap(0, Relaxed)])
            })
    }
}

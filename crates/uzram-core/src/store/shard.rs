//! One lock stripe of the page table: the entries of every page `p` with
//! `p % shards == s`, plus the rare state that does not fit in an entry.

use std::collections::HashMap;

use super::entry::{Entry, Slot};
use super::stats::PageTotals;

/// A table of `len` empty entries whose every page is written once, so it is resident (and,
/// under `mlockall`, locked) from the start, as zram's table is. `vec!` alone may hand out fresh
/// zero pages the allocator never touched (calloc of new heap memory); then the first write
/// to each page of the table would allocate memory while a swap write is being served, which
/// is exactly when there is none. `black_box` hides the value so the writes are not elided.
fn resident_table(len: usize) -> Vec<Entry> {
    let mut entries = vec![Entry::EMPTY; len];
    let per_page = crate::PAGE_SIZE / std::mem::size_of::<Entry>();
    for entry in entries.iter_mut().step_by(per_page) {
        *entry = std::hint::black_box(Entry::EMPTY);
    }
    if let Some(last) = entries.last_mut() {
        *last = std::hint::black_box(Entry::EMPTY);
    }
    entries
}

/// A shard's table; always used behind its `RwLock`.
#[derive(Debug)]
pub(crate) struct Shard {
    entries: Vec<Entry>,
    /// Fill words that do not fit in an entry, by index within the shard.
    same_ext: HashMap<u64, u64>,
    /// Generation of the deferred write each page holds, for pages whose raw copy waits
    /// for a `commit`.
    pending: HashMap<u64, u32>,
    next_generation: u32,
    /// Counts and payload of this shard's pages.
    pub(crate) totals: PageTotals,
}

impl Shard {
    pub(crate) fn new(len: usize) -> Self {
        Self {
            entries: resident_table(len),
            same_ext: HashMap::new(),
            pending: HashMap::new(),
            next_generation: 0,
            totals: PageTotals::default(),
        }
    }

    /// Bytes of entries this shard holds.
    pub(crate) fn table_bytes(&self) -> u64 {
        (self.entries.capacity() * std::mem::size_of::<Entry>()) as u64
    }

    /// Bytes held by the side maps (capacity × (key, value) + one control byte).
    pub(crate) fn side_bytes(&self) -> u64 {
        let ext = self.same_ext.capacity() * (std::mem::size_of::<(u64, u64)>() + 1);
        let pending = self.pending.capacity() * (std::mem::size_of::<(u64, u32)>() + 1);
        (ext + pending) as u64
    }

    /// The page's slot, with a side-map fill word resolved.
    pub(crate) fn get(&self, idx: u64) -> Option<Slot> {
        let slot = self.entries.get(usize::try_from(idx).ok()?)?.slot();
        Some(match slot {
            Slot::SameExt => Slot::Same(self.same_ext.get(&idx).copied().unwrap_or_default()),
            other => other,
        })
    }

    /// Stores `slot` for the page and returns the old slot (resolved). Clears any pending
    /// deferred write of the page.
    pub(crate) fn set(&mut self, idx: u64, slot: Slot) -> Option<Slot> {
        let old = self.get(idx)?;
        let entry = self.entries.get_mut(usize::try_from(idx).ok()?)?;
        if let Slot::Same(word) = slot {
            if !Entry::same_fits(word) {
                self.same_ext.insert(idx, word);
            }
        }
        if old.is_same_ext() && !matches!(slot, Slot::Same(w) if !Entry::same_fits(w)) {
            self.same_ext.remove(&idx);
        }
        *entry = Entry::pack(slot);
        self.pending.remove(&idx);
        Some(old)
    }

    /// `(index, handle, len)` of every page whose bytes are in the arena.
    pub(crate) fn stored(&self) -> impl Iterator<Item = (u64, u64, u16)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| match e.slot() {
                Slot::Stored { handle, len } => Some((i as u64, handle, len)),
                _ => None,
            })
    }

    /// Points a stored page at its new place after compaction moved its bytes.
    pub(crate) fn rehome(&mut self, idx: u64, handle: u64) {
        if let Some(entry) = usize::try_from(idx)
            .ok()
            .and_then(|i| self.entries.get_mut(i))
        {
            if let Slot::Stored { len, .. } = entry.slot() {
                *entry = Entry::pack(Slot::Stored { handle, len });
            }
        }
    }

    /// Marks the page's current content as a deferred write; returns its generation.
    pub(crate) fn mark_pending(&mut self, idx: u64) -> u32 {
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1);
        self.pending.insert(idx, generation);
        generation
    }

    /// Forgets the page's deferred write (its raw copy stays as the final content).
    pub(crate) fn clear_pending(&mut self, idx: u64) {
        self.pending.remove(&idx);
    }

    /// True if the page still holds the deferred write of `generation`.
    pub(crate) fn is_pending(&self, idx: u64, generation: u32) -> bool {
        self.pending.get(&idx) == Some(&generation)
    }
}

impl Slot {
    fn is_same_ext(self) -> bool {
        matches!(self, Slot::Same(w) if !Entry::same_fits(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_map_words_come_and_go() {
        let mut shard = Shard::new(4);
        let word = 0x1234_5678_9abc_def0;
        assert_eq!(shard.set(1, Slot::Same(word)), Some(Slot::Empty));
        assert_eq!(shard.get(1), Some(Slot::Same(word)));
        assert_eq!(shard.same_ext.len(), 1);
        assert_eq!(shard.set(1, Slot::Same(0)), Some(Slot::Same(word)));
        assert!(shard.same_ext.is_empty());
        assert_eq!(shard.get(1), Some(Slot::Same(0)));
        assert_eq!(shard.get(4), None);
        assert_eq!(shard.set(4, Slot::Empty), None);
    }

    #[test]
    fn any_set_clears_pending() {
        let mut shard = Shard::new(2);
        shard.set(
            0,
            Slot::Stored {
                handle: 0,
                len: 4096,
            },
        );
        let g = shard.mark_pending(0);
        assert!(shard.is_pending(0, g));
        assert!(!shard.is_pending(0, g.wrapping_add(1)));
        shard.set(0, Slot::Empty);
        assert!(!shard.is_pending(0, g));
    }
}

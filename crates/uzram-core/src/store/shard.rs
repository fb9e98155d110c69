//! One lock stripe of the page table: the entries of every page `p` with
//! `p % shards == s`, plus the rare fill words that do not fit in an entry.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::entry::{Entry, Slot, StagedAt};
use super::stats::PageTotals;
use crate::CoreError;

/// A table of `len` empty entries whose every page is written once, so it is resident (and,
/// under `mlockall`, locked) from the start, as zram's table is. `vec!` alone may hand out fresh
/// zero pages the allocator never touched (calloc of new heap memory); then the first write
/// to each page of the table would allocate memory while a swap write is being served, which
/// is exactly when there is none. `black_box` hides the value so the writes are not elided.
fn resident_table(len: usize) -> Vec<u64> {
    let empty = Entry::EMPTY.word();
    let mut entries = vec![empty; len];
    let per_page = crate::PAGE_SIZE / std::mem::size_of::<u64>();
    for entry in entries.iter_mut().step_by(per_page) {
        *entry = std::hint::black_box(empty);
    }
    if let Some(last) = entries.last_mut() {
        *last = std::hint::black_box(empty);
    }
    entries
}

/// A shard's entries: its own allocation, or a part of a table the caller keeps (a
/// persistent store, see `persist.rs`). Kept entries are atomic words: the memory is the
/// caller's too, and atomics make sharing it sound (a relaxed load or store is a plain
/// aligned access, so it costs nothing); the shard's lock orders them.
#[derive(Debug)]
pub(crate) enum Entries {
    Owned(Vec<u64>),
    Kept(&'static [AtomicU64]),
}

impl Entries {
    fn len(&self) -> usize {
        match self {
            Entries::Owned(v) => v.len(),
            Entries::Kept(s) => s.len(),
        }
    }

    fn word(&self, i: usize) -> Option<u64> {
        match self {
            Entries::Owned(v) => v.get(i).copied(),
            Entries::Kept(s) => s.get(i).map(|w| w.load(Relaxed)),
        }
    }

    fn get(&self, idx: u64) -> Option<Entry> {
        self.word(usize::try_from(idx).ok()?).map(Entry::from_word)
    }

    /// Sets an entry with one aligned 8-byte store (what a crash can leave: old or new).
    fn put(&mut self, idx: u64, entry: Entry) -> bool {
        let Ok(i) = usize::try_from(idx) else {
            return false;
        };
        match self {
            Entries::Owned(v) => v.get_mut(i).map(|w| *w = entry.word()).is_some(),
            Entries::Kept(s) => s.get(i).map(|w| w.store(entry.word(), Relaxed)).is_some(),
        }
    }

    /// Every entry set to `word`, touching each page of the table.
    fn fill(&mut self, word: u64) {
        match self {
            Entries::Owned(v) => v.fill(word),
            Entries::Kept(s) => s.iter().for_each(|w| w.store(word, Relaxed)),
        }
    }
}

/// A shard's table; always used behind its `RwLock`.
#[derive(Debug)]
pub(crate) struct Shard {
    entries: Entries,
    /// Fill words that do not fit in an entry, by index within the shard.
    same_ext: HashMap<u64, u64>,
    /// Counts and payload of this shard's pages.
    pub(crate) totals: PageTotals,
}

impl Shard {
    pub(crate) fn new(len: usize) -> Self {
        Self::with_entries(Entries::Owned(resident_table(len)))
    }

    /// A shard over `entries` as they are (a recovered table), with empty totals.
    pub(crate) fn with_entries(entries: Entries) -> Self {
        Self {
            entries,
            same_ext: HashMap::new(),
            totals: PageTotals::default(),
        }
    }

    /// Every entry back to empty, touching each page of the table (see `resident_table`).
    pub(crate) fn clear(&mut self) {
        self.entries.fill(Entry::EMPTY.word());
    }

    /// The entries themselves, for tests that damage them.
    #[cfg(test)]
    pub(crate) fn entries_mut(&mut self) -> &mut Entries {
        &mut self.entries
    }

    /// Bytes of entries this shard holds.
    pub(crate) fn table_bytes(&self) -> u64 {
        let len = match &self.entries {
            Entries::Owned(v) => v.capacity(),
            Entries::Kept(s) => s.len(),
        };
        (len * std::mem::size_of::<Entry>()) as u64
    }

    /// `(index, slot)` of every entry, as stored (fill words in the side map unresolved).
    pub(crate) fn slots(&self) -> impl Iterator<Item = (u64, Slot)> + '_ {
        (0..self.entries.len()).filter_map(|i| {
            let w = self.entries.word(i)?;
            Some((i as u64, Entry::from_word(w).slot()))
        })
    }

    /// Bytes held by the side map (capacity × (key, value) + one control byte).
    pub(crate) fn side_bytes(&self) -> u64 {
        (self.same_ext.capacity() * (std::mem::size_of::<(u64, u64)>() + 1)) as u64
    }

    /// The page's slot, with a side-map fill word resolved; `SameExt` stays unresolved when
    /// the side map has no word for the page (a damaged entry: never a page of zeros).
    pub(crate) fn get(&self, idx: u64) -> Option<Slot> {
        let slot = self.entries.get(idx)?.slot();
        Some(match slot {
            Slot::SameExt => match self.same_ext.get(&idx) {
                Some(&word) => Slot::Same(word),
                None => Slot::SameExt,
            },
            other => other,
        })
    }

    /// True if the page is staged exactly at `at` (same slot, index and fill epoch).
    pub(crate) fn is_staged_at(&self, idx: u64, at: StagedAt) -> bool {
        self.entries
            .get(idx)
            .is_some_and(|e| e == Entry::pack(Slot::Staged(at)))
    }

    /// Stores `slot` for the page and returns the old slot (resolved); `Ok(None)` if the
    /// index is outside the shard. A fill word that needs the side map fails with
    /// `NoMemory` (the entry is unchanged) when the allocator has no room for it: the map
    /// grows on the I/O path, where an aborting allocation must never happen.
    pub(crate) fn set(&mut self, idx: u64, slot: Slot) -> Result<Option<Slot>, CoreError> {
        let Some(old) = self.get(idx) else {
            return Ok(None);
        };
        if let Slot::Same(word) = slot {
            if !Entry::same_fits(word) {
                self.same_ext
                    .try_reserve(1)
                    .map_err(|_| CoreError::NoMemory)?;
                self.same_ext.insert(idx, word);
            }
        }
        if old.is_same_ext() && !slot.is_same_ext() {
            self.same_ext.remove(&idx);
        }
        if !self.entries.put(idx, Entry::pack(slot)) {
            return Ok(None);
        }
        Ok(Some(old))
    }

    /// `(index, handle, len)` of every page whose bytes are in the arena.
    pub(crate) fn stored(&self) -> impl Iterator<Item = (u64, u64, u16)> + '_ {
        self.slots().filter_map(|(i, slot)| match slot {
            Slot::Stored { handle, len, .. } => Some((i, handle, len)),
            _ => None,
        })
    }

    /// Points a stored page at its new place after compaction moved its bytes.
    pub(crate) fn rehome(&mut self, idx: u64, handle: u64) {
        if let Some(Slot::Stored {
            len, recompressed, ..
        }) = self.entries.get(idx).map(Entry::slot)
        {
            self.entries.put(
                idx,
                Entry::pack(Slot::Stored {
                    handle,
                    len,
                    recompressed,
                }),
            );
        }
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
        assert_eq!(shard.set(1, Slot::Same(word)).unwrap(), Some(Slot::Empty));
        assert_eq!(shard.get(1), Some(Slot::Same(word)));
        assert_eq!(shard.same_ext.len(), 1);
        assert_eq!(shard.set(1, Slot::Same(0)).unwrap(), Some(Slot::Same(word)));
        assert!(shard.same_ext.is_empty());
        assert_eq!(shard.get(1), Some(Slot::Same(0)));
        assert_eq!(shard.get(4), None);
        assert_eq!(shard.set(4, Slot::Empty).unwrap(), None);
    }

    #[test]
    fn staged_entries_match_only_their_own_fill() {
        let mut shard = Shard::new(2);
        let at = StagedAt::new(1, 2, 3).unwrap();
        shard.set(0, Slot::Staged(at)).unwrap();
        assert!(shard.is_staged_at(0, at));
        assert!(!shard.is_staged_at(0, StagedAt::new(1, 2, 4).unwrap()));
        assert!(!shard.is_staged_at(1, at));
        assert!(!shard.is_staged_at(9, at));
        shard.set(0, Slot::Empty).unwrap();
        assert!(!shard.is_staged_at(0, at));
    }
}

//! One lock stripe of the page table: the entries of every page `p` with
//! `p % shards == s`, plus the rare fill words that do not fit in an entry.

use std::collections::HashMap;

use super::entry::{Entry, Slot, StagedAt};
use super::stats::PageTotals;
use crate::CoreError;

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
    /// Counts and payload of this shard's pages.
    pub(crate) totals: PageTotals,
}

impl Shard {
    pub(crate) fn new(len: usize) -> Self {
        Self {
            entries: resident_table(len),
            same_ext: HashMap::new(),
            totals: PageTotals::default(),
        }
    }

    /// Bytes of entries this shard holds.
    pub(crate) fn table_bytes(&self) -> u64 {
        (self.entries.capacity() * std::mem::size_of::<Entry>()) as u64
    }

    /// Bytes held by the side map (capacity × (key, value) + one control byte).
    pub(crate) fn side_bytes(&self) -> u64 {
        (self.same_ext.capacity() * (std::mem::size_of::<(u64, u64)>() + 1)) as u64
    }

    /// The page's slot, with a side-map fill word resolved.
    pub(crate) fn get(&self, idx: u64) -> Option<Slot> {
        let slot = self.entries.get(usize::try_from(idx).ok()?)?.slot();
        Some(match slot {
            Slot::SameExt => Slot::Same(self.same_ext.get(&idx).copied().unwrap_or_default()),
            other => other,
        })
    }

    /// True if the page is staged exactly at `at` (same slot, index and fill epoch).
    pub(crate) fn is_staged_at(&self, idx: u64, at: StagedAt) -> bool {
        usize::try_from(idx)
            .ok()
            .and_then(|i| self.entries.get(i))
            .is_some_and(|e| *e == Entry::pack(Slot::Staged(at)))
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
        let Some(entry) = usize::try_from(idx)
            .ok()
            .and_then(|i| self.entries.get_mut(i))
        else {
            return Ok(None);
        };
        *entry = Entry::pack(slot);
        Ok(Some(old))
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

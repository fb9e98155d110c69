//! The 8-byte per-page table entry: what a page currently is and where its bytes live.
//!
//! Layout of the `u64` (bit 0 is the least significant):
//! - bits 0..3: tag;
//! - `TAG_SAME`: bits 3..64 hold the fill word, sign-extended from 61 bits (covers zero,
//!   small values and all-ones, the fills that occur in practice);
//! - `TAG_SAME_EXT`: a fill word that does not fit; the shard keeps it in a side map;
//! - `TAG_STORED`: bits 3..16 hold the stored length (1..=4096; 4096 means the page is
//!   stored raw), bits 16..64 the arena offset in 8-byte units;
//! - `TAG_STAGED`: the page waits, uncompressed, in a batch backend's staging memory: bits
//!   3..11 hold the slot, bits 11..27 the page's index in it, bits 27..64 the slot's fill
//!   epoch (so an entry from an earlier fill of the same slot never matches a later one);
//! - `TAG_LOST`: a recovered store found the page staged: its bytes were in the dead
//!   daemon's staging memory, so reads fail until it is written again.
//!
//! The all-zero entry is [`Slot::Empty`], so a fresh table is a zeroed allocation.

use crate::page::PAGE_SIZE;

const TAG_BITS: u32 = 3;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
const TAG_EMPTY: u64 = 0;
const TAG_SAME: u64 = 1;
const TAG_SAME_EXT: u64 = 2;
const TAG_STORED: u64 = 3;
const TAG_STAGED: u64 = 4;
const TAG_LOST: u64 = 5;
const LEN_SHIFT: u32 = 3;
const LEN_MASK: u64 = (1 << 13) - 1;
const HANDLE_SHIFT: u32 = 16;
const SLOT_SHIFT: u32 = 3;
const SLOT_BITS: u32 = 8;
const INDEX_SHIFT: u32 = SLOT_SHIFT + SLOT_BITS;
const INDEX_BITS: u32 = 16;
const EPOCH_SHIFT: u32 = INDEX_SHIFT + INDEX_BITS;
const EPOCH_BITS: u32 = 64 - EPOCH_SHIFT;

/// Most slots a batch backend may stage pages in.
pub const MAX_STAGING_SLOTS: usize = 1 << SLOT_BITS;
/// Most pages one staging slot may hold.
pub const MAX_SLOT_PAGES: usize = 1 << INDEX_BITS;
/// Fill epochs wrap at this value (after 137 billion fills of one slot).
pub(crate) const EPOCH_MODULUS: u64 = 1 << EPOCH_BITS;

/// Where a staged page's bytes are: `index` of staging `slot`, filled in `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StagedAt {
    slot: u16,
    index: u16,
    epoch: u64,
}

impl StagedAt {
    /// A location; `None` when the slot or index does not fit an entry
    /// ([`MAX_STAGING_SLOTS`], [`MAX_SLOT_PAGES`]). The epoch is taken modulo 2^37.
    pub fn new(slot: usize, index: usize, epoch: u64) -> Option<Self> {
        (slot < MAX_STAGING_SLOTS && index < MAX_SLOT_PAGES).then_some(Self {
            slot: slot as u16,
            index: index as u16,
            epoch: epoch % EPOCH_MODULUS,
        })
    }

    /// The staging slot.
    pub fn slot(self) -> usize {
        usize::from(self.slot)
    }

    /// The page's index within the slot.
    pub fn index(self) -> usize {
        usize::from(self.index)
    }

    /// The slot's fill epoch (modulo 2^37).
    pub fn epoch(self) -> u64 {
        self.epoch
    }
}

/// Arena offsets are multiples of this many bytes (the arena's size-class granularity).
pub(crate) const HANDLE_ALIGN: u64 = 8;
/// Largest arena byte offset an entry can hold.
pub(crate) const MAX_HANDLE: u64 = ((1u64 << (64 - HANDLE_SHIFT)) - 1) * HANDLE_ALIGN;

/// A page's state, decoded from its [`Entry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Never written, discarded or zeroed by write_zeroes: reads as zeros, holds nothing.
    Empty,
    /// Same-filled with this word (no payload).
    Same(u64),
    /// Same-filled with a word kept in the shard's side map.
    SameExt,
    /// `len` bytes at arena offset `handle`; `len == PAGE_SIZE` means raw (a huge page).
    Stored {
        /// Byte offset in the arena.
        handle: u64,
        /// Stored bytes.
        len: u16,
    },
    /// Uncompressed in a batch backend's staging memory, waiting for its compressed form.
    Staged(StagedAt),
    /// Staged when the daemon that held the staging memory died (see `persist.rs`).
    Lost,
}

/// One page's packed metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub(crate) struct Entry(u64);

impl Entry {
    /// The entry of an empty page.
    pub(crate) const EMPTY: Entry = Entry(TAG_EMPTY);

    /// Packs `slot`. `Slot::Same(w)` with a word that does not fit packs as `SameExt`;
    /// the caller checks [`Entry::same_fits`] first and keeps such words itself.
    pub(crate) fn pack(slot: Slot) -> Entry {
        match slot {
            Slot::Empty => Entry::EMPTY,
            Slot::Same(word) if Self::same_fits(word) => Entry((word << TAG_BITS) | TAG_SAME),
            Slot::Same(_) | Slot::SameExt => Entry(TAG_SAME_EXT),
            Slot::Stored { handle, len } => {
                debug_assert!(handle % HANDLE_ALIGN == 0 && handle <= MAX_HANDLE);
                debug_assert!(len >= 1 && usize::from(len) <= PAGE_SIZE);
                Entry(
                    ((handle / HANDLE_ALIGN) << HANDLE_SHIFT)
                        | ((u64::from(len) & LEN_MASK) << LEN_SHIFT)
                        | TAG_STORED,
                )
            }
            Slot::Staged(at) => Entry(
                (at.epoch << EPOCH_SHIFT)
                    | (u64::from(at.index) << INDEX_SHIFT)
                    | (u64::from(at.slot) << SLOT_SHIFT)
                    | TAG_STAGED,
            ),
            Slot::Lost => Entry(TAG_LOST),
        }
    }

    /// The entry stored as `word` in a table.
    pub(crate) fn from_word(word: u64) -> Entry {
        Entry(word)
    }

    /// The word a table stores for this entry.
    pub(crate) fn word(self) -> u64 {
        self.0
    }

    /// True when `word` can live inside the entry (its top four bits are all equal).
    pub(crate) fn same_fits(word: u64) -> bool {
        (((word << TAG_BITS) as i64) >> TAG_BITS) as u64 == word
    }

    /// Decodes the entry.
    pub(crate) fn slot(self) -> Slot {
        match self.0 & TAG_MASK {
            TAG_SAME => Slot::Same(((self.0 as i64) >> TAG_BITS) as u64),
            TAG_SAME_EXT => Slot::SameExt,
            TAG_STORED => Slot::Stored {
                handle: (self.0 >> HANDLE_SHIFT) * HANDLE_ALIGN,
                len: ((self.0 >> LEN_SHIFT) & LEN_MASK) as u16,
            },
            TAG_STAGED => Slot::Staged(StagedAt {
                slot: ((self.0 >> SLOT_SHIFT) & ((1 << SLOT_BITS) - 1)) as u16,
                index: ((self.0 >> INDEX_SHIFT) & ((1 << INDEX_BITS) - 1)) as u16,
                epoch: self.0 >> EPOCH_SHIFT,
            }),
            TAG_LOST => Slot::Lost,
            _ => Slot::Empty,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_is_eight_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 8);
    }

    #[test]
    fn slots_round_trip() {
        let slots = [
            Slot::Empty,
            Slot::Same(0),
            Slot::Same(u64::MAX),
            Slot::Same(0x0123_4567_89ab_cdef),
            Slot::Same(0xf000_0000_0000_0001),
            Slot::Stored { handle: 0, len: 1 },
            Slot::Stored {
                handle: 8 * 12345,
                len: 4095,
            },
            Slot::Stored {
                handle: MAX_HANDLE,
                len: PAGE_SIZE as u16,
            },
            Slot::Staged(StagedAt::new(0, 0, 0).unwrap()),
            Slot::Staged(StagedAt::new(255, 65535, EPOCH_MODULUS - 1).unwrap()),
            Slot::Staged(StagedAt::new(7, 4095, 123_456_789).unwrap()),
            Slot::Lost,
        ];
        for slot in slots {
            assert_eq!(Entry::pack(slot).slot(), slot, "{slot:?}");
        }
    }

    #[test]
    fn staged_locations_are_checked_and_epochs_wrap() {
        assert!(StagedAt::new(MAX_STAGING_SLOTS, 0, 0).is_none());
        assert!(StagedAt::new(0, MAX_SLOT_PAGES, 0).is_none());
        let at = StagedAt::new(3, 9, EPOCH_MODULUS + 5).unwrap();
        assert_eq!((at.slot(), at.index(), at.epoch()), (3, 9, 5));
        // Same slot and index, another fill: a different entry.
        let later = StagedAt::new(3, 9, 6).unwrap();
        assert_ne!(
            Entry::pack(Slot::Staged(at)),
            Entry::pack(Slot::Staged(later))
        );
    }

    #[test]
    fn words_that_do_not_fit_become_ext() {
        for word in [
            0x8000_0000_0000_0000u64,
            0x1234_5678_9abc_def0,
            0x7fff_ffff_ffff_ffff,
        ] {
            assert!(!Entry::same_fits(word));
            assert_eq!(Entry::pack(Slot::Same(word)).slot(), Slot::SameExt);
        }
        assert_eq!(Entry::default(), Entry::EMPTY);
    }
}

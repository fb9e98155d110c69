//! The 8-byte per-page table entry: what a page currently is and where its bytes live.
//!
//! Layout of the `u64` (bit 0 is the least significant):
//! - bits 0..3: tag;
//! - `TAG_SAME`: bits 3..11 hold a check byte of the fill word ([`fill_check`]), bits
//!   11..64 the fill word, sign-extended from 53 bits (covers zero, small values and
//!   all-ones, the fills that occur in practice). A same-filled page has no bytes for a
//!   checksum to cover: the check byte is what catches a damaged entry;
//! - `TAG_SAME_EXT`: a fill word that does not fit; the shard keeps it in a side map;
//! - `TAG_STORED` (7, all three bits: no one flipped bit makes it a fill, which no
//!   checksum covers): bits 3..16 hold the stored length (1..=4096; 4096 means the page is
//!   stored raw), bits 16..63 the arena offset in 8-byte units, bit 63 whether recompression
//!   rewrote the object as a zstd frame (whatever the store's own algorithm; a frame decodes
//!   at any level): such an object is always compressed (length 1..4096);
//! - `TAG_STAGED`: the page waits, uncompressed, in a batch backend's staging memory: bits
//!   3..11 hold the slot, bits 11..27 the page's index in it, bits 27..64 the slot's fill
//!   epoch (so an entry from an earlier fill of the same slot never matches a later one);
//! - `TAG_LOST`: a recovered store found the page staged: its bytes were in the dead
//!   daemon's staging memory, so reads fail until it is written again.
//! - `TAG_BACKED`: the page was written back: bits 3..16 hold its length as for
//!   `TAG_STORED`, bit 16 the recompressed flag, bits 17..64 the byte on the backing device
//!   where its sealed object starts (`backing.rs`).
//!
//! Tag 3 is never written: an entry with it decodes as [`Slot::Invalid`], and so does a
//! same-filled entry whose check byte does not match. Reads of such a page fail, and a
//! recovery takes the page as lost (`Recovered::damaged_entries`). Tables of earlier
//! releases stored pages under tag 3, one bit from `TAG_SAME`: a stored entry with that bit
//! flipped read as a fill whenever its bits happened to hold the fill's check byte (1 in
//! 256), wrong data where an I/O error was due. A takeover moves those entries to tag 7
//! ([`move_stored_tag`]) before the table is read.
//!
//! The tags are placed so that one flipped tag bit never turns an entry into one that
//! answers a read without a check: the neighbours of `TAG_SAME` (1) are the empty entry,
//! whose fixed pattern fails the check byte, the lost entry (bare, likewise) and tag 3.
//!
//! [`Slot::Empty`] is one fixed word with tag 0 ([`EMPTY_WORD`]), not the all-zero word: an
//! entry that was zeroed (a page of the table lost, or cleared by mistake) decodes as
//! [`Slot::Invalid`], and its page reads as an I/O error instead of a page of zeros. Stores
//! of earlier releases wrote 0 for an empty page; a takeover rewrites those
//! ([`mark_zero_entries`]) before the table is read.

use crate::page::PAGE_SIZE;

const TAG_BITS: u32 = 3;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
const TAG_EMPTY: u64 = 0;
/// The entry of an empty page: tag 0 under a fixed pattern of bits that no damage which
/// zeroes, or sets, whole bytes makes.
pub const EMPTY_WORD: u64 = 0x5a3c_96e1_0f78_b4d0;
const _: () = assert!(EMPTY_WORD & TAG_MASK == TAG_EMPTY);
const TAG_SAME: u64 = 1;
const TAG_SAME_EXT: u64 = 2;
/// Never written (see the module docs).
const TAG_UNUSED: u64 = 3;
const TAG_STAGED: u64 = 4;
const TAG_LOST: u64 = 5;
const TAG_BACKED: u64 = 6;
const TAG_STORED: u64 = 7;
/// Where tables of earlier releases stored pages: [`move_stored_tag`].
const TAG_STORED_BEFORE: u64 = TAG_UNUSED;
/// A written-back entry's recompressed flag, and where its disk offset starts.
const BACKED_RECOMPRESSED: u64 = 1 << 16;
const DISK_SHIFT: u32 = 17;
/// A stored entry's flag: the object is a zstd frame written by recompression.
const RECOMPRESSED: u64 = 1 << 63;
/// Bits of a same-filled entry's check byte, above the tag.
const CHECK_BITS: u32 = 8;
const FILL_SHIFT: u32 = TAG_BITS + CHECK_BITS;
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

/// Largest backing-device byte offset an entry can hold (128 TiB).
pub(crate) const MAX_DISK_OFFSET: u64 = (1 << (64 - DISK_SHIFT)) - 1;

/// Arena offsets are multiples of this many bytes (the arena's size-class granularity).
pub(crate) const HANDLE_ALIGN: u64 = 8;
/// Largest arena byte offset an entry can hold.
pub(crate) const MAX_HANDLE: u64 = ((1u64 << (63 - HANDLE_SHIFT)) - 1) * HANDLE_ALIGN;

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
        /// Rewritten by recompression as a zstd frame, not in the store's own algorithm.
        recompressed: bool,
    },
    /// Uncompressed in a batch backend's staging memory, waiting for its compressed form.
    Staged(StagedAt),
    /// Staged when the daemon that held the staging memory died (see `persist.rs`).
    Lost,
    /// Written back: `len` bytes (and the checksum) sealed at byte `at` of the backing
    /// device; `len == PAGE_SIZE` means raw.
    Backed {
        /// Byte offset of the sealed object on the backing device.
        at: u64,
        /// Stored bytes.
        len: u16,
        /// A zstd frame written by recompression.
        recompressed: bool,
    },
    /// Not an entry this store writes: tag 3, a tagged entry whose other bits no entry of
    /// that tag has, or a same-filled entry whose check byte does not match its word
    /// (memory that was damaged, or never was a table).
    Invalid,
}

/// One page's packed metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Entry(u64);

impl Default for Entry {
    fn default() -> Self {
        Entry::EMPTY
    }
}

impl Entry {
    /// The entry of an empty page.
    pub(crate) const EMPTY: Entry = Entry(EMPTY_WORD);

    /// Packs `slot`. `Slot::Same(w)` with a word that does not fit packs as `SameExt`;
    /// the caller checks [`Entry::same_fits`] first and keeps such words itself.
    pub(crate) fn pack(slot: Slot) -> Entry {
        match slot {
            Slot::Empty => Entry::EMPTY,
            Slot::Same(word) if Self::same_fits(word) => {
                Entry((word << FILL_SHIFT) | (u64::from(fill_check(word)) << TAG_BITS) | TAG_SAME)
            }
            Slot::Same(_) | Slot::SameExt => Entry(TAG_SAME_EXT),
            Slot::Stored {
                handle,
                len,
                recompressed,
            } => {
                debug_assert!(handle % HANDLE_ALIGN == 0 && handle <= MAX_HANDLE);
                debug_assert!(len >= 1 && usize::from(len) <= PAGE_SIZE);
                debug_assert!(!recompressed || usize::from(len) < PAGE_SIZE);
                let flag = if recompressed { RECOMPRESSED } else { 0 };
                Entry(
                    flag | ((handle / HANDLE_ALIGN) << HANDLE_SHIFT)
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
            Slot::Backed {
                at,
                len,
                recompressed,
            } => {
                debug_assert!(at <= MAX_DISK_OFFSET);
                debug_assert!(len >= 1 && usize::from(len) <= PAGE_SIZE);
                let flag = if recompressed { BACKED_RECOMPRESSED } else { 0 };
                Entry(
                    (at << DISK_SHIFT)
                        | flag
                        | ((u64::from(len) & LEN_MASK) << LEN_SHIFT)
                        | TAG_BACKED,
                )
            }
            // Never packed by the store; a word no decoder accepts, should a caller try.
            Slot::Invalid => Entry(TAG_UNUSED),
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

    /// True when `word` can live inside the entry (its top twelve bits are all equal).
    pub(crate) fn same_fits(word: u64) -> bool {
        (((word << FILL_SHIFT) as i64) >> FILL_SHIFT) as u64 == word
    }

    /// Decodes the entry.
    pub(crate) fn slot(self) -> Slot {
        match self.0 & TAG_MASK {
            TAG_SAME => {
                let word = ((self.0 as i64) >> FILL_SHIFT) as u64;
                let check = ((self.0 >> TAG_BITS) & ((1 << CHECK_BITS) - 1)) as u8;
                if check == fill_check(word) {
                    Slot::Same(word)
                } else {
                    Slot::Invalid
                }
            }
            // Packed as the bare tag: any other bits mean damage (a stored or written-back
            // entry with one bit flipped can carry this tag).
            TAG_SAME_EXT if self.0 == TAG_SAME_EXT => Slot::SameExt,
            TAG_STORED => {
                let len = ((self.0 >> LEN_SHIFT) & LEN_MASK) as u16;
                let recompressed = self.0 & RECOMPRESSED != 0;
                if len_fits(len, recompressed) {
                    Slot::Stored {
                        handle: ((self.0 & !RECOMPRESSED) >> HANDLE_SHIFT) * HANDLE_ALIGN,
                        len,
                        recompressed,
                    }
                } else {
                    Slot::Invalid
                }
            }
            TAG_STAGED => Slot::Staged(StagedAt {
                slot: ((self.0 >> SLOT_SHIFT) & ((1 << SLOT_BITS) - 1)) as u16,
                index: ((self.0 >> INDEX_SHIFT) & ((1 << INDEX_BITS) - 1)) as u16,
                epoch: self.0 >> EPOCH_SHIFT,
            }),
            TAG_LOST => Slot::Lost,
            TAG_BACKED => {
                let len = ((self.0 >> LEN_SHIFT) & LEN_MASK) as u16;
                let recompressed = self.0 & BACKED_RECOMPRESSED != 0;
                if len_fits(len, recompressed) {
                    Slot::Backed {
                        at: self.0 >> DISK_SHIFT,
                        len,
                        recompressed,
                    }
                } else {
                    Slot::Invalid
                }
            }
            TAG_EMPTY if self.0 == EMPTY_WORD => Slot::Empty,
            _ => Slot::Invalid,
        }
    }
}

/// The word of a table an earlier release kept, as this release stores it: a stored
/// entry's tag moved from 3 to 7 (its other bits are the same); `None` for every other
/// word, which is the same in both. Idempotent: a moved entry is not moved again.
pub(crate) fn move_stored_tag(word: u64) -> Option<u64> {
    (word & TAG_MASK == TAG_STORED_BEFORE).then_some(word | TAG_STORED)
}

/// Whether a stored or written-back object of `len` bytes is one the store writes: a
/// recompressed page is always compressed, never the raw page's length.
fn len_fits(len: u16, recompressed: bool) -> bool {
    let most = if recompressed {
        PAGE_SIZE as u16 - 1
    } else {
        PAGE_SIZE as u16
    };
    (1..=most).contains(&len)
}

/// The check byte of a same-filled entry's word: CRC-8 (polynomial 0x07) of the 53 bits the
/// entry holds, so any one flipped bit of the entry is caught, offset so that the word 0
/// (the zero page, the most common fill) has a check byte that is not 0. An empty entry
/// (all zeros) with one bit flipped into a same-filled tag then fails its check instead of
/// reading as a page of zeros.
fn fill_check(word: u64) -> u8 {
    let held = word & ((1 << (64 - FILL_SHIFT)) - 1);
    let crc = held.to_le_bytes()[..7]
        .iter()
        .fold(0u8, |crc, &b| CRC8[usize::from(crc ^ b)]);
    crc ^ 0xa5
}

/// CRC-8 (0x07) of every byte value.
const CRC8: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u8;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 0x80 != 0 {
                (c << 1) ^ 0x07
            } else {
                c << 1
            };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

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
            Slot::Same(0x0003_4567_89ab_cdef),
            Slot::Same(0xfff0_0000_0000_0001),
            Slot::Same(0x000f_ffff_ffff_ffff),
            Slot::Stored {
                handle: 0,
                len: 1,
                recompressed: false,
            },
            Slot::Stored {
                handle: 8 * 12345,
                len: 4095,
                recompressed: false,
            },
            Slot::Stored {
                handle: MAX_HANDLE,
                len: PAGE_SIZE as u16,
                recompressed: false,
            },
            Slot::Stored {
                handle: 8,
                len: 1,
                recompressed: true,
            },
            Slot::Stored {
                handle: MAX_HANDLE,
                len: PAGE_SIZE as u16 - 1,
                recompressed: true,
            },
            Slot::Staged(StagedAt::new(0, 0, 0).unwrap()),
            Slot::Staged(StagedAt::new(255, 65535, EPOCH_MODULUS - 1).unwrap()),
            Slot::Staged(StagedAt::new(7, 4095, 123_456_789).unwrap()),
            Slot::Lost,
            Slot::Backed {
                at: 0,
                len: 1,
                recompressed: false,
            },
            Slot::Backed {
                at: MAX_DISK_OFFSET,
                len: PAGE_SIZE as u16,
                recompressed: false,
            },
            Slot::Backed {
                at: 4096 * 3 + 17,
                len: 1234,
                recompressed: true,
            },
        ];
        for slot in slots {
            assert_eq!(Entry::pack(slot).slot(), slot, "{slot:?}");
            // A flip in the tag never makes a fill word the side map must hold: that entry
            // is the bare tag alone (a stored entry with bit 0 flipped once read as zeros).
            let word = Entry::pack(slot).word();
            for bit in 0..TAG_BITS {
                let flipped = word ^ (1 << bit);
                if flipped != TAG_SAME_EXT {
                    assert_ne!(
                        Entry::from_word(flipped).slot(),
                        Slot::SameExt,
                        "{slot:?}, bit {bit}"
                    );
                }
            }
        }
        assert_eq!(Entry::from_word(TAG_SAME_EXT).slot(), Slot::SameExt);
        assert_eq!(
            Entry::from_word(TAG_SAME_EXT | 1 << 9).slot(),
            Slot::Invalid
        );
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
            0x0010_0000_0000_0000,
            0xffe0_0000_0000_0000,
        ] {
            assert!(!Entry::same_fits(word));
            assert_eq!(Entry::pack(Slot::Same(word)).slot(), Slot::SameExt);
        }
        assert_eq!(Entry::default(), Entry::EMPTY);
    }

    #[test]
    fn words_no_entry_is_written_as_decode_as_invalid() {
        for high in [0u64, 1 << 20, u64::MAX << 3] {
            assert_eq!(Entry::from_word(high | TAG_UNUSED).slot(), Slot::Invalid);
        }
        // a written-back page of no bytes, or of more than a page; a recompressed one as
        // long as a raw page
        for len in [0u64, PAGE_SIZE as u64 + 1, LEN_MASK] {
            assert_eq!(
                Entry::from_word((5 << DISK_SHIFT) | (len << LEN_SHIFT) | TAG_BACKED).slot(),
                Slot::Invalid
            );
        }
        assert_eq!(
            Entry::from_word(BACKED_RECOMPRESSED | ((PAGE_SIZE as u64) << LEN_SHIFT) | TAG_BACKED)
                .slot(),
            Slot::Invalid
        );
        // an empty tag with anything above it
        assert_eq!(Entry::from_word(1 << 40).slot(), Slot::Invalid);
        // a stored page of no bytes, or of more than a page; a recompressed one as long as
        // a raw page
        for len in [0u64, PAGE_SIZE as u64 + 1, LEN_MASK] {
            for flag in [0, RECOMPRESSED] {
                assert_eq!(
                    Entry::from_word(flag | (len << LEN_SHIFT) | TAG_STORED).slot(),
                    Slot::Invalid
                );
            }
        }
        assert_eq!(
            Entry::from_word(RECOMPRESSED | ((PAGE_SIZE as u64) << LEN_SHIFT) | TAG_STORED).slot(),
            Slot::Invalid
        );
        assert_eq!(Entry::pack(Slot::Invalid).slot(), Slot::Invalid);
    }

    #[test]
    fn a_same_filled_entry_with_one_bit_flipped_is_invalid_or_another_valid_kind() {
        for word in [
            0u64,
            1,
            u64::MAX,
            0x0000_0000_dead_beef,
            0xffff_f000_0000_0000,
        ] {
            let entry = Entry::pack(Slot::Same(word)).word();
            for bit in 3..64 {
                let flipped = Entry::from_word(entry ^ (1 << bit)).slot();
                assert_eq!(flipped, Slot::Invalid, "word {word:#x}, bit {bit}");
            }
        }
        // The empty entry with a bit flipped into a same-filled tag: not a page of zeros.
        assert_eq!(
            Entry::from_word(EMPTY_WORD ^ TAG_SAME).slot(),
            Slot::Invalid
        );
        assert_eq!(Entry::from_word(TAG_SAME).slot(), Slot::Invalid);
    }

    /// Entries whose reads are checked (an object's checksum, a staged page's, or an error),
    /// of every kind the store writes.
    fn checked_entries() -> Vec<u64> {
        let mut words = Vec::new();
        for len in [1u16, 2, 17, 1000, 2048, 4095, PAGE_SIZE as u16] {
            for handle in [0, 8, 8 * 12345, 0x7654_3210 * 8, MAX_HANDLE] {
                for recompressed in [false, len < PAGE_SIZE as u16] {
                    words.push(Slot::Stored {
                        handle,
                        len,
                        recompressed,
                    });
                }
            }
            for at in [0, 4096 * 3 + 17, MAX_DISK_OFFSET] {
                for recompressed in [false, len < PAGE_SIZE as u16] {
                    words.push(Slot::Backed {
                        at,
                        len,
                        recompressed,
                    });
                }
            }
        }
        for (slot, index, epoch) in [(0, 0, 0), (255, 65535, EPOCH_MODULUS - 1), (7, 9, 77)] {
            words.push(Slot::Staged(StagedAt::new(slot, index, epoch).unwrap()));
        }
        words.push(Slot::Lost);
        words.into_iter().map(|s| Entry::pack(s).word()).collect()
    }

    /// A fill, the empty page and a side-map fill answer a read with no checksum: one bit
    /// flipped anywhere in an entry whose reads are checked must never turn it into one of
    /// them. (A stored entry under tag 3, as earlier releases wrote it, became a fill with
    /// bit 1 flipped whenever its bits held the fill's check byte.)
    #[test]
    fn no_one_flipped_bit_turns_a_checked_entry_into_an_unchecked_one() {
        for word in checked_entries() {
            for bit in 0..64 {
                let flipped = Entry::from_word(word ^ (1 << bit)).slot();
                assert!(
                    !matches!(flipped, Slot::Same(_) | Slot::SameExt | Slot::Empty),
                    "{:?} with bit {bit} flipped reads as {flipped:?}",
                    Entry::from_word(word).slot()
                );
            }
        }
        // What a tag-3 stored entry did: some of them carry a fill's check byte.
        let before = (0..1u64 << 16)
            .map(|h| (h << HANDLE_SHIFT) | (100 << LEN_SHIFT) | TAG_STORED_BEFORE)
            .filter(|w| matches!(Entry::from_word(w ^ 0b10).slot(), Slot::Same(_)))
            .count();
        assert!(before > 0, "the earlier layout's flip never read as a fill");
    }

    #[test]
    fn an_earlier_releases_stored_entries_move_to_their_tag_and_nothing_else_does() {
        let stored = Slot::Stored {
            handle: 8 * 777,
            len: 1234,
            recompressed: true,
        };
        let now = Entry::pack(stored).word();
        let before = now & !TAG_MASK | TAG_STORED_BEFORE;
        assert_eq!(Entry::from_word(before).slot(), Slot::Invalid);
        assert_eq!(move_stored_tag(before), Some(now));
        assert_eq!(Entry::from_word(now).slot(), stored);
        // Moved once; every other entry, of either layout, stays as it is.
        assert_eq!(move_stored_tag(now), None);
        let others = [
            Slot::Empty,
            Slot::Same(0),
            Slot::Same(u64::MAX),
            Slot::SameExt,
            Slot::Lost,
            Slot::Staged(StagedAt::new(3, 4, 5).unwrap()),
            Slot::Backed {
                at: 99,
                len: 7,
                recompressed: false,
            },
        ];
        for slot in others {
            assert_eq!(move_stored_tag(Entry::pack(slot).word()), None, "{slot:?}");
        }
        assert_eq!(move_stored_tag(0), None);
    }

    #[test]
    fn a_zeroed_entry_is_invalid_never_an_empty_page() {
        assert_eq!(Entry::EMPTY.slot(), Slot::Empty);
        assert_eq!(Entry::pack(Slot::Empty).word(), EMPTY_WORD);
        // A table page lost or cleared: its entries read as I/O errors, not as zeros.
        assert_eq!(Entry::from_word(0).slot(), Slot::Invalid);
        // Damage to the empty entry: any bit above the tag, any whole byte zeroed or set.
        for bit in 3..64 {
            let flipped = Entry::from_word(EMPTY_WORD ^ (1 << bit)).slot();
            assert_eq!(flipped, Slot::Invalid, "bit {bit}");
        }
        for byte in 0..8 {
            let mask = 0xffu64 << (8 * byte);
            for damaged in [EMPTY_WORD & !mask, EMPTY_WORD | mask] {
                assert_ne!(
                    Entry::from_word(damaged).slot(),
                    Slot::Empty,
                    "{damaged:#x}"
                );
            }
        }
        // Every word but the empty one that carries the empty tag is refused.
        for word in [1u64 << 3, !TAG_MASK, EMPTY_WORD << 8] {
            assert_eq!(Entry::from_word(word).slot(), Slot::Invalid, "{word:#x}");
        }
    }
}

//! The result format of a slot, the contract between a [`super::SlotBackend`] and the ring.
//! For a slot of `n` pages a backend fills a `meta` array of `3n + 1` little-endian `u32`
//! words and a `packed` byte buffer:
//!
//! - `meta[i]`: page `i`'s size word: [`SIZE_RAW`], [`SIZE_SAME_FILLED`],
//!   [`SIZE_REJECTED`] or the length of its compressed block (below the raw threshold);
//! - `meta[n + i]`: where page `i`'s data starts in `packed` (its block, or the 8-byte
//!   word of a same-filled page; raw and rejected pages have none);
//! - `meta[2n]`: the number of packed bytes;
//! - `meta[2n + 1 + i]`: the checksum ([`crate::page::page_checksum`]) of page `i` as the
//!   backend read it (for compressed and same-filled pages; anything for the others). The
//!   ring compares it with the checksum the page's writer recorded: a backend that
//!   compressed other bytes than were staged (a copy that went wrong, a slot reused too
//!   early) is caught before its result becomes the only copy.
//!
//! A GPU writes this straight into pinned host memory, so only compressed bytes cross
//! the bus. Everything here is checked on the host: a result that breaks the contract is
//! an error, never a panic or an out-of-bounds read.

use super::place::Placer;
use crate::page::PAGE_SIZE;

/// Size word of a page whose block would not be shorter than the raw threshold.
pub const SIZE_RAW: u32 = 0;
/// Size word of a page that is one `u64` repeated; the word is its packed data.
pub const SIZE_SAME_FILLED: u32 = u32::MAX;
/// Size word of a page whose compressed block failed the backend's own decode-and-compare
/// check: the page must be compressed on the CPU.
pub const SIZE_REJECTED: u32 = u32::MAX - 1;

/// Bytes of the meta array for `pages` pages.
pub const fn meta_bytes(pages: usize) -> usize {
    (3 * pages + 1) * 4
}

/// One page's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageResult<'a> {
    /// The page is this word repeated.
    SameFilled(u64),
    /// The page's compressed block.
    Compressed(&'a [u8]),
    /// Store the page's own bytes.
    Raw,
    /// The backend's check refused its own block: compress the page elsewhere.
    Rejected,
}

/// The results of one slot; see the module docs.
#[derive(Clone, Copy)]
pub struct SlotOutput<'a> {
    pages: usize,
    meta: &'a [u8],
    packed: &'a [u8],
    limit: usize,
    placer: Option<&'a dyn Placer>,
}

impl std::fmt::Debug for SlotOutput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotOutput")
            .field("pages", &self.pages)
            .field("packed", &self.packed.len())
            .field("limit", &self.limit)
            .field("placer", &self.placer.is_some())
            .finish_non_exhaustive()
    }
}

/// A result that breaks the format's contract (a backend bug).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("page {page} of the slot came back with an impossible result (size word {size})")]
pub struct BadResult {
    /// Page index in the slot.
    pub page: usize,
    /// Its size word.
    pub size: u32,
}

impl<'a> SlotOutput<'a> {
    /// The results of `pages` pages compressed with raw threshold `limit`. `meta` must
    /// hold [`meta_bytes`]`(pages)` bytes; `packed` the packed bytes (at least as many as
    /// the total says).
    pub fn new(
        pages: usize,
        meta: &'a [u8],
        packed: &'a [u8],
        limit: usize,
    ) -> Result<Self, BadResult> {
        let out = Self {
            pages,
            meta,
            packed,
            limit: limit.min(PAGE_SIZE),
            placer: None,
        };
        let bad = BadResult {
            page: pages,
            size: 0,
        };
        let total = out.word(2 * pages).ok_or(bad)?;
        if total as usize > packed.len() {
            return Err(BadResult { size: total, ..bad });
        }
        Ok(Self {
            packed: &packed[..total as usize],
            ..out
        })
    }

    /// The same results, with the backend's copy engine to place them in the store.
    pub fn with_placer(self, placer: &'a dyn Placer) -> Self {
        Self {
            placer: Some(placer),
            ..self
        }
    }

    /// The backend's copy engine, if it has one for these results.
    pub fn placer(&self) -> Option<&'a dyn Placer> {
        self.placer
    }

    /// Pages in the slot.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Bytes the packed results take.
    pub fn packed_bytes(&self) -> usize {
        self.packed.len()
    }

    fn word(&self, i: usize) -> Option<u32> {
        let b = self.meta.get(i * 4..i * 4 + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The checksum the backend reports for page `i`.
    pub fn checksum(&self, i: usize) -> Result<u32, BadResult> {
        let bad = BadResult { page: i, size: 0 };
        if i >= self.pages {
            return Err(bad);
        }
        self.word(2 * self.pages + 1 + i).ok_or(bad)
    }

    /// Page `i`'s result, checked against the contract.
    pub fn page(&self, i: usize) -> Result<PageResult<'a>, BadResult> {
        let size = if i < self.pages { self.word(i) } else { None };
        let bad = BadResult {
            page: i,
            size: size.unwrap_or(0),
        };
        let size = size.ok_or(bad)?;
        let data = |len: usize| {
            let start = self.word(self.pages + i)? as usize;
            self.packed.get(start..start.checked_add(len)?)
        };
        match size {
            SIZE_RAW => Ok(PageResult::Raw),
            SIZE_REJECTED => Ok(PageResult::Rejected),
            SIZE_SAME_FILLED => {
                let word = data(8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
                    .ok_or(bad)?;
                Ok(PageResult::SameFilled(word))
            }
            len if (len as usize) < self.limit => {
                Ok(PageResult::Compressed(data(len as usize).ok_or(bad)?))
            }
            _ => Err(bad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn every_kind_of_result_decodes() {
        let mut packed = vec![0u8; 32];
        packed[0..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        packed[8..11].copy_from_slice(b"abc");
        let m = meta(&[
            SIZE_SAME_FILLED,
            3,
            SIZE_RAW,
            SIZE_REJECTED,
            0,
            8,
            0,
            0,
            11,
            0xc0de,
            0xbeef,
            0,
            0,
        ]);
        let out = SlotOutput::new(4, &m, &packed, 3625).unwrap();
        assert_eq!(out.checksum(0), Ok(0xc0de));
        assert_eq!(out.checksum(1), Ok(0xbeef));
        assert!(out.checksum(4).is_err());
        assert_eq!(out.pages(), 4);
        assert_eq!(out.packed_bytes(), 11);
        assert_eq!(
            out.page(0),
            Ok(PageResult::SameFilled(0x1122_3344_5566_7788))
        );
        assert_eq!(out.page(1), Ok(PageResult::Compressed(b"abc")));
        assert_eq!(out.page(2), Ok(PageResult::Raw));
        assert_eq!(out.page(3), Ok(PageResult::Rejected));
        assert!(out.page(4).is_err());
    }

    #[test]
    fn broken_contracts_are_errors() {
        let packed = vec![0u8; 4096];
        // A block as long as the threshold; one past the packed total; a same-filled word
        // past the end; a total larger than the buffer; a meta array too short.
        let m = meta(&[3625, 100, SIZE_SAME_FILLED, 0, 4000, 4090, 4096]);
        let out = SlotOutput::new(3, &m, &packed, 3625).unwrap();
        assert_eq!(
            out.page(0),
            Err(BadResult {
                page: 0,
                size: 3625
            })
        );
        assert!(out.page(1).is_err());
        assert!(out.page(2).is_err());
        assert!(SlotOutput::new(3, &meta(&[0, 0, 0, 0, 0, 0, 5000]), &packed, 3625).is_err());
        assert!(SlotOutput::new(3, &meta(&[0, 0]), &packed, 3625).is_err());
        // An offset that overflows.
        let m = meta(&[10, u32::MAX, 20]);
        let out = SlotOutput::new(1, &m, &packed, 3625).unwrap();
        assert!(out.page(0).is_err());
    }

    #[test]
    fn meta_layout() {
        assert_eq!(meta_bytes(3), 40);
    }
}

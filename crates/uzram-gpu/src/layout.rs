//! The kernel's output contract, decoded on the host. For a batch of `n` pages the kernel
//! fills a `meta` array of `2n + 1` little-endian `u32` words and a `packed` byte buffer:
//!
//! - `meta[i]`: page `i`'s size word: [`SIZE_RAW`], [`SIZE_SAME_FILLED`] or the length of
//!   its LZ4 block (below the raw threshold);
//! - `meta[n + i]`: where page `i`'s data starts in `packed` (its block, or the repeated
//!   8-byte word of a same-filled page; raw pages have none);
//! - `meta[2n]`: the number of packed bytes (only these are copied back to the host).

use uzram_core::batch::PageOutcome;
use uzram_core::PAGE_SIZE;

use crate::GpuError;

/// Size word of a page that is one `u64` repeated; the word is its packed data.
pub const SIZE_SAME_FILLED: u32 = u32::MAX;
/// Size word of a page whose block would not be shorter than the raw threshold.
pub const SIZE_RAW: u32 = 0;

/// Bytes of the meta array for `pages` pages.
pub const fn meta_bytes(pages: usize) -> usize {
    (2 * pages + 1) * 4
}

/// Index of the packed-bytes total in the meta array.
pub const fn total_index(pages: usize) -> usize {
    2 * pages
}

/// Reads `u32` word `i` of a meta array.
pub fn meta_word(meta: &[u8], i: usize) -> Option<u32> {
    let b = meta.get(i * 4..i * 4 + 4)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Turns page `page`'s size word and packed offset into a [`PageOutcome`] and its packed
/// bytes, checking that the kernel kept its contract (a length below `limit`, data inside
/// `packed`).
pub fn decode_outcome(
    page: usize,
    size: u32,
    offset: u32,
    packed: &[u8],
    limit: usize,
) -> Result<(PageOutcome, &[u8]), GpuError> {
    let bad = GpuError::BadLength { page, len: size };
    let data = |len: usize| {
        let start = offset as usize;
        packed.get(start..start.checked_add(len)?)
    };
    match size {
        SIZE_RAW => Ok((PageOutcome::Raw, &[])),
        SIZE_SAME_FILLED => {
            let word = data(8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or(bad)?;
            Ok((PageOutcome::SameFilled(word), &[]))
        }
        len if (len as usize) < limit.min(PAGE_SIZE) => {
            let block = data(len as usize).ok_or(bad)?;
            Ok((PageOutcome::Compressed(len as u16), block))
        }
        _ => Err(bad),
    }
}

/// The raw-storage limit the kernel is given: blocks must be strictly shorter than this.
pub fn kernel_limit(raw_threshold: usize) -> u32 {
    raw_threshold.min(PAGE_SIZE) as u32
}

/// Bytes a page costs in memory for the ratio: block length, a whole page when raw,
/// nothing when same-filled (as zram counts `compr_data_size`).
pub fn stored_bytes(outcome: PageOutcome) -> usize {
    match outcome {
        PageOutcome::Compressed(len) => usize::from(len),
        PageOutcome::Raw => PAGE_SIZE,
        PageOutcome::SameFilled(_) | PageOutcome::Unset => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_words_decode() {
        let mut packed = vec![0u8; 64];
        packed[10..18].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        packed[20..23].copy_from_slice(b"abc");
        assert_eq!(
            decode_outcome(0, SIZE_SAME_FILLED, 10, &packed, 3625)
                .unwrap()
                .0,
            PageOutcome::SameFilled(0x1122_3344_5566_7788)
        );
        assert_eq!(
            decode_outcome(0, SIZE_RAW, 0, &packed, 3625).unwrap().0,
            PageOutcome::Raw
        );
        let (o, block) = decode_outcome(0, 3, 20, &packed, 3625).unwrap();
        assert_eq!(o, PageOutcome::Compressed(3));
        assert_eq!(block, b"abc");
    }

    #[test]
    fn impossible_lengths_and_offsets_are_errors() {
        let packed = vec![0u8; 4096];
        assert!(matches!(
            decode_outcome(7, 3625, 0, &packed, 3625),
            Err(GpuError::BadLength { page: 7, len: 3625 })
        ));
        assert!(decode_outcome(0, 4096, 0, &packed, 10_000).is_err());
        // Data past the packed bytes, for a block and for a same-filled word.
        assert!(decode_outcome(0, 100, 4000, &packed, 4096).is_err());
        assert!(decode_outcome(0, SIZE_SAME_FILLED, 4090, &packed, 4096).is_err());
        assert!(decode_outcome(0, 10, u32::MAX, &packed, 4096).is_err());
    }

    #[test]
    fn meta_layout() {
        assert_eq!(meta_bytes(3), 28);
        assert_eq!(total_index(3), 6);
        let meta: Vec<u8> = (0u32..7).flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(meta_word(&meta, 6), Some(6));
        assert_eq!(meta_word(&meta, 7), None);
    }

    #[test]
    fn limit_is_clamped_to_a_page() {
        assert_eq!(kernel_limit(3625), 3625);
        assert_eq!(kernel_limit(1 << 20), 4096);
        assert_eq!(stored_bytes(PageOutcome::Raw), PAGE_SIZE);
        assert_eq!(stored_bytes(PageOutcome::Compressed(9)), 9);
        assert_eq!(stored_bytes(PageOutcome::SameFilled(0)), 0);
    }
}

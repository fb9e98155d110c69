//! The kernel's output contract, decoded on the host: one `u32` size word and one
//! 4096-byte slot per page.

use uzram_core::batch::PageOutcome;
use uzram_core::PAGE_SIZE;

use crate::GpuError;

/// Size word of a page that is one `u64` repeated; the word is in the slot's first 8 bytes.
pub const SIZE_SAME_FILLED: u32 = u32::MAX;
/// Size word of a page whose block would not be shorter than the raw threshold.
pub const SIZE_RAW: u32 = 0;

/// Turns page `page`'s size word and output slot into a [`PageOutcome`], checking that the
/// kernel kept its contract (a length below `limit`, a slot of a whole page).
pub fn decode_outcome(
    page: usize,
    size: u32,
    slot: &[u8],
    limit: usize,
) -> Result<PageOutcome, GpuError> {
    match size {
        SIZE_RAW => Ok(PageOutcome::Raw),
        SIZE_SAME_FILLED => {
            let word = slot
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or(GpuError::BadLength { page, len: size })?;
            Ok(PageOutcome::SameFilled(word))
        }
        len if (len as usize) < limit.min(PAGE_SIZE) && (len as usize) <= slot.len() => {
            Ok(PageOutcome::Compressed(len as u16))
        }
        len => Err(GpuError::BadLength { page, len }),
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
        let mut slot = vec![0u8; PAGE_SIZE];
        slot[..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(
            decode_outcome(0, SIZE_SAME_FILLED, &slot, 3625).unwrap(),
            PageOutcome::SameFilled(0x1122_3344_5566_7788)
        );
        assert_eq!(
            decode_outcome(0, SIZE_RAW, &slot, 3625).unwrap(),
            PageOutcome::Raw
        );
        assert_eq!(
            decode_outcome(0, 3624, &slot, 3625).unwrap(),
            PageOutcome::Compressed(3624)
        );
    }

    #[test]
    fn impossible_lengths_are_errors() {
        let slot = vec![0u8; PAGE_SIZE];
        assert!(matches!(
            decode_outcome(7, 3625, &slot, 3625),
            Err(GpuError::BadLength { page: 7, len: 3625 })
        ));
        assert!(decode_outcome(0, 4096, &slot, 10_000).is_err());
        assert!(decode_outcome(0, 100, &slot[..50], 4096).is_err());
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

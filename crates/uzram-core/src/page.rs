//! Page geometry and same-filled page detection.

mod same_fill;

/// Bytes in one page: the unit the store keeps, compresses and accounts.
pub const PAGE_SIZE: usize = 4096;
/// log2(PAGE_SIZE).
pub const PAGE_SHIFT: u32 = 12;
/// log2 of the 512-byte sector the block layer counts in.
pub const SECTOR_SHIFT: u32 = 9;

/// If the whole page is one `u64` word repeated (zram's "same-filled" rule), returns that word.
///
/// Zero pages are the common case. The word is read little-endian, as zram does on x86.
#[inline]
pub fn same_filled_word(page: &[u8; PAGE_SIZE]) -> Option<u64> {
    same_fill::same_filled_word(page)
}

/// Fills `page` with `word` repeated: the inverse of [`same_filled_word`].
#[inline]
pub fn fill_page(page: &mut [u8; PAGE_SIZE], word: u64) {
    let bytes = word.to_le_bytes();
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&bytes);
    }
}

//! Page geometry, same-filled page detection and page checksums.

mod crc_copy;
mod same_fill;
mod size;
mod stream;
mod view;
mod words;

pub use self::crc_copy::page_to_words_streaming_checksummed;
pub use self::size::{PAGE_SHIFT, PAGE_SIZE, PAGE_WORDS, SECTOR_SHIFT};
pub(crate) use self::view::with_words_as_page;
pub use self::words::{page_to_words, words_to_page};
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
pub use stream::{bytes_to_words_streaming, words_to_words_streaming};
pub use stream::{page_to_words_streaming, stream_fence};

/// If the whole page is one `u64` word repeated (zram's "same-filled" rule), returns that word.
///
/// Zero pages are the common case. The word is read little-endian, as zram does on x86.
#[inline]
pub fn same_filled_word(page: &[u8; PAGE_SIZE]) -> Option<u64> {
    same_fill::same_filled_word(page)
}

/// The checksum every stored page carries: CRC32C (Castagnoli) of its 4096 bytes, by
/// carry-less multiplication where the CPU has it (x86-64 AVX-512 VPCLMULQDQ: the crate's
/// own fold, `page/crc_copy.rs`; else crc-fast's PCLMULQDQ or ARMv8 PMULL). The GPU computes
/// the same function over the pages it compresses, so the two can be compared.
#[inline]
pub fn page_checksum(page: &[u8; PAGE_SIZE]) -> u32 {
    crc_copy::checksum(page)
}

/// Fills `page` with `word` repeated: the inverse of [`same_filled_word`].
#[inline]
pub fn fill_page(page: &mut [u8; PAGE_SIZE], word: u64) {
    let bytes = word.to_le_bytes();
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&bytes);
    }
}

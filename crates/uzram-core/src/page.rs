//! Page geometry, same-filled page detection and page checksums.

mod same_fill;
mod stream;

#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
pub use stream::{bytes_to_words_streaming, words_to_words_streaming};
pub use stream::{page_to_words_streaming, stream_fence};

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Bytes in one page: the unit the store keeps, compresses and accounts.
pub const PAGE_SIZE: usize = 4096;
/// 64-bit words in one page.
pub const PAGE_WORDS: usize = PAGE_SIZE / 8;
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

/// The checksum every stored page carries: CRC32C (Castagnoli) of its 4096 bytes, by
/// carry-less multiplication where the CPU has it (x86-64 PCLMULQDQ and VPCLMULQDQ, ARMv8
/// PMULL). The GPU computes the same function over the pages it compresses, so the two can
/// be compared.
#[inline]
pub fn page_checksum(page: &[u8; PAGE_SIZE]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, page) as u32
}

/// Fills `page` with `word` repeated: the inverse of [`same_filled_word`].
#[inline]
pub fn fill_page(page: &mut [u8; PAGE_SIZE], word: u64) {
    let bytes = word.to_le_bytes();
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&bytes);
    }
}

/// Copies `page` into `words` (at least [`PAGE_WORDS`] long), as little-endian words with
/// relaxed stores: staging memory that other threads (and a device) read is held as atomic
/// words, so writers need no lock. On a little-endian host the words' bytes in memory are
/// exactly the page's bytes, which is what a device copying them sees.
#[inline]
pub fn page_to_words(page: &[u8; PAGE_SIZE], words: &[AtomicU64]) {
    for (w, chunk) in words.iter().zip(page.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        w.store(u64::from_le_bytes(b), Relaxed);
    }
}

/// Copies [`PAGE_WORDS`] words written by [`page_to_words`] back into `page`.
#[inline]
pub fn words_to_page(words: &[AtomicU64], page: &mut [u8; PAGE_SIZE]) {
    for (w, chunk) in words.iter().zip(page.chunks_exact_mut(8)) {
        chunk.copy_from_slice(&w.load(Relaxed).to_le_bytes());
    }
}

//! Pages as little-endian atomic words, the form staging and arena memory hold them in,
//! copied with relaxed loads and stores.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::size::PAGE_SIZE;

/// Copies `page` into `words` (at least [`PAGE_WORDS`](super::PAGE_WORDS) long), as little-endian words with
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

/// Copies [`PAGE_WORDS`](super::PAGE_WORDS) words written by [`page_to_words`] back into `page`.
#[inline]
pub fn words_to_page(words: &[AtomicU64], page: &mut [u8; PAGE_SIZE]) {
    for (w, chunk) in words.iter().zip(page.chunks_exact_mut(8)) {
        chunk.copy_from_slice(&w.load(Relaxed).to_le_bytes());
    }
}

//! Staging words read in place as the page they hold: a write the kernel copied straight
//! into a slot (ublk's user copy) is scanned and checksummed there, not copied out first.
//! With the `unsafe-stream` feature on a little-endian host the words are viewed as bytes;
//! without it they are copied into a page on the stack.

#![cfg_attr(feature = "unsafe-stream", allow(unsafe_code))]

use std::sync::atomic::AtomicU64;

use super::size::{PAGE_SIZE, PAGE_WORDS};

/// Calls `f` with the page the first [`PAGE_WORDS`] of `words` hold (as
/// [`super::page_to_words`] lays a page out); `None` when `words` is shorter.
///
/// Nothing may write `words` while this runs: the ring calls it only on words it leased to
/// the calling writer (`LeasedWords`), and the device only reads them. Crate-only for that
/// reason, as the other views and copies of staging words in this module's siblings.
#[inline]
pub(crate) fn with_words_as_page<R>(
    words: &[AtomicU64],
    f: impl FnOnce(&[u8; PAGE_SIZE]) -> R,
) -> Option<R> {
    let words = words.get(..PAGE_WORDS)?;
    #[cfg(all(target_endian = "little", feature = "unsafe-stream"))]
    {
        // SAFETY: `words` spans PAGE_WORDS * 8 = PAGE_SIZE bytes (`AtomicU64` has `u64`'s
        // size), and a byte array needs no alignment; on a little-endian host those bytes
        // are the page's. The caller guarantees that nothing writes them while `f` runs,
        // so reading them through a shared reference races with no store.
        let page = unsafe { &*words.as_ptr().cast::<[u8; PAGE_SIZE]>() };
        Some(f(page))
    }
    #[cfg(not(all(target_endian = "little", feature = "unsafe-stream")))]
    {
        let mut page = [0u8; PAGE_SIZE];
        super::words_to_page(words, &mut page);
        Some(f(&page))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::page_to_words;

    #[test]
    fn the_view_is_the_page_the_words_hold() {
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 7 + i / 13) as u8).collect();
        let page: &[u8; PAGE_SIZE] = page.as_slice().try_into().unwrap();
        let words: Vec<AtomicU64> = (0..PAGE_WORDS + 3).map(|_| AtomicU64::new(0)).collect();
        page_to_words(page, &words);
        assert_eq!(with_words_as_page(&words, |p| *p == *page), Some(true));
        assert_eq!(with_words_as_page(&words[..PAGE_WORDS - 1], |_| ()), None);
    }
}

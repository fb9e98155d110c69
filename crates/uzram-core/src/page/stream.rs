//! Copying pages into staging memory that a device reads next: with non-temporal stores on
//! x86_64 under the `unsafe-stream` feature (SSE2 intrinsics, the crate's second and last
//! `unsafe` module), else with the same relaxed word stores as [`super::page_to_words`].

#![cfg_attr(feature = "unsafe-stream", allow(unsafe_code))]

use std::sync::atomic::AtomicU64;

use super::PAGE_SIZE;

/// [`super::page_to_words`] with non-temporal stores, for staging memory that a device
/// reads next and the CPU does not: the copy neither reads the destination's cache lines
/// in first (read-for-ownership) nor evicts the writer's own data. On the GPU ring's write
/// path this copy is most of a queue thread's work per page (docs/gpu-notes.md, Run 22).
/// `next`, the page the caller copies after this one, is prefetched line by line as this
/// one is copied: the hardware's streamer stops at every 4 KiB boundary, and without the
/// prefetch each page starts with a wait on memory (Run 34: 1.4x the GB/s per CPU-second
/// with four writers on the GPU host). Call [`stream_fence`] before publishing the words to
/// other threads or a device.
///
/// Nothing may read or write `words` while this runs (the ring leases each index to one
/// writer, and publishes the page only afterwards, under the shard lock).
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
#[inline]
pub fn page_to_words_streaming(
    page: &[u8; PAGE_SIZE],
    next: Option<&[u8; PAGE_SIZE]>,
    words: &[AtomicU64],
) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_prefetch, _mm_stream_si128, _MM_HINT_T0,
    };

    let Some(words) = words.get(..super::PAGE_WORDS) else {
        return super::page_to_words(page, words);
    };
    let dst = words.as_ptr().cast::<__m128i>().cast_mut();
    if !dst.is_aligned() {
        // Streaming stores need 16-byte alignment; staging from page-aligned allocations
        // always has it.
        return super::page_to_words(page, words);
    }
    let src = page.as_ptr().cast::<__m128i>();
    // Without a next page, this one's lines again: already in cache, the prefetch is free.
    let ahead = next.unwrap_or(page).as_ptr();
    for line in 0..PAGE_SIZE / 64 {
        // SAFETY: SSE is part of x86_64; `line * 64` is inside the page `ahead` points at,
        // and a prefetch reads nothing architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.add(line * 64).cast()) };
        for i in line * 4..line * 4 + 4 {
            // SAFETY: SSE2 is part of x86_64. `src` and `dst` span PAGE_SIZE bytes (`words`
            // is PAGE_WORDS long, checked above) and `i < PAGE_SIZE / 16`; `dst` is 16-byte
            // aligned (checked above); the load is unaligned. The words are `AtomicU64`s,
            // whose interior mutability allows writes through a shared reference, and the
            // caller guarantees that no other access races with these plain stores.
            unsafe { _mm_stream_si128(dst.add(i), _mm_loadu_si128(src.add(i))) };
        }
    }
}

/// Without streaming stores: [`super::page_to_words`] (`next` is not needed).
#[cfg(not(all(target_arch = "x86_64", feature = "unsafe-stream")))]
#[inline]
pub fn page_to_words_streaming(
    page: &[u8; PAGE_SIZE],
    _next: Option<&[u8; PAGE_SIZE]>,
    words: &[AtomicU64],
) {
    super::page_to_words(page, words);
}

/// Orders [`page_to_words_streaming`]'s stores, and every other store before it, before
/// every later store of this thread (such as the entry that publishes the page).
#[inline]
pub fn stream_fence() {
    #[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
    // SAFETY: SSE is part of x86_64; `sfence` has no operands and touches no memory.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
    // Ordinary stores too (a staged page's book word before its entry): for the compiler,
    // as `sfence` is not a fence to it; on x86 this emits no instruction.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::{words_to_page, PAGE_WORDS};

    #[test]
    fn streamed_words_read_back_as_the_page() {
        let mut page = [0u8; PAGE_SIZE];
        for (i, b) in page.iter_mut().enumerate() {
            *b = (i * 31 + i / 7) as u8;
        }
        // One word more than a page: the second copy starts 8 bytes in, unaligned for
        // streaming stores, and must fall back to word stores with the same result.
        let words: Vec<AtomicU64> = (0..PAGE_WORDS + 1).map(|_| AtomicU64::new(7)).collect();
        for offset in [0, 1] {
            page_to_words_streaming(&page, Some(&page), &words[offset..]);
            stream_fence();
            let mut back = [0u8; PAGE_SIZE];
            words_to_page(&words[offset..], &mut back);
            assert_eq!(back, page, "offset {offset} words");
        }
        // A destination shorter than a page gets what fits, no panic.
        page_to_words_streaming(&page, None, &words[..3]);
    }
}

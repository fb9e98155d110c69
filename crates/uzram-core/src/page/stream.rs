//! Copying into memory the CPU does not read soon: pages into staging that a device reads
//! next, and (through the arena) compressed pages into the store. With non-temporal stores
//! on x86_64 under the `unsafe-stream` feature (SSE2 intrinsics), else with the same
//! relaxed word stores as [`super::page_to_words`].

#![cfg_attr(feature = "unsafe-stream", allow(unsafe_code))]

use std::sync::atomic::AtomicU64;

use super::size::PAGE_SIZE;
use super::words::page_to_words;

/// [`super::page_to_words`] with non-temporal stores, for staging memory that a device
/// reads next and the CPU does not: the copy neither reads the destination's cache lines
/// in first (read-for-ownership) nor evicts the writer's own data. On the GPU ring's write
/// path this copy is most of a queue thread's work per page (docs/gpu.md).
/// `next`, the page the caller copies after this one, is prefetched line by line as this
/// one is copied: the hardware's streamer stops at every 4 KiB boundary, and without the
/// prefetch each page starts with a wait on memory (the prefetch gave 1.4x the GB/s per
/// CPU-second with four writers on the GPU host). Call [`stream_fence`] before publishing
/// the words to other threads or a device.
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

    let Some(words) = words.get(..super::size::PAGE_WORDS) else {
        return page_to_words(page, words);
    };
    let dst = words.as_ptr().cast::<__m128i>().cast_mut();
    if !dst.is_aligned() {
        // Streaming stores need 16-byte alignment; staging from page-aligned allocations
        // always has it.
        return page_to_words(page, words);
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
    page_to_words(page, words);
}

/// Copies `n` bytes from `src` to `dst`: the 64-byte lines wholly inside the destination
/// with streaming stores, the partial lines at either end with plain ones (a line written
/// partly by streaming stores is flushed piecemeal, which made a word-by-word streaming
/// copy slower than plain stores).
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, the ranges do not overlap, and no
/// other access races with these plain loads and stores.
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
unsafe fn copy_lines_streaming(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};

    let head = (dst as usize).wrapping_neg() & 63;
    if n < head + 64 {
        // SAFETY: the caller's contract, for `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let lines = (n - head) / 64;
    let done = head + lines * 64;
    // SAFETY: `head` and the `n - done` bytes after `done` lie inside the caller's `n`
    // bytes; every line starts at `dst + head + 64 * l`, 64-byte aligned (so each 16-byte
    // store is aligned, as `_mm_stream_si128` needs) and ends at or before `dst + done`;
    // the loads are unaligned. SSE2 is part of x86_64.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (s, d) = (src.add(head), dst.add(head).cast::<__m128i>());
        for i in 0..lines * 4 {
            _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i * 16).cast()));
        }
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
    }
}

/// Copies `bytes` (at most `words.len() * 8` of them) into the start of `words` for memory
/// the CPU will not read soon (the arena, from the installers): whole lines with streaming
/// stores, as `copy_lines_streaming`. Call [`stream_fence`] before publishing them.
///
/// Nothing may read or write those words while this runs (the arena hands new space to
/// one writer, who publishes it under a shard lock only afterwards).
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
pub fn bytes_to_words_streaming(bytes: &[u8], words: &[AtomicU64]) {
    let n = bytes.len().min(words.len() * 8);
    // SAFETY: `n` bytes of both; `bytes` is not arena memory (it is borrowed immutably
    // while `words` is written through interior mutability, so they cannot be the same
    // memory); the caller guarantees that no other access races with these stores.
    unsafe { copy_lines_streaming(bytes.as_ptr(), words.as_ptr().cast::<u8>().cast_mut(), n) };
}

/// [`bytes_to_words_streaming`] from words (a staging slot's copy of a page) rather than
/// bytes; nothing may write `from` meanwhile.
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
pub fn words_to_words_streaming(from: &[AtomicU64], words: &[AtomicU64]) {
    let n = from.len().min(words.len()) * 8;
    // SAFETY: `n` bytes of both, which are different memory (the caller copies staging
    // into new arena space); `AtomicU64` has the representation of `u64`, and the caller
    // guarantees that no store races with these plain loads and stores.
    unsafe {
        copy_lines_streaming(
            from.as_ptr().cast::<u8>(),
            words.as_ptr().cast::<u8>().cast_mut(),
            n,
        )
    };
}

/// Orders [`page_to_words_streaming`]'s (and the other streaming copies') stores, and every
/// other store before them, before
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

    #[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
    #[test]
    fn line_streamed_copies_are_exact_at_every_offset_and_length() {
        use std::sync::atomic::Ordering::Relaxed;
        let src: Vec<u8> = (0..PAGE_SIZE + 64)
            .map(|i| (i * 131 + i / 5) as u8)
            .collect();
        let src_words: Vec<AtomicU64> = src
            .chunks_exact(8)
            .map(|c| AtomicU64::new(u64::from_le_bytes(c.try_into().unwrap())))
            .collect();
        let dst: Vec<AtomicU64> = (0..PAGE_WORDS + 24).map(|_| AtomicU64::new(0)).collect();
        let bytes_of = |w: &[AtomicU64]| -> Vec<u8> {
            w.iter()
                .flat_map(|w| w.load(Relaxed).to_le_bytes())
                .collect()
        };
        // Destinations at every word offset within a line, lengths around line multiples.
        for offset in 0..8 {
            for len in [0, 8, 56, 64, 72, 120, 128, 136, 1704, 4096] {
                for w in &dst {
                    w.store(u64::MAX, Relaxed);
                }
                let out = &dst[offset..offset + len / 8];
                bytes_to_words_streaming(&src[..len], out);
                stream_fence();
                assert_eq!(
                    bytes_of(out),
                    &src[..len],
                    "bytes offset {offset} len {len}"
                );
                let past = bytes_of(&dst[offset + len / 8..]);
                assert!(
                    past.iter().all(|&b| b == 0xff),
                    "bytes past offset {offset} len {len}"
                );
                words_to_words_streaming(&src_words[1..1 + len / 8], out);
                stream_fence();
                assert_eq!(
                    bytes_of(out),
                    &src[8..8 + len],
                    "words offset {offset} len {len}"
                );
            }
        }
    }
}

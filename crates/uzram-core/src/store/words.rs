//! The arena's two bulk operations on its words: a new zeroed segment, and an object's bytes
//! copied in. Under the `unsafe-arena` feature (little-endian targets) they are the
//! allocator's `calloc` and `memcpy`; without it, safe Rust with the same results.
//!
//! Why: on the GPU write path the installers' CPU per GiB is half the path's, and a profile
//! of it found most of it in these two: a `memset` of every new segment, even where the
//! allocator hands out memory the kernel has just zeroed, and a copy of each compressed page
//! that relaxed atomic stores hold to 8 bytes an instruction (docs/gpu.md has the profile and
//! what the change saves on the path a user runs).

#![cfg_attr(feature = "unsafe-arena", allow(unsafe_code))]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// `n` zeroed words, or `None` when the allocator has no memory to give: never an abort
/// (the arena grows on threads that serve swap I/O).
pub(super) fn zeroed(n: usize) -> Option<Box<[AtomicU64]>> {
    #[cfg(feature = "unsafe-arena")]
    if n > 0 {
        let layout = std::alloc::Layout::array::<AtomicU64>(n).ok()?;
        // SAFETY: `layout` has a non-zero size (n > 0, checked above).
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicU64>();
        if p.is_null() {
            return None;
        }
        // SAFETY: `p` is a new allocation with the layout a `Box<[AtomicU64]>` of `n` words
        // is freed with (`Layout::array::<AtomicU64>(n)`), owned by nothing else; all-zero
        // bytes are a valid `AtomicU64` (it has the representation of a `u64`).
        return Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) });
    }
    let mut words: Vec<AtomicU64> = Vec::new();
    words.try_reserve_exact(n).ok()?;
    words.extend((0..n).map(|_| AtomicU64::new(0)));
    Some(words.into_boxed_slice())
}

/// Stores `data` and then `trailer` (at most 8 bytes: the store's checksum) into `words`
/// (at least `(data.len() + trailer.len()) / 8` rounded up; what does not fit is left out),
/// little-endian, the last word padded with zeros.
///
/// Nothing may read or write these words while this runs: the arena hands the space to one
/// writer, who publishes it (under a shard lock) only afterwards.
pub(super) fn store_bytes(data: &[u8], trailer: &[u8], words: &[AtomicU64]) {
    let whole = data.len() / 8;
    let fits = whole.min(words.len());
    copy_whole(&data[..fits * 8], &words[..fits]);
    let tail = &data[whole * 8..];
    store_tail(tail, trailer, words.get(whole..).unwrap_or_default());
}

/// What [`store_bytes`] stores after `data`'s whole words: its last bytes and `trailer`,
/// into the words from `data.len() / 8` on. For an object whose whole words a copy engine
/// has just placed (`batch/place.rs`).
pub(super) fn store_bytes_tail(data: &[u8], trailer: &[u8], words: &[AtomicU64]) {
    let whole = data.len() / 8;
    store_tail(
        &data[whole * 8..],
        trailer,
        words.get(whole..).unwrap_or_default(),
    );
}

/// Whether `words` begin with `data`'s whole words (little-endian): a placed object's
/// bytes as the copy engine left them, held to the host's copy.
pub(super) fn holds_whole(data: &[u8], words: &[AtomicU64]) -> bool {
    let whole = data.len() / 8;
    words.len() >= whole
        && data
            .chunks_exact(8)
            .zip(words)
            .all(|(b, w)| w.load(Relaxed).to_le_bytes() == *b)
}

/// Copies the words of `from` into `words` (as many as both have), then `trailer` (at
/// most 8 bytes) into the word after them.
///
/// Nothing may write `from` or touch `words` while this runs: `words` as in [`store_bytes`];
/// `from` is a staging slot's copy of a page, which its ring writes only while no
/// installer holds the slot.
pub(super) fn store_words(from: &[AtomicU64], trailer: &[u8], words: &[AtomicU64]) {
    let n = from.len().min(words.len());
    copy_words(&from[..n], &words[..n]);
    store_tail(&[], trailer, words.get(n..).unwrap_or_default());
}

/// The last bytes of an object (under 8 of its payload, then its trailer of up to 8) into
/// the first one or two of `words`, zero-padded, assembled in registers.
///
/// Why not `u64::from_le_bytes` of a zeroed `[u8; 8]` with the bytes copied in: the copy
/// writes that stack buffer with narrow stores, the 8-byte load that follows cannot be
/// forwarded from them, and it waits until every older store has left the core, among them
/// the whole object just copied into cold arena lines (the installers' profile found a
/// third of their time on the instruction after that load).
fn store_tail(tail: &[u8], trailer: &[u8], words: &[AtomicU64]) {
    let n = tail.len() + trailer.len();
    if n == 0 {
        return;
    }
    let (mut lo, mut hi) = (0u64, 0u64);
    for (i, &b) in tail.iter().chain(trailer).enumerate() {
        if i < 8 {
            lo |= u64::from(b) << (8 * i);
        } else {
            hi |= u64::from(b) << (8 * (i - 8));
        }
    }
    if let Some(w) = words.first() {
        w.store(lo, Relaxed);
    }
    if n > 8 {
        if let Some(w) = words.get(1) {
            w.store(hi, Relaxed);
        }
    }
}

/// Whole lines with streaming stores: no read for ownership of the arena's cold lines,
/// which the CPU does not read again soon. The arena fences before anything publishes them.
#[cfg(all(
    feature = "unsafe-arena",
    target_arch = "x86_64",
    feature = "unsafe-stream"
))]
fn copy_words(from: &[AtomicU64], words: &[AtomicU64]) {
    crate::page::words_to_words_streaming(from, words);
}

#[cfg(all(
    feature = "unsafe-arena",
    not(all(target_arch = "x86_64", feature = "unsafe-stream"))
))]
fn copy_words(from: &[AtomicU64], words: &[AtomicU64]) {
    debug_assert_eq!(from.len(), words.len());
    let n = from.len().min(words.len());
    // SAFETY: both ranges hold `n` words and do not overlap (`from` is not arena space
    // handed to this writer); `AtomicU64` has the representation of `u64` and interior
    // mutability, so reading and writing through pointers from shared references is
    // allowed, and the caller guarantees no store to either races with this copy.
    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), words.as_ptr().cast_mut(), n) };
}

#[cfg(not(feature = "unsafe-arena"))]
fn copy_words(from: &[AtomicU64], words: &[AtomicU64]) {
    for (f, w) in from.iter().zip(words) {
        w.store(f.load(Relaxed), Relaxed);
    }
}

/// `bytes` (exactly `words.len() * 8`) into `words`: whole lines with streaming stores, as
/// [`copy_words`] (memory bytes equal a word's little-endian bytes only on little-endian
/// targets).
#[cfg(all(
    feature = "unsafe-arena",
    target_endian = "little",
    target_arch = "x86_64",
    feature = "unsafe-stream"
))]
fn copy_whole(bytes: &[u8], words: &[AtomicU64]) {
    debug_assert_eq!(bytes.len(), words.len() * 8);
    crate::page::bytes_to_words_streaming(bytes, words);
}

/// `bytes` (exactly `words.len() * 8`) into `words`, with one `memcpy`.
#[cfg(all(
    feature = "unsafe-arena",
    target_endian = "little",
    not(all(target_arch = "x86_64", feature = "unsafe-stream"))
))]
fn copy_whole(bytes: &[u8], words: &[AtomicU64]) {
    debug_assert_eq!(bytes.len(), words.len() * 8);
    let n = bytes.len().min(words.len() * 8);
    // SAFETY: both ranges are `n` bytes long and do not overlap (`bytes` is not arena
    // memory borrowed as words); `AtomicU64` has interior mutability, so writing through a
    // pointer from a shared reference is allowed, and the caller guarantees that no other
    // access races with these plain stores (see `store_bytes`).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_ptr().cast::<u8>().cast_mut(), n)
    };
}

/// `bytes` (exactly `words.len() * 8`) into `words`, word by word.
#[cfg(not(all(feature = "unsafe-arena", target_endian = "little")))]
fn copy_whole(bytes: &[u8], words: &[AtomicU64]) {
    for (chunk, word) in bytes.chunks_exact(8).zip(words) {
        let bytes: Result<[u8; 8], _> = chunk.try_into();
        word.store(bytes.map_or(0, u64::from_le_bytes), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(words: &[AtomicU64]) -> Vec<u8> {
        words
            .iter()
            .flat_map(|w| w.load(Relaxed).to_le_bytes())
            .collect()
    }

    #[test]
    fn zeroed_words_are_zero_and_as_many_as_asked() {
        for n in [0, 1, 8192] {
            let words = zeroed(n).expect("memory");
            assert_eq!(words.len(), n);
            assert!(words.iter().all(|w| w.load(Relaxed) == 0));
        }
    }

    #[test]
    fn stored_bytes_read_back_with_a_zero_padded_tail() {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 37 + 11) as u8).collect();
        for len in [0, 1, 7, 8, 9, 64, 199, 200] {
            let words: Vec<AtomicU64> = (0..26).map(|_| AtomicU64::new(u64::MAX)).collect();
            store_bytes(&data[..len], &[], &words);
            let back = read(&words);
            assert_eq!(&back[..len], &data[..len], "len {len}");
            let padded = len.div_ceil(8) * 8;
            assert!(back[len..padded].iter().all(|&b| b == 0), "len {len} tail");
            assert!(back[padded..].iter().all(|&b| b == 0xff), "len {len} past");
        }
    }

    #[test]
    fn stored_words_read_back_and_stop_where_either_side_ends() {
        let from: Vec<AtomicU64> = (0..5u64)
            .map(|i| AtomicU64::new(i * 0x0101_0101_0101_0101 + 7))
            .collect();
        for n in [0, 3, 5, 8] {
            let words: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(u64::MAX)).collect();
            store_words(&from, &[], &words);
            for (i, w) in words.iter().enumerate() {
                let want = from.get(i).map_or(u64::MAX, |f| f.load(Relaxed));
                assert_eq!(w.load(Relaxed), want, "n {n} word {i}");
            }
        }
    }

    #[test]
    fn too_few_words_take_what_fits() {
        let data = [0xabu8; 30];
        let words: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
        store_bytes(&data, &[1, 2, 3, 4], &words);
        assert_eq!(read(&words), vec![0xab; 16]);
    }

    #[test]
    fn a_trailer_follows_the_payload_in_the_same_or_the_next_word() {
        let data: Vec<u8> = (0..40u8).collect();
        let trailer = [0xc1, 0xc2, 0xc3, 0xc4];
        for len in [0, 1, 3, 4, 5, 7, 8, 12, 13, 39] {
            let words: Vec<AtomicU64> = (0..8).map(|_| AtomicU64::new(u64::MAX)).collect();
            store_bytes(&data[..len], &trailer, &words);
            let back = read(&words);
            assert_eq!(&back[..len], &data[..len], "len {len}");
            assert_eq!(&back[len..len + 4], &trailer, "len {len}");
            let padded = (len + 4).div_ceil(8) * 8;
            assert!(
                back[len + 4..padded].iter().all(|&b| b == 0),
                "len {len} pad"
            );
            assert!(back[padded..].iter().all(|&b| b == 0xff), "len {len} past");
        }
        let from: Vec<AtomicU64> = (0..3u64).map(AtomicU64::new).collect();
        let words: Vec<AtomicU64> = (0..5).map(|_| AtomicU64::new(u64::MAX)).collect();
        store_words(&from, &trailer, &words);
        assert_eq!(words[3].load(Relaxed), 0xc4c3_c2c1);
        assert_eq!(words[4].load(Relaxed), u64::MAX);
    }
}

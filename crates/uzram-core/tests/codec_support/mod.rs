//! Helpers shared by the codec tests: test pages and a thin liblz4 wrapper.
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use uzram_core::page::PAGE_SIZE;

pub type Page = [u8; PAGE_SIZE];

/// The checked-in corpus slices (`testdata/*.slice.pages.zst`: a Python heap, a swap mix and
/// heaps of a compiler, a JVM, node, postgres, redis and numpy).
pub fn corpus_pages() -> Vec<Page> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("testdata")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".slice.pages.zst"))
        .collect();
    names.sort();
    let mut pages = Vec::new();
    for name in names {
        let z = std::fs::read(dir.join(name)).expect("testdata slice");
        let raw = zstd::stream::decode_all(&z[..]).expect("zstd slice");
        assert_eq!(raw.len() % PAGE_SIZE, 0);
        pages.extend(
            raw.chunks_exact(PAGE_SIZE)
                .map(|c| <Page>::try_from(c).unwrap()),
        );
    }
    pages
}

/// Pages that exercise a codec's corners: random, low-entropy, runs, short periods,
/// long matches, one odd byte at either end. The first page is always random bytes.
pub fn synthetic_pages(seed: u64, n: usize) -> Vec<Page> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let mut p = [0u8; PAGE_SIZE];
            match i % 8 {
                0 => rng.fill(&mut p[..]),
                1 => p.iter_mut().for_each(|b| *b = rng.gen_range(0..4)),
                2 => {
                    let period = rng.gen_range(1..24);
                    let pat: Vec<u8> = (0..period).map(|_| rng.gen()).collect();
                    p.iter_mut()
                        .zip(pat.iter().cycle())
                        .for_each(|(b, s)| *b = *s);
                }
                3 => {
                    // Runs of random length and value.
                    let mut i = 0;
                    while i < PAGE_SIZE {
                        let len = rng.gen_range(1..300).min(PAGE_SIZE - i);
                        let v = rng.gen();
                        p[i..i + len].fill(v);
                        i += len;
                    }
                }
                4 => {
                    // Text-like: words from a small dictionary.
                    let words = [
                        &b"alpha "[..],
                        b"beta ",
                        b"gamma ",
                        b"delta\n",
                        b"x",
                        b"0123456789",
                    ];
                    let mut i = 0;
                    while i < PAGE_SIZE {
                        let w = words[rng.gen_range(0..words.len())];
                        let n = w.len().min(PAGE_SIZE - i);
                        p[i..i + n].copy_from_slice(&w[..n]);
                        i += n;
                    }
                }
                5 => {
                    p[PAGE_SIZE - 1] = rng.gen_range(1..=255);
                }
                6 => {
                    p.fill(0x5A);
                    p[0] = rng.gen();
                }
                _ => {
                    // Half random, then the first half again (one long match).
                    rng.fill(&mut p[..PAGE_SIZE / 2]);
                    let (a, b) = p.split_at_mut(PAGE_SIZE / 2);
                    b.copy_from_slice(a);
                }
            }
            p
        })
        .collect()
}

/// liblz4 (C) through lz4-sys: the reference the codec is compared with.
pub mod liblz4 {
    use std::os::raw::{c_char, c_int};

    use super::{Page, PAGE_SIZE};

    /// The page alone through `LZ4_compress_fast_continue` on a fresh stream (the parse the
    /// codec makes), into a buffer of `cap` bytes; None when it does not fit. The crate's
    /// reference, which the cargo-fuzz targets compare with too.
    pub fn compress(page: &Page, cap: usize) -> Option<Vec<u8>> {
        uzram_core::fuzz::liblz4::compress(page, cap)
    }

    /// `LZ4_compress_default` (4-byte hash, 2^13 entries) into a buffer of `cap` bytes.
    pub fn compress_default(page: &Page, cap: usize) -> Option<Vec<u8>> {
        let mut out = vec![0u8; cap];
        // SAFETY: `page` (PAGE_SIZE bytes) and `out` (cap bytes) are live and distinct;
        // liblz4 writes at most `cap` bytes.
        let n = unsafe {
            lz4_sys::LZ4_compress_default(
                page.as_ptr().cast::<c_char>(),
                out.as_mut_ptr().cast::<c_char>(),
                PAGE_SIZE as c_int,
                cap as c_int,
            )
        };
        (n > 0).then(|| {
            out.truncate(n as usize);
            out
        })
    }

    /// `LZ4_decompress_safe` into one page; None unless it decodes to exactly a page.
    pub fn decompress(src: &[u8]) -> Option<Vec<u8>> {
        let mut out = vec![0u8; PAGE_SIZE];
        // SAFETY: `src` and `out` are live and distinct with the lengths passed;
        // LZ4_decompress_safe stays inside both for any input.
        let n = unsafe {
            lz4_sys::LZ4_decompress_safe(
                src.as_ptr().cast::<c_char>(),
                out.as_mut_ptr().cast::<c_char>(),
                src.len() as c_int,
                PAGE_SIZE as c_int,
            )
        };
        (n == PAGE_SIZE as c_int).then_some(out)
    }
}

//! Page generators shared by the store's integration tests.
#![allow(dead_code)]

use std::sync::OnceLock;

use uzram_core::page::fill_page;
use uzram_core::PAGE_SIZE;

/// A boxed page.
pub type Page = Box<[u8; PAGE_SIZE]>;

/// Real pages: the checked-in corpus slices (`testdata/*.slice.pages.zst`), concatenated.
pub fn corpus_pages() -> &'static [u8] {
    static PAGES: OnceLock<Vec<u8>> = OnceLock::new();
    PAGES.get_or_init(|| {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");
        let mut all = Vec::new();
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".slice.pages.zst"))
            .collect();
        names.sort();
        for name in names {
            let path = format!("{dir}/{name}");
            let packed = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let raw = zstd::decode_all(&packed[..]).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(raw.len() % PAGE_SIZE, 0, "{path}");
            all.extend_from_slice(&raw);
        }
        all
    })
}

/// Number of corpus pages.
pub fn corpus_len() -> usize {
    corpus_pages().len() / PAGE_SIZE
}

/// Corpus page `i` (modulo the corpus size).
pub fn corpus_page(i: usize) -> Page {
    let i = i % corpus_len();
    let mut page = Box::new([0u8; PAGE_SIZE]);
    page.copy_from_slice(&corpus_pages()[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
    page
}

/// xorshift64* stream.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Incompressible noise.
pub fn noise_page(seed: u64) -> Page {
    let mut rng = Rng::new(seed);
    let mut page = Box::new([0u8; PAGE_SIZE]);
    for chunk in page.chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.next().to_le_bytes());
    }
    page
}

/// Random but compressible: runs of random bytes copied from earlier in the page.
pub fn random_page(seed: u64) -> Page {
    let mut rng = Rng::new(seed);
    let mut page = Box::new([0u8; PAGE_SIZE]);
    let mut at = 0;
    while at < PAGE_SIZE {
        let run = 4 + (rng.next() % 60) as usize;
        let end = (at + run).min(PAGE_SIZE);
        if at > 64 && !rng.next().is_multiple_of(3) {
            let from = (rng.next() as usize) % (at - 32);
            for i in at..end {
                page[i] = page[from + (i - at) % 32];
            }
        } else {
            for b in &mut page[at..end] {
                *b = rng.next() as u8;
            }
        }
        at = end;
    }
    page
}

/// A page that is `word` repeated.
pub fn same_page(word: u64) -> Page {
    let mut page = Box::new([0u8; PAGE_SIZE]);
    fill_page(&mut page, word);
    page
}

/// A page stamped with `(index, writer, version)` in its first 24 bytes and filled with
/// bytes derived from them, so a reader can tell which write it came from and whether
/// it is whole. `kind` picks compressible, incompressible or corpus-based filler.
pub fn stamped_page(index: u64, writer: u64, version: u64, kind: u8) -> Page {
    let seed = index ^ (writer << 40) ^ (version << 20);
    let mut page = match kind % 3 {
        0 => random_page(seed),
        1 => noise_page(seed),
        _ => corpus_page(seed as usize),
    };
    page[0..8].copy_from_slice(&index.to_le_bytes());
    page[8..16].copy_from_slice(&writer.to_le_bytes());
    page[16..24].copy_from_slice(&(version | (u64::from(kind) << 56)).to_le_bytes());
    page
}

/// If `page` is a whole page made by [`stamped_page`], its `(index, writer, version)`.
pub fn read_stamp(page: &[u8; PAGE_SIZE]) -> Option<(u64, u64, u64)> {
    let word = |i: usize| u64::from_le_bytes(page[i * 8..i * 8 + 8].try_into().unwrap());
    let (index, writer, tagged) = (word(0), word(1), word(2));
    let (version, kind) = (tagged & ((1 << 56) - 1), (tagged >> 56) as u8);
    let expect = stamped_page(index, writer, version, kind);
    (expect[..] == page[..]).then_some((index, writer, version))
}

//! Page sets and the exactness check shared by the GPU tests and the benchmark.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use rand::{Rng, RngCore, SeedableRng};
use uzram_core::batch::{BatchBackend, BatchOutput, CpuBackend, Encoded};
use uzram_core::codec::Algorithm;
use uzram_core::page::same_filled_word;
use uzram_core::PAGE_SIZE;

/// The checked-in 512-page slices of both corpora (`$UZRAM_TESTDATA_DIR`, default the
/// repository's `testdata/`, for binaries run away from their build tree).
pub fn slice_paths() -> Vec<PathBuf> {
    let dir = std::env::var_os("UZRAM_TESTDATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata"));
    ["python-heap", "mixed-swap"]
        .iter()
        .map(|n| dir.join(format!("{n}.slice.pages.zst")))
        .collect()
}

/// The full 64 MiB corpora in `$UZRAM_CORPUS_DIR` (`*.pages.zst`), if that is set.
pub fn full_corpus_paths() -> Result<Vec<PathBuf>, String> {
    let dir =
        std::env::var("UZRAM_CORPUS_DIR").map_err(|_| "UZRAM_CORPUS_DIR is not set".to_string())?;
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{dir}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pages.zst"))
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(format!("no *.pages.zst in {dir}"));
    }
    Ok(v)
}

/// Reads a zstd-compressed page file.
pub fn load_pages(path: &Path) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let data = zstd::decode_all(f).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(data.len() % PAGE_SIZE, 0, "{}", path.display());
    data
}

/// Short name of a corpus file.
pub fn corpus_name(path: &Path) -> String {
    let n = path.file_name().unwrap_or_default().to_string_lossy();
    n.split('.').next().unwrap_or("corpus").to_string()
}

/// Incompressible pages.
pub fn random_pages(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; n * PAGE_SIZE];
    rng.fill_bytes(&mut v);
    v
}

/// Pages built to hit the parser's edge cases.
pub fn adversarial_pages() -> Vec<u8> {
    let mut pages: Vec<[u8; PAGE_SIZE]> = Vec::new();
    // All zero but one byte, at the block's edges and the LZ4 end-of-block limits.
    for pos in [
        0, 1, 3, 7, 8, 15, 16, 100, 2047, 2048, 4079, 4083, 4084, 4085, 4086, 4087, 4088, 4090,
        4091, 4092, 4094, 4095,
    ] {
        for val in [1u8, 0xff] {
            let mut p = [0u8; PAGE_SIZE];
            p[pos] = val;
            pages.push(p);
        }
    }
    // Repeated short patterns (period 1..=8 words of different bytes are not same-filled).
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for period in [
        1usize, 2, 3, 4, 5, 6, 7, 9, 12, 13, 16, 17, 31, 32, 33, 64, 127, 255, 256, 257, 1000,
        2049, 4095,
    ] {
        let pat: Vec<u8> = (0..period).map(|_| rng.gen()).collect();
        let mut p = [0u8; PAGE_SIZE];
        for (i, b) in p.iter_mut().enumerate() {
            *b = pat[i % period];
        }
        pages.push(p);
        // The same with a random tail of varying length, and a random head.
        for tail in [1usize, 5, 11, 12, 13, 40] {
            let mut q = p;
            rng.fill_bytes(&mut q[PAGE_SIZE - tail..]);
            pages.push(q);
            let mut h = p;
            rng.fill_bytes(&mut h[..tail * 7]);
            pages.push(h);
        }
    }
    // Same-filled pages with non-zero words, and a near-same-filled one.
    for word in [0x0101_0101_0101_0101u64, 0xdead_beef_0000_0001, u64::MAX] {
        let mut p = [0u8; PAGE_SIZE];
        for w in p.chunks_exact_mut(8) {
            w.copy_from_slice(&word.to_le_bytes());
        }
        pages.push(p);
        p[4095] ^= 1;
        pages.push(p);
    }
    // Long runs with literal runs between them (length fields >= 15 and >= 270).
    for lit in [14usize, 15, 16, 269, 270, 271, 524, 525, 1500] {
        let mut p = [0u8; PAGE_SIZE];
        rng.fill_bytes(&mut p[..lit]);
        pages.push(p);
        let mut q = [b'a'; PAGE_SIZE];
        rng.fill_bytes(&mut q[1000..1000 + lit]);
        pages.push(q);
    }
    // Text-like pages: words from a small vocabulary.
    let words = [
        "the ", "page ", "swap ", "zram ", "gpu ", "lz4 ", "block ", "\n", "0x", "fff",
    ];
    for _ in 0..16 {
        let mut p = [0u8; PAGE_SIZE];
        let mut i = 0;
        while i < PAGE_SIZE {
            let w = words[rng.gen_range(0..words.len())].as_bytes();
            let n = w.len().min(PAGE_SIZE - i);
            p[i..i + n].copy_from_slice(&w[..n]);
            i += n;
        }
        pages.push(p);
    }
    pages.concat()
}

/// What one batch check found.
#[derive(Debug, Default, Clone, Copy)]
pub struct Check {
    pub pages: usize,
    /// Pages whose result does not decode to exactly the input (must be 0).
    pub mismatches: usize,
    pub compressed: usize,
    pub raw: usize,
    pub same_filled: usize,
    /// Bytes stored by the GPU results / the CPU reference (raw pages count whole).
    pub gpu_bytes: usize,
    pub cpu_bytes: usize,
}

impl Check {
    /// GPU ratio ÷ CPU ratio (stored bytes, lower is better, so cpu/gpu).
    pub fn ratio_vs_cpu(&self) -> f64 {
        self.cpu_bytes.max(1) as f64 / self.gpu_bytes.max(1) as f64
    }
}

fn stored(e: Option<Encoded<'_>>) -> usize {
    match e {
        Some(Encoded::Compressed(b)) => b.len(),
        Some(Encoded::Raw) => PAGE_SIZE,
        _ => 0,
    }
}

/// Checks every page of `gpu_out` (produced from `pages` with `threshold`) decodes on the
/// CPU to exactly its input, and compares the stored size with the CPU backend's.
pub fn check(pages: &[u8], threshold: usize, gpu_out: &BatchOutput) -> Check {
    let cpu = CpuBackend::new(Algorithm::Lz4, None);
    let mut cpu_out = BatchOutput::default();
    cpu.compress_batch(pages, threshold, &mut cpu_out)
        .expect("CPU reference failed");
    let mut c = Check::default();
    let mut buf = [0u8; PAGE_SIZE];
    for (i, page) in pages.chunks_exact(PAGE_SIZE).enumerate() {
        let page: &[u8; PAGE_SIZE] = page.try_into().unwrap();
        c.pages += 1;
        let got = gpu_out.get(i);
        let ok = match got {
            Some(Encoded::SameFilled(w)) => {
                c.same_filled += 1;
                same_filled_word(page) == Some(w)
            }
            Some(Encoded::Compressed(b)) => {
                c.compressed += 1;
                b.len() < threshold.min(PAGE_SIZE)
                    && same_filled_word(page).is_none()
                    && matches!(lz4_flex::block::decompress_into(b, &mut buf), Ok(PAGE_SIZE))
                    && buf == *page
            }
            Some(Encoded::Raw) => {
                c.raw += 1;
                same_filled_word(page).is_none()
            }
            None => false,
        };
        if !ok {
            if c.mismatches < 5 {
                eprintln!(
                    "MISMATCH page {i}: {:?}",
                    got.map(|e| match e {
                        Encoded::Compressed(b) => format!("compressed {} bytes", b.len()),
                        other => format!("{other:?}"),
                    })
                );
            }
            c.mismatches += 1;
        }
        c.gpu_bytes += stored(got);
        c.cpu_bytes += stored(cpu_out.get(i));
    }
    c
}

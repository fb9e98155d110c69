//! Page sets, a way to run pages through GPU slots, and the exactness check shared by the
//! GPU tests and the benchmark.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use rand::{Rng, RngCore, SeedableRng};
use uzram_core::batch::{BackendError, PageResult, SlotBackend};
use uzram_core::codec::{Lz4Codec, PageCodec};
use uzram_core::page::{page_to_words, same_filled_word};
use uzram_core::{PAGE_SIZE, PAGE_WORDS};
use uzram_gpu::{ErrorKind, GpuConfig, GpuSlots, Parse};

/// GPU slots of this shape, or `None` (with the reason printed) where there is no GPU.
pub fn gpu(slots: usize, slot_pages: usize, parse: Parse, graphs: bool) -> Option<GpuSlots> {
    let cfg = GpuConfig {
        slots,
        slot_pages,
        parse,
        graphs,
        ..GpuConfig::default()
    };
    match GpuSlots::new(cfg) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            None
        }
        Err(e) => panic!("GPU present but the backend failed to start: {e}"),
    }
}

/// [`gpu`], with the slots' staging in `inputs`, registered with the GPU ([`GpuSlots::on_over`]).
pub fn gpu_over(
    slots: usize,
    slot_pages: usize,
    parse: Parse,
    inputs: &'static [std::sync::atomic::AtomicU64],
) -> Option<GpuSlots> {
    let cfg = GpuConfig {
        slots,
        slot_pages,
        parse,
        ..GpuConfig::default()
    };
    let gpus = match GpuSlots::open(&cfg) {
        Ok(g) => g,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            return None;
        }
        Err(e) => panic!("GPU present but it failed to open: {e}"),
    };
    Some(GpuSlots::on_over(gpus, cfg, Some(inputs)).expect("slots over registered staging"))
}

/// `n` zeroed words starting on a page, for the rest of the process: staging memory of the
/// caller's, as the daemon's shared memory segment is.
pub fn kept_words(n: usize) -> &'static [std::sync::atomic::AtomicU64] {
    let layout = std::alloc::Layout::from_size_align(n.max(1) * 8, 4096).expect("layout");
    // SAFETY: a non-zero size; the memory is never freed (leaked for the process), zeroed
    // words are valid AtomicU64s, and the slice covers exactly the allocation.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout);
        assert!(!p.is_null(), "out of memory");
        std::slice::from_raw_parts(p.cast::<std::sync::atomic::AtomicU64>(), n)
    }
}

/// The parses the loaded kernels have (`high` once it exists).
pub fn parses() -> Vec<Parse> {
    let mut v = vec![Parse::Fast];
    if uzram_gpu::ptx::PTX.contains(&format!(".entry {}(", uzram_gpu::Kernel::High.entry())) {
        v.push(Parse::High);
    }
    v
}

/// One page's result, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owned {
    Same(u64),
    Block(Vec<u8>),
    Raw,
    Rejected,
    /// The result broke the layout's contract.
    Bad,
}

/// Runs `pages` through the slots, one slot after another, and collects every result.
pub fn run_slots(slots: &GpuSlots, pages: &[u8], limit: usize) -> Result<Vec<Owned>, BackendError> {
    let per = slots.slot_pages();
    let mut out = Vec::with_capacity(pages.len() / PAGE_SIZE);
    for (n, chunk) in pages.chunks(per * PAGE_SIZE).enumerate() {
        let slot = n % slots.slots();
        let input = slots.input(slot);
        for (i, page) in chunk.chunks_exact(PAGE_SIZE).enumerate() {
            page_to_words(
                page.try_into().unwrap(),
                &input[i * PAGE_WORDS..(i + 1) * PAGE_WORDS],
            );
        }
        let count = chunk.len() / PAGE_SIZE;
        slots.submit(slot, count, limit)?;
        slots.complete(slot, &mut |o| {
            for i in 0..count {
                out.push(match o.page(i) {
                    Ok(PageResult::SameFilled(w)) => Owned::Same(w),
                    Ok(PageResult::Compressed(b)) => Owned::Block(b.to_vec()),
                    Ok(PageResult::Raw) => Owned::Raw,
                    Ok(PageResult::Rejected) => Owned::Rejected,
                    Err(_) => Owned::Bad,
                });
            }
        })?;
    }
    Ok(out)
}

/// The checked-in corpus slices, `testdata/*.slice.pages.zst` (`$UZRAM_TESTDATA_DIR`, default
/// the repository's `testdata/`, for binaries run away from their build tree).
pub fn slice_paths() -> Vec<PathBuf> {
    let dir = std::env::var_os("UZRAM_TESTDATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata"));
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.to_string_lossy().ends_with(".slice.pages.zst"))
                .collect()
        })
        .unwrap_or_default();
    paths.sort();
    paths
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

/// liblz4's block of one page into `out`, at its default level (`None`) or by
/// `LZ4_compress_HC` at `level`: the block's length, 0 where it did not fit.
pub fn liblz4_compress(page: &[u8], level: Option<i32>, out: &mut [u8]) -> usize {
    let page: &[u8; PAGE_SIZE] = page.try_into().expect("a page");
    let capacity = i32::try_from(out.len()).unwrap_or(i32::MAX);
    // SAFETY: `page` and `out` are live buffers of the lengths passed; liblz4 reads and
    // writes only inside them.
    let n = unsafe {
        match level {
            None => lz4_sys::LZ4_compress_default(
                page.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                PAGE_SIZE as i32,
                capacity,
            ),
            Some(l) => lz4_sys::LZ4_compress_HC(
                page.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                PAGE_SIZE as i32,
                capacity,
                l,
            ),
        }
    };
    usize::try_from(n).unwrap_or(0)
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
    // Records at a fixed stride, each with a random field: most matches lie one stride back,
    // found through the last match's offset rather than the hash table, up to the block's end.
    for (stride, field) in [
        (12usize, 3usize),
        (24, 4),
        (40, 8),
        (56, 5),
        (100, 17),
        (1000, 200),
    ] {
        let record: Vec<u8> = (0..stride).map(|_| rng.gen()).collect();
        let mut p = [0u8; PAGE_SIZE];
        for (i, b) in p.iter_mut().enumerate() {
            *b = record[i % stride];
        }
        for start in (0..PAGE_SIZE).step_by(stride) {
            rng.fill_bytes(&mut p[start..(start + field).min(PAGE_SIZE)]);
        }
        pages.push(p);
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

/// What one check found.
#[derive(Debug, Default, Clone, Copy)]
pub struct Check {
    pub pages: usize,
    /// Pages whose result does not decode to exactly the input (must be 0).
    pub mismatches: usize,
    /// Pages the device's own check rejected (must be 0 for a correct compressor).
    pub rejected: usize,
    pub compressed: usize,
    pub raw: usize,
    pub same_filled: usize,
    /// Bytes stored by the GPU results / uzram's CPU LZ4 (liblz4's parse; raw pages
    /// count whole, same-filled pages nothing).
    pub gpu_bytes: usize,
    pub cpu_bytes: usize,
}

impl Check {
    /// GPU ratio ÷ CPU ratio.
    pub fn ratio_vs_cpu(&self) -> f64 {
        self.cpu_bytes.max(1) as f64 / self.gpu_bytes.max(1) as f64
    }
}

/// Bytes a page costs under zram's rules with uzram's CPU LZ4.
pub fn cpu_bytes(codec: &mut Lz4Codec, page: &[u8; PAGE_SIZE], threshold: usize) -> usize {
    if same_filled_word(page).is_some() {
        return 0;
    }
    let mut out = [0u8; PAGE_SIZE];
    match codec.compress(page, &mut out[..threshold.min(PAGE_SIZE)]) {
        Ok(Some(len)) if len > 0 && len < threshold => len,
        _ => PAGE_SIZE,
    }
}

/// Checks every result decodes on the CPU (lz4_flex and uzram's decoder) to exactly its
/// page, and compares the stored size with uzram's CPU LZ4.
pub fn check(pages: &[u8], threshold: usize, results: &[Owned]) -> Check {
    let mut cpu = Lz4Codec::new();
    let mut c = Check::default();
    let mut buf = [0u8; PAGE_SIZE];
    let mut buf2 = [0u8; PAGE_SIZE];
    assert_eq!(
        results.len(),
        pages.len() / PAGE_SIZE,
        "one result per page"
    );
    for (i, (page, got)) in pages.chunks_exact(PAGE_SIZE).zip(results).enumerate() {
        let page: &[u8; PAGE_SIZE] = page.try_into().unwrap();
        c.pages += 1;
        let ok = match got {
            Owned::Same(w) => {
                c.same_filled += 1;
                same_filled_word(page) == Some(*w)
            }
            Owned::Block(b) => {
                c.compressed += 1;
                b.len() < threshold.min(PAGE_SIZE)
                    && same_filled_word(page).is_none()
                    && matches!(lz4_flex::block::decompress_into(b, &mut buf), Ok(PAGE_SIZE))
                    && buf == *page
                    && cpu.decompress(b, &mut buf2).is_ok()
                    && buf2 == *page
            }
            Owned::Raw => {
                c.raw += 1;
                same_filled_word(page).is_none()
            }
            Owned::Rejected => {
                c.rejected += 1;
                false
            }
            Owned::Bad => false,
        };
        if !ok {
            if c.mismatches < 5 {
                eprintln!(
                    "MISMATCH page {i}: {}",
                    match got {
                        Owned::Block(b) => format!("compressed {} bytes", b.len()),
                        other => format!("{other:?}"),
                    }
                );
            }
            c.mismatches += 1;
        }
        c.gpu_bytes += match got {
            Owned::Block(b) => b.len(),
            Owned::Same(_) => 0,
            _ => PAGE_SIZE,
        };
        c.cpu_bytes += cpu_bytes(&mut cpu, page, threshold);
    }
    c
}

//! Per-core LZ4 comparison: uzram's page codec against liblz4 (C, through lz4-sys) and
//! plain lz4_flex, on the shared page corpora.
//!
//! Every side gets zram's rules, applied the same way (what the store does per page):
//! same-filled pages are detected first and cost no payload; a page whose compressed form
//! would be >= the store's raw threshold (3625 bytes) is stored raw (4096 bytes). Throughput is GB/s of uncompressed
//! bytes (1e9), one thread. The passes of the sides are interleaved and repeated; the table
//! shows medians (and the best run).
//!
//! ```text
//! cargo bench -p uzram-core --bench lz4_vs_liblz4
//! UZRAM_CORPUS=a.pages:b.pages.zst UZRAM_BENCH_REPEAT=21 cargo bench -p uzram-core --bench lz4_vs_liblz4
//! ```
//! A second table puts the store's whole write path beside the bare codec, same run, same
//! pages: `PageStore::write` of every page (same-fill check, compress, arena reserve and copy,
//! table update), overwriting pages already stored as the steady state of a swap device does,
//! against liblz4's compress pass above (same-fill check, compress, append). Thread-CPU
//! seconds per GiB; the target is store ≤ 1.2× liblz4.
//!
//! Corpora: `UZRAM_CORPUS` (':'-separated; raw `.pages` or zstd `.pages.zst`), else
//! `../shared/corpus/*.pages.zst` beside the repository, else the checked-in
//! `testdata/*.slice.pages.zst`.

mod support;

use std::hint::black_box;
use std::os::raw::{c_char, c_int};
use std::time::Duration;

use support::{median, Instant};

use uzram_core::codec::{Algorithm, Lz4Codec, PageCodec};
use uzram_core::page::{fill_page, same_filled_word, PAGE_SIZE};
use uzram_core::store::{PageStore, StoreConfig};

/// zram stores a page raw when its compressed form takes at least this many bytes.
const HUGE_THRESHOLD: usize = uzram_core::store::StoreConfig::DEFAULT_RAW_THRESHOLD;

type Page = [u8; PAGE_SIZE];

/// One LZ4 implementation under test.
trait Side {
    fn name(&self) -> &'static str;
    /// Compressed length, or None when it does not fit in `out`.
    fn compress(&mut self, page: &Page, out: &mut [u8]) -> Option<usize>;
    /// True when `src` decoded to exactly one page.
    fn decompress(&mut self, src: &[u8], page: &mut Page) -> bool;
}

struct Uzram(Lz4Codec);

impl Side for Uzram {
    fn name(&self) -> &'static str {
        "uzram"
    }
    fn compress(&mut self, page: &Page, out: &mut [u8]) -> Option<usize> {
        self.0.compress(page, out).ok().flatten()
    }
    fn decompress(&mut self, src: &[u8], page: &mut Page) -> bool {
        self.0.decompress(src, page).is_ok()
    }
}

struct Liblz4;

impl Side for Liblz4 {
    fn name(&self) -> &'static str {
        "liblz4"
    }
    fn compress(&mut self, page: &Page, out: &mut [u8]) -> Option<usize> {
        // SAFETY: the pointers and lengths describe two live, non-overlapping buffers
        // (`page` of PAGE_SIZE bytes, `out` of out.len() bytes); liblz4 writes at most
        // `out.len()` bytes and returns 0 when the result does not fit.
        let n = unsafe {
            lz4_sys::LZ4_compress_default(
                page.as_ptr().cast::<c_char>(),
                out.as_mut_ptr().cast::<c_char>(),
                PAGE_SIZE as c_int,
                out.len() as c_int,
            )
        };
        (n > 0).then_some(n as usize)
    }
    fn decompress(&mut self, src: &[u8], page: &mut Page) -> bool {
        // SAFETY: `src` and `page` are live, non-overlapping buffers of the lengths
        // passed; LZ4_decompress_safe never reads or writes outside them.
        let n = unsafe {
            lz4_sys::LZ4_decompress_safe(
                src.as_ptr().cast::<c_char>(),
                page.as_mut_ptr().cast::<c_char>(),
                src.len() as c_int,
                PAGE_SIZE as c_int,
            )
        };
        n == PAGE_SIZE as c_int
    }
}

/// Plain lz4_flex (0.14, safe features), as uzram used it before its page codec. Its
/// `compress_into` refuses any output buffer smaller than the worst case, so it compresses
/// into a full-size scratch buffer and the result is kept only if it fits `out`.
struct Lz4Flex(Vec<u8>);

impl Side for Lz4Flex {
    fn name(&self) -> &'static str {
        "lz4_flex"
    }
    fn compress(&mut self, page: &Page, out: &mut [u8]) -> Option<usize> {
        let n = lz4_flex::block::compress_into(page, &mut self.0).ok()?;
        let dst = out.get_mut(..n)?;
        dst.copy_from_slice(&self.0[..n]);
        Some(n)
    }
    fn decompress(&mut self, src: &[u8], page: &mut Page) -> bool {
        matches!(lz4_flex::block::decompress_into(src, page), Ok(PAGE_SIZE))
    }
}

/// What the store keeps for one page.
#[derive(Clone, Copy)]
enum Stored {
    Same(u64),
    Raw(usize),
    Lz4 { off: usize, len: usize },
}

struct Encoded {
    entries: Vec<Stored>,
    data: Vec<u8>,
}

impl Encoded {
    fn payload_bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|e| match e {
                Stored::Same(_) => 0,
                Stored::Raw(_) => PAGE_SIZE,
                Stored::Lz4 { len, .. } => *len,
            })
            .sum()
    }
}

/// Writes every page the way the store does; returns the time taken and what was stored.
fn compress_pass(side: &mut dyn Side, pages: &[Page], enc: &mut Encoded) -> Duration {
    enc.entries.clear();
    enc.data.clear();
    let mut scratch = [0u8; HUGE_THRESHOLD - 1];
    let start = Instant::now();
    for (i, page) in pages.iter().enumerate() {
        let e = if let Some(w) = same_filled_word(page) {
            Stored::Same(w)
        } else if let Some(len) = side.compress(page, &mut scratch) {
            let off = enc.data.len();
            enc.data.extend_from_slice(&scratch[..len]);
            Stored::Lz4 { off, len }
        } else {
            Stored::Raw(i)
        };
        enc.entries.push(e);
    }
    start.elapsed()
}

/// Reads every page back the way the store does. Returns the time and the number of pages
/// that did not come back identical (checked outside the timed loop when `verify`).
fn decompress_pass(
    side: &mut dyn Side,
    pages: &[Page],
    enc: &Encoded,
    verify: bool,
) -> (Duration, usize) {
    let mut out = [0u8; PAGE_SIZE];
    let mut bad = 0;
    let mut elapsed = Duration::ZERO;
    let start = Instant::now();
    for (i, e) in enc.entries.iter().enumerate() {
        let t0 = verify.then(Instant::now);
        match *e {
            Stored::Same(w) => fill_page(&mut out, w),
            Stored::Raw(idx) => out.copy_from_slice(&pages[idx]),
            Stored::Lz4 { off, len } => {
                if !side.decompress(&enc.data[off..off + len], &mut out) {
                    bad += 1;
                }
            }
        }
        black_box(&mut out);
        if let Some(t0) = t0 {
            elapsed += t0.elapsed();
            bad += usize::from(out != pages[i]);
        }
    }
    if !verify {
        elapsed = start.elapsed();
    }
    (elapsed, bad)
}

struct Row {
    corpus: String,
    subset: &'static str,
    pages: usize,
    /// Per side: (compress GB/s runs, decompress GB/s runs, payload bytes)
    sides: Vec<(Vec<f64>, Vec<f64>, usize)>,
}

fn bench_subset(corpus: &str, subset: &'static str, pages: &[Page], repeat: usize) -> Row {
    let mut sides: Vec<Box<dyn Side>> = vec![
        Box::new(Uzram(Lz4Codec::new())),
        Box::new(Liblz4),
        Box::new(Lz4Flex(vec![
            0;
            lz4_flex::block::get_maximum_output_size(
                PAGE_SIZE
            )
        ])),
    ];
    let bytes = (pages.len() * PAGE_SIZE) as f64;
    let mut encs: Vec<Encoded> = sides
        .iter()
        .map(|_| Encoded {
            entries: Vec::with_capacity(pages.len()),
            data: Vec::with_capacity(pages.len() * PAGE_SIZE),
        })
        .collect();
    let mut res: Vec<(Vec<f64>, Vec<f64>, usize)> =
        sides.iter().map(|_| (vec![], vec![], 0)).collect();
    // Warm-up round, with verification (also across sides: each decodes the others' output).
    for (s, side) in sides.iter_mut().enumerate() {
        compress_pass(side.as_mut(), pages, &mut encs[s]);
        res[s].2 = encs[s].payload_bytes();
    }
    for side in sides.iter_mut() {
        for enc in &encs {
            let (_, bad) = decompress_pass(side.as_mut(), pages, enc, true);
            assert_eq!(bad, 0, "{} failed to decode pages of {corpus}", side.name());
        }
    }
    for r in 0..repeat {
        // Rotate the order so no side always runs first after the others.
        for k in 0..sides.len() {
            let s = (k + r) % sides.len();
            let t = compress_pass(sides[s].as_mut(), pages, &mut encs[s]);
            res[s].0.push(bytes / t.as_secs_f64() / 1e9);
            let (t, _) = decompress_pass(sides[s].as_mut(), pages, &encs[s], false);
            res[s].1.push(bytes / t.as_secs_f64() / 1e9);
        }
    }
    Row {
        corpus: corpus.to_string(),
        subset,
        pages: pages.len(),
        sides: res,
    }
}

/// Thread-CPU seconds per GiB: the store's write path and liblz4's compress pass, runs
/// interleaved. Returns (store runs, liblz4 runs).
fn store_vs_codec(pages: &[Page], repeat: usize) -> (Vec<f64>, Vec<f64>) {
    let store = PageStore::new(StoreConfig::new(pages.len() as u64, Algorithm::Lz4))
        .expect("creating the store");
    store.prepare_thread().expect("creating the codec");
    let gib = (pages.len() * PAGE_SIZE) as f64 / (1u64 << 30) as f64;
    let mut enc = Encoded {
        entries: Vec::with_capacity(pages.len()),
        data: Vec::with_capacity(pages.len() * PAGE_SIZE),
    };
    let write_all = |store: &PageStore| {
        let start = Instant::now();
        for (i, page) in pages.iter().enumerate() {
            store.write(i as u64, page).expect("store write");
        }
        start.elapsed()
    };
    // Warm-up: the first fill grows the arena (in the daemon, from pre-faulted pool blocks).
    write_all(&store);
    compress_pass(&mut Liblz4, pages, &mut enc);
    let (mut st, mut lz) = (Vec::new(), Vec::new());
    for r in 0..repeat {
        if r % 2 == 0 {
            st.push(write_all(&store).as_secs_f64() / gib);
            lz.push(compress_pass(&mut Liblz4, pages, &mut enc).as_secs_f64() / gib);
        } else {
            lz.push(compress_pass(&mut Liblz4, pages, &mut enc).as_secs_f64() / gib);
            st.push(write_all(&store).as_secs_f64() / gib);
        }
    }
    // Every page reads back.
    let mut out = [0u8; PAGE_SIZE];
    for (i, page) in pages.iter().enumerate() {
        store.read(i as u64, &mut out).expect("store read");
        assert!(out == *page, "page {i} did not read back");
    }
    (st, lz)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing we need to honour,
    // but then one quick round is enough to prove the bench runs.
    let quick = !std::env::args().any(|a| a == "--bench");
    let repeat = std::env::var("UZRAM_BENCH_REPEAT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 1 } else { 11 });
    println!(
        "LZ4 per core, {} ({} repeats, median GB/s of uncompressed bytes per thread-CPU-second; best in brackets)",
        cpu_model(),
        repeat
    );
    let mut rows = Vec::new();
    let mut store_rows = Vec::new();
    for path in support::corpus_paths() {
        let pages = support::load_pages(&path);
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or("corpus")
            .to_string();
        let same = pages
            .iter()
            .filter(|p| same_filled_word(p).is_some())
            .count();
        println!(
            "{name}: {same} of {} pages same-filled (detection speed: the same_fill bench)",
            pages.len()
        );
        let codec_pages: Vec<Page> = pages
            .iter()
            .filter(|p| same_filled_word(p).is_none())
            .copied()
            .collect();
        rows.push(bench_subset(&name, "all pages", &pages, repeat));
        store_rows.push((name.clone(), store_vs_codec(&pages, repeat)));
        rows.push(bench_subset(&name, "codec pages", &codec_pages, repeat));
    }
    let names = ["uzram", "liblz4", "lz4_flex"];
    println!(
        "{:<12} {:<12} {:>6} {:<10} {:>16} {:>16} {:>16} {:>13} {:>15}",
        "corpus",
        "pages",
        "n",
        "op",
        names[0],
        names[1],
        names[2],
        "uzram/liblz4",
        "lz4_flex/liblz4"
    );
    for row in &mut rows {
        for op in 0..2 {
            let mut cols = Vec::new();
            let mut med = Vec::new();
            for s in row.sides.iter_mut() {
                let v = if op == 0 { &mut s.0 } else { &mut s.1 };
                let m = median(v);
                let best = v.iter().copied().fold(0.0, f64::max);
                med.push(m);
                cols.push(format!("{m:.3} [{best:.3}]"));
            }
            println!(
                "{:<12} {:<12} {:>6} {:<10} {:>16} {:>16} {:>16} {:>12.3}x {:>14.3}x",
                row.corpus,
                row.subset,
                row.pages,
                if op == 0 { "compress" } else { "decompress" },
                cols[0],
                cols[1],
                cols[2],
                med[0] / med[1],
                med[2] / med[1]
            );
        }
    }
    println!("payload-only ratio (input bytes / stored bytes, same-filled = 0, huge = 4096):");
    for row in rows.iter().filter(|r| r.subset == "all pages") {
        let input = (row.pages * PAGE_SIZE) as f64;
        let r: Vec<f64> = row.sides.iter().map(|s| input / s.2 as f64).collect();
        println!(
            "{:<12} uzram {:.4}  liblz4 {:.4}  lz4_flex {:.4}  uzram/liblz4 {:.4}x  (stored bytes {} / {} / {})",
            row.corpus, r[0], r[1], r[2], r[0] / r[1], row.sides[0].2, row.sides[1].2, row.sides[2].2
        );
    }
    println!("store write path against the bare codec (thread-CPU s/GiB, median; target store <= 1.2x liblz4):");
    for (corpus, (mut st, mut lz)) in store_rows {
        let (m_st, m_lz) = (median(&mut st), median(&mut lz));
        println!(
            "{corpus:<12} PageStore::write {m_st:.3}  liblz4 pass {m_lz:.3}  store/liblz4 {:.3}x  (store path {:.3} GB/s per core)",
            m_st / m_lz,
            (1u64 << 30) as f64 / m_st / 1e9
        );
    }
}

//! The page checksum (CRC32C of 4 KiB): the crate's `page_checksum` (its own AVX-512
//! VPCLMULQDQ fold where the CPU has it, `page/crc_copy.rs`) against crc-fast's, in one run,
//! on the same pages: hot (64 pages in cache, as a read checks the page it just decoded) and
//! cold (16384 pages, 64 MiB, as a write checks a page it did not touch yet).
//!
//! ```text
//! cargo bench -p uzram-core --bench page_checksum
//! UZRAM_BENCH_REPEAT=51 cargo bench -p uzram-core --bench page_checksum
//! ```
//!
//! The pages: `UZRAM_CORPUS` (paths, `:`-separated), else `../shared/corpus/*.pages.zst`,
//! else the checked-in slices. Reported: ns a page per thread-CPU-second (median of the
//! interleaved rounds, best in brackets).

mod support;

use std::hint::black_box;

use support::{median, Instant};
use uzram_core::page::{page_checksum, PAGE_SIZE};

type Page = [u8; PAGE_SIZE];

#[derive(Clone, Copy)]
enum Variant {
    Crate,
    CrcFast,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Crate => "page_checksum (crate)",
            Variant::CrcFast => "crc-fast",
        }
    }

    #[inline]
    fn crc(self, page: &Page) -> u32 {
        match self {
            Variant::Crate => page_checksum(page),
            Variant::CrcFast => crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, page) as u32,
        }
    }
}

/// ns a page over `passes` passes of `pages`.
fn time(v: Variant, pages: &[Page], passes: usize) -> f64 {
    let t = Instant::now();
    let mut acc = 0u32;
    for _ in 0..passes {
        for p in pages {
            acc ^= v.crc(black_box(p));
        }
    }
    black_box(acc);
    t.elapsed().as_nanos() as f64 / (passes * pages.len()) as f64
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("page_checksum: bench");
        return;
    }
    let repeat: usize = std::env::var("UZRAM_BENCH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
        .max(1);
    let corpus: Vec<Page> = support::corpus_paths()
        .iter()
        .flat_map(|p| support::load_pages(p))
        .collect();
    assert!(!corpus.is_empty(), "empty corpus");
    let hot: Vec<Page> = corpus.iter().take(64).copied().collect();
    let cold: Vec<Page> = corpus.iter().cycle().take(16384).copied().collect();
    for p in &hot {
        assert_eq!(
            Variant::Crate.crc(p),
            Variant::CrcFast.crc(p),
            "the two disagree"
        );
    }
    let variants = [Variant::Crate, Variant::CrcFast];
    println!(
        "page_checksum: {} rounds; ns a page (thread CPU), median [best]",
        repeat
    );
    for (set, pages, passes) in [("hot", &hot, 2000), ("cold", &cold, 2)] {
        let mut ns = vec![Vec::new(); variants.len()];
        for _ in 0..repeat {
            for (i, &v) in variants.iter().enumerate() {
                ns[i].push(time(v, pages, passes));
            }
        }
        for (v, n) in variants.iter().zip(&mut ns) {
            let mid = median(n);
            println!("{set:<5} {:<22} {:>8.1} [{:>6.1}]", v.name(), mid, n[0]);
        }
    }
}

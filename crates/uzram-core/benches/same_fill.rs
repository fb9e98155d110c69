//! Same-filled page detection: uzram-core's portable loop against AVX2 and AVX-512 versions
//! of the same check, in one run, on the same pages.
//!
//! uzram-core keeps only the portable loop (it has no `unsafe` outside the fast LZ4
//! decoder); the SIMD versions live here, as the challengers it was measured against, so the
//! decision can be re-checked on any CPU:
//!
//! ```text
//! cargo bench -p uzram-core --bench same_fill
//! UZRAM_BENCH_REPEAT=51 cargo bench -p uzram-core --bench same_fill
//! ```
//!
//! Page sets:
//! - the corpora (`UZRAM_CORPUS`, else `../shared/corpus/*.pages.zst`, else the checked-in
//!   `testdata/*.slice.pages.zst`): real swap pages, most of which differ in their first
//!   cache line;
//! - adversarial pages that make every variant read all 4096 bytes: pages filled with one
//!   random word (same-filled), zero pages, and same-filled pages whose last word differs.
//!   Each comes hot (64 pages, 256 KiB, in cache) and cold (16384 pages, 64 MiB).
//!
//! GB/s is bytes checked per thread-CPU-second (the machine is shared), median of the
//! interleaved runs, best in brackets.

mod support;

use std::hint::black_box;

use support::{median, Instant};

use uzram_core::page::{fill_page, same_filled_word, PAGE_SIZE};

type Page = [u8; PAGE_SIZE];

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    /// uzram-core's own check (what the store runs).
    Core,
    Avx2,
    Avx512,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Core => "core (portable)",
            Variant::Avx2 => "avx2",
            Variant::Avx512 => "avx512",
        }
    }

    fn available(self) -> bool {
        match self {
            Variant::Core => true,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Variant::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    #[inline]
    fn check(self, page: &Page) -> Option<u64> {
        match self {
            Variant::Core => same_filled_word(page),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only reached for variants whose `available()` returned true (main
            // filters on it), i.e. std's CPUID detection saw AVX2.
            Variant::Avx2 => unsafe { x86::same_filled_avx2(page) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX-512F.
            Variant::Avx512 => unsafe { x86::same_filled_avx512(page) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("no SIMD variant off x86_64"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The SIMD versions uzram-core had before it became free of `unsafe`.
    use std::arch::x86_64::*;

    use super::{Page, PAGE_SIZE};

    const _: () = assert!(PAGE_SIZE == 4096);

    fn first_word(page: &Page) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&page[..8]);
        u64::from_le_bytes(w)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn same_filled_avx2(page: &Page) -> Option<u64> {
        let first = first_word(page);
        let want = _mm256_set1_epi64x(first as i64);
        let base = page.as_ptr();
        // SAFETY: bytes 0..64 are inside the 4096-byte page.
        let (a, b) = unsafe {
            (
                _mm256_loadu_si256(base.cast()),
                _mm256_loadu_si256(base.add(32).cast()),
            )
        };
        let head = _mm256_or_si256(_mm256_xor_si256(a, want), _mm256_xor_si256(b, want));
        if _mm256_testz_si256(head, head) == 0 {
            return None;
        }
        let mut off = 0;
        while off < PAGE_SIZE {
            // SAFETY: off + 128 <= PAGE_SIZE (off steps by 128 from 0 and PAGE_SIZE is a
            // multiple of 128), so the four 32-byte unaligned loads stay inside `page`.
            let (a, b, c, d) = unsafe {
                (
                    _mm256_loadu_si256(base.add(off).cast()),
                    _mm256_loadu_si256(base.add(off + 32).cast()),
                    _mm256_loadu_si256(base.add(off + 64).cast()),
                    _mm256_loadu_si256(base.add(off + 96).cast()),
                )
            };
            let diff = _mm256_or_si256(
                _mm256_or_si256(_mm256_xor_si256(a, want), _mm256_xor_si256(b, want)),
                _mm256_or_si256(_mm256_xor_si256(c, want), _mm256_xor_si256(d, want)),
            );
            if _mm256_testz_si256(diff, diff) == 0 {
                return None;
            }
            off += 128;
        }
        Some(first)
    }

    /// # Safety
    /// The CPU must support AVX-512F. (Inline assembly: AVX-512 intrinsics need Rust 1.89,
    /// newer than the workspace's minimum.)
    pub(super) unsafe fn same_filled_avx512(page: &Page) -> Option<u64> {
        let first = first_word(page);
        let differs: u8;
        // SAFETY: the caller guarantees AVX-512F. The code reads [base, base + 4096) in
        // 64-byte loads, all inside `page`, writes no memory, declares every vector register
        // it touches clobbered, and ends with `vzeroupper`.
        unsafe {
            std::arch::asm!(
                "vpbroadcastq zmm0, {first}",
                "vpxorq zmm1, zmm0, zmmword ptr [{base}]",
                "vextracti64x4 ymm2, zmm1, 1",
                "vpor ymm1, ymm1, ymm2",
                "vptest ymm1, ymm1",
                "jnz 3f",
                "xor {i:e}, {i:e}",
                "2:",
                "vpxorq zmm1, zmm0, zmmword ptr [{base} + {i}]",
                "vpxorq zmm2, zmm0, zmmword ptr [{base} + {i} + 64]",
                "vpxorq zmm3, zmm0, zmmword ptr [{base} + {i} + 128]",
                "vpxorq zmm4, zmm0, zmmword ptr [{base} + {i} + 192]",
                "vporq zmm1, zmm1, zmm2",
                "vporq zmm3, zmm3, zmm4",
                "vporq zmm1, zmm1, zmm3",
                "vextracti64x4 ymm2, zmm1, 1",
                "vpor ymm1, ymm1, ymm2",
                "vptest ymm1, ymm1",
                "jnz 3f",
                "add {i}, 256",
                "cmp {i}, 4096",
                "jb 2b",
                "3:",
                "setnz {differs}",
                "vzeroupper",
                first = in(reg) first,
                base = in(reg) page.as_ptr(),
                i = out(reg) _,
                differs = out(reg_byte) differs,
                out("xmm0") _,
                out("xmm1") _,
                out("xmm2") _,
                out("xmm3") _,
                out("xmm4") _,
                options(nostack, readonly),
            );
        }
        (differs == 0).then_some(first)
    }
}

/// A small xorshift generator: the adversarial pages need no more.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn filled_pages(n: usize, rng: &mut Rng, word: impl Fn(&mut Rng) -> u64) -> Vec<Page> {
    (0..n)
        .map(|_| {
            let mut p = [0u8; PAGE_SIZE];
            fill_page(&mut p, word(rng));
            p
        })
        .collect()
}

fn last_word_differs(mut pages: Vec<Page>) -> Vec<Page> {
    for p in &mut pages {
        p[PAGE_SIZE - 1] ^= 0x5a;
    }
    pages
}

/// One pass of `v` over `pages`, repeated until at least 64 MiB were checked (so hot sets
/// are timed over more than a few microseconds); returns GB/s per thread-CPU-second.
fn pass(v: Variant, pages: &[Page]) -> f64 {
    let rounds = (16384 / pages.len()).max(1);
    let t = Instant::now();
    let mut same = 0usize;
    for _ in 0..rounds {
        for p in pages {
            same += usize::from(v.check(black_box(p)).is_some());
        }
    }
    black_box(same);
    (rounds * pages.len() * PAGE_SIZE) as f64 / t.elapsed().as_secs_f64() / 1e9
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
    // `cargo test --benches` runs this without --bench: one quick round proves it works.
    let quick = !std::env::args().any(|a| a == "--bench");
    let repeat: usize = std::env::var("UZRAM_BENCH_REPEAT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 1 } else { 21 });
    let variants: Vec<Variant> = [Variant::Core, Variant::Avx2, Variant::Avx512]
        .into_iter()
        .filter(|v| v.available())
        .collect();
    let missing: Vec<&str> = [Variant::Avx2, Variant::Avx512]
        .into_iter()
        .filter(|v| !v.available())
        .map(|v| v.name())
        .collect();
    println!(
        "same-filled detection, {} ({repeat} interleaved runs, median GB/s per thread-CPU-second, best in brackets){}",
        cpu_model(),
        if missing.is_empty() {
            String::new()
        } else {
            format!("; not run, CPU lacks: {}", missing.join(", "))
        }
    );

    let mut sets: Vec<(String, Vec<Page>)> = Vec::new();
    for path in support::corpus_paths() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or("corpus")
            .to_string();
        sets.push((name, support::load_pages(&path)));
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (label, n) in [("hot, 256 KiB", 64), ("cold, 64 MiB", 16384)] {
        sets.push((
            format!("all same word ({label})"),
            filled_pages(n, &mut rng, |r| r.next() | 1),
        ));
        sets.push((format!("zero ({label})"), filled_pages(n, &mut rng, |_| 0)));
        sets.push((
            format!("last word differs ({label})"),
            last_word_differs(filled_pages(n, &mut rng, |r| r.next())),
        ));
    }

    print!("{:<34} {:>7} {:>6}", "pages", "n", "same");
    for v in &variants {
        print!(" {:>20}", v.name());
    }
    println!(" {:>12}", "core/best");
    for (name, pages) in &sets {
        // Every variant must agree with the core loop before its speed means anything.
        for v in &variants {
            for p in pages {
                assert_eq!(v.check(p), same_filled_word(p), "{} on {name}", v.name());
            }
        }
        let mut runs: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for r in 0..repeat {
            for k in 0..variants.len() {
                let i = (k + r) % variants.len();
                runs[i].push(pass(variants[i], pages));
            }
        }
        let same = pages
            .iter()
            .filter(|p| same_filled_word(p).is_some())
            .count();
        print!("{name:<34} {:>7} {same:>6}", pages.len());
        let mut medians = Vec::new();
        for r in &mut runs {
            let best = r.iter().copied().fold(0.0, f64::max);
            let m = median(r);
            medians.push(m);
            print!(" {:>20}", format!("{m:.1} [{best:.1}]"));
        }
        let best_simd = medians[1..].iter().copied().fold(0.0, f64::max);
        if best_simd > 0.0 {
            println!(" {:>11.2}×", medians[0] / best_simd);
        } else {
            println!(" {:>12}", "-");
        }
    }
}

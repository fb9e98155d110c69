//! The GPU ring's queue-thread copy: written pages into staging, as `Ring::write` does it
//! (a same-fill check over each 64 KiB request's pages, then a copy of the others into
//! staging with one store fence per run), with the crate's copy against challengers, in one
//! run, on the same pages, from several threads at once (the ring's writers share the
//! memory bus with each other and with the device's reads).
//!
//! ```text
//! cargo bench -p uzram-core --bench stage_copy
//! UZRAM_BENCH_THREADS=4 UZRAM_BENCH_MIB=1024 UZRAM_BENCH_REPEAT=5 cargo bench -p uzram-core --bench stage_copy
//! ```
//!
//! The pages: `UZRAM_CORPUS` (paths, `:`-separated), else `../shared/corpus/*.pages.zst`,
//! else the checked-in slices. Each thread copies its own quarter of the source (corpus pages tiled to
//! `UZRAM_BENCH_MIB`, default 1024: cold, as a swapped-out page is) into its own part of a
//! 128 MiB staging region, round after round. Variants:
//! - `words`: relaxed 8-byte stores (`page_to_words`, without the `unsafe-stream` feature);
//! - `stream, no next`: the crate's copy (`page_to_words_streaming`: SSE2 non-temporal
//!   stores) told of no next page, as it was before it prefetched;
//! - `stream (crate)`: the same, prefetching the request's next page while it copies, as
//!   the ring calls it;
//! - `avx2+pf`: 32-byte non-temporal stores, prefetching as above;
//! - `crc, then stream`: the page's CRC32C (`page_checksum`), then `stream (crate)`: what
//!   the ring did with checksums on before the two were fused;
//! - `crc+stream (crate)`: `page_to_words_streaming_checksummed`, the ring's copy with
//!   checksums on (one pass: AVX-512 loads folded into the CRC as they are stored).
//!
//! Reported: GB/s per thread-CPU-second (median of the rounds, best in brackets), which is
//! what a queue thread's CPU per GiB is the inverse of; and the wall GB/s of all threads.

mod support;

use std::hint::black_box;
use std::sync::atomic::AtomicU64;
use std::sync::Barrier;
use std::time::Duration;

use support::median;
use uzram_core::page::{
    page_checksum, page_to_words, page_to_words_streaming, page_to_words_streaming_checksummed,
    same_filled_word, stream_fence, PAGE_SIZE, PAGE_WORDS,
};

const REQUEST_PAGES: usize = 16;
const STAGING_BYTES: usize = 128 << 20;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Variant {
    Words,
    StreamAlone,
    Stream,
    Avx2Prefetch,
    CrcThenStream,
    CrcStream,
}

impl Variant {
    const ALL: [Variant; 6] = [
        Variant::Words,
        Variant::StreamAlone,
        Variant::Stream,
        Variant::Avx2Prefetch,
        Variant::CrcThenStream,
        Variant::CrcStream,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Words => "words",
            Variant::StreamAlone => "stream, no next",
            Variant::Stream => "stream (crate)",
            Variant::Avx2Prefetch => "avx2+pf",
            Variant::CrcThenStream => "crc, then stream",
            Variant::CrcStream => "crc+stream (crate)",
        }
    }

    fn available(self) -> bool {
        match self {
            Variant::Words
            | Variant::StreamAlone
            | Variant::Stream
            | Variant::CrcThenStream
            | Variant::CrcStream => true,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx2Prefetch => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Copies `page` into `words`; `next` is the request's next page, if any.
    #[inline]
    fn copy(self, page: &[u8; PAGE_SIZE], next: Option<&[u8]>, words: &[AtomicU64]) {
        match self {
            Variant::Words => page_to_words(page, words),
            Variant::StreamAlone => page_to_words_streaming(page, None, words),
            Variant::Stream => {
                page_to_words_streaming(page, next.and_then(|n| n.try_into().ok()), words)
            }
            Variant::CrcThenStream => {
                black_box(page_checksum(page));
                page_to_words_streaming(page, next.and_then(|n| n.try_into().ok()), words)
            }
            Variant::CrcStream => {
                black_box(page_to_words_streaming_checksummed(
                    page,
                    next.and_then(|n| n.try_into().ok()),
                    words,
                ));
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `words` is PAGE_WORDS long and 64-byte aligned (staging is carved in
            // whole pages from a page-aligned allocation), no other thread touches it, and
            // main runs this variant only where AVX2 was detected.
            Variant::Avx2Prefetch => unsafe { x86::avx2_prefetch(page, next, words) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("no x86 variant off x86_64"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_prefetch, _MM_HINT_T0,
    };
    use std::sync::atomic::AtomicU64;

    use super::PAGE_SIZE;

    #[inline]
    fn prefetch_line(next: Option<&[u8]>, at: usize) {
        if let Some(n) = next {
            if at < n.len() {
                // SAFETY: `at` is inside `n`; a prefetch never faults and writes nothing.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(n.as_ptr().add(at).cast()) };
            }
        }
    }

    /// # Safety
    /// `words` must be at least PAGE_SIZE / 8 long, 32-byte aligned, and touched by no
    /// other thread while this runs; the CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2_prefetch(
        page: &[u8; PAGE_SIZE],
        next: Option<&[u8]>,
        words: &[AtomicU64],
    ) {
        let dst = words.as_ptr().cast::<__m256i>().cast_mut();
        let src = page.as_ptr().cast::<__m256i>();
        for line in 0..PAGE_SIZE / 64 {
            prefetch_line(next, line * 64);
            for k in 0..2 {
                let i = line * 2 + k;
                // SAFETY: i < PAGE_SIZE / 32: inside both; dst aligned (caller).
                unsafe { _mm256_stream_si256(dst.add(i), _mm256_loadu_si256(src.add(i))) };
            }
        }
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One thread's pass over `src` (whole requests) into `staging`; returns thread CPU time.
fn pass(v: Variant, src: &[u8], staging: &[AtomicU64]) -> Duration {
    let slots = staging.len() / PAGE_WORDS;
    let mut at = 0;
    let t = support::Instant::now();
    let mut same = 0usize;
    for req in src.chunks_exact(REQUEST_PAGES * PAGE_SIZE) {
        let mut run = [0usize; REQUEST_PAGES];
        let mut n = 0;
        for (i, p) in req.chunks_exact(PAGE_SIZE).enumerate() {
            let p: &[u8; PAGE_SIZE] = p.try_into().expect("whole page");
            if same_filled_word(p).is_some() {
                same += 1;
            } else {
                run[n] = i;
                n += 1;
            }
        }
        for j in 0..n {
            let off = run[j] * PAGE_SIZE;
            let page: &[u8; PAGE_SIZE] = req[off..off + PAGE_SIZE].try_into().expect("page");
            let next = (j + 1 < n).then(|| &req[run[j + 1] * PAGE_SIZE..][..PAGE_SIZE]);
            v.copy(page, next, &staging[at * PAGE_WORDS..(at + 1) * PAGE_WORDS]);
            at = (at + 1) % slots;
        }
        stream_fence();
    }
    black_box(same);
    t.elapsed()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("stage_copy: bench");
        return;
    }
    let threads = env_usize("UZRAM_BENCH_THREADS", 4).max(1);
    let total = env_usize("UZRAM_BENCH_MIB", 1024) << 20;
    let repeat = env_usize("UZRAM_BENCH_REPEAT", 5).max(1);
    let corpus: Vec<u8> = support::corpus_paths()
        .iter()
        .flat_map(|p| support::read_corpus(p))
        .collect();
    assert!(corpus.len() >= PAGE_SIZE, "empty corpus");
    let per_thread = total / threads / (REQUEST_PAGES * PAGE_SIZE) * (REQUEST_PAGES * PAGE_SIZE);
    let src: Vec<u8> = corpus
        .iter()
        .copied()
        .cycle()
        .take(per_thread * threads)
        .collect();
    // Page-aligned staging, as the ring's (a Vec of 512-word pages is 8-aligned only).
    let words = STAGING_BYTES / 8;
    let backing: Vec<AtomicU64> = (0..words + 512).map(|_| AtomicU64::new(0)).collect();
    let skip = backing.as_ptr().align_offset(4096).min(512);
    let staging = &backing[skip..skip + words];
    let part = words / threads / PAGE_WORDS * PAGE_WORDS;
    let variants: Vec<Variant> = Variant::ALL.into_iter().filter(|v| v.available()).collect();
    println!(
        "stage_copy: {threads} threads, {} MiB of corpus pages, {} rounds, 64 KiB requests",
        (per_thread * threads) >> 20,
        repeat
    );
    let mut per_cpu: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for _ in 0..repeat {
        for (vi, &v) in variants.iter().enumerate() {
            let barrier = Barrier::new(threads);
            let start = std::time::Instant::now();
            let cpu: Vec<Duration> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        let src = &src[t * per_thread..(t + 1) * per_thread];
                        let stg = &staging[t * part..(t + 1) * part];
                        let barrier = &barrier;
                        s.spawn(move || {
                            barrier.wait();
                            pass(v, src, stg)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("thread"))
                    .collect()
            });
            let secs = start.elapsed().as_secs_f64();
            let cpu_secs: f64 = cpu.iter().map(Duration::as_secs_f64).sum();
            per_cpu[vi].push((per_thread * threads) as f64 / cpu_secs / 1e9);
            wall[vi].push((per_thread * threads) as f64 / secs / 1e9);
        }
    }
    println!(
        "{:<16} {:>22} {:>14}",
        "variant", "GB/s per CPU-s [best]", "wall GB/s"
    );
    for ((v, c), w) in variants.iter().zip(&mut per_cpu).zip(&mut wall) {
        let (mid, wall_mid) = (median(c), median(w));
        println!(
            "{:<16} {:>14.2} [{:>5.2}] {:>14.2}",
            v.name(),
            mid,
            c[c.len() - 1],
            wall_mid
        );
    }
}

//! How long the tier thread's work stops the writers when the thread that runs it has the
//! lowest priority and the CPUs are busy. The daemon's tier thread runs at nice 19;
//! `PageStore::compact` holds every shard's lock while it moves the live objects, and a
//! recompression pass holds a shard's lock (and the arena's) around each page's look-up and
//! install, and the dictionary recompressor's one-time sampling holds a shard's lock around
//! each page's look-up and each copy of a batch of objects, so a writer at the queue
//! threads' nice -20 can wait on a thread the scheduler seldom runs (priority inversion).
//! Side by side, in one run, per work: the worker at nice 19 throughout (`nice19`), raised
//! to the writer's nice for the whole work (`boosted`), and, for recompression and
//! sampling, at nice 19 with the store raising it only while it holds the locks
//! (`sections`, `Recompress::priority` and `dictionary_samples`' priority, what the daemon
//! does).
//!
//! ```text
//! cargo bench -p uzram-core --bench tier_pause      # as root (nice -20 needs it)
//! UZRAM_BENCH_MIB=512 UZRAM_BENCH_REPEAT=7 UZRAM_BENCH_RECOMPRESS_PAGES=4096 cargo bench -p uzram-core --bench tier_pause
//! UZRAM_BENCH_WORK=sample cargo bench -p uzram-core --bench tier_pause   # one work only
//! ```
//!
//! Each round: a store of the corpus pages (tiled to `UZRAM_BENCH_MIB`, default 256), every
//! other page discarded (holes for compaction to close), one CPU hog per CPU at nice 0, and
//! a writer at nice -20 rewriting one page every 200 µs, timed per write; then the worker
//! compacts the store, recompresses (zstd level 3) the first
//! `UZRAM_BENCH_RECOMPRESS_PAGES` (default 2,048) of its pages, or samples 4,096 of its
//! pages for a dictionary, as the daemon's `lz4-dict` recompressor does once (all three,
//! or those `UZRAM_BENCH_WORK` names: `compact`, `recompress`, `sample`). Reported per work and
//! variant: the work's wall time and its CPU time, the writer's longest write during it, and
//! how many of its writes took over a millisecond (medians of the rounds, the rounds' range
//! in brackets), and in how many rounds one did.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{corpus_paths, env_usize, median, read_corpus, tiled};
use uzram_core::codec::Algorithm;
use uzram_core::page::PAGE_SIZE;
use uzram_core::store::{Candidates, PageStore, Priority, Recompress, Recompressor, StoreConfig};

const WRITER_NICE: i32 = -20;
const TIER_NICE: i32 = 19;

fn set_nice(nice: i32) {
    // SAFETY: setpriority on this thread's own id; no memory is passed.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    assert_eq!(
        rc,
        0,
        "setpriority({nice}): {}",
        std::io::Error::last_os_error()
    );
}

/// The bench's stand-in for the daemon's `sys::IoPriority`: between the tier's nice and
/// the writer's.
#[derive(Debug)]
struct Raise;

impl Priority for Raise {
    fn raise(&self) {
        set_nice(WRITER_NICE);
    }

    fn lower(&self) {
        set_nice(TIER_NICE);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    Compact,
    Recompress { pages: u64 },
    Sample { pages: usize },
}

impl Work {
    /// The name `UZRAM_BENCH_WORK` selects it by.
    fn name(self) -> &'static str {
        match self {
            Work::Compact => "compact",
            Work::Recompress { .. } => "recompress",
            Work::Sample { .. } => "sample",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Nice19,
    Boosted,
    Sections,
}

/// What one round measured.
struct Round {
    work: Duration,
    /// The worker's CPU time: what raising and lowering add.
    cpu: Duration,
    longest: Duration,
    over_1ms: usize,
}

/// Runs `work` as `variant` does; asserts it did something.
fn run(store: &PageStore, work: Work, variant: Variant) {
    match work {
        Work::Compact => assert!(store.compact() > 0, "nothing to compact"),
        Work::Recompress { pages } => {
            let priority: Option<&dyn Priority> = (variant == Variant::Sections).then_some(&Raise);
            let done = store
                .recompress(Recompress {
                    candidates: Candidates::Idle { min_age: 0 },
                    recompressor: Recompressor::Zstd { level: 3 },
                    threshold: 0,
                    max_pages: pages,
                    retry_tried: true,
                    priority,
                })
                .unwrap();
            assert!(done.tried > 0, "nothing to recompress");
        }
        Work::Sample { pages } => {
            let priority: Option<&dyn Priority> = (variant == Variant::Sections).then_some(&Raise);
            let samples = store
                .dictionary_samples(Candidates::Idle { min_age: 0 }, 0, pages, priority)
                .unwrap();
            assert_eq!(samples.len(), pages * PAGE_SIZE, "too few pages sampled");
        }
    }
}

fn round(data: &[u8], work: Work, variant: Variant) -> Round {
    let pages = (data.len() / PAGE_SIZE) as u64;
    let store = Arc::new(PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap());
    store.write(0, data).unwrap();
    for p in (0..pages).step_by(2) {
        store.discard(p, 1).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let hogs: Vec<_> = (0..cpus)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    std::hint::black_box(x);
                }
            })
        })
        .collect();
    let working = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop, working) = (store.clone(), stop.clone(), working.clone());
        let page = data[PAGE_SIZE..2 * PAGE_SIZE].to_vec();
        std::thread::spawn(move || {
            set_nice(WRITER_NICE);
            let mut during = Vec::new();
            let mut p = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let was = working.load(Ordering::Acquire);
                let t = Instant::now();
                store.write(p, &page).unwrap();
                let took = t.elapsed();
                if was || working.load(Ordering::Acquire) {
                    during.push(took);
                }
                p = (p + 2) % pages;
                std::thread::sleep(Duration::from_micros(200));
            }
            during
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let worker = {
        let (store, working) = (store.clone(), working.clone());
        std::thread::spawn(move || {
            set_nice(TIER_NICE);
            if variant == Variant::Boosted {
                set_nice(WRITER_NICE);
            }
            working.store(true, Ordering::Release);
            let (t, cpu) = (Instant::now(), support::Instant::now());
            run(&store, work, variant);
            let took = (t.elapsed(), cpu.elapsed());
            working.store(false, Ordering::Release);
            took
        })
    };
    let (took, cpu) = worker.join().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    let during = writer.join().unwrap();
    for h in hogs {
        h.join().unwrap();
    }
    Round {
        work: took,
        cpu,
        longest: during.iter().copied().max().unwrap_or_default(),
        over_1ms: during
            .iter()
            .filter(|d| **d > Duration::from_millis(1))
            .count(),
    }
}

fn main() {
    let mib = env_usize("UZRAM_BENCH_MIB", 256);
    let repeat = env_usize("UZRAM_BENCH_REPEAT", 5);
    let recompress_pages = env_usize("UZRAM_BENCH_RECOMPRESS_PAGES", 2048) as u64;
    let path = &corpus_paths()[0];
    let pages = read_corpus(path);
    let data = tiled(&pages, mib << 20);
    println!(
        "{} MiB of {}, {} CPU hogs at nice 0, writer at nice {WRITER_NICE}",
        mib,
        path.display(),
        std::thread::available_parallelism().map_or(2, |n| n.get())
    );
    println!(
        "work | variant | work ms | its CPU ms | longest write during it, ms | writes over 1 ms \
         | rounds with one"
    );
    let recompress = Work::Recompress {
        pages: recompress_pages,
    };
    // As many as the daemon's `lz4-dict` recompressor samples (`daemon/dictionary.rs`).
    let sample = Work::Sample { pages: 4096 };
    let works = std::env::var("UZRAM_BENCH_WORK").unwrap_or_default();
    let mut results: Vec<(Work, Variant, Vec<[f64; 4]>)> = [
        (Work::Compact, Variant::Nice19),
        (Work::Compact, Variant::Boosted),
        (recompress, Variant::Nice19),
        (recompress, Variant::Boosted),
        (recompress, Variant::Sections),
        (sample, Variant::Nice19),
        (sample, Variant::Boosted),
        (sample, Variant::Sections),
    ]
    .into_iter()
    .filter(|(w, _)| works.is_empty() || works.split(',').any(|n| n == w.name()))
    .map(|(w, v)| (w, v, Vec::new()))
    .collect();
    assert!(
        !results.is_empty(),
        "UZRAM_BENCH_WORK names no work: compact, recompress, sample"
    );
    for _ in 0..repeat {
        for (work, variant, rounds) in results.iter_mut() {
            let r = round(&data, *work, *variant);
            rounds.push([
                r.work.as_secs_f64() * 1e3,
                r.cpu.as_secs_f64() * 1e3,
                r.longest.as_secs_f64() * 1e3,
                r.over_1ms as f64,
            ]);
        }
    }
    for (work, variant, rounds) in results {
        let cell = |i: usize| {
            let mut v: Vec<f64> = rounds.iter().map(|r| r[i]).collect();
            let (lo, hi) = (
                v.iter().copied().fold(f64::MAX, f64::min),
                v.iter().copied().fold(0.0, f64::max),
            );
            format!("{:.1} [{lo:.1}, {hi:.1}]", median(&mut v))
        };
        let stalled = rounds.iter().filter(|r| r[3] > 0.0).count();
        println!(
            "{work:?} | {variant:?} | {} | {} | {} | {} | {stalled} of {}",
            cell(0),
            cell(1),
            cell(2),
            cell(3),
            rounds.len()
        );
    }
}

//! How long a compaction stops the writers when the thread that runs it has the lowest
//! priority and the CPUs are busy: the daemon's tier thread runs at nice 19, and
//! `PageStore::compact` holds every shard's lock while it moves the live objects, so a
//! writer at the queue threads' nice -20 waits on a thread the scheduler seldom runs
//! (priority inversion). Side by side, in one run: the compactor at nice 19 for the whole
//! compaction (`nice19`), and raised to the writer's nice for it (`boosted`).
//!
//! ```text
//! cargo bench -p uzram-core --bench compaction_pause      # as root (nice -20 needs it)
//! UZRAM_BENCH_MIB=512 UZRAM_BENCH_REPEAT=7 cargo bench -p uzram-core --bench compaction_pause
//! ```
//!
//! Each round: a store of the corpus pages (tiled to `UZRAM_BENCH_MIB`, default 256), every
//! other page discarded (holes for compaction to close), one CPU hog per CPU at nice 0, and
//! a writer at nice -20 rewriting one page at a time, timed per write; then the compactor
//! compacts. Reported per variant: the compaction's wall time and the writer's longest write
//! during it (medians of the rounds, the rounds' range in brackets).

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{corpus_paths, env_usize, median, read_corpus, tiled};
use uzram_core::codec::Algorithm;
use uzram_core::page::PAGE_SIZE;
use uzram_core::store::{PageStore, StoreConfig};

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

/// One round: (compaction wall time, longest write while it ran).
fn round(data: &[u8], boosted: bool) -> (Duration, Duration) {
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
    let compacting = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop, compacting) = (store.clone(), stop.clone(), compacting.clone());
        let page = data[PAGE_SIZE..2 * PAGE_SIZE].to_vec();
        std::thread::spawn(move || {
            set_nice(WRITER_NICE);
            let mut longest = Duration::ZERO;
            let mut p = 1u64;
            while !stop.load(Ordering::Relaxed) {
                let during = compacting.load(Ordering::Acquire);
                let t = Instant::now();
                store.write(p, &page).unwrap();
                let took = t.elapsed();
                if during || compacting.load(Ordering::Acquire) {
                    longest = longest.max(took);
                }
                p = (p + 2) % pages;
                std::thread::sleep(Duration::from_micros(200));
            }
            longest
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let compactor = {
        let (store, compacting) = (store.clone(), compacting.clone());
        std::thread::spawn(move || {
            set_nice(TIER_NICE);
            if boosted {
                set_nice(WRITER_NICE);
            }
            compacting.store(true, Ordering::Release);
            let t = Instant::now();
            let moved = store.compact();
            let took = t.elapsed();
            compacting.store(false, Ordering::Release);
            if boosted {
                set_nice(TIER_NICE);
            }
            assert!(moved > 0, "nothing to compact");
            took
        })
    };
    let took = compactor.join().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    let longest = writer.join().unwrap();
    for h in hogs {
        h.join().unwrap();
    }
    (took, longest)
}

fn main() {
    let mib = env_usize("UZRAM_BENCH_MIB", 256);
    let repeat = env_usize("UZRAM_BENCH_REPEAT", 5);
    let path = &corpus_paths()[0];
    let pages = read_corpus(path);
    let data = tiled(&pages, mib << 20);
    println!(
        "{} MiB of {}, {} CPU hogs at nice 0, writer at nice {WRITER_NICE}",
        mib,
        path.display(),
        std::thread::available_parallelism().map_or(2, |n| n.get())
    );
    println!("variant | compaction ms (median [min, max]) | longest write during it, ms");
    let mut results: Vec<(&str, Vec<f64>, Vec<f64>)> =
        vec![("nice19", vec![], vec![]), ("boosted", vec![], vec![])];
    for _ in 0..repeat {
        for (name, took, longest) in results.iter_mut() {
            let (t, l) = round(&data, *name == "boosted");
            took.push(t.as_secs_f64() * 1e3);
            longest.push(l.as_secs_f64() * 1e3);
        }
    }
    for (name, mut took, mut longest) in results {
        let range = |v: &[f64]| {
            (
                v.iter().copied().fold(f64::MAX, f64::min),
                v.iter().copied().fold(0.0, f64::max),
            )
        };
        let (tl, th) = range(&took);
        let (ll, lh) = range(&longest);
        println!(
            "{name} | {:.1} [{tl:.1}, {th:.1}] | {:.1} [{ll:.1}, {lh:.1}]",
            median(&mut took),
            median(&mut longest)
        );
    }
}

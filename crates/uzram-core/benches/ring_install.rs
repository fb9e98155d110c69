//! The GPU ring's CPU work without the GPU: what putting a slot's results into the store
//! costs the installers, and what staging pages costs the writer, per GiB of real pages. A
//! [`HostSlots`] backend compresses each slot on the ring's submitter thread at `submit`, so
//! the installer threads (`uzram-install-*`) do only what they do behind a GPU (check each
//! result's checksum, plan the slot, copy each block into the arena, commit it to the table)
//! and the writer only what a queue thread does (scan for fills, copy into the slot, mark the
//! entries pending, keep what a rewritten page replaces).
//!
//! ```text
//! cargo bench -p uzram-core --bench ring_install
//! UZRAM_CORPUS=a.pages.zst:b.pages.zst UZRAM_BENCH_REPEAT=7 cargo bench -p uzram-core --bench ring_install
//! ```
//!
//! Each round writes the corpus (tiled to `UZRAM_BENCH_MIB`, default 256) through a fresh
//! ring of 7 slots of 2,048 pages (the GPU's default shape) in 64 KiB requests from one
//! writer, twice (the stats count both), and reads the installer threads' CPU during the second
//! pass from `/proc/self/task/*/schedstat`, the writer's from its thread clock in both.
//! Reported per corpus: the installers' CPU-s per GiB written on the second pass, the writer's
//! on the first pass (into an empty store) and on the second (every page replacing one), each
//! the median of the rounds with the rounds' spread in brackets, and the share of pages the
//! writers stored as fills.

mod support;

use std::sync::Arc;

use support::{corpus_paths, env_usize, median, read_corpus, tiled, Instant};
use uzram_core::batch::{HostSlots, Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::page::PAGE_SIZE;
use uzram_core::store::{PageStore, StoreConfig};

const REQUEST: usize = 16 * PAGE_SIZE;

/// Nanoseconds on a CPU of this process's threads whose name starts with `prefix`.
fn cpu_ns(prefix: &str) -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix))
        })
        .filter_map(|t| {
            let s = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            s.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

/// One round's CPU-s per GiB written: the installers' on the rewrite, the writer's on the
/// first write and on the rewrite.
struct Round {
    installers: f64,
    writer_first: f64,
    writer_rewrite: f64,
    same_filled: u64,
}

fn round(data: &[u8]) -> Round {
    let pages = (data.len() / PAGE_SIZE) as u64;
    let store = Arc::new(PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap());
    let backend = Arc::new(HostSlots::new(Algorithm::Lz4, 7, 2048));
    // The writer waits for a slot rather than compress inline: every page goes through the
    // installers, as behind a GPU that keeps up.
    let cfg = RingConfig {
        slot_wait: std::time::Duration::from_secs(30),
        ..RingConfig::default()
    };
    let ring = Ring::start(store.clone(), backend, cfg).unwrap();
    // The first pass faults the store's memory in (the daemon's pool keeper does that
    // ahead of the installers); the second overwrites every page and is the one measured.
    // The writer's clock stops before the flush, which only waits for the installers.
    let pass = || {
        let start = Instant::now();
        for (i, req) in data.chunks(REQUEST).enumerate() {
            ring.write((i * 16) as u64, req).unwrap();
        }
        let writer = start.elapsed();
        ring.flush();
        writer
    };
    let gib = data.len() as f64 / (1u64 << 30) as f64;
    let writer_first = pass().as_secs_f64() / gib;
    let before = cpu_ns("uzram-install");
    let writer_rewrite = pass().as_secs_f64() / gib;
    let ns = cpu_ns("uzram-install") - before;
    let same_filled = ring.stats().same_filled_pages;
    drop(ring);
    Round {
        installers: ns as f64 / 1e9 / gib,
        writer_first,
        writer_rewrite,
        same_filled,
    }
}

/// `median [min, max]` of `runs`, to 4 places.
fn spread(runs: &mut [f64]) -> String {
    let m = median(runs);
    format!("{m:.4} [{:.4}, {:.4}]", runs[0], runs[runs.len() - 1])
}

fn main() {
    let mib = env_usize("UZRAM_BENCH_MIB", 256);
    let repeat = env_usize("UZRAM_BENCH_REPEAT", 5);
    println!(
        "corpus | CPU-s/GiB (median [min, max]): installers, rewrite | writer, first write | \
         writer, rewrite | same-filled share"
    );
    for path in corpus_paths() {
        let pages = read_corpus(&path);
        let data = tiled(&pages, mib << 20);
        let (mut installers, mut first, mut rewrite) = (Vec::new(), Vec::new(), Vec::new());
        let mut same = 0;
        for _ in 0..repeat {
            let r = round(&data);
            installers.push(r.installers);
            first.push(r.writer_first);
            rewrite.push(r.writer_rewrite);
            same = r.same_filled;
        }
        println!(
            "{} | {} | {} | {} | {:.3}",
            path.file_name().unwrap_or_default().to_string_lossy(),
            spread(&mut installers),
            spread(&mut first),
            spread(&mut rewrite),
            same as f64 / (2 * data.len() / PAGE_SIZE) as f64
        );
    }
}

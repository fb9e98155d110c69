//! Concurrent stress: writers (inline, and through a ring of staging slots whose results
//! come back late), readers and discarders hammer overlapping pages. Every page read must be a whole page that some thread really wrote
//! to that index (pages carry an index/writer/version stamp and stamp-derived contents),
//! or zeros. A compactor moves everything around meanwhile. Runs about a second.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{read_stamp, stamped_page, Rng};
use uzram_core::batch::{FaultPlan, HostSlots, Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::{PageStore, StoreConfig, PAGE_SIZE};

const PAGES: u64 = 96;
const RUN: Duration = Duration::from_millis(1200);

/// Checks one page read back from `index`.
fn check(index: u64, page: &[u8; PAGE_SIZE], bad: &AtomicU64) {
    if page.iter().all(|b| *b == 0) {
        return;
    }
    match read_stamp(page) {
        Some((i, _, _)) if i == index => {}
        other => {
            eprintln!("page {index}: bad content, stamp {other:?}");
            bad.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[test]
fn concurrent_writes_reads_discards_and_commits() {
    let store = Arc::new(PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap());
    // A slow "device" with small slots, so staged pages are overwritten, discarded and
    // compacted around while their results are still on their way.
    let device = HostSlots::with_faults(
        Algorithm::Lz4,
        4,
        8,
        FaultPlan::slow(Duration::from_micros(300)),
    );
    let ring =
        Arc::new(Ring::start(store.clone(), Arc::new(device), RingConfig::default()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let bad = Arc::new(AtomicU64::new(0));
    let reads = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();

    // Writers: single pages and multi-page requests over the whole range.
    for writer in 0..3u64 {
        let (store, stop) = (store.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng::new(writer + 1);
            let mut version = 0;
            while !stop.load(Ordering::Relaxed) {
                version += 1;
                let count = 1 + rng.next() % 3;
                let first = rng.next() % (PAGES - count + 1);
                let data: Vec<u8> = (first..first + count)
                    .flat_map(|i| *stamped_page(i, writer, version, rng.next() as u8))
                    .collect();
                store.write(first, &data).unwrap();
            }
        }));
    }
    // Readers.
    for reader in 0..2u64 {
        let (store, stop, bad, reads) = (store.clone(), stop.clone(), bad.clone(), reads.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng::new(100 + reader);
            let mut out = vec![0u8; 4 * PAGE_SIZE];
            while !stop.load(Ordering::Relaxed) {
                let count = 1 + rng.next() % 4;
                let first = rng.next() % (PAGES - count + 1);
                let buf = &mut out[..count as usize * PAGE_SIZE];
                store.read(first, buf).unwrap();
                for (i, page) in buf.chunks_exact(PAGE_SIZE).enumerate() {
                    check(first + i as u64, page.try_into().unwrap(), &bad);
                }
                reads.fetch_add(count, Ordering::Relaxed);
            }
        }));
    }
    // Discards and write_zeroes.
    {
        let (store, stop) = (store.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng::new(200);
            while !stop.load(Ordering::Relaxed) {
                let first = rng.next() % PAGES;
                if rng.next().is_multiple_of(2) {
                    store.discard(first, 1).unwrap();
                } else {
                    store.write_zeroes(first, 1).unwrap();
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }));
    }
    // Writes through the ring: staged, compressed later, installed if still current.
    {
        let (ring, stop) = (ring.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng::new(300);
            let mut version = 0;
            while !stop.load(Ordering::Relaxed) {
                version += 1;
                let count = 1 + rng.next() % 4;
                let first = rng.next() % (PAGES - count + 1);
                let data: Vec<u8> = (first..first + count)
                    .flat_map(|i| *stamped_page(i, 9, version, rng.next() as u8))
                    .collect();
                ring.write(first, &data).unwrap();
            }
        }));
    }

    // Compaction racing with all of the above.
    let compacted = Arc::new(AtomicU64::new(0));
    {
        let (store, stop, compacted) = (store.clone(), stop.clone(), compacted.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                compacted.fetch_add(store.compact(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        }));
    }

    let start = Instant::now();
    while start.elapsed() < RUN {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    ring.flush();
    let ring_stats = ring.stats();

    // Quiescent: every page is whole, belongs to its index, and the counters add up.
    let mut all = vec![0u8; PAGES as usize * PAGE_SIZE];
    store.read(0, &mut all).unwrap();
    for (i, page) in all.chunks_exact(PAGE_SIZE).enumerate() {
        check(i as u64, page.try_into().unwrap(), &bad);
    }
    assert_eq!(
        bad.load(Ordering::Relaxed),
        0,
        "reads returned foreign or torn pages"
    );
    let stored = all
        .chunks_exact(PAGE_SIZE)
        .filter(|p| p.iter().any(|b| *b != 0))
        .count() as u64;
    let stats = store.stats();
    assert_eq!(stats.pages_stored, stored);
    assert!(reads.load(Ordering::Relaxed) > 100, "readers made progress");
    assert!(ring_stats.installed_pages > 0, "{ring_stats:?}");
    assert_eq!(stats.staged_pages, 0);
    eprintln!(
        "reads {}, writes {}, pages compacted {}, ring {ring_stats:?}",
        reads.load(Ordering::Relaxed),
        stats.writes,
        compacted.load(Ordering::Relaxed)
    );
    assert_eq!(stats.pages_compacted, compacted.load(Ordering::Relaxed));
    store.discard(0, PAGES).unwrap();
    assert_eq!(store.memory().segment_bytes, 0);
}

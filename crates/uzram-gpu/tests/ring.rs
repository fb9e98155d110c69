//! The ring over GPU slots, as the daemon runs it: pages written in 64 KiB requests from
//! several threads (half of them with their pages copied in by a source, as ublk's user
//! copy has the kernel copy them) read back exactly, also while staged and while overwritten or
//! discarded racing their slot, and nothing falls back to the CPU on a healthy GPU.
//! Skips with a printed reason where there is no GPU.

mod common;

use std::sync::Arc;

use uzram_core::batch::{BytesSource, Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::store::{PageStore, StoreConfig};
use uzram_core::PAGE_SIZE;

fn pages() -> Vec<u8> {
    let mut v = common::load_pages(&common::slice_paths()[0]);
    v.extend(common::load_pages(&common::slice_paths()[1]));
    v.extend(common::adversarial_pages());
    v.extend(common::random_pages(64, 9));
    v
}

#[test]
fn ring_on_the_gpu_keeps_the_latest_write() {
    for parse in common::parses() {
        let Some(slots) = common::gpu(4, 256, parse, true) else {
            return;
        };
        keeps_the_latest_write(slots, None, parse.name());
    }
}

/// As the daemon runs it: the staging in memory of its own (a shared memory segment that
/// outlives it) registered with the GPU, and the ring's books there too.
#[test]
fn ring_over_registered_staging_keeps_the_latest_write() {
    for parse in common::parses() {
        let inputs = common::kept_words(4 * 256 * uzram_core::PAGE_WORDS);
        let Some(slots) = common::gpu_over(4, 256, parse, inputs) else {
            return;
        };
        assert!(slots.staging_is_registered());
        let books = common::kept_words(uzram_core::batch::book_words(4, 256));
        keeps_the_latest_write(slots, Some(books), parse.name());
    }
}

fn keeps_the_latest_write(
    slots: uzram_gpu::GpuSlots,
    books: Option<&'static [std::sync::atomic::AtomicU64]>,
    what: &str,
) {
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let store = Arc::new(PageStore::new(StoreConfig::new(n, Algorithm::Lz4)).expect("store"));
    let cfg = RingConfig {
        spot_check_every: 1,
        books,
        ..RingConfig::default()
    };
    let ring = Ring::start(store.clone(), Arc::new(slots), cfg).expect("ring");
    // Four writers, as four queue threads, each on its own quarter.
    let per = (n as usize).div_ceil(4);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (ring, data) = (&ring, &data);
            s.spawn(move || {
                let end = ((t + 1) * per).min(n as usize);
                let mut bounce = vec![0u8; 16 * PAGE_SIZE];
                for first in (t * per..end).step_by(16) {
                    let count = 16.min(end - first);
                    let bytes = &data[first * PAGE_SIZE..(first + count) * PAGE_SIZE];
                    // Half the writers have their pages copied into the slots, as ublk's
                    // user copy has the kernel copy them; the others copy them themselves.
                    if t % 2 == 0 {
                        ring.write_from(first as u64, count, &mut BytesSource(bytes), &mut bounce)
                    } else {
                        ring.write(first as u64, bytes)
                    }
                    .expect("write");
                }
            });
        }
    });
    // Overwrite every 3rd page with the page after it, discard every 11th, while the
    // first slots may still be on the GPU.
    let mut expect = data.clone();
    for p in (0..n as usize - 1).step_by(3) {
        let next = data[(p + 1) * PAGE_SIZE..(p + 2) * PAGE_SIZE].to_vec();
        ring.write(p as u64, &next).expect("overwrite");
        expect[p * PAGE_SIZE..(p + 1) * PAGE_SIZE].copy_from_slice(&next);
    }
    for p in (0..n as usize).step_by(11) {
        store.discard(p as u64, 1).unwrap();
        expect[p * PAGE_SIZE..(p + 1) * PAGE_SIZE].fill(0);
    }
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).expect("read while staged");
    assert!(back == expect, "a page does not hold its last write");
    ring.flush();
    let stats = ring.stats();
    eprintln!(
        "{what} (kept books: {}): ring {stats:?}; gpu {:?}",
        books.is_some(),
        ring.backend_stats()
    );
    assert!(
        stats.slots_submitted > 0 && stats.installed_pages > 0,
        "{stats:?}"
    );
    assert_eq!(stats.backend_failures, 0, "{stats:?}");
    assert_eq!(stats.rejected_pages, 0, "{stats:?}");
    assert_eq!(stats.spot_check_failures, 0, "{stats:?}");
    assert_eq!(stats.cpu_pages, 0, "{stats:?}");
    assert_eq!(stats.retired, 0, "{stats:?}");
    assert_eq!(store.stats().staged_pages, 0);
    store.read(0, &mut back).expect("read");
    assert!(back == expect, "a page does not hold its last write");
    ring.shutdown();
}

/// A slot's copy engine brings a fixed share of its packed bytes over (`launch::copied_bytes`:
/// half the input for the high parse), the check's stores the rest; pages that compress to
/// three quarters of a page pack more than that share, so blocks straddle the boundary and
/// lie beyond it, and every one must come back exact. Both parses, with and without graphs.
#[test]
fn pages_that_pack_more_than_the_copy_come_back_whole() {
    // 3072 random bytes, then the page's first 1024 again: a block of about 3.1 KiB, under
    // the raw threshold.
    let mut data = common::random_pages(96, 21);
    for page in data.chunks_exact_mut(PAGE_SIZE) {
        page.copy_within(0..1024, 3072);
    }
    for parse in common::parses() {
        for graphs in [true, false] {
            let Some(slots) = common::gpu(2, 64, parse, graphs) else {
                return;
            };
            let results = common::run_slots(&slots, &data, 3625).expect("run");
            let c = common::check(&data, 3625, &results);
            let stats = slots.gpu_stats();
            eprintln!("{} graphs {graphs}: {stats:?}", parse.name());
            assert_eq!(c.mismatches, 0, "{} graphs {graphs}", parse.name());
            assert!(
                results
                    .iter()
                    .all(|r| matches!(r, common::Owned::Block(b) if b.len() > 2 * PAGE_SIZE / 3)),
                "every page should come back as a block of about three quarters of a page"
            );
            assert!(
                stats.packed_bytes > stats.bytes_in / 2,
                "the slots packed no more than their copy takes: {stats:?}"
            );
        }
    }
}

#[test]
fn slots_spread_over_every_gpu() {
    let count = match uzram_gpu::probe() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("skipping: {e}");
            return;
        }
    };
    let cfg = uzram_gpu::GpuConfig {
        devices: (0..count).collect(),
        slots: 2 * count.max(2),
        slot_pages: 128,
        ..uzram_gpu::GpuConfig::default()
    };
    let slots = uzram_gpu::GpuSlots::new(cfg).expect("slots on every GPU");
    eprintln!("{count} GPU(s): {:?}", slots.device_names());
    assert_eq!(slots.device_names().len(), count);
    let data = pages();
    let results = common::run_slots(&slots, &data, 3625).expect("run");
    let c = common::check(&data, 3625, &results);
    assert_eq!(c.mismatches, 0);
}

/// A handover drains the ring: with writers going on, afterwards no page is staged (only the
/// dying process could read it), slots in flight finished on the GPU, and every page reads
/// back with its last write.
#[test]
fn a_drain_leaves_no_page_staged_on_the_gpu() {
    let Some(slots) = common::gpu(4, 256, common::parses()[0], true) else {
        return;
    };
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let store = Arc::new(PageStore::new(StoreConfig::new(2 * n, Algorithm::Lz4)).expect("store"));
    let ring = Ring::start(store.clone(), Arc::new(slots), RingConfig::default()).expect("ring");
    std::thread::scope(|s| {
        for half in 0..2u64 {
            let (ring, data) = (&ring, &data);
            s.spawn(move || {
                for _ in 0..4 {
                    for (i, req) in data.chunks(16 * PAGE_SIZE).enumerate() {
                        ring.write(half * n + 16 * i as u64, req).expect("write");
                    }
                }
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
        let start = std::time::Instant::now();
        assert!(
            ring.drain(std::time::Duration::from_secs(30)),
            "drain timed out"
        );
        eprintln!("drained in {:?}; ring {:?}", start.elapsed(), ring.stats());
        assert_eq!(
            store.stats().staged_pages,
            0,
            "pages staged after the drain"
        );
    });
    let stats = ring.stats();
    assert_eq!(store.stats().staged_pages, 0);
    assert!(
        stats.slots_submitted > 0,
        "nothing went to the GPU: {stats:?}"
    );
    let mut expect = data.clone();
    expect.extend_from_slice(&data);
    let mut back = vec![0u8; expect.len()];
    store.read(0, &mut back).expect("read");
    assert!(back == expect, "a page does not hold its last write");
}

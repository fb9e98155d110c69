//! Allocation failures on the I/O path become errors for one request, never an abort, and
//! the store keeps serving once memory is back. A global allocator that refuses chosen
//! allocations stands in for a daemon whose reserves ran out.
//!
//! The refusal is process-wide, so this file has its own `main` (`harness = false`): libtest
//! reports results from another thread while the next test runs, and one of those reports
//! once allocated inside a refusal window and aborted the run.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uzram_core::batch::{FaultPlan, HostSlots, Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::page::fill_page;
use uzram_core::store::{
    BackingDevice, BlockRun, Nonces, Writeback, WritebackCandidates, WritebackKey, BLOCK_BYTES,
    KEY_BYTES,
};
use uzram_core::{CoreError, PageStore, StoreConfig, PAGE_SIZE};

/// Refuses every allocation of at least `FAIL_FROM` bytes while `FAILING` is set.
struct Refusing;

static FAILING: AtomicBool = AtomicBool::new(false);
static FAIL_FROM: AtomicUsize = AtomicUsize::new(usize::MAX);
static REFUSED: AtomicUsize = AtomicUsize::new(0);

fn refuse(layout: Layout) -> bool {
    let refuse =
        FAILING.load(Ordering::Relaxed) && layout.size() >= FAIL_FROM.load(Ordering::Relaxed);
    if refuse {
        REFUSED.fetch_add(1, Ordering::Relaxed);
    }
    refuse
}

// SAFETY: every allocation is either refused (null, which callers must handle) or forwarded
// to `System` with the caller's layout; deallocation always goes to `System`.
unsafe impl GlobalAlloc for Refusing {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refuse(layout) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if refuse(layout) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if FAILING.load(Ordering::Relaxed) && new_size >= FAIL_FROM.load(Ordering::Relaxed) {
            REFUSED.fetch_add(1, Ordering::Relaxed);
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: everything not refused came from System with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Refusing = Refusing;

struct Failing;

/// Refuses allocations of `from` bytes or more until the guard drops (hold [`serial`]).
fn failing(from: usize) -> Failing {
    FAIL_FROM.store(from, Ordering::Relaxed);
    FAILING.store(true, Ordering::Relaxed);
    Failing
}

impl Drop for Failing {
    fn drop(&mut self) {
        FAILING.store(false, Ordering::Relaxed);
    }
}

fn noise(seed: u64) -> [u8; PAGE_SIZE] {
    let mut x = seed | 1;
    let mut page = [0u8; PAGE_SIZE];
    for chunk in page.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    page
}

fn an_arena_that_cannot_grow_fails_the_write_with_enomem() {
    let store = PageStore::new(StoreConfig::new(64, Algorithm::Lz4)).unwrap();
    store.prepare_thread().unwrap();
    let page = noise(1);
    {
        // Arena segments are 64 KiB: refuse those.
        let _f = failing(64 << 10);
        let err = store.write(3, &page).unwrap_err();
        assert!(matches!(err, CoreError::NoMemory), "{err}");
        assert_eq!(err.errno(), -12);
        // The page kept its old (empty) content, and reads still work.
        let mut out = [1u8; PAGE_SIZE];
        store.read(3, &mut out).unwrap();
        assert_eq!(out, [0; PAGE_SIZE]);
    }
    store.write(3, &page).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    store.read(3, &mut out).unwrap();
    assert_eq!(out, page);
}

fn a_fill_word_without_room_in_the_side_map_fails_with_enomem() {
    let store = PageStore::new(StoreConfig::new(64, Algorithm::Lz4)).unwrap();
    store.prepare_thread().unwrap();
    // A fill word that does not fit an entry goes to the side map, whose first insert
    // allocates.
    let mut page = [0u8; PAGE_SIZE];
    fill_page(&mut page, 0x1234_5678_9abc_def0);
    {
        let _f = failing(1);
        let err = store.write(5, &page).unwrap_err();
        assert!(matches!(err, CoreError::NoMemory), "{err}");
    }
    store.write(5, &page).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    store.read(5, &mut out).unwrap();
    assert_eq!(out, page);
}

fn a_codec_that_cannot_be_made_fails_at_start_not_on_a_request() {
    let store = PageStore::new(StoreConfig::new(8, Algorithm::Lz4)).unwrap();
    // A fresh thread: its codec does not exist yet. LZ4's position table is 16 KiB.
    let refused = std::thread::spawn(move || {
        let err = {
            let _f = failing(8 << 10);
            store.prepare_thread().unwrap_err()
        };
        assert!(matches!(err, CoreError::Compress(_)), "{err}");
        store.prepare_thread().unwrap();
        store.write(0, &noise(2)).unwrap();
    })
    .join();
    assert!(refused.is_ok(), "the thread panicked");
}

fn a_ring_that_cannot_get_its_buffers_does_not_start() {
    let store = Arc::new(PageStore::new(StoreConfig::new(64, Algorithm::Lz4)).unwrap());
    let host = Arc::new(HostSlots::new(Algorithm::Lz4, 2, 16));
    let err = {
        // Installer page buffers are 1 MiB: refuse those.
        let _f = failing(1 << 20);
        Ring::start(store, host, RingConfig::default()).unwrap_err()
    };
    assert!(matches!(err, CoreError::NoMemory), "{err}");
}

fn installs_wait_for_memory_and_lose_nothing() {
    let store = Arc::new(PageStore::new(StoreConfig::new(256, Algorithm::Lz4)).unwrap());
    let host = Arc::new(HostSlots::with_faults(
        Algorithm::Lz4,
        4,
        32,
        FaultPlan::default(),
    ));
    // No slot is sealed by its delay: the 128 pages fill the 4 slots exactly, so no write
    // finds every slot busy and goes inline (which, with no segment to be had, would fail).
    let cfg = RingConfig {
        max_delay: Duration::from_secs(60),
        ..RingConfig::default()
    };
    let ring = Ring::start(store.clone(), host, cfg).unwrap();
    let pages: Vec<[u8; PAGE_SIZE]> = (0..128u64).map(noise).collect();
    let refused_before = REFUSED.load(Ordering::Relaxed);
    {
        // No arena segment can be had: writes are staged, installs must wait.
        let _f = failing(64 << 10);
        for (i, p) in pages.iter().enumerate() {
            ring.write(i as u64, p).unwrap();
        }
        let start = Instant::now();
        while ring.stats().commit_retries == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no install was tried"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // Meanwhile every page reads back from its slot.
        let mut out = [0u8; PAGE_SIZE];
        for (i, p) in pages.iter().enumerate() {
            store.read(i as u64, &mut out).unwrap();
            assert!(out == *p, "page {i} while installs wait");
        }
    }
    assert!(REFUSED.load(Ordering::Relaxed) > refused_before);
    ring.flush();
    let s = ring.stats();
    assert_eq!(s.installed_pages, 128, "{s:?}");
    assert_eq!(store.stats().staged_pages, 0);
    let mut out = [0u8; PAGE_SIZE];
    for (i, p) in pages.iter().enumerate() {
        store.read(i as u64, &mut out).unwrap();
        assert!(out == *p, "page {i} after the installs");
    }
}

/// A backing device in memory whose writes and reads allocate nothing.
#[derive(Debug)]
struct MemDisk(std::sync::Mutex<Vec<u8>>);

impl BackingDevice for MemDisk {
    fn blocks(&self) -> u64 {
        (self.0.lock().unwrap().len() / BLOCK_BYTES) as u64
    }
    fn write_runs(&self, runs: &[BlockRun<'_>], _failed: &mut [Option<std::io::Error>]) {
        let mut disk = self.0.lock().unwrap();
        for run in runs {
            let at = run.first as usize * BLOCK_BYTES;
            disk[at..at + run.data.len()].copy_from_slice(run.data);
        }
    }
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> std::io::Result<()> {
        let at = first as usize * BLOCK_BYTES;
        out.copy_from_slice(&self.0.lock().unwrap()[at..at + out.len()]);
        Ok(())
    }
    fn release(&self, _first: u64, _count: u64) -> std::io::Result<()> {
        Ok(())
    }
}

/// A writeback pass runs when memory is short, to make room for writes waiting on it: it
/// must not allocate (an allocation then can wait for reclaim, which waits for swap writes
/// to this device). Every allocation is refused during a pass of more pages than one scan
/// picks, and during the reads back; nothing is refused, and every page reads back.
fn a_writeback_pass_and_its_reads_allocate_nothing() {
    const PAGES: u64 = 6000;
    let store = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    store.prepare_thread().unwrap();
    let page = |i: u64| {
        let mut p = noise(i);
        if !i.is_multiple_of(4) {
            p[64..].fill(i as u8);
        }
        p
    };
    for i in 0..PAGES {
        store.write(i, &page(i)).unwrap();
    }
    let disk = Arc::new(MemDisk(std::sync::Mutex::new(vec![
        0;
        PAGES as usize
            * 2
            * BLOCK_BYTES
    ])));
    store
        .attach_backing(disk, &WritebackKey([3; KEY_BYTES]), Nonces::Owned)
        .unwrap();
    let refused = REFUSED.load(Ordering::Relaxed);
    let mut out = [0u8; PAGE_SIZE];
    let done = {
        let _f = failing(1);
        let done = store
            .writeback(Writeback {
                candidates: WritebackCandidates::Idle { min_age: 0 },
                max_pages: u64::MAX,
                max_bytes: u64::MAX,
            })
            .unwrap();
        for i in (0..PAGES).step_by(7) {
            store.read(i, &mut out).unwrap();
            assert!(out == page(i), "page {i} read back other data");
        }
        done
    };
    assert_eq!(
        REFUSED.load(Ordering::Relaxed),
        refused,
        "the pass allocated"
    );
    assert_eq!(done.pages, PAGES);
    assert_eq!(store.stats().bd_count, PAGES);
}

/// Runs each case in turn on this thread; nothing else allocates while one refuses.
fn main() {
    let cases: [(&str, fn()); 6] = [
        (
            "a_writeback_pass_and_its_reads_allocate_nothing",
            a_writeback_pass_and_its_reads_allocate_nothing,
        ),
        (
            "an_arena_that_cannot_grow_fails_the_write_with_enomem",
            an_arena_that_cannot_grow_fails_the_write_with_enomem,
        ),
        (
            "a_fill_word_without_room_in_the_side_map_fails_with_enomem",
            a_fill_word_without_room_in_the_side_map_fails_with_enomem,
        ),
        (
            "a_codec_that_cannot_be_made_fails_at_start_not_on_a_request",
            a_codec_that_cannot_be_made_fails_at_start_not_on_a_request,
        ),
        (
            "a_ring_that_cannot_get_its_buffers_does_not_start",
            a_ring_that_cannot_get_its_buffers_does_not_start,
        ),
        (
            "installs_wait_for_memory_and_lose_nothing",
            installs_wait_for_memory_and_lose_nothing,
        ),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut ran = 0;
    for (name, case) in cases {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        case();
        println!("test {name} ... ok");
        ran += 1;
    }
    println!("alloc_failure: {ran} passed");
}

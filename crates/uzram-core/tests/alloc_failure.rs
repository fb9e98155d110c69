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

/// Runs each case in turn on this thread; nothing else allocates while one refuses.
fn main() {
    let cases: [(&str, fn()); 5] = [
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

//! Writeback against a backing device in memory: pages leave RAM packed and sealed, read
//! back whole, free their blocks when they go, survive a takeover with the key, and a block
//! changed on disk, moved, or opened with another key is an I/O error, never other data.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::fuzz_tests::MemHome;
use super::*;

/// A backing device in memory that remembers which blocks it was told to release.
#[derive(Debug)]
struct MemDisk {
    bytes: Mutex<Vec<u8>>,
    released: Mutex<BTreeSet<u64>>,
    fail_writes: std::sync::atomic::AtomicBool,
}

impl MemDisk {
    fn new(blocks: usize) -> Arc<Self> {
        Arc::new(Self {
            bytes: Mutex::new(vec![0; blocks * BLOCK_BYTES]),
            released: Mutex::new(BTreeSet::new()),
            fail_writes: false.into(),
        })
    }

    fn flip(&self, byte: usize) {
        self.bytes.lock().unwrap()[byte] ^= 0x20;
    }

    fn block(&self, b: usize) -> Vec<u8> {
        self.bytes.lock().unwrap()[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES].to_vec()
    }

    fn set_block(&self, b: usize, data: &[u8]) {
        self.bytes.lock().unwrap()[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES].copy_from_slice(data);
    }
}

impl BackingDevice for MemDisk {
    fn blocks(&self) -> u64 {
        (self.bytes.lock().unwrap().len() / BLOCK_BYTES) as u64
    }
    fn write_blocks(&self, first: u64, data: &[u8]) -> io::Result<()> {
        if self.fail_writes.load(Relaxed) {
            return Err(io::Error::other("injected write failure"));
        }
        let at = first as usize * BLOCK_BYTES;
        self.bytes.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        let mut released = self.released.lock().unwrap();
        for b in first..first + (data.len() / BLOCK_BYTES) as u64 {
            released.remove(&b);
        }
        Ok(())
    }
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> io::Result<()> {
        let at = first as usize * BLOCK_BYTES;
        let bytes = self.bytes.lock().unwrap();
        let from = bytes
            .get(at..at + out.len())
            .ok_or_else(|| io::Error::other("read past the end"))?;
        out.copy_from_slice(from);
        Ok(())
    }
    fn release(&self, first: u64, count: u64) -> io::Result<()> {
        let mut released = self.released.lock().unwrap();
        for b in first..first + count {
            released.insert(b);
        }
        Ok(())
    }
}

const PAGES: u64 = 256;
const KEY: WritebackKey = WritebackKey([7; KEY_BYTES]);

/// Compressible text (i % 3 != 2) or noise (raw), different for every `i` and `round`.
fn page(i: u64, round: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let mut x = (i * 7919 + round * 104_729) | 1;
    for (k, c) in p.chunks_exact_mut(8).enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = if i % 3 == 2 {
            x
        } else {
            (k as u64 / 16) ^ i ^ (round << 32)
        };
        c.copy_from_slice(&w.to_le_bytes());
    }
    p
}

fn filled(store: &PageStore, round: u64) {
    for i in 0..PAGES {
        store.write(i, &page(i, round)).unwrap();
    }
}

fn reads_back(store: &PageStore, round: u64) {
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..PAGES {
        store.read(i, &mut out).unwrap();
        assert!(out == page(i, round), "page {i} read back other data");
    }
}

fn idle_pass(max_pages: u64) -> Writeback {
    Writeback {
        candidates: WritebackCandidates::Idle { min_age: 0 },
        max_pages,
        max_bytes: u64::MAX,
    }
}

fn backed_store(disk: &Arc<MemDisk>) -> PageStore {
    let store = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    store
        .attach_backing(disk.clone(), &KEY, NonceCounter::Owned(AtomicU64::new(0)))
        .unwrap();
    store
}

#[test]
fn written_back_pages_leave_ram_packed_and_read_back() {
    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    let before = store.stats();
    let done = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert_eq!(done.pages, PAGES);
    assert_eq!(done.payload_bytes, before.compr_data_size);
    let after = store.stats();
    assert_eq!(after.bd_count, PAGES);
    assert_eq!(after.compr_data_size, 0);
    assert_eq!(after.pages_stored, PAGES);
    assert_eq!(after.bd_writes, done.blocks);
    // Packed: the blocks hold the objects and their seals, not a block per page.
    let sealed = before.compr_data_size + PAGES * (CHECKSUM_BYTES + SEAL_BYTES) as u64;
    assert_eq!(done.blocks, sealed.div_ceil(BLOCK_BYTES as u64));
    assert!(done.blocks < PAGES);
    reads_back(&store, 0);
    assert!(store.stats().bd_reads >= PAGES);
    // A second pass finds nothing left in RAM.
    assert_eq!(store.writeback(idle_pass(u64::MAX)).unwrap().pages, 0);
}

#[test]
fn only_the_candidates_go_oldest_first_and_at_most_max_pages() {
    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    let huge = store.stats().huge_pages;
    let done = store
        .writeback(Writeback {
            candidates: WritebackCandidates::Huge,
            max_pages: u64::MAX,
            max_bytes: u64::MAX,
        })
        .unwrap();
    assert_eq!(done.pages, huge);
    assert_eq!(store.stats().huge_pages, 0);
    // Nothing is idle yet: an age of one tick takes nothing; after a tick, the pages
    // written before it go, not the one written after.
    let one_tick = |max_pages| Writeback {
        candidates: WritebackCandidates::Idle { min_age: 1 },
        max_pages,
        max_bytes: u64::MAX,
    };
    assert_eq!(store.writeback(one_tick(u64::MAX)).unwrap().pages, 0);
    store.tick();
    store.write(0, &page(0, 1)).unwrap();
    assert_eq!(store.writeback(one_tick(10)).unwrap().pages, 10);
    let done = store.writeback(one_tick(u64::MAX)).unwrap();
    assert_eq!(done.pages + 10 + huge, PAGES - 1);
    assert_eq!(store.stats().bd_count, PAGES - 1);
}

#[test]
fn overwrite_and_discard_free_the_blocks_and_they_are_written_again() {
    let disk = MemDisk::new(128);
    let store = backed_store(&disk);
    filled(&store, 0);
    let first = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert!(
        first.blocks > 64,
        "the test needs a pass of over half the device"
    );
    assert!(disk.released.lock().unwrap().is_empty());
    // Overwrite half, discard the rest: every block is released.
    for i in 0..PAGES / 2 {
        store.write(i, &page(i, 1)).unwrap();
    }
    store.discard(PAGES / 2, PAGES / 2).unwrap();
    assert_eq!(store.stats().bd_count, 0);
    assert_eq!(
        disk.released.lock().unwrap().len() as u64,
        first.blocks,
        "every block the pass wrote was released"
    );
    // The device holds 128 blocks; this pass fits only because the first one's were freed.
    filled(&store, 2);
    let second = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert_eq!(second.pages, PAGES);
    reads_back(&store, 2);
}

#[test]
fn a_full_device_or_a_failed_write_leaves_every_page_in_ram() {
    let disk = MemDisk::new(4);
    let store = backed_store(&disk);
    filled(&store, 0);
    let err = store.writeback(idle_pass(u64::MAX)).unwrap_err();
    assert!(matches!(err, CoreError::BackingFull { .. }), "{err}");
    assert_eq!(store.stats().bd_count, 0);
    reads_back(&store, 0);

    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    disk.fail_writes.store(true, Relaxed);
    assert!(store.writeback(idle_pass(u64::MAX)).is_err());
    assert_eq!(store.stats().bd_count, 0);
    assert_eq!(store.stats().bd_failures, 1);
    reads_back(&store, 0);
    disk.fail_writes.store(false, Relaxed);
    assert_eq!(store.writeback(idle_pass(u64::MAX)).unwrap().pages, PAGES);
    reads_back(&store, 0);
}

#[test]
fn a_block_changed_on_disk_or_moved_fails_its_reads_and_only_those() {
    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    // Two passes, so block 0 and a later block each start with an object.
    let first = store.writeback(idle_pass(PAGES / 2)).unwrap();
    store.writeback(idle_pass(u64::MAX)).unwrap();
    // One flipped byte in the middle of block 1.
    disk.flip(BLOCK_BYTES + 1000);
    let mut out = [0u8; PAGE_SIZE];
    let mut failed = 0;
    for i in 0..PAGES {
        match store.read(i, &mut out) {
            Ok(()) => assert!(out == page(i, 0), "page {i} read back other data"),
            Err(e) => {
                assert_eq!(e.errno(), -5, "{e}");
                failed += 1;
            }
        }
    }
    assert!((1..=2).contains(&failed), "{failed} pages failed");
    let stats = store.stats();
    assert_eq!(stats.checksum_failures, failed);
    assert_eq!(stats.bd_failures, failed);
    // The first block of the second pass copied over block 0: the pages there now hold
    // another page's sealed bytes at their place, and fail.
    let second_start = first.blocks as usize;
    disk.set_block(0, &disk.block(second_start));
    let mut wrong = 0;
    for i in 0..PAGES {
        if let Ok(()) = store.read(i, &mut out) {
            assert!(out == page(i, 0), "page {i} read back other data");
        } else {
            wrong += 1;
        }
    }
    assert!(wrong > failed, "the moved block failed no more reads");
}

#[test]
fn a_taken_over_store_reads_its_written_back_pages_with_the_key_and_fails_without_it() {
    let len = PageStore::table_len(PAGES).unwrap();
    let table: &'static [AtomicU64] = Box::leak((0..len).map(|_| AtomicU64::new(0)).collect());
    let nonces: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let disk = MemDisk::new(1024);
    let cfg = StoreConfig::new(PAGES, Algorithm::Lz4);
    let persist = |home| Persistence { table, home };
    let home = Arc::new(MemHome::default());
    let store = PageStore::new_persistent(cfg.clone(), persist(home)).unwrap();
    store
        .attach_backing(disk.clone(), &KEY, NonceCounter::Kept(nonces))
        .unwrap();
    filled(&store, 0);
    store.writeback(idle_pass(PAGES / 2)).unwrap();
    let used = nonces.load(Relaxed);
    assert_eq!(used, PAGES / 2, "a nonce per object");
    let segments: HashMap<usize, Vec<u64>> =
        store.arena.snapshot().into_iter().enumerate().collect();
    let words: Vec<u64> = table.iter().map(|w| w.load(Relaxed)).collect();
    drop(store);
    // The memory a killed daemon leaves, each time.
    let recovered = || {
        for (w, v) in table.iter().zip(&words) {
            w.store(*v, Relaxed);
        }
        let home = Arc::new(MemHome {
            found: Mutex::new(segments.clone()),
        });
        PageStore::recover(cfg.clone(), persist(home), None).unwrap()
    };

    let (store, found) = recovered();
    assert_eq!(found.pages_stored, PAGES);
    assert_eq!(store.stats().bd_count, PAGES / 2);
    // Before the device is attached, its pages fail; after, they read.
    let mut out = [0u8; PAGE_SIZE];
    assert!(store.read(0, &mut out).is_err() || store.read(PAGES - 1, &mut out).is_err());
    let adopted = store
        .attach_backing(disk.clone(), &KEY, NonceCounter::Kept(nonces))
        .unwrap();
    assert_eq!(adopted, PAGES / 2);
    reads_back(&store, 0);
    // It goes on: the rest goes out under new nonces, and overwrites free blocks.
    assert_eq!(
        store.writeback(idle_pass(u64::MAX)).unwrap().pages,
        PAGES / 2
    );
    assert_eq!(nonces.load(Relaxed), used + PAGES / 2);
    reads_back(&store, 0);
    drop(store);

    // Another key opens nothing: every written-back page fails, none reads other data.
    let (store, _) = recovered();
    store
        .attach_backing(
            disk.clone(),
            &WritebackKey([8; KEY_BYTES]),
            NonceCounter::Kept(nonces),
        )
        .unwrap();
    let failed = (0..PAGES)
        .filter(|&i| match store.read(i, &mut out) {
            Ok(()) => {
                assert!(out == page(i, 0));
                false
            }
            Err(_) => true,
        })
        .count() as u64;
    assert_eq!(failed, PAGES / 2);
    drop(store);

    // A smaller device than the table's objects need is refused whole.
    let (store, _) = recovered();
    let err = store
        .attach_backing(MemDisk::new(1), &KEY, NonceCounter::Kept(nonces))
        .unwrap_err();
    assert!(matches!(err, CoreError::Damaged(_)), "{err}");
    assert!(!store.has_backing());
}

#[test]
fn writes_racing_a_pass_win_and_nothing_is_lost() {
    let disk = MemDisk::new(4096);
    let store = Arc::new(backed_store(&disk));
    for round in 0..4u64 {
        filled(&store, round * 2);
        let writer = {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in (0..PAGES).rev() {
                    store.write(i, &page(i, round * 2 + 1)).unwrap();
                }
            })
        };
        while !writer.is_finished() {
            store.writeback(idle_pass(64)).unwrap();
        }
        writer.join().unwrap();
        reads_back(&store, round * 2 + 1);
        store.writeback(idle_pass(u64::MAX)).unwrap();
        reads_back(&store, round * 2 + 1);
    }
    // Every page's last object is on disk; every other block was released.
    assert_eq!(store.stats().bd_count, PAGES);
}

#[test]
fn a_pass_writes_no_more_blocks_than_its_byte_budget() {
    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    let mut total = 0;
    for budget in [0u64, 4095, 4096, 3 * 4096 + 100, 40 * 4096] {
        let done = store
            .writeback(Writeback {
                max_bytes: budget,
                ..idle_pass(u64::MAX)
            })
            .unwrap();
        assert!(
            done.blocks * BLOCK_BYTES as u64 <= budget,
            "{budget}: {done:?}"
        );
        assert_eq!(done.pages > 0, budget >= 4096, "{budget}: {done:?}");
        total += done.blocks;
    }
    assert_eq!(store.stats().bd_writes, total);
    reads_back(&store, 0);
}

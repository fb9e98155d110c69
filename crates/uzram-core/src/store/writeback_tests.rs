//! Writeback against a backing device in memory: pages leave RAM packed and sealed, read
//! back whole, free their blocks when they go, survive a takeover with the key, and a block
//! changed on disk, moved, or opened with another key is an I/O error, never other data.

use std::collections::BTreeSet;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::kept_memory::KeptMemory;
use super::*;

/// A backing device in memory that remembers which blocks it was told to release.
#[derive(Debug)]
struct MemDisk {
    bytes: Mutex<Vec<u8>>,
    released: Mutex<BTreeSet<u64>>,
    fail_writes: std::sync::atomic::AtomicBool,
    /// In every `write_runs` call, the runs from this one on (counted from 0) fail.
    fail_from_run: AtomicU64,
    /// Runs per `write_runs` call, in order.
    batches: Mutex<Vec<usize>>,
    release_calls: Mutex<u64>,
    /// Run once at the next `write_runs`, before it writes (writes racing the pass).
    race: Race,
}

/// What a [`MemDisk`] runs at its next write.
#[derive(Default)]
struct Race(Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl std::fmt::Debug for Race {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Race")
    }
}

impl MemDisk {
    fn new(blocks: usize) -> Arc<Self> {
        Arc::new(Self {
            bytes: Mutex::new(vec![0; blocks * BLOCK_BYTES]),
            released: Mutex::new(BTreeSet::new()),
            fail_writes: false.into(),
            fail_from_run: AtomicU64::new(u64::MAX),
            batches: Mutex::new(Vec::new()),
            release_calls: Mutex::new(0),
            race: Race::default(),
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
    fn write_runs(&self, runs: &[BlockRun<'_>], failed: &mut [Option<io::Error>]) {
        let race = self.race.0.lock().unwrap().take();
        if let Some(race) = race {
            race();
        }
        self.batches.lock().unwrap().push(runs.len());
        let fail_from = self.fail_from_run.load(Relaxed);
        for (i, (run, failed)) in runs.iter().zip(failed).enumerate() {
            let fail = self.fail_writes.load(Relaxed) || i as u64 >= fail_from;
            assert_eq!(
                run.data.as_ptr() as usize % BLOCK_BYTES,
                0,
                "a run is block-aligned"
            );
            assert_eq!(run.data.len() % BLOCK_BYTES, 0, "a run is whole blocks");
            if fail {
                *failed = Some(io::Error::other("injected write failure"));
                continue;
            }
            let at = run.first as usize * BLOCK_BYTES;
            self.bytes.lock().unwrap()[at..at + run.data.len()].copy_from_slice(run.data);
            let mut released = self.released.lock().unwrap();
            for b in run.first..run.first + (run.data.len() / BLOCK_BYTES) as u64 {
                released.remove(&b);
            }
        }
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
        *self.release_calls.lock().unwrap() += 1;
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
        .attach_backing(disk.clone(), &KEY, Nonces::Owned)
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
    let mut on_disk = store.written_back_pages();
    on_disk.sort_unstable();
    assert_eq!(on_disk, (0..PAGES).collect::<Vec<_>>());
    assert_eq!(after.compr_data_size, 0);
    assert_eq!(after.pages_stored, PAGES);
    assert_eq!(after.bd_writes, done.blocks);
    // Packed: the blocks hold the objects and their seals, not a block per page; each run
    // (one write) rounds up to whole blocks once.
    let sealed = before.compr_data_size + PAGES * (CHECKSUM_BYTES + SEAL_BYTES) as u64;
    let batches = disk.batches.lock().unwrap().clone();
    let runs: usize = batches.iter().sum();
    assert!(done.blocks >= sealed.div_ceil(BLOCK_BYTES as u64));
    assert!(done.blocks <= sealed.div_ceil(BLOCK_BYTES as u64) + runs as u64);
    assert!(done.blocks < PAGES);
    // Several runs in flight at once: a pass of this size needs more than one.
    assert!(
        done.blocks > RUN_BLOCKS as u64 && batches == [runs],
        "one call, several runs: {batches:?}"
    );
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
    // Not on the I/O path: a write or a discard never waits for the device's release.
    assert!(disk.released.lock().unwrap().is_empty());
    assert_eq!(store.release_freed_blocks(), first.blocks);
    assert_eq!(
        disk.released.lock().unwrap().len() as u64,
        first.blocks,
        "every block the pass wrote was released"
    );
    // Adjacent blocks go in one call: the device saw a few ranges, not a call a block.
    assert!(*disk.release_calls.lock().unwrap() < first.blocks / 4);
    assert_eq!(store.release_freed_blocks(), 0);
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
    // Runs are cut down to what the device can take; the rest stays in RAM.
    let done = store.writeback(idle_pass(u64::MAX)).unwrap();
    let s = store.stats();
    assert!(done.pages > 0 && done.blocks <= 4, "{done:?}");
    assert!(s.bd_writes <= 4 && s.pages_stored == PAGES, "{s:?}");
    assert_eq!(s.bd_count, done.pages);
    reads_back(&store, 0);
    // Full now: a pass finds no place for the smallest run either.
    let err = store.writeback(idle_pass(u64::MAX)).unwrap_err();
    assert!(matches!(err, CoreError::BackingFull { .. }), "{err}");
    reads_back(&store, 0);

    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    disk.fail_writes.store(true, Relaxed);
    assert!(store.writeback(idle_pass(u64::MAX)).is_err());
    assert_eq!(store.stats().bd_count, 0);
    // A failure per run that was written.
    let runs = *disk.batches.lock().unwrap().last().unwrap() as u64;
    assert_eq!(store.stats().bd_failures, runs);
    reads_back(&store, 0);
    disk.fail_writes.store(false, Relaxed);
    assert_eq!(store.writeback(idle_pass(u64::MAX)).unwrap().pages, PAGES);
    reads_back(&store, 0);
}

/// A device whose free blocks come in runs shorter than a full run (blocks freed here and
/// there, or a small device) still takes pages: the runs are cut to fit, and grow again.
#[test]
fn runs_shorten_to_the_free_runs_the_device_has() {
    let disk = MemDisk::new(40);
    let store = backed_store(&disk);
    filled(&store, 0);
    let done = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert!(
        done.blocks >= 32,
        "a device of 40 blocks took {} of them",
        done.blocks
    );
    assert_eq!(store.stats().bd_count, done.pages);
    assert!(
        done.pages < PAGES,
        "the test needs more pages than the device holds"
    );
    reads_back(&store, 0);
    // Freed everywhere, the device takes full runs again.
    store.discard(0, PAGES).unwrap();
    assert_eq!(store.release_freed_blocks(), done.blocks);
    filled(&store, 1);
    let runs_before = disk.batches.lock().unwrap().len();
    let again = store.writeback(idle_pass(16)).unwrap();
    assert_eq!(again.pages, 16);
    let batches = disk.batches.lock().unwrap().len() - runs_before;
    assert!(batches <= 2, "{batches} writes for 16 pages");
    reads_back(&store, 1);
}

/// A device of no blocks (a file that shrank under a taken-over store) refuses every run:
/// the pass fails, the pages stay, nothing panics.
#[test]
fn a_device_of_no_blocks_takes_no_run() {
    let disk = MemDisk::new(0);
    let store = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    store
        .attach_backing(disk.clone(), &KEY, Nonces::Owned)
        .unwrap();
    filled(&store, 0);
    let err = store.writeback(idle_pass(u64::MAX)).unwrap_err();
    assert!(matches!(err, CoreError::BackingFull { .. }), "{err}");
    reads_back(&store, 0);
}

/// A pass whose later write fails keeps what its earlier writes moved, and says so: that
/// room is made, and those pages read back from the disk.
#[test]
fn a_pass_that_fails_part_way_reports_what_it_wrote() {
    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    disk.fail_from_run.store(1, Relaxed);
    let done = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert!(done.pages > 0 && done.pages < PAGES, "{done:?}");
    assert_eq!(store.stats().bd_count, done.pages);
    assert!(store.stats().bd_failures > 0);
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

/// A store in memory that outlives it (as a daemon's shared memory does), its nonce counter
/// kept beside it: [`Kept::kill`] keeps what a SIGKILL leaves, [`Kept::recovered`] takes
/// that over as the next daemon does (as often as asked).
struct Kept {
    memory: KeptMemory,
    nonces: &'static AtomicU64,
    /// Each block's nonce floor, for a device of 1024 blocks.
    floors: &'static [AtomicU64],
}

impl Kept {
    /// A new store, `disk` attached.
    fn new(disk: &Arc<MemDisk>) -> (PageStore, Kept) {
        let kept = Kept {
            memory: KeptMemory::new(StoreConfig::new(PAGES, Algorithm::Lz4), 0),
            nonces: Box::leak(Box::new(AtomicU64::new(0))),
            floors: Box::leak((0..1024).map(|_| AtomicU64::new(0)).collect()),
        };
        let store = kept.memory.store();
        store
            .attach_backing(disk.clone(), &KEY, kept.nonces())
            .unwrap();
        (store, kept)
    }

    /// The kept nonce counter and floors, as a takeover attaches them.
    fn nonces(&self) -> Nonces {
        Nonces::Kept {
            next: self.nonces,
            floors: self.floors,
        }
    }

    /// The memory `store` leaves when its process is killed.
    fn kill(&mut self, store: PageStore) {
        self.memory.kill(store);
    }

    /// A new process's store over that memory (no backing device attached yet).
    fn recovered(&self) -> (PageStore, Recovered) {
        self.memory.recover().unwrap()
    }
}

#[test]
fn a_taken_over_store_reads_its_written_back_pages_with_the_key_and_fails_without_it() {
    let disk = MemDisk::new(1024);
    let (store, mut kept) = Kept::new(&disk);
    let nonces = kept.nonces;
    filled(&store, 0);
    store.writeback(idle_pass(PAGES / 2)).unwrap();
    let used = nonces.load(Relaxed);
    assert_eq!(used, PAGES / 2, "a nonce per object");
    kept.kill(store);
    let recovered = || kept.recovered();

    let (store, found) = recovered();
    assert_eq!(found.pages_stored, PAGES);
    assert_eq!(store.stats().bd_count, PAGES / 2);
    // Before the device is attached, its pages fail; after, they read.
    let mut out = [0u8; PAGE_SIZE];
    assert!(store.read(0, &mut out).is_err() || store.read(PAGES - 1, &mut out).is_err());
    let adopted = store
        .attach_backing(disk.clone(), &KEY, kept.nonces())
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
        .attach_backing(disk.clone(), &WritebackKey([8; KEY_BYTES]), kept.nonces())
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
    let one_block = Nonces::Kept {
        next: nonces,
        floors: Box::leak(Box::new([AtomicU64::new(0)])),
    };
    let err = store
        .attach_backing(MemDisk::new(1), &KEY, one_block)
        .unwrap_err();
    assert!(matches!(err, CoreError::Damaged(_)), "{err}");
    assert!(!store.has_backing());
    // Floors that do not cover the device are refused: they are not this device's.
    let err = store
        .attach_backing(
            disk.clone(),
            &KEY,
            Nonces::Kept {
                next: nonces,
                floors: &kept.floors[..512],
            },
        )
        .unwrap_err();
    assert!(matches!(err, CoreError::Config(_)), "{err}");
    assert!(!store.has_backing());
}

/// The attack the floors stop: someone who can write the backing device keeps a copy of a
/// page's blocks, and after the same page was sealed again at the same place (same index,
/// place and length: the associated data matches) writes the old copy back. The old
/// sealing's tag is good under the key; without the floors the page would read back its
/// old content. In one process, and across a takeover (floors kept as the nonces are).
#[test]
fn a_block_rolled_back_to_an_older_sealing_of_the_same_page_at_the_same_place_fails() {
    // Page 2 is noise: stored raw, so both rounds' objects have the same length.
    let (old, new) = (page(2, 0), page(2, 1));
    let mut out = [0u8; PAGE_SIZE];
    let rolled_back =
        |disk: &MemDisk, copy: &[Vec<u8>], store: &PageStore, out: &mut [u8; PAGE_SIZE]| {
            for (b, data) in copy.iter().enumerate() {
                disk.set_block(b, data);
            }
            let err = store
                .read(2, out)
                .expect_err("the rolled-back block opened");
            assert_eq!(err.errno(), -5, "{err}");
            assert!(format!("{err:?}").contains("rolled back"), "{err:?}");
        };

    // A device of two blocks: the raw page's sealed object needs both, so the second
    // sealing can only go where the first one was.
    let disk = MemDisk::new(2);
    let store = backed_store(&disk);
    store.write(2, &old).unwrap();
    assert_eq!(store.writeback(idle_pass(u64::MAX)).unwrap().blocks, 2);
    let copy = vec![disk.block(0), disk.block(1)];
    store.write(2, &new).unwrap();
    assert_eq!(store.writeback(idle_pass(u64::MAX)).unwrap().blocks, 2);
    assert_ne!(copy[0], disk.block(0), "sealed again under another nonce");
    store.read(2, &mut out).unwrap();
    assert!(out == new);
    rolled_back(&disk, &copy, &store, &mut out);
    assert_eq!(store.stats().bd_failures, 1);

    // Across a takeover: the new daemon's next-fit search starts at block 0 again, where
    // the dead daemon sealed the page.
    let disk = MemDisk::new(1024);
    let (store, mut kept) = Kept::new(&disk);
    store.write(2, &old).unwrap();
    store.writeback(idle_pass(u64::MAX)).unwrap();
    let copy = vec![disk.block(0), disk.block(1)];
    kept.kill(store);
    let (store, _) = kept.recovered();
    store
        .attach_backing(disk.clone(), &KEY, kept.nonces())
        .unwrap();
    store.read(2, &mut out).unwrap();
    assert!(
        out == old,
        "the old sealing is the page's until it is written again"
    );
    store.write(2, &new).unwrap();
    store.writeback(idle_pass(u64::MAX)).unwrap();
    assert_ne!(copy[0], disk.block(0), "sealed again at block 0");
    rolled_back(&disk, &copy, &store, &mut out);
}

#[test]
fn a_taken_over_store_gives_back_the_blocks_no_page_uses() {
    let disk = MemDisk::new(1024);
    let (store, mut kept) = Kept::new(&disk);
    filled(&store, 0);
    let pass = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert_eq!(pass.pages, PAGES);
    // A quarter overwritten, and the daemon killed before its release thread ran.
    for i in 0..PAGES / 4 {
        store.write(i, &page(i, 1)).unwrap();
    }
    kept.kill(store);
    let (store, _) = kept.recovered();
    let adopted = store
        .attach_backing(disk.clone(), &KEY, kept.nonces())
        .unwrap();
    assert_eq!(adopted, PAGES - PAGES / 4);
    // The dead daemon's frees died with it: nothing is marked.
    assert_eq!(store.release_freed_blocks(), 0);
    let unused = store.mark_unused_blocks_for_release();
    assert!(
        unused > 1024 - pass.blocks,
        "{unused} unused blocks: the overwritten quarter's are not among them"
    );
    assert_eq!(store.release_freed_blocks(), unused);
    let released = disk.released.lock().unwrap().clone();
    assert_eq!(released.len() as u64, unused);
    // No block a page still lives in was given back: wiped, every page still reads.
    for &b in &released {
        disk.set_block(b as usize, &[0; BLOCK_BYTES]);
    }
    for i in 0..PAGES {
        let mut out = [0u8; PAGE_SIZE];
        store.read(i, &mut out).unwrap();
        let want = if i < PAGES / 4 {
            page(i, 1)
        } else {
            page(i, 0)
        };
        assert!(out == want, "page {i} read back other data");
    }
    assert_eq!(store.mark_unused_blocks_for_release(), unused);
}

/// After a takeover most of a device can be one run of unused blocks; its blocks are not
/// free while their release is in flight, so a release covers at most 16 MiB.
#[test]
fn a_release_covers_a_bounded_run_of_blocks() {
    let disk = MemDisk::new(9000);
    let store = backed_store(&disk);
    assert_eq!(store.mark_unused_blocks_for_release(), 9000);
    assert_eq!(store.release_freed_blocks(), 9000);
    assert_eq!(disk.released.lock().unwrap().len(), 9000);
    assert_eq!(
        *disk.release_calls.lock().unwrap(),
        3,
        "runs of 4096, 4096 and 808 blocks"
    );
}

/// A page discarded and written again while its object is on its way to disk gets the very
/// handle back from the arena (a raw page has the same length too): the pass must see that
/// the object is another, and leave the new write in RAM.
#[test]
fn a_page_freed_and_written_again_on_the_same_handle_during_writeback_keeps_the_new_write() {
    let disk = MemDisk::new(64);
    let mut cfg = StoreConfig::new(4, Algorithm::Lz4);
    cfg.raw_threshold = 1024;
    let store = Arc::new(PageStore::new(cfg).unwrap());
    store
        .attach_backing(disk.clone(), &KEY, Nonces::Owned)
        .unwrap();
    let (old, new) = (page(2, 0), page(2, 1));
    store.write(0, &old).unwrap();
    assert_eq!(store.stats().huge_pages, 1, "noise is stored raw");
    let racing = store.clone();
    *disk.race.0.lock().unwrap() = Some(Box::new(move || {
        racing.discard(0, 1).unwrap();
        racing.write(0, &new).unwrap();
    }));
    let done = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert_eq!((done.pages, done.raced), (0, 1), "{done:?}");
    assert_eq!(store.stats().bd_count, 0);
    let mut back = [0u8; PAGE_SIZE];
    store.read(0, &mut back).unwrap();
    assert!(
        back == page(2, 1),
        "the discarded page came back in place of the new write"
    );
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

/// A backing device in a file, which gives its descriptor so that reads can be deferred.
#[derive(Debug)]
struct FileDisk {
    file: std::fs::File,
    blocks: u64,
    released: Mutex<BTreeSet<u64>>,
}

impl FileDisk {
    fn new(name: &str, blocks: u64) -> (Arc<Self>, std::path::PathBuf) {
        let path =
            std::env::temp_dir().join(format!("uzram-deferred-{name}-{}.bs", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(blocks * BLOCK_BYTES as u64).unwrap();
        let disk = Arc::new(Self {
            file,
            blocks,
            released: Mutex::new(BTreeSet::new()),
        });
        (disk, path)
    }

    /// What a caller of `read_deferring` does with a [`DiskRead`]: read its blocks itself.
    fn read(&self, read: &DiskRead) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut blocks = vec![0u8; read.bytes()];
        self.file.read_exact_at(&mut blocks, read.offset()).unwrap();
        blocks
    }
}

impl BackingDevice for FileDisk {
    fn blocks(&self) -> u64 {
        self.blocks
    }
    fn write_runs(&self, runs: &[BlockRun<'_>], failed: &mut [Option<io::Error>]) {
        use std::os::unix::fs::FileExt;
        for (run, failed) in runs.iter().zip(failed) {
            if let Err(e) = self
                .file
                .write_all_at(run.data, run.first * BLOCK_BYTES as u64)
            {
                *failed = Some(e);
            }
            let mut released = self.released.lock().unwrap();
            for b in run.first..run.first + (run.data.len() / BLOCK_BYTES) as u64 {
                released.remove(&b);
            }
        }
    }
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(out, first * BLOCK_BYTES as u64)
    }
    fn release(&self, first: u64, count: u64) -> io::Result<()> {
        self.released.lock().unwrap().extend(first..first + count);
        Ok(())
    }
    fn fd(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        Some(self.file.as_raw_fd())
    }
}

/// Reads `first..first + n` deferring every written-back page; returns the deferred reads
/// with their place in the request.
fn read_deferred(
    store: &PageStore,
    first: u64,
    out: &mut [u8],
) -> Result<Vec<(usize, DiskRead)>, CoreError> {
    let mut deferred = Vec::new();
    store.read_deferring(first, out, &mut |i, read| {
        deferred.push((i, read));
        Ok(())
    })?;
    Ok(deferred)
}

#[test]
fn written_back_pages_are_handed_out_read_by_the_caller_and_checked() {
    let (disk, path) = FileDisk::new("handed", 1024);
    let store = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    store
        .attach_backing(disk.clone(), &KEY, Nonces::Owned)
        .unwrap();
    filled(&store, 0);
    // Half the pages go to disk; a request of all of them defers exactly those.
    let done = store.writeback(idle_pass(PAGES / 2)).unwrap();
    assert_eq!(done.pages, PAGES / 2);
    let mut out = vec![0u8; PAGES as usize * PAGE_SIZE];
    let deferred = read_deferred(&store, 0, &mut out).unwrap();
    assert_eq!(deferred.len() as u64, PAGES / 2);
    let reads_before = store.stats().bd_reads;
    for (i, read) in deferred {
        assert_eq!(read.page(), i as u64);
        let mut blocks = disk.read(&read);
        let page_out: &mut [u8; PAGE_SIZE] = (&mut out[i * PAGE_SIZE..(i + 1) * PAGE_SIZE])
            .try_into()
            .unwrap();
        store.finish_disk_read(read, &mut blocks, page_out).unwrap();
    }
    for i in 0..PAGES as usize {
        assert!(
            out[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == page(i as u64, 0),
            "page {i} read back other data"
        );
    }
    assert!(store.stats().bd_reads > reads_before);

    // A read handed out holds its blocks: the page is overwritten and a pass writes it and
    // others back meanwhile, yet the blocks are neither released nor written again, and the
    // read finishes with the page as it was when the read began.
    let mut one = [0u8; PAGE_SIZE];
    let mut deferred = read_deferred(&store, 0, &mut one).unwrap();
    let (_, held) = deferred.pop().expect("page 0 is written back");
    let held_blocks = (held.offset() / BLOCK_BYTES as u64)
        ..(held.offset() + held.bytes() as u64) / BLOCK_BYTES as u64;
    store.write(0, &page(0, 9)).unwrap();
    store.discard(1, PAGES / 2 - 1).unwrap();
    filled(&store, 1);
    store.writeback(idle_pass(u64::MAX)).unwrap();
    store.release_freed_blocks();
    for b in held_blocks.clone() {
        assert!(
            !disk.released.lock().unwrap().contains(&b),
            "held block {b} released"
        );
    }
    let mut blocks = disk.read(&held);
    store.finish_disk_read(held, &mut blocks, &mut one).unwrap();
    assert!(one == page(0, 0), "the held read returned other data");
    // Its blocks are released once the read is done (when no new object shares them).
    let mut out = vec![0u8; PAGES as usize * PAGE_SIZE];
    for (i, read) in read_deferred(&store, 0, &mut out).unwrap() {
        let mut blocks = disk.read(&read);
        let p: &mut [u8; PAGE_SIZE] = (&mut out[i * PAGE_SIZE..(i + 1) * PAGE_SIZE])
            .try_into()
            .unwrap();
        store.finish_disk_read(read, &mut blocks, p).unwrap();
        assert!(*p == page(i as u64, 1), "page {i} after the second pass");
    }

    // A block changed on disk fails the read as an I/O error and a failed check; a
    // cancelled read drops its hold.
    let mut one = [0u8; PAGE_SIZE];
    let (_, read) = read_deferred(&store, 5, &mut one).unwrap().pop().unwrap();
    let mut blocks = disk.read(&read);
    let mid = blocks.len() / 2;
    blocks[mid] ^= 1;
    let failures = store.stats().checksum_failures;
    let err = store
        .finish_disk_read(read, &mut blocks, &mut one)
        .unwrap_err();
    assert_eq!(err.errno(), -5, "{err}");
    assert_eq!(store.stats().checksum_failures, failures + 1);
    let (_, read) = read_deferred(&store, 5, &mut one).unwrap().pop().unwrap();
    store.cancel_disk_read(read);
    store.read(5, &mut one).unwrap();
    assert!(one == page(5, 1));
    drop(store);
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_device_without_a_descriptor_reads_every_page_itself() {
    let disk = MemDisk::new(1024);
    let store = backed_store(&disk);
    filled(&store, 0);
    store.writeback(idle_pass(u64::MAX)).unwrap();
    let mut out = vec![0u8; PAGES as usize * PAGE_SIZE];
    assert!(read_deferred(&store, 0, &mut out).unwrap().is_empty());
    for i in 0..PAGES as usize {
        assert!(out[i * PAGE_SIZE..(i + 1) * PAGE_SIZE] == page(i as u64, 0));
    }
}

/// Staging that is never read here: the pages staged in it only replace others.
struct UnreadStaging;

impl StagedPages for UnreadStaging {
    fn read_staged(&self, _: u64, _: StagedAt, _: &mut [u8; PAGE_SIZE]) -> bool {
        false
    }
}

/// A written-back page overwritten through the GPU's ring (staged) gives its blocks back as
/// an inline write does: before, only its arena object was freed, its blocks stayed in use
/// until a takeover counted them again, and the device filled up for good.
#[test]
fn a_staged_overwrite_of_a_written_back_page_frees_its_blocks() {
    let disk = MemDisk::new(128);
    let store = backed_store(&disk);
    store.attach_staging(Arc::new(UnreadStaging)).unwrap();
    filled(&store, 0);
    let first = store.writeback(idle_pass(u64::MAX)).unwrap();
    assert_eq!(first.pages, PAGES);
    let items: Vec<(u64, StagedAt)> = (0..PAGES)
        .map(|i| (i, StagedAt::new(0, i as usize, 1).unwrap()))
        .collect();
    store.stage_many(&items).unwrap();
    assert_eq!(store.stats().bd_count, 0);
    assert_eq!(
        store.release_freed_blocks(),
        first.blocks,
        "every block the pass wrote is free again"
    );
    // The device holds 128 blocks: a second pass fits only if the first one's were freed.
    filled(&store, 1);
    assert_eq!(store.writeback(idle_pass(u64::MAX)).unwrap().pages, PAGES);
    reads_back(&store, 1);
}

/// A device of more blocks than an entry can address: refused before anything is made for
/// it (an object past 128 TiB would be recorded at another place).
#[test]
fn a_backing_device_past_what_an_entry_addresses_is_refused() {
    #[derive(Debug)]
    struct Huge(u64);
    impl BackingDevice for Huge {
        fn blocks(&self) -> u64 {
            self.0
        }
        fn write_runs(&self, _: &[BlockRun<'_>], _: &mut [Option<io::Error>]) {}
        fn read_blocks(&self, _: u64, _: &mut [u8]) -> io::Result<()> {
            Ok(())
        }
        fn release(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
    }
    let most = (super::entry::MAX_DISK_OFFSET + 1) / BLOCK_BYTES as u64;
    let store = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    let err = store
        .attach_backing(Arc::new(Huge(most + 1)), &KEY, Nonces::Owned)
        .unwrap_err();
    assert!(err.to_string().contains("128 TiB"), "{err}");
}

/// A kept nonce counter that went back to or under a block's floor (damage) is raised past
/// every nonce a run from that floor can have used, before anything is sealed with it.
#[test]
fn a_kept_nonce_counter_under_a_floor_is_raised_past_it() {
    let disk = MemDisk::new(1024);
    let (store, kept) = Kept::new(&disk);
    filled(&store, 0);
    store.writeback(idle_pass(u64::MAX)).unwrap();
    let next = kept.nonces.load(Relaxed);
    let top = kept.floors.iter().map(|f| f.load(Relaxed)).max().unwrap();
    assert!(next > top, "a counter past every floor ({next} > {top})");
    drop(store);
    // Damaged down to the top floor, then taken over.
    kept.nonces.store(top, Relaxed);
    let again = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    again
        .attach_backing(disk.clone(), &KEY, kept.nonces())
        .unwrap();
    assert!(kept.nonces.load(Relaxed) >= top + super::backing::RUN_OBJECTS as u64);
    // An intact counter is left as it was.
    kept.nonces
        .store(next + super::backing::RUN_OBJECTS as u64, Relaxed);
    let third = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    third
        .attach_backing(disk.clone(), &KEY, kept.nonces())
        .unwrap();
    assert_eq!(
        kept.nonces.load(Relaxed),
        next + super::backing::RUN_OBJECTS as u64
    );
}

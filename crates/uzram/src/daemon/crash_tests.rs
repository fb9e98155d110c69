//! A store killed at a random instant is one a new process can serve: a child process writes,
//! discards and compacts a store in shared memory until it is SIGKILLed; a second child takes
//! the store over and checks every page (and the counts the first one carried over). The
//! children are this test binary itself, run with `UZRAM_CRASH_CHILD` set (each needs a
//! process of its own: the pool is process-global).
//!
//! The same with a ring staging the writes (as the GPU backend does) in a staging segment of
//! shared memory, over a slow slot backend so that many pages wait in staging when the kill
//! comes: the second child installs them from there, and not one page is lost. And, where
//! there is a GPU (`scripts/gpu-check` runs it), with the daemon's own GPU backend
//! (`WriteBackend` with `backend = "gpu"`, staging in the store's region). And with a
//! writeback pass running all the while to a backing file: the second child opens the
//! pages the first one wrote back with the key the region kept.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uzram_core::batch::{FaultPlan, HostSlots, Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::store::{Writeback, WritebackCandidates};
use uzram_core::PAGE_SIZE;

use crate::config::{Backend, DeviceConfig, RawDevice};
use crate::control::proto::Stat;
use crate::daemon::backend::{StagingHome, WriteBackend};
use crate::daemon::store;
use crate::memory::pool;
use crate::takeover::staging_segment::StagingSegment;
use crate::takeover::{carry, store_segment};
use crate::ublk::handler::PageWriter;

const PAGES: u64 = 2048;
const ENV: &str = "UZRAM_CRASH_CHILD";
const SHM_ENV: &str = "UZRAM_CRASH_SHM";
const BACKING_ENV: &str = "UZRAM_CRASH_BACKING";

fn config() -> DeviceConfig {
    RawDevice {
        size: format!("{}", PAGES * PAGE_SIZE as u64),
        algorithm: Some("lz4".into()),
        backend: Some("cpu".into()),
        ..RawDevice::default()
    }
    .validate(crate::config::Host::current().expect("MemTotal"))
    .expect("a valid test config")
}

/// The device id the crash tests' stores are made for (no ublk device here has it).
const DEVICE: u32 = (1 << 20) - 5;

/// A fill word that does not fit an entry (so a persistent store must compress it).
fn fill_word(gen: u64) -> u64 {
    0x5a5a_5a5a_5a5a_5a00 | (gen & 0xff)
}

/// Generation `gen` of `page`: its index and generation up front, then compressible bytes
/// that depend on both; every 13th page is filled with a word instead.
fn content(page: u64, gen: u64) -> Vec<u8> {
    if page.is_multiple_of(13) {
        return fill_word(gen).to_le_bytes().repeat(PAGE_SIZE / 8);
    }
    let mut out = Vec::with_capacity(PAGE_SIZE);
    out.extend_from_slice(&page.to_le_bytes());
    out.extend_from_slice(&gen.to_le_bytes());
    let mut x = page.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ gen;
    while out.len() < PAGE_SIZE {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let run = 8 + (x % 24) as usize;
        let byte = (x >> 32) as u8 % 6;
        out.extend(std::iter::repeat_n(byte, run.min(PAGE_SIZE - out.len())));
    }
    out
}

/// `Err` unless `bytes` is what some write or discard of `page` left.
fn check(page: u64, bytes: &[u8]) -> Result<(), String> {
    if bytes.iter().all(|&b| b == 0) {
        return Ok(());
    }
    if page.is_multiple_of(13) {
        let word = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
        let gen = word & 0xff;
        return (word == fill_word(gen) && bytes == content(page, gen).as_slice())
            .then_some(())
            .ok_or_else(|| format!("page {page}: not a fill this test wrote"));
    }
    let got_page = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    let gen = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
    if got_page != page {
        return Err(format!("page {page} holds page {got_page}'s bytes"));
    }
    if bytes != content(page, gen).as_slice() {
        return Err(format!("page {page} generation {gen} is corrupt"));
    }
    Ok(())
}

fn write_retrying(writer: &dyn PageWriter, page: u64, bytes: &[u8]) {
    // The pool may be empty for a moment (the keeper refills it): NoMemory, retried.
    while writer.write_pages(page, bytes).is_err() {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// StagingSegment slots of the ring writer, and pages per slot.
const RING_SLOTS: usize = 4;
const RING_SLOT_PAGES: usize = 64;

/// How a writer child writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// `PageStore::write`.
    Store,
    /// A ring over host slots that take 20 ms a slot, staging in a segment the store's
    /// region records.
    HostRing,
    /// The daemon's GPU backend (`WriteBackend`, staging in the store's region).
    Gpu,
    /// `PageStore::write`, with writeback passes to a backing file beside.
    Writeback,
}

/// Child: writes generations of every page (discarding some) with compaction running
/// beside, forever; prints the segment id first.
fn writer(via: Via) {
    let (store, region) = match store::create(&config(), DEVICE) {
        Ok(made) => made,
        Err(err) => {
            println!("SKIP {err:#}");
            return;
        }
    };
    println!("SHM {}", region.id());
    std::thread::spawn(|| pool::keep(64));
    if via == Via::Writeback {
        let path = std::env::var(BACKING_ENV).expect("UZRAM_CRASH_BACKING");
        let file = super::backing::BackingFile::open(std::path::Path::new(&path), store.pages())
            .expect("the backing file");
        super::backing::attach(&store, &region, Some(std::sync::Arc::new(file)))
            .expect("the backing file attached");
        let cold = store.clone();
        std::thread::spawn(move || loop {
            let pass = Writeback {
                candidates: WritebackCandidates::Idle { min_age: 0 },
                max_pages: 256,
                max_bytes: u64::MAX,
            };
            if let Err(e) = cold.writeback(pass) {
                println!("WRITEBACK FAILED {e}");
            }
            std::thread::sleep(Duration::from_millis(1));
        });
    }
    let gpu = (via == Via::Gpu).then(|| {
        let cfg = config();
        let home = StagingHome::StoreSegment {
            region: &region,
            found: None,
        };
        match WriteBackend::start(store.clone(), Backend::Gpu, &cfg.gpu, None, home) {
            Ok(c) if c.staging_kept() => c,
            Ok(_) => {
                println!("SKIP the GPU backend did not keep its staging in shared memory");
                std::process::exit(0);
            }
            Err(err) => {
                println!("SKIP {err:#}");
                std::process::exit(0);
            }
        }
    });
    let ring = (via == Via::HostRing).then(|| {
        let staging = StagingSegment::create(RING_SLOTS, RING_SLOT_PAGES, false).expect("staging");
        region.set_staging(Some(staging.id()));
        let slow = FaultPlan::slow(Duration::from_millis(20));
        let backend = HostSlots::over(
            Algorithm::Lz4,
            RING_SLOTS,
            RING_SLOT_PAGES,
            staging.inputs(),
            slow,
        )
        .expect("host slots over the staging");
        let cfg = RingConfig {
            books: Some(staging.books()),
            installers: 2,
            ..RingConfig::default()
        };
        Ring::start(store.clone(), Arc::new(backend), cfg).expect("the ring")
    });
    let writer: &dyn PageWriter = match (&ring, &gpu) {
        (Some(ring), _) => ring,
        (_, Some(gpu)) => gpu,
        _ => &*store,
    };
    let write = |page: u64, bytes: &[u8]| write_retrying(writer, page, bytes);
    let compacted = store.clone();
    std::thread::spawn(move || loop {
        compacted.compact();
        std::thread::sleep(Duration::from_millis(2));
    });
    let mut writes = 0;
    // With writeback, every fourth page is written once and left alone (a cold page), so
    // the passes find pages that stay on the backing file until the kill.
    let cold = |page: u64| via == Via::Writeback && page % 4 == 1;
    for gen in 1u64.. {
        for page in 0..PAGES {
            if gen > 1 && cold(page) {
                continue;
            }
            if (page + gen) % 7 == 0 {
                let _ = store.discard(page, 1);
            } else {
                write(page, &content(page, gen));
                writes += 1;
            }
        }
        // What the daemon's carry thread does every second.
        carry::Carry::new(region.carried_counters()).save(&[Stat {
            name: "writes".into(),
            value: writes,
        }]);
        if gen == 2 {
            println!("ROUNDS 2");
        }
    }
}

/// Child: takes the store over and checks every page, then compacts, writes and checks again.
fn verifier(shm: i32) {
    let t = Instant::now();
    let taken = store::recover(&config(), DEVICE, shm, &mut |_| {})
        .expect("the killed writer's store is recoverable");
    println!("RECOVERED in {:?}", t.elapsed());
    let (store, region) = (taken.store, taken.region);
    let backing = std::env::var(BACKING_ENV).ok();
    let floors = region.floors();
    assert_eq!(
        floors.is_some(),
        backing.is_some(),
        "the writer recorded nonce floors exactly when it wrote back"
    );
    let file = backing.as_deref().map(|path| {
        let file = super::backing::BackingFile::reopen(std::path::Path::new(path), store.pages())
            .expect("the backing file of the killed writer");
        std::sync::Arc::new(file)
    });
    super::backing::attach(&store, &region, file)
        .expect("the backing file of the killed writer attached");
    assert_eq!(
        region.floors(),
        floors,
        "the killed writer's nonce floors were taken over, not replaced"
    );
    println!("BACKED {}", store.stats().bd_count);
    // As the daemon does once it serves.
    store.link_adopted_holes();
    assert!(
        region.block_states().is_some(),
        "a new store keeps its blocks' states"
    );
    // What the recovery adopted as in memory is, and what it took as empty is.
    let lies = pool::states_that_lie();
    assert!(lies.is_empty(), "recorded block states that lie: {lies:?}");
    println!(
        "STAGED installed {} lost {}",
        taken.found.settled_pages, taken.found.lost_pages
    );
    // The counts it saved after each round (two at least) are there for the next daemon.
    let carried = carry::Carry::new(region.carried_counters()).load();
    let writes = carried.get("writes").copied().unwrap_or(0);
    // A round writes every page but the discarded seventh (and, with writeback, the
    // second leaves out the cold quarter).
    let second = if backing.is_some() {
        PAGES * 3 / 4
    } else {
        PAGES
    };
    assert!(
        writes >= (PAGES - PAGES / 7 - 1) + (second - PAGES / 7 - 1),
        "carried writes {writes}: {carried:?}"
    );
    // As a recovering daemon: the keeper faults nothing in until the device serves
    // (`pool::hold_refills`). Emptied first, the pool would otherwise refill at once.
    pool::hold_refills();
    let taken: Vec<usize> =
        std::iter::from_fn(|| Some(pool::take_within(Duration::ZERO)).filter(|p| !p.is_null()))
            .map(|p| p as usize)
            .collect();
    std::thread::spawn(|| pool::keep(64));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(pool::free_blocks(), 0, "the keeper refilled while held");
    pool::allow_refills();
    let deadline = Instant::now() + Duration::from_secs(20);
    while pool::free_blocks() < 64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        pool::free_blocks() >= 64,
        "the keeper did not refill once allowed: {} free blocks",
        pool::free_blocks()
    );
    let block = std::alloc::Layout::from_size_align(pool::BLOCK, 4096).unwrap();
    for p in taken {
        // SAFETY: a pool block taken above and used by nobody; the global allocator (the
        // pool's) takes it back with the block layout.
        unsafe { std::alloc::dealloc(p as *mut u8, block) };
    }
    let verify = |what: &str| {
        let mut buf = vec![0u8; PAGE_SIZE];
        for page in 0..PAGES {
            store
                .read(page, &mut buf)
                .unwrap_or_else(|e| panic!("{what}: page {page}: {e}"));
            if let Err(bad) = check(page, &buf) {
                panic!("{what}: {bad}");
            }
        }
    };
    verify("after the crash");
    if let Some(path) = &backing {
        given_back_unused_blocks(&store, std::path::Path::new(path));
        verify("after the unused blocks were given back");
    }
    let held = store.stats().pages_stored;
    assert!(held > PAGES / 2, "only {held} pages survived");
    store.compact();
    verify("after compaction");
    for page in 0..PAGES {
        write_retrying(&*store, page, &content(page, 1_000_000 + page));
    }
    verify("after new writes");
    println!("VERIFIED {held}");
}

/// Child: takes the store over and fails, as a takeover whose start fails after the store
/// was adopted (`serve` returns its error): everything it built is dropped, the store with
/// it. The next process must find the store as the killed writer left it.
fn failed_taker(shm: i32) {
    let taken = store::recover(&config(), DEVICE, shm, &mut |_| {})
        .expect("the killed writer's store is recoverable");
    let held = taken.store.stats().pages_stored;
    drop(taken);
    println!("DROPPED {held}");
}

/// What the release thread of a daemon that took the store over does first: every block of
/// the backing file that no page uses is given back (the killed writer's last frees, and
/// the space the file reserved and nothing was written to), so the file then holds space
/// for the blocks in use at most.
fn given_back_unused_blocks(store: &uzram_core::store::PageStore, path: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    let meta = || std::fs::metadata(path).expect("the backing file");
    let (len, before) = (meta().len(), meta().blocks() * 512);
    let unused = store.mark_unused_blocks_for_release();
    assert!(unused > 0, "every block of the backing file is in use");
    assert_eq!(store.release_freed_blocks(), unused);
    let after = meta().blocks() * 512;
    let in_use = len - unused * uzram_core::store::BLOCK_BYTES as u64;
    // A file's blocks count the filesystem's own (ext4's extent tree, one block here).
    let metadata = 64 * 1024;
    assert!(
        after <= in_use + metadata,
        "the backing file holds {after} bytes after giving {unused} blocks back, more than \
         the {in_use} its used blocks take and {metadata} (before: {before})"
    );
    println!("GAVE BACK {unused} blocks: {before} -> {after} bytes on disk");
}

#[test]
#[ignore = "a child process of crash_at_random_instants_loses_nothing"]
fn crash_child() {
    match std::env::var(ENV).as_deref() {
        Ok("writer" | "earlier-writer") => writer(Via::Store),
        Ok("ring-writer") => writer(Via::HostRing),
        Ok("gpu-writer") => writer(Via::Gpu),
        Ok("wb-writer") => writer(Via::Writeback),
        Ok("failed-taker") => failed_taker(shm_from_env()),
        Ok("verifier") => verifier(shm_from_env()),
        _ => {}
    }
}

/// The killed writer's segment id, as the parent passes it to a child.
fn shm_from_env() -> i32 {
    std::env::var(SHM_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("UZRAM_CRASH_SHM")
}

fn child(mode: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args([
        "--exact",
        "daemon::crash_tests::crash_child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ENV, mode);
    cmd
}

#[test]
fn crash_at_random_instants_loses_nothing() {
    let staged = crash_rounds("writer").staged;
    assert_eq!(staged, (0, 0), "no ring, nothing staged");
}

/// A store a daemon of an earlier release left (layout 7: an empty page's entry 0, a stored
/// page's under tag 3, no marks) is taken over whole: its zero entries are marked empty and
/// its stored entries moved to tag 7 before the table is read, where this release reads
/// either as damage.
#[test]
fn crash_of_an_earlier_releases_daemon_loses_nothing() {
    let staged = crash_rounds("earlier-writer").staged;
    assert_eq!(staged, (0, 0), "no ring, nothing staged");
}

/// Leaves the killed writer's store in segment `shm` as a daemon of an earlier release would.
fn as_an_earlier_release_left_it(shm: i32) {
    let cfg = config();
    let store_cfg = store::store_config(&cfg);
    let algorithm = cfg.algorithm.to_string();
    let expect = store_segment::Expected {
        device: DEVICE,
        pages: store_cfg.pages,
        algorithm: &algorithm,
        checksums: store_cfg.checksums,
    };
    let region = store_segment::StoreSegment::attach(shm, expect).expect("the killed store");
    assert!(
        region.empties_marked(),
        "a store of this release marks its empties"
    );
    region.unmark_empties_for_tests();
    assert!(!region.empties_marked());
    assert!(region.stored_tags_moved(), "a store of this release");
    region.as_layout_7_for_tests(store_cfg.pages);
    let region = store_segment::StoreSegment::attach(shm, expect).expect("a layout 7 store");
    assert!(!region.stored_tags_moved());
    let zeros = region
        .table()
        .iter()
        .filter(|w| w.load(std::sync::atomic::Ordering::Relaxed) == 0)
        .count();
    assert!(zeros > 0, "no empty page to mark");
    let earlier = region
        .table()
        .iter()
        .filter(|w| w.load(std::sync::atomic::Ordering::Relaxed) & 0b111 == 0b011)
        .count();
    assert!(earlier > 0, "no stored page under the earlier tag");
}

#[test]
fn crash_with_pages_in_staging_loses_nothing() {
    let (installed, lost) = crash_rounds("ring-writer").staged;
    eprintln!("staged pages installed by the verifiers: {installed}, lost: {lost}");
    assert_eq!(lost, 0, "staged pages lost");
    if installed != u64::MAX {
        assert!(installed > 0, "no round found a page in staging to install");
    }
}

/// The daemon's GPU backend killed while it writes: its staged pages are installed by the
/// next process. Skips without a GPU.
#[test]
fn crash_on_the_gpu_loses_nothing() {
    if !uzram_gpu::gpu_available() {
        eprintln!("skipping: no GPU here");
        return;
    }
    let (installed, lost) = crash_rounds("gpu-writer").staged;
    eprintln!("staged pages installed by the verifiers: {installed}, lost: {lost}");
    assert_eq!(lost, 0, "staged pages lost");
    if installed != u64::MAX {
        assert!(installed > 0, "no round found a page in staging to install");
    }
}

/// Killed while writeback passes run: every page written back before the kill is read from
/// the backing file by the next process, with the key its region kept.
#[test]
fn crash_during_writeback_loses_nothing() {
    if !crate::sys::is_root() {
        eprintln!("skipping: a backing file must be root's");
        return;
    }
    let rounds = crash_rounds("wb-writer");
    if rounds.staged.0 == u64::MAX {
        return;
    }
    assert!(
        rounds.backed > 0,
        "no round found a page written back to take over"
    );
}

/// What [`crash_rounds`] saw, in all.
struct Rounds {
    /// Staged pages the verifiers installed and lost (`u64::MAX` installed when skipped).
    staged: (u64, u64),
    /// Pages the verifiers found written back.
    backed: u64,
}

/// Three rounds of: start a writer of `mode`, kill it, verify its store in a new process (for
/// `writer`, after a takeover that failed).
fn crash_rounds(mode: &str) -> Rounds {
    let (mut installed, mut lost, mut backed) = (0, 0, 0);
    for (round, delay_ms) in [37u64, 151, 409].into_iter().enumerate() {
        let backing = (mode == "wb-writer").then(|| {
            std::env::temp_dir().join(format!("uzram-crash-{}-{round}.wb", std::process::id()))
        });
        let with_backing = |mut cmd: Command| {
            if let Some(path) = &backing {
                cmd.env(BACKING_ENV, path);
            }
            cmd
        };
        let mut writer = with_backing(child(mode))
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the writer");
        let mut lines = BufReader::new(writer.stdout.take().expect("piped stdout")).lines();
        let mut shm = None;
        for line in lines.by_ref() {
            let line = line.expect("the writer's output");
            // The harness prints "test NAME ... " before the child's first line.
            if let Some((_, reason)) = line.split_once("SKIP ") {
                let _ = writer.wait();
                eprintln!("skipped: no locked shared memory here ({reason})");
                return Rounds {
                    staged: (u64::MAX, 0),
                    backed: 0,
                };
            }
            if let Some((_, id)) = line.split_once("SHM ") {
                shm = id.trim().parse::<i32>().ok();
            }
            if line.contains("ROUNDS") {
                break;
            }
        }
        let Some(shm) = shm else {
            let _ = writer.kill();
            panic!("the writer printed no segment id");
        };
        // Two whole rounds are in; kill it somewhere in the next ones.
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(delay_ms));
        writer.kill().expect("SIGKILL the writer");
        let _ = writer.wait();
        if mode == "earlier-writer" {
            as_an_earlier_release_left_it(shm);
        }
        if mode == "writer" {
            // A takeover that fails first: the verifier must find every page all the same.
            let out = child("failed-taker")
                .env(SHM_ENV, shm.to_string())
                .output()
                .expect("running the failed takeover");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("DROPPED"),
                "round {round}: the failed takeover: {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let out = with_backing(child("verifier"))
            .env(SHM_ENV, shm.to_string())
            .output()
            .expect("running the verifier");
        store_segment::remove(shm);
        if let Some(path) = &backing {
            let _ = std::fs::remove_file(path);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("VERIFIED"),
            "round {round} (killed {:?} after two rounds): {}\n{}",
            t.elapsed(),
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        let counts: Vec<u64> = text
            .lines()
            .find_map(|l| l.split_once("STAGED "))
            .map(|(_, rest)| {
                rest.split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(counts.len(), 2, "round {round}: {text}");
        let took = text
            .lines()
            .find_map(|l| l.split_once("RECOVERED in "))
            .map_or("?", |(_, d)| d.trim());
        eprintln!(
            "{mode} round {round}: recovered in {took}, {} staged pages installed, {} lost",
            counts[0], counts[1]
        );
        installed += counts[0];
        lost += counts[1];
        let found_backed = text
            .lines()
            .find_map(|l| l.split_once("BACKED "))
            .and_then(|(_, n)| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if found_backed > 0 {
            eprintln!("{mode} round {round}: {found_backed} pages were on the backing file");
        }
        backed += found_backed;
    }
    Rounds {
        staged: (installed, lost),
        backed,
    }
}

//! Writeback under pressure: besides the idle age (the tier thread's), the room thread
//! writes pages back when the store nears its `mem-limit` (so writes keep finding room),
//! at once when a write finds it reached (`room.rs`), and when the host is short of memory
//! by its pressure stall information (`/proc/pressure/memory`), all within the day's
//! budget, oldest pages first. It runs at the queue threads' priority: writes wait for it,
//! and at the tier thread's lowest priority a swap hog starved it of the CPU (scenario l).
//!
//! - Past [`LIMIT_HIGH`] of `mem-limit`, the oldest pages go, whatever their age, until the
//!   store holds [`LIMIT_LOW`] of it or nothing more can go.
//! - When tasks stalled on memory for [`PSI_SOME_AVG10`] % or more of the last 10 s, up to
//!   [`PSI_PAGES`] pages unused for [`PSI_MIN_AGE_MINUTES`] go each second.

use std::sync::Arc;
use std::time::Duration;

use uzram_core::store::WritebackCandidates;
use uzram_core::PageStore;

use super::budget::Budget;
use super::room::Room;

/// Share of `mem-limit` (in percent) past which writeback makes room.
pub const LIMIT_HIGH: u64 = 90;
/// Share of `mem-limit` (in percent) it makes room down to.
pub const LIMIT_LOW: u64 = 75;
/// `some avg10` of memory pressure (percent) at which idle-ish pages go.
pub const PSI_SOME_AVG10: f64 = 10.0;
/// The least age of a page written back for pressure (minutes).
pub const PSI_MIN_AGE_MINUTES: u32 = 10;
/// Most pages written back for pressure each second.
pub const PSI_PAGES: u64 = 4096;
/// Pages a pass of [`make_room`] takes at a time.
const ROOM_PASS_PAGES: u64 = 4096;

/// How often the room thread looks at the limit and at memory pressure, when no write asks.
const EVERY: Duration = Duration::from_secs(1);

/// The room thread: every second, or at once when a write asks for room, writes back what
/// `mem-limit` and memory pressure ask for. Never returns.
///
/// It is set up as an I/O-path thread (`memory::io_path_thread`), as the compactor is: its
/// pool takes fail rather than wait. A pass ends in a compaction, which holds every shard's
/// lock; a take that waited there for the pool's refill, which can wait for reclaim, which
/// waits for swap writes to this device, which wait for those locks, would deadlock (the
/// device stalled so in one guest run of scenario l).
pub(super) fn keep_room(store: Arc<PageStore>, budget: Option<Arc<Budget>>, room: Arc<Room>) {
    crate::memory::io_path_thread("uzram-room");
    store.prepare_backing_thread();
    let mut pressure = PressureFile::open();
    loop {
        room_round(&store, budget.as_deref(), &room, EVERY, || {
            pressure.some_avg10()
        });
    }
}

/// One round of the room thread: waits up to `period` for an ask, runs the policy
/// ([`relieve`], with the host's pressure from `psi`) and answers the asks it saw.
fn room_round(
    store: &PageStore,
    budget: Option<&Budget>,
    room: &Room,
    period: Duration,
    psi: impl FnOnce() -> Option<f64>,
) -> Relieved {
    let asked = room.wait(period);
    let urgent = room.pending(asked);
    let done = relieve(store, budget, psi(), urgent, &|| room.answer(asked, true));
    room.answer(asked, done.for_limit > 0);
    if done != Relieved::default() {
        tracing::info!(
            for_limit = done.for_limit,
            for_pressure = done.for_pressure,
            asked = urgent,
            "pages written back for memory"
        );
    }
    done
}

/// `some avg10` of a `/proc/pressure/memory` text.
pub fn some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("avg10="))?
        .parse()
        .ok()
}

/// `/proc/pressure/memory`, opened once and read again from its start each round.
///
/// Why: opening and reading a `/proc` file allocates kernel memory (the file, its seq_file
/// and a page for its text). Under memory exhaustion an allocation of the daemon's (an I/O
/// flusher, whose reclaim can neither swap nor wake the OOM killer) waits in reclaim as long
/// as it takes, and writes at `mem-limit` wait for this thread (in guest runs of scenario l
/// they waited out their 3 s and failed, one after another, for a minute, while the pool
/// keeper sat in reclaim; where this thread sat then was not recorded). A file kept open
/// keeps its buffer, so a read from its start allocates nothing.
pub struct PressureFile {
    file: Option<std::fs::File>,
    text: [u8; 256],
}

impl PressureFile {
    /// Opens it (`None` inside: a kernel built without PSI, whose pressure reads as none).
    pub fn open() -> Self {
        Self {
            file: std::fs::File::open("/proc/pressure/memory").ok(),
            text: [0; 256],
        }
    }

    /// The host's memory pressure now (`None` without PSI or when the read fails).
    pub fn some_avg10(&mut self) -> Option<f64> {
        use std::os::unix::fs::FileExt;
        let n = self.file.as_ref()?.read_at(&mut self.text, 0).ok()?;
        some_avg10(std::str::from_utf8(&self.text[..n]).ok()?)
    }
}

/// What one second of the policy wrote back, in pages, and why.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Relieved {
    /// For `mem-limit`.
    pub for_limit: u64,
    /// For the host's memory pressure.
    pub for_pressure: u64,
}

/// One second of the policy: room under `mem-limit`, then pressure (`psi`: the host's
/// `some avg10`). `asked`: a write found the store at its limit (`room.rs`), so room is made
/// whatever the share.
/// `room_made` runs after each step that brought the store under [`LIMIT_HIGH`] of its
/// limit (writes waiting for room go on then, not after the whole pass down to
/// [`LIMIT_LOW`]).
pub fn relieve(
    store: &PageStore,
    budget: Option<&Budget>,
    psi: Option<f64>,
    asked: bool,
    room_made: &dyn Fn(),
) -> Relieved {
    let mut done = Relieved {
        for_limit: make_room(store, budget, asked, room_made),
        ..Relieved::default()
    };
    if psi.is_some_and(|p| p >= PSI_SOME_AVG10) {
        done.for_pressure = pass(store, budget, PSI_MIN_AGE_MINUTES, PSI_PAGES).unwrap_or(0);
    }
    if done.for_limit + done.for_pressure > 0 {
        store.compact();
    }
    done
}

/// Writes the oldest pages back while the store holds more than [`LIMIT_HIGH`] of its
/// limit (or more than [`LIMIT_LOW`] when `asked`), down to [`LIMIT_LOW`]; returns how many
/// went.
fn make_room(store: &PageStore, budget: Option<&Budget>, asked: bool, room_made: &dyn Fn()) -> u64 {
    let now = store.stats();
    let limit = now.mem_limit;
    let high = if asked { LIMIT_LOW } else { LIMIT_HIGH };
    if limit == 0 || store.limited_bytes() * 100 <= limit * high {
        return 0;
    }
    let mut pages = 0;
    loop {
        let s = store.stats();
        let target = limit / 100 * LIMIT_LOW;
        let held = store.limited_bytes();
        if held <= target {
            break;
        }
        // About as many pages as hold the excess (their mean size in RAM), a few more for
        // what compaction cannot give back at once.
        let in_ram = s
            .pages_stored
            .saturating_sub(s.same_pages + s.bd_count + s.staged_pages)
            .max(1);
        let mean = (s.compr_data_size / in_ram).max(1);
        let want = ((held - target) / mean + 16).min(ROOM_PASS_PAGES);
        match pass(store, budget, 0, want) {
            Some(0) | None => break,
            Some(n) => pages += n,
        }
        // The objects' room is holes until compaction gives their segments back.
        store.compact();
        if store.limited_bytes() * 100 <= limit * LIMIT_HIGH {
            room_made();
        }
    }
    pages
}

/// One writeback pass of up to `max_pages` pages unused for `min_age` minutes, within the
/// budget; `None` when it failed (logged).
fn pass(store: &PageStore, budget: Option<&Budget>, min_age: u32, max_pages: u64) -> Option<u64> {
    let candidates = WritebackCandidates::Idle { min_age };
    match super::budget::budgeted_writeback(store, budget, candidates, max_pages) {
        Ok(d) => Some(d.pages),
        Err(error) => {
            tracing::warn!(%error, "writeback for memory failed; the pages stay in RAM");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use uzram_core::PAGE_SIZE;

    #[test]
    fn pressure_is_read_from_the_some_line() {
        let text = "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\n\
                    full avg10=99.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(some_avg10(text), Some(12.5));
        assert_eq!(some_avg10("full avg10=1.00\n"), None);
        assert_eq!(some_avg10("some avg10=x\n"), None);
    }

    #[test]
    fn the_pressure_file_is_read_again_from_its_start() {
        let mut psi = PressureFile::open();
        if psi.file.is_none() {
            println!("SKIP: this kernel has no /proc/pressure/memory (PSI)");
            return;
        }
        for _ in 0..3 {
            let now = psi.some_avg10();
            assert!(now.is_some_and(|p| (0.0..=100.0).contains(&p)), "{now:?}");
        }
    }

    fn page(i: u64) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_SIZE];
        let mut x = i | 1;
        for (k, c) in p.chunks_exact_mut(8).enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let w = if k % 4 == 0 { x } else { i };
            c.copy_from_slice(&w.to_le_bytes());
        }
        p
    }

    fn scratch_dir(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("uzram-pressure-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes through the daemon's backend at a limit a quarter of what they take: with the
    /// room thread's rounds answering every write that finds the limit, each succeeds and
    /// every page reads back; without room, the same writes hit the limit (ENOMEM).
    #[test]
    fn a_write_at_the_limit_gets_room_by_writeback_instead_of_failing() {
        if !crate::sys::is_root() {
            println!("SKIP: a backing file must be root's");
            return;
        }
        use crate::config::{Backend, GpuSettings};
        use crate::daemon::backend::{StagingHome, WriteBackend};
        use crate::daemon::room::Room;
        use crate::ublk::handler::{handle, Op};

        let dir = scratch_dir("room");
        let pages = 4096u64;
        let probe = super::super::backing::file_backed_store(&dir, pages, None);
        for i in 0..pages {
            probe.write(i, &page(i)).unwrap();
        }
        let limit = probe.stats().mem_used_total / 4;
        drop(probe);
        let request = 16usize; // pages a request, as a 64 KiB swap write
        let write_all = |store: &Arc<PageStore>, backend: &WriteBackend| -> Vec<i32> {
            (0..pages)
                .step_by(request)
                .map(|first| {
                    let mut buf: Vec<u8> = (first..first + request as u64).flat_map(page).collect();
                    let sectors = (buf.len() / 512) as u32;
                    handle(Op::Write, first * 8, sectors, &mut buf, store, backend)
                })
                .collect()
        };
        let store = Arc::new(super::super::backing::file_backed_store(
            &dir,
            pages,
            Some(limit),
        ));
        let start = |store: &Arc<PageStore>| {
            WriteBackend::start(
                store.clone(),
                Backend::Cpu,
                &GpuSettings::default(),
                None,
                StagingHome::Scratch,
            )
            .unwrap()
        };
        let mut backend = start(&store);
        let room = Arc::new(Room::default());
        backend.make_room_with(room.clone());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rounds = {
            let (store, room, stop) = (store.clone(), room.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut passes = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let period = std::time::Duration::from_millis(20);
                    let done = room_round(&store, None, &room, period, || None);
                    passes += u64::from(done.for_limit > 0);
                }
                passes
            })
        };
        let results = write_all(&store, &backend);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let passes = rounds.join().unwrap();
        let bytes = (request * PAGE_SIZE) as i32;
        assert!(results.iter().all(|&r| r == bytes), "{results:?}");
        assert!(passes > 0, "no pass wrote anything back");
        let s = store.stats();
        assert!(s.bd_count > 0 && s.mem_used_total <= limit, "{s:?}");
        let mut back = vec![0u8; PAGE_SIZE];
        for i in 0..pages {
            store.read(i, &mut back).unwrap();
            assert_eq!(back, page(i), "page {i}");
        }
        drop((backend, store));

        // Without room, the same writes hit the limit.
        let _ = std::fs::remove_file(dir.join("wb"));
        let store = Arc::new(super::super::backing::file_backed_store(
            &dir,
            pages,
            Some(limit),
        ));
        let backend = start(&store);
        let results = write_all(&store, &backend);
        assert!(results.contains(&-libc::ENOMEM), "{results:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A store filled to past [`LIMIT_HIGH`] of its limit gets back to [`LIMIT_LOW`] in one
    /// call, by about the pages the excess takes; every page still reads back, and without
    /// a limit nothing moves.
    #[test]
    fn past_the_high_share_of_the_limit_the_oldest_pages_go_down_to_the_low_share() {
        if !crate::sys::is_root() {
            println!("SKIP: a backing file must be root's");
            return;
        }
        let dir = scratch_dir("high");
        let pages = 2048u64;
        let fill =
            |limit: Option<u64>| super::super::backing::file_backed_store(&dir, pages, limit);
        // How much the pages take, then a limit they fill to 95 %.
        let probe = fill(None);
        for i in 0..pages {
            probe.write(i, &page(i)).unwrap();
        }
        assert_eq!(
            relieve(&probe, None, Some(0.0), false, &|| {}),
            Relieved::default()
        );
        let limit = probe.stats().mem_used_total * 100 / 95;
        drop(probe);
        let store = fill(Some(limit));
        for i in 0..pages {
            store.write(i, &page(i)).unwrap();
        }
        let before = store.stats().mem_used_total;
        assert!(before * 100 > limit * LIMIT_HIGH, "{before} of {limit}");
        let done = relieve(&store, None, None, false, &|| {});
        let after = store.stats().mem_used_total;
        assert!(done.for_limit > 0, "{done:?}");
        assert!(
            after * 100 <= limit * LIMIT_LOW,
            "{after} of {limit} after {done:?}"
        );
        let mut back = vec![0u8; PAGE_SIZE];
        for i in 0..pages {
            store.read(i, &mut back).unwrap();
            assert_eq!(back, page(i), "page {i}");
        }
        // Below the high share, nothing more goes.
        assert_eq!(relieve(&store, None, None, false, &|| {}).for_limit, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! [`Ring`]: written pages go once into a leased slot of a [`SlotBackend`]'s staging
//! memory, whole slots are submitted, and a small pool of installer threads puts the
//! results into the store while other slots are on the device.
//!
//! A slot goes Free → Filling (writers copy pages in; each page's entry says staged at
//! slot, index, epoch) → Sealed (full, or its first page waited `max_delay`) → Busy
//! (submitted, or failed and waiting for the CPU) → installed → Free. Nothing drains:
//! slots are filled, submitted and installed independently.
//!
//! - **One copy in.** A write copies each page (that is not same-filled) into the slot and
//!   completes; reads of a staged page copy it back out of the slot.
//! - **Bounded waits, no loss.** When every slot is busy, a writer waits at most
//!   `slot_wait` for one to be freed (once, until a slot is freed again, if none was);
//!   then, or when the backend was retired, it compresses inline on the CPU (counted). A
//!   slot the backend fails on is compressed on the CPU by an installer. A slot is only
//!   freed once every page in it was installed or found stale, so the staged copy is
//!   always there while an entry names it.
//! - **Trust, then verify.** Each writer records the checksum of every page it stages
//!   (with the store's checksums on). The backend proves its blocks (a GPU decodes and
//!   compares them on the device) and reports the checksum of each page as it read it; a
//!   page it rejects goes to the CPU. Every result's checksum is compared with the
//!   writer's before the result is installed: a mismatch (the backend compressed other
//!   bytes than were staged) sends the page to the CPU and retires the backend. The
//!   installed page carries the writer's checksum, so every later read is held to the
//!   bytes the kernel wrote. On top, every `spot_check_every`-th compressed page is
//!   decoded on the CPU before it is installed, which catches a backend whose own check
//!   lies; a mismatch retires the backend. So does a result that breaks the layout's
//!   contract, a sticky failure, or `max_failures` failures in a row: one log line, then
//!   the CPU from that point on.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::staging::{book_words, read_checked, Books, Words, NO_PAGE};
use super::{BackendError, BackendMemory, FailureKind, PageResult, SlotBackend, SlotOutput};
use crate::codec::PageCodec;
use crate::page::{
    page_checksum, page_to_words_streaming, same_filled_word, stream_fence, words_to_page,
    PAGE_SIZE, PAGE_WORDS,
};
use crate::store::{
    Commit, CommitState, Encoded, PageStore, StagedAt, StagedPages, Ticket, MAX_SLOT_PAGES,
    MAX_STAGING_SLOTS,
};
use crate::CoreError;

/// Called first thing on every thread the ring starts, with the thread's name (the daemon
/// uses it to make installer threads as careful about memory as queue threads).
pub type ThreadHook = Arc<dyn Fn(&str) + Send + Sync>;

/// How a [`Ring`] runs.
#[derive(Clone)]
pub struct RingConfig {
    /// Longest the first page of a partly filled slot waits before the slot is submitted.
    pub max_delay: Duration,
    /// Longest a writer that finds every slot busy waits for one to be freed before it
    /// compresses its pages inline. Compressing inline costs the CPU several times what the
    /// slot path does; a short wait while the installers catch up costs nothing. A wait
    /// that ends with no slot freed marks the ring stalled, and writers compress inline at
    /// once until a slot is freed again (a wedged device slows each writer once, not every
    /// write). Zero: never wait.
    pub slot_wait: Duration,
    /// Installer threads.
    pub installers: usize,
    /// Decode every n-th compressed page on the CPU before installing it (0: never).
    pub spot_check_every: u64,
    /// Backend failures in a row after which the backend is retired.
    pub max_failures: u32,
    /// Run on every thread the ring starts.
    pub on_thread_start: Option<ThreadHook>,
    /// Where the slots' books live ([`super::book_words`] words): `None`, in the ring; or
    /// in memory the caller keeps beyond the process, which (with a backend whose inputs
    /// are kept too) lets a later process recover the pages staged when this one died
    /// ([`super::StagedCopy`]). The caller must have recovered them before: the ring
    /// starts by forgetting every page the books name.
    pub books: Option<&'static [AtomicU64]>,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            max_delay: Duration::from_millis(2),
            slot_wait: Duration::from_millis(2),
            installers: 4,
            spot_check_every: 64,
            max_failures: 8,
            on_thread_start: None,
            books: None,
        }
    }
}

impl std::fmt::Debug for RingConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingConfig")
            .field("max_delay", &self.max_delay)
            .field("installers", &self.installers)
            .field("spot_check_every", &self.spot_check_every)
            .field("max_failures", &self.max_failures)
            .field("kept_books", &self.books.is_some())
            .finish_non_exhaustive()
    }
}

/// Counters of a [`Ring`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Pages copied into slots.
    pub staged_pages: u64,
    /// Pages the writers found same-filled (stored at once, never staged).
    pub same_filled_pages: u64,
    /// Pages compressed inline because every slot was busy.
    pub overflow_pages: u64,
    /// Times a writer found every slot busy and waited for one ([`RingConfig::slot_wait`]).
    pub slot_waits: u64,
    /// Waits that ended with no slot freed (the ring then counts as stalled).
    pub slot_wait_timeouts: u64,
    /// Pages compressed inline because the backend was retired.
    pub retired_pages: u64,
    /// Slots handed to the backend.
    pub slots_submitted: u64,
    /// Slots whose results were installed (from the backend or the CPU).
    pub slots_installed: u64,
    /// Pages whose result was installed.
    pub installed_pages: u64,
    /// Results dropped because the page changed meanwhile.
    pub stale_pages: u64,
    /// Pages the backend's own check rejected (compressed on the CPU instead).
    pub rejected_pages: u64,
    /// Slots compressed on the CPU because the backend failed them.
    pub fallback_slots: u64,
    /// Pages compressed on the CPU by installers (rejected, failed or contract-breaking).
    pub cpu_pages: u64,
    /// Backend results whose checksum was compared with their writer's before install.
    pub checksum_checked_pages: u64,
    /// Backend results whose checksum was not their writer's (compressed on the CPU
    /// instead; the backend was retired).
    pub checksum_mismatches: u64,
    /// Compressed pages decoded on the CPU before install.
    pub spot_checked_pages: u64,
    /// Spot checks whose decode differed from the page.
    pub spot_check_failures: u64,
    /// Results that broke the layout's contract.
    pub contract_violations: u64,
    /// Failed submissions and completions.
    pub backend_failures: u64,
    /// 1 once the backend is retired.
    pub retired: u64,
    /// Installs retried because the allocator had no memory.
    pub commit_retries: u64,
    /// Time installer threads spent on slots (waiting for the device included), µs.
    pub install_busy_us: u64,
    /// Slots not free right now.
    pub busy_slots: u64,
    /// Where the slots' time went, summed over every slot, µs: what bounds a ring whose
    /// backend is faster than its writers or installers.
    pub slot_us: SlotTimes,
}

/// Time slots spent in each step of their cycle, summed over slots, µs. The step a slot
/// is in now is not counted until it ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotTimes {
    /// Free, waiting for a writer to open it.
    pub free: u64,
    /// Open, taking pages, until full or its delay was up.
    pub filling: u64,
    /// Sealed, until its last writer finished copying in.
    pub sealed: u64,
    /// In the backend's `submit` (on the last writer's thread).
    pub submitting: u64,
    /// Submitted, waiting for an installer.
    pub queued: u64,
    /// An installer waiting for the backend's results.
    pub device: u64,
    /// Results (or the CPU's) being installed, until the slot is freed.
    pub installing: u64,
}

/// The steps of [`SlotTimes`], as indices of [`Counters::slot_ns`].
#[derive(Debug, Clone, Copy)]
enum Step {
    Free,
    Filling,
    Sealed,
    Submitting,
    Queued,
    Device,
    Installing,
}

/// How many [`Step`]s there are.
const STEPS: usize = Step::Installing as usize + 1;

impl RingStats {
    /// `(name, value)` pairs for `uzram status`.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("ring_staged_pages", self.staged_pages),
            ("ring_same_filled_pages", self.same_filled_pages),
            ("ring_overflow_pages", self.overflow_pages),
            ("ring_slot_waits", self.slot_waits),
            ("ring_slot_wait_timeouts", self.slot_wait_timeouts),
            ("ring_retired_pages", self.retired_pages),
            ("ring_slots_submitted", self.slots_submitted),
            ("ring_slots_installed", self.slots_installed),
            ("ring_installed_pages", self.installed_pages),
            ("ring_stale_pages", self.stale_pages),
            ("ring_rejected_pages", self.rejected_pages),
            ("ring_fallback_slots", self.fallback_slots),
            ("ring_cpu_pages", self.cpu_pages),
            ("ring_checksum_checked_pages", self.checksum_checked_pages),
            ("ring_checksum_mismatches", self.checksum_mismatches),
            ("ring_spot_checked_pages", self.spot_checked_pages),
            ("ring_spot_check_failures", self.spot_check_failures),
            ("ring_contract_violations", self.contract_violations),
            ("ring_backend_failures", self.backend_failures),
            ("ring_backend_retired", self.retired),
            ("ring_commit_retries", self.commit_retries),
            ("ring_install_busy_us", self.install_busy_us),
            ("ring_busy_slots", self.busy_slots),
            ("ring_slot_free_us", self.slot_us.free),
            ("ring_slot_filling_us", self.slot_us.filling),
            ("ring_slot_sealed_us", self.slot_us.sealed),
            ("ring_slot_submitting_us", self.slot_us.submitting),
            ("ring_slot_queued_us", self.slot_us.queued),
            ("ring_slot_device_us", self.slot_us.device),
            ("ring_slot_installing_us", self.slot_us.installing),
        ]
    }
}

#[derive(Debug, Default)]
struct Counters {
    staged_pages: AtomicU64,
    same_filled_pages: AtomicU64,
    overflow_pages: AtomicU64,
    slot_waits: AtomicU64,
    slot_wait_timeouts: AtomicU64,
    retired_pages: AtomicU64,
    slots_submitted: AtomicU64,
    slots_installed: AtomicU64,
    installed_pages: AtomicU64,
    stale_pages: AtomicU64,
    rejected_pages: AtomicU64,
    fallback_slots: AtomicU64,
    cpu_pages: AtomicU64,
    checksum_checked_pages: AtomicU64,
    checksum_mismatches: AtomicU64,
    spot_checked_pages: AtomicU64,
    spot_check_failures: AtomicU64,
    contract_violations: AtomicU64,
    backend_failures: AtomicU64,
    commit_retries: AtomicU64,
    install_busy_ns: AtomicU64,
    slot_ns: [AtomicU64; STEPS],
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Most pages an installer commits at a time.
const CHUNK: usize = 1024;
/// Page buffers of an installer, for pages it compresses itself (the backend could not, or
/// its result was refused): a chunk ends early when they are used up. Pages the backend
/// found incompressible need none: they are stored from their staged words.
const BUFS: usize = 256;
/// Most pages of one request a writer handles at a time.
const RUN: usize = 64;

/// The staging memory as the store reads it: the backend's inputs, checked against the
/// books. Shared by the ring and the store (it holds no reference to either).
struct Staging {
    backend: Arc<dyn SlotBackend>,
    books: Words,
    slots: usize,
    slot_pages: usize,
    /// Writers record checksums and copies are held to them (the store's setting).
    checksums: bool,
}

impl Staging {
    fn books(&self) -> Books<'_> {
        Books::new(&self.books, self.slots, self.slot_pages)
    }

    fn words(&self, slot: usize, index: usize) -> Option<&[AtomicU64]> {
        self.backend
            .input(slot)
            .get(index * PAGE_WORDS..(index + 1) * PAGE_WORDS)
    }

    /// The ticket of the page staged at `index` of `slot` in its current fill, if any.
    fn ticket(&self, slot: usize, index: usize) -> Option<Ticket> {
        self.books().ticket(slot, index)
    }
}

impl StagedPages for Staging {
    fn read_staged(&self, page: u64, at: StagedAt, out: &mut [u8; PAGE_SIZE]) -> bool {
        read_checked(
            &self.books(),
            self.backend.input(at.slot()),
            Ticket { page, at },
            self.checksums,
            out,
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    Filling,
    /// Full or timed out; submitted once its last writer is done.
    Sealed,
    /// Submitted or failed, until its results are installed.
    Busy,
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    phase: Phase,
    filled: usize,
    writers: u32,
}

/// A slot an installer takes on.
#[derive(Debug, Clone, Copy)]
struct Job {
    slot: usize,
    pages: usize,
    /// Submitted: install the backend's results. Otherwise compress the pages on the CPU.
    submitted: bool,
}

#[derive(Debug)]
struct State {
    open: Option<usize>,
    /// When the open slot took its first page.
    opened: Option<Instant>,
    free: Vec<usize>,
    slots: Vec<SlotState>,
    queue: VecDeque<Job>,
    stop: bool,
    /// A writer's wait for a free slot ended with none freed; cleared when one is.
    stalled: bool,
}

/// Pages `base..base + count` of `slot`, leased to one writer.
struct Lease {
    slot: usize,
    base: usize,
    count: usize,
    epoch: u64,
}

struct Shared {
    store: Arc<PageStore>,
    staging: Arc<Staging>,
    cfg: RingConfig,
    slot_pages: usize,
    limit: usize,
    state: Mutex<State>,
    /// Installers: a slot to install, an open slot to time, or stop.
    work: Condvar,
    /// Flushers: a slot was freed.
    idle: Condvar,
    retired: AtomicBool,
    /// No more leases: writes are compressed inline while the slots empty ([`Ring::drain`]).
    draining: AtomicBool,
    failures_in_row: AtomicU32,
    counters: Counters,
    /// When the ring started: slot marks count from here.
    started: Instant,
    /// Per slot, when its current step began (ns after `started`).
    slot_marks: Vec<AtomicU64>,
}

/// Stages writes into a [`SlotBackend`] and installs the results; see the module docs.
pub struct Ring {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("backend", &self.shared.staging.backend.name())
            .field("slots", &self.shared.staging.slots)
            .field("slot_pages", &self.shared.slot_pages)
            .field("cfg", &self.shared.cfg)
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// Attaches `backend`'s staging to `store` and starts the installer threads.
    pub fn start(
        store: Arc<PageStore>,
        backend: Arc<dyn SlotBackend>,
        cfg: RingConfig,
    ) -> Result<Self, CoreError> {
        let slots = backend.slots();
        let slot_pages = backend.slot_pages();
        if backend.algorithm() != store.algorithm() {
            return Err(CoreError::Config(format!(
                "the {} backend produces {}, the store holds {}",
                backend.name(),
                backend.algorithm(),
                store.algorithm()
            )));
        }
        if !(1..=MAX_STAGING_SLOTS).contains(&slots)
            || !(1..=MAX_SLOT_PAGES).contains(&slot_pages)
            || (0..slots).any(|s| backend.input(s).len() != slot_pages * PAGE_WORDS)
        {
            return Err(CoreError::Config(format!(
                "a ring needs 1..={MAX_STAGING_SLOTS} slots of 1..={MAX_SLOT_PAGES} pages \
                 with whole inputs; the {} backend has {slots} of {slot_pages}",
                backend.name()
            )));
        }
        if cfg.installers == 0 {
            return Err(CoreError::Config("a ring needs an installer thread".into()));
        }
        let books = match cfg.books {
            Some(kept) if kept.len() == book_words(slots, slot_pages) => Words::Kept(kept),
            Some(kept) => {
                return Err(CoreError::Config(format!(
                    "{} words of books for {slots} slots of {slot_pages} pages; they need {}",
                    kept.len(),
                    book_words(slots, slot_pages)
                )))
            }
            None => Words::zeroed(book_words(slots, slot_pages)),
        };
        let staging = Arc::new(Staging {
            backend,
            books,
            slots,
            slot_pages,
            checksums: store.checksums(),
        });
        staging.books().clear_pages();
        store.attach_staging(staging.clone())?;
        let shared = Arc::new(Shared {
            limit: store.raw_threshold(),
            store,
            staging,
            slot_pages,
            state: Mutex::new(State {
                open: None,
                opened: None,
                free: (0..slots).rev().collect(),
                slots: vec![
                    SlotState {
                        phase: Phase::Free,
                        filled: 0,
                        writers: 0,
                    };
                    slots
                ],
                queue: VecDeque::with_capacity(slots),
                stop: false,
                stalled: false,
            }),
            work: Condvar::new(),
            idle: Condvar::new(),
            retired: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            failures_in_row: AtomicU32::new(0),
            counters: Counters::default(),
            started: Instant::now(),
            slot_marks: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            cfg,
        });
        let mut ring = Ring {
            shared,
            threads: Vec::new(),
        };
        for n in 0..ring.shared.cfg.installers {
            let name = format!("uzram-install-{n}");
            let sh = Arc::clone(&ring.shared);
            let thread_name = name.clone();
            // Everything an installer holds is allocated here, before it serves.
            let tools = Tools::new(ring.shared.store.algorithm())?;
            let spawned = std::thread::Builder::new()
                .name(name.clone())
                .stack_size(256 << 10)
                .spawn(move || {
                    if let Some(hook) = &sh.cfg.on_thread_start {
                        hook(&thread_name);
                    }
                    installer_loop(&sh, tools);
                });
            match spawned {
                Ok(t) => ring.threads.push(t),
                // Dropping `ring` stops the installers already started.
                Err(e) => return Err(CoreError::Config(format!("cannot start {name}: {e}"))),
            }
        }
        Ok(ring)
    }

    /// Writes whole pages starting at `first_page`: same-filled pages are stored at once,
    /// the others are copied into slots (or compressed inline when no slot is free or the
    /// backend is retired). When this returns every page is readable with its new content.
    /// On an error some pages may hold their new content and the others their old one.
    pub fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let sh = &*self.shared;
        if data.len() % PAGE_SIZE != 0 {
            return Err(CoreError::Unaligned { len: data.len() });
        }
        let n = (data.len() / PAGE_SIZE) as u64;
        let pages = sh.store.pages();
        if !first_page.checked_add(n).is_some_and(|end| end <= pages) {
            return Err(CoreError::OutOfRange {
                first: first_page,
                end: first_page.saturating_add(n),
                pages,
            });
        }
        if sh.retired.load(Ordering::Relaxed) {
            bump(&sh.counters.retired_pages, n);
            return sh.store.write(first_page, data);
        }
        let mut run = [(0u64, 0usize); RUN];
        let mut len = 0;
        for (i, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let page: &[u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            let index = first_page + i as u64;
            if let Some(word) = same_filled_word(page) {
                sh.store.write_same_filled(index, word)?;
                bump(&sh.counters.same_filled_pages, 1);
                continue;
            }
            run[len] = (index, i * PAGE_SIZE);
            len += 1;
            if len == RUN {
                sh.stage_run(&run[..len], data)?;
                len = 0;
            }
        }
        sh.stage_run(&run[..len], data)
    }

    /// Waits until every page written before this call has been installed (submitting a
    /// partly filled slot at once instead of after its delay).
    pub fn flush(&self) {
        self.flush_within(Duration::MAX);
    }

    /// [`Ring::flush`], giving up after `within`.
    fn flush_within(&self, within: Duration) {
        let start = Instant::now();
        let sh = &*self.shared;
        let mut st = sh.lock();
        let mut submit = None;
        if let Some(slot) = st.open {
            if st.slots[slot].filled > 0 {
                submit = sh.seal(&mut st, slot).map(|pages| (slot, pages));
            }
        }
        let epochs: Vec<(usize, u64)> = st
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.phase != Phase::Free && s.filled > 0)
            .map(|(i, _)| (i, sh.epoch(i)))
            .collect();
        drop(st);
        if let Some((slot, pages)) = submit {
            sh.submit(slot, pages);
        }
        let mut st = sh.lock();
        while epochs
            .iter()
            .any(|&(s, e)| st.slots[s].phase != Phase::Free && sh.epoch(s) == e)
            && start.elapsed() < within
        {
            st = sh
                .idle
                .wait_timeout(st, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> RingStats {
        let sh = &*self.shared;
        let c = &sh.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let busy = sh
            .lock()
            .slots
            .iter()
            .filter(|s| s.phase != Phase::Free)
            .count();
        RingStats {
            staged_pages: g(&c.staged_pages),
            same_filled_pages: g(&c.same_filled_pages),
            overflow_pages: g(&c.overflow_pages),
            slot_waits: g(&c.slot_waits),
            slot_wait_timeouts: g(&c.slot_wait_timeouts),
            retired_pages: g(&c.retired_pages),
            slots_submitted: g(&c.slots_submitted),
            slots_installed: g(&c.slots_installed),
            installed_pages: g(&c.installed_pages),
            stale_pages: g(&c.stale_pages),
            rejected_pages: g(&c.rejected_pages),
            fallback_slots: g(&c.fallback_slots),
            cpu_pages: g(&c.cpu_pages),
            checksum_checked_pages: g(&c.checksum_checked_pages),
            checksum_mismatches: g(&c.checksum_mismatches),
            spot_checked_pages: g(&c.spot_checked_pages),
            spot_check_failures: g(&c.spot_check_failures),
            contract_violations: g(&c.contract_violations),
            backend_failures: g(&c.backend_failures),
            retired: u64::from(sh.retired.load(Ordering::Relaxed)),
            commit_retries: g(&c.commit_retries),
            install_busy_us: g(&c.install_busy_ns) / 1000,
            busy_slots: busy as u64,
            slot_us: {
                let us = |step: Step| g(&c.slot_ns[step as usize]) / 1000;
                SlotTimes {
                    free: us(Step::Free),
                    filling: us(Step::Filling),
                    sealed: us(Step::Sealed),
                    submitting: us(Step::Submitting),
                    queued: us(Step::Queued),
                    device: us(Step::Device),
                    installing: us(Step::Installing),
                }
            },
        }
    }

    /// The backend's counters.
    pub fn backend_stats(&self) -> Vec<(&'static str, u64)> {
        self.shared.staging.backend.stats()
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.shared.staging.backend.name()
    }

    /// Memory the ring holds besides the store: the backend's slots and the installers'
    /// page buffers. Fixed from the start.
    pub fn memory(&self) -> BackendMemory {
        let mut m = self.shared.staging.backend.memory();
        m.host_bytes += (self.shared.cfg.installers * BUFS * PAGE_SIZE) as u64
            + (self.shared.staging.books.len() * 8) as u64;
        m
    }

    /// Stops staging and installs everything staged, so that no page lives only in this
    /// process's staging memory (a handover: the next daemon cannot read it). Writes from
    /// then on are compressed inline on the CPU (counted as overflow); slots already
    /// submitted finish on the backend. Leases taken before the call are filled, submitted
    /// and installed. False when slots still held pages after `within` (a hung device).
    pub fn drain(&self, within: Duration) -> bool {
        let sh = &*self.shared;
        sh.draining.store(true, Ordering::Release);
        let start = Instant::now();
        loop {
            if start.elapsed() > within {
                return false;
            }
            self.flush_within(within.saturating_sub(start.elapsed()));
            let st = sh.lock();
            if st
                .slots
                .iter()
                .all(|s| s.phase == Phase::Free || (s.filled == 0 && s.writers == 0))
            {
                return true;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// True once the backend was retired (every write is compressed on the CPU).
    pub fn is_retired(&self) -> bool {
        self.shared.retired.load(Ordering::Relaxed)
    }

    /// Installs everything staged, then stops the installer threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        self.flush();
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::error!("a ring installer thread panicked");
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `slot` ends step `ended` now (each slot's steps follow one another, so one mark each).
    fn mark(&self, slot: usize, ended: Step) {
        let now = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let Some(m) = self.slot_marks.get(slot) {
            let began = m.swap(now, Ordering::Relaxed);
            bump(
                &self.counters.slot_ns[ended as usize],
                now.saturating_sub(began),
            );
        }
    }

    fn epoch(&self, slot: usize) -> u64 {
        self.staging
            .books()
            .epoch(slot)
            .map_or(0, |e| e.load(Ordering::Relaxed))
    }

    /// Copies the pages of `run` (page number, offset in `data`) into leased slots and
    /// stages them; pages no slot takes are compressed inline.
    fn stage_run(&self, run: &[(u64, usize)], data: &[u8]) -> Result<(), CoreError> {
        let mut done = 0;
        while done < run.len() {
            let Some(lease) = self.reserve(run.len() - done) else {
                let retired = self.retired.load(Ordering::Relaxed);
                let rest = &run[done..];
                let counter = if retired {
                    &self.counters.retired_pages
                } else {
                    &self.counters.overflow_pages
                };
                bump(counter, rest.len() as u64);
                for &(page, offset) in rest {
                    self.store.write(page, &data[offset..offset + PAGE_SIZE])?;
                }
                return Ok(());
            };
            let result = self.fill(&lease, &run[done..done + lease.count], data);
            self.release(lease.slot);
            result?;
            done += lease.count;
        }
        Ok(())
    }

    /// Copies `pages` (at most [`RUN`]) into the lease and stages them, all or nothing:
    /// after a failure the lease is left empty (its indices name no page).
    fn fill(&self, lease: &Lease, pages: &[(u64, usize)], data: &[u8]) -> Result<(), CoreError> {
        let books = self.staging.books();
        let book_page = |index: usize, page: u64| {
            if let Some(w) = books.page(lease.slot, index) {
                w.store(page, Ordering::Relaxed);
            }
        };
        let checksums = self.staging.checksums;
        let mut items = [(0u64, StagedAt::default()); RUN];
        for (j, &(page, offset)) in pages.iter().enumerate() {
            let index = lease.base + j;
            let bytes: &[u8; PAGE_SIZE] = data[offset..offset + PAGE_SIZE]
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            // The run's next page, fetched into cache while this one is copied.
            let next = pages
                .get(j + 1)
                .and_then(|&(_, o)| data.get(o..o + PAGE_SIZE))
                .and_then(|b| b.try_into().ok());
            if checksums {
                if let Some(w) = books.checksum(lease.slot, index) {
                    w.store(u64::from(page_checksum(bytes)), Ordering::Relaxed);
                }
            }
            if let Some(words) = self.staging.words(lease.slot, index) {
                // The device reads these words next, not this CPU.
                page_to_words_streaming(bytes, next, words);
            }
            book_page(index, page);
            let at = StagedAt::new(lease.slot, index, lease.epoch)
                .ok_or_else(|| CoreError::Config("staging slot out of range".into()))?;
            items[j] = (page, at);
        }
        // The copies land before the entries that point at them are published.
        stream_fence();
        let result = self.store.stage_many(&items[..pages.len()]);
        match &result {
            Ok(()) => bump(&self.counters.staged_pages, pages.len() as u64),
            Err(_) => {
                for j in 0..pages.len() {
                    book_page(lease.base + j, NO_PAGE);
                }
            }
        }
        result
    }

    /// Leases up to `want` indices of the open slot (opening a free one if needed).
    /// `None`: the backend is retired, the ring is draining or stopping, or every slot is
    /// busy (after waiting up to [`RingConfig::slot_wait`] for one, unless stalled).
    fn reserve(&self, want: usize) -> Option<Lease> {
        if self.retired.load(Ordering::Relaxed) || self.draining.load(Ordering::Acquire) {
            return None;
        }
        let mut st = self.lock();
        let mut waited = false;
        loop {
            let closed =
                self.retired.load(Ordering::Relaxed) || self.draining.load(Ordering::Acquire);
            if st.stop || closed {
                return None;
            }
            if st.open.is_some() || !st.free.is_empty() {
                break;
            }
            if waited || st.stalled || self.cfg.slot_wait.is_zero() {
                return None;
            }
            bump(&self.counters.slot_waits, 1);
            let (guard, timeout) = self
                .idle
                .wait_timeout(st, self.cfg.slot_wait)
                .unwrap_or_else(PoisonError::into_inner);
            st = guard;
            waited = true;
            if timeout.timed_out() && st.open.is_none() && st.free.is_empty() {
                bump(&self.counters.slot_wait_timeouts, 1);
                st.stalled = true;
            }
        }
        let slot = match st.open {
            Some(slot) => slot,
            None => {
                let slot = st.free.pop()?;
                self.mark(slot, Step::Free);
                st.slots[slot] = SlotState {
                    phase: Phase::Filling,
                    filled: 0,
                    writers: 0,
                };
                if let Some(epoch) = self.staging.books().epoch(slot) {
                    epoch.fetch_add(1, Ordering::Relaxed);
                }
                st.open = Some(slot);
                st.opened = None;
                slot
            }
        };
        let slot_pages = self.slot_pages;
        let s = &mut st.slots[slot];
        let base = s.filled;
        let count = want.min(slot_pages - base);
        s.filled += count;
        s.writers += 1;
        if s.filled == slot_pages {
            s.phase = Phase::Sealed;
            self.mark(slot, Step::Filling);
            st.open = None;
            st.opened = None;
        } else if st.opened.is_none() {
            st.opened = Some(Instant::now());
            // An installer times the open slot.
            self.work.notify_one();
        }
        Some(Lease {
            slot,
            base,
            count,
            epoch: self.epoch(slot),
        })
    }

    /// A writer is done with its lease of `slot`; the last writer of a sealed slot
    /// submits it.
    fn release(&self, slot: usize) {
        let submit = {
            let mut st = self.lock();
            let s = &mut st.slots[slot];
            s.writers -= 1;
            if s.phase == Phase::Sealed && s.writers == 0 {
                s.phase = Phase::Busy;
                Some(s.filled)
            } else {
                None
            }
        };
        if let Some(pages) = submit {
            self.submit(slot, pages);
        }
    }

    /// Seals `slot` (no more leases); returns its page count when it can be submitted now.
    fn seal(&self, st: &mut State, slot: usize) -> Option<usize> {
        if st.open == Some(slot) {
            st.open = None;
            st.opened = None;
        }
        self.mark(slot, Step::Filling);
        let s = &mut st.slots[slot];
        s.phase = Phase::Sealed;
        if s.writers == 0 {
            s.phase = Phase::Busy;
            return Some(s.filled);
        }
        None
    }

    /// Hands a sealed slot to the backend (or, retired or failing, to the CPU) and queues
    /// it for an installer.
    fn submit(&self, slot: usize, pages: usize) {
        self.mark(slot, Step::Sealed);
        let submitted = if self.retired.load(Ordering::Relaxed) {
            false
        } else {
            match self.staging.backend.submit(slot, pages, self.limit) {
                Ok(()) => {
                    bump(&self.counters.slots_submitted, 1);
                    true
                }
                Err(e) => {
                    self.failed(&e);
                    false
                }
            }
        };
        self.mark(slot, Step::Submitting);
        self.lock().queue.push_back(Job {
            slot,
            pages,
            submitted,
        });
        self.work.notify_one();
    }

    /// Counts a backend failure; retires the backend when it is sticky or one too many.
    fn failed(&self, e: &BackendError) {
        bump(&self.counters.backend_failures, 1);
        let in_row = self.failures_in_row.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(error = %e, in_row, "batch backend failed; the slot goes to the CPU");
        if e.kind == FailureKind::Sticky {
            self.retire("a sticky failure");
        } else if in_row >= self.cfg.max_failures {
            self.retire("too many failures in a row");
        }
    }

    /// From now on every write is compressed on the CPU (logged once).
    fn retire(&self, why: &str) {
        if !self.retired.swap(true, Ordering::Relaxed) {
            tracing::error!(
                backend = self.staging.backend.name(),
                why,
                "retiring the batch backend: every write is compressed on the CPU from now on"
            );
        }
    }

    /// Frees an installed slot.
    fn free(&self, slot: usize) {
        self.mark(slot, Step::Installing);
        let mut st = self.lock();
        st.slots[slot] = SlotState {
            phase: Phase::Free,
            filled: 0,
            writers: 0,
        };
        st.free.push(slot);
        st.stalled = false;
        drop(st);
        self.idle.notify_all();
    }

    /// The next job for an installer, sealing the open slot when its delay is up. `None`
    /// when stopping.
    fn next_job(&self) -> Option<Job> {
        let mut st = self.lock();
        loop {
            if let Some(job) = st.queue.pop_front() {
                self.mark(job.slot, Step::Queued);
                return Some(job);
            }
            if st.stop {
                return None;
            }
            let wait = match (st.open, st.opened) {
                (Some(slot), Some(since)) => {
                    let waited = since.elapsed();
                    if waited >= self.cfg.max_delay {
                        if let Some(pages) = self.seal(&mut st, slot) {
                            drop(st);
                            self.submit(slot, pages);
                            st = self.lock();
                        }
                        continue;
                    }
                    self.cfg.max_delay - waited
                }
                // Woken by the writer that opens the next slot, or to stop.
                _ => Duration::from_millis(100),
            };
            st = self
                .work
                .wait_timeout(st, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

fn installer_loop(sh: &Shared, tools: Tools) {
    let mut installer = Installer { sh, tools };
    while let Some(job) = sh.next_job() {
        let start = Instant::now();
        installer.run(job);
        bump(
            &sh.counters.install_busy_ns,
            u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX),
        );
        bump(&sh.counters.slots_installed, 1);
        sh.free(job.slot);
    }
}

/// What one page of a chunk becomes.
#[derive(Debug, Clone, Copy)]
enum Plan {
    Same(u64),
    /// The backend's block for this index of the slot.
    Block(usize),
    /// This index of the slot, stored raw from its staged words.
    Staged(usize),
    /// `len` bytes of installer buffer `buf` (`len == PAGE_SIZE`: the raw page).
    Buf {
        buf: usize,
        len: usize,
    },
}

/// One installer thread's codec and buffers, allocated once when the ring starts.
struct Tools {
    codec: Box<dyn PageCodec>,
    bufs: Vec<[u8; PAGE_SIZE]>,
    scratch: Box<[u8; PAGE_SIZE]>,
    plan: Vec<(Ticket, Plan)>,
    compressed_seen: u64,
}

impl Tools {
    fn new(algorithm: crate::codec::Algorithm) -> Result<Self, CoreError> {
        let mut bufs = Vec::new();
        bufs.try_reserve_exact(BUFS)
            .map_err(|_| CoreError::NoMemory)?;
        bufs.resize(BUFS, [0u8; PAGE_SIZE]);
        let mut plan = Vec::new();
        plan.try_reserve_exact(CHUNK)
            .map_err(|_| CoreError::NoMemory)?;
        Ok(Self {
            codec: algorithm.try_codec().map_err(CoreError::Compress)?,
            bufs,
            scratch: Box::new([0u8; PAGE_SIZE]),
            plan,
            compressed_seen: 0,
        })
    }
}

/// An installer thread at work.
struct Installer<'a> {
    sh: &'a Shared,
    tools: Tools,
}

impl Installer<'_> {
    fn run(&mut self, job: Job) {
        if job.submitted {
            let sh = self.sh;
            let mut completed = false;
            let result = sh.staging.backend.complete(job.slot, &mut |out| {
                if !completed {
                    sh.mark(job.slot, Step::Device);
                }
                completed = true;
                self.install(job, Some(out));
            });
            if !completed {
                // The wait ended without results: that time was the device's, not installing.
                sh.mark(job.slot, Step::Device);
            }
            match result {
                Ok(()) if completed => {
                    sh.failures_in_row.store(0, Ordering::Relaxed);
                    return;
                }
                Ok(()) => sh.failed(&BackendError {
                    backend: sh.staging.backend.name(),
                    kind: FailureKind::Transient,
                    message: "completed a slot without results".into(),
                }),
                Err(e) => sh.failed(&e),
            }
        }
        bump(&self.sh.counters.fallback_slots, 1);
        self.install(job, None);
    }

    /// Installs the slot's pages from `out`, or (without results) compresses them on the CPU.
    fn install(&mut self, job: Job, out: Option<&SlotOutput<'_>>) {
        let out = match out {
            Some(o) if o.pages() != job.pages => {
                self.violation(&format!(
                    "{} results for a slot of {} pages",
                    o.pages(),
                    job.pages
                ));
                None
            }
            other => other,
        };
        let mut index = 0;
        while index < job.pages {
            index = self.plan_chunk(job.slot, index, job.pages, out);
            self.commit_chunk(job.slot, out);
        }
    }

    /// Plans pages from `start` on (at most a chunk, fewer when the buffers run out);
    /// returns where the next chunk starts.
    fn plan_chunk(
        &mut self,
        slot: usize,
        start: usize,
        pages: usize,
        out: Option<&SlotOutput<'_>>,
    ) -> usize {
        self.tools.plan.clear();
        let mut next_buf = 0;
        let end = (start + CHUNK).min(pages);
        for index in start..end {
            if next_buf == BUFS {
                return index;
            }
            let Some(ticket) = self.sh.staging.ticket(slot, index) else {
                continue;
            };
            let result = out.map(|o| o.page(index));
            let plan = match result {
                Some(Ok(PageResult::SameFilled(word))) => self
                    .checksum_holds(ticket, out, index)
                    .then_some(Plan::Same(word)),
                Some(Ok(PageResult::Compressed(block))) => {
                    (self.checksum_holds(ticket, out, index) && self.spot_check(slot, index, block))
                        .then_some(Plan::Block(index))
                }
                // Stored from the slot's own copy: no bounce through a buffer.
                Some(Ok(PageResult::Raw)) => Some(Plan::Staged(index)),
                Some(Ok(PageResult::Rejected)) => {
                    bump(&self.sh.counters.rejected_pages, 1);
                    None
                }
                Some(Err(bad)) => {
                    self.violation(&bad.to_string());
                    None
                }
                None => None,
            };
            let plan = match plan {
                Some(p) => p,
                None => {
                    self.load(slot, index, next_buf);
                    next_buf += 1;
                    self.encode_on_cpu(next_buf - 1)
                }
            };
            self.tools.plan.push((ticket, plan));
        }
        end
    }

    /// Copies the staged page into buffer `buf`.
    fn load(&mut self, slot: usize, index: usize, buf: usize) {
        if let Some(words) = self.sh.staging.words(slot, index) {
            words_to_page(words, &mut self.tools.bufs[buf]);
        }
    }

    /// Compresses the page in buffer `buf` on the CPU (the result replaces it there).
    fn encode_on_cpu(&mut self, buf: usize) -> Plan {
        bump(&self.sh.counters.cpu_pages, 1);
        let page = &mut self.tools.bufs[buf];
        if let Some(word) = same_filled_word(page) {
            return Plan::Same(word);
        }
        let limit = self.sh.limit;
        match self
            .tools
            .codec
            .compress_below(page, &mut self.tools.scratch[..], limit)
        {
            Ok(Some(len)) => {
                page[..len].copy_from_slice(&self.tools.scratch[..len]);
                Plan::Buf { buf, len }
            }
            _ => Plan::Buf {
                buf,
                len: PAGE_SIZE,
            },
        }
    }

    /// Whether the checksum the backend reports for page `index` of the slot is the one its
    /// writer recorded (always, in a store without checksums). False (the page goes to the
    /// CPU, and the backend is retired) when not: the backend compressed other bytes than
    /// were staged.
    fn checksum_holds(&self, ticket: Ticket, out: Option<&SlotOutput<'_>>, index: usize) -> bool {
        let sh = self.sh;
        if !sh.staging.checksums {
            return true;
        }
        bump(&sh.counters.checksum_checked_pages, 1);
        let theirs = out.and_then(|o| o.checksum(index).ok());
        let ours = sh.staging.books().checksum_of(ticket);
        if theirs.is_some() && theirs == ours {
            return true;
        }
        bump(&sh.counters.checksum_mismatches, 1);
        tracing::error!(
            page = ticket.page,
            backend = ?theirs,
            writer = ?ours,
            "a backend result is not of the page that was staged"
        );
        sh.retire("a result whose checksum is not its page's");
        false
    }

    /// Decodes every n-th block on the CPU and compares it with the staged page. False
    /// (and the backend retired) on a mismatch.
    fn spot_check(&mut self, slot: usize, index: usize, block: &[u8]) -> bool {
        let every = self.sh.cfg.spot_check_every;
        self.tools.compressed_seen += 1;
        if every == 0 || self.tools.compressed_seen % every != 0 {
            return true;
        }
        bump(&self.sh.counters.spot_checked_pages, 1);
        let decoded = self
            .tools
            .codec
            .decompress(block, &mut self.tools.scratch)
            .is_ok();
        let same = decoded
            && self.sh.staging.words(slot, index).is_some_and(|words| {
                words
                    .iter()
                    .zip(self.tools.scratch.chunks_exact(8))
                    .all(|(w, b)| w.load(Ordering::Relaxed).to_le_bytes() == *b)
            });
        if !same {
            bump(&self.sh.counters.spot_check_failures, 1);
            self.sh
                .retire("a compressed page failed the CPU spot check");
        }
        same
    }

    fn violation(&self, what: &str) {
        bump(&self.sh.counters.contract_violations, 1);
        tracing::error!(what, "the batch backend broke the result contract");
        self.sh.retire("a result that breaks the layout's contract");
    }

    /// Installs the planned chunk, retrying while the allocator has no memory (the staged
    /// copies are the only ones: they are never given up).
    fn commit_chunk(&mut self, slot: usize, out: Option<&SlotOutput<'_>>) {
        let mut commits: Vec<Commit<'_>> = Vec::new();
        let mut backoff = Duration::from_micros(100);
        while commits.try_reserve_exact(self.tools.plan.len()).is_err() {
            self.wait_for_memory(&mut backoff);
        }
        let books = self.sh.staging.books();
        for &(ticket, plan) in &self.tools.plan {
            // The writer's checksum: what every later read of the page is held to.
            let checksum = books.checksum_of(ticket).unwrap_or_default();
            let encoded = match plan {
                Plan::Same(word) => Encoded::SameFilled(word),
                Plan::Block(index) => match out.map(|o| o.page(index)) {
                    Some(Ok(PageResult::Compressed(block))) => Encoded::Compressed(block),
                    _ => continue,
                },
                Plan::Staged(index) => match self.sh.staging.words(slot, index) {
                    Some(words) => Encoded::RawWords(words),
                    None => continue,
                },
                Plan::Buf { buf, len } if len == PAGE_SIZE => Encoded::Raw(&self.tools.bufs[buf]),
                Plan::Buf { buf, len } => Encoded::Compressed(&self.tools.bufs[buf][..len]),
            };
            commits.push(Commit::new(ticket, encoded, checksum));
        }
        let sh = self.sh;
        let mut tries = 0u64;
        while let Err(e) = sh.store.commit(&mut commits) {
            if tries % 1000 == 0 {
                tracing::warn!(error = %e, tries, "installing staged pages failed; retrying");
            }
            tries += 1;
            self.wait_for_memory(&mut backoff);
        }
        let installed = commits
            .iter()
            .filter(|c| c.state == CommitState::Installed)
            .count() as u64;
        bump(&sh.counters.installed_pages, installed);
        bump(&sh.counters.stale_pages, commits.len() as u64 - installed);
    }

    fn wait_for_memory(&self, backoff: &mut Duration) {
        bump(&self.sh.counters.commit_retries, 1);
        std::thread::sleep(*backoff);
        *backoff = (*backoff * 2).min(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests;

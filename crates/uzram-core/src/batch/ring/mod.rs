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
//!
//! The code follows a slot around its cycle: `stage.rs` (writers lease indices, copy
//! pages in and seal the slot), `submit.rs` (the slot goes to the backend and onto the
//! installers' queue; failures are counted), `install.rs` (installers check, plan and
//! commit the results). They are jobs on the state in `shared.rs`; `config.rs` says how a
//! ring runs and `stats.rs` what it counts. The staging they fill is a [`Staging`]
//! (`batch/staging.rs`), which the store reads staged pages from.

mod config;
mod install;
mod replaced;
mod shared;
mod stage;
mod stats;
mod submit;
mod watch;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use self::config::{RingConfig, ThreadHook};
use self::install::{installer_loop, Tools, BUFS};
use self::replaced::ReplacedBooks;
use self::shared::{InSubmit, Phase, Shared, SlotState, State, MAX_LINE, NO_SLOT};
use self::stats::Counters;
pub use self::stats::{RingStats, SlotTimes};
use self::submit::SubmitterGone;
use self::watch::watch_loop;
use super::backend::{BackendMemory, SlotBackend};
use super::source::PageSource;
use super::staging::{book_words, Staging, Words};
use crate::page::{PAGE_SIZE, PAGE_WORDS};
use crate::store::{PageStore, MAX_SLOT_PAGES, MAX_STAGING_SLOTS};
use crate::CoreError;

/// Stages writes into a [`SlotBackend`] and installs the results; see the module docs.
pub struct Ring {
    shared: Arc<Shared>,
    /// Installer threads, by id.
    installers: Vec<(usize, JoinHandle<()>)>,
    watcher: Option<JoinHandle<()>>,
    submitter: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("backend", &self.shared.staging.backend().name())
            .field("slots", &self.shared.staging.slots())
            .field("slot_pages", &self.shared.slot_pages)
            .field("cfg", &self.shared.cfg)
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// Starts the installer threads and attaches `backend`'s staging to `store`. On an error
    /// nothing is attached, and the threads already started are stopped.
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
        let staging = Arc::new(Staging::new(
            backend,
            books,
            slots,
            slot_pages,
            store.checksums(),
        ));
        let shared = Arc::new(Shared {
            limit: store.raw_threshold(),
            store,
            staging,
            slot_pages,
            state: Mutex::new(State {
                open: None,
                opened: None,
                free: (0..slots).rev().collect(),
                slots: vec![SlotState { phase: Phase::Free }; slots],
                queue: VecDeque::with_capacity(slots),
                to_submit: VecDeque::with_capacity(slots),
                submitting: None,
                submitter_parked: false,
                stop: false,
                stalled: false,
                line: VecDeque::with_capacity(MAX_LINE),
                next_ticket: 0,
                waits: vec![None; slots],
            }),
            work: Condvar::new(),
            idle: Condvar::new(),
            submits: Condvar::new(),
            watch: Condvar::new(),
            in_device: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            retired: AtomicBool::new(false),
            hung: AtomicBool::new(false),
            place_off: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            failures_in_row: AtomicU32::new(0),
            counters: Counters::default(),
            started: Instant::now(),
            slot_marks: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            leases: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            replaced: ReplacedBooks::new(slots, slot_pages),
            open_hint: AtomicUsize::new(NO_SLOT),
            waiting: AtomicUsize::new(0),
            cfg,
        });
        let mut ring = Ring {
            shared,
            installers: Vec::new(),
            watcher: None,
            submitter: None,
        };
        let installers = ring.shared.cfg.installers;
        // The watcher is one more installer, for slots whose installer the backend holds.
        for id in 0..=installers {
            let name = if id < installers {
                format!("uzram-install-{id}")
            } else {
                "uzram-ring-watch".to_string()
            };
            let sh = Arc::clone(&ring.shared);
            let thread_name = name.clone();
            // Everything an installer holds is allocated here, before it serves.
            let tools = Tools::new(ring.shared.store.algorithm())?;
            let spawned = spawn_thread(name.clone(), move || {
                if let Some(hook) = &sh.cfg.on_thread_start {
                    hook(&thread_name);
                }
                if id < installers {
                    installer_loop(&sh, tools, id);
                } else {
                    watch_loop(&sh, tools);
                }
            });
            match spawned {
                Ok(t) if id < installers => ring.installers.push((id, t)),
                Ok(t) => ring.watcher = Some(t),
                // Dropping `ring` stops the threads already started.
                Err(e) => return Err(CoreError::Config(format!("cannot start {name}: {e}"))),
            }
        }
        // The backend's `submit` runs on its own thread, never a writer's: a submission that
        // blocks in a wedged driver then holds no queue thread, and the watcher bounds it.
        let sh = Arc::clone(&ring.shared);
        let spawned = spawn_thread("uzram-ring-submit".into(), move || {
            let _gone = SubmitterGone(&sh);
            if let Some(hook) = &sh.cfg.on_thread_start {
                hook("uzram-ring-submit");
            }
            sh.submit_loop();
        });
        match spawned {
            Ok(t) => ring.submitter = Some(t),
            Err(e) => {
                return Err(CoreError::Config(format!(
                    "cannot start uzram-ring-submit: {e}"
                )))
            }
        }
        // Last: a ring that failed to start leaves the store as it found it, with no staging
        // attached, so that its caller can go on without one (`auto` on the CPU).
        ring.shared
            .store
            .attach_staging(ring.shared.staging.clone())?;
        Ok(ring)
    }

    /// Writes whole pages starting at `first_page`: same-filled pages are stored at once,
    /// the others are copied into slots (or compressed inline when no slot is free or the
    /// backend is retired). When this returns every page is readable with its new content.
    /// On an error some pages may hold their new content and the others their old one.
    pub fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        self.shared.write(first_page, data)
    }

    /// [`Ring::write`] of `pages` pages whose bytes `source` copies straight into the leased
    /// slots (ublk's user copy: the kernel's copy is then the only one). Same-filled pages
    /// are found in the slot and stored as such, their indices left empty; pages no slot
    /// takes are copied into `bounce` (at least `pages` pages long) and compressed inline.
    pub fn write_from(
        &self,
        first_page: u64,
        pages: usize,
        source: &mut dyn PageSource,
        bounce: &mut [u8],
    ) -> Result<(), CoreError> {
        self.shared.write_from(first_page, pages, source, bounce)
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
            if sh.leased(slot) > 0 {
                submit = sh.seal(&mut st, slot).map(|pages| (slot, pages));
            }
        }
        let epochs: Vec<(usize, u64)> = (0..st.slots.len())
            .filter(|&i| !Shared::settled(&st, i) && sh.leased(i) > 0)
            .map(|i| (i, sh.staging.epoch(i)))
            .collect();
        drop(st);
        if let Some((slot, pages)) = submit {
            sh.submit(slot, pages);
        }
        let mut st = sh.lock();
        while epochs
            .iter()
            .any(|&(s, e)| !Shared::settled(&st, s) && sh.staging.epoch(s) == e)
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
        let busy = sh
            .lock()
            .slots
            .iter()
            .filter(|s| s.phase != Phase::Free)
            .count();
        RingStats {
            retired: u64::from(sh.retired.load(Ordering::Relaxed)),
            install_busy_us: sh.counters.install_busy_ns.load(Ordering::Relaxed) / 1000,
            install_copy_us: sh.counters.install_copy_ns.load(Ordering::Relaxed) / 1000,
            busy_slots: busy as u64,
            ..sh.counters.snapshot()
        }
    }

    /// The backend's counters.
    pub fn backend_stats(&self) -> Vec<(&'static str, u64)> {
        self.shared.staging.backend().stats()
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.shared.staging.backend().name()
    }

    /// Memory the ring holds besides the store: the backend's slots and the installers'
    /// page buffers. Fixed from the start.
    pub fn memory(&self) -> BackendMemory {
        let mut m = self.shared.staging.backend().memory();
        m.host_bytes += ((self.shared.cfg.installers + 1) * BUFS * PAGE_SIZE) as u64
            + self.shared.staging.book_bytes() as u64
            + self.shared.replaced.bytes() as u64;
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
        // Writers waiting in line for room compress inline instead.
        sh.idle.notify_all();
        let start = Instant::now();
        loop {
            if start.elapsed() > within {
                return false;
            }
            self.flush_within(within.saturating_sub(start.elapsed()));
            let st = sh.lock();
            if (0..st.slots.len())
                .all(|i| Shared::settled(&st, i) || (sh.leased(i) == 0 && !sh.held(i)))
            {
                return true;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// True once the backend was retired (every write is compressed on the CPU).
    pub fn is_retired(&self) -> bool {
        self.shared.retired.load(Ordering::Acquire)
    }

    /// Installs everything staged, then stops the installer threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if self.installers.is_empty() && self.watcher.is_none() && self.submitter.is_none() {
            return;
        }
        self.flush();
        let sh = &*self.shared;
        sh.lock().stop = true;
        sh.submits.notify_all();
        sh.work.notify_all();
        sh.idle.notify_all();
        while let Some(thread) = self.submitter.take() {
            if thread.is_finished() {
                if thread.join().is_err() {
                    tracing::error!("the ring's submitter thread panicked");
                }
            } else if InSubmit::stuck(sh.lock().submitting) {
                // Its slot was installed from staging; the thread stays in the backend's
                // `submit` until the process ends.
                tracing::error!("leaving the submitter stuck in the backend");
            } else {
                self.submitter = Some(thread);
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        while !self.installers.is_empty() {
            let stuck = {
                let st = sh.lock();
                sh.device_waits(&st)
                    .filter(|w| w.rescued)
                    .map(|w| w.installer)
                    .collect::<Vec<_>>()
            };
            let mut i = 0;
            while i < self.installers.len() {
                let (id, thread) = &self.installers[i];
                if thread.is_finished() {
                    let (_, thread) = self.installers.swap_remove(i);
                    if thread.join().is_err() {
                        tracing::error!("a ring installer thread panicked");
                    }
                } else if stuck.contains(id) {
                    // Its slot was installed from staging; the thread stays in the
                    // backend's wait, holding the ring's shared state, until the process ends.
                    tracing::error!(installer = id, "leaving an installer stuck in the backend");
                    self.installers.swap_remove(i);
                } else {
                    i += 1;
                }
            }
            if !self.installers.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        sh.watch.notify_all();
        if let Some(t) = self.watcher.take() {
            if t.join().is_err() {
                tracing::error!("the ring's watcher thread panicked");
            }
        }
    }
}

/// Starts one of the ring's threads, named `name`, on a 256 KiB stack.
fn spawn_thread(
    name: String,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    #[cfg(test)]
    if tests::REFUSED_THREAD.with(|refused| refused.borrow().as_deref() == Some(name.as_str())) {
        // What a host out of threads or memory answers.
        return Err(std::io::Error::from_raw_os_error(libc::EAGAIN));
    }
    std::thread::Builder::new()
        .name(name)
        .stack_size(256 << 10)
        .spawn(f)
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_source;

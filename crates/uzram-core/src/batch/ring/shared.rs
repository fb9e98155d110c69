//! What the writers, the installers and the [`Ring`](super::Ring) handle share: the slots'
//! state behind one mutex, each slot's lease word, the staging, the counters, and the marks
//! that time each slot's steps. The jobs on it live in `stage.rs`, `submit.rs` and
//! `install.rs`.
//!
//! A write leases pages of the open slot with one compare-and-swap on that slot's lease
//! word (`LEASE_OPEN`) and gives them back with one atomic subtraction: the
//! mutex is taken only to open, seal, submit and free a slot, a few times per slot instead
//! of twice per write. With 16 queue threads the mutex held writers back (each write's
//! CPU rose 40 % from 4 to 16 threads, and ingest fell a third).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::config::RingConfig;
use super::replaced::ReplacedBooks;
use super::stats::{bump, nanos, Counters, Step};
use crate::batch::staging::Staging;
use crate::store::PageStore;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Free,
    /// Opened, until its results are installed (its lease word says how far it got).
    InUse,
}

/// A slot's lease word: pages leased (low 32 bits), writers holding a lease (bits 32..62),
/// and two flags. `OPEN`: writers may lease; set when the slot is opened, cleared when it is
/// sealed. `SEALED`: no more leases; whoever sees `SEALED` with no writer left submits it:
/// the sealer if none held a lease, else the last writer to let go.
pub(super) const LEASE_OPEN: u64 = 1 << 63;
/// See [`LEASE_OPEN`].
pub(super) const LEASE_SEALED: u64 = 1 << 62;
/// One writer in a lease word.
pub(super) const LEASE_WRITER: u64 = 1 << 32;
const LEASE_FILLED: u64 = (1 << 32) - 1;
const LEASE_WRITERS: u64 = ((1 << 30) - 1) << 32;

/// Pages leased in lease word `w`.
pub(super) fn filled(w: u64) -> usize {
    (w & LEASE_FILLED) as usize
}

/// Writers holding a lease in lease word `w`.
pub(super) fn writers(w: u64) -> u64 {
    (w & LEASE_WRITERS) >> 32
}

/// `open_hint` when no slot is open.
pub(super) const NO_SLOT: usize = usize::MAX;

#[derive(Debug, Clone, Copy)]
pub(super) struct SlotState {
    pub(super) phase: Phase,
}

/// A slot an installer takes on.
#[derive(Debug, Clone, Copy)]
pub(super) struct Job {
    pub(super) slot: usize,
    pub(super) pages: usize,
    /// Submitted: install the backend's results. Otherwise compress the pages on the CPU.
    pub(super) submitted: bool,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) open: Option<usize>,
    /// When the open slot took its first page.
    pub(super) opened: Option<Instant>,
    pub(super) free: Vec<usize>,
    pub(super) slots: Vec<SlotState>,
    /// Slots waiting for an installer.
    pub(super) queue: VecDeque<Job>,
    /// Sealed slots (and their page counts) waiting for the submitter thread.
    pub(super) to_submit: VecDeque<(usize, usize)>,
    /// The slot the submitter is handing to the backend now.
    pub(super) submitting: Option<InSubmit>,
    /// The submitter waits for `to_submit` (it is to be woken).
    pub(super) submitter_parked: bool,
    pub(super) stop: bool,
    /// A writer's wait for a free slot ended with none freed; cleared when one is.
    pub(super) stalled: bool,
    /// Writers waiting for room, in the order they came: room that appears goes to them
    /// first, in that order ([`Waiter`]).
    pub(super) line: VecDeque<Waiter>,
    /// The next waiter's ticket.
    pub(super) next_ticket: u64,
    /// Per slot, the installer that took it to wait for its results; the wait is on while
    /// [`Shared::in_device`] says so.
    pub(super) waits: Vec<Option<DeviceWait>>,
}

/// An installer in the backend's wait for a slot's results (`complete`).
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceWait {
    pub(super) since: Instant,
    pub(super) job: Job,
    /// Which installer waits.
    pub(super) installer: usize,
    /// The wait passed the deadline and the watcher is installing the slot's pages from
    /// staging on the CPU: the slot is not freed until it is done.
    pub(super) rescuing: bool,
    /// The watcher installed them: the slot counts as installed, and its installer as stuck
    /// until it returns.
    pub(super) rescued: bool,
}

/// The submitter thread in the backend's `submit` of one slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct InSubmit {
    pub(super) slot: usize,
    pub(super) pages: usize,
    pub(super) since: Instant,
    /// The call passed the deadline and the watcher took the slot's pages on: the
    /// submitter queues nothing for it when (if ever) it returns.
    pub(super) rescuing: bool,
}

impl State {
    /// Whether the submitter holds no slot this ring still waits for: nothing waits for
    /// it, and it is in no `submit` but one whose slot the watcher took on.
    pub(super) fn submitter_done(&self) -> bool {
        self.to_submit.is_empty() && self.submitting.is_none_or(|s| s.rescuing)
    }
}

impl InSubmit {
    /// Whether the submitter is stuck in the backend with its slot taken on by the watcher.
    pub(super) fn stuck(submitting: Option<InSubmit>) -> bool {
        submitting.is_some_and(|s| s.rescuing)
    }
}

/// Most writers that wait in line at once; a writer that finds the line full compresses
/// its pages inline. Far more than a device has queue threads.
pub(super) const MAX_LINE: usize = 1024;

/// A writer waiting in line for pages of a slot.
#[derive(Debug)]
pub(super) struct Waiter {
    pub(super) ticket: u64,
    pub(super) want: usize,
    /// Pages leased for it while it slept: it fills them when it wakes.
    pub(super) grant: Option<Lease>,
}

/// Pages `base..base + count` of `slot`, leased to one writer.
#[derive(Debug)]
pub(super) struct Lease {
    pub(super) slot: usize,
    pub(super) base: usize,
    pub(super) count: usize,
    pub(super) epoch: u64,
}

pub(super) struct Shared {
    pub(super) store: Arc<PageStore>,
    pub(super) staging: Arc<Staging>,
    pub(super) cfg: RingConfig,
    pub(super) slot_pages: usize,
    pub(super) limit: usize,
    pub(super) state: Mutex<State>,
    /// Installers: a slot to install, an open slot to time, or stop.
    pub(super) work: Condvar,
    /// Flushers: a slot was freed.
    pub(super) idle: Condvar,
    /// The submitter: a slot to submit, or stop.
    pub(super) submits: Condvar,
    /// Set (released) once the backend is retired; read with acquire, so a thread that
    /// sees it also sees what was done before the retirement.
    pub(super) retired: AtomicBool,
    /// A wait for results passed [`RingConfig::device_deadline`]: no installer waits for
    /// the backend again; every slot is compressed on the CPU. Stored (released) after
    /// `retired`, read with acquire: a thread that sees it sees the backend retired.
    pub(super) hung: AtomicBool,
    /// Set once a placement by the backend's copy engine failed or did not hold: the
    /// installers copy every page themselves from then on (`install.rs`).
    pub(super) place_off: AtomicBool,
    /// The watcher: woken to stop.
    pub(super) watch: Condvar,
    /// Per slot, whether an installer is (about to be) in the backend's wait for its
    /// results: cleared without the mutex when the wait ends.
    pub(super) in_device: Vec<AtomicBool>,
    /// No more leases: writes are compressed inline while the slots empty
    /// ([`Ring::drain`](super::Ring::drain)).
    pub(super) draining: AtomicBool,
    pub(super) failures_in_row: AtomicU32,
    pub(super) counters: Counters,
    /// When the ring started: slot marks count from here.
    pub(super) started: Instant,
    /// Per slot, when its current step began (ns after `started`).
    pub(super) slot_marks: Vec<AtomicU64>,
    /// Per slot, its lease word ([`LEASE_OPEN`]).
    pub(super) leases: Vec<AtomicU64>,
    /// Per slot, the store objects its staged pages replaced, given back when it is
    /// installed.
    pub(super) replaced: ReplacedBooks,
    /// The open slot, for writers that lease without the mutex ([`NO_SLOT`]: none). A hint:
    /// the lease word decides.
    pub(super) open_hint: AtomicUsize,
    /// Waiters in [`State::line`] without a grant yet: while there are any, writers take the
    /// mutex and queue behind them instead of leasing past them. Changed only with the
    /// line, by `join_line`, `grant` and `leave_line`.
    pub(super) waiting: AtomicUsize,
}

impl Shared {
    #[inline]
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `slot` needs nothing more from the ring: free, or installed by the watcher
    /// while its installer is stuck in the backend.
    pub(super) fn settled(st: &State, slot: usize) -> bool {
        st.slots.get(slot).is_none_or(|s| s.phase == Phase::Free)
            || st
                .waits
                .get(slot)
                .copied()
                .flatten()
                .is_some_and(|w| w.rescued)
    }

    /// Whether an installer waits in the backend for `slot`'s results.
    pub(super) fn waiting_on_device(&self, slot: usize) -> bool {
        self.in_device
            .get(slot)
            .is_some_and(|w| w.load(Ordering::Acquire))
    }

    /// The waits of installers now in the backend's wait for their slot's results.
    pub(super) fn device_waits<'s>(
        &'s self,
        st: &'s State,
    ) -> impl Iterator<Item = &'s DeviceWait> {
        st.waits
            .iter()
            .flatten()
            .filter(|w| self.waiting_on_device(w.job.slot))
    }

    /// `slot` ends step `ended` now (each slot's steps follow one another, so one mark each).
    #[inline]
    pub(super) fn mark(&self, slot: usize, ended: Step) {
        let now = nanos(self.started.elapsed());
        if let Some(m) = self.slot_marks.get(slot) {
            let began = m.swap(now, Ordering::Relaxed);
            bump(
                &self.counters.slot_ns[ended as usize],
                now.saturating_sub(began),
            );
        }
    }
}

//! What the writers, the installers and the [`Ring`](super::Ring) handle share: the slots'
//! state behind one mutex, the staging, the counters, and the marks that time each slot's
//! steps. The jobs on it live in `stage.rs`, `submit.rs` and `install.rs`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::config::RingConfig;
use super::stats::{bump, Counters, Step};
use crate::batch::staging::Staging;
use crate::store::PageStore;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Free,
    Filling,
    /// Full or timed out; submitted once its last writer is done.
    Sealed,
    /// Submitted or failed, until its results are installed.
    Busy,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct SlotState {
    pub(super) phase: Phase,
    pub(super) filled: usize,
    pub(super) writers: u32,
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
    pub(super) stop: bool,
    /// A writer's wait for a free slot ended with none freed; cleared when one is.
    pub(super) stalled: bool,
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
    pub(super) retired: AtomicBool,
    /// No more leases: writes are compressed inline while the slots empty
    /// ([`Ring::drain`](super::Ring::drain)).
    pub(super) draining: AtomicBool,
    pub(super) failures_in_row: AtomicU32,
    pub(super) counters: Counters,
    /// When the ring started: slot marks count from here.
    pub(super) started: Instant,
    /// Per slot, when its current step began (ns after `started`).
    pub(super) slot_marks: Vec<AtomicU64>,
}

impl Shared {
    #[inline]
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `slot` ends step `ended` now (each slot's steps follow one another, so one mark each).
    #[inline]
    pub(super) fn mark(&self, slot: usize, ended: Step) {
        let now = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let Some(m) = self.slot_marks.get(slot) {
            let began = m.swap(now, Ordering::Relaxed);
            bump(
                &self.counters.slot_ns[ended as usize],
                now.saturating_sub(began),
            );
        }
    }
}

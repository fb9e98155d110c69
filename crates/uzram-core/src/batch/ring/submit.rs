//! From a sealed slot to an installer: the slot is handed to the backend (or, retired or
//! failing, left to the CPU) and queued as a [`Job`] for the installers, who take them with
//! `next_job`; backend failures are counted here and retire the backend when there are too
//! many; an installed slot is freed for the writers.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use super::shared::{DeviceWait, Job, Phase, Shared, SlotState, State};
use super::stats::{bump, Step};
use crate::batch::backend::{BackendError, FailureKind};

impl Shared {
    /// Hands a sealed slot to the backend (or, retired or failing, to the CPU) and queues
    /// it for an installer.
    pub(super) fn submit(&self, slot: usize, pages: usize) {
        self.mark(slot, Step::Sealed);
        let submitted = if self.retired.load(Ordering::Relaxed) {
            false
        } else {
            match self.staging.backend().submit(slot, pages, self.limit) {
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
        if self.hung.load(Ordering::Relaxed) {
            // The installers may all be stuck in the device: the watcher takes the queue.
            self.watch.notify_one();
        }
    }

    /// Counts a backend failure; retires the backend when it is sticky or one too many.
    pub(super) fn failed(&self, e: &BackendError) {
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
    pub(super) fn retire(&self, why: &str) {
        if !self.retired.swap(true, Ordering::Relaxed) {
            tracing::error!(
                backend = self.staging.backend().name(),
                why,
                "retiring the batch backend: every write is compressed on the CPU from now on"
            );
        }
    }

    /// An installer's wait for `slot`'s results ended (or never began).
    pub(super) fn left_device(&self, slot: usize) {
        self.in_device[slot].store(false, Ordering::Release);
    }

    /// Whether the watcher took on `slot`'s pages (a rescue claimed, done or under way)
    /// while its installer waited.
    pub(super) fn claimed(&self, slot: usize) -> bool {
        self.lock().waits[slot].is_some_and(|w| w.rescuing)
    }

    /// Frees an installed slot.
    pub(super) fn free(&self, slot: usize) {
        self.mark(slot, Step::Installing);
        let mut st = self.lock();
        // The watcher may still be reading the slot's staged pages.
        while st.waits[slot].is_some_and(|w| w.rescuing && !w.rescued) {
            st = self.idle.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.slots[slot] = SlotState { phase: Phase::Free };
        st.waits[slot] = None;
        if let Some(word) = self.leases.get(slot) {
            word.store(0, Ordering::Release);
        }
        st.free.push(slot);
        st.stalled = false;
        self.serve_line(&mut st);
        drop(st);
        self.idle.notify_all();
    }

    /// The open slot, `Ok` once its first page has waited `max_delay` (it is to be sealed),
    /// else `Err` with the time left; `None` when no slot is open.
    pub(super) fn open_slot_due(&self, st: &State) -> Option<Result<usize, Duration>> {
        let (Some(slot), Some(since)) = (st.open, st.opened) else {
            return None;
        };
        let waited = since.elapsed();
        Some(if waited >= self.cfg.max_delay {
            Ok(slot)
        } else {
            Err(self.cfg.max_delay - waited)
        })
    }

    /// The next job for installer `installer`, sealing the open slot when its delay is up.
    /// `None` when stopping. A submitted slot is marked in the device's hands from here
    /// until the installer's wait for its results ends ([`Shared::left_device`]).
    pub(super) fn next_job(&self, installer: usize) -> Option<Job> {
        let mut st = self.lock();
        loop {
            if let Some(job) = st.queue.pop_front() {
                self.mark(job.slot, Step::Queued);
                if job.submitted {
                    st.waits[job.slot] = Some(DeviceWait {
                        since: Instant::now(),
                        job,
                        installer,
                        rescuing: false,
                        rescued: false,
                    });
                    self.in_device[job.slot].store(true, Ordering::Release);
                }
                return Some(job);
            }
            if st.stop {
                return None;
            }
            let wait = match self.open_slot_due(&st) {
                Some(Ok(slot)) => {
                    if let Some(pages) = self.seal(&mut st, slot) {
                        drop(st);
                        self.submit(slot, pages);
                        st = self.lock();
                    }
                    continue;
                }
                Some(Err(left)) => left,
                // Woken by the writer that opens the next slot, or to stop.
                None => Duration::from_millis(100),
            };
            st = self
                .work
                .wait_timeout(st, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

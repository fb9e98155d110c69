//! From a sealed slot to an installer: the submitter thread hands the slot to the backend
//! (or, retired or failing, leaves it to the CPU) and queues it as a [`Job`] for the
//! installers, who take them with `next_job`; backend failures are counted here and retire
//! the backend when there are too many; an installed slot is freed for the writers.

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::shared::{DeviceWait, InSubmit, Job, Phase, Shared, SlotState, State};
use super::stats::{bump, Step};
use crate::batch::backend::{BackendError, FailureKind};

impl Shared {
    /// Hands a sealed slot on: to the submitter thread, or (retired) straight to the
    /// installers' queue for the CPU.
    pub(super) fn submit(&self, slot: usize, pages: usize) {
        self.mark(slot, Step::Sealed);
        if self.retired.load(Ordering::Acquire) {
            self.mark(slot, Step::Submitting);
            self.queue_job(self.lock(), slot, pages, false);
            return;
        }
        let mut st = self.lock();
        st.to_submit.push_back((slot, pages));
        // A busy submitter finds the slot when it looks again: no wake-up (a system call)
        // per slot then.
        let parked = st.submitter_parked;
        drop(st);
        if parked {
            self.submits.notify_one();
        }
    }

    /// The submitter thread's life: hands each sealed slot to the backend (or, retired or
    /// failing, leaves it to the CPU) and queues it for an installer, until the ring stops
    /// with nothing left to submit.
    pub(super) fn submit_loop(&self) {
        let mut st = self.lock();
        loop {
            let Some((slot, pages)) = st.to_submit.pop_front() else {
                if st.stop {
                    return;
                }
                st.submitter_parked = true;
                st = self
                    .submits
                    .wait(st)
                    .unwrap_or_else(PoisonError::into_inner);
                st.submitter_parked = false;
                continue;
            };
            st.submitting = Some(InSubmit {
                slot,
                pages,
                since: Instant::now(),
                rescuing: false,
            });
            drop(st);
            let result = (!self.retired.load(Ordering::Acquire))
                .then(|| self.staging.backend().submit(slot, pages, self.limit));
            st = self.lock();
            if InSubmit::stuck(st.submitting.take()) {
                // The watcher installed the slot's pages while this call was stuck, and
                // freed the slot: nothing of this call counts, and the backend (retired)
                // has no results waited for.
                continue;
            }
            drop(st);
            self.mark(slot, Step::Submitting);
            let submitted = match result {
                None => false,
                Some(Ok(())) => {
                    bump(&self.counters.slots_submitted, 1);
                    true
                }
                Some(Err(e)) => {
                    self.failed(&e);
                    false
                }
            };
            self.queue_job(self.lock(), slot, pages, submitted);
            st = self.lock();
        }
    }

    /// Queues `slot` for an installer (`submitted`: to wait for the backend's results).
    fn queue_job(&self, mut st: MutexGuard<'_, State>, slot: usize, pages: usize, submitted: bool) {
        st.queue.push_back(Job {
            slot,
            pages,
            submitted,
        });
        drop(st);
        self.work.notify_one();
        if self.hung.load(Ordering::Acquire) {
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
        if !self.retired.swap(true, Ordering::AcqRel) {
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
            // Slots still with the submitter come to this queue, unless it is stuck.
            if st.stop && st.submitter_done() {
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

/// Retires the backend when the submitter thread dies of a panic: the watcher then sends
/// the slots left waiting for it to the CPU (and bounds a `submit` the panic left behind),
/// so that no flush or stop waits for them for good.
pub(super) struct SubmitterGone<'a>(pub(super) &'a Shared);

impl Drop for SubmitterGone<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let sh = self.0;
            let st = sh.lock();
            sh.retire("the ring's submitter thread panicked");
            sh.hung.store(true, Ordering::Release);
            drop(st);
            sh.watch.notify_one();
        }
    }
}

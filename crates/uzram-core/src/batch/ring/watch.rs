//! The watcher: bounds an installer's wait for a slot's results, and the submitter's
//! hand-over of a slot to the backend. A backend that hangs without an error (a wedged GPU
//! whose event never fires, a driver call that never returns) would otherwise hold its
//! slots for good: their pages readable from staging but never installed, writers sent to the
//! CPU one slot wait at a time, and a flush or stop that never returns. Past
//! [`RingConfig::device_deadline`](super::RingConfig::device_deadline) the watcher retires
//! the backend, installs the hung slots' pages from their staged copies on the CPU (a late
//! result of the stuck installer then finds them installed: stale), and takes the
//! installers' queue while they are stuck; a slot whose submission is stuck it installs
//! and frees, and sends the slots sealed after it to the CPU. [`Ring`](super::Ring)'s stop
//! leaves the stuck threads behind.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::install::{Installer, Tools};
use super::shared::{Job, Shared};
use super::stats::{bump, Step};

/// How often the watcher looks, as a share of the deadline.
const LOOKS_PER_DEADLINE: u32 = 4;

/// The watcher thread's life, until the ring stops with no installer left in an unrescued
/// wait, no submission unrescued and nothing queued or waiting for the submitter.
pub(super) fn watch_loop(sh: &Shared, tools: Tools) {
    let mut installer = Installer::new(sh, tools);
    let deadline = sh.cfg.device_deadline;
    let tick =
        (deadline / LOOKS_PER_DEADLINE).clamp(Duration::from_millis(1), Duration::from_secs(1));
    let mut st = sh.lock();
    loop {
        let hung = sh.hung.load(Ordering::Acquire);
        if st.stop
            && st.queue.is_empty()
            && st.submitter_done()
            && sh.device_waits(&st).all(|w| w.rescued)
        {
            return;
        }
        // Claimed under the mutex: the slot is not freed until its rescue is done.
        let mut overdue: Vec<(Job, Instant)> = Vec::new();
        for w in st.waits.iter_mut().flatten() {
            if !w.rescuing && sh.waiting_on_device(w.job.slot) && w.since.elapsed() >= deadline {
                w.rescuing = true;
                overdue.push((w.job, w.since));
            }
        }
        // A submission stuck in the backend holds its slot, and the submitter holds every
        // slot sealed after it: the slot is compressed here, then freed.
        let mut stuck_submit = None;
        if let Some(s) = st.submitting.as_mut() {
            if !s.rescuing && s.since.elapsed() >= deadline {
                s.rescuing = true;
                stuck_submit = Some((s.slot, s.pages, s.since));
                // Retired before the mutex goes: a submitter that returns now finds its
                // slot taken and submits nothing more to this backend.
                sh.retire("the backend did not take a slot within the device deadline");
                sh.hung.store(true, Ordering::Release);
            }
        }
        if hung && !st.to_submit.is_empty() {
            // Retired: what waits for the submitter goes to the CPU (it may be stuck).
            while let Some((slot, pages)) = st.to_submit.pop_front() {
                st.queue.push_back(Job {
                    slot,
                    pages,
                    submitted: false,
                });
            }
            sh.work.notify_all();
        }
        // With the installers stuck, the watcher also seals the open slot once its delay is
        // up (no installer's `next_job` will) and takes the queue.
        let mut sealed = None;
        if let (true, Some(Ok(slot))) = (hung, sh.open_slot_due(&st)) {
            sealed = sh.seal(&mut st, slot).map(|pages| (slot, pages));
        }
        let queued = if hung { st.queue.pop_front() } else { None };
        if overdue.is_empty() && stuck_submit.is_none() && queued.is_none() && sealed.is_none() {
            let wait = if hung {
                tick.min(sh.cfg.max_delay)
            } else {
                tick
            };
            let slept = Instant::now();
            st = sh
                .watch
                .wait_timeout(st, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
            // A watcher that slept far past its wait (the process stopped, the VM paused,
            // the CPUs starved) cannot tell a hung device from its own absence: the waits
            // start over.
            if slept.elapsed() > wait + deadline / 2 {
                let now = Instant::now();
                for w in st.waits.iter_mut().flatten() {
                    w.since = w.since.max(now);
                }
                if let Some(s) = st.submitting.as_mut() {
                    s.since = s.since.max(now);
                }
            }
            continue;
        }
        drop(st);
        if let Some((slot, pages)) = sealed {
            // Retired: queued for the CPU, where this loop takes it.
            sh.submit(slot, pages);
        }
        if !overdue.is_empty() {
            // Retired first: a writer that sees `hung`'s effects sees no open backend.
            sh.retire("the backend did not finish a slot within the device deadline");
            sh.hung.store(true, Ordering::Release);
        }
        if let Some((slot, pages, since)) = stuck_submit {
            tracing::error!(
                slot,
                pages,
                waited_ms = since.elapsed().as_millis() as u64,
                "a slot's submission never returned: installing its pages from staging on the CPU"
            );
            bump(&sh.counters.hung_slots, 1);
            installer.take(Job {
                slot,
                pages,
                submitted: false,
            });
        }
        for (job, since) in overdue {
            tracing::error!(
                slot = job.slot,
                pages = job.pages,
                waited_ms = since.elapsed().as_millis() as u64,
                "no results for a slot: installing its pages from staging on the CPU"
            );
            bump(&sh.counters.hung_slots, 1);
            let _done = Rescued { sh, slot: job.slot };
            installer.on_cpu(job);
        }
        if let Some(job) = queued {
            sh.mark(job.slot, Step::Queued);
            installer.take(job);
        }
        st = sh.lock();
    }
}

/// Marks a slot's rescue done when dropped, also when the rescue panicked: its stuck
/// installer, if it ever returns, waits in `free` until then.
struct Rescued<'a> {
    sh: &'a Shared,
    slot: usize,
}

impl Drop for Rescued<'_> {
    fn drop(&mut self) {
        let mut st = self.sh.lock();
        if let Some(w) = st.waits.get_mut(self.slot).and_then(Option::as_mut) {
            if w.rescuing {
                w.rescued = true;
            }
        }
        drop(st);
        self.sh.idle.notify_all();
    }
}

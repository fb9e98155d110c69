//! The watcher: bounds an installer's wait for a slot's results. A backend that hangs
//! without an error (a wedged GPU whose event never fires) would otherwise hold its slots
//! for good: their pages readable from staging but never installed, writers sent to the
//! CPU one slot wait at a time, and a flush or stop that never returns. Past
//! [`RingConfig::device_deadline`](super::RingConfig::device_deadline) the watcher retires
//! the backend, installs the hung slots' pages from their staged copies on the CPU (a late
//! result of the stuck installer then finds them installed: stale), and takes the
//! installers' queue while they are stuck. [`Ring`](super::Ring)'s stop leaves the stuck
//! installers behind.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::install::{Installer, Tools};
use super::shared::{Job, Shared};
use super::stats::{bump, Step};

/// How often the watcher looks, as a share of the deadline.
const LOOKS_PER_DEADLINE: u32 = 4;

/// The watcher thread's life, until the ring stops with no installer left in an unrescued
/// wait.
pub(super) fn watch_loop(sh: &Shared, tools: Tools) {
    let mut installer = Installer::new(sh, tools);
    let deadline = sh.cfg.device_deadline;
    let tick =
        (deadline / LOOKS_PER_DEADLINE).clamp(Duration::from_millis(1), Duration::from_secs(1));
    let mut st = sh.lock();
    loop {
        if st.stop
            && st
                .waits
                .iter()
                .flatten()
                .filter(|w| sh.waiting_on_device(w.job.slot))
                .all(|w| w.rescued)
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
        let queued = if sh.hung.load(Ordering::Relaxed) {
            st.queue.pop_front()
        } else {
            None
        };
        if overdue.is_empty() && queued.is_none() {
            st = sh
                .watch
                .wait_timeout(st, tick)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
            continue;
        }
        drop(st);
        if !overdue.is_empty() {
            sh.hung.store(true, Ordering::Relaxed);
            sh.retire("the backend did not finish a slot within the device deadline");
        }
        for (job, since) in overdue {
            tracing::error!(
                slot = job.slot,
                pages = job.pages,
                waited_ms = since.elapsed().as_millis() as u64,
                "no results for a slot: installing its pages from staging on the CPU"
            );
            bump(&sh.counters.hung_slots, 1);
            installer.rescue(job);
            let mut st = sh.lock();
            if let Some(w) = st.waits[job.slot].as_mut().filter(|w| w.since == since) {
                w.rescued = true;
            }
            drop(st);
            sh.idle.notify_all();
        }
        if let Some(job) = queued {
            sh.mark(job.slot, Step::Queued);
            installer.take(job);
        }
        st = sh.lock();
    }
}

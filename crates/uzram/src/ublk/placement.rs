//! Where the queue threads run.
//!
//! libublk pins each queue thread to the CPUs the kernel's block layer maps to its queue
//! (`UBLK_CMD_GET_QUEUE_AFFINITY`): one CPU each when there are as many queues as CPUs. The
//! gpu backend also runs its installers and pool keeper on those CPUs, and a pinned queue
//! thread whose CPU an installer took waits for it instead of moving to an idle one: at 16
//! queues on the GPU host (`uzram bench --queue-affinity kernel,any`, 16 pairs on seven
//! heaps) the GPU path ingested 1.00–1.16× (median 1.07×) as much unpinned, at the same CPU
//! per GiB, with a lower busy read p99 in 14 of the 16 (docs/bench/gpu-runs.md, runs
//! 270–272). So with the gpu backend the daemon lets its queue threads run on any CPU it may
//! use, once libublk has pinned them. The cpu backend, whose queue threads are its only busy
//! ones, measured 0.89–1.12× unpinned (within the host's spread): it keeps libublk's
//! placement.

use std::io;
use std::sync::Mutex;

use crate::sys::affinity;
use crate::sys::sched::{gettid, Tid};

/// Where the daemon's queue threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Each on its queue's CPUs, as libublk pins them.
    Kernel,
    /// On any CPU the daemon may use.
    Anywhere,
}

impl Placement {
    /// The daemon's choice for a backend: anywhere with the GPU's helper threads, else
    /// libublk's.
    pub fn for_backend(gpu: bool) -> Self {
        if gpu {
            Placement::Anywhere
        } else {
            Placement::Kernel
        }
    }

    /// `kernel` or `any`, as `uzram bench --queue-affinity` and the log name it.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Kernel => "kernel",
            Placement::Anywhere => "any",
        }
    }
}

/// The queue threads of a device, as they start: who [`QueueThreads::spread`] moves.
#[derive(Debug, Default)]
pub struct QueueThreads {
    tids: Mutex<Vec<Tid>>,
}

impl QueueThreads {
    /// Notes the calling thread as a queue thread.
    pub fn register(&self) {
        if let Ok(mut tids) = self.tids.lock() {
            tids.push(gettid());
        }
    }

    /// Puts the queue threads where `placement` says, once libublk pinned them (from the
    /// thread that runs the device, which libublk did not pin: its CPUs are the daemon's).
    /// Logs what it did; a failure leaves them pinned, which costs speed, not pages.
    pub fn place(&self, placement: Placement) {
        if placement == Placement::Kernel {
            return;
        }
        let spread = affinity::allowed_cpus().and_then(|cpus| {
            let moved = self.spread(&cpus)?;
            Ok((moved, cpus.len()))
        });
        match spread {
            Ok((threads, cpus)) => tracing::info!(
                threads,
                cpus,
                "queue threads run on any of the daemon's CPUs (the gpu backend's helpers \
                 share them)"
            ),
            Err(err) => tracing::warn!(
                error = %err,
                "letting the queue threads run on any CPU failed: they stay on their queues' CPUs"
            ),
        }
    }

    /// Lets every queue thread noted run on any of `cpus` (the daemon's own, read from a
    /// thread libublk did not pin). Run after libublk pinned them, which it does before the
    /// device starts. Returns how many it moved; on errors, the first, after trying all.
    pub fn spread(&self, cpus: &[usize]) -> io::Result<usize> {
        let tids = self
            .tids
            .lock()
            .map(|t| t.clone())
            .map_err(|_| io::Error::other("the queue threads' list was poisoned"))?;
        let mut moved = 0;
        let mut first_error = None;
        for tid in tids {
            match affinity::set_cpus_of(tid, cpus) {
                Ok(()) => moved += 1,
                // a queue thread that ended (its queue failed to start)
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(moved), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{mpsc, Arc};

    #[test]
    fn spread_widens_pinned_queue_threads_to_the_cpus_given() {
        let all = affinity::allowed_cpus().unwrap();
        let threads = Arc::new(QueueThreads::default());
        let (ready_tx, ready_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let queue = {
            let threads = threads.clone();
            let first = all[0];
            std::thread::spawn(move || {
                threads.register();
                affinity::pin_thread(&[first]).unwrap();
                ready_tx.send(affinity::allowed_cpus().unwrap()).unwrap();
                go_rx.recv().unwrap();
                affinity::allowed_cpus().unwrap()
            })
        };
        assert_eq!(
            ready_rx.recv().unwrap(),
            [all[0]],
            "pinned, as libublk pins"
        );
        assert_eq!(threads.spread(&all).unwrap(), 1);
        go_tx.send(()).unwrap();
        assert_eq!(queue.join().unwrap(), all, "free to run anywhere");
        // A thread that has ended is passed over. A joined thread can still be found by its
        // id for a moment (the join wakes before the kernel releases the task: one CI run
        // moved it), so the check waits until the task is gone.
        let tid = threads.tids.lock().unwrap()[0];
        let start = std::time::Instant::now();
        while std::path::Path::new(&format!("/proc/self/task/{tid}")).exists() {
            assert!(start.elapsed().as_secs() < 10, "thread {tid} never went");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(threads.spread(&all).unwrap(), 0);
        assert_eq!(Placement::for_backend(true), Placement::Anywhere);
        assert_eq!(Placement::for_backend(false).name(), "kernel");
    }
}

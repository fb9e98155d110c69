//! Scheduling calls: a thread's nice value, realtime policy, and its page-fault count.

use std::io;

use super::errno::check;

/// The nice value of the threads that serve swap I/O and refill the block pool: under
/// pressure they compete for CPU with the very tasks whose memory they swap out, and zram
/// does this work in the writer's own context, ahead of everything else.
pub const IO_NICE: i32 = -20;

/// A thread id (`gettid`).
pub type Tid = libc::pid_t;

/// The calling thread's id.
pub fn gettid() -> Tid {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Sets thread `tid`'s nice value (root may lower it below 0).
pub fn set_nice_of(tid: Tid, nice: i32) -> io::Result<()> {
    let tid = libc::id_t::try_from(tid).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: setpriority takes only integers; PRIO_PROCESS with a thread id changes that
    // thread alone on Linux.
    check(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) })
}

/// Sets the calling thread's nice value.
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    set_nice_of(gettid(), nice)
}

/// Raises the calling thread, one on the swap I/O path (`thread` names it in the warning),
/// to [`IO_NICE`]. Where that fails (no `CAP_SYS_NICE`) it warns and the thread runs on at
/// the nice value it had: it then competes for CPU at normal priority with the tasks whose
/// memory it swaps out.
pub fn raise_io_thread_priority(thread: impl std::fmt::Display) {
    if let Err(err) = set_thread_nice(IO_NICE) {
        tracing::warn!(
            thread = %thread,
            error = %err,
            "raising an I/O-path thread's priority failed: it competes at normal priority"
        );
    }
}

/// Runs `f` with the calling thread at [`IO_NICE`], then gives it back its nice value: for
/// work that holds locks the swap I/O path waits on. A thread at nice 19 holding them while
/// the CPUs are busy stops the I/O path for as long as the scheduler leaves it waiting: a
/// compaction of 256 MiB (every shard's lock) took 852 ms at nice 19 beside one CPU hog per
/// CPU and 13.5 ms raised, and a writer at nice -20 waited as long (`cargo bench -p
/// uzram-core --bench tier_pause`, docs/bench/2026-12-priority.md). Where the priority cannot be raised
/// (no `CAP_SYS_NICE`), `f` runs at the thread's own.
pub fn at_io_priority<T>(f: impl FnOnce() -> T) -> T {
    let _raised = Raised::new();
    f()
}

/// The calling thread raised to [`IO_NICE`] until this is dropped (a panic included).
struct Raised {
    priority: IoPriority,
    raised: bool,
}

impl Raised {
    fn new() -> Self {
        let priority = IoPriority::of_this_thread();
        let raised = priority.raise_now();
        Self { priority, raised }
    }
}

impl Drop for Raised {
    fn drop(&mut self) {
        if self.raised {
            self.priority.lower_now();
        }
    }
}

/// The calling thread's way between its own nice value and [`IO_NICE`], for work at a low
/// priority that now and then takes locks the I/O path waits on (a recompression pass, as
/// `uzram_core::store::Priority`). Only the thread that made it may use it.
#[derive(Debug)]
pub struct IoPriority {
    tid: Tid,
    /// The thread's own nice value; `None` where it already runs at [`IO_NICE`] (or its
    /// nice cannot be read): nothing to raise.
    own: Option<i32>,
    /// A raise failed (no `CAP_SYS_NICE`): none is tried again.
    refused: std::cell::Cell<bool>,
}

impl IoPriority {
    /// For the calling thread.
    pub fn of_this_thread() -> Self {
        let tid = gettid();
        Self {
            tid,
            own: nice_of(tid).ok().filter(|&n| n > IO_NICE),
            refused: std::cell::Cell::new(false),
        }
    }

    /// Raises the thread to [`IO_NICE`]; false where there was nothing to raise or it
    /// failed (no `CAP_SYS_NICE`: warned once per process, and the work runs at the
    /// thread's own priority).
    fn raise_now(&self) -> bool {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if self.own.is_none() || self.refused.get() {
            return false;
        }
        match set_nice_of(self.tid, IO_NICE) {
            Ok(()) => true,
            Err(err) => {
                self.refused.set(true);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        error = %err,
                        "raising a thread for work the I/O path waits on failed: it runs at \
                         its own priority (once per process)"
                    );
                }
                false
            }
        }
    }

    /// Gives the thread its own nice value back (nothing to do where no raise can work).
    fn lower_now(&self) {
        if let (Some(own), false) = (self.own, self.refused.get()) {
            if let Err(err) = set_nice_of(self.tid, own) {
                tracing::warn!(error = %err, nice = own, "giving a thread back its nice value failed");
            }
        }
    }
}

impl uzram_core::store::Priority for IoPriority {
    fn raise(&self) {
        self.raise_now();
    }

    fn lower(&self) {
        self.lower_now();
    }
}

/// Thread `tid`'s nice value.
pub fn nice_of(tid: Tid) -> io::Result<i32> {
    let tid = libc::id_t::try_from(tid).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // getpriority may return -1 as a value; errno tells.
    // SAFETY: __errno_location returns this thread's errno, valid for the thread's life;
    // getpriority takes only integers (PRIO_PROCESS with a thread id: that thread).
    let (n, errno) = unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid);
        (n, *libc::__errno_location())
    };
    if errno != 0 {
        return Err(io::Error::from_raw_os_error(errno));
    }
    Ok(n)
}

/// Runs thread `tid` (0: the calling one) as `SCHED_FIFO` at `priority`.
pub fn set_fifo(tid: Tid, priority: i32) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: `param` is a valid sched_param for the call's duration.
    check(unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) })
}

/// Runs thread `tid` under the normal policy (`SCHED_OTHER`), keeping its nice value.
pub fn set_normal(tid: Tid) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as for `set_fifo`.
    check(unsafe { libc::sched_setscheduler(tid, libc::SCHED_OTHER, &param) })
}

/// Whether thread `tid` (0: the calling thread) runs under a realtime policy (`SCHED_FIFO`,
/// `SCHED_RR`).
pub fn is_realtime(tid: Tid) -> io::Result<bool> {
    // SAFETY: sched_getscheduler takes a thread id and returns a policy or -1.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy == -1 {
        return Err(io::Error::last_os_error());
    }
    let policy = policy & !libc::SCHED_RESET_ON_FORK;
    Ok(policy == libc::SCHED_FIFO || policy == libc::SCHED_RR)
}

/// Page faults (minor and major) the calling thread has taken so far, or `None` where
/// `getrusage(RUSAGE_THREAD)` fails.
pub fn thread_faults() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the pointer, which points to a zeroed,
    // properly sized and aligned value that lives across the call.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded, so it filled the struct (and zeroed is valid for it anyway).
    let usage = unsafe { usage.assume_init() };
    let count = |v: libc::c_long| u64::try_from(v).unwrap_or(0);
    Some(count(usage.ru_minflt) + count(usage.ru_majflt))
}

/// Time the calling thread has spent waiting on a run queue (runnable, not running), from
/// `/proc/thread-self/schedstat`; `None` where the kernel does not keep scheduler stats.
pub fn thread_runqueue_wait() -> Option<std::time::Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(std::time::Duration::from_nanos(ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_priority_moves_its_thread_between_its_own_nice_and_the_io_path_s() {
        use uzram_core::store::Priority;
        std::thread::spawn(|| {
            let tid = gettid();
            set_nice_of(tid, 19).unwrap();
            let priority = IoPriority::of_this_thread();
            priority.raise();
            let raised = nice_of(tid).unwrap();
            priority.lower();
            let lowered = nice_of(tid).unwrap();
            if set_nice_of(tid, IO_NICE).is_err() {
                eprintln!("skipping: raising a nice value needs CAP_SYS_NICE");
                return;
            }
            assert_eq!((raised, lowered), (IO_NICE, 19));
            // A thread already at the I/O path's nice has nothing to raise, nor to lower.
            let at_io = IoPriority::of_this_thread();
            at_io.raise();
            at_io.lower();
            assert_eq!(nice_of(tid).unwrap(), IO_NICE);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn work_at_io_priority_runs_raised_and_the_thread_gets_its_nice_back() {
        std::thread::spawn(|| {
            let tid = gettid();
            set_nice_of(tid, 19).unwrap();
            let inside = at_io_priority(|| nice_of(tid).unwrap());
            let after = nice_of(tid).unwrap();
            if set_nice_of(tid, IO_NICE).is_err() {
                eprintln!("skipping: raising a nice value needs CAP_SYS_NICE");
                return;
            }
            assert_eq!((inside, after), (IO_NICE, 19));
            set_nice_of(tid, 19).unwrap();
            let panicked = std::panic::catch_unwind(|| at_io_priority(|| panic!("in the work")));
            assert!(panicked.is_err());
            assert_eq!(nice_of(tid).unwrap(), 19, "a panic kept the thread raised");
        })
        .join()
        .unwrap();
    }
}

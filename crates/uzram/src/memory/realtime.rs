//! Realtime priority for a takeover, from the wait for the dying daemon until the device
//! serves again.
//!
//! While the device is paused, memory can have run out with nothing able to free any: every
//! reclaim waits for this device's swap writes. The recovery room, given back at the crash,
//! is meant for the new daemon, but the kernel hands free pages to whoever asks first, and a
//! swap hog faulting at the same moment may take them (a recovery hung so on 6.12: the
//! takeover's main thread in reclaim for one page of a tmpfs file, docs/recovery.md). An
//! allocation that may wait, made by a realtime task, is allowed down to half of each zone's
//! minimum watermark (the page allocator's `ALLOC_MIN_RESERVE` for `rt_task`), which no
//! ordinary task can take: the takeover's last allocations find pages the hog could not
//! have taken. Realtime also puts the takeover ahead of the hog on the CPU.
//!
//! Threads inherit their creator's policy, so every thread the takeover starts (queues,
//! helpers) is realtime too; [`end`] moves them all back once the device serves, before
//! anything that grows memory in bulk (the pool keeper, the room's commit) may run.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::sys::sched;

/// The lowest realtime priority: ahead of every ordinary task, behind the kernel's own.
const PRIORITY: i32 = 1;

/// Set by [`begin`], cleared by [`end`]: only a policy this module gave is taken back (a
/// daemon an administrator runs realtime keeps it).
static BEGUN: AtomicBool = AtomicBool::new(false);

/// Passes over the process's threads at most: a realtime thread may start another while
/// one pass runs (an io_uring worker, say), which the next pass then finds.
const PASSES: usize = 3;

/// Runs the calling thread, and every thread it starts from now on, as `SCHED_FIFO`.
pub fn begin() -> io::Result<()> {
    sched::set_fifo(0, PRIORITY)?;
    BEGUN.store(true, Ordering::Release);
    Ok(())
}

/// Whether [`begin`] made this process realtime and [`end`] has not yet taken it back.
pub fn begun() -> bool {
    BEGUN.load(Ordering::Acquire)
}

/// Whether thread `tid` (0: the calling thread) runs under a realtime policy (`SCHED_FIFO`,
/// `SCHED_RR`).
pub fn is_realtime(tid: sched::Tid) -> io::Result<bool> {
    sched::is_realtime(tid)
}

/// After [`begin`], moves every realtime thread of this process back to `SCHED_OTHER`, each
/// keeping its nice value (a thread that set one while realtime gets it now); without it,
/// does nothing. Returns how many threads it moved; on errors, the first one, after trying
/// every thread.
pub fn end() -> io::Result<usize> {
    if !BEGUN.swap(false, Ordering::AcqRel) {
        return Ok(0);
    }
    let mut moved = 0;
    let mut first_error = None;
    for _ in 0..PASSES {
        let before = moved;
        let tids = match threads() {
            Ok(tids) => tids,
            Err(e) => {
                // The threads could not be listed (no memory, no descriptor: most likely
                // while memory is short, when this runs): a later call tries again.
                BEGUN.store(true, Ordering::Release);
                return Err(e);
            }
        };
        for tid in tids {
            match is_realtime(tid) {
                Ok(true) => {}
                Ok(false) => continue,
                // exited since the directory was read
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            }
            match sched::set_normal(tid) {
                Ok(()) => moved += 1,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if moved == before {
            break;
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(moved),
    }
}

/// The ids of this process's threads.
fn threads() -> io::Result<Vec<sched::Tid>> {
    Ok(std::fs::read_dir("/proc/self/task")?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sys::sched::{gettid, nice_of, set_nice_of};

    #[test]
    fn threads_started_in_a_takeover_are_realtime_until_it_ends_and_keep_their_nice() {
        // All of it on a thread of its own, so that the harness's threads are never made
        // realtime.
        std::thread::spawn(|| {
            if let Err(err) = begin() {
                assert_eq!(
                    err.raw_os_error(),
                    Some(libc::EPERM),
                    "SCHED_FIFO refused: {err}"
                );
                println!("skipped: realtime priority needs CAP_SYS_NICE ({err})");
                return;
            }
            let me = gettid();
            assert!(is_realtime(me).unwrap());
            let (tx, rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let child = std::thread::spawn(move || {
                let tid = gettid();
                // as a queue thread does (`sys::set_thread_nice`), while still realtime
                set_nice_of(tid, 7).unwrap();
                tx.send(tid).unwrap();
                go_rx.recv().unwrap();
            });
            let tid = rx.recv().unwrap();
            assert!(
                is_realtime(tid).unwrap(),
                "a thread started by a realtime thread inherits its policy"
            );
            let moved = end().unwrap();
            assert!(
                moved >= 2,
                "moved {moved} threads, expected this one and its child"
            );
            assert!(!is_realtime(me).unwrap());
            assert!(!is_realtime(tid).unwrap());
            assert_eq!(
                nice_of(tid).unwrap(),
                7,
                "the nice value set while realtime holds"
            );
            assert_eq!(end().unwrap(), 0, "nothing left to move");
            go_tx.send(()).unwrap();
            child.join().unwrap();
        })
        .join()
        .unwrap();
    }
}

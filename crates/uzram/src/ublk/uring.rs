//! Each queue thread's io_uring, set up the way the kernel's own ublk selftest server
//! (tools/testing/selftests/ublk/kublk.c) sets up its rings: `COOP_TASKRUN | SINGLE_ISSUER |
//! DEFER_TASKRUN`.
//!
//! The queue thread is the ring's only user, and it always waits for completions in
//! `io_uring_enter`. `DEFER_TASKRUN` then runs the completion work (the driver handing a request
//! to the daemon) in that wait, in one go per wake-up, instead of interrupting the thread with
//! task work at arbitrary points; `SINGLE_ISSUER` lets the kernel skip the locking that several
//! submitters would need. libublk's default ring has `COOP_TASKRUN` only.
//!
//! A kernel that refuses the flags (io_uring older than 6.1) gets libublk's default ring.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};

use io_uring::{squeue, IoUring};
use libublk::UblkError;

/// `IORING_SETUP_COOP_TASKRUN`.
pub const SETUP_COOP_TASKRUN: u32 = 1 << 8;
/// `IORING_SETUP_SINGLE_ISSUER`.
pub const SETUP_SINGLE_ISSUER: u32 = 1 << 12;
/// `IORING_SETUP_DEFER_TASKRUN`.
pub const SETUP_DEFER_TASKRUN: u32 = 1 << 13;

/// The setup flags of the rings the queue threads got (the last one set up), for `uzram status`.
static RING_FLAGS: AtomicU32 = AtomicU32::new(0);

/// The io_uring setup flags of the queue rings, `IORING_SETUP_*` bits; 0 before the first
/// queue thread set up its ring.
pub fn setup_flags() -> u32 {
    RING_FLAGS.load(Ordering::Relaxed)
}

/// Creates the calling thread's queue ring (`sq` submission and `cq` completion entries), before
/// libublk's `UblkQueue::new` would create its default one. Returns the setup flags it got.
pub fn init_queue_ring(sq: u32, cq: u32) -> Result<u32, UblkError> {
    let mut got = 0;
    libublk::io::ublk_init_task_ring(|cell| {
        if cell.get().is_some() {
            return Ok(());
        }
        let tuned = IoUring::<squeue::Entry>::builder()
            .setup_cqsize(cq)
            .setup_coop_taskrun()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(sq);
        // The builder fails as a whole on a flag the kernel does not know.
        let (ring, flags) = match tuned {
            Ok(ring) => (
                ring,
                SETUP_COOP_TASKRUN | SETUP_SINGLE_ISSUER | SETUP_DEFER_TASKRUN,
            ),
            Err(err) => {
                tracing::warn!(error = %err, "io_uring refused DEFER_TASKRUN/SINGLE_ISSUER: using COOP_TASKRUN only");
                let ring = IoUring::<squeue::Entry>::builder()
                    .setup_cqsize(cq)
                    .setup_coop_taskrun()
                    .build(sq)
                    .map_err(UblkError::IOError)?;
                (ring, SETUP_COOP_TASKRUN)
            }
        };
        got = flags;
        cell.set(RefCell::new(ring))
            .map_err(|_| UblkError::OtherError(-libc::EEXIST))
    })?;
    if got != 0 {
        RING_FLAGS.store(got, Ordering::Relaxed);
    }
    Ok(got)
}

/// Names of the `IORING_SETUP_*` bits in `flags` that this module sets, for logs.
pub fn describe(flags: u32) -> String {
    let names: Vec<&str> = [
        (SETUP_COOP_TASKRUN, "coop-taskrun"),
        (SETUP_SINGLE_ISSUER, "single-issuer"),
        (SETUP_DEFER_TASKRUN, "defer-taskrun"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect();
    if names.is_empty() {
        "default".to_string()
    } else {
        names.join("+")
    }
}

/// A wait for completions (`io_uring_enter` with `submit_and_wait`) that is to be entered
/// again: cut short by a signal (`EINTR`), or refused for want of memory or completion-queue
/// room (`EAGAIN`, `EBUSY`), in which cases the kernel kept the submissions. The waits that
/// must see their reads and writes through (a disk read's worker, a writeback run, a
/// thread's first entry) use it; a queue's own loop has `retries::Retries`.
pub fn wait_again(err: &std::io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_the_kernels() {
        // include/uapi/linux/io_uring.h
        assert_eq!(SETUP_COOP_TASKRUN, 0x100);
        assert_eq!(SETUP_SINGLE_ISSUER, 0x1000);
        assert_eq!(SETUP_DEFER_TASKRUN, 0x2000);
        assert_eq!(describe(0x3100), "coop-taskrun+single-issuer+defer-taskrun");
        assert_eq!(describe(0), "default");
    }

    #[test]
    fn a_wait_cut_short_or_short_of_room_is_entered_again_and_a_failure_is_not() {
        let io = std::io::Error::from_raw_os_error;
        for code in [libc::EINTR, libc::EAGAIN, libc::EBUSY] {
            assert!(wait_again(&io(code)), "{code}");
        }
        for code in [libc::EBADF, libc::EINVAL, libc::EFAULT, libc::EIO] {
            assert!(!wait_again(&io(code)), "{code}");
        }
        assert!(!wait_again(&std::io::Error::other("no errno")));
    }

    #[test]
    fn a_tuned_ring_is_made_once_per_thread() {
        // No ublk needed: the ring is plain io_uring. A sandbox without io_uring skips.
        std::thread::spawn(|| match init_queue_ring(8, 16) {
            Ok(flags) => {
                assert_ne!(flags & SETUP_COOP_TASKRUN, 0, "{flags:#x}");
                // a second call keeps the first ring
                assert_eq!(init_queue_ring(8, 16).unwrap(), 0);
                let entries = libublk::io::with_task_io_ring(|r| r.params().cq_entries());
                assert_eq!(entries, 16);
            }
            Err(err) => eprintln!("skipping: no io_uring here: {err}"),
        })
        .join()
        .unwrap();
    }
}

//! What a queue thread's loop does when its io_uring fails it: which failed waits it waits
//! again, and how it stops spinning when every turn of the loop fails.
//!
//! Why the second: in a clean-clone CI run (7.3, `batch` mode, the swap hog) one queue
//! thread ran 395 of 400 seconds on its CPU, in user space, at nice -20, while it served no
//! request: the kernel held that queue's requests, kswapd and the hog waited for its tags,
//! and the guest made no progress for ten minutes. Which failure it met every turn is not
//! known (no error was logged: a wait cut short by a signal was waited again at once, and
//! libublk re-arms a batch fetch that completes with an error at once, logging only at debug
//! level). Both are now counted (`queue_retried_waits`, `queue_failed_commands` in `uzram
//! status`) and logged, and a loop whose turns keep failing without a request sleeps between
//! them, so that it no longer takes a CPU that reclaim needs.

use std::time::Duration;

use libublk::sys;

use super::server::RequestCounters;

/// A queue's wait for requests cut short by a signal (`EINTR`, from a stop signal or a
/// tracer): wait again; no completion was taken.
fn interrupted(err: &libublk::UblkError) -> bool {
    matches!(err, libublk::UblkError::IOError(e) if e.kind() == std::io::ErrorKind::Interrupted)
}

/// `io_uring_enter` refused for want of memory or completion-queue room (`EAGAIN`, `ENOMEM`,
/// `EBUSY`): the kernel kept the submissions, and the documented answer is to wait and enter
/// again. A swap daemon meets this when memory runs out, the one time it must not give up.
fn short_of_resources(err: &libublk::UblkError) -> bool {
    matches!(err, libublk::UblkError::IOError(e)
        if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM | libc::EBUSY)))
}

/// Turns in a row that fail (a retried wait, a ublk command completed with an error) and
/// serve no request, before the loop sleeps between turns. A loop that works has at most a
/// few such turns in a row (an interrupted wait; a batch fetch that ran out of buffers and
/// is re-armed once they are back).
const SPIN_TURNS: u32 = 32;
/// The first sleep once a loop spins; it doubles each turn up to [`MAX_NAP`].
const FIRST_NAP: Duration = Duration::from_micros(20);
/// The longest sleep between two failing turns.
const MAX_NAP: Duration = Duration::from_millis(1);

/// One queue thread's failed waits and failed ublk commands: which are waited again, how
/// often each came (counted in the thread's slot of [`RequestCounters`]), and when the loop
/// sleeps because every turn fails.
pub struct Retries<'a> {
    qid: u16,
    slot: u16,
    counters: &'a RequestCounters,
    short: u64,
    failed_commands: u64,
    /// This turn met a failure.
    failed_turn: bool,
    /// The last errno a failure of this turn carried (positive).
    last_errno: i32,
    /// Failing turns in a row that served no request.
    streak: u32,
}

impl<'a> Retries<'a> {
    /// For the thread of queue `qid` that counts in `slot` of `counters`.
    pub fn new(qid: u16, slot: u16, counters: &'a RequestCounters) -> Self {
        Retries {
            qid,
            slot,
            counters,
            short: 0,
            failed_commands: 0,
            failed_turn: false,
            last_errno: 0,
            streak: 0,
        }
    }

    /// Whether the queue should wait again after `err` (having slept where due: a
    /// millisecond when the kernel is short of resources); false for any other error.
    /// A shortage is logged at the 1st, 2nd, 4th, ... time, so that a long one does not
    /// flood the log; an interrupted wait (one a stop signal brings) only as part of a
    /// failing streak ([`Retries::turn_done`]).
    pub fn retry(&mut self, err: &libublk::UblkError) -> bool {
        if interrupted(err) {
            self.wait_failed(libc::EINTR);
            return true;
        }
        if !short_of_resources(err) {
            return false;
        }
        self.short += 1;
        if self.short.is_power_of_two() {
            tracing::warn!(qid = self.qid, error = %err, times = self.short, "entering the queue's io_uring failed; retrying");
        }
        let errno = match err {
            libublk::UblkError::IOError(e) => e.raw_os_error().unwrap_or(libc::EAGAIN),
            _ => libc::EAGAIN,
        };
        self.wait_failed(errno);
        std::thread::sleep(Duration::from_millis(1));
        true
    }

    /// A completion of one of the thread's ublk commands (not a request's own I/O) with
    /// result `res`: a negative result other than the device's abort is a failed command
    /// (a batch fetch that libublk re-arms at once, say), counted and logged at the 1st,
    /// 2nd, 4th, ... time.
    pub fn command_done(&mut self, res: i32) {
        if res >= 0 || res == sys::UBLK_IO_RES_ABORT {
            return;
        }
        self.failed_commands += 1;
        self.counters.count_failed_command(self.slot);
        if self.failed_commands.is_power_of_two() {
            tracing::warn!(
                qid = self.qid,
                error = %std::io::Error::from_raw_os_error(-res),
                times = self.failed_commands,
                "a ublk command of the queue failed"
            );
        }
        self.failed_turn = true;
        self.last_errno = -res;
    }

    /// Counts a failed wait that is waited again; it fails the turn.
    fn wait_failed(&mut self, errno: i32) {
        self.counters.count_retried_wait(self.slot);
        self.failed_turn = true;
        self.last_errno = errno;
    }

    /// The end of a turn of the loop, which handed `served` requests to the handler. After
    /// [`SPIN_TURNS`] failing turns in a row without a request, sleeps (20 µs, doubling to
    /// 1 ms), and logs the streak at each power of two.
    pub fn turn_done(&mut self, served: usize) {
        let failed = std::mem::take(&mut self.failed_turn);
        if served > 0 || !failed {
            self.streak = 0;
            return;
        }
        self.streak = self.streak.saturating_add(1);
        if let Some(nap) = nap_after(self.streak) {
            if self.streak.is_power_of_two() {
                tracing::warn!(
                    qid = self.qid,
                    turns = self.streak,
                    error = %std::io::Error::from_raw_os_error(self.last_errno),
                    "the queue's loop keeps failing without a request; sleeping between turns"
                );
            }
            std::thread::sleep(nap);
        }
    }
}

/// The sleep after the `streak`-th failing turn in a row, if any.
fn nap_after(streak: u32) -> Option<Duration> {
    let over = streak.checked_sub(SPIN_TURNS)?;
    Some(FIRST_NAP.saturating_mul(1 << over.min(16)).min(MAX_NAP))
}

#[cfg(test)]
mod tests {
    use super::*;
    use libublk::UblkError;

    fn io(code: i32) -> UblkError {
        UblkError::IOError(std::io::Error::from_raw_os_error(code))
    }

    fn counts(c: &RequestCounters) -> (u64, u64) {
        let s: std::collections::HashMap<String, u64> = c
            .snapshot()
            .into_iter()
            .map(|s| (s.name, s.value))
            .collect();
        (s["queue_retried_waits"], s["queue_failed_commands"])
    }

    #[test]
    fn a_wait_short_of_memory_is_retried_and_other_errors_are_not() {
        for code in [libc::EAGAIN, libc::ENOMEM, libc::EBUSY] {
            assert!(short_of_resources(&io(code)), "{code}");
            assert!(!interrupted(&io(code)), "{code}");
        }
        assert!(interrupted(&io(libc::EINTR)));
        assert!(!short_of_resources(&io(libc::EINTR)));
        for code in [libc::EBADF, libc::EINVAL, libc::ENXIO, libc::EFAULT] {
            assert!(!short_of_resources(&io(code)), "{code}");
            assert!(!interrupted(&io(code)), "{code}");
        }
        assert!(!short_of_resources(&UblkError::QueueIsDown));
        assert!(!short_of_resources(&UblkError::OtherError(-libc::EINVAL)));
        let counters = RequestCounters::new(2);
        let mut retries = Retries::new(0, 1, &counters);
        for code in [libc::EINTR, libc::EAGAIN, libc::ENOMEM, libc::EBUSY] {
            assert!(retries.retry(&io(code)), "{code}");
        }
        assert_eq!(retries.short, 3);
        assert!(!retries.retry(&io(libc::EBADF)));
        assert!(!retries.retry(&UblkError::QueueIsDown));
        assert_eq!(counts(&counters), (4, 0));
    }

    #[test]
    fn failed_commands_are_counted_and_an_abort_or_a_result_is_not() {
        let counters = RequestCounters::new(1);
        let mut retries = Retries::new(3, 0, &counters);
        for res in [0, 4096, sys::UBLK_IO_RES_ABORT] {
            retries.command_done(res);
        }
        assert!(!retries.failed_turn);
        retries.command_done(-libc::ENOBUFS);
        retries.command_done(-libc::ENOMEM);
        assert!(retries.failed_turn);
        assert_eq!(retries.last_errno, libc::ENOMEM);
        assert_eq!(counts(&counters), (0, 2));
    }

    #[test]
    fn a_loop_that_keeps_failing_without_a_request_sleeps_and_one_request_resets_it() {
        assert_eq!(nap_after(1), None);
        assert_eq!(nap_after(SPIN_TURNS - 1), None);
        assert_eq!(nap_after(SPIN_TURNS), Some(FIRST_NAP));
        assert_eq!(nap_after(SPIN_TURNS + 1), Some(FIRST_NAP * 2));
        assert_eq!(nap_after(SPIN_TURNS + 50), Some(MAX_NAP));
        assert_eq!(nap_after(u32::MAX), Some(MAX_NAP));

        let counters = RequestCounters::new(1);
        let mut retries = Retries::new(0, 0, &counters);
        // Turns that fail without a request build the streak; turns without a failure
        // (an idle wait's timeout, a commit's completion) and turns that serve end it.
        for _ in 0..SPIN_TURNS - 1 {
            retries.command_done(-libc::ENOBUFS);
            retries.turn_done(0);
        }
        assert_eq!(retries.streak, SPIN_TURNS - 1);
        retries.turn_done(0);
        assert_eq!(retries.streak, 0, "a turn without a failure");
        for _ in 0..SPIN_TURNS + 3 {
            retries.command_done(-libc::ENOBUFS);
            retries.turn_done(0);
        }
        assert_eq!(retries.streak, SPIN_TURNS + 3);
        // The spinning turns slept: 20 + 40 + 80 + 160 µs at least.
        let start = std::time::Instant::now();
        retries.command_done(-libc::ENOBUFS);
        retries.turn_done(0);
        assert!(start.elapsed() >= FIRST_NAP * 16, "{:?}", start.elapsed());
        retries.command_done(-libc::ENOBUFS);
        retries.turn_done(1);
        assert_eq!(retries.streak, 0, "a turn that served");
        assert!(retries.retry(&io(libc::EINTR)));
        retries.turn_done(0);
        assert_eq!(retries.streak, 1, "an interrupted wait is a failing turn");
    }
}

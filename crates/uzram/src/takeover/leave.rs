//! Leaving the device to the next daemon the way a crash leaves it: the process exits without
//! stopping or deleting the device, so the kernel holds it (quiesced, `UBLK_F_USER_RECOVERY`)
//! with its pending requests, and the store stays in shared memory. The handover of a planned
//! restart ends so, and so does a queue that can serve no more: deleting the device there, as
//! the daemon did, took every page in swap with it, where the standby (or the unit's restart,
//! or `uzram recover` for a created device) takes it over and loses nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Exit status of a daemon whose queue failed (EX_SOFTWARE): non-zero, so that systemd's
/// `Restart=on-failure` starts the unit again.
pub const QUEUE_FAILED_EXIT: i32 = 70;

static STOPPING: AtomicBool = AtomicBool::new(false);
static LEAVING: AtomicBool = AtomicBool::new(false);

/// How long the exit waits for the counts to be saved: the thread that leaves may hold a
/// lock the saver takes (a panic on the write path holds its shard's, or the arena's), and
/// the device must not wait on it.
const SAVE_WAIT: Duration = Duration::from_secs(1);
static SAVE_COUNTS: OnceLock<Arc<dyn Fn() + Send + Sync>> = OnceLock::new();

/// The daemon is stopping its device on purpose (a stop request or signal): from now on a
/// queue error ends that queue, as the stop ends them all, and the device is deleted.
pub fn stopping() {
    STOPPING.store(true, Ordering::Release);
}

/// Whether [`stopping`] was called.
pub fn is_stopping() -> bool {
    STOPPING.load(Ordering::Acquire)
}

/// What saves the counts for the next daemon (`carry.rs`) before the process leaves.
pub fn save_counts_with(save: Arc<dyn Fn() + Send + Sync>) {
    let _ = SAVE_COUNTS.set(save);
}

/// Saves the counts (on a thread of their own, for at most [`SAVE_WAIT`]) and ends the
/// process at once with `code`; nothing else of ours runs (no device deletion, no removal of
/// the state the next daemon reads). A second caller, the saver's own panic among them, ends
/// the process without waiting.
pub fn exit_leaving_device(code: i32) -> ! {
    if LEAVING.swap(true, Ordering::AcqRel) {
        crate::sys::exit_now(code)
    }
    if let Some(save) = SAVE_COUNTS.get().cloned() {
        let (done, saved) = std::sync::mpsc::channel();
        let saver = std::thread::Builder::new()
            .name("save-counts".into())
            .spawn(move || {
                save();
                let _ = done.send(());
            });
        if saver.is_ok() {
            let _ = saved.recv_timeout(SAVE_WAIT);
        }
    }
    crate::sys::exit_now(code)
}

/// Queue `qid` can serve no more (`err`): unless the device is being stopped, leave it to the
/// next daemon and exit with [`QUEUE_FAILED_EXIT`]. Returns only while stopping.
pub fn queue_failed(qid: u16, err: &dyn std::fmt::Display) {
    if is_stopping() {
        tracing::error!(qid, error = %err, "a queue failed while the device stops");
        return;
    }
    tracing::error!(
        qid,
        error = %err,
        "a queue can serve no more: leaving the device, its pages and its requests to the next \
         daemon (the standby, the unit's restart, or `uzram recover` for a created device)"
    );
    exit_after_logging()
}

/// Ends the process as [`exit_leaving_device`] with [`QUEUE_FAILED_EXIT`], a moment after
/// the caller's log line: it goes through the log thread's queue.
pub fn exit_after_logging() -> ! {
    std::thread::sleep(Duration::from_millis(50));
    exit_leaving_device(QUEUE_FAILED_EXIT)
}

static PANICKED_STARTING: AtomicBool = AtomicBool::new(false);

/// From now until [`leave_device_on_panic`], a panic in any thread (a service the device's
/// start spawned) is noted for [`panicked_while_starting`]: the device is not serving yet,
/// so the start fails and a new device is removed, where the thread alone would have ended
/// and the device served on without it (a pool keeper, a room thread).
pub fn note_panics_while_starting() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        PANICKED_STARTING.store(true, Ordering::Release);
        tracing::error!(
            panic = %info,
            "a daemon thread panicked while the device started (a bug: please report it)"
        );
    }));
}

/// Whether a thread panicked since [`note_panics_while_starting`].
pub fn panicked_while_starting() -> bool {
    PANICKED_STARTING.load(Ordering::Acquire)
}

/// From now on a panic in any thread ends the process as a failed queue does (unless the
/// device is being stopped): a panic is a bug, and one that ended a queue thread, or a thread
/// a queue waits on, would leave that queue gone for good while the process lived on holding
/// the device, so that nothing took it over and its swap hung.
pub fn leave_device_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        if is_stopping() {
            return;
        }
        tracing::error!(
            panic = %info,
            "a daemon thread panicked (a bug: please report it): leaving the device, its pages \
             and its requests to the next daemon"
        );
        exit_after_logging()
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHILD: &str = "UZRAM_TEST_LEAVE_CHILD";

    /// Run in a child process by the test below: registers a count saver that writes a file,
    /// then fails a queue.
    #[test]
    fn leave_child() {
        let Some(marker) = std::env::var_os(CHILD) else {
            return;
        };
        saves_counts_to(marker);
        queue_failed(3, &"io_uring_enter: EBADF");
        // Not reached: queue_failed exits.
        std::process::exit(0);
    }

    /// Registers a count saver that writes `marker` (in a child process).
    fn saves_counts_to(marker: std::ffi::OsString) {
        let marker = std::path::PathBuf::from(marker);
        save_counts_with(Arc::new(move || {
            let _ = std::fs::write(&marker, b"saved");
        }));
    }

    /// Runs test `child` of this binary in a process of its own, `env` naming a marker file:
    /// the child's exit code, and whether its counts were saved. A child that has not exited
    /// after 30 s is killed and fails the test (it hung).
    fn run_child(child: &str, env: &str) -> (Option<i32>, bool) {
        let marker = std::env::temp_dir().join(format!("uzram-{child}-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        let mut proc = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", child, "--test-threads=1"])
            .env(env, &marker)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(status) = proc.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = proc.kill();
                let _ = proc.wait();
                panic!("{child} did not exit within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let saved = std::fs::read(&marker).is_ok_and(|b| b == b"saved");
        let _ = std::fs::remove_file(&marker);
        (status.code(), saved)
    }

    #[test]
    fn a_failed_queue_saves_the_counts_and_exits_without_returning() {
        let (code, saved) = run_child("takeover::leave::tests::leave_child", CHILD);
        assert_eq!(code, Some(QUEUE_FAILED_EXIT));
        assert!(saved);
    }

    const PANIC_CHILD: &str = "UZRAM_TEST_PANIC_CHILD";

    /// Run in a child process by the test below: a thread panics after the hook is set.
    #[test]
    fn panic_child() {
        let Some(marker) = std::env::var_os(PANIC_CHILD) else {
            return;
        };
        saves_counts_to(marker);
        leave_device_on_panic();
        let _ = std::thread::spawn(|| panic!("a bug on a queue thread")).join();
        // Not reached: the hook exits.
        std::process::exit(0);
    }

    #[test]
    fn a_panicking_thread_saves_the_counts_and_leaves_the_device() {
        let (code, saved) = run_child("takeover::leave::tests::panic_child", PANIC_CHILD);
        assert_eq!(code, Some(QUEUE_FAILED_EXIT));
        assert!(saved);
    }

    const STARTING_PANIC_CHILD: &str = "UZRAM_TEST_STARTING_PANIC_CHILD";

    /// Run in a child process by the test below: a service thread panics while the device
    /// starts; the start sees it, and the process goes on (exit 3: seen, 4: missed).
    #[test]
    fn starting_panic_child() {
        if std::env::var_os(STARTING_PANIC_CHILD).is_none() {
            return;
        }
        note_panics_while_starting();
        assert!(!panicked_while_starting());
        let _ = std::thread::spawn(|| panic!("a bug in the pool keeper")).join();
        std::process::exit(if panicked_while_starting() { 3 } else { 4 });
    }

    #[test]
    fn a_thread_that_panics_while_the_device_starts_fails_the_start() {
        let (code, saved) = run_child(
            "takeover::leave::tests::starting_panic_child",
            STARTING_PANIC_CHILD,
        );
        assert_eq!(code, Some(3));
        assert!(!saved, "nothing leaves the device before it serves");
    }

    const LOCKED_PANIC_CHILD: &str = "UZRAM_TEST_LOCKED_PANIC_CHILD";

    /// Run in a child process by the test below: the count saver takes a lock, and a thread
    /// panics while it holds that lock (as a panic on the write path holds its shard's).
    #[test]
    fn locked_panic_child() {
        if std::env::var_os(LOCKED_PANIC_CHILD).is_none() {
            return;
        }
        static SHARD: std::sync::Mutex<u64> = std::sync::Mutex::new(0);
        save_counts_with(Arc::new(|| {
            let _counts = SHARD.lock();
        }));
        leave_device_on_panic();
        let _ = std::thread::spawn(|| {
            let _held = SHARD.lock().unwrap();
            panic!("a bug under a shard lock");
        })
        .join();
        std::process::exit(0);
    }

    #[test]
    fn a_panic_under_a_lock_the_saver_takes_still_leaves_the_device() {
        let (code, _) = run_child(
            "takeover::leave::tests::locked_panic_child",
            LOCKED_PANIC_CHILD,
        );
        assert_eq!(code, Some(QUEUE_FAILED_EXIT));
    }

    #[test]
    fn while_stopping_a_failed_queue_returns() {
        // The only test in this process that sets the flag; the child above runs in its own.
        stopping();
        assert!(is_stopping());
        queue_failed(0, &"any error");
    }
}

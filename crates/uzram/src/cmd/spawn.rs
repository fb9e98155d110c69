//! Starting `uzram daemon` detached and waiting for its report (`uzram create`, `uzram
//! recover`): the daemon reports `READY`, `STOPPED` or `ERROR` on a pipe, and its log goes to
//! a file under `/run/uzram` until it knows its device id.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context;

use crate::control::state::StateDir;
use crate::sys;

/// How long `create` waits for the daemon to report.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Starts `uzram daemon ARGS` detached, waits until it serves and returns the device path;
/// on failure shows its message and the end of its log.
pub fn start_detached(daemon_args: Vec<String>) -> anyhow::Result<String> {
    match spawn_detached(daemon_args, Some(START_TIMEOUT))?.0 {
        Started::Serving(dev) => Ok(dev),
        Started::Stopped => {
            anyhow::bail!("the daemon reported a stopped device it did not wait for")
        }
    }
}

/// What a detached daemon reported.
pub enum Started {
    /// It serves the device at this path.
    Serving(String),
    /// `uzram daemon --wait`: the device it waited for went with its daemon.
    Stopped,
}

/// Starts `uzram daemon ARGS` detached and waits for its report, giving up after `within`
/// (`None`: a daemon started with `--wait` reports only after the running daemon exits, which
/// may be days away). Returns the report and the daemon, which is this process's child (a
/// caller that outlives it reaps it).
pub fn spawn_detached(
    daemon_args: Vec<String>,
    within: Option<Duration>,
) -> anyhow::Result<(Started, std::process::Child)> {
    let states = StateDir::default();
    states.create()?;
    // A name of its own for each daemon started: `recover --keep` starts a successor as soon
    // as the one before reports, which renames its log only after that.
    static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let seq = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log_path = states
        .path()
        .join(format!("pending-{}-{seq}.log", std::process::id()));
    // One an earlier process of this pid left behind.
    let _ = std::fs::remove_file(&log_path);
    let log = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let (ready_rx, ready_tx) = sys::inheritable_pipe().context("creating the readiness pipe")?;
    let mut cmd = this_binary();
    cmd.arg("daemon")
        .args(daemon_args)
        .arg("--ready-fd")
        .arg(ready_tx.as_raw_fd().to_string())
        .arg("--log")
        .arg(&log_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicating the log file")?)
        .stderr(log);
    if std::env::var_os("UZRAM_LOG").is_none() {
        cmd.env("UZRAM_LOG", "info");
    }
    let mut child = cmd.spawn().context("starting the daemon")?;
    drop(ready_tx);

    // Read the daemon's one line on a helper thread so the wait can time out.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let r = BufReader::new(std::fs::File::from(ready_rx)).read_line(&mut line);
        let _ = tx.send(r.map(|_| line));
    });
    let report = match within {
        Some(within) => rx.recv_timeout(within).ok(),
        None => rx.recv().ok(),
    };
    let line = match report {
        Some(Ok(line)) => line,
        Some(Err(err)) => return Err(err).context("reading the daemon's readiness pipe"),
        None => {
            let _ = child.kill();
            // Reaped if it goes within 5 s; a daemon stuck in the kernel may not.
            for _ in 0..50 {
                if !matches!(child.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            show_log_tail(&log_path);
            anyhow::bail!(
                "the daemon did not report within {}s and was killed; its log: {}",
                within.unwrap_or_default().as_secs(),
                log_path.display()
            );
        }
    };
    let line = line.trim_end();
    if let Some(rest) = line.strip_prefix("READY ") {
        let dev = rest.split_whitespace().nth(1).unwrap_or_default();
        if dev.is_empty() {
            anyhow::bail!("the daemon sent a malformed readiness line {line:?}");
        }
        return Ok((Started::Serving(dev.to_string()), child));
    }
    if line == "STOPPED" {
        let _ = child.wait();
        let _ = std::fs::remove_file(&log_path);
        return Ok((Started::Stopped, child));
    }
    // Failed: reap the daemon, show its message and the end of its log.
    let status = child.wait().ok();
    show_log_tail(&log_path);
    let _ = std::fs::remove_file(&log_path);
    match line.strip_prefix("ERROR ") {
        Some(msg) => anyhow::bail!("{msg}"),
        None => anyhow::bail!(
            "the daemon exited ({}) before the device was ready",
            status.map_or("unknown status".to_string(), |s| s.to_string())
        ),
    }
}

/// A command that runs this very binary, even after a package upgrade replaced the file at
/// its path (a long-lived standby starts its successors so): `/proc/self/exe` names the
/// running binary, whose store format the successor must share, where the path would name
/// the new one, or nothing while the upgrade swaps it (`current_exe` then ends in
/// " (deleted)"). Its `argv[0]` is the path it was started from, for `ps`.
pub fn this_binary() -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("/proc/self/exe");
    let name = std::env::args_os()
        .next()
        .unwrap_or_else(|| std::ffi::OsString::from("uzram"));
    cmd.arg0(name);
    cmd
}

/// Prints the last lines of a daemon's log to stderr.
fn show_log_tail(log_path: &std::path::Path) {
    let mut tail = String::new();
    if let Ok(mut f) = std::fs::File::open(log_path) {
        let _ = f.read_to_string(&mut tail);
    }
    let tail: Vec<&str> = tail.lines().rev().take(10).collect();
    for l in tail.iter().rev() {
        eprintln!("uzram: daemon log: {l}");
    }
}

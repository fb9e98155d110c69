//! `uzram create`: start a detached daemon for one device and print its path when it serves.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::process::{ExitCode, Stdio};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::Context;

use crate::cli::{CreateArgs, DaemonArgs};
use crate::control::state::StateDir;
use crate::daemon::{self, Launch, Readiness, Reporter};
use crate::sys;

/// How long `create` waits for the daemon to report.
const START_TIMEOUT: Duration = Duration::from_secs(120);

pub fn run(args: CreateArgs) -> anyhow::Result<ExitCode> {
    let config = args.device.raw().validate()?;
    super::require_root()?;
    super::require_module()?;
    if args.foreground {
        let launch = Launch {
            config,
            config_path: None,
            log: None,
            recover: None,
            create_args: Some(args.device.to_args()),
            bridge: false,
            pause: None,
            lock: None,
        };
        daemon::serve(launch, Arc::new(Reporter::new(Readiness::Stdout)))?;
        return Ok(ExitCode::SUCCESS);
    }
    let dev = start_detached(args.device.to_args())?;
    println!("{dev}");
    if args.standby {
        start_standby(&dev).with_context(|| {
            format!("{dev} serves, but its standby did not start: run uzram recover --wait --keep {dev}")
        })?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts `uzram recover --wait --keep DEV`, detached, logging to the kernel's log: a file
/// on tmpfs could have its pages in swap on the very device the standby waits to recover.
/// Warnings only (unless UZRAM_LOG says otherwise): the kernel drops a burst of user lines.
fn start_standby(dev: &str) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding the uzram binary")?;
    let log = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["recover", "--wait", "--keep", dev])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // Not waited for: it outlives this command, and its parent becomes init.
    let child = cmd.spawn().context("starting the standby")?;
    tracing::info!(%dev, pid = child.id(), "standby started");
    Ok(())
}

/// Starts `uzram daemon ARGS` detached, waits until it serves and returns the device path;
/// on failure shows its message and the end of its log.
pub(super) fn start_detached(daemon_args: Vec<String>) -> anyhow::Result<String> {
    let states = StateDir::default();
    states.create()?;
    let log_path = states
        .path()
        .join(format!("pending-{}.log", std::process::id()));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let (ready_rx, ready_tx) = sys::inheritable_pipe().context("creating the readiness pipe")?;
    let exe = std::env::current_exe().context("finding the uzram binary")?;
    let mut cmd = std::process::Command::new(exe);
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
    let line = match rx.recv_timeout(START_TIMEOUT) {
        Ok(Ok(line)) => line,
        Ok(Err(err)) => return Err(err).context("reading the daemon's readiness pipe"),
        Err(_) => {
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
                START_TIMEOUT.as_secs(),
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
        return Ok(dev.to_string());
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

/// The detached daemon `create` starts (hidden subcommand).
pub fn daemon(args: DaemonArgs) -> anyhow::Result<ExitCode> {
    let fd = sys::adopt_fd(args.ready_fd).context("the --ready-fd descriptor")?;
    let reporter = Arc::new(Reporter::new(Readiness::Pipe(fd)));
    let result = (|| {
        let config = args.device.raw().validate()?;
        super::require_root()?;
        super::require_module()?;
        if let Err(err) = sys::new_session() {
            tracing::warn!(error = %err, "setsid failed");
        }
        let launch = Launch {
            config,
            config_path: None,
            log: args.log.clone(),
            recover: args.recover,
            create_args: Some(args.device.to_args()),
            bridge: false,
            // A recovery's steps are timed from this process's start, the first step being
            // its start-up ("exec"): when the old daemon died, only whoever started us knows
            // (crashkill prints the whole pause).
            pause: args
                .recover
                .map(|_| crate::daemon::pause::PauseClock::since_start()),
            lock: None,
        };
        daemon::serve(launch, reporter.clone())
    })();
    if let Err(err) = &result {
        tracing::error!("{err:#}");
        reporter.failed(err);
    }
    result.map(|()| ExitCode::SUCCESS)
}

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
    let config = args
        .device
        .raw()
        .validate(crate::config::Host::current()?)?;
    super::require_root()?;
    super::require_module()?;
    if args.foreground {
        let launch = Launch {
            config,
            config_path: None,
            log: None,
            recover: None,
            settings: Some(Box::new(args.device.raw())),
            bridge: false,
            pause: None,
            lock: None,
        };
        daemon::serve(launch, Arc::new(Reporter::new(Readiness::Stdout)))?;
        return Ok(ExitCode::SUCCESS);
    }
    let dev = start_detached(args.device.to_args())?;
    println!("{dev}");
    if args.no_standby {
        eprintln!(
            "uzram: warning: {dev} has no standby (--no-standby): if its daemon dies, its I/O \
             waits until `uzram recover {dev}` starts a new one, and under memory pressure \
             nothing may be able to start; `uzram recover --wait --keep {dev}` starts one later"
        );
    } else {
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
    match spawn_detached(daemon_args, Some(START_TIMEOUT))?.0 {
        Started::Serving(dev) => Ok(dev),
        Started::Stopped => {
            anyhow::bail!("the daemon reported a stopped device it did not wait for")
        }
    }
}

/// What a detached daemon reported.
pub(super) enum Started {
    /// It serves the device at this path.
    Serving(String),
    /// `uzram daemon --wait`: the device it waited for went with its daemon.
    Stopped,
}

/// Starts `uzram daemon ARGS` detached and waits for its report, giving up after `within`
/// (`None`: a daemon started with `--wait` reports only after the running daemon exits, which
/// may be days away). Returns the report and the daemon, which is this process's child (a
/// caller that outlives it reaps it).
pub(super) fn spawn_detached(
    daemon_args: Vec<String>,
    within: Option<Duration>,
) -> anyhow::Result<(Started, std::process::Child)> {
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
        let config = args
            .device
            .raw()
            .validate(crate::config::Host::current()?)?;
        super::require_root()?;
        super::require_module()?;
        if let Err(err) = sys::new_session() {
            tracing::warn!(error = %err, "setsid failed");
        }
        // A recovery's steps are timed from this process's start, the first step being its
        // start-up ("exec"): when the old daemon died, only whoever started us knows
        // (crashkill prints the whole pause). One started before the crash (`--wait`) times
        // them from when it saw the old daemon gone.
        let mut pause = args
            .recover
            .map(|_| crate::daemon::pause::PauseClock::since_start());
        let mut lock = None;
        if let (true, Some(id)) = (args.wait, args.recover) {
            match wait_to_take_over(&config, id)? {
                Some((clock, locked)) => {
                    pause = Some(clock);
                    lock = Some(locked);
                }
                None => {
                    tracing::info!(id, "the device was stopped: nothing to take over");
                    reporter.stopped();
                    return Ok(());
                }
            }
        }
        let launch = Launch {
            config,
            config_path: None,
            log: args.log.clone(),
            recover: args.recover,
            settings: Some(Box::new(args.device.raw())),
            bridge: false,
            pause,
            lock,
        };
        daemon::serve(launch, reporter.clone())
    })();
    if let Err(err) = &result {
        tracing::error!("{err:#}");
        reporter.failed(err);
    }
    result.map(|()| ExitCode::SUCCESS)
}

/// `uzram daemon --recover N --wait`, before the crash: makes what serving device N will need
/// (heap, locked I/O buffers, the binary's code in memory) while memory is to be had, waits
/// until N's daemon exits, and then gives the store's recovery room back (mapped before, so
/// that needs no memory), and if the device waits for a new daemon, locks it and returns the
/// pause's clock and the lock. `None`: the device went
/// with its daemon.
///
/// Why before: a daemon started after a crash under swap pressure must get every page of its
/// start-up from a system where nothing can be swapped out until it serves. The room it is
/// given back for that can be taken first by the very processes that wait on the device
/// (seen on 7.3: docs/recovery.md). Started before, it takes only what it did not make.
fn wait_to_take_over(
    config: &crate::config::DeviceConfig,
    id: u32,
) -> anyhow::Result<Option<(crate::daemon::pause::PauseClock, std::fs::File)>> {
    sys::mlock_all().context("mlockall(MCL_CURRENT|MCL_FUTURE)")?;
    daemon::prepare_takeover(config);
    // Before the wait: the crash wakes this thread ahead of every ordinary task.
    daemon::take_over_at_realtime();
    let dev = crate::devname::dev_path(id);
    let states = StateDir::default();
    states.create()?;
    // The dead daemon's pid and the pause since it died, when another recoverer took the
    // lock first: this one waits for that one's record, then for its death.
    let mut lost: Option<(u32, crate::daemon::pause::PauseClock)> = None;
    let (mut clock, lock) = loop {
        let record = super::recover::waitable_record(id)?;
        let clock = match lost.take() {
            // the winner does not serve yet (or gave up, and the lock is free again)
            Some((pid, clock)) if pid == record.pid => clock,
            other => {
                if let (Some(_), Some(shm)) = (other, record.store_shm) {
                    // The winner serves (its record is out). Had this recoverer given the
                    // room back late, after the winner committed it again, the next crash
                    // would find none: committing it once more costs nothing if it is there.
                    crate::daemon::region::restore_room(shm);
                }
                tracing::info!(%dev, pid = record.pid, "waiting for the device's daemon to exit");
                // The room is given back as the first thing once the daemon is dying, before
                // anything allocates: memory for everything after. (A recoverer that loses
                // the race for the lock gave it back too, at the same moment as the winner,
                // long before the winner serves and commits it again.)
                let room = super::recover::RoomAhead::map(&record);
                let woke = room.wait_for_daemon(record.pid, record.started)?;
                // A stopped daemon deletes its device before it exits: nothing to recover,
                // and the per-CPU lists held short for the room go back to the default.
                if !crate::devname::in_kernel(id) {
                    crate::daemon::free_lists::restore();
                    return Ok(None);
                }
                let mut clock = crate::daemon::pause::PauseClock::starting(woke);
                clock.step("room");
                clock
            }
        };
        match states.try_lock(id)? {
            Some(lock) => break (clock, lock),
            None => {
                lost = Some((record.pid, clock));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    tracing::warn!(%dev, "the device's daemon died: taking the device over");
    let state = super::recover::wait_orphan(id)
        .map_err(|why| anyhow::anyhow!("{dev} cannot be recovered: {why}"))?;
    clock.step("quiesced");
    // Only if the room could not be mapped ahead (given back already: nothing done).
    super::recover::make_room(&state);
    Ok(Some((clock, lock)))
}

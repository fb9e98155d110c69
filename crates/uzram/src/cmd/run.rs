//! `uzram run --config FILE`: serve in the foreground for systemd (`Type=notify`); and
//! `uzram standby`, which takes the device over when that daemon dies (`handover`).

use std::fs::File;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cli::{RunArgs, StandbyArgs};
use crate::config::load_device_config;
use crate::control::state::{DaemonState, StateDir};
use crate::daemon::{self, Launch, Readiness, Reporter};
use crate::sys;
use crate::takeover::pause::{self, PauseClock};

/// How long `uzram run` waits for another daemon that is taking the device over (a standby
/// after a crash) to serve, so that it can take the device from it.
const OTHER_TAKEOVER_WAIT: Duration = Duration::from_secs(60);

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let cfg = load_device_config(&args.config)?;
    super::require_root()?;
    super::require_module()?;
    let config_path = std::fs::canonicalize(&args.config).unwrap_or(args.config);
    let states = StateDir::default();
    states.create()?;
    // A bridge takes the device from the unit's daemon; the unit's next daemon takes it from
    // a bridge (`handover`).
    let from = (!args.bridge).then_some(true);
    let mut pause: Option<PauseClock> = None;
    let start = Instant::now();
    let mut told = false;
    let orphan = loop {
        // Once the old daemon has gone the device is paused, and the state files are on
        // tmpfs, whose pages may be in swap on it: never read them again (a guest run
        // blocked for good in that read).
        let live = match pause {
            None => super::handover::live_daemon(&states, &config_path, from),
            Some(_) => None,
        };
        match live {
            Some(live) => {
                // The device pauses once the other daemon is gone: nothing of ours may be
                // swapped out to it from here on (memory not yet touched is locked as it is
                // faulted in).
                sys::mlock_all().map_err(|e| anyhow::anyhow!("mlockall: {e}"))?;
                if pause.is_none() {
                    // While the old daemon still serves: its room first (memory for what
                    // follows; it is committed again once we serve), then what needs no
                    // pause.
                    crate::takeover::orphan::make_room(&live);
                    daemon::prepare_takeover(&cfg.device);
                }
                tracing::info!(dev = %live.dev, pid = live.pid, bridge = live.bridge, "taking the device over from its running daemon");
                let mut clock = PauseClock::now();
                if let Err(err) = super::handover::request(&live) {
                    if let Some(shm) = live.store_shm {
                        crate::takeover::store_segment::restore_room(shm, Some(live.id));
                    }
                    crate::memory::free_lists::restore();
                    return Err(err);
                }
                clock.step("old daemon exits");
                pause = Some(clock);
            }
            None if args.bridge && pause.is_none() => anyhow::bail!(
                "no running daemon was started from {}: nothing to bridge",
                config_path.display()
            ),
            None => {}
        }
        match take_orphan(&states, &config_path)? {
            Taken::Orphan(state, lock) => break Some((state, lock)),
            // The daemon we asked to hand over has gone, yet its device does not show as
            // waiting (seen once in the guest, cause unknown): a new device now would leave
            // that one, and whatever is in swap on it, without a daemon. Look again.
            Taken::Nothing if pause.is_some() && start.elapsed() < OTHER_TAKEOVER_WAIT => {
                if !told {
                    told = true;
                    tracing::warn!("the device handed over does not show as waiting for a daemon yet; looking again");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Taken::Nothing if pause.is_some() => anyhow::bail!(
                "the device of {} was handed over but never showed as waiting for a daemon",
                config_path.display()
            ),
            Taken::Nothing => break None,
            Taken::Busy(dev) if start.elapsed() < OTHER_TAKEOVER_WAIT => {
                if !told {
                    told = true;
                    tracing::info!(%dev, "another daemon is taking the device over; this one takes it from that one once it serves");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Taken::Busy(dev) => anyhow::bail!(
                "{dev}: another daemon has been taking the device over for {} s",
                OTHER_TAKEOVER_WAIT.as_secs()
            ),
        }
    };
    if args.bridge && orphan.is_none() {
        anyhow::bail!(
            "the device of {} was handed over but cannot be taken over: see the log above",
            config_path.display()
        );
    }
    pause::step(&mut pause, "find the device");
    if let Some((state, _)) = &orphan {
        tracing::info!(id = state.id, config = %config_path.display(), "this config's device lost its daemon: recovering it");
    }
    serve_config(cfg.device, config_path, orphan, args.bridge, pause)
}

/// Serves the device of the config at `config_path` (canonical): the `orphan` this process
/// locked, after giving its recovery room back, or else a new device.
fn serve_config(
    config: crate::config::DeviceConfig,
    config_path: std::path::PathBuf,
    orphan: Option<(DaemonState, File)>,
    bridge: bool,
    mut pause: Option<PauseClock>,
) -> anyhow::Result<ExitCode> {
    let (recover, lock) = match orphan {
        Some((state, lock)) => {
            crate::takeover::orphan::make_room(&state);
            pause::step(&mut pause, "room");
            (Some(state.id), Some(lock))
        }
        None => (None, None),
    };
    let launch = Launch {
        config,
        config_path: Some(config_path),
        log: None,
        recover,
        settings: None,
        bridge,
        pause,
        lock,
    };
    daemon::serve(launch, Arc::new(Reporter::new(Readiness::Systemd)))?;
    Ok(ExitCode::SUCCESS)
}

/// What `take_orphan` found.
enum Taken {
    /// The config's device waits for a daemon, and this process now holds its lock.
    Orphan(DaemonState, File),
    /// No device of this config waits for a daemon.
    Nothing,
    /// One does, but another process holds its lock (it is taking the device over), or the
    /// device's daemon process has not exited yet.
    Busy(String),
}

/// Locks the device of `config` whose daemon died, then waits for the kernel to hold it for
/// recovery. The lock comes first: while another daemon adopts the store, the device stops
/// looking quiesced, and waiting for that would only time out.
fn take_orphan(states: &StateDir, config: &Path) -> anyhow::Result<Taken> {
    let Some(dead) = crate::takeover::orphan::dead_record_of_config(config) else {
        // A daemon of this config that does not serve as a live one (the caller asked
        // first) but whose process is still there: most likely killed and still exiting.
        // Its device waits for a daemon once it is gone; a new device now would leave that
        // one, and whatever is in swap on it, without a daemon (seen in the guest: a standby
        // killed right after it took the device over).
        if let Some(running) = crate::takeover::orphan::running_record_of_config(config) {
            return Ok(Taken::Busy(running.dev));
        }
        return Ok(Taken::Nothing);
    };
    let Some(lock) = states.try_lock(dead.id)? else {
        return Ok(Taken::Busy(dead.dev));
    };
    match crate::takeover::orphan::wait_orphan(dead.id) {
        Ok(state) => Ok(Taken::Orphan(state, lock)),
        Err(why) => {
            tracing::warn!(dev = %dead.dev, why, "a device of this config lost its daemon but cannot be recovered");
            Ok(Taken::Nothing)
        }
    }
}

/// How long the standby tries again while another process holds the dead daemon's device.
const STANDBY_BUSY_WAIT: Duration = Duration::from_secs(5);

/// `uzram standby --config FILE --pid PID`: started by the unit's daemon (PID) in a scope of
/// its own, it waits for that daemon to exit. If the daemon died leaving its device paused,
/// the standby takes the device over at once, as a bridge, until the unit's next daemon takes
/// it from there: a crash then never waits for systemd to start a daemon, which it cannot do
/// while its own pages are in swap on the paused device.
pub fn standby(args: StandbyArgs) -> anyhow::Result<ExitCode> {
    let cfg = load_device_config(&args.config)?;
    super::require_root()?;
    let config_path = std::fs::canonicalize(&args.config).unwrap_or(args.config);
    // What it has touched so far stays in RAM; the rest is locked as it is touched.
    sys::mlock_all().map_err(|e| anyhow::anyhow!("mlockall: {e}"))?;
    // The code a takeover runs is not faulted in from a swap device that waits for it.
    if let Err(err) = crate::memory::fault_guard::populate_file_code() {
        tracing::warn!(error = %err, "populating the binary's code failed");
    }
    // Before the wait: the crash wakes this thread ahead of every ordinary task, and the
    // takeover's allocations may use what they cannot (`memory::realtime`).
    crate::daemon::take_over_at_realtime();
    // Its daemon's store room, mapped now: given back the moment the daemon is gone, before
    // anything here allocates (after a crash under swap pressure, nothing else frees memory).
    let room = crate::takeover::orphan::running_record_of_config(&config_path)
        .filter(|s| s.pid == args.pid)
        .map(|s| crate::takeover::orphan::RoomAhead::map(&s));
    let gone = match &room {
        Some(room) => room.wait_for_daemon(args.pid, args.started)?,
        None => {
            sys::wait_for_exit(args.pid, args.started)
                .map_err(|e| anyhow::anyhow!("waiting for pid {}: {e}", args.pid))?;
            Instant::now()
        }
    };
    let mut pause = PauseClock::starting(gone);
    pause.step("room");
    let states = StateDir::default();
    // The device's lock held by another for a moment (`uzram recover` and `uzram destroy`
    // take it to look) is no takeover: only one held for longer is.
    let busy_since = Instant::now();
    let taken = loop {
        match take_orphan(&states, &config_path)? {
            Taken::Busy(_) if busy_since.elapsed() < STANDBY_BUSY_WAIT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            taken => break taken,
        }
    };
    let (state, lock) = match taken {
        Taken::Orphan(state, lock) => (state, lock),
        // A normal stop (the device is gone) or a takeover by another daemon.
        Taken::Nothing => {
            // A normal stop (the device is gone): the per-CPU lists held short for the room
            // go back to the default. (Not for `Busy`: the daemon taking over holds them
            // short until it serves.)
            crate::memory::free_lists::restore();
            return Ok(ExitCode::SUCCESS);
        }
        Taken::Busy(dev) => {
            tracing::warn!(%dev, pid = args.pid, "another process holds the dead daemon's device: the standby leaves the takeover to it");
            return Ok(ExitCode::SUCCESS);
        }
    };
    pause.step("find the device");
    tracing::warn!(dev = %state.dev, pid = args.pid, "the device's daemon died: the standby takes the device over until the unit's next daemon does");
    serve_config(
        cfg.device,
        config_path,
        Some((state, lock)),
        true,
        Some(pause),
    )
}

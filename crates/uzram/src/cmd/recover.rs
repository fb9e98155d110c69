//! `uzram recover DEV`: a new daemon for a device whose daemon died. The device waits with
//! its I/O paused (ublk user recovery) and its pages in shared memory (`takeover/store_segment.rs`);
//! the new daemon takes both over and the paused I/O goes on. `uzram run` does the same by
//! itself when its config's device lost its daemon, so a unit that restarts on failure
//! recovers.

use std::process::ExitCode;

use crate::cli::RecoverArgs;
use crate::control::state::DaemonState;
use crate::devname::{dev_path, parse_device};
use crate::takeover::orphan::{make_room, wait_orphan, waitable_record};
use crate::takeover::record;

pub fn run(args: RecoverArgs) -> anyhow::Result<ExitCode> {
    let id = parse_device(&args.device).map_err(anyhow::Error::msg)?;
    super::require_root()?;
    super::require_module()?;
    let dev = dev_path(id);
    if args.keep {
        // A standby outlives the shell or command that started it.
        if let Err(err) = crate::sys::new_session() {
            tracing::warn!(error = %err, "setsid failed");
        }
    }
    let mut failed = 0;
    // The daemons started here (`--keep`): each is this process's child, and a zombie once
    // it died, until it is reaped.
    let mut children: Vec<std::process::Child> = Vec::new();
    loop {
        let recovered = if args.wait {
            wait_and_take_over(id, &mut children)
        } else {
            recover_now(id).map(Some)
        };
        children.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
        match recovered {
            Ok(Some(serving)) => {
                println!("{serving}");
                failed = 0;
            }
            Ok(None) => {
                tracing::info!(%dev, "the device was stopped: nothing to recover");
                return Ok(ExitCode::SUCCESS);
            }
            // The new daemon died before it served (killed as well, or failed in its start):
            // the device waits for a daemon again, and a standby is its only hope. Seen in the
            // guest: a kill of the new daemon just before it reported.
            Err(err) if args.keep && failed + 1 < KEEP_TRIES => {
                failed += 1;
                tracing::warn!(%dev, error = %err, failed, "the recovery failed: trying again");
            }
            Err(err) => return Err(err),
        }
        if !args.keep {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

/// Recoveries in a row a standby (`--keep`) tries before it gives up.
const KEEP_TRIES: u32 = 3;

/// How long `uzram recover` waits for a takeover that another process (a standby) has begun.
const OTHER_TAKEOVER_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The daemon that serves device `id` now, when one does: the recovery record is written
/// once a daemon serves, so a record whose daemon lives means a served device. When its
/// daemon is dead and another process holds the device's lock (a standby taking it over),
/// waits for that takeover, up to [`OTHER_TAKEOVER_WAIT`].
fn served_by(id: u32) -> Option<DaemonState> {
    let states = crate::control::state::StateDir::default();
    let start = std::time::Instant::now();
    loop {
        if let Some(live) = record::read(id).filter(DaemonState::daemon_alive) {
            return Some(live);
        }
        // Taking the lock here holds it only for this look.
        let held_by_another = matches!(states.try_lock(id), Ok(None));
        if !held_by_another || start.elapsed() > OTHER_TAKEOVER_WAIT {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Tells the user that `serving`'s daemon serves `dev`, so there is nothing to recover.
fn say_served(dev: &str, serving: &DaemonState) {
    eprintln!(
        "uzram: {dev} is served by its daemon (pid {}){}: nothing to recover",
        serving.pid,
        if serving.recovered {
            ", which took it over from the one that died (its standby)"
        } else {
            ""
        }
    );
}

/// Starts a new daemon for device `id`, once the kernel holds it for recovery, with the
/// settings its dead daemon published; returns the device path once the new one serves.
/// A device a live daemon serves (its standby took it over already) is reported as such.
fn recover_now(id: u32) -> anyhow::Result<String> {
    let dev = dev_path(id);
    let start = std::time::Instant::now();
    if let Some(serving) = served_by(id) {
        say_served(&dev, &serving);
        return Ok(dev);
    }
    let state =
        wait_orphan(id).map_err(|why| anyhow::anyhow!("{dev} cannot be recovered: {why}"))?;
    let orphan_ms = start.elapsed().as_millis() as u64;
    if let Some(config) = &state.config {
        anyhow::bail!(
            "{dev} was started from {}: start it the same way again (its systemd unit, or uzram run --config {}), which recovers it",
            config.display(),
            config.display()
        );
    }
    let daemon_args = recovery_daemon_args(&state)?;
    make_room(&state);
    let room_ms = start.elapsed().as_millis() as u64 - orphan_ms;
    let started = super::spawn::start_detached(daemon_args).or_else(|err| {
        // A standby that took the device the moment its daemon died wins the race for its
        // lock, and ours gives up: the device is served all the same.
        match served_by(id) {
            Some(serving) => {
                say_served(&dev, &serving);
                Ok(dev.clone())
            }
            None => Err(err),
        }
    });
    // Where the part of a crash's pause that the new daemon does not see goes.
    tracing::info!(
        %dev,
        orphan_ms,
        room_ms,
        daemon_ms = start.elapsed().as_millis() as u64 - orphan_ms - room_ms,
        ok = started.is_ok(),
        "recover: the device was found quiesced, its room given back, the new daemon started"
    );
    started
}

/// `uzram recover --wait`: starts the next daemon of device `id` now, while its daemon still
/// runs (`uzram daemon --recover ID --wait`, `create::wait_to_take_over`): it makes its
/// memory before the crash and takes the device over once the daemon died. Waits for its
/// report: the device path once it serves, `None` when the device went with its daemon.
/// This process waits locked in memory: after a crash it must be able to report.
fn wait_and_take_over(
    id: u32,
    children: &mut Vec<std::process::Child>,
) -> anyhow::Result<Option<String>> {
    let state = waitable_record(id)?;
    let mut daemon_args = recovery_daemon_args(&state)?;
    daemon_args.push("--wait".to_string());
    crate::sys::mlock_all().map_err(|e| anyhow::anyhow!("mlockall: {e}"))?;
    tracing::info!(dev = %state.dev, pid = state.pid, "waiting for the device's daemon to exit; its successor waits with its memory made");
    let (started, child) = super::spawn::spawn_detached(daemon_args, None)?;
    children.push(child);
    Ok(match started {
        super::spawn::Started::Serving(dev) => Some(dev),
        super::spawn::Started::Stopped => None,
    })
}

/// `uzram daemon` arguments that take `state`'s device over: the settings its dead daemon
/// published (`uzram create`'s, validated again as a config file is; the record they come
/// from passed that check already when it was read), and `--recover ID`.
fn recovery_daemon_args(state: &DaemonState) -> anyhow::Result<Vec<String>> {
    let Some(settings) = &state.settings else {
        anyhow::bail!(
            "{}: its daemon did not publish how it was created",
            state.dev
        );
    };
    settings
        .validate(crate::config::Host::current()?)
        .map_err(|e| anyhow::anyhow!("{}: its published settings are refused: {e}", state.dev))?;
    let mut args = crate::cli::DeviceArgs::from_raw(settings).to_args();
    args.extend(["--recover".to_string(), state.id.to_string()]);
    Ok(args)
}

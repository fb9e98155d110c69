//! `uzram recover DEV`: a new daemon for a device whose daemon died. The device waits with
//! its I/O paused (ublk user recovery) and its pages in shared memory (`daemon/region.rs`);
//! the new daemon takes both over and the paused I/O goes on. `uzram run` does the same by
//! itself when its config's device lost its daemon, so a unit that restarts on failure
//! recovers.

use std::path::Path;
use std::process::ExitCode;

use crate::cli::RecoverArgs;
use crate::control::anchor;
use crate::control::state::DaemonState;
use crate::daemon::{free_lists, region};
use crate::devname::{dev_path, in_kernel, parse_device};

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
        if let Some(live) = anchor::read(id).filter(DaemonState::daemon_alive) {
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
    let started = super::create::start_detached(daemon_args).or_else(|err| {
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
    let (started, child) = super::create::spawn_detached(daemon_args, None)?;
    children.push(child);
    Ok(match started {
        super::create::Started::Serving(dev) => Some(dev),
        super::create::Started::Stopped => None,
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

/// The recovery record of device `id`, for a recovery that waits for its daemon to exit:
/// refuses at once what a recovery would refuse after the wait (a device without a record,
/// or one started from a config).
pub(super) fn waitable_record(id: u32) -> anyhow::Result<DaemonState> {
    let dev = dev_path(id);
    let Some(state) = anchor::read(id) else {
        anyhow::bail!(
            "{dev} has no recovery record: not a uzram device, or its daemon does not serve yet"
        );
    };
    if let Some(config) = &state.config {
        anyhow::bail!(
            "{dev} was started from {}: its systemd unit's standby recovers it",
            config.display()
        );
    }
    Ok(state)
}

/// What a process that waits to take a device over gives back the moment the device's
/// daemon is gone, before it does anything else: the store's recovery room, mapped ahead,
/// with the per-CPU free lists held short first. Mapped and opened before the wait, since
/// both need memory, and memory may have run out by then (a CI run hung with the next
/// daemon in reclaim before it got to give the room back); [`make_room`] does both at once,
/// for a recovery started after the crash.
pub struct RoomAhead {
    dev: String,
    room: Option<region::MappedRoom>,
    lists: free_lists::OpenedLists,
    given: std::cell::Cell<bool>,
}

impl RoomAhead {
    /// Maps the room of `state`'s store (failing that, warns: the recovery gives nothing back).
    pub fn map(state: &DaemonState) -> RoomAhead {
        let room = state.store_shm.and_then(|shm| {
            region::MappedRoom::map(shm)
                .inspect_err(|err| tracing::warn!(dev = %state.dev, error = %err, "mapping the store's recovery room failed: a takeover will not give it back"))
                .ok()
        });
        RoomAhead {
            dev: state.dev.clone(),
            room,
            lists: free_lists::OpenedLists::open(),
            given: std::cell::Cell::new(false),
        }
    }

    /// Gives the room back (again, if a takeover before did), once: when the daemon is dying
    /// ([`Self::wait_for_daemon`]) or else when it is gone.
    pub fn give_back(&self) {
        let Some(room) = &self.room else { return };
        if self.given.replace(true) {
            return;
        }
        // Before the room goes: its pages must reach the zone's free lists, where the new
        // daemon's page faults count them (`daemon::free_lists`).
        self.lists.shorten();
        match room.release() {
            Ok(bytes) => {
                GIVEN_BACK.store(i64::from(room.shm()), std::sync::atomic::Ordering::Relaxed);
                tracing::info!(dev = %self.dev, bytes, "the store's recovery room is free for the new daemon")
            }
            Err(err) => {
                tracing::warn!(dev = %self.dev, error = %err, "giving back the store's recovery room failed")
            }
        }
    }

    /// Waits until the daemon `pid` (started at `started`) has exited, and gives the room
    /// back as soon as it is dying: its first thread gone while others are still there. A
    /// killed daemon's thread inside a page fault can only exit once that fault got a page,
    /// and with memory run out and the device paused none comes free but the room's (seen on
    /// 7.3: a killed daemon's pool keeper took 5-8 s to go, and the device's pause with it).
    /// Returns when the exit was seen (the pause's start, for the new daemon's clock).
    pub fn wait_for_daemon(
        &self,
        pid: u32,
        started: Option<u64>,
    ) -> anyhow::Result<std::time::Instant> {
        crate::sys::wait_for_exit_noting_death(pid, started, &mut || {
            self.give_back();
            tracing::info!(dev = %self.dev, pid, "the daemon's first thread is gone: its room was given back while the rest exits");
        })
        .map_err(|e| anyhow::anyhow!("waiting for pid {pid}: {e}"))?;
        let gone = std::time::Instant::now();
        self.give_back();
        Ok(gone)
    }
}

/// The segment whose room this process gave back last ([`make_room`], [`RoomAhead`]).
static GIVEN_BACK: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(-1);

/// Gives the recovery room of `state`'s store back to the system, so that the new daemon
/// can start when memory ran out with the old one dead (see `daemon::region`): a
/// [`RoomAhead`] mapped and given back at once. Failing that only warns: with memory to
/// spare the daemon starts anyway.
///
/// Once per segment and process: a takeover that gave the room back before it asked for the
/// handover (`uzram run`) does not map the segment again inside the pause.
pub fn make_room(state: &DaemonState) {
    let Some(shm) = state.store_shm else { return };
    if GIVEN_BACK.load(std::sync::atomic::Ordering::Relaxed) == i64::from(shm) {
        return;
    }
    RoomAhead::map(state).give_back();
}

/// The recovery record of device `id` when the device waits for a new daemon: its daemon is
/// gone, the kernel holds the device quiesced, and its store is still in shared memory.
/// Otherwise why not. Reads nothing that can be in swap (`control::anchor`).
pub fn check_orphan(id: u32) -> Result<DaemonState, String> {
    if !in_kernel(id) {
        return Err("no such device in the kernel".into());
    }
    let Some(state) = anchor::read(id) else {
        return Err(
            "it has no recovery record (not a uzram device, or its daemon never served)".into(),
        );
    };
    if state.daemon_alive() {
        return Err(format!("its daemon (pid {}) is running", state.pid));
    }
    let Some(shm) = state.store_shm else {
        return Err("its daemon kept no store in shared memory".into());
    };
    if !region::exists(shm) {
        return Err(format!("its store (shared memory segment {shm}) is gone"));
    }
    crate::daemon::quiesced_info(id)?;
    Ok(state)
}

/// [`check_orphan`], given up to 30 s for the kernel to quiesce the device: it does so a
/// moment after the daemon is gone (6.12's monitor notices within 5 s).
pub fn wait_orphan(id: u32) -> Result<DaemonState, String> {
    let start = std::time::Instant::now();
    loop {
        match check_orphan(id) {
            Err(why)
                if why.starts_with(crate::daemon::NOT_QUIESCED)
                    && start.elapsed() < std::time::Duration::from_secs(30) =>
            {
                // The device's I/O is paused until it is taken over: look often (100 ms
                // naps added up to 100 ms to every takeover).
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            done => return done,
        }
    }
}

/// The recovery record of the device started from `config` whose daemon is gone and whose
/// store is still there; the device may not be quiesced yet ([`wait_orphan`]).
pub fn dead_record_of_config(config: &Path) -> Option<DaemonState> {
    record_of_config(config, false)
}

/// The recovery record of the device started from `config` whose store is still there and
/// whose daemon process still exists: serving, starting, or killed and not yet gone (a
/// killed daemon's threads can take a while to exit, and until they have, its device does
/// not wait for a new daemon).
pub fn running_record_of_config(config: &Path) -> Option<DaemonState> {
    record_of_config(config, true)
}

fn record_of_config(config: &Path, alive: bool) -> Option<DaemonState> {
    anchor::device_ids()
        .into_iter()
        .filter_map(anchor::read)
        .find(|s| {
            s.config.as_deref() == Some(config)
                && s.daemon_alive() == alive
                && s.store_shm.is_some_and(region::exists)
        })
}

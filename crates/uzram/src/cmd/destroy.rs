//! `uzram destroy DEV|--all`: refuse devices in use; otherwise stop the daemon (it deletes the
//! device) and wait until the device is gone. Devices of dead daemons are deleted directly.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use libublk::ctrl::UblkCtrl;

use super::{probe, Probe};
use crate::cli::DestroyArgs;
use crate::control::client;
use crate::control::proto::{Request, Response};
use crate::control::state::{DaemonState, StateDir};
use crate::control::ControlError;
use crate::devname::{dev_path, parse_device};
use crate::inuse::in_use;
use crate::takeover::record;
use crate::takeover::store_segment;

/// How long to wait for a daemon to delete its device.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(args: DestroyArgs) -> anyhow::Result<ExitCode> {
    let ids = match &args.device {
        Some(name) => vec![parse_device(name).map_err(anyhow::Error::msg)?],
        None => Vec::new(),
    };
    super::require_root()?;
    let states = StateDir::default();
    if args.all {
        let mut failed = 0;
        let (live, damaged) = states.list_all()?;
        for state in live {
            if let Err(err) = destroy(&states, &state) {
                eprintln!("uzram: error: {err:#}");
                failed += 1;
            }
        }
        for err in damaged {
            if let Err(err) = destroy_damaged(&states, &err) {
                eprintln!("uzram: error: {err:#}");
                failed += 1;
            }
        }
        for leftover in super::leftovers::find() {
            eprintln!(
                "uzram: freeing shared memory segment {} ({}, {}), kept by no device",
                leftover.id,
                leftover.what,
                crate::size::Human(leftover.bytes)
            );
            super::leftovers::free(&leftover);
        }
        return Ok(if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    for id in ids {
        let state = match states.read(id) {
            Ok(Some(state)) => state,
            Ok(None) => anyhow::bail!(
                "unknown device {}: no uzram device with id {id}",
                dev_path(id)
            ),
            Err(err @ ControlError::DamagedState { .. }) => {
                destroy_damaged(&states, &err)?;
                continue;
            }
            Err(err) => return Err(err.into()),
        };
        destroy(&states, &state)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn destroy(states: &StateDir, state: &DaemonState) -> anyhow::Result<()> {
    let dev = dev_path(state.id);
    if let Some(reason) = in_use(&dev) {
        anyhow::bail!("{reason}");
    }
    let why = match probe(states, state) {
        Probe::Live(_) => return stop_live(states, state, &dev),
        Probe::Orphan => "its daemon died (the device waits for uzram recover)".to_string(),
        Probe::Stale(why) => why,
        // Deleting the device under a live daemon would skip its own stop (swap off first,
        // its segments given back in order) while it still serves.
        Probe::Silent(why) => {
            anyhow::bail!("not deleting {dev}: {}", super::silent_advice(state, &why))
        }
    };
    // A daemon taking the device over (a standby, `uzram recover`) holds its lock from before
    // it publishes itself: until then the state still names the dead daemon.
    let Some(_lock) = states.try_lock(state.id)? else {
        anyhow::bail!(
            "not deleting {dev}: {why}, but another daemon is taking it over (it holds {}); \
             run uzram status {} in a moment",
            states.lock_path(state.id).display(),
            state.id
        );
    };
    if states.read(state.id)?.as_ref() != Some(state) {
        anyhow::bail!(
            "not deleting {dev}: its state changed meanwhile (a new daemon?); run uzram status {} \
             and try again",
            state.id
        );
    }
    eprintln!("uzram: {dev}: {why}; deleting the device directly");
    delete_orphan(state.id)?;
    // Only this device's store: a stale state's segment id may since be another's.
    if let Some(shm) = state.store_shm.filter(|&shm| {
        store_segment::store_facts(shm).is_some_and(|facts| facts.device == state.id)
    }) {
        store_segment::remove(shm);
    }
    record::remove(state.id);
    states.remove(state.id);
    Ok(())
}

/// A device whose state file is damaged: its daemon's pid and segments are unknown, so it
/// is deleted only when no process holds the device's lock (every daemon holds it while it
/// serves or takes the device over). Its store's segments are then kept by no device, and
/// `uzram destroy --all` frees them.
fn destroy_damaged(states: &StateDir, damaged: &ControlError) -> anyhow::Result<()> {
    let ControlError::DamagedState { id, .. } = *damaged else {
        anyhow::bail!("{damaged}");
    };
    let dev = dev_path(id);
    if let Some(reason) = in_use(&dev) {
        anyhow::bail!("{reason}");
    }
    let Some(_lock) = states.try_lock(id)? else {
        let lock = states.lock_path(id);
        anyhow::bail!(
            "{damaged}; a daemon of it still runs (it holds {lock}): stop it (`systemctl stop \
             uzram@NAME`, or kill the process that holds that file: `fuser {lock}`), then run \
             uzram destroy {id} again",
            lock = lock.display()
        );
    };
    eprintln!("uzram: {dev}: its state file is damaged and no daemon holds the device; deleting the device directly");
    delete_orphan(id)?;
    record::remove(id);
    states.remove(id);
    Ok(())
}

fn stop_live(states: &StateDir, state: &DaemonState, dev: &str) -> anyhow::Result<()> {
    // The node of this daemon's device: once it is gone the kernel may give the id to a new
    // device, whose node is another file (devtmpfs numbers each new node's inode afresh; its
    // device number may be the same).
    let node = node_of(dev);
    match client::request(
        &states.socket_path(state.id),
        &Request::Stop,
        Duration::from_secs(5),
    )? {
        Response::Stopping => {}
        other => anyhow::bail!("{dev}: daemon refused to stop: {other:?}"),
    }
    let start = Instant::now();
    let node_stays = || node.is_some() && node_of(dev) == node;
    while state.daemon_alive() || node_stays() {
        if start.elapsed() > STOP_TIMEOUT {
            anyhow::bail!(
                "{dev}: daemon pid {} did not finish within {}s",
                state.pid,
                STOP_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // The daemon removes its files itself; what is left is its, unless a new daemon of the
    // same id published its own meanwhile.
    let ours = |s: &DaemonState| s.pid == state.pid && s.started == state.started;
    if states
        .read(state.id)
        .ok()
        .flatten()
        .is_some_and(|s| ours(&s))
    {
        states.remove(state.id);
    }
    Ok(())
}

/// The inode and device number of block device node `dev`.
fn node_of(dev: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(dev).ok()?;
    meta.file_type()
        .is_block_device()
        .then(|| (meta.ino(), meta.rdev()))
}

/// Deletes a device whose daemon died, through the ublk control device.
fn delete_orphan(id: u32) -> anyhow::Result<()> {
    if !crate::devname::in_kernel(id) {
        return Ok(()); // already gone from the kernel
    }
    super::require_module()?;
    let ctrl = UblkCtrl::new_simple(id as i32)
        .map_err(|e| anyhow::anyhow!("opening ublk device {id}: {e} ({e:?})"))?;
    let _ = ctrl.kill_dev();
    ctrl.del_dev()
        .map_err(|e| anyhow::anyhow!("deleting ublk device {id}: {e} ({e:?})"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::{Request, Response};

    /// A daemon alive but slower to answer than the probe waits (a long pass once held its
    /// control thread for minutes) was taken for a stale one, and its device deleted under
    /// it; `uzram status` told the user to do so.
    #[test]
    fn a_live_daemon_that_does_not_answer_is_not_deleted_under_it() {
        let (_dir, states) = StateDir::temporary();
        // An id no kernel device and no record has; the daemon is this process.
        let id = 1_048_001;
        let pid = std::process::id();
        let state = DaemonState {
            pid,
            started: crate::sys::start_ticks(pid),
            ..DaemonState::example(id)
        };
        assert!(state.daemon_alive());
        states.write(&state).unwrap();
        let socket = crate::control::listener::bind(&states.socket_path(id)).unwrap();
        std::thread::spawn(move || {
            crate::control::listener::serve(
                socket,
                |_: Request| {
                    std::thread::sleep(std::time::Duration::from_secs(8));
                    Response::Stopping
                },
                None,
            )
        });
        match super::super::probe(&states, &state) {
            super::super::Probe::Silent(why) => assert!(why.contains("does not answer"), "{why}"),
            _ => panic!("a live daemon that did not answer was not told apart"),
        }
        let err = destroy(&states, &state).unwrap_err().to_string();
        assert!(
            err.contains("not deleting") && err.contains("alive"),
            "{err}"
        );
        assert!(states.state_path(id).exists(), "its state was removed");
        assert!(states.socket_path(id).exists(), "its socket was removed");
    }

    /// A dead daemon's device is deleted directly only when no daemon holds its lock: a
    /// successor taking it over holds the lock before it publishes its own state.
    #[test]
    fn a_dead_daemons_device_is_not_deleted_under_a_daemon_taking_it_over() {
        let (_dir, states) = StateDir::temporary();
        // An id no kernel device and no record has; pid 0 is no live daemon.
        let id = 1_048_002;
        let state = DaemonState::example(id);
        assert!(!state.daemon_alive());
        states.write(&state).unwrap();
        let successor = states.try_lock(id).unwrap().expect("the lock is free");
        let err = destroy(&states, &state).unwrap_err().to_string();
        assert!(err.contains("taking it over"), "{err}");
        assert!(states.state_path(id).exists(), "its state was removed");
        drop(successor);
        let newer = DaemonState {
            size: 2 << 20,
            ..state.clone()
        };
        states.write(&newer).unwrap();
        let err = destroy(&states, &state).unwrap_err().to_string();
        assert!(err.contains("state changed"), "{err}");
        destroy(&states, &newer).unwrap();
        assert!(!states.state_path(id).exists());
    }

    /// A damaged state file names no daemon: the device is deleted (and the file removed)
    /// only when no process holds the device's lock, as every daemon does while it serves.
    #[test]
    fn a_damaged_state_file_is_cleared_only_when_no_daemon_holds_the_device() {
        let (_dir, states) = StateDir::temporary();
        // An id no kernel device and no record has.
        let id = 1_048_000;
        std::fs::write(states.state_path(id), "{garbage").unwrap();
        let damaged = states.read(id).unwrap_err();
        assert!(
            matches!(damaged, ControlError::DamagedState { id: i, .. } if i == id),
            "{damaged}"
        );
        assert!(damaged
            .to_string()
            .contains(&format!("`uzram destroy {id}` deletes the device")));
        let (listed, unreadable) = states.list_all().unwrap();
        assert!(listed.is_empty());
        assert_eq!(unreadable.len(), 1);
        let daemon = states.try_lock(id).unwrap().expect("the lock is free");
        let err = destroy_damaged(&states, &damaged).unwrap_err().to_string();
        assert!(err.contains("a daemon of it still runs"), "{err}");
        assert!(
            states.state_path(id).exists(),
            "kept while a daemon holds it"
        );
        drop(daemon);
        destroy_damaged(&states, &damaged).unwrap();
        assert!(!states.state_path(id).exists());
        assert!(states.list_all().unwrap().1.is_empty());
    }
}

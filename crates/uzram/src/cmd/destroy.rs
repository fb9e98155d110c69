//! `uzram destroy DEV|--all`: refuse devices in use; otherwise stop the daemon (it deletes the
//! device) and wait until the device is gone. Devices of dead daemons are deleted directly.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use libublk::ctrl::UblkCtrl;

use super::{probe, Probe};
use crate::cli::DestroyArgs;
use crate::control::client;
use crate::control::proto::{Request, Response};
use crate::control::state::{DaemonState, StateDir};
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
        for state in states.list()? {
            if let Err(err) = destroy(&states, &state) {
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
        let Some(state) = states.read(id)? else {
            anyhow::bail!(
                "unknown device {}: no uzram device with id {id}",
                dev_path(id)
            );
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
    };
    eprintln!("uzram: {dev}: {why}; deleting the device directly");
    delete_orphan(state.id)?;
    if let Some(shm) = state.store_shm.filter(|&shm| store_segment::exists(shm)) {
        store_segment::remove(shm);
    }
    record::remove(state.id);
    states.remove(state.id);
    Ok(())
}

fn stop_live(states: &StateDir, state: &DaemonState, dev: &str) -> anyhow::Result<()> {
    match client::request(
        &states.socket_path(state.id),
        &Request::Stop,
        Duration::from_secs(5),
    )? {
        Response::Stopping => {}
        other => anyhow::bail!("{dev}: daemon refused to stop: {other:?}"),
    }
    let start = Instant::now();
    while state.daemon_alive() || Path::new(dev).exists() {
        if start.elapsed() > STOP_TIMEOUT {
            anyhow::bail!(
                "{dev}: daemon pid {} did not finish within {}s",
                state.pid,
                STOP_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    states.remove(state.id);
    Ok(())
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

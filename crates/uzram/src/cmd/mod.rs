//! One module per subcommand; shared preflight checks here.

pub mod check;
pub mod create;
pub mod daemon;
pub mod destroy;
pub mod docs;
pub mod generator;
pub mod handover;
pub mod leftovers;
pub mod list;
pub mod recover;
pub mod run;
pub mod spawn;
pub mod status;
pub mod swap;
pub mod swapoff;
pub mod tier;

use std::path::Path;
use std::time::Duration;

use crate::control::client;
use crate::control::proto::{DeviceStatus, Request, Response};
use crate::control::state::{DaemonState, StateDir};
use crate::sys;

/// The ublk control device; it exists once `ublk_drv` is loaded.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";

/// Refuses to go on without root.
pub fn require_root() -> anyhow::Result<()> {
    if !sys::is_root() {
        anyhow::bail!("uzram must run as root");
    }
    Ok(())
}

/// Refuses to go on without the ublk driver.
pub fn require_module() -> anyhow::Result<()> {
    if !Path::new(UBLK_CONTROL).exists() {
        anyhow::bail!("the ublk_drv kernel module is not loaded: run modprobe ublk_drv");
    }
    Ok(())
}

/// A published daemon and whether it answers.
pub enum Probe {
    /// It answered with its status.
    Live(Box<DeviceStatus>),
    /// Its daemon died and the device waits, I/O paused, for `uzram recover`.
    Orphan,
    /// Its state file is there but the daemon is gone, or something else answered.
    Stale(String),
    /// Its daemon is alive but did not answer in time (busy or hung): nothing may be done to
    /// the device behind its back.
    Silent(String),
}

/// What to tell the user of a daemon that is alive but does not answer.
pub fn silent_advice(state: &DaemonState, why: &str) -> String {
    format!(
        "{}: {why}; it is alive (busy or hung): try again in a minute, and if it stays \
         silent, stop it (kill {}) and run uzram recover {} or uzram destroy {}",
        state.dev, state.pid, state.id, state.id
    )
}

/// What is known of a device whose daemon died (`Probe::Orphan`): its settings, no counters
/// (they died with the daemon; the pages did not), and `queue_mode` saying what to do.
pub fn orphan_status(state: &DaemonState) -> DeviceStatus {
    DeviceStatus {
        id: state.id,
        dev: state.dev.clone(),
        pid: state.pid,
        size: state.size,
        algorithm: state.algorithm.clone(),
        backend: state.backend.clone(),
        queues: 0,
        depth: 0,
        queue_mode: ORPHAN_MODE.to_string(),
        stats: Vec::new(),
        requests: Vec::new(),
        backend_stats: Vec::new(),
    }
}

/// Tells the user that `state`'s daemon died and what to do (`list` and `status`).
pub fn warn_orphan(state: &DaemonState) {
    eprintln!(
        "uzram: {}: its daemon died; I/O is paused and the pages are kept: run uzram recover {}",
        state.dev, state.id
    );
}

/// The `queue_mode` of a device whose daemon died.
pub const ORPHAN_MODE: &str = "none: daemon gone, I/O paused, pages kept; run uzram recover";

/// Asks the daemon of `state` for its status.
pub fn probe(states: &StateDir, state: &DaemonState) -> Probe {
    if !state.daemon_alive() {
        return match crate::takeover::orphan::check_orphan(state.id) {
            Ok(_) => Probe::Orphan,
            Err(_) => Probe::Stale(format!("daemon pid {} is gone", state.pid)),
        };
    }
    match client::request(
        &states.socket_path(state.id),
        &Request::Status,
        Duration::from_secs(5),
    ) {
        Ok(Response::Status(s)) => Probe::Live(Box::new(s)),
        Ok(other) => Probe::Stale(format!("daemon answered {other:?}")),
        Err(err) => Probe::Silent(format!("daemon pid {} does not answer: {err:#}", state.pid)),
    }
}

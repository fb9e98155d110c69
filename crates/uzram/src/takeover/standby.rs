//! Starting the standby (`uzram standby`, `cmd/run.rs`): a small process outside the unit
//! that takes the device over the moment this daemon dies, so that a crash never waits for
//! systemd, whose own pages may be in swap on the paused device (docs/recovery.md).

use std::ffi::OsStr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::control::state::DaemonState;

/// Runs this binary with `args` in a transient scope of its own (`systemd-run --scope`):
/// processes left in a unit's cgroup are killed when it stops, and the standby and a
/// restart's bridge must outlive the unit's daemon. Their readiness is their published
/// state, not an sd_notify to the unit they leave.
pub fn spawn_in_scope<I, S>(description: &str, args: I) -> std::io::Result<Child>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Command::new("systemd-run")
        .args(["--scope", "--quiet", "--collect"])
        .arg(format!("--description={description}"))
        .arg("--")
        .arg(std::env::current_exe()?)
        .args(args)
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        // The unit's journal, not this daemon's routed stdio: its pipe dies with us.
        .stdout(crate::stdio_route::original(1).map_or_else(Stdio::inherit, Stdio::from))
        .stderr(crate::stdio_route::original(2).map_or_else(Stdio::inherit, Stdio::from))
        .spawn()
}

/// Starts the standby for `state`'s device and puts its pid in `pid`. Without
/// `systemd-run` there is none, and the log says what that means.
pub fn start(state: &DaemonState, pid: &AtomicU32) {
    let Some(config) = &state.config else { return };
    let daemon_pid = state.pid.to_string();
    let started = state.started.map(|t| t.to_string());
    let mut args = vec![
        OsStr::new("standby"),
        OsStr::new("--pid"),
        OsStr::new(&daemon_pid),
        OsStr::new("--config"),
        config.as_os_str(),
    ];
    if let Some(started) = &started {
        args.extend([OsStr::new("--started"), OsStr::new(started)]);
    }
    match spawn_in_scope(&format!("uzram standby for {}", state.dev), args) {
        Ok(mut child) => {
            pid.store(child.id(), Ordering::Release);
            tracing::info!(pid = child.id(), "standby started");
            // Reaps it; it normally outlives us.
            let _ = std::thread::Builder::new()
                .name("uzram-standby".into())
                .stack_size(64 << 10)
                .spawn(move || {
                    let _ = child.wait();
                });
        }
        Err(err) => tracing::warn!(
            error = %err,
            "no standby (systemd-run failed): after a crash the device waits for systemd to restart the daemon"
        ),
    }
}

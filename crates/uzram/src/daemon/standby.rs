//! Starting the standby (`uzram standby`, `cmd/run.rs`): a small process outside the unit
//! that takes the device over the moment this daemon dies, so that a crash never waits for
//! systemd, whose own pages may be in swap on the paused device (docs/recovery.md).

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::control::state::DaemonState;

/// Starts the standby for `state`'s device in a transient scope (processes left in the
/// unit's cgroup are killed when it stops after a crash) and puts its pid in `pid`. Without
/// `systemd-run` there is none, and the log says what that means.
pub fn start(state: &DaemonState, pid: &AtomicU32) {
    let Some(config) = &state.config else { return };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(err) => return warn_none(&err.to_string()),
    };
    let spawned = Command::new("systemd-run")
        .args(["--scope", "--quiet", "--collect"])
        .arg(format!("--description=uzram standby for {}", state.dev))
        .arg("--")
        .arg(exe)
        .args(["standby", "--pid", &state.pid.to_string(), "--config"])
        .arg(config)
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .spawn();
    match spawned {
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
        Err(err) => warn_none(&err.to_string()),
    }
}

fn warn_none(why: &str) {
    tracing::warn!(
        error = why,
        "no standby (systemd-run failed): after a crash the device waits for systemd to restart the daemon"
    );
}

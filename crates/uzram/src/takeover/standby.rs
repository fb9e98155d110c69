//! Starting the standby (`uzram standby`, `cmd/run.rs`): a small process outside the unit
//! that takes the device over the moment this daemon dies, so that a crash never waits for
//! systemd, whose own pages may be in swap on the paused device (docs/recovery.md).

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use crate::control::state::DaemonState;

/// The standby this daemon started, held as a pidfd: a handover's kill reaches that process
/// or, once it has exited, none, never a later process the kernel gave its pid (a pid alone
/// would name whoever has it by then, and the daemon kills as root).
#[derive(Debug, Default)]
pub struct Standby {
    pidfd: OnceLock<OwnedFd>,
}

impl Standby {
    /// Keeps `child`'s pidfd and reaps it on a thread of its own when it exits.
    pub fn watch(&self, mut child: Child) -> io::Result<()> {
        // Opened before anything reaps it: an exited child stays a zombie until then, and
        // the pidfd names that process.
        let pidfd = crate::sys::pidfd_open(child.id());
        std::thread::Builder::new()
            .name("uzram-standby".into())
            .stack_size(64 << 10)
            .spawn(move || {
                let _ = child.wait();
            })?;
        // A daemon starts one standby: a second would not replace the first.
        let _ = self.pidfd.set(pidfd?);
        Ok(())
    }

    /// Kills the standby if it still runs: `Ok(false)` when there is none, or it has exited.
    pub fn kill(&self) -> io::Result<bool> {
        let Some(pidfd) = self.pidfd.get() else {
            return Ok(false);
        };
        match crate::sys::pidfd_kill(pidfd.as_fd()) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

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

/// Starts the standby for `state`'s device and keeps it in `standby`. Without
/// `systemd-run` there is none, and the log says what that means.
pub fn start(state: &DaemonState, standby: &Standby) {
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
        Ok(child) => {
            let pid = child.id();
            // It normally outlives us; reaped when it does not.
            match standby.watch(child) {
                Ok(()) => tracing::info!(pid, "standby started"),
                Err(err) => tracing::warn!(
                    pid,
                    error = %err,
                    "standby started, but without its pidfd a handover cannot end it"
                ),
            }
        }
        Err(err) => tracing::warn!(
            error = %err,
            "no standby (systemd-run failed): after a crash the device waits for systemd to restart the daemon"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn until_gone(pid: u32) {
        let start = Instant::now();
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "pid {pid} stayed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_handover_kills_the_standby_it_started_and_no_later_process_with_its_pid() {
        assert!(
            !Standby::default().kill().unwrap(),
            "no standby: nothing to kill"
        );
        // A standby that runs: killed.
        let live = Standby::default();
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        live.watch(child).unwrap();
        assert!(live.kill().unwrap());
        until_gone(pid);
        // One that exited and was reaped (its pid free for any process): no signal is sent,
        // where a kill by pid would have reached whoever has it now.
        let gone = Standby::default();
        let child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        gone.watch(child).unwrap();
        until_gone(pid);
        assert!(!gone.kill().unwrap());
    }
}

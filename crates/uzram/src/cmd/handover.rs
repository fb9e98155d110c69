//! Handing a live daemon's device over to the next daemon (a planned restart).
//!
//! A handover makes the daemon exit the way a crash would (the kernel holds the device and
//! its I/O, the store stays in shared memory), and the next daemon takes both over. Between
//! the two the device serves nothing: whoever starts the next daemon must not need a page
//! that is in swap on it. Under `systemctl restart` that is PID 1, and with heavy swap
//! systemd's own pages are there (it was seen waiting in `do_swap_page`, never starting the
//! new daemon). So a restart hands over twice, each time to a daemon that already runs:
//! ExecStop starts a bridge (`uzram run --bridge`) outside the unit, which takes the device
//! from the old daemon; systemd stops the unit and starts the new `uzram run` while the
//! bridge serves; the new daemon takes the device from the bridge.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::control::client;
use crate::control::proto::{Request, Response};
use crate::control::state::{DaemonState, StateDir};
use crate::takeover::standby::spawn_in_scope;

/// How long a daemon gets to exit after a handover request.
const EXIT_WAIT: Duration = Duration::from_secs(10);

/// How long ExecStop waits for a bridge to serve the device.
const BRIDGE_WAIT: Duration = Duration::from_secs(60);

/// The running daemon of the device started from `config` (canonical path) whose
/// [`DaemonState::bridge`] is `bridge` (`None`: either), newest first.
pub fn live_daemon(states: &StateDir, config: &Path, bridge: Option<bool>) -> Option<DaemonState> {
    newest_live(states.list().ok()?, config, bridge)
}

/// [`live_daemon`] among `states`. A daemon killed without cleanup leaves its state behind:
/// only a live one counts, and of several (a restart racing a stale file) the newest.
pub fn newest_live(
    states: Vec<DaemonState>,
    config: &Path,
    bridge: Option<bool>,
) -> Option<DaemonState> {
    states
        .into_iter()
        .filter(|s| {
            s.config.as_deref() == Some(config)
                && bridge.is_none_or(|b| s.bridge == b)
                && s.daemon_alive()
        })
        .max_by_key(|s| s.id)
}

/// Asks `state`'s daemon to hand its device over and waits until it has exited.
pub fn request(state: &DaemonState) -> anyhow::Result<()> {
    if state.store_shm.is_none() {
        anyhow::bail!(
            "{}: its daemon keeps no store to hand over; stop and start it instead",
            state.dev
        );
    }
    let socket = StateDir::default().socket_path(state.id);
    match client::request(&socket, &Request::Handoff, Duration::from_secs(5)) {
        Ok(Response::HandingOff) => {}
        Ok(other) => anyhow::bail!("{}: the daemon refused the handoff: {other:?}", state.dev),
        // It may exit before its answer is out; whether it exits is what counts (below).
        Err(err) => tracing::debug!(error = %err, "no answer to the handoff request"),
    }
    // Gone means every thread gone: its leader turns zombie first, while the others still
    // hold its files, the device's lock among them (a guest run saw the next daemon take
    // that for another daemon taking the device over).
    let gone = match crate::sys::wait_for_exit_within(state.pid, state.started, Some(EXIT_WAIT)) {
        Ok(gone) => gone,
        // No pidfds (before Linux 5.3): watch the process instead.
        Err(err) => {
            tracing::debug!(error = %err, "no pidfd for the old daemon; polling");
            let start = Instant::now();
            while state.daemon_alive() && start.elapsed() <= EXIT_WAIT {
                std::thread::sleep(Duration::from_millis(5));
            }
            !state.daemon_alive()
        }
    };
    if !gone {
        anyhow::bail!(
            "{}: daemon pid {} did not exit for the handoff",
            state.dev,
            state.pid
        );
    }
    Ok(())
}

/// ExecStop of a restart: a bridge takes the device over from `old` and serves it until the
/// unit's next daemon takes it over. Without `systemd-run`, or when the bridge fails before
/// the old daemon went, the old daemon hands over directly (the next daemon then recovers
/// the paused device, which stalls if systemd's own pages are in swap on it).
pub fn restart_through_bridge(config: &Path, unit: &str, old: &DaemonState) -> anyhow::Result<()> {
    let bridge = match start_bridge(config, unit) {
        Ok(child) => child,
        Err(err) => {
            eprintln!(
                "uzram: {}: cannot start a bridge daemon ({err:#}); handing over directly",
                old.dev
            );
            return request(old);
        }
    };
    match wait_for_bridge(config, old, bridge) {
        Bridge::Serving(pid) => {
            eprintln!(
                "uzram: {unit} restarts: {} is served by a bridge daemon (pid {pid}) until the next daemon takes it over; swap stays on",
                old.dev
            );
            Ok(())
        }
        Bridge::Failed(why) if old.daemon_alive() => {
            eprintln!(
                "uzram: {}: the bridge daemon {why}; handing over directly",
                old.dev
            );
            request(old)
        }
        Bridge::Failed(why) => {
            // The old daemon handed over: the device waits with its store for the unit's
            // next daemon, which recovers it.
            eprintln!(
                "uzram: {}: the bridge daemon {why} after the old daemon handed over; the next daemon recovers the device",
                old.dev
            );
            Ok(())
        }
    }
}

/// `uzram run --bridge --config CONFIG` in a transient scope of its own: processes left in
/// the unit's cgroup are killed before the unit starts again.
fn start_bridge(config: &Path, unit: &str) -> std::io::Result<Child> {
    let args = [
        OsStr::new("run"),
        OsStr::new("--bridge"),
        OsStr::new("--config"),
        config.as_os_str(),
    ];
    spawn_in_scope(
        &format!("uzram bridge daemon for {unit} (planned restart)"),
        args,
    )
}

enum Bridge {
    Serving(u32),
    Failed(String),
}

fn wait_for_bridge(config: &Path, old: &DaemonState, mut child: Child) -> Bridge {
    let states = StateDir::default();
    let start = Instant::now();
    loop {
        if !old.daemon_alive() {
            if let Some(bridge) = live_daemon(&states, config, Some(true)) {
                return Bridge::Serving(bridge.pid);
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Bridge::Failed(format!("exited ({status})"));
        }
        if start.elapsed() > BRIDGE_WAIT {
            if old.daemon_alive() {
                // It never asked for the handover: stop it, so that it cannot race the
                // direct one that follows. (Once the old daemon is gone it holds the device's
                // lock, and the next daemon takes the device from it.)
                let _ = child.kill();
                let _ = child.wait();
            }
            return Bridge::Failed(format!(
                "did not serve the device within {} s",
                BRIDGE_WAIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(id: u32, pid: u32, config: &str, bridge: bool) -> DaemonState {
        DaemonState {
            pid,
            config: Some(config.into()),
            store_shm: Some(1),
            bridge,
            ..DaemonState::example(id)
        }
    }

    #[test]
    fn finds_the_live_daemon_of_a_config_by_role() {
        let dir = std::env::temp_dir().join(format!("uzram-handover-{}", std::process::id()));
        let states = StateDir::new(&dir);
        states.create().unwrap();
        let me = std::process::id();
        let started = crate::sys::start_ticks(me);
        // pid 0 is never a live daemon (process_alive refuses it); device 4's daemon had this
        // process's pid but started at another time: the pid was reused, that daemon is gone.
        for s in [
            state(1, me, "/etc/uzram/a.toml", false),
            state(2, 0, "/etc/uzram/a.toml", true),
            state(3, me, "/etc/uzram/b.toml", true),
            DaemonState {
                started: started.map(|t| t + 1),
                ..state(4, me, "/etc/uzram/d.toml", false)
            },
            DaemonState {
                started,
                ..state(5, me, "/etc/uzram/e.toml", false)
            },
        ] {
            states.write(&s).unwrap();
        }
        let a = Path::new("/etc/uzram/a.toml");
        let b = Path::new("/etc/uzram/b.toml");
        assert_eq!(live_daemon(&states, a, Some(false)).map(|s| s.id), Some(1));
        assert_eq!(
            live_daemon(&states, a, Some(true)),
            None,
            "a dead bridge is no bridge"
        );
        assert_eq!(live_daemon(&states, a, None).map(|s| s.id), Some(1));
        assert_eq!(live_daemon(&states, b, Some(true)).map(|s| s.id), Some(3));
        assert_eq!(live_daemon(&states, b, Some(false)), None);
        assert_eq!(
            live_daemon(&states, Path::new("/etc/uzram/c.toml"), None),
            None
        );
        assert_eq!(
            live_daemon(&states, Path::new("/etc/uzram/d.toml"), None),
            None,
            "a reused pid is not the daemon"
        );
        assert_eq!(
            live_daemon(&states, Path::new("/etc/uzram/e.toml"), None).map(|s| s.id),
            Some(5)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_daemon_without_a_store_cannot_hand_over() {
        let mut s = state(9, std::process::id(), "/etc/uzram/a.toml", false);
        s.store_shm = None;
        let err = request(&s).unwrap_err().to_string();
        assert!(err.contains("keeps no store"), "{err}");
    }
}

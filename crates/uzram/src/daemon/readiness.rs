//! How a daemon tells whoever started it that its device serves, or why it does not.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::Mutex;

use super::notify;

/// How the daemon tells its starter that the device is ready (or that it failed).
pub enum Readiness {
    /// `uzram create`: a pipe to the waiting `create`: `READY <id>` or `ERROR <message>`
    /// (or, for `uzram daemon --wait`, `STOPPED`: the device went with its daemon).
    Pipe(OwnedFd),
    /// `uzram run`: sd_notify `READY=1` (when `NOTIFY_SOCKET` is set).
    Systemd,
    /// `uzram create --foreground`: print the device path on stdout.
    Stdout,
}

/// Reports readiness exactly once.
pub struct Reporter {
    how: Mutex<Option<Readiness>>,
}

impl Reporter {
    /// A reporter that reports through `how`.
    pub fn new(how: Readiness) -> Self {
        Reporter {
            how: Mutex::new(Some(how)),
        }
    }

    fn take(&self) -> Option<Readiness> {
        self.how.lock().map_or(None, |mut g| g.take())
    }

    /// The device is serving at `dev`.
    pub fn ready(&self, id: u32, dev: &str) {
        let result = match self.take() {
            Some(Readiness::Pipe(fd)) => {
                std::fs::File::from(fd).write_all(format!("READY {id} {dev}\n").as_bytes())
            }
            Some(Readiness::Systemd) => {
                notify::notify(&format!("READY=1\nSTATUS=serving {dev}")).map(|_| ())
            }
            Some(Readiness::Stdout) => writeln!(std::io::stdout(), "{dev}"),
            None => Ok(()),
        };
        if let Err(err) = result {
            tracing::warn!(error = %err, "reporting readiness failed");
        }
    }

    /// The device this daemon waited to take over was stopped (`uzram daemon --wait`).
    pub fn stopped(&self) {
        if let Some(Readiness::Pipe(fd)) = self.take() {
            if let Err(err) = std::fs::File::from(fd).write_all(b"STOPPED\n") {
                tracing::warn!(error = %err, "reporting the stop failed");
            }
        }
    }

    /// The daemon could not start.
    pub fn failed(&self, err: &anyhow::Error) {
        if let Some(Readiness::Pipe(fd)) = self.take() {
            let line = format!("ERROR {err:#}").replace('\n', " ");
            let _ = std::fs::File::from(fd).write_all(format!("{line}\n").as_bytes());
        }
    }
}

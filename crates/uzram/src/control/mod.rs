//! The control plane: how any process finds and talks to running daemons.
//!
//! Each daemon publishes, under the root-only directory [`state::RUN_DIR`]:
//! - `<id>.json`: a small state file (pid, device, size, algorithm, backend);
//! - `<id>.sock`: a unix socket speaking line-delimited JSON ([`proto`]) for status and stop;
//! - `<id>.log`: its log, when started detached by `uzram create`.
//!
//! For recovery after a crash, a copy of the state lives in memory that is never swapped
//! (`takeover::record`).

pub mod client;
pub mod counters;
pub mod listener;
pub mod proto;
pub mod state;

/// Errors talking to a daemon or reading its published state.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Connecting to the daemon's socket failed (daemon gone or not ready).
    #[error("cannot connect to {path}")]
    Connect {
        /// The socket.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket or a state file failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The peer sent something that is not the protocol.
    #[error("malformed control message: {0}")]
    Protocol(String),
    /// A device's state file could not be parsed.
    #[error(
        "the state file {} of device {id} is damaged ({why}): once no daemon of the device \
         runs, `uzram destroy {id}` deletes the device and removes the file",
        path.display()
    )]
    DamagedState {
        /// The device.
        id: u32,
        /// The file.
        path: std::path::PathBuf,
        /// What the parser said.
        why: String,
    },
    /// The state directory is not root's alone: nothing in it is trusted.
    #[error(
        "{} {why}: daemons publish their state only in a directory no one but root can \
         change; remove it, and the next daemon makes it again",
        path.display()
    )]
    UntrustedDir {
        /// The directory.
        path: std::path::PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

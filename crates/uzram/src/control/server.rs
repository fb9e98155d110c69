//! The daemon's side of the control socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use super::proto::{decode, encode, Request, Response, MAX_LINE};
use super::ControlError;

/// Binds the control socket at `path` (replacing a stale one), readable by root only.
pub fn bind(path: &Path) -> Result<UnixListener, ControlError> {
    let io = |what: &str| {
        let what = format!("{what} {}", path.display());
        move |source| ControlError::Io { what, source }
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing stale socket")(e)),
    }
    let listener = UnixListener::bind(path).map_err(io("binding control socket"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io("restricting control socket"))?;
    Ok(listener)
}

/// Answers connections forever: one request line in, one response line out. A client that
/// sends garbage or stalls only loses its own connection.
pub fn serve(listener: UnixListener, handler: impl Fn(Request) -> Response) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                if let Err(err) = answer(stream, &handler) {
                    tracing::debug!(error = %err, "control connection failed");
                }
            }
            Err(err) => tracing::warn!(error = %err, "accepting a control connection failed"),
        }
    }
}

fn answer(stream: UnixStream, handler: &impl Fn(Request) -> Response) -> Result<(), ControlError> {
    let io = |what: &'static str| {
        move |source| ControlError::Io {
            what: what.to_string(),
            source,
        }
    };
    let timeout = Some(Duration::from_secs(5));
    stream
        .set_read_timeout(timeout)
        .map_err(io("set timeout"))?;
    stream
        .set_write_timeout(timeout)
        .map_err(io("set timeout"))?;
    let mut line = String::new();
    BufReader::new((&stream).take(MAX_LINE as u64))
        .read_line(&mut line)
        .map_err(io("reading request"))?;
    let response = match decode::<Request>(&line) {
        Ok(req) => handler(req),
        Err(err) => Response::Error {
            message: err.to_string(),
        },
    };
    (&stream)
        .write_all(encode(&response).as_bytes())
        .map_err(io("writing response"))
}

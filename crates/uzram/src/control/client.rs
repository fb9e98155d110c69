//! The client side of the control socket, used by `uzram status|list|destroy`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::proto::{decode, encode, Request, Response, MAX_LINE};
use super::ControlError;

/// Sends one request and waits (up to `timeout` per read/write) for the response.
pub fn request(socket: &Path, req: &Request, timeout: Duration) -> Result<Response, ControlError> {
    let stream = UnixStream::connect(socket).map_err(|source| ControlError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    let io = |what: &'static str| {
        move |source| ControlError::Io {
            what: what.to_string(),
            source,
        }
    };
    stream
        .set_read_timeout(Some(timeout))
        .map_err(io("set timeout"))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(io("set timeout"))?;
    (&stream)
        .write_all(encode(req).as_bytes())
        .map_err(io("sending request"))?;
    let mut line = String::new();
    BufReader::new((&stream).take(MAX_LINE as u64))
        .read_line(&mut line)
        .map_err(io("reading response"))?;
    if line.is_empty() {
        // The daemon closes a connection from anyone but root unanswered.
        let why = if crate::sys::is_root() {
            "daemon closed the connection"
        } else {
            "daemon closed the connection (it answers root only)"
        };
        return Err(ControlError::Protocol(why.into()));
    }
    decode(&line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::listener;
    use crate::control::proto::{DeviceStatus, Stat};

    fn status() -> DeviceStatus {
        DeviceStatus {
            id: 5,
            dev: "/dev/ublkb5".into(),
            pid: std::process::id(),
            size: 4096,
            algorithm: "zstd:1".into(),
            backend: "cpu".into(),
            queues: 1,
            depth: 8,
            queue_mode: "per-queue".into(),
            stats: vec![Stat {
                name: "same_pages".into(),
                value: 7,
            }],
            requests: vec![],
            backend_stats: Vec::new(),
        }
    }

    #[test]
    fn request_and_response_cross_a_real_socket() {
        let dir = std::env::temp_dir().join(format!("uzram-ctl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("5.sock");
        // A stale file in the way is replaced.
        std::fs::write(&path, b"stale").unwrap();
        let socket = listener::bind(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            listener::serve(
                socket,
                move |req| match req {
                    Request::Status => Response::Status(status()),
                    Request::Stop => {
                        tx.send(()).unwrap();
                        Response::Stopping
                    }
                    Request::Handoff => Response::HandingOff,
                    _ => Response::Error {
                        message: "not served by this test".into(),
                    },
                },
                None,
            )
        });
        let t = Duration::from_secs(5);
        assert_eq!(
            request(&path, &Request::Status, t).unwrap(),
            Response::Status(status())
        );
        assert_eq!(
            request(&path, &Request::Stop, t).unwrap(),
            Response::Stopping
        );
        rx.recv_timeout(t).unwrap();
        assert_eq!(
            request(&path, &Request::Handoff, t).unwrap(),
            Response::HandingOff
        );

        // Garbage gets an error reply, and the server keeps serving.
        let mut raw = UnixStream::connect(&path).unwrap();
        raw.write_all(b"{\"cmd\":\"explode\"}\n").unwrap();
        let mut reply = String::new();
        BufReader::new(&raw).read_line(&mut reply).unwrap();
        assert!(matches!(
            decode::<Response>(&reply).unwrap(),
            Response::Error { .. }
        ));
        assert!(request(&path, &Request::Status, t).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_socket_is_a_connect_error() {
        let err = request(
            Path::new("/nonexistent/uzram.sock"),
            &Request::Status,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(matches!(err, ControlError::Connect { .. }));
    }
}

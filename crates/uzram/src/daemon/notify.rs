//! systemd's readiness protocol (sd_notify): one datagram to `$NOTIFY_SOCKET`.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `READY=1`) to the socket named by `NOTIFY_SOCKET`, if set.
/// Returns whether a message was sent. A path starting with `@` is an abstract socket.
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    send_to(&target, state)?;
    Ok(true)
}

fn send_to(target: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = target.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(std::path::Path::new(target))?,
    };
    let sock = UnixDatagram::unbound()?;
    sock.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagram_reaches_a_path_socket() {
        let path = std::env::temp_dir().join(format!("uzram-notify-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        send_to(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn datagram_reaches_an_abstract_socket() {
        let name = format!("uzram-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
            .unwrap();
        send_to(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}

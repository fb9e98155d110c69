//! Sends a daemon's direct writes to stdout and stderr through the log's lossy queue.
//!
//! A daemon's log goes to a writer thread through a bounded queue that drops lines when full,
//! so that no serving thread waits on the log's destination. That destination is a file on
//! tmpfs (`/run/uzram`) or the journal, and either can wait for a swap-in from the very device
//! the daemon serves. Lines that bypass the queue — an `eprintln!` in a library (libublk prints
//! one while it reloads a device it takes over), a panic message — went straight to the same
//! open file: in the guest, a successor daemon's main thread sat in `writev` on fd 2 behind the
//! file's position lock, held by its own log writer, which was swapping in a page of the log
//! from the paused device the successor was about to serve. Neither could go on.
//!
//! [`install`] points the chosen descriptors at a pipe and drains it on a thread of its own
//! into the lossy queue. A direct write then waits at most for the drainer to empty the pipe,
//! and the drainer never waits on the destination.
//!
//! A child meant to outlive the daemon (its standby, a restart's bridge) must not inherit the
//! pipe, whose reader dies with the daemon: [`original`] gives it the descriptor as it was.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::sync::{mpsc, Mutex, PoisonError};
use std::time::Duration;

use crate::sys;

/// Longest piece the drainer forwards as one log message. A created device's standby logs to
/// the kernel's log (`/dev/kmsg`), which refuses a write of more than 1024 bytes whole.
const MAX_PIECE: usize = 960;

/// How long [`StdioRoute`]'s drop waits for the drainer to forward what is left in the pipe.
const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// Each routed descriptor with a copy of what it pointed at before, while its route stands:
/// its [`StdioRoute`] puts them back, and [`original`] hands out copies.
static ORIGINALS: Mutex<Vec<(RawFd, OwnedFd)>> = Mutex::new(Vec::new());

/// A copy of what `fd` pointed at before [`install`] routed it (`None`: not routed), for a
/// child that outlives this process: the routed pipe's reader dies with it.
pub fn original(fd: RawFd) -> Option<OwnedFd> {
    let originals = ORIGINALS.lock().unwrap_or_else(PoisonError::into_inner);
    let (_, old) = originals.iter().find(|(f, _)| *f == fd)?;
    old.try_clone().ok()
}

/// Descriptors pointed at the drained pipe; dropping it points them back and lets the drainer
/// finish.
pub struct StdioRoute {
    /// The routed descriptors (what they pointed at before is in [`ORIGINALS`]).
    fds: Vec<RawFd>,
    /// Closed by the drainer when it has forwarded everything (end of file on the pipe).
    done: mpsc::Receiver<()>,
}

/// Points each of `fds` at one pipe whose bytes a thread named `uzram-stdio` forwards to `sink`
/// in chunks. `sink` must not block (a lossy `tracing_appender` writer).
pub fn install(fds: &[RawFd], sink: impl Write + Send + 'static) -> io::Result<StdioRoute> {
    let (read, write) = sys::pipe_cloexec()?;
    let mut saved = Vec::with_capacity(fds.len());
    for &fd in fds {
        saved.push((fd, sys::dup_cloexec(fd)?));
    }
    let (done_tx, done) = mpsc::channel::<()>();
    let mut pipe = std::fs::File::from(read);
    // The drainer must never take a daemon's stop signal (`with_stop_signals_blocked`).
    sys::with_stop_signals_blocked(|| {
        std::thread::Builder::new()
            .name("uzram-stdio".into())
            // A daemon locks every thread's stack whole: this one needs little.
            .stack_size(64 << 10)
            .spawn(move || {
                let mut sink = sink;
                let mut forward = |piece: &[u8]| {
                    let _ = sink.write_all(piece);
                };
                let mut lines = Lines::default();
                let mut buf = [0u8; 4096];
                loop {
                    match pipe.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => lines.feed(&buf[..n], &mut forward),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                lines.finish(&mut forward);
                drop(done_tx);
            })
    })?;
    // From here the pipe's only writers are the routed descriptors (and children that
    // inherit them): `write` itself closes at the end of this function.
    for &fd in fds {
        if let Err(err) = crate::sys::redirect_fd(write.as_fd(), fd) {
            restore(&saved);
            return Err(err);
        }
    }
    ORIGINALS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(saved);
    Ok(StdioRoute {
        fds: fds.to_vec(),
        done,
    })
}

/// Cuts the drained bytes into lines, each forwarded as one message (a line of `eprintln!`
/// and a log line never share one), none longer than [`MAX_PIECE`].
struct Lines {
    buf: [u8; MAX_PIECE],
    len: usize,
}

impl Default for Lines {
    fn default() -> Self {
        Self {
            buf: [0; MAX_PIECE],
            len: 0,
        }
    }
}

impl Lines {
    fn feed(&mut self, mut bytes: &[u8], out: &mut impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            let room = &bytes[..bytes.len().min(MAX_PIECE - self.len)];
            let take = room
                .iter()
                .position(|&b| b == b'\n')
                .map_or(room.len(), |i| i + 1);
            self.buf[self.len..self.len + take].copy_from_slice(&bytes[..take]);
            self.len += take;
            bytes = &bytes[take..];
            if self.len == MAX_PIECE || self.buf[self.len - 1] == b'\n' {
                out(&self.buf[..self.len]);
                self.len = 0;
            }
        }
    }

    /// Forwards what is left of a last line without its newline.
    fn finish(&mut self, out: &mut impl FnMut(&[u8])) {
        if self.len > 0 {
            out(&self.buf[..self.len]);
            self.len = 0;
        }
    }
}

impl Drop for StdioRoute {
    fn drop(&mut self) {
        let saved: Vec<(RawFd, OwnedFd)> = {
            let mut originals = ORIGINALS.lock().unwrap_or_else(PoisonError::into_inner);
            let (ours, others) = std::mem::take(&mut *originals)
                .into_iter()
                .partition(|(fd, _)| self.fds.contains(fd));
            *originals = others;
            ours
        };
        restore(&saved);
        // End of file once no routed descriptor is left open on the pipe; a child that
        // inherited one keeps it open, hence the bound.
        let _ = self.done.recv_timeout(DRAIN_WAIT);
    }
}

fn restore(saved: &[(RawFd, OwnedFd)]) {
    for (fd, old) in saved {
        // A failure leaves `fd` on the pipe, which still reaches the log.
        let _ = crate::sys::redirect_fd(old.as_fd(), *fd);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::fd::FromRawFd;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    /// A sink that accepts nothing until released, as a log file whose page is in swap on a
    /// paused device would.
    #[derive(Clone)]
    struct Stalled {
        gate: Arc<(Mutex<bool>, std::sync::Condvar)>,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Stalled {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let (open, cv) = &*self.gate;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            self.got.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A descriptor of this test's own (never 0–2, which the test harness shares).
    fn own_fd() -> OwnedFd {
        OwnedFd::from(std::fs::File::open("/dev/null").unwrap())
    }

    fn write_raw(fd: RawFd, bytes: &[u8]) -> io::Result<()> {
        // The descriptor belongs to the test; ManuallyDrop keeps the File from closing it.
        // SAFETY: `fd` is open for the duration of the call and is not closed here.
        let mut file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
        file.write_all(bytes)
    }

    #[test]
    fn lines_are_forwarded_whole_and_long_ones_in_pieces() {
        let mut got: Vec<Vec<u8>> = Vec::new();
        let mut lines = Lines::default();
        let mut out = |p: &[u8]| got.push(p.to_vec());
        lines.feed(b"ab\ncd", &mut out);
        lines.feed(b"e\nf", &mut out);
        lines.feed(&[b'x'; 2000], &mut out);
        lines.feed(b"\n", &mut out);
        lines.feed(b"tail", &mut out);
        lines.finish(&mut out);
        let lens: Vec<usize> = got.iter().map(Vec::len).collect();
        assert_eq!(
            lens,
            [3, 4, MAX_PIECE, MAX_PIECE, 2001 - 2 * MAX_PIECE + 1, 4]
        );
        assert_eq!(got[0], b"ab\n");
        assert_eq!(got[1], b"cde\n");
        assert_eq!(got[2][0], b'f');
        assert_eq!(got[4].last(), Some(&b'\n'));
        assert_eq!(got[5], b"tail");
        assert_eq!(got.concat().len(), 3 + 4 + 1 + 2000 + 1 + 4);
    }

    #[test]
    fn a_direct_write_does_not_wait_for_a_stalled_log() {
        // Before the route, the descriptor is a pipe that nobody reads: a write past its
        // capacity would block for good.
        let (_unread, target) = sys::pipe_cloexec().unwrap();
        let sink = Stalled {
            gate: Arc::new((Mutex::new(false), std::sync::Condvar::new())),
            got: Arc::new(Mutex::new(Vec::new())),
        };
        let (lossy, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(true)
            .buffered_lines_limit(16)
            .finish(sink.clone());
        let route = install(&[target.as_raw_fd()], lossy).unwrap();
        // Sixteen times a pipe's default capacity.
        let line = [b'x'; 4095];
        let (tx, rx) = mpsc::channel();
        let fd = target.as_raw_fd();
        std::thread::spawn(move || {
            let started = Instant::now();
            for _ in 0..256 {
                write_raw(fd, &line).unwrap();
                write_raw(fd, b"\n").unwrap();
            }
            let _ = tx.send(started.elapsed());
        });
        let took = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("direct writes waited for the stalled log");
        assert!(took < Duration::from_secs(30));
        // Released, the destination gets what the queue kept: something, not all of it.
        {
            let (open, cv) = &*sink.gate;
            *open.lock().unwrap() = true;
            cv.notify_all();
        }
        drop(route);
        drop(guard);
        let got = sink.got.lock().unwrap().len();
        assert!(got > 0, "nothing reached the log");
        assert!(
            got < 256 * 4096,
            "a stalled log kept everything: {got} bytes"
        );
    }

    #[test]
    fn routed_bytes_reach_the_log_and_the_descriptor_is_given_back() {
        let target = own_fd();
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = Stalled {
            gate: Arc::new((Mutex::new(true), std::sync::Condvar::new())),
            got: got.clone(),
        };
        let (lossy, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(true)
            .finish(sink);
        let before = std::fs::read_link(format!("/proc/self/fd/{}", target.as_raw_fd())).unwrap();
        let route = install(&[target.as_raw_fd()], lossy).unwrap();
        let during = std::fs::read_link(format!("/proc/self/fd/{}", target.as_raw_fd())).unwrap();
        assert!(during.to_string_lossy().starts_with("pipe:"), "{during:?}");
        // What a child that outlives this process gets instead: the descriptor as it was.
        let kept = original(target.as_raw_fd()).expect("a routed descriptor's original");
        let kept_is = std::fs::read_link(format!("/proc/self/fd/{}", kept.as_raw_fd())).unwrap();
        assert_eq!(kept_is, before);
        write_raw(target.as_raw_fd(), b"device reload json failed\n").unwrap();
        drop(route);
        drop(guard);
        let after = std::fs::read_link(format!("/proc/self/fd/{}", target.as_raw_fd())).unwrap();
        assert_eq!(after, before);
        assert!(original(target.as_raw_fd()).is_none(), "the route is gone");
        assert_eq!(&*got.lock().unwrap(), b"device reload json failed\n");
    }
}

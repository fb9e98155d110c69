//! The daemon's side of the control socket.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use super::proto::{decode, encode, Request, Response, MAX_LINE};
use super::ControlError;
use crate::sys;

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

/// How long a client has to send its request line before its connection is closed. Other
/// clients are served meanwhile, so a slow one (a `uzram status` paging itself back in under
/// memory pressure) holds up nobody but itself.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// Connections waiting for their request line at once; one more closes the oldest. The
/// daemon runs under memory pressure: whatever clients do, the serving thread stays one
/// thread, with at most this many buffers.
const MAX_PENDING: usize = 8;

/// How long writing a response may block. A response fits in the socket's buffer, so only a
/// peer that is not reading a full buffer would take this long.
const WRITE_TIMEOUT: Duration = Duration::from_millis(100);

/// The pause after the socket itself fails (out of descriptors, say), where retrying at
/// once would spin: short enough to hold no client up for longer than a write may.
const ERROR_PAUSE: Duration = WRITE_TIMEOUT;

/// Only root may ask for anything: the socket's mode and its root-only directory keep others
/// out already, and this holds should either be loosened.
const ALLOWED_UID: libc::uid_t = 0;

/// What a connection may take from the serving thread.
#[derive(Debug, Clone, Copy)]
struct Limits {
    deadline: Duration,
    max_pending: usize,
}

const LIMITS: Limits = Limits {
    deadline: REQUEST_DEADLINE,
    max_pending: MAX_PENDING,
};

/// Answers connections forever, one thread for all of them: one request line in, one
/// response line out. A connection from any user but root is closed unanswered. A client
/// that sends garbage, stalls or dribbles only loses its own connection: the thread waits on
/// every connection at once and serves whichever has sent its line. Requests that `long`
/// names go, with their connection, to its thread, which answers them (a tier pass takes
/// minutes, and answered here it held every other client up for as long: `uzram status`
/// found a busy daemon stale, a handoff timed out and ran minutes later).
pub fn serve(
    listener: UnixListener,
    handler: impl Fn(Request) -> Response,
    long: Option<LongRequests>,
) {
    serve_with(listener, &handler, long.as_ref(), LIMITS);
}

/// Where the serving thread sends the requests that take long.
pub struct LongRequests {
    /// Which requests.
    pub is_long: fn(&Request) -> bool,
    /// Their thread's line: at most [`LONG_WAITING`] wait for it; one more is refused.
    pub to: SyncSender<Handed>,
}

/// Long requests that may wait for their thread at once, beside the one it serves.
pub const LONG_WAITING: usize = 4;

/// The line of long requests and its end: `LongRequests::to` and the thread's receiver.
pub fn long_line(is_long: fn(&Request) -> bool) -> (LongRequests, Receiver<Handed>) {
    let (to, from) = std::sync::mpsc::sync_channel(LONG_WAITING);
    (LongRequests { is_long, to }, from)
}

/// A long request and the connection its answer goes to.
pub struct Handed {
    /// The request.
    pub request: Request,
    stream: UnixStream,
}

impl Handed {
    /// Whether the client has gone (hung up, or its connection broke) since it asked: its
    /// request is not acted on, since no one waits for what it does.
    pub fn client_gone(&self) -> bool {
        let mut fds = [libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        }];
        match sys::poll(&mut fds, Some(Duration::ZERO)) {
            Ok(_) => fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0,
            Err(_) => false,
        }
    }

    /// Sends the answer.
    pub fn answer(self, response: &Response) -> Result<(), ControlError> {
        respond(self.stream, response)
    }
}

/// A connection still sending its request line.
struct Pending {
    stream: UnixStream,
    line: Vec<u8>,
    deadline: Instant,
}

/// Where a connection's request line stands after a read.
enum Progress {
    /// More is to come.
    Waiting,
    /// The line is complete (or the client stopped sending, or sent too much): answer it.
    Complete,
    /// The connection broke.
    Failed(std::io::Error),
}

fn serve_with(
    listener: UnixListener,
    handler: &impl Fn(Request) -> Response,
    long: Option<&LongRequests>,
    limits: Limits,
) {
    // Accepting stops where nothing is pending instead of blocking the thread.
    if let Err(err) = listener.set_nonblocking(true) {
        tracing::warn!(error = %err, "control socket left blocking");
    }
    let mut pending: VecDeque<Pending> = VecDeque::with_capacity(limits.max_pending);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(limits.max_pending + 1);
    let wait_for = |fd: std::os::fd::RawFd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        let now = Instant::now();
        pending.retain(|conn| {
            let live = conn.deadline > now;
            if !live {
                tracing::debug!("control client sent no request in time; connection closed");
            }
            live
        });
        fds.clear();
        fds.push(wait_for(listener.as_raw_fd()));
        fds.extend(pending.iter().map(|conn| wait_for(conn.stream.as_raw_fd())));
        let timeout = pending.iter().map(|conn| conn.deadline - now).min();
        match sys::poll(&mut fds, timeout) {
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => {
                tracing::warn!(error = %err, "waiting on control connections failed");
                std::thread::sleep(ERROR_PAUSE);
                continue;
            }
        }
        // From the back, so that removing one leaves the indices of those before it (and
        // their `fds` entries, one place on) as they were.
        for i in (0..pending.len()).rev() {
            if fds[i + 1].revents == 0 {
                continue;
            }
            match read_more(&mut pending[i]) {
                Progress::Waiting => {}
                Progress::Complete => {
                    if let Some(conn) = pending.remove(i) {
                        if let Err(err) = answer(conn, handler, long) {
                            tracing::debug!(error = %err, "control connection failed");
                        }
                    }
                }
                Progress::Failed(err) => {
                    pending.remove(i);
                    tracing::debug!(error = %err, "control connection failed");
                }
            }
        }
        if fds[0].revents != 0 {
            accept_all(&listener, &mut pending, limits);
        }
    }
}

/// Takes every connection waiting to be accepted, closing those of anyone but root.
fn accept_all(listener: &UnixListener, pending: &mut VecDeque<Pending>, limits: Limits) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => {
                tracing::warn!(error = %err, "accepting a control connection failed");
                // The listener stays readable: see `ERROR_PAUSE`.
                std::thread::sleep(ERROR_PAUSE);
                return;
            }
        };
        match sys::peer_cred(stream.as_fd()) {
            Ok(peer) if peer.uid == ALLOWED_UID => {}
            Ok(peer) => {
                tracing::warn!(
                    uid = peer.uid,
                    pid = peer.pid,
                    "control connection refused: only root may use the control socket"
                );
                continue;
            }
            Err(err) => {
                tracing::warn!(error = %err, "control connection refused: its peer is unknown");
                continue;
            }
        }
        if let Err(err) = stream.set_nonblocking(true) {
            tracing::debug!(error = %err, "control connection failed");
            continue;
        }
        if pending.len() >= limits.max_pending {
            pending.pop_front();
            tracing::debug!(
                max = limits.max_pending,
                "too many control connections waiting; the oldest closed"
            );
        }
        pending.push_back(Pending {
            stream,
            line: Vec::new(),
            deadline: Instant::now() + limits.deadline,
        });
    }
}

/// Reads what the connection has sent so far, without waiting.
fn read_more(conn: &mut Pending) -> Progress {
    let mut buf = [0u8; 1024];
    loop {
        let room = MAX_LINE - conn.line.len();
        if room == 0 {
            return Progress::Complete;
        }
        let want = room.min(buf.len());
        match (&conn.stream).read(&mut buf[..want]) {
            Ok(0) => return Progress::Complete,
            Ok(n) => {
                let got = &buf[..n];
                if let Some(end) = got.iter().position(|&b| b == b'\n') {
                    conn.line.extend_from_slice(&got[..=end]);
                    return Progress::Complete;
                }
                conn.line.extend_from_slice(got);
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return Progress::Waiting,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Progress::Failed(err),
        }
    }
}

fn answer(
    conn: Pending,
    handler: &impl Fn(Request) -> Response,
    long: Option<&LongRequests>,
) -> Result<(), ControlError> {
    let request = match std::str::from_utf8(&conn.line) {
        Ok(line) => decode::<Request>(line).map_err(|err| err.to_string()),
        Err(_) => Err("the request is not UTF-8".to_string()),
    };
    let (response, stream) = match (request, long) {
        (Ok(request), Some(long)) if (long.is_long)(&request) => {
            let handed = Handed {
                request,
                stream: conn.stream,
            };
            match long.to.try_send(handed) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(h)) => (
                    Response::Error {
                        message: format!(
                            "{LONG_WAITING} requests for writeback or recompression passes \
                             already wait for the one running; try again once they are done"
                        ),
                    },
                    h.stream,
                ),
                Err(TrySendError::Disconnected(h)) => (
                    Response::Error {
                        message: "the daemon's thread for writeback and recompression passes \
                                  has stopped; see the daemon's log"
                            .into(),
                    },
                    h.stream,
                ),
            }
        }
        (Ok(request), _) => (handler(request), conn.stream),
        (Err(message), _) => (Response::Error { message }, conn.stream),
    };
    respond(stream, &response)
}

/// Writes `response` to a connection, waiting at most [`WRITE_TIMEOUT`].
fn respond(stream: UnixStream, response: &Response) -> Result<(), ControlError> {
    let io = |what: &'static str| {
        move |source| ControlError::Io {
            what: what.to_string(),
            source,
        }
    };
    stream.set_nonblocking(false).map_err(io("set blocking"))?;
    stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .map_err(io("set timeout"))?;
    (&stream)
        .write_all(encode(response).as_bytes())
        .map_err(io("writing response"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::DeviceStatus;
    use std::io::{BufRead, BufReader};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::SocketAddr;

    /// How soon a client must be answered while others stall: with connections served one
    /// after another, it waited for the stalled one's whole timeout (5 s, or the dribbler's
    /// 3 s less the 1 s before it asks). A second leaves room for a busy 2-core CI machine.
    const PROMPT: Duration = Duration::from_secs(1);

    fn status() -> DeviceStatus {
        DeviceStatus {
            id: 0,
            dev: "/dev/ublkb0".into(),
            pid: std::process::id(),
            size: 4096,
            algorithm: "lz4".into(),
            backend: "cpu".into(),
            queues: 1,
            depth: 8,
            queue_mode: "per-queue".into(),
            stats: Vec::new(),
            requests: Vec::new(),
            backend_stats: Vec::new(),
        }
    }

    /// A server on an abstract socket (no file, no permissions: anyone on the host can
    /// connect, which reaches the checks behind the socket's mode), on a thread of its own.
    fn start(tag: &str, limits: Limits) -> SocketAddr {
        let name = format!("uzram-test-{tag}-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        std::thread::spawn(move || {
            serve_with(
                listener,
                &|req| match req {
                    Request::Status => Response::Status(status()),
                    Request::Stop => Response::Stopping,
                    Request::Handoff => Response::HandingOff,
                    _ => Response::Error {
                        message: "not served by this test".into(),
                    },
                },
                None,
                limits,
            )
        });
        addr
    }

    /// Sends a status request on `stream` and reads the answer.
    fn ask(stream: &UnixStream) -> std::io::Result<Response> {
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut w = stream;
        w.write_all(encode(&Request::Status).as_bytes())?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line)?;
        decode(&line).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    fn ask_new(addr: &SocketAddr) -> std::io::Result<(Response, Duration)> {
        let start = Instant::now();
        let stream = UnixStream::connect_addr(addr)?;
        Ok((ask(&stream)?, start.elapsed()))
    }

    /// True when the server closed `stream` within `within` (read sees the end, or a reset).
    fn closed_within(stream: &UnixStream, within: Duration) -> bool {
        stream.set_read_timeout(Some(within)).unwrap();
        let mut byte = [0u8; 1];
        match (&*stream).read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }

    /// The attack: a client connects and sends nothing (or half a line) while another asks.
    #[test]
    fn a_stalled_client_holds_no_one_up() {
        let addr = start("stall", LIMITS);
        let silent = UnixStream::connect_addr(&addr).unwrap();
        let half = UnixStream::connect_addr(&addr).unwrap();
        (&half).write_all(b"{\"cmd\":").unwrap();
        // The server has taken both before the request below.
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            let (got, took) = ask_new(&addr).unwrap();
            assert_eq!(got, Response::Status(status()));
            assert!(
                took < PROMPT,
                "answered after {took:?} behind stalled clients"
            );
        }
        // The stalled ones lost nothing either: the half line, finished, is answered.
        (&half).write_all(b"\"status\"}\n").unwrap();
        let mut line = String::new();
        BufReader::new(&half).read_line(&mut line).unwrap();
        assert_eq!(
            decode::<Response>(&line).unwrap(),
            Response::Status(status())
        );
        drop(silent);
    }

    /// A client gets its deadline for the whole line, not per read: one that sends a byte
    /// at a time, each in time for a per-read timeout, is closed at the deadline too.
    #[test]
    fn a_dribbling_client_is_closed_at_its_deadline() {
        let deadline = Duration::from_secs(3);
        let addr = start(
            "dribble",
            Limits {
                deadline,
                max_pending: MAX_PENDING,
            },
        );
        let silent = UnixStream::connect_addr(&addr).unwrap();
        let dribbler = UnixStream::connect_addr(&addr).unwrap();
        // On this thread, not one of its own: see `park_forever`.
        let start = Instant::now();
        let mut answered = false;
        let cut = loop {
            // Blanks before the JSON: a line that never ends.
            if (&dribbler).write_all(b" ").is_err() {
                break start.elapsed();
            }
            assert!(
                start.elapsed() < deadline + Duration::from_secs(5),
                "the dribbler was never cut off"
            );
            if !answered && start.elapsed() >= deadline / 3 {
                let (got, took) = ask_new(&addr).unwrap();
                assert_eq!(got, Response::Status(status()));
                assert!(took < PROMPT, "answered after {took:?}");
                answered = true;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(answered, "cut after {cut:?}, before the deadline");
        assert!(
            cut >= deadline && cut < deadline + Duration::from_secs(3),
            "cut after {cut:?}"
        );
        assert!(closed_within(&silent, Duration::from_secs(3)));
    }

    /// The attack: many connections that send nothing. The serving thread keeps a fixed
    /// number of them and closes the oldest for each new one; everyone who asks is answered.
    #[test]
    fn waiting_connections_are_bounded() {
        let addr = start(
            "flood",
            Limits {
                deadline: Duration::from_secs(60),
                max_pending: 4,
            },
        );
        let silent: Vec<UnixStream> = (0..6)
            .map(|_| UnixStream::connect_addr(&addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let (got, took) = ask_new(&addr).unwrap();
        assert_eq!(got, Response::Status(status()));
        assert!(took < PROMPT, "answered after {took:?}");
        // Six waited, then the request: three oldest closed, three kept.
        for (i, conn) in silent.iter().enumerate() {
            let closed = closed_within(conn, Duration::from_millis(100));
            assert_eq!(closed, i < 3, "connection {i}");
        }
    }

    /// A server whose writeback requests go to a thread of their own, which takes `pass`
    /// for each (a tier pass takes minutes) and reports the requests it ran, or skipped for
    /// their client having gone, on the channel returned.
    fn start_with_passes(
        tag: &str,
        pass: Duration,
    ) -> (SocketAddr, std::sync::mpsc::Receiver<&'static str>) {
        let name = format!("uzram-test-{tag}-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        let (long, passes) = long_line(|req| matches!(req, Request::Writeback { .. }));
        let (ran, runs) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for handed in passes {
                if handed.client_gone() {
                    let _ = ran.send("skipped");
                    continue;
                }
                std::thread::sleep(pass);
                let _ = ran.send("ran");
                let _ = handed.answer(&Response::Idled { pages: 7 });
            }
        });
        std::thread::spawn(move || {
            serve_with(
                listener,
                &|req| match req {
                    Request::Status => Response::Status(status()),
                    _ => Response::Error {
                        message: "not served by this test".into(),
                    },
                },
                Some(&long),
                LIMITS,
            )
        });
        (addr, runs)
    }

    fn writeback() -> Request {
        Request::Writeback {
            kind: "idle".into(),
            max_pages: None,
        }
    }

    fn send(addr: &SocketAddr, req: &Request) -> UnixStream {
        let stream = UnixStream::connect_addr(addr).unwrap();
        (&stream).write_all(encode(req).as_bytes()).unwrap();
        stream
    }

    fn read_answer(stream: &UnixStream, within: Duration) -> Response {
        stream.set_read_timeout(Some(within)).unwrap();
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        decode(&line).unwrap()
    }

    /// A pass of minutes, answered on the serving thread, held every other client up for as
    /// long: `uzram status` took the busy daemon for a stale one.
    #[test]
    fn a_long_pass_holds_no_one_up() {
        let (addr, runs) = start_with_passes("pass", Duration::from_secs(3));
        let pass = send(&addr, &writeback());
        std::thread::sleep(Duration::from_millis(100));
        for _ in 0..3 {
            let (got, took) = ask_new(&addr).unwrap();
            assert_eq!(got, Response::Status(status()));
            assert!(took < PROMPT, "answered after {took:?} behind a pass");
        }
        assert_eq!(
            read_answer(&pass, Duration::from_secs(10)),
            Response::Idled { pages: 7 }
        );
        assert_eq!(runs.recv_timeout(Duration::from_secs(1)), Ok("ran"));
    }

    /// Passes wait in line, a bounded one: one more is refused at once with an error that
    /// says why. A waiting pass whose client hung up is never run.
    #[test]
    fn passes_wait_in_a_bounded_line_and_a_gone_client_s_is_not_run() {
        let (addr, runs) = start_with_passes("line", Duration::from_secs(2));
        let running = send(&addr, &writeback());
        std::thread::sleep(Duration::from_millis(200));
        // The line fills; its first client hangs up while it waits.
        let waiting: Vec<UnixStream> = (0..LONG_WAITING)
            .map(|_| send(&addr, &writeback()))
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let refused = send(&addr, &writeback());
        match read_answer(&refused, PROMPT) {
            Response::Error { message } => assert!(message.contains("wait"), "{message}"),
            other => panic!("a pass past the line was answered {other:?}"),
        }
        let mut waiting = waiting.into_iter();
        drop(waiting.next());
        assert_eq!(
            read_answer(&running, Duration::from_secs(10)),
            Response::Idled { pages: 7 }
        );
        for stream in waiting {
            assert_eq!(
                read_answer(&stream, Duration::from_secs(20)),
                Response::Idled { pages: 7 }
            );
        }
        // In the line's order, which need not be the clients' (one turn of the serving
        // thread takes the requests that came together in any order).
        let reports: Vec<_> = (0..=LONG_WAITING)
            .map(|_| runs.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(reports[0], "ran");
        assert_eq!(
            reports.iter().filter(|&&r| r == "skipped").count(),
            1,
            "{reports:?}"
        );
    }

    /// Where a test's own thread ends instead of exiting. glibc keeps an exited thread's
    /// stack for the next thread, and `fault_guard`'s tests populate every mapping and then
    /// count the faults of a fresh thread's stack: one handed down, already populated, takes
    /// none.
    fn park_forever() -> ! {
        loop {
            std::thread::park();
        }
    }

    /// The attack: a user other than root reaches the socket (its mode or directory
    /// loosened: an abstract socket here, which anyone can connect to) and asks. It gets
    /// no answer, and root is still served.
    #[test]
    fn only_root_is_answered() {
        if !sys::is_root() {
            eprintln!("SKIP only_root_is_answered: a client of another uid needs root to make");
            return;
        }
        let addr = start("peer", LIMITS);
        let nobody_addr = addr.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            crate::sys::become_nobody_thread();
            let stream = UnixStream::connect_addr(&nobody_addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            // Refused before it reads, the server may be gone before this is written.
            let _ = (&stream).write_all(encode(&Request::Stop).as_bytes());
            let mut got = Vec::new();
            let got = match (&stream).read_to_end(&mut got) {
                Ok(_) => Ok(got),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(got),
                Err(e) => Err(e),
            };
            let _ = tx.send(got);
            park_forever();
        });
        let got = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the client of uid 65534 failed (see its panic)")
            .expect("the connection of uid 65534 was left open");
        assert!(
            got.is_empty(),
            "uid 65534 was answered: {}",
            String::from_utf8_lossy(&got)
        );
        let (got, took) = ask_new(&addr).unwrap();
        assert_eq!(got, Response::Status(status()));
        assert!(took < PROMPT, "answered after {took:?}");
    }
}

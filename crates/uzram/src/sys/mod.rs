//! The raw system calls of the binary, each wrapped in a function with its SAFETY note:
//! process, signals, files and sockets here; [`memory`] for address ranges; [`sched`] for
//! scheduling, [`affinity`] for the CPUs a thread runs on; [`disk`] for the backing device;
//! [`walk`] for opening a directory through links only root could have made; [`owned_file`]
//! for reading a small file only root could have written.
//! SysV shared memory has its own room, `crate::shm`.

pub mod affinity;
pub mod disk;
mod errno;
pub mod memory;
pub mod owned_file;
pub mod sched;
pub mod walk;

pub use sched::{at_io_priority, raise_io_thread_priority, set_thread_nice, IoPriority};

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use errno::check;

/// True when running with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Locks every current and future page of the process in RAM, so the daemon never swaps its own
/// memory out to the device it serves.
///
/// `MCL_ONFAULT`: new mappings are locked as their pages are first touched, not populated by
/// `mmap` itself. Populating runs with `mmap_lock` held, and under memory pressure it sits in
/// reclaim waiting for swap writes to this device; any thread then queued for the write lock
/// (malloc growth, munmap) blocks every later reader, including ublk copying request data into
/// our buffers: the device deadlocks (seen in the guest). Touching pages instead faults them
/// under the per-VMA lock only.
pub fn mlock_all() -> io::Result<()> {
    // SAFETY: mlockall only changes this process's paging policy; no memory is touched.
    check(unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) })
}

/// Marks the process as an I/O flusher (`PR_SET_IO_FLUSHER`): its allocations do not recurse
/// into reclaim that would wait on its own device.
pub fn set_io_flusher() -> io::Result<()> {
    /// `PR_SET_IO_FLUSHER` from <linux/prctl.h> (Linux 5.6); the libc crate lacks it.
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    // SAFETY: prctl(PR_SET_IO_FLUSHER, 1) takes no pointers; unused arguments are zero.
    check(unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) })
}

/// Makes the process non-dumpable (`PR_SET_DUMPABLE` 0): a crash writes no core file.
///
/// Why: a daemon's memory holds every page swapped out to its device, decompressed ones in
/// its buffers among them; a core file would put them on disk (systemd-coredump keeps them),
/// which swap on memory exists to avoid. And a core dump first waits for every thread to stop,
/// which a thread waiting for a page of its own device never does: a daemon that crashed while
/// its log writer waited for a swapped-out page of its log file sat in the dump for good
/// (seen in the guest), the device paused with it. Ptrace and `/proc/PID/mem` are then
/// root's alone, as they are for a root daemon anyway.
pub fn forbid_core_dumps() -> io::Result<()> {
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes no pointers; unused arguments are zero.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })
}

/// Whether the process may dump core (`PR_GET_DUMPABLE`).
#[cfg(test)]
pub fn dumpable() -> io::Result<bool> {
    // SAFETY: prctl(PR_GET_DUMPABLE) takes no pointers and returns the flag.
    let flag = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
    check(flag).map(|()| flag != 0)
}

/// Exempts the process from the OOM killer (`oom_score_adj` = -1000). The daemon holds other
/// processes' swapped-out pages and its RSS grows with them, so under pressure it is the
/// killer's favourite victim; killing it loses every page on the device (seen in the guest:
/// after the hog was killed, the daemon went next and took PID 1 with it). zram, being in
/// the kernel, cannot be chosen at all.
pub fn protect_from_oom_killer() -> io::Result<()> {
    std::fs::write("/proc/self/oom_score_adj", "-1000")
}

/// Ends the process at once with `code` (`_exit`): no destructors, no atexit handlers, no
/// flushing of buffers shared with a parent.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit takes an integer and never returns.
    unsafe { libc::_exit(code) }
}

/// Sets the permission bits of the file open at `fd` (`fchmod`: the file itself, never
/// what a name now points at).
pub fn fchmod(fd: std::os::fd::BorrowedFd<'_>, mode: libc::mode_t) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fchmod takes a descriptor, open for the call's duration, and an integer.
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode) })
}

/// Makes `fd` a copy of `from` (`dup2`), closing what `fd` was.
pub fn redirect_fd(from: std::os::fd::BorrowedFd<'_>, fd: i32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: dup2 takes two descriptors; `from` is open for the call's duration, and
    // replacing `fd` is what the caller asks.
    if unsafe { libc::dup2(from.as_raw_fd(), fd) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves the process into its own mount namespace, with `/` made a recursive slave so mounts
/// and unmounts outside still propagate in but nothing propagates out (libublk's mount-namespace
/// caveat: a daemon sharing a namespace with its device's users can deadlock on exit).
pub fn private_mount_namespace() -> io::Result<()> {
    // SAFETY: unshare(CLONE_NEWNS) takes no pointers and affects only this process.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
    let root = c"/";
    // SAFETY: `root` is a valid NUL-terminated string; source, fstype and data may be NULL for a
    // propagation change (MS_REC | MS_SLAVE).
    check(unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        )
    })
}

/// Starts a new session so the daemon is detached from the caller's terminal and process group.
pub fn new_session() -> io::Result<()> {
    // SAFETY: setsid takes no arguments.
    if unsafe { libc::setsid() } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// When process `pid` started, in clock ticks after boot (`/proc/<pid>/stat`, field 22).
/// A pid alone names a process only until it exits: the kernel hands it out again.
///
/// `/proc` must be the caller's pid namespace (as for the root daemon and the CLI): in
/// another one a live daemon's pid would name some other process or none.
pub fn start_ticks(pid: u32) -> Option<u64> {
    read_stat(pid)?.started
}

/// `/proc/<pid>/stat`, parsed. Read as bytes: a process's name is whatever it set (any user
/// can give theirs bytes that are not UTF-8), and the fields that matter come after it.
fn read_stat(pid: impl std::fmt::Display) -> Option<ProcStat> {
    let bytes = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&String::from_utf8_lossy(&bytes))
}

/// What one read of `/proc/<pid>/stat` says about a process.
#[derive(Debug, PartialEq, Eq)]
struct ProcStat {
    /// A zombie (or dead) process with no thread left but the exited leader.
    exited: bool,
    /// Its leader exited, and other threads are still there.
    dying: bool,
    /// Field 22, in clock ticks after boot.
    started: Option<u64>,
}

fn parse_stat(stat: &str) -> Option<ProcStat> {
    // "pid (comm) S ...": comm may hold spaces and parentheses, so fields are counted from
    // the last ')': the state is field 3, the thread count field 20, the start time 22.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let zombie = fields.first().is_some_and(|s| *s == "Z" || *s == "X");
    let threads: Option<u64> = fields.get(20 - 3).and_then(|n| n.parse().ok());
    Some(ProcStat {
        exited: zombie && threads.is_some_and(|n| n <= 1),
        dying: zombie && threads.is_some_and(|n| n > 1),
        started: fields.get(22 - 3).and_then(|n| n.parse().ok()),
    })
}

/// True when `pid` is alive and, if `started` is known, is the process that started then
/// (not a later one that was given the same pid).
///
/// An exited process stays a zombie until its parent reaps it, and a daemon's parent is
/// systemd, which may itself wait on the paused device: a zombie is not alive. But only once
/// its last thread has gone: a leader that exits first shows as a zombie while the other
/// threads still hold the process's files (the device's lock among them).
///
/// `/proc/<pid>/stat` is read once and decides alone when it can be read: a check in two
/// steps (signal 0, then the stat) took a zombie that its parent reaped between the two for
/// a live process, and a standby gave up its device (seen in the guest under systemd).
pub fn process_alive(pid: u32, started: Option<u64>) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    match read_stat(pid) {
        Some(stat) => {
            !stat.exited && started.is_none_or(|t| stat.started.is_none_or(|now| now == t))
        }
        // No stat: gone, unless the kernel still knows the pid (a /proc that is not this pid
        // namespace's), which is taken for alive, the safe answer: a caller that sees a live
        // daemon waits or refuses, one that sees a dead one takes its device over.
        None => {
            // SAFETY: signal 0 only checks for existence and permission; nothing is delivered.
            let ret = unsafe { libc::kill(pid, 0) };
            ret == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
        }
    }
}

/// How long ago this process was started (its fork, which for a spawned command is its
/// exec), to the clock tick (10 ms); `None` where `/proc` or the clock cannot say.
pub fn process_age() -> Option<std::time::Duration> {
    let started = start_ticks(std::process::id())?;
    // SAFETY: sysconf takes no pointers.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `now` is.
    check(unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) }).ok()?;
    let now = std::time::Duration::new(u64::try_from(now.tv_sec).ok()?, now.tv_nsec as u32);
    now.checked_sub(std::time::Duration::from_millis(
        started.checked_mul(1000)? / hz.max(1),
    ))
}

/// The set of signals that stop a daemon: SIGTERM and SIGINT.
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t for all three calls.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
    }
    set
}

/// Runs `spawn` with SIGTERM and SIGINT blocked in the calling thread, then restores the
/// thread's mask: threads started inside inherit the blocked set and never take a stop
/// signal, which is meant for the daemon's signal thread (a helper thread taking SIGTERM
/// would die with the whole process, leaving the device half deleted: seen under systemd).
pub fn with_stop_signals_blocked<T>(spawn: impl FnOnce() -> T) -> T {
    let set = stop_signals();
    // SAFETY: sigset_t is plain data; pthread_sigmask fills it with the old mask.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is initialized and `old` is a valid, exclusively borrowed sigset_t.
    let blocked = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) } == 0;
    let out = spawn();
    if blocked {
        // SAFETY: `old` holds the mask pthread_sigmask returned above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    out
}

/// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts afterwards, so
/// that [`wait_stop_signal`] receives them. Call before starting any thread.
pub fn block_stop_signals() -> io::Result<()> {
    let set = stop_signals();
    // SAFETY: `set` is initialized; the old mask is not needed (NULL).
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// Waits for SIGTERM or SIGINT (blocked beforehand) and returns its number.
pub fn wait_stop_signal() -> io::Result<i32> {
    let set = stop_signals();
    let mut sig: libc::c_int = 0;
    // SAFETY: `set` is initialized and `sig` is a valid out-pointer.
    let ret = unsafe { libc::sigwait(&set, &mut sig) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(sig)
}

/// A pipe whose read end is close-on-exec and whose write end is inherited by children.
pub fn inheritable_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (read, write) = pipe_with(0)?;
    use std::os::fd::AsRawFd;
    // SAFETY: `read` is an open descriptor; F_SETFD with FD_CLOEXEC takes no pointers.
    check(unsafe { libc::fcntl(read.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) })?;
    Ok((read, write))
}

/// A pipe whose two ends are close-on-exec.
pub fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    pipe_with(libc::O_CLOEXEC)
}

/// `pipe2(flags)`: the read end, then the write end.
fn pipe_with(flags: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), flags) })?;
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The file status flags of an open descriptor (`F_GETFL`: `O_APPEND`, the access mode...).
pub fn status_flags(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<libc::c_int> {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETFL takes no pointers and only reads the descriptor's flags.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    check(flags)?;
    Ok(flags)
}

/// A copy of descriptor `fd`, close-on-exec.
pub fn dup_cloexec(fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC takes no pointers; an invalid `fd` fails with EBADF.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    check(new)?;
    // SAFETY: fcntl returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Takes ownership of an inherited file descriptor number, marking it close-on-exec. The
/// standard streams (0, 1, 2) are refused: the process uses them itself, and owning one would
/// close it under that use.
pub fn adopt_fd(fd: i32) -> io::Result<OwnedFd> {
    if fd <= 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is a standard stream, not one handed over to be owned"),
        ));
    }
    // SAFETY: F_GETFD on an arbitrary number only checks that it is open.
    check(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: F_SETFD takes no pointers; the descriptor was just checked to be open.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) })?;
    // SAFETY: the descriptor is open and was handed to this process for it alone to own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens a block device with `O_EXCL`: fails with `EBUSY` while it is mounted, active swap or
/// held exclusively by anyone else.
pub fn open_exclusive(path: &std::path::Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(path)
}

/// Whose CPU time [`cpu_time`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuOf {
    /// Every thread of the process.
    Process,
    /// The calling thread.
    Thread,
}

/// User plus system CPU time used so far. The calling thread's is read from its CPU clock
/// (`CLOCK_THREAD_CPUTIME_ID`), which counts the slice it is running in; `getrusage` leaves
/// that out until the next tick or switch, up to a tick of error on every read, too coarse
/// to time a copy of 64 KiB.
pub fn cpu_time(of: CpuOf) -> io::Result<std::time::Duration> {
    if of == CpuOf::Thread {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec, which `now` is.
        check(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) })?;
        let secs = u64::try_from(now.tv_sec).unwrap_or_default();
        let nanos = u32::try_from(now.tv_nsec).unwrap_or_default();
        return Ok(std::time::Duration::new(secs, nanos));
    }
    usage(of).map(|u| u.cpu)
}

/// CPU time and page faults so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// User plus system CPU time.
    pub cpu: std::time::Duration,
    /// Minor and major page faults.
    pub faults: u64,
}

/// [`Usage`] of the process or the calling thread.
pub fn usage(of: CpuOf) -> io::Result<Usage> {
    let who = match of {
        CpuOf::Process => libc::RUSAGE_SELF,
        CpuOf::Thread => libc::RUSAGE_THREAD,
    };
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the pointer, which points to a zeroed,
    // properly sized and aligned value that lives across the call.
    check(unsafe { libc::getrusage(who, usage.as_mut_ptr()) })?;
    // SAFETY: getrusage succeeded, so it filled the struct (and zeroed is valid for it anyway).
    let u = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| {
        std::time::Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + std::time::Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    let count = |v: libc::c_long| u64::try_from(v).unwrap_or(0);
    Ok(Usage {
        cpu: tv(u.ru_utime) + tv(u.ru_stime),
        faults: count(u.ru_minflt) + count(u.ru_majflt),
    })
}

/// Creates a block device node at `path` for device number `rdev`, with permission bits
/// `mode`.
pub fn mknod_block(path: &std::path::Path, rdev: u64, mode: u32) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c_path` is a valid NUL-terminated string that outlives the call; mknod only
    // reads it, and the other arguments are plain integers.
    check(unsafe {
        libc::mknod(
            c_path.as_ptr(),
            libc::S_IFBLK | (mode & 0o7777) as libc::mode_t,
            rdev as libc::dev_t,
        )
    })
}

/// This process's resident memory in bytes (`/proc/self/statm`: anonymous, file and shared
/// memory pages, the block pool's memfd included).
pub fn resident_bytes() -> io::Result<u64> {
    let [resident, _shared] = statm_resident_shared()?;
    Ok(resident)
}

/// Bytes of this process's private memory in RAM (`RssAnon`: resident minus file and shared
/// memory pages, from `/proc/self/statm`).
pub fn anon_resident_bytes() -> io::Result<u64> {
    let [resident, shared] = statm_resident_shared()?;
    Ok(resident.saturating_sub(shared))
}

/// `/proc/self/statm`'s resident and shared (file and shared memory) sizes, in bytes.
fn statm_resident_shared() -> io::Result<[u64; 2]> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let field = |i: usize| -> Option<u64> { statm.split_whitespace().nth(i)?.parse().ok() };
    let (Some(resident), Some(shared)) = (field(1), field(2)) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "unexpected /proc/self/statm",
        ));
    };
    // SAFETY: sysconf only reads a system constant.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    Ok([resident * page, shared * page])
}

/// Takes an exclusive `flock` on `file` without waiting: `Ok(false)` when another process
/// holds it. The kernel drops the lock when the holder exits, however it exits.
pub fn try_lock_exclusive(file: &std::fs::File) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; it touches no memory.
    match check(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits until process `pid`, started at `started` (see [`start_ticks`]) if given, has
/// exited (a pidfd that becomes readable). Returns at once when it is already gone, also when
/// its pid now names a process that started at another time.
pub fn wait_for_exit(pid: u32, started: Option<u64>) -> io::Result<()> {
    wait_for_exit_within(pid, started, None).map(drop)
}

/// [`wait_for_exit`], giving up after `within` (`None`: never). True once the process is
/// gone: every thread of it, not only the one whose pid it is (a thread group leader that
/// exits first shows as a zombie while its other threads still hold the process's files and
/// memory).
pub fn wait_for_exit_within(
    pid: u32,
    started: Option<u64>,
    within: Option<std::time::Duration>,
) -> io::Result<bool> {
    wait_for_exit_noting(pid, started, within, None)
}

/// [`wait_for_exit`], calling `dying` once the process's first thread (the one whose pid it
/// is) has exited while others are still there: a process killed with SIGKILL whose other
/// threads take long to follow, such as one inside a page fault that waits for memory. Looked
/// for every [`DYING_LOOK`] in its `/proc/<pid>/stat`, opened (and read once) before the
/// wait, so a look allocates nothing (a thread pidfd would not do: the kernel does not report
/// a thread group leader's exit while the group lives on).
pub fn wait_for_exit_noting_death(
    pid: u32,
    started: Option<u64>,
    dying: &mut dyn FnMut(),
) -> io::Result<()> {
    wait_for_exit_noting(pid, started, None, Some(dying)).map(drop)
}

/// How often [`wait_for_exit_noting_death`] looks whether the process is dying.
const DYING_LOOK: std::time::Duration = std::time::Duration::from_millis(200);

/// True when the `/proc/<pid>/stat` open in `file` says the leader exited while other
/// threads remain.
fn leader_gone(file: &std::fs::File) -> bool {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 1024];
    let n = file.read_at(&mut buf, 0).unwrap_or(0);
    parse_stat(&String::from_utf8_lossy(&buf[..n])).is_some_and(|s| s.dying)
}

fn wait_for_exit_noting(
    pid: u32,
    started: Option<u64>,
    within: Option<std::time::Duration>,
    mut dying: Option<&mut dyn FnMut()>,
) -> io::Result<bool> {
    let raw = pid;
    let fd = match pidfd_open(pid) {
        Ok(fd) => fd,
        // ESRCH: no such process (or no pid at all). EINVAL: the pid is now a thread of
        // another process, which can only be a reuse.
        Err(e) => {
            return if e.raw_os_error() == Some(libc::ESRCH) || !process_alive(raw, started) {
                Ok(true)
            } else {
                Err(e)
            };
        }
    };
    // Checked after the pidfd is open: a start time that still matches means the pidfd names
    // that process (it started before the pidfd was opened and still runs).
    if started.is_some_and(|t| start_ticks(raw).is_some_and(|now| now != t)) {
        return Ok(true);
    }
    // The leader's state, when someone wants to hear that it died first.
    let stat = match dying.is_some() {
        true => std::fs::File::open(format!("/proc/{raw}/stat")).ok(),
        false => None,
    };
    // (the first look also makes the file's read buffer, so later looks allocate nothing)
    if stat.as_ref().is_some_and(leader_gone) {
        if let Some(dying) = dying.take() {
            dying();
        }
    }
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline = within.map(|w| std::time::Instant::now() + w);
    loop {
        let timeout = deadline.map_or(-1, |d| {
            let left = d.saturating_duration_since(std::time::Instant::now());
            // rounded up: under a millisecond left is one more wait, not a spin of poll(0)
            i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        });
        let look = DYING_LOOK.as_millis() as i32;
        let timeout = match (&dying, timeout) {
            (Some(_), -1) => look,
            (Some(_), t) => t.min(look),
            (None, t) => t,
        };
        // SAFETY: one valid pollfd, owned by this frame, for the duration of the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, timeout) };
        match ready {
            0 if deadline.is_some_and(|d| std::time::Instant::now() >= d) => return Ok(false),
            0 => {
                if stat.as_ref().is_some_and(leader_gone) {
                    // only the first thread has gone: the others are still on their way out
                    if let Some(dying) = dying.take() {
                        dying();
                    }
                }
            }
            n if n > 0 => return Ok(true),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// A pidfd of process `pid` (`pidfd_open`): it names that process for as long as the
/// descriptor is open, also once the process has exited, never a later one given its pid.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: pidfd_open returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends SIGKILL to the process `pidfd` names (`pidfd_send_signal`); `ESRCH` once it has
/// exited, whatever process now has its pid.
pub fn pidfd_kill(pidfd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal takes a descriptor (open for the call), a signal number, a
    // null siginfo and flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The process's effective user id.
pub fn effective_uid() -> libc::uid_t {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Puts `bytes` at `path` as a new file of `mode` that replaces whatever was there, never
/// through a link planted at the name (root may write into a directory a user can write, or
/// one whose old file is a copy only it may read): they go to a new name beside it, made with
/// `O_EXCL|O_NOFOLLOW`, which is then renamed over `path`.
pub fn write_replacing(path: &std::path::Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.new", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    // One an earlier process of this pid left behind.
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .and_then(|mut f| {
            // The mode asked for, whatever the umask took off it (a man page for everyone).
            use std::os::unix::fs::PermissionsExt;
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
            f.write_all(bytes)
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Why someone besides root and this process could write a file or directory, if they could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OthersWrite {
    /// Writable by its group or others (the permission bits, `0o7777` of the mode).
    Mode(u32),
    /// Owned by this user, neither root nor this process's effective uid.
    Owner(libc::uid_t),
}

/// Why someone besides root and this process's user could write what `meta` describes: its
/// owner is another user, or (owned as it should be) its group or others may write it.
/// `None` when only its owner, root or this process's user, can.
pub fn others_could_write(meta: &std::fs::Metadata) -> Option<OthersWrite> {
    use std::os::unix::fs::MetadataExt;
    if meta.uid() != 0 && meta.uid() != effective_uid() {
        return Some(OthersWrite::Owner(meta.uid()));
    }
    let mode = meta.mode() & 0o7777;
    (mode & 0o022 != 0).then_some(OthersWrite::Mode(mode))
}

/// Whether no one but root (or this process's user) can change what directory or link
/// `meta` describes; why not otherwise. A sticky directory others may write is safe: no one
/// can rename or remove root's entries in it, so what root made there stays root's.
pub fn changed_by_others(meta: &std::fs::Metadata) -> Option<String> {
    match others_could_write(meta) {
        Some(OthersWrite::Owner(uid)) => Some(format!("is owned by uid {uid}")),
        Some(OthersWrite::Mode(mode)) if meta.is_dir() && mode & libc::S_ISVTX == 0 => {
            Some(format!("may be written by others (mode {mode:04o})"))
        }
        _ => None,
    }
}

/// The first directory or link on the way to `path` (its ancestors as named, nearest
/// first) that another user could change, so as to point `path` elsewhere, and why.
pub fn ancestor_changed_by_others(
    path: &std::path::Path,
) -> io::Result<Option<(std::path::PathBuf, String)>> {
    for dir in path.ancestors().skip(1) {
        if dir.as_os_str().is_empty() {
            continue;
        }
        let meta = std::fs::symlink_metadata(dir)
            .map_err(|e| io::Error::new(e.kind(), format!("looking at {}: {e}", dir.display())))?;
        if let Some(why) = changed_by_others(&meta) {
            return Ok(Some((dir.to_path_buf(), why)));
        }
    }
    Ok(None)
}

/// Makes a FIFO at `path` (for tests of readers that must not wait on one).
#[cfg(test)]
pub fn make_fifo(path: &std::path::Path) -> io::Result<()> {
    let name = c_name(path.as_os_str())?;
    // SAFETY: `name` is a valid NUL-terminated path for the call's duration.
    check(unsafe { libc::mkfifo(name.as_ptr(), 0o644) })
}

/// `name` as the C string a `*at` system call takes; a NUL inside is `InvalidInput`.
fn c_name(name: &std::ffi::OsStr) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(name.as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Creates the file `name` in the directory `dir`, write-only and close-on-exec, failing with
/// `EEXIST` when anything (a symbolic link included, dangling or not) is there already: a link
/// planted at the name is never followed.
pub fn create_new_at(
    dir: std::os::fd::BorrowedFd<'_>,
    name: &std::ffi::OsStr,
    mode: libc::mode_t,
) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let name = c_name(name)?;
    // SAFETY: `dir` is an open descriptor for the call's duration and `name` a valid
    // NUL-terminated string; openat with O_CREAT reads the mode as its fourth argument.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    check(fd)?;
    // SAFETY: openat succeeded, so `fd` is a fresh descriptor that nothing else owns.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Renames `from` to `to`, both in the directory `dir`. A link at either name is renamed or
/// replaced itself, never followed.
pub fn rename_at(
    dir: std::os::fd::BorrowedFd<'_>,
    from: &std::ffi::OsStr,
    to: &std::ffi::OsStr,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (from, to) = (c_name(from)?, c_name(to)?);
    // SAFETY: `dir` is an open descriptor for the call's duration; both names are valid
    // NUL-terminated strings.
    check(unsafe { libc::renameat(dir.as_raw_fd(), from.as_ptr(), dir.as_raw_fd(), to.as_ptr()) })
}

/// Removes the name `name` from the directory `dir` (a link is removed itself, never
/// followed); a directory there is not removed.
pub fn unlink_at(dir: std::os::fd::BorrowedFd<'_>, name: &std::ffi::OsStr) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let name = c_name(name)?;
    // SAFETY: `dir` is an open descriptor for the call's duration and `name` a valid
    // NUL-terminated string; flags 0 removes a non-directory only.
    check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })
}

/// Who is at the other end of a unix socket, as the kernel recorded it when that end
/// connected (`SO_PEERCRED`): the peer cannot forge it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's process id.
    pub pid: libc::pid_t,
    /// The peer's effective user id.
    pub uid: libc::uid_t,
    /// The peer's effective group id.
    pub gid: libc::gid_t,
}

/// The credentials of the peer of the connected unix socket `sock`.
pub fn peer_cred(sock: std::os::fd::BorrowedFd<'_>) -> io::Result<PeerCred> {
    use std::os::fd::AsRawFd;
    // Not root until the kernel says so.
    let mut cred = libc::ucred {
        pid: 0,
        uid: libc::uid_t::MAX,
        gid: libc::gid_t::MAX,
    };
    let size = std::mem::size_of::<libc::ucred>();
    let mut len = size as libc::socklen_t;
    // SAFETY: `sock` is an open descriptor for the call's duration; `cred` and `len` are valid
    // out-pointers, and `len` holds the size of `cred`, which getsockopt never writes past.
    check(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast::<libc::c_void>(),
            &mut len,
        )
    })?;
    if len as usize != size {
        return Err(io::Error::from(io::ErrorKind::InvalidData));
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Waits until one of `fds` is ready or `timeout` passes (`None`: no limit); returns how many
/// are ready. An interrupted wait is `ErrorKind::Interrupted`.
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<std::time::Duration>) -> io::Result<usize> {
    // Rounded up: a wait rounded down to 0 ms would spin until the deadline.
    let ms = timeout.map_or(-1, |t| {
        libc::c_int::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(libc::c_int::MAX)
    });
    let n = libc::nfds_t::try_from(fds.len())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `fds` is a valid, writable array of `n` pollfd entries for the call's duration.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
    check(ready)?;
    Ok(ready as usize)
}

#[cfg(test)]
/// Makes the calling thread alone uid and gid 65534, for good. The raw system calls
/// change one thread's credentials (glibc's wrappers would change every thread's), and
/// SO_PEERCRED records the connecting thread's. Such a thread must never exit: parked, it keeps its credentials to itself.
pub fn become_nobody_thread() {
    const NOBODY: libc::c_long = 65534;
    let no_groups: libc::c_long = 0;
    // SAFETY: setgroups with a count of 0 reads no list.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_setgroups,
            no_groups,
            std::ptr::null::<libc::gid_t>(),
        )
    };
    assert_eq!(rc, 0, "setgroups: {}", std::io::Error::last_os_error());
    // SAFETY: setresgid and setresuid take integers only.
    let rc = unsafe { libc::syscall(libc::SYS_setresgid, NOBODY, NOBODY, NOBODY) };
    assert_eq!(rc, 0, "setresgid: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    let rc = unsafe { libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY) };
    assert_eq!(rc, 0, "setresuid: {}", std::io::Error::last_os_error());
    // SAFETY: geteuid has no preconditions; it reads the calling thread's credentials.
    assert_eq!(i64::from(unsafe { libc::geteuid() }), NOBODY);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process marked so reads back as not dumpable, and a core-dumping signal then ends
    /// it with no core (the wait status's core bit clear, though its limit allows one).
    #[test]
    fn a_process_that_forbids_core_dumps_dies_without_one() {
        // SAFETY: the child only makes system calls and leaves by a signal or _exit, never
        // returning into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let unlimited = libc::rlimit {
                rlim_cur: libc::RLIM_INFINITY,
                rlim_max: libc::RLIM_INFINITY,
            };
            // SAFETY: `unlimited` is a valid rlimit for the call's duration.
            let raised = unsafe { libc::setrlimit(libc::RLIMIT_CORE, &unlimited) } == 0;
            // Dumpable to begin with (another test's change of a thread's credentials may
            // have made this process not).
            // SAFETY: prctl(PR_SET_DUMPABLE, 1) takes no pointers.
            let made_dumpable = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) } == 0;
            let ok = raised
                && made_dumpable
                && dumpable().unwrap_or(false)
                && forbid_core_dumps().is_ok()
                && dumpable().ok() == Some(false);
            if !ok {
                exit_now(1);
            }
            // Where a core would go, should one be written: a scratch directory.
            let dir = std::env::temp_dir();
            if std::env::set_current_dir(&dir).is_err() {
                exit_now(2);
            }
            // SAFETY: raise sends SIGABRT (default action: dump core) to this process.
            unsafe { libc::raise(libc::SIGABRT) };
            exit_now(3);
        }
        let mut status = 0;
        // SAFETY: waits for the child made above; `status` is a valid out-parameter.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGABRT,
            "the child did not die of SIGABRT (status {status:#x})"
        );
        assert!(
            !libc::WCOREDUMP(status),
            "the child dumped core although it forbade it"
        );
    }

    /// A file is replaced with the mode asked, a link at the name is replaced and its target
    /// left as it was, and no temporary file stays behind.
    #[test]
    fn write_replacing_replaces_files_and_links_never_their_targets() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("0001.json");
        std::fs::write(&path, "old").unwrap();
        write_replacing(&path, b"new", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let target = dir.path().join("precious");
        std::fs::write(&target, "keep me").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        write_replacing(&path, b"newer", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_file());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "newer");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // The mode asked for, not what the umask (022 here, or 077) leaves of it.
        let shared = dir.path().join("uzram.8");
        write_replacing(&shared, b"page", 0o666).unwrap();
        let mode = std::fs::metadata(&shared).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666);
    }

    #[test]
    fn a_process_is_told_apart_from_a_later_one_with_its_pid() {
        let me = std::process::id();
        let started = start_ticks(me).expect("this process's start time");
        assert!(process_alive(me, Some(started)));
        assert!(process_alive(me, None), "a record without a start time");
        assert!(
            !process_alive(me, Some(started + 1)),
            "the same pid, started at another time, is another process"
        );
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let (pid, child_started) = (child.id(), start_ticks(child.id()));
        assert!(
            child_started.is_some_and(|t| t >= started),
            "{child_started:?}"
        );
        assert!(process_alive(pid, child_started));
        // A process alive under the pid but with another start time is waited for not at
        // all (this call would block for 5 s on the child otherwise).
        let t = std::time::Instant::now();
        wait_for_exit(pid, child_started.map(|s| s + 1)).unwrap();
        assert!(
            t.elapsed().as_secs() < 4,
            "waited for a process that is not the one named"
        );
        child.kill().unwrap();
        wait_for_exit(pid, child_started).unwrap();
        child.wait().unwrap();
        assert!(!process_alive(pid, child_started), "a reaped child");
        assert_eq!(start_ticks(0), None);
    }

    #[test]
    fn waiting_for_a_process_gives_up_in_time_and_sees_it_go() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let (pid, started) = (child.id(), start_ticks(child.id()));
        let t = std::time::Instant::now();
        let within = Some(std::time::Duration::from_millis(100));
        assert!(!wait_for_exit_within(pid, started, within).unwrap());
        assert!(
            t.elapsed().as_millis() >= 90,
            "gave up early: {:?}",
            t.elapsed()
        );
        assert!(
            t.elapsed().as_secs() < 3,
            "did not give up: {:?}",
            t.elapsed()
        );
        child.kill().unwrap();
        let within = Some(std::time::Duration::from_secs(5));
        assert!(
            wait_for_exit_within(pid, started, within).unwrap(),
            "a killed child"
        );
        child.wait().unwrap();
    }

    /// A process whose leader thread ends at once while another thread runs on for two seconds
    /// (`None`, said, without python3).
    fn leader_exits_first() -> Option<std::process::Child> {
        let script = "import ctypes, os, threading, time\n\
threading.Thread(target=lambda: (time.sleep(2.0), os._exit(0))).start()\n\
ctypes.CDLL(None).pthread_exit(None)\n";
        let child = std::process::Command::new("python3")
            .args(["-c", script])
            .spawn();
        if child.is_err() {
            println!("SKIP: no python3 to make a process whose first thread exits early");
        }
        child.ok()
    }

    /// Waits until `pid`'s first thread has exited while another runs (fails after 5 s);
    /// returns when, from `t`.
    fn until_leader_exited(pid: u32, t: std::time::Instant) -> std::time::Duration {
        let dying = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| parse_stat(&s))
                .is_some_and(|s| s.dying)
        };
        while !dying() {
            assert!(t.elapsed().as_secs() < 5, "the leader never exited first");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        t.elapsed()
    }

    #[test]
    fn a_dying_process_is_noted_when_its_first_thread_goes_and_waited_for_to_the_end() {
        // The leader thread ends while another thread runs on for two seconds, as a killed
        // daemon's main thread goes while a thread inside a page fault is still there.
        let Some(mut child) = leader_exits_first() else {
            return;
        };
        let pid = child.id();
        let t = std::time::Instant::now();
        let mut noted: Option<(std::time::Duration, bool)> = None;
        wait_for_exit_noting_death(pid, None, &mut || {
            noted = Some((t.elapsed(), process_alive(pid, None)));
        })
        .unwrap();
        let returned = t.elapsed();
        child.wait().unwrap();
        let (at, alive) = noted.expect("the first thread's exit was noted");
        assert!(alive, "noted while the process still ran");
        assert!(
            returned >= at + std::time::Duration::from_millis(300),
            "returned while the second thread still ran (noted {at:?}, returned {returned:?})"
        );
    }

    #[test]
    fn a_process_already_dying_when_the_wait_begins_is_noted_at_once() {
        let Some(mut child) = leader_exits_first() else {
            return;
        };
        until_leader_exited(child.id(), std::time::Instant::now());
        let pid = child.id();
        let start = std::time::Instant::now();
        let mut noted = None;
        wait_for_exit_noting_death(pid, None, &mut || noted = Some(start.elapsed())).unwrap();
        child.wait().unwrap();
        let at = noted.expect("noted");
        assert!(
            at < DYING_LOOK / 2,
            "noted {at:?} after the wait began, not at once"
        );
    }

    #[test]
    fn a_process_whose_first_thread_exited_is_waited_for_until_its_last_thread_ends() {
        // The leader thread ends (and shows as a zombie) while another thread runs on for two
        // seconds: as a daemon's main thread can end before its I/O threads.
        let Some(mut child) = leader_exits_first() else {
            return;
        };
        let pid = child.id();
        let t = std::time::Instant::now();
        let zombie_after = until_leader_exited(pid, t);
        assert!(
            process_alive(pid, None),
            "a process whose leader is a zombie but whose other thread runs is alive"
        );
        let within = Some(std::time::Duration::from_secs(10));
        assert!(wait_for_exit_within(pid, None, within).unwrap());
        assert!(
            t.elapsed() >= zombie_after + std::time::Duration::from_millis(300),
            "returned while the second thread still ran ({zombie_after:?} -> {:?})",
            t.elapsed()
        );
        assert!(
            !process_alive(pid, None),
            "every thread gone, not yet reaped: not alive"
        );
        child.wait().unwrap();
    }

    /// A standard stream is never taken over as a handed-over descriptor (its owner would
    /// close it under the process's own output).
    #[test]
    fn a_standard_stream_is_not_adopted() {
        for fd in 0..=2 {
            assert_eq!(
                adopt_fd(fd).unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
        }
        assert!(adopt_fd(-1).is_err());
    }

    /// Any user can name a process with bytes that are not UTF-8: its start time is still
    /// read, so a pid reused by such a process is never taken for the daemon that had it.
    #[test]
    fn a_process_named_in_bytes_that_are_not_utf8_still_has_its_start_time() {
        use std::io::Write;
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "printf '\\377\\376x' > /proc/self/comm; echo named; read x",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut named = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut named,
        )
        .unwrap();
        assert_eq!(named.trim(), "named");
        let comm = std::fs::read(format!("/proc/{}/comm", child.id())).unwrap();
        assert!(std::str::from_utf8(&comm).is_err(), "{comm:?}");
        let started = start_ticks(child.id()).expect("its start time");
        assert!(process_alive(child.id(), Some(started)));
        assert!(
            !process_alive(child.id(), Some(started + 1)),
            "a process that started at another time was taken for the one asked about"
        );
        child.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_stat_line_says_whether_the_process_exited_and_when_it_started() {
        // Fields 3.. of a real line; field 20 is the thread count, 22 the start time.
        let line = |comm: &str, state: &str, threads: u32| {
            format!("375 ({comm}) {state} 1 375 375 0 -1 4194560 9 0 0 0 1 2 0 0 20 0 {threads} 0 4242 1 2")
        };
        let stat = |comm, state, threads| parse_stat(&line(comm, state, threads)).unwrap();
        assert_eq!(
            stat("uzram", "S", 5),
            ProcStat {
                exited: false,
                dying: false,
                started: Some(4242)
            }
        );
        assert!(
            stat("uzram", "Z", 1).exited,
            "a zombie whose last thread is gone"
        );
        assert!(stat("uzram", "Z", 0).exited);
        assert!(
            !stat("uzram", "Z", 3).exited && stat("uzram", "Z", 3).dying,
            "a leader that exited while two threads run on"
        );
        assert!(!stat("uzram", "S", 3).dying && !stat("uzram", "Z", 1).dying);
        assert!(
            stat("a) Z 1 (b", "Z", 1).exited && !stat("a) Z 1 (b", "R", 1).exited,
            "a name with parentheses and a state inside it"
        );
        assert_eq!(parse_stat("no parenthesis"), None);
        assert_eq!(
            parse_stat("7 (x) S 1"),
            Some(ProcStat {
                exited: false,
                dying: false,
                started: None
            }),
            "a line cut short"
        );
    }

    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // exited, not yet reaped
        let start = std::time::Instant::now();
        while process_alive(pid, None) {
            assert!(start.elapsed().as_secs() < 10, "pid {pid} still alive");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "the zombie is still there"
        );
        child.wait().unwrap();
        assert!(
            process_alive(std::process::id(), None),
            "this process is alive"
        );
    }

    #[test]
    fn resident_and_private_bytes_count_touched_memory() {
        // The totals are the whole process's, and the other tests of this binary free memory
        // meanwhile (a 4 MiB buffer given back lowers them by as much): a measure so disturbed
        // is taken again. 48 MiB, above the mmap threshold `memory::reserve` may have set, so
        // that the memory is new, not a heap's free memory already resident.
        const TOUCHED: usize = 48 << 20;
        let mut seen = Vec::new();
        for _ in 0..5 {
            let before = resident_bytes().unwrap();
            let anon_before = anon_resident_bytes().unwrap();
            let touched = vec![1u8; TOUCHED];
            let after = resident_bytes().unwrap();
            let anon_after = anon_resident_bytes().unwrap();
            drop(std::hint::black_box(touched));
            let grown = after.saturating_sub(before);
            let anon_grown = anon_after.saturating_sub(anon_before);
            if grown >= TOUCHED as u64 * 15 / 16 && anon_grown >= TOUCHED as u64 * 15 / 16 {
                return;
            }
            seen.push((grown >> 10, anon_grown >> 10));
        }
        panic!("48 MiB touched in each of 5 tries; KiB grown (resident, private): {seen:?}");
    }
}

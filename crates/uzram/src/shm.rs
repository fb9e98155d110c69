//! Root-only SysV shared memory: the one place the daemon and the CLI make, find, check,
//! attach, lock and remove segments (a device's store, its GPU staging, its recovery record).
//!
//! Swap holds every process's memory, so a segment is used only if it is root's alone:
//! owner uid 0, creator uid 0 and mode 0600 ([`Stat::is_root_only`]). A segment is made with
//! `IPC_EXCL` (never an existing one), and every attach checks the segment again through
//! the new mapping's id: while mapped it cannot be removed and its id reused, so what was
//! checked is what is mapped. The creator uid matters most: a user can hand a segment of
//! theirs to uid 0 (`IPC_SET`), but its creator stays theirs.
//!
//! Every segment is private (`IPC_PRIVATE`): a key is a name any user can take first. What
//! a segment is, is read from its first bytes once it is known to be root's alone.

use std::io;
use std::ptr;

/// The segment facts the checks read (`IPC_STAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// The segment id.
    pub id: i32,
    /// Its key (0: private).
    pub key: i32,
    /// Owner uid.
    pub uid: u32,
    /// Creator uid.
    pub cuid: u32,
    /// Permission bits (the low nine of `shm_perm.mode`).
    pub mode: u32,
    /// Size in bytes.
    pub size: usize,
    /// Processes that have it attached.
    pub attached: u64,
    /// Marked for removal (`SHM_DEST`) while still attached somewhere: it goes once the
    /// last process detaches, whatever is written to it meanwhile.
    pub removed: bool,
}

impl Stat {
    /// Owner and creator root, readable and writable by the owner only.
    pub fn is_root_only(&self) -> bool {
        self.uid == 0 && self.cuid == 0 && self.mode == 0o600
    }
}

/// Why a segment could not be made, found or used.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// The call and its purpose.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The segment is not root's alone: it is never used.
    #[error(
        "shared memory segment {id} is not root's alone (owner uid {uid}, creator uid {cuid}, \
         mode {mode:04o}): refusing to use it"
    )]
    NotRootOnly {
        /// The segment id.
        id: i32,
        /// Owner uid.
        uid: u32,
        /// Creator uid.
        cuid: u32,
        /// Permission bits.
        mode: u32,
    },
}

fn sys(what: &'static str) -> impl FnOnce(io::Error) -> ShmError {
    move |source| ShmError::Sys { what, source }
}

/// The segment's facts; an error when there is no segment `id`.
pub fn stat(id: i32) -> io::Result<Stat> {
    let mut ds = std::mem::MaybeUninit::<libc::shmid_ds>::zeroed();
    // SAFETY: IPC_STAT writes one shmid_ds into our buffer.
    if unsafe { libc::shmctl(id, libc::IPC_STAT, ds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: IPC_STAT succeeded, so the struct is initialized.
    let ds = unsafe { ds.assume_init() };
    Ok(Stat {
        id,
        key: ds.shm_perm.__key,
        uid: ds.shm_perm.uid,
        cuid: ds.shm_perm.cuid,
        mode: u32::from(ds.shm_perm.mode) & 0o777,
        size: ds.shm_segsz,
        attached: ds.shm_nattch,
        removed: u32::from(ds.shm_perm.mode) & SHM_DEST != 0,
    })
}

/// The facts of segment `id`, when it is root's alone; [`ShmError::NotRootOnly`] otherwise.
pub fn check(id: i32) -> Result<Stat, ShmError> {
    let st = stat(id).map_err(sys("shmctl IPC_STAT"))?;
    if st.is_root_only() {
        Ok(st)
    } else {
        Err(ShmError::NotRootOnly {
            id,
            uid: st.uid,
            cuid: st.cuid,
            mode: st.mode,
        })
    }
}

/// A new private segment of `len` bytes, root's alone, with no swap space reserved (nothing
/// is committed until touched).
pub fn create(len: usize) -> Result<i32, ShmError> {
    create_at(libc::IPC_PRIVATE, len)
}

fn create_at(key: i32, len: usize) -> Result<i32, ShmError> {
    // SAFETY: shmget takes no pointers.
    let id = unsafe {
        libc::shmget(
            key,
            len,
            libc::IPC_CREAT | libc::IPC_EXCL | libc::SHM_NORESERVE | 0o600,
        )
    };
    if id < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSPC) {
            // Segments are counted host-wide, not per user: anyone can use them all up.
            return Err(sys(
                "shmget: the host's SysV segments are used up (kernel.shmmni or \
                 kernel.shmall); `ipcs -m -p` shows whose they are",
            )(err));
        }
        return Err(sys("shmget")(err));
    }
    // Made just now, by us, with IPC_EXCL: root's alone unless the process is not root (then
    // nothing it makes is of any use to a root daemon's recovery, and it is refused).
    if let Err(e) = check(id) {
        let _ = remove(id);
        return Err(e);
    }
    Ok(id)
}

/// A mapping of a root-only segment, detached on drop (unless [`Attached::keep`]).
#[derive(Debug)]
pub struct Attached {
    base: *mut u8,
    size: usize,
}

impl Attached {
    /// Maps segment `id` (read-only if asked) and checks it through the mapping: root's alone.
    pub fn map(id: i32, read_only: bool) -> Result<Attached, ShmError> {
        check(id)?;
        let flags = if read_only { libc::SHM_RDONLY } else { 0 };
        // SAFETY: shmat maps the segment where the kernel picks; none of our memory is touched.
        let base = unsafe { libc::shmat(id, ptr::null(), flags) };
        if base as isize == -1 {
            return Err(sys("shmat")(io::Error::last_os_error()));
        }
        // Dropped (detached) if the check below fails.
        let mut attached = Attached {
            base: base.cast(),
            size: 0,
        };
        // Again now that it is mapped: the id cannot be reused while we hold it.
        attached.size = check(id)?.size;
        Ok(attached)
    }

    /// The mapping's first byte.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// The segment's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Keeps the mapping for the rest of the process; returns its address.
    pub fn keep(self) -> usize {
        let base = self.base as usize;
        std::mem::forget(self);
        base
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made; whoever dropped it holds no reference into it.
        unsafe { detach(self.base as usize) };
    }
}

/// Detaches the mapping at `base` that [`Attached::keep`] kept.
///
/// # Safety
/// `base` must be such a mapping, and nothing may refer to it any more.
pub unsafe fn detach(base: usize) {
    // SAFETY: the caller's contract.
    unsafe { libc::shmdt(base as *const libc::c_void) };
}

/// A `T` read at byte `offset` of root-only segment `id`, through a read-only mapping
/// dropped at once. `T` must be plain data that any bytes make valid (integers, arrays and
/// structs of them).
pub fn peek<T: Copy>(id: i32, offset: usize) -> Result<T, ShmError> {
    let map = Attached::map(id, true)?;
    let fits = offset
        .checked_add(std::mem::size_of::<T>())
        .is_some_and(|end| end <= map.size());
    if !fits || !offset.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(sys("reading a segment")(io::Error::from(
            io::ErrorKind::InvalidData,
        )));
    }
    // SAFETY: the value lies inside the mapping (checked against its size) and is aligned
    // (the mapping is page-aligned); callers read plain data that any bytes make valid.
    Ok(unsafe { ptr::read_volatile(map.base().add(offset).cast::<T>()) })
}

/// Keeps segment `id` resident (`SHM_LOCK`; needs CAP_IPC_LOCK).
pub fn lock(id: i32) -> Result<(), ShmError> {
    // SAFETY: SHM_LOCK changes the segment's paging only and takes no buffer.
    if unsafe { libc::shmctl(id, libc::SHM_LOCK, ptr::null_mut()) } != 0 {
        return Err(sys("shmctl SHM_LOCK")(io::Error::last_os_error()));
    }
    Ok(())
}

/// Marks segment `id` for removal (`IPC_RMID`): it goes once no process has it attached.
pub fn remove(id: i32) -> Result<(), ShmError> {
    // SAFETY: IPC_RMID takes no buffer.
    if unsafe { libc::shmctl(id, libc::IPC_RMID, ptr::null_mut()) } != 0 {
        return Err(sys("shmctl IPC_RMID")(io::Error::last_os_error()));
    }
    Ok(())
}

/// The mode bit Linux sets on a segment removed while attached (`SHM_DEST`, not in libc).
const SHM_DEST: u32 = 0o1000;

/// Every segment on the host that is root's alone (`/proc/sysvipc/shm`; procfs, never
/// swapped), but those already removed: one of them (a destroyed device's record that a
/// reader still has attached) must not be found and written again, to vanish with its last
/// reader. Segments that cannot be stated are left out.
pub fn root_only_segments() -> Vec<Stat> {
    let Ok(text) = std::fs::read_to_string("/proc/sysvipc/shm") else {
        return Vec::new();
    };
    text.lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(1)?.parse::<i32>().ok())
        .filter_map(|id| stat(id).ok())
        .filter(|s| s.is_root_only() && !s.removed)
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Runs `f` in a child process that has dropped to `nobody` (uid and gid 65534), and
    /// returns its exit status; `None` (the test prints why) when not root.
    pub fn as_nobody(f: impl FnOnce() -> i32) -> Option<i32> {
        let pid = fork_nobody(f)?;
        let mut status = 0;
        // SAFETY: waits for our own child, writing its status into `status`.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        Some(libc::WEXITSTATUS(status))
    }

    /// Runs `f` over and over in a child process that has dropped to `nobody`, until the
    /// returned guard is dropped (which kills and reaps it); `None` when not root.
    pub fn nobody_meanwhile(f: impl Fn()) -> Option<Meanwhile> {
        let pid = fork_nobody(|| loop {
            f();
        })?;
        Some(Meanwhile { pid })
    }

    /// A child process that drops to `nobody` and exits with what `f` returns; its pid, or
    /// `None` (the test prints why) when not root.
    fn fork_nobody(f: impl FnOnce() -> i32) -> Option<libc::pid_t> {
        if !crate::sys::is_root() {
            eprintln!("skipped: playing another user needs root");
            return None;
        }
        // SAFETY: the child only calls async-signal-safe functions and `f` (which the tests
        // keep to system calls), then _exit; the parent waits for it or kills it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: plain system calls in the child.
            let code = unsafe {
                if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    100
                } else {
                    f()
                }
            };
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        Some(pid)
    }

    /// The child of [`nobody_meanwhile`], killed and reaped on drop.
    pub struct Meanwhile {
        pid: libc::pid_t,
    }

    impl Drop for Meanwhile {
        fn drop(&mut self) {
            let mut status = 0;
            // SAFETY: our own child, killed and waited for once.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, &mut status, 0);
            }
        }
    }

    /// A segment `nobody` makes on `key` (private when 0) with `mode`; its id.
    pub fn nobodys_segment(key: i32, len: usize, mode: i32) -> Option<i32> {
        let (read, write) = crate::sys::pipe_cloexec().unwrap();
        use std::os::fd::AsRawFd;
        let wfd = write.as_raw_fd();
        let code = as_nobody(move || {
            // SAFETY: shmget takes no pointers; write sends 4 bytes from a local.
            unsafe {
                let id = libc::shmget(key, len, libc::IPC_CREAT | libc::IPC_EXCL | mode);
                if id < 0 {
                    return 1;
                }
                let bytes = id.to_ne_bytes();
                if libc::write(wfd, bytes.as_ptr().cast(), 4) != 4 {
                    return 2;
                }
                0
            }
        })?;
        drop(write);
        assert_eq!(code, 0, "nobody could not make a segment");
        let mut bytes = [0u8; 4];
        use std::io::Read;
        std::fs::File::from(read).read_exact(&mut bytes).unwrap();
        Some(i32::from_ne_bytes(bytes))
    }

    /// Makes root the owner of segment `id`, with mode 0600, as its creator can (`IPC_SET`);
    /// its creator stays who it was.
    pub fn hand_to_root(id: i32) {
        let mut ds = std::mem::MaybeUninit::<libc::shmid_ds>::zeroed();
        // SAFETY: IPC_STAT and IPC_SET of a segment with our own buffer.
        unsafe {
            assert_eq!(libc::shmctl(id, libc::IPC_STAT, ds.as_mut_ptr()), 0);
            let mut ds = ds.assume_init();
            ds.shm_perm.uid = 0;
            ds.shm_perm.gid = 0;
            ds.shm_perm.mode = 0o600;
            assert_eq!(libc::shmctl(id, libc::IPC_SET, &mut ds), 0);
        }
        let st = stat(id).unwrap();
        assert_eq!((st.uid, st.mode), (0, 0o600));
    }

    /// A segment of root's alone on `key`, as the releases before made recovery records.
    pub fn root_segment_on_key(key: i32, len: usize) -> i32 {
        create_at(key, len).unwrap()
    }

    /// The bytes of a plain-data header, to write into a segment.
    pub fn bytes_of<T: Copy>(value: &T) -> &[u8] {
        // SAFETY: any `T` is readable as its bytes for its size; callers pass `repr(C)`
        // headers of integers, which have no padding.
        unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }
    }

    /// Writes `bytes` at the start of segment `id` as its owner could, whoever that is
    /// (nobody's 0666 segment, in the attacks the tests try).
    pub fn write_as_owner(id: i32, bytes: &[u8]) {
        assert!(bytes.len() <= stat(id).unwrap().size);
        // SAFETY: a mapping of our own, detached right after; `bytes` fit in the segment.
        unsafe {
            let base = libc::shmat(id, ptr::null(), 0);
            assert_ne!(base as isize, -1, "shmat: {}", io::Error::last_os_error());
            ptr::copy_nonoverlapping(bytes.as_ptr(), base.cast::<u8>(), bytes.len());
            libc::shmdt(base);
        }
    }

    /// Whether uid 65534, in a child, can map (read-only) or remove segment `id`: 0 when
    /// it can do neither, 1 when it mapped it, 2 when it removed it.
    pub fn nobody_maps_or_removes(id: i32) -> Option<i32> {
        as_nobody(move || {
            // SAFETY: plain system calls in the child.
            unsafe {
                let base = libc::shmat(id, ptr::null(), libc::SHM_RDONLY);
                if base as isize != -1 {
                    return 1;
                }
                if libc::shmctl(id, libc::IPC_RMID, ptr::null_mut()) == 0 {
                    return 2;
                }
                0
            }
        })
    }

    #[test]
    fn a_new_segment_is_root_only_and_a_removed_one_is_gone() {
        if !crate::sys::is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let id = create(65536).unwrap();
        let st = check(id).unwrap();
        assert!(st.is_root_only());
        assert_eq!((st.size, st.attached, st.key), (65536, 0, 0));
        assert!(root_only_segments().iter().any(|s| s.id == id));
        remove(id).unwrap();
        assert!(stat(id).is_err());
    }

    /// A segment removed while attached lives on until its last detach, marked: it is not
    /// listed among root's segments (where a record would be found and written again).
    #[test]
    fn a_segment_removed_while_attached_is_not_listed() {
        if !crate::sys::is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let id = create(65536).unwrap();
        let map = Attached::map(id, false).unwrap();
        assert!(!stat(id).unwrap().removed);
        remove(id).unwrap();
        let st = stat(id).unwrap();
        assert!(st.removed && st.attached == 1, "{st:?}");
        assert!(!root_only_segments().iter().any(|s| s.id == id));
        drop(map);
        assert!(stat(id).is_err());
    }

    #[test]
    fn a_segment_another_user_made_is_never_attached_even_if_handed_to_root() {
        let Some(id) = nobodys_segment(0, 65536, 0o666) else {
            return;
        };
        let err = Attached::map(id, true).unwrap_err();
        assert!(
            matches!(err, ShmError::NotRootOnly { cuid: 65534, .. }),
            "{err}"
        );
        assert!(peek::<u64>(id, 0).is_err());
        // Root owns it now, mode 0600: its creator is still nobody.
        hand_to_root(id);
        assert!(
            Attached::map(id, false).is_err(),
            "a segment nobody made was attached"
        );
        assert!(!root_only_segments().iter().any(|s| s.id == id));
        remove(id).unwrap();
    }
}

//! Opening a directory one name at a time, each through the descriptor of the one before,
//! following only links that no one but root (or this process's user) could have made or
//! changed.
//!
//! Checking a path's links and then opening it by name is a race: a user who may write a
//! directory on the way (node_exporter's `/var/lib/prometheus` is the prometheus user's) can
//! swap a name there for a link of theirs between the check and the open. Here each name is
//! opened without following it (`O_PATH | O_NOFOLLOW`), and a link is judged and read
//! through that one descriptor, so what was judged is what is followed.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};

use super::{c_name, changed_by_others};

/// The most links one walk follows, as the kernel's own lookup allows (`ELOOP` beyond).
const MAX_LINKS: usize = 40;

/// Why a walk stopped.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    /// A link on the way that another user could have pointed elsewhere.
    #[error("the link {} {why}", link.display())]
    Link {
        /// The link, as the walk had resolved the path up to it.
        link: PathBuf,
        /// Why (its owner).
        why: String,
    },
    /// A name on the way is missing, not a directory, or could not be opened.
    #[error("{}: {error}", at.display())]
    Io {
        /// The path as the walk had resolved it up to the name.
        at: PathBuf,
        /// What the kernel said.
        error: io::Error,
    },
}

/// Opens the directory `path` for reading (a descriptor to use with `*at` calls), walking it
/// a name at a time: every link on the way must be root's or this process's user's.
/// Directories on the way may be anyone's; the caller judges the one it gets.
pub fn open_dir(path: &Path) -> Result<std::fs::File, WalkError> {
    let mut at = PathBuf::new();
    let fail = |at: &Path, error| WalkError::Io {
        at: at.to_path_buf(),
        error,
    };
    let mut names: VecDeque<OsString> = VecDeque::new();
    let mut dir = start(path, &mut at, &mut names).map_err(|e| fail(&at, e))?;
    let mut links = 0;
    while let Some(name) = names.pop_front() {
        let here = at.join(&name);
        // A directory first (an automount point is mounted only when looked up as one);
        // anything else, a link included, is then opened as itself.
        let next = match open_path(dir.as_fd(), &name, libc::O_NOFOLLOW | libc::O_DIRECTORY) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                open_path(dir.as_fd(), &name, libc::O_NOFOLLOW)
            }
            other => other,
        }
        .map_err(|e| fail(&here, e))?;
        let next = std::fs::File::from(next);
        let meta = next.metadata().map_err(|e| fail(&here, e))?;
        let next = OwnedFd::from(next);
        if meta.is_dir() {
            dir = next;
            at = here;
            continue;
        }
        if !meta.file_type().is_symlink() {
            return Err(fail(&here, io::Error::from_raw_os_error(libc::ENOTDIR)));
        }
        if let Some(why) = changed_by_others(&meta) {
            return Err(WalkError::Link { link: here, why });
        }
        // A second name for root's link may be another user's doing (a hard link they made
        // in their directory, where `fs.protected_hardlinks` is off).
        let names_of_link = std::os::unix::fs::MetadataExt::nlink(&meta);
        if names_of_link > 1 {
            return Err(WalkError::Link {
                link: here,
                why: format!(
                    "has {names_of_link} names (hard links): someone may have linked root's \
                     link there"
                ),
            });
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(fail(&here, io::Error::from_raw_os_error(libc::ELOOP)));
        }
        let target = read_link(&next).map_err(|e| fail(&here, e))?;
        let mut rest = VecDeque::new();
        if let Some(root) = start_of(&target, &mut rest) {
            dir = root.map_err(|e| fail(&here, e))?;
            at = PathBuf::from("/");
        }
        rest.extend(names);
        names = rest;
    }
    reopen_for_reading(&dir).map_err(|e| fail(&at, e))
}

/// The descriptor the walk starts from (`/`, or the working directory for a relative path),
/// with `path`'s names queued.
fn start(path: &Path, at: &mut PathBuf, names: &mut VecDeque<OsString>) -> io::Result<OwnedFd> {
    match start_of(path, names) {
        Some(root) => {
            *at = PathBuf::from("/");
            root
        }
        None => {
            *at = PathBuf::from(".");
            open_path_cwd(OsStr::new("."))
        }
    }
}

/// Queues the names of `path` onto `names`; for an absolute path, also opens `/`.
fn start_of(path: &Path, names: &mut VecDeque<OsString>) -> Option<io::Result<OwnedFd>> {
    let mut root = None;
    for part in path.components() {
        match part {
            Component::RootDir => root = Some(open_path_cwd(OsStr::new("/"))),
            Component::Normal(name) => names.push_back(name.to_os_string()),
            Component::ParentDir => names.push_back(OsString::from("..")),
            Component::CurDir | Component::Prefix(_) => {}
        }
    }
    root
}

/// `openat(dir, name, O_PATH | flags)`: a descriptor that names the file without opening it
/// for I/O; with `O_NOFOLLOW`, a link itself.
fn open_path(dir: BorrowedFd<'_>, name: &OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    let name = c_name(name)?;
    // SAFETY: `dir` is an open descriptor for the call's duration and `name` a valid
    // NUL-terminated string; without O_CREAT openat reads no mode.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_PATH | libc::O_CLOEXEC | flags,
        )
    };
    super::errno::check(fd)?;
    // SAFETY: openat succeeded, so `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// [`open_path`] of a directory named from the working directory (`/` or `.`).
fn open_path_cwd(name: &OsStr) -> io::Result<OwnedFd> {
    // SAFETY: AT_FDCWD is a valid directory argument for openat.
    let cwd = unsafe { BorrowedFd::borrow_raw(libc::AT_FDCWD) };
    open_path(cwd, name, libc::O_DIRECTORY)
}

/// What the link `link` (an `O_PATH | O_NOFOLLOW` descriptor of it) points to.
fn read_link(link: &OwnedFd) -> io::Result<PathBuf> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: `link` is open for the call's duration; the empty name reads the link the
    // descriptor itself names; `buf` is writable for its whole length.
    let n = unsafe {
        libc::readlinkat(
            link.as_raw_fd(),
            c"".as_ptr(),
            buf.as_mut_ptr().cast::<libc::c_char>(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    if n >= buf.len() {
        return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    buf.truncate(n);
    Ok(PathBuf::from(OsString::from_vec(buf)))
}

/// The directory `dir` (an `O_PATH` descriptor) opened for reading, through the descriptor:
/// the same directory, whatever its names are now.
fn reopen_for_reading(dir: &OwnedFd) -> io::Result<std::fs::File> {
    // SAFETY: `dir` is an open descriptor for the call's duration and "." a valid
    // NUL-terminated string; without O_CREAT openat reads no mode.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c".".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    super::errno::check(fd)?;
    // SAFETY: openat succeeded, so `fd` is a fresh descriptor that nothing else owns.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("uzram-walk-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn same_dir(a: &std::fs::File, b: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let (a, b) = (a.metadata().unwrap(), std::fs::metadata(b).unwrap());
        (a.dev(), a.ino()) == (b.dev(), b.ino())
    }

    /// Links of root's are followed as the kernel would: relative to the link's directory,
    /// absolute from `/`, chained, and with `..` after them.
    #[test]
    fn own_links_are_followed_as_the_kernel_would() {
        let base = fresh("follow");
        let real = base.join("a/b");
        std::fs::create_dir_all(&real).unwrap();
        std::os::unix::fs::symlink("a/b", base.join("rel")).unwrap();
        std::os::unix::fs::symlink(&real, base.join("abs")).unwrap();
        std::os::unix::fs::symlink("rel", base.join("chain")).unwrap();
        for (named, want) in [
            (base.join("a/b"), real.clone()),
            (base.join("rel"), real.clone()),
            (base.join("abs"), real.clone()),
            (base.join("chain"), real.clone()),
            (base.join("chain/.."), base.join("a")),
            (base.join("a/./b/"), real.clone()),
        ] {
            let dir = open_dir(&named).unwrap_or_else(|e| panic!("{}: {e}", named.display()));
            assert!(same_dir(&dir, &want), "{}", named.display());
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// A missing name, a file on the way and a loop of links each stop the walk with what
    /// the kernel says.
    #[test]
    fn a_missing_name_a_file_and_a_loop_fail() {
        let base = fresh("fail");
        std::fs::write(base.join("file"), "").unwrap();
        std::os::unix::fs::symlink("loop", base.join("loop")).unwrap();
        let err = open_dir(&base.join("missing/x")).unwrap_err();
        assert!(
            matches!(&err, WalkError::Io { error, .. } if error.kind() == io::ErrorKind::NotFound),
            "{err}"
        );
        assert!(err.to_string().contains("missing"), "{err}");
        let err = open_dir(&base.join("file")).unwrap_err();
        assert!(
            matches!(&err, WalkError::Io { error, .. } if error.raw_os_error() == Some(libc::ENOTDIR)),
            "{err}"
        );
        let err = open_dir(&base.join("loop")).unwrap_err();
        assert!(
            matches!(&err, WalkError::Io { error, .. } if error.raw_os_error() == Some(libc::ELOOP)),
            "{err}"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// Root's link with a second name (a hard link, which anyone may make to it where
    /// `fs.protected_hardlinks` is off) is refused: its place may be another user's choice.
    #[test]
    fn a_link_with_two_names_is_refused() {
        let base = fresh("hardlink");
        std::fs::create_dir(base.join("d")).unwrap();
        std::os::unix::fs::symlink("d", base.join("l")).unwrap();
        assert!(open_dir(&base.join("l")).is_ok());
        std::fs::hard_link(base.join("l"), base.join("l2")).unwrap();
        for named in ["l", "l2"] {
            let err = open_dir(&base.join(named)).unwrap_err();
            assert!(
                matches!(&err, WalkError::Link { why, .. } if why.contains("has 2 names")),
                "{named}: {err}"
            );
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// Another user's link, anywhere on the way, is refused with its owner; their directory
    /// on the way is not (the caller judges the directory it gets).
    #[test]
    fn another_users_link_is_refused() {
        if !super::super::is_root() {
            eprintln!("SKIP another_users_link_is_refused: giving a link to uid 65534 needs root");
            return;
        }
        let base = fresh("foreign");
        let theirs = base.join("theirs");
        std::fs::create_dir_all(theirs.join("inner")).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let link = theirs.join("l");
        std::os::unix::fs::symlink(&base, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
        let err = open_dir(&link.join("theirs")).unwrap_err();
        assert!(
            matches!(&err, WalkError::Link { link: l, why } if l == &link && why.contains("uid 65534")),
            "{err}"
        );
        // Root's link to their link: still refused at theirs.
        std::os::unix::fs::symlink(&link, base.join("mine")).unwrap();
        assert!(matches!(
            open_dir(&base.join("mine")),
            Err(WalkError::Link { .. })
        ));
        let dir = open_dir(&theirs.join("inner")).unwrap();
        assert!(same_dir(&dir, &theirs.join("inner")));
        std::fs::remove_dir_all(&base).unwrap();
    }
}

//! libublk's run directory (`/run/ublksrvd`), where it writes each device's JSON file as
//! root when a device is added, started or recovered (`flush_json`).
//!
//! Where it finds no such directory, libublk makes one with mode 0777 and no sticky bit, and
//! then writes `NNNN.json` with `File::create` and sets its mode: both follow a link at that
//! name. Outside the unit (whose `RuntimeDirectory=` makes it 0700 first), any user could
//! then plant `/run/ublksrvd/0001.json` as a link to a root file, which the next daemon of
//! device 1 truncates and overwrites, or as a file of their own, whose contents the daemon
//! copies into the device's recovery record. So before a device is added or recovered the
//! daemon makes the directory root's alone ([`secure`]) and removes what it holds that is not
//! a plain file of root's.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Makes libublk's run directory root's alone before libublk writes into it; returns how
/// many entries it removed (links, files of other users, anything not a plain file).
pub fn secure() -> io::Result<usize> {
    secure_at(Path::new(&libublk::ctrl::UblkCtrl::run_dir()))
}

/// [`secure`] for the directory at `dir`: made 0700 where absent; where present it must be
/// a directory (not a link) of root's, and is set to 0700 if it was looser.
pub fn secure_at(dir: &Path) -> io::Result<usize> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // Opened without following a link, so that the checks and the mode change are of the
    // directory itself.
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "{} is not a directory one may trust (a link?): {e}",
                    dir.display()
                ),
            )
        })?;
    let meta = handle.metadata()?;
    if meta.uid() != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} belongs to uid {}, not root: remove it (rm -r {}) and start again",
                dir.display(),
                meta.uid(),
                dir.display()
            ),
        ));
    }
    if meta.mode() & 0o7777 != 0o700 {
        tracing::warn!(
            dir = %dir.display(),
            mode = format_args!("{:o}", meta.mode() & 0o7777),
            "libublk's run directory was not root's alone: made mode 0700"
        );
        crate::sys::fchmod(handle.as_fd(), 0o700)?;
    }
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue; // gone meanwhile
        };
        let plain_roots = meta.file_type().is_file() && meta.uid() == 0 && meta.nlink() == 1;
        if plain_roots {
            continue;
        }
        let gone = if meta.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match gone {
            Ok(()) => {
                removed += 1;
                tracing::warn!(
                    entry = %path.display(),
                    uid = meta.uid(),
                    "removed from libublk's run directory: not a plain file of root's"
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;

    /// As `nobody`: a link at `name` in `dir` pointing at `target`, and a file of their own.
    fn plant(dir: &Path, target: &Path) -> Option<i32> {
        let link = CString::new(dir.join("0001.json").as_os_str().as_bytes()).unwrap();
        let to = CString::new(target.as_os_str().as_bytes()).unwrap();
        let own = CString::new(dir.join("0002.json").as_os_str().as_bytes()).unwrap();
        crate::shm::tests::as_nobody(move || {
            // SAFETY: plain system calls on NUL-terminated paths.
            unsafe {
                if libc::symlink(to.as_ptr(), link.as_ptr()) != 0 {
                    return 1;
                }
                let fd = libc::open(own.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644);
                if fd < 0 {
                    return 2;
                }
                libc::close(fd);
            }
            0
        })
    }

    #[test]
    fn a_run_directory_libublk_left_open_is_closed_and_what_users_planted_removed() {
        let root = tempfile::tempdir().unwrap();
        // A parent others may enter, as /run is.
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir = root.path().join("ublksrvd");
        std::fs::create_dir(&dir).unwrap();
        // As libublk leaves it.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let precious = root.path().join("shadow");
        std::fs::write(&precious, "keep me").unwrap();
        std::fs::write(dir.join("0003.json"), "{}").unwrap();
        let Some(code) = plant(&dir, &precious) else {
            return; // not root: printed why
        };
        assert_eq!(code, 0, "nobody could not plant in a 0777 directory");
        assert_eq!(secure_at(&dir).unwrap(), 2, "the link and nobody's file");
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o700);
        let mut left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["0003.json"], "root's own file kept");
        assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep me");
        // Now nobody can plant anything.
        assert_ne!(plant(&dir, &precious), Some(0));
        assert_eq!(secure_at(&dir).unwrap(), 0);
    }

    #[test]
    fn a_missing_run_directory_is_made_root_only_and_a_link_or_stranger_refused() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ublksrvd");
        assert_eq!(secure_at(&dir).unwrap(), 0);
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
        // A link in its place is refused, not followed.
        let elsewhere = root.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = root.path().join("linked");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let err = secure_at(&link).unwrap_err();
        assert!(err.to_string().contains("link"), "{err}");
        // A directory of another user's is refused.
        if crate::sys::is_root() {
            let theirs = root.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let err = secure_at(&theirs).unwrap_err();
            assert!(err.to_string().contains("uid 65534"), "{err}");
        }
    }
}

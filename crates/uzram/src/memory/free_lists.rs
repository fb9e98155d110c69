//! The kernel's per-CPU free page lists, held short while a recovery gives its room back.
//!
//! A page freed on a CPU goes to that CPU's free list first, and since Linux 6.7 a list's
//! limit grows with a burst of frees. Pages on those lists are free, but the watermark checks
//! do not count them. A recovery gives its room back (tens of MiB at once) and the new daemon
//! then faults its first pages in; with most of the room on one CPU's list, those faults can
//! see free memory under the minimum and wait in reclaim for kswapd, which waits with
//! everything else for the paused device (a clean-clone CI run, 6.12: 11.5 MiB on the lists,
//! 3.3 MiB counted free against a minimum of 8.5 MiB; docs/recovery.md).
//!
//! `vm.percpu_pagelist_high_fraction` fixes each list's limit at a fraction of its zone,
//! split among the CPUs; at [`SHORT`] every list is held at the kernel's floor (four batches:
//! 1 MiB a CPU in the 512 MiB guest), so the room's pages reach the zone's free lists as
//! they are freed. A recovery sets it before it gives the room back ([`OpenedLists::shorten`]), and the
//! new daemon puts the kernel's default back once it serves ([`restore`]). A value an
//! administrator set (anything but the default, 0) is left alone, and so is the setting on a
//! kernel without it. The systemd unit holds the lists short for good with another value
//! (524288; docs/bench/swap-tuning.md: on 6.18 and later a swap-out's cluster table is allocated
//! without reserves), which a recovery therefore leaves as it is. A recovery that dies in between leaves the lists short until the next
//! recovery's daemon serves: slower frees on a busy many-core host, nothing worse.

use std::io;
use std::path::Path;

const SYSCTL: &str = "/proc/sys/vm/percpu_pagelist_high_fraction";

/// A fraction far past any zone's pages per CPU: every list at the kernel's floor.
pub const SHORT: u64 = 1 << 20;

/// Gives the per-CPU lists the kernel's default limits back, if a recovery held them short.
pub fn restore() -> bool {
    log_outcome(
        restore_at(Path::new(SYSCTL)),
        "back to the kernel's default",
    )
}

/// The setting opened ahead, by a process that waits to recover a device: after the crash
/// an open would need memory that may have run out, a write to an open file hardly any.
#[derive(Debug)]
pub struct OpenedLists(Option<std::fs::File>);

impl OpenedLists {
    /// Opens the setting; a kernel without it (or a failed open, logged) leaves nothing to set.
    pub fn open() -> OpenedLists {
        OpenedLists(open_at(Path::new(SYSCTL)))
    }

    /// Holds the per-CPU lists short for a recovery; true when it did (the setting was the
    /// kernel's default). Failing only warns: with memory to spare a recovery works without it.
    pub fn shorten(&self) -> bool {
        match &self.0 {
            Some(file) => log_outcome(set_if_open(file, 0, SHORT), "held short for the recovery"),
            None => false,
        }
    }
}

fn open_at(path: &Path) -> Option<std::fs::File> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(file) => Some(file),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(err) => {
            tracing::warn!(sysctl = %path.display(), error = %err, "per-CPU free lists: opening the setting failed");
            None
        }
    }
}

fn log_outcome(outcome: io::Result<bool>, what: &str) -> bool {
    match outcome {
        Ok(changed) => {
            if changed {
                tracing::info!(sysctl = SYSCTL, what, "per-CPU free lists");
            }
            changed
        }
        Err(err) => {
            tracing::warn!(sysctl = SYSCTL, error = %err, "per-CPU free lists: setting failed");
            false
        }
    }
}

fn restore_at(path: &Path) -> io::Result<bool> {
    set_if(path, SHORT, 0)
}

/// Writes `to` where the setting at `path` reads `from`; true when it did. An absent setting
/// (a kernel before 5.14, or no /proc) is left absent.
fn set_if(path: &Path, from: u64, to: u64) -> io::Result<bool> {
    let now = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if parse(&now)? != from {
        return Ok(false);
    }
    std::fs::write(path, to.to_string())?;
    Ok(true)
}

/// [`set_if`] on the setting's open file: read and written at offset 0, as a sysctl is
/// (a longer value is written over a shorter one whole; `to` is never the shorter here).
fn set_if_open(file: &std::fs::File, from: u64, to: u64) -> io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 32];
    let n = file.read_at(&mut buf, 0)?;
    if parse(&String::from_utf8_lossy(&buf[..n]))? != from {
        return Ok(false);
    }
    file.write_all_at(to.to_string().as_bytes(), 0)?;
    Ok(true)
}

fn parse(value: &str) -> io::Result<u64> {
    value.trim().parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a number: {:?}", value.trim()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file standing for the setting, in a directory of this test's own (removed when the
    /// returned `TempDir` drops).
    fn setting(value: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("percpu_pagelist_high_fraction");
        std::fs::write(&path, value).unwrap();
        (dir, path)
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap().trim().to_owned()
    }

    #[test]
    fn a_recovery_holds_the_default_lists_short_and_its_daemon_restores_them() {
        let (_dir, path) = setting("0\n");
        let opened = OpenedLists(open_at(&path));
        assert!(opened.shorten());
        assert_eq!(read(&path), SHORT.to_string());
        assert!(!opened.shorten(), "already short: nothing to do");
        assert!(restore_at(&path).unwrap());
        assert_eq!(read(&path), "0");
        assert!(!restore_at(&path).unwrap(), "already the default");
        assert_eq!(read(&path), "0");
    }

    #[test]
    fn an_administrators_value_is_left_alone() {
        let (_dir, path) = setting("64\n");
        assert!(!OpenedLists(open_at(&path)).shorten());
        assert!(!restore_at(&path).unwrap());
        assert_eq!(read(&path), "64");
    }

    #[test]
    fn an_absent_setting_stays_absent_and_a_strange_one_is_an_error() {
        let (_dir, path) = setting("many\n");
        let absent = path.with_file_name("none");
        let opened = OpenedLists(open_at(&absent));
        assert!(opened.0.is_none());
        assert!(!opened.shorten());
        assert!(!restore_at(&absent).unwrap());
        assert!(!absent.exists());
        let strange = open_at(&path).unwrap();
        assert_eq!(
            set_if_open(&strange, 0, SHORT).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert_eq!(
            restore_at(&path).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert_eq!(read(&path), "many");
    }
}

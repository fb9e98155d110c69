//! Keeping a uzram device from being chosen as the place to write a hibernation image.
//!
//! systemd picks the hibernation device itself when no `resume=` is configured: the swap
//! partition or file in `/proc/swaps` with the highest priority (then the most free space),
//! and it writes that device to `/sys/power/resume`. It skips one kind of swap only: a
//! partition whose path in `/proc/swaps` starts with `/dev/zram` (systemd 252
//! `src/shared/sleep-config.c`, `find_hibernate_location()`; current systemd
//! `src/shared/hibernate-util.c`, `read_swap_entries()`). A uzram device is RAM held by a
//! daemon that the kernel freezes before it writes the image, so it must be skipped the same
//! way, and a uzram swap at zram-generator's priority 100 would otherwise win over a disk swap.
//!
//! So uzram activates swap through a second node of the same block device whose path systemd
//! skips: `/dev/zram-uzram/ublkbN`. The kernel lists a swap area under the path it was
//! activated with, and every other part of the system sees the same device (`swapoff
//! /dev/ublkbN` works, and so does uzram's own in-use check, which compares device numbers).
//! docs/hibernation.md has the source lines and the test that runs systemd's own code.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::inuse::block_rdev;

/// The directory of the alias nodes. A directory, so that tools globbing `/dev/zram*` for
/// zram devices (`zram%d` in zramctl) find no device node in it.
pub const ALIAS_DIR: &str = "/dev/zram-uzram";

/// `/dev/ublkbN` → `/dev/zram-uzram/ublkbN`.
pub fn alias_path(dev: &str) -> PathBuf {
    Path::new(ALIAS_DIR).join(dev.trim_start_matches("/dev/"))
}

/// Makes `/dev/zram-uzram/ublkbN` a node of the block device `dev` (same number, mode and
/// owner), replacing a stale one; returns its path.
pub fn create_alias(dev: &str) -> io::Result<PathBuf> {
    let meta = std::fs::metadata(dev)?;
    let rdev = block_rdev(dev).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{dev} is not a block device"),
        )
    })?;
    let alias = alias_path(dev);
    std::fs::create_dir_all(ALIAS_DIR)?;
    std::fs::set_permissions(ALIAS_DIR, std::fs::Permissions::from_mode(0o755))?;
    let alias_str = alias.to_string_lossy();
    let kept = std::fs::symlink_metadata(&alias).is_ok_and(|a| {
        // A node left as it should be (one of an earlier version, or made by hand with
        // another mode or owner, would let others read swapped pages through it).
        block_rdev(&alias_str) == Some(rdev)
            && !a.file_type().is_symlink()
            && (a.mode() & 0o7777, a.uid(), a.gid())
                == (meta.mode() & 0o7777, meta.uid(), meta.gid())
    });
    if kept {
        return Ok(alias);
    }
    match std::fs::remove_file(&alias) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    crate::sys::mknod_block(&alias, rdev, meta.mode() & 0o7777)?;
    std::os::unix::fs::chown(&alias, Some(meta.uid()), Some(meta.gid()))?;
    std::fs::set_permissions(
        &alias,
        std::fs::Permissions::from_mode(meta.mode() & 0o7777),
    )?;
    Ok(alias)
}

/// Removes the alias of `dev` if it is a node of device number `rdev` (a later device may
/// have taken the name), and the directory once empty. Errors are logged: a stale node is
/// harmless, `create_alias` replaces it.
pub fn remove_alias(dev: &str, rdev: u64) {
    let alias = alias_path(dev);
    if block_rdev(&alias.to_string_lossy()) != Some(rdev) {
        return;
    }
    if let Err(err) = std::fs::remove_file(&alias) {
        tracing::warn!(path = %alias.display(), error = %err, "removing the swap alias failed");
    }
    let _ = std::fs::remove_dir(ALIAS_DIR);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// systemd's rule, as written in both versions named in the module docs: does it skip
    /// this `/proc/swaps` path of a swap partition when choosing where to hibernate?
    fn systemd_skips(path: &str) -> bool {
        path.strip_prefix("/dev/")
            .map(|node| node.trim_start_matches('/'))
            .is_some_and(|node| node.starts_with("zram"))
    }

    #[test]
    fn the_alias_is_a_path_systemd_skips() {
        assert_eq!(
            alias_path("/dev/ublkb12"),
            Path::new("/dev/zram-uzram/ublkb12")
        );
        assert!(systemd_skips("/dev/zram-uzram/ublkb12"));
        assert!(systemd_skips("/dev/zram0"));
        assert!(!systemd_skips("/dev/ublkb12"));
        assert!(!systemd_skips("/dev/sda2"));
        assert!(!systemd_skips("/swap/zram"));
    }

    #[test]
    fn alias_nodes_are_made_and_removed() {
        if !crate::sys::is_root() {
            eprintln!("SKIP alias_nodes_are_made_and_removed: mknod needs root");
            return;
        }
        // /dev/null is no block device: refused.
        assert!(create_alias("/dev/null").is_err());
        let Some(dev) = std::fs::read_dir("/dev").ok().and_then(|d| {
            d.flatten()
                .map(|e| e.path().to_string_lossy().into_owned())
                .find(|p| block_rdev(p).is_some() && !p.contains("zram"))
        }) else {
            eprintln!("SKIP alias_nodes_are_made_and_removed: no block device node in /dev");
            return;
        };
        let rdev = block_rdev(&dev).unwrap();
        let existed = alias_path(&dev).exists();
        let alias = create_alias(&dev).unwrap();
        assert_eq!(block_rdev(&alias.to_string_lossy()), Some(rdev));
        assert_eq!(create_alias(&dev).unwrap(), alias, "idempotent");
        if !existed {
            remove_alias(&dev, rdev + 1);
            assert!(
                alias.exists(),
                "a node of another device number is left alone"
            );
            remove_alias(&dev, rdev);
            assert!(!alias.exists());
        }
    }

    /// Runs the installed systemd-sleep (systemd's own choice of hibernation device) in a
    /// private mount namespace where /sys/power is a tmpfs (nothing can hibernate this host),
    /// /proc/swaps is a file of ours and /dev holds matching device nodes. Returns its exit
    /// status, log and the device it wrote to /sys/power/resume.
    fn systemd_sleep(swaps: &[(&str, i32)]) -> Option<(bool, String, String)> {
        const SLEEP: &str = "/usr/lib/systemd/systemd-sleep";
        let tools = Path::new(SLEEP).exists()
            && crate::sys::is_root()
            && std::process::Command::new("unshare")
                .args(["--mount", "true"])
                .status()
                .is_ok_and(|s| s.success());
        if !tools {
            let msg = format!("needs root, unshare(1) and {SLEEP}");
            assert!(std::env::var_os("CI").is_none(), "{msg}");
            eprintln!("SKIP systemd-sleep test: {msg}");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "uzram-hibernate-{}-{}",
            std::process::id(),
            swaps.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut table = String::from("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n");
        for (path, prio) in swaps {
            table.push_str(&format!("{path:<40}partition\t262140\t\t0\t\t{prio}\n"));
        }
        std::fs::write(dir.join("swaps"), table).unwrap();
        // 259:7 stands for a ublk device, 8:34 for a disk partition.
        let script = r#"
set -eu
mount -t tmpfs none /sys/power
[ "$(stat -f -c %T /sys/power)" = tmpfs ] || exit 90
: > /sys/power/state; echo 0:0 > /sys/power/resume; echo 0 > /sys/power/resume_offset
: > /sys/power/disk
mount --bind "$1/swaps" /proc/swaps
cmp -s "$1/swaps" /proc/swaps || exit 91
mount -t tmpfs none /dev
mknod /dev/null c 1 3; chmod 666 /dev/null
mkdir /dev/zram-uzram
mknod /dev/zram-uzram/ublkb0 b 259 7; mknod /dev/ublkb0 b 259 7; mknod /dev/sdz2 b 8 34
if [ -d /usr/lib/systemd/system-sleep ]; then mount -t tmpfs none /usr/lib/systemd/system-sleep; fi
rc=0
SYSTEMD_LOG_LEVEL=debug SYSTEMD_LOG_TARGET=console /usr/lib/systemd/systemd-sleep hibernate \
  > "$1/log" 2>&1 || rc=$?
cat /sys/power/resume > "$1/resume"
exit $rc
"#;
        let status = std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
            ])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(
            !matches!(status.code(), Some(90 | 91)),
            "the namespace was not set up: {status}"
        );
        let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        let resume = std::fs::read_to_string(dir.join("resume"))
            .unwrap_or_default()
            .trim()
            .to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        Some((status.success(), log, resume))
    }

    #[test]
    fn systemd_does_not_hibernate_to_the_alias() {
        // The problem: a uzram swap under its own name, at zram-generator's priority 100,
        // is what systemd writes to /sys/power/resume, ahead of a disk swap.
        let Some((ok, log, resume)) = systemd_sleep(&[("/dev/ublkb0", 100), ("/dev/sdz2", -2)])
        else {
            return;
        };
        assert!(ok && resume == "259:7", "{resume}: {log}");
        // The fix: through the alias, systemd skips it like zram and picks the disk swap...
        let (ok, log, resume) =
            systemd_sleep(&[("/dev/zram-uzram/ublkb0", 100), ("/dev/sdz2", -2)]).unwrap();
        assert!(ok && resume == "8:34", "{resume}: {log}");
        assert!(
            log.contains("/dev/zram-uzram/ublkb0: ignoring zram swap")
                || log.contains("is a zram device, ignoring"),
            "{log}"
        );
        // ...and with uzram the only swap, refuses to hibernate at all.
        let (ok, log, resume) = systemd_sleep(&[("/dev/zram-uzram/ublkb0", 100)]).unwrap();
        assert!(!ok && resume == "0:0", "{resume}: {log}");
        assert!(
            log.contains("No possible swap partitions or files suitable for hibernation")
                || log.contains("No swap space available for hibernation"),
            "{log}"
        );
    }
}

//! Is a block device in use? Active swap, mounted, held by a stacked device, or open.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Why `dev` (`/dev/ublkbN`) is in use, as a message that says what to do; `None` if it is not.
pub fn in_use(dev: &str) -> Option<String> {
    if is_active_swap(dev).unwrap_or(false) {
        return Some(format!("{dev} is active swap: run swapoff {dev} first"));
    }
    let rdev = std::fs::metadata(dev).ok().map(|m| m.rdev());
    if let (Some(rdev), Ok(info)) = (rdev, std::fs::read_to_string("/proc/self/mountinfo")) {
        if let Some(mnt) = mountpoint(&info, dev, rdev) {
            return Some(format!("{dev} is mounted on {mnt}: run umount {mnt} first"));
        }
    }
    let name = dev.trim_start_matches("/dev/");
    if let Ok(holders) = std::fs::read_dir(format!("/sys/block/{name}/holders")) {
        if let Some(h) = holders.flatten().next() {
            return Some(format!(
                "{dev} is held by {}: remove that device first",
                h.file_name().to_string_lossy()
            ));
        }
    }
    if let Some((pid, comm)) = open_by(dev) {
        return Some(format!(
            "{dev} is open by process {pid} ({comm}): stop it or close the device first"
        ));
    }
    match crate::sys::open_exclusive(Path::new(dev)) {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Some(format!(
            "{dev} is busy (held open exclusively): release it first"
        )),
        _ => None,
    }
}

/// True when `/proc/swaps` lists `dev` now, under its own name or under another node of the
/// same block device (`uzram swap-on` activates swap through `/dev/zram-uzram/ublkbN`; see
/// `hibernate.rs`), that node removed since included.
pub fn is_active_swap(dev: &str) -> std::io::Result<bool> {
    let swaps = std::fs::read_to_string("/proc/swaps")?;
    Ok(swap_active(&swaps, dev, same_device_as(dev)))
}

/// `dev`'s line of `/proc/swaps`: (size, used) in KiB; `None` when it is not active swap.
pub fn swap_usage(dev: &str) -> std::io::Result<Option<(u64, u64)>> {
    let swaps = std::fs::read_to_string("/proc/swaps")?;
    Ok(swap_line(&swaps, dev, same_device_as(dev)))
}

/// Whether a `/proc/swaps` path (decoded, [`swap_path`]) names block device `dev`: a node of
/// the same device number, or, once removed (the kernel then lists it with " (deleted)"),
/// `dev`'s own name or uzram's alias of it, whose number can no longer be read (taken for
/// `dev`: a stop then waits for swapoff rather than delete a device still in swap).
fn same_device_as(dev: &str) -> impl Fn(&str, bool) -> bool + '_ {
    let rdev = block_rdev(dev);
    let alias = crate::hibernate::alias_path(dev);
    move |path, deleted| {
        if deleted {
            return path == dev || Path::new(path) == alias;
        }
        rdev.is_some() && block_rdev(path) == rdev
    }
}

/// The path a `/proc/swaps` line names, and whether it was removed since: the kernel writes
/// space, tab, newline and backslash as octal escapes (`\040`) and adds " (deleted)" to a
/// path whose node is gone.
fn swap_path(field: &str) -> (String, bool) {
    let (field, deleted) = match field.strip_suffix("\\040(deleted)") {
        Some(rest) => (rest, true),
        None => (field, false),
    };
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |n, c| n * 8 + u32::from(c - b'0')))
            .and_then(|n| u8::try_from(n).ok());
        match octal {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), deleted)
}

/// (size, used) in KiB of the `/proc/swaps` line of `dev`, or of a path for which
/// `same_device` holds.
fn swap_line(
    swaps: &str,
    dev: &str,
    same_device: impl Fn(&str, bool) -> bool,
) -> Option<(u64, u64)> {
    swaps.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if !names(f.first()?, dev, &same_device) {
            return None;
        }
        Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?))
    })
}

/// Whether the path field of a `/proc/swaps` line names `dev`: its own node as it is, or a
/// path for which `same_device` holds.
fn names(field: &str, dev: &str, same_device: &impl Fn(&str, bool) -> bool) -> bool {
    let (path, deleted) = swap_path(field);
    (path == dev && !deleted) || same_device(&path, deleted)
}

/// The device number of a block device node.
pub fn block_rdev(path: &str) -> Option<u64> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).ok()?;
    meta.file_type().is_block_device().then(|| meta.rdev())
}

/// True when `/proc/swaps` text lists `dev`, or a path for which `same_device` holds.
fn swap_active(swaps: &str, dev: &str, same_device: impl Fn(&str, bool) -> bool) -> bool {
    swaps
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .any(|field| names(field, dev, &same_device))
}

/// The mount point of `dev` (device number `rdev`) in mountinfo text, if mounted.
pub fn mountpoint(mountinfo: &str, dev: &str, rdev: u64) -> Option<String> {
    let want = format!("{}:{}", libc::major(rdev), libc::minor(rdev));
    mountinfo.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let source = line
            .split(" - ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().nth(1));
        let hit = fields.get(2) == Some(&want.as_str()) || source == Some(dev);
        hit.then(|| fields.get(4).map(|m| m.to_string())).flatten()
    })
}

/// The first process with `dev` open: (pid, command name). This process counts too: uzram
/// never opens the device before this scan, so an fd of ours was inherited from a caller
/// (e.g. `sh -c "exec 4<DEV; uzram destroy"`) that still uses the device.
///
/// A descriptor counts by what it has open, not by the name it was opened through: another
/// node of the same block device (uzram's alias, a container's `/dev`) or a node removed
/// since names the same device.
fn open_by(dev: &str) -> Option<(u32, String)> {
    use std::os::unix::fs::FileTypeExt;
    let target = std::fs::metadata(dev).ok()?;
    let block = target.file_type().is_block_device();
    let same = |fd: &Path| {
        std::fs::metadata(fd).is_ok_and(|m| {
            if block {
                m.file_type().is_block_device() && m.rdev() == target.rdev()
            } else {
                (m.dev(), m.ino()) == (target.dev(), target.ino())
            }
        })
    };
    let procs = std::fs::read_dir("/proc").ok()?;
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let open = fds.flatten().any(|fd| same(&fd.path()));
        if open {
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            return Some((pid, comm.trim().to_string()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_usage_reads_size_and_used_of_the_device_line() {
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n\
                     /dev/zram-uzram/ublkb0 partition\t1061884\t524288\t100\n\
                     /swapfile file 2097148 0 -2\n";
        let alias = |p: &str, _| p == "/dev/zram-uzram/ublkb0";
        assert_eq!(
            swap_line(swaps, "/dev/ublkb0", alias),
            Some((1061884, 524288))
        );
        assert_eq!(
            swap_line(swaps, "/swapfile", |_, _| false),
            Some((2097148, 0))
        );
        assert_eq!(swap_line(swaps, "/dev/ublkb1", |_, _| false), None);
    }

    #[test]
    fn finds_active_swap() {
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n\
                     /dev/ublkb0                             partition\t262140\t0\t-2\n";
        let never = |_: &str, _| false;
        assert!(swap_active(swaps, "/dev/ublkb0", never));
        assert!(!swap_active(swaps, "/dev/ublkb1", never));
        assert!(!swap_active("Filename\tType\n", "/dev/ublkb0", never));
        // Swap activated through another node of the same device.
        let alias = "Filename\tType\tSize\tUsed\tPriority\n\
                     /dev/zram-uzram/ublkb1                  partition\t262140\t0\t100\n";
        assert!(!swap_active(alias, "/dev/ublkb1", never));
        assert!(swap_active(alias, "/dev/ublkb1", |p, _| p == "/dev/zram-uzram/ublkb1"));
    }

    /// The kernel escapes a swap path's spaces and backslashes, and marks a path whose node
    /// was removed: swap turned on through uzram's alias stays found once the alias is gone
    /// (the daemon's stop would otherwise delete a device still in swap).
    #[test]
    fn a_removed_alias_and_escaped_paths_are_still_found() {
        assert_eq!(swap_path("/swap\\040file"), ("/swap file".into(), false));
        assert_eq!(swap_path("/a\\134b"), ("/a\\b".into(), false));
        assert_eq!(swap_path("/x\\9"), ("/x\\9".into(), false));
        assert_eq!(
            swap_path("/dev/zram-uzram/ublkb3\\040(deleted)"),
            ("/dev/zram-uzram/ublkb3".into(), true)
        );
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n\
                     /dev/zram-uzram/ublkb3\\040(deleted) partition\t262140\t4\t100\n";
        let same = same_device_as("/dev/ublkb3");
        assert!(swap_active(swaps, "/dev/ublkb3", &same));
        assert_eq!(swap_line(swaps, "/dev/ublkb3", &same), Some((262140, 4)));
        assert!(!swap_active(
            swaps,
            "/dev/ublkb4",
            same_device_as("/dev/ublkb4")
        ));
        // Turned on through the device's own node, removed since.
        let gone = "Filename\tType\tSize\tUsed\tPriority\n\
                    /dev/ublkb3\\040(deleted) partition\t262140\t4\t100\n";
        assert!(swap_active(
            gone,
            "/dev/ublkb3",
            same_device_as("/dev/ublkb3")
        ));
        assert!(!swap_active(gone, "/dev/ublkb3", |_, _| false));
    }

    #[test]
    fn finds_mounts_by_number_or_source() {
        let info = "22 1 259:3 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p3 rw\n\
                    40 22 259:7 / /mnt/data rw shared:9 - ext4 /dev/ublkb2 rw\n";
        let rdev = libc::makedev(259, 7);
        assert_eq!(
            mountpoint(info, "/dev/ublkb2", rdev).as_deref(),
            Some("/mnt/data")
        );
        assert_eq!(
            mountpoint(info, "/dev/ublkb2", libc::makedev(1, 1)).as_deref(),
            Some("/mnt/data")
        );
        assert_eq!(mountpoint(info, "/dev/ublkb5", libc::makedev(1, 1)), None);
    }

    #[test]
    fn a_missing_device_is_not_in_use() {
        assert_eq!(in_use("/dev/ublkb-does-not-exist"), None);
    }

    #[test]
    fn an_fd_held_by_this_process_counts_as_open() {
        let path = std::env::temp_dir().join(format!("uzram-inuse-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let name = path.to_str().unwrap().to_string();
        assert_eq!(open_by(&name), None);
        let held = std::fs::File::open(&path).unwrap();
        let (pid, _) = open_by(&name).expect("our own fd must be found");
        assert_eq!(pid, std::process::id());
        // Opened through another name of the same file: the same file open.
        let other = path.with_extension("link");
        std::fs::hard_link(&path, &other).unwrap();
        drop(held);
        assert_eq!(open_by(&name), None);
        let held = std::fs::File::open(&other).unwrap();
        let (pid, _) = open_by(&name).expect("an fd opened through another name must be found");
        assert_eq!(pid, std::process::id());
        drop(held);
        std::fs::remove_file(&other).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(open_by(&name), None);
    }
}

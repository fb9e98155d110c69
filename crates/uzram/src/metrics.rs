//! Every counter of a device in Prometheus' text exposition format (what node_exporter's
//! textfile collector reads), for `uzram status DEV --prometheus` and the daemon's
//! `metrics-textfile`.
//!
//! Each `uzram status` counter becomes one metric family with a `device` label (`ublkbN`,
//! as node_exporter's disk metrics name the device). The counters with zram's names
//! (`mm_stat`, `io_stat`) and the daemon's request and pool counters take their names and
//! help from `control::counters`; any other stat, such as a backend counter added later, is exported by a
//! generic rule, so a new stat needs no change here:
//! - the name is `uzram_` (`uzram_backend_` for backend stats) plus the stat's name, with
//!   characters Prometheus does not allow replaced by `_`;
//! - units become base units at the end of the name: `_us`, `_ms`, `_ns` → `_seconds` (the
//!   value scaled), `_size` → `_bytes`, a `bytes` word elsewhere moves to the end
//!   (`gpu_bytes_in` → `gpu_in_bytes`);
//! - it is a counter (`_total` appended): a stat whose value can go down belongs in the
//!   table of `control::counters`, as a gauge.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::control::proto::{DeviceStatus, Stat};
use crate::sys;

pub use crate::control::counters::Group;
use crate::control::counters::Kind;

/// One exported metric family.
#[derive(Debug, Clone, PartialEq)]
struct Metric {
    name: String,
    kind: Kind,
    help: String,
    /// Multiplier from the stat's unit to the metric's (1 unless converted to seconds).
    scale: f64,
}

fn sanitize(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// The generic rule of the module docs.
fn generic(group: Group, stat: &str) -> Metric {
    // Not listed in `counters`: a backend's, which count events.
    let kind = Kind::Counter;
    let mut words: Vec<String> = sanitize(stat)
        .split('_')
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    let mut scale = 1.0;
    let unit = match words.last().map(String::as_str) {
        Some("us") => Some(("seconds", 1e-6)),
        Some("ms") => Some(("seconds", 1e-3)),
        Some("ns") => Some(("seconds", 1e-9)),
        Some("size") => Some(("bytes", 1.0)),
        _ => None,
    };
    if let Some((unit, s)) = unit {
        words.pop();
        words.push(unit.to_string());
        scale = s;
    } else if let Some(i) = words.iter().position(|w| w == "bytes") {
        let w = words.remove(i);
        words.push(w);
    }
    if group == Group::Backend && words.first().map(String::as_str) != Some("backend") {
        words.insert(0, "backend".to_string());
    }
    let mut name = format!("uzram_{}", words.join("_"));
    if kind == Kind::Counter && !name.ends_with("_total") {
        name.push_str("_total");
    }
    let what = match group {
        Group::Store => "store",
        Group::Requests => "request",
        Group::Backend => "backend",
    };
    Metric {
        name,
        kind,
        help: format!("uzram status {what} stat {stat}."),
        scale,
    }
}

fn metric_for(group: Group, stat: &str) -> Metric {
    match crate::control::counters::find(stat).filter(|c| c.group == group) {
        Some(c) => Metric {
            name: c.metric.to_string(),
            kind: c.kind,
            help: c.help.to_string(),
            scale: 1.0,
        },
        None => generic(group, stat),
    }
}

/// A label value as the text format wants it.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: Kind, help: &str, labels: &str, value: &str) {
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {}", kind.name());
    let _ = writeln!(out, "{name}{{{labels}}} {value}");
}

/// The device's metrics in the text exposition format.
pub fn render(s: &DeviceStatus) -> String {
    let device = s.dev.trim_start_matches("/dev/");
    let labels = format!("device=\"{}\"", escape_label(device));
    let mut out = String::new();
    family(
        &mut out,
        "uzram_device_info",
        Kind::Gauge,
        "Device settings as labels; the value is always 1.",
        &format!(
            "{labels},algorithm=\"{}\",backend=\"{}\",queue_mode=\"{}\"",
            escape_label(&s.algorithm),
            escape_label(&s.backend),
            escape_label(&s.queue_mode)
        ),
        "1",
    );
    let settings = [
        ("uzram_disksize_bytes", "Device size.", s.size),
        ("uzram_queues", "Hardware queues.", u64::from(s.queues)),
        (
            "uzram_queue_depth",
            "Depth of each queue.",
            u64::from(s.depth),
        ),
    ];
    for (name, help, value) in settings {
        family(
            &mut out,
            name,
            Kind::Gauge,
            help,
            &labels,
            &value.to_string(),
        );
    }
    let mut seen: Vec<String> = Vec::new();
    let groups: [(Group, &[Stat]); 3] = [
        (Group::Store, &s.stats),
        (Group::Requests, &s.requests),
        (Group::Backend, &s.backend_stats),
    ];
    for (group, stats) in groups {
        for stat in stats {
            let m = metric_for(group, &stat.name);
            // Two stats may not share a family (the format forbids it): keep the first.
            if seen.contains(&m.name) {
                tracing::warn!(stat = %stat.name, metric = %m.name, "duplicate metric name; stat not exported");
                continue;
            }
            let value = if m.scale == 1.0 {
                stat.value.to_string()
            } else {
                (stat.value as f64 * m.scale).to_string()
            };
            family(&mut out, &m.name, m.kind, &m.help, &labels, &value);
            seen.push(m.name);
        }
    }
    out
}

/// An example of a directory fit for the metrics file, for the errors.
const GOOD_DIR: &str = "/var/lib/prometheus/node-exporter";

/// Why the metrics file cannot be written (or removed) where it was asked. Each message
/// carries its cause, so that it reads whole in one log line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TextfileError {
    /// The path has no directory part.
    #[error("metrics-textfile {}: no directory", path.display())]
    NoDirectory {
        /// The metrics file.
        path: PathBuf,
    },
    /// The directory is missing.
    #[error(
        "metrics-textfile {}: directory {} does not exist (create it, e.g. node_exporter's \
         --collector.textfile.directory)",
        path.display(),
        dir.display()
    )]
    Missing {
        /// The metrics file.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
    },
    /// Another user could plant a link at the name the daemon, running as root, writes.
    #[error(
        "metrics-textfile {}: directory {} is writable by group or others (mode {mode:04o}), \
         who could make the daemon overwrite another file: use a directory only root can \
         write, e.g. {GOOD_DIR}",
        path.display(),
        dir.display()
    )]
    SharedDirectory {
        /// The metrics file.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
        /// The directory's permission bits.
        mode: u32,
    },
    /// The directory's owner could plant a link at the name the daemon writes.
    #[error(
        "metrics-textfile {}: directory {} is owned by uid {owner}, not root, who could make \
         the daemon overwrite another file: use a directory owned by root that only root can \
         write, e.g. {GOOD_DIR}",
        path.display(),
        dir.display()
    )]
    ForeignDirectory {
        /// The metrics file.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
        /// The directory's owner.
        owner: u32,
    },
    /// A link on the way to the file is another user's, who could point the daemon at
    /// another directory with it.
    #[error(
        "metrics-textfile {}: the link {} on the way to it {why}, so another user could point \
         it at another directory: name a directory without it, e.g. {GOOD_DIR}",
        path.display(),
        on_way.display()
    )]
    SharedPath {
        /// The metrics file.
        path: PathBuf,
        /// The link.
        on_way: PathBuf,
        /// Why (its owner, or its mode).
        why: String,
    },
    /// A system call on the directory or the file failed.
    #[error("metrics-textfile {}: {what}: {error}", path.display())]
    Io {
        /// The metrics file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        error: std::io::Error,
    },
}

/// The metrics file's directory, opened and checked, and the file's name in it.
///
/// Every later step goes through the descriptor with `*at` calls, so what was checked is
/// what is written into, whatever happens to the path meanwhile. The directory must be
/// writable by its owner alone, and that owner root (or the user running uzram, where that
/// is not root): anyone else who can write there could plant a link at the temporary name.
fn open_dir(path: &Path) -> Result<(std::fs::File, OsString), TextfileError> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(TextfileError::NoDirectory {
            path: path.to_path_buf(),
        });
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let io = |what| {
        move |error| TextfileError::Io {
            path: path.to_path_buf(),
            what,
            error,
        }
    };
    // Every link on the way must be root's: the directory checked below is the one opened,
    // but a link of another user's on the way would let them choose which one that is. The
    // walk judges each link through the descriptor it then follows, so a name swapped for a
    // link between a look and an open is never followed. (Directories on the way may be
    // others': node_exporter's own directory on Debian, /var/lib/prometheus, is the
    // prometheus user's.)
    let handle = sys::walk::open_dir(dir).map_err(|error| match error {
        sys::walk::WalkError::Link { link, why } => TextfileError::SharedPath {
            path: path.to_path_buf(),
            on_way: link,
            why,
        },
        sys::walk::WalkError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound => {
            TextfileError::Missing {
                path: path.to_path_buf(),
                dir: dir.to_path_buf(),
            }
        }
        sys::walk::WalkError::Io { at, error } => io("opening its directory")(std::io::Error::new(
            error.kind(),
            format!("{}: {error}", at.display()),
        )),
    })?;
    let meta = handle
        .metadata()
        .map_err(io("reading its directory's owner and mode"))?;
    match sys::others_could_write(&meta) {
        Some(sys::OthersWrite::Mode(mode)) => {
            return Err(TextfileError::SharedDirectory {
                path: path.to_path_buf(),
                dir: dir.to_path_buf(),
                mode,
            })
        }
        Some(sys::OthersWrite::Owner(owner)) => {
            return Err(TextfileError::ForeignDirectory {
                path: path.to_path_buf(),
                dir: dir.to_path_buf(),
                owner,
            })
        }
        None => {}
    }
    Ok((handle, name.to_os_string()))
}

/// Writes `text` to `path` atomically: a temporary file in the same directory (a name that
/// node_exporter's textfile collector ignores, it reads `*.prom` only), then a rename, so a
/// scrape never sees half a file. The directory must pass [`check_textfile_dir`]'s rule, and
/// nothing found at the temporary name is ever followed.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), TextfileError> {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::fs::PermissionsExt;
    let (dir, name) = open_dir(path)?;
    let dir = dir.as_fd();
    let mut tmp = OsString::from(".");
    tmp.push(&name);
    tmp.push(format!(".{}.tmp", std::process::id()));
    let io = |what| {
        move |error| TextfileError::Io {
            path: path.to_path_buf(),
            what,
            error,
        }
    };
    // Something at the name is a file a crash left, or a plant: its name goes, whatever it
    // points to stays, and the file is created anew, once.
    let mut file = match sys::create_new_at(dir, &tmp, 0o644) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            sys::unlink_at(dir, &tmp).map_err(io("removing what is at the temporary name"))?;
            sys::create_new_at(dir, &tmp, 0o644)
        }
        other => other,
    }
    .map_err(io("creating the temporary file"))?;
    let written = (|| {
        // node_exporter runs as its own user: the file must be readable, whatever the umask.
        file.set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(io("making the temporary file readable"))?;
        file.write_all(text.as_bytes())
            .map_err(io("writing the temporary file"))?;
        sys::rename_at(dir, &tmp, &name).map_err(io("renaming the temporary file"))
    })();
    if written.is_err() {
        let _ = sys::unlink_at(dir, &tmp);
    }
    written
}

/// How often the daemon rewrites its metrics file (node_exporter's textfile collector reads
/// it on every scrape; 15 s is the usual scrape interval).
pub const TEXTFILE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(15);

/// Refuses a metrics file whose directory is missing (a typo would otherwise only show as a
/// warning every 15 s) or unsafe for root to write into: writable by group or others, or
/// owned by another user (the rule of every write, see [`write_atomically`]).
pub fn check_textfile_dir(path: &Path) -> Result<(), TextfileError> {
    open_dir(path).map(|_| ())
}

/// The daemon's metrics file: rewritten by its own thread, removed when the device stops.
#[derive(Debug)]
pub struct Textfile {
    path: std::path::PathBuf,
    /// Set (under the lock) once the file is removed: a write in progress finishes first,
    /// and none starts after, so a stopped device leaves no file behind.
    stopped: std::sync::Mutex<bool>,
}

impl Textfile {
    /// The file at `path` (not written yet).
    pub fn new(path: std::path::PathBuf) -> Self {
        Textfile {
            path,
            stopped: std::sync::Mutex::new(false),
        }
    }

    /// Writes `status` unless the file was removed; `Ok(false)` then.
    pub fn write(&self, status: &DeviceStatus) -> Result<bool, TextfileError> {
        let stopped = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        if *stopped {
            return Ok(false);
        }
        write_atomically(&self.path, &render(status))?;
        Ok(true)
    }

    /// Removes the file for good: stale numbers must not outlive the device.
    pub fn remove(&self) {
        let mut stopped = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        *stopped = true;
        // Through the checked directory, as the writes went: a directory that turned unsafe
        // since is left alone.
        match open_dir(&self.path) {
            Ok((dir, name)) => {
                use std::os::fd::AsFd;
                match sys::unlink_at(dir.as_fd(), &name) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => {
                        tracing::warn!(path = %self.path.display(), %error, "removing the metrics file failed")
                    }
                }
            }
            // No directory, no file.
            Err(TextfileError::Missing { .. }) => {}
            Err(error) => {
                tracing::warn!(%error, "the metrics file is not removed")
            }
        }
    }

    /// The metrics thread: writes from `snapshot` now and every [`TEXTFILE_INTERVAL`] until
    /// the file is removed. A failed write is logged (once until a write works again) and
    /// retried next time; it never affects serving.
    pub fn keep_writing(&self, snapshot: impl Fn() -> DeviceStatus) {
        let mut failing = false;
        loop {
            match self.write(&snapshot()) {
                Ok(false) => return,
                Ok(true) if failing => {
                    tracing::info!(path = %self.path.display(), "metrics file written again");
                    failing = false;
                }
                Ok(true) => {}
                Err(err) if !failing => {
                    tracing::warn!(path = %self.path.display(), error = %err, "writing the metrics file failed; retrying every 15 s");
                    failing = true;
                }
                Err(_) => {}
            }
            std::thread::sleep(TEXTFILE_INTERVAL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(name: &str, value: u64) -> Stat {
        Stat {
            name: name.into(),
            value,
        }
    }

    /// Every stat the daemon reports today, plus backend stats of the kind added later.
    fn status() -> DeviceStatus {
        let store = uzram_core::Stats {
            orig_data_size: 12 << 20,
            compr_data_size: 5 << 20,
            mem_used_total: 6 << 20,
            mem_used_max: 7 << 20,
            same_pages: 17,
            reads: 99,
            ..Default::default()
        };
        let requests = [
            "read_requests",
            "read_bytes",
            "write_requests",
            "write_bytes",
            "flush_requests",
            "discard_requests",
            "write_zeroes_requests",
            "failed_requests",
            "queue_page_faults",
            "pool_free_blocks",
            "pool_released_blocks",
            "daemon_rss_bytes",
            "pool_refused_blocks",
            "pool_waited_takes",
            "pool_take_timeouts",
            "pool_damaged_lists",
            "io_threads_per_queue",
            "queue_ring_setup_flags",
            "queue_retried_waits",
            "queue_failed_commands",
        ];
        DeviceStatus {
            id: 3,
            dev: "/dev/ublkb3".into(),
            pid: 42,
            size: 1 << 30,
            algorithm: "zstd:3".into(),
            backend: "gpu".into(),
            queues: 2,
            depth: 64,
            queue_mode: "per-queue".into(),
            stats: store
                .fields()
                .into_iter()
                .map(|(n, v)| stat(n, v))
                .collect(),
            requests: requests
                .iter()
                .enumerate()
                .map(|(i, n)| stat(n, i as u64 + 1))
                .collect(),
            backend_stats: vec![
                stat("batches", 4),
                stat("backend_us", 2_500_000),
                stat("gpu_bytes_in", 1 << 20),
                stat("gpu_h2d_us", 1500),
                stat("ring.slot-waits", 9),
            ],
        }
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        let text = render(&status());
        for want in [
            "uzram_orig_data_bytes{device=\"ublkb3\"} 12582912",
            "uzram_mem_used_bytes{device=\"ublkb3\"} 6291456",
            "uzram_pages_read_total{device=\"ublkb3\"} 99",
            "uzram_pool_free_blocks{device=\"ublkb3\"} 10",
            "uzram_device_info{device=\"ublkb3\",algorithm=\"zstd:3\",backend=\"gpu\",queue_mode=\"per-queue\"} 1",
            // The generic rule: counters, base units, a backend prefix.
            "uzram_backend_batches_total{device=\"ublkb3\"} 4",
            "uzram_backend_seconds_total{device=\"ublkb3\"} 2.5",
            "uzram_backend_gpu_in_bytes_total{device=\"ublkb3\"} 1048576",
            "uzram_backend_gpu_h2d_seconds_total{device=\"ublkb3\"} 0.0015",
            "uzram_backend_ring_slot_waits_total{device=\"ublkb3\"} 9",
            "# TYPE uzram_same_pages gauge",
            "# TYPE uzram_failed_reads_total counter",
            // Amounts and settings are gauges; the pool's give-backs are counted.
            "# TYPE uzram_daemon_resident_bytes gauge",
            "# TYPE uzram_io_threads_per_queue gauge",
            "# TYPE uzram_queue_ring_setup_flags gauge",
            "# TYPE uzram_pool_released_blocks_total counter",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        let names: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("# TYPE "))
            .map(|l| l.split(' ').nth(2).unwrap())
            .collect();
        let s = status();
        assert_eq!(
            names.len(),
            4 + s.stats.len() + s.requests.len() + s.backend_stats.len(),
            "one family per stat, none dropped as a duplicate"
        );
        for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut parts = line.split(' ').skip(2);
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            assert!(
                name.starts_with("uzram_")
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{name}"
            );
            assert_eq!(kind == "counter", name.ends_with("_total"), "{line}");
        }
    }

    #[test]
    fn duplicate_names_keep_the_first() {
        let mut s = status();
        s.backend_stats = vec![stat("x_us", 1), stat("x_ms", 2)];
        let text = render(&s);
        assert_eq!(
            text.matches("# TYPE uzram_backend_x_seconds_total").count(),
            1
        );
        assert!(text.contains("uzram_backend_x_seconds_total{device=\"ublkb3\"} 0.000001"));
    }

    #[test]
    fn a_removed_textfile_is_never_written_again() {
        let dir = fresh_dir("rm", 0o755);
        let file = Textfile::new(dir.join("u.prom"));
        assert!(file.write(&status()).unwrap());
        assert!(dir.join("u.prom").exists());
        file.remove();
        assert!(!dir.join("u.prom").exists());
        assert!(!file.write(&status()).unwrap());
        assert!(!dir.join("u.prom").exists());
        file.keep_writing(status); // returns at once: the file was removed
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn textfile_is_replaced_atomically() {
        let dir = fresh_dir("atomic", 0o755);
        let path = dir.join("uzram-ublkb3.prom");
        write_atomically(&path, "a 1\n").unwrap();
        write_atomically(&path, &render(&status())).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("uzram_orig_data_bytes"));
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "no temporary file is left behind");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o644, 0o644);
        let err = write_atomically(&dir.join("missing/x.prom"), "a 1\n").unwrap_err();
        assert!(matches!(err, TextfileError::Missing { .. }), "{err}");
        assert!(err.to_string().contains("does not exist"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A fresh directory for one test, with `mode` whatever the umask.
    fn fresh_dir(tag: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("uzram-prom-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        dir
    }

    /// A root-only file (as /etc/shadow is) that a planted link points to: its path, in a
    /// directory of its own.
    fn secret(tag: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = fresh_dir(tag, 0o700).join("shadow");
        std::fs::write(&path, "root:secret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }

    fn assert_untouched(secret: &Path) {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::read_to_string(secret).unwrap(), "root:secret\n");
        let mode = std::fs::metadata(secret).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o600, "{}", secret.display());
    }

    fn tmp_name(path: &Path) -> PathBuf {
        let name = path.file_name().unwrap().to_string_lossy();
        path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
    }

    /// The attack: in a directory anyone can write, a link at the temporary name made root
    /// truncate and write the file it points to.
    #[test]
    fn a_link_planted_in_a_shared_directory_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let target = secret("shared-secret");
        let shared = fresh_dir("shared", 0o777);
        let path = shared.join("u.prom");
        let tmp = tmp_name(&path);
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        for mode in [0o777, 0o1777, 0o775, 0o757] {
            std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = write_atomically(&path, "a 1\n").unwrap_err();
            assert!(
                matches!(err, TextfileError::SharedDirectory { mode: m, .. } if m == mode),
                "{mode:o}: {err}"
            );
            let file = Textfile::new(path.clone());
            assert!(file.write(&status()).is_err(), "{mode:o}");
            assert_untouched(&target);
            assert!(
                std::fs::symlink_metadata(&path).is_err(),
                "{mode:o}: no file written"
            );
            assert_eq!(
                std::fs::read_link(&tmp).unwrap(),
                target,
                "the plant is left alone"
            );
        }
        std::fs::remove_dir_all(&shared).unwrap();
        std::fs::remove_dir_all(target.parent().unwrap()).unwrap();
    }

    /// Where only root can write, nobody else can plant a link; one there anyway (a stale
    /// name, root's own mistake) is replaced, never followed, even when it dangles (opening
    /// with O_CREAT through it would create its target).
    #[test]
    fn a_link_at_the_temporary_name_is_never_followed() {
        let target = secret("private-secret");
        let dangling = target.with_file_name("created-through-a-link");
        let dir = fresh_dir("private", 0o755);
        let path = dir.join("u.prom");
        let tmp = tmp_name(&path);
        for (i, plant) in [&target, &dangling].into_iter().enumerate() {
            std::os::unix::fs::symlink(plant, &tmp).unwrap();
            // A link at the final name is replaced too.
            let _ = std::fs::remove_file(&path);
            std::os::unix::fs::symlink(&target, &path).unwrap();
            let text = format!("a {i}\n");
            write_atomically(&path, &text).unwrap();
            assert_untouched(&target);
            assert!(
                !dangling.exists(),
                "nothing created through the dangling link"
            );
            assert!(std::fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_file());
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
            assert!(
                std::fs::symlink_metadata(&tmp).is_err(),
                "no temporary name left"
            );
        }
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(left.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(target.parent().unwrap()).unwrap();
    }

    /// The check at daemon start applies the rule of every write, with what to do about it.
    #[test]
    fn a_directory_others_can_write_fails_the_start() {
        use std::os::unix::fs::PermissionsExt;
        let dir = fresh_dir("start", 0o755);
        let path = dir.join("u.prom");
        check_textfile_dir(&path).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        check_textfile_dir(&path).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = check_textfile_dir(&path).unwrap_err().to_string();
        for want in [
            path.display().to_string(),
            format!(
                "directory {} is writable by group or others (mode 0777)",
                dir.display()
            ),
            format!("use a directory only root can write, e.g. {GOOD_DIR}"),
        ] {
            assert!(err.contains(&want), "missing {want:?} in {err:?}");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(check_textfile_dir(&path).is_err(), "group-writable");
        let err = check_textfile_dir(&dir.join("missing/u.prom")).unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The attack on the way to the directory: in a directory of a user's, a link of theirs
    /// named as the metrics directory, pointed at a directory only root can write, would
    /// have the daemon write (and at its stop remove) a file there.
    #[test]
    fn a_link_another_user_owns_on_the_way_is_refused() {
        if !sys::is_root() {
            eprintln!("SKIP a_link_another_user_owns_on_the_way_is_refused: needs root");
            return;
        }
        let roots = fresh_dir("redirect-target", 0o755);
        let users = fresh_dir("redirect-home", 0o755);
        std::os::unix::fs::chown(&users, Some(65534), Some(65534)).unwrap();
        // A link of the user's, in their directory, to root's directory.
        let link = users.join("m");
        std::os::unix::fs::symlink(&roots, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
        let path = link.join("u.prom");
        let err = write_atomically(&path, "a 1\n").unwrap_err();
        assert!(matches!(err, TextfileError::SharedPath { .. }), "{err}");
        assert!(err.to_string().contains("uid 65534"), "{err}");
        assert_eq!(
            std::fs::read_dir(&roots).unwrap().count(),
            0,
            "nothing written"
        );
        // Root's directory inside the user's (as node_exporter's is on Debian): taken.
        let inner = users.join("real");
        std::fs::create_dir(&inner).unwrap();
        check_textfile_dir(&inner.join("u.prom")).unwrap();
        // Root's link to root's directory: fine.
        let good_link = roots.join("ok");
        std::fs::create_dir(roots.join("d")).unwrap();
        std::os::unix::fs::symlink(roots.join("d"), &good_link).unwrap();
        check_textfile_dir(&good_link.join("u.prom")).unwrap();
        let _ = std::fs::remove_dir_all(&users);
        let _ = std::fs::remove_dir_all(&roots);
    }

    /// The race on the way to the directory: in a directory of another user's (as
    /// `/var/lib/prometheus` is the prometheus user's), that user swaps root's metrics
    /// directory for a link of theirs to another of root's directories, and back, as fast as
    /// they can, while the daemon writes. Whatever the timing, nothing is written through
    /// their link.
    #[test]
    fn a_directory_swapped_for_a_link_while_writing_is_never_followed() {
        if !sys::is_root() {
            eprintln!(
                "SKIP a_directory_swapped_for_a_link_while_writing_is_never_followed: the \
                 swapping user is uid 65534, which needs root"
            );
            return;
        }
        let roots = fresh_dir("swap-target", 0o755);
        let users = fresh_dir("swap-home", 0o755);
        std::os::unix::fs::chown(&users, Some(65534), Some(65534)).unwrap();
        let real = users.join("m");
        std::fs::create_dir(&real).unwrap();
        let link = users.join("alt");
        std::os::unix::fs::symlink(&roots, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
        let Some(swapper) = Swapper::start(&real, &link) else {
            eprintln!(
                "SKIP a_directory_swapped_for_a_link_while_writing_is_never_followed: this \
                 file system has no RENAME_EXCHANGE"
            );
            let _ = std::fs::remove_dir_all(&users);
            let _ = std::fs::remove_dir_all(&roots);
            return;
        };
        let path = real.join("u.prom");
        let (mut written, mut refused) = (0, 0);
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(3) || written == 0 || refused == 0 {
            match write_atomically(&path, "a 1\n") {
                Ok(()) => written += 1,
                Err(TextfileError::SharedPath { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
            assert_eq!(
                std::fs::read_dir(&roots).unwrap().count(),
                0,
                "a file was written through the user's link ({written} written, {refused} \
                 refused)"
            );
            assert!(start.elapsed() < std::time::Duration::from_secs(60));
        }
        drop(swapper);
        eprintln!("{written} written, {refused} refused, none through the link");
        let _ = std::fs::remove_dir_all(&users);
        let _ = std::fs::remove_dir_all(&roots);
    }

    /// A child process, uid 65534, exchanging two names of its directory until dropped.
    struct Swapper(libc::pid_t);

    impl Swapper {
        /// `None` when the file system cannot exchange names.
        fn start(a: &Path, b: &Path) -> Option<Swapper> {
            use std::os::unix::ffi::OsStrExt;
            let a = std::ffi::CString::new(a.as_os_str().as_bytes()).unwrap();
            let b = std::ffi::CString::new(b.as_os_str().as_bytes()).unwrap();
            let exchange = || {
                // SAFETY: both names are valid NUL-terminated strings.
                unsafe {
                    libc::renameat2(
                        libc::AT_FDCWD,
                        a.as_ptr(),
                        libc::AT_FDCWD,
                        b.as_ptr(),
                        libc::RENAME_EXCHANGE,
                    )
                }
            };
            if exchange() != 0 || exchange() != 0 {
                return None;
            }
            // SAFETY: the child calls only async-signal-safe functions (setgid, setuid,
            // renameat2, _exit) and never returns into the test harness.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                // SAFETY: as above; the child runs as uid 65534 from here, or exits.
                unsafe {
                    if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                        libc::_exit(2);
                    }
                    loop {
                        if exchange() != 0 {
                            libc::_exit(3);
                        }
                    }
                }
            }
            Some(Swapper(pid))
        }
    }

    impl Drop for Swapper {
        fn drop(&mut self) {
            let mut status = 0;
            // SAFETY: `self.0` is this test's child, reaped here once.
            unsafe {
                libc::kill(self.0, libc::SIGKILL);
                libc::waitpid(self.0, &mut status, 0);
            }
            assert!(
                libc::WIFSIGNALED(status),
                "the swapping child stopped by itself (status {status:#x})"
            );
        }
    }

    /// A directory another user owns is theirs to plant links in, whatever its mode.
    #[test]
    fn a_directory_owned_by_another_user_is_refused() {
        if !sys::is_root() {
            eprintln!(
                "SKIP a_directory_owned_by_another_user_is_refused: giving a directory to \
                 uid 65534 needs root"
            );
            return;
        }
        let dir = fresh_dir("foreign", 0o755);
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let path = dir.join("u.prom");
        let err = check_textfile_dir(&path).unwrap_err();
        assert!(
            matches!(err, TextfileError::ForeignDirectory { owner: 65534, .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains(&format!(
                "{} is owned by uid 65534, not root",
                dir.display()
            )),
            "{err}"
        );
        assert!(write_atomically(&path, "a 1\n").is_err());
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "nothing written"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Debian's python, the one python3-prometheus-client installs into (a `python3` earlier
    /// on PATH, e.g. pyenv's, does not see it).
    const DEBIAN_PYTHON: &str = "/usr/bin/python3";

    /// The real parser: prometheus_client's (python3-prometheus-client, installed by
    /// scripts/setup-host) reads every family, type and value back.
    #[test]
    fn prometheus_client_parses_the_output() {
        let have = std::process::Command::new(DEBIAN_PYTHON)
            .args(["-c", "import prometheus_client.parser"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !have {
            let msg = "/usr/bin/python3 with prometheus_client is missing: run scripts/setup-host \
                       (apt-get install python3-prometheus-client)";
            assert!(std::env::var_os("CI").is_none(), "{msg}");
            eprintln!("SKIP prometheus_client_parses_the_output: {msg}");
            return;
        }
        let s = status();
        let text = render(&s);
        let script = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for fam in text_string_to_metric_families(sys.stdin.read()):
    for smp in fam.samples:
        print(fam.name, fam.type, smp.name, smp.labels["device"], repr(smp.value))
"#;
        let mut child = std::process::Command::new(DEBIAN_PYTHON)
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "parser refused the output: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        let parsed = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = parsed.lines().collect();
        assert_eq!(
            lines.len(),
            4 + s.stats.len() + s.requests.len() + s.backend_stats.len()
        );
        for want in [
            "uzram_orig_data_bytes gauge uzram_orig_data_bytes ublkb3 12582912.0",
            "uzram_mem_used_bytes gauge uzram_mem_used_bytes ublkb3 6291456.0",
            "uzram_read_requests counter uzram_read_requests_total ublkb3 1.0",
            "uzram_backend_gpu_h2d_seconds counter uzram_backend_gpu_h2d_seconds_total ublkb3 0.0015",
            "uzram_device_info gauge uzram_device_info ublkb3 1.0",
        ] {
            assert!(lines.contains(&want), "missing {want:?} in\n{parsed}");
        }
    }
}

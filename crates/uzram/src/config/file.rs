//! A uzram TOML config file: zram-generator's keys flat, plus uzram's own (see the parent
//! module), read into a [`Plan`] for this host.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::device::{ConfigError, DeviceConfig, Host, RawDevice, SwapConfig, DEFAULT_SWAP_OPTIONS};
use crate::size::MAX_SIZE;
use crate::sizeexpr::{eval_mib, mib_to_bytes};

/// A `zram-size` or `zram-resident-limit` in a TOML file: an expression (`"ram / 2"`) or a
/// number, both in MiB.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a number of MiB or an expression in quotes, e.g. 4096 or \"ram / 2\""
)]
enum ExprValue {
    Int(u64),
    Float(f64),
    Text(String),
}

impl ExprValue {
    fn text(self) -> String {
        match self {
            ExprValue::Int(n) => n.to_string(),
            ExprValue::Float(f) => f.to_string(),
            ExprValue::Text(t) => t,
        }
    }
}

/// `host-memory-limit`: MiB, or "none".
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a whole number of MiB, or \"none\"")]
enum LimitValue {
    Int(u64),
    Text(String),
}

/// A size in a TOML file: `"8G"` or a plain number of bytes.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a size in quotes, e.g. \"8G\", or a whole number of bytes"
)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn text(self) -> String {
        match self {
            SizeValue::Bytes(b) => b.to_string(),
            SizeValue::Text(t) => t,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct FileConfig {
    zram_size: Option<ExprValue>,
    size: Option<SizeValue>,
    zram_resident_limit: Option<ExprValue>,
    host_memory_limit: Option<LimitValue>,
    compression_algorithm: Option<String>,
    backend: Option<String>,
    mem_limit: Option<SizeValue>,
    metrics_textfile: Option<PathBuf>,
    swap_priority: Option<i64>,
    options: Option<String>,
    fs_type: Option<String>,
    queues: Option<u64>,
    depth: Option<u64>,
    queue_mode: Option<String>,
    user_copy: Option<String>,
    queue_affinity: Option<String>,
    id: Option<u64>,
    gpus: Option<String>,
    gpu_memory: Option<SizeValue>,
    gpu_parse: Option<String>,
    gpu_installers: Option<u64>,
    gpu_slot_wait_us: Option<u64>,
    gpu_slot_pages: Option<u64>,
    gpu_place: Option<bool>,
    checksums: Option<bool>,
    recompress_algorithm: Option<String>,
    recompress_idle_age: Option<ExprValue>,
    recompress_threshold: Option<u64>,
    writeback_device: Option<PathBuf>,
    writeback_idle_age: Option<ExprValue>,
    writeback_limit: Option<String>,
}

/// A config file, validated: the device and its swap settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The device.
    pub device: DeviceConfig,
    /// How `uzram swap-on` activates it.
    pub swap: SwapConfig,
}

/// What a config file asks for on this host.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Serve this device (boxed: the config is large, a skip is a line of text).
    Device(Box<RunConfig>),
    /// No device here, as zram-generator would create none: the host has more RAM than
    /// `host-memory-limit`, or the size evaluates to 0. The text says which.
    Skip(String),
}

/// zram-generator's default `zram-size`.
pub const DEFAULT_ZRAM_SIZE: &str = "min(ram / 2, 4096)";

/// Evaluates a MiB expression into bytes; `None` for 0.
fn expr_bytes(
    path: &Path,
    key: &'static str,
    expr: &str,
    host: Host,
) -> Result<Option<u64>, ConfigError> {
    let mib = eval_mib(key, expr, host.ram_mib).map_err(|why| ConfigError::Expr {
        path: path.to_path_buf(),
        why,
    })?;
    let bytes = mib_to_bytes(mib);
    if bytes > MAX_SIZE {
        return Err(ConfigError::ExprTooLarge {
            path: path.to_path_buf(),
            key,
            expr: expr.to_string(),
            mib,
            ram_mib: host.ram_mib,
        });
    }
    Ok((bytes > 0).then_some(bytes))
}

/// Parses config file text for `host`; `path` is only used in messages.
pub fn parse_config(path: &Path, text: &str, host: Host) -> Result<Plan, ConfigError> {
    let file: FileConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: placed(text, e.span(), e.message()),
    })?;
    plan(file, path, host)
}

/// The longest piece of a config file a message quotes.
const QUOTED_CHARS: usize = 80;

/// `message` with where in `text` it arose (`span`, a byte range): the line, the column and
/// the line itself, each cut to a readable length (a config file may be a megabyte).
fn placed(text: &str, span: Option<std::ops::Range<usize>>, message: &str) -> String {
    // What the parser quotes (a key, in backticks) may be the whole file; its list of the
    // keys there are is not.
    let message: Vec<String> = message
        .trim_end()
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                clip(part, QUOTED_CHARS)
            } else {
                part.to_string()
            }
        })
        .collect();
    let message = clip(&message.join("`"), 20 * QUOTED_CHARS);
    let Some(at) = span.map(|s| s.start.min(text.len())) else {
        return message;
    };
    let before = text.get(..at).unwrap_or_default();
    let line = before.matches('\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = text.get(start..at).map_or(1, |t| t.chars().count() + 1);
    let whole = text[start..].lines().next().unwrap_or_default().trim();
    format!(
        "line {line}, column {column} ({}): {message}",
        clip(whole, QUOTED_CHARS)
    )
}

/// `text` cut to `max` characters, marked where cut.
pub(crate) fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// What `file`'s keys make on `host`; `path` names them in messages.
pub(super) fn plan(file: FileConfig, path: &Path, host: Host) -> Result<Plan, ConfigError> {
    let duplicate = |a, b| ConfigError::Duplicate {
        path: path.to_path_buf(),
        a,
        b,
    };
    if let Some(fs_type) = file.fs_type.filter(|t| t != "swap") {
        return Err(ConfigError::FsType {
            path: path.to_path_buf(),
            fs_type,
        });
    }
    let priority = file
        .swap_priority
        .map(|p| {
            if (-1..=32767).contains(&p) {
                Ok(p as i32)
            } else {
                Err(ConfigError::OutOfRange {
                    what: "swap-priority",
                    value: p,
                    min: -1,
                    max: 32767,
                })
            }
        })
        .transpose()?;
    let host_limit = match file.host_memory_limit {
        None => None,
        Some(LimitValue::Int(mib)) => Some(mib),
        Some(LimitValue::Text(t)) if t.trim() == "none" => None,
        Some(LimitValue::Text(t)) => {
            Some(
                t.trim()
                    .parse::<u64>()
                    .map_err(|_| ConfigError::HostMemoryLimit {
                        path: path.to_path_buf(),
                        value: t.clone(),
                    })?,
            )
        }
    };
    // Expressions are evaluated (and refused when bad) even where no device is made, so a
    // broken file is found on every host.
    let size = match (file.zram_size, file.size) {
        (Some(_), Some(_)) => return Err(duplicate("zram-size", "size")),
        (None, Some(bytes)) => Some(bytes.text()),
        (expr, None) => {
            let expr = expr.map_or_else(|| DEFAULT_ZRAM_SIZE.to_string(), ExprValue::text);
            expr_bytes(path, "zram-size", &expr, host)?.map(|b| b.to_string())
        }
    };
    let mem_limit = match (file.zram_resident_limit, file.mem_limit) {
        (Some(_), Some(_)) => return Err(duplicate("zram-resident-limit", "mem-limit")),
        (None, Some(bytes)) => Some(bytes.text()),
        (Some(expr), None) => {
            expr_bytes(path, "zram-resident-limit", &expr.text(), host)?.map(|b| b.to_string())
        }
        (None, None) => None,
    };
    if let Some(limit) = host_limit.filter(|&l| l < host.ram_mib) {
        return Ok(Plan::Skip(format!(
            "this host has {} MiB of RAM, more than host-memory-limit = {limit} MiB",
            host.ram_mib
        )));
    }
    let Some(size) = size else {
        return Ok(Plan::Skip(format!(
            "zram-size is 0 MiB with ram = {} MiB (a device of size 0 is not created)",
            host.ram_mib
        )));
    };
    let raw = RawDevice {
        size,
        algorithm: file.compression_algorithm,
        backend: file.backend,
        queues: file.queues,
        depth: file.depth,
        queue_mode: file.queue_mode,
        user_copy: file.user_copy,
        queue_affinity: file.queue_affinity,
        mem_limit,
        id: file.id,
        gpus: file.gpus,
        gpu_memory: file.gpu_memory.map(SizeValue::text),
        gpu_parse: file.gpu_parse,
        gpu_installers: file.gpu_installers,
        gpu_slot_wait_us: file.gpu_slot_wait_us,
        gpu_slot_pages: file.gpu_slot_pages,
        gpu_place: file.gpu_place,
        metrics_textfile: file.metrics_textfile,
        checksums: file.checksums,
        recompress_algorithm: file.recompress_algorithm,
        recompress_idle_age: file.recompress_idle_age.map(ExprValue::text),
        recompress_threshold: file.recompress_threshold,
        writeback_device: file.writeback_device,
        writeback_idle_age: file.writeback_idle_age.map(ExprValue::text),
        writeback_limit: file.writeback_limit,
    };
    Ok(Plan::Device(Box::new(RunConfig {
        device: raw.validate(host)?,
        swap: SwapConfig {
            priority,
            // zram-generator's default: freed swap clusters reach the device as discards,
            // the only way a ublk device learns that pages are free (zram gets a per-slot
            // notification from the kernel that other block devices do not).
            options: Some(
                file.options
                    .unwrap_or_else(|| DEFAULT_SWAP_OPTIONS.to_string()),
            )
            .filter(|o| !o.is_empty()),
        },
    })))
}

/// The most a config file may hold: far more than any real one, and a bound on what a read
/// of a path that is no file (`/dev/zero`) takes.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of `path`, refused when it is not a regular file (a FIFO would block the reader,
/// at boot the generator, until someone writes to it; a device never ends), when it passes
/// [`MAX_CONFIG_BYTES`], or when others than its reader and root could have written it: the
/// file is not root's (or the reader's) or is writable by its group or others. A config
/// names files the daemon opens as root and ends up in the unit (the generator's drop-ins),
/// so only whoever runs it may have written it.
pub(crate) fn read_capped(path: &Path) -> std::io::Result<String> {
    use crate::sys::owned_file::{self, Links, Refused};
    use std::io::{Error, ErrorKind};
    let bytes = owned_file::read(path, MAX_CONFIG_BYTES, Links::Follow).map_err(|e| match e {
        Refused::NotAFile(kind) => Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{} is {kind}, not a regular file: name the config file itself",
                path.display()
            ),
        ),
        Refused::OthersWrite(crate::sys::OthersWrite::Owner(owner)) => Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "owned by uid {owner}, not root or the reader (uid {}): `chown root: {}`",
                crate::sys::effective_uid(),
                path.display()
            ),
        ),
        Refused::OthersWrite(crate::sys::OthersWrite::Mode(mode)) => Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "writable by its group or others (mode {mode:04o}): `chmod go-w {}`",
                path.display()
            ),
        ),
        Refused::TooLarge(max) => Error::new(
            ErrorKind::InvalidData,
            format!("larger than {max} bytes: not a uzram config file"),
        ),
        Refused::Io(e) => e,
    })?;
    String::from_utf8(bytes)
        .map_err(|_| Error::new(ErrorKind::InvalidData, "stream did not contain valid UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::super::device::*;
    use super::*;
    use uzram_core::codec::Algorithm;
    use uzram_gpu::Parse;

    const HOST: Host = Host::with_ram(8192);

    fn plan(text: &str, host: Host) -> Result<Plan, ConfigError> {
        parse_config(Path::new("test.toml"), text, host)
    }

    fn parse(text: &str) -> Result<RunConfig, ConfigError> {
        match plan(text, HOST)? {
            Plan::Device(cfg) => Ok(*cfg),
            Plan::Skip(why) => panic!("unexpected skip: {why}"),
        }
    }

    /// The generator writes `writeback-device` into the unit's drop-in and opens a file's
    /// directory to the daemon: a config line must not add settings to the unit (a newline
    /// and an `ExecStartPre=`), be split or expanded by systemd, or open a system directory.
    #[test]
    fn a_writeback_device_the_unit_cannot_name_safely_is_refused() {
        for (path, why) in [
            (
                r"/x\n[Service]\nExecStartPre=+/bin/sh -c /tmp/p\n#/y.wb",
                "holds a space",
            ),
            ("/srv/my swap.wb", "holds a space"),
            ("/srv/%h.wb", "holds a space"),
            ("/swap.wb", "system directory"),
            ("/etc/x.wb", "system directory"),
            ("/run/x.wb", "system directory"),
            ("/etc/systemd/system/x.wb", "system directory"),
            ("/usr/lib/x/x.wb", "system directory"),
            ("/var/x.wb", "system directory"),
            ("/var/lib/x.wb", "system directory"),
            ("/srv/x.wb", "system directory"),
            ("/mnt/x.wb", "system directory"),
            ("/dev/../etc/x.wb", "`..`"),
            ("/srv/swap/./x.wb", "`..`"),
            ("/dev", "/dev itself"),
            ("/dev/", "/dev itself"),
        ] {
            let text = format!("size = \"1G\"\nwriteback-device = \"{path}\"\n");
            let err = parse(&text).unwrap_err();
            assert!(
                matches!(err, ConfigError::WritebackPathUnsafe { .. }),
                "{path:?}: {err}"
            );
            assert!(err.to_string().contains(why), "{path:?}: {err}");
        }
        for path in [
            "/dev/sdb2",
            "/dev/disk/by-id/ata-X_Y-part2",
            "/var/lib/uzram/swap0.wb",
            "/srv/swap/swap0.wb",
        ] {
            let text = format!("size = \"1G\"\nwriteback-device = \"{path}\"\n");
            let cfg = parse(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            assert_eq!(
                cfg.device.writeback.map(|w| w.device),
                Some(std::path::PathBuf::from(path))
            );
        }
    }

    /// A directory that is a link into a system directory opens that directory as well
    /// as one named outright (systemd's `ReadWritePaths=` follows links).
    #[test]
    fn a_writeback_file_through_a_link_into_a_system_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("wb");
        std::os::unix::fs::symlink("/etc/systemd", &link).unwrap();
        let text = format!(
            "size = \"1G\"\nwriteback-device = \"{}\"\n",
            link.join("x.wb").display()
        );
        let err = parse(&text).unwrap_err();
        assert!(
            matches!(err, ConfigError::WritebackPathUnsafe { .. }),
            "{err}"
        );
        std::fs::remove_file(&link).unwrap();
        std::fs::create_dir(&link).unwrap();
        assert!(parse(&text).is_ok(), "a directory of its own is fine");
    }

    /// A value of the wrong kind, a TOML syntax error or a duplicate key says where (line,
    /// column, the line itself) and what the key takes; a huge key is quoted cut, not whole.
    #[test]
    fn parse_errors_say_where_and_what() {
        for (text, want) in [
            (
                "size = \"1G\"\nzram-size = true\n",
                "line 2, column 13 (zram-size = true): a number of MiB or an expression in \
                 quotes",
            ),
            (
                "size = 1.5\n",
                "line 1, column 8 (size = 1.5): a size in quotes, e.g. \"8G\", or a whole number",
            ),
            (
                "size = \"1G\"\nhost-memory-limit = -5\n",
                "(host-memory-limit = -5): a whole number of MiB, or \"none\"",
            ),
            (
                "size = \"1G\"\nsize = \"2G\"\n",
                "line 2, column 1 (size = \"2G\"): duplicate key",
            ),
            ("queues = \"four\"\n", "(queues = \"four\"): invalid type"),
        ] {
            let err = plan(text, HOST).unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let huge_value = format!("queues = \"{}\"\n", "x".repeat(100_000));
        let err = plan(&huge_value, HOST).unwrap_err().to_string();
        assert!(err.len() < 2_000, "{} bytes", err.len());
        let huge = format!("{} = 1\n", "x".repeat(100_000));
        let err = plan(&huge, HOST).unwrap_err().to_string();
        assert!(err.len() < 2_000, "{} bytes", err.len());
        assert!(
            err.contains("`writeback-limit`"),
            "the keys are listed whole: {err}"
        );
    }

    /// Only a regular file is read: a FIFO no one writes to (which held the generator, and
    /// with it the boot, until its timeout) and a directory are refused at once, by kind.
    #[test]
    fn a_fifo_or_a_directory_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.toml");
        crate::sys::make_fifo(&fifo).unwrap();
        let start = std::time::Instant::now();
        let err = read_capped(&fifo).unwrap_err();
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        assert!(
            err.to_string().contains("is a FIFO, not a regular file"),
            "{err}"
        );
        let err = read_capped(dir.path()).unwrap_err();
        assert!(
            err.to_string()
                .contains("is a directory, not a regular file"),
            "{err}"
        );
    }

    /// A config someone else could have written is refused before it is read: writable by
    /// its group or others, or (read by root) owned by another user.
    #[test]
    fn a_config_others_could_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap0.toml");
        std::fs::write(&path, "size = \"1G\"\n").unwrap();
        let set = |mode| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode));
        set(0o644).unwrap();
        assert_eq!(read_capped(&path).unwrap(), "size = \"1G\"\n");
        for mode in [0o666, 0o664, 0o646] {
            set(mode).unwrap();
            let err = read_capped(&path).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{mode:o}");
            assert!(err.to_string().contains("chmod go-w"), "{err}");
        }
        let zero = read_capped(Path::new("/dev/zero")).unwrap_err();
        assert!(
            zero.to_string()
                .contains("a character device, not a regular file"),
            "{zero}"
        );
        set(0o644).unwrap();
        if crate::sys::is_root() {
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            let err = read_capped(&path).unwrap_err();
            assert!(err.to_string().contains("owned by uid 65534"), "{err}");
        }
    }

    #[test]
    fn full_file_parses() {
        let cfg = parse(
            r#"
            size = "8G"
            compression-algorithm = "zstd:3"
            swap-priority = 100
            mem-limit = "2G"
            backend = "auto"
            options = "discard"
            fs-type = "swap"
            queues = 2
            depth = 64
            id = 7
            gpus = "0,1"
            gpu-memory = "256M"
            gpu-parse = "fast"
            gpu-installers = 6
            gpu-slot-wait-us = 500
            metrics-textfile = "/var/lib/node_exporter/textfile_collector/uzram-swap0.prom"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.device.gpu.gpus, GpuSelect::List(vec![0, 1]));
        assert_eq!(cfg.device.gpu.memory, 256 << 20);
        assert_eq!(cfg.device.gpu.parse, Parse::Fast);
        assert_eq!(cfg.device.gpu.installers, 6);
        assert_eq!(cfg.device.gpu.slot_wait_us, 500);
        assert_eq!(cfg.device.size, 8 << 30);
        assert_eq!(cfg.device.algorithm, Algorithm::Zstd { level: 3 });
        assert_eq!(cfg.device.backend, Backend::Auto);
        assert_eq!(cfg.device.mem_limit, Some(2 << 30));
        assert_eq!((cfg.device.queues, cfg.device.depth), (2, 64));
        assert_eq!(cfg.device.id, Some(7));
        assert_eq!(
            cfg.device.metrics_textfile.as_deref(),
            Some(Path::new(
                "/var/lib/node_exporter/textfile_collector/uzram-swap0.prom"
            ))
        );
        assert_eq!(cfg.swap.priority, Some(100));
        assert_eq!(cfg.swap.options.as_deref(), Some("discard"));
    }

    #[test]
    fn shipped_example_parses() {
        let text = include_str!("../../../../systemd/uzram.toml.example");
        let cfg = parse(text).unwrap();
        // zram-size = "min(ram / 2, 4096)" on an 8 GiB host.
        assert_eq!(cfg.device.size, 4096 << 20);
        assert_eq!(cfg.swap.priority, Some(100));
        assert_eq!(cfg.swap.options.as_deref(), Some("discard"));
    }

    #[test]
    fn minimal_file_gets_defaults() {
        let cfg = parse("size = 1048576").unwrap();
        assert_eq!(cfg.device.size, 1 << 20);
        assert_eq!(cfg.device.algorithm, Algorithm::Lz4);
        assert_eq!(cfg.device.backend, Backend::Cpu);
        assert_eq!(cfg.device.depth, DEFAULT_DEPTH);
        assert_eq!(cfg.device.queues, default_queues());
        assert_eq!(cfg.device.mem_limit, None);
        assert_eq!(cfg.device.metrics_textfile, None);
        assert_eq!(cfg.swap.priority, None);
        assert_eq!(cfg.swap.options.as_deref(), Some(DEFAULT_SWAP_OPTIONS));
        assert_eq!(cfg.device.gpu, GpuSettings::default());
        assert_eq!(cfg.device.gpu.parse, Parse::High);
        assert!(!cfg.device.gpu.place, "gpu-place is opt-in");
        // An empty options string turns the default off.
        let cfg = parse("size = 1048576\noptions = \"\"").unwrap();
        assert_eq!(cfg.swap.options, None);
        // No size at all: zram-generator's default, min(ram / 2, 4096) MiB.
        let small = Host::with_ram(1000);
        let Plan::Device(cfg) = plan("", small).unwrap() else {
            panic!("skipped")
        };
        assert_eq!(cfg.device.size, 500 << 20);
        assert_eq!(parse("").unwrap().device.size, 4096 << 20);
    }

    #[test]
    fn zram_generator_size_keys() {
        // MiB expressions over ram, as zram-generator.conf(5) documents them.
        let host = Host::with_ram(16384);
        let size = |text: &str| match plan(text, host).unwrap() {
            Plan::Device(cfg) => (cfg.device.size, cfg.device.mem_limit),
            Plan::Skip(why) => panic!("{text}: skipped: {why}"),
        };
        assert_eq!(size("zram-size = \"ram / 4\"").0, 4096 << 20);
        assert_eq!(size("zram-size = 512").0, 512 << 20);
        assert_eq!(
            size("zram-size = 0.001").0,
            4096,
            "1048 bytes round up to one page"
        );
        assert_eq!(
            size("zram-size = \"min(min(ram, 4096) + max(ram - 4096, 0) / 2, 32 * 1024)\"").0,
            10240 << 20
        );
        assert_eq!(
            size("zram-size = 1024\nzram-resident-limit = \"ram / 8\""),
            (1024 << 20, Some(2048 << 20))
        );
        assert_eq!(size("zram-size = 1024\nzram-resident-limit = 0").1, None);
        // host-memory-limit: no device when MemTotal is above it (MiB, or "none").
        for (limit, made) in [
            ("16384", true),
            ("16383", false),
            ("\"none\"", true),
            ("\"100\"", false),
        ] {
            let p = plan(
                &format!("zram-size = 64\nhost-memory-limit = {limit}"),
                host,
            )
            .unwrap();
            assert_eq!(
                matches!(p, Plan::Device(_)),
                made,
                "host-memory-limit = {limit}"
            );
            if let Plan::Skip(why) = p {
                assert!(why.contains("host-memory-limit"), "{why}");
            }
        }
        // A size of 0: no device, like zram-generator.
        let p = plan("zram-size = \"ram * 0\"", host).unwrap();
        assert!(
            matches!(p, Plan::Skip(ref why) if why.contains("0 MiB")),
            "{p:?}"
        );
    }

    #[test]
    fn bad_expressions_name_the_key() {
        for (text, key) in [
            (
                "zram-size = \"ram /\"",
                "zram-size = \"ram /\" is not a valid expression",
            ),
            (
                "zram-size = \"ram * swap\"",
                "zram-size = \"ram * swap\" cannot be evaluated",
            ),
            ("zram-size = \"100 - ram\"", "must be 0 or more"),
            (
                "zram-size = 64\nzram-resident-limit = \"ram +\"",
                "zram-resident-limit = ",
            ),
            // uzram's old byte syntax under zram-generator's key: 8e9 MiB.
            (
                "zram-size = \"8G\"",
                "for 8 GiB write zram-size = 8192, or size = \"8G\"",
            ),
            (
                "zram-size = 64\nzram-resident-limit = \"ram * 10000\"",
                "for 8 GiB write zram-resident-limit = 8192, or mem-limit = \"8G\"",
            ),
        ] {
            let err = plan(text, HOST).unwrap_err();
            let msg = format!("{:#}", anyhow::Error::new(err));
            assert!(msg.contains(key), "{text}: {msg}");
        }
        assert!(matches!(
            plan("size = \"1G\"\nzram-size = 1024", HOST),
            Err(ConfigError::Duplicate {
                a: "zram-size",
                b: "size",
                ..
            })
        ));
        assert!(matches!(
            plan(
                "size = \"1G\"\nmem-limit = \"1G\"\nzram-resident-limit = 1",
                HOST
            ),
            Err(ConfigError::Duplicate { .. })
        ));
        assert!(matches!(
            plan("size = \"1G\"\nhost-memory-limit = \"lots\"", HOST),
            Err(ConfigError::HostMemoryLimit { .. })
        ));
        // A bad expression is refused also where the host limit means no device.
        assert!(plan("zram-size = \"ram /\"\nhost-memory-limit = 1", HOST).is_err());
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(matches!(
            parse("size = \"0\""),
            Err(ConfigError::Size { .. })
        ));
        assert!(matches!(
            parse("size = \"lots\""),
            Err(ConfigError::Size { .. })
        ));
        assert!(matches!(
            parse("size = \"99T\""),
            Err(ConfigError::Size { .. })
        ));
        assert!(matches!(
            parse("size = \"1G\"\nmem-limit = \"x\""),
            Err(ConfigError::Size { .. })
        ));
        assert!(matches!(
            parse("size = \"1G\"\ncompression-algorithm = \"lzo\""),
            Err(ConfigError::UnknownAlgorithm(_))
        ));
        assert!(matches!(
            parse("size = \"1G\"\nbackend = \"tpu\""),
            Err(ConfigError::UnknownBackend(_))
        ));
        assert!(matches!(
            parse("size = \"1G\"\nbackend = \"gpu\""),
            Err(ConfigError::GpuUnavailable(_))
        ));
        assert!(matches!(
            parse("size = \"1G\"\nswap-priority = 40000"),
            Err(ConfigError::OutOfRange { .. })
        ));
        assert!(matches!(
            parse("size = \"1G\"\nqueues = 0"),
            Err(ConfigError::OutOfRange { .. })
        ));
        assert!(matches!(
            parse("size = \"1G\"\nfs-type = \"ext4\""),
            Err(ConfigError::FsType { .. })
        ));
        for path in ["uzram.prom\"", "/tmp/uzram.txt\""] {
            let err = parse(&format!("size = \"1G\"\nmetrics-textfile = \"{path}")).unwrap_err();
            assert!(matches!(err, ConfigError::MetricsTextfile { .. }), "{err}");
        }
        for gpus in ["", "zero", "0,0", "1,,2", "-1"] {
            let text = format!("size = \"1G\"\ngpus = \"{gpus}\"");
            assert!(
                matches!(parse(&text), Err(ConfigError::Gpus(_))),
                "{gpus:?}"
            );
        }
        let err = parse("size = \"1G\"\ngpu-parse = \"medium\"").unwrap_err();
        assert!(err.to_string().contains("fast or high"), "{err}");
        assert!(matches!(
            parse("size = \"1G\"\ngpu-memory = \"16M\""),
            Err(ConfigError::GpuMemory(_))
        ));
        let err = parse("size = \"1G\"\ngpu-slot-wait-us = 100001").unwrap_err();
        assert!(matches!(err, ConfigError::OutOfRange { .. }), "{err}");
        assert!(err.to_string().contains("gpu-slot-wait-us"), "{err}");
        assert_eq!(
            parse("size = \"1G\"\ngpu-slot-wait-us = 0")
                .unwrap()
                .device
                .gpu
                .slot_wait_us,
            0
        );
    }

    #[test]
    fn gpus_select_all_or_a_list() {
        assert_eq!(GpuSelect::parse("all").unwrap(), GpuSelect::All);
        assert_eq!(
            GpuSelect::parse("0, 2").unwrap(),
            GpuSelect::List(vec![0, 2])
        );
        assert_eq!(GpuSelect::List(vec![0, 2]).to_string(), "0,2");
        assert_eq!(GpuSelect::All.to_string(), "all");
    }

    #[test]
    fn auto_with_zstd_is_accepted_and_gpu_with_zstd_is_not() {
        let cfg =
            parse("size = \"1G\"\ncompression-algorithm = \"zstd\"\nbackend = \"auto\"").unwrap();
        assert_eq!(cfg.device.backend, Backend::Auto);
        assert!(matches!(
            parse("size = \"1G\"\ncompression-algorithm = \"zstd\"\nbackend = \"gpu\""),
            Err(ConfigError::GpuNeedsLz4)
        ));
    }

    #[test]
    fn unknown_keys_and_bad_toml_are_refused() {
        let err = parse("size = \"1G\"\ncompresion-algorithm = \"lz4\"").unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }));
        assert!(err.to_string().contains("compresion-algorithm"), "{err}");
        assert!(matches!(parse("size = "), Err(ConfigError::Parse { .. })));
        assert!(matches!(
            parse("size = [1]"),
            Err(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn queue_affinity_defaults_to_auto_and_values_are_checked() {
        use crate::config::QueueAffinity;
        use crate::ublk::placement::Placement;
        let device = parse("size = \"1G\"").unwrap().device;
        assert_eq!(device.queue_affinity, QueueAffinity::Auto);
        assert_eq!(device.queue_affinity.placement(true), Placement::Anywhere);
        assert_eq!(device.queue_affinity.placement(false), Placement::Kernel);
        for (text, want) in [
            ("kernel", QueueAffinity::Kernel),
            ("any", QueueAffinity::Any),
            ("auto", QueueAffinity::Auto),
        ] {
            let file = format!("size = \"1G\"\nqueue-affinity = \"{text}\"");
            let got = parse(&file).unwrap().device.queue_affinity;
            assert_eq!(got, want);
            assert_eq!(got.to_string(), text);
        }
        assert_eq!(
            QueueAffinity::Kernel.placement(true),
            Placement::Kernel,
            "asked for, kept with the gpu backend too"
        );
        assert_eq!(QueueAffinity::Any.placement(false), Placement::Anywhere);
        let err = parse("size = \"1G\"\nqueue-affinity = \"pinned\"").unwrap_err();
        assert!(matches!(err, ConfigError::UnknownQueueAffinity(_)), "{err}");
        assert!(err.to_string().contains("auto, kernel or any"), "{err}");
    }

    #[test]
    fn user_copy_defaults_to_auto_and_values_are_checked() {
        use crate::config::UserCopy;
        assert_eq!(
            parse("size = \"1G\"").unwrap().device.user_copy,
            UserCopy::Auto
        );
        for (text, want) in [
            ("on", UserCopy::On),
            ("off", UserCopy::Off),
            ("auto", UserCopy::Auto),
        ] {
            let file = format!("size = \"1G\"\nuser-copy = \"{text}\"");
            assert_eq!(parse(&file).unwrap().device.user_copy, want);
        }
        let err = parse("size = \"1G\"\nuser-copy = \"yes\"").unwrap_err();
        assert!(matches!(err, ConfigError::UnknownUserCopy(_)), "{err}");
        assert!(err.to_string().contains("auto, on or off"), "{err}");
    }

    #[test]
    fn queue_mode_defaults_to_auto_and_names_are_checked() {
        use crate::ublk::queue_mode::QueueMode;
        assert_eq!(
            parse("size = \"1G\"").unwrap().device.queue_mode,
            QueueModeChoice::Auto
        );
        assert_eq!(
            parse("size = \"1G\"\nqueue-mode = \"per-io-daemon\"")
                .unwrap()
                .device
                .queue_mode,
            QueueModeChoice::Exactly(QueueMode::PerIoDaemon)
        );
        let err = parse("size = \"1G\"\nqueue-mode = \"turbo\"").unwrap_err();
        assert!(matches!(err, ConfigError::UnknownQueueMode(_)), "{err}");
        assert!(err.to_string().contains("per-queue"), "{err}");
    }

    #[test]
    fn recompression_keys_take_zstd_an_age_and_a_threshold() {
        let cfg = parse(
            "size = \"1G\"\nrecompress-algorithm = \"zstd:7\"\nrecompress-idle-age = \"90s\"\n\
             recompress-threshold = 1024\n",
        )
        .unwrap();
        let r = cfg.device.recompress.unwrap();
        assert_eq!(
            (r.codec, r.idle_age_minutes, r.threshold),
            (RecompressCodec::Zstd { level: 7 }, 2, 1024)
        );
        let default = parse("size = \"1G\"\nrecompress-algorithm = \"zstd\"\n").unwrap();
        let r = default.device.recompress.unwrap();
        assert_eq!(
            (r.codec, r.idle_age_minutes),
            (RecompressCodec::Zstd { level: 3 }, 60)
        );
        let gpu = parse("size = \"1G\"\nrecompress-algorithm = \"lz4-gpu\"\n").unwrap();
        assert_eq!(
            gpu.device.recompress.unwrap().codec,
            RecompressCodec::GpuLz4
        );
        // Its GPU slot's pinned memory counts in what the device locks up front.
        assert_eq!(
            gpu.device.gpu_pinned_bytes() - default.device.gpu_pinned_bytes(),
            uzram_gpu::GpuConfig::pinned_bytes_per_slot(DEFAULT_GPU_SLOT_PAGES)
        );
        // nvCOMP's zstd on any device's algorithm; its slot counts too.
        for algorithm in ["lz4", "zstd"] {
            let text = format!(
                "size = \"1G\"\ncompression-algorithm = \"{algorithm}\"\n\
                 recompress-algorithm = \"zstd-gpu\"\n"
            );
            let nv = parse(&text).unwrap();
            assert_eq!(
                nv.device.recompress.unwrap().codec,
                RecompressCodec::GpuZstd
            );
            assert_eq!(
                nv.device.gpu_pinned_bytes(),
                uzram_gpu::NvcompZstd::pinned_bytes_for(DEFAULT_GPU_SLOT_PAGES)
            );
        }
        // The dictionary parse on any device's algorithm (its objects are marked
        // recompressed); its slot counts too.
        for algorithm in ["lz4", "zstd"] {
            let text = format!(
                "size = \"1G\"\ncompression-algorithm = \"{algorithm}\"\n\
                 recompress-algorithm = \"lz4-gpu-dict\"\n"
            );
            let dict = parse(&text).unwrap();
            assert_eq!(
                dict.device.recompress.unwrap().codec,
                RecompressCodec::GpuLz4Dict
            );
            assert_eq!(
                dict.device.gpu_pinned_bytes(),
                uzram_gpu::GpuDictLz4::pinned_bytes_for(DEFAULT_GPU_SLOT_PAGES)
            );
        }
        assert_eq!(parse("size = \"1G\"\n").unwrap().device.recompress, None);
        for (text, want) in [
            (
                "recompress-algorithm = \"lz4\"",
                "use zstd, zstd:LEVEL (1-22), zstd-gpu, lz4-gpu or lz4-gpu-dict",
            ),
            (
                "checksums = false\nrecompress-algorithm = \"lz4-gpu-dict\"",
                "lz4-gpu-dict needs checksums",
            ),
            (
                "checksums = false\nbackend = \"gpu\"",
                "backend gpu needs checksums",
            ),
            (
                "compression-algorithm = \"zstd\"\nrecompress-algorithm = \"lz4-gpu\"",
                "use it with algorithm lz4",
            ),
            ("recompress-idle-age = \"1h\"", "need recompress-algorithm"),
            (
                "recompress-algorithm = \"zstd\"\nrecompress-idle-age = \"soon\"",
                "bad age",
            ),
            (
                "recompress-algorithm = \"zstd\"\nrecompress-idle-age = \"90d\"",
                "bad age",
            ),
            (
                "recompress-algorithm = \"zstd\"\nrecompress-threshold = 5000",
                "recompress-threshold",
            ),
        ] {
            let err = parse(&format!("size = \"1G\"\n{text}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
        assert_eq!(crate::config::parse_age("10m").unwrap(), 10);
        assert_eq!(crate::config::parse_age("2h").unwrap(), 120);
        assert_eq!(crate::config::parse_age("0").unwrap(), 0);
        assert_eq!(crate::config::parse_age("1d").unwrap(), 1440);
    }
}

//! Validated device configuration, from `uzram create` arguments or a TOML file for `uzram run`.
//!
//! The TOML file uses zram-generator's vocabulary where it has one (`zram-size`,
//! `compression-algorithm`, `swap-priority`, `options`, `fs-type`), plus `mem-limit`, `backend`,
//! `queues`, `depth`, `queue-mode` and `id`. Unknown keys are errors, so a typo never silently
//! does nothing.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use uzram_core::codec::Algorithm;

use crate::daemon::queue_mode::QueueModeChoice;
use crate::size::{parse_size, SizeError};

/// Most hardware queues a device may have (the kernel's `UBLK_MAX_NR_QUEUES`).
pub const MAX_QUEUES: u16 = 4096;
/// Deepest queue the kernel accepts (`UBLK_MAX_QUEUE_DEPTH`).
pub const MAX_DEPTH: u16 = 4096;
/// Default queue depth (each tag holds a locked 128 KiB buffer: 8 MiB per queue).
pub const DEFAULT_DEPTH: u16 = 64;
/// Highest device id uzram accepts (the kernel allows ids below 2^20).
pub const MAX_ID: u32 = (1 << 20) - 1;

/// Where page compression runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Compress inline on the queue threads.
    Cpu,
    /// Compress in batches on an NVIDIA GPU.
    Gpu,
    /// The GPU when one is usable, else the CPU.
    Auto,
}

impl Backend {
    /// Parses `cpu`, `gpu` or `auto`.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "gpu" => Ok(Backend::Gpu),
            "auto" => Ok(Backend::Auto),
            other => Err(ConfigError::UnknownBackend(other.to_string())),
        }
    }

    /// The backend that will serve writes here: `cpu` or `gpu`.
    ///
    /// `gpu` needs an NVIDIA GPU and driver and LZ4 (the GPU kernel speaks LZ4 only); `auto`
    /// is `gpu` where that holds and `cpu` elsewhere.
    pub fn resolve(self, algorithm: Algorithm) -> Result<Backend, ConfigError> {
        match self {
            Backend::Cpu => Ok(Backend::Cpu),
            Backend::Gpu if algorithm != Algorithm::Lz4 => Err(ConfigError::GpuNeedsLz4),
            Backend::Gpu => uzram_gpu::probe()
                .map(|_| Backend::Gpu)
                .map_err(|e| ConfigError::GpuUnavailable(e.to_string())),
            Backend::Auto if algorithm == Algorithm::Lz4 && uzram_gpu::gpu_available() => {
                Ok(Backend::Gpu)
            }
            Backend::Auto => Ok(Backend::Cpu),
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A size or memory limit did not parse.
    #[error("bad {what}")]
    Size {
        /// Which setting.
        what: &'static str,
        /// Why.
        #[source]
        source: SizeError,
    },
    /// The algorithm is not one uzram knows.
    #[error("unknown compression algorithm {0:?}: use lz4, zstd or zstd:LEVEL (1-22)")]
    UnknownAlgorithm(String),
    /// The backend is not cpu, gpu or auto.
    #[error("unknown backend {0:?}: use cpu, gpu or auto")]
    UnknownBackend(String),
    /// The queue mode is not one uzram knows.
    #[error("unknown queue mode {0:?}: use {names}", names = QueueModeChoice::NAMES)]
    UnknownQueueMode(String),
    /// `--backend gpu` where no GPU or driver is usable.
    #[error(
        "the gpu backend is not available: {0}; use --backend cpu, or --backend auto to use \
         a GPU only where there is one"
    )]
    GpuUnavailable(String),
    /// `--backend gpu` with an algorithm other than LZ4.
    #[error("the gpu backend compresses lz4 only: use --algorithm lz4 with --backend gpu")]
    GpuNeedsLz4,
    /// A number is out of its range.
    #[error("{what} must be between {min} and {max}, got {value}")]
    OutOfRange {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: i64,
        /// Smallest allowed.
        min: i64,
        /// Largest allowed.
        max: i64,
    },
    /// The config file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML for uzram.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The config file lacks a required key.
    #[error("config file {path}: missing `zram-size` (or `size`)")]
    MissingSize {
        /// The file.
        path: PathBuf,
    },
    /// A setting is given twice under two names.
    #[error("config file {path}: give only one of `zram-size` and `size`")]
    DuplicateSize {
        /// The file.
        path: PathBuf,
    },
    /// `fs-type` other than swap.
    #[error("config file {path}: fs-type {fs_type:?} is not supported (only \"swap\")")]
    FsType {
        /// The file.
        path: PathBuf,
        /// The value given.
        fs_type: String,
    },
}

/// Everything a daemon needs to serve one device, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceConfig {
    /// Device size in bytes, a whole number of pages.
    pub size: u64,
    /// Compression algorithm.
    pub algorithm: Algorithm,
    /// Backend as asked for (`auto` is kept so `list` shows what the user chose).
    pub backend: Backend,
    /// Hardware queues.
    pub queues: u16,
    /// Depth of each queue.
    pub depth: u16,
    /// How requests reach the queue threads (`auto`: the fastest the kernel offers).
    pub queue_mode: QueueModeChoice,
    /// Memory limit in bytes for compressed data, if any.
    pub mem_limit: Option<u64>,
    /// Device id to ask the kernel for; `None` lets it pick.
    pub id: Option<u32>,
}

/// `swapon -o` options when the config file names none (zram-generator's default).
pub const DEFAULT_SWAP_OPTIONS: &str = "discard";

/// Swap settings from a config file (used by `uzram swap-on`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SwapConfig {
    /// `swapon -p`; `None` leaves the kernel's default.
    pub priority: Option<i32>,
    /// `swapon -o` options, e.g. `discard`.
    pub options: Option<String>,
}

/// Raw settings before validation (CLI flags and file keys both land here).
#[derive(Debug, Default, Clone)]
pub struct RawDevice {
    /// Size text.
    pub size: String,
    /// Algorithm text.
    pub algorithm: Option<String>,
    /// Backend text.
    pub backend: Option<String>,
    /// Queues.
    pub queues: Option<u64>,
    /// Depth.
    pub depth: Option<u64>,
    /// Queue mode text.
    pub queue_mode: Option<String>,
    /// Memory limit text.
    pub mem_limit: Option<String>,
    /// Device id.
    pub id: Option<u64>,
}

/// The default queue count: one per CPU, at most 4.
pub fn default_queues() -> u16 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.min(4) as u16
}

fn ranged(what: &'static str, value: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::OutOfRange {
            what,
            value: i64::try_from(value).unwrap_or(i64::MAX),
            min: min as i64,
            max: max as i64,
        })
    }
}

impl RawDevice {
    /// Validates every field; the first bad one is the error.
    pub fn validate(&self) -> Result<DeviceConfig, ConfigError> {
        let size = parse_size(&self.size).map_err(|source| ConfigError::Size {
            what: "device size",
            source,
        })?;
        let algorithm_text = self.algorithm.as_deref().unwrap_or("lz4");
        let algorithm = Algorithm::parse(algorithm_text)
            .map_err(|_| ConfigError::UnknownAlgorithm(algorithm_text.to_string()))?;
        let backend = Backend::parse(self.backend.as_deref().unwrap_or("cpu"))?;
        backend.resolve(algorithm)?;
        let queues = match self.queues {
            Some(q) => ranged("queues", q, 1, MAX_QUEUES.into())? as u16,
            None => default_queues(),
        };
        let depth = match self.depth {
            Some(d) => ranged("depth", d, 1, MAX_DEPTH.into())? as u16,
            None => DEFAULT_DEPTH,
        };
        let queue_mode = match self.queue_mode.as_deref() {
            Some(text) => QueueModeChoice::parse(text)
                .ok_or_else(|| ConfigError::UnknownQueueMode(text.to_string()))?,
            None => QueueModeChoice::Auto,
        };
        let mem_limit = self
            .mem_limit
            .as_deref()
            .map(parse_size)
            .transpose()
            .map_err(|source| ConfigError::Size {
                what: "memory limit",
                source,
            })?;
        let id = self
            .id
            .map(|id| ranged("id", id, 0, MAX_ID.into()))
            .transpose()?
            .map(|id| id as u32);
        Ok(DeviceConfig {
            size,
            algorithm,
            backend,
            queues,
            depth,
            queue_mode,
            mem_limit,
            id,
        })
    }
}

/// A size in a TOML file: `"8G"` or a plain number of bytes.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
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
struct FileConfig {
    zram_size: Option<SizeValue>,
    size: Option<SizeValue>,
    compression_algorithm: Option<String>,
    backend: Option<String>,
    mem_limit: Option<SizeValue>,
    swap_priority: Option<i64>,
    options: Option<String>,
    fs_type: Option<String>,
    queues: Option<u64>,
    depth: Option<u64>,
    queue_mode: Option<String>,
    id: Option<u64>,
}

/// A config file, validated: the device and its swap settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RunConfig {
    /// The device.
    pub device: DeviceConfig,
    /// How `uzram swap-on` activates it.
    pub swap: SwapConfig,
}

/// Parses config file text; `path` is only used in messages.
pub fn parse_config(path: &Path, text: &str) -> Result<RunConfig, ConfigError> {
    let file: FileConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.message().to_string(),
    })?;
    let size = match (file.zram_size, file.size) {
        (Some(s), None) | (None, Some(s)) => s.text(),
        (None, None) => {
            return Err(ConfigError::MissingSize {
                path: path.to_path_buf(),
            })
        }
        (Some(_), Some(_)) => {
            return Err(ConfigError::DuplicateSize {
                path: path.to_path_buf(),
            })
        }
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
    let raw = RawDevice {
        size,
        algorithm: file.compression_algorithm,
        backend: file.backend,
        queues: file.queues,
        depth: file.depth,
        queue_mode: file.queue_mode,
        mem_limit: file.mem_limit.map(SizeValue::text),
        id: file.id,
    };
    Ok(RunConfig {
        device: raw.validate()?,
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
    })
}

/// Reads and parses a config file.
pub fn load_config(path: &Path) -> Result<RunConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_config(path, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RunConfig, ConfigError> {
        parse_config(Path::new("test.toml"), text)
    }

    #[test]
    fn full_file_parses() {
        let cfg = parse(
            r#"
            zram-size = "8G"
            compression-algorithm = "zstd:3"
            swap-priority = 100
            mem-limit = "2G"
            backend = "auto"
            options = "discard"
            fs-type = "swap"
            queues = 2
            depth = 64
            id = 7
            "#,
        )
        .unwrap();
        assert_eq!(cfg.device.size, 8 << 30);
        assert_eq!(cfg.device.algorithm, Algorithm::Zstd { level: 3 });
        assert_eq!(cfg.device.backend, Backend::Auto);
        assert_eq!(cfg.device.mem_limit, Some(2 << 30));
        assert_eq!((cfg.device.queues, cfg.device.depth), (2, 64));
        assert_eq!(cfg.device.id, Some(7));
        assert_eq!(cfg.swap.priority, Some(100));
        assert_eq!(cfg.swap.options.as_deref(), Some("discard"));
    }

    #[test]
    fn shipped_example_parses() {
        let text = include_str!("../../../systemd/uzram.toml.example");
        let cfg = parse(text).unwrap();
        assert_eq!(cfg.device.size, 8 << 30);
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
        assert_eq!(cfg.swap.priority, None);
        assert_eq!(cfg.swap.options.as_deref(), Some(DEFAULT_SWAP_OPTIONS));
        // An empty options string turns the default off.
        let cfg = parse("size = 1048576\noptions = \"\"").unwrap();
        assert_eq!(cfg.swap.options, None);
    }

    #[test]
    fn missing_and_duplicate_size_are_refused() {
        assert!(matches!(
            parse("swap-priority = 5"),
            Err(ConfigError::MissingSize { .. })
        ));
        assert!(matches!(
            parse("size = \"1G\"\nzram-size = \"1G\""),
            Err(ConfigError::DuplicateSize { .. })
        ));
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
    fn queue_mode_defaults_to_auto_and_names_are_checked() {
        use crate::daemon::queue_mode::QueueMode;
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
}

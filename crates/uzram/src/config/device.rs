//! A device's settings, validated: what `uzram create` arguments, a TOML file, a
//! zram-generator section and a recovery record all become, through one validation
//! ([`RawDevice::validate`]).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uzram_core::codec::Algorithm;
use uzram_core::store::MAX_SLOT_PAGES;
use uzram_gpu::Parse;

use crate::footprint::Writeback;
use crate::size::{parse_size, SizeError, MAX_SIZE};
use crate::sizeexpr::ExprError;

pub use crate::footprint::{MAX_DEPTH, MAX_QUEUES};
/// Default queue depth (each tag holds a locked 128 KiB buffer: 8 MiB per queue).
pub const DEFAULT_DEPTH: u16 = 64;
/// A page's bytes, the largest recompression threshold.
const PAGE_BYTES: u64 = uzram_core::PAGE_SIZE as u64;
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

    /// The name the CLI and config file use.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Gpu => "gpu",
            Backend::Auto => "auto",
        }
    }

    /// Refuses `gpu` early (before a daemon starts) where it cannot work: an algorithm other
    /// than LZ4, or no NVIDIA driver or GPU. `auto` is decided when the device starts
    /// (`daemon::backend`), the one place that chooses.
    /// With `probe` off, only the algorithm is checked.
    pub fn check(self, algorithm: Algorithm, probe: bool) -> Result<(), ConfigError> {
        match self {
            Backend::Gpu if algorithm != Algorithm::Lz4 => Err(ConfigError::GpuNeedsLz4),
            Backend::Gpu if probe => uzram_gpu::probe()
                .map(drop)
                .map_err(|e| ConfigError::GpuUnavailable(e.to_string())),
            Backend::Gpu | Backend::Cpu | Backend::Auto => Ok(()),
        }
    }
}

/// Which GPUs the ring's slots are spread over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSelect {
    /// Every GPU the driver reports.
    All,
    /// These ordinals.
    List(Vec<usize>),
}

impl GpuSelect {
    /// Parses `all` or a comma-separated list of ordinals (`0,1`).
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        if s.trim() == "all" {
            return Ok(GpuSelect::All);
        }
        let list: Result<Vec<usize>, _> = s.split(',').map(|p| p.trim().parse()).collect();
        match list {
            Ok(v) if !v.is_empty() => {
                let mut sorted = v.clone();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() != v.len() {
                    return Err(ConfigError::Gpus(s.to_string()));
                }
                Ok(GpuSelect::List(v))
            }
            _ => Err(ConfigError::Gpus(s.to_string())),
        }
    }

    /// The ordinals, with `all` resolved against the driver.
    pub fn ordinals(&self) -> Result<Vec<usize>, uzram_gpu::GpuError> {
        match self {
            GpuSelect::All => Ok((0..uzram_gpu::probe()?).collect()),
            GpuSelect::List(v) => Ok(v.clone()),
        }
    }
}

impl std::fmt::Display for GpuSelect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuSelect::All => f.write_str("all"),
            GpuSelect::List(v) => {
                let parts: Vec<String> = v.iter().map(ToString::to_string).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

/// Default pinned host memory of the GPU ring: 7 slots of 2048 pages (staging and results).
pub const DEFAULT_GPU_MEMORY: u64 = 128 << 20;

/// How the GPU backend runs, when it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSettings {
    /// GPUs to spread slots over.
    pub gpus: GpuSelect,
    /// Page-locked host memory for the ring (staging and results), in bytes.
    pub memory: u64,
    /// The GPU's LZ4 parse. `high` by default: through the daemon it ingests as fast as
    /// `fast` at the same CPU per GiB and stores 1.05-1.10x as much per byte of memory, and
    /// its ring (25-32 GB/s) is above what a host's queue threads push (docs/bench/gpu-runs.md).
    pub parse: Parse,
    /// Threads that install the GPU's results into the store.
    pub installers: usize,
    /// Pages per slot of the ring.
    pub slot_pages: usize,
    /// Longest a queue thread that finds every slot busy waits for one before it
    /// compresses on the CPU, in microseconds (0: never waits).
    pub slot_wait_us: u64,
    /// Whether the GPU's copy engine places the checked compressed pages straight into the
    /// store's memory, which is then registered with the driver as the block pool faults it
    /// in (and no longer given back while the daemon runs), so that the installers need not
    /// copy them. Off by default: on the H100 machines of three starts it moved the GPU path's
    /// CPU per GiB by -21 % to +45 % beside off in the same call, and on the last, with its
    /// final code, it cost CPU and ingest on the swap mix (docs/bench/gpu-runs.md, runs
    /// 309-311).
    pub place: bool,
}

/// Default pages per slot of the GPU ring.
pub const DEFAULT_GPU_SLOT_PAGES: usize = 2048;

/// Default installer threads of the GPU ring.
pub const DEFAULT_GPU_INSTALLERS: usize = 4;
/// Most installer threads of the GPU ring.
pub const MAX_GPU_INSTALLERS: u64 = 64;

/// Default wait for a free slot of the GPU ring, µs: about a slot's install time. Waiting
/// costs no CPU; compressing on the CPU instead costs several times the GPU path's CPU per
/// page (docs/bench/gpu-runs.md). A waiting queue thread holds back the other
/// requests of its queue, hence the cap.
pub const DEFAULT_GPU_SLOT_WAIT_US: u64 = 2000;
/// Longest allowed wait for a free slot, µs.
pub const MAX_GPU_SLOT_WAIT_US: u64 = 100_000;

impl Default for GpuSettings {
    fn default() -> Self {
        Self {
            gpus: GpuSelect::List(vec![0]),
            memory: DEFAULT_GPU_MEMORY,
            parse: Parse::High,
            installers: DEFAULT_GPU_INSTALLERS,
            slot_pages: DEFAULT_GPU_SLOT_PAGES,
            slot_wait_us: DEFAULT_GPU_SLOT_WAIT_US,
            place: false,
        }
    }
}

/// A queue mode the daemon can serve with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueMode {
    /// `UBLK_F_BATCH_IO`: batched prepare/fetch/commit, one thread per queue.
    Batch,
    /// `UBLK_F_PER_IO_DAEMON`: several threads per queue.
    PerIoDaemon,
    /// One thread per queue, one command per request.
    PerQueue,
}

impl QueueMode {
    /// The name `uzram status` shows and `--queue-mode` takes.
    pub fn name(self) -> &'static str {
        match self {
            QueueMode::Batch => "batch",
            QueueMode::PerIoDaemon => "per-io-daemon",
            QueueMode::PerQueue => "per-queue",
        }
    }
}

impl fmt::Display for QueueMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the user asked for: a mode by name, or the fastest one the kernel offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueModeChoice {
    /// The fastest mode the kernel offers.
    #[default]
    Auto,
    /// This mode, or an error where the kernel lacks it.
    Exactly(QueueMode),
}

impl QueueModeChoice {
    /// Every value `--queue-mode` takes.
    pub const NAMES: &'static str = "auto, batch, per-io-daemon or per-queue";

    /// Parses `auto`, `batch`, `per-io-daemon` or `per-queue`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "auto" => QueueModeChoice::Auto,
            "batch" => QueueModeChoice::Exactly(QueueMode::Batch),
            "per-io-daemon" => QueueModeChoice::Exactly(QueueMode::PerIoDaemon),
            "per-queue" => QueueModeChoice::Exactly(QueueMode::PerQueue),
            _ => return None,
        })
    }
}

impl fmt::Display for QueueModeChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QueueModeChoice::Auto => f.write_str("auto"),
            QueueModeChoice::Exactly(mode) => mode.fmt(f),
        }
    }
}

/// Whether requests' data moves by ublk's user copy (`UBLK_F_USER_COPY`, Linux 6.5): the
/// kernel copies a request's data only when the daemon asks, so a write goes straight into
/// the GPU ring's staging (`ublk/user_copy.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UserCopy {
    /// On where writes go to a GPU (`backend = "gpu"`) at up to 4 queues and the kernel
    /// offers it.
    #[default]
    Auto,
    /// Always; refused where the kernel lacks it or with `queue-mode = "batch"`.
    On,
    /// Never: the kernel copies every request's data into its tag's buffer.
    Off,
}

impl UserCopy {
    /// Every value `--user-copy` takes.
    pub const NAMES: &'static str = "auto, on or off";

    /// Parses `auto`, `on` or `off`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "auto" => UserCopy::Auto,
            "on" => UserCopy::On,
            "off" => UserCopy::Off,
            _ => return None,
        })
    }
}

impl fmt::Display for UserCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UserCopy::Auto => "auto",
            UserCopy::On => "on",
            UserCopy::Off => "off",
        })
    }
}

/// Where the queue threads run (`queue-affinity`). libublk pins each to the CPUs the
/// kernel maps to its queue; `auto` keeps that for the cpu backend and lets them run on any
/// CPU with the gpu backend, whose installer threads share those CPUs
/// (`ublk::placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueAffinity {
    /// Pinned for the cpu backend, anywhere for the gpu backend.
    #[default]
    Auto,
    /// Each on its queue's CPUs, as libublk pins them.
    Kernel,
    /// On any CPU the daemon may use.
    Any,
}

impl QueueAffinity {
    /// Every value `--queue-affinity` takes.
    pub const NAMES: &'static str = "auto, kernel or any";

    /// Parses `auto`, `kernel` or `any`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "auto" => QueueAffinity::Auto,
            "kernel" => QueueAffinity::Kernel,
            "any" => QueueAffinity::Any,
            _ => return None,
        })
    }

    /// Where the queue threads go when `gpu` says whether the gpu backend serves writes.
    pub fn placement(self, gpu: bool) -> crate::ublk::placement::Placement {
        use crate::ublk::placement::Placement;
        match self {
            QueueAffinity::Auto => Placement::for_backend(gpu),
            QueueAffinity::Kernel => Placement::Kernel,
            QueueAffinity::Any => Placement::Anywhere,
        }
    }
}

impl fmt::Display for QueueAffinity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QueueAffinity::Auto => "auto",
            QueueAffinity::Kernel => "kernel",
            QueueAffinity::Any => "any",
        })
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
    /// The user copy setting is not auto, on or off.
    #[error("unknown user-copy {0:?}: use {names}", names = UserCopy::NAMES)]
    UnknownUserCopy(String),
    /// The queue affinity is not auto, kernel or any.
    #[error("unknown queue-affinity {0:?}: use {names}", names = QueueAffinity::NAMES)]
    UnknownQueueAffinity(String),
    /// `--backend gpu` where no GPU or driver is usable.
    #[error(
        "the gpu backend is not available: {0}; use --backend cpu, or --backend auto to use \
         a GPU only where there is one"
    )]
    GpuUnavailable(String),
    /// `--backend gpu` with an algorithm other than LZ4.
    #[error("the gpu backend compresses lz4 only: use --algorithm lz4 with --backend gpu")]
    GpuNeedsLz4,
    /// `gpus` is neither `all` nor a list of distinct ordinals.
    #[error("bad gpus {0:?}: use all, or GPU numbers separated by commas (0,1)")]
    Gpus(String),
    /// `gpu-parse` is neither `fast` nor `high`.
    #[error("bad gpu-parse {0:?}: use fast or high")]
    GpuParse(String),
    /// `gpu-memory` is too small for a ring.
    #[error("gpu-memory: {0}")]
    GpuMemory(String),
    /// The device would lock more memory up front than the host can spare.
    #[error(
        "a device of {size} with these settings locks {total} before it stores a page (page \
         table {table}, recovery room {room}, heap and I/O buffers {buffers}, GPU ring {gpu}, \
         backing device records {backing}); uzram holds that to 1/{divisor} of this host's \
         {ram} of RAM ({most}): {advice}"
    )]
    TooLarge {
        /// The device size.
        size: crate::size::Human,
        /// Everything locked up front.
        total: crate::size::Human,
        /// Page table, directory and block states.
        table: crate::size::Human,
        /// The recovery room.
        room: crate::size::Human,
        /// Heap reserve and I/O buffers.
        buffers: crate::size::Human,
        /// GPU pinned memory.
        gpu: crate::size::Human,
        /// The backing device's per-block records.
        backing: crate::size::Human,
        /// The share's divisor.
        divisor: u64,
        /// The host's RAM.
        ram: crate::size::Human,
        /// The most allowed.
        most: crate::size::Human,
        /// What to do.
        advice: String,
    },
    /// `mem-limit` is below what the store holds from the start.
    #[error(
        "mem-limit {limit} is below the {table} page table of a device of {size}: raise it \
         (zram counts its table in mem_used_total too), or leave it out"
    )]
    MemLimitBelowTable {
        /// The limit.
        limit: crate::size::Human,
        /// The page table.
        table: crate::size::Human,
        /// The device size.
        size: crate::size::Human,
    },
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
    /// A setting is given twice under two names.
    #[error("config file {path}: give only one of `{a}` and `{b}`")]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// One name.
        a: &'static str,
        /// The other.
        b: &'static str,
    },
    /// A `zram-size` or `zram-resident-limit` expression was refused.
    #[error("config file {path}: {why}")]
    Expr {
        /// The file.
        path: PathBuf,
        /// Why (names the key). In the message, and so not a `source` as well: a message
        /// chain would print it twice.
        why: ExprError,
    },
    /// An expression's result is beyond what uzram serves.
    #[error(
        "config file {path}: {key} = {expr:?} is {mib} MiB with ram = {ram_mib}, above the 16T \
         maximum; {key} is in MiB, as in zram-generator (and G there means 10^9): for 8 GiB \
         write {key} = 8192, or {} = \"8G\"", if *key == "zram-size" { "size" } else { "mem-limit" }
    )]
    ExprTooLarge {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// The text.
        expr: String,
        /// Its value.
        mib: f64,
        /// `ram` it was evaluated with.
        ram_mib: u64,
    },
    /// `host-memory-limit` is not a number of MiB or "none".
    #[error(
        "config file {path}: host-memory-limit = {value:?}: expected a number of MiB or \"none\""
    )]
    HostMemoryLimit {
        /// The file.
        path: PathBuf,
        /// The value given.
        value: String,
    },
    /// `metrics-textfile` is not a usable path.
    #[error("metrics-textfile {path:?}: {why}")]
    MetricsTextfile {
        /// The value given.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The host's MemTotal (zram-generator's `ram`) could not be read.
    #[error("cannot read MemTotal from /proc/meminfo (needed for ram in size expressions)")]
    MemInfo,
    /// `zram-generator:zramN` names a section that no file has.
    #[error(
        "zram-generator's configuration has no [{name}] section ({})",
        if files.is_empty() {
            "there is no zram-generator.conf, nor a drop-in in zram-generator.conf.d".to_string()
        } else {
            format!("files read: {}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "))
        }
    )]
    NoSection {
        /// The section.
        name: String,
        /// The files read.
        files: Vec<PathBuf>,
    },
    /// An age (`recompress-idle-age`, `uzram idle --age`) that does not parse.
    #[error("bad age {0:?}: give a number with s, m, h or d (30s, 10m, 1h, 2d), at most 17 days")]
    Age(String),
    /// A recompression algorithm uzram cannot write.
    #[error(
        "recompress-algorithm {0:?}: recompression writes zstd or the GPU's LZ4: use zstd, zstd:LEVEL (1-22), zstd-gpu, lz4-gpu or lz4-gpu-dict"
    )]
    RecompressAlgorithm(String),
    /// `recompress-algorithm = "lz4-gpu-dict"` with `checksums = false`.
    #[error("recompress-algorithm lz4-gpu-dict needs checksums: a page decoded with a damaged dictionary must fail its check, so leave checksums on (the default)")]
    RecompressDictNeedsChecksums,
    /// `backend = "gpu"` with `checksums = false`.
    #[error("backend gpu needs checksums: a page the GPU compressed is installed only once its check matches the checksum taken when it was staged, so leave checksums on (the default), or use backend cpu or auto")]
    GpuNeedsChecksums,
    /// `writeback-idle-age` or `writeback-limit` without `writeback-device`.
    #[error(
        "writeback-idle-age and writeback-limit need writeback-device (a partition or a file path)"
    )]
    WritebackWithout,
    /// A `writeback-limit` that does not parse.
    #[error("writeback-limit {0:?}: give SIZE/day (e.g. 1G/day, 512M/day) or none")]
    WritebackLimit(String),
    /// A `writeback-device` that is no absolute path.
    #[error("writeback-device {0:?} is not an absolute path (e.g. /dev/sdb2 or /var/lib/uzram/swap0.wb)")]
    WritebackPath(PathBuf),
    /// A `writeback-device` that the unit's drop-in cannot name safely, or whose directory
    /// the daemon must not be given.
    #[error("writeback-device {path:?} {why}")]
    WritebackPathUnsafe {
        /// The path.
        path: PathBuf,
        /// Why it is refused.
        why: &'static str,
    },
    /// `recompress-algorithm = "lz4-gpu"` on a device that does not store LZ4.
    #[error("recompress-algorithm lz4-gpu rewrites LZ4 pages: use it with algorithm lz4, or recompress with zstd")]
    RecompressGpuNeedsLz4,
    /// `recompress-idle-age` or `recompress-threshold` without `recompress-algorithm`.
    #[error("recompress-idle-age and recompress-threshold need recompress-algorithm (e.g. zstd)")]
    RecompressWithout,
    /// A zram-generator key that uzram cannot honour for this device.
    #[error("config file {path}: {why}")]
    Unsupported {
        /// The file or section.
        path: PathBuf,
        /// The key.
        key: String,
        /// Why, and what to do.
        why: String,
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
    /// Whether requests' data moves by ublk's user copy.
    pub user_copy: UserCopy,
    /// Where the queue threads run.
    pub queue_affinity: QueueAffinity,
    /// Memory limit in bytes for compressed data, if any.
    pub mem_limit: Option<u64>,
    /// Device id to ask the kernel for; `None` lets it pick.
    pub id: Option<u32>,
    /// The GPU ring, for `gpu` and `auto`.
    pub gpu: GpuSettings,
    /// Where the daemon rewrites its Prometheus metrics every 15 s, if anywhere.
    pub metrics_textfile: Option<PathBuf>,
    /// A checksum with every stored page, checked on every read (off only to measure it).
    pub checksums: bool,
    /// Pages that go unused are recompressed in the background, if set.
    pub recompress: Option<RecompressSettings>,
    /// Pages that go unused are written back to a file or partition, if set.
    pub writeback: Option<WritebackSettings>,
}

/// Writeback to a backing device (`writeback-*` keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritebackSettings {
    /// The partition, or the file (created 0600 if absent).
    pub device: PathBuf,
    /// Minutes a page goes unused before the daemon writes it back.
    pub idle_age_minutes: u32,
    /// Bytes writeback may write to the device per UTC day (`None`: no limit).
    pub limit_per_day: Option<u64>,
}

/// `writeback-idle-age` when none is given: Android's idle age.
pub const DEFAULT_WRITEBACK_IDLE_AGE: &str = "1h";
/// `writeback-limit` when none is given.
pub const DEFAULT_WRITEBACK_LIMIT: &str = "1G/day";

/// A `writeback-limit`: `SIZE/day` in bytes, or `none`.
pub fn parse_writeback_limit(text: &str) -> Result<Option<u64>, ConfigError> {
    let t = text.trim();
    if t == "none" {
        return Ok(None);
    }
    let bad = || ConfigError::WritebackLimit(text.to_string());
    let size = t.strip_suffix("/day").ok_or_else(bad)?;
    let bytes = parse_size(size).map_err(|_| bad())?;
    Ok(Some(bytes))
}

/// What recompression writes (`recompress-algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecompressCodec {
    /// zstd at this level (`zstd`, `zstd:N`).
    Zstd {
        /// zstd's level.
        level: i32,
    },
    /// LZ4 again, from an NVIDIA GPU's `high` parse (`lz4-gpu`; the device's algorithm
    /// must be lz4).
    GpuLz4,
    /// zstd frames from NVIDIA nvCOMP's batched zstd on the GPU (`zstd-gpu`).
    GpuZstd,
    /// LZ4 with a dictionary trained on the device's own pages, from an NVIDIA GPU
    /// (`lz4-gpu-dict`; the device must keep checksums).
    GpuLz4Dict,
}

impl RecompressCodec {
    /// Its name, as `recompress-algorithm` spells it.
    pub fn name(self) -> String {
        match self {
            Self::Zstd { level } => format!("zstd:{level}"),
            Self::GpuLz4 => "lz4-gpu".into(),
            Self::GpuZstd => "zstd-gpu".into(),
            Self::GpuLz4Dict => "lz4-gpu-dict".into(),
        }
    }
}

/// The cold tier's recompression (`recompress-*` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecompressSettings {
    /// What it writes.
    pub codec: RecompressCodec,
    /// Minutes a page goes unused before it is recompressed (the store's clock ticks once a
    /// minute).
    pub idle_age_minutes: u32,
    /// Only objects of at least this many bytes (zram's `threshold=`).
    pub threshold: usize,
}

/// `recompress-idle-age` when none is given: Android's idle age.
pub const DEFAULT_RECOMPRESS_IDLE_AGE: &str = "1h";

/// An age as `uzram` takes it: a number with `s`, `m`, `h` or `d` (minutes without one), in
/// whole minutes, rounded up (the store's clock ticks once a minute).
pub fn parse_age(text: &str) -> Result<u32, ConfigError> {
    let bad = || ConfigError::Age(text.to_string());
    let t = text.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, "m"),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "s" => n,
        "m" | "min" => n.checked_mul(60).ok_or_else(bad)?,
        "h" => n.checked_mul(3600).ok_or_else(bad)?,
        "d" => n.checked_mul(86_400).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    let minutes = seconds.div_ceil(60);
    if minutes > u64::from(uzram_core::store::MAX_AGE) {
        return Err(bad());
    }
    Ok(minutes as u32)
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

/// Raw settings before validation (CLI flags and file keys both land here, and a device's
/// recovery record keeps them: a recovery validates them again, as a config file).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// User copy text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_copy: Option<String>,
    /// Queue affinity text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_affinity: Option<String>,
    /// Memory limit text.
    pub mem_limit: Option<String>,
    /// Device id.
    pub id: Option<u64>,
    /// GPUs text.
    pub gpus: Option<String>,
    /// GPU ring pinned memory text.
    pub gpu_memory: Option<String>,
    /// GPU parse text.
    pub gpu_parse: Option<String>,
    /// GPU ring installer threads.
    pub gpu_installers: Option<u64>,
    /// Wait for a free GPU ring slot, µs.
    pub gpu_slot_wait_us: Option<u64>,
    /// Pages per GPU ring slot.
    pub gpu_slot_pages: Option<u64>,
    /// Whether the GPU's copy engine places compressed pages in the store (default off).
    #[serde(default)]
    pub gpu_place: Option<bool>,
    /// Metrics text file.
    pub metrics_textfile: Option<PathBuf>,
    /// Page checksums (default on).
    #[serde(default)]
    pub checksums: Option<bool>,
    /// Recompression algorithm text (zstd, zstd:N, zstd-gpu or lz4-gpu).
    #[serde(default)]
    pub recompress_algorithm: Option<String>,
    /// Recompression idle age text (10m, 1h, ...).
    #[serde(default)]
    pub recompress_idle_age: Option<String>,
    /// Recompress only objects of at least this many bytes.
    #[serde(default)]
    pub recompress_threshold: Option<u64>,
    /// Backing file or partition for writeback.
    #[serde(default)]
    pub writeback_device: Option<PathBuf>,
    /// Writeback idle age text (10m, 1h, ...).
    #[serde(default)]
    pub writeback_idle_age: Option<String>,
    /// Writeback budget text (1G/day, none).
    #[serde(default)]
    pub writeback_limit: Option<String>,
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
    /// Validates every field, and the device as a whole against `host`; the first bad one is
    /// the error. The daemon's own validation: `create`, `check-config`, `run` and a
    /// recovery all go through here.
    pub fn validate(&self, host: Host) -> Result<DeviceConfig, ConfigError> {
        let size = parse_size(&self.size).map_err(|source| ConfigError::Size {
            what: "device size",
            source,
        })?;
        let algorithm_text = self.algorithm.as_deref().unwrap_or("lz4");
        let algorithm = Algorithm::parse(algorithm_text)
            .map_err(|_| ConfigError::UnknownAlgorithm(algorithm_text.to_string()))?;
        let backend = Backend::parse(self.backend.as_deref().unwrap_or("cpu"))?;
        if backend == Backend::Gpu && self.checksums == Some(false) {
            return Err(ConfigError::GpuNeedsChecksums);
        }
        backend.check(algorithm, host.probe_gpu)?;
        let gpu = self.gpu_settings()?;
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
        let user_copy = match self.user_copy.as_deref() {
            Some(text) => UserCopy::parse(text)
                .ok_or_else(|| ConfigError::UnknownUserCopy(text.to_string()))?,
            None => UserCopy::Auto,
        };
        let queue_affinity = match self.queue_affinity.as_deref() {
            Some(text) => QueueAffinity::parse(text)
                .ok_or_else(|| ConfigError::UnknownQueueAffinity(text.to_string()))?,
            None => QueueAffinity::Auto,
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
        if let Some(path) = &self.metrics_textfile {
            check_metrics_textfile(path)?;
        }
        let cfg = DeviceConfig {
            size,
            algorithm,
            backend,
            queues,
            depth,
            queue_mode,
            user_copy,
            queue_affinity,
            mem_limit,
            id,
            gpu,
            metrics_textfile: self.metrics_textfile.clone(),
            checksums: self.checksums.unwrap_or(true),
            recompress: self.recompress_settings(algorithm, self.checksums.unwrap_or(true))?,
            writeback: self.writeback_settings()?,
        };
        cfg.check_memory(host)?;
        Ok(cfg)
    }

    fn writeback_settings(&self) -> Result<Option<WritebackSettings>, ConfigError> {
        let Some(device) = &self.writeback_device else {
            if self.writeback_idle_age.is_some() || self.writeback_limit.is_some() {
                return Err(ConfigError::WritebackWithout);
            }
            return Ok(None);
        };
        if !device.is_absolute() {
            return Err(ConfigError::WritebackPath(device.clone()));
        }
        if let Some(why) = unsafe_writeback_path(device) {
            return Err(ConfigError::WritebackPathUnsafe {
                path: device.clone(),
                why,
            });
        }
        let idle_age_minutes = parse_age(
            self.writeback_idle_age
                .as_deref()
                .unwrap_or(DEFAULT_WRITEBACK_IDLE_AGE),
        )?;
        let limit_per_day = parse_writeback_limit(
            self.writeback_limit
                .as_deref()
                .unwrap_or(DEFAULT_WRITEBACK_LIMIT),
        )?;
        Ok(Some(WritebackSettings {
            device: device.clone(),
            idle_age_minutes,
            limit_per_day,
        }))
    }

    fn recompress_settings(
        &self,
        algorithm: Algorithm,
        checksums: bool,
    ) -> Result<Option<RecompressSettings>, ConfigError> {
        let Some(text) = &self.recompress_algorithm else {
            if self.recompress_idle_age.is_some() || self.recompress_threshold.is_some() {
                return Err(ConfigError::RecompressWithout);
            }
            return Ok(None);
        };
        let text = match text.as_str() {
            "zstd" => format!("zstd:{}", uzram_core::store::DEFAULT_RECOMPRESS_LEVEL),
            other => other.to_string(),
        };
        let codec = match Algorithm::parse(&text) {
            Ok(Algorithm::Zstd { level }) => RecompressCodec::Zstd { level },
            _ if text == "zstd-gpu" => RecompressCodec::GpuZstd,
            _ if text == "lz4-gpu" && algorithm == Algorithm::Lz4 => RecompressCodec::GpuLz4,
            _ if text == "lz4-gpu" => return Err(ConfigError::RecompressGpuNeedsLz4),
            _ if text == "lz4-gpu-dict" && checksums => RecompressCodec::GpuLz4Dict,
            _ if text == "lz4-gpu-dict" => return Err(ConfigError::RecompressDictNeedsChecksums),
            _ => return Err(ConfigError::RecompressAlgorithm(text)),
        };
        let idle_age_minutes = parse_age(
            self.recompress_idle_age
                .as_deref()
                .unwrap_or(DEFAULT_RECOMPRESS_IDLE_AGE),
        )?;
        let threshold = match self.recompress_threshold {
            Some(t) => ranged("recompress-threshold", t, 0, PAGE_BYTES)? as usize,
            None => 0,
        };
        Ok(Some(RecompressSettings {
            codec,
            idle_age_minutes,
            threshold,
        }))
    }

    fn gpu_settings(&self) -> Result<GpuSettings, ConfigError> {
        let mut gpu = GpuSettings::default();
        if let Some(g) = &self.gpus {
            gpu.gpus = GpuSelect::parse(g)?;
        }
        if let Some(n) = self.gpu_slot_pages {
            gpu.slot_pages = ranged("gpu-slot-pages", n, 1, MAX_SLOT_PAGES as u64)? as usize;
        }
        if let Some(m) = &self.gpu_memory {
            gpu.memory = parse_size(m).map_err(|source| ConfigError::Size {
                what: "gpu-memory",
                source,
            })?;
        }
        uzram_gpu::GpuConfig::for_pinned_budget(gpu.memory, gpu.slot_pages)
            .map_err(|e| ConfigError::GpuMemory(e.to_string()))?;
        if let Some(p) = &self.gpu_parse {
            gpu.parse = p.parse().map_err(|_| ConfigError::GpuParse(p.clone()))?;
        }
        if let Some(n) = self.gpu_installers {
            gpu.installers = ranged("gpu-installers", n, 1, MAX_GPU_INSTALLERS)? as usize;
        }
        if let Some(us) = self.gpu_slot_wait_us {
            gpu.slot_wait_us = ranged("gpu-slot-wait-us", us, 0, MAX_GPU_SLOT_WAIT_US)?;
        }
        if let Some(place) = self.gpu_place {
            gpu.place = place;
        }
        Ok(gpu)
    }
}

impl DeviceConfig {
    /// Pinned host memory the GPU ring (none on the CPU backend) and the GPU recompressor
    /// (`recompress-algorithm = "lz4-gpu"`, `"lz4-gpu-dict"` or `"zstd-gpu"`, a slot of its
    /// own) take.
    pub fn gpu_pinned_bytes(&self) -> u64 {
        let ring = match self.backend {
            Backend::Cpu => 0,
            Backend::Gpu | Backend::Auto => self.gpu.memory,
        };
        let recompressor = match self.recompress.map(|r| r.codec) {
            Some(RecompressCodec::GpuLz4) => {
                uzram_gpu::GpuConfig::pinned_bytes_per_slot(DEFAULT_GPU_SLOT_PAGES)
            }
            Some(RecompressCodec::GpuZstd) => {
                uzram_gpu::NvcompZstd::pinned_bytes_for(DEFAULT_GPU_SLOT_PAGES)
            }
            Some(RecompressCodec::GpuLz4Dict) => {
                uzram_gpu::GpuDictLz4::pinned_bytes_for(DEFAULT_GPU_SLOT_PAGES)
            }
            Some(RecompressCodec::Zstd { .. }) | None => 0,
        };
        ring + recompressor
    }

    /// The device's up-front memory against what `host` can hold, and the memory limit
    /// against the page table.
    fn check_memory(&self, host: Host) -> Result<(), ConfigError> {
        use crate::size::Human;
        let pages = self.size / uzram_core::PAGE_SIZE as u64;
        let table = uzram_core::PageStore::table_bytes_for(pages).unwrap_or(u64::MAX);
        if let Some(limit) = self.mem_limit.filter(|&l| l < table) {
            return Err(ConfigError::MemLimitBelowTable {
                limit: Human(limit),
                table: Human(table),
                size: Human(self.size),
            });
        }
        let writeback = match self.writeback {
            Some(_) => Writeback::File,
            None => Writeback::None,
        };
        self.check_upfront(host, writeback)
    }

    /// The up-front memory again once the backing device is open and its `blocks` are
    /// known: a partition (or a file made larger than this device needs) may hold far more
    /// blocks than the device has pages, and each costs locked records
    /// ([`crate::footprint::backing_bytes`]).
    pub fn check_backing_memory(&self, host: Host, blocks: u64) -> Result<(), ConfigError> {
        self.check_upfront(host, Writeback::Blocks(blocks))
    }

    fn check_upfront(&self, host: Host, writeback: Writeback) -> Result<(), ConfigError> {
        use crate::footprint::{Upfront, MAX_SHARE_DIVISOR};
        use crate::size::Human;
        let gpu = self.gpu_pinned_bytes();
        let ram = host.ram_mib.saturating_mul(1 << 20);
        let upfront = Upfront::of(self.size, self.queues, self.depth, gpu, writeback);
        let most = match upfront.map(|u| (u, u.check(ram))) {
            Some((_, Ok(()))) => return Ok(()),
            Some((_, Err(most))) => most,
            None => ram / MAX_SHARE_DIVISOR,
        };
        let u = upfront.unwrap_or(Upfront {
            table: u64::MAX,
            room: 0,
            buffers: 0,
            gpu,
            backing: 0,
        });
        let advice =
            match Upfront::largest_size(self.queues, self.depth, gpu, writeback, most, MAX_SIZE) {
                Some(largest) => format!(
                    "the largest device that fits with these settings is {} (size = \"{}\")",
                    Human(largest),
                    crate::size::exact(largest)
                ),
                None => match writeback {
                    Writeback::Blocks(blocks) => format!(
                        "with this backing device no size fits: its {blocks} blocks of 4 KiB need \
                     {} of records (a nonce floor and a use count each); name a smaller \
                     partition as writeback-device, or a file, which is made for the device's \
                     size",
                        Human(u.backing)
                    ),
                    Writeback::None | Writeback::File => format!(
                        "with these settings no size fits: lower gpu-memory ({}), queues ({}) or \
                     depth ({})",
                        Human(gpu),
                        self.queues,
                        self.depth
                    ),
                },
            };
        Err(ConfigError::TooLarge {
            size: Human(self.size),
            total: Human(u.total()),
            table: Human(u.table),
            room: Human(u.room),
            buffers: Human(u.buffers),
            gpu: Human(u.gpu),
            backing: Human(u.backing),
            divisor: MAX_SHARE_DIVISOR,
            ram: Human(ram),
            most: Human(most),
            advice,
        })
    }
}

/// Trees a writeback file may not sit in, at any depth: the generator opens a file's
/// directory to the daemon (`ReadWritePaths=`), which would undo the unit's
/// `ProtectSystem=strict` there (and `/run`, `/proc`, `/sys` hold no disk space).
const SYSTEM_TREES: [&str; 10] = [
    "/etc", "/usr", "/boot", "/bin", "/sbin", "/lib", "/lib64", "/proc", "/sys", "/run",
];
/// Directories a writeback file may not sit in directly: opening one would open every
/// directory below it.
const SHARED_DIRS: [&str; 9] = [
    "/", "/root", "/var", "/var/lib", "/home", "/opt", "/srv", "/mnt", "/media",
];

/// Whether a writeback file in directory `dir` would open a system directory (above).
fn opens_a_system_dir(dir: &Path) -> bool {
    SHARED_DIRS.iter().any(|d| dir == Path::new(d))
        || SYSTEM_TREES.iter().any(|t| dir.starts_with(t))
}

/// Whether writeback path `path` names a device (under /dev) rather than a file: the one
/// rule validation and the generator's drop-in share.
pub fn writeback_is_device(path: &Path) -> bool {
    path.starts_with("/dev")
}

/// Why `path` cannot be a writeback device, if it cannot. The generator writes it into the
/// unit's drop-in, where a space separates values, `%` starts a specifier and a newline a
/// new setting (a config line could add an `ExecStartPre=`), and opens a file's directory
/// to the daemon.
fn unsafe_writeback_path(path: &Path) -> Option<&'static str> {
    let Some(text) = path.to_str() else {
        return Some("is not UTF-8: give a path systemd's unit files can name");
    };
    if text
        .chars()
        .any(|c| c.is_control() || c.is_whitespace() || matches!(c, '%' | '\\' | '"' | '\'' | ';'))
    {
        return Some(
            "holds a space, a control character or one of % \\ \" ' ; \
             (the unit's drop-in names it): rename it",
        );
    }
    // As written: `Path::components` would drop a `.` in the middle.
    if text.split('/').any(|part| part == "." || part == "..") {
        return Some("holds a `.` or `..` part: name the path as it is, without them");
    }
    let is_file = !writeback_is_device(path);
    if !is_file && path.components().count() < 3 {
        return Some("is /dev itself: name the partition or disk (e.g. /dev/disk/by-partuuid/...)");
    }
    let parent = path.parent().unwrap_or(Path::new("/"));
    // As named, and where a link on the way leads (when the directory exists yet).
    let resolved = std::fs::canonicalize(parent).ok();
    if is_file && (opens_a_system_dir(parent) || resolved.is_some_and(|d| opens_a_system_dir(&d))) {
        return Some(
            "is a file in a system directory, or directly in a shared one (/var, /srv, /mnt, \
             ...), which the unit would then let the daemon write: put it in a directory of \
             its own (e.g. /var/lib/uzram/swap0.wb or /srv/swap/swap0.wb)",
        );
    }
    None
}

/// node_exporter's textfile collector reads `*.prom` files only, and the daemon's working
/// directory is not the user's: refuse paths that would silently export nothing.
fn check_metrics_textfile(path: &Path) -> Result<(), ConfigError> {
    let why = if !path.is_absolute() {
        Some("must be an absolute path")
    } else if path.extension() != Some(std::ffi::OsStr::new("prom")) {
        Some("must end in .prom (node_exporter's textfile collector reads *.prom files only)")
    } else {
        None
    };
    match why {
        Some(why) => Err(ConfigError::MetricsTextfile {
            path: path.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// The host facts that size expressions use, and whether validation may probe the host's
/// devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    /// MemTotal in whole MiB: zram-generator's `ram`.
    pub ram_mib: u64,
    /// Whether `backend = "gpu"` is checked against the driver and its GPUs
    /// ([`Backend::check`]). Off for the generator, which runs before any unit at boot:
    /// loading the driver there would hold the boot up (and the GPU's module may not be
    /// loaded yet); the unit's `check-config` probes it.
    pub probe_gpu: bool,
}

impl Host {
    /// A host with `ram_mib` MiB of memory, whose GPU is probed.
    pub const fn with_ram(ram_mib: u64) -> Host {
        Host {
            ram_mib,
            probe_gpu: true,
        }
    }

    /// This host, from `/proc/meminfo`.
    pub fn current() -> Result<Host, ConfigError> {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| crate::sizeexpr::mem_total_mib(&t))
            .map(Host::with_ram)
            .ok_or(ConfigError::MemInfo)
    }

    /// The same host, validated without probing its devices.
    pub const fn without_probes(self) -> Host {
        Host {
            probe_gpu: false,
            ..self
        }
    }
}

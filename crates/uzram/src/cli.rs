//! Command-line arguments as typed (clap); validation into configs happens in `config.rs`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// uzram: compressed RAM block devices (a userspace zram on ublk).
#[derive(Debug, Parser)]
#[command(name = "uzram", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a device: start its daemon, wait until /dev/ublkbN exists, print its path.
    Create(CreateArgs),
    /// Stop a device's daemon and delete the device (refused while it is in use).
    Destroy(DestroyArgs),
    /// List devices, zramctl style.
    List(ListArgs),
    /// Show one device's mm_stat and io_stat counters.
    Status(StatusArgs),
    /// Serve a device from a config file in the foreground (for systemd, Type=notify).
    Run(RunArgs),
    /// mkswap + swapon the device started from a config file (systemd ExecStartPost).
    SwapOn(ConfigArg),
    /// swapoff the device started from a config file (systemd ExecStop).
    SwapOff(ConfigArg),
    /// Internal: the detached daemon that `create` starts.
    #[command(hide = true)]
    Daemon(DaemonArgs),
    /// Store every page of a corpus file through a PageStore, read it back, verify, report.
    Bench(BenchArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct DeviceArgs {
    /// Device size: bytes or with a K, M, G or T suffix (rounded up to whole 4 KiB pages).
    #[arg(long, short = 's')]
    pub size: String,
    /// Compression algorithm: lz4, zstd or zstd:LEVEL.
    #[arg(long, short = 'a', default_value = "lz4")]
    pub algorithm: String,
    /// Compression backend: cpu, gpu or auto.
    #[arg(long, short = 'b', default_value = "cpu")]
    pub backend: String,
    /// Hardware queues (default: one per CPU, at most 4).
    #[arg(long)]
    pub queues: Option<u64>,
    /// Depth of each queue.
    #[arg(long)]
    pub depth: Option<u64>,
    /// How requests reach the daemon: auto (the fastest the kernel offers), batch,
    /// per-io-daemon or per-queue.
    #[arg(long)]
    pub queue_mode: Option<String>,
    /// Most memory the compressed data may use (like zram's mem_limit).
    #[arg(long)]
    pub mem_limit: Option<String>,
    /// Device id N for /dev/ublkbN (default: the kernel picks).
    #[arg(long)]
    pub id: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Serve the device in the foreground instead of detaching a daemon.
    #[arg(long)]
    pub foreground: bool,
}

#[derive(Debug, clap::Args)]
pub struct DaemonArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// File descriptor of the pipe on which the daemon reports readiness to `create`.
    #[arg(long)]
    pub ready_fd: i32,
    /// The log file `create` opened; renamed to `<id>.log` once the id is known.
    #[arg(long)]
    pub log: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct DestroyArgs {
    /// The device: /dev/ublkbN, ublkbN or N.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub device: Option<String>,
    /// Destroy every uzram device that is not in use.
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The device: /dev/ublkbN, ublkbN or N.
    pub device: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// TOML config file (see systemd/uzram.toml.example).
    #[arg(long)]
    pub config: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// The TOML config file the device was started from.
    #[arg(long)]
    pub config: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// File of raw concatenated 4 KiB pages (zstd-compressed if its name ends in .zst).
    #[arg(long)]
    pub corpus: PathBuf,
    /// Compression algorithm: lz4, zstd or zstd:LEVEL.
    #[arg(long, default_value = "lz4")]
    pub algorithm: String,
    /// Compression backend.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Worker threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Timed runs; the median throughput is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Compressed pages of this many bytes or more are stored raw (1..=4096).
    #[arg(long, default_value_t = uzram_core::StoreConfig::DEFAULT_RAW_THRESHOLD)]
    pub raw_threshold: usize,
    /// Write through the batch seam (PageStore::write_batch, the backend compressing
    /// each batch on --threads threads) instead of --threads threads calling write.
    #[arg(long)]
    pub batch: bool,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

impl DeviceArgs {
    /// The raw settings for validation.
    pub fn raw(&self) -> crate::config::RawDevice {
        crate::config::RawDevice {
            size: self.size.clone(),
            algorithm: Some(self.algorithm.clone()),
            backend: Some(self.backend.clone()),
            queues: self.queues,
            depth: self.depth,
            queue_mode: self.queue_mode.clone(),
            mem_limit: self.mem_limit.clone(),
            id: self.id,
        }
    }

    /// The arguments that reproduce these settings on the daemon's command line.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--size".to_string(),
            self.size.clone(),
            "--algorithm".to_string(),
            self.algorithm.clone(),
            "--backend".to_string(),
            self.backend.clone(),
        ];
        let mut opt = |flag: &str, val: Option<String>| {
            if let Some(val) = val {
                v.push(flag.to_string());
                v.push(val);
            }
        };
        opt("--queues", self.queues.map(|q| q.to_string()));
        opt("--depth", self.depth.map(|d| d.to_string()));
        opt("--queue-mode", self.queue_mode.clone());
        opt("--mem-limit", self.mem_limit.clone());
        opt("--id", self.id.map(|i| i.to_string()));
        v
    }
}

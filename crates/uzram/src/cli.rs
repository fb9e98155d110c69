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
    /// Start a new daemon for a device whose daemon died: it takes over the device and the
    /// pages kept in shared memory, and the paused I/O goes on.
    Recover(RecoverArgs),
    /// List devices, with zramctl's columns and flags.
    List(ListArgs),
    /// Show one device's mm_stat and io_stat counters (also as JSON or Prometheus metrics).
    Status(StatusArgs),
    /// Serve a device from a config file in the foreground (for systemd, Type=notify).
    Run(RunArgs),
    /// mkswap + swapon the device started from a config file (systemd ExecStartPost).
    SwapOn(ConfigArg),
    /// swapoff the device started from a config file (systemd ExecStop); during a restart
    /// of --unit, hand the device over to the next daemon instead (swap stays on).
    SwapOff(SwapOffArgs),
    /// Mark a device's pages idle (zram's idle): all of them, or those unused for --age.
    Idle(IdleArgs),
    /// Recompress a device's idle or huge pages now (zram's recompress), with its
    /// recompress-algorithm or zstd; a page is kept recompressed only if that saves memory.
    Recompress(RecompressArgs),
    /// Write a device's idle, huge or incompressible pages to its backing device now
    /// (zram's writeback); the daemon also does so by itself for pages unused for its
    /// writeback-idle-age.
    Writeback(WritebackArgs),
    /// Check a config and say what it makes on this host (the unit's ExecCondition): exit 0
    /// when a device is made, 1 when none is (host-memory-limit, a size of 0), 255 when it is
    /// invalid. Without --config, every device configured here: /etc/uzram/*.toml and
    /// zram-generator.conf's sections.
    CheckConfig(CheckArgs),
    /// Print shell completions for bash, zsh, fish, elvish or powershell.
    Completions(CompletionsArgs),
    /// Print the man page (roff), or write one page per command into a directory.
    Man(ManArgs),
    /// The systemd generator (installed as uzram-generator): wants uzram@NAME.service into
    /// swap.target for every configured device, at boot.
    #[command(hide = true)]
    Generator(GeneratorArgs),
    /// Internal: the detached daemon that `create` starts.
    #[command(hide = true)]
    Daemon(DaemonArgs),
    /// Internal: started by `uzram run` outside its unit; takes the device over if that
    /// daemon dies (docs/recovery.md).
    #[command(hide = true)]
    Standby(StandbyArgs),
    /// Drive the daemon's request handler with a corpus from several threads, as ublk queue
    /// threads do, while one thread times reads; report speed, CPU, memory, read latency.
    Bench(BenchArgs),
}

/// The arguments, with `generator` put in front when the binary runs as `uzram-generator`
/// (the name systemd knows its generators by: a symlink to uzram).
pub fn args_with_generator_name(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<_> = args.into_iter().collect();
    let generator = args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "uzram-generator");
    if generator {
        args.insert(1, "generator".into());
    }
    args
}

impl Command {
    /// Whether this command is on a device's I/O path: it runs a device's daemon in this
    /// process, or (`recover`) starts the daemon that a paused device waits for. Either must
    /// never reclaim memory by writing swap, which may go to that very device; `recover`'s
    /// daemon inherits the setting from its first instruction on, before its `main` could
    /// set it (see `main`).
    pub fn on_a_device_io_path(&self) -> bool {
        match self {
            Command::Run(_) | Command::Daemon(_) | Command::Standby(_) | Command::Recover(_) => {
                true
            }
            Command::Create(args) => args.foreground,
            _ => false,
        }
    }

    /// True for the commands whose stdout carries nothing but log lines: the detached daemon
    /// (its stdout is its log file) and the systemd services (readiness goes by sd_notify).
    /// `create --foreground` and `recover` print the device on stdout for their caller.
    pub fn stdout_is_its_log(&self) -> bool {
        matches!(
            self,
            Command::Daemon(_) | Command::Run(_) | Command::Standby(_)
        )
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct DeviceArgs {
    /// Device size: bytes or with a K, M, G or T suffix (rounded up to whole 4 KiB pages).
    #[arg(long, short = 's')]
    pub size: String,
    /// Compression algorithm: lz4, zstd or zstd:LEVEL.
    #[arg(long, short = 'a', default_value = "lz4")]
    pub algorithm: String,
    /// Where pages are compressed: cpu, gpu or auto.
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
    /// Whether the kernel copies requests' data only when the daemon asks (ublk's user
    /// copy): auto (where writes go to a GPU, at up to 4 queues), on or off.
    #[arg(long)]
    pub user_copy: Option<String>,
    /// Where the queue threads run: auto (pinned to their queues' CPUs, as libublk pins
    /// them, with the cpu backend; on any CPU with the gpu backend, whose installer threads
    /// share those CPUs), kernel or any.
    #[arg(long)]
    pub queue_affinity: Option<String>,
    /// Most memory the compressed data may use (like zram's mem_limit).
    #[arg(long)]
    pub mem_limit: Option<String>,
    /// Device id N for /dev/ublkbN (default: the kernel picks).
    #[arg(long)]
    pub id: Option<u64>,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Rewrite this file with the device's Prometheus metrics every 15 s (for
    /// node_exporter's textfile collector; must end in .prom, in a directory only root can
    /// write).
    #[arg(long, value_name = "PATH")]
    pub metrics_textfile: Option<PathBuf>,
    /// Store pages without their checksum (every stored page carries a CRC32C, checked on
    /// every read, unless this is given; for measuring what the checksums cost).
    #[arg(long)]
    pub no_checksums: bool,
    /// Recompress pages that went unused with zstd or zstd:LEVEL (default level 3), with
    /// zstd-gpu (zstd from NVIDIA nvCOMP on the GPU), with lz4-gpu (LZ4 again from an
    /// NVIDIA GPU's tighter parse; with --algorithm lz4) or with lz4-gpu-dict (LZ4 with a
    /// dictionary trained on the device's pages, on an NVIDIA GPU), in the background; a
    /// page is kept recompressed only if that saves memory.
    #[arg(long, value_name = "ALGORITHM")]
    pub recompress_algorithm: Option<String>,
    /// How long a page goes unused before it is recompressed: 30s, 10m, 1h, 2d (default 1h).
    #[arg(long, value_name = "AGE")]
    pub recompress_idle_age: Option<String>,
    /// Recompress only pages stored in at least this many bytes (zram's threshold=).
    #[arg(long, value_name = "BYTES")]
    pub recompress_threshold: Option<u64>,
    /// Write pages that went unused back to this partition (used whole, opened exclusively)
    /// or file (created 0600 and reserved if absent), packed and encrypted.
    #[arg(long, value_name = "PATH")]
    pub writeback_device: Option<PathBuf>,
    /// How long a page goes unused before the daemon writes it back: 30s, 10m, 1h, 2d
    /// (default 1h).
    #[arg(long, value_name = "AGE")]
    pub writeback_idle_age: Option<String>,
    /// The most writeback may write to the backing device a day, kept across restarts
    /// and reboots (flash wears): SIZE/day, or none (default 1G/day).
    #[arg(long, value_name = "LIMIT")]
    pub writeback_limit: Option<String>,
}

/// How the GPU backend runs (`uzram create`, `run`'s daemon, `uzram bench`).
#[derive(Debug, Clone, clap::Args)]
pub struct GpuArgs {
    /// GPUs for the gpu or auto backend: all, or numbers separated by commas (default 0).
    #[arg(long)]
    pub gpus: Option<String>,
    /// Page-locked host memory of the GPU ring, staging and results (default 128M).
    #[arg(long)]
    pub gpu_memory: Option<String>,
    /// The GPU's LZ4 parse: high (default: LZ4HC-class ratio) or fast.
    #[arg(long)]
    pub gpu_parse: Option<String>,
    /// Threads installing the GPU's results into the store (default 4).
    #[arg(long)]
    pub gpu_installers: Option<u64>,
    /// Longest a queue thread waits for a free GPU ring slot before compressing on the CPU,
    /// in µs (default 2000; 0: never waits).
    #[arg(long, value_name = "US")]
    pub gpu_slot_wait_us: Option<u64>,
    /// Pages per slot of the GPU ring (default 2048; the ring holds --gpu-memory of them).
    #[arg(long)]
    pub gpu_slot_pages: Option<u64>,
    /// Whether the GPU's copy engine places compressed pages straight into the store
    /// (default false; when true, the store's memory is registered with the driver and kept).
    #[arg(long, value_name = "BOOL")]
    pub gpu_place: Option<bool>,
}

impl GpuArgs {
    /// `raw` with these settings, for validation.
    pub fn with_raw(&self, raw: crate::config::RawDevice) -> crate::config::RawDevice {
        crate::config::RawDevice {
            gpus: self.gpus.clone(),
            gpu_memory: self.gpu_memory.clone(),
            gpu_parse: self.gpu_parse.clone(),
            gpu_installers: self.gpu_installers,
            gpu_slot_wait_us: self.gpu_slot_wait_us,
            gpu_slot_pages: self.gpu_slot_pages,
            gpu_place: self.gpu_place,
            ..raw
        }
    }

    /// The arguments that reproduce these settings, appended to `v`.
    fn push_args(&self, v: &mut Vec<String>) {
        push_flag(v, "--gpus", self.gpus.as_ref());
        push_flag(v, "--gpu-memory", self.gpu_memory.as_ref());
        push_flag(v, "--gpu-parse", self.gpu_parse.as_ref());
        push_flag(v, "--gpu-installers", self.gpu_installers);
        push_flag(v, "--gpu-slot-wait-us", self.gpu_slot_wait_us);
        push_flag(v, "--gpu-slot-pages", self.gpu_slot_pages);
        push_flag(v, "--gpu-place", self.gpu_place);
    }
}

/// Appends `flag value` to `v` when there is a value.
fn push_flag(v: &mut Vec<String>, flag: &str, value: Option<impl ToString>) {
    if let Some(value) = value {
        v.push(flag.to_string());
        v.push(value.to_string());
    }
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Serve the device in the foreground instead of detaching a daemon.
    #[arg(long)]
    pub foreground: bool,
    /// Start no standby. By default a standby (`uzram recover --wait --keep DEV`, started
    /// once the device serves) recovers the device by itself whenever its daemon dies: it
    /// keeps the next daemon waiting with its memory made (8 MiB of heap and 8 MiB of I/O
    /// buffers a queue at the default depth, locked); both end with the device. Without one,
    /// a daemon that dies under memory pressure may leave nothing able to start a new one.
    #[arg(long, conflicts_with = "foreground")]
    pub no_standby: bool,
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
    /// Take over device N, whose daemon died (what `uzram recover` starts).
    #[arg(long, value_name = "N")]
    pub recover: Option<u32>,
    /// With --recover: start while device N's daemon still runs, make the memory a takeover
    /// needs (heap, locked I/O buffers) now, wait until that daemon exits, then take the
    /// device over if it died, or report that it was stopped (what `uzram recover --wait`
    /// starts).
    #[arg(long, requires = "recover")]
    pub wait: bool,
}

#[derive(Debug, clap::Args)]
pub struct RecoverArgs {
    /// The device: /dev/ublkbN, its swap node /dev/zram-uzram/ublkbN, ublkbN or N.
    pub device: String,
    /// Start now, while the device's daemon runs: the next daemon starts at once, makes its
    /// memory (heap, locked I/O buffers) and waits until that daemon exits, then takes the
    /// device over if it died; this command waits, locked in memory, and prints the device
    /// once it serves again (exit 0 without a recovery if the device was stopped). A
    /// recovery started after a crash needs free memory to start at all, which a crash under
    /// swap pressure may have left none of.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: after each recovery, wait for the new daemon in turn, until the device is
    /// stopped (the standby `uzram create --standby` starts). Runs in a session of its own.
    #[arg(long, requires = "wait")]
    pub keep: bool,
}

#[derive(Debug, clap::Args)]
pub struct DestroyArgs {
    /// The device: /dev/ublkbN, its swap node /dev/zram-uzram/ublkbN, ublkbN or N.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub device: Option<String>,
    /// Destroy every uzram device that is not in use, and free the shared memory that no
    /// device takes back (`uzram list` names it).
    #[arg(long)]
    pub all: bool,
}

/// The column list of `uzram list --help`, with what each column means for uzram.
pub const COLUMNS_HELP: &str = "\
Available output columns (zramctl's names and meanings; -o takes a comma-separated list,
+LIST appends to the defaults NAME,ALGORITHM,DISKSIZE,DATA,COMPR,TOTAL,STREAMS,MOUNTPOINT):
        NAME  device name (/dev/ublkbN)
    DISKSIZE  limit on the uncompressed amount of data (the device size)
        DATA  uncompressed size of stored data
       COMPR  compressed size of stored data
   ALGORITHM  the selected compression algorithm
     STREAMS  number of concurrent compress operations: one per hardware queue, whose thread
              compresses its own writes
  ZERO-PAGES  same-filled pages, stored with no compressed data
       TOTAL  all memory the store holds: arena, page table and bookkeeping
   MEM-LIMIT  memory limit used to store compressed data (0B: none)
    MEM-USED  peak memory usage to store compressed data
    MIGRATED  pages of memory given back by compaction (zram's pages_compacted)
  COMP-RATIO  compression ratio: DATA/TOTAL
  MOUNTPOINT  where the device is mounted, [SWAP] when it is active swap
     BACKEND  where writes are compressed: cpu or gpu (uzram only)";

#[derive(Debug, clap::Args)]
#[command(after_help = COLUMNS_HELP)]
pub struct ListArgs {
    /// Columns to print (comma-separated); +LIST appends them to the defaults.
    #[arg(short = 'o', long, value_name = "LIST", allow_hyphen_values = true)]
    pub output: Option<String>,
    /// Print every column.
    #[arg(long)]
    pub output_all: bool,
    /// Print sizes in bytes, not in human-readable form.
    #[arg(short = 'b', long)]
    pub bytes: bool,
    /// Raw output: no alignment, one space between cells, special characters escaped.
    #[arg(long)]
    pub raw: bool,
    /// Do not print the header line.
    #[arg(short = 'n', long)]
    pub noheadings: bool,
    /// Print every field of every device as JSON (sizes in bytes) instead of a table.
    #[arg(long, conflicts_with_all = ["output", "output_all", "bytes", "raw", "noheadings"])]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The device: /dev/ublkbN, its swap node /dev/zram-uzram/ublkbN, ublkbN or N.
    pub device: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Print every counter in Prometheus' text format, with a device label (what the
    /// metrics-textfile config key writes for node_exporter).
    #[arg(long, conflicts_with = "json")]
    pub prometheus: bool,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// A uzram TOML file (uzram.toml(5)), or zram-generator:zramN for a section of
    /// zram-generator.conf.
    #[arg(long)]
    pub config: PathBuf,
    /// Take the device over from the running daemon of this config and serve it until the
    /// next `uzram run --config` of the same file takes it over in turn. A planned
    /// `systemctl restart` starts one outside the unit (docs/recovery.md), so that the device
    /// is never left without a daemon while systemd itself may wait on it.
    #[arg(long)]
    pub bridge: bool,
}

#[derive(Debug, clap::Args)]
pub struct StandbyArgs {
    /// The config file of the daemon stood by for.
    #[arg(long)]
    pub config: PathBuf,
    /// The daemon's pid.
    #[arg(long)]
    pub pid: u32,
    /// The daemon's start time (clock ticks after boot, `/proc/PID/stat`): a process that
    /// was given the pid after the daemon died is not taken for it.
    #[arg(long)]
    pub started: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// The config the device was started from: a uzram TOML file, or zram-generator:zramN
    /// for a section of zram-generator.conf.
    #[arg(long)]
    pub config: PathBuf,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["all", "age"])))]
pub struct IdleArgs {
    /// The device: /dev/ublkbN, its swap node /dev/zram-uzram/ublkbN, ublkbN or N.
    pub device: String,
    /// Only pages unused this long (30s, 10m, 1h, 2d; zram's `echo SECONDS > idle`).
    #[arg(long)]
    pub age: Option<String>,
    /// Every page holding data (zram's `echo all > idle`).
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, clap::Args)]
pub struct RecompressArgs {
    /// The device: /dev/ublkbN, its swap node /dev/zram-uzram/ublkbN, ublkbN or N.
    pub device: String,
    /// Which pages: idle (unused for the device's recompress-idle-age, default 1h, or marked
    /// with uzram idle), huge (stored uncompressed), or huge_idle (both).
    #[arg(long = "type", default_value = "idle", value_name = "TYPE", value_parser = ["idle", "huge", "huge_idle"])]
    pub kind: String,
    /// Only pages stored in at least this many bytes (zram's threshold=).
    #[arg(long, value_name = "BYTES")]
    pub threshold: Option<u64>,
    /// zstd (level 3) or zstd:LEVEL (default: the device's recompress-algorithm, zstd,
    /// zstd-gpu, lz4-gpu or lz4-gpu-dict, else zstd:3).
    #[arg(long)]
    pub algorithm: Option<String>,
    /// Print the pass's report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct WritebackArgs {
    /// The device: /dev/ublkbN, its swap node /dev/zram-uzram/ublkbN, ublkbN or N.
    pub device: String,
    /// Which pages: idle (unused for the device's writeback-idle-age, default 1h, or marked
    /// with uzram idle), huge (stored uncompressed), or incompressible (stored uncompressed
    /// after recompression could not shrink them).
    #[arg(long = "type", default_value = "idle", value_name = "TYPE", value_parser = ["idle", "huge", "incompressible"])]
    pub kind: String,
    /// At most this many pages, oldest first.
    #[arg(long, value_name = "N")]
    pub max_pages: Option<u64>,
    /// Print the pass's report as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// A uzram TOML file, or zram-generator:zramN for a section of zram-generator.conf;
    /// without it, every device configured on this host.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct GeneratorArgs {
    /// systemd's normal, early and late generator folders (only the first is written).
    #[arg(num_args = 1..=3, required = true)]
    pub dirs: Vec<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct SwapOffArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The systemd unit this runs for (%n): when systemd is restarting it, the daemon hands
    /// the device over to the next one instead of swapping off.
    #[arg(long)]
    pub unit: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell.
    pub shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write uzram.8 and one uzram-COMMAND.8 per command into this directory instead of
    /// printing uzram.8.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// File of raw concatenated 4 KiB pages (zstd-compressed if its name ends in .zst);
    /// give it more than once to run each corpus.
    #[arg(long, required = true)]
    pub corpus: Vec<PathBuf>,
    /// Compression algorithm: lz4, zstd or zstd:LEVEL.
    #[arg(long, default_value = "lz4")]
    pub algorithm: String,
    /// Backends to run side by side: cpu, gpu, auto, comma-separated (e.g. cpu,gpu).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Threads sending 64 KiB writes through the daemon's request handler, as ublk queue
    /// threads do.
    #[arg(long, default_value_t = 4)]
    pub queues: usize,
    /// Bytes written per run (the corpus repeated), with a K, M, G suffix.
    #[arg(long, default_value = "1G")]
    pub total: String,
    /// Runs per backend; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Untimed runs per backend first: the process's heap then has the memory a running
    /// daemon has reused since its start (its first writes fault pages in, once).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Compressed pages of this many bytes or more are stored raw (1..=4096).
    #[arg(long, default_value_t = uzram_core::StoreConfig::DEFAULT_RAW_THRESHOLD)]
    pub raw_threshold: usize,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Print one JSON object per corpus and backend on stdout.
    #[arg(long)]
    pub json: bool,
    /// Page checksums to run side by side: on, off, or both (on,off).
    #[arg(long, default_value = "on")]
    pub checksums: String,
    /// Writes by ublk's user copy, as the daemon moves them with `--user-copy`: auto (as the
    /// daemon decides: on for the gpu backend at up to 4 queues), on, off, or several side
    /// by side (on,off; auto,off). Either way the kernel's copy of each written request is
    /// stood in for by a memcpy (into the request's buffer, or with user copy into
    /// staging), in the wall time, its CPU time left out and reported apart.
    #[arg(long, default_value = "auto")]
    pub user_copy: String,
    /// Request buffers each queue thread writes from in turn, as a ublk queue keeps a
    /// buffer for each tag and the kernel copies a write into its tag's (1 to 4096; without
    /// user copy only). 1, the default: one buffer, always in the CPU's cache. A queue with
    /// N writes in flight cycles through about N (the daemon's tags: `--depth`, 64).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub request_buffers: usize,
    /// Where the queue threads run: auto (as the daemon places them: pinned for the cpu
    /// backend, anywhere for the gpu backend), kernel (each pinned to the CPUs the kernel's
    /// block layer maps to its queue, as libublk pins them), any (wherever the scheduler
    /// puts them), or several side by side (kernel,any). The installers, the pool keeper and
    /// the timing reader run anywhere, as the daemon's helper threads do.
    #[arg(long, default_value = "auto", value_name = "WHERE")]
    pub queue_affinity: String,
    /// After each run's writes, mark every page idle and recompress it with zstd,
    /// zstd:LEVEL, zstd-gpu (NVIDIA nvCOMP's zstd), lz4-gpu (an NVIDIA GPU's high LZ4
    /// parse) or lz4-gpu-dict (LZ4 with a dictionary trained on the run's pages, on an
    /// NVIDIA GPU), as the cold tier does; report the idle set's memory before and after.
    #[arg(long, value_name = "ALGORITHM")]
    pub recompress: Option<String>,
    /// After that, write the lower half of each run's device back to a backing file at
    /// PATH (created 0600 if absent; give a file on the disk to measure), as the daemon's
    /// writeback does; report disk bytes per page and read latencies during the pass.
    #[arg(long, value_name = "PATH")]
    pub writeback: Option<PathBuf>,
    /// The timing reader's pause between reads, in µs (0: back to back, a whole core).
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub read_gap_us: u64,
    /// After each run's first write, write the same pages N times more, each time with
    /// other contents, as swap reuses its slots; report those passes apart (ingest, CPU,
    /// read p99, the store's memory with the holes they leave, and after a compaction).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub overwrites: usize,
}

impl DeviceArgs {
    /// The raw settings for validation.
    pub fn raw(&self) -> crate::config::RawDevice {
        self.gpu.with_raw(crate::config::RawDevice {
            size: self.size.clone(),
            algorithm: Some(self.algorithm.clone()),
            backend: Some(self.backend.clone()),
            queues: self.queues,
            depth: self.depth,
            queue_mode: self.queue_mode.clone(),
            user_copy: self.user_copy.clone(),
            queue_affinity: self.queue_affinity.clone(),
            mem_limit: self.mem_limit.clone(),
            id: self.id,
            metrics_textfile: self.metrics_textfile.clone(),
            checksums: self.no_checksums.then_some(false),
            recompress_algorithm: self.recompress_algorithm.clone(),
            recompress_idle_age: self.recompress_idle_age.clone(),
            recompress_threshold: self.recompress_threshold,
            writeback_device: self.writeback_device.clone(),
            writeback_idle_age: self.writeback_idle_age.clone(),
            writeback_limit: self.writeback_limit.clone(),
            ..crate::config::RawDevice::default()
        })
    }

    /// The arguments of a device whose settings are `raw` (a recovery record's, validated).
    pub fn from_raw(raw: &crate::config::RawDevice) -> DeviceArgs {
        DeviceArgs {
            size: raw.size.clone(),
            algorithm: raw.algorithm.clone().unwrap_or_else(|| "lz4".into()),
            backend: raw.backend.clone().unwrap_or_else(|| "cpu".into()),
            queues: raw.queues,
            depth: raw.depth,
            queue_mode: raw.queue_mode.clone(),
            user_copy: raw.user_copy.clone(),
            queue_affinity: raw.queue_affinity.clone(),
            mem_limit: raw.mem_limit.clone(),
            id: raw.id,
            gpu: GpuArgs {
                gpus: raw.gpus.clone(),
                gpu_memory: raw.gpu_memory.clone(),
                gpu_parse: raw.gpu_parse.clone(),
                gpu_installers: raw.gpu_installers,
                gpu_slot_wait_us: raw.gpu_slot_wait_us,
                gpu_slot_pages: raw.gpu_slot_pages,
                gpu_place: raw.gpu_place,
            },
            metrics_textfile: raw.metrics_textfile.clone(),
            no_checksums: raw.checksums == Some(false),
            recompress_algorithm: raw.recompress_algorithm.clone(),
            recompress_idle_age: raw.recompress_idle_age.clone(),
            recompress_threshold: raw.recompress_threshold,
            writeback_device: raw.writeback_device.clone(),
            writeback_idle_age: raw.writeback_idle_age.clone(),
            writeback_limit: raw.writeback_limit.clone(),
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
        push_flag(&mut v, "--queues", self.queues);
        push_flag(&mut v, "--depth", self.depth);
        push_flag(&mut v, "--queue-mode", self.queue_mode.as_ref());
        push_flag(&mut v, "--user-copy", self.user_copy.as_ref());
        push_flag(&mut v, "--queue-affinity", self.queue_affinity.as_ref());
        push_flag(&mut v, "--mem-limit", self.mem_limit.as_ref());
        push_flag(&mut v, "--id", self.id);
        push_flag(
            &mut v,
            "--metrics-textfile",
            self.metrics_textfile
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned()),
        );
        self.gpu.push_args(&mut v);
        if self.no_checksums {
            v.push("--no-checksums".to_string());
        }
        push_flag(
            &mut v,
            "--recompress-algorithm",
            self.recompress_algorithm.as_ref(),
        );
        push_flag(
            &mut v,
            "--recompress-idle-age",
            self.recompress_idle_age.as_ref(),
        );
        push_flag(&mut v, "--recompress-threshold", self.recompress_threshold);
        push_flag(
            &mut v,
            "--writeback-device",
            self.writeback_device
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned()),
        );
        push_flag(
            &mut v,
            "--writeback-idle-age",
            self.writeback_idle_age.as_ref(),
        );
        push_flag(&mut v, "--writeback-limit", self.writeback_limit.as_ref());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn device_of(args: &[&str]) -> DeviceArgs {
        match Cli::try_parse_from(args).expect("parses").command {
            Command::Create(c) => c.device,
            other => panic!("not create: {other:?}"),
        }
    }

    #[test]
    fn a_device_command_line_survives_to_args() {
        let every = [
            "uzram",
            "create",
            "--size",
            "1G",
            "--algorithm",
            "zstd:3",
            "--backend",
            "gpu",
            "--queues",
            "2",
            "--depth",
            "64",
            "--queue-mode",
            "batch",
            "--user-copy",
            "off",
            "--mem-limit",
            "512M",
            "--id",
            "3",
            "--gpus",
            "0,1",
            "--gpu-memory",
            "256M",
            "--gpu-parse",
            "fast",
            "--gpu-installers",
            "6",
            "--gpu-slot-wait-us",
            "500",
            "--gpu-slot-pages",
            "1024",
            "--metrics-textfile",
            "/run/x.prom",
            "--no-checksums",
        ];
        for line in [&every[..], &["uzram", "create", "--size", "4M"][..]] {
            let first = device_of(line);
            let again: Vec<String> = ["uzram", "create"]
                .iter()
                .map(|s| s.to_string())
                .chain(first.to_args())
                .collect();
            let second = device_of(&again.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(format!("{first:?}"), format!("{second:?}"));
        }
        let d = device_of(&every);
        assert_eq!(d.gpu.gpu_parse.as_deref(), Some("fast"));
        assert_eq!(d.gpu.gpu_slot_pages, Some(1024));
        assert_eq!(d.raw().gpu_installers, Some(6));
        assert_eq!(d.raw().checksums, Some(false));
        // What a recovery record keeps makes the same device again.
        for line in [&every[..], &["uzram", "create", "--size", "4M"][..]] {
            let d = device_of(line);
            assert_eq!(DeviceArgs::from_raw(&d.raw()).raw(), d.raw());
        }
    }
}

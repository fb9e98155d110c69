//! `uzram bench`: the write path a user runs, measured, with every backend asked for side
//! by side in one invocation (`--backend cpu,gpu`).
//!
//! Each run sets up a store and its compression backend exactly as the daemon does (the
//! store in locked shared memory over the block pool, `memory.rs`; the backend by
//! `daemon::backend::WriteBackend::start`), then `--queues` threads send 64 KiB writes
//! through the daemon's own request handler (`ublk::handler::handle`), as ublk queue
//! threads do, while one more thread times random 4 KiB reads of pages written before.
//! Reported per corpus and backend, medians over `--repeat` runs:
//! - ingest GB/s (written and compressed), time to acknowledge every write, time until
//!   everything is compressed;
//! - process CPU-seconds per GiB ingested (the timing reader's own CPU left out);
//! - read p50/p99, idle and under ingest;
//! - orig ÷ mem_used, and a check of every page.
//!
//! `--checksums on,off` runs every backend with and without the per-page checksums, side by
//! side, and prints what they cost.

mod measure;
mod memory;
mod pass;
mod queue_reads;
mod random;
mod report;
mod threads;
mod writeback;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, ensure, Context};
use uzram_core::codec::Algorithm;
use uzram_core::PAGE_SIZE;

use crate::cli::BenchArgs;
use crate::config::{Backend, GpuSettings, QueueAffinity, RawDevice, RecompressCodec};
use crate::size::parse_size;
use crate::ublk::placement::Placement;
use crate::ublk::queue_mode::user_copy_by_default;

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let algorithm = Algorithm::parse(&args.algorithm)?;
    ensure!(args.queues >= 1, "--queues must be at least 1");
    ensure!(args.repeat >= 1, "--repeat must be at least 1");
    ensure!(
        (1..=PAGE_SIZE).contains(&args.raw_threshold),
        "--raw-threshold must be in 1..=4096, not {}",
        args.raw_threshold
    );
    let backends = parse_backends(&args.backend)?;
    let checksums = parse_checksums(&args.checksums)?;
    let copies = parse_user_copy(&args.user_copy)?;
    let affinities = parse_queue_affinity(&args.queue_affinity)?;
    ensure!(
        (1..=usize::from(crate::config::MAX_DEPTH)).contains(&args.request_buffers),
        "--request-buffers must be in 1..={} (a queue's tags), not {}",
        crate::config::MAX_DEPTH,
        args.request_buffers
    );
    ensure!(
        args.read_gap_us <= MAX_READ_GAP_US,
        "--read-gap-us must be at most {MAX_READ_GAP_US} (a second), not {}: a run waits out \
         the reader's last pause",
        args.read_gap_us
    );
    let recompress = match args.recompress.as_deref() {
        None => None,
        Some("zstd") => Some(RecompressCodec::Zstd {
            level: uzram_core::store::DEFAULT_RECOMPRESS_LEVEL,
        }),
        Some("lz4-gpu") if algorithm == Algorithm::Lz4 => Some(RecompressCodec::GpuLz4),
        Some("zstd-gpu") => Some(RecompressCodec::GpuZstd),
        Some("lz4-gpu-dict") => Some(RecompressCodec::GpuLz4Dict),
        Some(text) => match Algorithm::parse(text) {
            Ok(Algorithm::Zstd { level }) => Some(RecompressCodec::Zstd { level }),
            _ => anyhow::bail!(
                "--recompress {text:?}: give zstd, zstd:LEVEL, zstd-gpu, lz4-gpu-dict or (with --algorithm lz4) lz4-gpu"
            ),
        },
    };
    ensure!(
        args.overwrites <= MAX_OVERWRITES,
        "--overwrites must be at most {MAX_OVERWRITES}, not {}",
        args.overwrites
    );
    let total = parse_size(&args.total).context("--total")?;
    let pages = usize::try_from(total / PAGE_SIZE as u64).context("--total is too large")?;
    ensure!(
        args.queues
            .checked_mul(measure::REQUEST_PAGES)
            .is_some_and(|least| pages >= least),
        "--total must give every queue at least one 64 KiB request"
    );
    let buffers = (args.queues as u64)
        .saturating_mul(args.request_buffers as u64)
        .saturating_mul((measure::REQUEST_PAGES * PAGE_SIZE) as u64);
    // The host's facts, read once: the checks below and the GPU settings' sizes use them.
    let host = crate::config::Host::current()?;
    let ram = host.ram_mib << 20;
    ensure!(
        buffers <= ram / 4,
        "--request-buffers {} for {} queues is {} of buffers, over a quarter of this host's {} \
         of RAM: ask fewer",
        args.request_buffers,
        args.queues,
        crate::size::Human(buffers),
        crate::size::Human(ram)
    );
    let gpu = gpu_settings(&args, host)?;
    let corpora = args
        .corpus
        .iter()
        .map(|path| Ok((corpus_name(path), load_corpus(path)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Each run's device: the corpus once (the reader's pages), then the ingest region.
    let most = corpora
        .iter()
        .map(|(_, c)| (c.len() / PAGE_SIZE + pages) as u64)
        .max()
        .unwrap_or(0);
    check_host_holds(most, &backends, &gpu, ram)?;
    let memory = memory::StoreMemory::new(most, algorithm)?;
    let mut all_verified = true;
    let mut reports = Vec::new();
    for (name, corpus) in &corpora {
        let queues = u16::try_from(args.queues).unwrap_or(u16::MAX);
        let mut settings: Vec<(Backend, bool, bool, Placement)> = Vec::new();
        for &b in &backends {
            let auto = user_copy_by_default(b == Backend::Gpu, queues);
            for &c in &checksums {
                for copy in &copies {
                    for affinity in &affinities {
                        // `auto,off` gives the cpu backend's run once.
                        let placement = affinity.placement(b == Backend::Gpu);
                        let s = (b, c, copy.unwrap_or(auto), placement);
                        if !settings.contains(&s) {
                            settings.push(s);
                        }
                    }
                }
            }
        }
        let setups: Vec<(Backend, measure::Setup)> = settings
            .into_iter()
            .map(|(backend, checksums, user_copy, placement)| {
                let setup = measure::Setup {
                    algorithm,
                    backend,
                    gpu: gpu.clone(),
                    raw_threshold: args.raw_threshold,
                    queues: args.queues,
                    pages,
                    warmup: args.warmup,
                    checksums,
                    recompress,
                    writeback: args.writeback.clone(),
                    read_gap: std::time::Duration::from_micros(args.read_gap_us),
                    user_copy,
                    request_buffers: args.request_buffers,
                    placement,
                    overwrites: args.overwrites,
                };
                (backend, setup)
            })
            .collect();
        for (_, setup) in &setups {
            for _ in 0..args.warmup {
                // Not in the numbers, but its pages are checked like any run's.
                all_verified &= measure::run(corpus, setup, &memory)?.verified;
            }
        }
        // The settings' runs interleaved (A B A B ...), not one after the other: a run's
        // place in the invocation moved its numbers by more than the settings did (a first
        // setting's writes cost up to 40 % more CPU on a loaded host).
        let mut runs: Vec<Vec<measure::Run>> = setups.iter().map(|_| Vec::new()).collect();
        for _ in 0..args.repeat {
            for ((_, setup), runs) in setups.iter().zip(runs.iter_mut()) {
                runs.push(measure::run(corpus, setup, &memory)?);
            }
        }
        for ((backend, setup), runs) in setups.iter().zip(&runs) {
            let r = report::Report::new(name, *backend, setup, runs);
            all_verified &= r.verified;
            if args.json {
                println!("{}", serde_json::to_string(&r)?);
            }
            reports.push(r);
        }
    }
    if !args.json {
        print!("{}", report::table(&reports));
    }
    Ok(if all_verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `on`, `off`, or both, in the order given.
fn parse_checksums(text: &str) -> anyhow::Result<Vec<bool>> {
    parse_list(text, "--checksums", |part| match part {
        "on" => Ok(true),
        "off" => Ok(false),
        other => bail!("--checksums {other:?}: use on, off, or on,off"),
    })
}

/// A comma-separated list, each item parsed by `item`; an item given twice is an error
/// that names it after `what`.
fn parse_list<T: PartialEq>(
    text: &str,
    what: &str,
    item: impl Fn(&str) -> anyhow::Result<T>,
) -> anyhow::Result<Vec<T>> {
    let mut v = Vec::new();
    for part in text.split(',').map(str::trim) {
        let x = item(part)?;
        ensure!(!v.contains(&x), "{what} {part} given twice");
        v.push(x);
    }
    Ok(v)
}

/// `--user-copy`: `auto` (as the daemon decides it: on for the gpu backend at up to 4
/// queues, else off), `on`, `off`, or several side by side (`on,off`; `auto,off`: the gpu backend both
/// ways, the others once); `None` is `auto`.
fn parse_user_copy(text: &str) -> anyhow::Result<Vec<Option<bool>>> {
    parse_list(text, "--user-copy", |part| match part {
        "auto" => Ok(None),
        "on" => Ok(Some(true)),
        "off" => Ok(Some(false)),
        other => bail!("--user-copy {other:?}: use auto, on, off, or a list such as on,off"),
    })
}

/// `--queue-affinity`: the daemon's values (`auto`: as the daemon places its queue threads
/// for the backend), or several side by side.
fn parse_queue_affinity(text: &str) -> anyhow::Result<Vec<QueueAffinity>> {
    parse_list(text, "--queue-affinity", |part| {
        QueueAffinity::parse(part).ok_or_else(|| {
            anyhow::anyhow!(
                "--queue-affinity {part:?}: use {}, or a list such as kernel,any",
                QueueAffinity::NAMES
            )
        })
    })
}

/// Refuses a bench whose locked memory (its store's table and room, and a GPU ring) the
/// host, of `ram` bytes, cannot hold, before anything is taken: the daemon's rule
/// (`footprint.rs`).
fn check_host_holds(
    pages: u64,
    backends: &[Backend],
    gpu: &GpuSettings,
    ram: u64,
) -> anyhow::Result<()> {
    let gpu_bytes = if backends.iter().any(|&b| b != Backend::Cpu) {
        gpu.memory
    } else {
        0
    };
    let bytes = pages.saturating_mul(PAGE_SIZE as u64);
    let fits =
        crate::footprint::Upfront::of(bytes, 1, 1, gpu_bytes, crate::footprint::Writeback::None)
            .map(|u| (u, u.check(ram)));
    match fits {
        Some((_, Ok(()))) => Ok(()),
        _ => {
            let most = ram / crate::footprint::MAX_SHARE_DIVISOR;
            let largest = crate::footprint::Upfront::largest_size(
                1,
                1,
                gpu_bytes,
                crate::footprint::Writeback::None,
                most,
                crate::size::MAX_SIZE,
            );
            bail!(
                "--total {} (with the corpus) would lock more than 1/{} of this host's {} of RAM \
                 ({}) in page table and rings; {}",
                crate::size::Human(bytes),
                crate::footprint::MAX_SHARE_DIVISOR,
                crate::size::Human(ram),
                crate::size::Human(most),
                match largest {
                    Some(l) => format!("the most that fits is about {}", crate::size::Human(l)),
                    None => "lower --gpu-memory".to_string(),
                }
            )
        }
    }
}

fn parse_backends(text: &str) -> anyhow::Result<Vec<Backend>> {
    // A backend parses from its name alone, so the part named twice is the name.
    parse_list(text, "backend", |part| Ok(Backend::parse(part)?))
}

/// The GPU settings, validated as a config file's would be.
fn gpu_settings(args: &BenchArgs, host: crate::config::Host) -> anyhow::Result<GpuSettings> {
    let raw = args.gpu.with_raw(RawDevice {
        size: "1G".into(),
        ..RawDevice::default()
    });
    Ok(raw.validate(host)?.gpu)
}

fn corpus_name(path: &Path) -> String {
    let n = path.file_name().unwrap_or_default().to_string_lossy();
    n.split('.').next().unwrap_or("corpus").to_string()
}

/// The most passes `--overwrites` may add to each run (each as long as the first).
const MAX_OVERWRITES: usize = 100;

/// The longest pause the timing reader may take between reads.
const MAX_READ_GAP_US: u64 = 1_000_000;

fn load_corpus(path: &Path) -> anyhow::Result<Vec<u8>> {
    // Only a regular file: a device (`/dev/zero`) never ends and a FIFO may never start.
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read corpus {}", path.display()))?;
    ensure!(
        meta.is_file(),
        "corpus {} is {}, not a regular file of pages",
        path.display(),
        crate::sys::owned_file::file_kind(&meta.file_type())
    );
    let data =
        std::fs::read(path).with_context(|| format!("cannot read corpus {}", path.display()))?;
    // The project's corpora ship zstd-compressed; take them as they are.
    let data = if path.extension().is_some_and(|e| e == "zst") {
        zstd::decode_all(&data[..])
            .with_context(|| format!("corpus {} is not valid zstd", path.display()))?
    } else {
        data
    };
    if data.is_empty() {
        bail!("corpus {} is empty", path.display());
    }
    ensure!(
        data.len() % PAGE_SIZE == 0,
        "corpus {} is {} bytes, not a multiple of the 4096-byte page",
        path.display(),
        data.len()
    );
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A corpus that is not a regular file is refused by kind, at once: `/dev/zero` was read
    /// without end (300 MB/s of memory), a FIFO waited for a writer.
    #[test]
    fn a_corpus_that_is_not_a_regular_file_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pages");
        crate::sys::make_fifo(&fifo).unwrap();
        for (path, kind) in [
            (Path::new("/dev/zero"), "a character device"),
            (dir.path(), "a directory"),
            (fifo.as_path(), "a FIFO"),
        ] {
            let err = load_corpus(path).unwrap_err().to_string();
            assert!(
                err.contains(&format!("is {kind}, not a regular file")),
                "{err}"
            );
        }
        let pages = dir.path().join("ok.pages");
        std::fs::write(&pages, vec![7u8; 2 * PAGE_SIZE]).unwrap();
        assert_eq!(load_corpus(&pages).unwrap().len(), 2 * PAGE_SIZE);
    }
}

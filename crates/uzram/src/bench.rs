//! `uzram bench`: a corpus through a PageStore, read back and verified, with ratio and
//! throughput.
//!
//! Writes go through one of two paths:
//! - [`WritePath::Inline`] (`--backend cpu`): the page range is split into one contiguous
//!   part per thread and every thread calls [`PageStore::write`] with 64 KiB requests, as
//!   the daemon's queue threads do. Compression, arena copies and table updates all run
//!   in parallel, so this path scales with threads (see the README's numbers);
//! - [`WritePath::Batch`] (`--batch`): [`PageStore::write_batch`] through any
//!   [`BatchBackend`] in batches of [`BATCH_PAGES`]; the CPU backend compresses each
//!   batch on `--threads` threads, then the calling thread stores the results. It scales
//!   worse than the inline path (the storing is serial and each batch allocates its
//!   output), which is why `cpu` defaults to inline;
//! - [`WritePath::Gpu`] (`--backend gpu`): `write_batch` through `uzram_gpu::GpuBackend`
//!   in batches of [`GPU_BATCH_PAGES`] (large, so the GPU's slot ring overlaps copies and
//!   kernels); the report adds the GPU's H2D, kernel and D2H device time of the last run.

use std::num::NonZeroUsize;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde::Serialize;
use uzram_core::batch::{BatchBackend, CpuBackend};
use uzram_core::codec::Algorithm;
use uzram_core::{MemoryUsage, PageStore, StoreConfig, PAGE_SIZE};

use crate::cli::BenchArgs;

/// Pages per request on the inline path (64 KiB, a typical swap request).
const REQUEST_PAGES: usize = 16;
/// Pages per `write_batch` call on the batch path.
const BATCH_PAGES: usize = 4096;
/// Pages per `write_batch` call on the GPU path: many slots of the GPU's ring per call.
const GPU_BATCH_PAGES: usize = 65536;

/// How pages get into the store.
enum WritePath {
    /// Each of `threads` threads calls `write` on its own part of the corpus.
    Inline { threads: usize },
    /// `write_batch` through a backend (which parallelises on its own).
    Batch(Box<dyn BatchBackend>),
    /// `write_batch` through the GPU backend.
    Gpu(uzram_gpu::GpuBackend),
}

/// What `uzram bench` reports.
#[derive(Debug, Serialize)]
struct Report {
    pages: u64,
    input_bytes: u64,
    mem_used_bytes: u64,
    ratio: f64,
    compress_gbps: f64,
    decompress_gbps: f64,
    threads: usize,
    algorithm: String,
    backend: String,
    verified: bool,
    /// `inline` (threads calling write) or `batch` (write_batch through the backend).
    path: &'static str,
    /// Stored payload alone (zram's compr_data_size) and input / payload: the ratio
    /// before any arena or table overhead.
    payload_bytes: u64,
    payload_ratio: f64,
    raw_threshold: usize,
    same_pages: u64,
    huge_pages: u64,
    repeat: usize,
    /// Where mem_used_bytes goes (last run).
    memory: Memory,
    /// GPU device time of the last run: host→device copies, kernels, device→host copies
    /// (summed over the ring's slots, so they overlap each other and the wall time).
    #[serde(skip_serializing_if = "Option::is_none")]
    h2d_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    d2h_ms: Option<f64>,
}

/// [`MemoryUsage`] for the JSON report.
#[derive(Debug, Serialize)]
struct Memory {
    payload_bytes: u64,
    table_bytes: u64,
    class_rounding_bytes: u64,
    free_hole_bytes: u64,
    frontier_unused_bytes: u64,
    arena_bookkeeping_bytes: u64,
    side_map_bytes: u64,
}

impl From<MemoryUsage> for Memory {
    fn from(m: MemoryUsage) -> Self {
        Self {
            payload_bytes: m.payload_bytes,
            table_bytes: m.table_bytes,
            class_rounding_bytes: m.class_rounding_bytes,
            free_hole_bytes: m.free_hole_bytes,
            frontier_unused_bytes: m.frontier_unused_bytes,
            arena_bookkeeping_bytes: m.arena_bookkeeping_bytes,
            side_map_bytes: m.side_map_bytes,
        }
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let algorithm = Algorithm::parse(&args.algorithm)?;
    let threads = match args.threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
    };
    ensure!(args.repeat >= 1, "--repeat must be at least 1");
    ensure!(
        (1..=PAGE_SIZE).contains(&args.raw_threshold),
        "--raw-threshold must be in 1..=4096, not {}",
        args.raw_threshold
    );
    let path = write_path(&args.backend, args.batch, algorithm, threads)?;
    let corpus = load_corpus(&args.corpus)?;
    let report = measure(&corpus, algorithm, &args, threads, &path)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_human(&report);
    }
    Ok(if report.verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The write path for `--backend` (and `--batch`). The hook for more backends: build
/// one and return `WritePath::Batch(Box::new(it))`.
fn write_path(
    backend: &str,
    batch: bool,
    algorithm: Algorithm,
    threads: usize,
) -> anyhow::Result<WritePath> {
    match backend {
        "cpu" if batch => Ok(WritePath::Batch(Box::new(CpuBackend::new(
            algorithm,
            NonZeroUsize::new(threads),
        )))),
        "cpu" => Ok(WritePath::Inline { threads }),
        "gpu" => {
            ensure!(
                algorithm == Algorithm::Lz4,
                "the GPU backend produces lz4, not {algorithm}"
            );
            let gpu = uzram_gpu::GpuBackend::new(uzram_gpu::PipelineConfig::default())
                .context("GPU backend unavailable")?;
            Ok(WritePath::Gpu(gpu))
        }
        other => bail!("unknown backend '{other}': cpu or gpu"),
    }
}

fn load_corpus(path: &Path) -> anyhow::Result<Vec<u8>> {
    let data =
        std::fs::read(path).with_context(|| format!("cannot read corpus {}", path.display()))?;
    // The project's corpora ship zstd-compressed; take them as they are.
    let data = if path.extension().is_some_and(|e| e == "zst") {
        zstd::decode_all(&data[..])
            .with_context(|| format!("corpus {} is not valid zstd", path.display()))?
    } else {
        data
    };
    ensure!(!data.is_empty(), "corpus {} is empty", path.display());
    ensure!(
        data.len() % PAGE_SIZE == 0,
        "corpus {} is {} bytes, not a multiple of the 4096-byte page",
        path.display(),
        data.len()
    );
    Ok(data)
}

fn measure(
    corpus: &[u8],
    algorithm: Algorithm,
    args: &BenchArgs,
    threads: usize,
    path: &WritePath,
) -> anyhow::Result<Report> {
    let pages = (corpus.len() / PAGE_SIZE) as u64;
    let mut write_times = Vec::new();
    let mut read_times = Vec::new();
    let mut verified = true;
    let mut last = None;
    let mut gpu_times = None;
    let mut back = vec![0u8; corpus.len()];
    for _ in 0..args.repeat {
        let mut cfg = StoreConfig::new(pages, algorithm);
        cfg.raw_threshold = args.raw_threshold;
        let store = PageStore::new(cfg)?;
        let start = Instant::now();
        match path {
            WritePath::Inline { threads } => write_inline(&store, corpus, *threads)?,
            WritePath::Batch(backend) => {
                write_batches(&store, corpus, backend.as_ref(), BATCH_PAGES)?
            }
            WritePath::Gpu(gpu) => {
                let before = gpu.stats();
                write_batches(&store, corpus, gpu, GPU_BATCH_PAGES)?;
                let after = gpu.stats();
                gpu_times = Some((
                    after.h2d_ms - before.h2d_ms,
                    after.kernel_ms - before.kernel_ms,
                    after.d2h_ms - before.d2h_ms,
                ));
            }
        }
        write_times.push(start.elapsed());
        back.fill(0xa5);
        let start = Instant::now();
        read_parallel(&store, &mut back, threads)?;
        read_times.push(start.elapsed());
        verified &= back == corpus;
        last = Some((store.stats(), store.memory()));
    }
    let (stats, memory) = last.context("no run")?;
    let input = corpus.len() as u64;
    let gbps = |times: &mut Vec<Duration>| input as f64 / median(times).as_secs_f64() / 1e9;
    Ok(Report {
        pages,
        input_bytes: input,
        mem_used_bytes: stats.mem_used_total,
        ratio: input as f64 / stats.mem_used_total as f64,
        compress_gbps: gbps(&mut write_times),
        decompress_gbps: gbps(&mut read_times),
        threads,
        algorithm: algorithm.to_string(),
        backend: args.backend.clone(),
        verified,
        path: match path {
            WritePath::Inline { .. } => "inline",
            WritePath::Batch(_) | WritePath::Gpu(_) => "batch",
        },
        payload_bytes: stats.compr_data_size,
        payload_ratio: input as f64 / stats.compr_data_size.max(1) as f64,
        raw_threshold: args.raw_threshold,
        same_pages: stats.same_pages,
        huge_pages: stats.huge_pages,
        repeat: args.repeat,
        memory: memory.into(),
        h2d_ms: gpu_times.map(|t| t.0),
        kernel_ms: gpu_times.map(|t| t.1),
        d2h_ms: gpu_times.map(|t| t.2),
    })
}

/// `write_batch` over the corpus in calls of `batch_pages` pages.
fn write_batches(
    store: &PageStore,
    corpus: &[u8],
    backend: &dyn BatchBackend,
    batch_pages: usize,
) -> anyhow::Result<()> {
    for (i, chunk) in corpus.chunks(batch_pages * PAGE_SIZE).enumerate() {
        store.write_batch((i * batch_pages) as u64, chunk, backend)?;
    }
    Ok(())
}

/// One contiguous page range per thread, written in `REQUEST_PAGES` requests.
fn write_inline(store: &PageStore, corpus: &[u8], threads: usize) -> anyhow::Result<()> {
    let pages = corpus.len() / PAGE_SIZE;
    let per_thread = pages.div_ceil(threads) * PAGE_SIZE;
    std::thread::scope(|s| {
        let workers: Vec<_> = corpus
            .chunks(per_thread)
            .enumerate()
            .map(|(t, part)| {
                s.spawn(move || -> anyhow::Result<()> {
                    let first = t * per_thread / PAGE_SIZE;
                    for (r, req) in part.chunks(REQUEST_PAGES * PAGE_SIZE).enumerate() {
                        store.write((first + r * REQUEST_PAGES) as u64, req)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a writer thread panicked")))
        })
    })
}

/// Reads everything back on `threads` threads, in `REQUEST_PAGES` requests.
fn read_parallel(store: &PageStore, out: &mut [u8], threads: usize) -> anyhow::Result<()> {
    let pages = out.len() / PAGE_SIZE;
    let per_thread = pages.div_ceil(threads) * PAGE_SIZE;
    std::thread::scope(|s| {
        let workers: Vec<_> = out
            .chunks_mut(per_thread)
            .enumerate()
            .map(|(t, part)| {
                s.spawn(move || -> anyhow::Result<()> {
                    let first = t * per_thread / PAGE_SIZE;
                    for (r, req) in part.chunks_mut(REQUEST_PAGES * PAGE_SIZE).enumerate() {
                        store.read((first + r * REQUEST_PAGES) as u64, req)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a reader thread panicked")))
        })
    })
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn print_human(r: &Report) {
    println!("pages            {}", r.pages);
    println!("input_bytes      {}", r.input_bytes);
    println!("mem_used_bytes   {}", r.mem_used_bytes);
    println!("ratio            {:.4}", r.ratio);
    println!(
        "payload_ratio    {:.4}  (input / compressed payload alone)",
        r.payload_ratio
    );
    println!("compress_gbps    {:.3}", r.compress_gbps);
    println!("decompress_gbps  {:.3}", r.decompress_gbps);
    println!("threads          {}", r.threads);
    println!("algorithm        {}", r.algorithm);
    println!("backend          {} ({} writes)", r.backend, r.path);
    println!(
        "same/huge pages  {} / {}  (raw threshold {} bytes)",
        r.same_pages, r.huge_pages, r.raw_threshold
    );
    println!("verified         {}", r.verified);
    let m = &r.memory;
    let pct = |b: u64| 100.0 * b as f64 / r.mem_used_bytes as f64;
    println!("memory breakdown (% of mem_used_bytes):");
    for (name, bytes) in [
        ("payload", m.payload_bytes),
        ("page table", m.table_bytes),
        ("class rounding", m.class_rounding_bytes),
        ("free holes", m.free_hole_bytes),
        ("newest segment unused", m.frontier_unused_bytes),
        ("arena bookkeeping", m.arena_bookkeeping_bytes),
        ("side maps", m.side_map_bytes),
    ] {
        println!("  {name:<22} {bytes:>12}  {:6.3}%", pct(bytes));
    }
    if let (Some(h2d), Some(kernel), Some(d2h)) = (r.h2d_ms, r.kernel_ms, r.d2h_ms) {
        println!("gpu device time  h2d {h2d:.2} ms, kernel {kernel:.2} ms, d2h {d2h:.2} ms (last run, summed over slots)");
    }
}

//! GPU benchmark: per corpus, one JSON line each for
//! - `cpu`: CpuBackend over all cores of this host (pageable pages in → BatchOutput),
//! - `gpu_e2e`: pinned host pages in → compressed pages in pinned host memory (the ring),
//! - `gpu_backend`: GpuBackend through the BatchBackend seam (pageable in, staging copy),
//! - `gpu_kernel`: the kernel alone on device-resident pages,
//! - `h2d`: a plain pinned host→device copy of the same bytes (the transfer ceiling),
//!
//! plus an exactness check of every page of the corpus (decoded on the CPU).
//!
//! Usage: gpu_bench [--pages N] [--batch-pages N] [--slots N] [--threshold N] [--iters N]
//!        [--ptx FILE] CORPUS.pages.zst...
//! `--ptx` benchmarks another build of the kernel instead of the embedded one.
//! Each corpus is replicated in memory to N pages (default 262144 = 1 GiB); batch and slots
//! default to `PipelineConfig::default()`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use uzram_core::batch::{BatchBackend, BatchOutput, CpuBackend};
use uzram_core::codec::Algorithm;
use uzram_core::PAGE_SIZE;
use uzram_gpu::driver::{DevBuf, Event, HostBuf, Stream};
use uzram_gpu::layout::{kernel_limit, meta_bytes, meta_word, stored_bytes, total_index};
use uzram_gpu::{launch, Gpu, GpuBackend, GpuError, PinnedPages, Pipeline, PipelineConfig};

struct Args {
    pages: usize,
    batch_pages: usize,
    slots: usize,
    threshold: usize,
    iters: usize,
    ptx: Option<PathBuf>,
    corpora: Vec<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let defaults = PipelineConfig::default();
    let mut a = Args {
        pages: 262144,
        batch_pages: defaults.batch_pages,
        slots: defaults.slots,
        threshold: 3625,
        iters: 5,
        ptx: None,
        corpora: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--pages" => a.pages = num("--pages")?,
            "--batch-pages" => a.batch_pages = num("--batch-pages")?,
            "--slots" => a.slots = num("--slots")?,
            "--threshold" => a.threshold = num("--threshold")?,
            "--iters" => a.iters = num("--iters")?.max(1),
            "--ptx" => a.ptx = Some(it.next().ok_or("--ptx needs a file")?.into()),
            s if s.starts_with("--") => return Err(format!("unknown option {s}")),
            s => a.corpora.push(PathBuf::from(s)),
        }
    }
    if a.corpora.is_empty() {
        return Err("give at least one CORPUS.pages.zst".into());
    }
    Ok(a)
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("gpu_bench: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), GpuError> {
    let config = PipelineConfig {
        device: 0,
        batch_pages: args.batch_pages,
        slots: args.slots,
    };
    let gpu = match &args.ptx {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| GpuError::Config(format!("{}: {e}", path.display())))?;
            Gpu::open_with_ptx(0, &text)?
        }
        None => Gpu::open(0)?,
    };
    let mut pipe = Pipeline::on(gpu.clone(), config)?;
    let backend = GpuBackend::from_pipeline(Pipeline::on(gpu.clone(), config)?)?;
    let cpu = CpuBackend::new(Algorithm::Lz4, None);
    let limit = kernel_limit(args.threshold);
    println!(
        "{{\"device\":\"{}\",\"ptx\":\"{}\",\"sms\":{},\"cpu_threads\":{},\"pages\":{},\"batch_pages\":{},\"slots\":{},\"threshold\":{}}}",
        gpu.name(),
        args.ptx.as_ref().map_or("embedded".into(), |p| p.display().to_string()),
        gpu.sm_count(),
        cpu.threads(),
        args.pages,
        args.batch_pages,
        args.slots,
        args.threshold
    );
    for path in &args.corpora {
        let name = common::corpus_name(path);
        let unique = common::load_pages(path);

        // Exactness of every page of the corpus (through the seam), and ratio vs CPU.
        let mut out = BatchOutput::default();
        backend
            .compress(&unique, args.threshold, &mut out)
            .map_err(|e| GpuError::Config(format!("verify batch: {e}")))?;
        let c = common::check(&unique, args.threshold, &out);
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"exact\",\"pages\":{},\"mismatches\":{},\"compressed\":{},\"raw\":{},\"same_filled\":{},\"gpu_ratio\":{:.4},\"cpu_ratio\":{:.4},\"ratio_vs_cpu\":{:.4}}}",
            c.pages,
            c.mismatches,
            c.compressed,
            c.raw,
            c.same_filled,
            unique.len() as f64 / c.gpu_bytes.max(1) as f64,
            unique.len() as f64 / c.cpu_bytes.max(1) as f64,
            c.ratio_vs_cpu()
        );

        // Replicate to the benchmark size, in pageable and in pinned memory.
        let total = args.pages * PAGE_SIZE;
        let pageable: Vec<u8> = unique.iter().copied().cycle().take(total).collect();
        let mut pinned = PinnedPages::new(&gpu, args.pages)?;
        pinned.as_mut_slice().copy_from_slice(&pageable);
        let pinned = Arc::new(pinned);

        // CPU, all cores.
        let mut best = f64::MAX;
        let mut cpu_out = BatchOutput::default();
        for _ in 0..args.iters {
            let t = Instant::now();
            cpu.compress_batch(&pageable, args.threshold, &mut cpu_out)
                .map_err(|e| GpuError::Config(format!("cpu: {e}")))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let cpu_stored: usize = cpu_out.outcomes.iter().map(|&o| stored_bytes(o)).sum();
        let cpu_gbps = gbps(total, best);
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"cpu\",\"threads\":{},\"gbps\":{:.2},\"ratio\":{:.4}}}",
            cpu.threads(),
            cpu_gbps,
            total as f64 / cpu_stored as f64
        );

        // GPU end to end from pinned pages: the ring.
        let mut best = f64::MAX;
        let mut best_stats = pipe.stats();
        for _ in 0..args.iters {
            let before = pipe.stats();
            let t = Instant::now();
            ring_pass(&mut pipe, &pinned, limit)?;
            let secs = t.elapsed().as_secs_f64();
            if secs < best {
                best = secs;
                let after = pipe.stats();
                best_stats = uzram_gpu::GpuStats {
                    pages: after.pages - before.pages,
                    bytes_stored: after.bytes_stored - before.bytes_stored,
                    h2d_ms: after.h2d_ms - before.h2d_ms,
                    kernel_ms: after.kernel_ms - before.kernel_ms,
                    d2h_ms: after.d2h_ms - before.d2h_ms,
                    bytes_d2h: after.bytes_d2h - before.bytes_d2h,
                    ..after
                };
            }
        }
        let e2e = gbps(total, best);
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"gpu_e2e\",\"gbps\":{:.2},\"vs_cpu\":{:.2},\"ratio\":{:.4},\"wall_ms\":{:.2},\"h2d_ms\":{:.2},\"kernel_ms\":{:.2},\"d2h_ms\":{:.2},\"d2h_bytes\":{}}}",
            e2e,
            e2e / cpu_gbps,
            total as f64 / best_stats.bytes_stored as f64,
            best * 1e3,
            best_stats.h2d_ms,
            best_stats.kernel_ms,
            best_stats.d2h_ms,
            best_stats.bytes_d2h
        );

        // GPU through the BatchBackend seam (pageable in, host staging copy, BatchOutput).
        let mut best = f64::MAX;
        let mut gout = BatchOutput::default();
        for _ in 0..args.iters {
            let t = Instant::now();
            backend.compress(&pageable, args.threshold, &mut gout)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"gpu_backend\",\"gbps\":{:.2},\"vs_cpu\":{:.2}}}",
            gbps(total, best),
            gbps(total, best) / cpu_gbps
        );

        // The seam as PageStore::write_batch uses it: the unique corpus in one call, into a
        // fresh BatchOutput each time (its first touch included).
        let mut best = f64::MAX;
        for _ in 0..args.iters {
            let mut fresh = BatchOutput::default();
            let t = Instant::now();
            backend.compress(&unique, args.threshold, &mut fresh)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"gpu_backend_fresh_output\",\"pages\":{},\"gbps\":{:.2}}}",
            unique.len() / PAGE_SIZE,
            gbps(unique.len(), best)
        );
        let mut best = f64::MAX;
        for _ in 0..args.iters {
            let mut fresh = BatchOutput::default();
            let t = Instant::now();
            cpu.compress_batch(&unique, args.threshold, &mut fresh)
                .map_err(|e| GpuError::Config(format!("cpu: {e}")))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"cpu_fresh_output\",\"pages\":{},\"gbps\":{:.2}}}",
            unique.len() / PAGE_SIZE,
            gbps(unique.len(), best)
        );

        // Kernel only and the H2D ceiling, on the same bytes.
        let (kernel_ms, h2d_ms) = kernel_and_copy(&gpu, &pinned, limit, args.iters)?;
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"gpu_kernel\",\"gbps\":{:.2},\"ms\":{:.3}}}",
            gbps(total, kernel_ms / 1e3),
            kernel_ms
        );
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"h2d\",\"gbps\":{:.2},\"ms\":{:.3}}}",
            gbps(total, h2d_ms / 1e3),
            h2d_ms
        );
    }
    Ok(())
}

/// Every page of `src` once through the ring; results land in the slots' pinned output.
fn ring_pass(pipe: &mut Pipeline, src: &Arc<PinnedPages>, limit: u32) -> Result<(), GpuError> {
    let batch = pipe.config().batch_pages;
    let slots = pipe.config().slots;
    let n = src.pages();
    let mut first = 0;
    let mut c = 0;
    while first < n {
        let slot = c % slots;
        if pipe.is_busy(slot) {
            pipe.wait(slot)?;
        }
        let len = batch.min(n - first);
        pipe.submit_pinned(slot, src, first, len, limit)?;
        first += len;
        c += 1;
    }
    for k in 0..slots {
        let slot = (c + k) % slots;
        if pipe.is_busy(slot) {
            pipe.wait(slot)?;
        }
    }
    Ok(())
}

/// Best-of-`iters` device time (ms) of one kernel launch over all pages resident on the
/// device, and of one pinned host→device copy of them.
fn kernel_and_copy(
    gpu: &Arc<uzram_gpu::Gpu>,
    src: &PinnedPages,
    limit: u32,
    iters: usize,
) -> Result<(f64, f64), GpuError> {
    let bytes = src.as_slice().len();
    let pages = src.pages();
    let stream = Stream::new(gpu)?;
    let (a, b) = (Event::new(gpu)?, Event::new(gpu)?);
    let dev_in = DevBuf::new(gpu, bytes)?;
    let scratch = DevBuf::new(gpu, bytes)?;
    let packed = DevBuf::new(gpu, bytes)?;
    let meta = DevBuf::new(gpu, meta_bytes(pages))?;
    let bufs = launch::LaunchBuffers {
        input: dev_in.ptr(),
        scratch: scratch.ptr(),
        packed: packed.ptr(),
        meta: meta.ptr(),
    };
    let mut h2d = f64::MAX;
    for _ in 0..iters {
        a.record(&stream)?;
        // SAFETY: dev_in holds `bytes`; `src` is pinned and outlives the synchronize below.
        unsafe { stream.copy_to_device(dev_in.ptr(), src.as_slice())? };
        b.record(&stream)?;
        b.synchronize()?;
        h2d = h2d.min(f64::from(a.elapsed_ms(&b)?));
    }
    let mut kernel = f64::MAX;
    for _ in 0..iters {
        a.record(&stream)?;
        // SAFETY: the buffers are sized for `pages` pages and live until the synchronize.
        unsafe { launch::compress_pages(gpu, &stream, bufs, pages as u32, limit)? };
        b.record(&stream)?;
        b.synchronize()?;
        kernel = kernel.min(f64::from(a.elapsed_ms(&b)?));
    }
    // Keep the sizes honest: the kernel ran on real data (count the compressed pages).
    let mut host_meta = HostBuf::new(gpu, meta_bytes(pages))?;
    // SAFETY: host_meta is pinned, meta_bytes(pages) long, read only after the synchronize.
    unsafe { stream.copy_to_host(host_meta.as_mut_slice(), meta.ptr())? };
    stream.synchronize()?;
    let compressed = (0..pages)
        .filter_map(|i| meta_word(host_meta.as_slice(), i))
        .filter(|&v| v != 0 && v != u32::MAX)
        .count();
    let packed_total = meta_word(host_meta.as_slice(), total_index(pages)).unwrap_or(0);
    eprintln!(
        "kernel-only pass: {compressed} of {pages} pages compressed, {packed_total} packed bytes"
    );
    Ok((kernel, h2d))
}

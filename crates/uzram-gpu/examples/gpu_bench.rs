//! GPU benchmark and exactness check, per corpus and per parse (`fast`, `high`). One JSON
//! line per measurement, then a summary table:
//! - `exact`: every page of the corpus through GPU slots, decoded on the CPU (0 mismatches
//!   and 0 device rejections expected), and the ratio under zram's rules against liblz4's
//!   default level and LZ4_compress_HC at levels 9 and 12 on the same pages;
//! - `decode`: one CPU thread decoding the GPU's blocks with uzram's decoder, against the
//!   same decoder on liblz4 default-level blocks of the same pages, in turns;
//! - `ring`: pinned slots in, checked compressed pages out, `--slots` slots in flight
//!   (one graph launch per slot, completions waited for by a sleeping thread);
//! - `kernel`: the compression kernel alone on device-resident pages, and with the check;
//! - `cpu`: uzram's LZ4 on all host cores; `h2d`: the pinned copy ceiling.
//!
//! Usage: gpu_bench [--pages N] [--slots N] [--slot-pages N] [--threshold N] [--iters N]
//!        [--parse fast|high|both] [--no-graphs] [--ptx FILE] CORPUS.pages.zst...
//! Each corpus is replicated to N pages (default 262144 = 1 GiB) for the throughput runs.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use uzram_core::batch::{meta_bytes, SlotBackend};
use uzram_core::codec::{Lz4Codec, PageCodec};
use uzram_core::page::{page_to_words, same_filled_word};
use uzram_core::{PAGE_SIZE, PAGE_WORDS};
use uzram_gpu::driver::{DevBuf, Event, HostBuf, Stream};
use uzram_gpu::launch::{self, SlotBuffers, CTRL_SERIAL_WALKS, CTRL_WORDS};
use uzram_gpu::{Gpu, GpuConfig, GpuError, GpuSlots, Parse};

struct Args {
    pages: usize,
    slots: usize,
    slot_pages: usize,
    threshold: usize,
    iters: usize,
    parses: Vec<Parse>,
    graphs: bool,
    ptx: Option<PathBuf>,
    corpora: Vec<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let d = GpuConfig::default();
    let mut a = Args {
        pages: 262144,
        slots: d.slots,
        slot_pages: d.slot_pages,
        threshold: 3625,
        iters: 5,
        parses: vec![Parse::Fast],
        graphs: true,
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
            "--slots" => a.slots = num("--slots")?,
            "--slot-pages" => a.slot_pages = num("--slot-pages")?,
            "--threshold" => a.threshold = num("--threshold")?,
            "--iters" => a.iters = num("--iters")?.max(1),
            "--no-graphs" => a.graphs = false,
            "--parse" => {
                a.parses = match it.next().as_deref() {
                    Some("both") => vec![Parse::Fast, Parse::High],
                    Some(p) => vec![p.parse::<Parse>().map_err(|e| e.to_string())?],
                    None => return Err("--parse needs fast, high or both".into()),
                }
            }
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

/// liblz4 reference sizes and blocks of a corpus, under zram's rules.
struct Reference {
    default_bytes: usize,
    hc9_bytes: usize,
    hc12_bytes: usize,
    /// liblz4 default-level blocks (for the decode comparison); empty for raw/same pages.
    default_blocks: Vec<Vec<u8>>,
}

/// One liblz4 compression of a page: bytes stored (0 same-filled, 4096 raw) and the block.
fn liblz4(page: &[u8], level: Option<i32>, threshold: usize) -> (usize, Vec<u8>) {
    let page: &[u8; PAGE_SIZE] = page.try_into().expect("page");
    if same_filled_word(page).is_some() {
        return (0, Vec::new());
    }
    let mut out = vec![0u8; PAGE_SIZE + 64];
    let n = common::liblz4_compress(page, level, &mut out);
    if n == 0 || n >= threshold {
        return (PAGE_SIZE, Vec::new());
    }
    out.truncate(n);
    (n, out)
}

fn reference(unique: &[u8], threshold: usize) -> Reference {
    let mut r = Reference {
        default_bytes: 0,
        hc9_bytes: 0,
        hc12_bytes: 0,
        default_blocks: Vec::new(),
    };
    for page in unique.chunks_exact(PAGE_SIZE) {
        let (n, block) = liblz4(page, None, threshold);
        r.default_bytes += n;
        r.default_blocks.push(block);
        r.hc9_bytes += liblz4(page, Some(9), threshold).0;
        r.hc12_bytes += liblz4(page, Some(12), threshold).0;
    }
    r
}

/// Single-thread decode speed (GB/s of pages) of `ours` and of `reference` with uzram's
/// decoder, measured in turns (a fifth of a second each, best of `iters` turns each), so that
/// both see the same host: this host's speed was seen to swing by 1.75x within a minute
/// (docs/bench/gpu-runs.md).
fn decode_gbps(ours: &[&[u8]], reference: &[&[u8]], iters: usize) -> (f64, f64) {
    let mut codec = Lz4Codec::new();
    let mut out = [0u8; PAGE_SIZE];
    let mut best = [f64::MAX; 2];
    for _ in 0..iters {
        for (i, blocks) in [ours, reference].into_iter().enumerate() {
            let t = Instant::now();
            let mut rounds = 0;
            while rounds == 0 || t.elapsed().as_secs_f64() < 0.2 {
                for b in blocks {
                    let _ = codec.decompress(b, &mut out);
                }
                rounds += 1;
            }
            best[i] = best[i].min(t.elapsed().as_secs_f64() / rounds as f64);
        }
    }
    (
        gbps(ours.len() * PAGE_SIZE, best[0]),
        gbps(reference.len() * PAGE_SIZE, best[1]),
    )
}

fn run(args: &Args) -> Result<(), GpuError> {
    let gpu = match &args.ptx {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| GpuError::Config(format!("{}: {e}", path.display())))?;
            Gpu::open_with_ptx(0, &text)?
        }
        None => Gpu::open(0)?,
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "{{\"device\":\"{}\",\"ptx\":\"{}\",\"sms\":{},\"cpu_threads\":{threads},\"pages\":{},\"slots\":{},\"slot_pages\":{},\"graphs\":{},\"threshold\":{}}}",
        gpu.name(),
        args.ptx.as_ref().map_or("embedded".into(), |p| p.display().to_string()),
        gpu.sm_count(),
        args.pages,
        args.slots,
        args.slot_pages,
        args.graphs,
        args.threshold
    );
    let mut summary = Vec::new();
    for path in &args.corpora {
        let name = common::corpus_name(path);
        let unique = common::load_pages(path);
        let total = args.pages * PAGE_SIZE;
        let replicated: Vec<u8> = unique.iter().copied().cycle().take(total).collect();
        let refs = reference(&unique, args.threshold);
        let ratio = |bytes: usize| unique.len() as f64 / bytes.max(1) as f64;
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"liblz4\",\"default_ratio\":{:.4},\"hc9_ratio\":{:.4},\"hc12_ratio\":{:.4}}}",
            ratio(refs.default_bytes),
            ratio(refs.hc9_bytes),
            ratio(refs.hc12_bytes)
        );
        let cpu = cpu_gbps(&replicated, args.threshold, threads, args.iters);
        println!(
            "{{\"corpus\":\"{name}\",\"test\":\"cpu\",\"threads\":{threads},\"gbps\":{cpu:.2}}}"
        );
        let h2d = h2d_gbps(&gpu, &replicated[..total.min(1 << 30)], args.iters)?;
        println!("{{\"corpus\":\"{name}\",\"test\":\"h2d\",\"gbps\":{h2d:.2}}}");
        let default_blocks: Vec<&[u8]> = refs
            .default_blocks
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| b.as_slice())
            .collect();
        for &parse in &args.parses {
            let cfg = GpuConfig {
                slots: args.slots,
                slot_pages: args.slot_pages,
                parse,
                graphs: args.graphs,
                ..GpuConfig::default()
            };
            let slots = GpuSlots::on(vec![gpu.clone()], cfg)?;
            let results = common::run_slots(&slots, &unique, args.threshold)
                .map_err(|e| GpuError::Config(e.to_string()))?;
            let c = common::check(&unique, args.threshold, &results);
            let gpu_ratio = ratio(c.gpu_bytes);
            println!(
                "{{\"corpus\":\"{name}\",\"parse\":\"{}\",\"test\":\"exact\",\"pages\":{},\"mismatches\":{},\"rejected\":{},\"compressed\":{},\"raw\":{},\"same_filled\":{},\"ratio\":{gpu_ratio:.4},\"vs_lz4\":{:.4},\"vs_hc9\":{:.4},\"vs_hc12\":{:.4}}}",
                parse.name(),
                c.pages,
                c.mismatches,
                c.rejected,
                c.compressed,
                c.raw,
                c.same_filled,
                gpu_ratio / ratio(refs.default_bytes),
                gpu_ratio / ratio(refs.hc9_bytes),
                gpu_ratio / ratio(refs.hc12_bytes)
            );
            let blocks: Vec<&[u8]> = results
                .iter()
                .filter_map(|r| match r {
                    common::Owned::Block(b) => Some(b.as_slice()),
                    _ => None,
                })
                .collect();
            let (decode, lz4_decode) = decode_gbps(&blocks, &default_blocks, args.iters);
            println!(
                "{{\"corpus\":\"{name}\",\"parse\":\"{}\",\"test\":\"decode\",\"gpu_blocks_gbps\":{decode:.3},\"lz4_default_blocks_gbps\":{lz4_decode:.3},\"vs_lz4\":{:.4}}}",
                parse.name(),
                decode / lz4_decode
            );
            let ring = ring_gbps(&slots, &replicated, args.threshold, args.iters)?;
            println!(
                "{{\"corpus\":\"{name}\",\"parse\":\"{}\",\"test\":\"ring\",\"gbps\":{:.2},\"vs_cpu\":{:.2},\"packed_fraction\":{:.3}}}",
                parse.name(),
                ring.0,
                ring.0 / cpu,
                ring.1
            );
            let kernel_pages = args.pages.min(65536);
            let (kernel, with_check) = kernel_gbps(
                &gpu,
                parse,
                &replicated[..kernel_pages * PAGE_SIZE],
                args.threshold,
                args.iters,
            )?;
            println!(
                "{{\"corpus\":\"{name}\",\"parse\":\"{}\",\"test\":\"kernel\",\"pages\":{kernel_pages},\"gbps\":{kernel:.2},\"with_check_gbps\":{with_check:.2}}}",
                parse.name()
            );
            summary.push(format!(
                "{name:<12} {:<5} ratio {gpu_ratio:.4} (x{:.3} lz4, x{:.3} hc9, x{:.3} hc12)  ring {:6.2} GB/s  kernel {kernel:6.2} (+check {with_check:6.2})  cpu {cpu:5.2}  h2d {h2d:5.2}  decode x{:.3}  mismatches {} rejected {}",
                parse.name(),
                gpu_ratio / ratio(refs.default_bytes),
                gpu_ratio / ratio(refs.hc9_bytes),
                gpu_ratio / ratio(refs.hc12_bytes),
                ring.0,
                decode / lz4_decode,
                c.mismatches,
                c.rejected
            ));
        }
    }
    println!("== summary");
    for line in summary {
        println!("{line}");
    }
    Ok(())
}

/// uzram's LZ4 over `pages` on `threads` threads: best-of-`iters` GB/s.
fn cpu_gbps(pages: &[u8], threshold: usize, threads: usize, iters: usize) -> f64 {
    let per = (pages.len() / PAGE_SIZE).div_ceil(threads) * PAGE_SIZE;
    let mut best = f64::MAX;
    for _ in 0..iters {
        let t = Instant::now();
        std::thread::scope(|s| {
            for part in pages.chunks(per) {
                s.spawn(move || {
                    let mut codec = Lz4Codec::new();
                    let mut sum = 0usize;
                    for p in part.chunks_exact(PAGE_SIZE) {
                        sum += common::cpu_bytes(&mut codec, p.try_into().unwrap(), threshold);
                    }
                    std::hint::black_box(sum);
                });
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    gbps(pages.len(), best)
}

/// The pinned host→device copy of `pages`: best-of-`iters` GB/s.
fn h2d_gbps(gpu: &Arc<Gpu>, pages: &[u8], iters: usize) -> Result<f64, GpuError> {
    let mut host = HostBuf::new(gpu, pages.len())?;
    host.as_mut_slice().copy_from_slice(pages);
    let dev = DevBuf::new(gpu, pages.len())?;
    let stream = Stream::new(gpu)?;
    let (a, b) = (Event::new(gpu)?, Event::new(gpu)?);
    let mut best = f64::MAX;
    for _ in 0..iters {
        a.record(&stream)?;
        // SAFETY: `host` is pinned and outlives the synchronize; `dev` holds the bytes.
        unsafe { stream.copy_to_device(dev.ptr(), host.as_slice().as_ptr(), pages.len())? };
        b.record(&stream)?;
        b.synchronize()?;
        best = best.min(f64::from(a.elapsed_ms(&b)?) / 1e3);
    }
    Ok(gbps(pages.len(), best))
}

/// Every slot filled once from `pages`, then `pages.len()` bytes' worth of slot runs with
/// every slot in flight: best-of-`iters` GB/s, and the fraction of bytes that came back.
fn ring_gbps(
    slots: &GpuSlots,
    pages: &[u8],
    threshold: usize,
    iters: usize,
) -> Result<(f64, f64), GpuError> {
    let n = slots.slots();
    let per = slots.slot_pages();
    for s in 0..n {
        let input = slots.input(s);
        for i in 0..per {
            let at = ((s * per + i) % (pages.len() / PAGE_SIZE)) * PAGE_SIZE;
            page_to_words(
                pages[at..at + PAGE_SIZE].try_into().unwrap(),
                &input[i * PAGE_WORDS..(i + 1) * PAGE_WORDS],
            );
        }
    }
    let runs = (pages.len() / PAGE_SIZE).div_ceil(per);
    let err = |e: uzram_core::batch::BackendError| GpuError::Config(e.to_string());
    let mut best = f64::MAX;
    let mut packed = 0usize;
    for _ in 0..iters {
        packed = 0;
        let t = Instant::now();
        for s in 0..n.min(runs) {
            slots.submit(s, per, threshold).map_err(err)?;
        }
        for r in 0..runs {
            let s = r % n;
            slots
                .complete(s, &mut |out| packed += out.packed_bytes())
                .map_err(err)?;
            if r + n < runs {
                slots.submit(s, per, threshold).map_err(err)?;
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = runs * per * PAGE_SIZE;
    Ok((gbps(bytes, best), packed as f64 / bytes as f64))
}

/// The compression kernel alone, and followed by the check, on device-resident pages:
/// best-of-`iters` GB/s each.
fn kernel_gbps(
    gpu: &Arc<Gpu>,
    parse: Parse,
    pages: &[u8],
    threshold: usize,
    iters: usize,
) -> Result<(f64, f64), GpuError> {
    let n = pages.len() / PAGE_SIZE;
    let bytes = pages.len();
    let stream = Stream::new(gpu)?;
    let (a, b, c) = (Event::new(gpu)?, Event::new(gpu)?, Event::new(gpu)?);
    let dev: Vec<DevBuf> = launch::device_buffer_bytes(n)
        .iter()
        .map(|&len| DevBuf::new(gpu, len))
        .collect::<Result<_, _>>()?;
    let out_meta = HostBuf::mapped(gpu, meta_bytes(n))?;
    let out_packed = HostBuf::mapped(gpu, bytes)?;
    let mut host = HostBuf::new(gpu, bytes)?;
    host.as_mut_slice().copy_from_slice(pages);
    let mut ctrl = HostBuf::new(gpu, CTRL_WORDS * 4)?;
    let kernel = parse.kernel();
    let copied = launch::copied_bytes(kernel, n);
    ctrl.as_mut_slice()
        .copy_from_slice(&launch::control_words(n, threshold, copied));
    let bufs = SlotBuffers {
        input: dev[0].ptr(),
        scratch: dev[1].ptr(),
        packed: dev[2].ptr(),
        meta: dev[3].ptr(),
        ctrl: dev[4].ptr(),
        out_packed: out_packed.device_ptr().unwrap_or(0),
        out_meta: out_meta.device_ptr().unwrap_or(0),
    };
    // SAFETY: pinned sources that outlive the synchronize; device buffers of their size.
    unsafe { stream.copy_to_device(bufs.input, host.as_slice().as_ptr(), bytes)? };
    let (mut only, mut checked) = (f64::MAX, f64::MAX);
    for _ in 0..iters {
        // SAFETY: the control words reset the packed counter; buffers as above.
        unsafe {
            stream.copy_to_device(bufs.ctrl, ctrl.as_slice().as_ptr(), CTRL_WORDS * 4)?;
            a.record(&stream)?;
            launch::compress(gpu, &stream, kernel, bufs, n as u32)?;
            b.record(&stream)?;
            launch::verify(gpu, &stream, bufs, n as u32)?;
            launch::copy_packed(&stream, &out_packed, bufs.packed, copied)?;
            c.record(&stream)?;
        }
        c.synchronize()?;
        only = only.min(f64::from(a.elapsed_ms(&b)?) / 1e3);
        checked = checked.min(f64::from(a.elapsed_ms(&c)?) / 1e3);
    }
    let out = uzram_core::batch::SlotOutput::new(
        n,
        out_meta.as_slice(),
        out_packed.as_slice(),
        threshold,
    )
    .map_err(|e| GpuError::Config(e.to_string()))?;
    let rejected = (0..n)
        .filter(|&i| matches!(out.page(i), Ok(uzram_core::batch::PageResult::Rejected)))
        .count();
    let mut words = [0u8; CTRL_WORDS * 4];
    // SAFETY: `words` has the control words' size and is read only after the synchronize
    // below; the stream has finished every launch that writes them (`c.synchronize`).
    unsafe { stream.copy_to_host(&mut words, bufs.ctrl)? };
    stream.synchronize()?;
    let walked = u32::from_le_bytes(
        words[CTRL_SERIAL_WALKS * 4..CTRL_SERIAL_WALKS * 4 + 4]
            .try_into()
            .unwrap_or_default(),
    );
    eprintln!(
        "kernel-only pass ({}): {n} pages, {} packed bytes, {rejected} rejected, \
         {walked} blocks the check walked serially (no usable hints)",
        parse.name(),
        out.packed_bytes()
    );
    Ok((gbps(bytes, only), gbps(bytes, checked)))
}

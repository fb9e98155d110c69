//! Medians over runs, as JSON and as a side-by-side table.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use uzram_core::PAGE_SIZE;

use super::measure::{Overwritten, Run, Setup, Writer};
use crate::config::Backend;

/// What `uzram bench` reports for one corpus and backend.
#[derive(Debug, Serialize)]
#[cfg_attr(test, derive(Default))]
pub struct Report {
    pub corpus: String,
    /// As asked (`auto` included).
    pub backend_asked: &'static str,
    /// The backend that served writes.
    pub backend: &'static str,
    pub algorithm: String,
    /// Stored pages carried checksums, checked on every read.
    pub checksums: bool,
    /// Writes moved by ublk's user copy (straight into staging) rather than in the
    /// request's buffer.
    pub user_copy: bool,
    /// Request buffers each writer filled in turn (`--request-buffers`).
    pub request_buffers: usize,
    /// Where the writers ran (`--queue-affinity`): `kernel`, each pinned to its queue's
    /// CPUs as libublk pins the daemon's queue threads, or `any`.
    pub queue_affinity: &'static str,
    /// CPU-seconds per GiB of the stand-in for the kernel's copy of each written request
    /// (a `memcpy`, in the wall time, left out of `cpu_s_per_gib`; median).
    pub kernel_copy_s_per_gib: f64,
    pub queues: usize,
    pub repeat: usize,
    pub warmup: usize,
    pub pages: usize,
    pub bytes: u64,
    /// Bytes ÷ time until everything was compressed (median).
    pub ingest_gbps: f64,
    /// Bytes ÷ time until every write was acknowledged (median).
    pub ack_gbps: f64,
    pub ack_s: f64,
    /// When the first writer had written its equal share (median): against `ack_s`, how
    /// unevenly the writers went.
    pub first_writer_done_s: f64,
    /// The median writer (by when it was done) and the last one: when each was done, its
    /// own CPU-seconds, and the seconds it was runnable but waited for a CPU (medians over
    /// runs). What is left of `done` beyond the two, the writer slept.
    pub median_writer: WriterReport,
    pub last_writer: WriterReport,
    pub compressed_s: f64,
    /// Process CPU-seconds per GiB ingested, the timing reader's own left out (median).
    pub cpu_s_per_gib: f64,
    /// Page faults of the process per GiB ingested (median): memory the store took.
    pub faults_per_gib: f64,
    /// CPU-seconds per GiB by thread role (queues, installers, the pool keeper, reader, other),
    /// medians.
    pub cpu_s_per_gib_by_role: BTreeMap<String, f64>,
    /// Seconds per GiB the GPU ring's installers spent copying objects into the arena
    /// (`ring_install_copy_us`; 0 without a ring), median: the share of their CPU the
    /// device's copy engine could take over.
    pub install_copy_s_per_gib: f64,
    /// Bytes per GiB of pages the GPU's copy engine placed in the store
    /// (`ring_placed_bytes`; 0 without placement), median.
    pub placed_bytes_per_gib: f64,
    pub read_idle_p50_us: f64,
    pub read_idle_p99_us: f64,
    pub read_busy_p50_us: f64,
    pub read_busy_p99_us: f64,
    pub busy_reads: usize,
    /// orig_data_size ÷ mem_used_total at the end (median).
    pub ratio: f64,
    /// orig_data_size ÷ compr_data_size (payload alone).
    pub payload_ratio: f64,
    pub mem_used_bytes: u64,
    /// Fixed backend memory outside the store (GPU ring: pinned host, device).
    pub backend_pinned_bytes: u64,
    pub backend_device_bytes: u64,
    /// Every page of every run read back exactly.
    pub verified: bool,
    /// The backend's counters at the end of the last run.
    pub backend_stats: BTreeMap<String, u64>,
    /// Runs whose GPU was retired (a failure, a hang): their writes went to the CPU from
    /// then on, so their numbers are not the GPU path's.
    pub gpu_retired_runs: usize,
    /// `--recompress`: every page marked idle and recompressed after the writes (medians).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recompress: Option<RecompressReport>,
    /// `--writeback`: the lower half written back after that (medians).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub writeback: Option<WritebackReport>,
    /// `--overwrites`: the passes after the first write (medians). The fields above are the
    /// first write's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overwrite: Option<OverwriteReport>,
}

/// What writing every page again did, medians over runs.
#[derive(Debug, Serialize)]
pub struct OverwriteReport {
    pub passes: usize,
    /// Bytes written ÷ the passes' time until everything was installed.
    pub ingest_gbps: f64,
    /// Process CPU-seconds per GiB written, as `cpu_s_per_gib`.
    pub cpu_s_per_gib: f64,
    pub cpu_s_per_gib_by_role: BTreeMap<String, f64>,
    pub read_busy_p50_us: f64,
    pub read_busy_p99_us: f64,
    /// orig_data_size ÷ mem_used_total after the last pass, the holes the overwrites left
    /// in the arena included.
    pub ratio: f64,
    /// The same after a compaction, which the daemon's worker runs once writes pause.
    pub ratio_compacted: f64,
    /// The arena's free holes after the last pass ÷ the store's memory then.
    pub holes_share: f64,
    /// How long that compaction took.
    pub compact_s: f64,
}

/// The thread roles `uzram bench` reports CPU for.
const ROLES: [&str; 6] = [
    "queues",
    "installers",
    "submitter",
    "keeper",
    "reader",
    "other",
];

/// Median CPU-seconds per GiB of each role in [`ROLES`], from each run's nanoseconds by role
/// (`of`) over its `gib` written.
fn by_role(
    runs: &[Run],
    of: impl Fn(&Run) -> Option<&BTreeMap<&'static str, u64>>,
    gib: f64,
) -> BTreeMap<String, f64> {
    ROLES
        .iter()
        .map(|role| {
            let per_gib = median(
                runs.iter()
                    .filter_map(&of)
                    .map(|roles| roles.get(role).copied().unwrap_or(0) as f64 / 1e9 / gib)
                    .collect(),
            );
            (role.to_string(), per_gib)
        })
        .collect()
}

fn overwrite_report(runs: &[Run], bytes: u64) -> Option<OverwriteReport> {
    let os: Vec<_> = runs.iter().filter_map(|r| r.overwritten.as_ref()).collect();
    let last = os.last()?;
    let mm = |f: &dyn Fn(&Overwritten) -> f64| median(os.iter().map(|o| f(o)).collect());
    let written = |o: &Overwritten| bytes as f64 * o.passes as f64;
    let gib = bytes as f64 * last.passes as f64 / (1u64 << 30) as f64;
    Some(OverwriteReport {
        passes: last.passes,
        ingest_gbps: mm(&|o| written(o) / o.compressed.as_secs_f64().max(1e-9) / 1e9),
        cpu_s_per_gib: mm(&|o| o.cpu.as_secs_f64() / (written(o) / (1u64 << 30) as f64)),
        cpu_s_per_gib_by_role: by_role(
            runs,
            |r| r.overwritten.as_ref().map(|o| &o.cpu_by_role),
            gib,
        ),
        read_busy_p50_us: mm(&|o| pct(&o.busy_reads, 0.50)),
        read_busy_p99_us: mm(&|o| pct(&o.busy_reads, 0.99)),
        ratio: mm(&|o| o.orig_bytes as f64 / o.mem_used.max(1) as f64),
        ratio_compacted: mm(&|o| o.orig_bytes as f64 / o.mem_used_compacted.max(1) as f64),
        holes_share: mm(&|o| o.hole_bytes as f64 / o.mem_used.max(1) as f64),
        compact_s: mm(&|o| o.compact.as_secs_f64()),
    })
}

/// What writing back half the device did, medians over runs.
#[derive(Debug, Serialize)]
pub struct WritebackReport {
    /// Pages written back (last run).
    pub pages: u64,
    /// Disk bytes written per page written back.
    pub disk_bytes_per_page: f64,
    /// That ÷ 4096, what zram writes for each page (padded, also with compressed_writeback).
    pub disk_bytes_over_zram: f64,
    /// Disk bytes ÷ the pages' compressed bytes in RAM (the seal and the packing).
    pub disk_over_payload: f64,
    /// Uncompressed GB written back per second of the pass.
    pub gbps: f64,
    /// Reads of pages in RAM before the pass and while it ran, p50 and p99, µs.
    pub ram_idle_p50_us: f64,
    pub ram_idle_p99_us: f64,
    pub ram_busy_p50_us: f64,
    pub ram_busy_p99_us: f64,
    /// Reads while it ran.
    pub ram_busy_reads: usize,
    /// Reads of written-back pages, p50 and p99, µs.
    pub disk_p50_us: f64,
    pub disk_p99_us: f64,
    /// One queue thread serving 16 one-page reads at a time, every other one for a
    /// written-back page (`queue_reads.rs`): with those read synchronously on the thread,
    /// and through its ring. `None` without io_uring.
    pub queue_inline: Option<QueueReport>,
    pub queue_ring: Option<QueueReport>,
}

/// Latencies of one queue's mixed reads, medians over runs.
#[derive(Debug, Serialize)]
pub struct QueueReport {
    /// Requests for pages in RAM: from their arrival to their completion, p50 and p99, µs.
    pub ram_p50_us: f64,
    pub ram_p99_us: f64,
    /// Requests for written-back pages, the same.
    pub disk_p50_us: f64,
    pub disk_p99_us: f64,
    /// Requests served per second.
    pub requests_per_s: f64,
}

/// What recompressing every page did, medians over runs.
#[derive(Debug, Serialize)]
pub struct RecompressReport {
    /// The recompressor (`zstd:LEVEL`, `zstd-gpu`, `lz4-gpu`, `lz4-gpu-dict`).
    pub recompressor: String,
    /// The idle set's memory (the store's beyond its page table) after ÷ before.
    pub memory_after_over_before: f64,
    /// Payload after ÷ before.
    pub payload_after_over_before: f64,
    pub held_before_bytes: u64,
    pub held_after_bytes: u64,
    /// Uncompressed GB recompressed per second of the pass (one thread).
    pub gbps: f64,
    /// CPU-seconds per GiB recompressed.
    pub cpu_s_per_gib: f64,
    /// Pages rewritten ÷ pages tried.
    pub rewritten_share: f64,
    /// Seconds (wall, and CPU) of what the recompressor does once before its first pass:
    /// `lz4-gpu-dict` trains the device's dictionary and loads the GPU with it; 0 for the
    /// others. Not in `gbps` or `cpu_s_per_gib`.
    pub prepare_s: f64,
    pub prepare_cpu_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        // Even: the mean of the middle two, not the upper one (of 2 runs, the best).
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn pct(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    f64::from(sorted[i]) / 1e3
}

/// One writer of each run, picked by its place in the finishing order.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(test, derive(Default))]
pub struct WriterReport {
    pub done_s: f64,
    pub cpu_s: f64,
    pub runnable_s: f64,
}

impl WriterReport {
    fn of(runs: &[Run], pick: impl Fn(&[Writer]) -> Option<&Writer>) -> Self {
        let m = |f: &dyn Fn(&Writer) -> Duration| {
            median(
                runs.iter()
                    .filter_map(|r| pick(&r.writers))
                    .map(|w| f(w).as_secs_f64())
                    .collect(),
            )
        };
        Self {
            done_s: m(&|w| w.done),
            cpu_s: m(&|w| w.cpu),
            runnable_s: m(&|w| w.runnable),
        }
    }
}

impl Report {
    pub fn new(corpus: &str, asked: Backend, setup: &Setup, runs: &[Run]) -> Self {
        let bytes = (setup.pages * PAGE_SIZE) as u64;
        let secs = |d: Duration| d.as_secs_f64().max(1e-9);
        let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let last = runs.last();
        Self {
            corpus: corpus.to_string(),
            backend_asked: asked.name(),
            backend: last.map_or("?", |r| r.backend),
            algorithm: setup.algorithm.to_string(),
            checksums: setup.checksums,
            user_copy: setup.user_copy,
            request_buffers: setup.request_buffers,
            queue_affinity: setup.placement.name(),
            kernel_copy_s_per_gib: m(&|r| {
                r.writers
                    .iter()
                    .map(|w| w.kernel_copy.as_secs_f64())
                    .sum::<f64>()
                    / (bytes as f64 / (1u64 << 30) as f64)
            }),
            queues: setup.queues,
            repeat: runs.len(),
            warmup: setup.warmup,
            pages: setup.pages,
            bytes,
            ingest_gbps: m(&|r| bytes as f64 / secs(r.compressed) / 1e9),
            ack_gbps: m(&|r| bytes as f64 / secs(r.ack) / 1e9),
            ack_s: m(&|r| r.ack.as_secs_f64()),
            first_writer_done_s: m(&|r| r.writers.first().map_or(0.0, |w| w.done.as_secs_f64())),
            median_writer: WriterReport::of(runs, |ws| ws.get(ws.len() / 2)),
            last_writer: WriterReport::of(runs, |ws| ws.last()),
            compressed_s: m(&|r| r.compressed.as_secs_f64()),
            cpu_s_per_gib: m(&|r| r.cpu.as_secs_f64() / (bytes as f64 / (1u64 << 30) as f64)),
            faults_per_gib: m(&|r| r.faults as f64 / (bytes as f64 / (1u64 << 30) as f64)),
            cpu_s_per_gib_by_role: by_role(
                runs,
                |r| Some(&r.cpu_by_role),
                bytes as f64 / (1u64 << 30) as f64,
            ),
            install_copy_s_per_gib: m(&|r| {
                r.first_pass_stat("ring_install_copy_us")
                    .map_or(0.0, |us| us as f64 / 1e6)
                    / (bytes as f64 / (1u64 << 30) as f64)
            }),
            placed_bytes_per_gib: m(&|r| {
                r.first_pass_stat("ring_placed_bytes").unwrap_or(0) as f64
                    / (bytes as f64 / (1u64 << 30) as f64)
            }),
            read_idle_p50_us: m(&|r| pct(&r.idle_reads, 0.50)),
            read_idle_p99_us: m(&|r| pct(&r.idle_reads, 0.99)),
            read_busy_p50_us: m(&|r| pct(&r.busy_reads, 0.50)),
            read_busy_p99_us: m(&|r| pct(&r.busy_reads, 0.99)),
            busy_reads: last.map_or(0, |r| r.busy_reads.len()),
            ratio: m(&|r| r.orig_bytes as f64 / r.mem_used.max(1) as f64),
            payload_ratio: m(&|r| r.orig_bytes as f64 / r.compr_bytes.max(1) as f64),
            mem_used_bytes: last.map_or(0, |r| r.mem_used),
            backend_pinned_bytes: last.map_or(0, |r| r.backend_pinned),
            backend_device_bytes: last.map_or(0, |r| r.backend_device),
            verified: runs.iter().all(|r| r.verified),
            gpu_retired_runs: runs
                .iter()
                .filter(|r| {
                    r.backend_stat("ring_backend_retired")
                        .is_some_and(|v| v > 0)
                })
                .count(),
            backend_stats: last
                .map(|r| r.backend_stats.iter().cloned().collect())
                .unwrap_or_default(),
            recompress: setup.recompress.and_then(|codec| {
                let rs: Vec<_> = runs.iter().filter_map(|r| r.recompressed).collect();
                let last = rs.last()?;
                let mm = |f: &dyn Fn(&super::measure::Recompressed) -> f64| {
                    median(rs.iter().map(f).collect())
                };
                let gib = |r: &super::measure::Recompressed| {
                    r.tried as f64 * PAGE_SIZE as f64 / (1u64 << 30) as f64
                };
                Some(RecompressReport {
                    recompressor: codec.name(),
                    memory_after_over_before: mm(&|r| {
                        r.held_after as f64 / r.held_before.max(1) as f64
                    }),
                    payload_after_over_before: mm(&|r| {
                        r.compr_after as f64 / r.compr_before.max(1) as f64
                    }),
                    held_before_bytes: last.held_before,
                    held_after_bytes: last.held_after,
                    gbps: mm(&|r| r.tried as f64 * PAGE_SIZE as f64 / secs(r.wall) / 1e9),
                    cpu_s_per_gib: mm(&|r| times(r.cpu.as_secs_f64(), gib(r))),
                    rewritten_share: mm(&|r| r.rewritten as f64 / r.tried.max(1) as f64),
                    prepare_s: mm(&|r| r.prepare_wall.as_secs_f64()),
                    prepare_cpu_s: mm(&|r| r.prepare_cpu.as_secs_f64()),
                })
            }),
            writeback: writeback_report(runs),
            overwrite: overwrite_report(runs, bytes),
        }
    }
}

fn writeback_report(runs: &[Run]) -> Option<WritebackReport> {
    let ws: Vec<_> = runs
        .iter()
        .filter_map(|r| r.written_back.as_ref())
        .collect();
    let last = ws.last()?;
    let mm = |f: &dyn Fn(&super::writeback::WrittenBack) -> f64| {
        median(ws.iter().map(|w| f(w)).collect())
    };
    let per_page = |w: &super::writeback::WrittenBack| w.disk_bytes as f64 / w.pages.max(1) as f64;
    Some(WritebackReport {
        pages: last.pages,
        disk_bytes_per_page: mm(&per_page),
        disk_bytes_over_zram: mm(&|w| per_page(w) / PAGE_SIZE as f64),
        disk_over_payload: mm(&|w| w.disk_bytes as f64 / w.payload_bytes.max(1) as f64),
        gbps: mm(&|w| w.pages as f64 * PAGE_SIZE as f64 / w.wall.as_secs_f64().max(1e-9) / 1e9),
        ram_idle_p50_us: mm(&|w| pct(&w.ram_idle, 0.50)),
        ram_idle_p99_us: mm(&|w| pct(&w.ram_idle, 0.99)),
        ram_busy_p50_us: mm(&|w| pct(&w.ram_busy, 0.50)),
        ram_busy_p99_us: mm(&|w| pct(&w.ram_busy, 0.99)),
        ram_busy_reads: last.ram_busy.len(),
        disk_p50_us: mm(&|w| pct(&w.disk, 0.50)),
        disk_p99_us: mm(&|w| pct(&w.disk, 0.99)),
        queue_inline: queue_report(&ws, |w| w.queue_inline.as_ref()),
        queue_ring: queue_report(&ws, |w| w.queue_ring.as_ref()),
    })
}

fn queue_report(
    ws: &[&super::writeback::WrittenBack],
    pick: impl Fn(&super::writeback::WrittenBack) -> Option<&super::queue_reads::QueueReads>,
) -> Option<QueueReport> {
    let qs: Vec<_> = ws.iter().filter_map(|w| pick(w)).collect();
    if qs.is_empty() {
        return None;
    }
    let mm = |f: &dyn Fn(&super::queue_reads::QueueReads) -> f64| {
        median(qs.iter().map(|q| f(q)).collect())
    };
    Some(QueueReport {
        ram_p50_us: mm(&|q| pct(&q.ram, 0.50)),
        ram_p99_us: mm(&|q| pct(&q.ram, 0.99)),
        disk_p50_us: mm(&|q| pct(&q.disk, 0.50)),
        disk_p99_us: mm(&|q| pct(&q.disk, 0.99)),
        requests_per_s: mm(&|q| {
            (q.ram.len() + q.disk.len()) as f64 * 1e9 / q.wall_ns.max(1) as f64
        }),
    })
}

/// The report of `r`'s corpus and backend (as asked) for which `other` holds.
fn twin<'a>(
    reports: &'a [Report],
    r: &Report,
    other: impl Fn(&Report) -> bool,
) -> Option<&'a Report> {
    reports
        .iter()
        .find(|b| b.corpus == r.corpus && b.backend_asked == r.backend_asked && other(b))
}

/// Whether runs `a` and `b` placed their writers alike for a comparison of backends: the
/// same way, or each as `--queue-affinity auto` places them for its backend (pinned for the
/// CPU backend, anywhere for the GPU's), where each backend ran one way only.
fn placed_alike(reports: &[Report], a: &Report, b: &Report) -> bool {
    let one_way = |r: &Report| {
        reports.iter().all(|x| {
            x.corpus != r.corpus
                || x.backend_asked != r.backend_asked
                || x.queue_affinity == r.queue_affinity
        })
    };
    a.queue_affinity == b.queue_affinity || (one_way(a) && one_way(b))
}

/// CPU-seconds per GiB of thread role `name` (0 when the run has none).
/// `a` as a multiple of `b` (a `b` of 0 counts as a tiny number, not a division by zero).
fn times(a: f64, b: f64) -> f64 {
    a / b.max(1e-9)
}

/// One run against another: "CPU per GiB x (queues x{extra}), ingest x, busy read p99 x".
fn cost_and_speed(on: &Report, off: &Report, extra: &str) -> String {
    format!(
        "CPU per GiB x{:.3} (queues x{:.3}{extra}), ingest x{:.3}, busy read p99 x{:.3}",
        times(on.cpu_s_per_gib, off.cpu_s_per_gib),
        times(role(on, "queues"), role(off, "queues")),
        times(on.ingest_gbps, off.ingest_gbps),
        times(on.read_busy_p99_us, off.read_busy_p99_us),
    )
}

fn role(r: &Report, name: &str) -> f64 {
    r.cpu_s_per_gib_by_role.get(name).copied().unwrap_or(0.0)
}

/// The human table: one row per corpus and backend, then each backend against the first
/// one of the same corpus.
pub fn table(reports: &[Report]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<14} {:<8} {:>4} {:>4} {:>6} {:>7} {:>7} {:>9} {:>7} {:>16} {:>16} {:>9} {:>8}\n",
        "corpus",
        "backend",
        "sums",
        "copy",
        "cpus",
        "ingest",
        "ack",
        "CPU-s/GiB",
        "ratio",
        "read p50/p99 µs",
        "busy p50/p99 µs",
        "pinned",
        "verified"
    ));
    for r in reports {
        let backend = if r.backend_asked == r.backend {
            r.backend.to_string()
        } else {
            format!("{}>{}", r.backend_asked, r.backend)
        };
        out.push_str(&format!(
            "{:<14} {:<8} {:>4} {:>4} {:>6} {:>7.2} {:>7.2} {:>9.3} {:>7.4} {:>16} {:>16} {:>8}M {:>8}\n",
            r.corpus,
            backend,
            if r.checksums { "on" } else { "off" },
            if r.user_copy { "user" } else { "buf" },
            r.queue_affinity,
            r.ingest_gbps,
            r.ack_gbps,
            r.cpu_s_per_gib,
            r.ratio,
            format!("{:.1}/{:.1}", r.read_idle_p50_us, r.read_idle_p99_us),
            format!("{:.1}/{:.1}", r.read_busy_p50_us, r.read_busy_p99_us),
            r.backend_pinned_bytes >> 20,
            r.verified
        ));
    }
    out.push_str(
        "(GB/s of uncompressed pages; ratio = orig_data_size / mem_used_total; copy: buf = the \
         pages copied into the request's buffer, user = ublk's user copy, into staging; that \
         copy, the kernel's, is stood in for by a memcpy, its CPU left out; cpus: kernel = each \
         queue thread pinned to its queue's CPUs, as libublk pins the daemon's, any = anywhere)\n",
    );
    for r in reports.iter().filter(|r| r.gpu_retired_runs > 0) {
        out.push_str(&format!(
            "!! {} {}: the GPU was retired in {} of {} runs (a failure or a hang): their writes \
             went to the CPU from then on, and the row is not the GPU path's\n",
            r.corpus, r.backend, r.gpu_retired_runs, r.repeat
        ));
    }
    for r in reports {
        if let Some(w) = &r.writeback {
            out.push_str(&format!(
                "{} {} writeback of {} pages: {:.0} disk bytes a page (x{:.3} of zram's 4096, \
                 x{:.3} of the RAM payload), {:.2} GB/s; RAM reads p50/p99 {:.1}/{:.1} µs idle, \
                 {:.1}/{:.1} µs during the pass (p99 x{:.2}, {} reads); disk reads {:.1}/{:.1} µs\n",
                r.corpus,
                r.backend,
                w.pages,
                w.disk_bytes_per_page,
                w.disk_bytes_over_zram,
                w.disk_over_payload,
                w.gbps,
                w.ram_idle_p50_us,
                w.ram_idle_p99_us,
                w.ram_busy_p50_us,
                w.ram_busy_p99_us,
                times(w.ram_busy_p99_us, w.ram_idle_p99_us),
                w.ram_busy_reads,
                w.disk_p50_us,
                w.disk_p99_us,
            ));
            if let (Some(i), Some(q)) = (&w.queue_inline, &w.queue_ring) {
                out.push_str(&format!(
                    "{} {} one queue, 16 reads in flight, half from the disk: RAM reads p50/p99 \
                     {:.1}/{:.1} µs with disk reads on the thread, {:.1}/{:.1} µs through its ring \
                     (p99 x{:.3}); disk reads {:.1}/{:.1} against {:.1}/{:.1} µs; {:.0} against \
                     {:.0} requests/s\n",
                    r.corpus,
                    r.backend,
                    i.ram_p50_us,
                    i.ram_p99_us,
                    q.ram_p50_us,
                    q.ram_p99_us,
                    times(q.ram_p99_us, i.ram_p99_us),
                    i.disk_p50_us,
                    i.disk_p99_us,
                    q.disk_p50_us,
                    q.disk_p99_us,
                    i.requests_per_s,
                    q.requests_per_s,
                ));
            }
        }
    }
    for r in reports {
        if let Some(o) = &r.overwrite {
            out.push_str(&format!(
                "{} {} {} overwrites: {:.2} GB/s (x{:.2} of the first write), {:.3} CPU-s/GiB \
                 (x{:.3}), busy read p99 {:.1} µs (x{:.2} idle); ratio {:.4} with the holes \
                 ({:.1} % of the memory), {:.4} compacted in {:.3} s (first write {:.4})\n",
                r.corpus,
                r.backend,
                o.passes,
                o.ingest_gbps,
                times(o.ingest_gbps, r.ingest_gbps),
                o.cpu_s_per_gib,
                times(o.cpu_s_per_gib, r.cpu_s_per_gib),
                o.read_busy_p99_us,
                times(o.read_busy_p99_us, r.read_idle_p99_us),
                o.ratio,
                o.holes_share * 100.0,
                o.ratio_compacted,
                o.compact_s,
                r.ratio,
            ));
        }
    }
    for r in reports {
        let Some(first) = reports.iter().find(|b| {
            b.corpus == r.corpus && b.checksums == r.checksums && placed_alike(reports, b, r)
        }) else {
            continue;
        };
        // The same backend another way (user copy) has its own line below.
        if std::ptr::eq(first, r) || first.backend_asked == r.backend_asked {
            continue;
        }
        // Against the first backend's run that moved its pages the same way, where it has
        // one (a cpu,gpu run with user copy on,off has both); the way is named either way.
        let first = reports
            .iter()
            .find(|b| {
                b.corpus == r.corpus
                    && b.checksums == r.checksums
                    && placed_alike(reports, b, r)
                    && b.backend_asked == first.backend_asked
                    && b.user_copy == r.user_copy
            })
            .unwrap_or(first);
        let copy = |b: &Report| if b.user_copy { "user copy" } else { "buffer" };
        out.push_str(&format!(
            "{} {} ({}) vs {} ({}): ingest x{:.2}, CPU per GiB x{:.3}, ratio x{:.4}; busy p99 / idle p99 x{:.2}\n",
            r.corpus,
            r.backend,
            copy(r),
            first.backend,
            copy(first),
            times(r.ingest_gbps, first.ingest_gbps),
            times(r.cpu_s_per_gib, first.cpu_s_per_gib),
            times(r.ratio, first.ratio),
            times(r.read_busy_p99_us, r.read_idle_p99_us)
        ));
        if let (Some(o), Some(f)) = (&r.overwrite, &first.overwrite) {
            out.push_str(&format!(
                "{} {} vs {} overwritten: ingest x{:.2}, CPU per GiB x{:.3}, ratio compacted \
                 x{:.4}; busy p99 / idle p99 x{:.2}\n",
                r.corpus,
                r.backend,
                first.backend,
                times(o.ingest_gbps, f.ingest_gbps),
                times(o.cpu_s_per_gib, f.cpu_s_per_gib),
                times(o.ratio_compacted, f.ratio_compacted),
                times(o.read_busy_p99_us, r.read_idle_p99_us)
            ));
        }
    }
    // What user copy saves: each run with it against the same run without.
    for on in reports.iter().filter(|r| r.user_copy) {
        let Some(off) = twin(reports, on, |b| {
            !b.user_copy && b.checksums == on.checksums && b.queue_affinity == on.queue_affinity
        }) else {
            continue;
        };
        out.push_str(&format!(
            "{} {} user copy vs the request's buffer: {} (the stand-in for the kernel's copy: \
             {:.3} against {:.3} CPU-s/GiB, left out)\n",
            on.corpus,
            on.backend,
            cost_and_speed(on, off, ""),
            on.kernel_copy_s_per_gib,
            off.kernel_copy_s_per_gib,
        ));
    }
    // What the checksums cost: each run with them against the same run without.
    for on in reports.iter().filter(|r| r.checksums) {
        let Some(off) = twin(reports, on, |b| {
            !b.checksums && b.user_copy == on.user_copy && b.queue_affinity == on.queue_affinity
        }) else {
            continue;
        };
        out.push_str(&format!(
            "{} {} checksums on vs off: CPU per GiB x{:.3}, ingest x{:.3}, ratio x{:.4}, \
             read p50 x{:.3}, p99 x{:.3}\n",
            on.corpus,
            on.backend,
            times(on.cpu_s_per_gib, off.cpu_s_per_gib),
            times(on.ingest_gbps, off.ingest_gbps),
            times(on.ratio, off.ratio),
            times(on.read_idle_p50_us, off.read_idle_p50_us),
            times(on.read_idle_p99_us, off.read_idle_p99_us),
        ));
    }
    // What pinning the queue threads does: each pinned run against the same run unpinned.
    for on in reports.iter().filter(|r| r.queue_affinity == "kernel") {
        let Some(off) = twin(reports, on, |b| {
            b.queue_affinity == "any" && b.checksums == on.checksums && b.user_copy == on.user_copy
        }) else {
            continue;
        };
        // The cpu backend has no installers.
        let installers = if role(off, "installers") > 0.0 {
            format!(
                ", installers x{:.3}",
                role(on, "installers") / role(off, "installers")
            )
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{} {} queue threads on their queues' CPUs vs anywhere: {}\n",
            on.corpus,
            on.backend,
            cost_and_speed(on, off, &installers),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{median, table, Report};

    fn run(backend: &'static str, placed: &'static str) -> Report {
        Report {
            corpus: "heap".into(),
            backend_asked: backend,
            backend,
            queue_affinity: placed,
            checksums: true,
            ingest_gbps: if backend == "gpu" { 16.0 } else { 2.0 },
            cpu_s_per_gib: if backend == "gpu" { 0.2 } else { 2.0 },
            ratio: 2.0,
            ..Report::default()
        }
    }

    #[test]
    fn backends_placed_as_auto_places_them_are_compared() {
        // `--queue-affinity auto`: the CPU backend's writers pinned, the GPU's anywhere.
        let out = table(&[run("cpu", "kernel"), run("gpu", "any")]);
        assert!(
            out.contains("heap gpu (buffer) vs cpu (buffer): ingest x8.00, CPU per GiB x0.100"),
            "{out}"
        );
        // `kernel,any`: each placement against its own.
        let out = table(&[
            run("cpu", "kernel"),
            run("cpu", "any"),
            run("gpu", "kernel"),
            run("gpu", "any"),
        ]);
        assert_eq!(out.matches(" vs cpu (buffer)").count(), 2, "{out}");
    }

    #[test]
    fn a_row_whose_gpu_was_retired_says_so() {
        assert!(!table(&[run("cpu", "kernel"), run("gpu", "any")]).contains("!!"));
        let mut gpu = run("gpu", "any");
        gpu.gpu_retired_runs = 1;
        gpu.repeat = 3;
        let out = table(&[run("cpu", "kernel"), gpu]);
        assert!(
            out.contains("!! heap gpu: the GPU was retired in 1 of 3 runs"),
            "{out}"
        );
    }

    #[test]
    fn a_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![3.0, 1.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 10.0]), 3.0);
    }
}

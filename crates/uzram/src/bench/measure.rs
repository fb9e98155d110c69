//! One measured run: a fresh store and backend set up as the daemon sets them up, `queues`
//! writer threads sending 64 KiB writes through the daemon's request handler, one reader
//! timing random 4 KiB reads, then a check of every page.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use uzram_core::codec::Algorithm;
use uzram_core::Stats as StoreStats;
use uzram_core::{PageStore, StoreConfig, PAGE_SIZE};

use super::memory::StoreMemory;
use super::pass::{self, Pass, Source, Writers};
use super::random::next;
use crate::config::{Backend, GpuSettings};
use crate::daemon::backend::{StagingHome, WriteBackend};
use crate::memory::pool;
use crate::ublk::handler::{handle, handle_via, Op, Via};
use crate::ublk::placement::Placement;

/// Pages per write request: 64 KiB, a typical swap-out request.
pub const REQUEST_PAGES: usize = 16;
/// Timed reads before the writers start.
const IDLE_READS: usize = 20_000;
const SECTORS_PER_PAGE: u64 = (PAGE_SIZE / 512) as u64;

/// What one run is asked to do.
#[derive(Debug, Clone)]
pub struct Setup {
    pub algorithm: Algorithm,
    pub backend: Backend,
    pub gpu: GpuSettings,
    pub raw_threshold: usize,
    pub queues: usize,
    /// Pages written by the writers (the corpus repeated).
    pub pages: usize,
    /// Untimed runs before the measured ones.
    pub warmup: usize,
    /// A checksum with every stored page, checked on every read.
    pub checksums: bool,
    /// After the writes: every page marked idle and recompressed with this.
    pub recompress: Option<crate::config::RecompressCodec>,
    /// After that: half the device written back to a backing file here.
    pub writeback: Option<std::path::PathBuf>,
    /// The timing reader's pause between reads (zero: back to back).
    pub read_gap: Duration,
    /// Writes move by ublk's user copy: the handler has each request's pages copied in
    /// where it puts them instead of finding them in the request's buffer (either way the
    /// kernel's copy is stood in for: `pass.rs`'s `KernelCopyStandIn`).
    pub user_copy: bool,
    /// Request buffers each writer fills in turn (the kernel's copy rotates over them, as
    /// over a ublk queue's tags): how cold the buffer the copy lands in is.
    pub request_buffers: usize,
    /// Where the writers run: each pinned to the CPUs blk-mq maps to its queue, as libublk
    /// pins the daemon's queue threads (`sys::affinity::queue_cpus`), or on any CPU, as the
    /// daemon lets them with the gpu backend (`ublk::placement`).
    pub placement: Placement,
    /// Passes over the ingest region after the first, each with other contents for every
    /// page, as swap reuses its slots.
    pub overwrites: usize,
}

/// Where a run's pages are: the corpus once from page 0 (the timing reader's), then the
/// ingest region from `base` to `total`, the corpus repeated from its page `shift` on (the
/// last pass's contents).
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub base: usize,
    pub total: usize,
    pub shift: usize,
}

impl Layout {
    /// Where ingest page `p` (`base` or more) starts in the corpus repeated: its page
    /// `corpus_at(p)` modulo the corpus's pages.
    pub fn corpus_at(&self, p: usize) -> usize {
        p - self.base + self.shift
    }

    /// Device page `p`'s bytes.
    pub fn expected<'c>(&self, corpus: &'c [u8], p: usize) -> &'c [u8] {
        let cpages = (corpus.len() / PAGE_SIZE).max(1);
        let i = if p < self.base {
            p
        } else {
            self.corpus_at(p) % cpages
        };
        &corpus[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]
    }
}

/// What the overwrites did (`--overwrites`): their passes together, and the store after.
#[derive(Debug, Clone)]
pub struct Overwritten {
    pub passes: usize,
    /// Each pass from its first write until every page was installed, summed.
    pub compressed: Duration,
    /// Process CPU time over those spans (as [`Run::cpu`]), summed.
    pub cpu: Duration,
    /// CPU time (ns) over them by thread role, summed.
    pub cpu_by_role: BTreeMap<&'static str, u64>,
    /// Read latencies while they ran, sorted.
    pub busy_reads: Vec<u32>,
    pub orig_bytes: u64,
    /// The store's memory after the last pass, the holes the overwrites left included.
    pub mem_used: u64,
    /// Of that, freed room on the arena's free lists, waiting for an object of its class.
    pub hole_bytes: u64,
    /// The same after a compaction (what the daemon's worker does once writes pause).
    pub mem_used_compacted: u64,
    /// How long that compaction took.
    pub compact: Duration,
}

impl Overwritten {
    fn of(
        passes: Vec<Pass>,
        held: &StoreStats,
        holes: u64,
        compacted: &StoreStats,
        compact: Duration,
    ) -> Self {
        let mut cpu_by_role = BTreeMap::new();
        for p in &passes {
            for (&role, &ns) in &p.cpu_by_role {
                *cpu_by_role.entry(role).or_insert(0u64) += ns;
            }
        }
        let mut busy_reads: Vec<u32> = passes.iter().flat_map(|p| p.busy.iter().copied()).collect();
        busy_reads.sort_unstable();
        Self {
            passes: passes.len(),
            compressed: passes.iter().map(|p| p.compressed).sum(),
            cpu: passes.iter().map(|p| p.cpu).sum(),
            cpu_by_role,
            busy_reads,
            orig_bytes: held.orig_data_size,
            mem_used: held.mem_used_total,
            hole_bytes: holes,
            mem_used_compacted: compacted.mem_used_total,
            compact,
        }
    }
}

/// What recompressing every page after the writes did (`--recompress`).
#[derive(Debug, Clone, Copy)]
pub struct Recompressed {
    /// The store's memory beyond its page table, before and after: the idle set's.
    pub held_before: u64,
    pub held_after: u64,
    /// Payload before and after.
    pub compr_before: u64,
    pub compr_after: u64,
    /// Wall time and CPU time of the pass (one thread).
    pub wall: Duration,
    pub cpu: Duration,
    /// Wall and CPU time of what the recompressor did once before its first pass (training
    /// and loading the dictionary; nothing for the others).
    pub prepare_wall: Duration,
    pub prepare_cpu: Duration,
    pub tried: u64,
    pub rewritten: u64,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Run {
    /// The backend that served writes (`auto` resolved).
    pub backend: &'static str,
    /// From the first write to the last acknowledged one.
    pub ack: Duration,
    /// The writers, first done first (each has an equal share): against `ack`, how
    /// unevenly they went, and why.
    pub writers: Vec<Writer>,
    /// From the first write until every page was compressed and installed.
    pub compressed: Duration,
    /// Process CPU time over that span, the timing reader's own left out.
    pub cpu: Duration,
    /// Page faults of the process over that span.
    pub faults: u64,
    /// CPU time over that span by thread role (queues, installers, reader, other).
    pub cpu_by_role: std::collections::BTreeMap<&'static str, u64>,
    /// Read latencies before the writers started, and while they ran, sorted.
    pub idle_reads: Vec<u32>,
    pub busy_reads: Vec<u32>,
    pub orig_bytes: u64,
    pub mem_used: u64,
    pub compr_bytes: u64,
    /// Backend memory outside the store (the GPU ring's pinned staging and results).
    pub backend_pinned: u64,
    pub backend_device: u64,
    /// The backend's counters at the end (ring and GPU), by name.
    pub backend_stats: Vec<(String, u64)>,
    /// The same after the first pass (the rates per GiB of the first write are of these).
    pub first_pass_stats: Vec<(String, u64)>,
    /// Every page read back equal to what was written last, and the reader saw no other.
    pub verified: bool,
    /// The recompression pass, when asked for.
    pub recompressed: Option<Recompressed>,
    /// The writeback pass, when asked for.
    pub written_back: Option<super::writeback::WrittenBack>,
    /// The overwrites, when asked for. The fields above are the first pass's.
    pub overwritten: Option<Overwritten>,
}

impl Run {
    /// The backend's counter `name` at the end of the run, if it has one.
    pub fn backend_stat(&self, name: &str) -> Option<u64> {
        find_stat(&self.backend_stats, name)
    }

    /// The backend's counter `name` after the first pass.
    pub fn first_pass_stat(&self, name: &str) -> Option<u64> {
        find_stat(&self.first_pass_stats, name)
    }
}

fn find_stat(stats: &[(String, u64)], name: &str) -> Option<u64> {
    stats.iter().find_map(|(n, v)| (n == name).then_some(*v))
}

/// The backend's counters now, by name.
fn stat_pairs(c: &WriteBackend) -> Vec<(String, u64)> {
    c.stats()
        .into_iter()
        .map(|st| (st.name, st.value))
        .collect()
}

/// One writer thread's run.
#[derive(Debug, Clone, Copy)]
pub struct Writer {
    /// Its own CPU time, the stand-in for the kernel's copy left out.
    pub cpu: Duration,
    /// The CPU time of the stand-in for the kernel's copy of its requests.
    pub kernel_copy: Duration,
    /// From the first write until it had written its share.
    pub done: Duration,
    /// Time it was runnable but waited for a CPU (zero where the kernel keeps no
    /// scheduler stats). The rest of `done` beyond `cpu` and this, it slept: waiting for a
    /// slot, a lock or memory.
    pub runnable: Duration,
}

/// One run over `corpus` (whole pages).
pub fn run(corpus: &[u8], setup: &Setup, memory: &StoreMemory) -> anyhow::Result<Run> {
    let cpages = corpus.len() / PAGE_SIZE;
    // Device layout: the corpus once (the pages the reader reads), then the ingest region.
    let base = cpages;
    let total = base + setup.pages;
    let mut cfg = StoreConfig::new(total as u64, setup.algorithm);
    cfg.raw_threshold = setup.raw_threshold;
    cfg.checksums = setup.checksums;
    let pool_before = pool::take_waits();
    let store = Arc::new(memory.store(cfg)?);
    let compression = WriteBackend::start(
        store.clone(),
        setup.backend,
        &setup.gpu,
        // The daemon's installer set-up (strict pool takes, a prefaulted 256 KiB stack,
        // nice -20): the GPU host has no ublk, so only the bench runs it there.
        Some(Arc::new(crate::memory::io_path_thread)),
        StagingHome::Scratch,
    )
    .with_context(|| format!("starting the {} backend", setup.backend.name()))?;
    let c = &compression;
    let s = &*store;

    // The reader's pages.
    let mut src = Source::new(corpus);
    let mut scratch = vec![0u8; REQUEST_PAGES * PAGE_SIZE];
    for first in (0..cpages).step_by(REQUEST_PAGES) {
        let n = REQUEST_PAGES.min(cpages - first);
        let buf = src.pages_at(first, n, &mut scratch);
        write_via(s, c, first, n, buf, Via::Buffer)?;
    }
    compression.flush();
    let mut seed = 0x2545_f491_4f6c_dd1d;
    let mut idle = Vec::with_capacity(IDLE_READS);
    let mut ok = true;
    let mut page = vec![0u8; PAGE_SIZE];
    for _ in 0..IDLE_READS {
        let (lat, good) = timed_read(s, c, corpus, &mut seed, &mut page);
        idle.push(lat);
        ok &= good;
    }

    // Pass `k`'s layout (0: the first write).
    let layout_of = |k| Layout {
        base,
        total,
        shift: pass::shift(k, cpages),
    };
    let mut writers = Writers::new(corpus, setup);
    let first = pass::ingest(s, c, corpus, setup, &mut writers, layout_of(0))?;
    // The first write's memory, before overwrites leave holes, and the backend's counters.
    let stats = store.stats();
    let first_stats = stat_pairs(&compression);
    let mut reader_ok = first.reader_ok;
    let overwritten = match setup.overwrites {
        0 => None,
        n => {
            let mut passes = Vec::with_capacity(n);
            for k in 1..=n {
                let p = pass::ingest(s, c, corpus, setup, &mut writers, layout_of(k))?;
                reader_ok &= p.reader_ok;
                passes.push(p);
            }
            let held = store.stats();
            let holes = store.memory().free_hole_bytes;
            let start = Instant::now();
            // What the daemon's worker does once writes pause.
            store.compact();
            let compact = start.elapsed();
            Some(Overwritten::of(
                passes,
                &held,
                holes,
                &store.stats(),
                compact,
            ))
        }
    };
    drop(writers);
    let layout = layout_of(setup.overwrites);
    let mut verified = ok && reader_ok && verify_all(s, c, corpus, layout, setup.queues)?;
    let recompressed = match setup.recompress {
        None => None,
        Some(codec) => {
            let table = store.table_bytes();
            let before = store.stats();
            store.mark_idle(None);
            // Opened before the clock starts, as the daemon opens it before its passes.
            let recompressor = crate::daemon::recompressor::Recompressor::new(codec, &setup.gpu);
            recompressor.open()?;
            let idle = uzram_core::store::Candidates::Idle { min_age: 0 };
            // A dictionary is trained once in a device's life, not each pass: timed apart.
            let (cpu_before, start) = (
                crate::sys::cpu_time(crate::sys::CpuOf::Thread)?,
                Instant::now(),
            );
            recompressor.prepare(&store, idle, 0)?;
            let prepare_wall = start.elapsed();
            let prepare_cpu =
                crate::sys::cpu_time(crate::sys::CpuOf::Thread)?.saturating_sub(cpu_before);
            let (cpu_before, start) = (
                crate::sys::cpu_time(crate::sys::CpuOf::Thread)?,
                Instant::now(),
            );
            let done = recompressor.run(&store, idle, 0, u64::MAX, None, true)?;
            // The room the old objects left, given back as the daemon's tier does.
            store.compact();
            let wall = start.elapsed();
            let cpu = crate::sys::cpu_time(crate::sys::CpuOf::Thread)?.saturating_sub(cpu_before);
            let after = store.stats();
            // Every page again, now read from its zstd object.
            verified = verified && verify_all(s, c, corpus, layout, setup.queues)?;
            Some(Recompressed {
                held_before: before.mem_used_total.saturating_sub(table),
                held_after: after.mem_used_total.saturating_sub(table),
                compr_before: before.compr_data_size,
                compr_after: after.compr_data_size,
                wall,
                cpu,
                prepare_wall,
                prepare_cpu,
                tried: done.tried,
                rewritten: done.rewritten,
            })
        }
    };
    let written_back = match &setup.writeback {
        None => None,
        Some(path) => {
            let wb = super::writeback::measure(s, c, corpus, layout, path)?;
            // Every page again, half of them now read from the disk.
            verified = verified && wb.reads_ok && verify_all(s, c, corpus, layout, setup.queues)?;
            Some(wb)
        }
    };
    let backend_memory = compression.memory();
    let (waits, timeouts) = pool::take_waits();
    let backend_stats = compression
        .stats()
        .into_iter()
        .map(|st| (st.name, st.value))
        // The store's new segments that waited for the pool keeper during this run.
        .chain([
            (
                "pool_waited_takes".to_string(),
                (waits - pool_before.0) as u64,
            ),
            (
                "pool_take_timeouts".to_string(),
                (timeouts - pool_before.1) as u64,
            ),
        ])
        .collect();
    let backend = compression.name();
    drop(compression);
    let mut busy = first.busy;
    idle.sort_unstable();
    busy.sort_unstable();
    Ok(Run {
        backend,
        ack: first.ack,
        writers: first.writers,
        compressed: first.compressed,
        cpu: first.cpu,
        faults: first.faults,
        cpu_by_role: first.cpu_by_role,
        idle_reads: idle,
        busy_reads: busy,
        orig_bytes: stats.orig_data_size,
        mem_used: stats.mem_used_total,
        compr_bytes: stats.compr_data_size,
        backend_pinned: backend_memory.pinned_host_bytes,
        backend_device: backend_memory.device_bytes,
        backend_stats,
        first_pass_stats: first_stats,
        verified,
        recompressed,
        written_back,
        overwritten,
    })
}

/// One write request of `pages` pages through the handler, its data moving as `via` says
/// (`buf` holds it, or is the bounce buffer).
pub(super) fn write_via(
    s: &PageStore,
    c: &WriteBackend,
    first: usize,
    pages: usize,
    buf: &mut [u8],
    via: Via<'_>,
) -> anyhow::Result<()> {
    let r = handle_via(
        Op::Write,
        first as u64 * SECTORS_PER_PAGE,
        (pages as u64 * SECTORS_PER_PAGE) as u32,
        buf,
        s,
        c,
        via,
    );
    if r < 0 {
        bail!("write of pages {first}+{pages} failed with errno {}", -r);
    }
    Ok(())
}

/// A random 4 KiB read of the corpus region, timed (ns) and checked.
pub(super) fn timed_read(
    s: &PageStore,
    c: &WriteBackend,
    corpus: &[u8],
    seed: &mut u64,
    page: &mut [u8],
) -> (u32, bool) {
    let cpages = corpus.len() / PAGE_SIZE;
    let p = (next(seed) % cpages as u64) as usize;
    // A read that returned success without writing the page must not pass on what the
    // buffer held before.
    page.fill(0xa5);
    let t = Instant::now();
    let r = handle(Op::Read, p as u64 * SECTORS_PER_PAGE, 8, page, s, c);
    let lat = u32::try_from(t.elapsed().as_nanos()).unwrap_or(u32::MAX);
    (
        lat,
        r == PAGE_SIZE as i32 && page == &corpus[p * PAGE_SIZE..(p + 1) * PAGE_SIZE],
    )
}

/// Reads every page back through the handler on `threads` threads and compares it.
fn verify_all(
    s: &PageStore,
    c: &WriteBackend,
    corpus: &[u8],
    layout: Layout,
    threads: usize,
) -> anyhow::Result<bool> {
    let total = layout.total;
    let per = total.div_ceil(threads.max(1));
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|t| {
                scope.spawn(move || {
                    let mut buf = vec![0u8; REQUEST_PAGES * PAGE_SIZE];
                    let (lo, hi) = (t * per, ((t + 1) * per).min(total));
                    let mut first = lo;
                    while first < hi {
                        let n = REQUEST_PAGES.min(hi - first);
                        let buf = &mut buf[..n * PAGE_SIZE];
                        buf.fill(0xa5);
                        let r = handle(
                            Op::Read,
                            first as u64 * SECTORS_PER_PAGE,
                            (n as u64 * SECTORS_PER_PAGE) as u32,
                            buf,
                            s,
                            c,
                        );
                        if r < 0 {
                            return false;
                        }
                        for (i, got) in buf.chunks_exact(PAGE_SIZE).enumerate() {
                            if got != layout.expected(corpus, first + i) {
                                return false;
                            }
                        }
                        first += n;
                    }
                    true
                })
            })
            .collect();
        Ok(workers.into_iter().all(|w| w.join().unwrap_or(false)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ingest region holds the corpus from `shift` on, the reader's region the corpus
    /// as it is: a check that ignored the shift would pass a pass that wrote the old pages.
    #[test]
    fn expected_pages_follow_the_last_pass_shift() {
        let corpus: Vec<u8> = (0..5 * PAGE_SIZE).map(|i| (i / PAGE_SIZE) as u8).collect();
        let page = |layout: Layout, p: usize| layout.expected(&corpus, p)[0];
        let layout = Layout {
            base: 5,
            total: 15,
            shift: 0,
        };
        assert_eq!(
            (0..15).map(|p| page(layout, p)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
        );
        let shifted = Layout { shift: 2, ..layout };
        assert_eq!(
            (0..15).map(|p| page(shifted, p)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
        );
    }

    /// Every overwrite gives each page other contents than the pass before it, for corpora
    /// of any size but a multiple of the shift.
    #[test]
    fn each_pass_moves_the_corpus() {
        for pages in [2, 3, 16, 1024, 16384, 4098, 4100] {
            for k in 1..=10 {
                assert_ne!(
                    pass::shift(k, pages),
                    pass::shift(k - 1, pages),
                    "{pages} pages, pass {k}"
                );
            }
        }
        assert_eq!(pass::shift(0, 16384), 0);
    }
}

//! One measured run: a fresh store and backend set up as the daemon sets them up, `queues`
//! writer threads sending 64 KiB writes through the daemon's request handler, one reader
//! timing random 4 KiB reads, then a check of every page.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use uzram_core::batch::{BytesSource, LeasedWords, PageSource};
use uzram_core::codec::Algorithm;
use uzram_core::{PageStore, StoreConfig, PAGE_SIZE};

use super::memory::StoreMemory;
use super::random::next;
use crate::config::{Backend, GpuSettings};
use crate::daemon::backend::{StagingHome, WriteBackend};
use crate::memory::pool;
use crate::sys::{cpu_time, usage, CpuOf};
use crate::ublk::handler::{handle, handle_via, Op, Via};
use crate::ublk::placement::Placement;

/// Pages per write request: 64 KiB, a typical swap-out request.
pub const REQUEST_PAGES: usize = 16;
/// Timed reads before the writers start.
const IDLE_READS: usize = 20_000;
/// Most read latencies kept while the writers run.
const MAX_BUSY_SAMPLES: usize = 1 << 22;
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
    /// kernel's copy is stood in for: [`KernelCopyStandIn`]).
    pub user_copy: bool,
    /// Request buffers each writer fills in turn (the kernel's copy rotates over them, as
    /// over a ublk queue's tags): how cold the buffer the copy lands in is.
    pub request_buffers: usize,
    /// Where the writers run: each pinned to the CPUs blk-mq maps to its queue, as libublk
    /// pins the daemon's queue threads (`sys::affinity::queue_cpus`), or on any CPU, as the
    /// daemon lets them with the gpu backend (`ublk::placement`).
    pub placement: Placement,
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
    /// Every page read back equal to what was written last, and the reader saw no other.
    pub verified: bool,
    /// The recompression pass, when asked for.
    pub recompressed: Option<Recompressed>,
    /// The writeback pass, when asked for.
    pub written_back: Option<super::writeback::WrittenBack>,
}

impl Run {
    /// The backend's counter `name` at the end of the run, if it has one.
    pub fn backend_stat(&self, name: &str) -> Option<u64> {
        self.backend_stats
            .iter()
            .find_map(|(n, v)| (n == name).then_some(*v))
    }
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

/// A ublk queue thread's priority (`Server::start`: nice -20, as the installers have), so
/// that the writers share the CPUs with the installers as the daemon's queue threads do.
/// Not its strict pool takes: an empty pool would fail a write, which the kernel retries
/// and the bench cannot.
fn queue_thread_priority(name: &str) {
    crate::sys::raise_io_thread_priority(name);
}

fn runqueue_wait() -> Duration {
    crate::sys::sched::thread_runqueue_wait().unwrap_or_default()
}

/// The kernel's copy of each written request, stood in for by a `memcpy` from the corpus:
/// into the request's buffer before the handler runs, or (ublk's user copy,
/// `ublk/user_copy.rs`) wherever the handler asks for the pages, straight into a staging
/// slot. Either way the kernel copies each written byte once; the stand-in puts that copy
/// in the run's wall time, and keeps its CPU time apart (`spent`): the runs count what the
/// daemon does besides, as they did before the stand-in, when the handler found the pages
/// in the corpus.
struct KernelCopyStandIn<'a> {
    data: BytesSource<'a>,
    spent: &'a mut Duration,
}

impl KernelCopyStandIn<'_> {
    fn timed(&mut self, copy: impl FnOnce(&mut Self) -> io::Result<()>) -> io::Result<()> {
        let start = cpu_time(CpuOf::Thread)?;
        let copied = copy(self);
        *self.spent += cpu_time(CpuOf::Thread)?.saturating_sub(start);
        copied
    }
}

impl PageSource for KernelCopyStandIn<'_> {
    fn fill_words(&mut self, offset: usize, dst: LeasedWords<'_>) -> io::Result<()> {
        self.timed(|k| {
            let src = k.data.range(offset, dst.len_bytes())?;
            // SAFETY: `dst` is writable for `src.len()` bytes (its length, checked by
            // `range`), and only the ring makes a `LeasedWords`, over words it leased to this
            // writer alone; the corpus copy does not overlap staging.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
            Ok(())
        })
    }

    fn fill_bytes(&mut self, offset: usize, bytes: &mut [u8]) -> io::Result<()> {
        self.timed(|k| k.data.fill_bytes(offset, bytes))
    }
}

/// A copy of the corpus a thread can hand to the handler (which takes `&mut` buffers, as
/// ublk's I/O buffers are).
struct Source {
    data: Vec<u8>,
    pages: usize,
}

impl Source {
    /// The `n` pages that belong at device page `first` of the ingest region starting at
    /// `base` (the corpus repeated), in `scratch` where they wrap around its end.
    fn pages_at<'a>(
        &'a mut self,
        base: usize,
        first: usize,
        n: usize,
        scratch: &'a mut [u8],
    ) -> &'a mut [u8] {
        let start = (first - base) % self.pages;
        if start + n <= self.pages {
            return &mut self.data[start * PAGE_SIZE..(start + n) * PAGE_SIZE];
        }
        for i in 0..n {
            let p = (start + i) % self.pages;
            scratch[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]
                .copy_from_slice(&self.data[p * PAGE_SIZE..(p + 1) * PAGE_SIZE]);
        }
        &mut scratch[..n * PAGE_SIZE]
    }
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
    let mut src = Source {
        data: corpus.to_vec(),
        pages: cpages,
    };
    let mut scratch = vec![0u8; REQUEST_PAGES * PAGE_SIZE];
    for first in (0..cpages).step_by(REQUEST_PAGES) {
        let n = REQUEST_PAGES.min(cpages - first);
        let buf = src.pages_at(0, first, n, &mut scratch);
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

    let stop = AtomicBool::new(false);
    let go = AtomicBool::new(false);
    let bad_reads = AtomicU64::new(0);
    let per = setup.pages.div_ceil(setup.queues);
    // The CPUs this process may use, which blk-mq's map shares out among the queues.
    let pinned = setup.placement == Placement::Kernel;
    let cpus = if pinned {
        crate::sys::affinity::allowed_cpus().context("reading this process's CPUs")?
    } else {
        Vec::new()
    };
    let cpus = &cpus;
    // Each writer's buffers are made before the clock starts, and freed after it stopped:
    // freeing 16 writers' 64 MiB copies inside the clock took 40 ms of a 100 ms run
    // (docs/bench/gpu-runs.md, run 162).
    let mut sources: Vec<(Source, Vec<u8>, Vec<u8>)> = (0..setup.queues)
        .map(|_| {
            let src = Source {
                data: corpus.to_vec(),
                pages: cpages,
            };
            // The requests' buffers, as ublk tags have one each.
            // (`bench::run` held them to a quarter of the host's memory.)
            let mut buffer = vec![0u8; setup.request_buffers.max(1) * REQUEST_PAGES * PAGE_SIZE];
            let mut scratch = vec![0u8; REQUEST_PAGES * PAGE_SIZE];
            // Touched now: memory the allocator hands out zeroed may be untouched, and its
            // first write would fault inside the clock (a run with more request buffers
            // then paid faults a run with one, a pool block zeroed on taking, did not).
            buffer.fill(1);
            scratch.fill(1);
            (src, scratch, buffer)
        })
        .collect();
    let (ack, writers, compressed, cpu, faults, cpu_by_role, busy, reader_ok) =
        std::thread::scope(|scope| {
            // Named, so profiles tell the threads apart.
            let reader = std::thread::Builder::new()
                .name("bench-reader".into())
                .spawn_scoped(scope, || -> anyhow::Result<(Vec<u32>, Duration)> {
                    // It stands in for the queue threads' reads: their priority.
                    queue_thread_priority("bench-reader");
                    let start = cpu_time(CpuOf::Thread)?;
                    // Touched before the window: its first writes would fault inside it.
                    let mut lats = vec![0u32; MAX_BUSY_SAMPLES];
                    lats.clear();
                    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
                    let mut page = vec![0u8; PAGE_SIZE];
                    // Busy reads are those while the writers run: none before they start.
                    while !go.load(Ordering::Acquire) && !stop.load(Ordering::Relaxed) {
                        std::thread::yield_now();
                    }
                    let mut reads = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let (lat, good) = timed_read(s, c, corpus, &mut seed, &mut page);
                        // Past MAX_BUSY_SAMPLES, a reservoir: every read of the run has the
                        // same chance to be kept, and the reader keeps its load on to the end.
                        reads += 1;
                        if lats.len() < MAX_BUSY_SAMPLES {
                            lats.push(lat);
                        } else if let Some(kept) = usize::try_from(next(&mut seed) % reads)
                            .ok()
                            .and_then(|j| lats.get_mut(j))
                        {
                            *kept = lat;
                        }
                        if !good {
                            bad_reads.fetch_add(1, Ordering::Relaxed);
                        }
                        if !setup.read_gap.is_zero() {
                            std::thread::sleep(setup.read_gap);
                        }
                    }
                    Ok((lats, cpu_time(CpuOf::Thread)? - start))
                })?;
            // The roles' window lies inside the process's: the reader's share of it, taken
            // out of the process's CPU below, is then never more than the process spent. The
            // reader's own clock covers its whole life, which starts before the window opens
            // and ends after it closes: on a busy 2-core machine that was more than the run
            // itself, and the process's CPU came out as 0.
            let before = usage(CpuOf::Process)?;
            let roles_before = super::threads::cpu_by_role();
            let t0 = Instant::now();
            go.store(true, Ordering::Release);
            let writers: std::io::Result<Vec<_>> = sources
                .iter_mut()
                .enumerate()
                .map(|(q, (src, scratch, buffer))| {
                    let lo = base + q * per;
                    let hi = (base + (q + 1) * per).min(total);
                    let name = format!("bench-queue-{q}");
                    std::thread::Builder::new().name(name.clone()).spawn_scoped(
                        scope,
                        move || -> anyhow::Result<Writer> {
                            queue_thread_priority(&name);
                            if pinned {
                                let mine = crate::sys::affinity::queue_cpus(cpus, q, setup.queues);
                                crate::sys::affinity::pin_thread(mine)
                                    .with_context(|| format!("pinning {name} to CPUs {mine:?}"))?;
                            }
                            // Its own CPU, measured here: the thread is gone when the run
                            // ends.
                            let start = cpu_time(CpuOf::Thread)?;
                            let queued = runqueue_wait();
                            let mut first = lo;
                            let mut kernel_copy = Duration::ZERO;
                            let tag_bytes = REQUEST_PAGES * PAGE_SIZE;
                            let tags = buffer.len() / tag_bytes;
                            let mut request = 0;
                            while first < hi {
                                let n = REQUEST_PAGES.min(hi - first);
                                let pages = src.pages_at(base, first, n, scratch);
                                let mut kernel = KernelCopyStandIn {
                                    data: BytesSource(pages),
                                    spent: &mut kernel_copy,
                                };
                                let tag = (request % tags) * tag_bytes;
                                let tag = &mut buffer[tag..tag + tag_bytes];
                                if setup.user_copy {
                                    write_via(s, c, first, n, tag, Via::Source(&mut kernel))?;
                                } else {
                                    let buf = &mut tag[..n * PAGE_SIZE];
                                    kernel.fill_bytes(0, buf)?;
                                    write_via(s, c, first, n, buf, Via::Buffer)?;
                                }
                                first += n;
                                request += 1;
                            }
                            let cpu = cpu_time(CpuOf::Thread)? - start;
                            Ok(Writer {
                                cpu: cpu.saturating_sub(kernel_copy),
                                kernel_copy,
                                done: t0.elapsed(),
                                runnable: runqueue_wait().saturating_sub(queued),
                            })
                        },
                    )
                })
                .collect();
            let writers = match writers {
                Ok(w) => w,
                Err(e) => {
                    // The reader stops too; the scope then joins every thread it started.
                    stop.store(true, Ordering::Relaxed);
                    return Err(anyhow::Error::new(e).context("starting a writer thread"));
                }
            };
            let mut result = Ok(());
            let mut done_writers = Vec::with_capacity(writers.len());
            for w in writers {
                match w
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a writer thread panicked")))
                {
                    Ok(w) => done_writers.push(w),
                    Err(e) => result = Err(e),
                }
            }
            let queues_cpu: Duration = done_writers.iter().map(|w| w.cpu).sum();
            let kernel_copy: Duration = done_writers.iter().map(|w| w.kernel_copy).sum();
            done_writers.sort_unstable_by_key(|w| w.done);
            let ack = t0.elapsed();
            compression.flush();
            let compressed = t0.elapsed();
            let mut roles = super::threads::delta(&roles_before, &super::threads::cpu_by_role());
            let after = usage(CpuOf::Process)?;
            let reader_in_window = roles.get("reader").copied().unwrap_or(0);
            // Without schedstat in /proc (a kernel built without CONFIG_SCHED_INFO) every role
            // reads 0, and the reader's own clock over its life stands in.
            let roles_measured = roles.values().any(|&ns| ns > 0);
            roles.insert(
                "queues",
                u64::try_from(queues_cpu.as_nanos()).unwrap_or(u64::MAX),
            );
            stop.store(true, Ordering::Relaxed);
            let (busy, reader_life) = reader
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the reader thread panicked")))?;
            result?;
            anyhow::Ok((
                ack,
                done_writers,
                compressed,
                (after.cpu - before.cpu)
                    .saturating_sub(if roles_measured {
                        Duration::from_nanos(reader_in_window)
                    } else {
                        reader_life
                    })
                    .saturating_sub(kernel_copy),
                after.faults - before.faults,
                roles,
                busy,
                bad_reads.load(Ordering::Relaxed) == 0,
            ))
        })?;

    let mut verified = ok && reader_ok && verify_all(s, c, corpus, base, total, setup.queues)?;
    let stats = store.stats();
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
            verified = verified && verify_all(s, c, corpus, base, total, setup.queues)?;
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
            let wb = super::writeback::measure(s, c, corpus, base, total, path)?;
            // Every page again, half of them now read from the disk.
            verified =
                verified && wb.reads_ok && verify_all(s, c, corpus, base, total, setup.queues)?;
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
    let mut busy = busy;
    idle.sort_unstable();
    busy.sort_unstable();
    Ok(Run {
        backend,
        ack,
        writers,
        compressed,
        cpu,
        faults,
        cpu_by_role,
        idle_reads: idle,
        busy_reads: busy,
        orig_bytes: stats.orig_data_size,
        mem_used: stats.mem_used_total,
        compr_bytes: stats.compr_data_size,
        backend_pinned: backend_memory.pinned_host_bytes,
        backend_device: backend_memory.device_bytes,
        backend_stats,
        verified,
        recompressed,
        written_back,
    })
}

/// One write request of `pages` pages through the handler, its data moving as `via` says
/// (`buf` holds it, or is the bounce buffer).
fn write_via(
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
fn timed_read(
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
    base: usize,
    total: usize,
    threads: usize,
) -> anyhow::Result<bool> {
    let cpages = corpus.len() / PAGE_SIZE;
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
                            let p = first + i;
                            let want = if p < base { p } else { (p - base) % cpages };
                            if got != &corpus[want * PAGE_SIZE..(want + 1) * PAGE_SIZE] {
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

//! One timed pass of writes over a run's ingest region: `queues` writer threads send 64 KiB
//! writes through the daemon's request handler, as ublk queue threads do, while one reader
//! times random 4 KiB reads of the corpus region; the pass ends when every page is
//! compressed and installed. A run makes one pass, then one for each overwrite.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use uzram_core::batch::{BytesSource, LeasedWords, PageSource};
use uzram_core::{PageStore, PAGE_SIZE};

use super::measure::{timed_read, write_via, Layout, Setup, Writer, REQUEST_PAGES};
use super::random::next;
use crate::daemon::backend::WriteBackend;
use crate::sys::{cpu_time, usage, CpuOf};
use crate::ublk::handler::Via;
use crate::ublk::placement::Placement;

/// Most read latencies kept while the writers run.
const MAX_BUSY_SAMPLES: usize = 1 << 22;

/// Pages each overwrite moves the corpus along the ingest region, so that every page gets
/// other contents than it held (a prime: no pass lines the corpus up as an earlier one did,
/// unless the corpus is a multiple of it).
const OVERWRITE_SHIFT: usize = 4099;

/// Where pass `pass` (0: the first write) starts in the corpus: the ingest region's page
/// `i` holds the corpus's page `(i + shift(pass)) % pages`.
pub(super) fn shift(pass: usize, corpus_pages: usize) -> usize {
    pass.wrapping_mul(OVERWRITE_SHIFT) % corpus_pages.max(1)
}

/// What one pass measured.
pub(super) struct Pass {
    /// From the first write to the last acknowledged one.
    pub ack: Duration,
    /// The writers, first done first.
    pub writers: Vec<Writer>,
    /// From the first write until every page was compressed and installed.
    pub compressed: Duration,
    /// Process CPU time over that span, the timing reader's own and the kernel copy's
    /// stand-in left out.
    pub cpu: Duration,
    pub faults: u64,
    /// CPU time (ns) over that span by thread role.
    pub cpu_by_role: BTreeMap<&'static str, u64>,
    /// Read latencies (ns) while the writers ran.
    pub busy: Vec<u32>,
    /// Every timed read returned the page written there.
    pub reader_ok: bool,
}

/// Each writer's copy of the corpus and buffers, made once a run before any clock starts
/// and freed after the last stopped: freeing 16 writers' 64 MiB copies inside the clock took
/// 40 ms of a 100 ms run (docs/bench/gpu-runs.md, run 162).
pub(super) struct Writers {
    sources: Vec<(Source, Vec<u8>, Vec<u8>)>,
}

impl Writers {
    pub(super) fn new(corpus: &[u8], setup: &Setup) -> Self {
        let sources = (0..setup.queues)
            .map(|_| {
                let src = Source::new(corpus);
                // The requests' buffers, as ublk tags have one each.
                // (`bench::run` held them to a quarter of the host's memory.)
                let mut buffer =
                    vec![0u8; setup.request_buffers.max(1) * REQUEST_PAGES * PAGE_SIZE];
                let mut scratch = vec![0u8; REQUEST_PAGES * PAGE_SIZE];
                // Touched now: memory the allocator hands out zeroed may be untouched, and its
                // first write would fault inside the clock (a run with more request buffers
                // then paid faults a run with one, a pool block zeroed on taking, did not).
                buffer.fill(1);
                scratch.fill(1);
                (src, scratch, buffer)
            })
            .collect();
        Self { sources }
    }
}

/// One pass over the ingest region, each page written with the corpus's page `layout`
/// puts there.
pub(super) fn ingest(
    s: &PageStore,
    c: &WriteBackend,
    corpus: &[u8],
    setup: &Setup,
    writers: &mut Writers,
    layout: Layout,
) -> anyhow::Result<Pass> {
    let Layout { base, total, .. } = layout;
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
            let writers: std::io::Result<Vec<_>> = writers
                .sources
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
                                let pages = src.pages_at(layout.corpus_at(first), n, scratch);
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
            c.flush();
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
    Ok(Pass {
        ack,
        writers,
        compressed,
        cpu,
        faults,
        cpu_by_role,
        busy,
        reader_ok,
    })
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
pub(super) struct Source {
    data: Vec<u8>,
    pages: usize,
}

impl Source {
    pub(super) fn new(corpus: &[u8]) -> Self {
        Self {
            data: corpus.to_vec(),
            pages: corpus.len() / PAGE_SIZE,
        }
    }

    /// The `n` pages from page `at` of the corpus repeated, in `scratch` where they wrap
    /// around its end.
    pub(super) fn pages_at<'a>(
        &'a mut self,
        at: usize,
        n: usize,
        scratch: &'a mut [u8],
    ) -> &'a mut [u8] {
        let start = at % self.pages;
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

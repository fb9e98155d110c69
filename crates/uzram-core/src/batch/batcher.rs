//! The write batcher: gathers pages written from any number of threads into batches for a
//! [`BatchBackend`] (the GPU), and commits the results into a [`PageStore`].
//!
//! A deferred page is stored raw at once ([`PageStore::write_deferred`]), so every read is
//! served by the store whatever state the batch is in; the batch result replaces that raw
//! copy only if no newer write, discard or write-zeroes came first (the store's generation
//! check). If the backend fails, the same batch goes through the fallback backend (the
//! CPU); if that fails too the pages simply stay raw. No path loses a page.
//!
//! Memory is bounded: the queue's two page buffers are allocated when the batcher starts.
//! When the queue is full, writers compress inline instead of waiting or allocating.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{BatchBackend, BatchOutput};
use crate::page::PAGE_SIZE;
use crate::store::{PageStore, Ticket};
use crate::CoreError;

/// When a write goes to the batch backend instead of being compressed inline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeferPolicy {
    /// Every page that is not same-filled goes to the batch backend (`--backend gpu`).
    Always,
    /// Only when at least this many pages are waiting or being written: small, sparse
    /// writes are cheaper to compress inline than to ship over PCIe (`--backend auto`).
    Backlog {
        /// Pages in the queue plus pages of writes in progress that make batching pay.
        min_pages: usize,
    },
}

/// How the batcher gathers pages.
#[derive(Debug, Clone)]
pub struct BatcherConfig {
    /// Pages handed to the backend at once (at most; fewer when the delay runs out).
    pub batch_pages: usize,
    /// How long a page may wait for its batch to fill.
    pub max_delay: Duration,
    /// When to defer.
    pub policy: DeferPolicy,
}

impl Default for BatcherConfig {
    fn default() -> Self {
        Self {
            batch_pages: 16384,
            max_delay: Duration::from_millis(2),
            policy: DeferPolicy::Always,
        }
    }
}

/// Counters of a [`WriteBatcher`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatcherStats {
    /// Batches compressed (by the backend or its fallback).
    pub batches: u64,
    /// Pages that went through a batch.
    pub batched_pages: u64,
    /// Pages compressed inline: the policy said so, or the queue was full.
    pub inline_pages: u64,
    /// Batches the backend failed on.
    pub backend_failures: u64,
    /// Batches the fallback backend compressed after such a failure.
    pub fallback_batches: u64,
    /// Pages left raw because the fallback failed as well.
    pub left_raw_pages: u64,
    /// Batch results dropped because the page changed meanwhile.
    pub stale_results: u64,
    /// Nanoseconds spent inside the backends.
    pub backend_ns: u64,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    batched_pages: AtomicU64,
    inline_pages: AtomicU64,
    backend_failures: AtomicU64,
    fallback_batches: AtomicU64,
    left_raw_pages: AtomicU64,
    stale_results: AtomicU64,
    backend_ns: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Pages waiting for a batch: tickets and their bytes, in one preallocated buffer.
#[derive(Debug)]
struct Queue {
    tickets: Vec<Ticket>,
    pages: Vec<u8>,
    /// When the oldest waiting page arrived.
    oldest: Option<Instant>,
    /// Pages ever queued, and pages whose batch has been committed: `flush` waits for the
    /// second to reach the first.
    queued_total: u64,
    done_total: u64,
    stop: bool,
}

#[derive(Debug)]
struct Shared {
    store: Arc<PageStore>,
    cfg: BatcherConfig,
    queue: Mutex<Queue>,
    /// Signals the worker: pages arrived or stop.
    work: Condvar,
    /// Signals flushers: a batch was committed.
    done: Condvar,
    /// Pages of writes currently inside [`WriteBatcher::write`].
    in_flight: AtomicU64,
    counters: Counters,
}

/// Gathers deferred writes into batches for a backend; see the module docs.
pub struct WriteBatcher {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for WriteBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBatcher")
            .field("cfg", &self.shared.cfg)
            .finish_non_exhaustive()
    }
}

impl WriteBatcher {
    /// Starts the batcher thread. `backend` compresses batches; `fallback` takes a batch
    /// `backend` failed on. Both must produce the store's algorithm.
    pub fn start(
        store: Arc<PageStore>,
        backend: Arc<dyn BatchBackend>,
        fallback: Arc<dyn BatchBackend>,
        cfg: BatcherConfig,
    ) -> Result<Self, CoreError> {
        for b in [&backend, &fallback] {
            if b.algorithm() != store.algorithm() {
                return Err(CoreError::Config(format!(
                    "batch backend {} produces {}, the store holds {}",
                    b.name(),
                    b.algorithm(),
                    store.algorithm()
                )));
            }
        }
        if cfg.batch_pages == 0 {
            return Err(CoreError::Config("batch_pages must be at least 1".into()));
        }
        let queue = Queue {
            tickets: Vec::with_capacity(cfg.batch_pages),
            pages: Vec::with_capacity(cfg.batch_pages * PAGE_SIZE),
            oldest: None,
            queued_total: 0,
            done_total: 0,
            stop: false,
        };
        let shared = Arc::new(Shared {
            store,
            cfg,
            queue: Mutex::new(queue),
            work: Condvar::new(),
            done: Condvar::new(),
            in_flight: AtomicU64::new(0),
            counters: Counters::default(),
        });
        let worker_shared = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("uzram-batcher".into())
            .spawn(move || worker_loop(&worker_shared, &*backend, &*fallback))
            .map_err(|e| CoreError::Config(format!("cannot start the batcher thread: {e}")))?;
        Ok(Self {
            shared,
            worker: Some(worker),
        })
    }

    /// The store this batcher writes into.
    pub fn store(&self) -> &Arc<PageStore> {
        &self.shared.store
    }

    /// Writes whole pages starting at `first_page`, deferring to the batch backend where
    /// the policy says so. When this returns, every page is stored (raw or compressed) and
    /// readable.
    pub fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let sh = &*self.shared;
        if data.len() % PAGE_SIZE != 0 {
            return Err(CoreError::Unaligned { len: data.len() });
        }
        let n = (data.len() / PAGE_SIZE) as u64;
        let in_flight = sh.in_flight.fetch_add(n, Ordering::Relaxed) + n;
        let result = if self.defer(in_flight) {
            self.write_deferred(first_page, data)
        } else {
            bump(&sh.counters.inline_pages, n);
            sh.store.write(first_page, data)
        };
        sh.in_flight.fetch_sub(n, Ordering::Relaxed);
        result
    }

    fn defer(&self, in_flight: u64) -> bool {
        match self.shared.cfg.policy {
            DeferPolicy::Always => true,
            DeferPolicy::Backlog { min_pages } => {
                let queued = lock(&self.shared.queue).tickets.len() as u64;
                queued + in_flight >= min_pages as u64
            }
        }
    }

    fn write_deferred(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let sh = &*self.shared;
        for (i, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let index = first_page + i as u64;
            let page: &[u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: page.len() })?;
            let Some(ticket) = sh.store.write_deferred(index, page)? else {
                continue; // same-filled: already stored for good
            };
            let mut q = lock(&sh.queue);
            if q.tickets.len() >= sh.cfg.batch_pages || q.stop {
                drop(q);
                // Queue full: compress inline rather than wait or grow. This replaces the
                // raw copy and makes the ticket stale.
                bump(&sh.counters.inline_pages, 1);
                sh.store.write(index, page)?;
                continue;
            }
            q.tickets.push(ticket);
            q.pages.extend_from_slice(page);
            q.queued_total += 1;
            let now = Instant::now();
            q.oldest.get_or_insert(now);
            if q.tickets.len() == 1 || q.tickets.len() >= sh.cfg.batch_pages {
                sh.work.notify_one();
            }
        }
        Ok(())
    }

    /// Waits until every page queued before this call has been through its batch.
    pub fn flush(&self) {
        let sh = &*self.shared;
        let mut q = lock(&sh.queue);
        let target = q.queued_total;
        sh.work.notify_one();
        while q.done_total < target && !q.stop {
            q = sh
                .done
                .wait_timeout(q, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> BatcherStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BatcherStats {
            batches: g(&c.batches),
            batched_pages: g(&c.batched_pages),
            inline_pages: g(&c.inline_pages),
            backend_failures: g(&c.backend_failures),
            fallback_batches: g(&c.fallback_batches),
            left_raw_pages: g(&c.left_raw_pages),
            stale_results: g(&c.stale_results),
            backend_ns: g(&c.backend_ns),
        }
    }

    /// Compresses what is queued, then stops the batcher thread.
    pub fn shutdown(mut self) {
        self.stop_worker();
    }

    fn stop_worker(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.work.notify_one();
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                tracing::error!("the batcher thread panicked; queued pages stay stored raw");
            }
        }
    }
}

impl Drop for WriteBatcher {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    // A poisoned queue still holds consistent vectors (pushes are not interrupted midway
    // by anything but a panic in extend, which does not leave partial tickets).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn worker_loop(sh: &Shared, backend: &dyn BatchBackend, fallback: &dyn BatchBackend) {
    let mut tickets: Vec<Ticket> = Vec::with_capacity(sh.cfg.batch_pages);
    let mut pages: Vec<u8> = Vec::with_capacity(sh.cfg.batch_pages * PAGE_SIZE);
    let mut out = BatchOutput::default();
    loop {
        let stop = {
            let mut q = lock(&sh.queue);
            loop {
                let full = q.tickets.len() >= sh.cfg.batch_pages;
                let due = q.oldest.is_some_and(|t| t.elapsed() >= sh.cfg.max_delay);
                if full || due || q.stop {
                    break;
                }
                let wait = q.oldest.map_or(Duration::from_millis(100), |t| {
                    sh.cfg.max_delay.saturating_sub(t.elapsed())
                });
                q = sh
                    .work
                    .wait_timeout(q, wait)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            std::mem::swap(&mut q.tickets, &mut tickets);
            std::mem::swap(&mut q.pages, &mut pages);
            q.oldest = None;
            q.stop
        };
        if !tickets.is_empty() {
            run_batch(sh, backend, fallback, &tickets, &pages, &mut out);
            let mut q = lock(&sh.queue);
            q.done_total += tickets.len() as u64;
            sh.done.notify_all();
        }
        tickets.clear();
        pages.clear();
        if stop {
            let mut q = lock(&sh.queue);
            if q.tickets.is_empty() {
                q.done_total = q.queued_total;
                sh.done.notify_all();
                return;
            }
        }
    }
}

fn run_batch(
    sh: &Shared,
    backend: &dyn BatchBackend,
    fallback: &dyn BatchBackend,
    tickets: &[Ticket],
    pages: &[u8],
    out: &mut BatchOutput,
) {
    let c = &sh.counters;
    let threshold = sh.store.raw_threshold();
    let t0 = Instant::now();
    let mut compressed = compress_checked(backend, pages, threshold, out, tickets.len());
    if let Err(e) = &compressed {
        bump(&c.backend_failures, 1);
        tracing::warn!(
            backend = backend.name(),
            pages = tickets.len(),
            "batch backend failed, compressing this batch with {}: {e}",
            fallback.name()
        );
        compressed = compress_checked(fallback, pages, threshold, out, tickets.len());
        if compressed.is_ok() {
            bump(&c.fallback_batches, 1);
        }
    }
    bump(&c.backend_ns, t0.elapsed().as_nanos() as u64);
    bump(&c.batches, 1);
    bump(&c.batched_pages, tickets.len() as u64);
    if let Err(e) = compressed {
        bump(&c.left_raw_pages, tickets.len() as u64);
        tracing::error!(
            pages = tickets.len(),
            "fallback backend failed too; the pages stay stored raw: {e}"
        );
        return;
    }
    for (i, &ticket) in tickets.iter().enumerate() {
        let committed = out.get(i).map(|encoded| sh.store.commit(ticket, encoded));
        match committed {
            Some(Ok(true)) => {}
            Some(Ok(false)) => bump(&c.stale_results, 1),
            // Out of memory for the compressed copy, or an unset result: the raw copy
            // stays, which is still the right content.
            Some(Err(_)) | None => bump(&c.left_raw_pages, 1),
        }
    }
}

/// Runs a backend and checks it produced one valid result per page.
fn compress_checked(
    backend: &dyn BatchBackend,
    pages: &[u8],
    threshold: usize,
    out: &mut BatchOutput,
    n: usize,
) -> Result<(), CoreError> {
    backend.compress_batch(pages, threshold, out)?;
    if out.len() != n || (0..n).any(|i| out.get(i).is_none()) {
        return Err(CoreError::Backend {
            backend: backend.name(),
            reason: format!("returned {} results for {n} pages", out.len()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;

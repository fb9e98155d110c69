//! `uzram bench --writeback PATH`: after a run's writes (and its recompression, if asked),
//! the lower half of the device written back to a backing file as the daemon's writeback
//! does it (packed and sealed, direct I/O): the disk bytes a written-back page costs
//! against the 4 KiB zram writes for each, the latency of reads of pages still in RAM
//! while the pass runs against before it, and of reads that come from the disk.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use uzram_core::store::{Nonces, Writeback, WritebackCandidates};
use uzram_core::{PageStore, PAGE_SIZE};

use super::measure::Layout;
use super::queue_reads::{self, QueueReads};
use super::random::next;
use crate::daemon::backend::WriteBackend;
use crate::daemon::backing::{new_key, BackingFile};
use crate::ublk::handler::{handle, Op};

/// Timed reads of each kind.
const READS: usize = 20_000;
const SECTORS_PER_PAGE: u64 = (PAGE_SIZE / 512) as u64;

/// What writing back half the device did.
#[derive(Debug, Clone, Default)]
pub struct WrittenBack {
    /// Pages written back, and the bytes the pass wrote for them.
    pub pages: u64,
    pub disk_bytes: u64,
    /// Their compressed bytes in RAM before.
    pub payload_bytes: u64,
    /// Wall time of the pass.
    pub wall: Duration,
    /// Reads of pages in RAM before the pass, while it ran, and reads from the disk (ns,
    /// sorted).
    pub ram_idle: Vec<u32>,
    pub ram_busy: Vec<u32>,
    pub disk: Vec<u32>,
    /// One queue thread serving a mix of reads (`queue_reads.rs`), with written-back pages
    /// read synchronously on it and through its ring; `None` without io_uring.
    pub queue_inline: Option<QueueReads>,
    pub queue_ring: Option<QueueReads>,
    /// Every timed read returned the page written.
    pub reads_ok: bool,
}

/// Writes back pages `0..total / 2` of `store` (laid out as `layout` says) to the backing
/// file at `path`.
pub fn measure(
    store: &PageStore,
    c: &WriteBackend,
    corpus: &[u8],
    layout: Layout,
    path: &Path,
) -> anyhow::Result<WrittenBack> {
    let total = layout.total;
    let file = BackingFile::open(path, store.pages())?;
    // A path that holds anything but zeros or uzram's label is refused, as the daemon does.
    let key = new_key()?;
    file.label(&key)?;
    store
        .attach_backing(Arc::new(file), &key, Nonces::Owned)
        .context("attaching the backing file")?;
    let half = total / 2;
    // Every page idle, then the upper half used again: the pass takes the lower half only.
    store.mark_idle(None);
    let mut page = vec![0u8; PAGE_SIZE];
    let mut ok = true;
    for p in half..total {
        ok &= read(store, c, p, &mut page) && page == layout.expected(corpus, p);
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut timed = |pages: &dyn Fn(u64) -> usize, page: &mut [u8]| {
        let p = pages(next(&mut seed));
        page.fill(0xa5);
        let t = Instant::now();
        let good = read(store, c, p, page) && page == layout.expected(corpus, p);
        (
            u32::try_from(t.elapsed().as_nanos()).unwrap_or(u32::MAX),
            good,
        )
    };
    let in_ram = |r: u64| half + (r % (total - half) as u64) as usize;
    let mut ram_idle = Vec::with_capacity(READS);
    for _ in 0..READS {
        let (lat, good) = timed(&in_ram, &mut page);
        ram_idle.push(lat);
        ok &= good;
    }
    let before = store.stats();
    let done = AtomicBool::new(false);
    let (pass, ram_busy) = std::thread::scope(|scope| {
        let pass = scope.spawn(|| {
            let t = Instant::now();
            let r = store.writeback(Writeback {
                candidates: WritebackCandidates::Idle { min_age: 1 },
                max_pages: u64::MAX,
                max_bytes: u64::MAX,
            });
            done.store(true, Ordering::Release);
            r.map(|r| (r, t.elapsed()))
        });
        let mut busy = Vec::new();
        let mut page = vec![0u8; PAGE_SIZE];
        while !done.load(Ordering::Acquire) {
            let (lat, good) = timed(&in_ram, &mut page);
            busy.push(lat);
            ok &= good;
        }
        (pass.join(), busy)
    });
    let (pass, wall) = pass
        .map_err(|_| anyhow::anyhow!("the writeback pass panicked"))?
        .context("the writeback pass")?;
    let after = store.stats();
    // The disk's reads are of pages the pass wrote: same-filled pages (zeros among them)
    // stay in RAM, and timing them would count RAM reads as the disk's.
    let on_disk: Vec<usize> = store
        .written_back_pages()
        .into_iter()
        .filter_map(|p| usize::try_from(p).ok())
        .filter(|&p| p < half)
        .collect();
    let mut disk = Vec::with_capacity(READS);
    if !on_disk.is_empty() {
        for _ in 0..READS {
            let (lat, good) = timed(&|r| on_disk[(r % on_disk.len() as u64) as usize], &mut page);
            disk.push(lat);
            ok &= good;
        }
    }
    let page_of = |p: usize| layout.expected(corpus, p);
    let (queue_inline, queue_ring) = if on_disk.is_empty() {
        (None, None)
    } else {
        (
            queue_reads::measure(store, c, &on_disk, half..total, false, &page_of),
            queue_reads::measure(store, c, &on_disk, half..total, true, &page_of),
        )
    };
    for q in [&queue_inline, &queue_ring].into_iter().flatten() {
        ok &= q.ok;
    }
    let (mut ram_idle, mut ram_busy) = (ram_idle, ram_busy);
    ram_idle.sort_unstable();
    ram_busy.sort_unstable();
    disk.sort_unstable();
    Ok(WrittenBack {
        pages: pass.pages,
        disk_bytes: after.bd_bytes_written - before.bd_bytes_written,
        payload_bytes: pass.payload_bytes,
        wall,
        ram_idle,
        ram_busy,
        disk,
        queue_inline,
        queue_ring,
        reads_ok: ok,
    })
}

fn read(store: &PageStore, c: &WriteBackend, p: usize, page: &mut [u8]) -> bool {
    handle(Op::Read, p as u64 * SECTORS_PER_PAGE, 8, page, store, c) == PAGE_SIZE as i32
}

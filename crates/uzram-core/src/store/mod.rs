//! [`PageStore`]: a sharded page table over a size-class arena.
//!
//! - The table is striped over up to [`MAX_SHARDS`] reader-writer locks (page `p` lives in
//!   shard `p % shards`); each page costs one 8-byte entry (`entry.rs`).
//! - Compressed bytes live in one size-class arena (`arena.rs`) shared by all shards.
//! - Compression and decompression never run under the bookkeeping locks: a write
//!   compresses on the calling thread, copies the result into freshly reserved arena
//!   space, and only then takes the shard lock to swap the entry; the old space is freed
//!   after the lock is dropped. A read holds its shard's read lock while it decodes, so
//!   the bytes cannot be freed under it.

mod arena;
mod entry;
mod shard;
mod stats;
mod worker;

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use self::stats::{MemoryUsage, Stats};

use self::arena::{Arena, Object};
use self::entry::Slot;
use self::shard::Shard;
use self::stats::{Counters, PageCost, PageTotals};
use crate::batch::{BatchBackend, BatchOutput, Encoded};
use crate::codec::Algorithm;
use crate::page::{fill_page, same_filled_word, PAGE_SIZE};
use crate::CoreError;

/// Most lock stripes a store uses.
pub const MAX_SHARDS: usize = 64;

/// How a [`PageStore`] is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Pages in the store (the device size / 4096).
    pub pages: u64,
    /// Codec for every page.
    pub algorithm: Algorithm,
    /// Refuse writes that would take `mem_used_total` above this many bytes. (The few
    /// bytes of side maps, for fill words that do not fit an entry and for pending
    /// deferred writes, are counted in `mem_used_total` but not held to the limit.)
    pub mem_limit: Option<u64>,
    /// Compressed output of this many bytes or more is stored raw (a huge page).
    pub raw_threshold: usize,
}

impl StoreConfig {
    /// Default raw-storage threshold: zram's real one. zsmalloc (with its chain size of 8)
    /// stores objects above about 3625 bytes in a class of their own, so zram keeps those
    /// pages uncompressed ("huge"). At 3072 (3/4 page) the python-heap corpus stores at
    /// 2.336 instead of 2.391 and reads were not measurably faster (see README).
    pub const DEFAULT_RAW_THRESHOLD: usize = 3625;

    /// A config with no memory limit and the default threshold.
    pub fn new(pages: u64, algorithm: Algorithm) -> Self {
        Self {
            pages,
            algorithm,
            mem_limit: None,
            raw_threshold: Self::DEFAULT_RAW_THRESHOLD,
        }
    }
}

/// Identifies one deferred write: see [`PageStore::write_deferred`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// The page written.
    pub page: u64,
    /// Which write to that page (per shard, wrapping).
    pub generation: u32,
}

/// What a page becomes, before arena space is reserved for it.
#[derive(Debug, Clone, Copy)]
enum Payload<'a> {
    Empty,
    Same(u64),
    /// Compressed bytes, or the raw page when `len == PAGE_SIZE`.
    Bytes(&'a [u8]),
}

/// When an install may replace the page's current content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Install {
    Always,
    /// Always, and mark the result as a deferred write.
    Deferred,
    /// Only if the page still holds the deferred write of this generation.
    Commit(u32),
}

/// What [`PageStore::install`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Installed {
    /// A commit found the page changed; nothing was stored.
    Stale,
    /// Stored.
    Done {
        /// The page held data before.
        held_data: bool,
        /// The deferred write's generation, for `Install::Deferred`.
        generation: Option<u32>,
    },
}

/// Compressed page store; `Send + Sync`, share it with `Arc`.
#[derive(Debug)]
pub struct PageStore {
    pages: u64,
    algorithm: Algorithm,
    raw_threshold: usize,
    mem_limit: Option<u64>,
    shard_mask: u64,
    shard_shift: u32,
    shards: Box<[RwLock<Shard>]>,
    arena: Arena,
    table_bytes: u64,
    counters: Counters,
}

impl PageStore {
    /// Builds an empty store. Fails on zero pages, a threshold outside `1..=4096`, or a
    /// memory limit smaller than the page table itself.
    pub fn new(cfg: StoreConfig) -> Result<Self, CoreError> {
        if cfg.pages == 0 {
            return Err(CoreError::Config("a store needs at least one page".into()));
        }
        if !(1..=PAGE_SIZE).contains(&cfg.raw_threshold) {
            return Err(CoreError::Config(format!(
                "raw_threshold {} is outside 1..=4096",
                cfg.raw_threshold
            )));
        }
        let Ok(pages) = usize::try_from(cfg.pages) else {
            return Err(CoreError::Config(format!(
                "{} pages is too many",
                cfg.pages
            )));
        };
        if pages.checked_mul(PAGE_SIZE).is_none() {
            return Err(CoreError::Config(format!("{pages} pages is too many")));
        }
        let shards = pages.next_power_of_two().min(MAX_SHARDS);
        let shard_shift = shards.trailing_zeros();
        let shards: Box<[RwLock<Shard>]> = (0..shards)
            .map(|s| RwLock::new(Shard::new(pages.saturating_sub(s).div_ceil(shards))))
            .collect();
        // The store struct minus the arena inside it (the arena counts itself).
        let table_bytes = (std::mem::size_of::<Self>() - std::mem::size_of::<Arena>()
            + shards.len() * std::mem::size_of::<RwLock<Shard>>()) as u64
            + shards
                .iter()
                .map(|s| read_lock(s).table_bytes())
                .sum::<u64>();
        if let Some(limit) = cfg.mem_limit {
            if limit < table_bytes {
                return Err(CoreError::Config(format!(
                    "mem_limit {limit} is below the {table_bytes}-byte page table"
                )));
            }
        }
        Ok(Self {
            pages: cfg.pages,
            algorithm: cfg.algorithm,
            raw_threshold: cfg.raw_threshold,
            mem_limit: cfg.mem_limit,
            shard_mask: (shards.len() - 1) as u64,
            shard_shift,
            shards,
            arena: Arena::new(table_bytes, cfg.mem_limit),
            table_bytes,
            counters: Counters::default(),
        })
    }

    /// Pages in the store.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The store's codec.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Compressed output of this many bytes or more is stored raw.
    pub fn raw_threshold(&self) -> usize {
        self.raw_threshold
    }

    /// Writes whole pages starting at `first_page`, compressing each on the calling thread
    /// with that thread's reused codec. On an error, the pages before the failing one are
    /// written and the rest keep their old content. Failed requests are counted by the
    /// caller ([`PageStore::record_failed_write`]).
    pub fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let count = self.check_buffer(first_page, data.len())?;
        for (i, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let page: &[u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            let index = first_page + i as u64;
            if let Some(word) = same_filled_word(page) {
                self.install(index, Payload::Same(word), Install::Always)?;
                continue;
            }
            let threshold = self.raw_threshold;
            worker::with_codec(self.algorithm, |codec, scratch| {
                let out = &mut scratch[..threshold];
                let payload = match codec.compress(page, out).map_err(CoreError::Compress)? {
                    Some(len) if len > 0 && len < threshold => Payload::Bytes(&out[..len]),
                    _ => Payload::Bytes(page),
                };
                self.install(index, payload, Install::Always)
            })?;
        }
        Counters::bump(&self.counters.writes, count);
        Ok(())
    }

    /// Reads whole pages starting at `first_page` into `out`. Failed requests are counted
    /// by the caller ([`PageStore::record_failed_read`]).
    pub fn read(&self, first_page: u64, out: &mut [u8]) -> Result<(), CoreError> {
        let count = self.check_buffer(first_page, out.len())?;
        for (i, page) in out.chunks_exact_mut(PAGE_SIZE).enumerate() {
            let page: &mut [u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: PAGE_SIZE })?;
            self.read_page(first_page + i as u64, page)?;
        }
        Counters::bump(&self.counters.reads, count);
        Ok(())
    }

    fn read_page(&self, index: u64, page: &mut [u8; PAGE_SIZE]) -> Result<(), CoreError> {
        let (shard, idx) = self.locate(index);
        let shard = read_lock(shard);
        let (handle, len) = match shard.get(idx) {
            None => return Err(self.out_of_range(index, 1)),
            Some(Slot::Empty) => {
                page.fill(0);
                return Ok(());
            }
            Some(Slot::Same(word)) => {
                fill_page(page, word);
                return Ok(());
            }
            Some(Slot::SameExt) => return Err(corrupt(index, "fill word missing")),
            Some(Slot::Stored { handle, len }) => (handle, usize::from(len)),
        };
        if len == PAGE_SIZE {
            return match self.arena.load(handle, len, page) {
                true => Ok(()),
                false => Err(corrupt(index, "arena range missing")),
            };
        }
        // Copy the compressed bytes out under the shard lock, decode after dropping it.
        worker::with_codec(self.algorithm, |codec, scratch| {
            let loaded = self.arena.load(handle, len, scratch);
            drop(shard);
            if !loaded {
                return Err(corrupt(index, "arena range missing"));
            }
            codec
                .decompress(&scratch[..len], page)
                .map_err(|source| CoreError::Corrupt { index, source })
        })
    }

    /// Frees `count` pages from `first_page`: they read as zeros and hold no memory.
    /// Each page that held data counts in `notify_free`.
    pub fn discard(&self, first_page: u64, count: u64) -> Result<(), CoreError> {
        self.check_range(first_page, count)?;
        let mut freed = 0;
        for index in first_page..first_page + count {
            if let Installed::Done {
                held_data: true, ..
            } = self.install(index, Payload::Empty, Install::Always)?
            {
                freed += 1;
            }
        }
        Counters::bump(&self.counters.notify_free, freed);
        Ok(())
    }

    /// Zeroes `count` pages from `first_page`: they read as zeros and hold no memory.
    pub fn write_zeroes(&self, first_page: u64, count: u64) -> Result<(), CoreError> {
        self.check_range(first_page, count)?;
        for index in first_page..first_page + count {
            self.install(index, Payload::Empty, Install::Always)?;
        }
        Ok(())
    }

    /// Compresses `data` through `backend` (whose algorithm must be the store's), then
    /// stores every page (large batches on several threads). On an error some pages may
    /// already hold the new content; each page holds either its old or its new content.
    pub fn write_batch(
        &self,
        first_page: u64,
        data: &[u8],
        backend: &dyn BatchBackend,
    ) -> Result<(), CoreError> {
        let count = self.check_buffer(first_page, data.len())?;
        if backend.algorithm() != self.algorithm {
            return Err(CoreError::Config(format!(
                "backend {} produces {}, the store holds {}",
                backend.name(),
                backend.algorithm(),
                self.algorithm
            )));
        }
        worker::with_batch_output(|out| self.store_batch(first_page, data, backend, out))?;
        Counters::bump(&self.counters.writes, count);
        Ok(())
    }

    fn store_batch(
        &self,
        first_page: u64,
        data: &[u8],
        backend: &dyn BatchBackend,
        out: &mut BatchOutput,
    ) -> Result<(), CoreError> {
        backend.compress_batch(data, self.raw_threshold, out)?;
        if out.len() != data.len() / PAGE_SIZE {
            return Err(backend_error(backend, "returned the wrong number of pages"));
        }
        let pages = data.len() / PAGE_SIZE;
        // A GPU hands over tens of thousands of pages at a time; storing them one by one
        // on this thread would cap the backend at one core's copy speed.
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(pages.div_ceil(INSTALL_PAGES_PER_THREAD))
            .max(1);
        if threads == 1 {
            return self.install_results(first_page, 0..pages, data, backend, out);
        }
        let per = pages.div_ceil(threads);
        let out = &*out;
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..pages)
                .step_by(per)
                .map(|start| {
                    let range = start..(start + per).min(pages);
                    s.spawn(move || self.install_results(first_page, range, data, backend, out))
                })
                .collect();
            let results: Vec<Result<(), CoreError>> = workers
                .into_iter()
                .map(|w| {
                    w.join().unwrap_or_else(|_| {
                        Err(backend_error(backend, "an install thread panicked"))
                    })
                })
                .collect();
            results.into_iter().collect()
        })
    }

    /// Stores the batch results for pages `range` (indexes into the batch).
    fn install_results(
        &self,
        first_page: u64,
        range: std::ops::Range<usize>,
        data: &[u8],
        backend: &dyn BatchBackend,
        out: &BatchOutput,
    ) -> Result<(), CoreError> {
        for i in range {
            let page = &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
            let encoded = out
                .get(i)
                .ok_or_else(|| backend_error(backend, "left a page without a valid result"))?;
            let payload = match encoded {
                Encoded::SameFilled(word) => Payload::Same(word),
                Encoded::Compressed(bytes) if bytes.len() < self.raw_threshold => {
                    Payload::Bytes(bytes)
                }
                Encoded::Compressed(_) | Encoded::Raw => Payload::Bytes(page),
            };
            self.install(first_page + i as u64, payload, Install::Always)?;
        }
        Ok(())
    }

    /// The deferred (GPU) path: a same-filled page is stored at once and `None` returned;
    /// any other page is stored raw now, so reads are always served by the store, and a
    /// [`Ticket`] for its later [`PageStore::commit`] is returned.
    pub fn write_deferred(
        &self,
        page: u64,
        data: &[u8; PAGE_SIZE],
    ) -> Result<Option<Ticket>, CoreError> {
        self.check_range(page, 1)?;
        let ticket = if let Some(word) = same_filled_word(data) {
            self.install(page, Payload::Same(word), Install::Always)?;
            None
        } else {
            match self.install(page, Payload::Bytes(data), Install::Deferred)? {
                Installed::Done { generation, .. } => {
                    generation.map(|generation| Ticket { page, generation })
                }
                Installed::Stale => None,
            }
        };
        Counters::bump(&self.counters.writes, 1);
        Ok(ticket)
    }

    /// Replaces a deferred write's raw copy with `encoded`, if the page still holds exactly
    /// the write that made `ticket`. `Ok(false)`: a later write, discard or write_zeroes
    /// came first; the result is dropped. Compressed output at or above the threshold
    /// leaves the raw copy in place (and still counts as committed). The store does not
    /// decode `encoded` to check it: the backend guarantees it decodes to the ticket's page
    /// (DESIGN.md invariant 2, tested in the backends' conformance tests).
    pub fn commit(&self, ticket: Ticket, encoded: Encoded<'_>) -> Result<bool, CoreError> {
        self.check_range(ticket.page, 1)?;
        let payload = match encoded {
            Encoded::SameFilled(word) => Payload::Same(word),
            Encoded::Compressed(bytes) if !bytes.is_empty() && bytes.len() < self.raw_threshold => {
                Payload::Bytes(bytes)
            }
            Encoded::Compressed(_) | Encoded::Raw => {
                let (shard, idx) = self.locate(ticket.page);
                let mut shard = write_lock(shard);
                if !shard.is_pending(idx, ticket.generation) {
                    return Ok(false);
                }
                shard.clear_pending(idx);
                return Ok(true);
            }
        };
        // Cheap early out for a stale ticket before reserving arena space (checked again
        // under the write lock, where it counts).
        let (shard, idx) = self.locate(ticket.page);
        if !read_lock(shard).is_pending(idx, ticket.generation) {
            return Ok(false);
        }
        let installed = self.install(ticket.page, payload, Install::Commit(ticket.generation))?;
        Ok(installed != Installed::Stale)
    }

    /// Compacts the arena like zram's `compact`: slides every stored page's bytes down to
    /// the lowest addresses and releases the segments left empty. Returns the pages'
    /// worth of memory released (also added to `pages_compacted`).
    ///
    /// Stops the world: every shard is write-locked for the duration (tens of ms per
    /// GiB stored). It only runs when no write is between reserving arena space and
    /// publishing it; after a few tries against such writes it gives up and returns 0.
    pub fn compact(&self) -> u64 {
        for _ in 0..100 {
            let mut compaction = self.arena.lock_for_compaction();
            let mut shards: Vec<_> = self.shards.iter().map(write_lock).collect();
            let mut objects: Vec<Object> = shards
                .iter()
                .enumerate()
                .flat_map(|(s, shard)| {
                    shard.stored().map(move |(idx, handle, len)| Object {
                        handle,
                        len,
                        tag: (idx << self.shard_shift) | s as u64,
                    })
                })
                .collect();
            if objects.len() as u64 != compaction.objects() {
                drop(shards);
                drop(compaction);
                std::thread::yield_now();
                continue;
            }
            let pages = compaction.run(&mut objects);
            for object in &objects {
                let s = (object.tag & self.shard_mask) as usize;
                if let Some(shard) = shards.get_mut(s) {
                    shard.rehome(object.tag >> self.shard_shift, object.handle);
                }
            }
            return pages;
        }
        0
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let (totals, side) = self.shard_totals();
        let usage = self.arena.usage();
        let c = &self.counters;
        let pages_stored = totals.pages_stored;
        Stats {
            orig_data_size: pages_stored * PAGE_SIZE as u64,
            compr_data_size: totals.compr_data_size,
            mem_used_total: self.table_bytes + usage.held_bytes + side,
            mem_limit: self.mem_limit.unwrap_or(0),
            mem_used_max: self.table_bytes + usage.max_held_bytes + side,
            same_pages: totals.same_pages,
            pages_compacted: usage.compacted_pages,
            huge_pages: totals.huge_pages,
            failed_reads: Counters::get(&c.failed_reads),
            failed_writes: Counters::get(&c.failed_writes),
            invalid_io: Counters::get(&c.invalid_io),
            notify_free: Counters::get(&c.notify_free),
            pages_stored,
            reads: Counters::get(&c.reads),
            writes: Counters::get(&c.writes),
        }
    }

    /// Counts a failed read request (io_stat `failed_reads`).
    pub fn record_failed_read(&self) {
        Counters::bump(&self.counters.failed_reads, 1);
    }

    /// Counts a failed write request (io_stat `failed_writes`).
    pub fn record_failed_write(&self) {
        Counters::bump(&self.counters.failed_writes, 1);
    }

    /// Counts a request refused as out of range or misaligned (io_stat `invalid_io`).
    pub fn record_invalid_io(&self) {
        Counters::bump(&self.counters.invalid_io, 1);
    }

    /// Where `mem_used_total` goes, for benchmarks and diagnostics.
    pub fn memory(&self) -> MemoryUsage {
        let (totals, side) = self.shard_totals();
        let usage = self.arena.usage();
        let payload = totals.compr_data_size;
        MemoryUsage {
            table_bytes: self.table_bytes,
            side_map_bytes: side,
            arena_bookkeeping_bytes: usage.held_bytes - usage.segment_bytes,
            segment_bytes: usage.segment_bytes,
            payload_bytes: payload,
            class_rounding_bytes: usage.class_bytes.saturating_sub(payload),
            free_hole_bytes: usage.free_bytes,
            frontier_unused_bytes: usage
                .segment_bytes
                .saturating_sub(usage.class_bytes + usage.free_bytes),
        }
    }

    /// Bytes of the page table (entries, shard locks, the store itself): fixed at creation.
    pub fn table_bytes(&self) -> u64 {
        self.table_bytes
    }

    /// Puts `payload` into page `index` under `mode`.
    fn install(
        &self,
        index: u64,
        payload: Payload<'_>,
        mode: Install,
    ) -> Result<Installed, CoreError> {
        let (slot, cost) = match payload {
            Payload::Empty => (Slot::Empty, PageCost::default()),
            Payload::Same(word) => (
                Slot::Same(word),
                PageCost {
                    stored: true,
                    same: true,
                    ..PageCost::default()
                },
            ),
            Payload::Bytes(bytes) => {
                let handle = self.arena.store(bytes)?;
                let len = bytes.len();
                (
                    Slot::Stored {
                        handle,
                        len: len as u16,
                    },
                    PageCost {
                        stored: true,
                        huge: len == PAGE_SIZE,
                        payload: len as u64,
                        ..PageCost::default()
                    },
                )
            }
        };
        let (shard, idx) = self.locate(index);
        let mut shard = write_lock(shard);
        if let Install::Commit(generation) = mode {
            if !shard.is_pending(idx, generation) {
                drop(shard);
                free_slot(&self.arena, slot);
                return Ok(Installed::Stale);
            }
        }
        let Some(old) = shard.set(idx, slot) else {
            drop(shard);
            free_slot(&self.arena, slot);
            return Err(self.out_of_range(index, 1));
        };
        let generation = (mode == Install::Deferred).then(|| shard.mark_pending(idx));
        shard.totals.replace(cost_of(old), cost);
        drop(shard);
        free_slot(&self.arena, old);
        Ok(Installed::Done {
            held_data: old != Slot::Empty,
            generation,
        })
    }

    /// Page totals and side-map bytes summed over the shards.
    fn shard_totals(&self) -> (PageTotals, u64) {
        let mut totals = PageTotals::default();
        let mut side = 0;
        for shard in self.shards.iter() {
            let shard = read_lock(shard);
            totals.add(&shard.totals);
            side += shard.side_bytes();
        }
        (totals, side)
    }

    fn locate(&self, index: u64) -> (&RwLock<Shard>, u64) {
        let shard = (index & self.shard_mask) as usize;
        (&self.shards[shard], index >> self.shard_shift)
    }

    fn check_buffer(&self, first: u64, len: usize) -> Result<u64, CoreError> {
        if len % PAGE_SIZE != 0 {
            return Err(CoreError::Unaligned { len });
        }
        let count = (len / PAGE_SIZE) as u64;
        self.check_range(first, count)?;
        Ok(count)
    }

    fn check_range(&self, first: u64, count: u64) -> Result<(), CoreError> {
        match first.checked_add(count) {
            Some(end) if end <= self.pages => Ok(()),
            _ => Err(self.out_of_range(first, count)),
        }
    }

    fn out_of_range(&self, first: u64, count: u64) -> CoreError {
        CoreError::OutOfRange {
            first,
            end: first.saturating_add(count),
            pages: self.pages,
        }
    }
}

fn cost_of(slot: Slot) -> PageCost {
    match slot {
        Slot::Empty => PageCost::default(),
        Slot::Same(_) | Slot::SameExt => PageCost {
            stored: true,
            same: true,
            ..PageCost::default()
        },
        Slot::Stored { len, .. } => PageCost {
            stored: true,
            huge: usize::from(len) == PAGE_SIZE,
            payload: u64::from(len),
            ..PageCost::default()
        },
    }
}

fn free_slot(arena: &Arena, slot: Slot) {
    if let Slot::Stored { handle, len } = slot {
        arena.free(handle, usize::from(len));
    }
}

fn corrupt(index: u64, what: &str) -> CoreError {
    CoreError::Corrupt {
        index,
        source: crate::codec::CodecError::Corrupt(what.into()),
    }
}

/// Below this many pages per thread, a batch is stored on the calling thread alone.
const INSTALL_PAGES_PER_THREAD: usize = 1024;

fn backend_error(backend: &dyn BatchBackend, reason: &str) -> CoreError {
    CoreError::Backend {
        backend: backend.name(),
        reason: reason.into(),
    }
}

fn read_lock<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write_lock<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;

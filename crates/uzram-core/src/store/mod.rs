//! [`PageStore`]: a sharded page table over a size-class arena.
//!
//! - The table is striped over up to [`MAX_SHARDS`] reader-writer locks in groups of
//!   [`GROUP_PAGES`] consecutive pages, so a 64 KiB request takes one lock, not sixteen.
//!   Groups go to shards by a hash: writers that walk regions a power of two apart (swap
//!   clusters, queue threads) would otherwise meet on the same lock at every step. Each
//!   page costs one 8-byte entry (`entry.rs`).
//! - Compressed bytes live in one size-class arena (`arena.rs`) shared by all shards.
//! - Compression and decompression never run under the bookkeeping locks: a write
//!   compresses on the calling thread, copies the result into freshly reserved arena
//!   space, and only then takes the shard lock to swap the entry; the old space is freed
//!   after the lock is dropped. A read holds its shard's read lock while it copies the
//!   bytes out, so they cannot be freed under it.
//!
//! Every stored object carries a checksum after its payload: CRC32C of the page's 4096
//! bytes as the writer handed it over ([`crate::page::page_checksum`]), bound to the page's
//! index (`PageStore::bound_checksum`). A read decodes the page and compares; a mismatch
//! fails the read with [`CoreError::Checksum`] (an I/O error for that request, counted in
//! `checksum_failures`), never returns other data. The checksum is computed from the
//! writer's page, not from what a backend returned, so it also catches a backend whose
//! output decodes to something else. A same-filled page has no bytes to check: its entry
//! carries a check byte of its word (`entry.rs`).
//!
//! Beside this file: deferred writes, staged and committed later (`staged.rs`); the cold
//! tier's ages and recompression (`tier.rs`, `recompress.rs`); writeback to a backing
//! device and reads from it (`writeback.rs`, `backing.rs`, `disk_read.rs`); the table and
//! segments kept across a daemon's restart (`persist.rs`).

mod arena;
mod backing;
mod dictionary;
mod disk_read;
mod entry;
pub mod persist;
mod recompress;
mod segments;
mod shard;
mod staged;
mod stats;
mod tier;
mod words;
mod worker;
mod write_batch;
mod writeback;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

#[cfg(test)]
pub(crate) use self::arena::locks_taken as arena_locks_taken;
pub(crate) use self::arena::Replaced;
pub use self::arena::RAW_PAGES_PER_SEGMENT;
pub use self::backing::{
    BackingDevice, BlockRun, Nonces, WritebackKey, BLOCK_BYTES, KEY_BYTES, MAX_OBJECT_BLOCKS,
    RUNS_IN_FLIGHT, RUN_BLOCKS, SEAL_BYTES, TAG_BYTES,
};
pub use self::disk_read::DiskRead;
pub use self::entry::{StagedAt, EMPTY_WORD, MAX_SLOT_PAGES, MAX_STAGING_SLOTS};
pub use self::persist::{Persistence, Recovered, SegmentHome, SegmentWords, SEGMENT_BYTES};
pub use self::staged::{Commit, CommitState, CopyCost, Encoded, StagedPages, Ticket};
pub use self::stats::{MemoryUsage, Stats};
pub use self::tier::{
    AgeCounts, Candidates, Priority, Recompress, Recompressed, Recompressor, AGE_BUCKETS,
    DEFAULT_LEVEL as DEFAULT_RECOMPRESS_LEVEL, MAX_AGE,
};
pub use self::writeback::{Writeback, WritebackCandidates, WrittenBack};

/// Bytes each stored object spends on its checksum.
pub const CHECKSUM_BYTES: usize = arena::CHECKSUM_BYTES;

/// Memory a staged page holds to the limit until it is installed: what it can take then at
/// most, a raw page's share of a segment and of the room for the holes it leaves (15 to
/// 64 KiB: 4,375 bytes, not 4,096, which let a device written to its limit with
/// incompressible pages end up past it).
pub const STAGED_PAGE_ROOM: u64 = ((segments::SEGMENT_SIZE + arena::TABLE_BYTES_PER_SEGMENT)
    as u64)
    .div_ceil(RAW_PAGES_PER_SEGMENT as u64);

use self::arena::{Arena, Budget, Object};
use self::entry::{Entry, Slot};
use self::shard::{Entries, Shard};
use self::stats::{Counters, PageCost, PageTotals};
use self::writeback::Scratch;
use crate::codec::Algorithm;
use crate::page::{fill_page, page_checksum, same_filled_word, PAGE_SIZE};
use crate::CoreError;

/// Most lock stripes a store uses.
pub const MAX_SHARDS: usize = 64;
/// Consecutive pages that share a lock stripe.
pub const GROUP_PAGES: usize = 1 << GROUP_SHIFT;
const GROUP_SHIFT: u32 = 4;

/// How a [`PageStore`] is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Pages in the store (the device size / 4096).
    pub pages: u64,
    /// Codec for every page.
    pub algorithm: Algorithm,
    /// Refuse writes that would take `mem_used_total` above this many bytes. Staged pages
    /// count a whole page each until they are installed. (The few bytes of the side map,
    /// for fill words that do not fit an entry, are counted in `mem_used_total` but not
    /// held to the limit.)
    pub mem_limit: Option<u64>,
    /// Compressed output of this many bytes or more is stored raw (a huge page).
    pub raw_threshold: usize,
    /// Keep a checksum with every stored page and check it on every read (see the module
    /// docs). Off only to measure what the checksums cost.
    pub checksums: bool,
    /// Store each checksum bound to its page's index (xored with the index folded to 32
    /// bits), so that an object read for another page fails its check. Off only for a store
    /// taken over from a daemon that kept checksums without it.
    pub checksums_name_pages: bool,
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
            checksums: true,
            checksums_name_pages: true,
        }
    }
}

/// What a page becomes, before arena space is reserved for it.
#[derive(Debug, Clone, Copy)]
enum Payload<'a> {
    Same(u64),
    /// Compressed bytes, or the raw page when `len == PAGE_SIZE`, and the page's checksum.
    Bytes(&'a [u8], u32),
}

/// Compressed page store; `Send + Sync`, share it with `Arc`.
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
    /// Pages currently staged, counted only under a memory limit (each holds a page of
    /// room under it); otherwise the shards' totals count them.
    staged: AtomicU64,
    staging: OnceLock<Arc<dyn StagedPages>>,
    /// The table and segments live in memory kept across processes (`persist.rs`).
    persistent: bool,
    /// Stored objects carry a checksum ([`StoreConfig::checksums`]).
    checksums: bool,
    /// Stored checksums are bound to their page ([`StoreConfig::checksums_name_pages`]).
    checksums_name_pages: bool,
    /// Each page's last use, for the cold tier (`tier.rs`).
    ages: tier::Ages,
    /// Where written-back pages live (`backing.rs`), once attached.
    backing: OnceLock<backing::Backing>,
    /// What writeback passes work in, made with the backing device (`writeback.rs`); one
    /// pass at a time.
    pass: OnceLock<std::sync::Mutex<Scratch>>,
    /// The LZ4 dictionary cold pages are recompressed with (`dictionary.rs`).
    dictionary: dictionary::Dictionary,
}

impl std::fmt::Debug for PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStore")
            .field("pages", &self.pages)
            .field("algorithm", &self.algorithm)
            .field("raw_threshold", &self.raw_threshold)
            .field("checksums", &self.checksums)
            .field("mem_limit", &self.mem_limit)
            .field("shards", &self.shards.len())
            .field("staging", &self.staging.get().is_some())
            .field("backing", &self.backing.get())
            .finish_non_exhaustive()
    }
}

impl PageStore {
    /// Builds an empty store. Fails on zero pages, a threshold outside `1..=4096`, or a
    /// memory limit smaller than the page table itself.
    pub fn new(cfg: StoreConfig) -> Result<Self, CoreError> {
        let layout = Layout::of(&cfg)?;
        let shards = (0..layout.shards)
            .map(|_| RwLock::new(Shard::new(layout.shard_len)))
            .collect();
        let ages = tier::Ages::new(cfg.pages)?;
        Self::build(cfg, layout, shards, ages, None)
    }

    /// Words of table memory a persistent store of `pages` pages needs
    /// ([`PageStore::new_persistent`]): the entries, then the pages' ages.
    pub fn table_len(pages: u64) -> Result<usize, CoreError> {
        let layout = Layout::of(&StoreConfig::new(pages, Algorithm::Lz4))?;
        usize::try_from(tier::Ages::words_for(pages))
            .ok()
            .and_then(|ages| (layout.shards * layout.shard_len).checked_add(ages))
            .ok_or_else(|| CoreError::Config(format!("{pages} pages is too many")))
    }

    /// Rewrites every all-zero entry of a kept page table of `pages` pages (`table`,
    /// [`PageStore::table_len`] words) as the empty entry, which stores of earlier releases
    /// wrote as 0; the pages' ages after the entries are left as they are. Returns how many
    /// were rewritten. For a table whose keeper says its empty entries are zeros, before
    /// [`PageStore::recover`] reads it: in any other table a zero entry is damage, and is
    /// read as such. Running it again changes nothing, so a takeover that dies in the
    /// middle is finished by the next.
    pub fn mark_zero_entries(pages: u64, table: &[AtomicU64]) -> Result<u64, CoreError> {
        let mut marked = 0;
        for word in Self::kept_entries(pages, table)? {
            if word.load(Ordering::Relaxed) == 0 {
                word.store(Entry::EMPTY.word(), Ordering::Relaxed);
                marked += 1;
            }
        }
        Ok(marked)
    }

    /// The entries of a kept page table of `pages` pages (`table`, [`PageStore::table_len`]
    /// words): the words before the pages' ages.
    pub fn kept_entries(pages: u64, table: &[AtomicU64]) -> Result<&[AtomicU64], CoreError> {
        let layout = Layout::of(&StoreConfig::new(pages, Algorithm::Lz4))?;
        Ok(split_kept_table(&layout, pages, table)?.0)
    }

    /// Moves every stored entry of a kept page table of `pages` pages (`table`,
    /// [`PageStore::table_len`] words) from the tag stores of earlier releases wrote to this
    /// release's (`entry.rs` says why); the pages' ages after the entries are left as they
    /// are. Returns how many were moved. For a table whose keeper says its stored entries
    /// have the earlier tag, before [`PageStore::recover`] reads it: in any other table an
    /// entry with that tag is damage, and is read as such. Running it again changes
    /// nothing, so a takeover that dies in the middle is finished by the next.
    pub fn move_stored_tags(pages: u64, table: &[AtomicU64]) -> Result<u64, CoreError> {
        let mut moved = 0;
        for word in Self::kept_entries(pages, table)? {
            if let Some(now) = entry::move_stored_tag(word.load(Ordering::Relaxed)) {
                word.store(now, Ordering::Relaxed);
                moved += 1;
            }
        }
        Ok(moved)
    }

    /// The bytes of page table a store of `pages` pages holds from the start (its
    /// `table_bytes`, the least `mem_limit` it takes), without building it.
    pub fn table_bytes_for(pages: u64) -> Result<u64, CoreError> {
        let layout = Layout::of(&StoreConfig::new(pages, Algorithm::Lz4))?;
        let fixed = std::mem::size_of::<Self>() - std::mem::size_of::<Arena>()
            + layout.shards * std::mem::size_of::<RwLock<Shard>>();
        let entries = (layout.shards * layout.shard_len) as u64 * 8;
        Ok(fixed as u64 + entries + tier::Ages::bytes_for(pages))
    }

    /// Most arena segments a store of `pages` pages can hold: the size of a
    /// [`SegmentHome`]'s directory.
    pub fn segment_capacity(pages: u64) -> usize {
        max_segments(usize::try_from(pages).unwrap_or(usize::MAX))
    }

    /// Builds an empty store whose table and segments live in `persist` (every entry is
    /// cleared), so that after this process dies [`PageStore::recover`] can take it over.
    pub fn new_persistent(cfg: StoreConfig, persist: Persistence) -> Result<Self, CoreError> {
        let layout = Layout::of(&cfg)?;
        let (mut shards, ages) = kept_parts(&layout, cfg.pages, persist.table)?;
        for shard in shards.iter_mut() {
            shard
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
        ages.clear();
        Self::build(cfg, layout, shards, ages, Some(persist.home))
    }

    /// Takes over the store a dead process left in `persist` (built there by
    /// [`PageStore::new_persistent`] with the same `cfg.pages`): the entries as they are,
    /// the segments from the home; counters, free space and the arena's bookkeeping are
    /// rebuilt from the entries. Fails with [`CoreError::Damaged`] when the entries do not
    /// describe a consistent store (an object outside the segments, two that overlap). An
    /// entry that is none the store writes loses its page only
    /// ([`Recovered::damaged_entries`]).
    ///
    /// Pages the dead process had staged (written, waiting for their compressed form) are
    /// read from `staged` (the staging it left, e.g. [`crate::batch::StagedCopy`]),
    /// compressed on this thread and installed; the ones it does not hold (or all, without
    /// it) become lost: reads of them fail until they are written again.
    pub fn recover(
        cfg: StoreConfig,
        persist: Persistence,
        staged: Option<&dyn StagedPages>,
    ) -> Result<(Self, Recovered), CoreError> {
        let layout = Layout::of(&cfg)?;
        // The ages as the dead process left them: a page's age and tried flag go on.
        let (shards, ages) = kept_parts(&layout, cfg.pages, persist.table)?;
        let store = Self::build(cfg, layout, shards, ages, Some(persist.home))?;
        let mut found = Recovered::default();
        let mut objects: Vec<(u64, usize)> = Vec::new();
        let mut waiting: Vec<(u64, StagedAt)> = Vec::new();
        let mut damaged: Vec<u64> = Vec::new();
        for (s, shard) in store.shards.iter().enumerate() {
            let mut shard = write_lock(shard);
            let mut totals = PageTotals::default();
            for (idx, slot) in shard.slots() {
                let slot = match slot {
                    Slot::Staged(at) => {
                        waiting.push((store.page_at(s, idx), at));
                        slot
                    }
                    // Damage, or a fill word that lived in the old process's memory: that
                    // page is lost (its reads fail until it is written again), not the store.
                    Slot::SameExt | Slot::Invalid => {
                        damaged.push(store.page_at(s, idx));
                        Slot::Lost
                    }
                    other => other,
                };
                if let Some(object) = store.stored_object(slot) {
                    objects.push(object);
                }
                if !matches!(slot, Slot::Empty | Slot::Lost | Slot::Staged(_)) {
                    found.pages_stored += 1;
                }
                totals.replace(PageCost::default(), cost_of(slot));
            }
            shard.totals = totals;
        }
        found.segments = store
            .arena
            .adopt(&mut objects)
            .map_err(CoreError::Damaged)?;
        for &index in &damaged {
            // Padding entries past the last page are no page's: left as they are.
            if index < store.pages() {
                // Counted as lost above already: nothing of its old entry is taken off.
                store.lose(index, false);
                found.damaged_entries += 1;
            }
        }
        if store.mem_limit.is_some() {
            store.staged.store(waiting.len() as u64, Ordering::Relaxed);
        }
        if !waiting.is_empty() {
            // The staged pages below fill the dead process's holes rather than new segments.
            store.link_adopted_holes();
        }
        let mut page = [0u8; PAGE_SIZE];
        let mut compacted = false;
        for (index, at) in waiting {
            let copied = staged.is_some_and(|s| s.read_staged(index, at, &mut page));
            // A crash from here on finds the staging as it was: the next recovery redoes
            // what this one did not finish.
            let mut settled = copied && store.install_recovered(Ticket { page: index, at }, &page);
            if copied && !settled && !compacted {
                // No segment to be had (the adopted pool ran dry): the dead process's holes
                // give whole segments back without asking the system for memory, which
                // could wait on this very device.
                compacted = true;
                store.compact();
                settled = store.install_recovered(Ticket { page: index, at }, &page);
            }
            if settled {
                found.settled_pages += 1;
                found.pages_stored += 1;
            } else {
                store.lose(index, true);
                found.lost_pages += 1;
            }
        }
        Ok((store, found))
    }

    /// Puts the free space [`PageStore::recover`] found between the stored pages onto the
    /// allocator's lists, a batch at a time (writers go on meanwhile). Until then new pages
    /// take new segments. A recovery leaves this for after I/O resumes: linking a hole
    /// writes into it, the first touch of that memory in this process (the step took 22 of
    /// a recovery's 37 ms natively, 9,259 holes for 250,000 pages; in a virtual machine a
    /// page fault costs far more).
    pub fn link_adopted_holes(&self) {
        while self.arena.link_adopted_holes(64) {}
    }

    /// Installs a staged page recovered from a dead process's staging, as its installer
    /// would have (room under the memory limit was taken when it was staged). False when
    /// it could not be installed (no memory, or a corrupt entry).
    fn install_recovered(&self, ticket: Ticket, page: &[u8; PAGE_SIZE]) -> bool {
        let kept_fill = same_filled_word(page).filter(|&w| self.keeps_fill(w));
        let state = match kept_fill {
            Some(word) => {
                let mut commits = [Commit::new(ticket, Encoded::SameFilled(word), 0)];
                self.commit(&mut commits).map(|()| commits[0].state)
            }
            None => self.commit_encoded(ticket, page),
        };
        state.is_ok_and(|s| s == CommitState::Installed)
    }

    /// Marks page `index` lost (its staged copy is gone, or its entry was damaged): reads
    /// of it fail until it is written again. `counted`: the shard's totals count its old
    /// entry (a damaged one was counted as lost already, and a damaged side-map fill's cost
    /// taken off would wrap them).
    fn lose(&self, index: u64, counted: bool) {
        let (shard, idx) = self.locate(index);
        let mut shard = write_lock(shard);
        // Lost needs no side map, so `set` cannot fail.
        if let Ok(Some(old)) = shard.set(idx, Slot::Lost) {
            if counted {
                shard.totals.replace(cost_of(old), PageCost::default());
            }
            if self.mem_limit.is_some() && matches!(old, Slot::Staged(_)) {
                self.staged.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    fn build(
        cfg: StoreConfig,
        layout: Layout,
        shards: Box<[RwLock<Shard>]>,
        ages: tier::Ages,
        home: Option<Arc<dyn SegmentHome>>,
    ) -> Result<Self, CoreError> {
        // The store struct minus the arena inside it (the arena counts itself).
        let table_bytes = (std::mem::size_of::<Self>() - std::mem::size_of::<Arena>()
            + shards.len() * std::mem::size_of::<RwLock<Shard>>()) as u64
            + shards
                .iter()
                .map(|s| read_lock(s).table_bytes())
                .sum::<u64>()
            + tier::Ages::bytes_for(cfg.pages);
        if let Some(limit) = cfg.mem_limit {
            if limit < table_bytes {
                return Err(CoreError::Config(format!(
                    "mem_limit {limit} is below the {table_bytes}-byte page table"
                )));
            }
        }
        let persistent = home.is_some();
        let checksums = cfg.checksums;
        Ok(Self {
            pages: cfg.pages,
            algorithm: cfg.algorithm,
            raw_threshold: cfg.raw_threshold,
            mem_limit: cfg.mem_limit,
            shard_mask: (shards.len() - 1) as u64,
            shard_shift: layout.shards.trailing_zeros(),
            shards,
            arena: Arena::new(table_bytes, cfg.mem_limit, max_segments(layout.pages), home),
            table_bytes,
            counters: Counters::default(),
            staged: AtomicU64::new(0),
            staging: OnceLock::new(),
            persistent,
            checksums,
            checksums_name_pages: cfg.checksums_name_pages,
            ages,
            backing: OnceLock::new(),
            pass: OnceLock::new(),
            dictionary: dictionary::Dictionary::default(),
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

    /// Whether stored pages carry checksums ([`StoreConfig::checksums`]).
    pub fn checksums(&self) -> bool {
        self.checksums
    }

    /// The checksum a page written now gets: [`page_checksum`], or 0 in a store without
    /// checksums.
    pub fn checksum_of(&self, page: &[u8; PAGE_SIZE]) -> u32 {
        if self.checksums {
            page_checksum(page)
        } else {
            0
        }
    }

    /// What goes after page `index`'s object: its checksum as stored
    /// ([`PageStore::bound_checksum`]), or nothing.
    fn trailer(&self, index: u64, checksum: u32) -> Option<[u8; CHECKSUM_BYTES]> {
        self.checksums
            .then(|| self.bound_checksum(index, checksum).to_le_bytes())
    }

    /// Page `index`'s checksum as its object stores it, and back (the same xor both ways):
    /// xored with the page's index folded to 32 bits, which differs for every two pages of a
    /// device under 16 TiB. A table entry that points at another page's object (swapped or
    /// damaged) then reads as a failed check, never as that page's data.
    fn bound_checksum(&self, index: u64, checksum: u32) -> u32 {
        if self.checksums_name_pages {
            checksum ^ (index ^ (index >> 32)) as u32
        } else {
            checksum
        }
    }

    /// Bytes an object of `len` payload bytes takes in the arena.
    fn object_len(&self, len: usize) -> usize {
        len + if self.checksums { CHECKSUM_BYTES } else { 0 }
    }

    /// A fingerprint of the arena object `slot` holds (its payload and checksum): see
    /// [`PageStore::switch`]. `None` for a slot that holds none.
    fn fingerprint(&self, slot: Slot) -> Option<u64> {
        let (handle, bytes) = self.stored_object(slot)?;
        let mut object = [0u8; PAGE_SIZE + CHECKSUM_BYTES];
        let object = object.get_mut(..bytes)?;
        self.arena
            .load(handle, bytes, object)
            .then(|| object_fingerprint(object))
    }

    /// The arena object `(handle, bytes)` a slot holds, if any.
    fn stored_object(&self, slot: Slot) -> Option<(u64, usize)> {
        match slot {
            Slot::Stored { handle, len, .. } => Some((handle, self.object_len(usize::from(len)))),
            _ => None,
        }
    }

    /// Copies the `len` payload bytes of page `index`'s object at `handle` into `out` and
    /// returns the page checksum stored after them (0 in a store without checksums); `None`
    /// when they are not in the arena.
    fn load_stored(&self, index: u64, handle: u64, len: usize, out: &mut [u8]) -> Option<u32> {
        if !self.checksums {
            return self.arena.load(handle, len, out).then_some(0);
        }
        self.arena
            .load_with_trailer(handle, len, out)
            .map(|stored| self.bound_checksum(index, u32::from_le_bytes(stored)))
    }

    /// Checks a page just decoded against the checksum stored with it.
    fn verify(&self, index: u64, page: &[u8; PAGE_SIZE], stored: u32) -> Result<(), CoreError> {
        if !self.checksums || page_checksum(page) == stored {
            return Ok(());
        }
        Err(self.failed_check(CoreError::Checksum { index }))
    }

    /// Counts a stored page that failed its check (`checksum_failures`) and logs it (the
    /// first few, then at every power of two: a damaged region fails many reads).
    fn failed_check(&self, error: CoreError) -> CoreError {
        let n = self
            .counters
            .checksum_failures
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        if n <= 16 || n.is_power_of_two() {
            tracing::error!(%error, failures = n, "a stored page failed its check: the read fails with EIO");
        }
        error
    }

    /// Creates the calling thread's codec now. Threads that serve I/O call this before
    /// serving, so that a codec that cannot be allocated fails the start, not a request.
    pub fn prepare_thread(&self) -> Result<(), CoreError> {
        worker::prepare(self.algorithm)?;
        // Any page may have been recompressed, by this daemon or one before it.
        worker::with_recompressed_decoder(|_, _| Ok(()))
    }

    /// Writes whole pages starting at `first_page`, compressing each on the calling thread
    /// with that thread's reused codec. On an error, the pages before the failing one are
    /// written and the rest keep their old content. Failed requests are counted by the
    /// caller ([`PageStore::record_failed_write`]).
    pub fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let count = self.check_buffer(first_page, data.len())?;
        let batch = write_batch::BATCH_PAGES * PAGE_SIZE;
        for (i, pages) in data.chunks(batch).enumerate() {
            self.write_batch(first_page + (i * write_batch::BATCH_PAGES) as u64, pages)?;
        }
        Counters::bump(&self.counters.writes, count);
        Ok(())
    }

    fn write_page(&self, index: u64, page: &[u8; PAGE_SIZE]) -> Result<(), CoreError> {
        if let Some(word) = same_filled_word(page).filter(|&w| self.keeps_fill(w)) {
            return self.install(index, Payload::Same(word));
        }
        self.encode(page, |compressed, checksum| {
            let payload = Payload::Bytes(compressed.unwrap_or(page), checksum);
            self.install(index, payload)
        })
    }

    /// Compresses `page` with this thread's codec and takes its checksum, then hands `then`
    /// the compressed bytes (`None` when they would not be under the raw threshold: the
    /// page is stored raw) and the checksum.
    fn encode<R>(
        &self,
        page: &[u8; PAGE_SIZE],
        then: impl FnOnce(Option<&[u8]>, u32) -> Result<R, CoreError>,
    ) -> Result<R, CoreError> {
        let threshold = self.raw_threshold;
        worker::with_codec(self.algorithm, |codec, scratch| {
            let compressed = codec
                .compress_below(page, scratch, threshold)
                .map_err(CoreError::Compress)?;
            // After the compressor, not before: it takes the page's cache misses while it
            // computes, and the CRC then reads the page from cache. First, the CRC waited
            // for the page to come from memory (+3 to +5 % CPU a GiB on the CPU path, GPU
            // runs 155-156).
            let checksum = self.checksum_of(page);
            then(compressed.map(|len| &scratch[..len]), checksum)
        })
    }

    /// Stores a page known to be `word` repeated (no payload), as [`PageStore::write`]
    /// would: for writers that checked for same-filled pages themselves.
    pub fn write_same_filled(&self, page: u64, word: u64) -> Result<(), CoreError> {
        self.check_range(page, 1)?;
        if self.keeps_fill(word) {
            self.install(page, Payload::Same(word))?;
        } else {
            let mut bytes = [0u8; PAGE_SIZE];
            fill_page(&mut bytes, word);
            self.write_page(page, &bytes)?;
        }
        Counters::bump(&self.counters.writes, 1);
        Ok(())
    }

    /// [`PageStore::write_same_filled`] for many distinct pages: each run of them in one
    /// shard is set under one lock, and the write count is bumped once a run. The GPU
    /// ring's writers store a request's same-filled pages this way; one at a time, each page
    /// took its shard's lock and bumped the shared counts, cache lines every queue thread
    /// and installer touches. On an error the pages before the failing one are written and
    /// the rest keep their old content.
    pub fn write_same_filled_many(&self, pages: &[(u64, u64)]) -> Result<(), CoreError> {
        self.write_same_filled_many_replacing(pages, None)
    }

    /// [`PageStore::write_same_filled_many`], keeping in `replaced[k]` the arena object page
    /// `k` held (counted as deferred, for the caller to give back with
    /// [`PageStore::free_replaced`]) instead of freeing it, where `replaced` is given: a
    /// GPU ring's writer leaves the arena's lock to the slot's installer. `replaced` holds
    /// at least one entry per page; entries of pages that held no object are left as they
    /// are. What else a page held (a block on the backing device) is freed here. On an
    /// error, what the pages written so far replaced is kept or freed all the same.
    pub(crate) fn write_same_filled_many_replacing(
        &self,
        pages: &[(u64, u64)],
        mut replaced: Option<&mut [Option<Replaced>]>,
    ) -> Result<(), CoreError> {
        /// Pages set under one lock at most (their old contents are freed after it).
        const GROUP: usize = 16;
        if replaced.as_ref().is_some_and(|r| r.len() < pages.len()) {
            return Err(CoreError::Config(
                "no room to keep the objects same-filled pages replace".into(),
            ));
        }
        for &(page, _) in pages {
            self.check_range(page, 1)?;
        }
        let mut start = 0;
        while start < pages.len() {
            let (page, word) = pages[start];
            if !self.keeps_fill(word) {
                self.write_same_filled(page, word)?;
                start += 1;
                continue;
            }
            let shard_index = self.shard_of(page);
            let end = pages[start..]
                .iter()
                .take(GROUP)
                .position(|&(p, w)| self.shard_of(p) != shard_index || !self.keeps_fill(w))
                .map_or((start + GROUP).min(pages.len()), |k| start + k);
            let mut olds = [Slot::Empty; GROUP];
            let (mut set, mut nolds) = (0, 0);
            let mut unstaged = 0u64;
            let mut result = Ok(());
            let mut shard = write_lock(&self.shards[shard_index]);
            for (k, &(page, word)) in pages.iter().enumerate().take(end).skip(start) {
                match shard.set(self.locate(page).1, Slot::Same(word)) {
                    Ok(Some(old)) => {
                        shard.totals.replace(cost_of(old), same_cost());
                        self.ages.written(page);
                        unstaged += u64::from(matches!(old, Slot::Staged(_)));
                        set += 1;
                        let kept =
                            self.keep_replaced(old, replaced.as_deref_mut().map(|r| &mut r[k]));
                        if !kept && self.holds_room(old) {
                            olds[nolds] = old;
                            nolds += 1;
                        }
                    }
                    Ok(None) => {
                        result = Err(self.out_of_range(page, 1));
                        break;
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            drop(shard);
            // Writes replace a staged copy; only `stage_many` makes one.
            if self.mem_limit.is_some() && unstaged > 0 {
                self.staged.fetch_sub(unstaged, Ordering::Relaxed);
            }
            // One acquisition of the arena's lock for the group, not one a page.
            self.free_slots(&olds[..nolds]);
            Counters::bump(&self.counters.writes, set as u64);
            result?;
            start = end;
        }
        Ok(())
    }

    /// Whether a page filled with `word` is kept as a fill word: always, except in a
    /// persistent store for words that do not fit an entry (the side map they would need
    /// dies with the process), which are compressed like any page.
    fn keeps_fill(&self, word: u64) -> bool {
        !self.persistent || Entry::same_fits(word)
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
        self.ages.read(index);
        let (shard, idx) = self.locate(index);
        let shard = read_lock(shard);
        let (handle, len, recompressed) = match shard.get(idx) {
            None => return Err(self.out_of_range(index, 1)),
            Some(Slot::Invalid) => {
                return Err(self.failed_check(corrupt(index, "its table entry is damaged")))
            }
            Some(Slot::Empty) => {
                page.fill(0);
                return Ok(());
            }
            Some(Slot::Same(word)) => {
                fill_page(page, word);
                return Ok(());
            }
            Some(Slot::SameExt) => {
                return Err(self.failed_check(corrupt(
                    index,
                    "its table entry names a fill word the store does not hold",
                )))
            }
            Some(Slot::Lost) => {
                return Err(corrupt(
                    index,
                    "lost: it waited uncompressed for the GPU when the old daemon died",
                ))
            }
            // Copied out under the shard lock: the staged copy cannot be installed (and its
            // slot reused) before the lock is dropped.
            Some(Slot::Staged(at)) => {
                return match self.staging.get() {
                    Some(staging) if staging.read_staged(index, at, page) => Ok(()),
                    _ => Err(self.failed_check(corrupt(
                        index,
                        "its staged copy is missing or does not match its checksum",
                    ))),
                };
            }
            Some(Slot::Stored {
                handle,
                len,
                recompressed,
            }) => (handle, usize::from(len), recompressed),
            // Read under the shard's read lock: the object's blocks cannot be freed and
            // written again meanwhile.
            Some(Slot::Backed {
                at,
                len,
                recompressed,
            }) => return self.read_backed(index, at, usize::from(len), recompressed, page),
        };
        if len == PAGE_SIZE {
            let stored = self.load_stored(index, handle, len, page);
            drop(shard);
            return match stored {
                Some(stored) => self.verify(index, page, stored),
                None => Err(self.failed_check(corrupt(index, "arena range missing"))),
            };
        }
        if recompressed {
            return worker::with_recompressed_decoder(|decoder, scratch| {
                let stored = self.load_stored(index, handle, len, scratch);
                drop(shard);
                let Some(stored) = stored else {
                    return Err(self.failed_check(corrupt(index, "arena range missing")));
                };
                self.decode_recompressed(index, &scratch[..len], decoder, page)
                    .map_err(|e| self.failed_check(e))?;
                self.verify(index, page, stored)
            });
        }
        // Copy the compressed bytes out under the shard lock, decode after dropping it.
        worker::with_codec(self.algorithm, |codec, scratch| {
            let stored = self.load_stored(index, handle, len, scratch);
            drop(shard);
            let Some(stored) = stored else {
                return Err(self.failed_check(corrupt(index, "arena range missing")));
            };
            codec
                .decompress(&scratch[..len], page)
                .map_err(|source| self.failed_check(CoreError::Corrupt { index, source }))?;
            self.verify(index, page, stored)
        })
    }

    /// Frees `count` pages from `first_page`: they read as zeros and hold no memory.
    /// Each page that held data counts in `notify_free`.
    pub fn discard(&self, first_page: u64, count: u64) -> Result<(), CoreError> {
        self.check_range(first_page, count)?;
        let freed = self.empty_pages(first_page, count)?;
        Counters::bump(&self.counters.notify_free, freed);
        Ok(())
    }

    /// Zeroes `count` pages from `first_page`: they read as zeros and hold no memory.
    pub fn write_zeroes(&self, first_page: u64, count: u64) -> Result<(), CoreError> {
        self.check_range(first_page, count)?;
        self.empty_pages(first_page, count).map(drop)
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
            // Room for every object, taken before any lock: allocating under the shard locks
            // could fault into reclaim that waits for swap writes, which wait for those locks.
            let mut objects: Vec<Object> = Vec::new();
            let mut shards = Vec::new();
            let want = self.arena.usage().objects as usize + 1024;
            if objects.try_reserve_exact(want).is_err()
                || shards.try_reserve_exact(self.shards.len()).is_err()
            {
                return 0;
            }
            fault_in_spare(&mut objects, Object::default());
            let mut compaction = self.arena.lock_for_compaction();
            if compaction.objects() as usize > objects.capacity() {
                continue;
            }
            shards.extend(self.shards.iter().map(write_lock));
            for (s, shard) in shards.iter().enumerate() {
                for (idx, handle, len) in shard.stored() {
                    // Never reached: every stored page is one of the arena's objects, and
                    // they fit. Growing here would allocate under the locks.
                    if objects.len() == objects.capacity() {
                        break;
                    }
                    objects.push(Object {
                        handle,
                        len: self.object_len(usize::from(len)) as u16,
                        tag: (idx << self.shard_shift) | s as u64,
                    });
                }
            }
            if objects.len() as u64 != compaction.objects() {
                drop(shards);
                drop(compaction);
                std::thread::yield_now();
                continue;
            }
            let (mask, shift) = (self.shard_mask, self.shard_shift);
            return compaction.run(&mut objects, |object| {
                if let Some(shard) = shards.get_mut((object.tag & mask) as usize) {
                    shard.rehome(object.tag >> shift, object.handle);
                }
            });
        }
        0
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let (totals, side) = self.shard_totals();
        let usage = self.arena.usage();
        let c = &self.counters;
        let disk = |f: fn(&backing::DiskCounters) -> &AtomicU64| {
            self.backing
                .get()
                .map_or(0, |b| f(&b.counters).load(Ordering::Relaxed))
        };
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
            staged_pages: totals.staged_pages,
            checksum_failures: Counters::get(&c.checksum_failures),
            recompressed_pages: totals.recompressed_pages,
            recompress_tried_pages: Counters::get(&c.recompress_tried),
            recompress_kept_pages: Counters::get(&c.recompress_kept),
            recompress_rewritten_pages: Counters::get(&c.recompress_rewritten),
            recompress_saved_bytes: Counters::get(&c.recompress_saved_bytes),
            recompress_dictionary_bytes: self.dictionary().map_or(0, |d| d.len() as u64),
            bd_count: totals.backed_pages,
            bd_reads: disk(|d| &d.reads),
            bd_writes: disk(|d| &d.writes),
            bd_bytes_written: disk(|d| &d.bytes_written),
            bd_failures: disk(|d| &d.failures),
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
        let replaced = self.arena.deferred_bytes();
        let replaced_objects = self.arena.deferred_objects();
        let checksums =
            usage.objects.saturating_sub(replaced_objects) * (self.object_len(0) as u64);
        MemoryUsage {
            table_bytes: self.table_bytes,
            side_map_bytes: side,
            arena_bookkeeping_bytes: usage.held_bytes - usage.segment_bytes,
            segment_bytes: usage.segment_bytes,
            payload_bytes: payload,
            checksum_bytes: checksums,
            class_rounding_bytes: usage
                .class_bytes
                .saturating_sub(payload + checksums + replaced),
            free_hole_bytes: usage.free_bytes,
            replaced_bytes: replaced,
            frontier_unused_bytes: usage
                .segment_bytes
                .saturating_sub(usage.class_bytes + usage.free_bytes),
        }
    }

    /// Bytes of the page table (entries, shard locks, the store itself): fixed at creation.
    pub fn table_bytes(&self) -> u64 {
        self.table_bytes
    }

    /// Memory held to the limit, as a staging write's check counts it: the table, the
    /// arena, and [`STAGED_PAGE_ROOM`] per staged page (the room thread measures the same).
    pub fn limited_bytes(&self) -> u64 {
        self.table_bytes + self.arena.held_bytes() + self.staged_room()
    }

    /// Room promised to staged pages, in full. An object a staged page replaced and the
    /// ring has not given back yet ([`PageStore::stage_many_replacing`]) is not taken off:
    /// the arena counts whole segments, which a freed object leaves as held as a kept one,
    /// and the page may need a larger class than the hole it leaves.
    fn staged_room(&self) -> u64 {
        self.staged
            .load(Ordering::Relaxed)
            .saturating_mul(STAGED_PAGE_ROOM)
    }

    /// Puts `payload` into page `index`, whatever it held.
    fn install(&self, index: u64, payload: Payload<'_>) -> Result<(), CoreError> {
        let (slot, cost) = match payload {
            Payload::Same(word) => (Slot::Same(word), same_cost()),
            Payload::Bytes(bytes, checksum) => {
                let budget = Budget::Limited {
                    reserved: self.staged_room(),
                };
                let handle = self
                    .arena
                    .store(bytes, self.trailer(index, checksum), budget)?;
                stored(handle, bytes.len())
            }
        };
        let (shard, idx) = self.locate(index);
        let mut shard = write_lock(shard);
        let old = match shard.set(idx, slot) {
            Ok(Some(old)) => old,
            Ok(None) => {
                drop(shard);
                self.free_slot(slot);
                return Err(self.out_of_range(index, 1));
            }
            Err(e) => {
                drop(shard);
                self.free_slot(slot);
                return Err(e);
            }
        };
        let old = self.replaced(&mut shard, index, old, cost);
        drop(shard);
        if let Some(old) = old {
            self.free_slot(old);
        }
        Ok(())
    }

    /// The bookkeeping of a write, discard or zeroes that put a slot costing `cost` into page
    /// `index` of `shard` (still locked) in place of `was`: the shard's totals, the page's
    /// age, and the count of staged pages (only `stage_many` makes a staged copy; anything
    /// else replaces one). Returns `was` when it holds room to free once the lock is let go.
    fn replaced(&self, shard: &mut Shard, index: u64, was: Slot, cost: PageCost) -> Option<Slot> {
        shard.totals.replace(cost_of(was), cost);
        self.ages.written(index);
        if self.mem_limit.is_some() && matches!(was, Slot::Staged(_)) {
            self.staged.fetch_sub(1, Ordering::Relaxed);
        }
        self.holds_room(was).then_some(was)
    }

    /// Whether `slot` holds room to free: an object in the arena, or blocks on the backing
    /// device.
    fn holds_room(&self, slot: Slot) -> bool {
        self.stored_object(slot).is_some() || matches!(slot, Slot::Backed { .. })
    }

    /// Counts the arena object `old` names as deferred and keeps it in `keep`, where a
    /// place to keep it is given: its room is then given back later, with
    /// [`PageStore::free_replaced`]. Whether it was kept (else the caller frees what `old`
    /// holds). Under the shard's lock that replaced `old`.
    fn keep_replaced(&self, old: Slot, keep: Option<&mut Option<Replaced>>) -> bool {
        match (keep, self.stored_object(old)) {
            (Some(k), Some((handle, len))) => {
                *k = Some(self.arena.defer(handle, len));
                true
            }
            _ => false,
        }
    }

    fn free_slot(&self, slot: Slot) {
        self.free_slots(&[slot]);
    }

    /// Frees what `slots` held: their objects in the arena (under one lock) and their
    /// blocks on the backing device. Call it holding no shard's lock.
    fn free_slots(&self, slots: &[Slot]) {
        self.arena
            .free_many(slots.iter().filter_map(|&s| self.stored_object(s)));
        for &slot in slots {
            if let Slot::Backed { at, len, .. } = slot {
                if let Some(backing) = self.backing.get() {
                    backing.free(self.on_disk(at, usize::from(len)));
                }
            }
        }
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

    /// The shard of page `index`, and the page's index within it. Groups of 16 pages form
    /// rows of one group per shard; within a row the groups go to the shards in order,
    /// rotated by a hash of the row, so the same position in different rows lands on
    /// unrelated shards.
    fn locate(&self, index: u64) -> (&RwLock<Shard>, u64) {
        let row = (index >> GROUP_SHIFT) >> self.shard_shift;
        let within = index & (GROUP_PAGES as u64 - 1);
        (
            &self.shards[self.shard_of(index)],
            (row << GROUP_SHIFT) | within,
        )
    }

    /// The page at `idx` of shard `shard`: the inverse of [`PageStore::locate`].
    fn page_at(&self, shard: usize, idx: u64) -> u64 {
        let row = idx >> GROUP_SHIFT;
        let within = idx & (GROUP_PAGES as u64 - 1);
        let low = (shard as u64).wrapping_sub(self.row_rotation(row)) & self.shard_mask;
        let group = (row << self.shard_shift) | low;
        (group << GROUP_SHIFT) | within
    }

    fn shard_of(&self, index: u64) -> usize {
        let group = index >> GROUP_SHIFT;
        let row = group >> self.shard_shift;
        (group.wrapping_add(self.row_rotation(row)) & self.shard_mask) as usize
    }

    /// How far a row of groups is rotated across the shards. Fibonacci hashing: the top
    /// bits of row × 2^64/φ.
    fn row_rotation(&self, row: u64) -> u64 {
        row.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (63 - self.shard_shift) >> 1
    }

    fn check_buffer(&self, first: u64, len: usize) -> Result<u64, CoreError> {
        if !len.is_multiple_of(PAGE_SIZE) {
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

/// How a store of some pages splits into shards.
struct Layout {
    pages: usize,
    shards: usize,
    /// Entries per shard.
    shard_len: usize,
}

impl Layout {
    /// Checks `cfg` (zero pages, a threshold outside `1..=4096`, too many pages) and
    /// lays it out.
    fn of(cfg: &StoreConfig) -> Result<Self, CoreError> {
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
        let groups = pages.div_ceil(GROUP_PAGES);
        let shards = groups.next_power_of_two().min(MAX_SHARDS);
        // Groups come in rows of one group per shard (see `locate`): every shard holds one
        // group of every row.
        let rows = groups.div_ceil(shards);
        Ok(Self {
            pages,
            shards,
            shard_len: rows * GROUP_PAGES,
        })
    }
}

/// Shards over consecutive parts of a kept table.
/// A store's shards.
type Shards = Box<[RwLock<Shard>]>;

/// The shards and the ages of a store of `pages` pages over a kept table
/// ([`PageStore::table_len`] words: the entries, then the ages).
fn kept_parts(
    layout: &Layout,
    pages: u64,
    table: &'static [AtomicU64],
) -> Result<(Shards, tier::Ages), CoreError> {
    let (entries, ages) = split_kept_table(layout, pages, table)?;
    let shards = entries
        .chunks(layout.shard_len)
        .map(|part| RwLock::new(Shard::with_entries(Entries::Kept(part))))
        .collect();
    Ok((shards, tier::Ages::kept(pages, ages)?))
}

/// A kept page table of `pages` pages split into its entries and the pages' ages; refused
/// unless it is exactly [`PageStore::table_len`] words.
fn split_kept_table<'a>(
    layout: &Layout,
    pages: u64,
    table: &'a [AtomicU64],
) -> Result<(&'a [AtomicU64], &'a [AtomicU64]), CoreError> {
    let need = PageStore::table_len(pages)?;
    if table.len() != need {
        return Err(CoreError::Config(format!(
            "the kept page table has {} words; the store needs {need}",
            table.len()
        )));
    }
    Ok(table.split_at(layout.shards * layout.shard_len))
}

/// Most arena segments a store of `pages` pages can need: every page raw, twice over for
/// free holes, plus a few; the arena refuses to grow past it (`NoMemory`). Its table costs
/// about 2 B per page only once the arena grows that far.
fn max_segments(pages: usize) -> usize {
    (pages.saturating_mul(2 * PAGE_SIZE) / segments::SEGMENT_SIZE).saturating_add(64)
}

/// The bytes a waiting commit stores in the arena, if any.
fn same_cost() -> PageCost {
    PageCost {
        stored: true,
        same: true,
        ..PageCost::default()
    }
}

/// The cold tier: each page's age, and recompression (`tier.rs` has the why).
impl PageStore {
    /// Advances the store's clock by one tick (the daemon: once a minute), counts the pages
    /// by age ([`PageStore::ages`]) and, every so often, moves stamps older than
    /// [`MAX_AGE`] up to it. Off the I/O path: a pass over the table.
    pub fn tick(&self) {
        let now = self.ages.advance();
        let clamp = now.is_multiple_of(tier::CLAMP_EVERY);
        let mut counts = tier::AgeCounts::default();
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = read_lock(shard);
            for (idx, slot) in shard.slots() {
                if slot == Slot::Empty {
                    continue;
                }
                let index = self.page_at(s, idx);
                let age = self.ages.age(index);
                if clamp && age > MAX_AGE {
                    self.ages.set_age(index, MAX_AGE);
                }
                counts[tier::bucket(age.min(MAX_AGE))] += 1;
            }
        }
        self.ages.set_counts(counts);
    }

    /// Pages holding data by age bucket ([`AGE_BUCKETS`] in ticks, then the rest), as of the
    /// last [`PageStore::tick`].
    pub fn ages(&self) -> AgeCounts {
        self.ages.counts()
    }

    /// The age of page `index` in ticks (0 for a page outside the store).
    pub fn age(&self, index: u64) -> u32 {
        self.ages.age(index)
    }

    /// The pages on the backing device now (`bd_count` of them), in no particular order.
    pub fn written_back_pages(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = read_lock(shard);
            for (idx, slot) in shard.slots() {
                if matches!(slot, Slot::Backed { .. }) {
                    out.push(self.page_at(s, idx));
                }
            }
        }
        out
    }

    /// Marks pages idle (zram's `idle`): every page holding data, or with `min_age` only
    /// those unused for that many ticks, gets the oldest age. Returns how many it marked.
    pub fn mark_idle(&self, min_age: Option<u32>) -> u64 {
        let mut marked = 0;
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = read_lock(shard);
            for (idx, slot) in shard.slots() {
                let index = self.page_at(s, idx);
                if slot == Slot::Empty || min_age.is_some_and(|a| self.ages.age(index) < a) {
                    continue;
                }
                self.ages.make_old(index, MAX_AGE);
                marked += 1;
            }
        }
        marked
    }
}

/// What the passes share: switching an entry to a new home, decoding stored bytes.
impl PageStore {
    /// Points page `index` at `new` if it still holds `expected`, the very object whose
    /// [`PageStore::fingerprint`] was `fingerprint` when it was read, and frees what
    /// `expected` held. `Ok(false)`: a write came first and nothing changed.
    ///
    /// The entry alone does not tell: a page discarded and written again while a pass had
    /// its object out (on the GPU, on its way to disk) can get the very handle back from
    /// the arena, with the same length (a raw page always has it), and the pass would then
    /// put the old page's copy in place of the new write. The new object's bytes differ.
    ///
    /// With `tried`, the page is flagged tried by recompression with it (see
    /// `recompress.rs`), under the lock a write stamps it young under.
    fn switch(
        &self,
        index: u64,
        expected: Slot,
        fingerprint: u64,
        new: Slot,
        tried: bool,
    ) -> Result<bool, CoreError> {
        let (shard, idx) = self.locate(index);
        let mut shard = write_lock(shard);
        if shard.get(idx) != Some(expected)
            || self.fingerprint(expected) != Some(fingerprint)
            || shard.set(idx, new)?.is_none()
        {
            return Ok(false);
        }
        if tried {
            self.ages.mark_tried(index);
        }
        shard.totals.replace(cost_of(expected), cost_of(new));
        drop(shard);
        self.free_slot(expected);
        Ok(true)
    }

    /// Decodes the stored bytes `body` of page `index` into `page`: a raw page as it is, a
    /// recompressed one with the thread's zstd decoder, the rest with the store's codec.
    /// (The read of a page in RAM decodes in place from its worker's scratch instead.)
    fn decode(
        &self,
        index: u64,
        body: &[u8],
        recompressed: bool,
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CoreError> {
        let corrupt = |source| CoreError::Corrupt { index, source };
        if body.len() == PAGE_SIZE {
            page.copy_from_slice(body);
            Ok(())
        } else if recompressed {
            worker::with_recompressed_decoder(|d, _| self.decode_recompressed(index, body, d, page))
        } else {
            worker::with_codec(self.algorithm, |c, _| {
                c.decompress(body, page).map_err(corrupt)
            })
        }
    }
}

/// The slot and cost of `len` bytes stored at `handle`.
fn stored(handle: u64, len: usize) -> (Slot, PageCost) {
    (
        Slot::Stored {
            handle,
            len: len as u16,
            recompressed: false,
        },
        PageCost {
            stored: true,
            huge: len == PAGE_SIZE,
            payload: len as u64,
            ..PageCost::default()
        },
    )
}

fn cost_of(slot: Slot) -> PageCost {
    match slot {
        Slot::Empty | Slot::Lost | Slot::Invalid => PageCost::default(),
        Slot::Same(_) | Slot::SameExt => same_cost(),
        Slot::Staged(_) => PageCost {
            stored: true,
            staged: true,
            ..PageCost::default()
        },
        Slot::Stored {
            handle,
            len,
            recompressed,
        } => PageCost {
            recompressed,
            ..stored(handle, usize::from(len)).1
        },
        Slot::Backed { .. } => PageCost {
            stored: true,
            backed: true,
            ..PageCost::default()
        },
    }
}

fn corrupt(index: u64, what: &str) -> CoreError {
    CoreError::Corrupt {
        index,
        source: crate::codec::CodecError::Corrupt(what.into()),
    }
}

/// Writes an item on every page of `v`'s spare room, so that the room is in memory before
/// the caller takes its locks.
///
/// Why: a reservation is address space; its pages come with the first write (the daemon
/// locks memory on fault, `MCL_ONFAULT`, and a large reservation is a fresh mapping of its
/// own). Compaction's list of every object (24 bytes an object: 60 MB for 2.5 million pages
/// in RAM) was first written under every shard's write lock, so one of those faults waiting
/// in reclaim (under memory exhaustion an I/O flusher's waits as long as it takes) would
/// hold every queue thread.
fn fault_in_spare<T: Copy>(v: &mut Vec<T>, item: T) {
    let per_page = (4096 / std::mem::size_of::<T>().max(1)).max(1);
    let spare = v.spare_capacity_mut();
    let last = spare.len().checked_sub(1);
    for i in (0..spare.len()).step_by(per_page).chain(last) {
        spare[i].write(item);
        // The write must happen: nothing reads it before the item written there later.
        std::hint::black_box(&spare[i]);
    }
}

/// An empty vector with room for `n` items, or `NoMemory`.
fn try_vec<T>(n: usize) -> Result<Vec<T>, CoreError> {
    #[cfg(test)]
    if tests::failing_alloc() {
        return Err(CoreError::NoMemory);
    }
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| CoreError::NoMemory)?;
    Ok(v)
}

fn read_lock<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    #[cfg(test)]
    tests::count_lock();
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write_lock<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    #[cfg(test)]
    tests::count_lock();
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// CRC-64 of an object's bytes: two different objects share one with odds of 2^-64.
fn object_fingerprint(object: &[u8]) -> u64 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, object)
}

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod kept_memory;
#[cfg(test)]
mod replaced_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod writeback_tests;

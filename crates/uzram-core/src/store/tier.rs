//! The store's cold tier in RAM: how long each page has gone unused, and recompression of
//! the pages that went cold (or were stored raw) into zstd, which stores them tighter than
//! the LZ4 the hot path writes and still decodes in microseconds.
//!
//! **Ages.** Each page keeps a 16-bit stamp beside its table entry: the store's clock (in
//! ticks; the daemon ticks it once a minute) at its last write or read, in 15 bits, and a
//! flag that recompression already tried the page and kept it as it was. The age of a page is
//! the clock minus its stamp; the store's tick clamps old stamps before the 15 bits could
//! wrap, so a page idle for weeks stays the oldest. With the 8-byte entry and the 4-byte
//! checksum a page has 14 bytes of metadata. A persistent store keeps the clock and the
//! stamps after its page table (`PageStore::table_len`), four stamps to a word: a takeover
//! keeps every page's age and tried flag.
//!
//! **Recompression** (`PageStore::recompress`, in the store's module) reads a candidate's object, decodes it,
//! compresses it with zstd, and keeps the result only if it saves at least one size class;
//! the new object replaces the old one only if the page still holds the object read (a write
//! in between wins). The entry then says `recompressed` (see `entry.rs`): reads decode it
//! with zstd, whatever the store's own algorithm. The checksum of the page travels with it.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::batch::{SlotBackend, Words};
use crate::CoreError;

/// The stamp's flag: recompression tried the page and kept it as it was.
const TRIED: u16 = 1 << 15;
/// The stamp's clock bits.
const CLOCK_MASK: u32 = (1 << 15) - 1;
/// The oldest age a page shows; older stamps are moved up to it (see [`PageStore::tick`](crate::PageStore::tick)).
pub const MAX_AGE: u32 = 24 * 1024;
/// How often (in ticks) [`PageStore::tick`](crate::PageStore::tick) clamps old stamps: well before an age of
/// `MAX_AGE` plus this could pass the 15 bits.
pub(crate) const CLAMP_EVERY: u32 = 256;
/// A recompressed object must save at least this much (one arena size class).
pub(crate) const MIN_SAVING: usize = 8;

/// The upper bounds, in ticks, of the age buckets [`PageStore::ages`](crate::PageStore::ages) counts: with a tick
/// of a minute, under a minute, 10 minutes, an hour, a day, and the rest.
pub const AGE_BUCKETS: [u32; 4] = [1, 10, 60, 1440];

/// Pages holding data, by age bucket ([`AGE_BUCKETS`], then the rest).
pub type AgeCounts = [u64; AGE_BUCKETS.len() + 1];

/// Which pages a recompression pass takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidates {
    /// Pages unused for at least this many ticks.
    Idle {
        /// Age in ticks.
        min_age: u32,
    },
    /// Pages stored raw (they did not compress below the raw threshold).
    Huge,
    /// Pages stored raw and unused for at least this many ticks.
    HugeIdle {
        /// Age in ticks.
        min_age: u32,
    },
}

/// What a recompression pass writes (`recompress.rs`).
#[derive(Clone, Copy)]
pub enum Recompressor<'a> {
    /// zstd at this level, a page at a time on the calling thread.
    Zstd {
        /// zstd's level.
        level: i32,
    },
    /// A backend's batch compressor, a slot of pages at a time: the store's own codec
    /// again from one that parses tighter than the hot path (a GPU's `high` LZ4 parse), or
    /// zstd frames (NVIDIA nvCOMP's batched zstd), which the entry then marks
    /// `recompressed` as the CPU's zstd does. The pass uses slot `slot` of `backend`, which
    /// nothing else may use meanwhile.
    Batched {
        /// The compressor.
        backend: &'a dyn SlotBackend,
        /// The slot the pass fills.
        slot: usize,
    },
    /// A backend's batch LZ4 compressor that writes blocks with the store's dictionary as
    /// their prefix (`dictionary.rs`; the caller loaded the backend with it): installed as
    /// `recompressed` objects that start with the dictionary's mark. Slot `slot` as for
    /// `Batched`.
    Dictionary {
        /// The compressor.
        backend: &'a dyn SlotBackend,
        /// The slot the pass fills.
        slot: usize,
    },
}

impl std::fmt::Debug for Recompressor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Zstd { level } => f.debug_struct("Zstd").field("level", level).finish(),
            Self::Batched { backend, slot } => f
                .debug_struct("Batched")
                .field("backend", &backend.name())
                .field("slot", slot)
                .finish(),
            Self::Dictionary { backend, slot } => f
                .debug_struct("Dictionary")
                .field("backend", &backend.name())
                .field("slot", slot)
                .finish(),
        }
    }
}

/// One recompression pass.
#[derive(Debug, Clone, Copy)]
pub struct Recompress<'a> {
    /// Which pages.
    pub candidates: Candidates,
    /// What it writes.
    pub recompressor: Recompressor<'a>,
    /// Only pages whose stored object has at least this many bytes (zram's `threshold=`).
    pub threshold: usize,
    /// At most this many pages tried.
    pub max_pages: u64,
    /// Also the pages an earlier pass tried and left (their flag is one for every
    /// recompressor): for a pass with another recompressor than the one that tried them
    /// (`uzram recompress --algorithm zstd:19` on a device whose own is `lz4-gpu` or zstd:3).
    pub retry_tried: bool,
    /// How the calling thread is raised while the pass looks pages up and installs them,
    /// under locks the I/O path waits on (`None`: it is not); it compresses at the thread's
    /// own priority.
    pub priority: Option<&'a dyn Priority>,
}

/// Moves the calling thread between its own priority and the I/O path's. The daemon runs
/// recompression at the lowest priority, but a pass takes a shard's lock and the arena's
/// for each page it looks up and installs: preempted while it holds one beside busy CPUs,
/// it would stop the writers for as long as the scheduler leaves it waiting (priority
/// inversion; `cargo bench -p uzram-core --bench tier_pause`). Calls come from the thread
/// that runs the pass, in pairs: `raise`, then `lower`.
pub trait Priority: std::fmt::Debug {
    /// Raises the calling thread to the I/O path's priority.
    fn raise(&self);
    /// Gives the calling thread its own priority back.
    fn lower(&self);
}

/// What a pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recompressed {
    /// Candidates tried.
    pub tried: u64,
    /// Rewritten smaller.
    pub rewritten: u64,
    /// Tried and kept as they were (not smaller by a size class).
    pub kept: u64,
    /// Payload bytes saved by the rewrites.
    pub saved_bytes: u64,
    /// Written (or freed) while they were being recompressed: the write won.
    pub raced: u64,
    /// Not rewritten for want of memory under the limit, or failing their checksum.
    pub failed: u64,
}

/// The store's clock and the pages' stamps, in words: the clock in the first, then four
/// 16-bit stamps to a word (page `i`'s in word `1 + i / 4`, bits `16 * (i % 4)` up). A
/// persistent store keeps them after its page table, in the memory a takeover finds, so a
/// page's age and its tried flag outlive the daemon; a stamp is updated with one atomic
/// read-modify-write of its word, since the other three pages' stamps in it change under
/// other locks.
#[derive(Debug)]
pub(crate) struct Ages {
    words: Words,
    /// Pages by age bucket, as the last tick counted them.
    counts: [AtomicU64; AGE_BUCKETS.len() + 1],
}

impl Ages {
    /// Words the clock and the stamps of `pages` pages take.
    pub(crate) fn words_for(pages: u64) -> u64 {
        1 + pages.div_ceil(4)
    }

    /// Stamps for `pages` pages (all young) in this process's memory, or `NoMemory`.
    pub(crate) fn new(pages: u64) -> Result<Ages, CoreError> {
        let n = usize::try_from(Self::words_for(pages)).map_err(|_| CoreError::NoMemory)?;
        let mut words = Vec::new();
        words
            .try_reserve_exact(n)
            .map_err(|_| CoreError::NoMemory)?;
        words.resize_with(n, || AtomicU64::new(0));
        Ok(Self::over(Words::Own(words.into_boxed_slice())))
    }

    /// The clock and stamps in `words` ([`Ages::words_for`] of them), as a dead process
    /// left them (zeroed for a new store: every page young). Any value is an age, so
    /// nothing in them needs checking beyond their number.
    pub(crate) fn kept(pages: u64, words: &'static [AtomicU64]) -> Result<Ages, CoreError> {
        if words.len() as u64 != Self::words_for(pages) {
            return Err(CoreError::Config(format!(
                "the kept ages have {} words; {pages} pages need {}",
                words.len(),
                Self::words_for(pages)
            )));
        }
        Ok(Self::over(Words::Kept(words)))
    }

    fn over(words: Words) -> Ages {
        Ages {
            words,
            counts: Default::default(),
        }
    }

    /// Every page young and not tried, the clock at 0 (a new store over kept memory).
    pub(crate) fn clear(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::Relaxed);
        }
    }

    fn clock(&self) -> &AtomicU64 {
        &self.words[0]
    }

    /// Page `index`'s word and the shift of its stamp in it.
    fn word(&self, index: u64) -> Option<(&AtomicU64, u32)> {
        let w = usize::try_from(1 + index / 4).ok()?;
        Some((self.words.get(w)?, 16 * (index % 4) as u32))
    }

    fn stamp(&self, index: u64) -> Option<u16> {
        let (word, shift) = self.word(index)?;
        Some((word.load(Ordering::Relaxed) >> shift) as u16)
    }

    /// Sets page `index`'s stamp to `f(old)`, storing only if it changes.
    fn update(&self, index: u64, f: impl Fn(u16) -> u16) {
        if let Some((word, shift)) = self.word(index) {
            let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                let old = (w >> shift) as u16;
                let new = f(old);
                (new != old).then(|| (w & !(0xffff << shift)) | (u64::from(new) << shift))
            });
        }
    }

    /// Advances the clock by one tick; returns the new time.
    pub(crate) fn advance(&self) -> u32 {
        (self.clock().fetch_add(1, Ordering::Relaxed) + 1) as u32
    }

    /// Publishes the pages counted by age bucket.
    pub(crate) fn set_counts(&self, counts: AgeCounts) {
        for (c, n) in self.counts.iter().zip(counts) {
            c.store(n, Ordering::Relaxed);
        }
    }

    /// The pages by age bucket, as last published.
    pub(crate) fn counts(&self) -> AgeCounts {
        let mut out = AgeCounts::default();
        for (o, c) in out.iter_mut().zip(&self.counts) {
            *o = c.load(Ordering::Relaxed);
        }
        out
    }

    /// Bytes the clock and stamps take for `pages` pages.
    pub(crate) fn bytes_for(pages: u64) -> u64 {
        Self::words_for(pages) * 8
    }

    pub(crate) fn now(&self) -> u32 {
        self.clock().load(Ordering::Relaxed) as u32
    }

    pub(crate) fn stamp_now(&self) -> u16 {
        (self.now() & CLOCK_MASK) as u16
    }

    pub(crate) fn age_of(&self, stamp: u16) -> u32 {
        self.now().wrapping_sub(u32::from(stamp)) & CLOCK_MASK
    }

    /// Page `index` was written: young, and not yet tried.
    pub(crate) fn written(&self, index: u64) {
        let now = self.stamp_now();
        self.update(index, |_| now);
    }

    /// Page `index` was read: young; its content, and so what recompression found of it,
    /// is unchanged. Stores only when the stamp changes: reads of a hot page leave its
    /// line alone.
    pub(crate) fn read(&self, index: u64) {
        let now = self.stamp_now();
        if self.stamp(index).is_some_and(|old| old & !TRIED != now) {
            self.update(index, |old| now | (old & TRIED));
        }
    }

    pub(crate) fn age(&self, index: u64) -> u32 {
        self.stamp(index).map_or(0, |s| self.age_of(s & !TRIED))
    }

    pub(crate) fn tried(&self, index: u64) -> bool {
        self.stamp(index).is_some_and(|s| s & TRIED != 0)
    }

    pub(crate) fn mark_tried(&self, index: u64) {
        self.update(index, |old| old | TRIED);
    }

    /// Sets page `index`'s age to at least `age` ticks.
    pub(crate) fn make_old(&self, index: u64, age: u32) {
        if self.age(index) < age {
            self.set_age(index, age);
        }
    }

    /// Sets page `index`'s age to `age` ticks, keeping its flag.
    pub(crate) fn set_age(&self, index: u64, age: u32) {
        let stamp = (self.now().wrapping_sub(age) & CLOCK_MASK) as u16;
        self.update(index, |old| stamp | (old & TRIED));
    }
}

pub(crate) fn bucket(age: u32) -> usize {
    AGE_BUCKETS
        .iter()
        .position(|&b| age < b)
        .unwrap_or(AGE_BUCKETS.len())
}

/// The zstd level recompression uses when none is given.
pub const DEFAULT_LEVEL: i32 = 3;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::codec::Algorithm;
    use crate::page::PAGE_SIZE;
    use crate::store::PageStore;
    use crate::store::StoreConfig;

    /// The checked-in slices: real pages of several heaps.
    pub(crate) fn corpus() -> Vec<u8> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
        let mut out = Vec::new();
        for name in ["python-heap", "mixed-swap", "jvm"] {
            let f = std::fs::File::open(dir.join(format!("{name}.slice.pages.zst"))).unwrap();
            out.extend(zstd::decode_all(f).unwrap());
        }
        out
    }

    pub(crate) fn filled(data: &[u8]) -> PageStore {
        let pages = (data.len() / PAGE_SIZE) as u64;
        let store = PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap();
        store.write(0, data).unwrap();
        store
    }

    fn pass(candidates: Candidates) -> Recompress<'static> {
        Recompress {
            candidates,
            recompressor: Recompressor::Zstd {
                level: DEFAULT_LEVEL,
            },
            threshold: 0,
            max_pages: u64::MAX,
            retry_tried: false,
            priority: None,
        }
    }

    pub(crate) use crate::fuzz::reads_back;

    #[test]
    fn a_page_ages_by_the_tick_and_is_young_again_when_used() {
        let data = corpus();
        let store = filled(&data[..8 * PAGE_SIZE]);
        assert_eq!(store.age(3), 0);
        for _ in 0..70 {
            store.tick();
        }
        assert_eq!(store.age(3), 70);
        assert_eq!(
            store.ages(),
            [0, 0, 0, 8, 0],
            "8 pages between an hour and a day"
        );
        let mut page = [0u8; PAGE_SIZE];
        store.read(3, &mut page).unwrap();
        store.write(5, &data[..PAGE_SIZE]).unwrap();
        assert_eq!((store.age(3), store.age(5), store.age(4)), (0, 0, 70));
        store.tick();
        assert_eq!(store.ages(), [0, 2, 0, 6, 0]);
        // Marked idle: the oldest age, and counted so.
        assert_eq!(store.mark_idle(Some(60)), 6);
        assert_eq!(store.age(4), MAX_AGE);
        assert_eq!(store.mark_idle(None), 8);
        store.tick();
        assert_eq!(store.ages(), [0, 0, 0, 0, 8]);
    }

    #[test]
    fn a_taken_over_store_keeps_its_pages_ages_and_tried_flags() {
        use crate::store::kept_memory::KeptMemory;
        let data = corpus()[..64 * PAGE_SIZE].to_vec();
        // What an earlier store left there: a new store starts from young pages anyway.
        let mut kept = KeptMemory::new(StoreConfig::new(64, Algorithm::Lz4), u64::MAX);
        let store = kept.store();
        store.write(0, &data).unwrap();
        assert_eq!((store.age(3), store.ages.tried(3)), (0, false));
        for _ in 0..30 {
            store.tick();
        }
        store.write(5, &data[..PAGE_SIZE]).unwrap();
        store.ages.mark_tried(7);
        kept.kill(store);
        let (store, _) = kept.recover().unwrap();
        assert_eq!((store.age(3), store.age(5), store.age(7)), (30, 0, 30));
        assert!(store.ages.tried(7) && !store.ages.tried(3));
        store.tick();
        assert_eq!(store.age(3), 31, "the clock goes on from where it was");
        assert_eq!(store.ages(), [0, 1, 63, 0, 0]);
        let mut want = data.clone();
        want.copy_within(..PAGE_SIZE, 5 * PAGE_SIZE);
        reads_back(&store, &want);
    }

    #[test]
    fn ages_never_wrap_back_to_young() {
        let data = corpus();
        let store = filled(&data[..2 * PAGE_SIZE]);
        for _ in 0..(1 << 15) + 2 * CLAMP_EVERY {
            store.tick();
        }
        assert!(store.age(0) >= MAX_AGE, "{}", store.age(0));
        assert_eq!(store.ages()[AGE_BUCKETS.len()], 2);
    }

    #[test]
    fn idle_pages_recompressed_as_zstd_take_less_memory_and_read_back_exact() {
        let data = corpus();
        let store = filled(&data);
        let before = store.stats();
        for _ in 0..10 {
            store.tick();
        }
        // Written after the ticks: young, so left alone.
        store.write(0, &data[..16 * PAGE_SIZE]).unwrap();
        let done = store
            .recompress(pass(Candidates::Idle { min_age: 10 }))
            .unwrap();
        let after = store.stats();
        let pages = (data.len() / PAGE_SIZE) as u64;
        assert!(done.tried > 0 && done.tried <= pages - 16, "{done:?}");
        assert!(done.rewritten > done.tried / 2, "{done:?}");
        assert_eq!(done.rewritten + done.kept, done.tried, "{done:?}");
        assert_eq!(after.recompressed_pages, done.rewritten);
        assert_eq!(
            before.compr_data_size - after.compr_data_size,
            done.saved_bytes,
            "{before:?} {after:?}"
        );
        assert!(
            (after.compr_data_size as f64) < 0.9 * before.compr_data_size as f64,
            "zstd stores these heaps tighter than lz4: {} -> {}",
            before.compr_data_size,
            after.compr_data_size
        );
        assert_eq!(after.recompress_saved_bytes, done.saved_bytes);
        reads_back(&store, &data);
        // The young pages were not taken; a second pass finds nothing left to try.
        assert_eq!(store.age(0), 0);
        let again = store
            .recompress(pass(Candidates::Idle { min_age: 10 }))
            .unwrap();
        assert_eq!(again.tried, 0, "{again:?}");
        // Compaction moves recompressed objects like any other.
        store.discard(16, 64).unwrap();
        store.compact();
        let mut expect = data.clone();
        expect[16 * PAGE_SIZE..80 * PAGE_SIZE].fill(0);
        reads_back(&store, &expect);
    }

    #[test]
    fn huge_pages_are_tried_once_and_a_threshold_and_a_budget_hold() {
        let mut data = corpus()[..64 * PAGE_SIZE].to_vec();
        // Every other page noise: stored raw, and no better as zstd.
        let noise = crate::fuzz::noise_pages(32, 0x9e37_79b9_7f4a_7c15);
        for (page, noise) in data
            .chunks_exact_mut(PAGE_SIZE)
            .step_by(2)
            .zip(noise.chunks_exact(PAGE_SIZE))
        {
            page.copy_from_slice(noise);
        }
        let store = filled(&data);
        let huge = store.stats().huge_pages;
        assert!(huge >= 32, "{huge}");
        let done = store.recompress(pass(Candidates::Huge)).unwrap();
        assert_eq!(done.tried, huge);
        assert_eq!(done.kept, huge, "noise does not shrink: {done:?}");
        // Tried: not tried again until rewritten, unless the pass asks (another recompressor).
        assert_eq!(store.recompress(pass(Candidates::Huge)).unwrap().tried, 0);
        let retry = Recompress {
            retry_tried: true,
            priority: None,
            ..pass(Candidates::Huge)
        };
        assert_eq!(store.recompress(retry).unwrap().tried, huge);
        // Only objects of at least `threshold` bytes, at most `max_pages` of them.
        for _ in 0..5 {
            store.tick();
        }
        let some = store
            .recompress(Recompress {
                threshold: 1500,
                max_pages: 7,
                ..pass(Candidates::Idle { min_age: 5 })
            })
            .unwrap();
        assert_eq!(some.tried, 7, "{some:?}");
        reads_back(&store, &data);
    }

    #[test]
    fn a_damaged_object_is_never_rewritten_as_good_and_its_read_still_fails() {
        let data = corpus()[..32 * PAGE_SIZE].to_vec();
        let store = filled(&data);
        crate::store::tests::damage(&store, 7, 20, 3);
        let mut page = [0u8; PAGE_SIZE];
        assert!(store.read(7, &mut page).is_err());
        let done = store
            .recompress(pass(Candidates::Idle { min_age: 0 }))
            .unwrap();
        assert!(done.failed >= 1, "{done:?}");
        assert!(
            store.read(7, &mut page).is_err(),
            "still fails, never other data"
        );
    }
}

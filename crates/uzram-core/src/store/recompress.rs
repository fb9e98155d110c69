//! Recompression passes (`tier.rs` has the why): a page that went cold is read, decoded,
//! checked and compressed again, and its new object replaces the old one only if the page
//! still holds the object read (a write in between wins) and it saves a size class.
//!
//! Two recompressors:
//! - **zstd**, a page at a time on the calling thread. The entry then says `recompressed`
//!   and reads decode it with zstd.
//! - **Batched** through a [`SlotBackend`]: a slot of cold pages at a time, compressed by a
//!   backend, in one of two outputs:
//!   - the store's own codec again, from a backend that parses tighter than the hot path
//!     did (a GPU's `high` LZ4 parse): reads decode it as before, at LZ4's speed;
//!   - zstd frames (NVIDIA nvCOMP's batched zstd): the entry says `recompressed`, as for
//!     the CPU's zstd, and reads decode it with zstd.
//!
//!   - LZ4 with the store's dictionary (`dictionary.rs`), from a backend loaded with it:
//!     the entry says `recompressed` and the object starts with the dictionary's mark.
//!
//!   A block is taken only if the backend's checksum of what it compressed is the page's
//!   and it decodes, on the CPU, to the page: the old object is good, and a device whose
//!   own check passed a bad block must not turn it into a failed read. That decode is most
//!   of the pass's CPU; the GPU does the search.

use super::dictionary::DICT_MARK;
use super::tier::{Candidates, Priority, Recompress, Recompressed, Recompressor, MIN_SAVING};
use super::{read_lock, Budget, Counters, PageStore, Slot};
use crate::batch::{PageResult, SlotBackend};
use crate::codec::{Algorithm, PageCodec, ZstdCodec};
use crate::page::{page_checksum, page_to_words, PAGE_SIZE, PAGE_WORDS};
use crate::CoreError;
use std::sync::atomic::Ordering::Relaxed;

/// A batch on its way through a backend.
#[derive(Clone, Copy)]
struct Staged<'a> {
    /// Each candidate with the checksum of the page staged for it.
    batch: &'a [(Candidate, u32)],
    /// The backend's slot, the pages staged in it.
    input: &'a [std::sync::atomic::AtomicU64],
    /// What the backend writes.
    output: Output,
}

/// What a batched recompressor's blocks are, and so how they are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// The store's own codec: installed as the hot path's objects are.
    Own,
    /// zstd frames: installed as `recompressed`.
    Frames,
    /// LZ4 blocks with the store's dictionary: installed as `recompressed`, after the
    /// dictionary's mark.
    Dictionary,
}

impl Output {
    fn recompressed(self) -> bool {
        self != Output::Own
    }
}

/// A page a pass took: what it held when read, and the checksum it is stored with.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    index: u64,
    slot: Slot,
    /// The stored object's checksum (0 in a store without checksums).
    checksum: u32,
    /// The stored object's length.
    len: usize,
    /// Its object's fingerprint when it was read (`PageStore::switch`).
    fingerprint: u64,
}

/// Candidates of a zstd pass taken at once: compressed one after the other at the pass's
/// own priority, and installed one after the other raised, so that a raise and its
/// lowering (two system calls, 3 µs a page on the build VM) come once a batch.
const ZSTD_BATCH: usize = 32;

/// A zstd pass's batch: each candidate's page and the buffer its frame goes into.
struct ZstdBatch {
    candidates: Vec<Candidate>,
    pages: Vec<[u8; PAGE_SIZE]>,
    outs: Vec<[u8; PAGE_SIZE]>,
}

impl ZstdBatch {
    fn new() -> Result<Self, CoreError> {
        let buffers = || {
            let mut v = Vec::new();
            v.try_reserve_exact(ZSTD_BATCH)
                .map_err(|_| CoreError::NoMemory)?;
            v.resize(ZSTD_BATCH, [0u8; PAGE_SIZE]);
            Ok::<_, CoreError>(v)
        };
        let mut candidates = Vec::new();
        candidates
            .try_reserve_exact(ZSTD_BATCH)
            .map_err(|_| CoreError::NoMemory)?;
        Ok(Self {
            candidates,
            pages: buffers()?,
            outs: buffers()?,
        })
    }

    fn push(&mut self, c: Candidate, page: &[u8; PAGE_SIZE]) {
        if let Some(slot) = self.pages.get_mut(self.candidates.len()) {
            *slot = *page;
            self.candidates.push(c);
        }
    }

    fn full(&self) -> bool {
        self.candidates.len() == ZSTD_BATCH
    }
}

/// The pass's thread raised ([`Recompress::priority`]) while it takes locks the I/O path
/// waits on (a shard's, the arena's), and at its own priority while it compresses: raised
/// at the first look-up of a batch and kept so while it looks pages up (each candidate's
/// object copied out and decoded, a few µs a page: too short to lower the thread for
/// between two look-ups) until the batch is full, lowered while the batch is compressed,
/// raised again to install it, and lowered when dropped (a panic included). The sampling
/// a dictionary is trained on (`dictionary.rs`) holds its look-ups the same way.
pub(super) struct Held<'a> {
    priority: Option<&'a dyn Priority>,
    raised: std::cell::Cell<bool>,
}

impl<'a> Held<'a> {
    pub(super) fn new(priority: Option<&'a dyn Priority>) -> Self {
        Self {
            priority,
            raised: std::cell::Cell::new(false),
        }
    }

    /// Before taking locks the I/O path waits on.
    pub(super) fn locks(&self) {
        if let (Some(p), false) = (self.priority, self.raised.get()) {
            p.raise();
            self.raised.set(true);
        }
    }

    /// Before work that holds none.
    pub(super) fn work(&self) {
        if let (Some(p), true) = (self.priority, self.raised.get()) {
            p.lower();
            self.raised.set(false);
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.work();
    }
}

impl PageStore {
    /// One recompression pass over the pages `pass` selects, in page order. Off the I/O
    /// path: it holds a shard's lock only to copy an object out and to swap it in, raised
    /// to the I/O path's priority meanwhile where `pass.priority` says how.
    pub fn recompress(&self, pass: Recompress<'_>) -> Result<Recompressed, CoreError> {
        let mut done = Recompressed::default();
        let held = Held::new(pass.priority);
        let result = match pass.recompressor {
            Recompressor::Zstd { level } => self.recompress_zstd(&pass, level, &held, &mut done),
            Recompressor::Batched { backend, slot } => {
                // zstd frames from a backend are the recompressed kind whatever the store
                // holds; anything else must be the store's own codec.
                let output = if matches!(backend.algorithm(), Algorithm::Zstd { .. }) {
                    Output::Frames
                } else {
                    Output::Own
                };
                self.recompress_batched(&pass, backend, slot, output, &held, &mut done)
            }
            Recompressor::Dictionary { backend, slot } => {
                self.recompress_batched(&pass, backend, slot, Output::Dictionary, &held, &mut done)
            }
        };
        drop(held);
        Counters::bump(&self.counters.recompress_tried, done.tried);
        Counters::bump(&self.counters.recompress_kept, done.kept);
        Counters::bump(&self.counters.recompress_rewritten, done.rewritten);
        Counters::bump(&self.counters.recompress_saved_bytes, done.saved_bytes);
        match result {
            // Pages already rewritten stay so (their entries point at the new objects): the
            // pass saved that much, and says so.
            Err(e) if done.rewritten > 0 => {
                tracing::warn!(error = %e, rewritten = done.rewritten, "a recompression pass ended early");
                Ok(done)
            }
            result => result.map(|()| done),
        }
    }

    fn recompress_zstd(
        &self,
        pass: &Recompress<'_>,
        level: i32,
        held: &Held<'_>,
        done: &mut Recompressed,
    ) -> Result<(), CoreError> {
        let mut zstd = ZstdCodec::try_new(level).map_err(CoreError::Compress)?;
        let mut batch = ZstdBatch::new()?;
        self.each_candidate(pass, held, done, |done, c, page| {
            batch.push(c, page);
            if batch.full() {
                self.compress_zstd_batch(&mut zstd, &mut batch, held, done);
            }
            Ok(())
        })?;
        self.compress_zstd_batch(&mut zstd, &mut batch, held, done);
        Ok(())
    }

    /// Compresses the candidates of `batch` at the thread's own priority, then installs
    /// those that came out smaller raised (`held`), and empties it.
    fn compress_zstd_batch(
        &self,
        zstd: &mut ZstdCodec,
        batch: &mut ZstdBatch,
        held: &Held<'_>,
        done: &mut Recompressed,
    ) {
        held.work();
        let ZstdBatch {
            candidates,
            pages,
            outs,
        } = batch;
        let mut lens = [None; ZSTD_BATCH];
        for (((c, page), out), len) in candidates
            .iter()
            .zip(pages.iter())
            .zip(outs.iter_mut())
            .zip(lens.iter_mut())
        {
            *len = match zstd.compress(page, &mut out[..PAGE_SIZE - 1]) {
                Ok(Some(n)) if n + MIN_SAVING <= c.len => Some(n),
                _ => None,
            };
        }
        held.locks();
        for ((&c, out), len) in candidates.iter().zip(outs.iter()).zip(lens) {
            match len {
                Some(n) => self.replace(c, &out[..n], true, done),
                None => self.keep(c, done),
            }
        }
        candidates.clear();
    }

    /// Fills slot `slot` of `backend` with candidates, compresses it, installs what came
    /// back smaller, and again until the pass is done. The backend's slot is this pass's
    /// alone: the caller holds it (a backend made for recompression, not the ring's).
    fn recompress_batched(
        &self,
        pass: &Recompress<'_>,
        backend: &dyn SlotBackend,
        slot: usize,
        output: Output,
        held: &Held<'_>,
        done: &mut Recompressed,
    ) -> Result<(), CoreError> {
        match output {
            Output::Own if backend.algorithm() != self.algorithm => {
                return Err(CoreError::Config(format!(
                    "a batched recompressor writes {} and this store holds {}",
                    backend.algorithm(),
                    self.algorithm
                )))
            }
            Output::Dictionary if backend.algorithm() != Algorithm::Lz4 => {
                return Err(CoreError::Config(format!(
                    "a dictionary recompressor must write LZ4, not {}",
                    backend.algorithm()
                )))
            }
            Output::Dictionary if self.dictionary().is_none() => {
                return Err(CoreError::Config(
                    "a dictionary recompressor needs the store's dictionary set first".into(),
                ))
            }
            _ => {}
        }
        let room = backend.slot_pages();
        let input = backend.input(slot);
        if room == 0 || input.len() < room * PAGE_WORDS {
            return Err(CoreError::Config(format!(
                "slot {slot} of the {} backend has no room for pages",
                backend.name()
            )));
        }
        let mut batch = Vec::new();
        batch
            .try_reserve_exact(room)
            .map_err(|_| CoreError::NoMemory)?;
        self.each_candidate(pass, held, done, |done, c, page| {
            let k = batch.len();
            page_to_words(page, &input[k * PAGE_WORDS..(k + 1) * PAGE_WORDS]);
            // With checksums on, the candidate's was just checked against this page.
            let staged = if self.checksums {
                c.checksum
            } else {
                page_checksum(page)
            };
            batch.push((c, staged));
            if batch.len() == room {
                let compressed = self.compress_batch(backend, slot, &batch, output, held, done);
                batch.clear();
                compressed?;
            }
            Ok(())
        })?;
        if !batch.is_empty() {
            self.compress_batch(backend, slot, &batch, output, held, done)?;
        }
        Ok(())
    }

    /// Compresses the staged `batch` in `slot` and installs each result that saves a size
    /// class. `batch` pairs each candidate with the checksum of the page staged for it;
    /// `output`: what the results are. A backend that fails fails the pass, its batch
    /// counted failed. The install runs raised (`held`) as a whole: besides its locks it
    /// decodes each block the backend returned (a few µs a page), too short a time to lower
    /// the thread for between two pages' locks.
    fn compress_batch(
        &self,
        backend: &dyn SlotBackend,
        slot: usize,
        batch: &[(Candidate, u32)],
        output: Output,
        held: &Held<'_>,
        done: &mut Recompressed,
    ) -> Result<(), CoreError> {
        held.work();
        let backend_failed = |e: crate::batch::BackendError| CoreError::Backend {
            backend: e.backend,
            reason: e.message,
        };
        let mut installed = false;
        let input = backend.input(slot);
        let mut decoded = [0u8; PAGE_SIZE];
        let mut bad = None;
        let compressed = backend.submit(slot, batch.len(), PAGE_SIZE).and_then(|()| {
            backend.complete(slot, &mut |out| {
                installed = true;
                let staged = Staged {
                    batch,
                    input,
                    output,
                };
                held.locks();
                self.install_batch(&staged, out, &mut decoded, &mut bad, done);
            })
        });
        if let Err(e) = compressed {
            if !installed {
                done.failed += batch.len() as u64;
            }
            return Err(backend_failed(e));
        }
        if let Some(k) = bad {
            tracing::warn!(
                backend = backend.name(),
                page = batch[k].0.index,
                "a recompressor's result did not decode to the page staged: not installed"
            );
        }
        Ok(())
    }

    /// Installs what came back for `staged` where it saves a size class and decodes to its
    /// page; `bad`: the first that did not.
    fn install_batch(
        &self,
        staged: &Staged<'_>,
        out: &crate::batch::SlotOutput<'_>,
        decoded: &mut [u8; PAGE_SIZE],
        bad: &mut Option<usize>,
        done: &mut Recompressed,
    ) {
        let Staged {
            batch,
            input,
            output,
        } = *staged;
        // A dictionary block is stored after the dictionary's mark.
        let mut marked = [0u8; PAGE_SIZE];
        marked[0] = DICT_MARK;
        for (k, &(c, staged)) in batch.iter().enumerate() {
            let block = match (out.page(k), out.checksum(k)) {
                (Ok(PageResult::Compressed(block)), Ok(sum)) if sum == staged => block,
                (Ok(PageResult::Compressed(_)), _) | (Err(_), _) => {
                    // It compressed other bytes than were staged, or broke the
                    // format: never installed, nor tried again.
                    self.refuse(c, done);
                    bad.get_or_insert(k);
                    continue;
                }
                // Raw, same-filled (not stored as an object, so not a candidate
                // that could come back so) or rejected: left as it is.
                _ => {
                    self.keep(c, done);
                    continue;
                }
            };
            let block = match output {
                Output::Dictionary if block.len() < PAGE_SIZE => {
                    marked[1..=block.len()].copy_from_slice(block);
                    &marked[..=block.len()]
                }
                Output::Dictionary => {
                    self.keep(c, done);
                    continue;
                }
                Output::Own | Output::Frames => block,
            };
            if block.len() + MIN_SAVING > c.len {
                self.keep(c, done);
                continue;
            }
            // The old object is good: the new one replaces it only once it has
            // decoded, here, to the very page (a device whose check passed a bad
            // block would otherwise turn a good page into a failed read).
            let staged = &input[k * PAGE_WORDS..(k + 1) * PAGE_WORDS];
            let same = self
                .decode(c.index, block, output.recompressed(), decoded)
                .is_ok()
                && staged
                    .iter()
                    .zip(decoded.chunks_exact(8))
                    .all(|(w, b)| w.load(Relaxed).to_le_bytes() == *b);
            if !same {
                self.refuse(c, done);
                bad.get_or_insert(k);
                continue;
            }
            self.replace(c, block, output.recompressed(), done);
        }
    }

    /// Leaves candidate `c` as it is, and flags it tried, if its page still holds what
    /// was read (a write since made it another page).
    fn keep(&self, c: Candidate, done: &mut Recompressed) {
        self.mark_tried_if_held(c);
        done.kept += 1;
    }

    /// A result for `c` that failed its check: counted failed, and `c` flagged tried so
    /// that a device that gets it wrong each time is not asked again each pass.
    fn refuse(&self, c: Candidate, done: &mut Recompressed) {
        self.mark_tried_if_held(c);
        done.failed += 1;
    }

    /// Flags `c`'s page tried if it still holds the object read: under the shard's lock,
    /// which a write holds while it stamps the page young (and clears the flag).
    fn mark_tried_if_held(&self, c: Candidate) {
        let (shard, idx) = self.locate(c.index);
        let shard = read_lock(shard);
        if shard.get(idx) == Some(c.slot) && self.fingerprint(c.slot) == Some(c.fingerprint) {
            self.ages.mark_tried(c.index);
        }
    }

    /// Calls `f` with each page `pass` takes, in page order, decoded and checked, until
    /// `pass.max_pages` were tried or `f` fails.
    fn each_candidate(
        &self,
        pass: &Recompress<'_>,
        held: &Held<'_>,
        done: &mut Recompressed,
        mut f: impl FnMut(&mut Recompressed, Candidate, &[u8; PAGE_SIZE]) -> Result<(), CoreError>,
    ) -> Result<(), CoreError> {
        let mut page = [0u8; PAGE_SIZE];
        for index in 0..self.pages {
            if done.tried >= pass.max_pages {
                break;
            }
            held.locks();
            if let Some(c) = self.take_candidate(pass, index, &mut page, done) {
                f(done, c, &page)?;
            }
        }
        Ok(())
    }

    /// Page `index` if `pass` takes it: decoded into `page` and checked against its
    /// checksum (counted as tried; a damaged one counted failed and left for its read to
    /// fail, never rewritten as good).
    fn take_candidate(
        &self,
        pass: &Recompress<'_>,
        index: u64,
        page: &mut [u8; PAGE_SIZE],
        done: &mut Recompressed,
    ) -> Option<Candidate> {
        let mut stored = [0u8; PAGE_SIZE];
        let (shard, idx) = self.locate(index);
        let (slot, checksum, len, fingerprint) = {
            let shard = read_lock(shard);
            let Some(
                slot @ Slot::Stored {
                    handle,
                    len,
                    recompressed: false,
                },
            ) = shard.get(idx)
            else {
                return None;
            };
            let len = usize::from(len);
            let huge = len == PAGE_SIZE;
            let age = self.ages.age(index);
            let wanted = match pass.candidates {
                Candidates::Idle { min_age } => age >= min_age,
                Candidates::Huge => huge,
                Candidates::HugeIdle { min_age } => huge && age >= min_age,
            };
            if !wanted || len < pass.threshold || (self.ages.tried(index) && !pass.retry_tried) {
                return None;
            }
            let checksum = self.load_stored(index, handle, len, &mut stored[..len])?;
            let fingerprint = self.fingerprint(slot)?;
            (slot, checksum, len, fingerprint)
        };
        done.tried += 1;
        if self.decode(index, &stored[..len], false, page).is_err()
            || (self.checksums && self.checksum_of(page) != checksum)
        {
            done.failed += 1;
            return None;
        }
        Some(Candidate {
            index,
            slot,
            checksum,
            len,
            fingerprint,
        })
    }

    /// Stores `bytes` (the page's new object: a recompressed one, a zstd frame or marked
    /// dictionary block, when `recompressed`, else the store's own codec) and points the page at it if it still holds what `c` read; frees
    /// whichever object lost, and counts the outcome. A page rewritten in its own codec is
    /// still a candidate by its entry: it is flagged tried (under the lock) so that the
    /// next pass leaves it until it is written.
    fn replace(&self, c: Candidate, bytes: &[u8], recompressed: bool, done: &mut Recompressed) {
        let budget = Budget::Limited {
            reserved: self.staged_room(),
        };
        let handle = match self
            .arena
            .store(bytes, self.trailer(c.index, c.checksum), budget)
        {
            Ok(handle) => handle,
            Err(_) => {
                done.failed += 1;
                return;
            }
        };
        let new = Slot::Stored {
            handle,
            len: bytes.len() as u16,
            recompressed,
        };
        match self.switch(c.index, c.slot, c.fingerprint, new, !recompressed) {
            Ok(true) => {
                done.rewritten += 1;
                done.saved_bytes += (c.len - bytes.len()) as u64;
                return;
            }
            Ok(false) => done.raced += 1,
            Err(_) => done.failed += 1,
        }
        self.free_slot(new);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    use super::super::tests::locks_taken;
    use super::super::tier::tests::{corpus, reads_back};
    use super::*;
    use crate::batch::{BackendError, FaultPlan, HostSlots, SlotOutput};
    use crate::codec::Algorithm;
    use crate::fuzz::noise_pages as noise;
    use crate::store::StoreConfig;

    /// A store that keeps every page that does not compress below 1 KiB raw: the hot path
    /// at its loosest, so that a batch backend's LZ4 (the CPU's own, in these tests) finds
    /// room to save.
    fn loose(data: &[u8]) -> PageStore {
        let pages = (data.len() / PAGE_SIZE) as u64;
        let mut cfg = StoreConfig::new(pages, Algorithm::Lz4);
        cfg.raw_threshold = 1024;
        let store = PageStore::new(cfg).unwrap();
        store.write(0, data).unwrap();
        store
    }

    fn batched(backend: &dyn SlotBackend) -> Recompress<'_> {
        Recompress {
            candidates: Candidates::Huge,
            recompressor: Recompressor::Batched { backend, slot: 0 },
            threshold: 0,
            max_pages: u64::MAX,
            retry_tried: false,
            priority: None,
        }
    }

    /// A [`Priority`] that checks it is used in pairs, counts its raises, and checks that
    /// its thread takes the store's locks only while raised (`store::tests::locks_taken`).
    #[derive(Debug)]
    pub(super) struct Counted {
        pub(super) raised: std::cell::Cell<bool>,
        pub(super) raises: std::cell::Cell<u64>,
        /// The thread's store locks when it was last lowered (or made).
        lowered_at: std::cell::Cell<u64>,
    }

    impl Default for Counted {
        fn default() -> Self {
            Self {
                raised: std::cell::Cell::new(false),
                raises: std::cell::Cell::new(0),
                lowered_at: std::cell::Cell::new(locks_taken()),
            }
        }
    }

    impl Counted {
        /// Panics unless the thread is lowered and took no store lock since it was last
        /// lowered: every lock it took since this was made, it took raised.
        pub(super) fn check_locks_were_raised(&self) {
            assert!(!self.raised.get(), "it ended raised");
            self.check_none_lowered();
        }

        fn check_none_lowered(&self) {
            let lowered = locks_taken() - self.lowered_at.get();
            assert_eq!(lowered, 0, "{lowered} store locks taken lowered");
        }
    }

    impl Priority for Counted {
        fn raise(&self) {
            assert!(!self.raised.replace(true), "raised twice");
            self.check_none_lowered();
            self.raises.set(self.raises.get() + 1);
        }

        fn lower(&self) {
            assert!(self.raised.replace(false), "lowered unraised");
            self.lowered_at.set(locks_taken());
        }
    }

    /// A pass raises its thread for its locks (it takes none lowered) and lowers it for its
    /// pages' compression: once a batch of the pages it tries, not once per page it looks
    /// at (the look-ups of pages it skips share a raise), and it ends lowered, whichever
    /// recompressor runs it.
    #[test]
    fn a_pass_is_raised_for_its_locks_once_a_batch_and_ends_lowered() {
        let data = corpus()[..256 * PAGE_SIZE].to_vec();
        let pages = (data.len() / PAGE_SIZE) as u64;
        for batched in [false, true] {
            let store = loose(&data);
            let backend = HostSlots::new(Algorithm::Lz4, 1, 64);
            let recompressor = if batched {
                Recompressor::Batched {
                    backend: &backend,
                    slot: 0,
                }
            } else {
                Recompressor::Zstd { level: 3 }
            };
            store.tick();
            // Every other page young again: looked at, skipped.
            for p in (0..pages).step_by(2) {
                let page = &data[p as usize * PAGE_SIZE..][..PAGE_SIZE];
                store.write(p, page).unwrap();
            }
            // The pass's locks from here on.
            let counted = Counted::default();
            let done = store
                .recompress(Recompress {
                    candidates: Candidates::Idle { min_age: 1 },
                    recompressor,
                    threshold: 0,
                    max_pages: u64::MAX,
                    retry_tried: false,
                    priority: Some(&counted),
                })
                .unwrap();
            assert!(done.tried > 0 && done.tried < pages, "{batched}: {done:?}");
            counted.check_locks_were_raised();
            let raises = counted.raises.get();
            assert!(
                raises >= 1 && raises <= done.tried.div_ceil(16) + 1,
                "{batched}: {raises} raises for {} pages tried",
                done.tried
            );
            reads_back(&store, &data);
        }
    }

    #[test]
    fn a_batch_backend_rewrites_pages_smaller_in_the_stores_own_codec() {
        let data = corpus();
        let store = loose(&data);
        let before = store.stats();
        assert!(before.huge_pages > 100, "{before:?}");
        let backend = HostSlots::new(Algorithm::Lz4, 1, 16);
        let done = store.recompress(batched(&backend)).unwrap();
        let after = store.stats();
        assert_eq!(done.tried, before.huge_pages, "{done:?}");
        assert!(done.rewritten > done.tried / 2, "{done:?}");
        assert_eq!(done.rewritten + done.kept, done.tried, "{done:?}");
        assert_eq!(after.recompress_rewritten_pages, done.rewritten);
        assert_eq!(after.recompressed_pages, 0, "LZ4, not zstd frames");
        assert_eq!(
            before.compr_data_size - after.compr_data_size,
            done.saved_bytes
        );
        assert_eq!(after.huge_pages, before.huge_pages - done.rewritten);
        reads_back(&store, &data);
        // Tried: a page is not tried again until it is written.
        let again = Recompress {
            candidates: Candidates::Idle { min_age: 0 },
            ..batched(&backend)
        };
        let pages = (data.len() / PAGE_SIZE) as u64;
        let second = store.recompress(again).unwrap();
        assert_eq!(second.tried, pages - before.huge_pages - before.same_pages);
        assert_eq!(second.rewritten, 0, "the same LZ4 saves nothing");
    }

    #[test]
    fn a_zstd_frame_backend_rewrites_pages_as_recompressed_zstd() {
        let data = corpus();
        let store = loose(&data);
        let before = store.stats();
        let backend = HostSlots::new(Algorithm::Zstd { level: 3 }, 1, 16);
        let pass = Recompress {
            candidates: Candidates::Idle { min_age: 0 },
            ..batched(&backend)
        };
        let done = store.recompress(pass).unwrap();
        let after = store.stats();
        let stored = (data.len() / PAGE_SIZE) as u64 - before.same_pages;
        assert_eq!(done.tried, stored, "{done:?}");
        assert!(done.rewritten > done.tried / 2, "{done:?}");
        assert_eq!(done.rewritten + done.kept, done.tried, "{done:?}");
        // The entries say zstd, so reads decode them with zstd, and no pass takes them
        // again (a recompressed entry is no candidate).
        assert_eq!(after.recompressed_pages, done.rewritten);
        assert_eq!(
            before.compr_data_size - after.compr_data_size,
            done.saved_bytes
        );
        reads_back(&store, &data);
        let again = store.recompress(batched(&backend)).unwrap();
        assert_eq!(again.tried, 0, "{again:?}");
    }

    #[test]
    fn a_backend_that_lies_or_misreads_gets_none_of_its_bad_blocks_installed() {
        let data = corpus();
        let writes = [Algorithm::Lz4, Algorithm::Zstd { level: 3 }];
        for ((what, faults), writes) in writes.iter().flat_map(|&w| {
            [
                (
                    "corrupt",
                    FaultPlan {
                        corrupt_every: 3,
                        ..FaultPlan::default()
                    },
                ),
                (
                    "misread",
                    FaultPlan {
                        misread_every: 4,
                        ..FaultPlan::default()
                    },
                ),
            ]
            .map(|f| (f, w))
        }) {
            let store = loose(&data);
            let backend = HostSlots::with_faults(writes, 1, 16, faults);
            let done = store.recompress(batched(&backend)).unwrap();
            // Its good blocks are taken, its bad ones refused, and every page reads back.
            assert!(done.failed > 0, "{what}: {done:?}");
            assert!(done.rewritten > 0, "{what}: {done:?}");
            assert_eq!(done.rewritten + done.kept + done.failed, done.tried);
            reads_back(&store, &data);
            // The refused pages are not offered again each pass.
            let again = store.recompress(batched(&backend)).unwrap();
            assert_eq!(again.tried, 0, "{what}: {again:?}");
        }
    }

    /// Runs `race` (writes to the store) once, while the backend compresses the first batch.
    struct Racing<'a> {
        inner: HostSlots,
        race: &'a (dyn Fn() + Sync),
        raced: AtomicU64,
    }

    impl SlotBackend for Racing<'_> {
        fn name(&self) -> &'static str {
            "racing"
        }
        fn algorithm(&self) -> Algorithm {
            self.inner.algorithm()
        }
        fn slots(&self) -> usize {
            self.inner.slots()
        }
        fn slot_pages(&self) -> usize {
            self.inner.slot_pages()
        }
        fn input(&self, slot: usize) -> &[AtomicU64] {
            self.inner.input(slot)
        }
        fn submit(&self, slot: usize, pages: usize, limit: usize) -> Result<(), BackendError> {
            self.inner.submit(slot, pages, limit)
        }
        fn complete(
            &self,
            slot: usize,
            install: &mut dyn FnMut(&SlotOutput<'_>),
        ) -> Result<(), BackendError> {
            if self.raced.fetch_add(1, Relaxed) == 0 {
                (self.race)();
            }
            self.inner.complete(slot, install)
        }
    }

    #[test]
    fn a_write_while_the_batch_is_compressed_wins() {
        let data = corpus();
        let store = Arc::new(loose(&data));
        let overwrite = || {
            for i in 0..64u64 {
                let from = (i as usize + 1) * PAGE_SIZE;
                store.write(i, &data[from..from + PAGE_SIZE]).unwrap();
            }
        };
        let racing = Racing {
            inner: HostSlots::new(Algorithm::Lz4, 1, 4096),
            race: &overwrite,
            raced: AtomicU64::new(0),
        };
        let done = store.recompress(batched(&racing)).unwrap();
        assert!(done.raced > 0, "{done:?}");
        assert_eq!(done.raced + done.rewritten + done.kept, done.tried);
        // Pages 0..64 hold what the racing writes put there; the rest, the corpus.
        let mut want = data.clone();
        want.copy_within(PAGE_SIZE..65 * PAGE_SIZE, 0);
        reads_back(&store, &want);
    }

    /// A page discarded and written again while its batch is on the device gets the very
    /// handle its old object had (a raw page has the same length too): the pass must see
    /// that the object is another, and leave the new write.
    #[test]
    fn a_page_freed_and_written_again_on_the_same_handle_keeps_the_new_write() {
        let mut cfg = StoreConfig::new(4, Algorithm::Lz4);
        cfg.raw_threshold = 1024;
        let store = PageStore::new(cfg).unwrap();
        // Half noise, half zeros: LZ4 saves half, above the raw threshold, so stored raw.
        let mut old = noise(1, 0x9e37_79b9_7f4a_7c15);
        old[PAGE_SIZE / 2..].fill(0);
        let new = noise(1, 0x2545_f491_4f6c_dd1d);
        store.write(0, &old).unwrap();
        assert_eq!(store.stats().huge_pages, 1);
        let reuse = || {
            store.discard(0, 1).unwrap();
            store.write(0, &new).unwrap();
        };
        let racing = Racing {
            inner: HostSlots::new(Algorithm::Lz4, 1, 16),
            race: &reuse,
            raced: AtomicU64::new(0),
        };
        let done = store.recompress(batched(&racing)).unwrap();
        assert_eq!(
            (done.tried, done.rewritten, done.raced),
            (1, 0, 1),
            "{done:?}"
        );
        let mut back = vec![0u8; PAGE_SIZE];
        store.read(0, &mut back).unwrap();
        assert!(
            back == new,
            "the discarded page came back in place of the new write"
        );
    }

    /// A page written while its batch is on the device is another page: the pass's verdict
    /// on the old one (kept as it was) must not flag the new one tried.
    #[test]
    fn a_page_written_during_the_batch_is_not_flagged_tried() {
        let store = PageStore::new(StoreConfig::new(4, Algorithm::Lz4)).unwrap();
        let (old, new) = (
            noise(1, 0x2545_f491_4f6c_dd1d),
            noise(1, 0x9e37_79b9_7f4a_7c15),
        );
        store.write(0, &old).unwrap();
        let overwrite = || store.write(0, &new).unwrap();
        let racing = Racing {
            inner: HostSlots::new(Algorithm::Lz4, 1, 16),
            race: &overwrite,
            raced: AtomicU64::new(0),
        };
        let done = store.recompress(batched(&racing)).unwrap();
        assert_eq!((done.tried, done.kept), (1, 1), "{done:?}");
        let plain = HostSlots::new(Algorithm::Lz4, 1, 16);
        let next = store.recompress(batched(&plain)).unwrap();
        assert_eq!(next.tried, 1, "the new page was never tried: {next:?}");
    }
}

/// The dictionary recompressor: liblz4 with the store's dictionary standing in for the
/// GPU's (`HostSlots::load_dictionary`).
#[cfg(test)]
mod dictionary_tests {
    use super::super::dictionary::SAMPLE_BATCH;
    use super::super::tier::tests::{corpus, reads_back};
    use super::*;
    use crate::batch::HostSlots;
    use crate::codec::{train_dictionary, MAX_DICTIONARY_BYTES};
    use crate::page::same_filled_word;
    use crate::store::kept_memory::KeptMemory;
    use crate::store::StoreConfig;

    fn idle_pass(backend: &dyn SlotBackend) -> Recompress<'_> {
        Recompress {
            candidates: Candidates::Idle { min_age: 0 },
            recompressor: Recompressor::Dictionary { backend, slot: 0 },
            threshold: 0,
            max_pages: u64::MAX,
            retry_tried: false,
            priority: None,
        }
    }

    /// A store of the corpus, its dictionary trained on the store's own pages, and a
    /// backend loaded with it.
    fn trained(store: &PageStore) -> HostSlots {
        store.mark_idle(None);
        let samples = store
            .dictionary_samples(Candidates::Idle { min_age: 0 }, 0, 4096, None)
            .unwrap();
        assert!(samples.len() >= 256 * PAGE_SIZE, "{}", samples.len());
        let dict = train_dictionary(&samples, MAX_DICTIONARY_BYTES).unwrap();
        store.set_dictionary(&dict).unwrap();
        let backend = HostSlots::new(Algorithm::Lz4, 1, 64);
        backend.load_dictionary(&dict);
        backend
    }

    #[test]
    fn dictionary_blocks_are_stored_marked_and_read_back_exact() {
        let data = corpus();
        let pages = (data.len() / PAGE_SIZE) as u64;
        let store = PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap();
        store.write(0, &data).unwrap();
        // No dictionary yet: the pass says what is missing.
        let backend = HostSlots::new(Algorithm::Lz4, 1, 64);
        assert!(matches!(
            store.recompress(idle_pass(&backend)),
            Err(CoreError::Config(_))
        ));
        let backend = trained(&store);
        let before = store.stats();
        let done = store.recompress(idle_pass(&backend)).unwrap();
        let after = store.stats();
        assert!(done.rewritten > done.tried / 2, "{done:?}");
        assert_eq!(done.failed, 0, "{done:?}");
        assert_eq!(after.recompressed_pages, done.rewritten);
        assert_eq!(
            before.compr_data_size - after.compr_data_size,
            done.saved_bytes
        );
        reads_back(&store, &data);
        // A recompressed page is no candidate again.
        assert_eq!(store.recompress(idle_pass(&backend)).unwrap().tried, 0);
        // One dictionary per store: the same bytes again are fine, others refused.
        let dict = store.dictionary().unwrap().to_vec();
        store.set_dictionary(&dict).unwrap();
        assert!(store.set_dictionary(&dict[1..]).is_err());
        assert!(
            !store.lose_dictionary(),
            "a store keeps the dictionary it has"
        );
    }

    /// Where most stored pages are zero or young, the samples still come from all the
    /// qualifying ones, as many as asked for.
    #[test]
    fn samples_are_taken_from_the_qualifying_pages_however_few_they_are() {
        let data = corpus();
        let n = (data.len() / PAGE_SIZE) as u64;
        let store = PageStore::new(StoreConfig::new(8 * n, Algorithm::Lz4)).unwrap();
        store.write(0, &data).unwrap();
        store.mark_idle(None);
        // Zero pages (no object) and young copies of the corpus do not qualify.
        store
            .write(n, &vec![0u8; 5 * n as usize * PAGE_SIZE])
            .unwrap();
        store.write(6 * n, &data).unwrap();
        store.write(7 * n, &data).unwrap();
        let idle = Candidates::Idle { min_age: 1 };
        let qualifying = (0..n)
            .filter(|&i| {
                let at = i as usize * PAGE_SIZE;
                let page: &[u8; PAGE_SIZE] = data[at..at + PAGE_SIZE].try_into().unwrap();
                same_filled_word(page).is_none()
            })
            .count();
        let want = qualifying / 2;
        let samples = store.dictionary_samples(idle, 0, want, None).unwrap();
        let got = samples.len() / PAGE_SIZE;
        // Huge pages do not qualify either: most of the corpus still does.
        assert!(got >= want * 9 / 10 && got <= want, "{got} of {want} asked");
    }

    /// The sampling takes every store lock raised, as a pass does (a thread at nice 19
    /// preempted under a shard's lock stalls the writers), raising once a batch of pages
    /// copied out, and ends lowered: the dictionary is trained at the thread's own
    /// priority. It takes the same samples as a sampling with no priority.
    #[test]
    fn the_sampling_looks_pages_up_raised_once_a_batch_and_ends_lowered() {
        let data = corpus();
        let n = (data.len() / PAGE_SIZE) as u64;
        let store = PageStore::new(StoreConfig::new(n, Algorithm::Lz4)).unwrap();
        store.write(0, &data).unwrap();
        store.mark_idle(None);
        let idle = Candidates::Idle { min_age: 0 };
        // All of them, and a stride over them.
        for want in [4 * n as usize, n as usize / 3] {
            let plain = store.dictionary_samples(idle, 0, want, None).unwrap();
            let counted = super::tests::Counted::default();
            let samples = store
                .dictionary_samples(idle, 0, want, Some(&counted))
                .unwrap();
            counted.check_locks_were_raised();
            let pages = (samples.len() / PAGE_SIZE) as u64;
            let raises = counted.raises.get();
            assert!(pages > 256, "{pages} pages sampled of {want}");
            assert!(
                raises >= 1 && raises <= pages.div_ceil(SAMPLE_BATCH as u64) + 1,
                "{raises} raises for {pages} pages sampled"
            );
            assert!(samples == plain, "other samples when raised");
        }
    }

    #[test]
    fn a_store_without_checksums_takes_no_dictionary() {
        let mut cfg = StoreConfig::new(4, Algorithm::Lz4);
        cfg.checksums = false;
        let store = PageStore::new(cfg).unwrap();
        assert!(!store.may_take_dictionary());
        assert!(matches!(
            store.set_dictionary(b"some dictionary"),
            Err(CoreError::Config(_))
        ));
    }

    /// A taken-over store reads its dictionary pages only once it has the dictionary
    /// again; without it, or with another one, those reads fail (I/O errors), every other
    /// page reads as written, and it never returns other data.
    #[test]
    fn a_taken_over_store_needs_its_own_dictionary_back() {
        let data = corpus();
        let pages = (data.len() / PAGE_SIZE) as u64;
        let mut kept = KeptMemory::new(StoreConfig::new(pages, Algorithm::Lz4), 0);
        let store = kept.store();
        store.write(0, &data).unwrap();
        let backend = trained(&store);
        let done = store.recompress(idle_pass(&backend)).unwrap();
        assert!(done.rewritten > 0, "{done:?}");
        let dict = store.dictionary().unwrap().to_vec();
        kept.kill(store);
        let recover = || kept.recover().unwrap().0;
        // Every page either reads exact or fails: count the failures.
        let failures = |store: &PageStore| {
            let mut page = vec![0u8; PAGE_SIZE];
            (0..pages)
                .filter(|&i| match store.read(i, &mut page) {
                    Ok(()) => {
                        let at = i as usize * PAGE_SIZE;
                        assert!(page == data[at..at + PAGE_SIZE], "page {i} read wrong");
                        false
                    }
                    Err(_) => true,
                })
                .count() as u64
        };
        let lost = recover();
        assert!(lost.lose_dictionary());
        assert!(
            lost.set_dictionary(&dict).is_err(),
            "a lost one is not taken back"
        );
        assert_eq!(failures(&lost), done.rewritten);
        drop(lost);
        let other = recover();
        let mut wrong = dict.clone();
        wrong.iter_mut().rev().take(4096).for_each(|b| *b ^= 0x5a);
        other.set_dictionary(&wrong).unwrap();
        let failed = failures(&other);
        assert!(failed > 0 && failed <= done.rewritten, "{failed}");
        assert_eq!(other.stats().checksum_failures, failed);
        drop(other);
        let back = recover();
        back.set_dictionary(&dict).unwrap();
        reads_back(&back, &data);
    }
}

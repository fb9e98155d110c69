//! A write request's pages stored as a batch: compressed first, their room in the arena taken
//! under one acquisition of its lock, their entries swapped under one write lock per run of
//! pages in the same shard, and what they held freed under one more acquisition. A discard's
//! (or zeroes') pages are emptied the same way.
//!
//! Why: page by page, every page took the arena's lock twice (its room, its old object) and
//! its shard's once, and 16 queue threads on 16 cores queued on them: rewrites ran at
//! 0.35–0.44 of the first write's ingest at 2.2–2.4× its CPU per GiB, reads under them at
//! 64–76 µs p99. As batches: 0.91–0.97 of it at 1.07–1.08×, reads at 7–8 µs
//! (docs/bench/gpu-runs.md, run 315). A 64 KiB request is 16 pages in one group, so one shard.

use super::arena::{Budget, ObjectBytes};
use super::entry::Slot;
use super::{
    same_cost, same_filled_word, stored, worker, write_lock, PageCost, PageStore, Payload,
};
use crate::page::PAGE_SIZE;
use crate::CoreError;

/// Pages stored as one batch: a 64 KiB request, a typical swap-out.
pub(crate) const BATCH_PAGES: usize = 16;

/// A page of a batch, encoded.
#[derive(Debug, Clone, Copy)]
enum BatchPage {
    /// Same-filled with a word the store keeps in its entry (or side map).
    Same(u64),
    /// Compressed into the batch buffer's `at..at + len`.
    Compressed {
        at: usize,
        len: usize,
        checksum: u32,
    },
    /// Stored raw: the request's own page.
    Raw { checksum: u32 },
}

/// Page `k` of a batch as [`PageStore::install`] takes it: a fill's word, or its object's
/// bytes (compressed in `buf`, or the raw page in `data`) and checksum.
fn payload<'a>(page: BatchPage, k: usize, data: &'a [u8], buf: &'a [u8]) -> Payload<'a> {
    match page {
        BatchPage::Same(word) => Payload::Same(word),
        BatchPage::Compressed { at, len, checksum } => Payload::Bytes(&buf[at..at + len], checksum),
        BatchPage::Raw { checksum } => {
            Payload::Bytes(&data[k * PAGE_SIZE..(k + 1) * PAGE_SIZE], checksum)
        }
    }
}

impl PageStore {
    /// Stores up to [`BATCH_PAGES`] whole pages from `first`, as [`PageStore::write`] does.
    /// Where a page fails to compress, they are stored page by page instead, so that the
    /// pages before the one that failed are written, as `write` promises.
    pub(super) fn write_batch(&self, first: u64, data: &[u8]) -> Result<(), CoreError> {
        let pages = data.len() / PAGE_SIZE;
        let batched = pages <= BATCH_PAGES && data.len() == pages * PAGE_SIZE;
        let stored = batched && self.store_batch(first, data)?;
        if stored {
            return Ok(());
        }
        for (k, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let page: &[u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            self.write_page(first + k as u64, page)?;
        }
        Ok(())
    }

    /// Compresses the batch's pages into the thread's batch buffer and installs them, all at
    /// once where their room can be had, else one by one. `Ok(false)`: nothing changed (a
    /// page failed to compress), the pages are to be stored one by one.
    fn store_batch(&self, first: u64, data: &[u8]) -> Result<bool, CoreError> {
        let pages = data.len() / PAGE_SIZE;
        worker::with_batch_codec(self.algorithm, |codec, buf| {
            let mut encoded = [BatchPage::Same(0); BATCH_PAGES];
            let mut used = 0;
            let limit = self.raw_threshold.min(PAGE_SIZE);
            for (k, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
                let page: &[u8; PAGE_SIZE] = page
                    .try_into()
                    .map_err(|_| CoreError::Unaligned { len: data.len() })?;
                if let Some(word) = same_filled_word(page).filter(|&w| self.keeps_fill(w)) {
                    encoded[k] = BatchPage::Same(word);
                    continue;
                }
                // Fits: each page before this one compressed to less than `limit`
                // (`worker::BATCH_BYTES`).
                let Some(out) = buf.get_mut(used..used + limit) else {
                    return Ok(false);
                };
                // A codec's error is met again, and returned, page by page below.
                let Ok(compressed) = codec.compress_below(page, out, limit) else {
                    return Ok(false);
                };
                // After the compressor, as `encode` does: the CRC reads the page from cache.
                let checksum = self.checksum_of(page);
                encoded[k] = match compressed {
                    Some(len) => {
                        let at = used;
                        used += len;
                        BatchPage::Compressed { at, len, checksum }
                    }
                    None => BatchPage::Raw { checksum },
                };
            }
            let encoded = &encoded[..pages];
            if !self.install_batch_pages(first, data, buf, encoded)? {
                // Room for them all at once was refused (the memory limit): page by page,
                // each page's old object freed before the next takes room, and the pages
                // before one that fails written, as `write` promises.
                for (k, &page) in encoded.iter().enumerate() {
                    self.install(first + k as u64, payload(page, k, data, buf))?;
                }
            }
            Ok(true)
        })
    }

    /// Takes room for the batch's objects, fills it and swaps the entries. `Ok(false)` when
    /// the memory limit refused the room for all of them: nothing changed.
    fn install_batch_pages(
        &self,
        first: u64,
        data: &[u8],
        buf: &[u8],
        encoded: &[BatchPage],
    ) -> Result<bool, CoreError> {
        // The object bytes and checksum of page `k`; none for a fill.
        let payload = |k: usize| match payload(encoded[k], k, data, buf) {
            Payload::Bytes(bytes, checksum) => Some((bytes, checksum)),
            _ => None,
        };
        let mut lens = [0usize; BATCH_PAGES];
        let mut objects = 0;
        for k in 0..encoded.len() {
            if let Some((bytes, _)) = payload(k) {
                lens[objects] = self.object_len(bytes.len());
                objects += 1;
            }
        }
        let mut handles = [0u64; BATCH_PAGES];
        let budget = Budget::Limited {
            reserved: self.staged_room(),
        };
        if objects > 0 {
            match self
                .arena
                .alloc_many(&lens[..objects], budget, &mut handles[..objects])
            {
                Ok(()) => {}
                // Room for all of them at once may pass the limit where one page at a time,
                // each freeing its old object before the next takes room, does not.
                Err(CoreError::MemLimit { .. }) => return Ok(false),
                // No segment to be had (the block pool dry after its wait): a page alone
                // would wait and fail the same way.
                Err(e) => return Err(e),
            }
        }
        // Each page's slot; the objects take the handles in page order.
        let mut slots = [(Slot::Empty, same_cost()); BATCH_PAGES];
        let mut next = 0;
        for (slot, &e) in slots.iter_mut().zip(encoded) {
            let len = match e {
                BatchPage::Same(word) => {
                    *slot = (Slot::Same(word), same_cost());
                    continue;
                }
                BatchPage::Compressed { len, .. } => len,
                BatchPage::Raw { .. } => PAGE_SIZE,
            };
            *slot = stored(handles[next], len);
            next += 1;
        }
        self.arena.write_many((0..encoded.len()).filter_map(|k| {
            let (bytes, checksum) = payload(k)?;
            let Slot::Stored { handle, .. } = slots[k].0 else {
                return None;
            };
            Some((
                handle,
                ObjectBytes::Bytes(bytes),
                self.trailer(first + k as u64, checksum),
            ))
        }));
        self.swap_batch_entries(first, &slots[..encoded.len()])?;
        Ok(true)
    }

    /// Puts `slots[k]` into page `first + k`, under one write lock per run of pages in the
    /// same shard, then frees what the pages held. On an error (a fill word finding no room
    /// in its shard's side map), the pages before the failing one hold their new slots and
    /// the rest keep their old ones; the new objects of the rest are freed.
    fn swap_batch_entries(&self, first: u64, slots: &[(Slot, PageCost)]) -> Result<(), CoreError> {
        let mut old = [Slot::Empty; BATCH_PAGES];
        let mut held = 0;
        let mut failed = None;
        let mut k = 0;
        'runs: while k < slots.len() {
            let shard_index = self.shard_of(first + k as u64);
            let mut shard = write_lock(&self.shards[shard_index]);
            while k < slots.len() && self.shard_of(first + k as u64) == shard_index {
                let index = first + k as u64;
                let (slot, cost) = slots[k];
                let was = match shard.set(self.locate(index).1, slot) {
                    Ok(Some(was)) => was,
                    Ok(None) => {
                        failed = Some(self.out_of_range(index, 1));
                        break 'runs;
                    }
                    Err(e) => {
                        failed = Some(e);
                        break 'runs;
                    }
                };
                if let Some(was) = self.replaced(&mut shard, index, was, cost) {
                    old[held] = was;
                    held += 1;
                }
                k += 1;
            }
        }
        // Never under a shard's lock: compaction takes the arena's lock before the shards'.
        self.free_slots(&old[..held]);
        match failed {
            None => Ok(()),
            Some(e) => {
                let mut unused = [Slot::Empty; BATCH_PAGES];
                for (u, &(slot, _)) in unused.iter_mut().zip(&slots[k..]) {
                    *u = slot;
                }
                self.free_slots(&unused[..slots.len() - k]);
                Err(e)
            }
        }
    }
}

impl PageStore {
    /// Empties `count` pages from `first` (a discard, or zeroes written), under one write
    /// lock per run of pages in the same shard, and frees what they held under one
    /// acquisition of the arena's lock per [`FREED_AT_ONCE`] objects. Returns how many of
    /// them held data. Page by page, a discard of a swap cluster (hundreds of pages) took
    /// the arena's lock once a page, as writes did.
    pub(super) fn empty_pages(&self, first: u64, count: u64) -> Result<u64, CoreError> {
        let end = first.saturating_add(count);
        let mut freed = [Slot::Empty; FREED_AT_ONCE];
        let mut nfreed = 0;
        let mut held = 0;
        let mut index = first;
        while index < end {
            let shard_index = self.shard_of(index);
            let mut shard = write_lock(&self.shards[shard_index]);
            while index < end && self.shard_of(index) == shard_index && nfreed < freed.len() {
                // An empty slot needs no side map: only a page out of range fails here.
                let Ok(Some(was)) = shard.set(self.locate(index).1, Slot::Empty) else {
                    drop(shard);
                    self.free_slots(&freed[..nfreed]);
                    return Err(self.out_of_range(index, 1));
                };
                held += u64::from(was != Slot::Empty);
                if let Some(was) = self.replaced(&mut shard, index, was, PageCost::default()) {
                    freed[nfreed] = was;
                    nfreed += 1;
                }
                index += 1;
            }
            drop(shard);
            // Never under a shard's lock: compaction takes the arena's lock before the shards'.
            if nfreed == freed.len() {
                self.free_slots(&freed);
                nfreed = 0;
            }
        }
        self.free_slots(&freed[..nfreed]);
        Ok(held)
    }
}

/// Objects an emptying frees under one acquisition of the arena's lock (kept on the stack:
/// the I/O path allocates nothing).
const FREED_AT_ONCE: usize = 64;

#[cfg(test)]
mod tests {
    use super::BATCH_PAGES;
    use crate::codec::Algorithm;
    use crate::page::{fill_page, PAGE_SIZE};
    use crate::store::tests::{locks_taken, noise_page, read_page, store, text_page};
    use crate::store::{PageStore, StoreConfig};
    use crate::CoreError;

    /// A request's pages of every kind: fills (zero and not), compressible, incompressible.
    fn mixed(pages: usize, seed: u64) -> Vec<u8> {
        let mut data = vec![0u8; pages * PAGE_SIZE];
        for (k, page) in data.chunks_exact_mut(PAGE_SIZE).enumerate() {
            let page: &mut [u8; PAGE_SIZE] = page.try_into().unwrap();
            let n = seed + k as u64;
            match n % 4 {
                0 => fill_page(
                    page,
                    n.wrapping_mul(0x0101_0101_0101_0101) & (u64::MAX >> (n % 3)),
                ),
                1 => *page = text_page(n as u8),
                2 => *page = noise_page(n),
                _ => {}
            }
        }
        data
    }

    fn pages_of(store: &PageStore, first: u64, count: usize) -> Vec<u8> {
        let mut out = vec![0u8; count * PAGE_SIZE];
        store.read(first, &mut out).unwrap();
        out
    }

    #[test]
    fn a_batch_leaves_the_store_as_its_pages_written_one_at_a_time() {
        let batched = store(256);
        let single = store(256);
        // Aligned, then across two groups (two shards), then over both with one page short.
        for (first, pages, seed) in [(0u64, 16, 1), (8, 16, 7), (3, 15, 20), (16, 16, 33)] {
            let data = mixed(pages, seed);
            batched.write(first, &data).unwrap();
            for (k, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
                single.write(first + k as u64, page).unwrap();
            }
            assert_eq!(pages_of(&batched, 0, 40), pages_of(&single, 0, 40));
            assert_eq!(pages_of(&batched, first, pages), data);
            let (b, s) = (batched.stats(), single.stats());
            assert_eq!(
                (
                    b.pages_stored,
                    b.same_pages,
                    b.huge_pages,
                    b.compr_data_size
                ),
                (
                    s.pages_stored,
                    s.same_pages,
                    s.huge_pages,
                    s.compr_data_size
                )
            );
            assert_eq!(batched.arena.usage().objects, single.arena.usage().objects);
        }
        // Every object the batches replaced was freed: fills over all of them leave none.
        batched.write(0, &vec![0u8; 40 * PAGE_SIZE]).unwrap();
        assert_eq!(batched.arena.usage().objects, 0);
        assert_eq!(batched.stats().pages_stored, 40);
    }

    #[test]
    fn an_aligned_request_takes_its_shards_lock_once() {
        let store = store(1024);
        let data = mixed(BATCH_PAGES, 5);
        let before = locks_taken();
        store.write(32, &data).unwrap();
        assert_eq!(locks_taken() - before, 1);
        // Overwritten: still once (the old objects are freed after the shard's lock).
        let before = locks_taken();
        store.write(32, &mixed(BATCH_PAGES, 9)).unwrap();
        assert_eq!(locks_taken() - before, 1);
        assert_eq!(pages_of(&store, 32, BATCH_PAGES), mixed(BATCH_PAGES, 9));
    }

    /// A discard of a swap cluster's worth of pages (every kind of content, several shards,
    /// more objects than are freed at once) frees them all, counts those that held data,
    /// and takes a shard's lock once a run of its pages, not once a page.
    #[test]
    fn a_long_discard_frees_everything_under_few_locks() {
        let store = store(1024);
        let data = mixed(BATCH_PAGES * 16, 3);
        store.write(0, &data).unwrap();
        assert!(store.arena.usage().objects > super::FREED_AT_ONCE as u64);
        let (first, count) = (5u64, 256 - 5 + 40);
        let before = locks_taken();
        store.discard(first, count).unwrap();
        let locks = locks_taken() - before;
        // 19 groups touched, and a lock again after each 64 objects freed.
        assert!((19..=19 + 8).contains(&locks), "{locks} shard locks");
        // Every written page held something (a zero page its fill); the 40 past them none.
        assert_eq!(store.stats().notify_free, 256 - first);
        let left = store.arena.usage().objects;
        let left_pages = (0..first)
            .filter(|&p| {
                let page = &data[p as usize * PAGE_SIZE..(p as usize + 1) * PAGE_SIZE];
                crate::page::same_filled_word(page.try_into().unwrap()).is_none()
            })
            .count() as u64;
        assert_eq!(left, left_pages);
        assert_eq!(
            pages_of(&store, first, count as usize),
            vec![0u8; count as usize * PAGE_SIZE]
        );
        assert_eq!(
            pages_of(&store, 0, first as usize),
            data[..first as usize * PAGE_SIZE]
        );
        store.write_zeroes(0, first).unwrap();
        assert_eq!(store.arena.usage().objects, 0);
        assert_eq!(store.stats().pages_stored, 0);
    }

    #[test]
    fn a_batch_that_meets_the_limit_writes_the_pages_before_the_failing_one() {
        let probe = store(64);
        let mut cfg = StoreConfig::new(64, Algorithm::Lz4);
        cfg.mem_limit = Some(probe.stats().mem_used_total + 70 * 1024);
        let store = PageStore::new(cfg).unwrap();
        let old = mixed(BATCH_PAGES, 1);
        let noise: Vec<u8> = (0..BATCH_PAGES as u64)
            .flat_map(|k| noise_page(k + 100))
            .collect();
        store.write(16, &old).unwrap();
        let err = store.write(16, &noise).unwrap_err();
        assert!(matches!(err, CoreError::MemLimit { .. }), "{err}");
        let written = (0..BATCH_PAGES)
            .take_while(|&k| read_page(&store, 16 + k as u64) == noise_page(k as u64 + 100))
            .count();
        assert!((4..BATCH_PAGES).contains(&written), "{written}");
        // The rest kept their old content.
        assert_eq!(
            pages_of(&store, 16 + written as u64, BATCH_PAGES - written),
            old[written * PAGE_SIZE..]
        );
        let stats = store.stats();
        assert!(stats.mem_used_total <= stats.mem_limit);
        assert_eq!(stats.pages_stored, BATCH_PAGES as u64);
    }
}

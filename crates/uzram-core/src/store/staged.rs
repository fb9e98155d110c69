//! Deferred writes: a page's bytes wait uncompressed in a staging slot (a GPU's pinned
//! memory) while a backend compresses them, and the result is installed later.
//!
//! [`PageStore::stage`] records where the bytes wait (the entry says slot, index and the
//! slot's fill epoch); reads of such a page copy it out of the [`StagedPages`] memory
//! attached with [`PageStore::attach_staging`]; [`PageStore::commit`] installs the
//! compressed form only while the entry still names exactly that staged copy, so a write,
//! discard or write-zeroes in between always wins. The store knows nothing about batches or
//! backends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arena::{Budget, ObjectBytes, Placement, Replaced};
use super::entry::{Slot, StagedAt};
use super::stats::{Counters, PageCost};
use super::{cost_of, same_cost, stored, try_vec, write_lock, PageStore};
use crate::batch::Placer;
use crate::page::{fill_page, PAGE_SIZE, PAGE_WORDS};
use crate::CoreError;

/// Where the store reads a staged page while it waits for its compressed form: the
/// staging memory of whatever stages pages (a GPU's pinned slots).
pub trait StagedPages: Send + Sync {
    /// Copies `page`, staged at `at`, into `out`. False if `at` does not hold that page
    /// (a corrupt entry: the read fails with an error instead of returning other data),
    /// or if the copy does not match the checksum its writer recorded.
    fn read_staged(&self, page: u64, at: StagedAt, out: &mut [u8; PAGE_SIZE]) -> bool;
}

/// One staged write: see [`PageStore::stage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// The page written.
    pub page: u64,
    /// Where its bytes wait.
    pub at: StagedAt,
}

/// What a staged page became, for [`PageStore::commit`].
#[derive(Debug, Clone, Copy)]
pub enum Encoded<'a> {
    /// The page is one `u64` word repeated; no payload is stored.
    SameFilled(u64),
    /// The page's compressed form (1..4096 bytes, in the store's algorithm).
    Compressed(&'a [u8]),
    /// The page did not compress below the threshold: these are its bytes.
    Raw(&'a [u8; PAGE_SIZE]),
    /// The page did not compress below the threshold, and these [`PAGE_WORDS`] words (the
    /// staging slot's copy, little-endian) are its bytes: stored raw straight from them,
    /// with no bounce through a page buffer. Nothing may write them during the commit.
    RawWords(&'a [AtomicU64]),
}

/// How one [`Commit`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommitState {
    /// Not done yet (a failed [`PageStore::commit`] leaves the rest in this state).
    #[default]
    Waiting,
    /// Installed: the page now holds the result.
    Installed,
    /// The page changed after it was staged (a later write, discard or write-zeroes); the
    /// result was dropped.
    Stale,
}

/// One result to install: see [`PageStore::commit`].
#[derive(Debug, Clone, Copy)]
pub struct Commit<'a> {
    /// The staged write this result belongs to.
    pub ticket: Ticket,
    /// The result.
    pub encoded: Encoded<'a>,
    /// The checksum of the page as its writer handed it over
    /// ([`crate::page::page_checksum`]), stored with the result (unused for a same-filled
    /// page).
    pub checksum: u32,
    /// Set by [`PageStore::commit`].
    pub state: CommitState,
}

impl<'a> Commit<'a> {
    /// A result waiting to be installed, for the page whose checksum is `checksum`.
    pub fn new(ticket: Ticket, encoded: Encoded<'a>, checksum: u32) -> Self {
        Self {
            ticket,
            encoded,
            checksum,
            state: CommitState::Waiting,
        }
    }
}

/// What writing a commit's objects into the arena cost ([`PageStore::commit_with`]): the GPU
/// ring's installers count it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyCost {
    /// Time spent writing the objects into the arena: the CPU's copies, and the wait for the
    /// copy engine's.
    pub copying: Duration,
    /// Bytes the backend's copy engine placed.
    pub placed_bytes: u64,
    /// Its copies (each a run of objects).
    pub placed_runs: u64,
    /// Whether the copy engine failed, or wrote what the host's copy does not hold (the CPU
    /// then wrote those objects).
    pub place_failed: bool,
}

/// Deferred writes.
impl PageStore {
    /// Attaches the memory staged pages are read from (once; a second call fails).
    pub fn attach_staging(&self, staging: Arc<dyn StagedPages>) -> Result<(), CoreError> {
        self.staging
            .set(staging)
            .map_err(|_| CoreError::Config("staging memory is already attached".into()))
    }

    /// Records that `page`'s new content waits uncompressed at `at` in the attached
    /// staging memory (the caller copied it there and keeps it until the ticket's
    /// [`PageStore::commit`]). From now on reads of the page copy from there. Under a
    /// memory limit the page holds a whole page of room until it is installed; when that
    /// room is not there the write fails with `MemLimit` and the page is unchanged.
    pub fn stage(&self, page: u64, at: StagedAt) -> Result<Ticket, CoreError> {
        self.stage_many(&[(page, at)])?;
        Ok(Ticket { page, at })
    }

    /// [`PageStore::stage`] for several `(page, at)` at once, all or nothing: the pages of
    /// one shard are staged under one acquisition of its lock (a 64 KiB request is one
    /// shard), and the memory limit is checked once for all of them.
    pub fn stage_many(&self, items: &[(u64, StagedAt)]) -> Result<(), CoreError> {
        self.stage_many_replacing(items, None)
    }

    /// [`PageStore::stage_many`]; with `replaced` (as long as `items`), the arena objects
    /// the pages held are not freed but put there, at their item's place (`None` where a
    /// page held none), for [`PageStore::free_replaced`]. A GPU ring gives them back a
    /// slot at a time, so its writers never take the arena's lock.
    pub(crate) fn stage_many_replacing(
        &self,
        items: &[(u64, StagedAt)],
        mut replaced: Option<&mut [Option<Replaced>]>,
    ) -> Result<(), CoreError> {
        if replaced.as_ref().is_some_and(|r| r.len() < items.len()) {
            return Err(CoreError::Config(
                "no room to keep the objects staged pages replace".into(),
            ));
        }
        for &(page, _) in items {
            self.check_range(page, 1)?;
        }
        if self.staging.get().is_none() {
            return Err(CoreError::Config(
                "no staging memory is attached to stage pages in".into(),
            ));
        }
        let n = items.len() as u64;
        if let Some(limit) = self.mem_limit {
            // The room is taken before it is checked, so that stagers on other threads count
            // it: checked first and taken after, each of them could pass the limit by its
            // request. Room taken for a page that was already staged is given back below.
            // Two stagers that find room for one of them between them may then both be
            // refused: on the safe side (the kernel writes again).
            self.staged.fetch_add(n, Ordering::Relaxed);
            let used = self.limited_bytes();
            if used > limit {
                self.staged.fetch_sub(n, Ordering::Relaxed);
                return Err(CoreError::MemLimit {
                    limit,
                    used: used.saturating_sub(n * super::STAGED_PAGE_ROOM),
                });
            }
        }
        let staged_cost = PageCost {
            stored: true,
            staged: true,
            ..PageCost::default()
        };
        // Old contents to free after the locks (a handful at a time: no allocation). Never
        // under a shard's lock: compaction takes the arena's lock before the shards'.
        let mut freed = [Slot::Empty; 16];
        let mut nfreed = 0;
        let mut start = 0;
        while start < items.len() {
            let shard_index = self.shard_of(items[start].0);
            let end = items[start..]
                .iter()
                .position(|&(p, _)| self.shard_of(p) != shard_index)
                .map_or(items.len(), |k| start + k);
            let mut shard = write_lock(&self.shards[shard_index]);
            let mut newly = 0u64;
            let mut next = end;
            for (k, &(page, at)) in items.iter().enumerate().take(end).skip(start) {
                if nfreed == freed.len() {
                    // Freed after the lock; the rest of the shard's pages under it again.
                    next = k;
                    break;
                }
                let idx = self.locate(page).1;
                // A staged slot needs no side map, so `set` cannot fail here.
                let Ok(Some(old)) = shard.set(idx, Slot::Staged(at)) else {
                    continue;
                };
                shard.totals.replace(cost_of(old), staged_cost);
                self.ages.written(page);
                newly += u64::from(!matches!(old, Slot::Staged(_)));
                let kept = self.keep_replaced(old, replaced.as_deref_mut().map(|r| &mut r[k]));
                if !kept && self.holds_room(old) {
                    freed[nfreed] = old;
                    nfreed += 1;
                }
            }
            // The room taken above for pages that were staged already (or not set) given
            // back under the lock, as a rewrite that takes a staged page off counts it
            // under the lock: the count never falls below the pages staged, so such a
            // rewrite cannot wrap it.
            let done = (next - start) as u64;
            if self.mem_limit.is_some() && done > newly {
                self.staged.fetch_sub(done - newly, Ordering::Relaxed);
            }
            drop(shard);
            if nfreed == freed.len() {
                self.free_slots(&freed);
                nfreed = 0;
            }
            start = next;
        }
        self.free_slots(&freed[..nfreed]);
        Counters::bump(&self.counters.writes, n);
        Ok(())
    }

    /// Gives back the room of objects [`PageStore::stage_many_replacing`] kept, under one
    /// acquisition of the arena's lock.
    pub(crate) fn free_replaced(&self, objects: impl IntoIterator<Item = Replaced>) {
        self.arena.free_replaced(objects);
    }

    /// Installs the results of staged writes: each one only if its page still holds
    /// exactly the staged copy its ticket names (else it is stale and dropped). Arena room
    /// for all of them is reserved under one lock and filled without any; then each shard's
    /// entries are swapped under one write lock, so readers of a shard wait for a few entry
    /// swaps only.
    ///
    /// Room under the memory limit was taken when each page was staged, so this never
    /// fails with `MemLimit`. It fails with `NoMemory` when the allocator has no segment to
    /// give (nothing is installed then), or when a fill word found no room in the side map;
    /// the commits already done say `Installed` or `Stale`, the rest stay `Waiting` and can
    /// be retried. The order of `commits` is changed.
    pub fn commit(&self, commits: &mut [Commit<'_>]) -> Result<(), CoreError> {
        self.commit_with(commits, None, None)
    }

    /// [`Self::commit`], with the results' compressed blocks placed by `placer` (a backend's
    /// copy engine) where it can, and what the objects' copy into the arena cost added to
    /// `cost`. With a placer, objects go to the arena's frontier in the order of `commits`:
    /// sorted by where their blocks lie in the slot's packed results, runs of them are one
    /// copy each.
    pub fn commit_with(
        &self,
        commits: &mut [Commit<'_>],
        cost: Option<&mut CopyCost>,
        placer: Option<&dyn Placer>,
    ) -> Result<(), CoreError> {
        for c in commits.iter() {
            self.check_range(c.ticket.page, 1)?;
            match c.encoded {
                Encoded::Compressed(bytes) if bytes.is_empty() || bytes.len() >= PAGE_SIZE => {
                    return Err(CoreError::Config(format!(
                        "page {}: a compressed result of {} bytes",
                        c.ticket.page,
                        bytes.len()
                    )));
                }
                Encoded::RawWords(words) if words.len() != PAGE_WORDS => {
                    return Err(CoreError::Config(format!(
                        "page {}: a raw page of {} words",
                        c.ticket.page,
                        words.len()
                    )));
                }
                _ => {}
            }
        }
        for c in commits.iter_mut() {
            if let (CommitState::Waiting, Encoded::SameFilled(word)) = (c.state, c.encoded) {
                if !self.keeps_fill(word) {
                    c.state = self.commit_fill_compressed(c.ticket, word)?;
                }
            }
        }
        // Installers run on the swap I/O path: their allocations fail, they never abort.
        // Space is taken and filled in the caller's order (a slot's, in which the backend
        // packed its results): both sides of the copies are then read and written in order.
        let mut lens = try_vec(commits.len())?;
        lens.extend(
            commits
                .iter()
                .filter_map(|c| payload(c).map(|p| self.object_len(p.len()))),
        );
        let mut handles = try_vec(lens.len())?;
        handles.resize(lens.len(), 0u64);
        let mut slots = try_vec(commits.len())?;
        let mut unused = try_vec(commits.len())?;
        // Every allocation that can fail comes before the arena's: objects reserved and then
        // left by an error would be neither published nor freed (counted against mem-limit,
        // and compaction, which waits for the arena's objects to match the table's, would
        // never run again).
        let (order, shards) = self.shard_order(commits)?;
        // The objects the placer holds go to the arena in order, the others anywhere. Room
        // for that list and the placed objects' list comes before the arena's allocation (as
        // above); without it the CPU copies them all. While holes pile up (overwrites), all
        // go anywhere, into the holes, and the CPU copies them.
        let placer = placer.filter(|_| self.arena.may_place_in_order());
        let mut placing = match placer {
            Some(p) => match (try_vec(lens.len()), try_vec::<bool>(lens.len())) {
                (Ok(list), Ok(mut marks)) => {
                    marks.extend(commits.iter().filter_map(|c| {
                        payload(c).map(|b| match b {
                            ObjectBytes::Bytes(bytes) => p.packed_offset(bytes).is_some(),
                            ObjectBytes::Words(_) => false,
                        })
                    }));
                    Some((p, list, marks))
                }
                _ => None,
            },
            None => None,
        };
        let order_in_arena = match &placing {
            Some((_, _, marks)) => Placement::InOrder(marks),
            None => Placement::Anywhere,
        };
        self.arena
            .alloc_many_placed(&lens, Budget::Reserved, order_in_arena, &mut handles)?;
        let copy_start = cost.is_some().then(Instant::now);
        let objects =
            handles
                .iter()
                .copied()
                .zip(commits.iter().filter_map(|c| {
                    payload(c).map(|p| (p, self.trailer(c.ticket.page, c.checksum)))
                }))
                .map(|(h, (p, t))| (h, p, t));
        let placed = match placing.as_mut() {
            Some((placer, list, _)) => {
                list.extend(objects);
                Some(self.arena.write_many_placing(list, *placer))
            }
            None => {
                self.arena.write_many(objects);
                None
            }
        };
        if let Some(cost) = cost {
            if let Some(start) = copy_start {
                cost.copying = cost.copying.saturating_add(start.elapsed());
            }
            if let Some(p) = placed {
                cost.placed_bytes += p.bytes;
                cost.placed_runs += p.runs;
                cost.place_failed |= p.mismatched || p.refused;
            }
        }
        let mut next = handles.iter();
        slots.extend(commits.iter().map(|c| match (c.state, c.encoded) {
            (CommitState::Waiting, Encoded::SameFilled(word)) => {
                Some((Slot::Same(word), same_cost()))
            }
            _ => payload(c).map(|p| stored(next.next().copied().unwrap_or_default(), p.len())),
        }));
        let mut start = 0;
        while start < order.len() {
            let shard = shards[order[start] as usize];
            let end = order[start..]
                .iter()
                .position(|&i| shards[i as usize] != shard)
                .map_or(order.len(), |n| start + n);
            self.commit_shard(commits, &mut slots, &order[start..end], &mut unused);
            start = end;
        }
        self.arena
            .free_many(unused.into_iter().filter_map(|s| self.stored_object(s)));
        if commits.iter().any(|c| c.state == CommitState::Waiting) {
            return Err(CoreError::NoMemory);
        }
        Ok(())
    }

    /// The indices of `commits` grouped by shard, so that each shard is locked once, and
    /// each commit's shard. A counting sort: an installer's chunk is a thousand pages over
    /// every shard, and a comparison sort of it took 7 % of the installers' time
    /// (docs/gpu.md).
    pub(super) fn shard_order(
        &self,
        commits: &[Commit<'_>],
    ) -> Result<(Vec<u32>, Vec<u32>), CoreError> {
        let mut starts = try_vec::<u32>(self.shards.len() + 1)?;
        starts.resize(self.shards.len() + 1, 0);
        let mut shards = try_vec::<u32>(commits.len())?;
        for c in commits {
            let shard = self.shard_of(c.ticket.page);
            shards.push(shard as u32);
            starts[shard + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut order = try_vec::<u32>(commits.len())?;
        order.resize(commits.len(), 0);
        for (i, &shard) in shards.iter().enumerate() {
            let at = &mut starts[shard as usize];
            order[*at as usize] = i as u32;
            *at += 1;
        }
        Ok((order, shards))
    }

    /// Swaps in the prepared slots of one shard's commits (`group`: their indices) under
    /// its write lock; slots that are not installed go to `unused` (their arena room is
    /// freed by the caller).
    fn commit_shard(
        &self,
        commits: &mut [Commit<'_>],
        slots: &mut [Option<(Slot, PageCost)>],
        group: &[u32],
        unused: &mut Vec<Slot>,
    ) {
        let Some(first) = group.first().and_then(|&i| commits.get(i as usize)) else {
            return;
        };
        let (shard, _) = self.locate(first.ticket.page);
        let mut shard = write_lock(shard);
        // One update of the shared count per group: it is a cache line every writer and
        // installer touches.
        let mut settled = 0u64;
        for &i in group {
            let (Some(c), Some(prepared)) =
                (commits.get_mut(i as usize), slots.get_mut(i as usize))
            else {
                continue;
            };
            let Some((slot, cost)) = prepared.take() else {
                continue;
            };
            let idx = self.locate(c.ticket.page).1;
            if !shard.is_staged_at(idx, c.ticket.at) {
                c.state = CommitState::Stale;
                unused.push(slot);
                continue;
            }
            match shard.set(idx, slot) {
                Ok(Some(old)) => {
                    shard.totals.replace(cost_of(old), cost);
                    settled += 1;
                    c.state = CommitState::Installed;
                }
                // Out of range cannot happen (checked by `commit`); a fill word with no
                // room in the side map keeps the staged copy, still right, for a retry.
                Ok(None) | Err(_) => unused.push(slot),
            }
        }
        drop(shard);
        if self.mem_limit.is_some() && settled > 0 {
            self.staged.fetch_sub(settled, Ordering::Relaxed);
        }
    }

    /// Commits a staged page that turned out to be filled with a word this store does not
    /// keep as such ([`PageStore::keeps_fill`]): compressed on this thread instead.
    fn commit_fill_compressed(&self, ticket: Ticket, word: u64) -> Result<CommitState, CoreError> {
        let mut page = [0u8; PAGE_SIZE];
        fill_page(&mut page, word);
        self.commit_encoded(ticket, &page)
    }

    /// Commits `ticket`'s page from its bytes, compressed on this thread (raw when it does
    /// not compress below the threshold).
    pub(super) fn commit_encoded(
        &self,
        ticket: Ticket,
        page: &[u8; PAGE_SIZE],
    ) -> Result<CommitState, CoreError> {
        self.encode(page, |compressed, checksum| {
            let encoded = compressed.map_or(Encoded::Raw(page), Encoded::Compressed);
            let mut one = [Commit::new(ticket, encoded, checksum)];
            self.commit(&mut one)?;
            Ok(one[0].state)
        })
    }
}

/// The bytes a waiting commit puts in the arena: none for a fill word, or once it is settled.
fn payload<'a>(c: &Commit<'a>) -> Option<ObjectBytes<'a>> {
    match (c.state, c.encoded) {
        (CommitState::Waiting, Encoded::Compressed(bytes)) => Some(ObjectBytes::Bytes(bytes)),
        (CommitState::Waiting, Encoded::Raw(page)) => Some(ObjectBytes::Bytes(&page[..])),
        (CommitState::Waiting, Encoded::RawWords(words)) => Some(ObjectBytes::Words(words)),
        _ => None,
    }
}

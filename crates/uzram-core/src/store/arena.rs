//! The compressed-data arena: size classes over one shared, segmented bump region.
//!
//! Every object is rounded up to a size class of [`CLASS_GRANULE`] bytes (1..=513 classes
//! for 8..=4104 bytes: a raw page and its checksum is the largest object). A freed object
//! becomes a free hole, merged with the holes beside it (`arena/holes.rs`); a hole of an
//! object's class is handed out first, then the frontier of the newest segment, then the
//! front of the smallest larger hole.
//!
//! Why not one slab chain per class, as zsmalloc does: with ~500 classes each holding a
//! partly filled slab, a 64 MiB working set loses several percent to half-empty slabs.
//! Here all classes share the segments, so the only partly filled memory is the
//! frontier's segment, and rounding costs < 8 bytes per object.
//!
//! Locking: the bookkeeping (free lists, frontier, counters) sits behind one short mutex.
//! The bytes sit in segments of atomic words: an object is written once, before its
//! page entry is published under a shard lock, and copied out by readers that hold that
//! shard lock, so copies need no lock of their own and threads that fill the same
//! segment never wait for each other. Segments are found through `segments.rs`, where
//! each has a lock of its own that only its creation and release take for writing.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::entry::HANDLE_ALIGN;
use super::persist::SegmentHome;
use super::segments::{Segment, SegmentTable, SEGMENT_SIZE};
use super::words;
use crate::page::PAGE_SIZE;
use crate::CoreError;

#[cfg(test)]
mod coalescing_tests;
mod holes;
mod placing;
mod replaced;

#[cfg(test)]
pub(crate) use holes::CHUNK_GROWTH_BYTES;
pub(crate) use holes::TABLE_BYTES_PER_SEGMENT;
use holes::{Holes, NotFreed};
use replaced::Deferred;
pub(crate) use replaced::Replaced;

#[cfg(test)]
thread_local! {
    /// Acquisitions of an arena's lock on this thread (test hook).
    static LOCKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Acquisitions of an arena's lock on this thread so far (test hook).
#[cfg(test)]
pub(crate) fn locks_taken() -> u64 {
    LOCKS.with(std::cell::Cell::get)
}

/// Size-class granularity in bytes.
pub(crate) const CLASS_GRANULE: usize = HANDLE_ALIGN as usize;
/// Bytes of the checksum the store keeps after an object's payload (`store/mod.rs`).
pub(crate) const CHECKSUM_BYTES: usize = 4;
/// The largest object: a raw page and its checksum.
pub(crate) const MAX_OBJECT: usize = PAGE_SIZE + CHECKSUM_BYTES;
const CLASSES: usize = MAX_OBJECT.div_ceil(CLASS_GRANULE) + 1;
/// Raw pages (with checksums) one segment holds: a raw page's object takes its class's
/// bytes (4104), so 15 a segment, not 16; the tail is a hole no raw page fits.
pub const RAW_PAGES_PER_SEGMENT: usize =
    SEGMENT_SIZE / (MAX_OBJECT.div_ceil(CLASS_GRANULE) * CLASS_GRANULE);
const BITMAP_WORDS: usize = CLASSES.div_ceil(64);

/// An object's bytes on their way into the arena.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ObjectBytes<'a> {
    Bytes(&'a [u8]),
    /// Little-endian words: `len() * 8` bytes.
    Words(&'a [AtomicU64]),
}

impl ObjectBytes<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            ObjectBytes::Bytes(b) => b.len(),
            ObjectBytes::Words(w) => w.len() * 8,
        }
    }
}

/// The class of an object of `len` bytes (1..=MAX_OBJECT).
fn class_of(len: usize) -> usize {
    len.div_ceil(CLASS_GRANULE)
}

/// Whether an allocation is held to the memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Budget {
    /// Held to the limit, counting `reserved` more bytes as already used (the room the
    /// store keeps for staged pages that have not been installed yet).
    Limited {
        /// Bytes promised to staged pages.
        reserved: u64,
    },
    /// Not checked: the room was reserved when the page was staged.
    Reserved,
}

/// Where an allocation's objects may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement<'a> {
    /// A free hole of the object's class first, else the frontier, else part of a larger
    /// hole: the least memory.
    Anywhere,
    /// The objects marked `true` at the frontier, one after another, so that objects a copy
    /// engine packed next to each other land next to each other, one copy a run
    /// (`batch/place.rs`); the others `Anywhere`. Where an object (marked or
    /// not) does not fit the rest of the frontier's segment, that rest is first filled with
    /// marked objects from the end of the list that fit (each then a copy of its own), so
    /// that the order costs little memory: without it, the tail of every segment was a
    /// hole, and a GPU store held up to 3 % more memory (docs/bench/gpu-runs.md, run 307).
    InOrder(&'a [bool]),
}

/// How many objects from the end of an in-order list [`Placement::InOrder`] weighs to fill a
/// segment's tail: on the mixed-swap corpus (`lz4_flex` blocks, slots of 2,048 pages), 64 left
/// 46 % more bytes in holes than 256; the search runs under the bookkeeping lock, a few
/// hundred lengths compared.
const TAIL_FILL_LOOKBACK: usize = 256;

/// In-order allocation ([`Placement::InOrder`]) takes no hole: a store whose pages are
/// overwritten while writes never pause (compaction waits for a pause) would grow by every
/// overwrite. Past this share of its segments in holes (1/32), objects go `Anywhere` until
/// the holes are taken again.
const IN_ORDER_HOLE_SHARE: u64 = 32;

/// Counters read by the store's stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ArenaUsage {
    /// Memory the arena holds: segments plus its own bookkeeping.
    pub held_bytes: u64,
    /// The highest `held_bytes` so far.
    pub max_held_bytes: u64,
    /// Bytes in segments.
    pub segment_bytes: u64,
    /// Live objects.
    pub objects: u64,
    /// Bytes of live objects after rounding to their class.
    pub class_bytes: u64,
    /// Bytes on free lists (holes that the next objects of their class reuse).
    pub free_bytes: u64,
    /// Pages' worth of segments released by compaction (cumulative).
    pub compacted_pages: u64,
}

#[derive(Debug)]
struct Meta {
    /// Next unused byte of the newest segment (global offset).
    frontier: u64,
    /// Segments allocated (mirror of `segments.len()`, readable without that lock).
    segments: usize,
    /// The free holes.
    holes: Holes,
    objects: u64,
    class_bytes: u64,
    max_held: u64,
    /// Pages' worth of segments released by compaction (cumulative).
    compacted_pages: u64,
    /// Free ranges an adoption found and has not made holes yet
    /// ([`Arena::link_adopted_holes`]), and their bytes. Making one a hole is table and list
    /// work under the bookkeeping lock, and may allocate: a recovery's thousands of them
    /// are made a few at a time, not while its first I/O waits.
    adopted_holes: Vec<(u64, u64)>,
    adopted_hole_bytes: u64,
}

impl Meta {
    /// Forgets every hole and the holes' memory (the segments are gone).
    fn clear_free(&mut self) {
        self.holes.clear();
        self.forget_adopted_holes();
    }

    fn forget_adopted_holes(&mut self) {
        self.adopted_holes = Vec::new();
        self.adopted_hole_bytes = 0;
    }

    /// Room for an object of `class` without growing: a hole of that class, the frontier
    /// of the newest segment, or the front of a larger hole (its rest stays a hole).
    fn take(&mut self, class: usize) -> Option<u64> {
        if let Some(h) = self.holes.take_exact(class) {
            return Some(h);
        }
        if let Some(h) = self.take_frontier(class) {
            return Some(h);
        }
        self.holes.take_larger(class)
    }

    /// Room for an object of `class` at the frontier of the newest segment, if it fits.
    fn take_frontier(&mut self, class: usize) -> Option<u64> {
        let size = (class * CLASS_GRANULE) as u64;
        let fits = self.frontier % SEGMENT_SIZE as u64 + size <= SEGMENT_SIZE as u64
            && self.frontier + size <= (self.segments * SEGMENT_SIZE) as u64;
        fits.then(|| {
            let h = self.frontier;
            self.frontier += size;
            h
        })
    }

    /// Makes `size` bytes at `at` a free hole; where that fails, they stay unused until a
    /// compaction lays the arena out anew. Room that ends at the frontier goes back to it,
    /// with the hole before it, if any: a hole there would only split the frontier's room.
    fn free(&mut self, segments: &SegmentTable, at: u64, size: u64) {
        let in_last_segment = (at / SEGMENT_SIZE as u64 + 1) as usize == self.segments;
        if at + size == self.frontier && in_last_segment {
            self.frontier = at;
            if !at.is_multiple_of(SEGMENT_SIZE as u64) {
                if let Some(start) = self.holes.take_ending_at(at) {
                    self.frontier = start;
                }
            }
            return;
        }
        match self.holes.free(segments, at, size) {
            Ok(()) => {}
            Err(NotFreed::NoMemory) => tracing::warn!(
                at,
                size,
                "no memory for the arena's free map: the space is unused until a compaction"
            ),
            // A caller bug (a double free): making it a hole again would hand it out twice.
            Err(NotFreed::Invalid) => {
                tracing::error!(at, size, "freed space that is not in use: ignored")
            }
        }
    }
}

/// A size-class arena; see the module docs.
#[derive(Debug)]
pub(crate) struct Arena {
    meta: Mutex<Meta>,
    segments: SegmentTable,
    /// Memory outside the arena that counts against the limit (the page table).
    base_bytes: u64,
    limit: Option<u64>,
    /// Where segments come from and are recorded, for a persistent store.
    home: Option<Arc<dyn SegmentHome>>,
    /// Replaced objects whose room is given back later (`arena/replaced.rs`).
    deferred: Deferred,
    /// What the arena held when its lock was last let go ([`Arena::held_bytes`]).
    held_now: AtomicU64,
}

/// The bookkeeping, locked. Letting go of it publishes what the arena holds, so that the
/// memory limit's check on every staged request reads it without the lock.
struct MetaGuard<'a> {
    arena: &'a Arena,
    meta: MutexGuard<'a, Meta>,
}

impl std::ops::Deref for MetaGuard<'_> {
    type Target = Meta;
    fn deref(&self) -> &Meta {
        &self.meta
    }
}

impl std::ops::DerefMut for MetaGuard<'_> {
    fn deref_mut(&mut self) -> &mut Meta {
        &mut self.meta
    }
}

impl Drop for MetaGuard<'_> {
    fn drop(&mut self) {
        self.arena
            .held_now
            .store(self.arena.held(&self.meta), Relaxed);
    }
}

/// Segments of a home that outlives the store (a daemon's shared memory) are the home's, not
/// the allocator's: freeing them hands them to the allocator, which writes its free-list link
/// into each one's first word. A takeover that fails after adopting a store drops it, and
/// the store it left for the next one had lost the first object of every segment. The
/// home's directory still names them; whoever comes next adopts them.
impl Drop for Arena {
    fn drop(&mut self) {
        if self.home.as_ref().is_some_and(|h| h.outlives_the_store()) {
            self.segments.forget_all();
        }
    }
}

impl Arena {
    /// An empty arena of up to `max_segments` segments. `base_bytes` is memory held
    /// elsewhere that counts against `limit`.
    pub(crate) fn new(
        base_bytes: u64,
        limit: Option<u64>,
        max_segments: usize,
        home: Option<Arc<dyn SegmentHome>>,
    ) -> Self {
        let arena = Self {
            meta: Mutex::new(Meta {
                frontier: 0,
                segments: 0,
                holes: Holes::new(),
                objects: 0,
                class_bytes: 0,
                max_held: 0,
                compacted_pages: 0,
                adopted_holes: Vec::new(),
                adopted_hole_bytes: 0,
            }),
            segments: SegmentTable::new(max_segments),
            base_bytes,
            limit,
            home,
            deferred: Deferred::default(),
            held_now: AtomicU64::new(0),
        };
        drop(arena.lock_meta());
        arena
    }

    /// The bookkeeping, locked.
    fn lock_meta(&self) -> MetaGuard<'_> {
        #[cfg(test)]
        LOCKS.with(|n| n.set(n.get() + 1));
        MetaGuard {
            arena: self,
            meta: self.meta.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// What the arena holds (segments and bookkeeping), as of the last release of its lock:
    /// [`ArenaUsage::held_bytes`] without taking the lock.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held_now.load(Relaxed)
    }

    /// A new segment: from the home of a persistent store, else zeroed from the allocator.
    fn new_segment(&self) -> Result<Segment, CoreError> {
        let Some(home) = &self.home else {
            return new_segment();
        };
        let segment = home.alloc().ok_or(CoreError::NoMemory)?;
        if segment.len() != SEGMENT_SIZE / 8 {
            return Err(CoreError::NoMemory);
        }
        // Not zeroed: a home's memory is initialized (an earlier object's bytes at worst),
        // and nothing reads a word of a segment that no object has written (compaction moves
        // an object's padding words too, unread). Zeroing cost a pass over every new segment.
        Ok(segment)
    }

    /// Takes over a recovered store's memory: segments `0..n` from the home (dense: the
    /// arena only ever grows and shrinks at the top) and the live `objects` (`(handle,
    /// len)`, any order), whose gaps become free holes. Fails, changing nothing that
    /// matters (the arena is fresh), when an object lies outside the segments or two
    /// overlap.
    pub(crate) fn adopt(&self, objects: &mut [(u64, usize)]) -> Result<usize, String> {
        let Some(home) = &self.home else {
            return Err("the store has no segment home".into());
        };
        let mut meta = self.lock_meta();
        let mut n = 0;
        while n < self.segments.capacity() {
            let Some(segment) = home.find(n) else { break };
            if segment.len() != SEGMENT_SIZE / 8 {
                let words = segment.len();
                home.hand_back(segment);
                return Err(format!("segment {n} has {words} words"));
            }
            if let Err((e, segment)) = self.segments.install_or_hand_back(n, segment) {
                home.hand_back(segment);
                return Err(format!("segment {n}: {e}"));
            }
            n += 1;
        }
        meta.segments = n;
        objects.sort_unstable_by_key(|o| o.0);
        let seg = SEGMENT_SIZE as u64;
        let mut cursor = 0u64;
        for &(handle, len) in objects.iter() {
            let size = (class_of(len) * CLASS_GRANULE) as u64;
            if handle < cursor {
                return Err(format!("object at {handle} overlaps the one before it"));
            }
            if handle % seg + size > seg || handle / seg >= n as u64 {
                return Err(format!(
                    "object at {handle} ({len} bytes) is outside the {n} segments"
                ));
            }
            self.adopt_hole(&mut meta, cursor, handle);
            meta.objects += 1;
            meta.class_bytes += size;
            cursor = handle + size;
        }
        // The space after the last object is free too. The frontier goes to the end: it
        // only ever lies in the last segment, whose tail `grow` frees as one hole (a
        // frontier segments before the end made that hole larger than any class).
        let end = n as u64 * seg;
        self.adopt_hole(&mut meta, cursor, end);
        meta.frontier = end;
        meta.max_held = self.held(&meta);
        Ok(n)
    }

    /// Notes the free space `from..to` for [`Arena::link_adopted_holes`], or (with no memory
    /// for the note) puts it on the free lists at once.
    fn adopt_hole(&self, meta: &mut Meta, from: u64, to: u64) {
        if from >= to {
            return;
        }
        if meta.adopted_holes.try_reserve(1).is_ok() {
            meta.adopted_holes.push((from, to));
            meta.adopted_hole_bytes += to - from;
        } else {
            self.free_range(meta, from, to);
        }
    }

    /// Puts up to `max` of the free ranges [`Arena::adopt`] found onto the free lists (until
    /// then the arena grows rather than fill them). True while some are left.
    pub(crate) fn link_adopted_holes(&self, max: usize) -> bool {
        let mut meta = self.lock_meta();
        for _ in 0..max {
            let Some((from, to)) = meta.adopted_holes.pop() else {
                break;
            };
            meta.adopted_hole_bytes -= to - from;
            self.free_range(&mut meta, from, to);
        }
        if meta.adopted_holes.is_empty() {
            // Its memory back, not only its length.
            meta.adopted_holes = Vec::new();
            return false;
        }
        true
    }

    /// Makes the free space `from..to` holes, one a segment.
    fn free_range(&self, meta: &mut Meta, mut from: u64, to: u64) {
        let seg = SEGMENT_SIZE as u64;
        while from < to {
            let end = to.min((from / seg + 1) * seg);
            meta.free(&self.segments, from, end - from);
            from = end;
        }
    }

    /// Releases segment `i` (after telling the home, so a crash never leaves it recorded
    /// with its memory reused).
    fn release(&self, i: usize) {
        if let Some(home) = &self.home {
            home.removed(i);
        }
        self.segments.release(i);
    }

    fn fixed_bytes() -> u64 {
        std::mem::size_of::<Self>() as u64
    }

    fn held(&self, meta: &Meta) -> u64 {
        Self::fixed_bytes()
            + (meta.segments * SEGMENT_SIZE) as u64
            + self.segments.bytes()
            + meta.holes.held_bytes()
    }

    /// Every segment's words, in order (what a process killed now leaves), for tests.
    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> Vec<Vec<u64>> {
        let n = self
            .meta
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .segments;
        (0..n)
            .filter_map(|i| {
                let seg = self.segments.read(i)?;
                Some(seg.words().iter().map(|w| w.load(Relaxed)).collect())
            })
            .collect()
    }

    /// Current usage.
    pub(crate) fn usage(&self) -> ArenaUsage {
        let meta = self.lock_meta();
        let held_bytes = self.held(&meta);
        ArenaUsage {
            held_bytes,
            max_held_bytes: meta.max_held.max(held_bytes),
            segment_bytes: (meta.segments * SEGMENT_SIZE) as u64,
            objects: meta.objects,
            class_bytes: meta.class_bytes,
            free_bytes: meta.holes.bytes() + meta.adopted_hole_bytes,
            compacted_pages: meta.compacted_pages,
        }
    }

    /// Whether objects may go in order at the frontier now ([`Placement::InOrder`]): false
    /// while free holes hold more than 1/[`IN_ORDER_HOLE_SHARE`] of the segments, which
    /// only objects placed `Anywhere` fill.
    pub(crate) fn may_place_in_order(&self) -> bool {
        let meta = self.lock_meta();
        let holes = meta.holes.bytes() + meta.adopted_hole_bytes;
        holes.saturating_mul(IN_ORDER_HOLE_SHARE) <= (meta.segments * SEGMENT_SIZE) as u64
    }

    /// Reserves room for an object of `data.len()` (1..=PAGE_SIZE) bytes and then `trailer`
    /// (the store's checksum, if any) and copies both into it. Returns its offset. Fails
    /// with [`CoreError::MemLimit`] when that needs a new segment that `budget` does not
    /// allow; nothing changes then.
    pub(crate) fn store(
        &self,
        data: &[u8],
        trailer: Option<[u8; CHECKSUM_BYTES]>,
        budget: Budget,
    ) -> Result<u64, CoreError> {
        let mut handle = [0u64];
        let trailer_len = trailer.map_or(0, |t| t.len());
        self.alloc_many(&[data.len() + trailer_len], budget, &mut handle)?;
        self.write_many(std::iter::once((
            handle[0],
            ObjectBytes::Bytes(data),
            trailer,
        )));
        Ok(handle[0])
    }

    /// Reserves room for objects of `lens[i]` bytes into `handles[i]` under one acquisition
    /// of the bookkeeping lock (a GPU slot's results are installed a few hundred at a
    /// time). All or nothing: on an error every object reserved so far is given back.
    pub(crate) fn alloc_many(
        &self,
        lens: &[usize],
        budget: Budget,
        handles: &mut [u64],
    ) -> Result<(), CoreError> {
        self.alloc_many_placed(lens, budget, Placement::Anywhere, handles)
    }

    /// [`Arena::alloc_many`], with the objects' [`Placement`].
    pub(crate) fn alloc_many_placed(
        &self,
        lens: &[usize],
        budget: Budget,
        placement: Placement,
        handles: &mut [u64],
    ) -> Result<(), CoreError> {
        debug_assert_eq!(lens.len(), handles.len());
        let mut done = 0;
        // Objects allocated ahead of `done` (tail fillers, `Placement::InOrder`); without room
        // for the flags, no filling.
        let mut early = Vec::new();
        if matches!(placement, Placement::InOrder(_)) && early.try_reserve_exact(lens.len()).is_ok()
        {
            early.resize(lens.len(), false);
        }
        let result = self.alloc_into(lens, budget, placement, handles, &mut done, &mut early);
        if result.is_err() {
            self.free_many(
                handles
                    .iter()
                    .copied()
                    .zip(lens.iter().copied())
                    .enumerate()
                    .filter(|&(i, _)| i < done || early.get(i) == Some(&true))
                    .map(|(_, o)| o),
            );
        }
        result
    }

    fn alloc_into(
        &self,
        lens: &[usize],
        budget: Budget,
        placement: Placement<'_>,
        handles: &mut [u64],
        done: &mut usize,
        early: &mut [bool],
    ) -> Result<(), CoreError> {
        // A fresh segment is allocated (zeroed, page-faulted in) outside the bookkeeping
        // lock, so other writers keep going meanwhile; if one of them grew the arena
        // first, the spare is kept for the next need or dropped at the end.
        let mut fresh: Option<Segment> = None;
        loop {
            let mut meta = self.lock_meta();
            while *done < lens.len() {
                if early.get(*done) == Some(&true) {
                    *done += 1;
                    continue;
                }
                let len = lens[*done];
                debug_assert!((1..=MAX_OBJECT).contains(&len));
                let class = class_of(len);
                let size = (class * CLASS_GRANULE) as u64;
                let in_order = matches!(placement, Placement::InOrder(marks) if marks.get(*done) == Some(&true));
                let room = if in_order {
                    meta.take_frontier(class)
                } else {
                    meta.take(class)
                };
                if let Some(h) = room {
                    meta.objects += 1;
                    meta.class_bytes += size;
                    handles[*done] = h;
                    *done += 1;
                    continue;
                }
                // Before the arena grows, the frontier's tail is filled, whether the object
                // that did not fit is in order or not: a page stored raw that does not fit
                // leaves a tail no later in-order object would take.
                if let Placement::InOrder(marks) = placement {
                    fill_tail(&mut meta, lens, marks, handles, *done + 1, early);
                }
                self.check_growth(&meta, budget)?;
                match fresh.take() {
                    Some(segment) => self.grow(&mut meta, segment)?,
                    None => {
                        drop(meta);
                        fresh = Some(self.new_segment()?);
                        break;
                    }
                }
            }
            if *done == lens.len() {
                return Ok(());
            }
        }
    }

    /// Fails with [`CoreError::MemLimit`] if one more segment would pass the limit, and
    /// with `NoMemory` if the segment table is full.
    fn check_growth(&self, meta: &Meta, budget: Budget) -> Result<(), CoreError> {
        if meta.segments >= self.segments.capacity() {
            return Err(CoreError::NoMemory);
        }
        let (Some(limit), Budget::Limited { reserved }) = (self.limit, budget) else {
            return Ok(());
        };
        let used = self.base_bytes + reserved + self.held(meta);
        // The new segment comes with room in the holes' tables.
        let after = used
            + SEGMENT_SIZE as u64
            + self.segments.growth_bytes(meta.segments)
            + meta.holes.growth_bytes(meta.segments);
        if after > limit {
            return Err(CoreError::MemLimit { limit, used });
        }
        Ok(())
    }

    /// Adds `segment` and moves the frontier to its start; the old segment's unused tail
    /// goes onto the free lists. The caller checked the limit under the same lock.
    fn grow(&self, meta: &mut Meta, segment: Segment) -> Result<(), CoreError> {
        let at = segment.as_ptr();
        self.segments.install(meta.segments, segment)?;
        meta.holes.prepare(meta.segments);
        if let Some(home) = &self.home {
            home.placed(meta.segments, at);
        }
        let end = (meta.segments * SEGMENT_SIZE) as u64;
        if end > meta.frontier {
            let at = meta.frontier;
            meta.free(&self.segments, at, end - at);
        }
        meta.segments += 1;
        meta.frontier = end;
        meta.max_held = meta.max_held.max(self.held(meta));
        Ok(())
    }

    /// [`Arena::free_many`] of one object.
    #[cfg(test)]
    pub(crate) fn free(&self, handle: u64, len: usize) {
        self.free_many(std::iter::once((handle, len)));
    }

    /// Returns the space of several `(handle, len)` objects to their classes' free lists,
    /// under one lock. When the last object goes, every segment is released.
    pub(crate) fn free_many(&self, objects: impl IntoIterator<Item = (u64, usize)>) {
        let mut objects = objects.into_iter().peekable();
        // Most writes replace nothing the arena holds (a first write, a fill): no lock then.
        if objects.peek().is_none() {
            return;
        }
        let mut meta = self.lock_meta();
        for (handle, len) in objects {
            self.free_locked(&mut meta, handle, len);
        }
    }

    /// [`Arena::free_many`] of one object, under the lock.
    fn free_locked(&self, meta: &mut Meta, handle: u64, len: usize) {
        let class = class_of(len);
        meta.objects -= 1;
        meta.class_bytes -= (class * CLASS_GRANULE) as u64;
        if meta.objects == 0 {
            for i in (0..meta.segments).rev() {
                self.release(i);
            }
            meta.clear_free();
            meta.segments = 0;
            meta.frontier = 0;
        } else {
            meta.free(&self.segments, handle, (class * CLASS_GRANULE) as u64);
        }
    }

    /// Copies the `len` stored bytes at `handle` into `out[..len]`. `false` if that range
    /// is not in the arena (a corrupt entry: the store reports it instead of panicking).
    pub(crate) fn load(&self, handle: u64, len: usize, out: &mut [u8]) -> bool {
        let (seg, off) = split(handle);
        let Some(segment) = self.segments.read(seg) else {
            return false;
        };
        let words = segment.words().get(off / 8..(off + len).div_ceil(8));
        let (Some(words), Some(out)) = (words, out.get_mut(..len)) else {
            return false;
        };
        words_to_bytes(words, out);
        true
    }

    /// [`Arena::load`], and the [`CHECKSUM_BYTES`] trailer after the `len` bytes (with one
    /// look-up of the segment). `None` if the object is not in the arena.
    pub(crate) fn load_with_trailer(
        &self,
        handle: u64,
        len: usize,
        out: &mut [u8],
    ) -> Option<[u8; CHECKSUM_BYTES]> {
        let (seg, off) = split(handle);
        let segment = self.segments.read(seg)?;
        let end = off.checked_add(len)?;
        let words = segment.words();
        let out = out.get_mut(..len)?;
        words_to_bytes(words.get(off / 8..end.div_ceil(8))?, out);
        let tail = words.get(end / 8..(end + CHECKSUM_BYTES).div_ceil(8))?;
        let mut bytes = [0u8; 16];
        for (chunk, w) in bytes.chunks_exact_mut(8).zip(tail) {
            chunk.copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        bytes
            .get(end % 8..end % 8 + CHECKSUM_BYTES)?
            .try_into()
            .ok()
    }

    /// Writes objects (`handle`, payload, trailer) at handles `alloc_many` just returned:
    /// nobody else can see that space until the caller publishes it under a shard lock
    /// (whose release orders these stores before any reader's loads). Each segment is
    /// locked once per run of objects in it.
    pub(crate) fn write_many<'d>(
        &self,
        objects: impl IntoIterator<Item = (u64, ObjectBytes<'d>, Option<[u8; CHECKSUM_BYTES]>)>,
    ) {
        let mut cursor = self.segments.cursor();
        for (handle, data, trailer) in objects {
            let trailer = trailer.as_ref().map_or(&[][..], |t| &t[..]);
            let (seg, off) = split(handle);
            let words = cursor
                .words(seg)
                .get(off / 8..(off + data.len() + trailer.len()).div_ceil(8));
            match (words, data) {
                (Some(words), ObjectBytes::Bytes(bytes)) => {
                    words::store_bytes(bytes, trailer, words)
                }
                (Some(words), ObjectBytes::Words(from)) => words::store_words(from, trailer, words),
                (None, _) => {}
            }
        }
        // The copies may use streaming stores: they land before the entries that publish
        // these objects (stored after this returns, under a shard lock).
        crate::page::stream_fence();
    }
}

/// Fills the rest of the frontier's segment with objects marked in `marks` from the end of
/// the list (down to `from`) that fit, flagging each in `early`. It weighs at most
/// [`TAIL_FILL_LOOKBACK`] objects not yet placed: the ones earlier fills took are passed
/// over, not counted, so that the last segments of a long list find fillers as the first did.
fn fill_tail(
    meta: &mut Meta,
    lens: &[usize],
    marks: &[bool],
    handles: &mut [u64],
    from: usize,
    early: &mut [bool],
) {
    let end = lens.len().min(marks.len()).min(early.len());
    let mut weighed = 0;
    for j in (from..end).rev() {
        if !marks[j] || early[j] {
            continue;
        }
        if weighed == TAIL_FILL_LOOKBACK || meta.frontier.is_multiple_of(SEGMENT_SIZE as u64) {
            break;
        }
        weighed += 1;
        let class = class_of(lens[j]);
        if let Some(h) = meta.take_frontier(class) {
            meta.objects += 1;
            meta.class_bytes += (class * CLASS_GRANULE) as u64;
            handles[j] = h;
            early[j] = true;
        }
    }
}

/// One live object, as compaction sees it: where it is, how long, and an opaque tag the
/// caller uses to find its table entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Object {
    pub handle: u64,
    pub len: u16,
    pub tag: u64,
}

/// The arena locked for compaction: no allocation or free can run while it lives.
pub(crate) struct Compaction<'a> {
    arena: &'a Arena,
    meta: MetaGuard<'a>,
}

impl Arena {
    /// Locks the arena for [`Compaction::run`]. Take this before the shard locks.
    pub(crate) fn lock_for_compaction(&self) -> Compaction<'_> {
        Compaction {
            arena: self,
            meta: self.lock_meta(),
        }
    }
}

impl Compaction<'_> {
    /// Objects the arena has handed out and not had back (published or not), less those
    /// replaced and not given back yet: what the page table names once every write in
    /// flight has published its entries. Exact only while the caller holds every shard's
    /// lock.
    pub(crate) fn objects(&self) -> u64 {
        self.meta
            .objects
            .saturating_sub(self.arena.deferred_objects())
    }

    /// Slides every object in `objects` (all live objects; sorted here) down to the
    /// lowest addresses, calls `moved` with each one's new handle right after moving it
    /// (before the next move: a crash between two moves leaves every entry pointing at
    /// whole bytes), and releases the segments left empty. An object whose new place would
    /// overlap its old one stays where it is (a half-done overlapping copy would leave
    /// neither copy whole), and the gap before it becomes a free hole. Returns the pages'
    /// worth of memory released. The caller guarantees nothing reads the moved objects
    /// meanwhile (it holds every shard's write lock). Replaced objects not given back yet
    /// are not in `objects`: their room is reclaimed here, and their later free skipped.
    pub(crate) fn run(&mut self, objects: &mut [Object], mut moved: impl FnMut(&Object)) -> u64 {
        objects.sort_unstable_by_key(|o| o.handle);
        let meta = &mut *self.meta;
        let segments = &self.arena.segments;
        meta.holes.forget();
        meta.forget_adopted_holes();
        meta.objects = objects.len() as u64;
        meta.class_bytes = objects
            .iter()
            .map(|o| (class_of(usize::from(o.len)) * CLASS_GRANULE) as u64)
            .sum();
        self.arena.forget_deferred();
        let seg_size = SEGMENT_SIZE as u64;
        let mut cursor = 0u64;
        for object in objects.iter_mut() {
            let size = (class_of(usize::from(object.len)) * CLASS_GRANULE) as u64;
            if cursor % seg_size + size > seg_size {
                let next = cursor.next_multiple_of(seg_size);
                // No object that still has to move lies in this tail: one that did
                // not fit here came from a later segment.
                meta.free(segments, cursor, next - cursor);
                cursor = next;
            }
            if cursor + size > object.handle {
                if cursor < object.handle {
                    meta.free(segments, cursor, object.handle - cursor);
                }
                cursor = object.handle;
            } else {
                move_words(segments, object.handle, cursor, size);
                object.handle = cursor;
                moved(object);
            }
            cursor += size;
        }
        let keep = cursor.div_ceil(seg_size) as usize;
        let released = meta.segments.saturating_sub(keep);
        for i in (keep..meta.segments).rev() {
            self.arena.release(i);
        }
        meta.holes.release_from(keep);
        meta.segments = meta.segments.min(keep);
        meta.frontier = cursor;
        let pages = (released * SEGMENT_SIZE / PAGE_SIZE) as u64;
        meta.compacted_pages += pages;
        pages
    }
}

/// Loads `out.len()` bytes from `words`, little-endian: the inverse of [`words::store_bytes`].
fn words_to_bytes(words: &[AtomicU64], out: &mut [u8]) {
    let mut words = words.iter();
    let mut whole = out.chunks_exact_mut(8);
    for (chunk, word) in whole.by_ref().zip(words.by_ref()) {
        chunk.copy_from_slice(&word.load(Relaxed).to_le_bytes());
    }
    let tail = whole.into_remainder();
    if !tail.is_empty() {
        if let Some(word) = words.next() {
            let n = tail.len();
            tail.copy_from_slice(&word.load(Relaxed).to_le_bytes()[..n]);
        }
    }
}

/// Copies `size` bytes from `from` to `to` (`to < from`), ascending, word by word: safe
/// for overlapping ranges in that direction.
fn move_words(segments: &SegmentTable, from: u64, to: u64, size: u64) {
    let (fs, fo) = split(from);
    let (ts, to_off) = split(to);
    let (Some(src), dst) = (segments.read(fs), (ts != fs).then(|| segments.read(ts))) else {
        return;
    };
    let dst = match &dst {
        Some(Some(d)) => d.words(),
        Some(None) => return,
        None => src.words(),
    };
    let src = src.words();
    let words = (size / 8) as usize;
    for i in 0..words {
        if let (Some(s), Some(d)) = (src.get(fo / 8 + i), dst.get(to_off / 8 + i)) {
            d.store(s.load(Relaxed), Relaxed);
        }
    }
}

/// Writes one word at `handle`; `false` if it is not in the arena.
#[cfg(test)]
fn set_word(segments: &SegmentTable, handle: u64, value: u64) -> bool {
    let (seg, off) = split(handle);
    match segments.read(seg) {
        Some(s) => match s.words().get(off / 8) {
            Some(word) => {
                word.store(value, Relaxed);
                true
            }
            None => false,
        },
        None => false,
    }
}

/// Whether `handle` is in one of the arena's segments, found without touching its memory
/// (a page not yet mapped into this process would fault in on the I/O path).
fn in_arena(segments: &SegmentTable, handle: u64) -> bool {
    let (seg, off) = split(handle);
    segments
        .read(seg)
        .is_some_and(|s| s.words().get(off / 8).is_some())
}

/// A zeroed segment, or `NoMemory` when the allocator has none to give. The allocation is
/// fallible on purpose: the daemon's allocator refuses (rather than page-faults) on threads
/// that serve swap I/O once its reserve is empty, and that must become an error for one
/// write, never an abort.
fn new_segment() -> Result<Segment, CoreError> {
    words::zeroed(SEGMENT_SIZE / 8).ok_or(CoreError::NoMemory)
}

fn split(handle: u64) -> (usize, usize) {
    (
        (handle / SEGMENT_SIZE as u64) as usize,
        (handle % SEGMENT_SIZE as u64) as usize,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const LIMITED: Budget = Budget::Limited { reserved: 0 };

    /// A home that finds `found` segments (zeroed: adopting reads no object's bytes).
    #[derive(Debug)]
    struct FoundHome {
        found: usize,
    }

    impl SegmentHome for FoundHome {
        fn alloc(&self) -> Option<super::super::SegmentWords> {
            new_segment().ok()
        }
        fn placed(&self, _: usize, _: *const AtomicU64) {}
        fn removed(&self, _: usize) {}
        fn find(&self, index: usize) -> Option<super::super::SegmentWords> {
            (index < self.found).then(|| new_segment().ok()).flatten()
        }
    }

    #[test]
    fn an_adopted_arena_with_empty_segments_at_the_end_grows() {
        // Three segments, one object in the first: the other two are free space.
        let arena = Arena::new(0, None, 16, Some(Arc::new(FoundHome { found: 3 })));
        assert_eq!(arena.adopt(&mut [(0, 100)]), Ok(3));
        while arena.link_adopted_holes(64) {}
        let before = arena.usage();
        assert_eq!(before.segment_bytes, 3 * SEGMENT_SIZE as u64);
        // The last segment, free from its start to the frontier, went back to the frontier.
        assert_eq!(arena.meta.lock().unwrap().frontier, 2 * SEGMENT_SIZE as u64);
        assert_eq!(
            before.free_bytes,
            2 * SEGMENT_SIZE as u64 - (class_of(100) * CLASS_GRANULE) as u64
        );
        // Pages until the free space is used up and the arena grows.
        let page = [7u8; PAGE_SIZE];
        let mut handles = Vec::new();
        for _ in 0..(4 * SEGMENT_SIZE / PAGE_SIZE) {
            handles.push(arena.store(&page, None, LIMITED).unwrap());
        }
        assert_eq!(arena.usage().segment_bytes, 5 * SEGMENT_SIZE as u64);
        let mut sorted = handles.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), handles.len(), "an object handed out twice");
        assert!(sorted.windows(2).all(|w| w[1] - w[0] >= PAGE_SIZE as u64));
        for h in handles {
            assert_eq!(read(&arena, h, PAGE_SIZE), page);
        }
    }

    /// A home whose segment `bad` is one word short, and which keeps what is handed back.
    #[derive(Debug, Default)]
    struct ShortHome {
        bad: usize,
        handed_back: std::sync::Mutex<Vec<super::super::SegmentWords>>,
    }

    impl SegmentHome for ShortHome {
        fn alloc(&self) -> Option<super::super::SegmentWords> {
            new_segment().ok()
        }
        fn placed(&self, _: usize, _: *const AtomicU64) {}
        fn removed(&self, _: usize) {}
        fn find(&self, index: usize) -> Option<super::super::SegmentWords> {
            let words = SEGMENT_SIZE / 8 - usize::from(index == self.bad);
            (index <= self.bad).then(|| (0..words).map(|_| AtomicU64::new(0)).collect())
        }
        fn outlives_the_store(&self) -> bool {
            true
        }
        fn hand_back(&self, segment: super::super::SegmentWords) {
            self.handed_back.lock().unwrap().push(segment);
        }
    }

    /// A takeover that fails on a segment leaves that segment to its home (in a daemon, the
    /// next daemon's store), never frees it, whether the segment is refused or the table has
    /// no room for it.
    #[test]
    fn a_failed_adoption_hands_the_segment_it_holds_back_to_its_home() {
        let home = Arc::new(ShortHome {
            bad: 2,
            ..ShortHome::default()
        });
        let arena = Arena::new(0, None, 16, Some(home.clone()));
        let err = arena.adopt(&mut []).unwrap_err();
        assert!(err.contains("segment 2"), "{err}");
        assert_eq!(home.handed_back.lock().unwrap().len(), 1);
        assert_eq!(
            home.handed_back.lock().unwrap()[0].len(),
            SEGMENT_SIZE / 8 - 1
        );

        // The table's first chunk cannot be had: the first segment goes back.
        let home = Arc::new(ShortHome {
            bad: 5,
            ..ShortHome::default()
        });
        let arena = Arena::new(0, None, 16, Some(home.clone()));
        super::super::tests::fail_allocs_from(Some(0));
        let err = arena.adopt(&mut []);
        super::super::tests::fail_allocs_from(None);
        assert!(err.unwrap_err().contains("segment 0"));
        assert_eq!(home.handed_back.lock().unwrap().len(), 1);
        assert_eq!(home.handed_back.lock().unwrap()[0].len(), SEGMENT_SIZE / 8);
    }

    #[test]
    fn an_adopted_arenas_holes_are_filled_only_once_linked_and_counted_free_all_along() {
        // Two segments; objects at 0 and 4096: holes after each, and the second segment.
        let arena = Arena::new(0, None, 16, Some(Arc::new(FoundHome { found: 2 })));
        assert_eq!(arena.adopt(&mut [(4096, 100), (0, 100)]), Ok(2));
        let used = 2 * (class_of(100) * CLASS_GRANULE) as u64;
        let free = 2 * SEGMENT_SIZE as u64 - used;
        assert_eq!(arena.usage().free_bytes, free);
        // Not linked yet: a new object grows the arena instead of filling a hole.
        let first = arena.store(&[1; 100], None, LIMITED).unwrap();
        assert!(
            first >= 2 * SEGMENT_SIZE as u64,
            "filled an unlinked hole at {first}"
        );
        assert_eq!(arena.usage().segment_bytes, 3 * SEGMENT_SIZE as u64);
        // Linked a few at a time: the holes take the next objects, and the free bytes are
        // what they were (the third segment's rest is its frontier, not a hole).
        while arena.link_adopted_holes(1) {}
        assert!(!arena.link_adopted_holes(1));
        assert_eq!(arena.usage().free_bytes, free);
        // A segment's worth of pages: the third segment's frontier takes 15, a linked
        // hole the rest, and the arena does not grow.
        let page = [2u8; PAGE_SIZE];
        let handles: Vec<u64> = (0..SEGMENT_SIZE / PAGE_SIZE)
            .map(|_| arena.store(&page, None, LIMITED).unwrap())
            .collect();
        assert_eq!(arena.usage().segment_bytes, 3 * SEGMENT_SIZE as u64);
        let low: Vec<u64> = handles
            .iter()
            .copied()
            .filter(|&h| h < 2 * SEGMENT_SIZE as u64)
            .collect();
        assert!(!low.is_empty(), "no linked hole was used: {handles:?}");
        let object = (class_of(100) * CLASS_GRANULE) as u64;
        for &h in &low {
            let clear = |at: u64| h + PAGE_SIZE as u64 <= at || h >= at + object;
            assert!(
                clear(0) && clear(4096),
                "a page at {h} overlaps an adopted object"
            );
        }
        for h in handles {
            assert_eq!(read(&arena, h, PAGE_SIZE), page);
        }
        assert_eq!(read(&arena, first, 100), vec![1; 100]);
    }

    pub(super) fn read(arena: &Arena, handle: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        assert!(arena.load(handle, len, &mut out), "stored range");
        out
    }

    /// `lens` allocated [`Placement::InOrder`] with `marks`; their handles.
    fn in_order(arena: &Arena, lens: &[usize], marks: &[bool]) -> Vec<u64> {
        let mut handles = vec![0u64; lens.len()];
        arena
            .alloc_many_placed(
                lens,
                Budget::Reserved,
                Placement::InOrder(marks),
                &mut handles,
            )
            .unwrap();
        handles
    }

    #[test]
    fn in_order_objects_follow_each_other_and_fill_each_segments_tail_from_the_end() {
        let arena = Arena::new(0, None, 4096, None);
        // A hole from earlier frees: `Anywhere` objects take it, in-order ones do not.
        let mut old = [0u64; 2];
        arena
            .alloc_many(&[1000, 1000], Budget::Reserved, &mut old)
            .unwrap();
        arena.free(old[0], 1000);
        let frontier = 2000u64;
        // 20 objects of 3096 bytes fill the first segment to 63920 (from 2000); the 21st
        // does not fit its remaining 1616: the last marked object of the list (1000 bytes)
        // goes there first, then the 21st and 22nd to a new segment, and the 23rd after them.
        // The unmarked one takes the hole.
        let mut lens = vec![3096usize; 22];
        lens.extend([1000, 1000, 1000]);
        let mut marks = vec![true; 24];
        marks.push(false);
        let handles = in_order(&arena, &lens, &marks);
        for (i, h) in handles.iter().take(20).enumerate() {
            assert_eq!(*h, frontier + 3096 * i as u64, "object {i}");
        }
        assert_eq!(
            handles[23], 63_920,
            "the last marked object fills the tail first"
        );
        let second = SEGMENT_SIZE as u64;
        assert_eq!(handles[20..23], [second, second + 3096, second + 6192]);
        assert_eq!(handles[24], old[0], "an unmarked object takes a free hole");
        let usage = arena.usage();
        assert_eq!(usage.objects, 26);
        assert_eq!(usage.free_bytes, (SEGMENT_SIZE - 64_920) as u64);
    }

    #[test]
    fn an_object_stored_anywhere_that_does_not_fit_leaves_the_tail_to_in_order_objects() {
        let arena = Arena::new(0, None, 4096, None);
        // 20 objects of 3096 bytes end at 61920; the raw page (unmarked) does not fit the
        // remaining 3616 bytes and no hole holds it: the three marked objects from the end
        // of the list fill the tail before the arena grows for it.
        let mut lens = vec![3096usize; 20];
        lens.extend([4096, 1000, 1000, 1000]);
        let mut marks = vec![true; lens.len()];
        marks[20] = false;
        let handles = in_order(&arena, &lens, &marks);
        assert_eq!(handles[21..], [63_920, 62_920, 61_920]);
        assert_eq!(handles[20], SEGMENT_SIZE as u64);
        assert_eq!(arena.usage().free_bytes, (SEGMENT_SIZE - 64_920) as u64);
    }

    #[test]
    fn tail_fills_pass_over_the_objects_earlier_fills_took() {
        let arena = Arena::new(0, None, 4096, None);
        // 21 objects of 3096 bytes a segment leave tails of 520 bytes, each filled by 8
        // objects of 64 bytes from the end of the list: 39 tails take 312 of them, more than
        // the fill weighs at once, so the later fills reach past the ones taken.
        let mut lens = vec![3096usize; 21 * 40];
        lens.extend(std::iter::repeat_n(64, 400));
        const { assert!(39 * 8 > TAIL_FILL_LOOKBACK) };
        let marks = vec![true; lens.len()];
        let handles = in_order(&arena, &lens, &marks);
        let usage = arena.usage();
        assert_eq!(usage.segment_bytes, 41 * SEGMENT_SIZE as u64);
        assert!(
            usage.free_bytes < 520,
            "a segment's tail was left a hole: {} bytes free",
            usage.free_bytes
        );
        let mut sorted = handles.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), handles.len(), "two objects at one place");
    }

    #[test]
    fn in_order_placement_waits_while_holes_pile_up() {
        let arena = Arena::new(0, None, 4096, None);
        assert!(arena.may_place_in_order(), "an empty arena");
        let lens = vec![1000usize; 640];
        let mut handles = vec![0u64; lens.len()];
        arena
            .alloc_many(&lens, Budget::Reserved, &mut handles)
            .unwrap();
        assert!(arena.may_place_in_order());
        // 40 of 640 objects freed: 40,000 bytes of holes in 10 segments, over 1/32.
        arena.free_many(handles[..40].iter().map(|&h| (h, 1000)));
        assert!(!arena.may_place_in_order());
        // Objects placed anywhere take the holes back.
        let mut again = vec![0u64; 40];
        arena
            .alloc_many(&lens[..40], Budget::Reserved, &mut again)
            .unwrap();
        assert!(arena.usage().free_bytes <= SEGMENT_SIZE as u64 * 10 / IN_ORDER_HOLE_SHARE);
        assert!(arena.may_place_in_order());
    }

    #[test]
    fn stores_and_reads_back() {
        let arena = Arena::new(0, None, 4096, None);
        let a = arena.store(&[1; 100], None, LIMITED).unwrap();
        let b = arena.store(&[2; 4096], None, LIMITED).unwrap();
        let c = arena.store(&[3; 1], None, LIMITED).unwrap();
        assert_eq!(read(&arena, a, 100), vec![1; 100]);
        assert_eq!(read(&arena, b, 4096), vec![2; 4096]);
        assert_eq!(read(&arena, c, 1), vec![3; 1]);
        let usage = arena.usage();
        assert_eq!(usage.objects, 3);
        assert_eq!(usage.class_bytes, 104 + 4096 + 8);
        assert_eq!(usage.segment_bytes, SEGMENT_SIZE as u64);
    }

    #[test]
    fn freed_space_is_reused_by_the_same_class() {
        let arena = Arena::new(0, None, 4096, None);
        let keep = arena.store(&[9; 50], None, LIMITED).unwrap();
        let a = arena.store(&[1; 100], None, LIMITED).unwrap();
        // Between `a` and the frontier: freed room at the frontier goes back to it.
        let fence = arena.store(&[9; 50], None, LIMITED).unwrap();
        arena.free(a, 100);
        assert_eq!(arena.usage().free_bytes, 104);
        // 97..=104 bytes round to the same class: the hole comes back.
        let b = arena.store(&[2; 97], None, LIMITED).unwrap();
        assert_eq!(a, b);
        assert_eq!(arena.usage().free_bytes, 0);
        assert_eq!(read(&arena, keep, 50), vec![9; 50]);
        assert_eq!(read(&arena, fence, 50), vec![9; 50]);
    }

    #[test]
    fn room_freed_at_the_frontier_goes_back_to_it_with_the_hole_before_it() {
        let arena = Arena::new(0, None, 4096, None);
        let keep = arena.store(&[9; 50], None, LIMITED).unwrap();
        let a = arena.store(&[1; 100], None, LIMITED).unwrap();
        let b = arena.store(&[1; 200], None, LIMITED).unwrap();
        arena.free(a, 100);
        assert_eq!(arena.usage().free_bytes, 104);
        arena.free(b, 200);
        assert_eq!(arena.usage().free_bytes, 0, "a hole before the frontier");
        assert_eq!(arena.meta.lock().unwrap().frontier, a);
        assert_eq!(arena.store(&[2; 300], None, LIMITED).unwrap(), a);
        assert_eq!(read(&arena, keep, 50), vec![9; 50]);
    }

    /// Nothing is read back from a hole's memory (shared memory in a persistent store):
    /// what is written there changes nothing the arena hands out.
    #[test]
    fn what_is_written_into_a_hole_changes_nothing_handed_out() {
        for bad in [5u64, 1 << 40, SEGMENT_SIZE as u64 - 8] {
            let arena = Arena::new(0, None, 4096, None);
            let keep = arena.store(&[9; 50], None, LIMITED).unwrap();
            let a = arena.store(&[1; 100], None, LIMITED).unwrap();
            // Kept between the two, so that they are two holes, not one.
            let between = arena.store(&[5; 40], None, LIMITED).unwrap();
            let b = arena.store(&[1; 100], None, LIMITED).unwrap();
            let fence = arena.store(&[5; 40], None, LIMITED).unwrap();
            arena.free(a, 100);
            arena.free(b, 100);
            // Where a list kept in the holes would link b to a.
            assert!(set_word(&arena.segments, b, bad));
            assert!(set_word(&arena.segments, a, bad));
            assert_eq!(arena.store(&[2; 100], None, LIMITED).unwrap(), b);
            let next = arena.store(&[3; 100], None, LIMITED).unwrap();
            assert_eq!(next, a, "the holes are handed out as freed");
            assert_eq!(read(&arena, keep, 50), vec![9; 50]);
            assert_eq!(read(&arena, between, 40), vec![5; 40]);
            assert_eq!(read(&arena, fence, 40), vec![5; 40]);
            assert_eq!(read(&arena, b, 100), vec![2; 100]);
            assert_eq!(read(&arena, next, 100), vec![3; 100]);
        }
    }

    #[test]
    fn split_hole_serves_smaller_class_and_keeps_remainder() {
        let arena = Arena::new(0, None, 4096, None);
        // Fill a segment exactly with 4096-byte objects (16 of them).
        let objs: Vec<u64> = (0..SEGMENT_SIZE / PAGE_SIZE)
            .map(|_| arena.store(&[1; 4096], None, LIMITED).unwrap())
            .collect();
        assert_eq!(arena.usage().segment_bytes, SEGMENT_SIZE as u64);
        arena.free(objs[3], 4096);
        // No 1000-byte hole and no frontier room: the 4096 hole is split.
        let h = arena.store(&[2; 1000], None, LIMITED).unwrap();
        assert_eq!(h, objs[3]);
        assert_eq!(arena.usage().segment_bytes, SEGMENT_SIZE as u64);
        assert_eq!(arena.usage().free_bytes, 4096 - 1000);
        assert_eq!(read(&arena, objs[4], 4096), vec![1; 4096]);
        // The remainder serves the next object of its class without growing either.
        let r = arena.store(&[3; 3096], None, LIMITED).unwrap();
        assert_eq!(r, objs[3] + 1000);
        assert_eq!(arena.usage().free_bytes, 0);
        assert_eq!(arena.usage().segment_bytes, SEGMENT_SIZE as u64);
    }

    #[test]
    fn freeing_everything_releases_all_segments() {
        let arena = Arena::new(0, None, 4096, None);
        let handles: Vec<u64> = (0..100)
            .map(|_| arena.store(&[4; 3000], None, LIMITED).unwrap())
            .collect();
        assert!(arena.usage().segment_bytes >= 100 * 3000);
        for h in handles {
            arena.free(h, 3000);
        }
        let usage = arena.usage();
        assert_eq!(usage.segment_bytes, 0);
        assert_eq!(usage.objects, 0);
        assert_eq!(usage.free_bytes, 0);
        // What stays: the arena itself and its segment table (kept for the next growth).
        assert_eq!(
            usage.held_bytes,
            Arena::fixed_bytes() + arena.segments.bytes()
        );
        assert!(arena.segments.bytes() < 8192);
    }

    #[test]
    fn limit_refuses_growth_and_keeps_data() {
        let table = SegmentTable::new(4096);
        let limit = Arena::fixed_bytes()
            + table.bytes()
            + table.growth_bytes(0)
            + Holes::new().growth_bytes(0)
            + SEGMENT_SIZE as u64
            + 1024;
        let arena = Arena::new(0, Some(limit), 4096, None);
        let first = arena.store(&[8; 4096], None, LIMITED).unwrap();
        let mut stored = 1;
        let err = loop {
            match arena.store(&[8; 4096], None, LIMITED) {
                Ok(_) => stored += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, CoreError::MemLimit { .. }), "{err}");
        assert_eq!(stored, SEGMENT_SIZE / PAGE_SIZE);
        assert!(arena.usage().held_bytes <= limit);
        assert_eq!(read(&arena, first, 4096), vec![8; 4096]);
        // Freed space is still usable under the limit.
        arena.free(first, 4096);
        assert_eq!(arena.store(&[9; 4096], None, LIMITED).unwrap(), first);
    }

    #[test]
    fn compaction_slides_objects_down_and_releases_segments() {
        let arena = Arena::new(0, None, 4096, None);
        let mut live = Vec::new();
        let mut freed = Vec::new();
        for i in 0..200u64 {
            let len = 1000 + (i as usize * 37) % 3000;
            let data: Vec<u8> = (0..len).map(|b| (b as u64 * 7 + i) as u8).collect();
            let h = arena.store(&data, None, LIMITED).unwrap();
            if i % 3 == 0 {
                live.push((h, data));
            } else {
                freed.push((h, len));
            }
        }
        // Freed once all are stored: holes between the live objects that nothing reuses.
        arena.free_many(freed);
        let before = arena.usage();
        let mut objects: Vec<Object> = live
            .iter()
            .enumerate()
            .map(|(tag, (h, d))| Object {
                handle: *h,
                len: d.len() as u16,
                tag: tag as u64,
            })
            .collect();
        // In the order `run` sorts them, so that the handles before and after pair up.
        objects.sort_unstable_by_key(|o| o.handle);
        let mut compaction = arena.lock_for_compaction();
        assert_eq!(compaction.objects(), live.len() as u64);
        let old: Vec<u64> = objects.iter().map(|o| o.handle).collect();
        let mut told = Vec::new();
        let pages = compaction.run(&mut objects, |o| told.push((o.tag, o.handle)));
        drop(compaction);
        // Every move was reported as it happened, and only moves.
        let moved: Vec<(u64, u64)> = objects
            .iter()
            .zip(&old)
            .filter(|(o, &h)| o.handle != h)
            .map(|(o, _)| (o.tag, o.handle))
            .collect();
        told.sort_unstable();
        let mut moved_sorted = moved.clone();
        moved_sorted.sort_unstable();
        assert_eq!(told, moved_sorted);
        let after = arena.usage();
        assert!(pages > 0);
        assert_eq!(after.compacted_pages, pages);
        assert_eq!(
            before.segment_bytes - after.segment_bytes,
            pages * PAGE_SIZE as u64
        );
        assert!(after.free_bytes < before.free_bytes);
        for object in &objects {
            let data = &live[object.tag as usize].1;
            assert_eq!(&read(&arena, object.handle, data.len()), data);
        }
        // Allocation works on after compaction, from the new frontier.
        let h = arena.store(&[3; 2000], None, LIMITED).unwrap();
        assert_eq!(read(&arena, h, 2000), vec![3; 2000]);
    }

    #[test]
    fn compaction_never_moves_an_object_onto_itself() {
        // A 16-byte hole before a 4000-byte object: its new place would overlap its old one,
        // and a crash halfway through that copy would leave neither whole. It stays.
        let arena = Arena::new(0, None, 4096, None);
        let a = arena.store(&[1; 16], None, LIMITED).unwrap();
        let b = arena.store(&[2; 4000], None, LIMITED).unwrap();
        let c = arena.store(&[3; 100], None, LIMITED).unwrap();
        arena.free(a, 16);
        let mut objects = vec![
            Object {
                handle: b,
                len: 4000,
                tag: 0,
            },
            Object {
                handle: c,
                len: 100,
                tag: 1,
            },
        ];
        let mut told = Vec::new();
        arena
            .lock_for_compaction()
            .run(&mut objects, |o| told.push(o.tag));
        assert_eq!(objects[0].handle, b);
        assert!(told.is_empty(), "{told:?}");
        assert_eq!(read(&arena, b, 4000), vec![2; 4000]);
        assert_eq!(read(&arena, c, 100), vec![3; 100]);
        // The hole is still usable.
        assert_eq!(arena.store(&[4; 16], None, LIMITED).unwrap(), a);
    }

    #[test]
    fn accounting_tracks_rounding_and_free_space() {
        let arena = Arena::new(0, None, 4096, None);
        let a = arena.store(&[1; 13], None, LIMITED).unwrap();
        let b = arena.store(&[1; 16], None, LIMITED).unwrap();
        assert_eq!(arena.usage().class_bytes, 32);
        arena.free(a, 13);
        assert_eq!(arena.usage().class_bytes, 16);
        assert_eq!(arena.usage().free_bytes, 16);
        let usage = arena.usage();
        assert!(usage.held_bytes >= usage.segment_bytes + Arena::fixed_bytes());
        let _ = b;
    }

    #[test]
    fn objects_of_every_length_round_trip() {
        let arena = Arena::new(0, None, 4096, None);
        let mut kept = Vec::new();
        for len in 1..=100usize {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 + len) as u8).collect();
            kept.push((arena.store(&data, None, LIMITED).unwrap(), data));
        }
        for (h, data) in &kept {
            assert_eq!(&read(&arena, *h, data.len()), data, "len {}", data.len());
        }
    }

    #[test]
    fn trailers_follow_payloads_of_every_length_and_the_largest_object_fits() {
        let arena = Arena::new(0, None, 4096, None);
        let mut kept = Vec::new();
        for len in (1..=64usize).chain([4088, 4095, PAGE_SIZE]) {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let trailer = (len as u32 ^ 0xdead_beef).to_le_bytes();
            let h = arena.store(&data, Some(trailer), LIMITED).unwrap();
            kept.push((h, data, trailer));
        }
        for (h, data, trailer) in &kept {
            assert_eq!(&read(&arena, *h, data.len()), data, "len {}", data.len());
            let mut back = vec![0u8; data.len()];
            assert_eq!(
                arena.load_with_trailer(*h, data.len(), &mut back),
                Some(*trailer),
                "len {}",
                data.len()
            );
            assert_eq!(&back, data);
        }
        // a raw page with its checksum is one object of the largest class
        assert_eq!(
            class_of(MAX_OBJECT) * CLASS_GRANULE,
            (CLASSES - 1) * CLASS_GRANULE
        );
        // the words after an object are untouched by its trailer
        let (h, data, _) = &kept[2];
        let next = kept[3].0;
        assert!(next >= *h + (data.len() + CHECKSUM_BYTES) as u64);
    }

    #[test]
    fn out_of_range_reads_are_refused() {
        let arena = Arena::new(0, None, 4096, None);
        let mut out = vec![0u8; SEGMENT_SIZE + 8];
        assert!(!arena.load(0, 8, &mut out));
        let h = arena.store(&[1; 8], None, LIMITED).unwrap();
        assert!(!arena.load(h, SEGMENT_SIZE + 1, &mut out));
        assert!(!arena.load(u64::MAX - 7, 8, &mut out));
        assert!(!arena.load(h, 8, &mut out[..4]), "output too short");
        assert!(arena.load(h, 8, &mut out));
    }
}

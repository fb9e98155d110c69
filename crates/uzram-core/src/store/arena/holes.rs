//! The arena's free holes: where they are, and lists to find a hole of a size.
//!
//! Where the holes are is told by a private table per segment: its holes as (first
//! granule, granules), sorted ([`CLASS_GRANULE`] bytes a granule). A freed object is merged
//! with the holes beside it in its segment, so no two holes touch. Without the merging, a
//! store whose pages are rewritten held 15-23 % of its memory in holes on real heaps after
//! two overwrites, pieces too small for the next objects (docs/known-gaps.md,
//! `scripts/arena-model`).
//!
//! A hole of two granules or more is on a doubly linked list of its class (holes larger
//! than the largest class share one list), its next and previous holes named in its first two
//! words. Those words are the arena's memory (shared memory in a persistent store), so a
//! link read back is held to the table before it is used: it must name the start of a hole
//! of the list's class, or the list ends there. What is handed out is decided by the table:
//! a place is taken only where a hole is. A hole of one granule is on no list (no object
//! fits it) until a free beside it merges it.
//!
//! A table costs 4 bytes a hole. (A bitmap of free granules, tried first, costs 1/64 of every
//! segment: every segment has a hole, the tail the newest segment left when the arena grew,
//! and the store held 1.6 % more memory on a first write.)

use super::{get_word, in_arena, set_word, split, BITMAP_WORDS, CLASSES, CLASS_GRANULE, NONE};
use crate::store::segments::{SegmentTable, SEGMENT_SIZE};

/// Granules per segment.
#[cfg(test)]
const GRANULES: usize = SEGMENT_SIZE / CLASS_GRANULE;
/// The list of holes larger than the largest class (no object is of class 0).
const BIG: usize = 0;

/// A hole in a segment: its first granule and its granules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    start: u16,
    len: u16,
}

impl Run {
    fn end(self) -> usize {
        usize::from(self.start) + usize::from(self.len)
    }
}

/// Per segment, its holes, in chunks of [`TABLE_CHUNK`] segments: a segment more adds a
/// chunk at most, never a doubling of one vector of them all, so the memory it takes is
/// bounded when the arena checks its limit before growing ([`Holes::growth_bytes`]).
#[derive(Debug, Default)]
struct Tables {
    chunks: Vec<Box<[Vec<Run>]>>,
}

const TABLE_CHUNK: usize = 64;
/// Holes a segment's table has room for from the segment's start: a free on the I/O path
/// allocates only where a segment has more (a swap device's free may find the allocator
/// refusing: the holes are then left unused until a compaction).
const FIRST_TABLE_RUNS: usize = 8;
const FIRST_TABLE_BYTES: usize = FIRST_TABLE_RUNS * std::mem::size_of::<Run>();
/// What a segment with a hole or a few adds to the tables: its place in a chunk and its
/// first table.
pub(crate) const TABLE_BYTES_PER_SEGMENT: usize =
    FIRST_TABLE_BYTES + std::mem::size_of::<Vec<Run>>();
/// What the first of [`TABLE_CHUNK`] segments' tables adds at once: the chunk, and the
/// list of chunks' first room.
#[cfg(test)]
pub(crate) const CHUNK_GROWTH_BYTES: u64 = (TABLE_CHUNK * std::mem::size_of::<Vec<Run>>()
    + 4 * std::mem::size_of::<Box<[Vec<Run>]>>()) as u64;

impl Tables {
    fn get(&self, seg: usize) -> Option<&Vec<Run>> {
        self.chunks.get(seg / TABLE_CHUNK)?.get(seg % TABLE_CHUNK)
    }

    fn get_mut(&mut self, seg: usize) -> Option<&mut Vec<Run>> {
        self.chunks
            .get_mut(seg / TABLE_CHUNK)?
            .get_mut(seg % TABLE_CHUNK)
    }

    /// Makes room for segment `seg`'s table.
    fn reach(&mut self, seg: usize) -> Result<(), NotFreed> {
        while self.chunks.len() <= seg / TABLE_CHUNK {
            self.chunks.try_reserve(1).map_err(|_| NotFreed::NoMemory)?;
            let mut chunk = Vec::new();
            chunk
                .try_reserve_exact(TABLE_CHUNK)
                .map_err(|_| NotFreed::NoMemory)?;
            chunk.resize_with(TABLE_CHUNK, Vec::new);
            self.chunks.push(chunk.into_boxed_slice());
        }
        Ok(())
    }

    /// Memory the chunks take (not the tables in them).
    fn bytes(&self) -> usize {
        self.chunks.capacity() * std::mem::size_of::<Box<[Vec<Run>]>>()
            + self.chunks.len() * TABLE_CHUNK * std::mem::size_of::<Vec<Run>>()
    }

    /// The most [`Tables::bytes`] grows by when segment `seg` gets its table.
    fn growth_bytes(&self, seg: usize) -> usize {
        if seg / TABLE_CHUNK < self.chunks.len() {
            return 0;
        }
        let top = if self.chunks.len() == self.chunks.capacity() {
            self.chunks.capacity().max(4) * std::mem::size_of::<Box<[Vec<Run>]>>()
        } else {
            0
        };
        top + TABLE_CHUNK * std::mem::size_of::<Vec<Run>>()
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (usize, &Vec<Run>)> {
        self.chunks.iter().flat_map(|c| c.iter()).enumerate()
    }
}

/// Why a range did not become a hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NotFreed {
    /// No memory for the segment's table: the bytes stay unused until a compaction.
    NoMemory,
    /// Not a whole range of one segment, or some of it is free already (a double free).
    Invalid,
}

/// See the module docs.
#[derive(Debug)]
pub(super) struct Holes {
    /// Per list: the first hole, or [`NONE`]. List `c` holds holes of class `c`; [`BIG`]
    /// the larger ones.
    heads: [u64; CLASSES],
    /// Bit `c` set when list `c` is not empty.
    nonempty: [u64; BITMAP_WORDS],
    /// Per segment: its holes, sorted.
    runs: Tables,
    /// Runs the tables have room for.
    room: usize,
    /// Bytes in holes.
    bytes: u64,
}

impl Holes {
    pub(super) fn new() -> Self {
        Self {
            heads: [NONE; CLASSES],
            nonempty: [0; BITMAP_WORDS],
            runs: Tables::default(),
            room: 0,
            bytes: 0,
        }
    }

    /// Bytes in holes.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Memory the tables take.
    pub(super) fn held_bytes(&self) -> u64 {
        (self.room * std::mem::size_of::<Run>() + self.runs.bytes()) as u64
    }

    /// The most [`Holes::held_bytes`] grows by when segment `seg` gets its first hole.
    pub(super) fn growth_bytes(&self, seg: usize) -> u64 {
        (self.runs.growth_bytes(seg) + FIRST_TABLE_BYTES) as u64
    }

    /// Forgets every hole, and the tables' memory (the segments are gone).
    pub(super) fn clear(&mut self) {
        *self = Self::new();
    }

    /// Forgets every hole, keeping the tables' room (compaction lays the holes out anew).
    pub(super) fn forget(&mut self) {
        self.heads = [NONE; CLASSES];
        self.nonempty = [0; BITMAP_WORDS];
        self.bytes = 0;
        for chunk in &mut self.runs.chunks {
            chunk.iter_mut().for_each(Vec::clear);
        }
    }

    /// Gives back the tables of segments `from..` (released).
    pub(super) fn release_from(&mut self, from: usize) {
        for seg in from..self.runs.chunks.len() * TABLE_CHUNK {
            if let Some(table) = self.runs.get_mut(seg) {
                self.room -= table.capacity();
                *table = Vec::new();
            }
        }
    }

    /// Room for segment `seg`'s first holes, made with the segment (best effort: without
    /// it, the first free there allocates).
    pub(super) fn prepare(&mut self, seg: usize) {
        if self.runs.reach(seg).is_err() {
            return;
        }
        if let Some(table) = self.runs.get_mut(seg) {
            let room = table.capacity();
            if table.try_reserve_exact(FIRST_TABLE_RUNS).is_ok() {
                self.room += table.capacity() - room;
            }
        }
    }

    /// Makes `size` bytes at `at` (within one segment, none of them free) a hole, merged
    /// with the holes beside it.
    pub(super) fn free(
        &mut self,
        segments: &SegmentTable,
        at: u64,
        size: u64,
    ) -> Result<(), NotFreed> {
        let (seg, off) = split(at);
        let granule = CLASS_GRANULE as u64;
        if size == 0
            || !at.is_multiple_of(granule)
            || !size.is_multiple_of(granule)
            || off as u64 + size > SEGMENT_SIZE as u64
            || !in_arena(segments, at)
        {
            return Err(NotFreed::Invalid);
        }
        let (g, n) = (off / CLASS_GRANULE, size as usize / CLASS_GRANULE);
        let base = at - off as u64;
        let place = |g: usize| base + (g * CLASS_GRANULE) as u64;
        self.runs.reach(seg)?;
        let runs = self.runs.get(seg).ok_or(NotFreed::Invalid)?;
        // The first hole after `g`, and the one before it.
        let i = runs.partition_point(|r| usize::from(r.start) <= g);
        let before = i.checked_sub(1).and_then(|j| runs.get(j)).copied();
        let after = runs.get(i).copied();
        if before.is_some_and(|r| r.end() > g)
            || after.is_some_and(|r| usize::from(r.start) < g + n)
        {
            return Err(NotFreed::Invalid);
        }
        let before = before.filter(|r| r.end() == g);
        let after = after.filter(|r| usize::from(r.start) == g + n);
        if before.is_none() && after.is_none() {
            let room = runs.capacity();
            let runs = self.runs.get_mut(seg).ok_or(NotFreed::Invalid)?;
            runs.try_reserve(1).map_err(|_| NotFreed::NoMemory)?;
            self.room += runs.capacity() - room;
        }
        // Unlinked while the table still shows them as they are listed.
        for r in before.iter().chain(after.iter()) {
            if let Some(list) = list_of(usize::from(r.len)) {
                self.unlink(segments, place(usize::from(r.start)), list);
            }
        }
        let start = before.map_or(g, |r| usize::from(r.start));
        let end = after.map_or(g + n, |r| r.end());
        let merged = Run {
            start: start as u16,
            len: (end - start) as u16,
        };
        let runs = self.runs.get_mut(seg).ok_or(NotFreed::Invalid)?;
        match (before, after) {
            (None, None) => runs.insert(i, merged),
            (Some(_), None) => runs[i - 1] = merged,
            (None, Some(_)) => runs[i] = merged,
            (Some(_), Some(_)) => {
                runs[i - 1] = merged;
                runs.remove(i);
            }
        }
        self.bytes += size;
        self.push(segments, place(start), end - start);
        Ok(())
    }

    /// A hole of exactly `class`, taken.
    pub(super) fn take_exact(&mut self, segments: &SegmentTable, class: usize) -> Option<u64> {
        let at = self.pop(segments, class)?;
        self.claim(at, class);
        Some(at)
    }

    /// The front of the smallest hole larger than `class`, taken; the rest stays a hole.
    pub(super) fn take_larger(&mut self, segments: &SegmentTable, class: usize) -> Option<u64> {
        let list = self.larger_list(class).unwrap_or(BIG);
        let at = self.pop(segments, list)?;
        let run = self.run_at(at)?;
        if run <= class {
            // `pop` held it to the table: cannot happen, and nothing is handed out.
            return None;
        }
        self.claim(at, class);
        self.push(segments, at + (class * CLASS_GRANULE) as u64, run - class);
        Some(at)
    }

    /// Takes the hole that ends at `at`, in `at`'s segment, if one does; its start.
    pub(super) fn take_ending_at(&mut self, segments: &SegmentTable, at: u64) -> Option<u64> {
        let (seg, off) = split(at);
        let g = off / CLASS_GRANULE;
        let runs = self.runs.get(seg)?;
        let i = runs.partition_point(|r| usize::from(r.start) < g);
        let run = *runs.get(i.checked_sub(1)?).filter(|r| r.end() == g)?;
        let start = at - (usize::from(run.len) * CLASS_GRANULE) as u64;
        if let Some(list) = list_of(usize::from(run.len)) {
            self.unlink(segments, start, list);
        }
        self.claim(start, usize::from(run.len));
        Some(start)
    }

    /// Takes the first `class` granules of the hole at `at` (just taken off its list).
    fn claim(&mut self, at: u64, class: usize) {
        let (seg, off) = split(at);
        let g = off / CLASS_GRANULE;
        let Some(runs) = self.runs.get_mut(seg) else {
            return;
        };
        let i = runs.partition_point(|r| usize::from(r.start) < g);
        let Some(run) = runs.get_mut(i).filter(|r| usize::from(r.start) == g) else {
            return;
        };
        if usize::from(run.len) > class {
            run.start += class as u16;
            run.len -= class as u16;
        } else {
            // Its room is kept: the next free in this segment needs it again.
            runs.remove(i);
        }
        self.bytes -= (class * CLASS_GRANULE) as u64;
    }

    /// The length in granules of the hole that starts at `at`, if one does.
    pub(super) fn run_at(&self, at: u64) -> Option<usize> {
        if !at.is_multiple_of(CLASS_GRANULE as u64) {
            return None;
        }
        let (seg, off) = split(at);
        let g = off / CLASS_GRANULE;
        let runs = self.runs.get(seg)?;
        let i = runs.partition_point(|r| usize::from(r.start) < g);
        let run = runs.get(i).filter(|r| usize::from(r.start) == g)?;
        Some(usize::from(run.len))
    }

    /// Whether `at` starts a hole that belongs on `list`.
    fn listed(&self, at: u64, list: usize) -> bool {
        self.run_at(at).and_then(list_of) == Some(list)
    }

    /// A link read back from a hole: `NONE`, or a hole on `list`; anything else ends the
    /// list (the holes after it stay free but unlisted until a compaction).
    fn checked_link(&self, link: Option<u64>, list: usize) -> u64 {
        match link {
            Some(NONE) => NONE,
            Some(at) if self.listed(at, list) => at,
            _ => {
                tracing::error!(
                    list,
                    link = link.unwrap_or(NONE),
                    "a damaged free-list link in the arena: the holes after it are left unused"
                );
                NONE
            }
        }
    }

    fn push(&mut self, segments: &SegmentTable, at: u64, run: usize) {
        let Some(list) = list_of(run) else { return };
        let old = self.heads[list];
        if !set_word(segments, at, old) || !set_word(segments, at + 8, NONE) {
            return;
        }
        if old != NONE {
            set_word(segments, old + 8, at);
        }
        self.heads[list] = at;
        self.nonempty[list / 64] |= 1 << (list % 64);
    }

    fn pop(&mut self, segments: &SegmentTable, list: usize) -> Option<u64> {
        let at = self.heads[list];
        if at == NONE {
            return None;
        }
        if !self.listed(at, list) {
            tracing::error!(list, at, "a free list's head is not a hole of its class");
            self.set_head(list, NONE);
            return None;
        }
        let next = self.checked_link(get_word(segments, at), list);
        if next != NONE {
            set_word(segments, next + 8, NONE);
        }
        self.set_head(list, next);
        Some(at)
    }

    /// Takes the hole at `at` (listed on `list`) off its list.
    fn unlink(&mut self, segments: &SegmentTable, at: u64, list: usize) {
        let next = self.checked_link(get_word(segments, at), list);
        let prev = match get_word(segments, at + 8) {
            Some(NONE) => NONE,
            link => self.checked_link(link, list),
        };
        if prev == NONE {
            if self.heads[list] != at {
                tracing::error!(list, at, "a free hole is not on its list");
                return;
            }
            self.set_head(list, next);
        } else {
            if get_word(segments, prev) != Some(at) {
                tracing::error!(list, at, "a free hole's list links disagree");
                return;
            }
            set_word(segments, prev, next);
        }
        if next != NONE {
            set_word(segments, next + 8, prev);
        }
    }

    fn set_head(&mut self, list: usize, at: u64) {
        self.heads[list] = at;
        if at == NONE {
            self.nonempty[list / 64] &= !(1 << (list % 64));
        } else {
            self.nonempty[list / 64] |= 1 << (list % 64);
        }
    }

    /// The smallest class above `class` whose list is not empty.
    fn larger_list(&self, class: usize) -> Option<usize> {
        let start = class + 1;
        let mut word = start / 64;
        let mut bits = self.nonempty.get(word)? & (!0u64 << (start % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.nonempty.get(word)?;
        }
    }
}

#[cfg(test)]
impl Holes {
    /// Holds the lists to the bitmaps: every run of free granules of two or more is on the
    /// list of its length once, nothing else is listed, and the runs add up to the bytes.
    pub(super) fn check(&self, segments: &SegmentTable) -> Result<(), String> {
        let mut listed = std::collections::HashSet::new();
        for list in 0..CLASSES {
            let mut at = self.heads[list];
            let mut prev = NONE;
            while at != NONE {
                if !self.listed(at, list) {
                    return Err(format!("{at} on list {list} is not a hole of it"));
                }
                if get_word(segments, at + 8) != Some(prev) {
                    return Err(format!("{at} on list {list}: its back link is wrong"));
                }
                if !listed.insert(at) {
                    return Err(format!("{at} is listed twice"));
                }
                prev = at;
                at = get_word(segments, at).unwrap_or(NONE);
            }
            if (self.nonempty[list / 64] >> (list % 64) & 1 == 1) != (self.heads[list] != NONE) {
                return Err(format!("list {list}'s bit is wrong"));
            }
        }
        let mut bytes = 0;
        let mut runs = 0;
        for (seg, table) in self.runs.iter() {
            for (r, next) in table.iter().zip(table.iter().skip(1)) {
                if r.end() >= usize::from(next.start) || r.len == 0 {
                    return Err(format!("segment {seg}: holes {r:?} and {next:?} touch"));
                }
            }
            for r in table {
                bytes += (usize::from(r.len) * CLASS_GRANULE) as u64;
                let at = (seg * SEGMENT_SIZE + usize::from(r.start) * CLASS_GRANULE) as u64;
                if r.end() > GRANULES {
                    return Err(format!("the hole at {at} passes its segment's end"));
                }
                if r.len >= 2 {
                    runs += 1;
                    if !listed.contains(&at) {
                        return Err(format!("the hole at {at} is on no list"));
                    }
                }
            }
        }
        if runs != listed.len() || bytes != self.bytes {
            return Err(format!(
                "{runs} runs, {} listed; {bytes} bytes in runs, {} counted",
                listed.len(),
                self.bytes
            ));
        }
        Ok(())
    }
}

/// The list a hole of `run` granules belongs on: none for one granule.
fn list_of(run: usize) -> Option<usize> {
    match run {
        0 | 1 => None,
        r if r < CLASSES => Some(r),
        _ => Some(BIG),
    }
}

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
//! than the largest class share one list), in a pool of nodes of the daemon's own memory
//! (`holes/lists.rs`): nothing here reads or writes the holes themselves, which are shared
//! memory in a persistent store. (Links kept in the holes' first words, tried first, cost
//! an overwrite 5-6 % more CPU: a merge wrote into the cold memory of the holes beside it and
//! of their list neighbours.) A hole of one granule is on no list (no object fits it) until a
//! free beside it merges it.
//!
//! A table costs 8 bytes a hole and a node 16. (A bitmap of free granules, tried first,
//! costs 1/64 of every segment: every segment has a hole, the tail the newest segment left
//! when the arena grew, and the store held 1.6 % more memory on a first write.)

mod chunked;
mod lists;
mod tables;

use lists::{Lists, NO_NODE};
use tables::{Run, Tables};

use super::{in_arena, split, CLASSES, CLASS_GRANULE};
use crate::store::segments::{SegmentTable, SEGMENT_SIZE};

/// Granules per segment.
#[cfg(test)]
const GRANULES: usize = SEGMENT_SIZE / CLASS_GRANULE;
/// The list of holes larger than the largest class (no object is of class 0).
const BIG: usize = 0;

/// Holes a segment's table has room for from the segment's start, and nodes the pool gains
/// a segment: a free on the I/O path allocates only where there are more (a swap device's
/// free may find the allocator refusing: the holes are then left unused until a
/// compaction).
const FIRST_TABLE_RUNS: usize = 4;
const NODES_PER_SEGMENT: usize = 2;
const FIRST_TABLE_BYTES: usize = FIRST_TABLE_RUNS * std::mem::size_of::<Run>();
/// What a segment adds to the tables and the nodes: its place in a chunk of tables, its
/// first table, and its nodes.
pub(crate) const TABLE_BYTES_PER_SEGMENT: usize =
    FIRST_TABLE_BYTES + std::mem::size_of::<Vec<Run>>() + NODES_PER_SEGMENT * lists::NODE_BYTES;
/// What the first of [`tables::TABLE_CHUNK`] segments adds at once: a chunk of tables and of
/// nodes, and the lists of chunks' first room.
#[cfg(test)]
pub(crate) const CHUNK_GROWTH_BYTES: u64 = (tables::TABLE_CHUNK * std::mem::size_of::<Vec<Run>>()
    + 4 * std::mem::size_of::<Box<[Vec<Run>]>>()
    + lists::CHUNK_BYTES) as u64;

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
    lists: Lists,
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
            lists: Lists::new(),
            runs: Tables::default(),
            room: 0,
            bytes: 0,
        }
    }

    /// Bytes in holes.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Memory the tables and the nodes take.
    pub(super) fn held_bytes(&self) -> u64 {
        (self.room * std::mem::size_of::<Run>() + self.runs.bytes() + self.lists.bytes()) as u64
    }

    /// The most [`Holes::held_bytes`] grows by when segment `seg` is made
    /// ([`Holes::prepare`]).
    pub(super) fn growth_bytes(&self, seg: usize) -> u64 {
        (self.runs.growth_bytes(seg)
            + FIRST_TABLE_BYTES
            + self.lists.growth_bytes(NODES_PER_SEGMENT * (seg + 1))) as u64
    }

    /// Forgets every hole, and the tables' and nodes' memory (the segments are gone).
    pub(super) fn clear(&mut self) {
        *self = Self::new();
    }

    /// Forgets every hole, keeping the tables' and nodes' room (compaction lays the holes
    /// out anew).
    pub(super) fn forget(&mut self) {
        self.lists.forget();
        self.bytes = 0;
        self.runs.chunks.iter_mut().for_each(Vec::clear);
    }

    /// Gives back the tables of segments `from..` (released).
    pub(super) fn release_from(&mut self, from: usize) {
        for seg in from..self.runs.chunks.len() {
            if let Some(table) = self.runs.get_mut(seg) {
                self.room -= table.capacity();
                *table = Vec::new();
            }
        }
    }

    /// Room for segment `seg`'s first holes, made with the segment (best effort: without
    /// it, the first frees there allocate).
    pub(super) fn prepare(&mut self, seg: usize) {
        self.lists.reserve(NODES_PER_SEGMENT * (seg + 1));
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
        for r in before.iter().chain(after.iter()) {
            self.unlist(*r);
        }
        let start = before.map_or(g, |r| usize::from(r.start));
        let end = after.map_or(g + n, |r| r.end());
        let merged = self.list(base, start, end - start);
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
        Ok(())
    }

    /// A run of `len` granules from granule `start` of the segment at `base`, listed.
    fn list(&mut self, base: u64, start: usize, len: usize) -> Run {
        let node = list_of(len).map_or(NO_NODE, |list| {
            self.lists.push(list, base + (start * CLASS_GRANULE) as u64)
        });
        Run {
            start: start as u16,
            len: len as u16,
            node,
        }
    }

    fn unlist(&mut self, run: Run) {
        if let Some(list) = list_of(usize::from(run.len)).filter(|_| run.node != NO_NODE) {
            self.lists.unlink(list, run.node);
        }
    }

    /// A hole of exactly `class`, taken.
    pub(super) fn take_exact(&mut self, class: usize) -> Option<u64> {
        self.take_first(class, class)
    }

    /// The front of the smallest hole larger than `class`, taken; the rest stays a hole.
    pub(super) fn take_larger(&mut self, class: usize) -> Option<u64> {
        let list = self.lists.larger(class).unwrap_or(BIG);
        self.take_first(list, class)
    }

    /// The first `class` granules of the first hole on `list`.
    fn take_first(&mut self, list: usize, class: usize) -> Option<u64> {
        let (node, at) = self.lists.first(list)?;
        // Off its list whether or not the table agrees: one that does not is never met again.
        self.lists.unlink(list, node);
        let (seg, off) = split(at);
        let g = off / CLASS_GRANULE;
        let Some((i, run)) = self.run_index(seg, g).filter(|&(_, r)| {
            r.node == node
                && list_of(usize::from(r.len)) == Some(list)
                && usize::from(r.len) >= class
        }) else {
            // The lists and the tables are kept together: cannot happen; nothing is handed
            // out.
            tracing::error!(list, at, "a free list names no hole of its class");
            return None;
        };
        let rest = usize::from(run.len) - class;
        let base = at - off as u64;
        let left = (rest > 0).then(|| self.list(base, g + class, rest));
        let runs = self.runs.get_mut(seg)?;
        match left {
            Some(left) => runs[i] = left,
            None => {
                // Its room is kept: the next free in this segment needs it again.
                runs.remove(i);
            }
        }
        self.bytes -= (class * CLASS_GRANULE) as u64;
        Some(at)
    }

    /// The hole of segment `seg` that starts at granule `g`, and its index in the table.
    fn run_index(&self, seg: usize, g: usize) -> Option<(usize, Run)> {
        let runs = self.runs.get(seg)?;
        let i = runs.partition_point(|r| usize::from(r.start) < g);
        let run = *runs.get(i).filter(|r| usize::from(r.start) == g)?;
        Some((i, run))
    }

    /// Takes the hole that ends at `at`, in `at`'s segment, if one does; its start.
    pub(super) fn take_ending_at(&mut self, at: u64) -> Option<u64> {
        let (seg, off) = split(at);
        let g = off / CLASS_GRANULE;
        let runs = self.runs.get(seg)?;
        let i = runs.partition_point(|r| usize::from(r.start) < g);
        let j = i.checked_sub(1)?;
        let run = *runs.get(j).filter(|r| r.end() == g)?;
        self.unlist(run);
        self.runs.get_mut(seg)?.remove(j);
        self.bytes -= (usize::from(run.len) * CLASS_GRANULE) as u64;
        Some(at - (usize::from(run.len) * CLASS_GRANULE) as u64)
    }

    /// The length in granules of the hole that starts at `at`, if one does.
    #[cfg(test)]
    pub(super) fn run_at(&self, at: u64) -> Option<usize> {
        let (seg, off) = split(at);
        if !off.is_multiple_of(CLASS_GRANULE) {
            return None;
        }
        self.run_index(seg, off / CLASS_GRANULE)
            .map(|(_, r)| usize::from(r.len))
    }
}

#[cfg(test)]
impl Holes {
    /// Holds the lists to the tables: every hole of two granules or more is on the list of
    /// its length once, nothing else is listed, no two holes touch, and the holes add up to
    /// the bytes.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut listed = std::collections::HashSet::new();
        for list in 0..CLASSES {
            for (node, at) in self.lists.walk(list)? {
                let (seg, off) = split(at);
                match self.run_index(seg, off / CLASS_GRANULE) {
                    Some((_, r)) if r.node == node && list_of(usize::from(r.len)) == Some(list) => {
                    }
                    _ => return Err(format!("{at} on list {list} is not a hole of it")),
                }
                if !listed.insert(at) {
                    return Err(format!("{at} is listed twice"));
                }
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

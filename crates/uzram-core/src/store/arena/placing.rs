//! Objects written by a backend's copy engine ([`Placer`]): runs of objects that lie next to
//! each other both in the device's packed results and in the arena are one copy each; the
//! CPU writes each placed object's last word and checksum, and everything the copy engine
//! did not place, as [`Arena::write_many`] does.
//!
//! What the copy engine wrote is held to the host's copy of the same results: the last object
//! of every run is compared word by word before anything is published. A run that does not
//! hold is written again by the CPU, and the caller is told (it stops placing). Every later
//! read is held to the writer's checksum besides.

use std::sync::atomic::AtomicU64;

use super::{split, Arena, ObjectBytes, CHECKSUM_BYTES};
use crate::batch::{PlaceRun, Placer};
use crate::store::segments::SegmentGuard;
use crate::store::words;

/// Runs shorter than this are copied by the CPU: a copy engine's copy costs the driver more
/// CPU than a CPU copy of a few objects (docs/gpu.md, runs 301-302).
const MIN_RUN_BYTES: usize = 2048;

/// How a placing write went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Placed {
    /// Bytes the copy engine wrote that held.
    pub bytes: u64,
    /// Its copies (runs) that held.
    pub runs: u64,
    /// Whether a run did not hold the host's bytes (the CPU wrote it again).
    pub mismatched: bool,
    /// Whether the copy engine refused or failed the copies (the CPU wrote them).
    pub refused: bool,
}

/// A run of objects `first..=last` (indices into the caller's list) from packed offset
/// `from` to arena handle `handle`, `len` bytes (whole words of payload).
#[derive(Debug, Clone, Copy)]
struct Run {
    first: usize,
    last: usize,
    from: usize,
    handle: u64,
    len: usize,
}

type Object<'d> = (u64, ObjectBytes<'d>, Option<[u8; CHECKSUM_BYTES]>);

impl Arena {
    /// [`Arena::write_many`] of `objects` (at handles `alloc_many_placed` just returned, in
    /// its `InOrder` placement), with the runs `placer` can copy copied by it. Falls back to
    /// the CPU's copy of everything when the bookkeeping cannot be allocated.
    pub(crate) fn write_many_placing(&self, objects: &[Object<'_>], placer: &dyn Placer) -> Placed {
        let mut placed = Placed::default();
        let mut runs: Vec<Run> = Vec::new();
        let mut guards: Vec<(usize, SegmentGuard<'_>)> = Vec::new();
        let planned = runs.try_reserve(objects.len().div_ceil(8).max(1)).is_ok()
            && self.plan_runs(objects, placer, &mut runs)
            && guards.try_reserve(runs.len() + 1).is_ok();
        if !planned || runs.is_empty() {
            self.write_many(objects.iter().copied());
            return placed;
        }
        for r in &runs {
            let seg = split(r.handle).0;
            // Each segment locked once: a tail filler can put a run back in a segment left
            // behind, and a second read lock of one segment on one thread can wait behind a
            // writer.
            if !guards.iter().any(|(s, _)| *s == seg) {
                match self.segments.read(seg) {
                    Some(g) => guards.push((seg, g)),
                    None => {
                        self.write_many(objects.iter().copied());
                        return placed;
                    }
                }
            }
        }
        let targets = |r: &Run| -> Option<&[AtomicU64]> {
            let (seg, off) = split(r.handle);
            let g = guards.iter().find(|(s, _)| *s == seg)?;
            g.1.words().get(off / 8..(off + r.len) / 8)
        };
        let mut copies: Vec<PlaceRun<'_>> = Vec::new();
        if copies.try_reserve_exact(runs.len()).is_err() {
            self.write_many(objects.iter().copied());
            return placed;
        }
        runs.retain(|r| {
            targets(r).is_some_and(|to| {
                let reach = placer.reaches(to);
                if reach {
                    copies.push(PlaceRun { from: r.from, to });
                }
                reach
            })
        });
        let landed = !copies.is_empty() && placer.place(&copies);
        placed.refused = !copies.is_empty() && !landed;
        // Let go of the segments before the CPU's writes take them one at a time again (a
        // second read lock of one segment on one thread can wait behind a writer).
        drop(copies);
        drop(guards);
        if !landed {
            self.write_many(objects.iter().copied());
            return placed;
        }
        // The copies have landed: the CPU's stores come after them. Objects of a run get
        // their last word and checksum; all others are written whole.
        let mut next = runs.iter().peekable();
        let mut cursor = self.segments.cursor();
        let mut rewrite = false;
        for (i, &(handle, data, trailer)) in objects.iter().enumerate() {
            while next.peek().is_some_and(|r| r.last < i) {
                next.next();
            }
            let in_run = next.peek().is_some_and(|r| r.first <= i);
            let trailer = trailer.as_ref().map_or(&[][..], |t| &t[..]);
            let (seg, off) = split(handle);
            let Some(to) = cursor
                .words(seg)
                .get(off / 8..(off + data.len() + trailer.len()).div_ceil(8))
            else {
                continue;
            };
            match data {
                ObjectBytes::Bytes(bytes) if in_run => {
                    words::store_bytes_tail(bytes, trailer, to);
                    if next.peek().is_some_and(|r| r.last == i) && !words::holds_whole(bytes, to) {
                        rewrite = true;
                    }
                }
                ObjectBytes::Bytes(bytes) => words::store_bytes(bytes, trailer, to),
                ObjectBytes::Words(from) => words::store_words(from, trailer, to),
            }
        }
        drop(cursor);
        if rewrite {
            tracing::error!(
                "the copy engine's placement does not hold the host's copy of the results: \
                 written again by the CPU"
            );
            self.write_many(objects.iter().copied());
            placed.mismatched = true;
            return placed;
        }
        // The copies may use streaming stores: they land before the entries that publish
        // these objects.
        crate::page::stream_fence();
        placed.runs = runs.len() as u64;
        placed.bytes = runs.iter().map(|r| r.len as u64).sum();
        placed
    }

    /// Groups `objects` into runs the copy engine can place: consecutive objects whose
    /// offsets in the packed results and handles in one segment advance alike. False when
    /// `runs` could not grow.
    fn plan_runs(&self, objects: &[Object<'_>], placer: &dyn Placer, runs: &mut Vec<Run>) -> bool {
        let mut open: Option<Run> = None;
        let close = |run: Option<Run>, runs: &mut Vec<Run>| -> bool {
            match run {
                Some(r) if r.len >= MIN_RUN_BYTES => {
                    if runs.len() == runs.capacity() && runs.try_reserve(runs.len()).is_err() {
                        return false;
                    }
                    runs.push(r);
                    true
                }
                _ => true,
            }
        };
        for (i, &(handle, data, _)) in objects.iter().enumerate() {
            let from = match data {
                ObjectBytes::Bytes(bytes) => placer.packed_offset(bytes),
                ObjectBytes::Words(_) => None,
            }
            // A run is held to the host's copy by its last object's whole words: a block of
            // fewer than 8 bytes has none, and is left to the CPU.
            .filter(|&o| o % 8 == 0 && handle % 8 == 0 && data.len() >= 8);
            let (Some(from), ObjectBytes::Bytes(bytes)) = (from, data) else {
                if !close(open.take(), runs) {
                    return false;
                }
                continue;
            };
            let whole = bytes.len() / 8 * 8;
            let extends = open.as_ref().is_some_and(|r| {
                r.last + 1 == i
                    && split(r.handle).0 == split(handle).0
                    && from > r.from
                    && handle > r.handle
                    && (from - r.from) as u64 == handle - r.handle
            });
            if extends {
                if let Some(r) = open.as_mut() {
                    r.last = i;
                    r.len = from - r.from + whole;
                }
            } else {
                if !close(open.take(), runs) {
                    return false;
                }
                open = Some(Run {
                    first: i,
                    last: i,
                    from,
                    handle,
                    len: whole,
                });
            }
        }
        close(open.take(), runs)
    }
}

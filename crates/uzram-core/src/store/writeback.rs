//! Writeback: pages that went cold (or never compressed) leave RAM for a backing file or
//! partition, packed and sealed (`backing.rs`), and are read from there.
//!
//! A pass picks its candidates oldest first, copies each one's arena object (payload and
//! checksum, as stored: nothing is decoded) into a chunk, writes the chunk in one write, and
//! only then points each page's entry at its place on disk, if the page still holds the
//! object copied (a write in between wins and the disk copy is freed). So a page leaves
//! RAM only after its bytes are on the device, and a daemon killed at any point leaves
//! each page either in RAM or on disk, never neither. The entries live in the persistent
//! table; the blocks' use counts are rebuilt from them when the backing device is attached.
//!
//! A read of a written-back page reads its blocks under the shard's read lock (so they
//! cannot be freed and reused meanwhile), opens the seal, decodes and checks the checksum,
//! as for a page in RAM.
//!
//! The passes themselves are `PageStore` methods, in the store's module (they reach into
//! its shards and arena); this file holds what they take and give.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::backing::{Run, RUNS_IN_FLIGHT};
use super::entry::Slot;
use crate::CoreError;

/// Most pages one scan of the table picks; a pass of more scans again.
pub(super) const PICK_PAGES: usize = 4096;

/// Which pages a writeback pass takes (zram's `writeback type=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritebackCandidates {
    /// Pages unused for at least this many ticks.
    Idle {
        /// Age in ticks.
        min_age: u32,
    },
    /// Pages stored raw.
    Huge,
    /// Pages stored raw that recompression tried and could not shrink.
    Incompressible,
}

/// One writeback pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Writeback {
    /// Which pages.
    pub candidates: WritebackCandidates,
    /// At most this many pages written back.
    pub max_pages: u64,
    /// At most this many bytes written to the backing device (whole blocks).
    pub max_bytes: u64,
}

/// What a pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WrittenBack {
    /// Pages now on the backing device instead of in RAM.
    pub pages: u64,
    /// 4 KiB blocks written.
    pub blocks: u64,
    /// Payload bytes (compressed lengths) the pages held in RAM.
    pub payload_bytes: u64,
    /// Pages written while the pass copied them (they stay in RAM; the disk copy is freed).
    pub raced: u64,
}

/// A page a scan picked. Ordered by preference, so that the least wanted (the youngest, then
/// the highest page) is the heap's top, the one a better candidate replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Pick {
    pub(super) youth: Reverse<u32>,
    pub(super) index: u64,
}

/// What a pass works in, made when the backing device is attached: a pass runs when memory
/// is short (writes wait for the room it makes), and an allocation then could wait for
/// reclaim, which waits for swap writes to this very device. A pass allocated its candidate
/// list (every stored page), a 1 MiB chunk and a bounce buffer: in one guest run of scenario
/// l the room thread sat in `brk`, behind the pool keeper's reclaim, and swap stalled.
#[derive(Debug)]
pub(super) struct Scratch {
    /// The best [`PICK_PAGES`] candidates of a scan.
    pub(super) heap: BinaryHeap<Pick>,
    /// The same, best first.
    pub(super) picked: Vec<Pick>,
    /// The runs written together, and the entry each of their objects' pages had with its
    /// object's fingerprint (`PageStore::fingerprint`).
    pub(super) runs: Vec<Run>,
    pub(super) slots: Vec<Vec<(Slot, u64)>>,
}

impl Scratch {
    /// Bytes a scratch holds (for the daemon's account of what it holds).
    pub const BYTES: usize = RUNS_IN_FLIGHT * Run::BYTES
        + 2 * PICK_PAGES * std::mem::size_of::<Pick>()
        + RUNS_IN_FLIGHT * super::backing::RUN_OBJECTS * std::mem::size_of::<(Slot, u64)>();

    pub(super) fn new() -> Result<Self, CoreError> {
        let mut heap = BinaryHeap::new();
        heap.try_reserve_exact(PICK_PAGES)
            .map_err(|_| CoreError::NoMemory)?;
        let mut picked = Vec::new();
        picked
            .try_reserve_exact(PICK_PAGES)
            .map_err(|_| CoreError::NoMemory)?;
        let mut runs = Vec::new();
        let mut slots = Vec::new();
        runs.try_reserve_exact(RUNS_IN_FLIGHT)
            .map_err(|_| CoreError::NoMemory)?;
        slots
            .try_reserve_exact(RUNS_IN_FLIGHT)
            .map_err(|_| CoreError::NoMemory)?;
        for _ in 0..RUNS_IN_FLIGHT {
            runs.push(Run::new()?);
            let mut s = Vec::new();
            s.try_reserve_exact(super::backing::RUN_OBJECTS)
                .map_err(|_| CoreError::NoMemory)?;
            slots.push(s);
        }
        Ok(Self {
            heap,
            picked,
            runs,
            slots,
        })
    }

    /// Offers a candidate to the scan's heap: kept if there is room or it is better than
    /// the worst kept, which then goes. Allocates nothing.
    pub(super) fn offer(&mut self, pick: Pick, want: usize) {
        if self.heap.len() < want.min(PICK_PAGES) {
            self.heap.push(pick);
        } else if let Some(mut worst) = self.heap.peek_mut() {
            if pick < *worst {
                *worst = pick;
            }
        }
    }

    /// Moves the scan's picks into [`Scratch::picked`], best first.
    pub(super) fn sort_picks(&mut self) {
        self.picked.clear();
        self.picked.extend(self.heap.drain());
        self.picked.sort_unstable();
    }

    /// Blocks the runs' writes take so far.
    pub(super) fn blocks(&self) -> u64 {
        self.runs.iter().map(Run::blocks).sum()
    }

    pub(super) fn clear_runs(&mut self) {
        for (run, slots) in self.runs.iter_mut().zip(&mut self.slots) {
            run.clear();
            slots.clear();
        }
    }
}

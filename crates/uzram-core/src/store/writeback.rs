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
//! The passes are `PageStore` methods, here beside what they take and give; the synchronous
//! read of a written-back page is in `disk_read.rs`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, PoisonError};

use super::backing::{
    Backing, BackingDevice, Nonces, Run, WritebackKey, BLOCK_BYTES, MIN_RUN_BLOCKS, RUNS_IN_FLIGHT,
    RUN_BLOCKS,
};
use super::entry::Slot;
use super::{object_fingerprint, read_lock, PageStore};
use crate::page::PAGE_SIZE;
use crate::CoreError;

/// Most pages one scan of the table picks; a pass of more scans again.
const PICK_PAGES: usize = 4096;

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
struct Pick {
    youth: Reverse<u32>,
    index: u64,
}

/// What a pass works in, made when the backing device is attached: a pass runs when memory
/// is short (writes wait for the room it makes), and an allocation then could wait for
/// reclaim, which waits for swap writes to this very device. A pass allocated its candidate
/// list (every stored page), a 1 MiB chunk and a bounce buffer: in one guest run of scenario
/// l the room thread sat in `brk`, behind the pool keeper's reclaim, and swap stalled.
#[derive(Debug)]
pub(super) struct Scratch {
    /// The best [`PICK_PAGES`] candidates of a scan.
    heap: BinaryHeap<Pick>,
    /// The same, best first.
    picked: Vec<Pick>,
    /// The runs written together, and the entry each of their objects' pages had with its
    /// object's fingerprint (`PageStore::fingerprint`).
    runs: Vec<Run>,
    slots: Vec<Vec<(Slot, u64)>>,
    /// Most blocks a run fills now: halved while the device has no free run that long,
    /// doubled again after a flush whose runs all found their place.
    run_blocks: usize,
}

impl Scratch {
    /// Bytes a scratch holds (for the daemon's account of what it holds).
    pub const BYTES: usize = RUNS_IN_FLIGHT * Run::BYTES
        + 2 * PICK_PAGES * std::mem::size_of::<Pick>()
        + RUNS_IN_FLIGHT * super::backing::RUN_OBJECTS * std::mem::size_of::<(Slot, u64)>();

    fn new() -> Result<Self, CoreError> {
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
            run_blocks: RUN_BLOCKS,
        })
    }

    /// Offers a candidate to the scan's heap: kept if there is room or it is better than
    /// the worst kept, which then goes. Allocates nothing.
    fn offer(&mut self, pick: Pick, want: usize) {
        if self.heap.len() < want.min(PICK_PAGES) {
            self.heap.push(pick);
        } else if let Some(mut worst) = self.heap.peek_mut() {
            if pick < *worst {
                *worst = pick;
            }
        }
    }

    /// Moves the scan's picks into [`Scratch::picked`], best first.
    fn sort_picks(&mut self) {
        self.picked.clear();
        self.picked.extend(self.heap.drain());
        self.picked.sort_unstable();
    }

    /// Blocks the runs' writes take so far.
    fn blocks(&self) -> u64 {
        self.runs.iter().map(Run::blocks).sum()
    }

    fn clear_runs(&mut self) {
        for (run, slots) in self.runs.iter_mut().zip(&mut self.slots) {
            run.clear();
            run.set_cap(self.run_blocks);
            slots.clear();
        }
    }

    /// Halves the runs' size for the next flush; `false` when they are already the smallest.
    fn shorter_runs(&mut self) -> bool {
        if self.run_blocks <= MIN_RUN_BLOCKS {
            return false;
        }
        self.run_blocks = (self.run_blocks / 2).max(MIN_RUN_BLOCKS);
        true
    }

    /// Doubles the runs' size for the next flush, up to [`RUN_BLOCKS`].
    fn longer_runs(&mut self) {
        self.run_blocks = (self.run_blocks * 2).min(RUN_BLOCKS);
    }
}

/// What [`PageStore::copy_out`] did with a page.
enum CopyOut {
    /// Its object is in the run.
    Added,
    /// It holds no object any more (written, discarded, written back).
    Gone,
    /// The run has no room for it: try the next.
    Full,
    /// It would take the pass past its byte budget.
    OverBudget,
}

/// Writeback (`writeback.rs` has the why, `backing.rs` the disk side).
impl PageStore {
    /// Attaches the backing device that written-back pages go to, with the device's key
    /// and nonce counter, and counts the pages a recovered table already has on it.
    /// Returns how many. Fails (and attaches nothing) when one of them lies past the
    /// device's end: the table is not one written for this device.
    pub fn attach_backing(
        &self,
        device: Arc<dyn BackingDevice>,
        key: &WritebackKey,
        nonces: Nonces,
    ) -> Result<u64, CoreError> {
        let backing = Backing::new(device, key, nonces)?;
        let scratch = Scratch::new()?;
        let mut adopted = 0;
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = read_lock(shard);
            for (idx, slot) in shard.slots() {
                if let Slot::Backed { at, len, .. } = slot {
                    if !backing.adopt(self.on_disk(at, usize::from(len))) {
                        return Err(CoreError::Damaged(format!(
                            "page {} was written back past the end of the {}-byte backing device",
                            self.page_at(s, idx),
                            backing.capacity()
                        )));
                    }
                    adopted += 1;
                }
            }
        }
        self.backing
            .set(backing)
            .map_err(|_| CoreError::Config("a backing device is already attached".into()))?;
        let _ = self.pass.set(std::sync::Mutex::new(scratch));
        Ok(adopted)
    }

    /// Bytes written to the backing device so far (0 without one): a pass's writes are the
    /// difference across it, also where the pass failed partway.
    pub fn backing_bytes_written(&self) -> u64 {
        self.backing.get().map_or(0, |b| {
            b.counters
                .bytes_written
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    }

    /// Marks every block of the backing device that holds no live object for release by
    /// [`PageStore::release_freed_blocks`], and returns how many: after a takeover, the
    /// blocks the dead daemon freed but had not released yet, and those of earlier devices
    /// on the same file or partition, would otherwise keep their space (and their
    /// ciphertext) until taken again. 0 without a backing device.
    pub fn mark_unused_blocks_for_release(&self) -> u64 {
        self.backing.get().map_or(0, Backing::mark_unused)
    }

    /// Readies the calling thread for writeback passes before memory runs short (see
    /// [`BackingDevice::prepare_thread`]); nothing without a backing device. Every thread
    /// that runs passes calls it once at its start.
    pub fn prepare_backing_thread(&self) {
        if let Some(backing) = self.backing.get() {
            backing.prepare_thread();
        }
    }

    /// Whether a backing device is attached.
    pub fn has_backing(&self) -> bool {
        self.backing.get().is_some()
    }

    /// Gives the space of written-back blocks that emptied (overwrites, discards, passes'
    /// races, reads that held them) back to the backing device; returns how many. It can
    /// wait for the device for long under memory pressure: call it from a thread that no
    /// request and no writeback pass waits for.
    pub fn release_freed_blocks(&self) -> u64 {
        self.backing.get().map_or(0, Backing::release_freed)
    }

    /// Whether reads of written-back pages can go to the backing device's file descriptor
    /// directly ([`PageStore::read_deferring`]).
    pub fn backing_reads_directly(&self) -> bool {
        self.backing_read_fd().is_some()
    }

    /// The backing device's file descriptor, where reads of written-back pages may go
    /// through the caller's own I/O ([`BackingDevice::fd`]).
    pub fn backing_read_fd(&self) -> Option<i32> {
        self.backing.get().and_then(|b| b.fd())
    }

    /// Bytes the buffers of writeback passes take, made when a backing device is attached.
    pub const WRITEBACK_SCRATCH_BYTES: usize = Scratch::BYTES;

    /// Bytes of the records attaching a backing device of `blocks` blocks allocates (a use
    /// count and a release bit a block; the nonce floors, 8 bytes a block, are the caller's
    /// when it keeps them, [`Nonces::Kept`], and allocated here as well otherwise).
    pub fn backing_records_bytes(blocks: u64) -> u64 {
        Backing::records_bytes(blocks)
    }

    /// One writeback pass over the pages `pass` selects, oldest first. It runs on the
    /// calling thread, allocates nothing (`writeback.rs`), and holds a shard's lock only to
    /// copy an object out and to switch an entry. Objects go in runs of up to
    /// [`RUN_BLOCKS`] blocks, [`RUNS_IN_FLIGHT`] runs written at once.
    pub fn writeback(&self, pass: Writeback) -> Result<WrittenBack, CoreError> {
        let (Some(backing), Some(scratch)) = (self.backing.get(), self.pass.get()) else {
            return Err(CoreError::Config(
                "this device has no backing device (writeback-device)".into(),
            ));
        };
        let mut scratch = scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &mut *scratch;
        let max_pages = usize::try_from(pass.max_pages).unwrap_or(usize::MAX);
        let mut done = WrittenBack::default();
        let mut taken = 0usize;
        let mut failed = None;
        'scans: while taken < max_pages {
            let want = (max_pages - taken).min(PICK_PAGES);
            self.pick(pass.candidates, want, s);
            let found = s.picked.len();
            if found == 0 {
                break;
            }
            let before = done.pages;
            let mut shortened = false;
            let mut cur = 0;
            for i in 0..found {
                let index = s.picked[i].index;
                loop {
                    match self.copy_out(s, cur, index, done.blocks, pass.max_bytes) {
                        CopyOut::Added => taken += 1,
                        CopyOut::Gone => {}
                        CopyOut::Full => {
                            cur += 1;
                            if cur == s.runs.len() {
                                match self.flush_runs(backing, s, &mut done) {
                                    Ok(shorter) => shortened |= shorter,
                                    Err(e) => {
                                        failed = Some(e);
                                        break 'scans;
                                    }
                                }
                                cur = 0;
                            }
                            continue;
                        }
                        CopyOut::OverBudget => {
                            if let Err(e) = self.flush_runs(backing, s, &mut done) {
                                failed = Some(e);
                            }
                            break 'scans;
                        }
                    }
                    break;
                }
            }
            match self.flush_runs(backing, s, &mut done) {
                Ok(shorter) => shortened |= shorter,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            // Pages whose runs found no place stay in RAM, and the next scan picks them
            // again for shorter runs (halved at most a few times: no endless loop).
            if !shortened && (found < want || done.pages == before) {
                break;
            }
        }
        match failed {
            // What was written stays written (its pages' entries point at it): the pass
            // made that much room, and says so.
            Some(e) if done.pages > 0 => {
                tracing::warn!(error = %e, pages = done.pages, "a writeback pass ended early");
                Ok(done)
            }
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// [`PageStore::flush`], and the runs' size after it: where the device had no free run
    /// as long as one of them, the next runs are half as long (`Ok(true)`; those pages stay
    /// in RAM) until [`MIN_RUN_BLOCKS`], which failing fails the pass; after a flush whose
    /// runs all found their place, twice as long again.
    fn flush_runs(
        &self,
        backing: &Backing,
        s: &mut Scratch,
        done: &mut WrittenBack,
    ) -> Result<bool, CoreError> {
        if s.runs.iter().all(|r| r.is_empty()) {
            return Ok(false);
        }
        match self.flush(backing, s, done) {
            Ok(()) => {
                s.longer_runs();
                s.clear_runs();
                Ok(false)
            }
            Err(CoreError::BackingFull { .. }) if s.shorter_runs() => {
                s.clear_runs();
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }

    /// One scan: the best `want` (at most [`PICK_PAGES`]) pages the candidates name, into
    /// `s.picked`, oldest first.
    fn pick(&self, candidates: WritebackCandidates, want: usize, s: &mut Scratch) {
        s.heap.clear();
        for (sh, shard) in self.shards.iter().enumerate() {
            let shard = read_lock(shard);
            for (idx, slot) in shard.slots() {
                let Slot::Stored { len, .. } = slot else {
                    continue;
                };
                let index = self.page_at(sh, idx);
                let age = self.ages.age(index);
                let huge = usize::from(len) == PAGE_SIZE;
                let wanted = match candidates {
                    WritebackCandidates::Idle { min_age } => age >= min_age,
                    WritebackCandidates::Huge => huge,
                    WritebackCandidates::Incompressible => huge && self.ages.tried(index),
                };
                if wanted {
                    s.offer(
                        Pick {
                            youth: std::cmp::Reverse(age),
                            index,
                        },
                        want,
                    );
                }
            }
        }
        s.sort_picks();
    }

    /// Copies page `index`'s object into run `cur` of `s`, if the page still holds one, it
    /// fits, and the writes stay within `max_bytes` (`written` blocks gone already).
    fn copy_out(
        &self,
        s: &mut Scratch,
        cur: usize,
        index: u64,
        written: u64,
        max_bytes: u64,
    ) -> CopyOut {
        let (shard, idx) = self.locate(index);
        let shard = read_lock(shard);
        let Some(
            slot @ Slot::Stored {
                handle,
                len,
                recompressed,
                ..
            },
        ) = shard.get(idx)
        else {
            return CopyOut::Gone;
        };
        let bytes = self.object_len(usize::from(len));
        let run = &s.runs[cur];
        if !run.fits(bytes) {
            return CopyOut::Full;
        }
        let blocks = written + s.blocks() - run.blocks() + run.blocks_with(bytes);
        if blocks.saturating_mul(BLOCK_BYTES as u64) > max_bytes {
            return CopyOut::OverBudget;
        }
        let run = &mut s.runs[cur];
        let mut fingerprint = 0;
        if !run.push(index, bytes, recompressed, |dst| {
            let loaded = self.arena.load(handle, bytes, dst);
            fingerprint = object_fingerprint(dst);
            loaded
        }) {
            return CopyOut::Gone;
        }
        s.slots[cur].push((slot, fingerprint));
        CopyOut::Added
    }

    /// Writes the runs' objects and points their pages at them; empties the runs.
    fn flush(
        &self,
        backing: &Backing,
        s: &mut Scratch,
        done: &mut WrittenBack,
    ) -> Result<(), CoreError> {
        if s.runs.iter().all(|r| r.is_empty()) {
            return Ok(());
        }
        let written = backing.write_runs(&mut s.runs);
        for (run, slots) in s.runs.iter().zip(&s.slots) {
            if !run.written() {
                continue;
            }
            done.blocks += run.blocks();
            for (o, &(slot, fingerprint)) in slots.iter().enumerate() {
                let (
                    Some(at),
                    Slot::Stored {
                        len, recompressed, ..
                    },
                ) = (run.placed(o), slot)
                else {
                    continue;
                };
                let index = run.index(o);
                let new = Slot::Backed {
                    at: at.at,
                    len,
                    recompressed,
                };
                match self.switch(index, slot, fingerprint, new, false) {
                    Ok(true) => {
                        done.pages += 1;
                        done.payload_bytes += u64::from(len);
                    }
                    _ => {
                        backing.free(at);
                        done.raced += 1;
                    }
                }
            }
        }
        s.clear_runs();
        written
    }
}

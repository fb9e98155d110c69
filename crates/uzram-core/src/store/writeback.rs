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

use super::backing::{BLOCK_BYTES, CHUNK_BLOCKS, SEAL_BYTES};
use super::entry::Slot;

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

/// Objects copied out for one write.
#[derive(Default)]
pub(super) struct Chunk {
    pub(super) bytes: Vec<u8>,
    pub(super) items: Vec<Item>,
}

/// A page in a [`Chunk`]: the entry it had when copied, and where its bytes are.
pub(super) struct Item {
    pub(super) index: u64,
    pub(super) slot: Slot,
    pub(super) range: std::ops::Range<usize>,
}

impl Chunk {
    pub(super) fn fits(&self, bytes: usize) -> bool {
        self.blocks_with(bytes) <= CHUNK_BLOCKS as u64
    }

    /// Blocks the chunk's write takes.
    pub(super) fn blocks(&self) -> u64 {
        Self::blocks_for(self.items.len(), self.bytes.len())
    }

    /// Blocks the chunk's write takes with an object of `bytes` more.
    pub(super) fn blocks_with(&self, bytes: usize) -> u64 {
        Self::blocks_for(self.items.len() + 1, self.bytes.len() + bytes)
    }

    /// Blocks that `objects` objects of `bytes` in all take, each sealed.
    fn blocks_for(objects: usize, bytes: usize) -> u64 {
        (bytes + objects * SEAL_BYTES).div_ceil(BLOCK_BYTES) as u64
    }

    pub(super) fn push(&mut self, index: u64, slot: Slot, bytes: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        self.items.push(Item {
            index,
            slot,
            range: start..self.bytes.len(),
        });
    }
}

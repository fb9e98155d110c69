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

use std::sync::Arc;

use super::backing::{Backing, BackingDevice, NonceCounter, OnDisk, Outgoing, WritebackKey};
use super::entry::Slot;
use super::BLOCK_BYTES;
use super::{cost_of, read_lock, worker, write_lock, PageStore, CHECKSUM_BYTES, CHUNK_BLOCKS};
use crate::page::PAGE_SIZE;
use crate::CoreError;

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

impl PageStore {
    /// Attaches the backing device that written-back pages go to, with the device's key
    /// and nonce counter, and counts the pages a recovered table already has on it.
    /// Returns how many. Fails (and attaches nothing) when one of them lies past the
    /// device's end: the table is not one written for this device.
    pub fn attach_backing(
        &self,
        device: Arc<dyn BackingDevice>,
        key: &WritebackKey,
        nonces: NonceCounter,
    ) -> Result<u64, CoreError> {
        let backing = Backing::new(device, key, nonces)?;
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
        Ok(adopted)
    }

    /// Whether a backing device is attached.
    pub fn has_backing(&self) -> bool {
        self.backing.get().is_some()
    }

    /// One writeback pass over the pages `pass` selects, oldest first. Off the I/O path:
    /// it runs on the calling thread and holds a shard's lock only to copy an object out
    /// and to switch an entry.
    pub fn writeback(&self, pass: Writeback) -> Result<WrittenBack, CoreError> {
        let backing = self.backing.get().ok_or_else(|| {
            CoreError::Config("this device has no backing device (writeback-device)".into())
        })?;
        let mut picked = self.writeback_candidates(pass)?;
        picked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        picked.truncate(usize::try_from(pass.max_pages).unwrap_or(usize::MAX));
        let mut done = WrittenBack::default();
        let mut chunk = Chunk::default();
        let mut object = [0u8; PAGE_SIZE + CHECKSUM_BYTES];
        for &(_, index) in &picked {
            let (shard, idx) = self.locate(index);
            let slot = {
                let shard = read_lock(shard);
                let Some(slot @ Slot::Stored { handle, len, .. }) = shard.get(idx) else {
                    continue;
                };
                let bytes = self.object_len(usize::from(len));
                if !self.arena.load(handle, bytes, &mut object[..bytes]) {
                    continue;
                }
                slot
            };
            let Slot::Stored { len, .. } = slot else {
                continue;
            };
            let bytes = &object[..self.object_len(usize::from(len))];
            if !chunk.fits(bytes.len()) {
                self.flush(backing, &mut chunk, &mut done)?;
            }
            if (done.blocks + chunk.blocks_with(bytes.len())) * BLOCK_BYTES as u64 > pass.max_bytes
            {
                break;
            }
            chunk.push(index, slot, bytes);
        }
        self.flush(backing, &mut chunk, &mut done)?;
        Ok(done)
    }

    /// `(age, page)` of every page `pass` would take.
    fn writeback_candidates(&self, pass: Writeback) -> Result<Vec<(u32, u64)>, CoreError> {
        let mut picked = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = read_lock(shard);
            for (idx, slot) in shard.slots() {
                let Slot::Stored { len, .. } = slot else {
                    continue;
                };
                let index = self.page_at(s, idx);
                let age = self.ages.age(index);
                let huge = usize::from(len) == PAGE_SIZE;
                let wanted = match pass.candidates {
                    WritebackCandidates::Idle { min_age } => age >= min_age,
                    WritebackCandidates::Huge => huge,
                    WritebackCandidates::Incompressible => huge && self.ages.tried(index),
                };
                if wanted {
                    picked.try_reserve(1).map_err(|_| CoreError::NoMemory)?;
                    picked.push((age, index));
                }
            }
        }
        Ok(picked)
    }

    /// Writes the chunk's objects and points their pages at them.
    fn flush(
        &self,
        backing: &Backing,
        chunk: &mut Chunk,
        done: &mut WrittenBack,
    ) -> Result<(), CoreError> {
        if chunk.items.is_empty() {
            return Ok(());
        }
        let outgoing: Vec<Outgoing<'_>> = chunk
            .items
            .iter()
            .map(|it| Outgoing {
                index: it.index,
                bytes: &chunk.bytes[it.range.clone()],
                recompressed: matches!(
                    it.slot,
                    Slot::Stored {
                        recompressed: true,
                        ..
                    }
                ),
            })
            .collect();
        let placed = backing.write(&outgoing)?;
        done.blocks += outgoing
            .iter()
            .map(|o| o.bytes.len() + super::SEAL_BYTES)
            .sum::<usize>()
            .div_ceil(BLOCK_BYTES) as u64;
        for (it, at) in chunk.items.iter().zip(placed) {
            let Slot::Stored {
                len, recompressed, ..
            } = it.slot
            else {
                continue;
            };
            let new = Slot::Backed {
                at: at.at,
                len,
                recompressed,
            };
            if self.switch(it.index, it.slot, new)? {
                done.pages += 1;
                done.payload_bytes += u64::from(len);
            } else {
                backing.free(at);
                done.raced += 1;
            }
        }
        chunk.items.clear();
        chunk.bytes.clear();
        Ok(())
    }

    /// Points page `index` at `new` if it still holds `expected`, and frees what
    /// `expected` held. `Ok(false)`: a write came first and nothing changed.
    fn switch(&self, index: u64, expected: Slot, new: Slot) -> Result<bool, CoreError> {
        let (shard, idx) = self.locate(index);
        let mut shard = write_lock(shard);
        if shard.get(idx) != Some(expected) || shard.set(idx, new)?.is_none() {
            return Ok(false);
        }
        shard.totals.replace(cost_of(expected), cost_of(new));
        drop(shard);
        self.free_slot(expected);
        Ok(true)
    }

    /// Reads written-back page `index` (`len` stored bytes at byte `at` of the backing
    /// device) into `page`. The caller holds the page's shard lock.
    pub(super) fn read_backed(
        &self,
        index: u64,
        at: u64,
        len: usize,
        recompressed: bool,
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CoreError> {
        let Some(backing) = self.backing.get() else {
            return Err(self.failed_check(super::corrupt(
                index,
                "it was written back, and this device has no backing device attached",
            )));
        };
        let mut object = [0u8; PAGE_SIZE + CHECKSUM_BYTES];
        let disk = self.on_disk(at, len);
        backing
            .read(index, disk, recompressed, &mut object)
            .map_err(|e| match e {
                CoreError::Corrupt { .. } => self.failed_check(e),
                other => other,
            })?;
        let stored = if self.checksums {
            let mut c = [0u8; CHECKSUM_BYTES];
            c.copy_from_slice(&object[len..len + CHECKSUM_BYTES]);
            u32::from_le_bytes(c)
        } else {
            0
        };
        let body = &object[..len];
        let corrupt = |source| CoreError::Corrupt { index, source };
        let decoded = if len == PAGE_SIZE {
            page.copy_from_slice(body);
            Ok(())
        } else if recompressed {
            worker::with_recompressed_decoder(|d, _| d.decompress(body, page).map_err(corrupt))
        } else {
            worker::with_codec(self.algorithm, |c, _| {
                c.decompress(body, page).map_err(corrupt)
            })
        };
        decoded.map_err(|e| self.failed_check(e))?;
        self.verify(index, page, stored)
    }

    /// Where a written-back object of `len` stored bytes at byte `at` lies.
    pub(super) fn on_disk(&self, at: u64, len: usize) -> OnDisk {
        OnDisk {
            at,
            bytes: self.object_len(len),
        }
    }
}

/// Objects copied out for one write.
#[derive(Default)]
struct Chunk {
    bytes: Vec<u8>,
    items: Vec<Item>,
}

struct Item {
    index: u64,
    slot: Slot,
    range: std::ops::Range<usize>,
}

impl Chunk {
    fn fits(&self, bytes: usize) -> bool {
        self.blocks_with(bytes) <= CHUNK_BLOCKS as u64
    }

    /// Blocks the chunk's write takes with an object of `bytes` more.
    fn blocks_with(&self, bytes: usize) -> u64 {
        let sealed = self.bytes.len() + (self.items.len() + 1) * super::SEAL_BYTES + bytes;
        sealed.div_ceil(BLOCK_BYTES) as u64
    }

    fn push(&mut self, index: u64, slot: Slot, bytes: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        self.items.push(Item {
            index,
            slot,
            range: start..self.bytes.len(),
        });
    }
}

//! Reads of written-back pages that the caller does itself, through its own io_uring, so
//! that a page on the backing device never holds up the other requests of its queue.
//!
//! [`PageStore::read_deferring`] reads a request's pages like [`PageStore::read`], except
//! that it hands each written-back page to the caller as a [`DiskRead`]: which blocks to
//! read from which file descriptor. The object's blocks are held meanwhile (a block in use
//! is never released nor taken again), so the read finds the object it was handed even if
//! the page is written or discarded in between: it then returns what the page held when
//! the read began, as any read that races a write of the same page may. The caller brings
//! the blocks back to [`PageStore::finish_disk_read`], which opens the seal, decodes and
//! checks the page as a read of a page in RAM does, or gives the read up with
//! [`PageStore::cancel_disk_read`]; either drops the hold.

use super::backing::OnDisk;
use super::entry::Slot;
use super::{corrupt, read_lock, PageStore, CHECKSUM_BYTES, MAX_OBJECT_BLOCKS};
use crate::page::PAGE_SIZE;
use crate::CoreError;

/// A written-back page for the caller to read from the backing device; see the module docs.
/// Finish or cancel every one: its blocks stay held until then.
#[derive(Debug)]
#[must_use = "a DiskRead holds its blocks until finished or cancelled"]
pub struct DiskRead {
    index: u64,
    at: OnDisk,
    recompressed: bool,
    fd: i32,
}

impl DiskRead {
    /// The page it reads.
    pub fn page(&self) -> u64 {
        self.index
    }

    /// The file descriptor to read from ([`super::BackingDevice::fd`]).
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// Byte offset of the first block to read.
    pub fn offset(&self) -> u64 {
        *self.at.blocks().start() * super::BLOCK_BYTES as u64
    }

    /// Bytes to read: whole blocks, at most [`MAX_OBJECT_BLOCKS`] of them.
    pub fn bytes(&self) -> usize {
        self.at.block_count() * super::BLOCK_BYTES
    }
}

impl PageStore {
    /// Reads pages from `first_page` into `out` like [`PageStore::read`], except that each
    /// written-back page `i` of the request (`out[i * PAGE_SIZE..]`) is offered to `defer`
    /// as a [`DiskRead`] instead of being read here; `defer` gives it back when it cannot
    /// take it (the page is then read here, synchronously). Without a backing device that
    /// gives a file descriptor, it is [`PageStore::read`]. On an error, reads already
    /// deferred stay the caller's.
    pub fn read_deferring(
        &self,
        first_page: u64,
        out: &mut [u8],
        defer: &mut dyn FnMut(usize, DiskRead) -> Result<(), DiskRead>,
    ) -> Result<(), CoreError> {
        let Some(fd) = self.backing.get().and_then(|b| b.fd()) else {
            return self.read(first_page, out);
        };
        let count = self.check_buffer(first_page, out.len())?;
        for (i, page) in out.chunks_exact_mut(PAGE_SIZE).enumerate() {
            let page: &mut [u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: PAGE_SIZE })?;
            let index = first_page + i as u64;
            if let Some(read) = self.hold_backed(index, fd) {
                self.ages.read(index);
                match defer(i, read) {
                    Ok(()) => continue,
                    Err(read) => self.cancel_disk_read(read),
                }
            }
            self.read_page(index, page)?;
        }
        super::stats::Counters::bump(&self.counters.reads, count);
        Ok(())
    }

    /// Page `index`'s disk read, its blocks held, if it is written back (and its entry is
    /// sound: a damaged one is left to the synchronous read, which reports it).
    fn hold_backed(&self, index: u64, fd: i32) -> Option<DiskRead> {
        let backing = self.backing.get()?;
        let (shard, idx) = self.locate(index);
        let shard = read_lock(shard);
        let Some(Slot::Backed {
            at,
            len,
            recompressed,
        }) = shard.get(idx)
        else {
            return None;
        };
        let at = self.on_disk(at, usize::from(len));
        if at.block_count() > MAX_OBJECT_BLOCKS || !backing.hold(at) {
            return None;
        }
        Some(DiskRead {
            index,
            at,
            recompressed,
            fd,
        })
    }

    /// Finishes `read` with `blocks` (its [`DiskRead::bytes`] bytes as read from its offset):
    /// opens the seal, decodes the page into `page` and checks it. A block changed on disk,
    /// or not this page's, fails with [`CoreError::Corrupt`] (counted as a failed check).
    pub fn finish_disk_read(
        &self,
        read: DiskRead,
        blocks: &mut [u8],
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CoreError> {
        let Some(backing) = self.backing.get() else {
            return Err(CoreError::Config("no backing device".into()));
        };
        let mut object = [0u8; PAGE_SIZE + CHECKSUM_BYTES];
        let len = read.at.bytes - if self.checksums { CHECKSUM_BYTES } else { 0 };
        let opened = backing
            .open(read.index, read.at, read.recompressed, blocks, &mut object)
            .map_err(|e| self.failed_check(e));
        backing.free(read.at);
        opened?;
        self.finish_object(read.index, &object, len, read.recompressed, page)
    }

    /// Gives `read` up: its blocks are no longer held.
    pub fn cancel_disk_read(&self, read: DiskRead) {
        if let Some(backing) = self.backing.get() {
            backing.free(read.at);
        }
    }
}

/// Reads of written-back pages on the calling thread.
impl PageStore {
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
            return Err(self.failed_check(corrupt(
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
        self.finish_object(index, &object, len, recompressed, page)
    }

    /// Decodes a written-back object (`object`: its `len` payload bytes and the checksum
    /// after them), as opened from its seal, into `page` and checks it.
    fn finish_object(
        &self,
        index: u64,
        object: &[u8; PAGE_SIZE + CHECKSUM_BYTES],
        len: usize,
        recompressed: bool,
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CoreError> {
        let stored = if self.checksums {
            let mut c = [0u8; CHECKSUM_BYTES];
            c.copy_from_slice(&object[len..len + CHECKSUM_BYTES]);
            self.bound_checksum(index, u32::from_le_bytes(c))
        } else {
            0
        };
        self.decode(index, &object[..len], recompressed, page)
            .map_err(|e| self.failed_check(e))?;
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

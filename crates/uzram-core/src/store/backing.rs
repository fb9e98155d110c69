//! Writeback's disk side: compressed objects packed into 4 KiB blocks of a backing file or
//! partition, each sealed with ChaCha20-Poly1305, and which blocks still hold a live object.
//!
//! - **Packed.** A writeback pass writes its objects back to back into a run of free blocks
//!   (one write of up to [`CHUNK_BLOCKS`] blocks); an object may cross a block boundary.
//!   zram pads every page to a block; this costs an object its bytes plus [`SEAL_BYTES`].
//! - **Sealed.** On disk an object is `nonce (8 bytes) ‖ ciphertext ‖ tag (16 bytes)`. The
//!   key is random per device and never written to the backing device (the daemon keeps it
//!   in its locked memory and its root-only store segment). The nonce comes from a counter
//!   that only goes up (kept with the key, so a recovered daemon goes on from it: a nonce is
//!   never used twice under one key). The associated data is the page's index and the
//!   object's place and form, so a block that was changed, moved, or is read for another
//!   page fails its tag: an I/O error, never other data.
//! - **Freed.** Each block counts the live objects that touch it. When the last one goes
//!   (overwrite, discard) the block is released to the device ([`BackingDevice::release`]:
//!   a hole punched in a file, a discard on a partition) and can be written again.
//!
//! Known limit: a block rolled back to an older sealing of the same page at the same place
//! (an attacker who can write the backing device and kept an old copy) still opens; the
//! entry has no room to name the nonce it expects.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::{ChaCha20Poly1305, Key, KeyInit, Nonce, Tag};

use crate::page::PAGE_SIZE;
use crate::CoreError;

/// The backing device's unit of I/O and of freeing.
pub const BLOCK_BYTES: usize = 4096;
/// Bytes an object takes on disk beyond its arena bytes: the nonce and the tag.
pub const SEAL_BYTES: usize = NONCE_BYTES + TAG_BYTES;
/// Most blocks one writeback write covers (1 MiB).
pub const CHUNK_BLOCKS: usize = 256;
/// Bytes of a device key.
pub const KEY_BYTES: usize = 32;
const NONCE_BYTES: usize = 8;
const TAG_BYTES: usize = 16;
/// Most blocks one object can touch: the largest sealed object (a raw page, its checksum
/// and the seal) is under two blocks, so it touches at most three.
const MAX_OBJECT_BLOCKS: usize = 3;

/// A backing file or partition, in [`BLOCK_BYTES`] blocks. The daemon implements it with
/// direct I/O; tests with memory.
pub trait BackingDevice: Send + Sync + fmt::Debug {
    /// Blocks the device holds.
    fn blocks(&self) -> u64;
    /// Writes `data` (whole blocks) from block `first`; returns once the device has it.
    fn write_blocks(&self, first: u64, data: &[u8]) -> io::Result<()>;
    /// Reads whole blocks from block `first` into `out`.
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> io::Result<()>;
    /// Blocks `first..first + count` hold nothing live any more: give their space back.
    fn release(&self, first: u64, count: u64) -> io::Result<()>;
}

/// A device's writeback key. Its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct WritebackKey(pub [u8; KEY_BYTES]);

impl fmt::Debug for WritebackKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WritebackKey(..)")
    }
}

/// The nonce counter: the store's own, or a word the caller keeps beyond the process (the
/// daemon: in the store segment, next to the key).
#[derive(Debug)]
pub enum NonceCounter {
    /// Lives as long as the store.
    Owned(AtomicU64),
    /// Kept by the caller; its value is the next nonce.
    Kept(&'static AtomicU64),
}

impl NonceCounter {
    fn next(&self) -> u64 {
        match self {
            NonceCounter::Owned(w) => w.fetch_add(1, Relaxed),
            NonceCounter::Kept(w) => w.fetch_add(1, Relaxed),
        }
    }
}

/// Where a written-back object is: its first byte on the device and its arena bytes
/// (payload and checksum), the seal not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OnDisk {
    pub at: u64,
    pub bytes: usize,
}

impl OnDisk {
    fn sealed(self) -> usize {
        self.bytes + SEAL_BYTES
    }

    /// The blocks the sealed object touches.
    fn blocks(self) -> std::ops::RangeInclusive<u64> {
        let first = self.at / BLOCK_BYTES as u64;
        let last = (self.at + self.sealed() as u64 - 1) / BLOCK_BYTES as u64;
        first..=last
    }
}

/// An object to write back: the page it belongs to, its arena bytes, and the entry flags
/// the associated data binds it to.
#[derive(Debug)]
pub(crate) struct Outgoing<'a> {
    pub index: u64,
    pub bytes: &'a [u8],
    pub recompressed: bool,
}

/// Cumulative disk traffic, with zram's `bd_stat` meaning (in blocks).
#[derive(Debug, Default)]
pub(crate) struct DiskCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_written: AtomicU64,
    pub failures: AtomicU64,
}

/// The disk side of a store's writeback; see the module docs.
pub(crate) struct Backing {
    device: Arc<dyn BackingDevice>,
    cipher: ChaCha20Poly1305,
    nonces: NonceCounter,
    /// Live objects touching each block.
    users: Box<[AtomicU32]>,
    /// Next-fit cursor; held while blocks are taken and while a freed block is released,
    /// so a block is never released after it was taken again.
    cursor: Mutex<u64>,
    pub counters: DiskCounters,
}

impl fmt::Debug for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backing")
            .field("device", &self.device)
            .field("blocks", &self.users.len())
            .finish_non_exhaustive()
    }
}

impl Backing {
    pub(crate) fn new(
        device: Arc<dyn BackingDevice>,
        key: &WritebackKey,
        nonces: NonceCounter,
    ) -> Result<Self, CoreError> {
        let blocks = usize::try_from(device.blocks())
            .map_err(|_| CoreError::Config("the backing device is too large".into()))?;
        let mut users = Vec::new();
        users
            .try_reserve_exact(blocks)
            .map_err(|_| CoreError::NoMemory)?;
        users.extend((0..blocks).map(|_| AtomicU32::new(0)));
        Ok(Self {
            device,
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key.0)),
            nonces,
            users: users.into_boxed_slice(),
            cursor: Mutex::new(0),
            counters: DiskCounters::default(),
        })
    }

    /// Bytes the device holds.
    pub(crate) fn capacity(&self) -> u64 {
        self.users.len() as u64 * BLOCK_BYTES as u64
    }

    /// Counts an object found in a recovered table as live; `false` if it does not lie
    /// within the device (a damaged entry: the caller refuses the table).
    pub(crate) fn adopt(&self, at: OnDisk) -> bool {
        if at.at.saturating_add(at.sealed() as u64) > self.capacity() {
            return false;
        }
        for b in at.blocks() {
            self.users[b as usize].fetch_add(1, Relaxed);
        }
        true
    }

    /// Seals `objects` into one run of free blocks and writes it; returns where each one
    /// is, in order. Nothing is live on failure.
    pub(crate) fn write(&self, objects: &[Outgoing<'_>]) -> Result<Vec<OnDisk>, CoreError> {
        let total: usize = objects.iter().map(|o| o.bytes.len() + SEAL_BYTES).sum();
        let blocks = total.div_ceil(BLOCK_BYTES);
        if blocks == 0 {
            return Ok(Vec::new());
        }
        let mut buf = Vec::new();
        buf.try_reserve_exact(blocks * BLOCK_BYTES)
            .map_err(|_| CoreError::NoMemory)?;
        buf.resize(blocks * BLOCK_BYTES, 0);
        let first = self.take(blocks)?;
        let base = first * BLOCK_BYTES as u64;
        let mut placed = Vec::with_capacity(objects.len());
        let mut off = 0;
        for o in objects {
            let at = OnDisk {
                at: base + off as u64,
                bytes: o.bytes.len(),
            };
            let nonce = self.nonces.next();
            let sealed = &mut buf[off..off + at.sealed()];
            sealed[..NONCE_BYTES].copy_from_slice(&nonce.to_le_bytes());
            let (body, tag) = sealed[NONCE_BYTES..].split_at_mut(o.bytes.len());
            body.copy_from_slice(o.bytes);
            let Ok(sealed_tag) = self.cipher.encrypt_in_place_detached(
                &nonce_of(nonce),
                &associated(o.index, at, o.recompressed),
                body,
            ) else {
                // Only a message longer than the cipher takes is refused: never one of these.
                self.drop_hold(first, blocks as u64);
                return Err(CoreError::Compress(crate::codec::CodecError::Corrupt(
                    "the writeback cipher refused an object".into(),
                )));
            };
            tag.copy_from_slice(&sealed_tag);
            off += at.sealed();
            placed.push(at);
        }
        // The run is held (a user per block, see `take`) while the objects are sealed:
        // count each object in the blocks it touches, then drop that hold.
        for at in &placed {
            for b in at.blocks() {
                self.users[b as usize].fetch_add(1, Relaxed);
            }
        }
        let written = self.device.write_blocks(first, &buf);
        self.drop_hold(first, blocks as u64);
        if let Err(e) = written {
            for at in &placed {
                self.free(*at);
            }
            self.counters.failures.fetch_add(1, Relaxed);
            return Err(disk_error("write", e));
        }
        self.counters.writes.fetch_add(blocks as u64, Relaxed);
        self.counters
            .bytes_written
            .fetch_add(buf.len() as u64, Relaxed);
        Ok(placed)
    }

    /// Reads the object of page `index` at `at` and opens its seal into `out[..at.bytes]`.
    pub(crate) fn read(
        &self,
        index: u64,
        at: OnDisk,
        recompressed: bool,
        out: &mut [u8],
    ) -> Result<(), CoreError> {
        let blocks = at.blocks();
        let n = (blocks.end() - blocks.start() + 1) as usize;
        let mut buf = [0u8; MAX_OBJECT_BLOCKS * BLOCK_BYTES];
        let (Some(buf), Some(out)) = (buf.get_mut(..n * BLOCK_BYTES), out.get_mut(..at.bytes))
        else {
            return Err(self.failed(index, "its disk entry is damaged"));
        };
        if at.at.saturating_add(at.sealed() as u64) > self.capacity() {
            return Err(self.failed(index, "its disk entry points past the backing device"));
        }
        if let Err(e) = self.device.read_blocks(*blocks.start(), buf) {
            self.counters.failures.fetch_add(1, Relaxed);
            return Err(disk_error("read", e));
        }
        self.counters.reads.fetch_add(n as u64, Relaxed);
        let start = (at.at % BLOCK_BYTES as u64) as usize;
        let sealed = &mut buf[start..start + at.sealed()];
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&sealed[..NONCE_BYTES]);
        let (body, tag) = sealed[NONCE_BYTES..].split_at_mut(at.bytes);
        let opened = self.cipher.decrypt_in_place_detached(
            &nonce_of(u64::from_le_bytes(nonce)),
            &associated(index, at, recompressed),
            body,
            Tag::from_slice(tag),
        );
        if opened.is_err() {
            return Err(self.failed(
                index,
                "its written-back block fails its tag (changed on disk, or not this page's)",
            ));
        }
        out.copy_from_slice(body);
        Ok(())
    }

    /// The object at `at` is gone: its blocks lose a user, and blocks left with none are
    /// released.
    pub(crate) fn free(&self, at: OnDisk) {
        let mut emptied = [0u64; MAX_OBJECT_BLOCKS];
        let mut n = 0;
        for b in at.blocks() {
            let Some(users) = self.users.get(b as usize) else {
                continue;
            };
            if users.fetch_sub(1, Relaxed) == 1 && n < emptied.len() {
                emptied[n] = b;
                n += 1;
            }
        }
        if n > 0 {
            let _cursor = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
            for &b in &emptied[..n] {
                // Taken again since it emptied: it is someone else's now.
                if self.users[b as usize].load(Relaxed) == 0 {
                    if let Err(e) = self.device.release(b, 1) {
                        tracing::warn!(block = b, error = %e, "releasing a written-back block failed");
                    }
                }
            }
        }
    }

    /// Takes a run of `n` free blocks (next fit, wrapping once) and holds each with one
    /// user until [`Backing::drop_hold`].
    fn take(&self, n: usize) -> Result<u64, CoreError> {
        let total = self.users.len();
        let mut cursor = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        let start = (*cursor as usize).min(total);
        let mut run = 0;
        let mut b = start;
        let mut scanned = 0;
        while scanned < total + n {
            if b == total {
                b = 0;
                run = 0;
            }
            if self.users[b].load(Relaxed) == 0 {
                run += 1;
                if run == n {
                    let first = b + 1 - n;
                    for u in &self.users[first..=b] {
                        u.fetch_add(1, Relaxed);
                    }
                    *cursor = (b + 1) as u64;
                    return Ok(first as u64);
                }
            } else {
                run = 0;
            }
            b += 1;
            scanned += 1;
        }
        Err(CoreError::BackingFull {
            blocks: n as u64,
            capacity: total as u64,
        })
    }

    /// Drops the hold [`Backing::take`] put on a run; blocks no object ended up in (none,
    /// when the objects fill the run) are released.
    fn drop_hold(&self, first: u64, n: u64) {
        for b in first..first + n {
            if self.users[b as usize].fetch_sub(1, Relaxed) == 1 {
                let _cursor = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
                if self.users[b as usize].load(Relaxed) == 0 {
                    let _ = self.device.release(b, 1);
                }
            }
        }
    }

    fn failed(&self, index: u64, what: &str) -> CoreError {
        self.counters.failures.fetch_add(1, Relaxed);
        CoreError::Corrupt {
            index,
            source: crate::codec::CodecError::Corrupt(what.into()),
        }
    }
}

fn nonce_of(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&counter.to_le_bytes());
    *Nonce::from_slice(&n)
}

/// What a sealed object is bound to: its page, its place, its length and its form.
fn associated(index: u64, at: OnDisk, recompressed: bool) -> [u8; 24] {
    let mut a = [0u8; 24];
    a[..8].copy_from_slice(&index.to_le_bytes());
    a[8..16].copy_from_slice(&at.at.to_le_bytes());
    a[16..20].copy_from_slice(&(at.bytes as u32).to_le_bytes());
    a[20] = u8::from(recompressed);
    a
}

fn disk_error(what: &str, e: io::Error) -> CoreError {
    CoreError::Backend {
        backend: "writeback",
        reason: format!("backing device {what} failed: {e}"),
    }
}

/// Largest arena object (a raw page and its checksum) sealed: under two blocks.
const _: () = assert!(PAGE_SIZE + 8 + SEAL_BYTES <= 2 * BLOCK_BYTES);

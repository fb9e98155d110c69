//! Writeback's disk side: compressed objects packed into 4 KiB blocks of a backing file or
//! partition, each sealed with ChaCha20-Poly1305, and which blocks still hold a live object.
//!
//! - **Packed.** A writeback pass writes its objects back to back into runs of free blocks
//!   (one write of up to [`RUN_BLOCKS`] blocks each, [`RUNS_IN_FLIGHT`] of them in flight
//!   at once); an object may cross a block boundary. zram pads every page to a block; this
//!   costs an object its bytes plus [`SEAL_BYTES`].
//! - **Made once.** A pass runs when memory is short (a write waits for its room), so it
//!   allocates nothing: its runs ([`Run`]) are made when the device is attached, block-aligned
//!   for direct I/O, and the objects are copied into them and sealed in place.
//! - **Sealed.** On disk an object is `nonce (8 bytes) ‖ ciphertext ‖ tag (16 bytes)`. The
//!   key is random per device and never written to the backing device (the daemon keeps it
//!   in its locked memory and its root-only store segment). The nonce comes from a counter
//!   that only goes up (kept with the key, so a recovered daemon goes on from it: a nonce is
//!   never used twice under one key). The associated data is the page's index and the
//!   object's place and form, so a block that was changed, moved, or is read for another
//!   page fails its tag: an I/O error, never other data.
//! - **Freed.** Each block counts the live objects that touch it. When the last one goes
//!   (overwrite, discard) the block can be written again, and its space is given back to
//!   the device ([`BackingDevice::release`]: a hole punched in a file, a discard on a
//!   partition) later, by a thread nothing waits for ([`Backing::release_freed`]).
//!
//! - **Never rolled back.** A block's *floor* is the first nonce of the run that last wrote
//!   it, recorded before that write is issued; every object the run holds has a nonce at or
//!   above it, and every older sealing anywhere in the block (the same page at the same
//!   place, from an earlier run: an attacker who can write the backing device and kept a
//!   copy) has one below it, so it fails to open. The 8-byte entry has no room for the
//!   nonce it expects; the floors (8 bytes a block) live beside the key, where a takeover
//!   finds them ([`Nonces::Kept`]).

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::{ChaCha20Poly1305, Key, KeyInit, Nonce, Tag};
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

use crate::page::PAGE_SIZE;
use crate::CoreError;

/// The backing device's unit of I/O and of freeing.
pub const BLOCK_BYTES: usize = 4096;
/// Bytes an object takes on disk beyond its arena bytes: the nonce and the tag.
pub const SEAL_BYTES: usize = NONCE_BYTES + TAG_BYTES;
/// Most blocks one writeback write covers (256 KiB).
pub const RUN_BLOCKS: usize = 64;
/// Fewest blocks a run is cut to where the device has no longer free runs: the largest
/// sealed object (a raw page, its checksum and the seal) fits in two.
pub const MIN_RUN_BLOCKS: usize = 2;
const _: () =
    assert!(PAGE_SIZE + super::CHECKSUM_BYTES + SEAL_BYTES <= MIN_RUN_BLOCKS * BLOCK_BYTES);
/// Writes a pass keeps in flight at once (zram keeps 32 single-block bios; these are runs).
pub const RUNS_IN_FLIGHT: usize = 8;
/// Most objects one run holds, so that its list is made once.
pub(crate) const RUN_OBJECTS: usize = 1024;
/// Bytes of a device key.
pub const KEY_BYTES: usize = 32;
const NONCE_BYTES: usize = 8;
/// Bytes of a Poly1305 tag, as a sealed object and a label's [`WritebackKey::label_tag`] carry.
pub const TAG_BYTES: usize = 16;
/// Most blocks one object can touch: the largest sealed object (a raw page, its checksum
/// and the seal) is under two blocks, so it touches at most three.
pub const MAX_OBJECT_BLOCKS: usize = 3;
/// A block's user count while [`Backing::release_freed`] gives its space back: not free.
const RELEASING: u32 = 1 << 31;
/// Most blocks one release covers (16 MiB): the blocks of a release in flight are not free,
/// and after a takeover most of a device can be one run of unused blocks.
const RELEASE_RUN_BLOCKS: u64 = 4096;

/// A backing file or partition, in [`BLOCK_BYTES`] blocks. The daemon implements it with
/// direct I/O through io_uring; tests with memory.
pub trait BackingDevice: Send + Sync + fmt::Debug {
    /// Blocks the device holds.
    fn blocks(&self) -> u64;
    /// Writes every run (whole blocks from block `first`, block-aligned in memory), as many
    /// in flight at once as the device takes, and returns once each is written or failed:
    /// `failed[i]` (as long as `runs`, `None` on entry) is run `i`'s error.
    fn write_runs(&self, runs: &[BlockRun<'_>], failed: &mut [Option<io::Error>]);
    /// Reads whole blocks from block `first` into `out`.
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> io::Result<()>;
    /// Blocks `first..first + count` hold nothing live any more: give their space back.
    fn release(&self, first: u64, count: u64) -> io::Result<()>;
    /// Readies the calling thread to write through the device later without allocating:
    /// a thread's first submission to an io_uring makes the kernel allocate a context for
    /// it, and a writeback pass runs when memory is short, where that allocation can wait in
    /// reclaim for swap writes to this very device (seen in the guest: the room thread sat
    /// in it while every write waited for room). Default: nothing to ready.
    fn prepare_thread(&self) {}
    /// A file descriptor the caller may read the device's blocks through itself (direct
    /// I/O: block-aligned offsets, lengths and memory), so that a read of a written-back page
    /// can go through the caller's own io_uring instead of [`BackingDevice::read_blocks`].
    /// `None` (the default): reads go through `read_blocks`.
    fn fd(&self) -> Option<i32> {
        None
    }
}

/// One write of a pass: whole blocks from block `first`.
#[derive(Debug, Clone, Copy)]
pub struct BlockRun<'a> {
    /// The first block written.
    pub first: u64,
    /// The blocks' bytes, a multiple of [`BLOCK_BYTES`], aligned to a block in memory.
    pub data: &'a [u8],
}

/// A block's bytes, aligned as direct I/O needs them.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C, align(4096))]
struct Block([u8; BLOCK_BYTES]);

/// An object a [`Run`] holds: its page, where it starts in the run (its seal's first
/// byte), its arena bytes, and the entry flag the associated data binds it to.
#[derive(Debug, Clone, Copy)]
struct Held {
    index: u64,
    off: usize,
    bytes: usize,
    recompressed: bool,
}

/// The blocks of one writeback write, filled with sealed objects back to back. Made once
/// (see the module docs) and reused by every pass.
pub(crate) struct Run {
    blocks: Vec<Block>,
    /// Bytes taken: sealed objects back to back.
    used: usize,
    held: Vec<Held>,
    /// The run's first block once [`Backing::write_runs`] wrote it.
    written: Option<u64>,
    /// Most blocks it fills ([`MIN_RUN_BLOCKS`]..=[`RUN_BLOCKS`]): a device whose free
    /// blocks lie scattered has no free run of [`RUN_BLOCKS`].
    cap: usize,
}

impl fmt::Debug for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Run")
            .field("used", &self.used)
            .field("objects", &self.held.len())
            .field("written", &self.written)
            .finish()
    }
}

impl Run {
    /// Bytes a run takes in memory (for the daemon's account of what it holds).
    pub(crate) const BYTES: usize =
        RUN_BLOCKS * BLOCK_BYTES + RUN_OBJECTS * std::mem::size_of::<Held>();

    pub(crate) fn new() -> Result<Self, CoreError> {
        let mut blocks = Vec::new();
        blocks
            .try_reserve_exact(RUN_BLOCKS)
            .map_err(|_| CoreError::NoMemory)?;
        blocks.extend((0..RUN_BLOCKS).map(|_| Block::new_zeroed()));
        let mut held = Vec::new();
        held.try_reserve_exact(RUN_OBJECTS)
            .map_err(|_| CoreError::NoMemory)?;
        Ok(Self {
            blocks,
            used: 0,
            held,
            written: None,
            cap: RUN_BLOCKS,
        })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Objects in the run.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether an object of `bytes` arena bytes still fits.
    pub(crate) fn fits(&self, bytes: usize) -> bool {
        self.held.len() < RUN_OBJECTS && self.used + bytes + SEAL_BYTES <= self.cap * BLOCK_BYTES
    }

    /// Fills at most `blocks` blocks from the next [`Run::clear`] on (clamped to
    /// [`MIN_RUN_BLOCKS`]..=[`RUN_BLOCKS`]).
    pub(crate) fn set_cap(&mut self, blocks: usize) {
        self.cap = blocks.clamp(MIN_RUN_BLOCKS, RUN_BLOCKS);
    }

    /// Blocks the run's write takes.
    pub(crate) fn blocks(&self) -> u64 {
        self.used.div_ceil(BLOCK_BYTES) as u64
    }

    /// Blocks it would take with an object of `bytes` more.
    pub(crate) fn blocks_with(&self, bytes: usize) -> u64 {
        (self.used + bytes + SEAL_BYTES).div_ceil(BLOCK_BYTES) as u64
    }

    /// Adds page `index`'s object of `bytes` arena bytes, which `fill` copies in (`false`:
    /// it could not, and nothing is added). The caller checked [`Run::fits`].
    pub(crate) fn push(
        &mut self,
        index: u64,
        bytes: usize,
        recompressed: bool,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> bool {
        if !self.fits(bytes) {
            return false;
        }
        let off = self.used;
        let body = off + NONCE_BYTES;
        if !fill(&mut self.blocks.as_mut_bytes()[body..body + bytes]) {
            return false;
        }
        self.held.push(Held {
            index,
            off,
            bytes,
            recompressed,
        });
        self.used += bytes + SEAL_BYTES;
        true
    }

    /// Where object `i` lies on the device once the run was written.
    pub(crate) fn placed(&self, i: usize) -> Option<OnDisk> {
        let first = self.written?;
        let h = self.held.get(i)?;
        Some(OnDisk {
            at: first * BLOCK_BYTES as u64 + h.off as u64,
            bytes: h.bytes,
        })
    }

    /// Page of object `i`.
    pub(crate) fn index(&self, i: usize) -> u64 {
        self.held.get(i).map_or(u64::MAX, |h| h.index)
    }

    /// Whether the last [`Backing::write_runs`] wrote the run.
    pub(crate) fn written(&self) -> bool {
        self.written.is_some()
    }

    /// Empties the run for the next write.
    pub(crate) fn clear(&mut self) {
        self.used = 0;
        self.held.clear();
        self.written = None;
    }
}

/// A device's writeback key. Its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct WritebackKey(pub [u8; KEY_BYTES]);

impl fmt::Debug for WritebackKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WritebackKey(..)")
    }
}

impl WritebackKey {
    /// What a backing device's label carries to name the key its pages are sealed with,
    /// without giving it away: the key's Poly1305 tag of nothing, under a nonce no object
    /// is sealed with (objects' nonces end in four zero bytes, this one in `LABL`). A
    /// takeover reads it back to know that the device a path names now is the one the
    /// store's pages were written to.
    pub fn label_tag(&self) -> [u8; TAG_BYTES] {
        let cipher = ChaCha20Poly1305::new(Key::from_slice(&self.0));
        let mut nonce = [0u8; 12];
        nonce[8..].copy_from_slice(b"LABL");
        let tag = cipher
            .encrypt_in_place_detached(Nonce::from_slice(&nonce), b"uzram writeback label", &mut [])
            // Sealing fails only for a message over ChaCha20's 256 GiB; this one is empty.
            .unwrap_or_default();
        tag.into()
    }
}

/// A device's nonces: the counter (the next nonce) and each block's floor (the lowest nonce
/// an object in it may have, see the module docs).
#[derive(Debug)]
pub enum Nonces {
    /// Both live as long as the store, from 0.
    Owned,
    /// Kept by the caller beyond the process (the daemon: the counter beside the key in the
    /// store segment, the floors in a segment of their own), so that a takeover goes on from
    /// them: `floors` has a word per block of the backing device.
    Kept {
        /// The next nonce.
        next: &'static AtomicU64,
        /// Each block's floor.
        floors: &'static [AtomicU64],
    },
}

/// Words the store owns, or words the caller keeps.
#[derive(Debug)]
enum Words {
    Owned(Box<[AtomicU64]>),
    Kept(&'static [AtomicU64]),
}

impl std::ops::Deref for Words {
    type Target = [AtomicU64];

    fn deref(&self) -> &[AtomicU64] {
        match self {
            Words::Owned(w) => w,
            Words::Kept(w) => w,
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

    /// How many blocks the sealed object touches (at most [`MAX_OBJECT_BLOCKS`] for a
    /// sound entry).
    pub(crate) fn block_count(self) -> usize {
        let b = self.blocks();
        (b.end() - b.start() + 1) as usize
    }

    /// The blocks the sealed object touches.
    pub(crate) fn blocks(self) -> std::ops::RangeInclusive<u64> {
        let first = self.at / BLOCK_BYTES as u64;
        let last = (self.at + self.sealed() as u64 - 1) / BLOCK_BYTES as u64;
        first..=last
    }
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
    /// The next nonce (one word).
    next_nonce: Words,
    /// Each block's floor (module docs).
    floors: Words,
    /// Live objects touching each block.
    users: Box<[AtomicU32]>,
    /// Next-fit cursor; held while blocks are taken and while a freed block is claimed for
    /// release, so a block is never released after it was taken again.
    cursor: Mutex<u64>,
    /// Blocks that lost their last user since [`Backing::release_freed`] last ran, a bit
    /// each.
    to_release: Box<[AtomicU64]>,
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
        nonces: Nonces,
    ) -> Result<Self, CoreError> {
        // An entry holds a byte offset below 128 TiB: an object placed further would be
        // recorded at another place (and read as an I/O error).
        if device.blocks() > (super::entry::MAX_DISK_OFFSET + 1) / BLOCK_BYTES as u64 {
            return Err(CoreError::Config(format!(
                "the backing device has {} blocks, more than the {} TiB a page's entry can \
                 address: give it a partition or file of at most that size",
                device.blocks(),
                (super::entry::MAX_DISK_OFFSET + 1) >> 40
            )));
        }
        let blocks = usize::try_from(device.blocks())
            .map_err(|_| CoreError::Config("the backing device is too large".into()))?;
        let (next_nonce, floors) = match nonces {
            Nonces::Owned => (Words::Owned(zeroed(1)?), Words::Owned(zeroed(blocks)?)),
            Nonces::Kept { next, floors } => {
                if floors.len() != blocks {
                    return Err(CoreError::Config(format!(
                        "the backing device's nonce floors cover {} blocks, and it has {blocks}",
                        floors.len()
                    )));
                }
                // A counter at or under a block's floor went back (damage): an object there
                // was sealed with a nonce at or above that floor, and the counter would
                // hand it out again, which ChaCha20-Poly1305 must never see. Raised past
                // every nonce a run from that floor can have used.
                let top = floors.iter().map(|f| f.load(Relaxed)).max().unwrap_or(0);
                if top > 0 && next.load(Relaxed) <= top {
                    let raised = top.saturating_add(RUN_OBJECTS as u64);
                    tracing::error!(
                        next = next.load(Relaxed),
                        top,
                        raised,
                        "the kept nonce counter is at or under a block's floor: raised"
                    );
                    next.store(raised, Relaxed);
                }
                (Words::Kept(std::slice::from_ref(next)), Words::Kept(floors))
            }
        };
        Ok(Self {
            device,
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key.0)),
            next_nonce,
            floors,
            users: zeroed(blocks)?,
            cursor: Mutex::new(0),
            to_release: zeroed(blocks.div_ceil(64))?,
            counters: DiskCounters::default(),
        })
    }

    /// Bytes of the per-block records [`Backing::new`] makes for a device of `blocks`
    /// blocks in this process: a use count and a release bit a block. The floors are not
    /// counted: kept ones live where the caller keeps them.
    pub(crate) fn records_bytes(blocks: u64) -> u64 {
        let users = blocks.saturating_mul(std::mem::size_of::<AtomicU32>() as u64);
        let bits = blocks
            .div_ceil(64)
            .saturating_mul(std::mem::size_of::<AtomicU64>() as u64);
        users.saturating_add(bits)
    }

    /// The device's file descriptor for reads outside the store ([`BackingDevice::fd`]).
    pub(crate) fn fd(&self) -> Option<i32> {
        self.device.fd()
    }

    /// See [`BackingDevice::prepare_thread`].
    pub(crate) fn prepare_thread(&self) {
        self.device.prepare_thread();
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

    /// Seals every run that holds objects into free blocks and writes them all at once.
    /// A run that was written has its place ([`Run::placed`]); one that was not holds
    /// nothing live. Allocates nothing. Returns the first error, after the writes that
    /// could go went.
    pub(crate) fn write_runs(&self, runs: &mut [Run]) -> Result<(), CoreError> {
        let mut error = None;
        let mut first = [0u64; RUNS_IN_FLIGHT];
        let mut sealed = 0;
        for (i, run) in runs.iter_mut().enumerate().take(RUNS_IN_FLIGHT) {
            run.written = None;
            if run.is_empty() {
                continue;
            }
            match self.take(run.blocks() as usize) {
                Ok(f) if self.seal(run, f) => {
                    first[i] = f;
                    sealed |= 1u32 << i;
                }
                Ok(f) => {
                    self.drop_hold(f, run.blocks());
                    error.get_or_insert(CoreError::Compress(crate::codec::CodecError::Corrupt(
                        "the writeback cipher refused an object".into(),
                    )));
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        let mut list = [BlockRun {
            first: 0,
            data: &[],
        }; RUNS_IN_FLIGHT];
        let mut which = [0usize; RUNS_IN_FLIGHT];
        let mut n = 0;
        for (i, run) in runs.iter().enumerate().take(RUNS_IN_FLIGHT) {
            if sealed & (1 << i) != 0 {
                let len = run.blocks() as usize * BLOCK_BYTES;
                list[n] = BlockRun {
                    first: first[i],
                    data: &run.blocks.as_bytes()[..len],
                };
                which[n] = i;
                n += 1;
            }
        }
        let mut failed: [Option<io::Error>; RUNS_IN_FLIGHT] = Default::default();
        self.device.write_runs(&list[..n], &mut failed[..n]);
        for (k, &i) in which[..n].iter().enumerate() {
            let run = &mut runs[i];
            let blocks = run.blocks();
            // The run was held (a user per block, see `take`) while it was sealed and
            // written; its objects count in the blocks they touch from now.
            run.written = Some(first[i]);
            for o in 0..run.len() {
                if let Some(at) = run.placed(o) {
                    for b in at.blocks() {
                        self.users[b as usize].fetch_add(1, Relaxed);
                    }
                }
            }
            self.drop_hold(first[i], blocks);
            if let Some(e) = failed[k].take() {
                for o in 0..run.len() {
                    if let Some(at) = run.placed(o) {
                        self.free(at);
                    }
                }
                run.written = None;
                self.counters.failures.fetch_add(1, Relaxed);
                error.get_or_insert(disk_error("write", e));
                continue;
            }
            self.counters.writes.fetch_add(blocks, Relaxed);
            self.counters
                .bytes_written
                .fetch_add(blocks * BLOCK_BYTES as u64, Relaxed);
        }
        error.map_or(Ok(()), Err)
    }

    /// Seals each object of `run` in place for its place on the device (the run starting
    /// at block `first`), and zeroes the last block's tail. `false` (never seen: the cipher
    /// refuses only messages of 256 GiB and more) if an object could not be sealed; the run
    /// then holds no plaintext either.
    ///
    /// Before the first object is sealed, the run's blocks get their new floor, the first
    /// nonce it will use: nonces only go up, so every object it seals is at or above it.
    /// (The blocks are free and held by this run, so no live object is below it; a crash
    /// before the write leaves them free.)
    fn seal(&self, run: &mut Run, first: u64) -> bool {
        let base = first * BLOCK_BYTES as u64;
        let len = run.blocks() as usize * BLOCK_BYTES;
        let floor = self.next_nonce[0].load(Relaxed);
        for f in self
            .floors
            .iter()
            .skip(first as usize)
            .take(run.blocks() as usize)
        {
            f.store(floor, Relaxed);
        }
        let bytes = &mut run.blocks.as_mut_bytes()[..len];
        bytes[run.used..].fill(0);
        for h in &run.held {
            let at = OnDisk {
                at: base + h.off as u64,
                bytes: h.bytes,
            };
            let nonce = self.next_nonce[0].fetch_add(1, Relaxed);
            let sealed = &mut bytes[h.off..h.off + at.sealed()];
            sealed[..NONCE_BYTES].copy_from_slice(&nonce.to_le_bytes());
            let (body, tag) = sealed[NONCE_BYTES..].split_at_mut(h.bytes);
            match self.cipher.encrypt_in_place_detached(
                &nonce_of(nonce),
                &associated(h.index, at, h.recompressed),
                body,
            ) {
                Ok(t) => tag.copy_from_slice(&t),
                Err(_) => {
                    bytes.fill(0);
                    return false;
                }
            }
        }
        true
    }

    /// Reads the object of page `index` at `at` and opens its seal into `out[..at.bytes]`.
    pub(crate) fn read(
        &self,
        index: u64,
        at: OnDisk,
        recompressed: bool,
        out: &mut [u8],
    ) -> Result<(), CoreError> {
        let n = at.block_count();
        let mut buf = [0u8; MAX_OBJECT_BLOCKS * BLOCK_BYTES];
        let Some(buf) = buf.get_mut(..n * BLOCK_BYTES) else {
            return Err(self.failed(index, "its disk entry is damaged"));
        };
        if at.at.saturating_add(at.sealed() as u64) > self.capacity() {
            return Err(self.failed(index, "its disk entry points past the backing device"));
        }
        if let Err(e) = self.device.read_blocks(*at.blocks().start(), buf) {
            self.counters.failures.fetch_add(1, Relaxed);
            return Err(disk_error("read", e));
        }
        self.open(index, at, recompressed, buf, out)
    }

    /// Opens the seal of page `index`'s object at `at` in `blocks` (the blocks it touches,
    /// as read from the device) into `out[..at.bytes]`, and counts the read.
    pub(crate) fn open(
        &self,
        index: u64,
        at: OnDisk,
        recompressed: bool,
        blocks: &mut [u8],
        out: &mut [u8],
    ) -> Result<(), CoreError> {
        let start = (at.at % BLOCK_BYTES as u64) as usize;
        let (Some(sealed), Some(out)) = (
            blocks.get_mut(start..start + at.sealed()),
            out.get_mut(..at.bytes),
        ) else {
            return Err(self.failed(index, "its disk entry is damaged"));
        };
        self.counters
            .reads
            .fetch_add(at.block_count() as u64, Relaxed);
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&sealed[..NONCE_BYTES]);
        let nonce = u64::from_le_bytes(nonce);
        let floor = self
            .floors
            .get(*at.blocks().start() as usize)
            .map_or(u64::MAX, |f| f.load(Relaxed));
        if nonce < floor {
            return Err(self.failed(
                index,
                "its written-back block holds an older sealing than the one last written there \
                 (rolled back on disk)",
            ));
        }
        let (body, tag) = sealed[NONCE_BYTES..].split_at_mut(at.bytes);
        let opened = self.cipher.decrypt_in_place_detached(
            &nonce_of(nonce),
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

    /// Holds the blocks of the live object at `at` for a read outside the store's locks:
    /// they cannot be released and taken again until [`Backing::free`] drops the hold.
    /// `false` (nothing held) if it does not lie within the device.
    pub(crate) fn hold(&self, at: OnDisk) -> bool {
        self.adopt(at)
    }

    /// The object at `at` is gone (or a read's hold on it): its blocks lose a user, and
    /// blocks left with none are marked for release ([`Backing::release_freed`]). Never
    /// blocks: it runs on the queue threads (an overwrite or a discard of a written-back
    /// page), and a discard there waited, in the guest, for a bio that only swap writes to
    /// this very device would give back (scenario l).
    pub(crate) fn free(&self, at: OnDisk) {
        for b in at.blocks() {
            self.unuse(b);
        }
    }

    /// Block `b` loses a user; marked for release when it has none left.
    fn unuse(&self, b: u64) {
        let Some(users) = self.users.get(b as usize) else {
            return;
        };
        if users.fetch_sub(1, Relaxed) == 1 {
            if let Some(word) = self.to_release.get((b / 64) as usize) {
                word.fetch_or(1 << (b % 64), Relaxed);
            }
        }
    }

    /// Marks every block no live object touches for release ([`Backing::release_freed`]):
    /// what a daemon that died left there, objects freed after its last release, and blocks
    /// of earlier devices sealed under keys nobody holds any more. Returns how many.
    pub(crate) fn mark_unused(&self) -> u64 {
        let mut marked = 0;
        for (w, word) in self.to_release.iter().enumerate() {
            let first = w * 64;
            let mut bits = 0u64;
            for (i, users) in self.users.iter().skip(first).take(64).enumerate() {
                if users.load(Relaxed) == 0 {
                    bits |= 1 << i;
                }
            }
            marked += u64::from(bits.count_ones());
            word.fetch_or(bits, Relaxed);
        }
        marked
    }

    /// Gives the space of blocks that emptied since the last call back to the device (a
    /// hole punched in a file, a discard on a partition), in runs of adjacent blocks; a
    /// block taken again meanwhile is skipped. It can wait for the device (a discard waited
    /// tens of seconds for a bio under memory pressure in the guest), so only a thread that
    /// nothing waits for calls it (the daemon's `uzram-release`), and it holds no lock while
    /// it waits: a block is claimed first (marked in use, so [`Backing::take`] passes it
    /// by), released, then unmarked. Returns how many blocks it released.
    pub(crate) fn release_freed(&self) -> u64 {
        let mut released = 0;
        let mut run: Option<(u64, u64)> = None;
        let flush = |run: &mut Option<(u64, u64)>| {
            let Some((first, count)) = run.take() else {
                return 0;
            };
            if let Err(e) = self.device.release(first, count) {
                tracing::warn!(first, count, error = %e, "releasing written-back blocks failed");
            }
            for b in first..first + count {
                self.users[b as usize].store(0, Relaxed);
            }
            count
        };
        for (w, word) in self.to_release.iter().enumerate() {
            let mut bits = word.swap(0, Relaxed);
            while bits != 0 {
                let b = w as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                if !self.claim(b) {
                    continue;
                }
                match &mut run {
                    Some((first, count)) if *first + *count == b && *count < RELEASE_RUN_BLOCKS => {
                        *count += 1
                    }
                    _ => {
                        released += flush(&mut run);
                        run = Some((b, 1));
                    }
                }
            }
        }
        released + flush(&mut run)
    }

    /// Marks free block `b` as being released, so that no run takes it meanwhile; `false`
    /// if it is in use again.
    fn claim(&self, b: u64) -> bool {
        let Some(users) = self.users.get(b as usize) else {
            return false;
        };
        // Under the cursor, as `take` checks and takes blocks under it.
        let _cursor = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        users
            .compare_exchange(0, RELEASING, Relaxed, Relaxed)
            .is_ok()
    }

    /// Takes a run of `n` free blocks (next fit, wrapping once) and holds each with one
    /// user until [`Backing::drop_hold`].
    fn take(&self, n: usize) -> Result<u64, CoreError> {
        let total = self.users.len();
        if n == 0 || n > total {
            return Err(CoreError::BackingFull {
                blocks: n as u64,
                capacity: total as u64,
            });
        }
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
    /// when the objects fill the run) are marked for release.
    fn drop_hold(&self, first: u64, n: u64) {
        for b in first..first + n {
            self.unuse(b);
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

/// `n` zeroed atomics (their `Default`), or [`CoreError::NoMemory`].
fn zeroed<T: Default>(n: usize) -> Result<Box<[T]>, CoreError> {
    let mut words = Vec::new();
    words
        .try_reserve_exact(n)
        .map_err(|_| CoreError::NoMemory)?;
    words.extend((0..n).map(|_| T::default()));
    Ok(words.into_boxed_slice())
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

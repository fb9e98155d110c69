//! The memory a device's page store lives in: one SysV shared memory segment that outlives
//! the daemon, so a new daemon can take the store over after a crash or for an upgrade.
//!
//! Why SysV shared memory (docs/recovery.md has the comparison): a segment stays in the
//! kernel with no process attached and needs no file descriptor passed on, so `uzram
//! recover` works for devices made by `uzram create` as well as under systemd; and
//! `SHM_LOCK` keeps its pages unevictable while no daemon runs. That matters: this device
//! is the highest-priority swap, so store pages swapped out while its server is dead could
//! only come back through the dead server. (A memfd kept in systemd's fd store is locked
//! only while some process maps it with mlock.)
//!
//! Layout, in 64 KiB units: a header unit (the header, then the carried counters of
//! `carry.rs` and the recompression dictionary of `dictionary.rs`), the page table (8
//! bytes a page), the segment directory (4 bytes an arena segment: the block it lives in,
//! plus one; 0 for none), the block states (a byte a block: whether its pages are in
//! memory, `pool::BlockState`; since layout 3), the recovery room, then the blocks the
//! pool hands out.
//!
//! The block states let a recovery find the old daemon's free blocks that are still in
//! memory without asking the kernel page by page: `mincore` over the blocks took ~30 ms per
//! 1.3 GiB of device on a 2-core host and 120-240 ms of a 1.2 GiB device's takeover pause
//! in the TCG guest. A layout 2 region (no states) is still taken over, with `mincore`.
//!
//! The recovery room (`footprint::room_bytes`, committed and never used) is memory a recovery gives
//! back to the system before the new daemon allocates anything ([`MappedRoom::release`]). A daemon
//! that dies when memory has run out leaves a system in which every reclaim waits for this
//! device, so nothing else would free a page, and the new daemon could not start (seen in
//! the guest: it waited in reclaim until `uzram recover` gave up). The new daemon commits
//! the room again once it serves. The header says where each part is, so a daemon refuses
//! a segment whose layout it does not know.
//!
//! The header, table and directory are mlocked (populated up front); the blocks are not
//! (`MADV_REMOVE`, which gives freed blocks back, refuses locked mappings): `SHM_LOCK` keeps
//! their pages resident.
//!
//! Trust: the segment is root's alone (`shm.rs`, checked on every attach), and a takeover
//! still reads its header as data from outside: every offset and length must be exactly
//! what the device's settings lay out ([`Sizes::of`]), computed with checked arithmetic, and
//! the device id, page count, codec and checksum setting must be the device's. Only then is
//! any part of it handed out as a slice.

use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use uzram_core::store::{SegmentHome, SegmentWords, WritebackKey, SEGMENT_BYTES};

use super::segment::{foreign, sys, SegmentError};
use crate::memory::pool;

const MAGIC: [u8; 8] = *b"UZRAMST1";
/// Layout 8: layout 7 whose stored pages' table entries have the tag no one flipped bit
/// makes a fill (`uzram_core`'s `entry.rs`). Layout 7: blocks for every page stored raw
/// with its checksum (`Sizes::of`). Layout 6
/// bound each stored checksum to its page (`StoreConfig::checksums_name_pages`). Layout 5
/// (taken over, and kept unbound) made the page table's words end with the pages' ages
/// (`PageStore::table_len`), so a takeover keeps each page's age and tried flag; layout 4
/// added the checksums. A store of an older layout is not taken over.
const VERSION: u32 = 8;
/// Layout 7, still taken over: as [`VERSION`] but with its stored entries under the earlier
/// tag until a takeover moves them ([`StoreSegment::stored_tags_moved`]). An earlier
/// release refuses layout 8, where it would read every stored page as damage.
const LAYOUT_7: u32 = 7;
/// Layout 6, still taken over: as [`LAYOUT_7`] but with fewer blocks
/// (`Sizes::before_layout_7`).
const BOUND_VERSION: u32 = 6;
/// Layout 5, still taken over: as [`BOUND_VERSION`] but for unbound checksums.
const UNBOUND_VERSION: u32 = 5;
/// Layout 6 whose stored entries a takeover moved to this release's tag: laid out, and its
/// checksums kept, as layout 6, but under a version no earlier release knows, so that one
/// refuses it rather than read each of its stored pages as damage (as [`VERSION`] does for
/// layout 7). Not 8 (the blocks are layout 6's) and not 9, kept for the layout after 8
/// (a test takes 9 for a later layout this release refuses).
const BOUND_MOVED: u32 = 10;
/// Layout 5 whose stored entries a takeover moved, as [`BOUND_MOVED`] is layout 6's.
const UNBOUND_MOVED: u32 = 11;

/// The layout a store of header version `version` is laid out as (its blocks, its
/// checksums' rules), for the versions this release takes over; `None` for any other.
fn base_layout(version: u32) -> Option<u32> {
    match version {
        VERSION | LAYOUT_7 | BOUND_VERSION | UNBOUND_VERSION => Some(version),
        BOUND_MOVED => Some(BOUND_VERSION),
        UNBOUND_MOVED => Some(UNBOUND_VERSION),
        _ => None,
    }
}

/// The header version of a store of layout `base` ([`base_layout`]) whose stored entries
/// have this release's tag.
fn moved_version(base: u32) -> u32 {
    match base {
        BOUND_VERSION => BOUND_MOVED,
        UNBOUND_VERSION => UNBOUND_MOVED,
        _ => VERSION,
    }
}

/// Whether a store of layout `version` is taken over.
fn known_version(version: u32) -> bool {
    base_layout(version).is_some()
}
use crate::footprint::max_room;
use crate::footprint::{Sizes, MIN_ROOM};

const UNIT: usize = crate::footprint::UNIT;
/// Where the id of the device's GPU staging segment (`staging_segment.rs`) is recorded: a word in
/// the header's unit after the header, [`STAGING_TAG`] above the id (0: none; a region of
/// an older daemon has 0 there).
const STAGING_OFF: usize = 2048;
const STAGING_TAG: u64 = 0x5354_4147 << 32;
/// Where the id of the backing device's nonce floors segment (`floors_segment.rs`) is
/// recorded, as the staging's is: [`FLOORS_TAG`] above the id (0: none; a region of an older
/// daemon has 0 there).
const FLOORS_OFF: usize = 2056;
const FLOORS_TAG: u64 = 0x464c_4f52 << 32; // "FLOR"
/// Where the region says its page table's empty entries are `uzram_core`'s empty word:
/// [`EMPTIES_TAG`] (0: zeros, as a daemon of an earlier release wrote them; a takeover
/// marks them before it reads the table, then sets the tag).
const EMPTIES_OFF: usize = 2064;
const EMPTIES_TAG: u64 = 0x454d_5054_594d_4b31; // "EMPTYMK1"
/// Where a region of layout 6 or 5 said a takeover moved its stored entries to this
/// release's tag, before the moved versions ([`BOUND_MOVED`], [`UNBOUND_MOVED`]) said so:
/// [`TAGS_TAG`]. Only read now, so that a store an earlier build of this release marked so
/// is not moved again (an entry under the earlier tag is damage there) and gets its moved
/// version on its next takeover. Layout 8 stores them so from the start.
const TAGS_OFF: usize = 2072;
const TAGS_TAG: u64 = 0x5354_4f52_4554_4737; // "STORETG7"
/// Where the device's writeback key and nonce counter live (`daemon/backing.rs`): a word
/// with [`WRITEBACK_TAG`] (or [`UNLABELLED_TAG`]) once they are set (0: none; an older
/// daemon has 0 there), the next nonce, then the key's 32 bytes. The segment is root's alone
/// (0600, checked on every attach), as the pages in it are.
const WRITEBACK_OFF: usize = 2560;
/// The tag of a key whose backing device carries uzram's label in its last block, which
/// no object may use (`daemon/backing.rs`).
const WRITEBACK_TAG: u64 = 0x5752_4954_4542_4b32; // "WRITEBK2"
/// The tag a daemon of an earlier release set: its backing device has no label, and its
/// objects may lie in any block.
const UNLABELLED_TAG: u64 = 0x5752_4954_4542_4b31; // "WRITEBK1"
/// Words at [`WRITEBACK_OFF`]: the tag, the nonce counter, the key.
const WRITEBACK_WORDS: usize = 2 + uzram_core::store::KEY_BYTES / 8;
/// Where the carried counters (`carry.rs`) live: in the header's unit, after the header.
const CARRY_OFF: usize = 4096;
/// Where the store's recompression dictionary is kept (`dictionary.rs`; zeros: none, as an
/// older daemon leaves it).
const DICTIONARY_OFF: usize = 8192;
const _: () = assert!(
    std::mem::size_of::<Header>() <= STAGING_OFF
        && STAGING_OFF + 8 <= FLOORS_OFF
        && FLOORS_OFF + 8 <= EMPTIES_OFF
        && EMPTIES_OFF + 8 <= TAGS_OFF
        && TAGS_OFF + 8 <= WRITEBACK_OFF
        && WRITEBACK_OFF + WRITEBACK_WORDS * 8 <= CARRY_OFF
        && CARRY_OFF + crate::takeover::carry::WORDS * 8 <= DICTIONARY_OFF
        && DICTIONARY_OFF + crate::takeover::dictionary::WORDS * 8 <= UNIT
);

/// What a region starts with.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    magic: [u8; 8],
    version: u32,
    /// The ublk device id once the device exists (`u32::MAX` before).
    device: u32,
    pages: u64,
    table_off: u64,
    table_len: u64,
    dir_off: u64,
    dir_len: u64,
    blocks_off: u64,
    len: u64,
    /// The store's codec, NUL-padded (compressed bytes are only readable with it).
    algorithm: [u8; 32],
    room_off: u64,
    room_len: u64,
    /// A byte per block: whether its pages are in memory.
    states_off: u64,
    states_len: u64,
    /// 1 when stored objects carry checksums, 0 when not.
    checksums: u32,
    _pad: u32,
}

/// A device's writeback key as its store's region keeps it.
pub struct KeptKey {
    /// The key its pages on the backing device are sealed with.
    pub key: WritebackKey,
    /// The next nonce, in the region.
    pub next: &'static AtomicU64,
    /// Whether the backing device's last block is uzram's label (a key this release set),
    /// or objects may lie there (one an earlier release set).
    pub labelled: bool,
}

/// An attached region; see the module docs. Never detached: the store in it lives as long as
/// the process.
#[derive(Debug)]
pub struct StoreSegment {
    id: i32,
    base: usize,
    header: Header,
    /// The layout the header's version lays out ([`base_layout`]; checked on attach).
    layout: u32,
}

/// The header of a store of `sizes` (`None`: its parts overflow).
fn layout(sizes: Sizes, algorithm: &str, checksums: bool, device: u32) -> Option<Header> {
    let o = sizes.offsets()?;
    let mut name = [0u8; 32];
    let n = algorithm.len().min(name.len());
    name[..n].copy_from_slice(&algorithm.as_bytes()[..n]);
    Some(Header {
        magic: MAGIC,
        version: VERSION,
        device,
        pages: sizes.pages,
        table_off: o.table_off as u64,
        table_len: sizes.table_len as u64,
        dir_off: o.dir_off as u64,
        dir_len: sizes.dir_len as u64,
        blocks_off: o.blocks_off as u64,
        len: o.len as u64,
        algorithm: name,
        room_off: o.room_off as u64,
        room_len: sizes.room as u64,
        states_off: o.states_off as u64,
        states_len: o.blocks as u64,
        checksums: u32::from(checksums),
        _pad: 0,
    })
}

/// What a store taken over must be: the device's id and settings.
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// The ublk device id.
    pub device: u32,
    /// Device pages.
    pub pages: u64,
    /// The codec.
    pub algorithm: &'a str,
    /// Whether objects carry checksums.
    pub checksums: bool,
}

/// Checks a store's header (read from segment `id` of `size` bytes) against what the
/// device `expect` names lays out: every field must be exactly that. Returns the layout
/// its version lays out ([`base_layout`]).
fn check_header(
    id: i32,
    header: &Header,
    size: usize,
    expect: Expected<'_>,
) -> Result<u32, SegmentError> {
    if header.magic != MAGIC {
        return Err(foreign(id, "no uzram store header".into()));
    }
    let Some(layout) = base_layout(header.version) else {
        return Err(foreign(
            id,
            format!(
                "layout version {} (this daemon takes over layouts {UNBOUND_VERSION} to \
                 {VERSION}, {BOUND_MOVED} and {UNBOUND_MOVED}, with a checksum on every page \
                 and its age; a store of another uzram is not taken over: stop the device \
                 with the uzram that made it)",
                header.version
            ),
        ));
    };
    if header.device != expect.device {
        return Err(foreign(
            id,
            format!(
                "it is the store of device {}, not {}",
                header.device, expect.device
            ),
        ));
    }
    if header.pages != expect.pages {
        return Err(foreign(
            id,
            format!(
                "it has {} pages; this device has {}",
                header.pages, expect.pages
            ),
        ));
    }
    let algorithm = algorithm_name(&header.algorithm);
    if algorithm != expect.algorithm {
        return Err(foreign(
            id,
            format!(
                "it is compressed with {algorithm}, not {}",
                expect.algorithm
            ),
        ));
    }
    if header.checksums != u32::from(expect.checksums) {
        return Err(foreign(
            id,
            format!(
                "its pages {} checksums; this device's {}",
                if header.checksums == 1 {
                    "carry"
                } else {
                    "carry no"
                },
                if expect.checksums { "do" } else { "do not" }
            ),
        ));
    }
    let room = usize::try_from(header.room_len).unwrap_or(usize::MAX);
    if !(MIN_ROOM..=max_room()).contains(&room) {
        return Err(foreign(id, format!("a recovery room of {room} bytes")));
    }
    if !lays_out(header, size, expect) {
        return Err(foreign(
            id,
            "its layout is not the one its device's settings give".into(),
        ));
    }
    Ok(layout)
}

/// Whether `header`, of a segment of `size` bytes, is exactly the layout `expect` gives
/// with the header's own recovery room (of a size a daemon makes) and layout version.
fn lays_out(header: &Header, size: usize, expect: Expected<'_>) -> bool {
    let room = usize::try_from(header.room_len).unwrap_or(usize::MAX);
    (MIN_ROOM..=max_room()).contains(&room)
        && header.len == size as u64
        && base_layout(header.version)
            .and_then(|base| {
                if base < LAYOUT_7 {
                    Sizes::before_layout_7(expect.pages, room)
                } else {
                    Sizes::of(expect.pages, room)
                }
            })
            .and_then(|s| layout(s, expect.algorithm, expect.checksums, expect.device))
            .is_some_and(|laid_out| {
                Header {
                    version: header.version,
                    ..laid_out
                } == *header
            })
}

/// Seeds for the store-header fuzz target: a valid header of a small device and its
/// segment size, as bytes ([`header_bytes`]).
#[cfg(test)]
pub fn fuzz_seeds() -> Vec<Vec<u8>> {
    let sizes = Sizes::of(16, MIN_ROOM).unwrap();
    let header = layout(sizes, "lz4", true, 7).unwrap();
    let mut seed = header_bytes(&header);
    seed.extend_from_slice(&header.len.to_le_bytes());
    vec![seed]
}

/// The store-header fuzz target: a header (and then a segment size) from arbitrary bytes is
/// refused by a takeover, or every part it names lies inside the segment.
#[cfg(test)]
pub fn fuzz_check(input: &[u8]) {
    let mut bytes = input.to_vec();
    bytes.resize(std::mem::size_of::<Header>() + 8, 0);
    let header = header_from_bytes(&bytes);
    let size = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap()) as usize;
    let expect = Expected {
        device: 7,
        pages: 16,
        algorithm: "lz4",
        checksums: true,
    };
    if check_header(1, &header, size, expect).is_err() {
        return;
    }
    let end = |off: u64, len: u64| {
        off.checked_add(len)
            .expect("no overflow in an accepted header")
    };
    assert!(end(header.table_off, header.table_len * 8) <= header.dir_off);
    assert!(end(header.dir_off, header.dir_len * 4) <= header.states_off);
    assert!(end(header.states_off, header.states_len) <= header.room_off);
    assert!(end(header.room_off, header.room_len) <= header.blocks_off);
    assert!(header.blocks_off <= header.len && header.len == size as u64);
    assert!(header.dir_len as usize >= uzram_core::PageStore::segment_capacity(16));
}

/// A header's bytes, field by field, little-endian.
#[cfg(test)]
fn header_bytes(h: &Header) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&h.magic);
    v.extend_from_slice(&h.version.to_le_bytes());
    v.extend_from_slice(&h.device.to_le_bytes());
    for x in [
        h.pages,
        h.table_off,
        h.table_len,
        h.dir_off,
        h.dir_len,
        h.blocks_off,
        h.len,
    ] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.extend_from_slice(&h.algorithm);
    for x in [h.room_off, h.room_len, h.states_off, h.states_len] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.extend_from_slice(&h.checksums.to_le_bytes());
    v.extend_from_slice(&h._pad.to_le_bytes());
    v
}

/// The inverse of [`header_bytes`] (any bytes make a header).
#[cfg(test)]
fn header_from_bytes(b: &[u8]) -> Header {
    let mut at = 0;
    let mut take = |n: usize| {
        let s = &b[at..at + n];
        at += n;
        s
    };
    let mut magic = [0u8; 8];
    magic.copy_from_slice(take(8));
    let version = u32::from_le_bytes(take(4).try_into().unwrap());
    let device = u32::from_le_bytes(take(4).try_into().unwrap());
    let mut u = || u64::from_le_bytes(take(8).try_into().unwrap());
    let (pages, table_off, table_len, dir_off, dir_len, blocks_off, len) =
        (u(), u(), u(), u(), u(), u(), u());
    let mut algorithm = [0u8; 32];
    algorithm.copy_from_slice(take(32));
    let mut u = || u64::from_le_bytes(take(8).try_into().unwrap());
    let (room_off, room_len, states_off, states_len) = (u(), u(), u(), u());
    let checksums = u32::from_le_bytes(take(4).try_into().unwrap());
    let _pad = u32::from_le_bytes(take(4).try_into().unwrap());
    Header {
        magic,
        version,
        device,
        pages,
        table_off,
        table_len,
        dir_off,
        dir_len,
        blocks_off,
        len,
        algorithm,
        room_off,
        room_len,
        states_off,
        states_len,
        checksums,
        _pad,
    }
}

/// A header's codec name (NUL-padded).
fn algorithm_name(name: &[u8; 32]) -> String {
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}

impl StoreSegment {
    /// Makes a new locked segment for the store of device `device` (`u32::MAX` for none: a
    /// `scratch` store, which is marked for removal before anything of it is locked or
    /// touched, so that it goes with this process however it ends: a benchmark's, a test's).
    /// Nothing in it is committed until touched, but for the header and the recovery room.
    pub fn create(
        sizes: Sizes,
        algorithm: &str,
        checksums: bool,
        device: u32,
        scratch: bool,
    ) -> Result<StoreSegment, SegmentError> {
        let header = layout(sizes, algorithm, checksums, device)
            .ok_or_else(|| foreign(-1, "the store's parts overflow the address space".into()))?;
        let len = usize::try_from(header.len)
            .map_err(|_| foreign(-1, "the store is larger than the address space".into()))?;
        let id = crate::shm::create(len)?;
        let mapped = crate::shm::Attached::map(id, false);
        if scratch || mapped.is_err() {
            let _ = crate::shm::remove(id);
        }
        let base = mapped?.keep();
        // SAFETY: the header page lies in our fresh read-write mapping, nobody else uses it.
        // Written before the segment is locked: from here on `uzram list` knows it as a
        // store (and whose), should this process be killed before its device serves.
        unsafe { ptr::write_volatile(base as *mut Header, header) };
        let region = StoreSegment {
            id,
            base,
            header,
            layout: VERSION,
        };
        if let Err(e) = crate::shm::lock(id) {
            let _ = crate::shm::remove(id);
            return Err(e.into());
        }
        region.lock_parts();
        region.commit_room();
        Ok(region)
    }

    /// Takes over segment `id` left by an earlier daemon of the device `expect` names:
    /// attaches it (root's alone) and checks its header against what the device lays out.
    pub fn attach(id: i32, expect: Expected<'_>) -> Result<StoreSegment, SegmentError> {
        let mapped = crate::shm::Attached::map(id, false)?;
        let size = mapped.size();
        if size < UNIT {
            return Err(foreign(id, format!("only {size} bytes")));
        }
        // SAFETY: the segment is at least one unit long, so the header lies in the mapping.
        let header = unsafe { ptr::read_volatile(mapped.base() as *const Header) };
        let layout = check_header(id, &header, size, expect)?;
        crate::shm::lock(id)?;
        let region = StoreSegment {
            id,
            base: mapped.keep(),
            header,
            layout,
        };
        region.lock_parts();
        Ok(region)
    }

    /// Whether the store's checksums are bound to their pages (layout 6 on): what its store
    /// must keep doing.
    pub fn checksums_name_pages(&self) -> bool {
        self.layout != UNBOUND_VERSION
    }

    /// Header, page table and directory: populated and locked now, since queue threads write
    /// them and a page fault there under memory pressure can deadlock the device (mlock
    /// faults every page in; touching them from Rust is not enough: an atomic add of 0 is
    /// compiled to a load). Blocks: unlocked (mlockall locked the new mapping), since
    /// `MADV_REMOVE`, which gives freed blocks back, refuses locked mappings; `SHM_LOCK` keeps
    /// them resident, and the pool faults them in before handing them out.
    fn lock_parts(&self) {
        let meta = self.header.room_off as usize;
        if let Err(err) = crate::sys::memory::lock(self.base, meta) {
            tracing::warn!(error = %err, "locking the store's page table failed");
        }
        // the room and the blocks, which follow it
        let start = self.base + self.header.room_off as usize;
        let len = self.header.len as usize - self.header.room_off as usize;
        if let Err(err) = crate::sys::memory::unlock(start, len) {
            tracing::warn!(error = %err, "unlocking the store's blocks failed: freed blocks cannot go back");
        }
    }

    /// Faults in the recovery room (again, after a recovery gave it back). `SHM_LOCK` keeps
    /// it resident from then on. Under memory pressure this waits for reclaim: call it off
    /// the I/O path.
    pub fn commit_room(&self) {
        let (start, len) = self.room();
        commit_room_at(start, len);
    }

    /// The recovery room's address range.
    pub fn room(&self) -> (usize, usize) {
        (
            self.base + self.header.room_off as usize,
            self.header.room_len as usize,
        )
    }

    /// The mapping's address, for tests that play a killed process.
    #[cfg(test)]
    pub fn base_for_tests(&self) -> usize {
        self.base
    }

    /// The segment's id (what `uzram recover` attaches to).
    pub fn id(&self) -> i32 {
        self.id
    }

    fn recorded_word(&self, record: Recorded) -> &AtomicU64 {
        // SAFETY: the header's unit lies in the mapping (see `carried_counters`); the word at
        // `record.off` (STAGING_OFF, FLOORS_OFF, EMPTIES_OFF or TAGS_OFF, inside it by the assertion above) is
        // 8-aligned, only ever accessed atomically, and the mapping is never detached.
        unsafe { &*((self.base + record.off) as *const AtomicU64) }
    }

    fn recorded(&self, record: Recorded) -> Option<i32> {
        record.id(self.recorded_word(record).load(Ordering::Acquire))
    }

    fn record(&self, record: Recorded, id: Option<i32>) {
        let word = id.map_or(0, |id| record.tag | u64::from(id as u32));
        self.recorded_word(record).store(word, Ordering::Release);
    }

    /// The device's GPU staging segment, if it has one (`staging_segment.rs`).
    pub fn staging(&self) -> Option<i32> {
        self.recorded(STAGING)
    }

    /// Records the device's GPU staging segment (`None`: it has none).
    pub fn set_staging(&self, id: Option<i32>) {
        self.record(STAGING, id);
    }

    /// The backing device's nonce floors segment, if the device has one
    /// (`floors_segment.rs`).
    pub fn floors(&self) -> Option<i32> {
        self.recorded(FLOORS)
    }

    /// Records the backing device's nonce floors segment (`None`: it has none).
    pub fn set_floors(&self, id: Option<i32>) {
        self.record(FLOORS, id);
    }

    /// Whether the page table's empty entries are `uzram_core`'s empty word, so a zero
    /// entry is damage; false for a store an earlier release kept, whose empty entries
    /// are zeros until [`StoreSegment::set_empties_marked`].
    pub fn empties_marked(&self) -> bool {
        self.recorded_word(EMPTIES).load(Ordering::Acquire) == EMPTIES_TAG
    }

    /// Records that every empty entry of the page table is the empty word.
    pub fn set_empties_marked(&self) {
        self.recorded_word(EMPTIES)
            .store(EMPTIES_TAG, Ordering::Release);
    }

    /// Leaves the page table as a daemon of an earlier release did: every empty entry 0, no
    /// mark.
    #[cfg(test)]
    pub fn unmark_empties_for_tests(&self) {
        for word in self.table() {
            let _ = word.compare_exchange(
                uzram_core::store::EMPTY_WORD,
                0,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        self.recorded_word(EMPTIES).store(0, Ordering::Release);
    }

    /// Whether the page table's stored entries have this release's tag: always in layout
    /// 8; in layouts 7, 6 and 5 once a takeover moved them and said so in the header's
    /// version ([`StoreSegment::set_stored_tags_moved`]), or, for layouts 6 and 5, in the
    /// word an earlier build of this release set instead ([`TAGS_OFF`]).
    pub fn stored_tags_moved(&self) -> bool {
        self.header_word_version() == moved_version(self.layout)
            || (self.layout < LAYOUT_7
                && self.recorded_word(TAGS).load(Ordering::Acquire) == TAGS_TAG)
    }

    /// Records that every stored entry of the page table has this release's tag, once they
    /// are moved: the header's version becomes one no earlier release takes over (layout 7
    /// becomes 8, the same sizes; layout 6 becomes [`BOUND_MOVED`], 5 [`UNBOUND_MOVED`],
    /// laid out as they were), where that release would read each stored page as damage and
    /// lose it. One word, written last: a takeover that dies before it finds the entries
    /// moved or not, and moves them again (the move is idempotent). Returns whether the
    /// header changed: false when it already said so.
    pub fn set_stored_tags_moved(&self) -> bool {
        let moved = moved_version(self.layout);
        if self.header_word_version() == moved {
            return false;
        }
        self.version_word().store(moved, Ordering::Release);
        true
    }

    /// The header's layout version as it is now in the segment (a takeover may have moved it
    /// on since this process attached).
    fn header_word_version(&self) -> u32 {
        self.version_word().load(Ordering::Acquire)
    }

    fn version_word(&self) -> &AtomicU32 {
        // SAFETY: the header lies at the start of the mapping, which is never detached; its
        // `version` field is a 4-aligned u32 (the header is `repr(C)`, the mapping starts on
        // a page), read by other processes only as a whole.
        unsafe { &*((self.base + std::mem::offset_of!(Header, version)) as *const AtomicU32) }
    }

    /// Leaves the region as a daemon of an earlier release did: layout 7, every stored
    /// entry under the earlier tag, no mark.
    #[cfg(test)]
    pub fn as_layout_7_for_tests(&self, pages: u64) {
        self.as_earlier_layout_for_tests(pages, LAYOUT_7);
    }

    /// Leaves the region as a daemon of an earlier release of layout `version` (7, 6 or 5,
    /// whose blocks the region must have) did: every stored entry under the earlier tag, no
    /// mark.
    #[cfg(test)]
    fn as_earlier_layout_for_tests(&self, pages: u64, version: u32) {
        assert!(
            matches!(version, LAYOUT_7 | BOUND_VERSION | UNBOUND_VERSION),
            "{version}"
        );
        let entries = uzram_core::store::PageStore::kept_entries(pages, self.table())
            .expect("the region's table");
        for word in entries {
            let w = word.load(Ordering::Relaxed);
            if w & 0b111 == 0b111 {
                word.store(w & !0b100, Ordering::Relaxed);
            }
        }
        self.recorded_word(TAGS).store(0, Ordering::Release);
        let version = Header {
            version,
            ..self.header
        };
        // SAFETY: the header lies at the start of the mapping, which is never detached; the
        // test that calls this holds the region alone (its daemon was killed).
        unsafe { ptr::write_volatile(self.base as *mut Header, version) };
    }

    fn writeback_words(&self) -> &'static [AtomicU64] {
        // SAFETY: the header's unit lies in the mapping (see `carried_counters`); the words
        // are 8-aligned, only ever accessed atomically, and the mapping is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + WRITEBACK_OFF) as *const AtomicU64,
                WRITEBACK_WORDS,
            )
        }
    }

    /// The device's writeback key and nonce counter, when a daemon set them.
    pub fn writeback_key(&self) -> Option<KeptKey> {
        let words = self.writeback_words();
        let labelled = match words[0].load(Ordering::Acquire) {
            WRITEBACK_TAG => true,
            UNLABELLED_TAG => false,
            _ => return None,
        };
        let mut key = [0u8; uzram_core::store::KEY_BYTES];
        for (bytes, w) in key.chunks_exact_mut(8).zip(&words[2..]) {
            bytes.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        Some(KeptKey {
            key: WritebackKey(key),
            next: &words[1],
            labelled,
        })
    }

    /// Records the device's writeback `key`, its nonce counter at 0, for a backing device
    /// that carries uzram's label; returns the counter.
    pub fn set_writeback_key(&self, key: &WritebackKey) -> &'static AtomicU64 {
        let words = self.writeback_words();
        words[0].store(0, Ordering::Release);
        for (bytes, w) in key.0.chunks_exact(8).zip(&words[2..]) {
            let mut b = [0u8; 8];
            b.copy_from_slice(bytes);
            w.store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
        words[1].store(0, Ordering::Relaxed);
        words[0].store(WRITEBACK_TAG, Ordering::Release);
        &words[1]
    }

    /// Marks the recorded writeback key as an earlier release's, whose backing device has
    /// no label: how a store that release left looks.
    #[cfg(test)]
    pub fn forget_label(&self) {
        self.writeback_words()[0].store(UNLABELLED_TAG, Ordering::Release);
    }

    /// The store's recompression dictionary's area (`dictionary.rs`), in the header's unit.
    pub fn dictionary_area(&self) -> crate::takeover::dictionary::KeptDictionary {
        // SAFETY: as for `carried_counters`: the area lies in the header's unit (asserted
        // above), its words are 8-aligned and only ever accessed atomically, and the mapping
        // is never detached.
        let words = unsafe {
            std::slice::from_raw_parts(
                (self.base + DICTIONARY_OFF) as *const AtomicU64,
                crate::takeover::dictionary::WORDS,
            )
        };
        crate::takeover::dictionary::KeptDictionary::over(words)
    }

    /// The carried counters' words (`carry.rs`), in the header's unit.
    pub fn carried_counters(&self) -> &'static [AtomicU64] {
        // SAFETY: the header's unit lies in the mapping (`create` made it, `attach` checked
        // the segment is at least a unit long); the words are 8-aligned (the mapping is
        // page-aligned), only ever accessed atomically, and the mapping is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + CARRY_OFF) as *const AtomicU64,
                crate::takeover::carry::WORDS,
            )
        }
    }

    /// The page table's words. Shared atomics: handing them out twice is sound, and a store
    /// built on them must be the only writer while it lives (`Persistence::table`).
    pub fn table(&self) -> &'static [AtomicU64] {
        // SAFETY: `attach`/`create` checked that the table lies in the mapping (8-aligned);
        // its words are only ever accessed atomically; the mapping is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + self.header.table_off as usize) as *const AtomicU64,
                self.header.table_len as usize,
            )
        }
    }

    fn dir(&self) -> &'static [AtomicU32] {
        // SAFETY: the directory lies in the mapping (checked), 4-aligned, and is only ever
        // accessed atomically; the mapping is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + self.header.dir_off as usize) as *const AtomicU32,
                self.header.dir_len as usize,
            )
        }
    }

    /// A byte per block (`pool::BlockState`).
    pub fn block_states(&self) -> Option<&'static [AtomicU8]> {
        if self.header.states_len == 0 {
            return None;
        }
        // SAFETY: `attach`/`create` checked that the states lie in the mapping, before the
        // room; bytes are only ever accessed atomically; the mapping is never detached.
        Some(unsafe {
            std::slice::from_raw_parts(
                (self.base + self.header.states_off as usize) as *const AtomicU8,
                self.header.states_len as usize,
            )
        })
    }

    /// The blocks' address range.
    pub fn blocks(&self) -> (usize, usize) {
        let start = self.base + self.header.blocks_off as usize;
        (start, self.base + self.header.len as usize - start)
    }

    /// Blocks the directory names (block numbers from the start of the blocks).
    pub fn used_blocks(&self) -> Vec<usize> {
        let blocks = self.blocks().1 / UNIT;
        self.dir()
            .iter()
            .map(|d| d.load(Ordering::Acquire) as usize)
            .filter(|&b| b > 0 && b <= blocks)
            .map(|b| b - 1)
            .collect()
    }

    /// The segment home over this region's directory and blocks, for a daemon's store: a
    /// store dropped whole leaves its segments where they are, for whoever adopts the region
    /// next ([`SegmentHome::outlives_the_store`]).
    pub fn home(&self) -> Home {
        self.home_kept(true)
    }

    /// The segment home for stores that follow one another in this region within one
    /// process (`uzram bench`'s runs): a store dropped whole gives its segments back to the
    /// pool, where the next store takes them. Without that, each run's segments stayed out
    /// of the pool and a bench of a few runs ran out of memory.
    pub fn home_for_stores_in_turn(&self) -> Home {
        self.home_kept(false)
    }

    fn home_kept(&self, outlives: bool) -> Home {
        let (start, len) = self.blocks();
        Home {
            dir: self.dir(),
            start,
            blocks: len / UNIT,
            outlives,
        }
    }
}

/// Commits the recovery room at `start` (`len` bytes) again after a recovery, a MiB at a
/// time with a short pause between, so the reclaim it may cause (swap-out to this device,
/// which serves by now) is spread out. It does not wait for memory to spare: after a
/// crash under a swap storm the storm goes on, and MemAvailable stayed under the three
/// rooms the first version waited for, so a second crash found no room and its new daemon
/// waited in reclaim until `uzram recover` gave up (docs/recovery.md).
pub fn commit_room_soon(start: usize, len: usize) {
    const STEP: usize = 1 << 20;
    let t = std::time::Instant::now();
    let end = start + len;
    for at in (start..end).step_by(STEP) {
        commit_room_at(at, STEP.min(end - at));
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    tracing::info!(
        bytes = len,
        ms = t.elapsed().as_millis() as u64,
        "recovery room committed again"
    );
}

/// Faults in `len` bytes at `start`, a range of a region's recovery room.
pub fn commit_room_at(start: usize, len: usize) {
    for page in (start..start + len).step_by(4096) {
        // SAFETY: `page` lies in the recovery room of our read-write mapping, which nothing
        // else uses; the write faults the page in.
        unsafe { ptr::write_volatile(page as *mut u8, 1) };
    }
}

/// Commits the recovery room of segment `id` again, after [`MappedRoom::release`] for a handover
/// that then failed (its daemon serves on, and needs its room for the next takeover).
pub fn restore_room(id: i32, device: Option<u32>) {
    let restored = with_room(id, device, |room, len| {
        commit_room_at(room, len);
        Ok(len)
    });
    if let Err(err) = restored {
        tracing::warn!(id, error = %err, "the store's recovery room stays given back");
    }
}

/// Maps segment `id` for as long as `f` runs and hands it the recovery room's address and
/// length, once the header is checked to be a store's whose room lies in the segment.
fn with_room(
    id: i32,
    device: Option<u32>,
    f: impl FnOnce(usize, usize) -> Result<usize, SegmentError>,
) -> Result<usize, SegmentError> {
    let attached = attach_room(id, device)?;
    f(attached.room, attached.len)
}

/// Segment `id` mapped whole (root's alone), its header checked to be a store's whose room
/// lies in it.
struct AttachedRoom {
    mapped: crate::shm::Attached,
    room: usize,
    len: usize,
}

/// The room of store `id`, when it is `device`'s store (where the caller knows the device:
/// a record's segment id may since have been freed and reused by another device's store,
/// whose room must not be given back).
fn attach_room(id: i32, device: Option<u32>) -> Result<AttachedRoom, SegmentError> {
    let mapped = crate::shm::Attached::map(id, false)?;
    let size = mapped.size();
    if size < UNIT {
        return Err(foreign(id, format!("only {size} bytes")));
    }
    // SAFETY: the segment is at least one unit long, so the header lies in the mapping.
    let header = unsafe { ptr::read_volatile(mapped.base() as *const Header) };
    if header.magic != MAGIC || !known_version(header.version) {
        return Err(foreign(
            id,
            "no uzram store header of a known layout".into(),
        ));
    }
    if let Some(device) = device.filter(|&d| d != header.device) {
        return Err(foreign(
            id,
            format!("it is the store of device {}, not {device}", header.device),
        ));
    }
    // The room is given back (its pages zeroed) before the store is checked whole: a header
    // whose room were anywhere else would have the table or the objects zeroed instead. So
    // the whole layout must be the one its own fields give, as a takeover checks it.
    let algorithm = algorithm_name(&header.algorithm);
    let own = Expected {
        device: header.device,
        pages: header.pages,
        algorithm: &algorithm,
        checksums: header.checksums == 1,
    };
    if !lays_out(&header, size, own) {
        return Err(foreign(
            id,
            "its layout is not a store's, so its recovery room is not known".into(),
        ));
    }
    Ok(AttachedRoom {
        room: mapped.base() as usize + header.room_off as usize,
        len: header.room_len as usize,
        mapped,
    })
}

/// The recovery room of a store, mapped by a process that waits for the store's daemon to
/// die so it can take the device over. Giving the room back is the first thing it does
/// then, when memory may have run out: with the mapping made (and nothing else of the
/// segment mapped, so no page tables either) beforehand, that needs no memory at all.
#[derive(Debug)]
pub struct MappedRoom {
    shm: i32,
    start: usize,
    len: usize,
}

impl MappedRoom {
    /// Maps the room of segment `id` (when `device` is given, only if it is that device's
    /// store), and only the room.
    pub fn map(id: i32, device: Option<u32>) -> Result<MappedRoom, SegmentError> {
        let attached = attach_room(id, device)?;
        let (room, len) = (attached.room, attached.len);
        let size = attached.mapped.size();
        let base = attached.mapped.keep();
        let tail = room + len;
        let end = base + size.next_multiple_of(4096);
        let failed = |what: &str, err: std::io::Error| tracing::warn!(id, what, error = %err, "mapping a store's recovery room ahead");
        // (left mapped, they cost page tables and an attach, nothing else)
        if room > base {
            // SAFETY: the range lies in the mapping made by attach_room, before the room,
            // and nothing of ours refers to it (the header was copied out).
            if let Err(err) = unsafe { crate::sys::memory::unmap(base, room - base) } {
                failed("munmap before the room", err);
            }
        }
        if end > tail {
            // SAFETY: as above, after the room.
            if let Err(err) = unsafe { crate::sys::memory::unmap(tail, end - tail) } {
                failed("munmap after the room", err);
            }
        }
        // A caller under mlockall(MCL_FUTURE) mapped it locked, and MADV_REMOVE refuses
        // locked pages; unlocking it now, not after the crash, splits no mapping then.
        if let Err(err) = crate::sys::memory::unlock(room, len) {
            failed("munlock", err);
        }
        Ok(MappedRoom {
            shm: id,
            start: room,
            len,
        })
    }

    /// The segment whose room this is.
    pub fn shm(&self) -> i32 {
        self.shm
    }

    /// Gives the room's pages back to the system; returns the bytes given back.
    pub fn release(&self) -> Result<usize, SegmentError> {
        // SAFETY: the room, our own shared mapping of it, which no daemon uses.
        unsafe { crate::sys::memory::give_back(self.start, self.len) }
            .map(|()| self.len)
            .map_err(sys("madvise MADV_REMOVE (the recovery room)"))
    }
}

impl Drop for MappedRoom {
    fn drop(&mut self) {
        // SAFETY: the room's mapping made by `map`; nothing else refers to it.
        let _ = unsafe { crate::sys::memory::unmap(self.start, self.len) };
    }
}

/// Another segment a store records: a word of the header's unit at `off`, `tag` above the
/// segment's id (0: none).
#[derive(Debug, Clone, Copy)]
struct Recorded {
    off: usize,
    tag: u64,
}

const STAGING: Recorded = Recorded {
    off: STAGING_OFF,
    tag: STAGING_TAG,
};
const FLOORS: Recorded = Recorded {
    off: FLOORS_OFF,
    tag: FLOORS_TAG,
};
const EMPTIES: Recorded = Recorded {
    off: EMPTIES_OFF,
    tag: EMPTIES_TAG,
};
const TAGS: Recorded = Recorded {
    off: TAGS_OFF,
    tag: TAGS_TAG,
};

impl Recorded {
    /// The id `word` records, if it carries the tag.
    fn id(self, word: u64) -> Option<i32> {
        (word & 0xffff_ffff_0000_0000 == self.tag).then_some(word as u32 as i32)
    }

    /// The id store segment `store` records, read without attaching it for good.
    fn peek(self, store: i32) -> Option<i32> {
        crate::shm::peek::<u64>(store, self.off)
            .ok()
            .and_then(|w| self.id(w))
    }
}

/// Marks store segment `id` for removal, and the GPU staging and nonce floors segments it
/// records: they go once no process has them attached (at once when none has). For a
/// deleted device's store. A segment that is not a uzram store, root's alone (its id was
/// freed and reused), is left as it is.
pub fn remove(id: i32) {
    match crate::shm::peek::<Header>(id, 0) {
        Ok(h) if h.magic == MAGIC => {}
        Ok(_) => {
            tracing::warn!(id, "not removing a segment that is no uzram store");
            return;
        }
        Err(error) => {
            tracing::warn!(id, %error, "not removing the recorded store");
            return;
        }
    }
    if let Some(staging) = STAGING.peek(id) {
        crate::takeover::staging_segment::remove(staging);
    }
    if let Some(floors) = FLOORS.peek(id) {
        crate::takeover::floors_segment::remove(floors);
    }
    if let Err(error) = crate::shm::remove(id) {
        tracing::warn!(id, %error, "removing the store's shared memory failed");
    }
}

/// Whether segment `id` exists.
pub fn exists(id: i32) -> bool {
    crate::shm::stat(id).is_ok()
}

/// What a root-only segment holds, as far as its header tells (for `uzram list` and
/// `uzram destroy`, which find segments no device takes back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFacts {
    /// The device it is the store of (`u32::MAX`: none yet).
    pub device: u32,
    /// Its device's pages.
    pub pages: u64,
    /// The GPU staging segment it records.
    pub staging: Option<i32>,
    /// The nonce floors segment it records.
    pub floors: Option<i32>,
}

/// The facts of segment `id` if it is a uzram store (root's alone).
pub fn store_facts(id: i32) -> Option<StoreFacts> {
    let header = crate::shm::peek::<Header>(id, 0).ok()?;
    if header.magic != MAGIC {
        return None;
    }
    Some(StoreFacts {
        device: header.device,
        pages: header.pages,
        staging: STAGING.peek(id),
        floors: FLOORS.peek(id),
    })
}

/// Longest a new arena segment waits for the pool keeper before the write that needs it fails
/// with `NoMemory` (see `pool::take_within`).
const ALLOC_WAIT: Duration = Duration::from_millis(100);

/// Segments of the store come from the pool (whose blocks are this region's) and are
/// recorded in the region's directory.
#[derive(Debug)]
pub struct Home {
    dir: &'static [AtomicU32],
    start: usize,
    blocks: usize,
    outlives: bool,
}

impl Home {
    fn words(at: usize) -> SegmentWords {
        let words = ptr::slice_from_raw_parts_mut(at as *mut AtomicU64, SEGMENT_BYTES / 8);
        // SAFETY: `at` is a whole pool block of this region (SEGMENT_BYTES, page-aligned,
        // initialized shared memory) owned by the store from now on; the global allocator
        // (PoolAlloc) takes it back as a pool block when the store drops the box.
        unsafe { Box::from_raw(words) }
    }
}

impl SegmentHome for Home {
    fn alloc(&self) -> Option<SegmentWords> {
        let block = NonNull::new(pool::take_within(ALLOC_WAIT))?;
        Some(Self::words(block.as_ptr() as usize))
    }

    fn placed(&self, index: usize, at: *const AtomicU64) {
        let at = at as usize;
        let block = at.wrapping_sub(self.start) / UNIT;
        match self.dir.get(index) {
            Some(d) if at >= self.start && block < self.blocks => {
                d.store(block as u32 + 1, Ordering::Release)
            }
            _ => tracing::error!(
                index,
                "an arena segment outside the store's shared memory: it will not survive a restart"
            ),
        }
    }

    fn removed(&self, index: usize) {
        if let Some(d) = self.dir.get(index) {
            d.store(0, Ordering::Release);
        }
    }

    fn find(&self, index: usize) -> Option<SegmentWords> {
        let block = self.dir.get(index)?.load(Ordering::Acquire) as usize;
        (block > 0 && block <= self.blocks).then(|| Self::words(self.start + (block - 1) * UNIT))
    }

    fn outlives_the_store(&self) -> bool {
        self.outlives
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::takeover::floors_segment::FloorsSegment;
    use crate::takeover::staging_segment::StagingSegment;

    const DEVICE: u32 = 7;

    /// The store of a 16-page device; `None` (printed) where segments cannot be locked
    /// (containers without CAP_IPC_LOCK). Marked for removal when made: it goes with the
    /// test process however the test ends.
    fn small_region() -> Option<StoreSegment> {
        let sizes = Sizes::of(16, MIN_ROOM).unwrap();
        StoreSegment::create(sizes, "lz4", true, DEVICE, true)
            .inspect_err(|e| println!("SKIP: {e}"))
            .ok()
    }

    /// A region of [`small_region`]'s device with the blocks layouts 5 and 6 gave it (its
    /// header says this release's layout until a test writes another); `None` (printed) as
    /// for [`small_region`].
    fn old_layout_region() -> Option<StoreSegment> {
        let sizes = Sizes::before_layout_7(16, MIN_ROOM).unwrap();
        StoreSegment::create(sizes, "lz4", true, DEVICE, true)
            .inspect_err(|e| println!("SKIP: {e}"))
            .ok()
    }

    /// Rewrites `region`'s header as made, but for layout `version`, as a daemon of that
    /// layout would have left it.
    fn write_version(region: &StoreSegment, version: u32) {
        // SAFETY: the header lies at the start of the test's own mapping of the segment,
        // which stays mapped; no other thread of the test reads it meanwhile.
        unsafe {
            ptr::write_volatile(
                region.base as *mut Header,
                Header {
                    version,
                    ..region.header
                },
            )
        };
    }

    /// The layouts a daemon of the release before layout 8 takes over, and those of an
    /// earlier build of this release (which marked a moved layout 6 or 5 store only by the
    /// word at [`TAGS_OFF`]).
    const EARLIER_RELEASE: &[u32] = &[5, 6, 7];
    const EARLIER_BUILD: &[u32] = &[5, 6, 7, 8];

    /// Whether a daemon that knows the layouts `known` takes over a store whose header says
    /// `version`: as `check_header` does, it takes over exactly the layouts it knows.
    fn taken_over_by(known: &[u32], version: u32) -> bool {
        known.contains(&version)
    }

    fn expected() -> Expected<'static> {
        Expected {
            device: DEVICE,
            pages: 16,
            algorithm: "lz4",
            checksums: true,
        }
    }

    /// The dictionary a daemon keeps is what the next one attaching the region reads; the
    /// carried counters beside it are untouched by it.
    #[test]
    fn a_kept_dictionary_is_found_by_the_next_attach() {
        let Some(region) = small_region() else {
            return;
        };
        assert_eq!(
            region.dictionary_area().read(),
            Ok(None),
            "a new store has none"
        );
        let dict: Vec<u8> = (0..uzram_core::codec::MAX_DICTIONARY_BYTES)
            .map(|i| (i % 251) as u8)
            .collect();
        region.dictionary_area().keep(&dict).unwrap();
        let counters = region.carried_counters();
        assert!(counters.iter().all(|w| w.load(Ordering::Relaxed) == 0));
        let again = StoreSegment::attach(region.id(), expected()).unwrap();
        assert_eq!(again.dictionary_area().read(), Ok(Some(dict)));
        remove(region.id());
    }

    #[test]
    fn removing_a_store_removes_its_staging_and_floors() {
        let Some(region) = small_region() else {
            return;
        };
        assert_eq!(region.staging(), None, "a new store has no staging");
        assert_eq!(region.floors(), None, "a new store has no floors");
        let staging = StagingSegment::create(1, 1, false).expect("a staging segment");
        let id = staging.id();
        region.set_staging(Some(id));
        assert_eq!(region.staging(), Some(id));
        let floors = FloorsSegment::create(8).expect("a floors segment");
        region.set_floors(Some(floors.id()));
        assert_eq!(region.floors(), Some(floors.id()));
        let again = StoreSegment::attach(region.id(), expected()).unwrap();
        assert_eq!(again.staging(), Some(id));
        assert_eq!(again.floors(), Some(floors.id()));
        assert_eq!(
            store_facts(region.id()),
            Some(StoreFacts {
                device: DEVICE,
                pages: 16,
                staging: Some(id),
                floors: Some(floors.id()),
            })
        );
        let floors_id = floors.id();
        // SAFETY: nothing uses the segments' memory.
        unsafe {
            staging.detach();
            floors.detach();
        }
        remove(region.id());
        assert!(!exists(id), "the staging segment outlived its store");
        assert!(!exists(floors_id), "the floors segment outlived its store");
        region.set_staging(None);
        assert_eq!(region.staging(), None);
        region.set_floors(None);
        assert_eq!(region.floors(), None);
    }

    #[test]
    fn a_header_that_is_not_what_its_device_lays_out_is_refused() {
        let Some(region) = small_region() else {
            return;
        };
        let states = region.block_states().expect("block states");
        assert_eq!(states.len(), region.blocks().1 / UNIT);
        states[1].store(1, Ordering::Relaxed);
        let again = StoreSegment::attach(region.id(), expected()).expect("taken over");
        assert_eq!(again.block_states().unwrap()[1].load(Ordering::Relaxed), 1);
        // Another device, size, codec or checksum setting than the header's.
        for (expect, what) in [
            (
                Expected {
                    device: 8,
                    ..expected()
                },
                "device 7, not 8",
            ),
            (
                Expected {
                    pages: 17,
                    ..expected()
                },
                "16 pages",
            ),
            (
                Expected {
                    algorithm: "zstd",
                    ..expected()
                },
                "lz4, not zstd",
            ),
            (
                Expected {
                    checksums: false,
                    ..expected()
                },
                "checksums",
            ),
        ] {
            let err = StoreSegment::attach(region.id(), expect).expect_err(what);
            assert!(err.to_string().contains(what), "{err}");
        }
        // Damaged headers: lengths that overflow when multiplied, lengths that do not fit,
        // an older layout, a room that is no device's.
        let h = region.header;
        for (bad, what) in [
            (
                Header {
                    table_len: u64::MAX / 8 + 2,
                    ..h
                },
                "layout",
            ),
            (
                Header {
                    dir_len: 1 << 62,
                    ..h
                },
                "layout",
            ),
            (
                Header {
                    dir_len: h.dir_len + 1,
                    ..h
                },
                "layout",
            ),
            (
                Header {
                    states_len: h.states_len - 1,
                    ..h
                },
                "layout",
            ),
            (
                Header {
                    table_off: u64::MAX - 4,
                    ..h
                },
                "layout",
            ),
            (
                Header {
                    len: h.len + UNIT as u64,
                    ..h
                },
                "layout",
            ),
            (Header { version: 3, ..h }, "layout version 3"),
            (Header { version: 4, ..h }, "layout version 4"),
            (
                Header {
                    room_len: u64::MAX,
                    ..h
                },
                "recovery room",
            ),
            (
                Header {
                    room_len: (MIN_ROOM + UNIT) as u64,
                    ..h
                },
                "layout",
            ),
            (
                Header {
                    magic: *b"UZRAMST0",
                    ..h
                },
                "no uzram store header",
            ),
        ] {
            // SAFETY: the header lies at the start of our mapping; nothing else uses it.
            unsafe { ptr::write_volatile(region.base as *mut Header, bad) };
            let err = StoreSegment::attach(region.id(), expected()).expect_err(what);
            assert!(err.to_string().contains(what), "{what}: {err}");
        }
        assert!(region.checksums_name_pages());
        // SAFETY: as above.
        unsafe { ptr::write_volatile(region.base as *mut Header, h) };
        assert!(StoreSegment::attach(region.id(), expected())
            .unwrap()
            .checksums_name_pages());
        // Layouts 5 and 6 gave fewer blocks: this one's blocks are not theirs, whether or not
        // their tags were moved.
        for version in [UNBOUND_VERSION, BOUND_VERSION, UNBOUND_MOVED, BOUND_MOVED] {
            write_version(&region, version);
            let err = StoreSegment::attach(region.id(), expected()).expect_err("fewer blocks");
            assert!(err.to_string().contains("layout"), "{version}: {err}");
        }
        remove(region.id());

        // A store of layout 6 (bound checksums) or 5 (unbound), its tags moved or not, is
        // taken over as made, its store keeping its checksums as they were; one of layout 7
        // or 8 with their blocks is not.
        let old = old_layout_region().unwrap();
        for (version, bound) in [
            (BOUND_VERSION, true),
            (UNBOUND_VERSION, false),
            (BOUND_MOVED, true),
            (UNBOUND_MOVED, false),
        ] {
            write_version(&old, version);
            let taken = StoreSegment::attach(old.id(), expected()).unwrap();
            assert_eq!(taken.checksums_name_pages(), bound, "layout {version}");
        }
        for version in [LAYOUT_7, VERSION] {
            write_version(&old, version);
            assert!(
                StoreSegment::attach(old.id(), expected()).is_err(),
                "layout {version} with the blocks of layout 6"
            );
        }
        remove(old.id());
    }

    /// A region of layout 7 is taken over, and says its stored entries have the earlier
    /// tag until it is marked, which makes it layout 8 (which an earlier release refuses);
    /// a region of layout 8 has this release's tag from the start, and one of a layout this
    /// release does not know is refused.
    #[test]
    fn a_layout_7_store_is_taken_over_with_its_tags_to_move() {
        let Some(region) = small_region() else {
            return;
        };
        assert_eq!(region.header.version, VERSION);
        assert!(region.stored_tags_moved());
        assert!(!region.set_stored_tags_moved(), "layout 8 says so already");
        write_version(&region, LAYOUT_7);
        let taken = StoreSegment::attach(region.id(), expected()).unwrap();
        assert!(!taken.stored_tags_moved(), "layout 7, not yet moved");
        assert!(taken.set_stored_tags_moved());
        assert!(taken.stored_tags_moved());
        let again = StoreSegment::attach(region.id(), expected()).unwrap();
        assert!(again.stored_tags_moved(), "the mark is the region's");
        assert_eq!(again.header.version, VERSION, "moved, layout 7 is layout 8");
        assert!(!taken_over_by(EARLIER_RELEASE, again.header.version));
        assert_eq!(again.recorded_word(TAGS).load(Ordering::Relaxed), 0);
        write_version(&region, VERSION + 1);
        let err = StoreSegment::attach(region.id(), expected()).expect_err("a later layout");
        assert!(err.to_string().contains("layout version 9"), "{err}");
        remove(region.id());
    }

    /// A region of layout 6 or 5 whose tags a takeover moved says so in a version of its
    /// own, which no earlier release takes over (where it would lose every stored page),
    /// and is still taken over here as the layout it was made with. One that an earlier
    /// build of this release marked by a word of the header's unit alone is taken over as
    /// moved, and gets its version on the next takeover.
    #[test]
    fn a_moved_layout_6_or_5_store_says_so_in_a_version_earlier_releases_refuse() {
        let Some(old) = old_layout_region() else {
            return;
        };
        for (version, moved, bound) in [
            (BOUND_VERSION, BOUND_MOVED, true),
            (UNBOUND_VERSION, UNBOUND_MOVED, false),
        ] {
            let made = Header {
                version,
                ..old.header
            };
            write_version(&old, version);
            old.recorded_word(TAGS).store(0, Ordering::Relaxed);
            let taken = StoreSegment::attach(old.id(), expected()).unwrap();
            assert!(
                !taken.stored_tags_moved(),
                "layout {version}, not yet moved"
            );
            assert!(taken.set_stored_tags_moved());
            assert!(taken.stored_tags_moved());
            assert!(!taken.set_stored_tags_moved(), "said once");
            let again = StoreSegment::attach(old.id(), expected()).unwrap();
            assert_eq!(again.header.version, moved, "layout {version}, moved");
            assert!(
                !taken_over_by(EARLIER_RELEASE, again.header.version)
                    && !taken_over_by(EARLIER_BUILD, again.header.version),
                "an earlier release would take over moved layout {version}"
            );
            assert_eq!(
                again.header,
                Header {
                    version: moved,
                    ..made
                },
                "laid out as made"
            );
            assert_eq!(blocks_in(&again), blocks_in(&taken));
            assert!(again.stored_tags_moved());
            assert_eq!(again.checksums_name_pages(), bound, "layout {version}");

            // An earlier build of this release's mark, the word alone.
            write_version(&old, version);
            old.recorded_word(TAGS).store(TAGS_TAG, Ordering::Relaxed);
            assert!(taken_over_by(EARLIER_RELEASE, version), "what the gap was");
            let marked = StoreSegment::attach(old.id(), expected()).unwrap();
            assert!(marked.stored_tags_moved(), "not to be moved again");
            assert!(marked.set_stored_tags_moved(), "its version is moved on");
            let again = StoreSegment::attach(old.id(), expected()).unwrap();
            assert_eq!(again.header.version, moved);
            assert!(again.stored_tags_moved());
        }
        // The word is no mark for layout 7, which never had it.
        let Some(region) = small_region() else {
            return;
        };
        write_version(&region, LAYOUT_7);
        region
            .recorded_word(TAGS)
            .store(TAGS_TAG, Ordering::Relaxed);
        let taken = StoreSegment::attach(region.id(), expected()).unwrap();
        assert!(!taken.stored_tags_moved());
        remove(region.id());
        remove(old.id());
    }

    /// Where a region's blocks lie in it, and their bytes.
    fn blocks_in(region: &StoreSegment) -> (usize, usize) {
        let (start, len) = region.blocks();
        (start - region.base, len)
    }

    /// Arena segments in this process's heap, found again by index as a region's directory
    /// finds them: for a store over a region's table without the block pool, which is the
    /// whole process's.
    #[derive(Debug, Default)]
    struct HeapHome {
        placed: std::sync::Mutex<std::collections::HashMap<usize, usize>>,
    }

    impl SegmentHome for HeapHome {
        fn alloc(&self) -> Option<SegmentWords> {
            Some((0..SEGMENT_BYTES / 8).map(|_| AtomicU64::new(0)).collect())
        }
        fn placed(&self, index: usize, at: *const AtomicU64) {
            self.placed.lock().unwrap().insert(index, at as usize);
        }
        fn removed(&self, index: usize) {
            self.placed.lock().unwrap().remove(&index);
        }
        fn find(&self, index: usize) -> Option<SegmentWords> {
            let at = self.placed.lock().unwrap().remove(&index)?;
            let words = ptr::slice_from_raw_parts_mut(at as *mut AtomicU64, SEGMENT_BYTES / 8);
            // SAFETY: `at` starts a segment `alloc` made from the global allocator, of these
            // words, which the store it was placed in let go of without freeing (its home
            // outlives it); taken from the map, so only this box owns it.
            Some(unsafe { Box::from_raw(words) })
        }
        fn outlives_the_store(&self) -> bool {
            true
        }
    }

    /// A store of layout 6 or 5 an earlier release left (its stored entries under the
    /// earlier tag) is taken over: its entries moved, its version one no earlier release
    /// takes over, and every page read back by the store over the same table, its checksums
    /// held to the rules of its layout.
    #[test]
    fn a_moved_layout_6_or_5_store_keeps_its_pages() {
        use uzram_core::codec::Algorithm;
        use uzram_core::store::{PageStore, Persistence, StoreConfig};
        use uzram_core::PAGE_SIZE;

        for (version, moved) in [
            (BOUND_VERSION, BOUND_MOVED),
            (UNBOUND_VERSION, UNBOUND_MOVED),
        ] {
            let Some(old) = old_layout_region() else {
                return;
            };
            write_version(&old, version);
            let region = StoreSegment::attach(old.id(), expected()).unwrap();
            let mut cfg = StoreConfig::new(16, Algorithm::Lz4);
            cfg.checksums_name_pages = region.checksums_name_pages();
            let len = PageStore::table_len(16).unwrap();
            let home = Arc::new(HeapHome::default());
            let persist = || Persistence {
                table: &region.table()[..len],
                home: home.clone(),
            };
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(version);
            let pages: Vec<[u8; PAGE_SIZE]> = (0..16u8)
                .map(|i| {
                    let mut page = [0u8; PAGE_SIZE];
                    match i {
                        // compressible, each its own
                        0..=7 => page.iter_mut().enumerate().for_each(|(at, b)| {
                            *b = (at / 64) as u8 ^ i;
                        }),
                        // stored raw
                        8 => page.iter_mut().for_each(|b| {
                            seed ^= seed << 13;
                            seed ^= seed >> 7;
                            seed ^= seed << 17;
                            *b = seed as u8;
                        }),
                        9 => page.fill(0x5a),
                        _ => {}
                    }
                    page
                })
                .collect();
            let store = PageStore::new_persistent(cfg.clone(), persist()).unwrap();
            for (i, page) in pages.iter().enumerate().take(10) {
                store.write(i as u64, page).unwrap();
            }
            drop(store);
            let entries = || PageStore::kept_entries(16, region.table()).unwrap();
            let stored = entries()
                .iter()
                .filter(|w| w.load(Ordering::Relaxed) & 0b111 == 0b111)
                .count() as u64;
            assert!(stored >= 9, "{stored} stored pages");
            region.as_earlier_layout_for_tests(16, version);

            let taken = StoreSegment::attach(old.id(), expected()).unwrap();
            assert!(!taken.stored_tags_moved());
            assert_eq!(
                PageStore::move_stored_tags(16, taken.table()).unwrap(),
                stored
            );
            assert!(taken.set_stored_tags_moved());
            let again = StoreSegment::attach(old.id(), expected()).unwrap();
            assert_eq!(again.header.version, moved);
            assert!(!taken_over_by(EARLIER_RELEASE, again.header.version));
            assert_eq!(
                blocks_in(&again),
                blocks_in(&region),
                "layout {version}'s blocks"
            );
            assert!(again.stored_tags_moved());
            cfg.checksums_name_pages = again.checksums_name_pages();
            assert_eq!(cfg.checksums_name_pages, version == BOUND_VERSION);
            let (store, found) = PageStore::recover(cfg, persist(), None).unwrap();
            assert_eq!(found.damaged_entries, 0, "layout {version}");
            assert_eq!(found.pages_stored, 10, "layout {version}");
            for (i, page) in pages.iter().enumerate() {
                let mut back = [1u8; PAGE_SIZE];
                store.read(i as u64, &mut back).unwrap();
                assert!(back == *page, "layout {version}: page {i}");
            }
            drop(store);
            remove(old.id());
        }
    }

    #[test]
    fn a_store_another_user_made_is_never_taken_over() {
        // A segment of the right size whose header is a store's, made by nobody.
        let Some(region) = small_region() else {
            return;
        };
        let size = crate::shm::stat(region.id()).unwrap().size;
        let Some(id) = crate::shm::tests::nobodys_segment(0, size, 0o666) else {
            return;
        };
        let copy = crate::shm::Attached::map(id, false);
        assert!(copy.is_err(), "root attached nobody's segment through shm");
        crate::shm::tests::write_as_owner(id, crate::shm::tests::bytes_of(&region.header));
        let err = StoreSegment::attach(id, expected()).expect_err("nobody's store");
        assert!(err.to_string().contains("not root's alone"), "{err}");
        assert!(MappedRoom::map(id, None).is_err());
        assert_eq!(store_facts(id), None);
        remove(id);
        assert!(exists(id), "remove() took someone else's segment");
        crate::shm::remove(id).unwrap();
    }

    #[test]
    fn a_room_given_back_for_a_failed_handover_is_committed_again() {
        let Some(region) = small_region() else {
            return;
        };
        let (room, len) = region.room();
        let resident = || {
            crate::sys::memory::resident_pages(room, len)
                .unwrap()
                .into_iter()
                .filter(|&p| p)
                .count()
        };
        assert_eq!(resident(), len / 4096, "a new store's room is committed");
        // Asked for as another device's store (a record whose segment id was reused): kept.
        let device = store_facts(region.id()).unwrap().device;
        let err = MappedRoom::map(region.id(), Some(device.wrapping_add(1))).unwrap_err();
        assert!(err.to_string().contains("not"), "{err}");
        restore_room(region.id(), Some(device.wrapping_add(1)));
        assert_eq!(resident(), len / 4096, "another device's room was touched");
        assert_eq!(
            MappedRoom::map(region.id(), Some(device))
                .unwrap()
                .release()
                .unwrap(),
            len
        );
        assert_eq!(resident(), 0, "given back");
        restore_room(region.id(), None);
        assert_eq!(resident(), len / 4096, "committed again");
        remove(region.id());
    }

    /// This process's mappings of segment `id` (its `/SYSV` lines in /proc/self/maps, whose
    /// inode is the segment's id): a room mapped ahead adds one, and only while it lives.
    /// Not shm_nattch, which counts every process: a child another test forks meanwhile
    /// holds copies of this process's mappings until it execs or exits. Counted by address:
    /// the file is read in pieces, and another test's thread that maps or unmaps meanwhile
    /// can make a line come twice.
    fn attaches(id: i32) -> u64 {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let id = id.to_string();
        maps.lines()
            .filter(|line| {
                // address, perms, offset, device, inode (a SysV segment's id), path
                let mut fields = line.split_whitespace().skip(4);
                fields.next() == Some(id.as_str())
                    && fields.next().is_some_and(|path| path.starts_with("/SYSV"))
            })
            .filter_map(|line| line.split_whitespace().next())
            .collect::<std::collections::HashSet<_>>()
            .len() as u64
    }

    #[test]
    fn a_room_mapped_ahead_maps_only_the_room_and_gives_it_back() {
        let Some(region) = small_region() else {
            return;
        };
        let (room, len) = region.room();
        let before = attaches(region.id());
        let mapped = MappedRoom::map(region.id(), None).unwrap();
        assert_eq!(mapped.shm(), region.id());
        assert_eq!(attaches(region.id()), before + 1);
        // only the room is mapped: the maps line of its address spans the room's length
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let line = maps
            .lines()
            .find(|l| l.starts_with(&format!("{:x}-", mapped.start)))
            .expect("the room's mapping");
        let (from, to) = line.split_once(' ').unwrap().0.split_once('-').unwrap();
        let span =
            usize::from_str_radix(to, 16).unwrap() - usize::from_str_radix(from, 16).unwrap();
        assert_eq!(span, len, "{line}");
        let resident = || {
            crate::sys::memory::resident_pages(room, len)
                .unwrap()
                .into_iter()
                .filter(|&p| p)
                .count()
        };
        assert_eq!(resident(), len / 4096);
        assert_eq!(mapped.release().unwrap(), len);
        assert_eq!(resident(), 0, "given back through the mapping made ahead");
        drop(mapped);
        assert_eq!(attaches(region.id()), before);
        remove(region.id());
    }

    /// The room is given back before the store is checked whole, so it is mapped only
    /// where the header's whole layout is a store's: a header whose room were moved over
    /// the table (damage) would have the table zeroed. A store an earlier release laid out
    /// (layout 5) has its room given back as this release's does.
    #[test]
    fn a_room_is_mapped_only_where_the_whole_layout_is_a_stores() {
        let Some(region) = small_region() else {
            return;
        };
        let good = region.header;
        let write = |h: Header| {
            // SAFETY: the header lies at the start of our own mapping of the segment, and
            // no other thread of this test reads it meanwhile.
            unsafe { ptr::write_volatile(region.base as *mut Header, h) }
        };
        write(Header {
            room_off: good.table_off,
            ..good
        });
        let err = MappedRoom::map(region.id(), None).unwrap_err();
        assert!(err.to_string().contains("layout"), "{err}");
        write(Header {
            room_len: good.room_len + 4096,
            ..good
        });
        assert!(MappedRoom::map(region.id(), None).is_err());
        write(Header {
            version: UNBOUND_VERSION,
            ..good
        });
        assert!(
            MappedRoom::map(region.id(), None).is_err(),
            "layout 5 with layout 7's blocks"
        );
        write(Header {
            version: UNBOUND_MOVED,
            ..good
        });
        assert!(
            MappedRoom::map(region.id(), None).is_err(),
            "moved layout 5 with layout 7's blocks"
        );
        write(good);
        remove(region.id());
        let old = old_layout_region().unwrap();
        let (_, len) = old.room();
        for version in [UNBOUND_VERSION, BOUND_VERSION, UNBOUND_MOVED, BOUND_MOVED] {
            write_version(&old, version);
            assert_eq!(
                MappedRoom::map(old.id(), None).unwrap().release().unwrap(),
                len,
                "a layout {version} store's room"
            );
        }
        remove(old.id());
    }

    #[test]
    fn a_segment_that_is_no_store_has_no_room_to_map() {
        let Ok(id) = crate::shm::create(2 * UNIT) else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        let held = crate::shm::Attached::map(id, true).unwrap();
        crate::shm::remove(id).unwrap();
        let err = MappedRoom::map(id, None).unwrap_err();
        assert!(err.to_string().contains("header"), "{err}");
        assert_eq!(attaches(id), 1, "nothing left mapped but ours");
        drop(held);
    }
}

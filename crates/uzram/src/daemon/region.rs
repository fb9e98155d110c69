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
//! `carry.rs`), the page table (8 bytes a page), the segment directory (4 bytes an arena
//! segment: the block it lives in, plus one; 0 for none), the block states (a byte a block:
//! whether its pages are in memory, `pool::BlockState`; since layout 3), the recovery room,
//! then the blocks the pool hands out.
//!
//! The block states let a recovery find the old daemon's free blocks that are still in
//! memory without asking the kernel page by page: `mincore` over the blocks took ~30 ms per
//! 1.3 GiB of device on a 2-core host and 120-240 ms of a 1.2 GiB device's takeover pause
//! in the TCG guest. A layout 2 region (no states) is still taken over, with `mincore`.
//!
//! The recovery room ([`room_bytes`], committed and never used) is memory a recovery gives
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

use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use uzram_core::store::{SegmentHome, SegmentWords, SEGMENT_BYTES};

use super::pool;

const MAGIC: [u8; 8] = *b"UZRAMST1";
const VERSION: u32 = 3;
/// The layout before the block states: still taken over (its free blocks found by `mincore`).
const VERSION_NO_STATES: u32 = 2;
/// The smallest recovery room (see the module docs): a new daemon's heap reserve, stacks
/// and rings before it serves, with two queues' I/O buffers (what the 24 MiB of every room
/// was sized for until it grew with the queues: [`room_bytes`]).
pub const MIN_ROOM: usize = 24 << 20;

/// What a recovering daemon allocates before it serves besides its heap reserve and I/O
/// buffers: stacks, the recovered store's bookkeeping, static data, page tables, rings.
/// Measured in the guest's crash test (1 GiB device, 2 queues, some 40 thousand pages
/// stored): RssAnon 29 MiB against 24 MiB of reserve and buffers, page tables 0.4-0.7 MiB.
/// A room without it was spent before the new daemon served when the hog had taken the
/// dead daemon's freed memory first, and the daemon's queue threads then waited in reclaim
/// for good (docs/recovery.md). It had 16 MiB more for a while, as slack for room pages
/// stranded on a CPU's free list (11.5 MiB in a CI run); a recovery now keeps those lists
/// short while it gives the room back (`free_lists`), and the 16 MiB, locked in every
/// device, were what a guest short of memory then missed (the OOM killer took scenario r's
/// hog in 2 of 17 runs with them).
const START_REST: usize = 8 << 20;

/// The recovery room for a device of `queues` queues of `depth` tags: the heap reserve,
/// every tag's locked I/O buffer and the rest of what a new daemon allocates before it
/// serves ([`START_REST`]); never under [`MIN_ROOM`]. A fixed 24 MiB fell 16 MiB short of
/// the first two with four queues at the default depth.
pub fn room_bytes(queues: u16, depth: u16) -> usize {
    let buffers = usize::from(queues) * usize::from(depth) * super::target::IO_BUF_BYTES as usize;
    (super::HEAP_RESERVE + buffers + START_REST)
        .next_multiple_of(UNIT)
        .max(MIN_ROOM)
}
const UNIT: usize = pool::BLOCK;
/// Where the id of the device's GPU staging segment (`staging.rs`) is recorded: a word in
/// the header's unit after the header, [`STAGING_TAG`] above the id (0: none; a region of
/// an older daemon has 0 there).
const STAGING_OFF: usize = 2048;
const STAGING_TAG: u64 = 0x5354_4147 << 32;
/// Where the carried counters (`carry.rs`) live: in the header's unit, after the header.
const CARRY_OFF: usize = 4096;
const _: () = assert!(
    std::mem::size_of::<Header>() <= STAGING_OFF
        && STAGING_OFF + 8 <= CARRY_OFF
        && CARRY_OFF + super::carry::WORDS * 8 <= UNIT
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
    /// The block states (layout 3; 0 and 0 in layout 2, whose header ended before them, in
    /// the unit's zeroed bytes).
    states_off: u64,
    states_len: u64,
}

/// Why a region could not be made or taken over.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// The call and its purpose.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The segment is not a store this daemon can take over.
    #[error("shared memory segment {id} is not a uzram store this daemon can serve: {why}")]
    Foreign {
        /// The segment id.
        id: i32,
        /// What did not match.
        why: String,
    },
}

fn sys(what: &'static str) -> impl FnOnce(std::io::Error) -> RegionError {
    move |source| RegionError::Sys { what, source }
}

/// An attached region; see the module docs. Never detached: the store in it lives as long as
/// the process.
#[derive(Debug)]
pub struct Region {
    id: i32,
    base: usize,
    header: Header,
}

/// Sizes of a store's parts, for [`Region::create`].
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Device pages.
    pub pages: u64,
    /// Page table words (`PageStore::table_len`).
    pub table_len: usize,
    /// Directory entries (`PageStore::segment_capacity`).
    pub dir_len: usize,
    /// Bytes of blocks for the pool.
    pub block_bytes: usize,
    /// Bytes of the recovery room ([`room_bytes`]), a whole number of units.
    pub room: usize,
}

impl Region {
    /// Makes a new locked segment for a store of `sizes` with `algorithm`. Nothing in it is
    /// committed until touched.
    pub fn create(sizes: Sizes, algorithm: &str) -> Result<Region, RegionError> {
        let units = |bytes: usize| bytes.div_ceil(UNIT) * UNIT;
        let table_off = UNIT;
        let dir_off = table_off + units(sizes.table_len * 8);
        let states_off = dir_off + units(sizes.dir_len * 4);
        let blocks = sizes.block_bytes.div_ceil(UNIT);
        let room_off = states_off + units(blocks);
        let blocks_off = room_off + sizes.room;
        let len = blocks_off + blocks * UNIT;
        let mut name = [0u8; 32];
        let n = algorithm.len().min(name.len());
        name[..n].copy_from_slice(&algorithm.as_bytes()[..n]);
        let header = Header {
            magic: MAGIC,
            version: VERSION,
            device: u32::MAX,
            pages: sizes.pages,
            table_off: table_off as u64,
            table_len: sizes.table_len as u64,
            dir_off: dir_off as u64,
            dir_len: sizes.dir_len as u64,
            blocks_off: blocks_off as u64,
            len: len as u64,
            algorithm: name,
            room_off: room_off as u64,
            room_len: sizes.room as u64,
            states_off: states_off as u64,
            states_len: blocks as u64,
        };
        let id = crate::sys::shm_create(len)
            .map_err(sys("shmget (creating the store's shared memory)"))?;
        let region = Self::map(id).inspect_err(|_| remove(id))?;
        // SAFETY: the header page lies in our fresh read-write mapping, nobody else uses it.
        unsafe { ptr::write_volatile(region.base as *mut Header, header) };
        let region = Region { header, ..region };
        region.lock_parts();
        region.commit_room();
        Ok(region)
    }

    /// Takes over segment `id` left by an earlier daemon: attaches it and checks its header.
    pub fn attach(id: i32) -> Result<Region, RegionError> {
        let region = Self::map(id)?;
        let size = crate::sys::shm_size(id).map_err(sys("shmctl IPC_STAT"))?;
        if size < UNIT {
            return Err(foreign(id, format!("only {size} bytes")));
        }
        // SAFETY: the segment is at least one unit long, so the header lies in the mapping.
        let header = unsafe { ptr::read_volatile(region.base as *const Header) };
        let fits = |off: u64, len: u64| off.checked_add(len).is_some_and(|end| end <= size as u64);
        if header.magic != MAGIC {
            return Err(foreign(id, "no uzram store header".into()));
        }
        if header.version != VERSION && header.version != VERSION_NO_STATES {
            return Err(foreign(id, format!("layout version {}", header.version)));
        }
        let blocks = (header.len.saturating_sub(header.blocks_off)) / UNIT as u64;
        let states_ok = match header.version {
            VERSION => {
                header.states_len == blocks
                    && fits(header.states_off, header.states_len)
                    && header.states_off + header.states_len <= header.room_off
            }
            _ => header.states_off == 0 && header.states_len == 0,
        };
        if !states_ok {
            return Err(foreign(id, "its block states do not fit its blocks".into()));
        }
        if header.len != size as u64
            || !fits(header.table_off, header.table_len * 8)
            || !fits(header.dir_off, header.dir_len * 4)
            || !fits(header.blocks_off, 0)
            || !fits(header.room_off, header.room_len)
            || header.room_off + header.room_len > header.blocks_off
            || header.room_off % 4096 != 0
            || header.table_off % 8 != 0
            || header.dir_off % 4 != 0
            || header.blocks_off % UNIT as u64 != 0
        {
            return Err(foreign(id, "its layout does not fit its size".into()));
        }
        let region = Region { header, ..region };
        region.lock_parts();
        Ok(region)
    }

    fn map(id: i32) -> Result<Region, RegionError> {
        crate::sys::shm_lock(id).map_err(sys("shmctl SHM_LOCK (keeping the store resident)"))?;
        // SAFETY: shmat maps the segment at an address the kernel picks; no memory of ours is
        // touched.
        let base = unsafe { libc::shmat(id, ptr::null(), 0) };
        if base as isize == -1 {
            return Err(sys("shmat (mapping the store)")(
                std::io::Error::last_os_error(),
            ));
        }
        let len = crate::sys::shm_size(id).unwrap_or(0);
        Ok(Region {
            id,
            base: base as usize,
            header: Header {
                magic: [0; 8],
                version: 0,
                device: u32::MAX,
                pages: 0,
                table_off: 0,
                table_len: 0,
                dir_off: 0,
                dir_len: 0,
                blocks_off: 0,
                len: len as u64,
                algorithm: [0; 32],
                room_off: 0,
                room_len: 0,
                states_off: 0,
                states_len: 0,
            },
        })
    }

    /// Header, page table and directory: populated and locked now, since queue threads write
    /// them and a page fault there under memory pressure can deadlock the device (mlock
    /// faults every page in; touching them from Rust is not enough: an atomic add of 0 is
    /// compiled to a load). Blocks: unlocked (mlockall locked the new mapping), since
    /// `MADV_REMOVE`, which gives freed blocks back, refuses locked mappings; `SHM_LOCK` keeps
    /// them resident, and the pool faults them in before handing them out.
    fn lock_parts(&self) {
        let meta = self.header.room_off as usize;
        // SAFETY: mlock and munlock only change the paging of ranges of our own mapping.
        if unsafe { libc::mlock(self.base as *const libc::c_void, meta) } != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "locking the store's page table failed");
        }
        // the room and the blocks, which follow it
        let start = self.base + self.header.room_off as usize;
        let len = self.header.len as usize - self.header.room_off as usize;
        // SAFETY: as above.
        if unsafe { libc::munlock(start as *const libc::c_void, len) } != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "unlocking the store's blocks failed: freed blocks cannot go back");
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

    /// The segment's id (what `uzram recover` attaches to).
    pub fn id(&self) -> i32 {
        self.id
    }

    /// Device pages the store in it has.
    pub fn pages(&self) -> u64 {
        self.header.pages
    }

    /// The store's codec, as written at creation.
    pub fn algorithm(&self) -> String {
        let end = self.header.algorithm.iter().position(|&b| b == 0);
        String::from_utf8_lossy(&self.header.algorithm[..end.unwrap_or(32)]).into_owned()
    }

    /// Records the device id (once the kernel gave it).
    pub fn set_device(&mut self, id: u32) {
        self.header.device = id;
        // SAFETY: the header lies at the start of our mapping.
        unsafe { ptr::write_volatile(self.base as *mut Header, self.header) };
    }

    fn staging_word(&self) -> &AtomicU64 {
        // SAFETY: the header's unit lies in the mapping (see `carried_counters`); the word is
        // 8-aligned, only ever accessed atomically, and the mapping is never detached.
        unsafe { &*((self.base + STAGING_OFF) as *const AtomicU64) }
    }

    /// The device's GPU staging segment, if it has one (`staging.rs`).
    pub fn staging(&self) -> Option<i32> {
        staging_id(self.staging_word().load(Ordering::Acquire))
    }

    /// Records the device's GPU staging segment (`None`: it has none).
    pub fn set_staging(&self, id: Option<i32>) {
        let word = id.map_or(0, |id| STAGING_TAG | u64::from(id as u32));
        self.staging_word().store(word, Ordering::Release);
    }

    /// The carried counters' words (`carry.rs`), in the header's unit.
    pub fn carried_counters(&self) -> &'static [AtomicU64] {
        // SAFETY: the header's unit lies in the mapping (`create` made it, `attach` checked
        // the segment is at least a unit long); the words are 8-aligned (the mapping is
        // page-aligned), only ever accessed atomically, and the mapping is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + CARRY_OFF) as *const AtomicU64,
                super::carry::WORDS,
            )
        }
    }

    /// The page table. Call once: the store owns it from then on.
    pub fn take_table(&self) -> &'static mut [u64] {
        // SAFETY: `attach`/`create` checked that the table lies in the mapping (8-aligned);
        // the mapping is never detached, and this is its only handle.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.base + self.header.table_off as usize) as *mut u64,
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

    /// A byte per block (`pool::BlockState`), for regions of layout 3; `None` for one of
    /// layout 2.
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

    /// The segment home over this region's directory and blocks.
    pub fn home(&self) -> Home {
        let (start, len) = self.blocks();
        Home {
            dir: self.dir(),
            start,
            blocks: len / UNIT,
        }
    }
}

/// Commits the recovery room at `start` (`len` bytes) again after a recovery, a MiB at a
/// time with a short pause between, so the reclaim it may cause (swap-out to this device,
/// which serves by now) is spread out. It does not wait for memory to spare: after a
/// crash under a swap storm the storm goes on, and MemAvailable stayed under the three
/// rooms the first version waited for, so a second crash found no room and its new daemon
/// waited in reclaim until `uzram recover` gave up (scenario r on 6.12: it hung in 2 of 5
/// runs, and took 15 s in a third).
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
pub fn restore_room(id: i32) {
    let restored = with_room(id, |room, len| {
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
    f: impl FnOnce(usize, usize) -> Result<usize, RegionError>,
) -> Result<usize, RegionError> {
    let attached = attach_room(id)?;
    let result = f(attached.room, attached.len);
    // SAFETY: detaches the mapping made by attach_room; nothing refers to it.
    unsafe { libc::shmdt(attached.base) };
    result
}

/// Segment `id` mapped whole, its header checked to be a store's whose room lies in it.
struct AttachedRoom {
    base: *mut libc::c_void,
    size: usize,
    room: usize,
    len: usize,
}

fn attach_room(id: i32) -> Result<AttachedRoom, RegionError> {
    // SAFETY: shmat maps the segment where the kernel picks; none of our memory is touched.
    let base = unsafe { libc::shmat(id, ptr::null(), 0) };
    if base as isize == -1 {
        return Err(sys("shmat (the store, for its recovery room)")(
            std::io::Error::last_os_error(),
        ));
    }
    let size = crate::sys::shm_size(id).unwrap_or(0);
    let checked = if size < UNIT {
        Err(foreign(id, format!("only {size} bytes")))
    } else {
        // SAFETY: the segment is at least one unit long, so the header lies in the mapping.
        let header = unsafe { ptr::read_volatile(base as *const Header) };
        let end = header.room_off.checked_add(header.room_len);
        if header.magic != MAGIC
            || (header.version != VERSION && header.version != VERSION_NO_STATES)
        {
            Err(foreign(id, "no uzram store header of this version".into()))
        } else if !end.is_some_and(|end| end <= size as u64)
            || header.room_off % 4096 != 0
            || header.room_len % 4096 != 0
        {
            Err(foreign(id, "its recovery room does not fit".into()))
        } else {
            Ok(AttachedRoom {
                base,
                size,
                room: base as usize + header.room_off as usize,
                len: header.room_len as usize,
            })
        }
    };
    if checked.is_err() {
        // SAFETY: detaches the mapping made above; nothing refers to it.
        unsafe { libc::shmdt(base) };
    }
    checked
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
    /// Maps the room of segment `id`, and only the room.
    pub fn map(id: i32) -> Result<MappedRoom, RegionError> {
        let attached = attach_room(id)?;
        let (base, room, len) = (attached.base as usize, attached.room, attached.len);
        let tail = room + len;
        let end = base + attached.size.next_multiple_of(4096);
        let failed = |what: &str| tracing::warn!(id, what, error = %std::io::Error::last_os_error(), "mapping a store's recovery room ahead");
        // SAFETY: both ranges lie in the mapping made by attach_room, outside the room,
        // and nothing of ours refers to them (the header was copied out).
        unsafe {
            // (left mapped, they cost page tables and an attach, nothing else)
            if room > base && libc::munmap(base as *mut libc::c_void, room - base) != 0 {
                failed("munmap before the room");
            }
            if end > tail && libc::munmap(tail as *mut libc::c_void, end - tail) != 0 {
                failed("munmap after the room");
            }
            // A caller under mlockall(MCL_FUTURE) mapped it locked, and MADV_REMOVE
            // refuses locked pages; unlocking it now, not after the crash, splits no
            // mapping then.
            if libc::munlock(room as *mut libc::c_void, len) != 0 {
                failed("munlock");
            }
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
    pub fn release(&self) -> Result<usize, RegionError> {
        // SAFETY: MADV_REMOVE frees the pages of the room, our own shared mapping of it,
        // which no daemon uses.
        if unsafe { libc::madvise(self.start as *mut libc::c_void, self.len, libc::MADV_REMOVE) }
            == 0
        {
            Ok(self.len)
        } else {
            Err(sys("madvise MADV_REMOVE (the recovery room)")(
                std::io::Error::last_os_error(),
            ))
        }
    }
}

impl Drop for MappedRoom {
    fn drop(&mut self) {
        // SAFETY: unmaps the room's mapping made by `map`; nothing else refers to it.
        unsafe { libc::munmap(self.start as *mut libc::c_void, self.len) };
    }
}

fn foreign(id: i32, why: String) -> RegionError {
    RegionError::Foreign { id, why }
}

fn staging_id(word: u64) -> Option<i32> {
    (word & 0xffff_ffff_0000_0000 == STAGING_TAG).then_some(word as u32 as i32)
}

/// Marks segment `id` for removal, and the GPU staging segment it records: they go once no
/// process has them attached (at once when none has). For a deleted device's store.
pub fn remove(id: i32) {
    let is_store = crate::sys::shm_size(id).is_ok_and(|size| size >= UNIT)
        && crate::sys::shm_peek::<Header>(id, 0).is_ok_and(|h| h.magic == MAGIC);
    if is_store {
        if let Some(staging) = crate::sys::shm_peek::<u64>(id, STAGING_OFF)
            .ok()
            .and_then(staging_id)
        {
            super::staging::remove(staging);
        }
    }
    if let Err(error) = crate::sys::shm_remove(id) {
        tracing::warn!(id, %error, "removing the store's shared memory failed");
    }
}

/// Whether segment `id` exists.
pub fn exists(id: i32) -> bool {
    crate::sys::shm_size(id).is_ok()
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::staging::Staging;

    /// A region of 16 pages and `blocks` blocks; `None` (printed) where segments cannot be
    /// locked (containers without CAP_IPC_LOCK).
    fn small_region(blocks: usize) -> Option<Region> {
        let sizes = Sizes {
            pages: 16,
            table_len: 16,
            dir_len: 4,
            block_bytes: blocks * UNIT,
            room: MIN_ROOM,
        };
        Region::create(sizes, "lz4")
            .inspect_err(|e| println!("SKIP: {e}"))
            .ok()
    }

    #[test]
    fn removing_a_store_removes_its_staging() {
        let Some(region) = small_region(1) else {
            return;
        };
        assert_eq!(region.staging(), None, "a new store has no staging");
        let staging = Staging::create(1, 1, false).expect("a staging segment");
        let id = staging.id();
        region.set_staging(Some(id));
        assert_eq!(region.staging(), Some(id));
        assert_eq!(Region::attach(region.id()).unwrap().staging(), Some(id));
        // SAFETY: nothing uses the segment's memory.
        unsafe { staging.detach() };
        assert!(exists(id));
        remove(region.id());
        assert!(!exists(id), "the staging segment outlived its store");
        region.set_staging(None);
        assert_eq!(region.staging(), None);
    }

    #[test]
    fn a_region_keeps_a_state_per_block_and_one_of_layout_2_is_still_taken_over() {
        let Some(region) = small_region(3) else {
            return;
        };
        let states = region.block_states().expect("layout 3 keeps block states");
        assert_eq!(states.len(), 3);
        assert!(states.iter().all(|s| s.load(Ordering::Relaxed) == 0));
        states[1].store(1, Ordering::Relaxed);
        let again = Region::attach(region.id()).expect("taken over");
        assert_eq!(again.block_states().unwrap()[1].load(Ordering::Relaxed), 1);

        // A layout 2 header (what the daemon before this one wrote) has no states.
        let old = Header {
            version: VERSION_NO_STATES,
            states_off: 0,
            states_len: 0,
            ..region.header
        };
        // SAFETY: the header lies at the start of our mapping; nothing else uses it.
        unsafe { ptr::write_volatile(region.base as *mut Header, old) };
        let v2 = Region::attach(region.id()).expect("a layout 2 region is taken over");
        assert!(v2.block_states().is_none());
        assert_eq!(v2.blocks().1, region.blocks().1);

        // States that do not cover the blocks are refused.
        let bad = Header {
            states_len: 2,
            ..region.header
        };
        // SAFETY: as above.
        unsafe { ptr::write_volatile(region.base as *mut Header, bad) };
        let err = Region::attach(region.id()).expect_err("states for 2 of 3 blocks");
        assert!(err.to_string().contains("block states"), "{err}");
        remove(region.id());
    }

    #[test]
    fn the_room_holds_the_heap_reserve_every_tags_buffer_and_the_rest() {
        assert_eq!(room_bytes(1, 64), (8 << 20) + (8 << 20) + START_REST);
        assert_eq!(room_bytes(1, 1), MIN_ROOM, "never under the smallest room");
        assert_eq!(
            room_bytes(2, 64),
            (8 << 20) + (16 << 20) + START_REST,
            "the guest's two queues"
        );
        assert_eq!(room_bytes(4, 64), (8 << 20) + (32 << 20) + START_REST);
        assert_eq!(room_bytes(4, 64) % UNIT, 0);
        assert!(room_bytes(u16::MAX, u16::MAX) > MIN_ROOM);
    }

    #[test]
    fn a_room_given_back_for_a_failed_handover_is_committed_again() {
        let Some(region) = small_region(1) else {
            return;
        };
        let (room, len) = region.room();
        let resident = || {
            let mut pages = vec![0u8; len / 4096];
            // SAFETY: mincore reads the page tables of our own mapping of the room and writes
            // one byte a page into `pages`, which has exactly that many.
            let rc = unsafe { libc::mincore(room as *mut libc::c_void, len, pages.as_mut_ptr()) };
            assert_eq!(rc, 0);
            pages.iter().filter(|&&p| p & 1 != 0).count()
        };
        assert_eq!(resident(), len / 4096, "a new store's room is committed");
        assert_eq!(
            MappedRoom::map(region.id()).unwrap().release().unwrap(),
            len
        );
        assert_eq!(resident(), 0, "given back");
        restore_room(region.id());
        assert_eq!(resident(), len / 4096, "committed again");
        remove(region.id());
    }

    /// Mappings of segment `id` (shm_nattch): a room mapped ahead adds one, and only while
    /// it lives.
    fn attaches(id: i32) -> u64 {
        let mut stat = std::mem::MaybeUninit::<libc::shmid_ds>::zeroed();
        // SAFETY: IPC_STAT writes one shmid_ds into our buffer.
        let rc = unsafe { libc::shmctl(id, libc::IPC_STAT, stat.as_mut_ptr()) };
        assert_eq!(rc, 0);
        // SAFETY: IPC_STAT succeeded, so the struct is initialized.
        unsafe { stat.assume_init() }.shm_nattch
    }

    #[test]
    fn a_room_mapped_ahead_maps_only_the_room_and_gives_it_back() {
        let Some(region) = small_region(1) else {
            return;
        };
        let (room, len) = region.room();
        let before = attaches(region.id());
        let mapped = MappedRoom::map(region.id()).unwrap();
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
            let mut pages = vec![0u8; len / 4096];
            // SAFETY: mincore reads the page tables of the region's own mapping of the room
            // and writes one byte a page into `pages`, which has exactly that many.
            let rc = unsafe { libc::mincore(room as *mut libc::c_void, len, pages.as_mut_ptr()) };
            assert_eq!(rc, 0);
            pages.iter().filter(|&&p| p & 1 != 0).count()
        };
        assert_eq!(resident(), len / 4096);
        assert_eq!(mapped.release().unwrap(), len);
        assert_eq!(resident(), 0, "given back through the mapping made ahead");
        drop(mapped);
        assert_eq!(attaches(region.id()), before);
        remove(region.id());
    }

    #[test]
    fn a_segment_that_is_no_store_has_no_room_to_map() {
        let Ok(id) = crate::sys::shm_create(2 * UNIT) else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        let err = MappedRoom::map(id).unwrap_err();
        assert!(err.to_string().contains("header"), "{err}");
        assert_eq!(attaches(id), 0, "nothing left mapped");
        // SAFETY: IPC_RMID takes no buffer.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    }
}

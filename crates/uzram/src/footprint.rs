//! What a device's daemon holds in memory from the start, before it stores a page: the sizes
//! its store's parts take (`takeover/store_segment.rs` lays them out from [`Sizes`]), its recovery
//! room, heap reserve and I/O buffers, and the GPU ring's pinned memory. All of it is locked
//! and none of it can be reclaimed, so a device whose up-front memory the host cannot hold
//! is refused before anything is taken ([`Upfront::check`]): a typo in a size (16T for 16G)
//! once locked a 32 GiB page table in a 1 GiB guest, and the kernel panicked.

use uzram_core::store::{BLOCK_BYTES, RAW_PAGES_PER_SEGMENT};
use uzram_core::{PageStore, PAGE_SIZE};

/// The unit a store's region is laid out in, and the pool's block.
pub const UNIT: usize = 64 << 10;

/// The bytes of one tag's I/O buffer: the largest request the device takes.
pub const IO_BUF_BYTES: u32 = 128 << 10;

/// Heap grown at start for the daemon's small allocations (`memory/reserve.rs`).
pub const HEAP_RESERVE: usize = 8 << 20;

/// The smallest recovery room (`takeover/store_segment.rs`): a new daemon's heap reserve, stacks and
/// rings before it serves, with two queues' I/O buffers.
pub const MIN_ROOM: usize = 24 << 20;

/// What a recovering daemon allocates before it serves besides its heap reserve and I/O
/// buffers: stacks, the recovered store's bookkeeping, static data, page tables, rings.
/// Measured after a crash under a swap hog (1 GiB device, 2 queues, some 40 thousand pages
/// stored): RssAnon 29 MiB against 24 MiB of reserve and buffers, page tables 0.4-0.7 MiB.
/// A room without it was spent before the new daemon served when the hog had taken the
/// dead daemon's freed memory first, and the daemon's queue threads then waited in reclaim
/// for good (docs/recovery.md).
pub const START_REST: usize = 8 << 20;

/// The disk reader threads' stacks that a queue's threads fault in before they serve
/// (`ublk/disk_readers.rs`: [`READERS`](crate::ublk::disk_readers::READERS) a thread, 128 KiB
/// each, at most two threads a queue in per-io-daemon mode).
pub const READER_STACKS_PER_QUEUE: usize = 1 << 20;

/// Bytes of pool blocks beyond the device size: room for holes and for 64 KiB allocations
/// that are not the store's.
pub const SLACK: usize = 64 << 20;

/// The recovery room for a device of `queues` queues of `depth` tags, each with a locked
/// I/O buffer of `io_buf_bytes` (the ublk frontend's [`IO_BUF_BYTES`]): the heap reserve,
/// every tag's buffer, each queue's disk reader stacks ([`READER_STACKS_PER_QUEUE`]) and the
/// rest of what a new daemon allocates before it serves ([`START_REST`]); never under
/// [`MIN_ROOM`]. A fixed 24 MiB fell 16 MiB short of the first two with four queues at the
/// default depth.
pub fn room_bytes(queues: u16, depth: u16, io_buf_bytes: u32) -> usize {
    let buffers = usize::from(queues) * usize::from(depth) * io_buf_bytes as usize;
    let readers = usize::from(queues) * READER_STACKS_PER_QUEUE;
    (HEAP_RESERVE + buffers + readers + START_REST)
        .next_multiple_of(UNIT)
        .max(MIN_ROOM)
}

/// Most hardware queues a device may have (the kernel's `UBLK_MAX_NR_QUEUES`).
pub const MAX_QUEUES: u16 = 4096;
/// Deepest queue the kernel accepts (`UBLK_MAX_QUEUE_DEPTH`).
pub const MAX_DEPTH: u16 = 4096;

/// The largest room any device has (the most queues at the greatest depth).
pub fn max_room() -> usize {
    room_bytes(MAX_QUEUES, MAX_DEPTH, IO_BUF_BYTES)
}

/// Sizes of a store's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Where a store's parts lie in its region, in bytes from its start: a header unit, the
/// page table, the segment directory, the block states, the recovery room, the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offsets {
    /// The page table (8 bytes a page).
    pub table_off: usize,
    /// The directory (4 bytes an arena segment).
    pub dir_off: usize,
    /// The block states (a byte a block).
    pub states_off: usize,
    /// Blocks.
    pub blocks: usize,
    /// The recovery room.
    pub room_off: usize,
    /// The blocks' start.
    pub blocks_off: usize,
    /// The whole region.
    pub len: usize,
}

impl Sizes {
    /// The parts of the store of a device of `pages` pages with a recovery room of `room`
    /// bytes: its table, its directory, blocks for every page stored raw (with its checksum,
    /// [`RAW_PAGES_PER_SEGMENT`] a block) plus [`SLACK`]. `None` when they do not fit the
    /// address space.
    pub fn of(pages: u64, room: usize) -> Option<Sizes> {
        let block_bytes = usize::try_from(pages)
            .ok()?
            .div_ceil(RAW_PAGES_PER_SEGMENT)
            .checked_mul(UNIT)?
            .checked_add(SLACK)?;
        Self::with_blocks(pages, room, block_bytes)
    }

    /// The sizes of store layouts before 7, which gave blocks for the device's bytes plus
    /// [`SLACK`]: a block holds 15 raw pages, not 16, so incompressible pages filled those
    /// blocks before the device (a device over 960 MiB); taken over as they were made.
    pub fn before_layout_7(pages: u64, room: usize) -> Option<Sizes> {
        let block_bytes = usize::try_from(pages)
            .ok()?
            .checked_mul(PAGE_SIZE)?
            .checked_add(SLACK)?;
        Self::with_blocks(pages, room, block_bytes)
    }

    fn with_blocks(pages: u64, room: usize, block_bytes: usize) -> Option<Sizes> {
        Some(Sizes {
            pages,
            table_len: PageStore::table_len(pages).ok()?,
            dir_len: PageStore::segment_capacity(pages),
            block_bytes,
            room,
        })
    }

    /// Where the parts lie, with checked arithmetic (`None`: they overflow, or the room is
    /// not a whole number of units).
    pub fn offsets(self) -> Option<Offsets> {
        let units = |bytes: usize| Some(bytes.checked_add(UNIT - 1)? / UNIT * UNIT);
        if !self.room.is_multiple_of(UNIT) {
            return None;
        }
        let table_off = UNIT;
        let dir_off = table_off.checked_add(units(self.table_len.checked_mul(8)?)?)?;
        let states_off = dir_off.checked_add(units(self.dir_len.checked_mul(4)?)?)?;
        let blocks = self.block_bytes.div_ceil(UNIT);
        let room_off = states_off.checked_add(units(blocks)?)?;
        let blocks_off = room_off.checked_add(self.room)?;
        let len = blocks_off.checked_add(blocks.checked_mul(UNIT)?)?;
        Some(Offsets {
            table_off,
            dir_off,
            states_off,
            blocks,
            room_off,
            blocks_off,
            len,
        })
    }
}

/// RAM a device's up-front memory may take: a quarter. The rest is what the host runs on,
/// and what the device's pages are swapped out of.
pub const MAX_SHARE_DIVISOR: u64 = 4;

/// A device's backing device (`writeback-device`), as far as its up-front memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writeback {
    /// None is configured.
    None,
    /// A backing file made for the device ([`crate::daemon::backing::file_bytes`]): its
    /// blocks follow the device's size. What the configuration alone tells.
    File,
    /// A backing device of this many blocks: a partition, or a file that was larger, once it
    /// is open.
    Blocks(u64),
}

impl Writeback {
    /// The backing device's blocks for a device of `pages` pages.
    fn blocks(self, pages: u64) -> u64 {
        match self {
            Writeback::None => 0,
            Writeback::File => crate::daemon::backing::file_bytes(pages) / BLOCK_BYTES as u64,
            Writeback::Blocks(blocks) => blocks,
        }
    }
}

/// The locked memory a backing device of `blocks` blocks costs a daemon: its nonce floors'
/// segment and the store's use counts and release bits (12 bytes a 4 KiB block, 3 MiB a GiB).
pub fn backing_bytes(blocks: u64) -> u64 {
    if blocks == 0 {
        return 0;
    }
    PageStore::backing_records_bytes(blocks)
        .saturating_add(crate::takeover::floors_segment::bytes_for(blocks))
}

/// A device's up-front memory, part by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upfront {
    /// The store's header, page table, segment directory and block states.
    pub table: u64,
    /// The recovery room.
    pub room: u64,
    /// The heap reserve, every tag's I/O buffer and, with a backing device, the buffers
    /// writeback passes work in.
    pub buffers: u64,
    /// The GPU ring's pinned memory (0 without a GPU backend).
    pub gpu: u64,
    /// The backing device's records ([`backing_bytes`]; 0 without one).
    pub backing: u64,
}

impl Upfront {
    /// The up-front memory of a device of `size` bytes with `queues` of `depth` tags,
    /// `gpu` bytes of pinned GPU memory and `writeback`'s backing device (whose passes'
    /// buffers are made when it is attached, so that a pass allocates nothing); `None` when
    /// it overflows.
    pub fn of(
        size: u64,
        queues: u16,
        depth: u16,
        gpu: u64,
        writeback: Writeback,
    ) -> Option<Upfront> {
        let pages = size.div_ceil(PAGE_SIZE as u64);
        let room = room_bytes(queues, depth, IO_BUF_BYTES);
        let offsets = Sizes::of(pages, room)?.offsets()?;
        let scratch = match writeback {
            Writeback::None => 0,
            Writeback::File | Writeback::Blocks(_) => PageStore::WRITEBACK_SCRATCH_BYTES as u64,
        };
        let buffers = HEAP_RESERVE as u64
            + u64::from(queues) * u64::from(depth) * u64::from(IO_BUF_BYTES)
            + scratch;
        Some(Upfront {
            table: offsets.room_off as u64,
            room: room as u64,
            buffers,
            gpu,
            backing: backing_bytes(writeback.blocks(pages)),
        })
    }

    /// Every part together.
    pub fn total(&self) -> u64 {
        self.table
            .saturating_add(self.room)
            .saturating_add(self.buffers)
            .saturating_add(self.gpu)
            .saturating_add(self.backing)
    }

    /// `Ok` when a host of `ram` bytes can hold it ([`MAX_SHARE_DIVISOR`]); otherwise the
    /// most it may be, for the caller's message.
    pub fn check(&self, ram: u64) -> Result<(), u64> {
        let most = ram / MAX_SHARE_DIVISOR;
        if self.total() <= most {
            Ok(())
        } else {
            Err(most)
        }
    }

    /// The largest device size (a whole number of pages, at most `limit`) whose up-front
    /// memory, with the other settings of `self`'s device, fits in `most` bytes; `None`
    /// when not even one page does.
    pub fn largest_size(
        queues: u16,
        depth: u16,
        gpu: u64,
        writeback: Writeback,
        most: u64,
        limit: u64,
    ) -> Option<u64> {
        let fits = |pages: u64| {
            Upfront::of(pages * PAGE_SIZE as u64, queues, depth, gpu, writeback)
                .is_some_and(|u| u.total() <= most)
        };
        let (mut lo, mut hi) = (1u64, limit / PAGE_SIZE as u64);
        if !fits(lo) {
            return None;
        }
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Some(lo * PAGE_SIZE as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_holds_the_heap_reserve_every_tags_buffer_and_the_rest() {
        assert_eq!(
            room_bytes(1, 64, IO_BUF_BYTES),
            (8 << 20) + (8 << 20) + (1 << 20) + START_REST
        );
        assert_eq!(
            room_bytes(1, 1, IO_BUF_BYTES),
            MIN_ROOM,
            "never under the smallest room"
        );
        assert_eq!(
            room_bytes(2, 64, IO_BUF_BYTES),
            (8 << 20) + (16 << 20) + (2 << 20) + START_REST,
            "the guest's two queues"
        );
        assert_eq!(
            room_bytes(4, 64, IO_BUF_BYTES),
            (8 << 20) + (32 << 20) + (4 << 20) + START_REST
        );
        assert_eq!(room_bytes(4, 64, IO_BUF_BYTES) % UNIT, 0);
        assert!(room_bytes(u16::MAX, u16::MAX, IO_BUF_BYTES) > MIN_ROOM);
    }

    #[test]
    fn offsets_overflow_into_none_never_a_panic() {
        let huge = Sizes {
            pages: u64::MAX,
            table_len: usize::MAX / 4,
            dir_len: usize::MAX,
            block_bytes: usize::MAX,
            room: MIN_ROOM,
        };
        assert_eq!(huge.offsets(), None);
        assert_eq!(Sizes::of(u64::MAX, MIN_ROOM), None);
        let odd_room = Sizes::of(16, MIN_ROOM + 1).unwrap();
        assert_eq!(odd_room.offsets(), None);
    }

    /// A raw page takes 4104 bytes with its checksum, so 15 fit a block: blocks for the
    /// device's bytes left a device over 960 MiB of incompressible pages without room for
    /// its last pages (a 1 GiB device 1,024 short, a 4 GiB one 50,176).
    #[test]
    fn the_blocks_hold_every_page_stored_raw_and_the_slack_beside_them() {
        let raw = uzram_core::PAGE_SIZE + 4;
        let raw_in_block = UNIT / raw.next_multiple_of(8);
        assert_eq!(raw_in_block, 15);
        for pages in [16u64, 245_760, 1 << 18, 1 << 20, 1 << 22] {
            let s = Sizes::of(pages, MIN_ROOM).unwrap();
            let blocks = s.block_bytes / UNIT;
            assert!(
                (blocks - SLACK / UNIT) * raw_in_block >= pages as usize,
                "{pages} pages: {blocks} blocks"
            );
            let before = Sizes::before_layout_7(pages, MIN_ROOM).unwrap();
            assert!(before.block_bytes < s.block_bytes);
        }
        let gib = Sizes::before_layout_7(1 << 18, MIN_ROOM).unwrap();
        assert!((gib.block_bytes / UNIT - SLACK / UNIT) * raw_in_block < 1 << 18);
    }

    #[test]
    fn a_16t_device_does_not_fit_a_small_host_and_the_largest_that_fits_does() {
        let gib = 1u64 << 30;
        let u = Upfront::of(16 << 40, 2, 64, 0, Writeback::None).unwrap();
        // 8 bytes of table a page: 32 GiB for 16 TiB.
        assert!(u.table > 32 * gib, "{u:?}");
        assert_eq!(u.check(gib), Err(gib / 4));
        let largest = Upfront::largest_size(2, 64, 0, Writeback::None, gib / 4, 16 << 40).unwrap();
        let fits = Upfront::of(largest, 2, 64, 0, Writeback::None).unwrap();
        assert!(fits.check(gib).is_ok(), "{fits:?}");
        let over = Upfront::of(largest + PAGE_SIZE as u64, 2, 64, 0, Writeback::None).unwrap();
        assert!(over.check(gib).is_err());
        // A guest's device of 1 GiB fits its 449 MiB; 128 MiB of pinned GPU memory on top
        // does not.
        let guest = 449 << 20;
        assert!(Upfront::of(gib, 2, 64, 0, Writeback::None)
            .unwrap()
            .check(guest)
            .is_ok());
        assert!(Upfront::of(gib, 2, 64, 128 << 20, Writeback::None)
            .unwrap()
            .check(guest)
            .is_err());
        // Settings that alone pass the share leave no size at all.
        assert_eq!(
            Upfront::largest_size(2, 64, gib, Writeback::None, gib / 4, 16 << 40),
            None
        );
    }

    #[test]
    fn a_backing_device_adds_its_blocks_records_and_a_large_partition_does_not_fit() {
        let gib = 1u64 << 30;
        let without = Upfront::of(gib, 2, 64, 0, Writeback::None).unwrap();
        let file = Upfront::of(gib, 2, 64, 0, Writeback::File).unwrap();
        assert_eq!(without.backing, 0);
        // A file made for 1 GiB: a use count (4 bytes) and a floor (8) a 4 KiB block, a
        // release bit, and the floors' header page.
        let blocks = crate::daemon::backing::file_bytes(gib / PAGE_SIZE as u64) / 4096;
        assert!(blocks >= gib / 4096, "{blocks}");
        assert_eq!(
            file.backing,
            blocks * 4 + blocks.div_ceil(64) * 8 + (4096 + blocks * 8).next_multiple_of(4096)
        );
        assert_eq!(
            file.buffers - without.buffers,
            PageStore::WRITEBACK_SCRATCH_BYTES as u64
        );
        // The guest's 1 GiB device with a backing file fits its 449 MiB.
        assert!(file.check(449 << 20).is_ok(), "{file:?}");
        // A 1 TiB partition behind the same device takes 3 GiB of records: not on a host of
        // 8 GiB, whose quarter is 2 GiB, whatever the device's size.
        let tib = Writeback::Blocks((1u64 << 40) / 4096);
        let big = Upfront::of(gib, 2, 64, 0, tib).unwrap();
        assert!(big.backing > 3 * gib, "{big:?}");
        assert!(big.check(8 * gib).is_err());
        assert_eq!(
            Upfront::largest_size(2, 64, 0, tib, 2 * gib, 16 << 40),
            None
        );
        // On a host of 64 GiB it fits.
        assert!(big.check(64 * gib).is_ok());
    }
}

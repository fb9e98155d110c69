//! Reads of written-back pages, completed through the queue thread's own io_uring: a request
//! that needs a page from the backing device waits for that read while the thread serves its
//! other requests, and is committed when its last page came in.
//!
//! The store hands each written-back page of a read out as a [`DiskRead`] (its blocks held
//! until the read is finished, `uzram_core::store::disk_read`); this module has the blocks
//! read into one of its [`SLOTS`] block-aligned buffers (the backing device is opened for
//! direct I/O), with the slot's number in the completion's user data, and gives them back to
//! the store to open, decode and check into the request's buffer. The reads run on the queue
//! thread's reader threads (`disk_readers.rs`), [`READERS`](disk_readers::READERS) at a time, which post each
//! result into the thread's ring; where those could not be started (a kernel without
//! `IORING_OP_MSG_RING`), on the ring's single io_uring worker, one at a time. With every
//! slot busy, or no room to queue, a page is read synchronously on the thread, as before.
//! Everything is made before the thread serves: a read allocates nothing.

use std::cell::RefCell;

use io_uring::{opcode, squeue, types};
use libublk::io::UblkIOCtx;

use super::disk_readers::{self, Job, Readers};
use uzram_core::store::{DiskRead, PageStore, BLOCK_BYTES, MAX_OBJECT_BLOCKS};
use uzram_core::PAGE_SIZE;

/// Disk reads a queue thread keeps in flight at most.
pub const SLOTS: usize = 32;

/// The user data of the read that starts a queue thread's io_uring worker
/// ([`ready_worker`]); no request's (those carry a tag and an operation byte).
const WORKER_READY: u64 = u64::MAX - 1;

/// The user data's operation byte that marks a disk read's completion (a target I/O of
/// ours; the ublk commands' completions carry no target bit).
const DISK_READ_OP: u32 = 0xd1;

thread_local! {
    /// The reader threads [`ready`] started for this queue thread, until its [`DiskReads`]
    /// takes them.
    static STARTED: RefCell<Option<Readers>> = const { RefCell::new(None) };
}

/// One disk read's blocks.
#[repr(C, align(4096))]
struct SlotBuf([u8; MAX_OBJECT_BLOCKS * BLOCK_BYTES]);

/// A read in flight: the store's handle, and where the page goes.
struct InFlight {
    read: DiskRead,
    tag: u16,
    page: usize,
}

/// A request waiting for its disk reads.
#[derive(Debug, Clone, Copy, Default)]
struct Waiting {
    pending: u16,
    /// Bytes read, or the first error (a negative errno).
    result: i32,
}

/// A queue thread's disk reads; see the module docs.
pub struct DiskReads {
    /// Declared first, so dropped first: the readers finish every read they hold before
    /// the buffers they read into go.
    readers: Option<Readers>,
    bufs: Vec<SlotBuf>,
    inflight: Vec<Option<InFlight>>,
    /// Bit `i` set: slot `i` is free.
    free: u64,
    tags: Vec<Waiting>,
}

const _: () = assert!(SLOTS <= 64);

/// How a queue thread reads written-back pages, once [`ready`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    /// The store has no backing device.
    NoDisk,
    /// [`READERS`](disk_readers::READERS) reader threads at once.
    Readers,
    /// One at a time, on the ring's io_uring worker.
    Worker,
}

/// Readies the calling queue thread for disk reads before it serves (a store with a backing
/// device read directly; otherwise nothing to do): starts its reader threads, which the
/// thread's [`DiskReads`] then takes; where they cannot be started, readies the ring's
/// io_uring worker instead ([`ready_worker`]).
pub fn ready(store: &PageStore) -> std::io::Result<ReadPath> {
    if store.backing_read_fd().is_none() {
        return Ok(ReadPath::NoDisk);
    }
    let ring_fd = libublk::io::with_task_io_ring(std::os::fd::AsRawFd::as_raw_fd);
    match Readers::start(ring_fd, SLOTS, disk_readers::pread_job) {
        Ok(readers) => {
            STARTED.with(|s| *s.borrow_mut() = Some(readers));
            Ok(ReadPath::Readers)
        }
        Err(err) => {
            tracing::warn!(
                error = %err,
                "starting the disk reader threads failed: written-back pages are read one \
                 at a time through the queue's io_uring worker"
            );
            ready_worker(store).map(|()| ReadPath::Worker)
        }
    }
}

/// Readies the calling queue thread's ring for disk reads before it serves (a store with a
/// backing device read directly; otherwise nothing to do): io_uring may keep one worker of
/// each kind for this thread, and the one disk reads use is started now, by a read of the
/// backing device's first block.
///
/// Why: every disk read runs on io_uring's workers ([`DiskReads::start`]), and a submission
/// that finds no idle worker makes one then and there, in the submitting thread: a new
/// kernel thread, whose stack is an allocation. Under the memory pressure that swap serves,
/// that allocation went into direct reclaim on the very thread reclaim needed to write
/// pages (a 7.3 guest, scenario l: the queue thread in `create_io_worker`, kswapd blocked,
/// the hog stalled for good). Made now, while memory is plenty, and with no second one
/// allowed, serving never makes one: io_uring keeps the last worker of a kind when it goes
/// idle. The price: a thread's disk reads run one after another on that worker, each still
/// without blocking the thread.
pub fn ready_worker(store: &PageStore) -> std::io::Result<()> {
    let Some(fd) = store.backing_read_fd() else {
        return Ok(());
    };
    let mut block = Box::new(SlotBuf([0; MAX_OBJECT_BLOCKS * BLOCK_BYTES]));
    let read = opcode::Read::new(types::Fd(fd), block.0.as_mut_ptr(), BLOCK_BYTES as u32)
        .offset(0)
        .build()
        .flags(squeue::Flags::ASYNC)
        .user_data(WORKER_READY);
    libublk::io::with_task_io_ring_mut(|ring| {
        ring.submitter().register_iowq_max_workers(&mut [1, 1])?;
        // SAFETY: the read fills `block`, which outlives it: this waits for its completion
        // below before `block` is dropped. Nothing else is queued on the ring yet.
        unsafe { ring.submission().push(&read) }
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::WouldBlock))?;
        let mut result = None;
        while result.is_none() {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if super::uring::wait_again(&e) => {}
                Err(e) => return Err(e),
            }
            result = ring
                .completion()
                .find(|c| c.user_data() == WORKER_READY)
                .map(|c| c.result());
        }
        match result {
            Some(res) if res < 0 => Err(std::io::Error::from_raw_os_error(-res)),
            _ => Ok(()),
        }
    })
}

impl DiskReads {
    /// Slots for a queue of `depth` tags.
    pub fn new(depth: u16) -> Self {
        DiskReads {
            readers: STARTED.with(|s| s.borrow_mut().take()),
            bufs: (0..SLOTS)
                .map(|_| SlotBuf([0; MAX_OBJECT_BLOCKS * BLOCK_BYTES]))
                .collect(),
            inflight: (0..SLOTS).map(|_| None).collect(),
            free: if SLOTS == 64 {
                u64::MAX
            } else {
                (1 << SLOTS) - 1
            },
            tags: vec![Waiting::default(); usize::from(depth)],
        }
    }

    /// Reads each reader thread finished; empty without readers.
    #[cfg(test)]
    pub fn readers_done(&self) -> Vec<u64> {
        self.readers.as_ref().map_or_else(Vec::new, Readers::done)
    }

    /// Read request `tag` begins.
    pub fn begin(&mut self, tag: u16) {
        if let Some(w) = self.tags.get_mut(usize::from(tag)) {
            *w = Waiting::default();
        }
    }

    /// Request `tag` was served with `res` (bytes, or a negative errno), some of its pages
    /// still to come: it is committed with that once they came, unless one of them fails.
    pub fn served(&mut self, tag: u16, res: i32) {
        if let Some(w) = self.tags.get_mut(usize::from(tag)) {
            if w.result >= 0 {
                w.result = res;
            }
        }
    }

    /// Disk reads request `tag` still waits for.
    pub fn pending(&self, tag: u16) -> u16 {
        self.tags.get(usize::from(tag)).map_or(0, |w| w.pending)
    }

    /// Submits `read` (page `page` of request `tag`) on the thread's ring; gives it back
    /// when no slot or submission entry is free.
    pub fn start(&mut self, tag: u16, page: usize, read: DiskRead) -> Result<(), DiskRead> {
        if self.free == 0 || usize::from(tag) >= self.tags.len() {
            return Err(read);
        }
        let slot = self.free.trailing_zeros() as usize;
        let Ok(len) = u32::try_from(read.bytes()) else {
            return Err(read);
        };
        let buf = &mut self.bufs[slot].0;
        if buf.len() < read.bytes() {
            return Err(read);
        }
        let user_data = UblkIOCtx::build_user_data(tag, DISK_READ_OP, slot as u32, true);
        if let Some(readers) = &self.readers {
            let job = Job {
                fd: read.fd(),
                buf: buf.as_mut_ptr(),
                len,
                offset: read.offset(),
                user_data,
            };
            // The slot's buffer is the reader's until the completion arrives: the slot stays
            // taken until then ([`DiskReads::complete`]), and the readers finish every read
            // they hold before this `DiskReads` (and its buffers) is dropped.
            if readers.submit(job).is_err() {
                return Err(read);
            }
            self.take(slot, tag, page, read);
            return Ok(());
        }
        // ASYNC: issued from io_uring's own workers, never inline on this thread. Issued
        // inline, a read whose bio has to wait for the block layer's reserve (which swap
        // writes to this very device hold under memory pressure) would stop the queue.
        let sqe = opcode::Read::new(types::Fd(read.fd()), buf.as_mut_ptr(), len)
            .offset(read.offset())
            .build()
            .flags(squeue::Flags::ASYNC)
            .user_data(user_data);
        let pushed = libublk::io::with_task_io_ring_mut(|ring| {
            // SAFETY: the entry reads into slot `slot`'s buffer, which lives as long as this
            // thread's `DiskReads` and is not touched until the completion arrives
            // ([`DiskReads::complete`]): the slot stays taken until then, and a queue thread
            // ends only once no request (hence no read) is in flight.
            if unsafe { ring.submission().push(&sqe) }.is_ok() {
                return true;
            }
            // Full: hand what is queued to the kernel and try once more.
            ring.submit().is_ok()
                // SAFETY: as above.
                && unsafe { ring.submission().push(&sqe) }.is_ok()
        });
        if !pushed {
            return Err(read);
        }
        self.take(slot, tag, page, read);
        Ok(())
    }

    /// The queue thread stops with reads in flight (its loop ended with requests it held):
    /// their blocks' holds go back to the store, so the blocks can be released once their
    /// pages are gone. On the io_uring worker's path the kernel may still read into their
    /// buffers after this, so the buffers are leaked (32 slots' worth at most, once per
    /// queue thread); the reader threads finish every read they hold before they are gone.
    pub fn abandon(mut self, store: &PageStore) {
        let held: Vec<InFlight> = self.inflight.iter_mut().filter_map(Option::take).collect();
        if held.is_empty() {
            return;
        }
        let worker = self.readers.is_none();
        drop(self.readers.take());
        tracing::warn!(
            reads = held.len(),
            "a queue thread stops with disk reads in flight: their requests never complete"
        );
        for f in held {
            store.cancel_disk_read(f.read);
        }
        if worker {
            std::mem::forget(std::mem::take(&mut self.bufs));
        }
    }

    /// Slot `slot` now holds `read`, page `page` of request `tag`.
    fn take(&mut self, slot: usize, tag: u16, page: usize, read: DiskRead) {
        self.free &= !(1 << slot);
        self.inflight[slot] = Some(InFlight { read, tag, page });
        self.tags[usize::from(tag)].pending += 1;
    }

    /// Whether a completion's user data is one of these reads'.
    pub fn owns(user_data: u64) -> bool {
        user_data & libublk::UblkUringData::Target as u64 != 0
            && UblkIOCtx::user_data_to_op(user_data) == DISK_READ_OP
    }

    /// A disk read completed with `res` (bytes read, or a negative errno): its page is
    /// finished into `buf`, the I/O buffer of its request (the tag in `user_data`). Returns
    /// the request and its result when that was its last read.
    pub fn complete(
        &mut self,
        store: &PageStore,
        user_data: u64,
        res: i32,
        buf: Option<&mut [u8]>,
    ) -> Option<(u16, i32)> {
        let slot = usize::try_from(user_data >> 24 & 0xffff).ok()?;
        let tag = UblkIOCtx::user_data_to_tag(user_data) as u16;
        if self.inflight.get(slot)?.as_ref()?.tag != tag {
            return None;
        }
        let done = self.inflight.get_mut(slot)?.take()?;
        self.free |= 1 << slot;
        let InFlight { read, tag, page } = done;
        let outcome = if usize::try_from(res).ok() != Some(read.bytes()) {
            store.cancel_disk_read(read);
            Err(if res < 0 { res } else { -libc::EIO })
        } else {
            let blocks = &mut self.bufs[slot].0[..read.bytes()];
            match buf
                .and_then(|b| b.get_mut(page * PAGE_SIZE..(page + 1) * PAGE_SIZE))
                .and_then(|p| <&mut [u8; PAGE_SIZE]>::try_from(p).ok())
            {
                Some(out) => store
                    .finish_disk_read(read, blocks, out)
                    .map_err(|e| e.errno()),
                None => {
                    store.cancel_disk_read(read);
                    Err(-libc::EIO)
                }
            }
        };
        let w = self.tags.get_mut(usize::from(tag))?;
        if let Err(errno) = outcome {
            store.record_failed_read();
            tracing::error!(tag, page, errno, "reading a written-back page failed");
            if w.result >= 0 {
                w.result = errno;
            }
        }
        w.pending = w.pending.saturating_sub(1);
        (w.pending == 0).then_some((tag, w.result))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_of_disk_reads_are_told_from_ublk_commands() {
        let ours = UblkIOCtx::build_user_data(7, DISK_READ_OP, 31, true);
        assert!(DiskReads::owns(ours));
        assert_eq!(UblkIOCtx::user_data_to_tag(ours), 7);
        assert_eq!(ours >> 24 & 0xffff, 31);
        // A ublk command's completion, and another target I/O.
        assert!(!DiskReads::owns(UblkIOCtx::build_user_data(7, 1, 0, false)));
        assert!(!DiskReads::owns(UblkIOCtx::build_user_data(7, 1, 0, true)));
        // The batch queue's commands (libublk's io_batch.rs: the target bit, the queue id,
        // operations 0xf0-0xf5, a command id and a magic above): never a disk read's. A
        // loop that took every target completion for a read left the batch fetches
        // unserved, and the device never started (7.3 guest).
        for op in 0xf0..=0xf5u64 {
            let batch =
                libublk::UblkUringData::Target as u64 | 3 | op << 16 | 5 << 24 | 0xb47c << 40;
            assert!(!DiskReads::owns(batch), "{op:#x}");
        }
    }

    /// A queue thread's read of written-back pages, without a kernel device: the thread's
    /// ring is the one a queue thread makes, the request goes through the server, waits for
    /// its disk reads (the server returns no result), and the completions on the ring
    /// finish it with every page as written; a read of pages in RAM still completes at once.
    /// The reads run on the thread's reader threads.
    #[test]
    fn a_read_of_written_back_pages_waits_on_the_ring_and_completes_whole() {
        on_a_queue_thread(|| serve_written_back_reads(Through::Readers), true);
    }

    /// The same through the ring's one io_uring worker, where reader threads cannot be
    /// started.
    #[test]
    fn without_readers_the_reads_go_through_the_rings_one_worker() {
        on_a_queue_thread(|| serve_written_back_reads(Through::Worker), false);
    }

    /// Runs `f` on a queue thread's ring as root (a backing file must be root's); the
    /// readers need `IORING_OP_MSG_RING`, the worker does not.
    fn on_a_queue_thread(f: fn(), msg_ring: bool) {
        if !crate::sys::is_root() {
            println!("SKIP: a backing file must be root's");
            return;
        }
        super::disk_readers::test_ring::on_a_queue_ring(64, 128, msg_ring, move |_| f());
    }

    /// A store of `pages` pages, ready on this thread, backed by a file in `dir`.
    fn backed_store(dir: &std::path::Path, pages: u64) -> PageStore {
        let store = crate::daemon::backing::file_backed_store(dir, pages, None);
        store.prepare_thread().unwrap();
        store
    }

    #[derive(PartialEq)]
    enum Through {
        Readers,
        Worker,
    }

    fn serve_written_back_reads(through: Through) {
        use crate::ublk::handler::PageWriter;
        use crate::ublk::server::{RequestCounters, Server};
        use uzram_core::store::{Writeback, WritebackCandidates};

        let dir = std::env::temp_dir().join(format!("uzram-disk-reads-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        const PAGES: u64 = 96;
        let page = |i: u64| -> Vec<u8> {
            let mut p = vec![0u8; PAGE_SIZE];
            let mut x = i | 1;
            for (k, c) in p.chunks_exact_mut(8).enumerate() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let w = if k % 3 == 0 {
                    x
                } else {
                    i * 31 + k as u64 / 64
                };
                c.copy_from_slice(&w.to_le_bytes());
            }
            p
        };
        let store = backed_store(&dir, PAGES);
        for i in 0..PAGES {
            store.write_pages(i, &page(i)).unwrap();
        }
        // The first 64 pages go to the disk; 64..96 stay in RAM.
        let done = store
            .writeback(Writeback {
                candidates: WritebackCandidates::Idle { min_age: 0 },
                max_pages: 64,
                max_bytes: u64::MAX,
            })
            .unwrap();
        assert_eq!(done.pages, 64);
        if through == Through::Readers {
            assert_eq!(
                ready(&store).expect("readied"),
                ReadPath::Readers,
                "the reader threads run"
            );
        } else {
            ready_worker(&store).expect("the ring's worker readied");
            // The cap holds: asking with zeroes changes nothing and tells what it is.
            let mut max = [0, 0];
            libublk::io::with_task_io_ring_mut(|ring| {
                ring.submitter().register_iowq_max_workers(&mut max)
            })
            .unwrap();
            assert_eq!(max, [1, 1], "one io_uring worker of each kind");
        }
        let counters = RequestCounters::new(1);
        let mut server = Server::new(0, &store, &store, &counters);
        server.start(4);
        let iod = |first: u64, pages: u32| libublk::sys::ublksrv_io_desc {
            op_flags: libublk::sys::UBLK_IO_OP_READ,
            nr_sectors: pages * 8,
            start_sector: first * 8,
            addr: 0,
        };
        // Tag 1: 32 pages, 24 on disk and 8 in RAM; tag 2: 16 pages, all on disk.
        let mut bufs = [vec![0u8; 32 * PAGE_SIZE], vec![0u8; 32 * PAGE_SIZE]];
        assert_eq!(server.handle(1, &iod(40, 32), &mut bufs[0]), None);
        assert_eq!(
            server.handle(2, &iod(0, 16), &mut bufs[1][..16 * PAGE_SIZE]),
            None
        );
        let mut in_ram = vec![0u8; 8 * PAGE_SIZE];
        assert_eq!(
            server.handle(3, &iod(70, 8), &mut in_ram),
            Some(8 * PAGE_SIZE as i32),
            "a read of pages in RAM completes at once"
        );
        let mut results = std::collections::HashMap::new();
        while results.len() < 2 {
            let cqes: Vec<(u64, i32)> = libublk::io::with_task_io_ring_mut(|ring| {
                ring.submit_and_wait(1).unwrap();
                ring.completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect()
            });
            for (user_data, res) in cqes {
                let tag = UblkIOCtx::user_data_to_tag(user_data) as usize;
                let buf = bufs.get_mut(tag - 1).map(|b| b.as_mut_slice());
                if let Some((tag, res)) = server.disk_read_done(user_data, res, buf) {
                    assert!(
                        results.insert(tag, res).is_none(),
                        "tag {tag} completed twice"
                    );
                }
            }
        }
        assert_eq!(results[&1], 32 * PAGE_SIZE as i32);
        assert_eq!(results[&2], 16 * PAGE_SIZE as i32);
        for (k, i) in (40..72).enumerate() {
            assert!(
                bufs[0][k * PAGE_SIZE..(k + 1) * PAGE_SIZE] == page(i),
                "page {i}"
            );
        }
        for i in 0..16 {
            let k = i as usize;
            assert!(
                bufs[1][k * PAGE_SIZE..(k + 1) * PAGE_SIZE] == page(i),
                "page {i}"
            );
        }
        for (k, i) in (70..78).enumerate() {
            assert!(
                in_ram[k * PAGE_SIZE..(k + 1) * PAGE_SIZE] == page(i),
                "page {i}"
            );
        }
        let stats = store.stats();
        assert!(stats.bd_reads >= 40, "{stats:?}");
        assert_eq!(stats.failed_reads, 0);
        let readers_read = server.disk_readers_done();
        if through == Through::Readers {
            // The pages on disk went through the readers (some may have been read on the
            // thread itself, when every slot was busy).
            let total: u64 = readers_read.iter().sum();
            assert!(total > 0, "{readers_read:?}");
        } else {
            assert!(readers_read.is_empty());
        }
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A queue thread that stops while a request waits for its disk reads gives their
    /// blocks' holds back: once every page is discarded, every block written is released.
    #[test]
    fn an_abandoned_read_gives_its_blocks_back() {
        on_a_queue_thread(|| abandon_a_read(Through::Readers), true);
        on_a_queue_thread(|| abandon_a_read(Through::Worker), false);
    }

    fn abandon_a_read(through: Through) {
        use crate::ublk::handler::PageWriter;
        use crate::ublk::server::{RequestCounters, Server};
        use uzram_core::store::{Writeback, WritebackCandidates};

        let dir = std::env::temp_dir().join(format!(
            "uzram-abandoned-reads-{}-{}",
            std::process::id(),
            through == Through::Readers
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        const PAGES: u64 = 32;
        let store = backed_store(&dir, PAGES);
        for i in 0..PAGES {
            let p: Vec<u8> = (0..PAGE_SIZE)
                .map(|k| (k as u64 * (i + 3) % 251) as u8)
                .collect();
            store.write_pages(i, &p).unwrap();
        }
        let done = store
            .writeback(Writeback {
                candidates: WritebackCandidates::Idle { min_age: 0 },
                max_pages: PAGES,
                max_bytes: u64::MAX,
            })
            .unwrap();
        assert_eq!(done.pages, PAGES);
        let written = store.stats().bd_writes;
        if through == Through::Readers {
            assert_eq!(ready(&store).expect("readied"), ReadPath::Readers);
        } else {
            ready_worker(&store).expect("the ring's worker readied");
        }
        let counters = RequestCounters::new(1);
        let mut server = Server::new(0, &store, &store, &counters);
        server.start(4);
        let iod = libublk::sys::ublksrv_io_desc {
            op_flags: libublk::sys::UBLK_IO_OP_READ,
            nr_sectors: 16 * 8,
            start_sector: 0,
            addr: 0,
        };
        let mut buf = vec![0u8; 16 * PAGE_SIZE];
        assert_eq!(
            server.handle(1, &iod, &mut buf),
            None,
            "waits for its reads"
        );
        drop(server);
        store.discard(0, PAGES).unwrap();
        assert_eq!(
            store.release_freed_blocks(),
            written,
            "every block written is released"
        );
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn buffers_are_block_aligned_for_direct_io() {
        let r = DiskReads::new(4);
        for b in &r.bufs {
            assert_eq!(b.0.as_ptr() as usize % BLOCK_BYTES, 0);
        }
        assert_eq!(r.free.count_ones() as usize, SLOTS);
    }
}

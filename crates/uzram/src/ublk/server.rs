//! A queue thread's state: its request counters, the store and writer it serves with, its
//! page-fault accounting and its I/O buffers. Both serving loops (`queue.rs` per request,
//! `batch.rs` in groups) go through [`Server`]; what they do with failed waits and commands
//! is `retries.rs`.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::sys;
use uzram_core::store::PageStore;
use uzram_core::PAGE_SIZE;

use super::disk_reads::DiskReads;
use super::handler::{handle_via, Op, PageWriter, Via};
use super::retries::Retries;
use super::user_copy::KernelCopy;
use crate::control::counters;
use crate::control::proto::Stat;
use crate::footprint::IO_BUF_BYTES;
use crate::memory::{fault_guard, pool};

/// Requests between two reads of a queue thread's page-fault count.
const FAULT_CHECK_EVERY: u32 = 64;

/// One queue's request counters, on its own cache line.
#[derive(Default)]
#[repr(align(64))]
struct QueueCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    write_zeroes: AtomicU64,
    errors: AtomicU64,
    /// Page faults the queue thread took while serving (see `fault_guard`).
    page_faults: AtomicU64,
    /// Waits of the thread's io_uring that failed and were waited again (`retries.rs`).
    retried_waits: AtomicU64,
    /// The thread's ublk commands that completed with an error (`retries.rs`).
    failed_commands: AtomicU64,
}

/// Per-operation request counters of every queue thread.
pub struct RequestCounters {
    queues: Box<[QueueCounters]>,
}

impl RequestCounters {
    /// Counters for `threads` queue threads (queues x threads per queue); thread `k` of queue
    /// `q` counts in slot `q * threads_per_queue + k`.
    pub fn new(threads: u16) -> Self {
        RequestCounters {
            queues: (0..threads.max(1))
                .map(|_| QueueCounters::default())
                .collect(),
        }
    }

    /// Publishes queue thread `slot`'s page-fault count since it started serving.
    fn set_faults(&self, slot: u16, faults: u64) {
        if let Some(q) = self.queues.get(usize::from(slot)) {
            q.page_faults.store(faults, Ordering::Relaxed);
        }
    }

    /// Counts a failed wait of queue thread `slot` that it waits again.
    pub(super) fn count_retried_wait(&self, slot: u16) {
        if let Some(q) = self.queues.get(usize::from(slot)) {
            q.retried_waits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a ublk command of queue thread `slot` that completed with an error.
    pub(super) fn count_failed_command(&self, slot: u16) {
        if let Some(q) = self.queues.get(usize::from(slot)) {
            q.failed_commands.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn record(&self, slot: u16, op: Op, res: i32) {
        let Some(q) = self.queues.get(usize::from(slot)) else {
            return;
        };
        let bump = |c: &AtomicU64, n: u64| {
            c.fetch_add(n, Ordering::Relaxed);
        };
        if res < 0 {
            bump(&q.errors, 1);
            return;
        }
        let bytes = u64::try_from(res).unwrap_or(0);
        match op {
            Op::Read => {
                bump(&q.reads, 1);
                bump(&q.read_bytes, bytes);
            }
            Op::Write => {
                bump(&q.writes, 1);
                bump(&q.write_bytes, bytes);
            }
            Op::Flush => bump(&q.flushes, 1),
            Op::Discard => bump(&q.discards, 1),
            Op::WriteZeroes => bump(&q.write_zeroes, 1),
            Op::Other(_) => {}
        }
    }

    /// Sums over queues, as named counters.
    pub fn snapshot(&self) -> Vec<Stat> {
        let sum = |f: fn(&QueueCounters) -> &AtomicU64| -> u64 {
            self.queues
                .iter()
                .map(|q| f(q).load(Ordering::Relaxed))
                .sum()
        };
        type Field = fn(&QueueCounters) -> &AtomicU64;
        let fields: [(&str, Field); 11] = [
            (counters::READ_REQUESTS, |q| &q.reads),
            (counters::READ_BYTES, |q| &q.read_bytes),
            (counters::WRITE_REQUESTS, |q| &q.writes),
            (counters::WRITE_BYTES, |q| &q.write_bytes),
            (counters::FLUSH_REQUESTS, |q| &q.flushes),
            (counters::DISCARD_REQUESTS, |q| &q.discards),
            (counters::WRITE_ZEROES_REQUESTS, |q| &q.write_zeroes),
            (counters::FAILED_REQUESTS, |q| &q.errors),
            (counters::QUEUE_PAGE_FAULTS, |q| &q.page_faults),
            (counters::QUEUE_RETRIED_WAITS, |q| &q.retried_waits),
            (counters::QUEUE_FAILED_COMMANDS, |q| &q.failed_commands),
        ];
        fields
            .iter()
            .map(|(name, f)| Stat {
                name: (*name).to_string(),
                value: sum(*f),
            })
            .collect()
    }
}

/// One queue thread's request handling: the store, its counters slot and the thread's
/// page-fault accounting. Both serving loops (per request, batch) go through it.
pub struct Server<'a> {
    slot: u16,
    store: &'a PageStore,
    writer: &'a dyn PageWriter,
    counters: &'a RequestCounters,
    served: u32,
    faults_at_start: Option<u64>,
    /// Reads of written-back pages in flight on the thread's ring (with a backing device
    /// that reads can go to directly).
    disk: Option<DiskReads>,
    inline_disk_reads: bool,
    /// With ublk's user copy: the device's character device and this thread's queue.
    user_copy: Option<(RawFd, u16)>,
}

impl Drop for Server<'_> {
    fn drop(&mut self) {
        if let Some(disk) = self.disk.take() {
            disk.abandon(self.store);
        }
    }
}

impl<'a> Server<'a> {
    pub fn new(
        slot: u16,
        store: &'a PageStore,
        writer: &'a dyn PageWriter,
        counters: &'a RequestCounters,
    ) -> Self {
        Server {
            slot,
            store,
            writer,
            counters,
            served: 0,
            faults_at_start: None,
            disk: None,
            inline_disk_reads: false,
            user_copy: None,
        }
    }

    /// Requests' data moves by ublk's user copy (the device has `UBLK_F_USER_COPY`): a
    /// WRITE's through its source, a READ's handed to the kernel once read
    /// (`user_copy.rs`), by `pread`/`pwrite` on `cdev`, queue `qid`'s character device.
    pub fn copy_through(&mut self, cdev: RawFd, qid: u16) {
        self.user_copy = Some((cdev, qid));
    }

    /// Written-back pages are read synchronously on the thread, as before the queue's ring
    /// carried them (for `uzram bench` to compare the two).
    pub fn reading_backed_pages_inline(mut self) -> Self {
        self.inline_disk_reads = true;
        self
    }

    /// The failed waits and commands of this thread's loop on queue `qid`, counted in its
    /// slot.
    pub fn retries(&self, qid: u16) -> Retries<'a> {
        Retries::new(qid, self.slot, self.counters)
    }

    /// The thread's setup is done (buffers allocated and locked) for a queue of `depth`
    /// tags: from here on it serves swap I/O and must never page-fault (see `fault_guard`).
    pub fn start(&mut self, depth: u16) {
        if !self.inline_disk_reads && self.store.backing_reads_directly() {
            self.disk = Some(DiskReads::new(depth));
        }
        pool::strict_current_thread();
        fault_guard::prefault_stack();
        // This queue's own setup allocated after the daemon-wide populate in `serve`.
        if let Err(err) = fault_guard::populate_writable_mappings() {
            tracing::warn!(slot = self.slot, error = %err, "populating writable memory failed");
        }
        crate::sys::raise_io_thread_priority(format_args!("queue thread {}", self.slot));
        self.faults_at_start = crate::sys::sched::thread_faults();
    }

    /// Serves request `tag`, whose data is in `data` (the tag's I/O buffer; with user copy a
    /// WRITE's bounce buffer and a READ's pages before they go to the kernel); returns its
    /// result, or `None` when it waits for disk reads ([`Server::disk_read_done`] returns
    /// it then).
    pub fn handle(&mut self, tag: u16, iod: &sys::ublksrv_io_desc, data: &mut [u8]) -> Option<i32> {
        let op = Op::from_ublk(iod.op_flags);
        let (store, writer) = (self.store, self.writer);
        let mut serve = |via: Via<'_>| {
            handle_via(
                op,
                iod.start_sector,
                iod.nr_sectors,
                data,
                store,
                writer,
                via,
            )
        };
        let mut source = self
            .user_copy
            .map(|(cdev, qid)| KernelCopy::new(cdev, qid, tag));
        let res = match (
            self.disk.as_mut().filter(|_| op == Op::Read),
            source.as_mut(),
        ) {
            (Some(disk), _) => {
                disk.begin(tag);
                let res = serve(Via::DiskReads(&mut |page, read| {
                    disk.start(tag, page, read)
                }));
                if disk.pending(tag) > 0 {
                    disk.served(tag, res);
                    return None;
                }
                res
            }
            (None, Some(source)) if op == Op::Write => serve(Via::Source(source)),
            _ => serve(Via::Buffer),
        };
        let res = self.copied_out(tag, op, data, res);
        self.finished(op, res);
        Some(res)
    }

    /// A completion on the thread's ring that is not a ublk command's: if it is a disk
    /// read's, finishes its page into its request's buffer (`buf`, the I/O buffer of the
    /// tag in `user_data`), and returns the request and its result once that was its last
    /// read.
    pub fn disk_read_done(
        &mut self,
        user_data: u64,
        res: i32,
        mut buf: Option<&mut [u8]>,
    ) -> Option<(u16, i32)> {
        if !DiskReads::owns(user_data) {
            return None;
        }
        let (tag, res) =
            self.disk
                .as_mut()?
                .complete(self.store, user_data, res, buf.as_deref_mut())?;
        let res = self.copied_out(tag, Op::Read, buf.as_deref().unwrap_or_default(), res);
        self.finished(Op::Read, res);
        Some((tag, res))
    }

    /// With user copy, a READ that succeeded hands its `res` bytes in `data` to the kernel;
    /// a copy the kernel refuses fails the request (`-EIO`). Anything else keeps `res`.
    fn copied_out(&self, tag: u16, op: Op, data: &[u8], res: i32) -> i32 {
        let Some((cdev, qid)) = self.user_copy else {
            return res;
        };
        let Some(pages) = usize::try_from(res)
            .ok()
            .filter(|&n| op == Op::Read && n > 0)
        else {
            return res;
        };
        let copied = match data.get(..pages) {
            Some(pages) => KernelCopy::new(cdev, qid, tag).copy_out(pages),
            None => Err(std::io::Error::other("the read is longer than its buffer")),
        };
        match copied {
            Ok(()) => res,
            Err(err) => {
                self.store.record_failed_read();
                tracing::error!(qid, tag, error = %err, "handing a read's pages to the kernel failed");
                -libc::EIO
            }
        }
    }

    /// Reads each of the thread's disk reader threads finished (`disk_readers.rs`); empty
    /// without them.
    #[cfg(test)]
    pub fn disk_readers_done(&self) -> Vec<u64> {
        self.disk
            .as_ref()
            .map_or_else(Vec::new, DiskReads::readers_done)
    }

    /// Counts a request served with `res`.
    fn finished(&mut self, op: Op, res: i32) {
        self.counters.record(self.slot, op, res);
        self.served = self.served.wrapping_add(1);
        // A syscall, so only now and then.
        if self.served.is_multiple_of(FAULT_CHECK_EVERY) {
            if let (Some(start), Some(now)) =
                (self.faults_at_start, crate::sys::sched::thread_faults())
            {
                self.counters
                    .set_faults(self.slot, now.saturating_sub(start));
            }
        }
    }
}

/// Full-size I/O buffers made and locked by [`stash_io_bufs`] before a takeover pauses the
/// device; queue threads take them instead of making their own.
static STASH: Mutex<Vec<IoBuf<u8>>> = Mutex::new(Vec::new());

/// Makes and locks `count` full-size I/O buffers for the queue threads to come. For a daemon
/// that takes a device over from a running one: locking faults every page in (8 MiB a queue
/// at the default depth), which took 140-280 ms of each takeover's pause in the TCG guest
/// when the queue threads did it after the old daemon had gone. Returns how many it made
/// (fewer when `mlock` fails; the threads then make the rest, and fail as before).
pub fn stash_io_bufs(count: usize) -> usize {
    let mut made = Vec::with_capacity(count);
    for _ in 0..count {
        let buf = IoBuf::<u8>::new(IO_BUF_BYTES as usize);
        if !buf.mlock() {
            break;
        }
        made.push(buf);
    }
    let n = made.len();
    STASH
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .extend(made);
    n
}

/// Frees what no queue thread took (a device with fewer queues or tags than the config).
pub fn drop_stashed_io_bufs() {
    STASH.lock().unwrap_or_else(PoisonError::into_inner).clear();
}

/// A buffer of `size` bytes: a stashed one when it has that size, else a new one (libublk
/// locks it when it registers it).
fn io_buf(size: usize) -> IoBuf<u8> {
    if size == IO_BUF_BYTES as usize {
        if let Some(buf) = STASH.lock().unwrap_or_else(PoisonError::into_inner).pop() {
            return buf;
        }
    }
    IoBuf::new(size)
}

/// A full-size buffer for every tag of the queue (batch mode, where one thread serves it).
pub fn queue_io_bufs(dev: &UblkDev) -> Vec<IoBuf<u8>> {
    let full = dev.dev_info.max_io_buf_bytes as usize;
    (0..dev.dev_info.queue_depth)
        .map(|_| io_buf(full))
        .collect()
}

/// A buffer per tag, full size for the tags this thread serves. With several threads per
/// queue the others' tags get a token page: libublk indexes buffers by tag, but registers and
/// locks only the thread's own (`UblkDev::alloc_queue_io_bufs` would lock nothing more, yet
/// cost every thread the whole queue's buffers).
pub fn own_io_bufs(queue: &UblkQueue<'_>, dev: &UblkDev) -> Vec<IoBuf<u8>> {
    let full = dev.dev_info.max_io_buf_bytes as usize;
    (0..dev.dev_info.queue_depth)
        .map(|tag| io_buf(if queue.owns_tag(tag) { full } else { PAGE_SIZE }))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_threads_take_the_stashed_buffers_first_and_only_full_sized_ones() {
        let stashed = stash_io_bufs(2);
        let len = || STASH.lock().unwrap().len();
        assert_eq!(len(), stashed);
        if stashed == 0 {
            println!("SKIP: mlock refused here");
            return;
        }
        let first = STASH.lock().unwrap().last().map(|b| b.as_ptr() as usize);
        let small = io_buf(PAGE_SIZE);
        assert_eq!(len(), stashed, "a token page is never a stashed buffer");
        let full = io_buf(IO_BUF_BYTES as usize);
        assert_eq!(Some(full.as_ptr() as usize), first);
        assert_eq!(len(), stashed - 1);
        drop((small, full));
        drop_stashed_io_bufs();
        assert_eq!(len(), 0);
        assert!(io_buf(IO_BUF_BYTES as usize).len() == IO_BUF_BYTES as usize);
    }

    #[test]
    fn counters_sum_queues_and_split_errors() {
        let c = RequestCounters::new(2);
        c.record(0, Op::Read, 4096);
        c.record(1, Op::Read, 8192);
        c.record(1, Op::Write, 4096);
        c.record(0, Op::Discard, 0);
        c.record(0, Op::Write, -5);
        c.record(9, Op::Write, 4096); // unknown queue: ignored
        let s: std::collections::HashMap<String, u64> = c
            .snapshot()
            .into_iter()
            .map(|s| (s.name, s.value))
            .collect();
        assert_eq!(s["read_requests"], 2);
        assert_eq!(s["read_bytes"], 12288);
        assert_eq!(s["write_requests"], 1);
        assert_eq!(s["discard_requests"], 1);
        assert_eq!(s["failed_requests"], 1);
    }
}

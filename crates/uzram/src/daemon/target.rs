//! ublk glue only: device parameters, per-queue setup, request counters and the per-request
//! loop around [`super::io::handle_with`] (the batch loop is in `batch_io`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use libublk::helpers::IoBuf;
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::sys;
use libublk::{BufDesc, UblkIORes};
use uzram_core::store::PageStore;
use uzram_core::{PAGE_SHIFT, PAGE_SIZE, SECTOR_SHIFT};

use super::compression::Compression;
use super::io::{handle_with, Op};
use super::queue_mode::{QueueMode, QueuePlan};
use crate::control::proto::Stat;

pub use crate::footprint::IO_BUF_BYTES;

/// Requests between two reads of a queue thread's page-fault count.
const FAULT_CHECK_EVERY: u32 = 64;

/// The device parameters: 4 KiB logical and physical blocks, discard and write-zeroes.
pub fn params(size: u64) -> sys::ublk_params {
    let max_sectors = IO_BUF_BYTES >> SECTOR_SHIFT;
    // Largest discard, in sectors, that is a whole number of pages.
    let max_discard = !((1u32 << (PAGE_SHIFT - SECTOR_SHIFT)) - 1);
    sys::ublk_params {
        types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
        basic: sys::ublk_param_basic {
            // No UBLK_ATTR_VOLATILE_CACHE: a write is as durable as RAM gets once it completes,
            // so the kernel need not send FLUSH (which is still answered if it does).
            attrs: 0,
            logical_bs_shift: PAGE_SHIFT as u8,
            physical_bs_shift: PAGE_SHIFT as u8,
            io_opt_shift: PAGE_SHIFT as u8,
            io_min_shift: PAGE_SHIFT as u8,
            max_sectors,
            dev_sectors: size >> SECTOR_SHIFT,
            ..Default::default()
        },
        discard: sys::ublk_param_discard {
            discard_alignment: 0,
            discard_granularity: 1 << PAGE_SHIFT,
            max_discard_sectors: max_discard,
            max_write_zeroes_sectors: max_discard,
            max_discard_segments: 1,
            reserved0: 0,
        },
        ..Default::default()
    }
}

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
}

/// Per-operation request counters of every queue thread.
pub struct Counters {
    queues: Box<[QueueCounters]>,
}

impl Counters {
    /// Counters for `threads` queue threads (queues x threads per queue); thread `k` of queue
    /// `q` counts in slot `q * threads_per_queue + k`.
    pub fn new(threads: u16) -> Self {
        Counters {
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
        let fields: [(&str, Field); 9] = [
            ("read_requests", |q| &q.reads),
            ("read_bytes", |q| &q.read_bytes),
            ("write_requests", |q| &q.writes),
            ("write_bytes", |q| &q.write_bytes),
            ("flush_requests", |q| &q.flushes),
            ("discard_requests", |q| &q.discards),
            ("write_zeroes_requests", |q| &q.write_zeroes),
            ("failed_requests", |q| &q.errors),
            ("queue_page_faults", |q| &q.page_faults),
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
    writer: &'a Compression,
    counters: &'a Counters,
    served: u32,
    faults_at_start: Option<u64>,
}

impl<'a> Server<'a> {
    fn new(
        slot: u16,
        store: &'a PageStore,
        writer: &'a Compression,
        counters: &'a Counters,
    ) -> Self {
        Server {
            slot,
            store,
            writer,
            counters,
            served: 0,
            faults_at_start: None,
        }
    }

    /// The thread's setup is done (buffers allocated and locked): from here on it serves swap
    /// I/O and must never page-fault (see `fault_guard`).
    pub fn start(&mut self) {
        super::pool::strict_current_thread();
        super::fault_guard::prefault_stack();
        // This queue's own setup allocated after the daemon-wide populate in `serve`.
        if let Err(err) = super::fault_guard::populate_writable_mappings() {
            tracing::warn!(slot = self.slot, error = %err, "populating writable memory failed");
        }
        if let Err(err) = crate::sys::set_thread_nice(super::pool::IO_NICE) {
            tracing::warn!(slot = self.slot, error = %err, "raising the queue thread's priority failed");
        }
        self.faults_at_start = super::fault_guard::thread_faults();
    }

    /// Serves one request whose data is in `data` (the tag's I/O buffer); returns its result.
    pub fn handle(&mut self, iod: &sys::ublksrv_io_desc, data: &mut [u8]) -> i32 {
        let op = Op::from_ublk(iod.op_flags);
        let res = handle_with(
            op,
            iod.start_sector,
            iod.nr_sectors,
            data,
            self.store,
            self.writer,
        );
        self.counters.record(self.slot, op, res);
        self.served = self.served.wrapping_add(1);
        // A syscall, so only now and then.
        if self.served % FAULT_CHECK_EVERY == 0 {
            if let (Some(start), Some(now)) =
                (self.faults_at_start, super::fault_guard::thread_faults())
            {
                self.counters
                    .set_faults(self.slot, now.saturating_sub(start));
            }
        }
        res
    }
}

/// `per-queue` and `per-io-daemon`: one FETCH / COMMIT_AND_FETCH uring command per request,
/// for the tags this thread owns (all of the queue's, or its share under per-io-daemon).
/// Buffers are allocated (and locked) before the first request; serving allocates nothing.
fn serve_per_request(qid: u16, dev: &UblkDev, server: &mut Server<'_>) {
    let queue = match UblkQueue::new(qid, dev) {
        Ok(queue) => queue,
        Err(err) => {
            tracing::error!(qid, error = %err, "queue setup failed");
            return;
        }
    };
    let bufs = own_io_bufs(&queue, dev);
    let queue = match queue.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))) {
        Ok(queue) => queue,
        Err(err) => {
            tracing::error!(qid, error = %err, "queue setup failed");
            return;
        }
    };
    server.start();
    let handler = |q: &UblkQueue, tag: u16| {
        let Some(buf) = bufs.get(usize::from(tag)) else {
            tracing::error!(qid, tag, "request for a tag without a buffer");
            return;
        };
        // SAFETY: `buf` is this tag's I/O buffer, allocated above with `buf.len()` bytes and
        // alive as long as `bufs`. Between delivering request `tag` and our commit below, the
        // kernel does not touch it and no other code on this thread uses it (tags are not
        // shared between threads), so this is the only reference to its bytes.
        let data = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
        let res = server.handle(q.get_iod(tag), data);
        if let Err(err) = q.complete_io_cmd_unified(
            tag,
            BufDesc::Slice(buf.as_slice()),
            Ok(UblkIORes::Result(res)),
        ) {
            tracing::error!(qid, tag, error = %err, "committing a request failed");
        }
    };
    wait_and_handle_io(&queue, handler);
    tracing::info!(qid, "queue stopped");
}

/// libublk's `UblkQueue::wait_and_handle_io`, except that a wait interrupted by a signal, or
/// refused for want of resources ([`short_of_resources`]), is waited again, and that any
/// other error leaves the device to the next daemon (`leave.rs`). libublk's loop ends the
/// queue on any error, and a stop signal (`kill -STOP`, a debugger attaching) interrupts
/// every queue's `io_uring_enter` with `EINTR`: each queue thread ended, and the daemon, its
/// queues gone, deleted the device (scenario a).
fn wait_and_handle_io(queue: &UblkQueue<'_>, mut handle: impl FnMut(&UblkQueue<'_>, u16)) {
    let mut retries = WaitRetries::default();
    loop {
        let waited = queue.flush_and_wake_io_tasks(
            |user_data, cqe, _last| {
                // As libublk's loop: a fetched request. (This ring carries no target I/O.)
                let target = user_data & libublk::UblkUringData::Target as u64 != 0;
                if !target && cqe.result() == sys::UBLK_IO_RES_OK as i32 {
                    handle(queue, UblkIOCtx::user_data_to_tag(user_data) as u16);
                }
            },
            1,
        );
        match waited {
            Ok(_) => {}
            Err(err) if retries.retry(queue.get_qid(), &err) => {}
            // Stopped with nothing left in flight.
            Err(libublk::UblkError::QueueIsDown) => break,
            Err(err) => {
                // Returns only while the device stops.
                super::leave::queue_failed(queue.get_qid(), &err);
                break;
            }
        }
    }
    for tag in queue.tags() {
        queue.unregister_io_buf(tag);
    }
}

/// A queue's wait for requests cut short by a signal (`EINTR`, from a stop signal or a
/// tracer): wait again; no completion was taken.
fn interrupted(err: &libublk::UblkError) -> bool {
    matches!(err, libublk::UblkError::IOError(e) if e.kind() == std::io::ErrorKind::Interrupted)
}

/// `io_uring_enter` refused for want of memory or completion-queue room (`EAGAIN`, `ENOMEM`,
/// `EBUSY`): the kernel kept the submissions, and the documented answer is to wait and enter
/// again. A swap daemon meets this when memory runs out, the one time it must not give up.
fn short_of_resources(err: &libublk::UblkError) -> bool {
    matches!(err, libublk::UblkError::IOError(e)
        if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM | libc::EBUSY)))
}

/// Which failed waits of a queue's loop (per-request or batch) are waited again: one
/// [`interrupted`] at once, one [`short_of_resources`] after a millisecond, logged at the
/// 1st, 2nd, 4th, 8th, ... time so that a long shortage does not flood the log.
#[derive(Default)]
pub struct WaitRetries {
    short: u64,
}

impl WaitRetries {
    /// Whether the queue should wait again after `err` (having slept where due); false for
    /// any other error.
    pub fn retry(&mut self, qid: u16, err: &libublk::UblkError) -> bool {
        if interrupted(err) {
            return true;
        }
        if !short_of_resources(err) {
            return false;
        }
        self.short += 1;
        if self.short.is_power_of_two() {
            tracing::warn!(qid, error = %err, times = self.short, "entering the queue's io_uring failed; retrying");
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        true
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
fn own_io_bufs(queue: &UblkQueue<'_>, dev: &UblkDev) -> Vec<IoBuf<u8>> {
    let full = dev.dev_info.max_io_buf_bytes as usize;
    (0..dev.dev_info.queue_depth)
        .map(|tag| io_buf(if queue.owns_tag(tag) { full } else { PAGE_SIZE }))
        .collect()
}

/// A shareable queue function for `UblkCtrl::run_target`: sets up the thread's ring and serves
/// its share of queue `qid` in `plan`'s mode until the device stops.
pub fn queue_fn(
    store: Arc<PageStore>,
    writer: Arc<Compression>,
    counters: Arc<Counters>,
    plan: QueuePlan,
) -> impl FnOnce(u16, &UblkDev) + Send + Sync + Clone + 'static {
    move |qid, dev| {
        let slot = qid
            .saturating_mul(plan.threads_per_queue)
            .saturating_add(libublk::io::io_thread_idx());
        let (sq, cq) = (u32::from(dev.tgt.sq_depth), u32::from(dev.tgt.cq_depth));
        match super::ring::init_queue_ring(sq, cq) {
            Ok(flags) => tracing::debug!(qid, ring = %super::ring::describe(flags), "queue ring"),
            Err(err) => {
                tracing::error!(qid, error = %err, "creating the queue's io_uring failed");
                return;
            }
        }
        // The codec this thread compresses and decodes with, made now: a failure to allocate
        // it must stop the queue at start, not fail requests later.
        if let Err(err) = store.prepare_thread() {
            tracing::error!(qid, error = %err, "creating the queue's codec failed");
            return;
        }
        let mut server = Server::new(slot, &store, &writer, &counters);
        match plan.mode {
            QueueMode::Batch => super::batch_io::serve(qid, dev, &mut server),
            QueueMode::PerIoDaemon | QueueMode::PerQueue => {
                serve_per_request(qid, dev, &mut server)
            }
        }
    }
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
    fn params_advertise_4k_blocks_and_discard() {
        let p = params(8 << 30);
        assert_eq!(p.basic.logical_bs_shift, 12);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.dev_sectors, (8u64 << 30) >> 9);
        assert_eq!(p.basic.max_sectors, 256);
        assert_ne!(p.types & sys::UBLK_PARAM_TYPE_DISCARD, 0);
        assert_eq!(p.discard.discard_granularity, 4096);
        assert_eq!(p.discard.max_discard_sectors % 8, 0);
        assert!(p.discard.max_write_zeroes_sectors > 0);
    }

    #[test]
    fn a_wait_short_of_memory_is_retried_and_other_errors_are_not() {
        use libublk::UblkError;
        let io = |code| UblkError::IOError(std::io::Error::from_raw_os_error(code));
        for code in [libc::EAGAIN, libc::ENOMEM, libc::EBUSY] {
            assert!(short_of_resources(&io(code)), "{code}");
            assert!(!interrupted(&io(code)), "{code}");
        }
        assert!(interrupted(&io(libc::EINTR)));
        assert!(!short_of_resources(&io(libc::EINTR)));
        for code in [libc::EBADF, libc::EINVAL, libc::ENXIO, libc::EFAULT] {
            assert!(!short_of_resources(&io(code)), "{code}");
            assert!(!interrupted(&io(code)), "{code}");
        }
        assert!(!short_of_resources(&UblkError::QueueIsDown));
        assert!(!short_of_resources(&UblkError::OtherError(-libc::EINVAL)));
        let mut retries = WaitRetries::default();
        for code in [libc::EINTR, libc::EAGAIN, libc::ENOMEM, libc::EBUSY] {
            assert!(retries.retry(0, &io(code)), "{code}");
        }
        assert_eq!(retries.short, 3);
        assert!(!retries.retry(0, &io(libc::EBADF)));
        assert!(!retries.retry(0, &UblkError::QueueIsDown));
    }

    #[test]
    fn counters_sum_queues_and_split_errors() {
        let c = Counters::new(2);
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

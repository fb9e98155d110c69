//! Reader threads beside a queue thread, for its reads of written-back pages: several such
//! reads run at once, and none runs on the queue thread or makes a thread while it serves.
//!
//! A queue thread hands a read (a block range of the backing device into one of its slot
//! buffers, `disk_reads.rs`) to its [`Readers`]; one of them reads it with `pread` and posts
//! the result into the queue thread's own ring as a completion (`IORING_OP_MSG_RING`, Linux
//! 5.18), with the read's user data, so the queue thread finishes it as it finishes any other
//! completion. Everything is made before the thread serves: the threads, their rings, the
//! job queue's room; a hand-off allocates nothing.
//!
//! Why threads of our own: io_uring's own workers (`IOSQE_ASYNC`) are made on demand by the
//! submitting thread, and making one under the memory pressure swap serves put the queue
//! thread into direct reclaim for good (a 7.3 guest); io_uring keeps only one idle worker of
//! a kind, so a queue thread could have one read in flight at a time. A reader that blocks in
//! reclaim or on the disk holds up its own read only.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::uring::wait_again;

/// Reader threads per queue thread: reads of written-back pages in flight at once, per queue.
pub const READERS: usize = 4;

/// A reader's stack; it faults in `fault_guard`'s small stack of it before it reads.
const STACK_BYTES: usize = 256 << 10;
// The recovery room counts what the readers fault in, for two queue threads a queue.
const _: () = assert!(
    2 * READERS * crate::memory::fault_guard::SMALL_STACK_PREFAULT
        <= crate::footprint::READER_STACKS_PER_QUEUE
);

/// The user data of a reader's first message, which tells the queue thread it is ready; no
/// request's (those carry a tag and an operation byte).
pub const READER_READY: u64 = u64::MAX - 2;

/// How long a queue thread waits for its readers to report ready before it goes on without
/// them.
const READY_WAIT: Duration = Duration::from_secs(10);

/// One read: `len` bytes at `offset` of `fd` into `buf`, its result posted with `user_data`.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    pub fd: RawFd,
    /// Where the bytes go; valid and not touched by anyone else until the completion with
    /// `user_data` arrived on the queue thread's ring (the caller's promise, see
    /// [`Readers::submit`]).
    pub buf: *mut u8,
    pub len: u32,
    pub offset: u64,
    pub user_data: u64,
}

// SAFETY: a job's buffer is handed to exactly one reader, and its owner does not touch it
// until that reader's completion arrived (`Readers::submit`'s contract).
unsafe impl Send for Job {}

/// How a reader reads a job: `pread` in the daemon; tests put a gate in front of it.
pub type ReadFn = fn(&Job) -> i32;

struct Queue {
    jobs: VecDeque<Job>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    read: ReadFn,
    /// Jobs each reader finished.
    done: Vec<AtomicU64>,
    /// Readers that could not post their ready message, and ended.
    failed: AtomicU64,
}

/// A queue thread's reader threads; stopped and joined when dropped (once the queue thread
/// has no read in flight, since it ends only then).
pub struct Readers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// `pread` of the whole job, `EINTR` retried: the bytes read, or a negative errno.
pub fn pread_job(job: &Job) -> i32 {
    let mut got = 0usize;
    let len = job.len as usize;
    while got < len {
        // SAFETY: `buf` is valid for `len` bytes and ours alone until the completion is
        // posted (`Readers::submit`'s contract); `got < len` keeps the range inside it.
        let n = unsafe {
            libc::pread(
                job.fd,
                job.buf.add(got).cast(),
                len - got,
                (job.offset + got as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => got += n as usize,
            0 => break,
            _ => {
                let err = io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return -err.raw_os_error().unwrap_or(libc::EIO);
            }
        }
    }
    i32::try_from(got).unwrap_or(-libc::EIO)
}

impl Readers {
    /// Starts [`READERS`] threads that post into the ring `ring_fd` (the calling queue
    /// thread's), each with room for `capacity` queued jobs in all, and waits until each has
    /// posted its [`READER_READY`] message, taking those completions off the ring. Call on
    /// the queue thread, before it serves, with nothing else in flight on its ring.
    pub fn start(ring_fd: RawFd, capacity: usize, read: ReadFn) -> io::Result<Readers> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::with_capacity(capacity),
                stop: false,
            }),
            wake: Condvar::new(),
            read,
            done: (0..READERS).map(|_| AtomicU64::new(0)).collect(),
            failed: AtomicU64::new(0),
        });
        let mut readers = Readers {
            shared,
            threads: Vec::with_capacity(READERS),
        };
        let started = (|| {
            for i in 0..READERS {
                // Made here, where a failure is an error of start(), not of a read.
                let ring = IoUring::<squeue::Entry, cqueue::Entry>::new(4)?;
                let shared = Arc::clone(&readers.shared);
                let handle = std::thread::Builder::new()
                    .name(format!("uzram-rd{i}"))
                    // mlockall locks every thread's whole stack: keep these small.
                    .stack_size(STACK_BYTES)
                    .spawn(move || run(i, ring, ring_fd, &shared))?;
                readers.threads.push(handle);
            }
            wait_ready(READERS, &readers.shared.failed)
        })();
        match started {
            Ok(()) => Ok(readers),
            Err(err) => {
                // Every reader that started has posted its ready message once it is joined:
                // take those off the ring too, so that the thread serves no stray
                // completion.
                drop(readers);
                discard_ready();
                Err(err)
            }
        }
    }

    /// Queues `job` for the next free reader; gives it back when the queue is full.
    ///
    /// The caller keeps `job.buf` valid, and does not touch it, until the completion with
    /// `job.user_data` arrived on its ring.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        let mut q = self
            .shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if q.jobs.len() == q.jobs.capacity() {
            return Err(job);
        }
        q.jobs.push_back(job);
        drop(q);
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Jobs each reader finished.
    #[cfg(test)]
    pub fn done(&self) -> Vec<u64> {
        self.shared
            .done
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .collect()
    }
}

impl Drop for Readers {
    fn drop(&mut self) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stop = true;
        self.shared.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Waits on the calling thread's ring for `n` [`READER_READY`] completions, at most
/// [`READY_WAIT`], and not once a reader `failed`.
fn wait_ready(n: usize, failed: &AtomicU64) -> io::Result<()> {
    let deadline = Instant::now() + READY_WAIT;
    let mut ready = 0;
    libublk::io::with_task_io_ring_mut(|ring| {
        while ready < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || failed.load(Ordering::Relaxed) > 0 {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{ready} of {n} disk readers reported ready, {} could not",
                        failed.load(Ordering::Relaxed)
                    ),
                ));
            }
            let ts = types::Timespec::from(left.min(Duration::from_millis(100)));
            let args = types::SubmitArgs::new().timespec(&ts);
            match ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) || wait_again(&e) => {}
                Err(e) => return Err(e),
            }
            for c in ring.completion() {
                if c.user_data() == READER_READY {
                    if c.result() < 0 {
                        return Err(io::Error::from_raw_os_error(-c.result()));
                    }
                    ready += 1;
                }
            }
        }
        Ok(())
    })
}

/// Takes every [`READER_READY`] completion still due off the calling thread's ring (after a
/// failed start, its readers joined): waits in short steps until one brings none.
fn discard_ready() {
    libublk::io::with_task_io_ring_mut(|ring| loop {
        let ts = types::Timespec::from(Duration::from_millis(10));
        let args = types::SubmitArgs::new().timespec(&ts);
        match ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ETIME) || wait_again(&e) => {}
            Err(_) => return,
        }
        if ring
            .completion()
            .filter(|c| c.user_data() == READER_READY)
            .count()
            == 0
        {
            return;
        }
    });
}

/// A reader's life: fault in its stack, enter its ring once (io_uring's per-thread state is
/// made at a thread's first submission), report ready, then read jobs until stopped.
fn run(index: usize, mut ring: IoUring, target: RawFd, shared: &Shared) {
    crate::memory::fault_guard::prefault_small_stack();
    if let Err(err) = post(&mut ring, target, READER_READY, 0) {
        tracing::warn!(reader = index, error = %err, "a disk reader could not reach its queue's ring");
        shared.failed.fetch_add(1, Ordering::Relaxed);
        return;
    }
    loop {
        let job = {
            let mut q = shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if let Some(job) = q.jobs.pop_front() {
                    break job;
                }
                if q.stop {
                    return;
                }
                q = shared.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let res = (shared.read)(&job);
        // Counted before it is posted, so that whoever saw the completion sees the count.
        shared.done[index].fetch_add(1, Ordering::Relaxed);
        if let Err(err) = post(&mut ring, target, job.user_data, res) {
            // The queue thread's ring is gone: the device is being torn down.
            tracing::error!(reader = index, error = %err, "posting a disk read's completion failed");
            return;
        }
    }
}

/// Posts a completion (`user_data`, `res`) into the ring `target`, through `ring`; retried
/// while the target's completion queue has no room or memory is short, since a lost
/// completion would leave its request waiting for good.
fn post(ring: &mut IoUring, target: RawFd, user_data: u64, res: i32) -> io::Result<()> {
    let msg = opcode::MsgRingData::new(types::Fd(target), res, user_data, None)
        .build()
        .user_data(user_data);
    let mut short = 0u64;
    loop {
        // SAFETY: a message refers to no memory of ours; the ring is this thread's alone and
        // empty (each post waits for its own completion).
        unsafe { ring.submission().push(&msg) }
            .map_err(|_| io::Error::other("a reader's ring is full"))?;
        let result = loop {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if wait_again(&e) => {}
                Err(e) => return Err(e),
            }
            if let Some(c) = ring.completion().next() {
                break c.result();
            }
        };
        match result {
            r if r >= 0 => return Ok(()),
            r if matches!(-r, libc::EOVERFLOW | libc::EAGAIN | libc::ENOMEM) => {
                short += 1;
                if short.is_power_of_two() {
                    tracing::warn!(
                        times = short,
                        errno = -r,
                        "a disk read's completion found no room on the queue's ring: trying again"
                    );
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            r => return Err(io::Error::from_raw_os_error(-r)),
        }
    }
}

/// Test support shared with `disk_reads`' tests.
#[cfg(test)]
pub(super) mod test_ring {
    use super::*;

    /// Runs `f` on a new thread that has a queue thread's ring (`sq` and `cq` entries), with
    /// that ring's descriptor; skips, saying why, where io_uring is refused or, with
    /// `msg_ring`, where the kernel has no `IORING_OP_MSG_RING` (5.18).
    pub(in crate::ublk) fn on_a_queue_ring(
        sq: u32,
        cq: u32,
        msg_ring: bool,
        f: impl FnOnce(RawFd) + Send + 'static,
    ) {
        std::thread::spawn(move || {
            if let Err(err) = crate::ublk::uring::init_queue_ring(sq, cq) {
                println!("SKIP: no io_uring here: {err}");
                return;
            }
            let ring_fd = libublk::io::with_task_io_ring(std::os::fd::AsRawFd::as_raw_fd);
            if msg_ring && !has_msg_ring(ring_fd) {
                println!("SKIP: this kernel has no IORING_OP_MSG_RING");
                return;
            }
            f(ring_fd);
        })
        .join()
        .unwrap();
    }

    /// Whether the calling thread's ring takes a message to itself (refused with EINVAL
    /// where the opcode is unknown); the message's completion is taken off the ring.
    fn has_msg_ring(ring_fd: RawFd) -> bool {
        let msg = opcode::MsgRingData::new(types::Fd(ring_fd), 0, 42, None).build();
        let res = libublk::io::with_task_io_ring_mut(|ring| {
            // SAFETY: a message refers to no memory of ours.
            unsafe { ring.submission().push(&msg) }.unwrap();
            ring.submit_and_wait(1).unwrap();
            ring.completion().map(|c| c.result()).min().unwrap_or(0)
        });
        libublk::io::with_task_io_ring_mut(|ring| {
            ring.submit_and_wait(0).unwrap();
            ring.completion().for_each(drop);
        });
        res != -libc::EINVAL
    }
}

#[cfg(test)]
mod tests {
    use super::test_ring::on_a_queue_ring;
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Jobs a gated read lets through only once [`READERS`] of them wait at once.
    static AT_GATE: AtomicUsize = AtomicUsize::new(0);

    fn gated_read(job: &Job) -> i32 {
        AT_GATE.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(20);
        while AT_GATE.load(Ordering::SeqCst) < READERS {
            if Instant::now() > deadline {
                return -libc::ETIMEDOUT;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        pread_job(job)
    }

    /// Reads that can only finish together (each waits until all are in flight) finish:
    /// the readers run them at once, and each result arrives on the queue thread's ring
    /// with its read's user data.
    #[test]
    fn reads_run_at_once_and_complete_on_the_queue_threads_ring() {
        on_a_queue_ring(16, 64, true, |ring_fd| {
            let readers = Readers::start(ring_fd, 8, gated_read).expect("readers started");
            let path = std::env::temp_dir().join(format!("uzram-readers-{}", std::process::id()));
            let data: Vec<u8> = (0..READERS * 4096).map(|i| (i * 7 % 251) as u8).collect();
            std::fs::write(&path, &data).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
            let mut bufs = vec![[0u8; 4096]; READERS];
            for (i, b) in bufs.iter_mut().enumerate() {
                let job = Job {
                    fd,
                    buf: b.as_mut_ptr(),
                    len: 4096,
                    offset: (i * 4096) as u64,
                    user_data: 1000 + i as u64,
                };
                readers.submit(job).unwrap();
            }
            let mut results = std::collections::HashMap::new();
            while results.len() < READERS {
                libublk::io::with_task_io_ring_mut(|ring| {
                    ring.submit_and_wait(1).unwrap();
                    for c in ring.completion() {
                        assert!(results.insert(c.user_data(), c.result()).is_none());
                    }
                });
            }
            for i in 0..READERS {
                assert_eq!(results[&(1000 + i as u64)], 4096, "read {i}");
                assert_eq!(&bufs[i][..], &data[i * 4096..(i + 1) * 4096], "read {i}");
            }
            assert!(
                readers.done().iter().all(|&d| d == 1),
                "each reader took one read: {:?}",
                readers.done()
            );
            drop(readers);
            let _ = std::fs::remove_file(&path);
        });
    }

    /// Readers that cannot reach the queue's ring (here: a descriptor that is no ring) make
    /// the start fail at once, and leave no completion on the thread's ring.
    #[test]
    fn readers_that_cannot_post_fail_the_start_and_leave_nothing_behind() {
        on_a_queue_ring(16, 64, true, |_| {
            let not_a_ring = std::fs::File::open("/dev/null").unwrap();
            let fd = std::os::fd::AsRawFd::as_raw_fd(&not_a_ring);
            let began = Instant::now();
            let err = match Readers::start(fd, 4, pread_job) {
                Ok(_) => panic!("readers started on /dev/null"),
                Err(err) => err,
            };
            assert!(err.to_string().contains("could not"), "{err}");
            assert!(began.elapsed() < READY_WAIT, "{:?}", began.elapsed());
            let left = libublk::io::with_task_io_ring_mut(|ring| ring.completion().count());
            assert_eq!(left, 0);
        });
    }

    static HELD: AtomicUsize = AtomicUsize::new(0);
    static RELEASED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    fn held_read(_: &Job) -> i32 {
        HELD.fetch_add(1, Ordering::SeqCst);
        while !RELEASED.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        0
    }

    /// With every reader busy and the queue's room taken, a read is given back (the queue
    /// thread then reads it itself), and nothing is lost: every queued read completes.
    #[test]
    fn a_full_queue_gives_the_job_back_and_loses_none() {
        on_a_queue_ring(16, 64, true, |ring_fd| {
            let readers = Readers::start(ring_fd, 3, held_read).expect("readers started");
            let job = |user_data| Job {
                fd: -1,
                buf: std::ptr::null_mut(),
                len: 0,
                offset: 0,
                user_data,
            };
            // One read for each reader, each taken before the next is queued.
            let deadline = Instant::now() + Duration::from_secs(20);
            for i in 0..READERS {
                readers.submit(job(i as u64)).unwrap();
                while HELD.load(Ordering::SeqCst) <= i {
                    if Instant::now() > deadline {
                        RELEASED.store(true, Ordering::SeqCst);
                        panic!("the readers never took their reads");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let room = readers.shared.queue.lock().unwrap().jobs.capacity();
            assert!(room >= 3);
            let mut queued = READERS as u64;
            for _ in 0..room {
                readers.submit(job(queued)).unwrap();
                queued += 1;
            }
            let refused = readers.submit(job(999));
            RELEASED.store(true, Ordering::SeqCst);
            assert_eq!(refused.expect_err("a full queue refuses").user_data, 999);
            let mut seen = std::collections::HashSet::new();
            while seen.len() < queued as usize {
                libublk::io::with_task_io_ring_mut(|ring| {
                    ring.submit_and_wait(1).unwrap();
                    for c in ring.completion() {
                        assert_eq!(c.result(), 0);
                        assert!(c.user_data() < queued, "{}", c.user_data());
                        assert!(seen.insert(c.user_data()));
                    }
                });
            }
            assert_eq!(readers.done().iter().sum::<u64>(), queued);
        });
    }
}

//! Part of `uzram bench --writeback`: one queue thread serving reads as the daemon does
//! (its `Server` on a queue thread's ring), [`WINDOW`] one-page requests in flight, every
//! other one for a written-back page. Measured twice: with the written-back pages read
//! through the thread's ring (`ublk/disk_reads.rs`) and read synchronously on the thread.
//!
//! Requests arrive in rounds, as the kernel hands a queue several at once: every tag that
//! is free at the start of a round gets a request, all arriving then; a request's latency
//! runs from its round's start to its completion. A synchronous disk read holds up the
//! requests after it in the round; a deferred one does not.

use std::time::Instant;

use uzram_core::{PageStore, PAGE_SIZE};

use super::random::next;
use crate::daemon::backend::WriteBackend;
use crate::ublk::server::{RequestCounters, Server};

/// Requests in flight on the queue.
pub const WINDOW: u16 = 16;
/// Rounds measured.
const ROUNDS: usize = 4000;

/// Latencies (ns, sorted) of the requests for pages in RAM and for written-back pages.
#[derive(Debug, Clone, Default)]
pub struct QueueReads {
    pub ram: Vec<u32>,
    pub disk: Vec<u32>,
    /// Wall time of all rounds.
    pub wall_ns: u64,
    /// Every request returned its page.
    pub ok: bool,
}

/// Serves the rounds on a new thread with its own queue ring; `None` where io_uring is
/// refused. `expected(p)` is page `p`'s content; pages `disk` (not empty) are written
/// back, `ram` not.
pub fn measure<'e>(
    store: &PageStore,
    c: &WriteBackend,
    disk: &[usize],
    ram: std::ops::Range<usize>,
    deferred: bool,
    expected: &(dyn Fn(usize) -> &'e [u8] + Sync),
) -> Option<QueueReads> {
    if disk.is_empty() {
        return None;
    }
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // The daemon's ring for a queue of 64 tags.
                crate::ublk::uring::init_queue_ring(64, crate::ublk::queue_cq_entries(64)).ok()?;
                store.prepare_thread().ok()?;
                if deferred {
                    crate::ublk::disk_reads::ready(store).ok()?;
                }
                Some(serve(store, c, disk, ram, deferred, expected))
            })
            .join()
            .ok()
            .flatten()
    })
}

/// A request in flight: when its round began, its page, and whether it is written back.
#[derive(Clone, Copy)]
struct Request {
    arrived: Instant,
    page: usize,
    disk: bool,
}

fn serve<'e>(
    store: &PageStore,
    c: &WriteBackend,
    disk: &[usize],
    ram: std::ops::Range<usize>,
    deferred: bool,
    expected: &dyn Fn(usize) -> &'e [u8],
) -> QueueReads {
    let counters = RequestCounters::new(1);
    let mut server = Server::new(0, store, c, &counters);
    if !deferred {
        server = server.reading_backed_pages_inline();
    }
    server.start(WINDOW);
    let mut bufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0u8; PAGE_SIZE]).collect();
    let mut inflight: Vec<Option<Request>> = vec![None; usize::from(WINDOW)];
    let mut out = QueueReads {
        ok: true,
        ..QueueReads::default()
    };
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let pick = |r: &std::ops::Range<usize>, seed: &mut u64| {
        r.start + (next(seed) % (r.end - r.start) as u64) as usize
    };
    let start = Instant::now();
    let mut done = |req: Request, res: i32, buf: &[u8], out: &mut QueueReads| {
        let lat = u32::try_from(req.arrived.elapsed().as_nanos()).unwrap_or(u32::MAX);
        out.ok &= res == PAGE_SIZE as i32 && buf == expected(req.page);
        if req.disk {
            out.disk.push(lat);
        } else {
            out.ram.push(lat);
        }
    };
    for _ in 0..ROUNDS {
        let now = Instant::now();
        let mut fresh = [false; WINDOW as usize];
        for (tag, slot) in inflight.iter_mut().enumerate() {
            if slot.is_none() {
                let disk_page = tag % 2 == 0;
                let page = if disk_page {
                    disk[(next(&mut seed) % disk.len().max(1) as u64) as usize]
                } else {
                    pick(&ram, &mut seed)
                };
                *slot = Some(Request {
                    arrived: now,
                    page,
                    disk: disk_page,
                });
                fresh[tag] = true;
            }
        }
        for tag in 0..WINDOW {
            let t = usize::from(tag);
            let Some(req) = inflight[t].filter(|_| fresh[t]) else {
                continue;
            };
            let iod = libublk::sys::ublksrv_io_desc {
                op_flags: libublk::sys::UBLK_IO_OP_READ,
                nr_sectors: (PAGE_SIZE / 512) as u32,
                start_sector: (req.page * (PAGE_SIZE / 512)) as u64,
                addr: 0,
            };
            if let Some(res) = server.handle(tag, &iod, &mut bufs[t]) {
                done(req, res, &bufs[t], &mut out);
                inflight[t] = None;
            }
        }
        // Requests waiting for disk reads: the next round begins once one came in.
        if inflight.iter().any(Option::is_some) {
            wait_one(&mut server, &mut bufs, &mut inflight, &mut done, &mut out);
        }
    }
    while inflight.iter().any(Option::is_some) {
        wait_one(&mut server, &mut bufs, &mut inflight, &mut done, &mut out);
    }
    out.wall_ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    out.ram.sort_unstable();
    out.disk.sort_unstable();
    out
}

/// Waits for at least one completion on the thread's ring and finishes what completed.
fn wait_one(
    server: &mut Server<'_>,
    bufs: &mut [Vec<u8>],
    inflight: &mut [Option<Request>],
    done: &mut impl FnMut(Request, i32, &[u8], &mut QueueReads),
    out: &mut QueueReads,
) {
    let mut cqes = [(0u64, 0i32); 64];
    let n = libublk::io::with_task_io_ring_mut(|ring| {
        if ring.submit_and_wait(1).is_err() {
            return 0;
        }
        let mut n = 0;
        for c in ring.completion().take(cqes.len()) {
            cqes[n] = (c.user_data(), c.result());
            n += 1;
        }
        n
    });
    if n == 0 {
        // No disk read can be in flight (a synchronous server): nothing will complete.
        for slot in inflight.iter_mut() {
            *slot = None;
        }
        out.ok = false;
        return;
    }
    for &(user_data, res) in &cqes[..n] {
        let tag = usize::from(libublk::io::UblkIOCtx::user_data_to_tag(user_data) as u16);
        let buf = bufs.get_mut(tag).map(|b| b.as_mut_slice());
        if let Some((tag, res)) = server.disk_read_done(user_data, res, buf) {
            let t = usize::from(tag);
            if let Some(req) = inflight[t].take() {
                done(req, res, &bufs[t], out);
            }
        }
    }
}

//! The ublk frontend: the device's parameters, its queues and the one request handler.
//!
//! - [`queue_mode`]: how requests reach the daemon (per queue, per I/O daemon, batched).
//! - [`uring`]: the queues' io_uring setup.
//! - [`queue_fn`] (here): each queue thread's start, in the loop of its mode;
//!   [`queue`]: the per-queue and per-I/O-daemon loops; [`batch`]: the batch loop.
//! - [`server`]: a queue thread's state; [`retries`]: its failed waits and commands.
//! - [`handler`]: the request handler, which sees a store and a [`handler::PageWriter`] and
//!   nothing else.
//! - [`tuning`]: the block queue's settings once the device exists.

pub mod batch;
pub mod disk_readers;
pub mod disk_reads;
pub mod handler;
pub mod placement;
pub mod queue;
pub mod queue_mode;
pub mod retries;
pub mod run_dir;
pub mod server;
pub mod tuning;
pub mod uring;
pub mod user_copy;

use std::sync::Arc;

use libublk::io::UblkDev;
use libublk::sys;
use uzram_core::store::PageStore;
use uzram_core::{PAGE_SHIFT, SECTOR_SHIFT};

use crate::footprint::IO_BUF_BYTES;
use handler::PageWriter;
use queue_mode::{QueueMode, QueuePlan};
use server::{RequestCounters, Server};

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

/// Completion-queue entries for the ring of a queue thread that serves `depth` tags: room
/// for every completion that can be outstanding at once.
///
/// A full completion queue costs more than memory. A completion that finds it full waits in
/// the kernel's overflow list, whose entries are allocated then (under the memory pressure
/// swap serves, that allocation can stall in reclaim or fail, and a failed one drops the
/// completion: a request or a disk read never finishes); and the kernel posts a multishot
/// command's completions (`batch` mode's fetches) only into free entries, so a fetch that
/// finds none ends with ENOBUFS. Outstanding at most: one completion per tag (the per-request modes' commands; in
/// `batch` mode a fetch's completions, each carrying a tag or more), one per fetch buffer
/// given back (`batch`: one buffer per tag), the disk reads ([`disk_reads::SLOTS`]) and
/// the reader threads' messages ([`disk_readers::READERS`] ready notes besides their
/// reads), and a few more (the batch commits and fetch ends, the first read of the thread's
/// io_uring worker). The kernel rounds it up to a power of two: 256 entries (4 KiB) at the
/// default depth of 64.
pub fn queue_cq_entries(depth: u16) -> u32 {
    // 36: the cast of these two small constants cannot truncate.
    const READS: u32 = (disk_reads::SLOTS + disk_readers::READERS) as u32;
    2 * u32::from(depth) + READS + 16
}

/// Submission entries for a queue thread's io_uring with `depth` tags: a command per tag,
/// and every disk read on the io_uring worker's path ([`disk_reads::SLOTS`]), which shares
/// the queue. libublk's push of a command into a full queue submits and then unwraps that
/// submission's result, so a full queue under memory pressure (where `io_uring_enter` may
/// fail with EAGAIN or ENOMEM) could end the daemon: the queue has room for everything at
/// once (and a few more: `batch` mode's commits and fetches).
pub fn queue_sq_entries(depth: u16) -> u32 {
    // 36: the cast of this small constant cannot truncate.
    u32::from(depth) + disk_reads::SLOTS as u32 + 8
}

/// A shareable queue function for `UblkCtrl::run_target`: sets up the thread's ring and serves
/// its share of queue `qid` in `plan`'s mode until the device stops.
pub fn queue_fn(
    store: Arc<PageStore>,
    writer: Arc<dyn PageWriter + Send + Sync>,
    counters: Arc<RequestCounters>,
    plan: QueuePlan,
    threads: Arc<placement::QueueThreads>,
) -> impl FnOnce(u16, &UblkDev) + Send + Sync + Clone + 'static {
    move |qid, dev| {
        threads.register();
        let slot = qid
            .saturating_mul(plan.threads_per_queue)
            .saturating_add(libublk::io::io_thread_idx());
        let sq = queue_sq_entries(dev.tgt.sq_depth);
        let cq = queue_cq_entries(dev.dev_info.queue_depth).max(sq);
        match uring::init_queue_ring(sq, cq) {
            Ok(flags) => tracing::debug!(qid, ring = %uring::describe(flags), "queue ring"),
            Err(err) => {
                queue::setup_failed(qid, &format!("creating the queue's io_uring: {err}"));
                return;
            }
        }
        // The codec this thread compresses and decodes with, made now: a failure to allocate
        // it must stop the queue at start, not fail requests later.
        if let Err(err) = store.prepare_thread() {
            queue::setup_failed(qid, &format!("creating the queue's codec: {err}"));
            return;
        }
        if let Err(err) = disk_reads::ready(&store) {
            tracing::warn!(qid, error = %err, "readying the io_uring worker for disk reads failed: one is made at the first read");
        }
        let mut server = Server::new(slot, &store, &*writer, &counters);
        match plan.mode {
            QueueMode::Batch => batch::serve(qid, dev, &mut server),
            QueueMode::PerIoDaemon | QueueMode::PerQueue => queue::serve(qid, dev, &mut server),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_ring_holds_every_completion_that_can_be_outstanding() {
        use super::{disk_readers::READERS, disk_reads::SLOTS};
        use crate::footprint::MAX_DEPTH;
        for depth in [1u16, 2, 64, 128, 1000, MAX_DEPTH] {
            let d = u32::from(depth);
            let cq = queue_cq_entries(depth);
            // A command or fetch completion per tag, a buffer given back per tag, every disk
            // read, every reader's ready note, the batch commits and fetch ends.
            let outstanding = d + d + SLOTS as u32 + READERS as u32 + 2 + 2 + 1;
            assert!(cq >= outstanding, "depth {depth}: {cq} < {outstanding}");
            // The submission queue holds a command per tag and every disk read at once, and
            // never exceeds the completion queue (IORING_SETUP_CQSIZE).
            let sq = queue_sq_entries(depth);
            assert!(sq >= d + SLOTS as u32, "depth {depth}: {sq}");
            assert!(cq >= sq, "depth {depth}: {cq} < {sq}");
            assert!(sq.next_power_of_two() <= 32768, "depth {depth}: {sq}");
            // io_uring's own bound on completion entries (IORING_MAX_CQ_ENTRIES).
            assert!(cq.next_power_of_two() <= 65536, "depth {depth}: {cq}");
        }
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
}

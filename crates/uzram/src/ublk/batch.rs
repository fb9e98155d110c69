//! The `batch` queue mode (`UBLK_F_BATCH_IO`, Linux 7.0): one queue thread fetches requests
//! in groups through multishot fetch commands and commits their results in groups, through
//! libublk's `UblkBatchQueue`.
//!
//! Per wake-up the thread serves every request of every fetched group, then commits all the
//! results with one command, where the per-request modes spend a uring command (and its
//! task-work round trip in the kernel) on each request.

use libublk::io::{
    UblkBatchBuffers, UblkBatchCompletion, UblkBatchConfig, UblkBatchQueue, UblkDev, UblkQueue,
};
use libublk::UblkError;

use super::disk_reads::DiskReads;
use super::server::{queue_io_bufs, Server};
use crate::takeover::leave;

/// Serves queue `qid` until the device stops; returns after the kernel released every buffer.
/// Buffers are allocated (and locked) before the first request; serving allocates nothing.
pub fn serve(qid: u16, dev: &UblkDev, server: &mut Server<'_>) {
    let queue = match UblkQueue::new(qid, dev) {
        Ok(queue) => queue,
        Err(err) => {
            super::queue::setup_failed(qid, &err);
            return;
        }
    };
    let depth = queue.get_depth() as usize;
    let config = fetch_config(u16::try_from(depth).unwrap_or(u16::MAX));
    let buffers = UblkBatchBuffers::IoBufs(queue_io_bufs(dev));
    let mut batch = match UblkBatchQueue::new(&queue, buffers, config) {
        Ok(batch) => batch,
        Err(err) => {
            super::queue::setup_failed(qid, &format!("the batch queue: {err}"));
            return;
        }
    };
    // Every tag is in flight at most once, so this never grows while serving.
    let mut pending: Vec<UblkBatchCompletion> = Vec::with_capacity(depth);
    server.start(u16::try_from(depth).unwrap_or(u16::MAX));
    if let Err(err) = run(&queue, &mut batch, &mut pending, server) {
        // The queue can serve no more. Returns only while the device stops.
        leave::queue_failed(qid, &err);
        return;
    }
    tracing::info!(qid, "queue stopped");
}

/// Most tags the kernel puts in one fetch completion (`MAX_NR_TAG` in `ublk_drv.c`); a
/// larger fetch buffer would never be filled.
const TAGS_PER_FETCH_MAX: u16 = 128;

/// The batch transport's fetch buffers for a queue of `depth` tags: one per tag.
///
/// Every fetch completion the kernel posts takes one provided buffer and carries at least one
/// tag, which stays the daemon's until its result is committed; libublk provides the buffer
/// again (in the submission queue, ahead of that commit) when it reads the completion. So at
/// most `depth` buffers are ever out of the kernel's hands, and with `depth` of them a fetch
/// never ends for want of one. A fetch also ends (with the same `ENOBUFS`) when its
/// completion finds the ring's completion queue full, which `queue_cq_entries` sizes for
/// these completions too. With libublk's default eight buffers and a completion queue of
/// `depth` entries, a fetch ended so and was re-armed twice in the guest under the swap hog;
/// a fetch that keeps ending so is a loop the queue thread spins in. Each buffer costs 2
/// bytes a tag: 8 KiB a queue at the default depth.
fn fetch_config(depth: u16) -> UblkBatchConfig {
    let depth = depth.max(1);
    let defaults = UblkBatchConfig::new();
    defaults
        .with_fetch_buffer_count(depth.max(defaults.fetch_buffer_count()))
        .with_tags_per_fetch_buffer(depth.min(TAGS_PER_FETCH_MAX))
}

/// The serving loop: handle CQEs, serve fetched requests, commit their results; ends once the
/// device stopped and the batch transport has shut down.
fn run(
    queue: &UblkQueue<'_>,
    batch: &mut UblkBatchQueue<'_, '_>,
    pending: &mut Vec<UblkBatchCompletion>,
    server: &mut Server<'_>,
) -> Result<(), UblkError> {
    let mut retries = server.retries(queue.get_qid());
    loop {
        let mut failed = None;
        let mut served = 0;
        let waited = queue.flush_and_wake_io_tasks(
            |user_data, cqe, _is_last| {
                // One of our own reads (`disk_reads.rs`): its request may be done. (The
                // batch commands' completions carry the target bit too: only the read's
                // operation byte tells them apart.)
                if DiskReads::owns(user_data) {
                    let tag = libublk::io::UblkIOCtx::user_data_to_tag(user_data) as u16;
                    let buf = batch.io_buf_mut(tag).map(|b| b.as_mut_slice());
                    if let Some((tag, res)) = server.disk_read_done(user_data, cqe.result(), buf) {
                        pending.push(UblkBatchCompletion::new(tag, res));
                    }
                    return;
                }
                // The batch commands' own results: a fetch that failed is re-armed by
                // libublk at once, which `retries` must see to stop a spin.
                retries.command_done(cqe.result());
                let handled = batch.handle_cqe(cqe, |batch, tags| {
                    served += tags.len();
                    for &tag in tags {
                        let iod = queue.get_iod(tag);
                        let res = match batch.io_buf_mut(tag) {
                            Some(buf) => server.handle(tag, iod, buf.as_mut_slice()),
                            // A tag the transport did not hand out (libublk 0.4 marks every
                            // fetched tag its own before this runs): its completion is refused
                            // with the batch's, and the queue stops as for any failed commit.
                            None => Some(-libc::EIO),
                        };
                        // None: it waits for disk reads, and is committed when they are done.
                        if let Some(res) = res {
                            pending.push(UblkBatchCompletion::new(tag, res));
                        }
                    }
                    Ok(())
                });
                // Ok(false): a CQE of no batch command; this ring carries nothing else.
                if let Err(err) = handled {
                    failed.get_or_insert(err);
                }
            },
            1,
        );
        match waited {
            Ok(_) => {}
            // A stop signal or a tracer cut the wait short, or the kernel was short of memory
            // (`retries.rs`); the results still pending are committed below.
            Err(err) if retries.retry(&err) => {}
            // Stopped with nothing left in flight: the transport is done with the buffers.
            Err(UblkError::QueueIsDown) => return Ok(()),
            Err(err) => return Err(err),
        }
        if let Some(err) = failed {
            return Err(err);
        }
        // Ok(false): every commit slot is in flight; keep the results and retry once one of
        // them completed (its CQE ends the next wait).
        if !pending.is_empty() && batch.try_submit_completions(pending)? {
            pending.clear();
        }
        if batch.try_begin_shutdown()? && batch.is_shutdown_complete() {
            return Ok(());
        }
        retries.turn_done(served);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_has_a_fetch_buffer_for_every_tag_and_each_holds_what_the_kernel_sends() {
        for depth in [1u16, 2, 8, 64, 128, 129, 1024, 4096] {
            let config = fetch_config(depth);
            // No fetch can run out of buffers: every tag could sit in a completion of its own.
            assert!(config.fetch_buffer_count() >= depth, "depth {depth}");
            // libublk's own floor (it refuses more fetch commands than buffers).
            assert!(config.fetch_buffer_count() >= config.fetch_command_count());
            // A buffer holds a full queue's tags, up to the most one completion carries.
            assert_eq!(
                config.tags_per_fetch_buffer(),
                depth.min(TAGS_PER_FETCH_MAX)
            );
            // The cost stays small at the largest depth: 1 MiB a queue.
            let bytes = usize::from(config.fetch_buffer_count())
                * usize::from(config.tags_per_fetch_buffer())
                * 2;
            assert!(bytes <= 1 << 20, "depth {depth}: {bytes} bytes");
        }
        // depth 0 cannot be configured, but is not a zero-buffer transport either.
        assert!(fetch_config(0).tags_per_fetch_buffer() >= 1);
    }
}

//! The `per-queue` and `per-io-daemon` queue modes: one uring command per request.

use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::sys;
use libublk::{BufDesc, UblkIORes};

use super::disk_reads::DiskReads;
use super::retries::Retries;
use super::server::{own_io_bufs, Server};
use crate::takeover::leave;

/// A queue thread that cannot start serving: the device cannot start (or go on, after a
/// takeover) without it, and nothing else would end the wait for it (libublk waits for every
/// queue's buffers, the kernel for every queue's fetches), so it ends the daemon as a queue
/// that fails later does: the device left to the next daemon. Returns only while stopping.
pub(super) fn setup_failed(qid: u16, err: &dyn std::fmt::Display) {
    leave::queue_failed(qid, &format_args!("queue setup: {err}"));
}

/// `per-queue` and `per-io-daemon`: one FETCH / COMMIT_AND_FETCH uring command per request,
/// for the tags this thread owns (all of the queue's, or its share under per-io-daemon).
/// Buffers are allocated (and locked) before the first request; serving allocates nothing.
pub fn serve(qid: u16, dev: &UblkDev, server: &mut Server<'_>) {
    let queue = match UblkQueue::new(qid, dev) {
        Ok(queue) => queue,
        Err(err) => {
            setup_failed(qid, &err);
            return;
        }
    };
    let bufs = own_io_bufs(&queue, dev);
    // With user copy the kernel takes no buffer address (it refuses one): the buffers stay
    // the thread's own, for reads to decode into and writes that need a bounce.
    let user_copy = dev.dev_info.flags & u64::from(sys::UBLK_F_USER_COPY) != 0;
    if user_copy && !bufs.iter().all(|b| b.mlock()) {
        setup_failed(
            qid,
            &"locking the queue's I/O buffers failed (RLIMIT_MEMLOCK?)",
        );
        return;
    }
    let fetch = if user_copy {
        BufDescList::Slices(None)
    } else {
        BufDescList::Slices(Some(&bufs))
    };
    let queue = match queue.submit_fetch_commands_unified(fetch) {
        Ok(queue) => queue,
        Err(err) => {
            setup_failed(qid, &err);
            return;
        }
    };
    if user_copy {
        server.copy_through(dev.tgt.fds[0], qid);
    }
    server.start(queue.get_depth() as u16);
    let retries = server.retries(qid);
    let data_of = |tag: u16| -> Option<&mut [u8]> {
        let buf = bufs.get(usize::from(tag))?;
        // SAFETY: `buf` is this tag's I/O buffer, allocated above with `buf.len()` bytes and
        // alive as long as `bufs`. Between delivering request `tag` and our commit, the
        // kernel does not touch it and no other code on this thread uses it (tags are not
        // shared between threads; a request waiting for disk reads is touched again only
        // when one completes, on this thread), so this is the only reference to its bytes.
        Some(unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) })
    };
    let commit = |q: &UblkQueue, tag: u16, res: i32| {
        let Some(buf) = bufs.get(usize::from(tag)) else {
            return;
        };
        let desc = if user_copy { &[][..] } else { buf.as_slice() };
        if let Err(err) =
            q.complete_io_cmd_unified(tag, BufDesc::Slice(desc), Ok(UblkIORes::Result(res)))
        {
            tracing::error!(qid, tag, error = %err, "committing a request failed");
        }
    };
    let handler = |q: &UblkQueue, event: Event| match event {
        Event::Request(tag) => {
            let Some(data) = data_of(tag) else {
                tracing::error!(qid, tag, "request for a tag without a buffer");
                return;
            };
            if let Some(res) = server.handle(tag, q.get_iod(tag), data) {
                commit(q, tag, res);
            }
        }
        Event::Target { user_data, res } => {
            let tag = UblkIOCtx::user_data_to_tag(user_data) as u16;
            if let Some((tag, res)) = server.disk_read_done(user_data, res, data_of(tag)) {
                commit(q, tag, res);
            }
        }
    };
    wait_and_handle_io(&queue, retries, handler);
    tracing::info!(qid, "queue stopped");
}

/// What a completion on a queue thread's ring brings.
enum Event {
    /// Request `tag` was fetched.
    Request(u16),
    /// An I/O of the thread's own completed (a disk read, `disk_reads.rs`).
    Target { user_data: u64, res: i32 },
}

/// libublk's `UblkQueue::wait_and_handle_io`, except that a wait interrupted by a signal,
/// or refused for want of resources, is waited again (`retries.rs`), and that any other
/// error leaves the device to the next daemon (`leave.rs`). libublk's loop ends the queue
/// on any error, and a stop signal (`kill -STOP`, a debugger attaching) interrupts every
/// queue's `io_uring_enter` with `EINTR`: each queue thread ended, and the daemon, its
/// queues gone, deleted the device (seen when a debugger attached).
fn wait_and_handle_io(
    queue: &UblkQueue<'_>,
    mut retries: Retries<'_>,
    mut handle: impl FnMut(&UblkQueue<'_>, Event),
) {
    loop {
        let mut served = 0;
        let waited = queue.flush_and_wake_io_tasks(
            |user_data, cqe, _last| {
                // As libublk's loop: a fetched request; or one of our own reads.
                if DiskReads::owns(user_data) {
                    let res = cqe.result();
                    handle(queue, Event::Target { user_data, res });
                } else if user_data & libublk::UblkUringData::Target as u64 == 0 {
                    retries.command_done(cqe.result());
                    if cqe.result() == sys::UBLK_IO_RES_OK as i32 {
                        served += 1;
                        handle(
                            queue,
                            Event::Request(UblkIOCtx::user_data_to_tag(user_data) as u16),
                        );
                    }
                }
            },
            1,
        );
        match waited {
            Ok(_) => {}
            Err(err) if retries.retry(&err) => {}
            // Stopped with nothing left in flight.
            Err(libublk::UblkError::QueueIsDown) => break,
            Err(err) => {
                // Returns only while the device stops.
                leave::queue_failed(queue.get_qid(), &err);
                break;
            }
        }
        retries.turn_done(served);
    }
    for tag in queue.tags() {
        queue.unregister_io_buf(tag);
    }
}

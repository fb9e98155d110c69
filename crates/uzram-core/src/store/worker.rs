//! Per-thread codec reuse: each thread that writes or reads keeps one codec (and a scratch
//! page for compressed output), so the I/O path allocates nothing after a thread's first page.

use std::cell::RefCell;

use crate::batch::BatchOutput;
use crate::codec::{Algorithm, PageCodec};
use crate::page::PAGE_SIZE;

struct Worker {
    algorithm: Algorithm,
    codec: Box<dyn PageCodec>,
    scratch: Box<[u8; PAGE_SIZE]>,
}

impl Worker {
    fn new(algorithm: Algorithm) -> Self {
        Self {
            algorithm,
            codec: algorithm.codec(),
            scratch: Box::new([0; PAGE_SIZE]),
        }
    }
}

thread_local! {
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's codec for `algorithm` and its scratch page.
pub(crate) fn with_codec<R>(
    algorithm: Algorithm,
    f: impl FnOnce(&mut dyn PageCodec, &mut [u8; PAGE_SIZE]) -> R,
) -> R {
    WORKER.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            let worker = match &mut *slot {
                Some(w) if w.algorithm == algorithm => w,
                other => other.insert(Worker::new(algorithm)),
            };
            f(worker.codec.as_mut(), &mut worker.scratch)
        }
        // Re-entered from inside `f` (never done by the store): use a one-off codec.
        Err(_) => {
            let mut w = Worker::new(algorithm);
            f(w.codec.as_mut(), &mut w.scratch)
        }
    })
}

thread_local! {
    /// Reused across `write_batch` calls: a batch output is `PAGE_SIZE` bytes per page, and
    /// allocating (and faulting in) 64 MiB per call cost more than the compression itself.
    static BATCH_OUTPUT: RefCell<BatchOutput> = RefCell::new(BatchOutput::default());
}

/// Runs `f` with this thread's batch output buffer (a fresh one if re-entered).
pub(crate) fn with_batch_output<R>(f: impl FnOnce(&mut BatchOutput) -> R) -> R {
    BATCH_OUTPUT.with(|cell| match cell.try_borrow_mut() {
        Ok(mut out) => f(&mut out),
        Err(_) => f(&mut BatchOutput::default()),
    })
}

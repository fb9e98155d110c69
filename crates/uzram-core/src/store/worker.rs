//! Per-thread codec reuse: each thread that writes or reads keeps one codec (and a scratch
//! page for compressed output), so the I/O path allocates nothing after a thread's first page.

use std::cell::RefCell;

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

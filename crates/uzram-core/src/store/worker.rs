//! Per-thread codec reuse: each thread that writes or reads keeps one codec (and a scratch
//! page for compressed output), so the I/O path allocates nothing after a thread's first page.
//! Threads that serve I/O create theirs before serving ([`crate::PageStore::prepare_thread`]),
//! so a failure to allocate a codec's state is an error at start, not on a request.

use std::cell::RefCell;

use crate::codec::{Algorithm, PageCodec};
use crate::page::PAGE_SIZE;
use crate::CoreError;

struct Worker {
    algorithm: Algorithm,
    codec: Box<dyn PageCodec>,
    scratch: Box<[u8; PAGE_SIZE]>,
}

impl Worker {
    fn new(algorithm: Algorithm) -> Result<Self, CoreError> {
        let codec = algorithm.try_codec().map_err(CoreError::Compress)?;
        let mut scratch = Vec::new();
        scratch
            .try_reserve_exact(PAGE_SIZE)
            .map_err(|_| CoreError::NoMemory)?;
        scratch.resize(PAGE_SIZE, 0u8);
        let scratch: Box<[u8; PAGE_SIZE]> = scratch
            .into_boxed_slice()
            .try_into()
            .map_err(|_| CoreError::NoMemory)?;
        Ok(Self {
            algorithm,
            codec,
            scratch,
        })
    }
}

thread_local! {
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
}

/// Creates this thread's codec for `algorithm` now, if it has none.
pub(crate) fn prepare(algorithm: Algorithm) -> Result<(), CoreError> {
    with_codec(algorithm, |_, _| Ok(()))
}

/// Runs `f` with this thread's codec for `algorithm` and its scratch page; the codec is
/// created on the thread's first use if [`prepare`] did not run.
pub(crate) fn with_codec<R>(
    algorithm: Algorithm,
    f: impl FnOnce(&mut dyn PageCodec, &mut [u8; PAGE_SIZE]) -> Result<R, CoreError>,
) -> Result<R, CoreError> {
    WORKER.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            let worker = match &mut *slot {
                Some(w) if w.algorithm == algorithm => w,
                other => other.insert(Worker::new(algorithm)?),
            };
            f(worker.codec.as_mut(), &mut worker.scratch)
        }
        // Re-entered from inside `f` (never done by the store): use a one-off codec.
        Err(_) => {
            let mut w = Worker::new(algorithm)?;
            f(w.codec.as_mut(), &mut w.scratch)
        }
    })
}

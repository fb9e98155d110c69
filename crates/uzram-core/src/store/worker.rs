//! Per-thread codec reuse: each thread that writes or reads keeps one codec (and a scratch
//! page for compressed output), so the I/O path allocates nothing after a thread's first page.
//! Threads that serve I/O create theirs before serving ([`crate::PageStore::prepare_thread`]),
//! so a failure to allocate a codec's state is an error at start, not on a request.

use std::cell::RefCell;

use crate::codec::{Algorithm, PageCodec, ZstdCodec};
use crate::page::PAGE_SIZE;
use crate::CoreError;

use super::write_batch::BATCH_PAGES;

/// The batch buffer's bytes: room to compress a page into (a page at most) after
/// `BATCH_PAGES - 1` pages that compressed to less than a page each. Not 64 KiB, which the
/// daemon's allocator serves from the store's block pool (`memory/pool.rs`): a thread's
/// scratch would hold a block of the store's reserve for good.
pub(crate) const BATCH_BYTES: usize = (BATCH_PAGES - 1) * (PAGE_SIZE - 1) + PAGE_SIZE;

struct Worker {
    algorithm: Algorithm,
    codec: Box<dyn PageCodec>,
    scratch: Box<[u8; PAGE_SIZE]>,
    /// Room for a batch's compressed pages (`write_batch.rs`), made with the codec.
    batch: Box<[u8]>,
}

impl Worker {
    fn new(algorithm: Algorithm) -> Result<Self, CoreError> {
        let codec = algorithm.try_codec().map_err(CoreError::Compress)?;
        Ok(Self {
            algorithm,
            codec,
            scratch: Self::scratch()?,
            batch: Self::batch()?,
        })
    }

    /// A zeroed buffer for [`BATCH_PAGES`] compressed pages, or `NoMemory`.
    fn batch() -> Result<Box<[u8]>, CoreError> {
        zeroed(BATCH_BYTES)
    }

    /// A zeroed page on the heap, or `NoMemory`.
    fn scratch() -> Result<Box<[u8; PAGE_SIZE]>, CoreError> {
        zeroed(PAGE_SIZE)?
            .try_into()
            .map_err(|_| CoreError::NoMemory)
    }
}

/// `len` zeroed bytes on the heap, or `NoMemory` (never an abort).
fn zeroed(len: usize) -> Result<Box<[u8]>, CoreError> {
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|_| CoreError::NoMemory)?;
    bytes.resize(len, 0u8);
    Ok(bytes.into_boxed_slice())
}

thread_local! {
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
    static RECOMPRESSED: RefCell<Option<Decoder>> = const { RefCell::new(None) };
}

/// A zstd decoder and a scratch page, for pages recompression rewrote (`tier.rs`); apart
/// from the thread's own codec, so that a read of one never replaces it.
struct Decoder {
    codec: ZstdCodec,
    scratch: Box<[u8; PAGE_SIZE]>,
}

/// Runs `f` with this thread's decoder of recompressed pages and its scratch page, made on
/// first use (threads that serve I/O make it before serving:
/// [`crate::PageStore::prepare_thread`]).
pub(crate) fn with_recompressed_decoder<R>(
    f: impl FnOnce(&mut dyn PageCodec, &mut [u8; PAGE_SIZE]) -> Result<R, CoreError>,
) -> Result<R, CoreError> {
    let make = || -> Result<Decoder, CoreError> {
        let codec = ZstdCodec::try_new(1).map_err(CoreError::Compress)?;
        Ok(Decoder {
            codec,
            scratch: Worker::scratch()?,
        })
    };
    RECOMPRESSED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            let d = match &mut *slot {
                Some(d) => d,
                none => none.insert(make()?),
            };
            f(&mut d.codec, &mut d.scratch)
        }
        Err(_) => {
            let mut d = make()?;
            f(&mut d.codec, &mut d.scratch)
        }
    })
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
    with_worker(algorithm, |w| f(w.codec.as_mut(), &mut w.scratch))
}

/// Runs `f` with this thread's codec for `algorithm` and its room for [`BATCH_PAGES`]
/// compressed pages ([`BATCH_BYTES`]), made as [`with_codec`] makes them.
pub(crate) fn with_batch_codec<R>(
    algorithm: Algorithm,
    f: impl FnOnce(&mut dyn PageCodec, &mut [u8]) -> Result<R, CoreError>,
) -> Result<R, CoreError> {
    with_worker(algorithm, |w| f(w.codec.as_mut(), &mut w.batch))
}

fn with_worker<R>(
    algorithm: Algorithm,
    f: impl FnOnce(&mut Worker) -> Result<R, CoreError>,
) -> Result<R, CoreError> {
    WORKER.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => {
            let worker = match &mut *slot {
                Some(w) if w.algorithm == algorithm => w,
                other => other.insert(Worker::new(algorithm)?),
            };
            f(worker)
        }
        // Re-entered from inside `f` (never done by the store): use a one-off codec.
        Err(_) => f(&mut Worker::new(algorithm)?),
    })
}

//! [`GpuBackend`]: the pipeline behind uzram-core's [`BatchBackend`] seam.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use tracing::warn;
use uzram_core::batch::{BatchBackend, BatchOutput, PageOutcome};
use uzram_core::codec::Algorithm;
use uzram_core::{CoreError, PAGE_SIZE};

use crate::layout::kernel_limit;
use crate::pipeline::{GpuStats, Pipeline, PipelineConfig};
use crate::GpuError;

/// Compresses batches of pages to LZ4 on a GPU. Batches larger than one slot are split
/// over the ring, so staging of one slot overlaps the GPU work of the others.
#[derive(Debug)]
pub struct GpuBackend {
    pipeline: Mutex<Pipeline>,
    device_name: String,
    /// Host threads for the copies into staging and out of the pinned results.
    host_threads: usize,
}

/// Most host threads used for the staging and result copies.
const MAX_HOST_THREADS: usize = 8;

impl GpuBackend {
    /// Opens the GPU and builds the pipeline. Errors of kind
    /// [`crate::ErrorKind::Unavailable`] mean: use the CPU.
    pub fn new(config: PipelineConfig) -> Result<Self, GpuError> {
        Self::from_pipeline(Pipeline::new(config)?)
    }

    /// A backend over a pipeline built by the caller (e.g. on a GPU opened with another
    /// kernel build).
    pub fn from_pipeline(pipeline: Pipeline) -> Result<Self, GpuError> {
        let host_threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_HOST_THREADS);
        Ok(Self {
            device_name: pipeline.gpu().name().to_string(),
            pipeline: Mutex::new(pipeline),
            host_threads,
        })
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Counters so far.
    pub fn stats(&self) -> GpuStats {
        self.lock().stats()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pipeline> {
        self.pipeline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Compresses `pages` (whole 4 KiB pages) into `out`: one outcome per page, blocks
    /// only where strictly shorter than `raw_threshold`.
    pub fn compress(
        &self,
        pages: &[u8],
        raw_threshold: usize,
        out: &mut BatchOutput,
    ) -> Result<(), GpuError> {
        if pages.len() % PAGE_SIZE != 0 {
            return Err(GpuError::Unaligned { len: pages.len() });
        }
        let n = pages.len() / PAGE_SIZE;
        out.reset(n);
        let mut pipe = self.lock();
        let result = run(
            &mut pipe,
            pages,
            kernel_limit(raw_threshold),
            out,
            self.host_threads,
        );
        if result.is_err() {
            // Leave no copy in flight into or out of buffers the next call reuses.
            let _ = pipe.drain();
        }
        result
    }
}

fn run(
    pipe: &mut Pipeline,
    pages: &[u8],
    limit: u32,
    out: &mut BatchOutput,
    threads: usize,
) -> Result<(), GpuError> {
    let batch = pipe.config().batch_pages;
    let slots = pipe.config().slots;
    let mut pending: VecDeque<(usize, usize)> = VecDeque::with_capacity(slots);
    for (ci, chunk) in pages.chunks(batch * PAGE_SIZE).enumerate() {
        let slot = ci % slots;
        if pipe.is_busy(slot) {
            // Start the copies back of finished slots before blocking on the oldest; a
            // failure there surfaces when that slot is harvested.
            let _ = pipe.advance();
            let (s, cj) = pending.pop_front().unwrap_or((slot, ci));
            harvest(pipe, s, cj * batch, out, threads)?;
        }
        par_copy(&mut pipe.staging_mut(slot)?[..chunk.len()], chunk, threads)?;
        pipe.submit_staged(slot, chunk.len() / PAGE_SIZE, limit)?;
        pending.push_back((slot, ci));
    }
    while let Some((s, cj)) = pending.pop_front() {
        let _ = pipe.advance();
        harvest(pipe, s, cj * batch, out, threads)?;
    }
    Ok(())
}

/// Pages per host thread below which one thread does the whole copy.
const MIN_PAGES_PER_THREAD: usize = 256;

/// `dst.copy_from_slice(src)` on up to `threads` threads.
fn par_copy(dst: &mut [u8], src: &[u8], threads: usize) -> Result<(), GpuError> {
    let per = src
        .len()
        .div_ceil(threads.max(1))
        .max(MIN_PAGES_PER_THREAD * PAGE_SIZE);
    if per >= src.len() {
        dst.copy_from_slice(src);
        return Ok(());
    }
    std::thread::scope(|s| {
        let workers: Vec<_> = dst
            .chunks_mut(per)
            .zip(src.chunks(per))
            .map(|(d, c)| s.spawn(move || d.copy_from_slice(c)))
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().map_err(|_| GpuError::HostWorker))
    })
}

/// Waits for `slot` and moves its results (pages `first..`) into `out`, on up to
/// `threads` threads.
fn harvest(
    pipe: &mut Pipeline,
    slot: usize,
    first: usize,
    out: &mut BatchOutput,
    threads: usize,
) -> Result<(), GpuError> {
    let res = pipe.wait(slot)?;
    let n = res.pages();
    let per = n.div_ceil(threads.max(1)).max(MIN_PAGES_PER_THREAD);
    let data = &mut out.data[first * PAGE_SIZE..(first + n) * PAGE_SIZE];
    let outcomes = &mut out.outcomes[first..first + n];
    let res = &res;
    let move_pages = move |base: usize, data: &mut [u8], outcomes: &mut [PageOutcome]| {
        for (j, (slot_out, o)) in data
            .chunks_exact_mut(PAGE_SIZE)
            .zip(outcomes.iter_mut())
            .enumerate()
        {
            let (outcome, block) = res.outcome(base + j)?;
            slot_out[..block.len()].copy_from_slice(block);
            *o = outcome;
        }
        Ok::<(), GpuError>(())
    };
    if per >= n {
        return move_pages(0, data, outcomes);
    }
    std::thread::scope(|s| {
        let workers: Vec<_> = data
            .chunks_mut(per * PAGE_SIZE)
            .zip(outcomes.chunks_mut(per))
            .enumerate()
            .map(|(t, (d, o))| s.spawn(move || move_pages(t * per, d, o)))
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().map_err(|_| GpuError::HostWorker)?)
    })
}

impl BatchBackend for GpuBackend {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }

    fn compress_batch(
        &self,
        pages: &[u8],
        raw_threshold: usize,
        out: &mut BatchOutput,
    ) -> Result<(), CoreError> {
        self.compress(pages, raw_threshold, out)
            .map_err(|e| to_core_error(&e))
    }
}

/// How a [`GpuError`] crosses the seam: caller bugs keep their meaning, everything else is
/// a backend failure that the store answers by compressing the batch on the CPU.
pub fn to_core_error(e: &GpuError) -> CoreError {
    match e {
        GpuError::Unaligned { len } => CoreError::Unaligned { len: *len },
        _ => {
            warn!(error = %e, kind = ?e.kind(), "GPU batch failed");
            CoreError::Backend {
                backend: "gpu",
                reason: error_chain(e),
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn par_copy_copies_every_byte_at_any_thread_count() {
        let src: Vec<u8> = (0..(3 * MIN_PAGES_PER_THREAD + 7) * PAGE_SIZE)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        for threads in [1, 2, 3, 8, 64] {
            let mut dst = vec![0u8; src.len()];
            par_copy(&mut dst, &src, threads).unwrap();
            assert!(dst == src, "threads {threads}");
        }
        let mut empty: [u8; 0] = [];
        par_copy(&mut empty, &[], 4).unwrap();
    }

    #[test]
    fn device_faults_become_backend_errors() {
        let e = GpuError::Driver {
            op: "cuStreamSynchronize",
            code: CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        };
        match to_core_error(&e) {
            CoreError::Backend { backend, reason } => {
                assert_eq!(backend, "gpu");
                assert!(reason.contains("cuStreamSynchronize"), "{reason}");
                assert!(reason.contains("ILLEGAL_ADDRESS"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            to_core_error(&GpuError::Unaligned { len: 3 }),
            CoreError::Unaligned { len: 3 }
        ));
    }
}

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
}

impl GpuBackend {
    /// Opens the GPU and builds the pipeline. Errors of kind
    /// [`crate::ErrorKind::Unavailable`] mean: use the CPU.
    pub fn new(config: PipelineConfig) -> Result<Self, GpuError> {
        let pipeline = Pipeline::new(config)?;
        Ok(Self {
            device_name: pipeline.gpu().name().to_string(),
            pipeline: Mutex::new(pipeline),
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
        let result = run(&mut pipe, pages, kernel_limit(raw_threshold), out);
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
) -> Result<(), GpuError> {
    let batch = pipe.config().batch_pages;
    let slots = pipe.config().slots;
    let mut pending: VecDeque<(usize, usize)> = VecDeque::with_capacity(slots);
    for (ci, chunk) in pages.chunks(batch * PAGE_SIZE).enumerate() {
        let slot = ci % slots;
        if pipe.is_busy(slot) {
            let (s, cj) = pending.pop_front().unwrap_or((slot, ci));
            harvest(pipe, s, cj * batch, out)?;
        }
        pipe.staging_mut(slot)?[..chunk.len()].copy_from_slice(chunk);
        pipe.submit_staged(slot, chunk.len() / PAGE_SIZE, limit)?;
        pending.push_back((slot, ci));
    }
    while let Some((s, cj)) = pending.pop_front() {
        harvest(pipe, s, cj * batch, out)?;
    }
    Ok(())
}

fn harvest(
    pipe: &mut Pipeline,
    slot: usize,
    first: usize,
    out: &mut BatchOutput,
) -> Result<(), GpuError> {
    let res = pipe.wait(slot)?;
    for j in 0..res.pages() {
        let i = first + j;
        let outcome = res.outcome(j)?;
        if let PageOutcome::Compressed(len) = outcome {
            let len = usize::from(len);
            out.data[i * PAGE_SIZE..i * PAGE_SIZE + len].copy_from_slice(&res.slot(j)[..len]);
        }
        out.outcomes[i] = outcome;
    }
    Ok(())
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

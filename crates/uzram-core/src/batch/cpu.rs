//! The CPU batch backend: splits a batch into one contiguous chunk per worker thread.

use std::num::NonZeroUsize;

use super::{BatchBackend, BatchOutput, PageOutcome};
use crate::codec::Algorithm;
use crate::page::{same_filled_word, PAGE_SIZE};
use crate::CoreError;

/// Compresses batches on `threads` CPU threads.
#[derive(Debug, Clone)]
pub struct CpuBackend {
    algorithm: Algorithm,
    threads: usize,
}

impl CpuBackend {
    /// A backend for `algorithm` on `threads` threads (`None`: every core).
    pub fn new(algorithm: Algorithm, threads: Option<NonZeroUsize>) -> Self {
        let threads = threads
            .or_else(|| std::thread::available_parallelism().ok())
            .map_or(1, NonZeroUsize::get);
        Self { algorithm, threads }
    }

    /// Worker threads per batch.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl BatchBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    fn compress_batch(
        &self,
        pages: &[u8],
        raw_threshold: usize,
        out: &mut BatchOutput,
    ) -> Result<(), CoreError> {
        if pages.len() % PAGE_SIZE != 0 {
            return Err(CoreError::Unaligned { len: pages.len() });
        }
        let n = pages.len() / PAGE_SIZE;
        out.reset(n);
        if n == 0 {
            return Ok(());
        }
        let threshold = raw_threshold.min(PAGE_SIZE);
        let per_thread = n.div_ceil(self.threads);
        let algorithm = self.algorithm;
        let chunks = pages
            .chunks(per_thread * PAGE_SIZE)
            .zip(out.data.chunks_mut(per_thread * PAGE_SIZE))
            .zip(out.outcomes.chunks_mut(per_thread));
        std::thread::scope(|s| {
            let workers: Vec<_> = chunks
                .map(|((input, data), outcomes)| {
                    s.spawn(move || compress_chunk(algorithm, threshold, input, data, outcomes))
                })
                .collect();
            // Join every worker before reporting the first error.
            let results: Vec<Result<(), CoreError>> = workers
                .into_iter()
                .map(|w| w.join().unwrap_or_else(|_| Err(worker_panicked())))
                .collect();
            results.into_iter().collect()
        })
    }
}

fn worker_panicked() -> CoreError {
    CoreError::Backend {
        backend: "cpu",
        reason: "a compression worker thread panicked".into(),
    }
}

fn compress_chunk(
    algorithm: Algorithm,
    threshold: usize,
    input: &[u8],
    data: &mut [u8],
    outcomes: &mut [PageOutcome],
) -> Result<(), CoreError> {
    let mut codec = algorithm.codec();
    for ((page, slot), outcome) in input
        .chunks_exact(PAGE_SIZE)
        .zip(data.chunks_exact_mut(PAGE_SIZE))
        .zip(outcomes.iter_mut())
    {
        let page: &[u8; PAGE_SIZE] = page
            .try_into()
            .map_err(|_| CoreError::Unaligned { len: page.len() })?;
        *outcome = if let Some(word) = same_filled_word(page) {
            PageOutcome::SameFilled(word)
        } else {
            match codec
                .compress(page, &mut slot[..threshold])
                .map_err(CoreError::Compress)?
            {
                Some(len) if len < threshold => PageOutcome::Compressed(len as u16),
                _ => PageOutcome::Raw,
            }
        };
    }
    Ok(())
}

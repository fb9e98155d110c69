//! Where a device's writes are compressed: inline on the queue threads (`cpu`), or in large
//! batches on an NVIDIA GPU through the write batcher (`gpu`, and `auto` when a GPU opens).
//!
//! With a GPU, a written page is stored raw at once and replaced by its compressed form
//! when its batch comes back (uzram-core's `WriteBatcher`, with a generation check), so reads
//! never wait for the GPU. A failed GPU batch is compressed by the CPU backend instead.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use uzram_core::batch::{BatchBackend, BatcherConfig, CpuBackend, DeferPolicy, WriteBatcher};
use uzram_core::store::PageStore;
use uzram_core::CoreError;
use uzram_gpu::{GpuBackend, PipelineConfig};

use super::io::PageWriter;
use crate::config::Backend;
use crate::control::proto::Stat;

/// Pages the batcher hands to the GPU at once: four of the pipeline's 4096-page slots, so
/// copies and kernels of consecutive slots overlap (docs/gpu-notes.md, run 3).
const GPU_BATCH_PAGES: usize = 16384;
/// Longest a written page waits for its batch to fill.
const GPU_MAX_DELAY: Duration = Duration::from_millis(2);
/// `auto`: pages waiting or being written before batching pays for the PCIe round trip.
/// Below this a swap-out burst is a few requests, which the queue threads compress faster
/// than a GPU round trip of a small batch completes.
const AUTO_MIN_BACKLOG_PAGES: usize = 512;

/// How the daemon compresses writes.
pub struct Compression {
    store: Arc<PageStore>,
    batcher: Option<WriteBatcher>,
    gpu: Option<Arc<GpuBackend>>,
}

impl Compression {
    /// Sets up the backend asked for. `gpu` fails when no GPU opens; `auto` then uses the CPU.
    pub fn start(store: Arc<PageStore>, asked: Backend) -> anyhow::Result<Self> {
        let policy = match asked {
            Backend::Cpu => None,
            Backend::Gpu => Some(DeferPolicy::Always),
            Backend::Auto => Some(DeferPolicy::Backlog {
                min_pages: AUTO_MIN_BACKLOG_PAGES,
            }),
        };
        let Some(policy) = policy else {
            return Ok(Self::cpu(store));
        };
        let gpu = match GpuBackend::new(PipelineConfig::default()) {
            Ok(gpu) => Arc::new(gpu),
            Err(err) if asked == Backend::Auto => {
                tracing::info!(error = %err, "no usable GPU: backend auto compresses on the CPU");
                return Ok(Self::cpu(store));
            }
            Err(err) => {
                return Err(anyhow::Error::new(err)
                    .context("opening the GPU for --backend gpu (use --backend cpu or auto)"))
            }
        };
        tracing::info!(
            gpu = gpu.device_name(),
            ?policy,
            "compressing writes on the GPU"
        );
        let fallback: Arc<dyn BatchBackend> = Arc::new(CpuBackend::new(store.algorithm(), None));
        let backend: Arc<dyn BatchBackend> = gpu.clone();
        let batcher = WriteBatcher::start(
            store.clone(),
            backend,
            fallback,
            BatcherConfig {
                batch_pages: GPU_BATCH_PAGES,
                max_delay: GPU_MAX_DELAY,
                policy,
            },
        )
        .context("starting the GPU write batcher")?;
        Ok(Self {
            store,
            batcher: Some(batcher),
            gpu: Some(gpu),
        })
    }

    fn cpu(store: Arc<PageStore>) -> Self {
        Self {
            store,
            batcher: None,
            gpu: None,
        }
    }

    /// The backend that serves writes: `cpu` or `gpu`.
    pub fn name(&self) -> &'static str {
        if self.gpu.is_some() {
            "gpu"
        } else {
            "cpu"
        }
    }

    /// Backend counters for `uzram status`; empty for the CPU backend.
    pub fn stats(&self) -> Vec<Stat> {
        let mut out = Vec::new();
        let mut put = |name: &str, value: u64| {
            out.push(Stat {
                name: name.to_string(),
                value,
            })
        };
        if let Some(b) = &self.batcher {
            let s = b.stats();
            put("batches", s.batches);
            put("batched_pages", s.batched_pages);
            put("inline_pages", s.inline_pages);
            put("backend_failures", s.backend_failures);
            put("fallback_batches", s.fallback_batches);
            put("left_raw_pages", s.left_raw_pages);
            put("stale_results", s.stale_results);
            put("backend_us", s.backend_ns / 1000);
        }
        if let Some(g) = &self.gpu {
            let s = g.stats();
            put("gpu_pages", s.pages);
            put("gpu_bytes_in", s.bytes_in);
            put("gpu_bytes_stored", s.bytes_stored);
            put("gpu_h2d_us", (s.h2d_ms * 1000.0) as u64);
            put("gpu_kernel_us", (s.kernel_ms * 1000.0) as u64);
            put("gpu_d2h_us", (s.d2h_ms * 1000.0) as u64);
        }
        out
    }
}

impl PageWriter for Compression {
    fn write_pages(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        match &self.batcher {
            Some(b) => b.write(first_page, data),
            None => self.store.write(first_page, data),
        }
    }
}

#[cfg(test)]
mod tests {
    use uzram_core::codec::Algorithm;
    use uzram_core::store::StoreConfig;

    use super::*;
    use crate::daemon::io::{handle_with, Op};

    fn store() -> Arc<PageStore> {
        Arc::new(PageStore::new(StoreConfig::new(64, Algorithm::Lz4)).unwrap())
    }

    #[test]
    fn cpu_and_auto_without_gpu_write_through_the_store() {
        for asked in [Backend::Cpu, Backend::Auto] {
            if asked == Backend::Auto && uzram_gpu::gpu_available() {
                eprintln!("skipping auto: this machine has a GPU");
                continue;
            }
            let s = store();
            let c = Compression::start(s.clone(), asked).unwrap();
            assert_eq!(c.name(), "cpu");
            assert!(c.stats().is_empty());
            let mut buf = b"uzram ".repeat(4096 * 2 / 6 + 1);
            buf.truncate(8192);
            let want = buf.clone();
            assert_eq!(handle_with(Op::Write, 8, 16, &mut buf, &s, &c), 8192);
            let mut back = vec![0u8; 8192];
            assert_eq!(handle_with(Op::Read, 8, 16, &mut back, &s, &c), 8192);
            assert_eq!(back, want);
        }
    }

    #[test]
    fn gpu_without_a_gpu_is_a_clear_error() {
        if uzram_gpu::gpu_available() {
            eprintln!("skipping: this machine has a GPU");
            return;
        }
        let err = Compression::start(store(), Backend::Gpu)
            .err()
            .expect("no GPU here");
        let text = format!("{err:#}");
        assert!(text.contains("--backend cpu or auto"), "{text}");
    }
}

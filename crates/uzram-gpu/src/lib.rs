//! uzram-gpu: compresses batches of 4 KiB pages to LZ4 on an NVIDIA GPU, behind
//! [`uzram_core::batch::BatchBackend`].
//!
//! - [`GpuBackend`]: the `BatchBackend` (`name() == "gpu"`).
//! - [`Pipeline`]: the ring of slots (pinned staging, device buffers, stream, events).
//! - [`gpu_available`] / [`probe`]: is there a driver and a GPU? Never panics.
//! - [`GpuError`] with [`GpuError::kind`]: fall back to the CPU, or a caller bug.
//!
//! libcuda is loaded at run time and the kernel ships as PTX built from
//! `kernels/lz4_compress.cu` (`scripts/gpu-ptx`), so this crate builds and tests on machines
//! without CUDA and runs where only the NVIDIA driver is installed.

mod backend;
pub mod driver;
mod error;
pub mod launch;
pub mod layout;
mod pipeline;
pub mod ptx;

pub use backend::{to_core_error, GpuBackend};
pub use driver::{gpu_available, probe, Gpu};
pub use error::{ErrorKind, GpuError};
pub use pipeline::{GpuStats, PinnedPages, Pipeline, PipelineConfig, SlotOutput};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_is_reported_not_panicked() {
        match probe() {
            Ok(n) => {
                eprintln!("this machine has {n} GPU(s); checking the backend opens");
                assert!(gpu_available());
                GpuBackend::new(PipelineConfig {
                    batch_pages: 64,
                    slots: 3,
                    device: 0,
                })
                .expect("GPU present but backend failed to open");
            }
            Err(e) => {
                eprintln!("no GPU here ({e}); checking the error is a clean fallback");
                assert!(!gpu_available());
                assert_eq!(e.kind(), ErrorKind::Unavailable);
                let err = GpuBackend::new(PipelineConfig::default()).unwrap_err();
                assert_eq!(err.kind(), ErrorKind::Unavailable);
            }
        }
    }
}

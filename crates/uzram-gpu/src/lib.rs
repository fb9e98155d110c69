//! uzram-gpu: compresses slots of 4 KiB pages to LZ4 on NVIDIA GPUs, behind uzram-core's
//! asynchronous [`uzram_core::batch::SlotBackend`] seam.
//!
//! - [`GpuSlots`]: the backend: pinned staging per slot, one captured graph per slot
//!   (copy in, compress, decode-and-compare every block, export the checked results to
//!   mapped host memory), slots spread over one or more GPUs.
//! - [`GpuConfig`] / [`Parse`]: the ring's shape and memory, and the `fast` or `high` parse.
//! - [`gpu_available`] / [`probe`]: is there a driver and a GPU? Never panics.
//! - [`NvcompZstd`]: NVIDIA nvCOMP's batched zstd behind the same seam, one slot, for the
//!   cold tier's recompressor (`zstd-gpu`); nvCOMP is loaded at run time ([`nvcomp`]).
//! - [`GpuDictLz4`]: LZ4 with an external dictionary (the device's trained one, up to
//!   [`MAX_DICT_BYTES`], as every block's prefix), one slot, for the cold tier's
//!   recompressor. It runs no check kernel: the store decodes every block on the CPU with
//!   the dictionary and compares it with the page before taking it, so nothing is trusted
//!   because the device wrote it.
//! - [`GpuError`] with [`GpuError::kind`]: fall back to the CPU, or a caller bug.
//!
//! libcuda is loaded at run time and the kernels ship as PTX built from `kernels/lz4.cu`
//! (`scripts/gpu-ptx`), so this crate builds and tests on machines without CUDA and runs
//! where only the NVIDIA driver is installed.

// Staging is written as little-endian words that the device copies as bytes.
#[cfg(target_endian = "big")]
compile_error!("uzram-gpu needs a little-endian host");

mod config;
mod dict_lz4;
pub mod driver;
mod error;
pub mod launch;
pub mod nvcomp;
mod nvcomp_zstd;
pub mod placement;
pub mod ptx;
mod slots;

pub use config::{GpuConfig, Parse};
pub use dict_lz4::{GpuDictLz4, MAX_DICT_BYTES};
pub use driver::{gpu_available, probe, Gpu, Kernel};
pub use error::{ErrorKind, GpuError};
pub use nvcomp_zstd::NvcompZstd;
pub use slots::{to_backend_error, GpuSlots, GpuStats};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_is_reported_not_panicked() {
        let small = GpuConfig {
            slots: 3,
            slot_pages: 64,
            ..GpuConfig::default()
        };
        match probe() {
            Ok(n) => {
                eprintln!("this machine has {n} GPU(s); checking the backend opens");
                assert!(gpu_available());
                GpuSlots::new(small).expect("GPU present but backend failed to open");
            }
            Err(e) => {
                eprintln!("no GPU here ({e}); checking the error is a clean fallback");
                assert!(!gpu_available());
                assert_eq!(e.kind(), ErrorKind::Unavailable);
                let err = GpuSlots::new(small).unwrap_err();
                assert_eq!(err.kind(), ErrorKind::Unavailable);
            }
        }
    }
}

//! [`GpuError`]: what can go wrong on the GPU path, and whether the caller should fall back
//! to the CPU ([`GpuError::kind`]).

use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

/// How a caller should react to a [`GpuError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// There is no usable GPU here (no driver library, no device, the driver cannot load
    /// our kernel). Use the CPU from now on.
    Unavailable,
    /// A CUDA operation failed while working (launch failure, illegal address, device
    /// lost, out of memory). Compress this batch on the CPU; the backend may stay broken.
    Fault,
    /// The caller broke the API's contract (a buffer that is not whole pages, a batch
    /// larger than the configured size, an invalid configuration). Retrying elsewhere will
    /// not help; this is a bug to fix.
    Usage,
}

impl ErrorKind {
    /// True when the work should be redone on the CPU.
    pub fn is_fallback(self) -> bool {
        matches!(self, ErrorKind::Unavailable | ErrorKind::Fault)
    }
}

/// Errors of the GPU backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// The driver is there but reports no device.
    #[error("the CUDA driver reports no GPU")]
    NoDevice,
    /// A CUDA driver call failed. (The code is shown by name: formatting cudarc's
    /// `DriverError` would call into libcuda.)
    #[error("CUDA call {op} failed with {code:?}")]
    Driver {
        /// The operation that failed (`cuMemcpyHtoDAsync`, `cuLaunchKernel`, ...).
        op: &'static str,
        /// The driver's result code.
        code: CUresult,
    },
    /// An earlier device fault left the CUDA context unusable.
    #[error("the GPU backend is unusable after an earlier device fault")]
    Poisoned,
    /// The kernel reported a block length it cannot have produced (a kernel bug).
    #[error("page {page} of a batch came back with an impossible length {len}")]
    BadLength {
        /// Page index within the batch.
        page: usize,
        /// The length word the kernel wrote.
        len: u32,
    },
    /// A host thread copying pages to or from pinned memory panicked (a bug).
    #[error("a host copy thread panicked")]
    HostWorker,
    /// The input is not a whole number of 4 KiB pages.
    #[error("input of {len} bytes is not a whole number of 4096-byte pages")]
    Unaligned {
        /// The input's length.
        len: usize,
    },
    /// A configuration value is out of range.
    #[error("invalid GPU pipeline configuration: {0}")]
    Config(String),
    /// NVIDIA nvCOMP 6 could not be loaded.
    #[error(
        "NVIDIA nvCOMP 6 is not installed where the loader finds it ({0}): install it \
         (NVIDIA's packages, or the nvidia-libnvcomp-cu13 Python wheel) and make \
         libnvcomp.so.6 visible to the loader (ldconfig, or LD_LIBRARY_PATH)"
    )]
    NoNvcomp(String),
    /// An nvCOMP call failed.
    #[error("nvCOMP call {call} failed with status {status}{}", nvcomp_hint(*status))]
    Nvcomp {
        /// The call, without its `nvcompBatched` prefix.
        call: &'static str,
        /// Its `nvcompStatus_t`.
        status: i32,
    },
}

impl GpuError {
    /// Wraps a failed driver call.
    pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> GpuError {
        move |e| GpuError::Driver { op, code: e.0 }
    }

    /// How the caller should react.
    pub fn kind(&self) -> ErrorKind {
        match self {
            GpuError::NoDriver | GpuError::NoDevice | GpuError::NoNvcomp(_) => {
                ErrorKind::Unavailable
            }
            GpuError::Nvcomp { .. } => ErrorKind::Fault,
            GpuError::Driver { code, .. } => driver_kind(*code),
            GpuError::Poisoned | GpuError::BadLength { .. } | GpuError::HostWorker => {
                ErrorKind::Fault
            }
            GpuError::Unaligned { .. } | GpuError::Config(_) => ErrorKind::Usage,
        }
    }

    /// True when the failed error leaves the CUDA context unusable (a "sticky" error):
    /// every later call in this process fails too.
    pub fn is_sticky(&self) -> bool {
        match self {
            GpuError::Driver { code, .. } => is_sticky(*code),
            GpuError::Poisoned => true,
            _ => false,
        }
    }
}

/// What an nvCOMP status says beyond its number.
fn nvcomp_hint(status: i32) -> &'static str {
    match status {
        // nvcompErrorCudaError: nvCOMP's own CUDA runtime (CUDA 13) failed.
        1000 => " (a CUDA error in nvCOMP: is the NVIDIA driver new enough for CUDA 13?)",
        _ => "",
    }
}

fn driver_kind(code: CUresult) -> ErrorKind {
    match code {
        CUresult::CUDA_ERROR_NO_DEVICE
        | CUresult::CUDA_ERROR_NOT_INITIALIZED
        | CUresult::CUDA_ERROR_INVALID_DEVICE
        | CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
        | CUresult::CUDA_ERROR_INVALID_PTX
        | CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        | CUresult::CUDA_ERROR_JIT_COMPILER_NOT_FOUND
        | CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
        | CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE
        | CUresult::CUDA_ERROR_SYSTEM_NOT_READY => ErrorKind::Unavailable,
        // Everything else a driver call can report while we work (launch failures,
        // illegal addresses, ECC errors, out of memory, a lost device) is a fault of
        // this batch on this GPU: the CPU can still do the work.
        _ => ErrorKind::Fault,
    }
}

/// Errors after which the context is corrupt and must be torn down (CUDA docs: "the
/// process must be terminated and relaunched" / "context cannot be used").
fn is_sticky(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            | CUresult::CUDA_ERROR_LAUNCH_FAILED
            | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUresult::CUDA_ERROR_MISALIGNED_ADDRESS
            | CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUresult::CUDA_ERROR_INVALID_PC
            | CUresult::CUDA_ERROR_ECC_UNCORRECTABLE
            | CUresult::CUDA_ERROR_ASSERT
            | CUresult::CUDA_ERROR_LAUNCH_TIMEOUT
            | CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
            | CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drv(code: CUresult) -> GpuError {
        GpuError::Driver { op: "test", code }
    }

    #[test]
    fn device_faults_fall_back_to_cpu() {
        for code in [
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            CUresult::CUDA_ERROR_LAUNCH_FAILED,
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
            CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        ] {
            let e = drv(code);
            assert_eq!(e.kind(), ErrorKind::Fault, "{code:?}");
            assert!(e.kind().is_fallback());
        }
        assert!(drv(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS).is_sticky());
        assert!(!drv(CUresult::CUDA_ERROR_OUT_OF_MEMORY).is_sticky());
        // CUDA: after a watchdog's timeout "the context cannot be used".
        assert!(drv(CUresult::CUDA_ERROR_LAUNCH_TIMEOUT).is_sticky());
        assert!(GpuError::Poisoned.kind().is_fallback());
    }

    #[test]
    fn missing_gpu_is_unavailable() {
        assert_eq!(GpuError::NoDriver.kind(), ErrorKind::Unavailable);
        assert_eq!(GpuError::NoDevice.kind(), ErrorKind::Unavailable);
        assert_eq!(
            drv(CUresult::CUDA_ERROR_NO_DEVICE).kind(),
            ErrorKind::Unavailable
        );
        assert_eq!(
            drv(CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION).kind(),
            ErrorKind::Unavailable
        );
        assert!(ErrorKind::Unavailable.is_fallback());
    }

    #[test]
    fn caller_bugs_are_not_retried() {
        let e = GpuError::Unaligned { len: 5 };
        assert_eq!(e.kind(), ErrorKind::Usage);
        assert!(!e.kind().is_fallback());
        assert!(!GpuError::Config("x".into()).kind().is_fallback());
    }
}

//! The copy engine as a slot's [`Placer`]: runs of a slot's checked blocks copied from its
//! device buffer straight into the store's memory, one `cuMemcpyBatchAsync` a slot, so that
//! the installers do not copy them (`uzram_core::batch` `place.rs` has the contract).
//!
//! The store's memory must be registered with the driver for the copy engine to write it
//! without the CPU ([`register_host`]); the daemon registers its block pool's memory as the
//! pool faults it in, and tells the backend which memory that is ([`Reach`]). A run outside
//! it is left to the installers.
//!
//! Measured (runs 301-302, `scripts/probe-arena-copy-engine`): one batched call a slot costs
//! the host 0.003 CPU-s per GiB of pages, against 0.05-0.08 for the installers' copy.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use uzram_core::batch::{offset_within, PlaceRun, Placer};

use crate::driver::{Event, Gpu, HostBuf, Stream};
use crate::GpuError;

/// Which host memory the copy engine may write: whether a range (`address`, `bytes`) is
/// registered with every GPU.
#[derive(Clone)]
pub struct Reach(Arc<dyn Fn(usize, usize) -> bool + Send + Sync>);

impl Reach {
    /// Memory for which `covers(address, bytes)` holds.
    pub fn new(covers: impl Fn(usize, usize) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(covers))
    }

    fn covers(&self, address: usize, bytes: usize) -> bool {
        (self.0)(address, bytes)
    }
}

impl std::fmt::Debug for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reach")
    }
}

/// Whether this driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later). Never panics.
pub fn batch_copy_available() -> bool {
    // SAFETY: looks the symbol up in the already loaded libcuda; calls nothing.
    unsafe {
        sys::is_culib_present()
            && sys::culib()
                .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync\0")
                .is_ok()
    }
}

/// Registers `bytes` of host memory at `address` with every context of this process
/// (`CU_MEMHOSTREGISTER_PORTABLE`): page-locked, and a target of the copy engines from then
/// on, for the rest of the process.
///
/// # Safety
/// The range must be mapped memory of this process that stays mapped, and is never given
/// back to the system (punched out), for the rest of the process: the device keeps writing
/// the pages it was registered with.
pub unsafe fn register_host(gpu: &Gpu, address: usize, bytes: usize) -> Result<(), GpuError> {
    gpu.bind()?;
    // SAFETY: as the caller guarantees.
    unsafe {
        sys::cuMemHostRegister_v2(
            address as *mut c_void,
            bytes,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    }
    .result()
    .map_err(GpuError::driver("cuMemHostRegister"))
}

/// One completed slot's copy engine: see the module docs.
pub(crate) struct SlotPlacer<'a> {
    pub gpu: &'a Gpu,
    pub stream: &'a Stream,
    /// Recorded after the copies, waited on (a blocking event: the installer sleeps).
    pub done: &'a Event,
    /// The slot's packed results on the device.
    pub packed: CUdeviceptr,
    /// The host's copy of them.
    pub out_packed: &'a HostBuf,
    pub reach: &'a Reach,
    pub device: i32,
    /// Failed calls, for the backend's stats.
    pub failures: &'a AtomicU64,
}

impl Placer for SlotPlacer<'_> {
    fn packed_offset(&self, bytes: &[u8]) -> Option<usize> {
        offset_within(self.out_packed.as_slice(), bytes)
    }

    fn reaches(&self, to: &[AtomicU64]) -> bool {
        self.reach
            .covers(to.as_ptr() as usize, std::mem::size_of_val(to))
    }

    fn place(&self, runs: &[PlaceRun<'_>]) -> bool {
        match self.copy(runs) {
            Ok(()) => true,
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "placing compressed pages with the copy engine failed");
                // Nothing may still be copying when the installers write those objects.
                let _ = self.stream.synchronize();
                false
            }
        }
    }
}

impl SlotPlacer<'_> {
    fn copy(&self, runs: &[PlaceRun<'_>]) -> Result<(), GpuError> {
        let packed_len = self.out_packed.len();
        let mut dsts: Vec<CUdeviceptr> = Vec::new();
        let mut srcs: Vec<CUdeviceptr> = Vec::new();
        let mut sizes: Vec<usize> = Vec::new();
        for v in [&mut dsts, &mut srcs] {
            v.try_reserve_exact(runs.len())
                .map_err(|_| GpuError::Config("no memory for the copy list".into()))?;
        }
        sizes
            .try_reserve_exact(runs.len())
            .map_err(|_| GpuError::Config("no memory for the copy list".into()))?;
        for r in runs {
            // Only the slot's own packed bytes are read.
            if r.from
                .checked_add(r.len())
                .is_none_or(|end| end > packed_len)
            {
                return Err(GpuError::Config(format!(
                    "a placement of {} bytes at {} past {packed_len} packed bytes",
                    r.len(),
                    r.from
                )));
            }
            dsts.push(r.to.as_ptr() as CUdeviceptr);
            srcs.push(self.packed + r.from as CUdeviceptr);
            sizes.push(r.len());
        }
        let attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device,
            },
            dstLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
            flags: 0,
        };
        let mut attrs = [attrs];
        let mut attr_at = [0usize];
        let mut fail_at = usize::MAX;
        self.gpu.bind()?;
        // SAFETY: every source lies in the slot's device buffer of packed results (checked
        // above), which nothing writes until the slot is submitted again, after this
        // returns; every destination is store memory the caller reserved for these objects
        // and registered with the driver (`reaches`), which nothing else touches until they
        // are published; the arrays outlive the call (the driver reads them during it).
        unsafe {
            sys::cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                runs.len(),
                attrs.as_mut_ptr(),
                attr_at.as_mut_ptr(),
                1,
                &mut fail_at,
                self.stream.raw(),
            )
        }
        .result()
        .map_err(GpuError::driver("cuMemcpyBatchAsync"))?;
        self.done.record(self.stream)?;
        self.done.synchronize()
    }
}

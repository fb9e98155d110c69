//! RAII wrappers over the few CUDA driver objects uzram uses: the device with our kernel
//! loaded ([`Gpu`]), pinned host memory ([`HostBuf`]), device memory ([`DevBuf`]), streams
//! and events. libcuda is loaded at run time (cudarc `dynamic-loading`), so nothing here
//! needs CUDA at build time.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::result::{self, stream::StreamKind};
use cudarc::driver::sys::{self, CUdeviceptr, CUevent, CUfunction, CUmodule, CUresult, CUstream};
use cudarc::driver::{CudaContext, DriverError};
use tracing::warn;

use crate::ptx;
use crate::GpuError;

/// True when libcuda loads and reports at least one GPU. Never panics.
pub fn gpu_available() -> bool {
    probe().is_ok()
}

/// Why [`gpu_available`] is false, or the number of GPUs.
pub fn probe() -> Result<usize, GpuError> {
    // SAFETY: only tries to dlopen libcuda by its usual names; it calls nothing in it.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    result::init().map_err(no_device_or(GpuError::driver("cuInit")))?;
    match result::device::get_count().map_err(GpuError::driver("cuDeviceGetCount"))? {
        n if n > 0 => Ok(n as usize),
        _ => Err(GpuError::NoDevice),
    }
}

fn no_device_or(
    other: impl FnOnce(DriverError) -> GpuError,
) -> impl FnOnce(DriverError) -> GpuError {
    move |e| {
        if e.0 == CUresult::CUDA_ERROR_NO_DEVICE {
            GpuError::NoDevice
        } else {
            other(e)
        }
    }
}

/// One GPU's context with the compression kernel loaded.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    module: CUmodule,
    function: CUfunction,
    name: String,
    sm_count: u32,
}

// SAFETY: CUDA module and function handles are plain handles into the driver, valid from
// any thread that binds the context; every method here binds it first (`bind`).
unsafe impl Send for Gpu {}
// SAFETY: as for Send; the driver serializes concurrent calls on the same context itself.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens GPU `ordinal` and loads the embedded PTX (the driver compiles it for this GPU).
    pub fn open(ordinal: usize) -> Result<Arc<Self>, GpuError> {
        Self::open_with_ptx(ordinal, ptx::PTX)
    }

    /// Opens GPU `ordinal` with another build of the kernel (kernel development: compare
    /// variants with the benchmark). `ptx` must define `uzram_lz4_compress` with the
    /// embedded kernel's signature and output contract.
    pub fn open_with_ptx(ordinal: usize, ptx: &str) -> Result<Arc<Self>, GpuError> {
        let ptx = CString::new(ptx.trim_end_matches('\0'))
            .map_err(|_| GpuError::Config("PTX text contains a NUL byte".into()))?;
        let count = probe()?;
        if ordinal >= count {
            return Err(GpuError::Config(format!(
                "GPU {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(no_device_or(GpuError::driver("cuCtx")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(GpuError::driver("cuDeviceGetAttribute"))?;
        // SAFETY: `ptx` is a NUL-terminated C string that outlives the call; the context is
        // bound to this thread by CudaContext::new.
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }
            .map_err(GpuError::driver("cuModuleLoadData"))?;
        let kernel =
            CString::new(ptx::KERNEL).map_err(|_| GpuError::Config("kernel name".into()))?;
        // SAFETY: `module` was just loaded and is not unloaded before `Gpu` drops.
        let function = match unsafe { result::module::get_function(module, kernel) } {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: the module was loaded above and nothing else refers to it.
                let _ = unsafe { result::module::unload(module) };
                return Err(GpuError::driver("cuModuleGetFunction")(e));
            }
        };
        Ok(Arc::new(Self {
            ctx,
            module,
            function,
            name,
            sm_count: sm_count.max(1) as u32,
        }))
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<(), GpuError> {
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::driver("cuCtxSetCurrent"))
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    pub(crate) fn function(&self) -> CUfunction {
        self.function
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: the module was loaded in `open`; every stream and buffer that used it
            // holds an `Arc<Gpu>`, so none is alive any more.
            if let Err(e) = unsafe { result::module::unload(self.module) } {
                warn!(error = %e, "cuModuleUnload failed");
            }
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): the only memory the GPU copies at full speed.
#[derive(Debug)]
pub struct HostBuf {
    ptr: *mut u8,
    len: usize,
    gpu: Arc<Gpu>,
}

// SAFETY: the buffer is plain memory owned by this value; the raw pointer is only an address.
unsafe impl Send for HostBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// Allocates `len` zeroed bytes of pinned host memory.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self, GpuError> {
        gpu.bind()?;
        // SAFETY: the context is bound; flags 0 asks for ordinary cached pinned memory
        // (write-combined memory would make host reads of results very slow).
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(GpuError::driver("cuMemHostAlloc"))?
            .cast::<u8>();
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Self {
            ptr,
            len,
            gpu: gpu.clone(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes. The caller must not read while a device copy into this buffer is in
    /// flight (the pipeline only hands it out for idle slots).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable (same rule as `as_slice`).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `new`; owners drop buffers only after
            // the streams that used them were synchronized.
            if let Err(e) = unsafe { result::free_host(self.ptr.cast::<c_void>()) } {
                warn!(error = %e, "cuMemFreeHost failed");
            }
        }
    }
}

/// Device memory (`cuMemAlloc`).
#[derive(Debug)]
pub struct DevBuf {
    ptr: CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
}

impl DevBuf {
    /// Allocates `len` bytes of device memory.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self, GpuError> {
        gpu.bind()?;
        // SAFETY: the context is bound.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(GpuError::driver("cuMemAlloc"))?;
        Ok(Self {
            ptr,
            len,
            gpu: gpu.clone(),
        })
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `new`; owners synchronize the streams that
            // used it before dropping it.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                warn!(error = %e, "cuMemFree failed");
            }
        }
    }
}

/// A non-blocking CUDA stream.
#[derive(Debug)]
pub struct Stream {
    raw: CUstream,
    gpu: Arc<Gpu>,
}

// SAFETY: a stream handle may be used from any thread that binds its context; `gpu.bind()`
// precedes every use.
unsafe impl Send for Stream {}
// SAFETY: as for Send; the driver serializes work submission on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream that does not synchronize with the legacy default stream.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self, GpuError> {
        gpu.bind()?;
        let raw = result::stream::create(StreamKind::NonBlocking)
            .map_err(GpuError::driver("cuStreamCreate"))?;
        Ok(Self {
            raw,
            gpu: gpu.clone(),
        })
    }

    /// The raw handle.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Waits until all work queued on the stream is done.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: `raw` is a live stream of the bound context.
        unsafe { result::stream::synchronize(self.raw) }
            .map_err(GpuError::driver("cuStreamSynchronize"))
    }

    /// Queues a copy of `src` into device memory at `dst`.
    ///
    /// # Safety
    /// `dst` must have room for `src.len()` bytes, and `src` (pinned memory, for the copy
    /// to be asynchronous) must stay alive and unchanged until the stream reaches this copy.
    pub unsafe fn copy_to_device(&self, dst: CUdeviceptr, src: &[u8]) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: the caller keeps `src` alive and `dst` large enough.
        unsafe { result::memcpy_htod_async(dst, src, self.raw) }
            .map_err(GpuError::driver("cuMemcpyHtoDAsync"))
    }

    /// Queues a copy of `dst.len()` bytes from device memory at `src` into `dst`.
    ///
    /// # Safety
    /// `src` must hold `dst.len()` bytes, and `dst` (pinned) must stay alive and must not be
    /// read until the stream reaches this copy.
    pub unsafe fn copy_to_host(&self, dst: &mut [u8], src: CUdeviceptr) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: the caller keeps `dst` alive and unread until completion.
        unsafe { result::memcpy_dtoh_async(dst, src, self.raw) }
            .map_err(GpuError::driver("cuMemcpyDtoHAsync"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `raw` was created in `new` and is destroyed once; destroying a stream
            // with pending work lets that work finish first (CUDA docs).
            if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
                warn!(error = %e, "cuStreamDestroy failed");
            }
        }
    }
}

/// A CUDA event with timing.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    gpu: Arc<Gpu>,
}

// SAFETY: event handles may be used from any thread that binds the context.
unsafe impl Send for Event {}
// SAFETY: as for Send.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event that records time.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self, GpuError> {
        gpu.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(GpuError::driver("cuEventCreate"))?;
        Ok(Self {
            raw,
            gpu: gpu.clone(),
        })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: both handles are live objects of the bound context.
        unsafe { result::event::record(self.raw, stream.raw) }
            .map_err(GpuError::driver("cuEventRecord"))
    }

    /// Waits until the work before the event's record point is done.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: `raw` is a live event.
        unsafe { result::event::synchronize(self.raw) }
            .map_err(GpuError::driver("cuEventSynchronize"))
    }

    /// True once the work before the event's record point is done; does not block.
    pub fn is_done(&self) -> Result<bool, GpuError> {
        self.gpu.bind()?;
        // SAFETY: `raw` is a live event.
        match unsafe { result::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(GpuError::driver("cuEventQuery")(e)),
        }
    }

    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, GpuError> {
        self.gpu.bind()?;
        // SAFETY: both are live events of the same context.
        unsafe { result::event::elapsed(self.raw, end.raw) }
            .map_err(GpuError::driver("cuEventElapsedTime"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once.
            if let Err(e) = unsafe { result::event::destroy(self.raw) } {
                warn!(error = %e, "cuEventDestroy failed");
            }
        }
    }
}

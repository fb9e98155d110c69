//! RAII wrappers over the few CUDA driver objects uzram uses: the device with our kernels
//! loaded ([`Gpu`]), pinned host memory ([`HostBuf`], [`PinnedWords`]), device memory
//! ([`DevBuf`]), streams, events and captured graphs ([`GraphExec`]). libcuda is loaded at
//! run time (cudarc `dynamic-loading`), so nothing here needs CUDA at build time.

use std::ffi::{c_void, CString};
use std::sync::atomic::AtomicU64;
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

/// The kernels of the embedded module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// LZ4 with every position tested and two lazy steps (`uzram_lz4_fast`).
    Fast,
    /// LZ4 with a deeper match search (`uzram_lz4_high`).
    High,
    /// Decode-and-compare of every block, and its export to the host (`uzram_lz4_verify`).
    Verify,
    /// LZ4 with an external dictionary as the blocks' prefix (`uzram_lz4_dict`), for
    /// [`crate::GpuDictLz4`]; its output contract is its own (see the kernel).
    Dict,
    /// The dictionary's hash chains, once per dictionary (`uzram_lz4_dict_chains`).
    DictChains,
}

impl Kernel {
    /// Every kernel, in the order of their index.
    pub const ALL: [Kernel; 5] = [
        Kernel::Fast,
        Kernel::High,
        Kernel::Verify,
        Kernel::Dict,
        Kernel::DictChains,
    ];
}

impl Kernel {
    /// The kernel's entry point in the PTX.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::Fast => "uzram_lz4_fast",
            Kernel::High => "uzram_lz4_high",
            Kernel::Verify => "uzram_lz4_verify",
            Kernel::Dict => "uzram_lz4_dict",
            Kernel::DictChains => "uzram_lz4_dict_chains",
        }
    }
}

/// One GPU's context, with the compression kernels loaded ([`Gpu::open`]) or without
/// ([`Gpu::open_context`], for a library that brings its own kernels).
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    module: Option<CUmodule>,
    /// Indexed like [`Kernel`]; `None` where the module lacks that entry point.
    functions: [Option<CUfunction>; Kernel::ALL.len()],
    /// Indexed like [`Kernel`]: the block size each function declares (its launch bound),
    /// read once here rather than at every launch.
    declared_threads: [Option<u32>; Kernel::ALL.len()],
    ordinal: usize,
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

    /// Opens GPU `ordinal` with another build of the kernels (kernel development: compare
    /// variants with the benchmark). `ptx` must define the entry points of [`Kernel`] it
    /// is used with, with the embedded kernels' signatures and output contract.
    pub fn open_with_ptx(ordinal: usize, ptx: &str) -> Result<Arc<Self>, GpuError> {
        let ptx = CString::new(ptx.trim_end_matches('\0'))
            .map_err(|_| GpuError::Config("PTX text contains a NUL byte".into()))?;
        let mut gpu = Self::context(ordinal)?;
        // SAFETY: `ptx` is a NUL-terminated C string that outlives the call; the context is
        // bound to this thread by CudaContext::new.
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }
            .map_err(GpuError::driver("cuModuleLoadData"))?;
        // From here `gpu` owns the module: every error below unloads it as `gpu` drops.
        gpu.module = Some(module);
        for (slot, kernel) in gpu.functions.iter_mut().zip(Kernel::ALL) {
            let entry =
                CString::new(kernel.entry()).map_err(|_| GpuError::Config("kernel name".into()))?;
            // SAFETY: `module` was just loaded and is not unloaded before `Gpu` drops.
            *slot = unsafe { result::module::get_function(module, entry) }.ok();
        }
        for (slot, f) in gpu.declared_threads.iter_mut().zip(gpu.functions) {
            let Some(f) = f else { continue };
            // SAFETY: `f` is a function of the module loaded above.
            let threads = unsafe {
                result::function::get_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                )
            }
            .map_err(GpuError::driver("cuFuncGetAttribute"))?;
            *slot = u32::try_from(threads).ok();
        }
        if gpu.function(Kernel::Fast).is_none() || gpu.function(Kernel::Verify).is_none() {
            return Err(GpuError::Config(format!(
                "the PTX lacks {} or {}",
                Kernel::Fast.entry(),
                Kernel::Verify.entry()
            )));
        }
        Ok(Arc::new(gpu))
    }

    /// Opens GPU `ordinal` without loading uzram's kernels: the context alone, for work
    /// that launches none of them (nvCOMP's), so that none is compiled for nothing.
    /// [`Gpu::function`] is `None` for every kernel.
    pub fn open_context(ordinal: usize) -> Result<Arc<Self>, GpuError> {
        Self::context(ordinal).map(Arc::new)
    }

    /// The context of GPU `ordinal`, bound to this thread, no module loaded.
    fn context(ordinal: usize) -> Result<Self, GpuError> {
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
        Ok(Self {
            ctx,
            module: None,
            functions: [None; Kernel::ALL.len()],
            declared_threads: [None; Kernel::ALL.len()],
            ordinal,
            name,
            sm_count: sm_count.max(1) as u32,
        })
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

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The kernel's function, if the loaded module has it.
    pub fn function(&self, kernel: Kernel) -> Option<CUfunction> {
        self.functions[kernel as usize]
    }

    /// The most threads a block the kernel's function takes (its launch bound), if the
    /// loaded module has it.
    pub fn declared_threads(&self, kernel: Kernel) -> Option<u32> {
        self.declared_threads[kernel as usize]
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let Some(module) = self.module else { return };
        if self.bind().is_ok() {
            // SAFETY: the module was loaded in `open_with_ptx` and is this value's alone;
            // every stream and buffer that used it holds an `Arc<Gpu>`, so none is alive any
            // more (and on `open_with_ptx`'s error paths none was made).
            if let Err(e) = unsafe { result::module::unload(module) } {
                warn!(error = %e, "cuModuleUnload failed");
            }
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): the only memory the GPU copies at full speed.
/// A mapped buffer ([`HostBuf::mapped`]) is also addressable from kernels, which write
/// results into it directly.
#[derive(Debug)]
pub struct HostBuf {
    ptr: *mut u8,
    len: usize,
    device_ptr: Option<CUdeviceptr>,
    gpu: Arc<Gpu>,
}

// SAFETY: the buffer is plain memory owned by this value; the raw pointer is only an address.
unsafe impl Send for HostBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// Allocates `len` zeroed bytes of pinned host memory.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self, GpuError> {
        Self::alloc(gpu, len, false)
    }

    /// Allocates `len` zeroed bytes of pinned host memory that kernels can also address
    /// ([`HostBuf::device_ptr`]).
    pub fn mapped(gpu: &Arc<Gpu>, len: usize) -> Result<Self, GpuError> {
        Self::alloc(gpu, len, true)
    }

    fn alloc(gpu: &Arc<Gpu>, len: usize, mapped: bool) -> Result<Self, GpuError> {
        gpu.bind()?;
        let flags = if mapped {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            0
        };
        // SAFETY: the context is bound; the flags ask for ordinary cached pinned memory,
        // mapped or not (write-combined memory would make host reads of results very slow).
        let ptr = unsafe { result::malloc_host(len.max(1), flags) }
            .map_err(GpuError::driver("cuMemHostAlloc"))?
            .cast::<u8>();
        let mut buf = Self {
            ptr,
            len,
            device_ptr: None,
            gpu: gpu.clone(),
        };
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        if mapped {
            let mut dptr: CUdeviceptr = 0;
            // SAFETY: `ptr` was allocated with CU_MEMHOSTALLOC_DEVICEMAP in the bound
            // context; flags must be 0; `dptr` is a valid out-pointer.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0) }
                .result()
                .map_err(GpuError::driver("cuMemHostGetDevicePointer"))?;
            buf.device_ptr = Some(dptr);
        }
        Ok(buf)
    }

    /// The address kernels use for a mapped buffer.
    pub fn device_ptr(&self) -> Option<CUdeviceptr> {
        self.device_ptr
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

/// Pinned host memory seen from Rust only as atomic words: the staging of a slot, which
/// writer threads fill, reader threads copy from and the device reads (by DMA) without
/// any lock among them. Allocated by the driver, or memory the caller keeps (a shared
/// memory segment that outlives the process) registered with it.
#[derive(Debug)]
pub struct PinnedWords {
    mem: Pinned,
}

#[derive(Debug)]
enum Pinned {
    Own(HostBuf),
    Registered {
        words: &'static [AtomicU64],
        gpu: Arc<Gpu>,
    },
}

impl PinnedWords {
    /// `words` zeroed pinned words.
    pub fn new(gpu: &Arc<Gpu>, words: usize) -> Result<Self, GpuError> {
        Ok(Self {
            mem: Pinned::Own(HostBuf::new(gpu, words * 8)?),
        })
    }

    /// The caller's `words`, page-locked and registered with `gpu`'s context
    /// (`cuMemHostRegister`) until this value is dropped. They must start on a page.
    pub fn register(gpu: &Arc<Gpu>, words: &'static [AtomicU64]) -> Result<Self, GpuError> {
        if !(words.as_ptr() as usize).is_multiple_of(4096) {
            return Err(GpuError::Config(
                "staging to register must start on a page".into(),
            ));
        }
        gpu.bind()?;
        // SAFETY: the range is `words`, memory of this process that lives for the rest of
        // it ('static); flags 0: page-locked for this context, not mapped. The device only
        // reads it (copies queued after the writes were made).
        unsafe {
            sys::cuMemHostRegister_v2(
                words.as_ptr() as *mut c_void,
                std::mem::size_of_val(words),
                0,
            )
        }
        .result()
        .map_err(GpuError::driver("cuMemHostRegister"))?;
        Ok(Self {
            mem: Pinned::Registered {
                words,
                gpu: gpu.clone(),
            },
        })
    }

    /// The words.
    pub fn words(&self) -> &[AtomicU64] {
        match &self.mem {
            // SAFETY: cuMemHostAlloc returns page-aligned memory of `len` bytes owned by
            // `buf`, which lives as long as `self`; AtomicU64 has the size and alignment of
            // u64, and this type hands out no non-atomic view of the bytes, so every access
            // from Rust is atomic. The device only reads them.
            Pinned::Own(buf) => unsafe {
                std::slice::from_raw_parts(buf.ptr.cast::<AtomicU64>(), buf.len / 8)
            },
            Pinned::Registered { words, .. } => words,
        }
    }

    /// Whether the words are the caller's (registered), not the driver's.
    pub fn is_registered(&self) -> bool {
        matches!(self.mem, Pinned::Registered { .. })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        std::mem::size_of_val(self.words())
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `len` bytes as the source of a host-to-device copy.
    ///
    /// # Safety
    /// The caller queues only device reads of these bytes (a copy to the device), and must
    /// not hold the returned pointer past the buffer's life.
    pub unsafe fn as_copy_source(&self) -> *const u8 {
        self.words().as_ptr().cast()
    }
}

impl Drop for PinnedWords {
    fn drop(&mut self) {
        if let Pinned::Registered { words, gpu } = &self.mem {
            match gpu.bind() {
                Ok(()) => {
                    // SAFETY: registered in `register` with this context; owners drop
                    // staging only after the streams that read it were synchronized.
                    let rc = unsafe { sys::cuMemHostUnregister(words.as_ptr() as *mut c_void) };
                    if let Err(e) = rc.result() {
                        warn!(error = %e, "cuMemHostUnregister failed");
                    }
                }
                // No work of ours reads it (the slot's streams were synchronized); the
                // driver keeps the pages pinned until the context goes.
                Err(e) => warn!(error = %e, "staging left registered: its GPU context is gone"),
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

    /// Queues a copy of `len` bytes at `src` into device memory at `dst`.
    ///
    /// # Safety
    /// `dst` must have room for `len` bytes, and `src` (pinned memory, for the copy to be
    /// asynchronous) must hold `len` bytes and stay alive until the stream reaches this copy
    /// (or, captured into a graph, as long as the graph).
    pub unsafe fn copy_to_device(
        &self,
        dst: CUdeviceptr,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: the caller keeps `src` alive with `len` bytes and `dst` large enough.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw) }
            .result()
            .map_err(GpuError::driver("cuMemcpyHtoDAsync"))
    }

    /// Starts capturing the work queued on this stream into a graph (work from other
    /// threads is not affected).
    pub fn begin_capture(&self) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: `raw` is a live stream of the bound context.
        unsafe {
            result::stream::begin_capture(
                self.raw,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(GpuError::driver("cuStreamBeginCapture"))
    }

    /// Ends a capture and instantiates the captured work.
    pub fn end_capture(&self) -> Result<GraphExec, GpuError> {
        self.gpu.bind()?;
        // SAFETY: `raw` is a live stream that is capturing.
        let graph = unsafe { result::stream::end_capture(self.raw) }
            .map_err(GpuError::driver("cuStreamEndCapture"))?;
        // SAFETY: `graph` was just captured; it is destroyed once instantiated (the
        // executable graph keeps what it needs).
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        // SAFETY: as above; the graph is not used again.
        let _ = unsafe { result::graph::destroy(graph) };
        Ok(GraphExec {
            raw: exec.map_err(GpuError::driver("cuGraphInstantiate"))?,
            gpu: self.gpu.clone(),
        })
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

    /// Queues a copy of `len` bytes from device memory at `src` into the start of `dst`;
    /// refuses more than `dst` holds.
    ///
    /// # Safety
    /// `src` must hold `len` bytes; `dst` must stay alive until the stream reaches this copy
    /// (or, captured into a graph, as long as the graph), and those bytes of it must not be
    /// read until then.
    pub unsafe fn copy_into_host(
        &self,
        dst: &HostBuf,
        src: CUdeviceptr,
        len: usize,
    ) -> Result<(), GpuError> {
        if len > dst.len {
            return Err(GpuError::Config(format!(
                "a copy of {len} bytes into a host buffer of {}",
                dst.len
            )));
        }
        self.gpu.bind()?;
        // SAFETY: the range lies inside `dst`'s pinned allocation (checked above); the caller
        // keeps it alive and unread until the copy is done, and `src` holds `len` bytes.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.ptr.cast(), src, len, self.raw) }
            .result()
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
        Self::with_flags(gpu, sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    /// Creates an event that records time and that [`Event::synchronize`] waits for by
    /// sleeping rather than spinning: a thread waiting for a slot costs no CPU.
    pub fn blocking(gpu: &Arc<Gpu>) -> Result<Self, GpuError> {
        Self::with_flags(gpu, sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)
    }

    fn with_flags(gpu: &Arc<Gpu>, flags: sys::CUevent_flags) -> Result<Self, GpuError> {
        gpu.bind()?;
        let raw = result::event::create(flags).map_err(GpuError::driver("cuEventCreate"))?;
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

/// An instantiated CUDA graph: a slot's whole GPU work, launched with one call.
#[derive(Debug)]
pub struct GraphExec {
    raw: sys::CUgraphExec,
    gpu: Arc<Gpu>,
}

// SAFETY: an executable graph handle may be launched from any thread that binds its
// context; `gpu.bind()` precedes every use.
unsafe impl Send for GraphExec {}
// SAFETY: as for Send; launches are serialized by the driver.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    /// Queues the graph's work on `stream`.
    pub fn launch(&self, stream: &Stream) -> Result<(), GpuError> {
        self.gpu.bind()?;
        // SAFETY: both handles are live objects of the bound context.
        unsafe { result::graph::launch(self.raw, stream.raw()) }
            .map_err(GpuError::driver("cuGraphLaunch"))
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: instantiated once, destroyed once; owners synchronize the streams
            // that ran it first.
            if let Err(e) = unsafe { result::graph::exec_destroy(self.raw) } {
                warn!(error = %e, "cuGraphExecDestroy failed");
            }
        }
    }
}

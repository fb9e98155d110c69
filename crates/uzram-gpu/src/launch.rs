//! The one place that launches the compression kernel.

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use crate::driver::{Gpu, Stream};
use crate::layout::{meta_bytes, total_index};
use crate::GpuError;

/// Threads per block: one warp, one page at a time (see `kernels/lz4_compress.cu`).
pub const BLOCK_THREADS: u32 = 32;

/// Most blocks one launch uses; the kernel walks the rest of the batch grid-stride.
const MAX_GRID: u32 = 1 << 30;

/// Device buffers of one launch over `pages` pages.
#[derive(Debug, Clone, Copy)]
pub struct LaunchBuffers {
    /// `pages * 4096` bytes of input pages.
    pub input: CUdeviceptr,
    /// `pages * 4096` bytes the kernel builds blocks in.
    pub scratch: CUdeviceptr,
    /// `pages * 4096` bytes receiving the packed blocks.
    pub packed: CUdeviceptr,
    /// [`meta_bytes`]`(pages)` bytes of size words, offsets and the packed total.
    pub meta: CUdeviceptr,
}

/// Queues, on `stream`, the zeroing of the packed-bytes counter and the LZ4 kernel for
/// `pages` pages (see [`crate::layout`] for the output). `limit` is the raw-storage
/// threshold: blocks are only kept when strictly shorter.
///
/// # Safety
/// Every buffer in `bufs` must be device memory of `gpu`'s context of the size documented
/// on [`LaunchBuffers`] (16-byte aligned), alive until the stream has finished the launch.
pub unsafe fn compress_pages(
    gpu: &Gpu,
    stream: &Stream,
    bufs: LaunchBuffers,
    pages: u32,
    limit: u32,
) -> Result<(), GpuError> {
    if pages == 0 {
        return Ok(());
    }
    gpu.bind()?;
    let total = bufs.meta + (total_index(pages as usize) * 4) as CUdeviceptr;
    debug_assert_eq!(
        total + 4,
        bufs.meta + meta_bytes(pages as usize) as CUdeviceptr
    );
    // SAFETY: `total` is the last u32 of the caller's meta buffer.
    unsafe { result::memset_d8_async(total, 0, 4, stream.raw()) }
        .map_err(GpuError::driver("cuMemsetD8Async"))?;
    let LaunchBuffers {
        mut input,
        mut scratch,
        mut packed,
        mut meta,
    } = bufs;
    let (mut pages_arg, mut limit) = (pages, limit);
    let mut params: [*mut c_void; 6] = [
        (&mut input as *mut CUdeviceptr).cast(),
        (&mut scratch as *mut CUdeviceptr).cast(),
        (&mut packed as *mut CUdeviceptr).cast(),
        (&mut meta as *mut CUdeviceptr).cast(),
        (&mut pages_arg as *mut u32).cast(),
        (&mut limit as *mut u32).cast(),
    ];
    // SAFETY: the function comes from our module, whose signature is
    // (const uint4*, u8*, u8*, u32*, u32, u32); `params` points at locals of exactly those
    // sizes that outlive this call (the driver copies them at launch); the caller
    // guarantees the buffers. Static shared memory only, so 0 dynamic bytes.
    unsafe {
        result::launch_kernel(
            gpu.function(),
            (pages.min(MAX_GRID), 1, 1),
            (BLOCK_THREADS, 1, 1),
            0,
            stream.raw(),
            &mut params,
        )
    }
    .map_err(GpuError::driver("cuLaunchKernel"))
}

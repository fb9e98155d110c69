//! The one place that launches the compression kernel.

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use crate::driver::{Gpu, Stream};
use crate::GpuError;

/// Threads per block: one warp, one page at a time (see `kernels/lz4_compress.cu`).
pub const BLOCK_THREADS: u32 = 32;

/// Most blocks one launch uses; the kernel walks the rest of the batch grid-stride.
const MAX_GRID: u32 = 1 << 30;

/// Queues the LZ4 kernel on `stream` for `pages` pages: reads `pages * 4096` bytes at
/// `input`, writes one block per page at `output` (4096-byte stride) and one size word per
/// page at `sizes` (see [`crate::layout`]). `limit` is the raw-storage threshold: blocks are
/// only kept when strictly shorter.
///
/// # Safety
/// `input` must point to `pages * 4096` readable bytes, `output` to `pages * 4096` writable
/// bytes and `sizes` to `pages * 4` writable bytes of device memory of `gpu`'s context, all
/// 16-byte aligned and alive until the stream has finished the launch.
pub unsafe fn compress_pages(
    gpu: &Gpu,
    stream: &Stream,
    input: CUdeviceptr,
    output: CUdeviceptr,
    sizes: CUdeviceptr,
    pages: u32,
    limit: u32,
) -> Result<(), GpuError> {
    if pages == 0 {
        return Ok(());
    }
    gpu.bind()?;
    let (mut input, mut output, mut sizes, mut pages_arg, mut limit) =
        (input, output, sizes, pages, limit);
    let mut params: [*mut c_void; 5] = [
        (&mut input as *mut CUdeviceptr).cast(),
        (&mut output as *mut CUdeviceptr).cast(),
        (&mut sizes as *mut CUdeviceptr).cast(),
        (&mut pages_arg as *mut u32).cast(),
        (&mut limit as *mut u32).cast(),
    ];
    // SAFETY: the function comes from our module, whose signature is
    // (const uint4*, u8*, u32*, u32, u32); `params` points at locals of exactly those sizes
    // that outlive this call (the driver copies them at launch); the caller guarantees the
    // buffers. Static shared memory only, so 0 dynamic bytes.
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

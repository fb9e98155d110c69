//! The one place that launches the kernels (see `kernels/lz4.cu` for their contract).

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use crate::driver::{Gpu, HostBuf, Kernel, Stream};
use crate::GpuError;

/// Threads per block of the fast and verify kernels: one warp, one page at a time.
pub const BLOCK_THREADS: u32 = 32;
/// Threads per block of the high kernel: eight warps share one page. The kernel declares
/// the same (`HIGH_THREADS`, its launch bound); [`compress`] refuses a module that differs.
pub const HIGH_BLOCK_THREADS: u32 = 256;

/// Control words the kernels read: pages, raw threshold, packed-bytes counter, the check's
/// count of blocks it walked serially (no usable sequence hints; see the kernels), and how
/// many packed bytes the host copies itself ([`copied_bytes`]). The host zeroes the two
/// counters before every run.
pub const CTRL_WORDS: usize = 5;
/// Which control word counts the check's serial walks (blocks without usable hints).
pub const CTRL_SERIAL_WALKS: usize = 3;

/// The control words of a run over `pages` pages with raw threshold `limit` (at most a
/// page), of which the host copies the first `copied` packed bytes itself, as the kernels
/// read them (little-endian): both counters zero.
pub fn control_words(pages: usize, limit: usize, copied: usize) -> [u8; CTRL_WORDS * 4] {
    let words = [
        pages as u32,
        limit.min(uzram_core::PAGE_SIZE) as u32,
        0,
        0,
        copied as u32,
    ];
    let mut bytes = [0u8; CTRL_WORDS * 4];
    for (b, w) in bytes.chunks_exact_mut(4).zip(words) {
        b.copy_from_slice(&w.to_le_bytes());
    }
    bytes
}
/// Bytes of a page's scratch slot (the kernels' `SCRATCH_SLOT_BYTES`): the block being
/// built, then the area of its sequence hints for the check.
pub const SCRATCH_SLOT_BYTES: usize = 2 * uzram_core::PAGE_SIZE;

/// Bytes of the scratch buffer for `pages` pages.
pub const fn scratch_bytes(pages: usize) -> usize {
    pages * SCRATCH_SLOT_BYTES
}

/// Bytes of each device buffer of a run over up to `pages` pages, in [`SlotBuffers`] order:
/// input, scratch, packed, meta, control words.
pub const fn device_buffer_bytes(pages: usize) -> [usize; 5] {
    let bytes = pages * uzram_core::PAGE_SIZE;
    [
        bytes,
        scratch_bytes(pages),
        bytes,
        uzram_core::batch::meta_bytes(pages),
        CTRL_WORDS * 4,
    ]
}

/// How many of a run's packed bytes (from the start of `packed`) the host brings over with a
/// copy engine after the check ([`copy_packed`]); the check exports the rest with its own
/// stores into mapped memory. A copy's size is fixed when it is queued (and captured in the
/// slot's graph), while the packed total is known only once the run is done, so a copy
/// moves bytes the run may not have packed.
///
/// Measured per parse (docs/bench/gpu-runs.md): the high parse's ring runs 8-15 %
/// faster with half its input's worth copied (its packed bytes are 0.27-0.37 of the input,
/// so nearly all of them), its SMs then free of the stores; the fast parse's ring runs up to
/// 30 % slower with any copy in its slot's run (an eighth of the input to all of it), so it
/// keeps the stores.
pub const fn copied_bytes(kernel: Kernel, pages: usize) -> usize {
    match kernel {
        Kernel::High => pages * uzram_core::PAGE_SIZE / 2,
        _ => 0,
    }
}

/// Queues the copy of the first `len` bytes of `packed` into `out_packed` (the
/// [`copied_bytes`] of the run; nothing when 0).
///
/// # Safety
/// `packed` must hold `len` bytes once the stream reaches the copy, and `out_packed` must
/// outlive it (or the graph it is captured into) and not be read until it is done.
pub unsafe fn copy_packed(
    stream: &Stream,
    out_packed: &HostBuf,
    packed: CUdeviceptr,
    len: usize,
) -> Result<(), GpuError> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: as the caller guarantees; the range is checked against `out_packed`.
    unsafe { stream.copy_into_host(out_packed, packed, len) }
}

/// Device buffers of one slot's run over up to `pages` pages.
#[derive(Debug, Clone, Copy)]
pub struct SlotBuffers {
    /// `pages * 4096` bytes of input pages.
    pub input: CUdeviceptr,
    /// [`scratch_bytes`]`(pages)` bytes the compressor builds blocks in, and leaves each
    /// block's sequence hints in for the check.
    pub scratch: CUdeviceptr,
    /// `pages * 4096` bytes receiving the packed blocks.
    pub packed: CUdeviceptr,
    /// `meta_bytes(pages)` bytes of size words and offsets (device side).
    pub meta: CUdeviceptr,
    /// [`CTRL_WORDS`] u32 control words.
    pub ctrl: CUdeviceptr,
    /// Mapped host memory of `pages * 4096` bytes receiving the checked blocks.
    pub out_packed: CUdeviceptr,
    /// Mapped host memory of `meta_bytes(pages)` bytes receiving the checked meta.
    pub out_meta: CUdeviceptr,
}

/// Queues the compression kernel `kernel` ([`Kernel::Fast`] or [`Kernel::High`]) over a
/// grid sized for `max_pages`; it compresses the `ctrl[0]` pages the control words name.
///
/// # Safety
/// Every buffer in `bufs` must be memory of `gpu`'s context of the size documented on
/// [`SlotBuffers`] for `max_pages` pages, alive until the stream has finished the launch
/// (or as long as a graph it is captured into), with `ctrl[0] <= max_pages`.
pub unsafe fn compress(
    gpu: &Gpu,
    stream: &Stream,
    kernel: Kernel,
    bufs: SlotBuffers,
    max_pages: u32,
) -> Result<(), GpuError> {
    let f = gpu
        .function(kernel)
        .ok_or_else(|| GpuError::Config(format!("the loaded module has no {}", kernel.entry())))?;
    let SlotBuffers {
        mut input,
        mut scratch,
        mut packed,
        mut meta,
        mut ctrl,
        ..
    } = bufs;
    let mut params: [*mut c_void; 5] = [
        (&mut input as *mut CUdeviceptr).cast(),
        (&mut scratch as *mut CUdeviceptr).cast(),
        (&mut packed as *mut CUdeviceptr).cast(),
        (&mut meta as *mut CUdeviceptr).cast(),
        (&mut ctrl as *mut CUdeviceptr).cast(),
    ];
    let threads = match kernel {
        Kernel::High => {
            // The kernel loads its page and sizes its queues by its own block size: launched
            // with another, it would compress parts of pages (which the check would reject).
            let declared = gpu.declared_threads(kernel);
            if declared != Some(HIGH_BLOCK_THREADS) {
                return Err(GpuError::Config(format!(
                    "the module's {} kernel takes {} threads a block; this build launches {HIGH_BLOCK_THREADS}",
                    kernel.entry(),
                    declared.map_or_else(|| "an unknown number of".to_string(), |t| t.to_string())
                )));
            }
            HIGH_BLOCK_THREADS
        }
        _ => BLOCK_THREADS,
    };
    // SAFETY: the function is one of our compression kernels, whose signature is
    // (const uint4*, u8*, u8*, u32*, u32*); `params` points at locals of exactly those
    // sizes that outlive this call (the driver copies them at launch); the caller
    // guarantees the buffers.
    unsafe { launch(gpu, stream, f, max_pages, threads, &mut params) }
}

/// Queues the check-and-export kernel over a grid sized for `max_pages`.
///
/// # Safety
/// As for [`compress`]; the compression kernel must be queued before it on `stream`.
pub unsafe fn verify(
    gpu: &Gpu,
    stream: &Stream,
    bufs: SlotBuffers,
    max_pages: u32,
) -> Result<(), GpuError> {
    let f = gpu
        .function(Kernel::Verify)
        .ok_or_else(|| GpuError::Config("the loaded module has no verify kernel".into()))?;
    let SlotBuffers {
        mut input,
        mut scratch,
        mut packed,
        mut meta,
        mut ctrl,
        mut out_packed,
        mut out_meta,
    } = bufs;
    let mut params: [*mut c_void; 7] = [
        (&mut input as *mut CUdeviceptr).cast(),
        (&mut scratch as *mut CUdeviceptr).cast(),
        (&mut packed as *mut CUdeviceptr).cast(),
        (&mut meta as *mut CUdeviceptr).cast(),
        (&mut ctrl as *mut CUdeviceptr).cast(),
        (&mut out_packed as *mut CUdeviceptr).cast(),
        (&mut out_meta as *mut CUdeviceptr).cast(),
    ];
    // SAFETY: the verify kernel's signature is (const uint4*, const u8*, const u8*,
    // const u32*, u32*, u8*, u32*); `params` points at locals of those sizes that outlive
    // this call; the caller guarantees the buffers.
    unsafe { launch(gpu, stream, f, max_pages, BLOCK_THREADS, &mut params) }
}

/// # Safety
/// `params` must match `f`'s signature; its buffers must be valid (see the callers).
unsafe fn launch(
    gpu: &Gpu,
    stream: &Stream,
    f: cudarc::driver::sys::CUfunction,
    max_pages: u32,
    threads: u32,
    params: &mut [*mut c_void],
) -> Result<(), GpuError> {
    gpu.bind()?;
    // One warp per page; kernels of other slots fill the tail of the last wave.
    let grid = max_pages.clamp(1, 1 << 30);
    // SAFETY: the caller guarantees `params` and the buffers; static shared memory only.
    unsafe { result::launch_kernel(f, (grid, 1, 1), (threads, 1, 1), 0, stream.raw(), params) }
        .map_err(GpuError::driver("cuLaunchKernel"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_words_in_the_kernels_layout() {
        let words: Vec<u32> = control_words(2048, 5000, 7)
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
            .collect();
        // Pages, the threshold clamped to a page, both counters zero, the copied bytes.
        assert_eq!(words, [2048, 4096, 0, 0, 7]);
        assert_eq!(control_words(1, 3625, 0)[4..8], 3625u32.to_le_bytes());
    }
}

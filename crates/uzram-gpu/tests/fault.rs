//! A forced device fault (a kernel launched on a bogus device address) must surface as an
//! error the caller falls back to the CPU on, never a panic or a hang, and the batch must
//! still be compressible on the CPU. Its own test binary: the fault kills the process's
//! CUDA context. Skips with a printed reason where there is no GPU.

mod common;

use uzram_core::batch::{BatchBackend, BatchOutput, CpuBackend};
use uzram_core::codec::Algorithm;
use uzram_core::CoreError;
use uzram_gpu::driver::{DevBuf, Stream};
use uzram_gpu::layout::meta_bytes;
use uzram_gpu::{launch, ErrorKind, GpuBackend, PipelineConfig};

#[test]
fn illegal_address_is_fallback_worthy() {
    let backend = match GpuBackend::new(PipelineConfig {
        device: 0,
        batch_pages: 64,
        slots: 3,
    }) {
        Ok(b) => b,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            return;
        }
        Err(e) => panic!("GPU present but the backend failed to start: {e}"),
    };
    let pages = common::adversarial_pages();
    let mut out = BatchOutput::default();
    backend
        .compress_batch(&pages, 3625, &mut out)
        .expect("healthy GPU batch failed");

    // Same (primary) context as the backend: the fault poisons both.
    let gpu = uzram_gpu::Gpu::open(0).expect("open GPU");
    let stream = Stream::new(&gpu).expect("stream");
    let scratch = DevBuf::new(&gpu, 64 * 4096).expect("alloc");
    let packed = DevBuf::new(&gpu, 64 * 4096).expect("alloc");
    let meta = DevBuf::new(&gpu, meta_bytes(64)).expect("alloc");
    let bufs = launch::LaunchBuffers {
        input: 0x1000,
        scratch: scratch.ptr(),
        packed: packed.ptr(),
        meta: meta.ptr(),
    };
    // SAFETY: deliberately violates the input contract (address 0x1000 is not mapped in
    // the GPU's address space): the device raises an illegal-address fault; no host memory
    // is touched.
    let launched = unsafe { launch::compress_pages(&gpu, &stream, bufs, 64, 3625) };
    let err = launched
        .and_then(|()| stream.synchronize())
        .expect_err("a kernel reading address 0x1000 must fault");
    eprintln!("forced fault: {err}");
    assert_eq!(err.kind(), ErrorKind::Fault);
    assert!(err.kind().is_fallback());
    assert!(err.is_sticky(), "{err}");

    // The backend now fails with a fallback-worthy error, and the CPU takes the batch.
    let e = backend
        .compress_batch(&pages, 3625, &mut out)
        .expect_err("the context is dead; the GPU batch must fail");
    assert!(
        matches!(e, CoreError::Backend { backend: "gpu", .. }),
        "{e}"
    );
    let e = backend.compress(&pages, 3625, &mut out).unwrap_err();
    assert!(e.kind().is_fallback(), "{e}");
    let cpu = CpuBackend::new(Algorithm::Lz4, None);
    cpu.compress_batch(&pages, 3625, &mut out)
        .expect("CPU fallback");
    let c = common::check(&pages, 3625, &out);
    assert_eq!(c.mismatches, 0);
}

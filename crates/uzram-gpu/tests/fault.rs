//! A device fault in the middle of a stream of writes: the ring retires the GPU (one log
//! line, a counter), compresses what the GPU held on the CPU, and loses no page. The fault
//! is forced by a kernel launched on an address that is not mapped, in the same (primary)
//! context as the slots. Its own test binary: the fault kills the process's CUDA context.
//! Skips with a printed reason where there is no GPU; the same path runs on every machine
//! through uzram-core's failing backends (`batch::ring` tests).

mod common;

use std::sync::Arc;

use uzram_core::batch::{Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::store::{PageStore, StoreConfig};
use uzram_core::PAGE_SIZE;
use uzram_gpu::driver::{DevBuf, Kernel, Stream};
use uzram_gpu::launch::{self, scratch_bytes, SlotBuffers, CTRL_WORDS};
use uzram_gpu::{ErrorKind, Gpu, Parse};

#[test]
fn a_fault_mid_stream_retires_the_gpu_and_loses_nothing() {
    let Some(slots) = common::gpu(4, 128, Parse::Fast, true) else {
        return;
    };
    let mut data = common::load_pages(&common::slice_paths()[0]);
    data.extend(common::load_pages(&common::slice_paths()[1]));
    let n = (data.len() / PAGE_SIZE) as u64;
    let store = Arc::new(PageStore::new(StoreConfig::new(n, Algorithm::Lz4)).unwrap());
    let ring = Ring::start(store.clone(), Arc::new(slots), RingConfig::default()).unwrap();
    let half = (n / 2) as usize;
    for first in (0..half).step_by(16) {
        let count = 16.min(half - first);
        ring.write(
            first as u64,
            &data[first * PAGE_SIZE..(first + count) * PAGE_SIZE],
        )
        .unwrap();
    }
    ring.flush();
    assert_eq!(ring.stats().retired, 0);

    // The fault: a compression kernel whose input is address 0x1000.
    let gpu = Gpu::open(0).expect("open GPU");
    let stream = Stream::new(&gpu).expect("stream");
    let bufs: Vec<DevBuf> = [scratch_bytes(64), 64 * 4096, 4096, CTRL_WORDS * 4]
        .iter()
        .map(|&b| DevBuf::new(&gpu, b).unwrap())
        .collect();
    let bogus = SlotBuffers {
        input: 0x1000,
        scratch: bufs[0].ptr(),
        packed: bufs[1].ptr(),
        meta: bufs[2].ptr(),
        ctrl: 0x2000,
        out_packed: 0,
        out_meta: 0,
    };
    // SAFETY: deliberately violates the buffer contract (addresses 0x1000 and 0x2000 are
    // not mapped in the GPU's address space): the device raises an illegal-address fault;
    // no host memory is touched.
    let launched = unsafe { launch::compress(&gpu, &stream, Kernel::Fast, bogus, 64) };
    let err = launched
        .and_then(|()| stream.synchronize())
        .expect_err("a kernel reading address 0x1000 must fault");
    eprintln!("forced fault: {err}");
    assert_eq!(err.kind(), ErrorKind::Fault);
    assert!(err.is_sticky(), "{err}");

    // The rest of the stream, then everything back.
    for first in (half..n as usize).step_by(16) {
        let count = 16.min(n as usize - first);
        ring.write(
            first as u64,
            &data[first * PAGE_SIZE..(first + count) * PAGE_SIZE],
        )
        .unwrap();
    }
    ring.flush();
    let stats = ring.stats();
    eprintln!("after the fault: {stats:?}");
    assert_eq!(stats.retired, 1, "{stats:?}");
    assert!(ring.is_retired());
    assert!(stats.retired_pages + stats.cpu_pages > 0, "{stats:?}");
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).unwrap();
    assert!(back == data, "a page was lost or changed");
    ring.shutdown();
}

//! A GPU that hangs without an error, in the middle of a stream of writes: the ring's
//! watcher retires it once a slot's results are later than the device deadline, installs
//! the hung slots' staged pages on the CPU, and loses no page; flush and shutdown return.
//! The hang is forced by a kernel that spins on a flag in mapped host memory with every SM's
//! threads (two blocks of 1024 on each), so the slots' kernels cannot start; the flag is set
//! at the end, and the stuck installers' late results find their pages installed already.
//! Its own test binary: the spinning kernel holds the whole device. Skips with a printed
//! reason where there is no GPU; the same path runs on every machine through uzram-core's
//! hanging backend (`batch::ring` tests).

mod common;

use std::ffi::CString;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result;
use uzram_core::batch::{Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::store::{PageStore, StoreConfig};
use uzram_core::PAGE_SIZE;
use uzram_gpu::driver::{HostBuf, Stream};
use uzram_gpu::{Gpu, Parse};

/// Spins until the 32-bit word at `flag` (mapped host memory) is not zero.
const SPIN_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry uzram_test_spin(.param .u64 flag)
{
    .reg .pred %p;
    .reg .b32 %r;
    .reg .b64 %a;
    ld.param.u64 %a, [flag];
SPIN:
    ld.volatile.u32 %r, [%a];
    setp.eq.u32 %p, %r, 0;
    @%p bra SPIN;
    ret;
}
"#;

fn write_range(ring: &Ring, data: &[u8], pages: std::ops::Range<usize>) {
    for first in pages.clone().step_by(16) {
        let count = 16.min(pages.end - first);
        ring.write(
            first as u64,
            &data[first * PAGE_SIZE..(first + count) * PAGE_SIZE],
        )
        .unwrap();
    }
}

#[test]
fn a_gpu_that_hangs_is_retired_after_the_deadline_and_loses_nothing() {
    let Some(slots) = common::gpu(4, 128, Parse::High, true) else {
        return;
    };
    let mut data = common::load_pages(&common::slice_paths()[0]);
    data.extend(common::load_pages(&common::slice_paths()[1]));
    let n = data.len() / PAGE_SIZE;
    let store = Arc::new(PageStore::new(StoreConfig::new(n as u64, Algorithm::Lz4)).unwrap());
    let cfg = RingConfig {
        device_deadline: Duration::from_millis(500),
        ..RingConfig::default()
    };
    let ring = Ring::start(store.clone(), Arc::new(slots), cfg).unwrap();
    write_range(&ring, &data, 0..n / 2);
    ring.flush();
    assert_eq!(ring.stats().retired, 0);

    // The hang: every SM's threads spin on a flag nobody sets until the end.
    let gpu = Gpu::open(0).expect("open GPU");
    let mut flag = HostBuf::mapped(&gpu, 4096).expect("mapped flag");
    let flag_dev = flag.device_ptr().expect("device address of the flag");
    let stream = Stream::new(&gpu).expect("stream");
    let ptx = CString::new(SPIN_PTX).unwrap();
    gpu.bind().unwrap();
    // SAFETY: the context is bound; the image is a NUL-terminated PTX text.
    let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }.expect("spin PTX");
    // SAFETY: `module` was loaded above and is never unloaded.
    let spin =
        unsafe { result::module::get_function(module, CString::new("uzram_test_spin").unwrap()) }
            .expect("spin kernel");
    let mut arg = flag_dev;
    let mut params = [(&mut arg as *mut u64).cast::<std::ffi::c_void>()];
    // SAFETY: one u64 parameter, the device address of a live mapped buffer that the kernel
    // only reads; the stream is live in the bound context.
    unsafe {
        result::launch_kernel(
            spin,
            (2 * gpu.sm_count(), 1, 1),
            (1024, 1, 1),
            0,
            stream.raw(),
            &mut params,
        )
    }
    .expect("launching the spin kernel");

    let start = Instant::now();
    write_range(&ring, &data, n / 2..n);
    ring.flush();
    let waited = start.elapsed();
    let stats = ring.stats();
    eprintln!("while the GPU hangs ({waited:?}): {stats:?}");
    assert!(waited < Duration::from_secs(60), "flush took {waited:?}");
    assert!(stats.hung_slots >= 1, "{stats:?}");
    assert_eq!(stats.retired, 1, "{stats:?}");
    assert_eq!(store.stats().staged_pages, 0, "every staged page installed");
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).unwrap();
    assert!(
        back == data,
        "a page was lost or changed while the GPU hung"
    );

    // Let the GPU go: the stuck installers' results come back stale.
    // SAFETY: a 4-byte aligned store into the live mapped buffer, which the kernel polls.
    unsafe { std::ptr::write_volatile(flag.as_mut_slice().as_mut_ptr().cast::<u32>(), 1) };
    stream
        .synchronize()
        .expect("the spin kernel ends once its flag is set");
    ring.shutdown();
    store.read(0, &mut back).unwrap();
    assert!(back == data, "a late result changed a page");
}

//! A GPU opened for its context alone ([`Gpu::open_context`], what nvCOMP's recompressor
//! opens) compiles none of uzram's kernels, and slots of uzram's kernels refuse it with an
//! error instead of launching nothing. Skips with a printed reason where there is no GPU.

use uzram_gpu::{ErrorKind, Gpu, GpuConfig, GpuError, GpuSlots, Kernel};

#[test]
fn a_context_only_gpu_loads_no_kernel_and_kernel_slots_refuse_it() {
    let gpu = match Gpu::open_context(0) {
        Ok(g) => g,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            return;
        }
        Err(e) => panic!("GPU present but its context failed to open: {e}"),
    };
    for k in [Kernel::Fast, Kernel::High, Kernel::Verify] {
        assert!(gpu.function(k).is_none(), "{} loaded", k.entry());
        assert!(gpu.declared_threads(k).is_none(), "{} declared", k.entry());
    }
    assert!(
        gpu.sm_count() > 0,
        "the context reads the device's attributes"
    );
    let full = Gpu::open(0).expect("the same GPU with the kernels");
    assert!(full.function(Kernel::Fast).is_some() && full.function(Kernel::Verify).is_some());
    match GpuSlots::on_over(vec![gpu], GpuConfig::default(), None) {
        Err(GpuError::Config(why)) => assert!(why.contains("not in the loaded kernels"), "{why}"),
        Err(e) => panic!("slots on a context-only GPU: {e}, not the missing kernel's error"),
        Ok(_) => panic!("slots of uzram's kernels started on a GPU without them"),
    }
}

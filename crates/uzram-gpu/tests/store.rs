//! The GPU backend behind uzram-core's store and write batcher: pages written through the
//! GPU read back exactly, including overwrites racing a batch (the generation check).
//! Skips with a printed reason where there is no GPU.

mod common;

use std::sync::Arc;
use std::time::Duration;

use uzram_core::batch::{BatcherConfig, CpuBackend, DeferPolicy, WriteBatcher};
use uzram_core::codec::Algorithm;
use uzram_core::store::{PageStore, StoreConfig};
use uzram_core::PAGE_SIZE;
use uzram_gpu::{ErrorKind, GpuBackend, PipelineConfig};

fn gpu() -> Option<Arc<GpuBackend>> {
    match GpuBackend::new(PipelineConfig {
        device: 0,
        batch_pages: 256,
        slots: 4,
    }) {
        Ok(b) => Some(Arc::new(b)),
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            None
        }
        Err(e) => panic!("GPU present but the backend failed to start: {e}"),
    }
}

fn pages() -> Vec<u8> {
    let mut v = common::load_pages(&common::slice_paths()[0]);
    v.extend(common::load_pages(&common::slice_paths()[1]));
    v.extend(common::adversarial_pages());
    v.extend(common::random_pages(64, 9));
    v
}

#[test]
fn write_batch_through_the_gpu_reads_back_exactly() {
    let Some(backend) = gpu() else { return };
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let store = PageStore::new(StoreConfig::new(n, Algorithm::Lz4)).expect("store");
    store
        .write_batch(0, &data, backend.as_ref())
        .expect("write_batch");
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).expect("read");
    assert!(back == data, "pages read back differ");
    assert_eq!(backend.stats().pages, n);
}

#[test]
fn write_batcher_on_the_gpu_keeps_the_latest_write() {
    let Some(backend) = gpu() else { return };
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let store = Arc::new(PageStore::new(StoreConfig::new(n, Algorithm::Lz4)).expect("store"));
    let cpu = Arc::new(CpuBackend::new(Algorithm::Lz4, None));
    let batcher = WriteBatcher::start(
        store.clone(),
        backend.clone(),
        cpu,
        BatcherConfig {
            batch_pages: 1000,
            max_delay: Duration::from_millis(1),
            policy: DeferPolicy::Always,
        },
    )
    .expect("batcher");
    // Write everything, then overwrite every 3rd page with the page after it while the
    // first batches may still be on the GPU.
    for (i, chunk) in data.chunks(64 * PAGE_SIZE).enumerate() {
        batcher.write((i * 64) as u64, chunk).expect("write");
    }
    let mut expect = data.clone();
    for p in (0..n as usize - 1).step_by(3) {
        let next = data[(p + 1) * PAGE_SIZE..(p + 2) * PAGE_SIZE].to_vec();
        batcher.write(p as u64, &next).expect("overwrite");
        expect[p * PAGE_SIZE..(p + 1) * PAGE_SIZE].copy_from_slice(&next);
    }
    batcher.flush();
    let stats = batcher.stats();
    eprintln!("batcher: {stats:?}; gpu: {:?}", backend.stats());
    assert!(stats.batches > 0 && stats.batched_pages > 0, "{stats:?}");
    assert_eq!(stats.backend_failures, 0, "{stats:?}");
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).expect("read");
    assert!(back == expect, "a page does not hold its last write");
    batcher.shutdown();
}

//! GPU conformance: every page the kernel compresses decodes with the CPU (lz4_flex) to
//! exactly its input. Skips with a printed reason where there is no GPU.

mod common;

use common::{adversarial_pages, check, load_pages, random_pages, Check};
use uzram_core::batch::{BatchBackend, BatchOutput};
use uzram_gpu::{ErrorKind, GpuBackend, PipelineConfig};

/// zram's raw threshold with zsmalloc.
const THRESHOLD: usize = 3625;

fn gpu(batch_pages: usize, slots: usize) -> Option<GpuBackend> {
    match GpuBackend::new(PipelineConfig {
        device: 0,
        batch_pages,
        slots,
    }) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            None
        }
        Err(e) => panic!("GPU present but the backend failed to start: {e}"),
    }
}

fn run(backend: &GpuBackend, pages: &[u8], threshold: usize) -> Check {
    let mut out = BatchOutput::default();
    backend
        .compress_batch(pages, threshold, &mut out)
        .expect("GPU batch failed");
    check(pages, threshold, &out)
}

fn assert_corpus(backend: &GpuBackend, name: &str, pages: &[u8]) {
    let c = run(backend, pages, THRESHOLD);
    eprintln!(
        "{name}: {} pages, {} compressed, {} raw, {} same-filled, GPU {} B vs CPU {} B stored, \
         ratio vs CPU {:.4}x, {} mismatches",
        c.pages,
        c.compressed,
        c.raw,
        c.same_filled,
        c.gpu_bytes,
        c.cpu_bytes,
        c.ratio_vs_cpu(),
        c.mismatches
    );
    assert_eq!(c.mismatches, 0, "{name}");
    assert!(
        c.ratio_vs_cpu() >= 0.97,
        "{name}: ratio {:.4}x CPU",
        c.ratio_vs_cpu()
    );
}

#[test]
fn checked_in_slices_decode_exactly() {
    let Some(backend) = gpu(256, 3) else { return };
    for path in common::slice_paths() {
        let pages = load_pages(&path);
        assert_corpus(&backend, &common::corpus_name(&path), &pages);
    }
}

#[test]
fn full_corpora_decode_exactly() {
    let paths = match common::full_corpus_paths() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipping: full corpora not available: {why}");
            return;
        }
    };
    let Some(backend) = gpu(4096, 4) else { return };
    for path in paths {
        let pages = load_pages(&path);
        assert_corpus(&backend, &common::corpus_name(&path), &pages);
    }
}

#[test]
fn random_pages_are_raw_and_exact() {
    let Some(backend) = gpu(128, 3) else { return };
    let pages = random_pages(1000, 1);
    for threshold in [THRESHOLD, 4096] {
        let c = run(&backend, &pages, threshold);
        assert_eq!(c.mismatches, 0);
        assert_eq!(
            c.raw, 1000,
            "random pages must not compress below {threshold}"
        );
    }
}

#[test]
fn adversarial_pages_decode_exactly_at_every_threshold() {
    let Some(backend) = gpu(64, 3) else { return };
    let pages = adversarial_pages();
    for threshold in [1, 16, 64, 1000, THRESHOLD, 4095, 4096, 1 << 20] {
        let c = run(&backend, &pages, threshold);
        eprintln!("adversarial, threshold {threshold}: {c:?}");
        assert_eq!(c.mismatches, 0, "threshold {threshold}");
        if threshold <= 1 {
            assert_eq!(c.compressed, 0);
        }
        if threshold >= 4096 {
            assert!(c.compressed > c.pages / 2, "{c:?}");
            assert!(c.ratio_vs_cpu() >= 0.97, "{c:?}");
        }
    }
}

#[test]
fn ring_wraps_over_many_slots_and_partial_batches() {
    let Some(backend) = gpu(64, 3) else { return };
    // 1000 pages = 15 full slots of 64 and one of 40: every slot is reused.
    let mut pages = random_pages(500, 2);
    pages.extend(adversarial_pages().iter().cycle().take(500 * 4096));
    let c = run(&backend, &pages, THRESHOLD);
    assert_eq!(c.pages, 1000);
    assert_eq!(c.mismatches, 0);
    let stats = backend.stats();
    assert_eq!(stats.pages, 1000);
    assert_eq!(stats.batches, 16);
    assert_eq!(stats.bytes_stored as usize, c.gpu_bytes);
    assert!(stats.kernel_ms > 0.0 && stats.h2d_ms > 0.0 && stats.d2h_ms > 0.0);
    // An empty batch is fine; a ragged one is a caller bug, not a GPU failure.
    let mut out = BatchOutput::default();
    backend.compress(&[], THRESHOLD, &mut out).unwrap();
    assert!(out.is_empty());
    let e = backend
        .compress(&[0u8; 100], THRESHOLD, &mut out)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Usage);
}

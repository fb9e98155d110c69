//! GPU conformance: every page the kernels compress decodes on the CPU to exactly its
//! input, the device's own check rejects nothing a correct compressor made, and a block
//! corrupted on the device is rejected. For every parse the loaded kernels have, with and
//! without captured graphs. Skips with a printed reason where there is no GPU.

mod common;

use common::{adversarial_pages, check, gpu, load_pages, parses, random_pages, run_slots, Check};
use uzram_gpu::{GpuSlots, Parse};

/// zram's raw threshold with zsmalloc.
const THRESHOLD: usize = 3625;

fn run(slots: &GpuSlots, pages: &[u8], threshold: usize) -> Check {
    let results = run_slots(slots, pages, threshold).expect("GPU slot failed");
    check(pages, threshold, &results)
}

fn assert_corpus(slots: &GpuSlots, name: &str, pages: &[u8], min_ratio: f64) {
    let c = run(slots, pages, THRESHOLD);
    eprintln!(
        "{name} ({}): {} pages, {} compressed, {} raw, {} same-filled, GPU {} B vs CPU {} B \
         stored, ratio vs CPU {:.4}x, {} rejected, {} mismatches",
        slots.config().parse.name(),
        c.pages,
        c.compressed,
        c.raw,
        c.same_filled,
        c.gpu_bytes,
        c.cpu_bytes,
        c.ratio_vs_cpu(),
        c.rejected,
        c.mismatches
    );
    assert_eq!(c.mismatches, 0, "{name}");
    assert_eq!(c.rejected, 0, "{name}");
    assert!(
        c.ratio_vs_cpu() >= min_ratio,
        "{name}: ratio {:.4}x CPU",
        c.ratio_vs_cpu()
    );
}

fn min_ratio(parse: Parse) -> f64 {
    match parse {
        Parse::Fast => 1.0,
        Parse::High => 1.05,
    }
}

#[test]
fn checked_in_slices_decode_exactly() {
    for parse in parses() {
        for graphs in [true, false] {
            let Some(slots) = gpu(3, 256, parse, graphs) else {
                return;
            };
            for path in common::slice_paths() {
                let pages = load_pages(&path);
                assert_corpus(
                    &slots,
                    &common::corpus_name(&path),
                    &pages,
                    min_ratio(parse),
                );
            }
        }
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
    for parse in parses() {
        let Some(slots) = gpu(4, 2048, parse, true) else {
            return;
        };
        for path in &paths {
            let pages = load_pages(path);
            assert_corpus(&slots, &common::corpus_name(path), &pages, min_ratio(parse));
        }
    }
}

#[test]
fn random_pages_are_raw_and_exact() {
    for parse in parses() {
        let Some(slots) = gpu(3, 128, parse, true) else {
            return;
        };
        let pages = random_pages(1000, 1);
        for threshold in [THRESHOLD, 4096] {
            let c = run(&slots, &pages, threshold);
            assert_eq!(c.mismatches, 0);
            assert_eq!(
                c.raw, 1000,
                "random pages must not compress below {threshold}"
            );
        }
    }
}

#[test]
fn adversarial_pages_decode_exactly_at_every_threshold() {
    for parse in parses() {
        let Some(slots) = gpu(3, 64, parse, true) else {
            return;
        };
        let pages = adversarial_pages();
        for threshold in [1, 16, 64, 1000, THRESHOLD, 4095, 4096, 1 << 20] {
            let c = run(&slots, &pages, threshold);
            eprintln!(
                "adversarial ({}), threshold {threshold}: {c:?}",
                parse.name()
            );
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
}

#[test]
fn slots_are_reused_with_partial_fills_and_counted() {
    let Some(slots) = gpu(3, 64, Parse::Fast, true) else {
        return;
    };
    // 1000 pages = 15 full slots of 64 and one of 40: every slot is reused.
    let mut pages = random_pages(500, 2);
    pages.extend(adversarial_pages().iter().cycle().take(500 * 4096));
    let c = run(&slots, &pages, THRESHOLD);
    assert_eq!(c.pages, 1000);
    assert_eq!(c.mismatches, 0);
    let stats = slots.gpu_stats();
    assert_eq!(stats.pages, 1000);
    assert_eq!(stats.slots, 16);
    assert!(stats.busy_us > 0 && stats.packed_bytes > 0, "{stats:?}");
    // A slot with nothing submitted, or too many pages, is refused cleanly.
    use uzram_core::batch::SlotBackend;
    assert!(slots.complete(0, &mut |_| ()).is_err());
    assert!(slots.submit(0, 65, THRESHOLD).is_err());
    assert!(slots.submit(0, 0, THRESHOLD).is_err());
}

//! The cold tier's GPU recompressors as the daemon runs them: pages the CPU wrote with its
//! LZ4 go through a GPU slot, and every page that comes back smaller (and decodes, on the
//! CPU, to the page) replaces its object; the store then takes less memory and reads every
//! page back exactly. With the `high` parse (`lz4-gpu`) the entries stay plain LZ4; with
//! nvCOMP's zstd (`zstd-gpu`) they become zstd frames that the CPU's zstd decodes. On every
//! checked-in slice, and on the full corpora where `UZRAM_CORPUS_DIR` names them. Skips
//! with a printed reason where there is no GPU (or, for `zstd-gpu`, no nvCOMP).

mod common;

use uzram_core::batch::SlotBackend;
use uzram_core::codec::Algorithm;
use uzram_core::store::{Candidates, PageStore, Recompress, Recompressor, StoreConfig};
use uzram_core::PAGE_SIZE;
use uzram_gpu::{ErrorKind, NvcompZstd, Parse};

fn recompressed_exactly(name: &str, data: &[u8], slots: &dyn SlotBackend) {
    let frames = matches!(slots.algorithm(), Algorithm::Zstd { .. });
    let name = format!("{name} ({})", slots.name());
    let pages = (data.len() / PAGE_SIZE) as u64;
    let store = PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap();
    store.write(0, data).unwrap();
    let before = store.stats();
    store.mark_idle(None);
    let done = store
        .recompress(Recompress {
            candidates: Candidates::Idle { min_age: 0 },
            recompressor: Recompressor::Batched {
                backend: slots,
                slot: 0,
            },
            threshold: 0,
            max_pages: u64::MAX,
            retry_tried: false,
            priority: None,
        })
        .unwrap();
    store.compact();
    let after = store.stats();
    uzram_core::fuzz::reads_back(&store, data);
    let payload = after.compr_data_size as f64 / before.compr_data_size.max(1) as f64;
    let memory = after.mem_used_total as f64 / before.mem_used_total.max(1) as f64;
    println!(
        "{name}: {} pages tried, {} rewritten, {} kept, {} failed; payload after/before \
         {payload:.4}, mem_used_total {memory:.4}",
        done.tried, done.rewritten, done.kept, done.failed
    );
    assert_eq!(done.failed, 0, "{name}: {done:?}");
    assert_eq!(done.raced, 0, "{name}: {done:?}");
    if frames {
        assert_eq!(
            after.recompressed_pages, done.rewritten,
            "{name}: zstd entries"
        );
    } else {
        assert_eq!(after.recompressed_pages, 0, "{name}: LZ4 entries, not zstd");
    }
    assert_eq!(after.recompress_rewritten_pages, done.rewritten, "{name}");
    assert_eq!(
        before.compr_data_size - after.compr_data_size,
        done.saved_bytes,
        "{name}"
    );
    if done.tried > 64 {
        assert!(
            done.rewritten > 0,
            "{name}: the recompressor saved nothing: {done:?}"
        );
        assert!(payload < 1.0, "{name}: payload {payload}");
    }
}

#[test]
fn the_high_parse_recompresses_cpu_lz4_pages_smaller_and_every_page_reads_back() {
    let Some(slots) = common::gpu(1, 2048, Parse::High, true) else {
        return;
    };
    every_corpus(&slots);
}

#[test]
fn nvcomp_zstd_recompresses_cpu_lz4_pages_smaller_and_every_page_reads_back() {
    let zstd = match NvcompZstd::new(0, 2048) {
        Ok(z) => z,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no GPU or no nvCOMP: {e}");
            return;
        }
        Err(e) => panic!("GPU and nvCOMP present but nvCOMP's zstd failed to start: {e}"),
    };
    every_corpus(&zstd);
}

fn every_corpus(slots: &dyn SlotBackend) {
    for path in common::slice_paths() {
        let data = common::load_pages(&path);
        recompressed_exactly(&common::corpus_name(&path), &data, slots);
    }
    match common::full_corpus_paths() {
        Ok(paths) => {
            for path in paths {
                let data = common::load_pages(&path);
                recompressed_exactly(&common::corpus_name(&path), &data, slots);
            }
        }
        Err(why) => eprintln!("full corpora skipped: {why}"),
    }
}

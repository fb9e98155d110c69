//! PageStore unit tests: accounting, table size, thresholds, deferred writes.

use super::*;
use crate::batch::CpuBackend;

fn store(pages: u64) -> PageStore {
    PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap()
}

/// A page that lz4 compresses to a few hundred bytes.
fn text_page(seed: u8) -> [u8; PAGE_SIZE] {
    let mut page = [0u8; PAGE_SIZE];
    for (i, b) in page.iter_mut().enumerate() {
        *b = b"the quick brown fox jumps over the lazy dog "[(i * 7 + usize::from(seed)) % 44]
            ^ (i / 512) as u8;
    }
    page
}

/// A page lz4 cannot compress (xorshift noise).
fn noise_page(seed: u64) -> [u8; PAGE_SIZE] {
    let mut x = seed | 1;
    let mut page = [0u8; PAGE_SIZE];
    for chunk in page.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    page
}

fn read_page(store: &PageStore, index: u64) -> [u8; PAGE_SIZE] {
    let mut page = [0u8; PAGE_SIZE];
    store.read(index, &mut page).unwrap();
    page
}

#[test]
fn table_costs_at_most_16_bytes_per_page() {
    assert_eq!(std::mem::size_of::<entry::Entry>(), 8);
    for pages in [4096u64, 1 << 20] {
        let store = store(pages);
        let stats = store.stats();
        // The table's real allocation (entries, shard locks, side maps, the store itself).
        let per_page = store.table_bytes() as f64 / pages as f64;
        assert!(per_page <= 16.0, "{pages} pages: {per_page} bytes/page");
        assert!(stats.mem_used_total >= store.table_bytes());
        if pages == 1 << 20 {
            // 8 bytes per entry plus a few KiB of locks and bookkeeping.
            assert!(per_page < 8.1, "{per_page}");
            assert!((stats.mem_used_total as f64 / pages as f64) < 8.1);
        }
    }
}

#[test]
fn empty_pages_read_as_zeros() {
    let store = store(4);
    assert_eq!(read_page(&store, 3), [0; PAGE_SIZE]);
    assert_eq!(store.stats().pages_stored, 0);
}

#[test]
fn same_filled_pages_cost_no_payload() {
    let store = store(8);
    let before = store.stats().mem_used_total;
    let words = [0u64, u64::MAX, 0x0101_0101_0101_0101, 0x1234_5678_9abc_def0];
    for (i, word) in words.iter().enumerate() {
        let mut page = [0u8; PAGE_SIZE];
        fill_page(&mut page, *word);
        store.write(i as u64, &page).unwrap();
        assert_eq!(read_page(&store, i as u64), page);
    }
    let stats = store.stats();
    assert_eq!(stats.same_pages, 4);
    assert_eq!(stats.pages_stored, 4);
    assert_eq!(stats.compr_data_size, 0);
    assert_eq!(stats.orig_data_size, 4 * PAGE_SIZE as u64);
    // Only the side map for the one word that does not fit an entry may grow.
    assert!(stats.mem_used_total - before < 1024);
}

#[test]
fn incompressible_pages_are_huge_and_round_trip() {
    let store = store(2);
    let page = noise_page(7);
    store.write(1, &page).unwrap();
    assert_eq!(read_page(&store, 1), page);
    let stats = store.stats();
    assert_eq!(stats.huge_pages, 1);
    assert_eq!(stats.compr_data_size, PAGE_SIZE as u64);
}

#[test]
fn raw_threshold_decides_huge() {
    let page = text_page(1);
    let mut codec = Algorithm::Lz4.codec();
    let mut out = [0u8; PAGE_SIZE];
    let len = codec.compress(&page, &mut out).unwrap().unwrap();
    for (threshold, huge) in [(len, 1), (len + 1, 0)] {
        let mut cfg = StoreConfig::new(1, Algorithm::Lz4);
        cfg.raw_threshold = threshold;
        let store = PageStore::new(cfg).unwrap();
        store.write(0, &page).unwrap();
        assert_eq!(
            store.stats().huge_pages,
            huge,
            "threshold {threshold}, len {len}"
        );
        assert_eq!(read_page(&store, 0), page);
    }
}

#[test]
fn config_is_validated() {
    let bad = [
        StoreConfig::new(0, Algorithm::Lz4),
        StoreConfig {
            raw_threshold: 0,
            ..StoreConfig::new(1, Algorithm::Lz4)
        },
        StoreConfig {
            raw_threshold: PAGE_SIZE + 1,
            ..StoreConfig::new(1, Algorithm::Lz4)
        },
        StoreConfig {
            mem_limit: Some(10),
            ..StoreConfig::new(1000, Algorithm::Lz4)
        },
    ];
    for cfg in bad {
        assert!(
            matches!(PageStore::new(cfg.clone()), Err(CoreError::Config(_))),
            "{cfg:?}"
        );
    }
}

#[test]
fn range_and_alignment_errors() {
    let store = store(4);
    let page = [1u8; PAGE_SIZE];
    assert!(matches!(
        store.write(4, &page),
        Err(CoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        store.write(0, &page[..100]),
        Err(CoreError::Unaligned { .. })
    ));
    assert!(matches!(
        store.discard(3, 2),
        Err(CoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        store.discard(u64::MAX, 2),
        Err(CoreError::OutOfRange { .. })
    ));
    let mut out = [0u8; 2 * PAGE_SIZE];
    assert!(matches!(
        store.read(3, &mut out),
        Err(CoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        store.write_deferred(4, &page),
        Err(CoreError::OutOfRange { .. })
    ));
}

#[test]
fn discard_frees_memory_and_counts() {
    let store = store(64);
    let empty = store.stats().mem_used_total;
    let data: Vec<u8> = (0..64).flat_map(|i| text_page(i as u8)).collect();
    store.write(0, &data).unwrap();
    let full = store.stats();
    assert!(full.mem_used_total > empty);
    assert_eq!(full.pages_stored, 64);
    store.discard(0, 32).unwrap();
    store.write_zeroes(32, 32).unwrap();
    let stats = store.stats();
    assert_eq!(stats.notify_free, 32);
    assert_eq!(stats.pages_stored, 0);
    assert_eq!(stats.compr_data_size, 0);
    assert_eq!(stats.mem_used_total, empty);
    assert_eq!(stats.mem_used_max, full.mem_used_max);
    assert_eq!(read_page(&store, 5), [0; PAGE_SIZE]);
    // Discarding empty pages frees nothing and is not counted.
    store.discard(0, 64).unwrap();
    assert_eq!(store.stats().notify_free, 32);
}

#[test]
fn overwrite_reuses_space() {
    let store = store(1);
    store.write(0, &text_page(3)).unwrap();
    let first = store.stats().mem_used_total;
    for seed in 0..200u8 {
        store.write(0, &text_page(seed)).unwrap();
        assert_eq!(read_page(&store, 0), text_page(seed));
    }
    // Only the free list's own small allocation may have grown.
    assert!(store.stats().mem_used_total <= first + 256);
    assert_eq!(store.stats().compr_data_size, {
        let mut out = [0u8; PAGE_SIZE];
        Algorithm::Lz4
            .codec()
            .compress(&text_page(199), &mut out)
            .unwrap()
            .unwrap() as u64
    });
}

#[test]
fn mem_limit_refuses_and_keeps_old_content() {
    let probe = store(64);
    let mut cfg = StoreConfig::new(64, Algorithm::Lz4);
    cfg.mem_limit = Some(probe.stats().mem_used_total + 70 * 1024);
    let store = PageStore::new(cfg).unwrap();
    let mut written = 0;
    let err = loop {
        match store.write(written, &noise_page(written + 1)) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, CoreError::MemLimit { .. }), "{err}");
    assert_eq!(err.errno(), -12);
    assert!(written >= 10, "{written}");
    let stats = store.stats();
    assert!(stats.mem_used_total <= stats.mem_limit);
    // The failed page kept its old (empty) content; an overwrite that fails keeps the old.
    assert_eq!(read_page(&store, written), [0; PAGE_SIZE]);
    store.write(written, &[0u8; PAGE_SIZE]).unwrap();
    // Like zram, an overwrite needs room for the new copy before the old one is freed:
    // at the limit it fails and the old content stays.
    assert!(matches!(
        store.write(0, &noise_page(999)),
        Err(CoreError::MemLimit { .. })
    ));
    assert_eq!(read_page(&store, 0), noise_page(1));
    // Freed space is reused under the limit.
    store.discard(1, 1).unwrap();
    store.write(0, &noise_page(999)).unwrap();
    assert_eq!(read_page(&store, 0), noise_page(999));
    for i in 2..written {
        assert_eq!(read_page(&store, i), noise_page(i + 1));
    }
}

#[test]
fn batch_write_matches_inline_write() {
    let data: Vec<u8> = (0..40u64)
        .flat_map(|i| match i % 4 {
            0 => text_page(i as u8),
            1 => noise_page(i),
            2 => [0u8; PAGE_SIZE],
            _ => [0xabu8; PAGE_SIZE],
        })
        .collect();
    let inline = store(40);
    inline.write(0, &data).unwrap();
    let batch = store(40);
    let backend = CpuBackend::new(Algorithm::Lz4, std::num::NonZeroUsize::new(3));
    batch.write_batch(0, &data, &backend).unwrap();
    let mut a = vec![0u8; data.len()];
    let mut b = vec![0u8; data.len()];
    inline.read(0, &mut a).unwrap();
    batch.read(0, &mut b).unwrap();
    assert!(a == data && b == data);
    let (sa, sb) = (inline.stats(), batch.stats());
    assert_eq!(sa.compr_data_size, sb.compr_data_size);
    assert_eq!(sa.huge_pages, sb.huge_pages);
    assert_eq!(sb.same_pages, 20);
    assert_eq!(sb.writes, 40);
    let zstd = CpuBackend::new(Algorithm::Zstd { level: 1 }, None);
    assert!(matches!(
        batch.write_batch(0, &data, &zstd),
        Err(CoreError::Config(_))
    ));
}

#[test]
fn deferred_write_commit_and_stale_tickets() {
    let store = store(4);
    let page = text_page(9);
    assert_eq!(store.write_deferred(0, &[0u8; PAGE_SIZE]).unwrap(), None);
    let ticket = store.write_deferred(1, &page).unwrap().unwrap();
    assert_eq!(ticket.page, 1);
    // Stored raw until the commit, and readable at once.
    assert_eq!(store.stats().huge_pages, 1);
    assert_eq!(read_page(&store, 1), page);
    let mut codec = Algorithm::Lz4.codec();
    let mut out = [0u8; PAGE_SIZE];
    let len = codec.compress(&page, &mut out).unwrap().unwrap();
    assert!(store
        .commit(ticket, Encoded::Compressed(&out[..len]))
        .unwrap());
    assert_eq!(store.stats().huge_pages, 0);
    assert_eq!(store.stats().compr_data_size, len as u64);
    assert_eq!(read_page(&store, 1), page);
    // A second commit of the same ticket is stale.
    assert!(!store.commit(ticket, Encoded::Raw).unwrap());

    // Overwritten, discarded or zeroed before the commit: stale, and the newer data stays.
    let newer = text_page(10);
    for change in 0..3 {
        let t = store.write_deferred(2, &page).unwrap().unwrap();
        match change {
            0 => store.write(2, &newer).unwrap(),
            1 => store.discard(2, 1).unwrap(),
            _ => store.write_zeroes(2, 1).unwrap(),
        }
        let before = store.stats();
        assert!(!store.commit(t, Encoded::Compressed(&out[..len])).unwrap());
        assert_eq!(store.stats(), before);
        let expect = if change == 0 { newer } else { [0; PAGE_SIZE] };
        assert_eq!(read_page(&store, 2), expect);
    }
    // A later deferred write makes the older ticket stale too.
    let old = store.write_deferred(3, &page).unwrap().unwrap();
    let new = store.write_deferred(3, &newer).unwrap().unwrap();
    assert_ne!(old, new);
    assert!(!store.commit(old, Encoded::Compressed(&out[..len])).unwrap());
    assert_eq!(read_page(&store, 3), newer);
    // Raw and same-filled commits.
    assert!(store.commit(new, Encoded::Raw).unwrap());
    assert_eq!(read_page(&store, 3), newer);
    let t = store.write_deferred(3, &page).unwrap().unwrap();
    assert!(store.commit(t, Encoded::SameFilled(0x77)).unwrap());
    let mut filled = [0u8; PAGE_SIZE];
    fill_page(&mut filled, 0x77);
    assert_eq!(read_page(&store, 3), filled);
}

#[test]
fn compact_releases_memory_after_scattered_discards() {
    let store = store(512);
    let data: Vec<u8> = (0..512u64)
        .flat_map(|i| {
            if i % 5 == 0 {
                noise_page(i)
            } else {
                text_page(i as u8)
            }
        })
        .collect();
    store.write(0, &data).unwrap();
    for i in (0..512).filter(|i| i % 4 != 0) {
        store.discard(i, 1).unwrap();
    }
    let before = store.stats();
    let freed = store.compact();
    let after = store.stats();
    assert!(freed > 0);
    assert_eq!(after.pages_compacted, freed);
    assert_eq!(
        before.mem_used_total - after.mem_used_total,
        freed * PAGE_SIZE as u64
    );
    assert_eq!(after.compr_data_size, before.compr_data_size);
    for i in 0..512u64 {
        let expect = if i % 4 == 0 {
            data[i as usize * PAGE_SIZE..][..PAGE_SIZE]
                .try_into()
                .unwrap()
        } else {
            [0u8; PAGE_SIZE]
        };
        assert_eq!(read_page(&store, i), expect, "page {i}");
    }
    // Nothing left to release a second time; writes go on normally.
    assert_eq!(store.compact(), 0);
    store.write(1, &text_page(77)).unwrap();
    assert_eq!(read_page(&store, 1), text_page(77));
}

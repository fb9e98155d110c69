//! Fuzzing a store's recovery (see `crate::fuzz`): a store a dead process left, with
//! arbitrary damage to its table words and arena bytes, is taken over. It refuses, or it
//! serves only pages whose check holds: every read either fails or returns a page whose
//! checksum is the one stored with it; and damage to the arena alone never yields other
//! data than was written (CRC32C catches every error of up to three bits, and others but
//! for one in 2^32).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::kept_memory::MemHome;
use super::*;
use crate::fuzz;

const PAGES: u64 = 96;

thread_local! {
    /// One table per thread, reused by every case (a store's table lives as long as the
    /// process; the store built on it is gone before the next case takes it).
    static TABLE: Cell<Option<&'static [AtomicU64]>> = const { Cell::new(None) };
}

fn table() -> &'static [AtomicU64] {
    TABLE.with(|t| match t.get() {
        Some(table) => table,
        None => {
            let len = PageStore::table_len(PAGES).unwrap();
            let table: &'static [AtomicU64] =
                Box::leak((0..len).map(|_| AtomicU64::new(0)).collect());
            t.set(Some(table));
            table
        }
    })
}

/// A page of each kind the store keeps: compressible text, noise (raw), zeros and other
/// fills (in the entry), a fill word too wide for an entry (compressed).
fn page(i: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    match i % 6 {
        0 | 1 => {
            for (k, b) in p.iter_mut().enumerate() {
                *b = b"swap holds every process's memory "[(k + i as usize) % 34] ^ (k / 700) as u8;
            }
        }
        2 => {
            let mut x = i | 1;
            for c in p.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes());
            }
        }
        3 => {}
        4 => fill_page(&mut p, 0xffff_ffff_ffff_ff00 | i),
        _ => fill_page(&mut p, 0x1234_5678_9abc_def0 ^ i),
    }
    p
}

/// The image a killed process leaves: the table words and the segments by index.
struct Image {
    table: Vec<u64>,
    segments: Vec<(usize, Vec<u64>)>,
}

/// Writes every page (some twice, some discarded) into a persistent store and takes the
/// image of its memory, as a crash would leave it.
fn image() -> Image {
    let home = Arc::new(MemHome::default());
    let cfg = StoreConfig::new(PAGES, Algorithm::Lz4);
    let store = PageStore::new_persistent(
        cfg,
        Persistence {
            table: table(),
            home: home.clone(),
        },
    )
    .unwrap();
    for i in 0..PAGES {
        store.write(i, &page(i + 1)).unwrap();
        store.write(i, &page(i)).unwrap();
    }
    store.discard(PAGES - 3, 2).unwrap();
    // Some pages recompressed (zstd objects, flagged in their entries), as a daemon with a cold tier
    // leaves them.
    store.mark_idle(None);
    let recompressed = store
        .recompress(crate::store::Recompress {
            candidates: crate::store::Candidates::Idle { min_age: 0 },
            recompressor: crate::store::Recompressor::Zstd { level: 3 },
            threshold: 0,
            max_pages: PAGES / 2,
            retry_tried: false,
            priority: None,
        })
        .unwrap();
    assert!(recompressed.rewritten > 0, "{recompressed:?}");
    let segments = store.arena.snapshot().into_iter().enumerate().collect();
    let table = table().iter().map(|w| w.load(Relaxed)).collect();
    drop(store);
    Image { table, segments }
}

/// What a page reads as after the image above.
fn expected(i: u64) -> [u8; PAGE_SIZE] {
    if (PAGES - 3..PAGES - 1).contains(&i) {
        [0u8; PAGE_SIZE]
    } else {
        page(i)
    }
}

/// Applies `input` to a copy of `image` as edits of 6 bytes each: where (even: the table,
/// odd: the arena), a little-endian offset, a byte to XOR in. Returns whether every edit
/// went to the arena.
fn damage(image: &Image, input: &[u8]) -> (Vec<u64>, HashMap<usize, Vec<u64>>, bool) {
    let mut table = image.table.clone();
    let mut segments: HashMap<usize, Vec<u64>> = image.segments.iter().cloned().collect();
    let mut order: Vec<usize> = segments.keys().copied().collect();
    order.sort_unstable();
    let mut arena_only = true;
    for edit in input.chunks_exact(6) {
        let at = u32::from_le_bytes([edit[1], edit[2], edit[3], edit[4]]) as usize;
        let x = u64::from(edit[5]) << (8 * (at % 8));
        if edit[0] % 2 == 0 {
            arena_only = false;
            let n = table.len();
            table[(at / 8) % n] ^= x;
        } else if !order.is_empty() {
            let seg = order[(at / SEGMENT_BYTES) % order.len()];
            let words = segments.get_mut(&seg).unwrap();
            words[(at % SEGMENT_BYTES) / 8] ^= x;
        }
    }
    (table, segments, arena_only)
}

/// The checksum stored with page `index` of `store`, when it is a stored page.
fn stored_checksum(store: &PageStore, index: u64) -> Option<u32> {
    let (shard, idx) = store.locate(index);
    match read_lock(shard).get(idx) {
        Some(Slot::Stored { handle, len, .. }) => {
            let mut bytes = [0u8; PAGE_SIZE];
            store.load_stored(index, handle, usize::from(len), &mut bytes)
        }
        _ => None,
    }
}

fn check(image: &Image, input: &[u8]) {
    let (words, segments, arena_only) = damage(image, input);
    for (w, v) in table().iter().zip(&words) {
        w.store(*v, Relaxed);
    }
    let home = Arc::new(MemHome {
        found: Mutex::new(segments),
    });
    let cfg = StoreConfig::new(PAGES, Algorithm::Lz4);
    let Ok((store, _)) = PageStore::recover(
        cfg,
        Persistence {
            table: table(),
            home,
        },
        None,
    ) else {
        return; // refused: fine
    };
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..PAGES {
        if store.read(i, &mut out).is_err() {
            continue;
        }
        if let Some(sum) = stored_checksum(&store, i) {
            assert_eq!(
                page_checksum(&out),
                sum,
                "page {i} read against its checksum"
            );
        }
        if arena_only {
            assert!(out == expected(i), "page {i} read back other data");
        }
    }
    // A store taken over goes on working: writes, compaction, reads.
    store.write(0, &page(7)).unwrap_or(());
    store.compact();
    let _ = store.read(0, &mut out);
}

#[test]
fn fuzz_store_recovery_refuses_or_serves_only_checked_pages() {
    let image = image();
    // The undamaged image recovers whole.
    check(&image, &[]);
    let seeds: Vec<Vec<u8>> = vec![
        vec![],
        // one flipped bit in the first segment, one in the table
        vec![1, 0x40, 0, 0, 0, 0x10],
        vec![0, 0x10, 0, 0, 0, 0x01],
        // a run of arena edits
        (0..8u8).flat_map(|k| [1, k * 13, k, 0, 0, 0x80]).collect(),
    ];
    fuzz::run("store_recovery", &seeds, 6 * 16, |input| {
        check(&image, input)
    });
}

#[test]
fn the_undamaged_image_reads_back_every_page() {
    let image = image();
    let (words, segments, _) = damage(&image, &[]);
    for (w, v) in table().iter().zip(&words) {
        w.store(*v, Relaxed);
    }
    let home = Arc::new(MemHome {
        found: Mutex::new(segments),
    });
    let (store, found) = PageStore::recover(
        StoreConfig::new(PAGES, Algorithm::Lz4),
        Persistence {
            table: table(),
            home,
        },
        None,
    )
    .unwrap();
    assert_eq!(found.pages_stored, PAGES - 2);
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..PAGES {
        store.read(i, &mut out).unwrap();
        assert!(out == expected(i), "page {i}");
    }
}

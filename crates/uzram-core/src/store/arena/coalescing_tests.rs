//! The arena's holes merged, and kept apart from what is written into them.

use std::sync::PoisonError;

use super::tests::{read, LIMITED};
use super::*;
use crate::fuzz::Rng;

/// Bytes of the newest segment past the frontier: neither objects nor holes.
fn frontier_rest(arena: &Arena) -> u64 {
    let meta = arena.meta.lock().unwrap_or_else(PoisonError::into_inner);
    (meta.segments * SEGMENT_SIZE) as u64 - meta.frontier
}

#[test]
fn freed_neighbours_merge_into_one_hole() {
    let arena = Arena::new(0, None, 4096, None);
    let [a, b, c, after] = [1000, 1000, 1000, 8].map(|len| {
        arena
            .store(&vec![1; len - CHECKSUM_BYTES], Some([0; 4]), LIMITED)
            .unwrap()
    });
    // The one in the middle last: it joins the holes on both sides of it.
    arena.free(a, 1000);
    arena.free(c, 1000);
    arena.free(b, 1000);
    let meta = arena.meta.lock().unwrap();
    assert_eq!(meta.holes.run_at(a), Some(3000 / CLASS_GRANULE));
    assert_eq!(meta.holes.run_at(b), None, "not a hole's start");
    meta.holes.check().unwrap();
    drop(meta);
    assert_eq!(arena.usage().free_bytes, 3000);
    assert_eq!(read(&arena, after, 4), vec![1; 4]);
}

#[test]
fn a_hole_larger_than_any_class_serves_pages_and_keeps_its_rest() {
    let arena = Arena::new(0, None, 4096, None);
    let pages: Vec<u64> = (0..SEGMENT_SIZE / PAGE_SIZE)
        .map(|_| arena.store(&[1; PAGE_SIZE], None, LIMITED).unwrap())
        .collect();
    // Three pages side by side: one hole of 12 KiB, larger than the largest class.
    arena.free_many([4, 5, 6].map(|i| (pages[i], PAGE_SIZE)));
    assert_eq!(arena.usage().free_bytes, 3 * PAGE_SIZE as u64);
    for (i, &page) in pages.iter().enumerate().take(7).skip(4) {
        let again = arena.store(&[2; PAGE_SIZE], None, LIMITED).unwrap();
        assert_eq!(again, page, "page {i}");
    }
    assert_eq!(arena.usage().free_bytes, 0);
    assert_eq!(arena.usage().segment_bytes, SEGMENT_SIZE as u64);
    assert_eq!(read(&arena, pages[3], PAGE_SIZE), vec![1; PAGE_SIZE]);
    assert_eq!(read(&arena, pages[7], PAGE_SIZE), vec![1; PAGE_SIZE]);
}

#[test]
fn a_double_free_is_refused_and_never_hands_a_place_out_twice() {
    let arena = Arena::new(0, None, 4096, None);
    let keep = arena.store(&[9; 60], None, LIMITED).unwrap();
    let a = arena.store(&[1; 100], None, LIMITED).unwrap();
    let fence = arena.store(&[9; 60], None, LIMITED).unwrap();
    arena.free(a, 100);
    // Its object count was taken once; the bytes are not a hole twice.
    arena.meta.lock().unwrap().objects += 1;
    arena.free(a, 100);
    assert_eq!(arena.usage().free_bytes, 104);
    let first = arena.store(&[2; 100], None, LIMITED).unwrap();
    let second = arena.store(&[3; 100], None, LIMITED).unwrap();
    assert_eq!(first, a);
    assert_ne!(second, a, "one place handed out twice");
    assert_eq!(read(&arena, first, 100), vec![2; 100]);
    assert_eq!(read(&arena, keep, 60), vec![9; 60]);
    assert_eq!(read(&arena, fence, 60), vec![9; 60]);
}

/// Objects stored and freed at random, with and without something writing at random into
/// the holes (shared memory in a persistent store, which the lists must not depend on):
/// every live object reads back whole, no two overlap, the lists agree with the tables, and
/// every byte of the segments is an object's, a hole's or past the frontier.
#[test]
fn holes_stay_merged_and_what_is_written_into_them_never_hands_out_a_place_in_use() {
    for damage in [false, true] {
        let arena = Arena::new(0, None, 1 << 16, None);
        // Seeded, so that a failure replays.
        let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut live: Vec<(u64, usize, u8)> = Vec::new();
        for step in 0..40_000u32 {
            let r = rng.next_u64();
            if live.len() < 50 || r % 100 < 52 {
                let len = 1 + (rng.next_u64() % 4100) as usize;
                let fill = (step % 251) as u8;
                let h = arena.store(&vec![fill; len], None, LIMITED).unwrap();
                live.push((h, len, fill));
            } else {
                let (h, len, _) = live.swap_remove((r as usize / 100) % live.len());
                arena.free(h, len);
            }
            if step % 1000 == 0 {
                let meta = arena.meta.lock().unwrap();
                meta.holes.check().unwrap();
            }
            if damage && step % 7 == 0 {
                // Into any word of any segment that is not an object's.
                let segments = arena.usage().segment_bytes;
                let at = (rng.next_u64() % segments) & !7;
                let in_use = live
                    .iter()
                    .any(|&(h, len, _)| at >= h && at < h + (class_of(len) * CLASS_GRANULE) as u64);
                if !in_use {
                    set_word(&arena.segments, at, rng.next_u64() % (segments + 64));
                }
            }
        }
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|&(h, len, _)| (h, h + (class_of(len) * CLASS_GRANULE) as u64))
            .collect();
        spans.sort_unstable();
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "objects overlap"
        );
        for &(h, len, fill) in &live {
            assert_eq!(read(&arena, h, len), vec![fill; len], "object at {h}");
        }
        let usage = arena.usage();
        assert_eq!(
            usage.class_bytes + usage.free_bytes + frontier_rest(&arena),
            usage.segment_bytes
        );
        let meta = arena.meta.lock().unwrap();
        meta.holes.check().unwrap();
        drop(meta);
        assert!(
            usage.free_bytes * 5 < usage.segment_bytes,
            "holes {} of {} bytes",
            usage.free_bytes,
            usage.segment_bytes
        );
    }
}

//! Objects replaced by staged pages and given back later (`arena/replaced.rs`): counted once
//! under the limit, given back once, and reclaimed by a compaction that runs between.

use super::tests::{at, compressed, read_page, staged_store, text_page};
use super::*;

/// Pages `0..n` written inline, then staged anew with their objects kept; returns them.
fn replace(store: &PageStore, staging: &tests::MapStaging, n: u64) -> Vec<Replaced> {
    for i in 0..n {
        store.write(i, &text_page(i as u8)).unwrap();
    }
    let items: Vec<(u64, StagedAt)> = (0..n).map(|i| (i, at(0, i as usize, 1))).collect();
    for &(i, at) in &items {
        staging.put(i, at, text_page(100 + i as u8));
    }
    let mut kept = vec![None; items.len()];
    store.stage_many_replacing(&items, Some(&mut kept)).unwrap();
    kept.into_iter().map(Option::unwrap).collect()
}

#[test]
fn a_replaced_object_stays_until_given_back_and_its_page_counts_its_room_in_full() {
    let mut cfg = StoreConfig::new(64, Algorithm::Lz4);
    // Staged pages hold room only under a limit.
    cfg.mem_limit = Some(1 << 30);
    let store = PageStore::new(cfg).unwrap();
    let staging = Arc::new(tests::MapStaging::default());
    store.attach_staging(staging.clone()).unwrap();
    for i in 0..16 {
        store.write(i, &text_page(i as u8)).unwrap();
    }
    let objects = store.arena.usage();
    let before = store.limited_bytes();
    let items: Vec<(u64, StagedAt)> = (0..16).map(|i| (i, at(0, i as usize, 1))).collect();
    for &(i, at) in &items {
        staging.put(i, at, text_page(100 + i as u8));
    }
    let mut kept = vec![None; 16];
    store.stage_many_replacing(&items, Some(&mut kept)).unwrap();
    assert!(kept.iter().all(Option::is_some));
    // Still the arena's, and counted as replaced, not as payload.
    assert_eq!(store.arena.usage().objects, objects.objects);
    let memory = store.memory();
    assert_eq!(memory.replaced_bytes, objects.class_bytes);
    assert_eq!(memory.payload_bytes, 0);
    // Under the limit each page counts its staged room in full, beside the segment its old
    // object is in, as when the object was freed at once (the hole stays in the segment).
    assert_eq!(store.limited_bytes() - before, 16 * STAGED_PAGE_ROOM);
    for i in 0..16 {
        assert_eq!(read_page(&store, i), text_page(100 + i as u8));
    }
    store.free_replaced(kept.into_iter().flatten());
    assert_eq!(store.arena.usage().objects, 0);
    assert_eq!(store.memory().replaced_bytes, 0);
    assert_eq!(
        store.limited_bytes(),
        store.table_bytes() + store.arena.usage().held_bytes + 16 * STAGED_PAGE_ROOM
    );
}

/// Compaction runs while objects wait to be given back (it would give up, waiting for the
/// arena's count to match the table's, if it did not know of them), reclaims their room,
/// and their late free then changes nothing: were it to free their old places, the next
/// objects would be written over the pages compaction moved there.
#[test]
fn a_compaction_between_replacing_and_giving_back_reclaims_the_room_once() {
    let (store, staging) = staged_store(512);
    for i in 32..64 {
        store.write(i, &text_page(i as u8)).unwrap();
    }
    let replaced = replace(&store, &staging, 32);
    // The staged pages installed: new objects beside the replaced ones.
    let blocks: Vec<Vec<u8>> = (0..32).map(|i| compressed(&text_page(100 + i))).collect();
    let mut commits: Vec<Commit<'_>> = (0..32u64)
        .map(|i| {
            let page = text_page(100 + i as u8);
            Commit::new(
                Ticket {
                    page: i,
                    at: at(0, i as usize, 1),
                },
                Encoded::Compressed(&blocks[i as usize]),
                store.checksum_of(&page),
            )
        })
        .collect();
    store.commit(&mut commits).unwrap();
    assert!(commits.iter().all(|c| c.state == CommitState::Installed));
    assert_eq!(store.arena.usage().objects, 96);

    store.compact();
    assert_eq!(store.arena.usage().objects, 64, "compaction reclaimed them");
    assert_eq!(store.memory().replaced_bytes, 0);
    let after = store.arena.usage();
    store.free_replaced(replaced);
    assert_eq!(store.arena.usage(), after, "the late free changed nothing");

    for i in 64..512 {
        store.write(i, &text_page(i as u8)).unwrap();
    }
    for i in 0..512u64 {
        let want = if i < 32 { 100 + i as u8 } else { i as u8 };
        assert_eq!(read_page(&store, i), text_page(want), "page {i}");
    }
}

#[test]
fn staging_without_room_for_the_replaced_objects_is_refused() {
    let (store, _) = staged_store(4);
    let items = [(0, at(0, 0, 1)), (1, at(0, 1, 1))];
    let mut kept = [None; 1];
    assert!(matches!(
        store.stage_many_replacing(&items, Some(&mut kept)),
        Err(CoreError::Config(_))
    ));
    assert_eq!(store.stats().staged_pages, 0);
}

/// What the limit counts while pages wait staged covers what the store holds once they are
/// installed, also where each page comes back larger than the object it replaced (raw
/// pages over 2 KiB objects, among objects that stay): the holes they leave fit none of
/// them. Taking the replaced objects off the staged pages' room let the store pass its limit
/// by 4.3 MB here.
#[test]
fn the_limit_counts_what_the_installed_pages_will_hold() {
    const N: u64 = 2048;
    let mut cfg = StoreConfig::new(2 * N, Algorithm::Lz4);
    cfg.mem_limit = Some(1 << 30);
    let store = PageStore::new(cfg).unwrap();
    let staging = Arc::new(tests::MapStaging::default());
    store.attach_staging(staging.clone()).unwrap();
    // Half text, half noise: compresses to about 2 KiB.
    let half = |seed: u64| {
        let mut page = text_page(seed as u8);
        page[PAGE_SIZE / 2..].copy_from_slice(&tests::noise_page(seed)[PAGE_SIZE / 2..]);
        page
    };
    for i in 0..2 * N {
        store.write(i, &half(i)).unwrap();
    }
    let items: Vec<(u64, StagedAt)> = (0..N).map(|k| (2 * k + 1, at(0, k as usize, 1))).collect();
    let mut kept = vec![None; items.len()];
    for &(page, at) in &items {
        staging.put(page, at, tests::noise_page(1000 + page));
    }
    store.stage_many_replacing(&items, Some(&mut kept)).unwrap();
    let counted = store.limited_bytes();
    store.free_replaced(kept.into_iter().flatten());
    let raw: Vec<[u8; PAGE_SIZE]> = items
        .iter()
        .map(|&(page, _)| tests::noise_page(1000 + page))
        .collect();
    let mut commits: Vec<Commit<'_>> = items
        .iter()
        .zip(&raw)
        .map(|(&(page, at), bytes)| {
            Commit::new(
                Ticket { page, at },
                Encoded::Raw(bytes),
                store.checksum_of(bytes),
            )
        })
        .collect();
    store.commit(&mut commits).unwrap();
    assert!(commits.iter().all(|c| c.state == CommitState::Installed));
    let held = store.table_bytes() + store.arena.usage().held_bytes;
    assert!(
        held <= counted,
        "the store holds {held} bytes; the limit counted {counted} while they were staged"
    );
}

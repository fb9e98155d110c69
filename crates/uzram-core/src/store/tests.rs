//! PageStore unit tests: accounting, table size, thresholds, staged writes.

use std::collections::HashMap;
use std::sync::Mutex;

use super::arena::ObjectBytes;
use super::*;

/// Staging memory for tests: pages by location.
#[derive(Default)]
pub(super) struct MapStaging(Mutex<HashMap<StagedAt, (u64, [u8; PAGE_SIZE])>>);

impl MapStaging {
    pub(super) fn put(&self, page: u64, at: StagedAt, data: [u8; PAGE_SIZE]) {
        self.0.lock().unwrap().insert(at, (page, data));
    }
}

impl StagedPages for MapStaging {
    fn read_staged(&self, page: u64, at: StagedAt, out: &mut [u8; PAGE_SIZE]) -> bool {
        match self.0.lock().unwrap().get(&at) {
            Some((p, data)) if *p == page => {
                *out = *data;
                true
            }
            _ => false,
        }
    }
}

/// A store with test staging attached.
pub(super) fn staged_store(pages: u64) -> (PageStore, Arc<MapStaging>) {
    let store = store(pages);
    let staging = Arc::new(MapStaging::default());
    store.attach_staging(staging.clone()).unwrap();
    (store, staging)
}

thread_local! {
    /// The store's fallible allocations on this thread fail from the Nth on (test hook).
    static FAIL_ALLOCS_FROM: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    static ALLOCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether this fallible allocation fails (see [`fail_allocs_from`]).
pub(super) fn failing_alloc() -> bool {
    let n = ALLOCS.with(|a| a.replace(a.get() + 1));
    FAIL_ALLOCS_FROM.with(|f| f.get().is_some_and(|from| n >= from))
}

thread_local! {
    /// The store's locks (a shard's, through `read_lock`/`write_lock`) this thread took
    /// (test hook): what a [`super::Priority`] in a test checks it was raised for.
    static LOCKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts a store lock this thread takes.
pub(super) fn count_lock() {
    LOCKS.with(|n| n.set(n.get() + 1));
}

/// The store locks this thread took so far.
pub(super) fn locks_taken() -> u64 {
    LOCKS.with(std::cell::Cell::get)
}

/// Makes this thread's fallible store allocations fail from the `from`th on (`None`: none).
pub(super) fn fail_allocs_from(from: Option<usize>) {
    ALLOCS.with(|a| a.set(0));
    FAIL_ALLOCS_FROM.with(|f| f.set(from));
}

pub(super) fn at(slot: usize, index: usize, epoch: u64) -> StagedAt {
    StagedAt::new(slot, index, epoch).unwrap()
}

pub(super) fn store(pages: u64) -> PageStore {
    PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap()
}

/// A page that lz4 compresses to a few hundred bytes.
pub(super) fn text_page(seed: u8) -> [u8; PAGE_SIZE] {
    let mut page = [0u8; PAGE_SIZE];
    for (i, b) in page.iter_mut().enumerate() {
        *b = b"the quick brown fox jumps over the lazy dog "[(i * 7 + usize::from(seed)) % 44]
            ^ (i / 512) as u8;
    }
    page
}

/// A page lz4 cannot compress (xorshift noise).
pub(super) fn noise_page(seed: u64) -> [u8; PAGE_SIZE] {
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

pub(super) fn read_page(store: &PageStore, index: u64) -> [u8; PAGE_SIZE] {
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
            // 8 bytes per entry, 2 of age stamp, plus a few KiB of locks and bookkeeping.
            assert!(per_page < 10.1, "{per_page}");
            assert!((stats.mem_used_total as f64 / pages as f64) < 10.1);
        }
    }
}

#[test]
fn the_table_bytes_a_store_holds_are_known_before_it_is_built() {
    for pages in [1u64, 17, 4096, 1 << 20] {
        assert_eq!(
            PageStore::table_bytes_for(pages).unwrap(),
            store(pages).table_bytes(),
            "{pages} pages"
        );
    }
    assert!(PageStore::table_bytes_for(0).is_err());
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
        store.write_same_filled(4, 0),
        Err(CoreError::OutOfRange { .. })
    ));
    let (staged, _) = staged_store(4);
    assert!(matches!(
        staged.stage(4, at(0, 0, 0)),
        Err(CoreError::OutOfRange { .. })
    ));
    // Staging needs staging memory to read from.
    assert!(matches!(
        store.stage(0, at(0, 0, 0)),
        Err(CoreError::Config(_))
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
    // Back to empty, but for the segment table's first chunk (2 KiB, kept for reuse).
    assert!(
        stats.mem_used_total <= empty + 4096,
        "{} vs {empty}",
        stats.mem_used_total
    );
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
    // Only the holes' bookkeeping may have grown (its first room came with the segment).
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
fn same_filled_writes_match_inline_writes() {
    let inline = store(8);
    let direct = store(8);
    for (i, word) in [0u64, u64::MAX, 0x0101_0101_0101_0101, 0x1234_5678_9abc_def0]
        .into_iter()
        .enumerate()
    {
        let mut page = [0u8; PAGE_SIZE];
        fill_page(&mut page, word);
        inline.write(i as u64, &page).unwrap();
        direct.write_same_filled(i as u64, word).unwrap();
        assert_eq!(read_page(&direct, i as u64), page);
    }
    let (a, b) = (inline.stats(), direct.stats());
    assert_eq!(a.same_pages, b.same_pages);
    assert_eq!(a.pages_stored, b.pages_stored);
    assert_eq!(b.writes, 4);
    assert_eq!(a.mem_used_total, b.mem_used_total);
}

/// Many same-filled pages at once (across shards, over every kind of old content: empty,
/// stored, same-filled, staged) leave the store as the same pages written one at a time;
/// in a persistent store too, where a word that does not fit an entry is compressed.
#[test]
fn same_filled_pages_at_once_match_one_at_a_time() {
    let pages = 200u64;
    let words = [0u64, u64::MAX, 0x0101_0101_0101_0101, 0x1234_5678_9abc_def0];
    let fills: Vec<(u64, u64)> = (0..pages)
        .filter(|i| i % 5 != 3)
        .map(|i| (i, words[(i % 7 % 4) as usize]))
        .collect();
    let persistent =
        || super::kept_memory::KeptMemory::new(StoreConfig::new(pages, Algorithm::Lz4), 0).store();
    let before = |store: &PageStore, staging: Option<&MapStaging>| {
        for i in 0..pages {
            match i % 4 {
                0 => {}
                1 => store.write(i, &noise_page(i)).unwrap(),
                2 => store.write_same_filled(i, 7).unwrap(),
                _ => match staging {
                    Some(staging) => {
                        let at = at(0, i as usize, 1);
                        staging.put(i, at, text_page(i as u8));
                        store.stage(i, at).unwrap();
                    }
                    None => store.write(i, &text_page(i as u8)).unwrap(),
                },
            }
        }
    };
    let check = |many: &PageStore, one: &PageStore| {
        for i in 0..pages {
            assert_eq!(read_page(many, i), read_page(one, i), "page {i}");
        }
        for &(i, word) in &fills {
            let mut page = [0u8; PAGE_SIZE];
            fill_page(&mut page, word);
            assert_eq!(read_page(many, i), page, "page {i}");
        }
        let (a, b) = (many.stats(), one.stats());
        assert_eq!(a.same_pages, b.same_pages);
        assert_eq!(a.pages_stored, b.pages_stored);
        assert_eq!(a.staged_pages, b.staged_pages);
        assert_eq!(a.writes, b.writes);
        assert_eq!(a.mem_used_total, b.mem_used_total);
    };
    let (many, many_staging) = staged_store(pages);
    let (one, one_staging) = staged_store(pages);
    before(&many, Some(&many_staging));
    before(&one, Some(&one_staging));
    many.write_same_filled_many(&fills).unwrap();
    for &(i, word) in &fills {
        one.write_same_filled(i, word).unwrap();
    }
    assert!(many.stats().staged_pages > 0, "some staged pages were left");
    check(&many, &one);

    let many = persistent();
    before(&many, None);
    many.write_same_filled_many(&fills).unwrap();
    let mut expected = Vec::new();
    for i in 0..pages {
        expected.push(read_page(&many, i));
    }
    drop(many);
    let one = persistent();
    before(&one, None);
    for &(i, word) in &fills {
        one.write_same_filled(i, word).unwrap();
    }
    for (i, page) in expected.iter().enumerate() {
        assert_eq!(read_page(&one, i as u64), *page, "page {i}");
    }
    // The words that do not fit an entry were stored as pages, the others as words.
    assert!(one.stats().same_pages > 0);
    assert!(fills.iter().any(|&(_, w)| !Entry::same_fits(w)));

    // A page out of range fails the call before anything is written.
    let store = store(4);
    assert!(matches!(
        store.write_same_filled_many(&[(0, 1), (4, 1)]),
        Err(CoreError::OutOfRange { .. })
    ));
    assert_eq!(store.stats().writes, 0);
}

pub(super) fn compressed(page: &[u8; PAGE_SIZE]) -> Vec<u8> {
    let mut out = [0u8; PAGE_SIZE];
    let len = Algorithm::Lz4
        .codec()
        .compress(page, &mut out)
        .unwrap()
        .unwrap();
    out[..len].to_vec()
}

#[test]
fn staged_pages_read_from_staging_until_committed() {
    let (store, staging) = staged_store(4);
    let page = text_page(9);
    let t = at(2, 7, 1);
    staging.put(1, t, page);
    let ticket = store.stage(1, t).unwrap();
    assert_eq!(ticket, Ticket { page: 1, at: t });
    let stats = store.stats();
    assert_eq!(
        (stats.staged_pages, stats.pages_stored, stats.writes),
        (1, 1, 1)
    );
    assert_eq!(stats.compr_data_size, 0);
    assert_eq!(read_page(&store, 1), page);
    // The staging memory must hold the named page, or the read fails.
    staging.0.lock().unwrap().clear();
    let mut out = [0u8; PAGE_SIZE];
    assert!(matches!(
        store.read(1, &mut out),
        Err(CoreError::Corrupt { index: 1, .. })
    ));
    staging.put(1, t, page);

    let block = compressed(&page);
    let mut commits = [Commit::new(
        ticket,
        Encoded::Compressed(&block),
        page_checksum(&page),
    )];
    store.commit(&mut commits).unwrap();
    assert_eq!(commits[0].state, CommitState::Installed);
    let stats = store.stats();
    assert_eq!((stats.staged_pages, stats.pages_stored), (0, 1));
    assert_eq!(stats.compr_data_size, block.len() as u64);
    staging.0.lock().unwrap().clear();
    assert_eq!(read_page(&store, 1), page, "read from the arena now");
    // The same ticket again is stale, and changes nothing.
    let before = store.stats();
    let mut again = [Commit::new(
        ticket,
        Encoded::Compressed(&block),
        page_checksum(&page),
    )];
    store.commit(&mut again).unwrap();
    assert_eq!(again[0].state, CommitState::Stale);
    assert_eq!(store.stats(), before);
}

#[test]
fn changed_pages_make_their_results_stale() {
    let (store, staging) = staged_store(4);
    let page = text_page(9);
    let newer = text_page(10);
    let block = compressed(&page);
    for change in 0..4 {
        let t = at(0, change, 5);
        staging.put(2, t, page);
        let ticket = store.stage(2, t).unwrap();
        let expect = match change {
            0 => {
                store.write(2, &newer).unwrap();
                newer
            }
            1 => {
                store.discard(2, 1).unwrap();
                [0; PAGE_SIZE]
            }
            2 => {
                store.write_zeroes(2, 1).unwrap();
                [0; PAGE_SIZE]
            }
            _ => {
                // Staged again elsewhere (the same index of a later fill, too).
                let later = at(0, change, 6);
                staging.put(2, later, newer);
                store.stage(2, later).unwrap();
                newer
            }
        };
        let before = store.stats();
        let mut commits = [Commit::new(
            ticket,
            Encoded::Compressed(&block),
            page_checksum(&page),
        )];
        store.commit(&mut commits).unwrap();
        assert_eq!(commits[0].state, CommitState::Stale, "change {change}");
        assert_eq!(store.stats(), before, "change {change}");
        assert_eq!(read_page(&store, 2), expect, "change {change}");
    }
    assert_eq!(store.stats().staged_pages, 1);
}

#[test]
fn commits_of_every_kind_across_shards() {
    let (store, staging) = staged_store(64);
    let pages: Vec<[u8; PAGE_SIZE]> = (0..64u64)
        .map(|i| match i % 3 {
            0 => text_page(i as u8),
            1 => noise_page(i),
            _ => [0x5au8; PAGE_SIZE],
        })
        .collect();
    let blocks: Vec<Vec<u8>> = pages
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i % 3 == 0 {
                compressed(p)
            } else {
                Vec::new()
            }
        })
        .collect();
    let mut tickets = Vec::new();
    for (i, p) in pages.iter().enumerate() {
        let t = at(1, i, 9);
        staging.put(i as u64, t, *p);
        tickets.push(store.stage(i as u64, t).unwrap());
    }
    assert_eq!(store.stats().staged_pages, 64);
    let mut commits: Vec<Commit<'_>> = tickets
        .iter()
        .zip(&pages)
        .zip(&blocks)
        .enumerate()
        .map(|(i, ((t, p), b))| {
            let encoded = match i % 3 {
                0 => Encoded::Compressed(b),
                1 => Encoded::Raw(p),
                _ => Encoded::SameFilled(0x5a5a_5a5a_5a5a_5a5a),
            };
            Commit::new(*t, encoded, page_checksum(p))
        })
        .collect();
    store.commit(&mut commits).unwrap();
    assert!(commits.iter().all(|c| c.state == CommitState::Installed));
    staging.0.lock().unwrap().clear();
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(read_page(&store, i as u64), *p, "page {i}");
    }
    let stats = store.stats();
    assert_eq!(stats.staged_pages, 0);
    assert_eq!(stats.huge_pages, 21);
    assert_eq!(stats.same_pages, 21);
    // A malformed result is refused before anything changes.
    let t = at(2, 0, 1);
    staging.put(0, t, pages[0]);
    let ticket = store.stage(0, t).unwrap();
    let long = vec![1u8; PAGE_SIZE];
    for bad in [&long[..], &[][..]] {
        let mut c = [Commit::new(ticket, Encoded::Compressed(bad), 0)];
        assert!(matches!(store.commit(&mut c), Err(CoreError::Config(_))));
        assert_eq!(c[0].state, CommitState::Waiting);
    }
}

#[test]
fn staged_pages_hold_room_under_the_memory_limit() {
    let probe = store(64);
    let mut cfg = StoreConfig::new(64, Algorithm::Lz4);
    // Room for the table and 96 KiB more: 22 pages can wait staged (a raw page's share of a
    // segment each).
    let room = (64 + 32) * 1024 + 100;
    cfg.mem_limit = Some(probe.stats().mem_used_total + room);
    let fit = room / STAGED_PAGE_ROOM;
    assert_eq!(fit, 22);
    let store = PageStore::new(cfg).unwrap();
    let staging = Arc::new(MapStaging::default());
    store.attach_staging(staging.clone()).unwrap();
    let page = text_page(3);
    let mut tickets = Vec::new();
    let unstaged = store.limited_bytes();
    for i in 0..fit {
        staging.put(i, at(0, i as usize, 1), page);
        tickets.push(store.stage(i, at(0, i as usize, 1)).unwrap());
    }
    // What the limit (and the daemon's room thread) counts of them: a raw page's room each.
    assert_eq!(store.limited_bytes() - unstaged, fit * STAGED_PAGE_ROOM);
    assert!(matches!(
        store.stage(fit, at(0, fit as usize, 1)),
        Err(CoreError::MemLimit { .. })
    ));
    // An inline write needs a segment that the staged pages' room leaves no space for.
    assert!(matches!(
        store.write(25, &noise_page(1)),
        Err(CoreError::MemLimit { .. })
    ));
    // Installing them never fails on the limit, and gives back the room they held.
    let block = compressed(&page);
    let mut commits: Vec<Commit<'_>> = tickets
        .iter()
        .map(|t| Commit::new(*t, Encoded::Compressed(&block), page_checksum(&page)))
        .collect();
    store.commit(&mut commits).unwrap();
    assert!(commits.iter().all(|c| c.state == CommitState::Installed));
    assert!(store.stats().mem_used_total <= store.stats().mem_limit);
    staging.put(24, at(0, 24, 1), page);
    store.stage(24, at(0, 24, 1)).unwrap();
    assert_eq!(read_page(&store, 24), page);
}

/// Stagers on several threads at once never pass the memory limit together: each takes its
/// room before it checks the limit. (Checked first and taken after, two requests that
/// found room for one were both staged, in most rounds here.)
#[test]
fn concurrent_stagers_never_pass_the_limit_together() {
    const REQUEST: u64 = 16;
    const THREADS: u64 = 4;
    let pages = 1024;
    let probe = store(pages);
    let mut cfg = StoreConfig::new(pages, Algorithm::Lz4);
    // Room for one request's staged pages, not two.
    let room = REQUEST * STAGED_PAGE_ROOM + STAGED_PAGE_ROOM / 2;
    cfg.mem_limit = Some(probe.stats().mem_used_total + room);
    let store = PageStore::new(cfg).unwrap();
    let staging = Arc::new(MapStaging::default());
    store.attach_staging(staging.clone()).unwrap();
    let page = text_page(5);
    for p in 0..THREADS * REQUEST {
        staging.put(p, at(0, p as usize, 1), page);
    }
    let mut passed = 0;
    for _ in 0..300 {
        let start = std::sync::Barrier::new(THREADS as usize);
        let staged: u64 = std::thread::scope(|s| {
            let threads: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (store, start) = (&store, &start);
                    s.spawn(move || {
                        let items: Vec<_> = (t * REQUEST..(t + 1) * REQUEST)
                            .map(|p| (p, at(0, p as usize, 1)))
                            .collect();
                        start.wait();
                        u64::from(store.stage_many(&items).is_ok())
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum()
        });
        passed += u64::from(staged > 1);
        assert!(
            store.limited_bytes() <= store.stats().mem_limit,
            "{staged} requests staged"
        );
        store.discard(0, THREADS * REQUEST).unwrap();
        assert_eq!(
            store.staged_room(),
            0,
            "the room of discarded pages given back"
        );
    }
    assert_eq!(passed, 0, "rounds in which two requests were staged");
}

/// Pages staged up to the limit that turn out incompressible are installed raw (15 to a
/// segment) without passing it (but for the segment table's and the holes' bookkeeping's
/// growth by a chunk: 2 KiB and 2.6 KiB per 64 segments, and each segment's first room for
/// holes): each held a raw page's share of a segment while staged. Holding 4,096 bytes
/// each, as before, they passed it by a segment here.
#[test]
fn incompressible_staged_pages_installed_raw_stay_under_the_limit() {
    let pages = 256;
    let probe = store(pages);
    let mut cfg = StoreConfig::new(pages, Algorithm::Lz4);
    let limit = probe.stats().mem_used_total + 8 * SEGMENT_BYTES as u64;
    cfg.mem_limit = Some(limit);
    let store = PageStore::new(cfg).unwrap();
    let staging = Arc::new(MapStaging::default());
    store.attach_staging(staging.clone()).unwrap();
    let raw: Vec<_> = (0..pages).map(noise_page).collect();
    let mut tickets = Vec::new();
    for (i, page) in raw.iter().enumerate() {
        staging.put(i as u64, at(0, i, 1), *page);
        match store.stage(i as u64, at(0, i, 1)) {
            Ok(t) => tickets.push(t),
            Err(CoreError::MemLimit { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(tickets.len() > 100, "{} staged", tickets.len());
    let mut commits: Vec<Commit<'_>> = tickets
        .iter()
        .map(|t| {
            let page = &raw[t.page as usize];
            Commit::new(*t, Encoded::Raw(page), page_checksum(page))
        })
        .collect();
    store.commit(&mut commits).unwrap();
    assert!(commits.iter().all(|c| c.state == CommitState::Installed));
    let s = store.stats();
    assert!(
        s.mem_used_total
            <= limit
                + super::segments::GROWTH_BYTES
                + super::arena::CHUNK_GROWTH_BYTES
                + s.mem_used_total / SEGMENT_BYTES as u64
                    * super::arena::TABLE_BYTES_PER_SEGMENT as u64,
        "{} raw pages installed hold {} bytes, past the limit of {limit}",
        tickets.len(),
        s.mem_used_total
    );
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
    let tables = store.memory().arena_bookkeeping_bytes;
    let freed = store.compact();
    let after = store.stats();
    assert!(freed > 0);
    assert_eq!(after.pages_compacted, freed);
    // The segments released, and what the tables of the holes no longer take.
    assert_eq!(
        before.mem_used_total - after.mem_used_total,
        freed * PAGE_SIZE as u64 + tables - store.memory().arena_bookkeeping_bytes
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

#[test]
fn pages_map_one_to_one_onto_shard_entries() {
    for pages in [1u64, 15, 16, 17, 1000, 4096 * 16 + 5, 1 << 20] {
        let store = store(pages);
        let mut seen = std::collections::HashSet::new();
        for p in 0..pages {
            let (shard, idx) = store.locate(p);
            let s = store
                .shards
                .iter()
                .position(|x| std::ptr::eq(x, shard))
                .unwrap();
            assert_eq!(s, store.shard_of(p));
            assert_eq!(store.page_at(s, idx), p, "{pages}: page {p}");
            assert!(read_lock(shard).get(idx).is_some(), "{pages}: page {p}");
            assert!(seen.insert((s, idx)), "{pages}: page {p} collides");
        }
    }
}

#[test]
fn a_request_is_one_shard_and_distant_regions_are_not_in_lockstep() {
    let store = store(1 << 20);
    // A 64 KiB request (16 aligned pages) takes one shard.
    for first in (0..4096u64).step_by(16) {
        let s = store.shard_of(first);
        assert!((first..first + 16).all(|p| store.shard_of(p) == s));
    }
    // Four writers 64 Ki pages apart (a power of two, as queue regions and swap clusters
    // are) do not walk the shards in lockstep.
    let steps = 256u64;
    let same = (0..steps)
        .filter(|i| {
            let shards: Vec<usize> = (0..4u64)
                .map(|w| store.shard_of(w * 65536 + i * 16))
                .collect();
            shards.iter().all(|&s| s == shards[0])
        })
        .count();
    assert!(same < 8, "{same} of {steps} steps in lockstep");
}

#[test]
fn a_commits_shard_order_is_a_stable_permutation_with_each_shard_once() {
    let store = store(1 << 16);
    assert!(store.shards.len() > 1, "the test needs several shards");
    // Pages spread over every shard, interleaved.
    let commits: Vec<Commit<'_>> = (0..3000u64)
        .map(|i| {
            let ticket = Ticket {
                page: (i * 7919) % (1 << 16),
                at: at(0, 0, 1),
            };
            Commit::new(ticket, Encoded::SameFilled(i), 0)
        })
        .collect();
    let (order, shards) = store.shard_order(&commits).unwrap();
    for (c, &shard) in commits.iter().zip(&shards) {
        assert_eq!(shard as usize, store.shard_of(c.ticket.page));
    }
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..3000).collect::<Vec<u32>>(), "not a permutation");
    let mut runs: Vec<u32> = order.iter().map(|&i| shards[i as usize]).collect();
    runs.dedup();
    let mut distinct = runs.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(runs.len(), distinct.len(), "a shard in two runs: {runs:?}");
    for pair in order.windows(2) {
        let (a, b) = (pair[0] as usize, pair[1] as usize);
        if shards[a] == shards[b] {
            assert!(a < b, "the caller's order within a shard is lost");
        }
    }
}

/// Flips bit `bit` of byte `byte` of page `index`'s stored object (its payload, then its
/// checksum), as damaged memory would.
pub(super) fn damage(store: &PageStore, index: u64, byte: usize, bit: u8) {
    let (shard, idx) = store.locate(index);
    let Some(Slot::Stored { handle, len, .. }) = read_lock(shard).get(idx) else {
        panic!("page {index} is not stored");
    };
    let object = store.object_len(usize::from(len));
    let mut bytes = vec![0u8; object];
    assert!(store.arena.load(handle, object, &mut bytes));
    bytes[byte] ^= 1 << bit;
    store
        .arena
        .write_many([(handle, ObjectBytes::Bytes(&bytes), None)]);
}

#[test]
fn a_damaged_stored_page_fails_its_read_and_is_counted_and_the_others_still_read() {
    let store = store(8);
    let pages = [text_page(1), noise_page(2), text_page(3), noise_page(4)];
    for (i, p) in pages.iter().enumerate() {
        store.write(i as u64, p).unwrap();
    }
    assert_eq!(store.stats().huge_pages, 2);
    let (shard, idx) = store.locate(0);
    let Some(Slot::Stored { len, .. }) = read_lock(shard).get(idx) else {
        panic!("page 0 is not stored");
    };
    // A flipped bit in a compressed payload, in a raw page, and in each stored checksum.
    damage(&store, 0, usize::from(len) / 2, 3);
    damage(&store, 1, 1000, 0);
    damage(&store, 2, usize::from(len) + 2, 7);
    damage(&store, 3, PAGE_SIZE + 3, 1);
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..4 {
        let err = store
            .read(i, &mut out)
            .expect_err("a damaged page read back");
        assert!(
            matches!(err, CoreError::Checksum { index } | CoreError::Corrupt { index, .. } if index == i),
            "page {i}: {err}"
        );
        assert_eq!(err.errno(), -5, "an I/O error");
    }
    assert_eq!(store.stats().checksum_failures, 4);
    // Pages around them still read, and a rewrite heals the page.
    store.write(4, &text_page(5)).unwrap();
    assert_eq!(read_page(&store, 4), text_page(5));
    store.write(0, &pages[0]).unwrap();
    assert_eq!(read_page(&store, 0), pages[0]);
    assert_eq!(store.stats().checksum_failures, 4);
}

#[test]
fn a_store_without_checksums_stores_no_trailer_and_reads_what_it_holds() {
    let mut cfg = StoreConfig::new(4, Algorithm::Lz4);
    cfg.checksums = false;
    let plain = PageStore::new(cfg).unwrap();
    let checked = store(4);
    for s in [&plain, &checked] {
        s.write(0, &text_page(1)).unwrap();
        s.write(1, &noise_page(1)).unwrap();
        assert_eq!(read_page(s, 0), text_page(1));
        assert_eq!(read_page(s, 1), noise_page(1));
    }
    assert_eq!(plain.memory().checksum_bytes, 0);
    assert_eq!(checked.memory().checksum_bytes, 2 * CHECKSUM_BYTES as u64);
    assert_eq!(
        plain.stats().compr_data_size,
        checked.stats().compr_data_size,
        "compr_data_size counts the payload only"
    );
}

#[test]
fn table_words_no_store_writes_fail_reads_and_are_counted() {
    let store = store(4);
    store.write(1, &text_page(1)).unwrap();
    for (page, word) in [
        (0u64, 6u64),
        (2, 7 | (1 << 40)),
        (3, entry::Entry::pack(Slot::Same(9)).word() ^ (1 << 20)),
    ] {
        let (shard, idx) = store.locate(page);
        let mut shard = write_lock(shard);
        match &mut shard.entries_mut() {
            shard::Entries::Owned(v) => v[idx as usize] = word,
            shard::Entries::Kept(_) => unreachable!(),
        }
    }
    let mut out = [0u8; PAGE_SIZE];
    for page in [0, 2, 3] {
        assert!(store.read(page, &mut out).is_err(), "page {page}");
    }
    assert_eq!(store.stats().checksum_failures, 3);
    assert_eq!(read_page(&store, 1), text_page(1));
}

/// A stored entry with a bit of its tag flipped to the side-map fill's tag, or that tag with
/// no word in the side map: an I/O error, counted, never a page of zeros.
#[test]
fn an_entry_damaged_into_a_side_map_fill_fails_its_read() {
    let store = store(4);
    for page in 0..3 {
        store.write(page, &text_page(page as u8)).unwrap();
    }
    let set = |page: u64, f: &dyn Fn(u64) -> u64| {
        let (shard, idx) = store.locate(page);
        let mut shard = write_lock(shard);
        match &mut shard.entries_mut() {
            shard::Entries::Owned(v) => v[idx as usize] = f(v[idx as usize]),
            shard::Entries::Kept(_) => unreachable!(),
        }
    };
    // A stored entry whose tag was damaged into the side map's (tag 7 to 2), the handle bits
    // still set.
    set(0, &|w| {
        assert_eq!(w & 0b111, 0b111, "a stored entry");
        (w & !0b111) | 0b010
    });
    // The bare tag, with no fill word kept for the page.
    set(1, &|_| 2);
    let mut out = [0u8; PAGE_SIZE];
    for page in [0, 1] {
        let read = store.read(page, &mut out);
        assert!(read.is_err(), "page {page} read as {:?}", &out[..8]);
    }
    assert_eq!(store.stats().checksum_failures, 2);
    assert_eq!(read_page(&store, 2), text_page(2));
}

/// Swaps the table entries of pages `a` and `b`, as a stray write or a bug could.
fn swap_entries(store: &PageStore, a: u64, b: u64) {
    let word = |page: u64| {
        let (shard, idx) = store.locate(page);
        let mut shard = write_lock(shard);
        match &mut shard.entries_mut() {
            shard::Entries::Owned(v) => v[idx as usize],
            shard::Entries::Kept(_) => unreachable!(),
        }
    };
    let set = |page: u64, value: u64| {
        let (shard, idx) = store.locate(page);
        let mut shard = write_lock(shard);
        match &mut shard.entries_mut() {
            shard::Entries::Owned(v) => v[idx as usize] = value,
            shard::Entries::Kept(_) => unreachable!(),
        }
    };
    let (wa, wb) = (word(a), word(b));
    set(a, wb);
    set(b, wa);
}

#[test]
fn an_entry_that_points_at_another_pages_object_fails_its_check() {
    // Two compressed pages in one shard, two in others, and two raw ones.
    let swaps = [(0u64, 1u64), (2, 1 << 12), (3, 4)];
    for name_pages in [true, false] {
        let mut cfg = StoreConfig::new(1 << 13, Algorithm::Lz4);
        cfg.checksums_name_pages = name_pages;
        let store = PageStore::new(cfg).unwrap();
        let page = |i: u64| match i {
            3 | 4 => noise_page(i),
            _ => text_page(i as u8),
        };
        for &(a, b) in &swaps {
            store.write(a, &page(a)).unwrap();
            store.write(b, &page(b)).unwrap();
            swap_entries(&store, a, b);
        }
        let mut out = [0u8; PAGE_SIZE];
        for &(a, b) in &swaps {
            for (at, held) in [(a, b), (b, a)] {
                let read = store.read(at, &mut out);
                if name_pages {
                    let err = read.expect_err("another page's object read back");
                    assert!(
                        matches!(err, CoreError::Checksum { index } if index == at),
                        "page {at}: {err}"
                    );
                } else {
                    // What the binding prevents: the other page's bytes, read as this one's.
                    read.unwrap();
                    assert_eq!(out, page(held), "page {at}");
                }
            }
        }
        let failed = if name_pages {
            2 * swaps.len() as u64
        } else {
            0
        };
        assert_eq!(store.stats().checksum_failures, failed);
    }
}

/// A store kept by a daemon whose checksums were not bound to their pages reads back
/// after a takeover that keeps them so, and fails every check if taken over as bound: the
/// setting must come from the store's layout, as `store_segment.rs` reads it.
#[test]
fn a_store_with_unbound_checksums_is_taken_over_as_such() {
    let mut cfg = StoreConfig::new(64, Algorithm::Lz4);
    cfg.checksums_name_pages = false;
    let mut kept = super::kept_memory::KeptMemory::new(cfg, 0);
    let store = kept.store();
    let pages: Vec<_> = (1..9u64).map(|i| text_page(i as u8)).collect();
    for (i, p) in pages.iter().enumerate() {
        store.write(i as u64 + 1, p).unwrap();
    }
    kept.kill(store);
    let (unbound, _) = kept.recover().unwrap();
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(read_page(&unbound, i as u64 + 1), *p);
    }
    drop(unbound);
    kept.cfg.checksums_name_pages = true;
    let (bound, _) = kept.recover().unwrap();
    let mut out = [0u8; PAGE_SIZE];
    for i in 1..=pages.len() as u64 {
        assert!(bound.read(i, &mut out).is_err(), "page {i} read as bound");
    }
}

/// A persistent store of `pages` pages in kept memory, with eight text pages written (pages
/// 5, 10, ... 40), and those pages.
fn kept_with_text_pages(
    pages: u64,
) -> (
    super::kept_memory::KeptMemory,
    PageStore,
    Vec<(u64, [u8; PAGE_SIZE])>,
) {
    let kept = super::kept_memory::KeptMemory::new(StoreConfig::new(pages, Algorithm::Lz4), 0);
    let store = kept.store();
    let written: Vec<_> = (1..9u64).map(|i| (i * 5, text_page(i as u8))).collect();
    for (i, p) in &written {
        store.write(*i, p).unwrap();
    }
    (kept, store, written)
}

/// An entry that reads as a fill kept in the dead process's side map (its word is gone) is
/// a lost page after a takeover, and the store's counts stay right (its cost was never
/// counted: taking it off wrapped the shard's totals).
#[test]
fn a_side_map_fill_entry_is_lost_in_a_takeover_without_wrapping_the_counts() {
    let pages = 64;
    let (mut kept, store, written) = kept_with_text_pages(pages);
    let ext_entry = 2u64;
    assert!(matches!(
        entry::Entry::from_word(ext_entry).slot(),
        entry::Slot::SameExt
    ));
    let table = kept.table;
    table[3].store(ext_entry, Ordering::Relaxed);
    kept.kill(store);
    let (taken, found) = kept.recover().unwrap();
    assert_eq!(found.damaged_entries, 1);
    let s = taken.stats();
    assert_eq!(s.pages_stored, written.len() as u64, "{s:?}");
    assert_eq!(s.same_pages, 0, "{s:?}");
    assert!(taken.read(3, &mut [0u8; PAGE_SIZE]).is_err());
    for (i, p) in &written {
        assert_eq!(read_page(&taken, *i), *p, "page {i}");
    }
}

/// An entry that was zeroed is damage, never an empty page: in a running store its page
/// reads as an I/O error, and a takeover loses that page, not the store. A table an earlier
/// release kept, whose empty pages were zeros and whose stored pages had tag 3, is taken
/// over whole once its zeros are marked and its stored entries moved.
#[test]
fn a_zeroed_entry_reads_as_an_error_and_an_earlier_releases_table_is_taken_over_whole() {
    let pages = 64;
    let (mut kept, store, written) = kept_with_text_pages(pages);
    let table = kept.table;
    let entries = table.len() - tier::Ages::words_for(pages) as usize;
    let held: Vec<usize> = (0..entries)
        .filter(|&i| table[i].load(Ordering::Relaxed) != entry::EMPTY_WORD)
        .collect();
    assert_eq!(held.len(), written.len(), "one entry a written page");
    // How many written pages fail their reads; every other one reads back whole.
    let failing = |store: &PageStore| {
        let mut out = [7u8; PAGE_SIZE];
        let mut failed = 0;
        for (i, p) in &written {
            match store.read(*i, &mut out) {
                Ok(()) => assert_eq!(out, *p, "page {i}"),
                Err(_) => failed += 1,
            }
        }
        failed
    };
    // A table page lost (zeros) under a running store.
    let lost = (held[0], table[held[0]].load(Ordering::Relaxed));
    table[lost.0].store(0, Ordering::Relaxed);
    assert_eq!(
        failing(&store),
        1,
        "the zeroed entry's page, and only it, fails"
    );
    let mut out = [7u8; PAGE_SIZE];
    store.read(1, &mut out).unwrap();
    assert_eq!(out, [0u8; PAGE_SIZE], "a page never written reads as zeros");
    kept.kill(store);
    let (taken, found) = kept.recover().unwrap();
    assert_eq!(found.damaged_entries, 1);
    assert_eq!(found.pages_stored, written.len() as u64 - 1);
    assert_eq!(
        failing(&taken),
        1,
        "the damaged entry's page, and only it, is lost"
    );
    assert_eq!(read_page(&taken, 1), [0u8; PAGE_SIZE]);
    drop(taken);
    // As an earlier release kept it: every empty entry zero, every stored one under tag 3
    // (bit 2 clear). Read as this release's, every page would be lost.
    let earlier = |w: u64| if w & 0b111 == 0b111 { w & !0b100 } else { w };
    kept.rewrite(|i, w| match w {
        _ if i == lost.0 => earlier(lost.1),
        entry::EMPTY_WORD => 0,
        w if i < entries => earlier(w),
        w => w,
    });
    let (unmarked, found) = kept.recover().unwrap();
    assert_eq!(found.damaged_entries, pages);
    assert!(unmarked.read(1, &mut out).is_err());
    drop(unmarked);
    let super::kept_memory::EarlierTaken {
        marked,
        moved,
        store: taken,
        found,
    } = kept.recover_earlier_release().unwrap();
    assert_eq!(found.damaged_entries, 0);
    assert_eq!(marked, (entries - written.len()) as u64);
    assert_eq!(moved, written.len() as u64, "every written page was stored");
    assert_eq!(found.pages_stored, written.len() as u64);
    for (i, p) in &written {
        assert_eq!(read_page(&taken, *i), *p, "page {i}");
    }
    assert_eq!(read_page(&taken, 1), [0u8; PAGE_SIZE]);
    // Marking a marked table, or moving a moved one, changes nothing.
    assert_eq!(PageStore::mark_zero_entries(pages, table).unwrap(), 0);
    assert_eq!(PageStore::move_stored_tags(pages, table).unwrap(), 0);
}

#[test]
fn a_staged_copy_that_no_longer_matches_its_checksum_is_not_read() {
    // The ring's staging checks its copies (batch::staging); the store fails the read.
    struct Damaged;
    impl StagedPages for Damaged {
        fn read_staged(&self, _: u64, _: StagedAt, _: &mut [u8; PAGE_SIZE]) -> bool {
            false
        }
    }
    let store = store(4);
    store.attach_staging(Arc::new(Damaged)).unwrap();
    store.stage(2, at(0, 0, 1)).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    assert!(store.read(2, &mut out).is_err());
    assert_eq!(store.stats().checksum_failures, 1);
}

/// Pages of `[addr, addr + len)` mapped in this process (`/proc/self/pagemap`'s present bit).
fn resident_pages(addr: usize, len: usize) -> usize {
    use std::os::unix::fs::FileExt;
    let start = addr & !4095;
    let pages = (addr + len - start).div_ceil(4096);
    let mut entries = vec![0u8; pages * 8];
    std::fs::File::open("/proc/self/pagemap")
        .unwrap()
        .read_exact_at(&mut entries, (start / 4096 * 8) as u64)
        .unwrap();
    entries.chunks_exact(8).filter(|e| e[7] & 0x80 != 0).count()
}

#[test]
fn compactions_object_list_is_in_memory_before_it_takes_the_locks() {
    // 64 MiB: above glibc's largest mmap threshold, so a fresh mapping, never touched.
    let n = (64 << 20) / std::mem::size_of::<super::arena::Object>();
    let mut objects: Vec<super::arena::Object> = Vec::new();
    objects.try_reserve_exact(n).unwrap();
    let (addr, len) = (
        objects.as_ptr() as usize,
        objects.capacity() * std::mem::size_of::<super::arena::Object>(),
    );
    let pages = resident_pages(addr, len);
    assert!(pages < 16, "{pages} pages of a fresh reservation in memory");
    super::fault_in_spare(&mut objects, super::arena::Object::default());
    let all = (addr + len - (addr & !4095)).div_ceil(4096);
    assert_eq!(
        resident_pages(addr, len),
        all,
        "pages left to fault under the locks"
    );
    assert!(objects.is_empty());
}

/// A staged write of many pages that replaces stored ones frees their objects while
/// compaction runs: compaction takes the arena's lock before the shards', so the write must
/// not take the arena's while it holds a shard's (it did once it had 17 objects to free, and
/// the two waited for each other for good, with every queue thread behind them).
#[test]
fn a_staged_write_freeing_many_objects_never_deadlocks_with_compaction() {
    let (store, staging) = staged_store(4096);
    let store = Arc::new(store);
    const N: u64 = 64;
    for i in 0..N {
        store.write(i, &text_page(i as u8)).unwrap();
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let compactor = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                store.compact();
                // A moment between compactions: one after another, they can keep every
                // shard's lock from the writer for minutes on two cores.
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        })
    };
    // A round each time the writer reports: a deadlock stops the reports, a slow host
    // (CI runs the tests side by side on two cores) only spaces them out.
    const ROUNDS: u64 = 20;
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let store = store.clone();
        std::thread::spawn(move || {
            for round in 0..ROUNDS {
                let items: Vec<(u64, StagedAt)> =
                    (0..N).map(|i| (i, at(0, i as usize, round))).collect();
                for &(i, at) in &items {
                    staging.put(i, at, text_page(i as u8));
                }
                store.stage_many(&items).unwrap();
                for i in 0..N {
                    store.write(i, &text_page((i + round) as u8)).unwrap();
                }
                if tx.send(round).is_err() {
                    return;
                }
            }
        });
    }
    let mut stalled = None;
    for round in 0..ROUNDS {
        if rx.recv_timeout(std::time::Duration::from_secs(30)).is_err() {
            stalled = Some(round);
            break;
        }
    }
    done.store(true, Ordering::Relaxed);
    assert!(
        stalled.is_none(),
        "staged writes and compaction waited for each other (round {stalled:?} never ended)"
    );
    compactor.join().unwrap();
}

#[test]
fn a_commit_that_runs_out_of_memory_anywhere_leaves_no_object_behind() {
    let pages: Vec<[u8; PAGE_SIZE]> = (0..8u8).map(text_page).collect();
    let blocks: Vec<Vec<u8>> = pages.iter().map(compressed).collect();
    let mut failed_at = Vec::new();
    for from in 0..12 {
        let (store, staging) = staged_store(4096);
        let mut commits = Vec::new();
        for (i, page) in pages.iter().enumerate() {
            // Pages far apart, so that the commit spans several shards.
            let index = i as u64 * 509;
            let t = at(0, i, 1);
            staging.put(index, t, *page);
            let ticket = store.stage(index, t).unwrap();
            commits.push(Commit::new(
                ticket,
                Encoded::Compressed(&blocks[i]),
                page_checksum(page),
            ));
        }
        fail_allocs_from(Some(from));
        let result = store.commit(&mut commits);
        fail_allocs_from(None);
        if result.is_err() {
            failed_at.push(from);
            assert_eq!(
                store.arena.usage().objects,
                0,
                "a commit that failed at allocation {from} kept objects it never published"
            );
            store.commit(&mut commits).unwrap();
        }
        assert!(commits.iter().all(|c| c.state == CommitState::Installed));
        assert_eq!(store.arena.usage().objects, pages.len() as u64);
        staging.0.lock().unwrap().clear();
        for (i, page) in pages.iter().enumerate() {
            assert_eq!(read_page(&store, i as u64 * 509), *page);
        }
    }
    assert!(
        failed_at.len() >= 4,
        "too few failures were injected: {failed_at:?}"
    );
}

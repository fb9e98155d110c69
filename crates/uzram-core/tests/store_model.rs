//! Model-based test: random operation sequences against a `HashMap` model of the store.
//!
//! 48 cases × 240 operations = 11,520 operations per run by default (more with
//! `PROPTEST_CASES`), plus the memory-limit model below.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{corpus_page, noise_page, random_page, same_page, Page};
use proptest::prelude::*;
use uzram_core::batch::{FaultPlan, HostSlots, Ring, RingConfig};
use uzram_core::codec::Algorithm;
use uzram_core::store::{Commit, CommitState, Encoded, StagedAt, StagedPages};
use uzram_core::{CoreError, PageStore, StoreConfig, Ticket, PAGE_SIZE};

const PAGES: u64 = 48;
const OPS: usize = 240;

/// What a page's content is made from.
#[derive(Debug, Clone, Copy)]
enum Content {
    Random(u64),
    Noise(u64),
    Same(u64),
    Corpus(usize),
}

impl Content {
    fn page(self) -> Page {
        match self {
            Content::Random(s) => random_page(s),
            Content::Noise(s) => noise_page(s),
            Content::Same(w) => same_page(w),
            Content::Corpus(i) => corpus_page(i),
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Write {
        first: u64,
        contents: Vec<Content>,
    },
    /// Through a ring of small, slow staging slots.
    RingWrite {
        first: u64,
        contents: Vec<Content>,
    },
    /// Wait until everything written through the ring is installed.
    Flush,
    Read {
        first: u64,
        count: u64,
    },
    Discard {
        first: u64,
        count: u64,
    },
    WriteZeroes {
        first: u64,
        count: u64,
    },
    /// Stage a page by hand (as a ring does) at a fresh staging location.
    Stage {
        page: u64,
        content: Content,
    },
    /// Commit the `n`-th outstanding ticket (modulo their number): compressed, raw, or
    /// (for same-filled pages) as a fill word.
    Commit {
        n: usize,
        raw: bool,
    },
    /// Compact the arena (zram's `compact`).
    Compact,
}

fn content() -> impl Strategy<Value = Content> {
    prop_oneof![
        3 => any::<u64>().prop_map(Content::Random),
        1 => any::<u64>().prop_map(Content::Noise),
        2 => prop_oneof![
            Just(0u64),
            Just(u64::MAX),
            Just(0x0101_0101_0101_0101),
            Just(0x1234_5678_9abc_def0),
            any::<u64>()
        ]
        .prop_map(Content::Same),
        3 => any::<usize>().prop_map(Content::Corpus),
    ]
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    (0..PAGES).prop_flat_map(|first| (Just(first), 1..=(PAGES - first).min(6)))
}

fn op() -> impl Strategy<Value = Op> {
    let contents = (0..PAGES).prop_flat_map(|first| {
        (
            Just(first),
            prop::collection::vec(content(), 1..=(PAGES - first).min(4) as usize),
        )
    });
    prop_oneof![
        6 => contents.clone().prop_map(|(first, contents)| Op::Write { first, contents }),
        3 => contents.prop_map(|(first, contents)| Op::RingWrite { first, contents }),
        1 => Just(Op::Flush),
        4 => range().prop_map(|(first, count)| Op::Read { first, count }),
        2 => range().prop_map(|(first, count)| Op::Discard { first, count }),
        1 => range().prop_map(|(first, count)| Op::WriteZeroes { first, count }),
        3 => (0..PAGES, content()).prop_map(|(page, content)| Op::Stage { page, content }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(n, raw)| Op::Commit { n, raw }),
        1 => Just(Op::Compact),
    ]
}

/// Staging memory for hand-staged pages: pages by location.
#[derive(Default)]
struct MapStaging(Mutex<HashMap<StagedAt, (u64, Page)>>);

impl StagedPages for MapStaging {
    fn read_staged(&self, page: u64, at: StagedAt, out: &mut [u8; PAGE_SIZE]) -> bool {
        match self.0.lock().unwrap().get(&at) {
            Some((p, data)) if *p == page => {
                *out = **data;
                true
            }
            _ => false,
        }
    }
}

/// The model: page → content (absent = empty), and which ticket each page's content
/// came from, if staged by hand.
#[derive(Default)]
struct Model {
    pages: HashMap<u64, Page>,
    pending: HashMap<u64, Ticket>,
}

impl Model {
    fn put(&mut self, index: u64, page: Page) {
        self.pages.insert(index, page);
        self.pending.remove(&index);
    }

    fn clear(&mut self, index: u64) {
        self.pages.remove(&index);
        self.pending.remove(&index);
    }

    fn expect(&self, index: u64) -> [u8; PAGE_SIZE] {
        self.pages.get(&index).map_or([0; PAGE_SIZE], |p| **p)
    }
}

fn is_same(page: &[u8; PAGE_SIZE]) -> bool {
    uzram_core::page::same_filled_word(page).is_some()
}

/// Runs `ops`. With `ring`, writes marked `RingWrite` go through a ring of staging slots
/// (hand staging is then skipped: a store has one staging memory); without, pages are
/// staged by hand and `RingWrite` is an inline write.
fn run(ops: &[Op], ring: bool) -> Result<(), TestCaseError> {
    let store = Arc::new(PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap());
    let empty_mem = store.stats().mem_used_total;
    let store_empty_bookkeeping = store.memory().arena_bookkeeping_bytes;
    let staging = Arc::new(MapStaging::default());
    let ring = if ring {
        let device = HostSlots::with_faults(
            Algorithm::Lz4,
            3,
            4,
            FaultPlan::slow(std::time::Duration::from_micros(200)),
        );
        Some(Ring::start(store.clone(), Arc::new(device), RingConfig::default()).unwrap())
    } else {
        store.attach_staging(staging.clone()).unwrap();
        None
    };
    let mut next_epoch = 0;
    let mut codec = Algorithm::Lz4.codec();
    let mut model = Model::default();
    let mut tickets: Vec<(Ticket, Page)> = Vec::new();
    let mut notify_free = 0;
    for op in ops {
        match op {
            Op::Write { first, contents } | Op::RingWrite { first, contents } => {
                let pages: Vec<Page> = contents.iter().map(|c| c.page()).collect();
                let data: Vec<u8> = pages.iter().flat_map(|p| p.iter().copied()).collect();
                match (&ring, op) {
                    (Some(r), Op::RingWrite { .. }) => r.write(*first, &data).unwrap(),
                    _ => store.write(*first, &data).unwrap(),
                }
                for (i, page) in pages.into_iter().enumerate() {
                    model.put(first + i as u64, page);
                }
            }
            Op::Flush => {
                if let Some(r) = &ring {
                    r.flush();
                    prop_assert_eq!(store.stats().staged_pages, 0);
                }
            }
            Op::Read { first, count } => {
                let mut out = vec![0x5au8; (*count as usize) * PAGE_SIZE];
                store.read(*first, &mut out).unwrap();
                for (i, page) in out.chunks_exact(PAGE_SIZE).enumerate() {
                    let index = first + i as u64;
                    prop_assert!(page == model.expect(index), "page {} differs", index);
                }
            }
            Op::Discard { first, count } => {
                store.discard(*first, *count).unwrap();
                for index in *first..first + count {
                    notify_free += u64::from(model.pages.contains_key(&index));
                    model.clear(index);
                }
            }
            Op::WriteZeroes { first, count } => {
                store.write_zeroes(*first, *count).unwrap();
                for index in *first..first + count {
                    model.clear(index);
                }
            }
            Op::Stage { page, content } => {
                if ring.is_some() {
                    continue;
                }
                let data = content.page();
                next_epoch += 1;
                let at = StagedAt::new(1, 0, next_epoch).unwrap();
                staging.0.lock().unwrap().insert(at, (*page, data.clone()));
                let ticket = store.stage(*page, at).unwrap();
                prop_assert_eq!(ticket.page, *page);
                tickets.push((ticket, data.clone()));
                model.put(*page, data);
                model.pending.insert(*page, ticket);
            }
            Op::Commit { n, raw } => {
                if tickets.is_empty() {
                    continue;
                }
                let (ticket, data) = tickets.remove(n % tickets.len());
                let mut out = [0u8; PAGE_SIZE];
                let encoded = if let Some(word) = uzram_core::page::same_filled_word(&data) {
                    Encoded::SameFilled(word)
                } else {
                    match codec.compress(&data, &mut out[..3072]).unwrap() {
                        Some(len) if !raw => Encoded::Compressed(&out[..len]),
                        _ => Encoded::Raw(&data),
                    }
                };
                let fresh = model.pending.get(&ticket.page) == Some(&ticket);
                let checksum = uzram_core::page::page_checksum(&data);
                let mut commits = [Commit::new(ticket, encoded, checksum)];
                store.commit(&mut commits).unwrap();
                let want = if fresh {
                    CommitState::Installed
                } else {
                    CommitState::Stale
                };
                prop_assert_eq!(commits[0].state, want);
                if fresh {
                    model.pending.remove(&ticket.page);
                }
                // Installed pages no longer need their staged copy.
                staging.0.lock().unwrap().remove(&ticket.at);
            }
            Op::Compact => {
                // The accounting below needs no installs running meanwhile.
                if let Some(r) = &ring {
                    r.flush();
                }
                let before = store.stats();
                let tables = store.memory().arena_bookkeeping_bytes;
                let freed = store.compact();
                let after = store.stats();
                prop_assert_eq!(after.pages_compacted, before.pages_compacted + freed);
                // The segments released, and the hole tables' room they had.
                prop_assert_eq!(
                    i128::from(after.mem_used_total) + i128::from(freed * PAGE_SIZE as u64),
                    i128::from(before.mem_used_total) - i128::from(tables)
                        + i128::from(store.memory().arena_bookkeeping_bytes)
                );
            }
        }
        let stats = store.stats();
        // Hand-staged pages count as same-filled only once committed as such.
        let same = model
            .pages
            .iter()
            .filter(|(i, p)| is_same(p) && !model.pending.contains_key(*i))
            .count() as u64;
        prop_assert_eq!(stats.pages_stored, model.pages.len() as u64);
        prop_assert_eq!(stats.same_pages, same);
        prop_assert_eq!(stats.orig_data_size, model.pages.len() as u64 * 4096);
        prop_assert_eq!(stats.notify_free, notify_free);
        prop_assert!(stats.compr_data_size <= (model.pages.len() as u64 - same) * 4096);
        prop_assert!(stats.mem_used_total >= stats.compr_data_size + empty_mem);
        prop_assert!(stats.mem_used_max >= stats.mem_used_total);
    }
    let mut all = vec![0u8; PAGES as usize * PAGE_SIZE];
    store.read(0, &mut all).unwrap();
    for (i, page) in all.chunks_exact(PAGE_SIZE).enumerate() {
        prop_assert!(page == model.expect(i as u64), "final page {} differs", i);
    }
    if let Some(r) = ring {
        r.shutdown();
    }
    // Everything freed: the arena gives all its segments back; the side map and the
    // arena's segment table keep their (small) capacity for the next writes.
    store.discard(0, PAGES).unwrap();
    let stats = store.stats();
    let memory = store.memory();
    prop_assert_eq!(stats.pages_stored, 0);
    prop_assert_eq!(stats.compr_data_size, 0);
    prop_assert_eq!(memory.segment_bytes, 0);
    prop_assert!(memory.side_map_bytes < 16 * 1024);
    prop_assert_eq!(
        stats.mem_used_total - memory.side_map_bytes - memory.arena_bookkeeping_bytes,
        empty_mem - store_empty_bookkeeping
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), OPS)) {
        run(&ops, false)?;
    }

    #[test]
    fn ring_and_store_match_model(ops in prop::collection::vec(op(), OPS)) {
        run(&ops, true)?;
    }

    /// Under a memory limit, single-page writes either succeed or fail with MemLimit and
    /// leave the page as it was; memory never exceeds the limit.
    #[test]
    fn mem_limit_model(
        writes in prop::collection::vec((0..PAGES, content(), any::<bool>()), 200),
        extra in 0u64..300_000,
    ) {
        let probe = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
        let limit = probe.stats().mem_used_total + 40_000 + extra;
        let mut cfg = StoreConfig::new(PAGES, Algorithm::Lz4);
        cfg.mem_limit = Some(limit);
        let store = PageStore::new(cfg).unwrap();
        let mut model = Model::default();
        let mut refused = 0;
        for (index, content, discard) in writes {
            if discard {
                store.discard(index, 1).unwrap();
                model.clear(index);
                continue;
            }
            let page = content.page();
            match store.write(index, &page[..]) {
                Ok(()) => model.put(index, page),
                Err(CoreError::MemLimit { limit: l, used }) => {
                    refused += 1;
                    prop_assert_eq!(l, limit);
                    prop_assert!(used <= limit);
                }
                Err(e) => return Err(TestCaseError::fail(format!("write: {e}"))),
            }
            // The limit governs the table and the arena; the side maps (fill words that
            // do not fit an entry, pending deferred writes) are reported but not limited.
            let stats = store.stats();
            let limited = stats.mem_used_total - store.memory().side_map_bytes;
            prop_assert!(limited <= limit, "{} > {}", limited, limit);
            prop_assert_eq!(stats.mem_limit, limit);
            let mut out = [0u8; PAGE_SIZE];
            store.read(index, &mut out).unwrap();
            prop_assert!(out == model.expect(index));
        }
        let mut all = vec![0u8; PAGES as usize * PAGE_SIZE];
        store.read(0, &mut all).unwrap();
        for (i, page) in all.chunks_exact(PAGE_SIZE).enumerate() {
            prop_assert!(page == model.expect(i as u64));
        }
        let _ = refused;
    }
}

/// The limit is reachable with these sizes: a store this small refuses some writes.
#[test]
fn mem_limit_is_hit_by_incompressible_pages() {
    let probe = PageStore::new(StoreConfig::new(PAGES, Algorithm::Lz4)).unwrap();
    let mut cfg = StoreConfig::new(PAGES, Algorithm::Lz4);
    cfg.mem_limit = Some(probe.stats().mem_used_total + 100_000);
    let store = PageStore::new(cfg).unwrap();
    let results: Vec<bool> = (0..PAGES)
        .map(|i| store.write(i, &noise_page(i)[..]).is_ok())
        .collect();
    assert!(results.iter().any(|ok| *ok) && results.iter().any(|ok| !ok));
    assert_eq!(
        store.stats().failed_writes,
        0,
        "the caller records failed requests"
    );
}

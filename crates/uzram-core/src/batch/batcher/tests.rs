use std::sync::atomic::AtomicUsize;

use super::*;
use crate::batch::{CpuBackend, PageOutcome};
use crate::codec::Algorithm;
use crate::store::StoreConfig;

/// A compressible page stamped with its index and a version, never same-filled.
fn page(index: u64, version: u64) -> Vec<u8> {
    let mut p = Vec::with_capacity(PAGE_SIZE);
    while p.len() < PAGE_SIZE {
        p.extend_from_slice(format!("page {index} version {version}; ").as_bytes());
    }
    p.truncate(PAGE_SIZE);
    p
}

fn store(pages: u64) -> Arc<PageStore> {
    Arc::new(PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap())
}

fn cpu() -> Arc<dyn BatchBackend> {
    Arc::new(CpuBackend::new(Algorithm::Lz4, None))
}

fn read(store: &PageStore, index: u64) -> Vec<u8> {
    let mut out = vec![0u8; PAGE_SIZE];
    store.read(index, &mut out).unwrap();
    out
}

/// Fails every batch, like a GPU that lost its context.
struct Failing;
impl BatchBackend for Failing {
    fn name(&self) -> &'static str {
        "failing"
    }
    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }
    fn compress_batch(&self, _: &[u8], _: usize, _: &mut BatchOutput) -> Result<(), CoreError> {
        Err(CoreError::Backend {
            backend: "failing",
            reason: "injected fault".into(),
        })
    }
}

/// Claims success but leaves every page unset: a backend bug the batcher must catch.
struct Lying;
impl BatchBackend for Lying {
    fn name(&self) -> &'static str {
        "lying"
    }
    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }
    fn compress_batch(
        &self,
        pages: &[u8],
        _: usize,
        out: &mut BatchOutput,
    ) -> Result<(), CoreError> {
        out.reset(pages.len() / PAGE_SIZE);
        out.outcomes
            .iter_mut()
            .for_each(|o| *o = PageOutcome::Unset);
        Ok(())
    }
}

/// The CPU backend, slowed down so writes can overtake a batch in flight.
struct Slow {
    inner: CpuBackend,
    calls: AtomicUsize,
}
impl BatchBackend for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }
    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }
    fn compress_batch(&self, p: &[u8], t: usize, out: &mut BatchOutput) -> Result<(), CoreError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(30));
        self.inner.compress_batch(p, t, out)
    }
}

fn cfg(batch_pages: usize) -> BatcherConfig {
    BatcherConfig {
        batch_pages,
        max_delay: Duration::from_millis(1),
        policy: DeferPolicy::Always,
    }
}

#[test]
fn batched_pages_are_compressed_and_read_back() {
    let s = store(256);
    let b = WriteBatcher::start(s.clone(), cpu(), cpu(), cfg(256)).unwrap();
    for i in 0..200 {
        b.write(i, &page(i, 1)).unwrap();
    }
    b.write(200, &[0u8; PAGE_SIZE]).unwrap(); // same-filled: never queued
    b.flush();
    for i in 0..200 {
        assert_eq!(read(&s, i), page(i, 1), "page {i}");
    }
    let st = b.stats();
    assert_eq!(st.batched_pages, 200);
    assert_eq!(st.inline_pages, 0);
    assert_eq!(st.stale_results, 0);
    let ss = s.stats();
    assert_eq!(ss.same_pages, 1);
    assert!(ss.compr_data_size < ss.orig_data_size / 4, "{ss:?}");
    assert_eq!(
        ss.huge_pages, 0,
        "every batched page must have been committed compressed"
    );
}

#[test]
fn failing_backend_falls_back_to_cpu_and_loses_nothing() {
    let s = store(128);
    let b = WriteBatcher::start(s.clone(), Arc::new(Failing), cpu(), cfg(32)).unwrap();
    for i in 0..100 {
        b.write(i, &page(i, 7)).unwrap();
    }
    b.flush();
    let st = b.stats();
    assert!(st.backend_failures > 0);
    assert_eq!(st.backend_failures, st.fallback_batches);
    assert_eq!(st.left_raw_pages, 0);
    for i in 0..100 {
        assert_eq!(read(&s, i), page(i, 7));
    }
    assert_eq!(s.stats().huge_pages, 0, "fallback output must be committed");
}

#[test]
fn when_fallback_fails_too_pages_stay_raw_and_readable() {
    let s = store(64);
    let b = WriteBatcher::start(s.clone(), Arc::new(Failing), Arc::new(Lying), cfg(64)).unwrap();
    for i in 0..40 {
        b.write(i, &page(i, 3)).unwrap();
    }
    b.flush();
    let st = b.stats();
    assert_eq!(st.left_raw_pages, 40);
    assert_eq!(st.fallback_batches, 0);
    for i in 0..40 {
        assert_eq!(read(&s, i), page(i, 3));
    }
}

#[test]
fn late_batch_results_never_overwrite_newer_writes_or_discards() {
    let s = store(64);
    let slow: Arc<dyn BatchBackend> = Arc::new(Slow {
        inner: CpuBackend::new(Algorithm::Lz4, None),
        calls: AtomicUsize::new(0),
    });
    let b = WriteBatcher::start(s.clone(), slow, cpu(), cfg(8)).unwrap();
    for i in 0..8 {
        b.write(i, &page(i, 1)).unwrap();
    }
    // The batch is now with the slow backend; overtake it.
    std::thread::sleep(Duration::from_millis(10));
    s.write(0, &page(0, 2)).unwrap();
    s.discard(1, 1).unwrap();
    s.write_zeroes(2, 1).unwrap();
    b.flush();
    assert_eq!(read(&s, 0), page(0, 2));
    assert_eq!(read(&s, 1), vec![0u8; PAGE_SIZE]);
    assert_eq!(read(&s, 2), vec![0u8; PAGE_SIZE]);
    for i in 3..8 {
        assert_eq!(read(&s, i), page(i, 1));
    }
    assert_eq!(b.stats().stale_results, 3);
}

#[test]
fn full_queue_compresses_inline() {
    let s = store(64);
    let slow: Arc<dyn BatchBackend> = Arc::new(Slow {
        inner: CpuBackend::new(Algorithm::Lz4, None),
        calls: AtomicUsize::new(0),
    });
    let b = WriteBatcher::start(
        s.clone(),
        slow,
        cpu(),
        BatcherConfig {
            batch_pages: 4,
            max_delay: Duration::from_secs(1),
            policy: DeferPolicy::Always,
        },
    )
    .unwrap();
    let data: Vec<u8> = (0..40).flat_map(|i| page(i, 5)).collect();
    b.write(0, &data).unwrap();
    b.flush();
    let st = b.stats();
    assert!(st.inline_pages > 0, "{st:?}");
    assert_eq!(
        st.inline_pages + st.batched_pages - st.stale_results,
        40,
        "{st:?}"
    );
    for i in 0..40 {
        assert_eq!(read(&s, i), page(i, 5));
    }
}

#[test]
fn backlog_policy_keeps_small_writes_inline() {
    let s = store(1024);
    let b = WriteBatcher::start(
        s.clone(),
        cpu(),
        cpu(),
        BatcherConfig {
            batch_pages: 256,
            max_delay: Duration::from_millis(1),
            policy: DeferPolicy::Backlog { min_pages: 64 },
        },
    )
    .unwrap();
    b.write(0, &page(0, 1)).unwrap();
    let big: Vec<u8> = (100..228).flat_map(|i| page(i, 1)).collect();
    b.write(100, &big).unwrap();
    b.flush();
    let st = b.stats();
    assert_eq!(st.inline_pages, 1);
    assert_eq!(st.batched_pages, 128);
    assert_eq!(read(&s, 0), page(0, 1));
    assert_eq!(read(&s, 150), page(150, 1));
}

#[test]
fn concurrent_writers_and_readers_see_only_written_versions() {
    let s = store(64);
    let b = Arc::new(WriteBatcher::start(s.clone(), cpu(), cpu(), cfg(16)).unwrap());
    std::thread::scope(|scope| {
        for t in 0..3u64 {
            let b = b.clone();
            scope.spawn(move || {
                for v in 1..=60u64 {
                    let i = (v * 7 + t) % 64;
                    b.write(i, &page(i, v * 10 + t)).unwrap();
                }
            });
        }
        let s = s.clone();
        scope.spawn(move || {
            for r in 0..400u64 {
                let i = r % 64;
                let got = read(&s, i);
                if got.iter().all(|&x| x == 0) {
                    continue;
                }
                let text = String::from_utf8_lossy(&got[..40]).to_string();
                assert!(text.starts_with(&format!("page {i} version ")), "{text}");
            }
        });
    });
    b.flush();
    // After everything settled, each page holds one complete, consistent version.
    for i in 0..64 {
        let got = read(&s, i);
        if got.iter().any(|&x| x != 0) {
            let text = String::from_utf8_lossy(&got[..40]).to_string();
            let v: u64 = text
                .split(' ')
                .nth(3)
                .and_then(|v| v.trim_end_matches(';').parse().ok())
                .unwrap();
            assert_eq!(got, page(i, v));
        }
    }
}

#[test]
fn mismatched_algorithm_is_refused() {
    let s = store(8);
    let zstd: Arc<dyn BatchBackend> = Arc::new(CpuBackend::new(Algorithm::Zstd { level: 1 }, None));
    assert!(WriteBatcher::start(s, zstd, cpu(), cfg(4)).is_err());
}

//! What the benches share: where their pages come from, how they are read, the
//! thread-CPU clock they are timed by, and the median they report.

// Each bench compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use uzram_core::page::PAGE_SIZE;

/// The corpora to measure: `UZRAM_CORPUS` (paths, `:`-separated), else
/// `../shared/corpus/{python-heap,mixed-swap}.pages.zst` beside the repository, else the
/// checked-in 2 MiB slices of them (`testdata/`).
pub fn corpus_paths() -> Vec<PathBuf> {
    if let Ok(list) = std::env::var("UZRAM_CORPUS") {
        return list
            .split(':')
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .collect();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let names = ["python-heap", "mixed-swap"];
    let shared: Vec<PathBuf> = names
        .iter()
        .map(|n| repo.join(format!("../shared/corpus/{n}.pages.zst")))
        .collect();
    if shared.iter().all(|p| p.exists()) {
        return shared;
    }
    println!("../shared/corpus not found: using the checked-in testdata slices (2 MiB each)");
    names
        .iter()
        .map(|n| repo.join(format!("testdata/{n}.slice.pages.zst")))
        .collect()
}

/// The bytes of a corpus file (zstd-decoded when it ends in `.zst`): whole pages, or a panic
/// that names the file.
pub fn read_corpus(path: &Path) -> Vec<u8> {
    let raw = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let raw = if path.extension().is_some_and(|e| e == "zst") {
        zstd::stream::decode_all(&raw[..])
            .unwrap_or_else(|e| panic!("zstd -d {}: {e}", path.display()))
    } else {
        raw
    };
    assert!(
        raw.len() % PAGE_SIZE == 0,
        "{}: not whole pages",
        path.display()
    );
    raw
}

/// [`read_corpus`], page by page.
pub fn load_pages(path: &Path) -> Vec<[u8; PAGE_SIZE]> {
    read_corpus(path)
        .chunks_exact(PAGE_SIZE)
        .map(|c| {
            let mut p = [0u8; PAGE_SIZE];
            p.copy_from_slice(c);
            p
        })
        .collect()
}

/// CPU time this thread has used. Timing passes by it, not by the wall clock, keeps other
/// processes on a shared machine out of the numbers (they still share caches).
#[derive(Clone, Copy)]
pub struct Instant(Duration);

impl Instant {
    pub fn now() -> Self {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on every
        // Linux this runs on (a failure leaves `ts` zero, which only spoils a number).
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        Instant(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }

    pub fn elapsed(&self) -> Duration {
        Self::now().0.saturating_sub(self.0)
    }
}

/// The median of `v`, which it leaves sorted (so `v[0]` and `v[v.len() - 1]` are the
/// extremes).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The number in environment variable `name`, or `default` where it is unset or not one.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `bytes` bytes of `corpus`'s pages, the corpus repeated as often as it takes.
pub fn tiled(corpus: &[u8], bytes: usize) -> Vec<u8> {
    let mut data = Vec::with_capacity(bytes);
    while data.len() < bytes && !corpus.is_empty() {
        let take = (bytes - data.len()).min(corpus.len());
        data.extend_from_slice(&corpus[..take]);
    }
    data
}

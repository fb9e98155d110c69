//! The cold tier in RAM: the store's clock, which ages every page once a minute, and the
//! background recompression of pages that went unused (`recompress-*` keys); the control
//! socket's `idle` and `recompress` requests run here too (`uzram idle`, `uzram recompress`).

use std::sync::Arc;
use std::time::Duration;

use uzram_core::store::{Candidates, Recompress, AGE_BUCKETS};
use uzram_core::PageStore;

use crate::config::RecompressSettings;
use crate::control::counters;
use crate::control::proto::{RecompressReport, Stat};

/// The store's tick: ages count in minutes.
const TICK: Duration = Duration::from_secs(60);
/// Most pages a background pass tries per tick: bounds the CPU it takes (zstd at level 3
/// compresses a page in tens of microseconds) while the backlog of a large device drains.
const PAGES_PER_TICK: u64 = 1 << 16;
/// The nice value of the background pass: behind every task that wants the CPU.
const TIER_NICE: i32 = 19;

/// Ticks the store's clock once a minute and, with `settings`, recompresses the pages unused
/// for their idle age. Never returns.
pub(super) fn keep(store: Arc<PageStore>, settings: Option<RecompressSettings>) {
    if let Err(err) = crate::sys::set_thread_nice(TIER_NICE) {
        tracing::warn!(error = %err, "lowering the tier thread's priority failed");
    }
    loop {
        std::thread::sleep(TICK);
        store.tick();
        let Some(s) = settings else { continue };
        let pass = Recompress {
            candidates: Candidates::Idle {
                min_age: s.idle_age_minutes,
            },
            level: s.level,
            threshold: s.threshold,
            max_pages: PAGES_PER_TICK,
        };
        match store.recompress(pass) {
            Ok(done) if done.rewritten > 0 || done.failed > 0 => {
                // The old objects' room is holes in their segments until compaction moves
                // the live objects together and gives the segments back.
                let compacted = if done.rewritten > 0 {
                    store.compact()
                } else {
                    0
                };
                tracing::info!(
                    tried = done.tried,
                    rewritten = done.rewritten,
                    kept = done.kept,
                    saved_bytes = done.saved_bytes,
                    failed = done.failed,
                    compacted,
                    "idle pages recompressed"
                )
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "recompression failed"),
        }
    }
}

/// A recompression pass now, of `kind` (`idle`, `huge` or `huge_idle`; idle: unused for the
/// device's idle age, or marked idle), as `uzram recompress` asks.
pub(super) fn recompress_now(
    store: &PageStore,
    settings: Option<RecompressSettings>,
    kind: &str,
    threshold: Option<u64>,
    level: Option<i32>,
) -> Result<RecompressReport, String> {
    let min_age = settings.map_or(uzram_core::store::MAX_AGE, |s| s.idle_age_minutes);
    let candidates = match kind {
        "idle" => Candidates::Idle { min_age },
        "huge" => Candidates::Huge,
        "huge_idle" => Candidates::HugeIdle { min_age },
        other => {
            return Err(format!(
                "unknown type {other:?}: use idle, huge or huge_idle"
            ))
        }
    };
    let level = level
        .or(settings.map(|s| s.level))
        .unwrap_or(uzram_core::store::DEFAULT_RECOMPRESS_LEVEL);
    let pass = Recompress {
        candidates,
        level,
        threshold: threshold
            .map(|t| t.min(uzram_core::PAGE_SIZE as u64) as usize)
            .or(settings.map(|s| s.threshold))
            .unwrap_or(0),
        max_pages: u64::MAX,
    };
    let before = store.stats().mem_used_total;
    let done = store.recompress(pass).map_err(|e| e.to_string())?;
    if done.rewritten > 0 {
        store.compact();
    }
    Ok(RecompressReport {
        tried: done.tried,
        rewritten: done.rewritten,
        kept: done.kept,
        saved_bytes: done.saved_bytes,
        raced: done.raced,
        failed: done.failed,
        mem_used_before: before,
        mem_used_after: store.stats().mem_used_total,
    })
}

/// The pages holding data by age, as `uzram status` reports them.
pub(super) fn age_stats(store: &PageStore) -> Vec<Stat> {
    const NAMES: [&str; AGE_BUCKETS.len() + 1] = [
        counters::PAGES_AGE_UNDER_1M,
        counters::PAGES_AGE_UNDER_10M,
        counters::PAGES_AGE_UNDER_1H,
        counters::PAGES_AGE_UNDER_1D,
        counters::PAGES_AGE_1D_OR_MORE,
    ];
    NAMES
        .iter()
        .zip(store.ages())
        .map(|(name, value)| Stat {
            name: (*name).to_string(),
            value,
        })
        .collect()
}

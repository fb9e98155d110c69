//! The cold tiers: the store's clock, which ages every page once a minute, the background
//! recompression of pages that went unused (`recompress-*` keys) and their writeback to the
//! backing device (`writeback-*` keys); and what the control socket's `idle`, `recompress`
//! and `writeback` requests run (`uzram idle`, `uzram recompress`, `uzram writeback`).

use std::sync::Arc;
use std::time::Duration;

use uzram_core::store::{Candidates, WritebackCandidates, AGE_BUCKETS};
use uzram_core::PageStore;

use super::budget::Budget;
use super::recompressor::Recompressor;
use crate::config::{RecompressSettings, WritebackSettings};
use crate::control::counters;
use crate::control::proto::{RecompressReport, Stat, WritebackReport};

/// The store's tick: ages count in minutes.
const TICK: Duration = Duration::from_secs(60);
/// Most pages a background pass tries per tick: bounds the CPU it takes (zstd at level 3
/// compresses a page in tens of microseconds) while the backlog of a large device drains.
const PAGES_PER_TICK: u64 = 1 << 16;
/// The nice value of the background pass: behind every task that wants the CPU.
const TIER_NICE: i32 = 19;

/// Compacts the store with this thread raised to the I/O path's priority for the while:
/// compaction holds every shard's lock, and at this thread's nice 19 beside busy CPUs it
/// stopped the writers for as long as the scheduler left it waiting
/// ([`crate::sys::at_io_priority`]). The control thread's `uzram writeback` and `uzram
/// recompress` compact through here too.
fn compact(store: &PageStore) -> u64 {
    crate::sys::at_io_priority(|| store.compact())
}

/// Writeback's settings and the day's budget (shared with the room thread).
pub(super) struct Writeback {
    pub settings: WritebackSettings,
    pub budget: Option<Arc<Budget>>,
}

/// Recompression's settings and the recompressor they name (shared with the control
/// thread's `uzram recompress`).
#[derive(Clone)]
pub(super) struct Recompression {
    pub settings: RecompressSettings,
    pub recompressor: Arc<Recompressor>,
}

/// Ticks the store's clock once a minute; with `recompression`, recompresses the pages
/// unused for their idle age, and with `writeback`, then writes back those unused for its.
/// Runs at the lowest priority; what memory asks for runs on the room thread
/// (`pressure::keep_room`). Never returns.
pub(super) fn keep(
    store: Arc<PageStore>,
    recompression: Option<Recompression>,
    writeback: Option<Writeback>,
) {
    if let Err(err) = crate::sys::set_thread_nice(TIER_NICE) {
        tracing::warn!(error = %err, "lowering the tier thread's priority failed");
    }
    store.prepare_backing_thread();
    let mut last_error = None;
    loop {
        std::thread::sleep(TICK);
        store.tick();
        if let Some(r) = &recompression {
            recompress_idle(&store, r, &mut last_error);
        }
        if let Some(w) = &writeback {
            write_back_idle(&store, &w.settings, w.budget.as_deref());
        }
    }
}

/// The background writeback of one tick: the oldest pages past the idle age, a bounded
/// number of them, within the day's budget.
fn write_back_idle(store: &PageStore, settings: &WritebackSettings, budget: Option<&Budget>) {
    let candidates = WritebackCandidates::Idle {
        min_age: settings.idle_age_minutes,
    };
    match super::budget::budgeted_writeback(store, budget, candidates, PAGES_PER_TICK) {
        Ok(done) if done.pages > 0 => {
            let compacted = compact(store);
            tracing::info!(
                pages = done.pages,
                blocks = done.blocks,
                payload_bytes = done.payload_bytes,
                raced = done.raced,
                compacted,
                "idle pages written back"
            );
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "writeback failed; the pages stay in RAM"),
    }
}

/// The background recompression of one tick.
/// `last_error`: the error the previous tick logged, so that one that stays (a GPU that
/// does not open after a takeover) is logged once, not every minute.
fn recompress_idle(store: &PageStore, r: &Recompression, last_error: &mut Option<String>) {
    let candidates = Candidates::Idle {
        min_age: r.settings.idle_age_minutes,
    };
    let threshold = r.settings.threshold;
    let ran = r
        .recompressor
        .run(store, candidates, threshold, PAGES_PER_TICK, None, false);
    let error = ran.as_ref().err().map(ToString::to_string);
    if error.is_some() && error == *last_error {
        return;
    }
    *last_error = error;
    match ran {
        Ok(done) if done.rewritten > 0 || done.failed > 0 => {
            // The old objects' room is holes in their segments until compaction moves
            // the live objects together and gives the segments back.
            let compacted = if done.rewritten > 0 {
                compact(store)
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
        Err(err) => tracing::warn!(
            error = %err,
            recompressor = r.recompressor.name(),
            "recompression failed"
        ),
    }
}

/// A writeback pass now, of `kind` (`idle`, `huge` or `incompressible`; idle: unused for the
/// device's writeback idle age, or marked idle), as `uzram writeback` asks.
pub(super) fn writeback_now(
    store: &PageStore,
    settings: Option<&WritebackSettings>,
    budget: Option<&Budget>,
    kind: &str,
    max_pages: Option<u64>,
) -> Result<WritebackReport, String> {
    let Some(settings) = settings else {
        return Err(
            "this device has no backing device: create it with --writeback-device (the \
             writeback-device key)"
                .into(),
        );
    };
    let candidates = match kind {
        "idle" => WritebackCandidates::Idle {
            min_age: settings.idle_age_minutes,
        },
        "huge" => WritebackCandidates::Huge,
        "incompressible" => WritebackCandidates::Incompressible,
        other => {
            return Err(format!(
                "unknown type {other:?}: use idle, huge or incompressible"
            ))
        }
    };
    let before = store.stats().mem_used_total;
    let done =
        super::budget::budgeted_writeback(store, budget, candidates, max_pages.unwrap_or(u64::MAX))
            .map_err(|e| e.to_string())?;
    if done.pages > 0 {
        compact(store);
    }
    Ok(WritebackReport {
        pages: done.pages,
        blocks: done.blocks,
        payload_bytes: done.payload_bytes,
        raced: done.raced,
        mem_used_before: before,
        mem_used_after: store.stats().mem_used_total,
        budget_left_bytes: budget.map(Budget::left),
    })
}

/// A recompression pass now, of `kind` (`idle`, `huge` or `huge_idle`; idle: unused for the
/// device's idle age, or marked idle), as `uzram recompress` asks.
///
/// With `level`, or on a device without recompression settings, it writes zstd (at
/// `level`, else the default); otherwise the device's own recompressor.
pub(super) fn recompress_now(
    store: &PageStore,
    recompression: Option<&Recompression>,
    kind: &str,
    threshold: Option<u64>,
    level: Option<i32>,
) -> Result<RecompressReport, String> {
    let settings = recompression.map(|r| r.settings);
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
    let threshold = threshold
        .map(|t| t.min(uzram_core::PAGE_SIZE as u64) as usize)
        .or(settings.map(|s| s.threshold))
        .unwrap_or(0);
    let before = store.stats().mem_used_total;
    let done = match recompression {
        Some(r) => r
            .recompressor
            .run(store, candidates, threshold, u64::MAX, level, true),
        None => Recompressor::Zstd {
            level: level.unwrap_or(uzram_core::store::DEFAULT_RECOMPRESS_LEVEL),
        }
        .run(store, candidates, threshold, u64::MAX, None, true),
    }
    .map_err(|e| e.to_string())?;
    if done.rewritten > 0 {
        compact(store);
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

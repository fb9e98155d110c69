//! The seam between the ring and a compressor: [`SlotBackend`] (slots of staging memory
//! compressed a slot at a time), what it reports when it fails, and the memory it holds.

use std::sync::atomic::AtomicU64;

use super::layout::SlotOutput;
use crate::codec::Algorithm;

/// What a backend failure means for the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// This submission failed; the backend may work for the next one.
    Transient,
    /// The backend is unusable from now on (a lost or faulted device context).
    Sticky,
}

/// A backend failed to compress a slot. The ring compresses that slot's pages on the CPU.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{backend} backend ({kind:?}): {message}")]
pub struct BackendError {
    /// The backend's name.
    pub backend: &'static str,
    /// Whether the backend can go on.
    pub kind: FailureKind,
    /// What went wrong.
    pub message: String,
}

/// Memory a backend holds for its slots, fixed when it starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendMemory {
    /// Page-locked host memory (staging, results).
    pub pinned_host_bytes: u64,
    /// Ordinary host memory.
    pub host_bytes: u64,
    /// Device memory.
    pub device_bytes: u64,
}

/// Slots of staging memory that are compressed a slot at a time. See the module docs.
///
/// The ring promises: a slot's input is written only between its lease and its
/// `submit`; `submit` and `complete` alternate per slot; `complete` is called once per
/// successful `submit`, unless the ring retired the backend as hung (a `submit` or a
/// `complete` past the device deadline): from then on it calls neither again, and no slot
/// is leased again, so no input is written either. A backend promises: results are valid
/// LZ4 (or its algorithm) of exactly the submitted input, or marked rejected; `install` is
/// called at most once per `complete`, and not at all when it returns an error.
pub trait SlotBackend: Send + Sync {
    /// Short name for stats and logs (`gpu`, `host`).
    fn name(&self) -> &'static str;

    /// The algorithm its results are in; a store only accepts its own.
    fn algorithm(&self) -> Algorithm;

    /// Number of slots.
    fn slots(&self) -> usize;

    /// Pages per slot.
    fn slot_pages(&self) -> usize;

    /// The input pages of `slot`, as `slot_pages * 512` little-endian words: writers copy
    /// pages in, readers of staged pages copy them out, the device reads them after
    /// `submit`. Atomic words make all of that sound without a lock.
    fn input(&self, slot: usize) -> &[AtomicU64];

    /// Starts compressing the first `pages` pages of `slot`; results shorter than `limit`
    /// bytes are kept compressed, others are marked raw.
    fn submit(&self, slot: usize, pages: usize, limit: usize) -> Result<(), BackendError>;

    /// Waits for `slot`'s submission and calls `install` with its results, which stay
    /// valid (and the slot's input untouched by the backend) until `install` returns.
    fn complete(
        &self,
        slot: usize,
        install: &mut dyn FnMut(&SlotOutput<'_>),
    ) -> Result<(), BackendError>;

    /// Memory held for the slots.
    fn memory(&self) -> BackendMemory {
        BackendMemory::default()
    }

    /// Backend-specific counters for `uzram status` (`name`, value).
    fn stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

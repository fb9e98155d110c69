//! The batch seam: a [`BatchBackend`] turns a batch of pages into [`Encoded`] results
//! that [`crate::store::PageStore`] stores. The CPU backend ([`CpuBackend`]) spreads a
//! batch over all cores; `uzram-gpu` plugs a CUDA backend in here without the store
//! knowing.

mod batcher;
mod cpu;

pub use batcher::{BatcherConfig, BatcherStats, DeferPolicy, WriteBatcher};
pub use cpu::CpuBackend;

use crate::codec::Algorithm;
use crate::page::PAGE_SIZE;
use crate::CoreError;

/// What one page of a batch became.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoded<'a> {
    /// The page is one `u64` word repeated; no payload is stored.
    SameFilled(u64),
    /// The page compressed to these bytes (shorter than the raw-storage threshold).
    Compressed(&'a [u8]),
    /// The page did not compress below the threshold: store its original bytes.
    Raw,
}

/// Per-page outcome kinds inside a [`BatchOutput`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageOutcome {
    /// Not produced yet.
    #[default]
    Unset,
    /// Same-filled with this word.
    SameFilled(u64),
    /// Compressed to this many bytes at the page's slot in [`BatchOutput::data`].
    Compressed(u16),
    /// Store raw.
    Raw,
}

/// Results of compressing a batch: one fixed-stride slot of `PAGE_SIZE` bytes per page
/// (compressed output is always shorter than a page, or the page is stored raw), so a GPU
/// can write it with one device-to-host copy.
#[derive(Debug, Default)]
pub struct BatchOutput {
    /// `PAGE_SIZE` bytes per page: page `i`'s compressed bytes start at `i * PAGE_SIZE`.
    pub data: Vec<u8>,
    /// Outcome per page.
    pub outcomes: Vec<PageOutcome>,
}

impl BatchOutput {
    /// Makes room for `pages` results, reusing the allocation.
    pub fn reset(&mut self, pages: usize) {
        self.data.resize(pages * PAGE_SIZE, 0);
        self.outcomes.clear();
        self.outcomes.resize(pages, PageOutcome::Unset);
    }

    /// Pages in this output.
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    /// True when the output holds no pages.
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// The encoded form of page `i`, or `None` if the backend left it unset or the
    /// recorded length is impossible (a backend bug the caller must treat as a failure).
    pub fn get(&self, i: usize) -> Option<Encoded<'_>> {
        match *self.outcomes.get(i)? {
            PageOutcome::Unset => None,
            PageOutcome::SameFilled(w) => Some(Encoded::SameFilled(w)),
            PageOutcome::Raw => Some(Encoded::Raw),
            PageOutcome::Compressed(len) => {
                let len = usize::from(len);
                if len == 0 || len >= PAGE_SIZE {
                    return None;
                }
                let start = i * PAGE_SIZE;
                self.data.get(start..start + len).map(Encoded::Compressed)
            }
        }
    }
}

/// Something that compresses whole batches of pages.
pub trait BatchBackend: Send + Sync {
    /// Short name for stats and logs (`cpu`, `gpu`).
    fn name(&self) -> &'static str;

    /// The algorithm this backend produces; a store only accepts its own.
    fn algorithm(&self) -> Algorithm;

    /// Compresses every page of `pages` (a multiple of `PAGE_SIZE` bytes) into `out`,
    /// with compressed output only where it is shorter than `raw_threshold` bytes.
    fn compress_batch(
        &self,
        pages: &[u8],
        raw_threshold: usize,
        out: &mut BatchOutput,
    ) -> Result<(), CoreError>;
}

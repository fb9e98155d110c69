//! The store's memory during a bench, as the daemon has it: the page table and the arena's
//! segments in a region of locked shared memory (`takeover/store_segment.rs`), the segments taken
//! from the block pool over its blocks (`memory/pool.rs`), and the pool kept full by its
//! keeper thread. A store on the process heap would measure memory the daemon never uses:
//! the daemon's installers take segments only from the pool, which the keeper fills by
//! faulting blocks in, and nothing zeroes them.
//!
//! One region serves the whole invocation, sized for its largest store; each run builds a
//! fresh store in it after the previous one is gone (its segments back in the pool). The
//! region is marked for removal before anything of it is locked or touched, so it goes when
//! the process ends, however it ends (an OOM kill included).

use anyhow::Context;
use uzram_core::codec::Algorithm;
use uzram_core::{PageStore, StoreConfig};

use crate::daemon::store;
use crate::memory::pool;
use crate::takeover::store_segment::StoreSegment;

/// See the module docs.
#[derive(Debug)]
pub struct StoreMemory {
    region: StoreSegment,
}

impl StoreMemory {
    /// A region for stores of up to `pages` pages, the pool over its blocks filled to the
    /// daemon's target for a device of that size, and the keeper started. Once per process
    /// (the pool is the global allocator's).
    pub fn new(pages: u64, algorithm: Algorithm) -> anyhow::Result<Self> {
        let cfg = StoreConfig::new(pages, algorithm);
        let region = store::new_region(&cfg, crate::footprint::MIN_ROOM, u32::MAX, true).context(
            "the bench keeps pages in locked shared memory, as the daemon does; run it as root \
             (or with CAP_IPC_LOCK), with kernel.shmmax and kernel.shmall large enough for --total",
        )?;
        let (start, len) = region.blocks();
        pool::init(start, len, region.block_states());
        let target = pool::target_blocks(
            pages.saturating_mul(uzram_core::PAGE_SIZE as u64),
            pool::ram_bytes(),
        );
        if !pool::fill_to(target) {
            anyhow::bail!("could not fill the block pool: not enough memory");
        }
        std::thread::Builder::new()
            .name("uzram-pool".into())
            .spawn(move || pool::keep(target))
            .context("starting the pool keeper")?;
        Ok(Self { region })
    }

    /// A fresh, empty store in the region. The previous one must have been dropped.
    pub fn store(&self, cfg: StoreConfig) -> anyhow::Result<PageStore> {
        store::new_store_in_turn(cfg, &self.region)
    }
}

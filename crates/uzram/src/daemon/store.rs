//! The device's page store in its segment (`takeover::store_segment`): a new one, or the one a dead daemon
//! left behind, with the block pool over the region's blocks.

use std::sync::Arc;

use anyhow::Context;
use uzram_core::store::{PageStore, Persistence, Recovered, StoreConfig};
use uzram_core::PAGE_SIZE;

use crate::config::DeviceConfig;
use crate::footprint::Sizes;
use crate::memory::pool;
use crate::takeover::staging_segment::StagingSegment;
use crate::takeover::store_segment::{Expected, StoreSegment};

pub(crate) fn store_config(cfg: &DeviceConfig) -> StoreConfig {
    let mut store_cfg = StoreConfig::new(cfg.size / PAGE_SIZE as u64, cfg.algorithm);
    store_cfg.mem_limit = cfg.mem_limit;
    store_cfg.checksums = cfg.checksums;
    store_cfg
}

/// A new, empty store for device `device` in a new region, and the pool serving the
/// region's blocks.
pub fn create(cfg: &DeviceConfig, device: u32) -> anyhow::Result<(Arc<PageStore>, StoreSegment)> {
    let store_cfg = store_config(cfg);
    let room = crate::footprint::room_bytes(cfg.queues, cfg.depth, crate::footprint::IO_BUF_BYTES);
    let region = new_region(&store_cfg, room, device, false)?;
    let (start, len) = region.blocks();
    pool::init(start, len, region.block_states());
    let store = new_store(store_cfg, &region)?;
    Ok((Arc::new(store), region))
}

/// A new region for the store `store_cfg` describes (at most its pages): its table, its
/// directory, and blocks for every page stored raw plus slack, and a recovery room of `room`
/// bytes (`footprint::room_bytes`), recorded as the store of `device`. A `scratch` region is
/// marked for removal before it is locked or touched (`StoreSegment::create`).
pub fn new_region(
    store_cfg: &StoreConfig,
    room: usize,
    device: u32,
    scratch: bool,
) -> anyhow::Result<StoreSegment> {
    let sizes = Sizes::of(store_cfg.pages, room).context("sizing the store")?;
    StoreSegment::create(
        sizes,
        &store_cfg.algorithm.to_string(),
        store_cfg.checksums,
        device,
        scratch,
    )
    .context("creating the store's shared memory")
}

/// A new, empty store of `store_cfg.pages` (at most the region's) over `region`'s table and
/// blocks, which the pool serves: a daemon's, whose segments outlive it for the next daemon.
/// The store before it in the region must be gone.
pub fn new_store(store_cfg: StoreConfig, region: &StoreSegment) -> anyhow::Result<PageStore> {
    new_store_at(store_cfg, region, region.home())
}

/// As [`new_store`], for stores that follow one another in `region` within this process
/// (`uzram bench`'s runs): a dropped store's segments go back to the pool for the next.
pub fn new_store_in_turn(
    store_cfg: StoreConfig,
    region: &StoreSegment,
) -> anyhow::Result<PageStore> {
    new_store_at(store_cfg, region, region.home_for_stores_in_turn())
}

fn new_store_at(
    store_cfg: StoreConfig,
    region: &StoreSegment,
    home: crate::takeover::store_segment::Home,
) -> anyhow::Result<PageStore> {
    let len = PageStore::table_len(store_cfg.pages).context("sizing the page table")?;
    let table = region.table();
    let have = table.len();
    let Some(table) = table.get(..len) else {
        anyhow::bail!(
            "a store of {} pages needs {len} table entries; the region has {have}",
            store_cfg.pages
        );
    };
    let persist = Persistence {
        table,
        home: Arc::new(home),
    };
    let store = PageStore::new_persistent(store_cfg, persist).context("creating the page store")?;
    region.set_empties_marked();
    Ok(store)
}

/// A store taken over from a dead daemon.
#[derive(Debug)]
pub struct Taken {
    /// The store.
    pub store: Arc<PageStore>,
    /// Its region.
    pub region: StoreSegment,
    /// The dead daemon's GPU staging, its pages installed: the new ring may reuse it.
    pub staging: Option<StagingSegment>,
    /// What the recovery found.
    pub found: Recovered,
}

/// The store a dead daemon of device `device` left in shared memory segment `shm`, taken
/// over: refused, changing nothing, when it is not root's alone, not that device's store of
/// this size, codec and checksum setting, or damaged. A store an earlier release kept is
/// first brought to this release's form (its empty entries marked, its stored entries'
/// tag moved: layout 7 becomes 8, layouts 6 and 5 versions of their own that no earlier
/// release takes over), which stays so if the takeover fails later on, and a retry finds
/// done. Pages it had staged for the GPU are
/// read from its staging segment (held to their checksums) and installed. `step` is told
/// when each part is done (`takeover::pause`).
pub fn recover(
    cfg: &DeviceConfig,
    device: u32,
    shm: i32,
    step: &mut dyn FnMut(&'static str),
) -> anyhow::Result<Taken> {
    let mut store_cfg = store_config(cfg);
    let algorithm = cfg.algorithm.to_string();
    let expect = Expected {
        device,
        pages: store_cfg.pages,
        algorithm: &algorithm,
        checksums: store_cfg.checksums,
    };
    let region =
        StoreSegment::attach(shm, expect).context("taking over the store's shared memory")?;
    store_cfg.checksums_name_pages = region.checksums_name_pages();
    step("store: attach");
    let mut used = region.used_blocks();
    used.sort_unstable();
    if let Some(w) = used.windows(2).find(|w| w[0] == w[1]) {
        anyhow::bail!(
            "the preserved store is damaged: block {} holds two arena segments",
            w[0]
        );
    }
    let (start, len) = region.blocks();
    let adopted = pool::init_with(start, len, &used, region.block_states());
    step("store: blocks");
    tracing::info!(
        adopted_bytes = adopted * pool::BLOCK,
        "the old daemon's free blocks are the new pool"
    );
    if !region.empties_marked() {
        // A store an earlier release kept wrote an empty page's entry as 0, which this
        // release reads as damage: marked first, then recorded (a takeover that dies in
        // between is finished by the next).
        let marked = PageStore::mark_zero_entries(store_cfg.pages, region.table())
            .context("marking the preserved store's empty entries")?;
        region.set_empties_marked();
        tracing::info!(marked, "the preserved store's empty entries are marked");
        step("store: empties");
    }
    if !region.stored_tags_moved() {
        // Likewise, a store of an earlier layout stored pages under the tag that one flipped
        // bit turns into a fill (`uzram_core`'s `entry.rs`); this release reads it as damage.
        let moved = PageStore::move_stored_tags(store_cfg.pages, region.table())
            .context("moving the preserved store's stored entries to this release's tag")?;
        region.set_stored_tags_moved();
        tracing::info!(
            moved,
            "the preserved store's stored entries have this release's tag"
        );
        step("store: tags");
    } else if region.set_stored_tags_moved() {
        // A layout 6 or 5 store an earlier build of this release moved said so only in a
        // word an earlier release does not read, which would take it over and lose its pages.
        tracing::info!("the preserved store's moved tags are now in its layout version");
    }
    let persist = Persistence {
        table: region.table(),
        home: Arc::new(region.home()),
    };
    let staging = match region.staging().map(|id| (id, StagingSegment::attach(id))) {
        None => None,
        Some((_, Ok(staging))) => Some(staging),
        // Short of memory now: giving it up would lose every staged page for good, so the
        // takeover fails and the next try takes it.
        Some((id, Err(error))) if error.is_for_now() => {
            return Err(error)
                .with_context(|| format!("taking over the GPU staging (segment {id})"))
        }
        Some((id, Err(error))) => {
            tracing::error!(id, %error, "the old daemon's GPU staging cannot be taken over");
            None
        }
    };
    let copy = staging.as_ref().and_then(|s| s.copy(store_cfg.checksums));
    // Nothing refills the pool while the store is taken over (no keeper yet, and a refill
    // could wait on this very device): a staged page that finds no segment is lost at once,
    // not after a wait per page (thousands of pages, minutes of a paused device).
    let _no_waits = crate::memory::pool::takes_without_waiting();
    let (store, found) = PageStore::recover(
        store_cfg,
        persist,
        copy.as_ref()
            .map(|c| c as &dyn uzram_core::store::StagedPages),
    )
    .context("taking over the preserved page store")?;
    step("store: entries");
    Ok(Taken {
        store: Arc::new(store),
        region,
        staging,
        found,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use uzram_core::codec::Algorithm;

    #[test]
    fn a_region_holds_any_store_up_to_its_size_and_refuses_a_larger_one() {
        let cfg = StoreConfig::new(4096, Algorithm::Lz4);
        let region = match new_region(&cfg, crate::footprint::MIN_ROOM, u32::MAX, true) {
            Ok(r) => r,
            // Containers without CAP_IPC_LOCK cannot lock segments.
            Err(e) => {
                println!("SKIP: {e:#}");
                return;
            }
        };
        for pages in [4096, 1000, 4096] {
            let store = new_store(StoreConfig::new(pages, Algorithm::Lz4), &region)
                .expect("a store that fits");
            assert_eq!(store.pages(), pages);
            // A fresh store in the table the one before used starts empty.
            let mut back = [1u8; PAGE_SIZE];
            store.read(999, &mut back).unwrap();
            assert_eq!(back, [0u8; PAGE_SIZE]);
            // A same-filled page whose word fits its entry needs no arena segment (no pool
            // in this test; a persistent store compresses other fills).
            store.write(999, &[0xffu8; PAGE_SIZE]).unwrap();
            store.read(999, &mut back).unwrap();
            assert_eq!(back, [0xffu8; PAGE_SIZE]);
        }
        let err = new_store(StoreConfig::new(1 << 20, Algorithm::Lz4), &region)
            .expect_err("a store larger than the region");
        assert!(format!("{err:#}").contains("the region has"), "{err:#}");
    }
}

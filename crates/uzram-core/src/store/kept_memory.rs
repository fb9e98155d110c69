//! A persistent store's memory in tests: segments in plain memory ([`MemHome`]), and the
//! table and segments a killed process leaves for a takeover ([`KeptMemory`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::*;

/// Segments in plain memory, found by index: what a daemon's region does, for tests.
#[derive(Debug, Default)]
pub(super) struct MemHome {
    /// Segment words a recovery finds, by index.
    pub(super) found: Mutex<HashMap<usize, Vec<u64>>>,
}

impl SegmentHome for MemHome {
    fn alloc(&self) -> Option<SegmentWords> {
        Some((0..SEGMENT_BYTES / 8).map(|_| AtomicU64::new(0)).collect())
    }
    fn placed(&self, _: usize, _: *const AtomicU64) {}
    fn removed(&self, _: usize) {}
    fn find(&self, index: usize) -> Option<SegmentWords> {
        let words = self.found.lock().unwrap().get(&index)?.clone();
        Some(words.into_iter().map(AtomicU64::new).collect())
    }
}

/// The memory a persistent store lives in beyond its process: a table that lives as long
/// as the test process (leaked, as a daemon's shared segment outlives the daemon), and what
/// [`KeptMemory::kill`] took of the table and the arena's segments.
pub(super) struct KeptMemory {
    pub(super) table: &'static [AtomicU64],
    pub(super) cfg: StoreConfig,
    words: Vec<u64>,
    segments: HashMap<usize, Vec<u64>>,
}

impl KeptMemory {
    /// Memory for a store of `cfg`, its table words set to `fill` (what an earlier store
    /// may have left there).
    pub(super) fn new(cfg: StoreConfig, fill: u64) -> Self {
        let len = PageStore::table_len(cfg.pages).unwrap();
        Self {
            table: Box::leak((0..len).map(|_| AtomicU64::new(fill)).collect()),
            cfg,
            words: Vec::new(),
            segments: HashMap::new(),
        }
    }

    pub(super) fn persist(&self, home: MemHome) -> Persistence {
        Persistence {
            table: self.table,
            home: Arc::new(home),
        }
    }

    /// A new store in this memory (segments from a fresh [`MemHome`]).
    pub(super) fn store(&self) -> PageStore {
        PageStore::new_persistent(self.cfg.clone(), self.persist(MemHome::default())).unwrap()
    }

    /// Keeps what `store` leaves when its process is killed: its table and its segments.
    pub(super) fn kill(&mut self, store: PageStore) {
        self.segments = store.arena.snapshot().into_iter().enumerate().collect();
        self.words = self.table.iter().map(|w| w.load(Relaxed)).collect();
        drop(store);
    }

    /// A new process's store over the memory the last [`KeptMemory::kill`] kept (no
    /// backing device or dictionary attached yet).
    pub(super) fn recover(&self) -> Result<(PageStore, Recovered), CoreError> {
        self.restore();
        self.recover_as_is()
    }

    /// [`KeptMemory::recover`] of a table an earlier release kept: its zero entries are
    /// marked empty and its stored entries moved to their tag first.
    pub(super) fn recover_earlier_release(&self) -> Result<EarlierTaken, CoreError> {
        self.restore();
        let marked = PageStore::mark_zero_entries(self.cfg.pages, self.table)?;
        let moved = PageStore::move_stored_tags(self.cfg.pages, self.table)?;
        let (store, found) = self.recover_as_is()?;
        Ok(EarlierTaken {
            marked,
            moved,
            store,
            found,
        })
    }

    /// Changes the kept table's words, as something outside the process might have.
    pub(super) fn rewrite(&mut self, f: impl Fn(usize, u64) -> u64) {
        for (i, w) in self.words.iter_mut().enumerate() {
            *w = f(i, *w);
        }
    }

    fn restore(&self) {
        for (w, v) in self.table.iter().zip(&self.words) {
            w.store(*v, Relaxed);
        }
    }

    fn recover_as_is(&self) -> Result<(PageStore, Recovered), CoreError> {
        let home = MemHome {
            found: Mutex::new(self.segments.clone()),
        };
        PageStore::recover(self.cfg.clone(), self.persist(home), None)
    }
}

/// A table an earlier release kept, taken over ([`KeptMemory::recover_earlier_release`]).
pub(super) struct EarlierTaken {
    /// Zero entries marked empty.
    pub marked: u64,
    /// Stored entries moved to this release's tag.
    pub moved: u64,
    pub store: PageStore,
    pub found: Recovered,
}

//! How a ring runs: [`RingConfig`] and the [`ThreadHook`] it calls on its threads.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

/// Called first thing on every thread the ring starts, with the thread's name (the daemon
/// uses it to make installer threads as careful about memory as queue threads).
pub type ThreadHook = Arc<dyn Fn(&str) + Send + Sync>;

/// How a [`Ring`](super::Ring) runs.
#[derive(Clone)]
pub struct RingConfig {
    /// Longest the first page of a partly filled slot waits before the slot is submitted.
    pub max_delay: Duration,
    /// Longest a writer that finds every slot busy waits for one to be freed before it
    /// compresses its pages inline. Compressing inline costs the CPU several times what the
    /// slot path does; a short wait while the installers catch up costs nothing. A wait
    /// that ends with no slot freed marks the ring stalled, and writers compress inline at
    /// once until a slot is freed again (a wedged device slows each writer once, not every
    /// write). Zero: never wait.
    pub slot_wait: Duration,
    /// Installer threads.
    pub installers: usize,
    /// Decode every n-th compressed page on the CPU before installing it (0: never).
    pub spot_check_every: u64,
    /// Backend failures in a row after which the backend is retired.
    pub max_failures: u32,
    /// Longest an installer waits for one slot's results, and longest the submitter's
    /// `submit` of one slot may take. A backend that hangs without an error (a wedged GPU,
    /// a driver call that never returns) would otherwise hold its slots for good: their
    /// pages readable from staging but never installed, and a flush or stop that never
    /// returns. Past it the ring's watcher retires the backend and installs the slot's pages
    /// from their staged copies on the CPU; the thread stuck in the backend is left behind.
    /// A slot takes milliseconds on a GPU, so the default leaves room for a device shared
    /// with other work.
    pub device_deadline: Duration,
    /// Run on every thread the ring starts.
    pub on_thread_start: Option<ThreadHook>,
    /// Where the slots' books live ([`book_words`](crate::batch::book_words) words): `None`,
    /// in the ring; or in memory the caller keeps beyond the process, which (with a backend
    /// whose inputs are kept too) lets a later process recover the pages staged when this
    /// one died ([`StagedCopy`](crate::batch::StagedCopy)). The caller must have recovered
    /// them before: the ring starts by forgetting every page the books name.
    pub books: Option<&'static [AtomicU64]>,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            max_delay: Duration::from_millis(2),
            slot_wait: Duration::from_millis(2),
            installers: 4,
            spot_check_every: 64,
            max_failures: 8,
            device_deadline: Duration::from_secs(10),
            on_thread_start: None,
            books: None,
        }
    }
}

impl std::fmt::Debug for RingConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingConfig")
            .field("max_delay", &self.max_delay)
            .field("installers", &self.installers)
            .field("spot_check_every", &self.spot_check_every)
            .field("max_failures", &self.max_failures)
            .field("device_deadline", &self.device_deadline)
            .field("kept_books", &self.books.is_some())
            .finish_non_exhaustive()
    }
}

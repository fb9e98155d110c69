//! uzram-core: everything uzram needs to keep 4 KiB pages compressed in memory,
//! with no knowledge of ublk or CUDA.
//!
//! - [`page`]: page constants and same-filled page detection (zram's `same_pages`).
//! - [`codec`]: the [`codec::PageCodec`] trait with LZ4 and zstd implementations.
//! - [`store`]: [`store::PageStore`], a sharded page table over a size-class arena; it
//!   knows pages and tickets (staged writes), not batches.
//! - [`batch`]: above the store: the asynchronous seam [`batch::SlotBackend`] (slots of
//!   staging memory compressed whole, by a GPU in `uzram-gpu`) and the [`batch::Ring`]
//!   that stages written pages into those slots and installs the results.

pub mod batch;
pub mod codec;
pub mod error;
pub mod page;
pub mod store;

pub use error::CoreError;
pub use page::{PAGE_SHIFT, PAGE_SIZE, PAGE_WORDS, SECTOR_SHIFT};
pub use store::{MemoryUsage, PageStore, Stats, StoreConfig, Ticket};

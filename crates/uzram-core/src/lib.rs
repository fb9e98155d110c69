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
//!
//! The crate is safe Rust. The three exceptions sit behind features, each in one module:
//! the fast LZ4 decoder (`unsafe-lz4`, `codec/lz4/decode_fast.rs`), the streaming copies
//! into staging memory and arena lines and the in-place view of staged words
//! (`unsafe-stream`, `page/stream.rs`, `page/view.rs`), and the arena's
//! zeroed allocation and object copy (`unsafe-arena`, `store/words.rs`, which streams with
//! both features on x86_64). Without the three features the whole
//! crate is `forbid(unsafe_code)`; with them every other module still denies `unsafe` (the
//! pattern lz4_flex uses for its safe and unsafe decoders). Test scaffolding adds a fourth,
//! never in the binary: liblz4 as the LZ4 reference (`liblz4-reference`, `fuzz/liblz4.rs`).

#![cfg_attr(
    not(any(
        feature = "unsafe-lz4",
        feature = "unsafe-stream",
        feature = "unsafe-arena",
        feature = "liblz4-reference"
    )),
    forbid(unsafe_code)
)]
#![cfg_attr(
    any(
        feature = "unsafe-lz4",
        feature = "unsafe-stream",
        feature = "unsafe-arena",
        feature = "liblz4-reference"
    ),
    deny(unsafe_code)
)]

pub mod batch;
pub mod codec;
pub mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fuzz;
pub mod page;
pub mod store;

pub use error::CoreError;
pub use page::{PAGE_SHIFT, PAGE_SIZE, PAGE_WORDS, SECTOR_SHIFT};
pub use store::{MemoryUsage, PageStore, Stats, StoreConfig, Ticket};

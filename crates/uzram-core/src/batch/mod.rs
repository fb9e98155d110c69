//! Above the store: the asynchronous batch seam and the ring that drives it.
//!
//! - [`SlotBackend`] (`backend.rs`): a backend owns slots of staging memory. Writers fill
//!   a slot's input pages, the ring submits the slot whole, and the backend later hands the
//!   results over (`complete`). A GPU implements it in `uzram-gpu` (pinned staging, one
//!   submission per slot). `HostSlots` (`host.rs`, with the `test-support` feature) is
//!   the synchronous CPU implementation that the ring's tests run against, with
//!   injectable faults.
//! - [`SlotOutput`]: the result format every backend produces (`layout.rs`).
//! - [`Placer`] (`place.rs`): a backend's copy engine, which lands runs of a slot's
//!   compressed pages in the store's memory straight from the device.
//! - [`Ring`]: stages each written page once into a leased slot, submits full (or timed
//!   out) slots, and installs results into the [`crate::PageStore`] from a small pool of
//!   installer threads while other slots are on the device (`ring/`). The store only sees
//!   pages and tickets, and reads staged pages through the books of `staging.rs`.
//! - [`PageSource`] (`source.rs`): a write's bytes that the ring has copied straight into
//!   its slots instead of copying them itself ([`Ring::write_from`]; ublk's user copy).

mod backend;
#[cfg(any(test, feature = "test-support"))]
mod host;
mod layout;
mod place;
mod ring;
mod source;
mod staging;

pub use backend::{BackendError, BackendMemory, FailureKind, SlotBackend};
#[cfg(any(test, feature = "test-support"))]
pub use host::{CopyEngine, FailAt, FaultPlan, Hang, HostSlots};
pub use layout::{meta_bytes, PageResult, SlotOutput, SIZE_RAW, SIZE_REJECTED, SIZE_SAME_FILLED};
pub use place::{offset_within, PlaceRun, Placer};
pub use ring::{Ring, RingConfig, RingStats, SlotTimes, ThreadHook};
pub use source::{BytesSource, LeasedWords, PageSource};
pub use staging::{book_words, StagedCopy, Words};

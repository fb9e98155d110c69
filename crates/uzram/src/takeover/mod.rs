//! Crash and handover: what outlives a daemon, and how the next one takes the device over.
//!
//! - [`store_segment`], [`staging_segment`] and [`floors_segment`]: the store (page table,
//!   arena blocks, recovery room), the GPU staging and the backing device's nonce floors in
//!   root-only SysV shared memory, checked on every attach; one [`segment::SegmentError`] for
//!   all.
//! - [`record`]: a device's recovery record: typed settings, validated as a config file is.
//! - [`orphan`]: finding a device whose daemon died, and giving its recovery room back.
//! - [`carry`]: the counters a daemon leaves for the next one.
//! - [`dictionary`]: the store's recompression dictionary, kept in the store segment.
//! - [`leave`]: exiting with the device and store left to the next daemon.
//! - [`standby`]: the process that takes a config's device over when its daemon dies.
//! - [`pause`]: the I/O pause of a takeover, step by step.

pub mod carry;
pub mod dictionary;
pub mod floors_segment;
pub mod leave;
pub mod orphan;
pub mod pause;
pub mod record;
mod record_layout;
pub mod segment;
pub mod staging_segment;
pub mod standby;
pub mod store_segment;

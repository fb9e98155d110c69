//! [`Placer`]: a backend's copy engine, which lands runs of a slot's compressed pages straight
//! in the store's memory from the device's own copy of them, so that the installers do not
//! copy those bytes themselves.
//!
//! Why: the installers' copy of each compressed page into the store's arena was about half of
//! their CPU, a twentieth of a CPU-second per GiB of pages (docs/gpu.md). A GPU's copy engine
//! moves those bytes without the CPU, if the device packs each block in the store's own
//! object form (the block, room for its 4-byte checksum, rounded to 8 bytes): then blocks
//! that lie next to each other in the device's packed buffer and in the arena are one copy.
//!
//! The store decides where every object goes and names only that room to the placer; it
//! then writes each placed object's last word and checksum itself, from the host's copy of
//! the results, and compares the last object of every run with that copy. Nothing the
//! device wrote is trusted beyond what that check and every later read's checksum hold.

use std::sync::atomic::AtomicU64;

/// One copy: `len` bytes from offset `from` of the slot's packed results (the device's
/// copy) into `to` (store memory, `len / 8` words; `len` and `from` are multiples of 8).
#[derive(Debug, Clone, Copy)]
pub struct PlaceRun<'a> {
    /// Offset in the slot's packed results.
    pub from: usize,
    /// Where the bytes go.
    pub to: &'a [AtomicU64],
}

impl PlaceRun<'_> {
    /// Bytes the run copies.
    pub fn len(&self) -> usize {
        self.to.len() * 8
    }

    /// True for a run of no bytes.
    pub fn is_empty(&self) -> bool {
        self.to.is_empty()
    }
}

/// Where `bytes` starts in `packed`, when it lies wholly inside it: a result's place in the
/// packed buffer it was handed over in (each [`Placer::packed_offset`]).
pub fn offset_within(packed: &[u8], bytes: &[u8]) -> Option<usize> {
    let at = (bytes.as_ptr() as usize).checked_sub(packed.as_ptr() as usize)?;
    (at.checked_add(bytes.len())? <= packed.len()).then_some(at)
}

/// A backend's copy engine for one completed slot; see the module docs.
pub trait Placer: Sync {
    /// Where `bytes`, a result handed over in this slot's [`super::SlotOutput`], starts in
    /// the packed results; `None` when it is not one of them.
    fn packed_offset(&self, bytes: &[u8]) -> Option<usize>;

    /// Whether the copy engine can write `to` (memory registered with the device).
    fn reaches(&self, to: &[AtomicU64]) -> bool;

    /// Copies every run and waits until they have landed. False when they did not all land:
    /// nothing is copying any more then, and the caller writes those objects itself.
    fn place(&self, runs: &[PlaceRun<'_>]) -> bool;
}

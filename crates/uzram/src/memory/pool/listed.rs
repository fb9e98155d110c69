//! Which of the pool's blocks are on its free list, a bit a block in the daemon's private
//! memory.
//!
//! Why: the list's links live in the free blocks themselves, in shared memory that a stray
//! write into a freed block can damage. A link that names no block is caught by its
//! address; one that names another block's start is not: that block may be in use (it
//! would be handed out twice) or given back to the system. The bit says whether the block
//! the link names is really free, and a block pushed again while it is still free is
//! refused for the same reason. What no bit can tell: a block freed twice with a new owner
//! in between (the second free lists the new owner's block), and a link that skips ahead
//! to a block further down the list (the count at the list's end shows that one).
//!
//! Every change is made under the pool's spin lock, so the bits need no stronger ordering
//! than that lock gives.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

static BITS: OnceLock<Box<[AtomicU64]>> = OnceLock::new();

/// Makes room for `blocks` bits, all clear. Once, before the pool's first push (a second
/// call keeps the first's bits); they are never freed (the pool lives as long as the
/// process).
pub(super) fn init(blocks: usize) {
    let _ = BITS.set(
        (0..blocks.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect(),
    );
}

fn words() -> &'static [AtomicU64] {
    BITS.get().map_or(&[], |b| b)
}

/// Whether block number `block` is on the free list (false where no bits are kept).
pub(super) fn is_listed(block: usize) -> bool {
    words()
        .get(block / 64)
        .is_some_and(|w| w.load(Relaxed) & (1 << (block % 64)) != 0)
}

/// Marks block number `block` listed (`true`) or not. Returns whether it was listed before.
pub(super) fn set(block: usize, listed: bool) -> bool {
    let Some(w) = words().get(block / 64) else {
        return false;
    };
    let bit = 1u64 << (block % 64);
    let before = if listed {
        w.fetch_or(bit, Relaxed)
    } else {
        w.fetch_and(!bit, Relaxed)
    };
    before & bit != 0
}

/// Marks every block not listed (the list was dropped).
pub(super) fn clear() {
    for w in words() {
        w.store(0, Relaxed);
    }
}

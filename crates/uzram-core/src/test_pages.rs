//! Pages the unit tests of several modules make.

use crate::page::PAGE_SIZE;

/// `pages` pages of xorshift noise from `seed`: incompressible, none same-filled.
pub(crate) fn noise(pages: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..pages * PAGE_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

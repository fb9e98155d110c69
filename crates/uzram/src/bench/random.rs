//! Reproducible read offsets for the bench's timed readers.

/// xorshift64: the next number of the sequence `x` is at.
pub fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

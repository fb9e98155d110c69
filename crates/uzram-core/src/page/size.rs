//! Page geometry: the sizes everything else counts in.

/// Bytes in one page: the unit the store keeps, compresses and accounts.
pub const PAGE_SIZE: usize = 4096;
/// 64-bit words in one page.
pub const PAGE_WORDS: usize = PAGE_SIZE / 8;
/// log2(PAGE_SIZE).
pub const PAGE_SHIFT: u32 = 12;
/// log2 of the 512-byte sector the block layer counts in.
pub const SECTOR_SHIFT: u32 = 9;

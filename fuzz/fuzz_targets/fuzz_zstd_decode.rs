//! Any bytes into the zstd page decoder: an error or one page, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use uzram_core::codec::{PageCodec, ZstdCodec};
use uzram_core::page::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    let mut codec = ZstdCodec::new(1);
    let mut page = [0u8; PAGE_SIZE];
    let _ = codec.decompress(data, &mut page);
});

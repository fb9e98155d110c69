//! Any bytes into the page LZ4 decoder (the `unsafe-lz4` fast one, uzram-core's default)
//! and into the safe reference decoder: both must return, never panic or write outside
//! the page, and give the same result (the same error, or the same page). Where liblz4's
//! `LZ4_decompress_safe` decodes the block to exactly one page, an accepted page must
//! also equal liblz4's.
#![no_main]

use std::os::raw::{c_char, c_int};

use libfuzzer_sys::fuzz_target;
use uzram_core::codec::{Lz4Codec, PageCodec};
use uzram_core::page::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    // Start both pages from different garbage: an accepted page must not depend on it.
    let mut fast = [0xA5u8; PAGE_SIZE];
    let mut safe = [0x5Au8; PAGE_SIZE];
    let fast_r = Lz4Codec::new().decompress(data, &mut fast);
    let safe_r = Lz4Codec::decompress_safe(data, &mut safe);
    assert_eq!(
        fast_r, safe_r,
        "fast and safe decoders give different results"
    );
    if fast_r.is_ok() {
        assert!(fast == safe, "fast and safe decoders decode differently");
        let mut theirs = [0u8; PAGE_SIZE];
        // SAFETY: `data` and `theirs` are live, distinct buffers of the lengths passed;
        // LZ4_decompress_safe stays inside both for any input.
        let n = unsafe {
            lz4_sys::LZ4_decompress_safe(
                data.as_ptr().cast::<c_char>(),
                theirs.as_mut_ptr().cast::<c_char>(),
                data.len() as c_int,
                PAGE_SIZE as c_int,
            )
        };
        if n == PAGE_SIZE as c_int {
            assert!(
                fast == theirs,
                "uzram and liblz4 decode the same block differently"
            );
        }
    }
});

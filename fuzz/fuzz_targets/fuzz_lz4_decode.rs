//! Any bytes into the page LZ4 decoder: it must return, never panic or write outside the
//! page; whatever it accepts, liblz4's safe decoder (where it also accepts) decodes alike.
#![no_main]

use std::os::raw::{c_char, c_int};

use libfuzzer_sys::fuzz_target;
use uzram_core::codec::{Lz4Codec, PageCodec};
use uzram_core::page::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    let mut codec = Lz4Codec::new();
    let mut page = [0u8; PAGE_SIZE];
    if codec.decompress(data, &mut page).is_ok() {
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
            assert_eq!(
                page, theirs,
                "uzram and liblz4 decode the same block differently"
            );
        }
    }
});

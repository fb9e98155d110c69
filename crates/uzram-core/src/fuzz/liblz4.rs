//! liblz4 (C, through lz4-sys) as the LZ4 codec's reference, for this crate's codec tests
//! and the cargo-fuzz targets (feature `liblz4-reference`): the one place its streaming
//! compressor is declared and called. Test scaffolding, and the only `unsafe` outside the
//! three `unsafe-*` features' modules.

#![allow(unsafe_code)]

use std::os::raw::{c_char, c_int};

use crate::page::PAGE_SIZE;

extern "C" {
    // liblz4's streaming compressor (in the library lz4-sys builds; lz4-sys does not
    // declare it).
    fn LZ4_compress_fast_continue(
        stream: *mut lz4_sys::LZ4StreamEncode,
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        dst_capacity: c_int,
        acceleration: c_int,
    ) -> c_int;
}

/// The page alone through `LZ4_compress_fast_continue` on a fresh stream (the parse the
/// codec makes: 5-byte hash, 2^12 entries), into a buffer of `cap` bytes; `None` when it
/// does not fit.
pub fn compress(page: &[u8; PAGE_SIZE], cap: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; cap];
    // SAFETY: LZ4_createStream returns an initialised stream or null (checked); the
    // stream is only used here and freed once. `page` (PAGE_SIZE bytes) and `out` (cap
    // bytes) are live and distinct; liblz4 writes at most `cap` bytes.
    let n = unsafe {
        let stream = lz4_sys::LZ4_createStream();
        assert!(!stream.is_null(), "LZ4_createStream failed");
        let n = LZ4_compress_fast_continue(
            stream,
            page.as_ptr().cast::<c_char>(),
            out.as_mut_ptr().cast::<c_char>(),
            PAGE_SIZE as c_int,
            cap as c_int,
            1,
        );
        lz4_sys::LZ4_freeStream(stream);
        n
    };
    (n > 0).then(|| {
        out.truncate(n as usize);
        out
    })
}

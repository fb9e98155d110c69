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
    fn LZ4_loadDict(
        stream: *mut lz4_sys::LZ4StreamEncode,
        dict: *const c_char,
        dict_size: c_int,
    ) -> c_int;
    fn LZ4_decompress_safe_usingDict(
        src: *const c_char,
        dst: *mut c_char,
        src_size: c_int,
        dst_capacity: c_int,
        dict: *const c_char,
        dict_size: c_int,
    ) -> c_int;
}

/// The page alone through `LZ4_compress_fast_continue` on a fresh stream (the parse the
/// codec makes: 5-byte hash, 2^12 entries), into a buffer of `cap` bytes; `None` when it
/// does not fit.
pub fn compress(page: &[u8; PAGE_SIZE], cap: usize) -> Option<Vec<u8>> {
    compress_after(page, &[], cap)
}

/// The page through `LZ4_compress_fast_continue` on a fresh stream that loaded `dict`
/// (`LZ4_loadDict`, at most 64 KiB of it): a block whose matches may reach into the
/// dictionary, and run from its end into the page.
pub fn compress_with_dict(page: &[u8; PAGE_SIZE], dict: &[u8]) -> Vec<u8> {
    compress_after(page, dict, PAGE_SIZE + PAGE_SIZE / 255 + 16)
        .expect("LZ4_compress_fast_continue failed with room for any page")
}

/// The page through a fresh stream that loaded `dict` (none when empty), into `cap` bytes.
fn compress_after(page: &[u8; PAGE_SIZE], dict: &[u8], cap: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; cap];
    // SAFETY: LZ4_createStream returns an initialised stream or null (checked); the
    // stream is only used here and freed once. `page` (PAGE_SIZE bytes), `dict` and `out`
    // (cap bytes) are live and distinct, and `dict` is unchanged until the stream is freed
    // (liblz4 keeps a pointer to it); liblz4 writes at most `cap` bytes. The lengths fit a
    // c_int (a page, and test dictionaries of at most a few MiB).
    let n = unsafe {
        let stream = lz4_sys::LZ4_createStream();
        assert!(!stream.is_null(), "LZ4_createStream failed");
        if !dict.is_empty() {
            LZ4_loadDict(stream, dict.as_ptr().cast::<c_char>(), dict.len() as c_int);
        }
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

/// liblz4's own decode of a block made with `dict` (`LZ4_decompress_safe_usingDict`):
/// `None` when liblz4 refuses it or it is not one page.
pub fn decompress_with_dict(block: &[u8], dict: &[u8]) -> Option<Box<[u8; PAGE_SIZE]>> {
    let mut page = Box::new([0u8; PAGE_SIZE]);
    // SAFETY: every pointer is to a live buffer of the length passed with it; liblz4
    // writes at most PAGE_SIZE bytes into `page`.
    let n = unsafe {
        LZ4_decompress_safe_usingDict(
            block.as_ptr().cast::<c_char>(),
            page.as_mut_ptr().cast::<c_char>(),
            block.len() as c_int,
            PAGE_SIZE as c_int,
            dict.as_ptr().cast::<c_char>(),
            dict.len() as c_int,
        )
    };
    (n == PAGE_SIZE as c_int).then_some(page)
}

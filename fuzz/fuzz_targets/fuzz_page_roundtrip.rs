//! A page built from the input goes through both codecs with an output budget taken from
//! the input: LZ4 output is liblz4's byte for byte (`LZ4_compress_fast_continue` on a fresh
//! stream, the parse the codec makes; or both refuse the budget), and every compressed page
//! decodes back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use uzram_core::codec::{Lz4Codec, PageCodec, ZstdCodec};
use uzram_core::fuzz::liblz4;
use uzram_core::page::PAGE_SIZE;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let cap = usize::from(u16::from_le_bytes([data[0], data[1]])) % (PAGE_SIZE + 64);
    let body = &data[2..];
    let mut page = [0u8; PAGE_SIZE];
    for (dst, src) in page.iter_mut().zip(body.iter().cycle()) {
        *dst = *src;
    }
    if body.len() < PAGE_SIZE {
        // Short inputs: the body once, then zeros (tests long zero tails, too).
        page[body.len()..].fill(0);
    }

    let mut lz4 = Lz4Codec::new();
    let mut out = vec![0u8; cap];
    let ours = lz4
        .compress(&page, &mut out)
        .expect("lz4 compress never errors");
    let theirs = liblz4::compress(&page, cap);
    assert_eq!(
        ours.map(|n| &out[..n]),
        theirs.as_deref(),
        "LZ4 output differs from liblz4's"
    );
    let mut back = [0u8; PAGE_SIZE];
    if let Some(n) = ours {
        lz4.decompress(&out[..n], &mut back)
            .expect("own LZ4 output decodes");
        assert_eq!(back, page);
    }

    let mut zstd = ZstdCodec::new(1 + i32::from(data[2] % 3));
    if let Some(n) = zstd
        .compress(&page, &mut out)
        .expect("zstd compress never errors")
    {
        zstd.decompress(&out[..n], &mut back)
            .expect("own zstd output decodes");
        assert_eq!(back, page);
    }
});

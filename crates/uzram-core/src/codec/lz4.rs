//! LZ4 block format, specialised for 4 KiB pages.
//!
//! The encoder makes liblz4's exact parse (so the ratio is liblz4's, byte for byte) and the
//! decoder accepts any valid LZ4 block that decodes to one page. Both are safe Rust; see
//! `encode.rs` and `decode.rs` for why they are faster than the general-purpose codecs.
//! With the `unsafe-lz4` feature (on by default) pages are decoded by `decode_fast.rs`,
//! which gives the same result as `decode.rs` for every input, with unchecked copies.

mod decode;
// One of the crate's three `unsafe` modules, each behind its own feature (with
// `page/stream.rs` and `store/words.rs`): everything else is `deny(unsafe_code)`, and the
// whole crate `forbid(unsafe_code)` without the three features (see lib.rs).
#[cfg(feature = "unsafe-lz4")]
#[allow(unsafe_code)]
mod decode_fast;
mod encode;

use super::page_codec::{Algorithm, CodecError, PageCodec};
use crate::page::PAGE_SIZE;

/// LZ4 block codec for 4 KiB pages; holds one worker's 16 KiB position table.
#[derive(Debug)]
pub struct Lz4Codec {
    encoder: encode::Encoder,
}

impl Default for Lz4Codec {
    fn default() -> Self {
        Self::new()
    }
}

impl Lz4Codec {
    /// A codec for one worker; [`CodecError::Create`] when its 16 KiB position table
    /// cannot be allocated (reported, where a plain allocation would abort the process).
    pub fn try_new() -> Result<Self, CodecError> {
        Ok(Self {
            encoder: encode::Encoder::try_new().map_err(|e| CodecError::Create {
                algorithm: Algorithm::Lz4,
                reason: e.to_string(),
            })?,
        })
    }

    /// [`Lz4Codec::try_new`] for tests and tools.
    ///
    /// # Panics
    /// When the position table cannot be allocated.
    pub fn new() -> Self {
        Self::try_new().unwrap_or_else(|e| panic!("{e}"))
    }

    /// The largest LZ4 block a page can compress to (an incompressible page): with an
    /// `out` this long, [`PageCodec::compress`] always succeeds.
    pub const fn max_compressed_len() -> usize {
        // liblz4's LZ4_COMPRESSBOUND: n + n / 255 + 16.
        PAGE_SIZE + PAGE_SIZE / 255 + 16
    }

    /// Decodes with the safe decoder of `decode.rs`, whatever the features: the reference
    /// that differential tests and fuzzing compare [`PageCodec::decompress`] with.
    pub fn decompress_safe(src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        decode::decompress(src, page).map_err(decode_error)
    }

    /// Decodes a block compressed with `dict` as the bytes before the page (liblz4's
    /// `LZ4_decompress_safe_usingDict`; the cold tier's dictionary recompressor writes
    /// them). A block that needs no dictionary decodes the same with any.
    pub fn decompress_with_dict(
        src: &[u8],
        dict: &[u8],
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CodecError> {
        decode::decompress_with_dict(src, dict, page).map_err(decode_error)
    }
}

fn decode_error(e: decode::DecodeError) -> CodecError {
    match e {
        decode::DecodeError::TooShort(actual) => CodecError::WrongSize { actual },
        e => CodecError::Corrupt(e.to_string()),
    }
}

impl PageCodec for Lz4Codec {
    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }

    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8],
    ) -> Result<Option<usize>, CodecError> {
        Ok(self.encoder.compress(page, out))
    }

    fn decompress(&mut self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        #[cfg(feature = "unsafe-lz4")]
        let r = decode_fast::decompress(src, page);
        #[cfg(not(feature = "unsafe-lz4"))]
        let r = decode::decompress(src, page);
        r.map_err(decode_error)
    }
}

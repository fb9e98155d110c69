//! LZ4 block format through lz4_flex.

use super::{Algorithm, CodecError, PageCodec};
use crate::page::PAGE_SIZE;

/// LZ4 block codec for 4 KiB pages.
#[derive(Debug, Default)]
pub struct Lz4Codec {}

impl Lz4Codec {
    /// A codec for one worker.
    pub fn new() -> Self {
        Self {}
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
        match lz4_flex::block::compress_into(page, out) {
            Ok(n) => Ok(Some(n)),
            Err(lz4_flex::block::CompressError::OutputTooSmall { .. }) => Ok(None),
            Err(e) => Err(CodecError::Compress(e.to_string())),
        }
    }

    fn decompress(&mut self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        match lz4_flex::block::decompress_into(src, page) {
            Ok(PAGE_SIZE) => Ok(()),
            Ok(actual) => Err(CodecError::WrongSize { actual }),
            Err(e) => Err(CodecError::Corrupt(e.to_string())),
        }
    }
}

//! zstd through the `zstd` crate (libzstd), with contexts reused across pages.

use super::page_codec::{Algorithm, CodecError, PageCodec};
use crate::page::PAGE_SIZE;

/// zstd codec for 4 KiB pages; holds one compression and one decompression context.
pub struct ZstdCodec {
    level: i32,
    cctx: zstd::bulk::Compressor<'static>,
    dctx: zstd::bulk::Decompressor<'static>,
}

impl std::fmt::Debug for ZstdCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZstdCodec")
            .field("level", &self.level)
            .finish()
    }
}

impl ZstdCodec {
    /// A codec at `level` (1..=22) for one worker; [`CodecError::Create`] when libzstd
    /// cannot allocate or set up a context (out of memory, or a level it refuses).
    pub fn try_new(level: i32) -> Result<Self, CodecError> {
        let create = |e: std::io::Error| CodecError::Create {
            algorithm: Algorithm::Zstd { level },
            reason: e.to_string(),
        };
        let cctx = zstd::bulk::Compressor::new(level).map_err(create)?;
        let dctx = zstd::bulk::Decompressor::new().map_err(create)?;
        Ok(Self { level, cctx, dctx })
    }

    /// [`ZstdCodec::try_new`] for tests and tools.
    ///
    /// # Panics
    /// When libzstd cannot create the contexts.
    pub fn new(level: i32) -> Self {
        Self::try_new(level).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl PageCodec for ZstdCodec {
    fn algorithm(&self) -> Algorithm {
        Algorithm::Zstd { level: self.level }
    }

    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8],
    ) -> Result<Option<usize>, CodecError> {
        match self.cctx.compress_to_buffer(&page[..], out) {
            Ok(n) => Ok(Some(n)),
            // libzstd reports "destination buffer is too small" as an I/O error; any
            // failure to fit means "store raw".
            Err(_) => Ok(None),
        }
    }

    fn decompress(&mut self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        match self.dctx.decompress_to_buffer(src, &mut page[..]) {
            Ok(PAGE_SIZE) => Ok(()),
            Ok(actual) => Err(CodecError::WrongSize { actual }),
            Err(e) => Err(CodecError::Corrupt(e.to_string())),
        }
    }
}

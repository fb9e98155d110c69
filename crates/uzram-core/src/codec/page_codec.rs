//! The seam every codec sits behind: the [`PageCodec`] trait, the [`Algorithm`] a codec
//! speaks and the [`CodecError`] it fails with.

use crate::page::PAGE_SIZE;

/// Which compression algorithm a store uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// LZ4 block format (no frame): what zram calls `lz4`.
    Lz4,
    /// zstd at the given level (1..=22; zram's default is 3... we use 1 for speed unless told).
    Zstd {
        /// Compression level, 1..=22.
        level: i32,
    },
}

impl Algorithm {
    /// zstd's default level when a user asks for `zstd` without one.
    pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

    /// The name zram and the CLI use: `lz4` or `zstd`.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Lz4 => "lz4",
            Algorithm::Zstd { .. } => "zstd",
        }
    }

    /// Parses `lz4`, `zstd` or `zstd:LEVEL`.
    pub fn parse(s: &str) -> Result<Self, CodecError> {
        match s {
            "lz4" => Ok(Algorithm::Lz4),
            "zstd" => Ok(Algorithm::Zstd {
                level: Self::DEFAULT_ZSTD_LEVEL,
            }),
            _ => match s.strip_prefix("zstd:").map(str::parse::<i32>) {
                Some(Ok(level)) if (1..=22).contains(&level) => Ok(Algorithm::Zstd { level }),
                _ => Err(CodecError::UnknownAlgorithm(s.to_string())),
            },
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Algorithm::Lz4 => f.write_str("lz4"),
            Algorithm::Zstd { level } => write!(f, "zstd:{level}"),
        }
    }
}

/// Why a codec refused to encode or decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The compressed input is corrupt or truncated.
    #[error("compressed page is corrupt or truncated: {0}")]
    Corrupt(String),
    /// The input decoded to a size other than one page.
    #[error("compressed page decodes to {actual} bytes, not one 4096-byte page")]
    WrongSize {
        /// Bytes the input decoded to (or at least, before decoding stopped).
        actual: usize,
    },
    /// The compressor failed for a reason other than "output did not fit".
    #[error("compressor failed: {0}")]
    Compress(String),
    /// The algorithm name is not one uzram knows.
    #[error("unknown compression algorithm '{0}': use lz4, zstd or zstd:LEVEL (1-22)")]
    UnknownAlgorithm(String),
    /// A codec's state (hash table, zstd context) could not be allocated.
    #[error("cannot create a {algorithm} codec: {reason}")]
    Create {
        /// The codec asked for.
        algorithm: Algorithm,
        /// What failed (libzstd's message, or the allocation that was refused).
        reason: String,
    },
}

/// Compresses and decompresses whole 4 KiB pages.
pub trait PageCodec: Send {
    /// The algorithm this codec speaks.
    fn algorithm(&self) -> Algorithm;

    /// Compresses `page` into `out`. Returns `Ok(Some(len))`, or `Ok(None)` when the
    /// compressed form does not fit in `out` (the caller then stores the page raw, so
    /// `out` is sized at the raw-storage threshold and incompressible pages stop early).
    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8],
    ) -> Result<Option<usize>, CodecError>;

    /// Decodes `src` into `page`. Fails, never panics, on corrupt or truncated input and
    /// never writes outside `page`; input that does not decode to exactly one page is an error.
    fn decompress(&mut self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError>;

    /// Compresses `page` under zram's rule for raw storage: `Ok(Some(len))`, the block in
    /// `out[..len]`, when it is shorter than `limit` bytes; `Ok(None)` when the page is to
    /// be stored raw. `out` should hold `limit` bytes (at most a page is used).
    fn compress_below(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8],
        limit: usize,
    ) -> Result<Option<usize>, CodecError> {
        let limit = limit.min(PAGE_SIZE).min(out.len());
        Ok(self
            .compress(page, &mut out[..limit])?
            .filter(|&len| len > 0 && len < limit))
    }
}

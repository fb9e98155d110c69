//! Page codecs: one small trait, LZ4 (block format) and zstd behind it.
//!
//! A codec instance holds per-worker state (hash tables, zstd contexts) and is reused
//! for every page that worker handles, so compressing a page allocates nothing.

mod dictionary;
mod lz4;
mod page_codec;
mod zstd;

pub use self::dictionary::{train_dictionary, MAX_DICTIONARY_BYTES, MIN_DICTIONARY_SAMPLES};
pub use self::lz4::Lz4Codec;
pub use self::page_codec::{Algorithm, CodecError, PageCodec};
pub use self::zstd::ZstdCodec;

// Here rather than with `Algorithm` (`page_codec.rs`): making a codec names every codec,
// and the codecs name the seam.
impl Algorithm {
    /// A fresh codec of this algorithm for one worker, or [`CodecError::Create`] when its
    /// state cannot be allocated. Create codecs before serving I/O, so that failure is a
    /// start-up error and never a panic on a request.
    pub fn try_codec(&self) -> Result<Box<dyn PageCodec>, CodecError> {
        Ok(match *self {
            Algorithm::Lz4 => Box::new(Lz4Codec::try_new()?),
            Algorithm::Zstd { level } => Box::new(ZstdCodec::try_new(level)?),
        })
    }

    /// [`Algorithm::try_codec`] for callers that cannot go on without a codec (tests,
    /// benches, start-up code that reports the panic as a failed start).
    ///
    /// # Panics
    /// When the codec's state cannot be allocated.
    pub fn codec(&self) -> Box<dyn PageCodec> {
        self.try_codec()
            .unwrap_or_else(|e| panic!("creating a {self} codec: {e}"))
    }
}

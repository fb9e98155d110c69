//! The one error type of uzram-core, and its mapping to the errno a block request completes with.

use crate::codec::CodecError;

/// Errors from the page store and its codecs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A request addressed pages past the end of the device.
    #[error("pages {first}..{end} are outside the device's {pages} pages")]
    OutOfRange {
        /// First page of the request.
        first: u64,
        /// One past the last page of the request.
        end: u64,
        /// Pages in the store.
        pages: u64,
    },
    /// A buffer's length is not a whole number of pages.
    #[error("buffer of {len} bytes is not a multiple of the 4096-byte page")]
    Unaligned {
        /// The length given.
        len: usize,
    },
    /// Storing the page would take the store past its memory limit; nothing was changed.
    #[error("memory limit of {limit} bytes reached ({used} bytes in use); raise mem_limit or free pages")]
    MemLimit {
        /// The configured limit in bytes.
        limit: u64,
        /// Bytes in use when the write was refused.
        used: u64,
    },
    /// The allocator had no memory for the compressed page (the daemon's reserve is empty
    /// and serving threads must not page-fault); nothing was changed and a retry may work.
    #[error("no memory for the compressed page right now; the write can be retried")]
    NoMemory,
    /// A stored page failed to decode: the data in memory is corrupt.
    #[error("page {index} failed to decode")]
    Corrupt {
        /// The page that failed.
        index: u64,
        /// Why the codec refused it.
        #[source]
        source: CodecError,
    },
    /// A stored page decoded to bytes whose checksum is not the one stored with it.
    #[error("page {index} does not match its checksum: its stored bytes are damaged")]
    Checksum {
        /// The page that failed.
        index: u64,
    },
    /// A page could not be compressed.
    #[error("compressing page failed")]
    Compress(#[source] CodecError),
    /// A store was asked for with an invalid configuration.
    #[error("invalid store configuration: {0}")]
    Config(String),
    /// A store kept across a daemon restart is not one this daemon can serve (its table
    /// points outside its memory, or objects overlap); nothing of it was used.
    #[error("the preserved store is damaged: {0}")]
    Damaged(String),
    /// The backing device has no run of free blocks for a writeback write; nothing moved.
    #[error("the backing device has no {blocks} free blocks in a row (it holds {capacity}); pages stay in memory")]
    BackingFull {
        /// Blocks the write needed.
        blocks: u64,
        /// Blocks the device holds.
        capacity: u64,
    },
    /// A write's bytes could not be had from where they were (ublk's user copy: the kernel
    /// refused to copy the request's data); nothing of that part of the write was stored.
    #[error("reading the write's data failed: {0}")]
    Source(#[source] std::io::Error),
    /// A batch backend failed; the caller may retry the batch on another backend.
    #[error("batch backend {backend} failed: {reason}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// What went wrong.
        reason: String,
    },
}

impl CoreError {
    /// The negative errno a block request that failed with this error completes with.
    /// This is the only place store errors become errnos.
    pub fn errno(&self) -> i32 {
        const EIO: i32 = 5;
        const ENOMEM: i32 = 12;
        const EINVAL: i32 = 22;
        match self {
            CoreError::OutOfRange { .. } | CoreError::Unaligned { .. } | CoreError::Config(_) => {
                -EINVAL
            }
            CoreError::MemLimit { .. } | CoreError::NoMemory | CoreError::BackingFull { .. } => {
                -ENOMEM
            }
            CoreError::Corrupt { .. }
            | CoreError::Checksum { .. }
            | CoreError::Compress(_)
            | CoreError::Backend { .. }
            | CoreError::Source(_)
            | CoreError::Damaged(_) => -EIO,
        }
    }
}

//! Why a store or staging segment could not be made or taken over: one error for both.

/// Why a segment could not be made or taken over.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// The call and its purpose.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The segment is not one this daemon can take over.
    #[error("shared memory segment {id} is not a uzram segment this daemon can serve: {why}")]
    Foreign {
        /// The segment id.
        id: i32,
        /// What did not match.
        why: String,
    },
    /// The segment is not root's alone, or a call on it failed.
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
}

/// Maps a failed system call's error, naming the call.
pub fn sys(what: &'static str) -> impl FnOnce(std::io::Error) -> SegmentError {
    move |source| SegmentError::Sys { what, source }
}

/// A segment that is not one this daemon can take over, and why.
pub fn foreign(id: i32, why: String) -> SegmentError {
    SegmentError::Foreign { id, why }
}

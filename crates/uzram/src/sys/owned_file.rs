//! Reading a small file that only its owner, root (or this process's user), could have
//! written: config files, and libublk's device file that the recovery record copies.
//!
//! The file is looked at before it is opened (opening a device can act: a watchdog arms, a
//! tape rewinds), opened non-blocking (a FIFO put there since the look would wait for a
//! writer), looked at again through the descriptor, and read no further than a bound (a
//! device that never ends).

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::{others_could_write, OthersWrite};

/// Whether a link at the path itself is followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Followed, as a name given by the administrator is.
    Follow,
    /// Refused: the file must be at that name.
    Refuse,
}

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Not a regular file.
    #[error("is {0}, not a regular file")]
    NotAFile(&'static str),
    /// Someone besides its reader and root could have written it.
    #[error("could be written by others")]
    OthersWrite(OthersWrite),
    /// Longer than the bound.
    #[error("larger than {0} bytes")]
    TooLarge(u64),
    /// The system said no.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The bytes of the regular file at `path`, at most `max` of them, when no one but its
/// reader and root could have written it.
pub fn read(path: &Path, max: u64, links: Links) -> Result<Vec<u8>, Refused> {
    let named = match links {
        Links::Follow => std::fs::metadata(path)?,
        Links::Refuse => std::fs::symlink_metadata(path)?,
    };
    if !named.is_file() {
        return Err(Refused::NotAFile(file_kind(&named.file_type())));
    }
    let nofollow = if links == Links::Refuse {
        libc::O_NOFOLLOW
    } else {
        0
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | nofollow)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(Refused::NotAFile(file_kind(&meta.file_type())));
    }
    if let Some(who) = others_could_write(&meta) {
        return Err(Refused::OthersWrite(who));
    }
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(Refused::TooLarge(max));
    }
    Ok(bytes)
}

/// What a file is, in words (for one that is not a regular file).
pub fn file_kind(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_file() {
        "a regular file"
    } else {
        "not a file"
    }
}

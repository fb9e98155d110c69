//! The backing device's nonce floors in a SysV shared memory segment of their own, so that a
//! takeover keeps them: a word per block of the backing device, the first nonce of the run
//! that last wrote it (`uzram_core::store::Nonces`). With them a block rolled back on disk to
//! an older sealing fails to open; a daemon that lost them could not tell.
//!
//! Why a segment of its own and not part of the store's region: its size follows the backing
//! device (8 bytes a block: 2 MiB a GiB), which a device without writeback does not have and
//! whose size the store's region does not know when it is laid out. The store's region
//! records which segment holds the floors
//! ([`crate::takeover::store_segment::StoreSegment::floors`]), and removing the region
//! removes it too.
//!
//! Layout: a header page, then the words. Locked (`SHM_LOCK`) and populated: a writeback
//! pass writes them when memory is short, and every read of a written-back page reads one, on
//! the I/O path of the device the system swaps to.
//!
//! Trust: root's alone (checked on every attach, `shm.rs`), and its header must be exactly
//! the layout for the backing device's block count before any word is handed out.

use std::sync::atomic::AtomicU64;

use super::segment::{attach_locked, create_locked, foreign, remove_recorded, SegmentError};

const MAGIC: [u8; 8] = *b"UZRAMNF1";
const VERSION: u32 = 1;
const HEADER: usize = 4096;
/// How a failed `mlock` of the segment is named.
const POPULATING: &str = "mlock (the nonce floors)";

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    magic: [u8; 8],
    version: u32,
    _pad: u32,
    blocks: u64,
    words_off: u64,
    len: u64,
}

/// An attached floors segment; never detached (the store reads and writes its words for the
/// rest of the process).
#[derive(Debug)]
pub struct FloorsSegment {
    id: i32,
    base: usize,
    header: Header,
}

/// The layout for a backing device of `blocks` blocks (`None`: too large).
fn layout(blocks: u64) -> Option<Header> {
    let words = usize::try_from(blocks).ok()?.checked_mul(8)?;
    let len = HEADER.checked_add(words)?.checked_next_multiple_of(4096)?;
    Some(Header {
        magic: MAGIC,
        version: VERSION,
        _pad: 0,
        blocks,
        words_off: HEADER as u64,
        len: len as u64,
    })
}

/// Bytes of the floors segment for a backing device of `blocks` blocks (`u64::MAX`: too
/// large to lay out), for the up-front memory check (`footprint.rs`).
pub fn bytes_for(blocks: u64) -> u64 {
    layout(blocks).map_or(u64::MAX, |h| h.len)
}

/// The header of segment `id`, read through a read-only mapping dropped at once, when it is a
/// uzram floors segment of this version whose layout fits its size.
fn header_of(id: i32) -> Result<Header, SegmentError> {
    let size = crate::shm::check(id)?.size;
    if size < HEADER {
        return Err(foreign(id, format!("only {size} bytes")));
    }
    let header: Header = crate::shm::peek(id, 0)?;
    if header.magic != MAGIC || header.version != VERSION {
        return Err(foreign(id, "no uzram nonce floors of this version".into()));
    }
    if layout(header.blocks) != Some(header) || header.len != size as u64 {
        return Err(foreign(id, "its layout does not fit its size".into()));
    }
    Ok(header)
}

impl FloorsSegment {
    /// A new locked, populated segment of zeroed floors (no block has one yet) for a backing
    /// device of `blocks` blocks. Its header says what it is before it is locked, so that
    /// `uzram list` finds it should this process die before its store records it.
    pub fn create(blocks: u64) -> Result<FloorsSegment, SegmentError> {
        let header = layout(blocks).ok_or_else(|| SegmentError::Sys {
            what: "sizing the backing device's nonce floors",
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
        let len = usize::try_from(header.len).map_err(|_| foreign(-1, "too large".into()))?;
        let (id, base) = create_locked(len, header, false, POPULATING)?;
        Ok(FloorsSegment { id, base, header })
    }

    /// Takes over segment `id`, the floors of a daemon that is gone, for a backing device of
    /// `blocks` blocks. A segment that is not one, or is for another size, is left as it was.
    pub fn attach(id: i32, blocks: u64) -> Result<FloorsSegment, SegmentError> {
        let header = header_of(id)?;
        if header.blocks != blocks {
            return Err(foreign(
                id,
                format!(
                    "its floors cover {} blocks, and the backing device has {blocks}",
                    header.blocks
                ),
            ));
        }
        let base = attach_locked(id, header, header.len as usize, POPULATING)?;
        Ok(FloorsSegment { id, base, header })
    }

    /// The segment id.
    pub fn id(&self) -> i32 {
        self.id
    }

    /// A word per block of the backing device.
    pub fn floors(&self) -> &'static [AtomicU64] {
        // SAFETY: the words lie in the mapping (`create` laid them out, `attach` checked the
        // layout against the size), page-aligned, only ever accessed atomically; the
        // mapping is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + self.header.words_off as usize) as *const AtomicU64,
                self.header.blocks as usize,
            )
        }
    }

    /// Unmaps the segment (it goes once marked for removal and detached everywhere). The
    /// daemon never does (the store uses the floors for the rest of the process); tests do.
    ///
    /// # Safety
    /// Nothing may use the words [`FloorsSegment::floors`] handed out, from now on.
    #[cfg(test)]
    pub unsafe fn detach(self) {
        // SAFETY: our own mapping; the caller promises nothing refers to it any more.
        unsafe { crate::shm::detach(self.base) };
    }
}

/// Whether segment `id` is a uzram floors segment (root's alone, of this layout).
pub fn is_floors(id: i32) -> bool {
    header_of(id).is_ok()
}

/// Marks floors segment `id` (as a store records it) for removal: it goes once no process has
/// it attached. A segment that is not a uzram floors segment (the id was freed and reused) is
/// left alone.
pub fn remove(id: i32) {
    remove_recorded(id, header_of(id), "the recorded nonce floors");
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::takeover::segment::{self, remove_logged};

    #[test]
    fn floors_are_found_again_with_their_values_and_only_for_their_size() {
        let made = match FloorsSegment::create(1000) {
            Ok(s) => s,
            // Containers without CAP_IPC_LOCK cannot lock segments.
            Err(e) => {
                println!("SKIP: {e}");
                return;
            }
        };
        assert_eq!(made.floors().len(), 1000);
        assert!(made.floors().iter().all(|f| f.load(Ordering::Relaxed) == 0));
        made.floors()[999].store(77, Ordering::Relaxed);
        let err = FloorsSegment::attach(made.id(), 1001).unwrap_err();
        assert!(err.to_string().contains("cover 1000 blocks"), "{err}");
        let again = FloorsSegment::attach(made.id(), 1000).unwrap();
        remove(made.id());
        assert_eq!(again.floors()[999].load(Ordering::Relaxed), 77);
        // SAFETY: nothing uses their words any more.
        unsafe {
            made.detach();
            again.detach();
        }
    }

    #[test]
    fn another_segment_is_neither_taken_over_nor_removed() {
        segment::tests::another_segment_is_left_alone(
            |id| FloorsSegment::attach(id, 15),
            remove,
            "no uzram nonce floors",
        );
    }

    /// The attack on the floors themselves: a local user who made a segment with a floors
    /// header (zeroes would let any old sealing open) never gets it taken over.
    #[test]
    fn floors_another_user_made_are_never_taken_over() {
        let Some(made) = FloorsSegment::create(10).ok() else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        segment::tests::a_copy_another_user_made_is_refused(
            crate::shm::stat(made.id()).unwrap().size,
            crate::shm::tests::bytes_of(&made.header),
            |id| FloorsSegment::attach(id, 10),
            remove,
        );
        remove_logged(made.id());
        // SAFETY: nothing uses its memory.
        unsafe { made.detach() };
    }
}

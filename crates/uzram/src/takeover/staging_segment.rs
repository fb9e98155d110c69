//! The GPU ring's staging in a SysV shared memory segment of its own, so that pages written
//! to the device and waiting for the GPU outlive a daemon crash: the next daemon reads them
//! from here and installs them (`PageStore::recover` through a `StagedCopy`) instead of
//! losing them.
//!
//! Why a segment of its own and not part of the store's region: its size follows the GPU
//! settings (`gpu-memory`, `gpu-slot-pages`), which may change from one daemon to the next,
//! and a CPU daemon needs none. The store's region records which segment is the device's
//! staging ([`crate::takeover::store_segment::StoreSegment::staging`]), and removing the region removes it too.
//!
//! Layout: a header page, the slots' books (`uzram_core::batch::book_words`), then the
//! slots' input pages, each on a page of its own: the GPU backend registers them with the driver
//! (`cuMemHostRegister`), so they are copied to the device as fast as memory it allocated
//! itself. The segment is locked (`SHM_LOCK`) and populated: writers copy pages into it on
//! the I/O path, where a page fault under memory pressure could deadlock the device.

use std::sync::atomic::AtomicU64;

use uzram_core::batch::{book_words, StagedCopy};
use uzram_core::PAGE_WORDS;

use super::segment::{attach_locked, create_locked, foreign, remove_recorded, SegmentError};

const MAGIC: [u8; 8] = *b"UZRAMSG1";
/// Layout 2: the books hold each staged page's checksum.
const VERSION: u32 = 2;
const HEADER: usize = 4096;
const ALIGN: usize = 4096;
/// How a failed `mlock` of the segment is named.
const POPULATING: &str = "mlock (the GPU staging)";

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    magic: [u8; 8],
    version: u32,
    slots: u32,
    slot_pages: u64,
    books_off: u64,
    inputs_off: u64,
    len: u64,
}

/// An attached staging segment; never detached (the ring and the GPU use its memory for the
/// rest of the process).
#[derive(Debug)]
pub struct StagingSegment {
    id: i32,
    base: usize,
    header: Header,
}

/// The layout of a segment for `slots` slots of `slot_pages` pages (`None`: too large).
fn layout(slots: usize, slot_pages: usize) -> Option<Header> {
    let books = slot_pages
        .checked_mul(2)?
        .checked_add(1)?
        .checked_mul(slots)?
        .checked_mul(8)?;
    debug_assert_eq!(books, book_words(slots, slot_pages) * 8);
    let books_off = HEADER;
    let inputs_off = books_off
        .checked_add(books)?
        .checked_next_multiple_of(ALIGN)?;
    let inputs = slots.checked_mul(slot_pages)?.checked_mul(PAGE_WORDS * 8)?;
    Some(Header {
        magic: MAGIC,
        version: VERSION,
        slots: u32::try_from(slots).ok()?,
        slot_pages: slot_pages as u64,
        books_off: books_off as u64,
        inputs_off: inputs_off as u64,
        len: inputs_off.checked_add(inputs)? as u64,
    })
}

/// The header of segment `id`, read through a read-only mapping dropped at once (nothing
/// about the segment changes), when it is a uzram staging segment of this version whose
/// layout fits its size.
fn header_of(id: i32) -> Result<Header, SegmentError> {
    let size = crate::shm::check(id)?.size;
    if size < HEADER {
        return Err(foreign(id, format!("only {size} bytes")));
    }
    let header: Header = crate::shm::peek(id, 0)?;
    if header.magic != MAGIC || header.version != VERSION {
        return Err(foreign(
            id,
            "no uzram staging header of this version".into(),
        ));
    }
    let shape = usize::try_from(header.slot_pages)
        .ok()
        .and_then(|pages| layout(header.slots as usize, pages));
    if shape != Some(header) || header.len != size as u64 {
        return Err(foreign(id, "its layout does not fit its size".into()));
    }
    Ok(header)
}

impl StagingSegment {
    /// A new locked, populated segment for `slots` slots of `slot_pages` pages. With
    /// `scratch`, it is marked for removal before anything of it is locked or touched: it
    /// goes when this process does, however it ends (a benchmark's, which no later process
    /// recovers). Otherwise its header says what it is before it is locked, so that `uzram
    /// list` finds it should this process die before its store records it.
    pub fn create(
        slots: usize,
        slot_pages: usize,
        scratch: bool,
    ) -> Result<StagingSegment, SegmentError> {
        let header = layout(slots, slot_pages).ok_or_else(|| SegmentError::Sys {
            what: "sizing the GPU staging",
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
        let len = usize::try_from(header.len).map_err(|_| foreign(-1, "too large".into()))?;
        let (id, base) = create_locked(len, header, scratch, POPULATING)?;
        Ok(StagingSegment { id, base, header })
    }

    /// Takes over segment `id`, the staging of a daemon that is gone. A segment that is not
    /// one is left as it was.
    pub fn attach(id: i32) -> Result<StagingSegment, SegmentError> {
        let header = header_of(id)?;
        let base = attach_locked(id, header, header.len as usize, POPULATING)?;
        Ok(StagingSegment { id, base, header })
    }

    /// The segment id.
    pub fn id(&self) -> i32 {
        self.id
    }

    /// Slots and pages per slot.
    pub fn shape(&self) -> (usize, usize) {
        (self.header.slots as usize, self.header.slot_pages as usize)
    }

    /// The slots' books, for the ring (`RingConfig::books`).
    pub fn books(&self) -> &'static [AtomicU64] {
        let (slots, slot_pages) = self.shape();
        // SAFETY: the books lie in the mapping (`create` laid them out, `attach` checked the
        // layout against the size), 8-aligned, only ever accessed atomically; the mapping
        // is never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + self.header.books_off as usize) as *const AtomicU64,
                book_words(slots, slot_pages),
            )
        }
    }

    /// The slots' input pages, slot after slot, for the backend.
    pub fn inputs(&self) -> &'static [AtomicU64] {
        let (slots, slot_pages) = self.shape();
        // SAFETY: as for the books: inside the mapping, aligned, atomic only, never detached.
        unsafe {
            std::slice::from_raw_parts(
                (self.base + self.header.inputs_off as usize) as *const AtomicU64,
                slots * slot_pages * PAGE_WORDS,
            )
        }
    }

    /// Unmaps the segment (it goes once marked for removal and detached everywhere).
    ///
    /// # Safety
    /// Nothing may use the slices [`StagingSegment::books`], [`StagingSegment::inputs`] and
    /// [`StagingSegment::copy`] handed out, from now on.
    pub unsafe fn detach(self) {
        // SAFETY: our own mapping; the caller promises nothing refers to it any more.
        unsafe { crate::shm::detach(self.base) };
    }

    /// The pages staged in it, as the store's recovery reads them (held to their
    /// checksums when the store keeps them).
    pub fn copy(&self, checksums: bool) -> Option<StagedCopy<'static>> {
        let (slots, slot_pages) = self.shape();
        StagedCopy::new(self.books(), self.inputs(), slots, slot_pages, checksums)
    }
}

/// Whether segment `id` is a uzram staging segment (root's alone, of this layout).
pub fn is_staging(id: i32) -> bool {
    header_of(id).is_ok()
}

/// Marks staging segment `id` (as a store records it) for removal: it goes once no process
/// has it attached. A segment that is not a uzram staging segment (the id was freed and
/// reused) is left alone.
pub fn remove(id: i32) {
    remove_recorded(id, header_of(id), "the recorded GPU staging");
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::takeover::segment;

    #[test]
    fn a_segment_is_found_again_with_its_contents() {
        let made = match StagingSegment::create(3, 5, true) {
            Ok(s) => s,
            // Containers without CAP_IPC_LOCK cannot lock segments.
            Err(e) => {
                println!("SKIP: {e}");
                return;
            }
        };
        assert_eq!(made.books().len(), book_words(3, 5));
        assert_eq!(made.inputs().len(), 3 * 5 * PAGE_WORDS);
        // The books end before the inputs begin: a checksum written into the books never
        // lands in a staged page.
        let books_end = made.books().as_ptr_range().end as usize;
        assert!(books_end <= made.inputs().as_ptr() as usize);
        assert_eq!(made.inputs().as_ptr() as usize % ALIGN, 0);
        made.books()[4].store(99, Ordering::Relaxed);
        made.inputs()[PAGE_WORDS * 14 + 511].store(7, Ordering::Relaxed);
        let again = StagingSegment::attach(made.id()).unwrap();
        remove(made.id());
        assert_eq!(again.shape(), (3, 5));
        assert_eq!(again.books()[4].load(Ordering::Relaxed), 99);
        assert_eq!(
            again.inputs()[PAGE_WORDS * 14 + 511].load(Ordering::Relaxed),
            7
        );
        assert!(again.copy(true).is_some());
    }

    #[test]
    fn another_segment_is_neither_taken_over_nor_removed() {
        segment::tests::another_segment_is_left_alone(
            StagingSegment::attach,
            remove,
            "no uzram staging header",
        );
    }

    #[test]
    fn a_staging_segment_another_user_made_is_never_taken_over() {
        let Some(made) = StagingSegment::create(2, 3, true).ok() else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        segment::tests::a_copy_another_user_made_is_refused(
            crate::shm::stat(made.id()).unwrap().size,
            crate::shm::tests::bytes_of(&made.header),
            StagingSegment::attach,
            remove,
        );
        // SAFETY: nothing uses its memory.
        unsafe { made.detach() };
    }
}

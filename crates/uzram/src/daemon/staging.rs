//! The GPU ring's staging in a SysV shared memory segment of its own, so that pages written
//! to the device and waiting for the GPU outlive a daemon crash: the next daemon reads them
//! from here and installs them (`PageStore::recover` through a `StagedCopy`) instead of
//! losing them.
//!
//! Why a segment of its own and not part of the store's region: its size follows the GPU
//! settings (`gpu-memory`, `gpu-slot-pages`), which may change from one daemon to the next,
//! and a CPU daemon needs none. The store's region records which segment is the device's
//! staging ([`super::region::Region::staging`]), and removing the region removes it too.
//!
//! Layout: a header page, the slots' books (`uzram_core::batch::book_words`), then the
//! slots' input pages, each on a page of its own: the GPU backend registers them with the driver
//! (`cuMemHostRegister`), so they are copied to the device as fast as memory it allocated
//! itself. The segment is locked (`SHM_LOCK`) and populated: writers copy pages into it on
//! the I/O path, where a page fault under memory pressure could deadlock the device.

use std::ptr;
use std::sync::atomic::AtomicU64;

use uzram_core::batch::{book_words, StagedCopy};
use uzram_core::PAGE_WORDS;

use super::region::RegionError;

const MAGIC: [u8; 8] = *b"UZRAMSG1";
const VERSION: u32 = 1;
const HEADER: usize = 4096;
const ALIGN: usize = 4096;

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
pub struct Staging {
    id: i32,
    base: usize,
    header: Header,
}

fn sys(what: &'static str) -> impl FnOnce(std::io::Error) -> RegionError {
    move |source| RegionError::Sys { what, source }
}

fn foreign(id: i32, why: String) -> RegionError {
    RegionError::Foreign { id, why }
}

fn layout(slots: usize, slot_pages: usize) -> Header {
    let up = |n: usize, to: usize| n.div_ceil(to) * to;
    let books_off = HEADER;
    let inputs_off = up(books_off + book_words(slots, slot_pages) * 8, ALIGN);
    let len = inputs_off + slots * slot_pages * PAGE_WORDS * 8;
    Header {
        magic: MAGIC,
        version: VERSION,
        slots: slots as u32,
        slot_pages: slot_pages as u64,
        books_off: books_off as u64,
        inputs_off: inputs_off as u64,
        len: len as u64,
    }
}

impl Staging {
    /// A new locked, populated segment for `slots` slots of `slot_pages` pages. With
    /// `scratch`, it is already marked for removal: it goes when this process does (a
    /// benchmark's, which no later process recovers).
    pub fn create(slots: usize, slot_pages: usize, scratch: bool) -> Result<Staging, RegionError> {
        let header = layout(slots, slot_pages);
        let len = header.len as usize;
        // SAFETY: shmget takes no pointers. IPC_PRIVATE: a new segment only we know the id of.
        let id = unsafe {
            libc::shmget(
                libc::IPC_PRIVATE,
                len,
                libc::IPC_CREAT | libc::IPC_EXCL | libc::SHM_NORESERVE | 0o600,
            )
        };
        if id < 0 {
            return Err(sys("shmget (creating the GPU staging's shared memory)")(
                std::io::Error::last_os_error(),
            ));
        }
        let made = Self::map(id).and_then(|base| {
            // SAFETY: the header page lies in our fresh read-write mapping; nobody else
            // knows the segment yet.
            unsafe { ptr::write_volatile(base as *mut Header, header) };
            let staging = Staging { id, base, header };
            staging.populate()?;
            Ok(staging)
        });
        if scratch || made.is_err() {
            remove(id);
        }
        made
    }

    /// Takes over segment `id`, the staging of a daemon that is gone.
    pub fn attach(id: i32) -> Result<Staging, RegionError> {
        let size = crate::sys::shm_size(id).map_err(sys("shmctl IPC_STAT (the GPU staging)"))?;
        if size < HEADER {
            return Err(foreign(id, format!("only {size} bytes")));
        }
        let base = Self::map(id)?;
        // SAFETY: the segment is at least a header page long.
        let header = unsafe { ptr::read_volatile(base as *const Header) };
        let shape = layout(header.slots as usize, header.slot_pages as usize);
        if header.magic != MAGIC || header.version != VERSION {
            return Err(foreign(
                id,
                "no uzram staging header of this version".into(),
            ));
        }
        if header.slot_pages > u64::from(u32::MAX) || shape != header || header.len != size as u64 {
            return Err(foreign(id, "its layout does not fit its size".into()));
        }
        let staging = Staging { id, base, header };
        staging.populate()?;
        Ok(staging)
    }

    fn map(id: i32) -> Result<usize, RegionError> {
        crate::sys::shm_lock(id)
            .map_err(sys("shmctl SHM_LOCK (keeping the GPU staging resident)"))?;
        // SAFETY: shmat maps the segment where the kernel picks; no memory of ours is touched.
        let base = unsafe { libc::shmat(id, ptr::null(), 0) };
        if base as isize == -1 {
            return Err(sys("shmat (mapping the GPU staging)")(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(base as usize)
    }

    /// Faults every page in and keeps it in (see the module docs).
    fn populate(&self) -> Result<(), RegionError> {
        // SAFETY: mlock only changes the paging of our own mapping of `len` bytes.
        if unsafe { libc::mlock(self.base as *const libc::c_void, self.header.len as usize) } != 0 {
            return Err(sys("mlock (the GPU staging)")(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
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
    /// Nothing may use the slices [`Staging::books`], [`Staging::inputs`] and
    /// [`Staging::copy`] handed out, from now on.
    pub unsafe fn detach(self) {
        // SAFETY: our own mapping; the caller promises nothing refers to it any more.
        unsafe { libc::shmdt(self.base as *const libc::c_void) };
    }

    /// The pages staged in it, as the store's recovery reads them.
    pub fn copy(&self) -> Option<StagedCopy<'static>> {
        let (slots, slot_pages) = self.shape();
        StagedCopy::new(self.books(), self.inputs(), slots, slot_pages)
    }
}

/// Marks staging segment `id` for removal (it goes once no process has it attached).
pub fn remove(id: i32) {
    if let Err(error) = crate::sys::shm_remove(id) {
        tracing::warn!(id, %error, "removing the GPU staging's shared memory failed");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn a_segment_is_found_again_with_its_contents() {
        let made = match Staging::create(3, 5, false) {
            Ok(s) => s,
            // Containers without CAP_IPC_LOCK cannot lock segments.
            Err(e) => {
                println!("SKIP: {e}");
                return;
            }
        };
        assert_eq!(made.books().len(), book_words(3, 5));
        assert_eq!(made.inputs().len(), 3 * 5 * PAGE_WORDS);
        assert_eq!(made.inputs().as_ptr() as usize % ALIGN, 0);
        made.books()[4].store(99, Ordering::Relaxed);
        made.inputs()[PAGE_WORDS * 14 + 511].store(7, Ordering::Relaxed);
        let again = Staging::attach(made.id()).unwrap();
        remove(made.id());
        assert_eq!(again.shape(), (3, 5));
        assert_eq!(again.books()[4].load(Ordering::Relaxed), 99);
        assert_eq!(
            again.inputs()[PAGE_WORDS * 14 + 511].load(Ordering::Relaxed),
            7
        );
        assert!(again.copy().is_some());
    }

    #[test]
    fn a_store_segment_is_not_staging() {
        // SAFETY: shmget takes no pointers.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 65536, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0);
        let err = Staging::attach(id).unwrap_err();
        remove(id);
        assert!(
            err.to_string().contains("no uzram staging header")
                || err.to_string().contains("SHM_LOCK"),
            "{err}"
        );
    }
}

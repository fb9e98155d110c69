//! Memory-management calls on address ranges of our own mappings: mapping, locking,
//! populating, residency, giving pages back, and malloc's tuning.
//!
//! Calls that only change paging (lock, unlock, populate, residency) are safe functions: at
//! worst they fail on a range that is not mapped. Calls that change what memory holds or
//! whether it exists (unmapping, giving pages back) are `unsafe fn`s: their caller promises
//! that nothing refers to the range.

use std::io;

/// `MADV_POPULATE_WRITE` (Linux 5.14); the libc crate lacks it on some targets.
const MADV_POPULATE_WRITE: libc::c_int = 23;
/// `MADV_POPULATE_READ` (Linux 5.14).
const MADV_POPULATE_READ: libc::c_int = 22;

fn ok(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Maps `len` bytes of new anonymous shared read-write memory where the kernel picks;
/// `noreserve`: commit nothing until a page is touched. Returns its address.
#[cfg(test)]
pub fn map_shared_anonymous(len: usize, noreserve: bool) -> io::Result<usize> {
    let flags =
        libc::MAP_SHARED | libc::MAP_ANONYMOUS | if noreserve { libc::MAP_NORESERVE } else { 0 };
    // SAFETY: a new mapping at an address the kernel picks; no memory of ours is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(base as usize)
}

/// Maps `len` bytes of the file open at `fd`, from byte `offset` (a multiple of the page
/// size), shared and read-only, where the kernel picks. Returns its address.
pub fn map_file_read_only(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: usize,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    // SAFETY: a new read-only mapping at an address the kernel picks; no memory of ours is
    // touched, and a bad descriptor or offset fails.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            offset,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(base as usize)
}

/// Unmaps `[addr, addr + len)`.
///
/// # Safety
/// Nothing may refer to the range any more.
pub unsafe fn unmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller promises nothing refers to the range.
    ok(unsafe { libc::munmap(addr as *mut libc::c_void, len) })
}

/// Frees the backing pages of a shared range (`MADV_REMOVE`); they read as zeros afterwards.
///
/// # Safety
/// Nothing may hold a reference into the range, since its bytes change.
pub unsafe fn give_back(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller promises nothing refers to the bytes, which become zeros.
    ok(unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_REMOVE) })
}

/// Drops the pages of a private or shared range from this mapping (`MADV_DONTNEED`).
///
/// # Safety
/// As for [`give_back`]: private pages read as zeros afterwards.
#[cfg(test)]
pub unsafe fn discard(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller promises nothing refers to the bytes.
    ok(unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) })
}

/// Keeps the range resident (`mlock`), faulting it in.
pub fn lock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: mlock changes only the paging of the range; an unmapped one fails with ENOMEM.
    ok(unsafe { libc::mlock(addr as *const libc::c_void, len) })
}

/// Lets the range be paged again (`munlock`).
pub fn unlock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: as for `lock`.
    ok(unsafe { libc::munlock(addr as *const libc::c_void, len) })
}

/// Faults the range in writable (`MADV_POPULATE_WRITE`), which changes no byte.
pub fn populate_write(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: populating only faults pages in; it writes nothing visible and fails (EFAULT,
    // EINVAL on kernels before 5.14) rather than touch a range it cannot.
    ok(unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE) })
}

/// Faults the range in readable (`MADV_POPULATE_READ`).
pub fn populate_read(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: as for `populate_write`.
    ok(unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_READ) })
}

/// One flag per 4 KiB page of the range: whether it is resident (`mincore`).
pub fn resident_pages(addr: usize, len: usize) -> io::Result<Vec<bool>> {
    let mut pages = vec![0u8; len.div_ceil(4096)];
    if pages.is_empty() {
        return Ok(Vec::new());
    }
    // SAFETY: mincore reads the page tables of the range and writes one byte per page into
    // `pages`, which has exactly that many; an unmapped range fails with ENOMEM.
    ok(unsafe { libc::mincore(addr as *mut libc::c_void, len, pages.as_mut_ptr()) })?;
    Ok(pages.into_iter().map(|p| p & 1 != 0).collect())
}

/// glibc malloc's tuning knob `param` (`M_*`) set to `value`; false when refused.
pub fn mallopt(param: libc::c_int, value: libc::c_int) -> bool {
    // SAFETY: mallopt takes two integers and only changes malloc's tuning.
    unsafe { libc::mallopt(param, value) == 1 }
}

/// malloc's statistics (`mallinfo2`).
pub fn mallinfo() -> libc::mallinfo2 {
    // SAFETY: mallinfo2 only reads malloc's statistics and returns them by value.
    unsafe { libc::mallinfo2() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_given_back_is_no_longer_resident_and_reads_zeros() {
        let len = 16 * 4096;
        let base = map_shared_anonymous(len, true).unwrap();
        assert!(resident_pages(base, len).unwrap().iter().all(|&r| !r));
        populate_write(base, len).unwrap();
        assert!(resident_pages(base, len).unwrap().iter().all(|&r| r));
        // SAFETY: our fresh mapping; nothing else refers to it.
        unsafe { std::ptr::write_volatile(base as *mut u8, 7) };
        // SAFETY: as above.
        unsafe { give_back(base, len) }.unwrap();
        assert!(resident_pages(base, len).unwrap().iter().all(|&r| !r));
        // SAFETY: still mapped, now zeros.
        assert_eq!(unsafe { std::ptr::read_volatile(base as *const u8) }, 0);
        // SAFETY: as above.
        unsafe { unmap(base, len) }.unwrap();
        assert!(resident_pages(base, len).is_err(), "unmapped");
    }
}

//! The backing device's system calls: sizing and punching a file, sizing and discarding a
//! partition.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::errno::check;

/// `BLKGETSIZE64` from <linux/fs.h>: `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `BLKDISCARD` from <linux/fs.h>: `_IO(0x12, 119)`.
const BLKDISCARD: libc::c_ulong = 0x1277;

/// Reserves `len` bytes from 0 of a file (`fallocate` mode 0): later writes cannot fail for
/// want of space.
pub fn allocate(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: fallocate on a descriptor the caller holds open; no memory is passed.
    check(unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len) })
}

/// Frees `len` bytes at `offset` of a file, keeping its size (a hole reads as zeros).
pub fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let (offset, len) = offsets(offset, len)?;
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on a descriptor the caller holds open; no memory is passed.
    check(unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset, len) })
}

/// The size of a block device in bytes.
pub fn block_device_bytes(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `bytes`.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) })?;
    Ok(bytes)
}

/// Discards `len` bytes at `offset` of a block device (the device may then read them as
/// anything: the caller never reads freed blocks).
pub fn discard(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64 (start, length) through the pointer, which points at
    // `range`.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), BLKDISCARD, range.as_ptr()) })
}

fn offsets(offset: u64, len: u64) -> io::Result<(libc::off_t, libc::off_t)> {
    let too_big = || io::Error::from_raw_os_error(libc::EFBIG);
    Ok((
        libc::off_t::try_from(offset).map_err(|_| too_big())?,
        libc::off_t::try_from(len).map_err(|_| too_big())?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_file_is_allocated_and_a_punched_block_reads_as_zeros() {
        let dir = std::env::temp_dir().join(format!("uzram-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        allocate(file.as_fd(), 3 * 4096).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 3 * 4096);
        file.write_all_at(&[0xabu8; 3 * 4096], 0).unwrap();
        match punch_hole(file.as_fd(), 4096, 4096) {
            Ok(()) => {
                let mut back = [1u8; 3 * 4096];
                file.read_exact_at(&mut back, 0).unwrap();
                assert!(back[..4096].iter().all(|&b| b == 0xab));
                assert!(back[4096..8192].iter().all(|&b| b == 0));
                assert!(back[8192..].iter().all(|&b| b == 0xab));
            }
            // Some filesystems (overlayfs over one without it) cannot punch.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => println!("SKIP: {e}"),
            Err(e) => panic!("{e}"),
        }
        assert_eq!(file.metadata().unwrap().len(), 3 * 4096);
        // A regular file is no block device.
        assert!(block_device_bytes(file.as_fd()).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

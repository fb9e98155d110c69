//! ublk's user copy (`UBLK_F_USER_COPY`, Linux 6.5): the kernel copies a request's data only
//! when the daemon asks, by `pread`/`pwrite` on `/dev/ublkcN` at a position that names the
//! queue, the tag and the offset into the request. A WRITE's pages then go straight into the
//! GPU ring's staging slots, so the kernel's copy is the only one (without it the kernel
//! copies them into the tag's buffer and the queue thread copies them again into the slot);
//! a READ's pages are decoded into the tag's buffer as before and handed to the kernel with
//! one `pwrite`. The price is a system call per request: one per slot lease a write spans
//! (one or two for a 128 KiB write at the default slot size; more with small slots), and one
//! per fill of the bounce buffer where no slot takes the pages.

use std::io;
use std::os::fd::RawFd;

use libublk::io::UblkIOCtx;
use libublk::sys;
use uzram_core::batch::{LeasedWords, PageSource};

/// One request's data as the kernel holds it: queue `qid`, tag `tag` of the device whose
/// character device is `fd`.
pub struct KernelCopy {
    fd: RawFd,
    qid: u16,
    tag: u16,
}

impl KernelCopy {
    pub fn new(fd: RawFd, qid: u16, tag: u16) -> Self {
        KernelCopy { fd, qid, tag }
    }

    /// The file position of byte `offset` of the request.
    fn pos(&self, offset: usize) -> io::Result<libc::off_t> {
        let offset = u32::try_from(offset)
            .ok()
            .filter(|o| o & !sys::UBLK_IO_BUF_BITS_MASK == 0)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("offset {offset} is past what a ublk request can hold"),
                )
            })?;
        libc::off_t::try_from(UblkIOCtx::ublk_user_copy_pos(self.qid, self.tag, offset))
            .map_err(io::Error::other)
    }

    /// Hands `data`, a READ's pages, to the kernel as the request's data.
    pub fn copy_out(&self, data: &[u8]) -> io::Result<()> {
        let mut done = 0;
        while done < data.len() {
            let rest = &data[done..];
            // SAFETY: `rest` is readable for `rest.len()` bytes; the kernel only reads it.
            let n =
                unsafe { libc::pwrite(self.fd, rest.as_ptr().cast(), rest.len(), self.pos(done)?) };
            done += transferred(n, "pwrite")?;
        }
        Ok(())
    }

    /// Copies `len` bytes of the request from `offset` to `dst`.
    ///
    /// # Safety
    /// `dst` is writable for `len` bytes, and nothing else reads or writes them meanwhile.
    unsafe fn copy_in(&self, offset: usize, dst: *mut u8, len: usize) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            // SAFETY: `done < len`, so `dst + done` and the `len - done` bytes after it lie
            // in what the caller guarantees writable and unshared.
            let n = unsafe {
                libc::pread(
                    self.fd,
                    dst.add(done).cast(),
                    len - done,
                    self.pos(offset + done)?,
                )
            };
            done += transferred(n, "pread")?;
        }
        Ok(())
    }
}

/// The bytes a `pread`/`pwrite` moved; a call cut short by a signal moved none and is made
/// again, and one that moved nothing before the end is an error (the request is shorter).
fn transferred(n: isize, call: &str) -> io::Result<usize> {
    match n {
        0 => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{call} on the ublk character device moved no bytes"),
        )),
        n if n > 0 => Ok(n.unsigned_abs()),
        _ => {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                Ok(0)
            } else {
                Err(err)
            }
        }
    }
}

impl PageSource for KernelCopy {
    fn fill_words(&mut self, offset: usize, dst: LeasedWords<'_>) -> io::Result<()> {
        // SAFETY: `LeasedWords` is writable for `len_bytes()` bytes, and only the ring makes
        // one, over words it leased to this writer alone until it publishes them, so nothing
        // else reads or writes them meanwhile.
        unsafe { self.copy_in(offset, dst.as_mut_ptr(), dst.len_bytes()) }
    }

    fn fill_bytes(&mut self, offset: usize, bytes: &mut [u8]) -> io::Result<()> {
        // SAFETY: `bytes` is an exclusive borrow, writable for its length.
        unsafe { self.copy_in(offset, bytes.as_mut_ptr(), bytes.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_name_queue_tag_and_offset_and_refuse_what_a_request_cannot_hold() {
        let c = KernelCopy::new(-1, 3, 7);
        let base = sys::UBLKSRV_IO_BUF_OFFSET as i64;
        let at = c.pos(4096).unwrap() - base;
        assert_eq!(at >> sys::UBLK_QID_OFF, 3);
        assert_eq!(
            (at >> sys::UBLK_TAG_OFF) & ((1 << (sys::UBLK_QID_OFF - sys::UBLK_TAG_OFF)) - 1),
            7
        );
        assert_eq!(at & i64::from(sys::UBLK_IO_BUF_BITS_MASK), 4096);
        assert!(c.pos(sys::UBLK_IO_BUF_BITS_MASK as usize + 1).is_err());
        assert!(c.pos(usize::MAX).is_err());
    }

    #[test]
    fn a_copy_the_kernel_refuses_is_an_error_not_a_panic() {
        // An fd that is no ublk device: every copy fails with its errno.
        let mut c = KernelCopy::new(-1, 0, 0);
        let mut bytes = [0u8; 4096];
        assert_eq!(
            c.fill_bytes(0, &mut bytes).unwrap_err().raw_os_error(),
            Some(libc::EBADF)
        );
        assert!(c.copy_out(&bytes).is_err());
        assert!(c.copy_out(&[]).is_ok(), "nothing to hand over is no call");
        assert!(transferred(0, "pread").is_err());
    }
}

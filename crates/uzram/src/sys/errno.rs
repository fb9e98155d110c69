//! How a raw system call's result becomes an `io::Result`.

use std::io;

/// `Ok` unless a system call returned -1, then its `errno`.
pub(super) fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

//! The daemon's log file, appended to without ever waiting on swap.
//!
//! A daemon's log lives on tmpfs (`/run/uzram`), whose pages can be swapped out to the
//! daemon's own device. An append touches the page that holds the file's end; were that page
//! in swap, the log writer would wait for its own daemon to serve the swap-in. A daemon that
//! crashed then could never finish exiting: the waiting thread keeps its files open, the
//! device's control file among them, so no successor can take the device over, and its swap
//! hangs (seen in the guest). So the page holding the end is kept mapped and locked: an append
//! then touches only that page and new ones, which are never in swap.
//!
//! A write that ends in a new page would leave that page unlocked from the moment the write
//! makes it until the pin after the write; a page reclaimed in that instant is read back by
//! the pin, which waits on the device. So, where this writer alone places its writes (the file
//! is not `O_APPEND`), the file is first grown to reach one byte into that page (a hole, which
//! nothing can swap), the page is mapped and locked (the fault makes it already locked), and
//! only then is the data written. Someone reading the file in that instant sees the gap as
//! zero bytes until the write fills it. An `O_APPEND` file, where any writer may have moved
//! the end, keeps the instant: growing it would put others' appends behind a gap.

use std::fs::File;
use std::io::{self, Seek, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;

use crate::sys::{self, memory};

const PAGE: u64 = 4096;

/// What a log whose last page cannot be pinned says, once.
pub const UNPINNED: &str = "the log file's last page cannot be kept in memory: a crash while \
                            it is swapped out to this device can hang the device";

/// A log file whose last page stays in memory (see the module's note). Any other
/// destination (a pipe, a socket, a terminal) is written as it is.
pub struct PinnedLog {
    file: File,
    /// The same file opened for reading, which a mapping needs; `None` for any other
    /// destination.
    readable: Option<File>,
    appends: bool,
    /// The page mapped and locked: its offset in the file and its address.
    pinned: Option<(u64, usize)>,
    /// The new page a write in progress ends in, pinned before the write, with the size the
    /// file had before it was grown to reach that page.
    ahead: Option<Ahead>,
    told: bool,
}

impl PinnedLog {
    /// Wraps `file` and pins the page holding its end. The error says why nothing could be
    /// pinned; the log is written anyway.
    pub fn new(file: File) -> (PinnedLog, Option<io::Error>) {
        let mut log = PinnedLog {
            file,
            readable: None,
            appends: false,
            pinned: None,
            ahead: None,
            told: false,
        };
        let err = log.open_readable().and_then(|()| log.pin_end()).err();
        (log, err)
    }

    fn open_readable(&mut self) -> io::Result<()> {
        let meta = self.file.metadata()?;
        if !meta.file_type().is_file() {
            return Ok(());
        }
        self.appends = sys::status_flags(self.file.as_fd())? & libc::O_APPEND != 0;
        let path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        // The descriptor may be write-only; its link in /proc opens the same file anew.
        let readable = File::open(&path)?;
        let again = readable.metadata()?;
        if (again.dev(), again.ino()) != (meta.dev(), meta.ino()) {
            return Err(io::Error::other("the log reopened as another file"));
        }
        self.readable = Some(readable);
        Ok(())
    }

    /// Where the next write lands.
    fn end(&self, size: u64) -> io::Result<u64> {
        if self.appends {
            Ok(size)
        } else {
            (&self.file).stream_position()
        }
    }

    /// Pins the page the next write starts in, if the file has it already (a write at a
    /// page boundary past the end starts a new page, which is not in swap).
    fn pin_end(&mut self) -> io::Result<()> {
        let Some(readable) = &self.readable else {
            return Ok(());
        };
        let size = readable.metadata()?.len();
        let page = self.end(size)? / PAGE * PAGE;
        let want = (page < size).then_some(page);
        if let Some(ahead) = self.ahead.take() {
            if Some(ahead.page) == want {
                self.unpin();
                self.pinned = Some((ahead.page, ahead.addr));
                return Ok(());
            }
            // The end moved elsewhere (another writer of the same file offset).
            unmap_page(ahead.addr);
        }
        if self.pinned.map(|(at, _)| at) == want {
            return Ok(());
        }
        let fresh = match want {
            Some(at) => Some((at, map_locked(readable, at)?)),
            None => None,
        };
        self.unpin();
        self.pinned = fresh;
        Ok(())
    }

    /// Before a write of `len` bytes that ends in a page the file does not have yet: grows
    /// the file to reach one byte into that page and pins it (see the module's note).
    fn pin_ahead(&mut self, len: usize) -> io::Result<()> {
        let Some(readable) = &self.readable else {
            return Ok(());
        };
        if let Some(left) = self.ahead.take() {
            unmap_page(left.addr);
        }
        if self.appends || len == 0 {
            return Ok(());
        }
        let size = readable.metadata()?.len();
        let end = (&self.file).stream_position()? + len as u64;
        let page = end / PAGE * PAGE;
        if end == page || page < size {
            // It ends at a page's end (the next write starts a new page, done then), or in a
            // page the file has, which the pin after the write finds.
            return Ok(());
        }
        self.file.set_len(page + 1)?;
        match map_locked(readable, page) {
            Ok(addr) => {
                self.ahead = Some(Ahead {
                    page,
                    addr,
                    size_before: size,
                });
                Ok(())
            }
            Err(err) => {
                self.shrink_back(page, size);
                Err(err)
            }
        }
    }

    /// After the write: where it did not reach the page pinned ahead (it failed, or wrote
    /// less), the file shrinks back from the grown size to what was written.
    fn settle(&mut self) {
        let Some(ahead) = self.ahead else {
            return;
        };
        if (&self.file)
            .stream_position()
            .is_ok_and(|at| at > ahead.page)
        {
            return;
        }
        self.ahead = None;
        self.shrink_back(ahead.page, ahead.size_before);
        unmap_page(ahead.addr);
    }

    /// Undoes `pin_ahead`'s growth into `page` (from `size_before`) down to what this writer
    /// has written, unless the file has changed size since (someone else wrote to it; their
    /// bytes stay).
    fn shrink_back(&self, page: u64, size_before: u64) {
        let grown = page + 1;
        let Ok(at) = (&self.file).stream_position() else {
            return;
        };
        if self.file.metadata().is_ok_and(|m| m.len() == grown) {
            let _ = self.file.set_len(at.clamp(size_before, grown));
        }
    }

    fn unpin(&mut self) {
        if let Some((_, addr)) = self.pinned.take() {
            unmap_page(addr);
        }
    }

    fn tell(&mut self, err: &io::Error) {
        if !self.told {
            self.told = true;
            // Said in the log itself: this runs on the log's own writer thread.
            let _ = writeln!(self.file, "uzram: {UNPINNED} ({err})");
        }
    }
}

/// Maps the page of `file` at `at` and locks it; the fault of a hole makes the page locked.
fn map_locked(file: &File, at: u64) -> io::Result<usize> {
    let addr = memory::map_file_read_only(file.as_fd(), at, PAGE as usize)?;
    if let Err(err) = memory::lock(addr, PAGE as usize) {
        unmap_page(addr);
        return Err(err);
    }
    Ok(addr)
}

/// Unmaps a page [`map_locked`] mapped.
fn unmap_page(addr: usize) {
    // SAFETY: every page the log maps is the writer's own, and nothing reads through it.
    let _ = unsafe { memory::unmap(addr, PAGE as usize) };
}

/// A page pinned before the write that makes it (see `PinnedLog::pin_ahead`).
#[derive(Clone, Copy)]
struct Ahead {
    page: u64,
    addr: usize,
    size_before: u64,
}

impl Write for PinnedLog {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Err(err) = self.pin_ahead(buf.len()) {
            self.tell(&err);
        }
        let written = self.file.write(buf);
        self.settle();
        let n = written?;
        if let Err(err) = self.pin_end() {
            self.tell(&err);
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for PinnedLog {
    fn drop(&mut self) {
        self.unpin();
        if let Some(ahead) = self.ahead.take() {
            unmap_page(ahead.addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// This process's mappings of `path`: (offset in the file, kB locked), by offset.
    fn mappings_of(path: &std::path::Path) -> Vec<(u64, u64)> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let name = path.to_str().unwrap();
        let mut found = Vec::new();
        let mut current: Option<u64> = None;
        for line in smaps.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let header = fields.first().is_some_and(|f| {
                f.contains('-') && f.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
            });
            if header {
                current = (fields.get(5) == Some(&name))
                    .then(|| u64::from_str_radix(fields[2], 16).unwrap());
            } else if let (Some(offset), Some(&"Locked:")) = (current, fields.first()) {
                found.push((offset, fields[1].parse().unwrap()));
            }
        }
        found.sort_unstable();
        found
    }

    /// A file on tmpfs where there is one, as the daemon's log is.
    fn scratch() -> tempfile::TempDir {
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() {
            tempfile::tempdir_in(shm).unwrap()
        } else {
            tempfile::tempdir().unwrap()
        }
    }

    #[test]
    fn the_page_holding_the_end_stays_locked_as_the_log_grows() {
        let dir = scratch();
        let path = dir.path().join("daemon.log");
        let mut log = new_log(&path);
        assert_eq!(mappings_of(&path), vec![], "an empty file has no page");
        let mut written = Vec::new();
        for (i, len) in [100usize, 3996, 1, 8191, 5000, 4096, 7]
            .into_iter()
            .enumerate()
        {
            let chunk = vec![b'a' + i as u8; len];
            log.write_all(&chunk).unwrap();
            written.extend_from_slice(&chunk);
            let end = written.len() as u64;
            let want = if end.is_multiple_of(PAGE) {
                vec![]
            } else {
                vec![(end / PAGE * PAGE, 4)]
            };
            assert_eq!(mappings_of(&path), want, "after {end} bytes");
        }
        drop(log);
        assert_eq!(mappings_of(&path), vec![], "dropped, it maps nothing");
        let mut back = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut back).unwrap();
        assert!(back == written, "the log holds what was written, in order");
    }

    /// A log writing `path` anew, its end pinned.
    fn new_log(path: &std::path::Path) -> PinnedLog {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)
            .unwrap();
        let (log, err) = PinnedLog::new(file);
        assert!(err.is_none(), "{err:?}");
        log
    }

    /// The file's length.
    fn size_of(path: &std::path::Path) -> u64 {
        std::fs::metadata(path).unwrap().len()
    }

    #[test]
    fn a_write_into_a_new_page_finds_it_locked_already() {
        let dir = scratch();
        let path = dir.path().join("daemon.log");
        let mut log = new_log(&path);
        log.write_all(&[b'a'; 4000]).unwrap();
        assert_eq!(mappings_of(&path), vec![(0, 4)]);
        // What `write` does before the data goes out: 200 bytes from 4000 end in page 4096.
        log.pin_ahead(200).unwrap();
        assert_eq!(
            mappings_of(&path),
            vec![(0, 4), (4096, 4)],
            "the page being written and the new one are both locked before the write"
        );
        assert_eq!(size_of(&path), 4097, "grown one byte into the new page");
        let n = log.file.write(&[b'b'; 200]).unwrap();
        assert_eq!(n, 200);
        log.settle();
        log.pin_end().unwrap();
        assert_eq!(
            mappings_of(&path),
            vec![(4096, 4)],
            "the new page took over"
        );
        assert_eq!(size_of(&path), 4200, "no gap left behind");
        // A write ending at a page's end, or inside the page pinned, grows nothing.
        log.pin_ahead(8192 - 4200).unwrap();
        assert_eq!(size_of(&path), 4200);
        log.pin_ahead(10).unwrap();
        assert_eq!(size_of(&path), 4200);
        assert!(log.ahead.is_none());
    }

    #[test]
    fn a_write_that_fails_after_the_growth_leaves_no_gap() {
        let dir = scratch();
        let path = dir.path().join("daemon.log");
        let mut log = new_log(&path);
        log.write_all(&[b'a'; 5000]).unwrap();
        log.pin_ahead(20_000).unwrap();
        assert_eq!(
            size_of(&path),
            24_577,
            "grown into the page the write ends in"
        );
        assert_eq!(mappings_of(&path), vec![(4096, 4), (24_576, 4)]);
        // The write stops short of that page (as a full /run would make it).
        let n = log.file.write(&[b'b'; 3000]).unwrap();
        assert_eq!(n, 3000);
        log.settle();
        assert_eq!(size_of(&path), 8000, "shrunk back to what was written");
        assert_eq!(mappings_of(&path), vec![(4096, 4)], "the page ahead let go");
        log.pin_end().unwrap();
        assert_eq!(mappings_of(&path), vec![(4096, 4)]);
        let mut back = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut back).unwrap();
        assert_eq!(back.len(), 8000);
        assert!(!back.contains(&0), "no zero byte of the growth is left");
    }

    #[test]
    fn an_appended_log_pins_the_end_others_moved() {
        let dir = scratch();
        let path = dir.path().join("shared.log");
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .unwrap()
        };
        let (mut log, err) = PinnedLog::new(open());
        assert!(err.is_none(), "{err:?}");
        let mut other = open();
        other.write_all(&[b'x'; 10_000]).unwrap();
        log.write_all(b"one line\n").unwrap();
        assert_eq!(mappings_of(&path), vec![(8192, 4)]);
    }

    #[test]
    fn a_pipe_is_written_as_it_is() {
        let (rx, tx) = crate::sys::pipe_cloexec().unwrap();
        let (mut log, err) = PinnedLog::new(File::from(tx));
        assert!(err.is_none(), "{err:?}");
        log.write_all(b"through\n").unwrap();
        drop(log);
        let mut back = String::new();
        File::from(rx).read_to_string(&mut back).unwrap();
        assert_eq!(back, "through\n");
    }
}

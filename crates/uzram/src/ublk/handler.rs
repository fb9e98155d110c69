//! The request handler: one ublk request against a [`PageStore`] and a [`PageWriter`], as a
//! pure function.
//!
//! It knows nothing about ublk queues or buffers' origin, so every branch is unit-tested here
//! without a kernel. It never panics: bad requests become `-EINVAL` plus zram's `invalid_io`
//! counter, store failures become the store's errno plus `failed_reads`/`failed_writes` and a
//! rate-limited log line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use uzram_core::batch::PageSource;
use uzram_core::store::{DiskRead, PageStore};
use uzram_core::CoreError;
use uzram_core::{PAGE_SHIFT, PAGE_SIZE, SECTOR_SHIFT};

/// Sectors per page (8).
const SECTORS_PER_PAGE: u64 = 1 << (PAGE_SHIFT - SECTOR_SHIFT);

/// A ublk request's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Copy pages out of the store.
    Read,
    /// Store pages.
    Write,
    /// Make earlier writes durable: a no-op for RAM.
    Flush,
    /// Forget pages (memory comes back).
    Discard,
    /// Pages read back as zeros (memory comes back).
    WriteZeroes,
    /// Anything else (zone operations, ...): not supported.
    Other(u32),
}

impl Op {
    /// Decodes the low byte of `ublksrv_io_desc.op_flags`.
    pub fn from_ublk(op_flags: u32) -> Op {
        match op_flags & 0xff {
            libublk::sys::UBLK_IO_OP_READ => Op::Read,
            libublk::sys::UBLK_IO_OP_WRITE => Op::Write,
            libublk::sys::UBLK_IO_OP_FLUSH => Op::Flush,
            libublk::sys::UBLK_IO_OP_DISCARD => Op::Discard,
            libublk::sys::UBLK_IO_OP_WRITE_ZEROES => Op::WriteZeroes,
            other => Op::Other(other),
        }
    }
}

/// Where WRITE data goes: the store itself (compress inline), or a ring of staging slots in
/// front of it (compress on a GPU). Reads, discards and counters always go to the store.
pub trait PageWriter {
    /// Stores whole pages starting at `first_page`.
    fn write_pages(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError>;

    /// Stores `pages` whole pages starting at `first_page` whose bytes `source` copies out
    /// on request (ublk's user copy), with `bounce` (at least `pages` pages) as the buffer
    /// they are copied into where the writer cannot take them in place. By default always:
    /// only a ring of staging slots takes them in place.
    fn write_pages_from(
        &self,
        first_page: u64,
        pages: usize,
        source: &mut dyn PageSource,
        bounce: &mut [u8],
    ) -> Result<(), CoreError> {
        let data = fill_bounce(pages, source, bounce)?;
        self.write_pages(first_page, data)
    }
}

/// The first `pages` pages of `bounce`, filled from `source`.
pub fn fill_bounce<'b>(
    pages: usize,
    source: &mut dyn PageSource,
    bounce: &'b mut [u8],
) -> Result<&'b mut [u8], CoreError> {
    let len = bounce.len();
    let data = pages
        .checked_mul(PAGE_SIZE)
        .and_then(|n| bounce.get_mut(..n))
        .ok_or(CoreError::Unaligned { len })?;
    source.fill_bytes(0, data).map_err(CoreError::Source)?;
    Ok(data)
}

impl PageWriter for PageStore {
    fn write_pages(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        self.write(first_page, data)
    }
}

impl PageWriter for uzram_core::batch::Ring {
    fn write_pages(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        self.write(first_page, data)
    }

    fn write_pages_from(
        &self,
        first_page: u64,
        pages: usize,
        source: &mut dyn PageSource,
        bounce: &mut [u8],
    ) -> Result<(), CoreError> {
        self.write_from(first_page, pages, source, bounce)
    }
}

/// Serves one request. Returns bytes transferred for READ/WRITE, 0 for FLUSH, DISCARD and
/// WRITE_ZEROES, or a negative errno.
///
/// `buf` is the request's I/O buffer; READ fills its first `nr_sectors * 512` bytes, WRITE
/// stores them through `writer` (the store itself, or a write backend in front of it).
/// Reads, discards and the counters always go to `store`.
pub fn handle(
    op: Op,
    start_sector: u64,
    nr_sectors: u32,
    buf: &mut [u8],
    store: &PageStore,
    writer: &dyn PageWriter,
) -> i32 {
    handle_via(
        op,
        start_sector,
        nr_sectors,
        buf,
        store,
        writer,
        Via::Buffer,
    )
}

/// Takes a READ's written-back pages to read them outside the request
/// ([`PageStore::read_deferring`]).
pub type Defer<'a> = &'a mut dyn FnMut(usize, DiskRead) -> Result<(), DiskRead>;

/// Where a request's data moves besides its buffer.
pub enum Via<'a> {
    /// All of it through the buffer.
    Buffer,
    /// A READ's written-back pages are offered to the closure (the queue thread's disk
    /// reads, `disk_reads.rs`): the result then counts them as read, and the caller
    /// completes the request once they are.
    DiskReads(Defer<'a>),
    /// A WRITE's bytes are copied out of the source on request (ublk's user copy), straight
    /// into staging where the writer takes them in place; the buffer is the bounce buffer.
    Source(&'a mut dyn PageSource),
}

/// [`handle`], with the data moving as `via` says.
pub fn handle_via(
    op: Op,
    start_sector: u64,
    nr_sectors: u32,
    buf: &mut [u8],
    store: &PageStore,
    writer: &dyn PageWriter,
    via: Via<'_>,
) -> i32 {
    // A FLUSH carries no range (its start_sector is u64::MAX): answer before any range check.
    if op == Op::Flush {
        return 0;
    }
    if let Op::Other(code) = op {
        return invalid(store, -libc::EOPNOTSUPP, || {
            format!("unsupported operation {code}")
        });
    }
    let sectors = u64::from(nr_sectors);
    if sectors == 0
        || !start_sector.is_multiple_of(SECTORS_PER_PAGE)
        || sectors % SECTORS_PER_PAGE != 0
    {
        return invalid(store, -libc::EINVAL, || {
            format!("{op:?} of {sectors} sectors at sector {start_sector} is not 4 KiB aligned")
        });
    }
    let first_page = start_sector / SECTORS_PER_PAGE;
    let count = sectors / SECTORS_PER_PAGE;
    if first_page.saturating_add(count) > store.pages() {
        return invalid(store, -libc::EINVAL, || {
            format!(
                "{op:?} of pages {first_page}+{count} is past the device's {} pages",
                store.pages()
            )
        });
    }
    match op {
        Op::Read | Op::Write => {
            let bytes = sectors << SECTOR_SHIFT;
            let Some(data) = usize::try_from(bytes).ok().and_then(|n| buf.get_mut(..n)) else {
                return invalid(store, -libc::EINVAL, || {
                    format!(
                        "{op:?} of {bytes} bytes exceeds the {}-byte buffer",
                        buf.len()
                    )
                });
            };
            // `data` is at most the I/O buffer (<= a few MiB), so its length fits in i32.
            let done = i32::try_from(data.len()).unwrap_or(i32::MAX);
            let result = match (op, via) {
                (Op::Read, Via::DiskReads(defer)) => store.read_deferring(first_page, data, defer),
                (Op::Read, _) => store.read(first_page, data),
                (_, Via::Source(source)) => {
                    // `count` pages fit in `data`, so in usize.
                    let pages = usize::try_from(count).unwrap_or(usize::MAX);
                    writer.write_pages_from(first_page, pages, source, data)
                }
                _ => writer.write_pages(first_page, data),
            };
            match result {
                Ok(()) => done,
                Err(err) => {
                    if op == Op::Read {
                        store.record_failed_read();
                    } else {
                        store.record_failed_write();
                    }
                    rate_limited(|| {
                        tracing::error!(?op, first_page, count, error = %err, "request failed");
                    });
                    err.errno()
                }
            }
        }
        Op::Discard | Op::WriteZeroes => {
            let result = if op == Op::Discard {
                store.discard(first_page, count)
            } else {
                store.write_zeroes(first_page, count)
            };
            match result {
                Ok(()) => 0,
                Err(err) => {
                    store.record_failed_write();
                    rate_limited(|| {
                        tracing::error!(?op, first_page, count, error = %err, "request failed");
                    });
                    err.errno()
                }
            }
        }
        Op::Flush | Op::Other(_) => 0,
    }
}

fn invalid(store: &PageStore, errno: i32, what: impl FnOnce() -> String) -> i32 {
    store.record_invalid_io();
    rate_limited(|| tracing::warn!("invalid request: {}", what()));
    errno
}

/// Runs `log` at most once a second across all queues; counts what it skipped.
fn rate_limited(log: impl FnOnce()) {
    static START: OnceLock<Instant> = OnceLock::new();
    static LAST_MS: AtomicU64 = AtomicU64::new(0);
    static SUPPRESSED: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(Instant::now);
    // +1000 so the very first line is never suppressed.
    let now = u64::try_from(start.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1000);
    let last = LAST_MS.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= 1000
        && LAST_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let skipped = SUPPRESSED.swap(0, Ordering::Relaxed);
        if skipped > 0 {
            tracing::warn!("{skipped} similar log lines suppressed");
        }
        log();
    } else {
        SUPPRESSED.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uzram_core::codec::Algorithm;
    use uzram_core::store::StoreConfig;

    const PAGE: usize = 4096;

    fn store(pages: u64) -> PageStore {
        PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap()
    }

    fn stat(store: &PageStore, name: &str) -> u64 {
        store
            .stats()
            .fields()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no stat {name}"))
    }

    fn pattern(pages: usize, seed: u8) -> Vec<u8> {
        (0..pages * PAGE).map(|i| (i / 7) as u8 ^ seed).collect()
    }

    #[test]
    fn write_then_read_returns_the_data() {
        let s = store(64);
        let mut data = pattern(4, 3);
        assert_eq!(
            handle(Op::Write, 8 * 10, 32, &mut data, &s, &s),
            4 * PAGE as i32
        );
        let mut out = vec![0u8; 512 << 10];
        assert_eq!(
            handle(Op::Read, 8 * 10, 32, &mut out, &s, &s),
            4 * PAGE as i32
        );
        assert_eq!(&out[..4 * PAGE], &data[..]);
        // A page never written reads as zeros.
        out.fill(0xAA);
        assert_eq!(handle(Op::Read, 0, 8, &mut out, &s, &s), PAGE as i32);
        assert!(out[..PAGE].iter().all(|b| *b == 0));
    }

    #[test]
    fn flush_succeeds_before_any_range_check() {
        let s = store(4);
        let mut buf = vec![0u8; PAGE];
        assert_eq!(handle(Op::Flush, u64::MAX, 0, &mut buf, &s, &s), 0);
        assert_eq!(stat(&s, "invalid_io"), 0);
    }

    #[test]
    fn discard_and_write_zeroes_read_back_as_zeros() {
        let s = store(16);
        let mut data = pattern(4, 9);
        assert_eq!(handle(Op::Write, 0, 32, &mut data, &s, &s), 4 * PAGE as i32);
        assert_eq!(handle(Op::Discard, 0, 16, &mut [], &s, &s), 0);
        assert_eq!(handle(Op::WriteZeroes, 16, 8, &mut [], &s, &s), 0);
        let mut out = vec![0xFFu8; 4 * PAGE];
        assert_eq!(handle(Op::Read, 0, 32, &mut out, &s, &s), 4 * PAGE as i32);
        assert!(out[..3 * PAGE].iter().all(|b| *b == 0));
        assert_eq!(&out[3 * PAGE..], &data[3 * PAGE..]);
        assert_eq!(stat(&s, "orig_data_size"), PAGE as u64);
    }

    #[test]
    fn unaligned_and_out_of_range_are_invalid() {
        let s = store(4);
        let mut buf = vec![0u8; 8 * PAGE];
        let cases: [(Op, u64, u32); 8] = [
            (Op::Read, 1, 8),
            (Op::Write, 0, 7),
            (Op::Read, 0, 0),
            (Op::Read, 32, 8),
            (Op::Write, 24, 16),
            (Op::Discard, u64::MAX - 7, 8),
            (Op::WriteZeroes, 0, u32::MAX),
            (Op::Read, u64::MAX, 8),
        ];
        for (i, (op, sector, n)) in cases.into_iter().enumerate() {
            assert_eq!(
                handle(op, sector, n, &mut buf, &s, &s),
                -libc::EINVAL,
                "{op:?} {sector} {n}"
            );
            assert_eq!(stat(&s, "invalid_io"), i as u64 + 1);
        }
        assert_eq!(
            handle(Op::Other(10), 0, 8, &mut buf, &s, &s),
            -libc::EOPNOTSUPP
        );
        assert_eq!(stat(&s, "invalid_io"), cases.len() as u64 + 1);
    }

    #[test]
    fn request_larger_than_buffer_is_invalid() {
        let s = store(64);
        let mut buf = vec![0u8; PAGE];
        assert_eq!(handle(Op::Read, 0, 16, &mut buf, &s, &s), -libc::EINVAL);
        assert_eq!(handle(Op::Write, 0, 16, &mut buf, &s, &s), -libc::EINVAL);
        assert_eq!(stat(&s, "invalid_io"), 2);
    }

    #[test]
    fn store_errors_become_errno_and_counters() {
        // A 64 KiB memory limit: 64 incompressible pages (256 KiB) cannot all fit.
        let mut cfg = StoreConfig::new(256, Algorithm::Lz4);
        cfg.mem_limit = Some(64 << 10);
        let s = PageStore::new(cfg).unwrap();
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut noise: Vec<u8> = (0..64 * PAGE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let r = handle(Op::Write, 0, 64 * 8, &mut noise, &s, &s);
        assert!(r < 0, "write past the memory limit returned {r}");
        assert_eq!(stat(&s, "failed_writes"), 1);
        assert_eq!(stat(&s, "invalid_io"), 0);
    }

    #[test]
    fn decodes_ublk_ops() {
        assert_eq!(Op::from_ublk(libublk::sys::UBLK_IO_OP_READ), Op::Read);
        assert_eq!(
            Op::from_ublk(libublk::sys::UBLK_IO_OP_WRITE | 0x100),
            Op::Write
        );
        assert_eq!(Op::from_ublk(libublk::sys::UBLK_IO_OP_FLUSH), Op::Flush);
        assert_eq!(Op::from_ublk(libublk::sys::UBLK_IO_OP_DISCARD), Op::Discard);
        assert_eq!(
            Op::from_ublk(libublk::sys::UBLK_IO_OP_WRITE_ZEROES),
            Op::WriteZeroes
        );
        assert_eq!(Op::from_ublk(200), Op::Other(200));
    }
}

//! Where a write's bytes come from when the writer does not hold them in memory: with
//! ublk's user copy the kernel copies a request's data on demand, so the GPU ring has it
//! copied straight into a staging slot ([`super::Ring::write_from`]) and the kernel's copy
//! is the only one.

use std::io;
use std::sync::atomic::AtomicU64;

use crate::page::{page_to_words, PAGE_SIZE};

/// Staging words leased to one writer. Only the ring makes them, over the indices of a slot
/// it leased to that writer, so nothing else reads or writes them until the writer
/// publishes them: a source may write them with plain stores (a `pread` into
/// [`LeasedWords::as_mut_ptr`]) as well as through [`LeasedWords::words`].
#[derive(Debug)]
pub struct LeasedWords<'a> {
    words: &'a [AtomicU64],
}

impl<'a> LeasedWords<'a> {
    /// The ring's lease of `words` (see the type: only the ring may make one).
    pub(crate) fn new(words: &'a [AtomicU64]) -> Self {
        Self { words }
    }

    /// The words, for atomic stores.
    pub fn words(&self) -> &'a [AtomicU64] {
        self.words
    }

    /// Their bytes' length.
    pub fn len_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Where their bytes start, writable for [`LeasedWords::len_bytes`] bytes while the
    /// lease lasts, by this writer alone (`AtomicU64` allows writes through a shared
    /// reference).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.words.as_ptr().cast::<u8>().cast_mut()
    }

    /// The first `words` of them, if there are that many.
    pub fn prefix(&self, words: usize) -> Option<LeasedWords<'a>> {
        self.words.get(..words).map(LeasedWords::new)
    }
}

/// A write's bytes, copied out on request by byte offset into the write.
pub trait PageSource {
    /// Fills `dst` (whole pages, laid out as [`page_to_words`] lays them: on a little-endian
    /// host, the page's bytes in order) with the write's bytes from `offset`.
    fn fill_words(&mut self, offset: usize, dst: LeasedWords<'_>) -> io::Result<()>;

    /// Fills `bytes` with the write's bytes from `offset`.
    fn fill_bytes(&mut self, offset: usize, bytes: &mut [u8]) -> io::Result<()>;
}

/// A write's bytes already in memory (tests, and `uzram bench` standing in for the kernel).
#[derive(Debug, Clone, Copy)]
pub struct BytesSource<'a>(pub &'a [u8]);

impl BytesSource<'_> {
    /// The write's `len` bytes from `offset`; an error past its end.
    pub fn range(&self, offset: usize, len: usize) -> io::Result<&[u8]> {
        offset
            .checked_add(len)
            .and_then(|end| self.0.get(offset..end))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{len} bytes at {offset} are past the write's {} bytes",
                        self.0.len()
                    ),
                )
            })
    }
}

impl PageSource for BytesSource<'_> {
    fn fill_words(&mut self, offset: usize, dst: LeasedWords<'_>) -> io::Result<()> {
        let bytes = self.range(offset, dst.len_bytes())?;
        for (page, words) in bytes
            .chunks_exact(PAGE_SIZE)
            .zip(dst.words().chunks_exact(PAGE_SIZE / 8))
        {
            let page: &[u8; PAGE_SIZE] = page.try_into().map_err(io::Error::other)?;
            page_to_words(page, words);
        }
        Ok(())
    }

    fn fill_bytes(&mut self, offset: usize, bytes: &mut [u8]) -> io::Result<()> {
        bytes.copy_from_slice(self.range(offset, bytes.len())?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::{words_to_page, PAGE_WORDS};

    #[test]
    fn bytes_fill_words_and_bytes_and_refuse_past_the_end() {
        let data: Vec<u8> = (0..2 * PAGE_SIZE).map(|i| (i % 251) as u8).collect();
        let mut src = BytesSource(&data);
        let words: Vec<AtomicU64> = (0..PAGE_WORDS).map(|_| AtomicU64::new(0)).collect();
        src.fill_words(PAGE_SIZE, LeasedWords::new(&words)).unwrap();
        let mut page = [0u8; PAGE_SIZE];
        words_to_page(&words, &mut page);
        assert_eq!(&page[..], &data[PAGE_SIZE..]);
        let mut bytes = [0u8; 16];
        src.fill_bytes(8, &mut bytes).unwrap();
        assert_eq!(&bytes[..], &data[8..24]);
        assert!(src
            .fill_words(2 * PAGE_SIZE, LeasedWords::new(&words))
            .is_err());
        assert!(src.fill_bytes(usize::MAX, &mut bytes).is_err());
    }
}

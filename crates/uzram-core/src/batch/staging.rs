//! Staging memory as a ring fills it and the store reads it ([`Staging`]), and as a later
//! process finds it ([`StagedCopy`]).
//!
//! A slot's **books** say which page each index of the slot holds in the slot's current
//! fill (its epoch), and the checksum its writer computed of it: one word per slot for the
//! epoch, then one word per index for the page number, then one per index for the checksum
//! ([`book_words`]). The checksum goes with the page into the store, and every copy of the
//! staged page (a read, an install, a recovery) is held to it. A staged page's entry names
//! (slot, index, epoch); its bytes are the slot's input words at that index only while the
//! books say so. The ring writes a
//! page's words, then its book word, then (after a fence) its entry, so memory as a killed
//! process leaves it never has an entry whose books agree with words that are not the
//! page's.
//!
//! A ring keeps its books and a backend its inputs in their own memory, or in memory the
//! caller keeps beyond the process ([`Words::Kept`]; the daemon: a locked SysV shared
//! memory segment). Then a new process reads the pages a dead one had staged through a
//! [`StagedCopy`] and installs them ([`crate::PageStore::recover`]) instead of losing them.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::backend::SlotBackend;
use crate::page::{page_checksum, words_to_page, PAGE_SIZE, PAGE_WORDS};
use crate::store::{StagedAt, StagedPages, Ticket};

/// Marks an index of a slot that holds no staged page.
pub(crate) const NO_PAGE: u64 = u64::MAX;

/// Words of the books of `slots` slots of `slot_pages` pages.
pub const fn book_words(slots: usize, slot_pages: usize) -> usize {
    slots * (1 + 2 * slot_pages)
}

/// Atomic words owned by their user, or kept by the caller for longer than the process
/// (so that a later process can read what this one left there).
#[derive(Debug)]
pub enum Words {
    /// Allocated by and dropped with their user.
    Own(Box<[AtomicU64]>),
    /// Memory the caller keeps for the rest of the process and beyond.
    Kept(&'static [AtomicU64]),
}

impl Words {
    /// `n` zeroed words of this process's own.
    pub fn zeroed(n: usize) -> Self {
        Self::Own((0..n).map(|_| AtomicU64::new(0)).collect())
    }
}

impl Deref for Words {
    type Target = [AtomicU64];

    fn deref(&self) -> &[AtomicU64] {
        match self {
            Self::Own(words) => words,
            Self::Kept(words) => words,
        }
    }
}

/// The books of `slots` slots of `slot_pages` pages, over [`book_words`] words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Books<'a> {
    words: &'a [AtomicU64],
    slots: usize,
    slot_pages: usize,
}

impl<'a> Books<'a> {
    /// The books of that shape over `words`; see [`Books::whole`].
    pub(crate) fn new(words: &'a [AtomicU64], slots: usize, slot_pages: usize) -> Self {
        Self {
            words,
            slots,
            slot_pages,
        }
    }

    /// Whether the words are exactly the books of this shape (else some slots name no
    /// page at all).
    pub(crate) fn whole(&self) -> bool {
        self.words.len() == book_words(self.slots, self.slot_pages)
    }

    /// The fill epoch of `slot`.
    #[inline]
    pub(crate) fn epoch(&self, slot: usize) -> Option<&'a AtomicU64> {
        if slot < self.slots {
            self.words.get(slot)
        } else {
            None
        }
    }

    /// The page staged at `index` of `slot` in its current fill ([`NO_PAGE`]: none).
    #[inline]
    pub(crate) fn page(&self, slot: usize, index: usize) -> Option<&'a AtomicU64> {
        if slot < self.slots && index < self.slot_pages {
            self.words.get(self.slots + slot * self.slot_pages + index)
        } else {
            None
        }
    }

    /// The checksum of the page staged at `index` of `slot` (in its low 32 bits).
    #[inline]
    pub(crate) fn checksum(&self, slot: usize, index: usize) -> Option<&'a AtomicU64> {
        if slot < self.slots && index < self.slot_pages {
            let pages = self.slots * self.slot_pages;
            self.words
                .get(self.slots + pages + slot * self.slot_pages + index)
        } else {
            None
        }
    }

    /// The checksum its writer recorded for `ticket`'s page, if the books say it is staged
    /// where the ticket says.
    #[inline]
    pub(crate) fn checksum_of(&self, ticket: Ticket) -> Option<u32> {
        let (slot, index) = (ticket.at.slot(), ticket.at.index());
        if self.ticket(slot, index) != Some(ticket) {
            return None;
        }
        Some(self.checksum(slot, index)?.load(Ordering::Relaxed) as u32)
    }

    /// The ticket of the page staged at `index` of `slot` in its current fill, if any.
    #[inline]
    pub(crate) fn ticket(&self, slot: usize, index: usize) -> Option<Ticket> {
        let page = self.page(slot, index)?.load(Ordering::Relaxed);
        let at = StagedAt::new(slot, index, self.epoch(slot)?.load(Ordering::Relaxed))?;
        (page != NO_PAGE).then_some(Ticket { page, at })
    }

    /// Forgets every staged page (epochs go on counting).
    pub(crate) fn clear_pages(&self) {
        let pages = self.slots * self.slot_pages;
        for w in self
            .words
            .get(self.slots..self.slots + pages)
            .unwrap_or_default()
        {
            w.store(NO_PAGE, Ordering::Relaxed);
        }
    }
}

/// Copies the page at `index` of a slot's `input` (`slot_pages * PAGE_WORDS` words) into
/// `out`, when `books` say it is `ticket`'s page and (with `checksums`) the copy matches
/// the checksum its writer recorded.
pub(crate) fn read_checked(
    books: &Books<'_>,
    input: &[AtomicU64],
    ticket: Ticket,
    checksums: bool,
    out: &mut [u8; PAGE_SIZE],
) -> bool {
    let Some(checksum) = books.checksum_of(ticket) else {
        return false;
    };
    let index = ticket.at.index();
    match input.get(index * PAGE_WORDS..(index + 1) * PAGE_WORDS) {
        Some(words) => {
            words_to_page(words, out);
            !checksums || page_checksum(out) == checksum
        }
        None => false,
    }
}

/// A ring's staging memory: the backend's inputs, checked against the books. The ring's
/// writers stage pages into it, its installers read them back, and the store reads staged
/// pages from it (it holds no reference to either). Everyone goes through its methods.
pub(crate) struct Staging {
    backend: Arc<dyn SlotBackend>,
    books: Words,
    slots: usize,
    slot_pages: usize,
    /// Writers record checksums and copies are held to them (the store's setting).
    checksums: bool,
}

impl Staging {
    /// The staging of `backend`'s `slots` slots of `slot_pages` pages, booked in `books`
    /// ([`book_words`] words). Forgets every page the books name: a page an earlier process
    /// staged there was recovered before, or is lost.
    pub(crate) fn new(
        backend: Arc<dyn SlotBackend>,
        books: Words,
        slots: usize,
        slot_pages: usize,
        checksums: bool,
    ) -> Self {
        let staging = Self {
            backend,
            books,
            slots,
            slot_pages,
            checksums,
        };
        staging.books().clear_pages();
        staging
    }

    fn books(&self) -> Books<'_> {
        Books::new(&self.books, self.slots, self.slot_pages)
    }

    /// The backend whose inputs are the slots.
    pub(crate) fn backend(&self) -> &dyn SlotBackend {
        &*self.backend
    }

    /// Number of slots.
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes of the books.
    pub(crate) fn book_bytes(&self) -> usize {
        self.books.len() * 8
    }

    /// Whether writers record each page's checksum (the store's setting): without them,
    /// results are installed without a comparison with their writer's.
    pub(crate) fn checksums(&self) -> bool {
        self.checksums
    }

    /// The fill epoch of `slot` (0 for a slot that does not exist).
    #[inline]
    pub(crate) fn epoch(&self, slot: usize) -> u64 {
        self.books()
            .epoch(slot)
            .map_or(0, |e| e.load(Ordering::Relaxed))
    }

    /// Starts `slot`'s next fill: entries that name the one before no longer match.
    #[inline]
    pub(crate) fn next_epoch(&self, slot: usize) {
        if let Some(epoch) = self.books().epoch(slot) {
            epoch.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Books `page` at `index` of `slot` ([`NO_PAGE`]: none).
    #[inline]
    pub(crate) fn book_page(&self, slot: usize, index: usize, page: u64) {
        if let Some(w) = self.books().page(slot, index) {
            w.store(page, Ordering::Relaxed);
        }
    }

    /// Records the checksum its writer computed of the page at `index` of `slot`.
    #[inline]
    pub(crate) fn book_checksum(&self, slot: usize, index: usize, checksum: u32) {
        if let Some(w) = self.books().checksum(slot, index) {
            w.store(u64::from(checksum), Ordering::Relaxed);
        }
    }

    /// The words of the page at `index` of `slot`.
    #[inline]
    pub(crate) fn words(&self, slot: usize, index: usize) -> Option<&[AtomicU64]> {
        self.words_run(slot, index, 1)
    }

    /// The words of the `count` pages from `index` of `slot`, one run of memory.
    #[inline]
    pub(crate) fn words_run(
        &self,
        slot: usize,
        index: usize,
        count: usize,
    ) -> Option<&[AtomicU64]> {
        self.backend
            .input(slot)
            .get(index * PAGE_WORDS..(index + count) * PAGE_WORDS)
    }

    /// The ticket of the page staged at `index` of `slot` in its current fill, if any.
    #[inline]
    pub(crate) fn ticket(&self, slot: usize, index: usize) -> Option<Ticket> {
        self.books().ticket(slot, index)
    }

    /// The checksum its writer recorded for `ticket`'s page, if the books say it is staged
    /// where the ticket says.
    #[inline]
    pub(crate) fn checksum(&self, ticket: Ticket) -> Option<u32> {
        self.books().checksum_of(ticket)
    }
}

impl StagedPages for Staging {
    fn read_staged(&self, page: u64, at: StagedAt, out: &mut [u8; PAGE_SIZE]) -> bool {
        read_checked(
            &self.books(),
            self.backend.input(at.slot()),
            Ticket { page, at },
            self.checksums,
            out,
        )
    }
}

/// The staging a dead process left in kept memory: its books and its slots' inputs (slot
/// after slot, `slot_pages * PAGE_WORDS` words each). A page is read only where the books
/// say the entry's page is there, so a torn or stale slot reads as missing, never as other
/// data.
#[derive(Debug, Clone, Copy)]
pub struct StagedCopy<'a> {
    books: Books<'a>,
    inputs: &'a [AtomicU64],
    checksums: bool,
}

impl<'a> StagedCopy<'a> {
    /// `None` unless `books` and `inputs` have the sizes of `slots` slots of `slot_pages`.
    /// With `checksums`, a page whose copy does not match the checksum its writer recorded
    /// reads as missing.
    pub fn new(
        books: &'a [AtomicU64],
        inputs: &'a [AtomicU64],
        slots: usize,
        slot_pages: usize,
        checksums: bool,
    ) -> Option<Self> {
        let books = Books::new(books, slots, slot_pages);
        (books.whole() && inputs.len() == slots * slot_pages * PAGE_WORDS).then_some(Self {
            books,
            inputs,
            checksums,
        })
    }
}

impl StagedPages for StagedCopy<'_> {
    fn read_staged(&self, page: u64, at: StagedAt, out: &mut [u8; PAGE_SIZE]) -> bool {
        let per = self.books.slot_pages * PAGE_WORDS;
        let input = self.inputs.get(at.slot() * per..(at.slot() + 1) * per);
        input.is_some_and(|input| {
            read_checked(&self.books, input, Ticket { page, at }, self.checksums, out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::page_to_words;

    #[test]
    fn a_copy_reads_only_what_the_books_name() {
        let (slots, slot_pages) = (2, 3);
        let books = Words::zeroed(book_words(slots, slot_pages));
        let inputs = Words::zeroed(slots * slot_pages * PAGE_WORDS);
        let b = Books::new(&books, slots, slot_pages);
        assert!(b.whole());
        b.clear_pages();
        b.epoch(1).unwrap().store(7, Ordering::Relaxed);
        b.page(1, 2).unwrap().store(42, Ordering::Relaxed);
        let page = [0xabu8; PAGE_SIZE];
        b.checksum(1, 2)
            .unwrap()
            .store(u64::from(page_checksum(&page)), Ordering::Relaxed);
        let at = (slot_pages + 2) * PAGE_WORDS;
        page_to_words(&page, &inputs[at..at + PAGE_WORDS]);
        let copy = StagedCopy::new(&books, &inputs, slots, slot_pages, true).unwrap();
        let mut out = [0u8; PAGE_SIZE];
        let here = StagedAt::new(1, 2, 7).unwrap();
        assert!(copy.read_staged(42, here, &mut out));
        assert_eq!(out, page);
        // another page, an older fill, another index, a slot that does not exist
        assert!(!copy.read_staged(41, here, &mut out));
        assert!(!copy.read_staged(42, StagedAt::new(1, 2, 6).unwrap(), &mut out));
        assert!(!copy.read_staged(42, StagedAt::new(1, 1, 7).unwrap(), &mut out));
        assert!(!copy.read_staged(42, StagedAt::new(2, 2, 7).unwrap(), &mut out));
        assert_eq!(
            b.checksum_of(Ticket { page: 42, at: here }),
            Some(page_checksum(&page))
        );
        // a flipped bit in the staged copy: it reads as missing, not as other data
        let w = &inputs[at + 17];
        w.store(w.load(Ordering::Relaxed) ^ 4, Ordering::Relaxed);
        assert!(!copy.read_staged(42, here, &mut out));
        let unchecked = StagedCopy::new(&books, &inputs, slots, slot_pages, false).unwrap();
        assert!(unchecked.read_staged(42, here, &mut out));
        w.store(w.load(Ordering::Relaxed) ^ 4, Ordering::Relaxed);
        assert!(copy.read_staged(42, here, &mut out));
        // a cleared book names nothing, and the checksums survive the clear untouched
        b.clear_pages();
        assert!(!copy.read_staged(42, here, &mut out));
        assert_eq!(b.checksum_of(Ticket { page: 42, at: here }), None);
        assert_eq!(
            b.checksum(1, 2).unwrap().load(Ordering::Relaxed),
            u64::from(page_checksum(&page))
        );
        assert!(StagedCopy::new(&books, &inputs[1..], slots, slot_pages, true).is_none());
        assert!(StagedCopy::new(&books[1..], &inputs, slots, slot_pages, true).is_none());
    }
}

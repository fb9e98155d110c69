//! The writers' path: a write leases indices of the open slot, copies its pages into the
//! slot's staging, books them and stages them in the store; a slot is sealed when full or
//! when its delay is up, and the last writer of a sealed slot submits it.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::Instant;

use super::shared::{Phase, Shared, SlotState, State};
use super::stats::{bump, Step};
use crate::batch::staging::NO_PAGE;
use crate::page::{
    page_checksum, page_to_words_streaming, same_filled_word, stream_fence, PAGE_SIZE,
};
use crate::store::StagedAt;
use crate::CoreError;

/// Most pages of one request a writer handles at a time.
const RUN: usize = 64;

/// Pages `base..base + count` of `slot`, leased to one writer.
struct Lease {
    slot: usize,
    base: usize,
    count: usize,
    epoch: u64,
}

impl Shared {
    /// [`Ring::write`](super::Ring::write).
    pub(super) fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let sh = self;
        if data.len() % PAGE_SIZE != 0 {
            return Err(CoreError::Unaligned { len: data.len() });
        }
        let n = (data.len() / PAGE_SIZE) as u64;
        let pages = sh.store.pages();
        if !first_page.checked_add(n).is_some_and(|end| end <= pages) {
            return Err(CoreError::OutOfRange {
                first: first_page,
                end: first_page.saturating_add(n),
                pages,
            });
        }
        if sh.retired.load(Ordering::Relaxed) {
            bump(&sh.counters.retired_pages, n);
            return sh.store.write(first_page, data);
        }
        let mut run = [(0u64, 0usize); RUN];
        let mut len = 0;
        for (i, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let page: &[u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            let index = first_page + i as u64;
            if let Some(word) = same_filled_word(page) {
                sh.store.write_same_filled(index, word)?;
                bump(&sh.counters.same_filled_pages, 1);
                continue;
            }
            run[len] = (index, i * PAGE_SIZE);
            len += 1;
            if len == RUN {
                sh.stage_run(&run[..len], data)?;
                len = 0;
            }
        }
        sh.stage_run(&run[..len], data)
    }

    /// Copies the pages of `run` (page number, offset in `data`) into leased slots and
    /// stages them; pages no slot takes are compressed inline.
    fn stage_run(&self, run: &[(u64, usize)], data: &[u8]) -> Result<(), CoreError> {
        let mut done = 0;
        while done < run.len() {
            let Some(lease) = self.reserve(run.len() - done) else {
                let retired = self.retired.load(Ordering::Relaxed);
                let rest = &run[done..];
                let counter = if retired {
                    &self.counters.retired_pages
                } else {
                    &self.counters.overflow_pages
                };
                bump(counter, rest.len() as u64);
                for &(page, offset) in rest {
                    self.store.write(page, &data[offset..offset + PAGE_SIZE])?;
                }
                return Ok(());
            };
            let result = self.fill(&lease, &run[done..done + lease.count], data);
            self.release(lease.slot);
            result?;
            done += lease.count;
        }
        Ok(())
    }

    /// Copies `pages` (at most [`RUN`]) into the lease and stages them, all or nothing:
    /// after a failure the lease is left empty (its indices name no page).
    fn fill(&self, lease: &Lease, pages: &[(u64, usize)], data: &[u8]) -> Result<(), CoreError> {
        let staging = &self.staging;
        let checksums = staging.checksums();
        let mut items = [(0u64, StagedAt::default()); RUN];
        for (j, &(page, offset)) in pages.iter().enumerate() {
            let index = lease.base + j;
            let bytes: &[u8; PAGE_SIZE] = data[offset..offset + PAGE_SIZE]
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            // The run's next page, fetched into cache while this one is copied.
            let next = pages
                .get(j + 1)
                .and_then(|&(_, o)| data.get(o..o + PAGE_SIZE))
                .and_then(|b| b.try_into().ok());
            if checksums {
                staging.book_checksum(lease.slot, index, page_checksum(bytes));
            }
            if let Some(words) = staging.words(lease.slot, index) {
                // The device reads these words next, not this CPU.
                page_to_words_streaming(bytes, next, words);
            }
            staging.book_page(lease.slot, index, page);
            let at = StagedAt::new(lease.slot, index, lease.epoch)
                .ok_or_else(|| CoreError::Config("staging slot out of range".into()))?;
            items[j] = (page, at);
        }
        // The copies land before the entries that point at them are published.
        stream_fence();
        let result = self.store.stage_many(&items[..pages.len()]);
        match &result {
            Ok(()) => bump(&self.counters.staged_pages, pages.len() as u64),
            Err(_) => {
                for j in 0..pages.len() {
                    staging.book_page(lease.slot, lease.base + j, NO_PAGE);
                }
            }
        }
        result
    }

    /// Leases up to `want` indices of the open slot (opening a free one if needed).
    /// `None`: the backend is retired, the ring is draining or stopping, or every slot is
    /// busy (after waiting up to [`RingConfig::slot_wait`](super::RingConfig::slot_wait)
    /// for one, unless stalled).
    fn reserve(&self, want: usize) -> Option<Lease> {
        if self.retired.load(Ordering::Relaxed) || self.draining.load(Ordering::Acquire) {
            return None;
        }
        let mut st = self.lock();
        let mut waited = false;
        loop {
            let closed =
                self.retired.load(Ordering::Relaxed) || self.draining.load(Ordering::Acquire);
            if st.stop || closed {
                return None;
            }
            if st.open.is_some() || !st.free.is_empty() {
                break;
            }
            if waited || st.stalled || self.cfg.slot_wait.is_zero() {
                return None;
            }
            bump(&self.counters.slot_waits, 1);
            let (guard, timeout) = self
                .idle
                .wait_timeout(st, self.cfg.slot_wait)
                .unwrap_or_else(PoisonError::into_inner);
            st = guard;
            waited = true;
            if timeout.timed_out() && st.open.is_none() && st.free.is_empty() {
                bump(&self.counters.slot_wait_timeouts, 1);
                st.stalled = true;
            }
        }
        let slot = match st.open {
            Some(slot) => slot,
            None => {
                let slot = st.free.pop()?;
                self.mark(slot, Step::Free);
                st.slots[slot] = SlotState {
                    phase: Phase::Filling,
                    filled: 0,
                    writers: 0,
                };
                self.staging.next_epoch(slot);
                st.open = Some(slot);
                st.opened = None;
                slot
            }
        };
        let slot_pages = self.slot_pages;
        let s = &mut st.slots[slot];
        let base = s.filled;
        let count = want.min(slot_pages - base);
        s.filled += count;
        s.writers += 1;
        if s.filled == slot_pages {
            s.phase = Phase::Sealed;
            self.mark(slot, Step::Filling);
            st.open = None;
            st.opened = None;
        } else if st.opened.is_none() {
            st.opened = Some(Instant::now());
            // An installer times the open slot.
            self.work.notify_one();
        }
        Some(Lease {
            slot,
            base,
            count,
            epoch: self.staging.epoch(slot),
        })
    }

    /// A writer is done with its lease of `slot`; the last writer of a sealed slot
    /// submits it.
    fn release(&self, slot: usize) {
        let submit = {
            let mut st = self.lock();
            let s = &mut st.slots[slot];
            s.writers -= 1;
            if s.phase == Phase::Sealed && s.writers == 0 {
                s.phase = Phase::Busy;
                Some(s.filled)
            } else {
                None
            }
        };
        if let Some(pages) = submit {
            self.submit(slot, pages);
        }
    }

    /// Seals `slot` (no more leases); returns its page count when it can be submitted now.
    pub(super) fn seal(&self, st: &mut State, slot: usize) -> Option<usize> {
        if st.open == Some(slot) {
            st.open = None;
            st.opened = None;
        }
        self.mark(slot, Step::Filling);
        let s = &mut st.slots[slot];
        s.phase = Phase::Sealed;
        if s.writers == 0 {
            s.phase = Phase::Busy;
            return Some(s.filled);
        }
        None
    }
}

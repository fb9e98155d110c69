//! The writers' path: a write leases indices of the open slot, copies its pages into the
//! slot's staging (or has its source copy them there: [`Shared::write_from`]), books them
//! and stages them in the store; a slot is sealed when full or when its delay is up, and
//! the last writer of a sealed slot submits it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::PoisonError;
use std::time::Instant;

use super::shared::{
    filled, writers, Lease, Phase, Shared, SlotState, State, Waiter, LEASE_OPEN, LEASE_SEALED,
    LEASE_WRITER, MAX_LINE, NO_SLOT,
};
use super::stats::{bump, Step};
use crate::batch::staging::NO_PAGE;
use crate::batch::{LeasedWords, PageSource};
use crate::page::{
    page_checksum, page_to_words_streaming, page_to_words_streaming_checksummed, same_filled_word,
    stream_fence, with_words_as_page, PAGE_SIZE, PAGE_WORDS,
};
use crate::store::{Replaced, StagedAt};
use crate::CoreError;

/// Most pages of one request a writer handles at a time.
const RUN: usize = 64;

impl Shared {
    /// [`Ring::write`](super::Ring::write).
    pub(super) fn write(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        let sh = self;
        if !data.len().is_multiple_of(PAGE_SIZE) {
            return Err(CoreError::Unaligned { len: data.len() });
        }
        let n = (data.len() / PAGE_SIZE) as u64;
        self.check_range(first_page, n)?;
        if sh.retired.load(Ordering::Acquire) {
            bump(&sh.counters.retired_pages, n);
            return sh.store.write(first_page, data);
        }
        let mut run = [(0u64, 0usize); RUN];
        let mut len = 0;
        // A request's same-filled pages are stored together: one shard lock and one bump
        // of the shared counts for a run of them, not one each (a fifth of mixed-swap's
        // pages).
        let mut fills = [(0u64, 0u64); RUN];
        let mut nfills = 0;
        for (i, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
            let page: &[u8; PAGE_SIZE] = page
                .try_into()
                .map_err(|_| CoreError::Unaligned { len: data.len() })?;
            let index = first_page + i as u64;
            if let Some(word) = same_filled_word(page) {
                fills[nfills] = (index, word);
                nfills += 1;
                if nfills == RUN {
                    sh.store_fills(&fills[..nfills])?;
                    nfills = 0;
                }
                continue;
            }
            run[len] = (index, i * PAGE_SIZE);
            len += 1;
            if len == RUN {
                sh.stage_run(&run[..len], data)?;
                len = 0;
            }
        }
        sh.store_fills(&fills[..nfills])?;
        sh.stage_run(&run[..len], data)
    }

    /// Stores same-filled pages (distinct pages of one request) and counts them.
    fn store_fills(&self, fills: &[(u64, u64)]) -> Result<(), CoreError> {
        if fills.is_empty() {
            return Ok(());
        }
        self.store.write_same_filled_many(fills)?;
        bump(&self.counters.same_filled_pages, fills.len() as u64);
        Ok(())
    }

    /// [`Self::store_fills`] for same-filled pages of `lease`, page `k` at its index
    /// `indices[k]`: the objects they replace are kept at those indices for the slot's
    /// installer to give back, as a staged page's are (the index names no page then).
    fn store_fills_keeping_replaced(
        &self,
        lease: &Lease,
        fills: &[(u64, u64)],
        indices: &[usize],
    ) -> Result<(), CoreError> {
        if fills.is_empty() {
            return Ok(());
        }
        let mut replaced = [None; RUN];
        let result = self
            .store
            .write_same_filled_many_replacing(fills, Some(&mut replaced[..fills.len()]));
        // Kept whatever the result: a page written before a failure replaced its object.
        self.keep_replaced(lease, indices.iter().copied(), &replaced);
        result?;
        bump(&self.counters.same_filled_pages, fills.len() as u64);
        Ok(())
    }

    /// [`Ring::write_from`](super::Ring::write_from).
    pub(super) fn write_from(
        &self,
        first_page: u64,
        pages: usize,
        source: &mut dyn PageSource,
        bounce: &mut [u8],
    ) -> Result<(), CoreError> {
        self.check_range(first_page, pages as u64)?;
        let bytes = pages
            .checked_mul(PAGE_SIZE)
            .ok_or(CoreError::Unaligned { len: usize::MAX })?;
        let Some(bounce) = bounce.get_mut(..bytes) else {
            return Err(CoreError::Unaligned { len: bounce.len() });
        };
        let mut done = 0;
        while done < pages {
            let Some(lease) = self.reserve((pages - done).min(RUN)) else {
                // No slot takes them: into the bounce buffer, and compressed inline.
                bump(self.inline_counter(), (pages - done) as u64);
                let rest = &mut bounce[done * PAGE_SIZE..];
                source
                    .fill_bytes(done * PAGE_SIZE, rest)
                    .map_err(CoreError::Source)?;
                return self.store.write(first_page + done as u64, rest);
            };
            let result = self.fill_from(&lease, first_page + done as u64, done, source);
            self.release(lease.slot);
            result?;
            done += lease.count;
        }
        Ok(())
    }

    /// Has the source copy the lease's pages (page `first` on, `skip` pages into the write)
    /// into its slot, then scans, checksums and stages them in place; a same-filled page is
    /// stored as such and its index left empty. All or nothing for the staged pages: after a
    /// failure the lease is left empty.
    fn fill_from(
        &self,
        lease: &Lease,
        first: u64,
        skip: usize,
        source: &mut dyn PageSource,
    ) -> Result<(), CoreError> {
        let staging = &self.staging;
        let checksums = staging.checksums();
        let empty = || {
            for j in 0..lease.count {
                staging.book_page(lease.slot, lease.base + j, NO_PAGE);
            }
        };
        let Some(words) = staging.words_run(lease.slot, lease.base, lease.count) else {
            empty();
            return Err(CoreError::Config("staging slot out of range".into()));
        };
        if let Err(err) = source.fill_words(skip * PAGE_SIZE, LeasedWords::new(words)) {
            empty();
            return Err(CoreError::Source(err));
        }
        let mut items = [(0u64, StagedAt::default()); RUN];
        let mut staged = 0;
        let mut fills = [(0u64, 0u64); RUN];
        let mut fill_indices = [0usize; RUN];
        let mut same = 0;
        for (j, words) in words.chunks_exact(PAGE_WORDS).enumerate() {
            let (index, page) = (lease.base + j, first + j as u64);
            // The lease keeps every other writer off these words, and the device reads
            // them only after the slot is submitted.
            let scanned = with_words_as_page(words, |p| {
                let fill = same_filled_word(p);
                let crc = (fill.is_none() && checksums).then(|| page_checksum(p));
                (fill, crc)
            });
            let Some((fill, crc)) = scanned else {
                empty();
                return Err(CoreError::Config("staging slot out of range".into()));
            };
            if let Some(word) = fill {
                staging.book_page(lease.slot, index, NO_PAGE);
                fills[same] = (page, word);
                fill_indices[same] = index;
                same += 1;
                continue;
            }
            if let Some(crc) = crc {
                staging.book_checksum(lease.slot, index, crc);
            }
            staging.book_page(lease.slot, index, page);
            let Some(at) = StagedAt::new(lease.slot, index, lease.epoch) else {
                empty();
                return Err(CoreError::Config("staging slot out of range".into()));
            };
            items[staged] = (page, at);
            staged += 1;
        }
        if let Err(err) =
            self.store_fills_keeping_replaced(lease, &fills[..same], &fill_indices[..same])
        {
            empty();
            return Err(err);
        }
        if staged == 0 {
            // Every page was same-filled: nothing to stage (and no memory check to fail).
            return Ok(());
        }
        // The books land before the entries that point at them are published.
        stream_fence();
        let result = self.stage_keeping_replaced(lease, &items[..staged]);
        match &result {
            Ok(()) => bump(&self.counters.staged_pages, staged as u64),
            Err(_) => empty(),
        }
        result
    }

    /// Stages `items` (pages of `lease`'s slot, at most [`RUN`]), keeping the objects they
    /// replace for the slot's installer to give back (`replaced.rs`).
    fn stage_keeping_replaced(
        &self,
        lease: &Lease,
        items: &[(u64, StagedAt)],
    ) -> Result<(), CoreError> {
        let mut replaced = [None; RUN];
        self.store
            .stage_many_replacing(items, Some(&mut replaced[..items.len()]))?;
        self.keep_replaced(lease, items.iter().map(|(_, at)| at.index()), &replaced);
        Ok(())
    }

    /// Keeps in the books of `lease`'s slot what the page at the k-th of `indices` replaced
    /// (`replaced[k]`, where there is one).
    fn keep_replaced(
        &self,
        lease: &Lease,
        indices: impl Iterator<Item = usize>,
        replaced: &[Option<Replaced>],
    ) {
        for (index, r) in indices.zip(replaced) {
            if let Some(r) = *r {
                self.replaced.keep(lease.slot, index, r);
            }
        }
    }

    /// Where pages no slot took count: as the retired backend's, or as overflow.
    fn inline_counter(&self) -> &AtomicU64 {
        if self.retired.load(Ordering::Acquire) {
            &self.counters.retired_pages
        } else {
            &self.counters.overflow_pages
        }
    }

    /// Refuses a write of `n` pages from `first_page` that leaves the device.
    fn check_range(&self, first_page: u64, n: u64) -> Result<(), CoreError> {
        let pages = self.store.pages();
        if first_page.checked_add(n).is_none_or(|end| end > pages) {
            return Err(CoreError::OutOfRange {
                first: first_page,
                end: first_page.saturating_add(n),
                pages,
            });
        }
        Ok(())
    }

    /// Copies the pages of `run` (page number, offset in `data`) into leased slots and
    /// stages them; pages no slot takes are compressed inline.
    fn stage_run(&self, run: &[(u64, usize)], data: &[u8]) -> Result<(), CoreError> {
        let mut done = 0;
        while done < run.len() {
            let Some(lease) = self.reserve(run.len() - done) else {
                let rest = &run[done..];
                bump(self.inline_counter(), rest.len() as u64);
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
            // The device reads these words next, not this CPU; with checksums on, the page
            // is read once for both the copy and its CRC.
            match (checksums, staging.words(lease.slot, index)) {
                (true, Some(words)) => {
                    let crc = page_to_words_streaming_checksummed(bytes, next, words);
                    staging.book_checksum(lease.slot, index, crc);
                }
                (true, None) => staging.book_checksum(lease.slot, index, page_checksum(bytes)),
                (false, Some(words)) => page_to_words_streaming(bytes, next, words),
                (false, None) => {}
            }
            staging.book_page(lease.slot, index, page);
            let at = StagedAt::new(lease.slot, index, lease.epoch)
                .ok_or_else(|| CoreError::Config("staging slot out of range".into()))?;
            items[j] = (page, at);
        }
        // The copies land before the entries that point at them are published.
        stream_fence();
        let result = self.stage_keeping_replaced(lease, &items[..pages.len()]);
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
    /// busy (after waiting in line up to
    /// [`RingConfig::slot_wait`](super::RingConfig::slot_wait) for room, unless stalled).
    ///
    /// Waiters are served in the order they came: a freed slot's pages are leased to them
    /// before anyone else's, and while anyone waits, a writer queues behind them. Without
    /// the line, a writer that slept through a wake-up found the freed slot taken by
    /// writers that were running, gave up after its one wait and compressed inline: at 16
    /// queue threads 1,000-3,000 pages a GiB went to the CPU that way, none with the line
    /// (docs/bench/gpu-runs.md, runs 160-161).
    fn reserve(&self, want: usize) -> Option<Lease> {
        if self.closed() {
            return None;
        }
        // Without the mutex: the open slot, if it has room and nobody waits for it.
        let hint = self.open_hint.load(Ordering::Acquire);
        if hint != NO_SLOT && self.waiting.load(Ordering::Acquire) == 0 {
            if let Some((lease, event)) = self.lease_in(hint, want) {
                if event != Leased::Plain {
                    let mut st = self.lock();
                    self.after_lease(&mut st, hint, event);
                }
                return Some(lease);
            }
        }
        let mut st = self.lock();
        if st.stop || self.closed() {
            return None;
        }
        if self.waiting.load(Ordering::Acquire) == 0 {
            if let Some(lease) = self.lease_now(&mut st, want) {
                return Some(lease);
            }
        }
        if st.stalled || self.cfg.slot_wait.is_zero() || st.line.len() == MAX_LINE {
            return None;
        }
        let ticket = self.join_line(&mut st, want);
        bump(&self.counters.slot_waits, 1);
        let start = Instant::now();
        loop {
            let left = self.cfg.slot_wait.saturating_sub(start.elapsed());
            let (guard, _) = self
                .idle
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner);
            st = guard;
            let at = st.line.iter().position(|w| w.ticket == ticket);
            if let Some(i) = at.filter(|&i| st.line[i].grant.is_some()) {
                // Granted while it slept: it leaves the line with its lease.
                return self.leave_line(&mut st, i);
            }
            let closed = st.stop || self.closed();
            if closed || start.elapsed() >= self.cfg.slot_wait {
                if let Some(i) = at {
                    self.leave_line(&mut st, i);
                }
                if !closed && st.open.is_none() && st.free.is_empty() {
                    bump(&self.counters.slot_wait_timeouts, 1);
                    st.stalled = true;
                }
                // Room it leaves behind goes to whoever waits after it.
                self.serve_line(&mut st);
                drop(st);
                self.idle.notify_all();
                return None;
            }
        }
    }

    /// Retired, or draining: no more leases.
    fn closed(&self) -> bool {
        self.retired.load(Ordering::Acquire) || self.draining.load(Ordering::Acquire)
    }

    /// Leases up to `want` pages of the open slot, or of a free slot it opens; `None` when
    /// every slot is busy.
    fn lease_now(&self, st: &mut State, want: usize) -> Option<Lease> {
        loop {
            if let Some(slot) = st.open {
                if let Some((lease, event)) = self.lease_in(slot, want) {
                    self.after_lease(st, slot, event);
                    return Some(lease);
                }
                // Sealed by a writer that filled it, which clears `open` once it has the
                // mutex: clear it now.
                self.close(st, slot);
                continue;
            }
            let slot = st.free.pop()?;
            self.mark(slot, Step::Free);
            st.slots[slot] = SlotState {
                phase: Phase::InUse,
            };
            self.staging.next_epoch(slot);
            // The epoch first: a writer whose lease succeeds on this word reads it.
            self.leases[slot].store(LEASE_OPEN, Ordering::Release);
            st.open = Some(slot);
            st.opened = None;
            self.open_hint.store(slot, Ordering::Release);
        }
    }

    /// Leases room to the writers waiting in line, first come first served, as far as it
    /// goes; they pick their grants up when they wake (`idle` is notified by the caller).
    pub(super) fn serve_line(&self, st: &mut State) {
        if self.closed() || st.stop {
            return;
        }
        let mut i = 0;
        while i < st.line.len() {
            if st.line[i].grant.is_none() {
                let want = st.line[i].want;
                let Some(lease) = self.lease_now(st, want) else {
                    return;
                };
                self.grant(st, i, lease);
            }
            i += 1;
        }
    }

    /// Puts a writer that wants `want` pages at the end of the line, counted as waiting;
    /// returns its ticket.
    fn join_line(&self, st: &mut State, want: usize) -> u64 {
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        st.line.push_back(Waiter {
            ticket,
            want,
            grant: None,
        });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        ticket
    }

    /// Gives waiter `i` of the line its `lease`, which takes it off the waiting count.
    fn grant(&self, st: &mut State, i: usize, lease: Lease) {
        st.line[i].grant = Some(lease);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes waiter `i` out of the line; returns its grant, if it had one, and otherwise
    /// takes it off the waiting count.
    fn leave_line(&self, st: &mut State, i: usize) -> Option<Lease> {
        let grant = st.line.remove(i)?.grant;
        if grant.is_none() {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        grant
    }

    /// Leases up to `want` pages of `slot` with one compare-and-swap on its lease word;
    /// `None` when it is not open or full.
    fn lease_in(&self, slot: usize, want: usize) -> Option<(Lease, Leased)> {
        let word = self.leases.get(slot)?;
        let mut w = word.load(Ordering::Acquire);
        loop {
            let base = filled(w);
            if w & LEASE_OPEN == 0 || w & LEASE_SEALED != 0 || base >= self.slot_pages {
                return None;
            }
            let count = want.min(self.slot_pages - base);
            let full = base + count == self.slot_pages;
            let mut new = w + count as u64 + LEASE_WRITER;
            if full {
                new = (new | LEASE_SEALED) & !LEASE_OPEN;
            }
            match word.compare_exchange_weak(w, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    let event = match (full, base) {
                        (true, _) => Leased::Filled,
                        (false, 0) => Leased::First,
                        _ => Leased::Plain,
                    };
                    // The slot cannot be reopened (its epoch move) while this lease holds it.
                    let epoch = self.staging.epoch(slot);
                    let lease = Lease {
                        slot,
                        base,
                        count,
                        epoch,
                    };
                    return Some((lease, event));
                }
                Err(now) => w = now,
            }
        }
    }

    /// What a lease that took a slot's first pages, or its last, tells the others.
    fn after_lease(&self, st: &mut State, slot: usize, event: Leased) {
        match event {
            Leased::Plain => {}
            // An installer times the open slot.
            Leased::First => {
                if st.open == Some(slot) && st.opened.is_none() {
                    st.opened = Some(Instant::now());
                    self.work.notify_one();
                }
            }
            Leased::Filled => {
                self.close(st, slot);
                self.mark(slot, Step::Filling);
            }
        }
    }

    /// `slot` takes no more leases: it is no longer the open one.
    fn close(&self, st: &mut State, slot: usize) {
        if st.open == Some(slot) {
            st.open = None;
            st.opened = None;
        }
        let _ = self
            .open_hint
            .compare_exchange(slot, NO_SLOT, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// A writer is done with its lease of `slot`; the last writer of a sealed slot
    /// submits it.
    fn release(&self, slot: usize) {
        let Some(word) = self.leases.get(slot) else {
            return;
        };
        let before = word.fetch_sub(LEASE_WRITER, Ordering::AcqRel);
        if before & LEASE_SEALED != 0 && writers(before) == 1 {
            self.submit(slot, filled(before));
        }
    }

    /// Seals `slot` (no more leases); returns its page count when it can be submitted now
    /// (no writer holds a lease; otherwise the last one to let go submits it). `None` too
    /// when it was sealed already.
    pub(super) fn seal(&self, st: &mut State, slot: usize) -> Option<usize> {
        self.close(st, slot);
        let word = self.leases.get(slot)?;
        let before = word
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w & LEASE_SEALED == 0).then_some((w | LEASE_SEALED) & !LEASE_OPEN)
            })
            .ok()?;
        self.mark(slot, Step::Filling);
        (writers(before) == 0).then_some(filled(before))
    }

    /// Pages leased in `slot` so far.
    pub(super) fn leased(&self, slot: usize) -> usize {
        self.leases
            .get(slot)
            .map_or(0, |w| filled(w.load(Ordering::Acquire)))
    }

    /// Whether a writer holds a lease of `slot`.
    pub(super) fn held(&self, slot: usize) -> bool {
        self.leases
            .get(slot)
            .is_some_and(|w| writers(w.load(Ordering::Acquire)) > 0)
    }
}

/// What a lease did to its slot besides leasing pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leased {
    Plain,
    /// It took the slot's first pages.
    First,
    /// It took the slot's last pages, sealing it.
    Filled,
}

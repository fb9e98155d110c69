//! The installer threads: each takes a [`Job`] (a submitted or failed slot), waits for the
//! backend's results, checks them against what the writers staged (checksums, spot checks,
//! the layout's contract), plans each page (the backend's block, the staged words, or the
//! CPU's own compression) and commits the plan to the store a chunk at a time. Staging is
//! only read through [`Staging`](crate::batch::staging::Staging)'s questions: a page's
//! words, its ticket and its writer's checksum.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::shared::{Job, Shared};
use super::stats::{bump, nanos, Step};
use crate::batch::backend::{BackendError, FailureKind};
use crate::batch::layout::{PageResult, SlotOutput};
use crate::batch::Placer;
use crate::codec::{Algorithm, PageCodec};
use crate::page::{page_checksum, same_filled_word, words_to_page, PAGE_SIZE};
use crate::store::{Commit, CommitState, CopyCost, Encoded, Ticket};
use crate::CoreError;

/// Most pages an installer commits at a time: a whole slot (2048 pages by default), so that
/// a backend's copy engine places runs of the slot's packed results, which lie in the order
/// the device packed them, not in the slot's.
const CHUNK: usize = 4096;
/// Page buffers of an installer, for pages it compresses itself (the backend could not, or
/// its result was refused): a chunk ends early when they are used up. Pages the backend
/// found incompressible need none: they are stored from their staged words.
pub(super) const BUFS: usize = 256;

/// Installer thread `id`'s life: jobs until the ring stops.
pub(super) fn installer_loop(sh: &Shared, tools: Tools, id: usize) {
    let mut installer = Installer::new(sh, tools);
    while let Some(job) = sh.next_job(id) {
        installer.take(job);
    }
}

/// What one page of a chunk becomes.
#[derive(Debug, Clone, Copy)]
enum Plan {
    Same(u64),
    /// The backend's block for this index of the slot.
    Block(usize),
    /// This index of the slot, stored raw from its staged words.
    Staged(usize),
    /// `len` bytes of installer buffer `buf` (`len == PAGE_SIZE`: the raw page).
    Buf {
        buf: usize,
        len: usize,
    },
}

/// One installer thread's codec and buffers, allocated once when the ring starts.
pub(super) struct Tools {
    codec: Box<dyn PageCodec>,
    bufs: Vec<[u8; PAGE_SIZE]>,
    scratch: Box<[u8; PAGE_SIZE]>,
    plan: Vec<(Ticket, Plan)>,
    compressed_seen: u64,
    /// Pages whose checksum this chunk compared, counted once a chunk: a shared counter
    /// bumped for every page is a cache line the installers pass between them.
    checked: u64,
}

impl Tools {
    pub(super) fn new(algorithm: Algorithm) -> Result<Self, CoreError> {
        let mut bufs = Vec::new();
        bufs.try_reserve_exact(BUFS)
            .map_err(|_| CoreError::NoMemory)?;
        bufs.resize(BUFS, [0u8; PAGE_SIZE]);
        let mut plan = Vec::new();
        plan.try_reserve_exact(CHUNK)
            .map_err(|_| CoreError::NoMemory)?;
        Ok(Self {
            codec: algorithm.try_codec().map_err(CoreError::Compress)?,
            bufs,
            scratch: Box::new([0u8; PAGE_SIZE]),
            plan,
            compressed_seen: 0,
            checked: 0,
        })
    }
}

/// An installer at work (one of the installer threads, or the watcher).
pub(super) struct Installer<'a> {
    sh: &'a Shared,
    tools: Tools,
}

impl<'a> Installer<'a> {
    pub(super) fn new(sh: &'a Shared, tools: Tools) -> Self {
        Self { sh, tools }
    }

    /// Installs `job`'s slot and frees it.
    pub(super) fn take(&mut self, job: Job) {
        let sh = self.sh;
        let start = Instant::now();
        // First, so that the slot's new objects can take the room its pages' old ones held.
        sh.store
            .free_replaced(sh.replaced.take(job.slot, job.pages));
        self.run(job);
        bump(&sh.counters.install_busy_ns, nanos(start.elapsed()));
        bump(&sh.counters.slots_installed, 1);
        sh.free(job.slot);
    }

    /// Compresses the pages of `job`'s slot on the CPU from their staged copies, without the
    /// backend (failed, retired, or, for the watcher, stuck in its wait: that slot stays its
    /// stuck installer's to free).
    pub(super) fn on_cpu(&mut self, job: Job) {
        bump(&self.sh.counters.fallback_slots, 1);
        self.install(job, None);
    }

    fn run(&mut self, job: Job) {
        let sh = self.sh;
        // `next_job` marked the slot in the device's hands; the watcher looks at it only
        // while this thread waits in `complete`.
        if !job.submitted || sh.hung.load(Ordering::Acquire) {
            sh.left_device(job.slot);
        } else {
            let mut completed = false;
            let result = sh.staging.backend().complete(job.slot, &mut |out| {
                if !completed {
                    // The device answered: installing is no longer the watcher's business.
                    sh.left_device(job.slot);
                    sh.mark(job.slot, Step::Device);
                }
                completed = true;
                self.install(job, Some(out));
            });
            sh.left_device(job.slot);
            if !completed {
                // The wait ended without results: that time was the device's, not installing.
                sh.mark(job.slot, Step::Device);
            }
            match result {
                Ok(()) if completed => {
                    sh.failures_in_row.store(0, Ordering::Relaxed);
                    return;
                }
                // The watcher compressed them while this thread was stuck.
                _ if sh.claimed(job.slot) => return,
                Ok(()) => sh.failed(&BackendError {
                    backend: sh.staging.backend().name(),
                    kind: FailureKind::Transient,
                    message: "completed a slot without results".into(),
                }),
                Err(e) => sh.failed(&e),
            }
        }
        self.on_cpu(job);
    }

    /// Installs the slot's pages from `out`, or (without results) compresses them on the CPU.
    fn install(&mut self, job: Job, out: Option<&SlotOutput<'_>>) {
        let out = match out {
            Some(o) if o.pages() != job.pages => {
                self.violation(&format!(
                    "{} results for a slot of {} pages",
                    o.pages(),
                    job.pages
                ));
                None
            }
            other => other,
        };
        let mut index = 0;
        while index < job.pages {
            index = self.plan_chunk(job.slot, index, job.pages, out);
            bump(
                &self.sh.counters.checksum_checked_pages,
                std::mem::take(&mut self.tools.checked),
            );
            self.commit_chunk(job.slot, out);
        }
    }

    /// Plans pages from `start` on (at most a chunk, fewer when the buffers run out);
    /// returns where the next chunk starts.
    fn plan_chunk(
        &mut self,
        slot: usize,
        start: usize,
        pages: usize,
        out: Option<&SlotOutput<'_>>,
    ) -> usize {
        self.tools.plan.clear();
        let mut next_buf = 0;
        let end = (start + CHUNK).min(pages);
        for index in start..end {
            if next_buf == BUFS {
                return index;
            }
            let Some(ticket) = self.sh.staging.ticket(slot, index) else {
                continue;
            };
            let result = out.map(|o| o.page(index));
            let plan = match result {
                Some(Ok(PageResult::SameFilled(word))) => (self.checksum_holds(ticket, out, index)
                    && self.fill_holds(slot, index, word))
                .then_some(Plan::Same(word)),
                Some(Ok(PageResult::Compressed(block))) => {
                    (self.checksum_holds(ticket, out, index) && self.spot_check(slot, index, block))
                        .then_some(Plan::Block(index))
                }
                // Stored from the slot's own copy: no bounce through a buffer.
                Some(Ok(PageResult::Raw)) => Some(Plan::Staged(index)),
                Some(Ok(PageResult::Rejected)) => {
                    bump(&self.sh.counters.rejected_pages, 1);
                    None
                }
                Some(Err(bad)) => {
                    self.violation(&bad.to_string());
                    None
                }
                None => None,
            };
            let plan = match plan {
                Some(p) => p,
                None => {
                    self.load(slot, index, next_buf);
                    next_buf += 1;
                    self.encode_on_cpu(next_buf - 1, ticket)
                }
            };
            self.tools.plan.push((ticket, plan));
        }
        end
    }

    /// Copies the staged page into buffer `buf`.
    fn load(&mut self, slot: usize, index: usize, buf: usize) {
        if let Some(words) = self.sh.staging.words(slot, index) {
            words_to_page(words, &mut self.tools.bufs[buf]);
        }
    }

    /// Compresses the page in buffer `buf`, staged for `ticket`, on the CPU (the result
    /// replaces it there).
    fn encode_on_cpu(&mut self, buf: usize, ticket: Ticket) -> Plan {
        bump(&self.sh.counters.cpu_pages, 1);
        let page = &mut self.tools.bufs[buf];
        if let Some(word) = same_filled_word(page) {
            // Writers store same-filled pages themselves, so a staged copy that reads as a
            // fill may be one damaged since its writer took its checksum; a fill entry keeps
            // no checksum, so the fill is taken only where the writer's checksum says so.
            // Otherwise the page is stored with that checksum and its reads fail the check.
            let staging = &self.sh.staging;
            if !staging.checksums() || staging.checksum(ticket) == Some(page_checksum(page)) {
                return Plan::Same(word);
            }
        }
        let limit = self.sh.limit;
        match self
            .tools
            .codec
            .compress_below(page, &mut self.tools.scratch[..], limit)
        {
            Ok(Some(len)) => {
                page[..len].copy_from_slice(&self.tools.scratch[..len]);
                Plan::Buf { buf, len }
            }
            _ => Plan::Buf {
                buf,
                len: PAGE_SIZE,
            },
        }
    }

    /// Whether the checksum the backend reports for page `index` of the slot is the one its
    /// writer recorded (always, in a store without checksums). False (the page goes to the
    /// CPU, and the backend is retired) when not: the backend compressed other bytes than
    /// were staged.
    fn checksum_holds(
        &mut self,
        ticket: Ticket,
        out: Option<&SlotOutput<'_>>,
        index: usize,
    ) -> bool {
        let sh = self.sh;
        if !sh.staging.checksums() {
            return true;
        }
        self.tools.checked += 1;
        let theirs = out.and_then(|o| o.checksum(index).ok());
        let ours = sh.staging.checksum(ticket);
        if theirs.is_some() && theirs == ours {
            return true;
        }
        bump(&sh.counters.checksum_mismatches, 1);
        tracing::error!(
            page = ticket.page,
            backend = ?theirs,
            writer = ?ours,
            "a backend result is not of the page that was staged"
        );
        sh.retire("a result whose checksum is not its page's");
        false
    }

    /// Whether page `index` of the slot is `word` repeated, as the backend says: a fill
    /// entry carries no checksum of the page, so no read could catch a wrong one. Such
    /// results are rare (the writers store fills themselves), and one that is wrong breaks
    /// the contract (the backend is retired, the page compressed on the CPU).
    fn fill_holds(&mut self, slot: usize, index: usize, word: u64) -> bool {
        let holds = self
            .sh
            .staging
            .words(slot, index)
            .is_some_and(|words| words.iter().all(|w| w.load(Ordering::Relaxed) == word));
        if !holds {
            self.violation("a same-filled result for a page that is not");
        }
        holds
    }

    /// Decodes every n-th block on the CPU and compares it with the staged page. False
    /// (and the backend retired) on a mismatch.
    fn spot_check(&mut self, slot: usize, index: usize, block: &[u8]) -> bool {
        let every = self.sh.cfg.spot_check_every;
        self.tools.compressed_seen += 1;
        if every == 0 || !self.tools.compressed_seen.is_multiple_of(every) {
            return true;
        }
        bump(&self.sh.counters.spot_checked_pages, 1);
        let decoded = self
            .tools
            .codec
            .decompress(block, &mut self.tools.scratch)
            .is_ok();
        let same = decoded
            && self.sh.staging.words(slot, index).is_some_and(|words| {
                words
                    .iter()
                    .zip(self.tools.scratch.chunks_exact(8))
                    .all(|(w, b)| w.load(Ordering::Relaxed).to_le_bytes() == *b)
            });
        if !same {
            bump(&self.sh.counters.spot_check_failures, 1);
            self.sh
                .retire("a compressed page failed the CPU spot check");
        }
        same
    }

    fn violation(&self, what: &str) {
        bump(&self.sh.counters.contract_violations, 1);
        tracing::error!(what, "the batch backend broke the result contract");
        self.sh.retire("a result that breaks the layout's contract");
    }

    /// Installs the planned chunk, retrying while the allocator has no memory (the staged
    /// copies are the only ones: they are never given up).
    fn commit_chunk(&mut self, slot: usize, out: Option<&SlotOutput<'_>>) {
        let mut commits: Vec<Commit<'_>> = Vec::new();
        let mut backoff = Duration::from_micros(100);
        while commits.try_reserve_exact(self.tools.plan.len()).is_err() {
            self.wait_for_memory(&mut backoff);
        }
        let staging = &self.sh.staging;
        for &(ticket, plan) in &self.tools.plan {
            // The writer's checksum: what every later read of the page is held to.
            let checksum = staging.checksum(ticket).unwrap_or_default();
            let encoded = match plan {
                Plan::Same(word) => Encoded::SameFilled(word),
                Plan::Block(index) => match out.map(|o| o.page(index)) {
                    Some(Ok(PageResult::Compressed(block))) => Encoded::Compressed(block),
                    _ => continue,
                },
                Plan::Staged(index) => match staging.words(slot, index) {
                    Some(words) => Encoded::RawWords(words),
                    None => continue,
                },
                Plan::Buf { buf, len } if len == PAGE_SIZE => Encoded::Raw(&self.tools.bufs[buf]),
                Plan::Buf { buf, len } => Encoded::Compressed(&self.tools.bufs[buf][..len]),
            };
            commits.push(Commit::new(ticket, encoded, checksum));
        }
        let sh = self.sh;
        // The copy engine places runs of blocks that lie next to each other in the packed
        // results: in that order they go to the arena's frontier one after another.
        let placer = out
            .and_then(SlotOutput::placer)
            .filter(|_| !sh.place_off.load(Ordering::Relaxed));
        if let Some(p) = placer {
            commits = in_packed_order(commits, p);
        }
        let mut tries = 0u64;
        let mut cost = CopyCost::default();
        while let Err(e) = sh.store.commit_with(&mut commits, Some(&mut cost), placer) {
            if tries.is_multiple_of(1000) {
                tracing::warn!(error = %e, tries, "installing staged pages failed; retrying");
            }
            tries += 1;
            self.wait_for_memory(&mut backoff);
        }
        bump(&sh.counters.install_copy_ns, nanos(cost.copying));
        bump(&sh.counters.placed_bytes, cost.placed_bytes);
        bump(&sh.counters.placed_runs, cost.placed_runs);
        if cost.place_failed {
            bump(&sh.counters.place_failures, 1);
            if !sh.place_off.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    "the backend's copy engine failed to place compressed pages; the \
                     installers copy them from now on"
                );
            }
        }
        let installed = commits
            .iter()
            .filter(|c| c.state == CommitState::Installed)
            .count() as u64;
        bump(&sh.counters.installed_pages, installed);
        bump(&sh.counters.stale_pages, commits.len() as u64 - installed);
    }

    fn wait_for_memory(&self, backoff: &mut Duration) {
        bump(&self.sh.counters.commit_retries, 1);
        std::thread::sleep(*backoff);
        *backoff = (*backoff * 2).min(Duration::from_millis(20));
    }
}

/// `commits` sorted by where their blocks lie in the slot's packed results, for the copy
/// engine's runs, with the others (pages stored raw, mostly) first: where one of those does
/// not fit the rest of an arena segment, blocks from the end of the list fill that rest,
/// where raw pages at the end left it a hole (1.9 % more memory on mixed-swap). Each
/// block's place is looked up once: a sort that asked the placer at every comparison cost
/// more than the copies it saved. Unsorted when there is no memory for the keys (the
/// installers then copy more themselves).
fn in_packed_order<'a>(commits: Vec<Commit<'a>>, placer: &dyn Placer) -> Vec<Commit<'a>> {
    let mut keys: Vec<u64> = Vec::new();
    let mut sorted: Vec<Commit<'a>> = Vec::new();
    if keys.try_reserve_exact(commits.len()).is_err()
        || sorted.try_reserve_exact(commits.len()).is_err()
    {
        return commits;
    }
    keys.extend(commits.iter().enumerate().map(|(i, c)| {
        let at = match c.encoded {
            Encoded::Compressed(block) => placer.packed_offset(block),
            _ => None,
        };
        // The offset above (one past it, 0 for none), the index below: packed buffers and
        // slots are far under 4 GiB and 4 G pages.
        (at.map_or(0, |o| o as u64 + 1) << 32) | i as u64
    }));
    keys.sort_unstable();
    sorted.extend(
        keys.iter()
            .filter_map(|&k| commits.get((k & 0xffff_ffff) as usize).copied()),
    );
    sorted
}

//! [`HostSlots`]: the synchronous CPU implementation of the slot seam. `submit` compresses
//! the slot on the calling thread; `complete` hands the results over. The ring's tests run
//! against it, with faults injected through a [`FaultPlan`] (failing, lying, rejecting and
//! slow backends), so every failure path of the ring runs on machines without a GPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::backend::{BackendError, BackendMemory, FailureKind, SlotBackend};
use super::layout::SlotOutput;
use super::layout::{meta_bytes, SIZE_RAW, SIZE_REJECTED, SIZE_SAME_FILLED};
use super::place::{offset_within, PlaceRun, Placer};
use super::staging::Words;
use crate::codec::{Algorithm, PageCodec};
use crate::page::{page_checksum, same_filled_word, words_to_page, PAGE_SIZE, PAGE_WORDS};
use crate::CoreError;

/// Which calls of one kind fail: the `from`-th (counting from 0) and the `count - 1`
/// after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailAt {
    /// First failing call.
    pub from: u64,
    /// How many calls fail (`u64::MAX`: all from `from` on).
    pub count: u64,
    /// What the failure says about the backend.
    pub kind: FailureKind,
}

impl FailAt {
    fn hits(&self, n: u64) -> bool {
        n >= self.from && n - self.from < self.count
    }
}

/// Faults to inject.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Failing `submit` calls.
    pub submit: Option<FailAt>,
    /// Failing `complete` calls.
    pub complete: Option<FailAt>,
    /// Mark every n-th compressed page rejected (a device check that caught a bad block).
    pub reject_every: u64,
    /// Flip a byte in every n-th compressed block and report it as good (a lying device:
    /// its check passes blocks that do not decode to their page).
    pub corrupt_every: u64,
    /// Flip a bit in the input every n-th compressed page was read with, and report the
    /// checksum of what was compressed (a device that compressed other bytes than were
    /// staged: a copy that went wrong, a slot reused too early).
    pub misread_every: u64,
    /// Report every n-th page that is not same-filled as its first word repeated, with the
    /// page's true checksum (a device whose same-fill test is wrong: the checksum it reports
    /// is of the page it read, and holds).
    pub false_fill_every: u64,
    /// Zero every n-th page's staged copy in the slot itself before compressing it, and
    /// report what it then holds, honestly: a fill of zeros with the checksum of zeros (the
    /// staging damaged after its writer took the page's checksum).
    pub zero_input_every: u64,
    /// Wait this long in every `complete` (a slow device).
    pub delay: Duration,
    /// Completions that do not return until released (a device that hangs without an
    /// error).
    pub hang: Option<Hang>,
    /// Submissions that do not return until released (a driver call that blocks in a
    /// wedged driver).
    pub hang_submit: Option<Hang>,
    /// Panic in this submission (counting from 0): a bug in the backend's `submit`.
    pub panic_submit: Option<u64>,
    /// Wait this long in every `complete` after its results were installed (a device slow
    /// to let go of a slot it answered for).
    pub linger: Duration,
}

/// Every call from the `from`-th on (counting from 0) waits until [`Hang::release`].
#[derive(Debug, Clone, Default)]
pub struct Hang {
    /// First hanging call.
    pub from: u64,
    released: Arc<(Mutex<bool>, Condvar)>,
}

impl Hang {
    /// Calls from the `from`-th on hang.
    pub fn from(from: u64) -> Self {
        Self {
            from,
            released: Arc::default(),
        }
    }

    /// Lets the hanging calls (and every later one) return.
    pub fn release(&self) {
        let (released, cv) = &*self.released;
        *released.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
    }

    fn wait(&self, n: u64) {
        if n < self.from {
            return;
        }
        let (released, cv) = &*self.released;
        let mut done = released.lock().unwrap_or_else(PoisonError::into_inner);
        while !*done {
            done = cv.wait(done).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl FaultPlan {
    /// A device that never fails but takes `delay` in every `complete`: results come back
    /// after the writes that staged them have returned.
    pub fn slow(delay: Duration) -> Self {
        FaultPlan {
            delay,
            ..FaultPlan::default()
        }
    }
}

#[derive(Debug, Default)]
struct Output {
    pages: usize,
    limit: usize,
    meta: Vec<u8>,
    packed: Vec<u8>,
    /// The "device's" copy of `packed`, which a [`CopyEngine`] places from.
    device: Vec<u8>,
}

/// A stand-in for a GPU's copy engine ([`crate::batch::Placer`]): with one, blocks are packed
/// in the store's object form (the block and room for its checksum, rounded to 8 bytes), as
/// the GPU's kernels pack them, and placed from a second copy of the results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyEngine {
    /// None: the installers copy every block.
    #[default]
    Absent,
    /// Places what it is asked to.
    Works,
    /// Refuses every placement (a driver call that fails).
    Refuses,
    /// Places from a copy in which the first byte of every block differs from the host's (a
    /// copy engine, or device memory, that damages what it moves).
    Damages,
}

/// [`CopyEngine`] over one slot's results.
struct HostPlacer<'a> {
    engine: CopyEngine,
    packed: &'a [u8],
    device: &'a [u8],
}

impl Placer for HostPlacer<'_> {
    fn packed_offset(&self, bytes: &[u8]) -> Option<usize> {
        offset_within(self.packed, bytes)
    }

    fn reaches(&self, _to: &[AtomicU64]) -> bool {
        true
    }

    fn place(&self, runs: &[PlaceRun<'_>]) -> bool {
        if self.engine == CopyEngine::Refuses {
            return false;
        }
        for r in runs {
            let Some(from) = self.device.get(r.from..r.from + r.len()) else {
                return false;
            };
            for (w, b) in r.to.iter().zip(from.chunks_exact(8)) {
                let mut word = [0u8; 8];
                word.copy_from_slice(b);
                w.store(u64::from_le_bytes(word), Ordering::Relaxed);
            }
        }
        true
    }
}

/// Slots in ordinary memory, compressed on the CPU at `submit`.
pub struct HostSlots {
    algorithm: Algorithm,
    slots: usize,
    slot_pages: usize,
    /// Slot after slot, `slot_pages * PAGE_WORDS` words each.
    inputs: Words,
    outputs: Box<[Mutex<Output>]>,
    codec: Mutex<Box<dyn PageCodec>>,
    /// Blocks are liblz4's with this dictionary as their prefix (a stand-in for the GPU's
    /// dictionary recompressor).
    #[cfg(feature = "liblz4-reference")]
    dictionary: Mutex<Option<Vec<u8>>>,
    faults: FaultPlan,
    engine: CopyEngine,
    submits: AtomicU64,
    completes: AtomicU64,
    compressed: AtomicU64,
    misread: AtomicU64,
    /// Pages looked at for `FaultPlan::false_fill_every`.
    false_fills: AtomicU64,
    /// Pages looked at for `FaultPlan::zero_input_every`.
    zeroed: AtomicU64,
}

impl std::fmt::Debug for HostSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSlots")
            .field("algorithm", &self.algorithm)
            .field("slots", &self.slots)
            .field("kept_inputs", &matches!(self.inputs, Words::Kept(_)))
            .field("slot_pages", &self.slot_pages)
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

impl HostSlots {
    /// `slots` slots of `slot_pages` pages each, producing `algorithm`.
    pub fn new(algorithm: Algorithm, slots: usize, slot_pages: usize) -> Self {
        Self::with_faults(algorithm, slots, slot_pages, FaultPlan::default())
    }

    /// As [`HostSlots::new`], with faults injected.
    pub fn with_faults(
        algorithm: Algorithm,
        slots: usize,
        slot_pages: usize,
        faults: FaultPlan,
    ) -> Self {
        Self::with_inputs(
            algorithm,
            slots,
            slot_pages,
            Words::zeroed(slots * slot_pages * PAGE_WORDS),
            faults,
        )
    }

    /// As [`HostSlots::with_faults`], with the slots' inputs in memory the caller keeps
    /// (slot after slot, `slot_pages * PAGE_WORDS` words each): what a GPU backend does
    /// with staging that outlives the process, for tests of that on any machine.
    pub fn over(
        algorithm: Algorithm,
        slots: usize,
        slot_pages: usize,
        inputs: &'static [AtomicU64],
        faults: FaultPlan,
    ) -> Result<Self, CoreError> {
        if inputs.len() != slots * slot_pages * PAGE_WORDS {
            return Err(CoreError::Config(format!(
                "{} input words for {slots} slots of {slot_pages} pages",
                inputs.len()
            )));
        }
        Ok(Self::with_inputs(
            algorithm,
            slots,
            slot_pages,
            Words::Kept(inputs),
            faults,
        ))
    }

    fn with_inputs(
        algorithm: Algorithm,
        slots: usize,
        slot_pages: usize,
        inputs: Words,
        faults: FaultPlan,
    ) -> Self {
        Self {
            algorithm,
            slots,
            slot_pages,
            inputs,
            outputs: (0..slots).map(|_| Mutex::new(Output::default())).collect(),
            codec: Mutex::new(algorithm.codec()),
            #[cfg(feature = "liblz4-reference")]
            dictionary: Mutex::new(None),
            faults,
            engine: CopyEngine::Absent,
            submits: AtomicU64::new(0),
            completes: AtomicU64::new(0),
            compressed: AtomicU64::new(0),
            misread: AtomicU64::new(0),
            false_fills: AtomicU64::new(0),
            zeroed: AtomicU64::new(0),
        }
    }

    /// The same slots, with `engine` as their copy engine.
    pub fn with_copy_engine(self, engine: CopyEngine) -> Self {
        Self { engine, ..self }
    }

    /// From now on, LZ4 blocks with `dict` as their prefix (liblz4's, through
    /// `LZ4_loadDict`), as a dictionary recompressor writes them.
    #[cfg(feature = "liblz4-reference")]
    pub fn load_dictionary(&self, dict: &[u8]) {
        *self
            .dictionary
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(dict.to_vec());
    }

    fn output(&self, slot: usize) -> Result<MutexGuard<'_, Output>, BackendError> {
        self.outputs
            .get(slot)
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
            .ok_or_else(|| self.error(FailureKind::Transient, format!("no slot {slot}")))
    }

    fn error(&self, kind: FailureKind, message: String) -> BackendError {
        BackendError {
            backend: "host",
            kind,
            message,
        }
    }

    /// Compresses the slot's first `pages` pages into `out`.
    fn compress(&self, slot: usize, pages: usize, limit: usize, out: &mut Output) {
        let input = self.input(slot);
        out.pages = pages;
        out.limit = limit;
        out.meta.clear();
        out.meta.resize(meta_bytes(pages), 0);
        out.packed.clear();
        let mut codec = self.codec.lock().unwrap_or_else(PoisonError::into_inner);
        #[cfg(feature = "liblz4-reference")]
        let dictionary = self
            .dictionary
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut page = [0u8; PAGE_SIZE];
        let mut block = vec![0u8; PAGE_SIZE];
        // Where the compressed blocks start, for a copy engine that damages them.
        let mut blocks = Vec::new();
        for i in 0..pages {
            let words = &input[i * PAGE_WORDS..(i + 1) * PAGE_WORDS];
            let zeroed = self.zeroed.fetch_add(1, Ordering::Relaxed) + 1;
            if self.faults.zero_input_every > 0
                && zeroed.is_multiple_of(self.faults.zero_input_every)
            {
                words.iter().for_each(|w| w.store(0, Ordering::Relaxed));
            }
            words_to_page(words, &mut page);
            let seen = self.misread.fetch_add(1, Ordering::Relaxed) + 1;
            if self.faults.misread_every > 0 && seen.is_multiple_of(self.faults.misread_every) {
                page[100] ^= 1;
            }
            let at = (2 * pages + 1 + i) * 4;
            out.meta[at..at + 4].copy_from_slice(&page_checksum(&page).to_le_bytes());
            let offset = out.packed.len() as u32;
            let false_fill = self.faults.false_fill_every > 0
                && (self.false_fills.fetch_add(1, Ordering::Relaxed) + 1)
                    .is_multiple_of(self.faults.false_fill_every);
            let size = if let Some(word) = same_filled_word(&page) {
                out.packed.extend_from_slice(&word.to_le_bytes());
                SIZE_SAME_FILLED
            } else if false_fill {
                out.packed.extend_from_slice(&page[..8]);
                SIZE_SAME_FILLED
            } else {
                #[cfg(feature = "liblz4-reference")]
                let compressed = match dictionary.as_deref() {
                    Some(dict) => dict_block(&page, dict, &mut block, limit),
                    None => codec.compress_below(&page, &mut block, limit),
                };
                #[cfg(not(feature = "liblz4-reference"))]
                let compressed = codec.compress_below(&page, &mut block, limit);
                match compressed {
                    Ok(Some(len)) => {
                        let n = self.compressed.fetch_add(1, Ordering::Relaxed) + 1;
                        let reject = self.faults.reject_every > 0
                            && n.is_multiple_of(self.faults.reject_every);
                        let corrupt = self.faults.corrupt_every > 0
                            && n.is_multiple_of(self.faults.corrupt_every);
                        if reject {
                            SIZE_REJECTED
                        } else {
                            if corrupt {
                                // The first byte is a token: changing its literal count
                                // makes the block decode to something else (or nothing).
                                block[0] ^= 0x10;
                            }
                            out.packed.extend_from_slice(&block[..len]);
                            blocks.push(offset as usize);
                            if self.engine != CopyEngine::Absent {
                                // The store's object form, as a GPU packs it.
                                let room = (len + 4).next_multiple_of(8);
                                out.packed.resize(offset as usize + room, 0);
                            }
                            len as u32
                        }
                    }
                    _ => SIZE_RAW,
                }
            };
            out.meta[i * 4..i * 4 + 4].copy_from_slice(&size.to_le_bytes());
            let at = (pages + i) * 4;
            out.meta[at..at + 4].copy_from_slice(&offset.to_le_bytes());
        }
        let total = out.packed.len() as u32;
        let at = 2 * pages * 4;
        out.meta[at..at + 4].copy_from_slice(&total.to_le_bytes());
        out.device.clone_from(&out.packed);
        if self.engine == CopyEngine::Damages {
            for at in blocks {
                out.device[at] ^= 0x10;
            }
        }
    }
}

impl SlotBackend for HostSlots {
    fn name(&self) -> &'static str {
        "host"
    }

    fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn slot_pages(&self) -> usize {
        self.slot_pages
    }

    fn input(&self, slot: usize) -> &[AtomicU64] {
        let per = self.slot_pages * PAGE_WORDS;
        self.inputs
            .get(slot * per..(slot + 1) * per)
            .unwrap_or_default()
    }

    fn submit(&self, slot: usize, pages: usize, limit: usize) -> Result<(), BackendError> {
        let n = self.submits.fetch_add(1, Ordering::Relaxed);
        if let Some(hang) = &self.faults.hang_submit {
            hang.wait(n);
        }
        assert!(
            self.faults.panic_submit != Some(n),
            "injected panic in submission {n}"
        );
        if let Some(f) = self.faults.submit.filter(|f| f.hits(n)) {
            return Err(self.error(f.kind, format!("injected failure of submission {n}")));
        }
        if pages == 0 || pages > self.slot_pages {
            return Err(self.error(
                FailureKind::Transient,
                format!("{pages} pages in a slot of {}", self.slot_pages),
            ));
        }
        let mut out = self.output(slot)?;
        self.compress(slot, pages, limit, &mut out);
        Ok(())
    }

    fn complete(
        &self,
        slot: usize,
        install: &mut dyn FnMut(&SlotOutput<'_>),
    ) -> Result<(), BackendError> {
        let n = self.completes.fetch_add(1, Ordering::Relaxed);
        if !self.faults.delay.is_zero() {
            std::thread::sleep(self.faults.delay);
        }
        if let Some(hang) = &self.faults.hang {
            hang.wait(n);
        }
        if let Some(f) = self.faults.complete.filter(|f| f.hits(n)) {
            return Err(self.error(f.kind, format!("injected failure of completion {n}")));
        }
        let out = self.output(slot)?;
        let view = SlotOutput::new(out.pages, &out.meta, &out.packed, out.limit)
            .map_err(|e| self.error(FailureKind::Transient, e.to_string()))?;
        let placer = HostPlacer {
            engine: self.engine,
            packed: &out.packed,
            device: &out.device,
        };
        match self.engine {
            CopyEngine::Absent => install(&view),
            _ => install(&view.with_placer(&placer)),
        }
        drop(out);
        if !self.faults.linger.is_zero() {
            std::thread::sleep(self.faults.linger);
        }
        Ok(())
    }

    fn memory(&self) -> BackendMemory {
        BackendMemory {
            host_bytes: (self.slots * self.slot_pages * PAGE_SIZE * 2) as u64,
            ..BackendMemory::default()
        }
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("host_submits", self.submits.load(Ordering::Relaxed)),
            ("host_completes", self.completes.load(Ordering::Relaxed)),
        ]
    }
}

/// liblz4's block of `page` with `dict` as its prefix, into `block` if shorter than `limit`.
#[cfg(feature = "liblz4-reference")]
fn dict_block(
    page: &[u8; PAGE_SIZE],
    dict: &[u8],
    block: &mut [u8],
    limit: usize,
) -> Result<Option<usize>, crate::codec::CodecError> {
    let b = crate::fuzz::liblz4::compress_with_dict(page, dict);
    Ok((b.len() < limit && b.len() <= block.len()).then(|| {
        block[..b.len()].copy_from_slice(&b);
        b.len()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::PageResult;
    use crate::page::page_to_words;

    fn text_page(seed: u8) -> [u8; PAGE_SIZE] {
        let mut p = [0u8; PAGE_SIZE];
        for (i, b) in p.iter_mut().enumerate() {
            *b = b"host slots compress pages "[(i + usize::from(seed)) % 26];
        }
        p
    }

    #[test]
    fn compresses_a_slot_into_the_layout() {
        let host = HostSlots::new(Algorithm::Lz4, 2, 4);
        let pages = [text_page(1), [0u8; PAGE_SIZE], text_page(2)];
        for (i, p) in pages.iter().enumerate() {
            page_to_words(p, &host.input(1)[i * PAGE_WORDS..(i + 1) * PAGE_WORDS]);
        }
        host.submit(1, 3, 3625).unwrap();
        let mut seen = 0;
        host.complete(1, &mut |out| {
            assert_eq!(out.pages(), 3);
            assert_eq!(out.page(1), Ok(PageResult::SameFilled(0)));
            for (i, p) in pages.iter().enumerate() {
                assert_eq!(out.checksum(i), Ok(page_checksum(p)));
            }
            for i in [0, 2] {
                let Ok(PageResult::Compressed(block)) = out.page(i) else {
                    panic!("page {i}: {:?}", out.page(i));
                };
                let mut back = [0u8; PAGE_SIZE];
                Algorithm::Lz4.codec().decompress(block, &mut back).unwrap();
                assert_eq!(back, pages[i]);
            }
            seen += 1;
        })
        .unwrap();
        assert_eq!(seen, 1);
    }

    #[test]
    fn injected_failures_hit_the_calls_they_name() {
        let host = HostSlots::with_faults(
            Algorithm::Lz4,
            1,
            1,
            FaultPlan {
                submit: Some(FailAt {
                    from: 1,
                    count: 2,
                    kind: FailureKind::Transient,
                }),
                ..FaultPlan::default()
            },
        );
        let results: Vec<bool> = (0..5).map(|_| host.submit(0, 1, 4096).is_ok()).collect();
        assert_eq!(results, [true, false, false, true, true]);
        assert!(host.submit(0, 2, 4096).is_err(), "more pages than a slot");
    }
}

//! The GPU pipeline: a ring of slots, each with pinned host staging, device buffers, a
//! stream and events. A slot goes Idle → (H2D → kernel → D2H queued on its stream) →
//! waited → Idle, so copies and kernels of different slots overlap on the GPU while the
//! host fills or drains other slots.

use std::sync::Arc;

use uzram_core::batch::PageOutcome;
use uzram_core::PAGE_SIZE;

use crate::driver::{DevBuf, Event, Gpu, HostBuf, Stream};
use crate::layout::{decode_outcome, meta_bytes, meta_word, stored_bytes, total_index, SIZE_RAW};
use crate::{launch, GpuError};

/// Pipeline shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineConfig {
    /// GPU ordinal.
    pub device: usize,
    /// Pages per slot (one kernel launch). Kernels of different slots overlap on the GPU,
    /// so small launches do not leave SMs idle.
    pub batch_pages: usize,
    /// Slots in the ring (>= 3 lets H2D, kernel and D2H of different slots overlap). On an
    /// H200, 8 slots reached 44 GB/s end to end where 4 slots stayed at 31-35 GB/s, at any
    /// batch size from 4096 to 32768 pages (docs/gpu-notes.md).
    pub slots: usize,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            device: 0,
            batch_pages: 4096,
            slots: 8,
        }
    }
}

impl PipelineConfig {
    /// Checks the values are usable.
    pub fn validate(&self) -> Result<(), GpuError> {
        if self.slots == 0 || self.slots > 64 {
            return Err(GpuError::Config(format!(
                "slots must be 1..=64, got {}",
                self.slots
            )));
        }
        if self.batch_pages == 0 || self.batch_pages > (1 << 20) {
            return Err(GpuError::Config(format!(
                "batch_pages must be 1..=1048576, got {}",
                self.batch_pages
            )));
        }
        Ok(())
    }
}

/// Counters of a pipeline, summed over every waited batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuStats {
    /// Batches completed.
    pub batches: u64,
    /// Pages completed.
    pub pages: u64,
    /// Uncompressed bytes in.
    pub bytes_in: u64,
    /// Bytes the results take in memory (block lengths; raw pages count whole; same-filled
    /// pages nothing).
    pub bytes_stored: u64,
    /// Bytes copied back from the device (packed blocks, words and the per-page meta).
    pub bytes_d2h: u64,
    /// Pages found same-filled on the GPU.
    pub same_filled: u64,
    /// Pages that did not compress below the threshold.
    pub raw: u64,
    /// Device time of host→device copies, ms.
    pub h2d_ms: f64,
    /// Device time of kernels, ms.
    pub kernel_ms: f64,
    /// Device time of device→host copies, ms.
    pub d2h_ms: f64,
}

/// Pages in pinned host memory that the pipeline can copy from directly (no staging copy).
#[derive(Debug)]
pub struct PinnedPages {
    buf: HostBuf,
}

impl PinnedPages {
    /// `pages` zeroed pinned pages on `gpu`.
    pub fn new(gpu: &Arc<Gpu>, pages: usize) -> Result<Self, GpuError> {
        Ok(Self {
            buf: HostBuf::new(gpu, pages * PAGE_SIZE)?,
        })
    }

    /// Number of pages.
    pub fn pages(&self) -> usize {
        self.buf.len() / PAGE_SIZE
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }

    /// The bytes, writable. Unavailable while a pipeline holds the pages (it holds an
    /// `Arc` clone until the batch is waited for).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }
}

#[derive(Debug)]
struct InFlight {
    pages: usize,
    limit: u32,
    /// Keeps an external input alive until the copy is done.
    _source: Option<Arc<PinnedPages>>,
    /// Packed bytes, once their copy back to the host is queued.
    packed: Option<usize>,
}

#[derive(Debug)]
struct Slot {
    stream: Stream,
    /// start, H2D done, kernel done, meta D2H done, packed D2H start, packed D2H done.
    events: [Event; 6],
    staging: HostBuf,
    host_packed: HostBuf,
    host_meta: HostBuf,
    dev_in: DevBuf,
    dev_scratch: DevBuf,
    dev_packed: DevBuf,
    dev_meta: DevBuf,
    in_flight: Option<InFlight>,
    /// Pages, limit and packed bytes of the last waited batch, whose results are in
    /// `host_*`.
    done: Option<(usize, u32, usize)>,
}

impl Slot {
    fn new(gpu: &Arc<Gpu>, batch_pages: usize) -> Result<Self, GpuError> {
        let bytes = batch_pages * PAGE_SIZE;
        let events = [
            Event::new(gpu)?,
            Event::new(gpu)?,
            Event::new(gpu)?,
            Event::new(gpu)?,
            Event::new(gpu)?,
            Event::new(gpu)?,
        ];
        Ok(Self {
            stream: Stream::new(gpu)?,
            events,
            staging: HostBuf::new(gpu, bytes)?,
            host_packed: HostBuf::new(gpu, bytes)?,
            host_meta: HostBuf::new(gpu, meta_bytes(batch_pages))?,
            dev_in: DevBuf::new(gpu, bytes)?,
            dev_scratch: DevBuf::new(gpu, bytes)?,
            dev_packed: DevBuf::new(gpu, bytes)?,
            dev_meta: DevBuf::new(gpu, meta_bytes(batch_pages))?,
            in_flight: None,
            done: None,
        })
    }
}

/// The results of one waited slot.
#[derive(Debug)]
pub struct SlotOutput<'a> {
    pages: usize,
    meta: &'a [u8],
    packed: &'a [u8],
    limit: u32,
}

impl SlotOutput<'_> {
    /// Pages in the batch.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Page `i`'s raw size word (see [`crate::layout`]).
    pub fn size_word(&self, i: usize) -> u32 {
        meta_word(self.meta, i).unwrap_or(SIZE_RAW)
    }

    /// Page `i`'s outcome and its compressed bytes (empty unless compressed); an error if
    /// the kernel broke its contract.
    pub fn outcome(&self, i: usize) -> Result<(PageOutcome, &[u8]), GpuError> {
        let offset = meta_word(self.meta, self.pages + i).ok_or(GpuError::BadLength {
            page: i,
            len: self.size_word(i),
        })?;
        decode_outcome(
            i,
            self.size_word(i),
            offset,
            self.packed,
            usize::try_from(self.limit).unwrap_or(PAGE_SIZE),
        )
    }

    /// Bytes that came back from the device for this batch's blocks and words.
    pub fn packed_bytes(&self) -> usize {
        self.packed.len()
    }
}

/// A ring of GPU slots. Not thread-safe by itself: wrap it in a lock to share it.
#[derive(Debug)]
pub struct Pipeline {
    // Field order: slots drop (and free their memory) before the GPU context goes.
    slots: Vec<Slot>,
    gpu: Arc<Gpu>,
    config: PipelineConfig,
    stats: GpuStats,
    poisoned: bool,
}

impl Pipeline {
    /// Opens the GPU and allocates `config.slots` slots of `config.batch_pages` pages.
    pub fn new(config: PipelineConfig) -> Result<Self, GpuError> {
        config.validate()?;
        let gpu = Gpu::open(config.device)?;
        Self::on(gpu, config)
    }

    /// A pipeline on an already opened GPU.
    pub fn on(gpu: Arc<Gpu>, config: PipelineConfig) -> Result<Self, GpuError> {
        config.validate()?;
        let slots = (0..config.slots)
            .map(|_| Slot::new(&gpu, config.batch_pages))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            slots,
            gpu,
            config,
            stats: GpuStats::default(),
            poisoned: false,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The configuration.
    pub fn config(&self) -> PipelineConfig {
        self.config
    }

    /// Counters so far.
    pub fn stats(&self) -> GpuStats {
        self.stats
    }

    /// True once a sticky device error made the pipeline unusable.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// True while `slot` has work queued that was not waited for.
    pub fn is_busy(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| s.in_flight.is_some())
    }

    fn check(&mut self, slot: usize) -> Result<(), GpuError> {
        if self.poisoned {
            return Err(GpuError::Poisoned);
        }
        match self.slots.get(slot) {
            None => Err(GpuError::Config(format!(
                "slot {slot} of {}",
                self.slots.len()
            ))),
            Some(s) if s.in_flight.is_some() => Err(GpuError::Config(format!(
                "slot {slot} is busy: wait for it first"
            ))),
            Some(_) => Ok(()),
        }
    }

    /// Records a sticky error so every later call fails fast (the context is gone).
    fn note<T>(&mut self, r: Result<T, GpuError>) -> Result<T, GpuError> {
        if let Err(e) = &r {
            if e.is_sticky() {
                self.poisoned = true;
            }
        }
        r
    }

    /// The pinned input staging of idle `slot`, `batch_pages * 4096` bytes, to fill before
    /// [`Pipeline::submit_staged`].
    pub fn staging_mut(&mut self, slot: usize) -> Result<&mut [u8], GpuError> {
        self.check(slot)?;
        Ok(self.slots[slot].staging.as_mut_slice())
    }

    /// Queues the copy back of the packed results of every slot whose kernel and meta copy
    /// are done, so those copies start before anyone waits for them. Never blocks.
    /// Otherwise a slot's packed results are copied when it is waited for. On the H200 this
    /// doubled the `GpuBackend` path (host copies between waits) but cost 10–15 % in a
    /// ring that only submits and waits (docs/gpu-notes.md, runs 7–10), so the caller
    /// decides.
    pub fn advance(&mut self) -> Result<(), GpuError> {
        if self.poisoned {
            return Err(GpuError::Poisoned);
        }
        let mut r = Ok(());
        for s in &mut self.slots {
            let queued = match &s.in_flight {
                Some(f) => f.packed.is_some(),
                None => true,
            };
            if !queued {
                r = s.events[3]
                    .is_done()
                    .and_then(|done| if done { queue_packed(s) } else { Ok(()) });
                if r.is_err() {
                    break;
                }
            }
        }
        self.note(r)
    }

    /// Queues the first `pages` pages of `slot`'s staging: H2D, kernel, D2H.
    pub fn submit_staged(&mut self, slot: usize, pages: usize, limit: u32) -> Result<(), GpuError> {
        self.check(slot)?;
        self.check_pages(pages)?;
        let r = self.enqueue(slot, None, 0, pages, limit);
        self.note(r)
    }

    /// Queues `pages` pages of `src` starting at `first`: H2D straight from the caller's
    /// pinned memory, kernel, D2H. The slot keeps `src` alive until waited for.
    pub fn submit_pinned(
        &mut self,
        slot: usize,
        src: &Arc<PinnedPages>,
        first: usize,
        pages: usize,
        limit: u32,
    ) -> Result<(), GpuError> {
        self.check(slot)?;
        self.check_pages(pages)?;
        if !first
            .checked_add(pages)
            .is_some_and(|end| end <= src.pages())
        {
            return Err(GpuError::Config(format!(
                "pages {first}..+{pages} outside a source of {} pages",
                src.pages()
            )));
        }
        let r = self.enqueue(slot, Some(src.clone()), first, pages, limit);
        self.note(r)
    }

    fn check_pages(&self, pages: usize) -> Result<(), GpuError> {
        if pages == 0 || pages > self.config.batch_pages {
            return Err(GpuError::Config(format!(
                "batch of {pages} pages; a slot holds 1..={}",
                self.config.batch_pages
            )));
        }
        Ok(())
    }

    fn enqueue(
        &mut self,
        slot: usize,
        source: Option<Arc<PinnedPages>>,
        first: usize,
        pages: usize,
        limit: u32,
    ) -> Result<(), GpuError> {
        let gpu = self.gpu.clone();
        let s = &mut self.slots[slot];
        let bytes = pages * PAGE_SIZE;
        s.done = None;
        s.events[0].record(&s.stream)?;
        let input: &[u8] = match &source {
            Some(src) => &src.as_slice()[first * PAGE_SIZE..first * PAGE_SIZE + bytes],
            None => &s.staging.as_slice()[..bytes],
        };
        // SAFETY: dev_in holds batch_pages pages >= `pages`; the input is pinned memory that
        // stays alive and unmodified until `wait`: the staging buffer is only handed out for
        // idle slots, and an external source is kept alive by `in_flight` below.
        unsafe { s.stream.copy_to_device(s.dev_in.ptr(), input)? };
        s.events[1].record(&s.stream)?;
        let bufs = launch::LaunchBuffers {
            input: s.dev_in.ptr(),
            scratch: s.dev_scratch.ptr(),
            packed: s.dev_packed.ptr(),
            meta: s.dev_meta.ptr(),
        };
        // SAFETY: the device buffers are sized for batch_pages >= pages pages (meta for
        // meta_bytes(batch_pages)), are cuMemAlloc'd (256-byte aligned), and live as long
        // as the slot, which synchronizes before it is dropped or reused.
        unsafe { launch::compress_pages(&gpu, &s.stream, bufs, pages as u32, limit)? };
        s.events[2].record(&s.stream)?;
        let meta_ptr = s.host_meta.as_mut_ptr();
        // SAFETY: host_meta is a pinned buffer of the slot of meta_bytes(batch_pages) >=
        // meta_bytes(pages) bytes; it is not read until `wait` synchronizes on events[3].
        unsafe {
            let meta = std::slice::from_raw_parts_mut(meta_ptr, meta_bytes(pages));
            s.stream.copy_to_host(meta, s.dev_meta.ptr())?;
        }
        s.events[3].record(&s.stream)?;
        s.in_flight = Some(InFlight {
            pages,
            limit,
            _source: source,
            packed: None,
        });
        Ok(())
    }

    /// Waits for `slot`'s batch and returns its results (valid until the slot is reused).
    /// The packed blocks are copied back here, once their total size is known.
    pub fn wait(&mut self, slot: usize) -> Result<SlotOutput<'_>, GpuError> {
        if !self.is_busy(slot) {
            return Err(GpuError::Config(format!("slot {slot} has nothing queued")));
        }
        let r = self.finish(slot);
        self.note(r)?;
        let s = &self.slots[slot];
        let (pages, limit, packed) = s.done.ok_or(GpuError::Config("slot not done".into()))?;
        Ok(SlotOutput {
            pages,
            meta: &s.host_meta.as_slice()[..meta_bytes(pages)],
            packed: &s.host_packed.as_slice()[..packed],
            limit,
        })
    }

    fn finish(&mut self, slot: usize) -> Result<(), GpuError> {
        let s = &mut self.slots[slot];
        let queued = s.in_flight.as_ref().and_then(|f| f.packed);
        let r = match queued {
            Some(_) => Ok(()),
            None => s.events[3].synchronize().and_then(|()| queue_packed(s)),
        }
        .and_then(|()| s.events[5].synchronize());
        let flight = s.in_flight.take();
        if let Err(e) = r {
            // The stream may still run; nothing may touch the slot's buffers until it
            // stops (or the context is dead and it never will touch them again).
            let _ = s.stream.synchronize();
            return Err(e);
        }
        let Some(flight) = flight else {
            return Ok(());
        };
        let pages = flight.pages;
        let total = flight.packed.or(queued).unwrap_or(0);
        let h2d = s.events[0].elapsed_ms(&s.events[1])?;
        let kernel = s.events[1].elapsed_ms(&s.events[2])?;
        let d2h = s.events[2].elapsed_ms(&s.events[3])? + s.events[4].elapsed_ms(&s.events[5])?;
        let out = SlotOutput {
            pages,
            meta: &s.host_meta.as_slice()[..meta_bytes(pages)],
            packed: &s.host_packed.as_slice()[..total],
            limit: flight.limit,
        };
        let mut st = self.stats;
        for i in 0..pages {
            let (o, _) = out.outcome(i)?;
            st.bytes_stored += stored_bytes(o) as u64;
            match o {
                PageOutcome::SameFilled(_) => st.same_filled += 1,
                PageOutcome::Raw => st.raw += 1,
                _ => {}
            }
        }
        st.batches += 1;
        st.pages += pages as u64;
        st.bytes_in += (pages * PAGE_SIZE) as u64;
        st.bytes_d2h += (total + meta_bytes(pages)) as u64;
        st.h2d_ms += f64::from(h2d);
        st.kernel_ms += f64::from(kernel);
        st.d2h_ms += f64::from(d2h);
        self.stats = st;
        s.done = Some((pages, flight.limit, total));
        Ok(())
    }

    /// Waits for every busy slot, dropping their results; returns the first error.
    pub fn drain(&mut self) -> Result<(), GpuError> {
        let mut first = Ok(());
        for i in 0..self.slots.len() {
            if self.is_busy(i) {
                if let Err(e) = self.wait(i) {
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
        }
        first
    }
}

/// Queues the copy of the packed results of `s` (whose meta copy is complete) to the host.
fn queue_packed(s: &mut Slot) -> Result<(), GpuError> {
    let Some(flight) = s.in_flight.as_mut() else {
        return Ok(());
    };
    if flight.packed.is_some() {
        return Ok(());
    }
    let pages = flight.pages;
    let total = meta_word(s.host_meta.as_slice(), total_index(pages)).unwrap_or(u32::MAX) as usize;
    if total > pages * PAGE_SIZE {
        return Err(GpuError::BadLength {
            page: pages,
            len: total as u32,
        });
    }
    s.events[4].record(&s.stream)?;
    let packed_ptr = s.host_packed.as_mut_ptr();
    // SAFETY: host_packed is the slot's pinned buffer of batch_pages * 4096 >= total bytes;
    // dev_packed holds `total` valid bytes (the kernel is done: its meta copy, queued after
    // it, completed); nothing reads host_packed before `finish` synchronizes on events[5].
    unsafe {
        let dst = std::slice::from_raw_parts_mut(packed_ptr, total);
        s.stream.copy_to_host(dst, s.dev_packed.ptr())?;
    }
    s.events[5].record(&s.stream)?;
    flight.packed = Some(total);
    Ok(())
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // Device copies must not outlive the buffers they touch.
        for s in &self.slots {
            if s.in_flight.is_some() {
                let _ = s.stream.synchronize();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        assert!(PipelineConfig::default().validate().is_ok());
        assert!(PipelineConfig::default().slots >= 3);
        for bad in [
            PipelineConfig {
                slots: 0,
                ..Default::default()
            },
            PipelineConfig {
                batch_pages: 0,
                ..Default::default()
            },
            PipelineConfig {
                batch_pages: (1 << 20) + 1,
                ..Default::default()
            },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(!e.kind().is_fallback(), "{e}");
        }
    }
}

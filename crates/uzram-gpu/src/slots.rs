//! [`GpuSlots`]: uzram-core's [`SlotBackend`] on one or more NVIDIA GPUs.
//!
//! Each slot owns pinned staging (written by the ring's writers as atomic words), device
//! buffers, mapped pinned result buffers, a stream, two events and (by default) a captured
//! CUDA graph of its whole run: copy the control words and pages in, compress, check and
//! export. So a submission is one graph launch, a completion one blocking event wait, and
//! only compressed bytes come back over the bus: a copy engine brings the first
//! [`launch::copied_bytes`] of them, the check kernel writes the rest of those that passed
//! straight into host memory. Slots are spread round-robin over the configured GPUs.
//!
//! Where the store's memory is registered with the driver ([`GpuSlots::place_into`]), each
//! completed slot also offers its copy engine to the installers (`placement.rs`): runs of
//! checked blocks go from the device's buffer straight into the store, one batched copy a
//! slot, and the installers copy none of those bytes themselves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use uzram_core::batch::{
    meta_bytes, BackendError, BackendMemory, FailureKind, SlotBackend, SlotOutput,
};
use uzram_core::codec::Algorithm;
use uzram_core::{PAGE_SIZE, PAGE_WORDS};

use crate::config::{GpuConfig, Parse};
use crate::driver::{DevBuf, Event, Gpu, GraphExec, HostBuf, Kernel, PinnedWords, Stream};
use crate::launch::{self, SlotBuffers, CTRL_WORDS};
use crate::placement::{self, Reach, SlotPlacer};
use crate::GpuError;

/// Counters of a [`GpuSlots`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuStats {
    /// Slots completed.
    pub slots: u64,
    /// Pages completed.
    pub pages: u64,
    /// Bytes of pages compressed.
    pub bytes_in: u64,
    /// Checked result bytes that came back to the host.
    pub packed_bytes: u64,
    /// Device time of completed runs (start to end of each slot's run), microseconds.
    pub busy_us: u64,
}

#[derive(Debug, Default)]
struct Counters {
    slots: AtomicU64,
    pages: AtomicU64,
    bytes_in: AtomicU64,
    packed_bytes: AtomicU64,
    busy_ns: AtomicU64,
    place_failures: AtomicU64,
}

/// The highest raw threshold a slot runs with: the kernels give each block the room of the
/// store's object for it (its length and 4 bytes, rounded to 8), and below this every
/// slot's rooms fit its packed buffer of `pages * 4096` bytes. A threshold above it stores
/// the few pages whose blocks would be longer raw.
const MAX_LIMIT: usize = PAGE_SIZE - 8;

/// A slot's device side; behind the slot's lock.
#[derive(Debug)]
struct SlotDev {
    // Dropped first: the graph refers to the buffers below.
    graph: Option<GraphExec>,
    stream: Stream,
    start: Event,
    done: Event,
    ctrl: HostBuf,
    out_meta: HostBuf,
    out_packed: HostBuf,
    bufs: SlotBuffers,
    _dev: [DevBuf; 5],
    /// Pages and raw threshold of the run in flight.
    submitted: Option<(usize, usize)>,
}

impl Drop for SlotDev {
    fn drop(&mut self) {
        // Device work must not outlive the buffers it touches.
        if self.submitted.is_some() {
            let _ = self.stream.synchronize();
        }
    }
}

#[derive(Debug)]
struct GpuSlot {
    gpu: Arc<Gpu>,
    // Dropped before the staging: it waits for device work that reads the staging.
    dev: Mutex<SlotDev>,
    staging: PinnedWords,
}

impl GpuSlot {
    /// A slot whose staging is `input` (registered with the GPU), or allocated pinned memory.
    fn new(
        gpu: &Arc<Gpu>,
        cfg: &GpuConfig,
        input: Option<&'static [AtomicU64]>,
    ) -> Result<Self, GpuError> {
        let pages = cfg.slot_pages;
        let bytes = pages * PAGE_SIZE;
        // `on_over` hands each slot exactly its pages' words.
        let staging = match input {
            Some(words) => PinnedWords::register(gpu, words)?,
            None => PinnedWords::new(gpu, pages * PAGE_WORDS)?,
        };
        let [input, scratch, packed, meta, ctrl] = launch::device_buffer_bytes(pages);
        let dev = [
            DevBuf::new(gpu, input)?,
            DevBuf::new(gpu, scratch)?,
            DevBuf::new(gpu, packed)?,
            DevBuf::new(gpu, meta)?,
            DevBuf::new(gpu, ctrl)?,
        ];
        let out_meta = HostBuf::mapped(gpu, meta_bytes(pages))?;
        let out_packed = HostBuf::mapped(gpu, bytes)?;
        let bufs = SlotBuffers {
            input: dev[0].ptr(),
            scratch: dev[1].ptr(),
            packed: dev[2].ptr(),
            meta: dev[3].ptr(),
            ctrl: dev[4].ptr(),
            out_packed: out_packed
                .device_ptr()
                .ok_or_else(|| GpuError::Config("result buffer is not mapped".into()))?,
            out_meta: out_meta
                .device_ptr()
                .ok_or_else(|| GpuError::Config("meta buffer is not mapped".into()))?,
        };
        let mut d = SlotDev {
            graph: None,
            stream: Stream::new(gpu)?,
            start: Event::new(gpu)?,
            done: Event::blocking(gpu)?,
            ctrl: HostBuf::new(gpu, CTRL_WORDS * 4)?,
            out_meta,
            out_packed,
            bufs,
            _dev: dev,
            submitted: None,
        };
        let kernel = cfg.parse.kernel();
        if gpu.function(kernel).is_none() {
            return Err(GpuError::Config(format!(
                "the GPU parse {} is not in the loaded kernels",
                cfg.parse.name()
            )));
        }
        if cfg.graphs {
            d.stream.begin_capture()?;
            // SAFETY: captured, not run: the graph copies the whole staging and runs the
            // kernels over the slot's buffers, all of which live in this slot as long as
            // the graph (SlotDev drops the graph first).
            let queued = unsafe { enqueue(gpu, &d, &staging, kernel, pages) };
            let graph = d.stream.end_capture();
            queued?;
            d.graph = Some(graph?);
        }
        Ok(Self {
            gpu: gpu.clone(),
            staging,
            dev: Mutex::new(d),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SlotDev> {
        self.dev.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Queues a slot's run over `copy_pages` pages of staging: control words and pages in,
/// compression, check and export.
///
/// # Safety
/// The slot's buffers must stay alive and the staging unchanged until the stream has
/// run this work (or as long as the graph it is captured into).
unsafe fn enqueue(
    gpu: &Gpu,
    d: &SlotDev,
    staging: &PinnedWords,
    kernel: Kernel,
    copy_pages: usize,
) -> Result<(), GpuError> {
    let max_pages = (staging.len() / PAGE_SIZE) as u32;
    // SAFETY: the control words and the staging are pinned buffers of the slot, of at
    // least the sizes copied; the device buffers are the slot's own (see SlotBuffers).
    unsafe {
        d.stream
            .copy_to_device(d.bufs.ctrl, d.ctrl.as_slice().as_ptr(), CTRL_WORDS * 4)?;
        d.stream.copy_to_device(
            d.bufs.input,
            staging.as_copy_source(),
            copy_pages * PAGE_SIZE,
        )?;
        launch::compress(gpu, &d.stream, kernel, d.bufs, max_pages)?;
        launch::verify(gpu, &d.stream, d.bufs, max_pages)?;
        launch::copy_packed(
            &d.stream,
            &d.out_packed,
            d.bufs.packed,
            launch::copied_bytes(kernel, max_pages as usize),
        )
    }
}

/// Compresses slots of pages on NVIDIA GPUs; see the module docs.
#[derive(Debug)]
pub struct GpuSlots {
    slots: Box<[GpuSlot]>,
    gpus: Vec<Arc<Gpu>>,
    config: GpuConfig,
    kernel: Kernel,
    counters: Counters,
    /// Host memory the copy engine may place blocks in ([`GpuSlots::place_into`]).
    reach: OnceLock<Reach>,
}

impl GpuSlots {
    /// Opens the configured GPUs (with the embedded kernels) and allocates every slot.
    /// Errors of kind [`crate::ErrorKind::Unavailable`] mean: use the CPU.
    pub fn new(config: GpuConfig) -> Result<Self, GpuError> {
        Self::on(Self::open(&config)?, config)
    }

    /// The configured GPUs, opened with the embedded kernels.
    pub fn open(config: &GpuConfig) -> Result<Vec<Arc<Gpu>>, GpuError> {
        config.validate()?;
        config.devices.iter().map(|&d| Gpu::open(d)).collect()
    }

    /// Slots on GPUs opened by the caller (e.g. with another build of the kernels).
    pub fn on(gpus: Vec<Arc<Gpu>>, config: GpuConfig) -> Result<Self, GpuError> {
        Self::on_over(gpus, config, None)
    }

    /// [`GpuSlots::on`], with the slots' staging in `inputs` (slot after slot,
    /// `slot_pages * PAGE_WORDS` words each, starting on a page): memory the caller keeps,
    /// such as a shared memory segment that outlives the process, registered with the GPUs
    /// for as long as the slots live. `None`: pinned memory of the driver's.
    pub fn on_over(
        gpus: Vec<Arc<Gpu>>,
        config: GpuConfig,
        inputs: Option<&'static [AtomicU64]>,
    ) -> Result<Self, GpuError> {
        config.validate()?;
        if gpus.is_empty() {
            return Err(GpuError::Config("no GPU to put slots on".into()));
        }
        let per = config.slot_pages * PAGE_WORDS;
        if let Some(words) = inputs.filter(|w| w.len() != config.slots * per) {
            return Err(GpuError::Config(format!(
                "{} staging words for {} slots of {} pages",
                words.len(),
                config.slots,
                config.slot_pages
            )));
        }
        let slots = (0..config.slots)
            .map(|s| {
                let input = inputs.and_then(|w| w.get(s * per..(s + 1) * per));
                GpuSlot::new(&gpus[s % gpus.len()], &config, input)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            slots: slots.into_boxed_slice(),
            gpus,
            kernel: config.parse.kernel(),
            config,
            counters: Counters::default(),
            reach: OnceLock::new(),
        })
    }

    /// From now on, the installers are offered each slot's copy engine to place its checked
    /// blocks straight into host memory that `reach` says is registered with every GPU
    /// ([`placement::register_host`]; the daemon's block pool). False, and nothing changes,
    /// where the driver has no batched copy (before CUDA 12.8) or a reach was set before.
    pub fn place_into(&self, reach: Reach) -> bool {
        placement::batch_copy_available() && self.reach.set(reach).is_ok()
    }

    /// Whether the copy engine places blocks ([`GpuSlots::place_into`]).
    pub fn places(&self) -> bool {
        self.reach.get().is_some()
    }

    /// The GPUs the slots are on.
    pub fn gpus(&self) -> &[Arc<Gpu>] {
        &self.gpus
    }

    /// The configuration.
    pub fn config(&self) -> &GpuConfig {
        &self.config
    }

    /// Whether the slots' staging is the caller's memory ([`GpuSlots::on_over`]).
    pub fn staging_is_registered(&self) -> bool {
        self.slots.iter().all(|s| s.staging.is_registered())
    }

    /// The GPUs' names, e.g. "NVIDIA H200".
    pub fn device_names(&self) -> Vec<String> {
        self.gpus.iter().map(|g| g.name().to_string()).collect()
    }

    /// Counters so far.
    pub fn gpu_stats(&self) -> GpuStats {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GpuStats {
            slots: g(&c.slots),
            pages: g(&c.pages),
            bytes_in: g(&c.bytes_in),
            packed_bytes: g(&c.packed_bytes),
            busy_us: g(&c.busy_ns) / 1000,
        }
    }

    fn slot(&self, slot: usize) -> Result<&GpuSlot, BackendError> {
        self.slots
            .get(slot)
            .ok_or_else(|| to_backend_error(&GpuError::Config(format!("no slot {slot}"))))
    }

    fn run(
        &self,
        s: &GpuSlot,
        d: &mut SlotDev,
        pages: usize,
        limit: usize,
    ) -> Result<(), GpuError> {
        d.ctrl
            .as_mut_slice()
            .copy_from_slice(&launch::control_words(
                pages,
                limit,
                launch::copied_bytes(self.kernel, s.staging.len() / PAGE_SIZE),
            ));
        d.start.record(&d.stream)?;
        match &d.graph {
            Some(graph) => graph.launch(&d.stream)?,
            // SAFETY: the slot's buffers live as long as the slot, and the ring leaves the
            // staging unchanged until `complete`, or for good once it retired this backend
            // as hung (the SlotBackend contract).
            None => unsafe { enqueue(&s.gpu, d, &s.staging, self.kernel, pages)? },
        }
        d.done.record(&d.stream)
    }
}

/// The seam's rules for a submission to `slot`: 1 to `capacity` pages, and nothing of the
/// slot's still `running`.
pub(crate) fn may_submit(
    slot: usize,
    pages: usize,
    capacity: usize,
    running: bool,
) -> Result<(), BackendError> {
    let broken = |why: String| Err(to_backend_error(&GpuError::Config(why)));
    if pages == 0 || pages > capacity {
        return broken(format!("{pages} pages in a slot of {capacity}"));
    }
    if running {
        return broken(format!("slot {slot} is still running"));
    }
    Ok(())
}

/// The seam's rule for a backend of one slot (nvCOMP's zstd, the dictionary parse): slot 0.
pub(crate) fn only_slot(slot: usize) -> Result<(), BackendError> {
    if slot == 0 {
        Ok(())
    } else {
        Err(to_backend_error(&GpuError::Config(format!(
            "slot {slot} of a backend with one"
        ))))
    }
}

/// What queueing a submission on `stream` came to: a failure drains the stream first, since
/// part of the work may be queued and must finish before the slot is reused.
pub(crate) fn queued(result: Result<(), GpuError>, stream: &Stream) -> Result<(), BackendError> {
    result.map_err(|e| {
        let _ = stream.synchronize();
        to_backend_error(&e)
    })
}

/// A slot's results as the seam reads them (`meta` for `pages`, the blocks in `packed`); a
/// size the layout refuses is the backend's error.
pub(crate) fn slot_output<'a>(
    pages: usize,
    meta: &'a [u8],
    packed: &'a [u8],
    limit: usize,
) -> Result<SlotOutput<'a>, BackendError> {
    SlotOutput::new(pages, &meta[..meta_bytes(pages)], packed, limit).map_err(|e| {
        to_backend_error(&GpuError::BadLength {
            page: e.page,
            len: e.size,
        })
    })
}

/// How a [`GpuError`] crosses the seam: a fault that leaves the context unusable, a GPU
/// that is not there, or results that break the layout's contract (a device that writes
/// past its buffers is not trusted again) are sticky (the ring retires the backend);
/// anything else costs one slot.
pub fn to_backend_error(e: &GpuError) -> BackendError {
    let broke_contract = matches!(e, GpuError::BadLength { .. });
    let kind = if e.is_sticky() || broke_contract || e.kind() == crate::ErrorKind::Unavailable {
        FailureKind::Sticky
    } else {
        FailureKind::Transient
    };
    BackendError {
        backend: "gpu",
        kind,
        message: error_chain(e),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl SlotBackend for GpuSlots {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }

    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn slot_pages(&self) -> usize {
        self.config.slot_pages
    }

    fn input(&self, slot: usize) -> &[AtomicU64] {
        self.slots.get(slot).map_or(&[], |s| s.staging.words())
    }

    fn submit(&self, slot: usize, pages: usize, limit: usize) -> Result<(), BackendError> {
        let limit = limit.min(MAX_LIMIT);
        let s = self.slot(slot)?;
        let mut d = s.lock();
        may_submit(slot, pages, self.config.slot_pages, d.submitted.is_some())?;
        let run = self.run(s, &mut d, pages, limit);
        queued(run, &d.stream)?;
        d.submitted = Some((pages, limit));
        Ok(())
    }

    fn complete(
        &self,
        slot: usize,
        install: &mut dyn FnMut(&SlotOutput<'_>),
    ) -> Result<(), BackendError> {
        let s = self.slot(slot)?;
        let mut d = s.lock();
        let Some((pages, limit)) = d.submitted.take() else {
            return Err(to_backend_error(&GpuError::Config(format!(
                "slot {slot} has nothing submitted"
            ))));
        };
        if let Err(e) = d.done.synchronize() {
            let _ = d.stream.synchronize();
            return Err(to_backend_error(&e));
        }
        let busy = d
            .start
            .elapsed_ms(&d.done)
            .map_err(|e| to_backend_error(&e))?;
        let out = slot_output(pages, d.out_meta.as_slice(), d.out_packed.as_slice(), limit)?;
        let c = &self.counters;
        c.slots.fetch_add(1, Ordering::Relaxed);
        c.pages.fetch_add(pages as u64, Ordering::Relaxed);
        c.bytes_in
            .fetch_add((pages * PAGE_SIZE) as u64, Ordering::Relaxed);
        c.packed_bytes
            .fetch_add(out.packed_bytes() as u64, Ordering::Relaxed);
        c.busy_ns
            .fetch_add((f64::from(busy) * 1e6) as u64, Ordering::Relaxed);
        match self.reach.get() {
            Some(reach) => {
                let placer = SlotPlacer {
                    gpu: &s.gpu,
                    stream: &d.stream,
                    done: &d.done,
                    packed: d.bufs.packed,
                    out_packed: &d.out_packed,
                    reach,
                    device: s.gpu.ordinal() as i32,
                    failures: &c.place_failures,
                };
                install(&out.with_placer(&placer));
            }
            None => install(&out),
        }
        Ok(())
    }

    fn memory(&self) -> BackendMemory {
        BackendMemory {
            pinned_host_bytes: self.config.pinned_bytes(),
            host_bytes: 0,
            device_bytes: self.config.device_bytes(),
        }
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.gpu_stats();
        vec![
            ("gpu_devices", self.gpus.len() as u64),
            ("gpu_slots", self.slots.len() as u64),
            ("gpu_slot_pages", self.config.slot_pages as u64),
            (
                "gpu_parse_high",
                u64::from(self.config.parse == Parse::High),
            ),
            ("gpu_slots_completed", s.slots),
            ("gpu_pages", s.pages),
            ("gpu_bytes_in", s.bytes_in),
            ("gpu_packed_bytes", s.packed_bytes),
            ("gpu_busy_us", s.busy_us),
            ("gpu_pinned_bytes", self.config.pinned_bytes()),
            (
                "gpu_staging_registered",
                u64::from(self.staging_is_registered()),
            ),
            ("gpu_device_bytes", self.config.device_bytes()),
            ("gpu_places", u64::from(self.places())),
            (
                "gpu_place_failures",
                self.counters.place_failures.load(Ordering::Relaxed),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn sticky_and_missing_gpus_retire_the_backend() {
        let sticky = GpuError::Driver {
            op: "cuEventSynchronize",
            code: CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        };
        let e = to_backend_error(&sticky);
        assert_eq!(e.kind, FailureKind::Sticky);
        assert_eq!(e.backend, "gpu");
        assert!(e.message.contains("cuEventSynchronize"), "{}", e.message);
        assert!(e.message.contains("ILLEGAL_ADDRESS"), "{}", e.message);
        assert_eq!(
            to_backend_error(&GpuError::NoDevice).kind,
            FailureKind::Sticky
        );
        let oom = GpuError::Driver {
            op: "cuGraphLaunch",
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        };
        assert_eq!(to_backend_error(&oom).kind, FailureKind::Transient);
    }

    #[test]
    fn a_packed_total_past_the_buffer_retires_the_backend() {
        // One page whose packed total (the meta's third word) claims more than the buffer.
        let mut meta = vec![0u8; meta_bytes(1)];
        meta[8..12].copy_from_slice(&5000u32.to_le_bytes());
        let Err(e) = slot_output(1, &meta, &[0u8; 4096], 3000) else {
            panic!("a total past the buffer was accepted");
        };
        assert_eq!(e.kind, FailureKind::Sticky, "{}", e.message);
    }
}

//! Where a device's writes are compressed: inline on the queue threads (`cpu`), or on NVIDIA
//! GPUs through a ring of pinned staging slots (`gpu`, and `auto` where a GPU opens and the
//! algorithm is LZ4). This is the one place that decides.
//!
//! With a GPU, a write copies each page once into a slot and completes; reads of a staged
//! page copy it back out of the slot; installer threads put the checked results into the
//! store while other slots are on the GPU (uzram-core's `Ring`). A failing GPU is retired
//! and the CPU takes over, losing nothing.
//!
//! The daemon keeps the ring's staging (slot inputs and books) in a shared memory segment
//! that the store's region records (`takeover::staging_segment`), so that the pages waiting there survive
//! a crash of the daemon: the next one installs them when it takes the store over.

use std::sync::Arc;

use anyhow::Context;
use uzram_core::batch::{BackendMemory, PageSource, Ring, RingConfig, ThreadHook};
use uzram_core::codec::Algorithm;
use uzram_core::store::PageStore;
use uzram_core::CoreError;
use uzram_gpu::{GpuConfig, GpuSlots};

use super::room::{self, Room};
use crate::config::{Backend, GpuSettings};
use crate::control::proto::Stat;
use crate::takeover::staging_segment::{self, StagingSegment};
use crate::takeover::store_segment::StoreSegment;
use crate::ublk::handler::{fill_bounce, PageWriter};

/// How the daemon compresses writes.
pub struct WriteBackend {
    store: Arc<PageStore>,
    ring: Option<Ring>,
    /// Whether the ring's staging outlives the process (kept in a shared memory segment).
    staging_kept: bool,
    /// With a backing device: where a write at `mem-limit` asks for room (`room.rs`).
    room: Option<Arc<Room>>,
}

/// Where the GPU ring's staging lives. Where no segment can be made, or the GPU cannot use
/// one, the staging is the GPU driver's pinned memory (with a warning), whose pages a crash
/// loses.
#[derive(Debug)]
pub enum StagingHome<'a> {
    /// In a shared memory segment of its own that goes with the process: the benchmark,
    /// which so runs the daemon's memory path.
    Scratch,
    /// In a segment the store's region records, from which a later daemon installs the
    /// pages staged when this one died; `found` is the segment a dead daemon left (its
    /// pages already installed), reused when its shape fits.
    StoreSegment {
        /// The store's region.
        region: &'a StoreSegment,
        /// The old daemon's staging.
        found: Option<StagingSegment>,
    },
}

impl StagingHome<'_> {
    /// The segment for a ring of `slots` slots of `slot_pages` pages, recorded in the
    /// region for a later daemon.
    fn segment(&mut self, slots: usize, slot_pages: usize) -> anyhow::Result<StagingSegment> {
        match self {
            Self::Scratch => StagingSegment::create(slots, slot_pages, true)
                .context("creating the GPU staging's shared memory"),
            Self::StoreSegment { region, found } => {
                if let Some(old) = found.take() {
                    if old.shape() == (slots, slot_pages) {
                        return Ok(old);
                    }
                    // SAFETY: its pages were installed by the store's recovery, which holds
                    // nothing of it; no ring or GPU was given its memory.
                    unsafe { old.detach() };
                }
                // The old segment (of another shape, or one that could not be attached).
                if let Some(id) = region.staging() {
                    region.set_staging(None);
                    staging_segment::remove(id);
                }
                let made = StagingSegment::create(slots, slot_pages, false)
                    .context("creating the GPU staging's shared memory")?;
                region.set_staging(Some(made.id()));
                Ok(made)
            }
        }
    }

    /// No staging after all (the CPU compresses, or the GPU could not use the segment):
    /// the region records none, and a segment made or found goes. Nothing may use
    /// `segment`'s memory any more.
    fn forget(&mut self, segment: Option<StagingSegment>) {
        if let Self::StoreSegment { region, found } = self {
            let recorded = region.staging();
            if let Some(id) = recorded {
                region.set_staging(None);
                staging_segment::remove(id);
            }
            if let Some(old) = found.take() {
                if Some(old.id()) != recorded {
                    staging_segment::remove(old.id());
                }
                // SAFETY: its pages were installed by the store's recovery, which holds
                // nothing of it; no ring or GPU was given its memory.
                unsafe { old.detach() };
            }
        }
        if let Some(segment) = segment {
            // SAFETY: the caller gave up the segment's memory (the GPU slots that
            // registered it are gone); it was marked for removal above or when made.
            unsafe { segment.detach() };
        }
    }
}

/// Why `auto` compresses on the CPU, or `None` when it uses a GPU.
fn auto_on_cpu<T>(
    algorithm: Algorithm,
    checksums: bool,
    gpu: &Result<T, anyhow::Error>,
) -> Option<String> {
    if algorithm != Algorithm::Lz4 {
        return Some(format!("the GPU compresses lz4, this device {algorithm}"));
    }
    if !checksums {
        // A GPU result is installed once its check matches the checksum of the staged page:
        // without checksums nothing on the host would catch a wrong one.
        return Some("the GPU's results are checked against the page checksums, which this device does not keep".into());
    }
    gpu.as_ref().err().map(|e| format!("{e:#}"))
}

impl WriteBackend {
    /// Sets up the backend asked for. `gpu` fails when no GPU ring can start; `auto` then
    /// compresses on the CPU (and says why in the log). `hook` runs first on every thread
    /// the ring starts; `home` says where the ring's staging lives.
    pub fn start(
        store: Arc<PageStore>,
        asked: Backend,
        settings: &GpuSettings,
        hook: Option<ThreadHook>,
        mut home: StagingHome<'_>,
    ) -> anyhow::Result<Self> {
        let algorithm = store.algorithm();
        let opened = match asked {
            Backend::Cpu => None,
            Backend::Gpu if algorithm != Algorithm::Lz4 => {
                anyhow::bail!("the gpu backend compresses lz4 only: use --algorithm lz4 with --backend gpu")
            }
            Backend::Gpu => Some(open_gpus(settings).context(
                "opening the GPU for --backend gpu (use --backend cpu, or auto to use a GPU only where one works)",
            )?),
            Backend::Auto => {
                let gpu = if algorithm == Algorithm::Lz4 && store.checksums() {
                    open_gpus(settings)
                } else {
                    Err(anyhow::anyhow!("not tried"))
                };
                match auto_on_cpu(algorithm, store.checksums(), &gpu) {
                    Some(why) => {
                        tracing::info!(why, "backend auto compresses on the CPU");
                        None
                    }
                    None => Some(gpu?),
                }
            }
        };
        let Some((gpus, gpu_cfg)) = opened else {
            home.forget(None);
            return Ok(Self::cpu(store));
        };
        let segment = match home.segment(gpu_cfg.slots, gpu_cfg.slot_pages) {
            Ok(segment) => Some(segment),
            Err(error) => {
                tracing::warn!(error = format!("{error:#}"), "no shared memory for the GPU staging: staging in the driver's pinned memory, whose pages a crash of this daemon loses");
                home.forget(None);
                None
            }
        };
        let inputs = segment.as_ref().map(StagingSegment::inputs);
        let (slots, segment) = match GpuSlots::on_over(gpus.clone(), gpu_cfg.clone(), inputs) {
            Ok(slots) => (Ok(slots), segment),
            Err(error) if inputs.is_some() => {
                tracing::warn!(%error, "the GPU slots could not be set up over shared memory: trying them in the driver's pinned memory, whose staged pages a crash of this daemon loses");
                home.forget(segment);
                (GpuSlots::on(gpus, gpu_cfg), None)
            }
            Err(error) => (Err(error), segment),
        };
        let slots = match slots {
            Ok(slots) => slots,
            Err(error) if asked == Backend::Auto => {
                tracing::info!(why = %error, "backend auto compresses on the CPU");
                home.forget(segment);
                return Ok(Self::cpu(store));
            }
            Err(error) => {
                home.forget(segment);
                return Err(error.into());
            }
        };
        let books = segment.as_ref().map(StagingSegment::books);
        match Self::start_ring(store.clone(), slots, settings, hook, books) {
            Ok(backend) => Ok(backend),
            // A ring that fails to start (its threads, their buffers) attached nothing to
            // the store and dropped the GPU slots, and with them their registration of the
            // segment's memory.
            Err(error) if asked == Backend::Auto => {
                tracing::info!(
                    why = format!("{error:#}"),
                    "backend auto compresses on the CPU"
                );
                home.forget(segment);
                Ok(Self::cpu(store))
            }
            Err(error) => {
                home.forget(segment);
                Err(error)
            }
        }
    }

    fn start_ring(
        store: Arc<PageStore>,
        slots: GpuSlots,
        settings: &GpuSettings,
        hook: Option<ThreadHook>,
        books: Option<&'static [std::sync::atomic::AtomicU64]>,
    ) -> anyhow::Result<Self> {
        tracing::info!(
            gpus = ?slots.device_names(),
            slots = slots.config().slots,
            slot_pages = slots.config().slot_pages,
            parse = slots.config().parse.name(),
            pinned_bytes = slots.config().pinned_bytes(),
            staging_kept = books.is_some(),
            "compressing writes on the GPU"
        );
        let places = settings.place && place_into_pool(&slots);
        tracing::info!(
            places,
            "the GPU's copy engine places compressed pages in the store: {}",
            if places {
                "on"
            } else if settings.place {
                "off (no block pool, no batched copies in this driver, or its registration failed)"
            } else {
                "off (gpu-place = false)"
            }
        );
        let cfg = RingConfig {
            on_thread_start: hook,
            installers: settings.installers,
            slot_wait: std::time::Duration::from_micros(settings.slot_wait_us),
            books,
            ..RingConfig::default()
        };
        let ring =
            Ring::start(store.clone(), Arc::new(slots), cfg).context("starting the GPU ring")?;
        Ok(Self {
            store,
            ring: Some(ring),
            staging_kept: books.is_some(),
            room: None,
        })
    }

    fn cpu(store: Arc<PageStore>) -> Self {
        Self {
            store,
            ring: None,
            staging_kept: false,
            room: None,
        }
    }

    /// The backend that serves writes: `cpu` or `gpu`.
    pub fn name(&self) -> &'static str {
        if self.ring.is_some() {
            "gpu"
        } else {
            "cpu"
        }
    }

    /// Waits until every write so far is compressed and installed.
    pub fn flush(&self) {
        if let Some(r) = &self.ring {
            r.flush();
        }
    }

    /// Stops staging and installs every staged page (before a handover: the next daemon
    /// would have to install them before it serves, on the CPU, or could not read them at
    /// all from this process's own pinned staging); later writes are compressed on the
    /// CPU. `None` without a ring; else whether it emptied within `within`.
    pub fn drain(&self, within: std::time::Duration) -> Option<bool> {
        self.ring.as_ref().map(|r| r.drain(within))
    }

    /// Whether the ring's staging is in shared memory a later daemon recovers pages from.
    pub fn staging_kept(&self) -> bool {
        self.staging_kept
    }

    /// Memory the backend holds besides the store (fixed from the start).
    pub fn memory(&self) -> BackendMemory {
        self.ring.as_ref().map(Ring::memory).unwrap_or_default()
    }

    /// Backend counters for `uzram status`: the ring's, the GPU's and the backend's
    /// memory; empty for the CPU backend.
    pub fn stats(&self) -> Vec<Stat> {
        let Some(ring) = &self.ring else {
            return Vec::new();
        };
        let m = ring.memory();
        ring.stats()
            .fields()
            .into_iter()
            .chain(ring.backend_stats())
            .chain([
                ("ring_pinned_host_bytes", m.pinned_host_bytes),
                ("ring_host_bytes", m.host_bytes),
                ("ring_device_bytes", m.device_bytes),
                ("ring_staging_kept", u64::from(self.staging_kept)),
            ])
            .map(|(name, value)| Stat {
                name: name.to_string(),
                value,
            })
            .collect()
    }
}

/// Opens the configured GPUs, and the ring's shape for them.
fn open_gpus(settings: &GpuSettings) -> anyhow::Result<(Vec<Arc<uzram_gpu::Gpu>>, GpuConfig)> {
    let mut cfg = GpuConfig::for_pinned_budget(settings.memory, settings.slot_pages)?;
    cfg.devices = settings.gpus.ordinals()?;
    cfg.parse = settings.parse;
    Ok((GpuSlots::open(&cfg)?, cfg))
}

impl WriteBackend {
    /// Writes at `mem-limit` ask `room` for writeback and try again, until their deadline
    /// (`room.rs`).
    pub fn make_room_with(&mut self, room: Arc<Room>) {
        self.room = Some(room);
    }

    /// Where writes ask for room, with a backing device: the room thread answers
    /// (`pressure::keep_room`).
    pub fn room(&self) -> Option<&Arc<Room>> {
        self.room.as_ref()
    }

    /// Runs `write` until it leaves `mem-limit` behind: with room to make, a write that
    /// found none asks for it and runs again, until its deadline. The pages before the one
    /// that found no room are written; writing them again stores the same bytes. Other
    /// writers may take the room made before this one retries: it asks again.
    fn with_room(&self, mut write: impl FnMut() -> Result<(), CoreError>) -> Result<(), CoreError> {
        let Some(room) = &self.room else {
            return write();
        };
        let deadline = std::time::Instant::now() + room::WAIT;
        loop {
            match write() {
                Err(CoreError::MemLimit { .. })
                    if room.ask(deadline.saturating_duration_since(std::time::Instant::now())) => {}
                result => return result,
            }
        }
    }
}

impl PageWriter for WriteBackend {
    fn write_pages(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        self.with_room(|| match &self.ring {
            Some(r) => r.write(first_page, data),
            None => self.store.write(first_page, data),
        })
    }

    fn write_pages_from(
        &self,
        first_page: u64,
        pages: usize,
        source: &mut dyn PageSource,
        bounce: &mut [u8],
    ) -> Result<(), CoreError> {
        match &self.ring {
            // Each try has the source copy the pages again (the request still holds them).
            Some(r) => self.with_room(|| r.write_from(first_page, pages, source, bounce)),
            None => {
                let data = fill_bounce(pages, source, bounce)?;
                self.with_room(|| self.store.write(first_page, data))
            }
        }
    }
}

/// Registers the block pool's memory with the GPUs as the pool faults it in, and lets the
/// slots' copy engine place compressed pages there (`uzram_gpu::placement`). False where it
/// cannot: no block pool, a driver without batched copies, or a registration that failed.
fn place_into_pool(slots: &GpuSlots) -> bool {
    use crate::memory::pool;
    use uzram_gpu::placement::{self, Reach};
    let Some(gpu) = slots.gpus().first().cloned() else {
        return false;
    };
    if !placement::batch_copy_available() {
        return false;
    }
    // The closure keeps `gpu`, and with it its context and what was registered in it, for
    // the life of the process: the pool's memory stays registered while it is.
    let registering = pool::register_with(move |address, bytes| {
        // SAFETY: the pool's range is mapped for the life of the process, and its registered
        // blocks are never punched out (`pool::trim` stops at them).
        match unsafe { placement::register_host(&gpu, address, bytes) } {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "registering the block pool's memory with the GPU");
                false
            }
        }
    });
    registering && slots.place_into(Reach::new(pool::registered))
}

#[cfg(test)]
mod tests {
    use uzram_core::store::StoreConfig;

    use super::*;
    use crate::ublk::handler::{handle, Op};

    fn store(algorithm: Algorithm) -> Arc<PageStore> {
        Arc::new(PageStore::new(StoreConfig::new(64, algorithm)).unwrap())
    }

    /// The backend asked for, with defaults, staging (if any) in a scratch segment.
    fn start(s: Arc<PageStore>, asked: Backend) -> anyhow::Result<WriteBackend> {
        WriteBackend::start(
            s,
            asked,
            &GpuSettings::default(),
            None,
            StagingHome::Scratch,
        )
    }

    fn round_trip(s: &Arc<PageStore>, c: &WriteBackend) {
        let mut buf = b"uzram ".repeat(4096 * 2 / 6 + 1);
        buf.truncate(8192);
        let want = buf.clone();
        assert_eq!(handle(Op::Write, 8, 16, &mut buf, s, c), 8192);
        let mut back = vec![0u8; 8192];
        assert_eq!(handle(Op::Read, 8, 16, &mut back, s, c), 8192);
        assert_eq!(back, want);
    }

    #[test]
    fn cpu_writes_through_the_store() {
        let s = store(Algorithm::Lz4);
        let c = start(s.clone(), Backend::Cpu).unwrap();
        assert_eq!(c.name(), "cpu");
        assert!(c.stats().is_empty());
        assert_eq!(c.memory(), BackendMemory::default());
        round_trip(&s, &c);
    }

    /// A daemon that compresses on the CPU after one that staged for the GPU (a config
    /// changed to `backend = "cpu"`, or a GPU gone) removes the old staging: nothing would
    /// ever use its locked memory again.
    #[test]
    fn a_cpu_daemon_removes_the_staging_a_gpu_daemon_left() {
        let sizes = crate::footprint::Sizes::of(16, crate::footprint::MIN_ROOM).unwrap();
        let region = match StoreSegment::create(sizes, "lz4", true, u32::MAX, true) {
            Ok(r) => r,
            Err(e) => {
                println!("SKIP: no locked shared memory here: {e}");
                return;
            }
        };
        let old = StagingSegment::create(2, 4, false).expect("a staging segment");
        let id = old.id();
        region.set_staging(Some(id));
        let home = StagingHome::StoreSegment {
            region: &region,
            found: Some(old),
        };
        let s = store(Algorithm::Lz4);
        let c = WriteBackend::start(s.clone(), Backend::Cpu, &GpuSettings::default(), None, home)
            .unwrap();
        assert_eq!(c.name(), "cpu");
        assert!(!c.staging_kept());
        assert_eq!(region.staging(), None, "the region still names the staging");
        assert!(
            !crate::takeover::store_segment::exists(id),
            "the old staging segment is still there"
        );
        round_trip(&s, &c);
    }

    /// `auto` where a GPU opens but its ring does not start goes on on the CPU, and the
    /// staging segment the ring was to use goes (nothing would use its locked memory);
    /// `gpu` fails and says the ring did. The ring's start is made to fail last of all, as
    /// it does when the store refuses its staging: the store has staging attached already.
    /// Needs a GPU: `scripts/gpu-check` runs it, where a skip counts as a failure.
    #[test]
    fn auto_goes_on_on_the_cpu_when_the_gpu_ring_does_not_start() {
        use std::sync::atomic::AtomicU64;
        use uzram_core::batch::{book_words, StagedCopy};
        let s = store(Algorithm::Lz4);
        let words = |n| &*Box::leak((0..n).map(|_| AtomicU64::new(0)).collect::<Box<[_]>>());
        let staged = StagedCopy::new(
            words(book_words(1, 1)),
            words(uzram_core::PAGE_WORDS),
            1,
            1,
            true,
        )
        .expect("the books and input of one slot of one page");
        s.attach_staging(Arc::new(staged)).unwrap();
        if let Err(why) = uzram_gpu::probe() {
            eprintln!("skipping: no GPU here ({why})");
            return;
        }
        let sizes = crate::footprint::Sizes::of(16, crate::footprint::MIN_ROOM).unwrap();
        let region = match StoreSegment::create(sizes, "lz4", true, u32::MAX, true) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("skipping: no locked shared memory here: {e}");
                return;
            }
        };
        // A dead daemon's staging of the ring's very shape: the ring is set up over it, so
        // the segment that must go is one the test knows.
        let settings = GpuSettings::default();
        let shape = GpuConfig::for_pinned_budget(settings.memory, settings.slot_pages).unwrap();
        let old = StagingSegment::create(shape.slots, shape.slot_pages, false)
            .expect("a staging segment");
        let id = old.id();
        region.set_staging(Some(id));
        let home = StagingHome::StoreSegment {
            region: &region,
            found: Some(old),
        };
        let c = WriteBackend::start(s.clone(), Backend::Auto, &settings, None, home)
            .expect("auto goes on on the CPU");
        assert_eq!(c.name(), "cpu");
        assert!(!c.staging_kept());
        assert_eq!(region.staging(), None, "the region still names the staging");
        assert!(
            !crate::takeover::store_segment::exists(id),
            "the staging segment is still there"
        );
        round_trip(&s, &c);
        drop(c);
        let home = StagingHome::StoreSegment {
            region: &region,
            found: None,
        };
        let err = WriteBackend::start(s.clone(), Backend::Gpu, &settings, None, home)
            .err()
            .expect("gpu with a ring that does not start");
        let text = format!("{err:#}");
        assert!(text.contains("GPU ring"), "{text}");
        assert_eq!(region.staging(), None, "the region still names the staging");
    }

    #[test]
    fn auto_with_zstd_starts_on_the_cpu_with_or_without_a_gpu() {
        let s = store(Algorithm::Zstd { level: 1 });
        let c = start(s.clone(), Backend::Auto).expect("auto with zstd must start");
        assert_eq!(c.name(), "cpu");
        round_trip(&s, &c);
        assert!(auto_on_cpu::<()>(
            Algorithm::Zstd { level: 3 },
            true,
            &Err(anyhow::anyhow!("x"))
        )
        .unwrap()
        .contains("lz4"));
    }

    /// Without checksums nothing on the host checks a GPU result: `auto` compresses on the
    /// CPU, with or without a GPU.
    #[test]
    fn auto_without_checksums_uses_the_cpu() {
        assert!(auto_on_cpu::<()>(Algorithm::Lz4, false, &Ok(()))
            .unwrap()
            .contains("checksums"));
        assert_eq!(auto_on_cpu::<()>(Algorithm::Lz4, true, &Ok(())), None);
    }

    #[test]
    fn auto_without_a_gpu_uses_the_cpu() {
        if uzram_gpu::gpu_available() {
            eprintln!("skipping: this machine has a GPU");
            return;
        }
        let s = store(Algorithm::Lz4);
        let c = start(s.clone(), Backend::Auto).unwrap();
        assert_eq!(c.name(), "cpu");
        round_trip(&s, &c);
    }

    #[test]
    fn gpu_without_a_gpu_or_with_zstd_is_a_clear_error() {
        let err = start(store(Algorithm::Zstd { level: 1 }), Backend::Gpu)
            .err()
            .expect("zstd on the GPU");
        assert!(format!("{err:#}").contains("lz4 only"), "{err:#}");
        if uzram_gpu::gpu_available() {
            eprintln!("skipping the no-GPU case: this machine has a GPU");
            return;
        }
        let err = start(store(Algorithm::Lz4), Backend::Gpu)
            .err()
            .expect("no GPU here");
        let text = format!("{err:#}");
        assert!(text.contains("--backend cpu"), "{text}");
    }
}

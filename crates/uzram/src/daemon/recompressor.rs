//! What a device's recompression writes (`recompress-algorithm`): zstd on the CPU; LZ4
//! again from an NVIDIA GPU's `high` parse (`lz4-gpu`), which stores pages the hot path
//! wrote with the CPU's LZ4 tighter and reads them back at LZ4's speed; LZ4 with a
//! dictionary trained on the device's own pages, from the GPU (`lz4-gpu-dict`,
//! `dictionary.rs`), tighter still where pages share content with pages far from them;
//! or zstd frames from NVIDIA nvCOMP's batched zstd (`zstd-gpu`), zstd's memory for a
//! fraction of its CPU. A
//! GPU works through a slot of its own, not the write ring's, opened at the first pass (a
//! takeover does not wait for it) or, on a fresh start, before the device serves, so that a
//! host where it cannot work says so at once.

use std::sync::{Arc, Mutex, OnceLock, PoisonError, TryLockError};

use anyhow::Context;
use uzram_core::batch::SlotBackend;
use uzram_core::store::{Candidates, Priority, Recompress, Recompressed, Recompressor as Pass};
use uzram_core::{CoreError, PageStore};
use uzram_gpu::{GpuConfig, GpuDictLz4, GpuSlots, NvcompZstd, Parse};

use super::dictionary;
use crate::config::{DeviceConfig, GpuSettings, RecompressCodec, DEFAULT_GPU_SLOT_PAGES};
use crate::takeover::dictionary::KeptDictionary;

/// The recompressor `cfg` asks for, if any; opened now unless `recovered` (a takeover does
/// not wait for a GPU).
pub fn for_device(
    cfg: &DeviceConfig,
    recovered: bool,
) -> anyhow::Result<Option<Arc<Recompressor>>> {
    let Some(settings) = cfg.recompress else {
        return Ok(None);
    };
    let recompressor = Recompressor::new(settings.codec, &cfg.gpu);
    if !recovered {
        recompressor.open()?;
    }
    Ok(Some(Arc::new(recompressor)))
}

/// A device's recompressor; see the module docs.
pub enum Recompressor {
    /// zstd at this level.
    Zstd {
        /// zstd's level.
        level: i32,
    },
    /// A GPU: the `high` LZ4 parse, or nvCOMP's zstd.
    Gpu(Box<OnGpu>),
}

/// A GPU recompressor's state.
pub struct OnGpu {
    /// `GpuLz4`, `GpuLz4Dict` or `GpuZstd`.
    codec: RecompressCodec,
    /// The GPU settings of the device (which GPUs).
    settings: GpuSettings,
    /// The slot, once opened.
    slots: OnceLock<Result<Opened, String>>,
    /// Where a dictionary trained for `GpuLz4Dict` is kept for the next daemon (the store
    /// segment's area); none in a store that lives only in this process (`uzram bench`).
    kept: OnceLock<KeptDictionary>,
}

/// An opened GPU recompressor: its backend (one slot), and the turn passes take on it. The
/// backend is outside the turn so that its counters can be read while a pass runs.
struct Opened {
    backend: Backend,
    turn: Mutex<()>,
}

/// A recompressor's slot backend.
enum Backend {
    /// Writes what its algorithm says (the `high` parse's LZ4, nvCOMP's zstd frames).
    Plain(Box<dyn SlotBackend>),
    /// Writes LZ4 with the store's dictionary, once loaded with it (`loaded`).
    Dictionary {
        slots: Box<dyn DictionarySlots>,
        loaded: std::sync::atomic::AtomicBool,
    },
}

impl Backend {
    fn slots(&self) -> &dyn SlotBackend {
        match self {
            Self::Plain(b) => &**b,
            Self::Dictionary { slots, .. } => &**slots,
        }
    }
}

/// A slot backend that compresses with a dictionary it is loaded with.
pub trait DictionarySlots: SlotBackend {
    /// From now on, blocks with `dict` as their prefix.
    fn load_dictionary(&self, dict: &[u8]) -> Result<(), String>;
}

impl DictionarySlots for GpuDictLz4 {
    fn load_dictionary(&self, dict: &[u8]) -> Result<(), String> {
        GpuDictLz4::load_dictionary(self, dict).map_err(|e| e.to_string())
    }
}

impl OnGpu {
    /// The store's dictionary, trained now if it has none (false while too few pages
    /// qualify; its sampling raised by `priority`), loaded into `slots` once. Called with
    /// the turn held.
    fn dictionary_ready(
        &self,
        slots: &dyn DictionarySlots,
        loaded: &std::sync::atomic::AtomicBool,
        store: &PageStore,
        candidates: Candidates,
        threshold: usize,
        priority: &dyn Priority,
    ) -> Result<bool, CoreError> {
        let keep = self.kept.get().copied();
        let Some(dict) = dictionary::for_pass(store, candidates, threshold, keep, Some(priority))?
        else {
            return Ok(false);
        };
        if !loaded.load(std::sync::atomic::Ordering::Acquire) {
            slots
                .load_dictionary(&dict)
                .map_err(|reason| CoreError::Backend {
                    backend: "gpu",
                    reason,
                })?;
            loaded.store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(true)
    }

    /// The slot, opened at the first call.
    fn slots(&self) -> Result<&Opened, String> {
        self.slots
            .get_or_init(|| {
                open_gpu(self.codec, &self.settings).map(|backend| Opened {
                    backend,
                    turn: Mutex::new(()),
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl Recompressor {
    /// The recompressor for `codec` (the GPU not opened yet).
    pub fn new(codec: RecompressCodec, gpu: &GpuSettings) -> Self {
        match codec {
            RecompressCodec::Zstd { level } => Self::Zstd { level },
            RecompressCodec::GpuLz4 | RecompressCodec::GpuZstd | RecompressCodec::GpuLz4Dict => {
                Self::Gpu(Box::new(OnGpu {
                    codec,
                    settings: gpu.clone(),
                    slots: OnceLock::new(),
                    kept: OnceLock::new(),
                }))
            }
        }
    }

    /// Keeps a dictionary it trains in `area` (the store segment's) before the store takes
    /// it, so that the next daemon reads what was written with it.
    pub fn keep_dictionary_in(&self, area: KeptDictionary) {
        if let Self::Gpu(gpu) = self {
            let _ = gpu.kept.set(area);
        }
    }

    /// Opens the GPU now, if it is one; the error says what to do.
    pub fn open(&self) -> anyhow::Result<()> {
        match self {
            Self::Zstd { .. } => Ok(()),
            Self::Gpu(gpu) => gpu.slots().map(|_| ()).map_err(anyhow::Error::msg),
        }
    }

    /// One pass over `candidates`: at most `max_pages` tried, of at least `threshold`
    /// stored bytes. With `level`, zstd at that level whatever the device's recompressor
    /// (`uzram recompress --algorithm`); if that is another than the device's, the pass
    /// also takes the pages the device's own already tried. Passes take turns on the GPU;
    /// without `wait`, a pass that finds another on it does nothing (the tier thread's
    /// tick, behind a manual pass).
    pub fn run(
        &self,
        store: &PageStore,
        candidates: Candidates,
        threshold: usize,
        max_pages: u64,
        level: Option<i32>,
        wait: bool,
    ) -> Result<Recompressed, CoreError> {
        let own = match (self, level) {
            (&Self::Zstd { level: own }, Some(level)) => own == level,
            (Self::Gpu(_), Some(_)) => false,
            (_, None) => true,
        };
        // The pass runs at its thread's priority (the tier thread's nice 19), raised only
        // while it holds locks the I/O path waits on.
        let priority = crate::sys::IoPriority::of_this_thread();
        let pass = |recompressor| Recompress {
            candidates,
            recompressor,
            threshold,
            max_pages,
            retry_tried: !own,
            priority: Some(&priority),
        };
        match (self, level) {
            (_, Some(level)) => store.recompress(pass(Pass::Zstd { level })),
            (&Self::Zstd { level }, None) => store.recompress(pass(Pass::Zstd { level })),
            (Self::Gpu(gpu), None) => {
                let opened = gpu.slots().map_err(|reason| CoreError::Backend {
                    backend: "gpu",
                    reason,
                })?;
                let _turn = match opened.turn.try_lock() {
                    Ok(turn) => turn,
                    Err(TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(TryLockError::WouldBlock) if !wait => return Ok(Recompressed::default()),
                    Err(TryLockError::WouldBlock) => {
                        opened.turn.lock().unwrap_or_else(PoisonError::into_inner)
                    }
                };
                match &opened.backend {
                    Backend::Plain(backend) => store.recompress(pass(Pass::Batched {
                        backend: &**backend,
                        slot: 0,
                    })),
                    Backend::Dictionary { slots, loaded } => {
                        if !gpu.dictionary_ready(
                            &**slots, loaded, store, candidates, threshold, &priority,
                        )? {
                            // Too few idle pages yet to learn a dictionary from.
                            return Ok(Recompressed::default());
                        }
                        store.recompress(pass(Pass::Dictionary {
                            backend: &**slots,
                            slot: 0,
                        }))
                    }
                }
            }
        }
    }

    /// For the dictionary recompressor: trains the store's dictionary now if it has none
    /// (and enough of `candidates` to learn from) and loads the GPU with it, as its first
    /// pass would; true once both are done. Other recompressors need nothing: true.
    /// (`uzram bench` times this apart from the pass.)
    pub fn prepare(
        &self,
        store: &PageStore,
        candidates: Candidates,
        threshold: usize,
    ) -> Result<bool, CoreError> {
        let Self::Gpu(gpu) = self else {
            return Ok(true);
        };
        let opened = gpu.slots().map_err(|reason| CoreError::Backend {
            backend: "gpu",
            reason,
        })?;
        match &opened.backend {
            Backend::Plain(_) => Ok(true),
            Backend::Dictionary { slots, loaded } => {
                let _turn = opened.turn.lock().unwrap_or_else(PoisonError::into_inner);
                let priority = crate::sys::IoPriority::of_this_thread();
                gpu.dictionary_ready(&**slots, loaded, store, candidates, threshold, &priority)
            }
        }
    }

    /// The GPU recompressor's own counters once it is open (`nvcomp_failed_pages`, the
    /// `high` parse's `gpu_*`), named `recompressor_*` beside the write path's backend's.
    pub fn stats(&self) -> Vec<(String, u64)> {
        let Self::Gpu(gpu) = self else {
            return Vec::new();
        };
        match gpu.slots.get() {
            Some(Ok(opened)) => opened
                .backend
                .slots()
                .stats()
                .into_iter()
                .map(|(name, value)| (format!("recompressor_{name}"), value))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Its name, as `recompress-algorithm` spells it.
    pub fn name(&self) -> String {
        match self {
            &Self::Zstd { level } => RecompressCodec::Zstd { level },
            Self::Gpu(gpu) => gpu.codec,
        }
        .name()
    }
}

/// One slot of `codec` (the `high` parse, the dictionary parse, or nvCOMP's zstd) on the
/// device's first GPU.
fn open_gpu(codec: RecompressCodec, settings: &GpuSettings) -> Result<Backend, String> {
    let opened = (|| -> anyhow::Result<(Backend, String)> {
        let first = settings
            .gpus
            .ordinals()?
            .into_iter()
            .next()
            .context("no GPU to open: gpus names none")?;
        if codec == RecompressCodec::GpuZstd {
            let zstd = NvcompZstd::new(first, DEFAULT_GPU_SLOT_PAGES)
                .context("opening nvCOMP's zstd on the GPU")?;
            let name = zstd.device_name().to_string();
            return Ok((Backend::Plain(Box::new(zstd)), name));
        }
        if codec == RecompressCodec::GpuLz4Dict {
            let dict = GpuDictLz4::new(first, DEFAULT_GPU_SLOT_PAGES)
                .context("opening the dictionary parse on the GPU")?;
            let name = dict.device_name().to_string();
            let backend = Backend::Dictionary {
                slots: Box::new(dict),
                loaded: std::sync::atomic::AtomicBool::new(false),
            };
            return Ok((backend, name));
        }
        let cfg = GpuConfig {
            devices: vec![first],
            slots: 1,
            slot_pages: DEFAULT_GPU_SLOT_PAGES,
            parse: Parse::High,
            graphs: true,
        };
        let slots = GpuSlots::new(cfg).context("opening the GPU")?;
        let name = slots.device_names().join(", ");
        Ok((Backend::Plain(Box::new(slots)), name))
    })();
    match opened {
        Ok((slots, device)) => {
            tracing::info!(
                recompressor = %codec.name(),
                device,
                "recompression on the GPU ready"
            );
            Ok(slots)
        }
        Err(e) => Err(format!(
            "recompress-algorithm {}: {e:#} (use recompress-algorithm zstd on a host \
             without a working NVIDIA GPU)",
            codec.name()
        )),
    }
}

#[cfg(test)]
mod tests {
    use uzram_core::batch::HostSlots;
    use uzram_core::codec::Algorithm;
    use uzram_core::{StoreConfig, PAGE_SIZE};

    use super::*;

    #[test]
    fn a_gpu_recompressor_without_a_gpu_says_what_to_do_and_zstd_still_runs() {
        for (codec, name) in [
            (RecompressCodec::GpuLz4, "lz4-gpu"),
            (RecompressCodec::GpuZstd, "zstd-gpu"),
        ] {
            let r = Recompressor::new(codec, &GpuSettings::default());
            assert_eq!(r.name(), name);
            let store = PageStore::new(StoreConfig::new(16, Algorithm::Lz4)).unwrap();
            let text: Vec<u8> = (0..16 * PAGE_SIZE).map(|i| b"cold page "[i % 10]).collect();
            store.write(0, &text).unwrap();
            store.mark_idle(None);
            let idle = Candidates::Idle { min_age: 0 };
            if r.open().is_ok() {
                eprintln!("skipping the no-GPU half of {name}: this host's GPU opened");
            } else {
                let err = r.open().unwrap_err().to_string();
                assert!(err.contains("use recompress-algorithm zstd"), "{err}");
                assert!(err.contains(name), "{err}");
                let pass = r.run(&store, idle, 0, u64::MAX, None, true).unwrap_err();
                assert!(matches!(pass, CoreError::Backend { .. }), "{pass}");
            }
            // `uzram recompress --level` writes zstd whatever the device's recompressor.
            let done = r.run(&store, idle, 0, u64::MAX, Some(3), true).unwrap();
            assert_eq!(done.tried, 16, "{done:?}");
            assert_eq!(store.stats().recompressed_pages, done.rewritten);
            let mut back = vec![0u8; text.len()];
            store.read(0, &mut back).unwrap();
            assert!(back == text);
        }
    }

    #[test]
    fn a_manual_pass_with_another_level_takes_the_pages_the_devices_own_tried() {
        let r = Recompressor::new(RecompressCodec::Zstd { level: 3 }, &GpuSettings::default());
        let store = PageStore::new(StoreConfig::new(16, Algorithm::Lz4)).unwrap();
        let noise = uzram_core::fuzz::noise_pages(16, 0x2545_f491_4f6c_dd1d);
        store.write(0, &noise).unwrap();
        store.mark_idle(None);
        let idle = Candidates::Idle { min_age: 0 };
        let tick = r.run(&store, idle, 0, u64::MAX, None, true).unwrap();
        assert_eq!((tick.tried, tick.kept), (16, 16), "noise stays: {tick:?}");
        // The device's own level again: nothing to do.
        let same = r.run(&store, idle, 0, u64::MAX, Some(3), true).unwrap();
        assert_eq!(same.tried, 0, "{same:?}");
        // Another level: the pages are its to try.
        let other = r.run(&store, idle, 0, u64::MAX, Some(19), true).unwrap();
        assert_eq!(other.tried, 16, "{other:?}");
    }

    /// A GPU recompressor over `backend` (a stand-in for the GPU's slot).
    fn on_backend(codec: RecompressCodec, backend: Box<dyn SlotBackend>) -> Recompressor {
        on(codec, Backend::Plain(backend))
    }

    fn on(codec: RecompressCodec, backend: Backend) -> Recompressor {
        let slots = OnceLock::new();
        assert!(slots
            .set(Ok(Opened {
                backend,
                turn: Mutex::new(()),
            }))
            .is_ok());
        Recompressor::Gpu(Box::new(OnGpu {
            codec,
            settings: GpuSettings::default(),
            slots,
            kept: OnceLock::new(),
        }))
    }

    /// liblz4 with the loaded dictionary, standing in for the GPU's dictionary parse.
    impl DictionarySlots for HostSlots {
        fn load_dictionary(&self, dict: &[u8]) -> Result<(), String> {
            HostSlots::load_dictionary(self, dict);
            Ok(())
        }
    }

    /// The dictionary recompressor waits for enough idle pages, then trains the device's
    /// dictionary on them, keeps it where the next daemon finds it, loads the backend and
    /// writes pages that read back exact; the next pass uses the same dictionary.
    #[test]
    fn the_dictionary_recompressor_trains_keeps_and_uses_one_dictionary() {
        use crate::takeover::dictionary::{KeptDictionary, WORDS};
        use std::sync::atomic::AtomicU64;
        let r = on(
            RecompressCodec::GpuLz4Dict,
            Backend::Dictionary {
                slots: Box::new(HostSlots::new(Algorithm::Lz4, 1, 256)),
                loaded: std::sync::atomic::AtomicBool::new(false),
            },
        );
        let area = KeptDictionary::over(Box::leak((0..WORDS).map(|_| AtomicU64::new(0)).collect()));
        r.keep_dictionary_in(area);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
        let mut data = Vec::new();
        for name in ["mixed-swap", "python-heap", "postgres"] {
            let f = std::fs::File::open(dir.join(format!("{name}.slice.pages.zst"))).unwrap();
            data.extend(zstd::decode_all(f).unwrap());
        }
        let pages = (data.len() / PAGE_SIZE) as u64;
        let store = PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap();
        let idle = Candidates::Idle { min_age: 0 };
        // Too few idle pages: nothing done, no dictionary.
        store.write(0, &data[..512 * PAGE_SIZE]).unwrap();
        store.mark_idle(None);
        assert!(
            !r.prepare(&store, idle, 0).unwrap(),
            "no dictionary from 512 pages"
        );
        let early = r.run(&store, idle, 0, u64::MAX, None, true).unwrap();
        assert_eq!(early, Recompressed::default());
        assert!(store.dictionary().is_none() && area.read().unwrap().is_none());
        store.write(0, &data).unwrap();
        store.mark_idle(None);
        let before = store.stats();
        assert!(r.prepare(&store, idle, 0).unwrap());
        let dict = store.dictionary().expect("trained").to_vec();
        let done = r.run(&store, idle, 0, u64::MAX, None, true).unwrap();
        assert_eq!(
            area.read().unwrap(),
            Some(dict.clone()),
            "kept for the next daemon"
        );
        assert!(done.rewritten > done.tried / 2, "{done:?}");
        assert_eq!(done.failed, 0, "{done:?}");
        assert_eq!(
            before.compr_data_size - store.stats().compr_data_size,
            done.saved_bytes
        );
        uzram_core::fuzz::reads_back(&store, &data);
        // Pages written again go idle and are recompressed with the same dictionary.
        store.write(0, &data[..64 * PAGE_SIZE]).unwrap();
        store.mark_idle(None);
        let again = r.run(&store, idle, 0, u64::MAX, None, true).unwrap();
        // (Same-filled pages hold no object: no candidates.)
        assert!(again.tried > 32 && again.tried <= 64, "{again:?}");
        assert!(again.rewritten > 0, "{again:?}");
        assert_eq!(store.dictionary(), Some(&dict[..]));
        uzram_core::fuzz::reads_back(&store, &data);
    }

    #[test]
    fn a_gpu_recompressor_takes_turns_writes_its_frames_and_shows_its_counters() {
        // The CPU's zstd in a slot, standing in for nvCOMP.
        let r = on_backend(
            RecompressCodec::GpuZstd,
            Box::new(HostSlots::new(Algorithm::Zstd { level: 3 }, 1, 64)),
        );
        let completes = |r: &Recompressor| {
            r.stats()
                .into_iter()
                .find(|(name, _)| name == "recompressor_host_completes")
                .map(|(_, value)| value)
        };
        assert_eq!(completes(&r), Some(0));
        // Words from a small vocabulary: LZ4 halves them, zstd's entropy coding does better.
        let words = [
            "cold ", "page ", "swap ", "idle ", "zstd ", "gpu ", "ring ", "slot ",
        ];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut text = Vec::new();
        while text.len() < 128 * PAGE_SIZE {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            text.extend_from_slice(words[(x % 8) as usize].as_bytes());
        }
        text.truncate(128 * PAGE_SIZE);
        let store = PageStore::new(StoreConfig::new(128, Algorithm::Lz4)).unwrap();
        store.write(0, &text).unwrap();
        store.mark_idle(None);
        let idle = Candidates::Idle { min_age: 0 };
        // The tier's tick behind a manual pass on the slot does nothing.
        let Recompressor::Gpu(gpu) = &r else {
            unreachable!()
        };
        let held = gpu.slots().unwrap().turn.lock().unwrap();
        let skipped = r.run(&store, idle, 0, u64::MAX, None, false).unwrap();
        assert_eq!(skipped, Recompressed::default());
        drop(held);
        let done = r.run(&store, idle, 0, u64::MAX, None, false).unwrap();
        assert_eq!(done.tried, 128, "{done:?}");
        assert!(done.rewritten > 64, "{done:?}");
        assert_eq!(store.stats().recompressed_pages, done.rewritten);
        uzram_core::fuzz::reads_back(&store, &text);
        // Its counters, named as the recompressor's: two slots of 64 pages went through.
        assert_eq!(completes(&r), Some(2));
    }
}

//! Where a device's writes are compressed: inline on the queue threads (`cpu`), or on NVIDIA
//! GPUs through a ring of pinned staging slots (`gpu`, and `auto` where a GPU opens and the
//! algorithm is LZ4). This is the one place that decides.
//!
//! With a GPU, a write copies each page once into a slot and completes; reads of a staged
//! page copy it back out of the slot; installer threads put the checked results into the
//! store while other slots are on the GPU (uzram-core's `Ring`). A failing GPU is retired
//! and the CPU takes over, losing nothing.

use std::sync::Arc;

use anyhow::Context;
use uzram_core::batch::{BackendMemory, Ring, RingConfig, ThreadHook};
use uzram_core::codec::Algorithm;
use uzram_core::store::PageStore;
use uzram_core::CoreError;
use uzram_gpu::{GpuConfig, GpuSlots};

use super::io::PageWriter;
use crate::config::{Backend, GpuSettings};
use crate::control::proto::Stat;

/// How the daemon compresses writes.
pub struct Compression {
    store: Arc<PageStore>,
    ring: Option<Ring>,
}

/// Why `auto` compresses on the CPU, or `None` when it uses a GPU.
fn auto_on_cpu(algorithm: Algorithm, gpu: &Result<GpuSlots, anyhow::Error>) -> Option<String> {
    if algorithm != Algorithm::Lz4 {
        return Some(format!("the GPU compresses lz4, this device {algorithm}"));
    }
    gpu.as_ref().err().map(|e| format!("{e:#}"))
}

impl Compression {
    /// Sets up the backend asked for. `gpu` fails when no GPU ring can start; `auto` then
    /// compresses on the CPU (and says why in the log). `hook` runs first on every thread
    /// the ring starts.
    pub fn start(
        store: Arc<PageStore>,
        asked: Backend,
        settings: &GpuSettings,
        hook: Option<ThreadHook>,
    ) -> anyhow::Result<Self> {
        let algorithm = store.algorithm();
        let slots = match asked {
            Backend::Cpu => return Ok(Self::cpu(store)),
            Backend::Gpu if algorithm != Algorithm::Lz4 => {
                anyhow::bail!("the gpu backend compresses lz4 only: use --algorithm lz4 with --backend gpu")
            }
            Backend::Gpu => open_gpu(settings).context(
                "opening the GPU for --backend gpu (use --backend cpu, or auto to use a GPU only where one works)",
            )?,
            Backend::Auto => {
                let gpu = if algorithm == Algorithm::Lz4 {
                    open_gpu(settings)
                } else {
                    Err(anyhow::anyhow!("not tried"))
                };
                if let Some(why) = auto_on_cpu(algorithm, &gpu) {
                    tracing::info!(why, "backend auto compresses on the CPU");
                    return Ok(Self::cpu(store));
                }
                gpu?
            }
        };
        tracing::info!(
            gpus = ?slots.device_names(),
            slots = slots.config().slots,
            slot_pages = slots.config().slot_pages,
            parse = slots.config().parse.name(),
            pinned_bytes = slots.config().pinned_bytes(),
            "compressing writes on the GPU"
        );
        let cfg = RingConfig {
            on_thread_start: hook,
            installers: settings.installers,
            ..RingConfig::default()
        };
        let ring =
            Ring::start(store.clone(), Arc::new(slots), cfg).context("starting the GPU ring")?;
        Ok(Self {
            store,
            ring: Some(ring),
        })
    }

    fn cpu(store: Arc<PageStore>) -> Self {
        Self { store, ring: None }
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

    /// Stops staging and installs every staged page (before a handover, whose next daemon
    /// cannot read this process's pinned staging); later writes are compressed on the CPU.
    /// `None` without a ring; else whether it emptied within `within`.
    pub fn drain(&self, within: std::time::Duration) -> Option<bool> {
        self.ring.as_ref().map(|r| r.drain(within))
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
            ])
            .map(|(name, value)| Stat {
                name: name.to_string(),
                value,
            })
            .collect()
    }
}

/// Opens the GPU ring's slots as configured.
fn open_gpu(settings: &GpuSettings) -> anyhow::Result<GpuSlots> {
    let mut cfg = GpuConfig::for_pinned_budget(settings.memory, settings.slot_pages)?;
    cfg.devices = settings.gpus.ordinals()?;
    cfg.parse = settings.parse;
    Ok(GpuSlots::new(cfg)?)
}

impl PageWriter for Compression {
    fn write_pages(&self, first_page: u64, data: &[u8]) -> Result<(), CoreError> {
        match &self.ring {
            Some(r) => r.write(first_page, data),
            None => self.store.write(first_page, data),
        }
    }
}

#[cfg(test)]
mod tests {
    use uzram_core::store::StoreConfig;

    use super::*;
    use crate::daemon::io::{handle_with, Op};

    fn store(algorithm: Algorithm) -> Arc<PageStore> {
        Arc::new(PageStore::new(StoreConfig::new(64, algorithm)).unwrap())
    }

    fn round_trip(s: &Arc<PageStore>, c: &Compression) {
        let mut buf = b"uzram ".repeat(4096 * 2 / 6 + 1);
        buf.truncate(8192);
        let want = buf.clone();
        assert_eq!(handle_with(Op::Write, 8, 16, &mut buf, s, c), 8192);
        let mut back = vec![0u8; 8192];
        assert_eq!(handle_with(Op::Read, 8, 16, &mut back, s, c), 8192);
        assert_eq!(back, want);
    }

    #[test]
    fn cpu_writes_through_the_store() {
        let s = store(Algorithm::Lz4);
        let c = Compression::start(s.clone(), Backend::Cpu, &GpuSettings::default(), None).unwrap();
        assert_eq!(c.name(), "cpu");
        assert!(c.stats().is_empty());
        assert_eq!(c.memory(), BackendMemory::default());
        round_trip(&s, &c);
    }

    #[test]
    fn auto_with_zstd_starts_on_the_cpu_with_or_without_a_gpu() {
        let s = store(Algorithm::Zstd { level: 1 });
        let c = Compression::start(s.clone(), Backend::Auto, &GpuSettings::default(), None)
            .expect("auto with zstd must start");
        assert_eq!(c.name(), "cpu");
        round_trip(&s, &c);
        assert!(
            auto_on_cpu(Algorithm::Zstd { level: 3 }, &Err(anyhow::anyhow!("x")))
                .unwrap()
                .contains("lz4")
        );
    }

    #[test]
    fn auto_without_a_gpu_uses_the_cpu() {
        if uzram_gpu::gpu_available() {
            eprintln!("skipping: this machine has a GPU");
            return;
        }
        let s = store(Algorithm::Lz4);
        let c =
            Compression::start(s.clone(), Backend::Auto, &GpuSettings::default(), None).unwrap();
        assert_eq!(c.name(), "cpu");
        round_trip(&s, &c);
    }

    #[test]
    fn gpu_without_a_gpu_or_with_zstd_is_a_clear_error() {
        let err = Compression::start(
            store(Algorithm::Zstd { level: 1 }),
            Backend::Gpu,
            &GpuSettings::default(),
            None,
        )
        .err()
        .expect("zstd on the GPU");
        assert!(format!("{err:#}").contains("lz4 only"), "{err:#}");
        if uzram_gpu::gpu_available() {
            eprintln!("skipping the no-GPU case: this machine has a GPU");
            return;
        }
        let err = Compression::start(
            store(Algorithm::Lz4),
            Backend::Gpu,
            &GpuSettings::default(),
            None,
        )
        .err()
        .expect("no GPU here");
        let text = format!("{err:#}");
        assert!(text.contains("--backend cpu"), "{text}");
    }
}

//! [`GpuConfig`]: how many slots of how many pages, on which GPUs, with which parse; and
//! the memory that takes, known before anything is allocated.

use uzram_core::batch::meta_bytes;
use uzram_core::store::{MAX_SLOT_PAGES, MAX_STAGING_SLOTS};
use uzram_core::PAGE_SIZE;

use crate::driver::Kernel;
use crate::launch::{device_buffer_bytes, CTRL_WORDS};
use crate::GpuError;

/// Which compression kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parse {
    /// Every position tested against one candidate, two lazy steps: fastest.
    Fast,
    /// A deeper match search for a better ratio (LZ4HC's class).
    High,
}

impl std::str::FromStr for Parse {
    type Err = GpuError;

    /// Parses `fast` or `high`.
    fn from_str(s: &str) -> Result<Self, GpuError> {
        match s {
            "fast" => Ok(Parse::Fast),
            "high" => Ok(Parse::High),
            other => Err(GpuError::Config(format!(
                "unknown GPU parse {other:?}: use fast or high"
            ))),
        }
    }
}

impl Parse {
    /// `fast` or `high`.
    pub fn name(self) -> &'static str {
        match self {
            Parse::Fast => "fast",
            Parse::High => "high",
        }
    }

    /// The compression kernel that runs this parse.
    pub fn kernel(self) -> Kernel {
        match self {
            Parse::Fast => Kernel::Fast,
            Parse::High => Kernel::High,
        }
    }
}

/// The shape of a [`crate::GpuSlots`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
    /// GPU ordinals; slot `s` runs on `devices[s % devices.len()]`.
    pub devices: Vec<usize>,
    /// Slots in the ring.
    pub slots: usize,
    /// Pages per slot.
    pub slot_pages: usize,
    /// The compression kernel.
    pub parse: Parse,
    /// Capture each slot's work as a CUDA graph (one launch per submission) instead of
    /// queueing its four steps each time.
    pub graphs: bool,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            devices: vec![0],
            slots: 8,
            slot_pages: 2048,
            parse: Parse::Fast,
            graphs: true,
        }
    }
}

impl GpuConfig {
    /// The ring for a pinned-host-memory budget: slots of `slot_pages` pages, as many as
    /// fit (at least 3, so copies, kernels and installs of different slots overlap).
    pub fn for_pinned_budget(bytes: u64, slot_pages: usize) -> Result<Self, GpuError> {
        let mut cfg = Self {
            slot_pages,
            ..Self::default()
        };
        if !(1..=MAX_SLOT_PAGES).contains(&slot_pages) {
            return Err(GpuError::Config(format!(
                "slot_pages must be 1..={MAX_SLOT_PAGES}, got {slot_pages}"
            )));
        }
        let per = Self::pinned_bytes_per_slot(cfg.slot_pages);
        let slots = usize::try_from(bytes / per).unwrap_or(usize::MAX);
        if slots < 3 {
            return Err(GpuError::Config(format!(
                "a GPU ring needs at least {} of pinned memory (3 slots of {} pages)",
                3 * per,
                cfg.slot_pages
            )));
        }
        cfg.slots = slots.min(MAX_STAGING_SLOTS);
        Ok(cfg)
    }

    /// Checks the values are usable.
    pub fn validate(&self) -> Result<(), GpuError> {
        if !(1..=MAX_STAGING_SLOTS).contains(&self.slots) {
            return Err(GpuError::Config(format!(
                "slots must be 1..={MAX_STAGING_SLOTS}, got {}",
                self.slots
            )));
        }
        if !(1..=MAX_SLOT_PAGES).contains(&self.slot_pages) {
            return Err(GpuError::Config(format!(
                "slot_pages must be 1..={MAX_SLOT_PAGES}, got {}",
                self.slot_pages
            )));
        }
        if self.devices.is_empty() {
            return Err(GpuError::Config("no GPU named".into()));
        }
        let mut sorted = self.devices.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != self.devices.len() {
            return Err(GpuError::Config(format!(
                "a GPU is named twice in {:?}",
                self.devices
            )));
        }
        Ok(())
    }

    /// Page-locked host memory of one slot: staging, results, meta and control words.
    pub fn pinned_bytes_per_slot(slot_pages: usize) -> u64 {
        (2 * slot_pages * PAGE_SIZE + meta_bytes(slot_pages) + CTRL_WORDS * 4) as u64
    }

    /// Device memory of one slot: input, scratch (blocks and their hints), packed blocks,
    /// meta and control words.
    pub fn device_bytes_per_slot(slot_pages: usize) -> u64 {
        device_buffer_bytes(slot_pages).iter().sum::<usize>() as u64
    }

    /// Page-locked host memory of the whole ring.
    pub fn pinned_bytes(&self) -> u64 {
        self.slots as u64 * Self::pinned_bytes_per_slot(self.slot_pages)
    }

    /// Device memory of the whole ring (over all its GPUs).
    pub fn device_bytes(&self) -> u64 {
        self.slots as u64 * Self::device_bytes_per_slot(self.slot_pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_and_sizes() {
        let d = GpuConfig::default();
        assert!(d.validate().is_ok());
        assert!(d.slots >= 3);
        assert_eq!(
            d.pinned_bytes(),
            8 * (2 * 2048 * 4096 + (3 * 2048 + 1) * 4 + 20)
        );
        // Input and packed blocks a page each, scratch two (the block, then its hints).
        assert_eq!(
            d.device_bytes(),
            8 * (4 * 2048 * 4096 + (3 * 2048 + 1) * 4 + 20)
        );
        for bad in [
            GpuConfig {
                slots: 0,
                ..GpuConfig::default()
            },
            GpuConfig {
                slots: MAX_STAGING_SLOTS + 1,
                ..GpuConfig::default()
            },
            GpuConfig {
                slot_pages: MAX_SLOT_PAGES + 1,
                ..GpuConfig::default()
            },
            GpuConfig {
                devices: vec![],
                ..GpuConfig::default()
            },
            GpuConfig {
                devices: vec![0, 1, 0],
                ..GpuConfig::default()
            },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(!e.kind().is_fallback(), "{e}");
        }
    }

    #[test]
    fn pinned_budget_decides_the_slot_count() {
        let c = GpuConfig::for_pinned_budget(128 << 20, 2048).unwrap();
        assert_eq!(c.slots, 7, "{c:?}");
        assert!(c.pinned_bytes() <= 128 << 20);
        assert_eq!(
            GpuConfig::for_pinned_budget(128 << 20, 1024).unwrap().slots,
            15
        );
        assert!(GpuConfig::for_pinned_budget(40 << 20, 2048).is_err());
        assert!(GpuConfig::for_pinned_budget(128 << 20, 0).is_err());
        assert_eq!("high".parse::<Parse>().unwrap(), Parse::High);
        assert_eq!(Parse::High.kernel(), Kernel::High);
        assert_eq!(Parse::Fast.kernel(), Kernel::Fast);
        let e = "medium".parse::<Parse>().unwrap_err().to_string();
        assert!(e.contains("fast or high"), "{e}");
    }
}

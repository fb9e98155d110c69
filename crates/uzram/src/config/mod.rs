//! Validated device configuration, from `uzram create` arguments or a TOML file for `uzram run`.
//!
//! The TOML file uses zram-generator's vocabulary where it has one, with its units and
//! defaults: `zram-size` and `zram-resident-limit` (expressions over `ram`, in MiB),
//! `host-memory-limit`, `compression-algorithm`, `swap-priority`, `options`, `fs-type`. uzram's
//! own keys: `size` and `mem-limit` (bytes, or with a K/M/G/T suffix), `backend`, `gpus`,
//! `gpu-memory`, `gpu-parse`, `gpu-installers`, `gpu-slot-wait-us`, `queues`, `depth`,
//! `queue-mode`, `user-copy`, `id`, `metrics-textfile` and `checksums`. Unknown keys are errors, so a typo
//! never silently does nothing.
//!
//! Validation ([`RawDevice::validate`]) is the one the daemon applies, so `check-config`
//! and `create` refuse exactly what the daemon would: it includes what the host can hold
//! (`footprint.rs`) and what the store needs (a memory limit above its page table).
//!
//! - [`device`]: the settings and their one validation;
//! - [`file`](mod@file): uzram's TOML files; [`zram_generator`]: zram-generator's, as it
//!   reads them;
//! - [`load`]: a config by its name on the command line (a file, or `zram-generator:zramN`);
//! - [`sources`]: every device configured on a host.

pub mod device;
pub mod file;
pub mod load;
pub mod sources;
pub mod zram_generator;

pub use device::*;
pub use file::Plan;
pub use load::{load_config, load_device_config};

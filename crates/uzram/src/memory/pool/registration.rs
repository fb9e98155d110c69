//! The pool's memory registered with a device, run by run as it is faulted in, so that the
//! device's copy engine can write the store's objects into it (the GPU's placement of
//! compressed pages, `uzram_gpu::placement`).
//!
//! Registered memory is page-locked by the driver, and the device keeps the pages it was
//! registered with: a block whose pages were punched out (`trim`) and faulted in again would
//! be new pages the device never writes. So registered blocks are never given back
//! ([`covers`]; `trim` stops at them): with placement on, the pool keeps the memory it has
//! faulted in for the life of the process.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use super::{BASE, BLOCK, FRONTIER};

/// Memory registered at a time: 2 MiB (about 0.1-0.2 ms a run, docs/bench/gpu-runs.md run
/// 268), from the start of the pool's range.
const RUN: usize = 32 * BLOCK;

type Register = Box<dyn Fn(usize, usize) -> bool + Send + Sync>;

static REGISTER: OnceLock<Register> = OnceLock::new();
/// End of the memory registered so far (0: none).
static END: AtomicUsize = AtomicUsize::new(0);
/// Set when a registration failed: nothing more is registered.
static FAILED: AtomicBool = AtomicBool::new(false);
/// Held while registering, so that every run is registered once.
static REGISTERING: Mutex<()> = Mutex::new(());

/// From now on, registers the pool's memory through `register(address, bytes)` (true when it
/// took), a run at a time as the pool faults it in: what is in the pool already at once,
/// the rest as the keeper and fillers refill. A second call keeps the first `register`.
/// False when the pool is not set up or a registration failed.
pub fn register_with(register: impl Fn(usize, usize) -> bool + Send + Sync + 'static) -> bool {
    let base = BASE.load(Ordering::Acquire);
    if base == 0 {
        return false;
    }
    if REGISTER.set(Box::new(register)).is_ok() {
        let _ = END.compare_exchange(0, base, Ordering::AcqRel, Ordering::Acquire);
    }
    register_ready();
    !FAILED.load(Ordering::Acquire)
}

/// Registers every whole run the pool has faulted in (or is faulting in) and not yet
/// registered.
pub(super) fn register_ready() {
    let Some(register) = REGISTER.get() else {
        return;
    };
    let _one = REGISTERING.lock().unwrap_or_else(PoisonError::into_inner);
    let frontier = FRONTIER.load(Ordering::Acquire);
    let mut end = END.load(Ordering::Acquire);
    while !FAILED.load(Ordering::Acquire) && end + RUN <= frontier {
        if !register(end, RUN) {
            tracing::warn!(
                at = end,
                "registering the block pool's memory with the GPU failed: compressed pages \
                 past it are copied by the installers"
            );
            FAILED.store(true, Ordering::Release);
            break;
        }
        end += RUN;
        END.store(end, Ordering::Release);
    }
}

/// Whether `bytes` at `address` lie in registered memory.
pub fn registered(address: usize, bytes: usize) -> bool {
    let base = BASE.load(Ordering::Acquire);
    base != 0
        && address >= base
        && address
            .checked_add(bytes)
            .is_some_and(|end| end <= END.load(Ordering::Acquire))
}

/// Whether the block at `block` is registered (and so must never be punched out).
pub(super) fn covers(block: usize) -> bool {
    registered(block, BLOCK)
}

//! Staying alive under memory reclaim: the daemon serves the device that reclaim writes to,
//! so it must never need memory that only reclaim could give it.
//!
//! - [`pool`]: the block pool, the global allocator's 64 KiB blocks, kept full ahead of need.
//! - [`reserve`]: the heap grown once at start and never trimmed.
//! - [`fault_guard`]: the binary's code and writable memory faulted in and locked up front,
//!   and the queue threads' page faults counted.
//! - [`free_lists`]: the per-CPU free page lists held short while a takeover gives memory back.
//! - [`realtime`]: a takeover's threads at realtime priority until the device serves.

pub mod fault_guard;
pub mod free_lists;
pub mod pool;
pub mod realtime;
pub mod reserve;

/// Set-up for a thread that installs staged pages: like a queue thread, it is on the swap
/// I/O path, so it must get ENOMEM rather than page-fault into reclaim, and run ahead of
/// the tasks that wait for swap.
/// Its threads have 256 KiB stacks (the ring's installers, `spawn`).
/// `uzram bench` gives its GPU ring the same set-up, so that the GPU host runs it.
pub fn io_path_thread(name: &str) {
    pool::strict_current_thread();
    fault_guard::prefault_small_stack();
    crate::sys::raise_io_thread_priority(name);
}

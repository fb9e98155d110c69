//! Heap headroom for the daemon's small allocations (see `pool.rs` for the big ones).
//!
//! malloc is told to use one arena, never to trim the heap and to serve allocations up to
//! 32 MiB from it; the daemon then grows the heap once at start. Memory freed once stays in the
//! process, already faulted in and locked (mlockall's MCL_FUTURE), so small allocations while
//! serving rarely need a page fault, which under memory pressure could wait on the daemon's own
//! swap I/O.

/// malloc's largest heap-served allocation once configured (glibc's maximum on 64-bit).
const MMAP_THRESHOLD: usize = 32 << 20;
/// Heap growth step: below the mmap threshold so it comes from the heap.
const STEP: usize = 4 << 20;

/// Configures glibc malloc as described in the module docs. Call before any thread starts
/// (first thing in `main`): an arena created earlier would stay in use.
pub fn configure_malloc() -> bool {
    let settings = [
        (libc::M_ARENA_MAX, 1),
        (libc::M_TRIM_THRESHOLD, i32::MAX),
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as i32),
        (libc::M_TOP_PAD, STEP as i32),
    ];
    settings
        .iter()
        .all(|&(param, value)| crate::sys::memory::mallopt(param, value))
}

/// Free bytes at the top of the heap: what can be handed out without touching the kernel.
pub fn headroom() -> usize {
    crate::sys::memory::mallinfo().keepcost
}

/// [`grow`], once per process: a daemon taking a device over from a running one grows its
/// heap before it asks for the handover (`daemon::prepare_takeover`), and `serve` then has
/// nothing left to do.
pub fn grow_once(bytes: usize) {
    static GROWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !GROWN.swap(true, std::sync::atomic::Ordering::Relaxed) {
        grow(bytes);
    }
}

/// Grows the heap's free top by about `bytes`: allocate in steps, then free (the heap is never
/// trimmed, so the memory stays, faulted in and locked).
pub fn grow(bytes: usize) {
    let steps = bytes.div_ceil(STEP);
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(steps);
    for _ in 0..steps {
        let mut block = Vec::<u8>::with_capacity(STEP);
        // Touch one byte per page: without mlockall the pages would otherwise stay virtual.
        block.resize(STEP, 1);
        held.push(std::hint::black_box(block));
    }
    // Free in reverse so each block merges into the heap's top.
    while held.pop().is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether growing by 4 steps leaves at least 3 free in the heap, and no less than was
    /// free before (what earlier tests freed is reused first, so the rise can be smaller).
    fn grown_memory_is_free() -> bool {
        if !configure_malloc() {
            return false;
        }
        // Count free bytes over all arenas (`fordblks`) rather than the main heap's top.
        let before = crate::sys::memory::mallinfo().fordblks;
        grow(4 * STEP);
        let after = crate::sys::memory::mallinfo().fordblks;
        after >= 3 * STEP && after >= before
    }

    #[test]
    fn grown_memory_stays_in_the_process() {
        // In a child of its own: the other tests' threads share the malloc arenas and would
        // take or free memory while this one counts it.
        // SAFETY: the child only allocates (glibc's fork leaves malloc usable in the child of
        // a threaded process) and leaves with _exit, never returning into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = std::panic::catch_unwind(grown_memory_is_free).unwrap_or(false);
            // SAFETY: ends the child at once, without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above; `status` is a valid out-parameter.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "growing by {} bytes did not leave them free in the heap (status {status:#x})",
            4 * STEP
        );
    }
}

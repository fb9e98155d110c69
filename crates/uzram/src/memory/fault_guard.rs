//! Keeping page faults off the threads that serve swap I/O.
//!
//! The daemon locks memory with `MCL_ONFAULT` (see `sys::mlock_all`), so a page is only
//! allocated when first touched. A queue thread that touches a new page while the system is
//! out of memory enters reclaim as an I/O flusher: it may not swap, cannot wake the OOM
//! killer, and retries forever while everyone else waits for its swap writes. So a queue
//! thread faults in its stack before serving, and counts the faults it takes afterwards
//! (`queue_page_faults` in `uzram status`): any non-zero count is a path to fix.

/// Stack a queue thread faults in before serving: several times the deepest request path
/// (codec state lives on the heap), half the thread's stack ([`DEFAULT_STACK`]).
const STACK_PREFAULT: usize = 512 << 10;

/// Stack the daemon's other I/O-path threads (GPU installers, the compactor) fault in: they
/// run with 256 KiB stacks (mlockall locks whole stacks), so half of that; their deepest path
/// (an install or a compaction pass) uses a few KiB.
pub const SMALL_STACK_PREFAULT: usize = 128 << 10;

/// Touches `STACK_PREFAULT` bytes of the calling thread's stack so that they are resident and
/// locked before the thread serves I/O. Only for threads with a stack of more than that (the
/// queue threads' 1 MiB); others call [`prefault_small_stack`].
#[inline(never)]
pub fn prefault_stack() {
    touch_stack::<STACK_PREFAULT>();
}

/// [`prefault_stack`] for threads started with a 256 KiB stack: touching more than the
/// stack holds would overflow it (the process aborts).
#[inline(never)]
pub fn prefault_small_stack() {
    touch_stack::<SMALL_STACK_PREFAULT>();
}

#[inline(always)]
fn touch_stack<const N: usize>() {
    let mut frame = [0u8; N];
    for byte in frame.iter_mut().step_by(4096) {
        *byte = 1;
    }
    // The optimizer must assume the frame is read, so the writes above happen.
    std::hint::black_box(&mut frame);
}

/// What [`populate_writable_mappings`] or [`populate_file_code`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Populated {
    /// Mappings populated.
    pub mappings: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Mappings the kernel refused to populate (special mappings).
    pub refused: usize,
}

/// Write-faults every page of every private writable mapping of the process (heap, the
/// binary's `.data` and `.bss`, thread stacks, malloc arenas) with `MADV_POPULATE_WRITE`,
/// without changing their contents, so that they are resident and locked. Under
/// `MCL_ONFAULT` a static first written under pressure (a counter, a logging call site's
/// registration) would otherwise fault on a queue thread. Call once setup is done, before
/// serving; reserved (`PROT_NONE`) ranges are left alone.
pub fn populate_writable_mappings() -> std::io::Result<Populated> {
    // MADV_POPULATE_WRITE on writable mappings: a write fault that changes no byte.
    populate(private_writable_range, crate::sys::memory::populate_write)
}

/// Read-faults every page of the process's read-only file mappings (the binary's code and
/// constants; a dynamic build's libraries too) with `MADV_POPULATE_READ`, so that they are
/// resident and locked (`MCL_ONFAULT` locks a page once it is mapped). Without it, code that
/// first runs under memory pressure (an error path, a log line's formatting) faults: from
/// disk on a real host, but from swap where the binary lives on tmpfs, and that swap can be
/// this very device: with a tmpfs root, queue threads then wait in `shmem_swapin_folio` for
/// their own device, and it hangs.
///
/// Once per process (those mappings never change, and they stay locked): a later call, such
/// as `serve`'s after a takeover prepared before its pause, populates nothing.
pub fn populate_file_code() -> std::io::Result<Populated> {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(Populated::default());
    }
    let done = populate(
        private_read_only_file_range,
        crate::sys::memory::populate_read,
    )?;
    DONE.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(done)
}

/// The stack size of threads started with `std::thread::spawn` (libublk's queue threads):
/// `main` sets it as `RUST_MIN_STACK` unless that is set. Twice [`STACK_PREFAULT`].
pub const DEFAULT_STACK: usize = 1 << 20;

/// Applies `advice` (a populating one, which changes no byte) to every mapping of the
/// process that `select` picks from its /proc/self/maps line.
fn populate(
    select: fn(&str) -> Option<(usize, usize)>,
    advice: fn(usize, usize) -> std::io::Result<()>,
) -> std::io::Result<Populated> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut done = Populated::default();
    for (start, end) in maps.lines().filter_map(select) {
        let len = end - start;
        // Populating only faults pages in, which changes no byte.
        if advice(start, len).is_ok() {
            done.mappings += 1;
            done.bytes += len as u64;
        } else {
            done.refused += 1;
        }
    }
    Ok(done)
}

/// A /proc/self/maps line's address range, permissions and path ("" when anonymous).
fn mapping(line: &str) -> Option<(usize, usize, &str, &str)> {
    let mut fields = line.split_whitespace();
    let range = fields.next()?;
    let perms = fields.next()?;
    let path = fields.nth(3).unwrap_or("");
    let (start, end) = range.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    (end > start).then_some((start, end, perms, path))
}

/// The address range of a /proc/self/maps line whose mapping is private, readable, not
/// writable and backed by a file (a path), or `None`.
fn private_read_only_file_range(line: &str) -> Option<(usize, usize)> {
    let (start, end, perms, path) = mapping(line)?;
    let read_only_private = perms.starts_with('r') && !perms.contains('w') && perms.ends_with('p');
    (read_only_private && path.starts_with('/')).then_some((start, end))
}

/// The address range of a /proc/self/maps line whose mapping is private and writable.
fn private_writable_range(line: &str) -> Option<(usize, usize)> {
    let (start, end, perms, _) = mapping(line)?;
    (perms.contains('w') && perms.ends_with('p')).then_some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::sched::thread_faults;

    #[test]
    fn parses_private_writable_mappings_only() {
        let line = "7f00a000-7f00c000 rw-p 00000000 00:00 0";
        assert_eq!(private_writable_range(line), Some((0x7f00a000, 0x7f00c000)));
        assert_eq!(
            private_writable_range("7f00a000-7f00c000 r--p 0 00:00 0"),
            None
        );
        assert_eq!(
            private_writable_range("7f00a000-7f00c000 rw-s 0 00:00 0"),
            None
        );
        assert_eq!(
            private_writable_range("7f00a000-7f00c000 ---p 0 00:00 0"),
            None
        );
        assert_eq!(private_writable_range("garbage"), None);
    }

    #[test]
    fn finds_read_only_file_mappings_only() {
        let code = "55d0a000-55d0c000 r-xp 00001000 fe:01 1234 /usr/bin/uzram";
        assert_eq!(
            private_read_only_file_range(code),
            Some((0x55d0a000, 0x55d0c000))
        );
        let consts = "55d0c000-55d0d000 r--p 00003000 fe:01 1234 /usr/bin/uzram";
        assert!(private_read_only_file_range(consts).is_some());
        for other in [
            "55d0d000-55d0e000 rw-p 00004000 fe:01 1234 /usr/bin/uzram",
            "7f00a000-7f00c000 r--s 00000000 00:05 99 /dev/ublkc0",
            "7f00a000-7f00c000 r-xp 00000000 00:00 0 [vdso]",
            "7f00a000-7f00c000 r--p 00000000 00:00 0",
            "7f00a000-7f00c000 ---p 00000000 fe:01 1234 /usr/bin/uzram",
            "garbage",
        ] {
            assert_eq!(private_read_only_file_range(other), None, "{other}");
        }
        // This test binary's own code is such a mapping.
        let code = populate(
            private_read_only_file_range,
            crate::sys::memory::populate_read,
        )
        .unwrap();
        assert!(code.mappings > 0 && code.bytes > 0, "{code:?}");
    }

    #[test]
    fn populated_static_takes_no_fault_on_first_write() {
        let _serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Pages of .bss nobody has written yet: populating must fault them in up front.
        static UNTOUCHED: [std::sync::atomic::AtomicU8; 7 * 4096] =
            [const { std::sync::atomic::AtomicU8::new(0) }; 7 * 4096];
        let done = populate_writable_mappings().unwrap();
        assert!(done.mappings > 0 && done.bytes > 0, "{done:?}");
        // Each try writes two pages not written before: unpopulated, that is two faults. A
        // stray fault (the host's compaction or khugepaged moving a page of this process
        // under load) is tolerated, one in a try, and a try with more is made again on two
        // fresh pages, three tries at most: unpopulated pages fail every one.
        let mut seen = Vec::new();
        for first in [1, 3, 5] {
            let before = thread_faults().unwrap();
            UNTOUCHED[first * 4096].store(1, std::sync::atomic::Ordering::Relaxed);
            UNTOUCHED[(first + 1) * 4096].store(1, std::sync::atomic::Ordering::Relaxed);
            let faults = thread_faults().unwrap() - before;
            seen.push(faults);
            if faults <= 1 {
                break;
            }
        }
        assert!(
            seen.last().is_some_and(|&f| f <= 1),
            "faults writing two populated static pages, a try each: {seen:?}"
        );
        assert_eq!(
            UNTOUCHED[4096].load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }

    /// The tests below that map thread stacks or populate the process's mappings run one at a
    /// time: a stack mapped or unmapped while /proc/self/maps is read and populated can make
    /// the populate test see a fault that has nothing to do with the code under test.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn small_prefault_fits_the_small_threads_stack() {
        let _serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The size `spawn` and the ring's installers use; an overflow aborts the test binary.
        let faults = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(|| {
                let start = thread_faults().unwrap();
                prefault_small_stack();
                thread_faults().unwrap() - start
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(
            faults >= 8,
            "only {faults} faults for 128 KiB of fresh stack"
        );
    }

    #[test]
    fn prefault_takes_the_stack_faults_up_front() {
        let _serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A fresh stack: glibc hands a new thread the cached stack of an exited one when it is
        // large enough, and that one's pages are already present (0 faults, seen in CI once
        // other tests' threads had exited). No thread of this binary asks for this much.
        let fresh = 64 << 20;
        let (first, second) = std::thread::Builder::new()
            .stack_size(fresh + DEFAULT_STACK)
            .spawn(|| {
                let start = thread_faults().unwrap();
                prefault_stack();
                let faulted = thread_faults().unwrap();
                prefault_stack();
                let again = thread_faults().unwrap();
                (faulted - start, again - faulted)
            })
            .unwrap()
            .join()
            .unwrap();
        let pages = (STACK_PREFAULT / 4096) as u64;
        // The first pass faults in (nearly) every page of a fresh thread's stack range...
        assert!(
            first >= pages * 3 / 4,
            "{first} faults for {pages} stack pages"
        );
        // ...so the same depth later takes none (a fault or two of kernel housekeeping,
        // e.g. khugepaged, is tolerated).
        assert!(second <= 2, "{second} faults on a prefaulted stack");
    }
}

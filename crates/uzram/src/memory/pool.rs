//! A pool of pre-faulted, locked 64 KiB blocks behind the global allocator, so the page store
//! can grow while the system is out of memory.
//!
//! Why: as swap, the daemon must store pages exactly when free memory is gone. Its arena grows
//! in 64 KiB segments; a page fault for a new segment enters reclaim, reclaim waits for swap
//! I/O, and swap I/O waits for the daemon: a deadlock (seen in the guest once the daemon's
//! first 64 MiB were used: kswapd and the memory hog blocked for minutes). zram avoids it with
//! kernel allocation reserves a process cannot use, so the daemon keeps its own:
//!
//! - [`PoolAlloc`] serves every 64 KiB allocation from a free list of blocks that are already
//!   mapped, faulted in and locked; it takes no lock shared with anything that can block in
//!   reclaim (a spin lock around a pointer swap), and falls back to the system allocator when
//!   the pool is empty or not set up;
//! - a keeper thread ([`keep`]) maps more blocks (touched page by page, locked by mlockall)
//!   whenever the pool is below its target, a target that grows when the pool ran low. On
//!   machines with many CPUs, filler threads ([`filler_count`]) share the work when the pool
//!   is far below its target. Like
//!   the queue threads it is an I/O flusher: its reclaim takes pages whose swap-out is done
//!   (clean, freed without I/O) and never queues swap writes of its own behind the queue
//!   threads. When it was not, it sat in its own reclaim's swap writes (waiting for bios and
//!   tags) while the pool ran dry, and every write then failed with ENOMEM for minutes in the
//!   guest, since failed writes free nothing.
//!
//! Blocks come from one address range, so `dealloc` knows its own blocks by address; freed
//! blocks return to the free list. The range is the blocks of the device's store region
//! (`takeover/store_segment.rs`: shared memory that outlives the daemon, nothing committed until a block is
//! first touched, kept resident by `SHM_LOCK` rather than mlock). Shared memory lets the
//! keeper return what the store no longer holds: free blocks beyond the target are punched out
//! (`MADV_REMOVE`, [`trim`]) and refilled first when the pool needs blocks again.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

mod listed;
mod registration;
pub use registration::{register_with, registered};

/// The block size: the page store's arena segment.
pub const BLOCK: usize = crate::footprint::UNIT;
/// Blocks mapped per refill (4 MiB).
const REFILL_BLOCKS: usize = 64;

static BASE: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(0);
/// Next never-mapped address in the reservation (moved forward by `refill`, atomically).
static FRONTIER: AtomicUsize = AtomicUsize::new(0);
static FREE_HEAD: AtomicPtr<u8> = AtomicPtr::new(ptr::null_mut());
static FREE_COUNT: AtomicUsize = AtomicUsize::new(0);
static LOCK: AtomicBool = AtomicBool::new(false);
/// Blocks given back to the system (holes punched), cumulative.
static RELEASED_TOTAL: AtomicUsize = AtomicUsize::new(0);
/// Blocks given back and not yet refilled: the first that `refill` reuses.
static RELEASED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// The keeper thread, woken by [`take_within`] when the pool runs dry.
static KEEPER: OnceLock<std::thread::Thread> = OnceLock::new();
/// Threads that help the keeper fault blocks in when the pool is far below its target
/// ([`fill`]); none on small machines.
static FILLERS: OnceLock<Vec<std::thread::Thread>> = OnceLock::new();
/// The keeper's current target, which the fillers fill to.
static TARGET: AtomicUsize = AtomicUsize::new(0);
static TAKE_WAITS: AtomicUsize = AtomicUsize::new(0);
static TAKE_TIMEOUTS: AtomicUsize = AtomicUsize::new(0);
/// Whether `MADV_POPULATE_WRITE` works here (Linux 5.14+); cleared at its first refusal.
static POPULATE: AtomicBool = AtomicBool::new(true);

/// Whether a block's pages are in memory, kept in the store's region (a byte a block,
/// `store_segment.rs`) so that a recovery adopts the old daemon's free blocks that are still in
/// memory without asking the kernel page by page. Changed before a block's pages are
/// faulted in or punched out and again after, so a crash in between leaves `Changing`, never
/// a state that claims more than is true.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BlockState {
    /// No page of the block is in memory (never touched, or punched out).
    Empty = 0,
    /// Every page of the block is in memory (`SHM_LOCK` keeps them there).
    Filled = 1,
    /// Being faulted in or punched out when its daemon died: anything in between.
    Changing = 2,
}

/// The region's block states and the address of the block the first one describes (null:
/// none are kept, as for a region of layout 2 or a test's anonymous reservation).
static STATES: AtomicPtr<AtomicU8> = AtomicPtr::new(ptr::null_mut());
static STATES_LEN: AtomicUsize = AtomicUsize::new(0);
static STATES_BASE: AtomicUsize = AtomicUsize::new(0);

fn set_states(base: usize, states: Option<&'static [AtomicU8]>) {
    let (p, len) = states.map_or((ptr::null_mut(), 0), |s| (s.as_ptr().cast_mut(), s.len()));
    STATES_BASE.store(base, Ordering::Relaxed);
    STATES_LEN.store(len, Ordering::Relaxed);
    STATES.store(p, Ordering::Release);
}

/// Records `state` for the block at address `block` (nothing when no states are kept).
fn mark(block: usize, state: BlockState) {
    let states = STATES.load(Ordering::Acquire);
    if states.is_null() {
        return;
    }
    let Some(i) = block.checked_sub(STATES_BASE.load(Ordering::Relaxed)) else {
        return;
    };
    let i = i / BLOCK;
    if i < STATES_LEN.load(Ordering::Relaxed) {
        // SAFETY: `set_states` published a slice of STATES_LEN bytes of the region, which is
        // never unmapped; `i` is within it.
        unsafe { (*states.add(i)).store(state as u8, Ordering::Release) };
    }
}

fn lock() {
    while LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
}

fn unlock() {
    LOCK.store(false, Ordering::Release);
}

fn owns(p: *mut u8) -> bool {
    let a = p as usize;
    let base = BASE.load(Ordering::Acquire);
    base != 0 && a >= base && a < LIMIT.load(Ordering::Acquire)
}

/// Whether `p` starts a block of the pool's range that has been mapped for use (below the
/// frontier).
fn is_block(p: *mut u8) -> bool {
    owns(p)
        && (p as usize) < FRONTIER.load(Ordering::Acquire)
        && (p as usize - BASE.load(Ordering::Acquire)).is_multiple_of(BLOCK)
}

/// The number of the block `p` starts (for a `p` that [`is_block`]).
fn block_number(p: *mut u8) -> usize {
    (p as usize - BASE.load(Ordering::Acquire)) / BLOCK
}

/// Free lists found damaged (a link that names no free block), and pointers handed back
/// that start no block or name one already free: cumulative. See [`pop`].
static DAMAGED: AtomicUsize = AtomicUsize::new(0);

/// How often the free list was found damaged, or a pointer into the pool that starts no
/// block, or a block already free, was freed (each dropped, never handed out).
pub fn damaged_lists() -> usize {
    DAMAGED.load(Ordering::Relaxed)
}

/// Pushes a block onto the free list.
///
/// # Safety
/// `block` must be a mapped, writable pool block that nobody else uses.
unsafe fn push(block: *mut u8) {
    if !is_block(block) {
        // Not a block this pool handed out: listed, it would be handed out as one.
        DAMAGED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    lock();
    if listed::set(block_number(block), true) {
        // Still free: listed twice, it would be handed out twice.
        unlock();
        DAMAGED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // SAFETY: the caller hands over an unused, writable block of BLOCK bytes; its first word
    // holds the list link while it is free. The spin lock serializes list updates.
    unsafe {
        block
            .cast::<*mut u8>()
            .write(FREE_HEAD.load(Ordering::Relaxed))
    };
    FREE_HEAD.store(block, Ordering::Relaxed);
    FREE_COUNT.fetch_add(1, Ordering::Relaxed);
    unlock();
}

/// A free block for the page store's arena, or null when the pool has none after waiting up
/// to `wait` for the keeper (woken at once). Never falls back to the system allocator: the
/// store's segments must lie in the region to outlive the daemon.
///
/// Why: a GPU swap-out burst grows the store faster than the keeper faults blocks in (about
/// 6 GB/s of compressed pages against its 1-2 GB/s, docs/bench/gpu-runs.md). Failing the
/// write then turned a burst into swap write errors; a short wait slows the burst to the
/// keeper's pace instead. Bounded, because when memory is truly gone the keeper's refill can
/// itself wait for swap writes, which wait here: the write then fails after `wait`, as it
/// did at once before.
pub fn take_within(wait: Duration) -> *mut u8 {
    let block = pop();
    if !block.is_null() || BASE.load(Ordering::Acquire) == 0 || NO_WAITS.with(|n| n.get() > 0) {
        return block;
    }
    TAKE_WAITS.fetch_add(1, Ordering::Relaxed);
    let deadline = Instant::now() + wait;
    let mut nap = Duration::from_micros(20);
    loop {
        if let Some(keeper) = KEEPER.get() {
            keeper.unpark();
        }
        wake_fillers();
        std::thread::sleep(nap.min(deadline.saturating_duration_since(Instant::now())));
        let block = pop();
        if !block.is_null() {
            return block;
        }
        if Instant::now() >= deadline {
            TAKE_TIMEOUTS.fetch_add(1, Ordering::Relaxed);
            return block;
        }
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

thread_local! {
    /// Guards of [`takes_without_waiting`] this thread holds.
    static NO_WAITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// While the guard lives, [`take_within`] on this thread does not wait for an empty pool to
/// be refilled: for work during which nothing refills it (a takeover's adoption of the
/// store, before its keeper starts).
pub fn takes_without_waiting() -> NoWaits {
    NO_WAITS.with(|n| n.set(n.get() + 1));
    NoWaits(std::marker::PhantomData)
}

/// See [`takes_without_waiting`]; bound to its thread.
#[must_use]
pub struct NoWaits(std::marker::PhantomData<*const ()>);

impl Drop for NoWaits {
    fn drop(&mut self) {
        NO_WAITS.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// Takes that found the pool empty and waited, and those of them that gave up: cumulative.
pub fn take_waits() -> (usize, usize) {
    (
        TAKE_WAITS.load(Ordering::Relaxed),
        TAKE_TIMEOUTS.load(Ordering::Relaxed),
    )
}

/// Takes the free list's first block, or null.
///
/// The link is read from the free block itself (shared memory). One that names no free
/// block (no block at all, or one in use or given back, as the private bits of `listed.rs`
/// say) means something wrote into a free block: both it and the rest of the list may
/// still be someone else's, so the whole list is dropped (counted in [`damaged_lists`],
/// logged by the keeper, which refills the pool) rather than a stray address handed out as
/// 64 KiB to write: that is how a write into freed memory becomes a write into glibc's
/// heap, or two owners of one block.
fn pop() -> *mut u8 {
    lock();
    let mut head = FREE_HEAD.load(Ordering::Relaxed);
    if !head.is_null() {
        listed::set(block_number(head), false);
        // SAFETY: `head` is a free pool block (`push` and the check below let only blocks
        // onto the list); its first word is the link written by `push`.
        let next = unsafe { head.cast::<*mut u8>().read() };
        if next.is_null() || (is_block(next) && listed::is_listed(block_number(next))) {
            FREE_HEAD.store(next, Ordering::Relaxed);
            let left = FREE_COUNT.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
            if next.is_null() && left != 0 {
                // The list ended early: a link skipped free blocks further down. They are
                // lost to this daemon; counted, the keeper would never refill for them.
                forget_list();
            }
        } else {
            FREE_HEAD.store(ptr::null_mut(), Ordering::Relaxed);
            forget_list();
            head = ptr::null_mut();
        }
    }
    unlock();
    head
}

/// After damage, with the pool's lock held and the list's head already cut: nothing is
/// free any more, as far as the pool knows, and the damage is counted.
fn forget_list() {
    FREE_COUNT.store(0, Ordering::Relaxed);
    listed::clear();
    DAMAGED.fetch_add(1, Ordering::Relaxed);
}

/// Set while memory may be given back (see [`set_give_back`]).
static GIVE_BACK: AtomicBool = AtomicBool::new(false);

/// Lets the keeper give memory back (drop a raised target, punch out free blocks beyond it)
/// or stops it. The compactor decides, because it sees the store: only when no page has been
/// written for a while and pages were freed since the last write. A pause in a swap storm
/// is not such a time: blocks given back then are wanted again soon, and refilling them
/// under pressure is what the reserves exist to avoid (guest runs that gave back whenever no
/// block had been taken for 3 s had failed writes fill the swap device, and the OOM killer
/// took the hog).
pub fn set_give_back(on: bool) {
    GIVE_BACK.store(on, Ordering::Relaxed);
}

thread_local! {
    /// Set on threads that serve swap I/O: their 64 KiB allocations that find the pool
    /// empty are counted.
    static STRICT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Cleared while the keeper must not fault blocks in ([`hold_refills`]).
static REFILLS_ALLOWED: AtomicBool = AtomicBool::new(true);

/// Keeps the keeper (and so its fillers) from faulting blocks in until [`allow_refills`].
///
/// Why: a recovering daemon starts while its device serves nothing, often with memory
/// exhausted. A refill then sits in reclaim that only the device's swap writes can satisfy,
/// and `MADV_POPULATE_WRITE` does so holding the process's mmap lock: the next mmap of the
/// starting daemon (a thread's stack) waits behind it, the device never serves, and every
/// later taker of the lock (even a read of `/proc/PID/cmdline`) waits too. Seen in the
/// guest's crash test: the keeper in `madvise` on its CPU for 400 s, the new daemon stuck.
/// The recovery serves with the blocks it adopted instead, and refills once it serves.
pub fn hold_refills() {
    REFILLS_ALLOWED.store(false, Ordering::Release);
}

/// Ends [`hold_refills`] and wakes the keeper.
pub fn allow_refills() {
    REFILLS_ALLOWED.store(true, Ordering::Release);
    if let Some(keeper) = KEEPER.get() {
        keeper.unpark();
    }
}

/// 64 KiB allocations of I/O-serving threads that found the pool empty (the system allocator
/// served them).
static FELL_BACK: AtomicUsize = AtomicUsize::new(0);

/// Marks the calling thread as one that serves I/O, so that a 64 KiB allocation it makes
/// while the pool is empty is counted ([`fallen_back_blocks`]).
///
/// Why not refuse it (null), so that the thread never faults memory in from the system:
/// the store's segments come from [`take_within`], which never falls back and fails the one
/// write with ENOMEM, and any other allocation of that size (a vector growing through 64 KiB)
/// is one Rust cannot fail: null aborts the daemon (`memory allocation of 65536 bytes
/// failed`, SIGABRT), swap and all (seen in a takeover in the guest, docs/known-gaps.md).
/// The system allocator serves it from the heap's headroom, as it serves every other size.
pub fn strict_current_thread() {
    STRICT.with(|s| s.set(true));
}

/// How often an I/O-serving thread's 64 KiB allocation found the pool empty.
pub fn fallen_back_blocks() -> usize {
    FELL_BACK.load(Ordering::Relaxed)
}

/// Counts a 64 KiB allocation that found the pool empty, on an I/O-serving thread.
fn note_fallback() {
    if BASE.load(Ordering::Acquire) != 0 && STRICT.with(|s| s.get()) {
        FELL_BACK.fetch_add(1, Ordering::Relaxed);
    }
}

/// The global allocator: [`System`], except 64 KiB blocks from the pool when it has some.
pub struct PoolAlloc;

fn pooled(layout: Layout) -> bool {
    layout.size() == BLOCK && layout.align() <= 4096
}

// SAFETY: pool blocks are BLOCK bytes, page-aligned (so any align <= 4096), handed out to one
// owner at a time; everything else is delegated to System with the caller's layout.
unsafe impl GlobalAlloc for PoolAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if pooled(layout) {
            let p = pop();
            if !p.is_null() {
                return p;
            }
            note_fallback();
        }
        // SAFETY: forwarded with the caller's own layout contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if pooled(layout) {
            let p = pop();
            if !p.is_null() {
                // SAFETY: `p` is a whole BLOCK-byte block now owned by this caller.
                unsafe { ptr::write_bytes(p, 0, BLOCK) };
                return p;
            }
            note_fallback();
        }
        // SAFETY: forwarded with the caller's own layout contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if owns(p) {
            // SAFETY: `p` came from the pool (it lies in the reservation) and its owner is
            // done with it.
            unsafe { push(p) };
            return;
        }
        // SAFETY: not a pool block, so System allocated it with this layout.
        unsafe { System.dealloc(p, layout) }
    }
}

/// Serves blocks from `len` bytes at `base` (a whole number of blocks of shared memory
/// that this process never unmaps and does not mlock; nothing in it used yet), recording
/// each block's [`BlockState`] in `states` when given. Once only.
pub fn init(base: usize, len: usize, states: Option<&'static [AtomicU8]>) {
    init_with(base, len, &[], states);
}

/// [`init`] for a range whose blocks `used` (block numbers) hold a recovered store: those
/// stay out of the pool. Of the others, blocks whose pages are all still in memory (the old
/// daemon's free pool: `SHM_LOCK` kept them) go straight onto the free list, so a recovery
/// needs no new memory for them: it may run while memory is exhausted and every reclaim
/// waits for this very device. The rest are given back to the system (their pages read as
/// zeros) and refilled first. Returns how many blocks were adopted.
///
/// Which blocks are in memory, `states` says when given (the old daemon kept them, see
/// [`BlockState`]); without them the kernel is asked (`mincore`, page by page: slow for a
/// large device).
pub fn init_with(
    base: usize,
    len: usize,
    used: &[usize],
    states: Option<&'static [AtomicU8]>,
) -> usize {
    let blocks = len / BLOCK;
    let mut in_use = vec![false; blocks];
    for &b in used {
        if let Some(u) = in_use.get_mut(b) {
            *u = true;
        }
    }
    let states = states.filter(|s| s.len() == blocks);
    set_states(base, states);
    let residency = match states {
        Some(states) => recorded_residency(states),
        None => block_residency(base, blocks),
    };
    let top = (0..blocks)
        .rev()
        .find(|&b| in_use[b] || residency[b] != Resident::None)
        .map_or(0, |b| b + 1);
    // Published before the first push: from then on `alloc` may hand out a block (a 64 KiB
    // buffer, `released` below growing to one among them), and its `dealloc` must know it
    // for a pool block. Known a moment later, it went to glibc's `free`, which takes any
    // pointer into the region for one of its own chunks.
    listed::init(blocks);
    FRONTIER.store(base + top * BLOCK, Ordering::Release);
    LIMIT.store(base + blocks * BLOCK, Ordering::Release);
    BASE.store(base, Ordering::Release);
    let mut released = RELEASED.lock().unwrap_or_else(PoisonError::into_inner);
    let mut adopted = 0;
    for b in (0..top).rev().filter(|&b| !in_use[b]) {
        let block = base + b * BLOCK;
        if residency[b] == Resident::All {
            // SAFETY: a block of our mapping that no arena segment holds (the directory says
            // so), whose pages are all in memory: free and ours.
            unsafe { push(block as *mut u8) };
            adopted += 1;
        } else if residency[b] == Resident::None && states.is_some() {
            // Recorded empty: nothing to give back.
            released.push(block);
        } else if punch(block, BLOCK).is_ok() {
            mark(block, BlockState::Empty);
            released.push(block);
        }
    }
    drop(released);
    map_page_tables(base, &in_use[..top]);
    // Recorded states say the blocks above `top` are empty; otherwise make sure.
    if top < blocks && states.is_none() {
        // Never touched, or given back already: made sure of in one call.
        if let Err(err) = punch(base + top * BLOCK, (blocks - top) * BLOCK) {
            tracing::warn!(error = %err, "giving back the old daemon's free blocks failed");
        }
    }
    adopted
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resident {
    None,
    Some,
    All,
}

/// How much of each block is in memory, as its recorded state says.
fn recorded_residency(states: &[AtomicU8]) -> Vec<Resident> {
    states
        .iter()
        .map(|s| match s.load(Ordering::Acquire) {
            x if x == BlockState::Empty as u8 => Resident::None,
            x if x == BlockState::Filled as u8 => Resident::All,
            _ => Resident::Some,
        })
        .collect()
}

/// How much of each of `blocks` blocks at `base` is in memory (`mincore`; all `None` if it
/// fails, which only costs refills).
fn block_residency(base: usize, blocks: usize) -> Vec<Resident> {
    const PAGES: usize = BLOCK / 4096;
    let pages = match crate::sys::memory::resident_pages(base, blocks * BLOCK) {
        Ok(pages) => pages,
        Err(err) => {
            tracing::warn!(error = %err, "mincore over the store's blocks failed: free blocks are refilled, not adopted");
            return vec![Resident::None; blocks];
        }
    };
    pages
        .chunks(PAGES)
        .map(|c| match c.iter().filter(|&&v| v).count() {
            0 => Resident::None,
            n if n == PAGES => Resident::All,
            _ => Resident::Some,
        })
        .collect()
}

/// Blocks whose recorded state claims what the kernel does not hold: `Filled` with a page
/// not in memory, or `Empty` with one in memory (block number, recorded, found). For tests:
/// a recovery adopts what the states say.
#[cfg(test)]
pub fn states_that_lie() -> Vec<(usize, u8, String)> {
    let states = STATES.load(Ordering::Acquire);
    if states.is_null() {
        return Vec::new();
    }
    let len = STATES_LEN.load(Ordering::Relaxed);
    // SAFETY: as in `mark`.
    let states = unsafe { std::slice::from_raw_parts(states.cast_const(), len) };
    let found = block_residency(STATES_BASE.load(Ordering::Relaxed), len);
    states
        .iter()
        .zip(found)
        .enumerate()
        .filter_map(|(b, (s, found))| {
            let s = s.load(Ordering::Acquire);
            let lie = (s == BlockState::Filled as u8 && found != Resident::All)
                || (s == BlockState::Empty as u8 && found != Resident::None);
            lie.then(|| (b, s, format!("{found:?}")))
        })
        .collect()
}

/// The span of address space one page-table page maps (x86-64 and arm64 with 4 KiB pages).
const PAGE_TABLE_SPAN: usize = 2 << 20;

/// Gives this process the page tables over the recovered store's segments (blocks `in_use`
/// from `base`): one read of a page of each 2 MiB that holds a segment.
///
/// Why: the segments are in memory (`SHM_LOCK`), but a process that has just attached the
/// region has no page tables over them, and the first touch of each 2 MiB allocates one.
/// Once the device serves, that first touch is a queue thread's read, or the linking of the
/// old daemon's holes under the arena's lock, and with memory exhausted the allocation sits
/// in reclaim that only this device's swap writes can satisfy: `uzram-holes` in `pte_alloc_one` with the lock held, the queue threads waiting for
/// it, and the hog and kswapd waiting for bios that never completed. Here, before the
/// device serves, the room the old daemon kept for its successor is free. (Adopted free
/// blocks got theirs when their free-list links were written.)
fn map_page_tables(base: usize, in_use: &[bool]) {
    let mut mapped = usize::MAX;
    for (b, _) in in_use.iter().enumerate().filter(|(_, &u)| u) {
        let block = base + b * BLOCK;
        if block / PAGE_TABLE_SPAN != mapped {
            mapped = block / PAGE_TABLE_SPAN;
            // SAFETY: a block of our mapping that holds an arena segment: mapped, readable
            // and in memory; a read changes nothing.
            unsafe { ptr::read_volatile(block as *const u8) };
        }
    }
}

/// Gives the pages of `len` bytes of blocks at `start` back to the system; they read as
/// zeros afterwards.
fn punch(start: usize, len: usize) -> std::io::Result<()> {
    // SAFETY: whole blocks of our own shared mapping that nobody references (callers pass
    // free blocks only); the mapping stays.
    unsafe { crate::sys::memory::give_back(start, len) }
}

/// Maps `bytes` of anonymous shared memory and serves blocks from it: for tests that have no
/// store region.
#[cfg(test)]
pub fn reserve(bytes: usize) -> std::io::Result<()> {
    let len = bytes.div_ceil(BLOCK).max(1) * BLOCK;
    let base = crate::sys::memory::map_shared_anonymous(len, true)?;
    init(base, len, None);
    Ok(())
}

/// Touches every page of `block` (faulting it in; mlockall locks it) and frees it into the pool.
///
/// # Safety
/// `block` must be a block of the reservation that nobody uses: never handed out, or given
/// back by `trim`.
unsafe fn commit(block: usize) {
    mark(block, BlockState::Changing);
    // One call per block instead of a fault per page: a fifth to a third less of the keeper's
    // CPU per block (docs/bench/gpu-runs.md).
    if POPULATE.load(Ordering::Relaxed) {
        let populated = crate::sys::memory::populate_write(block, BLOCK);
        if populated.is_ok() {
            mark(block, BlockState::Filled);
            // SAFETY: as below.
            unsafe { push(block as *mut u8) };
            return;
        }
        if populated.is_err_and(|e| e.raw_os_error() == Some(libc::EINVAL)) {
            POPULATE.store(false, Ordering::Relaxed);
        }
    }
    for page in (block..block + BLOCK).step_by(4096) {
        // SAFETY: `page` lies in the caller's unused block of our read-write mapping; the
        // write faults the page in.
        unsafe { ptr::write_volatile(page as *mut u8, 0) };
    }
    mark(block, BlockState::Filled);
    // SAFETY: the block is mapped read-write and unused (the caller's contract).
    unsafe { push(block as *mut u8) };
}

/// Commits up to `blocks` more blocks (populated; locked under mlockall) and frees them into
/// the pool: blocks given back by `trim` first, then never-used ones. Returns how many were
/// added (0 when the reservation is used up). The keeper and the fillers run it at once:
/// each block is claimed by one of them before its pages are faulted in.
pub fn refill(blocks: usize) -> usize {
    if BASE.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let mut added = 0;
    while added < blocks {
        // One at a time, and faulted in outside the lock, so that fillers share the work.
        let block = RELEASED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let Some(block) = block else { break };
        // SAFETY: `trim` gave this block back and it was taken off the list above; nobody
        // holds it.
        unsafe { commit(block) };
        added += 1;
    }
    let want = blocks - added;
    let limit = LIMIT.load(Ordering::Acquire);
    let take = |frontier: usize| want.min(limit.saturating_sub(frontier) / BLOCK);
    let Ok(start) = FRONTIER.fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
        let n = take(f);
        (n > 0).then_some(f + n * BLOCK)
    }) else {
        return added;
    };
    let n = take(start);
    // Each block goes to the pool as soon as its pages are in: under pressure a page can take
    // long to come, and a queue thread waiting for one block must not wait for all n.
    for i in 0..n {
        // SAFETY: the block lies in the range this call moved the frontier over, in our
        // mapping, and was never handed out (the frontier only moves forward, and each range
        // is claimed by one caller).
        unsafe { commit(start + i * BLOCK) };
    }
    registration::register_ready();
    added + n
}

/// Refills the pool until it holds `target` free blocks; `false` when the reservation or the
/// system ran out first.
pub fn fill_to(target: usize) -> bool {
    loop {
        // One reading of the count: another thread's free between two readings could make
        // the second larger than `target` (a wrapped, huge refill) or equal to it (a refill
        // of none, taken for a failure).
        let missing = target.saturating_sub(free_blocks());
        if missing == 0 {
            return true;
        }
        if refill(missing) == 0 {
            return false;
        }
    }
}

/// Gives up to `blocks` free blocks back to the system: each is taken off the free list and
/// its pages are punched out of the shared memory. Returns how many went back.
pub fn trim(blocks: usize) -> usize {
    if BASE.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let mut released = RELEASED.lock().unwrap_or_else(PoisonError::into_inner);
    let mut done = 0;
    while done < blocks {
        // Room to remember the block before its pages go: a punched block pushed back onto
        // the free list would fault its pages in on the I/O path that takes it next.
        if released.try_reserve(1).is_err() {
            break;
        }
        let block = pop();
        if block.is_null() {
            break;
        }
        if registration::covers(block as usize) {
            // The device keeps its pages: never punched out.
            // SAFETY: the block was just taken off the free list, whole and unused.
            unsafe { push(block) };
            break;
        }
        mark(block as usize, BlockState::Changing);
        let rc = punch(block as usize, BLOCK);
        if let Err(err) = rc {
            tracing::warn!(error = %err, "giving a pool block back failed");
            // Left `Changing`: a recovery that finds it free punches it again.
            // SAFETY: the block is still mapped, whole and unused: back on the free list.
            unsafe { push(block) };
            break;
        }
        mark(block as usize, BlockState::Empty);
        released.push(block as usize);
        done += 1;
    }
    RELEASED_TOTAL.fetch_add(done, Ordering::Relaxed);
    done
}

/// Blocks given back to the system so far (cumulative).
pub fn released_blocks() -> usize {
    RELEASED_TOTAL.load(Ordering::Relaxed)
}

/// Free blocks in the pool.
pub fn free_blocks() -> usize {
    FREE_COUNT.load(Ordering::Relaxed)
}

/// Pool size to keep for a device of `size` bytes on a machine of `ram` bytes (MemTotal):
/// a quarter of the device, at most 64 MiB and at most a sixteenth of the RAM, in blocks.
/// (The blocks are taken as the store grows, but the free ones are memory held up front.
/// A larger pool was tried and left the guest's swap test too little RAM: the swap device
/// filled up. In a 449 MiB guest 64 MiB was a seventh of its memory, and under a hog of
/// twice its available memory the pool never ran below 929 of its 1024 blocks
/// (docs/bench/swap-tuning.md); the keeper still raises the target when it runs low.)
pub fn target_blocks(size: u64, ram: u64) -> usize {
    let bytes = usize::try_from((size / 4).min(ram / 16))
        .unwrap_or(usize::MAX)
        .min(64 << 20);
    bytes.div_ceil(BLOCK).max(REFILL_BLOCKS)
}

/// This machine's MemTotal in bytes (the config's `ram`), or `u64::MAX` where
/// `/proc/meminfo` cannot be read (then only the device's size bounds the pool).
pub fn ram_bytes() -> u64 {
    crate::config::Host::current().map_or(u64::MAX, |host| host.ram_mib << 20)
}

/// Keeps the pool at `target` free blocks, forever (on its own thread, an I/O flusher like
/// every daemon thread: see the module docs).
///
/// The pool is topped up whenever it is below target. When it nevertheless ran low (a quarter
/// or less), swap-out outpaced the refills, so the target grows by half, up to
/// `MAX_GROWTH` times the initial one. While [`set_give_back`] allows it, the target is back
/// to the initial one, and free blocks beyond it by more than `TRIM_SLACK` are the store's
/// freed memory: they go back to the system ([`trim`]). Nothing is faulted in while
/// [`hold_refills`] holds.
pub fn keep(initial_target: usize) {
    crate::sys::raise_io_thread_priority("pool keeper");
    let _ = KEEPER.set(std::thread::current());
    TARGET.store(initial_target, Ordering::Relaxed);
    let mut target = initial_target;
    let mut low_at = Instant::now();
    // From zero: damage found before the keeper started (a takeover's adoption) is logged too.
    let mut damaged = 0;
    loop {
        let now = damaged_lists();
        if now != damaged {
            damaged = now;
            tracing::error!(
                damaged,
                "the block pool's free list named a place that is no free block, or a block was freed while free (something wrote into freed memory, or freed it twice): what the list held was dropped and the pool is refilled; please report this with the daemon's log"
            );
        }
        if !REFILLS_ALLOWED.load(Ordering::Acquire) {
            std::thread::park_timeout(Duration::from_millis(5));
            continue;
        }
        let give_back = GIVE_BACK.load(Ordering::Relaxed);
        if free_blocks() <= target / 4 {
            low_at = Instant::now();
            let grown = next_target(target, initial_target);
            if grown > target {
                tracing::info!(from = target, to = grown, "pool ran low: target raised");
                target = grown;
            }
        } else if target > initial_target && give_back && low_at.elapsed() >= Duration::from_secs(1)
        {
            tracing::info!(
                from = target,
                to = initial_target,
                "pool quiet: target back to its start"
            );
            target = initial_target;
        }
        TARGET.store(target, Ordering::Relaxed);
        if free_blocks() < target / 2 {
            wake_fillers();
        }
        loop {
            // Fillers add blocks meanwhile: the deficit is read once per turn.
            let deficit = target.saturating_sub(free_blocks());
            if deficit == 0 || refill(REFILL_BLOCKS.min(deficit)) == 0 {
                break;
            }
        }
        // After the first fill, not before: starting threads (stacks that mlockall faults
        // in) under memory pressure must not delay the blocks a starting daemon needs.
        FILLERS.get_or_init(|| start_fillers(filler_count()));
        let excess = free_blocks().saturating_sub(target);
        if excess > TRIM_SLACK && give_back {
            let n = trim(excess);
            tracing::debug!(blocks = n, "pool: free blocks given back");
        }
        std::thread::park_timeout(Duration::from_millis(5));
    }
}

/// Fillers for this machine: one per four CPUs beyond the first four, at most two.
///
/// Why: one keeper faults blocks in at about 2.3 GB/s of blocks per CPU-second (shared
/// memory pages cleared and charged one by one), and a GPU swap-out burst into a fresh device
/// grows the store at about 6 GB/s: the burst ran at the keeper's pace, with thousands of
/// segments waiting for a block. Measured on 16 CPUs (docs/bench/gpu-runs.md), 0, 1,
/// 2 and 3 fillers ran a cold GPU burst at 5.0, 7.6, 8.8 and 10.1 GB/s, but each filler
/// makes every fault dearer (the faults contend in the kernel): the process's CPU per GiB
/// went 0.69, 0.68, 0.72, 0.75. Two is the knee. A small machine (the 2-CPU guest) keeps
/// the single keeper.
fn filler_count() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus.saturating_sub(4) / 4).min(2)
}

/// Starts `n` fillers; those that cannot be started are left out (the keeper fills alone).
fn start_fillers(n: usize) -> Vec<std::thread::Thread> {
    (0..n)
        .filter_map(|i| {
            std::thread::Builder::new()
                .name(format!("uzram-pool-fill-{i}"))
                // Locked whole by mlockall, like every daemon thread's: small, with room
                // for a warning's formatting.
                .stack_size(128 << 10)
                .spawn(fill)
                .map_err(|err| tracing::warn!(error = %err, "starting a pool filler failed"))
                .ok()
                .map(|h| h.thread().clone())
        })
        .collect()
}

/// A filler: woken by the keeper (or by a take that found the pool empty), it refills until
/// the pool reaches the keeper's target, a few blocks at a time so that the fillers and
/// the keeper share the deficit. It sleeps otherwise: small top-ups are the keeper's alone.
fn fill() {
    crate::sys::raise_io_thread_priority("pool filler");
    loop {
        // An unpark before this park is not lost: it returns at once.
        std::thread::park();
        while free_blocks() < TARGET.load(Ordering::Relaxed) {
            if refill(FILL_STEP) == 0 {
                break;
            }
        }
    }
}

/// Blocks a filler commits per turn (512 KiB).
const FILL_STEP: usize = 8;

/// Wakes the fillers.
fn wake_fillers() {
    for filler in FILLERS.get().into_iter().flatten() {
        filler.unpark();
    }
}

/// Free blocks the pool may hold beyond its target before it gives them back.
const TRIM_SLACK: usize = 16;

/// How many times the initial target the keeper may grow the pool to.
const MAX_GROWTH: usize = 4;

/// The target after the pool ran low: half as much again, at most `MAX_GROWTH` x initial.
fn next_target(target: usize, initial: usize) -> usize {
    (target + target / 2)
        .min(initial.saturating_mul(MAX_GROWTH))
        .max(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests' one reservation (the pool is set up once per process), and a lock that runs
    /// them one at a time: each counts or empties the free list.
    fn test_pool() -> std::sync::MutexGuard<'static, ()> {
        static ONCE: std::sync::Once = std::sync::Once::new();
        static SERIAL: Mutex<()> = Mutex::new(());
        ONCE.call_once(|| reserve(256 * BLOCK).unwrap());
        SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Empties the free list (other tests may give blocks back meanwhile).
    fn take_every_free_block() -> Vec<usize> {
        std::iter::from_fn(|| Some(pop()).filter(|p| !p.is_null()))
            .map(|p| p as usize)
            .collect()
    }

    #[test]
    fn a_take_from_an_empty_pool_waits_for_the_next_free_block() {
        let _serial = test_pool();
        // Empty the pool (other tests may give blocks back meanwhile: the take then returns
        // sooner, and the assertions still hold).
        let mut held = take_every_free_block();
        if held.is_empty() {
            assert_eq!(refill(1), 1);
            held.push(pop() as usize);
        }
        let (waits, _) = take_waits();
        let give = held.pop().unwrap();
        let giver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: a free pool block this test took off the list and nobody else uses.
            unsafe { push(give as *mut u8) };
        });
        let p = take_within(Duration::from_secs(5));
        assert!(
            !p.is_null(),
            "no block within 5 s though one was freed after 30 ms"
        );
        assert!(
            take_waits().0 > waits,
            "an empty pool's take did not count a wait"
        );
        giver.join().unwrap();
        // SAFETY: `p` and the held blocks are free pool blocks nobody else uses.
        unsafe { push(p) };
        for b in held {
            // SAFETY: as above.
            unsafe { push(b as *mut u8) };
        }
    }

    /// While a takeover holds the guard, a take from the empty pool returns at once: no
    /// keeper refills it then, and each wait would be a page's worth of a paused device.
    #[test]
    fn a_take_without_waiting_returns_at_once_from_an_empty_pool() {
        let _serial = test_pool();
        let held = take_every_free_block();
        let started = Instant::now();
        let p = {
            let _no_waits = takes_without_waiting();
            take_within(Duration::from_secs(5))
        };
        let took = started.elapsed();
        if !p.is_null() {
            // Another test gave a block back meanwhile.
            // SAFETY: a free pool block nobody else uses.
            unsafe { push(p) };
        }
        assert!(took < Duration::from_secs(1), "a take waited {took:?}");
        for b in held {
            // SAFETY: free pool blocks this test took and nobody else uses.
            unsafe { push(b as *mut u8) };
        }
    }

    #[test]
    fn blocks_refilled_by_several_threads_at_once_are_each_handed_out_once() {
        let _serial = test_pool();
        // Take every free block; give some back to the system, so that the refills below
        // take given-back blocks as well as new ones (while the reservation lasts).
        let mut held = take_every_free_block();
        // Given back straight from the blocks held here (not through the free list, where
        // other tests' allocations could take them meanwhile).
        let given = held.len().min(16);
        for b in held.drain(..given) {
            punch(b, BLOCK).unwrap();
            RELEASED.lock().unwrap().push(b);
        }
        let released = RELEASED.lock().unwrap().len();
        let left = (LIMIT.load(Ordering::Acquire) - FRONTIER.load(Ordering::Acquire)) / BLOCK;
        let added: usize = std::thread::scope(|s| {
            let refills: Vec<_> = (0..4).map(|_| s.spawn(|| refill(6))).collect();
            refills.into_iter().map(|r| r.join().unwrap()).sum()
        });
        // Nothing else refills in this process, so the four calls took exactly this many:
        // the given-back blocks first, then new ones while the reservation lasted.
        assert_eq!(
            added,
            (released + left).min(24),
            "{given} given back, {left} new left"
        );
        let mut got = Vec::new();
        while got.len() < added {
            // Other tests borrow blocks through the global allocator meanwhile, so a few may
            // be missing here; none may come twice.
            let p = pop();
            if p.is_null() {
                break;
            }
            got.push(p as usize);
        }
        let mut all: Vec<usize> = got.iter().chain(&held).copied().collect();
        all.sort_unstable();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n, "a block was handed out twice");
        let base = BASE.load(Ordering::Acquire);
        assert!(all
            .iter()
            .all(|&b| owns(b as *mut u8) && (b - base).is_multiple_of(BLOCK)));
        for b in got.into_iter().chain(held) {
            // SAFETY: free pool blocks this test took off the list and nobody else uses.
            unsafe { push(b as *mut u8) };
        }
    }

    #[test]
    fn pool_serves_and_takes_back_blocks() {
        // The test binary's global allocator is PoolAlloc too, so other tests may borrow
        // blocks concurrently; every assertion below holds regardless.
        let _serial = test_pool();
        assert_eq!(refill(8), 8);
        let layout = Layout::from_size_align(BLOCK, 4096).unwrap();
        // SAFETY: a valid non-zero layout; the block is freed with the same layout below.
        let p = unsafe { PoolAlloc.alloc(layout) };
        assert!(
            owns(p),
            "a 64 KiB allocation did not come from a non-empty pool"
        );
        assert_eq!(p as usize % 4096, 0);
        // SAFETY: `p` is a BLOCK-byte block we own.
        unsafe { ptr::write_bytes(p, 0xAA, BLOCK) };
        // SAFETY: allocated above with this layout.
        unsafe { PoolAlloc.dealloc(p, layout) };
        // Reused blocks are dirty; zeroed allocations must still be zero.
        // SAFETY: as above.
        let z = unsafe { PoolAlloc.alloc_zeroed(layout) };
        // SAFETY: `z` points to BLOCK readable bytes we own.
        let bytes = unsafe { std::slice::from_raw_parts(z, BLOCK) };
        assert!(bytes.iter().all(|b| *b == 0));
        // SAFETY: allocated above with this layout.
        unsafe { PoolAlloc.dealloc(z, layout) };
        // Free blocks go back to the system and read as zeros when they are refilled,
        // which reuses them before new ones.
        let frontier = FRONTIER.load(Ordering::Acquire);
        let before = released_blocks();
        let given = trim(2);
        assert!(given <= 2);
        assert_eq!(released_blocks(), before + given);
        let punched: Vec<usize> = RELEASED.lock().unwrap().clone();
        for &b in &punched {
            // SAFETY: a released block: mapped, and used by no one until `refill` below.
            let bytes = unsafe { std::slice::from_raw_parts(b as *const u8, BLOCK) };
            assert!(
                bytes.iter().all(|x| *x == 0),
                "a given-back block kept its bytes"
            );
        }
        assert_eq!(refill(given), given);
        assert_eq!(
            FRONTIER.load(Ordering::Acquire),
            frontier,
            "refill took new blocks"
        );
        // Refilling stops at the end of the reservation.
        let left = (LIMIT.load(Ordering::Acquire) - FRONTIER.load(Ordering::Acquire)) / BLOCK;
        let mut added = 0;
        loop {
            let n = refill(4);
            if n == 0 {
                break;
            }
            added += n;
        }
        assert_eq!(added, left);
        // Other sizes never come from the pool.
        let small = Layout::from_size_align(BLOCK / 2, 8).unwrap();
        // SAFETY: valid layout, freed right away with it.
        let q = unsafe { PoolAlloc.alloc(small) };
        assert!(!owns(q));
        // SAFETY: allocated above with this layout.
        unsafe { PoolAlloc.dealloc(q, small) };
        assert_eq!(next_target(1024, 1024), 1536);
        assert_eq!(next_target(3072, 1024), 4096);
        assert_eq!(next_target(4096, 1024), 4096);
        assert_eq!(target_blocks(8 << 30, 8 << 30), 1024);
        assert_eq!(target_blocks(8 << 30, u64::MAX), 1024);
        assert_eq!(target_blocks(1 << 20, 8 << 30), REFILL_BLOCKS);
        // A small machine: a sixteenth of its RAM, not a quarter of the device.
        assert_eq!(target_blocks(1 << 30, 448 << 20), 448);
        assert_eq!(target_blocks(64 << 20, 448 << 20), 256);
        assert_eq!(target_blocks(1 << 30, 32 << 20), REFILL_BLOCKS);
        assert!(ram_bytes() > 64 << 20);

        // An I/O-serving thread's 64 KiB allocation from an empty pool is served by the
        // system allocator, and counted: never null, which Rust turns into an abort for any
        // allocation it cannot fail (a vector growing through 64 KiB).
        let mut taken = Vec::new();
        loop {
            // SAFETY: valid layout; every block is freed below with it.
            let b = unsafe { PoolAlloc.alloc(layout) };
            if !owns(b) {
                // SAFETY: not a pool block: freed with the layout it was allocated with.
                unsafe { PoolAlloc.dealloc(b, layout) };
                break;
            }
            taken.push(b);
        }
        let before = fallen_back_blocks();
        let (raw, grown) = std::thread::spawn(move || {
            strict_current_thread();
            // SAFETY: valid layout; a non-null result is freed right away.
            let b = unsafe { PoolAlloc.alloc(layout) };
            let got = b as usize;
            if !b.is_null() {
                // SAFETY: allocated above with this layout.
                unsafe { PoolAlloc.dealloc(b, layout) };
            }
            let mut v: Vec<u64> = Vec::new();
            v.extend(0..(BLOCK / 8) as u64);
            (got, v.len())
        })
        .join()
        .unwrap();
        assert_ne!(raw, 0, "an I/O thread got null from an empty pool");
        assert_eq!(grown, BLOCK / 8);
        // Another test may have returned a block meanwhile; then the thread got it.
        if !owns(raw as *mut u8) {
            assert!(
                fallen_back_blocks() > before,
                "the fallback was not counted"
            );
        }
        for b in taken {
            // SAFETY: pool blocks taken above with this layout.
            unsafe { PoolAlloc.dealloc(b, layout) };
        }
    }

    /// Whether `addr`'s page is mapped in this process's page tables (`/proc/self/pagemap`).
    fn mapped_here(addr: usize) -> bool {
        use std::os::unix::fs::FileExt;
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut entry = [0u8; 8];
        pagemap
            .read_exact_at(&mut entry, (addr / 4096 * 8) as u64)
            .unwrap();
        u64::from_le_bytes(entry) >> 63 == 1
    }

    /// Set in the processes that tests of a pool set up from scratch start for themselves.
    const FRESH_PROCESS: &str = "UZRAM_POOL_TEST_FRESH_PROCESS";

    /// Whether this is the process of its own that test `name` runs in (the pool is set up
    /// once per process). If not, runs the test in one, checks that it passed, and returns
    /// false.
    fn in_a_fresh_process(name: &str) -> bool {
        if std::env::var_os(FRESH_PROCESS).is_some() {
            return true;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1", "--nocapture"])
            .env(FRESH_PROCESS, "1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name} in a fresh process failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        false
    }

    /// The pool's memory registered with a device as it is faulted in, in whole runs, each
    /// once, and never punched out afterwards. In a process of its own: registering is for
    /// the life of the process.
    #[test]
    fn registered_memory_grows_with_the_pool_and_is_never_given_back() {
        if !in_a_fresh_process(
            "memory::pool::tests::registered_memory_grows_with_the_pool_and_is_never_given_back",
        ) {
            return;
        }
        // No pool: nothing to register.
        assert!(!register_with(|_, _| true));
        reserve(256 * BLOCK).unwrap();
        let base = BASE.load(Ordering::Acquire);
        assert!(fill_to(40));
        let runs = std::sync::Arc::new(Mutex::new(Vec::new()));
        let seen = runs.clone();
        assert!(register_with(move |at, len| {
            seen.lock().unwrap().push((at, len));
            true
        }));
        // What the pool had faulted in, in whole 2 MiB runs from its start, once each.
        let first = runs.lock().unwrap().clone();
        let run = 32 * BLOCK;
        assert!(!first.is_empty());
        for (i, &(at, len)) in first.iter().enumerate() {
            assert_eq!((at, len), (base + i * run, run));
        }
        let end = base + first.len() * run;
        assert!(registered(base, BLOCK) && registered(end - BLOCK, BLOCK));
        assert!(!registered(end, BLOCK) && !registered(end - 8, 16));
        assert!(!registered(base - BLOCK, BLOCK));
        // A refill registers the runs it completes.
        assert!(refill(96) > 0);
        assert!(runs.lock().unwrap().len() > first.len());
        assert_eq!(
            runs.lock().unwrap()[first.len()],
            (end, run),
            "the next run, once"
        );
        // Registered blocks stay: trim gives back only what lies past them, and stops at
        // the first registered one.
        let free = free_blocks();
        let given = trim(free);
        assert!(given < free, "trim gave back all {free} free blocks");
        assert!(
            RELEASED
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .all(|&b| !registered(b, BLOCK)),
            "a registered block was punched out"
        );
    }

    /// `init_with` hands adopted blocks out while it still sorts the rest of the region: a
    /// 64 KiB buffer taken then (its own list of given-back blocks growing to one, past 4096
    /// of them) must go back to the pool when freed (past 8192), never to glibc's `free`,
    /// which aborts on a pointer into the region or takes it for a chunk of its own. In a
    /// process of its own: the pool is set up once per process, here never before.
    #[test]
    fn a_block_taken_while_the_pool_is_set_up_goes_back_to_the_pool() {
        if !in_a_fresh_process(
            "memory::pool::tests::a_block_taken_while_the_pool_is_set_up_goes_back_to_the_pool",
        ) {
            return;
        }
        // The old daemon's region: blocks recorded empty below two recorded full ones at
        // the top, which are adopted first (the walk goes down), before the empty ones fill
        // the list of blocks given back.
        let empty = 8192 + 16;
        let blocks = empty + 2;
        let base = crate::sys::memory::map_shared_anonymous(blocks * BLOCK, true).unwrap();
        let states: &'static [AtomicU8] = Box::leak(
            (0..blocks)
                .map(|b| {
                    let s = if b >= empty {
                        BlockState::Filled
                    } else {
                        BlockState::Empty
                    };
                    AtomicU8::new(s as u8)
                })
                .collect(),
        );
        assert_eq!(init_with(base, blocks * BLOCK, &[], Some(states)), 2);
        // Whatever the set-up took of its two blocks it gave back.
        assert_eq!(free_blocks(), 2, "a block taken during the set-up was lost");
        assert_eq!(
            RELEASED
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len(),
            empty
        );
    }

    /// Sets up the pool over 16 blocks of shared memory, fills a few and takes one: the block
    /// taken. Once per process.
    fn a_pool_of_16_blocks_one_taken() -> *mut u8 {
        let blocks = 16;
        let base = crate::sys::memory::map_shared_anonymous(blocks * BLOCK, true).unwrap();
        init(base, blocks * BLOCK, None);
        assert!(refill(4) >= 3);
        let taken = pop();
        assert!(is_block(taken));
        taken
    }

    /// A free block written into (its link overwritten, here with a heap address, as a
    /// stale 64 KiB buffer's owner might) never makes the pool hand out what the link
    /// names: the list is dropped and counted, and the pool works again once refilled; a
    /// pointer into the range that starts no block is not listed. In a process of its own:
    /// the pool is set up once per process.
    #[test]
    fn a_damaged_free_list_is_dropped_and_never_hands_out_what_it_names() {
        if !in_a_fresh_process(
            "memory::pool::tests::a_damaged_free_list_is_dropped_and_never_hands_out_what_it_names",
        ) {
            return;
        }
        let taken = a_pool_of_16_blocks_one_taken();
        let heap = Box::into_raw(Box::new([0u64; 4]));
        let head = FREE_HEAD.load(Ordering::Relaxed);
        assert!(is_block(head));
        // SAFETY: `head` is a free block of the pool, mapped and writable: the damage.
        unsafe { head.cast::<*mut u8>().write(heap.cast()) };
        assert!(pop().is_null(), "a damaged list handed out a block");
        assert_eq!(damaged_lists(), 1);
        assert_eq!(free_blocks(), 0);
        assert!(pop().is_null(), "the heap address was handed out");
        // Refilled, the pool serves again (the dropped blocks are not reused).
        assert!(refill(2) > 0);
        let again = pop();
        assert!(is_block(again) && again != head && again != taken);
        // SAFETY: an address 8 bytes into a block this test holds: not a block.
        unsafe { push(again.add(8)) };
        assert_eq!(damaged_lists(), 2);
        // SAFETY: the test's own blocks and box, back to their owners.
        unsafe {
            push(again);
            push(taken);
            drop(Box::from_raw(heap));
        }
        assert!(is_block(pop()));
    }

    /// A free block's link overwritten with another block's start, one in use, never makes
    /// the pool hand that block out a second time: the list is dropped and counted. A block
    /// freed again while it is free is listed once. A link that skips ahead is found at the
    /// list's end, where its count is not zero. In a process of its own: the pool is set up
    /// once per process.
    #[test]
    fn a_link_that_names_a_block_in_use_or_a_block_freed_twice_is_never_handed_out() {
        if !in_a_fresh_process(
            "memory::pool::tests::a_link_that_names_a_block_in_use_or_a_block_freed_twice_is_never_handed_out",
        ) {
            return;
        }
        let taken = a_pool_of_16_blocks_one_taken();
        let head = FREE_HEAD.load(Ordering::Relaxed);
        assert!(is_block(head) && head != taken);
        // SAFETY: `head` is a free block of the pool, mapped and writable: the damage, a
        // link to the block this test holds.
        unsafe { head.cast::<*mut u8>().write(taken) };
        assert!(pop().is_null(), "a damaged list handed out a block");
        assert_eq!(damaged_lists(), 1);
        assert_eq!(free_blocks(), 0);
        assert!(pop().is_null(), "the block in use was handed out again");
        // Refilled, the pool serves again; a block freed twice is listed once.
        assert!(refill(2) > 0);
        let again = pop();
        assert!(is_block(again) && again != taken);
        let free = free_blocks();
        // SAFETY: the test's own block, back to the pool, then (the bug this guards
        // against) once more.
        unsafe {
            push(again);
            push(again);
        }
        assert_eq!(damaged_lists(), 2);
        assert_eq!(free_blocks(), free + 1);
        let mut handed = Vec::new();
        loop {
            let p = pop();
            if p.is_null() {
                break;
            }
            handed.push(p as usize);
        }
        let n = handed.len();
        handed.sort_unstable();
        handed.dedup();
        assert_eq!(handed.len(), n, "a block was handed out twice");
        assert_eq!(damaged_lists(), 2);
        // A link that skips ahead to a block further down: the block it skips is lost, and
        // the count at the list's end says so (the keeper then refills).
        for &b in &handed {
            // SAFETY: blocks this test holds, back to the pool.
            unsafe { push(b as *mut u8) };
        }
        refill(4);
        let listed = free_blocks();
        assert!(listed >= 3, "{listed} blocks");
        let head = FREE_HEAD.load(Ordering::Relaxed);
        // SAFETY: the first two blocks of the list are free pool blocks, mapped and
        // writable: the second's link read, and written over the first's (the damage).
        unsafe {
            let third = head.cast::<*mut u8>().read().cast::<*mut u8>().read();
            head.cast::<*mut u8>().write(third);
        }
        let mut popped = 0;
        while !pop().is_null() {
            popped += 1;
        }
        assert_eq!(popped, listed - 1);
        assert_eq!(damaged_lists(), 3);
        assert_eq!(free_blocks(), 0);
        // SAFETY: the test's own block, back to its owner.
        unsafe { push(taken) };
        assert_eq!(pop(), taken);
    }

    #[test]
    fn a_recovered_store_gets_page_tables_over_each_2_mib_that_holds_a_segment() {
        // 8 MiB of shared memory, 2 MiB aligned: four page tables' worth of blocks.
        let span = 4 * PAGE_TABLE_SPAN;
        let raw = crate::sys::memory::map_shared_anonymous(span + PAGE_TABLE_SPAN, false).unwrap();
        let base = raw.next_multiple_of(PAGE_TABLE_SPAN);
        // In memory but not mapped here: what a new daemon finds of the old one's segments.
        // SAFETY: writes within our own new mapping, then unmapping its pages from this
        // process (shared memory keeps them).
        unsafe {
            ptr::write_bytes(base as *mut u8, 0x5A, span);
            crate::sys::memory::discard(base, span).unwrap();
        }
        let blocks = span / BLOCK;
        let per_table = PAGE_TABLE_SPAN / BLOCK;
        assert!(!mapped_here(base + 3 * BLOCK));
        let mut in_use = vec![false; blocks];
        // Segments in the first and third 2 MiB only.
        for b in [3, 5, 2 * per_table + 6] {
            in_use[b] = true;
        }
        map_page_tables(base, &in_use);
        assert!(
            mapped_here(base + 3 * BLOCK),
            "the first segment is not mapped"
        );
        assert!(
            mapped_here(base + (2 * per_table + 6) * BLOCK),
            "the third 2 MiB's segment is not mapped"
        );
        for page in (0..span).step_by(4096) {
            let table = page / PAGE_TABLE_SPAN;
            if table == 1 || table == 3 {
                assert!(
                    !mapped_here(base + page),
                    "page {page:#x} was mapped though no segment lies in its 2 MiB"
                );
            }
        }
        // The data stayed.
        // SAFETY: a page of our mapping.
        let kept = unsafe { ptr::read_volatile((base + 5 * BLOCK) as *const u8) };
        assert_eq!(kept, 0x5A);
        // SAFETY: unmapping the whole mapping made above.
        unsafe { crate::sys::memory::unmap(raw, span + PAGE_TABLE_SPAN) }.unwrap();
    }
}

//! [`Ring::write_from`]: writes whose bytes a [`PageSource`] copies straight into the slots
//! (ublk's user copy), against [`HostSlots`], with the same outcome as [`Ring::write`].

use std::io;
use std::time::Duration;

use super::tests::{
    assert_nothing_left_to_give_back, assert_reads, host, pages, patient, ring_with, write_all,
};
use super::*;
use crate::batch::{BytesSource, FaultPlan, LeasedWords};
use crate::codec::Algorithm;
use crate::store::StoreConfig;

/// Writes `data` in 16-page requests through a [`BytesSource`], as a queue thread with user
/// copy does.
fn write_all_from(ring: &Ring, first: u64, data: &[u8]) {
    let mut bounce = vec![0u8; 16 * PAGE_SIZE];
    for (i, req) in data.chunks(16 * PAGE_SIZE).enumerate() {
        let pages = req.len() / PAGE_SIZE;
        ring.write_from(
            first + 16 * i as u64,
            pages,
            &mut BytesSource(req),
            &mut bounce,
        )
        .unwrap();
    }
}

#[test]
fn pages_copied_in_by_their_source_round_trip_as_written_ones_do() {
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let (store, ring) = ring_with(n, host(4, 64, FaultPlan::default()), patient());
    write_all_from(&ring, 0, &data);
    ring.flush();
    let s = ring.stats();
    // Same-filled pages are found in the slot: stored as such, never installed.
    assert!(s.same_filled_pages > 0, "{s:?}");
    assert_eq!(s.staged_pages + s.same_filled_pages, n, "{s:?}");
    assert_eq!(s.installed_pages, s.staged_pages, "{s:?}");
    assert_eq!(s.overflow_pages + s.stale_pages + s.cpu_pages, 0, "{s:?}");
    assert!(
        s.spot_checked_pages > 0 && s.spot_check_failures == 0,
        "{s:?}"
    );
    assert!(
        s.checksum_checked_pages > 0 && s.checksum_mismatches == 0,
        "{s:?}"
    );
    assert_reads(&store, &data);
    // Same store as the writer's own copy gives.
    let (copied, ring2) = ring_with(n, host(4, 64, FaultPlan::default()), RingConfig::default());
    write_all(&ring2, 0, &data);
    ring2.flush();
    let (a, b) = (store.stats(), copied.stats());
    assert_eq!(
        (
            a.compr_data_size,
            a.huge_pages,
            a.same_pages,
            a.pages_stored
        ),
        (
            b.compr_data_size,
            b.huge_pages,
            b.same_pages,
            b.pages_stored
        )
    );
    assert_eq!(ring2.stats().same_filled_pages, s.same_filled_pages);
}

#[test]
fn without_a_free_slot_or_backend_the_source_fills_the_bounce_buffer() {
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let none = RingConfig {
        slot_wait: Duration::ZERO,
        ..RingConfig::default()
    };
    let slow = FaultPlan::slow(Duration::from_millis(5));
    let (store, ring) = ring_with(n, host(2, 16, slow), none);
    write_all_from(&ring, 0, &data);
    let s = ring.stats();
    assert!(s.overflow_pages > 0, "{s:?}");
    ring.flush();
    assert_reads(&store, &data);

    // A bounce buffer shorter than the write is refused before anything is stored.
    let mut short = vec![0u8; PAGE_SIZE];
    let err = ring
        .write_from(0, 2, &mut BytesSource(&data[..2 * PAGE_SIZE]), &mut short)
        .unwrap_err();
    assert!(matches!(err, CoreError::Unaligned { .. }), "{err}");
    // Past the device's end.
    let err = ring
        .write_from(
            n - 1,
            2,
            &mut BytesSource(&data[..2 * PAGE_SIZE]),
            &mut vec![0; 2 * PAGE_SIZE],
        )
        .unwrap_err();
    assert!(matches!(err, CoreError::OutOfRange { .. }), "{err}");
}

/// A source that fails on its `fail_at`-th fill, like a kernel refusing the copy.
struct Failing<'a> {
    inner: BytesSource<'a>,
    fills: usize,
    fail_at: usize,
}

impl PageSource for Failing<'_> {
    fn fill_words(&mut self, offset: usize, dst: LeasedWords<'_>) -> io::Result<()> {
        self.fills += 1;
        if self.fills == self.fail_at {
            // Part of the bytes landed before the failure, as a short copy leaves them.
            if let Some(first) = dst.prefix(PAGE_WORDS) {
                self.inner.fill_words(offset, first)?;
            }
            return Err(io::Error::other("the kernel refused the copy"));
        }
        self.inner.fill_words(offset, dst)
    }

    fn fill_bytes(&mut self, offset: usize, bytes: &mut [u8]) -> io::Result<()> {
        self.inner.fill_bytes(offset, bytes)
    }
}

#[test]
fn a_source_that_fails_stages_nothing_of_its_lease_and_the_old_pages_stay() {
    let data = pages();
    let n = data.len() / PAGE_SIZE;
    let (store, ring) = ring_with(
        n as u64,
        host(4, 64, FaultPlan::default()),
        RingConfig::default(),
    );
    let old: Vec<u8> = data.iter().map(|b| b.wrapping_add(1)).collect();
    write_all_from(&ring, 0, &old);
    ring.flush();
    // One 128-page write whose source fails on its second fill (pages 64..128): the first
    // lease's pages are new, the failed lease's stay old, and its error is an EIO.
    let pages = 128.min(n);
    let mut src = Failing {
        inner: BytesSource(&data[..pages * PAGE_SIZE]),
        fills: 0,
        fail_at: 2,
    };
    let mut bounce = vec![0u8; pages * PAGE_SIZE];
    let err = ring
        .write_from(0, pages, &mut src, &mut bounce)
        .unwrap_err();
    assert!(matches!(err, CoreError::Source(_)), "{err}");
    assert_eq!(err.errno(), -5);
    ring.flush();
    let s = ring.stats();
    assert_eq!(s.installed_pages, s.staged_pages, "{s:?}");
    let mut expect = old.clone();
    expect[..64 * PAGE_SIZE].copy_from_slice(&data[..64 * PAGE_SIZE]);
    assert_reads(&store, &expect);
}

#[test]
fn a_store_with_checksums_off_takes_sourced_pages_too() {
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let mut cfg = StoreConfig::new(n, Algorithm::Lz4);
    cfg.checksums = false;
    let store = Arc::new(PageStore::new(cfg).unwrap());
    let ring = Ring::start(
        store.clone(),
        host(4, 64, FaultPlan::default()),
        RingConfig::default(),
    )
    .unwrap();
    write_all_from(&ring, 0, &data);
    ring.flush();
    let s = ring.stats();
    assert_eq!(s.checksum_checked_pages, 0, "{s:?}");
    assert_reads(&store, &data);
}

/// `data` with every other page zeroed (a fill) and the rest XORed with 1: as compressible,
/// but no page the same as before.
fn half_fills(data: &[u8]) -> Vec<u8> {
    data.chunks_exact(PAGE_SIZE)
        .enumerate()
        .flat_map(|(i, p)| p.iter().map(move |&b| if i % 2 == 0 { 0 } else { b ^ 1 }))
        .collect()
}

/// Same-filled pages found in the slot that replace stored ones leave their old objects at
/// their own (empty) indices, for the slot's installer to give back with the staged pages'
/// ones: the writer takes the arena's lock for none of them.
#[test]
fn fills_found_in_the_slot_leave_what_they_replace_to_the_slots_installer() {
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    // The last slot, not full, waits for the flush: what its pages replaced is still kept
    // before it, however late this thread runs.
    let cfg = RingConfig {
        max_delay: Duration::from_secs(60),
        ..patient()
    };
    let (store, ring) = ring_with(n, host(4, 64, FaultPlan::default()), cfg);
    write_all_from(&ring, 0, &data);
    ring.flush();
    let again = half_fills(&data);
    let before = crate::store::arena_locks_taken();
    write_all_from(&ring, 0, &again);
    assert_eq!(crate::store::arena_locks_taken() - before, 0);
    assert!(store.memory().replaced_bytes > 0);
    ring.flush();
    assert_reads(&store, &again);
    let st = store.stats();
    // The zeroed pages, and the odd ones that were fills already.
    assert!(st.same_pages > n / 2, "{st:?}");
    assert_nothing_left_to_give_back(&store);
}

/// Where the writer copies (no user copy), a request's fills that replace stored pages
/// free those under one acquisition of the arena's lock, not one each.
#[test]
fn a_requests_fills_free_what_they_replace_under_one_lock() {
    let data = pages();
    let n = (data.len() / PAGE_SIZE) as u64;
    let (store, ring) = ring_with(n, host(4, 64, FaultPlan::default()), patient());
    write_all(&ring, 0, &data);
    ring.flush();
    let again = half_fills(&data);
    let requests = again.len().div_ceil(16 * PAGE_SIZE) as u64;
    let before = crate::store::arena_locks_taken();
    write_all(&ring, 0, &again);
    let locks = crate::store::arena_locks_taken() - before;
    assert!(
        locks > 0 && locks <= requests,
        "{locks} locks for {requests} requests"
    );
    ring.flush();
    assert_reads(&store, &again);
    assert_eq!(store.memory().replaced_bytes, 0);
}

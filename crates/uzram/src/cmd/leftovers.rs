//! Shared memory no device takes back: a store whose device is gone (or never came to be:
//! its daemon was killed while it started), a GPU staging or nonce floors segment no store
//! records, a recovery record of a device the kernel no longer has. `uzram list` names them and `uzram
//! destroy --all` frees them, so that no kill, at any instant, leaves locked memory behind
//! that no command finds.
//!
//! Only segments that are root's alone, carry a uzram header (or sit on a legacy record key) and
//! that no process has attached are considered: a live daemon keeps its store and staging
//! attached, and a standby keeps its store's recovery room mapped.

use crate::devname::{dev_path, in_kernel};
use crate::shm;
use crate::size::Human;
use crate::takeover::record;
use crate::takeover::{floors_segment, staging_segment, store_segment};

/// One segment no device takes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    /// The segment id.
    pub id: i32,
    /// What it is, for messages.
    pub what: String,
    /// Its size.
    pub bytes: u64,
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Store,
    Staging,
    Floors,
    Record(u32),
}

/// Every segment on the host that no device takes back.
pub fn find() -> Vec<Leftover> {
    let segments = shm::root_only_segments();
    let stores: Vec<(shm::Stat, store_segment::StoreFacts)> = segments
        .iter()
        .filter_map(|s| store_segment::store_facts(s.id).map(|f| (*s, f)))
        .collect();
    let mut found = Vec::new();
    for seg in segments.iter().filter(|s| s.attached == 0) {
        if let Some(device) = record::device_of_segment(seg) {
            if !in_kernel(device) {
                found.push(Leftover {
                    id: seg.id,
                    what: format!(
                        "the recovery record of {}, a device that is gone",
                        dev_path(device)
                    ),
                    bytes: seg.size as u64,
                    kind: Kind::Record(device),
                });
            }
            continue;
        }
        if let Some((_, facts)) = stores.iter().find(|(s, _)| s.id == seg.id) {
            if let Some(why) = store_orphaned(seg.id, facts) {
                found.push(Leftover {
                    id: seg.id,
                    what: format!(
                        "a store of {} pages ({}) {why}",
                        facts.pages,
                        Human(facts.pages * uzram_core::PAGE_SIZE as u64)
                    ),
                    bytes: seg.size as u64,
                    kind: Kind::Store,
                });
            }
            continue;
        }
        let recorded = stores.iter().any(|(_, f)| f.staging == Some(seg.id));
        if !recorded && staging_segment::is_staging(seg.id) {
            found.push(Leftover {
                id: seg.id,
                what: "GPU staging that no store records".into(),
                bytes: seg.size as u64,
                kind: Kind::Staging,
            });
        }
        let recorded = stores.iter().any(|(_, f)| f.floors == Some(seg.id));
        if !recorded && floors_segment::is_floors(seg.id) {
            found.push(Leftover {
                id: seg.id,
                what: "backing device nonce floors that no store records".into(),
                bytes: seg.size as u64,
                kind: Kind::Floors,
            });
        }
    }
    found
}

/// Why no device takes store `id` back, if none does.
fn store_orphaned(id: i32, facts: &store_segment::StoreFacts) -> Option<String> {
    if facts.device == u32::MAX {
        return Some("whose daemon died before its device existed".into());
    }
    let dev = dev_path(facts.device);
    if !in_kernel(facts.device) {
        return Some(format!("of {dev}, a device that is gone"));
    }
    match record::read(facts.device) {
        Some(record) if record.store_shm != Some(id) => Some(format!(
            "of {dev}, which keeps another store (segment {})",
            record.store_shm.map_or("none".into(), |s| s.to_string())
        )),
        _ => None,
    }
}

/// Frees `leftover` (its staging and floors too, for a store).
pub fn free(leftover: &Leftover) {
    match leftover.kind {
        Kind::Store => store_segment::remove(leftover.id),
        Kind::Staging => staging_segment::remove(leftover.id),
        Kind::Floors => floors_segment::remove(leftover.id),
        Kind::Record(device) => record::remove(device),
    }
}

/// The line `uzram list` prints for a leftover.
pub fn describe(leftover: &Leftover) -> String {
    format!(
        "shared memory segment {} ({}, {}) is kept by no device: uzram destroy --all frees it",
        leftover.id,
        leftover.what,
        Human(leftover.bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::footprint::{Sizes, MIN_ROOM};
    use crate::takeover::store_segment::StoreSegment;

    /// One of these tests at a time: [`find`] maps every segment for a moment to read what it
    /// is, and a segment mapped is in use, so one test's scan would hide another's leftover.
    static SCANS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_scan_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        SCANS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[test]
    fn a_store_of_a_device_that_never_came_to_be_is_found_and_freed() {
        let _scans = one_scan_at_a_time();
        // Made as a daemon makes it, for a device id the kernel has not (this host has no
        // ublk at all, or not this id), and not attached by anyone once we let go.
        let sizes = Sizes::of(16, MIN_ROOM).unwrap();
        let Ok(region) = StoreSegment::create(sizes, "lz4", true, (1 << 20) - 3, false) else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        let id = region.id();
        // The region stays mapped by this process: in use, so not a leftover.
        assert!(!find().iter().any(|l| l.id == id));
        // As a killed daemon leaves it: nobody attached. (A second process would have to be
        // killed for real; detaching this one's mapping is what its death does.)
        let base = region.base_for_tests();
        // SAFETY: the region's only mapping, never used again.
        unsafe { crate::shm::detach(base) };
        let left = find();
        let mine = left
            .iter()
            .find(|l| l.id == id)
            .expect("the store is found");
        assert!(mine.what.contains("a device that is gone"), "{mine:?}");
        assert!(describe(mine).contains("uzram destroy --all"));
        free(mine);
        assert!(shm::stat(id).is_err(), "not freed");
    }

    #[test]
    fn floors_no_store_records_are_found_and_freed() {
        let _scans = one_scan_at_a_time();
        let Ok(floors) = floors_segment::FloorsSegment::create(64) else {
            println!("SKIP: no SysV shared memory");
            return;
        };
        let id = floors.id();
        assert!(!find().iter().any(|l| l.id == id), "attached: in use");
        // SAFETY: never used again; detaching is what a killed daemon's death does.
        unsafe { floors.detach() };
        let left = find();
        let mine = left
            .iter()
            .find(|l| l.id == id)
            .expect("the floors are found");
        assert!(mine.what.contains("nonce floors"), "{mine:?}");
        free(mine);
        assert!(shm::stat(id).is_err(), "not freed");
    }

    #[test]
    fn a_record_of_a_device_that_is_gone_is_found_by_its_content_and_freed() {
        if !crate::sys::is_root() {
            println!("SKIP: SHM_LOCK needs root");
            return;
        }
        let _scans = one_scan_at_a_time();
        let device = (1 << 20) - 21;
        let state = crate::control::state::DaemonState::example(device);
        record::write(&state).unwrap();
        // A record test's scan for records maps each for a moment, and a mapped segment is
        // in use: look again while that may be so.
        let mine = (0..100)
            .find_map(|_| {
                let found = find().into_iter().find(|l| l.kind == Kind::Record(device));
                if found.is_none() {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                found
            })
            .expect("the record is found");
        let seg = shm::check(mine.id).unwrap();
        assert_eq!(
            seg.key,
            libc::IPC_PRIVATE,
            "found by its content, not a key"
        );
        assert!(mine.what.contains("a device that is gone"), "{mine:?}");
        free(&mine);
        // Marked for removal, it goes once that other scan let go of it.
        let gone = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            shm::stat(mine.id).is_err()
        });
        assert!(gone, "not freed");
        assert_eq!(record::read(device), None);
    }
}

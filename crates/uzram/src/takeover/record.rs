//! A device's recovery record: its daemon's [`DaemonState`] and libublk's device file, in a
//! small private SysV shared memory segment of root's, locked (`SHM_LOCK`) so it is never
//! swapped, and found by its content: a header that names the device.
//!
//! Why not the state file alone: `/run` is tmpfs, whose pages go to swap, and the
//! highest-priority swap is this very device. After a crash, a recovery that reads
//! `/run/uzram/<id>.json` may wait for a page only the dead daemon could serve. In the guest
//! that happened: `uzram recover` blocked for good in a read of the state file. Everything a
//! recovery needs (which daemon, which store, how it was started) is therefore read from
//! here; the state files stay for `list`, `status` and the control socket, which only run
//! with a live daemon or can wait for one.
//!
//! Why no key: a key derived from the device id is one any user can take first, and a user
//! who keeps making segments there can keep root off it. A private segment has no name to
//! take; a recovery finds the record among the segments root made with mode 0600
//! (`/proc/sysvipc/shm`, procfs, never swapped), which no other user can make or change. A
//! record of the releases before, on the key `0x75700000 + id`, is still read (a device
//! their daemon made is recovered by this one) and removed once this format is written.
//!
//! libublk has the same problem: every `UblkCtrl` of an existing device reads
//! `/run/ublksrvd/NNNN.json` first (the recovering daemon's too). The record keeps a copy, and
//! [`restore_ublk_json`] writes it back as a new file before a recovery opens the device: the
//! old file's swapped page is dropped unread.

use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::record_layout::{expected_body, host_cpus, Layout, HEADER, SECOND};
use crate::control::state::DaemonState;
use crate::control::ControlError;
use crate::shm;

/// The record's header: this magic, the body's length and the device id (native-endian
/// `u32`s), then the body (JSON), in the first or the second half of the rest ([`SECOND`]).
/// A segment's size is one of [`Layout`]'s: 16 KiB for most devices, more for one whose
/// libublk device file (a line per queue) needs it.
const MAGIC: [u8; 8] = *b"UZRAMAN3";

/// The releases before kept the record on key `LEGACY_KEY_BASE + id`, with this magic and no
/// device in the header; read, never written.
const LEGACY_KEY_BASE: i32 = 0x7570_0000;
const LEGACY_MAGIC: [u8; 8] = *b"UZRAMAN2";

/// What the segment holds (as JSON, after the 16-byte header: magic, length, device).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    state: DaemonState,
    /// libublk's device file as the daemon last saw it.
    ublk: Option<serde_json::Value>,
}

/// libublk's device file (`UblkJsonManager::get_json_path`).
fn ublk_json_path(id: u32) -> String {
    format!("{}/{id:04}.json", libublk::ctrl::UblkCtrl::run_dir())
}

fn shm_err(what: &str) -> impl FnOnce(shm::ShmError) -> ControlError + '_ {
    move |e| ControlError::Io {
        what: what.to_string(),
        source: std::io::Error::other(e),
    }
}

/// The device whose recovery record `seg` (a segment root's alone) is: by its header, or by
/// the legacy key it sits on and the legacy magic it starts with (another program of root's
/// may have a segment on such a key: it is not ours to read or remove).
pub fn device_of_segment(seg: &shm::Stat) -> Option<u32> {
    if seg.key == libc::IPC_PRIVATE && Layout::of(seg.size).is_some() {
        let header: [u8; HEADER] = shm::peek(seg.id, 0).ok()?;
        let device = u32::from_ne_bytes(header[12..16].try_into().ok()?);
        return (header[..8] == MAGIC).then_some(device);
    }
    // The key's range first: a segment on any other key is not looked into at all.
    let id = seg
        .key
        .checked_sub(LEGACY_KEY_BASE)
        .filter(|id| (0..1 << 20).contains(id))?;
    let magic: [u8; 8] = shm::peek(seg.id, 0).ok()?;
    (magic == LEGACY_MAGIC).then_some(id as u32)
}

/// Root's record segments of device `id`: those found by their header, the largest first
/// (the one a write reuses), then by lowest id; then one on its legacy key.
fn segments_of(id: u32) -> Vec<shm::Stat> {
    let mut found: Vec<shm::Stat> = shm::root_only_segments()
        .into_iter()
        .filter(|seg| device_of_segment(seg) == Some(id))
        .collect();
    found.sort_unstable_by_key(|seg| {
        (
            seg.key != libc::IPC_PRIVATE,
            std::cmp::Reverse(seg.size),
            seg.id,
        )
    });
    found
}

/// Publishes `state` as the recovery record of its device (made, or overwritten), with
/// libublk's device file as it is now. Call it once the device serves.
///
/// The device's first record segment (found by content) is reused, so every daemon of a
/// device writes the same one; any other (a second one two writers made at once, a smaller
/// one a record outgrew, or one on the legacy key) is removed once this one is written.
/// A record whose halves the segment cannot hold moves to a new, larger segment that can
/// ([`Layout::for_body`]): the old one is removed only once the new one holds it, so a kill
/// on the way leaves both, and readers take the newer ([`read_record`]).
pub fn write(state: &DaemonState) -> Result<(), ControlError> {
    let ublk = read_ublk_json(std::path::Path::new(&ublk_json_path(state.id)));
    let record = Record {
        state: state.clone(),
        ublk,
    };
    let json = serde_json::to_vec(&record).map_err(|e| ControlError::Io {
        what: "encoding the recovery record".into(),
        source: std::io::Error::other(e),
    })?;
    let too_long = || ControlError::Io {
        what: format!("the recovery record of {}", state.dev),
        source: std::io::Error::other(format!(
            "{} bytes do not fit a record segment of {} bytes",
            json.len(),
            Layout::MAX.len()
        )),
    };
    let needed = Layout::for_body(json.len()).ok_or_else(too_long)?;
    let mut found = segments_of(state.id);
    let (map, layout) = match take_reusable(&mut found) {
        None => headed_segment(state.id, None, needed)?,
        Some(seg) => {
            let (map, layout) = record_segment(seg.id)?;
            if in_halves(&map, layout, json.len()) {
                (map, layout)
            } else {
                // Only ever into a larger segment (this one may fail `in_halves` for a long
                // record written in place, not for its size): a kill before the old one
                // goes leaves the new record in the larger.
                let larger = layout.doubled().map(|doubled| doubled.max(needed));
                match larger.map(|larger| headed_segment(state.id, None, larger)) {
                    Some(Ok(larger)) => {
                        #[cfg(test)]
                        if tests::killed_at(Step::Moving) {
                            return Ok(());
                        }
                        found.push(seg);
                        larger
                    }
                    // The largest already, or no segment to be had (the host's are counted
                    // host-wide): in place, as long as the segment holds it at all.
                    _ if json.len() > layout.body_max() => return Err(too_long()),
                    failed => {
                        let error = failed.and_then(Result::err).map(|e| e.to_string());
                        tracing::warn!(?error, bytes = json.len(), "no larger recovery record segment: rewriting the record in place, where a kill in the copy leaves none");
                        (map, layout)
                    }
                }
            }
        }
    };
    place(&map, layout, &json);
    #[cfg(test)]
    if tests::killed_at(Step::Placed) {
        return Ok(());
    }
    for other in found {
        if let Err(error) = shm::remove(other.id) {
            tracing::warn!(id = other.id, %error, "removing a second recovery record failed");
        }
    }
    Ok(())
}

/// Where a test stops [`write()`] or [`reserve`] as a kill would.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// A larger segment made and headed, the record not in it yet.
    Moving,
    /// The record written, the segments it replaces not removed yet.
    Placed,
    /// [`reserve`]: an earlier device's records emptied, their segments not removed yet.
    Emptied,
}

/// The length word of a record segment's mapping `map` (at least [`HEADER`] bytes).
fn length_word(map: &shm::Attached) -> &AtomicU32 {
    // SAFETY: the header's second u32 lies inside the mapping, 4-byte aligned (the mapping
    // starts on a page); it is only ever accessed atomically, here and by other processes
    // through their own mappings, and lives as long as `map`.
    unsafe { AtomicU32::from_ptr(map.base().add(8).cast::<u32>()) }
}

/// The write count of a record segment's mapping `map`, of `layout` (checked on attach).
fn write_count(map: &shm::Attached, layout: Layout) -> &AtomicU64 {
    debug_assert!(map.size() >= layout.len());
    // SAFETY: `count_at` is 8 bytes before the layout's end, 8-aligned (the mapping starts
    // on a page and every layout's size is a power of two), inside `map` (its size was
    // checked to be at least the layout's when it was attached); only ever accessed
    // atomically, and lives as long as `map`.
    unsafe { AtomicU64::from_ptr(map.base().add(layout.count_at()).cast::<u64>()) }
}

/// Whether a body of `len` bytes goes into a half of record segment `map` (of `layout`):
/// it fits one, and the record there now does not reach from the first half into the
/// second (one a release before wrote in place, or one written in place here for want of
/// a larger segment).
fn in_halves(map: &shm::Attached, layout: Layout, len: usize) -> bool {
    let current = layout.body_of(length_word(map).load(Ordering::Acquire));
    let long_first = current.is_some_and(|(at, len)| at == HEADER && len > layout.half());
    len <= layout.half_body() && !long_first
}

/// Writes `json` (at most the layout's `body_max` bytes) into the record segment `map`. A
/// body that goes into the halves ([`in_halves`]) goes first into the second half, which
/// the length word then names, and then into the first, which the word names last: a
/// daemon killed at any moment leaves a whole record, and the one left in the end is where
/// the releases before read it. The half the word names is never written.
fn place(map: &shm::Attached, layout: Layout, json: &[u8]) {
    let word = length_word(map);
    if in_halves(map, layout, json.len()) {
        let in_first = layout
            .body_of(word.load(Ordering::Acquire))
            .is_some_and(|(at, _)| at == HEADER);
        if in_first {
            put(map, layout, HEADER + layout.half(), json);
        }
        put(map, layout, HEADER, json);
    } else {
        // In place, the length zeroed first so that a record cut short reads as none. Only
        // where no larger segment could be had (`write`): a kill in these microseconds
        // leaves the device with no record.
        word.store(0, Ordering::Relaxed);
        // The zero before any byte of the new body, for a reader in another process.
        std::sync::atomic::fence(Ordering::SeqCst);
        put(map, layout, HEADER, json);
    }
}

/// Copies `json` to offset `at` of record segment `map`, then names it in the length word.
fn put(map: &shm::Attached, layout: Layout, at: usize, json: &[u8]) {
    let flag = if at == HEADER { 0 } else { SECOND };
    // Counted before any byte is copied (a locked add: a full barrier, for readers in other
    // processes too). Not while the record the length word names reaches the count's bytes
    // (one an earlier release left in the second half, 8,177 to 8,184 bytes long): the add
    // would spoil it, and this copy goes into the first half, so the word moves anyway.
    let named = layout.body_of(length_word(map).load(Ordering::Acquire));
    if named.is_none_or(|(from, len)| from + len <= layout.count_at()) {
        write_count(map, layout).fetch_add(1, Ordering::SeqCst);
    }
    assert!(
        at + json.len() <= layout.count_at(),
        "a record body past the write count"
    );
    // SAFETY: `at + json.len()` is at most the layout's `count_at` (asserted: the callers
    // put a half's body in a half, a longer one from the header), inside the mapping, which
    // is ours while attached; no reader uses these bytes until the length word names them.
    unsafe { ptr::copy_nonoverlapping(json.as_ptr(), map.base().add(at), json.len()) };
    length_word(map).store(json.len() as u32 | flag, Ordering::Release);
}

/// The first of a device's record segments (`found`, from [`segments_of`]) when it is the
/// one to reuse (private: not on a legacy key), taken off the list.
fn take_reusable(found: &mut Vec<shm::Stat>) -> Option<shm::Stat> {
    found.first().filter(|seg| seg.key == libc::IPC_PRIVATE)?;
    Some(found.remove(0))
}

/// Segment `seg` attached for writing, if it is a record's size, with its layout.
fn attach_record(seg: i32) -> Result<(shm::Attached, Layout), ControlError> {
    let map = shm::Attached::map(seg, false).map_err(shm_err("the recovery record"))?;
    let Some(layout) = Layout::of(map.size()) else {
        return Err(ControlError::Io {
            what: format!("shared memory segment {seg}"),
            source: std::io::Error::other("not the size of a recovery record"),
        });
    };
    Ok((map, layout))
}

/// Locks record segment `seg` in memory (a segment of the releases before may not be).
fn lock_record(seg: i32) -> Result<(), ControlError> {
    shm::lock(seg).map_err(shm_err("shmctl SHM_LOCK (the recovery record)"))
}

/// Record segment `seg`, attached, checked to be a record's size, and locked in memory.
fn record_segment(seg: i32) -> Result<(shm::Attached, Layout), ControlError> {
    let attached = attach_record(seg)?;
    lock_record(seg)?;
    Ok(attached)
}

/// Device `id`'s record segment, `reused` or made now with `layout`, attached, its header
/// naming the device with a length of 0 (no record yet), and locked in memory. A segment
/// made here and not handed out is removed again.
fn headed_segment(
    id: u32,
    reused: Option<i32>,
    layout: Layout,
) -> Result<(shm::Attached, Layout), ControlError> {
    let seg = match reused {
        Some(seg) => seg,
        None => create(layout.len()).map_err(shm_err("the recovery record"))?,
    };
    let headed = attach_record(seg).and_then(|(map, layout)| {
        // No record first (an earlier device's is emptied), then the header.
        length_word(&map).store(0, Ordering::SeqCst);
        // SAFETY: the mapping is a record's size (checked), at least HEADER bytes, and ours
        // while attached. The header names the device before the segment is locked, so a
        // kill from here on leaves a record that `uzram list` finds.
        unsafe {
            let base = map.base();
            ptr::write_volatile(base.add(12).cast::<u32>(), id);
            ptr::copy_nonoverlapping(MAGIC.as_ptr(), base, MAGIC.len());
        }
        lock_record(seg)?;
        Ok((map, layout))
    });
    if headed.is_err() && reused.is_none() {
        let _ = shm::remove(seg);
    }
    headed
}

/// A new segment of `len` bytes (root's alone, private); in tests, on a thread that called
/// `tests::refuse_new_segments`, the refusal a host whose segments are used up gives.
fn create(len: usize) -> Result<i32, shm::ShmError> {
    #[cfg(test)]
    if tests::NEW_REFUSED.get() {
        return shm::create(usize::MAX);
    }
    shm::create(len)
}

/// The record layout a device of `queues` queues is made with on this host.
fn layout_for_queues(queues: u16) -> Layout {
    Layout::for_body(expected_body(queues, host_cpus())).unwrap_or(Layout::MAX)
}

/// Whether record segment `seg` is one of this format (private) at least `layout`'s size.
fn holds_layout(seg: &shm::Stat, layout: Layout) -> bool {
    seg.key == libc::IPC_PRIVATE && seg.size >= layout.len()
}

/// Makes the record segment of new device `id`, of `queues` queues, now, with no record in
/// it yet, large enough for the record its daemon will write ([`expected_body`]): its record
/// is written only once it serves, and a segment made then could be refused (the host's
/// segments are counted host-wide, and any user can use them all up), leaving a device in
/// swap that no daemon could take over after a crash. Every record of the id is an earlier
/// device's: one segment large enough is emptied and reused, the others are removed first,
/// so none of them is ever read for this device. A device whose segment cannot be had here
/// (or whose earlier records cannot be removed) is not made.
pub fn reserve(id: u32, queues: u16) -> Result<(), ControlError> {
    let needed = layout_for_queues(queues);
    let mut found = segments_of(id);
    // Emptied before anything else, so that a kill anywhere in here leaves none of them
    // readable (the length word is at offset 8 in the legacy format too).
    for seg in &found {
        if let Ok(map) = shm::Attached::map(seg.id, false) {
            length_word(&map).store(0, Ordering::SeqCst);
        }
    }
    #[cfg(test)]
    if tests::killed_at(Step::Emptied) {
        return Ok(());
    }
    // The smallest large enough (the order is the largest first): a larger one would lock
    // memory for nothing, and hide the record from an earlier release.
    let reused = found
        .iter()
        .rposition(|seg| holds_layout(seg, needed))
        .map(|at| found.remove(at));
    for seg in found {
        if let Err(error) = shm::remove(seg.id) {
            // Removed meanwhile (`uzram destroy --all`, another device's start) is gone.
            if shm::stat(seg.id).is_ok_and(|now| !now.removed) {
                return Err(shm_err("removing an earlier device's recovery record")(
                    error,
                ));
            }
        }
    }
    headed_segment(id, reused.map(|seg| seg.id), needed).map(drop)
}

/// Makes room for the record of device `id`, of `queues` queues, taken over from an earlier
/// daemon (perhaps of a release whose segments were all 16 KiB), before it serves: a
/// segment of the size [`reserve`] makes, beside the one that holds the record now (never
/// touched here), when none of its segments is that large. The daemon's first [`write()`]
/// goes into it and removes the old one, so that write needs no segment the host may have
/// run out of by then.
pub fn make_room(id: u32, queues: u16) -> Result<(), ControlError> {
    let needed = layout_for_queues(queues);
    if segments_of(id).iter().any(|seg| holds_layout(seg, needed)) {
        return Ok(());
    }
    headed_segment(id, None, needed).map(drop)
}

/// The bytes of record segment `seg`, copied while neither its length word nor its write
/// count moved (a writer in another process may be rewriting it: the copy is taken again).
/// A record of this format is its segment's size; one on a legacy key, the base size.
fn record_bytes(seg: &shm::Stat) -> Option<Vec<u8>> {
    let map = shm::Attached::map(seg.id, true).ok()?;
    let layout = if seg.key == libc::IPC_PRIVATE {
        Layout::of(map.size())?
    } else {
        Some(Layout::BASE).filter(|base| map.size() >= base.len())?
    };
    let (word, count) = (length_word(&map), write_count(&map, layout));
    for _ in 0..COPY_TRIES {
        let counted = count.load(Ordering::Acquire);
        let before = word.load(Ordering::Acquire);
        let mut bytes = vec![0u8; layout.len()];
        // SAFETY: the mapping is at least the layout's size (checked) and stays attached
        // while we copy; copied through the raw pointer, never a shared reference, since a
        // writer in another process may change these bytes meanwhile (the word and count
        // checks below throw such a copy away).
        unsafe {
            ptr::copy_nonoverlapping(map.base() as *const u8, bytes.as_mut_ptr(), layout.len());
        }
        std::sync::atomic::fence(Ordering::Acquire);
        if word.load(Ordering::Relaxed) == before && count.load(Ordering::Relaxed) == counted {
            bytes[8..12].copy_from_slice(&before.to_ne_bytes());
            return Some(bytes);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    None
}

/// Why [`parse_record`] refuses a segment whose length word names no body.
const NO_RECORD_YET: &str = "no record in it yet";

/// Copies of a record taken before one is found whose length word held still.
const COPY_TRIES: usize = 16;

/// The record in `page` (a record segment's bytes, or their start) if it is one of device
/// `id` and passes every check of what it may hold ([`DaemonState::validate`]); why not
/// otherwise.
fn parse_record(id: u32, page: &[u8], host: crate::config::Host) -> Result<Record, String> {
    if page.len() < HEADER || (page[..8] != MAGIC && page[..8] != LEGACY_MAGIC) {
        return Err("no uzram recovery record".into());
    }
    let device = u32::from_ne_bytes(page[12..16].try_into().map_err(|_| "short header")?);
    if page[..8] == MAGIC && device != id {
        return Err(format!("its header names device {device}"));
    }
    let word = u32::from_ne_bytes(page[8..12].try_into().map_err(|_| "short header")?);
    // A copy of a whole segment (a fuzz input may be a shorter start of one).
    let layout = Layout::containing(page.len()).ok_or("longer than any record")?;
    let (at, len) = layout.body_of(word).ok_or(NO_RECORD_YET)?;
    let body = at
        .checked_add(len)
        .filter(|&end| end <= layout.len())
        .and_then(|end| page.get(at..end))
        .ok_or_else(|| format!("a length of {len} bytes at {at}"))?;
    let record: Record = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    // Every key of the state must be one it has: the state file tolerates keys of other
    // versions, a record read back from shared memory does not.
    let raw: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let known = serde_json::to_value(&record.state).map_err(|e| e.to_string())?;
    if let (Some(raw), Some(known)) = (raw["state"].as_object(), known.as_object()) {
        if let Some(extra) = raw.keys().find(|k| !known.contains_key(*k)) {
            return Err(format!("its state has a field {extra:?} no daemon writes"));
        }
    }
    record.state.validate(id, host)?;
    if let Some(ublk) = &record.ublk {
        check_ublk_json(id, ublk)?;
    }
    Ok(record)
}

/// libublk's device file as a record keeps it: an object, of device `id` where it names one.
fn check_ublk_json(id: u32, json: &serde_json::Value) -> Result<(), String> {
    let object = json
        .as_object()
        .ok_or("its ublk device file is not an object")?;
    let named = object
        .get("dev_info")
        .and_then(|info| info.get("dev_id"))
        .and_then(serde_json::Value::as_u64);
    match named {
        Some(named) if named != u64::from(id) => {
            Err(format!("its ublk device file is device {named}'s"))
        }
        _ => Ok(()),
    }
}

/// Seeds for the recovery-record fuzz target: the bytes of valid records of device 3.
#[cfg(test)]
pub fn fuzz_seeds() -> Vec<Vec<u8>> {
    let state = DaemonState {
        pid: 99,
        started: Some(1234),
        size: 1 << 30,
        settings: Some(Box::new(crate::config::RawDevice {
            size: "1G".into(),
            queues: Some(2),
            metrics_textfile: Some("/var/lib/node/u.prom".into()),
            ..Default::default()
        })),
        store_shm: Some(5),
        config: Some("/etc/uzram/swap0.toml".into()),
        ..DaemonState::example(3)
    };
    let ublk = [None, Some(serde_json::json!({"dev_info": {"dev_id": 3}}))];
    // The body right after the header, and in the second half.
    ublk.into_iter()
        .flat_map(|ublk| [(ublk.clone(), false), (ublk, true)])
        .map(|(ublk, second)| {
            let json = serde_json::to_vec(&Record {
                state: state.clone(),
                ublk,
            })
            .unwrap();
            let flag = if second { SECOND } else { 0 };
            let mut page = MAGIC.to_vec();
            page.extend_from_slice(&(json.len() as u32 | flag).to_ne_bytes());
            page.extend_from_slice(&3u32.to_ne_bytes());
            if second {
                page.resize(HEADER + Layout::BASE.half(), 0);
            }
            page.extend_from_slice(&json);
            page
        })
        .collect()
}

/// The recovery-record fuzz target: a record from arbitrary bytes is refused, or it is device
/// 3's, names its node, and its settings pass a config file's validation.
#[cfg(test)]
pub fn fuzz_check(input: &[u8], host: crate::config::Host) {
    let Ok(record) = parse_record(3, input, host) else {
        return;
    };
    let state = record.state;
    assert_eq!((state.id, state.dev.as_str()), (3, "/dev/ublkb3"));
    if let Some(settings) = &state.settings {
        let cfg = settings.validate(host).expect("accepted settings validate");
        assert_eq!(cfg.size, state.size);
    }
    assert!(state.config.as_ref().is_none_or(|c| {
        c.is_absolute() || crate::config::zram_generator::section_of_spec(c).is_some()
    }));
}

/// The newest of the records passing every check in device `id`'s record segments: the one
/// of the daemon that started last (`DaemonState::started`, ticks since boot, which no
/// segment outlives), and of one daemon's, the one in the larger segment (a daemon's record
/// moves only ever into a larger one). More than one is left only by a kill between a
/// write and the removal of the segment it replaced, or by an earlier release, which writes
/// 16 KiB segments only and leaves larger ones be.
fn read_record(id: u32) -> Option<Record> {
    let host = crate::config::Host::current().ok()?;
    segments_of(id)
        .iter()
        .filter_map(|seg| {
            let page = record_bytes(seg)?;
            parse_record(id, &page, host)
                .map_err(|why| {
                    // A segment made for a record to come (`reserve`, `make_room`, a move)
                    // is no damage.
                    if why == NO_RECORD_YET {
                        tracing::debug!(
                            id,
                            segment = seg.id,
                            "a recovery record segment holds no record yet"
                        );
                    } else {
                        tracing::warn!(
                            id,
                            segment = seg.id,
                            why,
                            "refusing a recovery record of the device"
                        );
                    }
                })
                .ok()
                .map(|record| (record, seg.size))
        })
        // Of equals, the first in `segments_of`'s order.
        .rev()
        .max_by_key(|(record, size)| (record.state.started, *size))
        .map(|(record, _)| record)
}

/// libublk's device file at `path`, if it is a plain file of root's that fits in a record:
/// never through a link, never past the record's size (a FIFO or `/dev/zero` at the name
/// would hang or fill the daemon), never a file another user could have written.
fn read_ublk_json(path: &std::path::Path) -> Option<serde_json::Value> {
    use crate::sys::owned_file::{self, Links, Refused};
    match owned_file::read(path, Layout::MAX.body_max() as u64, Links::Refuse) {
        Ok(bytes) => serde_json::from_slice(&bytes).ok(),
        Err(why @ (Refused::NotAFile(_) | Refused::OthersWrite(_))) => {
            tracing::warn!(path = %path.display(), %why, "libublk's device file is not root's alone: not kept in the recovery record");
            None
        }
        Err(_) => None,
    }
}

/// The published state in the recovery record of device `id`, if there is one that passes
/// every check.
pub fn read(id: u32) -> Option<DaemonState> {
    read_record(id).map(|r| r.state)
}

/// Writes libublk's device file of `id` back from the recovery record, as a new file (see the
/// module docs). Only while no daemon serves the device.
pub fn restore_ublk_json(id: u32) -> Result<(), ControlError> {
    let Some(json) = read_record(id).and_then(|r| r.ublk) else {
        return Ok(()); // nothing kept: libublk reads what is there
    };
    let path = ublk_json_path(id);
    // root-only, as libublk makes it; never through a link planted at the name
    crate::sys::write_replacing(
        std::path::Path::new(&path),
        json.to_string().as_bytes(),
        0o600,
    )
    .map_err(|source| ControlError::Io {
        what: format!("writing a new {path}"),
        source,
    })
}

/// The devices whose record this process removed: a retry of [`publish`] must not make it
/// again.
static REMOVED: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// A record [`publish`] could not write yet, and when to try again.
static PENDING: std::sync::Mutex<Option<(DaemonState, std::time::Instant)>> =
    std::sync::Mutex::new(None);

/// How long a failed [`publish`] waits before [`retry_pending`] tries again.
const RETRY_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// [`write()`], and when that fails (the host's segments or lockable memory used up, for
/// a while), leaves it to [`retry_pending`] to try again every [`RETRY_EVERY`] until it
/// succeeds or this process [`remove`]s the record.
pub fn publish(state: &DaemonState) {
    let Err(err) = write_unless_removed(state) else {
        return;
    };
    tracing::error!(error = %err, "publishing the recovery record failed: until it is, a crash of this daemon cannot be recovered; trying again every {}s", RETRY_EVERY.as_secs());
    *lock(&PENDING) = Some((state.clone(), std::time::Instant::now() + RETRY_EVERY));
}

/// Tries a record [`publish`] could not write again, once its time came; called by a thread
/// that already runs once a second (the daemon starts no thread once it serves).
pub fn retry_pending() {
    let mut pending = lock(&PENDING);
    let Some((state, at)) = pending.as_mut() else {
        return;
    };
    let now = std::time::Instant::now();
    if now < *at {
        return;
    }
    match write_unless_removed(state) {
        Ok(()) => {
            tracing::info!(dev = %state.dev, "recovery record published");
            *pending = None;
        }
        Err(err) => {
            tracing::debug!(error = %err, "publishing the recovery record failed again");
            *at = now + RETRY_EVERY;
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`write()`] unless this process removed the record (then `Ok`: there is nothing to publish).
fn write_unless_removed(state: &DaemonState) -> Result<(), ControlError> {
    let removed = lock(&REMOVED);
    if removed.contains(&state.id) {
        return Ok(());
    }
    write(state)
}

/// Removes the recovery records of device `id` (its device is gone).
pub fn remove(id: u32) {
    let mut removed = lock(&REMOVED);
    if !removed.contains(&id) {
        removed.push(id);
    }
    for seg in segments_of(id) {
        if let Err(error) = shm::remove(seg.id) {
            tracing::warn!(id, segment = seg.id, %error, "removing the recovery record failed");
        }
    }
}

/// Ids of the ublk devices the kernel has that carry a recovery record (sysfs and procfs:
/// never swapped).
pub fn device_ids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/sys/class/ublk-char") else {
        return Vec::new();
    };
    let recorded: Vec<u32> = shm::root_only_segments()
        .iter()
        .filter_map(device_of_segment)
        .collect();
    let mut ids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
        .filter(|id| recorded.contains(id))
        .collect();
    ids.sort_unstable();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The base layout's places: the record of every device of a few queues.
    const LEN: usize = Layout::BASE.len();
    const HALF: usize = Layout::BASE.half();
    const COUNT_AT: usize = Layout::BASE.count_at();

    /// Root's record segments of device `id`, as `(key, segment id)`.
    fn segments(id: u32) -> Vec<(i32, i32)> {
        segments_of(id).iter().map(|s| (s.key, s.id)).collect()
    }

    /// Writes, reads back, overwrites and removes a record (needs root for SHM_LOCK; the test
    /// says so and returns otherwise). Uses an id no ublk device of this machine has.
    #[test]
    fn libublk_s_file_is_kept_only_when_it_is_a_plain_root_file_that_fits() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("0001.json");
        std::fs::write(&good, r#"{"dev_info":{"dev_id":1}}"#).unwrap();
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_ublk_json(&good).is_some());
        // Through a link: not followed.
        let link = dir.path().join("0002.json");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        assert!(read_ublk_json(&link).is_none());
        // Past the record's size, or endless: not read past it.
        let big = dir.path().join("0003.json");
        std::fs::write(&big, format!("\"{}\"", "x".repeat(Layout::MAX.len()))).unwrap();
        assert!(read_ublk_json(&big).is_none());
        let start = std::time::Instant::now();
        assert!(read_ublk_json(std::path::Path::new("/dev/zero")).is_none());
        assert!(start.elapsed().as_secs() < 5);
        // Writable by others.
        let open = dir.path().join("0004.json");
        std::fs::write(&open, "{}").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(read_ublk_json(&open).is_none());
        // Another user's.
        if crate::sys::is_root() {
            std::os::unix::fs::chown(&good, Some(65534), None).unwrap();
            assert!(read_ublk_json(&good).is_none());
        }
    }

    #[test]
    fn a_record_round_trips_and_goes() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = (1 << 20) - 7;
        let mut state = DaemonState {
            pid: 4242,
            started: Some(7),
            size: 1 << 20,
            config: Some("/etc/uzram/swap0.toml".into()),
            store_shm: Some(17),
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        assert_eq!(read(id), Some(state.clone()));
        let made = segments(id);
        assert!(
            matches!(made[..], [(libc::IPC_PRIVATE, _)]),
            "one private segment: {made:?}"
        );
        state.pid = 4343;
        state.settings = Some(Box::new(crate::config::RawDevice {
            size: "1M".into(),
            ..Default::default()
        }));
        write(&state).unwrap();
        assert_eq!(read(id), Some(state));
        assert_eq!(
            segments(id),
            made,
            "a second daemon's record is not the first's"
        );
        remove(id);
        assert_eq!(read(id), None);
        assert!(segments(id).is_empty());
    }

    /// A rewrite never touches the half the length word names: a body that fits a half goes
    /// into the second half first and then back into the first, where the releases before
    /// read it. A daemon killed between the two leaves the second half's record, which is
    /// read, and moved back by the next write; bytes in the half the word does not name are
    /// never read. A body longer than a half goes in place.
    #[test]
    fn a_rewrite_cut_short_leaves_a_whole_record() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = (1 << 20) - 23;
        let mut state = DaemonState {
            pid: 4242,
            store_shm: Some(17),
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        let seg = segments(id)[0].1;
        let map = shm::Attached::map(seg, false).unwrap();
        let word = || length_word(&map).load(Ordering::Acquire);
        assert_eq!(
            word() & SECOND,
            0,
            "a record where the releases before read it"
        );
        // A rewrite killed after its first step: the new record in the second half, named.
        state.pid = 4343;
        let json = body_of(&state);
        put(&map, Layout::BASE, HEADER + HALF, &json);
        assert_ne!(word() & SECOND, 0);
        assert_eq!(read(id), Some(state.clone()), "the second half's record");
        // Whatever is in the first half now is not read.
        // SAFETY: `HEADER..HEADER + HALF` lies inside the mapping.
        unsafe { ptr::write_bytes(map.base().add(HEADER), b'{', HALF) };
        assert_eq!(read(id), Some(state.clone()));
        state.pid = 4444;
        write(&state).unwrap();
        assert_eq!(word() & SECOND, 0, "moved back into the first half");
        assert_eq!(read(id), Some(state));
        drop(map);
        remove(id);
        assert!(segments(id).is_empty());
    }

    thread_local! {
        /// Whether this thread's new record segments are refused ([`refuse_new_segments`]).
        pub(super) static NEW_REFUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        /// Where this thread's next [`write()`] stops, as a kill would ([`kill_at`]).
        static KILL_AT: std::cell::Cell<Option<Step>> = const { std::cell::Cell::new(None) };
    }

    /// Stops this thread's next [`write()`] at `step`, as a kill there would.
    fn kill_at(step: Step) {
        KILL_AT.set(Some(step));
    }

    /// Whether [`write()`] stops at `step` (once).
    pub(super) fn killed_at(step: Step) -> bool {
        let stop = KILL_AT.get() == Some(step);
        if stop {
            KILL_AT.set(None);
        }
        stop
    }

    /// Refuses this thread's new record segments from now on, as a host whose segments
    /// another user used up does.
    pub(super) fn refuse_new_segments() {
        NEW_REFUSED.set(true);
    }

    /// Where no larger segment can be had, a record too long for its segment's halves is
    /// still written, in place (the one window left where a kill leaves none), and read
    /// back whole; one too long for the segment at all is refused, saying so.
    #[test]
    fn a_record_that_cannot_move_is_written_in_place_or_refused() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = fresh((1 << 20) - 47);
        let mut state = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        let made = segments(id);
        refuse_new_segments();
        state.config = Some(format!("/etc/uzram/{}.toml", "x".repeat(HALF)).into());
        write(&state).unwrap();
        assert_eq!(segments(id), made, "a segment was made");
        let map = shm::Attached::map(made[0].1, true).unwrap();
        assert!(
            length_word(&map).load(Ordering::Acquire) as usize > HALF,
            "not in place"
        );
        assert_eq!(read(id), Some(state.clone()));
        state.config = Some(format!("/etc/uzram/{}.toml", "x".repeat(LEN)).into());
        let err = write(&state).unwrap_err().to_string();
        assert!(err.contains("recovery record"), "{err}");
        // Segments to be had again: a short record cannot go into the halves beside the
        // long one in place, so it moves, into a larger segment (never one of the same
        // size, which a reader could not tell from the old one).
        NEW_REFUSED.set(false);
        state.config = None;
        state.pid += 1;
        kill_at(Step::Placed);
        write(&state).unwrap();
        let both = segments(id);
        assert_eq!(both.len(), 2, "{both:?}");
        assert_eq!(size_of(both[0].1), 32 << 10);
        assert_eq!(
            read(id),
            Some(state.clone()),
            "the record the move left behind"
        );
        write(&state).unwrap();
        assert_eq!(segments(id), both[..1], "the old segment stayed");
        assert_eq!(read(id), Some(state));
        drop(map);
        remove(id);
    }

    /// Device `id` with no record segment: none that a failed run of the test left.
    fn fresh(id: u32) -> u32 {
        for seg in segments_of(id) {
            shm::remove(seg.id).unwrap();
        }
        id
    }

    /// The size of record segment `seg`.
    fn size_of(seg: i32) -> usize {
        shm::stat(seg).unwrap().size
    }

    /// A record too long for its segment's halves (a long config path here; many queues'
    /// libublk device file on a large host) moves whole to a segment whose halves hold it,
    /// and the smaller one goes: it is never written in place (where a kill in the copy
    /// leaves no record). A later short record stays in the larger segment.
    #[test]
    fn a_record_too_long_for_its_segment_moves_whole_to_a_larger_one() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = fresh((1 << 20) - 37);
        let mut state = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        let small = segments(id);
        assert_eq!(size_of(small[0].1), LEN);
        for (path, size) in [(HALF, 32 << 10), (20_000, 64 << 10), (20, 64 << 10)] {
            state.config = Some(format!("/etc/uzram/{}.toml", "x".repeat(path)).into());
            state.pid += 1;
            write(&state).unwrap();
            let now = segments(id);
            assert!(matches!(now[..], [(libc::IPC_PRIVATE, _)]), "{now:?}");
            assert_eq!(size_of(now[0].1), size, "a config path of {path} bytes");
            let map = shm::Attached::map(now[0].1, true).unwrap();
            let word = length_word(&map).load(Ordering::Acquire);
            assert_eq!(word & SECOND, 0, "not in the first half");
            assert!(
                (word as usize) <= Layout::of(size).unwrap().half_body(),
                "written past a half: in place"
            );
            assert_eq!(read(id), Some(state.clone()));
        }
        assert!(shm::stat(small[0].1).is_err(), "the smaller segment stayed");
        remove(id);
        assert!(segments(id).is_empty());
    }

    /// A daemon killed while its record moves to a larger segment leaves the record it had
    /// (the larger segment holds none yet) or the new one (read as the newer, in the larger
    /// segment); the next write goes into the larger one and removes the smaller.
    #[test]
    fn a_move_cut_short_leaves_the_old_record_or_the_new_one() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = fresh((1 << 20) - 41);
        let old = DaemonState {
            pid: 4242,
            started: Some(100),
            ..DaemonState::example(id)
        };
        write(&old).unwrap();
        let small = segments(id)[0].1;
        let new = DaemonState {
            config: Some(format!("/etc/uzram/{}.toml", "y".repeat(HALF)).into()),
            ..old.clone()
        };
        // Killed once the larger segment was made and headed.
        kill_at(Step::Moving);
        write(&new).unwrap();
        let both = segments(id);
        assert_eq!(both.len(), 2, "{both:?}");
        assert_eq!(read(id), Some(old.clone()), "the record it had");
        // Killed once the record was in it, before the smaller segment went.
        kill_at(Step::Placed);
        write(&new).unwrap();
        assert_eq!(segments(id), both, "a third segment");
        assert_eq!(read(id), Some(new.clone()), "the larger segment's record");
        // The next daemon's write.
        let next = DaemonState {
            pid: 4444,
            started: Some(200),
            ..new
        };
        write(&next).unwrap();
        let left = segments(id);
        assert!(
            matches!(left[..], [(libc::IPC_PRIVATE, seg)] if seg != small),
            "{left:?}"
        );
        assert_eq!(size_of(left[0].1), 32 << 10);
        assert_eq!(read(id), Some(next));
        remove(id);
    }

    /// Of two records, the newer daemon's is read, whichever segment is larger: an earlier
    /// release writes 16 KiB segments only, and leaves a larger one this release wrote be.
    #[test]
    fn the_newer_daemon_s_record_is_read_whatever_its_segment_s_size() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = fresh((1 << 20) - 51);
        let this_release = DaemonState {
            pid: 4242,
            started: Some(100),
            config: Some(format!("/etc/uzram/{}.toml", "z".repeat(HALF)).into()),
            ..DaemonState::example(id)
        };
        write(&this_release).unwrap();
        assert_eq!(size_of(segments(id)[0].1), 32 << 10);
        // An earlier release's daemon, started later, in a 16 KiB segment of its own.
        let earlier_release = DaemonState {
            pid: 4343,
            started: Some(200),
            ..DaemonState::example(id)
        };
        let (map, layout) = headed_segment(id, None, Layout::BASE).unwrap();
        let json = body_of(&earlier_release);
        place(&map, layout, &json);
        assert_eq!(segments(id).len(), 2);
        assert_eq!(read(id), Some(earlier_release));
        // This release again: its write goes into the larger and removes the other.
        let again = DaemonState {
            pid: 4444,
            started: Some(300),
            ..DaemonState::example(id)
        };
        write(&again).unwrap();
        assert_eq!(segments(id).len(), 1);
        assert_eq!(read(id), Some(again));
        drop(map);
        remove(id);
    }

    /// A device taken over from a daemon whose segment is too small for its queues' record
    /// gets room beside it before it serves, the record it has untouched; the first write
    /// then needs no new segment, and removes the old one.
    #[test]
    fn a_taken_over_device_gets_room_for_its_record_before_it_serves() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = fresh((1 << 20) - 53);
        let old = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        write(&old).unwrap();
        let small = segments(id);
        assert_eq!(size_of(small[0].1), LEN);
        make_room(id, 512).unwrap();
        let both = segments(id);
        assert_eq!(both.len(), 2, "{both:?}");
        assert_eq!(read(id), Some(old.clone()), "the record it has");
        make_room(id, 512).unwrap();
        assert_eq!(segments(id), both, "room made twice");
        // The new daemon's record, longer than a 16 KiB segment's half, where the host has
        // no segment left to give.
        refuse_new_segments();
        let new = DaemonState {
            pid: 4343,
            config: Some(format!("/etc/uzram/{}.toml", "w".repeat(HALF)).into()),
            ..old
        };
        write(&new).unwrap();
        assert_eq!(segments(id), both[..1], "the old segment stayed");
        assert_eq!(read(id), Some(new));
        NEW_REFUSED.set(false);
        remove(id);
    }

    /// A new device's record segment is made large enough for its queues' record before it
    /// serves, so publishing that record needs no segment the host may have run out of by
    /// then: an earlier device's smaller segment of the id is replaced, and its record gone.
    #[test]
    fn a_device_of_many_queues_reserves_a_segment_its_record_fits() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = fresh((1 << 20) - 43);
        let earlier = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        write(&earlier).unwrap();
        let stale = segments(id)[0].1;
        reserve(id, 512).unwrap();
        let reserved = segments(id);
        assert!(
            matches!(reserved[..], [(libc::IPC_PRIVATE, seg)] if seg != stale),
            "{reserved:?}"
        );
        let layout = Layout::of(size_of(reserved[0].1)).unwrap();
        assert!(layout.half_body() >= expected_body(512, host_cpus()));
        assert_eq!(
            read(id),
            None,
            "the earlier device's record outlived the reserve"
        );
        // The record of a device of 512 queues, as libublk writes its file, goes into it.
        let body = body_with_queues(id, 512, host_cpus());
        assert!(body.len() > Layout::BASE.body_max(), "{} bytes", body.len());
        let (map, _) = record_segment(reserved[0].1).unwrap();
        assert!(in_halves(&map, layout, body.len()));
        place(&map, layout, &body);
        // Read back on a host large enough for 512 queues' buffers.
        let page = record_bytes(&shm::stat(reserved[0].1).unwrap()).unwrap();
        parse_record(id, &page, crate::config::Host::with_ram(64 << 10)).unwrap();
        // A device of a few queues keeps the size every release reads (on a host of a few
        // hundred CPUs or fewer).
        reserve(id, 4).unwrap();
        assert_eq!(segments(id), reserved, "a large enough segment is reused");
        drop(map);
        remove(id);
        lock(&REMOVED).retain(|&r| r != id);
        reserve(id, 4).unwrap();
        assert_eq!(size_of(segments(id)[0].1), layout_for_queues(4).len());
        remove(id);
        lock(&REMOVED).retain(|&r| r != id);
        // An earlier device's records in two segments (a kill mid-move): none is read for
        // the new device, whichever the reserve reuses.
        let long = DaemonState {
            config: Some(format!("/etc/uzram/{}.toml", "v".repeat(HALF)).into()),
            ..earlier.clone()
        };
        write(&earlier).unwrap();
        kill_at(Step::Placed);
        write(&long).unwrap();
        assert_eq!(segments(id).len(), 2);
        kill_at(Step::Emptied);
        reserve(id, 4).unwrap();
        assert_eq!(segments(id).len(), 2);
        assert_eq!(
            read(id),
            None,
            "a reserve killed early left a record readable"
        );
        reserve(id, 4).unwrap();
        let left = segments(id);
        assert_eq!(left.len(), 1, "an earlier device's segment stayed");
        assert_eq!(
            size_of(left[0].1),
            layout_for_queues(4).len(),
            "not the smallest segment large enough"
        );
        assert_eq!(
            read(id),
            None,
            "an earlier device's record outlived the reserve"
        );
        remove(id);
    }

    /// The body of a record of device `id`, with a state as long as a config file's
    /// settings make it and libublk's device file as libublk 0.4.8 builds it
    /// (`build_json_with_affinities`) for `queues` queues over `cpus` CPUs (at most the
    /// 1,024 its affinity names), each CPU in one queue's affinity, each queue with one at
    /// least, every number as long as it gets.
    fn body_with_queues(id: u32, queues: u16, cpus: usize) -> Vec<u8> {
        let info = libublk::sys::ublksrv_ctrl_dev_info {
            nr_hw_queues: queues,
            queue_depth: 4096,
            max_io_buf_bytes: u32::MAX,
            dev_id: id,
            ublksrv_pid: i32::MAX,
            flags: u64::MAX,
            ublksrv_flags: u64::MAX,
            owner_uid: u32::MAX,
            owner_gid: u32::MAX,
            ..Default::default()
        };
        let target = libublk::io::UblkTgt {
            tgt_type: "uzram".into(),
            dev_size: u64::MAX,
            ring_flags: u64::MAX,
            ..Default::default()
        };
        // libublk's affinity names CPUs below 1,024: as long as they get, 4 digits.
        let per = (cpus.min(1024) / usize::from(queues)).max(1);
        let queue_map: serde_json::Map<String, serde_json::Value> = (0..usize::from(queues))
            .map(|q| {
                let affinity: Vec<usize> = (0..per).map(|k| 1000 + (q * per + k) % 24).collect();
                let entry = serde_json::json!({"qid": q, "tid": i32::MAX, "affinity": affinity});
                (q.to_string(), entry)
            })
            .collect();
        let ublk = serde_json::json!({
            "dev_info": info,
            "target": target,
            "target_flags": u64::MAX,
            "queues": queue_map,
        });
        let state = DaemonState {
            pid: u32::MAX,
            started: Some(u64::MAX),
            size: 1 << 30,
            config: Some("/etc/uzram/swap0.toml".into()),
            store_shm: Some(i32::MAX),
            settings: Some(Box::new(crate::config::RawDevice {
                size: "1G".into(),
                queues: Some(queues.into()),
                metrics_textfile: Some("/var/lib/prometheus/node-exporter/uzram0.prom".into()),
                ..Default::default()
            })),
            ..DaemonState::example(id)
        };
        serde_json::to_vec(&Record {
            state,
            ublk: Some(ublk),
        })
        .unwrap()
    }

    /// The size a device's record segment is made with holds its record, as libublk writes
    /// its part, from one queue on two CPUs to 4,096 queues on 4,096 CPUs.
    #[test]
    fn the_expected_body_bounds_the_record_libublk_makes_for_the_queues() {
        for (queues, cpus) in [
            (1, 2),
            (1, 4096),
            (4, 16),
            (16, 64),
            (64, 256),
            (128, 512),
            (256, 256),
            (1024, 512),
            (4096, 4096),
        ] {
            let body = body_with_queues(1, queues, cpus).len();
            let bound = expected_body(queues, cpus);
            assert!(
                body <= bound,
                "{queues} queues, {cpus} CPUs: {body} > {bound}"
            );
            let layout = Layout::for_body(bound).expect("a layout for every queue count");
            assert!(layout.half_body() >= body);
        }
        // The usual device keeps the base size, which every release before reads.
        assert_eq!(Layout::for_body(expected_body(4, 16)), Some(Layout::BASE));
        assert_eq!(Layout::for_body(expected_body(16, 64)), Some(Layout::BASE));
    }

    /// A reader whose copy spans rewrites of the same length (the length word back where it
    /// was) never takes a mix of two records: with the length word alone as its check it
    /// did (a config path half of one record, half of the other).
    #[test]
    fn a_record_rewritten_during_a_copy_is_never_read_torn() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = (1 << 20) - 29;
        let host = HOST;
        let states: Vec<DaemonState> = [b'a', b'b']
            .iter()
            .map(|&c| DaemonState {
                pid: 4242,
                config: Some(
                    format!("/etc/uzram/{}.toml", (c as char).to_string().repeat(3000)).into(),
                ),
                ..DaemonState::example(id)
            })
            .collect();
        write(&states[0]).unwrap();
        let seg = crate::shm::stat(segments(id)[0].1).unwrap();
        let bodies: Vec<Vec<u8>> = states.iter().map(body_of).collect();
        assert_eq!(bodies[0].len(), bodies[1].len());
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (read, torn) = std::thread::scope(|s| {
            s.spawn(|| {
                let map = shm::Attached::map(seg.id, false).unwrap();
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    place(&map, Layout::BASE, &bodies[i % 2]);
                }
            });
            let (mut read, mut torn) = (0, 0);
            let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while std::time::Instant::now() < until {
                let Some(bytes) = record_bytes(&seg) else {
                    continue;
                };
                read += 1;
                match parse_record(id, &bytes, host) {
                    Ok(r) if states.contains(&r.state) => {}
                    _ => torn += 1,
                }
            }
            stop.store(true, Ordering::Relaxed);
            (read, torn)
        });
        eprintln!("{read} copies read back, {torn} torn");
        assert!(read > 0, "no copy held still");
        assert_eq!(torn, 0, "copies that were no record written");
        remove(id);
    }

    /// A record an earlier release left in the second half, long enough to reach the write
    /// count's bytes, stays whole while the next rewrite copies its body into the first
    /// half: the count is not bumped over it.
    #[test]
    fn an_earlier_releases_record_over_the_count_survives_the_first_rewrite() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = (1 << 20) - 31;
        let mut state = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        let seg = segments(id)[0].1;
        let map = shm::Attached::map(seg, false).unwrap();
        // As an earlier release left it: a body of HALF bytes in the second half, named.
        let mut body = body_of(&state);
        body.resize(HALF, b' ');
        assert!(HEADER + HALF + body.len() > COUNT_AT);
        // SAFETY: the second half lies inside the mapping (HEADER + 2 * HALF == LEN).
        unsafe { ptr::copy_nonoverlapping(body.as_ptr(), map.base().add(HEADER + HALF), HALF) };
        length_word(&map).store(HALF as u32 | SECOND, Ordering::Release);
        assert_eq!(
            read(id),
            Some(state.clone()),
            "the earlier release's record"
        );
        // The rewrite's first copy (into the first half) leaves the named record's bytes as
        // they were until the word moves off them.
        let before = write_count(&map, Layout::BASE).load(Ordering::Relaxed);
        state.pid = 4343;
        let json = body_of(&state);
        put(&map, Layout::BASE, HEADER, &json);
        // SAFETY: the second half lies inside the mapping.
        let second = unsafe { std::slice::from_raw_parts(map.base().add(HEADER + HALF), HALF) };
        assert!(
            second == body,
            "the earlier release's record was written over"
        );
        assert_eq!(
            write_count(&map, Layout::BASE).load(Ordering::Relaxed),
            before
        );
        assert_eq!(
            read(id),
            Some(state.clone()),
            "the new record, in the first half"
        );
        // From now on, rewrites count.
        state.pid = 4444;
        write(&state).unwrap();
        assert!(write_count(&map, Layout::BASE).load(Ordering::Relaxed) > before);
        assert_eq!(read(id), Some(state));
        drop(map);
        remove(id);
    }

    /// A new device's segment is made before it serves, empty (an earlier device's record of
    /// the id is emptied), and its record later goes into that very segment: publishing it
    /// needs no segment the host may have run out of by then.
    #[test]
    fn a_reserved_segment_holds_no_record_until_the_daemon_writes_it() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = (1 << 20) - 19;
        let state = DaemonState {
            pid: 4242,
            store_shm: Some(17),
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        let stale = segments(id);
        reserve(id, 1).unwrap();
        // Reused where it is large enough: on a host of a few hundred CPUs or fewer.
        if layout_for_queues(1) == Layout::BASE {
            assert_eq!(
                segments(id),
                stale,
                "the earlier device's segment is reused"
            );
        }
        assert_eq!(segments(id).len(), 1);
        assert_eq!(
            read(id),
            None,
            "an earlier device's record outlived the reserve"
        );
        remove(id);
        lock(&REMOVED).retain(|&r| r != id);
        reserve(id, 1).unwrap();
        let reserved = segments(id);
        assert!(
            matches!(reserved[..], [(libc::IPC_PRIVATE, _)]),
            "{reserved:?}"
        );
        assert_eq!(read(id), None);
        write(&state).unwrap();
        assert_eq!(read(id), Some(state));
        assert_eq!(segments(id), reserved, "the record went elsewhere");
        remove(id);
        assert!(segments(id).is_empty());
    }

    /// A record that could not be written is written by a later retry once its time came,
    /// and never after the device's record was removed.
    #[test]
    fn a_pending_record_is_written_by_a_retry_and_never_after_its_removal() {
        if !crate::sys::is_root() {
            eprintln!("skipped: SHM_LOCK needs root");
            return;
        }
        let id = (1 << 20) - 13;
        let state = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        let later = std::time::Instant::now() + std::time::Duration::from_secs(3600);
        *lock(&PENDING) = Some((state.clone(), later));
        retry_pending();
        assert_eq!(read(id), None, "retried before its time");
        *lock(&PENDING) = Some((state.clone(), std::time::Instant::now()));
        retry_pending();
        assert_eq!(read(id), Some(state.clone()));
        assert!(lock(&PENDING).is_none(), "still pending once written");
        remove(id);
        *lock(&PENDING) = Some((state, std::time::Instant::now()));
        retry_pending();
        assert_eq!(read(id), None, "a removed record was made again");
        assert!(lock(&PENDING).is_none());
    }

    /// The record body of `state`, with no libublk device file.
    fn body_of(state: &DaemonState) -> Vec<u8> {
        serde_json::to_vec(&Record {
            state: state.clone(),
            ublk: None,
        })
        .unwrap()
    }

    fn page_of(state: &DaemonState) -> Vec<u8> {
        page_with(&MAGIC, state)
    }

    /// A record page of `state` with `magic`, naming its device in the header.
    fn page_with(magic: &[u8; 8], state: &DaemonState) -> Vec<u8> {
        let json = body_of(state);
        let mut page = vec![0u8; LEN];
        page[..8].copy_from_slice(magic);
        page[8..12].copy_from_slice(&(json.len() as u32).to_ne_bytes());
        page[12..16].copy_from_slice(&state.id.to_ne_bytes());
        page[HEADER..HEADER + json.len()].copy_from_slice(&json);
        page
    }

    const HOST: crate::config::Host = crate::config::Host::with_ram(1024);

    #[test]
    fn the_fuzz_seeds_are_records_that_pass() {
        for seed in fuzz_seeds() {
            parse_record(3, &seed, HOST).unwrap();
        }
    }

    #[test]
    fn a_forged_record_is_refused_as_data() {
        let id = 3;
        let good = DaemonState {
            pid: 99,
            size: 1 << 30,
            settings: Some(Box::new(crate::config::RawDevice {
                size: "1G".into(),
                ..Default::default()
            })),
            store_shm: Some(5),
            ..DaemonState::example(id)
        };
        assert!(parse_record(id, &page_of(&good), HOST).is_ok());
        let settings = |raw: crate::config::RawDevice| DaemonState {
            settings: Some(Box::new(raw)),
            ..good.clone()
        };
        let raw = crate::config::RawDevice {
            size: "1G".into(),
            ..Default::default()
        };
        for (bad, why) in [
            (
                DaemonState {
                    id: 4,
                    ..good.clone()
                },
                "device 4",
            ),
            (
                DaemonState {
                    dev: "/dev/sda".into(),
                    ..good.clone()
                },
                "device node",
            ),
            (
                DaemonState {
                    store_shm: Some(-1),
                    ..good.clone()
                },
                "store segment",
            ),
            (
                DaemonState {
                    config: Some("etc/x.toml".into()),
                    ..good.clone()
                },
                "neither an absolute path",
            ),
            (
                DaemonState {
                    config: Some("zram-generator:../../etc/shadow".into()),
                    ..good.clone()
                },
                "neither an absolute path",
            ),
            (
                DaemonState {
                    size: 1 << 20,
                    ..good.clone()
                },
                "the record says",
            ),
            (
                settings(crate::config::RawDevice {
                    size: "16T".into(),
                    ..raw.clone()
                }),
                "RAM",
            ),
            (
                settings(crate::config::RawDevice {
                    metrics_textfile: Some("/etc/shadow".into()),
                    ..raw.clone()
                }),
                "metrics-textfile",
            ),
            (
                settings(crate::config::RawDevice {
                    algorithm: Some("lz4; rm -rf /".into()),
                    ..raw.clone()
                }),
                "algorithm",
            ),
        ] {
            let err = parse_record(id, &page_of(&bad), HOST).expect_err(why);
            assert!(err.contains(why), "{why}: {err}");
        }
        // Arguments smuggled as keys the settings do not have, a length past the page, no magic.
        let mut json = serde_json::to_value(Record {
            state: good.clone(),
            ublk: None,
        })
        .unwrap();
        json["state"]["create_args"] = serde_json::json!(["--size", "16T"]);
        let text = serde_json::to_vec(&json).unwrap();
        let mut page = page_of(&good);
        page[8..12].copy_from_slice(&(text.len() as u32).to_ne_bytes());
        page[HEADER..HEADER + text.len()].copy_from_slice(&text);
        assert!(parse_record(id, &page, HOST).is_err());
        let mut long = page_of(&good);
        long[8..12].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(parse_record(id, &long, HOST).is_err());
        assert!(parse_record(id, &[0u8; LEN], HOST).is_err());
        // A header that names another device than the record's state.
        let mut named = page_of(&good);
        named[12..16].copy_from_slice(&4u32.to_ne_bytes());
        assert!(parse_record(id, &named, HOST)
            .unwrap_err()
            .contains("names device 4"));
        // A ublk device file of another device.
        let other = Record {
            state: good.clone(),
            ublk: Some(serde_json::json!({"dev_info": {"dev_id": 9}})),
        };
        let text = serde_json::to_vec(&other).unwrap();
        let mut page = page_of(&good);
        page[8..12].copy_from_slice(&(text.len() as u32).to_ne_bytes());
        page[HEADER..HEADER + text.len()].copy_from_slice(&text);
        assert!(parse_record(id, &page, HOST)
            .unwrap_err()
            .contains("device 9"));
    }

    /// The attacks on the record that the key of the releases before allowed, tried: a user
    /// forges a record in a segment of their own (private, even handed to root, and on the
    /// legacy key), and a user makes and removes segments on that key all the while. None of
    /// it is read, none of it keeps root from writing the record every time, and nobody can
    /// neither map nor remove root's.
    #[test]
    fn no_segment_another_user_makes_is_read_as_a_record_or_keeps_root_from_one() {
        let id = (1 << 20) - 11;
        let legacy_key = LEGACY_KEY_BASE + id as i32;
        let forged = DaemonState {
            pid: 1,
            ..DaemonState::example(id)
        };
        let Some(private) = shm::tests::nobodys_segment(libc::IPC_PRIVATE, LEN, 0o666) else {
            return;
        };
        shm::tests::write_as_owner(private, &page_of(&forged));
        // As large as a record of many queues is (the largest is read first).
        let larger = shm::tests::nobodys_segment(libc::IPC_PRIVATE, 64 << 10, 0o666).unwrap();
        shm::tests::write_as_owner(larger, &page_of(&forged));
        let on_key = shm::tests::nobodys_segment(legacy_key, LEN, 0o666).unwrap();
        shm::tests::write_as_owner(on_key, &page_with(&LEGACY_MAGIC, &forged));
        assert_eq!(read(id), None, "a record in nobody's segment was read");
        shm::tests::hand_to_root(private);
        shm::tests::hand_to_root(larger);
        assert_eq!(
            read(id),
            None,
            "a record nobody made was read once root owned it"
        );
        // A racer on the key the record had: root writes its record every time regardless.
        let racer = shm::tests::nobody_meanwhile(|| {
            // SAFETY: shmget and shmctl(IPC_RMID) take no pointers of ours.
            unsafe {
                let made = libc::shmget(legacy_key, LEN, libc::IPC_CREAT | libc::IPC_EXCL | 0o666);
                if made >= 0 {
                    libc::shmctl(made, libc::IPC_RMID, ptr::null_mut());
                }
            }
        })
        .unwrap();
        for pid in 1000..1200 {
            let state = DaemonState {
                pid,
                ..DaemonState::example(id)
            };
            write(&state).unwrap();
            assert_eq!(read(id), Some(state));
        }
        drop(racer);
        let ours = segments(id);
        assert!(
            matches!(ours[..], [(libc::IPC_PRIVATE, _)]),
            "one record of root's: {ours:?}"
        );
        let code = shm::tests::nobody_maps_or_removes(ours[0].1).unwrap();
        assert_eq!(code, 0, "nobody read or removed root's record");
        remove(id);
        for seg in [private, larger, on_key] {
            assert!(shm::stat(seg).is_ok(), "nobody's segment {seg} was removed");
            shm::remove(seg).unwrap();
        }
    }

    /// A record of the releases before (on its key) is read, and gives way to this format
    /// once a daemon writes the record.
    #[test]
    fn a_record_on_the_legacy_key_is_read_and_replaced() {
        if !crate::sys::is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let id = (1 << 20) - 17;
        let old = DaemonState {
            pid: 77,
            ..DaemonState::example(id)
        };
        let seg = shm::tests::root_segment_on_key(LEGACY_KEY_BASE + id as i32, LEN);
        shm::tests::write_as_owner(seg, &page_with(&LEGACY_MAGIC, &old));
        assert_eq!(segments(id), [(LEGACY_KEY_BASE + id as i32, seg)]);
        assert_eq!(read(id), Some(old));
        let new = DaemonState {
            pid: 78,
            ..DaemonState::example(id)
        };
        write(&new).unwrap();
        assert_eq!(read(id), Some(new));
        assert!(shm::stat(seg).is_err(), "the legacy record is still there");
        remove(id);
        assert!(segments(id).is_empty());
    }

    /// A segment of another root program's that sits on a legacy key but holds something
    /// else is not a record: never read as one, listed as one or removed with the device.
    #[test]
    fn another_program_s_segment_on_a_legacy_key_is_left_alone() {
        if !crate::sys::is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let id = (1 << 20) - 59;
        let seg = shm::tests::root_segment_on_key(LEGACY_KEY_BASE + id as i32, LEN);
        shm::tests::write_as_owner(seg, b"NOTOURS!some other program's data");
        let stat = shm::stat(seg).unwrap();
        assert_eq!(device_of_segment(&stat), None);
        assert!(segments(id).is_empty());
        assert_eq!(read(id), None);
        remove(id);
        assert!(
            shm::stat(seg).is_ok(),
            "another program's segment was removed"
        );
        shm::remove(seg).unwrap();
    }
}

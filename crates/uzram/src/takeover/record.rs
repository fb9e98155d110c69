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

use crate::control::state::DaemonState;
use crate::control::ControlError;
use crate::shm;

/// The record's header: this magic, the body's length and the device id (native-endian
/// `u32`s), then the body (JSON), in the first or the second half of the rest ([`SECOND`]).
const MAGIC: [u8; 8] = *b"UZRAMAN3";
const LEN: usize = 16 << 10;
const HEADER: usize = 16;
/// A half of the space after the header: a new record is written into the half the current
/// one is not in, and the length word, one aligned store, then points at it. A daemon
/// killed at any moment of a rewrite so leaves the old record or the new one.
const HALF: usize = (LEN - HEADER) / 2;
/// The length word's flag: the body is in the second half. Without it the body starts
/// right after the header (as every record of the releases before, up to `LEN - HEADER`
/// bytes).
const SECOND: u32 = 1 << 31;
/// Where the write count lies: the segment's last 8 bytes, which no body of this release
/// reaches ([`BODY_MAX`], [`HALF_BODY`]) and none a release before ever read. Every copy
/// of a body into the segment first bumps it, so a reader whose copy spans a rewrite sees
/// it move, even where the rewrite left the length word as it was (a record of the same
/// length, back in the same half).
const COUNT_AT: usize = LEN - 8;
/// The longest body: up to the write count.
const BODY_MAX: usize = COUNT_AT - HEADER;
/// The longest body written into a half: the second half ends at the write count.
const HALF_BODY: usize = COUNT_AT - (HEADER + HALF);

/// Where the body a length word names lies: its offset and length, or `None` when there is
/// none (a length of 0).
fn body_of(word: u32) -> Option<(usize, usize)> {
    let len = (word & !SECOND) as usize;
    match (word & SECOND != 0, len) {
        (_, 0) => None,
        (true, len) => Some((HEADER + HALF, len)),
        (false, len) => Some((HEADER, len)),
    }
}

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
    if seg.key == libc::IPC_PRIVATE && seg.size == LEN {
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

/// Root's record segments of device `id`: those found by their header, lowest id first, then
/// one on its legacy key.
fn segments_of(id: u32) -> Vec<shm::Stat> {
    let mut found: Vec<shm::Stat> = shm::root_only_segments()
        .into_iter()
        .filter(|seg| device_of_segment(seg) == Some(id))
        .collect();
    found.sort_unstable_by_key(|seg| (seg.key != libc::IPC_PRIVATE, seg.id));
    found
}

/// Publishes `state` as the recovery record of its device (made, or overwritten), with
/// libublk's device file as it is now. Call it once the device serves.
///
/// The device's first record segment (found by content) is reused, so every daemon of a
/// device writes the same one; any other (a second one two writers made at once, or one on
/// the legacy key) is removed once this one is written.
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
    if json.len() > BODY_MAX {
        return Err(ControlError::Io {
            what: format!("the recovery record of {}", state.dev),
            source: std::io::Error::other(format!("{} bytes do not fit", json.len())),
        });
    }
    let mut found = segments_of(state.id);
    let map = match take_reusable(&mut found) {
        Some(seg) => record_segment(seg)?,
        None => headed_segment(state.id, None)?,
    };
    place(&map, &json);
    for other in found {
        if let Err(error) = shm::remove(other.id) {
            tracing::warn!(id = other.id, %error, "removing a second recovery record failed");
        }
    }
    Ok(())
}

/// The length word of a record segment's mapping `map` (at least [`HEADER`] bytes).
fn length_word(map: &shm::Attached) -> &AtomicU32 {
    // SAFETY: the header's second u32 lies inside the mapping, 4-byte aligned (the mapping
    // starts on a page); it is only ever accessed atomically, here and by other processes
    // through their own mappings, and lives as long as `map`.
    unsafe { AtomicU32::from_ptr(map.base().add(8).cast::<u32>()) }
}

/// The write count of a record segment's mapping `map` (at least [`LEN`] bytes).
fn write_count(map: &shm::Attached) -> &AtomicU64 {
    // SAFETY: `COUNT_AT` is 8 bytes before LEN, 8-aligned (the mapping starts on a page),
    // inside every mapping this is called with (record segments are LEN bytes, checked on
    // attach); only ever accessed atomically, and lives as long as `map`.
    unsafe { AtomicU64::from_ptr(map.base().add(COUNT_AT).cast::<u64>()) }
}

/// Writes `json` (at most [`BODY_MAX`] bytes) into the record segment `map`. A body that
/// fits a half goes first into the second half, which the length word then names, and then
/// into the first, which the word names last: a daemon killed at any moment leaves a whole
/// record, and the one left in the end is where the releases before read it. The half the
/// word names is never written.
fn place(map: &shm::Attached, json: &[u8]) {
    let word = length_word(map);
    let current = body_of(word.load(Ordering::Acquire));
    let in_first = current.is_some_and(|(at, _)| at == HEADER);
    let long_first = current.is_some_and(|(at, len)| at == HEADER && len > HALF);
    if json.len() <= HALF_BODY && !long_first {
        if in_first {
            put(map, HEADER + HALF, json);
        }
        put(map, HEADER, json);
    } else {
        // A body longer than a half (or beside an older release's long one): in place, the
        // length zeroed first so that a record cut short reads as none. A kill in these
        // microseconds leaves the device with no record.
        word.store(0, Ordering::Relaxed);
        // The zero before any byte of the new body, for a reader in another process.
        std::sync::atomic::fence(Ordering::SeqCst);
        put(map, HEADER, json);
    }
}

/// Copies `json` to offset `at` of record segment `map`, then names it in the length word.
fn put(map: &shm::Attached, at: usize, json: &[u8]) {
    let flag = if at == HEADER { 0 } else { SECOND };
    // Counted before any byte is copied (a locked add: a full barrier, for readers in other
    // processes too). Not while the record the length word names reaches the count's bytes
    // (one an earlier release left in the second half, 8,177 to 8,184 bytes long): the add
    // would spoil it, and this copy goes into the first half, so the word moves anyway.
    let named = body_of(length_word(map).load(Ordering::Acquire));
    if named.is_none_or(|(from, len)| from + len <= COUNT_AT) {
        write_count(map).fetch_add(1, Ordering::SeqCst);
    }
    // SAFETY: `at + json.len()` is at most COUNT_AT (the callers' checks: a half's body in
    // a half, a longer one from the header), inside the mapping, which is ours while
    // attached; no reader uses these bytes until the length word names them.
    unsafe { ptr::copy_nonoverlapping(json.as_ptr(), map.base().add(at), json.len()) };
    length_word(map).store(json.len() as u32 | flag, Ordering::Release);
}

/// The first of a device's record segments (`found`, from [`segments_of`]) when it is the
/// one to reuse (private: not on a legacy key), taken off the list.
fn take_reusable(found: &mut Vec<shm::Stat>) -> Option<i32> {
    let first = found.first().filter(|seg| seg.key == libc::IPC_PRIVATE)?.id;
    found.remove(0);
    Some(first)
}

/// Segment `seg` attached for writing, if it is a record's size.
fn attach_record(seg: i32) -> Result<shm::Attached, ControlError> {
    let map = shm::Attached::map(seg, false).map_err(shm_err("the recovery record"))?;
    if map.size() != LEN {
        return Err(ControlError::Io {
            what: format!("shared memory segment {seg}"),
            source: std::io::Error::other("not the size of a recovery record"),
        });
    }
    Ok(map)
}

/// Locks record segment `seg` in memory (a segment of the releases before may not be).
fn lock_record(seg: i32) -> Result<(), ControlError> {
    shm::lock(seg).map_err(shm_err("shmctl SHM_LOCK (the recovery record)"))
}

/// Record segment `seg`, attached, checked to be a record's size, and locked in memory.
fn record_segment(seg: i32) -> Result<shm::Attached, ControlError> {
    let map = attach_record(seg)?;
    lock_record(seg)?;
    Ok(map)
}

/// Device `id`'s record segment, `reused` or made now, attached, its header naming the
/// device with a length of 0 (no record yet), and locked in memory. A segment made here
/// and not handed out is removed again.
fn headed_segment(id: u32, reused: Option<i32>) -> Result<shm::Attached, ControlError> {
    let seg = match reused {
        Some(seg) => seg,
        None => shm::create(LEN).map_err(shm_err("the recovery record"))?,
    };
    let headed = attach_record(seg).and_then(|map| {
        // No record first (an earlier device's is emptied), then the header.
        length_word(&map).store(0, Ordering::SeqCst);
        // SAFETY: the mapping is LEN bytes (checked) and ours while attached. The header
        // names the device before the segment is locked, so a kill from here on leaves a
        // record that `uzram list` finds.
        unsafe {
            let base = map.base();
            ptr::write_volatile(base.add(12).cast::<u32>(), id);
            ptr::copy_nonoverlapping(MAGIC.as_ptr(), base, MAGIC.len());
        }
        lock_record(seg)?;
        Ok(map)
    });
    if headed.is_err() && reused.is_none() {
        let _ = shm::remove(seg);
    }
    headed
}

/// Makes the record segment of new device `id` now, with no record in it yet (one an
/// earlier device of the id left is emptied and reused): its record is written only once
/// it serves, and a segment made then could be refused (the host's segments are counted
/// host-wide, and any user can use them all up), leaving a device in swap that no daemon
/// could take over after a crash. A device whose segment cannot be had here is not made.
pub fn reserve(id: u32) -> Result<(), ControlError> {
    headed_segment(id, take_reusable(&mut segments_of(id))).map(drop)
}

/// The bytes of record segment `seg`, copied while neither its length word nor its write
/// count moved (a writer in another process may be rewriting it: the copy is taken again).
fn record_bytes(seg: &shm::Stat) -> Option<Vec<u8>> {
    let map = shm::Attached::map(seg.id, true).ok()?;
    if map.size() < LEN {
        return None;
    }
    let (word, count) = (length_word(&map), write_count(&map));
    for _ in 0..COPY_TRIES {
        let counted = count.load(Ordering::Acquire);
        let before = word.load(Ordering::Acquire);
        // SAFETY: the mapping is at least LEN bytes (checked) and stays attached while we
        // copy.
        let mut bytes =
            unsafe { std::slice::from_raw_parts(map.base() as *const u8, LEN) }.to_vec();
        std::sync::atomic::fence(Ordering::Acquire);
        if word.load(Ordering::Relaxed) == before && count.load(Ordering::Relaxed) == counted {
            bytes[8..12].copy_from_slice(&before.to_ne_bytes());
            return Some(bytes);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    None
}

/// Copies of a record taken before one is found whose length word held still.
const COPY_TRIES: usize = 16;

/// The record in `page` (a record segment's bytes) if it is one of device `id` and passes
/// every check of what it may hold ([`DaemonState::validate`]); why not otherwise.
fn parse_record(id: u32, page: &[u8], host: crate::config::Host) -> Result<Record, String> {
    if page.len() < HEADER || (page[..8] != MAGIC && page[..8] != LEGACY_MAGIC) {
        return Err("no uzram recovery record".into());
    }
    let device = u32::from_ne_bytes(page[12..16].try_into().map_err(|_| "short header")?);
    if page[..8] == MAGIC && device != id {
        return Err(format!("its header names device {device}"));
    }
    let word = u32::from_ne_bytes(page[8..12].try_into().map_err(|_| "short header")?);
    let (at, len) = body_of(word).ok_or("no record in it yet")?;
    let body = at
        .checked_add(len)
        .filter(|&end| end <= LEN)
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
                page.resize(HEADER + HALF, 0);
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

/// The first of device `id`'s record segments ([`segments_of`]) that holds a record passing
/// every check.
fn read_record(id: u32) -> Option<Record> {
    let host = crate::config::Host::current().ok()?;
    segments_of(id).iter().find_map(|seg| {
        let page = record_bytes(seg)?;
        parse_record(id, &page, host)
            .map_err(|why| {
                tracing::warn!(
                    id,
                    segment = seg.id,
                    why,
                    "refusing a recovery record of the device"
                );
            })
            .ok()
    })
}

/// libublk's device file at `path`, if it is a plain file of root's that fits in a record:
/// never through a link, never past the record's size (a FIFO or `/dev/zero` at the name
/// would hang or fill the daemon), never a file another user could have written.
fn read_ublk_json(path: &std::path::Path) -> Option<serde_json::Value> {
    use crate::sys::owned_file::{self, Links, Refused};
    match owned_file::read(path, LEN as u64, Links::Refuse) {
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
        std::fs::write(&big, format!("\"{}\"", "x".repeat(LEN))).unwrap();
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
        let json = serde_json::to_vec(&Record {
            state: state.clone(),
            ublk: None,
        })
        .unwrap();
        put(&map, HEADER + HALF, &json);
        assert_ne!(word() & SECOND, 0);
        assert_eq!(read(id), Some(state.clone()), "the second half's record");
        // Whatever is in the first half now is not read.
        // SAFETY: `HEADER..HEADER + HALF` lies inside the mapping.
        unsafe { ptr::write_bytes(map.base().add(HEADER), b'{', HALF) };
        assert_eq!(read(id), Some(state.clone()));
        state.pid = 4444;
        write(&state).unwrap();
        assert_eq!(word() & SECOND, 0, "moved back into the first half");
        assert_eq!(read(id), Some(state.clone()));
        // A body longer than a half (a long config path) goes in place, and the next short
        // one cannot go into the second half (the long one reaches into it): in place too.
        state.config = Some(format!("/etc/uzram/{}.toml", "x".repeat(HALF)).into());
        write(&state).unwrap();
        assert!((word() as usize) > HALF);
        assert_eq!(read(id), Some(state.clone()));
        state.config = Some("/etc/uzram/swap0.toml".into());
        write(&state).unwrap();
        assert_eq!(read(id), Some(state));
        drop(map);
        remove(id);
        assert!(segments(id).is_empty());
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
        let bodies: Vec<Vec<u8>> = states
            .iter()
            .map(|state| {
                serde_json::to_vec(&Record {
                    state: state.clone(),
                    ublk: None,
                })
                .unwrap()
            })
            .collect();
        assert_eq!(bodies[0].len(), bodies[1].len());
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (read, torn) = std::thread::scope(|s| {
            s.spawn(|| {
                let map = shm::Attached::map(seg.id, false).unwrap();
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    place(&map, &bodies[i % 2]);
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
        let mut body = serde_json::to_vec(&Record {
            state: state.clone(),
            ublk: None,
        })
        .unwrap();
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
        let before = write_count(&map).load(Ordering::Relaxed);
        state.pid = 4343;
        let json = serde_json::to_vec(&Record {
            state: state.clone(),
            ublk: None,
        })
        .unwrap();
        put(&map, HEADER, &json);
        // SAFETY: the second half lies inside the mapping.
        let second = unsafe { std::slice::from_raw_parts(map.base().add(HEADER + HALF), HALF) };
        assert!(
            second == body,
            "the earlier release's record was written over"
        );
        assert_eq!(write_count(&map).load(Ordering::Relaxed), before);
        assert_eq!(
            read(id),
            Some(state.clone()),
            "the new record, in the first half"
        );
        // From now on, rewrites count.
        state.pid = 4444;
        write(&state).unwrap();
        assert!(write_count(&map).load(Ordering::Relaxed) > before);
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
        reserve(id).unwrap();
        assert_eq!(
            segments(id),
            stale,
            "the earlier device's segment is reused"
        );
        assert_eq!(
            read(id),
            None,
            "an earlier device's record outlived the reserve"
        );
        remove(id);
        lock(&REMOVED).retain(|&r| r != id);
        reserve(id).unwrap();
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

    fn page_of(state: &DaemonState) -> Vec<u8> {
        page_with(&MAGIC, state)
    }

    /// A record page of `state` with `magic`, naming its device in the header.
    fn page_with(magic: &[u8; 8], state: &DaemonState) -> Vec<u8> {
        let json = serde_json::to_vec(&Record {
            state: state.clone(),
            ublk: None,
        })
        .unwrap();
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
        let on_key = shm::tests::nobodys_segment(legacy_key, LEN, 0o666).unwrap();
        shm::tests::write_as_owner(on_key, &page_with(&LEGACY_MAGIC, &forged));
        assert_eq!(read(id), None, "a record in nobody's segment was read");
        shm::tests::hand_to_root(private);
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
        for seg in [private, on_key] {
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
        let id = (1 << 20) - 19;
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

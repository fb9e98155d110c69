//! A device's recovery record: its daemon's [`DaemonState`] and libublk's device file, in a
//! small SysV shared memory segment with a key derived from the device id, locked
//! (`SHM_LOCK`) so it is never swapped.
//!
//! Why not the state file alone: `/run` is tmpfs, whose pages go to swap, and the
//! highest-priority swap is this very device. After a crash, a recovery that reads
//! `/run/uzram/<id>.json` may wait for a page only the dead daemon could serve. In the guest
//! that happened: `uzram recover` blocked for good in a read of the state file. Everything a
//! recovery needs (which daemon, which store, how it was started) is therefore read from
//! here; the state files stay for `list`, `status` and the control socket, which only run
//! with a live daemon or can wait for one.
//!
//! libublk has the same problem: every `UblkCtrl` of an existing device reads
//! `/run/ublksrvd/NNNN.json` first (the recovering daemon's too). The record keeps a copy, and
//! [`restore_ublk_json`] writes it back as a new file before a recovery opens the device: the
//! old file's swapped page is dropped unread.

use std::ptr;

use serde::{Deserialize, Serialize};

use crate::control::state::DaemonState;
use crate::control::ControlError;
use crate::shm;

/// Keys are `KEY_BASE + id` (0x757 for "uz" in the top bits); ublk ids stay below 2^20.
/// Predictable, so anyone can take a key first: `shm` removes a segment on it that is not
/// root's alone, and never uses one.
const KEY_BASE: i32 = 0x7570_0000;
const MAGIC: [u8; 8] = *b"UZRAMAN2";
const LEN: usize = 16 << 10;
const HEADER: usize = 16;

/// What the segment holds (as JSON, after a 16-byte header: magic, length).
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

fn key(id: u32) -> Option<i32> {
    (id < 1 << 20).then(|| KEY_BASE + id as i32)
}

fn shm_err(what: &str) -> impl FnOnce(shm::ShmError) -> ControlError + '_ {
    move |e| ControlError::Io {
        what: what.to_string(),
        source: std::io::Error::other(e),
    }
}

/// Publishes `state` as the recovery record of its device (made, or overwritten), with
/// libublk's device file as it is now. Call it once the device serves.
pub fn write(state: &DaemonState) -> Result<(), ControlError> {
    let ublk = std::fs::read(ublk_json_path(state.id))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    let record = Record {
        state: state.clone(),
        ublk,
    };
    let json = serde_json::to_vec(&record).map_err(|e| ControlError::Io {
        what: "encoding the recovery record".into(),
        source: std::io::Error::other(e),
    })?;
    if json.len() > LEN - HEADER {
        return Err(ControlError::Io {
            what: format!("the recovery record of {}", state.dev),
            source: std::io::Error::other(format!("{} bytes do not fit", json.len())),
        });
    }
    let key =
        key(state.id).ok_or_else(|| ControlError::Protocol(format!("device id {}", state.id)))?;
    let id = shm::create_keyed(key, LEN).map_err(shm_err("the recovery record"))?;
    let map = shm::Attached::map(id, false).map_err(shm_err("the recovery record"))?;
    if map.size() < LEN {
        return Err(ControlError::Io {
            what: format!("shared memory key {key:#x}"),
            source: std::io::Error::other("a smaller segment of root's has this key"),
        });
    }
    shm::lock(id).map_err(shm_err("shmctl SHM_LOCK (the recovery record)"))?;
    // SAFETY: the mapping is LEN bytes (checked) and ours while attached; the length goes in
    // last, so a record cut short by a crash reads as none.
    unsafe {
        let base = map.base();
        ptr::write_volatile(base.add(8).cast::<u32>(), 0);
        ptr::copy_nonoverlapping(MAGIC.as_ptr(), base, MAGIC.len());
        ptr::copy_nonoverlapping(json.as_ptr(), base.add(HEADER), json.len());
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        ptr::write_volatile(base.add(8).cast::<u32>(), json.len() as u32);
    }
    Ok(())
}

/// The bytes of the record segment of device `id`, if there is one root's alone.
fn record_bytes(id: u32) -> Option<Vec<u8>> {
    let shm = shm::find_keyed(key(id)?)?;
    let map = shm::Attached::map(shm, true).ok()?;
    if map.size() < LEN {
        return None;
    }
    // SAFETY: the mapping is at least LEN bytes (checked) and stays attached while we copy.
    let bytes = unsafe { std::slice::from_raw_parts(map.base() as *const u8, LEN) }.to_vec();
    Some(bytes)
}

/// The record in `page` (a record segment's bytes) if it is one of device `id` and passes
/// every check of what it may hold ([`DaemonState::validate`]); why not otherwise.
fn parse_record(id: u32, page: &[u8], host: crate::config::Host) -> Result<Record, String> {
    if page.len() < HEADER || page[..8] != MAGIC {
        return Err("no uzram recovery record".into());
    }
    let len = u32::from_ne_bytes(page[8..12].try_into().map_err(|_| "short header")?) as usize;
    let body = HEADER
        .checked_add(len)
        .and_then(|end| page.get(HEADER..end))
        .ok_or_else(|| format!("a length of {len} bytes"))?;
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
    [None, Some(serde_json::json!({"dev_info": {"dev_id": 3}}))]
        .into_iter()
        .map(|ublk| {
            let json = serde_json::to_vec(&Record {
                state: state.clone(),
                ublk,
            })
            .unwrap();
            let mut page = MAGIC.to_vec();
            page.extend_from_slice(&(json.len() as u32).to_ne_bytes());
            page.extend_from_slice(&[0; 4]);
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

fn read_record(id: u32) -> Option<Record> {
    let page = record_bytes(id)?;
    let host = crate::config::Host::current().ok()?;
    match parse_record(id, &page, host) {
        Ok(record) => Some(record),
        Err(why) => {
            tracing::warn!(id, why, "refusing the recovery record of the device");
            None
        }
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

/// [`write()`], and when that fails (a user who keeps making segments on the record's key
/// outlasts [`shm::create_keyed`]), leaves it to [`retry_pending`] to try again every
/// [`RETRY_EVERY`] until it succeeds or this process [`remove`]s the record: the key is the
/// squatter's only while root has no segment there, so once written the record stays the
/// daemon's.
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

/// Removes the recovery record of device `id` (its device is gone).
pub fn remove(id: u32) {
    let mut removed = lock(&REMOVED);
    if !removed.contains(&id) {
        removed.push(id);
    }
    if let Some(shm) = key(id).and_then(shm::find_keyed) {
        if let Err(error) = shm::remove(shm) {
            tracing::warn!(id, %error, "removing the recovery record failed");
        }
    }
}

/// Whether device `id` has a record segment (root's alone).
pub fn exists(id: u32) -> bool {
    key(id).and_then(shm::find_keyed).is_some()
}

/// The device id whose record segment has key `key`, if it is a record key.
pub fn device_of_key(key: i32) -> Option<u32> {
    let id = key.checked_sub(KEY_BASE)?;
    (0..1 << 20).contains(&id).then_some(id as u32)
}

/// Ids of the ublk devices the kernel has that carry a recovery record (sysfs: never
/// swapped).
pub fn device_ids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/sys/class/ublk-char") else {
        return Vec::new();
    };
    let mut ids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
        .filter(|&id| exists(id))
        .collect();
    ids.sort_unstable();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_stay_apart_and_in_range() {
        assert_eq!(key(0), Some(KEY_BASE));
        assert_eq!(key((1 << 20) - 1), Some(KEY_BASE + (1 << 20) - 1));
        assert_eq!(key(1 << 20), None);
        assert!(KEY_BASE > 0 && KEY_BASE.checked_add(1 << 20).is_some());
    }

    /// Writes, reads back, overwrites and removes a record (needs root for SHM_LOCK; the test
    /// says so and returns otherwise). Uses an id no ublk device of this machine has.
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
        state.pid = 4343;
        state.settings = Some(Box::new(crate::config::RawDevice {
            size: "1M".into(),
            ..Default::default()
        }));
        write(&state).unwrap();
        assert_eq!(read(id), Some(state));
        remove(id);
        assert_eq!(read(id), None);
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
        let json = serde_json::to_vec(&Record {
            state: state.clone(),
            ublk: None,
        })
        .unwrap();
        let mut page = vec![0u8; LEN];
        page[..8].copy_from_slice(&MAGIC);
        page[8..12].copy_from_slice(&(json.len() as u32).to_ne_bytes());
        page[HEADER..HEADER + json.len()].copy_from_slice(&json);
        page
    }

    const HOST: crate::config::Host = crate::config::Host { ram_mib: 1024 };

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

    #[test]
    fn a_key_taken_first_by_another_user_is_never_used_and_nobody_reads_the_record() {
        let id = (1 << 20) - 11;
        let key = key(id).unwrap();
        let Some(squat) = shm::tests::nobodys_segment(key, LEN, 0o666) else {
            return;
        };
        // nobody writes a record of their own making into it
        let forged = DaemonState {
            pid: 1,
            store_shm: Some(squat),
            ..DaemonState::example(id)
        };
        let page = page_of(&forged);
        shm::tests::write_as_owner(squat, &page[..LEN]);
        assert_eq!(read(id), None, "a record in nobody's segment was read");
        // The daemon publishes: the squatter's segment goes, and root's own is made.
        let state = DaemonState {
            pid: 4242,
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        assert!(
            shm::stat(squat).is_err(),
            "the squatter's segment is still there"
        );
        assert_eq!(read(id), Some(state));
        let ours = shm::find_keyed(key).unwrap();
        // nobody can neither map nor remove it
        let code = shm::tests::nobody_maps_or_removes(ours).unwrap();
        assert_eq!(code, 0, "nobody read or removed root's record");
        remove(id);
    }
}

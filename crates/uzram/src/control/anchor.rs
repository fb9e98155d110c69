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

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::ptr;

use serde::{Deserialize, Serialize};

use super::state::DaemonState;
use super::ControlError;

/// Keys are `KEY_BASE + id` (0x757 for "uz" in the top bits); ublk ids stay below 2^20.
const KEY_BASE: i32 = 0x7570_0000;
const MAGIC: [u8; 8] = *b"UZRAMAN1";
const LEN: usize = 16 << 10;
const HEADER: usize = 16;

/// What the segment holds (as JSON, after a 16-byte header: magic, length).
#[derive(Debug, Serialize, Deserialize)]
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

fn sys_err(what: &str) -> ControlError {
    ControlError::Io {
        what: what.to_string(),
        source: std::io::Error::last_os_error(),
    }
}

/// An attached anchor segment, detached on drop.
struct Mapped(*mut u8);

impl Mapped {
    fn attach(shm: i32, read_only: bool) -> Option<Mapped> {
        let flags = if read_only { libc::SHM_RDONLY } else { 0 };
        // SAFETY: shmat maps the segment where the kernel picks; none of our memory is touched.
        let base = unsafe { libc::shmat(shm, ptr::null(), flags) };
        (base as isize != -1).then_some(Mapped(base.cast()))
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: detaches the mapping `attach` made; nothing refers to it after this.
        unsafe { libc::shmdt(self.0 as *const libc::c_void) };
    }
}

fn segment(id: u32, create: bool) -> Option<i32> {
    let key = key(id)?;
    let flags = if create { libc::IPC_CREAT | 0o600 } else { 0 };
    // SAFETY: shmget takes no pointers.
    let shm = unsafe { libc::shmget(key, if create { LEN } else { 0 }, flags) };
    (shm >= 0).then_some(shm)
}

fn segment_size(shm: i32) -> usize {
    crate::sys::shm_size(shm).unwrap_or(0)
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
    let shm = segment(state.id, true).ok_or_else(|| sys_err("shmget (the recovery record)"))?;
    if segment_size(shm) < LEN {
        return Err(ControlError::Io {
            what: format!("shared memory key {:#x}", KEY_BASE + state.id as i32),
            source: std::io::Error::other("a smaller segment of another program has this key"),
        });
    }
    crate::sys::shm_lock(shm).map_err(|source| ControlError::Io {
        what: "shmctl SHM_LOCK (the recovery record)".into(),
        source,
    })?;
    let map = Mapped::attach(shm, false).ok_or_else(|| sys_err("shmat (the recovery record)"))?;
    // SAFETY: the mapping is LEN bytes (checked) and ours while attached; the length goes in
    // last, so a record cut short by a crash reads as none.
    unsafe {
        ptr::write_volatile(map.0.add(8).cast::<u32>(), 0);
        ptr::copy_nonoverlapping(MAGIC.as_ptr(), map.0, MAGIC.len());
        ptr::copy_nonoverlapping(json.as_ptr(), map.0.add(HEADER), json.len());
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        ptr::write_volatile(map.0.add(8).cast::<u32>(), json.len() as u32);
    }
    Ok(())
}

fn read_record(id: u32) -> Option<Record> {
    let shm = segment(id, false)?;
    if segment_size(shm) < LEN {
        return None;
    }
    let map = Mapped::attach(shm, true)?;
    // SAFETY: the mapping is at least LEN bytes (checked) and stays attached while we copy.
    let page = unsafe { std::slice::from_raw_parts(map.0 as *const u8, LEN) }.to_vec();
    drop(map);
    let len = u32::from_ne_bytes(page[8..12].try_into().ok()?) as usize;
    if page[..8] != MAGIC || len > LEN - HEADER {
        return None;
    }
    let record: Record = serde_json::from_slice(&page[HEADER..HEADER + len]).ok()?;
    (record.state.id == id).then_some(record)
}

/// The published state in the recovery record of device `id`, if there is a readable one.
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
    let tmp = format!("{path}.uzram-{}", std::process::id());
    let io = |what: &str| {
        let what = format!("{what} {path}");
        move |source| ControlError::Io { what, source }
    };
    // root-only, as libublk makes it
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io("writing a new"))?;
    file.write_all(json.to_string().as_bytes())
        .map_err(io("writing a new"))?;
    std::fs::rename(&tmp, &path).map_err(io("replacing"))
}

/// Removes the recovery record of device `id` (its device is gone).
pub fn remove(id: u32) {
    if let Some(shm) = segment(id, false) {
        if let Err(error) = crate::sys::shm_remove(shm) {
            tracing::warn!(id, %error, "removing the recovery record failed");
        }
    }
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
        .filter(|&id| segment(id, false).is_some())
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
            size: 1 << 30,
            config: Some("/etc/uzram/swap0.toml".into()),
            store_shm: Some(17),
            ..DaemonState::example(id)
        };
        write(&state).unwrap();
        assert_eq!(read(id), Some(state.clone()));
        state.pid = 4343;
        state.create_args = Some(vec!["--size".into(), "1G".into()]);
        write(&state).unwrap();
        assert_eq!(read(id), Some(state));
        remove(id);
        assert_eq!(read(id), None);
    }
}

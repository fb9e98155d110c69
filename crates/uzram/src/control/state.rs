//! Published daemon state under `/run/uzram/`: `<id>.json`, `<id>.sock`, `<id>.log`.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ControlError;

/// Where daemons publish their state.
pub const RUN_DIR: &str = "/run/uzram";

/// The largest state file read: a record with a device's whole settings is a few KiB.
const MAX_STATE_BYTES: u64 = 64 << 10;

/// What a daemon publishes about itself in `<id>.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonState {
    /// The daemon's pid.
    pub pid: u32,
    /// When the daemon started (`sys::start_ticks`): with the pid it names the daemon even
    /// after the pid is reused. Records from before this field have none.
    #[serde(default)]
    pub started: Option<u64>,
    /// Device id N.
    pub id: u32,
    /// `/dev/ublkbN`.
    pub dev: String,
    /// Device size in bytes.
    pub size: u64,
    /// WriteBackend algorithm.
    pub algorithm: String,
    /// Backend as configured (`cpu`, `auto`, ...).
    pub backend: String,
    /// Memory limit in bytes, if any.
    pub mem_limit: Option<u64>,
    /// The config file the daemon was started from (`uzram run`), if any.
    pub config: Option<PathBuf>,
    /// The SysV shared memory segment that holds the device's store (`uzram recover`).
    #[serde(default)]
    pub store_shm: Option<i32>,
    /// The settings of a daemon made by `uzram create` (`uzram recover` starts the same
    /// daemon again, once they pass the validation a config file passes).
    #[serde(default)]
    pub settings: Option<Box<crate::config::RawDevice>>,
    /// A planned restart's bridge (`uzram run --bridge`): it took the device over from the
    /// unit's daemon and serves it until the unit's next daemon takes it over in turn.
    #[serde(default)]
    pub bridge: bool,
    /// This daemon took the device over from an earlier one (a recovery or a handover).
    #[serde(default)]
    pub recovered: bool,
}

impl DaemonState {
    /// Checks a record read back from outside this process (the recovery record) as data:
    /// it must be device `id`'s, name its device node, a store segment id and a config path
    /// that can be, and settings that pass the same validation as a config file on this
    /// `host`. Nothing of a record that fails is used.
    pub fn validate(&self, id: u32, host: crate::config::Host) -> Result<(), String> {
        if self.id != id {
            return Err(format!("it is the record of device {}, not {id}", self.id));
        }
        if self.dev != crate::devname::dev_path(id) {
            return Err(format!("it names the device node {:?}", self.dev));
        }
        if self.pid == 0 {
            return Err("it names no daemon process".into());
        }
        if self.store_shm.is_some_and(|shm| shm < 0) {
            return Err("it names no store segment".into());
        }
        if let Some(config) = &self.config {
            let section = crate::config::zram_generator::section_of_spec(config);
            if !config.is_absolute() && section.is_none() {
                return Err(format!(
                    "its config {config:?} is neither an absolute path nor a zram-generator section"
                ));
            }
        }
        if let Some(settings) = &self.settings {
            let cfg = settings
                .validate(host)
                .map_err(|e| format!("its settings are refused: {e}"))?;
            if cfg.size != self.size {
                return Err(format!(
                    "its settings make a device of {} bytes, the record says {}",
                    cfg.size, self.size
                ));
            }
        }
        Ok(())
    }

    /// Whether the daemon of this record still runs: its pid is alive, and where the record
    /// has its start time, that process started then (a reused pid is someone else).
    pub fn daemon_alive(&self) -> bool {
        crate::sys::process_alive(self.pid, self.started)
    }
}

#[cfg(test)]
impl DaemonState {
    /// A record of device `id` for tests: 1 MiB, lz4 on the CPU, no config, no store.
    pub fn example(id: u32) -> Self {
        DaemonState {
            pid: 0,
            started: None,
            id,
            dev: format!("/dev/ublkb{id}"),
            size: 1 << 20,
            algorithm: "lz4".into(),
            backend: "cpu".into(),
            mem_limit: None,
            config: None,
            store_shm: None,
            settings: None,
            bridge: false,
            recovered: false,
        }
    }
}

/// A directory of daemon state files.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> ControlError {
    move |source| ControlError::Io { what, source }
}

impl Default for StateDir {
    fn default() -> Self {
        StateDir::new(RUN_DIR)
    }
}

#[cfg(test)]
impl StateDir {
    /// A state directory made (0700) in a new temporary directory, which it lives as long as.
    pub fn temporary() -> (tempfile::TempDir, StateDir) {
        let dir = tempfile::tempdir().unwrap();
        let states = StateDir::new(dir.path().join("run"));
        states.create().unwrap();
        (dir, states)
    }
}

impl StateDir {
    /// State under `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        StateDir { dir: dir.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Creates the directory (mode 0700) if needed and makes sure it is root-only.
    pub fn create(&self) -> Result<(), ControlError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(io_err(format!("creating {}", self.dir.display())))?;
        // Never through a link planted at the name: chmod would follow it.
        self.checked(false)?;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(format!("restricting {}", self.dir.display())))?;
        self.check().map(drop)
    }

    /// Makes sure the directory is root's alone (or this process's user's, in tests): a
    /// real directory, not a link, that no one else owns, and that its group and others can
    /// neither change nor read. `Ok(false)` when there is none.
    pub fn check(&self) -> Result<bool, ControlError> {
        self.checked(true)
    }

    /// [`StateDir::check`], its mode checked only with `mode_too` (`create` restricts that
    /// next).
    fn checked(&self, mode_too: bool) -> Result<bool, ControlError> {
        let untrusted = |why: String| ControlError::UntrustedDir {
            path: self.dir.clone(),
            why,
        };
        let meta = match std::fs::symlink_metadata(&self.dir) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err(format!("looking at {}", self.dir.display()))(e)),
        };
        if !meta.is_dir() {
            let kind = crate::sys::owned_file::file_kind(&meta.file_type());
            return Err(untrusted(format!("is {kind}, not a directory")));
        }
        if meta.uid() != 0 && meta.uid() != crate::sys::effective_uid() {
            return Err(untrusted(format!("is owned by uid {}", meta.uid())));
        }
        let mode = meta.mode() & 0o7777;
        if mode_too && mode & 0o077 != 0 {
            return Err(untrusted(format!("has mode {mode:04o}, not 0700")));
        }
        Ok(true)
    }

    /// `<id>.json`.
    pub fn state_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// `<id>.sock`.
    pub fn socket_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{id}.sock"))
    }

    /// `<id>.lock`, the file [`StateDir::try_lock`] locks.
    pub fn lock_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{id}.lock"))
    }

    /// `<id>.log`.
    pub fn log_path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{id}.log"))
    }

    /// Locks device `id` for this process (`<id>.lock`): a daemon holds it while it serves
    /// or takes the device over, so that two daemons never adopt one store. `Ok(None)` when
    /// another process holds it. The file stays (removing it would let a later locker lock
    /// a different file than a waiting one).
    pub fn try_lock(&self, id: u32) -> Result<Option<std::fs::File>, ControlError> {
        self.check()?;
        let path = self.lock_path(id);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        match crate::sys::try_lock_exclusive(&file) {
            Ok(true) => Ok(Some(file)),
            Ok(false) => Ok(None),
            Err(e) => Err(io_err(format!("locking {}", path.display()))(e)),
        }
    }

    /// Writes `<id>.json` atomically (temporary file + rename).
    pub fn write(&self, state: &DaemonState) -> Result<(), ControlError> {
        self.check()?;
        let path = self.state_path(state.id);
        let text = serde_json::to_string_pretty(state)
            .map_err(|e| ControlError::Protocol(e.to_string()))?;
        crate::sys::write_replacing(&path, (text + "\n").as_bytes(), 0o600)
            .map_err(io_err(format!("writing {}", path.display())))
    }

    /// Reads `<id>.json`; `Ok(None)` when there is none. A file that is not a regular file
    /// at that name, that someone besides root could have written, that is larger than any
    /// state, or that names another device is damaged.
    pub fn read(&self, id: u32) -> Result<Option<DaemonState>, ControlError> {
        if !self.check()? {
            return Ok(None);
        }
        self.read_checked(id)
    }

    /// [`StateDir::read`] in a directory already checked.
    fn read_checked(&self, id: u32) -> Result<Option<DaemonState>, ControlError> {
        use crate::sys::owned_file::{self, Links, Refused};
        let path = self.state_path(id);
        let damaged = |why: String| ControlError::DamagedState {
            id,
            path: path.clone(),
            why,
        };
        let bytes = match owned_file::read(&path, MAX_STATE_BYTES, Links::Refuse) {
            Ok(bytes) => bytes,
            Err(Refused::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(Refused::Io(e)) => return Err(io_err(format!("reading {}", path.display()))(e)),
            Err(refused) => return Err(damaged(format!("it {refused}"))),
        };
        let state: DaemonState =
            serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
        if state.id != id {
            return Err(damaged(format!("it names device {}", state.id)));
        }
        Ok(Some(state))
    }

    /// Every published state, sorted by id. A missing directory means none; unreadable files are
    /// skipped with a warning.
    pub fn list(&self) -> Result<Vec<DaemonState>, ControlError> {
        let (states, unreadable) = self.list_all()?;
        for err in unreadable {
            tracing::warn!(error = %err, "skipping unreadable state file");
        }
        Ok(states)
    }

    /// Every published state, sorted by id, and each damaged state file (one that was read
    /// but does not parse); a file that cannot be read at all is skipped with a warning.
    pub fn list_all(&self) -> Result<(Vec<DaemonState>, Vec<ControlError>), ControlError> {
        if !self.check()? {
            return Ok((Vec::new(), Vec::new()));
        }
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok((Vec::new(), Vec::new()))
            }
            Err(e) => return Err(io_err(format!("reading {}", self.dir.display()))(e)),
        };
        let mut states = Vec::new();
        let mut unreadable = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            match self.read_checked(id) {
                Ok(Some(state)) => states.push(state),
                Ok(None) => {}
                Err(err @ ControlError::DamagedState { .. }) => unreadable.push((id, err)),
                Err(err) => tracing::warn!(error = %err, "skipping unreadable state file"),
            }
        }
        states.sort_by_key(|s| s.id);
        unreadable.sort_by_key(|&(id, _)| id);
        Ok((states, unreadable.into_iter().map(|(_, e)| e).collect()))
    }

    /// Removes `<id>.json` and `<id>.sock` (missing files are fine).
    pub fn remove(&self, id: u32) {
        for path in [self.state_path(id), self.socket_path(id)] {
            if let Err(e) = std::fs::remove_file(&path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove state file");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_list_read_remove() {
        let dir = std::env::temp_dir().join(format!("uzram-state-{}", std::process::id()));
        let sd = StateDir::new(dir.join("run"));
        assert!(sd.list().unwrap().is_empty(), "missing dir lists nothing");
        sd.create().unwrap();
        let mode = std::fs::metadata(sd.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let mk = |id| DaemonState {
            pid: 100 + id,
            started: Some(1000 + u64::from(id)),
            store_shm: Some(id as i32),
            settings: Some(Box::new(crate::config::RawDevice {
                size: "1M".into(),
                ..Default::default()
            })),
            bridge: id == 2,
            ..DaemonState::example(id)
        };
        sd.write(&mk(10)).unwrap();
        sd.write(&mk(2)).unwrap();
        std::fs::write(sd.path().join("junk.json"), "x").unwrap();
        std::fs::write(sd.state_path(7), "{not json").unwrap();
        let ids: Vec<u32> = sd.list().unwrap().iter().map(|s| s.id).collect();
        assert_eq!(ids, vec![2, 10]);
        assert_eq!(sd.read(10).unwrap(), Some(mk(10)));
        assert!(sd.read(7).is_err());
        let held = sd.try_lock(10).unwrap();
        assert!(held.is_some(), "a free device lock is taken");
        // flock locks belong to open file descriptions: a second open is a second locker
        assert!(
            sd.try_lock(10).unwrap().is_none(),
            "a held device lock is refused"
        );
        drop(held);
        assert!(
            sd.try_lock(10).unwrap().is_some(),
            "a released device lock is free again"
        );
        sd.remove(10);
        assert_eq!(sd.read(10).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Nothing is read from, or written to, a state directory others could change or read,
    /// nor through a link planted at its name; `create` never restricts a link's target.
    #[test]
    fn a_state_directory_that_is_not_roots_alone_is_refused() {
        let (dir, sd) = StateDir::temporary();
        sd.write(&DaemonState::example(1)).unwrap();
        let file_mode = std::fs::metadata(sd.state_path(1)).unwrap().mode() & 0o777;
        assert_eq!(file_mode, 0o600, "a state file is root's alone");
        std::fs::set_permissions(sd.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        for err in [
            sd.read(1).unwrap_err(),
            sd.list().unwrap_err(),
            sd.write(&DaemonState::example(2)).unwrap_err(),
            sd.try_lock(1).unwrap_err(),
        ] {
            assert!(
                matches!(&err, ControlError::UntrustedDir { why, .. } if why.contains("0755")),
                "{err}"
            );
        }
        // `create` puts the mode right again.
        sd.create().unwrap();
        assert_eq!(sd.read(1).unwrap(), Some(DaemonState::example(1)));

        let target = dir.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755)).unwrap();
        let linked = StateDir::new(dir.path().join("linked"));
        std::os::unix::fs::symlink(&target, linked.path()).unwrap();
        let err = linked.create().unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        let mode = std::fs::metadata(&target).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o755, "create changed the mode of a link's target");
        assert!(linked.list().is_err());
    }

    /// A state file that names another device, that is a link, or that is larger than any
    /// state is damaged, never taken for the device of its name.
    #[test]
    fn a_state_file_is_read_only_as_its_own_devices() {
        let (_dir, sd) = StateDir::temporary();
        sd.write(&DaemonState::example(5)).unwrap();
        std::fs::rename(sd.state_path(5), sd.state_path(3)).unwrap();
        let err = sd.read(3).unwrap_err();
        assert!(
            matches!(&err, ControlError::DamagedState { id: 3, why, .. } if why.contains("names device 5")),
            "{err}"
        );
        sd.write(&DaemonState::example(5)).unwrap();
        std::fs::remove_file(sd.state_path(3)).unwrap();
        std::os::unix::fs::symlink(sd.state_path(5), sd.state_path(3)).unwrap();
        assert!(matches!(
            sd.read(3).unwrap_err(),
            ControlError::DamagedState { id: 3, .. }
        ));
        std::fs::remove_file(sd.state_path(3)).unwrap();
        std::fs::write(sd.state_path(3), vec![b' '; 1 << 20]).unwrap();
        let err = sd.read(3).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
        let (states, damaged) = sd.list_all().unwrap();
        assert_eq!(states, vec![DaemonState::example(5)]);
        assert_eq!(damaged.len(), 1);
    }

    #[test]
    fn a_record_from_before_the_start_time_reads_without_one() {
        let now = DaemonState {
            started: Some(12345),
            ..DaemonState::example(3)
        };
        let mut json = serde_json::to_value(&now).unwrap();
        assert_eq!(json["started"], 12345);
        json.as_object_mut().unwrap().remove("started");
        let old: DaemonState = serde_json::from_value(json).unwrap();
        assert_eq!(old.started, None);
        assert_eq!(
            old,
            DaemonState {
                started: None,
                ..now
            }
        );
    }
}

//! A device whose daemon died, as a recovery finds it: its recovery record, whether the kernel
//! holds it quiesced, and its store's recovery room, which a recovery gives back to the
//! system before anything else (mapped ahead when the recoverer waits for the crash).
//! `uzram recover`, `uzram daemon --wait`, `uzram run` and the standby all go through here.

use std::path::Path;

use crate::control::state::DaemonState;
use crate::devname::{dev_path, in_kernel};
use crate::memory::free_lists;
use libublk::ctrl::UblkCtrl;

use crate::takeover::{record, store_segment};

/// The recovery record of device `id`, for a recovery that waits for its daemon to exit:
/// refuses at once what a recovery would refuse after the wait (a device without a record,
/// or one started from a config).
pub fn waitable_record(id: u32) -> anyhow::Result<DaemonState> {
    let dev = dev_path(id);
    let Some(state) = record::read(id) else {
        anyhow::bail!(
            "{dev} has no recovery record: not a uzram device, or its daemon does not serve yet"
        );
    };
    if let Some(config) = &state.config {
        anyhow::bail!(
            "{dev} was started from {}: its systemd unit's standby recovers it",
            config.display()
        );
    }
    Ok(state)
}

/// What a process that waits to take a device over gives back the moment the device's
/// daemon is gone, before it does anything else: the store's recovery room, mapped ahead,
/// with the per-CPU free lists held short first. Mapped and opened before the wait, since
/// both need memory, and memory may have run out by then (a CI run hung with the next
/// daemon in reclaim before it got to give the room back); [`make_room`] does both at once,
/// for a recovery started after the crash.
pub struct RoomAhead {
    dev: String,
    room: Option<store_segment::MappedRoom>,
    lists: free_lists::OpenedLists,
    given: std::cell::Cell<bool>,
}

impl RoomAhead {
    /// Maps the room of `state`'s store (failing that, warns: the recovery gives nothing back).
    pub fn map(state: &DaemonState) -> RoomAhead {
        let room = state.store_shm.and_then(|shm| {
            store_segment::MappedRoom::map(shm, Some(state.id))
                .inspect_err(|err| tracing::warn!(dev = %state.dev, error = %err, "mapping the store's recovery room failed: a takeover will not give it back"))
                .ok()
        });
        RoomAhead {
            dev: state.dev.clone(),
            room,
            lists: free_lists::OpenedLists::open(),
            given: std::cell::Cell::new(false),
        }
    }

    /// Gives the room back (again, if a takeover before did), once: when the daemon is dying
    /// ([`Self::wait_for_daemon`]) or else when it is gone.
    pub fn give_back(&self) {
        let Some(room) = &self.room else { return };
        if self.given.replace(true) {
            return;
        }
        // Before the room goes: its pages must reach the zone's free lists, where the new
        // daemon's page faults count them (`memory::free_lists`).
        self.lists.shorten();
        match room.release() {
            Ok(bytes) => {
                GIVEN_BACK.store(i64::from(room.shm()), std::sync::atomic::Ordering::Relaxed);
                tracing::info!(dev = %self.dev, bytes, "the store's recovery room is free for the new daemon")
            }
            Err(err) => {
                tracing::warn!(dev = %self.dev, error = %err, "giving back the store's recovery room failed")
            }
        }
    }

    /// Waits until the daemon `pid` (started at `started`) has exited, and gives the room
    /// back as soon as it is dying: its first thread gone while others are still there. A
    /// killed daemon's thread inside a page fault can only exit once that fault got a page,
    /// and with memory run out and the device paused none comes free but the room's (seen on
    /// 7.3: a killed daemon's pool keeper took 5-8 s to go, and the device's pause with it).
    /// Returns when the exit was seen (the pause's start, for the new daemon's clock).
    pub fn wait_for_daemon(
        &self,
        pid: u32,
        started: Option<u64>,
    ) -> anyhow::Result<std::time::Instant> {
        crate::sys::wait_for_exit_noting_death(pid, started, &mut || {
            self.give_back();
            tracing::info!(dev = %self.dev, pid, "the daemon's first thread is gone: its room was given back while the rest exits");
        })
        .map_err(|e| anyhow::anyhow!("waiting for pid {pid}: {e}"))?;
        let gone = std::time::Instant::now();
        self.give_back();
        Ok(gone)
    }
}

/// The segment whose room this process gave back last ([`make_room`], [`RoomAhead`]).
static GIVEN_BACK: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(-1);

/// Gives the recovery room of `state`'s store back to the system, so that the new daemon
/// can start when memory ran out with the old one dead (see `takeover::store_segment`): a
/// [`RoomAhead`] mapped and given back at once. Failing that only warns: with memory to
/// spare the daemon starts anyway.
///
/// Once per segment and process: a takeover that gave the room back before it asked for the
/// handover (`uzram run`) does not map the segment again inside the pause.
pub fn make_room(state: &DaemonState) {
    let Some(shm) = state.store_shm else { return };
    if GIVEN_BACK.load(std::sync::atomic::Ordering::Relaxed) == i64::from(shm) {
        return;
    }
    RoomAhead::map(state).give_back();
}

/// The recovery record of device `id` when the device waits for a new daemon: its daemon is
/// gone, the kernel holds the device quiesced, and its store is still in shared memory.
/// Otherwise why not. Reads nothing that can be in swap (`takeover::record`).
pub fn check_orphan(id: u32) -> Result<DaemonState, String> {
    if !in_kernel(id) {
        return Err("no such device in the kernel".into());
    }
    let Some(state) = record::read(id) else {
        return Err(
            "it has no recovery record (not a uzram device, or its daemon never served)".into(),
        );
    };
    if state.daemon_alive() {
        return Err(format!("its daemon (pid {}) is running", state.pid));
    }
    let Some(shm) = state.store_shm else {
        return Err("its daemon kept no store in shared memory".into());
    };
    if !store_segment::exists(shm) {
        return Err(format!("its store (shared memory segment {shm}) is gone"));
    }
    quiesced_info(id)?;
    Ok(state)
}

/// How long [`wait_orphan`] waits for the kernel to quiesce a device whose daemon is gone.
/// Usually a moment. On 6.12, a queue whose every request the dead daemon had taken gets no
/// cancel callback when the daemon's io_uring goes, and the device stays live until one of
/// those requests times out (the disk's `io_timeout`, 30 s unless set: `ublk::tuning` sets
/// it short). A recoverer that gave up first left the device paused for good: in the guest,
/// the standby gave up while systemd, whose pages were in swap on the device, could start no
/// other daemon. So the wait outlasts any timeout a disk is likely to have.
pub const QUIESCE_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// How often [`wait_orphan`] says it still waits.
const QUIESCE_NOTE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// [`check_orphan`], given up to [`QUIESCE_WAIT`] for the kernel to quiesce the device.
pub fn wait_orphan(id: u32) -> Result<DaemonState, String> {
    // The device's I/O is paused until it is taken over: look often (100 ms naps added up
    // to 100 ms to every takeover).
    wait_quiesced(
        || check_orphan(id),
        QUIESCE_WAIT,
        std::time::Duration::from_millis(5),
        QUIESCE_NOTE_EVERY,
        |waited| tracing::warn!(dev = %dev_path(id), waited_s = waited.as_secs(), "the kernel has not quiesced the device yet: waiting (a request the dead daemon held must time out first)"),
    )
}

/// Calls `check` until it answers anything but [`NOT_QUIESCED`], or `limit` has passed,
/// napping `nap` between looks (ten times that after the first second: a device still live
/// then waits for a request timeout, and each look opens the control device and rewrites
/// libublk's file) and calling `note` with the time waited every `note_every`.
fn wait_quiesced<T>(
    mut check: impl FnMut() -> Result<T, String>,
    limit: std::time::Duration,
    nap: std::time::Duration,
    note_every: std::time::Duration,
    mut note: impl FnMut(std::time::Duration),
) -> Result<T, String> {
    let start = std::time::Instant::now();
    let mut noted = std::time::Duration::ZERO;
    loop {
        match check() {
            Err(why) if why.starts_with(NOT_QUIESCED) && start.elapsed() < limit => {
                let waited = start.elapsed();
                if waited >= noted + note_every {
                    noted = waited;
                    note(waited);
                }
                let slow = waited >= std::time::Duration::from_secs(1);
                std::thread::sleep(if slow { nap * 10 } else { nap });
            }
            done => return done,
        }
    }
}

/// The recovery record of the device started from `config` whose daemon is gone and whose
/// store is still there; the device may not be quiesced yet ([`wait_orphan`]).
pub fn dead_record_of_config(config: &Path) -> Option<DaemonState> {
    record_of_config(config, false)
}

/// The recovery record of the device started from `config` whose store is still there and
/// whose daemon process still exists: serving, starting, or killed and not yet gone (a
/// killed daemon's threads can take a while to exit, and until they have, its device does
/// not wait for a new daemon).
pub fn running_record_of_config(config: &Path) -> Option<DaemonState> {
    record_of_config(config, true)
}

fn record_of_config(config: &Path, alive: bool) -> Option<DaemonState> {
    record::device_ids()
        .into_iter()
        .filter_map(record::read)
        .find(|s| {
            s.config.as_deref() == Some(config)
                && s.daemon_alive() == alive
                && s.store_shm.is_some_and(store_segment::exists)
        })
}

/// How a device that cannot be taken over is described (`uzram recover` waits while it
/// says this: the kernel quiesces a device a moment after its daemon is gone).
pub const NOT_QUIESCED: &str = "the kernel does not hold it for recovery";

/// Device `id`'s ublk info when the kernel holds it quiesced for a new daemon; otherwise
/// why not. Restores libublk's device file first, which libublk reads and which may have
/// been in swap on this very device (`record.rs`).
pub fn quiesced_info(id: u32) -> Result<libublk::sys::ublksrv_ctrl_dev_info, String> {
    if let Err(err) = record::restore_ublk_json(id) {
        tracing::warn!(error = %err, "restoring libublk's device file failed");
    }
    let ctrl = UblkCtrl::new_simple(id as i32)
        .map_err(|e| format!("opening its ublk control device: {e} ({e:?})"))?;
    let info = ctrl.dev_info();
    let st = u32::from(info.state);
    if st != libublk::sys::UBLK_S_DEV_QUIESCED {
        return Err(format!("{NOT_QUIESCED} (ublk state {st})"));
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn not_quiesced() -> Result<u32, String> {
        Err(format!("{NOT_QUIESCED} (ublk state 0)"))
    }

    #[test]
    fn a_recoverer_waits_for_the_quiesce_however_many_looks_it_takes_and_says_so() {
        let mut looks = 0;
        let mut notes = Vec::new();
        let got = wait_quiesced(
            || {
                looks += 1;
                if looks < 40 {
                    not_quiesced()
                } else {
                    Ok(looks)
                }
            },
            Duration::from_secs(60),
            Duration::from_millis(1),
            Duration::from_millis(10),
            |waited| notes.push(waited),
        );
        assert_eq!(got, Ok(40));
        assert!(!notes.is_empty(), "a long wait is logged");
        assert!(notes
            .windows(2)
            .all(|w| w[1] >= w[0] + Duration::from_millis(10)));
    }

    #[test]
    fn any_other_answer_ends_the_wait_at_once_and_the_limit_ends_it_too() {
        let mut looks = 0;
        let got: Result<u32, String> = wait_quiesced(
            || {
                looks += 1;
                Err("no such device in the kernel".into())
            },
            Duration::from_secs(60),
            Duration::from_millis(1),
            Duration::from_secs(5),
            |_| {},
        );
        assert_eq!(
            (got, looks),
            (Err("no such device in the kernel".into()), 1)
        );
        let start = std::time::Instant::now();
        let got = wait_quiesced(
            not_quiesced,
            Duration::from_millis(30),
            Duration::from_millis(1),
            Duration::from_secs(5),
            |_| {},
        );
        assert!(got.unwrap_err().starts_with(NOT_QUIESCED));
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn the_wait_outlasts_the_kernels_default_request_timeout() {
        // blk-mq's default io_timeout, which on 6.12 may be what ends a dead daemon's pause
        assert!(QUIESCE_WAIT >= Duration::from_secs(30) * 10);
    }
}

//! `uzram daemon` (hidden): the detached daemon `uzram create` and `uzram recover` start, and
//! its wait to take a device over from a daemon that still runs (`--recover N --wait`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::cli::DaemonArgs;
use crate::control::state::StateDir;
use crate::daemon::{self, Launch, Readiness, Reporter};
use crate::sys;
use crate::takeover::orphan;

/// The detached daemon `create` starts (hidden subcommand).
pub fn run(args: DaemonArgs) -> anyhow::Result<ExitCode> {
    let fd = sys::adopt_fd(args.ready_fd).context("the --ready-fd descriptor")?;
    let reporter = Arc::new(Reporter::new(Readiness::Pipe(fd)));
    let result = (|| {
        let config = args
            .device
            .raw()
            .validate(crate::config::Host::current()?)?;
        super::require_root()?;
        super::require_module()?;
        if let Err(err) = sys::new_session() {
            tracing::warn!(error = %err, "setsid failed");
        }
        // A recovery's steps are timed from this process's start, the first step being its
        // start-up ("exec"): when the old daemon died, only whoever started us knows
        // (crashkill prints the whole pause). One started before the crash (`--wait`) times
        // them from when it saw the old daemon gone.
        let mut pause = args
            .recover
            .map(|_| crate::takeover::pause::PauseClock::since_start());
        let mut lock = None;
        if let (true, Some(id)) = (args.wait, args.recover) {
            match wait_to_take_over(&config, id)? {
                Some((clock, locked)) => {
                    pause = Some(clock);
                    lock = Some(locked);
                }
                None => {
                    tracing::info!(id, "the device was stopped: nothing to take over");
                    reporter.stopped();
                    return Ok(());
                }
            }
        }
        let launch = Launch {
            config,
            config_path: None,
            log: args.log.clone(),
            recover: args.recover,
            settings: Some(Box::new(args.device.raw())),
            bridge: false,
            pause,
            lock,
        };
        daemon::serve(launch, reporter.clone())
    })();
    if let Err(err) = &result {
        tracing::error!("{err:#}");
        reporter.failed(err);
    }
    result.map(|()| ExitCode::SUCCESS)
}

/// `uzram daemon --recover N --wait`, before the crash: makes what serving device N will need
/// (heap, locked I/O buffers, the binary's code in memory) while memory is to be had, waits
/// until N's daemon exits, and then gives the store's recovery room back (mapped before, so
/// that needs no memory), and if the device waits for a new daemon, locks it and returns the
/// pause's clock and the lock. `None`: the device went
/// with its daemon.
///
/// Why before: a daemon started after a crash under swap pressure must get every page of its
/// start-up from a system where nothing can be swapped out until it serves. The room it is
/// given back for that can be taken first by the very processes that wait on the device
/// (seen on 7.3: docs/recovery.md). Started before, it takes only what it did not make.
fn wait_to_take_over(
    config: &crate::config::DeviceConfig,
    id: u32,
) -> anyhow::Result<Option<(crate::takeover::pause::PauseClock, std::fs::File)>> {
    sys::mlock_all().context("mlockall(MCL_CURRENT|MCL_FUTURE)")?;
    daemon::prepare_takeover(config);
    // Before the wait: the crash wakes this thread ahead of every ordinary task.
    daemon::take_over_at_realtime();
    let dev = crate::devname::dev_path(id);
    let states = StateDir::default();
    states.create()?;
    // The dead daemon's pid and the pause since it died, when another recoverer took the
    // lock first: this one waits for that one's record, then for its death.
    let mut lost: Option<(u32, crate::takeover::pause::PauseClock)> = None;
    let (mut clock, lock) = loop {
        let record = orphan::waitable_record(id)?;
        let clock = match lost.take() {
            // the winner does not serve yet (or gave up, and the lock is free again)
            Some((pid, clock)) if pid == record.pid => clock,
            other => {
                if let (Some(_), Some(shm)) = (other, record.store_shm) {
                    // The winner serves (its record is out). Had this recoverer given the
                    // room back late, after the winner committed it again, the next crash
                    // would find none: committing it once more costs nothing if it is there.
                    crate::takeover::store_segment::restore_room(shm, Some(record.id));
                }
                tracing::info!(%dev, pid = record.pid, "waiting for the device's daemon to exit");
                // The room is given back as the first thing once the daemon is dying, before
                // anything allocates: memory for everything after. (A recoverer that loses
                // the race for the lock gave it back too, at the same moment as the winner,
                // long before the winner serves and commits it again.)
                let room = orphan::RoomAhead::map(&record);
                let woke = room.wait_for_daemon(record.pid, record.started)?;
                // A stopped daemon deletes its device before it exits: nothing to recover,
                // and the per-CPU lists held short for the room go back to the default.
                if !crate::devname::in_kernel(id) {
                    crate::memory::free_lists::restore();
                    return Ok(None);
                }
                let mut clock = crate::takeover::pause::PauseClock::starting(woke);
                clock.step("room");
                clock
            }
        };
        match states.try_lock(id)? {
            Some(lock) => break (clock, lock),
            None => {
                lost = Some((record.pid, clock));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    tracing::warn!(%dev, "the device's daemon died: taking the device over");
    let state = orphan::wait_orphan(id)
        .map_err(|why| anyhow::anyhow!("{dev} cannot be recovered: {why}"))?;
    clock.step("quiesced");
    // Only if the room could not be mapped ahead (given back already: nothing done).
    orphan::make_room(&state);
    Ok(Some((clock, lock)))
}

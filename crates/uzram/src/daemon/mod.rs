//! The daemon's lifecycle: lock memory, add the ublk device, serve its queues, publish state,
//! and on SIGTERM/SIGINT or a control `stop` delete the device and clean up.

mod batch_io;
mod carry;
mod compactor;
pub mod compression;
#[cfg(test)]
mod crash_tests;
pub mod fault_guard;
pub mod free_lists;
pub mod io;
pub mod leave;
pub mod notify;
pub mod pause;
pub mod pool;
pub mod queue_mode;
pub mod queue_tuning;
pub mod realtime;
pub mod region;
pub mod reserve;
pub mod ring;
pub mod staging;
pub mod standby;
pub mod store_memory;
pub mod target;

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use libublk::{UblkError, UblkFlags};

use crate::config::DeviceConfig;
use crate::control::anchor;
use crate::control::proto::{DeviceStatus, Request, Response, Stat};
use crate::control::state::{DaemonState, StateDir};
use crate::control::{server, ControlError};
use crate::sys;
use queue_mode::{QueueMode, QueueModeChoice, QueuePlan};
use target::Counters;

/// How the daemon tells its starter that the device is ready (or that it failed).
pub enum Readiness {
    /// `uzram create`: a pipe to the waiting `create`: `READY <id>` or `ERROR <message>`
    /// (or, for `uzram daemon --wait`, `STOPPED`: the device went with its daemon).
    Pipe(OwnedFd),
    /// `uzram run`: sd_notify `READY=1` (when `NOTIFY_SOCKET` is set).
    Systemd,
    /// `uzram create --foreground`: print the device path on stdout.
    Stdout,
}

/// Reports readiness exactly once.
pub struct Reporter {
    how: Mutex<Option<Readiness>>,
}

impl Reporter {
    /// A reporter that reports through `how`.
    pub fn new(how: Readiness) -> Self {
        Reporter {
            how: Mutex::new(Some(how)),
        }
    }

    fn take(&self) -> Option<Readiness> {
        self.how.lock().map_or(None, |mut g| g.take())
    }

    /// The device is serving at `dev`.
    pub fn ready(&self, id: u32, dev: &str) {
        let result = match self.take() {
            Some(Readiness::Pipe(fd)) => {
                std::fs::File::from(fd).write_all(format!("READY {id} {dev}\n").as_bytes())
            }
            Some(Readiness::Systemd) => {
                notify::notify(&format!("READY=1\nSTATUS=serving {dev}")).map(|_| ())
            }
            Some(Readiness::Stdout) => writeln!(std::io::stdout(), "{dev}"),
            None => Ok(()),
        };
        if let Err(err) = result {
            tracing::warn!(error = %err, "reporting readiness failed");
        }
    }

    /// The device this daemon waited to take over was stopped (`uzram daemon --wait`).
    pub fn stopped(&self) {
        if let Some(Readiness::Pipe(fd)) = self.take() {
            if let Err(err) = std::fs::File::from(fd).write_all(b"STOPPED\n") {
                tracing::warn!(error = %err, "reporting the stop failed");
            }
        }
    }

    /// The daemon could not start.
    pub fn failed(&self, err: &anyhow::Error) {
        if let Some(Readiness::Pipe(fd)) = self.take() {
            let line = format!("ERROR {err:#}").replace('\n', " ");
            let _ = std::fs::File::from(fd).write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// What the daemon serves and where it reports.
pub struct Launch {
    /// The device.
    pub config: DeviceConfig,
    /// The config file, for `uzram run` (published so `swap-on` can find the device).
    pub config_path: Option<PathBuf>,
    /// The log file `create` opened for us, renamed to `<id>.log` once the id is known.
    pub log: Option<PathBuf>,
    /// Take over device N, whose daemon died, and the store it left (`uzram recover`).
    pub recover: Option<u32>,
    /// The device's settings as given to `uzram create`, published in the recovery record
    /// so that `uzram recover` can start the same daemon again.
    pub settings: Option<Box<crate::config::RawDevice>>,
    /// Published as [`DaemonState::bridge`]: serving for a planned restart until the unit's
    /// next daemon takes over (`uzram run --bridge`).
    pub bridge: bool,
    /// When the device stopped being served, and the steps of the takeover so far: the
    /// handover this daemon asked for, or the crash its standby saw (the log says how long
    /// I/O was paused, and where the time went, once it serves).
    pub pause: Option<pause::PauseClock>,
    /// The device's lock (`StateDir::try_lock`), when the caller took it before handing a
    /// recovery here; otherwise `serve` takes it.
    pub lock: Option<std::fs::File>,
}

/// Serves one device until it is stopped. Returns after the device is deleted.
pub fn serve(launch: Launch, reporter: Arc<Reporter>) -> anyhow::Result<()> {
    let cfg = launch.config;
    let mut pause = launch.pause;
    let mut step = |name: &'static str| pause::step(&mut pause, name);
    if let Some(path) = &cfg.metrics_textfile {
        crate::metrics::check_textfile_dir(path).map_err(anyhow::Error::msg)?;
    }
    // malloc was configured first thing in `main` (see there).
    sys::block_stop_signals().context("blocking SIGTERM/SIGINT")?;
    sys::private_mount_namespace().context("entering a private mount namespace")?;
    sys::mlock_all().context("mlockall(MCL_CURRENT|MCL_FUTURE)")?;
    if let Err(err) = sys::protect_from_oom_killer() {
        tracing::warn!(error = %err, "setting oom_score_adj to -1000 failed: the OOM killer may pick the daemon");
    }
    step("mlock");
    if launch.recover.is_some() {
        // (already done when this daemon waited for the crash)
        take_over_at_realtime();
    }
    // PR_SET_IO_FLUSHER was set in `main`, before any thread existed (see there).
    let (plan, features) = choose_queue_mode(&cfg)?;
    step("queue mode");
    let states = StateDir::default();
    states.create()?;
    // Two daemons must never adopt one store: whoever recovers holds the device's lock.
    let mut lock = launch.lock;
    if let (None, Some(id)) = (&lock, launch.recover) {
        lock =
            Some(states.try_lock(id)?.with_context(|| {
                format!("/dev/ublkb{id} is being taken over by another daemon")
            })?);
    }
    // A new device is added first, and its store made for it: the store's header names its
    // device from the start, so no store exists that `uzram list` cannot tie to a device
    // (should this process be killed on the way), and a failed start deletes both
    // (`Unborn`). A device taken over is asked for (`START_USER_RECOVERY`) only once
    // everything else is ready, just before its queues serve: see `Device`.
    let mut added = match launch.recover {
        None => {
            let (ctrl, plan) = add_device(&cfg, plan, features)?;
            Some((Device::Added(Box::new(ctrl)), plan))
        }
        Some(_) => None,
    };
    let mut unborn = Unborn {
        device: added.as_ref().map(|(d, _)| d.id()),
        store: None,
    };
    // Arena segments: the pool, over the blocks of the store's shared memory. A recovery
    // takes it over first: it frees memory for what follows (`store_memory::recover`).
    let (store, region, found_staging) = match (launch.recover, &added) {
        (None, Some((device, _))) => {
            let (store, region) = store_memory::create(&cfg, device.id())?;
            unborn.store = Some(region.id());
            (store, region, None)
        }
        (None, None) => unreachable!("a new device is added above"),
        (Some(id), _) => {
            // The recovery record, not the state file: see `control::anchor`.
            let old = anchor::read(id)
                .with_context(|| format!("/dev/ublkb{id} has no recovery record"))?;
            let shm = old.store_shm.with_context(|| {
                format!("/dev/ublkb{id} was made by a daemon that kept no store to recover")
            })?;
            let taken = store_memory::recover(&cfg, id, shm, &mut step)?;
            let found = taken.found;
            tracing::info!(
                shm,
                pages_stored = found.pages_stored,
                segments = found.segments,
                staged_pages_installed = found.settled_pages,
                lost_pages = found.lost_pages,
                "store recovered"
            );
            if found.lost_pages > 0 {
                tracing::error!(
                    lost_pages = found.lost_pages,
                    "pages that waited for the GPU when the old daemon died are lost (their staging was not there): reading them fails until they are written again"
                );
            }
            (taken.store, taken.region, taken.staging)
        }
    };
    // Small allocations: a pre-grown heap that is never trimmed.
    reserve::grow_once(HEAP_RESERVE);
    step("heap");
    let compression = Arc::new(
        compression::Compression::start(
            store.clone(),
            cfg.backend,
            &cfg.gpu,
            Some(Arc::new(io_path_thread)),
            compression::StagingHome::Region {
                region: &region,
                found: found_staging,
            },
        )
        .context("setting up the compression backend")?,
    );
    step("backend");
    let pool_target = pool::target_blocks(cfg.size, pool::ram_bytes());
    // A recovery serves with the pool it adopted: refilling now could wait for reclaim,
    // which waits for this device. The keeper refills once the device serves.
    if launch.recover.is_none() && !pool::fill_to(pool_target) {
        anyhow::bail!("could not fill the block pool: not enough memory");
    }
    tracing::info!(
        pool_bytes = pool::free_blocks() * pool::BLOCK,
        heap_headroom = reserve::headroom(),
        "memory reserves ready"
    );

    let (device, plan) = match (added.take(), launch.recover) {
        (Some(added), _) => added,
        (None, Some(id)) => recovery_plan(id, plan)?,
        (None, None) => unreachable!("a new device is added above"),
    };
    step("device");
    // From here the device and its store are this daemon's to serve, and its stop (or a
    // crash) is what ends them.
    unborn.device = None;
    unborn.store = None;
    let counters = Arc::new(Counters::new(
        cfg.queues.saturating_mul(plan.threads_per_queue),
    ));
    let id = device.id();
    let dev = format!("/dev/ublkb{id}");
    tracing::info!(id, %dev, size = cfg.size, queues = cfg.queues, depth = cfg.depth, "device added");
    if lock.is_none() {
        match states.try_lock(id) {
            Ok(Some(l)) => lock = Some(l),
            Ok(None) => tracing::warn!(id, "another process holds the new device's lock"),
            Err(err) => tracing::warn!(id, error = %err, "locking the device failed"),
        }
    }
    // Held until the process exits, however it exits.
    let _lock = lock;
    if launch.recover.is_some() {
        // The dead daemon's socket; its state file stays until ours replaces it.
        let _ = std::fs::remove_file(states.socket_path(id));
    } else {
        // The kernel just gave us this id, so any files published under it are stale.
        states.remove(id);
    }

    let state = DaemonState {
        pid: std::process::id(),
        started: crate::sys::start_ticks(std::process::id()),
        id,
        dev: dev.clone(),
        size: cfg.size,
        algorithm: cfg.algorithm.to_string(),
        backend: compression.name().to_string(),
        mem_limit: cfg.mem_limit,
        config: launch.config_path.clone(),
        store_shm: Some(region.id()),
        settings: launch.settings.clone(),
        recovered: launch.recover.is_some(),
        bridge: launch.bridge,
    };
    let (stop_tx, stop_rx) = mpsc::channel::<&'static str>();
    let textfile = cfg
        .metrics_textfile
        .clone()
        .map(|path| Arc::new(crate::metrics::Textfile::new(path)));
    let listener = server::bind(&states.socket_path(id))?;
    {
        let template = DeviceStatus {
            id,
            dev: dev.clone(),
            pid: state.pid,
            size: cfg.size,
            algorithm: state.algorithm.clone(),
            backend: compression.name().to_string(),
            queues: cfg.queues,
            depth: cfg.depth,
            queue_mode: plan.mode.name().to_string(),
            stats: Vec::new(),
            requests: Vec::new(),
            backend_stats: Vec::new(),
        };
        let (store, counters, stop_tx) = (store.clone(), counters.clone(), stop_tx.clone());
        let compression = compression.clone();
        let stop_tx = Mutex::new(stop_tx);
        // Counts the daemons before us left (nothing for a new device).
        let carried_in = carry::Carry::new(region.carried_counters()).load();
        if !carried_in.is_empty() {
            tracing::info!(
                writes = carried_in.get("write_requests").copied().unwrap_or(0),
                reads = carried_in.get("read_requests").copied().unwrap_or(0),
                "counters go on from the last daemon's"
            );
        }
        let snapshot = Arc::new(move || {
            let mut stats: Vec<Stat> = store
                .stats()
                .fields()
                .into_iter()
                .map(|(name, value)| Stat {
                    name: name.to_string(),
                    value,
                })
                .collect();
            let mut requests = counters.snapshot();
            carry::add_base(&mut stats, &carried_in);
            carry::add_base(&mut requests, &carried_in);
            requests.extend(pool_stats().into_iter().chain(queue_stats(plan)));
            DeviceStatus {
                stats,
                requests,
                backend_stats: compression.stats(),
                ..template.clone()
            }
        });
        if let Some(file) = textfile.clone() {
            let snapshot = snapshot.clone();
            spawn("uzram-metrics", move || file.keep_writing(|| snapshot()))?;
        }
        let (counted, table) = (snapshot.clone(), region.carried_counters());
        // Saves the counts for the next daemon (`carry.rs`): once a second, and once more
        // when the device is left to it (a handover, a failed queue).
        let save_counts: Arc<dyn Fn() + Send + Sync> =
            Arc::new(move || carry::Carry::new(table).save_status(&counted()));
        leave::save_counts_with(save_counts.clone());
        spawn("uzram-carry", move || loop {
            std::thread::sleep(CARRY_EVERY);
            save_counts();
        })?;
        spawn("uzram-control", move || {
            server::serve(listener, move |req| match req {
                Request::Status => Response::Status(snapshot()),
                Request::Stop => {
                    if let Ok(tx) = stop_tx.lock() {
                        let _ = tx.send("control request");
                    }
                    Response::Stopping
                }
                Request::Handoff => {
                    if let Ok(tx) = stop_tx.lock() {
                        let _ = tx.send(HANDOFF);
                    }
                    Response::HandingOff
                }
            })
        })?;
    }
    spawn("uzram-signals", move || loop {
        match sys::wait_stop_signal() {
            Ok(sig) => {
                tracing::info!(sig, "stop signal");
                let _ = stop_tx.send("signal");
            }
            Err(err) => {
                tracing::error!(error = %err, "sigwait failed");
                return;
            }
        }
    })?;
    let stopper_dev = dev.clone();
    let standby_pid = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let stopper_standby = standby_pid.clone();
    let stopper_compression = compression.clone();
    spawn("uzram-stopper", move || {
        let Ok(why) = stop_rx.recv() else { return };
        if why == HANDOFF {
            // The daemon taking over is already running: our standby must not race it.
            let standby = stopper_standby.load(std::sync::atomic::Ordering::Acquire);
            if standby != 0 {
                let _ = sys::kill_now(standby);
            }
            // Pages staged for the GPU are installed first, while we still serve: the next
            // daemon would install them on the CPU before it serves (or, from staging in our
            // own pinned memory, lose them). Bounded: a hung GPU must not stop the handover.
            let start = std::time::Instant::now();
            match stopper_compression.drain(HANDOFF_DRAIN) {
                Some(true) => tracing::info!(
                    ms = start.elapsed().as_millis() as u64,
                    "staged pages installed for the handover"
                ),
                Some(false) if stopper_compression.staging_kept() => tracing::warn!(
                    secs = HANDOFF_DRAIN.as_secs(),
                    "the GPU did not finish its slots: the next daemon installs the pages still staged"
                ),
                Some(false) => tracing::error!(
                    secs = HANDOFF_DRAIN.as_secs(),
                    "the GPU did not finish its slots: pages still staged are lost to the next daemon"
                ),
                None => {}
            }
            // Exactly what a crash leaves, on purpose: the kernel holds the device and its
            // I/O for the next daemon (requests we had taken are reissued to it) and the store
            // stays in shared memory. The next daemon's counters go on from ours as they are
            // now.
            tracing::info!("handing the device over to the next daemon; exiting");
            leave::exit_leaving_device(0);
        }
        tracing::info!(why, "stopping the device");
        // From here a queue that fails ends as the stop ends them all.
        leave::stopping();
        wait_until_not_swap(&stopper_dev);
        if let Err(err) = notify::notify("STOPPING=1") {
            tracing::warn!(error = %err, "sd_notify STOPPING=1 failed");
        }
        // The control ring is per thread: use a control handle of our own to stop the device,
        // which ends the queue threads and so `run_target` in the main thread.
        match UblkCtrl::new_simple(id as i32).and_then(|c| c.kill_dev()) {
            Ok(_) => {}
            Err(err) => tracing::error!(error = %err, "stopping the device failed"),
        }
    })?;

    if launch.recover.is_some() {
        // Until the device serves (`on_started`): see `pool::hold_refills`.
        pool::hold_refills();
    }
    spawn("uzram-pool", move || pool::keep(pool_target))?;
    let compacted = store.clone();
    spawn("uzram-compact", move || {
        io_path_thread("uzram-compact");
        compactor::keep(compacted)
    })?;
    // A recovery's follow-up work once the device serves: commit the room it gave back again
    // (off the I/O path; see `commit_room_soon`), and link the holes it left between the old
    // daemon's pages off the free lists (`PageStore::link_adopted_holes`). Both threads start
    // now, before serving: see `spawn_deferred`.
    let mut after_start = Vec::new();
    if launch.recover.is_some() {
        let (start, len) = region.room();
        after_start.push(spawn_deferred("uzram-room", move || {
            free_lists::restore();
            region::commit_room_soon(start, len)
        })?);
        let holes = store.clone();
        after_start.push(spawn_deferred("uzram-holes", move || {
            holes.link_adopted_holes()
        })?);
    }

    step("threads");
    // The binary's code (`populate_file_code`), and everything set up so far (heap,
    // statics, thread stacks), resident and locked before serving.
    for (what, populated) in [
        ("the binary's code", fault_guard::populate_file_code()),
        ("writable memory", fault_guard::populate_writable_mappings()),
    ] {
        match populated {
            Ok(done) => tracing::info!(
                mappings = done.mappings,
                bytes = done.bytes,
                refused = done.refused,
                "{what} populated (the code only once per process)"
            ),
            Err(err) => tracing::warn!(error = %err, "populating {what} failed"),
        }
    }
    step("populate");
    let ctrl = match device {
        Device::Added(ctrl) => *ctrl,
        Device::Quiesced { id, queues, depth } => {
            let ctrl = start_recovery(id, queues, depth, plan)?;
            step("start recovery");
            ctrl
        }
    };
    let size = cfg.size;
    let tgt_init = move |dev: &mut UblkDev| {
        dev.tgt.dev_size = size;
        dev.tgt.params = target::params(size);
        Ok(())
    };
    let ready_states = states.clone();
    let ready_reporter = reporter.clone();
    let launch_log = launch.log.clone();
    // A config's daemon (`uzram run`, not a bridge) gets a standby outside its unit that
    // takes the device over if it dies (`uzram standby`).
    let want_standby = !launch.bridge && launch.config_path.is_some();
    let started_standby = standby_pid.clone();
    let alias_rdev = Arc::new(std::sync::OnceLock::new());
    let started_alias_rdev = alias_rdev.clone();
    let on_started = move |_ctrl: &UblkCtrl| {
        // END_USER_RECOVERY has returned: the device serves again.
        pause::step(&mut pause, "queues");
        // The takeover is over: its threads, the queues' among them, go back to normal
        // priority before anything else (the threads that grow memory in bulk, the room's
        // commit and the pool's refill, have not run yet: realtime, they could take the
        // reserve the takeover had).
        let ran_realtime = realtime::begun();
        match realtime::end() {
            Ok(0) => {}
            Ok(threads) => {
                tracing::info!(
                    threads,
                    "the takeover's threads are back to normal priority"
                )
            }
            Err(err) => tracing::warn!(
                error = %err,
                "moving the takeover's threads back to normal priority failed"
            ),
        }
        // Not part of the I/O pause, which ended now, but of the wait of whoever started us
        // (`uzram recover`, systemd): the node, its alias and tuning, the recovery record and
        // the state file.
        let publishing = std::time::Instant::now();
        target::drop_stashed_io_bufs();
        if !wait_for_path(Path::new(&state.dev), Duration::from_secs(10)) {
            tracing::warn!(dev = %state.dev, "block device node did not appear");
        }
        // The node that swap is activated through, so hibernation never picks this device.
        match crate::hibernate::create_alias(&state.dev) {
            Ok(_) => {
                if let Some(rdev) = crate::inuse::block_rdev(&state.dev) {
                    let _ = started_alias_rdev.set(rdev);
                }
            }
            Err(err) => {
                tracing::warn!(dev = %state.dev, error = %err, "creating the swap alias node failed")
            }
        }
        queue_tuning::tune(state.id);
        if let Err(err) = anchor::write(&state) {
            tracing::error!(error = %err, "publishing the recovery record failed: after a crash this device cannot be recovered");
        }
        if let Err(err) = ready_states.write(&state) {
            tracing::error!(error = %err, "publishing state failed");
        }
        match &pause {
            // The pause ended when the queues were served again (above), not now.
            Some(p) => {
                tracing::info!(
                    dev = %state.dev,
                    paused_ms = p.total().as_millis() as u64,
                    realtime = ran_realtime,
                    steps = %p,
                    faults = p.faults(),
                    anon_kib = p.anon_grown_kib(),
                    publish_ms = publishing.elapsed().as_millis() as u64,
                    "serving (taken over; I/O was paused for paused_ms: steps in ms)"
                )
            }
            None => tracing::info!(dev = %state.dev, "serving"),
        }
        for go in &after_start {
            let _ = go.send(());
        }
        if want_standby {
            standby::start(&state, &started_standby);
        }
        // Last: a refill in reclaim holds the mmap lock, which the threads started above
        // needed for their stacks.
        pool::allow_refills();
        ready_reporter.ready(state.id, &state.dev);
        // Once serving, and after the report: the log file is on tmpfs, and a daemon started
        // before a crash (`uzram daemon --wait`) may have had its pages swapped out to this
        // device. Its log thread then waits in a write for their swap-in, holding the file's
        // lock; a rename in the pause waited for that lock for good (guest, scenario r), and
        // one before the report held it up for 2 s under the hog.
        if let Some(log) = &launch_log {
            if let Err(err) = std::fs::rename(log, ready_states.log_path(state.id)) {
                tracing::warn!(error = %err, "renaming the log file failed");
            }
        }
    };
    let served = ctrl.run_target(
        tgt_init,
        target::queue_fn(store.clone(), compression, counters, plan),
        on_started,
    );
    states.remove(id);
    if let Some(&rdev) = alias_rdev.get() {
        crate::hibernate::remove_alias(&dev, rdev);
    }
    if let Some(file) = &textfile {
        file.remove();
    }
    if let Err(err) = ctrl.del_dev() {
        tracing::debug!(error = %err, "del_dev after stop");
    }
    // The device is gone, so is the store's reason to outlive us.
    region::remove(region.id());
    anchor::remove(id);
    served.map_err(|err| anyhow::anyhow!("serving the device failed: {err}"))?;
    tracing::info!(id, "device deleted; daemon exits");
    Ok(())
}

pub(crate) use crate::footprint::HEAP_RESERVE;

/// Runs the calling thread, and the threads it starts, at realtime priority until the
/// device serves (`realtime`): a takeover's allocations may then use the part of the
/// kernel's reserve that no ordinary task can take. Warns when refused (no `CAP_SYS_NICE`,
/// or a cgroup without realtime time); leaves a daemon run realtime by its administrator
/// as it is.
pub fn take_over_at_realtime() {
    if realtime::begun() {
        return;
    }
    if realtime::is_realtime(0).unwrap_or(false) {
        tracing::info!("already realtime: the takeover keeps the policy it was given");
        return;
    }
    match realtime::begin() {
        Ok(()) => tracing::info!("realtime priority (SCHED_FIFO) for the takeover"),
        Err(err) => tracing::warn!(
            error = %err,
            "realtime priority for the takeover refused: it competes with every task"
        ),
    }
}

/// What a daemon that takes a device over from a running daemon (a planned restart) does
/// before it asks for the handover: the work that does not need the old daemon gone, out of
/// the pause in which the device serves nothing. The heap reserve, and the queues' I/O
/// buffers, locked (in the TCG guest these took 40-120 ms and 140-280 ms of each takeover's
/// pause). The caller has locked its memory (`mlockall`) already.
pub fn prepare_takeover(cfg: &DeviceConfig) {
    let _ = fault_guard::populate_file_code();
    let tags = usize::from(cfg.queues) * usize::from(cfg.depth);
    let stashed = target::stash_io_bufs(tags);
    reserve::grow_once(HEAP_RESERVE);
    tracing::debug!(
        stashed,
        tags,
        "I/O buffers and heap ready before the handover"
    );
}

/// What the stop channel carries for a planned restart ([`Request::Handoff`]).
const HANDOFF: &str = "handoff";

/// How long a handover waits for staged pages to be installed (the handover's requester
/// gives the daemon 10 s to exit).
const HANDOFF_DRAIN: Duration = Duration::from_secs(5);
/// How often the carried counters are saved for the next daemon (`carry.rs`): what a crash
/// can lose of them.
const CARRY_EVERY: Duration = Duration::from_secs(1);

/// Set-up for a thread that installs staged pages: like a queue thread, it is on the swap
/// I/O path, so it must get ENOMEM rather than page-fault into reclaim, and run ahead of
/// the tasks that wait for swap.
/// Its threads have 256 KiB stacks (the ring's installers, `spawn`).
/// `uzram bench` gives its GPU ring the same set-up, so that the GPU host runs it.
pub(crate) fn io_path_thread(name: &str) {
    pool::strict_current_thread();
    fault_guard::prefault_small_stack();
    if let Err(err) = sys::set_thread_nice(pool::IO_NICE) {
        tracing::warn!(thread = name, error = %err, "raising the thread's priority failed");
    }
}

/// The queue mode `cfg` asks for, or with `auto` the fastest one the driver offers
/// (`UBLK_U_CMD_GET_FEATURES`); decided before any memory is reserved, so that a mode the
/// kernel lacks is refused at once. Also returns the feature bits.
fn choose_queue_mode(cfg: &DeviceConfig) -> anyhow::Result<(QueuePlan, Option<u64>)> {
    let features = UblkCtrl::get_features();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = queue_mode::plan(cfg.queue_mode, features, cfg.queues, cfg.depth, cpus)?;
    tracing::info!(
        features = %features.map_or("none (GET_FEATURES needs Linux 6.5)".into(), |f| format!("{f:#x}")),
        asked = %cfg.queue_mode,
        mode = %plan.mode,
        threads_per_queue = plan.threads_per_queue,
        "queue mode"
    );
    Ok((plan, features))
}

/// A device this daemon added and the store it made for it, while its start can still fail:
/// when dropped still holding them (the start failed), the device is deleted and the store
/// removed, since no one would ever serve or recover them.
struct Unborn {
    device: Option<u32>,
    store: Option<i32>,
}

impl Drop for Unborn {
    fn drop(&mut self) {
        if let Some(id) = self.store {
            region::remove(id);
        }
        if let Some(id) = self.device {
            match UblkCtrl::new_simple(id as i32).and_then(|c| c.del_dev()) {
                Ok(_) => tracing::info!(id, "the start failed: the device is deleted again"),
                Err(err) => {
                    tracing::warn!(id, error = %err, "deleting the device of a failed start failed")
                }
            }
        }
    }
}

/// Adds the ublk device in `plan`'s mode. Should the driver refuse a mode it advertised, `auto`
/// falls back to `per-queue`, which every ublk kernel serves.
fn add_device(
    cfg: &DeviceConfig,
    plan: QueuePlan,
    features: Option<u64>,
) -> anyhow::Result<(UblkCtrl, QueuePlan)> {
    match build_ctrl(cfg, plan) {
        Ok(ctrl) => Ok((ctrl, plan)),
        Err(err) if cfg.queue_mode == QueueModeChoice::Auto && plan.mode != QueueMode::PerQueue => {
            tracing::warn!(mode = %plan.mode, error = %err, "adding the device failed; trying per-queue");
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let plain = queue_mode::plan(
                QueueModeChoice::Exactly(QueueMode::PerQueue),
                features,
                cfg.queues,
                cfg.depth,
                cpus,
            )?;
            let ctrl = build_ctrl(cfg, plain).map_err(|err| add_error(err, cfg.id))?;
            Ok((ctrl, plain))
        }
        Err(err) => Err(add_error(err, cfg.id)),
    }
}

/// `UBLK_F_*` flags every device gets: when its daemon dies the device stays, its I/O queued,
/// until a new daemon takes over (`uzram recover`), and requests the dead one had taken are
/// issued again to the new one (swap writes and reads may be repeated; nothing is lost).
const RECOVERY_FLAGS: u64 =
    (libublk::sys::UBLK_F_USER_RECOVERY | libublk::sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;

fn build_ctrl(cfg: &DeviceConfig, plan: QueuePlan) -> Result<UblkCtrl, UblkError> {
    ctrl_builder(
        cfg.id.map_or(-1, |id| id as i32),
        cfg.queues,
        cfg.depth,
        plan,
        UblkFlags::UBLK_DEV_F_ADD_DEV,
    )
    .build()
}

/// The control device as every uzram device gets it: new (`UBLK_DEV_F_ADD_DEV`) or taken
/// over (`UBLK_DEV_F_RECOVER_DEV`), always with recovery and locked I/O buffers.
fn ctrl_builder(
    id: i32,
    queues: u16,
    depth: u16,
    plan: QueuePlan,
    how: UblkFlags,
) -> UblkCtrlBuilder<'static> {
    UblkCtrlBuilder::default()
        .name("uzram")
        .id(id)
        .nr_queues(queues)
        .depth(depth)
        .io_buf_bytes(target::IO_BUF_BYTES)
        // What we ask for at add time, also when taking over: the kernel reports more (7.x
        // sets flags of its own, such as UBLK_F_PER_IO_DAEMON, that libublk refuses as input).
        .ctrl_flags(plan.ctrl_flags | RECOVERY_FLAGS)
        .io_threads_per_queue(plan.threads_per_queue)
        .dev_flags(how | UblkFlags::UBLK_DEV_F_MLOCK_IO_BUFFER)
}

/// How a device that cannot be taken over is described (`uzram recover` waits while it
/// says this: the kernel quiesces a device a moment after its daemon is gone).
pub const NOT_QUIESCED: &str = "the kernel does not hold it for recovery";

/// Device `id`'s ublk info when the kernel holds it quiesced for a new daemon; otherwise
/// why not. Restores libublk's device file first, which libublk reads and which may have
/// been in swap on this very device (`control::anchor`).
pub fn quiesced_info(id: u32) -> Result<libublk::sys::ublksrv_ctrl_dev_info, String> {
    if let Err(err) = anchor::restore_ublk_json(id) {
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

/// The device a daemon serves: one it just added, or one quiesced since its daemon died, not
/// yet asked for. A takeover asks for it ([`start_recovery`]) only after its threads, its
/// listener and its populated memory are ready: on 6.12 a daemon that dies between
/// `START_USER_RECOVERY` and its first queue served leaves the device refused to every later
/// daemon (docs/recovery.md), so that window holds nothing that could wait.
enum Device {
    Added(Box<UblkCtrl>),
    /// Its id, and the queues and depth it was made with.
    Quiesced {
        id: u32,
        queues: u16,
        depth: u16,
    },
}

impl Device {
    fn id(&self) -> u32 {
        match self {
            Device::Added(ctrl) => ctrl.dev_info().dev_id,
            Device::Quiesced { id, .. } => *id,
        }
    }
}

/// Device `id`, quiesced since its daemon died, and the queue plan for taking it over: the
/// queue mode is the one the device was made with.
fn recovery_plan(id: u32, plan: QueuePlan) -> anyhow::Result<(Device, QueuePlan)> {
    let info = quiesced_info(id).map_err(|why| {
        anyhow::anyhow!(
            "/dev/ublkb{id} cannot be taken over: {why}; only a device whose daemon died can be recovered"
        )
    })?;
    if info.flags & RECOVERY_FLAGS == 0 {
        anyhow::bail!("/dev/ublkb{id} was made without user recovery");
    }
    let batch = info.flags & u64::from(libublk::sys::UBLK_F_BATCH_IO) != 0;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = match (batch, plan.mode) {
        (true, QueueMode::Batch) | (false, QueueMode::PerQueue | QueueMode::PerIoDaemon) => plan,
        (true, _) => queue_mode::plan(
            QueueModeChoice::Exactly(QueueMode::Batch),
            Some(info.flags),
            info.nr_hw_queues,
            info.queue_depth,
            cpus,
        )?,
        (false, _) => queue_mode::plan(
            QueueModeChoice::Exactly(QueueMode::PerQueue),
            None,
            info.nr_hw_queues,
            info.queue_depth,
            cpus,
        )?,
    };
    let device = Device::Quiesced {
        id,
        queues: info.nr_hw_queues,
        depth: info.queue_depth,
    };
    Ok((device, plan))
}

/// Takes over device `id` ([`recovery_plan`]): the driver hands the queued and
/// reissued requests to our queues once they serve (`START_USER_RECOVERY` here,
/// `END_USER_RECOVERY` when started).
fn start_recovery(id: u32, queues: u16, depth: u16, plan: QueuePlan) -> anyhow::Result<UblkCtrl> {
    let ctrl = ctrl_builder(
        id as i32,
        queues,
        depth,
        plan,
        UblkFlags::UBLK_DEV_F_RECOVER_DEV,
    )
    .build()
    .map_err(|e| anyhow::anyhow!("opening /dev/ublkb{id} for recovery: {e} ({e:?})"))?;
    ctrl.start_user_recover().map_err(|e| {
        let why = if matches!(e, UblkError::UringIOError(code) if code == -libc::EINVAL) {
            // 6.12 refuses once a recovery has started and its daemon died before every queue
            // was served again (no queue is ready, and only a ready one allows a new start).
            ": the kernel refuses to recover this device again (a daemon that was recovering it \
             died half-way); its pages cannot be served any more: stop what uses it and \
             reboot, or `uzram destroy` it"
        } else {
            ""
        };
        anyhow::anyhow!("START_USER_RECOVERY on /dev/ublkb{id}: {e} ({e:?}){why}")
    })?;
    Ok(ctrl)
}

fn add_error(err: UblkError, id: Option<u32>) -> anyhow::Error {
    let errno = match &err {
        UblkError::OtherError(e) | UblkError::UringIOError(e) => Some(*e),
        _ => None,
    };
    match (errno, id) {
        (Some(e), Some(id)) if e == -libc::EEXIST => {
            anyhow::anyhow!("device id {id} is already in use (/dev/ublkb{id} exists)")
        }
        _ => anyhow::anyhow!("adding the ublk device failed: {err} ({err:?})"),
    }
}

/// Starts thread `name` now and returns the sender that makes it run `job`; once `job` is
/// done (or the sender is dropped unsent), the thread parks for good, it never exits.
///
/// Why: starting a thread maps its stack, and a thread's exit unmaps its signal stack; both
/// take the process's mmap lock for writing. Once the device serves, a thread of ours may
/// hold that lock for reading for a long time: a page fault (`uzram-room` committing the
/// room, the pool keeper's refill) that sits in reclaim while memory is exhausted. A writer
/// then waits behind it, and every later reader waits behind the writer, among them a queue
/// thread's first touch of an old daemon's segment page: the device stops serving, and the
/// reclaim that was waiting for its writes never ends. Seen in the guest's crash scenario
/// (r) on 6.12: `uzram-room` in reclaim, `uzram-holes` exiting in `munmap`, a queue thread in
/// `lock_mm_and_find_vma`, the hog and kswapd waiting for bios.
fn spawn_deferred(
    name: &str,
    job: impl FnOnce() + Send + 'static,
) -> Result<mpsc::Sender<()>, ControlError> {
    let (go, told) = mpsc::channel::<()>();
    spawn(name, move || {
        if told.recv().is_ok() {
            job();
        }
        loop {
            std::thread::park();
        }
    })?;
    Ok(go)
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), ControlError> {
    std::thread::Builder::new()
        .name(name.to_string())
        // mlockall locks every thread's whole stack: keep these small.
        .stack_size(256 << 10)
        .spawn(f)
        .map(|_| ())
        .map_err(|source| ControlError::Io {
            what: format!("starting thread {name}"),
            source,
        })
}

/// Returns once `dev` is not active swap. Deleting a swap device loses every page swapped
/// out to it, and the processes owning them die on the next touch; at shutdown systemd may
/// send SIGTERM while its own swap unit is still running swapoff (seen in the guest: PID 1
/// got SIGBUS). So a stop waits for swapoff, however long; `uzram destroy` refuses instead.
fn wait_until_not_swap(dev: &str) {
    let mut warned = false;
    loop {
        match crate::inuse::is_active_swap(dev) {
            Ok(true) => {}
            Ok(false) => return,
            Err(err) => {
                tracing::warn!(error = %err, "reading /proc/swaps failed; stopping anyway");
                return;
            }
        }
        if !warned {
            tracing::warn!(
                dev,
                "device is active swap: waiting for swapoff before deleting it"
            );
            warned = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls until `path` exists; false on timeout.
pub fn wait_for_path(path: &Path, timeout: Duration) -> bool {
    let start = Instant::now();
    while !path.exists() {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// How the queues are served, as numbers for `uzram status` (the mode's name is `queue_mode`).
fn queue_stats(plan: QueuePlan) -> [Stat; 2] {
    [
        Stat {
            name: "io_threads_per_queue".into(),
            value: plan.threads_per_queue.into(),
        },
        // IORING_SETUP_* bits of the queue threads' rings (0x3100: coop + single issuer +
        // defer taskrun; see `ring`).
        Stat {
            name: "queue_ring_setup_flags".into(),
            value: ring::setup_flags().into(),
        },
    ]
}

/// The block pool's counters, for `uzram status`.
fn pool_stats() -> [Stat; 6] {
    let (waits, timeouts) = pool::take_waits();
    [
        Stat {
            name: "pool_free_blocks".into(),
            value: pool::free_blocks() as u64,
        },
        Stat {
            name: "pool_released_blocks".into(),
            value: pool::released_blocks() as u64,
        },
        // What the daemon holds (resident, shared memory included), beside the store's
        // mem_used_total: the difference is reserves, buffers and code.
        Stat {
            name: "daemon_rss_bytes".into(),
            value: sys::resident_bytes().unwrap_or(0),
        },
        Stat {
            name: "pool_refused_blocks".into(),
            value: pool::refused_blocks() as u64,
        },
        Stat {
            name: "pool_waited_takes".into(),
            value: waits as u64,
        },
        Stat {
            name: "pool_take_timeouts".into(),
            value: timeouts as u64,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Threads of this process named `name` (`/proc/self/task/*/comm`).
    fn threads_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == name)
            .count()
    }

    fn within_5_s(what: &str, done: impl Fn() -> bool) {
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !done() {
            assert!(std::time::Instant::now() < until, "{what}: not within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_deferred_thread_starts_at_once_runs_its_job_when_told_and_never_exits() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        let name = "uzram-deftest";
        let go = spawn_deferred(name, || {
            RUNS.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        within_5_s("the thread started", || threads_named(name) == 1);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            RUNS.load(Ordering::SeqCst),
            0,
            "the job ran before it was told to"
        );
        go.send(()).unwrap();
        within_5_s("the job ran", || RUNS.load(Ordering::SeqCst) == 1);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(threads_named(name), 1, "the thread exited after its job");
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);
    }
}

//! The daemon's lifecycle: lock memory, add the ublk device, serve its queues, publish state,
//! and on SIGTERM/SIGINT or a control `stop` delete the device and clean up.

pub mod backend;
pub mod backing;
mod backing_label;
mod budget;
mod compactor;
#[cfg(test)]
mod crash_tests;
mod device;
mod dictionary;
pub mod notify;
mod pressure;
mod readiness;
pub mod recompressor;
mod room;
mod services;
pub mod store;
mod tier;

pub use readiness::{Readiness, Reporter};

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::Context;
use libublk::ctrl::UblkCtrl;
use libublk::io::UblkDev;
use uzram_core::store::PageStore;

use crate::config::DeviceConfig;
use crate::control::state::{DaemonState, StateDir};
use crate::footprint::HEAP_RESERVE;
use crate::sys;
use crate::takeover::pause::PauseClock;
use crate::takeover::record;
use crate::takeover::staging_segment::StagingSegment;
use crate::takeover::store_segment::StoreSegment;
use crate::ublk::placement::QueueThreads;
use crate::ublk::queue_mode::QueuePlan;
use crate::ublk::server::RequestCounters;
use backend::WriteBackend;

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
    pub pause: Option<crate::takeover::pause::PauseClock>,
    /// The device's lock (`StateDir::try_lock`), when the caller took it before handing a
    /// recovery here; otherwise `serve` takes it.
    pub lock: Option<std::fs::File>,
}

/// Serves one device until it is stopped. Returns after the device is deleted.
///
/// The phases, in order: lock the process into memory; open the store (a new device is added
/// first, so that its store names it); start the write backend; take the device; spawn the
/// services (control socket, metrics, carried counters, signals, stopper, pool keeper,
/// compactor); run the queues, publishing the device once they serve; tear down.
pub fn serve(launch: Launch, reporter: Arc<Reporter>) -> anyhow::Result<()> {
    let Launch {
        config: cfg,
        config_path,
        log,
        recover,
        settings,
        bridge,
        mut pause,
        lock,
    } = launch;
    lock_process(&cfg, recover.is_some(), &mut pause)?;
    let (plan, features) = device::choose_queue_mode(&cfg)?;
    step(&mut pause, "queue mode");
    let states = StateDir::default();
    states.create()?;
    // Two daemons must never adopt one store: whoever recovers holds the device's lock.
    let mut lock = lock;
    if let (None, Some(id)) = (&lock, recover) {
        lock =
            Some(states.try_lock(id)?.with_context(|| {
                format!("/dev/ublkb{id} is being taken over by another daemon")
            })?);
    }
    let mut opened = open_store(&cfg, recover, plan, features, &mut pause)?;
    let (backend, pool_target) = start_backend(&cfg, &mut opened, recover.is_some(), &mut pause)?;
    // While a failure still removes the new device: a fresh start says at once when the GPU
    // cannot recompress; a takeover does not wait for it (its first pass opens it).
    let recompressor = recompressor::for_device(&cfg, recover.is_some())?;
    let Opened {
        store,
        region,
        added,
        mut unborn,
        ..
    } = opened;
    let (device, plan) = match (added, recover) {
        (Some(added), _) => added,
        (None, Some(id)) => device::recovery_plan(id, plan)?,
        (None, None) => unreachable!("open_store adds a new device"),
    };
    step(&mut pause, "device");
    let id = device.id();
    let dev = format!("/dev/ublkb{id}");
    tracing::info!(id, %dev, size = cfg.size, queues = cfg.queues, depth = cfg.depth, "device added");
    // Held until the process exits, however it exits.
    let _lock = lock.or_else(|| match states.try_lock(id) {
        Ok(Some(l)) => Some(l),
        Ok(None) => {
            tracing::warn!(id, "another process holds the new device's lock");
            None
        }
        Err(err) => {
            tracing::warn!(id, error = %err, "locking the device failed");
            None
        }
    });
    if recover.is_some() {
        // The dead daemon's socket; its state file stays until ours replaces it.
        let _ = std::fs::remove_file(states.socket_path(id));
    } else {
        // The kernel just gave us this id, so any files published under it are stale.
        states.remove(id);
    }
    let state = DaemonState {
        pid: std::process::id(),
        started: sys::start_ticks(std::process::id()),
        id,
        dev: dev.clone(),
        size: cfg.size,
        algorithm: cfg.algorithm.to_string(),
        backend: backend.name().to_string(),
        mem_limit: cfg.mem_limit,
        config: config_path,
        store_shm: Some(region.id()),
        settings,
        recovered: recover.is_some(),
        bridge,
    };
    let counters = Arc::new(RequestCounters::new(
        cfg.queues.saturating_mul(plan.threads_per_queue),
    ));
    // A service that panics before the device serves fails the start (checked below).
    crate::takeover::leave::note_panics_while_starting();
    let running = services::spawn_all(services::Setup {
        cfg: &cfg,
        plan,
        state: &state,
        states: &states,
        store: &store,
        region: &region,
        backend: &backend,
        counters: &counters,
        pool_target,
        recovered: recover.is_some(),
        recompressor,
    })?;
    step(&mut pause, "threads");
    populate_memory();
    step(&mut pause, "populate");
    let ctrl = device.start(plan, &mut pause)?;
    if crate::takeover::leave::panicked_while_starting() {
        anyhow::bail!(
            "a daemon thread panicked while the device started (a bug: please report it, with \
             the log above)"
        );
    }
    // From here a panic anywhere leaves the device to the next daemon (see the function).
    crate::takeover::leave::leave_device_on_panic();
    // From here the device and its store are this daemon's to serve, and its stop (or a
    // crash) is what ends them; a failed start of its services above removes a new store
    // (locked memory, its pool filled) with its device, as any earlier failure does.
    unborn.disarm();
    let alias_rdev = Arc::new(std::sync::OnceLock::new());
    let publish = Publish {
        pause,
        // A config's daemon (`uzram run`, not a bridge) gets a standby outside its unit that
        // takes the device over if it dies (`uzram standby`).
        want_standby: !bridge && state.config.is_some(),
        state,
        states: states.clone(),
        reporter,
        log,
        after_start: running.after_start,
        standby: running.standby,
        alias_rdev: alias_rdev.clone(),
    };
    let size = cfg.size;
    let queue_threads = Arc::new(QueueThreads::default());
    let placement = cfg.queue_affinity.placement(backend.name() == "gpu");
    let placed = queue_threads.clone();
    let served = ctrl.run_target(
        move |dev: &mut UblkDev| {
            dev.tgt.dev_size = size;
            dev.tgt.params = crate::ublk::params(size);
            Ok(())
        },
        crate::ublk::queue_fn(store, backend, counters, plan, queue_threads),
        move |_: &UblkCtrl| {
            placed.place(placement);
            publish.serving()
        },
    );
    if let Err(err) = &served {
        if leaves_device_on_failure(recover.is_some(), crate::takeover::leave::is_stopping()) {
            tracing::error!(
                id,
                error = %err,
                "the takeover could not serve the device: leaving it, its pages and its store to \
                 the next daemon (`uzram recover`, the standby, the unit's restart)"
            );
            crate::takeover::leave::exit_after_logging();
        }
    }
    // Tear down: what was published, the device, and the store with its recovery record.
    states.remove(id);
    if let Some(&rdev) = alias_rdev.get() {
        crate::hibernate::remove_alias(&dev, rdev);
    }
    if let Some(file) = &running.textfile {
        file.remove();
    }
    if let Err(err) = ctrl.del_dev() {
        tracing::debug!(error = %err, "del_dev after stop");
    }
    // The device is gone, so is the store's reason to outlive us.
    crate::takeover::store_segment::remove(region.id());
    record::remove(id);
    served.map_err(|err| anyhow::anyhow!("serving the device failed: {err}"))?;
    tracing::info!(id, "device deleted; daemon exits");
    Ok(())
}

/// Whether a daemon whose device could not be served (`run_target` failed) leaves the device
/// as it is, for the next daemon, instead of deleting it: a device taken over holds every
/// page its swap has out, which deleting it would take with it (processes then die of
/// SIGBUS); unless it is being stopped on purpose. A new device holds nothing yet.
fn leaves_device_on_failure(taken_over: bool, stopping: bool) -> bool {
    taken_over && !stopping
}

fn step(pause: &mut Option<PauseClock>, name: &'static str) {
    crate::takeover::pause::step(pause, name);
}

/// Locks the process into memory before anything is allocated for the device: no page of
/// the daemon may ever need the swap it serves.
fn lock_process(
    cfg: &DeviceConfig,
    recovering: bool,
    pause: &mut Option<PauseClock>,
) -> anyhow::Result<()> {
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
    step(pause, "mlock");
    if recovering {
        // (already done when this daemon waited for the crash)
        take_over_at_realtime();
    }
    // PR_SET_IO_FLUSHER was set in `main`, before any thread existed (see there).
    Ok(())
}

/// The store, opened: with the device a new one was made for.
struct Opened {
    store: Arc<PageStore>,
    region: StoreSegment,
    /// Staging a dead daemon left, its pages installed, for the backend to reuse.
    staging: Option<StagingSegment>,
    /// A new device, added; a takeover asks for its device later ([`device::Device`]).
    added: Option<(device::Device, QueuePlan)>,
    unborn: device::Unborn,
}

/// Makes the store of a new device, or takes over the one a dead daemon left.
///
/// A new device is added first, and its store made for it: the store's header names its
/// device from the start, so no store exists that `uzram list` cannot tie to a device
/// (should this process be killed on the way), and a failed start deletes both
/// ([`device::Unborn`]). A device taken over is asked for (`START_USER_RECOVERY`) only once
/// everything else is ready, just before its queues serve.
fn open_store(
    cfg: &DeviceConfig,
    recover: Option<u32>,
    plan: QueuePlan,
    features: Option<u64>,
    pause: &mut Option<PauseClock>,
) -> anyhow::Result<Opened> {
    let Some(id) = recover else {
        let (ctrl, plan) = device::add(cfg, plan, features)?;
        let added = device::Device::Added(Box::new(ctrl));
        let mut unborn = device::Unborn::device(added.id());
        let (store, region) = store::create(cfg, added.id())?;
        unborn.store = Some(region.id());
        record::reserve(added.id(), cfg.queues).with_context(|| {
            format!(
                "making the recovery record of /dev/ublkb{}: without one no daemon could take \
                 the device over after a crash",
                added.id()
            )
        })?;
        let file =
            backing::open_configured(cfg, crate::config::Host::current(), store.pages(), false)?;
        backing::attach(&store, &region, file)?;
        return Ok(Opened {
            store,
            region,
            staging: None,
            added: Some((added, plan)),
            unborn,
        });
    };
    // The recovery record, not the state file: see `takeover::record`.
    let old = record::read(id).with_context(|| format!("/dev/ublkb{id} has no recovery record"))?;
    let shm = old.store_shm.with_context(|| {
        format!("/dev/ublkb{id} was made by a daemon that kept no store to recover")
    })?;
    // Taken over before anything else is allocated: it frees memory for what follows.
    let taken = store::recover(cfg, id, shm, &mut |name| step(pause, name))?;
    if let Err(error) = record::make_room(id, cfg.queues) {
        tracing::warn!(%error, "no room made for the recovery record beside the one it has: its first rewrite may need a segment the host has run out of");
    }
    step(pause, "recovery record room");
    let file = backing::open_configured(
        cfg,
        crate::config::Host::current(),
        taken.store.pages(),
        true,
    )?;
    backing::attach(&taken.store, &taken.region, file)?;
    step(pause, "backing device");
    dictionary::restore(&taken.store, &taken.region);
    let found = taken.found;
    tracing::info!(
        shm,
        pages_stored = found.pages_stored,
        segments = found.segments,
        staged_pages_installed = found.settled_pages,
        lost_pages = found.lost_pages,
        damaged_entries = found.damaged_entries,
        "store recovered"
    );
    if found.damaged_entries > 0 {
        tracing::error!(
            damaged_entries = found.damaged_entries,
            "pages whose page-table entries were damaged are lost: reading them fails until they are written again"
        );
    }
    if found.lost_pages > 0 {
        tracing::error!(
            lost_pages = found.lost_pages,
            "pages that waited for the GPU when the old daemon died are lost (their staging was not there): reading them fails until they are written again"
        );
    }
    Ok(Opened {
        store: taken.store,
        region: taken.region,
        staging: taken.staging,
        added: None,
        unborn: device::Unborn::none(),
    })
}

/// Starts the write backend over the store, with the heap reserve and block pool it
/// allocates from. Returns the backend and the pool's target size in blocks.
fn start_backend(
    cfg: &DeviceConfig,
    opened: &mut Opened,
    recovering: bool,
    pause: &mut Option<PauseClock>,
) -> anyhow::Result<(Arc<WriteBackend>, usize)> {
    // Small allocations: a pre-grown heap that is never trimmed.
    crate::memory::reserve::grow_once(HEAP_RESERVE);
    step(pause, "heap");
    let mut backend = WriteBackend::start(
        opened.store.clone(),
        cfg.backend,
        &cfg.gpu,
        Some(Arc::new(crate::memory::io_path_thread)),
        backend::StagingHome::StoreSegment {
            region: &opened.region,
            found: opened.staging.take(),
        },
    )
    .context("setting up the compression backend")?;
    if cfg.writeback.is_some() {
        backend.make_room_with(Arc::new(room::Room::default()));
    }
    step(pause, "backend");
    let pool_target =
        crate::memory::pool::target_blocks(cfg.size, crate::memory::pool::ram_bytes());
    // A recovery serves with the pool it adopted: refilling now could wait for reclaim,
    // which waits for this device. The keeper refills once the device serves.
    if !recovering && !crate::memory::pool::fill_to(pool_target) {
        anyhow::bail!("could not fill the block pool: not enough memory");
    }
    tracing::info!(
        pool_bytes = crate::memory::pool::free_blocks() * crate::memory::pool::BLOCK,
        heap_headroom = crate::memory::reserve::headroom(),
        "memory reserves ready"
    );
    Ok((Arc::new(backend), pool_target))
}

/// The binary's code (`populate_file_code`), and everything set up so far (heap, statics,
/// thread stacks), resident and locked before serving.
fn populate_memory() {
    for (what, populated) in [
        (
            "the binary's code",
            crate::memory::fault_guard::populate_file_code(),
        ),
        (
            "writable memory",
            crate::memory::fault_guard::populate_writable_mappings(),
        ),
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
}

/// What is published once the queues serve: the node and its alias, the recovery record,
/// the state file, and the report to whoever started the daemon.
struct Publish {
    pause: Option<PauseClock>,
    want_standby: bool,
    state: DaemonState,
    states: StateDir,
    reporter: Arc<Reporter>,
    log: Option<PathBuf>,
    after_start: Vec<mpsc::Sender<()>>,
    standby: Arc<crate::takeover::standby::Standby>,
    alias_rdev: Arc<std::sync::OnceLock<u64>>,
}

impl Publish {
    /// Runs once `END_USER_RECOVERY` (or `START_DEV`) has returned: the device serves.
    fn serving(mut self) {
        let state = &self.state;
        step(&mut self.pause, "queues");
        // The takeover is over: its threads, the queues' among them, go back to normal
        // priority before anything else (the threads that grow memory in bulk, the room's
        // commit and the pool's refill, have not run yet: realtime, they could take the
        // reserve the takeover had).
        let ran_realtime = crate::memory::realtime::begun();
        let mut ended = crate::memory::realtime::end();
        // Its threads not listed (short of memory or descriptors, as a takeover may be):
        // tried again a few times, realtime threads left behind would starve the host.
        for _ in 0..20 {
            if ended.is_ok() || !crate::memory::realtime::begun() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
            ended = crate::memory::realtime::end();
        }
        match ended {
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
        let publishing = Instant::now();
        crate::ublk::server::drop_stashed_io_bufs();
        if !wait_for_path(Path::new(&state.dev), Duration::from_secs(10)) {
            tracing::warn!(dev = %state.dev, "block device node did not appear");
        }
        // The node that swap is activated through, so hibernation never picks this device.
        match crate::hibernate::create_alias(&state.dev) {
            Ok(_) => {
                if let Some(rdev) = crate::inuse::block_rdev(&state.dev) {
                    let _ = self.alias_rdev.set(rdev);
                }
            }
            Err(err) => {
                tracing::warn!(dev = %state.dev, error = %err, "creating the swap alias node failed")
            }
        }
        crate::ublk::tuning::tune(state.id);
        record::publish(state);
        if let Err(err) = self.states.write(state) {
            tracing::error!(error = %err, "publishing state failed");
        }
        match &self.pause {
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
        for go in &self.after_start {
            let _ = go.send(());
        }
        if self.want_standby {
            crate::takeover::standby::start(state, &self.standby);
        }
        // Last: a refill in reclaim holds the mmap lock, which the threads started above
        // needed for their stacks.
        crate::memory::pool::allow_refills();
        self.reporter.ready(state.id, &state.dev);
        // Once serving, and after the report: the log file is on tmpfs, and a daemon started
        // before a crash (`uzram daemon --wait`) may have had its pages swapped out to this
        // device. Its log thread then waits in a write for their swap-in, holding the file's
        // lock: a rename in the pause could wait for that lock for good, and one before the
        // report held the report up.
        if let Some(log) = &self.log {
            if let Err(err) = std::fs::rename(log, self.states.log_path(state.id)) {
                tracing::warn!(error = %err, "renaming the log file failed");
            }
        }
    }
}

/// Runs the calling thread, and the threads it starts, at realtime priority until the
/// device serves (`realtime`): a takeover's allocations may then use the part of the
/// kernel's reserve that no ordinary task can take. Warns when refused (no `CAP_SYS_NICE`,
/// or a cgroup without realtime time); leaves a daemon run realtime by its administrator
/// as it is.
pub fn take_over_at_realtime() {
    if crate::memory::realtime::begun() {
        return;
    }
    if crate::memory::realtime::is_realtime(0).unwrap_or(false) {
        tracing::info!("already realtime: the takeover keeps the policy it was given");
        return;
    }
    match crate::memory::realtime::begin() {
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
    let _ = crate::memory::fault_guard::populate_file_code();
    let tags = usize::from(cfg.queues) * usize::from(cfg.depth);
    let stashed = crate::ublk::server::stash_io_bufs(tags);
    crate::memory::reserve::grow_once(HEAP_RESERVE);
    tracing::debug!(
        stashed,
        tags,
        "I/O buffers and heap ready before the handover"
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A takeover that cannot serve leaves the device (with every page in swap) to the next
    /// daemon; a new device that cannot serve, or a device stopped on purpose, is deleted.
    #[test]
    fn only_a_new_or_stopping_device_is_deleted_when_serving_fails() {
        assert!(leaves_device_on_failure(true, false));
        assert!(!leaves_device_on_failure(true, true));
        assert!(!leaves_device_on_failure(false, false));
        assert!(!leaves_device_on_failure(false, true));
    }
}

//! The daemon's threads beside its queues (control socket, metrics file, carried counters,
//! signals, the stopper, the pool keeper, the compactor), and the numbers they report.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use libublk::ctrl::UblkCtrl;
use uzram_core::store::PageStore;

use crate::config::DeviceConfig;
use crate::control::counters;
use crate::control::proto::{DeviceStatus, Request, Response, Stat};
use crate::control::state::{DaemonState, StateDir};
use crate::control::{listener, ControlError};
use crate::sys;
use crate::takeover::carry::Carry;
use crate::takeover::standby::Standby;
use crate::takeover::store_segment::StoreSegment;
use crate::ublk::queue_mode::QueuePlan;
use crate::ublk::server::RequestCounters;

use super::backend::WriteBackend;
use super::notify;

/// What the stop channel carries for a planned restart ([`Request::Handoff`]).
const HANDOFF: &str = "handoff";

/// How long a handover waits for staged pages to be installed (the handover's requester
/// gives the daemon 10 s to exit).
const HANDOFF_DRAIN: Duration = Duration::from_secs(5);
/// How often the carried counters are saved for the next daemon (`carry.rs`): what a crash
/// can lose of them.
const CARRY_EVERY: Duration = Duration::from_secs(1);

/// What the services serve.
pub(super) struct Setup<'a> {
    pub cfg: &'a DeviceConfig,
    pub plan: QueuePlan,
    pub state: &'a DaemonState,
    pub states: &'a StateDir,
    pub store: &'a Arc<PageStore>,
    pub region: &'a StoreSegment,
    pub backend: &'a Arc<WriteBackend>,
    pub counters: &'a Arc<RequestCounters>,
    /// The block pool's size for the keeper, in blocks.
    pub pool_target: usize,
    /// A takeover: its follow-up work starts once the device serves.
    pub recovered: bool,
    /// The device's recompressor (`recompress-algorithm`), if it has one.
    pub recompressor: Option<Arc<super::recompressor::Recompressor>>,
}

/// The services started, as the rest of the daemon's life needs them.
pub(super) struct Running {
    /// The metrics file, removed when the device goes.
    pub textfile: Option<Arc<crate::metrics::Textfile>>,
    /// The standby once it runs, for the stopper to end it at a handover.
    pub standby: Arc<Standby>,
    /// Senders that start the takeover's follow-up work once the device serves.
    pub after_start: Vec<mpsc::Sender<()>>,
}

/// Starts every service thread. All of them start before the device serves: see
/// [`spawn_deferred`] for why.
pub(super) fn spawn_all(s: Setup<'_>) -> anyhow::Result<Running> {
    let socket = listener::bind(&s.states.socket_path(s.state.id))?;
    let (stop_tx, stop_rx) = mpsc::channel::<&'static str>();
    let textfile = s
        .cfg
        .metrics_textfile
        .clone()
        .map(|path| Arc::new(crate::metrics::Textfile::new(path)));
    let snapshot = status_snapshot(&s);
    if let Some(file) = textfile.clone() {
        let snapshot = snapshot.clone();
        spawn("uzram-metrics", move || file.keep_writing(|| snapshot()))?;
    }
    // Saves the counts for the next daemon (`carry.rs`): once a second, and once more when
    // the device is left to it (a handover, a failed queue).
    let (counted, table) = (snapshot.clone(), s.region.carried_counters());
    let save_counts: Arc<dyn Fn() + Send + Sync> =
        Arc::new(move || Carry::new(table).save_status(&counted()));
    crate::takeover::leave::save_counts_with(save_counts.clone());
    spawn("uzram-carry", move || loop {
        std::thread::sleep(CARRY_EVERY);
        save_counts();
        crate::takeover::record::retry_pending();
    })?;
    let requests = Mutex::new(stop_tx.clone());
    if let Some(r) = &s.recompressor {
        r.keep_dictionary_in(s.region.dictionary_area());
    }
    let recompression =
        s.cfg
            .recompress
            .zip(s.recompressor.clone())
            .map(|(settings, recompressor)| super::tier::Recompression {
                settings,
                recompressor,
            });
    let (tiered, recompress) = (s.store.clone(), recompression.clone());
    let writeback = s.cfg.writeback.clone();
    let budget = match &writeback {
        Some(w) => w
            .limit_per_day
            .map(|per_day| {
                super::budget::Budget::open(
                    std::path::Path::new(super::budget::BUDGET_DIR),
                    &w.device,
                    per_day,
                )
            })
            .transpose()
            .context("opening the writeback budget")?
            .map(Arc::new),
        None => None,
    };
    if let Some(b) = &budget {
        let b = b.clone();
        spawn("uzram-budget", move || b.keep_on_disk())?;
    }
    let kept_budget = budget.clone();
    let (long, passes) = listener::long_line(|req| {
        matches!(req, Request::Recompress { .. } | Request::Writeback { .. })
    });
    let idled = tiered.clone();
    spawn("uzram-passes", move || {
        // `uzram writeback` and `uzram recompress` run their passes here, one at a time.
        tiered.prepare_backing_thread();
        for handed in passes {
            if handed.client_gone() {
                tracing::info!("a pass's client left before it began; not run");
                continue;
            }
            let response = match &handed.request {
                Request::Recompress {
                    kind,
                    threshold,
                    level,
                } => match super::tier::recompress_now(
                    &tiered,
                    recompress.as_ref(),
                    kind,
                    *threshold,
                    *level,
                ) {
                    Ok(report) => Response::Recompressed(report),
                    Err(message) => Response::Error { message },
                },
                Request::Writeback { kind, max_pages } => {
                    match super::tier::writeback_now(
                        &tiered,
                        writeback.as_ref(),
                        budget.as_deref(),
                        kind,
                        *max_pages,
                    ) {
                        Ok(report) => Response::WrittenBack(report),
                        Err(message) => Response::Error { message },
                    }
                }
                _ => Response::Error {
                    message: "not a pass".into(),
                },
            };
            if let Err(err) = handed.answer(&response) {
                tracing::debug!(error = %err, "answering a pass's client failed");
            }
        }
    })?;
    spawn("uzram-control", move || {
        let handler = move |req| match req {
            Request::Idle { min_age_minutes } => Response::Idled {
                pages: idled.mark_idle(min_age_minutes),
            },
            // `long` takes these to the passes' thread.
            Request::Recompress { .. } | Request::Writeback { .. } => Response::Error {
                message: "a pass reached the control thread".into(),
            },
            Request::Status => Response::Status(snapshot()),
            Request::Stop => {
                if let Ok(tx) = requests.lock() {
                    let _ = tx.send("control request");
                }
                Response::Stopping
            }
            Request::Handoff => {
                if let Ok(tx) = requests.lock() {
                    let _ = tx.send(HANDOFF);
                }
                Response::HandingOff
            }
        };
        listener::serve(socket, handler, Some(long))
    })?;
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
    let standby = Arc::new(Standby::default());
    let stopper = Stopper {
        id: s.state.id,
        dev: s.state.dev.clone(),
        standby: standby.clone(),
        backend: s.backend.clone(),
    };
    spawn("uzram-stopper", move || {
        if let Ok(why) = stop_rx.recv() {
            stopper.stop(why);
        }
    })?;
    if s.recovered {
        // Until the device serves: see `crate::memory::pool::hold_refills`.
        crate::memory::pool::hold_refills();
    }
    let pool_target = s.pool_target;
    spawn("uzram-pool", move || crate::memory::pool::keep(pool_target))?;
    let aged = s.store.clone();
    let writeback = s.cfg.writeback.clone().map(|w| super::tier::Writeback {
        settings: w,
        budget: kept_budget,
    });
    if let (Some(w), Some(room)) = (&writeback, s.backend.room()) {
        let (store, budget, room) = (s.store.clone(), w.budget.clone(), room.clone());
        spawn("uzram-room", move || {
            super::pressure::keep_room(store, budget, room)
        })?;
    }
    if writeback.is_some() {
        let (store, recovered) = (s.store.clone(), s.recovered);
        spawn("uzram-release", move || {
            super::backing::keep_releasing(store, recovered)
        })?;
    }
    spawn("uzram-tier", move || {
        super::tier::keep(aged, recompression, writeback)
    })?;
    let compacted = s.store.clone();
    spawn("uzram-compact", move || {
        crate::memory::io_path_thread("uzram-compact");
        super::compactor::keep(compacted)
    })?;
    // A recovery's follow-up work once the device serves: commit the room it gave back again
    // (off the I/O path; see `commit_room_soon`), and link the holes it left between the old
    // daemon's pages off the free lists (`PageStore::link_adopted_holes`).
    let mut after_start = Vec::new();
    if s.recovered {
        let (start, len) = s.region.room();
        after_start.push(spawn_deferred("uzram-room", move || {
            crate::memory::free_lists::restore();
            crate::takeover::store_segment::commit_room_soon(start, len)
        })?);
        let holes = s.store.clone();
        after_start.push(spawn_deferred("uzram-holes", move || {
            holes.link_adopted_holes()
        })?);
    }
    Ok(Running {
        textfile,
        standby,
        after_start,
    })
}

/// `uzram status`'s answer, as the control socket, the metrics file and the carried
/// counters all read it.
fn status_snapshot(s: &Setup<'_>) -> Arc<dyn Fn() -> DeviceStatus + Send + Sync> {
    let template = DeviceStatus {
        id: s.state.id,
        dev: s.state.dev.clone(),
        pid: s.state.pid,
        size: s.cfg.size,
        algorithm: s.state.algorithm.clone(),
        backend: s.backend.name().to_string(),
        queues: s.cfg.queues,
        depth: s.cfg.depth,
        queue_mode: s.plan.mode.name().to_string(),
        stats: Vec::new(),
        requests: Vec::new(),
        backend_stats: Vec::new(),
    };
    // Counts the daemons before us left (nothing for a new device).
    let carried_in = Carry::new(s.region.carried_counters()).load();
    if !carried_in.is_empty() {
        tracing::info!(
            writes = carried_in
                .get(counters::WRITE_REQUESTS)
                .copied()
                .unwrap_or(0),
            reads = carried_in
                .get(counters::READ_REQUESTS)
                .copied()
                .unwrap_or(0),
            "counters go on from the last daemon's"
        );
    }
    let (store, counters, backend, plan) = (
        s.store.clone(),
        s.counters.clone(),
        s.backend.clone(),
        s.plan,
    );
    let recompressor = s.recompressor.clone();
    Arc::new(move || {
        let mut stats: Vec<Stat> = store
            .stats()
            .fields()
            .into_iter()
            .map(|(name, value)| Stat {
                name: name.to_string(),
                value,
            })
            .collect();
        stats.extend(super::tier::age_stats(&store));
        crate::takeover::carry::add_base(&mut stats, &carried_in);
        let requests = request_stats(counters.snapshot(), &carried_in, plan);
        let mut backend_stats = backend.stats();
        if let Some(r) = &recompressor {
            backend_stats.extend(
                r.stats()
                    .into_iter()
                    .map(|(name, value)| Stat { name, value }),
            );
        }
        DeviceStatus {
            stats,
            requests,
            backend_stats,
            ..template.clone()
        }
    })
}

/// Ends the device when asked: a stop deletes it, a handover leaves it to the next daemon.
struct Stopper {
    id: u32,
    dev: String,
    standby: Arc<Standby>,
    backend: Arc<WriteBackend>,
}

impl Stopper {
    fn stop(self, why: &'static str) {
        if why == HANDOFF {
            self.hand_over();
        }
        tracing::info!(why, "stopping the device");
        // While it is still swap, a queue that fails (or a panic) leaves the device to the
        // next daemon as before the stop: deleting it would take its pages with it.
        wait_until_not_swap(&self.dev);
        // From here a queue that fails ends as the stop ends them all.
        crate::takeover::leave::stopping();
        if let Err(err) = notify::notify("STOPPING=1") {
            tracing::warn!(error = %err, "sd_notify STOPPING=1 failed");
        }
        // The control ring is per thread: use a control handle of our own to stop the device,
        // which ends the queue threads and so `run_target` in the main thread.
        match UblkCtrl::new_simple(self.id as i32).and_then(|c| c.kill_dev()) {
            Ok(_) => {}
            Err(err) => tracing::error!(error = %err, "stopping the device failed"),
        }
    }

    /// Leaves the device to the daemon that asked for it; never returns.
    fn hand_over(&self) -> ! {
        // The daemon taking over is already running: our standby must not race it.
        if let Err(err) = self.standby.kill() {
            tracing::warn!(error = %err, "ending the standby for the handover failed");
        }
        // Pages staged for the GPU are installed first, while we still serve: the next
        // daemon would install them on the CPU before it serves (or, from staging in our
        // own pinned memory, lose them). Bounded: a hung GPU must not stop the handover.
        let start = std::time::Instant::now();
        match self.backend.drain(HANDOFF_DRAIN) {
            Some(true) => tracing::info!(
                ms = start.elapsed().as_millis() as u64,
                "staged pages installed for the handover"
            ),
            Some(false) if self.backend.staging_kept() => tracing::warn!(
                secs = HANDOFF_DRAIN.as_secs(),
                "the GPU did not finish its slots: the next daemon installs the pages still staged"
            ),
            Some(false) => tracing::error!(
                secs = HANDOFF_DRAIN.as_secs(),
                "the GPU did not finish its slots: pages still staged are lost to the next daemon"
            ),
            None => {}
        }
        // Exactly what a crash leaves, on purpose: the kernel holds the device and its I/O
        // for the next daemon (requests we had taken are reissued to it) and the store stays
        // in shared memory. The next daemon's counters go on from ours as they are now.
        tracing::info!("handing the device over to the next daemon; exiting");
        crate::takeover::leave::exit_leaving_device(0)
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
/// reclaim that was waiting for its writes never ends: `uzram-room` in reclaim, `uzram-holes`
/// exiting in `munmap`, a queue thread in `lock_mm_and_find_vma`, the hog and kswapd waiting
/// for bios (docs/recovery.md).
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

/// How the queues are served, as numbers for `uzram status` (the mode's name is `queue_mode`).
/// The request counters, the pool's and the queues', each carried one with what the dead
/// daemons before this one counted (`carried_in`) added, the pool's included.
fn request_stats(
    mut requests: Vec<Stat>,
    carried_in: &std::collections::HashMap<String, u64>,
    plan: QueuePlan,
) -> Vec<Stat> {
    requests.extend(pool_stats().into_iter().chain(queue_stats(plan)));
    crate::takeover::carry::add_base(&mut requests, carried_in);
    requests
}

fn queue_stats(plan: QueuePlan) -> [Stat; 3] {
    [
        Stat {
            name: counters::IO_THREADS_PER_QUEUE.into(),
            value: plan.threads_per_queue.into(),
        },
        // IORING_SETUP_* bits of the queue threads' rings (0x3100: coop + single issuer +
        // defer taskrun; see `ring`).
        Stat {
            name: counters::QUEUE_RING_SETUP_FLAGS.into(),
            value: crate::ublk::uring::setup_flags().into(),
        },
        Stat {
            name: counters::QUEUE_USER_COPY.into(),
            value: plan.user_copy().into(),
        },
    ]
}

/// The block pool's counters, for `uzram status`.
fn pool_stats() -> [Stat; 7] {
    let (waits, timeouts) = crate::memory::pool::take_waits();
    [
        Stat {
            name: counters::POOL_FREE_BLOCKS.into(),
            value: crate::memory::pool::free_blocks() as u64,
        },
        Stat {
            name: counters::POOL_RELEASED_BLOCKS.into(),
            value: crate::memory::pool::released_blocks() as u64,
        },
        // What the daemon holds (resident, shared memory included), beside the store's
        // mem_used_total: the difference is reserves, buffers and code.
        Stat {
            name: counters::DAEMON_RSS_BYTES.into(),
            value: sys::resident_bytes().unwrap_or(0),
        },
        Stat {
            name: counters::POOL_REFUSED_BLOCKS.into(),
            value: crate::memory::pool::fallen_back_blocks() as u64,
        },
        Stat {
            name: counters::POOL_WAITED_TAKES.into(),
            value: waits as u64,
        },
        Stat {
            name: counters::POOL_TAKE_TIMEOUTS.into(),
            value: timeouts as u64,
        },
        Stat {
            name: counters::POOL_DAMAGED_LISTS.into(),
            value: crate::memory::pool::damaged_lists() as u64,
        },
    ]
}

#[cfg(test)]
mod tests {

    /// What the daemons before a takeover counted of the pool's carried counters is in the
    /// status after it, as for the request counters (the pool's were read after the carried
    /// base was added, so a successor's first save reset them).
    #[test]
    fn the_pools_carried_counters_go_on_from_the_dead_daemons() {
        let carried_in: std::collections::HashMap<String, u64> = [
            (counters::POOL_TAKE_TIMEOUTS.to_string(), 5),
            (counters::POOL_REFUSED_BLOCKS.to_string(), 7),
        ]
        .into();
        let plan = QueuePlan {
            mode: crate::ublk::queue_mode::QueueMode::Batch,
            ctrl_flags: 0,
            threads_per_queue: 1,
        };
        let stats = request_stats(Vec::new(), &carried_in, plan);
        let value = |name: &str| stats.iter().find(|s| s.name == name).map(|s| s.value);
        assert!(value(counters::POOL_TAKE_TIMEOUTS).is_some_and(|v| v >= 5));
        assert!(value(counters::POOL_REFUSED_BLOCKS).is_some_and(|v| v >= 7));
    }

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

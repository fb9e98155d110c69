//! The ublk device a daemon serves: the queue mode, adding a new device (and deleting it
//! again when the start fails), and asking for a device whose daemon died.

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::{UblkError, UblkFlags};

use crate::config::{DeviceConfig, UserCopy};
use crate::ublk::queue_mode::{QueueMode, QueueModeChoice, QueuePlan};

/// The queue mode `cfg` asks for, or with `auto` the fastest one the driver offers
/// (`UBLK_U_CMD_GET_FEATURES`); decided before any memory is reserved, so that a mode the
/// kernel lacks is refused at once. Also returns the feature bits.
pub(super) fn choose_queue_mode(cfg: &DeviceConfig) -> anyhow::Result<(QueuePlan, Option<u64>)> {
    let features = UblkCtrl::get_features();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = crate::ublk::queue_mode::plan_with_copy(
        cfg.queue_mode,
        cfg.user_copy,
        cfg.backend == crate::config::Backend::Gpu,
        features,
        cfg.queues,
        cfg.depth,
        cpus,
    )?;
    tracing::info!(
        features = %features.map_or("none (GET_FEATURES needs Linux 6.5)".into(), |f| format!("{f:#x}")),
        asked = %cfg.queue_mode,
        mode = %plan.mode,
        threads_per_queue = plan.threads_per_queue,
        user_copy = plan.user_copy(),
        "queue mode"
    );
    Ok((plan, features))
}

/// A device this daemon added and the store it made for it, while its start can still fail:
/// when dropped still holding them (the start failed), the device is deleted and the store
/// removed, since no one would ever serve or recover them.
pub(super) struct Unborn {
    device: Option<u32>,
    /// The store's shared memory id, once made.
    pub store: Option<i32>,
}

impl Unborn {
    /// Device `id`, just added.
    pub fn device(id: u32) -> Self {
        Unborn {
            device: Some(id),
            store: None,
        }
    }

    /// Nothing made yet (a takeover makes neither).
    pub fn none() -> Self {
        Unborn {
            device: None,
            store: None,
        }
    }

    /// The start succeeded: the device and its store stay.
    pub fn disarm(&mut self) {
        self.device = None;
        self.store = None;
    }
}

impl Drop for Unborn {
    fn drop(&mut self) {
        if let Some(id) = self.store {
            crate::takeover::store_segment::remove(id);
        }
        if let Some(id) = self.device {
            // Its recovery record, made empty with the store (`record::reserve`).
            crate::takeover::record::remove(id);
            match UblkCtrl::new_simple(id as i32).and_then(|c| c.del_dev()) {
                Ok(_) => tracing::info!(id, "the start failed: the device is deleted again"),
                Err(err) => {
                    tracing::warn!(id, error = %err, "deleting the device of a failed start failed")
                }
            }
        }
    }
}

/// Adds the ublk device in `plan`'s mode. Should the driver refuse what it advertised, `auto`
/// falls back: a queue mode to `per-queue`, which every ublk kernel serves, and user copy to
/// none (with the queue mode chosen again without it).
pub(super) fn add(
    cfg: &DeviceConfig,
    plan: QueuePlan,
    features: Option<u64>,
) -> anyhow::Result<(UblkCtrl, QueuePlan)> {
    secure_run_dir()?;
    let refused = match build_ctrl(cfg, plan) {
        Ok(ctrl) => return Ok((ctrl, plan)),
        Err(err) => err,
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut fallbacks = Vec::new();
    if cfg.queue_mode == QueueModeChoice::Auto && plan.mode != QueueMode::PerQueue {
        let plain = crate::ublk::queue_mode::plan(
            QueueModeChoice::Exactly(QueueMode::PerQueue),
            features,
            cfg.queues,
            cfg.depth,
            cpus,
        )?;
        fallbacks.push(plain.with_user_copy(plan.user_copy()));
    }
    if cfg.user_copy == UserCopy::Auto && plan.user_copy() {
        let without =
            crate::ublk::queue_mode::plan(cfg.queue_mode, features, cfg.queues, cfg.depth, cpus)?;
        fallbacks.push(without.with_user_copy(false));
    }
    for fallback in fallbacks {
        tracing::warn!(
            mode = %plan.mode,
            user_copy = plan.user_copy(),
            error = %refused,
            then_mode = %fallback.mode,
            then_user_copy = fallback.user_copy(),
            "adding the device failed; trying again"
        );
        match build_ctrl(cfg, fallback) {
            Ok(ctrl) => return Ok((ctrl, fallback)),
            Err(err) => tracing::warn!(error = %err, "adding the device failed again"),
        }
    }
    Err(add_error(refused, cfg.id))
}

/// `UBLK_F_*` flags every device gets: when its daemon dies the device stays, its I/O queued,
/// until a new daemon takes over (`uzram recover`), and requests the dead one had taken are
/// issued again to the new one (swap writes and reads may be repeated; nothing is lost).
const RECOVERY_FLAGS: u64 =
    (libublk::sys::UBLK_F_USER_RECOVERY | libublk::sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;

/// libublk writes the device's JSON file into its run directory as root, through whatever is
/// at that name: the directory must be root's alone first (`ublk::run_dir`).
fn secure_run_dir() -> anyhow::Result<()> {
    crate::ublk::run_dir::secure().map(drop).map_err(|e| {
        anyhow::anyhow!(
            "making libublk's run directory {} root's alone: {e}",
            libublk::ctrl::UblkCtrl::run_dir()
        )
    })
}

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
        .io_buf_bytes(crate::footprint::IO_BUF_BYTES)
        // What we ask for at add time, also when taking over: the kernel reports more (7.x
        // sets flags of its own, such as UBLK_F_PER_IO_DAEMON, that libublk refuses as input).
        .ctrl_flags(plan.ctrl_flags | RECOVERY_FLAGS)
        .io_threads_per_queue(plan.threads_per_queue)
        .dev_flags(if plan.user_copy() {
            // libublk locks only the buffers it registers, and with user copy it registers
            // none (and refuses the flag): the queue threads lock their own (`queue.rs`).
            how
        } else {
            how | UblkFlags::UBLK_DEV_F_MLOCK_IO_BUFFER
        })
}

/// The device a daemon serves: one it just added, or one quiesced since its daemon died, not
/// yet asked for. A takeover asks for it ([`start_recovery`]) only after its threads, its
/// listener and its populated memory are ready: on 6.12 a daemon that dies between
/// `START_USER_RECOVERY` and its first queue served leaves the device refused to every later
/// daemon (docs/recovery.md), so that window holds nothing that could wait.
pub(super) enum Device {
    Added(Box<UblkCtrl>),
    /// Its id, and the queues and depth it was made with.
    Quiesced {
        id: u32,
        queues: u16,
        depth: u16,
    },
}

impl Device {
    pub fn id(&self) -> u32 {
        match self {
            Device::Added(ctrl) => ctrl.dev_info().dev_id,
            Device::Quiesced { id, .. } => *id,
        }
    }

    /// The control handle to serve the device through: a quiesced device is asked for now.
    pub fn start(
        self,
        plan: QueuePlan,
        pause: &mut Option<crate::takeover::pause::PauseClock>,
    ) -> anyhow::Result<UblkCtrl> {
        match self {
            Device::Added(ctrl) => Ok(*ctrl),
            Device::Quiesced { id, queues, depth } => {
                let ctrl = start_recovery(id, queues, depth, plan)?;
                crate::takeover::pause::step(pause, "start recovery");
                Ok(ctrl)
            }
        }
    }
}

/// Device `id`, quiesced since its daemon died, and the queue plan for taking it over: the
/// queue mode is the one the device was made with.
pub(super) fn recovery_plan(id: u32, plan: QueuePlan) -> anyhow::Result<(Device, QueuePlan)> {
    let info = crate::takeover::orphan::quiesced_info(id).map_err(|why| {
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
        (true, _) => crate::ublk::queue_mode::plan(
            QueueModeChoice::Exactly(QueueMode::Batch),
            Some(info.flags),
            info.nr_hw_queues,
            info.queue_depth,
            cpus,
        )?,
        (false, _) => crate::ublk::queue_mode::plan(
            QueueModeChoice::Exactly(QueueMode::PerQueue),
            None,
            info.nr_hw_queues,
            info.queue_depth,
            cpus,
        )?,
    };
    // Its requests' data moves as the device was made to move it.
    let plan = plan.with_user_copy(info.flags & u64::from(libublk::sys::UBLK_F_USER_COPY) != 0);
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
    secure_run_dir()?;
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

//! How requests travel between the kernel and the queue threads, chosen from what the
//! running kernel's ublk driver offers (`UBLK_U_CMD_GET_FEATURES`).
//!
//! - `batch` (`UBLK_F_BATCH_IO`, Linux 7.0): one uring command prepares, fetches or commits
//!   many requests, so a queue thread pays one round of io_uring work per batch of requests
//!   instead of one per request. One thread per queue.
//! - `per-io-daemon` (`UBLK_F_PER_IO_DAEMON`, Linux 6.16): several threads serve one queue,
//!   each its own share of the tags, one uring command per request. It spreads one queue's
//!   compression over several CPUs, which only pays where a queue has more CPUs than one
//!   thread (fewer queues than CPUs).
//! - `per-queue` (every ublk kernel): one thread per queue, one uring command per request.
//!
//! `auto` takes `batch` where the kernel has it, then `per-io-daemon` where a queue has CPUs to
//! spare, else `per-queue`. The order follows what each mode saves per request. In the
//! TCG guest (docs/bench/swap-tuning.md) the three modes ran the swap hog within 3 % of each
//! other, batch ahead; with fio, batch led on 4K writes at QD32 (+21 % over per-queue) and
//! trailed on 4K reads at QD1 (−20 %).
//! A mode asked for by name that the kernel lacks is an error, not a silent fallback.

use libublk::sys;

pub use crate::config::{QueueMode, QueueModeChoice, UserCopy};

/// Most threads `per-io-daemon` puts on one queue.
pub const MAX_THREADS_PER_QUEUE: u16 = 4;

/// The driver feature `mode` needs, if any.
fn feature(mode: QueueMode) -> Option<(u64, &'static str)> {
    match mode {
        QueueMode::Batch => Some((sys::UBLK_F_BATCH_IO as u64, "UBLK_F_BATCH_IO, Linux 7.0+")),
        QueueMode::PerIoDaemon => Some((
            sys::UBLK_F_PER_IO_DAEMON as u64,
            "UBLK_F_PER_IO_DAEMON, Linux 6.16+",
        )),
        QueueMode::PerQueue => None,
    }
}

fn offered_by(mode: QueueMode, features: u64) -> bool {
    feature(mode).is_none_or(|(bit, _)| features & bit != 0)
}

/// The chosen mode and what it takes to set the device up with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePlan {
    /// The mode.
    pub mode: QueueMode,
    /// `UBLK_F_*` flags to ask for when adding the device.
    pub ctrl_flags: u64,
    /// Threads serving each queue.
    pub threads_per_queue: u16,
}

impl QueuePlan {
    /// Whether requests' data moves by ublk's user copy (`UBLK_F_USER_COPY`).
    pub fn user_copy(&self) -> bool {
        self.ctrl_flags & u64::from(sys::UBLK_F_USER_COPY) != 0
    }

    /// The plan with user copy on or off as `on` says.
    pub fn with_user_copy(mut self, on: bool) -> Self {
        let bit = u64::from(sys::UBLK_F_USER_COPY);
        self.ctrl_flags = if on {
            self.ctrl_flags | bit
        } else {
            self.ctrl_flags & !bit
        };
        self
    }
}

/// `user-copy = "on"` where it cannot be had.
#[derive(Debug, thiserror::Error)]
#[error("user-copy = on {why}")]
pub struct UserCopyUnavailable {
    why: &'static str,
}

/// Most queues `user-copy = "auto"` takes user copy for. With more, the kernel's copies
/// into staging that is not in cache (each line read in before it is written) compete for
/// memory bandwidth: at 16 queues user copy cost the GPU path 5-14 % of its ingest and
/// raised the reader's busy p99 1.4-2.1x on three of four corpora, where at 1 and 4 it cut
/// the daemon's CPU per GiB by a fifth to a third at about the same ingest
/// (docs/bench/gpu-runs.md, run 194). At 8 and 16 queues on five later heaps it saved 8-15 %
/// of the CPU for 2-12 % of the ingest and 1.4-2.4x the busy p99 (run 249). Those runs
/// copied every request into one buffer, always in cache; with the copies spread over 64
/// request buffers, as over a queue's tags, the buffer's ingest lead is gone but the p99
/// stays (user copy 1.85-2.9x idle at 16 queues, the buffer 1.5-1.6x; runs 252-253), and
/// swap feels the reads first.
pub const USER_COPY_AUTO_MAX_QUEUES: u16 = 4;

/// Whether `user-copy = "auto"` takes user copy for a device of `queues` queues whose writes
/// go to a GPU (`gpu_writes`), where the kernel offers it.
pub fn user_copy_by_default(gpu_writes: bool, queues: u16) -> bool {
    gpu_writes && queues <= USER_COPY_AUTO_MAX_QUEUES && USER_COPY_HOST
}

/// The kernel copies a request's bytes in order, and the ring reads staging as little-endian
/// words (`page_to_words`): user copy needs a little-endian host.
const USER_COPY_HOST: bool = cfg!(target_endian = "little");

/// [`plan`], with ublk's user copy decided: `on` takes it or fails; `auto` takes it where
/// [`user_copy_by_default`] says and the kernel offers it, and then, under
/// `queue-mode = "auto"`, prefers it to `batch` (which cannot have it: `UBLK_F_BATCH_IO`
/// refuses `UBLK_F_USER_COPY`) for the daemon CPU it saves (run 194). The two were not
/// measured against each other through ublk: `uzram bench` drives the handler without it,
/// and no host here has both a GPU and ublk.
pub fn plan_with_copy(
    choice: QueueModeChoice,
    copy: UserCopy,
    gpu_writes: bool,
    features: Option<u64>,
    queues: u16,
    depth: u16,
    cpus: usize,
) -> anyhow::Result<QueuePlan> {
    let offered = features.is_some_and(|f| f & u64::from(sys::UBLK_F_USER_COPY) != 0);
    let want = match copy {
        UserCopy::Off => false,
        UserCopy::On if !offered => {
            return Err(UserCopyUnavailable {
                why: "needs UBLK_F_USER_COPY (Linux 6.5+), which this kernel's ublk_drv does not offer (use user-copy = auto or off)",
            }
            .into())
        }
        UserCopy::On if !USER_COPY_HOST => {
            return Err(UserCopyUnavailable {
                why: "needs a little-endian host (the ring reads staging as little-endian words)",
            }
            .into())
        }
        UserCopy::On => true,
        UserCopy::Auto => offered && user_copy_by_default(gpu_writes, queues),
    };
    let batch = u64::from(sys::UBLK_F_BATCH_IO);
    let features = match (want, choice) {
        (true, QueueModeChoice::Auto) => features.map(|f| f & !batch),
        _ => features,
    };
    let plan = plan(choice, features, queues, depth, cpus)?;
    match (want, plan.mode) {
        (true, QueueMode::Batch) if copy == UserCopy::On => Err(UserCopyUnavailable {
            why: "cannot go with queue-mode = batch (UBLK_F_BATCH_IO refuses UBLK_F_USER_COPY): use per-queue or per-io-daemon",
        }
        .into()),
        (true, QueueMode::Batch) => Ok(plan),
        _ => Ok(plan.with_user_copy(want)),
    }
}

/// A mode was asked for that this kernel's ublk driver does not offer.
#[derive(Debug, thiserror::Error)]
#[error(
    "queue mode {mode} needs {needs}; this kernel's ublk_drv offers {offered} \
     (use --queue-mode auto)"
)]
pub struct UnsupportedQueueMode {
    mode: QueueMode,
    needs: &'static str,
    offered: String,
}

/// Picks the mode for a device of `queues` x `depth` on a machine with `cpus` CPUs, given the
/// driver's feature bits (`None`: a kernel before 6.5 without `GET_FEATURES`).
pub fn plan(
    choice: QueueModeChoice,
    features: Option<u64>,
    queues: u16,
    depth: u16,
    cpus: usize,
) -> Result<QueuePlan, UnsupportedQueueMode> {
    let features = features.unwrap_or(0);
    // CPUs per queue beyond the first are what extra threads of a queue can use.
    let spare = u16::try_from(cpus / usize::from(queues.max(1))).unwrap_or(u16::MAX);
    let threads = spare.clamp(2, MAX_THREADS_PER_QUEUE).min(depth.max(1));
    let mode = match choice {
        QueueModeChoice::Exactly(mode) => {
            if !offered_by(mode, features) {
                let needs = feature(mode).map_or("", |(_, needs)| needs);
                return Err(UnsupportedQueueMode {
                    mode,
                    needs,
                    offered: offered(features),
                });
            }
            mode
        }
        QueueModeChoice::Auto if offered_by(QueueMode::Batch, features) => QueueMode::Batch,
        QueueModeChoice::Auto if offered_by(QueueMode::PerIoDaemon, features) && spare >= 2 => {
            QueueMode::PerIoDaemon
        }
        QueueModeChoice::Auto => QueueMode::PerQueue,
    };
    Ok(match mode {
        QueueMode::Batch => QueuePlan {
            mode,
            ctrl_flags: sys::UBLK_F_BATCH_IO as u64,
            threads_per_queue: 1,
        },
        // The driver turns UBLK_F_PER_IO_DAEMON on by itself (6.16+, unless BATCH_IO).
        QueueMode::PerIoDaemon => QueuePlan {
            mode,
            ctrl_flags: 0,
            threads_per_queue: threads,
        },
        QueueMode::PerQueue => QueuePlan {
            mode,
            ctrl_flags: 0,
            threads_per_queue: 1,
        },
    })
}

/// The modes `features` allows, for messages.
fn offered(features: u64) -> String {
    [
        QueueMode::Batch,
        QueueMode::PerIoDaemon,
        QueueMode::PerQueue,
    ]
    .into_iter()
    .filter(|&m| offered_by(m, features))
    .map(QueueMode::name)
    .collect::<Vec<_>>()
    .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const BATCH: u64 = sys::UBLK_F_BATCH_IO as u64;
    const PER_IO: u64 = sys::UBLK_F_PER_IO_DAEMON as u64;
    /// What 6.12's driver reports (no per-io daemon, no batch).
    const K612: u64 = (sys::UBLK_F_SUPPORT_ZERO_COPY
        | sys::UBLK_F_URING_CMD_COMP_IN_TASK
        | sys::UBLK_F_USER_RECOVERY
        | sys::UBLK_F_CMD_IOCTL_ENCODE
        | sys::UBLK_F_USER_COPY) as u64;

    #[test]
    fn user_copy_goes_with_gpu_writes_and_before_batch_under_auto() {
        let copy = |c, q, gpu, f| plan_with_copy(q, c, gpu, f, 2, 64, 2);
        let bit = sys::UBLK_F_USER_COPY as u64;
        // auto: on for a GPU's writes where offered, in place of batch
        let p = copy(
            UserCopy::Auto,
            QueueModeChoice::Auto,
            true,
            Some(K612 | BATCH),
        )
        .unwrap();
        assert_eq!((p.mode, p.user_copy()), (QueueMode::PerQueue, true));
        assert_eq!(p.ctrl_flags, bit);
        // not for the CPU's writes, which keep batch
        let p = copy(
            UserCopy::Auto,
            QueueModeChoice::Auto,
            false,
            Some(K612 | BATCH),
        )
        .unwrap();
        assert_eq!((p.mode, p.user_copy()), (QueueMode::Batch, false));
        // not with more than 4 queues
        let many = plan_with_copy(
            QueueModeChoice::Auto,
            UserCopy::Auto,
            true,
            Some(K612),
            16,
            64,
            32,
        );
        assert!(!many.unwrap().user_copy());
        // not where the kernel lacks it (before 6.5 there is no feature list at all)
        let p = copy(UserCopy::Auto, QueueModeChoice::Auto, true, None).unwrap();
        assert!(!p.user_copy());
        // batch asked by name keeps batch, without user copy
        let named = QueueModeChoice::Exactly(QueueMode::Batch);
        let p = copy(UserCopy::Auto, named, true, Some(K612 | BATCH)).unwrap();
        assert_eq!((p.mode, p.user_copy()), (QueueMode::Batch, false));
        // on: taken with any backend, refused with batch or without the feature
        let p = copy(UserCopy::On, QueueModeChoice::Auto, false, Some(K612)).unwrap();
        assert!(p.user_copy());
        let err = copy(UserCopy::On, named, false, Some(K612 | BATCH)).unwrap_err();
        assert!(err.to_string().contains("batch"), "{err}");
        let err = copy(UserCopy::On, QueueModeChoice::Auto, false, Some(BATCH)).unwrap_err();
        assert!(err.to_string().contains("UBLK_F_USER_COPY"), "{err}");
        // off: never
        let p = copy(UserCopy::Off, QueueModeChoice::Auto, true, Some(K612)).unwrap();
        assert!(!p.user_copy());
        assert!(!p.with_user_copy(true).with_user_copy(false).user_copy());
    }

    #[test]
    fn auto_takes_batch_where_offered() {
        let p = plan(QueueModeChoice::Auto, Some(K612 | PER_IO | BATCH), 2, 64, 2).unwrap();
        assert_eq!(p.mode, QueueMode::Batch);
        assert_eq!(p.ctrl_flags, BATCH);
        assert_eq!(p.threads_per_queue, 1);
    }

    #[test]
    fn auto_falls_back_to_per_queue_on_6_12_and_without_get_features() {
        for features in [Some(K612), None] {
            let p = plan(QueueModeChoice::Auto, features, 2, 64, 2).unwrap();
            assert_eq!(p.mode, QueueMode::PerQueue);
            assert_eq!((p.ctrl_flags, p.threads_per_queue), (0, 1));
        }
    }

    #[test]
    fn auto_uses_per_io_daemon_only_with_spare_cpus() {
        // 6.16-6.19: a queue per CPU already has its own CPU.
        let p = plan(QueueModeChoice::Auto, Some(K612 | PER_IO), 2, 64, 2).unwrap();
        assert_eq!(p.mode, QueueMode::PerQueue);
        let p = plan(QueueModeChoice::Auto, Some(K612 | PER_IO), 4, 64, 16).unwrap();
        assert_eq!(p.mode, QueueMode::PerIoDaemon);
        assert_eq!(p.threads_per_queue, MAX_THREADS_PER_QUEUE);
        assert_eq!(p.ctrl_flags, 0);
    }

    #[test]
    fn a_named_mode_is_refused_where_the_kernel_lacks_it() {
        let err = plan(
            QueueModeChoice::Exactly(QueueMode::Batch),
            Some(K612),
            1,
            64,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("UBLK_F_BATCH_IO"), "{err}");
        assert!(err.contains("offers per-queue"), "{err}");
        assert!(plan(
            QueueModeChoice::Exactly(QueueMode::PerIoDaemon),
            None,
            1,
            64,
            2
        )
        .is_err());
        // per-queue works everywhere, even where the other two are offered
        let p = plan(
            QueueModeChoice::Exactly(QueueMode::PerQueue),
            Some(K612 | PER_IO | BATCH),
            2,
            64,
            2,
        )
        .unwrap();
        assert_eq!(
            (p.mode, p.ctrl_flags, p.threads_per_queue),
            (QueueMode::PerQueue, 0, 1)
        );
    }

    #[test]
    fn named_per_io_daemon_has_at_least_two_threads_and_no_more_than_the_depth() {
        let p = plan(
            QueueModeChoice::Exactly(QueueMode::PerIoDaemon),
            Some(PER_IO),
            2,
            64,
            2,
        )
        .unwrap();
        assert_eq!(p.threads_per_queue, 2);
        let p = plan(
            QueueModeChoice::Exactly(QueueMode::PerIoDaemon),
            Some(PER_IO),
            1,
            1,
            8,
        )
        .unwrap();
        assert_eq!(p.threads_per_queue, 1);
    }

    #[test]
    fn names_round_trip() {
        for name in ["auto", "batch", "per-io-daemon", "per-queue"] {
            assert_eq!(QueueModeChoice::parse(name).unwrap().to_string(), name);
        }
        assert_eq!(QueueModeChoice::parse("fast"), None);
    }
}

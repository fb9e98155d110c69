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

pub use crate::config::{QueueMode, QueueModeChoice};

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

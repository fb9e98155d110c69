//! What a ring counts: the atomic [`Counters`] its threads bump, the [`RingStats`] snapshot
//! taken of them, and [`SlotTimes`], where the slots' time went.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Declares each field of [`RingStats`] once, with its name in [`RingStats::fields`] (the
/// order here is the order `uzram status` and the metrics print). A `count` field is a
/// plain counter: an atomic of [`Counters`] that the ring bumps and the snapshot loads. A
/// `given` field is worked out when the snapshot is taken, in
/// [`Ring::stats`](super::Ring::stats).
macro_rules! ring_stats {
    // The atomics of the `count` fields, gathered one field at a time, then the rest.
    (@counters [$($atomic:ident)*]) => {
        /// The ring's counters, bumped with relaxed atomics by every thread.
        #[derive(Debug, Default)]
        pub(super) struct Counters {
            $(pub(super) $atomic: AtomicU64,)*
            /// Time installer threads spent on slots, ns.
            pub(super) install_busy_ns: AtomicU64,
            /// Time installer threads spent copying objects into the arena, ns.
            pub(super) install_copy_ns: AtomicU64,
            /// Time slots spent in each [`Step`], ns.
            pub(super) slot_ns: [AtomicU64; STEPS],
        }
    };
    (@counters [$($atomic:ident)*] count $field:ident $($rest:tt)*) => {
        ring_stats!(@counters [$($atomic)* $field] $($rest)*);
    };
    (@counters [$($atomic:ident)*] given $field:ident $($rest:tt)*) => {
        ring_stats!(@counters [$($atomic)*] $($rest)*);
    };
    (@load count $counter:expr) => {
        $counter.load(Ordering::Relaxed)
    };
    (@load given $counter:expr) => {
        0
    };
    ($($(#[$doc:meta])* $kind:ident $field:ident => $name:literal,)*) => {
        /// Counters of a [`Ring`](super::Ring).
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct RingStats {
            $($(#[$doc])* pub $field: u64,)*
            /// Where the slots' time went, summed over every slot, µs: what bounds a ring whose
            /// backend is faster than its writers or installers.
            pub slot_us: SlotTimes,
        }

        impl RingStats {
            /// `(name, value)` pairs for `uzram status`.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                let mut fields = vec![$(($name, self.$field),)*];
                fields.extend(self.slot_us.fields());
                fields
            }
        }

        ring_stats!(@counters [] $($kind $field)*);

        impl Counters {
            /// A snapshot of the `count` fields and the slot times; the `given` fields are
            /// left at zero.
            pub(super) fn snapshot(&self) -> RingStats {
                RingStats {
                    $($field: ring_stats!(@load $kind self.$field),)*
                    slot_us: SlotTimes::from_ns(&self.slot_ns),
                }
            }
        }
    };
}

ring_stats! {
    /// Pages copied into slots.
    count staged_pages => "ring_staged_pages",
    /// Pages the writers found same-filled (stored at once, never staged).
    count same_filled_pages => "ring_same_filled_pages",
    /// Pages compressed inline because every slot was busy.
    count overflow_pages => "ring_overflow_pages",
    /// Times a writer found every slot busy and waited for one
    /// ([`RingConfig::slot_wait`](super::RingConfig::slot_wait)).
    count slot_waits => "ring_slot_waits",
    /// Waits that ended with no slot freed (the ring then counts as stalled).
    count slot_wait_timeouts => "ring_slot_wait_timeouts",
    /// Pages compressed inline because the backend was retired.
    count retired_pages => "ring_retired_pages",
    /// Slots handed to the backend.
    count slots_submitted => "ring_slots_submitted",
    /// Slots whose results were installed (from the backend or the CPU).
    count slots_installed => "ring_slots_installed",
    /// Pages whose result was installed.
    count installed_pages => "ring_installed_pages",
    /// Results dropped because the page changed meanwhile.
    count stale_pages => "ring_stale_pages",
    /// Pages the backend's own check rejected (compressed on the CPU instead).
    count rejected_pages => "ring_rejected_pages",
    /// Slots compressed on the CPU because the backend failed them.
    count fallback_slots => "ring_fallback_slots",
    /// Pages compressed on the CPU by installers (rejected, failed or contract-breaking).
    count cpu_pages => "ring_cpu_pages",
    /// Backend results whose checksum was compared with their writer's before install.
    count checksum_checked_pages => "ring_checksum_checked_pages",
    /// Backend results whose checksum was not their writer's (compressed on the CPU
    /// instead; the backend was retired).
    count checksum_mismatches => "ring_checksum_mismatches",
    /// Compressed pages decoded on the CPU before install.
    count spot_checked_pages => "ring_spot_checked_pages",
    /// Spot checks whose decode differed from the page.
    count spot_check_failures => "ring_spot_check_failures",
    /// Results that broke the layout's contract.
    count contract_violations => "ring_contract_violations",
    /// Failed submissions and completions.
    count backend_failures => "ring_backend_failures",
    /// Slots whose results had not come within
    /// [`RingConfig::device_deadline`](super::RingConfig::device_deadline): installed from
    /// staging on the CPU, and the backend retired.
    count hung_slots => "ring_hung_slots",
    /// 1 once the backend is retired.
    given retired => "ring_backend_retired",
    /// Installs retried because the allocator had no memory.
    count commit_retries => "ring_commit_retries",
    /// Time installer threads spent on slots (waiting for the device included), µs.
    given install_busy_us => "ring_install_busy_us",
    /// Of that, time spent copying objects into the arena (compressed blocks, raw staged
    /// pages, the CPU's own results), µs: what the device's copy engine could take off the
    /// installers.
    given install_copy_us => "ring_install_copy_us",
    /// Compressed bytes the backend's copy engine placed in the store straight from the
    /// device, which the installers then did not copy (`batch/place.rs`).
    count placed_bytes => "ring_placed_bytes",
    /// The copy engine's copies (each a run of compressed pages).
    count placed_runs => "ring_placed_runs",
    /// Installs whose placement failed or did not hold the host's copy (the installers
    /// wrote those pages themselves, and the ring stopped placing).
    count place_failures => "ring_place_failures",
    /// Slots not free right now.
    given busy_slots => "ring_busy_slots",
}

/// Time slots spent in each step of their cycle, summed over slots, µs. The step a slot
/// is in now is not counted until it ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotTimes {
    /// Free, waiting for a writer to open it.
    pub free: u64,
    /// Open, taking pages, until full or its delay was up.
    pub filling: u64,
    /// Sealed, until its last writer finished copying in.
    pub sealed: u64,
    /// In the backend's `submit` (on the last writer's thread).
    pub submitting: u64,
    /// Submitted, waiting for an installer.
    pub queued: u64,
    /// An installer waiting for the backend's results.
    pub device: u64,
    /// Results (or the CPU's) being installed, until the slot is freed.
    pub installing: u64,
}

impl SlotTimes {
    fn from_ns(ns: &[AtomicU64; STEPS]) -> Self {
        let us = |step: Step| ns[step as usize].load(Ordering::Relaxed) / 1000;
        Self {
            free: us(Step::Free),
            filling: us(Step::Filling),
            sealed: us(Step::Sealed),
            submitting: us(Step::Submitting),
            queued: us(Step::Queued),
            device: us(Step::Device),
            installing: us(Step::Installing),
        }
    }

    fn fields(&self) -> [(&'static str, u64); STEPS] {
        [
            ("ring_slot_free_us", self.free),
            ("ring_slot_filling_us", self.filling),
            ("ring_slot_sealed_us", self.sealed),
            ("ring_slot_submitting_us", self.submitting),
            ("ring_slot_queued_us", self.queued),
            ("ring_slot_device_us", self.device),
            ("ring_slot_installing_us", self.installing),
        ]
    }
}

/// The steps of [`SlotTimes`], as indices of [`Counters::slot_ns`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Step {
    Free,
    Filling,
    Sealed,
    Submitting,
    Queued,
    Device,
    Installing,
}

/// How many [`Step`]s there are.
const STEPS: usize = Step::Installing as usize + 1;

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// `d` in ns, for the ring's ns counters (saturating: a u64 of ns is 584 years).
pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

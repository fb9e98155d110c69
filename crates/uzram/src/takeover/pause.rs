//! Where a takeover's I/O pause goes. The device serves nothing from the moment its old
//! daemon stops until the new one serves its queues; the log line that ends the pause names
//! each step's share, so a slow takeover says what to look at.

use std::fmt;
use std::time::{Duration, Instant};

/// The steps of one takeover, timed from when the device stopped being served.
#[derive(Debug, Clone)]
pub struct PauseClock {
    since: Instant,
    last: Instant,
    steps: Vec<(&'static str, Duration)>,
    /// The process's page faults when the pause began (0: it began before the process).
    faults_before: u64,
    /// Its private memory in RAM then, bytes (0: it began before the process).
    anon_before: u64,
}

impl PauseClock {
    /// A pause that began at `since`.
    pub fn since(since: Instant) -> Self {
        PauseClock {
            since,
            last: since,
            steps: Vec::new(),
            faults_before: 0,
            anon_before: 0,
        }
    }

    /// A pause that begins now, in a process that was running before it.
    pub fn now() -> Self {
        Self::starting(Instant::now())
    }

    /// A pause that began at `since` in a process that was running before it and has
    /// touched no new memory since.
    pub fn starting(since: Instant) -> Self {
        let mut clock = Self::since(since);
        clock.faults_before = process_faults();
        clock.anon_before = crate::sys::anon_resident_bytes().unwrap_or(0);
        clock
    }

    /// A pause that began when this process started, its first step ("exec") ending now:
    /// for a daemon started because its device's daemon died (`uzram recover`).
    pub fn since_start() -> Self {
        let age = crate::sys::process_age().unwrap_or_default();
        let mut clock = Self::since(Instant::now().checked_sub(age).unwrap_or_else(Instant::now));
        clock.step("exec");
        clock
    }

    /// `step` ended now: it took the time since the previous step ended.
    pub fn step(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps
            .push((step, now.saturating_duration_since(self.last)));
        self.last = now;
    }

    /// From the start of the pause to the end of the last step.
    pub fn total(&self) -> Duration {
        self.last.saturating_duration_since(self.since)
    }

    /// Page faults this process took since the pause began: roughly the pages the takeover
    /// had to get from the system while nothing could be swapped out to free one.
    pub fn faults(&self) -> u64 {
        process_faults().saturating_sub(self.faults_before)
    }

    /// How much this process's private memory in RAM grew since the pause began, KiB: what
    /// the takeover took from a system in which nothing could be swapped out until it served
    /// (the recovery room is there for it). A daemon started before the crash made most of
    /// its memory before (`uzram daemon --wait`).
    pub fn anon_grown_kib(&self) -> u64 {
        crate::sys::anon_resident_bytes()
            .unwrap_or(0)
            .saturating_sub(self.anon_before)
            / 1024
    }
}

fn process_faults() -> u64 {
    crate::sys::usage(crate::sys::CpuOf::Process).map_or(0, |u| u.faults)
}

/// [`PauseClock::step`] when there is a pause (a takeover); nothing for a new device.
pub fn step(pause: &mut Option<PauseClock>, name: &'static str) {
    if let Some(p) = pause {
        p.step(name);
    }
}

/// `step ms, step ms, …`, largest first.
impl fmt::Display for PauseClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut steps = self.steps.clone();
        steps.sort_by_key(|s| std::cmp::Reverse(s.1));
        for (i, (name, took)) in steps.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name} {}", took.as_millis())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_takes_the_time_since_the_step_before() {
        let mut clock = PauseClock::since(Instant::now() - Duration::from_millis(50));
        clock.step("wait");
        std::thread::sleep(Duration::from_millis(20));
        clock.step("store");
        assert!(clock.steps[0].1 >= Duration::from_millis(50));
        assert!(clock.steps[1].1 >= Duration::from_millis(20));
        let sum: Duration = clock.steps.iter().map(|s| s.1).sum();
        assert_eq!(sum, clock.total());
    }

    #[test]
    fn the_line_lists_the_largest_step_first() {
        let mut clock = PauseClock::now();
        clock.steps = vec![
            ("store", Duration::from_millis(5)),
            ("queues", Duration::from_millis(300)),
            ("wait", Duration::from_millis(40)),
        ];
        let line = clock.to_string();
        assert_eq!(line, "queues 300, wait 40, store 5");
    }

    #[test]
    fn a_pause_counts_the_memory_touched_since_it_began() {
        // Other tests of this binary allocate and free memory meanwhile, which moves the
        // process's resident total either way: a pause so disturbed is measured again. 48 MiB,
        // above the mmap threshold `memory::reserve` may have set for the whole process, so
        // that the memory is new, not a heap's free memory already resident.
        const TOUCHED: usize = 48 << 20;
        let mut seen = Vec::new();
        for _ in 0..5 {
            let clock = PauseClock::now();
            let touched = vec![1u8; TOUCHED];
            let (grown, faults) = (clock.anon_grown_kib(), clock.faults());
            drop(std::hint::black_box(touched));
            if grown >= (TOUCHED as u64 >> 10) * 15 / 16 && faults >= 3000 {
                return;
            }
            seen.push((grown, faults));
        }
        panic!("48 MiB touched in each of 5 pauses; KiB grown and faults: {seen:?}");
    }
}

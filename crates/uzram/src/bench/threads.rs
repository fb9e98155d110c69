//! CPU time of the process's threads by role, from `/proc/self/task/*/schedstat` (the
//! scheduler's nanosecond run time) and each thread's name: where a run's CPU goes.

use std::collections::BTreeMap;

/// A thread's role, from its name.
fn role(comm: &str) -> &'static str {
    if comm.starts_with("bench-queue") {
        "queues"
    } else if comm.starts_with("uzram-install") {
        "installers"
    } else if comm.starts_with("uzram-ring-subm") {
        // The ring's submitter (the name cut to the kernel's 15 bytes): the backend's
        // `submit` of every slot.
        "submitter"
    } else if comm.starts_with("bench-reader") {
        "reader"
    } else if comm.starts_with("uzram-pool") {
        // Faults in the blocks the store's new segments come from.
        "keeper"
    } else {
        "other"
    }
}

/// Nanoseconds on a CPU per role so far. Threads that exited are not counted: the bench's
/// queue threads measure their own time instead.
pub fn cpu_by_role() -> BTreeMap<&'static str, u64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let ns = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        *out.entry(role(comm.trim())).or_insert(0) += ns;
    }
    out
}

/// `after - before` per role.
pub fn delta(
    before: &BTreeMap<&'static str, u64>,
    after: &BTreeMap<&'static str, u64>,
) -> BTreeMap<&'static str, u64> {
    after
        .iter()
        .map(|(k, v)| (*k, v.saturating_sub(before.get(k).copied().unwrap_or(0))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_thread_is_counted_under_its_role() {
        let before = cpu_by_role();
        // Busy for 50 ms: /proc counts CPU time in clock ticks (10 ms), and a fixed number
        // of iterations took less than one in a release build.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(50) {
            for i in 0..10_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
        }
        let after = cpu_by_role();
        let d = delta(&before, &after);
        assert!(d.values().sum::<u64>() > 0, "{d:?}");
        assert_eq!(role("uzram-install-3"), "installers");
        assert_eq!(role("uzram-ring-subm"), "submitter");
        assert_eq!(role("bench-queue-0"), "queues");
        assert_eq!(role("cuda-EvtHandlr"), "other");
    }
}

//! Which CPUs a thread may run on: read, set, and the share of them that the kernel's
//! block layer gives each hardware queue of a device.
//!
//! libublk pins each of the daemon's queue threads to the CPUs the kernel reports for its
//! queue (`UBLK_CMD_GET_QUEUE_AFFINITY`, blk-mq's map), so `uzram bench` pins its stand-in
//! queue threads the same way ([`queue_cpus`]) to measure what the daemon runs.

use std::io;

use super::errno::check;

/// The CPUs the calling thread may run on, ascending.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is a plain bitmask, for which all-zero bytes are a valid value.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a cpu_set_t of the size passed, writable for the call's duration.
    check(unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) })?;
    let most = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    // SAFETY: every index is below CPU_SETSIZE, the set's size in bits.
    Ok((0..most)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Lets the calling thread run only on `cpus` (each below `CPU_SETSIZE`).
pub fn pin_thread(cpus: &[usize]) -> io::Result<()> {
    set_cpus_of(0, cpus)
}

/// Lets thread `tid` (0: the calling one) of this process run only on `cpus` (each below
/// `CPU_SETSIZE`).
pub fn set_cpus_of(tid: super::sched::Tid, cpus: &[usize]) -> io::Result<()> {
    let most = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    if cpus.is_empty() || cpus.iter().any(|&cpu| cpu >= most) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("no CPU set can hold {cpus:?}"),
        ));
    }
    // SAFETY: as in `allowed_cpus`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a cpu_set_t of the size passed, read for the call's duration.
    check(unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) })
}

/// The CPUs of `allowed` (ascending) that blk-mq maps to hardware queue `q` of `queues`:
/// `allowed` cut into `queues` runs of consecutive CPUs, the first `len % queues` runs one
/// CPU longer (`group_cpus_evenly` on a host of one NUMA node whose CPUs are not SMT
/// siblings, as the GPU host's; elsewhere the kernel groups by node and sibling first).
/// With more queues than CPUs, queue `q` gets CPU `q % len`, as a queue the kernel leaves
/// without CPUs of its own has to run somewhere.
pub fn queue_cpus(allowed: &[usize], q: usize, queues: usize) -> &[usize] {
    let n = allowed.len();
    if n == 0 || queues == 0 {
        return allowed;
    }
    if queues >= n {
        let i = q % n;
        return &allowed[i..=i];
    }
    let (base, extra) = (n / queues, n % queues);
    let q = q % queues;
    let start = q * base + q.min(extra);
    let len = base + usize::from(q < extra);
    &allowed[start..start + len]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_split_the_cpus_into_even_runs_the_first_ones_longer() {
        let cpus: Vec<usize> = (0..16).collect();
        for q in 0..16 {
            assert_eq!(queue_cpus(&cpus, q, 16), &[q]);
        }
        assert_eq!(queue_cpus(&cpus, 0, 4), &[0, 1, 2, 3]);
        assert_eq!(queue_cpus(&cpus, 3, 4), &[12, 13, 14, 15]);
        assert_eq!(queue_cpus(&cpus, 0, 1), cpus.as_slice());
        // 16 over 6: runs of 3, 3, 3, 3, 2, 2, every CPU once.
        let runs: Vec<&[usize]> = (0..6).map(|q| queue_cpus(&cpus, q, 6)).collect();
        assert_eq!(
            runs.iter().map(|r| r.len()).collect::<Vec<_>>(),
            [3, 3, 3, 3, 2, 2]
        );
        assert_eq!(runs.concat(), cpus);
        // A process allowed on some CPUs only: its own, in order.
        let some = [2, 5, 7];
        assert_eq!(queue_cpus(&some, 1, 2), &[7]);
        assert_eq!(queue_cpus(&some, 0, 2), &[2, 5]);
        // More queues than CPUs: each queue on one, round the CPUs.
        assert_eq!(queue_cpus(&some, 4, 16), &[5]);
    }

    #[test]
    fn a_pinned_thread_runs_only_where_it_was_pinned() {
        let before = allowed_cpus().expect("sched_getaffinity");
        assert!(!before.is_empty());
        let last = *before.last().unwrap();
        std::thread::spawn(move || {
            pin_thread(&[last]).expect("sched_setaffinity");
            assert_eq!(allowed_cpus().unwrap(), [last]);
            // SAFETY: sched_getcpu takes no arguments.
            let now = unsafe { libc::sched_getcpu() };
            assert_eq!(usize::try_from(now).ok(), Some(last));
        })
        .join()
        .unwrap();
        // Only the thread that asked was pinned.
        assert_eq!(allowed_cpus().unwrap(), before);
        assert!(pin_thread(&[]).is_err());
        assert!(pin_thread(&[1 << 20]).is_err());
    }
}

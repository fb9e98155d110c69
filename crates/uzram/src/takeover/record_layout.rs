//! What lies where in a recovery record segment, and how large one is made.
//!
//! A record holds libublk's device file, which names every queue with its thread and its
//! CPUs: about 50 bytes a queue and 5 a CPU beside a fixed kilobyte (`libublk` 0.4.8's
//! `build_json_with_affinities`; [`expected_body`] bounds it with 56 and 5). A 16 KiB
//! segment's half (8,176 bytes) holds it up to about 110 queues and the whole segment up to
//! about 250; a device with more would have its record written in place, or none at all. So
//! a segment is made as large as its device needs: 16 KiB (the size every release before
//! reads) doubled until a half holds the body, up to 1 MiB (4,096 queues take about 220 KB).

/// Magic, length word, device: the header every record size starts with.
pub(super) const HEADER: usize = 16;
/// The length word's flag: the body is in the second half. Without it the body starts
/// right after the header (as every record of the releases before, up to the write count).
pub(super) const SECOND: u32 = 1 << 31;

/// The size of a record segment and the places in it that follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Layout {
    len: usize,
}

impl Layout {
    /// The size of every record segment of the releases before, and of most devices'.
    pub(super) const BASE: Layout = Layout { len: 16 << 10 };
    /// The largest record segment made or read.
    pub(super) const MAX: Layout = Layout { len: 1 << 20 };

    /// The layout of a segment of `len` bytes, if that is a record's size: a power of two
    /// from [`Self::BASE`] to [`Self::MAX`]. A segment of any other size is not a record.
    pub(super) fn of(len: usize) -> Option<Self> {
        (len.is_power_of_two() && (Self::BASE.len..=Self::MAX.len).contains(&len))
            .then_some(Layout { len })
    }

    /// The smallest record layout at least `len` bytes long (for a copy of a record's first
    /// `len` bytes), if there is one.
    pub(super) fn containing(len: usize) -> Option<Self> {
        Self::of(len.max(Self::BASE.len).checked_next_power_of_two()?)
    }

    /// The smallest layout whose halves hold a body of `len` bytes with a quarter of it to
    /// spare for the record's later rewrites (a body grows with its pids and paths), or
    /// without, where none holds that; `None` where no half holds the body.
    pub(super) fn for_body(len: usize) -> Option<Self> {
        let holding = |wanted: usize| {
            let mut layout = Self::BASE;
            while layout.half_body() < wanted {
                layout = layout.doubled()?;
            }
            Some(layout)
        };
        holding(len.saturating_add(len / 4)).or_else(|| holding(len))
    }

    /// The layout twice this one's size, if there is one.
    pub(super) fn doubled(self) -> Option<Self> {
        Self::of(self.len.checked_mul(2)?)
    }

    /// The segment's size in bytes.
    pub(super) const fn len(self) -> usize {
        self.len
    }

    /// A half of the space after the header: a new record is written into the half the
    /// current one is not in, and the length word, one aligned store, then points at it.
    pub(super) const fn half(self) -> usize {
        (self.len - HEADER) / 2
    }

    /// Where the write count lies: the segment's last 8 bytes, which no body of this
    /// release reaches and none a release before ever read.
    pub(super) const fn count_at(self) -> usize {
        self.len - 8
    }

    /// The longest body: from the header up to the write count.
    pub(super) const fn body_max(self) -> usize {
        self.count_at() - HEADER
    }

    /// The longest body written into a half: the second half ends at the write count.
    pub(super) const fn half_body(self) -> usize {
        self.count_at() - (HEADER + self.half())
    }

    /// Where the body a length word names lies: its offset and length, or `None` when
    /// there is none (a length of 0).
    pub(super) fn body_of(self, word: u32) -> Option<(usize, usize)> {
        let len = (word & !SECOND) as usize;
        match (word & SECOND != 0, len) {
            (_, 0) => None,
            (true, len) => Some((HEADER + self.half(), len)),
            (false, len) => Some((HEADER, len)),
        }
    }
}

/// A bound on the body of the record of a device of `queues` queues on a host of `cpus`
/// CPUs (its state, settings and a config path of a usual length, and libublk's device
/// file): the size its segment is made with before the device serves. A body that outgrows
/// it (a config path of kilobytes) moves to a larger segment when it is written.
pub(super) fn expected_body(queues: u16, cpus: usize) -> usize {
    3 * 1024 + 56 * usize::from(queues) + 5 * cpus.min(AFFINITY_CPUS)
}

/// The CPUs libublk's queue affinity can name (`UblkQueueAffinity`'s `Bitmap<1024>`):
/// numbers of at most 4 digits.
const AFFINITY_CPUS: usize = 1024;

/// The CPUs a queue's affinity may name: the host's possible CPUs (sysfs), or at least
/// those this process may run on.
pub(super) fn host_cpus() -> usize {
    let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|text| cpu_count(text.trim()));
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    possible.unwrap_or(0).max(usable)
}

/// The CPUs a sysfs CPU list (`0-3,8,10-11`) names.
fn cpu_count(list: &str) -> Option<usize> {
    list.split(',').try_fold(0usize, |sum, range| {
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let cpu = range.parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        sum.checked_add(last.checked_sub(first)? + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_sizes_are_the_powers_of_two_from_16_kib_to_1_mib() {
        assert_eq!(Layout::of(16 << 10), Some(Layout::BASE));
        assert_eq!(Layout::of(1 << 20), Some(Layout::MAX));
        for len in [
            0,
            4096,
            (16 << 10) - 1,
            (16 << 10) + 8,
            24 << 10,
            2 << 20,
            usize::MAX,
        ] {
            assert_eq!(Layout::of(len), None, "{len}");
        }
        assert_eq!(Layout::containing(100), Some(Layout::BASE));
        assert_eq!(
            Layout::containing(20 << 10).map(Layout::len),
            Some(32 << 10)
        );
        assert_eq!(Layout::containing((1 << 20) + 1), None);
        // The base layout is the one the releases before wrote.
        let base = Layout::BASE;
        assert_eq!((base.half(), base.count_at()), (8184, 16376));
        assert_eq!((base.half_body(), base.body_max()), (8176, 16360));
    }

    #[test]
    fn a_body_gets_the_smallest_layout_whose_halves_hold_it_with_room() {
        assert_eq!(Layout::for_body(1000), Some(Layout::BASE));
        assert_eq!(Layout::for_body(6540), Some(Layout::BASE));
        assert_eq!(Layout::for_body(6600).map(Layout::len), Some(32 << 10));
        let big = Layout::for_body(200_000).unwrap();
        assert_eq!(big.len(), 512 << 10);
        assert!(big.half_body() >= 250_000);
        // Without room to spare where no layout has it; none where no half holds it.
        assert_eq!(Layout::for_body(500_000), Some(Layout::MAX));
        assert_eq!(Layout::for_body(Layout::MAX.half_body() + 1), None);
        assert_eq!(Layout::BASE.doubled().map(Layout::len), Some(32 << 10));
        assert_eq!(Layout::MAX.doubled(), None);
        for len in (0..400_000).step_by(997) {
            let layout = Layout::for_body(len).unwrap();
            assert!(layout.half_body() >= len + len / 4);
            assert!(
                layout == Layout::BASE
                    || Layout::of(layout.len() / 2).unwrap().half_body() < len + len / 4
            );
        }
    }

    #[test]
    fn a_sysfs_cpu_list_is_counted() {
        assert_eq!(cpu_count("0"), Some(1));
        assert_eq!(cpu_count("0-15"), Some(16));
        assert_eq!(cpu_count("0-3,8,10-11"), Some(7));
        assert_eq!(cpu_count("3-1"), None);
        assert_eq!(cpu_count("x"), None);
        assert!(host_cpus() >= 1);
    }
}

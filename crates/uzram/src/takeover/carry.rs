//! Cumulative counters that go on across daemons: zram's `io_stat` counts, the request
//! counts and `pages_compacted` start where the last daemon of the device left them, after
//! a crash as after a planned handover, instead of at zero; `mem_used_max`, a peak, goes on
//! from the highest any daemon of the device saw.
//!
//! The store's gauges (pages, bytes, memory) are rebuilt from the store itself; the counts
//! are not in it. So each daemon writes its totals (its own counts plus what it carried
//! in) into a small table in the store's shared memory (`store_segment.rs`, in the header's unit):
//! every second, and once more right before it hands the device over. The next daemon
//! reads that table before it serves and adds it to everything it reports. A crash loses
//! at most the last second's counts.
//!
//! The table holds [`SLOTS`] slots of four words: a name of up to 24 bytes, NUL-padded,
//! and its value, so daemons of different versions carry the counters both know. A region
//! made by a daemon without this table has zeros there: nothing is carried.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::control::counters::{find, Carried};
use crate::control::proto::{DeviceStatus, Stat};

/// Slots in the table.
pub const SLOTS: usize = 64;
/// Words the table takes.
pub const WORDS: usize = SLOTS * 4;
const NAME_BYTES: usize = 24;

/// Whether `name` is carried from one daemon to the next (`control::counters`).
pub fn is_carried(name: &str) -> bool {
    find(name).is_some_and(|c| c.carried != Carried::No)
}

/// The table over its words (the region's, or any others in tests).
#[derive(Debug, Clone, Copy)]
pub struct Carry<'a> {
    words: &'a [AtomicU64],
}

fn name_words(name: &str) -> Option<[u64; 3]> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > NAME_BYTES || bytes.contains(&0) {
        return None;
    }
    let mut padded = [0u8; NAME_BYTES];
    padded[..bytes.len()].copy_from_slice(bytes);
    let mut words = [0u64; 3];
    for (w, chunk) in words.iter_mut().zip(padded.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    Some(words)
}

impl<'a> Carry<'a> {
    /// The table in `words` (at least [`WORDS`]; a shorter slice holds fewer slots).
    pub fn new(words: &'a [AtomicU64]) -> Self {
        Carry { words }
    }

    fn slots(&self) -> impl Iterator<Item = &'a [AtomicU64]> {
        self.words.chunks_exact(4).take(SLOTS)
    }

    /// What the table holds: the totals the last daemon wrote (empty for a new store).
    pub fn load(&self) -> HashMap<String, u64> {
        let mut found = HashMap::new();
        for slot in self.slots() {
            let mut bytes = Vec::with_capacity(NAME_BYTES);
            for w in &slot[..3] {
                bytes.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
            }
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(NAME_BYTES);
            if end == 0 {
                continue;
            }
            if let Ok(name) = std::str::from_utf8(&bytes[..end]) {
                if is_carried(name) {
                    found.insert(name.to_string(), slot[3].load(Ordering::Relaxed));
                }
            }
        }
        found
    }

    /// Writes the carried ones of `stats` (totals, base included) into the table, in order.
    /// A slot whose name changes is zeroed first, so a process killed halfway never leaves
    /// one counter's value under another's name.
    pub fn save<'s>(&self, stats: impl IntoIterator<Item = &'s Stat>) {
        let mut slots = self.slots();
        for stat in stats.into_iter().filter(|s| is_carried(&s.name)) {
            let Some(name) = name_words(&stat.name) else {
                continue;
            };
            let Some(slot) = slots.next() else { return };
            let same = slot[..3]
                .iter()
                .zip(name)
                .all(|(w, n)| w.load(Ordering::Relaxed) == n);
            if !same {
                slot[3].store(0, Ordering::Relaxed);
                for (w, n) in slot[..3].iter().zip(name) {
                    w.store(n, Ordering::Relaxed);
                }
            }
            slot[3].store(stat.value, Ordering::Relaxed);
        }
    }
}

impl Carry<'_> {
    /// [`Carry::save`] of a status report's counters (`stats` and `requests`).
    pub fn save_status(&self, status: &DeviceStatus) {
        self.save(status.stats.iter().chain(&status.requests));
    }
}

/// Adds the carried-in `base` to the carried counters among `stats` (for a peak: keeps the
/// larger).
pub fn add_base(stats: &mut [Stat], base: &HashMap<String, u64>) {
    for stat in stats.iter_mut() {
        if let Some(&b) = base.get(&stat.name) {
            stat.value = if find(&stat.name).is_some_and(|c| c.carried == Carried::Peak) {
                stat.value.max(b)
            } else {
                stat.value.saturating_add(b)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(name: &str, value: u64) -> Stat {
        Stat {
            name: name.into(),
            value,
        }
    }

    fn table() -> Vec<AtomicU64> {
        (0..WORDS).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn a_new_table_carries_nothing() {
        assert!(Carry::new(&table()).load().is_empty());
    }

    #[test]
    fn the_next_daemon_continues_from_the_saved_totals() {
        let words = table();
        let first = Carry::new(&words);
        let stats = [
            stat("writes", 10),
            stat("orig_data_size", 4096),
            stat("read_requests", 3),
        ];
        first.save(&stats);
        let base = Carry::new(&words).load();
        assert_eq!(base.len(), 2, "gauges are not carried: {base:?}");
        assert_eq!(base["writes"], 10);
        assert_eq!(base["read_requests"], 3);

        let mut now = vec![stat("writes", 5), stat("orig_data_size", 8192)];
        add_base(&mut now, &base);
        assert_eq!(now[0].value, 15);
        assert_eq!(now[1].value, 8192, "a gauge stays as measured");
        Carry::new(&words).save(&now);
        assert_eq!(Carry::new(&words).load()["writes"], 15);
    }

    #[test]
    fn a_peak_goes_on_from_the_highest_any_daemon_saw() {
        let words = table();
        Carry::new(&words).save(&[stat("mem_used_max", 900)]);
        let base = Carry::new(&words).load();
        // A new daemon that has seen less reports the old peak, not the sum.
        let mut now = vec![stat("mem_used_max", 300)];
        add_base(&mut now, &base);
        assert_eq!(now[0].value, 900);
        Carry::new(&words).save(&now);
        // One that has seen more reports its own.
        let mut later = vec![stat("mem_used_max", 1200)];
        add_base(&mut later, &Carry::new(&words).load());
        assert_eq!(later[0].value, 1200);
    }

    #[test]
    fn a_slot_that_changes_name_never_keeps_the_old_value() {
        let words = table();
        let c = Carry::new(&words);
        c.save(&[stat("writes", 99)]);
        // A daemon of another version puts another counter first.
        c.save(&[stat("reads", 7)]);
        let base = c.load();
        assert_eq!(base.get("reads"), Some(&7));
        assert_eq!(base.get("writes"), None);
    }

    #[test]
    fn a_short_table_holds_what_fits_and_bad_bytes_are_ignored() {
        let words: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
        let c = Carry::new(&words);
        c.save(&[stat("writes", 1), stat("reads", 2)]);
        assert_eq!(c.load().len(), 1);
        // Garbage in the table (not UTF-8, an unknown name) carries nothing.
        words[0].store(u64::MAX, Ordering::Relaxed);
        assert!(c.load().is_empty());
        let words = table();
        Carry::new(&words).save(&[stat("reads", 2)]);
        words[0].store(u64::from_le_bytes(*b"unknown\0"), Ordering::Relaxed);
        assert!(Carry::new(&words).load().is_empty());
    }
}

//! A small fuzzing driver that runs on stable Rust, as ordinary tests: every target is a
//! function of bytes that must not panic (and asserts what must hold of its result), run on
//! mutations of seed inputs and on random bytes, a fixed number of cases per run.
//!
//! Why not only cargo-fuzz: it needs nightly and libFuzzer, which CI does not have, so its
//! targets ran only by hand. These run in `cargo test` with a small budget on every CI run
//! (`UZRAM_FUZZ_CASES`, default [`DEFAULT_CASES`]) and as long as wanted by hand:
//! `UZRAM_FUZZ_CASES=1000000 cargo test --release fuzz_`. A failing input is written to
//! `$UZRAM_FUZZ_FAILURES` (default the system temp directory) and named in the panic, so it
//! can be replayed and kept as a regression.
//!
//! The mutations are libFuzzer's simple ones: bit flips, byte and word overwrites with
//! interesting values, inserts, deletes, duplicated runs and splices of two seeds. Inputs are
//! derived from a seed that is fixed unless `UZRAM_FUZZ_SEED` says otherwise, so a CI run is
//! repeatable.

use std::panic::{catch_unwind, AssertUnwindSafe};

#[cfg(feature = "liblz4-reference")]
pub mod liblz4;

/// Cases a target runs when `UZRAM_FUZZ_CASES` is not set.
pub const DEFAULT_CASES: u64 = 2000;

/// `pages` 4 KiB pages of xorshift noise from `seed`: incompressible, none same-filled
/// (tests that need pages no codec can shrink).
pub fn noise_pages(pages: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..pages * crate::PAGE_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Asserts that `store` reads back `data` from its first page on, naming the first page
/// that differs.
pub fn reads_back(store: &crate::PageStore, data: &[u8]) {
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).unwrap();
    for (i, (a, b)) in back
        .chunks_exact(crate::PAGE_SIZE)
        .zip(data.chunks_exact(crate::PAGE_SIZE))
        .enumerate()
    {
        assert!(a == b, "page {i} differs");
    }
}

/// The input generator: xorshift64*, seeded.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 for `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

const INTERESTING: [u64; 12] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    4096,
];

/// One mutation of `data` (in place), `max_len` the longest it may grow to.
pub fn mutate(rng: &mut Rng, data: &mut Vec<u8>, other: &[u8], max_len: usize) {
    let len = data.len();
    match rng.below(8) {
        0 if len > 0 => {
            let i = rng.below(len);
            data[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            data[i] = rng.next_u64() as u8;
        }
        2 if len > 0 => {
            // An interesting value, little-endian, 1 to 8 bytes wide.
            let width = 1 << rng.below(4);
            let at = rng.below(len);
            let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
            for (k, b) in v.iter().take(width).enumerate() {
                if let Some(d) = data.get_mut(at + k) {
                    *d = *b;
                }
            }
        }
        3 if len < max_len => {
            let at = rng.below(len + 1);
            let n = (1 + rng.below(16)).min(max_len - len);
            let fill = rng.bytes(n);
            data.splice(at..at, fill);
        }
        4 if len > 1 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(16));
            data.drain(at..at + n);
        }
        5 if len > 1 && len < max_len => {
            // A run of the input copied elsewhere (repeated structures).
            let from = rng.below(len);
            let n = (1 + rng.below((len - from).min(64))).min(max_len - len);
            let run = data[from..from + n].to_vec();
            let at = rng.below(len + 1);
            data.splice(at..at, run);
        }
        6 if !other.is_empty() => {
            // A splice: our head, the other's tail.
            let cut = rng.below(len + 1);
            let from = rng.below(other.len());
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
            data.truncate(max_len);
        }
        _ if len > 0 => {
            let i = rng.below(len);
            // a small step up or down, as a counter or length nearby would be
            data[i] = data[i].wrapping_add((rng.below(35) as i8 - 17) as u8);
        }
        _ => data.push(rng.next_u64() as u8),
    }
}

/// How many cases to run, and from which seed (`UZRAM_FUZZ_CASES`, `UZRAM_FUZZ_SEED`).
pub fn budget() -> (u64, u64) {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    (
        var("UZRAM_FUZZ_CASES").unwrap_or(DEFAULT_CASES),
        var("UZRAM_FUZZ_SEED").unwrap_or(0x757a_7261_6d21),
    )
}

/// Runs `check` on `cases` inputs (see [`budget`]): each the mutation (1 to 8 steps) of a
/// seed, or every 16th case random bytes, at most `max_len` bytes. A panic is caught, the
/// input written to a file, and the panic raised again naming the file.
pub fn run(name: &str, seeds: &[Vec<u8>], max_len: usize, check: impl Fn(&[u8])) {
    let (cases, seed) = budget();
    let mut rng = Rng::new(
        seed ^ name
            .bytes()
            .fold(0u64, |h, b| h.rotate_left(5) ^ u64::from(b)),
    );
    for seed_input in seeds {
        replay(name, seed_input, &check);
    }
    for case in 0..cases {
        let input = if seeds.is_empty() || case % 16 == 15 {
            let len = rng.below(max_len + 1);
            rng.bytes(len)
        } else {
            let mut data = seeds[rng.below(seeds.len())].clone();
            let other = &seeds[rng.below(seeds.len())];
            for _ in 0..1 + rng.below(8) {
                mutate(&mut rng, &mut data, other, max_len);
            }
            data
        };
        replay(name, &input, &check);
    }
}

/// Runs `check` on one input, saving the input if it panics.
pub fn replay(name: &str, input: &[u8], check: &impl Fn(&[u8])) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| check(input))) {
        let dir = std::env::var_os("UZRAM_FUZZ_FAILURES")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let path = dir.join(format!("crash-{name}-{hash:016x}"));
        let saved = std::fs::write(&path, input).is_ok();
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!(
            "fuzz target {name} failed on an input of {} bytes{}: {why}",
            input.len(),
            if saved {
                format!(" (saved as {})", path.display())
            } else {
                String::new()
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_stay_within_the_length_and_a_failing_input_is_reported() {
        let mut rng = Rng::new(1);
        let mut data = vec![7u8; 10];
        for _ in 0..10_000 {
            mutate(&mut rng, &mut data, &[1, 2, 3], 64);
            assert!(data.len() <= 64);
        }
        let err = catch_unwind(|| {
            replay("selftest", b"boom", &|d: &[u8]| assert_ne!(d, b"boom"));
        })
        .unwrap_err();
        let text = err.downcast_ref::<String>().unwrap();
        assert!(
            text.contains("selftest") && text.contains("4 bytes"),
            "{text}"
        );
    }
}

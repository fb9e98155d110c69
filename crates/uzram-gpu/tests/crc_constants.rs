//! The CRC32C constants the verify kernel is built with (`kernels/lz4.cu`) are the ones
//! CRC32C needs, and the kernel's way of combining per-lane states gives the CPU's checksum:
//! checked on any machine, with no GPU, against uzram-core's `page_checksum`.

use uzram_core::page::page_checksum;
use uzram_core::PAGE_SIZE;

const SOURCE: &str = include_str!("../kernels/lz4.cu");
const POLY: u32 = 0x82f6_3b78;

fn table() -> [u32; 256] {
    let mut t = [0u32; 256];
    for (i, e) in t.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = (c >> 1) ^ if c & 1 != 0 { POLY } else { 0 };
        }
        *e = c;
    }
    t
}

/// The state `c` carried over `n` zero bytes.
fn carry(t: &[u32; 256], mut c: u32, n: usize) -> u32 {
    for _ in 0..n {
        c = t[(c & 0xff) as usize] ^ (c >> 8);
    }
    c
}

/// The numbers of the array declared as `name` in the kernel source, in order.
fn array(name: &str) -> Vec<u32> {
    let start = SOURCE.find(name).expect("the array is in the source");
    let body = &SOURCE[start..];
    let open = body.find('{').unwrap();
    let close = body.find("};").unwrap();
    body[open..close]
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter_map(|w| w.strip_prefix("0x"))
        .map(|w| u32::from_str_radix(w.trim_end_matches('u'), 16).unwrap())
        .collect()
}

fn define(name: &str) -> u32 {
    let line = SOURCE
        .lines()
        .find(|l| l.starts_with(&format!("#define {name} ")))
        .expect("the define is in the source");
    let v = line.split_whitespace().nth(2).unwrap();
    u32::from_str_radix(v.trim_start_matches("0x").trim_end_matches('u'), 16).unwrap()
}

#[test]
fn the_kernels_crc_constants_are_crc32cs() {
    let t = table();
    assert_eq!(array("CRC32C_TABLE[256]"), t.to_vec());
    let shifts = array("CRC32C_SHIFT[5][32]");
    assert_eq!(shifts.len(), 5 * 32);
    for level in 0..5 {
        for bit in 0..32 {
            assert_eq!(
                shifts[level * 32 + bit],
                carry(&t, 1 << bit, 128 << level),
                "level {level} bit {bit}"
            );
        }
    }
    assert_eq!(define("CRC32C_PAGE_INIT"), carry(&t, u32::MAX, PAGE_SIZE));
}

#[test]
fn the_kernels_combination_of_lane_states_is_the_page_checksum() {
    let t = table();
    let shifts = array("CRC32C_SHIFT[5][32]");
    let init = define("CRC32C_PAGE_INIT");
    let mut x = 0x1234_5678_9abc_def1u64;
    for round in 0..20 {
        let mut page = [0u8; PAGE_SIZE];
        for (i, b) in page.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = if round % 3 == 0 {
                (i % 7) as u8
            } else {
                x as u8
            };
        }
        // As the kernel: each of 32 lanes the state of its 128 bytes from 0, then five
        // shuffle-down steps.
        let mut lanes: Vec<u32> = page
            .chunks_exact(128)
            .map(|run| {
                run.iter().fold(0u32, |c, &b| {
                    t[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
                })
            })
            .collect();
        for level in 0..5 {
            let step = 1 << level;
            lanes = (0..32)
                .map(|l| {
                    let right = if l + step < 32 {
                        lanes[l + step]
                    } else {
                        lanes[l]
                    };
                    let c = lanes[l];
                    let shifted = (0..32)
                        .filter(|b| c >> b & 1 != 0)
                        .fold(0, |r, b| r ^ shifts[level * 32 + b]);
                    shifted ^ right
                })
                .collect();
        }
        assert_eq!(!(lanes[0] ^ init), page_checksum(&page), "round {round}");
    }
}

//! The page LZ4 decoder (`Lz4Codec::decompress`, the fast `unsafe-lz4` one by default)
//! against the safe reference decoder (`Lz4Codec::decompress_safe`): the same result,
//! error included, and the same page, on real blocks, on generated blocks that hit every
//! copy path (short periods, long matches ending at the page's last byte, long literals),
//! on corrupted blocks, on arbitrary bytes, and on the checked-in fuzz corpora. Without
//! the feature both calls run the safe decoder, and these tests still check it against a
//! byte-at-a-time model decoder.

mod codec_support;

use std::path::Path;

use codec_support::{corpus_pages, liblz4, synthetic_pages, Page};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use uzram_core::codec::{CodecError, Lz4Codec, PageCodec};
use uzram_core::page::PAGE_SIZE;

/// Decodes with both decoders from different starting garbage; asserts they agree and
/// returns the result (with the page when accepted).
fn both(src: &[u8]) -> Result<Page, CodecError> {
    let mut fast = [0xA5u8; PAGE_SIZE];
    let mut safe = [0x5Au8; PAGE_SIZE];
    let f = Lz4Codec::new().decompress(src, &mut fast);
    let s = Lz4Codec::decompress_safe(src, &mut safe);
    assert_eq!(
        f,
        s,
        "fast and safe decoders disagree on {} bytes",
        src.len()
    );
    if f.is_ok() {
        assert!(fast == safe, "fast and safe decoders decode differently");
    }
    f.map(|()| fast)
}

fn push_len(out: &mut Vec<u8>, mut rest: usize) {
    while rest >= 255 {
        out.push(255);
        rest -= 255;
    }
    out.push(rest as u8);
}

/// One LZ4 sequence: `lit` literals, then (unless `None`) a match.
fn push_seq(out: &mut Vec<u8>, lits: &[u8], m: Option<(usize, usize)>) {
    let lit = lits.len();
    let ml_field = m.map_or(0, |(_, ml)| ml - 4);
    out.push(((lit.min(15) as u8) << 4) | ml_field.min(15) as u8);
    if lit >= 15 {
        push_len(out, lit - 15);
    }
    out.extend_from_slice(lits);
    if let Some((off, _)) = m {
        out.extend_from_slice(&(off as u16).to_le_bytes());
        if ml_field >= 15 {
            push_len(out, ml_field - 15);
        }
    }
}

/// A valid block for one page, with random sequences biased towards the decoder's
/// corners, and the page it must decode to (built one byte at a time).
fn generated_block(rng: &mut impl Rng) -> (Vec<u8>, Page) {
    let mut page: Vec<u8> = Vec::with_capacity(PAGE_SIZE);
    let mut src = Vec::new();
    loop {
        let room = PAGE_SIZE - page.len();
        let final_seq = room <= 4 || rng.gen_ratio(1, 60);
        let lit = if final_seq {
            room
        } else {
            let max = room - 4;
            let want = match rng.gen_range(0..10) {
                0..=5 => rng.gen_range(0..15),
                6 | 7 => rng.gen_range(15..300),
                8 => 0,
                _ => max,
            };
            want.min(max).max(usize::from(page.is_empty()))
        };
        let lits: Vec<u8> = (0..lit)
            .map(|_| {
                if rng.gen_bool(0.5) {
                    rng.gen()
                } else {
                    rng.gen_range(0..3)
                }
            })
            .collect();
        page.extend_from_slice(&lits);
        if final_seq {
            push_seq(&mut src, &lits, None);
            break;
        }
        let mroom = PAGE_SIZE - page.len();
        let ml = match rng.gen_range(0..10) {
            0..=5 => rng.gen_range(4..19),
            6 | 7 => rng.gen_range(19..700),
            _ => mroom,
        }
        .min(mroom);
        let off = match rng.gen_range(0..4) {
            0 => rng.gen_range(1..8),
            1 => rng.gen_range(8..17),
            2 => rng.gen_range(17..64),
            _ => rng.gen_range(1..65536),
        }
        .min(page.len());
        for _ in 0..ml {
            page.push(page[page.len() - off]);
        }
        push_seq(&mut src, &lits, Some((off, ml)));
        if page.len() == PAGE_SIZE {
            push_seq(&mut src, &[], None);
            break;
        }
    }
    (src, page.try_into().unwrap())
}

#[test]
fn real_blocks_decode_alike() {
    let mut codec = Lz4Codec::new();
    let mut pages = corpus_pages();
    pages.extend(synthetic_pages(0x22, 400));
    let mut out = vec![0u8; Lz4Codec::max_compressed_len()];
    for page in &pages {
        let n = codec.compress(page, &mut out).unwrap().unwrap();
        assert!(both(&out[..n]).unwrap() == *page);
        let theirs = liblz4::compress(page, out.len()).unwrap();
        assert!(both(&theirs).unwrap() == *page);
    }
}

#[test]
fn generated_blocks_decode_to_their_page() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xDEC0DE);
    for i in 0..3000 {
        let (src, page) = generated_block(&mut rng);
        assert!(both(&src).unwrap() == page, "block {i}");
    }
}

#[test]
fn corrupted_blocks_get_the_same_answer() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xBAD);
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..1500 {
        let (src, _) = generated_block(&mut rng);
        for _ in 0..20 {
            let mut bad = src.clone();
            match rng.gen_range(0..4) {
                0 => {
                    let i = rng.gen_range(0..bad.len());
                    bad[i] ^= 1 << rng.gen_range(0..8);
                }
                1 => {
                    let i = rng.gen_range(0..bad.len());
                    bad[i] = rng.gen();
                }
                2 => bad.truncate(rng.gen_range(0..bad.len())),
                _ => {
                    let i = rng.gen_range(0..=bad.len());
                    bad.insert(i, rng.gen());
                }
            }
            match both(&bad) {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
    }
    assert!(ok > 0 && refused > 0, "accepted {ok}, refused {refused}");
}

#[test]
fn checked_in_fuzz_inputs_get_the_same_answer() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions");
    let mut n = 0;
    for target in ["fuzz_lz4_decode", "fuzz_lz4_decode_diff"] {
        for e in std::fs::read_dir(dir.join(target)).unwrap() {
            let data = std::fs::read(e.unwrap().path()).unwrap();
            let _ = both(&data);
            n += 1;
        }
    }
    assert!(n > 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn proptest_arbitrary_bytes_get_the_same_answer(
        src in proptest::collection::vec(any::<u8>(), 0..5000)
    ) {
        let _ = both(&src);
    }
}

//! What a read of a page the cold tier rewrote with the device's dictionary
//! (`lz4-gpu-dict`) costs the CPU: decoding LZ4 blocks made with a 32 KiB dictionary
//! (`Lz4Codec::decompress_with_dict`, the safe decoder reads of such pages use) against
//! decoding the hot path's own blocks of the same pages (the fast decoder every other read
//! uses, and the safe one). The dictionary is trained on every other page of the corpus and
//! the blocks are liblz4's with it (`LZ4_loadDict`, its fast parse: more sequences than the
//! GPU's tighter parse makes, so if anything slower to decode). Pages that are same-filled or
//! that LZ4 does not shrink are left out, as the store leaves them out. GB/s of pages per
//! thread-CPU second, medians of `UZRAM_BENCH_REPEAT` (default 7) interleaved passes.
//!
//! ```text
//! cargo bench -p uzram-core --bench dict_decode
//! ```

mod support;

use std::hint::black_box;

use support::{median, Instant};

use uzram_core::codec::{train_dictionary, Lz4Codec, PageCodec, MAX_DICTIONARY_BYTES};
use uzram_core::page::{same_filled_word, PAGE_SIZE};

fn main() {
    let repeat: usize = std::env::var("UZRAM_BENCH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    println!("| corpus | pages | dictionary blocks ÷ plain (bytes) | plain, fast decoder GB/s | plain, safe decoder GB/s | with the dictionary GB/s |");
    println!("|---|---|---|---|---|---|");
    for path in support::corpus_paths() {
        let pages: Vec<[u8; PAGE_SIZE]> = support::load_pages(&path)
            .into_iter()
            .filter(|p| same_filled_word(p).is_none())
            .collect();
        let train: Vec<u8> = pages.iter().step_by(2).flatten().copied().collect();
        let dict = match train_dictionary(&train, MAX_DICTIONARY_BYTES) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                continue;
            }
        };
        let mut codec = Lz4Codec::new();
        let mut out = vec![0u8; Lz4Codec::max_compressed_len()];
        let (mut plain, mut with) = (Vec::new(), Vec::new());
        for p in &pages {
            let Ok(Some(n)) = codec.compress(p, &mut out) else {
                continue;
            };
            if n >= PAGE_SIZE {
                continue;
            }
            let d = uzram_core::fuzz::liblz4::compress_with_dict(p, &dict);
            if d.len() >= PAGE_SIZE {
                continue;
            }
            plain.push(out[..n].to_vec());
            with.push(d);
        }
        let bytes = (plain.len() * PAGE_SIZE) as f64;
        let mut page = [0u8; PAGE_SIZE];
        let (mut fast, mut safe, mut dictd) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeat {
            let t = Instant::now();
            for b in &plain {
                codec.decompress(black_box(b), &mut page).unwrap();
            }
            fast.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            for b in &plain {
                Lz4Codec::decompress_safe(black_box(b), &mut page).unwrap();
            }
            safe.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            for b in &with {
                Lz4Codec::decompress_with_dict(black_box(b), &dict, &mut page).unwrap();
            }
            dictd.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        }
        let size = |v: &[Vec<u8>]| v.iter().map(Vec::len).sum::<usize>() as f64;
        println!(
            "| {} | {} | {:.3} | {:.2} | {:.2} | {:.2} |",
            path.file_name().unwrap_or_default().to_string_lossy(),
            plain.len(),
            size(&with) / size(&plain),
            median(&mut fast),
            median(&mut safe),
            median(&mut dictd),
        );
    }
}

//! [`GpuDictLz4`] on a GPU: LZ4 with a trained 32 KiB dictionary as every block's prefix.
//! On every checked-in slice (and the full corpora where `UZRAM_CORPUS_DIR` names them):
//! every page's CRC32C is the CPU's, every block decodes with the dictionary (lz4_flex) to
//! exactly its page, and on mixed-swap the payload is below the CPU's plain LZ4. Skips with
//! a printed reason where there is no GPU.

mod common;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use uzram_core::batch::{PageResult, SlotBackend};
use uzram_core::codec::Lz4Codec;
use uzram_core::page::{page_checksum, page_to_words, same_filled_word};
use uzram_core::{PAGE_SIZE, PAGE_WORDS};
use uzram_gpu::{ErrorKind, GpuDictLz4, MAX_DICT_BYTES};

const SLOT_PAGES: usize = 2048;

fn backend() -> Option<GpuDictLz4> {
    match GpuDictLz4::new(0, SLOT_PAGES) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            None
        }
        Err(e) => panic!("GPU present but the dictionary LZ4 backend failed to start: {e}"),
    }
}

fn stat(b: &GpuDictLz4, key: &str) -> u64 {
    b.stats()
        .into_iter()
        .find(|(k, _)| *k == key)
        .map_or(0, |(_, v)| v)
}

/// The pages zram would store with a block: not same-filled.
fn stored_pages(data: &[u8]) -> Vec<&[u8; PAGE_SIZE]> {
    data.chunks_exact(PAGE_SIZE)
        .map(|p| <&[u8; PAGE_SIZE]>::try_from(p).unwrap())
        .filter(|p| same_filled_word(p).is_none())
        .collect()
}

/// A dictionary of at most MAX_DICT_BYTES trained by zstd on half the pages (shuffled); where
/// zstd cannot train on so few, the last bytes of that half as a raw dictionary.
fn train(pages: &[&[u8; PAGE_SIZE]]) -> Vec<u8> {
    let mut sample: Vec<&[u8]> = pages.iter().map(|p| &p[..]).collect();
    sample.shuffle(&mut rand::rngs::StdRng::seed_from_u64(1));
    sample.truncate(sample.len().div_ceil(2));
    match zstd::dict::from_samples(&sample, MAX_DICT_BYTES) {
        Ok(d) if !d.is_empty() && d.len() <= MAX_DICT_BYTES => d,
        other => {
            eprintln!("zstd did not train a dictionary ({other:?}); a raw one instead");
            let all = sample.concat();
            all[all.len().saturating_sub(MAX_DICT_BYTES)..].to_vec()
        }
    }
}

/// Bytes stored by the GPU and by uzram's CPU LZ4, and the pages stored raw.
#[derive(Default)]
struct Sums {
    gpu: usize,
    cpu: usize,
    raw: usize,
}

/// Compresses `pages` with `dict` at raw threshold `limit`, checking every result.
fn compress_and_check(
    name: &str,
    b: &GpuDictLz4,
    pages: &[&[u8; PAGE_SIZE]],
    dict: &[u8],
    limit: usize,
) -> Sums {
    b.load_dictionary(dict).expect("load the dictionary");
    let mut cpu = Lz4Codec::new();
    let mut sums = Sums::default();
    for (n, chunk) in pages.chunks(SLOT_PAGES).enumerate() {
        let input = b.input(0);
        for (i, page) in chunk.iter().enumerate() {
            page_to_words(page, &input[i * PAGE_WORDS..(i + 1) * PAGE_WORDS]);
        }
        b.submit(0, chunk.len(), limit).expect("submit");
        b.complete(0, &mut |o| {
            for (i, page) in chunk.iter().enumerate() {
                let at = n * SLOT_PAGES + i;
                assert_eq!(
                    o.checksum(i),
                    Ok(page_checksum(page)),
                    "{name}: page {at}'s CRC32C"
                );
                match o.page(i) {
                    Ok(PageResult::Compressed(block)) => {
                        assert!(block.len() < limit.min(PAGE_SIZE), "{name}: page {at}");
                        let mut out = [0u8; PAGE_SIZE];
                        let got = lz4_flex::block::decompress_into_with_dict(block, &mut out, dict);
                        assert!(
                            matches!(got, Ok(PAGE_SIZE)),
                            "{name}: page {at}'s block: {got:?}"
                        );
                        assert!(
                            out == **page,
                            "{name}: page {at}'s block decodes to another page"
                        );
                        sums.gpu += block.len();
                    }
                    Ok(PageResult::Raw) => {
                        sums.raw += 1;
                        sums.gpu += PAGE_SIZE;
                    }
                    other => panic!("{name}: page {at}: {other:?}"),
                }
                sums.cpu += common::cpu_bytes(&mut cpu, page, limit);
            }
        })
        .expect("complete");
    }
    sums
}

fn one_corpus(b: &GpuDictLz4, name: &str, data: &[u8]) {
    let pages = stored_pages(data);
    if pages.is_empty() {
        return;
    }
    let dict = train(&pages);
    let kernel_us = stat(b, "gpu_dict_kernel_us");
    let sums = compress_and_check(name, b, &pages, &dict, PAGE_SIZE);
    let kernel_us = stat(b, "gpu_dict_kernel_us") - kernel_us;
    let ratio = sums.gpu as f64 / sums.cpu.max(1) as f64;
    let gbps = (pages.len() * PAGE_SIZE) as f64 / (kernel_us.max(1) as f64 * 1e3);
    println!(
        "{name}: {} pages, dictionary {} bytes: payload {} vs CPU LZ4 {} = {ratio:.4}, {} raw; \
         kernel {gbps:.2} GB/s ({kernel_us} us)",
        pages.len(),
        dict.len(),
        sums.gpu,
        sums.cpu,
        sums.raw
    );
    if name.starts_with("mixed-swap") && pages.len() > 64 {
        assert!(
            ratio < 1.0,
            "{name}: the dictionary did not beat plain LZ4 ({ratio:.4})"
        );
    }
}

#[test]
fn every_block_decodes_with_the_dictionary_and_mixed_swap_beats_plain_lz4() {
    let Some(b) = backend() else {
        return;
    };
    println!("{}", b.device_name());
    let slices = common::slice_paths();
    assert!(!slices.is_empty(), "no checked-in corpus slices found");
    for path in slices {
        one_corpus(&b, &common::corpus_name(&path), &common::load_pages(&path));
    }
    match common::full_corpus_paths() {
        Ok(paths) => {
            for path in paths {
                let name = format!("{} (full)", common::corpus_name(&path));
                one_corpus(&b, &name, &common::load_pages(&path));
            }
        }
        Err(why) => eprintln!("full corpora skipped: {why}"),
    }
}

#[test]
fn edge_cases_low_limits_and_tiny_dictionaries_decode_exactly() {
    let Some(b) = backend() else {
        return;
    };
    let mut data = common::adversarial_pages();
    data.extend(common::random_pages(64, 3));
    let pages = stored_pages(&data);
    let trained = train(&pages);
    for (dict, limit) in [
        (trained.clone(), PAGE_SIZE),
        (trained.clone(), 1024),
        (trained, 1),
        (vec![0u8; 1], PAGE_SIZE),
        (b"the page swap zram ".repeat(200), 3625),
        (vec![0xa5u8; MAX_DICT_BYTES], PAGE_SIZE),
    ] {
        let sums = compress_and_check("edge cases", &b, &pages, &dict, limit);
        println!(
            "edge cases, dictionary {} bytes, limit {limit}: {} raw of {}",
            dict.len(),
            sums.raw,
            pages.len()
        );
        if limit == 1 {
            assert_eq!(sums.raw, pages.len());
        }
    }
}

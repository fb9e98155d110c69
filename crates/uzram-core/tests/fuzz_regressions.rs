//! Replays every checked-in fuzz input (`fuzz/regressions/<target>/*`) through the same
//! checks the cargo-fuzz targets make, so stable `cargo test` covers them without nightly
//! or libFuzzer. Also writes seed corpora for the fuzz targets on request:
//! `cargo test -p uzram-core --test fuzz_regressions -- --ignored write_fuzz_seeds`.

mod codec_support;

use std::path::{Path, PathBuf};

use codec_support::{corpus_pages, liblz4, synthetic_pages};
use uzram_core::codec::{Lz4Codec, PageCodec, ZstdCodec};
use uzram_core::page::PAGE_SIZE;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = fuzz_dir().join("regressions").join(target);
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            (p, data)
        })
        .collect();
    v.sort();
    v
}

/// Mirrors `fuzz/fuzz_targets/fuzz_lz4_decode.rs`.
fn check_lz4_decode(data: &[u8]) -> bool {
    let mut page = [0u8; PAGE_SIZE];
    let ok = Lz4Codec::new().decompress(data, &mut page).is_ok();
    if ok {
        if let Some(theirs) = liblz4::decompress(data) {
            assert_eq!(&theirs[..], &page[..]);
        }
    }
    ok
}

/// Mirrors `fuzz/fuzz_targets/fuzz_lz4_decode_diff.rs`: the default decoder and the safe
/// reference give the same result (error or page).
fn check_lz4_decode_diff(data: &[u8]) -> bool {
    let mut fast = [0xA5u8; PAGE_SIZE];
    let mut safe = [0x5Au8; PAGE_SIZE];
    let r = Lz4Codec::new().decompress(data, &mut fast);
    assert_eq!(r, Lz4Codec::decompress_safe(data, &mut safe));
    if r.is_ok() {
        assert_eq!(fast, safe);
        if let Some(theirs) = liblz4::decompress(data) {
            assert_eq!(&theirs[..], &fast[..]);
        }
    }
    r.is_ok()
}

/// Mirrors `fuzz/fuzz_targets/fuzz_zstd_decode.rs`.
fn check_zstd_decode(data: &[u8]) -> bool {
    let mut page = [0u8; PAGE_SIZE];
    ZstdCodec::new(1).decompress(data, &mut page).is_ok()
}

/// Mirrors `fuzz/fuzz_targets/fuzz_page_roundtrip.rs`.
fn check_roundtrip(data: &[u8]) {
    if data.len() < 3 {
        return;
    }
    let cap = usize::from(u16::from_le_bytes([data[0], data[1]])) % (PAGE_SIZE + 64);
    let body = &data[2..];
    let mut page = [0u8; PAGE_SIZE];
    for (dst, src) in page.iter_mut().zip(body.iter().cycle()) {
        *dst = *src;
    }
    if body.len() < PAGE_SIZE {
        page[body.len()..].fill(0);
    }
    let mut lz4 = Lz4Codec::new();
    let mut out = vec![0u8; cap];
    let ours = lz4.compress(&page, &mut out).unwrap();
    assert_eq!(
        ours.map(|n| out[..n].to_vec()),
        liblz4::compress(&page, cap)
    );
    let mut back = [0u8; PAGE_SIZE];
    if let Some(n) = ours {
        lz4.decompress(&out[..n], &mut back).unwrap();
        assert_eq!(back, page);
    }
    let mut zstd = ZstdCodec::new(1 + i32::from(data[2] % 3));
    if let Some(n) = zstd.compress(&page, &mut out).unwrap() {
        zstd.decompress(&out[..n], &mut back).unwrap();
        assert_eq!(back, page);
    }
}

#[test]
fn lz4_decode_regressions() {
    let all = inputs("fuzz_lz4_decode");
    assert!(!all.is_empty());
    let accepted = all.iter().filter(|(_, d)| check_lz4_decode(d)).count();
    println!(
        "fuzz_lz4_decode: {} inputs, {accepted} decode to a page",
        all.len()
    );
}

#[test]
fn lz4_decode_diff_regressions() {
    let all = inputs("fuzz_lz4_decode_diff");
    assert!(!all.is_empty());
    let accepted = all.iter().filter(|(_, d)| check_lz4_decode_diff(d)).count();
    println!(
        "fuzz_lz4_decode_diff: {} inputs, {accepted} decode to a page",
        all.len()
    );
}

#[test]
fn zstd_decode_regressions() {
    let all = inputs("fuzz_zstd_decode");
    assert!(!all.is_empty());
    let accepted = all.iter().filter(|(_, d)| check_zstd_decode(d)).count();
    println!(
        "fuzz_zstd_decode: {} inputs, {accepted} decode to a page",
        all.len()
    );
}

#[test]
fn page_roundtrip_regressions() {
    let all = inputs("fuzz_page_roundtrip");
    assert!(!all.is_empty());
    for (_, d) in &all {
        check_roundtrip(d);
    }
    println!("fuzz_page_roundtrip: {} inputs", all.len());
}

/// Writes seed corpora (compressed corpus and synthetic pages) under `fuzz/corpus/`.
#[test]
#[ignore = "a tool: writes fuzz/corpus/*; run with --ignored write_fuzz_seeds"]
fn write_fuzz_seeds() {
    let mut pages = corpus_pages();
    pages.extend(synthetic_pages(0xF0, 64));
    let pick: Vec<_> = pages.iter().step_by(16).collect();
    let base = fuzz_dir().join("corpus");
    for t in ["fuzz_lz4_decode", "fuzz_zstd_decode", "fuzz_page_roundtrip"] {
        std::fs::create_dir_all(base.join(t)).unwrap();
    }
    let mut lz4 = Lz4Codec::new();
    let mut zstd = ZstdCodec::new(1);
    let mut out = vec![0u8; Lz4Codec::max_compressed_len()];
    for (i, page) in pick.iter().enumerate() {
        let n = lz4.compress(page, &mut out).unwrap().unwrap();
        std::fs::write(base.join(format!("fuzz_lz4_decode/seed-{i:03}")), &out[..n]).unwrap();
        let n = zstd.compress(page, &mut out).unwrap().unwrap();
        std::fs::write(
            base.join(format!("fuzz_zstd_decode/seed-{i:03}")),
            &out[..n],
        )
        .unwrap();
        let mut rt = 3071u16.to_le_bytes().to_vec();
        rt.extend_from_slice(&page[..]);
        std::fs::write(base.join(format!("fuzz_page_roundtrip/seed-{i:03}")), rt).unwrap();
    }
    println!(
        "wrote {} seeds per target under {}",
        pick.len(),
        base.display()
    );
}

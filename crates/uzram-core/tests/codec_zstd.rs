//! The zstd page codec: round trips at several levels, output budgets, and refusal of
//! truncated or corrupt input without panicking.

mod codec_support;

use codec_support::{corpus_pages, synthetic_pages};
use uzram_core::codec::{Algorithm, CodecError, PageCodec, ZstdCodec};
use uzram_core::page::PAGE_SIZE;

#[test]
fn round_trips_at_several_levels() {
    let mut pages = corpus_pages();
    pages.extend(synthetic_pages(0x33, 64));
    let mut out = vec![0u8; 2 * PAGE_SIZE];
    let mut back = [0u8; PAGE_SIZE];
    for level in [1, 3, 9] {
        let mut codec = ZstdCodec::new(level);
        assert_eq!(codec.algorithm(), Algorithm::Zstd { level });
        let mut total = 0;
        for page in pages.iter().step_by(3) {
            let n = codec
                .compress(page, &mut out)
                .unwrap()
                .expect("2 pages always fit");
            total += n;
            back.fill(0xEE);
            codec.decompress(&out[..n], &mut back).unwrap();
            assert_eq!(&back, page, "level {level}");
        }
        assert!(
            total < pages.len().div_ceil(3) * PAGE_SIZE,
            "level {level} did not compress"
        );
    }
}

#[test]
fn higher_levels_do_not_compress_worse_on_the_corpus() {
    let pages = corpus_pages();
    let mut out = vec![0u8; 2 * PAGE_SIZE];
    let mut size = |level| {
        let mut c = ZstdCodec::new(level);
        pages
            .iter()
            .map(|p| c.compress(p, &mut out).unwrap().unwrap())
            .sum::<usize>()
    };
    let (l1, l9) = (size(1), size(9));
    assert!(l9 <= l1, "level 9 {l9} > level 1 {l1}");
}

#[test]
fn small_budget_returns_none() {
    let mut codec = ZstdCodec::new(1);
    let random = synthetic_pages(0x44, 1).remove(0);
    let mut out = vec![0u8; 3071];
    assert_eq!(codec.compress(&random, &mut out).unwrap(), None);
    let zeros = [0u8; PAGE_SIZE];
    let mut tiny = [0u8; 4];
    assert_eq!(codec.compress(&zeros, &mut tiny).unwrap(), None);
    assert!(codec.compress(&zeros, &mut out).unwrap().is_some());
}

#[test]
fn truncated_and_corrupt_input_is_refused_without_panic() {
    let mut codec = ZstdCodec::new(3);
    let mut out = vec![0u8; 2 * PAGE_SIZE];
    let mut back = [0u8; PAGE_SIZE];
    let mut accepted_flips = 0;
    for page in corpus_pages().iter().step_by(64) {
        let n = codec.compress(page, &mut out).unwrap().unwrap();
        let c = out[..n].to_vec();
        for len in 0..n {
            assert!(
                codec.decompress(&c[..len], &mut back).is_err(),
                "prefix {len}/{n}"
            );
        }
        for bit in (0..n * 8).step_by(3) {
            let mut bad = c.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            accepted_flips += usize::from(codec.decompress(&bad, &mut back).is_ok());
        }
    }
    // A frame that decodes to something other than one page is an error, not a short page.
    let short = zstd::bulk::compress(&[7u8; 100], 1).unwrap();
    assert!(matches!(
        codec.decompress(&short, &mut back),
        Err(CodecError::WrongSize { actual: 100 }) | Err(CodecError::Corrupt(_))
    ));
    let long = zstd::bulk::compress(&[7u8; PAGE_SIZE + 1], 1).unwrap();
    assert!(codec.decompress(&long, &mut back).is_err());
    println!("{accepted_flips} bit flips still decoded (zstd checks no checksum by default)");
}

#[test]
fn codecs_from_algorithm_round_trip() {
    let page = corpus_pages().remove(5);
    for alg in [
        Algorithm::Lz4,
        Algorithm::Zstd { level: 1 },
        Algorithm::parse("zstd:5").unwrap(),
    ] {
        let mut codec = alg.codec();
        assert_eq!(codec.algorithm(), alg);
        let mut out = vec![0u8; 2 * PAGE_SIZE];
        let n = codec.compress(&page, &mut out).unwrap().unwrap();
        let mut back = [0u8; PAGE_SIZE];
        codec.decompress(&out[..n], &mut back).unwrap();
        assert_eq!(back, page, "{alg}");
    }
}

#[test]
fn try_codec_creates_every_algorithm_and_names_it_on_failure() {
    let page = corpus_pages().remove(7);
    for alg in [
        Algorithm::Lz4,
        Algorithm::Zstd { level: 1 },
        Algorithm::Zstd { level: 19 },
    ] {
        let mut codec = alg.try_codec().expect("codec state allocates here");
        assert_eq!(codec.algorithm(), alg);
        let mut out = vec![0u8; 2 * PAGE_SIZE];
        let n = codec.compress(&page, &mut out).unwrap().unwrap();
        let mut back = [0u8; PAGE_SIZE];
        codec.decompress(&out[..n], &mut back).unwrap();
        assert_eq!(back, page, "{alg}");
    }
    // What a caller logs when creation fails: the algorithm and the reason.
    let err = CodecError::Create {
        algorithm: Algorithm::Zstd { level: 3 },
        reason: "Allocation error : not enough memory".into(),
    };
    assert_eq!(
        err.to_string(),
        "cannot create a zstd:3 codec: Allocation error : not enough memory"
    );
}

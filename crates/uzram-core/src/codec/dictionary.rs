//! The device's LZ4 dictionary for its cold pages: trained on pages the device holds, then
//! the prefix every block the dictionary recompressor writes may reach back into (an LZ4
//! offset reaches 64 KiB back, so 32 KiB of dictionary stays in reach of a page's last
//! byte). A dictionary pays where pages share content with others that are not near them:
//! on a many-process swap mix, per-page LZ4 with one of 32 KiB stores about 0.85 of plain
//! LZ4's payload where the best parse without one (LZ4HC-12) stores 0.92
//! (`scripts/probe-zstd-dict`, docs/bench/2026-11-recompress.md).
//!
//! Training is zstd's (`ZDICT_trainFromBuffer`, the cover algorithm): it picks the
//! segments that occur in the most samples. The entropy tables it puts first are
//! unused by LZ4 and cost a few hundred bytes of reach.

use super::page_codec::CodecError;
use crate::page::PAGE_SIZE;

/// The largest dictionary a device keeps.
pub const MAX_DICTIONARY_BYTES: usize = 32 << 10;
/// Fewest sample pages a dictionary is trained on: with fewer, zstd's trainer fails or
/// learns the samples by heart.
pub const MIN_DICTIONARY_SAMPLES: usize = 64;

/// Trains a dictionary of at most `max_bytes` (≤ [`MAX_DICTIONARY_BYTES`]) on `samples`,
/// whole pages one after another.
pub fn train_dictionary(samples: &[u8], max_bytes: usize) -> Result<Vec<u8>, CodecError> {
    let pages = samples.len() / PAGE_SIZE;
    if !samples.len().is_multiple_of(PAGE_SIZE) || pages < MIN_DICTIONARY_SAMPLES {
        return Err(CodecError::Compress(format!(
            "a dictionary needs at least {MIN_DICTIONARY_SAMPLES} whole sample pages, got {} bytes",
            samples.len()
        )));
    }
    if max_bytes == 0 || max_bytes > MAX_DICTIONARY_BYTES {
        return Err(CodecError::Compress(format!(
            "a dictionary of {max_bytes} bytes: at most {MAX_DICTIONARY_BYTES}"
        )));
    }
    let sizes = vec![PAGE_SIZE; pages];
    let dict = zstd::dict::from_continuous(samples, &sizes, max_bytes)
        .map_err(|e| CodecError::Compress(format!("training a dictionary: {e}")))?;
    if dict.is_empty() || dict.len() > max_bytes {
        return Err(CodecError::Compress(format!(
            "the trainer made a dictionary of {} bytes (at most {max_bytes} asked)",
            dict.len()
        )));
    }
    Ok(dict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Lz4Codec;
    use crate::page::same_filled_word;

    /// The pages of the checked-in slices of two heaps and a swap mix that are not
    /// same-filled.
    fn corpus_pages() -> Vec<[u8; PAGE_SIZE]> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
        let mut pages = Vec::new();
        for name in ["python-heap", "mixed-swap", "jvm"] {
            let f = std::fs::File::open(dir.join(format!("{name}.slice.pages.zst"))).unwrap();
            let data = zstd::decode_all(f).unwrap();
            for p in data.chunks_exact(PAGE_SIZE) {
                let p: [u8; PAGE_SIZE] = p.try_into().unwrap();
                if same_filled_word(&p).is_none() {
                    pages.push(p);
                }
            }
        }
        pages
    }

    #[test]
    fn too_few_samples_or_too_large_a_dictionary_is_an_error() {
        assert!(train_dictionary(&[0u8; PAGE_SIZE * 8], 4096).is_err());
        assert!(train_dictionary(&[0u8; 100], 4096).is_err());
        let many = vec![1u8; PAGE_SIZE * MIN_DICTIONARY_SAMPLES];
        assert!(train_dictionary(&many, MAX_DICTIONARY_BYTES + 1).is_err());
        assert!(train_dictionary(&many, 0).is_err());
    }

    /// Trained on every other page of the checked-in slices, the dictionary makes
    /// liblz4's blocks of the other pages smaller, and both decoders agree on every one.
    #[test]
    fn a_trained_dictionary_shrinks_held_out_pages_and_decodes_as_liblz4_does() {
        let pages = corpus_pages();
        let train: Vec<u8> = pages.iter().step_by(2).flatten().copied().collect();
        let dict = train_dictionary(&train, MAX_DICTIONARY_BYTES).unwrap();
        assert!(dict.len() > MAX_DICTIONARY_BYTES / 2, "{}", dict.len());
        let (mut with, mut without) = (0usize, 0usize);
        let mut page = [0u8; PAGE_SIZE];
        for p in pages.iter().skip(1).step_by(2) {
            let block = crate::fuzz::liblz4::compress_with_dict(p, &dict);
            let plain = crate::fuzz::liblz4::compress_with_dict(p, &[]);
            with += block.len().min(PAGE_SIZE);
            without += plain.len().min(PAGE_SIZE);
            Lz4Codec::decompress_with_dict(&block, &dict, &mut page).unwrap();
            assert!(page == *p);
            let theirs = crate::fuzz::liblz4::decompress_with_dict(&block, &dict).unwrap();
            assert!(*theirs == *p);
            // Without the dictionary it is another page or an error, never silently right
            // unless the block did not use it.
            if Lz4Codec::decompress_with_dict(&block, &[], &mut page).is_ok() {
                assert!(crate::fuzz::liblz4::decompress_with_dict(&block, &[]).is_some());
            }
        }
        // liblz4's fast parse gains little from it (about 0.97); the point is that it gains.
        let ratio = with as f64 / without as f64;
        eprintln!("held-out payload with the dictionary ÷ without: {ratio:.3}");
        assert!(ratio < 0.99, "{ratio}");
        // Damaged blocks: whatever this decoder accepts, liblz4 decodes to the same page.
        let mut rng = crate::fuzz::Rng::new(0x5eed);
        let mut accepted = 0;
        for p in pages.iter().skip(1).step_by(2).take(400) {
            let good = crate::fuzz::liblz4::compress_with_dict(p, &dict);
            for _ in 0..8 {
                let mut bad = good.clone();
                let at = rng.below(bad.len());
                bad[at] ^= 1 << rng.below(8);
                if Lz4Codec::decompress_with_dict(&bad, &dict, &mut page).is_ok() {
                    accepted += 1;
                    let theirs = crate::fuzz::liblz4::decompress_with_dict(&bad, &dict);
                    assert!(theirs.is_some_and(|t| *t == page), "a block only we accept");
                }
            }
        }
        eprintln!("{accepted} of 3200 damaged blocks still decode (to liblz4's page)");
    }

    /// Any bytes as a block over a dictionary of any length (0 to 64 KiB: an offset reaches
    /// 64 KiB back): the safe decoder returns, never panics; a page it accepts does not
    /// depend on what the output held before, and where liblz4's
    /// `LZ4_decompress_safe_usingDict` accepts the same block and dictionary, it is the
    /// page liblz4 makes. The first input byte picks the dictionary's length; seeds are
    /// real blocks of the slices' pages over each length. `UZRAM_FUZZ_CASES=4000000 cargo
    /// test --release -p uzram-core fuzz_dictionary` runs it at length.
    #[test]
    fn fuzz_dictionary_blocks_decode_as_liblz4_does_or_are_refused() {
        let pages = corpus_pages();
        let train: Vec<u8> = pages.iter().step_by(2).flatten().copied().collect();
        let trained = train_dictionary(&train, MAX_DICTIONARY_BYTES).unwrap();
        // Up to 64 KiB: the trained bytes, then pages of the slices after them.
        let long: Vec<u8> = trained
            .iter()
            .copied()
            .chain(pages.iter().flatten().copied())
            .take(64 << 10)
            .collect();
        const LENGTHS: [usize; 8] = [0, 1, 5, 300, 4096, 30000, 32 << 10, 64 << 10];
        let dict_of = |input: &[u8]| &long[..LENGTHS[usize::from(input[0]) % LENGTHS.len()]];
        let mut seeds = Vec::new();
        for (i, p) in pages.iter().skip(1).step_by(97).take(24).enumerate() {
            let class = (i % LENGTHS.len()) as u8;
            let dict = &long[..LENGTHS[usize::from(class)]];
            let block = crate::fuzz::liblz4::compress_with_dict(p, dict);
            seeds.push([&[class][..], &block].concat());
        }
        crate::fuzz::run("lz4_dictionary", &seeds, PAGE_SIZE + 64, |input| {
            let Some((_, block)) = input.split_first() else {
                return;
            };
            let dict = dict_of(input);
            let mut ours = [0xA5u8; PAGE_SIZE];
            let mut again = [0x5Au8; PAGE_SIZE];
            let first = Lz4Codec::decompress_with_dict(block, dict, &mut ours);
            let second = Lz4Codec::decompress_with_dict(block, dict, &mut again);
            assert_eq!(
                first.is_ok(),
                second.is_ok(),
                "the result depends on the output"
            );
            if first.is_ok() {
                assert!(
                    ours == again,
                    "an accepted page depends on the output's old bytes"
                );
                // Where liblz4 also accepts, it decodes the same bytes. (It refuses some
                // blocks this decoder takes: a match in the block's last bytes, which
                // LZ4's format reserves for literals; such a page is still decoded in
                // bounds, and read only if its checksum holds.)
                if let Some(theirs) = crate::fuzz::liblz4::decompress_with_dict(block, dict) {
                    assert!(*theirs == ours, "liblz4 decodes this block to another page");
                }
            }
        });
    }
}

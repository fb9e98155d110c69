//! Same-filled page detection (zram's rule: the page is one `u64` word repeated).
//!
//! Portable and free of `unsafe`. AVX2 and AVX-512 versions were measured against it in the
//! same run (`cargo bench -p uzram-core --bench same_fill`, which keeps them as challengers):
//! they lost on the python-heap corpus, tied on mixed-swap, and won only on pages that are
//! scanned to the end, by a few tens of nanoseconds per page; see the README's benchmarks.

use super::size::PAGE_SIZE;

fn word_at(page: &[u8; PAGE_SIZE], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&page[i * 8..i * 8 + 8]);
    u64::from_le_bytes(w)
}

/// The first cache line word by word (most pages that are not same-filled differ there and
/// cost 64 bytes), then by doubling: once bytes `0..n` are known to be the word repeated,
/// `n..2n` is compared with them (n = 64, 128, ..., 2048). Those slice comparisons are
/// `memcmp`, which glibc runs with the widest vector unit the CPU has, so the check keeps
/// most of the speed of hand-written AVX2 without `unsafe` here.
pub(super) fn same_filled_word(page: &[u8; PAGE_SIZE]) -> Option<u64> {
    let first = word_at(page, 0);
    let mut diff = 0u64;
    for w in page[..64].chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        diff |= u64::from_le_bytes(b) ^ first;
    }
    if diff != 0 {
        return None;
    }
    let mut n = 64;
    while n < PAGE_SIZE {
        if page[n..2 * n] != page[..n] {
            return None;
        }
        n *= 2;
    }
    Some(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious definition, independent of the loop above.
    fn reference(page: &[u8; PAGE_SIZE]) -> Option<u64> {
        let first = word_at(page, 0);
        (0..PAGE_SIZE / 8)
            .all(|i| word_at(page, i) == first)
            .then_some(first)
    }

    fn check(page: &[u8; PAGE_SIZE], what: &str) {
        assert_eq!(same_filled_word(page), reference(page), "{what}");
        assert_eq!(
            crate::page::same_filled_word(page),
            reference(page),
            "public entry point on {what}"
        );
    }

    fn filled(word: u64) -> Box<[u8; PAGE_SIZE]> {
        let mut p = Box::new([0u8; PAGE_SIZE]);
        crate::page::fill_page(&mut p, word);
        p
    }

    #[test]
    fn edge_cases_agree_with_reference() {
        let words = [
            0u64,
            u64::MAX,
            0x0101_0101_0101_0101,
            0xdead_beef_0bad_f00d,
            1,
            1 << 63,
        ];
        for &word in &words {
            let p = filled(word);
            check(&p, &format!("fill {word:#x}"));
            assert_eq!(reference(&p), Some(word));
            // Every single-byte change, at every position, must be seen.
            for pos in 0..PAGE_SIZE {
                let mut q = p.clone();
                q[pos] ^= 0x80;
                assert_eq!(reference(&q), None, "pos {pos}");
                assert_eq!(same_filled_word(&q), None, "pos {pos} fill {word:#x}");
            }
            // One whole word in the middle differs.
            let mut q = p.clone();
            q[2048..2056].copy_from_slice(&(!word).to_le_bytes());
            check(&q, "middle word");
        }
    }

    #[test]
    fn repeated_bytes_that_are_not_a_repeated_word() {
        // Period 16 bytes: each u64 alternates, so not same-filled.
        let mut p = Box::new([0u8; PAGE_SIZE]);
        for (i, b) in p.iter_mut().enumerate() {
            *b = if (i / 8) % 2 == 0 { 7 } else { 9 };
        }
        check(&p, "period 16");
        assert_eq!(reference(&p), None);
    }

    #[test]
    fn random_pages_agree_with_reference() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5a3e);
        for _ in 0..2000 {
            let mut p = Box::new([0u8; PAGE_SIZE]);
            rng.fill(&mut p[..]);
            check(&p, "random");
            // Random pages whose tail is random after a same-filled prefix.
            let cut = rng.gen_range(8..PAGE_SIZE);
            let word: u64 = rng.gen();
            let mut q = filled(word);
            q[cut] = q[cut].wrapping_add(1 + rng.gen_range(0..255));
            check(&q, "prefix then one change");
        }
    }
}

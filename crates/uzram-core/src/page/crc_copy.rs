//! A page copied into staging and checksummed in one pass: the GPU ring's writers need both
//! ([`super::page_to_words_streaming`] and [`super::page_checksum`]), and done one after the
//! other the checksum cost the GPU path 7 % more CPU per GiB (docs/gpu.md, run 144). Here each
//! 64-byte line is loaded once, stored (non-temporally) into the slot and folded into the
//! CRC, so the carry-less multiplications run while the copy waits on memory.
//!
//! The CRC is CRC32C computed by folding: four 512-bit accumulators (16 lanes of 128 bits)
//! are each moved 2048 bits forward by two carry-less multiplications per lane and XORed
//! with the next 256 bytes; at the end they are folded into one 128-bit remainder that is
//! congruent to the page modulo the polynomial, and the CPU's `crc32` instruction reduces
//! those 16 bytes. This is `crc-fast`'s function (the same value, tested against it), which
//! cannot be fused with a copy from outside.

#![cfg_attr(feature = "unsafe-stream", allow(unsafe_code))]

use std::sync::atomic::AtomicU64;

use super::size::PAGE_SIZE;

/// The CRC32C polynomial without its x^32 term, bit i the coefficient of x^i.
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
const POLY: u64 = 0x1EDC_6F41;

/// x^n mod P, bit i the coefficient of x^i.
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
const fn x_pow_mod(n: u32) -> u32 {
    let mut r: u64 = 1;
    let mut i = 0;
    while i < n {
        r <<= 1;
        if r & (1 << 32) != 0 {
            r ^= (1 << 32) | POLY;
        }
        i += 1;
    }
    r as u32
}

/// The constant that moves a 128-bit lane `bits` forward: in each 64-bit half, the
/// bit-reflected remainder placed so that a carry-less product with that half lands as a
/// reflected 128-bit value. The low half of a lane (its first 8 bytes) holds the higher
/// powers, x^(64 + bits), the high half x^bits; the product of two reflected values is the
/// product times x, hence the minus one.
#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
const fn fold_constant(bits: u32) -> (u64, u64) {
    (
        (x_pow_mod(bits + 63).reverse_bits() as u64) << 32,
        (x_pow_mod(bits - 1).reverse_bits() as u64) << 32,
    )
}

/// Copies `page` into `words` as [`super::page_to_words_streaming`] does (prefetching
/// `next`) and returns [`super::page_checksum`] of it, reading the page once where the CPU
/// has AVX-512 and VPCLMULQDQ. Call [`super::stream_fence`] before publishing the words.
///
/// Nothing may read or write `words` while this runs (the ring leases each index to one
/// writer, and publishes the page only afterwards, under the shard lock).
#[inline]
pub fn page_to_words_streaming_checksummed(
    page: &[u8; PAGE_SIZE],
    next: Option<&[u8; PAGE_SIZE]>,
    words: &[AtomicU64],
) -> u32 {
    #[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
    if let Some(words) = words.get(..super::size::PAGE_WORDS) {
        if words.as_ptr().cast::<u8>().align_offset(64) == 0 && fused::available() {
            // SAFETY: the CPU has the features `fused::copy_and_checksum` is compiled for
            // (checked just above); `words` is PAGE_WORDS long and 64-byte aligned (checked
            // above), and the caller guarantees that nothing else touches it meanwhile.
            return unsafe { fused::copy_and_checksum(page, next, words) };
        }
    }
    let checksum = super::page_checksum(page);
    super::page_to_words_streaming(page, next, words);
    checksum
}

/// CRC32C of a page ([`super::page_checksum`]): by the same fold where the CPU has AVX-512
/// and VPCLMULQDQ (about 15 % under crc-fast's time on a page in cache, on the H200 host's
/// Intel CPU and this project's AMD build host: `benches/page_checksum.rs`), else crc-fast.
#[inline]
pub fn checksum(page: &[u8; PAGE_SIZE]) -> u32 {
    #[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
    if fused::available() {
        // SAFETY: the CPU has the features `fused::checksum` is compiled for (checked).
        return unsafe { fused::checksum(page) };
    }
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, page) as u32
}

#[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
mod fused {
    use std::arch::x86_64::{
        __m128i, __m512i, _mm512_castsi512_si128, _mm512_clmulepi64_epi128,
        _mm512_extracti32x4_epi32, _mm512_loadu_si512, _mm512_set_epi64, _mm512_stream_si512,
        _mm512_ternarylogic_epi64, _mm512_xor_si512, _mm_clmulepi64_si128, _mm_crc32_u64,
        _mm_cvtsi128_si64, _mm_extract_epi64, _mm_prefetch, _mm_set_epi64x, _mm_xor_si128,
        _MM_HINT_T0,
    };
    use std::sync::atomic::AtomicU64;
    use std::sync::OnceLock;

    use super::{fold_constant, PAGE_SIZE};

    /// Bytes the four accumulators cover per round.
    const ROUND: usize = 256;

    pub(super) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("sse4.2")
        })
    }

    /// The constants, evaluated when compiling: a round (2048 bits), the accumulators onto
    /// the last one, the lanes onto the last lane.
    const K_ROUND: (u64, u64) = fold_constant(ROUND as u32 * 8);
    const K_512: (u64, u64) = fold_constant(512);
    const K_1024: (u64, u64) = fold_constant(1024);
    const K_1536: (u64, u64) = fold_constant(1536);
    const K_128: (u64, u64) = fold_constant(128);
    const K_256: (u64, u64) = fold_constant(256);
    const K_384: (u64, u64) = fold_constant(384);

    /// A 512-bit constant: `k` in each of the four lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn lanes((lo, hi): (u64, u64)) -> __m512i {
        let (lo, hi) = (lo as i64, hi as i64);
        _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo)
    }

    /// Each lane of `acc` moved by the lanes' constant `k`, XORed with `data`.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold(acc: __m512i, k: __m512i, data: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128::<0x00>(acc, k);
        let hi = _mm512_clmulepi64_epi128::<0x11>(acc, k);
        // 0x96: a ^ b ^ c.
        _mm512_ternarylogic_epi64::<0x96>(lo, hi, data)
    }

    /// One 128-bit lane moved by `k`, XORed with `data`.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn fold128(acc: __m128i, (lo, hi): (u64, u64), data: __m128i) -> __m128i {
        let k = _mm_set_epi64x(hi as i64, lo as i64);
        let a = _mm_clmulepi64_si128::<0x00>(acc, k);
        let b = _mm_clmulepi64_si128::<0x11>(acc, k);
        _mm_xor_si128(_mm_xor_si128(a, b), data)
    }

    /// # Safety
    /// The CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2; `words` is PAGE_WORDS long
    /// and 64-byte aligned, and nothing else reads or writes it while this runs.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn copy_and_checksum(
        page: &[u8; PAGE_SIZE],
        next: Option<&[u8; PAGE_SIZE]>,
        words: &[AtomicU64],
    ) -> u32 {
        let dst = words.as_ptr().cast::<u8>().cast_mut();
        // SAFETY: the caller's contract.
        unsafe { fold_page::<true>(page, next, dst) }
    }

    /// The CRC alone, for a page in cache (a read checks the page it just decoded).
    ///
    /// # Safety
    /// The CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn checksum(page: &[u8; PAGE_SIZE]) -> u32 {
        // SAFETY: the caller's contract; without COPY, `dst` is never used.
        unsafe { fold_page::<false>(page, None, std::ptr::null_mut()) }
    }

    /// The fold, storing each line at `dst` too when `COPY` (and prefetching `next`).
    ///
    /// # Safety
    /// The CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2; with `COPY`, `dst` is
    /// writable for PAGE_SIZE bytes, 64-byte aligned, and nothing else touches them.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    unsafe fn fold_page<const COPY: bool>(
        page: &[u8; PAGE_SIZE],
        next: Option<&[u8; PAGE_SIZE]>,
        dst: *mut u8,
    ) -> u32 {
        let src = page.as_ptr();
        // Without a next page, this one's lines again: already in cache, the prefetch is
        // free.
        let ahead = next.unwrap_or(page).as_ptr();
        macro_rules! line {
            ($l:expr) => {{
                let at = $l * 64;
                // SAFETY: `$l * 64 + 64 <= PAGE_SIZE` (the lines below), so each load,
                // prefetch and store touches bytes inside `page`, `ahead`'s page or (with
                // COPY) `dst`'s PAGE_SIZE bytes, 64-byte aligned as the streaming store needs;
                // the loads are unaligned; the caller guarantees that nothing races with the
                // stores (`words` are `AtomicU64`s, which allow writes through a shared
                // reference).
                unsafe {
                    let v = _mm512_loadu_si512(src.add(at).cast());
                    if COPY {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(at).cast());
                        _mm512_stream_si512(dst.add(at).cast(), v);
                    }
                    v
                }
            }};
        }
        // CRC32C's initial value ~0 is the same as ~0 XORed into the first 4 bytes.
        let init = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, 0xFFFF_FFFF);
        let mut a0 = _mm512_xor_si512(line!(0), init);
        let mut a1 = line!(1);
        let mut a2 = line!(2);
        let mut a3 = line!(3);
        let k = lanes(K_ROUND);
        let mut l = 4;
        while l < PAGE_SIZE / 64 {
            a0 = fold(a0, k, line!(l));
            a1 = fold(a1, k, line!(l + 1));
            a2 = fold(a2, k, line!(l + 2));
            a3 = fold(a3, k, line!(l + 3));
            l += 4;
        }
        // The four accumulators onto the last one's place, then its four lanes onto the
        // last lane's.
        let a = fold(
            a0,
            lanes(K_1536),
            fold(a1, lanes(K_1024), fold(a2, lanes(K_512), a3)),
        );
        let (r0, r1, r2, r3) = (
            _mm512_castsi512_si128(a),
            _mm512_extracti32x4_epi32::<1>(a),
            _mm512_extracti32x4_epi32::<2>(a),
            _mm512_extracti32x4_epi32::<3>(a),
        );
        let r = fold128(r0, K_384, fold128(r1, K_256, fold128(r2, K_128, r3)));
        // The remainder is congruent to the page: its CRC (from 0) is the page's.
        let c = _mm_crc32_u64(0, _mm_cvtsi128_si64(r) as u64);
        let crc = _mm_crc32_u64(c, _mm_extract_epi64::<1>(r) as u64);
        !(crc as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::{words_to_page, PAGE_WORDS};

    /// The reference: crc-fast's CRC32C, an implementation of its own.
    fn reference(page: &[u8; PAGE_SIZE]) -> u32 {
        crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, page) as u32
    }

    fn pattern(seed: u64) -> Box<[u8; PAGE_SIZE]> {
        let mut page = Box::new([0u8; PAGE_SIZE]);
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for b in page.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        page
    }

    /// Room for a page at every 64-byte offset of a 4 KiB span: the aligned ones take the
    /// fused path where the CPU has it, the others the two passes.
    fn aligned_words() -> Vec<AtomicU64> {
        (0..PAGE_WORDS * 2).map(|_| AtomicU64::new(0)).collect()
    }

    fn check(page: &[u8; PAGE_SIZE], words: &[AtomicU64]) {
        let next = pattern(99);
        let crc = page_to_words_streaming_checksummed(page, Some(&next), words);
        super::super::stream_fence();
        assert_eq!(crc, reference(page));
        assert_eq!(checksum(page), reference(page));
        let mut back = [0u8; PAGE_SIZE];
        words_to_page(&words[..PAGE_WORDS], &mut back);
        assert_eq!(&back[..], &page[..]);
    }

    /// CRC32C's check value ("123456789" gives 0xE3069283), carried to a page: the
    /// reference agrees with it, so the tests below compare against CRC32C itself.
    #[test]
    fn the_reference_is_crc32c() {
        assert_eq!(
            crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, b"123456789"),
            0xE306_9283
        );
        // A page of zeros, by the bitwise definition (reflected, polynomial 0x82F63B78).
        let mut crc = !0u32;
        for _ in 0..PAGE_SIZE {
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
            }
        }
        assert_eq!(reference(&[0u8; PAGE_SIZE]), !crc);
        assert_eq!(checksum(&[0u8; PAGE_SIZE]), !crc);
    }

    #[test]
    fn same_checksum_and_copy_as_the_two_passes() {
        let store = aligned_words();
        for start in (0..PAGE_WORDS).step_by(8).take(8) {
            let words = &store[start..start + PAGE_WORDS];
            for seed in 0..64 {
                check(&pattern(seed), words);
            }
            check(&[0u8; PAGE_SIZE], words);
            check(&[0xFFu8; PAGE_SIZE], words);
            let mut one = [0u8; PAGE_SIZE];
            for bit in [0usize, 7, 31, 32, 1000, 4095 * 8 + 7] {
                one.fill(0);
                one[bit / 8] = 1 << (bit % 8);
                check(&one, words);
            }
        }
    }

    #[cfg(all(target_arch = "x86_64", feature = "unsafe-stream"))]
    #[test]
    fn the_fused_path_runs_where_the_cpu_has_it() {
        if !fused::available() {
            eprintln!("skipped: this CPU has no AVX-512 with VPCLMULQDQ");
            return;
        }
        let store = aligned_words();
        let at = store
            .iter()
            .position(|w| (w as *const AtomicU64).cast::<u8>().align_offset(64) == 0)
            .expect("an aligned word");
        let words = &store[at..at + PAGE_WORDS];
        for seed in 0..256 {
            let page = pattern(seed);
            // SAFETY: the features were checked above; `words` is PAGE_WORDS long,
            // 64-byte aligned and this test's alone.
            let crc = unsafe { fused::copy_and_checksum(&page, None, words) };
            assert_eq!(crc, reference(&page), "seed {seed}");
            // SAFETY: the features were checked above.
            assert_eq!(unsafe { fused::checksum(&page) }, crc, "seed {seed}");
        }
    }
}

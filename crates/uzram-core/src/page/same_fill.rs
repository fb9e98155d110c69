//! Same-filled page detection (zram's rule: the page is one `u64` word repeated), with
//! runtime dispatch to AVX-512, AVX2 or a portable scalar loop.
//!
//! This is the only module of uzram-core with `unsafe`: calling a `#[target_feature]`
//! function is unsafe, and each call happens only after the CPU was seen to have the feature.

use std::sync::OnceLock;

use super::PAGE_SIZE;

/// One implementation of same-filled detection. All of them return the same answer for
/// every page; they differ only in speed and in which CPUs can run them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SameFillImpl {
    /// Portable: eight `u64` words (64 bytes) per step, stops at the first differing block.
    Scalar,
    /// AVX2: 128 bytes per step.
    Avx2,
    /// AVX-512F: 256 bytes per step.
    Avx512,
}

impl SameFillImpl {
    /// Every variant, narrowest first.
    pub const ALL: [SameFillImpl; 3] = [Self::Scalar, Self::Avx2, Self::Avx512];

    /// Whether this CPU can run the variant.
    pub fn is_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 | Self::Avx512 => false,
        }
    }

    /// The fastest variant this CPU can run, detected once and cached.
    pub fn best() -> Self {
        static BEST: OnceLock<SameFillImpl> = OnceLock::new();
        *BEST.get_or_init(|| {
            let best = Self::ALL
                .into_iter()
                .rev()
                .find(|v| v.is_available())
                .unwrap_or(Self::Scalar);
            tracing::debug!(variant = ?best, "same-filled page detection");
            best
        })
    }

    /// A short lower-case name: `scalar`, `avx2`, `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }

    /// Runs this variant; falls back to the scalar one if the CPU lacks the variant's
    /// instructions, so the answer is always correct.
    #[inline]
    pub fn same_filled_word(self, page: &[u8; PAGE_SIZE]) -> Option<u64> {
        #[cfg(target_arch = "x86_64")]
        match self {
            Self::Avx512 if self.is_available() => {
                // SAFETY: `is_available` just confirmed (through std's cached CPUID
                // detection) that this CPU executes AVX-512F instructions.
                return unsafe { x86::same_filled_avx512(page) };
            }
            Self::Avx2 if self.is_available() => {
                // SAFETY: `is_available` just confirmed that this CPU executes AVX2.
                return unsafe { x86::same_filled_avx2(page) };
            }
            _ => {}
        }
        same_filled_scalar(page)
    }
}

fn word_at(page: &[u8; PAGE_SIZE], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&page[i * 8..i * 8 + 8]);
    u64::from_le_bytes(w)
}

/// The reference implementation every other variant is tested against.
fn same_filled_scalar(page: &[u8; PAGE_SIZE]) -> Option<u64> {
    let first = word_at(page, 0);
    for block in page.chunks_exact(64) {
        let mut diff = 0u64;
        for w in block.chunks_exact(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            diff |= u64::from_le_bytes(b) ^ first;
        }
        if diff != 0 {
            return None;
        }
    }
    Some(first)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{word_at, PAGE_SIZE};

    // The AVX-512 loop below has the page size written into its assembly.
    const _: () = assert!(PAGE_SIZE == 4096);

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn same_filled_avx2(page: &[u8; PAGE_SIZE]) -> Option<u64> {
        let first = word_at(page, 0);
        let want = _mm256_set1_epi64x(first as i64);
        let base = page.as_ptr();
        // Most pages that are not same-filled differ in their first cache line: test it
        // alone first, so those pages cost one line, not the loop's 128 bytes.
        // SAFETY: bytes 0..64 are inside the 4096-byte page.
        let (a, b) = unsafe {
            (
                _mm256_loadu_si256(base.cast()),
                _mm256_loadu_si256(base.add(32).cast()),
            )
        };
        let head = _mm256_or_si256(_mm256_xor_si256(a, want), _mm256_xor_si256(b, want));
        if _mm256_testz_si256(head, head) == 0 {
            return None;
        }
        let mut off = 0;
        while off < PAGE_SIZE {
            // SAFETY: off + 128 <= PAGE_SIZE (off steps by 128 from 0 and PAGE_SIZE is a
            // multiple of 128), so all four 32-byte unaligned loads stay inside `page`.
            let (a, b, c, d) = unsafe {
                (
                    _mm256_loadu_si256(base.add(off).cast()),
                    _mm256_loadu_si256(base.add(off + 32).cast()),
                    _mm256_loadu_si256(base.add(off + 64).cast()),
                    _mm256_loadu_si256(base.add(off + 96).cast()),
                )
            };
            let diff = _mm256_or_si256(
                _mm256_or_si256(_mm256_xor_si256(a, want), _mm256_xor_si256(b, want)),
                _mm256_or_si256(_mm256_xor_si256(c, want), _mm256_xor_si256(d, want)),
            );
            if _mm256_testz_si256(diff, diff) == 0 {
                return None;
            }
            off += 128;
        }
        Some(first)
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    ///
    /// Written as inline assembly: AVX-512 intrinsics and `target_feature(enable =
    /// "avx512f")` need Rust 1.89, newer than the workspace's minimum.
    pub(super) unsafe fn same_filled_avx512(page: &[u8; PAGE_SIZE]) -> Option<u64> {
        let first = word_at(page, 0);
        let differs: u8;
        // SAFETY: the caller guarantees AVX-512F. The code reads [base, base + 4096) in
        // 64-byte loads at offsets 0..4096 step 256 (+0/64/128/192), all inside `page`,
        // and writes no memory. Every vector register it touches is declared clobbered
        // (xmmN stands for the whole zmmN), and `vzeroupper` leaves the upper halves
        // clean for SSE code that follows.
        unsafe {
            std::arch::asm!(
                "vpbroadcastq zmm0, {first}",
                // The first cache line alone first: most pages that are not same-filled
                // differ there, and then cost one line instead of the loop's four.
                "vpxorq zmm1, zmm0, zmmword ptr [{base}]",
                "vextracti64x4 ymm2, zmm1, 1",
                "vpor ymm1, ymm1, ymm2",
                "vptest ymm1, ymm1",
                "jnz 3f",
                "xor {i:e}, {i:e}",
                "2:",
                "vpxorq zmm1, zmm0, zmmword ptr [{base} + {i}]",
                "vpxorq zmm2, zmm0, zmmword ptr [{base} + {i} + 64]",
                "vpxorq zmm3, zmm0, zmmword ptr [{base} + {i} + 128]",
                "vpxorq zmm4, zmm0, zmmword ptr [{base} + {i} + 192]",
                "vporq zmm1, zmm1, zmm2",
                "vporq zmm3, zmm3, zmm4",
                "vporq zmm1, zmm1, zmm3",
                "vextracti64x4 ymm2, zmm1, 1",
                "vpor ymm1, ymm1, ymm2",
                "vptest ymm1, ymm1",
                "jnz 3f",
                "add {i}, 256",
                "cmp {i}, 4096",
                "jb 2b",
                "3:",
                "setnz {differs}",
                "vzeroupper",
                first = in(reg) first,
                base = in(reg) page.as_ptr(),
                i = out(reg) _,
                differs = out(reg_byte) differs,
                out("xmm0") _,
                out("xmm1") _,
                out("xmm2") _,
                out("xmm3") _,
                out("xmm4") _,
                options(nostack, readonly),
            );
        }
        (differs == 0).then_some(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious definition, independent of every variant's code.
    fn reference(page: &[u8; PAGE_SIZE]) -> Option<u64> {
        let first = word_at(page, 0);
        (0..PAGE_SIZE / 8)
            .all(|i| word_at(page, i) == first)
            .then_some(first)
    }

    fn check_all(page: &[u8; PAGE_SIZE], what: &str) {
        let want = reference(page);
        for v in SameFillImpl::ALL {
            if v.is_available() {
                assert_eq!(v.same_filled_word(page), want, "{} on {what}", v.name());
            }
        }
        assert_eq!(
            crate::page::same_filled_word(page),
            want,
            "dispatch on {what}"
        );
    }

    fn filled(word: u64) -> Box<[u8; PAGE_SIZE]> {
        let mut p = Box::new([0u8; PAGE_SIZE]);
        crate::page::fill_page(&mut p, word);
        p
    }

    #[test]
    fn reports_skipped_variants() {
        for v in SameFillImpl::ALL {
            if !v.is_available() {
                println!("same-fill variant {} skipped: CPU lacks it", v.name());
            }
        }
        assert!(SameFillImpl::best().is_available());
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
            check_all(&p, &format!("fill {word:#x}"));
            assert_eq!(reference(&p), Some(word));
            // Every single-byte change, at every position, must be seen by every variant.
            for pos in 0..PAGE_SIZE {
                let mut q = p.clone();
                q[pos] ^= 0x80;
                let want = reference(&q);
                // A page differing from a same-filled page in one byte is never same-filled.
                assert_eq!(want, None, "pos {pos}");
                for v in SameFillImpl::ALL.into_iter().filter(|v| v.is_available()) {
                    assert_eq!(
                        v.same_filled_word(&q),
                        None,
                        "{} pos {pos} fill {word:#x}",
                        v.name()
                    );
                }
            }
            // One whole word in the middle differs.
            let mut q = p.clone();
            q[2048..2056].copy_from_slice(&(!word).to_le_bytes());
            check_all(&q, "middle word");
        }
    }

    #[test]
    fn repeated_bytes_that_are_not_a_repeated_word() {
        // Period 16 bytes: each u64 alternates, so not same-filled.
        let mut p = Box::new([0u8; PAGE_SIZE]);
        for (i, b) in p.iter_mut().enumerate() {
            *b = if (i / 8) % 2 == 0 { 7 } else { 9 };
        }
        check_all(&p, "period 16");
        assert_eq!(reference(&p), None);
    }

    #[test]
    fn random_pages_agree_with_reference() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5a3e);
        for _ in 0..2000 {
            let mut p = Box::new([0u8; PAGE_SIZE]);
            rng.fill(&mut p[..]);
            check_all(&p, "random");
            // Random pages whose tail is random after a same-filled prefix.
            let cut = rng.gen_range(8..PAGE_SIZE);
            let word: u64 = rng.gen();
            let mut q = filled(word);
            q[cut] = q[cut].wrapping_add(1 + rng.gen_range(0..255));
            check_all(&q, "prefix then one change");
        }
    }
}

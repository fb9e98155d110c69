//! The kernels' PTX, embedded at build time (built by `scripts/gpu-ptx` from
//! `kernels/lz4.cu`), so the backend runs where only the driver is installed: the driver
//! compiles PTX for the GPU it finds (`cuModuleLoadData`).

/// PTX of `kernels/lz4.cu` (NUL-terminated for `cuModuleLoadData`).
pub const PTX: &str = concat!(include_str!("../kernels/lz4.ptx"), "\0");

/// The CUDA source the PTX must have been built from.
pub const SOURCE: &str = include_str!("../kernels/lz4.cu");

/// The header line `scripts/gpu-ptx` puts first in the PTX.
const HASH_TAG: &str = "// uzram-source-fnv1a64: ";

/// FNV-1a, 64 bit: the hash `scripts/gpu-ptx` records.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The source hash recorded in a PTX text's header, if it has one.
pub fn recorded_source_hash(ptx: &str) -> Option<u64> {
    let line = ptx.lines().next()?;
    u64::from_str_radix(line.strip_prefix(HASH_TAG)?.trim(), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_known_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn embedded_ptx_matches_kernel_source() {
        let recorded = recorded_source_hash(PTX).expect("PTX has no source-hash header");
        assert_eq!(
            recorded,
            fnv1a64(SOURCE.as_bytes()),
            "kernels/lz4.ptx is stale: run scripts/gpu-ptx"
        );
    }

    #[test]
    fn embedded_ptx_defines_the_kernels_for_hopper() {
        for k in crate::Kernel::ALL {
            assert!(PTX.contains(&format!(".entry {}(", k.entry())), "{k:?}");
        }
        assert!(PTX.contains(".target sm_90"));
        assert!(PTX.ends_with('\0') && !PTX[..PTX.len() - 1].contains('\0'));
    }

    #[test]
    fn header_parse_rejects_garbage() {
        assert_eq!(
            recorded_source_hash("// uzram-source-fnv1a64: 00ff\n"),
            Some(0xff)
        );
        assert_eq!(recorded_source_hash("//x\n"), None);
        assert_eq!(recorded_source_hash("// uzram-source-fnv1a64: zz\n"), None);
    }
}

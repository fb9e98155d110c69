//! The arena object each page of a corpus becomes, one line a page: its bytes with the
//! checksum, rounded up to the 8-byte size class (0: a same-filled page, no object; 4104: a
//! page stored raw). Input for `scripts/arena-model`, which replays a device's writes and
//! overwrites against models of the arena's allocator.
//!
//!   cargo run --release -p uzram-core --example object_sizes -- CORPUS.pages.zst > sizes.txt

use std::io::Write;

use uzram_core::codec::Algorithm;
use uzram_core::{StoreConfig, PAGE_SIZE};

/// The checksum the store keeps after each object's payload, and the size classes' step
/// (`store/arena.rs`).
const CHECKSUM_BYTES: usize = 4;
const CLASS_GRANULE: usize = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: object_sizes CORPUS.pages[.zst]")?;
    let bytes = std::fs::read(&path)?;
    let pages = if path.ends_with(".zst") {
        zstd::decode_all(&bytes[..])?
    } else {
        bytes
    };
    let mut codec = Algorithm::Lz4.codec();
    let limit = StoreConfig::DEFAULT_RAW_THRESHOLD;
    let mut out = vec![0u8; PAGE_SIZE];
    let mut stdout = std::io::BufWriter::new(std::io::stdout().lock());
    for chunk in pages.chunks_exact(PAGE_SIZE) {
        let page: &[u8; PAGE_SIZE] = chunk.try_into()?;
        let first = &page[..8];
        let size = if page.chunks_exact(8).all(|w| w == first) {
            0
        } else {
            let len = codec
                .compress_below(page, &mut out, limit)?
                .unwrap_or(PAGE_SIZE);
            (len + CHECKSUM_BYTES).div_ceil(CLASS_GRANULE) * CLASS_GRANULE
        };
        writeln!(stdout, "{size}")?;
    }
    Ok(())
}

//! uzram's label on a backing device, and what a backing device holds before uzram takes it.
//!
//! `writeback-device` names a path, and a path can be wrong: a partition with a filesystem,
//! a disk, a file of root's (a key, a database) that happens to be mode 0600 with one name.
//! uzram takes a device for a device's writeback only when it is empty (a new file, or its
//! first MiB all zeros) or carries uzram's label in its last block, which uzram writes when
//! it first takes it and keeps out of the store's reach. Anything else is refused, never
//! overwritten. The label is at the end, not the start, so that the blocks an earlier
//! release wrote objects to keep their places (a store it left is taken over with every
//! block), and so that the first MiB, where filesystems, partition tables, swap and volume
//! managers put their signatures, stays where the emptiness check looks.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use uzram_core::store::BLOCK_BYTES;

use super::backing::Aligned;

/// What a backing device held when it was opened: whether uzram may take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// Made here, or its first [`EMPTY_PROBE_BYTES`] (all of it, if smaller) read as zeros.
    Empty,
    /// Its last block carries uzram's label.
    Labelled,
    /// Anything else: a filesystem, a partition table, swap, a file's data.
    Foreign,
    /// Not looked at: opened for a device taken over, whose pages may be on it.
    Unread,
}

/// What a backing device's last block starts with while a device of uzram's may use it.
const LABEL_MAGIC: [u8; 8] = *b"UZRAMWB1";
/// What follows the magic, for whoever finds the device.
const LABEL_NOTE: &[u8] = b"\nuzram writeback device: its other blocks hold pages of a ublk \
device, sealed under a key only its daemon holds. Zero its first MiB and this block before \
using it for anything else.\n";
/// How much of a device without the label must read as zeros for uzram to take it: every
/// common filesystem, partition table, swap and volume signature lies in it.
const EMPTY_PROBE_BYTES: u64 = 1 << 20;

/// What `file`, of `bytes`, holds ([`Found`]): its last whole block is read for the label,
/// and, without one, its first [`EMPTY_PROBE_BYTES`] (every byte of a smaller file, a
/// partial block too) for anything but zeros.
pub(super) fn probe(file: &File, bytes: u64) -> io::Result<Found> {
    const CHUNK: usize = 64 << 10;
    let mut buf = Aligned::new(CHUNK)?;
    if let Some(last) = (bytes / BLOCK_BYTES as u64).checked_sub(1) {
        let block = &mut buf.bytes()[..BLOCK_BYTES];
        file.read_exact_at(block, last * BLOCK_BYTES as u64)?;
        if block.starts_with(&LABEL_MAGIC) {
            return Ok(Found::Labelled);
        }
    }
    let end = EMPTY_PROBE_BYTES.min(bytes);
    let mut at = 0;
    while at < end {
        // Whole blocks, as direct I/O reads them; a file's last partial one comes back short.
        let len = CHUNK.min((end - at).next_multiple_of(BLOCK_BYTES as u64) as usize);
        let chunk = &mut buf.bytes()[..len];
        let n = file.read_at(chunk, at)?;
        if n == 0 {
            break;
        }
        if chunk[..n].iter().any(|&b| b != 0) {
            return Ok(Found::Foreign);
        }
        at += n as u64;
    }
    Ok(Found::Empty)
}

/// Writes the label into block `block` of `file` and syncs it.
pub(super) fn write(file: &File, block: u64) -> io::Result<()> {
    let mut label = Aligned::new(BLOCK_BYTES)?;
    let bytes = label.bytes();
    bytes.fill(0);
    bytes[..LABEL_MAGIC.len()].copy_from_slice(&LABEL_MAGIC);
    bytes[LABEL_MAGIC.len()..LABEL_MAGIC.len() + LABEL_NOTE.len()].copy_from_slice(LABEL_NOTE);
    file.write_all_at(bytes, block * BLOCK_BYTES as u64)?;
    file.sync_data()
}

/// Why the backing device at `path` is not taken, and what to do.
pub(super) fn refusal(path: &Path, partition: bool) -> String {
    let path = path.display();
    let clear = if partition {
        format!("`dd if=/dev/zero of={path} bs=1M count=1`")
    } else {
        format!("`rm {path}` (uzram makes it anew)")
    };
    format!(
        "writeback-device {path} holds data that is not uzram's: its first MiB is not all \
         zeros and its last block carries no uzram label (a filesystem, a partition table, \
         swap, someone's file, or the backing file of a uzram release before labels?). uzram \
         does not overwrite it. If everything on it may go, clear it with {clear} and start \
         again; otherwise name another"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn file(dir: &Path, name: &str, bytes: &[u8], len: u64) -> File {
        let f = std::fs::OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(dir.join(name))
            .unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f.set_len(len.max(bytes.len() as u64)).unwrap();
        f
    }

    /// What the probe calls empty, labelled and foreign: a key file shorter than a block,
    /// a filesystem's signature in its first MiB and a byte in a file's partial last block
    /// are foreign; zeros, sparse or not, are empty; data only beyond the first MiB is not
    /// looked at; the label is found in the last whole block, and only there.
    #[test]
    fn the_probe_tells_empty_labelled_and_foreign_apart() {
        let dir = std::env::temp_dir().join(format!("uzram-label-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let probe_of = |f: &File| probe(f, f.metadata().unwrap().len()).unwrap();

        let key = file(&dir, "key", b"-----BEGIN OPENSSH PRIVATE KEY-----\n", 0);
        assert_eq!(probe_of(&key), Found::Foreign);
        let mut ext4 = vec![0u8; 1082];
        ext4[1080..].copy_from_slice(&[0x53, 0xef]);
        let fs = file(&dir, "fs", &ext4, 8 << 20);
        assert_eq!(probe_of(&fs), Found::Foreign);
        let tail = file(&dir, "tail", &[], 3 * BLOCK_BYTES as u64);
        tail.write_all_at(&[1], 3 * BLOCK_BYTES as u64).unwrap();
        assert_eq!(
            probe_of(&tail),
            Found::Foreign,
            "a byte past the last whole block"
        );

        assert_eq!(probe_of(&file(&dir, "none", &[], 0)), Found::Empty);
        assert_eq!(probe_of(&file(&dir, "sparse", &[], 1 << 30)), Found::Empty);
        let zeros = file(&dir, "zeros", &vec![0u8; 3 << 20], 0);
        assert_eq!(probe_of(&zeros), Found::Empty);
        let late = file(&dir, "late", &[], 4 << 20);
        late.write_all_at(b"data", EMPTY_PROBE_BYTES).unwrap();
        assert_eq!(
            probe_of(&late),
            Found::Empty,
            "past the first MiB: not looked at"
        );

        // Labelled at its last block: taken whatever its first MiB holds.
        let used = file(&dir, "used", &[0xa5; 64 << 10], 16 * BLOCK_BYTES as u64);
        write(&used, 15).unwrap();
        assert_eq!(probe_of(&used), Found::Labelled);
        // The label one block early is not uzram's label of this file.
        let early = file(&dir, "early", &[0xa5; 64 << 10], 16 * BLOCK_BYTES as u64);
        write(&early, 14).unwrap();
        assert_eq!(probe_of(&early), Found::Foreign);
        let mut block = vec![0u8; BLOCK_BYTES];
        used.read_exact_at(&mut block, 15 * BLOCK_BYTES as u64)
            .unwrap();
        assert!(block.starts_with(&LABEL_MAGIC));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

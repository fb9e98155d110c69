//! uzram's label on a backing device, and what a backing device holds before uzram takes it.
//!
//! `writeback-device` names a path, and a path can be wrong: a partition with a filesystem,
//! a disk, a file of root's (a key, a database) that happens to be mode 0600 with one name.
//! uzram takes a device for a device's writeback only when it is empty (a new file, or its
//! first and last MiB all zeros) or carries uzram's label in its last block, which uzram
//! writes when it first takes it and keeps out of the store's reach. Anything else is
//! refused, never overwritten. The label is at the end, not the start, so that the blocks an
//! earlier release wrote objects to keep their places (a store it left is taken over with
//! every block). The emptiness check reads both ends because that is where signatures are:
//! filesystems, partition tables, swap and volume managers put theirs in the first MiB, and
//! RAID members (md's 0.90 and 1.0 superblocks, DDF, Intel's IMSM), GPT's backup header and
//! ZFS's last two labels in the last.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use uzram_core::store::{WritebackKey, BLOCK_BYTES, TAG_BYTES};

use super::backing::Aligned;

/// What a backing device held when it was opened: whether uzram may take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// Made here, or its first and last [`EMPTY_PROBE_BYTES`] (all of it, if smaller) read
    /// as zeros.
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
/// Where in the label's block the key's tag ([`WritebackKey::label_tag`]) is, after
/// [`KEY_MARK`]: a takeover reads it to know the device is the one its pages are on.
const KEY_AT: usize = 1024;
/// What precedes the key's tag; a label an earlier release wrote has zeros there.
const KEY_MARK: [u8; 8] = *b"KEYTAG01";
/// Where the tag itself is.
const TAG_AT: usize = KEY_AT + KEY_MARK.len();
const _: () = assert!(LABEL_MAGIC.len() + LABEL_NOTE.len() <= KEY_AT);
const _: () = assert!(TAG_AT + TAG_BYTES <= BLOCK_BYTES);

/// What a backing device's last block says of the key its pages are sealed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Label {
    /// No uzram label.
    Missing,
    /// uzram's label without a key's tag (an earlier release wrote it).
    Untagged,
    /// uzram's label for the key of this tag.
    Keyed([u8; TAG_BYTES]),
}

/// How much of each end of a device without the label must read as zeros for uzram to take
/// it: every common filesystem, partition table, swap, volume and RAID signature lies in one
/// of them (the furthest from its end, ZFS's labels, within 512 KiB).
const EMPTY_PROBE_BYTES: u64 = 1 << 20;

/// What `file`, of `bytes`, holds ([`Found`]): its last whole block is read for the label,
/// and, without one, its first and last [`EMPTY_PROBE_BYTES`] (every byte of a smaller
/// file, a partial last block too) for anything but zeros.
pub(super) fn probe(file: &File, bytes: u64) -> io::Result<Found> {
    let mut buf = Aligned::new(PROBE_CHUNK)?;
    if let Some(last) = (bytes / BLOCK_BYTES as u64).checked_sub(1) {
        let block = &mut buf.bytes()[..BLOCK_BYTES];
        file.read_exact_at(block, last * BLOCK_BYTES as u64)?;
        if block.starts_with(&LABEL_MAGIC) {
            return Ok(Found::Labelled);
        }
    }
    let head = EMPTY_PROBE_BYTES.min(bytes);
    // From a whole block, as direct I/O reads, where the head ends or earlier.
    let tail = (bytes.saturating_sub(EMPTY_PROBE_BYTES) / BLOCK_BYTES as u64 * BLOCK_BYTES as u64)
        .max(head / BLOCK_BYTES as u64 * BLOCK_BYTES as u64);
    if zeros(file, &mut buf, 0, head)? && zeros(file, &mut buf, tail, bytes)? {
        Ok(Found::Empty)
    } else {
        Ok(Found::Foreign)
    }
}

/// Bytes read at a time by [`probe`].
const PROBE_CHUNK: usize = 64 << 10;

/// Whether bytes `from..to` of `file` read as zeros (`from` a whole block's offset). Reads
/// whole blocks, as direct I/O does; a file's last partial one comes back short.
fn zeros(file: &File, buf: &mut Aligned, from: u64, to: u64) -> io::Result<bool> {
    let mut at = from;
    while at < to {
        let len = PROBE_CHUNK.min((to - at).next_multiple_of(BLOCK_BYTES as u64) as usize);
        let chunk = &mut buf.bytes()[..len];
        let n = file.read_at(chunk, at)?;
        if n == 0 {
            break;
        }
        if chunk[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// Writes the label for `key` into block `block` of `file` and syncs it.
pub(super) fn write(file: &File, block: u64, key: &WritebackKey) -> io::Result<()> {
    let mut label = Aligned::new(BLOCK_BYTES)?;
    let bytes = label.bytes();
    bytes.fill(0);
    bytes[..LABEL_MAGIC.len()].copy_from_slice(&LABEL_MAGIC);
    bytes[LABEL_MAGIC.len()..LABEL_MAGIC.len() + LABEL_NOTE.len()].copy_from_slice(LABEL_NOTE);
    bytes[KEY_AT..KEY_AT + KEY_MARK.len()].copy_from_slice(&KEY_MARK);
    bytes[TAG_AT..TAG_AT + TAG_BYTES].copy_from_slice(&key.label_tag());
    file.write_all_at(bytes, block * BLOCK_BYTES as u64)?;
    file.sync_data()
}

/// Reads block `block` of `file` as a label ([`Label`]).
pub(super) fn read(file: &File, block: u64) -> io::Result<Label> {
    let mut buf = Aligned::new(BLOCK_BYTES)?;
    let bytes = buf.bytes();
    file.read_exact_at(bytes, block * BLOCK_BYTES as u64)?;
    if !bytes.starts_with(&LABEL_MAGIC) {
        return Ok(Label::Missing);
    }
    let mark = &bytes[KEY_AT..KEY_AT + KEY_MARK.len()];
    if mark != KEY_MARK {
        return Ok(Label::Untagged);
    }
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&bytes[TAG_AT..TAG_AT + TAG_BYTES]);
    Ok(Label::Keyed(tag))
}

/// Why the backing device at `path` is not taken, and what to do.
pub(super) fn refusal(path: &Path, partition: bool) -> String {
    let path = path.display();
    let clear = if partition {
        format!(
            "`dd if=/dev/zero of={path} bs=1M count=1 && dd if=/dev/zero of={path} bs=1M \
             count=1 oflag=seek_bytes seek=$(($(blockdev --getsize64 {path}) - 1048576))` \
             (its first and last MiB)"
        )
    } else {
        format!("`rm {path}` (uzram makes it anew)")
    };
    format!(
        "writeback-device {path} holds data that is not uzram's: its first or last MiB is not \
         all zeros and its last block carries no uzram label (a filesystem, a partition table, \
         swap, a RAID member, someone's file, or the backing file of a uzram release before \
         labels?). uzram does not overwrite it. If everything on it may go, clear it with \
         {clear} and start again; otherwise name another"
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
    /// a filesystem's signature in its first MiB, a RAID superblock or GPT's backup header in
    /// its last MiB and a byte in a file's partial last block are foreign; zeros, sparse or
    /// not, are empty; data only between the first and the last MiB is not looked at; the
    /// label is found in the last whole block, and only there.
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
        let middle = file(&dir, "middle", &[], 4 << 20);
        middle.write_all_at(b"data", EMPTY_PROBE_BYTES).unwrap();
        middle.write_all_at(b"data", (3 << 20) - 4).unwrap();
        assert_eq!(
            probe_of(&middle),
            Found::Empty,
            "between the first and the last MiB: not looked at"
        );

        // Signatures at the end, with zeros at the start: an md RAID member (superblock
        // 1.0, 8 KiB from the end; 0.90, 64 KiB below the last 64 KiB boundary), a disk's
        // GPT backup header in its last sector, a byte just past the first MiB of a device
        // under 2 MiB.
        let md_magic = 0xa92b_4efc_u32.to_le_bytes();
        let md10 = file(&dir, "md10", &[], 64 << 20);
        md10.write_all_at(&md_magic, (64 << 20) - (8 << 10))
            .unwrap();
        assert_eq!(probe_of(&md10), Found::Foreign, "md 1.0 superblock");
        let md090 = file(&dir, "md090", &[], (64 << 20) + 12288);
        md090
            .write_all_at(&md_magic, (64 << 20) - (64 << 10))
            .unwrap();
        assert_eq!(probe_of(&md090), Found::Foreign, "md 0.90 superblock");
        let gpt = file(&dir, "gpt", &[], 32 << 20);
        gpt.write_all_at(b"EFI PART", (32 << 20) - 512).unwrap();
        assert_eq!(probe_of(&gpt), Found::Foreign, "GPT backup header");
        let small = file(&dir, "small", &[], 3 << 19);
        small.write_all_at(&[1], EMPTY_PROBE_BYTES + 1).unwrap();
        assert_eq!(
            probe_of(&small),
            Found::Foreign,
            "past the first MiB of 1.5 MiB"
        );

        // Labelled at its last block: taken whatever its first MiB holds.
        let key = WritebackKey([7; 32]);
        let used = file(&dir, "used", &[0xa5; 64 << 10], 16 * BLOCK_BYTES as u64);
        write(&used, 15, &key).unwrap();
        assert_eq!(probe_of(&used), Found::Labelled);
        // Its pages fill its last MiB too: the label decides before the zeros are looked for.
        used.write_all_at(&[0x5a; 8 << 10], 13 * BLOCK_BYTES as u64)
            .unwrap();
        assert_eq!(probe_of(&used), Found::Labelled);
        // The label one block early is not uzram's label of this file.
        let early = file(&dir, "early", &[0xa5; 64 << 10], 16 * BLOCK_BYTES as u64);
        write(&early, 14, &key).unwrap();
        assert_eq!(probe_of(&early), Found::Foreign);
        let mut block = vec![0u8; BLOCK_BYTES];
        used.read_exact_at(&mut block, 15 * BLOCK_BYTES as u64)
            .unwrap();
        assert!(block.starts_with(&LABEL_MAGIC));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A label names its key by a tag that another key does not make, and that does not
    /// give the key away; a label without the tag (an earlier release's) and a block that
    /// is no label are told apart from it.
    #[test]
    fn a_label_names_its_key() {
        let dir = std::env::temp_dir().join(format!("uzram-label-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = WritebackKey([7; 32]);
        let other = WritebackKey([8; 32]);
        assert_ne!(key.label_tag(), other.label_tag());
        assert_eq!(key.label_tag(), WritebackKey([7; 32]).label_tag());
        let f = file(&dir, "wb", &[], 4 * BLOCK_BYTES as u64);
        assert_eq!(read(&f, 3).unwrap(), Label::Missing);
        write(&f, 3, &key).unwrap();
        assert_eq!(read(&f, 3).unwrap(), Label::Keyed(key.label_tag()));
        let mut block = vec![0u8; BLOCK_BYTES];
        f.read_exact_at(&mut block, 3 * BLOCK_BYTES as u64).unwrap();
        assert!(
            !block.windows(8).any(|w| key.0.windows(8).any(|k| k == w)),
            "no part of the key is in the label"
        );
        // An earlier release's label: the magic and the note, nothing where the tag goes.
        f.write_all_at(&[0; 64], (3 * BLOCK_BYTES + KEY_AT) as u64)
            .unwrap();
        assert_eq!(read(&f, 3).unwrap(), Label::Untagged);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

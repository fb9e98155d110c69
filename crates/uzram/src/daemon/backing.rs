//! The device's backing file or partition for writeback (`writeback-device`), opened so that
//! only root can read or change it, and the key its pages are sealed with.
//!
//! - A file that does not exist is created `0600` (never through a symbolic link) and
//!   reserved with `fallocate`, so a file the filesystem cannot hold is refused at once. The
//!   blocks that empty later are punched out and their space goes back to the filesystem
//!   (after a takeover, every block no page uses): a later writeback into them can fail
//!   for want of space if the filesystem filled meanwhile, and its pages then stay in RAM.
//!   An existing file must be a regular file of root's with no access for group or others.
//!   A daemon holds its file locked (`flock`): a second device naming it is refused.
//! - Every directory on the way to it, as named and as it resolves, must be root's and
//!   writable by no one else unless sticky (where no one can rename or remove root's
//!   entries), and every symbolic link on the way root's: otherwise another user could point
//!   the path at another file of root's between two starts. A partition may be named through
//!   such a link (`/dev/disk/by-id/...`); a file may not.
//! - A partition is used whole and opened `O_EXCL`: refused while it is mounted, swap, or
//!   held by anyone else. Its blocks hold only sealed objects; anyone who can read the
//!   partition (group `disk`) sees ciphertext, and a change to it is an I/O error.
//! - **Taken only when empty or uzram's** (`backing_label.rs`). A device gets a backing
//!   device for writeback only when it is a new file, its first and last MiB (all of it, if
//!   smaller) read as zeros, or its last block carries uzram's label: anything else (a
//!   filesystem, a partition table, swap, a RAID member, a file of root's named by mistake)
//!   is refused, not overwritten.
//!   The label is written when a device first gets the backing device, and no object is ever
//!   put in that block; a device taken over keeps what it had without looking (its pages are
//!   there), and one an earlier release made, whose key the store records as unlabelled,
//!   keeps every block.
//! - Direct I/O, so written-back pages do not come back into RAM as page cache. A file on a
//!   filesystem without it (tmpfs, ramfs: RAM anyway) is used through the page cache, with
//!   a warning.
//! - A pass's runs are written through an io_uring of the file's own, all in flight at once
//!   (`write_runs`); where io_uring is refused (a sandbox without it), one after another.
//! - The key is random, made when the device first gets a backing device, and kept only in
//!   the daemon's locked memory and the store's root-only segment (`store_segment.rs`), so
//!   a recovered daemon opens what its predecessor wrote; it is never written to disk.
//! - Each block's nonce floor (why: `uzram_core::store::backing`) lives in a root-only
//!   segment of its own (`floors_segment.rs`, 8 bytes a block), which the store's segment
//!   records, so a recovered daemon refuses blocks rolled back on disk as its predecessor
//!   did.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{bail, Context};
use io_uring::{opcode, types, IoUring};
use uzram_core::store::{
    BackingDevice, BlockRun, Nonces, PageStore, WritebackKey, BLOCK_BYTES, CHECKSUM_BYTES,
    KEY_BYTES, RUNS_IN_FLIGHT, SEAL_BYTES,
};
use uzram_core::PAGE_SIZE;

use super::backing_label::{self, Found};
use crate::config::{DeviceConfig, Host};
use crate::sys::disk;
use crate::takeover::floors_segment::{self, FloorsSegment};
use crate::takeover::store_segment::StoreSegment;
use crate::ublk::uring::wait_again;

/// An open backing file or partition.
pub struct BackingFile {
    file: File,
    path: PathBuf,
    /// Every whole block of the file or partition, the label's included.
    blocks: u64,
    partition: bool,
    /// What it held when opened for a new device.
    found: Found,
    /// Whether its last block is uzram's label, which the store must not use (set by
    /// [`attach`] before the store sees the device).
    labelled: AtomicBool,
    /// The writes' ring; `None` where io_uring is refused, or after it failed.
    ring: Mutex<Option<IoUring>>,
    /// A failed ring left writes in flight whose end was never seen ([`BackingFile::drain`]):
    /// any block may still be overwritten by one, so nothing more is written.
    stranded: AtomicBool,
}

/// How long a failed ring's writes in flight are waited for (a disk's own timeouts and
/// retries end a write well within it).
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

impl std::fmt::Debug for BackingFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackingFile")
            .field("path", &self.path)
            .field("blocks", &self.blocks)
            .field("partition", &self.partition)
            .field("found", &self.found)
            .finish_non_exhaustive()
    }
}

/// Bytes a backing file is made for a device of `pages`: every page written back raw, and
/// the label's block.
pub fn file_bytes(pages: u64) -> u64 {
    let sealed = (PAGE_SIZE + CHECKSUM_BYTES + SEAL_BYTES) as u64;
    (pages * sealed).div_ceil(BLOCK_BYTES as u64) * BLOCK_BYTES as u64 + BLOCK_BYTES as u64
}

impl BackingFile {
    /// Opens (or creates, for a file) the backing device at `path` for a new device of
    /// `pages`: a file too small for them grows, and what the device holds is looked at
    /// ([`Found`]) before anything is written.
    pub fn open(path: &Path, pages: u64) -> anyhow::Result<Self> {
        Self::open_for(path, pages, true)
    }

    /// Opens the backing device at `path` of a device of `pages` taken over: as
    /// [`BackingFile::open`], but nothing is read, and an existing file keeps its size
    /// (the store's records of its blocks were made for that size).
    pub fn reopen(path: &Path, pages: u64) -> anyhow::Result<Self> {
        Self::open_for(path, pages, false)
    }

    fn open_for(path: &Path, pages: u64, new: bool) -> anyhow::Result<Self> {
        let (path, found) = look_at(path)?;
        let path = path.as_path();
        match found {
            Kind::Missing => Self::create(path, pages),
            Kind::Partition => Self::partition(path, new),
            Kind::File(meta) => Self::existing_file(path, &meta, pages, new),
        }
    }

    fn create(path: &Path, pages: u64) -> anyhow::Result<Self> {
        let file = open(path, true, false)
            .with_context(|| format!("creating the backing file {}", path.display()))?;
        hold(&file, path, true)?;
        let bytes = file_bytes(pages);
        if let Err(e) = reserve(&file, path, bytes) {
            let _ = std::fs::remove_file(path);
            return Err(e).with_context(|| {
                format!(
                    "reserving {bytes} bytes for the backing file {} (free that much space, or \
                     name a partition)",
                    path.display()
                )
            });
        }
        tracing::info!(path = %path.display(), bytes, "backing file created");
        Ok(Self::new(
            file,
            path,
            bytes / BLOCK_BYTES as u64,
            false,
            Found::Empty,
        ))
    }

    fn existing_file(
        path: &Path,
        meta: &std::fs::Metadata,
        pages: u64,
        new: bool,
    ) -> anyhow::Result<Self> {
        check_private(path, meta)?;
        let file = open(path, false, false)
            .with_context(|| format!("opening the backing file {}", path.display()))?;
        // Checked again on what was opened: the name may have been changed in between.
        check_private(path, &file.metadata()?)?;
        hold(&file, path, new)?;
        if !new {
            let bytes = file.metadata()?.len();
            return Ok(Self::new(
                file,
                path,
                bytes / BLOCK_BYTES as u64,
                false,
                Found::Unread,
            ));
        }
        // Before it grows: a label is in the last block of the size it was.
        let found = backing_label::probe(&file, file.metadata()?.len())
            .with_context(|| format!("reading the backing file {}", path.display()))?;
        let want = file_bytes(pages);
        if found != Found::Foreign && file.metadata()?.len() < want {
            reserve(&file, path, want).with_context(|| {
                format!(
                    "growing the backing file {} to {want} bytes",
                    path.display()
                )
            })?;
        }
        let bytes = file.metadata()?.len();
        Ok(Self::new(
            file,
            path,
            bytes / BLOCK_BYTES as u64,
            false,
            found,
        ))
    }

    fn partition(path: &Path, new: bool) -> anyhow::Result<Self> {
        let file = open(path, false, true).with_context(|| {
            format!(
                "opening the partition {} for writeback (it must not be mounted, swap, or in \
                 use)",
                path.display()
            )
        })?;
        let bytes = disk::block_device_bytes(file.as_fd())
            .with_context(|| format!("sizing {}", path.display()))?;
        let blocks = bytes / BLOCK_BYTES as u64;
        let found = if new {
            backing_label::probe(&file, bytes)
                .with_context(|| format!("reading {}", path.display()))?
        } else {
            Found::Unread
        };
        Ok(Self::new(file, path, blocks, true, found))
    }

    fn new(file: File, path: &Path, blocks: u64, partition: bool, found: Found) -> Self {
        let ring = match IoUring::new(RUNS_IN_FLIGHT as u32) {
            Ok(ring) => Some(ring),
            Err(e) => {
                tracing::warn!(error = %e, "no io_uring for writeback: runs are written one at a time");
                None
            }
        };
        Self {
            file,
            path: path.to_path_buf(),
            blocks,
            partition,
            found,
            labelled: AtomicBool::new(false),
            ring: Mutex::new(ring),
            stranded: AtomicBool::new(false),
        }
    }

    /// Takes the device for a device's writeback with its first key, `key`: refused unless
    /// it was empty or uzram's ([`Found`]); then its last block is written with the label
    /// for `key` and kept out of the store's reach.
    pub fn label(&self, key: &WritebackKey) -> anyhow::Result<()> {
        let path = self.path.display();
        let found = match self.found {
            Found::Unread => {
                let bytes = if self.partition {
                    self.blocks * BLOCK_BYTES as u64
                } else {
                    self.file.metadata()?.len()
                };
                backing_label::probe(&self.file, bytes)
                    .with_context(|| format!("reading the backing device {path}"))?
            }
            found => found,
        };
        if found == Found::Foreign {
            bail!(backing_label::refusal(&self.path, self.partition));
        }
        let Some(last) = self.label_block() else {
            bail!(
                "writeback-device {path} has room for no page beside uzram's label: it needs \
                 at least two blocks of {BLOCK_BYTES} bytes"
            );
        };
        backing_label::write(&self.file, last, key)
            .with_context(|| format!("writing uzram's label to the backing device {path}"))?;
        self.labelled.store(true, Ordering::Release);
        Ok(())
    }

    /// For a device taken over whose pages were written back under `key` to a labelled
    /// device: refuses the device `writeback-device` names now unless its label is for
    /// `key`, before anything on it is touched (the takeover gives back every block no page
    /// uses, which on another device would be its data). A label an earlier release wrote,
    /// without a key's tag, is taken and given the tag.
    fn check_label(&self, key: &WritebackKey) -> anyhow::Result<()> {
        let path = self.path.display();
        let wrong = "Nothing on it was touched. Start the device with the writeback-device its                      pages were written to (see `uzram status` before the change, or the config                      it was made with), or destroy the device and make it anew";
        let Some(last) = self.label_block() else {
            bail!(
                "writeback-device {path} is too small to be the backing device this device's                  pages were written to. {wrong}"
            );
        };
        let label = backing_label::read(&self.file, last)
            .with_context(|| format!("reading the label of the backing device {path}"))?;
        match label {
            backing_label::Label::Keyed(tag) if tag == key.label_tag() => Ok(()),
            backing_label::Label::Keyed(_) => bail!(
                "writeback-device {path} is not the backing device this device's pages were                  written to: its label is another uzram device's (another device's backing                  file, or a path that now names another disk). {wrong}"
            ),
            backing_label::Label::Missing => bail!(
                "writeback-device {path} is not the backing device this device's pages were                  written to: its last block carries no uzram label (the setting changed, or                  the path now names another disk). {wrong}"
            ),
            backing_label::Label::Untagged => {
                backing_label::write(&self.file, last, key).with_context(|| {
                    format!("writing uzram's label to the backing device {path}")
                })?;
                tracing::info!(path = %path, "the backing device's label now names its key");
                Ok(())
            }
        }
    }

    /// The block uzram's label lives in: the last, where the device has another beside it
    /// for pages.
    fn label_block(&self) -> Option<u64> {
        self.blocks.checked_sub(1).filter(|&last| last > 0)
    }

    /// Writes `runs` through `ring`, all submitted at once; fills `failed`. `Err`: the ring
    /// itself failed (the runs it did not complete are marked failed with that error).
    fn write_through(
        &self,
        ring: &mut IoUring,
        runs: &[BlockRun<'_>],
        failed: &mut [Option<io::Error>],
    ) -> io::Result<()> {
        let fd = types::Fd(self.file.as_raw_fd());
        let mut pending = 0u32;
        for (i, run) in runs.iter().enumerate() {
            let Ok(len) = u32::try_from(run.data.len()) else {
                failed[i] = Some(io::Error::from(io::ErrorKind::InvalidInput));
                continue;
            };
            let write = opcode::Write::new(fd, run.data.as_ptr(), len)
                .offset(run.first * BLOCK_BYTES as u64)
                .build()
                .user_data(i as u64);
            // SAFETY: the run's bytes stay borrowed (and unchanged) until this function
            // returns, and it returns only once every submitted write completed (or the
            // ring failed, see below). The queue has RUNS_IN_FLIGHT entries, no more runs.
            if unsafe { ring.submission().push(&write) }.is_err() {
                failed[i] = Some(io::Error::other("the writeback ring is full"));
                continue;
            }
            pending |= 1 << i;
        }
        while pending != 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if wait_again(&e) => {}
                Err(e) => {
                    for (i, f) in failed.iter_mut().enumerate() {
                        if pending & (1 << i) != 0 {
                            *f = Some(io::Error::new(e.kind(), e.to_string()));
                        }
                    }
                    self.drain(ring, &mut pending);
                    return Err(e);
                }
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                let Some(run) = runs.get(i) else { continue };
                pending &= !(1 << i);
                let res = cqe.result();
                if res < 0 {
                    failed[i] = Some(io::Error::from_raw_os_error(-res));
                } else if (res as usize) < run.data.len() {
                    // Short (rare with direct I/O): the rest, synchronously.
                    let done = res as usize;
                    if let Err(e) = self.file.write_all_at(
                        &run.data[done..],
                        run.first * BLOCK_BYTES as u64 + done as u64,
                    ) {
                        failed[i] = Some(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// After the ring failed: waits for the writes it still has in flight, reading its
    /// completions from the shared ring (no `io_uring_enter`: they post as this thread
    /// returns from its sleeps). Their runs count as failed, and their blocks are free again:
    /// a write of a later pass to one of them must not be overtaken by an old write landing
    /// after it (the page it holds would then fail its check, lost). Writes still out after
    /// [`DRAIN_WAIT`] leave the device refusing writes until the daemon restarts.
    fn drain(&self, ring: &mut IoUring, pending: &mut u32) {
        let start = std::time::Instant::now();
        while *pending != 0 && start.elapsed() < DRAIN_WAIT {
            for cqe in ring.completion() {
                *pending &= !(1u32.checked_shl(cqe.user_data() as u32).unwrap_or(0));
            }
            if *pending != 0 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        if *pending != 0 {
            tracing::error!(
                writes = pending.count_ones(),
                "writes of the failed writeback ring are still in flight: the backing device \
                 takes no more writes until the daemon restarts (pages stay in memory)"
            );
            self.stranded.store(true, Ordering::Release);
        }
    }
}

/// Locks a backing file for as long as this process has it open (an exclusive `flock`, which
/// the kernel drops when the process exits, however it exits), so that two devices never
/// write into one file: a new device is refused while another daemon holds it (a partition
/// gets the same from `O_EXCL`). A device taken over takes the lock as it finds it: its
/// predecessor is gone, and its pages are in the file whoever else holds it (warned).
fn hold(file: &File, path: &Path, new: bool) -> anyhow::Result<()> {
    match crate::sys::try_lock_exclusive(file) {
        Ok(true) => Ok(()),
        Ok(false) if new => bail!(
            "writeback-device {} is in use by another uzram device (its daemon holds it): give \
             each device a backing file of its own",
            path.display()
        ),
        Ok(false) => {
            tracing::warn!(
                path = %path.display(),
                "another process holds the backing file of the device taken over: its pages are \
                 there, so it is kept; no new device can take it while either holds it"
            );
            Ok(())
        }
        // A filesystem without flock (some network ones): two devices could share the file.
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "the backing file cannot be locked: nothing keeps another device from naming it"
            );
            Ok(())
        }
    }
}

/// Reserves `bytes` for a backing file; on a filesystem that cannot (ramfs), sizes it
/// sparse instead, with a warning: a writeback may then fail for want of space (the pages
/// stay in RAM).
fn reserve(file: &File, path: &Path, bytes: u64) -> io::Result<()> {
    match disk::allocate(file.as_fd(), bytes) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            tracing::warn!(
                path = %path.display(),
                "the backing file's filesystem cannot reserve space: it is sized sparse"
            );
            file.set_len(bytes)
        }
        other => other,
    }
}

/// Opens `path` read-write, never through a symbolic link: created `0600` (and refused if
/// it appeared meanwhile) when `create`, `O_EXCL` on a block device when `exclusive`. Direct
/// I/O where the filesystem has it.
fn open(path: &Path, create: bool, exclusive: bool) -> io::Result<File> {
    let attempt = |direct: bool| {
        let mut flags = libc::O_NOFOLLOW | libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        if exclusive {
            flags |= libc::O_EXCL;
        }
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true).custom_flags(flags);
        if create {
            o.create_new(true).mode(0o600);
        }
        o.open(path)
    };
    match attempt(true) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            if create {
                // create_new made the file before O_DIRECT was refused.
                let _ = std::fs::remove_file(path);
            }
            tracing::warn!(
                path = %path.display(),
                "the backing file's filesystem has no direct I/O: written-back pages also \
                 pass through the page cache"
            );
            attempt(false)
        }
        other => other,
    }
}

use crate::sys::changed_by_others;

/// What a `writeback-device` path names, once its way there is checked.
enum Kind {
    /// Nothing yet: a file is made there.
    Missing,
    /// A block device.
    Partition,
    /// A regular file, as found.
    File(std::fs::Metadata),
}

/// The path to open for `writeback-device = path` and what is there, or why it cannot be
/// one: not absolute, a way another user could change, something neither a regular file
/// nor a block device, or a name under `/dev` that is no device (a file there would live
/// in RAM).
fn look_at(path: &Path) -> anyhow::Result<(PathBuf, Kind)> {
    if !path.is_absolute() {
        bail!(
            "writeback-device {} is not an absolute path",
            path.display()
        );
    }
    let resolved = resolve_roots_path(path)?;
    let kind = match std::fs::symlink_metadata(&resolved) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && resolved.starts_with("/dev") => bail!(
            "writeback-device {}: no such device (a file under /dev would live in RAM): name \
             a partition that exists, or a file on a disk",
            path.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Kind::Missing,
        Err(e) => return Err(e).with_context(|| format!("looking at {}", resolved.display())),
        Ok(meta) if meta.file_type().is_block_device() => Kind::Partition,
        Ok(meta) if meta.file_type().is_file() => Kind::File(meta),
        Ok(meta) => bail!(
            "writeback-device {} is {}, neither a regular file nor a block device (a symbolic \
             link is not followed): name the file or partition itself",
            path.display(),
            crate::sys::owned_file::file_kind(&meta.file_type())
        ),
    };
    Ok((resolved, kind))
}

/// What the daemon checks of `writeback-device = path` before it opens it, without opening
/// or reading anything: for `uzram check-config`. A file found there must be root's alone.
pub fn precheck(path: &Path) -> anyhow::Result<()> {
    match look_at(path)? {
        (found, Kind::File(meta)) => check_private(&found, &meta),
        _ => Ok(()),
    }
}

/// Checks every directory and link on the way to `path`, as named and as it resolves
/// (`changed_by_others`, see the module docs), and returns the path to open: `path` with
/// its directories resolved, or, where `path` itself is a link of root's to a block device
/// (`/dev/disk/by-id/...`), that device.
fn resolve_roots_path(path: &Path) -> anyhow::Result<PathBuf> {
    let refuse = |on_way: &Path, why: String| {
        anyhow::anyhow!(
            "writeback-device {}: {} on the way to it {why}, so another user could point it \
             at another file; use a directory only root can write (e.g. /var/lib/uzram)",
            path.display(),
            on_way.display()
        )
    };
    let check_ancestors = |of: &Path| -> anyhow::Result<()> {
        match crate::sys::ancestor_changed_by_others(of)? {
            Some((dir, why)) => Err(refuse(&dir, why)),
            None => Ok(()),
        }
    };
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        bail!("writeback-device {} names no file", path.display());
    };
    check_ancestors(path)?;
    let parent =
        std::fs::canonicalize(parent).with_context(|| format!("resolving {}", parent.display()))?;
    let named = parent.join(name);
    check_ancestors(&named)?;
    let Ok(meta) = std::fs::symlink_metadata(&named) else {
        return Ok(named); // not there yet: made, never through a link
    };
    if !meta.file_type().is_symlink() {
        return Ok(named);
    }
    if let Some(why) = changed_by_others(&meta) {
        return Err(refuse(&named, why));
    }
    let target =
        std::fs::canonicalize(&named).with_context(|| format!("resolving {}", named.display()))?;
    if !std::fs::metadata(&target).is_ok_and(|m| m.file_type().is_block_device()) {
        // A file is named itself: `open` refuses the link.
        return Ok(named);
    }
    check_ancestors(&target)?;
    Ok(target)
}

/// A backing file must be root's alone: swap's pages go there. A second name for it (a hard
/// link someone made elsewhere to a root file, e.g. in a shared directory before the
/// daemon's first start) is refused: writeback would overwrite that file.
fn check_private(path: &Path, meta: &std::fs::Metadata) -> anyhow::Result<()> {
    if !meta.file_type().is_file() {
        bail!("{} is not a regular file", path.display());
    }
    if meta.nlink() != 1 {
        bail!(
            "the backing file {} has {} names (hard links): it may be another file of \
             root's; remove it and let uzram create it",
            path.display(),
            meta.nlink()
        );
    }
    if meta.uid() != 0 || meta.mode() & 0o077 != 0 {
        bail!(
            "the backing file {} is owned by uid {} with mode {:o}: only root may read or \
             write it (chown root:root and chmod 600 it, or remove it and let uzram create it)",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

impl BackingDevice for BackingFile {
    /// The label's block is not the store's.
    fn blocks(&self) -> u64 {
        self.blocks - u64::from(self.labelled.load(Ordering::Acquire))
    }

    fn write_runs(&self, runs: &[BlockRun<'_>], failed: &mut [Option<io::Error>]) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        if self.stranded.load(Ordering::Acquire) {
            for f in failed.iter_mut().take(runs.len()) {
                *f = Some(io::Error::other(
                    "the backing device takes no writes: a failed ring's writes may still land \
                     (restart the daemon)",
                ));
            }
            return;
        }
        if let Some(r) = ring.as_mut() {
            if let Err(e) = self.write_through(r, runs, failed) {
                // Its writes in flight were waited for (`drain`): the runs they were count
                // as failed, and their blocks may be written again.
                tracing::warn!(error = %e, "the writeback ring failed: runs are written one at a time from now");
                *ring = None;
            }
            return;
        }
        for (run, failed) in runs.iter().zip(failed) {
            if let Err(e) = self
                .file
                .write_all_at(run.data, run.first * BLOCK_BYTES as u64)
            {
                *failed = Some(e);
            }
        }
    }

    /// On the I/O path (a read of a written-back page): the bounce buffer is the thread's
    /// own, made once, so a read allocates nothing.
    fn read_blocks(&self, first: u64, out: &mut [u8]) -> io::Result<()> {
        READ_BUF.with(|cell| {
            let mut slot = cell.borrow_mut();
            let buf = match &mut *slot {
                Some(b) if b.capacity() >= out.len() => b,
                other => other.insert(Aligned::new(out.len().max(READ_BUF_BYTES))?),
            };
            let bytes = &mut buf.bytes()[..out.len()];
            self.file.read_exact_at(bytes, first * BLOCK_BYTES as u64)?;
            out.copy_from_slice(bytes);
            Ok(())
        })
    }

    /// One NOP through the ring from the calling thread, which the kernel then knows.
    fn prepare_thread(&self) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(r) = ring.as_mut() else { return };
        let nop = opcode::Nop::new().build().user_data(u64::MAX);
        // SAFETY: a NOP refers to no memory; the ring is idle (its lock is held, and a pass
        // drains it before it lets go).
        if unsafe { r.submission().push(&nop) }.is_err() {
            return;
        }
        loop {
            match r.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if wait_again(&e) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "readying a thread for the writeback ring failed");
                    break;
                }
            }
        }
        for _ in r.completion() {}
    }

    /// The queue threads read written-back pages through their own rings
    /// (`ublk/disk_reads.rs`), from block-aligned buffers as direct I/O needs.
    fn fd(&self) -> Option<i32> {
        Some(self.file.as_raw_fd())
    }

    fn release(&self, first: u64, count: u64) -> io::Result<()> {
        let (at, len) = (first * BLOCK_BYTES as u64, count * BLOCK_BYTES as u64);
        let done = if self.partition {
            disk::discard(self.file.as_fd(), at, len)
        } else {
            disk::punch_hole(self.file.as_fd(), at, len)
        };
        match done {
            // A device or filesystem that cannot free blocks still works: they are
            // overwritten when taken again.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            other => other,
        }
    }
}

/// A read's blocks: one object touches at most three.
const READ_BUF_BYTES: usize = 3 * BLOCK_BYTES;

thread_local! {
    static READ_BUF: std::cell::RefCell<Option<Aligned>> = const { std::cell::RefCell::new(None) };
}

/// A block-aligned buffer (direct I/O needs one), carved out of a slightly larger vector.
pub(super) struct Aligned {
    vec: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    pub(super) fn new(len: usize) -> io::Result<Self> {
        let mut vec = Vec::new();
        vec.try_reserve_exact(len + BLOCK_BYTES)
            .map_err(|_| io::Error::from(io::ErrorKind::OutOfMemory))?;
        vec.resize(len + BLOCK_BYTES, 0);
        let start = vec.as_ptr().align_offset(BLOCK_BYTES);
        Ok(Self { vec, start, len })
    }

    fn capacity(&self) -> usize {
        self.len
    }

    pub(super) fn bytes(&mut self) -> &mut [u8] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

/// Opens the backing device `cfg` names (none: `None`) for a device of `pages` pages, and
/// checks the locked records its blocks cost against what the host (`host`, as read) can
/// hold ([`DeviceConfig::check_backing_memory`]): a partition may have far more blocks than
/// the device has pages, which the configuration alone could not tell. A new device is
/// refused when they do not fit; a device `taken_over` keeps its backing device whatever it
/// costs (and whether or not the host's memory could be read), with a warning, for its
/// pages are there.
pub fn open_configured(
    cfg: &DeviceConfig,
    host: Result<Host, crate::config::ConfigError>,
    pages: u64,
    taken_over: bool,
) -> anyhow::Result<Option<Arc<BackingFile>>> {
    let Some(settings) = &cfg.writeback else {
        return Ok(None);
    };
    let file = if taken_over {
        BackingFile::reopen(&settings.device, pages)?
    } else {
        BackingFile::open(&settings.device, pages)?
    };
    let fits = host.and_then(|host| cfg.check_backing_memory(host, file.blocks));
    if let Err(error) = fits {
        if !taken_over {
            return Err(error)
                .with_context(|| format!("writeback-device {}", settings.device.display()));
        }
        tracing::warn!(
            path = %settings.device.display(),
            %error,
            "the backing device's records do not pass the memory check a new device must (or it \
             could not run); kept, since the device taken over has pages on it"
        );
    }
    Ok(Some(Arc::new(file)))
}

/// Attaches the backing device `file` (from [`open_configured`]) to `store` with the key its region
/// keeps (a new random one, recorded there, when it has none). A store that has pages
/// written back but no backing device configured is refused: they would all fail.
pub fn attach(
    store: &PageStore,
    region: &StoreSegment,
    file: Option<Arc<BackingFile>>,
) -> anyhow::Result<()> {
    let Some(file) = file else {
        let backed = store.stats().bd_count;
        if backed > 0 {
            bail!(
                "the preserved store has {backed} pages on a backing device, and this \
                 device's settings name none: start it with its writeback-device"
            );
        }
        return Ok(());
    };
    let (key, next) = match region.writeback_key() {
        Some(kept) => {
            if kept.labelled {
                file.check_label(&kept.key)?;
            }
            file.labelled.store(kept.labelled, Ordering::Release);
            (kept.key, kept.next)
        }
        None => {
            let key = new_key()?;
            file.label(&key)?;
            let nonces = region.set_writeback_key(&key);
            (key, nonces)
        }
    };
    let floors = kept_floors(region, BackingDevice::blocks(&*file))?;
    let nonces = Nonces::Kept {
        next,
        floors: floors.floors(),
    };
    let adopted = store
        .attach_backing(file.clone(), &key, nonces)
        .with_context(|| format!("attaching the backing device {}", file.path.display()))?;
    tracing::info!(
        path = %file.path.display(),
        blocks = file.blocks,
        partition = file.partition,
        adopted,
        "writeback to the backing device"
    );
    Ok(())
}

/// The backing device's nonce floors (`floors_segment.rs`): the ones the store's region
/// records, or new ones, recorded there. Recorded floors that cannot be taken over (not a
/// floors segment, or for another size of device) are replaced by zeroed ones, with a
/// warning: every sealing on the device then opens again until its block is written anew,
/// as before floors existed; a store of a daemon that kept none gets zeroed ones too.
fn kept_floors(region: &StoreSegment, blocks: u64) -> anyhow::Result<FloorsSegment> {
    if let Some(id) = region.floors() {
        match FloorsSegment::attach(id, blocks) {
            Ok(floors) => return Ok(floors),
            // Short of memory now: the takeover fails, the floors stay for the next try.
            Err(error) if error.is_for_now() => {
                return Err(error).context("taking over the backing device's nonce floors")
            }
            Err(error) => {
                tracing::warn!(
                    id,
                    %error,
                    "the recorded nonce floors cannot be taken over: blocks rolled back on disk \
                     to an older sealing open until they are written again"
                );
                region.set_floors(None);
                floors_segment::remove(id);
            }
        }
    }
    let floors = FloorsSegment::create(blocks)
        .context("creating the shared memory for the backing device's nonce floors")?;
    region.set_floors(Some(floors.id()));
    Ok(floors)
}

/// How often the release thread gives emptied blocks back.
const RELEASE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The release thread (`uzram-release`): every second, gives the space of written-back
/// blocks that emptied back to the backing device (a hole punched, a discard). A thread of
/// its own, because a discard can wait long for the block layer's reserve of bios, which
/// under memory pressure swap writes to this very device hold: on a queue thread it stalled
/// the device, and on the room thread it held up the room a waiting write needs for 12 s
/// (guest scenario l, 71 writes failed). Nothing waits for this thread. Never returns.
///
/// In a daemon that took a store over (`recovered`), it first marks every block no page
/// uses: the dead daemon gave emptied blocks back once a second, so those of its last
/// second would otherwise keep their space and ciphertext until taken again. Here, not in
/// the takeover, because the scan covers every block of the device and the takeover's
/// pause holds the device's I/O.
pub fn keep_releasing(store: Arc<PageStore>, recovered: bool) {
    if recovered {
        let unused = store.mark_unused_blocks_for_release();
        tracing::info!(
            blocks = unused,
            "blocks of the backing device that no page uses after the takeover: to be given back"
        );
    }
    loop {
        std::thread::sleep(RELEASE_EVERY);
        let n = store.release_freed_blocks();
        if n > 0 {
            tracing::debug!(blocks = n, "written-back blocks released");
        }
    }
}

/// A new random device key.
pub fn new_key() -> anyhow::Result<WritebackKey> {
    let mut key = [0u8; KEY_BYTES];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .context("reading a writeback key from /dev/urandom")?;
    Ok(WritebackKey(key))
}

/// A store of `pages` pages with `limit`, writing back to a new file in `dir` (tests).
#[cfg(test)]
pub(crate) fn file_backed_store(dir: &Path, pages: u64, limit: Option<u64>) -> PageStore {
    let mut cfg = uzram_core::StoreConfig::new(pages, uzram_core::codec::Algorithm::Lz4);
    cfg.mem_limit = limit;
    let store = PageStore::new(cfg).unwrap();
    let file = BackingFile::open(&dir.join("wb"), pages).unwrap();
    let key = new_key().unwrap();
    store
        .attach_backing(Arc::new(file), &key, Nonces::Owned)
        .unwrap();
    store
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A new store of `pages` in a region of its own; `None` (said) where the host cannot
    /// lock segments (containers without CAP_IPC_LOCK).
    fn store_of(pages: u64) -> Option<(PageStore, StoreSegment)> {
        use uzram_core::codec::Algorithm;
        use uzram_core::store::StoreConfig;
        let cfg = StoreConfig::new(pages, Algorithm::Lz4);
        let region =
            crate::daemon::store::new_region(&cfg, crate::footprint::MIN_ROOM, u32::MAX, true)
                .inspect_err(|e| println!("SKIP: {e:#}"))
                .ok()?;
        let store = crate::daemon::store::new_store(cfg, &region).unwrap();
        Some((store, region))
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("uzram-backing-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A thread readied for the ring (a NOP through it) writes through it as before: the
    /// NOP's completion is gone when the pass looks at the ring.
    #[test]
    fn a_readied_thread_writes_through_the_ring() {
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let dir = scratch("ready");
        let f = Arc::new(BackingFile::open(&dir.join("wb"), 64).unwrap());
        let writer = f.clone();
        std::thread::spawn(move || {
            writer.prepare_thread();
            writer.prepare_thread();
            let mut block = Aligned::new(BLOCK_BYTES).unwrap();
            block.bytes().fill(0x3c);
            let mut failed: [Option<io::Error>; 1] = Default::default();
            writer.write_runs(
                &[BlockRun {
                    first: 3,
                    data: block.bytes(),
                }],
                &mut failed,
            );
            assert!(failed[0].is_none(), "{:?}", failed[0]);
        })
        .join()
        .unwrap();
        let mut back = vec![0u8; BLOCK_BYTES];
        f.read_blocks(3, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0x3c));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A backing device with far more blocks than the device has pages (here a sparse file
    /// of 1 TiB behind a 64 MiB device, as a large partition would be) costs 3 GiB of
    /// locked records: a new device on a host of 8 GiB is refused with what to do, and a
    /// device taken over keeps it.
    #[test]
    fn a_backing_device_whose_records_the_host_cannot_hold_is_refused_for_a_new_device() {
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let dir = scratch("huge");
        let path = dir.join("wb");
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&path)
            .unwrap();
        file.set_len(1 << 40).unwrap();
        drop(file);
        let cfg = |path: &Path| {
            crate::config::RawDevice {
                size: "64M".into(),
                writeback_device: Some(path.to_path_buf()),
                ..Default::default()
            }
            .validate(Host::with_ram(8192))
            .expect("64 MiB with a backing file fits 8 GiB")
        };
        let host = Host::with_ram(8192);
        let pages = (64 << 20) / PAGE_SIZE as u64;
        let err = open_configured(&cfg(&path), Ok(host), pages, false)
            .expect_err("1 TiB of blocks on 8 GiB");
        let text = format!("{err:#}");
        assert!(text.contains("smaller partition"), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
        let kept = open_configured(&cfg(&path), Ok(host), pages, true)
            .expect("a device taken over keeps it");
        assert_eq!(kept.unwrap().blocks, (1 << 40) / BLOCK_BYTES as u64);
        // So does one whose host's memory could not be read; a new device is refused.
        let unknown = || Err(crate::config::ConfigError::MemInfo);
        assert!(open_configured(&cfg(&path), unknown(), pages, true).is_ok());
        assert!(open_configured(&cfg(&path), unknown(), pages, false).is_err());
        // The same file on a host of 64 GiB fits; and a file made for the device always does.
        assert!(open_configured(&cfg(&path), Ok(Host::with_ram(65536)), pages, false).is_ok());
        let made = dir.join("made");
        let small = open_configured(&cfg(&made), Ok(host), pages, false)
            .unwrap()
            .unwrap();
        assert_eq!(small.blocks, file_bytes(pages) / BLOCK_BYTES as u64);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The mistake the label guards against, tried through [`attach`] as a new device takes
    /// its backing device: a key file of root's (0600, one name) and a file holding a
    /// filesystem are refused, left byte for byte as they were, and no key is made; an empty
    /// file is taken and labelled, its label's block kept from the store, and taken again
    /// after use and when it grows; a store an earlier release left (its key unlabelled)
    /// keeps every block without a look, and a device taken over that has no key yet is
    /// looked at as a new one.
    #[test]
    fn a_backing_device_holding_data_that_is_not_uzrams_is_refused_and_left_alone() {
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let pages = 64;
        let fresh = || store_of(pages);
        // Containers without CAP_IPC_LOCK cannot lock segments.
        let Some((_, region)) = fresh() else { return };
        crate::takeover::store_segment::remove(region.id());
        let dir = scratch("label");
        let attach_new = |path: &Path| {
            let (store, region) = fresh().unwrap();
            let file = Arc::new(BackingFile::open(path, pages)?);
            let done = attach(&store, &region, Some(file.clone()));
            let keyed = region.writeback_key().is_some();
            crate::takeover::store_segment::remove(region.id());
            assert_eq!(
                keyed,
                done.is_ok(),
                "a key is made exactly for a device taken"
            );
            done.map(|()| file)
        };
        let planted = |name: &str, bytes: &[u8], len: u64| {
            let path = dir.join(name);
            let f = std::fs::OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&path)
                .unwrap();
            f.write_all_at(bytes, 0).unwrap();
            f.set_len(len.max(bytes.len() as u64)).unwrap();
            path
        };

        let key = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU=\n";
        let mut ext4 = vec![0u8; 1082];
        ext4[1080..].copy_from_slice(&[0x53, 0xef]);
        for (name, bytes, len) in [("id_ed25519", &key[..], 0), ("fs.img", &ext4[..], 4 << 20)] {
            let path = planted(name, bytes, len);
            let before = std::fs::read(&path).unwrap();
            let err = format!("{:#}", attach_new(&path).unwrap_err());
            assert!(err.contains("not uzram's") && err.contains("rm "), "{err}");
            assert_eq!(std::fs::read(&path).unwrap(), before, "{name} was changed");
        }

        // Empty (as `truncate` leaves it): taken, grown, labelled.
        let path = planted("wb", &[], 4096);
        let file = attach_new(&path).expect("an empty file is taken");
        let total = std::fs::metadata(&path).unwrap().len() / BLOCK_BYTES as u64;
        assert_eq!(total, file_bytes(pages) / BLOCK_BYTES as u64);
        assert_eq!(
            BackingDevice::blocks(&*file),
            total - 1,
            "the label's block"
        );
        let label = |path: &Path, block: u64| {
            let mut b = vec![0u8; BLOCK_BYTES];
            File::open(path)
                .unwrap()
                .read_exact_at(&mut b, block * BLOCK_BYTES as u64)
                .unwrap();
            b.starts_with(b"UZRAMWB1")
        };
        assert!(label(&path, total - 1));
        // Used (ciphertext in its first blocks), then taken again by a new device.
        let mut run = Aligned::new(4 * BLOCK_BYTES).unwrap();
        run.bytes().fill(0xa5);
        let mut failed: [Option<io::Error>; 1] = Default::default();
        file.write_runs(
            &[BlockRun {
                first: 0,
                data: run.bytes(),
            }],
            &mut failed,
        );
        assert!(failed[0].is_none(), "{:?}", failed[0]);
        drop(file);
        attach_new(&path).expect("a labelled file is taken again");
        // A device four times the size: the file grows, the label goes to its new end.
        let (store, region) = fresh().unwrap();
        let big = Arc::new(BackingFile::open(&path, pages * 4).unwrap());
        attach(&store, &region, Some(big.clone())).expect("a labelled file grows");
        let grown = std::fs::metadata(&path).unwrap().len() / BLOCK_BYTES as u64;
        assert!(grown > total && label(&path, grown - 1));
        assert_eq!(BackingDevice::blocks(&*big), grown - 1);
        crate::takeover::store_segment::remove(region.id());

        // A store an earlier release left: its key unlabelled, every block the store's, and
        // the file (here a foreign one) neither read nor refused.
        let fs = dir.join("fs.img");
        let (store, region) = fresh().unwrap();
        region.set_writeback_key(&new_key().unwrap());
        region.forget_label();
        let old = Arc::new(BackingFile::reopen(&fs, pages).unwrap());
        attach(&store, &region, Some(old.clone())).expect("an earlier release's store");
        assert_eq!(BackingDevice::blocks(&*old), old.blocks);
        crate::takeover::store_segment::remove(region.id());
        // Taken over without a key yet (writeback added to its settings): looked at.
        let (store, region) = fresh().unwrap();
        let err = attach(
            &store,
            &region,
            Some(Arc::new(BackingFile::reopen(&fs, pages).unwrap())),
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("not uzram's"), "{err:#}");
        assert!(region.writeback_key().is_none());
        crate::takeover::store_segment::remove(region.id());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The mistake a takeover guards against: `writeback-device` changed, or naming another
    /// disk, between a daemon and the one that takes its device over. The takeover would
    /// give back every block no page uses, so a device whose label is not for the store's
    /// key (another device's backing file, a filesystem, an empty file) is refused and left
    /// byte for byte as it was; the device the pages are on is taken, and an earlier
    /// release's label on it, without a key's tag, is given the tag.
    #[test]
    fn a_takeover_takes_only_the_backing_device_its_pages_are_on() {
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let pages = 64;
        let fresh = || store_of(pages);
        let Some((store, region)) = fresh() else {
            return;
        };
        let dir = scratch("takeover-label");
        // The device's own backing file, and another device's.
        let own = dir.join("own");
        attach(
            &store,
            &region,
            Some(Arc::new(BackingFile::open(&own, pages).unwrap())),
        )
        .unwrap();
        let key = region.writeback_key().unwrap().key;
        crate::takeover::store_segment::remove(region.id());
        drop(store);
        let others = dir.join("others");
        let (store, region) = fresh().unwrap();
        attach(
            &store,
            &region,
            Some(Arc::new(BackingFile::open(&others, pages).unwrap())),
        )
        .unwrap();
        crate::takeover::store_segment::remove(region.id());
        drop(store);
        let empty = dir.join("empty");
        std::fs::write(&empty, vec![0u8; 1 << 20]).unwrap();
        let mut ext4 = vec![0u8; 4 << 20];
        ext4[1080..1082].copy_from_slice(&[0x53, 0xef]);
        let fs = dir.join("fs.img");
        std::fs::write(&fs, &ext4).unwrap();
        for path in [&empty, &fs] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }

        let take_over = |path: &Path| {
            let (store, region) = fresh().unwrap();
            region.set_writeback_key(&key);
            let done = attach(
                &store,
                &region,
                Some(Arc::new(BackingFile::reopen(path, pages).unwrap())),
            );
            crate::takeover::store_segment::remove(region.id());
            done
        };
        for (path, says) in [
            (&others, "another uzram device's"),
            (&empty, "no uzram label"),
            (&fs, "no uzram label"),
        ] {
            let before = std::fs::read(path).unwrap();
            let err = format!("{:#}", take_over(path).unwrap_err());
            assert!(err.contains(says) && err.contains("Nothing on it"), "{err}");
            assert!(std::fs::read(path).unwrap() == before, "{path:?} changed");
        }
        take_over(&own).expect("the device its pages are on");
        // An earlier release's label: no tag, taken, and given the tag.
        let last = std::fs::metadata(&own).unwrap().len() / BLOCK_BYTES as u64 - 1;
        let file = std::fs::OpenOptions::new().write(true).open(&own).unwrap();
        file.write_all_at(&[0; 64], last * BLOCK_BYTES as u64 + 1024)
            .unwrap();
        let untagged = |path: &Path| {
            let f = File::open(path).unwrap();
            backing_label::read(&f, last).unwrap()
        };
        assert_eq!(untagged(&own), backing_label::Label::Untagged);
        take_over(&own).expect("an earlier release's label");
        assert_eq!(untagged(&own), backing_label::Label::Keyed(key.label_tag()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two devices naming one backing file (a copied line in a config): the second is
    /// refused while the first holds it, and takes it once the first is gone; a device
    /// taken over opens it whoever holds it, for its pages are there.
    #[test]
    fn a_backing_file_serves_one_device_at_a_time() {
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let dir = scratch("lock");
        let path = dir.join("wb");
        let first = BackingFile::open(&path, 64).unwrap();
        let err = format!("{:#}", BackingFile::open(&path, 64).unwrap_err());
        assert!(err.contains("in use by another uzram device"), "{err}");
        BackingFile::reopen(&path, 64).expect("a device taken over keeps its file");
        drop(first);
        BackingFile::open(&path, 64).expect("free once the first is gone");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_new_file_is_root_only_and_holds_every_page_raw() {
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let dir = scratch("new");
        let path = dir.join("wb");
        let f = BackingFile::open(&path, 1000).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.len(), file_bytes(1000));
        assert!(f.blocks * BLOCK_BYTES as u64 >= 1000 * PAGE_SIZE as u64);
        // Blocks written read back; a released one reads as zeros (or, where the
        // filesystem cannot punch, as before).
        let data: Vec<u8> = (0..2 * BLOCK_BYTES).map(|i| (i % 251) as u8).collect();
        // Direct I/O needs block-aligned memory, as the store's runs are.
        let mut aligned = Aligned::new(data.len()).unwrap();
        aligned.bytes().copy_from_slice(&data);
        let mut other = Aligned::new(BLOCK_BYTES).unwrap();
        other.bytes().fill(0x5a);
        let mut failed: [Option<io::Error>; 2] = Default::default();
        // Two runs in one call: both land, each at its place.
        f.write_runs(
            &[
                BlockRun {
                    first: 3,
                    data: aligned.bytes(),
                },
                BlockRun {
                    first: 9,
                    data: other.bytes(),
                },
            ],
            &mut failed,
        );
        assert!(failed.iter().all(Option::is_none), "{failed:?}");
        let mut nine = vec![0u8; BLOCK_BYTES];
        f.read_blocks(9, &mut nine).unwrap();
        assert!(nine.iter().all(|&b| b == 0x5a));
        let mut back = vec![0u8; 2 * BLOCK_BYTES];
        f.read_blocks(3, &mut back).unwrap();
        assert_eq!(back, data);
        f.release(3, 1).unwrap();
        drop(f);
        // Reopened: the same file, not a new one.
        let f = BackingFile::open(&path, 1000).unwrap();
        f.read_blocks(4, &mut back[..BLOCK_BYTES]).unwrap();
        assert_eq!(back[..BLOCK_BYTES], data[BLOCK_BYTES..]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_others_can_open_or_a_link_is_refused() {
        let dir = scratch("refused");
        let path = dir.join("wb");
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = format!("{:#}", BackingFile::open(&path, 10).unwrap_err());
        assert!(err.contains("only root may read or write it"), "{err}");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let err = format!("{:#}", BackingFile::open(&link, 10).unwrap_err());
        assert!(err.contains("symbolic link is not followed"), "{err}");
        let err = format!("{:#}", BackingFile::open(Path::new("wb"), 10).unwrap_err());
        assert!(err.contains("not an absolute path"), "{err}");
        // A root file of mode 0600 with a second name is not taken as a backing file: the
        // other name may be any file of root's.
        let victim = dir.join("victim");
        std::fs::write(&victim, b"root's data").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        let planted = dir.join("planted.wb");
        std::fs::hard_link(&victim, &planted).unwrap();
        if crate::sys::is_root() {
            let err = format!("{:#}", BackingFile::open(&planted, 10).unwrap_err());
            assert!(err.contains("hard links"), "{err}");
            assert_eq!(std::fs::read(&victim).unwrap(), b"root's data");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The attack a directory on the way allows, tried: a directory another user owns, one
    /// others may write, and a link of root's through a directory of another user's, are
    /// refused; a sticky directory others may write (as /tmp) is not.
    #[test]
    fn a_path_another_user_could_change_on_the_way_is_refused() {
        let dir = scratch("ways");
        let open = std::fs::Permissions::from_mode(0o777);
        let sticky = std::fs::Permissions::from_mode(0o1777);
        let writable = dir.join("open");
        std::fs::create_dir(&writable).unwrap();
        std::fs::set_permissions(&writable, open).unwrap();
        let err = format!(
            "{:#}",
            BackingFile::open(&writable.join("wb"), 10).unwrap_err()
        );
        assert!(
            err.contains("may be written by others (mode 0777)"),
            "{err}"
        );
        assert!(err.contains(&writable.display().to_string()), "{err}");
        let shared = dir.join("sticky");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, sticky).unwrap();
        BackingFile::open(&shared.join("wb"), 10).expect("a file in a sticky directory");
        if crate::sys::is_root() {
            let theirs = dir.join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let err = format!(
                "{:#}",
                BackingFile::open(&theirs.join("wb"), 10).unwrap_err()
            );
            assert!(err.contains("is owned by uid 65534"), "{err}");
            // Named through a link of root's: what it resolves to is checked too.
            let via = dir.join("via");
            std::os::unix::fs::symlink(&theirs, &via).unwrap();
            let err = format!("{:#}", BackingFile::open(&via.join("wb"), 10).unwrap_err());
            assert!(err.contains("is owned by uid 65534"), "{err}");
            assert!(
                !theirs.join("wb").exists(),
                "a file was made in nobody's directory"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A partition named through a link of root's (as udev's `/dev/disk/by-id/...`) is the
    /// partition; through a link another user owns it is refused, and a link to a file is
    /// left for `open` to refuse.
    #[test]
    fn a_partition_named_through_a_roots_link_resolves_to_it() {
        let Some(device) = ["/dev/loop0", "/dev/vda", "/dev/sda"]
            .into_iter()
            .map(Path::new)
            .find(|p| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device()))
        else {
            println!("SKIP: no block device node to link to");
            return;
        };
        let dir = scratch("by-id");
        let link = dir.join("disk-part2");
        std::os::unix::fs::symlink(device, &link).unwrap();
        assert_eq!(resolve_roots_path(&link).unwrap(), device);
        let file = dir.join("file");
        std::fs::write(&file, b"").unwrap();
        let to_file = dir.join("to-file");
        std::os::unix::fs::symlink(&file, &to_file).unwrap();
        assert_eq!(resolve_roots_path(&to_file).unwrap(), to_file);
        if crate::sys::is_root() {
            let theirs = dir.join("theirs-part2");
            std::os::unix::fs::symlink(device, &theirs).unwrap();
            std::os::unix::fs::lchown(&theirs, Some(65534), Some(65534)).unwrap();
            let err = format!("{:#}", resolve_roots_path(&theirs).unwrap_err());
            assert!(err.contains("is owned by uid 65534"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

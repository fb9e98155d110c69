//! The writeback budget (`writeback-limit = "1G/day"`): how many bytes writeback may write to
//! a backing device per UTC day. Flash wears by what is written to it, whichever daemon
//! wrote it, so the day's count is kept on disk, in [`BUDGET_DIR`], one file per backing
//! device: a restart, a crash or a reboot goes on from it. Every writeback pass of the daemon
//! (the tier's, pressure's, `uzram writeback`) goes through [`budgeted_writeback`].
//!
//! The directory is made root's with mode 0700 and checked on every use; the file is
//! written atomically (a temporary file and a rename, through the directory's descriptor),
//! by a thread of its own ([`Budget::keep_on_disk`]), never by the pass that spent: the room
//! thread's passes run exactly when memory is exhausted, writes at `mem-limit` wait for
//! them, and a file system write allocates (an I/O flusher's allocation then waits in
//! reclaim as long as it takes). A daemon that dies right after a pass may leave that pass
//! uncounted on disk.
//! A file that does not parse, or that counts a day after today, is not trusted: the day's
//! budget counts as spent (a warning says so), never as unspent.

use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use uzram_core::store::{Writeback, WritebackCandidates, WrittenBack};
use uzram_core::PageStore;

use crate::sys;

/// Where the budgets live.
pub const BUDGET_DIR: &str = "/var/lib/uzram/writeback-budget";
/// The most a budget file may hold.
const MAX_FILE: u64 = 4096;

/// What a budget file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Day {
    /// Days since 1970-01-01 (UTC).
    day: u64,
    /// Bytes written to the backing device that day.
    spent: u64,
}

/// A backing device's budget; see the module docs.
#[derive(Debug)]
pub struct Budget {
    dir: PathBuf,
    name: OsString,
    per_day: u64,
    today: Mutex<Day>,
    /// Wakes the thread that keeps `today` on disk when it changes.
    spent: Condvar,
    /// Held by a budgeted pass from reading what is left to spending what it wrote, so that
    /// two passes (the tier, room and control threads) never both spend the same bytes.
    turn: Mutex<()>,
}

/// How many days ahead of the clock a kept count may be and still be the device's own (an
/// early-boot clock behind, an RTC kept in local time): kept, and today counts as spent
/// until the clock reaches it. Further ahead, the file is taken as damaged.
const CLOCK_BEHIND_DAYS: u64 = 2;

/// Today, in days since 1970-01-01 (UTC).
pub fn today() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

/// The file name of `device`'s budget: its path with every character but letters, digits,
/// `.` and `-` as `_` (`/dev/sdb2` is `_dev_sdb2.json`).
fn file_name(device: &Path) -> OsString {
    let text: String = device
        .to_string_lossy()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    OsString::from(format!("{text}.json"))
}

impl Budget {
    /// The budget of backing device `device`, `per_day` bytes, kept in `dir`; reads what
    /// was spent today.
    pub fn open(dir: &Path, device: &Path, per_day: u64) -> anyhow::Result<Self> {
        let budget = Self {
            dir: dir.to_path_buf(),
            name: file_name(device),
            per_day,
            today: Mutex::new(Day {
                day: today(),
                spent: 0,
            }),
            spent: Condvar::new(),
            turn: Mutex::new(()),
        };
        let dir_fd = budget.open_dir()?;
        let kept = budget.read();
        let now = today();
        let day = match kept {
            Ok(Some(d)) if d.day == now => d,
            Ok(Some(d)) if d.day < now => Day { day: now, spent: 0 },
            Ok(None) => Day { day: now, spent: 0 },
            Ok(Some(d)) if d.day - now <= CLOCK_BEHIND_DAYS => {
                tracing::warn!(
                    day = d.day,
                    today = now,
                    "the writeback budget file counts a day after today (the clock behind?): \
                     nothing more is written back until the clock reaches that day"
                );
                d
            }
            Ok(Some(d)) => {
                tracing::warn!(
                    day = d.day,
                    today = now,
                    "the writeback budget file counts a day after today: today's budget counts as spent"
                );
                Day {
                    day: now,
                    spent: per_day,
                }
            }
            Err(error) => {
                tracing::warn!(%error, "the writeback budget file is not one uzram wrote: today's budget counts as spent");
                Day {
                    day: now,
                    spent: per_day,
                }
            }
        };
        *budget.today.lock().unwrap_or_else(|e| e.into_inner()) = day;
        budget.save(&dir_fd, day)?;
        Ok(budget)
    }

    /// Bytes left today.
    pub fn left(&self) -> u64 {
        self.left_on(today())
    }

    /// A clock that went back, to before the day counted, leaves that day's count as it is
    /// and spends nothing until it reaches that day again.
    fn left_on(&self, now: u64) -> u64 {
        let mut d = self.today.lock().unwrap_or_else(|e| e.into_inner());
        if now > d.day {
            *d = Day { day: now, spent: 0 };
        } else if now < d.day {
            return 0;
        }
        self.per_day.saturating_sub(d.spent)
    }

    /// Counts `bytes` written today; [`Budget::keep_on_disk`] writes the count down.
    pub fn spend(&self, bytes: u64) {
        self.spend_on(today(), bytes);
    }

    fn spend_on(&self, now: u64, bytes: u64) {
        {
            let mut d = self.today.lock().unwrap_or_else(|e| e.into_inner());
            // A clock behind the day counted: the bytes count for that day.
            if now > d.day {
                *d = Day { day: now, spent: 0 };
            }
            d.spent = d.spent.saturating_add(bytes);
        }
        self.spent.notify_one();
    }

    /// Writes today's count to the file now (what the thread does after a spend).
    #[cfg(test)]
    fn save_now(&self) -> anyhow::Result<()> {
        let day = *self.today.lock().unwrap_or_else(|e| e.into_inner());
        self.write_down(day)
    }

    fn write_down(&self, day: Day) -> anyhow::Result<()> {
        let dir = self.open_dir()?;
        self.save(&dir, day)
    }

    /// The thread that keeps the count on disk: writes it down at its start and then
    /// whenever it differs from what it last wrote (after each pass that spent). Never
    /// returns.
    pub fn keep_on_disk(&self) {
        let mut written: Option<Day> = None;
        loop {
            let day = {
                let mut d = self.today.lock().unwrap_or_else(|e| e.into_inner());
                while written == Some(*d) {
                    d = self.spent.wait(d).unwrap_or_else(|e| e.into_inner());
                }
                *d
            };
            if let Err(error) = self.write_down(day) {
                tracing::error!(error = %format!("{error:#}"), "the writeback budget could not be kept on disk");
            }
            written = Some(day);
        }
    }

    /// The directory, made root's and 0700 if absent, and checked: root's, no access for
    /// group or others.
    fn open_dir(&self) -> anyhow::Result<std::fs::File> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(&self.dir)
            .with_context(|| format!("opening {}", self.dir.display()))?;
        let meta = dir.metadata()?;
        if meta.uid() != sys::effective_uid() || meta.mode() & 0o077 != 0 {
            bail!(
                "{} is owned by uid {} with mode {:o}: the writeback budget is kept only in a \
                 directory of root's alone (chown root and chmod 700 it)",
                self.dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            );
        }
        Ok(dir)
    }

    /// The day kept in the file, `None` when there is none.
    fn read(&self) -> anyhow::Result<Option<Day>> {
        let path = self.dir.join(&self.name);
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            other => other.with_context(|| format!("opening {}", path.display()))?,
        };
        let meta = file.metadata()?;
        if !meta.is_file() || meta.uid() != sys::effective_uid() || meta.len() > MAX_FILE {
            bail!("{} is not a small file of root's", path.display());
        }
        let text = std::io::read_to_string(file)?;
        let day: Day = serde_json::from_str(&text)
            .with_context(|| format!("{} does not parse", path.display()))?;
        Ok(Some(day))
    }

    fn save(&self, dir_file: &std::fs::File, day: Day) -> anyhow::Result<()> {
        use std::io::Write;
        let dir = dir_file.as_fd();
        let mut tmp = OsString::from(".");
        tmp.push(&self.name);
        tmp.push(format!(".{}.tmp", std::process::id()));
        let mut file = match sys::create_new_at(dir, &tmp, 0o600) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                sys::unlink_at(dir, &tmp)?;
                sys::create_new_at(dir, &tmp, 0o600)
            }
            other => other,
        }
        .context("creating the budget's temporary file")?;
        // On disk before the rename, and the rename with the directory: after a power cut
        // the file is the old day or the new one, never empty (one that does not parse
        // counts the whole day as spent).
        let written = file
            .write_all(serde_json::to_string(&day)?.as_bytes())
            .and_then(|()| file.sync_data())
            .and_then(|()| sys::rename_at(dir, &tmp, &self.name));
        if written.is_err() {
            let _ = sys::unlink_at(dir, &tmp);
        }
        written
            .with_context(|| format!("saving the writeback budget in {}", self.dir.display()))?;
        dir_file
            .sync_all()
            .with_context(|| format!("syncing {}", self.dir.display()))
    }
}

/// A writeback pass of up to `max_pages` pages of `candidates`, within what is left of the
/// day's budget, which it then spends.
///
/// It runs at the I/O path's priority ([`crate::sys::at_io_priority`]), whoever calls it:
/// it holds the day's turn and the store's pass lock, which the room thread waits on to
/// make room under the memory limit, and at the tier thread's nice 19 beside busy CPUs a
/// pass held them for as long as the scheduler left it waiting (the mechanism measured on
/// compaction). The pass's own CPU (picking pages from the table, copying and sealing their
/// objects; nothing is compressed) then runs at that priority too: a background pass is
/// bounded to a tick's pages, `uzram writeback` to what its caller asked.
pub(super) fn budgeted_writeback(
    store: &PageStore,
    budget: Option<&Budget>,
    candidates: WritebackCandidates,
    max_pages: u64,
) -> Result<WrittenBack, uzram_core::CoreError> {
    crate::sys::at_io_priority(|| writeback_in_turn(store, budget, candidates, max_pages))
}

fn writeback_in_turn(
    store: &PageStore,
    budget: Option<&Budget>,
    candidates: WritebackCandidates,
    max_pages: u64,
) -> Result<WrittenBack, uzram_core::CoreError> {
    let _turn = budget.map(|b| b.turn.lock().unwrap_or_else(|e| e.into_inner()));
    let max_bytes = budget.map_or(u64::MAX, Budget::left);
    if max_bytes < uzram_core::store::BLOCK_BYTES as u64 {
        return Ok(WrittenBack::default());
    }
    let before = store.backing_bytes_written();
    let done = store.writeback(Writeback {
        candidates,
        max_pages,
        max_bytes,
    });
    if let Some(b) = budget {
        // What reached the device, also where the pass failed partway (the runs written
        // before the failure stay written back).
        let written = store.backing_bytes_written().saturating_sub(before);
        if written > 0 {
            b.spend(written);
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes `dir` root's alone (0700), as the budget's directory must be.
    fn make_private(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("uzram-budget-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn spending_is_kept_across_opens_and_a_new_day_starts_afresh() {
        let dir = scratch("kept");
        let dev = Path::new("/dev/sdb2");
        let b = Budget::open(&dir, dev, 1000).unwrap();
        assert_eq!(b.left(), 1000);
        b.spend(300);
        assert_eq!(b.left(), 700);
        b.save_now().unwrap();
        drop(b);
        // A restart goes on from the file.
        let b = Budget::open(&dir, dev, 1000).unwrap();
        assert_eq!(b.left(), 700);
        b.spend(900);
        assert_eq!(b.left(), 0);
        // Another device has its own budget.
        assert_eq!(
            Budget::open(&dir, Path::new("/dev/sdc1"), 1000)
                .unwrap()
                .left(),
            1000
        );
        // Tomorrow, the budget is whole again, and that is kept too.
        let tomorrow = today() + 1;
        assert_eq!(b.left_on(tomorrow), 1000);
        b.spend_on(tomorrow, 10);
        assert_eq!(b.left_on(tomorrow), 990);
        b.save_now().unwrap();
        let meta = std::fs::metadata(dir.join("_dev_sdb2.json")).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The tier, room and control threads' passes at once never spend more than the day's
    /// budget between them: each reads what is left only after the one before spent what it
    /// wrote (before, all could read the same amount left, and each write that much).
    #[test]
    fn passes_at_once_never_spend_more_than_the_day() {
        use std::sync::Arc;
        use uzram_core::codec::Algorithm;
        use uzram_core::store::{Nonces, StoreConfig, BLOCK_BYTES};
        if !crate::sys::is_root() {
            println!("SKIP: not root");
            return;
        }
        let dir = scratch("turns");
        make_private(&dir);
        let pages = 512u64;
        let store = Arc::new(PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap());
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for p in 0..pages {
            let page: Vec<u8> = (0..BLOCK_BYTES / 8)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect();
            store.write(p, &page).unwrap();
        }
        let wb = dir.join("wb");
        let file = super::super::backing::BackingFile::open(&wb, pages).unwrap();
        let key = super::super::backing::new_key().unwrap();
        file.label(&key).unwrap();
        store
            .attach_backing(Arc::new(file), &key, Nonces::Owned)
            .unwrap();
        let per_day = 64 * BLOCK_BYTES as u64;
        let budget = Arc::new(Budget::open(&dir, &wb, per_day).unwrap());
        let passes: Vec<_> = (0..3)
            .map(|_| {
                let (store, budget) = (store.clone(), budget.clone());
                std::thread::spawn(move || {
                    budgeted_writeback(
                        &store,
                        Some(&budget),
                        WritebackCandidates::Idle { min_age: 0 },
                        u64::MAX,
                    )
                    .unwrap()
                })
            })
            .collect();
        for p in passes {
            p.join().unwrap();
        }
        let written = store.backing_bytes_written();
        assert!(written > 0, "nothing was written back");
        assert!(
            written <= per_day,
            "{written} bytes written, {per_day} a day"
        );
        assert_eq!(budget.left(), per_day - written);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A clock behind the day counted (early boot, an RTC in local time) or stepped back
    /// keeps that day's count, spends nothing until the clock is back there, and goes on
    /// from the count then (before, the whole budget came back on a day half spent).
    #[test]
    fn a_clock_behind_the_day_counted_keeps_its_count() {
        let dir = scratch("clock");
        let dev = Path::new("/dev/sde1");
        make_private(&dir);
        let t = today() + 1;
        std::fs::write(
            dir.join(file_name(dev)),
            format!("{{\"day\": {t}, \"spent\": 600}}"),
        )
        .unwrap();
        let b = Budget::open(&dir, dev, 1000).unwrap();
        assert_eq!(b.left(), 0, "today is before the day counted");
        assert_eq!(b.left_on(t), 400, "that day goes on from its count");
        b.spend_on(t, 300);
        assert_eq!(b.left_on(t - 1), 0, "the clock stepped back");
        assert_eq!(b.left_on(t), 100);
        assert_eq!(b.left_on(t + 1), 1000, "a new day");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_pass_spends_in_memory_and_the_keeper_thread_writes_it_down() {
        let dir = scratch("keeper");
        let dev = Path::new("/dev/sdd1");
        let b = std::sync::Arc::new(Budget::open(&dir, dev, 1000).unwrap());
        let file = dir.join(file_name(dev));
        let on_disk = || {
            let text = std::fs::read_to_string(&file).unwrap();
            serde_json::from_str::<Day>(&text).unwrap().spent
        };
        // The directory taken away: a spend does not need it (the pass never waits on the
        // file system), and counts at once.
        std::fs::remove_dir_all(&dir).unwrap();
        b.spend(100);
        assert_eq!(b.left(), 900);
        make_private(&dir);
        let keeper = b.clone();
        std::thread::spawn(move || keeper.keep_on_disk());
        b.spend(250);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !(file.exists() && on_disk() == 350) {
            assert!(
                std::time::Instant::now() < deadline,
                "the count was not written down"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(Budget::open(&dir, dev, 1000).unwrap().left(), 650);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_that_is_not_uzrams_or_a_shared_directory_is_not_trusted() {
        let dir = scratch("foreign");
        let dev = Path::new("/var/lib/uzram/swap0.wb");
        make_private(&dir);
        let file = dir.join(file_name(dev));
        for bad in [
            "not json",
            "{\"day\": 1}",
            "{\"day\": 99999999, \"spent\": 0}",
        ] {
            std::fs::write(&file, bad).unwrap();
            let b = Budget::open(&dir, dev, 5000).unwrap();
            assert_eq!(b.left(), 0, "{bad:?} counted as unspent");
        }
        // A day before today: a fresh budget.
        std::fs::write(&file, "{\"day\": 3, \"spent\": 5000}").unwrap();
        assert_eq!(Budget::open(&dir, dev, 5000).unwrap().left(), 5000);
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let err = format!("{:#}", Budget::open(&dir, dev, 5000).unwrap_err());
        assert!(err.contains("root's alone"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

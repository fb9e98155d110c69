//! Store statistics with zram's names and meaning (`mm_stat`, `io_stat`), plus a few extras.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A snapshot of a store's counters. Sizes are in bytes, counts in pages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// mm_stat: uncompressed size of every stored page (same-filled ones included).
    pub orig_data_size: u64,
    /// mm_stat: stored payload: compressed lengths, 4096 per huge page, 0 per same-filled page.
    pub compr_data_size: u64,
    /// mm_stat: memory the store holds: arena segments, page table and all bookkeeping.
    pub mem_used_total: u64,
    /// mm_stat: the configured limit (0 = none).
    pub mem_limit: u64,
    /// mm_stat: the highest `mem_used_total` seen.
    pub mem_used_max: u64,
    /// mm_stat: pages stored as a repeated word, with no payload.
    pub same_pages: u64,
    /// mm_stat: memory released by [`super::PageStore::compact`], in pages (cumulative).
    pub pages_compacted: u64,
    /// mm_stat: pages stored raw because they did not compress below the threshold.
    pub huge_pages: u64,
    /// io_stat: failed read requests (recorded by the caller).
    pub failed_reads: u64,
    /// io_stat: failed write requests (recorded by the caller).
    pub failed_writes: u64,
    /// io_stat: requests refused as out of range or misaligned (recorded by the caller).
    pub invalid_io: u64,
    /// io_stat: pages freed by discard.
    pub notify_free: u64,
    /// Pages that hold data (not empty), same-filled ones included.
    pub pages_stored: u64,
    /// Pages read.
    pub reads: u64,
    /// Pages written (inline, same-filled or staged; write_zeroes not included).
    pub writes: u64,
    /// Pages waiting uncompressed in a batch backend's staging memory (counted in
    /// `pages_stored` and `orig_data_size`, not in `compr_data_size`: their memory is the
    /// backend's fixed staging, reported by the backend).
    pub staged_pages: u64,
    /// Reads of stored pages that failed their check (the checksum, the decode, or a
    /// damaged table entry): each one failed with EIO instead of returning other data.
    pub checksum_failures: u64,
    /// Pages held recompressed (zstd frames, or LZ4 blocks with the store's dictionary,
    /// written by recompression).
    pub recompressed_pages: u64,
    /// Pages recompression tried (cumulative).
    pub recompress_tried_pages: u64,
    /// Pages recompression tried and kept as they were: not smaller by a size class
    /// (cumulative).
    pub recompress_kept_pages: u64,
    /// Pages recompression rewrote smaller, with any recompressor (cumulative).
    pub recompress_rewritten_pages: u64,
    /// Payload bytes recompression saved (cumulative; pages rewritten since count nothing
    /// back).
    pub recompress_saved_bytes: u64,
    /// Bytes of the dictionary the store's pages are recompressed with
    /// (`recompress-algorithm = "lz4-gpu-dict"`; 0 before it is trained).
    pub recompress_dictionary_bytes: u64,
    /// bd_stat: pages written back, on the backing device now.
    pub bd_count: u64,
    /// bd_stat: 4 KiB blocks read from the backing device (cumulative).
    pub bd_reads: u64,
    /// bd_stat: 4 KiB blocks written to the backing device (cumulative).
    pub bd_writes: u64,
    /// Bytes written to the backing device (cumulative).
    pub bd_bytes_written: u64,
    /// Backing-device reads and writes that failed, and written-back objects that failed
    /// their tag (cumulative).
    pub bd_failures: u64,
}

impl Stats {
    /// `(name, value)` pairs in zram's order (mm_stat, then io_stat), then the extras.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("orig_data_size", self.orig_data_size),
            ("compr_data_size", self.compr_data_size),
            ("mem_used_total", self.mem_used_total),
            ("mem_limit", self.mem_limit),
            ("mem_used_max", self.mem_used_max),
            ("same_pages", self.same_pages),
            ("pages_compacted", self.pages_compacted),
            ("huge_pages", self.huge_pages),
            ("failed_reads", self.failed_reads),
            ("failed_writes", self.failed_writes),
            ("invalid_io", self.invalid_io),
            ("notify_free", self.notify_free),
            ("pages_stored", self.pages_stored),
            ("reads", self.reads),
            ("writes", self.writes),
            ("staged_pages", self.staged_pages),
            ("checksum_failures", self.checksum_failures),
            ("recompressed_pages", self.recompressed_pages),
            ("recompress_tried_pages", self.recompress_tried_pages),
            ("recompress_kept_pages", self.recompress_kept_pages),
            (
                "recompress_rewritten_pages",
                self.recompress_rewritten_pages,
            ),
            ("recompress_saved_bytes", self.recompress_saved_bytes),
            (
                "recompress_dictionary_bytes",
                self.recompress_dictionary_bytes,
            ),
            ("bd_count", self.bd_count),
            ("bd_reads", self.bd_reads),
            ("bd_writes", self.bd_writes),
            ("bd_bytes_written", self.bd_bytes_written),
            ("bd_failures", self.bd_failures),
        ]
    }
}

/// Where a store's memory goes: `mem_used_total` = `table_bytes` + `side_map_bytes` +
/// `arena_bookkeeping_bytes` + `segment_bytes`, and the segments split into payload,
/// checksums, rounding to size classes, replaced objects not given back yet, free holes and
/// the unused end of the newest segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Page table: 8-byte entries, shard locks, the store struct.
    pub table_bytes: u64,
    /// Side map (fill words that do not fit an entry).
    pub side_map_bytes: u64,
    /// Arena free lists and segment slots.
    pub arena_bookkeeping_bytes: u64,
    /// Memory in arena segments.
    pub segment_bytes: u64,
    /// Stored payload (compr_data_size).
    pub payload_bytes: u64,
    /// The checksums stored after the payloads.
    pub checksum_bytes: u64,
    /// Bytes lost to rounding objects up to their size class.
    pub class_rounding_bytes: u64,
    /// Freed or leftover space on free lists, waiting for an object of its class.
    pub free_hole_bytes: u64,
    /// Objects whose pages were staged anew, given back when the staging slot is installed
    /// (a GPU ring's; rounded to their classes).
    pub replaced_bytes: u64,
    /// Never-used space at the end of the newest segment.
    pub frontier_unused_bytes: u64,
}

/// Request counters behind [`Stats`] (page-state totals live in each shard, under its
/// lock, so writers on different shards never share a cache line for them).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub failed_reads: AtomicU64,
    pub failed_writes: AtomicU64,
    pub invalid_io: AtomicU64,
    pub notify_free: AtomicU64,
    pub reads: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub writes: AtomicU64,
    pub recompress_tried: AtomicU64,
    pub recompress_kept: AtomicU64,
    pub recompress_rewritten: AtomicU64,
    pub recompress_saved_bytes: AtomicU64,
}

/// What a page contributes to the counters.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PageCost {
    pub stored: bool,
    pub same: bool,
    pub huge: bool,
    pub staged: bool,
    pub recompressed: bool,
    pub backed: bool,
    pub payload: u64,
}

/// Page-state totals of one shard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PageTotals {
    pub pages_stored: u64,
    pub same_pages: u64,
    pub huge_pages: u64,
    pub staged_pages: u64,
    pub recompressed_pages: u64,
    pub backed_pages: u64,
    pub compr_data_size: u64,
}

impl PageTotals {
    /// Moves one page's contribution from `old` to `new`.
    pub(crate) fn replace(&mut self, old: PageCost, new: PageCost) {
        adjust(&mut self.pages_stored, old.stored.into(), new.stored.into());
        adjust(&mut self.same_pages, old.same.into(), new.same.into());
        adjust(&mut self.huge_pages, old.huge.into(), new.huge.into());
        adjust(&mut self.staged_pages, old.staged.into(), new.staged.into());
        adjust(
            &mut self.recompressed_pages,
            old.recompressed.into(),
            new.recompressed.into(),
        );
        adjust(&mut self.backed_pages, old.backed.into(), new.backed.into());
        adjust(&mut self.compr_data_size, old.payload, new.payload);
    }

    /// Adds another shard's totals.
    pub(crate) fn add(&mut self, other: &PageTotals) {
        self.pages_stored += other.pages_stored;
        self.same_pages += other.same_pages;
        self.huge_pages += other.huge_pages;
        self.staged_pages += other.staged_pages;
        self.recompressed_pages += other.recompressed_pages;
        self.backed_pages += other.backed_pages;
        self.compr_data_size += other.compr_data_size;
    }
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }
}

fn adjust(total: &mut u64, old: u64, new: u64) {
    *total = total.wrapping_sub(old).wrapping_add(new);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_in_zram_order_and_complete() {
        let stats = Stats {
            orig_data_size: 1,
            compr_data_size: 2,
            mem_used_total: 3,
            mem_limit: 4,
            mem_used_max: 5,
            same_pages: 6,
            pages_compacted: 7,
            huge_pages: 8,
            failed_reads: 9,
            failed_writes: 10,
            invalid_io: 11,
            notify_free: 12,
            pages_stored: 13,
            reads: 14,
            writes: 15,
            staged_pages: 16,
            checksum_failures: 17,
            recompressed_pages: 18,
            recompress_tried_pages: 19,
            recompress_kept_pages: 20,
            recompress_rewritten_pages: 21,
            recompress_saved_bytes: 22,
            recompress_dictionary_bytes: 23,
            bd_count: 24,
            bd_reads: 25,
            bd_writes: 26,
            bd_bytes_written: 27,
            bd_failures: 28,
        };
        let fields = stats.fields();
        let values: Vec<u64> = fields.iter().map(|f| f.1).collect();
        assert_eq!(values, (1..=28).collect::<Vec<u64>>());
        assert_eq!(fields[0].0, "orig_data_size");
        assert_eq!(fields[11].0, "notify_free");
    }

    #[test]
    fn replace_moves_contributions() {
        let mut c = PageTotals::default();
        let huge = PageCost {
            stored: true,
            huge: true,
            payload: 4096,
            ..PageCost::default()
        };
        let same = PageCost {
            stored: true,
            same: true,
            ..PageCost::default()
        };
        c.replace(PageCost::default(), huge);
        c.replace(huge, same);
        assert_eq!(c.pages_stored, 1);
        assert_eq!(c.huge_pages, 0);
        assert_eq!(c.same_pages, 1);
        assert_eq!(c.compr_data_size, 0);
        c.replace(same, PageCost::default());
        assert_eq!(c, PageTotals::default());
    }
}

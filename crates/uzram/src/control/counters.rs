//! Every counter of a device, named once: `uzram status` (text and JSON), the Prometheus
//! export (`metrics`), the counters carried to the next daemon (`takeover::carry`) and the
//! code that counts (`ublk::server::RequestCounters`, the daemon's pool and queue figures)
//! all read this table. The store's counters are named by `uzram_core`'s `Stats::fields`;
//! a test holds that every one of them is here.
//!
//! Backend counters are not listed: a backend may add any, and `metrics` exports them by
//! its generic rule.

/// Which part of `DeviceStatus` a counter comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// `stats`: the store's counters (zram's mm_stat and io_stat names).
    Store,
    /// `requests`: the daemon's request, pool and queue counters.
    Requests,
    /// `backend_stats`: the compression backend's counters.
    Backend,
}

/// Whether a value only grows (a count of events) or can go down (an amount now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Counts events since the device was made (or the daemon started, when not carried).
    Counter,
    /// A current amount.
    Gauge,
}

impl Kind {
    /// As Prometheus' `# TYPE` line names it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// What the next daemon of the device does with the value this one leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// Nothing: the value is rebuilt from the store, or belongs to one daemon.
    No,
    /// Adds it to its own count.
    Sum,
    /// Reports the larger of it and its own.
    Peak,
}

/// One counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    /// Its name in `uzram status` and the carried table.
    pub name: &'static str,
    /// Where it is reported.
    pub group: Group,
    /// Counter or gauge.
    pub kind: Kind,
    /// Whether it goes on across daemons.
    pub carried: Carried,
    /// Its Prometheus metric name.
    pub metric: &'static str,
    /// Its Prometheus help text.
    pub help: &'static str,
}

macro_rules! counters {
    ($($id:ident = $name:literal, $group:ident, $kind:ident, $carried:ident,
        $metric:literal, $help:literal;)*) => {
        $(
            #[doc = $help]
            // (a constant for every counter, also those no code of this crate names)
            #[allow(dead_code)]
            pub const $id: &str = $name;
        )*
        /// Every counter, in the order `uzram status` reports them.
        pub const ALL: &[Counter] = &[$(Counter {
            name: $name,
            group: Group::$group,
            kind: Kind::$kind,
            carried: Carried::$carried,
            metric: $metric,
            help: $help,
        }),*];
    };
}

counters! {
    ORIG_DATA_SIZE = "orig_data_size", Store, Gauge, No,
        "uzram_orig_data_bytes",
        "Uncompressed size of the data stored (zram mm_stat orig_data_size).";
    COMPR_DATA_SIZE = "compr_data_size", Store, Gauge, No,
        "uzram_compr_data_bytes",
        "Compressed size of the data stored (zram mm_stat compr_data_size).";
    MEM_USED_TOTAL = "mem_used_total", Store, Gauge, No,
        "uzram_mem_used_bytes",
        "Memory the store holds: arena, page table and bookkeeping (zram mm_stat mem_used_total).";
    MEM_LIMIT = "mem_limit", Store, Gauge, No,
        "uzram_mem_limit_bytes",
        "Memory limit for compressed data, 0 for none (zram mm_stat mem_limit).";
    MEM_USED_MAX = "mem_used_max", Store, Gauge, Peak,
        "uzram_mem_used_max_bytes",
        "Peak memory the store held (zram mm_stat mem_used_max).";
    SAME_PAGES = "same_pages", Store, Gauge, No,
        "uzram_same_pages",
        "Pages stored as one repeated word, with no compressed data (zram mm_stat same_pages).";
    PAGES_COMPACTED = "pages_compacted", Store, Counter, Sum,
        "uzram_pages_compacted_total",
        "Pages of memory given back by compaction (zram mm_stat pages_compacted).";
    HUGE_PAGES = "huge_pages", Store, Gauge, No,
        "uzram_huge_pages",
        "Pages stored uncompressed because they did not compress enough (zram mm_stat huge_pages).";
    FAILED_READS = "failed_reads", Store, Counter, Sum,
        "uzram_failed_reads_total",
        "Failed read requests (zram io_stat failed_reads).";
    FAILED_WRITES = "failed_writes", Store, Counter, Sum,
        "uzram_failed_writes_total",
        "Failed write requests (zram io_stat failed_writes).";
    INVALID_IO = "invalid_io", Store, Counter, Sum,
        "uzram_invalid_io_total",
        "Requests refused as out of range or misaligned (zram io_stat invalid_io).";
    NOTIFY_FREE = "notify_free", Store, Counter, Sum,
        "uzram_notify_free_total",
        "Pages freed by discard (zram io_stat notify_free).";
    PAGES_STORED = "pages_stored", Store, Gauge, No,
        "uzram_pages_stored",
        "Pages that hold data, same-filled ones included.";
    READS = "reads", Store, Counter, Sum,
        "uzram_pages_read_total",
        "Pages read from the store.";
    WRITES = "writes", Store, Counter, Sum,
        "uzram_pages_written_total",
        "Pages written to the store.";
    CHECKSUM_FAILURES = "checksum_failures", Store, Counter, Sum,
        "uzram_checksum_failures_total",
        "Reads of stored pages that failed their checksum (each an I/O error, never other data).";
    READ_REQUESTS = "read_requests", Requests, Counter, Sum,
        "uzram_read_requests_total",
        "Read requests served.";
    READ_BYTES = "read_bytes", Requests, Counter, Sum,
        "uzram_read_bytes_total",
        "Bytes read by requests.";
    WRITE_REQUESTS = "write_requests", Requests, Counter, Sum,
        "uzram_write_requests_total",
        "Write requests served.";
    WRITE_BYTES = "write_bytes", Requests, Counter, Sum,
        "uzram_write_bytes_total",
        "Bytes written by requests.";
    FLUSH_REQUESTS = "flush_requests", Requests, Counter, Sum,
        "uzram_flush_requests_total",
        "Flush requests served.";
    DISCARD_REQUESTS = "discard_requests", Requests, Counter, Sum,
        "uzram_discard_requests_total",
        "Discard requests served.";
    WRITE_ZEROES_REQUESTS = "write_zeroes_requests", Requests, Counter, Sum,
        "uzram_write_zeroes_requests_total",
        "Write-zeroes requests served.";
    FAILED_REQUESTS = "failed_requests", Requests, Counter, Sum,
        "uzram_failed_requests_total",
        "Requests completed with an error.";
    QUEUE_PAGE_FAULTS = "queue_page_faults", Requests, Counter, No,
        "uzram_queue_page_faults_total",
        "Major page faults taken by the queue threads (each one is a stall under memory pressure).";
    QUEUE_RETRIED_WAITS = "queue_retried_waits", Requests, Counter, Sum,
        "uzram_queue_retried_waits_total",
        "Waits of the queue threads' io_uring that failed (interrupted, or the kernel short of resources) and were waited again.";
    QUEUE_FAILED_COMMANDS = "queue_failed_commands", Requests, Counter, Sum,
        "uzram_queue_failed_commands_total",
        "ublk commands of the queue threads that completed with an error (a batch fetch, which is re-armed).";
    POOL_FREE_BLOCKS = "pool_free_blocks", Requests, Gauge, No,
        "uzram_pool_free_blocks",
        "Free 64 KiB blocks in the daemon's pre-faulted block pool.";
    POOL_RELEASED_BLOCKS = "pool_released_blocks", Requests, Counter, No,
        "uzram_pool_released_blocks_total",
        "Free pool blocks given back to the system (holes punched in the pool's memfd).";
    DAEMON_RSS_BYTES = "daemon_rss_bytes", Requests, Gauge, No,
        "uzram_daemon_resident_bytes",
        "Memory the daemon holds: resident pages, the block pool's shared memory included.";
    POOL_REFUSED_BLOCKS = "pool_refused_blocks", Requests, Counter, Sum,
        "uzram_pool_refused_blocks_total",
        "64 KiB allocations of I/O threads that found the block pool empty (the system allocator served them).";
    POOL_WAITED_TAKES = "pool_waited_takes", Requests, Counter, Sum,
        "uzram_pool_waited_takes_total",
        "New arena segments that found the pool empty and waited for its keeper.";
    POOL_TAKE_TIMEOUTS = "pool_take_timeouts", Requests, Counter, Sum,
        "uzram_pool_take_timeouts_total",
        "Waits for the pool keeper that ended with no block (each one failed a write with ENOMEM).";
    POOL_DAMAGED_LISTS = "pool_damaged_lists", Requests, Counter, Sum,
        "uzram_pool_damaged_lists_total",
        "Times the block pool's free list named no free block (something wrote into freed memory; the list was dropped), or a pointer that starts no block was freed into it.";
    STAGED_PAGES = "staged_pages", Store, Gauge, No,
        "uzram_staged_pages",
        "Pages accepted for the GPU and not yet installed in the store.";
    IO_THREADS_PER_QUEUE = "io_threads_per_queue", Requests, Gauge, No,
        "uzram_io_threads_per_queue",
        "Threads serving each hardware queue.";
    QUEUE_RING_SETUP_FLAGS = "queue_ring_setup_flags", Requests, Gauge, No,
        "uzram_queue_ring_setup_flags",
        "IORING_SETUP_* bits of the queue threads' io_uring rings.";
    QUEUE_USER_COPY = "queue_user_copy", Requests, Gauge, No,
        "uzram_queue_user_copy",
        "1 where requests' data moves by ublk's user copy (UBLK_F_USER_COPY), else 0.";
    RECOMPRESSED_PAGES = "recompressed_pages", Store, Gauge, No,
        "uzram_recompressed_pages",
        "Pages held recompressed (zstd frames, or LZ4 with the device's dictionary, written by the cold tier's recompression).";
    RECOMPRESS_TRIED_PAGES = "recompress_tried_pages", Store, Counter, Sum,
        "uzram_recompress_tried_pages_total",
        "Pages recompression tried.";
    RECOMPRESS_KEPT_PAGES = "recompress_kept_pages", Store, Counter, Sum,
        "uzram_recompress_kept_pages_total",
        "Pages recompression tried and kept as they were (not smaller by a size class).";
    RECOMPRESS_REWRITTEN_PAGES = "recompress_rewritten_pages", Store, Counter, Sum,
        "uzram_recompress_rewritten_pages_total",
        "Pages recompression rewrote smaller (zstd, on the CPU or by nvCOMP on the GPU, or LZ4 from the GPU's tighter parse).";
    RECOMPRESS_SAVED_BYTES = "recompress_saved_bytes", Store, Counter, Sum,
        "uzram_recompress_saved_bytes_total",
        "Payload bytes recompression saved.";
    RECOMPRESS_DICTIONARY_BYTES = "recompress_dictionary_bytes", Store, Gauge, No,
        "uzram_recompress_dictionary_bytes",
        "Bytes of the dictionary the device's idle pages are recompressed with (lz4-gpu-dict; 0 before it is trained).";
    BD_COUNT = "bd_count", Store, Gauge, No,
        "uzram_bd_count",
        "Pages written back: on the backing device now, not in RAM (zram's bd_stat).";
    BD_READS = "bd_reads", Store, Counter, Sum,
        "uzram_bd_reads_total",
        "4 KiB blocks read from the backing device (zram's bd_stat).";
    BD_WRITES = "bd_writes", Store, Counter, Sum,
        "uzram_bd_writes_total",
        "4 KiB blocks written to the backing device (zram's bd_stat).";
    BD_BYTES_WRITTEN = "bd_bytes_written", Store, Counter, Sum,
        "uzram_bd_bytes_written_total",
        "Bytes written to the backing device.";
    BD_FAILURES = "bd_failures", Store, Counter, Sum,
        "uzram_bd_failures_total",
        "Backing-device reads and writes that failed, and written-back blocks that failed their tag (each one an I/O error, never other data).";
    PAGES_AGE_UNDER_1M = "pages_age_under_1m", Store, Gauge, No,
        "uzram_pages_age_under_1m",
        "Pages holding data, used (written or read) in the last minute.";
    PAGES_AGE_UNDER_10M = "pages_age_under_10m", Store, Gauge, No,
        "uzram_pages_age_under_10m",
        "Pages holding data, last used 1 to 10 minutes ago.";
    PAGES_AGE_UNDER_1H = "pages_age_under_1h", Store, Gauge, No,
        "uzram_pages_age_under_1h",
        "Pages holding data, last used 10 minutes to an hour ago.";
    PAGES_AGE_UNDER_1D = "pages_age_under_1d", Store, Gauge, No,
        "uzram_pages_age_under_1d",
        "Pages holding data, last used an hour to a day ago.";
    PAGES_AGE_1D_OR_MORE = "pages_age_1d_or_more", Store, Gauge, No,
        "uzram_pages_age_1d_or_more",
        "Pages holding data, unused for a day or more (or marked idle).";
}

/// The counter named `name`, if it is listed.
pub fn find(name: &str) -> Option<&'static Counter> {
    ALL.iter().find(|c| c.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_store_counter_of_the_core_is_listed_in_the_store_group() {
        let stats = uzram_core::store::Stats::default();
        for (name, _) in stats.fields() {
            let counter = find(name).unwrap_or_else(|| panic!("{name} is not listed"));
            assert_eq!(counter.group, Group::Store, "{name}");
        }
    }

    #[test]
    fn names_and_metrics_are_unique_and_counters_end_in_total() {
        for (i, a) in ALL.iter().enumerate() {
            for b in &ALL[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.metric, b.metric);
            }
            assert_eq!(
                a.kind == Kind::Counter,
                a.metric.ends_with("_total"),
                "{}",
                a.name
            );
            assert!(
                a.carried == Carried::No || a.kind == Kind::Counter || a.carried == Carried::Peak,
                "{}: only counts and peaks go on",
                a.name
            );
        }
    }
}

//! Control messages: one JSON object per line, one request and one response per connection.

use serde::{Deserialize, Serialize};

/// The longest line either side accepts.
pub const MAX_LINE: usize = 64 << 10;

/// What a client asks a daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    /// Report the device's settings and counters.
    Status,
    /// Stop serving and delete the device.
    Stop,
    /// Exit at once and leave the device, its I/O paused, and the store to a new daemon (a
    /// planned restart: `systemctl restart` of the unit).
    Handoff,
    /// Mark pages idle (zram's `idle`): all of them, or those unused for `min_age_minutes`.
    Idle {
        /// Only pages unused this long; `None`: every page.
        #[serde(default)]
        min_age_minutes: Option<u32>,
    },
    /// Recompress now (zram's `recompress`).
    Recompress {
        /// `idle`, `huge` or `huge_idle`.
        kind: String,
        /// Only objects of at least this many bytes.
        #[serde(default)]
        threshold: Option<u64>,
        /// zstd's level; the device's, else the default.
        #[serde(default)]
        level: Option<i32>,
    },
    /// Write pages back to the backing device now (zram's `writeback`).
    Writeback {
        /// `idle`, `huge` or `incompressible`.
        kind: String,
        /// At most this many pages.
        #[serde(default)]
        max_pages: Option<u64>,
    },
}

/// What a daemon answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "lowercase")]
pub enum Response {
    /// Settings and counters.
    Status(DeviceStatus),
    /// The daemon is stopping; the device disappears shortly.
    Stopping,
    /// The daemon exits now and leaves the device to a new one.
    HandingOff,
    /// Pages marked idle.
    Idled {
        /// How many.
        pages: u64,
    },
    /// A recompression pass ran.
    Recompressed(RecompressReport),
    /// A writeback pass ran.
    WrittenBack(WritebackReport),
    /// The request failed or was not understood.
    Error {
        /// Why.
        message: String,
    },
}

/// What a recompression pass did (`uzram recompress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RecompressReport {
    /// Candidates tried.
    pub tried: u64,
    /// Rewritten smaller.
    pub rewritten: u64,
    /// Kept as they were.
    pub kept: u64,
    /// Payload bytes saved.
    pub saved_bytes: u64,
    /// Written while being recompressed (the write won).
    pub raced: u64,
    /// Not rewritten: no memory under the limit, or a failed checksum.
    pub failed: u64,
    /// mem_used_total before and after.
    pub mem_used_before: u64,
    /// See `mem_used_before`.
    pub mem_used_after: u64,
}

/// What a writeback pass did (`uzram writeback`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WritebackReport {
    /// Pages now on the backing device.
    pub pages: u64,
    /// 4 KiB blocks written.
    pub blocks: u64,
    /// Compressed bytes the pages held in RAM.
    pub payload_bytes: u64,
    /// Written while being copied (the write won; they stay in RAM).
    pub raced: u64,
    /// mem_used_total before and after.
    pub mem_used_before: u64,
    /// See `mem_used_before`.
    pub mem_used_after: u64,
    /// What is left of today's `writeback-limit`, when the device has one.
    #[serde(default)]
    pub budget_left_bytes: Option<u64>,
}

/// One counter, named as zram names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// zram's name (`orig_data_size`, `failed_reads`, ...) or a uzram counter.
    pub name: String,
    /// Its value (bytes for sizes, else a count).
    pub value: u64,
}

/// A device's settings and counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// Device id N.
    pub id: u32,
    /// `/dev/ublkbN`.
    pub dev: String,
    /// The daemon's pid.
    pub pid: u32,
    /// Device size in bytes.
    pub size: u64,
    /// WriteBackend algorithm (`lz4`, `zstd:1`, ...).
    pub algorithm: String,
    /// Backend serving writes (`cpu`, ...).
    pub backend: String,
    /// Hardware queues.
    pub queues: u16,
    /// Queue depth.
    pub depth: u16,
    /// How requests reach the queue threads: `batch`, `per-io-daemon` or `per-queue`.
    #[serde(default)]
    pub queue_mode: String,
    /// The store's mm_stat and io_stat fields, in zram's order.
    pub stats: Vec<Stat>,
    /// The daemon's request counters (per operation).
    pub requests: Vec<Stat>,
    /// The compression backend's counters (batches, fallbacks, GPU times); empty for `cpu`.
    #[serde(default)]
    pub backend_stats: Vec<Stat>,
}

impl DeviceStatus {
    /// A store counter by zram name; 0 when the store does not report it.
    pub fn stat(&self, name: &str) -> u64 {
        self.stats
            .iter()
            .find(|s| s.name == name)
            .map_or(0, |s| s.value)
    }
}

/// Encodes a message as one line (with its newline).
pub fn encode<T: Serialize>(msg: &T) -> String {
    // Serializing these plain structs cannot fail; fall back to an error object regardless.
    let mut line = serde_json::to_string(msg)
        .unwrap_or_else(|e| format!("{{\"reply\":\"error\",\"message\":\"encode: {e}\"}}"));
    line.push('\n');
    line
}

/// Decodes one line.
pub fn decode<T: for<'de> Deserialize<'de>>(line: &str) -> Result<T, super::ControlError> {
    serde_json::from_str(line.trim_end()).map_err(|e| super::ControlError::Protocol(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for req in [Request::Status, Request::Stop] {
            assert_eq!(decode::<Request>(&encode(&req)).unwrap(), req);
        }
        assert_eq!(encode(&Request::Stop), "{\"cmd\":\"stop\"}\n");
        let status = Response::Status(DeviceStatus {
            id: 3,
            dev: "/dev/ublkb3".into(),
            pid: 42,
            size: 1 << 30,
            algorithm: "lz4".into(),
            backend: "cpu".into(),
            queues: 2,
            depth: 128,
            queue_mode: "batch".into(),
            stats: vec![Stat {
                name: "orig_data_size".into(),
                value: 8192,
            }],
            requests: vec![],
            backend_stats: Vec::new(),
        });
        let back: Response = decode(&encode(&status)).unwrap();
        assert_eq!(back, status);
        let Response::Status(s) = back else {
            unreachable!()
        };
        assert_eq!(s.stat("orig_data_size"), 8192);
        assert_eq!(s.stat("nonexistent"), 0);
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        assert!(decode::<Request>("{\"cmd\":\"reboot\"}").is_err());
        assert!(decode::<Request>("not json").is_err());
    }
}

//! `uzram list [--json]`: one row per device, zramctl's columns and formatting.

use std::os::unix::fs::MetadataExt;
use std::process::ExitCode;

use serde::Serialize;

use super::{probe, Probe};
use crate::cli::ListArgs;
use crate::control::proto::DeviceStatus;
use crate::control::state::StateDir;
use crate::inuse::{is_active_swap, mountpoint};
use crate::size::format_size;

/// One device as `list --json` prints it (sizes in bytes).
#[derive(Debug, Serialize)]
pub struct Row {
    pub name: String,
    pub disksize: u64,
    pub data: u64,
    pub compr: u64,
    pub algorithm: String,
    pub backend: String,
    pub zero_pages: u64,
    pub total: u64,
    pub mem_limit: u64,
    pub mem_used: u64,
    /// DATA ÷ TOTAL; `None` while nothing is stored.
    pub comp_ratio: Option<f64>,
    pub mountpoint: Option<String>,
}

impl Row {
    pub fn from_status(s: &DeviceStatus, mountpoint: Option<String>) -> Row {
        let data = s.stat("orig_data_size");
        let total = s.stat("mem_used_total");
        Row {
            name: s.dev.clone(),
            disksize: s.size,
            data,
            compr: s.stat("compr_data_size"),
            algorithm: s.algorithm.clone(),
            backend: s.backend.clone(),
            zero_pages: s.stat("same_pages"),
            total,
            mem_limit: s.stat("mem_limit"),
            mem_used: s.stat("mem_used_max"),
            comp_ratio: (total > 0).then(|| data as f64 / total as f64),
            mountpoint,
        }
    }
}

const HEADER: [&str; 12] = [
    "NAME",
    "DISKSIZE",
    "DATA",
    "COMPR",
    "ALGORITHM",
    "BACKEND",
    "ZERO-PAGES",
    "TOTAL",
    "MEM-LIMIT",
    "MEM-USED",
    "COMP-RATIO",
    "MOUNTPOINT",
];
/// Columns printed left-aligned (text); the rest are numbers, right-aligned like zramctl.
const LEFT: [bool; 12] = [
    true, false, false, false, true, true, false, false, false, false, false, true,
];

/// The table, header first; empty when there are no rows (zramctl prints nothing then).
pub fn render(rows: &[Row]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let cells: Vec<[String; 12]> = rows
        .iter()
        .map(|r| {
            [
                r.name.clone(),
                format_size(r.disksize),
                format_size(r.data),
                format_size(r.compr),
                r.algorithm.clone(),
                r.backend.clone(),
                r.zero_pages.to_string(),
                format_size(r.total),
                format_size(r.mem_limit),
                format_size(r.mem_used),
                r.comp_ratio.map_or("-".to_string(), |c| format!("{c:.2}")),
                r.mountpoint.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let header = HEADER.map(str::to_string);
    for row in std::iter::once(&header).chain(&cells) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push(' ');
            }
            if LEFT[i] {
                line.push_str(&format!("{cell:<w$}", w = widths[i]));
            } else {
                line.push_str(&format!("{cell:>w$}", w = widths[i]));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `[SWAP]` when active swap, else the mount point, else nothing.
fn mount_column(dev: &str) -> Option<String> {
    if is_active_swap(dev).unwrap_or(false) {
        return Some("[SWAP]".to_string());
    }
    let rdev = std::fs::metadata(dev).ok()?.rdev();
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountpoint(&info, dev, rdev)
}

pub fn run(args: ListArgs) -> anyhow::Result<ExitCode> {
    super::require_root()?;
    let states = StateDir::default();
    let mut rows = Vec::new();
    for state in states.list()? {
        match probe(&states, &state) {
            Probe::Live(s) => rows.push(Row::from_status(&s, mount_column(&s.dev))),
            Probe::Stale(why) => eprintln!(
                "uzram: {}: {why} (stale state): run uzram destroy {} to clean up",
                state.dev, state.id
            ),
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "devices": rows }))?
        );
    } else {
        print!("{}", render(&rows));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::Stat;

    #[test]
    fn table_matches_zramctl_layout() {
        let stat = |name: &str, value| Stat {
            name: name.into(),
            value,
        };
        let s = DeviceStatus {
            id: 0,
            dev: "/dev/ublkb0".into(),
            pid: 1,
            size: 8 << 30,
            algorithm: "lz4".into(),
            backend: "cpu".into(),
            queues: 2,
            depth: 128,
            queue_mode: "per-queue".into(),
            stats: vec![
                stat("orig_data_size", 12 << 20),
                stat("compr_data_size", (1 << 20) + (1 << 20) / 5),
                stat("mem_used_total", 4 << 20),
                stat("mem_limit", 0),
                stat("mem_used_max", 5 << 20),
                stat("same_pages", 17),
            ],
            requests: vec![],
            backend_stats: Vec::new(),
        };
        let row = Row::from_status(&s, Some("[SWAP]".into()));
        assert_eq!(row.comp_ratio, Some(3.0));
        let table = render(&[row]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2);
        let cols: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "/dev/ublkb0",
                "8G",
                "12M",
                "1.2M",
                "lz4",
                "cpu",
                "17",
                "4M",
                "0B",
                "5M",
                "3.00",
                "[SWAP]"
            ]
        );
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(header, HEADER);
        assert_eq!(render(&[]), "");
    }
}

//! `uzram list`: one row per device, with zramctl's columns, flags and formatting
//! (util-linux `sys-utils/zramctl.c`): `-o/--output LIST` (`+LIST` appends to the defaults),
//! `--output-all`, `-b/--bytes`, `--raw`, `-n/--noheadings`; `--json` prints every field.

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
    /// Hardware queues: each queue's thread compresses its writes with its own codec.
    pub streams: u16,
    pub zero_pages: u64,
    pub total: u64,
    pub mem_limit: u64,
    pub mem_used: u64,
    /// Pages of memory given back by compaction (zram's `pages_compacted`).
    pub migrated: u64,
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
            streams: s.queues,
            zero_pages: s.stat("same_pages"),
            total,
            mem_limit: s.stat("mem_limit"),
            mem_used: s.stat("mem_used_max"),
            migrated: s.stat("pages_compacted"),
            comp_ratio: (total > 0).then(|| data as f64 / total as f64),
            mountpoint,
        }
    }
}

/// A column of the table: zramctl's thirteen, in zramctl's order, then uzram's BACKEND.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    Name,
    Disksize,
    Data,
    Compr,
    Algorithm,
    Streams,
    ZeroPages,
    Total,
    MemLimit,
    MemUsed,
    Migrated,
    CompRatio,
    Mountpoint,
    Backend,
}

impl Column {
    /// Every column, in `--output-all` order.
    pub const ALL: [Column; 14] = [
        Column::Name,
        Column::Disksize,
        Column::Data,
        Column::Compr,
        Column::Algorithm,
        Column::Streams,
        Column::ZeroPages,
        Column::Total,
        Column::MemLimit,
        Column::MemUsed,
        Column::Migrated,
        Column::CompRatio,
        Column::Mountpoint,
        Column::Backend,
    ];

    /// zramctl's default columns, in its order.
    pub const DEFAULT: [Column; 8] = [
        Column::Name,
        Column::Algorithm,
        Column::Disksize,
        Column::Data,
        Column::Compr,
        Column::Total,
        Column::Streams,
        Column::Mountpoint,
    ];

    /// The header, as zramctl spells it.
    pub fn name(self) -> &'static str {
        match self {
            Column::Name => "NAME",
            Column::Disksize => "DISKSIZE",
            Column::Data => "DATA",
            Column::Compr => "COMPR",
            Column::Algorithm => "ALGORITHM",
            Column::Streams => "STREAMS",
            Column::ZeroPages => "ZERO-PAGES",
            Column::Total => "TOTAL",
            Column::MemLimit => "MEM-LIMIT",
            Column::MemUsed => "MEM-USED",
            Column::Migrated => "MIGRATED",
            Column::CompRatio => "COMP-RATIO",
            Column::Mountpoint => "MOUNTPOINT",
            Column::Backend => "BACKEND",
        }
    }

    /// Text columns are left-aligned; numbers are right-aligned, as zramctl does.
    fn left(self) -> bool {
        matches!(
            self,
            Column::Name | Column::Algorithm | Column::Mountpoint | Column::Backend
        )
    }

    fn cell(self, r: &Row, bytes: bool) -> String {
        let size = |b: u64| if bytes { b.to_string() } else { format_size(b) };
        match self {
            Column::Name => r.name.clone(),
            Column::Disksize => size(r.disksize),
            Column::Data => size(r.data),
            Column::Compr => size(r.compr),
            Column::Algorithm => r.algorithm.clone(),
            Column::Streams => r.streams.to_string(),
            Column::ZeroPages => r.zero_pages.to_string(),
            Column::Total => size(r.total),
            Column::MemLimit => size(r.mem_limit),
            Column::MemUsed => size(r.mem_used),
            Column::Migrated => r.migrated.to_string(),
            Column::CompRatio => r.comp_ratio.map_or("-".to_string(), |c| format!("{c:.4}")),
            Column::Mountpoint => r.mountpoint.clone().unwrap_or_default(),
            Column::Backend => r.backend.clone(),
        }
    }
}

/// Why an output list was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ColumnError {
    /// A name that is not a column.
    #[error(
        "unknown column: {} (see uzram list --help for the columns)",
        if .0.is_empty() { "\"\" (an empty name)" } else { .0.as_str() }
    )]
    Unknown(String),
}

/// The columns to print, as zramctl picks them: the defaults (every column with
/// `--output-all`), replaced by `-o LIST` or extended by `-o +LIST`. Names are
/// case-insensitive; a column may appear twice.
pub fn columns(output: Option<&str>, all: bool) -> Result<Vec<Column>, ColumnError> {
    let mut cols: Vec<Column> = if all {
        Column::ALL.to_vec()
    } else {
        Column::DEFAULT.to_vec()
    };
    let Some(list) = output else {
        return Ok(cols);
    };
    let list = match list.strip_prefix('+') {
        Some(rest) => rest,
        None => {
            cols.clear();
            list
        }
    };
    for name in list.split(',') {
        let col = Column::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| ColumnError::Unknown(name.to_string()))?;
        cols.push(col);
    }
    Ok(cols)
}

/// How the table is printed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Format {
    /// Sizes in bytes (`-b`).
    pub bytes: bool,
    /// No alignment, one space between cells, special characters escaped (`--raw`).
    pub raw: bool,
    /// No header line (`-n`).
    pub noheadings: bool,
}

/// libsmartcols' raw-mode encoding: spaces, controls, backslashes and quotes as `\xHH`.
fn raw_escape(cell: &str) -> String {
    let mut out = String::with_capacity(cell.len());
    for c in cell.chars() {
        if c.is_ascii_control() || matches!(c, ' ' | '\\' | '"' | '\'' | '`' | '$') {
            out.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// The table; empty when there are no rows (zramctl prints nothing then).
pub fn render(rows: &[Row], cols: &[Column], fmt: Format) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let header: Vec<String> = cols.iter().map(|c| c.name().to_string()).collect();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| cols.iter().map(|c| c.cell(r, fmt.bytes)).collect())
        .collect();
    let lines = std::iter::once(&header)
        .filter(|_| !fmt.noheadings)
        .chain(&cells);
    let mut out = String::new();
    if fmt.raw {
        for row in lines {
            let line: Vec<String> = row.iter().map(|c| raw_escape(c)).collect();
            out.push_str(&line.join(" "));
            out.push('\n');
        }
        return out;
    }
    let mut widths: Vec<usize> = header.iter().map(String::len).collect();
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    for row in lines {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push(' ');
            }
            if cols[i].left() {
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
    let cols = columns(args.output.as_deref(), args.output_all)?;
    super::require_root()?;
    let states = StateDir::default();
    let mut rows = Vec::new();
    let (listed, damaged) = states.list_all()?;
    for err in damaged {
        eprintln!("uzram: {err}");
    }
    for state in listed {
        match probe(&states, &state) {
            Probe::Live(s) => rows.push(Row::from_status(&s, mount_column(&s.dev))),
            Probe::Orphan => {
                super::warn_orphan(&state);
                let s = super::orphan_status(&state);
                rows.push(Row::from_status(&s, mount_column(&s.dev)));
            }
            Probe::Stale(why) => eprintln!(
                "uzram: {}: {why} (stale state): run uzram destroy {} to clean up",
                state.dev, state.id
            ),
            Probe::Silent(why) => eprintln!("uzram: {}", super::silent_advice(&state, &why)),
        }
    }
    for leftover in super::leftovers::find() {
        eprintln!("uzram: {}", super::leftovers::describe(&leftover));
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "devices": rows }))?
        );
    } else {
        let fmt = Format {
            bytes: args.bytes,
            raw: args.raw,
            noheadings: args.noheadings,
        };
        print!("{}", render(&rows, &cols, fmt));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::Stat;

    fn row(mountpoint: Option<&str>) -> Row {
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
                stat("pages_compacted", 3),
            ],
            requests: vec![],
            backend_stats: Vec::new(),
        };
        Row::from_status(&s, mountpoint.map(str::to_string))
    }

    fn words(line: &str) -> Vec<&str> {
        line.split_whitespace().collect()
    }

    #[test]
    fn defaults_are_zramctls_columns_and_layout() {
        let r = row(Some("[SWAP]"));
        assert_eq!(r.comp_ratio, Some(3.0));
        let cols = columns(None, false).unwrap();
        let table = render(&[r], &cols, Format::default());
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            words(lines[0]),
            [
                "NAME",
                "ALGORITHM",
                "DISKSIZE",
                "DATA",
                "COMPR",
                "TOTAL",
                "STREAMS",
                "MOUNTPOINT"
            ]
        );
        assert_eq!(
            words(lines[1]),
            [
                "/dev/ublkb0",
                "lz4",
                "8G",
                "12M",
                "1.2M",
                "4M",
                "2",
                "[SWAP]"
            ]
        );
        // Numbers are right-aligned under their header, text left-aligned.
        let h = lines[0].find("DISKSIZE").unwrap();
        assert_eq!(&lines[1][h..h + "DISKSIZE".len()], "      8G");
        assert!(lines[1].starts_with("/dev/ublkb0 lz4 "));
        assert_eq!(render(&[], &cols, Format::default()), "");
    }

    #[test]
    fn output_lists_replace_or_extend_the_defaults() {
        use Column::*;
        assert_eq!(
            columns(Some("name,data,MIGRATED"), false).unwrap(),
            [Name, Data, Migrated]
        );
        let plus = columns(Some("+zero-pages,Backend"), false).unwrap();
        assert_eq!(plus.len(), Column::DEFAULT.len() + 2);
        assert_eq!(&plus[..8], Column::DEFAULT);
        assert_eq!(&plus[8..], [ZeroPages, Backend]);
        assert_eq!(columns(None, true).unwrap(), Column::ALL);
        // --output-all with a plain list: the list wins, as in zramctl.
        assert_eq!(columns(Some("NAME"), true).unwrap(), [Name]);
        assert_eq!(columns(Some("+NAME"), true).unwrap().len(), 15);
        for bad in ["NAME,SIZE", "", "NAME,,DATA", "+"] {
            let err = columns(Some(bad), false).unwrap_err();
            assert!(
                err.to_string().starts_with("unknown column"),
                "{bad:?}: {err}"
            );
        }
        assert_eq!(
            columns(Some("NAME,SIZE"), false).unwrap_err(),
            ColumnError::Unknown("SIZE".into())
        );
    }

    #[test]
    fn bytes_raw_and_noheadings() {
        let cols = columns(
            Some("NAME,DISKSIZE,COMPR,STREAMS,MIGRATED,COMP-RATIO,MOUNTPOINT"),
            false,
        )
        .unwrap();
        let r = || row(None);
        let fmt = Format {
            bytes: true,
            raw: true,
            noheadings: false,
        };
        let table = render(&[r()], &cols, fmt);
        assert_eq!(
            table,
            "NAME DISKSIZE COMPR STREAMS MIGRATED COMP-RATIO MOUNTPOINT\n\
             /dev/ublkb0 8589934592 1258291 2 3 3.0000 \n"
        );
        let fmt = Format {
            noheadings: true,
            ..fmt
        };
        assert_eq!(
            render(&[r()], &cols, fmt),
            "/dev/ublkb0 8589934592 1258291 2 3 3.0000 \n"
        );
        let fmt = Format {
            bytes: false,
            raw: false,
            noheadings: true,
        };
        let table = render(&[r(), r()], &cols, fmt);
        assert_eq!(table.lines().count(), 2);
        assert_eq!(words(table.lines().next().unwrap())[1], "8G");
        assert_eq!(raw_escape("/mnt/a b"), "/mnt/a\\x20b");
    }
}

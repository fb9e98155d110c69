//! `uzram status DEV [--json]`: every counter of one device, with zram's names.

use std::process::ExitCode;

use super::{probe, Probe};
use crate::cli::StatusArgs;
use crate::control::proto::DeviceStatus;
use crate::control::state::StateDir;
use crate::devname::{dev_path, parse_device};
use crate::size::format_size;

pub fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let id = parse_device(&args.device).map_err(anyhow::Error::msg)?;
    super::require_root()?;
    let states = StateDir::default();
    let Some(state) = states.read(id)? else {
        anyhow::bail!(
            "unknown device {}: no uzram device with id {id}",
            dev_path(id)
        );
    };
    let status = match probe(&states, &state) {
        Probe::Live(s) => s,
        Probe::Stale(why) => anyhow::bail!(
            "{}: {why} (stale state): run uzram destroy {id} to clean up",
            state.dev
        ),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status));
    }
    Ok(ExitCode::SUCCESS)
}

/// The human-readable report.
pub fn render(s: &DeviceStatus) -> String {
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<18} {v}\n"));
    line("device", s.dev.clone());
    line("pid", s.pid.to_string());
    line("disksize", format!("{} ({})", s.size, format_size(s.size)));
    line("algorithm", s.algorithm.clone());
    line("backend", s.backend.clone());
    line("queues", s.queues.to_string());
    line("depth", s.depth.to_string());
    for stat in s.stats.iter().chain(&s.requests) {
        line(&stat.name, stat.value.to_string());
    }
    out
}

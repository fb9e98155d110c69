//! `uzram swap-on|swap-off --config FILE`: activate or deactivate swap on the device that
//! `uzram run --config FILE` serves (the systemd unit's ExecStartPost and ExecStop).

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::Context;

use crate::cli::ConfigArg;
use crate::config::load_config;
use crate::control::state::StateDir;
use crate::inuse::swap_active;

fn device_for(config: &Path) -> anyhow::Result<String> {
    let want = std::fs::canonicalize(config).unwrap_or_else(|_| config.to_path_buf());
    StateDir::default()
        .list()?
        .into_iter()
        .find(|s| s.config.as_deref() == Some(want.as_path()))
        .map(|s| s.dev)
        .with_context(|| {
            format!(
                "no running uzram device was started from {}",
                want.display()
            )
        })
}

fn exec(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        anyhow::bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

pub fn on(args: ConfigArg) -> anyhow::Result<ExitCode> {
    let cfg = load_config(&args.config)?;
    super::require_root()?;
    let dev = device_for(&args.config)?;
    exec(Command::new("mkswap").arg(&dev))?;
    let mut swapon = Command::new("swapon");
    if let Some(prio) = cfg.swap.priority {
        swapon.arg("-p").arg(prio.to_string());
    }
    if let Some(opts) = &cfg.swap.options {
        swapon.arg("-o").arg(opts);
    }
    exec(swapon.arg(&dev))?;
    Ok(ExitCode::SUCCESS)
}

pub fn off(args: ConfigArg) -> anyhow::Result<ExitCode> {
    load_config(&args.config)?;
    super::require_root()?;
    let dev = device_for(&args.config)?;
    let swaps = std::fs::read_to_string("/proc/swaps").context("reading /proc/swaps")?;
    if swap_active(&swaps, &dev) {
        exec(Command::new("swapoff").arg(&dev))?;
    }
    Ok(ExitCode::SUCCESS)
}

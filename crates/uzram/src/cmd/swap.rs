//! `uzram swap-on|swap-off --config FILE`: activate or deactivate swap on the device that
//! `uzram run --config FILE` serves (the systemd unit's ExecStartPost and ExecStop).

use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cli::{ConfigArg, SwapOffArgs};
use crate::config::{load_config, load_device_config, Plan};
use crate::control::state::StateDir;
use crate::inuse::is_active_swap;

fn device_for(config: &Path) -> anyhow::Result<String> {
    let want = std::fs::canonicalize(config).unwrap_or_else(|_| config.to_path_buf());
    super::handover::newest_live(StateDir::default().list()?, &want, None)
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
    let cfg = load_device_config(&args.config)?;
    super::require_root()?;
    let dev = device_for(&args.config)?;
    if is_swap(&dev)? {
        // A daemon that recovered the device after a crash: swap never went off, and mkswap
        // would wipe every page in it.
        eprintln!("uzram: {dev} is already active swap (a recovered device): nothing to do");
        return Ok(ExitCode::SUCCESS);
    }
    exec(Command::new("mkswap").arg(&dev))?;
    // Through /dev/zram-uzram/ublkbN, the path systemd skips when it picks a hibernation
    // device (hibernate.rs); the daemon made it, this only repairs a missing one.
    let target = match crate::hibernate::create_alias(&dev) {
        Ok(alias) => alias.to_string_lossy().into_owned(),
        Err(err) => {
            eprintln!(
                "uzram: warning: cannot create {}: {err}; activating swap on {dev}, which \
                 systemd may choose for hibernation (docs/hibernation.md)",
                crate::hibernate::alias_path(&dev).display()
            );
            dev.clone()
        }
    };
    let mut swapon = Command::new("swapon");
    if let Some(prio) = cfg.swap.priority {
        swapon.arg("-p").arg(prio.to_string());
    }
    if let Some(opts) = &cfg.swap.options {
        swapon.arg("-o").arg(opts);
    }
    exec(swapon.arg(&target))?;
    Ok(ExitCode::SUCCESS)
}

pub fn off(off_args: SwapOffArgs) -> anyhow::Result<ExitCode> {
    let args = off_args.config;
    // The device is found by the file's path, not by what the file says now: one edited,
    // broken or removed since its device was made must not keep that device's swap on (the
    // unit's stop would then wait for a swapoff until its timeout, 15 minutes).
    let made = device_for(&args.config).is_ok();
    match load_config(&args.config) {
        Ok(Plan::Skip(_)) if !made => {
            // No device was made from this file here: nothing to deactivate.
            return Ok(ExitCode::SUCCESS);
        }
        Err(err) if !made => return Err(err.into()),
        Err(err) => eprintln!(
            "uzram: {}: {err:#}; turning swap off on the device made from it anyway",
            args.config.display()
        ),
        Ok(_) => {}
    }
    super::require_root()?;
    let canonical = std::fs::canonicalize(&args.config).unwrap_or_else(|_| args.config.clone());
    // A dead record counts only while no daemon serves the file's device: a record left by
    // an earlier daemon whose device was deleted must not keep the current device's swap on.
    let orphan = (!made)
        .then(|| crate::takeover::orphan::dead_record_of_config(&canonical))
        .flatten()
        .filter(|o| crate::devname::in_kernel(o.id));
    if let Some(orphan) = orphan {
        // The daemon died (systemd runs ExecStop after a crash too): swapoff would wait for
        // a server that is not there. Swap stays on; its standby or the restarted daemon
        // recovers the device.
        eprintln!(
            "uzram: {}: its daemon died; swap stays on for the next daemon to recover",
            orphan.dev
        );
        return Ok(ExitCode::SUCCESS);
    }
    let states = StateDir::default();
    if let Some(bridge) = super::handover::live_daemon(&states, &canonical, Some(true)) {
        // The daemon died and its standby took the device over: the unit's next daemon
        // takes it from there, with swap on.
        eprintln!(
            "uzram: {}: served by a bridge daemon (pid {}) until the next daemon takes it over; swap stays on",
            bridge.dev, bridge.pid
        );
        return Ok(ExitCode::SUCCESS);
    }
    if !made {
        // The daemon exited (`uzram destroy`, or it stopped on its own) and left nothing to
        // recover: no device of this file is left to turn swap off on.
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(unit) = off_args.unit.as_deref().filter(|u| restarting(u)) {
        return hand_off(&states, &canonical, unit);
    }
    let dev = device_for(&args.config)?;
    if !is_swap(&dev)? {
        return Ok(ExitCode::SUCCESS);
    }
    if let Err(err) = super::swapoff::run(&dev) {
        // At shutdown systemd stops its own swap unit for the device (dev-ublkbN.swap) at the
        // same time, and the second swapoff fails with EINVAL while the first still reads
        // pages back. The device is off swap once /proc/swaps no longer lists it.
        eprintln!("uzram: {err:#}; waiting for {dev} to leave /proc/swaps");
        let start = Instant::now();
        while is_swap(&dev)? {
            if start.elapsed() > SWAPOFF_WAIT {
                anyhow::bail!(
                    "{dev} is still active swap after {} s: run swapoff {dev}",
                    SWAPOFF_WAIT.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// How long `swap-off` waits for somebody else's swapoff of the device to finish (it reads
/// every swapped-out page back; the unit allows 15 minutes to stop).
const SWAPOFF_WAIT: Duration = Duration::from_secs(14 * 60);

fn is_swap(dev: &str) -> anyhow::Result<bool> {
    is_active_swap(dev).context("reading /proc/swaps")
}

/// Whether systemd is running a restart job for `unit` (this is then its ExecStop).
fn restarting(unit: &str) -> bool {
    let Ok(out) = Command::new("systemctl")
        .args(["list-jobs", "--no-legend", "--no-pager"])
        .output()
    else {
        return false;
    };
    String::from_utf8_lossy(&out.stdout).lines().any(|line| {
        let mut words = line.split_whitespace().skip(1);
        words.next() == Some(unit) && matches!(words.next(), Some("restart" | "try-restart"))
    })
}

/// A planned restart: the device goes, through a bridge daemon, to the daemon systemd
/// starts next (`handover`); swap stays on and nothing is swapped in.
fn hand_off(states: &StateDir, config: &Path, unit: &str) -> anyhow::Result<ExitCode> {
    let Some(old) = super::handover::live_daemon(states, config, Some(false)) else {
        return Ok(ExitCode::SUCCESS);
    };
    super::handover::restart_through_bridge(config, unit, &old)?;
    Ok(ExitCode::SUCCESS)
}

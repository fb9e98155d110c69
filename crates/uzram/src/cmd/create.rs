//! `uzram create`: start a detached daemon for one device and print its path when it serves.

use std::process::{ExitCode, Stdio};
use std::sync::Arc;

use anyhow::Context;

use crate::cli::CreateArgs;
use crate::daemon::{self, Launch, Readiness, Reporter};

pub fn run(args: CreateArgs) -> anyhow::Result<ExitCode> {
    let config = args
        .device
        .raw()
        .validate(crate::config::Host::current()?)?;
    super::require_root()?;
    super::require_module()?;
    if args.foreground {
        let launch = Launch {
            config,
            config_path: None,
            log: None,
            recover: None,
            settings: Some(Box::new(args.device.raw())),
            bridge: false,
            pause: None,
            lock: None,
        };
        daemon::serve(launch, Arc::new(Reporter::new(Readiness::Stdout)))?;
        return Ok(ExitCode::SUCCESS);
    }
    let dev = super::spawn::start_detached(args.device.to_args())?;
    println!("{dev}");
    if args.no_standby {
        eprintln!(
            "uzram: warning: {dev} has no standby (--no-standby): if its daemon dies, its I/O \
             waits until `uzram recover {dev}` starts a new one, and under memory pressure \
             nothing may be able to start; `uzram recover --wait --keep {dev}` starts one later"
        );
    } else {
        start_standby(&dev).with_context(|| {
            format!("{dev} serves, but its standby did not start: run uzram recover --wait --keep {dev}")
        })?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts `uzram recover --wait --keep DEV`, detached, logging to the kernel's log: a file
/// on tmpfs could have its pages in swap on the very device the standby waits to recover.
/// Warnings only (unless UZRAM_LOG says otherwise): the kernel drops a burst of user lines.
fn start_standby(dev: &str) -> anyhow::Result<()> {
    let log = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/kmsg")
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
    let mut cmd = super::spawn::this_binary();
    cmd.args(["recover", "--wait", "--keep", dev])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // Not waited for: it outlives this command, and its parent becomes init.
    let child = cmd.spawn().context("starting the standby")?;
    tracing::info!(%dev, pid = child.id(), "standby started");
    Ok(())
}

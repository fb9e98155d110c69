//! `uzram run --config FILE`: serve in the foreground for systemd (`Type=notify`).

use std::process::ExitCode;
use std::sync::Arc;

use crate::cli::RunArgs;
use crate::config::load_device_config;
use crate::daemon::{self, Launch, Readiness, Reporter};

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let cfg = load_device_config(&args.config)?;
    super::require_root()?;
    super::require_module()?;
    let config_path = std::fs::canonicalize(&args.config).unwrap_or(args.config);
    let orphan = super::recover::orphan_of_config(&config_path);
    if let Some(state) = &orphan {
        tracing::info!(id = state.id, config = %config_path.display(), "this config's device lost its daemon: recovering it");
        super::recover::make_room(state);
    }
    let recover = orphan.map(|s| s.id);
    let launch = Launch {
        config: cfg.device,
        config_path: Some(config_path),
        log: None,
        recover,
        create_args: None,
    };
    daemon::serve(launch, Arc::new(Reporter::new(Readiness::Systemd)))?;
    Ok(ExitCode::SUCCESS)
}

//! `uzram check-config --config FILE`: what a config file makes on this host. The systemd
//! unit runs it as `ExecCondition=`, which is how zram-generator's "no device" cases (more
//! RAM than `host-memory-limit`, a size of 0) skip the unit instead of failing it: systemd
//! skips a unit whose condition exits 1..=254 and fails it on 255.

use std::process::ExitCode;

use crate::cli::ConfigArg;
use crate::config::{load_config, Plan};
use crate::size::format_size;

/// Exit status for an invalid file: 255, so `ExecCondition=` fails the unit, not skips it.
const INVALID: u8 = 255;

pub fn run(args: ConfigArg) -> anyhow::Result<ExitCode> {
    let path = args.config.display();
    match load_config(&args.config) {
        Ok(Plan::Device(cfg)) => {
            let d = &cfg.device;
            println!(
                "{path}: a device of {} ({} bytes), {}, backend {:?}, memory limit {}{}",
                format_size(d.size),
                d.size,
                d.algorithm,
                d.backend,
                d.mem_limit.map_or("none".to_string(), format_size),
                d.metrics_textfile
                    .as_ref()
                    .map_or(String::new(), |p| format!(", metrics in {}", p.display())),
            );
            Ok(ExitCode::SUCCESS)
        }
        Ok(Plan::Skip(why)) => {
            println!("{path}: no device on this host: {why}");
            Ok(ExitCode::from(1))
        }
        Err(err) => {
            eprintln!("uzram: error: {:#}", anyhow::Error::new(err));
            Ok(ExitCode::from(INVALID))
        }
    }
}

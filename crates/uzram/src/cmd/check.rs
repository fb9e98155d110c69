//! `uzram check-config [--config SPEC]`: what a config makes on this host. The systemd unit
//! runs it as `ExecCondition=`, which is how zram-generator's "no device" cases (more RAM than
//! `host-memory-limit`, a size of 0) skip the unit instead of failing it: systemd skips a unit
//! whose condition exits 1..=254 and fails it on 255. Without `--config` it explains every
//! device configured on the host, zram-generator's sections included, and what of each uzram
//! does not do.

use std::path::Path;
use std::process::ExitCode;

use crate::cli::CheckArgs;
use crate::config::file::RunConfig;
use crate::config::zram_generator::section_of_spec;
use crate::config::{load_config, sources, zram_generator, ConfigError, Host, Plan};
use crate::size::format_size;

/// Exit status for an invalid config: 255, so `ExecCondition=` fails the unit, not skips it.
const INVALID: u8 = 255;

pub fn run(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let Some(spec) = args.config else {
        return every_source();
    };
    let code = report(&spec.display().to_string(), load_config(&spec), &[]);
    Ok(ExitCode::from(code))
}

/// Prints what `plan` makes and returns the exit status: 0 a device, 1 none, 255 invalid.
fn report(what: &str, plan: Result<Plan, ConfigError>, notes: &[String]) -> u8 {
    for note in notes {
        println!("{what}: note: {note}");
    }
    match plan {
        Ok(Plan::Device(cfg)) => {
            println!("{what}: {}", describe(&cfg));
            0
        }
        Ok(Plan::Skip(why)) => {
            println!("{what}: no device on this host: {why}");
            1
        }
        Err(err) => {
            eprintln!("uzram: error: {:#}", anyhow::Error::new(err));
            INVALID
        }
    }
}

fn describe(cfg: &RunConfig) -> String {
    let d = &cfg.device;
    format!(
        "a device of {} ({} bytes), {}, backend {:?}, memory limit {}{}; swap priority {}, \
         options {}",
        format_size(d.size),
        d.size,
        d.algorithm,
        d.backend,
        d.mem_limit.map_or("none".to_string(), format_size),
        d.metrics_textfile
            .as_ref()
            .map_or(String::new(), |p| format!(", metrics in {}", p.display())),
        cfg.swap
            .priority
            .map_or("the kernel's".to_string(), |p| p.to_string()),
        cfg.swap.options.as_deref().unwrap_or("none"),
    )
}

/// Every configured device, each under its unit's name. 255 if any is invalid.
fn every_source() -> anyhow::Result<ExitCode> {
    let (list, notes) = sources::on_host()?;
    for note in &notes {
        println!("note: {note}");
    }
    if list.is_empty() {
        println!(
            "no device is configured: no /etc/uzram/*.toml, and no [zramN] section in \
             zram-generator.conf"
        );
        return Ok(ExitCode::SUCCESS);
    }
    let host = Host::current()?;
    let zg = zram_generator::read_host()?;
    let mut worst = 0;
    for source in list {
        let what = format!("uzram@{}.service ({})", source.name, source.spec.display());
        let code = match section_of_spec(&source.spec) {
            Some(name) => match zg.devices.get(name) {
                Some(section) => {
                    let planned = section.plan(host);
                    report(&what, planned.plan, &planned.notes)
                }
                None => report(&what, load_config(Path::new(&source.spec)), &[]),
            },
            None => report(&what, load_config(&source.spec), &[]),
        };
        if code == INVALID {
            worst = INVALID;
        }
    }
    Ok(ExitCode::from(worst))
}

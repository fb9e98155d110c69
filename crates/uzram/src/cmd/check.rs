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
use crate::config::{load_config, sources, ConfigError, Host, Plan};
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
        Ok(Plan::Device(cfg)) => match paths_hold(&cfg) {
            Ok(()) => {
                println!("{what}: {}", describe(&cfg));
                0
            }
            Err(err) => {
                eprintln!("uzram: error: {what}: {err:#}");
                INVALID
            }
        },
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

/// The daemon's checks of the paths a config names, made before it starts serving: the
/// metrics file's directory, and what is at the backing device's path (nothing is opened
/// for writing or read).
fn paths_hold(cfg: &RunConfig) -> anyhow::Result<()> {
    let named = cfg.device.metrics_textfile.is_some() || cfg.device.writeback.is_some();
    if named && !crate::sys::is_root() {
        // The daemon judges them as root: another user can neither see into root's
        // directories nor be trusted with what they own.
        println!("note: the paths the config names are checked only when run as root");
        return Ok(());
    }
    if let Some(path) = &cfg.device.metrics_textfile {
        crate::metrics::check_textfile_dir(path)?;
    }
    if let Some(wb) = &cfg.device.writeback {
        crate::daemon::backing::precheck(&wb.device)?;
    }
    Ok(())
}

fn describe(cfg: &RunConfig) -> String {
    let d = &cfg.device;
    format!(
        "a device of {} ({} bytes), {}, backend {}, memory limit {}{}{}{}; swap priority {}, \
         options {}",
        format_size(d.size),
        d.size,
        d.algorithm,
        d.backend.name(),
        d.mem_limit.map_or("none".to_string(), format_size),
        d.recompress.as_ref().map_or(String::new(), |r| format!(
            ", pages idle {} min recompressed with {}",
            r.idle_age_minutes,
            r.codec.name()
        )),
        d.writeback.as_ref().map_or(String::new(), |w| format!(
            ", pages idle {} min written back to {}",
            w.idle_age_minutes,
            w.device.display()
        )),
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
    let configured = sources::on_host();
    for note in &configured.notes {
        println!("note: {note}");
    }
    let list = configured.sources;
    let zg = match configured.zram_generator {
        Ok(zg) => Some(zg),
        Err(err) => {
            eprintln!(
                "uzram: error: zram-generator's configuration makes no device: {:#}",
                anyhow::Error::new(err)
            );
            None
        }
    };
    let broken = zg.is_none();
    if list.is_empty() && broken {
        return Ok(ExitCode::from(INVALID));
    }
    if list.is_empty() {
        println!(
            "no device is configured: no /etc/uzram/*.toml, and no [zramN] section in \
             zram-generator.conf"
        );
        return Ok(ExitCode::SUCCESS);
    }
    let host = Host::current()?;
    let zg = zg.unwrap_or_default();
    let mut worst = if broken { INVALID } else { 0 };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> Result<Plan, ConfigError> {
        crate::config::file::parse_config(Path::new("t.toml"), text, Host::with_ram(8192))
    }

    /// What the daemon would refuse at its start, check-config refuses too (255): a metrics
    /// directory others may write or that is missing, and a writeback device that is a
    /// directory, a character device or a name under /dev that is no device.
    #[test]
    fn paths_the_daemon_refuses_are_invalid() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let good = dir.path().join("good");
        std::fs::create_dir(&good).unwrap();
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o755)).unwrap();
        let size = "size = \"64M\"\n";
        let ok = format!(
            "{size}metrics-textfile = \"{}/u.prom\"\nwriteback-device = \"{}/wb\"\n",
            good.display(),
            good.display()
        );
        assert_eq!(report("ok", plan(&ok), &[]), 0);
        for bad in [
            format!("{size}metrics-textfile = \"{}/u.prom\"\n", shared.display()),
            format!(
                "{size}metrics-textfile = \"{}/missing/u.prom\"\n",
                good.display()
            ),
            format!("{size}writeback-device = \"{}\"\n", good.display()),
            format!("{size}writeback-device = \"/dev/null\"\n"),
            format!("{size}writeback-device = \"/dev/uzram-no-such-disk\"\n"),
        ] {
            assert!(plan(&bad).is_ok(), "the file itself parses: {bad}");
            assert_eq!(report("bad", plan(&bad), &[]), INVALID, "{bad}");
        }
    }
}

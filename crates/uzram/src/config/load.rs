//! A device's config as the command line names it (`--config`): a uzram TOML file, or
//! `zram-generator:zramN` for a section of zram-generator's configuration.

use std::path::Path;

use super::device::{ConfigError, Host};
use super::file::{self, Plan, RunConfig};
use super::zram_generator;

/// Reads and parses a config file for this host; `zram-generator:zramN` names a section of
/// zram-generator's configuration instead.
pub fn load_config(path: &Path) -> Result<Plan, ConfigError> {
    if let Some(name) = zram_generator::section_of_spec(path) {
        return zram_generator::load_section(name);
    }
    if let Some(name) = path
        .to_str()
        .and_then(|p| p.strip_prefix(zram_generator::SPEC_PREFIX))
    {
        return Err(ConfigError::Parse {
            path: path.to_path_buf(),
            message: format!(
                "{name:?} is not a zram-generator device section: name one as \
                 zram-generator:zramN (zram0, zram1, ...)"
            ),
        });
    }
    let text = file::read_capped(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    file::parse_config(path, &text, Host::current()?)
}

/// Reads a config file that must make a device here (`uzram run`, `uzram swap-on`).
pub fn load_device_config(path: &Path) -> Result<RunConfig, anyhow::Error> {
    match load_config(path)? {
        Plan::Device(cfg) => Ok(*cfg),
        Plan::Skip(why) => anyhow::bail!(
            "{}: no device on this host: {why} (the systemd unit skips it through \
             ExecCondition=uzram check-config)",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `zram-generator:` spec that names no device section says how to name one, instead
    /// of looking for a file of that name.
    #[test]
    fn a_spec_without_a_device_section_says_how_to_name_one() {
        for spec in ["zram-generator:foo", "zram-generator:"] {
            let err = load_config(Path::new(spec)).unwrap_err().to_string();
            assert!(
                err.contains("is not a zram-generator device section")
                    && err.contains("zram-generator:zramN"),
                "{spec}: {err}"
            );
        }
    }
}

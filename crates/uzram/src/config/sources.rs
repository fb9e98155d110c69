//! Every device configured on a host: uzram's own files (`/etc/uzram/NAME.toml`) and
//! zram-generator's sections (`[zramN]`), each under the name its systemd unit instance
//! takes (`uzram@NAME.service`).

use std::path::{Path, PathBuf};

use super::device::ConfigError;
use super::zram_generator::{self, ZramGeneratorConfig};

/// Where uzram's own config files live.
pub const UZRAM_DIR: &str = "etc/uzram";

/// One configured device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The unit instance name: the file's stem, or the section's name.
    pub name: String,
    /// What `--config` takes for it: the file, or `zram-generator:zramN`.
    pub spec: PathBuf,
}

/// The devices configured under `root`, uzram's files first, then zram-generator's
/// sections; a section whose name a uzram file already has is left out, with a note.
pub fn all(root: &Path, cmdline: &str) -> Result<(Vec<Source>, Vec<String>), ConfigError> {
    let mut sources = uzram_files(root);
    let zg: ZramGeneratorConfig = zram_generator::read(root, cmdline)?;
    let mut notes = zg.notes;
    if zg.disabled_by_cmdline {
        notes.push(
            "systemd.zram=0 on the kernel command line: zram-generator's sections make no device"
                .into(),
        );
    }
    for name in zg.devices.keys() {
        if sources.iter().any(|s| &s.name == name) {
            notes.push(format!(
                "[{name}] of zram-generator's configuration is left out: {} has the same name",
                root.join(UZRAM_DIR).join(format!("{name}.toml")).display()
            ));
            continue;
        }
        sources.push(Source {
            name: name.clone(),
            spec: zram_generator::spec_of(name),
        });
    }
    Ok((sources, notes))
}

/// This host's devices.
pub fn on_host() -> Result<(Vec<Source>, Vec<String>), ConfigError> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    all(Path::new("/"), &cmdline)
}

/// `/etc/uzram/*.toml`, by name; names a unit instance cannot take are skipped.
fn uzram_files(root: &Path) -> Vec<Source> {
    let Ok(entries) = std::fs::read_dir(root.join(UZRAM_DIR)) else {
        return Vec::new();
    };
    let mut out: Vec<Source> = entries
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let name = path.file_stem()?.to_str()?.to_string();
            let usable = path.extension()? == "toml"
                && !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
            let spec = Path::new("/").join(UZRAM_DIR).join(path.file_name()?);
            usable.then_some(Source { name, spec })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uzram_files_come_first_and_shadow_sections_of_the_same_name() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc/uzram");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join("swap0.toml"), "size = \"1G\"\n").unwrap();
        std::fs::write(etc.join("zram1.toml"), "size = \"1G\"\n").unwrap();
        std::fs::write(etc.join("notes.txt"), "").unwrap();
        let sd = dir.path().join("etc/systemd");
        std::fs::create_dir_all(&sd).unwrap();
        std::fs::write(sd.join("zram-generator.conf"), "[zram0]\n[zram1]\n").unwrap();
        let (sources, notes) = all(dir.path(), "").unwrap();
        let names: Vec<_> = sources
            .iter()
            .map(|s| (s.name.as_str(), s.spec.clone()))
            .collect();
        assert_eq!(
            names,
            [
                ("swap0", PathBuf::from("/etc/uzram/swap0.toml")),
                ("zram1", PathBuf::from("/etc/uzram/zram1.toml")),
                ("zram0", PathBuf::from("zram-generator:zram0")),
            ]
        );
        assert!(notes.iter().any(|n| n.contains("[zram1]")), "{notes:?}");
        let (off, notes) = all(dir.path(), "systemd.zram=0").unwrap();
        assert_eq!(off.len(), 2, "uzram's own files stay");
        assert!(notes.iter().any(|n| n.contains("systemd.zram=0")));
    }
}

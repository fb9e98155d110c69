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

/// Every device configured on a host, and what was left out.
#[derive(Debug)]
pub struct Configured {
    /// uzram's files first, then zram-generator's sections.
    pub sources: Vec<Source>,
    /// What was left out, and why.
    pub notes: Vec<String>,
    /// zram-generator's configuration as read (its notes moved to `notes`), or why it could
    /// not be: none of its sections is known then, and uzram's own files still make their
    /// devices.
    pub zram_generator: Result<ZramGeneratorConfig, ConfigError>,
}

/// The devices configured under `root`, uzram's files first, then zram-generator's
/// sections; a section whose name a uzram file already has is left out, with a note. A
/// broken zram-generator configuration leaves out its own sections only.
pub fn all(root: &Path, cmdline: &str) -> Configured {
    let (mut sources, mut notes) = uzram_files(root);
    let mut zg: ZramGeneratorConfig = match zram_generator::read(root, cmdline) {
        Ok(zg) => zg,
        Err(err) => {
            return Configured {
                sources,
                notes,
                zram_generator: Err(err),
            }
        }
    };
    notes.append(&mut zg.notes);
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
    Configured {
        sources,
        notes,
        zram_generator: Ok(zg),
    }
}

/// This host's devices.
pub fn on_host() -> Configured {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    all(Path::new("/"), &cmdline)
}

/// `/etc/uzram/*.toml`, by name; a name a unit instance cannot take is left out, with a
/// note.
fn uzram_files(root: &Path) -> (Vec<Source>, Vec<String>) {
    let Ok(entries) = std::fs::read_dir(root.join(UZRAM_DIR)) else {
        return (Vec::new(), Vec::new());
    };
    let mut notes = Vec::new();
    let mut out: Vec<Source> = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(stem) = file_name
            .to_string_lossy()
            .strip_suffix(".toml")
            .map(String::from)
        else {
            continue;
        };
        let name = Some(stem).filter(|n| {
            !n.is_empty()
                && file_name.to_str().is_some()
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        });
        match name {
            Some(name) => out.push(Source {
                name,
                spec: Path::new("/").join(UZRAM_DIR).join(&file_name),
            }),
            None => notes.push(format!(
                "{} is left out: a unit's name takes only letters, digits, '-', '_' and '.' \
                 before .toml; rename it",
                Path::new("/").join(UZRAM_DIR).join(&file_name).display()
            )),
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    notes.sort();
    (out, notes)
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
        std::fs::write(etc.join("we ird.toml"), "size = \"1G\"\n").unwrap();
        std::fs::write(etc.join(".toml"), "size = \"1G\"\n").unwrap();
        let Configured { sources, notes, .. } = all(dir.path(), "");
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
        for odd in ["we ird.toml", "/.toml"] {
            assert!(
                notes
                    .iter()
                    .any(|n| n.contains(odd) && n.contains("is left out")),
                "{odd}: {notes:?}"
            );
        }
        let Configured {
            sources: off,
            notes,
            ..
        } = all(dir.path(), "systemd.zram=0");
        assert_eq!(off.len(), 2, "uzram's own files stay");
        assert!(notes.iter().any(|n| n.contains("systemd.zram=0")));
    }

    /// A zram-generator.conf that cannot be read leaves out its own sections only: uzram's
    /// files still make their devices, and the reason is kept for the caller to report.
    #[test]
    fn a_broken_zram_generator_conf_leaves_uzram_files_in() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc/uzram");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join("swap0.toml"), "size = \"1G\"\n").unwrap();
        let sd = dir.path().join("etc/systemd");
        std::fs::create_dir_all(&sd).unwrap();
        for broken in [&b"[zram0\n"[..], b"\xff\xfe[zram0]\n"] {
            std::fs::write(sd.join("zram-generator.conf"), broken).unwrap();
            let got = all(dir.path(), "");
            let names: Vec<_> = got.sources.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names, ["swap0"]);
            let err = got.zram_generator.expect_err("the error is kept");
            assert!(
                err.to_string().contains("zram-generator.conf"),
                "names the file: {err}"
            );
        }
    }
}

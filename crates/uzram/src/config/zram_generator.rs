//! zram-generator's configuration, read as zram-generator reads it, so that a host that
//! switches from zram to uzram keeps its config files unchanged.
//!
//! - One main file, the first that exists of `/run`, `/etc`, `/usr/local/lib` and `/usr/lib`
//!   (`systemd/zram-generator.conf` in each); a symlink to `/dev/null` counts, and masks the
//!   rest.
//! - Drop-ins `systemd/zram-generator.conf.d/*.conf` from the same four places: a name in a
//!   later place (`/run` last) replaces the same name in an earlier one, a symlink to
//!   `/dev/null` removes it, and the drop-ins apply in name order after the main file.
//! - Sections `[zramN]` of the same name merge across files, key by key, the later file
//!   winning. Other sections are ignored with a note.
//! - The kernel command line's `systemd.zram=0` (or `no`, `false`, `off`) makes no device;
//!   `systemd.zram` (or `=1`, `yes`, `true`, `on`) adds `zram0` with the defaults when no
//!   file defines it.
//!
//! Every key zram-generator knows is read. What uzram cannot do is said, naming the key: a
//! `mount-point` or an `fs-type` other than swap refuses that device (it would not be swap);
//! `fs-create-options` leaves the device as swap without it, with a note; `writeback-device`
//! is taken as uzram's own key of that name (and checked as it is); a second
//! `compression-algorithm` that is zstd recompresses pages that went unused
//! (`recompress-algorithm`), others are noted; `set!` variables are not run (a size expression that uses
//! one fails and says so). uzram's own keys (`backend`, `queues`, ...) are accepted in a
//! section too. Unknown keys are ignored with a note, as zram-generator ignores them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::device::{ConfigError, Host};
use super::file::{plan, read_capped, FileConfig, Plan};

/// The places zram-generator reads, from lowest precedence to highest.
const BASES: [&str; 4] = ["usr/lib", "usr/local/lib", "etc", "run"];
/// The main file's path under each base.
const MAIN: &str = "systemd/zram-generator.conf";
/// The drop-in folder under each base.
const DROPINS: &str = "systemd/zram-generator.conf.d";

/// How a section is named where a path is expected (`uzram run --config`, a unit's
/// `UZRAM_CONFIG`, the recovery record): `zram-generator:zram0`.
pub const SPEC_PREFIX: &str = "zram-generator:";

/// zram-generator's configuration on a host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ZramGeneratorConfig {
    /// The files read, in the order applied.
    pub files: Vec<PathBuf>,
    /// Devices by section name, in name order.
    pub devices: BTreeMap<String, Section>,
    /// What was ignored outside the devices (a section that is no device, `set!`).
    pub notes: Vec<String>,
    /// `systemd.zram=0` on the kernel command line: no device at all.
    pub disabled_by_cmdline: bool,
}

/// One `[zramN]` section, its keys merged over every file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Section {
    /// `zram0`.
    pub name: String,
    /// Key, value and the file it came from, the winning value of each key.
    pub keys: BTreeMap<String, (String, PathBuf)>,
}

/// A section read into uzram's settings.
#[derive(Debug)]
pub struct SectionPlan {
    /// What the section makes on this host.
    pub plan: Result<Plan, ConfigError>,
    /// What of it uzram does not do, each naming its key; the device starts without it.
    pub notes: Vec<String>,
}

/// Whether the kernel command line turns zram-generator's devices on (`Some(true)`) or off.
pub fn cmdline_switch(cmdline: &str) -> Option<bool> {
    let mut switch = None;
    for word in cmdline.split_whitespace() {
        let value = match word.split_once('=') {
            Some(("systemd.zram", v)) => v,
            None if word == "systemd.zram" => "1",
            _ => continue,
        };
        match value {
            "1" | "yes" | "true" | "on" => switch = Some(true),
            "0" | "no" | "false" | "off" => switch = Some(false),
            _ => {}
        }
    }
    switch
}

/// The files zram-generator would read under `root` (`/` on a host), in the order applied.
pub fn files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let main = BASES
        .iter()
        .rev()
        .map(|base| root.join(base).join(MAIN))
        // exists() follows a link: a dangling one is passed over, as zram-generator does
        // (a mask's link to /dev/null exists).
        .find(|p| p.exists());
    if let Some(main) = main.filter(|p| !is_masked(p)) {
        out.push(main);
    }
    let mut dropins: BTreeMap<std::ffi::OsString, PathBuf> = BTreeMap::new();
    for base in BASES {
        let Ok(entries) = std::fs::read_dir(root.join(base).join(DROPINS)) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let text = name.to_string_lossy();
            if text.starts_with('.') || !text.ends_with(".conf") {
                continue;
            }
            dropins.insert(name, entry.path());
        }
    }
    out.extend(dropins.into_values().filter(|p| !is_masked(p)));
    out
}

/// A symlink to `/dev/null`: systemd's way to mask a file of the same name.
fn is_masked(path: &Path) -> bool {
    std::fs::read_link(path).is_ok_and(|t| t == Path::new("/dev/null"))
}

/// Reads zram-generator's configuration under `root`, with the kernel command line
/// `cmdline`.
pub fn read(root: &Path, cmdline: &str) -> Result<ZramGeneratorConfig, ConfigError> {
    let switch = cmdline_switch(cmdline);
    if switch == Some(false) {
        return Ok(ZramGeneratorConfig {
            disabled_by_cmdline: true,
            ..ZramGeneratorConfig::default()
        });
    }
    let mut cfg = ZramGeneratorConfig {
        files: files(root),
        ..ZramGeneratorConfig::default()
    };
    for path in cfg.files.clone() {
        let text = read_capped(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        apply(&mut cfg, &path, &text)?;
    }
    if switch == Some(true) && !cfg.devices.contains_key("zram0") {
        cfg.devices.insert(
            "zram0".into(),
            Section {
                name: "zram0".into(),
                keys: BTreeMap::new(),
            },
        );
    }
    Ok(cfg)
}

/// Reads this host's configuration (`/`, `/proc/cmdline`).
pub fn read_host() -> Result<ZramGeneratorConfig, ConfigError> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    read(Path::new("/"), &cmdline)
}

/// The section a `zram-generator:zramN` spec names.
pub fn section_of_spec(spec: &Path) -> Option<&str> {
    spec.to_str()?
        .strip_prefix(SPEC_PREFIX)
        .filter(|name| is_device_name(name))
}

/// The spec of section `name`.
pub fn spec_of(name: &str) -> PathBuf {
    PathBuf::from(format!("{SPEC_PREFIX}{name}"))
}

/// What section `name` of this host's configuration makes, its notes logged.
pub fn load_section(name: &str) -> Result<Plan, ConfigError> {
    let cfg = read_host()?;
    if cfg.disabled_by_cmdline {
        return Ok(Plan::Skip(
            "systemd.zram=0 on the kernel command line turns zram-generator's devices off".into(),
        ));
    }
    let Some(section) = cfg.devices.get(name) else {
        return Err(ConfigError::NoSection {
            name: name.to_string(),
            files: cfg.files,
        });
    };
    let planned = section.plan(Host::current()?);
    for note in &planned.notes {
        tracing::warn!(section = name, "{note}");
    }
    planned.plan
}

/// Whether `name` is a section zram-generator makes a device of: `zram` and a number.
pub fn is_device_name(name: &str) -> bool {
    name.strip_prefix("zram")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// rust-ini's parse error in words: where, and what it wanted (it prints the characters
/// it expected as a Rust list of options).
fn ini_message(e: &ini::ParseError) -> String {
    let msg = &e.msg;
    let words = match (msg.find("\"["), msg.find("]\"")) {
        (Some(from), Some(to)) if from < to => {
            let wanted: Vec<String> = msg[from + 2..to]
                .split(", ")
                .map(|c| {
                    c.trim_start_matches("Some(")
                        .trim_end_matches(')')
                        .to_string()
                })
                .collect();
            format!("{}{}{}", &msg[..from], wanted.join(" or "), &msg[to + 2..])
        }
        _ => msg.to_string(),
    };
    format!("line {}, column {}: {words}", e.line, e.col)
}

fn apply(cfg: &mut ZramGeneratorConfig, path: &Path, text: &str) -> Result<(), ConfigError> {
    let ini = ini::Ini::load_from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: ini_message(&e),
    })?;
    for (section, props) in ini.iter() {
        let Some(name) = section else {
            for (key, _) in props.iter() {
                cfg.notes.push(match key.strip_prefix("set!") {
                    Some(var) => format!(
                        "{}: set!{var} is not supported: uzram runs no program from a config \
                         file; an expression that uses {var} is refused",
                        path.display()
                    ),
                    None => format!("{}: {key} outside a section is ignored", path.display()),
                });
            }
            continue;
        };
        if !is_device_name(name) {
            cfg.notes.push(format!(
                "{}: section [{name}] is ignored (devices are [zram0], [zram1], ...)",
                path.display()
            ));
            continue;
        }
        let device = cfg
            .devices
            .entry(name.to_string())
            .or_insert_with(|| Section {
                name: name.to_string(),
                keys: BTreeMap::new(),
            });
        for (key, value) in props.iter() {
            // memory-limit is host-memory-limit's old name: one setting, whichever file or
            // line sets it last wins, as in zram-generator.
            let key = if key == "memory-limit" {
                "host-memory-limit"
            } else {
                key
            };
            device
                .keys
                .insert(key.to_string(), (value.to_string(), path.to_path_buf()));
        }
    }
    Ok(())
}

/// zram-generator's `swap-priority` when a section gives none.
pub const DEFAULT_PRIORITY: i64 = 100;

/// Keys uzram takes as numbers or booleans; every other key's value is text.
const NUMBER_KEYS: &[&str] = &[
    "swap-priority",
    "recompress-threshold",
    "queues",
    "depth",
    "id",
    "gpu-installers",
    "gpu-slot-wait-us",
    "gpu-slot-pages",
];

/// uzram's own keys, accepted in a section as in a uzram file.
const UZRAM_KEYS: &[&str] = &[
    "size",
    "mem-limit",
    "backend",
    "metrics-textfile",
    "queues",
    "depth",
    "queue-mode",
    "user-copy",
    "queue-affinity",
    "id",
    "gpus",
    "gpu-memory",
    "gpu-parse",
    "gpu-installers",
    "gpu-slot-wait-us",
    "gpu-slot-pages",
    "gpu-place",
    "checksums",
    "recompress-algorithm",
    "recompress-idle-age",
    "recompress-threshold",
    "writeback-idle-age",
    "writeback-limit",
];

impl Section {
    /// How the section is named in messages: `zram-generator.conf [zram0]`.
    pub fn label(&self) -> PathBuf {
        PathBuf::from(format!("zram-generator.conf [{}]", self.name))
    }

    /// What the section makes on `host`.
    pub fn plan(&self, host: Host) -> SectionPlan {
        let mut notes = Vec::new();
        let plan = self
            .to_file_config(&mut notes)
            .and_then(|file| plan(file, &self.label(), host));
        SectionPlan { plan, notes }
    }

    fn to_file_config(&self, notes: &mut Vec<String>) -> Result<FileConfig, ConfigError> {
        let label = self.label();
        let refuse = |key: &str, why: String| ConfigError::Unsupported {
            path: label.clone(),
            key: key.to_string(),
            why,
        };
        let mut table = toml::Table::new();
        let mut fraction = None;
        let mut max_size = None;
        for (key, (value, _)) in &self.keys {
            let value = value.trim();
            match key.as_str() {
                "zram-size" | "zram-resident-limit" | "options" => {
                    table.insert(key.clone(), value.into());
                }
                "host-memory-limit" => {
                    table.insert(key.clone(), value.into());
                }
                "compression-algorithm" => {
                    let parsed = algorithms(value);
                    notes.extend(parsed.notes);
                    table.insert(key.clone(), parsed.primary.into());
                    if let Some(recompress) = parsed.recompress {
                        if !self.keys.contains_key("recompress-algorithm") {
                            table.insert("recompress-algorithm".into(), recompress.into());
                        }
                    }
                }
                "fs-type" => {
                    table.insert(key.clone(), value.into());
                }
                "mount-point" => {
                    return Err(refuse(
                        key,
                        format!(
                            "mount-point = {value} asks for a filesystem on the device; \
                             uzram devices are swap only: keep zram-generator for this \
                             device, or remove the key"
                        ),
                    ))
                }
                "writeback-device" => {
                    table.insert(key.clone(), value.into());
                }
                "fs-create-options" => notes.push(format!(
                    "fs-create-options = {value} is ignored: uzram runs mkswap with its \
                     defaults"
                )),
                "zram-fraction" => fraction = Some(value.to_string()),
                "max-zram-size" => max_size = Some(value.to_string()),
                k if k == "swap-priority" || UZRAM_KEYS.contains(&k) => {
                    table.insert(k.to_string(), typed(k, value, &label)?);
                }
                k => notes.push(format!("unknown key {k} is ignored")),
            }
        }
        // zram-generator's default, where uzram's own files leave the kernel's.
        if !table.contains_key("swap-priority") {
            table.insert(
                "swap-priority".into(),
                toml::Value::Integer(DEFAULT_PRIORITY),
            );
        }
        // zram-generator's obsolete pair replaces zram-size when either is set.
        if fraction.is_some() || max_size.is_some() {
            let fraction = fraction.unwrap_or_else(|| "0.5".into());
            let expr = match max_size.as_deref() {
                None | Some("none") => format!("{fraction} * ram"),
                Some(max) => format!("min({fraction} * ram, {max})"),
            };
            notes.push(format!(
                "zram-fraction/max-zram-size are obsolete: read as zram-size = {expr}"
            ));
            table.insert("zram-size".into(), expr.into());
        }
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                path: label,
                message: e.message().to_string(),
            })
    }
}

/// A key's value as the type uzram's file format gives it.
fn typed(key: &str, value: &str, label: &Path) -> Result<toml::Value, ConfigError> {
    let bad = |what: &str| ConfigError::Parse {
        path: label.to_path_buf(),
        message: format!("{key} = {value:?}: expected {what}"),
    };
    if key == "swap-priority" {
        return value
            .parse::<i64>()
            .map(toml::Value::Integer)
            .map_err(|_| bad("a whole number"));
    }
    if NUMBER_KEYS.contains(&key) {
        // Parsed unsigned here, so that a negative value's error names its key.
        return value
            .parse::<u64>()
            .ok()
            .and_then(|n| i64::try_from(n).ok())
            .map(toml::Value::Integer)
            .ok_or_else(|| bad("a whole number from 0"));
    }
    if key == "checksums" || key == "gpu-place" {
        return match value {
            "true" | "yes" | "on" | "1" => Ok(true.into()),
            "false" | "no" | "off" | "0" => Ok(false.into()),
            _ => Err(bad("true or false")),
        };
    }
    Ok(value.into())
}

/// What zram-generator's `compression-algorithm` (`lz4 zstd(level=3) (type=idle)`) asks
/// of uzram.
struct Algorithms {
    /// The first algorithm, in uzram's spelling (`zstd:3`).
    primary: String,
    /// The second, when uzram can recompress with it (zstd).
    recompress: Option<String>,
    /// What is not used, each naming its part.
    notes: Vec<String>,
}

/// Reads zram-generator's `compression-algorithm`: the first algorithm compresses, the
/// second (zram's first recompression algorithm) recompresses pages that went unused.
fn algorithms(value: &str) -> Algorithms {
    let mut out = Algorithms {
        primary: String::new(),
        recompress: None,
        notes: Vec::new(),
    };
    let mut seen = 0;
    for token in value.split_whitespace() {
        let (name, params) = match token.split_once('(') {
            Some((name, rest)) => (name, rest.strip_suffix(')').unwrap_or(rest)),
            None => (token, ""),
        };
        if name.is_empty() {
            // zram's global recompression parameters: uzram recompresses pages that went
            // unused (type=idle) by its own recompress-idle-age.
            if params
                .split(',')
                .map(str::trim)
                .any(|p| p != "type=idle" && !p.is_empty())
            {
                out.notes.push(format!(
                    "recompression parameters ({params}) are ignored but type=idle: uzram \
                     recompresses pages unused for recompress-idle-age"
                ));
            }
            continue;
        }
        let mut level = None;
        for param in params.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("level", l)) if name == "zstd" => level = Some(l.to_string()),
                _ => out.notes.push(format!(
                    "compression parameter {param} of {name} is ignored"
                )),
            }
        }
        let spelled = match level {
            Some(l) => format!("{name}:{l}"),
            None => name.to_string(),
        };
        match seen {
            0 => out.primary = spelled,
            1 if name == "zstd" => out.recompress = Some(spelled),
            1 => out.notes.push(format!(
                "recompression algorithm {token} is ignored: uzram recompresses with zstd only"
            )),
            _ => out.notes.push(format!(
                "recompression algorithm {token} is ignored: uzram recompresses with one"
            )),
        }
        seen += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RecompressCodec;

    const HOST: Host = Host::with_ram(8192);

    /// rust-ini's syntax errors read as words: where, and the characters it wanted.
    #[test]
    fn syntax_errors_say_where_and_what_was_wanted() {
        for (text, want) in [
            ("[zram0\n", "line 2, column 1: expecting ']' but found EOF"),
            ("[zram0]\nzram-size\n", "expecting '=' or ':' but found EOF"),
        ] {
            let dir = tree(&[("etc/systemd/zram-generator.conf", text)]);
            let err = read(dir.path(), "").unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    fn device(plan: &SectionPlan) -> &crate::config::file::RunConfig {
        match &plan.plan {
            Ok(Plan::Device(cfg)) => cfg,
            other => panic!("no device: {other:?}"),
        }
    }

    #[test]
    fn the_first_main_file_wins_and_drop_ins_apply_after_it_in_name_order() {
        let dir = tree(&[
            (
                "usr/lib/systemd/zram-generator.conf",
                "[zram0]\nzram-size = 100\n",
            ),
            (
                "etc/systemd/zram-generator.conf",
                "[zram0]\nzram-size = 200\nswap-priority = 5\n",
            ),
            (
                "usr/lib/systemd/zram-generator.conf.d/10-a.conf",
                "[zram0]\nzram-size = 300\n",
            ),
            (
                "etc/systemd/zram-generator.conf.d/10-a.conf",
                "[zram0]\nzram-size = 400\n",
            ),
            (
                "usr/lib/systemd/zram-generator.conf.d/20-b.conf",
                "[zram1]\n",
            ),
            (
                "run/systemd/zram-generator.conf.d/.hidden.conf",
                "[zram9]\n",
            ),
            ("etc/systemd/zram-generator.conf.d/notes.txt", "[zram8]\n"),
        ]);
        let cfg = read(dir.path(), "").unwrap();
        let rel: Vec<_> = cfg
            .files
            .iter()
            .map(|p| p.strip_prefix(dir.path()).unwrap().to_path_buf())
            .collect();
        assert_eq!(
            rel,
            [
                PathBuf::from("etc/systemd/zram-generator.conf"),
                PathBuf::from("etc/systemd/zram-generator.conf.d/10-a.conf"),
                PathBuf::from("usr/lib/systemd/zram-generator.conf.d/20-b.conf"),
            ]
        );
        assert_eq!(cfg.devices.keys().collect::<Vec<_>>(), ["zram0", "zram1"]);
        let zram0 = cfg.devices["zram0"].plan(HOST);
        let run = device(&zram0);
        // 400 MiB from the /etc drop-in, which replaced /usr/lib's of the same name; the
        // priority from the main file, which the drop-in did not set.
        assert_eq!(run.device.size, 400 << 20);
        assert_eq!(run.swap.priority, Some(5));
        // zram1: zram-generator's defaults.
        let zram1 = cfg.devices["zram1"].plan(HOST);
        assert_eq!(device(&zram1).device.size, 4096 << 20);
        assert_eq!(device(&zram1).swap.options.as_deref(), Some("discard"));
        assert_eq!(device(&zram1).swap.priority, Some(100));
    }

    #[test]
    fn a_file_masked_by_dev_null_is_not_read() {
        let dir = tree(&[
            ("usr/lib/systemd/zram-generator.conf", "[zram0]\n"),
            (
                "usr/lib/systemd/zram-generator.conf.d/50-x.conf",
                "[zram1]\n",
            ),
        ]);
        let etc = dir.path().join("etc/systemd/zram-generator.conf.d");
        std::fs::create_dir_all(&etc).unwrap();
        std::os::unix::fs::symlink(
            "/dev/null",
            dir.path().join("etc/systemd/zram-generator.conf"),
        )
        .unwrap();
        std::os::unix::fs::symlink("/dev/null", etc.join("50-x.conf")).unwrap();
        let cfg = read(dir.path(), "").unwrap();
        assert!(cfg.files.is_empty(), "{:?}", cfg.files);
        assert!(cfg.devices.is_empty());
    }

    #[test]
    fn the_kernel_command_line_switches_devices_off_or_adds_zram0() {
        assert_eq!(cmdline_switch("quiet systemd.zram=0 ro"), Some(false));
        assert_eq!(cmdline_switch("systemd.zram"), Some(true));
        assert_eq!(
            cmdline_switch("systemd.zram=off systemd.zram=yes"),
            Some(true)
        );
        assert_eq!(cmdline_switch("systemd.zramx=0 systemd.zram=maybe"), None);
        let dir = tree(&[("etc/systemd/zram-generator.conf", "[zram1]\n")]);
        let off = read(dir.path(), "systemd.zram=0").unwrap();
        assert!(off.disabled_by_cmdline && off.devices.is_empty());
        let on = read(dir.path(), "systemd.zram=1").unwrap();
        assert_eq!(on.devices.keys().collect::<Vec<_>>(), ["zram0", "zram1"]);
        let none = tempfile::tempdir().unwrap();
        assert!(read(none.path(), "").unwrap().devices.is_empty());
        assert_eq!(read(none.path(), "systemd.zram").unwrap().devices.len(), 1);
    }

    #[test]
    fn every_zram_generator_key_is_read_and_what_uzram_lacks_is_named() {
        let dir = tree(&[(
            "etc/systemd/zram-generator.conf",
            "set!maxmem = echo 1024\n\
             [zram0]\n\
             zram-size = min(ram / 4, 2048)\n\
             zram-resident-limit = 1024\n\
             host-memory-limit = none\n\
             compression-algorithm = zstd(level=3) lz4 (type=idle)\n\
             writeback-device = /dev/sdb1\n\
             swap-priority = 32767\n\
             options = discard=pages\n\
             fs-type = swap\n\
             fs-create-options = -L swap\n\
             colour = blue\n\
             [zram1]\n\
             mount-point = /var/tmp\n\
             [zram2]\n\
             zram-fraction = 0.25\n\
             max-zram-size = 1000\n\
             memory-limit = 4096\n\
             [swap]\n",
        )]);
        let cfg = read(dir.path(), "").unwrap();
        assert!(
            cfg.notes.iter().any(|n| n.contains("set!maxmem")),
            "{:?}",
            cfg.notes
        );
        assert!(
            cfg.notes.iter().any(|n| n.contains("[swap]")),
            "{:?}",
            cfg.notes
        );
        let zram0 = cfg.devices["zram0"].plan(HOST);
        let run = device(&zram0);
        assert_eq!(run.device.size, 2048 << 20);
        assert_eq!(run.device.mem_limit, Some(1024 << 20));
        assert_eq!(run.device.algorithm.to_string(), "zstd:3");
        assert_eq!(run.swap.priority, Some(32767));
        assert_eq!(run.swap.options.as_deref(), Some("discard=pages"));
        assert_eq!(
            run.device.writeback.as_ref().map(|w| w.device.clone()),
            Some(PathBuf::from("/dev/sdb1"))
        );
        for key in ["lz4", "fs-create-options", "colour"] {
            assert!(
                zram0.notes.iter().any(|n| n.contains(key)),
                "{key}: {:?}",
                zram0.notes
            );
        }
        let zram1 = cfg.devices["zram1"].plan(HOST);
        let err = zram1.plan.unwrap_err().to_string();
        assert!(
            err.contains("mount-point") && err.contains("[zram1]"),
            "{err}"
        );
        // host-memory-limit (as its old name) below this host's 8192 MiB: no device.
        let zram2 = cfg.devices["zram2"].plan(HOST);
        assert!(matches!(zram2.plan, Ok(Plan::Skip(_))), "{:?}", zram2.plan);
        let big = Host::with_ram(4096);
        let zram2 = cfg.devices["zram2"].plan(big);
        assert_eq!(device(&zram2).device.size, 1000 << 20);
    }

    /// memory-limit and host-memory-limit are one setting: the later assignment wins, in
    /// whichever spelling (zram-generator's rule), not the name that sorts last.
    #[test]
    fn the_last_host_memory_limit_wins_under_either_name() {
        let dir = tree(&[
            (
                "etc/systemd/zram-generator.conf",
                "[zram0]\nmemory-limit = 2048\n",
            ),
            (
                "etc/systemd/zram-generator.conf.d/99-local.conf",
                "[zram0]\nhost-memory-limit = none\n",
            ),
            (
                "etc/systemd/zram-generator.conf.d/50-x.conf",
                "[zram1]\nhost-memory-limit = none\nmemory-limit = 2048\n",
            ),
        ]);
        let cfg = read(dir.path(), "").unwrap();
        // zram0: the drop-in's "none" came last: a device on this 8 GiB host.
        device(&cfg.devices["zram0"].plan(HOST));
        // zram1: the old name came last in its file: no device above 2048 MiB.
        let zram1 = cfg.devices["zram1"].plan(HOST);
        assert!(matches!(zram1.plan, Ok(Plan::Skip(_))), "{:?}", zram1.plan);
    }

    /// A main file that is a dangling link is passed over for the next base's, as
    /// zram-generator does; a link to /dev/null still masks.
    #[test]
    fn a_dangling_main_file_link_falls_back_to_the_next_one() {
        let dir = tree(&[("usr/lib/systemd/zram-generator.conf", "[zram0]\n")]);
        let etc = dir.path().join("etc/systemd");
        std::fs::create_dir_all(&etc).unwrap();
        std::os::unix::fs::symlink("/nonexistent/zram.conf", etc.join("zram-generator.conf"))
            .unwrap();
        let cfg = read(dir.path(), "").unwrap();
        assert!(cfg.devices.contains_key("zram0"), "{:?}", cfg.files);
        std::fs::remove_file(etc.join("zram-generator.conf")).unwrap();
        std::os::unix::fs::symlink("/dev/null", etc.join("zram-generator.conf")).unwrap();
        assert!(read(dir.path(), "").unwrap().devices.is_empty());
    }

    #[test]
    fn a_second_zstd_algorithm_recompresses_idle_pages() {
        let dir = tree(&[(
            "etc/systemd/zram-generator.conf",
            "[zram0]\ncompression-algorithm = lz4 zstd(level=5) (type=idle)\n\
             [zram1]\ncompression-algorithm = lz4 zstd\nrecompress-idle-age = 10m\n\
             [zram2]\ncompression-algorithm = lz4 lz4hc\n",
        )]);
        let cfg = read(dir.path(), "").unwrap();
        let zram0 = cfg.devices["zram0"].plan(HOST);
        let r = device(&zram0).device.recompress.expect("recompression");
        assert_eq!(
            (r.codec, r.idle_age_minutes, r.threshold),
            (RecompressCodec::Zstd { level: 5 }, 60, 0)
        );
        assert!(zram0.notes.is_empty(), "{:?}", zram0.notes);
        let zram1 = cfg.devices["zram1"].plan(HOST);
        let r = device(&zram1).device.recompress.expect("recompression");
        assert_eq!(
            (r.codec, r.idle_age_minutes),
            (RecompressCodec::Zstd { level: 3 }, 10)
        );
        let zram2 = cfg.devices["zram2"].plan(HOST);
        assert_eq!(device(&zram2).device.recompress, None);
        assert!(
            zram2.notes.iter().any(|n| n.contains("lz4hc")),
            "{:?}",
            zram2.notes
        );
    }

    #[test]
    fn uzram_keys_are_typed_and_bad_values_name_the_section() {
        let section = |text: &str| {
            let dir = tree(&[("etc/systemd/zram-generator.conf", text)]);
            read(dir.path(), "").unwrap().devices["zram0"].plan(HOST)
        };
        let good =
            section("[zram0]\nbackend = cpu\nqueues = 2\nchecksums = false\nuser-copy = on\nqueue-affinity = any\n");
        let run = device(&good);
        assert_eq!(run.device.queues, 2);
        assert!(!run.device.checksums);
        assert_eq!(run.device.user_copy, crate::config::UserCopy::On);
        assert_eq!(run.device.queue_affinity, crate::config::QueueAffinity::Any);
        for (text, want) in [
            ("[zram0]\nqueues = many\n", "queues"),
            ("[zram0]\nswap-priority = high\n", "swap-priority"),
            ("[zram0]\ncompression-algorithm = lzo-rle\n", "lzo-rle"),
            ("[zram0]\nfs-type = ext2\n", "ext2"),
            ("[zram0]\nzram-size = maxmem / 2\n", "maxmem"),
            ("[zram0]\nuser-copy = sometimes\n", "user-copy"),
            ("[zram0]\nqueue-affinity = pinned\n", "queue-affinity"),
            ("[zram0]\nqueues = -1\n", "queues"),
            ("[zram0]\ngpu-slot-wait-us = -5\n", "gpu-slot-wait-us"),
        ] {
            let err = section(text).plan.unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }
}

//! `uzram-generator` (`uzram generator`): the systemd generator that makes a device of every
//! configured source at boot, as zram-generator does, so that a config file is all a user
//! writes. systemd runs it early, before most of the system is up: it reads only the config
//! files and `/proc`, writes only into the folder it is given, logs to the kernel log, and
//! exits 0 however a config is broken (the unit of a broken config fails and says why).
//!
//! For each source that makes a device on this host (`config::sources`) it wants
//! `uzram@NAME.service` into `swap.target`; a zram-generator section also gets a drop-in
//! that points the instance at the section (`UZRAM_CONFIG=zram-generator:zramN`). A source
//! whose plan is to make no device here (`host-memory-limit`, a size of 0) gets no unit. In
//! a container nothing is made: there is no ublk there, and zram-generator does the same.
//! A device with a `writeback-device` gets a drop-in that lets the sandboxed unit reach it:
//! the partition in its device list (and the unit after the partition's device unit), or the
//! file's directory writable and mounted first (files under `/var/lib/uzram`, the unit's
//! `StateDirectory=`, need neither).

use std::io::Write;

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::cli::GeneratorArgs;
use crate::config::sources::{self, Source};
use crate::config::zram_generator::{section_of_spec, ZramGeneratorConfig};
use crate::config::{Host, Plan};

/// Where the template unit may be installed, in systemd's order.
const TEMPLATE_DIRS: [&str; 3] = [
    "etc/systemd/system",
    "usr/lib/systemd/system",
    "lib/systemd/system",
];
const TEMPLATE: &str = "uzram@.service";

pub fn run(args: GeneratorArgs) -> anyhow::Result<ExitCode> {
    let log = Kmsg::open();
    let Some(normal) = args.dirs.first() else {
        anyhow::bail!("usage: uzram-generator NORMAL-DIR [EARLY-DIR LATE-DIR]");
    };
    if in_container() {
        log.info("in a container: no ublk device, nothing to do");
        return Ok(ExitCode::SUCCESS);
    }
    let root = Path::new("/");
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let made = Host::current()
        .map_err(anyhow::Error::from)
        .and_then(|host| generate(root, &cmdline, host, normal, &log));
    if let Err(err) = made {
        log.error(&format!("{err:#}"));
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the units for every source under `root` into `normal`; returns the instances
/// wanted.
pub fn generate(
    root: &Path,
    cmdline: &str,
    host: Host,
    normal: &Path,
    log: &dyn Log,
) -> anyhow::Result<Vec<String>> {
    // At boot, before any unit: nothing here may load a driver or wait on a device.
    let host = host.without_probes();
    let configured = sources::all(root, cmdline);
    for note in &configured.notes {
        log.info(note);
    }
    if let Err(err) = &configured.zram_generator {
        // Its sections are unknown, so they get no unit; uzram's own files still do.
        log.error(&format!(
            "zram-generator's configuration makes no device: {err:#} (`uzram check-config` \
             says the same)"
        ));
    }
    let zg = configured.zram_generator.ok();
    let list = configured.sources;
    if list.is_empty() {
        return Ok(Vec::new());
    }
    let Some(template) = TEMPLATE_DIRS
        .iter()
        .map(|d| root.join(d).join(TEMPLATE))
        .find(|p| p.exists())
    else {
        anyhow::bail!("{TEMPLATE} is not installed: no device is started");
    };
    // The unit file the symlinks point at, as systemd sees it (not under a test's root).
    let target = Path::new("/").join(template.strip_prefix(root).unwrap_or(&template));
    let mut wanted = Vec::new();
    for source in &list {
        let mut backing = None;
        match plan_of(root, zg.as_ref(), source, host) {
            Ok(Plan::Skip(why)) => {
                log.info(&format!("{}: no device on this host: {why}", source.name));
                continue;
            }
            Ok(Plan::Device(run)) => backing = run.device.writeback.map(|w| w.device),
            // Still wanted: the unit's check-config fails it, and says why, where an
            // administrator looks (systemctl status, the journal).
            Err(err) => log.error(&format!("{}: {err:#}", source.name)),
        }
        // One source's failure (a name too long for a unit, a full disk) costs that source
        // alone: every other still gets its unit.
        match write_units(
            root,
            normal,
            &target,
            source,
            zg.as_ref(),
            backing.as_deref(),
        ) {
            Ok(()) => wanted.push(source.name.clone()),
            Err(err) => log.error(&format!("{}: no unit: {err:#}", source.name)),
        }
    }
    Ok(wanted)
}

/// The wants link of `source` and its drop-ins (`backing`: its writeback device).
fn write_units(
    root: &Path,
    normal: &Path,
    target: &Path,
    source: &Source,
    zg: Option<&ZramGeneratorConfig>,
    backing: Option<&Path>,
) -> anyhow::Result<()> {
    want(root, normal, target, source, zg)?;
    if let Some(path) = backing {
        let dir = normal.join(format!("uzram@{}.service.d", source.name));
        std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
        let file = dir.join("writeback.conf");
        std::fs::write(&file, writeback_dropin(path))
            .with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(())
}

/// What `source` makes on `host`; a section's plan comes from `zg`, zram-generator's
/// configuration as [`sources::all`] read it (`None`: it could not be read).
fn plan_of(
    root: &Path,
    zg: Option<&ZramGeneratorConfig>,
    source: &Source,
    host: Host,
) -> anyhow::Result<Plan> {
    if let Some(name) = section_of_spec(&source.spec) {
        let section = zg
            .and_then(|zg| zg.devices.get(name))
            .ok_or_else(|| anyhow::anyhow!("no section [{name}]"))?;
        return Ok(section.plan(host).plan?);
    }
    let path = root.join(source.spec.strip_prefix("/").unwrap_or(&source.spec));
    let text = crate::config::file::read_capped(&path)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(crate::config::file::parse_config(
        &source.spec,
        &text,
        host,
    )?)
}

/// What the unit needs to reach backing device `path`: a partition in its device list, a
/// file's directory writable (both waited for).
fn writeback_dropin(path: &Path) -> String {
    let mut out = String::from(
        "# Automatically generated by uzram-generator: the unit may reach its writeback-device\n",
    );
    // The config's own rule (`writeback_is_device`): under /dev a device,
    // elsewhere a file, whatever is there at boot: /dev itself, a directory, must never open
    // ReadWritePaths=/.
    if crate::config::writeback_is_device(path) {
        let unit = format!("{}.device", escape_path(path));
        out.push_str(&format!(
            "[Unit]\nWants={unit}\nAfter={unit}\n[Service]\nDeviceAllow={} rw\n",
            path.display()
        ));
    } else if let Some(dir) = path.parent().filter(|d| !d.starts_with("/var/lib/uzram")) {
        out.push_str(&format!(
            "[Unit]\nRequiresMountsFor={}\n[Service]\nReadWritePaths={}\n",
            dir.display(),
            dir.display()
        ));
    }
    out
}

/// A path as systemd names its units (`systemd-escape --path`): no leading or trailing
/// `/`, `/` as `-`, every byte but ASCII letters, digits, `_` and `.` (not first) as `\xNN`.
fn escape_path(path: &Path) -> String {
    let text = path.to_string_lossy();
    // Simplified first, as systemd does: no empty or `.` parts (`//dev/./sdb2` is
    // `dev-sdb2`); `..` never gets here (the config refuses it).
    let simplified = text
        .split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect::<Vec<_>>()
        .join("/");
    let mut out = String::new();
    for (i, b) in simplified.bytes().enumerate() {
        match b {
            b'/' => out.push('-'),
            b'.' if i > 0 => out.push('.'),
            b if b.is_ascii_alphanumeric() || b == b'_' || b == b':' => out.push(b as char),
            b => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out
}

/// `swap.target.wants/uzram@NAME.service`, and for a zram-generator section its drop-in.
fn want(
    root: &Path,
    normal: &Path,
    template: &Path,
    source: &Source,
    zg: Option<&ZramGeneratorConfig>,
) -> anyhow::Result<()> {
    let unit = format!("uzram@{}.service", source.name);
    let wants = normal.join("swap.target.wants");
    std::fs::create_dir_all(&wants).with_context(|| format!("making {}", wants.display()))?;
    let link = wants.join(&unit);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(template, &link)
        .with_context(|| format!("linking {}", link.display()))?;
    if section_of_spec(&source.spec).is_some() {
        let dir = normal.join(format!("{unit}.d"));
        std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
        let source_path = zg
            .and_then(|zg| zg.files.first())
            .map(|f| Path::new("/").join(f.strip_prefix(root).unwrap_or(f)))
            .unwrap_or_else(|| PathBuf::from("/etc/systemd/zram-generator.conf"));
        std::fs::write(
            dir.join("zram-generator.conf"),
            format!(
                "# Automatically generated by uzram-generator\n\
                 [Unit]\n\
                 SourcePath={}\n\
                 [Service]\n\
                 Environment=UZRAM_CONFIG={}\n",
                source_path.display(),
                source.spec.display()
            ),
        )
        .with_context(|| format!("writing {}", dir.join("zram-generator.conf").display()))?;
    }
    Ok(())
}

/// Where a generator's lines go.
pub trait Log {
    fn info(&self, msg: &str);
    fn error(&self, msg: &str);
}

/// The kernel log (`/dev/kmsg`): the only log a generator has; stderr where it cannot be
/// opened.
struct Kmsg(Option<std::fs::File>);

impl Kmsg {
    fn open() -> Kmsg {
        Kmsg(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/kmsg")
                .ok(),
        )
    }

    fn line(&self, level: u8, msg: &str) {
        let line = format!("<{level}>uzram-generator[{}]: {msg}\n", std::process::id());
        match &self.0 {
            Some(file) => {
                let _ = (&*file).write_all(line.as_bytes());
            }
            None => eprint!("{}", &line[3..]),
        }
    }
}

impl Log for Kmsg {
    fn info(&self, msg: &str) {
        self.line(6, msg);
    }

    fn error(&self, msg: &str) {
        self.line(3, msg);
    }
}

/// `systemd-detect-virt --container`, as zram-generator asks; no answer counts as no.
fn in_container() -> bool {
    std::process::Command::new("systemd-detect-virt")
        .args(["--quiet", "--container"])
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Device unit names as `systemd-escape --path` gives them (its output for each, on
    /// Debian 12's systemd 252): `:` kept, empty and `.` parts dropped.
    #[test]
    fn device_paths_are_escaped_as_systemd_escapes_them() {
        for (path, unit) in [
            (
                "/dev/disk/by-path/pci-0000:00:1f.2-ata-1-part2",
                r"dev-disk-by\x2dpath-pci\x2d0000:00:1f.2\x2data\x2d1\x2dpart2",
            ),
            (
                "/dev/disk/by-id/usb-Generic_Flash_Disk_1234-0:0-part1",
                r"dev-disk-by\x2did-usb\x2dGeneric_Flash_Disk_1234\x2d0:0\x2dpart1",
            ),
            ("//dev//sdb2", "dev-sdb2"),
            ("/dev/./sdb2", "dev-sdb2"),
        ] {
            assert_eq!(escape_path(Path::new(path)), unit, "{path}");
        }
    }
    use std::cell::RefCell;

    #[derive(Default)]
    struct Lines(RefCell<Vec<String>>);

    impl Log for Lines {
        fn info(&self, msg: &str) {
            self.0.borrow_mut().push(format!("info: {msg}"));
        }
        fn error(&self, msg: &str) {
            self.0.borrow_mut().push(format!("error: {msg}"));
        }
    }

    fn write(root: &Path, path: &str, text: &str) {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn every_source_that_makes_a_device_is_wanted_into_swap_target() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "usr/lib/systemd/system/uzram@.service", "[Unit]\n");
        write(r, "etc/uzram/swap0.toml", "size = \"1G\"\n");
        write(
            r,
            "etc/uzram/big.toml",
            "size = \"1G\"\nhost-memory-limit = 1024\n",
        );
        write(
            r,
            "etc/systemd/zram-generator.conf",
            "[zram0]\nzram-size = ram / 4\n[zram1]\nmount-point = /var/tmp\n",
        );
        let out = tempfile::tempdir().unwrap();
        let lines = Lines::default();
        let host = Host::with_ram(8192);
        let wanted = generate(r, "", host, out.path(), &lines).unwrap();
        // big: more RAM than its host-memory-limit, no unit; zram1: wanted, so that its
        // unit fails and says why.
        assert_eq!(wanted, ["swap0", "zram0", "zram1"]);
        let wants = out.path().join("swap.target.wants");
        for name in &wanted {
            let link = std::fs::read_link(wants.join(format!("uzram@{name}.service"))).unwrap();
            assert_eq!(link, Path::new("/usr/lib/systemd/system/uzram@.service"));
        }
        assert!(!wants.join("uzram@big.service").exists());
        let dropin =
            std::fs::read_to_string(out.path().join("uzram@zram0.service.d/zram-generator.conf"))
                .unwrap();
        assert!(
            dropin.contains("Environment=UZRAM_CONFIG=zram-generator:zram0"),
            "{dropin}"
        );
        assert!(
            dropin.contains("SourcePath=/etc/systemd/zram-generator.conf"),
            "{dropin}"
        );
        assert!(!out.path().join("uzram@swap0.service.d").exists());
        let lines = lines.0.into_inner();
        assert!(
            lines.iter().any(|l| l.starts_with("info: big: no device")),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("error: zram1:") && l.contains("mount-point")),
            "{lines:?}"
        );
    }

    #[test]
    fn a_writeback_device_gets_a_dropin_that_lets_the_unit_reach_it() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "usr/lib/systemd/system/uzram@.service", "[Unit]\n");
        write(
            r,
            "etc/uzram/swap0.toml",
            "size = \"1G\"\nwriteback-device = \"/srv/swap/swap0.wb\"\n",
        );
        write(
            r,
            "etc/uzram/swap1.toml",
            "size = \"1G\"\nwriteback-device = \"/var/lib/uzram/swap1.wb\"\n",
        );
        write(
            r,
            "etc/systemd/zram-generator.conf",
            "[zram0]\nwriteback-device = /dev/disk/by-id/ata-X_Y-part2\n",
        );
        let out = tempfile::tempdir().unwrap();
        let host = Host::with_ram(8192);
        generate(r, "", host, out.path(), &Lines::default()).unwrap();
        let dropin = |unit: &str| {
            std::fs::read_to_string(out.path().join(format!("{unit}.d/writeback.conf"))).unwrap()
        };
        let part = dropin("uzram@zram0.service");
        for line in [
            "DeviceAllow=/dev/disk/by-id/ata-X_Y-part2 rw",
            "After=dev-disk-by\\x2did-ata\\x2dX_Y\\x2dpart2.device",
            "Wants=dev-disk-by\\x2did-ata\\x2dX_Y\\x2dpart2.device",
        ] {
            assert!(part.lines().any(|l| l == line), "{line}: {part}");
        }
        let file = dropin("uzram@swap0.service");
        assert!(file.contains("ReadWritePaths=/srv/swap\n"), "{file}");
        assert!(file.contains("RequiresMountsFor=/srv/swap\n"), "{file}");
        // the unit's own StateDirectory: nothing to add
        let state = dropin("uzram@swap1.service");
        assert!(
            !state.contains("ReadWritePaths") && !state.contains("DeviceAllow"),
            "{state}"
        );
    }

    /// The generator runs before any unit at boot: `backend = "gpu"` is not checked against
    /// the driver there (no GPU here: a probe would log an error), the unit's check-config
    /// does that.
    #[test]
    fn the_generator_never_probes_the_gpu() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "usr/lib/systemd/system/uzram@.service", "[Unit]\n");
        write(
            r,
            "etc/uzram/swap0.toml",
            "size = \"1G\"\nbackend = \"gpu\"\n",
        );
        write(
            r,
            "etc/systemd/zram-generator.conf",
            "[zram0]\nbackend = gpu\n",
        );
        let out = tempfile::tempdir().unwrap();
        let log = Lines::default();
        let wanted = generate(r, "", Host::with_ram(8192), out.path(), &log).unwrap();
        assert_eq!(wanted, ["swap0", "zram0"]);
        let lines = log.0.into_inner();
        assert!(!lines.iter().any(|l| l.starts_with("error")), "{lines:?}");
    }

    /// A source whose unit cannot be written (here a name too long for a unit file) costs
    /// itself only: the sources after it still get theirs.
    #[test]
    fn one_source_that_fails_leaves_the_others_their_units() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "usr/lib/systemd/system/uzram@.service", "[Unit]\n");
        let long = "a".repeat(250);
        write(r, &format!("etc/uzram/{long}.toml"), "size = \"1G\"\n");
        write(r, "etc/uzram/zz.toml", "size = \"1G\"\n");
        let out = tempfile::tempdir().unwrap();
        let log = Lines::default();
        let wanted = generate(r, "", Host::with_ram(8192), out.path(), &log).unwrap();
        assert_eq!(wanted, ["zz"]);
        let lines = log.0.into_inner();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("error: {long}: no unit"))),
            "{lines:?}"
        );
    }

    /// Under /dev is a device, whatever is there: /dev itself (a directory) never opens the
    /// root to the daemon.
    #[test]
    fn a_writeback_path_under_dev_never_opens_a_directory() {
        for path in ["/dev", "/dev/", "/dev/null", "/dev/sdb2"] {
            let dropin = writeback_dropin(Path::new(path));
            assert!(!dropin.contains("ReadWritePaths"), "{path}: {dropin}");
            assert!(dropin.contains("DeviceAllow="), "{path}: {dropin}");
        }
        let file = writeback_dropin(Path::new("/srv/swap/disk"));
        assert!(file.contains("ReadWritePaths=/srv/swap\n"), "{file}");
    }

    #[test]
    fn the_kernel_command_line_or_no_config_makes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "usr/lib/systemd/system/uzram@.service", "[Unit]\n");
        let host = Host::with_ram(8192);
        let out = tempfile::tempdir().unwrap();
        assert!(generate(r, "", host, out.path(), &Lines::default())
            .unwrap()
            .is_empty());
        write(r, "etc/systemd/zram-generator.conf", "[zram0]\n");
        let off = generate(r, "systemd.zram=0", host, out.path(), &Lines::default()).unwrap();
        assert!(off.is_empty());
        assert!(!out.path().join("swap.target.wants").exists());
    }

    /// A zram-generator.conf that cannot be read (a syntax error, bytes that are not UTF-8,
    /// a FIFO) costs its own sections only, with an error in the log: uzram's files still
    /// get their units, and the generator never waits.
    #[test]
    fn a_broken_zram_generator_conf_keeps_uzram_files_units() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "usr/lib/systemd/system/uzram@.service", "[Unit]\n");
        write(r, "etc/uzram/swap0.toml", "size = \"1G\"\n");
        let conf = r.join("etc/systemd/zram-generator.conf");
        let host = Host::with_ram(8192);
        for broken in ["syntax", "utf8", "fifo"] {
            let _ = std::fs::remove_file(&conf);
            match broken {
                "syntax" => write(r, "etc/systemd/zram-generator.conf", "[zram0\n"),
                "utf8" => std::fs::write(&conf, b"\xff\xfe[zram0]\n").unwrap(),
                _ => crate::sys::make_fifo(&conf).unwrap(),
            }
            let out = tempfile::tempdir().unwrap();
            let log = Lines::default();
            let wanted = generate(r, "", host, out.path(), &log).unwrap();
            assert_eq!(wanted, ["swap0"], "{broken}");
            assert!(std::fs::symlink_metadata(
                out.path().join("swap.target.wants/uzram@swap0.service")
            )
            .is_ok());
            let lines = log.0.borrow();
            assert!(
                lines.iter().any(|l| l
                    .starts_with("error: zram-generator's configuration makes no device")
                    && l.contains("zram-generator.conf")),
                "{broken}: {lines:?}"
            );
            if broken == "syntax" {
                assert!(
                    lines
                        .iter()
                        .any(|l| l.contains("line 2, column 1: expecting ']'")),
                    "{lines:?}"
                );
            }
        }
    }
}

//! `systemd-analyze verify` on the shipped unit, where systemd-analyze exists (it checks keys,
//! dependencies and that every Exec command is an executable file). The unit's binary path
//! is pointed at the freshly built `uzram`, since it is not installed here; the example config
//! is the instance's `ConditionPathExists` file only in spirit, so it is not needed.
//! Also `systemd-analyze security` on it (its sandbox), and a boot transaction with a tmpfs
//! `/tmp` (no ordering cycle).

use std::path::Path;
use std::process::Command;

const UNIT: &str = include_str!("../../../systemd/uzram@.service");
const INSTALLED_BIN: &str = "/usr/sbin/uzram";

fn systemd_analyze() -> Option<&'static str> {
    ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

/// Writes `unit` as `uzram@.service` plus an instance link into a fresh directory and runs
/// `systemd-analyze verify` on the instance; returns (success, stderr).
fn verify(analyze: &str, unit: &str) -> (bool, String) {
    let dir =
        std::env::temp_dir().join(format!("uzram-unit-{}-{}", std::process::id(), unit.len()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("uzram@.service"), unit).unwrap();
    std::os::unix::fs::symlink("uzram@.service", dir.join("uzram@swap0.service")).unwrap();
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(dir.join("uzram@swap0.service"))
        .output()
        .expect("running systemd-analyze");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), stderr)
}

#[test]
fn unit_passes_systemd_analyze_verify() {
    let Some(analyze) = systemd_analyze() else {
        eprintln!("skipping: systemd-analyze is not installed here");
        return;
    };
    assert!(
        UNIT.contains(INSTALLED_BIN),
        "the unit no longer runs {INSTALLED_BIN}"
    );
    let unit = UNIT.replace(INSTALLED_BIN, env!("CARGO_BIN_EXE_uzram"));
    let (ok, stderr) = verify(analyze, &unit);
    // Warnings (unknown keys, bad dependencies) do not always fail verify: treat any output
    // that names the unit as a failure too.
    let ours: Vec<&str> = stderr.lines().filter(|l| l.contains("uzram@")).collect();
    assert!(ok && ours.is_empty(), "systemd-analyze verify: {stderr}");

    // The check can fail: a unit with an unknown key and a missing binary is reported.
    let broken = unit
        .replace("KillMode=mixed", "KillMode=mixed\nNoSuchKey=1")
        .replace(env!("CARGO_BIN_EXE_uzram"), "/nonexistent/uzram");
    let (ok, stderr) = verify(analyze, &broken);
    assert!(!ok, "a broken unit passed: {stderr}");
    assert!(stderr.contains("NoSuchKey"), "{stderr}");
}

/// The highest overall exposure `systemd-analyze security` may give the unit (0 to 10; it
/// was 9.5, "UNSAFE", before the unit was sandboxed).
const MAX_EXPOSURE: f64 = 5.0;

/// A fresh directory holding `files` (name, contents) and the link `uzram@swap0.service`.
fn unit_dir(tag: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("uzram-unit-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    std::os::unix::fs::symlink("uzram@.service", dir.join("uzram@swap0.service")).unwrap();
    dir
}

/// `systemd-analyze security --offline=yes` on `unit`: the overall exposure it prints, or
/// what it said instead (an unknown option where it has no offline mode: systemd before 250).
fn exposure(analyze: &str, unit: &str) -> Result<f64, String> {
    let dir = unit_dir(&format!("sec{}", unit.len()), &[("uzram@.service", unit)]);
    // Only this directory: no drop-in of this host changes the result.
    let out = Command::new(analyze)
        .args(["security", "--offline=yes"])
        .arg(dir.join("uzram@.service"))
        .env("SYSTEMD_UNIT_PATH", &dir)
        .env("SYSTEMD_COLORS", "0")
        .output()
        .expect("running systemd-analyze");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // "→ Overall exposure level for uzram@i.service: 2.5 OK 🙂"
    let level = stdout
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .and_then(|l| l.rsplit_once(": "))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse::<f64>().ok());
    level.ok_or_else(|| {
        format!(
            "no exposure level (status {}): {stdout}{stderr}",
            out.status
        )
    })
}

#[test]
fn unit_sandbox_exposure_is_at_most_5() {
    let Some(analyze) = systemd_analyze() else {
        eprintln!("skipping: systemd-analyze is not installed here");
        return;
    };
    let level = match exposure(analyze, UNIT) {
        Ok(level) => level,
        Err(why) if why.contains("offline") && why.contains("unrecognized") => {
            eprintln!("skipping: this systemd-analyze has no --offline: {why}");
            return;
        }
        Err(why) => panic!("systemd-analyze security: {why}"),
    };
    assert!(
        level <= MAX_EXPOSURE,
        "systemd-analyze security --offline=yes rates systemd/uzram@.service {level}, over \
         {MAX_EXPOSURE}: a sandbox setting was dropped or weakened"
    );

    // The check can fail: the same unit without its [Service] sandbox rates far higher.
    let bare: String = UNIT
        .lines()
        .filter(|l| !SANDBOX_KEYS.iter().any(|k| l.starts_with(k)))
        .map(|l| format!("{l}\n"))
        .collect();
    let bare_level = exposure(analyze, &bare).expect("systemd-analyze security on the bare unit");
    assert!(
        bare_level > MAX_EXPOSURE,
        "the unit without its sandbox rates {bare_level}"
    );
}

/// The keys of the unit's sandbox (removed to show that the exposure check can fail).
const SANDBOX_KEYS: &[&str] = &[
    "Protect",
    "Private",
    "Restrict",
    "Capability",
    "NoNewPrivileges",
    "UMask",
    "IPAddressDeny",
    "SystemCall",
    "LockPersonality",
    "Device",
    "ReadWritePaths",
    "Runtime",
];

/// systemd's tmp.mount (a tmpfs /tmp, the default on some distributions): tmpfs mounts are
/// ordered after swap.target, so that their pages can be swapped out.
const TMP_MOUNT: &str = "[Unit]\nDefaultDependencies=no\nConflicts=umount.target\n\
Before=local-fs.target umount.target\nAfter=swap.target\n\n[Mount]\nWhat=tmpfs\nWhere=/tmp\n\
Type=tmpfs\nOptions=mode=1777,strictatime,nosuid,nodev\n";

/// Starts a target that wants the unit, swap.target and tmp.mount in systemd-analyze's test
/// manager (`verify` enqueues the start job); returns the lines that report an ordering cycle.
fn ordering_cycles(analyze: &str, unit: &str) -> Vec<String> {
    let target = "[Unit]\nWants=uzram@swap0.service tmp.mount swap.target\n";
    let dir = unit_dir(
        &format!("cyc{}", unit.len()),
        &[
            ("uzram@.service", unit),
            ("tmp.mount", TMP_MOUNT),
            ("t.target", target),
        ],
    );
    // This directory first, then the system's units (swap.target, modprobe@.service).
    let mut path = dir.clone().into_os_string();
    path.push(":");
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(dir.join("t.target"))
        .env("SYSTEMD_UNIT_PATH", path)
        .env("SYSTEMD_LOG_LEVEL", "debug")
        .output()
        .expect("running systemd-analyze");
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("ordering cycle"))
        .map(str::to_string)
        .collect()
}

#[test]
fn unit_forms_no_ordering_cycle_with_a_tmpfs_tmp() {
    let Some(analyze) = systemd_analyze() else {
        eprintln!("skipping: systemd-analyze is not installed here");
        return;
    };
    // The unit as installed: a binary under /tmp (a checkout there) would itself order
    // the unit after tmp.mount, and ordering does not need the binary to exist.
    let unit = UNIT.to_string();
    let cycles = ordering_cycles(analyze, &unit);
    assert!(cycles.is_empty(), "{}", cycles.join("\n"));

    // The check can fail: PrivateTmp= orders the unit after tmp.mount, which is after
    // swap.target, which is after the unit. systemd then drops one job of the cycle to break
    // it, tmp.mount's or the unit's: which one varies from run to run.
    let private_tmp = unit.replace("[Service]\n", "[Service]\nPrivateTmp=yes\n");
    let cycles = ordering_cycles(analyze, &private_tmp);
    if cycles.is_empty() {
        eprintln!("note: this systemd-analyze reports no ordering cycle even with PrivateTmp=yes");
    } else {
        assert!(
            cycles
                .iter()
                .any(|l| l.contains("tmp.mount") || l.contains("uzram@swap0.service")),
            "{cycles:?}"
        );
    }
}

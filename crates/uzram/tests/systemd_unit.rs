//! `systemd-analyze verify` on the shipped unit, where systemd-analyze exists (it checks keys,
//! dependencies and that every Exec command is an executable file). The unit's binary path
//! is pointed at the freshly built `uzram`, since it is not installed here; the example config
//! is the instance's `ConditionPathExists` file only in spirit, so it is not needed.

use std::path::Path;
use std::process::Command;

const UNIT: &str = include_str!("../../../systemd/uzram@.service");
const INSTALLED_BIN: &str = "/usr/local/sbin/uzram";

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

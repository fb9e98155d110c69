//! Runs the `uzram` binary without ublk: argument errors, privilege and module checks, unknown
//! devices, an empty `list`. Privileged end-to-end tests run in the guest (scripts/e2e).

use std::path::Path;
use std::process::{Command, Output};

fn uzram(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(args)
        .output()
        .expect("running uzram")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts failure with a message that contains `needle` (case-insensitive).
fn refused(args: &[&str], needle: &str) {
    let out = uzram(args);
    assert!(!out.status.success(), "uzram {args:?} succeeded");
    let err = stderr(&out);
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "uzram {args:?}: stderr {err:?} lacks {needle:?}"
    );
    assert!(out.stdout.is_empty(), "uzram {args:?} printed to stdout");
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn has_live_state() -> bool {
    std::fs::read_dir("/run/uzram").is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".json"))
    })
}

#[test]
fn help_lists_the_commands() {
    let out = uzram(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in [
        "create", "destroy", "recover", "list", "status", "run", "swap-on", "swap-off", "bench",
    ] {
        assert!(text.contains(cmd), "help lacks {cmd}: {text}");
    }
    assert!(
        !text.lines().any(|l| l.trim_start().starts_with("daemon ")),
        "the internal daemon command is hidden: {text}"
    );
    let out = uzram(&["create", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--size",
        "--algorithm",
        "--backend",
        "--queues",
        "--depth",
        "--mem-limit",
        "--id",
        "--foreground",
    ] {
        assert!(text.contains(flag), "create --help lacks {flag}");
    }
}

#[test]
fn the_cold_tiers_commands_check_their_arguments_first() {
    // zram's idle takes "all" or an age: one of the two, never neither or both.
    refused(&["idle", "0"], "--all");
    refused(
        &["idle", "0", "--all", "--age", "1h"],
        "cannot be used with",
    );
    refused(&["idle", "0", "--age", "soon"], "bad age");
    refused(&["recompress", "0", "--algorithm", "lz4"], "writes zstd");
    for flag in [
        "--writeback-device",
        "--writeback-idle-age",
        "--writeback-limit",
    ] {
        let out = uzram(&["create", "--help"]);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(flag),
            "create --help lacks {flag}"
        );
    }
    refused(
        &["create", "--size", "1G", "--writeback-device", "wb"],
        "not an absolute path",
    );
    refused(
        &["create", "--size", "1G", "--writeback-limit", "1G/day"],
        "need writeback-device",
    );
    refused(
        &[
            "create",
            "--size",
            "1G",
            "--writeback-device",
            "/var/lib/uzram/a.wb",
            "--writeback-limit",
            "lots",
        ],
        "SIZE/day",
    );
}

#[test]
fn list_takes_zramctls_flags() {
    let out = uzram(&["list", "--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--output <LIST>",
        "--output-all",
        "--bytes",
        "--raw",
        "--noheadings",
        "--json",
        "MIGRATED",
        "STREAMS",
        "COMP-RATIO",
    ] {
        assert!(text.contains(flag), "list --help lacks {flag}: {text}");
    }
    // Checked before anything else, so also as a user and without devices.
    refused(&["list", "-o", "NAME,BOGUS"], "unknown column: BOGUS");
    refused(&["list", "-o", "+SIZE"], "unknown column: SIZE");
    refused(&["list", "--json", "-o", "NAME"], "cannot be used with");
    refused(&["list", "--json", "--raw"], "cannot be used with");
}

#[test]
fn bad_sizes_are_refused_before_privilege_checks() {
    refused(&["create", "--size", "0"], "size");
    refused(&["create", "--size", "17T"], "16T maximum");
    refused(&["create", "--size", "1000000T"], "size");
    refused(&["create", "--size", "12Q"], "invalid size");
    refused(
        &["create", "--size", "64M", "--mem-limit", "lots"],
        "memory limit",
    );
    refused(&["create"], "--size");
}

#[test]
fn bad_settings_are_refused() {
    refused(
        &["create", "--size", "64M", "--algorithm", "foo"],
        "unknown compression algorithm \"foo\"",
    );
    refused(
        &["create", "--size", "64M", "--backend", "gpu"],
        "gpu backend is not available",
    );
    refused(
        &["create", "--size", "64M", "--backend", "tpu"],
        "unknown backend",
    );
    refused(
        &["create", "--size", "64M", "--queues", "0"],
        "queues must be between",
    );
    refused(
        &["create", "--size", "64M", "--depth", "5000"],
        "depth must be between",
    );
    refused(&["status", "ublkc3"], "invalid device");
    refused(&["recover", "ublkc3"], "invalid device");
    refused(&["recover", "--wait", "ublkc3"], "invalid device");
    refused(&["recover"], "required");
    // `uzram daemon --wait` (what `recover --wait` starts) waits for a device to take over
    refused(
        &["daemon", "--size", "64M", "--ready-fd", "1", "--wait"],
        "--recover",
    );
    refused(&["destroy"], "required");
    refused(&["destroy", "1", "--all"], "cannot be used with");
}

#[test]
fn run_refuses_bad_config_files() {
    let dir = std::env::temp_dir().join(format!("uzram-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let typo = dir.join("typo.toml");
    std::fs::write(&typo, "size = \"1G\"\ncompresion-algorithm = \"lz4\"\n").unwrap();
    refused(
        &["run", "--config", typo.to_str().unwrap()],
        "compresion-algorithm",
    );
    let badexpr = dir.join("badexpr.toml");
    std::fs::write(&badexpr, "zram-size = \"ram / \"\n").unwrap();
    refused(
        &["run", "--config", badexpr.to_str().unwrap()],
        "zram-size = \"ram / \" is not a valid expression",
    );
    let old = dir.join("old.toml");
    std::fs::write(&old, "zram-size = \"8G\"\n").unwrap();
    refused(
        &["run", "--config", old.to_str().unwrap()],
        "write zram-size = 8192, or size = \"8G\"",
    );
    refused(
        &["run", "--config", "/nonexistent/uzram.toml"],
        "cannot read config file",
    );
    refused(
        &["swap-on", "--config", typo.to_str().unwrap()],
        "compresion-algorithm",
    );
    refused(
        &["swap-off", "--config", "/nonexistent/uzram.toml"],
        "cannot read config file",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn check_config_exit_codes_are_execcondition_s() {
    let dir = std::env::temp_dir().join(format!("uzram-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        uzram(&["check-config", "--config", path.to_str().unwrap()])
    };
    // A device: exit 0 and what it will be.
    let out = run("ok.toml", "zram-size = 64\nzram-resident-limit = 16\n");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("a device of 64M (67108864 bytes)"), "{text}");
    assert!(text.contains("memory limit 16M"), "{text}");
    // No device here (this host has more than 1 MiB of RAM): exit 1, the unit is skipped.
    let out = run("skip.toml", "zram-size = 64\nhost-memory-limit = 1\n");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("more than host-memory-limit = 1 MiB"));
    let out = run("zero.toml", "zram-size = \"ram * 0\"\n");
    assert_eq!(out.status.code(), Some(1));
    // An invalid file: exit 255, which fails the unit.
    let out = run("bad.toml", "zram-size = \"ram +\"\n");
    assert_eq!(out.status.code(), Some(255));
    assert!(
        stderr(&out).contains("zram-size = \"ram +\""),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn man_page_and_completions_come_from_the_cli() {
    let out = uzram(&["man"]);
    assert!(out.status.success());
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        page.starts_with(".ie \\n(.g .ds Aq"),
        "roff: {}",
        &page[..80]
    );
    assert!(page.contains(".TH uzram 8"), "section 8");
    for word in ["create", "check\\-config", "completions"] {
        assert!(page.contains(word), "man page lacks {word}");
    }
    let dir = std::env::temp_dir().join(format!("uzram-man-{}", std::process::id()));
    let out = uzram(&["man", "--dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let list = std::fs::read_to_string(dir.join("uzram-list.8")).unwrap();
    assert!(
        list.contains("\\-\\-output\\-all"),
        "uzram-list.8 documents --output-all"
    );
    assert!(
        !dir.join("uzram-daemon.8").exists(),
        "hidden commands get no page"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    for (shell, needle) in [
        ("bash", "complete -F _uzram"),
        ("zsh", "#compdef uzram"),
        ("fish", "complete -c uzram"),
    ] {
        let out = uzram(&["completions", shell]);
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(needle),
            "{shell}: {}",
            &text[..200.min(text.len())]
        );
        assert!(
            text.contains("noheadings"),
            "{shell} completes list's flags"
        );
    }
    refused(&["completions", "tcsh"], "invalid value");
}

#[test]
fn non_root_is_refused() {
    if !is_root() {
        refused(&["create", "--size", "64M"], "uzram must run as root");
        refused(&["list"], "uzram must run as root");
        return;
    }
    // As root, drop to nobody with setpriv (util-linux) to see the message a user gets.
    let exe = env!("CARGO_BIN_EXE_uzram");
    let probe = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            exe,
            "--version",
        ])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        other => {
            eprintln!(
                "SKIP non_root_is_refused: cannot run {exe} as nobody via setpriv: {other:?}"
            );
            return;
        }
    }
    for args in [
        &["create", "--size", "64M"][..],
        &["list"],
        &["status", "0"],
        &["destroy", "0"],
    ] {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", exe])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded as nobody");
        assert!(
            stderr(&out).contains("uzram must run as root"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn missing_module_is_explained() {
    if !is_root() {
        eprintln!("SKIP missing_module_is_explained: needs root (the root check comes first)");
        return;
    }
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("SKIP missing_module_is_explained: ublk_drv is loaded on this host");
        return;
    }
    refused(
        &["create", "--size", "64M"],
        "the ublk_drv kernel module is not loaded: run modprobe ublk_drv",
    );
    let dir = std::env::temp_dir().join(format!("uzram-cli-mod-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("ok.toml");
    std::fs::write(&cfg, "zram-size = 64\n").unwrap();
    refused(
        &["run", "--config", cfg.to_str().unwrap()],
        "modprobe ublk_drv",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_devices_and_empty_list() {
    if !is_root() {
        eprintln!("SKIP unknown_devices_and_empty_list: needs root");
        return;
    }
    refused(&["status", "/dev/ublkb999"], "unknown device /dev/ublkb999");
    refused(&["destroy", "ublkb999"], "unknown device /dev/ublkb999");
    if has_live_state() {
        eprintln!("SKIP empty list: /run/uzram has devices");
        return;
    }
    let out = uzram(&["list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        out.stdout.is_empty(),
        "list with no devices prints nothing, like zramctl"
    );
    let out = uzram(&["list", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v, serde_json::json!({ "devices": [] }));
    let out = uzram(&["destroy", "--all"]);
    assert!(
        out.status.success(),
        "destroy --all with nothing to do: {}",
        stderr(&out)
    );
}

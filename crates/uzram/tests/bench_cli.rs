//! `uzram bench` from the outside: the JSON report's shape and the error paths.

use std::path::PathBuf;
use std::process::{Command, Output};

fn uzram(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(args)
        .output()
        .expect("run uzram")
}

/// A scratch file under the system temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &[u8]) -> Self {
        let path =
            std::env::temp_dir().join(format!("uzram-bench-cli-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).expect("write temp file");
        Self(path)
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn slice(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../../testdata/{name}.slice.pages.zst",
        env!("CARGO_MANIFEST_DIR")
    );
    let packed = std::fs::read(&path).expect("read test slice");
    zstd::decode_all(&packed[..]).expect("decode test slice")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn json_report_has_every_key_and_verifies() {
    for (corpus, algorithm) in [("python-heap", "lz4"), ("mixed-swap", "zstd")] {
        let file = TempFile::new(&format!("{corpus}-{algorithm}"), &slice(corpus));
        let out = uzram(&[
            "bench",
            "--corpus",
            file.arg(),
            "--algorithm",
            algorithm,
            "--queues",
            "2",
            "--total",
            "4M",
            "--repeat",
            "1",
            "--backend",
            "cpu,auto",
            "--json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let stdout = String::from_utf8(out.stdout).expect("utf-8");
        let lines: Vec<&str> = stdout.trim().lines().collect();
        assert_eq!(lines.len(), 2, "one JSON object per backend: {stdout}");
        for (line, asked) in lines.iter().zip(["cpu", "auto"]) {
            let v: serde_json::Value = serde_json::from_str(line).expect("valid JSON");
            assert_eq!(
                v["corpus"],
                format!(
                    "uzram-bench-cli-{}-{corpus}-{algorithm}",
                    std::process::id()
                )
            );
            assert_eq!(v["backend_asked"], asked);
            // No GPU in CI; with zstd, auto never uses one.
            if algorithm == "zstd" || !uzram_gpu_present() {
                assert_eq!(v["backend"], "cpu");
            }
            assert_eq!(v["pages"], 1024);
            assert_eq!(v["bytes"], 1024 * 4096);
            assert_eq!(v["queues"], 2);
            assert_eq!(
                v["algorithm"],
                if algorithm == "lz4" { "lz4" } else { "zstd:1" }
            );
            assert_eq!(v["verified"], true);
            let ratio = v["ratio"].as_f64().expect("ratio");
            assert!(ratio > 1.5, "real pages compress: {ratio}");
            for key in [
                "ingest_gbps",
                "ack_gbps",
                "cpu_s_per_gib",
                "read_idle_p50_us",
                "read_idle_p99_us",
                "payload_ratio",
            ] {
                assert!(v[key].as_f64().expect(key) > 0.0, "{key}: {line}");
            }
            assert!(v["read_idle_p99_us"].as_f64() >= v["read_idle_p50_us"].as_f64());
            // The first writer to finish its share is done by the time the last one is.
            let first = v["first_writer_done_s"]
                .as_f64()
                .expect("first_writer_done_s");
            let ack = v["ack_s"].as_f64().expect("ack_s");
            assert!(
                first > 0.0 && first <= ack,
                "first writer {first} s, ack {ack} s"
            );
        }
    }
}

/// The one JSON report of a bench that succeeded.
fn one_report(out: Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_str(String::from_utf8(out.stdout).expect("utf-8").trim()).expect("JSON")
}

/// `--overwrites`: the same pages written again with other contents, reported apart, and
/// every page read back as the last pass wrote it.
#[test]
fn overwrites_are_reported_apart_and_read_back_as_last_written() {
    let file = TempFile::new("overwrites", &slice("mixed-swap"));
    let out = uzram(&[
        "bench",
        "--corpus",
        file.arg(),
        "--queues",
        "2",
        "--total",
        "4M",
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--overwrites",
        "2",
        "--json",
    ]);
    let v = one_report(out);
    assert_eq!(v["verified"], true, "{v}");
    let o = &v["overwrite"];
    assert_eq!(o["passes"], 2, "{v}");
    for key in ["ingest_gbps", "cpu_s_per_gib", "read_busy_p99_us", "ratio"] {
        assert!(o[key].as_f64().expect(key) > 0.0, "{key}: {o}");
    }
    let (holes, compacted) = (
        o["ratio"].as_f64().unwrap(),
        o["ratio_compacted"].as_f64().unwrap(),
    );
    assert!(holes > 1.5, "real pages compress: {holes}");
    assert!(compacted >= holes, "a compaction never holds more: {o}");
    assert!(
        o["cpu_s_per_gib_by_role"]["queues"].as_f64().unwrap() > 0.0,
        "{o}"
    );
    // Without the flag there is no such object.
    let out = uzram(&[
        "bench",
        "--corpus",
        file.arg(),
        "--queues",
        "1",
        "--total",
        "1M",
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--json",
    ]);
    let v = one_report(out);
    assert!(v.get("overwrite").is_none(), "{v}");
}

/// Each run builds a fresh store in the bench's one region; a dropped store's segments must
/// go back to the pool. When they stayed out (a home that keeps them for a daemon's next
/// takeover), the fourth or fifth run of 32 MiB failed its writes with ENOMEM.
#[test]
fn many_runs_reuse_the_memory_of_the_runs_before() {
    let file = TempFile::new("many-runs", &slice("mixed-swap"));
    let out = uzram(&[
        "bench",
        "--corpus",
        file.arg(),
        "--total",
        "32M",
        "--repeat",
        "9",
        "--queues",
        "2",
        "--backend",
        "cpu",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("one JSON object for one backend");
    assert_eq!(v["repeat"], 9);
    assert_eq!(v["verified"], true);
}

/// True where libcuda loads and reports a GPU (then `auto` may pick it).
fn uzram_gpu_present() -> bool {
    ["/dev/nvidia0", "/dev/nvidiactl"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

#[test]
fn human_output_compares_the_backends() {
    let file = TempFile::new("human", &slice("python-heap")[..64 * 4096]);
    let out = uzram(&[
        "bench",
        "--corpus",
        file.arg(),
        "--repeat",
        "1",
        "--total",
        "2M",
        "--queues",
        "1",
        "--backend",
        "cpu,auto",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for key in [
        "ingest",
        "CPU-s/GiB",
        "ratio",
        "busy p50/p99",
        " vs cpu (buffer): ingest x",
        "true",
    ] {
        assert!(stdout.contains(key), "{key} missing in {stdout}");
    }
}

#[test]
fn user_copy_runs_beside_the_buffer_and_a_bad_value_is_refused() {
    let file = TempFile::new("copy", &slice("python-heap")[..64 * 4096]);
    let args = |copy: &'static str| {
        [
            "bench",
            "--corpus",
            file.arg(),
            "--repeat",
            "1",
            "--total",
            "2M",
            "--queues",
            "1",
            "--backend",
            "cpu",
            "--user-copy",
            copy,
        ]
    };
    let out = uzram(&args("on,off"));
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(" user "), "{stdout}");
    assert!(stdout.contains(" buf "), "{stdout}");
    assert!(
        stdout.contains("cpu user copy vs the request's buffer: CPU per GiB x"),
        "{stdout}"
    );
    // the cpu backend's run is made once for `auto,off`
    let out = uzram(&args("auto,off"));
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(" buf ") && !l.starts_with('('))
        .count();
    assert_eq!(rows, 1);
    let out = uzram(&args("sometimes"));
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--user-copy"), "{}", stderr(&out));
}

#[test]
fn writes_rotate_over_the_request_buffers_asked_for() {
    let file = TempFile::new("tags", &slice("mixed-swap")[..256 * 4096]);
    for buffers in ["1", "64"] {
        let out = uzram(&[
            "bench",
            "--corpus",
            file.arg(),
            "--repeat",
            "1",
            "--total",
            "8M",
            "--queues",
            "2",
            "--request-buffers",
            buffers,
            "--json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("JSON");
        assert_eq!(v["request_buffers"], buffers.parse::<u64>().unwrap());
        // 64 buffers of 64 KiB a writer hold 4 MiB: every page still lands where it belongs.
        assert_eq!(v["verified"], true, "{v}");
    }
}

#[test]
fn gpu_without_a_gpu_is_refused_with_the_way_out() {
    if uzram_gpu_present() {
        eprintln!("skipping: this machine has a GPU");
        return;
    }
    let file = TempFile::new("gpu", &slice("python-heap")[..64 * 4096]);
    let out = uzram(&[
        "bench",
        "--corpus",
        file.arg(),
        "--backend",
        "cpu,gpu",
        "--total",
        "1M",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--backend cpu"), "{}", stderr(&out));
}

#[test]
fn bad_inputs_fail_with_a_clear_message() {
    let odd = TempFile::new("odd", &[1u8; 4097]);
    let empty = TempFile::new("empty", &[]);
    let good = TempFile::new("good", &[7u8; 4096]);
    let missing = std::env::temp_dir().join("uzram-bench-cli-no-such-file");
    let cases: [(Vec<&str>, &str); 13] = [
        (
            vec!["--corpus", missing.to_str().unwrap()],
            "cannot read corpus",
        ),
        (
            vec!["--corpus", odd.arg()],
            "not a multiple of the 4096-byte page",
        ),
        (vec!["--corpus", empty.arg()], "is empty"),
        (
            vec!["--corpus", good.arg(), "--backend", "tpu"],
            "unknown backend \"tpu\"",
        ),
        (vec!["--corpus", good.arg(), "--queues", "0"], "--queues"),
        (
            vec!["--corpus", good.arg(), "--algorithm", "snappy"],
            "unknown compression algorithm",
        ),
        (
            vec!["--corpus", good.arg(), "--backend", "cpu,cpu"],
            "given twice",
        ),
        (
            vec!["--corpus", good.arg(), "--total", "4K"],
            "at least one 64 KiB request",
        ),
        (
            vec!["--corpus", good.arg(), "--gpu-parse", "medium"],
            "fast or high",
        ),
        (
            vec!["--corpus", good.arg(), "--request-buffers", "0"],
            "--request-buffers must be in 1..=4096",
        ),
        (
            vec!["--corpus", good.arg(), "--request-buffers", "4097"],
            "--request-buffers must be in 1..=4096",
        ),
        (
            // 4096 writers' 4096 buffers of 64 KiB: 1 TiB, over a quarter of any host's RAM
            vec![
                "--corpus",
                good.arg(),
                "--queues",
                "4096",
                "--request-buffers",
                "4096",
            ],
            "over a quarter of this host's",
        ),
        (
            vec!["--corpus", good.arg(), "--overwrites", "101"],
            "--overwrites must be at most 100",
        ),
    ];
    for (args, message) in cases {
        let mut full = vec!["bench"];
        full.extend(args.iter().copied());
        let out = uzram(&full);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(out.stdout.is_empty(), "{args:?} printed a report");
        assert!(stderr(&out).contains(message), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn zstd_compressed_corpus_is_read_directly() {
    let path = format!(
        "{}/../../testdata/mixed-swap.slice.pages.zst",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = uzram(&[
        "bench", "--corpus", &path, "--repeat", "1", "--total", "1M", "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pages"], 256);
    assert_eq!(v["corpus"], "mixed-swap");
    assert_eq!(v["verified"], true);

    let dir = std::env::temp_dir().join(format!("uzram-bench-zst-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.pages.zst");
    std::fs::write(&bad, [0u8; 4096]).unwrap();
    let out = uzram(&["bench", "--corpus", bad.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not valid zstd"),
        "{}",
        stderr(&out)
    );
}

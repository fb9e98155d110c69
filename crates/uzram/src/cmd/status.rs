//! `uzram status DEV [--json|--prometheus]`: every counter of one device, with zram's names.

use std::process::ExitCode;

use super::{probe, Probe};
use crate::cli::StatusArgs;
use crate::control::proto::DeviceStatus;
use crate::control::state::StateDir;
use crate::devname::{dev_path, parse_device};
use crate::size::format_size;

pub fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let id = parse_device(&args.device).map_err(anyhow::Error::msg)?;
    super::require_root()?;
    let states = StateDir::default();
    let Some(state) = states.read(id)? else {
        anyhow::bail!(
            "unknown device {}: no uzram device with id {id}",
            dev_path(id)
        );
    };
    let status = match probe(&states, &state) {
        Probe::Live(s) => s,
        Probe::Orphan => {
            super::warn_orphan(&state);
            Box::new(super::orphan_status(&state))
        }
        Probe::Stale(why) => anyhow::bail!(
            "{}: {why} (stale state): run uzram destroy {id} to clean up",
            state.dev
        ),
        Probe::Silent(why) => anyhow::bail!("{}", super::silent_advice(&state, &why)),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&status))?);
    } else if args.prometheus {
        print!("{}", crate::metrics::render(&status));
    } else {
        print!("{}", render(&status));
    }
    Ok(ExitCode::SUCCESS)
}

/// The JSON report: settings, then `stats` (zram's mm_stat and io_stat names) and `requests`
/// as name → value objects.
pub fn to_json(s: &DeviceStatus) -> serde_json::Value {
    let map =
        |stats: &[crate::control::proto::Stat]| -> serde_json::Map<String, serde_json::Value> {
            stats
                .iter()
                .map(|st| (st.name.clone(), serde_json::Value::from(st.value)))
                .collect()
        };
    serde_json::json!({
        "device": s.dev,
        "id": s.id,
        "pid": s.pid,
        "disksize": s.size,
        "algorithm": s.algorithm,
        "backend": s.backend,
        "queues": s.queues,
        "depth": s.depth,
        "queue_mode": s.queue_mode,
        "stats": map(&s.stats),
        "requests": map(&s.requests),
        "backend_stats": map(&s.backend_stats),
    })
}

/// The human-readable report.
pub fn render(s: &DeviceStatus) -> String {
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<18} {v}\n"));
    line("device", s.dev.clone());
    line("pid", s.pid.to_string());
    line("disksize", format!("{} ({})", s.size, format_size(s.size)));
    line("algorithm", s.algorithm.clone());
    line("backend", s.backend.clone());
    line("queues", s.queues.to_string());
    line("depth", s.depth.to_string());
    line("queue_mode", s.queue_mode.clone());
    for stat in s.stats.iter().chain(&s.requests).chain(&s.backend_stats) {
        line(&stat.name, stat.value.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::Stat;

    #[test]
    fn json_has_one_key_per_counter() {
        let s = DeviceStatus {
            id: 1,
            dev: "/dev/ublkb1".into(),
            pid: 9,
            size: 1 << 20,
            algorithm: "lz4".into(),
            backend: "cpu".into(),
            queues: 1,
            depth: 4,
            queue_mode: "per-queue".into(),
            stats: vec![Stat {
                name: "orig_data_size".into(),
                value: 4096,
            }],
            requests: vec![Stat {
                name: "read_requests".into(),
                value: 3,
            }],
            backend_stats: vec![Stat {
                name: "fallback_batches".into(),
                value: 2,
            }],
        };
        let v = to_json(&s);
        assert_eq!(v["stats"]["orig_data_size"], 4096);
        assert_eq!(v["requests"]["read_requests"], 3);
        assert_eq!(v["backend_stats"]["fallback_batches"], 2);
        assert_eq!(v["device"], "/dev/ublkb1");
        assert_eq!(v["queue_mode"], "per-queue");
        let text = render(&s);
        assert!(text.contains("orig_data_size     4096\n"), "{text}");
        assert!(text.contains("fallback_batches   2\n"), "{text}");
        assert!(text.contains("queue_mode         per-queue\n"), "{text}");
    }
}

//! `uzram idle DEV --all|--age AGE`, `uzram recompress DEV [--type T] [--threshold B]` and
//! `uzram writeback DEV [--type T] [--max-pages N]`: zram's `idle`, `recompress` and
//! `writeback` triggers, sent to the device's daemon. The daemon recompresses and writes back
//! by itself when its config asks (`recompress-algorithm`, `writeback-device`); these run a
//! pass now.

use std::process::ExitCode;
use std::time::Duration;

use crate::cli::{IdleArgs, RecompressArgs, WritebackArgs};
use crate::config::parse_age;
use crate::control::client::request;
use crate::control::proto::{Request, Response};
use crate::control::state::StateDir;
use crate::devname::{dev_path, parse_device};
use crate::size::format_size;

/// How long `recompress` waits for the pass: a large device takes a while (a few tens of
/// microseconds a page).
const RECOMPRESS_WAIT: Duration = Duration::from_secs(30 * 60);

fn ask(device: &str, req: &Request, wait: Duration) -> anyhow::Result<(String, Response)> {
    let id = parse_device(device).map_err(anyhow::Error::msg)?;
    super::require_root()?;
    let states = StateDir::default();
    if states.read(id)?.is_none() {
        anyhow::bail!(
            "unknown device {}: no uzram device with id {id}",
            dev_path(id)
        );
    }
    let response = request(&states.socket_path(id), req, wait)
        .map_err(|e| anyhow::anyhow!("{}: its daemon did not answer: {e}", dev_path(id)))?;
    if let Response::Error { message } = &response {
        anyhow::bail!("{}: {message}", dev_path(id));
    }
    Ok((dev_path(id), response))
}

pub fn idle(args: IdleArgs) -> anyhow::Result<ExitCode> {
    // clap lets through --all or --age, not both and not neither.
    let min_age_minutes = match (&args.age, args.all) {
        (Some(age), false) => Some(parse_age(age)?),
        _ => None,
    };
    let (dev, response) = ask(
        &args.device,
        &Request::Idle { min_age_minutes },
        Duration::from_secs(60),
    )?;
    let Response::Idled { pages } = response else {
        anyhow::bail!("{dev}: unexpected answer {response:?}");
    };
    println!("{dev}: {pages} pages marked idle");
    Ok(ExitCode::SUCCESS)
}

/// The zstd level `--algorithm` names; `None` without it (the device's own setting).
/// A bare `zstd` is the recompressor's level (3), as in a config's `recompress-algorithm`,
/// not the page codec's default.
fn recompress_level(algorithm: Option<&str>) -> anyhow::Result<Option<i32>> {
    let Some(text) = algorithm else {
        return Ok(None);
    };
    if text == "zstd" {
        return Ok(Some(uzram_core::store::DEFAULT_RECOMPRESS_LEVEL));
    }
    match uzram_core::codec::Algorithm::parse(text) {
        Ok(uzram_core::codec::Algorithm::Zstd { level }) => Ok(Some(level)),
        Err(err) if text.starts_with("zstd:") => {
            anyhow::bail!("uzram recompress --algorithm {text:?}: {err}")
        }
        _ => anyhow::bail!(
            "uzram recompress --algorithm writes zstd: give zstd or zstd:LEVEL, not {text:?} \
             (leave it out for the device's recompress-algorithm, zstd-gpu, lz4-gpu and lz4-gpu-dict included)"
        ),
    }
}

pub fn recompress(args: RecompressArgs) -> anyhow::Result<ExitCode> {
    let level = recompress_level(args.algorithm.as_deref())?;
    let req = Request::Recompress {
        kind: args.kind.clone(),
        threshold: args.threshold,
        level,
    };
    let (dev, response) = ask(&args.device, &req, RECOMPRESS_WAIT)?;
    let Response::Recompressed(r) = response else {
        anyhow::bail!("{dev}: unexpected answer {response:?}");
    };
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{dev}: {} pages tried, {} recompressed, {} kept; {} saved; memory {} -> {}",
        r.tried,
        r.rewritten,
        r.kept,
        format_size(r.saved_bytes),
        format_size(r.mem_used_before),
        format_size(r.mem_used_after),
    );
    if r.raced > 0 || r.failed > 0 {
        println!(
            "{dev}: {} written meanwhile, {} not rewritten (no memory under the limit, or a failed checksum)",
            r.raced, r.failed
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn writeback(args: WritebackArgs) -> anyhow::Result<ExitCode> {
    let req = Request::Writeback {
        kind: args.kind.clone(),
        max_pages: args.max_pages,
    };
    let (dev, response) = ask(&args.device, &req, RECOMPRESS_WAIT)?;
    let Response::WrittenBack(r) = response else {
        anyhow::bail!("{dev}: unexpected answer {response:?}");
    };
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{dev}: {} pages written back in {} blocks ({} of {} in RAM); memory {} -> {}",
        r.pages,
        r.blocks,
        format_size(r.blocks * uzram_core::store::BLOCK_BYTES as u64),
        format_size(r.payload_bytes),
        format_size(r.mem_used_before),
        format_size(r.mem_used_after),
    );
    if r.raced > 0 {
        println!("{dev}: {} written meanwhile (they stay in RAM)", r.raced);
    }
    if let Some(left) = r.budget_left_bytes {
        println!(
            "{dev}: {} of today's writeback-limit left",
            format_size(left)
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::recompress_level;

    #[test]
    fn bare_zstd_is_the_recompressors_level_as_in_a_config() {
        assert_eq!(
            recompress_level(Some("zstd")).unwrap(),
            Some(uzram_core::store::DEFAULT_RECOMPRESS_LEVEL)
        );
        assert_eq!(uzram_core::store::DEFAULT_RECOMPRESS_LEVEL, 3);
        assert_eq!(recompress_level(Some("zstd:7")).unwrap(), Some(7));
        assert_eq!(recompress_level(None).unwrap(), None);
    }

    #[test]
    fn other_algorithms_and_bad_levels_are_refused() {
        for text in ["lz4", "zstd-gpu", "zstd:99", "zstd:x", ""] {
            assert!(recompress_level(Some(text)).is_err(), "{text:?} was taken");
        }
    }
}

//! `uzram bench`: corpus through a PageStore, verified, with throughput and ratio.

use std::process::ExitCode;

use crate::cli::BenchArgs;

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("bench of {} is being written", args.corpus.display())
}

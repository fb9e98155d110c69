//! Command-line arguments as typed (clap); validation into configs happens elsewhere.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// uzram: compressed RAM block devices (a userspace zram on ublk).
#[derive(Debug, Parser)]
#[command(name = "uzram", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Store every page of a corpus file through a PageStore, read it back, verify, report.
    Bench(BenchArgs),
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// File of raw concatenated 4 KiB pages.
    #[arg(long)]
    pub corpus: PathBuf,
    /// Compression algorithm: lz4, zstd or zstd:LEVEL.
    #[arg(long, default_value = "lz4")]
    pub algorithm: String,
    /// Compression backend.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Worker threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

//! `uzram completions SHELL` and `uzram man`: shell completions and man pages generated from
//! the clap definitions, so they never disagree with `--help`.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::CommandFactory;

use crate::cli::{Cli, CompletionsArgs, ManArgs};

pub fn completions(args: CompletionsArgs) -> anyhow::Result<ExitCode> {
    let mut cmd = Cli::command();
    clap_complete::generate(args.shell, &mut cmd, "uzram", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// `uzram` is an administration tool: section 8, like zramctl(8).
const SECTION: &str = "8";

fn page(cmd: clap::Command) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd)
        .section(SECTION)
        .render(&mut out)
        .context("rendering the man page")?;
    Ok(out)
}

pub fn man(args: ManArgs) -> anyhow::Result<ExitCode> {
    let cmd = Cli::command();
    let Some(dir) = args.dir else {
        std::io::stdout().write_all(&page(cmd)?)?;
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut pages = vec![(format!("uzram.{SECTION}"), page(cmd.clone())?)];
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        // The page's title is the command as typed: uzram-create(8) for `uzram create`.
        let name = format!("uzram-{}", sub.get_name());
        let sub = sub.clone().name(name.clone());
        pages.push((format!("{name}.{SECTION}"), page(sub)?));
    }
    for (file, text) in pages {
        let path = dir.join(&file);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

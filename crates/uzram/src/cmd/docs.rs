//! `uzram completions SHELL` and `uzram man`: shell completions and man pages generated from
//! the clap definitions, so they never disagree with `--help`; and the two pages that are no
//! command's, written by hand (`man/`): the config file's and the generator's.

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

/// The hand-written pages: (file name, roff).
const WRITTEN: [(&str, &str); 2] = [
    ("uzram.toml.5", include_str!("../../../../man/uzram.toml.5")),
    (
        "uzram-generator.8",
        include_str!("../../../../man/uzram-generator.8"),
    ),
];

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
    pages.extend(WRITTEN.map(|(file, text)| (file.to_string(), text.as_bytes().to_vec())));
    for (file, text) in pages {
        let path = dir.join(&file);
        // Root may run this on a directory a user can write: a link planted at a page's name
        // is replaced, never followed.
        crate::sys::write_replacing(&path, &text, 0o644)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted at a page's name (in a directory a user can write) is replaced, and
    /// the file it points at is left as it was.
    #[test]
    fn a_link_at_a_pages_name_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, "keep me").unwrap();
        let page = dir.path().join(format!("uzram.{SECTION}"));
        std::os::unix::fs::symlink(&target, &page).unwrap();
        let code = man(ManArgs {
            dir: Some(dir.path().to_path_buf()),
        })
        .unwrap();
        assert_eq!(code, ExitCode::SUCCESS);
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
        let meta = std::fs::symlink_metadata(&page).unwrap();
        assert!(meta.file_type().is_file(), "the link is still there");
        assert!(std::fs::read_to_string(&page)
            .unwrap()
            .contains(".TH uzram 8"));
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".new"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }

    /// Every key a uzram file accepts, as the config file's page must name them.
    const KEYS: &[&str] = &[
        "zram-size",
        "size",
        "zram-resident-limit",
        "mem-limit",
        "host-memory-limit",
        "compression-algorithm",
        "backend",
        "metrics-textfile",
        "swap-priority",
        "options",
        "fs-type",
        "queues",
        "depth",
        "queue-mode",
        "user-copy",
        "queue-affinity",
        "id",
        "gpus",
        "gpu-memory",
        "gpu-parse",
        "gpu-installers",
        "gpu-slot-wait-us",
        "gpu-slot-pages",
        "gpu-place",
        "checksums",
        "recompress-algorithm",
        "recompress-idle-age",
        "recompress-threshold",
        "writeback-device",
        "writeback-idle-age",
        "writeback-limit",
    ];

    #[test]
    fn the_config_page_names_every_key_a_file_accepts() {
        let page = WRITTEN[0].1;
        let host = crate::config::Host::with_ram(8192);
        for key in KEYS {
            let named = page
                .split(|c: char| c.is_whitespace() || c == '"' || c == ',')
                .any(|word| word == *key);
            assert!(named, "uzram.toml(5) lacks {key}");
            // and the key is one a file accepts (an unknown one is an error)
            let text = format!("{key} = 1\n");
            let err =
                crate::config::file::parse_config(std::path::Path::new("t.toml"), &text, host)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
            assert!(!err.contains("unknown field"), "{key}: {err}");
        }
        let text = "no-such-key = 1\n";
        let err = crate::config::file::parse_config(std::path::Path::new("t.toml"), text, host)
            .unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }
}

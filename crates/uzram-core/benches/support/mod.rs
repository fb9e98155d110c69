//! What the benches share: where their pages come from.

use std::path::{Path, PathBuf};

/// The corpora to measure: `UZRAM_CORPUS` (paths, `:`-separated), else
/// `../shared/corpus/{python-heap,mixed-swap}.pages.zst` beside the repository, else the
/// checked-in 2 MiB slices of them (`testdata/`).
pub fn corpus_paths() -> Vec<PathBuf> {
    if let Ok(list) = std::env::var("UZRAM_CORPUS") {
        return list
            .split(':')
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .collect();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let names = ["python-heap", "mixed-swap"];
    let shared: Vec<PathBuf> = names
        .iter()
        .map(|n| repo.join(format!("../shared/corpus/{n}.pages.zst")))
        .collect();
    if shared.iter().all(|p| p.exists()) {
        return shared;
    }
    println!("../shared/corpus not found: using the checked-in testdata slices (2 MiB each)");
    names
        .iter()
        .map(|n| repo.join(format!("testdata/{n}.slice.pages.zst")))
        .collect()
}

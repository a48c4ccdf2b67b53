//! `cargo xtask previous`: the release upgrades are tested from, built once
//! and kept in the cache.
//!
//! `deploy/previous-release` names a git revision of this repository. Its
//! `egressgw` binary is built in a worktree of its own, with a target
//! directory of its own (its artifacts never replace the current build's),
//! and kept with its Helm chart in `<cache>/previous/<revision>/`. A
//! revision built before is not built again.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};

use crate::lab::cmd;
use crate::lab::helm::CHART;
use crate::lab::state::Paths;

/// The file naming the previous release's revision.
const REVISION_FILE: &str = "deploy/previous-release";

/// A previous release, built.
#[derive(Debug, Clone)]
pub struct Previous {
    /// The full commit id.
    pub revision: String,
    /// Its `egressgw` binary.
    pub binary: PathBuf,
    /// Its Helm chart (`deploy/helm/egressgw` at the revision).
    pub chart: PathBuf,
}

/// `cargo xtask previous`.
#[derive(Debug, clap::Args)]
pub struct PreviousArgs {
    /// Print where it is only; fail if it is not built.
    #[arg(long)]
    no_build: bool,
}

pub fn run(args: &PreviousArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env_or(crate::lab::topology::DEFAULT_PREFIX)?;
    let previous = if args.no_build {
        find(&paths)?
    } else {
        ensure_built(&paths)?
    };
    println!("previous release {}", previous.revision);
    println!("egressgw: {}", previous.binary.display());
    println!("chart:    {}", previous.chart.display());
    Ok(())
}

/// The previous release, which must have been built (`cargo xtask previous`).
pub fn find(paths: &Paths) -> anyhow::Result<Previous> {
    let previous = at(paths, &revision()?);
    ensure!(
        previous.binary.is_file() && previous.chart.join("Chart.yaml").is_file(),
        "the previous release {} is not built: run `cargo xtask previous` first",
        previous.revision
    );
    Ok(previous)
}

/// The previous release, built now unless it was before.
pub fn ensure_built(paths: &Paths) -> anyhow::Result<Previous> {
    let previous = at(paths, &revision()?);
    if let Ok(found) = find(paths) {
        return Ok(found);
    }
    let dir = previous
        .binary
        .parent()
        .context("a binary has a directory")?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let source = dir.join("source");
    if source.exists() {
        remove_worktree(&source);
    }
    let root = crate::workspace_root();
    let root_arg = root.display().to_string();
    let source_arg = source.display().to_string();
    cmd::run(
        "git",
        &[
            "-C",
            &root_arg,
            "worktree",
            "add",
            "--detach",
            "--force",
            &source_arg,
            &previous.revision,
        ],
    )
    .context("checking the previous release out")?;
    let built = build(
        &source,
        &paths.cache.join("previous").join("target"),
        &previous,
    );
    remove_worktree(&source);
    built?;
    Ok(previous)
}

/// The revision `deploy/previous-release` names, as a full commit id.
fn revision() -> anyhow::Result<String> {
    let file = crate::workspace_root().join(REVISION_FILE);
    let text = fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let Some(named) = named_revision(&text) else {
        bail!("{} names no revision", file.display());
    };
    let root = crate::workspace_root().display().to_string();
    let commit = format!("{named}^{{commit}}");
    let full = cmd::run(
        "git",
        &["-C", &root, "rev-parse", "--verify", "--quiet", &commit],
    )
    .with_context(|| {
        format!(
            "{} names {named}, which this clone does not have (a shallow clone? \
                 `git fetch --unshallow` or `git fetch origin {named}`)",
            file.display()
        )
    })?;
    Ok(full.trim().to_owned())
}

/// The first line of `text` that is neither empty nor a `#` comment.
fn named_revision(text: &str) -> Option<&str> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
}

/// Where the revision's build is kept.
fn at(paths: &Paths, revision: &str) -> Previous {
    let dir = paths.cache.join("previous").join(revision);
    Previous {
        revision: revision.to_owned(),
        binary: dir.join("egressgw"),
        chart: dir.join("chart"),
    }
}

/// Builds `egressgw` in `source` into `target`, and keeps the binary and
/// the chart where `previous` says.
fn build(source: &Path, target: &Path, previous: &Previous) -> anyhow::Result<()> {
    println!(
        "building the previous release {} in {} (target {})",
        previous.revision,
        source.display(),
        target.display()
    );
    let status = Command::new("cargo")
        .args(["build", "--locked", "-p", "egressgw"])
        .current_dir(source)
        .env("CARGO_TARGET_DIR", target)
        // Nothing debugs it: no debug info builds and links faster.
        .env("CARGO_PROFILE_DEV_DEBUG", "false")
        .status()
        .context("running cargo")?;
    ensure!(
        status.success(),
        "building the previous release failed ({status})"
    );
    let built = target.join("debug").join("egressgw");
    let tmp = previous.binary.with_extension("new");
    fs::copy(&built, &tmp).with_context(|| format!("copying {}", built.display()))?;
    let chart = source.join(CHART);
    let tmp_chart = previous.chart.with_extension("new");
    if tmp_chart.exists() {
        fs::remove_dir_all(&tmp_chart)
            .with_context(|| format!("removing {}", tmp_chart.display()))?;
    }
    let (from, to) = (chart.display().to_string(), tmp_chart.display().to_string());
    cmd::run("cp", &["-r", &from, &to]).context("copying the chart")?;
    if previous.chart.exists() {
        fs::remove_dir_all(&previous.chart)
            .with_context(|| format!("removing {}", previous.chart.display()))?;
    }
    fs::rename(&tmp_chart, &previous.chart)
        .with_context(|| format!("moving {} into place", previous.chart.display()))?;
    // The binary last: its presence says the build is complete.
    fs::rename(&tmp, &previous.binary)
        .with_context(|| format!("moving {} into place", previous.binary.display()))
}

/// Removes the worktree at `source`, also from git's list; a failure only
/// leaves it for the next run, which removes it first.
fn remove_worktree(source: &Path) {
    let root = crate::workspace_root().display().to_string();
    let source = source.display().to_string();
    if let Err(e) = cmd::run(
        "git",
        &["-C", &root, "worktree", "remove", "--force", &source],
    ) {
        eprintln!("previous: removing the worktree {source}: {e:#}");
        let _ = fs::remove_dir_all(&source);
        let _ = cmd::run("git", &["-C", &root, "worktree", "prune"]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_revision_is_the_first_line_that_is_no_comment() {
        let text = "# upgrades are tested from\n\n  v0.1.0  \n# later\nv0.2.0\n";
        assert_eq!(named_revision(text), Some("v0.1.0"));
        assert_eq!(named_revision("# none\n\n"), None);
    }
}

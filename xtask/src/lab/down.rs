//! `lab down`: removes every lab namespace, process and file, whatever state
//! a lab is in (up, half made by a failed `up`, or half removed).
//!
//! What it removes is found, not remembered: the network namespaces named
//! `<prefix>-*` (this lab's prefix only), every process living in one of them, the processes of the pid
//! files (if they are still the programs the lab started), and the lab
//! directory's entries. Running it again finds nothing and does nothing.

use std::collections::BTreeSet;

use anyhow::{Context, anyhow};

use super::state::Paths;
use super::{net, preflight, process};

/// The mount points at or under `dir`, deepest first.
fn mounts_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<std::path::PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        // Spaces and the like are octal escapes in mountinfo; lab paths
        // have none.
        .map(std::path::PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    found
}

pub fn down(paths: &Paths) -> anyhow::Result<()> {
    preflight::require_root()?;
    teardown(paths)
}

/// Stops the processes, deletes the namespaces, removes the files. Keeps
/// going past failures and reports them all at the end.
pub fn teardown(paths: &Paths) -> anyhow::Result<()> {
    let namespaces = net::lab_netns(&paths.prefix).context("listing network namespaces")?;
    let mut errors = Vec::new();
    let mut pids: BTreeSet<u32> = process::recorded_pids(paths).into_iter().collect();
    for ns in &namespaces {
        match net::netns_pids(ns) {
            Ok(found) => pids.extend(found),
            Err(e) => errors.push(e.context(format!("listing the processes in {ns}"))),
        }
    }
    let pids: Vec<u32> = pids.into_iter().collect();
    let survivors = process::stop_all(&pids);
    if !survivors.is_empty() {
        errors.push(anyhow!("processes {survivors:?} survived SIGKILL"));
    }
    for ns in &namespaces {
        if let Err(e) = net::delete_netns(ns) {
            errors.push(e.context(format!("deleting {ns}")));
        }
    }
    // The nodes' bpf filesystems (see kubelet/volumes.rs), and anything
    // else mounted in the lab directory.
    for mount in mounts_under(&paths.lab) {
        if let Err(e) = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH) {
            errors.push(anyhow!("unmounting {}: {e}", mount.display()));
        }
    }
    let had_files = paths.any_present();
    errors.extend(paths.remove_all());
    println!(
        "lab down ({}): stopped {} processes, deleted {} network namespaces, {}",
        paths.prefix,
        pids.len() - survivors.len(),
        namespaces.len(),
        if had_files {
            format!("removed the state in {}", paths.lab.display())
        } else {
            "no state files".to_owned()
        }
    );
    match errors.len() {
        0 => Ok(()),
        n => {
            for e in &errors {
                eprintln!("lab down: {e:#}");
            }
            Err(anyhow!(
                "lab down: {n} problems (above); run it again once they are fixed"
            ))
        }
    }
}

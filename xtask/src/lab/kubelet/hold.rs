//! Holds: Pods whose containers the stand-in must not start or restart for
//! now — the lab's way to keep a killed process down (`lab agent kill`), as
//! a node whose container runtime is stuck would. A hold is a file
//! `<lab>/kubelet/hold/<namespace>_<name>`; the Pod stays in the API, its
//! probes keep running, and `lab down` removes holds with the rest.

use std::fs;
use std::path::PathBuf;

use anyhow::Context;

use crate::lab::state::Paths;

fn path(paths: &Paths, namespace: &str, name: &str) -> PathBuf {
    paths
        .lab
        .join("kubelet")
        .join("hold")
        .join(format!("{namespace}_{name}"))
}

/// Holds Pod `namespace/name`: from the stand-in's next round on, none of
/// its containers starts again (one that exits stays down).
pub fn hold(paths: &Paths, namespace: &str, name: &str) -> anyhow::Result<()> {
    let file = path(paths, namespace, name);
    if let Some(dir) = file.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(&file, "").with_context(|| format!("writing {}", file.display()))
}

/// Releases the Pod: its containers that are down start at the stand-in's
/// next round, without waiting out a crash backoff. No error if it was not
/// held.
pub fn release(paths: &Paths, namespace: &str, name: &str) -> anyhow::Result<()> {
    let file = path(paths, namespace, name);
    match fs::remove_file(&file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", file.display()))
        }
        _ => Ok(()),
    }
}

/// Whether the Pod is held.
pub fn is_held(paths: &Paths, namespace: &str, name: &str) -> bool {
    path(paths, namespace, name).exists()
}

//! What the stand-in records about the Pods it runs: `kubelet/pods.json`
//! for `lab status`, and each Pod's `state.json`, with which a stand-in
//! started again stops what an earlier one left.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use super::ctr::signal;
use super::pod::log;
use crate::lab::state::Paths;

/// What `lab status` shows about a Pod, and what a restarted stand-in
/// cleans up: `kubelet/pods/<uid>/state.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Record {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
    pub netns: String,
    /// The network namespace, if the Pod has its own.
    pub owned_netns: bool,
    pub ip: String,
    pub phase: String,
    pub containers: Vec<ContainerRecord>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ContainerRecord {
    pub name: String,
    pub state: String,
    pub pid: Option<u32>,
    /// The process's start time (`/proc/<pid>/stat` field 22), to tell it
    /// from a later process with the same pid.
    pub start_ticks: Option<u64>,
    pub restarts: u32,
    pub ready: bool,
    pub log: PathBuf,
}

/// `<lab>/kubelet/pods`: a directory per Pod (uid) the stand-in runs.
pub(super) fn pods_dir(paths: &Paths) -> PathBuf {
    paths.lab.join("kubelet").join("pods")
}

/// `<lab>/kubelet/nodes`: each node's host paths.
pub(super) fn nodes_dir(paths: &Paths) -> PathBuf {
    paths.lab.join("kubelet").join("nodes")
}

/// A process's start time in clock ticks since boot (`/proc/<pid>/stat`).
pub(super) fn start_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Stops what a stand-in that is no longer running left: the processes
/// its records name (if they are still those processes) and the Pods'
/// network namespaces; removes the records.
pub(super) fn clean_up_after_previous(paths: &Paths) {
    let Ok(entries) = fs::read_dir(pods_dir(paths)) else {
        return;
    };
    for dir in entries.filter_map(Result::ok).map(|e| e.path()) {
        let record: Option<Record> = fs::read_to_string(dir.join("state.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        if let Some(record) = record {
            for c in &record.containers {
                if let (Some(pid), Some(ticks)) = (c.pid, c.start_ticks)
                    && start_ticks(pid) == Some(ticks)
                {
                    log(&format!(
                        "{}/{}: {}: stopping pid {pid}, left by an earlier run",
                        record.namespace, record.name, c.name
                    ));
                    signal(pid, Signal::SIGKILL);
                }
            }
            if record.owned_netns && !record.netns.is_empty() {
                let netns = crate::lab::topology::Netns::parse(&record.netns);
                if crate::lab::net::netns_exists(&netns) {
                    std::thread::sleep(Duration::from_millis(200));
                    let _ = crate::lab::net::delete_netns(&netns);
                }
            }
        }
        let _ = fs::remove_dir_all(&dir);
    }
}

//! What the lab needs from the machine, checked before anything is made.

use std::fs;

use anyhow::{Context, bail, ensure};

use super::cmd;

/// Programs the lab runs (besides Go, which only the build needs).
const TOOLS: [&str; 6] = ["ip", "iptables", "sysctl", "ss", "openssl", "iperf3"];

/// Fails unless this runs as root with every tool the lab uses on PATH.
pub fn check() -> anyhow::Result<()> {
    require_root()?;
    let missing: Vec<&str> = TOOLS.into_iter().filter(|t| !cmd::on_path(t)).collect();
    ensure!(
        missing.is_empty(),
        "missing {}: run scripts/lab-deps.sh (Debian packages iproute2 iptables procps openssl iperf3)",
        missing.join(", ")
    );
    Ok(())
}

/// Network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
pub fn require_root() -> anyhow::Result<()> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1));
    if euid != Some("0") {
        bail!(
            "the lab creates network namespaces and needs root: run it as root (e.g. `sudo -E cargo xtask lab ...`)"
        );
    }
    Ok(())
}

//! The `helm` CLI against the lab's API server: the pinned Helm built into
//! the cache, run inside the control-plane namespace with the lab's admin
//! kubeconfig (the operator's credentials; the daemons it installs use
//! their own ServiceAccounts).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, bail};

use super::topology::Netns;

/// The chart, relative to the workspace root.
pub const CHART: &str = "deploy/helm/egressgw";
/// The release name the lab installs.
pub const RELEASE: &str = "egressgw";

#[derive(Debug, Clone)]
pub struct Helm {
    program: PathBuf,
    kubeconfig: PathBuf,
    netns: Netns,
}

impl Helm {
    pub fn at(program: &Path, kubeconfig: &Path, netns: &Netns) -> Self {
        Self {
            program: program.to_path_buf(),
            kubeconfig: kubeconfig.to_path_buf(),
            netns: netns.clone(),
        }
    }

    /// The chart's directory in this checkout.
    pub fn chart() -> PathBuf {
        crate::workspace_root().join(CHART)
    }

    /// `helm args...` whatever its exit status, for callers that expect a
    /// failure and read why.
    pub fn output(&self, args: &[&str]) -> anyhow::Result<Output> {
        Command::new("ip")
            .args(["netns", "exec", self.netns.as_str()])
            .arg(&self.program)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running helm {}", args.join(" ")))
    }

    /// `helm args...`; its stdout, or an error with its stderr.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.output(args)?;
        if !out.status.success() {
            bail!(
                "helm {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The deployed revision of `release` in `namespace`.
    pub fn revision(&self, release: &str, namespace: &str) -> anyhow::Result<u64> {
        let text = self.run(&["status", release, "-n", namespace, "-o", "json"])?;
        let status: serde_json::Value =
            serde_json::from_str(&text).context("parsing helm status")?;
        status["version"]
            .as_u64()
            .with_context(|| format!("helm status of {release} has no version: {text}"))
    }
}

impl Helm {
    /// The lab's Helm, the one `lab.json` names.
    pub fn for_lab(lab: &super::session::Lab) -> Self {
        Self::at(
            &lab.state.helm,
            &lab.paths.kubeconfig(),
            &lab.state.topology.control_plane.netns,
        )
    }
}

//! The lab's own kubectl (built with the control plane, so its version
//! matches), run inside the control-plane namespace where the API server's
//! address is reachable.

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use anyhow::Context;

use super::build::Binaries;
use super::net;
use super::state::Paths;
use super::topology::{Netns, Topology};

#[derive(Debug, Clone)]
pub struct Kubectl {
    program: String,
    kubeconfig: String,
    netns: Netns,
}

impl Kubectl {
    pub fn new(bins: &Binaries, paths: &Paths, topo: &Topology) -> Self {
        Self::at(
            &bins.kubectl(),
            &paths.kubeconfig(),
            &topo.control_plane.netns,
        )
    }

    pub fn at(program: &Path, kubeconfig: &Path, netns: &Netns) -> Self {
        Self {
            program: program.display().to_string(),
            kubeconfig: kubeconfig.display().to_string(),
            netns: netns.clone(),
        }
    }

    /// `kubectl args...`; its stdout.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        self.run_with_input(args, None)
    }

    /// `kubectl args...` with `input` on stdin; its stdout.
    pub fn run_with_input(&self, args: &[&str], input: Option<&str>) -> anyhow::Result<String> {
        let mut all = vec!["--kubeconfig", &self.kubeconfig];
        all.extend_from_slice(args);
        net::exec_with_input(&self.netns, &self.program, &all, input)
    }

    /// `kubectl args...` with `input` on stdin, whatever its exit status:
    /// for callers that expect it to fail and read why.
    pub fn output(&self, args: &[&str], input: Option<&str>) -> anyhow::Result<Output> {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", self.netns.as_str(), &self.program])
            .args(["--kubeconfig", &self.kubeconfig])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .with_context(|| format!("running kubectl {}", args.join(" ")))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.unwrap_or_default().as_bytes())
                .context("writing kubectl's input")?;
        }
        child
            .wait_with_output()
            .with_context(|| format!("waiting for kubectl {}", args.join(" ")))
    }

    /// Starts `kubectl args...` with its stdout piped, its stderr dropped:
    /// for commands that stream (`logs -f`), which the caller reads and
    /// ends.
    pub fn spawn(&self, args: &[&str]) -> anyhow::Result<Child> {
        Command::new("ip")
            .args(["netns", "exec", self.netns.as_str(), &self.program])
            .args(["--kubeconfig", &self.kubeconfig])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting kubectl {}", args.join(" ")))
    }

    /// Writes a script that runs this kubectl from the host: `<lab>/kubectl get pods -A`.
    pub fn write_wrapper(&self, path: &Path) -> anyhow::Result<PathBuf> {
        let script = format!(
            "#!/bin/sh\n\
             # kubectl for the egressgw lab: runs inside the control-plane namespace,\n\
             # where the API server's address is reachable.\n\
             exec ip netns exec {} {} --kubeconfig {} \"$@\"\n",
            self.netns, self.program, self.kubeconfig
        );
        fs::write(path, script).with_context(|| format!("writing {}", path.display()))?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", path.display()))?;
        Ok(path.to_path_buf())
    }
}

//! A lab that is up, as the commands that work on it see it: its paths, its
//! `lab.json` and a kubectl that reaches its API server.

use anyhow::Context;

use super::kubectl::Kubectl;
use super::state::{LabState, Paths};
use super::topology::{Netns, Node};
use super::{net, preflight};

#[derive(Debug)]
pub struct Lab {
    pub paths: Paths,
    pub state: LabState,
    pub kubectl: Kubectl,
}

impl Lab {
    /// The lab of `paths` (its prefix), which must be up; needs root.
    pub fn open(paths: &Paths) -> anyhow::Result<Self> {
        preflight::require_root()?;
        let state = LabState::require(paths)?;
        let cp = &state.topology.control_plane.netns;
        anyhow::ensure!(
            net::netns_exists(cp),
            "the lab's control-plane namespace {cp} is missing: run `cargo xtask lab down`, then `up`"
        );
        let kubectl = Kubectl::at(&state.bin_dir.join("kubectl"), &paths.kubeconfig(), cp);
        Ok(Self {
            paths: paths.clone(),
            state,
            kubectl,
        })
    }

    /// Writes `lab.json` back after a change.
    pub fn save(&self) -> anyhow::Result<()> {
        self.state.write(&self.paths)
    }

    /// The egressgw binary the lab deployed.
    pub fn egressgw_binary(&self) -> anyhow::Result<&std::path::Path> {
        Ok(&self
            .state
            .egressgw
            .as_ref()
            .context("egressgw is not deployed")?
            .binary)
    }

    pub fn node(&self, name: &str) -> anyhow::Result<&Node> {
        self.state.topology.node(name)
    }

    /// The network namespace of pod `name` (pod names are unique in a lab).
    pub fn pod_netns(&self, name: &str) -> anyhow::Result<&Netns> {
        self.state
            .topology
            .pods
            .iter()
            .find(|p| p.name == name)
            .map(|p| &p.netns)
            .with_context(|| format!("the lab has no pod named {name:?}"))
    }

    /// `lab <command>` as a person types it for this lab (with the prefix
    /// when it is not the default).
    pub fn command(&self, command: &str) -> String {
        self.paths.command(command)
    }
}

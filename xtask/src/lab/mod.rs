//! `cargo xtask lab`: a Kubernetes cluster on one machine, in network
//! namespaces. Everything is real (etcd, kube-apiserver,
//! kube-controller-manager, the kernel's networking) except kubelet and the
//! CNI, which the lab plays itself: it wires node and pod namespaces and
//! registers them as Nodes and Pods. See docs/lab.md.
//!
//! kube-scheduler and kube-controller-manager's workload controllers make
//! and place Pods as in any cluster; the lab's kubelet stand-in
//! ([`kubelet`]) runs those whose image it knows ([`images`]).
//!
//! `lab deploy` runs egressgw's controller and agents in it; `lab agent`,
//! `lab node` and `lab pod` change it while it runs (for the e2e tests);
//! `lab selftest` checks that the cluster runs Pods as a cluster does.
//!
//! Safety: every link, address, route and process the lab makes lives in a
//! namespace named `<prefix>-*` that it created (`EGRESSGW_LAB_PREFIX`,
//! default `egl`); the host namespace is never changed, and nothing in the
//! lab has a route out of it.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Subcommand;

mod build;
mod certs;
mod cluster;
pub mod cmd;
mod controlplane;
pub mod down;
pub mod egressgw;
pub mod helm;
pub mod images;
pub mod kubectl;
pub mod kubelet;
pub mod net;
mod network;
pub mod pods;
pub mod preflight;
pub mod probe;
pub mod process;
mod selftest;
pub mod session;
pub mod state;
mod status;
mod target;
mod testpod;
pub mod topology;
pub mod up;
mod whoami;

pub use state::Paths;
pub use target::{Echo, echo_cpu as target_echo_cpu};

/// `cargo xtask lab <command>`.
#[derive(Debug, Subcommand)]
pub enum LabCommand {
    /// Create the lab: control plane, nodes, pods and the external target.
    Up(up::UpArgs),
    /// Remove every namespace, process and file of the lab (also after a failed `up`).
    Down,
    /// Show what is running and whether the API is healthy; exit 1 if not.
    Status,
    /// Build the control-plane binaries and Helm into the cache (`up` does this itself).
    Build,
    /// Run egressgw in the lab: CRDs, a controller, an agent per node.
    Deploy(egressgw::DeployArgs),
    /// Kill or start one node's agent.
    #[command(subcommand)]
    Agent(egressgw::AgentCommand),
    /// Take a node off the network, or bring it back.
    #[command(subcommand)]
    Node(egressgw::NodeCommand),
    /// Add or delete a pod.
    #[command(subcommand)]
    Pod(pods::PodCommand),
    /// The images the kubelet stand-in runs (images.json).
    #[command(subcommand)]
    Image(images::ImageCommand),
    /// Check on the running lab that Kubernetes' own controllers, the
    /// scheduler and the kubelet stand-in run Pods as a cluster does.
    Selftest(selftest::SelftestArgs),
    /// The kubelet stand-in (`lab up` starts it).
    #[command(hide = true)]
    Kubelet,
    /// Runs one container of the kubelet stand-in.
    #[command(hide = true)]
    ContainerShim { spec: std::path::PathBuf },
    /// The selftest's program: an HTTP server reporting what it runs as.
    #[command(hide = true)]
    Testpod(testpod::TestpodArgs),
    /// The target's TCP service: answers each connection with the client's address.
    #[command(hide = true)]
    Whoami {
        #[arg(long)]
        listen: SocketAddr,
    },
}

/// Whether anything of the lab of `paths` (its prefix) exists: a network
/// namespace or a state file.
pub fn leftovers(paths: &Paths) -> anyhow::Result<bool> {
    Ok(!net::lab_netns(&paths.prefix)?.is_empty() || paths.any_present())
}

pub fn run(command: LabCommand) -> anyhow::Result<ExitCode> {
    match command {
        LabCommand::Whoami { listen } => {
            whoami::serve(listen)?;
            return Ok(ExitCode::SUCCESS);
        }
        LabCommand::ContainerShim { spec } => kubelet::container_shim(&spec),
        LabCommand::Testpod(args) => {
            testpod::serve(&args)?;
            return Ok(ExitCode::SUCCESS);
        }
        _ => {}
    }
    let paths = Paths::from_env()?;
    match command {
        LabCommand::Up(args) => up::up(&args, &paths)?,
        LabCommand::Down => down::down(&paths)?,
        LabCommand::Status => return status::status(&paths),
        LabCommand::Build => drop(build::ensure(&paths)?),
        LabCommand::Deploy(args) => egressgw::deploy(&args, &paths)?,
        LabCommand::Agent(command) => egressgw::agent(&command, &paths)?,
        LabCommand::Node(command) => egressgw::node(&command, &paths)?,
        LabCommand::Pod(command) => pods::pod(&command, &paths)?,
        LabCommand::Image(command) => images::image(&command, &paths)?,
        LabCommand::Selftest(args) => selftest::run(&args, &paths)?,
        LabCommand::Kubelet => kubelet::serve(&paths)?,
        LabCommand::Whoami { .. } | LabCommand::ContainerShim { .. } | LabCommand::Testpod(_) => {
            unreachable!("handled above")
        }
    }
    Ok(ExitCode::SUCCESS)
}

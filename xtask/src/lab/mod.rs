//! `cargo xtask lab`: a Kubernetes cluster on one machine, in network
//! namespaces. Everything is real (etcd, kube-apiserver,
//! kube-controller-manager, the kernel's networking) except kubelet and the
//! CNI, which the lab plays itself: it wires node and pod namespaces and
//! registers them as Nodes and Pods. See docs/lab.md.
//!
//! Safety: every link, address, route and process the lab makes lives in a
//! namespace named `egl-*` that it created; the host namespace is never
//! changed, and nothing in the lab has a route out of it.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Subcommand;

mod build;
mod certs;
mod cluster;
mod cmd;
mod controlplane;
mod down;
mod kubectl;
mod net;
mod network;
mod preflight;
mod process;
mod state;
mod status;
mod target;
mod topology;
mod up;
mod whoami;

use state::Paths;

/// `cargo xtask lab <command>`.
#[derive(Debug, Subcommand)]
pub enum LabCommand {
    /// Create the lab: control plane, nodes, pods and the external target.
    Up(up::UpArgs),
    /// Remove every namespace, process and file of the lab (also after a failed `up`).
    Down,
    /// Show what is running and whether the API is healthy; exit 1 if not.
    Status,
    /// Build the control-plane binaries into the cache (`up` does this itself).
    Build,
    /// The target's TCP service: answers each connection with the client's address.
    #[command(hide = true)]
    Whoami {
        #[arg(long)]
        listen: SocketAddr,
    },
}

pub fn run(command: LabCommand) -> anyhow::Result<ExitCode> {
    if let LabCommand::Whoami { listen } = command {
        whoami::serve(listen)?;
        return Ok(ExitCode::SUCCESS);
    }
    let paths = Paths::from_env()?;
    match command {
        LabCommand::Up(args) => up::up(&args, &paths)?,
        LabCommand::Down => down::down(&paths)?,
        LabCommand::Status => return status::status(&paths),
        LabCommand::Build => drop(build::ensure(&paths)?),
        LabCommand::Whoami { .. } => unreachable!("handled above"),
    }
    Ok(ExitCode::SUCCESS)
}

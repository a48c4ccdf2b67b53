//! `cargo xtask scale`: egressgw on the lab's real API server with a
//! cluster of the benches' size and shape.
//!
//! A lab of two nodes comes up (the first gateway-capable), egressgw is
//! installed from the chart, and the benches' synthetic cluster is created
//! as objects: by default 1 000 Nodes, 10 000 policies and 100 000 Pods
//! ([`objects`]). No kubelet runs those Nodes and Pods, and no network
//! namespace is made for them. The lab's gateway node joins the default
//! gateway's group, so its agent watches and plans every Pod; the other
//! node's agent watches its own Pods.
//!
//! Measured ([`measure`]): how fast the objects were created; when the
//! controller had written every policy's status for its generation; the
//! status writes per second the API server took meanwhile; the watch
//! events it sent per kind; the agents', controller's and API server's
//! memory; and, one Pod at a time on the worker node, the time from a Pod
//! created to its entry in the node's eBPF classification map.

mod measure;
mod objects;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};

use crate::lab::egressgw::{DeployArgs, deploy, find_binary};
use crate::lab::session::Lab;
use crate::lab::state::{LabState, Paths};
use crate::lab::up::{UpArgs, up};

/// The scale lab's name prefix unless `EGRESSGW_LAB_PREFIX` says another:
/// apart from the demo's and the e2e's.
const PREFIX: &str = "egs";

/// `cargo xtask scale`.
#[derive(Debug, clap::Args)]
pub struct ScaleArgs {
    /// Synthetic Nodes.
    #[arg(long, default_value_t = 1_000)]
    pub nodes: usize,
    /// Synthetic policies (one in two hundred cluster-wide).
    #[arg(long, default_value_t = 10_000)]
    pub policies: usize,
    /// Synthetic Pods.
    #[arg(long, default_value_t = 100_000)]
    pub pods: usize,
    /// Pods created one at a time on the worker node, each timed until its
    /// entry is in the node's kernel.
    #[arg(long, default_value_t = 100)]
    pub probes: usize,
    /// Requests in flight while loading.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// The egressgw binary to deploy [default: target/release/egressgw; the
    /// planner's speed is the release build's].
    #[arg(long, value_name = "PATH")]
    pub egressgw: Option<PathBuf>,
    /// Leave the lab up afterwards (it is taken down otherwise, also on failure).
    #[arg(long)]
    pub keep: bool,
}

pub fn run(args: &ScaleArgs) -> anyhow::Result<ExitCode> {
    if args.probes > measure::MAX_PROBES {
        bail!("--probes: at most {}", measure::MAX_PROBES);
    }
    let binary = match &args.egressgw {
        Some(path) => find_binary(Some(path))?,
        None => {
            let release = crate::workspace_root().join("target/release/egressgw");
            find_binary(Some(&release)).context(
                "the scale test deploys the release build: `cargo build --release -p egressgw`",
            )?
        }
    };
    let paths = Paths::from_env_or(PREFIX)?;
    if LabState::read(&paths)?.is_some() {
        bail!(
            "a lab {} is up: the scale test loads a fresh one; take it down with `{}`",
            paths.prefix,
            paths.command("lab down")
        );
    }
    let result = up(
        &UpArgs {
            nodes: 2,
            gateways: 1,
            ipv6: false,
            keep_on_failure: false,
        },
        &paths,
    )
    .and_then(|()| {
        deploy(
            &DeployArgs {
                egressgw: Some(binary),
                ..DeployArgs::default()
            },
            &paths,
        )
    })
    .and_then(|()| Lab::open(&paths))
    .and_then(|lab| measure::run(&lab, args));
    if args.keep {
        println!(
            "the lab {} stays up: `{}`",
            paths.prefix,
            paths.command("lab down")
        );
    } else {
        println!("taking the lab {} down", paths.prefix);
        crate::lab::down::down(&paths).context("taking the scale lab down")?;
    }
    let report = result?;
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

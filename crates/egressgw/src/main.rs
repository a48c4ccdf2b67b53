//! `egressgw`: the egress gateway's command line.

mod config;
mod render;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use egressgw_core::Plan;
use egressgw_core::state::NodeState;

use crate::config::FileConfig;

/// Egress gateway for Kubernetes: fixed source IPs for pod traffic leaving the cluster.
#[derive(Debug, Parser)]
#[command(name = "egressgw", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show what each node's dataplane would be for a set of Kubernetes objects.
    ///
    /// Reads Nodes, Namespaces, Pods, EgressGateways, EgressPolicies,
    /// EgressClusterPolicies and EgressTunnels from YAML (several documents,
    /// or a `kubectl get -o yaml` list) and prints, per node, the tunnel
    /// device, peers, policy routes, classification and SNAT entries and
    /// owned EIPs, then the status every object would get. No cluster needed.
    Plan(PlanArgs),
}

#[derive(Debug, clap::Args)]
struct PlanArgs {
    /// YAML file with the objects; `-` reads standard input.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    file: PathBuf,
    /// Show only this node's dataplane.
    #[arg(long, value_name = "NODE")]
    node: Option<String>,
    /// Config file (the Helm chart's `feature` keys); defaults otherwise.
    #[arg(long, value_name = "FILE", env = "EGRESSGW_CONFIG")]
    config: Option<PathBuf>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    /// Readable text.
    Text,
    /// JSON: `{nodes: {...}, status: {...}, invalid: [...]}`.
    Json,
    /// The same as YAML.
    Yaml,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => plan(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn plan(args: &PlanArgs) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    }
    .resolve()?;
    let text = read_input(&args.file)?;
    let objects = egressgw_api::objects_from_yaml(&text)
        .with_context(|| format!("reading {}", args.file.display()))?;
    for skipped in &objects.skipped {
        eprintln!("note: {skipped}");
    }
    let snapshot = objects.into_snapshot(config);
    for invalid in &snapshot.invalid {
        let name = invalid.namespace.as_ref().map_or_else(
            || invalid.name.clone(),
            |ns| format!("{ns}/{}", invalid.name),
        );
        eprintln!(
            "warning: {} {name} is invalid and is ignored: {}",
            invalid.kind,
            invalid.errors.join("; ")
        );
    }
    for gateway in snapshot.gateways.iter().filter(|g| !g.errors.is_empty()) {
        eprintln!(
            "warning: EgressGateway {} is invalid and carries no traffic: {}",
            gateway.name,
            gateway.errors.join("; ")
        );
    }
    let plan = match &args.node {
        Some(node) => {
            if !snapshot.nodes.iter().any(|n| &n.name == node) {
                let known: Vec<&str> = snapshot.nodes.iter().map(|n| n.name.as_str()).collect();
                bail!(
                    "--node {node}: no such Node in {} (nodes: {})",
                    args.file.display(),
                    known.join(", ")
                );
            }
            egressgw_core::plan_node(&snapshot, node)
        }
        None => egressgw_core::plan(&snapshot),
    };
    let out = match args.output {
        Output::Text => {
            let nodes: Vec<&NodeState> = plan.nodes.values().collect();
            render::text(&plan, &nodes, &snapshot.invalid)
        }
        Output::Json => serde_json::to_string_pretty(&document(&plan, &snapshot.invalid))? + "\n",
        Output::Yaml => serde_yaml::to_string(&document(&plan, &snapshot.invalid))?,
    };
    std::io::stdout()
        .write_all(out.as_bytes())
        .context("writing the plan")
}

fn document(plan: &Plan, invalid: &[egressgw_core::model::InvalidObject]) -> serde_json::Value {
    let invalid: Vec<serde_json::Value> = invalid
        .iter()
        .map(|o| serde_json::json!({"kind": o.kind, "namespace": o.namespace, "name": o.name, "errors": o.errors}))
        .collect();
    serde_json::json!({"nodes": plan.nodes, "status": plan.status, "invalid": invalid})
}

fn read_input(path: &Path) -> anyhow::Result<String> {
    if path == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading standard input")?;
        Ok(text)
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    }
}

//! `egressgw`: the egress gateway's command line.

mod agent;
mod bench;
mod cluster;
mod controller;
mod dataplane;
mod doctor;
mod failover;
mod render;
mod slices;
mod writes;

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use egressgw_core::Plan;
use egressgw_core::state::NodeState;

use egressgw_api::config::FileConfig;

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
    ///
    /// egressgw's objects are checked as the API server checks them: a field
    /// their kind does not have is an error, like a failed validation. The
    /// plan is printed either way, without the invalid objects, and the exit
    /// status is non-zero when there are any (see --skip-invalid).
    Plan(PlanArgs),
    /// Make this host's kernel match one node's plan, without a cluster.
    ///
    /// Plans NODE from the objects in FILE (like `plan`) and reconciles the
    /// current network namespace to it: `egress.vxlan`, its neighbour and
    /// FDB entries, policy rules and routes, the `inet egressgw` nftables
    /// table and, on gateway nodes, the EIPs on `egress.eip`. Reads the
    /// kernel first and changes only what differs; running it twice changes
    /// nothing the second time. Changes nothing when an object is invalid
    /// (see --skip-invalid).
    Apply(ApplyArgs),
    /// Remove everything egressgw created on this host, and nothing else.
    ///
    /// Deletes the `inet egressgw` nftables table, egressgw's policy rules
    /// (its priority and mark mask) and routes (its tables), and the
    /// `egress.vxlan` and `egress.eip` devices.
    Cleanup(CleanupArgs),
    /// Run the node agent: reconcile this node's kernel with the cluster.
    ///
    /// Watches Nodes, Namespaces, Pods and egressgw's objects, plans this
    /// node with the controller's allocations and keeps the kernel in line
    /// (debounced, level-based, and every 30 s). Renews the Lease
    /// `egressgw-agent-NODE` every second as its liveness and reports its
    /// tunnel in `EgressTunnel` NODE. Stopping it leaves the kernel as is.
    Agent(agent::AgentArgs),
    /// Run the controller: allocations, gateway choice and status.
    ///
    /// One replica is active at a time (Lease `egressgw-controller`). It
    /// allocates EIPs and tunnel identities, picks each EIP's gateway node,
    /// moves EIPs away from nodes whose agent stopped renewing its Lease,
    /// writes every object's status with server-side apply, and records
    /// Events on EIP moves and invalid policies.
    Controller(controller::ControllerArgs),
    /// Measure throughput and latency: node -> node, egress VXLAN -> egress
    /// VXLAN, pod -> egress node -> target, with iperf3 in the cluster.
    ///
    /// Creates a namespace with an EgressPolicy for the gateway, an iperf3
    /// server Pod on the gateway node and, per run, a client Pod on the
    /// source node (the agents' image, which carries iperf3); runs the
    /// cases interleaved, reads each result from its Pod's log, prints the
    /// table and removes everything it created (also on failure and
    /// Ctrl-C). Case 3 counts only when the target saw the EIP. See
    /// docs/bench.md.
    Bench(bench::BenchArgs),
    /// What a bench Pod runs (used by `egressgw bench`).
    #[command(hide = true)]
    BenchClient(bench::client::ClientArgs),
    /// A TCP echo server for the bench's round trips (at the target, and
    /// what `egressgw bench` runs on the gateway node).
    #[command(hide = true)]
    BenchEcho(bench::echo::EchoArgs),
    /// Check this node's part of egress and say what to do about what is wrong.
    ///
    /// Reads the kernel (the tunnel and its MTU, offloads on the tunnel and
    /// its parent, reverse-path filtering, forwarding, other components'
    /// policy rules on egressgw's mark bits, Don't-Fragment probes of the
    /// path to each peer) and the agent's /status on this node (readiness,
    /// the last reconcile, the datapath, which peers answer through the
    /// tunnel). With --pod and --dst, also which policy, EIP and gateway
    /// node decide that Pod's traffic and whether the kernel agrees; with
    /// --throughput, how fast this node sends to its peers over the
    /// underlay and through the tunnel.
    /// Changes nothing. Run it on the node or with
    /// `kubectl exec` in the agent's container; the exit status is non-zero
    /// when a check fails.
    Doctor(doctor::DoctorArgs),
}

#[derive(Debug, clap::Args)]
struct ApplyArgs {
    #[command(flatten)]
    kernel: dataplane::KernelArgs,
    /// YAML file with the objects; `-` reads standard input.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    file: PathBuf,
    /// The node this host is.
    #[arg(long, value_name = "NODE", env = "NODE_NAME")]
    node: String,
    /// Config file (the Helm chart's `feature` keys); defaults otherwise.
    #[arg(long, value_name = "FILE", env = "EGRESSGW_CONFIG")]
    config: Option<PathBuf>,
    /// Output format of the report.
    #[arg(short, long, value_enum, default_value_t = ReportOutput::Text)]
    output: ReportOutput,
    /// Keep reconciling, every this many seconds, until stopped.
    #[arg(long, value_name = "SECONDS")]
    every: Option<u64>,
    #[command(flatten)]
    invalid: InvalidArgs,
}

/// What `plan` and `apply` do with invalid objects.
#[derive(Debug, clap::Args)]
struct InvalidArgs {
    /// Go on without invalid objects instead of failing: each is reported as
    /// a warning, an invalid policy or tunnel is left out and an invalid
    /// gateway carries no traffic. An object is invalid when it has a field
    /// its kind does not have (a misspelled `destSubnets`) or fails its
    /// kind's validation.
    #[arg(long)]
    skip_invalid: bool,
}

#[derive(Debug, clap::Args)]
struct CleanupArgs {
    #[command(flatten)]
    kernel: dataplane::KernelArgs,
    /// Config file: device names, rule priority, mark mask and tables to remove.
    #[arg(long, value_name = "FILE", env = "EGRESSGW_CONFIG")]
    config: Option<PathBuf>,
    /// Output format of the report.
    #[arg(short, long, value_enum, default_value_t = ReportOutput::Text)]
    output: ReportOutput,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ReportOutput {
    /// One line per operation, then a summary.
    Text,
    /// One JSON object per reconcile: `{applied, failed, warnings, facts}`.
    Json,
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
    #[command(flatten)]
    invalid: InvalidArgs,
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

/// jemalloc rather than glibc's allocator. A daemon keeps its watched
/// objects and plans for as long as it runs, while every watch event and
/// plan allocates and frees around them; glibc keeps the pages those kept
/// objects share, however little of each is in use, and gives back only
/// whole free pages, when asked. jemalloc keeps objects of one size
/// together, and its background thread gives the system back what has
/// been free for a few seconds, without being asked. At 1 000 nodes a
/// gateway node's agent held 129 MiB with glibc and 97 MiB with jemalloc
/// minutes after the same load (docs/scale.md). The `jemalloc` feature,
/// on by default, chooses it.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => plan(&args),
        Command::Apply(args) => dataplane::apply(&args),
        Command::Cleanup(args) => dataplane::cleanup(&args),
        Command::Agent(args) => agent::run(&args),
        Command::Controller(args) => controller::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::BenchClient(args) => bench::client::run(&args),
        Command::BenchEcho(args) => bench::echo::serve(&args),
        Command::Doctor(args) => doctor::run(&args),
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
    let (snapshot, invalid) = load(&args.file, args.config.as_deref(), &args.invalid)?;
    let plan = match &args.node {
        Some(node) => {
            known_node(&snapshot, node, &args.file)?;
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
        .context("writing the plan")?;
    refuse_invalid(invalid, &args.file, &args.invalid)
}

/// Reads the config and the objects, and reports on stderr what is left
/// out: invalid objects as errors, or as warnings with `--skip-invalid`.
/// Returns the snapshot and how many objects are invalid.
fn load(
    file: &Path,
    config: Option<&Path>,
    invalid_args: &InvalidArgs,
) -> anyhow::Result<(egressgw_core::Snapshot, usize)> {
    let config = load_config(config)?;
    let text = read_input(file)?;
    let objects = egressgw_api::objects_from_yaml(&text)
        .with_context(|| format!("reading {}", file.display()))?;
    for skipped in &objects.skipped {
        eprintln!("note: {skipped}");
    }
    let snapshot = objects.into_snapshot(config);
    let (level, ignored, no_traffic) = if invalid_args.skip_invalid {
        ("warning", " and is ignored", " and carries no traffic")
    } else {
        ("error", "", "")
    };
    for invalid in &snapshot.invalid {
        let name = invalid.namespace.as_ref().map_or_else(
            || invalid.name.clone(),
            |ns| format!("{ns}/{}", invalid.name),
        );
        eprintln!(
            "{level}: {} {name} is invalid{ignored}: {}",
            invalid.kind,
            invalid.errors.join("; ")
        );
    }
    let invalid_gateways = snapshot.gateways.iter().filter(|g| !g.errors.is_empty());
    for gateway in invalid_gateways.clone() {
        eprintln!(
            "{level}: EgressGateway {} is invalid{no_traffic}: {}",
            gateway.name,
            gateway.errors.join("; ")
        );
    }
    let count = snapshot.invalid.len() + invalid_gateways.count();
    Ok((snapshot, count))
}

/// Fails when `count` objects were found invalid, unless `--skip-invalid`.
fn refuse_invalid(count: usize, file: &Path, invalid: &InvalidArgs) -> anyhow::Result<()> {
    if count > 0 && !invalid.skip_invalid {
        bail!(
            "{count} invalid object(s) in {}: fix them, or pass --skip-invalid to go on without them",
            file.display()
        );
    }
    Ok(())
}

/// Logs of the daemons: to stderr as text or one JSON object per line,
/// `RUST_LOG` filters (default `info`), always without kube's per-request
/// connection errors, which the daemons report themselves once per outage.
fn init_daemon_logs(format: cluster::LogFormat) {
    let directives = std::env::var("RUST_LOG")
        .ok()
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(|| "info".to_owned());
    let filter = tracing_subscriber::EnvFilter::try_new(&directives)
        .unwrap_or_else(|e| {
            eprintln!(
                "warning: RUST_LOG={directives:?} is not a valid filter ({e}); logging at info"
            );
            tracing_subscriber::EnvFilter::new("info")
        })
        .add_directive(
            "kube_client::client::builder=off"
                .parse()
                .expect("a valid directive"),
        );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        cluster::LogFormat::Json => builder.json().try_init(),
        cluster::LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
}

fn load_config(path: Option<&Path>) -> anyhow::Result<egressgw_core::model::Config> {
    let file = match path {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading config {}", path.display()))?;
            FileConfig::parse(&text)
                .with_context(|| format!("parsing config {}", path.display()))?
        }
        None => FileConfig::default(),
    };
    Ok(file.resolve()?)
}

/// Checks that `node` is one of the snapshot's nodes.
fn known_node(snapshot: &egressgw_core::Snapshot, node: &str, file: &Path) -> anyhow::Result<()> {
    if !snapshot.nodes.iter().any(|n| n.name == node) {
        let known: Vec<&str> = snapshot.nodes.iter().map(|n| n.name.as_str()).collect();
        bail!(
            "--node {node}: no such Node in {} (nodes: {})",
            file.display(),
            known.join(", ")
        );
    }
    Ok(())
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

//! egressgw's development tasks: `cargo xtask <task>`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod chart;
mod dashboard;
mod e2e;
mod gen_crds;
mod lab;
mod previous;
mod scale;

/// egressgw's development tasks.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Write the CRD manifests (deploy/crds/ and the Helm chart's crds/) from the Rust types in egressgw-api.
    GenCrds {
        /// Write nothing; exit non-zero if the files are out of date.
        #[arg(long)]
        check: bool,
    },
    /// The Helm chart: its values reference.
    #[command(subcommand)]
    Chart(chart::ChartCommand),
    /// The chart's Grafana dashboard drawn from the lab's metrics: record
    /// them, render the panels as SVG (see docs/operations.md).
    #[command(subcommand)]
    Dashboard(dashboard::DashboardCommand),
    /// A Kubernetes cluster on this machine, in network namespaces (see docs/lab.md).
    #[command(subcommand)]
    Lab(lab::LabCommand),
    /// End-to-end tests: a fresh lab, egressgw deployed, every scenario with
    /// real traffic (see docs/e2e.md).
    E2e(e2e::E2eArgs),
    /// `egressgw bench` on the lab: up if needed, egressgw installed from the
    /// chart, the three iperf3 cases measured (see docs/bench.md).
    Bench(bench::BenchArgs),
    /// egressgw on the lab's API server with 1 000 Nodes, 10 000 policies
    /// and 100 000 Pods (objects only): load, convergence, status writes,
    /// watch events, memory, and a Pod's time into its node's kernel (see
    /// docs/scale.md).
    Scale(scale::ScaleArgs),
    /// The release upgrades are tested from (`deploy/previous-release`):
    /// its egressgw binary and chart, built once into the cache.
    Previous(previous::PreviousArgs),
}

/// Runs the task. An error prints as its message chain, one line: a
/// `main` returning `anyhow::Result` would print its `Debug` form, which adds
/// a backtrace whenever `RUST_BACKTRACE` is set (`scripts/test.sh` sets it
/// for the panics, which keep theirs).
fn main() -> ExitCode {
    let result = match Cli::parse().task {
        Task::Lab(command) => lab::run(command),
        Task::E2e(args) => e2e::run(&args),
        Task::Bench(args) => bench::run(&args),
        Task::Scale(args) => scale::run(&args),
        Task::Previous(args) => previous::run(&args).map(|()| ExitCode::SUCCESS),
        Task::GenCrds { check } => gen_crds::run(check),
        Task::Chart(command) => chart::run(&command),
        Task::Dashboard(command) => dashboard::run(&command),
    };
    result.unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        ExitCode::FAILURE
    })
}

/// The workspace root: the parent of this crate's directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

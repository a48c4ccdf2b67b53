//! What the agent and the controller share on the Kubernetes side: the
//! client, the watched objects, Leases and the health endpoint.

pub mod decoded;
pub mod following;
pub mod health;
pub mod lease;
pub mod metrics;
pub mod owner;
pub mod pods;
pub mod stored;
pub mod watch;

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// Options both daemons take.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Kubeconfig file; without it, the in-cluster service account (or
    /// `~/.kube/config`).
    #[arg(long, value_name = "FILE", env = "KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Config file (the Helm chart's `feature` keys); defaults otherwise.
    #[arg(long, value_name = "FILE", env = "EGRESSGW_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// Namespace of egressgw's Leases.
    #[arg(
        long,
        value_name = "NAMESPACE",
        env = "POD_NAMESPACE",
        default_value = "egressgw-system"
    )]
    pub namespace: String,
    /// Log format.
    #[arg(
        long,
        value_enum,
        value_name = "FORMAT",
        env = "EGRESSGW_LOG_FORMAT",
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
}

/// How the daemons write their logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// A client for the cluster: from `kubeconfig` when given, else inferred
/// (in-cluster config, then the default kubeconfig).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no --kubeconfig, and neither an in-cluster config nor ~/.kube/config")?,
    };
    // Fail fast on an unreachable API server (watches keep the default
    // read timeout: they are long polls).
    config.connect_timeout = Some(Duration::from_secs(2));
    config.write_timeout = Some(Duration::from_secs(5));
    Client::try_from(config).context("building the Kubernetes client")
}

/// Resolves when the process gets SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process still dies by the default action.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

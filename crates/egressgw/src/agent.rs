//! `egressgw agent`: keeps one node's kernel in line with the cluster.
//!
//! Watches feed reflector stores and wake the loop; the loop, debounced,
//! plans this node from the whole store (level-based, never from the event)
//! and reconciles the kernel with `egressgw-dataplane`. Its liveness is a
//! Lease renewed every second; its readiness (the `/readyz` endpoint and
//! the `Ready` phase of its `EgressTunnel`) follows its first successful
//! reconcile. Stopping the agent leaves the kernel as it is, so traffic
//! keeps flowing and a restarted agent finds nothing to change — unless
//! its DaemonSet is gone (an uninstall, see [`crate::cluster::owner`]):
//! then it removes everything it created before it exits.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use egressgw_api::EgressTunnel;
use egressgw_api::tunnel::{EgressTunnelStatus, TunnelEndpoint, TunnelParent, TunnelPhase};
use egressgw_core::model::Config;
use egressgw_core::state::NodeState;
use egressgw_dataplane::Report;
use egressgw_dataplane::netlink::Rtnetlink;
use egressgw_dataplane::nft::Nft;
use egressgw_dataplane::reconcile::Dataplane;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client};
use tokio::sync::Notify;

use crate::cluster::health::{self, Health};
use crate::cluster::owner::Owner;
use crate::cluster::watch::Stores;
use crate::cluster::{self, ClusterArgs, lease};
use crate::load_config;

/// Field manager of everything the agent writes.
const MANAGER: &str = "egressgw-agent";
/// Wait after a change before reconciling, so a burst of events is one run.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// Reconcile at least this often, to repair drift nobody announced.
const RESYNC: Duration = Duration::from_secs(30);
/// How often the Lease is renewed.
const RENEW_EVERY: Duration = Duration::from_secs(1);
/// How often the tunnel's `lastHeartbeatTime` is refreshed.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// The node this agent runs on.
    #[arg(long, value_name = "NODE", env = "NODE_NAME")]
    pub node: String,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub kernel: crate::dataplane::KernelArgs,
    /// Address of the health endpoint (`/healthz`, `/readyz`, `/status`).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9812")]
    pub health_addr: SocketAddr,
    /// Duration written into the agent's Lease.
    #[arg(long, value_name = "SECONDS", default_value_t = 3)]
    pub lease_duration: u64,
    /// The DaemonSet this agent belongs to, in `--namespace`. When it is
    /// deleted (an uninstall), the agent removes the datapath as it stops;
    /// otherwise (a restart, an upgrade), stopping leaves it in place.
    /// Without this flag stopping never removes anything.
    #[arg(long, value_name = "NAME", env = "EGRESSGW_DAEMONSET")]
    pub daemonset: Option<String>,
    /// Stopping for a restart (not an uninstall, node not cordoned), the
    /// agent renews its Lease one last time for this long, so that its
    /// node keeps its EIPs while the replacement starts; 0 lets them move
    /// after the controller's agent timeout as for a failure.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub restart_grace: u64,
}

/// What the stop path needs from the running agent, once it has it.
#[derive(Default)]
struct Running {
    owner: std::sync::OnceLock<Arc<Owner>>,
    client: std::sync::OnceLock<Client>,
    /// Whether the agent is stopping. The renewal task holds it while it
    /// renews and stops once it is set, so the last renewal at stop cannot
    /// be overwritten by one still on its way.
    stopping: Arc<tokio::sync::Mutex<bool>>,
}

pub fn run(args: &AgentArgs) -> anyhow::Result<()> {
    crate::init_daemon_logs(args.cluster.log_format);
    let config = load_config(args.cluster.config.as_deref())?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(async {
            let running = Running::default();
            tokio::select! {
                result = agent(args, config.clone(), &running) => result,
                () = cluster::shutdown_signal() => stop(args, &running, config).await,
            }
        })
}

/// On SIGTERM or SIGINT: keeps the kernel as it is (and, for a restart,
/// asks the controller to wait for the replacement), or, when the agent's
/// DaemonSet is gone, removes everything egressgw created.
async fn stop(args: &AgentArgs, running: &Running, config: Config) -> anyhow::Result<()> {
    let mut stopping = running.stopping.lock().await;
    *stopping = true;
    let reason = match running.owner.get() {
        Some(owner) => owner.uninstall_reason().await,
        None => None,
    };
    let Some(reason) = reason else {
        if let Some(client) = running.client.get() {
            restart_grace(args, client).await;
        }
        tracing::info!("stopping; the kernel state stays as it is");
        return Ok(());
    };
    tracing::info!(reason, "stopping for an uninstall: removing the datapath");
    let mut dataplane = Dataplane::new(args.kernel.netlink()?, Nft::new(), config);
    let report = dataplane.cleanup().await;
    log_ops(&report);
    anyhow::ensure!(
        report.is_ok(),
        "{} removal(s) failed; `egressgw cleanup` on the node finishes the job",
        report.failed.len()
    );
    tracing::info!(removed = report.applied.len(), "datapath removed");
    Ok(())
}

/// Renews the agent's Lease for `--restart-grace` seconds, unless the node
/// is cordoned (drained for maintenance or a shutdown: its EIPs should move
/// now) or the grace is 0. Failures are logged: the EIPs then move after
/// the usual timeout.
async fn restart_grace(args: &AgentArgs, client: &Client) {
    if args.restart_grace == 0 {
        return;
    }
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let cordoned = tokio::time::timeout(Duration::from_secs(1), nodes.get_opt(&args.node))
        .await
        .ok()
        .and_then(Result::ok)
        .flatten()
        .is_some_and(|n| n.spec.and_then(|s| s.unschedulable).unwrap_or(false));
    if cordoned {
        tracing::info!("the node is cordoned: its EIPs move after the agent timeout");
        return;
    }
    let api: Api<Lease> = Api::namespaced(client.clone(), &args.cluster.namespace);
    let name = lease::agent_lease_name(&args.node);
    let grace = Duration::from_secs(args.restart_grace);
    match tokio::time::timeout(
        Duration::from_secs(2),
        lease::renew(&api, &name, &args.node, grace),
    )
    .await
    {
        Ok(Ok(())) => tracing::info!(
            seconds = args.restart_grace,
            "Lease renewed for a restart: the node keeps its EIPs while the next agent starts"
        ),
        Ok(Err(e)) => tracing::warn!(
            error = format!("{e:#}"),
            "could not renew the Lease for a restart"
        ),
        Err(_) => tracing::warn!("renewing the Lease for a restart timed out"),
    }
}

async fn agent(args: &AgentArgs, config: Config, running: &Running) -> anyhow::Result<()> {
    let node = args.node.as_str();
    tracing::info!(node, "egressgw agent starting");
    let client = cluster::client(args.cluster.kubeconfig.as_deref()).await?;
    let _ = running.client.set(client.clone());
    if let Some(name) = &args.daemonset {
        let api = Api::namespaced(client.clone(), &args.cluster.namespace);
        let _ = running.owner.set(Owner::watch(api, name));
    }
    let health = Arc::new(Health::default());
    health::serve(args.health_addr, Arc::clone(&health)).await?;

    let changed = Arc::new(Notify::new());
    let fence = Arc::new(Fence::default());
    let leases: Api<Lease> = Api::namespaced(client.clone(), &args.cluster.namespace);
    tokio::spawn(renew_lease(
        leases,
        node.to_owned(),
        Duration::from_secs(args.lease_duration.max(1)),
        Arc::clone(&fence),
        Arc::clone(&changed),
        Arc::clone(&running.stopping),
    ));

    let (stores, _watches) = Stores::start(&client, &changed);
    tracing::info!("waiting for the first list of every watched kind");
    stores.ready().await?;
    tracing::info!("watches synced");

    let dataplane = Dataplane::new(args.kernel.netlink()?, Nft::new(), config.clone());
    let mut agent = Agent {
        node: node.to_owned(),
        config,
        client,
        stores,
        dataplane,
        health,
        fence,
        reported: None,
        reconciles: 0,
    };
    let mut retry = Backoff::default();
    loop {
        let wait = if agent.reconcile().await {
            retry.reset();
            RESYNC
        } else {
            retry.next()
        };
        tokio::select! {
            () = changed.notified() => tokio::time::sleep(DEBOUNCE).await,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Whether the agent must give up its EIPs: it could not renew its Lease
/// for the Lease's duration, so the controller has moved them elsewhere by
/// now, and keeping them would answer for an address another node owns.
///
/// Fenced is left only once the agent has reported again *and* its own
/// watch shows that report, i.e. once its view of the cluster is no older
/// than its return (a stale view would still show the EIPs here).
#[derive(Debug, Default)]
struct Fence {
    state: std::sync::Mutex<FenceState>,
}

#[derive(Debug, Default, Clone, Copy)]
struct FenceState {
    fenced: bool,
    /// When the Lease was renewed again after a fence.
    renewed: Option<Timestamp>,
}

impl Fence {
    fn get(&self) -> FenceState {
        *self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn update(&self, f: impl FnOnce(&mut FenceState)) {
        f(&mut self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
    }
}

/// Renews the agent's Lease forever. Failures are logged; once renewals
/// have failed for the Lease's duration the agent fences itself.
async fn renew_lease(
    api: Api<Lease>,
    node: String,
    duration: Duration,
    fence: Arc<Fence>,
    changed: Arc<Notify>,
    stopping: Arc<tokio::sync::Mutex<bool>>,
) {
    let name = lease::agent_lease_name(&node);
    let mut last_renewed = Instant::now();
    let mut failing = false;
    let mut tick = tokio::time::interval(RENEW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let guard = stopping.lock().await;
        if *guard {
            return;
        }
        let result = tokio::time::timeout(RENEW_EVERY, lease::renew(&api, &name, &node, duration))
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("renewing Lease {name}: timed out")));
        drop(guard);
        match result {
            Ok(()) => {
                last_renewed = Instant::now();
                if failing {
                    tracing::info!(lease = name, "Lease renewed again");
                    failing = false;
                }
                if fence.get().fenced && fence.get().renewed.is_none() {
                    fence.update(|f| f.renewed = Some(Timestamp::now()));
                    changed.notify_one();
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "cannot renew the Lease; retrying every second"
                    );
                    failing = true;
                }
                if last_renewed.elapsed() > duration && !fence.get().fenced {
                    tracing::warn!(
                        "the Lease has not been renewed for {} s: giving up this node's EIPs until the API is reachable again",
                        duration.as_secs()
                    );
                    fence.update(|f| {
                        *f = FenceState {
                            fenced: true,
                            renewed: None,
                        }
                    });
                    changed.notify_one();
                }
            }
        }
    }
}

struct Agent {
    node: String,
    config: Config,
    client: Client,
    stores: Stores,
    dataplane: Dataplane<Rtnetlink, Nft>,
    health: Arc<Health>,
    fence: Arc<Fence>,
    /// The tunnel status last written, and when.
    reported: Option<(EgressTunnelStatus, Instant)>,
    reconciles: u64,
}

impl Agent {
    /// One level-based run. Returns false when it should be retried soon.
    async fn reconcile(&mut self) -> bool {
        self.maybe_unfence();
        let fenced = self.fence.get().fenced;
        let mut snapshot = self.stores.snapshot(self.config.clone());
        if fenced {
            // Not ready in its own eyes: the planner places its EIPs on
            // other nodes, as the controller has.
            for n in snapshot.nodes.iter_mut().filter(|n| n.name == self.node) {
                n.ready = false;
            }
        }
        let Some(own) = snapshot.nodes.iter().find(|n| n.name == self.node) else {
            tracing::warn!(node = self.node, "no Node of this name in the API; waiting");
            return false;
        };
        let underlay = own.addresses.first().copied();
        if !snapshot
            .tunnels
            .iter()
            .any(|t| t.node == self.node && t.mac.is_some())
        {
            tracing::info!(
                node = self.node,
                "waiting for the controller to allocate this node's tunnel (EgressTunnel {})",
                self.node
            );
            return false;
        }
        let plan = egressgw_core::plan_node(&snapshot, &self.node);
        let Some(state) = plan.nodes.get(&self.node) else {
            tracing::warn!(node = self.node, "the planner has no state for this node");
            return false;
        };
        let started = Instant::now();
        let report = self.dataplane.reconcile(state).await;
        self.reconciles += 1;
        log_report(&report, state, started.elapsed());
        let ok = report.is_ok();
        if ok {
            self.health.set_ready(true);
        }
        self.health.set_status(serde_json::json!({
            "node": self.node,
            "reconciles": self.reconciles,
            "last": report,
            "eips": state.eips,
        }));
        if let Err(e) = self.report_tunnel(ok, underlay).await {
            tracing::warn!(
                error = format!("{e:#}"),
                "cannot update EgressTunnel status"
            );
            return false;
        }
        ok
    }

    /// Leaves the fence once the Lease is renewed and the watched tunnel
    /// shows a report written after that.
    fn maybe_unfence(&self) {
        let FenceState {
            fenced: true,
            renewed: Some(renewed),
        } = self.fence.get()
        else {
            return;
        };
        let seen = self
            .stores
            .tunnels
            .get(&ObjectRef::new(&self.node))
            .and_then(|t| {
                t.status
                    .as_ref()
                    .and_then(|s| s.last_heartbeat_time.clone())
            });
        // `lastHeartbeatTime` has whole seconds; the fence lasted longer.
        if seen.is_some_and(|t| t.0.as_second() >= renewed.as_second()) {
            tracing::info!("the cluster view is current again: this node may own EIPs");
            self.fence.update(|f| *f = FenceState::default());
        }
    }

    /// Writes the agent's part of its `EgressTunnel` status when it changed
    /// (or the heartbeat is due): parent, phase, heartbeat.
    async fn report_tunnel(&mut self, ok: bool, underlay: Option<IpAddr>) -> anyhow::Result<()> {
        // The interface the reconcile just found: no lookup of its own.
        let parent = underlay.map(|ip| TunnelParent {
            name: self.dataplane.parent().map(|p| p.name.clone()),
            ipv4: ip.is_ipv4().then(|| ip.to_string()),
            ipv6: ip.is_ipv6().then(|| ip.to_string()),
        });
        let phase = if ok {
            TunnelPhase::Ready
        } else {
            TunnelPhase::Failed
        };
        let current = self.stores.tunnels.get(&ObjectRef::new(&self.node));
        let api_phase = current.as_ref().and_then(|t| t.phase());
        let status = EgressTunnelStatus {
            tunnel: Some(TunnelEndpoint {
                parent,
                ..TunnelEndpoint::default()
            }),
            phase: Some(phase),
            mark: None,
            last_heartbeat_time: None,
        };
        let fence = self.fence.get();
        if fence.fenced && fence.renewed.is_none() {
            // Reporting Ready without a live Lease would only have the
            // controller mark it timed out again.
            return Ok(());
        }
        let returning = fence.fenced;
        let unchanged = !returning
            && self
                .reported
                .as_ref()
                .is_some_and(|(last, at)| *last == status && at.elapsed() < HEARTBEAT_EVERY)
            && api_phase == Some(phase);
        if unchanged {
            return Ok(());
        }
        let mut patch = status.clone();
        patch.last_heartbeat_time = Some(Time(Timestamp::now()));
        let body = serde_json::json!({
            "apiVersion": format!("{}/{}", egressgw_api::GROUP, egressgw_api::VERSION),
            "kind": "EgressTunnel",
            "metadata": { "name": self.node },
            "status": patch,
        });
        let api: Api<EgressTunnel> = Api::all(self.client.clone());
        api.patch_status(
            &self.node,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .with_context(|| format!("applying EgressTunnel {} status", self.node))?;
        if api_phase != Some(phase) {
            tracing::info!(node = self.node, ?phase, "tunnel phase reported");
        }
        self.reported = Some((status, Instant::now()));
        Ok(())
    }
}

/// One line per operation of `report`, applied or failed.
fn log_ops(report: &Report) {
    for op in &report.applied {
        tracing::info!(op, "applied");
    }
    for failure in &report.failed {
        tracing::error!(op = failure.op, error = failure.error, "operation failed");
    }
}

fn log_report(report: &Report, state: &NodeState, took: Duration) {
    log_ops(report);
    for warning in &report.warnings {
        tracing::warn!("{warning}");
    }
    let eips: Vec<String> = state.eips.iter().map(|e| e.ip.to_string()).collect();
    tracing::info!(
        "reconciled applied={} failed={} warnings={} eips=[{}] took={}ms",
        report.applied.len(),
        report.failed.len(),
        report.warnings.len(),
        eips.join(","),
        took.as_millis()
    );
}

/// Retry delays after failed runs: 1 s doubling up to 30 s.
#[derive(Debug, Default)]
struct Backoff(u32);

impl Backoff {
    fn next(&mut self) -> Duration {
        let delay = Duration::from_secs(1 << self.0.min(5)).min(Duration::from_secs(30));
        self.0 += 1;
        delay
    }

    fn reset(&mut self) {
        self.0 = 0;
    }
}

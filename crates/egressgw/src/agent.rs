//! `egressgw agent`: keeps one node's kernel in line with the cluster.
//!
//! Watches feed reflector stores and wake the loop; the loop, debounced,
//! plans this node from the whole store (level-based, never from the event),
//! resolves the plan against the peers it sees alive through the tunnel
//! ([`crate::failover`]) and reconciles the kernel with
//! `egressgw-dataplane`. A change in the peers' liveness resolves and
//! reconciles again at once, without planning or the API server: an
//! outage of the API server changes nothing in the data plane. The agent
//! renews a Lease every second, for the record; its readiness (the
//! `/readyz` endpoint and the `Ready` phase of its `EgressTunnel`) follows
//! its first successful reconcile. Stopping the agent leaves the kernel as it is, so traffic
//! keeps flowing and a restarted agent finds nothing to change — unless
//! its DaemonSet is gone (an uninstall, see [`crate::cluster::owner`]):
//! then it removes everything it created before it exits.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use egressgw_api::EgressTunnel;
use egressgw_api::tunnel::{
    EgressTunnelStatus, TunnelDatapath, TunnelEip, TunnelEipState, TunnelEndpoint, TunnelParent,
    TunnelPhase, TunnelUnreachable,
};
use egressgw_core::model::{Config, PolicyRef};
use egressgw_core::state::NodeState;
use egressgw_core::{PodScope, Snapshot};
use egressgw_dataplane::Report;
use egressgw_dataplane::classify::Datapath;
use egressgw_dataplane::netlink::Rtnetlink;
use egressgw_dataplane::nft::Nft;
use egressgw_dataplane::reconcile::Dataplane;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client};
use tokio::sync::Notify;
use tracing::Instrument as _;

use crate::cluster::following::{Following, Replanned};
use crate::cluster::health::{self, Health};
use crate::cluster::metrics::{AgentMetrics, ApiRequests, PolicyCount, Verb};
use crate::cluster::owner::Owner;
use crate::cluster::stored::StoredPod;
use crate::cluster::watch::{Changed, ClusterVersion, PolicyStates, Stores, Wanted};
use crate::cluster::{self, ClusterArgs, lease};
use crate::failover::{Held, Liveness, Memory};
use crate::load_config;

/// Field manager of everything the agent writes.
const MANAGER: &str = "egressgw-agent";
/// Wait after a change before reconciling, so a burst of events is one run.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// Reconcile at least this often, to repair drift nobody announced.
const RESYNC: Duration = Duration::from_secs(30);
/// How often the policies' counters are read into the metrics between
/// reconciles (one map lookup per policy).
const TRAFFIC_EVERY: Duration = Duration::from_secs(5);
/// How long the loop may go without a turn before `/livez` fails: a turn
/// comes at least every [`TRAFFIC_EVERY`], and a retry after at most 30 s.
const LIVE_WITHIN: Duration = Duration::from_secs(60);
/// How often the Lease is renewed.
const RENEW_EVERY: Duration = Duration::from_secs(1);
/// How often the agent's watches are renewed: the most its view stays
/// stale after a network outage (plus 5 s). The data plane does not wait
/// for it; new objects do.
const WATCH_RENEW: Duration = Duration::from_secs(60);
/// How long one status write may take before it is tried again.
const STATUS_WRITE_TIMEOUT: Duration = Duration::from_secs(3);
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
    /// agent renews its Lease one last time for this long, so that the
    /// controller reports its tunnel as restarting rather than timed out
    /// while the replacement starts. (EIPs never move for an agent's
    /// absence: the node keeps them while its kernel answers its peers.)
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub restart_grace: u64,
    #[command(flatten)]
    pub probe: crate::failover::ProbeArgs,
}

/// What the stop path needs from the running agent, once it has it.
#[derive(Default)]
struct Running {
    owner: std::sync::OnceLock<Arc<Owner>>,
    client: std::sync::OnceLock<Client>,
    requests: std::sync::OnceLock<ApiRequests>,
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
        if let (Some(client), Some(requests)) = (running.client.get(), running.requests.get()) {
            restart_grace(args, client, requests).await;
        }
        tracing::info!("stopping; the kernel state stays as it is");
        return Ok(());
    };
    tracing::info!(reason, "stopping for an uninstall: removing the datapath");
    let mut dataplane = Dataplane::new(args.kernel.netlink()?, Nft::new(), config)
        .with_ebpf_pins(&args.kernel.bpf_pins);
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
async fn restart_grace(args: &AgentArgs, client: &Client, requests: &ApiRequests) {
    if args.restart_grace == 0 {
        return;
    }
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let cordoned = tokio::time::timeout(
        Duration::from_secs(1),
        requests.send(Verb::Get, nodes.get_opt(&args.node)),
    )
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
        lease::renew(&api, requests, &name, &args.node, grace),
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
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = AgentMetrics::register(&mut registry);
    let _ = running.requests.set(metrics.api().clone());
    let health = Arc::new(Health::new(registry).with_sink());
    health::serve(args.health_addr, Arc::clone(&health)).await?;

    let changed = Arc::new(Notify::new());
    let leases: Api<Lease> = Api::namespaced(client.clone(), &args.cluster.namespace);
    tokio::spawn(renew_lease(
        leases,
        metrics.api().clone(),
        node.to_owned(),
        Duration::from_secs(args.lease_duration.max(1)),
        Arc::clone(&running.stopping),
    ));

    let (stores, _watches) = Stores::start(
        &client,
        &changed,
        WATCH_RENEW,
        Some((node, &args.cluster.namespace)),
    );
    tracing::info!("waiting for the first list of every watched kind");
    stores.ready().await?;
    tracing::info!("watches synced");

    let (mut dataplane, why) = args.kernel.dataplane(config.clone())?;
    tracing::info!(datapath = %dataplane.datapath(), why, "datapath chosen");
    let datapath = TunnelDatapath {
        name: dataplane.datapath().to_string(),
        reason: Some(why),
        fast_path: (dataplane.datapath() == Datapath::Ebpf).then_some(config.ebpf_fast_path),
    };
    let mut memory = Memory::default();
    // What an earlier agent left on the node is held: a restart moves nothing.
    match dataplane.held_eips().await {
        Ok(held) => {
            let now = Timestamp::now();
            memory.held = held
                .into_iter()
                .map(|ip| {
                    let held = Held {
                        since: now,
                        note: None,
                    };
                    (ip, held)
                })
                .collect();
            if !memory.held.is_empty() {
                tracing::info!(eips = ?memory.held.keys().collect::<Vec<_>>(), "this node holds EIPs already");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot read the EIPs this node holds; assuming none"),
    }
    let (status_tx, status_rx) = tokio::sync::watch::channel(None);
    tokio::spawn(write_tunnel_status(
        client.clone(),
        metrics.api().clone(),
        node.to_owned(),
        status_rx,
    ));
    let liveness = Liveness::start(&config.vxlan.name, args.probe);
    tokio::spawn(Arc::clone(&liveness).watch());
    let mut agent = Agent {
        node: node.to_owned(),
        config,
        stores,
        dataplane,
        health,
        metrics,
        liveness: Arc::clone(&liveness),
        memory,
        planned: None,
        following: Following::new(&args.node),
        planned_version: None,
        status_tx,
        reported: None,
        reconciles: 0,
        recovering: Vec::new(),
        datapath,
    };
    let mut retry = Backoff::default();
    let mut replan = true;
    agent.health.expect_beats(LIVE_WITHIN);
    let mut traffic = tokio::time::interval(TRAFFIC_EVERY);
    traffic.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let succeeded = agent.reconcile(replan).await;
        let wait = if succeeded {
            retry.reset();
            agent.memory.recheck_in().map_or(RESYNC, |d| d.min(RESYNC))
        } else {
            retry.next()
        };
        let until = tokio::time::Instant::now() + wait;
        let woken = loop {
            tokio::select! {
                () = changed.notified() => {
                    tokio::time::sleep(DEBOUNCE).await;
                    break Wake::Changed;
                }
                () = liveness.changed.notified() => break Wake::Peers,
                () = tokio::time::sleep_until(until) => break Wake::Timer,
                _ = traffic.tick() => {
                    agent.refresh_metrics();
                    agent.health.beat();
                }
            }
        };
        replan = woken.plans_again(succeeded);
    }
}

/// What woke the agent's loop for its next run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A watched object changed (after the debounce).
    Changed,
    /// A peer started or stopped answering through the tunnel.
    Peers,
    /// The resync, a retry after a failed run, or an EIP's recheck.
    Timer,
}

impl Wake {
    /// Whether the run it starts plans the node again from the stores,
    /// after a last run that `succeeded` or not. Only a change of a watched
    /// object can change the plan: the stores change only by their watches,
    /// and every change wakes the loop ([`Wake::Changed`]; one that comes
    /// during a run wakes it again right after). A resync therefore
    /// reconciles the kernel with the plan it has, which costs a gateway
    /// node of a large cluster a list of every Pod it serves and their
    /// comparison each time. A run that failed may have failed to plan (a
    /// watch still listing, the node's tunnel not allocated yet): its
    /// retry plans again.
    fn plans_again(self, succeeded: bool) -> bool {
        match self {
            Self::Changed => true,
            Self::Peers => false,
            Self::Timer => !succeeded,
        }
    }
}

/// Renews the agent's Lease forever. Failures are logged and change
/// nothing else: the node's EIPs stay while its peers answer.
async fn renew_lease(
    api: Api<Lease>,
    requests: ApiRequests,
    node: String,
    duration: Duration,
    stopping: Arc<tokio::sync::Mutex<bool>>,
) {
    let name = lease::agent_lease_name(&node);
    let mut failing = false;
    let mut tick = tokio::time::interval(RENEW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let guard = stopping.lock().await;
        if *guard {
            return;
        }
        let result = tokio::time::timeout(
            RENEW_EVERY,
            lease::renew(&api, &requests, &name, &node, duration),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("renewing Lease {name}: timed out")));
        drop(guard);
        match result {
            Ok(()) if failing => {
                tracing::info!(lease = name, "Lease renewed again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "cannot renew the Lease; retrying every second (the data plane carries on)"
                );
                failing = true;
            }
            Err(_) => {}
        }
    }
}

struct Agent {
    node: String,
    config: Config,
    stores: Stores,
    dataplane: Dataplane<Rtnetlink, Nft>,
    health: Arc<Health>,
    metrics: AgentMetrics,
    liveness: Arc<Liveness>,
    memory: Memory,
    /// The last plan of this node (each reconcile shares it, uncopied) and
    /// the node's underlay address then.
    planned: Option<(Arc<NodeState>, Option<IpAddr>)>,
    /// The planner of this node, fed from the stores.
    following: Following,
    /// The stores' [`Stores::cluster_version`] the plan was made from:
    /// while it reads the same, only Pods changed; while it says only
    /// policies changed, only policies and Pods did.
    planned_version: Option<ClusterVersion>,
    /// Queues the tunnel status for [`write_tunnel_status`].
    status_tx: tokio::sync::watch::Sender<Option<EgressTunnelStatus>>,
    /// The tunnel status last queued, and when.
    reported: Option<(EgressTunnelStatus, Instant)>,
    reconciles: u64,
    /// When the silent node of each failover carried out but not yet in
    /// the kernel last answered (a failed reconcile keeps them).
    recovering: Vec<Instant>,
    /// What classifies pod traffic here, and why.
    datapath: TunnelDatapath,
}

impl Agent {
    /// One level-based run in its span (`reconcile`, with the node, the
    /// run's number and the datapath): plans again when `replan` (or when
    /// there is no plan yet), resolves the plan with the live peers,
    /// reconciles. Returns false when it should be retried soon.
    async fn reconcile(&mut self, replan: bool) -> bool {
        let span = tracing::info_span!(
            "reconcile",
            node = %self.node,
            run = self.reconciles + 1,
            datapath = %self.dataplane.datapath(),
        );
        let ok = self.reconcile_once(replan).instrument(span).await;
        self.health.beat();
        ok
    }

    async fn reconcile_once(&mut self, replan: bool) -> bool {
        if (replan || self.planned.is_none()) && !self.replan() {
            return false;
        }
        let Some((planned, underlay)) = self.planned.clone() else {
            return false;
        };
        let sight = self.liveness.sight();
        let outcome = self.memory.resolve(&planned, &sight).await;
        self.metrics.resolved(&outcome);
        let now = Instant::now();
        self.recovering.extend(
            outcome
                .recovering
                .iter()
                .filter_map(|d| now.checked_sub(*d)),
        );
        let resolved = &outcome.resolved;
        let state = &resolved.state;
        let started = Instant::now();
        let report = self.dataplane.reconcile(state).await;
        self.reconciles += 1;
        let took = started.elapsed();
        log_report(&report, state, took);
        self.metrics.reconciled(&report, took, state.eips.len());
        if report.is_ok() {
            for since in self.recovering.drain(..) {
                self.metrics.recovered(since.elapsed());
            }
        }
        self.metrics.probed(&self.liveness.seen(), &sight.live);
        let ok = report.is_ok();
        let readiness = readiness(&report, &self.memory);
        if let Err(why) = &readiness {
            tracing::debug!(why, "not ready");
        }
        let in_use: BTreeMap<String, String> = self
            .memory
            .in_use
            .iter()
            .map(|(ip, u)| (ip.to_string(), u.by.clone()))
            .collect();
        let traffic = self.policy_traffic();
        let round_trips: BTreeMap<String, u128> = self
            .liveness
            .seen()
            .into_iter()
            .filter_map(|(peer, seen)| Some((peer, seen.round_trip?.as_micros())))
            .collect();
        self.health.set_status(serde_json::json!({
            "node": self.node,
            "settings": crate::doctor::Settings::of(&self.config),
            "reconciles": self.reconciles,
            "datapath": self.datapath,
            "traffic": traffic,
            "gatewayFastPath": self.dataplane.gateway_learning().map(|learning| serde_json::json!({
                "connections": learning.held,
                "taken": learning.taken,
                "left": learning.left,
            })),
            "tunnelEnd": self.dataplane.tunnel_end().map(|counts| match counts {
                Ok(end) => serde_json::json!({
                    "toPods": { "packets": end.to_pods.packets, "bytes": end.to_pods.bytes },
                    "out": { "packets": end.out.packets, "bytes": end.out.bytes },
                }),
                Err(e) => serde_json::json!({ "error": e }),
            }),
            "ready": readiness.as_ref().err().map_or(serde_json::json!(true), |why| serde_json::json!({ "ready": false, "why": why })),
            "last": report,
            "eips": state.eips,
            "failover": {
                "peers": sight.last_answers,
                "roundTripsMicros": round_trips,
                "live": sight.live,
                "holders": sight.holders,
                // Only a candidate of some EIP probes every peer and decides by it.
                "quorum": crate::failover::is_candidate(&planned).then(|| serde_json::json!({
                    "reached": resolved.quorum.reached,
                    "total": resolved.quorum.total,
                })),
                "targets": resolved.targets,
                "inUse": in_use,
            },
        }));
        self.health.set_ready(readiness);
        self.report_tunnel(ok, underlay);
        ok
    }

    /// Packets and bytes sent through a gateway, per policy
    /// (`namespace/name`, or the name of a cluster policy), from the eBPF
    /// classifier's counters or the nftables table's, read at the end of a
    /// reconcile (`at`; one runs at least every 30 s).
    fn policy_traffic(&self) -> serde_json::Value {
        let policies = match self.dataplane.policy_counters() {
            Err(e) => return serde_json::json!({ "error": e }),
            Ok(counters) => counters
                .into_iter()
                .map(|(policy, c)| {
                    let counts = serde_json::json!({ "packets": c.packets, "bytes": c.bytes });
                    (policy.to_string(), counts)
                })
                .collect::<serde_json::Map<_, _>>(),
        };
        serde_json::json!({ "at": Timestamp::now().to_string(), "policies": policies })
    }

    /// Reads the policies' counters and the probes into the metrics,
    /// between reconciles.
    fn refresh_metrics(&self) {
        self.metrics
            .probed(&self.liveness.seen(), &self.liveness.live());
        if let Some(learning) = self.dataplane.gateway_learning() {
            self.metrics
                .gateway_fast_path(learning.held, learning.taken, learning.left);
        } else {
            self.metrics.gateway_fast_path(0, 0, 0);
        }
        if let Some(Ok(end)) = self.dataplane.tunnel_end() {
            self.metrics.tunnel_end([
                (end.to_pods.packets, end.to_pods.bytes),
                (end.out.packets, end.out.bytes),
            ]);
        }
        let Ok(counters) = self.dataplane.policy_counters() else {
            return;
        };
        let gateways = self
            .planned
            .as_ref()
            .map(|(state, _)| policy_gateways(state))
            .unwrap_or_default();
        self.metrics.set_traffic(
            counters
                .into_iter()
                .map(|(policy, c)| {
                    let gateway = gateways.get(&policy).cloned().unwrap_or_default();
                    let count = PolicyCount {
                        gateway,
                        packets: c.packets,
                        bytes: c.bytes,
                    };
                    (policy, count)
                })
                .collect(),
        );
    }

    /// Plans this node from the stores; false when it cannot yet. While
    /// the Pods the plan needs are still being listed (a gateway has just
    /// selected this node), the last plan stays.
    fn replan(&mut self) -> bool {
        // Read before the stores: a change while they are read counts
        // after it, and the next replan reads them again.
        let version = self.stores.cluster_version();
        if let (Some(planned), Some((_, underlay))) = (self.planned_version, self.planned.as_ref())
        {
            let underlay = *underlay;
            let (scope, pods) = self.stores.pods.scoped_state();
            let count = pods.len();
            let start = Instant::now();
            let replanned = match version.since(&planned) {
                Changed::Nothing => self.following.update_pods(scope, pods),
                // Only the policies stored anew are converted.
                Changed::Policies => {
                    let policies = self.stores.policy_states();
                    self.following.update_policies(policies, scope, pods)
                }
                Changed::Others => None,
            };
            if let Some(replanned) = replanned {
                self.metrics.watched_pods(scope, count);
                let adopted = self.adopt(replanned, start, underlay);
                if adopted {
                    self.planned_version = Some(version);
                }
                return adopted;
            }
        }
        self.planned_version = None;
        let Some((snapshot, policies, scope, pods)) = self.snapshot() else {
            tracing::info!(
                node = self.node,
                "a gateway selects this node: waiting for the list of the pods it carries before planning"
            );
            return self.planned.is_some();
        };
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
        // Where each EIP is held is the controller's call (and, on failover,
        // the data plane's): the agent follows what the controller published
        // (the planner plans as `egressgw_core::plan_node_published`).
        let start = Instant::now();
        let replanned = self.following.update(snapshot, policies, scope, pods);
        let adopted = self.adopt(replanned, start, underlay);
        if adopted {
            self.planned_version = Some(version);
        }
        adopted
    }

    /// Takes the planner's state as this node's plan.
    fn adopt(&mut self, replanned: Replanned, start: Instant, underlay: Option<IpAddr>) -> bool {
        tracing::debug!(node = self.node, ?replanned, took = ?start.elapsed(), "planned");
        self.metrics.planned();
        let Some(state) = self.following.state() else {
            tracing::warn!(node = self.node, "the planner has no state for this node");
            return false;
        };
        self.liveness.follow(&state);
        self.planned = Some((state, underlay));
        true
    }

    /// The stores' objects but the Pods, and the Pods this node's plan
    /// needs (see [`egressgw_core::pod_scope`]) with the scope they are
    /// of; `None` while they are being listed.
    fn snapshot(&self) -> Option<(Snapshot, PolicyStates, PodScope, Vec<StoredPod>)> {
        for _ in 0..2 {
            let policies = self.stores.policy_states();
            let cluster = self
                .stores
                .cluster_snapshot_of(self.config.clone(), &policies);
            let gateways = egressgw_core::gateways_selecting(&cluster, &self.node);
            let wanted = Wanted::of(&gateways, |name| self.stores.publication(name));
            if !self.stores.pods.serve(&wanted) {
                return None;
            }
            // Every Pod serves any node; a node that needs every Pod,
            // listed since, takes the objects again.
            let (served, pods) = self.stores.pods.scoped_state();
            if served == wanted.scope() || served == PodScope::Cluster {
                self.metrics.watched_pods(served, pods.len());
                return Some((cluster, policies, served, pods));
            }
        }
        None
    }

    /// Writes the agent's part of its `EgressTunnel` status when it changed
    /// (or the heartbeat is due): parent, phase, heartbeat.
    fn report_tunnel(&mut self, ok: bool, underlay: Option<IpAddr>) {
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
        let mut eips: Vec<TunnelEip> = self
            .memory
            .held
            .iter()
            .map(|(ip, held)| TunnelEip {
                ip: ip.to_string(),
                state: TunnelEipState::Held,
                since: Some(MicroTime(held.since)),
                message: held.note.clone(),
            })
            .collect();
        eips.extend(self.memory.in_use.iter().map(|(ip, u)| TunnelEip {
            ip: ip.to_string(),
            state: TunnelEipState::InUse,
            since: Some(MicroTime(u.since)),
            message: Some(format!("another host answers for it: {}", u.by)),
        }));
        let status = EgressTunnelStatus {
            tunnel: Some(TunnelEndpoint {
                parent,
                ..TunnelEndpoint::default()
            }),
            phase: Some(phase),
            mark: None,
            last_heartbeat_time: None,
            eips,
            unreachable: self
                .memory
                .unreachable
                .values()
                .map(|u| TunnelUnreachable {
                    gateway: u.gateway.clone(),
                    eip: u.eip.map(|ip| ip.to_string()),
                    fail_closed: u.fail_closed,
                    since: Some(MicroTime(u.since)),
                })
                .collect(),
            datapath: Some(self.datapath.clone()),
        };
        if !status_due(self.reported.as_ref(), &status, api_phase, Instant::now()) {
            return;
        }
        let mut patch = status.clone();
        patch.last_heartbeat_time = Some(Time(Timestamp::now()));
        let queued_phase = self.reported.as_ref().and_then(|(last, _)| last.phase);
        if api_phase != Some(phase) && queued_phase != Some(phase) {
            tracing::info!(node = self.node, ?phase, "reporting the tunnel phase");
        }
        // The writer sends it; a slow or absent API server never holds up
        // the data plane.
        self.status_tx.send_replace(Some(patch));
        self.reported = Some((status, Instant::now()));
    }
}

/// Whether the agent writes `status` now, `last` being the status it last
/// queued and when: when it changed, when the stored phase is another (the
/// controller marked the tunnel `HeartbeatTimeout` while the agent was
/// away, or the object was created anew), and at least every
/// [`HEARTBEAT_EVERY`] so that the stored heartbeat stays recent.
fn status_due(
    last: Option<&(EgressTunnelStatus, Instant)>,
    status: &EgressTunnelStatus,
    stored_phase: Option<TunnelPhase>,
    now: Instant,
) -> bool {
    let recent = last.is_some_and(|(last, at)| {
        last == status && now.saturating_duration_since(*at) < HEARTBEAT_EVERY
    });
    !recent || stored_phase != status.phase
}

/// Writes the agent's `EgressTunnel` status whenever a new one is queued,
/// retrying every second until the API server takes it.
async fn write_tunnel_status(
    client: Client,
    requests: ApiRequests,
    node: String,
    mut queued: tokio::sync::watch::Receiver<Option<EgressTunnelStatus>>,
) {
    let api: Api<EgressTunnel> = Api::all(client);
    let mut failing = false;
    while queued.changed().await.is_ok() {
        loop {
            let Some(status) = queued.borrow_and_update().clone() else {
                break;
            };
            let body = serde_json::json!({
                "apiVersion": format!("{}/{}", egressgw_api::GROUP, egressgw_api::VERSION),
                "kind": "EgressTunnel",
                "metadata": { "name": node },
                "status": status,
            });
            let params = PatchParams::apply(MANAGER).force();
            let written = tokio::time::timeout(
                STATUS_WRITE_TIMEOUT,
                requests.send(
                    Verb::Patch,
                    api.patch_status(&node, &params, &Patch::Apply(&body)),
                ),
            )
            .await
            .unwrap_or_else(|_| Err(kube::Error::Service("timed out".into())))
            .with_context(|| format!("applying EgressTunnel {node} status"));
            match written {
                Ok(_) => {
                    if failing {
                        tracing::info!("EgressTunnel status written again");
                        failing = false;
                    }
                    break;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(
                            error = format!("{e:#}"),
                            "cannot update EgressTunnel status; retrying every second"
                        );
                        failing = true;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}

/// One line per operation of `report`, applied or failed: the only place
/// an agent logs them.
fn log_ops(report: &Report) {
    for op in &report.applied {
        tracing::info!(kind = %op.kind, object = op.object, op = op.text, "applied");
    }
    for f in &report.failed {
        tracing::error!(
            kind = %f.op.kind,
            object = f.op.object,
            op = f.op.text,
            cause = f.cause.as_str(),
            error = f.error,
            "operation failed"
        );
    }
}

/// Whether the agent is ready: its last reconcile applied every
/// operation, and every gateway it sends selected traffic to has a node
/// that answers through the tunnel. The reason when not.
fn readiness(report: &Report, memory: &Memory) -> Result<(), String> {
    if let Some(f) = report.failed.first() {
        return Err(format!(
            "the last reconcile failed: {} operation(s), first `{}`: {}",
            report.failed.len(),
            f.op.text,
            f.error
        ));
    }
    let gateways: BTreeSet<&str> = memory
        .unreachable
        .values()
        .map(|u| u.gateway.as_str())
        .collect();
    if gateways.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "no candidate node of EgressGateway {} answers through the tunnel",
            gateways.into_iter().collect::<Vec<_>>().join(", ")
        ))
    }
}

/// The EgressGateway of each policy with selected traffic on this node.
fn policy_gateways(state: &NodeState) -> BTreeMap<PolicyRef, String> {
    state
        .classify
        .iter()
        .filter_map(|e| {
            let id = e.group?;
            let group = state.groups.iter().find(|g| g.id == id)?;
            Some((PolicyRef::clone(e.policy.as_ref()?), group.gateway.clone()))
        })
        .collect()
}

fn log_report(report: &Report, state: &NodeState, took: Duration) {
    log_ops(report);
    for warning in &report.warnings {
        tracing::warn!(warning, "attention");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn status(phase: TunnelPhase) -> EgressTunnelStatus {
        EgressTunnelStatus {
            phase: Some(phase),
            ..EgressTunnelStatus::default()
        }
    }

    #[test]
    fn the_tunnel_status_is_written_when_it_changes_when_the_api_says_otherwise_and_as_a_heartbeat()
    {
        let start = Instant::now();
        let ready = status(TunnelPhase::Ready);
        let last = (ready.clone(), start);
        let soon = start + Duration::from_secs(1);
        let phase = Some(TunnelPhase::Ready);
        // Nothing queued yet.
        assert!(status_due(None, &ready, phase, soon));
        // The same status, stored as queued, a second later: nothing to say.
        assert!(!status_due(Some(&last), &ready, phase, soon));
        // It changed.
        let failed = status(TunnelPhase::Failed);
        assert!(status_due(Some(&last), &failed, phase, soon));
        // The controller marked it HeartbeatTimeout while this agent could
        // not renew its Lease: the agent says Ready again at once.
        let marked = Some(TunnelPhase::HeartbeatTimeout);
        assert!(status_due(Some(&last), &ready, marked, soon));
        // The heartbeat.
        let later = start + HEARTBEAT_EVERY;
        assert!(status_due(Some(&last), &ready, phase, later));
    }

    #[test]
    fn only_a_change_or_a_retry_plans_again_and_a_resync_reconciles_the_plan_it_has() {
        assert!(Wake::Changed.plans_again(true));
        assert!(Wake::Changed.plans_again(false));
        // The peers decide the failover, which is resolved on the plan.
        assert!(!Wake::Peers.plans_again(true));
        assert!(!Wake::Peers.plans_again(false));
        // The resync after a run that went well: nothing to plan anew.
        assert!(!Wake::Timer.plans_again(true));
        // The retry of a run that failed, perhaps to plan.
        assert!(Wake::Timer.plans_again(false));
    }
}

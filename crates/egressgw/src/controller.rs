//! `egressgw controller`: allocations, gateway choice and status.
//!
//! One replica acts at a time, the holder of the Lease
//! `egressgw-controller`; the others watch and wait. The active one plans
//! the whole cluster with `egressgw-core` on every change (debounced,
//! level-based) and writes the result with server-side apply: each node's
//! `EgressTunnel` (created with the Node as owner, so it goes with it), and
//! the status of every gateway and policy. It also watches the agents'
//! Leases: an agent that stops renewing for `--agent-timeout` gets its
//! tunnel marked `HeartbeatTimeout`, and its node gets no new EIPs. EIPs it
//! holds stay: failover is the data plane's (see `crate::failover`), and the
//! controller records where the agents report holding them.
//!
//! It also publishes, per gateway, the Pods whose traffic the gateway's
//! nodes may carry, in `EgressEndpointSlice`s in its namespace (see
//! `crate::slices`): the agents of those nodes watch them instead of every
//! Pod. A gateway's `status.pods` says they are published.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use egressgw_api::endpoints::{self, WatchedSlice};
use egressgw_api::{
    EgressClusterPolicy, EgressEndpointSlice, EgressGateway, EgressPolicy, EgressTunnel,
    TunnelPhase,
};
use egressgw_core::Snapshot;
use egressgw_core::model::{Config, Mac, PolicyRef};
use egressgw_core::status::{ClusterStatus, ConditionType, Reason};
use futures_util::{StreamExt as _, stream};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt as _};
use serde::Serialize;
use tokio::sync::{Notify, watch};

use crate::cluster::following::Publishing;
use crate::cluster::health::{self, Health};
use crate::cluster::lease::{self, Elector, Liveness};
use crate::cluster::metrics::{ApiRequests, ControllerMetrics, REQUEST_TIMEOUT, Verb};
use crate::cluster::watch::{ClusterVersion, Stores, stored_status, watch as watch_kind};
use crate::cluster::{self, ClusterArgs};
use crate::load_config;
use crate::slices::{self, SliceWrite};
use crate::writes::{self, Stored, Urgency, Write};

/// Field manager of the controller's writes.
const MANAGER: &str = "egressgw-controller";
/// Field manager of the `HeartbeatTimeout` phase alone (see
/// docs/tunnel-identity.md).
const PHASE_MANAGER: &str = "egressgw-controller-phase";
/// Name of the leader-election Lease.
const LEADER_LEASE: &str = "egressgw-controller";
const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often the controller's watches are renewed: the most its view stays
/// stale after a network outage of its node (plus 5 s).
const WATCH_RENEW: Duration = Duration::from_secs(15);
/// How often agent Leases are checked for expiry between events.
const LIVENESS_TICK: Duration = Duration::from_millis(200);
/// Full replan at least this often.
const RESYNC: Duration = Duration::from_secs(60);
/// How long one run goes on starting writes: past it, the rest waits for
/// the next run, so that a backlog of statuses (thousands of policies
/// created at once) never keeps the controller from seeing, and placing
/// first, what changed meanwhile.
const WRITE_BUDGET: Duration = Duration::from_secs(2);

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// This replica's name in the leader Lease (default: host name and pid).
    #[arg(long, value_name = "ID", env = "POD_NAME")]
    pub identity: Option<String>,
    /// Address of the health endpoint (`/healthz`, `/readyz`, `/status`).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9811")]
    pub health_addr: SocketAddr,
    /// An agent whose Lease is not renewed for this long is reported
    /// (`HeartbeatTimeout`) and its node gets no new EIPs; EIPs it holds
    /// stay while its node answers its peers.
    #[arg(long, value_name = "SECONDS", default_value_t = 3.0)]
    pub agent_timeout: f64,
    /// Duration of the leader Lease: how long a replica that stopped
    /// renewing blocks the others.
    #[arg(long, value_name = "SECONDS", default_value_t = 15)]
    pub leader_lease_duration: u64,
    /// How many writes (statuses, tunnels) may be in flight to the API
    /// server at once.
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub writes_in_flight: u16,
}

pub fn run(args: &ControllerArgs) -> anyhow::Result<()> {
    crate::init_daemon_logs(args.cluster.log_format);
    let config = load_config(args.cluster.config.as_deref())?;
    if !(args.agent_timeout.is_finite() && args.agent_timeout > 0.0) {
        anyhow::bail!(
            "--agent-timeout {}: must be a positive number of seconds",
            args.agent_timeout
        );
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(async { controller(args, config).await })
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "controller".to_owned());
    format!("{host}-{}", std::process::id())
}

async fn controller(args: &ControllerArgs, config: Config) -> anyhow::Result<()> {
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    tracing::info!(identity, "egressgw controller starting");
    let client = cluster::client(args.cluster.kubeconfig.as_deref()).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = ControllerMetrics::register(&mut registry);
    let health = Arc::new(Health::new(registry));
    health::serve(args.health_addr, Arc::clone(&health)).await?;

    let changed = Arc::new(Notify::new());
    let (stores, mut watches) = Stores::start(&client, &changed, WATCH_RENEW, None);
    // Renewals do not wake the loop (three agents would replan the cluster
    // three times a second); the liveness tick reads the Lease store.
    let renewed = Arc::new(Notify::new());
    let leases: Store<Lease> = watch_kind(
        Api::namespaced(client.clone(), &args.cluster.namespace),
        &renewed,
        &mut watches,
        WATCH_RENEW,
    );
    // Its own writes come back and wake it once more, with nothing to do;
    // a slice changed or deleted by anyone else is written again.
    let endpoint_slices: Store<WatchedSlice> = watch_kind(
        Api::namespaced(client.clone(), &args.cluster.namespace),
        &changed,
        &mut watches,
        WATCH_RENEW,
    );
    stores.ready().await?;
    leases
        .wait_until_ready()
        .await
        .map_err(|_| anyhow::anyhow!("the Lease watch stopped before its first list"))?;
    endpoint_slices.wait_until_ready().await.map_err(|_| {
        anyhow::anyhow!("the EgressEndpointSlice watch stopped before its first list")
    })?;
    tracing::info!("watches synced");
    health.set_ready(Ok(()));

    let (leading_tx, mut leading) = watch::channel(false);
    let lease_client = client.clone();
    let elector = || {
        Elector::new(
            lease_client.clone(),
            &args.cluster.namespace,
            LEADER_LEASE,
            &identity,
            Duration::from_secs(args.leader_lease_duration.max(2)),
            metrics.api().clone(),
        )
    };
    let election = tokio::spawn(elect(elector(), leading_tx));
    let mut shutdown = std::pin::pin!(cluster::shutdown_signal());

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: MANAGER.into(),
            instance: Some(identity.clone()),
        },
    );
    let mut control = Control {
        config,
        client,
        stores,
        leases,
        endpoint_slices,
        namespace: args.cluster.namespace.clone(),
        liveness: Liveness::default(),
        started: Instant::now(),
        agent_timeout: Duration::from_secs_f64(args.agent_timeout),
        writes_in_flight: usize::from(args.writes_in_flight),
        recorder,
        health,
        metrics: metrics.clone(),
        unavailable: BTreeSet::new(),
        invalid_reported: HashMap::new(),
        unreachable_reported: BTreeMap::new(),
        allocations: None,
        publishing: Publishing::default(),
        published_version: None,
        current_slices: BTreeMap::new(),
        written: HashMap::new(),
        due: None,
    };
    let mut last_run = Instant::now();
    let mut pending = true;
    loop {
        tokio::select! {
            () = changed.notified() => {
                tokio::time::sleep(DEBOUNCE).await;
                pending = true;
            }
            result = leading.changed() => {
                result.context("the leader election stopped")?;
                let now_leading = *leading.borrow();
                metrics.set_leader(now_leading);
                if !now_leading {
                    // Only the leader speaks for the objects.
                    metrics.clear_objects();
                    metrics.set_writes_pending(&BTreeMap::new());
                    control.allocations = None;
                    control.current_slices.clear();
                    control.written.clear();
                    control.due = None;
                }
                pending = true;
            }
            () = tokio::time::sleep(LIVENESS_TICK) => {}
            () = &mut shutdown => {
                election.abort();
                if let Err(e) = elector().release().await {
                    tracing::warn!(error = format!("{e:#}"), "cannot release the leader Lease");
                }
                tracing::info!("stopped");
                return Ok(());
            }
        }
        if !*leading.borrow() {
            continue;
        }
        let unavailable = control.unavailable_agents();
        if unavailable != control.unavailable
            || control.due.is_some_and(|due| due <= Instant::now())
        {
            pending = true;
        }
        if pending || last_run.elapsed() > RESYNC {
            pending = !control.reconcile(&unavailable).await;
            control.unavailable = unavailable;
            last_run = Instant::now();
        }
    }
}

/// Runs leader election forever, publishing whether this replica leads.
async fn elect(mut elector: Elector, leading: watch::Sender<bool>) {
    const RETRY: Duration = Duration::from_secs(2);
    let mut last_success: Option<Instant> = None;
    loop {
        let result = tokio::time::timeout(RETRY, elector.try_acquire_or_renew())
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("leader election: timed out")));
        let now_leading = match result {
            Ok(held) => {
                last_success = held.then(Instant::now);
                held
            }
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "leader election failed");
                // Keep leading through short API outages, not past the
                // point where another replica may take over.
                *leading.borrow() && last_success.is_some_and(|t| t.elapsed() < RETRY * 4)
            }
        };
        if now_leading != *leading.borrow() {
            if now_leading {
                tracing::info!("became the active controller");
            } else {
                tracing::warn!("no longer the active controller");
            }
            let _ = leading.send(now_leading);
        }
        tokio::time::sleep(RETRY).await;
    }
}

struct Control {
    config: Config,
    client: Client,
    stores: Stores,
    leases: Store<Lease>,
    /// The slices of every gateway's Pods, in `namespace`, as it keeps
    /// them (names and digests).
    endpoint_slices: Store<WatchedSlice>,
    /// The controller's namespace, where the slices are.
    namespace: String,
    liveness: Liveness,
    started: Instant,
    agent_timeout: Duration,
    /// `--writes-in-flight`.
    writes_in_flight: usize,
    recorder: Recorder,
    health: Arc<Health>,
    metrics: ControllerMetrics,
    /// Nodes whose agent was unavailable at the last run.
    unavailable: BTreeSet<String>,
    /// Invalid objects already reported by an Event, with their problems.
    invalid_reported: HashMap<(String, Option<String>, String), Vec<String>>,
    /// Traffic the agents report with no live gateway node, as last
    /// reported by an Event: (node, gateway, EIP) -> failClosed.
    unreachable_reported: BTreeMap<(String, String, Option<String>), bool>,
    /// What the last plan allocated; `None` until this replica plans as
    /// the leader.
    allocations: Option<Allocations>,
    /// The selection of Pods, and the gateways' Pods, kept between runs.
    publishing: Publishing,
    /// The cluster version and unavailable agents the publisher last
    /// planned with.
    published_version: Option<(ClusterVersion, BTreeSet<String>)>,
    /// Per gateway whose stored slices were found to hold its Pods: the
    /// [`slices_fingerprint`] they had. Until its Pods or those slices
    /// change, they are not compared again.
    current_slices: BTreeMap<String, u64>,
    /// When each object's status was last written by this replica, for
    /// the last [`writes::DETAILS_EVERY`].
    written: HashMap<String, Instant>,
    /// When the first status update held back by the last run is due.
    due: Option<Instant>,
}

impl Control {
    /// Nodes whose agent reported `Ready` but has not renewed its Lease
    /// within the timeout (a Lease never seen counts from the controller's
    /// start).
    fn unavailable_agents(&mut self) -> BTreeSet<String> {
        let now = Instant::now();
        let leases = self.leases.state();
        self.liveness.observe(leases.iter().map(AsRef::as_ref), now);
        self.stores
            .nodes
            .state()
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .filter(|node| {
                let name = lease::agent_lease_name(node);
                match self.liveness.alive(&name, self.agent_timeout, now) {
                    Some(alive) => !alive,
                    None => now.saturating_duration_since(self.started) > self.agent_timeout,
                }
            })
            .collect()
    }

    /// One full run. Returns false when something could not be written.
    async fn reconcile(&mut self, unavailable: &BTreeSet<String>) -> bool {
        let started = Instant::now();
        let mut ok = true;
        let stored = self.stored();
        let mut left = BTreeMap::new();
        ok &= self
            .send(writes::timeouts(&stored, unavailable), &stored, &mut left)
            .await;
        // The allocations, status and each gateway's Pods only: the nodes'
        // dataplane states are each agent's to plan. The Pods are taken one
        // by one as they change; the other objects are read again only
        // when one of them changed (counted before reading the stores).
        let version = (self.stores.cluster_version(), unavailable.clone());
        let cluster = (self.published_version.as_ref() != Some(&version)
            || self.publishing.publisher().is_none())
        .then(|| {
            let mut cluster = self.stores.cluster_snapshot(self.config.clone());
            for node in &mut cluster.nodes {
                if unavailable.contains(&node.name) {
                    node.ready = false;
                }
            }
            cluster
        });
        let changed = self
            .publishing
            .update(cluster, self.stores.pods.state())
            .take_changed();
        self.published_version = Some(version);
        let (sent, pods) = self.publish(&changed).await;
        ok &= sent;
        let publisher = self.publishing.publisher().expect("updated above");
        let status = publisher.status();
        let snapshot = publisher.cluster().clone();
        self.count_allocations(&snapshot, &status);
        let tunnels: Vec<Option<bool>> = self
            .stores
            .tunnels
            .state()
            .iter()
            .map(|t| t.phase().map(|p| p == TunnelPhase::Ready))
            .collect();
        self.metrics.set_objects(&status, &tunnels);
        // What the stores held at the run's start: the writes sent since
        // come back through the watches later, not in this run.
        let mut stored = stored;
        stored.published = pods;
        let mut planned = writes::plan(&stored, &status, Timestamp::now());
        let now = Instant::now();
        self.written
            .retain(|_, at| now.saturating_duration_since(*at) < writes::DETAILS_EVERY);
        let held = writes::hold_details(&mut planned, &stored, &self.written, now);
        self.due = held.due;
        if held.writes > 0 {
            *left.entry(Urgency::Details).or_default() += held.writes as i64;
        }
        ok &= self.send(planned, &stored, &mut left).await;
        self.metrics.set_writes_pending(&left);
        self.report_moves(&snapshot, &status).await;
        self.report_invalid(&snapshot).await;
        self.report_unreachable(&status).await;
        let eips: BTreeMap<String, String> = status
            .eip_nodes
            .iter()
            .map(|(ip, node)| (ip.to_string(), node.clone()))
            .collect();
        self.health.set_status(serde_json::json!({
            "eips": eips,
            "unavailableAgents": unavailable,
            "invalid": snapshot.invalid.len(),
        }));
        tracing::debug!(
            eips = ?eips,
            unavailable = ?unavailable,
            took_ms = started.elapsed().as_millis(),
            "planned"
        );
        ok
    }

    /// Counts what `status` allocated since the last plan (since what the
    /// stored objects record, for the first plan as the leader).
    fn count_allocations(&mut self, snapshot: &Snapshot, status: &ClusterStatus) {
        let now = Allocations::planned(status, &self.config);
        let before = self
            .allocations
            .take()
            .unwrap_or_else(|| Allocations::recorded(snapshot));
        for ((kind, result), n) in now.since(&before) {
            self.metrics.allocated(kind, result, n);
        }
        self.allocations = Some(now);
    }

    /// Writes the slices that publish each gateway's Pods, comparing only
    /// the gateways whose Pods (`changed`) or stored slices changed since
    /// they were last found current. Returns whether every write
    /// succeeded, and the gateways whose slices now hold their Pods, with
    /// their counts.
    async fn publish(
        &mut self,
        changed: &BTreeSet<String>,
    ) -> (bool, BTreeMap<String, egressgw_api::gateway::GatewayPods>) {
        let publisher = self.publishing.publisher().expect("updated before");
        let gateways: BTreeMap<String, String> = self
            .stores
            .gateways
            .state()
            .iter()
            .filter_map(|g| Some((g.name_any(), g.metadata.uid.clone()?)))
            .collect();
        let stored = self.endpoint_slices.state();
        let fingerprints: BTreeMap<&str, u64> = gateways
            .iter()
            .map(|(name, uid)| (name.as_str(), slices_fingerprint(uid, name, &stored)))
            .collect();
        let counts: BTreeMap<&str, usize> = publisher.gateways().collect();
        let compared = |gateway: &str| {
            changed.contains(gateway)
                || self.current_slices.get(gateway) != fingerprints.get(gateway)
        };
        let mut planned = slices::plan(&stored, &gateways, |gateway| {
            if compared(gateway) {
                let pods = publisher.pods_of(gateway);
                slices::Wanted::Pods(pods.into_iter().map(|p| self.publishing.want(p)).collect())
            } else {
                slices::Wanted::Current(counts.get(gateway).copied().unwrap_or(0))
            }
        });
        let compared: BTreeSet<String> = gateways.keys().filter(|g| compared(g)).cloned().collect();
        let written: BTreeSet<&str> = planned.writes.iter().map(SliceWrite::gateway).collect();
        let mut current: BTreeMap<String, u64> = self
            .current_slices
            .iter()
            .filter(|(g, _)| gateways.contains_key(*g) && !compared.contains(*g))
            .map(|(g, f)| (g.clone(), *f))
            .collect();
        for gateway in compared.iter().filter(|g| !written.contains(g.as_str())) {
            current.insert(gateway.clone(), fingerprints[gateway.as_str()]);
        }
        let mut ok = true;
        for write in &planned.writes {
            if let Err(e) = self.write_slice(write).await {
                tracing::warn!(write = %write, error = format!("{e:#}"), "cannot write");
                planned.published.remove(write.gateway());
                ok = false;
            }
        }
        self.current_slices = current;
        (ok, planned.published)
    }

    /// Sends one slice write.
    async fn write_slice(&self, write: &SliceWrite) -> anyhow::Result<()> {
        let api: Api<EgressEndpointSlice> = Api::namespaced(self.client.clone(), &self.namespace);
        match write {
            SliceWrite::Apply { name, owner, spec } => {
                let body = serde_json::json!({
                    "apiVersion": api_version(),
                    "kind": "EgressEndpointSlice",
                    "metadata": {
                        "name": name,
                        "labels": {
                            endpoints::GATEWAY_LABEL: endpoints::gateway_label(&spec.gateway),
                            "app.kubernetes.io/managed-by": MANAGER,
                        },
                        "ownerReferences": [{
                            "apiVersion": api_version(), "kind": "EgressGateway",
                            "name": spec.gateway, "uid": owner,
                        }],
                    },
                    "spec": spec,
                });
                let params = PatchParams::apply(MANAGER).force();
                self.metrics
                    .api()
                    .send(Verb::Patch, api.patch(name, &params, &Patch::Apply(&body)))
                    .await?;
            }
            SliceWrite::Delete { name, .. } => {
                let deleted = self
                    .metrics
                    .api()
                    .send(Verb::Delete, api.delete(name, &DeleteParams::default()))
                    .await;
                match deleted {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        tracing::debug!(write = %write, "written");
        Ok(())
    }

    /// What the watch caches hold, as [`writes::plan`] decides from it.
    fn stored(&self) -> Stored {
        let mut stored = Stored {
            tunnels: self
                .stores
                .tunnels
                .state()
                .iter()
                .map(|t| (t.name_any(), (t.phase(), t.status.clone())))
                .collect(),
            node_uids: self
                .stores
                .nodes
                .state()
                .iter()
                .filter_map(|n| Some((n.metadata.name.clone()?, n.metadata.uid.clone()?)))
                .collect(),
            gateways: self
                .stores
                .gateways
                .state()
                .iter()
                .map(|g| {
                    let stored = writes::Object {
                        status: g.status.clone(),
                        generation: g.metadata.generation,
                    };
                    (g.name_any(), stored)
                })
                .collect(),
            ..Stored::default()
        };
        let policies = self.stores.policies.state();
        let cluster_policies = self.stores.cluster_policies.state();
        let namespaced = policies.iter().map(|p| {
            let ns = p.meta().namespace.clone().unwrap_or_default();
            let status = stored_status(&**p);
            let id = PolicyRef::namespaced(ns, p.name_any());
            let generation = p.meta().generation;
            (id, writes::Object { status, generation })
        });
        let cluster = cluster_policies.iter().map(|p| {
            let status = stored_status(&**p);
            let id = PolicyRef::cluster(p.name_any());
            let generation = p.meta().generation;
            (id, writes::Object { status, generation })
        });
        stored.policies = namespaced.chain(cluster).collect();
        stored
    }

    /// Sends `writes`, ordered as [`writes::Waves`] orders them, up to
    /// `--writes-in-flight` at a time, and reports each failure. It starts
    /// no write after [`WRITE_BUDGET`]: what is left is planned again,
    /// most urgent first, by the next run, which also sees what changed
    /// meanwhile; `left` counts it by urgency. Each status written is
    /// remembered in `written`. Returns false when a write failed or was
    /// left.
    async fn send(
        &mut self,
        writes: Vec<Write>,
        stored: &Stored,
        left: &mut BTreeMap<Urgency, i64>,
    ) -> bool {
        let waves = writes::Waves::new(writes, stored);
        let deadline = Instant::now() + WRITE_BUDGET;
        let open = move || Instant::now() < deadline;
        let lanes: Vec<bool> = stream::iter(waves.tunnels.iter())
            .take_while(|_| std::future::ready(open()))
            .map(|lane| self.send_lane(lane))
            .buffer_unordered(self.writes_in_flight)
            .collect()
            .await;
        // In order, so that each result is its write's.
        let statuses: Vec<bool> = stream::iter(waves.statuses.iter())
            .take_while(|_| std::future::ready(open()))
            .map(|write| self.send_one(write))
            .buffered(self.writes_in_flight)
            .collect()
            .await;
        let now = Instant::now();
        for (write, _) in waves.statuses.iter().zip(&statuses).filter(|(_, ok)| **ok) {
            if let Some(object) = write.status_object() {
                self.written.insert(object, now);
            }
        }
        // Writes are started in order: those not started are the last.
        let untried = waves.tunnels[lanes.len()..]
            .iter()
            .flatten()
            .chain(&waves.statuses[statuses.len()..]);
        let mut untouched = 0;
        for write in untried {
            *left.entry(write.urgency(stored)).or_default() += 1;
            untouched += 1;
        }
        if untouched > 0 {
            tracing::info!(
                left = untouched,
                "writes left for the next run, most urgent first"
            );
        }
        untouched == 0 && lanes.iter().chain(&statuses).all(|ok| *ok)
    }

    /// Sends one tunnel's writes in order, stopping at the first failure
    /// (a tunnel that could not be created gets no status). Returns
    /// whether all succeeded.
    async fn send_lane(&self, lane: &[Write]) -> bool {
        for write in lane {
            if !self.send_one(write).await {
                return false;
            }
        }
        true
    }

    /// Sends one write; logs and returns false when it fails.
    async fn send_one(&self, write: &Write) -> bool {
        let sent = match write {
            Write::HeartbeatTimeout { node } => self.mark_timeout(node).await,
            Write::CreateTunnel { node, owner } => self.create_tunnel(node, owner.as_deref()).await,
            Write::TunnelStatus { node, status } => self.write_tunnel(node, status).await,
            Write::PolicyStatus { policy, status } => match &policy.namespace {
                Some(ns) => {
                    apply_status::<EgressPolicy, _>(
                        &self.client,
                        self.metrics.api(),
                        Some(ns),
                        &policy.name,
                        None,
                        status,
                    )
                    .await
                }
                None => {
                    apply_status::<EgressClusterPolicy, _>(
                        &self.client,
                        self.metrics.api(),
                        None,
                        &policy.name,
                        None,
                        status,
                    )
                    .await
                }
            },
            Write::GatewayStatus { gateway, status } => {
                apply_status::<EgressGateway, _>(
                    &self.client,
                    self.metrics.api(),
                    None,
                    gateway,
                    None,
                    status,
                )
                .await
            }
        };
        match sent {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(write = %write, error = format!("{e:#}"), "cannot write");
                false
            }
        }
    }

    /// Marks the tunnel of `node`, whose agent stopped renewing its Lease,
    /// `HeartbeatTimeout`, and says so in an Event.
    async fn mark_timeout(&self, node: &str) -> anyhow::Result<()> {
        let status = serde_json::json!({ "phase": TunnelPhase::HeartbeatTimeout });
        self.apply_tunnel_status(node, PHASE_MANAGER, &status)
            .await
            .context("marking the tunnel HeartbeatTimeout")?;
        tracing::warn!(node, "agent stopped renewing its Lease: HeartbeatTimeout");
        // One Event per outage: an agent that writes Ready while its Lease
        // is still stale is marked again, not announced again.
        if self.unavailable.contains(node) {
            return Ok(());
        }
        if let Some(tunnel) = self.stores.tunnels.get(&ObjectRef::new(node)) {
            self.event(
                &tunnel.object_ref(&()),
                EventType::Warning,
                "AgentHeartbeatTimeout",
                format!(
                    "the agent of node {node} has not renewed its Lease for {:.1} s; its EIPs move to other ready nodes",
                    self.agent_timeout.as_secs_f64()
                ),
                None,
            )
            .await;
        }
        Ok(())
    }

    /// Creates the `EgressTunnel` of `node`, owned by the Node of uid
    /// `owner`.
    async fn create_tunnel(&self, node: &str, owner: Option<&str>) -> anyhow::Result<()> {
        let api: Api<EgressTunnel> = Api::all(self.client.clone());
        let owners: Vec<serde_json::Value> = owner
            .map(|uid| {
                serde_json::json!({
                    "apiVersion": "v1", "kind": "Node", "name": node, "uid": uid,
                })
            })
            .into_iter()
            .collect();
        let body = serde_json::json!({
            "apiVersion": api_version(),
            "kind": "EgressTunnel",
            "metadata": { "name": node, "ownerReferences": owners },
            "spec": {},
        });
        let params = PatchParams::apply(MANAGER).force();
        self.metrics
            .api()
            .send(Verb::Patch, api.patch(node, &params, &Patch::Apply(&body)))
            .await
            .context("creating the EgressTunnel")?;
        Ok(())
    }

    /// Writes the controller's part of `node`'s tunnel status.
    async fn write_tunnel(
        &self,
        node: &str,
        status: &egressgw_api::EgressTunnelStatus,
    ) -> anyhow::Result<()> {
        self.apply_tunnel_status(node, MANAGER, status)
            .await
            .context("writing the tunnel identity")?;
        tracing::info!(node, "tunnel identity written");
        Ok(())
    }

    /// Applies `status` to `node`'s `EgressTunnel` under the field manager
    /// `manager`.
    async fn apply_tunnel_status(
        &self,
        node: &str,
        manager: &str,
        status: &impl Serialize,
    ) -> Result<(), kube::Error> {
        let api: Api<EgressTunnel> = Api::all(self.client.clone());
        let body = serde_json::json!({
            "apiVersion": api_version(),
            "kind": "EgressTunnel",
            "metadata": { "name": node },
            "status": status,
        });
        let params = PatchParams::apply(manager).force();
        self.metrics
            .api()
            .send(
                Verb::Patch,
                api.patch_status(node, &params, &Patch::Apply(&body)),
            )
            .await
            .map(drop)
    }

    /// An Event on each gateway and policy whose EIP changed node since
    /// the last status write.
    async fn report_moves(&self, snapshot: &Snapshot, status: &ClusterStatus) {
        for gateway in &snapshot.gateways {
            for (ip, old) in &gateway.previous_nodes {
                let Some(new) = status.eip_nodes.get(ip) else {
                    continue;
                };
                if new == old {
                    continue;
                }
                // The new holder's agent says how it got there (a takeover
                // in the data plane); otherwise the plan moved it.
                let reported = self.stores.tunnels.get(&ObjectRef::new(new)).and_then(|t| {
                    let eips = &t.status.as_ref()?.eips;
                    eips.iter()
                        .find(|e| e.ip == ip.to_string())
                        .and_then(|e| e.message.clone())
                });
                let why = match reported {
                    Some(message) => message,
                    None if snapshot.nodes.iter().any(|n| &n.name == old && !n.ready) => {
                        format!("{old} is not ready")
                    }
                    None => format!("{old} no longer carries it"),
                };
                let note = format!("EIP {ip} moved from node {old} to node {new} ({why})");
                self.metrics.eip_moved(&gateway.name);
                tracing::warn!("{note}");
                let related = self.tunnel_ref(new);
                if let Some(object) = self.stores.gateways.get(&ObjectRef::new(&gateway.name)) {
                    self.event(
                        &object.object_ref(&()),
                        EventType::Normal,
                        "EipMoved",
                        note.clone(),
                        related.clone(),
                    )
                    .await;
                }
                for policy in users_of(status, *ip) {
                    if let Some(reference) = self.policy_ref(&policy) {
                        self.event(
                            &reference,
                            EventType::Normal,
                            "EipMoved",
                            note.clone(),
                            related.clone(),
                        )
                        .await;
                    }
                }
            }
        }
    }

    /// An Event on the gateway and the policies concerned whenever an
    /// agent reports that its node's selected traffic has no live gateway
    /// node any more (Warning, saying whether it is dropped or leaves with
    /// the node's address) or has one again (Normal).
    async fn report_unreachable(&mut self, status: &ClusterStatus) {
        let mut now = BTreeMap::new();
        for tunnel in self.stores.tunnels.state() {
            let Some(node) = tunnel.metadata.name.clone() else {
                continue;
            };
            for u in tunnel.status.iter().flat_map(|s| &s.unreachable) {
                now.insert(
                    (node.clone(), u.gateway.clone(), u.eip.clone()),
                    u.fail_closed,
                );
            }
        }
        let mut notes = Vec::new();
        for (key @ (node, gateway, eip), fail_closed) in &now {
            if self.unreachable_reported.get(key) == Some(fail_closed) {
                continue;
            }
            let what = eip.as_ref().map_or_else(
                || "its useNodeIP traffic".to_owned(),
                |ip| format!("EIP {ip}"),
            );
            let outcome = if *fail_closed {
                "its selected traffic is dropped (failClosed)".to_owned()
            } else {
                format!(
                    "its selected traffic leaves with node {node}'s own address (failClosed: false)"
                )
            };
            let note =
                format!("node {node} reaches no gateway node of {gateway} for {what}: {outcome}");
            let reason = if *fail_closed {
                "FailingClosed"
            } else {
                "FailingOpen"
            };
            notes.push((EventType::Warning, reason, node, gateway, eip, note));
        }
        for (node, gateway, eip) in self.unreachable_reported.keys() {
            if now
                .keys()
                .any(|(n, g, e)| (n, g, e) == (node, gateway, eip))
            {
                continue;
            }
            let what = eip.as_ref().map_or_else(
                || "its useNodeIP traffic".to_owned(),
                |ip| format!("EIP {ip}"),
            );
            let note = format!("node {node} reaches a gateway node of {gateway} for {what} again");
            notes.push((
                EventType::Normal,
                "GatewayReachable",
                node,
                gateway,
                eip,
                note,
            ));
        }
        for (type_, reason, node, gateway, eip, note) in notes {
            let related = self.tunnel_ref(node);
            if type_ == EventType::Warning {
                tracing::warn!("{note}");
            } else {
                tracing::info!("{note}");
            }
            if let Some(object) = self.stores.gateways.get(&ObjectRef::new(gateway)) {
                self.event(
                    &object.object_ref(&()),
                    type_,
                    reason,
                    note.clone(),
                    related.clone(),
                )
                .await;
            }
            let Some(ip) = eip.as_ref().and_then(|ip| ip.parse::<IpAddr>().ok()) else {
                continue;
            };
            for policy in users_of(status, ip) {
                if let Some(reference) = self.policy_ref(&policy) {
                    self.event(&reference, type_, reason, note.clone(), related.clone())
                        .await;
                }
            }
        }
        self.unreachable_reported = now;
    }

    /// A Warning Event on each invalid policy, once per set of problems.
    async fn report_invalid(&mut self, snapshot: &Snapshot) {
        let mut seen = HashMap::new();
        for invalid in &snapshot.invalid {
            let key = (
                invalid.kind.clone(),
                invalid.namespace.clone(),
                invalid.name.clone(),
            );
            if self.invalid_reported.get(&key) != Some(&invalid.errors) {
                let id = PolicyRef {
                    namespace: invalid.namespace.clone(),
                    name: invalid.name.clone(),
                };
                let reference = match invalid.kind.as_str() {
                    "EgressPolicy" | "EgressClusterPolicy" => self.policy_ref(&id),
                    _ => None,
                };
                tracing::warn!(kind = invalid.kind, name = %describe(&id), errors = invalid.errors.join("; "), "invalid object ignored");
                if let Some(reference) = reference {
                    self.event(
                        &reference,
                        EventType::Warning,
                        "InvalidPolicy",
                        format!(
                            "ignored, its traffic is not steered: {}",
                            invalid.errors.join("; ")
                        ),
                        None,
                    )
                    .await;
                }
            }
            seen.insert(key, invalid.errors.clone());
        }
        self.invalid_reported = seen;
    }

    /// The `EgressTunnel` of `node`, as an Event's related object.
    fn tunnel_ref(&self, node: &str) -> Option<ObjectReference> {
        self.stores
            .tunnels
            .get(&ObjectRef::new(node))
            .map(|t| t.object_ref(&()))
    }

    fn policy_ref(&self, id: &PolicyRef) -> Option<ObjectReference> {
        match &id.namespace {
            Some(ns) => self
                .stores
                .policies
                .get(&ObjectRef::new(&id.name).within(ns))
                .map(|p| p.object_ref(&())),
            None => self
                .stores
                .cluster_policies
                .get(&ObjectRef::new(&id.name))
                .map(|p| p.object_ref(&())),
        }
    }

    /// Publishes an Event. Events of the same type, reason and objects are
    /// counted as a series of the first (the recorder's rule), so `related`
    /// names the node an Event is about: each node's gets a series of its own.
    async fn event(
        &self,
        reference: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
        related: Option<ObjectReference>,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: related,
        };
        let published =
            tokio::time::timeout(REQUEST_TIMEOUT, self.recorder.publish(&event, reference));
        match published.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(reason, error = %e, "cannot record an Event"),
            Err(_) => tracing::warn!(
                reason,
                "cannot record an Event: the API server did not answer within {} s",
                REQUEST_TIMEOUT.as_secs()
            ),
        }
    }
}

/// The policies using `ip`.
/// What a gateway's stored slices are, in short: its uid, and the name
/// and version of each slice of it. Equal fingerprints mean the same
/// stored slices.
fn slices_fingerprint(uid: &str, gateway: &str, slices: &[Arc<WatchedSlice>]) -> u64 {
    let mut held: Vec<(String, &str)> = slices
        .iter()
        .filter(|s| s.spec.gateway == gateway)
        .map(|s| {
            let version = s.metadata.resource_version.as_deref().unwrap_or_default();
            (s.name_any(), version)
        })
        .collect();
    held.sort_unstable();
    let mut bytes = uid.as_bytes().to_vec();
    for (name, version) in held {
        bytes.extend_from_slice(b"\0");
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(b"\0");
        bytes.extend_from_slice(version.as_bytes());
    }
    egressgw_core::stable_hash(&bytes)
}

fn users_of(status: &ClusterStatus, ip: IpAddr) -> Vec<PolicyRef> {
    status
        .gateways
        .iter()
        .flat_map(|g| &g.nodes)
        .flat_map(|n| &n.eips)
        .filter(|e| e.ip == Some(ip))
        .flat_map(|e| e.policies.clone())
        .collect()
}

fn describe(id: &PolicyRef) -> String {
    match &id.namespace {
        Some(ns) => format!("{ns}/{}", id.name),
        None => id.name.clone(),
    }
}

fn api_version() -> String {
    format!("{}/{}", egressgw_api::GROUP, egressgw_api::VERSION)
}

/// Applies `new` as the status of `K` `name` unless it equals `current`.
async fn apply_status<K, S>(
    client: &Client,
    requests: &ApiRequests,
    namespace: Option<&str>,
    name: &str,
    current: Option<&S>,
    new: &S,
) -> anyhow::Result<()>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: Serialize + PartialEq,
{
    if current == Some(new) {
        return Ok(());
    }
    let resource = ApiResource::erase::<K>(&());
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let mut metadata = serde_json::json!({ "name": name });
    if let Some(ns) = namespace {
        metadata["namespace"] = ns.into();
    }
    let body = serde_json::json!({
        "apiVersion": api_version(),
        "kind": K::kind(&()),
        "metadata": metadata,
        "status": new,
    });
    let params = PatchParams::apply(MANAGER).force();
    requests
        .send(
            Verb::Patch,
            api.patch_status(name, &params, &Patch::Apply(&body)),
        )
        .await
        .with_context(|| format!("applying {} {name} status", K::kind(&())))?;
    tracing::info!(kind = %K::kind(&()), namespace, name, "status written");
    Ok(())
}

/// What an allocation hands out: the `kind` of `egressgw_allocations_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Allocation {
    /// A policy's EIP, from its gateway's pool.
    Eip,
    /// A node's tunnel address, MAC or mark.
    Tunnel,
    /// The node an EIP is active on.
    GatewayNode,
}

impl Allocation {
    pub const ALL: [Self; 3] = [Self::Eip, Self::Tunnel, Self::GatewayNode];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Eip => "eip",
            Self::Tunnel => "tunnel",
            Self::GatewayNode => "gateway_node",
        }
    }
}

/// How an allocation went: the `result` of `egressgw_allocations_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AllocationResult {
    /// Something new was handed out.
    Ok,
    /// Nothing was left: the pool, the tunnel subnet or the marks are all
    /// taken, or no ready node can carry the EIP.
    Exhausted,
    /// What was asked for is another's: an EIP pinned by another namespace,
    /// a gateway's default EIP, an address of the cluster's own, or one
    /// another host on the segment answers for.
    Conflict,
}

impl AllocationResult {
    pub const ALL: [Self; 3] = [Self::Ok, Self::Exhausted, Self::Conflict];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Exhausted => "exhausted",
            Self::Conflict => "conflict",
        }
    }
}

/// One value of a node's tunnel identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum TunnelValue {
    Ipv4(Ipv4Addr),
    Ipv6(Ipv6Addr),
    Mac(Mac),
    Mark(u32),
}

/// What the controller has allocated, as a plan leaves it or as the
/// stored objects record it, and the allocations that failed. Between two
/// of them, what is new in the later is what its plan allocated.
#[derive(Debug, Default, PartialEq, Eq)]
struct Allocations {
    /// Each policy's EIPs (those reserved for a policy that cannot be
    /// served included).
    eips: BTreeSet<(PolicyRef, IpAddr)>,
    /// Each node's tunnel identity, value by value.
    tunnels: BTreeSet<(String, TunnelValue)>,
    /// The node each EIP is active on.
    gateway_nodes: BTreeSet<(IpAddr, String)>,
    /// What failed to be allocated, for which object (a policy, or a node
    /// and the value it lacks), and why.
    failed: BTreeSet<(Allocation, String, AllocationResult)>,
}

impl Allocations {
    /// What the stored objects record. Failures are not recorded there in
    /// a form to compare: the first plan counts those it finds.
    fn recorded(snapshot: &Snapshot) -> Self {
        let eips = snapshot
            .policies
            .iter()
            .flat_map(|p| p.previous_eips.iter().map(|ip| (p.id.clone(), *ip)))
            .collect();
        let tunnels = snapshot
            .tunnels
            .iter()
            .flat_map(|t| {
                let values = [
                    t.ipv4.map(TunnelValue::Ipv4),
                    t.ipv6.map(TunnelValue::Ipv6),
                    t.mac.map(TunnelValue::Mac),
                    t.mark.map(TunnelValue::Mark),
                ];
                values.into_iter().flatten().map(|v| (t.node.clone(), v))
            })
            .collect();
        let gateway_nodes = snapshot
            .gateways
            .iter()
            .flat_map(|g| &g.previous_nodes)
            .map(|(ip, node)| (*ip, node.clone()))
            .collect();
        Self {
            eips,
            tunnels,
            gateway_nodes,
            failed: BTreeSet::new(),
        }
    }

    /// What `status` allocates, and what it could not (by the conditions
    /// it gives the policies, and the tunnel identities it leaves
    /// incomplete with `config`'s families).
    fn planned(status: &ClusterStatus, config: &Config) -> Self {
        let mut eips = BTreeSet::new();
        let mut failed = BTreeSet::new();
        for p in &status.policies {
            let ips = [p.eip_ipv4.map(IpAddr::V4), p.eip_ipv6.map(IpAddr::V6)];
            eips.extend(ips.into_iter().flatten().map(|ip| (p.policy.clone(), ip)));
            for c in p.conditions.iter().filter(|c| !c.status) {
                let failure = match (c.type_, c.reason) {
                    (ConditionType::Allocated, Reason::PoolExhausted) => {
                        (Allocation::Eip, AllocationResult::Exhausted)
                    }
                    (ConditionType::Allocated, Reason::EipTaken | Reason::EipInCluster) => {
                        (Allocation::Eip, AllocationResult::Conflict)
                    }
                    (ConditionType::Ready, Reason::NoReadyNode) => {
                        (Allocation::GatewayNode, AllocationResult::Exhausted)
                    }
                    (ConditionType::Ready, Reason::EipInUse) => {
                        (Allocation::GatewayNode, AllocationResult::Conflict)
                    }
                    _ => continue,
                };
                failed.insert((failure.0, describe(&p.policy), failure.1));
            }
        }
        // Nodes a usable gateway selects: each needs a mark.
        let marked: BTreeSet<&str> = status
            .gateways
            .iter()
            .filter(|g| {
                !g.conditions.iter().any(|c| {
                    c.type_ == ConditionType::Ready
                        && matches!(c.reason, Reason::Invalid | Reason::PoolOverlap)
                })
            })
            .flat_map(|g| g.nodes.iter().map(|n| n.name.as_str()))
            .collect();
        let mut tunnels = BTreeSet::new();
        for t in &status.tunnels {
            let values = [
                (config.enable_ipv4, "ipv4", t.ipv4.map(TunnelValue::Ipv4)),
                (config.enable_ipv6, "ipv6", t.ipv6.map(TunnelValue::Ipv6)),
                (true, "mac", Some(TunnelValue::Mac(t.mac))),
                (
                    marked.contains(t.node.as_str()),
                    "mark",
                    t.mark.map(TunnelValue::Mark),
                ),
            ];
            for (wanted, what, value) in values {
                match value {
                    Some(value) => {
                        tunnels.insert((t.node.clone(), value));
                    }
                    None if wanted => {
                        let object = format!("{} {what}", t.node);
                        failed.insert((Allocation::Tunnel, object, AllocationResult::Exhausted));
                    }
                    None => {}
                }
            }
        }
        let gateway_nodes = status
            .eip_nodes
            .iter()
            .map(|(ip, node)| (*ip, node.clone()))
            .collect();
        Self {
            eips,
            tunnels,
            gateway_nodes,
            failed,
        }
    }

    /// How many allocations of each kind and result `self` has that
    /// `before` had not: every new allocation once, every failure once
    /// while it lasts.
    fn since(&self, before: &Self) -> BTreeMap<(Allocation, AllocationResult), u64> {
        fn new<T: Ord>(now: &BTreeSet<T>, before: &BTreeSet<T>) -> u64 {
            u64::try_from(now.difference(before).count()).unwrap_or(u64::MAX)
        }
        let mut counts = BTreeMap::new();
        for (kind, n) in [
            (Allocation::Eip, new(&self.eips, &before.eips)),
            (Allocation::Tunnel, new(&self.tunnels, &before.tunnels)),
            (
                Allocation::GatewayNode,
                new(&self.gateway_nodes, &before.gateway_nodes),
            ),
        ] {
            if n > 0 {
                counts.insert((kind, AllocationResult::Ok), n);
            }
        }
        for (kind, _, result) in self.failed.difference(&before.failed) {
            *counts.entry((*kind, *result)).or_default() += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use egressgw_core::model::Tunnel;
    use egressgw_core::status::{Condition, GatewayNodeStatus, GatewayStatus, TunnelAllocation};

    use super::*;
    use Allocation::{Eip, GatewayNode};
    use AllocationResult::{Conflict, Exhausted};

    /// Two nodes, n1 selected by gw1; gw1's pool holds its default EIP and
    /// one more, and two `rr` policies want an EIP of their own each.
    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1, labels: {egress: "true"}}
status:
  addresses: [{type: InternalIP, address: 192.168.1.11}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Node
metadata: {name: n2}
status:
  addresses: [{type: InternalIP, address: 192.168.1.12}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata: {name: gw1}
spec:
  nodeSelector: {selector: {matchLabels: {egress: "true"}}}
  ippools: {ipv4: [10.6.1.1-10.6.1.2]}
  clusterDefault: true
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: p1, namespace: shop}
spec:
  appliedTo: {podSelector: {matchLabels: {app: web}}}
  egressIP: {allocatorPolicy: rr}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: p2, namespace: shop}
spec:
  appliedTo: {podSelector: {matchLabels: {app: job}}}
  egressIP: {allocatorPolicy: rr}
"#;

    fn snapshot() -> Snapshot {
        egressgw_api::objects_from_yaml(CLUSTER)
            .unwrap()
            .into_snapshot(Config::default())
    }

    /// `snapshot` as the objects read once `status` is written.
    fn written(mut snapshot: Snapshot, status: &ClusterStatus) -> Snapshot {
        for p in snapshot.policies_mut() {
            let s = status.policies.iter().find(|s| s.policy == p.id).unwrap();
            p.previous_eips = [s.eip_ipv4.map(IpAddr::V4), s.eip_ipv6.map(IpAddr::V6)]
                .into_iter()
                .flatten()
                .collect();
        }
        for g in &mut snapshot.gateways {
            g.previous_nodes.clone_from(&status.eip_nodes);
        }
        snapshot.tunnels = status
            .tunnels
            .iter()
            .map(|t| Tunnel {
                node: t.node.clone(),
                ipv4: t.ipv4,
                ipv6: t.ipv6,
                mac: Some(t.mac),
                mark: t.mark,
            })
            .collect();
        snapshot
    }

    fn counts<const N: usize>(
        list: [(Allocation, AllocationResult, u64); N],
    ) -> BTreeMap<(Allocation, AllocationResult), u64> {
        list.into_iter()
            .map(|(kind, result, n)| ((kind, result), n))
            .collect()
    }

    #[test]
    fn a_plan_counts_what_it_allocates_anew_and_each_failure_once() {
        let snapshot = snapshot();
        let config = &snapshot.config;
        let first = Allocations::planned(&egressgw_core::plan(&snapshot).status, config);
        assert_eq!(
            first.since(&Allocations::recorded(&snapshot)),
            counts([
                // One policy gets the second address; the other finds none.
                (Eip, AllocationResult::Ok, 1),
                (Eip, Exhausted, 1),
                // n1: address, MAC, mark; n2 (no gateway's): address, MAC.
                (Allocation::Tunnel, AllocationResult::Ok, 5),
                (GatewayNode, AllocationResult::Ok, 1),
            ])
        );
        let again = Allocations::planned(&egressgw_core::plan(&snapshot).status, config);
        assert_eq!(again.since(&first), counts([]));
    }

    #[test]
    fn a_new_leader_counts_only_the_failures_of_what_the_stored_objects_record() {
        let snapshot = snapshot();
        let stored = written(snapshot.clone(), &egressgw_core::plan(&snapshot).status);
        let now = Allocations::planned(&egressgw_core::plan(&stored).status, &stored.config);
        assert_eq!(
            now.since(&Allocations::recorded(&stored)),
            counts([(Eip, Exhausted, 1)])
        );
    }

    #[test]
    fn a_moved_eip_is_a_new_gateway_node_and_an_eip_in_use_a_conflict() {
        let snapshot = snapshot();
        let config = &snapshot.config;
        let mut status = egressgw_core::plan(&snapshot).status;
        let before = Allocations::planned(&status, config);
        for node in status.eip_nodes.values_mut() {
            "n2".clone_into(node);
        }
        let served = status
            .policies
            .iter_mut()
            .find(|p| p.eip_ipv4.is_some())
            .unwrap();
        served.conditions[1] = Condition {
            type_: ConditionType::Ready,
            status: false,
            reason: Reason::EipInUse,
            message: String::new(),
        };
        assert_eq!(
            Allocations::planned(&status, config).since(&before),
            counts([
                (GatewayNode, AllocationResult::Ok, 1),
                (GatewayNode, Conflict, 1)
            ])
        );
    }

    #[test]
    fn a_tunnel_short_of_an_address_or_a_usable_gateways_node_short_of_a_mark_is_exhausted() {
        let tunnel = |node: &str, ipv4: Option<Ipv4Addr>| TunnelAllocation {
            node: node.into(),
            ipv4,
            ipv6: None,
            mac: Mac([2, 0, 0, 0, 0, 1]),
            mark: None,
            underlay: None,
        };
        let gateway = |name: &str, node: &str, reason: Reason| GatewayStatus {
            gateway: name.into(),
            nodes: vec![GatewayNodeStatus {
                name: node.into(),
                ready: false,
                eips: Vec::new(),
            }],
            ip_usage: Default::default(),
            conditions: vec![Condition {
                type_: ConditionType::Ready,
                status: false,
                reason,
                message: String::new(),
            }],
        };
        let status = ClusterStatus {
            tunnels: vec![
                tunnel("n1", Some(Ipv4Addr::new(100, 64, 0, 2))),
                tunnel("n2", None),
                tunnel("n3", Some(Ipv4Addr::new(100, 64, 0, 3))),
            ],
            gateways: vec![
                gateway("usable", "n1", Reason::NoReadyNode),
                gateway("invalid", "n3", Reason::Invalid),
            ],
            ..ClusterStatus::default()
        };
        let allocations = Allocations::planned(&status, &Config::default());
        let failed: Vec<&str> = allocations
            .failed
            .iter()
            .map(|(_, object, _)| object.as_str())
            .collect();
        assert_eq!(failed, ["n1 mark", "n2 ipv4"]);
        assert_eq!(
            allocations.since(&Allocations::default())[&(Allocation::Tunnel, Exhausted)],
            2
        );
    }
}

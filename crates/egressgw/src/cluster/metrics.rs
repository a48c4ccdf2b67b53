//! What the daemons export on `/metrics`, each registered here with its
//! help text (docs/operations.md is the reference). Names follow
//! Prometheus' conventions: the `egressgw_` prefix, base units, counters
//! ending in `_total` (the encoder adds it). No label carries a pod's
//! address: every label's values are bounded by the cluster's objects.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egressgw_core::PodScope;
use egressgw_core::model::PolicyRef;
use egressgw_core::status::{ClusterStatus, Condition, ConditionType};
use egressgw_dataplane::ops::{OpKind, Report};
use egressgw_dataplane::probe::Seen;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::controller::{Allocation, AllocationResult};
use crate::failover::{Outcome, Release, Takeover};
use crate::writes::Urgency;

/// A label set of one label.
type Label = [(&'static str, &'static str); 1];
/// A label set of two labels.
type Labels2 = [(&'static str, &'static str); 2];

/// Buckets of the failover times: about the default detection time
/// (300 ms) finely, up to probe settings a hundred times slower.
const FAILOVER_BUCKETS: [f64; 14] = [
    0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
];

/// An agent's metrics.
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    reconcile_seconds: Histogram,
    reconciles: Family<Label, Counter>,
    ops: Family<Labels2, Counter>,
    last_success: Gauge<f64, AtomicU64>,
    eips: Gauge,
    peer_up: Family<[(&'static str, String); 1], Gauge>,
    peer_last_answer: Family<[(&'static str, String); 1], Gauge<f64, AtomicU64>>,
    peer_round_trip: Family<[(&'static str, String); 1], Gauge<f64, AtomicU64>>,
    traffic: Arc<PolicyTraffic>,
    takeovers: Family<Label, Counter>,
    releases: Family<Label, Counter>,
    detection_seconds: Histogram,
    recovery_seconds: Histogram,
    gateway_unreachable: Family<[(&'static str, String); 1], Gauge>,
    watched_pods: Family<Label, Gauge>,
    fast_path_connections: Gauge,
    fast_path_learned: Family<Label, Counter>,
    tunnel_end_packets: Family<Label, Counter>,
    tunnel_end_bytes: Family<Label, Counter>,
    plans: Counter,
    api: ApiRequests,
}

/// The `way` labels of the tunnel end's counters.
const TUNNEL_END_WAYS: [&str; 2] = ["to_pods", "out"];

/// What a policy's selected pods on this node sent through its gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyCount {
    /// The policy's EgressGateway.
    pub gateway: String,
    /// Packets.
    pub packets: u64,
    /// Bytes (whole frames).
    pub bytes: u64,
}

impl AgentMetrics {
    /// The agent's metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            // 1 ms to about 16 s.
            reconcile_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 15),
            ),
            reconciles: Family::default(),
            ops: Family::default(),
            last_success: Gauge::default(),
            eips: Gauge::default(),
            peer_up: Family::default(),
            peer_last_answer: Family::default(),
            peer_round_trip: Family::default(),
            traffic: Arc::default(),
            takeovers: Family::default(),
            releases: Family::default(),
            detection_seconds: Histogram::new(FAILOVER_BUCKETS),
            recovery_seconds: Histogram::new(FAILOVER_BUCKETS),
            gateway_unreachable: Family::default(),
            watched_pods: Family::default(),
            fast_path_connections: Gauge::default(),
            fast_path_learned: Family::default(),
            tunnel_end_packets: Family::default(),
            tunnel_end_bytes: Family::default(),
            plans: Counter::default(),
            api: ApiRequests::register(registry),
        };
        // Rare events start at 0, so that the first one is an increase.
        for reason in Takeover::ALL {
            metrics
                .takeovers
                .get_or_create(&[("reason", reason.as_str())])
                .inc_by(0);
        }
        for reason in Release::ALL {
            metrics
                .releases
                .get_or_create(&[("reason", reason.as_str())])
                .inc_by(0);
        }
        // So are reconciles and their operations: a restarted agent's
        // rates start from its first scrape, not from its first change.
        for result in ["taken", "left"] {
            metrics
                .fast_path_learned
                .get_or_create(&[("result", result)])
                .inc_by(0);
        }
        for way in TUNNEL_END_WAYS {
            for family in [&metrics.tunnel_end_packets, &metrics.tunnel_end_bytes] {
                family.get_or_create(&[("way", way)]).inc_by(0);
            }
        }
        for result in ["ok", "failed"] {
            metrics
                .reconciles
                .get_or_create(&[("result", result)])
                .inc_by(0);
        }
        for kind in OpKind::ALL {
            for result in ["applied", "failed"] {
                metrics
                    .ops
                    .get_or_create(&[("kind", kind.as_str()), ("result", result)])
                    .inc_by(0);
            }
        }
        registry.register(
            "egressgw_reconcile_duration_seconds",
            "Time a reconcile of this node's kernel state took (read back, plan, apply)",
            metrics.reconcile_seconds.clone(),
        );
        registry.register(
            "egressgw_reconciles",
            "Reconciles of this node's kernel state, by result (ok: every operation \
             applied; failed: at least one failed)",
            metrics.reconciles.clone(),
        );
        registry.register(
            "egressgw_reconcile_operations",
            "Kernel operations reconciles carried out, by kind (link, address, neighbour, \
             fdb, route, rule, sysctl, offload, eip, table, chain, set, element, program, \
             map, conntrack, read) and result (applied, failed)",
            metrics.ops.clone(),
        );
        registry.register(
            "egressgw_reconcile_last_success_timestamp_seconds",
            "When the last reconcile that applied every operation ended (Unix time)",
            metrics.last_success.clone(),
        );
        registry.register(
            "egressgw_eips_held",
            "Egress IPs this node holds: SNATs to and announces on its network",
            metrics.eips.clone(),
        );
        registry.register(
            "egressgw_peer_up",
            "1 while the peer node answers this node's probes through the tunnel, 0 once \
             it counts as dead, by peer node; only peers this node probes (gateway \
             candidates of its traffic, holders of its EIPs)",
            metrics.peer_up.clone(),
        );
        registry.register(
            "egressgw_peer_last_answer_age_seconds",
            "Time since the peer node last answered a probe through the tunnel, by peer \
             node (absent until it first answers)",
            metrics.peer_last_answer.clone(),
        );
        registry.register(
            "egressgw_peer_round_trip_seconds",
            "Round trip of the last probe the peer node answered through the tunnel, by \
             peer node (absent until it first answers)",
            metrics.peer_round_trip.clone(),
        );
        registry.register(
            "egressgw_eip_takeovers",
            "EIPs this node took, by reason (planned: the plan makes it the EIP's active \
             node; failover: every candidate before it stopped answering through the tunnel)",
            metrics.takeovers.clone(),
        );
        registry.register(
            "egressgw_eip_releases",
            "EIPs this node gave up, by reason (planned: the plan took it off the EIP; \
             quorum_lost: it reaches fewer than half of the nodes)",
            metrics.releases.clone(),
        );
        registry.register(
            "egressgw_failover_detection_seconds",
            "For traffic of this node's selected pods, time from the last answer of the \
             node carrying it to the moment this node sent it elsewhere (or found no live \
             candidate), once that node stopped answering",
            metrics.detection_seconds.clone(),
        );
        registry.register(
            "egressgw_failover_recovery_seconds",
            "For each failover this node carried out (its selected traffic sent from a node \
             that stopped answering to a live one, an EIP taken over from such a node): time \
             from that node's last answer to the end of the reconcile that put the new path \
             in the kernel",
            metrics.recovery_seconds.clone(),
        );
        registry.register(
            "egressgw_gateway_unreachable",
            "1 while an EgressGateway this node sends selected traffic to has an EIP (or \
             useNodeIP policy) with no candidate node answering through the tunnel, 0 \
             otherwise, by gateway; only gateways this node sends traffic to",
            metrics.gateway_unreachable.clone(),
        );
        registry.register(
            "egressgw_watched_pods",
            "Pods this agent watches and plans from, by scope (node: the Pods on this node, \
             while no EgressGateway selects it; gateways: those and the Pods the controller \
             publishes for the EgressGateways selecting it; cluster: every Pod, while one \
             selects it and no controller publishes them); the other scopes are 0",
            metrics.watched_pods.clone(),
        );
        registry.register(
            "egressgw_gateway_fast_path_connections",
            "Connections the gateway's eBPF fast path translates on this node past its \
             stack, as its last sweep (every 30 s) counted them and those taken over since \
             (0 where it is off)",
            metrics.fast_path_connections.clone(),
        );
        registry.register(
            "egressgw_gateway_fast_path_learned",
            "Connections through this gateway node that its eBPF fast path saw conntrack \
             translate, by result (taken: it translates them from then on; left: they stay \
             on the stack: conntrack held them translated otherwise, not to one of the \
             node's EIPs any more, or a step failed)",
            metrics.fast_path_learned.clone(),
        );
        registry.register(
            "egressgw_tunnel_end_packets",
            "Packets this node's eBPF tunnel end took out of the tunnel on the underlay \
             interface, past the node's stack and the tunnel device, by way (to_pods: replies \
             handed to their pod; out: pods' packets translated and sent out on a gateway \
             node); counted since the pinned maps were created, 0 where it was never on",
            metrics.tunnel_end_packets.clone(),
        );
        registry.register(
            "egressgw_tunnel_end_bytes",
            "Bytes of those packets as they went on (the inner packet and an Ethernet \
             header), by way",
            metrics.tunnel_end_bytes.clone(),
        );
        registry.register(
            "egressgw_plans",
            "Times this agent planned its node from the objects it watches: once per change \
             of them (a burst of changes is one), not at the resync that reconciles the \
             kernel every 30 s",
            metrics.plans.clone(),
        );
        registry.register_collector(Box::new(Arc::clone(&metrics.traffic)));
        metrics
    }

    /// What the gateway's fast path holds now (`held`) and learned since
    /// the agent started (`taken`, `left`).
    pub fn gateway_fast_path(&self, held: u64, taken: u64, left: u64) {
        self.fast_path_connections
            .set(i64::try_from(held).unwrap_or(i64::MAX));
        for (result, total) in [("taken", taken), ("left", left)] {
            let counter = self.fast_path_learned.get_or_create(&[("result", result)]);
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// What the eBPF tunnel end took out of the tunnel in all, per way
    /// ([`TUNNEL_END_WAYS`]: to pods, out): packets and bytes.
    pub fn tunnel_end(&self, totals: [(u64, u64); 2]) {
        for (way, (packets, bytes)) in TUNNEL_END_WAYS.into_iter().zip(totals) {
            for (family, total) in [
                (&self.tunnel_end_packets, packets),
                (&self.tunnel_end_bytes, bytes),
            ] {
                let counter = family.get_or_create(&[("way", way)]);
                counter.inc_by(total.saturating_sub(counter.get()));
            }
        }
    }

    /// The agent planned its node from the stores once more.
    pub fn planned(&self) {
        self.plans.inc();
    }

    /// The agent planned from `count` Pods of `scope`.
    pub fn watched_pods(&self, scope: PodScope, count: usize) {
        for s in [PodScope::Node, PodScope::Gateways, PodScope::Cluster] {
            let n = if s == scope { count } else { 0 };
            self.watched_pods
                .get_or_create(&[("scope", s.as_str())])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Counts the agent's requests to the API server.
    pub fn api(&self) -> &ApiRequests {
        &self.api
    }

    /// A failover this node carried out is in the kernel, `took` after the
    /// silent node's last answer.
    pub fn recovered(&self, took: Duration) {
        self.recovery_seconds.observe(took.as_secs_f64());
    }

    /// Records what a resolve decided: EIPs taken and given up, failovers
    /// detected, and which gateways in use have no live candidate
    /// (gateways no longer in use are dropped).
    pub fn resolved(&self, outcome: &Outcome) {
        for (_, reason) in &outcome.taken {
            self.takeovers
                .get_or_create(&[("reason", reason.as_str())])
                .inc();
        }
        for (_, reason) in &outcome.released {
            self.releases
                .get_or_create(&[("reason", reason.as_str())])
                .inc();
        }
        for took in &outcome.detected {
            self.detection_seconds.observe(took.as_secs_f64());
        }
        self.gateway_unreachable.clear();
        for (gateway, unreachable) in &outcome.gateways {
            self.gateway_unreachable
                .get_or_create(&[("gateway", gateway.clone())])
                .set(i64::from(*unreachable));
        }
    }

    /// Records what the probes see: the peers probed, each with the time
    /// since its last answer (`None`: never), and the live ones. Peers no
    /// longer probed are dropped.
    pub fn probed(
        &self,
        peers: &BTreeMap<String, Seen>,
        live: &std::collections::BTreeSet<String>,
    ) {
        self.peer_up.clear();
        self.peer_last_answer.clear();
        self.peer_round_trip.clear();
        for (peer, seen) in peers {
            let labels = [("peer", peer.clone())];
            self.peer_up
                .get_or_create(&labels)
                .set(i64::from(live.contains(peer)));
            if let Some(age) = seen.last_answer {
                self.peer_last_answer
                    .get_or_create(&labels)
                    .set(age.as_secs_f64());
            }
            if let Some(rtt) = seen.round_trip {
                self.peer_round_trip
                    .get_or_create(&labels)
                    .set(rtt.as_secs_f64());
            }
        }
    }

    /// Records one reconcile: its report, how long it took and how many
    /// EIPs the node holds after it.
    pub fn reconciled(&self, report: &Report, took: Duration, eips: usize) {
        self.reconcile_seconds.observe(took.as_secs_f64());
        let result = if report.is_ok() { "ok" } else { "failed" };
        self.reconciles.get_or_create(&[("result", result)]).inc();
        for (kind, (applied, failed)) in report.by_kind() {
            for (result, n) in [("applied", applied), ("failed", failed)] {
                self.ops
                    .get_or_create(&[("kind", kind.as_str()), ("result", result)])
                    .inc_by(n);
            }
        }
        if report.is_ok() {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            self.last_success.set(now.as_secs_f64());
        }
        self.eips.set(i64::try_from(eips).unwrap_or(i64::MAX));
    }

    /// Each policy's packets and bytes as the classifier counted them
    /// (read at the end of a reconcile): what `/metrics` shows until the
    /// next.
    pub fn set_traffic(&self, traffic: BTreeMap<PolicyRef, PolicyCount>) {
        *self
            .traffic
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = traffic;
    }
}

/// Which of (packets, bytes) a family shows.
type Pick = fn(&PolicyCount) -> u64;

/// Per policy, the packets and bytes the eBPF classifier sent through a
/// gateway from this node: counters the kernel keeps, exported as they
/// were last read.
#[derive(Debug, Default)]
struct PolicyTraffic(Mutex<BTreeMap<PolicyRef, PolicyCount>>);

impl Collector for PolicyTraffic {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let traffic = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let families: [(&str, &str, Pick); 2] = [
            (
                "egressgw_policy_packets",
                "Packets of the policy's selected pods that this node sent through \
                 a gateway (eBPF datapath), by the policy's namespace (empty for an \
                 EgressClusterPolicy), name and EgressGateway.",
                |c| c.packets,
            ),
            (
                "egressgw_policy_bytes",
                "Bytes (whole frames) of the policy's selected pods that this node \
                 sent through a gateway (eBPF datapath).",
                |c| c.bytes,
            ),
        ];
        for (name, help, pick) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (policy, counts) in &traffic {
                let labels = [
                    ("namespace", policy.namespace.as_deref().unwrap_or("")),
                    ("policy", policy.name.as_str()),
                    ("gateway", counts.gateway.as_str()),
                ];
                ConstCounter::new(pick(counts)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// What a request to the API server does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Get,
    Create,
    Update,
    Patch,
    Delete,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Create => "create",
            Self::Update => "update",
            Self::Patch => "patch",
            Self::Delete => "delete",
        }
    }
}

/// Counts the requests a daemon sends to the API server (its writes and
/// the reads they depend on; not its watches), by verb and outcome.
/// Clones count into the same series.
#[derive(Debug, Clone)]
pub struct ApiRequests {
    requests: Family<Labels2, Counter>,
    errors: Family<[(&'static str, String); 2], Counter>,
}

impl ApiRequests {
    fn register(registry: &mut Registry) -> Self {
        let api = Self {
            requests: Family::default(),
            errors: Family::default(),
        };
        registry.register(
            "egressgw_api_requests",
            "Requests this daemon sent to the API server (writes, and the reads they \
             depend on; not its watches), by verb (get, create, update, patch) and result \
             (ok, error)",
            api.requests.clone(),
        );
        registry.register(
            "egressgw_api_errors",
            "Requests to the API server that failed, by verb and code: the HTTP status \
             the API server answered, or timeout, transport (no answer: connection, TLS, \
             authentication), decode (an answer that does not parse), other",
            api.errors.clone(),
        );
        api
    }

    /// Sends `request` and counts it when it completes. One without an
    /// answer within [`REQUEST_TIMEOUT`] fails, and one dropped before it
    /// completes (its caller's own timeout ran out) counts as failed too,
    /// both with the code `timeout`: the client's read timeout is the
    /// watches' (minutes), and a daemon must not wait that long on a write.
    pub async fn send<T>(
        &self,
        verb: Verb,
        request: impl Future<Output = kube::Result<T>>,
    ) -> kube::Result<T> {
        self.send_within(REQUEST_TIMEOUT, verb, request).await
    }

    /// [`ApiRequests::send`] with `limit` for the answer.
    async fn send_within<T>(
        &self,
        limit: Duration,
        verb: Verb,
        request: impl Future<Output = kube::Result<T>>,
    ) -> kube::Result<T> {
        let mut unfinished = Unfinished(Some((self, verb)));
        let result = tokio::time::timeout(limit, request)
            .await
            .unwrap_or_else(|_| Err(no_answer()));
        unfinished.0 = None;
        self.count(verb, result.as_ref().err().map(error_code));
        result
    }

    /// Counts one request; `error` is the code of its failure.
    fn count(&self, verb: Verb, error: Option<String>) {
        let result = if error.is_some() { "error" } else { "ok" };
        self.requests
            .get_or_create(&[("verb", verb.as_str()), ("result", result)])
            .inc();
        if let Some(code) = error {
            self.errors
                .get_or_create(&[("verb", verb.as_str().to_owned()), ("code", code)])
                .inc();
        }
    }
}

/// How long a request to the API server (not a watch) may go unanswered.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The error of a request that got no answer in time.
fn no_answer() -> kube::Error {
    kube::Error::Service(Box::new(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "the API server did not answer within {} s",
            REQUEST_TIMEOUT.as_secs()
        ),
    )))
}

/// Counts a request as timed out unless it is defused (set to `None`)
/// before it drops.
struct Unfinished<'a>(Option<(&'a ApiRequests, Verb)>);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some((api, verb)) = self.0.take() {
            api.count(verb, Some("timeout".to_owned()));
        }
    }
}

/// The `code` label of a failed request.
fn error_code(error: &kube::Error) -> String {
    use kube::Error as E;
    let timed_out = std::iter::successors(Some(error as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut)
    });
    let code = match error {
        E::Api(status) => return status.code.to_string(),
        _ if timed_out => "timeout",
        E::HyperError(_)
        | E::Service(_)
        | E::HttpError(_)
        | E::ReadEvents(_)
        | E::RustlsTls(_)
        | E::TlsRequired
        | E::Auth(_)
        | E::ProxyProtocolUnsupported { .. }
        | E::ProxyProtocolDisabled { .. } => "transport",
        E::SerdeError(_) | E::FromUtf8(_) | E::LinesCodecMaxLineLengthExceeded => "decode",
        _ => "other",
    };
    code.to_owned()
}

/// An object's `Ready` condition as the `condition` label says it.
fn ready_label(ready: Option<bool>) -> &'static str {
    match ready {
        Some(true) => "true",
        Some(false) => "false",
        None => "unknown",
    }
}

/// The kinds `egressgw_objects` counts.
const OBJECT_KINDS: [&str; 4] = [
    "EgressGateway",
    "EgressPolicy",
    "EgressClusterPolicy",
    "EgressTunnel",
];

/// The controller's metrics.
#[derive(Debug, Clone)]
pub struct ControllerMetrics {
    leader: Gauge,
    policy_ready: Family<Vec<(&'static str, String)>, Gauge>,
    gateway_ready_nodes: Family<Vec<(&'static str, String)>, Gauge>,
    eip_moves: Family<Vec<(&'static str, String)>, Counter>,
    allocations: Family<Labels2, Counter>,
    objects: Family<Labels2, Gauge>,
    writes_pending: Family<Vec<(&'static str, &'static str)>, Gauge>,
    api: ApiRequests,
}

impl ControllerMetrics {
    /// The controller's metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            leader: Gauge::default(),
            policy_ready: Family::default(),
            gateway_ready_nodes: Family::default(),
            eip_moves: Family::default(),
            allocations: Family::default(),
            objects: Family::default(),
            writes_pending: Family::default(),
            api: ApiRequests::register(registry),
        };
        // Failures are rare events: each series starts at 0, so that the
        // first one is an increase.
        for kind in Allocation::ALL {
            for result in AllocationResult::ALL {
                metrics
                    .allocations
                    .get_or_create(&[("kind", kind.as_str()), ("result", result.as_str())])
                    .inc_by(0);
            }
        }
        registry.register(
            "egressgw_controller_leader",
            "1 while this replica holds the leader Lease and allocates, 0 while it waits",
            metrics.leader.clone(),
        );
        registry.register(
            "egressgw_policy_ready",
            "1 while the policy's Ready condition holds (its traffic leaves with its EIP), \
             0 otherwise, by namespace (empty for an EgressClusterPolicy) and name; \
             exported by the leading controller",
            metrics.policy_ready.clone(),
        );
        registry.register(
            "egressgw_gateway_ready_nodes",
            "Selected nodes of the EgressGateway that can carry traffic; exported by \
             the leading controller",
            metrics.gateway_ready_nodes.clone(),
        );
        registry.register(
            "egressgw_eip_moves",
            "EIPs that moved from one gateway node to another, by EgressGateway",
            metrics.eip_moves.clone(),
        );
        registry.register(
            "egressgw_allocations",
            "What the controller's plans allocated, by kind (eip: a policy's EIP; tunnel: \
             a node's tunnel address, MAC or mark; gateway_node: the node an EIP is active \
             on) and result (ok: a new allocation; exhausted: nothing left to allocate; \
             conflict: the address asked for is another's or in use), each failure counted \
             once when a plan first finds it",
            metrics.allocations.clone(),
        );
        registry.register(
            "egressgw_objects",
            "egressgw's objects by kind and Ready condition (true, false, unknown; for an \
             EgressTunnel, whether its phase is Ready); exported by the leading controller",
            metrics.objects.clone(),
        );
        registry.register(
            "egressgw_controller_writes_pending",
            "Writes the leader's last run left for the next one (each run starts writes \
             for 2 s at most, most urgent first), by urgency (placement: a tunnel, an \
             object's first status, a moved EIP or node; conditions: a condition that \
             changed; details: counts and messages only)",
            metrics.writes_pending.clone(),
        );
        metrics
    }

    /// How many writes of each urgency the last run left for the next.
    pub fn set_writes_pending(&self, left: &BTreeMap<Urgency, i64>) {
        for urgency in Urgency::ALL {
            self.writes_pending
                .get_or_create(&vec![("urgency", urgency.as_str())])
                .set(left.get(&urgency).copied().unwrap_or(0));
        }
    }

    /// Counts the controller's requests to the API server.
    pub fn api(&self) -> &ApiRequests {
        &self.api
    }

    /// Counts `n` allocations of `kind` with `result`.
    pub fn allocated(&self, kind: Allocation, result: AllocationResult, n: u64) {
        self.allocations
            .get_or_create(&[("kind", kind.as_str()), ("result", result.as_str())])
            .inc_by(n);
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// The objects' state as the last plan left it: every policy's
    /// readiness, every gateway's ready nodes, and the objects of each kind
    /// by readiness, with `tunnels` the readiness of each EgressTunnel
    /// (`None`: no phase yet). Objects gone since drop out.
    pub fn set_objects(&self, status: &ClusterStatus, tunnels: &[Option<bool>]) {
        self.clear_objects();
        for (labels, n) in &object_counts(status, tunnels) {
            self.objects.get_or_create(labels).set(*n);
        }
        for p in &status.policies {
            let ready = ready_condition(&p.conditions) == Some(true);
            let labels = vec![
                ("namespace", p.policy.namespace.clone().unwrap_or_default()),
                ("policy", p.policy.name.clone()),
            ];
            self.policy_ready
                .get_or_create(&labels)
                .set(i64::from(ready));
        }
        for g in &status.gateways {
            let ready = g.nodes.iter().filter(|n| n.ready).count();
            self.gateway_ready_nodes
                .get_or_create(&vec![("gateway", g.gateway.clone())])
                .set(i64::try_from(ready).unwrap_or(i64::MAX));
        }
    }

    /// Drops every object's series: a replica that stops leading no longer
    /// speaks for them.
    pub fn clear_objects(&self) {
        self.policy_ready.clear();
        self.gateway_ready_nodes.clear();
        self.objects.clear();
    }

    /// An EIP of `gateway` moved to another node.
    pub fn eip_moved(&self, gateway: &str) {
        self.eip_moves
            .get_or_create(&vec![("gateway", gateway.to_owned())])
            .inc();
    }
}

/// The objects of each kind by readiness (every pair, 0 included), from
/// the plan's `status` and each EgressTunnel's readiness.
fn object_counts(status: &ClusterStatus, tunnels: &[Option<bool>]) -> BTreeMap<Labels2, i64> {
    let labels = |kind, ready| [("kind", kind), ("condition", ready_label(ready))];
    let mut counts = BTreeMap::new();
    for kind in OBJECT_KINDS {
        for ready in [Some(true), Some(false), None] {
            counts.insert(labels(kind, ready), 0);
        }
    }
    let policies = status.policies.iter().map(|p| {
        let kind = if p.policy.namespace.is_some() {
            "EgressPolicy"
        } else {
            "EgressClusterPolicy"
        };
        (kind, ready_condition(&p.conditions))
    });
    let gateways = status
        .gateways
        .iter()
        .map(|g| ("EgressGateway", ready_condition(&g.conditions)));
    let tunnels = tunnels.iter().map(|ready| ("EgressTunnel", *ready));
    for (kind, ready) in policies.chain(gateways).chain(tunnels) {
        *counts.entry(labels(kind, ready)).or_default() += 1;
    }
    counts
}

/// Whether the `Ready` condition among `conditions` holds (`None`: there
/// is none).
fn ready_condition(conditions: &[Condition]) -> Option<bool> {
    conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Ready)
        .map(|c| c.status)
}

#[cfg(test)]
mod tests {
    use egressgw_dataplane::ops::{Op, OpKind};

    use super::*;

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    /// The registry ends each help text with a period itself; a text that
    /// has its own shows "..".
    #[test]
    fn every_help_text_ends_with_one_period() {
        let mut agent_registry = Registry::default();
        let agent = AgentMetrics::register(&mut agent_registry);
        agent.set_traffic(BTreeMap::from([(
            PolicyRef::cluster("p".to_owned()),
            PolicyCount {
                gateway: "gw".into(),
                packets: 1,
                bytes: 2,
            },
        )]));
        let mut controller_registry = Registry::default();
        ControllerMetrics::register(&mut controller_registry);
        let text = text(&agent_registry) + &text(&controller_registry);
        let helps: Vec<&str> = text.lines().filter(|l| l.starts_with("# HELP")).collect();
        assert!(helps.len() > 10, "{} help lines in:\n{text}", helps.len());
        for help in helps {
            assert!(help.ends_with('.') && !help.ends_with(".."), "{help}");
        }
    }

    #[test]
    fn a_reconcile_and_the_policies_traffic_show_in_the_agents_metrics() {
        let mut registry = Registry::default();
        let metrics = AgentMetrics::register(&mut registry);
        let op = |kind, text: &str| Op::new(kind, "x", text);
        let mut ok = Report::default();
        ok.done(op(OpKind::Rule, "add rule"));
        ok.done(op(OpKind::Route, "add route"));
        metrics.reconciled(&ok, Duration::from_millis(12), 1);
        let mut failed = Report::default();
        failed.record(op(OpKind::Route, "add route"), Err("No such device"));
        metrics.reconciled(&failed, Duration::from_millis(3), 1);
        let count = |gateway: &str, packets, bytes| PolicyCount {
            gateway: gateway.into(),
            packets,
            bytes,
        };
        metrics.set_traffic(BTreeMap::from([
            (
                PolicyRef::namespaced("team-a", "web"),
                count("egw", 12, 1180),
            ),
            (
                PolicyRef::cluster("batch-to-partner"),
                count("partner", 3, 200),
            ),
        ]));
        let seen = |age: Option<Duration>, rtt: Option<Duration>| Seen {
            last_answer: age,
            round_trip: rtt,
        };
        let answers = BTreeMap::from([
            (
                "gw-1".to_owned(),
                seen(
                    Some(Duration::from_millis(40)),
                    Some(Duration::from_micros(250)),
                ),
            ),
            (
                "gw-2".to_owned(),
                seen(Some(Duration::from_secs(3)), Some(Duration::from_millis(2))),
            ),
            ("gw-3".to_owned(), seen(None, None)),
        ]);
        metrics.probed(&answers, &["gw-1".to_owned()].into());
        let out = text(&registry);
        for line in [
            "egressgw_reconciles_total{result=\"ok\"} 1",
            "egressgw_reconciles_total{result=\"failed\"} 1",
            "egressgw_reconcile_operations_total{kind=\"rule\",result=\"applied\"} 1",
            "egressgw_reconcile_operations_total{kind=\"route\",result=\"applied\"} 1",
            "egressgw_reconcile_operations_total{kind=\"route\",result=\"failed\"} 1",
            "egressgw_reconcile_duration_seconds_count 2",
            "egressgw_eips_held 1",
            "egressgw_reconcile_operations_total{kind=\"fdb\",result=\"failed\"} 0",
            "egressgw_policy_packets_total{namespace=\"team-a\",policy=\"web\",gateway=\"egw\"} 12",
            "egressgw_policy_bytes_total{namespace=\"team-a\",policy=\"web\",gateway=\"egw\"} 1180",
            "egressgw_policy_bytes_total{namespace=\"\",policy=\"batch-to-partner\",gateway=\"partner\"} 200",
            "egressgw_peer_up{peer=\"gw-1\"} 1",
            "egressgw_peer_up{peer=\"gw-2\"} 0",
            "egressgw_peer_up{peer=\"gw-3\"} 0",
            "egressgw_peer_last_answer_age_seconds{peer=\"gw-2\"} 3.0",
            "egressgw_peer_round_trip_seconds{peer=\"gw-1\"} 0.00025",
            "egressgw_peer_round_trip_seconds{peer=\"gw-2\"} 0.002",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
        assert!(
            out.contains("# TYPE egressgw_policy_bytes counter"),
            "{out}"
        );
        let last = out
            .lines()
            .find_map(|l| l.strip_prefix("egressgw_reconcile_last_success_timestamp_seconds "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap();
        assert!(last > 1.7e9, "{last}");
        assert!(!out.contains("egressgw_peer_last_answer_age_seconds{peer=\"gw-3\"}"));
        // A peer no longer probed is gone.
        metrics.probed(&BTreeMap::new(), &Default::default());
        assert!(!text(&registry).contains("gw-1"));
    }

    /// What a resolve decided, with no state to reconcile.
    fn outcome(
        taken: Vec<(std::net::IpAddr, Takeover)>,
        released: Vec<(std::net::IpAddr, Release)>,
        detected: Vec<Duration>,
        gateways: &[(&str, bool)],
    ) -> Outcome {
        Outcome {
            resolved: egressgw_core::failover::Resolved {
                state: Default::default(),
                targets: BTreeMap::new(),
                claims: Vec::new(),
                released: Vec::new(),
                quorum: egressgw_core::failover::Quorum {
                    reached: 1,
                    total: 1,
                },
            },
            taken,
            released,
            recovering: detected.clone(),
            detected,
            gateways: gateways
                .iter()
                .map(|(g, unreachable)| ((*g).to_owned(), *unreachable))
                .collect(),
        }
    }

    #[test]
    fn takeovers_releases_detections_and_unreachable_gateways_show_in_the_agents_metrics() {
        let mut registry = Registry::default();
        let metrics = AgentMetrics::register(&mut registry);
        let ip = std::net::IpAddr::from([198, 51, 100, 7]);
        metrics.resolved(&outcome(
            vec![(ip, Takeover::Failover)],
            vec![(ip, Release::QuorumLost)],
            vec![Duration::from_millis(340)],
            &[("egw", true), ("partner", false)],
        ));
        metrics.recovered(Duration::from_millis(1200));
        let out = text(&registry);
        for line in [
            "egressgw_eip_takeovers_total{reason=\"failover\"} 1",
            "egressgw_eip_takeovers_total{reason=\"planned\"} 0",
            "egressgw_eip_releases_total{reason=\"quorum_lost\"} 1",
            "egressgw_eip_releases_total{reason=\"planned\"} 0",
            "egressgw_failover_detection_seconds_count 1",
            "egressgw_failover_detection_seconds_bucket{le=\"0.3\"} 0",
            "egressgw_failover_detection_seconds_bucket{le=\"0.4\"} 1",
            "egressgw_failover_recovery_seconds_count 1",
            "egressgw_failover_recovery_seconds_bucket{le=\"1.0\"} 0",
            "egressgw_failover_recovery_seconds_bucket{le=\"1.5\"} 1",
            "egressgw_gateway_unreachable{gateway=\"egw\"} 1",
            "egressgw_gateway_unreachable{gateway=\"partner\"} 0",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
        assert!(
            out.contains("# TYPE egressgw_failover_detection_seconds histogram"),
            "{out}"
        );
        // A gateway no longer in use is gone.
        metrics.resolved(&outcome(
            Vec::new(),
            Vec::new(),
            Vec::new(),
            &[("egw", false)],
        ));
        let out = text(&registry);
        assert!(
            out.contains("egressgw_gateway_unreachable{gateway=\"egw\"} 0"),
            "{out}"
        );
        assert!(!out.contains("partner"), "{out}");
    }

    #[test]
    fn the_tunnel_ends_counts_show_by_way_and_only_rise() {
        let mut registry = Registry::default();
        let metrics = AgentMetrics::register(&mut registry);
        let out = text(&registry);
        for line in [
            "egressgw_tunnel_end_packets_total{way=\"to_pods\"} 0",
            "egressgw_tunnel_end_bytes_total{way=\"out\"} 0",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
        metrics.tunnel_end([(10, 700), (4, 300)]);
        metrics.tunnel_end([(12, 800), (4, 300)]);
        let out = text(&registry);
        for line in [
            "egressgw_tunnel_end_packets_total{way=\"to_pods\"} 12",
            "egressgw_tunnel_end_bytes_total{way=\"to_pods\"} 800",
            "egressgw_tunnel_end_packets_total{way=\"out\"} 4",
            "egressgw_tunnel_end_bytes_total{way=\"out\"} 300",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
    }

    #[tokio::test]
    async fn api_requests_are_counted_by_verb_and_result_and_errors_by_code() {
        let mut registry = Registry::default();
        let metrics = AgentMetrics::register(&mut registry);
        let api = metrics.api();
        let conflict = kube::Error::Api(
            kube::core::Status::failure("the object has been modified", "Conflict")
                .with_code(409)
                .boxed(),
        );
        api.send(Verb::Patch, async { Ok(()) }).await.unwrap();
        api.send(Verb::Patch, async { Ok(()) }).await.unwrap();
        api.send(Verb::Update, async { Err::<(), _>(conflict) })
            .await
            .unwrap_err();
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        api.send(Verb::Get, async {
            Err::<(), _>(kube::Error::ReadEvents(refused))
        })
        .await
        .unwrap_err();
        // Given up by its caller before it completes.
        let pending = api.send(Verb::Patch, std::future::pending::<kube::Result<()>>());
        tokio::time::timeout(Duration::from_millis(1), pending)
            .await
            .unwrap_err();
        let out = text(&registry);
        for line in [
            "egressgw_api_requests_total{verb=\"patch\",result=\"ok\"} 2",
            "egressgw_api_requests_total{verb=\"patch\",result=\"error\"} 1",
            "egressgw_api_requests_total{verb=\"update\",result=\"error\"} 1",
            "egressgw_api_requests_total{verb=\"get\",result=\"error\"} 1",
            "egressgw_api_errors_total{verb=\"update\",code=\"409\"} 1",
            "egressgw_api_errors_total{verb=\"get\",code=\"transport\"} 1",
            "egressgw_api_errors_total{verb=\"patch\",code=\"timeout\"} 1",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
    }

    #[tokio::test]
    async fn a_request_without_an_answer_fails_in_time_and_counts_as_a_timeout() {
        let mut registry = Registry::default();
        let api = ApiRequests::register(&mut registry);
        let never = std::future::pending::<kube::Result<()>>();
        let result = api
            .send_within(Duration::from_millis(20), Verb::Patch, never)
            .await;
        let error = result.expect_err("a request that never answers fails");
        assert_eq!(error_code(&error), "timeout");
        assert!(error.to_string().contains("did not answer"), "{error}");
        let out = text(&registry);
        assert!(
            out.contains("egressgw_api_errors_total{verb=\"patch\",code=\"timeout\"} 1"),
            "{out}"
        );
    }

    #[test]
    fn a_timeout_deep_in_an_errors_sources_is_a_timeout() {
        let timed_out = std::io::Error::from(std::io::ErrorKind::TimedOut);
        assert_eq!(error_code(&kube::Error::ReadEvents(timed_out)), "timeout");
        let json = serde_json::from_str::<u8>("x").unwrap_err();
        assert_eq!(error_code(&kube::Error::SerdeError(json)), "decode");
    }

    #[test]
    fn the_controller_says_whether_it_leads() {
        let mut registry = Registry::default();
        let metrics = ControllerMetrics::register(&mut registry);
        assert!(text(&registry).contains("egressgw_controller_leader 0"));
        metrics.set_leader(true);
        assert!(text(&registry).contains("egressgw_controller_leader 1"));
    }

    #[test]
    fn the_controller_exports_each_objects_state_and_forgets_objects_gone() {
        use egressgw_core::status::{
            Condition, GatewayNodeStatus, GatewayStatus, PolicyStatus, Reason,
        };
        let mut registry = Registry::default();
        let metrics = ControllerMetrics::register(&mut registry);
        let policy = |ns: Option<&str>, name: &str, ready: bool| PolicyStatus {
            policy: PolicyRef {
                namespace: ns.map(str::to_owned),
                name: name.into(),
            },
            eip_ipv4: None,
            eip_ipv6: None,
            use_node_ip: false,
            node: None,
            pods: 1,
            conditions: vec![Condition {
                type_: ConditionType::Ready,
                status: ready,
                reason: if ready {
                    Reason::Active
                } else {
                    Reason::NoReadyNode
                },
                message: String::new(),
            }],
        };
        let node = |name: &str, ready: bool| GatewayNodeStatus {
            name: name.into(),
            ready,
            eips: Vec::new(),
        };
        let mut status = ClusterStatus {
            policies: vec![
                policy(Some("team-a"), "web", true),
                policy(None, "batch-to-partner", false),
            ],
            gateways: vec![GatewayStatus {
                gateway: "lab".into(),
                nodes: vec![node("node-1", true), node("node-2", false)],
                ip_usage: Default::default(),
                conditions: Vec::new(),
            }],
            ..Default::default()
        };
        metrics.set_objects(&status, &[Some(true), Some(true), None]);
        metrics.eip_moved("lab");
        metrics.allocated(Allocation::Eip, AllocationResult::Ok, 2);
        metrics.allocated(Allocation::Eip, AllocationResult::Exhausted, 1);
        let out = text(&registry);
        for line in [
            "egressgw_policy_ready{namespace=\"team-a\",policy=\"web\"} 1",
            "egressgw_policy_ready{namespace=\"\",policy=\"batch-to-partner\"} 0",
            "egressgw_gateway_ready_nodes{gateway=\"lab\"} 1",
            "egressgw_eip_moves_total{gateway=\"lab\"} 1",
            "egressgw_objects{kind=\"EgressPolicy\",condition=\"true\"} 1",
            "egressgw_objects{kind=\"EgressPolicy\",condition=\"false\"} 0",
            "egressgw_objects{kind=\"EgressClusterPolicy\",condition=\"false\"} 1",
            "egressgw_objects{kind=\"EgressGateway\",condition=\"unknown\"} 1",
            "egressgw_objects{kind=\"EgressTunnel\",condition=\"true\"} 2",
            "egressgw_objects{kind=\"EgressTunnel\",condition=\"unknown\"} 1",
            "egressgw_allocations_total{kind=\"eip\",result=\"ok\"} 2",
            "egressgw_allocations_total{kind=\"eip\",result=\"exhausted\"} 1",
            "egressgw_allocations_total{kind=\"tunnel\",result=\"exhausted\"} 0",
            "egressgw_allocations_total{kind=\"gateway_node\",result=\"conflict\"} 0",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
        status.policies.remove(0);
        metrics.set_objects(&status, &[]);
        let out = text(&registry);
        assert!(!out.contains("policy=\"web\""), "{out}");
        assert!(
            out.contains("egressgw_objects{kind=\"EgressPolicy\",condition=\"true\"} 0"),
            "{out}"
        );
        // A replica that stops leading no longer speaks for the objects.
        metrics.clear_objects();
        assert!(!text(&registry).contains("egressgw_objects{"));
    }
}

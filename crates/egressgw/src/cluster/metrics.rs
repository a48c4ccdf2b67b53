//! What the daemons export on `/metrics`, each registered here with its
//! help text (docs/operations.md is the reference). Names follow
//! Prometheus' conventions: the `egressgw_` prefix, base units, counters
//! ending in `_total` (the encoder adds it). No label carries a pod's
//! address: every label's values are bounded by the cluster's objects.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egressgw_core::model::PolicyRef;
use egressgw_core::status::{ClusterStatus, ConditionType};
use egressgw_dataplane::ops::Report;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A label set of one label.
type Label = [(&'static str, &'static str); 1];

/// An agent's metrics.
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    reconcile_seconds: Histogram,
    reconciles: Family<Label, Counter>,
    ops: Family<[(&'static str, &'static str); 2], Counter>,
    last_success: Gauge<f64, AtomicU64>,
    eips: Gauge,
    peer_up: Family<[(&'static str, String); 1], Gauge>,
    peer_last_answer: Family<[(&'static str, String); 1], Gauge<f64, AtomicU64>>,
    traffic: Arc<PolicyTraffic>,
}

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
            traffic: Arc::default(),
        };
        registry.register(
            "egressgw_reconcile_duration_seconds",
            "Time a reconcile of this node's kernel state took (read back, plan, apply).",
            metrics.reconcile_seconds.clone(),
        );
        registry.register(
            "egressgw_reconciles",
            "Reconciles of this node's kernel state, by result (ok: every operation \
             applied; failed: at least one failed).",
            metrics.reconciles.clone(),
        );
        registry.register(
            "egressgw_reconcile_operations",
            "Kernel operations reconciles carried out, by kind (link, address, neighbour, \
             fdb, route, rule, sysctl, offload, eip, table, chain, set, element, program, \
             map, conntrack, read) and result (applied, failed).",
            metrics.ops.clone(),
        );
        registry.register(
            "egressgw_reconcile_last_success_timestamp_seconds",
            "When the last reconcile that applied every operation ended (Unix time).",
            metrics.last_success.clone(),
        );
        registry.register(
            "egressgw_eips_held",
            "Egress IPs this node holds: SNATs to and announces on its network.",
            metrics.eips.clone(),
        );
        registry.register(
            "egressgw_peer_up",
            "1 while the peer node answers this node's probes through the tunnel, 0 once \
             it counts as dead, by peer node; only peers this node probes (gateway \
             candidates of its traffic, holders of its EIPs).",
            metrics.peer_up.clone(),
        );
        registry.register(
            "egressgw_peer_last_answer_age_seconds",
            "Time since the peer node last answered a probe through the tunnel, by peer \
             node (absent until it first answers).",
            metrics.peer_last_answer.clone(),
        );
        registry.register_collector(Box::new(Arc::clone(&metrics.traffic)));
        metrics
    }

    /// Records what the probes see: the peers probed, each with the time
    /// since its last answer (`None`: never), and the live ones. Peers no
    /// longer probed are dropped.
    pub fn probed(
        &self,
        answers: &BTreeMap<String, Option<Duration>>,
        live: &std::collections::BTreeSet<String>,
    ) {
        self.peer_up.clear();
        self.peer_last_answer.clear();
        for (peer, age) in answers {
            let labels = [("peer", peer.clone())];
            self.peer_up
                .get_or_create(&labels)
                .set(i64::from(live.contains(peer)));
            if let Some(age) = age {
                self.peer_last_answer
                    .get_or_create(&labels)
                    .set(age.as_secs_f64());
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

/// The controller's metrics.
#[derive(Debug, Clone)]
pub struct ControllerMetrics {
    leader: Gauge,
    policy_ready: Family<Vec<(&'static str, String)>, Gauge>,
    gateway_ready_nodes: Family<Vec<(&'static str, String)>, Gauge>,
    eip_moves: Family<Vec<(&'static str, String)>, Counter>,
}

impl ControllerMetrics {
    /// The controller's metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            leader: Gauge::default(),
            policy_ready: Family::default(),
            gateway_ready_nodes: Family::default(),
            eip_moves: Family::default(),
        };
        registry.register(
            "egressgw_controller_leader",
            "1 while this replica holds the leader Lease and allocates, 0 while it waits.",
            metrics.leader.clone(),
        );
        registry.register(
            "egressgw_policy_ready",
            "1 while the policy's Ready condition holds (its traffic leaves with its EIP), \
             0 otherwise, by namespace (empty for an EgressClusterPolicy) and name; \
             exported by the leading controller.",
            metrics.policy_ready.clone(),
        );
        registry.register(
            "egressgw_gateway_ready_nodes",
            "Selected nodes of the EgressGateway that can carry traffic; exported by \
             the leading controller.",
            metrics.gateway_ready_nodes.clone(),
        );
        registry.register(
            "egressgw_eip_moves",
            "EIPs that moved from one gateway node to another, by EgressGateway.",
            metrics.eip_moves.clone(),
        );
        metrics
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// The objects' state as the last plan left it: every policy's
    /// readiness and every gateway's ready nodes (objects gone since drop
    /// out).
    pub fn set_objects(&self, status: &ClusterStatus) {
        self.clear_objects();
        for p in &status.policies {
            let ready = p
                .conditions
                .iter()
                .any(|c| c.type_ == ConditionType::Ready && c.status);
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
    }

    /// An EIP of `gateway` moved to another node.
    pub fn eip_moved(&self, gateway: &str) {
        self.eip_moves
            .get_or_create(&vec![("gateway", gateway.to_owned())])
            .inc();
    }
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
        let answers = BTreeMap::from([
            ("gw-1".to_owned(), Some(Duration::from_millis(40))),
            ("gw-2".to_owned(), Some(Duration::from_secs(3))),
            ("gw-3".to_owned(), None),
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
            "egressgw_policy_packets_total{namespace=\"team-a\",policy=\"web\",gateway=\"egw\"} 12",
            "egressgw_policy_bytes_total{namespace=\"team-a\",policy=\"web\",gateway=\"egw\"} 1180",
            "egressgw_policy_bytes_total{namespace=\"\",policy=\"batch-to-partner\",gateway=\"partner\"} 200",
            "egressgw_peer_up{peer=\"gw-1\"} 1",
            "egressgw_peer_up{peer=\"gw-2\"} 0",
            "egressgw_peer_up{peer=\"gw-3\"} 0",
            "egressgw_peer_last_answer_age_seconds{peer=\"gw-2\"} 3.0",
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
        metrics.set_objects(&status);
        metrics.eip_moved("lab");
        let out = text(&registry);
        for line in [
            "egressgw_policy_ready{namespace=\"team-a\",policy=\"web\"} 1",
            "egressgw_policy_ready{namespace=\"\",policy=\"batch-to-partner\"} 0",
            "egressgw_gateway_ready_nodes{gateway=\"lab\"} 1",
            "egressgw_eip_moves_total{gateway=\"lab\"} 1",
        ] {
            assert!(out.contains(line), "no {line:?} in\n{out}");
        }
        status.policies.remove(0);
        metrics.set_objects(&status);
        assert!(!text(&registry).contains("policy=\"web\""));
    }
}

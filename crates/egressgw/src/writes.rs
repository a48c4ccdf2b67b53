//! What the controller writes to the API server after a plan, decided
//! apart from sending it: [`plan`] is a pure function of what the watch
//! caches hold ([`Stored`]), the planned [`ClusterStatus`], the agents
//! that stopped renewing their Leases and the time; the controller sends
//! the [`Write`]s it returns, in order, and reports each.
//!
//! Nothing is written that would not change the object: a status equal to
//! the stored one, a tunnel allocation already there, a tunnel already
//! marked. A plan whose writes were all carried out plans none.
//!
//! [`Waves`] orders them for sending: each node's tunnel writes in one
//! lane, then every status, those that place traffic first ([`Urgency`]),
//! so that while thousands of statuses are due, a new policy's first
//! status is not queued behind count updates of policies already placed.
//!
//! [`hold_details`] keeps back a status whose counts alone changed while
//! the object was written less than [`DETAILS_EVERY`] ago: while Pods
//! load, a policy's count changes every run, and each write is a watch
//! event for every watcher of policies.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use egressgw_api::gateway::GatewayPods;
use egressgw_api::status::{gateway_status, policy_status, tunnel_status};
use egressgw_api::tunnel::TunnelEndpoint;
use egressgw_api::{EgressGatewayStatus, EgressPolicyStatus, EgressTunnelStatus, TunnelPhase};
use egressgw_core::model::PolicyRef;
use egressgw_core::status::ClusterStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

/// What the watch caches hold, as far as the decisions need it.
#[derive(Debug, Clone, Default)]
pub struct Stored {
    /// Each `EgressTunnel` by node: its phase and status.
    pub tunnels: BTreeMap<String, (Option<TunnelPhase>, Option<EgressTunnelStatus>)>,
    /// The uid of each Node (a new `EgressTunnel` is owned by its Node).
    pub node_uids: BTreeMap<String, String>,
    /// Each policy's stored status and `metadata.generation`.
    pub policies: BTreeMap<PolicyRef, Object<EgressPolicyStatus>>,
    /// Each gateway's stored status and `metadata.generation`.
    pub gateways: BTreeMap<String, Object<EgressGatewayStatus>>,
    /// The gateways whose Pods are published (their `EgressEndpointSlice`s
    /// written), with what their status says of them.
    pub published: BTreeMap<String, GatewayPods>,
}

/// An object's stored status and generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Object<S> {
    pub status: Option<S>,
    pub generation: Option<i64>,
}

/// One write.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// The agent of `node` stopped renewing its Lease: its tunnel's phase
    /// becomes `HeartbeatTimeout` (the controller's phase field manager).
    HeartbeatTimeout { node: String },
    /// A node has no `EgressTunnel` yet: create it, owned by its Node
    /// (`owner`: the Node's uid, when known).
    CreateTunnel { node: String, owner: Option<String> },
    /// The controller's part of a tunnel's status: address, MAC, mark.
    TunnelStatus {
        node: String,
        status: EgressTunnelStatus,
    },
    /// An `EgressPolicy`'s or `EgressClusterPolicy`'s status.
    PolicyStatus {
        policy: PolicyRef,
        status: EgressPolicyStatus,
    },
    /// An `EgressGateway`'s status.
    GatewayStatus {
        gateway: String,
        status: EgressGatewayStatus,
    },
}

impl std::fmt::Display for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Write::HeartbeatTimeout { node } => {
                write!(f, "mark the EgressTunnel {node} HeartbeatTimeout")
            }
            Write::CreateTunnel { node, .. } => write!(f, "create the EgressTunnel {node}"),
            Write::TunnelStatus { node, .. } => write!(f, "the status of EgressTunnel {node}"),
            Write::PolicyStatus { policy, .. } => {
                write!(f, "the status of {} {policy}", policy.kind())
            }
            Write::GatewayStatus { gateway, .. } => {
                write!(f, "the status of EgressGateway {gateway}")
            }
        }
    }
}

/// How soon a write matters; the most urgent go first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Urgency {
    /// A gateway's Pods published for the first time: until its status
    /// says so, the agents of the nodes it selects watch every Pod of the
    /// cluster instead of its slices (see `cluster::watch::Wanted::of`).
    Published,
    /// Where traffic goes: a tunnel (its creation, allocation or
    /// timeout), an object's first status, a policy's EIPs or node, or a
    /// gateway's nodes and their EIPs.
    Placement,
    /// Whether a condition holds, or why (what users and alerts read).
    Conditions,
    /// Counts and messages only.
    Details,
}

impl Urgency {
    pub const ALL: [Urgency; 4] = [
        Urgency::Published,
        Urgency::Placement,
        Urgency::Conditions,
        Urgency::Details,
    ];

    /// The metrics' label.
    pub fn as_str(self) -> &'static str {
        match self {
            Urgency::Published => "published",
            Urgency::Placement => "placement",
            Urgency::Conditions => "conditions",
            Urgency::Details => "details",
        }
    }
}

impl Write {
    /// How soon this write matters, given what is stored now.
    pub fn urgency(&self, stored: &Stored) -> Urgency {
        match self {
            Write::HeartbeatTimeout { .. }
            | Write::CreateTunnel { .. }
            | Write::TunnelStatus { .. } => Urgency::Placement,
            Write::PolicyStatus { policy, status } => {
                match stored.policies.get(policy).and_then(|o| o.status.as_ref()) {
                    None => Urgency::Placement,
                    Some(old) if old.eip != status.eip || old.node != status.node => {
                        Urgency::Placement
                    }
                    Some(old) => conditions_urgency(&old.conditions, &status.conditions),
                }
            }
            Write::GatewayStatus { gateway, status } => {
                let old = stored.gateways.get(gateway).and_then(|o| o.status.as_ref());
                // Only whether its Pods are published matters to the
                // agents, not how many there are.
                if status.pods.is_some() && old.is_none_or(|o| o.pods.is_none()) {
                    return Urgency::Published;
                }
                match old {
                    None => Urgency::Placement,
                    Some(old) if old.node_list != status.node_list => Urgency::Placement,
                    Some(old) => conditions_urgency(&old.conditions, &status.conditions),
                }
            }
        }
    }

    /// The object a status write is for (`kind/namespace/name`), `None`
    /// for a tunnel's writes.
    pub fn status_object(&self) -> Option<String> {
        match self {
            Write::PolicyStatus { policy, .. } => Some(match &policy.namespace {
                Some(ns) => format!("{}/{ns}/{}", policy.kind(), policy.name),
                None => format!("{}/{}", policy.kind(), policy.name),
            }),
            Write::GatewayStatus { gateway, .. } => Some(format!("EgressGateway/{gateway}")),
            Write::HeartbeatTimeout { .. }
            | Write::CreateTunnel { .. }
            | Write::TunnelStatus { .. } => None,
        }
    }

    /// Whether this write is part of a tunnel's lane (see [`Waves`]).
    fn tunnel(&self) -> Option<&str> {
        match self {
            Write::HeartbeatTimeout { node }
            | Write::CreateTunnel { node, .. }
            | Write::TunnelStatus { node, .. } => Some(node),
            Write::PolicyStatus { .. } | Write::GatewayStatus { .. } => None,
        }
    }
}

/// [`Urgency::Conditions`] when a condition appeared, went, or changed its
/// status or reason; [`Urgency::Details`] otherwise.
fn conditions_urgency(old: &[Condition], new: &[Condition]) -> Urgency {
    let same = old.len() == new.len()
        && old
            .iter()
            .zip(new)
            .all(|(a, b)| a.type_ == b.type_ && a.status == b.status && a.reason == b.reason);
    if same {
        Urgency::Details
    } else {
        Urgency::Conditions
    }
}

/// Writes in the order they are sent: first the tunnels, then the
/// statuses. Writes in different lanes touch different objects and may go
/// at the same time.
#[derive(Debug, Default, PartialEq)]
pub struct Waves {
    /// One lane per node, in plan order: a tunnel is created before its
    /// status is written, and a lane stops at its first failure.
    pub tunnels: Vec<Vec<Write>>,
    /// One write per object, most urgent first, in plan order within the
    /// same urgency.
    pub statuses: Vec<Write>,
}

impl Waves {
    /// Orders `writes` (each object written at most once among the
    /// statuses, as [`plan`] plans them).
    pub fn new(writes: Vec<Write>, stored: &Stored) -> Self {
        let mut lanes: BTreeMap<String, Vec<Write>> = BTreeMap::new();
        let mut statuses = Vec::new();
        for write in writes {
            match write.tunnel() {
                Some(node) => lanes.entry(node.to_owned()).or_default().push(write),
                None => statuses.push(write),
            }
        }
        statuses.sort_by_cached_key(|w| w.urgency(stored));
        Waves {
            tunnels: lanes.into_values().collect(),
            statuses,
        }
    }
}

/// How often at most a status is written when only its counts and
/// messages change ([`Urgency::Details`]).
pub const DETAILS_EVERY: Duration = Duration::from_secs(5);

/// The writes held back by [`hold_details`], and when the first of them is
/// due.
#[derive(Debug, Default, PartialEq)]
pub struct Held {
    pub writes: usize,
    pub due: Option<Instant>,
}

/// Takes out of `writes` the status writes that change only counts or
/// messages of an object written less than [`DETAILS_EVERY`] before `now`
/// (`written`: when each object's status was last written). A write that
/// places traffic or changes a condition is never held, nor is anything
/// of an object this controller has not written. What is held is planned
/// again by a later run, with whatever changed meanwhile.
pub fn hold_details(
    writes: &mut Vec<Write>,
    stored: &Stored,
    written: &HashMap<String, Instant>,
    now: Instant,
) -> Held {
    let mut held = Held::default();
    writes.retain(|write| {
        let Some(last) = write.status_object().and_then(|o| written.get(&o).copied()) else {
            return true;
        };
        let due = last + DETAILS_EVERY;
        if due <= now || write.urgency(stored) != Urgency::Details {
            return true;
        }
        held.writes += 1;
        held.due = Some(held.due.map_or(due, |d| d.min(due)));
        false
    });
    held
}

/// The tunnels to mark `HeartbeatTimeout`: those of `unavailable` agents
/// still `Ready` or `Init` (a tunnel already `Failed` or marked says
/// enough).
pub fn timeouts(stored: &Stored, unavailable: &BTreeSet<String>) -> Vec<Write> {
    stored
        .tunnels
        .iter()
        .filter(|(node, (phase, _))| {
            unavailable.contains(*node)
                && matches!(phase, Some(TunnelPhase::Ready | TunnelPhase::Init))
        })
        .map(|(node, _)| Write::HeartbeatTimeout { node: node.clone() })
        .collect()
}

/// The writes that make the objects say what `status` says, at `now`
/// (a condition that changes gets `now` as its transition time): tunnels
/// created and given their allocations, then the policies' and the
/// gateways' status. Objects the caches do not hold (deleted since the
/// snapshot) are left alone.
pub fn plan(stored: &Stored, status: &ClusterStatus, now: Timestamp) -> Vec<Write> {
    let mut writes = Vec::new();
    for allocation in &status.tunnels {
        let node = &allocation.node;
        let wanted = tunnel_status(allocation);
        match stored.tunnels.get(node) {
            None => {
                writes.push(Write::CreateTunnel {
                    node: node.clone(),
                    owner: stored.node_uids.get(node).cloned(),
                });
            }
            Some((_, current)) if allocation_of(current.as_ref()) == wanted => continue,
            Some(_) => {}
        }
        writes.push(Write::TunnelStatus {
            node: node.clone(),
            status: wanted,
        });
    }
    for s in &status.policies {
        let Some(stored) = stored.policies.get(&s.policy) else {
            continue;
        };
        let new = policy_status(s, stored.status.as_ref(), stored.generation, now);
        if stored.status.as_ref() != Some(&new) {
            writes.push(Write::PolicyStatus {
                policy: s.policy.clone(),
                status: new,
            });
        }
    }
    for s in &status.gateways {
        let Some(object) = stored.gateways.get(&s.gateway) else {
            continue;
        };
        let mut new = gateway_status(s, object.status.as_ref(), object.generation, now);
        if let Some(pods) = stored.published.get(&s.gateway) {
            new.pods = Some(*pods);
        }
        if object.status.as_ref() != Some(&new) {
            writes.push(Write::GatewayStatus {
                gateway: s.gateway.clone(),
                status: new,
            });
        }
    }
    writes
}

/// The controller's part of a stored tunnel status: what [`tunnel_status`]
/// writes, without what the agent writes (the parent interface, the
/// phase, the EIPs it holds, what it cannot reach, its datapath).
fn allocation_of(current: Option<&EgressTunnelStatus>) -> EgressTunnelStatus {
    let current = current.cloned().unwrap_or_default();
    EgressTunnelStatus {
        tunnel: current.tunnel.map(|t| TunnelEndpoint { parent: None, ..t }),
        phase: None,
        mark: current.mark,
        last_heartbeat_time: None,
        eips: Vec::new(),
        unreachable: Vec::new(),
        datapath: None,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use egressgw_core::model::Mac;
    use egressgw_core::status::{
        Condition, ConditionType, GatewayStatus, IpUsage, PolicyStatus, Reason, TunnelAllocation,
    };

    use super::*;

    fn now() -> Timestamp {
        "2026-11-27T02:00:00Z".parse().unwrap()
    }

    fn later() -> Timestamp {
        "2026-11-27T02:05:00Z".parse().unwrap()
    }

    fn allocation(node: &str, last: u8) -> TunnelAllocation {
        TunnelAllocation {
            node: node.into(),
            ipv4: Some(Ipv4Addr::new(172, 31, 0, last)),
            ipv6: None,
            mac: Mac([0x66, 0, 0, 0, 0, last]),
            mark: Some(0x0100_0000 * u32::from(last)),
            underlay: None,
        }
    }

    fn ready(ok: bool) -> Condition {
        Condition {
            type_: ConditionType::Ready,
            status: ok,
            reason: if ok {
                Reason::Allocated
            } else {
                Reason::NoReadyNode
            },
            message: String::new(),
        }
    }

    fn cluster(ok: bool) -> ClusterStatus {
        let web = PolicyRef::namespaced("team-a", "web");
        ClusterStatus {
            tunnels: vec![allocation("node-1", 1), allocation("node-2", 2)],
            policies: vec![PolicyStatus {
                policy: web,
                eip_ipv4: ok.then(|| Ipv4Addr::new(198, 51, 100, 10)),
                eip_ipv6: None,
                use_node_ip: false,
                node: ok.then(|| "node-1".to_owned()),
                pods: 1,
                conditions: vec![ready(ok)],
            }],
            gateways: vec![GatewayStatus {
                gateway: "egw".into(),
                nodes: Vec::new(),
                ip_usage: IpUsage::default(),
                conditions: vec![ready(ok)],
            }],
            ..ClusterStatus::default()
        }
    }

    /// The caches after `writes` were carried out on `stored`.
    fn carried_out(mut stored: Stored, writes: &[Write]) -> Stored {
        for write in writes {
            match write {
                Write::HeartbeatTimeout { node } => {
                    stored.tunnels.entry(node.clone()).or_default().0 =
                        Some(TunnelPhase::HeartbeatTimeout);
                }
                Write::CreateTunnel { node, .. } => {
                    stored.tunnels.insert(node.clone(), (None, None));
                }
                Write::TunnelStatus { node, status } => {
                    stored.tunnels.entry(node.clone()).or_default().1 = Some(status.clone());
                }
                Write::PolicyStatus { policy, status } => {
                    stored.policies.entry(policy.clone()).or_default().status =
                        Some(status.clone());
                }
                Write::GatewayStatus { gateway, status } => {
                    stored.gateways.entry(gateway.clone()).or_default().status =
                        Some(status.clone());
                }
            }
        }
        stored
    }

    /// A cluster whose objects exist but carry no status yet.
    fn fresh() -> Stored {
        let object = Object {
            status: None,
            generation: Some(1),
        };
        Stored {
            tunnels: BTreeMap::from([("node-1".to_owned(), (Some(TunnelPhase::Ready), None))]),
            node_uids: BTreeMap::from([("node-2".to_owned(), "uid-2".to_owned())]),
            policies: BTreeMap::from([(PolicyRef::namespaced("team-a", "web"), object.clone())]),
            gateways: BTreeMap::from([(
                "egw".to_owned(),
                Object {
                    status: None,
                    generation: Some(3),
                },
            )]),
            published: BTreeMap::new(),
        }
    }

    /// The gateway's status says its Pods are published once the slices
    /// are written, and is written again only when their count changes;
    /// until then it keeps what it said.
    #[test]
    fn a_gateways_published_pods_go_into_its_status() {
        let mut stored = carried_out(fresh(), &plan(&fresh(), &cluster(true), now()));
        let gateway = |stored: &Stored| stored.gateways["egw"].status.clone().unwrap();
        assert_eq!(gateway(&stored).pods, None);
        let pods = GatewayPods {
            selected: 3,
            slices: 1,
        };
        stored.published.insert("egw".into(), pods);
        let writes = plan(&stored, &cluster(true), later());
        assert!(
            matches!(writes.as_slice(), [Write::GatewayStatus { .. }]),
            "{writes:?}"
        );
        let mut stored = carried_out(stored, &writes);
        assert_eq!(gateway(&stored).pods, Some(pods));
        assert_eq!(plan(&stored, &cluster(true), later()), []);
        stored.published.clear();
        assert_eq!(plan(&stored, &cluster(true), later()), []);
    }

    /// Until a gateway's status says its Pods are published, the agents
    /// of its nodes watch every Pod of the cluster: that write goes ahead
    /// of every other status, the first statuses of policies created with
    /// it included (at 10 000 policies those took minutes to write, and
    /// the gateway's waited behind them). How many Pods it has later is a
    /// detail.
    #[test]
    fn a_gateways_pods_published_first_go_before_every_other_status() {
        let mut stored = fresh();
        let mut status = cluster(true);
        let web = status.policies[0].clone();
        for n in 0..50 {
            let mut p = web.clone();
            p.policy = PolicyRef::namespaced("team-a", format!("p{n:02}"));
            stored.policies.insert(p.policy.clone(), Object::default());
            status.policies.push(p);
        }
        let pods = GatewayPods {
            selected: 3,
            slices: 1,
        };
        stored.published.insert("egw".into(), pods);
        let writes = plan(&stored, &status, now());
        let waves = Waves::new(writes.clone(), &stored);
        assert!(
            matches!(&waves.statuses[0], Write::GatewayStatus { status, .. } if status.pods == Some(pods)),
            "{:?}",
            waves.statuses[0]
        );
        assert_eq!(waves.statuses[0].urgency(&stored), Urgency::Published);
        assert!(
            waves.statuses[1..]
                .iter()
                .all(|w| w.urgency(&stored) == Urgency::Placement),
            "{waves:?}"
        );

        let mut stored = carried_out(stored, &writes);
        stored.published.insert(
            "egw".into(),
            GatewayPods {
                selected: 4,
                slices: 1,
            },
        );
        let counted = plan(&stored, &status, later());
        assert!(
            matches!(counted.as_slice(), [Write::GatewayStatus { .. }]),
            "{counted:?}"
        );
        assert_eq!(counted[0].urgency(&stored), Urgency::Details);
    }

    #[test]
    fn a_missing_tunnel_is_created_owned_by_its_node_and_every_status_is_written_once() {
        let writes = plan(&fresh(), &cluster(true), now());
        let kinds: Vec<String> = writes
            .iter()
            .map(|w| match w {
                Write::CreateTunnel { node, owner } => format!("create {node} {owner:?}"),
                Write::TunnelStatus { node, .. } => format!("tunnel {node}"),
                Write::PolicyStatus { policy, .. } => format!("policy {policy}"),
                Write::GatewayStatus { gateway, .. } => format!("gateway {gateway}"),
                Write::HeartbeatTimeout { node } => format!("timeout {node}"),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "tunnel node-1",
                "create node-2 Some(\"uid-2\")",
                "tunnel node-2",
                "policy team-a/web",
                "gateway egw",
            ]
        );
        // Carried out, the same plan writes nothing, however much later.
        let stored = carried_out(fresh(), &writes);
        assert_eq!(plan(&stored, &cluster(true), later()), []);
    }

    #[test]
    fn a_status_that_changes_is_written_with_the_time_of_the_change_and_generation() {
        let stored = carried_out(fresh(), &plan(&fresh(), &cluster(true), now()));
        let writes = plan(&stored, &cluster(false), later());
        let [
            Write::PolicyStatus { status: policy, .. },
            Write::GatewayStatus {
                status: gateway, ..
            },
        ] = writes.as_slice()
        else {
            panic!("{writes:?}");
        };
        let condition = &policy.conditions[0];
        assert_eq!(condition.status, "False");
        assert_eq!(condition.last_transition_time.0, later());
        assert_eq!(condition.observed_generation, Some(1));
        assert_eq!(gateway.conditions[0].observed_generation, Some(3));
        assert_eq!(policy.eip, None, "no EIP while no node is ready");
    }

    #[test]
    fn a_tunnel_keeps_what_its_agent_wrote_and_moves_only_when_its_allocation_does() {
        let mut stored = carried_out(fresh(), &plan(&fresh(), &cluster(true), now()));
        // The agent's part of the status is not the controller's to write.
        let (_, status) = stored.tunnels.get_mut("node-1").unwrap();
        let status = status.as_mut().unwrap();
        status.phase = Some(TunnelPhase::Ready);
        status.tunnel.as_mut().unwrap().parent = None;
        status.datapath = None;
        assert_eq!(plan(&stored, &cluster(true), later()), []);
        // A new mark for node-2: its status only.
        let mut moved = cluster(true);
        moved.tunnels[1].mark = Some(0x0700_0000);
        let writes = plan(&stored, &moved, later());
        assert!(
            matches!(writes.as_slice(), [Write::TunnelStatus { node, .. }] if node == "node-2"),
            "{writes:?}"
        );
    }

    #[test]
    fn only_ready_or_starting_tunnels_of_silent_agents_are_marked() {
        let stored = Stored {
            tunnels: BTreeMap::from([
                ("a".to_owned(), (Some(TunnelPhase::Ready), None)),
                ("b".to_owned(), (Some(TunnelPhase::Init), None)),
                ("c".to_owned(), (Some(TunnelPhase::Failed), None)),
                ("d".to_owned(), (Some(TunnelPhase::HeartbeatTimeout), None)),
                ("e".to_owned(), (Some(TunnelPhase::Ready), None)),
            ]),
            ..Stored::default()
        };
        let silent: BTreeSet<String> = ["a", "b", "c", "d"].map(str::to_owned).into();
        assert_eq!(
            timeouts(&stored, &silent),
            [
                Write::HeartbeatTimeout { node: "a".into() },
                Write::HeartbeatTimeout { node: "b".into() },
            ]
        );
        let marks = timeouts(&stored, &silent);
        let stored = carried_out(stored, &marks);
        assert_eq!(timeouts(&stored, &silent), []);
    }

    /// While statuses are due, a policy's first status and an EIP moved go
    /// before what only counts, whatever the plan's order; each node's
    /// tunnel is created before its status is written, in one lane.
    #[test]
    fn placements_are_sent_before_conditions_and_conditions_before_counts() {
        let fresh_writes = plan(&fresh(), &cluster(true), now());
        let waves = Waves::new(fresh_writes.clone(), &fresh());
        assert_eq!(
            waves.tunnels.iter().map(Vec::len).sum::<usize>() + waves.statuses.len(),
            fresh_writes.len()
        );
        assert_eq!(
            waves.tunnels,
            [
                vec![fresh_writes[0].clone()],
                vec![fresh_writes[1].clone(), fresh_writes[2].clone()],
            ]
        );
        let mut stored = carried_out(fresh(), &fresh_writes);
        let policy = |name: &str| PolicyRef::namespaced("team-a", name);
        // "api" has no status yet, "web" only counts one Pod more, "db"
        // (placed but not ready before) becomes ready, "cache" moves from
        // node-2.
        let mut status = cluster(true);
        let web = status.policies[0].clone();
        status.policies[0].pods = 2;
        status.policies[0].conditions[0].message = "2 pod(s) leave through node node-1".into();
        for name in ["db", "cache", "api"] {
            let mut p = web.clone();
            p.policy = policy(name);
            status.policies.push(p);
        }
        let mut earlier = cluster(true);
        earlier.policies[0].policy = policy("db");
        earlier.policies[0].conditions = vec![ready(false)];
        let mut moved = cluster(true);
        moved.policies[0].policy = policy("cache");
        moved.policies[0].node = Some("node-2".to_owned());
        for (name, before) in [("db", &earlier), ("cache", &moved)] {
            stored.policies.insert(policy(name), Object::default());
            let writes = plan(&stored, before, now());
            stored = carried_out(stored, &writes);
            assert!(stored.policies[&policy(name)].status.is_some());
        }
        stored.policies.insert(policy("api"), Object::default());
        let waves = Waves::new(plan(&stored, &status, later()), &stored);
        assert_eq!(waves.tunnels, Vec::<Vec<Write>>::new());
        let order: Vec<(String, Urgency)> = waves
            .statuses
            .iter()
            .map(|w| match w {
                Write::PolicyStatus { policy, .. } => (policy.to_string(), w.urgency(&stored)),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            order,
            [
                ("team-a/cache".to_owned(), Urgency::Placement),
                ("team-a/api".to_owned(), Urgency::Placement),
                ("team-a/db".to_owned(), Urgency::Conditions),
                ("team-a/web".to_owned(), Urgency::Details),
            ]
        );
    }

    /// While Pods load, a policy's count changes every run: once its
    /// status is written, a count update waits until [`DETAILS_EVERY`]
    /// has passed; a changed condition, and an object this controller has
    /// not written, go at once.
    #[test]
    fn count_updates_of_a_status_just_written_wait() {
        let first = plan(&fresh(), &cluster(true), now());
        let stored = carried_out(fresh(), &first);
        let start = Instant::now();
        let written: HashMap<String, Instant> = first
            .iter()
            .filter_map(Write::status_object)
            .map(|o| (o, start))
            .collect();
        assert_eq!(
            written.keys().collect::<BTreeSet<_>>(),
            BTreeSet::from([
                &"EgressGateway/egw".to_owned(),
                &"EgressPolicy/team-a/web".to_owned()
            ])
        );
        let mut status = cluster(true);
        status.policies[0].pods = 2;
        status.policies[0].conditions[0].message = "2 pod(s) leave through node node-1".into();
        let counted = plan(&stored, &status, later());
        assert_eq!(counted.len(), 1, "{counted:?}");
        assert_eq!(counted[0].urgency(&stored), Urgency::Details);

        let second = Duration::from_secs(1);
        let mut writes = counted.clone();
        let held = hold_details(&mut writes, &stored, &written, start + second);
        assert_eq!(writes, []);
        assert_eq!(
            held,
            Held {
                writes: 1,
                due: Some(start + DETAILS_EVERY)
            }
        );
        let mut writes = counted.clone();
        let held = hold_details(&mut writes, &stored, &written, start + DETAILS_EVERY);
        assert_eq!((writes, held), (counted.clone(), Held::default()));

        let mut writes = counted.clone();
        let held = hold_details(&mut writes, &stored, &HashMap::new(), start + second);
        assert_eq!((writes, held), (counted, Held::default()));

        let failed = plan(&stored, &cluster(false), later());
        assert!(
            failed
                .iter()
                .any(|w| matches!(w, Write::PolicyStatus { .. })),
            "{failed:?}"
        );
        let mut writes = failed.clone();
        let held = hold_details(&mut writes, &stored, &written, start + second);
        assert_eq!((writes, held), (failed, Held::default()));
    }

    #[test]
    fn objects_deleted_since_the_snapshot_are_left_alone() {
        let mut stored = fresh();
        stored.policies.clear();
        stored.gateways.clear();
        let writes = plan(&stored, &cluster(true), now());
        assert!(
            writes
                .iter()
                .all(|w| matches!(w, Write::CreateTunnel { .. } | Write::TunnelStatus { .. })),
            "{writes:?}"
        );
    }
}

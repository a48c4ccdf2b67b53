//! Planning: snapshot -> allocations, per-node dataplane state and status.
//!
//! The stages run in a fixed order, each a pure function of the snapshot and
//! the stages before it:
//! 1. `gateways`: which gateways are usable, which one is the cluster
//!    default, which nodes each selects;
//! 2. `tunnels`: tunnel IP / MAC / mark per node, stable across runs;
//! 3. `eips`: EIPs per policy from its gateway's pools;
//! 4. `placement`: the active gateway node of every EIP;
//! 5. `classify`: which pods each policy selects, and per source the
//!    longest-prefix table that encodes the precedence rules;
//! 6. `nodes` and `report`: the per-node state and the objects' status.
//!
//! Everything iterates in a sorted order, so the plan does not depend on the
//! order of the snapshot's lists.

mod classify;
mod edits;
mod eips;
mod gateways;
mod incremental;
mod matching;
mod nodes;
mod placement;
mod publish;
mod report;
mod scope;
mod tunnels;

pub use edits::PolicyChange;
pub use incremental::{LastChange, Planner, PodChange};
pub use publish::Publisher;
pub use scope::{PodScope, gateways_selecting, pod_scope, scoped};

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::Serialize;

use crate::model::{Pod, Policy, Snapshot};
use crate::net::Family;
use crate::state::NodeState;
use crate::status::{ClusterStatus, Reason};

/// The result of planning a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Desired dataplane per node, by node name.
    pub nodes: BTreeMap<String, NodeState>,
    /// Allocations and status to write back.
    pub status: ClusterStatus,
}

/// Plans every node of `snapshot`.
pub fn plan(snapshot: &Snapshot) -> Plan {
    build(snapshot, States::All)
}

/// Plans the cluster but builds the dataplane state of `node` only (what an
/// agent needs); allocations and status are the full cluster's.
pub fn plan_node(snapshot: &Snapshot, node: &str) -> Plan {
    build(snapshot, States::One(node))
}

/// Plans `node` as an agent does: like [`plan_node`], but every EIP (and
/// `useNodeIP` policy) stays where the controller published it (the
/// gateways' and policies' status, or where an agent reports holding it)
/// and one the controller has not placed yet is placed nowhere. An agent
/// thus never derives ownership on its own, and agents and a controller of
/// different versions agree on who holds what during a rolling upgrade.
/// Failover among the candidates stays the data plane's (see
/// [`crate::failover`]). An agent writes no status, so none is built:
/// the result is `node`'s state, `None` for a node not in the snapshot.
pub fn plan_node_published(snapshot: &Snapshot, node: &str) -> Option<NodeState> {
    build_with(snapshot, States::One(node), Placement::Published, false)
        .nodes
        .remove(node)
}

/// Plans the cluster's allocations and status, and no node's dataplane
/// state: what the controller writes. The same as `plan(snapshot).status`,
/// without building millions of classification and SNAT entries nobody
/// reads.
pub fn plan_status(snapshot: &Snapshot) -> ClusterStatus {
    build(snapshot, States::None).status
}

/// What the controller publishes: the allocations and status, and per
/// gateway the pods its nodes' agents read instead of every pod
/// (`scope::gateway_pods`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published<'a> {
    /// The same as [`plan_status`]'s.
    pub status: ClusterStatus,
    /// Per gateway name, its pods, sorted by namespace and name; a gateway
    /// whose policies select nothing is left out.
    pub gateway_pods: BTreeMap<String, Vec<&'a Pod>>,
}

/// [`plan_status`], and per gateway the pods its nodes need, from one
/// selection of the pods.
pub fn plan_published(snapshot: &Snapshot) -> Published<'_> {
    let Stages {
        gateways,
        tunnels,
        cluster_cidrs: _,
        policies,
        placed,
    } = stages(snapshot, Placement::Own);
    let selecting: Vec<&Policy> = policies.iter().map(|w| &**w.policy).collect();
    let selection = classify::select(&snapshot.pods, &selecting, &snapshot.namespaces);
    let gateway_pods = scope::gateway_pods(&selection, &policies);
    let classified = classify::Classified {
        sources: Vec::new(),
        pod_counts: selection.counts,
    };
    let status = report::status(
        snapshot,
        &gateways,
        &tunnels,
        &policies,
        &placed,
        &classified,
    );
    Published {
        status,
        gateway_pods,
    }
}

/// Which nodes' dataplane states a plan builds.
#[derive(Debug, Clone, Copy)]
enum States<'n> {
    All,
    One(&'n str),
    None,
}

/// Where units without a place go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// To a ready node, as the controller places them.
    Own,
    /// Nowhere: they wait for the controller to publish a node.
    Published,
}

fn build(snapshot: &Snapshot, states: States<'_>) -> Plan {
    build_with(snapshot, states, Placement::Own, true)
}

/// Runs the stages; without `report`, the status is left empty.
/// What the cluster-wide stages (1 to 4) decide; they read no Pod.
struct Stages<'a> {
    gateways: gateways::Gateways<'a>,
    tunnels: tunnels::Tunnels,
    cluster_cidrs: Vec<IpNet>,
    policies: Vec<Work<'a>>,
    placed: placement::Placed<'a>,
}

/// Runs the cluster-wide stages on `snapshot`.
fn stages(snapshot: &Snapshot, placement: Placement) -> Stages<'_> {
    let gateways = gateways::resolve(snapshot);
    let tunnels = tunnels::allocate(snapshot, &gateways);
    let gateways = gateways.with_eligibility(snapshot, &tunnels);
    let cluster_cidrs = nodes::cluster_cidrs(snapshot);
    let mut policies = eips::allocate(snapshot, &gateways, &cluster_cidrs);
    let placed = placement::place(
        snapshot,
        &gateways,
        &mut policies,
        placement == Placement::Own,
    );
    Stages {
        gateways,
        tunnels,
        cluster_cidrs,
        policies,
        placed,
    }
}

fn build_with(snapshot: &Snapshot, states: States<'_>, placement: Placement, report: bool) -> Plan {
    let stages = stages(snapshot, placement);
    // The status needs only how many pods each policy selects.
    let classified = match states {
        States::None => classify::count(snapshot, &stages.policies),
        States::All | States::One(_) => {
            classify::classify(snapshot, &stages.policies, &stages.cluster_cidrs)
        }
    };
    let nodes = match states {
        States::None => BTreeMap::new(),
        States::All | States::One(_) => {
            let only = match states {
                States::One(node) => Some(node),
                _ => None,
            };
            let serving = nodes::serving(snapshot, &stages, only, None);
            nodes::build(&serving, &classified)
        }
    };
    let Stages {
        gateways,
        tunnels,
        policies,
        placed,
        ..
    } = stages;
    let status = if report {
        report::status(
            snapshot,
            &gateways,
            &tunnels,
            &policies,
            &placed,
            &classified,
        )
    } else {
        ClusterStatus::default()
    };
    Plan { nodes, status }
}

/// A policy on its way through the stages, in precedence-neutral age order.
#[derive(Debug)]
struct Work<'a> {
    policy: &'a Arc<Policy>,
    /// The gateway it uses, once resolved.
    gateway: Option<&'a str>,
    /// Why it cannot be allocated, if it cannot.
    failure: Option<(Reason, String)>,
    /// Its EIP per family ([`fi`]); `None` for a family it does not use.
    eips: [Option<IpAddr>; 2],
    /// Families it leaves with the node IP (`useNodeIP`).
    node_ip: [bool; 2],
    /// Active gateway node per family, once placed.
    nodes: [Option<&'a str>; 2],
    /// EIPs kept for a policy that cannot be served now (its previous ones).
    reserved: Vec<IpAddr>,
    /// Whether its gateway fails closed (`spec.failClosed`).
    fail_closed: bool,
}

impl Work<'_> {
    /// Whether the policy classifies traffic of `family`: it has a gateway
    /// node for it, or it has none and fails closed (the traffic is then
    /// dropped rather than left to leave with a node's address).
    fn active(&self, family: Family) -> bool {
        let uses =
            self.gateway.is_some() && (self.eips[fi(family)].is_some() || self.node_ip[fi(family)]);
        self.failure.is_none() && (self.nodes[fi(family)].is_some() || (self.fail_closed && uses))
    }
}

/// Index of a family in per-family arrays.
fn fi(family: Family) -> usize {
    match family {
        Family::Ipv4 => 0,
        Family::Ipv6 => 1,
    }
}

#[cfg(test)]
mod tests;

/// Feeds a plan's allocations back into `snapshot`, as the controller does
/// by writing status: the next plan then keeps EIPs, gateway nodes and
/// tunnel identities where they are.
pub fn remember(snapshot: &mut Snapshot, status: &ClusterStatus) {
    let by_policy: BTreeMap<&crate::model::PolicyRef, &crate::status::PolicyStatus> =
        status.policies.iter().map(|s| (&s.policy, s)).collect();
    for policy in &mut snapshot.policies {
        if let Some(s) = by_policy.get(&policy.id) {
            let policy = Arc::make_mut(policy);
            policy.previous_eips = s
                .eip_ipv4
                .map(IpAddr::V4)
                .into_iter()
                .chain(s.eip_ipv6.map(IpAddr::V6))
                .collect();
            policy.previous_node.clone_from(&s.node);
        }
    }
    let gateway_status: BTreeMap<&str, &crate::status::GatewayStatus> = status
        .gateways
        .iter()
        .map(|g| (g.gateway.as_str(), g))
        .collect();
    for gateway in &mut snapshot.gateways {
        gateway.previous_nodes = gateway_status
            .get(gateway.name.as_str())
            .into_iter()
            .flat_map(|g| &g.nodes)
            .flat_map(|n| n.eips.iter().filter_map(|e| Some((e.ip?, n.name.clone()))))
            .collect();
    }
    snapshot.tunnels = status
        .tunnels
        .iter()
        .map(|t| crate::model::Tunnel {
            node: t.node.clone(),
            ipv4: t.ipv4,
            ipv6: t.ipv6,
            mac: Some(t.mac),
            mark: t.mark,
        })
        .collect();
}

//! Stage 1: usable gateways, the cluster default, selected and eligible nodes.

use std::collections::BTreeMap;

use ipnet::IpNet;

use crate::model::{Gateway, Node, Snapshot};
use crate::net::Family;
use crate::status::Reason;

use super::fi;
use super::tunnels::Tunnels;

/// One gateway with what the planner learned about it.
#[derive(Debug)]
pub(super) struct GatewayInfo<'a> {
    pub gateway: &'a Gateway,
    /// Why the gateway cannot be used at all.
    pub problem: Option<(Reason, String)>,
    /// Nodes its selector matches, sorted.
    pub selected: Vec<&'a str>,
    /// Per family ([`fi`]): selected nodes that can carry that family's
    /// traffic now. Sorted.
    pub eligible: [Vec<&'a str>; 2],
    /// Per family: selected nodes that have what carrying that family's
    /// traffic takes (addresses, a tunnel identity, a mark), ready or not.
    /// An EIP stays on such a node and they are its failover candidates:
    /// whether one is alive is for the data plane to find out, not for the
    /// API server's view of it. Sorted.
    pub candidates: [Vec<&'a str>; 2],
    /// Notes for the status message (an ignored `clusterDefault`, a missing pool).
    pub notes: Vec<String>,
}

impl GatewayInfo<'_> {
    /// Whether `node` can carry this gateway's traffic of `family`.
    pub fn eligible(&self, node: &str, family: Family) -> bool {
        self.eligible[fi(family)].binary_search(&node).is_ok()
    }

    /// Whether `node` may carry this gateway's traffic of `family`, ready or not.
    pub fn candidate(&self, node: &str, family: Family) -> bool {
        self.candidates[fi(family)].binary_search(&node).is_ok()
    }

    /// Whether `node` can carry traffic of some family.
    pub fn eligible_any(&self, node: &str) -> bool {
        Family::ALL.into_iter().any(|f| self.eligible(node, f))
    }
}

/// All gateways by name, and the cluster default.
#[derive(Debug)]
pub(super) struct Gateways<'a> {
    pub by_name: BTreeMap<&'a str, GatewayInfo<'a>>,
    pub default: Option<&'a str>,
}

/// Resolves validity and the default; eligibility comes with [`Gateways::with_eligibility`].
///
/// The oldest gateway claiming `clusterDefault` is the default even while it
/// is invalid: its policies are then told so, rather than silently moving to
/// a younger default gateway and another EIP.
pub(super) fn resolve(snapshot: &Snapshot) -> Gateways<'_> {
    resolve_with(snapshot, true)
}

/// [`resolve`] without what only the stages read: each gateway's validity
/// and the default alone, with no notes and no nodes.
pub(super) fn validity(snapshot: &Snapshot) -> Gateways<'_> {
    resolve_with(snapshot, false)
}

/// [`resolve`], with the notes and the nodes selected when `whole`.
fn resolve_with(snapshot: &Snapshot, whole: bool) -> Gateways<'_> {
    let mut by_age: Vec<&Gateway> = snapshot.gateways.iter().collect();
    by_age.sort_by(|a, b| (&a.age, &a.name).cmp(&(&b.age, &b.name)));
    by_age.dedup_by(|a, b| a.name == b.name);

    let cluster = match whole {
        true => super::nodes::cluster_cidrs(snapshot),
        false => Vec::new(),
    };
    let mut by_name = BTreeMap::new();
    let mut default = None;
    let mut usable: Vec<&Gateway> = Vec::new();
    for gw in by_age {
        let problem = if gw.errors.is_empty() {
            pool_overlap(gw, &usable)
        } else {
            Some((Reason::Invalid, gw.errors.join("; ")))
        };
        if problem.is_none() {
            usable.push(gw);
        }
        let mut notes = Vec::new();
        if gw.cluster_default {
            match default {
                None => default = Some(gw.name.as_str()),
                Some(older) => notes.push(format!(
                    "clusterDefault is ignored: {older} is the older cluster default gateway"
                )),
            }
        }
        let selected = match whole {
            true => {
                notes.extend(pool_notes(snapshot, gw, &cluster, problem.is_none()));
                selected_nodes(snapshot, gw)
            }
            false => Vec::new(),
        };
        by_name.insert(
            gw.name.as_str(),
            GatewayInfo {
                gateway: gw,
                problem,
                selected,
                eligible: [Vec::new(), Vec::new()],
                candidates: [Vec::new(), Vec::new()],
                notes,
            },
        );
    }
    Gateways { by_name, default }
}

/// Notes on `gw`'s pools: addresses the cluster's own (`cluster`, its
/// prefixes, and nodes' ExternalIPs), and no pool for the enabled
/// families of a gateway that is otherwise `usable`.
fn pool_notes(snapshot: &Snapshot, gw: &Gateway, cluster: &[IpNet], usable: bool) -> Vec<String> {
    let mut notes = Vec::new();
    let enabled: Vec<Family> = snapshot.config.enabled_families().collect();
    for family in &enabled {
        for range in gw.pool(*family).ranges() {
            if let Some(net) = cluster.iter().find(|net| {
                Family::of_net(**net) == *family
                    && range.overlaps(&crate::net::IpRange::of_net(**net))
            }) {
                notes.push(format!(
                    "spec.ippools.{family}: {range} overlaps {net}, one of the cluster's own \
                     prefixes: those addresses are never handed out"
                ));
            }
        }
    }
    for node in &snapshot.nodes {
        for ip in &node.external_addresses {
            if gw.pool(Family::of(*ip)).contains(*ip) {
                notes.push(format!(
                    "spec.ippools.{}: {ip} is node {}'s ExternalIP: it is never handed out",
                    Family::of(*ip),
                    node.name
                ));
            }
        }
    }
    if usable && enabled.iter().all(|f| gw.pool(*f).is_empty()) {
        notes.push(
            "it has no EIP pool for the enabled families, so only useNodeIP policies can use it"
                .into(),
        );
    }
    notes
}

/// The nodes `gw`'s selector matches, sorted.
fn selected_nodes<'a>(snapshot: &'a Snapshot, gw: &Gateway) -> Vec<&'a str> {
    let mut selected: Vec<&str> = snapshot
        .nodes
        .iter()
        .filter(|n| gw.node_selector.matches(&n.labels))
        .map(|n| n.name.as_str())
        .collect();
    selected.sort_unstable();
    selected.dedup();
    selected
}

fn pool_overlap(gw: &Gateway, older: &[&Gateway]) -> Option<(Reason, String)> {
    for family in Family::ALL {
        for range in gw.pool(family).ranges() {
            for other in older {
                if let Some(hit) = other
                    .pool(family)
                    .ranges()
                    .iter()
                    .find(|r| r.overlaps(range))
                {
                    return Some((
                        Reason::PoolOverlap,
                        format!(
                            "spec.ippools.{family}: {range} overlaps {hit} of the older gateway {}; \
                             an EIP can belong to one gateway only",
                            other.name
                        ),
                    ));
                }
            }
        }
    }
    None
}

/// Why a node cannot carry `family` traffic now, if it cannot.
pub(super) fn ineligibility(
    node: Option<&Node>,
    tunnels: &Tunnels,
    family: Family,
) -> Option<&'static str> {
    let Some(node) = node else {
        return Some("no such node");
    };
    if !node.ready {
        return Some("not ready");
    }
    unfitness(node, tunnels, family)
}

/// What a node lacks to carry `family` traffic at all, readiness aside.
fn unfitness(node: &Node, tunnels: &Tunnels, family: Family) -> Option<&'static str> {
    if node.addresses.is_empty() {
        return Some("no InternalIP address");
    }
    let Some(tunnel) = tunnels.by_node.get(&node.name) else {
        return Some("no tunnel identity");
    };
    if tunnel.mark.is_none() {
        return Some("no mark left in the mark mask");
    }
    let address = match family {
        Family::Ipv4 => tunnel.ipv4.is_some(),
        Family::Ipv6 => tunnel.ipv6.is_some(),
    };
    (!address).then_some(match family {
        Family::Ipv4 => "no tunnel IPv4 address left in the tunnel subnet",
        Family::Ipv6 => "no tunnel IPv6 address left in the tunnel subnet",
    })
}

impl<'a> Gateways<'a> {
    /// Fills in which selected nodes can carry traffic now, per family.
    pub fn with_eligibility(mut self, snapshot: &'a Snapshot, tunnels: &Tunnels) -> Self {
        let nodes: BTreeMap<&str, &Node> = snapshot
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n))
            .collect();
        for info in self.by_name.values_mut() {
            if info.problem.is_some() {
                continue;
            }
            for family in Family::ALL {
                info.eligible[fi(family)] = info
                    .selected
                    .iter()
                    .copied()
                    .filter(|n| ineligibility(nodes.get(n).copied(), tunnels, family).is_none())
                    .collect();
                info.candidates[fi(family)] = info
                    .selected
                    .iter()
                    .copied()
                    .filter(|n| {
                        nodes
                            .get(n)
                            .is_some_and(|node| unfitness(node, tunnels, family).is_none())
                    })
                    .collect();
            }
        }
        self
    }
}

//! Which pods a node's own plan reads.
//!
//! A node's dataplane state holds the classification of its own pods'
//! addresses and, when some gateway may place traffic on the node, the
//! SNAT entries and reply routes for every pod whose traffic that gateway
//! carries. A node no gateway selects therefore needs only its own pods.
//! A node some gateway selects needs, besides its own, the pods of that
//! gateway ([`gateway_pods`]): the controller, which watches every pod,
//! publishes them per gateway, and the node's agent reads those instead of
//! every pod in the cluster. The property tests
//! `a_nodes_state_from_its_scoped_pods_is_the_whole_plans` and
//! `a_gateway_nodes_state_from_its_gateways_pods_is_the_whole_plans` check
//! that the state planned from either set equals the whole plan's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use serde::Serialize;

use crate::model::{Pod, Snapshot};

use super::Work;
use super::classify::Selection;

/// The pods a node's plan needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PodScope {
    /// The pods scheduled on the node.
    Node,
    /// The node's own pods and the pods of the gateways selecting it, as
    /// the controller publishes them ([`gateway_pods`]).
    Gateways,
    /// Every pod in the cluster.
    Cluster,
}

impl PodScope {
    /// The scope's name in logs, metrics and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Gateways => "gateways",
            Self::Cluster => "cluster",
        }
    }
}

/// The pods `node`'s plan needs, decided from the gateways and the node's
/// labels (the snapshot's pods are not read): its own while no gateway
/// selects it ([`gateways_selecting`]), else every pod the gateways
/// selecting it may carry traffic of (`Gateways`; every pod in the cluster
/// holds them too).
pub fn pod_scope(snapshot: &Snapshot, node: &str) -> PodScope {
    if gateways_selecting(snapshot, node).is_empty() {
        PodScope::Node
    } else {
        PodScope::Gateways
    }
}

/// The names of the gateways whose node selector matches `node`'s labels,
/// sorted. Any gateway counts, valid or not, ready node or not: a gateway
/// that becomes valid, or a node that becomes ready, must find the pods
/// already there. A node the snapshot does not hold yet has none.
pub fn gateways_selecting<'a>(snapshot: &'a Snapshot, node: &str) -> Vec<&'a str> {
    let Some(labels) = snapshot
        .nodes
        .iter()
        .find(|n| n.name == node)
        .map(|n| &n.labels)
    else {
        return Vec::new();
    };
    let mut names: Vec<&str> = snapshot
        .gateways
        .iter()
        .filter(|g| g.node_selector.matches(labels))
        .map(|g| g.name.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Per gateway, by name, the pods its nodes' plans need besides their
/// own, sorted by namespace and name: every eligible pod a policy using the
/// gateway selects (the cluster default for a policy that names none), and
/// every selected pod that shares an address with one of those, however
/// far the sharing goes. Of pods claiming one address the first claims it
/// (see `classify`), so a gateway node decides who does among all of them,
/// as the whole plan does. Gateways whose policies select nothing are
/// left out.
pub(super) fn gateway_pods<'a>(
    selection: &Selection<'a>,
    works: &[Work<'a>],
) -> BTreeMap<String, Vec<&'a Pod>> {
    let pods = &selection.pods;
    // Per selected pod: the gateways of the policies selecting it.
    let mut gateways: Vec<BTreeSet<&str>> = selection
        .selecting
        .iter()
        .map(|policies| policies.iter().filter_map(|i| works[*i].gateway).collect())
        .collect();
    // Pods sharing an address, joined: each takes the gateways of all.
    let mut joined = Joined::new(pods.len());
    let mut first: HashMap<IpAddr, usize, foldhash::fast::RandomState> = HashMap::default();
    for (p, pod) in pods.iter().enumerate() {
        if selection.selecting[p].is_empty() {
            continue;
        }
        for ip in &pod.ips {
            if let Some(q) = first.insert(*ip, p) {
                joined.join(p, q);
            }
        }
    }
    let mut shared: HashMap<usize, BTreeSet<&str>> = HashMap::new();
    for p in joined.shared() {
        shared
            .entry(joined.root(p))
            .or_default()
            .extend(gateways[p].iter().copied());
    }
    for p in joined.shared() {
        gateways[p].clone_from(&shared[&joined.root(p)]);
    }
    let mut out: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
    for (pod, names) in pods.iter().zip(&gateways) {
        for name in names {
            out.entry((*name).to_owned()).or_default().push(pod);
        }
    }
    out
}

/// Disjoint sets of pods (by index) that share addresses.
struct Joined {
    parent: Vec<usize>,
    /// Pods joined to another.
    shared: BTreeSet<usize>,
}

impl Joined {
    fn new(n: usize) -> Self {
        Self {
            parent: (0..n).collect(),
            shared: BTreeSet::new(),
        }
    }

    fn root(&self, mut p: usize) -> usize {
        while self.parent[p] != p {
            p = self.parent[p];
        }
        p
    }

    fn join(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.root(a), self.root(b));
        if ra != rb {
            self.parent[ra.max(rb)] = ra.min(rb);
        }
        self.shared.insert(a);
        self.shared.insert(b);
    }

    fn shared(&self) -> impl Iterator<Item = usize> + '_ {
        self.shared.iter().copied()
    }
}

/// `snapshot` with only the pods `scope` keeps for `node`: what the
/// node's agent holds. `Gateways` keeps the node's own pods and those
/// `gateway_pods` (as [`crate::plan_published`] gives them) holds for the
/// gateways selecting the node.
pub fn scoped(
    snapshot: &Snapshot,
    node: &str,
    scope: PodScope,
    gateway_pods: &BTreeMap<String, Vec<&Pod>>,
) -> Snapshot {
    let mut out = snapshot.clone();
    match scope {
        PodScope::Cluster => {}
        PodScope::Node => out.pods.retain(|p| p.node.as_deref() == Some(node)),
        PodScope::Gateways => {
            // The node's own pods from its watch, the others as published.
            out.pods.retain(|p| p.node.as_deref() == Some(node));
            let published = gateways_selecting(snapshot, node)
                .into_iter()
                .filter_map(|g| gateway_pods.get(g))
                .flatten()
                .filter(|p| p.node.as_deref() != Some(node));
            let mut seen = BTreeSet::new();
            for pod in published {
                if seen.insert((pod.namespace.as_str(), pod.name.as_str())) {
                    out.pods.push(Pod::clone(pod));
                }
            }
        }
    }
    out
}

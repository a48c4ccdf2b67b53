//! Which pods a node's own plan reads.
//!
//! A node's dataplane state holds the classification of its own pods'
//! addresses and, when some gateway may place traffic on the node, the
//! SNAT entries and reply routes for every pod whose traffic that gateway
//! carries. A node no gateway selects therefore needs only its own pods:
//! its agent watches those, not every pod in the cluster. The property
//! test `a_nodes_state_from_its_scoped_pods_is_the_whole_plans` checks
//! that the state planned from the scoped pods equals the whole plan's.

use serde::Serialize;

use crate::model::Snapshot;

/// The pods a node's plan needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PodScope {
    /// The pods scheduled on the node.
    Node,
    /// Every pod in the cluster: some gateway selects the node.
    Cluster,
}

impl PodScope {
    /// The scope's name in logs, metrics and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Cluster => "cluster",
        }
    }
}

/// The pods `node`'s plan needs, decided from the gateways and the node's
/// labels (the snapshot's pods are not read). Any gateway counts, valid or
/// not, ready node or not: a gateway that becomes valid, or a node that
/// becomes ready, must find the pods already there. A node the snapshot
/// does not hold yet needs its own pods only.
pub fn pod_scope(snapshot: &Snapshot, node: &str) -> PodScope {
    let Some(labels) = snapshot
        .nodes
        .iter()
        .find(|n| n.name == node)
        .map(|n| &n.labels)
    else {
        return PodScope::Node;
    };
    if snapshot
        .gateways
        .iter()
        .any(|g| g.node_selector.matches(labels))
    {
        PodScope::Cluster
    } else {
        PodScope::Node
    }
}

/// `snapshot` with only the pods `scope` keeps for `node`: what the
/// node's agent holds.
pub fn scoped(snapshot: &Snapshot, node: &str, scope: PodScope) -> Snapshot {
    let mut out = snapshot.clone();
    if scope == PodScope::Node {
        out.pods.retain(|p| p.node.as_deref() == Some(node));
    }
    out
}

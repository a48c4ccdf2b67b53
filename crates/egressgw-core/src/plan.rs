//! Planning (in progress).
use std::collections::BTreeMap;

use crate::model::Snapshot;
use crate::state::NodeState;
use crate::status::ClusterStatus;

/// The result of planning a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Plan {
    /// Desired dataplane per node, by node name.
    pub nodes: BTreeMap<String, NodeState>,
    /// Allocations and status to write back.
    pub status: ClusterStatus,
}

/// Plans `snapshot`.
pub fn plan(_snapshot: &Snapshot) -> Plan {
    Plan::default()
}

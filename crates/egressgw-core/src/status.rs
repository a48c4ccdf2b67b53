//! The planner's output for the API: allocations and status of every object.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::Serialize;

use crate::model::{Mac, PolicyRef};

/// A condition as it goes into an object's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Condition {
    /// `Ready` or `Allocated`.
    #[serde(rename = "type")]
    pub type_: ConditionType,
    /// Whether it holds.
    pub status: bool,
    /// A CamelCase reason a program can match on.
    pub reason: Reason,
    /// A sentence a person can act on.
    pub message: String,
}

/// Condition types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum ConditionType {
    /// The object is doing its job: traffic flows as it says.
    Ready,
    /// Its EIPs (and gateway node) are allocated.
    Allocated,
}

/// Reasons a condition holds or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Reason {
    /// Everything needed is in place.
    Allocated,
    /// Traffic leaves through the gateway node.
    Active,
    /// The spec failed validation.
    Invalid,
    /// The named gateway does not exist.
    GatewayNotFound,
    /// No gateway name and no cluster default gateway.
    NoDefaultGateway,
    /// The gateway itself is not usable (see its own status).
    GatewayInvalid,
    /// A pinned EIP is not in the gateway's pool.
    EipNotInPool,
    /// The pool has no address left for this policy.
    PoolExhausted,
    /// The gateway has no pool for any enabled family.
    NoPool,
    /// No ready node matches the gateway's node selector.
    NoReadyNode,
    /// A pool overlaps an older gateway's pool.
    PoolOverlap,
    /// Another host on the external segment answers for the EIP.
    EipInUse,
    /// The EIP lies in the cluster's own prefixes (pods, services, nodes,
    /// tunnel).
    EipInCluster,
    /// A pinned EIP belongs to another namespace, or is the shared default.
    EipTaken,
    /// The gateway's namespace selector does not admit the policy's namespace.
    NamespaceNotAllowed,
}

/// Status of an `EgressPolicy` / `EgressClusterPolicy`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyStatus {
    /// The policy.
    pub policy: PolicyRef,
    /// Allocated IPv4 EIP.
    pub eip_ipv4: Option<Ipv4Addr>,
    /// Allocated IPv6 EIP.
    pub eip_ipv6: Option<Ipv6Addr>,
    /// Whether it leaves with its gateway node's own address.
    pub use_node_ip: bool,
    /// The active gateway node.
    pub node: Option<String>,
    /// Pods it currently selects.
    pub pods: usize,
    /// `Allocated` then `Ready`.
    pub conditions: Vec<Condition>,
}

/// Status of an `EgressGateway`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GatewayStatus {
    /// Gateway name.
    pub gateway: String,
    /// Every selected node, with the EIPs active on it.
    pub nodes: Vec<GatewayNodeStatus>,
    /// Pool usage.
    pub ip_usage: IpUsage,
    /// `Ready`.
    pub conditions: Vec<Condition>,
}

/// One selected node of a gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GatewayNodeStatus {
    /// Node name.
    pub name: String,
    /// Whether it can carry traffic.
    pub ready: bool,
    /// EIPs active on it, each with the policies using it.
    pub eips: Vec<EipStatus>,
}

/// An EIP (or, for `useNodeIP` policies, the node's own address) in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EipStatus {
    /// The EIP; `None` for the node-IP entry.
    pub ip: Option<IpAddr>,
    /// Policies using it.
    pub policies: Vec<PolicyRef>,
    /// The nodes that take it over, in order, when the data plane finds
    /// this one dead (see [`crate::failover`]).
    pub standbys: Vec<String>,
}

/// Pool usage totals. Totals saturate at `u64::MAX` for huge IPv6 pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IpUsage {
    /// Addresses in the IPv4 pool.
    pub ipv4_total: u64,
    /// IPv4 addresses not in use by any policy.
    pub ipv4_free: u64,
    /// Addresses in the IPv6 pool.
    pub ipv6_total: u64,
    /// IPv6 addresses not in use by any policy.
    pub ipv6_free: u64,
}

/// A node's tunnel identity as it should be stored (`EgressTunnel`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct TunnelAllocation {
    /// Node name.
    pub node: String,
    /// Tunnel IPv4 address.
    pub ipv4: Option<Ipv4Addr>,
    /// Tunnel IPv6 address.
    pub ipv6: Option<Ipv6Addr>,
    /// Device MAC.
    pub mac: Mac,
    /// Mark of this node as a gateway; `None` if no gateway selects it.
    pub mark: Option<u32>,
    /// The node's underlay address (the tunnel's parent address).
    pub underlay: Option<IpAddr>,
}

/// Everything the controller writes back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ClusterStatus {
    /// Per policy, sorted by policy.
    pub policies: Vec<PolicyStatus>,
    /// Per gateway, sorted by name.
    pub gateways: Vec<GatewayStatus>,
    /// Per node, sorted by node.
    pub tunnels: Vec<TunnelAllocation>,
    /// Where each EIP is active.
    pub eip_nodes: BTreeMap<IpAddr, String>,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl fmt::Display for ConditionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

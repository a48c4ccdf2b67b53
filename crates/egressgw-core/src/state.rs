//! The planner's output for one node: what its dataplane should be.
//!
//! Every collection is sorted and free of duplicates, so two states compare
//! equal exactly when they mean the same thing, and `diff` can walk them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::IpNet;
use serde::Serialize;

use crate::model::{Mac, PolicyRef};

/// The desired dataplane of one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeState {
    /// The node.
    pub node: String,
    /// `egress.vxlan`; `None` until the node has a tunnel identity and an
    /// underlay address.
    pub vxlan: Option<Vxlan>,
    /// The other nodes' tunnel endpoints (neighbour + FDB entries).
    pub peers: Vec<Peer>,
    /// One routing table per gateway node this node may send through.
    pub routes: Vec<Route>,
    /// `ip rule fwmark <mark>/<mask> lookup <table>`: one per route, plus one
    /// for the reply table when `replies` is not empty.
    pub rules: Vec<Rule>,
    /// On a gateway node: the way back through the tunnel for each pod of
    /// another node that leaves through this one. Replies of connections that
    /// came out of the tunnel carry the reply mark and look these up.
    /// Shared by the copies of the state that differ elsewhere (see
    /// [`crate::failover::Resolved::state`]).
    pub replies: Arc<Vec<ReplyRoute>>,
    /// In-cluster prefixes: traffic to them is never classified.
    pub cluster_cidrs: Vec<IpNet>,
    /// (local pod source, destination prefix) -> what to do; longest
    /// destination prefix wins per source.
    pub classify: Vec<ClassifyEntry>,
    /// On a gateway node: (pod source, destination prefix) -> SNAT target,
    /// for pods anywhere in the cluster that leave through this node. Only
    /// `Tunnel` and `Local` decisions for this node appear here, so these
    /// entries apply to packets that came out of the tunnel or were
    /// classified `Local` on this node, never to other traffic. Per source
    /// the longest destination prefix wins, as for `classify`. Shared by
    /// the copies of the state that differ elsewhere.
    pub snat: Arc<Vec<SnatEntry>>,
    /// EIPs this node must own and announce.
    pub eips: Vec<OwnedEip>,
    /// The failover groups this node's entries refer to, or whose EIP it
    /// may hold, by id (ids are positions, the groups sorted by key): what
    /// [`crate::failover::resolve`] needs to move this node's decisions to
    /// the next live candidate without a new plan.
    pub groups: Vec<Group>,
}

/// A failover group: one EIP of a gateway (or one `useNodeIP` policy's
/// family) and every node that may carry it, in order. The first is the
/// planned active node, the others are its standbys.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Group {
    /// Index in [`NodeState::groups`]; [`ClassifyEntry::group`] refers to it.
    pub id: u32,
    /// What the group is, stable across plans: `<gateway>/<eip>`, or
    /// `<gateway>/node-ip/<policy>/<family>`.
    pub key: String,
    /// The gateway.
    pub gateway: String,
    /// The EIP; `None` for a `useNodeIP` group.
    pub eip: Option<IpAddr>,
    /// The nodes that may carry it, active first; never empty.
    pub candidates: Vec<Candidate>,
    /// Whether the group's traffic is dropped while no candidate is live
    /// (`spec.failClosed` of the gateway) rather than sent the normal way.
    pub fail_closed: bool,
}

/// A node that may carry a group's traffic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Candidate {
    /// Node name.
    pub node: String,
    /// Its gateway mark (what a source sets to send through it).
    pub mark: u32,
}

/// `egress.vxlan` as it should be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Vxlan {
    /// Device name.
    pub name: String,
    /// VNI.
    pub vni: u32,
    /// UDP destination port.
    pub port: u16,
    /// Local underlay address: the parent interface's address.
    pub local: IpAddr,
    /// Device MAC.
    pub mac: Mac,
    /// Tunnel IPv4 address (a host address inside the tunnel subnet).
    pub ipv4: Option<Ipv4Addr>,
    /// Tunnel IPv6 address.
    pub ipv6: Option<Ipv6Addr>,
    /// Prefix length of the tunnel IPv4 subnet.
    pub ipv4_prefix_len: u8,
    /// Prefix length of the tunnel IPv6 subnet.
    pub ipv6_prefix_len: u8,
    /// Turn tx checksum offload off.
    pub disable_checksum_offload: bool,
}

impl Vxlan {
    /// Bytes the encapsulation adds (outer IP + UDP + VXLAN + inner Ethernet):
    /// the device MTU is the parent's minus this.
    pub fn overhead(&self) -> u32 {
        match self.local {
            IpAddr::V4(_) => 50,
            IpAddr::V6(_) => 70,
        }
    }
}

/// Another node's tunnel endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Peer {
    /// Peer node name.
    pub node: String,
    /// Peer's underlay address (FDB destination).
    pub underlay: IpAddr,
    /// Peer's `egress.vxlan` MAC.
    pub mac: Mac,
    /// Peer's tunnel IPv4 address (permanent neighbour entry).
    pub ipv4: Option<Ipv4Addr>,
    /// Peer's tunnel IPv6 address.
    pub ipv6: Option<Ipv6Addr>,
}

/// The routing table that sends marked traffic to one gateway node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Route {
    /// Table number.
    pub table: u32,
    /// The gateway node.
    pub gateway: String,
    /// `default via <ipv4> dev egress.vxlan onlink`.
    pub via_ipv4: Option<Ipv4Addr>,
    /// `default via <ipv6> dev egress.vxlan onlink`.
    pub via_ipv6: Option<Ipv6Addr>,
}

/// `<dst> via <via> dev egress.vxlan onlink` in the reply table.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ReplyRoute {
    /// The pod address (a host route).
    pub dst: IpAddr,
    /// The tunnel IP of the pod's node, in the pod's family.
    pub via: IpAddr,
    /// The pod's node, shared by the entries of its pods.
    pub origin: Arc<str>,
    /// Table number (the reply table).
    pub table: u32,
}

/// `ip rule fwmark <mark>/<mask> lookup <table> priority <priority>`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Rule {
    /// Rule priority.
    pub priority: u32,
    /// Mark value.
    pub mark: u32,
    /// Mark mask: egressgw's bits only.
    pub mask: u32,
    /// Table to look up.
    pub table: u32,
}

/// What happens to a classified packet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Action {
    /// Leave the normal way (an excluded destination carved out of a wider one).
    Bypass,
    /// Mark it for the gateway node's table: it goes through the tunnel.
    Tunnel {
        /// Gateway node.
        gateway: String,
        /// Mark to set.
        mark: u32,
    },
    /// This node is the gateway: no tunnel, SNAT here.
    Local,
    /// The traffic must not leave: its gateway has no live node and fails
    /// closed.
    Drop,
}

/// One classification entry: packets from `src` to `dst` get `action`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ClassifyEntry {
    /// Pod source address.
    pub src: IpAddr,
    /// Destination prefix.
    pub dst: IpNet,
    /// What to do.
    pub action: Action,
    /// The policy that decided it (`None` for a bypass carved out by an exclusion
    /// that no other policy covers), shared by the entries it decides.
    pub policy: Option<Arc<PolicyRef>>,
    /// The failover group (an id in [`NodeState::groups`]) whose live
    /// candidate the traffic goes to; `None` for a bypass.
    pub group: Option<u32>,
}

/// Where a gateway node SNATs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "ip")]
pub enum SnatTo {
    /// An egress IP.
    Eip(IpAddr),
    /// The node's own address (`useNodeIP`): masquerade.
    NodeIp,
}

/// One SNAT entry on a gateway node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct SnatEntry {
    /// Pod source address.
    pub src: IpAddr,
    /// Destination prefix.
    pub dst: IpNet,
    /// SNAT target.
    pub to: SnatTo,
    /// The node the pod runs on (this node for `Local` traffic): replies go
    /// back to it through the tunnel. Shared by the entries of its pods.
    pub origin: Arc<str>,
    /// The policy it serves, shared by the entries it decides.
    pub policy: Arc<PolicyRef>,
}

/// An EIP a gateway node owns.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct OwnedEip {
    /// The address.
    pub ip: IpAddr,
    /// The gateway it belongs to.
    pub gateway: String,
}

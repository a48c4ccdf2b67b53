//! `EgressTunnel`: one per node, named after it, holding the node's tunnel
//! identity. See `docs/tunnel-identity.md` for who writes which field.

use egressgw_core::model::{self, Mac};
use egressgw_core::net::Family;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::schema;
use crate::snapshot::object_name;
use crate::validation::{self, FieldPath, ValidationErrors, as_v4, as_v6, non_empty};

/// Spec of an `EgressTunnel` (cluster-scoped, short name `egt`): empty. The
/// object is named after its node and everything else lives in its status.
#[expect(
    clippy::duplicated_attributes,
    reason = "printcolumn entries repeat keys such as type_ by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "egressgw.io",
    version = "v1alpha1",
    kind = "EgressTunnel",
    plural = "egresstunnels",
    shortname = "egt",
    category = "egressgw",
    status = "EgressTunnelStatus",
    derive = "PartialEq",
    doc = "The tunnel identity of one node, named after it: tunnel addresses, MAC and packet mark (allocated by the controller), parent interface and phase (reported by the node's agent).",
    printcolumn(
        name = "Tunnel IPv4",
        type_ = "string",
        json_path = ".status.tunnel.ipv4",
        description = "Address of the node's egress.vxlan"
    ),
    printcolumn(
        name = "Tunnel IPv6",
        type_ = "string",
        json_path = ".status.tunnel.ipv6",
        description = "IPv6 address of the node's egress.vxlan",
        priority = 1
    ),
    printcolumn(
        name = "MAC",
        type_ = "string",
        json_path = ".status.tunnel.mac",
        description = "MAC of the node's egress.vxlan"
    ),
    printcolumn(
        name = "Mark",
        type_ = "string",
        json_path = ".status.mark",
        description = "Packet mark that routes to this node as a gateway"
    ),
    printcolumn(
        name = "Parent",
        type_ = "string",
        json_path = ".status.tunnel.parent.name",
        description = "Underlay interface"
    ),
    printcolumn(
        name = "Parent IPv4",
        type_ = "string",
        json_path = ".status.tunnel.parent.ipv4",
        description = "Underlay address",
        priority = 1
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Tunnel phase"
    ),
    printcolumn(
        name = "Heartbeat",
        type_ = "date",
        json_path = ".status.lastHeartbeatTime",
        description = "Last report of the node's agent",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct EgressTunnelSpec {}

/// Status of an `EgressTunnel`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressTunnelStatus {
    /// The node's tunnel endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<TunnelEndpoint>,
    /// Where the tunnel is in its life; see [`TunnelPhase`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<TunnelPhase>,
    /// The packet mark that routes to this node as a gateway, in hex
    /// (`0x01000000`); unset while no gateway selects the node. Written by
    /// the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::mark)]
    pub mark: Option<String>,
    /// When the node's agent last reported. Written by the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<Time>,
    /// The EIPs this node's data plane holds, or would hold but found in use
    /// on its segment. Written by the agent; the controller takes these as
    /// where the EIPs are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eips: Vec<TunnelEip>,
    /// The gateways and EIPs this node sends selected traffic to that have
    /// no live gateway node as its data plane sees it (no candidate
    /// answers its probes): that traffic is dropped (`failClosed`) or
    /// leaves with the node's own address. Written by the agent; the
    /// controller records each change as an Event.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<TunnelUnreachable>,
    /// What classifies pod traffic on this node, and why. Written by the
    /// agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datapath: Option<TunnelDatapath>,
}

/// `status.datapath`: what classifies pod traffic on the node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelDatapath {
    /// `ebpf` or `nftables`.
    pub name: String,
    /// Why: the configured choice, or what kept `auto` from eBPF.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// On the eBPF datapath: whether TCP connections pods open take the
    /// fast path (`ebpf.fastPath`); unset on nftables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<bool>,
}

/// `status.unreachable[]`: selected traffic of this node with no live
/// gateway node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelUnreachable {
    /// The EgressGateway.
    pub gateway: String,
    /// The EIP; unset for `useNodeIP` traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eip: Option<String>,
    /// Whether the traffic is dropped (`true`) or leaves with the node's
    /// own address (`false`), from the gateway's `spec.failClosed`.
    pub fail_closed: bool,
    /// Since when no candidate answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<MicroTime>,
}

/// `status.eips[]`: an EIP as one node's data plane has it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelEip {
    /// The address.
    pub ip: String,
    /// `Held` or `InUse`.
    pub state: TunnelEipState,
    /// Since when it is in this state, to the microsecond: when two nodes
    /// report holding an EIP (the old holder cut off from the API server),
    /// the later one holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<MicroTime>,
    /// Details: who answered for an address in use, or how the node came to
    /// hold it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// What a node's data plane does with an EIP.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum TunnelEipState {
    /// The node owns the address and answers for it on its segment.
    #[default]
    Held,
    /// The node should hold it, but another host on the segment answered
    /// for it, so the node leaves it alone.
    InUse,
}

/// `status.tunnel`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelEndpoint {
    /// IPv4 address of the node's `egress.vxlan`. Written by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::ip_field(Family::Ipv4, "status.tunnel.ipv4"))]
    pub ipv4: Option<String>,
    /// IPv6 address of the node's `egress.vxlan`. Written by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::ip_field(Family::Ipv6, "status.tunnel.ipv6"))]
    pub ipv6: Option<String>,
    /// MAC of the node's `egress.vxlan` (lowercase, colon-separated).
    /// Written by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::mac)]
    pub mac: Option<String>,
    /// The underlay interface the tunnel runs over. Written by the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<TunnelParent>,
}

/// `status.tunnel.parent`: the underlay interface, as the agent found it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelParent {
    /// Interface name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its IPv4 address: the local end of IPv4 tunnels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::ip_field(Family::Ipv4, "status.tunnel.parent.ipv4"))]
    pub ipv4: Option<String>,
    /// Its IPv6 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::ip_field(Family::Ipv6, "status.tunnel.parent.ipv6"))]
    pub ipv6: Option<String>,
}

/// `status.phase` of an `EgressTunnel`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TunnelPhase {
    /// The controller cannot allocate the identity yet (no free tunnel
    /// address). A node without an InternalIP is not pending: it gets an
    /// identity, but no tunnel until it has an underlay address. Written by
    /// the controller.
    Pending,
    /// The agent has the identity and is setting the tunnel up.
    Init,
    /// The tunnel is up as the status describes.
    Ready,
    /// The agent could not set the tunnel up; see its logs and events.
    Failed,
    /// The agent stopped reporting. Written by the controller.
    HeartbeatTimeout,
}

impl TunnelPhase {
    /// Whether the node's agent is known to be unable to carry traffic: it
    /// failed, or stopped reporting. Such a node is not ready in the
    /// snapshot, so its EIPs move.
    pub fn agent_unavailable(self) -> bool {
        matches!(self, TunnelPhase::Failed | TunnelPhase::HeartbeatTimeout)
    }
}

/// A mark as `status.mark` holds it: `0x` and eight lowercase hex digits.
pub fn format_mark(mark: u32) -> String {
    format!("{mark:#010x}")
}

/// Parses `status.mark`, accepting exactly what the CRD's pattern
/// `^0x[0-9a-f]{1,8}$` accepts: no sign, no uppercase, no whitespace.
pub fn parse_mark(s: &str) -> Option<u32> {
    let digits = s.strip_prefix("0x")?;
    let lower_hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
    if digits.is_empty() || digits.len() > 8 || !digits.chars().all(lower_hex) {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

impl EgressTunnel {
    /// The node's tunnel identity as allocated earlier, or every problem
    /// with the status. A tunnel without a status has no identity yet.
    pub fn to_model(&self) -> Result<model::Tunnel, ValidationErrors> {
        let mut errors = ValidationErrors::new();
        let node = object_name(&self.metadata, &mut errors);
        let status = FieldPath::root("status");
        let tunnel = self.status.as_ref().and_then(|s| s.tunnel.as_ref());
        let tunnel_path = status.field("tunnel");
        let ip =
            |value: Option<&String>, family: Family, field: &str, errors: &mut ValidationErrors| {
                let s = non_empty(value)?;
                validation::ip_of(s, family)
                    .map_err(|message| errors.push(tunnel_path.field(field), message))
                    .ok()
            };
        let ipv4 = ip(
            tunnel.and_then(|t| t.ipv4.as_ref()),
            Family::Ipv4,
            "ipv4",
            &mut errors,
        );
        let ipv6 = ip(
            tunnel.and_then(|t| t.ipv6.as_ref()),
            Family::Ipv6,
            "ipv6",
            &mut errors,
        );
        let mac = non_empty(tunnel.and_then(|t| t.mac.as_ref())).and_then(|s| {
            let parsed = s.parse::<Mac>().ok().filter(|mac| mac.to_string() == s);
            if parsed.is_none() {
                errors.push(
                    tunnel_path.field("mac"),
                    format!("{s:?} is not a MAC address in aa:bb:cc:dd:ee:ff form"),
                );
            }
            parsed
        });
        let mark = non_empty(self.status.as_ref().and_then(|s| s.mark.as_ref())).and_then(|s| {
            let parsed = parse_mark(s);
            if parsed.is_none() {
                errors.push(
                    status.field("mark"),
                    format!("{s:?} is not a mark (0x and up to 8 lowercase hex digits)"),
                );
            }
            parsed
        });
        errors.into_result().map(|()| model::Tunnel {
            node,
            ipv4: ipv4.and_then(as_v4),
            ipv6: ipv6.and_then(as_v6),
            mac,
            mark,
        })
    }

    /// The phase the status reports, if any.
    pub fn phase(&self) -> Option<TunnelPhase> {
        self.status.as_ref().and_then(|s| s.phase)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_print_as_eight_hex_digits_and_parse_back() {
        assert_eq!(format_mark(0x0100_0000), "0x01000000");
        assert_eq!(parse_mark("0x01000000"), Some(0x0100_0000));
        assert_eq!(parse_mark("0x1"), Some(1));
    }

    #[test]
    fn a_mark_without_0x_or_in_uppercase_is_not_a_mark() {
        for s in ["16777216", "0x", "0X01", "0x0100000000", "0xABC", "0xzz"] {
            assert_eq!(parse_mark(s), None, "{s}");
        }
    }

    #[test]
    fn a_mark_with_a_sign_or_whitespace_is_not_a_mark() {
        for s in ["0x+1", "0x-1", "+0x1", "0x 1", " 0x1", "0x1 ", "0x_1"] {
            assert_eq!(parse_mark(s), None, "{s:?}");
        }
    }
}

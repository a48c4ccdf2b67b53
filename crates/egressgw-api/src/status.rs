//! The planner's status output back into the CRDs' status types.
//!
//! Conversions take the clock as an argument (`now`) and the status the
//! object had (`old`), so a condition that did not change keeps its
//! `lastTransitionTime` and repeated writes of the same state are identical.

use std::net::IpAddr;

use egressgw_core::model::PolicyRef;
use egressgw_core::status::{
    self as core, EipStatus, GatewayNodeStatus, GatewayStatus, PolicyStatus, TunnelAllocation,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::gateway::{
    EgressGatewayStatus, GatewayEip, GatewayNode, IpUsage, NodeReadiness, PolicyReference,
};
use crate::policy::{EgressPolicyStatus, PolicyEip};
use crate::schema;
use crate::tunnel::{EgressTunnelStatus, TunnelEndpoint, format_mark};

/// The planner's conditions as `metav1.Condition`s.
///
/// A condition whose type and status match one in `old` keeps that one's
/// `lastTransitionTime`; others get `now`. `generation` is the object's
/// `metadata.generation`, recorded as `observedGeneration`.
pub fn conditions(
    new: &[core::Condition],
    old: &[Condition],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    new.iter()
        .map(|c| {
            let type_ = c.type_.to_string();
            let status = if c.status { "True" } else { "False" }.to_owned();
            let last_transition_time = old
                .iter()
                .find(|o| o.type_ == type_ && o.status == status)
                .map_or(Time(now), |o| o.last_transition_time.clone());
            Condition {
                type_,
                status,
                reason: c.reason.to_string(),
                message: c.message.clone(),
                last_transition_time,
                observed_generation: generation,
            }
        })
        .collect()
}

/// Status of an `EgressPolicy` or `EgressClusterPolicy`.
pub fn policy_status(
    status: &PolicyStatus,
    old: Option<&EgressPolicyStatus>,
    generation: Option<i64>,
    now: Timestamp,
) -> EgressPolicyStatus {
    let eip = PolicyEip {
        ipv4: status.eip_ipv4.map(|ip| ip.to_string()),
        ipv6: status.eip_ipv6.map(|ip| ip.to_string()),
    };
    let old_conditions = old.map_or(&[][..], |o| &o.conditions);
    EgressPolicyStatus {
        eip: (eip != PolicyEip::default()).then_some(eip),
        node: status.node.clone(),
        conditions: conditions(&status.conditions, old_conditions, generation, now),
    }
}

/// Status of an `EgressGateway`.
///
/// On each node, an IPv4 and an IPv6 EIP that exactly the same policies use
/// share one `eips` entry, as in spidernet-io/egressgateway; the entry for
/// `useNodeIP` policies has neither address.
pub fn gateway_status(
    status: &GatewayStatus,
    old: Option<&EgressGatewayStatus>,
    generation: Option<i64>,
    now: Timestamp,
) -> EgressGatewayStatus {
    let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    let usage = status.ip_usage;
    let clamp = |n: u64| {
        let max = schema::ADDRESS_COUNT.max;
        i64::try_from(n).map_or(max, |n| n.min(max))
    };
    let old_conditions = old.map_or(&[][..], |o| &o.conditions);
    EgressGatewayStatus {
        node_list: status.nodes.iter().map(gateway_node).collect(),
        selected_nodes: count(status.nodes.len()),
        ready_nodes: count(status.nodes.iter().filter(|n| n.ready).count()),
        ip_usage: Some(IpUsage {
            ipv4_total: clamp(usage.ipv4_total),
            ipv4_free: clamp(usage.ipv4_free),
            ipv6_total: clamp(usage.ipv6_total),
            ipv6_free: clamp(usage.ipv6_free),
        }),
        // What the controller published last; it sets what it publishes now.
        pods: old.and_then(|o| o.pods),
        conditions: conditions(&status.conditions, old_conditions, generation, now),
    }
}

fn gateway_node(node: &GatewayNodeStatus) -> GatewayNode {
    GatewayNode {
        name: node.name.clone(),
        status: if node.ready {
            NodeReadiness::Ready
        } else {
            NodeReadiness::NotReady
        },
        eips: pair_eips(&node.eips),
    }
}

/// Folds each IPv6 EIP into the IPv4 entry used by the same policies (with
/// the same standbys).
fn pair_eips(eips: &[EipStatus]) -> Vec<GatewayEip> {
    let mut out: Vec<(Vec<PolicyRef>, GatewayEip)> = Vec::new();
    for eip in eips {
        let policies = &eip.policies;
        let entry = |ipv4, ipv6, policies: &[PolicyRef]| GatewayEip {
            standbys: eip.standbys.clone(),
            ..entry(ipv4, ipv6, policies)
        };
        match eip.ip {
            Some(IpAddr::V6(v6)) => {
                let partner = out.iter_mut().find(|(p, e)| {
                    p == policies
                        && e.standbys == eip.standbys
                        && e.ipv4.is_some()
                        && e.ipv6.is_none()
                });
                match partner {
                    Some((_, entry)) => entry.ipv6 = Some(v6.to_string()),
                    None => out.push((
                        policies.clone(),
                        entry(None, Some(v6.to_string()), policies),
                    )),
                }
            }
            Some(IpAddr::V4(v4)) => {
                let partner = out.iter_mut().find(|(p, e)| {
                    p == policies
                        && e.standbys == eip.standbys
                        && e.ipv6.is_some()
                        && e.ipv4.is_none()
                });
                match partner {
                    Some((_, entry)) => entry.ipv4 = Some(v4.to_string()),
                    None => out.push((
                        policies.clone(),
                        entry(Some(v4.to_string()), None, policies),
                    )),
                }
            }
            None => out.push((policies.clone(), entry(None, None, policies))),
        }
    }
    out.into_iter().map(|(_, e)| e).collect()
}

fn entry(ipv4: Option<String>, ipv6: Option<String>, policies: &[PolicyRef]) -> GatewayEip {
    GatewayEip {
        ipv4,
        ipv6,
        policies: policies.iter().map(policy_reference).collect(),
        standbys: Vec::new(),
    }
}

/// A policy reference as statuses hold it.
pub fn policy_reference(policy: &PolicyRef) -> PolicyReference {
    PolicyReference {
        name: policy.name.clone(),
        namespace: policy.namespace.clone(),
    }
}

/// The controller's part of an `EgressTunnel` status: tunnel addresses,
/// MAC and mark.
///
/// `parent`, `phase` and `lastHeartbeatTime` are the agent's and stay unset,
/// so a server-side apply of the result with the controller's field manager
/// leaves them alone. The allocation's underlay address is not written: the
/// agent reports the parent interface it actually uses.
pub fn tunnel_status(allocation: &TunnelAllocation) -> EgressTunnelStatus {
    EgressTunnelStatus {
        tunnel: Some(TunnelEndpoint {
            ipv4: allocation.ipv4.map(|ip| ip.to_string()),
            ipv6: allocation.ipv6.map(|ip| ip.to_string()),
            mac: Some(allocation.mac.to_string()),
            parent: None,
        }),
        phase: None,
        mark: allocation.mark.map(format_mark),
        last_heartbeat_time: None,
        eips: Vec::new(),
        unreachable: Vec::new(),
        datapath: None,
    }
}

//! Stage 6b: status of every policy and gateway, in words a person can act on.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::model::{InvalidObject, Node, PolicyRef, Snapshot};
use crate::net::Family;
use crate::status::{
    ClusterStatus, Condition, ConditionType, EipStatus, GatewayNodeStatus, GatewayStatus, IpUsage,
    PolicyStatus, Reason,
};

use super::classify::Classified;
use super::gateways::{GatewayInfo, Gateways, ineligibility};
use super::placement::{Placed, Unit};
use super::tunnels::Tunnels;
use super::{Work, fi};

/// Builds the status of everything.
pub(super) fn status(
    snapshot: &Snapshot,
    gateways: &Gateways<'_>,
    tunnels: &Tunnels,
    works: &[Work<'_>],
    placed: &Placed<'_>,
    classified: &Classified<'_>,
) -> ClusterStatus {
    let nodes: BTreeMap<&str, &Node> = snapshot
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n))
        .collect();
    let why = |node: &str| {
        let mut reasons: Vec<&str> = snapshot
            .config
            .enabled_families()
            .filter_map(|f| ineligibility(nodes.get(node).copied(), tunnels, f))
            .collect();
        reasons.dedup();
        if reasons.is_empty() {
            "ready".to_owned()
        } else {
            reasons.join(", ")
        }
    };
    let mut policies: Vec<PolicyStatus> = works
        .iter()
        .enumerate()
        .map(|(i, w)| {
            policy_status(
                w,
                classified.pod_counts[i],
                gateways,
                &snapshot.eips_in_use,
                &why,
            )
        })
        .chain(snapshot.invalid.iter().filter_map(invalid_policy))
        .collect();
    policies.sort_by(|a, b| a.policy.cmp(&b.policy));

    let mut gateway_statuses: Vec<GatewayStatus> = gateways
        .by_name
        .values()
        .map(|info| gateway_status(info, works, placed, &why))
        .collect();
    gateway_statuses.sort_by(|a, b| a.gateway.cmp(&b.gateway));

    let eip_nodes = placed
        .nodes
        .iter()
        .filter_map(|(unit, node)| match unit {
            Unit::Eip(_, ip) => Some((*ip, (*node).to_owned())),
            Unit::NodeIp(..) => None,
        })
        .collect();

    ClusterStatus {
        policies,
        gateways: gateway_statuses,
        tunnels: tunnels.by_node.values().cloned().collect(),
        eip_nodes,
    }
}

fn condition(
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: impl Into<String>,
) -> Condition {
    Condition {
        type_,
        status,
        reason,
        message: message.into(),
    }
}

fn policy_status(
    w: &Work<'_>,
    pods: usize,
    gateways: &Gateways<'_>,
    in_use: &BTreeMap<IpAddr, String>,
    why: &dyn Fn(&str) -> String,
) -> PolicyStatus {
    let node = w.nodes[0].or(w.nodes[1]).map(str::to_owned);
    let conditions = match &w.failure {
        Some((reason, message)) => {
            let mut message = message.clone();
            if !w.reserved.is_empty() {
                let reserved: Vec<String> = w.reserved.iter().map(ToString::to_string).collect();
                message.push_str(&format!(
                    "; its EIP {} stays reserved for it",
                    reserved.join(", ")
                ));
            }
            vec![
                condition(ConditionType::Allocated, false, *reason, message.clone()),
                condition(ConditionType::Ready, false, *reason, message),
            ]
        }
        None => {
            let gateway = w.gateway.expect("allocated policies have a gateway");
            let how = leaves_with(w);
            let allocated = condition(
                ConditionType::Allocated,
                true,
                Reason::Allocated,
                format!("{how} of EgressGateway {gateway}"),
            );
            let unplaced = Family::ALL
                .into_iter()
                .any(|f| (w.eips[fi(f)].is_some() || w.node_ip[fi(f)]) && w.nodes[fi(f)].is_none());
            let taken = w
                .eips
                .iter()
                .flatten()
                .find_map(|ip| Some((ip, in_use.get(ip)?)));
            let ready = if let Some((ip, who)) = taken {
                condition(
                    ConditionType::Ready,
                    false,
                    Reason::EipInUse,
                    format!(
                        "EIP {ip} is in use on the external segment ({who}), so no node takes it; \
                         give EgressGateway {gateway} a pool address no other host uses"
                    ),
                )
            } else if unplaced {
                let then = if w.fail_closed {
                    "meanwhile its traffic is dropped (failClosed)"
                } else {
                    "meanwhile its traffic leaves with the nodes' own addresses (failClosed: false)"
                };
                condition(
                    ConditionType::Ready,
                    false,
                    Reason::NoReadyNode,
                    format!("{}; {then}", no_ready_node(&gateways.by_name[gateway], why)),
                )
            } else {
                let nodes = w.nodes.iter().flatten().copied().collect::<Vec<_>>();
                let mut nodes = nodes;
                nodes.dedup();
                condition(
                    ConditionType::Ready,
                    true,
                    Reason::Active,
                    active(
                        pods,
                        &format!("leave through node {} {how}", nodes.join(" and ")),
                    ),
                )
            };
            vec![allocated, ready]
        }
    };
    // A reserved EIP stays in the status: it is what keeps it reserved.
    let eip = |slot: usize| {
        w.eips[slot].or_else(|| {
            w.reserved
                .iter()
                .copied()
                .find(|ip| fi(Family::of(*ip)) == slot)
        })
    };
    PolicyStatus {
        policy: w.policy.id.clone(),
        eip_ipv4: match eip(0) {
            Some(IpAddr::V4(ip)) => Some(ip),
            _ => None,
        },
        eip_ipv6: match eip(1) {
            Some(IpAddr::V6(ip)) => Some(ip),
            _ => None,
        },
        use_node_ip: w.failure.is_none() && w.policy.egress_ip.use_node_ip,
        node,
        pods,
        conditions,
    }
}

/// The message of an active policy's `Ready` condition.
fn active(pods: usize, rest: &str) -> String {
    format!("{pods} pod(s) {rest}")
}

/// `status`, as [`status`] gives it, with `pods` selected Pods instead:
/// the count and the message that states it (the rest of a policy's
/// status does not depend on its Pods).
pub(super) fn recount(status: &mut PolicyStatus, pods: usize) {
    if status.pods == pods {
        return;
    }
    status.pods = pods;
    for c in &mut status.conditions {
        if c.type_ == ConditionType::Ready
            && c.reason == Reason::Active
            && let Some((_, rest)) = c.message.split_once(" pod(s) ")
        {
            c.message = active(pods, rest);
        }
    }
}

fn leaves_with(w: &Work<'_>) -> String {
    let eips: Vec<String> = w.eips.iter().flatten().map(ToString::to_string).collect();
    if eips.is_empty() {
        "with the node's own address (useNodeIP)".to_owned()
    } else {
        format!("with EIP {}", eips.join(", "))
    }
}

fn no_ready_node(info: &GatewayInfo<'_>, why: &dyn Fn(&str) -> String) -> String {
    let name = &info.gateway.name;
    if info.selected.is_empty() {
        return format!(
            "spec.nodeSelector of EgressGateway {name} matches no node; label the nodes that may carry egress traffic"
        );
    }
    let shown: Vec<String> = info
        .selected
        .iter()
        .take(5)
        .map(|n| format!("{n}: {}", why(n)))
        .collect();
    let more = info.selected.len().saturating_sub(shown.len());
    let more = if more > 0 {
        format!("; and {more} more")
    } else {
        String::new()
    };
    format!(
        "none of the {} node(s) selected by EgressGateway {name} can carry its traffic ({}{more})",
        info.selected.len(),
        shown.join("; ")
    )
}

fn invalid_policy(o: &InvalidObject) -> Option<PolicyStatus> {
    let policy = match (o.kind.as_str(), &o.namespace) {
        ("EgressPolicy", Some(ns)) => PolicyRef::namespaced(ns.clone(), o.name.clone()),
        ("EgressClusterPolicy", _) => PolicyRef::cluster(o.name.clone()),
        _ => return None,
    };
    let message = o.errors.join("; ");
    Some(PolicyStatus {
        policy,
        eip_ipv4: None,
        eip_ipv6: None,
        use_node_ip: false,
        node: None,
        pods: 0,
        conditions: vec![
            condition(
                ConditionType::Allocated,
                false,
                Reason::Invalid,
                message.clone(),
            ),
            condition(ConditionType::Ready, false, Reason::Invalid, message),
        ],
    })
}

fn gateway_status(
    info: &GatewayInfo<'_>,
    works: &[Work<'_>],
    placed: &Placed<'_>,
    why: &dyn Fn(&str) -> String,
) -> GatewayStatus {
    let name = info.gateway.name.as_str();
    let mut on_node: BTreeMap<&str, BTreeMap<Option<IpAddr>, Vec<PolicyRef>>> = BTreeMap::new();
    let mut standbys: BTreeMap<Option<IpAddr>, &[&str]> = BTreeMap::new();
    for (unit, node) in placed.nodes.iter().filter(|(u, _)| u.gateway() == name) {
        let ip = match unit {
            Unit::Eip(_, ip) => Some(*ip),
            Unit::NodeIp(..) => None,
        };
        if ip.is_some()
            && let Some(order) = placed.candidates.get(unit)
        {
            standbys.insert(ip, &order[1..]);
        }
        let users = placed
            .users
            .get(unit)
            .into_iter()
            .flatten()
            .map(|i| works[*i].policy.id.clone());
        on_node
            .entry(node)
            .or_default()
            .entry(ip)
            .or_default()
            .extend(users);
    }
    // A gateway that cannot be used keeps its last placement on record, every
    // node shown not ready, so its EIPs return to the same nodes once it is fixed.
    if info.problem.is_some() {
        for (ip, node) in &info.gateway.previous_nodes {
            on_node
                .entry(node.as_str())
                .or_default()
                .entry(Some(*ip))
                .or_default();
        }
    }
    let mut names: Vec<&str> = info
        .selected
        .iter()
        .copied()
        .chain(on_node.keys().copied())
        .collect();
    names.sort_unstable();
    names.dedup();
    let nodes = names
        .into_iter()
        .map(|n| GatewayNodeStatus {
            name: n.to_owned(),
            ready: info.eligible_any(n),
            eips: on_node
                .get(n)
                .into_iter()
                .flatten()
                .map(|(ip, policies)| {
                    let mut policies = policies.clone();
                    policies.sort();
                    policies.dedup();
                    EipStatus {
                        ip: *ip,
                        policies,
                        standbys: standbys
                            .get(ip)
                            .map(|s| s.iter().map(|n| (*n).to_owned()).collect())
                            .unwrap_or_default(),
                    }
                })
                .collect(),
        })
        .collect();

    let ready_nodes = info
        .selected
        .iter()
        .filter(|n| info.eligible_any(n))
        .count();
    let ready = match &info.problem {
        Some((reason, message)) => condition(ConditionType::Ready, false, *reason, message.clone()),
        None if ready_nodes == 0 => condition(
            ConditionType::Ready,
            false,
            Reason::NoReadyNode,
            no_ready_node(info, why),
        ),
        None => {
            let mut message = format!(
                "{ready_nodes} of {} selected node(s) ready",
                info.selected.len()
            );
            for note in &info.notes {
                message.push_str("; ");
                message.push_str(note);
            }
            condition(ConditionType::Ready, true, Reason::Active, message)
        }
    };
    GatewayStatus {
        gateway: name.to_owned(),
        nodes,
        ip_usage: usage(info, works),
        conditions: vec![ready],
    }
}

fn usage(info: &GatewayInfo<'_>, works: &[Work<'_>]) -> IpUsage {
    let gw = info.gateway;
    let mut used: [Vec<IpAddr>; 2] = [Vec::new(), Vec::new()];
    for w in works
        .iter()
        .filter(|w| w.failure.is_none() && w.gateway == Some(gw.name.as_str()))
    {
        for family in Family::ALL {
            if let Some(ip) = w.eips[fi(family)].filter(|ip| gw.pool(family).contains(*ip)) {
                used[fi(family)].push(ip);
            }
        }
    }
    let count = |family: Family| {
        let total = u64::try_from(gw.pool(family).len()).unwrap_or(u64::MAX);
        let mut in_use = used[fi(family)].clone();
        in_use.sort_unstable();
        in_use.dedup();
        (total, total.saturating_sub(in_use.len() as u64))
    };
    let ((ipv4_total, ipv4_free), (ipv6_total, ipv6_free)) =
        (count(Family::Ipv4), count(Family::Ipv6));
    IpUsage {
        ipv4_total,
        ipv4_free,
        ipv6_total,
        ipv6_free,
    }
}

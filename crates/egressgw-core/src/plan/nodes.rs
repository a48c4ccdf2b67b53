//! Stage 6a: the desired dataplane state of each node.

use std::collections::{BTreeMap, HashMap};

use ipnet::IpNet;

use crate::model::{Config, Snapshot};
use crate::net::Family;
use crate::state::{
    Action, ClassifyEntry, NodeState, OwnedEip, Peer, ReplyRoute, Route, Rule, SnatEntry, SnatTo,
    Vxlan,
};

use super::classify::Classified;
use super::tunnels::Tunnels;
use super::{Work, fi};

/// Where a policy's traffic of one family goes: the gateway node, its mark,
/// and the index of its state if it is being built.
type Via<'a> = (&'a str, u32, Option<usize>);

/// Builds the state of every node, or of `only` that one.
pub(super) fn build(
    snapshot: &Snapshot,
    tunnels: &Tunnels,
    works: &[Work<'_>],
    classified: &Classified<'_>,
    cluster_cidrs: &[IpNet],
    only: Option<&str>,
) -> BTreeMap<String, NodeState> {
    let cfg = &snapshot.config;
    let peers = peers(tunnels);
    let routes = routes(cfg, tunnels);

    // States in a vector, found by index: the loops below touch them once
    // per classification entry.
    let mut names: Vec<&str> = snapshot
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .filter(|n| only.is_none_or(|o| o == *n))
        .collect();
    names.sort_unstable();
    names.dedup();
    let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut states: Vec<NodeState> = names
        .iter()
        .map(|name| NodeState {
            node: (*name).to_owned(),
            vxlan: vxlan(cfg, tunnels, name),
            peers: peers.iter().filter(|p| p.node != *name).cloned().collect(),
            routes: routes
                .iter()
                .filter(|(r, _)| r.gateway != *name)
                .map(|(r, _)| r.clone())
                .collect(),
            rules: routes
                .iter()
                .filter(|(r, _)| r.gateway != *name)
                .map(|(_, r)| r.clone())
                .collect(),
            cluster_cidrs: cluster_cidrs.to_vec(),
            ..NodeState::default()
        })
        .collect();

    let gateways: Vec<[Option<Via<'_>>; 2]> = works
        .iter()
        .map(|w| {
            Family::ALL.map(|family| {
                let node = w.nodes[fi(family)].as_deref()?;
                let mark = tunnels
                    .mark(node)
                    .expect("eligible gateway nodes have a mark");
                Some((node, mark, index.get(node).copied()))
            })
        })
        .collect();

    for source in &classified.sources {
        let family = Family::of(source.src);
        let here = index.get(source.node).copied();
        // A node without a tunnel of this family cannot send its pods'
        // traffic to another node: those decisions are left out, so the
        // traffic leaves the normal way rather than into a missing device.
        let can_send = tunnels.can_send(source.node, family);
        for (dst, decided) in source.table.iter() {
            let Some(w) = *decided else {
                if let Some(i) = here {
                    states[i].classify.push(ClassifyEntry {
                        src: source.src,
                        dst: *dst,
                        action: Action::Bypass,
                        policy: None,
                    });
                }
                continue;
            };
            let work = &works[w];
            let (gateway, mark, there) =
                gateways[w][fi(family)].expect("active policies are placed");
            let local = gateway == source.node;
            if !local && !can_send {
                continue;
            }
            if let Some(i) = here {
                let action = if local {
                    Action::Local
                } else {
                    Action::Tunnel {
                        gateway: gateway.to_owned(),
                        mark,
                    }
                };
                states[i].classify.push(ClassifyEntry {
                    src: source.src,
                    dst: *dst,
                    action,
                    policy: Some(work.policy.id.clone()),
                });
            }
            if let Some(i) = there {
                if !local && let Some(via) = tunnels.address(source.node, family) {
                    states[i].replies.push(ReplyRoute {
                        dst: source.src,
                        via,
                        origin: source.node.to_owned(),
                        table: cfg.reply_table(),
                    });
                }
                let to = work.eips[fi(family)].map_or(SnatTo::NodeIp, SnatTo::Eip);
                states[i].snat.push(SnatEntry {
                    src: source.src,
                    dst: *dst,
                    to,
                    origin: source.node.to_owned(),
                    policy: work.policy.id.clone(),
                });
            }
        }
    }

    for work in works.iter().filter(|w| w.failure.is_none()) {
        for family in Family::ALL {
            if let (Some(ip), Some(node)) = (work.eips[fi(family)], &work.nodes[fi(family)])
                && let Some(i) = index.get(node.as_str())
            {
                states[*i].eips.push(OwnedEip {
                    ip,
                    gateway: work.gateway.expect("allocated").to_owned(),
                });
            }
        }
    }

    for state in &mut states {
        state.peers.sort();
        state.routes.sort();
        state.rules.sort();
        state.classify.sort();
        state.snat.sort();
        state.replies.sort();
        state.replies.dedup();
        if !state.replies.is_empty() {
            state.rules.push(Rule {
                priority: cfg.rule_priority,
                mark: cfg.reply_mark(),
                mask: cfg.mark_mask,
                table: cfg.reply_table(),
            });
            state.rules.sort();
        }
        state.eips.sort();
        state.eips.dedup();
    }
    states.into_iter().map(|s| (s.node.clone(), s)).collect()
}

fn vxlan(cfg: &Config, tunnels: &Tunnels, node: &str) -> Option<Vxlan> {
    let t = tunnels.by_node.get(node)?;
    if t.ipv4.is_none() && t.ipv6.is_none() {
        return None;
    }
    Some(Vxlan {
        name: cfg.vxlan.name.clone(),
        vni: cfg.vxlan.id,
        port: cfg.vxlan.port,
        local: t.underlay?,
        mac: t.mac,
        ipv4: t.ipv4,
        ipv6: t.ipv6,
        ipv4_prefix_len: cfg.tunnel_ipv4_subnet.prefix_len(),
        ipv6_prefix_len: cfg.tunnel_ipv6_subnet.prefix_len(),
        disable_checksum_offload: cfg.vxlan.disable_checksum_offload,
    })
}

fn peers(tunnels: &Tunnels) -> Vec<Peer> {
    tunnels
        .by_node
        .values()
        .filter_map(|t| {
            Some(Peer {
                node: t.node.clone(),
                underlay: t.underlay?,
                mac: t.mac,
                ipv4: t.ipv4,
                ipv6: t.ipv6,
            })
        })
        .collect()
}

/// A route and its rule per gateway-capable node, ordered by table.
fn routes(cfg: &Config, tunnels: &Tunnels) -> Vec<(Route, Rule)> {
    let mut out: Vec<(Route, Rule)> = tunnels
        .by_node
        .values()
        .filter(|t| tunnels.can_carry(&t.node))
        .filter_map(|t| {
            let mark = t.mark?;
            let table = cfg.route_table_base + cfg.mark_index(mark)? - 1;
            Some((
                Route {
                    table,
                    gateway: t.node.clone(),
                    via_ipv4: t.ipv4,
                    via_ipv6: t.ipv6,
                },
                Rule {
                    priority: cfg.rule_priority,
                    mark,
                    mask: cfg.mark_mask,
                    table,
                },
            ))
        })
        .collect();
    out.sort();
    out
}

/// Every in-cluster prefix, aggregated: node pod CIDRs and addresses, service
/// and extra CIDRs, and the tunnel subnets.
pub(super) fn cluster_cidrs(snapshot: &Snapshot) -> Vec<IpNet> {
    let cfg = &snapshot.config;
    let mut nets: Vec<IpNet> = snapshot
        .nodes
        .iter()
        .flat_map(|n| {
            n.pod_cidrs
                .iter()
                .copied()
                .chain(n.addresses.iter().map(|ip| Family::host(*ip)))
        })
        .chain(cfg.service_cidrs.iter().copied())
        .chain(cfg.extra_cluster_cidrs.iter().copied())
        .collect();
    if cfg.enable_ipv4 {
        nets.push(IpNet::V4(cfg.tunnel_ipv4_subnet));
    }
    if cfg.enable_ipv6 {
        nets.push(IpNet::V6(cfg.tunnel_ipv6_subnet));
    }
    let mut nets = IpNet::aggregate(&nets);
    nets.sort();
    nets
}

//! Stage 6a: the desired dataplane state of each node.

use std::collections::{BTreeMap, HashMap};

use foldhash::fast::RandomState;

use ipnet::IpNet;

use crate::model::{Config, Snapshot};
use crate::net::Family;
use crate::state::{
    Action, Candidate, ClassifyEntry, Group, NodeState, OwnedEip, Peer, ReplyRoute, Route, Rule,
    SnatEntry, SnatTo, Vxlan,
};

use super::classify::{Classified, Source};
use super::placement::{Placed, Unit, unit_for};
use super::tunnels::Tunnels;
use super::{Work, fi};

/// Builds the state of every node, or of `only` that one.
pub(super) fn build<'a>(
    snapshot: &Snapshot,
    tunnels: &Tunnels,
    works: &[Work<'a>],
    placed: &Placed<'a>,
    classified: &Classified<'_>,
    cluster_cidrs: &[IpNet],
    only: Option<&str>,
) -> BTreeMap<String, NodeState> {
    let mut nodes = Nodes::new(snapshot, tunnels, works, placed, cluster_cidrs, only);
    for source in &classified.sources {
        nodes.source(source);
    }
    nodes.own_eips();
    nodes.finish()
}

/// The nodes' states while they are built, found by index: the loops
/// touch them once per classification entry.
struct Nodes<'p, 'a> {
    cfg: &'p Config,
    tunnels: &'p Tunnels,
    works: &'p [Work<'a>],
    placed: &'p Placed<'a>,
    index: FoldMap<&'p str, usize>,
    /// Per policy (by index) and family: its unit and that unit's
    /// candidates, looked up once rather than per classification entry.
    units: Vec<[Option<Served<'p, 'a>>; 2]>,
    /// Per pod node: its state's index here, and whether it can send each
    /// family through the tunnel.
    sources: FoldMap<&'p str, (Option<usize>, [bool; 2])>,
    states: Vec<NodeState>,
    /// Failover groups, numbered per node as they are first needed there.
    group_ids: Vec<BTreeMap<Unit<'a>, u32>>,
}

impl<'p, 'a> Nodes<'p, 'a> {
    /// Each node with its tunnel, peers, routes and rules, and nothing
    /// classified yet.
    fn new(
        snapshot: &'p Snapshot,
        tunnels: &'p Tunnels,
        works: &'p [Work<'a>],
        placed: &'p Placed<'a>,
        cluster_cidrs: &[IpNet],
        only: Option<&str>,
    ) -> Self {
        let cfg = &snapshot.config;
        let peers = peers(tunnels);
        let routes = routes(cfg, tunnels);
        let mut names: Vec<&str> = snapshot
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .filter(|n| only.is_none_or(|o| o == *n))
            .collect();
        names.sort_unstable();
        names.dedup();
        let index: FoldMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let states: Vec<NodeState> = names
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
        let units = works
            .iter()
            .enumerate()
            .map(|(i, w)| {
                Family::ALL.map(|family| {
                    let unit = unit_for(i, w, family)?;
                    let candidates = placed.candidates.get(&unit).map(Vec::as_slice);
                    Some((unit, candidates))
                })
            })
            .collect();
        Nodes {
            cfg,
            tunnels,
            works,
            placed,
            index,
            units,
            sources: FoldMap::default(),
            group_ids: vec![BTreeMap::new(); states.len()],
            states,
        }
    }

    /// The id of `unit`'s failover group on node `i`, added there when it
    /// is first needed.
    fn group_in(&mut self, i: usize, unit: &Unit<'a>) -> u32 {
        if let Some(id) = self.group_ids[i].get(unit) {
            return *id;
        }
        let id = u32::try_from(self.states[i].groups.len()).expect("fewer than 2^32 groups");
        let candidates = self.placed.candidates[unit]
            .iter()
            .map(|node| Candidate {
                node: node.clone(),
                mark: self
                    .tunnels
                    .mark(node)
                    .expect("gateway candidates have a mark"),
            })
            .collect();
        let first_user = self.placed.users[unit][0];
        self.states[i].groups.push(Group {
            id,
            key: group_key(unit, self.works),
            gateway: unit.gateway().to_owned(),
            eip: match unit {
                Unit::Eip(_, ip) => Some(*ip),
                Unit::NodeIp(..) => None,
            },
            candidates,
            fail_closed: self.works[first_user].fail_closed,
        });
        self.group_ids[i].insert(unit.clone(), id);
        id
    }

    /// One pod address: its node's classification of each destination,
    /// and on every candidate gateway node of its traffic the SNAT and the
    /// reply route.
    fn source(&mut self, source: &Source<'p>) {
        let family = Family::of(source.src);
        let (here, can_send) = *self.sources.entry(source.node).or_insert_with(|| {
            (
                self.index.get(source.node).copied(),
                Family::ALL.map(|f| self.tunnels.can_send(source.node, f)),
            )
        });
        // A node without a tunnel of this family cannot send its pods'
        // traffic to another node: those decisions are left out (or, failing
        // closed, dropped), rather than sent into a missing device.
        let can_send = can_send[fi(family)];
        for (dst, decided) in source.table.iter() {
            let entry = |action, policy, group| ClassifyEntry {
                src: source.src,
                dst: *dst,
                action,
                policy,
                group,
            };
            let Some(w) = *decided else {
                if let Some(i) = here {
                    self.states[i]
                        .classify
                        .push(entry(Action::Bypass, None, None));
                }
                continue;
            };
            let work = &self.works[w];
            let (unit, candidates) = self.units[w][fi(family)]
                .clone()
                .expect("classified policies have a unit");
            let Some(candidates) = candidates else {
                // No node at all, and the gateway fails closed.
                if let Some(i) = here {
                    self.states[i].classify.push(entry(
                        Action::Drop,
                        Some(work.policy.id.clone()),
                        None,
                    ));
                }
                continue;
            };
            let active = candidates[0].as_str();
            let local = active == source.node;
            if !local && !can_send && !work.fail_closed {
                continue;
            }
            if let Some(i) = here {
                let (action, group) = if !local && !can_send {
                    (Action::Drop, None)
                } else if local {
                    (Action::Local, Some(self.group_in(i, &unit)))
                } else {
                    let mark = self
                        .tunnels
                        .mark(active)
                        .expect("gateway nodes have a mark");
                    let action = Action::Tunnel {
                        gateway: active.to_owned(),
                        mark,
                    };
                    (action, Some(self.group_in(i, &unit)))
                };
                let policy = Some(work.policy.id.clone());
                self.states[i].classify.push(entry(action, policy, group));
            }
            if local || can_send {
                self.serve(source, *dst, work, candidates);
            }
        }
    }

    /// Every candidate is ready to serve `source`'s traffic to `dst`: the
    /// data plane may send it to any of them without a new plan.
    fn serve(&mut self, source: &Source<'_>, dst: IpNet, work: &Work<'a>, candidates: &[String]) {
        let family = Family::of(source.src);
        let to = work.eips[fi(family)].map_or(SnatTo::NodeIp, SnatTo::Eip);
        for candidate in candidates {
            let Some(i) = self.index.get(candidate.as_str()).copied() else {
                continue;
            };
            if candidate != source.node
                && let Some(via) = self.tunnels.address(source.node, family)
            {
                self.states[i].replies.push(ReplyRoute {
                    dst: source.src,
                    via,
                    origin: source.node.to_owned(),
                    table: self.cfg.reply_table(),
                });
            }
            self.states[i].snat.push(SnatEntry {
                src: source.src,
                dst,
                to,
                origin: source.node.to_owned(),
                policy: work.policy.id.clone(),
            });
        }
    }

    /// A candidate of an EIP needs its group to take it over; the active
    /// node owns it.
    fn own_eips(&mut self) {
        let placed = self.placed;
        for (unit, candidates) in &placed.candidates {
            let Unit::Eip(gateway, ip) = unit else {
                continue;
            };
            for (rank, node) in candidates.iter().enumerate() {
                let Some(i) = self.index.get(node.as_str()).copied() else {
                    continue;
                };
                self.group_in(i, unit);
                if rank == 0 {
                    self.states[i].eips.push(OwnedEip {
                        ip: *ip,
                        gateway: (*gateway).to_owned(),
                    });
                }
            }
        }
    }

    /// The states in canonical order, with the reply rule where replies
    /// are routed.
    fn finish(self) -> BTreeMap<String, NodeState> {
        let cfg = self.cfg;
        let mut states = self.states;
        for state in &mut states {
            state.peers.sort();
            state.routes.sort();
            state.rules.sort();
            state.classify.sort();
            state.snat.sort();
            state.snat.dedup();
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
}

/// A policy's unit in one family, and the unit's candidates (`None`: no
/// node at all).
type Served<'p, 'a> = (Unit<'a>, Option<&'p [String]>);

/// A hash map with a fast hasher, for lookups by node name within a plan.
type FoldMap<K, V> = HashMap<K, V, RandomState>;

/// A group's [`Group::key`].
fn group_key(unit: &Unit<'_>, works: &[Work<'_>]) -> String {
    match unit {
        Unit::Eip(gateway, ip) => format!("{gateway}/{ip}"),
        Unit::NodeIp(gateway, i) => format!("{gateway}/node-ip/{}", works[*i].policy.id),
    }
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

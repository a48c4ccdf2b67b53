//! Stage 4: the active gateway node of every EIP in use (and of every
//! `useNodeIP` policy).
//!
//! A unit stays on the node it was on (where its agent reports holding it,
//! else where the last status put it) while that node is still a candidate:
//! selected and fit, ready or not. Whether a node is alive is the data
//! plane's call (see [`crate::failover`]); the API server's view of it only
//! steers new placements. Units that need a node go, in a fixed order, to
//! the ready node already carrying the other family of the same policy, else
//! to the ready node with the fewest units (ties: by name).
//!
//! Every placed unit also gets its failover order: the active node, then
//! the other candidates, ready ones first, each part in an order of the
//! unit's own ([`standby_rank`]): the standbys of the EIPs one node holds
//! are spread over the others, and no unit's order depends on another's,
//! so one unit coming or going reorders no other.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::model::{PolicyRef, Snapshot};

use crate::net::Family;

use super::gateways::Gateways;

/// A hash map with a fast hasher, for lookups by name and address.
type FoldMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use super::{Work, fi};

/// What gets a gateway node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Unit<'a> {
    /// An EIP of a gateway, shared by the policies that use it.
    Eip(&'a str, IpAddr),
    /// A `useNodeIP` policy (by index in age order).
    NodeIp(&'a str, usize),
}

impl Unit<'_> {
    /// The gateway the unit belongs to.
    pub fn gateway(&self) -> &str {
        match self {
            Unit::Eip(g, _) | Unit::NodeIp(g, _) => g,
        }
    }
}

/// Where every unit went.
#[derive(Debug, Default)]
pub(super) struct Placed<'a> {
    /// Unit -> node; a unit without an eligible node is absent.
    pub nodes: BTreeMap<Unit<'a>, &'a str>,
    /// Unit -> its candidates, the active node first; a unit without a
    /// node is absent.
    pub candidates: BTreeMap<Unit<'a>, Vec<&'a str>>,
    /// Unit -> indexes of the policies using it.
    pub users: BTreeMap<Unit<'a>, Vec<usize>>,
}

/// Places all units and records each policy's node per family. Without
/// `place_new`, a unit stays where it was or goes nowhere (an agent
/// following the controller's placement).
pub(super) fn place<'a>(
    snapshot: &'a Snapshot,
    gateways: &Gateways<'a>,
    works: &mut [Work<'a>],
    place_new: bool,
) -> Placed<'a> {
    // Units and their users sorted once, then grouped; the maps are built
    // from them in order at the end, cheaper than trees built by insertion.
    let mut by_unit: Vec<(Unit<'a>, usize)> = Vec::with_capacity(works.len());
    for (i, w) in works.iter().enumerate() {
        by_unit.extend(units_of(i, w).map(|u| (u, i)));
    }
    by_unit.sort_unstable();
    let mut users: Vec<(Unit<'a>, Vec<usize>)> = Vec::new();
    for (unit, i) in by_unit {
        match users.last_mut() {
            Some((last, of)) if *last == unit => of.push(i),
            _ => users.push((unit, vec![i])),
        }
    }
    let addresses: FoldMap<&str, &[IpAddr]> = snapshot
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n.addresses.as_slice()))
        .collect();
    // An EIP needs a node that carries its family; a node-IP unit needs one
    // that carries, and has an address of, every family the policy uses.
    // `ready`: eligible for a new placement; otherwise a candidate.
    let fits = |unit: &Unit<'_>, node: &str, ready: bool| {
        let info = &gateways.by_name[unit.gateway()];
        let carries = |f: Family| {
            if ready {
                info.eligible(node, f)
            } else {
                info.candidate(node, f)
            }
        };
        match unit {
            Unit::Eip(_, ip) => carries(Family::of(*ip)),
            Unit::NodeIp(_, i) => Family::ALL
                .into_iter()
                .filter(|f| works[*i].node_ip[fi(*f)])
                .all(|f| {
                    carries(f)
                        && addresses
                            .get(node)
                            .is_some_and(|a| a.iter().any(|ip| Family::of(*ip) == f))
                }),
        }
    };
    let eligible = |unit: &Unit<'_>, node: &str| fits(unit, node, true);
    let candidate = |unit: &Unit<'_>, node: &str| fits(unit, node, false);
    // Where agents report holding each EIP; an EIP two nodes report (a
    // moment during a move) is left to the last status.
    let mut reported: BTreeMap<IpAddr, Option<&str>> = BTreeMap::new();
    for node in &snapshot.nodes {
        for ip in &node.held_eips {
            reported
                .entry(*ip)
                .and_modify(|n| *n = None)
                .or_insert(Some(node.name.as_str()));
        }
    }

    // Per unit (as in `users`): its node.
    let mut nodes: Vec<Option<&'a str>> = vec![None; users.len()];
    let mut load: FoldMap<&'a str, usize> = FoldMap::default();
    for ((unit, _), at) in users.iter().zip(&mut nodes) {
        let previous = match unit {
            Unit::Eip(g, ip) => reported.get(ip).copied().flatten().or_else(|| {
                gateways.by_name[g]
                    .gateway
                    .previous_nodes
                    .get(ip)
                    .map(String::as_str)
            }),
            Unit::NodeIp(_, i) => works[*i].policy.previous_node.as_deref(),
        };
        if let Some(node) = previous.filter(|n| candidate(unit, n)) {
            *load.entry(node).or_default() += 1;
            *at = Some(node);
        }
    }
    for k in (0..users.len()).filter(|_| place_new) {
        let (unit, policy_idxs) = &users[k];
        if nodes[k].is_some() {
            continue;
        }
        let node_of = |u: &Unit<'_>| {
            let at = users.binary_search_by(|(o, _)| o.cmp(u)).ok()?;
            nodes[at]
        };
        let partner = policy_idxs
            .iter()
            .flat_map(|i| units_of(*i, &works[*i]))
            .filter_map(|u| node_of(&u))
            .find(|n| eligible(unit, n));
        let choice = partner.or_else(|| {
            gateways.by_name[unit.gateway()]
                .selected
                .iter()
                .filter(|n| eligible(unit, n))
                .min_by_key(|n| (load.get(**n).copied().unwrap_or(0), **n))
                .copied()
        });
        if let Some(node) = choice {
            *load.entry(node).or_default() += 1;
            nodes[k] = Some(node);
        }
    }

    // The candidates of a unit, each with whether it is not ready: the
    // same for every EIP of one gateway and family, so found once for them.
    let fitting = |unit: &Unit<'_>| -> Vec<(bool, &'a str)> {
        gateways.by_name[unit.gateway()]
            .selected
            .iter()
            .filter(|n| candidate(unit, n))
            .map(|n| (!eligible(unit, n), *n))
            .collect()
    };
    let mut of_eips: FoldMap<(&str, Family), Vec<(bool, &'a str)>> = FoldMap::default();
    let candidates: BTreeMap<Unit<'a>, Vec<&'a str>> = users
        .iter()
        .zip(&nodes)
        .filter_map(|((unit, _), active)| Some((unit, (*active)?)))
        .map(|(unit, active)| {
            let node_ip;
            let fit: &[(bool, &'a str)] = match unit {
                Unit::Eip(g, ip) => of_eips
                    .entry((*g, Family::of(*ip)))
                    .or_insert_with(|| fitting(unit)),
                Unit::NodeIp(..) => {
                    node_ip = fitting(unit);
                    &node_ip
                }
            };
            let key = unit_key(unit, works);
            let order = failover_order(&key, active, fit.iter().copied());
            (unit.clone(), order)
        })
        .collect();

    for w in works.iter_mut() {
        w.nodes = [None, None];
    }
    for ((unit, of), node) in users.iter().zip(&nodes) {
        for i in of.iter().copied() {
            for family in Family::ALL {
                if unit_for(i, &works[i], family).as_ref() == Some(unit) {
                    works[i].nodes[fi(family)] = *node;
                }
            }
        }
    }
    let nodes = users
        .iter()
        .zip(nodes)
        .filter_map(|((unit, _), node)| Some((unit.clone(), node?)))
        .collect();
    Placed {
        nodes,
        candidates,
        users: users.into_iter().collect(),
    }
}

/// A unit's key: its group's ([`crate::state::Group::key`]), and what its
/// standbys are ranked by.
pub(super) fn unit_key(unit: &Unit<'_>, works: &[Work<'_>]) -> String {
    match unit {
        Unit::Eip(gateway, ip) => eip_key(gateway, *ip),
        Unit::NodeIp(gateway, i) => node_ip_key(gateway, &works[*i].policy.id),
    }
}

/// The key of the EIP `ip` of `gateway`'s unit.
pub(super) fn eip_key(gateway: &str, ip: IpAddr) -> String {
    format!("{gateway}/{ip}")
}

/// The key of the unit of `policy`, a `useNodeIP` policy of `gateway`.
pub(super) fn node_ip_key(gateway: &str, policy: &PolicyRef) -> String {
    format!("{gateway}/node-ip/{policy}")
}

/// The failover order of the unit `key` held by `active`: `active`, then
/// the other nodes of `fit` (each with whether it is not ready), ready
/// ones first, each part by [`standby_rank`].
pub(super) fn failover_order<'n>(
    key: &str,
    active: &'n str,
    fit: impl Iterator<Item = (bool, &'n str)>,
) -> Vec<&'n str> {
    let mut standbys: Vec<(bool, u64, &'n str)> = fit
        .filter(|(_, n)| *n != active)
        .map(|(not_ready, n)| (not_ready, standby_rank(key, n), n))
        .collect();
    standbys.sort_unstable();
    std::iter::once(active)
        .chain(standbys.into_iter().map(|(_, _, n)| n))
        .collect()
}

/// Where `node` stands among the standbys of the unit `key`, lowest first:
/// a hash of both (rendezvous hashing), the same on every node and in
/// every release, so that agents and the controller agree on it without
/// asking each other. Each unit orders the nodes its own way: when a node
/// fails, the units it held spread over the others instead of all going
/// to one.
pub fn standby_rank(key: &str, node: &str) -> u64 {
    // The key, a separator no name holds, and the node.
    super::tunnels::mix(key.bytes().chain([0]).chain(node.bytes()), 0)
}

/// The unit serving `family` of policy `i`.
pub(super) fn unit_for<'a>(i: usize, w: &Work<'a>, family: Family) -> Option<Unit<'a>> {
    let gateway = w.gateway?;
    if w.failure.is_some() {
        return None;
    }
    if w.node_ip[fi(family)] {
        return Some(Unit::NodeIp(gateway, i));
    }
    w.eips[fi(family)].map(|ip| Unit::Eip(gateway, ip))
}

/// The units of policy `i`: one per family it uses, one for both when
/// they share it.
fn units_of<'a>(i: usize, w: &Work<'a>) -> impl Iterator<Item = Unit<'a>> {
    let [v4, v6] = Family::ALL.map(|f| unit_for(i, w, f));
    let v6 = v6.filter(|u| v4.as_ref() != Some(u));
    v4.into_iter().chain(v6)
}

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
//! the other candidates, ready ones first, each part by load then name.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::model::Snapshot;

use crate::net::Family;

use super::gateways::Gateways;
use super::{Work, fi};

/// What gets a gateway node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
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
    pub nodes: BTreeMap<Unit<'a>, String>,
    /// Unit -> its candidates, the active node first; a unit without a
    /// node is absent.
    pub candidates: BTreeMap<Unit<'a>, Vec<String>>,
    /// Unit -> indexes of the policies using it.
    pub users: BTreeMap<Unit<'a>, Vec<usize>>,
}

/// Places all units and records each policy's node per family. Without
/// `place_new`, a unit stays where it was or goes nowhere (an agent
/// following the controller's placement).
pub(super) fn place<'a>(
    snapshot: &Snapshot,
    gateways: &Gateways<'a>,
    works: &mut [Work<'a>],
    place_new: bool,
) -> Placed<'a> {
    let mut users: BTreeMap<Unit<'a>, Vec<usize>> = BTreeMap::new();
    for (i, w) in works.iter().enumerate() {
        for unit in units_of(i, w) {
            users.entry(unit).or_default().push(i);
        }
    }
    let addresses: HashMap<&str, &[IpAddr]> = snapshot
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

    let mut nodes: BTreeMap<Unit<'a>, String> = BTreeMap::new();
    let mut load: HashMap<String, usize> = HashMap::new();
    for unit in users.keys() {
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
            *load.entry(node.to_owned()).or_default() += 1;
            nodes.insert(unit.clone(), node.to_owned());
        }
    }
    for (unit, policy_idxs) in users.iter().filter(|_| place_new) {
        if nodes.contains_key(unit) {
            continue;
        }
        let partner = policy_idxs
            .iter()
            .flat_map(|i| units_of(*i, &works[*i]))
            .filter_map(|u| nodes.get(&u))
            .find(|n| eligible(unit, n))
            .cloned();
        let choice = partner.or_else(|| {
            gateways.by_name[unit.gateway()]
                .selected
                .iter()
                .filter(|n| eligible(unit, n))
                .min_by_key(|n| (load.get(**n).copied().unwrap_or(0), **n))
                .map(|n| (*n).to_owned())
        });
        if let Some(node) = choice {
            *load.entry(node.clone()).or_default() += 1;
            nodes.insert(unit.clone(), node);
        }
    }

    let mut candidates: BTreeMap<Unit<'a>, Vec<String>> = BTreeMap::new();
    for (unit, active) in &nodes {
        let mut standbys: Vec<(bool, usize, &str)> = gateways.by_name[unit.gateway()]
            .selected
            .iter()
            .filter(|n| **n != active && candidate(unit, n))
            .map(|n| (!eligible(unit, n), load.get(*n).copied().unwrap_or(0), *n))
            .collect();
        standbys.sort_unstable();
        let order = std::iter::once(active.clone())
            .chain(standbys.into_iter().map(|(_, _, n)| n.to_owned()))
            .collect();
        candidates.insert(unit.clone(), order);
    }

    for (i, w) in works.iter_mut().enumerate() {
        for family in Family::ALL {
            w.nodes[fi(family)] = unit_for(i, w, family).and_then(|u| nodes.get(&u).cloned());
        }
    }
    Placed {
        nodes,
        candidates,
        users,
    }
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

fn units_of<'a>(i: usize, w: &Work<'a>) -> Vec<Unit<'a>> {
    let mut units: Vec<Unit<'a>> = Family::ALL
        .into_iter()
        .filter_map(|f| unit_for(i, w, f))
        .collect();
    units.dedup();
    units
}

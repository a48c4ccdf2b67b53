//! Desired vs. observed dataplane state -> the operations that turn one into
//! the other.
//!
//! [`diff`]`(desired, observed)` lists what to add, change and remove so that
//! [`apply`]`(observed, ops)` equals `desired`. Every item has a key (a peer
//! by node, a route by table, a classification entry by source and
//! destination, ...): a key present on both sides with another value is a
//! [`Op::Change`], which a dataplane can often carry out in place (a map
//! update, a route replace) without a gap in traffic.
//!
//! Order: device first, then additions and changes, then removals, and the
//! device's removal last, so that new paths exist before old ones go.

use ipnet::IpNet;
use serde::Serialize;

use crate::state::{
    ClassifyEntry, NodeState, OwnedEip, Peer, ReplyRoute, Route, Rule, SnatEntry, Vxlan,
};

/// One piece of dataplane state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Item {
    /// The tunnel device.
    Vxlan(Vxlan),
    /// A peer's neighbour + FDB entries.
    Peer(Peer),
    /// A gateway node's routing table.
    Route(Route),
    /// A policy-routing rule.
    Rule(Rule),
    /// An in-cluster prefix.
    ClusterCidr(IpNet),
    /// A classification entry.
    Classify(ClassifyEntry),
    /// A SNAT entry.
    Snat(SnatEntry),
    /// A route back to a pod's node.
    Reply(ReplyRoute),
    /// An owned EIP.
    Eip(OwnedEip),
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Op {
    /// Create the item.
    Add(Item),
    /// Replace the observed item (`from`) by the desired one (`to`); same key.
    Change {
        /// As observed.
        from: Item,
        /// As desired.
        to: Item,
    },
    /// Delete the item.
    Remove(Item),
}

/// The operations that turn `observed` into `desired`.
pub fn diff(desired: &NodeState, observed: &NodeState) -> Vec<Op> {
    let mut adds = Vec::new();
    let mut removes = Vec::new();
    let mut device_first = Vec::new();
    let mut device_last = Vec::new();
    match (&desired.vxlan, &observed.vxlan) {
        (Some(d), None) => device_first.push(Op::Add(Item::Vxlan(d.clone()))),
        (None, Some(o)) => device_last.push(Op::Remove(Item::Vxlan(o.clone()))),
        (Some(d), Some(o)) if d != o => device_first.push(Op::Change {
            from: Item::Vxlan(o.clone()),
            to: Item::Vxlan(d.clone()),
        }),
        _ => {}
    }
    keyed(
        &desired.peers,
        &observed.peers,
        |p| p.node.clone(),
        Item::Peer,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.routes,
        &observed.routes,
        |r| r.table,
        Item::Route,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.rules,
        &observed.rules,
        Clone::clone,
        Item::Rule,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.cluster_cidrs,
        &observed.cluster_cidrs,
        |n| *n,
        Item::ClusterCidr,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.classify,
        &observed.classify,
        |e| (e.src, e.dst),
        Item::Classify,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.snat,
        &observed.snat,
        |e| (e.src, e.dst),
        Item::Snat,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.replies,
        &observed.replies,
        |r| r.dst,
        Item::Reply,
        &mut adds,
        &mut removes,
    );
    keyed(
        &desired.eips,
        &observed.eips,
        |e| e.ip,
        Item::Eip,
        &mut adds,
        &mut removes,
    );
    removes.reverse();
    device_first
        .into_iter()
        .chain(adds)
        .chain(removes)
        .chain(device_last)
        .collect()
}

/// Applies `ops` to `state`, keeping every list sorted and unique by key.
/// Adding an existing key replaces it; removing a missing key does nothing.
pub fn apply(state: &mut NodeState, ops: &[Op]) {
    for op in ops {
        match op {
            Op::Add(item) | Op::Change { to: item, .. } => put(state, item.clone()),
            Op::Remove(item) => take(state, item),
        }
    }
}

/// Sorted merge of two lists by key: adds for keys only desired, changes for
/// keys on both sides with different values, removes for keys only observed.
/// Lists must be sorted by key (as the planner and [`apply`] keep them).
fn keyed<T: Clone + PartialEq, K: Ord>(
    desired: &[T],
    observed: &[T],
    key: impl Fn(&T) -> K,
    wrap: impl Fn(T) -> Item,
    adds: &mut Vec<Op>,
    removes: &mut Vec<Op>,
) {
    let (mut d, mut o) = (desired.iter().peekable(), observed.iter().peekable());
    loop {
        match (d.peek(), o.peek()) {
            (None, None) => break,
            (Some(x), None) => {
                adds.push(Op::Add(wrap((*x).clone())));
                d.next();
            }
            (None, Some(y)) => {
                removes.push(Op::Remove(wrap((*y).clone())));
                o.next();
            }
            (Some(x), Some(y)) => match key(x).cmp(&key(y)) {
                std::cmp::Ordering::Less => {
                    adds.push(Op::Add(wrap((*x).clone())));
                    d.next();
                }
                std::cmp::Ordering::Greater => {
                    removes.push(Op::Remove(wrap((*y).clone())));
                    o.next();
                }
                std::cmp::Ordering::Equal => {
                    if x != y {
                        adds.push(Op::Change {
                            from: wrap((*y).clone()),
                            to: wrap((*x).clone()),
                        });
                    }
                    d.next();
                    o.next();
                }
            },
        }
    }
}

fn put(state: &mut NodeState, item: Item) {
    match item {
        Item::Vxlan(v) => state.vxlan = Some(v),
        Item::Peer(p) => upsert(&mut state.peers, p, |p| p.node.clone()),
        Item::Route(r) => upsert(&mut state.routes, r, |r| r.table),
        Item::Rule(r) => upsert(&mut state.rules, r, Clone::clone),
        Item::ClusterCidr(n) => upsert(&mut state.cluster_cidrs, n, |n| *n),
        Item::Classify(e) => upsert(&mut state.classify, e, |e| (e.src, e.dst)),
        Item::Snat(e) => upsert(&mut state.snat, e, |e| (e.src, e.dst)),
        Item::Reply(r) => upsert(&mut state.replies, r, |r| r.dst),
        Item::Eip(e) => upsert(&mut state.eips, e, |e| e.ip),
    }
}

fn take(state: &mut NodeState, item: &Item) {
    match item {
        Item::Vxlan(_) => state.vxlan = None,
        Item::Peer(p) => remove(&mut state.peers, &p.node.clone(), |p| p.node.clone()),
        Item::Route(r) => remove(&mut state.routes, &r.table, |r| r.table),
        Item::Rule(r) => remove(&mut state.rules, r, Clone::clone),
        Item::ClusterCidr(n) => remove(&mut state.cluster_cidrs, n, |n| *n),
        Item::Classify(e) => remove(&mut state.classify, &(e.src, e.dst), |e| (e.src, e.dst)),
        Item::Snat(e) => remove(&mut state.snat, &(e.src, e.dst), |e| (e.src, e.dst)),
        Item::Reply(r) => remove(&mut state.replies, &r.dst, |r| r.dst),
        Item::Eip(e) => remove(&mut state.eips, &e.ip, |e| e.ip),
    }
}

fn upsert<T, K: Ord>(list: &mut Vec<T>, item: T, key: impl Fn(&T) -> K) {
    match list.binary_search_by(|x| key(x).cmp(&key(&item))) {
        Ok(i) => list[i] = item,
        Err(i) => list.insert(i, item),
    }
}

fn remove<T, K: Ord>(list: &mut Vec<T>, k: &K, key: impl Fn(&T) -> K) {
    if let Ok(i) = list.binary_search_by(|x| key(x).cmp(k)) {
        list.remove(i);
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use proptest::prelude::*;

    use super::*;
    use crate::model::{Mac, PolicyRef};
    use crate::state::{Action, SnatTo};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn entry(src: &str, dst: &str, gateway: &str) -> ClassifyEntry {
        ClassifyEntry {
            src: ip(src),
            dst: dst.parse().unwrap(),
            action: Action::Tunnel {
                gateway: gateway.into(),
                mark: 0x0100_0000,
            },
            policy: Some(PolicyRef::namespaced("ns", "p")),
            group: None,
        }
    }

    #[test]
    fn a_changed_action_for_the_same_source_and_destination_is_a_change_not_a_remove_and_add() {
        let observed = NodeState {
            classify: vec![entry("10.0.0.1", "0.0.0.0/0", "a")],
            ..NodeState::default()
        };
        let desired = NodeState {
            classify: vec![entry("10.0.0.1", "0.0.0.0/0", "b")],
            ..NodeState::default()
        };
        let ops = diff(&desired, &observed);
        assert!(matches!(ops.as_slice(), [Op::Change { .. }]), "{ops:?}");
    }

    #[test]
    fn additions_come_before_removals() {
        let observed = NodeState {
            classify: vec![entry("10.0.0.1", "0.0.0.0/0", "a")],
            ..NodeState::default()
        };
        let desired = NodeState {
            classify: vec![entry("10.0.0.2", "0.0.0.0/0", "a")],
            ..NodeState::default()
        };
        let ops = diff(&desired, &observed);
        assert!(
            matches!(ops.as_slice(), [Op::Add(_), Op::Remove(_)]),
            "{ops:?}"
        );
    }

    fn arb_state() -> impl Strategy<Value = NodeState> {
        let entry = (0u8..6, 0u8..4, 0u8..3).prop_map(|(s, d, g)| ClassifyEntry {
            src: IpAddr::from([10, 0, 0, s]),
            dst: IpNet::new(IpAddr::from([192, 0, 2, 0]), 24 + d)
                .unwrap()
                .trunc(),
            action: if g == 0 {
                Action::Bypass
            } else {
                Action::Tunnel {
                    gateway: format!("n{g}"),
                    mark: u32::from(g) << 24,
                }
            },
            policy: None,
            group: None,
        });
        let peer = (0u8..5, 0u8..3).prop_map(|(n, m)| Peer {
            node: format!("n{n}"),
            underlay: IpAddr::from([172, 18, 0, n]),
            mac: Mac([2, 0, 0, 0, n, m]),
            ipv4: Some([172, 31, 0, n + 1].into()),
            ipv6: None,
        });
        let snat = (0u8..6, 0u8..3).prop_map(|(s, e)| SnatEntry {
            src: IpAddr::from([10, 0, 0, s]),
            dst: "0.0.0.0/0".parse().unwrap(),
            to: if e == 0 {
                SnatTo::NodeIp
            } else {
                SnatTo::Eip(IpAddr::from([198, 51, 100, e]))
            },
            origin: format!("n{s}"),
            policy: PolicyRef::cluster("p"),
        });
        (
            prop::collection::vec(entry, 0..12),
            prop::collection::vec(peer, 0..6),
            prop::collection::vec(snat, 0..6),
            prop::option::of(0u8..3),
        )
            .prop_map(|(classify, peers, snat, port)| {
                let mut s = NodeState {
                    vxlan: port.map(|p| Vxlan {
                        name: "egress.vxlan".into(),
                        vni: 100,
                        port: 7789 + u16::from(p),
                        local: ip("172.18.0.1"),
                        mac: Mac([2, 0, 0, 0, 0, 1]),
                        ipv4: Some([172, 31, 0, 1].into()),
                        ipv6: None,
                        ipv4_prefix_len: 16,
                        ipv6_prefix_len: 112,
                        disable_checksum_offload: false,
                    }),
                    ..NodeState::default()
                };
                // Normalise as the planner does: sorted and unique by key.
                apply(
                    &mut s,
                    &classify
                        .into_iter()
                        .map(|e| Op::Add(Item::Classify(e)))
                        .collect::<Vec<_>>(),
                );
                apply(
                    &mut s,
                    &peers
                        .into_iter()
                        .map(|p| Op::Add(Item::Peer(p)))
                        .collect::<Vec<_>>(),
                );
                apply(
                    &mut s,
                    &snat
                        .into_iter()
                        .map(|e| Op::Add(Item::Snat(e)))
                        .collect::<Vec<_>>(),
                );
                s
            })
    }

    proptest! {
        #[test]
        fn a_state_diffed_against_itself_needs_nothing(s in arb_state()) {
            prop_assert!(diff(&s, &s).is_empty());
        }

        #[test]
        fn applying_the_diff_to_the_observed_state_yields_the_desired_one(a in arb_state(), b in arb_state()) {
            let ops = diff(&a, &b);
            let mut state = b.clone();
            apply(&mut state, &ops);
            prop_assert_eq!(&state, &a);
            prop_assert!(diff(&a, &state).is_empty(), "a second diff in a row plans nothing");
        }
    }
}

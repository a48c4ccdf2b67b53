use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::Mac;
use crate::state::{Action, Candidate, ClassifyEntry, Group, NodeState, OwnedEip, Peer};

use super::{Resolved, View};

/// [`super::resolve`] of a copy of `planned`.
fn resolve(planned: &NodeState, view: View<'_>) -> Resolved {
    super::resolve(&Arc::new(planned.clone()), view)
}

const EIP: &str = "198.51.100.200";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn mark(node: &str) -> u32 {
    match node {
        "a" => 0x0100_0000,
        "b" => 0x0200_0000,
        "c" => 0x0300_0000,
        _ => 0x0400_0000,
    }
}

/// `me` in a cluster of `nodes`, with one pod sending to the EIP group
/// whose candidates are `candidates` (planned active first).
fn planned(me: &str, nodes: &[&str], candidates: &[&str], fail_closed: bool) -> NodeState {
    let peers = nodes
        .iter()
        .filter(|n| **n != me)
        .map(|n| Peer {
            node: (*n).to_owned(),
            underlay: ip("192.0.2.1"),
            mac: Mac([2, 0, 0, 0, 0, 1]),
            ipv4: None,
            ipv6: None,
        })
        .collect();
    let active = candidates[0];
    let action = if active == me {
        Action::Local
    } else {
        Action::Tunnel {
            gateway: active.to_owned(),
            mark: mark(active),
        }
    };
    NodeState {
        node: me.to_owned(),
        peers,
        classify: vec![ClassifyEntry {
            src: ip("10.244.1.5"),
            dst: "0.0.0.0/0".parse().unwrap(),
            action,
            policy: None,
            group: Some(0),
        }],
        eips: if active == me {
            vec![OwnedEip {
                ip: ip(EIP),
                gateway: "gw".into(),
            }]
        } else {
            Vec::new()
        },
        groups: vec![Group {
            id: 0,
            key: format!("gw/{EIP}"),
            gateway: "gw".into(),
            eip: Some(ip(EIP)),
            candidates: candidates
                .iter()
                .map(|n| Candidate {
                    node: (*n).to_owned(),
                    mark: mark(n),
                })
                .collect(),
            fail_closed,
        }],
        ..NodeState::default()
    }
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

struct Seen {
    live: BTreeSet<String>,
    held: BTreeSet<IpAddr>,
    in_use: BTreeSet<IpAddr>,
    previous: BTreeMap<String, String>,
    holders: BTreeMap<IpAddr, BTreeSet<String>>,
}

impl Seen {
    fn new(live: &[&str]) -> Self {
        Seen {
            live: set(live),
            held: BTreeSet::new(),
            in_use: BTreeSet::new(),
            previous: BTreeMap::new(),
            holders: BTreeMap::new(),
        }
    }

    fn holding(mut self) -> Self {
        self.held.insert(ip(EIP));
        self
    }

    fn view(&self) -> View<'_> {
        View {
            live: &self.live,
            held: &self.held,
            in_use: &self.in_use,
            previous: &self.previous,
            holders: &self.holders,
        }
    }
}

fn action(state: &NodeState) -> &Action {
    &state.classify[0].action
}

#[test]
fn with_every_node_live_the_plan_stands() {
    let plan = planned("a", &["a", "b", "c"], &["b", "c"], true);
    let seen = Seen::new(&["b", "c"]);
    let out = resolve(&plan, seen.view());
    assert_eq!(*out.state, plan);
    assert!(out.claims.is_empty());

    // The holder's plan stands as it is: resolved without a copy.
    let holder = Arc::new(planned("b", &["a", "b", "c"], &["b", "c"], true));
    let seen = Seen::new(&["a", "c"]).holding();
    let out = super::resolve(&holder, seen.view());
    assert!(Arc::ptr_eq(&out.state, &holder));
    assert!(out.released.is_empty());

    // Once its EIP goes elsewhere, the plan is copied and changed.
    let out = super::resolve(&holder, Seen::new(&["a", "c"]).view());
    assert!(!Arc::ptr_eq(&out.state, &holder));
    assert!(out.state.eips.is_empty());
    assert_eq!(*holder, planned("b", &["a", "b", "c"], &["b", "c"], true));
}

#[test]
fn a_source_sends_to_the_next_live_candidate_at_once() {
    let plan = planned("a", &["a", "b", "c"], &["b", "c"], true);
    let out = resolve(&plan, Seen::new(&["c"]).view());
    assert_eq!(
        action(&out.state),
        &Action::Tunnel {
            gateway: "c".into(),
            mark: mark("c")
        }
    );
    assert_eq!(out.targets[&format!("gw/{EIP}")], Some("c".to_owned()));
}

#[test]
fn the_first_live_standby_with_a_majority_claims_the_eip() {
    let plan = planned("c", &["a", "b", "c"], &["b", "c"], true);
    let out = resolve(&plan, Seen::new(&["a"]).view());
    assert_eq!(out.claims, vec![ip(EIP)]);
    assert_eq!(action(&out.state), &Action::Local);
    // Not held until the segment has been checked.
    assert!(out.state.eips.is_empty());
    let seen = Seen::new(&["a"]).holding();
    let out = resolve(&plan, seen.view());
    assert_eq!(out.state.eips.len(), 1);
    assert!(out.claims.is_empty());
}

#[test]
fn a_holder_cut_off_from_the_majority_gives_its_eip_up() {
    let plan = planned("b", &["a", "b", "c"], &["b", "c"], true);
    let out = resolve(&plan, Seen::new(&[]).holding().view());
    assert!(out.state.eips.is_empty());
    assert_eq!(
        out.released,
        vec![(ip(EIP), "this node reaches fewer than half of the nodes")]
    );
    assert!(
        out.claims.is_empty(),
        "a node without a majority claims nothing"
    );
    // Its own pods' traffic has nowhere to go: dropped, not sent the normal way.
    assert_eq!(action(&out.state), &Action::Drop);
}

#[test]
fn a_holder_with_half_keeps_and_a_standby_with_half_does_not_claim() {
    // Two nodes that cannot see each other: neither side has a majority.
    let holder = planned("b", &["b", "c"], &["b", "c"], true);
    let out = resolve(&holder, Seen::new(&[]).holding().view());
    assert_eq!(out.state.eips.len(), 1);
    let standby = planned("c", &["b", "c"], &["b", "c"], true);
    let out = resolve(&standby, Seen::new(&[]).view());
    assert!(out.claims.is_empty());
    assert_eq!(action(&out.state), &Action::Drop);
}

#[test]
fn a_standby_that_took_over_keeps_the_eip_when_the_first_node_returns() {
    let plan = planned("c", &["a", "b", "c"], &["b", "c"], true);
    let out = resolve(&plan, Seen::new(&["a", "b"]).holding().view());
    assert_eq!(out.state.eips.len(), 1);
    assert_eq!(action(&out.state), &Action::Local);

    // A source that moved to c stays with it.
    let source = planned("a", &["a", "b", "c"], &["b", "c"], true);
    let mut seen = Seen::new(&["b", "c"]);
    seen.previous.insert(format!("gw/{EIP}"), "c".into());
    let out = resolve(&source, seen.view());
    assert_eq!(out.targets[&format!("gw/{EIP}")], Some("c".to_owned()));

    // The returning node finds the EIP answered on the segment: it does
    // not claim, and sends its own pods to the next live candidate.
    let returning = planned("b", &["a", "b", "c"], &["b", "c"], true);
    let mut seen = Seen::new(&["a", "c"]);
    seen.in_use.insert(ip(EIP));
    let out = resolve(&returning, seen.view());
    assert!(out.claims.is_empty());
    assert_eq!(
        action(&out.state),
        &Action::Tunnel {
            gateway: "c".into(),
            mark: mark("c")
        }
    );
}

#[test]
fn a_source_that_moved_on_a_hiccup_returns_to_the_candidate_holding_the_eip() {
    let key = format!("gw/{EIP}");
    let source = planned("a", &["a", "b", "c"], &["b", "c"], true);
    // b missed a few probes: a moved to c, which does not hold the EIP.
    let mut seen = Seen::new(&["b", "c"]);
    seen.previous.insert(key.clone(), "c".into());
    // Nothing known about holders: a stays where it went.
    assert_eq!(
        resolve(&source, seen.view()).targets[&key],
        Some("c".to_owned())
    );
    // b answers for the EIP: back to b.
    seen.holders.insert(ip(EIP), set(&["b"]));
    let out = resolve(&source, seen.view());
    assert_eq!(out.targets[&key], Some("b".to_owned()));
    assert_eq!(
        action(&out.state),
        &Action::Tunnel {
            gateway: "b".into(),
            mark: mark("b")
        }
    );
    // A holder that does not answer its probes is not followed.
    let mut seen = Seen::new(&["c"]);
    seen.holders.insert(ip(EIP), set(&["b"]));
    assert_eq!(
        resolve(&source, seen.view()).targets[&key],
        Some("c".to_owned())
    );
    // Two answer for it for a moment (a takeover under way): the one the
    // traffic goes to already stays.
    let mut seen = Seen::new(&["b", "c"]);
    seen.holders.insert(ip(EIP), set(&["b", "c"]));
    seen.previous.insert(key.clone(), "c".into());
    assert_eq!(
        resolve(&source, seen.view()).targets[&key],
        Some("c".to_owned())
    );
    // A holder's own decision is not changed by what others answer.
    let holder = planned("b", &["a", "b", "c"], &["b", "c"], true);
    let mut seen = Seen::new(&["a", "c"]).holding();
    seen.holders.insert(ip(EIP), set(&["c"]));
    assert_eq!(
        resolve(&holder, seen.view()).targets[&key],
        Some("b".to_owned())
    );
}

#[test]
fn with_no_live_candidate_traffic_is_dropped_or_failing_open_sent_the_normal_way() {
    let closed = planned("a", &["a", "b", "c"], &["b", "c"], true);
    assert_eq!(
        action(&resolve(&closed, Seen::new(&[]).view()).state),
        &Action::Drop
    );
    let open = planned("a", &["a", "b", "c"], &["b", "c"], false);
    let out = resolve(&open, Seen::new(&[]).view());
    assert_eq!(action(&out.state), &Action::Bypass);
    assert_eq!(out.targets[&format!("gw/{EIP}")], None);
}

#[test]
fn an_eip_no_longer_planned_here_is_released() {
    let plan = planned("a", &["a", "b", "c"], &["b", "c"], true);
    let out = resolve(&plan, Seen::new(&["b", "c"]).holding().view());
    assert_eq!(
        out.released,
        vec![(ip(EIP), "this node is no longer a candidate")]
    );
}

#[test]
fn two_candidates_that_sent_to_each_other_do_not_wait_for_each_other_forever() {
    // Their plans disagreed for a moment (each saw the other first), so
    // each sent the group to the other; now they agree that a comes first.
    let key = format!("gw/{EIP}");
    let a = planned("a", &["a", "b", "c"], &["a", "b"], true);
    let mut seen = Seen::new(&["b", "c"]);
    seen.previous.insert(key.clone(), "b".into());
    let out = resolve(&a, seen.view());
    assert_eq!(out.claims, vec![ip(EIP)], "the first live candidate claims");
    assert_eq!(out.targets[&key], Some("a".to_owned()));

    let b = planned("b", &["a", "b", "c"], &["a", "b"], true);
    let mut seen = Seen::new(&["a", "c"]);
    seen.previous.insert(key.clone(), "a".into());
    let out = resolve(&b, seen.view());
    assert!(out.claims.is_empty());
    assert_eq!(out.targets[&key], Some("a".to_owned()));

    // A standby that sent its own pods to the next one while the first was
    // silent claims nothing when the first is back and nobody holds yet.
    let mut seen = Seen::new(&["a", "c"]);
    seen.previous.insert(key.clone(), "a".into());
    let c = planned("c", &["a", "b", "c"], &["a", "b", "c"], true);
    let out = resolve(&c, seen.view());
    assert!(out.claims.is_empty());
}

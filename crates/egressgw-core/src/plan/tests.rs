//! Planner tests: one rule each, on small hand-built clusters, then
//! properties over generated ones.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use ipnet::IpNet;
use proptest::prelude::*;

use super::incremental::{Planner, PodChange};
use super::publish::Publisher;
use super::*;
use crate::model::{
    Age, Allocator, EgressIpSpec, Gateway, InvalidObject, Labels, Namespace, Node, Pod, PodMatch,
    Policy, PolicyRef,
};
use crate::net::{IpPool, IpRange};
use crate::selector::{LabelSelector, Requirement};
use crate::state::{Action, ClassifyEntry, SnatTo};
use crate::status::{ConditionType, PolicyStatus};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A cluster of three nodes: `n1` (workers only), `g1` and `g2` (gateway-capable),
/// namespaces `a` and `b`, one gateway `gw` with pool 198.51.100.10-198.51.100.13.
struct Cluster(Snapshot);

impl Cluster {
    fn new() -> Self {
        let mut s = Snapshot::default();
        for (i, name) in ["n1", "g1", "g2"].into_iter().enumerate() {
            let gw = if name.starts_with('g') {
                "true"
            } else {
                "false"
            };
            s.nodes.push(Node {
                name: name.into(),
                labels: labels(&[("egress", gw)]),
                addresses: vec![ip(&format!("172.18.0.{}", 11 + i))],
                external_addresses: Vec::new(),
                pod_cidrs: vec![net(&format!("10.244.{}.0/24", i + 1))],
                ready: true,
                held_eips: Vec::new(),
            });
        }
        for ns in ["a", "b"] {
            s.namespaces.push(Namespace {
                name: ns.into(),
                labels: labels(&[("team", ns)]),
            });
        }
        s.gateways
            .push(gateway("gw", "198.51.100.10-198.51.100.13", true, 1));
        Cluster(s)
    }

    fn pod(mut self, ns: &str, name: &str, node: &str, addr: &str, app: &str) -> Self {
        self.0.pods.push(Pod {
            namespace: ns.into(),
            name: name.into(),
            labels: labels(&[("app", app)]),
            ips: vec![ip(addr)],
            node: Some(node.into()),
            host_network: false,
        });
        self
    }

    fn policy(mut self, p: Policy) -> Self {
        self.0.policies.push(Arc::new(p));
        self
    }

    fn plan(&self) -> Plan {
        plan(&self.0)
    }
}

fn gateway(name: &str, pool: &str, cluster_default: bool, created: i64) -> Gateway {
    Gateway {
        fail_closed: false,
        namespace_selector: None,
        name: name.into(),
        node_selector: LabelSelector::eq("egress", "true"),
        ipv4_pool: IpPool::new(
            pool.split(',')
                .map(|r| r.parse::<IpRange>().unwrap())
                .collect(),
        ),
        ipv6_pool: IpPool::default(),
        ipv4_default: None,
        ipv6_default: None,
        cluster_default,
        age: Age {
            created,
            uid: name.into(),
        },
        previous_nodes: BTreeMap::new(),
        errors: Vec::new(),
    }
}

fn policy(ns: &str, name: &str, app: &str) -> Policy {
    Policy {
        id: PolicyRef::namespaced(ns, name),
        gateway: None,
        egress_ip: EgressIpSpec::default(),
        pods: PodMatch::Selector(LabelSelector::eq("app", app)),
        namespace_selector: None,
        dest_subnets: Vec::new(),
        exclude_subnets: Vec::new(),
        priority: 0,
        age: Age {
            created: 100,
            uid: format!("{ns}/{name}"),
        },
        previous_eips: Vec::new(),
        previous_node: None,
    }
}

fn with(mut p: Policy, f: impl FnOnce(&mut Policy)) -> Policy {
    f(&mut p);
    p
}

fn status<'a>(plan: &'a Plan, id: &PolicyRef) -> &'a PolicyStatus {
    plan.status
        .policies
        .iter()
        .find(|s| &s.policy == id)
        .unwrap_or_else(|| panic!("no status for {id}"))
}

fn condition(plan: &Plan, id: &PolicyRef, t: ConditionType) -> (bool, Reason, String) {
    let c = status(plan, id)
        .conditions
        .iter()
        .find(|c| c.type_ == t)
        .expect("condition present");
    (c.status, c.reason, c.message.clone())
}

/// Asserts that condition `t` of `id` is false with `reason` and a
/// message that contains every one of `words`.
fn refused(plan: &Plan, id: &PolicyRef, t: ConditionType, reason: Reason, words: &[&str]) {
    let (ok, got, message) = condition(plan, id, t);
    assert_eq!((ok, got), (false, reason), "{message}");
    for word in words {
        assert!(message.contains(word), "{word:?} not in {message:?}");
    }
}

fn entries<'a>(plan: &'a Plan, node: &str, src: &str) -> Vec<&'a ClassifyEntry> {
    plan.nodes[node]
        .classify
        .iter()
        .filter(|e| e.src == ip(src))
        .collect()
}

/// Where traffic from `src` to `dst` goes, by longest-prefix match over the
/// node's entries after the in-cluster check, as a dataplane would do it.
fn route(plan: &Plan, node: &str, src: &str, dst: &str) -> Action {
    let state = &plan.nodes[node];
    let dst = ip(dst);
    if state.cluster_cidrs.iter().any(|c| c.contains(&dst)) {
        return Action::Bypass;
    }
    entries(plan, node, src)
        .into_iter()
        .filter(|e| e.dst.contains(&dst))
        .max_by_key(|e| e.dst.prefix_len())
        .map_or(Action::Bypass, |e| e.action.clone())
}

fn gateway_of(action: &Action) -> Option<&str> {
    match action {
        Action::Tunnel { gateway, .. } => Some(gateway),
        _ => None,
    }
}

#[test]
fn a_selected_pod_is_marked_for_its_gateway_node_which_snats_to_the_eip() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(policy("a", "p", "web"));
    let plan = c.plan();
    let st = status(&plan, &PolicyRef::namespaced("a", "p"));
    let gw_node = st.node.clone().expect("placed");
    assert_eq!(st.eip_ipv4, Some("198.51.100.10".parse().unwrap()));
    let mark = plan
        .status
        .tunnels
        .iter()
        .find(|t| t.node == gw_node)
        .unwrap()
        .mark
        .unwrap();
    assert_eq!(
        route(&plan, "n1", "10.244.1.5", "203.0.113.9"),
        Action::Tunnel {
            gateway: gw_node.clone(),
            mark
        }
    );
    let snat = &plan.nodes[&gw_node].snat;
    assert_eq!(snat.len(), 1);
    assert_eq!(
        (snat[0].src, snat[0].to),
        (ip("10.244.1.5"), SnatTo::Eip(ip("198.51.100.10")))
    );
    assert_eq!(
        plan.nodes[&gw_node]
            .eips
            .iter()
            .map(|e| e.ip)
            .collect::<Vec<_>>(),
        vec![ip("198.51.100.10")]
    );
    assert!(
        plan.nodes["n1"]
            .rules
            .iter()
            .any(|r| r.mark == mark && r.mask == 0xff00_0000)
    );
    assert!(
        condition(
            &plan,
            &PolicyRef::namespaced("a", "p"),
            ConditionType::Ready
        )
        .0
    );
}

#[test]
fn a_pod_on_the_gateway_node_is_snatted_there_without_the_tunnel() {
    let c = Cluster::new()
        .pod("a", "web-0", "g1", "10.244.2.5", "web")
        .policy(policy("a", "p", "web"));
    let plan = c.plan();
    assert_eq!(
        status(&plan, &PolicyRef::namespaced("a", "p"))
            .node
            .as_deref(),
        Some("g1")
    );
    assert_eq!(
        route(&plan, "g1", "10.244.2.5", "203.0.113.9"),
        Action::Local
    );
    assert_eq!(plan.nodes["g1"].snat.len(), 1);
}

#[test]
fn an_unselected_pod_gets_no_entries() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("a", "db-0", "n1", "10.244.1.6", "db")
        .policy(policy("a", "p", "web"));
    let plan = c.plan();
    assert!(entries(&plan, "n1", "10.244.1.6").is_empty());
    assert!(
        plan.nodes
            .values()
            .flat_map(|n| n.snat.iter())
            .all(|e| e.src != ip("10.244.1.6"))
    );
}

#[test]
fn in_cluster_destinations_are_never_sent_to_a_gateway() {
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(policy("a", "p", "web"));
    c.0.config.extra_cluster_cidrs = vec![net("192.168.0.0/16")];
    let plan = c.plan();
    for dst in [
        "10.244.3.7",
        "172.18.0.12",
        "10.96.0.1",
        "172.31.0.2",
        "192.168.1.1",
    ] {
        assert_eq!(
            route(&plan, "n1", "10.244.1.5", dst),
            Action::Bypass,
            "{dst} is in the cluster"
        );
    }
    assert!(
        gateway_of(&route(&plan, "n1", "10.244.1.5", "172.18.0.99")).is_some(),
        "not a node address"
    );
}

#[test]
fn a_destination_subnet_inside_the_cluster_produces_no_entry() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(with(policy("a", "p", "web"), |p| {
            p.dest_subnets = vec![net("10.96.0.0/16")];
        }));
    assert!(entries(&c.plan(), "n1", "10.244.1.5").is_empty());
}

#[test]
fn an_excluded_subnet_leaves_the_normal_way() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(with(policy("a", "p", "web"), |p| {
            p.dest_subnets = vec![net("203.0.113.0/24")];
            p.exclude_subnets = vec![net("203.0.113.128/25")];
        }));
    let plan = c.plan();
    assert!(gateway_of(&route(&plan, "n1", "10.244.1.5", "203.0.113.1")).is_some());
    assert_eq!(
        route(&plan, "n1", "10.244.1.5", "203.0.113.200"),
        Action::Bypass
    );
    assert_eq!(route(&plan, "n1", "10.244.1.5", "8.8.8.8"), Action::Bypass);
}

#[test]
fn a_policy_in_one_namespace_never_affects_pods_in_another() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("b", "web-0", "n1", "10.244.1.6", "web")
        .policy(policy("a", "p", "web"));
    let plan = c.plan();
    assert!(!entries(&plan, "n1", "10.244.1.5").is_empty());
    assert!(entries(&plan, "n1", "10.244.1.6").is_empty());
    assert_eq!(status(&plan, &PolicyRef::namespaced("a", "p")).pods, 1);
}

#[test]
fn a_cluster_policy_applies_only_in_namespaces_its_selector_matches() {
    let cp = with(policy("x", "cp", "web"), |p| {
        p.id = PolicyRef::cluster("cp");
        p.namespace_selector = Some(LabelSelector::eq("team", "b"));
    });
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("b", "web-0", "n1", "10.244.1.6", "web")
        .policy(cp);
    let plan = c.plan();
    assert!(entries(&plan, "n1", "10.244.1.5").is_empty());
    assert!(!entries(&plan, "n1", "10.244.1.6").is_empty());
}

#[test]
fn a_cluster_policy_without_a_namespace_selector_applies_everywhere() {
    let cp = with(policy("x", "cp", "web"), |p| {
        p.id = PolicyRef::cluster("cp");
    });
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("b", "web-0", "n1", "10.244.1.6", "web")
        .policy(cp);
    assert_eq!(status(&c.plan(), &PolicyRef::cluster("cp")).pods, 2);
}

#[test]
fn a_pod_subnet_policy_selects_pods_by_address() {
    let c = Cluster::new()
        .pod("a", "x", "n1", "10.244.1.5", "any")
        .pod("a", "y", "n1", "10.244.1.200", "any")
        .policy(with(policy("a", "p", "-"), |p| {
            p.pods = PodMatch::Subnets(vec![net("10.244.1.0/25")]);
        }));
    let plan = c.plan();
    assert!(!entries(&plan, "n1", "10.244.1.5").is_empty());
    assert!(entries(&plan, "n1", "10.244.1.200").is_empty());
}

#[test]
fn the_most_specific_destination_wins_then_priority_then_age() {
    let c = two_gateways().pod("a", "web-0", "n1", "10.244.1.5", "web");
    let wide = with(policy("a", "wide", "web"), |p| {
        p.dest_subnets = vec![net("203.0.0.0/8")];
        p.priority = 100;
    });
    let narrow = with(policy("a", "narrow", "web"), |p| {
        p.gateway = Some("gw2".into());
        p.dest_subnets = vec![net("203.0.113.0/24")];
    });
    let plan = c.policy(wide).policy(narrow).plan();
    assert_eq!(
        gateway_of(&route(&plan, "n1", "10.244.1.5", "203.0.113.1")),
        Some("g2"),
        "narrower prefix wins"
    );
    assert_eq!(
        gateway_of(&route(&plan, "n1", "10.244.1.5", "203.1.0.1")),
        Some("g1")
    );
}

#[test]
fn on_equal_destinations_the_higher_priority_wins_and_then_the_older_policy() {
    let c = two_gateways().pod("a", "web-0", "n1", "10.244.1.5", "web");
    let dst = vec![net("203.0.113.0/24")];
    let older = with(policy("a", "older", "web"), |p| {
        p.dest_subnets.clone_from(&dst);
        p.age.created = 1;
    });
    let newer = with(policy("a", "newer", "web"), |p| {
        p.gateway = Some("gw2".into());
        p.dest_subnets.clone_from(&dst);
        p.age.created = 2;
    });
    let plan = c.policy(older.clone()).policy(newer.clone()).plan();
    assert_eq!(
        gateway_of(&route(&plan, "n1", "10.244.1.5", "203.0.113.1")),
        Some("g1"),
        "older wins a tie"
    );

    let c = two_gateways().pod("a", "web-0", "n1", "10.244.1.5", "web");
    let plan = c
        .policy(older)
        .policy(with(newer, |p| p.priority = 1))
        .plan();
    assert_eq!(
        gateway_of(&route(&plan, "n1", "10.244.1.5", "203.0.113.1")),
        Some("g2"),
        "higher priority wins"
    );
}

/// The standard cluster with gateway `gw` pinned to node g1 and a second
/// gateway `gw2` on node g2.
fn two_gateways() -> Cluster {
    let mut c = Cluster::new();
    for node in &mut c.0.nodes {
        node.labels
            .insert("kubernetes.io/hostname".into(), node.name.clone());
    }
    c.0.gateways[0].node_selector = LabelSelector::eq("kubernetes.io/hostname", "g1");
    c.0.gateways.push(with_selector(
        gateway("gw2", "198.51.100.20-198.51.100.21", false, 2),
        "g2",
    ));
    c
}

fn with_selector(mut g: Gateway, hostname: &str) -> Gateway {
    g.node_selector = LabelSelector::eq("kubernetes.io/hostname", hostname);
    g
}

#[test]
fn default_allocation_shares_the_gateways_default_eip() {
    let mut c = Cluster::new()
        .policy(policy("a", "p1", "web"))
        .policy(policy("b", "p2", "web"));
    c.0.gateways[0].ipv4_default = Some("198.51.100.12".parse().unwrap());
    let plan = c.plan();
    for id in [
        PolicyRef::namespaced("a", "p1"),
        PolicyRef::namespaced("b", "p2"),
    ] {
        assert_eq!(
            status(&plan, &id).eip_ipv4,
            Some("198.51.100.12".parse().unwrap())
        );
    }
    let usage = plan.status.gateways[0].ip_usage;
    assert_eq!((usage.ipv4_total, usage.ipv4_free), (4, 3));
}

#[test]
fn rr_gives_each_policy_its_own_eip_and_reports_exhaustion_without_disturbing_others() {
    let rr = |name: &str, created: i64| {
        with(policy("a", name, "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
            p.age.created = created;
        })
    };
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(rr("r1", 1))
        .policy(rr("r2", 2))
        .policy(rr("r3", 3))
        .policy(rr("r4", 4))
        .policy(with(policy("a", "d", "db"), |p| p.age.created = 5));
    let plan = c.plan();
    let eips: Vec<_> = ["r1", "r2", "r3"]
        .iter()
        .map(|n| {
            status(&plan, &PolicyRef::namespaced("a", *n))
                .eip_ipv4
                .unwrap()
        })
        .collect();
    assert_eq!(
        eips,
        vec![
            "198.51.100.11".parse::<Ipv4Addr>().unwrap(),
            "198.51.100.12".parse().unwrap(),
            "198.51.100.13".parse().unwrap()
        ]
    );
    let (ok, reason, message) = condition(
        &plan,
        &PolicyRef::namespaced("a", "r4"),
        ConditionType::Allocated,
    );
    assert_eq!((ok, reason), (false, Reason::PoolExhausted));
    assert!(
        message.contains("spec.egressIP.allocatorPolicy"),
        "{message}"
    );
    assert_eq!(
        status(&plan, &PolicyRef::namespaced("a", "d")).eip_ipv4,
        Some("198.51.100.10".parse().unwrap())
    );
    assert!(
        condition(
            &plan,
            &PolicyRef::namespaced("a", "r1"),
            ConditionType::Ready
        )
        .0
    );
}

#[test]
fn a_pinned_eip_outside_the_pool_is_reported_on_the_policy() {
    let c = Cluster::new().policy(with(policy("a", "p", "web"), |p| {
        p.egress_ip.ipv4 = Some("192.0.2.1".parse().unwrap());
    }));
    let (ok, reason, message) = condition(
        &c.plan(),
        &PolicyRef::namespaced("a", "p"),
        ConditionType::Allocated,
    );
    assert_eq!((ok, reason), (false, Reason::EipNotInPool));
    assert!(
        message.starts_with("spec.egressIP.ipv4: 192.0.2.1 is not in"),
        "{message}"
    );
}

#[test]
fn a_pinned_eip_is_used_as_given() {
    let c = Cluster::new().policy(with(policy("a", "p", "web"), |p| {
        p.egress_ip.ipv4 = Some("198.51.100.13".parse().unwrap());
    }));
    assert_eq!(
        status(&c.plan(), &PolicyRef::namespaced("a", "p")).eip_ipv4,
        Some("198.51.100.13".parse().unwrap())
    );
}

#[test]
fn an_unknown_gateway_or_a_missing_default_is_a_condition_not_an_error() {
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(with(policy("a", "lost", "web"), |p| {
            p.gateway = Some("nope".into());
        }));
    let plan = c.plan();
    assert_eq!(
        condition(
            &plan,
            &PolicyRef::namespaced("a", "lost"),
            ConditionType::Ready
        )
        .1,
        Reason::GatewayNotFound
    );
    assert!(entries(&plan, "n1", "10.244.1.5").is_empty());
    c.0.gateways[0].cluster_default = false;
    c.0.policy_mut(0).unwrap().gateway = None;
    assert_eq!(
        condition(
            &c.plan(),
            &PolicyRef::namespaced("a", "lost"),
            ConditionType::Ready
        )
        .1,
        Reason::NoDefaultGateway
    );
}

#[test]
fn a_gateway_without_ready_nodes_fails_its_policies_only() {
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("a", "db-0", "n1", "10.244.1.6", "db")
        .policy(policy("a", "web", "web"))
        .policy(with(policy("a", "db", "db"), |p| {
            p.gateway = Some("lonely".into());
        }));
    c.0.gateways.push(with_selector(
        gateway("lonely", "198.51.100.30", false, 2),
        "nowhere",
    ));
    let plan = c.plan();
    refused(
        &plan,
        &PolicyRef::namespaced("a", "db"),
        ConditionType::Ready,
        Reason::NoReadyNode,
        &["spec.nodeSelector of EgressGateway lonely matches no node"],
    );
    assert!(entries(&plan, "n1", "10.244.1.6").is_empty());
    assert!(gateway_of(&route(&plan, "n1", "10.244.1.5", "203.0.113.1")).is_some());
    let lonely = plan
        .status
        .gateways
        .iter()
        .find(|g| g.gateway == "lonely")
        .unwrap();
    assert_eq!(lonely.conditions[0].reason, Reason::NoReadyNode);
}

#[test]
fn eips_spread_over_the_least_loaded_nodes() {
    let rr = |name: &str| {
        with(policy("a", name, "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
        })
    };
    let plan = Cluster::new().policy(rr("r1")).policy(rr("r2")).plan();
    let nodes: HashSet<String> = plan.status.eip_nodes.values().cloned().collect();
    assert_eq!(nodes, ["g1".to_owned(), "g2".to_owned()].into());
}

#[test]
fn a_recompute_moves_an_eip_only_where_the_data_plane_took_it_or_off_a_node_no_longer_selected() {
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(policy("a", "p", "web"));
    let first = c.plan();
    let node = first.status.eip_nodes[&ip("198.51.100.10")].clone();
    remember(&mut c.0, &first.status);
    // A new, emptier gateway node appears: nothing moves.
    c.0.nodes.push(Node {
        name: "g0".into(),
        labels: labels(&[("egress", "true")]),
        addresses: vec![ip("172.18.0.10")],
        external_addresses: Vec::new(),
        pod_cidrs: vec![net("10.244.0.0/24")],
        ready: true,
        held_eips: Vec::new(),
    });
    let second = c.plan();
    assert_eq!(second.status.eip_nodes[&ip("198.51.100.10")], node);
    assert_eq!(
        second.status.tunnels.iter().find(|t| t.node == node),
        first.status.tunnels.iter().find(|t| t.node == node)
    );
    // The API server calls its node unready: the data plane decides
    // whether it is alive, so the EIP stays, and the node is its
    // candidate still (ready standbys first).
    remember(&mut c.0, &second.status);
    c.0.nodes.iter_mut().find(|n| n.name == node).unwrap().ready = false;
    let third = c.plan();
    assert_eq!(third.status.eip_nodes[&ip("198.51.100.10")], node);
    assert_eq!(third.nodes[&node].eips.len(), 1);
    // Another candidate's agent reports holding it (it took it over): the
    // plan follows, and the pod's node re-routes.
    let other = third.nodes[&node].groups[0].candidates[1].node.clone();
    assert_ne!(other, node);
    c.0.nodes
        .iter_mut()
        .find(|n| n.name == other)
        .unwrap()
        .held_eips = vec![ip("198.51.100.10")];
    let fourth = c.plan();
    assert_eq!(fourth.status.eip_nodes[&ip("198.51.100.10")], other);
    assert_eq!(
        gateway_of(&route(&fourth, "n1", "10.244.1.5", "203.0.113.1")),
        Some(other.as_str())
    );
    assert!(fourth.nodes[&node].eips.is_empty());
    // The holder is no longer selected: the EIP leaves it.
    remember(&mut c.0, &fourth.status);
    let holder = c.0.nodes.iter_mut().find(|n| n.name == other).unwrap();
    holder.labels.clear();
    holder.held_eips.clear();
    let fifth = c.plan();
    assert_ne!(fifth.status.eip_nodes[&ip("198.51.100.10")], other);
}

#[test]
fn tunnel_identities_are_unique_and_only_gateway_capable_nodes_get_a_mark() {
    let plan = Cluster::new().plan();
    let t: HashMap<&str, _> = plan
        .status
        .tunnels
        .iter()
        .map(|t| (t.node.as_str(), t))
        .collect();
    assert_eq!(t["n1"].mark, None);
    assert!(t["g1"].mark.is_some() && t["g2"].mark.is_some() && t["g1"].mark != t["g2"].mark);
    let ips: HashSet<_> = t.values().map(|t| t.ipv4.unwrap()).collect();
    let macs: HashSet<_> = t.values().map(|t| t.mac).collect();
    assert_eq!((ips.len(), macs.len()), (3, 3));
    assert!(
        t.values().all(|t| t.mac.0[0] & 0x03 == 0x02),
        "locally administered unicast"
    );
    assert_eq!(plan.nodes["n1"].routes.len(), 2);
    assert_eq!(
        plan.nodes["g1"]
            .routes
            .iter()
            .map(|r| r.gateway.as_str())
            .collect::<Vec<_>>(),
        vec!["g2"]
    );
}

#[test]
fn use_node_ip_masquerades_on_the_gateway_node_and_owns_no_eip() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(with(policy("a", "p", "web"), |p| {
            p.egress_ip.use_node_ip = true;
        }));
    let plan = c.plan();
    let st = status(&plan, &PolicyRef::namespaced("a", "p"));
    assert!(st.use_node_ip && st.eip_ipv4.is_none());
    let node = st.node.clone().unwrap();
    assert_eq!(plan.nodes[&node].snat[0].to, SnatTo::NodeIp);
    assert!(plan.nodes.values().all(|n| n.eips.is_empty()));
}

#[test]
fn an_invalid_policy_gets_an_invalid_status_and_disturbs_nothing() {
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(policy("a", "p", "web"));
    let before = c.plan();
    c.0.invalid.push(InvalidObject {
        kind: "EgressPolicy".into(),
        namespace: Some("a".into()),
        name: "broken".into(),
        errors: vec!["spec.destSubnet[0]: \"10.0.0.0/33\" is not a CIDR".into()],
    });
    let after = c.plan();
    assert_eq!(before.nodes, after.nodes);
    let (ok, reason, message) = condition(
        &after,
        &PolicyRef::namespaced("a", "broken"),
        ConditionType::Ready,
    );
    assert_eq!((ok, reason), (false, Reason::Invalid));
    assert!(message.starts_with("spec.destSubnet[0]"));
}

#[test]
fn host_network_and_unscheduled_pods_are_ignored() {
    let mut c = Cluster::new()
        .pod("a", "host", "n1", "172.18.0.11", "web")
        .pod("a", "pending", "n1", "10.244.1.9", "web");
    c.0.pods[0].host_network = true;
    c.0.pods[1].node = None;
    let plan = c.policy(policy("a", "p", "web")).plan();
    assert!(plan.nodes.values().all(|n| n.classify.is_empty()));
    assert_eq!(status(&plan, &PolicyRef::namespaced("a", "p")).pods, 0);
}

#[test]
fn a_gateway_whose_pool_overlaps_an_older_one_is_not_used() {
    let mut c = Cluster::new().policy(with(policy("a", "p", "web"), |p| {
        p.gateway = Some("young".into());
    }));
    c.0.gateways
        .push(gateway("young", "198.51.100.13-198.51.100.15", false, 9));
    let plan = c.plan();
    let young = plan
        .status
        .gateways
        .iter()
        .find(|g| g.gateway == "young")
        .unwrap();
    assert_eq!(young.conditions[0].reason, Reason::PoolOverlap);
    assert!(young.conditions[0].message.contains("older gateway gw"));
    assert_eq!(
        condition(
            &plan,
            &PolicyRef::namespaced("a", "p"),
            ConditionType::Allocated
        )
        .1,
        Reason::GatewayInvalid
    );
}

#[test]
fn of_two_cluster_default_gateways_the_older_is_the_default() {
    let mut c = Cluster::new().policy(policy("a", "p", "web"));
    c.0.gateways
        .push(gateway("newer", "198.51.100.40", true, 9));
    let plan = c.plan();
    assert_eq!(
        status(&plan, &PolicyRef::namespaced("a", "p")).eip_ipv4,
        Some("198.51.100.10".parse().unwrap())
    );
    let newer = plan
        .status
        .gateways
        .iter()
        .find(|g| g.gateway == "newer")
        .unwrap();
    assert!(
        newer.conditions[0]
            .message
            .contains("clusterDefault is ignored: gw is the older")
    );
}

#[test]
fn ipv6_pods_get_ipv6_eips_when_ipv6_is_enabled() {
    let mut c = Cluster::new().policy(policy("a", "p", "web"));
    c.0.config.enable_ipv6 = true;
    c.0.gateways[0].ipv6_pool = IpPool::new(vec!["2001:db8::10-2001:db8::11".parse().unwrap()]);
    c.0.pods.push(Pod {
        namespace: "a".into(),
        name: "web-0".into(),
        labels: labels(&[("app", "web")]),
        ips: vec![ip("10.244.1.5"), ip("fd00:244:1::5")],
        node: Some("n1".into()),
        host_network: false,
    });
    let plan = c.plan();
    let st = status(&plan, &PolicyRef::namespaced("a", "p"));
    assert_eq!(
        (st.eip_ipv4.is_some(), st.eip_ipv6.map(|v| v.to_string())),
        (true, Some("2001:db8::10".into()))
    );
    assert!(gateway_of(&route(&plan, "n1", "fd00:244:1::5", "2001:db8:ffff::1")).is_some());
    let t = &plan.status.tunnels[0];
    assert!(t.ipv6.is_some());
    let owner = plan.status.eip_nodes[&ip("2001:db8::10")].clone();
    assert_eq!(
        owner,
        plan.status.eip_nodes[&ip("198.51.100.10")],
        "both families of a policy share its node"
    );
}

#[test]
fn a_node_needs_its_gateways_pods_once_any_gateway_selects_it_valid_or_not() {
    let mut c = Cluster::new();
    assert_eq!(pod_scope(&c.0, "n1"), PodScope::Node);
    assert_eq!(pod_scope(&c.0, "g1"), PodScope::Gateways);
    assert_eq!(pod_scope(&c.0, "unknown"), PodScope::Node);
    // An invalid gateway selecting n1 may become valid: the pods must be there.
    let mut broken = gateway("broken", "198.51.100.20", false, 2);
    broken.node_selector = LabelSelector::eq("egress", "false");
    broken.errors.push("ippools: overlapping".into());
    c.0.gateways.push(broken);
    assert_eq!(pod_scope(&c.0, "n1"), PodScope::Gateways);
    assert_eq!(gateways_selecting(&c.0, "n1"), vec!["broken"]);

    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("a", "web-1", "g1", "10.244.2.5", "web")
        .pod("a", "db-0", "n1", "10.244.1.6", "db")
        .policy(policy("a", "p", "web"));
    let published = plan_published(&c.0);
    let only_n1 = scoped(&c.0, "n1", PodScope::Node, &published.gateway_pods);
    assert_eq!(only_n1.pods.len(), 2);
    assert!(only_n1.pods.iter().all(|p| p.node.as_deref() == Some("n1")));
    assert_eq!(
        scoped(&c.0, "n1", PodScope::Cluster, &published.gateway_pods)
            .pods
            .len(),
        3
    );
    // No policy selects db-0: the gateway node has no need of it.
    let mut names: Vec<String> = scoped(&c.0, "g1", PodScope::Gateways, &published.gateway_pods)
        .pods
        .into_iter()
        .map(|p| p.name)
        .collect();
    names.sort();
    assert_eq!(names, vec!["web-0", "web-1"]);
}

/// A pod that shares its address with a pod of another gateway is
/// published for both gateways: the first of them claims the address.
#[test]
fn pods_sharing_an_address_are_published_for_each_others_gateways() {
    let mut c = Cluster::new()
        .pod("a", "old", "n1", "10.244.1.5", "db")
        .pod("a", "web", "n1", "10.244.1.5", "web")
        .pod("a", "lone", "n1", "10.244.1.7", "db");
    let mut other = gateway("other", "198.51.100.30", false, 3);
    other.node_selector = LabelSelector::eq("egress", "false");
    c.0.gateways.push(other);
    let mut db = policy("a", "db", "db");
    db.gateway = Some("other".into());
    c = c.policy(policy("a", "web", "web")).policy(db);
    let published = plan_published(&c.0);
    let names = |g: &str| -> Vec<&str> {
        published.gateway_pods[g]
            .iter()
            .map(|p| p.name.as_str())
            .collect()
    };
    assert_eq!(names("other"), vec!["lone", "old", "web"]);
    assert_eq!(names("gw"), vec!["old", "web"]);
    assert_eq!(published.status, plan_status(&c.0));
}

// ---- properties over generated clusters ----

fn arb_snapshot() -> impl Strategy<Value = Snapshot> {
    let node = (any::<bool>(), any::<bool>());
    let pod = (0usize..2, 0usize..4, 0usize..3);
    let pol = (0usize..2, 0usize..3, 0u8..4, 0i32..2, 0u8..5, any::<bool>());
    (
        prop::collection::vec(node, 1..6),
        prop::collection::vec(pod, 0..12),
        prop::collection::vec(pol, 0..8),
        0u8..3,
    )
        .prop_map(|(nodes, pods, policies, gateways)| {
            build_snapshot(&nodes, &pods, &policies, gateways)
        })
}

fn build_snapshot(
    nodes: &[(bool, bool)],
    pods: &[(usize, usize, usize)],
    policies: &[(usize, usize, u8, i32, u8, bool)],
    gateways: u8,
) -> Snapshot {
    let mut s = Snapshot::default();
    for (i, (gw, ready)) in nodes.iter().enumerate() {
        s.nodes.push(Node {
            name: format!("node-{i}"),
            labels: labels(&[("egress", if *gw { "true" } else { "false" })]),
            addresses: vec![IpAddr::from([172, 18, 0, 10 + i as u8])],
            external_addresses: Vec::new(),
            pod_cidrs: vec![IpNet::new(IpAddr::from([10, 244, i as u8, 0]), 24).unwrap()],
            ready: *ready,
            held_eips: Vec::new(),
        });
    }
    for ns in ["a", "b"] {
        s.namespaces.push(Namespace {
            name: ns.into(),
            labels: labels(&[("team", ns)]),
        });
    }
    for (i, (ns, app, node)) in pods.iter().enumerate() {
        let node = node % nodes.len();
        s.pods.push(Pod {
            namespace: ["a", "b"][*ns].into(),
            name: format!("pod-{i}"),
            labels: labels(&[("app", &format!("app{app}"))]),
            ips: vec![IpAddr::from([10, 244, node as u8, 10 + i as u8])],
            node: Some(format!("node-{node}")),
            host_network: false,
        });
    }
    for g in 0..gateways {
        s.gateways.push(gateway(
            &format!("gw{g}"),
            &format!("198.51.{g}.1-198.51.{g}.3"),
            g == 0,
            i64::from(g),
        ));
    }
    let dests = [
        vec![],
        vec![net("203.0.113.0/24")],
        vec![net("203.0.0.0/8"), net("198.18.0.0/15")],
        vec![net("203.0.113.128/25")],
    ];
    for (i, (ns, app, dest, prio, alloc, cluster)) in policies.iter().enumerate() {
        let mut p = policy(["a", "b"][*ns], &format!("p{i}"), &format!("app{app}"));
        if *cluster {
            p.id = PolicyRef::cluster(format!("c{i}"));
        }
        p.dest_subnets = dests[*dest as usize].clone();
        p.priority = *prio;
        p.age.created = (i % 3) as i64;
        allocate_as(&mut p, *alloc, i);
        s.policies.push(Arc::new(p));
    }
    s
}

/// Gives `p` (the `i`th policy) the `alloc`th way to get its EIP: the
/// default gateway's shared one, an `rr` one, a named gateway's shared
/// one, a pinned one (an address two policies of a gateway may pin), or
/// the node's address.
fn allocate_as(p: &mut Policy, alloc: u8, i: usize) {
    p.egress_ip = EgressIpSpec::default();
    match alloc {
        0 => {}
        1 => p.egress_ip.allocator = Allocator::RoundRobin,
        2 => p.gateway = Some(format!("gw{}", i % 3)),
        3 => {
            let g = i % 2;
            p.gateway = Some(format!("gw{g}"));
            p.egress_ip.ipv4 = Some(Ipv4Addr::new(198, 51, g as u8, 3));
        }
        _ => p.egress_ip.use_node_ip = true,
    }
}

fn shuffled(s: &Snapshot, seed: u64) -> Snapshot {
    fn shuffle<T>(v: &mut [T], seed: &mut u64) {
        for i in (1..v.len()).rev() {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            v.swap(i, (*seed % (i as u64 + 1)) as usize);
        }
    }
    let mut seed = seed | 1;
    let mut s = s.clone();
    shuffle(&mut s.nodes, &mut seed);
    shuffle(&mut s.pods, &mut seed);
    shuffle(&mut s.policies, &mut seed);
    shuffle(&mut s.gateways, &mut seed);
    shuffle(&mut s.namespaces, &mut seed);
    s
}

/// Every node's state planned from the Pods its agent holds (its scope,
/// with the gateways' Pods as the controller publishes them) is its part of
/// the whole plan, and the published status is the whole plan's.
fn scoped_plans_are_the_whole_plans(s: &Snapshot) -> Result<(), TestCaseError> {
    let whole = plan(s);
    let published = plan_published(s);
    prop_assert_eq!(&published.status, &whole.status);
    for (node, state) in &whole.nodes {
        let scope = pod_scope(s, node);
        let one = plan_node(&scoped(s, node, scope, &published.gateway_pods), node);
        prop_assert_eq!(
            one.nodes.get(node),
            Some(state),
            "{} with scope {:?}",
            node,
            scope
        );
    }
    Ok(())
}

proptest! {
    #[test]
    fn planning_does_not_depend_on_the_order_of_the_input(s in arb_snapshot(), seed in any::<u64>()) {
        prop_assert_eq!(plan(&s), plan(&shuffled(&s, seed)));
    }

    #[test]
    fn the_status_alone_and_one_nodes_state_are_what_the_whole_plan_says(s in arb_snapshot()) {
        let whole = plan(&s);
        prop_assert_eq!(&plan_status(&s), &whole.status);
        for (node, state) in &whole.nodes {
            let one = plan_node(&s, node);
            prop_assert_eq!(one.nodes.get(node), Some(state));
            prop_assert_eq!(one.nodes.len(), 1);
        }
    }

    #[test]
    fn a_nodes_state_from_its_scoped_pods_is_the_whole_plans(s in arb_snapshot()) {
        scoped_plans_are_the_whole_plans(&s)?;
    }

    /// Gateways selecting nodes of their own, and pods sharing addresses:
    /// every node's state from its own pods and its
    /// gateways' published ones is its part of the whole plan.
    #[test]
    fn a_gateway_nodes_state_from_its_gateways_pods_is_the_whole_plans(
        s in arb_snapshot(),
        selects in prop::collection::vec(0u8..8, 6),
        shares in prop::collection::vec((0usize..12, 0usize..12), 0..4),
    ) {
        let mut s = s;
        // Gateway g selects the nodes whose entry in `selects` has bit g.
        for (i, node) in s.nodes.iter_mut().enumerate() {
            for g in 0..3 {
                if selects[i] & (1 << g) != 0 {
                    node.labels.insert(format!("gw{g}"), "yes".into());
                }
            }
        }
        for (g, gateway) in s.gateways.iter_mut().enumerate() {
            gateway.node_selector = LabelSelector::eq(&format!("gw{g}"), "yes");
        }
        // A stale Pod and the one its address went to, on one node (pod
        // addresses come from the node's range).
        let n = s.pods.len();
        for (from, to) in shares {
            if n > 0 {
                let (ips, node) = (s.pods[from % n].ips.clone(), s.pods[from % n].node.clone());
                s.pods[to % n].ips = ips;
                s.pods[to % n].node = node;
            }
        }
        scoped_plans_are_the_whole_plans(&s)?;
    }

    #[test]
    fn an_agent_following_the_published_placement_plans_what_the_controller_published(
        s in arb_snapshot()
    ) {
        // Nothing published yet: an agent holds no EIP.
        for node in s.nodes.iter().map(|n| n.name.as_str()) {
            let own = plan_node_published(&s, node);
            prop_assert!(own.is_none_or(|n| n.eips.is_empty()), "{} holds an EIP", node);
        }
        // Once the controller's status is written, the agent's plan of
        // every node is the controller's.
        let mut published = s.clone();
        remember(&mut published, &plan(&s).status);
        let whole = plan(&published);
        let pods = plan_published(&published).gateway_pods;
        for (node, state) in &whole.nodes {
            let one = plan_node_published(&published, node);
            prop_assert_eq!(one.as_ref(), Some(state));
            // And from the Pods the agent watches.
            let scope = pod_scope(&published, node);
            let agent = plan_node_published(&scoped(&published, node, scope, &pods), node);
            prop_assert_eq!(agent.as_ref(), Some(state));
        }
    }

    #[test]
    fn no_eip_is_active_on_two_nodes(s in arb_snapshot()) {
        let p = plan(&s);
        let mut owner: HashMap<IpAddr, &str> = HashMap::new();
        for (node, state) in &p.nodes {
            for eip in &state.eips {
                if let Some(other) = owner.insert(eip.ip, node) {
                    prop_assert!(false, "{} on {} and {}", eip.ip, other, node);
                }
            }
        }
    }

    #[test]
    fn every_eip_comes_from_its_gateways_pool(s in arb_snapshot()) {
        let p = plan(&s);
        let pools: HashMap<&str, &Gateway> = s.gateways.iter().map(|g| (g.name.as_str(), g)).collect();
        for state in p.nodes.values() {
            for eip in &state.eips {
                prop_assert!(pools[eip.gateway.as_str()].ipv4_pool.contains(eip.ip));
            }
        }
    }

    #[test]
    fn no_pod_and_destination_resolve_to_two_gateways(s in arb_snapshot()) {
        let p = plan(&s);
        let mut seen: HashSet<(IpAddr, IpNet)> = HashSet::new();
        for state in p.nodes.values() {
            for e in &state.classify {
                prop_assert!(seen.insert((e.src, e.dst)), "{} -> {} twice", e.src, e.dst);
            }
        }
    }

    #[test]
    fn a_plan_fed_back_is_a_fixed_point(s in arb_snapshot()) {
        let first = plan(&s);
        let mut s2 = s.clone();
        remember(&mut s2, &first.status);
        prop_assert_eq!(plan(&s2), first);
    }

    #[test]
    fn rr_policies_of_one_gateway_never_share_an_eip(s in arb_snapshot()) {
        let p = plan(&s);
        let rr: HashSet<&PolicyRef> = s.policies.iter().filter(|p| p.egress_ip.allocator == Allocator::RoundRobin && p.gateway.is_none()).map(|p| &p.id).collect();
        let mut taken = HashSet::new();
        for st in p.status.policies.iter().filter(|st| rr.contains(&st.policy)) {
            if let Some(eip) = st.eip_ipv4 {
                prop_assert!(taken.insert(eip), "{} shared", eip);
            }
        }
    }
}

#[test]
fn an_invalid_gateway_is_reported_as_invalid_and_keeps_its_default_claim() {
    let mut c = Cluster::new().policy(policy("a", "p", "web"));
    c.0.gateways[0].errors =
        vec!["spec.ippools.ipv6[0]: range \"fd00::9-fd00::1\" is reversed".into()];
    c.0.gateways
        .push(gateway("younger", "198.51.100.40", true, 9));
    let plan = c.plan();
    refused(
        &plan,
        &PolicyRef::namespaced("a", "p"),
        ConditionType::Ready,
        Reason::GatewayInvalid,
        &["spec.ippools.ipv6[0]"],
    );
    let gw = plan
        .status
        .gateways
        .iter()
        .find(|g| g.gateway == "gw")
        .unwrap();
    assert_eq!(
        (gw.conditions[0].status, gw.conditions[0].reason),
        (false, Reason::Invalid)
    );
    assert!(
        plan.nodes.values().all(|n| n.eips.is_empty()),
        "the younger default does not take over"
    );
}

#[test]
fn a_policy_that_fails_for_a_while_gets_its_rr_eip_back() {
    let rr = |name: &str, created: i64| {
        with(policy("a", name, "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
            p.age.created = created;
        })
    };
    let mut c = Cluster::new()
        .policy(rr("r1", 1))
        .policy(rr("r2", 2))
        .policy(rr("r3", 3));
    let first = c.plan();
    let r2 = status(&first, &PolicyRef::namespaced("a", "r2")).eip_ipv4;
    // r1 goes away and r2's gateway breaks for a while: r3 must not take r2's EIP.
    c.0.policies.retain(|p| p.id.name != "r1");
    remember(&mut c.0, &first.status);
    c.0.gateways.push(with_selector(
        gateway("other", "198.51.100.50", false, 5),
        "g1",
    ));
    c.0.policies_mut()
        .find(|p| p.id.name == "r2")
        .unwrap()
        .gateway = Some("missing".into());
    let broken = c.plan();
    let st = status(&broken, &PolicyRef::namespaced("a", "r2"));
    assert_eq!(
        st.eip_ipv4, r2,
        "the EIP stays on record while the policy fails"
    );
    assert!(
        st.conditions[0].message.contains("stays reserved"),
        "{}",
        st.conditions[0].message
    );
    remember(&mut c.0, &broken.status);
    c.0.policies_mut()
        .find(|p| p.id.name == "r2")
        .unwrap()
        .gateway = None;
    let fixed = c.plan();
    assert_eq!(
        status(&fixed, &PolicyRef::namespaced("a", "r2")).eip_ipv4,
        r2
    );
    assert_ne!(
        status(&fixed, &PolicyRef::namespaced("a", "r3")).eip_ipv4,
        r2
    );
}

#[test]
fn an_rr_policy_that_cannot_get_every_family_frees_what_it_took() {
    let mut c = Cluster::new();
    c.0.config.enable_ipv6 = true;
    c.0.gateways[0].ipv4_pool = IpPool::new(vec!["10.0.0.1-10.0.0.2".parse().unwrap()]);
    c.0.gateways[0].ipv6_pool = IpPool::new(vec!["fd00::1-fd00::2".parse().unwrap()]);
    let older = with(policy("a", "older", "web"), |p| {
        p.egress_ip.allocator = Allocator::RoundRobin;
        p.age.created = 1;
    });
    let pinned = with(policy("a", "pinned", "web"), |p| {
        p.egress_ip.allocator = Allocator::RoundRobin;
        p.egress_ip.ipv4 = Some("10.0.0.2".parse().unwrap());
        p.age.created = 2;
    });
    let plan = c.policy(older).policy(pinned).plan();
    assert_eq!(
        condition(
            &plan,
            &PolicyRef::namespaced("a", "older"),
            ConditionType::Allocated
        )
        .1,
        Reason::PoolExhausted
    );
    let st = status(&plan, &PolicyRef::namespaced("a", "pinned"));
    assert_eq!(st.eip_ipv6.map(|v| v.to_string()), Some("fd00::2".into()));
}

#[test]
fn a_node_without_a_tunnel_address_of_a_family_is_not_its_gateway() {
    let mut c = Cluster::new().policy(policy("a", "p", "web"));
    c.0.config.enable_ipv6 = true;
    // Two usable IPv6 tunnel addresses for three nodes: n1 (last by name) gets none.
    c.0.config.tunnel_ipv6_subnet = "fd11::/126".parse().unwrap();
    c.0.gateways[0].ipv4_pool = IpPool::default();
    c.0.gateways[0].ipv6_pool = IpPool::new(vec!["2001:db8::10-2001:db8::11".parse().unwrap()]);
    c.0.gateways[0].node_selector = LabelSelector::eq("kubernetes.io/hostname", "n1");
    c.0.nodes[0]
        .labels
        .insert("kubernetes.io/hostname".into(), "n1".into());
    let plan = c.plan();
    refused(
        &plan,
        &PolicyRef::namespaced("a", "p"),
        ConditionType::Ready,
        Reason::NoReadyNode,
        &["n1: no tunnel IPv6 address left"],
    );
}

#[test]
fn pods_on_a_node_without_a_tunnel_are_not_steered_into_it() {
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .pod("a", "web-1", "g1", "10.244.2.5", "web")
        .policy(policy("a", "p", "web"));
    c.0.nodes[0].addresses.clear();
    let plan = c.plan();
    assert!(plan.nodes["n1"].vxlan.is_none());
    assert!(entries(&plan, "n1", "10.244.1.5").is_empty());
    assert!(
        plan.nodes
            .values()
            .flat_map(|n| n.snat.iter())
            .all(|e| e.src != ip("10.244.1.5"))
    );
}

#[test]
fn snat_entries_name_the_node_replies_go_back_to() {
    let c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(policy("a", "p", "web"));
    let plan = c.plan();
    let node = status(&plan, &PolicyRef::namespaced("a", "p"))
        .node
        .clone()
        .unwrap();
    assert_eq!(plan.nodes[&node].snat[0].origin.as_ref(), "n1");
}

#[test]
fn a_pod_subnet_policy_steers_only_the_addresses_in_its_subnets() {
    let mut c = Cluster::new().policy(with(policy("a", "p", "-"), |p| {
        p.pods = PodMatch::Subnets(vec![net("10.244.1.0/24")]);
    }));
    c.0.config.enable_ipv6 = true;
    c.0.gateways[0].ipv6_pool = IpPool::new(vec!["2001:db8::10".parse().unwrap()]);
    c.0.pods.push(Pod {
        namespace: "a".into(),
        name: "dual".into(),
        labels: Labels::new(),
        ips: vec![ip("10.244.1.5"), ip("fd00:244:1::5")],
        node: Some("n1".into()),
        host_network: false,
    });
    let plan = c.plan();
    assert!(!entries(&plan, "n1", "10.244.1.5").is_empty());
    assert!(entries(&plan, "n1", "fd00:244:1::5").is_empty());
}

#[test]
fn a_node_without_a_mark_says_so() {
    let mut c = Cluster::new().policy(policy("a", "p", "web"));
    c.0.config.mark_mask = 0x0300_0000; // one gateway mark: g1 takes it
    c.0.gateways[0].node_selector = LabelSelector::eq("kubernetes.io/hostname", "g2");
    c.0.nodes[2]
        .labels
        .insert("kubernetes.io/hostname".into(), "g2".into());
    c.0.gateways.push(with_selector(
        gateway("first", "198.51.100.60", false, 0),
        "g1",
    ));
    c.0.nodes[1]
        .labels
        .insert("kubernetes.io/hostname".into(), "g1".into());
    let plan = c.plan();
    let message = condition(
        &plan,
        &PolicyRef::namespaced("a", "p"),
        ConditionType::Ready,
    )
    .2;
    assert!(
        message.contains("g2: no mark left in the mark mask"),
        "{message}"
    );
}

#[test]
fn a_policy_may_pin_only_a_free_eip_or_its_own_namespaces_and_never_the_shared_default() {
    let rr = |ns: &str, name: &str| {
        with(policy(ns, name, "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
        })
    };
    let pin = |ns: &str, name: &str, ip: &str| {
        let ip: Ipv4Addr = ip.parse().unwrap();
        with(policy(ns, name, "web"), move |p| {
            p.egress_ip.ipv4 = Some(ip);
        })
    };
    let mut c = Cluster::new()
        .pod("a", "web-0", "n1", "10.244.1.5", "web")
        .policy(rr("a", "mine"));
    let first = c.plan();
    let mine = PolicyRef::namespaced("a", "mine");
    let taken = status(&first, &mine).eip_ipv4.unwrap().to_string();
    remember(&mut c.0, &first.status);
    let c = c
        .policy(pin("b", "thief", &taken))
        .policy(pin("b", "sharer", "198.51.100.10"))
        .policy(pin("a", "friend", "198.51.100.13"));
    let plan = c.plan();
    assert_eq!(
        status(&plan, &mine).eip_ipv4.map(|ip| ip.to_string()),
        Some(taken.clone()),
        "team a keeps its EIP"
    );
    refused(
        &plan,
        &PolicyRef::namespaced("b", "thief"),
        ConditionType::Ready,
        Reason::EipTaken,
        &["spec.egressIP.ipv4", "namespace a"],
    );
    refused(
        &plan,
        &PolicyRef::namespaced("b", "sharer"),
        ConditionType::Ready,
        Reason::EipTaken,
        &["default EIP"],
    );
    let (ok, _, message) = condition(
        &plan,
        &PolicyRef::namespaced("a", "friend"),
        ConditionType::Allocated,
    );
    assert!(ok, "{message}");
    // The refused pin steers nothing: the pod still goes to team a's EIP.
    assert_eq!(
        plan.nodes
            .values()
            .flat_map(|n| &n.eips)
            .filter(|e| e.ip.to_string() == taken)
            .count(),
        1
    );
}

#[test]
fn a_gateway_admits_only_the_namespaces_its_selector_matches() {
    let mut c = Cluster::new()
        .policy(policy("a", "web", "web"))
        .policy(policy("b", "web", "web"));
    c.0.gateways[0].namespace_selector = Some(LabelSelector {
        match_labels: labels(&[("team", "a")]),
        ..LabelSelector::default()
    });
    let plan = c.plan();
    let (ok, _, _) = condition(
        &plan,
        &PolicyRef::namespaced("a", "web"),
        ConditionType::Allocated,
    );
    assert!(ok);
    refused(
        &plan,
        &PolicyRef::namespaced("b", "web"),
        ConditionType::Ready,
        Reason::NamespaceNotAllowed,
        &["spec.egressGatewayName", "namespace b"],
    );
}

#[test]
fn an_eip_inside_the_clusters_own_prefixes_is_never_handed_out() {
    // The pool covers the three nodes' addresses (172.18.0.11-13) and one
    // free address.
    let mut c = Cluster::new()
        .policy(policy("a", "shared", "web"))
        .policy(with(policy("a", "own", "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
        }))
        .policy(with(policy("a", "pinned", "web"), |p| {
            p.egress_ip.ipv4 = Some("172.18.0.12".parse().unwrap());
        }));
    c.0.gateways[0] = gateway("gw", "172.18.0.11-172.18.0.14", true, 1);
    let plan = c.plan();
    refused(
        &plan,
        &PolicyRef::namespaced("a", "shared"),
        ConditionType::Allocated,
        Reason::EipInCluster,
        &["default EIP", "172.18.0.11"],
    );
    refused(
        &plan,
        &PolicyRef::namespaced("a", "pinned"),
        ConditionType::Allocated,
        Reason::EipInCluster,
        &["spec.egressIP.ipv4"],
    );
    assert_eq!(
        status(&plan, &PolicyRef::namespaced("a", "own")).eip_ipv4,
        Some("172.18.0.14".parse().unwrap()),
        "rr skips the nodes' addresses"
    );
    let gw = plan
        .status
        .gateways
        .iter()
        .find(|g| g.gateway == "gw")
        .unwrap();
    assert!(
        gw.conditions[0].message.contains("never handed out"),
        "{}",
        gw.conditions[0].message
    );
}

#[test]
fn a_nodes_external_ip_is_never_an_eip() {
    let mut c = Cluster::new()
        .policy(with(policy("a", "own", "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
        }))
        .policy(with(policy("a", "pinned", "web"), |p| {
            p.egress_ip.ipv4 = Some("203.0.113.11".parse().unwrap());
        }));
    c.0.gateways[0] = gateway("gw", "203.0.113.10-203.0.113.12", true, 1);
    c.0.nodes[1].external_addresses = vec![ip("203.0.113.11")];
    let plan = c.plan();
    refused(
        &plan,
        &PolicyRef::namespaced("a", "pinned"),
        ConditionType::Allocated,
        Reason::EipInCluster,
        &["spec.egressIP.ipv4", "203.0.113.11", "node g1's ExternalIP"],
    );
    let rr = status(&plan, &PolicyRef::namespaced("a", "own")).eip_ipv4;
    assert!(
        rr.is_some() && rr != Some("203.0.113.11".parse().unwrap()),
        "rr skips the ExternalIP: {rr:?}"
    );
    let gw = plan
        .status
        .gateways
        .iter()
        .find(|g| g.gateway == "gw")
        .unwrap();
    assert!(
        gw.conditions[0]
            .message
            .contains("203.0.113.11 is node g1's ExternalIP"),
        "{}",
        gw.conditions[0].message
    );
}

// ---- pod selection against a plain reading of the selectors ----

/// A cluster whose pods carry two labels and whose policies select by
/// every kind of selector: one label, two labels, expressions, an empty
/// selector, pod subnets, namespaced and cluster-wide.
fn arb_selection() -> impl Strategy<Value = Snapshot> {
    let pod = (0usize..3, 0usize..3, 0usize..2, 0usize..2, any::<bool>());
    let selector = (0u8..6, 0usize..3, 0usize..2);
    let pol = (0usize..4, selector, 0u8..3);
    (
        prop::collection::vec(pod, 0..24),
        prop::collection::vec(pol, 1..10),
    )
        .prop_map(|(pods, policies)| {
            let mut s = build_snapshot(&[(true, true), (false, true)], &[], &[], 1);
            s.namespaces.push(Namespace {
                name: "c".into(),
                labels: labels(&[("team", "b"), ("env", "prod")]),
            });
            for (i, (ns, app, version, node, host)) in pods.iter().enumerate() {
                s.pods.push(Pod {
                    namespace: ["a", "b", "c"][*ns].into(),
                    name: format!("pod-{i}"),
                    labels: labels(&[("app", &format!("app{app}")), ("v", ["1", "2"][*version])]),
                    ips: vec![IpAddr::from([10, 244, *node as u8, 10 + i as u8])],
                    node: Some(format!("node-{node}")),
                    host_network: *host && i % 4 == 0,
                });
            }
            for (i, (scope, (kind, app, version), ns_kind)) in policies.iter().enumerate() {
                let app = format!("app{app}");
                let version = ["1", "2"][*version];
                let pods = match kind {
                    0 => PodMatch::Selector(LabelSelector::eq("app", &app)),
                    1 => PodMatch::Selector(LabelSelector {
                        match_labels: labels(&[("app", &app), ("v", version)]),
                        ..LabelSelector::default()
                    }),
                    2 => PodMatch::Selector(LabelSelector {
                        match_labels: labels(&[("v", version)]),
                        match_expressions: vec![Requirement::NotIn(
                            "app".into(),
                            [app.clone()].into(),
                        )],
                    }),
                    3 => PodMatch::Selector(LabelSelector {
                        match_labels: Labels::new(),
                        match_expressions: vec![Requirement::In(
                            "app".into(),
                            [app.clone(), "app0".into()].into(),
                        )],
                    }),
                    4 => PodMatch::Selector(LabelSelector::default()),
                    _ => PodMatch::Subnets(vec![net("10.244.1.0/28")]),
                };
                let mut p = policy(["a", "b", "c", "a"][*scope], &format!("p{i}"), "x");
                p.pods = pods;
                if *scope == 3 {
                    p.id = PolicyRef::cluster(format!("c{i}"));
                    p.namespace_selector = match ns_kind {
                        0 => None,
                        1 => Some(LabelSelector::eq("team", "b")),
                        _ => Some(LabelSelector {
                            match_labels: labels(&[("team", "b"), ("env", "prod")]),
                            ..LabelSelector::default()
                        }),
                    };
                }
                p.age.created = i as i64;
                s.policies.push(Arc::new(p));
            }
            s
        })
}

/// How many pods each policy selects, read plainly: every eligible pod of
/// its namespaces against its selector.
fn selected_plainly(s: &Snapshot) -> BTreeMap<PolicyRef, usize> {
    let ns_labels: HashMap<&str, &Labels> = s
        .namespaces
        .iter()
        .map(|n| (n.name.as_str(), &n.labels))
        .collect();
    s.policies
        .iter()
        .map(|p| {
            let count = s
                .pods
                .iter()
                .filter(|pod| pod.node.is_some() && !pod.ips.is_empty() && !pod.host_network)
                .filter(|pod| match (&p.id.namespace, &p.namespace_selector) {
                    (Some(own), _) => *own == pod.namespace,
                    (None, Some(sel)) => sel.matches(ns_labels[pod.namespace.as_str()]),
                    (None, None) => true,
                })
                .filter(|pod| match &p.pods {
                    PodMatch::Selector(sel) => sel.matches(&pod.labels),
                    PodMatch::Subnets(nets) => {
                        pod.ips.iter().any(|ip| nets.iter().any(|n| n.contains(ip)))
                    }
                })
                .count();
            (p.id.clone(), count)
        })
        .collect()
}

proptest! {
    #[test]
    fn each_policy_selects_the_pods_its_selectors_say(s in arb_selection()) {
        let counted: BTreeMap<PolicyRef, usize> = plan_status(&s)
            .policies
            .into_iter()
            .map(|p| (p.policy, p.pods))
            .collect();
        prop_assert_eq!(counted, selected_plainly(&s));
    }
}

// ---- the incremental planner against the whole plan ----

/// The actions of `state`'s classification entries of the source `src`.
fn actions(state: Option<&NodeState>, src: &str) -> Vec<Action> {
    let src = ip(src);
    state
        .into_iter()
        .flat_map(|s| &s.classify)
        .filter(|e| e.src == src)
        .map(|e| e.action.clone())
        .collect()
}

#[test]
fn a_policy_added_or_deleted_plans_again_only_the_pods_it_selects() {
    let mut s = Cluster::new()
        .pod("a", "web-1", "n1", "10.244.1.10", "web")
        .pod("a", "web-2", "n1", "10.244.1.11", "web")
        .pod("a", "db-1", "n1", "10.244.1.12", "db")
        .pod("b", "web-1", "n1", "10.244.1.20", "web")
        .pod("b", "web-2", "n1", "10.244.1.21", "web")
        .policy(policy("a", "db", "db"))
        .policy(policy("b", "web", "web"))
        .0;
    // Each policy as the controller placed and published it.
    let mut placed = s.clone();
    placed.policies.push(Arc::new(policy("a", "web", "web")));
    let mut everywhere = policy("", "db-everywhere", "db");
    everywhere.id = PolicyRef::cluster("db-everywhere");
    placed.policies.push(Arc::new(everywhere));
    let status = plan(&placed).status;
    remember(&mut placed, &status);
    remember(&mut s, &status);
    let published = |id: PolicyRef| {
        let p = placed.policies.iter().find(|p| p.id == id);
        Arc::clone(p.expect("placed"))
    };
    let mut planner = Planner::new(s, "n1");
    let planned_as_whole = |planner: &Planner| {
        let whole = plan_node_published(&planner.snapshot(), "n1");
        assert_eq!(planner.state(), whole.as_ref());
    };
    assert!(planner.last_change().whole);
    assert!(actions(planner.state(), "10.244.1.10").is_empty());
    // The stages run again with the same policies (a node labelled): no
    // Pod is reached, and their tables stay theirs for the next change.
    let mut labelled = planner.snapshot();
    labelled.nodes[0].labels.insert("zone".into(), "z1".into());
    planner.set_cluster(labelled);
    let staged = LastChange {
        staged: true,
        ..LastChange::default()
    };
    assert_eq!(planner.last_change(), staged);

    // Added: the two Pods it selects, and no other, are planned again.
    let web = PolicyRef::namespaced("a", "web");
    planner.change_policies([PolicyChange::Set(published(web.clone()))]);
    // Each shares the gateway's default EIP with the others: the stages
    // need not run again.
    let only = |pods| LastChange {
        whole: false,
        staged: false,
        pods,
    };
    assert_eq!(planner.last_change(), only(2));
    planned_as_whole(&planner);
    assert!(matches!(
        actions(planner.state(), "10.244.1.10")[..],
        [Action::Tunnel { .. }]
    ));
    // A cluster policy: the Pods it selects in every namespace.
    let everywhere = PolicyRef::cluster("db-everywhere");
    planner.change_policies([PolicyChange::Set(published(everywhere))]);
    assert_eq!(planner.last_change(), only(1));
    planned_as_whole(&planner);

    // Deleted: the Pods it selected.
    planner.change_policies([PolicyChange::Removed(PolicyRef::namespaced("b", "web"))]);
    assert_eq!(planner.last_change(), only(2));
    assert!(actions(planner.state(), "10.244.1.20").is_empty());
    planned_as_whole(&planner);
    // The same, given as a whole cluster: the stages run again.
    let mut cluster = planner.snapshot();
    cluster.policies.retain(|p| p.id != web);
    planner.set_cluster(cluster);
    let staged = LastChange {
        staged: true,
        ..only(2)
    };
    assert_eq!(planner.last_change(), staged);
    assert!(actions(planner.state(), "10.244.1.10").is_empty());
    planned_as_whole(&planner);
    assert!(matches!(
        actions(planner.state(), "10.244.1.12")[..],
        [Action::Tunnel { .. }]
    ));
}

#[test]
fn a_policy_of_its_own_eip_or_the_nodes_address_comes_and_goes_without_the_stages() {
    let base = Cluster::new()
        .pod("a", "web-1", "n1", "10.244.1.10", "web")
        .pod("a", "db-1", "n1", "10.244.1.11", "db")
        .pod("b", "api-1", "n1", "10.244.1.12", "api")
        .pod("b", "app-1", "n1", "10.244.1.13", "app")
        .policy(policy("a", "other", "none"))
        .0;
    // An `rr` policy, a pinned one and a `useNodeIP` one, as the
    // controller placed and published them.
    let rr = with(policy("a", "web", "web"), |p| {
        p.egress_ip.allocator = Allocator::RoundRobin;
    });
    let pinned = with(policy("a", "db", "db"), |p| {
        p.egress_ip.ipv4 = Some("198.51.100.13".parse().unwrap());
    });
    let node_ip = with(policy("b", "api", "api"), |p| {
        p.egress_ip.use_node_ip = true;
    });
    let mut placed = base.clone();
    placed.policies.extend([rr, pinned, node_ip].map(Arc::new));
    let status = plan(&placed).status;
    remember(&mut placed, &status);
    let mut s = base;
    remember(&mut s, &status);
    let published = |name: &str| {
        let p = placed.policies.iter().find(|p| p.id.name == name);
        Arc::clone(p.expect("placed"))
    };
    let alone = |pods| LastChange {
        whole: false,
        staged: false,
        pods,
    };
    for node in ["n1", "g1", "g2"] {
        let mut planner = Planner::new(s.clone(), node);
        let planned_as_whole = |planner: &Planner| {
            let whole = plan_node_published(&planner.snapshot(), node);
            assert_eq!(planner.state(), whole.as_ref(), "{node}");
        };
        for name in ["web", "db", "api"] {
            planner.change_policies([PolicyChange::Set(published(name))]);
            assert_eq!(planner.last_change(), alone(1), "{node}: {name} added");
            planned_as_whole(&planner);
        }
        // Each leaves with its own EIP, or the node's address, from the
        // node the controller published.
        let n1 = planner.state();
        if node == "n1" {
            for pod in ["10.244.1.10", "10.244.1.11", "10.244.1.12"] {
                assert!(
                    matches!(actions(n1, pod)[..], [Action::Tunnel { .. }]),
                    "{pod}"
                );
            }
        }
        for name in ["web", "db", "api"] {
            let id = published(name).id.clone();
            planner.change_policies([PolicyChange::Removed(id)]);
            assert_eq!(planner.last_change(), alone(1), "{node}: {name} deleted");
            planned_as_whole(&planner);
        }
        assert!(actions(planner.state(), "10.244.1.10").is_empty());
    }

    // Two `rr` policies the controller has not published: the second may
    // take its EIP before the first, by age, so the stages decide.
    let mut planner = Planner::new(s, "n1");
    let fresh = |name: &str, app: &str, created: i64| {
        Arc::new(with(policy("b", name, app), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
            p.age.created = created;
        }))
    };
    planner.change_policies([PolicyChange::Set(fresh("new", "app", 10))]);
    assert!(!planner.last_change().staged);
    planner.change_policies([PolicyChange::Set(fresh("older", "api", 5))]);
    assert!(planner.last_change().staged);
    let whole = plan_node_published(&planner.snapshot(), "n1");
    assert_eq!(planner.state(), whole.as_ref());
}

#[test]
fn an_eip_the_controller_places_is_followed_without_the_stages() {
    let mut s = Cluster::new()
        .pod("a", "web-1", "n1", "10.244.1.10", "web")
        .policy(policy("a", "other", "none"))
        .0;
    let status = plan(&s).status;
    remember(&mut s, &status);
    let mut planner = Planner::new(s, "n1");
    // A new `rr` policy: its EIP has no node until the controller says.
    let web = with(policy("a", "web", "web"), |p| {
        p.egress_ip.allocator = Allocator::RoundRobin;
    });
    planner.change_policies([PolicyChange::Set(Arc::new(web))]);
    assert!(actions(planner.state(), "10.244.1.10").is_empty());
    // The controller writes the gateway's status: the EIP's node.
    let mut cluster = planner.snapshot();
    let placed = plan(&cluster).status;
    let (eip, node) = placed
        .eip_nodes
        .iter()
        .find(|(ip, _)| !cluster.gateways[0].previous_nodes.contains_key(ip))
        .map(|(ip, n)| (*ip, n.clone()))
        .expect("the new EIP placed");
    cluster.gateways[0].previous_nodes.insert(eip, node.clone());
    planner.set_cluster(cluster);
    assert_eq!(
        planner.last_change(),
        LastChange {
            whole: false,
            staged: false,
            pods: 1
        }
    );
    assert_eq!(
        actions(planner.state(), "10.244.1.10")
            .first()
            .and_then(gateway_of),
        Some(node.as_str())
    );
    let whole = plan_node_published(&planner.snapshot(), "n1");
    assert_eq!(planner.state(), whole.as_ref());
    // Moved by hand to the other gateway node: followed the same way.
    let mut cluster = planner.snapshot();
    let other = if node == "g1" { "g2" } else { "g1" };
    cluster.gateways[0].previous_nodes.insert(eip, other.into());
    planner.set_cluster(cluster);
    assert!(!planner.last_change().staged);
    assert_eq!(
        actions(planner.state(), "10.244.1.10")
            .first()
            .and_then(gateway_of),
        Some(other)
    );
    let whole = plan_node_published(&planner.snapshot(), "n1");
    assert_eq!(planner.state(), whole.as_ref());
}

#[test]
fn the_eips_of_a_failed_node_spread_over_its_standbys() {
    // Six gateway nodes, twelve `rr` EIPs placed on them.
    let mut s = Snapshot::default();
    for i in 0..6 {
        s.nodes.push(Node {
            name: format!("g{i}"),
            labels: labels(&[("egress", "true")]),
            addresses: vec![ip(&format!("172.18.0.{}", 11 + i))],
            external_addresses: Vec::new(),
            pod_cidrs: vec![net(&format!("10.244.{}.0/24", i + 1))],
            ready: true,
            held_eips: Vec::new(),
        });
    }
    s.namespaces.push(Namespace {
        name: "a".into(),
        labels: Labels::new(),
    });
    s.gateways
        .push(gateway("gw", "198.51.100.10-198.51.100.40", true, 1));
    for k in 0..12 {
        s.policies
            .push(Arc::new(with(policy("a", &format!("p{k}"), "web"), |p| {
                p.egress_ip.allocator = Allocator::RoundRobin;
            })));
    }
    let first = plan(&s);
    let order = |plan: &Plan| -> BTreeMap<IpAddr, Vec<String>> {
        let state = &plan.nodes["g0"];
        state
            .groups
            .iter()
            .filter_map(|g| {
                Some((
                    g.eip?,
                    g.candidates.iter().map(|c| c.node.clone()).collect(),
                ))
            })
            .collect()
    };
    // The EIPs one node holds go to more than one standby.
    let of_g0 = order(&first);
    let held: Vec<&Vec<String>> = of_g0.values().filter(|c| c[0] == "g0").collect();
    assert!(held.len() >= 2, "{of_g0:?}");
    let next: HashSet<&String> = held.iter().map(|c| &c[1]).collect();
    assert!(
        next.len() >= 2,
        "every EIP of g0 fails over to one node: {of_g0:?}"
    );
    // One EIP more changes no other EIP's standbys.
    remember(&mut s, &first.status);
    s.policies
        .push(Arc::new(with(policy("a", "p12", "web"), |p| {
            p.egress_ip.allocator = Allocator::RoundRobin;
        })));
    let second = order(&plan(&s));
    for (eip, candidates) in &of_g0 {
        assert_eq!(second.get(eip), Some(candidates), "{eip}");
    }
}

#[test]
fn a_policy_whose_last_status_names_another_address_runs_the_stages() {
    // A policy of b pins an address nobody held, on a gateway failing
    // closed that has not placed it yet: its traffic is dropped.
    let pin = "198.51.100.12".parse().unwrap();
    let mut s = Cluster::new()
        .pod("a", "web-1", "n1", "10.244.1.10", "web")
        .pod("b", "db-1", "n1", "10.244.1.20", "db")
        .policy(policy("a", "other", "none"))
        .0;
    s.gateways[0].fail_closed = true;
    let status = plan(&s).status;
    remember(&mut s, &status);
    let mut planner = Planner::new(s, "n1");
    let db = with(policy("b", "db", "db"), |p| p.egress_ip.ipv4 = Some(pin));
    planner.change_policies([PolicyChange::Set(Arc::new(db))]);
    assert_eq!(actions(planner.state(), "10.244.1.20"), [Action::Drop]);
    // A policy of a sharing the default EIP, whose last status still
    // names the pinned address (a's own before): the address is a's, so
    // b's pin is refused, and the stages must say so.
    let web = with(policy("a", "web", "web"), |p| {
        p.previous_eips = vec![IpAddr::V4(pin)];
    });
    planner.change_policies([PolicyChange::Set(Arc::new(web))]);
    assert!(planner.last_change().staged);
    let whole = plan_node_published(&planner.snapshot(), "n1");
    assert_eq!(planner.state(), whole.as_ref());
    assert!(actions(planner.state(), "10.244.1.20").is_empty());
}

#[test]
fn a_policy_added_to_an_eip_without_a_node_drops_where_the_gateway_fails_closed() {
    // The default EIP's node is not published yet: its policies' traffic
    // is dropped, the gateway failing closed.
    let mut s = Cluster::new()
        .pod("a", "web-1", "n1", "10.244.1.10", "web")
        .policy(policy("a", "other", "none"))
        .0;
    s.gateways[0].fail_closed = true;
    let mut planner = Planner::new(s, "n1");
    planner.change_policies([PolicyChange::Set(Arc::new(policy("a", "web", "web")))]);
    assert!(!planner.last_change().staged);
    assert_eq!(actions(planner.state(), "10.244.1.10"), [Action::Drop]);
    let whole = plan_node_published(&planner.snapshot(), "n1");
    assert_eq!(planner.state(), whole.as_ref());
}

#[test]
fn namespaces_listed_twice_are_not_taken_for_the_labels_planned() {
    let cp = with(policy("x", "cp", "web"), |p| {
        p.id = PolicyRef::cluster("cp");
        p.namespace_selector = Some(LabelSelector::eq("team", "x"));
    });
    let mut s = Cluster::new()
        .pod("c", "web-1", "n1", "10.244.1.10", "web")
        .policy(cp)
        .0;
    s.namespaces.push(Namespace {
        name: "c".into(),
        labels: labels(&[("team", "x")]),
    });
    let status = plan(&s).status;
    remember(&mut s, &status);
    let mut planner = Planner::new(s, "n1");
    assert!(matches!(
        actions(planner.state(), "10.244.1.10")[..],
        [Action::Tunnel { .. }]
    ));
    // c deleted, a listed twice: as many names as before, each labelled
    // as before; and a node relabelled, so the stages run.
    let mut cluster = planner.snapshot();
    cluster.namespaces[2] = cluster.namespaces[0].clone();
    cluster.nodes[0].labels.insert("zone".into(), "z1".into());
    planner.set_cluster(cluster);
    let whole = plan_node_published(&planner.snapshot(), "n1");
    assert_eq!(planner.state(), whole.as_ref());
    assert!(actions(planner.state(), "10.244.1.10").is_empty());
}

#[test]
fn a_namespace_relabelled_plans_again_only_its_pods() {
    let cp = with(policy("x", "cp", "web"), |p| {
        p.id = PolicyRef::cluster("cp");
        p.namespace_selector = Some(LabelSelector::eq("team", "b"));
    });
    let mut s = Cluster::new()
        .pod("a", "web-1", "n1", "10.244.1.10", "web")
        .pod("a", "web-2", "n1", "10.244.1.11", "web")
        .pod("a", "db-1", "n1", "10.244.1.12", "db")
        .pod("b", "web-1", "n1", "10.244.1.20", "web")
        .policy(cp)
        .0;
    let status = plan(&s).status;
    remember(&mut s, &status);
    let mut planner = Planner::new(s, "n1");
    let planned_as_whole = |planner: &Planner| {
        let whole = plan_node_published(&planner.snapshot(), "n1");
        assert_eq!(planner.state(), whole.as_ref());
    };
    let only = |pods| LastChange {
        whole: false,
        staged: false,
        pods,
    };
    let steered = |planner: &Planner, src| {
        matches!(actions(planner.state(), src)[..], [Action::Tunnel { .. }])
    };
    assert!(!steered(&planner, "10.244.1.10"));
    assert!(steered(&planner, "10.244.1.20"));

    // A Pod added one by one is found with its namespace's.
    let web3 = Cluster::new()
        .pod("a", "web-3", "n1", "10.244.1.13", "web")
        .0;
    planner.set_pod(web3.pods[0].clone());
    assert!(!steered(&planner, "10.244.1.13"));

    // Namespace a taken by the policy's selector: its four Pods are
    // matched again, b's Pod is not.
    let mut cluster = planner.snapshot();
    cluster.namespaces[0].labels = labels(&[("team", "b")]);
    planner.set_cluster(cluster);
    assert_eq!(planner.last_change(), only(4));
    assert!(steered(&planner, "10.244.1.10"));
    assert!(steered(&planner, "10.244.1.13"));
    assert!(!steered(&planner, "10.244.1.12"));
    planned_as_whole(&planner);
    // A Pod deleted is no longer found with them.
    planner.remove_pod("a", "web-3");
    let mut cluster = planner.snapshot();
    cluster.namespaces[0].labels = labels(&[("team", "a")]);
    planner.set_cluster(cluster);
    assert_eq!(planner.last_change(), only(3));
    assert!(!steered(&planner, "10.244.1.10"));
    planned_as_whole(&planner);
    let mut cluster = planner.snapshot();
    cluster.namespaces[0].labels = labels(&[("team", "b")]);
    planner.set_cluster(cluster);
    assert_eq!(planner.last_change(), only(3));
    // A namespace added with no Pods: none.
    let mut cluster = planner.snapshot();
    cluster.namespaces.push(Namespace {
        name: "c".into(),
        labels: labels(&[("team", "b")]),
    });
    planner.set_cluster(cluster);
    assert_eq!(planner.last_change(), only(0));
    planned_as_whole(&planner);

    // Once a gateway admits namespaces by their labels, a relabel may
    // change what the stages decide: a's own policy is refused when a
    // leaves the gateway's selector.
    let mut cluster = planner.snapshot();
    cluster.gateways[0].namespace_selector = Some(LabelSelector::eq("team", "b"));
    planner.set_cluster(cluster);
    planner.change_policies([PolicyChange::Set(Arc::new(policy("a", "db", "db")))]);
    planned_as_whole(&planner);
    assert!(steered(&planner, "10.244.1.12"));
    let mut cluster = planner.snapshot();
    cluster.namespaces[0].labels = labels(&[("team", "c")]);
    planner.set_cluster(cluster);
    planned_as_whole(&planner);
    assert!(!steered(&planner, "10.244.1.12"));
    assert!(!steered(&planner, "10.244.1.10"));
}

/// One change to a cluster, as an agent's watches see them.
#[derive(Debug, Clone)]
enum Step {
    /// A Pod added or replaced: (namespace, name, app, node, address, host network).
    Pod(usize, usize, usize, usize, u8, bool),
    /// A Pod deleted.
    PodGone(usize, usize),
    /// A Pod not scheduled yet, or without an address.
    Pending(usize, usize, bool),
    /// A namespace relabelled (a cluster policy's selector may change).
    Namespace(usize, usize),
    /// A policy's pod selector edited.
    Policy(usize, usize),
    /// A policy's destinations edited.
    Destinations(usize, usize),
    /// A policy's priority and excluded destinations edited.
    Precedence(usize, i32, usize),
    /// A cluster policy's namespace selector set to a team, or removed.
    Scope(usize, Option<usize>),
    /// A node's readiness flipped.
    Node(usize),
    /// A node's tunnel address changed (as an operator editing its
    /// EgressTunnel would).
    Tunnel(usize),
    /// A policy deleted and one like it created under another name: the
    /// policies are no longer the same ones.
    Recreated(usize),
    /// A policy moved to another gateway (or the cluster default).
    Gateway(usize, Option<usize>),
    /// A policy like another created under a new name, a namespaced one in
    /// the given namespace: a policy that was not there.
    Copied(usize, usize),
    /// A policy deleted.
    Deleted(usize),
    /// A gateway made to fail closed, or open again.
    FailClosed(usize),
    /// A manifest applied again: one policy deleted, and another one's
    /// destinations edited, in one change.
    Reapplied(usize, usize, usize),
    /// A policy given another way to get its EIP ([`allocate_as`]).
    Allocator(usize, u8),
    /// The controller's allocations written back as status, and the
    /// first candidate of each EIP reporting it holds it.
    Published,
    /// The gateways' status alone written back as the controller plans it.
    GatewaysPublished,
    /// Every EIP a gateway's status names put on one node (as a controller
    /// of another version might).
    Placed(usize, usize),
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0usize..2, 0usize..8, 0usize..4, 0usize..6, 0u8..12, any::<bool>())
            .prop_map(|(ns, name, app, node, ip, host)| Step::Pod(ns, name, app, node, ip, host)),
        3 => (0usize..2, 0usize..8).prop_map(|(ns, name)| Step::PodGone(ns, name)),
        1 => (0usize..2, 0usize..8, any::<bool>()).prop_map(|(ns, name, n)| Step::Pending(ns, name, n)),
        1 => (0usize..2, 0usize..2).prop_map(|(ns, team)| Step::Namespace(ns, team)),
        1 => (0usize..8, 0usize..4).prop_map(|(p, app)| Step::Policy(p, app)),
        1 => (0usize..8, 0usize..4).prop_map(|(p, d)| Step::Destinations(p, d)),
        1 => (0usize..8, -1i32..2, 0usize..3).prop_map(|(p, prio, x)| Step::Precedence(p, prio, x)),
        1 => (0usize..8, prop::option::of(0usize..2)).prop_map(|(p, t)| Step::Scope(p, t)),
        1 => (0usize..6).prop_map(Step::Node),
        1 => (0usize..6).prop_map(Step::Tunnel),
        1 => (0usize..8).prop_map(Step::Recreated),
        1 => (0usize..8, prop::option::of(0usize..3)).prop_map(|(p, g)| Step::Gateway(p, g)),
        1 => (0usize..8, 0usize..2).prop_map(|(p, n)| Step::Copied(p, n)),
        1 => (0usize..8).prop_map(Step::Deleted),
        1 => (0usize..3).prop_map(Step::FailClosed),
        1 => (0usize..8, 0usize..8, 0usize..4).prop_map(|(p, q, d)| Step::Reapplied(p, q, d)),
        2 => (0usize..8, 0u8..5).prop_map(|(p, a)| Step::Allocator(p, a)),
        1 => Just(Step::Published),
        1 => Just(Step::GatewaysPublished),
        1 => (0usize..3, 0usize..6).prop_map(|(g, n)| Step::Placed(g, n)),
    ]
}

/// A planner kept between plans: an agent's or the controller's.
trait Follows {
    fn snapshot(&self) -> Snapshot;
    fn set_cluster(&mut self, cluster: Snapshot);
    fn change_policies(&mut self, changes: Vec<PolicyChange>);
    fn set_pod(&mut self, pod: Pod);
    fn remove_pod(&mut self, namespace: &str, name: &str);
}

macro_rules! follows {
    ($($kind:ty),*) => {$(
        impl Follows for $kind {
            fn snapshot(&self) -> Snapshot {
                <$kind>::snapshot(self)
            }
            fn set_cluster(&mut self, cluster: Snapshot) {
                <$kind>::set_cluster(self, cluster);
            }
            fn change_policies(&mut self, changes: Vec<PolicyChange>) {
                <$kind>::change_policies(self, changes);
            }
            fn set_pod(&mut self, pod: Pod) {
                <$kind>::set_pod(self, pod);
            }
            fn remove_pod(&mut self, namespace: &str, name: &str) {
                <$kind>::remove_pod(self, namespace, name);
            }
        }
    )*};
}
follows!(Planner, Publisher);

/// Applies `step` to `planner` as a daemon would: a Pod's change by itself,
/// anything else as a new cluster.
fn ns(i: usize) -> String {
    ["a", "b"][i].to_owned()
}

/// The change of a Pod step, in a cluster of `nodes` nodes; `None` for
/// the steps of other objects.
fn pod_change(step: &Step, nodes: usize) -> Option<PodChange> {
    Some(match *step {
        Step::Pod(n, name, app, node, ip, host) => {
            let node = node % nodes;
            PodChange::Set(Arc::new(Pod {
                namespace: ns(n),
                name: format!("pod-{name}"),
                labels: labels(&[("app", &format!("app{app}"))]),
                // Addresses collide on purpose: two Pods may claim one.
                ips: vec![IpAddr::from([10, 244, node as u8, 10 + ip])],
                node: Some(format!("node-{node}")),
                host_network: host && ip % 5 == 0,
            }))
        }
        Step::PodGone(n, name) => PodChange::Removed {
            namespace: ns(n),
            name: format!("pod-{name}"),
        },
        Step::Pending(n, name, scheduled) => PodChange::Set(Arc::new(Pod {
            namespace: ns(n),
            name: format!("pod-{name}"),
            labels: labels(&[("app", "app0")]),
            ips: Vec::new(),
            node: scheduled.then(|| "node-0".to_owned()),
            host_network: false,
        })),
        _ => return None,
    })
}

fn apply_step(planner: &mut impl Follows, step: &Step) {
    apply_step_as(planner, step, false);
}

/// [`apply_step`]; with `by_policies`, a step that changes policies alone
/// goes to the planner as those policies' changes.
fn apply_step_as(planner: &mut impl Follows, step: &Step, by_policies: bool) {
    let mut cluster = planner.snapshot();
    // A step names a policy by its place; planners given the same steps
    // otherwise may hold their policies in another order.
    cluster.policies.sort_by(|a, b| a.id.cmp(&b.id));
    let nodes = cluster.nodes.len();
    if let Some(change) = pod_change(step, nodes) {
        match change {
            PodChange::Set(pod) => planner.set_pod(Arc::unwrap_or_clone(pod)),
            PodChange::Removed { namespace, name } => planner.remove_pod(&namespace, &name),
        }
        return;
    }
    let before = by_policies.then(|| cluster.clone());
    match *step {
        Step::Pod(..) | Step::PodGone(..) | Step::Pending(..) => unreachable!("a Pod's change"),
        Step::Namespace(n, team) => {
            if let Some(namespace) = cluster.namespaces.get_mut(n) {
                namespace.labels = labels(&[("team", ["a", "b"][team])]);
            }
        }
        Step::Policy(p, app) => {
            if let Some(policy) = cluster.policy_mut(p) {
                policy.pods = PodMatch::Selector(LabelSelector::eq("app", &format!("app{app}")));
            }
        }
        Step::Destinations(p, d) => {
            if let Some(policy) = cluster.policy_mut(p) {
                policy.dest_subnets = destinations(d);
            }
        }
        Step::Precedence(p, priority, x) => {
            let excludes = [
                vec![],
                vec![net("203.0.113.0/26")],
                vec![net("198.18.0.0/16")],
            ];
            if let Some(policy) = cluster.policy_mut(p) {
                policy.priority = priority;
                policy.exclude_subnets = excludes[x].clone();
            }
        }
        Step::Scope(p, team) => {
            if let Some(policy) = cluster.policy_mut(p)
                && policy.id.namespace.is_none()
            {
                policy.namespace_selector = team.map(|t| LabelSelector::eq("team", ["a", "b"][t]));
            }
        }
        Step::Node(n) => {
            let node = &mut cluster.nodes[n % nodes];
            node.ready = !node.ready;
        }
        Step::Recreated(p) => {
            if let Some(policy) = cluster.policy_mut(p) {
                policy.id.name.push('x');
                policy.age.uid.push('x');
            }
        }
        Step::Gateway(p, g) => {
            if let Some(policy) = cluster.policy_mut(p) {
                policy.gateway = g.map(|g| format!("gw{g}"));
            }
        }
        Step::FailClosed(g) => {
            if let Some(gateway) = cluster.gateways.get_mut(g) {
                gateway.fail_closed = !gateway.fail_closed;
            }
        }
        Step::Copied(p, n) => {
            if let Some(policy) = cluster.policies.get(p) {
                let mut copy = Policy::clone(policy);
                // A name no policy has: the API server holds one object
                // of a name, and a change is known by it.
                let taken = |name: &str| cluster.policies.iter().any(|p| p.id.name == name);
                let k = (cluster.policies.len()..)
                    .find(|k| !taken(&format!("{}-copy{k}", copy.id.name)))
                    .expect("a free name");
                copy.id.name = format!("{}-copy{k}", copy.id.name);
                copy.age.uid = format!("{}-copy{k}", copy.age.uid);
                if copy.id.namespace.is_some() {
                    copy.id.namespace = Some(ns(n));
                }
                cluster.policies.push(Arc::new(copy));
            }
        }
        Step::Deleted(p) => {
            if p < cluster.policies.len() {
                cluster.policies.remove(p);
            }
        }
        Step::Reapplied(p, q, d) => {
            if let Some(policy) = cluster.policy_mut(q) {
                policy.dest_subnets = destinations(d);
            }
            if p != q && p < cluster.policies.len() {
                cluster.policies.remove(p);
            }
        }
        Step::Allocator(p, alloc) => {
            if let Some(policy) = cluster.policy_mut(p) {
                allocate_as(policy, alloc, p);
            }
        }
        Step::Published => {
            let status = plan(&cluster).status;
            remember(&mut cluster, &status);
            for node in &mut cluster.nodes {
                node.held_eips = status
                    .eip_nodes
                    .iter()
                    .filter(|(_, n)| **n == node.name)
                    .map(|(ip, _)| *ip)
                    .collect();
            }
        }
        Step::GatewaysPublished => {
            let mut published = cluster.clone();
            remember(&mut published, &plan(&cluster).status);
            for (gateway, now) in cluster.gateways.iter_mut().zip(published.gateways) {
                gateway.previous_nodes = now.previous_nodes;
            }
        }
        Step::Placed(g, n) => {
            if let Some(gateway) = cluster.gateways.get_mut(g) {
                for node in gateway.previous_nodes.values_mut() {
                    *node = format!("node-{}", n % nodes);
                }
            }
        }
        Step::Tunnel(n) => {
            let name = format!("node-{}", n % nodes);
            for tunnel in cluster.tunnels.iter_mut().filter(|t| t.node == name) {
                let [a, b, _, d] = tunnel.ipv4.map_or([172, 31, 0, 1], |ip| ip.octets());
                tunnel.ipv4 = Some([a, b, 7, d].into());
            }
        }
    }
    let policies_alone = before.as_ref().is_some_and(|b| {
        Snapshot {
            policies: cluster.policies.clone(),
            ..b.clone()
        } == cluster
    });
    match before {
        Some(before) if policies_alone => {
            planner.change_policies(policy_changes(&before, &cluster));
        }
        _ => planner.set_cluster(cluster),
    }
}

/// The `d`th of a few destination lists, nested and overlapping.
fn destinations(d: usize) -> Vec<IpNet> {
    let dests = [
        vec![],
        vec![net("203.0.113.0/24")],
        vec![net("203.0.0.0/8")],
        vec![net("203.0.113.128/25"), net("198.18.0.0/15")],
    ];
    dests[d].clone()
}

/// The changes of policies from `before` to `after`, deletions first.
fn policy_changes(before: &Snapshot, after: &Snapshot) -> Vec<PolicyChange> {
    let gone = before
        .policies
        .iter()
        .filter(|p| !after.policies.iter().any(|q| q.id == p.id))
        .map(|p| PolicyChange::Removed(p.id.clone()));
    let set = after
        .policies
        .iter()
        .filter(|p| !before.policies.contains(p))
        .map(|p| PolicyChange::Set(p.clone()));
    gone.chain(set).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_planner_changed_step_by_step_plans_what_the_whole_plan_does(
        s in arb_snapshot(),
        steps in prop::collection::vec(arb_step(), 1..40),
    ) {
        // The controller's placement, published, as agents find it.
        let mut s = s;
        let status = plan(&s).status;
        remember(&mut s, &status);
        let nodes: Vec<String> = s.nodes.iter().map(|n| n.name.clone()).collect();
        let mut planners: Vec<Planner> = nodes.iter().map(|n| Planner::new(s.clone(), n)).collect();
        // The same steps, with the Pods' changes between two other steps
        // taken in one batch.
        let mut batched: Vec<Planner> = nodes.iter().map(|n| Planner::new(s.clone(), n)).collect();
        let mut batch = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            for (planner, node) in planners.iter_mut().zip(&nodes) {
                // Held across the step, as an agent holds its plan, so
                // that the step plans into a copy of the shared state.
                let held = planner.shared_state();
                apply_step(planner, step);
                drop(held);
                let whole = plan_node_published(&planner.snapshot(), node);
                prop_assert_eq!(planner.state(), whole.as_ref(), "{} after step {}: {:?}", node, i, step);
            }
            let of_pods = pod_change(step, nodes.len());
            let last = i + 1 == steps.len();
            if let Some(change) = of_pods.clone() {
                batch.push(change);
                if !last {
                    continue;
                }
            }
            for ((planner, one_by_one), node) in batched.iter_mut().zip(&planners).zip(&nodes) {
                planner.change_pods(batch.clone());
                if of_pods.is_none() {
                    apply_step_as(planner, step, true);
                }
                prop_assert_eq!(planner.state(), one_by_one.state(), "{} batched, after step {}: {:?}", node, i, step);
            }
            batch.clear();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Gateways selecting nodes of their own, Pods sharing addresses: the
    /// controller's publisher, changed step by step, publishes what
    /// `plan_published` does from the same objects.
    #[test]
    fn a_publisher_changed_step_by_step_publishes_what_the_whole_plan_does(
        s in arb_snapshot(),
        steps in prop::collection::vec(arb_step(), 1..40),
    ) {
        let mut s = s;
        for (g, gateway) in s.gateways.iter_mut().enumerate() {
            if g > 0 {
                gateway.node_selector = LabelSelector::eq("gw", &g.to_string());
            }
        }
        let mut publisher = Publisher::new(s.clone());
        let mut one_by_one = Publisher::new(s.clone());
        one_by_one.never_in_bulk();
        let mut before = plan_published(&s).gateway_pods.into_iter()
            .map(|(g, pods)| (g, pods.into_iter().cloned().collect::<Vec<Pod>>()))
            .collect::<BTreeMap<_, _>>();
        prop_assert_eq!(&publisher.published(), &plan_published(&s));
        publisher.take_changed();
        for (i, step) in steps.iter().enumerate() {
            apply_step(&mut publisher, step);
            apply_step_as(&mut one_by_one, step, true);
            let objects = publisher.snapshot();
            let whole = plan_published(&objects);
            prop_assert_eq!(&publisher.published(), &whole, "after step {}: {:?}", i, step);
            prop_assert_eq!(&one_by_one.published(), &whole, "one by one, after step {}: {:?}", i, step);
            let changed_one_by_one = one_by_one.take_changed();
            // Every gateway whose Pods changed says so.
            let changed = publisher.take_changed();
            let after: BTreeMap<String, Vec<Pod>> = whole.gateway_pods.into_iter()
                .map(|(g, pods)| (g, pods.into_iter().cloned().collect()))
                .collect();
            for gateway in before.keys().chain(after.keys()) {
                if before.get(gateway) != after.get(gateway) {
                    prop_assert!(changed.contains(gateway), "{} changed unsaid after step {}: {:?}", gateway, i, step);
                    prop_assert!(changed_one_by_one.contains(gateway), "{} changed unsaid one by one after step {}: {:?}", gateway, i, step);
                }
            }
            before = after;
        }
    }
}

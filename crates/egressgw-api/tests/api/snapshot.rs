//! Kubernetes objects into the planner's snapshot.

use std::net::IpAddr;

use egressgw_api::snapshot::{self, SnapshotBuilder};
use egressgw_core::model::{Age, Config, PodMatch, PolicyRef};
use egressgw_core::selector::LabelSelector;
use k8s_openapi::api::core::v1::{Node, Pod};

use crate::fixtures::{cluster_policy, from_yaml, gateway, policy, tunnel};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP address")
}

fn node(yaml: &str) -> Node {
    from_yaml(&format!("apiVersion: v1\nkind: Node\n{yaml}"))
}

fn pod(yaml: &str) -> Pod {
    from_yaml(&format!("apiVersion: v1\nkind: Pod\n{yaml}"))
}

const READY_NODE: &str = r#"
metadata: {name: n1, labels: {egress: "true"}}
spec: {podCIDRs: [10.244.1.0/24, "fd00:244:1::/64"], podCIDR: 10.244.9.0/24}
status:
  addresses:
  - {type: Hostname, address: n1}
  - {type: ExternalIP, address: 203.0.113.1}
  - {type: InternalIP, address: 192.168.1.11}
  - {type: InternalIP, address: "fd00::11"}
  conditions:
  - {type: MemoryPressure, status: "False"}
  - {type: Ready, status: "True"}
"#;

#[test]
fn a_node_with_a_true_ready_condition_is_ready_with_its_internal_ips_and_pod_cidrs() {
    let n = snapshot::node(&node(READY_NODE)).unwrap();
    assert_eq!(n.name, "n1");
    assert!(n.ready);
    assert_eq!(n.addresses, vec![ip("192.168.1.11"), ip("fd00::11")]);
    assert_eq!(n.external_addresses, vec![ip("203.0.113.1")]);
    assert_eq!(
        n.pod_cidrs,
        vec![
            "10.244.1.0/24".parse().unwrap(),
            "fd00:244:1::/64".parse().unwrap()
        ]
    );
    assert_eq!(n.labels.get("egress").map(String::as_str), Some("true"));
}

#[test]
fn a_node_without_conditions_is_not_ready() {
    let n = snapshot::node(&node("metadata: {name: n1}\n")).unwrap();
    assert!(!n.ready);
    assert!(n.addresses.is_empty());
}

#[test]
fn a_node_whose_ready_condition_is_unknown_is_not_ready() {
    let n = snapshot::node(&node(
        "metadata: {name: n1}\nstatus: {conditions: [{type: Ready, status: Unknown}]}\n",
    ))
    .unwrap();
    assert!(!n.ready);
}

#[test]
fn pod_cidrs_fall_back_to_the_single_pod_cidr() {
    let n = snapshot::node(&node(
        "metadata: {name: n1}\nspec: {podCIDR: 10.244.3.0/24}\n",
    ))
    .unwrap();
    assert_eq!(n.pod_cidrs, vec!["10.244.3.0/24".parse().unwrap()]);
}

#[test]
fn a_running_pod_has_its_ips_node_and_labels() {
    let p = snapshot::pod(&pod(
        "metadata: {name: web-1, namespace: shop, labels: {app: web}}\n\
         spec: {nodeName: n1, containers: []}\n\
         status: {phase: Running, podIP: 10.244.1.9, podIPs: [{ip: 10.244.1.5}, {ip: 'fd00:244:1::5'}]}\n",
    ))
    .unwrap();
    assert_eq!((p.namespace.as_str(), p.name.as_str()), ("shop", "web-1"));
    assert_eq!(p.ips, vec![ip("10.244.1.5"), ip("fd00:244:1::5")]);
    assert_eq!(p.node.as_deref(), Some("n1"));
    assert!(!p.host_network);
    assert_eq!(p.labels.get("app").map(String::as_str), Some("web"));
}

#[test]
fn pod_ips_fall_back_to_the_single_pod_ip() {
    let p = snapshot::pod(&pod(
        "metadata: {name: a, namespace: d}\nspec: {containers: [], hostNetwork: true}\nstatus: {podIP: 192.168.1.11}\n",
    ))
    .unwrap();
    assert_eq!(p.ips, vec![ip("192.168.1.11")]);
    assert!(p.host_network);
    assert_eq!(p.node, None);
}

#[test]
fn a_pod_in_failed_or_succeeded_phase_is_ignored() {
    for phase in ["Failed", "Succeeded"] {
        let p = pod(&format!(
            "metadata: {{name: a, namespace: d}}\nspec: {{containers: []}}\nstatus: {{phase: {phase}, podIP: 10.0.0.1}}\n"
        ));
        assert_eq!(snapshot::pod(&p), None, "{phase}");
    }
}

#[test]
fn a_terminating_pod_is_ignored() {
    let p = pod(
        "metadata: {name: a, namespace: d, deletionTimestamp: '2026-01-01T00:00:00Z'}\n\
         spec: {containers: []}\nstatus: {phase: Running, podIP: 10.0.0.1}\n",
    );
    assert_eq!(snapshot::pod(&p), None);
}

const GATEWAY_OBJECT: &str = r#"
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata: {name: gw1, uid: u-1, creationTimestamp: "2026-01-01T00:00:10Z"}
spec:
  nodeSelector: {selector: {matchLabels: {egress: "true"}}}
  ippools: {ipv4: [10.6.1.1-10.6.1.9], ipv4DefaultEIP: 10.6.1.5, ipv6: ["fd00::/126"]}
  clusterDefault: true
status:
  nodeList:
  - name: n1
    status: Ready
    eips:
    - {ipv4: 10.6.1.5, ipv6: "fd00::1", policies: [{name: p1, namespace: default}]}
  - name: n2
    status: NotReady
    eips:
    - policies: [{name: cp1}]
"#;

#[test]
fn a_gateway_converts_with_its_pools_defaults_age_and_previous_nodes() {
    let g = gateway(GATEWAY_OBJECT).to_model();
    assert_eq!(g.errors, Vec::<String>::new());
    assert_eq!(g.name, "gw1");
    assert!(g.cluster_default);
    assert_eq!(g.node_selector, LabelSelector::eq("egress", "true"));
    assert_eq!(g.ipv4_pool.len(), 9);
    assert_eq!(g.ipv6_pool.len(), 4);
    assert_eq!(g.ipv4_default, Some("10.6.1.5".parse().unwrap()));
    assert_eq!(g.ipv6_default, None);
    assert_eq!(
        g.age,
        Age {
            created: 1_767_225_610,
            uid: "u-1".into()
        }
    );
    assert_eq!(
        g.previous_nodes,
        [
            (ip("10.6.1.5"), "n1".to_owned()),
            (ip("fd00::1"), "n1".to_owned())
        ]
        .into()
    );
}

const POLICY_OBJECT: &str = r#"
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: p1, namespace: shop, uid: u-2, creationTimestamp: "2026-01-01T00:00:00Z"}
spec:
  egressGatewayName: ""
  egressIP: {ipv4: 10.6.1.7, allocatorPolicy: rr}
  appliedTo: {podSelector: {matchLabels: {app: web}}}
  destSubnet: [0.0.0.0/0]
  excludeSubnet: [10.0.0.0/8]
  priority: 7
status:
  eip: {ipv4: 10.6.1.7, ipv6: "fd00::2"}
  node: n1
"#;

#[test]
fn a_namespaced_policy_converts_without_a_namespace_selector() {
    let p = policy(POLICY_OBJECT).to_model().unwrap();
    assert_eq!(p.id, PolicyRef::namespaced("shop", "p1"));
    assert_eq!(
        p.gateway, None,
        "an empty gateway name means the cluster default"
    );
    assert_eq!(p.egress_ip.ipv4, Some("10.6.1.7".parse().unwrap()));
    assert_eq!(
        p.egress_ip.allocator,
        egressgw_core::model::Allocator::RoundRobin
    );
    assert_eq!(p.pods, PodMatch::Selector(LabelSelector::eq("app", "web")));
    assert_eq!(p.namespace_selector, None);
    assert_eq!(p.dest_subnets, vec!["0.0.0.0/0".parse().unwrap()]);
    assert_eq!(p.exclude_subnets, vec!["10.0.0.0/8".parse().unwrap()]);
    assert_eq!(p.priority, 7);
    assert_eq!(p.previous_eips, vec![ip("10.6.1.7"), ip("fd00::2")]);
    assert_eq!(p.previous_node.as_deref(), Some("n1"));
}

#[test]
fn a_cluster_policy_keeps_its_namespace_selector_and_without_one_applies_everywhere() {
    let with = cluster_policy(
        "apiVersion: egressgw.io/v1alpha1\nkind: EgressClusterPolicy\nmetadata: {name: cp1}\n\
         spec: {egressGatewayName: gw1, appliedTo: {podSubnet: [10.244.0.0/16], namespaceSelector: {matchLabels: {team: a}}}}\n",
    )
    .to_model()
    .unwrap();
    assert_eq!(with.id, PolicyRef::cluster("cp1"));
    assert_eq!(with.gateway.as_deref(), Some("gw1"));
    assert_eq!(
        with.namespace_selector,
        Some(LabelSelector::eq("team", "a"))
    );
    assert_eq!(
        with.pods,
        PodMatch::Subnets(vec!["10.244.0.0/16".parse().unwrap()])
    );
    let without = cluster_policy(
        "apiVersion: egressgw.io/v1alpha1\nkind: EgressClusterPolicy\nmetadata: {name: cp2}\n\
         spec: {appliedTo: {podSelector: {}}}\n",
    )
    .to_model()
    .unwrap();
    assert_eq!(without.namespace_selector, None);
}

#[test]
fn an_invalid_policy_lands_in_invalid_and_leaves_the_valid_ones_alone() {
    let bad = policy(
        "apiVersion: egressgw.io/v1alpha1\nkind: EgressPolicy\nmetadata: {name: bad, namespace: shop}\n\
         spec: {egressIP: {ipv4: 10.0.0.300}, appliedTo: {}}\n",
    );
    let good = policy(POLICY_OBJECT);
    let snapshot = SnapshotBuilder::new(Config::default())
        .policies([&bad, &good])
        .build();
    assert_eq!(snapshot.policies.len(), 1);
    assert_eq!(snapshot.policies[0].id, PolicyRef::namespaced("shop", "p1"));
    assert_eq!(snapshot.invalid.len(), 1);
    let invalid = &snapshot.invalid[0];
    assert_eq!(
        (
            invalid.kind.as_str(),
            invalid.namespace.as_deref(),
            invalid.name.as_str()
        ),
        ("EgressPolicy", Some("shop"), "bad")
    );
    assert_eq!(
        invalid.errors,
        vec![
            r#"spec.egressIP.ipv4: "10.0.0.300" is not an IP address"#,
            "spec.appliedTo: set exactly one of podSelector and podSubnet",
        ]
    );
}

const INVALID_GATEWAY: &str = r#"
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata: {name: gwbad, uid: u-9, creationTimestamp: "2026-01-01T00:00:20Z"}
spec:
  nodeSelector: {selector: {matchLabels: {egress: "true"}}}
  ippools: {ipv4: [10.6.1.1-10.6.1.9, 10.0.0.9-10.0.0.1], ipv4DefaultEIP: 10.6.1.5}
  clusterDefault: true
status:
  nodeList:
  - name: n1
    status: Ready
    eips:
    - {ipv4: 10.6.1.5, policies: [{name: p1, namespace: default}]}
"#;

#[test]
fn an_invalid_gateway_lands_in_gateways_with_its_errors_and_keeps_cluster_default() {
    let snapshot = SnapshotBuilder::new(Config::default())
        .gateways([gateway(INVALID_GATEWAY), gateway(GATEWAY_OBJECT)])
        .build();
    assert!(snapshot.invalid.is_empty(), "{:?}", snapshot.invalid);
    assert_eq!(snapshot.gateways.len(), 2);
    let bad = &snapshot.gateways[0];
    assert_eq!(bad.name, "gwbad");
    assert_eq!(
        bad.errors,
        vec![
            r#"spec.ippools.ipv4[1]: range "10.0.0.9-10.0.0.1" is reversed: its end is lower than its start"#
        ]
    );
    assert!(bad.cluster_default);
    assert_eq!(
        bad.age,
        Age {
            created: 1_767_225_620,
            uid: "u-9".into()
        }
    );
    assert_eq!(bad.node_selector, LabelSelector::eq("egress", "true"));
    assert_eq!(
        bad.previous_nodes,
        [(ip("10.6.1.5"), "n1".to_owned())].into()
    );
    assert!(bad.ipv4_pool.is_empty() && bad.ipv6_pool.is_empty());
    assert_eq!((bad.ipv4_default, bad.ipv6_default), (None, None));
    assert_eq!(snapshot.gateways[1].errors, Vec::<String>::new());
}

#[test]
fn an_invalid_gateway_whose_selector_does_not_convert_gets_the_empty_selector() {
    let g = gateway(
        "apiVersion: egressgw.io/v1alpha1\nkind: EgressGateway\nmetadata: {name: gwsel}\n\
         spec: {nodeSelector: {selector: {matchLabels: {a: b}, matchExpressions: [{key: zone, operator: In}]}}, ippools: {ipv4: [10.0.0.1]}}\n",
    )
    .to_model();
    assert_eq!(g.name, "gwsel");
    assert!(!g.cluster_default);
    assert_eq!(g.node_selector, LabelSelector::default());
    assert_eq!(
        g.errors,
        vec![
            "spec.nodeSelector.selector.matchExpressions[0].values: operator In needs at least one value"
        ]
    );
    assert!(g.ipv4_pool.is_empty());
}

#[test]
fn a_gateway_without_a_name_converts_with_an_error_for_it() {
    let g = gateway(
        "apiVersion: egressgw.io/v1alpha1\nkind: EgressGateway\nmetadata: {}\n\
         spec: {nodeSelector: {selector: {}}, ippools: {ipv4: [10.0.0.1]}}\n",
    )
    .to_model();
    assert_eq!(g.errors, vec!["metadata.name: must be set"]);
    assert!(g.ipv4_pool.is_empty());
}

const TUNNEL: &str = r#"
apiVersion: egressgw.io/v1alpha1
kind: EgressTunnel
metadata: {name: n1}
spec: {}
status:
  tunnel: {ipv4: 172.31.0.1, mac: "66:0a:1b:2c:3d:4e", parent: {name: eth0, ipv4: 192.168.1.11}}
  mark: "0x01000000"
  phase: PHASE
"#;

#[test]
fn a_tunnel_converts_from_its_status() {
    let t = tunnel(&TUNNEL.replace("PHASE", "Ready"))
        .to_model()
        .unwrap();
    assert_eq!(t.node, "n1");
    assert_eq!(t.ipv4, Some("172.31.0.1".parse().unwrap()));
    assert_eq!(t.ipv6, None);
    assert_eq!(
        t.mac.map(|m| m.to_string()).as_deref(),
        Some("66:0a:1b:2c:3d:4e")
    );
    assert_eq!(t.mark, Some(0x0100_0000));
}

#[test]
fn a_tunnel_without_status_has_no_identity_yet() {
    let t = tunnel(
        "apiVersion: egressgw.io/v1alpha1\nkind: EgressTunnel\nmetadata: {name: n2}\nspec: {}\n",
    )
    .to_model()
    .unwrap();
    assert_eq!((t.ipv4, t.mac, t.mark), (None, None, None));
}

#[test]
fn a_tunnel_with_a_malformed_status_is_invalid_so_the_planner_allocates_afresh() {
    let bad = tunnel(
        &TUNNEL
            .replace("66:0a", "66:0A")
            .replace("0x01000000", "16777216")
            .replace("PHASE", "Ready"),
    );
    let snapshot = SnapshotBuilder::new(Config::default())
        .tunnels([bad])
        .build();
    assert!(snapshot.tunnels.is_empty());
    assert_eq!(
        snapshot.invalid[0].errors,
        vec![
            r#"status.tunnel.mac: "66:0A:1b:2c:3d:4e" is not a MAC address in aa:bb:cc:dd:ee:ff form"#,
            r#"status.mark: "16777216" is not a mark (0x and up to 8 lowercase hex digits)"#,
        ]
    );
}

#[test]
fn a_node_whose_agent_failed_or_timed_out_is_not_ready_but_one_initialising_is() {
    for (phase, ready) in [
        ("Ready", true),
        ("Init", true),
        ("Pending", true),
        ("Failed", false),
        ("HeartbeatTimeout", false),
    ] {
        let snapshot = SnapshotBuilder::new(Config::default())
            .tunnels([tunnel(&TUNNEL.replace("PHASE", phase))])
            .nodes([node(READY_NODE)])
            .build();
        assert_eq!(snapshot.nodes[0].ready, ready, "{phase}");
    }
}

#[test]
fn with_agents_required_only_a_node_whose_agent_reports_ready_is_ready() {
    for (phase, ready) in [
        (Some("Ready"), true),
        (Some("Init"), false),
        (Some("Pending"), false),
        (Some("HeartbeatTimeout"), false),
        (None, false),
    ] {
        let tunnels: Vec<_> = phase
            .map(|p| tunnel(&TUNNEL.replace("PHASE", p)))
            .into_iter()
            .collect();
        let snapshot = SnapshotBuilder::new(Config::default())
            .agents_required()
            .tunnels(tunnels)
            .nodes([node(READY_NODE)])
            .build();
        assert_eq!(snapshot.nodes[0].ready, ready, "{phase:?}");
    }
}

#[test]
fn with_agents_required_a_node_that_is_not_ready_stays_not_ready_whatever_its_agent_says() {
    let snapshot = SnapshotBuilder::new(Config::default())
        .agents_required()
        .tunnels([tunnel(&TUNNEL.replace("PHASE", "Ready"))])
        .nodes([node(&READY_NODE.replace("\"True\"", "\"False\""))])
        .build();
    assert!(!snapshot.nodes[0].ready);
}

#[test]
fn the_builder_takes_objects_in_any_form_and_keeps_the_config() {
    let config = Config {
        enable_ipv6: true,
        ..Config::default()
    };
    let nodes = vec![node(READY_NODE)];
    let shared: Vec<std::sync::Arc<Node>> =
        nodes.iter().cloned().map(std::sync::Arc::new).collect();
    let snapshot = SnapshotBuilder::new(config.clone())
        .nodes(&nodes)
        .nodes(shared)
        .pods(Vec::<Pod>::new())
        .build();
    assert_eq!(snapshot.config, config);
    assert_eq!(snapshot.nodes.len(), 2);
}

/// The tunnel of `node` in `phase`, reporting that it holds 198.51.100.7
/// since `since`.
fn holding(node: &str, phase: &str, since: &str) -> egressgw_api::EgressTunnel {
    tunnel(&format!(
        "{}  eips: [{{ip: 198.51.100.7, state: Held, since: \"{since}\"}}]\n",
        TUNNEL.replace("n1", node).replace("PHASE", phase)
    ))
}

fn holder_of_the_eip(tunnels: Vec<egressgw_api::EgressTunnel>) -> Vec<String> {
    let nodes = ["n1", "n2"].map(|n| node(&READY_NODE.replace("n1", n)));
    let snapshot = SnapshotBuilder::new(Config::default())
        .tunnels(tunnels)
        .nodes(nodes)
        .build();
    snapshot
        .nodes
        .iter()
        .filter(|n| n.held_eips.contains(&ip("198.51.100.7")))
        .map(|n| n.name.clone())
        .collect()
}

#[test]
fn of_two_nodes_reporting_an_eip_the_one_that_took_it_last_holds_it() {
    // An old holder cut off from the API server still reports the EIP it
    // gave up; the node that took it over reports a later moment, within
    // the same second.
    let old = holding("n1", "Ready", "2026-11-24T02:23:09.425000Z");
    let new = holding("n2", "Ready", "2026-11-24T02:23:09.965000Z");
    assert_eq!(holder_of_the_eip(vec![old.clone(), new.clone()]), ["n2"]);
    assert_eq!(holder_of_the_eip(vec![new, old]), ["n2"]);
    // Statuses written before the microseconds: the same moment. The node
    // whose agent still reports wins over one that timed out.
    let stale = holding("n1", "HeartbeatTimeout", "2026-11-24T02:23:09Z");
    let live = holding("n2", "Ready", "2026-11-24T02:23:09Z");
    assert_eq!(holder_of_the_eip(vec![stale.clone(), live.clone()]), ["n2"]);
    assert_eq!(holder_of_the_eip(vec![live, stale]), ["n2"]);
}

#[test]
fn a_reported_eip_keeps_its_moment_to_the_microsecond() {
    let since: k8s_openapi::jiff::Timestamp = "2026-11-24T02:23:09.965123Z".parse().unwrap();
    let eip = egressgw_api::TunnelEip {
        ip: "198.51.100.7".into(),
        state: egressgw_api::TunnelEipState::Held,
        since: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
            since,
        )),
        message: None,
    };
    let json = serde_json::to_value(&eip).unwrap();
    assert_eq!(json["since"], "2026-11-24T02:23:09.965123Z");
    let back: egressgw_api::TunnelEip = serde_json::from_value(json).unwrap();
    assert_eq!(back, eip);
}

//! The planner's status output into the CRDs' status types.

use egressgw_api::gateway::{GatewayEip, NodeReadiness, PolicyReference};
use egressgw_api::status::{conditions, gateway_status, policy_status, tunnel_status};
use egressgw_api::tunnel::TunnelPhase;
use egressgw_core::model::{Mac, PolicyRef};
use egressgw_core::status::{
    Condition, ConditionType, EipStatus, GatewayNodeStatus, GatewayStatus, IpUsage, PolicyStatus,
    Reason, TunnelAllocation,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

fn at(seconds: i64) -> Timestamp {
    Timestamp::from_second(seconds).expect("a valid timestamp")
}

fn ready(status: bool, reason: Reason) -> Condition {
    Condition {
        type_: ConditionType::Ready,
        status,
        reason,
        message: format!("{reason}"),
    }
}

fn allocated() -> Condition {
    Condition {
        type_: ConditionType::Allocated,
        status: true,
        reason: Reason::Allocated,
        message: "allocated".into(),
    }
}

fn policy(conditions: Vec<Condition>) -> PolicyStatus {
    PolicyStatus {
        policy: PolicyRef::namespaced("shop", "p1"),
        eip_ipv4: Some("10.6.1.5".parse().expect("an IPv4 address")),
        eip_ipv6: None,
        use_node_ip: false,
        node: Some("n1".into()),
        pods: 3,
        conditions,
    }
}

#[test]
fn conditions_read_true_or_false_with_reason_message_and_generation() {
    let converted = conditions(
        &[allocated(), ready(false, Reason::NoReadyNode)],
        &[],
        Some(4),
        at(100),
    );
    assert_eq!(converted.len(), 2);
    assert_eq!(
        (
            converted[0].type_.as_str(),
            converted[0].status.as_str(),
            converted[0].reason.as_str()
        ),
        ("Allocated", "True", "Allocated")
    );
    assert_eq!(
        (
            converted[1].type_.as_str(),
            converted[1].status.as_str(),
            converted[1].reason.as_str()
        ),
        ("Ready", "False", "NoReadyNode")
    );
    assert_eq!(converted[1].observed_generation, Some(4));
    assert_eq!(converted[1].last_transition_time, Time(at(100)));
}

#[test]
fn an_unchanged_condition_keeps_its_transition_time_and_a_flipped_one_gets_now() {
    let first = conditions(
        &[allocated(), ready(false, Reason::NoReadyNode)],
        &[],
        Some(1),
        at(100),
    );
    let second = conditions(
        &[allocated(), ready(true, Reason::Active)],
        &first,
        Some(2),
        at(200),
    );
    assert_eq!(
        second[0].last_transition_time,
        Time(at(100)),
        "Allocated stayed True"
    );
    assert_eq!(
        second[1].last_transition_time,
        Time(at(200)),
        "Ready flipped"
    );
    assert_eq!(second[0].observed_generation, Some(2));
}

#[test]
fn a_policy_status_carries_eips_node_and_conditions() {
    let status = policy_status(
        &policy(vec![ready(true, Reason::Active)]),
        None,
        Some(1),
        at(5),
    );
    let eip = status.eip.unwrap();
    assert_eq!(
        (eip.ipv4.as_deref(), eip.ipv6.as_deref()),
        (Some("10.6.1.5"), None)
    );
    assert_eq!(status.node.as_deref(), Some("n1"));
    assert_eq!(status.conditions[0].status, "True");
}

#[test]
fn rewriting_the_same_policy_status_later_changes_nothing() {
    let input = policy(vec![allocated(), ready(true, Reason::Active)]);
    let first = policy_status(&input, None, Some(1), at(5));
    let again = policy_status(&input, Some(&first), Some(1), at(500));
    assert_eq!(first, again);
}

#[test]
fn a_policy_without_eips_has_no_eip_in_its_status() {
    let mut input = policy(vec![]);
    input.eip_ipv4 = None;
    assert_eq!(policy_status(&input, None, None, at(5)).eip, None);
}

#[test]
fn a_gateway_status_pairs_the_eips_the_same_policies_use_and_counts_nodes() {
    let p1 = PolicyRef::namespaced("shop", "p1");
    let cp = PolicyRef::cluster("cp1");
    let status = GatewayStatus {
        gateway: "gw1".into(),
        nodes: vec![
            GatewayNodeStatus {
                name: "n1".into(),
                ready: true,
                eips: vec![
                    EipStatus {
                        ip: Some("10.6.1.5".parse().unwrap()),
                        policies: vec![p1.clone()],
                        standbys: vec!["n2".into()],
                    },
                    EipStatus {
                        ip: Some("10.6.1.6".parse().unwrap()),
                        policies: vec![cp.clone()],
                        standbys: vec!["n2".into()],
                    },
                    EipStatus {
                        ip: Some("fd00::5".parse().unwrap()),
                        policies: vec![p1.clone()],
                        standbys: vec!["n2".into()],
                    },
                    EipStatus {
                        ip: None,
                        policies: vec![cp.clone()],
                        standbys: vec![],
                    },
                ],
            },
            GatewayNodeStatus {
                name: "n2".into(),
                ready: false,
                eips: vec![],
            },
        ],
        ip_usage: IpUsage {
            ipv4_total: 9,
            ipv4_free: 7,
            ipv6_total: u64::MAX,
            ipv6_free: 5,
        },
        conditions: vec![ready(true, Reason::Active)],
    };
    let converted = gateway_status(&status, None, Some(3), at(9));
    assert_eq!((converted.selected_nodes, converted.ready_nodes), (2, 1));
    assert_eq!(converted.node_list[0].status, NodeReadiness::Ready);
    assert_eq!(converted.node_list[1].status, NodeReadiness::NotReady);
    let p1_ref = PolicyReference {
        name: "p1".into(),
        namespace: Some("shop".into()),
    };
    let cp_ref = PolicyReference {
        name: "cp1".into(),
        namespace: None,
    };
    assert_eq!(
        converted.node_list[0].eips,
        vec![
            GatewayEip {
                ipv4: Some("10.6.1.5".into()),
                ipv6: Some("fd00::5".into()),
                policies: vec![p1_ref],
                standbys: vec!["n2".into()],
            },
            GatewayEip {
                ipv4: Some("10.6.1.6".into()),
                ipv6: None,
                policies: vec![cp_ref.clone()],
                standbys: vec!["n2".into()],
            },
            GatewayEip {
                ipv4: None,
                ipv6: None,
                policies: vec![cp_ref],
                standbys: vec![],
            },
        ]
    );
    let usage = converted.ip_usage.unwrap();
    assert_eq!((usage.ipv4_total, usage.ipv4_free), (9, 7));
    assert_eq!(
        usage.ipv6_total,
        (1 << 53) - 1,
        "huge IPv6 pools saturate at the CRD's bound"
    );
}

#[test]
fn the_previous_nodes_of_a_written_gateway_status_read_back() {
    let status = GatewayStatus {
        gateway: "gw1".into(),
        nodes: vec![GatewayNodeStatus {
            name: "n1".into(),
            ready: true,
            eips: vec![EipStatus {
                ip: Some("10.6.1.5".parse().unwrap()),
                policies: vec![],
                standbys: vec![],
            }],
        }],
        ip_usage: IpUsage::default(),
        conditions: vec![],
    };
    let mut object = egressgw_api::EgressGateway::new("gw1", Default::default());
    object.status = Some(gateway_status(&status, None, None, at(1)));
    assert_eq!(
        object.previous_nodes(),
        [("10.6.1.5".parse().unwrap(), "n1".to_owned())].into()
    );
}

#[test]
fn a_tunnel_status_holds_the_controllers_fields_only() {
    let allocation = TunnelAllocation {
        node: "n1".into(),
        ipv4: Some("172.31.0.1".parse().unwrap()),
        ipv6: None,
        mac: "66:0a:1b:2c:3d:4e".parse::<Mac>().unwrap(),
        mark: Some(0x0200_0000),
        underlay: Some("192.168.1.11".parse().unwrap()),
    };
    let status = tunnel_status(&allocation);
    let tunnel = status.tunnel.unwrap();
    assert_eq!(tunnel.ipv4.as_deref(), Some("172.31.0.1"));
    assert_eq!(tunnel.mac.as_deref(), Some("66:0a:1b:2c:3d:4e"));
    assert_eq!(tunnel.parent, None, "the parent is the agent's to report");
    assert_eq!(status.mark.as_deref(), Some("0x02000000"));
    assert_eq!(status.phase, None::<TunnelPhase>);
    let json = serde_json::to_value(tunnel_status(&allocation)).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"tunnel": {"ipv4": "172.31.0.1", "mac": "66:0a:1b:2c:3d:4e"}, "mark": "0x02000000"})
    );
}

//! The benches' synthetic cluster as the Kubernetes objects a user would
//! have: Namespaces, Nodes, Pods, EgressGateways, EgressPolicies and
//! EgressClusterPolicies, each with the status its controller would write
//! (a Node's addresses and readiness, a Pod's phase and addresses).
//!
//! The Nodes are objects only: no kubelet runs them, no agent runs on them.
//! They carry no `kubernetes.io/os` label, which the chart's DaemonSet and
//! Deployment select, and no capacity, so nothing is placed on them. Their
//! Pods run the lab's pod image, which the kubelet stand-in leaves alone;
//! unscheduled Pods name a scheduler that does not exist, so they stay
//! pending as the synthetic cluster has them.

use std::collections::BTreeMap;
use std::net::IpAddr;

use egressgw_api::gateway::{EgressGateway, EgressGatewaySpec, Ippools, NodeSelector};
use egressgw_api::policy::{
    AllocatorPolicy, AppliedTo, ClusterAppliedTo, EgressClusterPolicy, EgressClusterPolicySpec,
    EgressIp, EgressPolicy, EgressPolicySpec,
};
use egressgw_core::Snapshot;
use egressgw_core::model::{self, Allocator, PodMatch};
use egressgw_core::net::IpPool;
use egressgw_core::selector::{self, Requirement};
use k8s_openapi::api::core::v1::{
    Container, Namespace, Node, NodeAddress, NodeCondition, NodeSpec, NodeStatus, Pod, PodIP,
    PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};

use crate::lab::kubelet::LAB_POD_IMAGE;

/// The label the chart's agents and controller select nodes by; the
/// synthetic nodes go without it.
pub const OS_LABEL: &str = "kubernetes.io/os";

/// The scheduler unscheduled synthetic Pods wait for: there is none.
pub const NO_SCHEDULER: &str = "egressgw-scale-unscheduled";

/// The synthetic cluster's objects, in the order they are created.
#[derive(Debug, Default)]
pub struct Objects {
    pub namespaces: Vec<Namespace>,
    pub nodes: Vec<Node>,
    pub gateways: Vec<EgressGateway>,
    pub policies: Vec<EgressPolicy>,
    pub cluster_policies: Vec<EgressClusterPolicy>,
    pub pods: Vec<Pod>,
}

impl Objects {
    pub fn of(snapshot: &Snapshot) -> Self {
        Self {
            namespaces: snapshot.namespaces.iter().map(namespace).collect(),
            nodes: snapshot.nodes.iter().map(node).collect(),
            gateways: snapshot.gateways.iter().map(gateway).collect(),
            policies: snapshot
                .policies
                .iter()
                .filter(|p| p.id.namespace.is_some())
                .map(|p| policy(p))
                .collect(),
            cluster_policies: snapshot
                .policies
                .iter()
                .filter(|p| p.id.namespace.is_none())
                .map(|p| cluster_policy(p))
                .collect(),
            pods: snapshot.pods.iter().map(pod).collect(),
        }
    }
}

fn meta(name: &str, namespace: Option<&str>, labels: &model::Labels) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        labels: (!labels.is_empty()).then(|| labels.to_map()),
        ..ObjectMeta::default()
    }
}

fn namespace(ns: &model::Namespace) -> Namespace {
    Namespace {
        metadata: meta(&ns.name, None, &ns.labels),
        ..Namespace::default()
    }
}

fn node(node: &model::Node) -> Node {
    let mut labels = node.labels.clone();
    labels.remove(OS_LABEL);
    let address = |kind: &str, ip: &IpAddr| NodeAddress {
        type_: kind.to_owned(),
        address: ip.to_string(),
    };
    let addresses = node
        .addresses
        .iter()
        .map(|ip| address("InternalIP", ip))
        .chain(
            node.external_addresses
                .iter()
                .map(|ip| address("ExternalIP", ip)),
        )
        .collect();
    let cidrs: Vec<String> = node.pod_cidrs.iter().map(ToString::to_string).collect();
    Node {
        metadata: meta(&node.name, None, &labels),
        spec: Some(NodeSpec {
            pod_cidr: cidrs.first().cloned(),
            pod_cidrs: Some(cidrs),
            ..NodeSpec::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(addresses),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: if node.ready { "True" } else { "False" }.into(),
                reason: Some(
                    if node.ready {
                        "Synthetic"
                    } else {
                        "SyntheticNotReady"
                    }
                    .into(),
                ),
                ..NodeCondition::default()
            }]),
            ..NodeStatus::default()
        }),
    }
}

fn pod(pod: &model::Pod) -> Pod {
    let ips: Vec<PodIP> = pod
        .ips
        .iter()
        .map(|ip| PodIP { ip: ip.to_string() })
        .collect();
    let scheduled = pod.node.is_some();
    Pod {
        metadata: meta(&pod.name, Some(&pod.namespace), &pod.labels),
        spec: Some(PodSpec {
            node_name: pod.node.clone(),
            scheduler_name: (!scheduled).then(|| NO_SCHEDULER.to_owned()),
            host_network: pod.host_network.then_some(true),
            automount_service_account_token: Some(false),
            termination_grace_period_seconds: Some(0),
            containers: vec![Container {
                name: "main".into(),
                image: Some(LAB_POD_IMAGE.into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some(if scheduled { "Running" } else { "Pending" }.into()),
            pod_ip: ips.first().map(|ip| ip.ip.clone()),
            pod_ips: (!ips.is_empty()).then_some(ips),
            ..PodStatus::default()
        }),
    }
}

fn selector(s: &selector::LabelSelector) -> LabelSelector {
    let expression = |r: &Requirement| {
        let (key, operator, values) = match r {
            Requirement::In(k, vs) => (k, "In", Some(vs.iter().cloned().collect())),
            Requirement::NotIn(k, vs) => (k, "NotIn", Some(vs.iter().cloned().collect())),
            Requirement::Exists(k) => (k, "Exists", None),
            Requirement::DoesNotExist(k) => (k, "DoesNotExist", None),
        };
        LabelSelectorRequirement {
            key: key.clone(),
            operator: operator.to_owned(),
            values,
        }
    };
    LabelSelector {
        match_labels: (!s.match_labels.is_empty()).then(|| s.match_labels.to_map()),
        match_expressions: (!s.match_expressions.is_empty())
            .then(|| s.match_expressions.iter().map(expression).collect()),
    }
}

/// A pool as `spec.ippools` lists it: `first-last`, or one address.
fn pool(pool: &IpPool) -> Vec<String> {
    pool.ranges()
        .iter()
        .map(|r| {
            if r.first() == r.last() {
                r.first().to_string()
            } else {
                format!("{}-{}", r.first(), r.last())
            }
        })
        .collect()
}

fn gateway(g: &model::Gateway) -> EgressGateway {
    EgressGateway::new(
        &g.name,
        EgressGatewaySpec {
            node_selector: NodeSelector {
                selector: selector(&g.node_selector),
            },
            ippools: Ippools {
                ipv4: pool(&g.ipv4_pool),
                ipv6: pool(&g.ipv6_pool),
                ipv4_default_eip: g.ipv4_default.map(|ip| ip.to_string()),
                ipv6_default_eip: g.ipv6_default.map(|ip| ip.to_string()),
            },
            cluster_default: g.cluster_default,
            fail_closed: g.fail_closed,
            namespace_selector: g.namespace_selector.as_ref().map(selector),
        },
    )
}

fn egress_ip(spec: &model::EgressIpSpec) -> EgressIp {
    EgressIp {
        ipv4: spec.ipv4.map(|ip| ip.to_string()),
        ipv6: spec.ipv6.map(|ip| ip.to_string()),
        use_node_ip: spec.use_node_ip,
        allocator_policy: match spec.allocator {
            Allocator::Default => AllocatorPolicy::Default,
            Allocator::RoundRobin => AllocatorPolicy::RoundRobin,
        },
    }
}

fn strings<T: ToString>(items: &[T]) -> Vec<String> {
    items.iter().map(ToString::to_string).collect()
}

/// `appliedTo`'s two ways: a selector, or subnets.
fn applied(pods: &PodMatch) -> (Option<LabelSelector>, Option<Vec<String>>) {
    match pods {
        PodMatch::Selector(s) => (Some(selector(s)), None),
        PodMatch::Subnets(nets) => (None, Some(strings(nets))),
    }
}

fn policy(p: &model::Policy) -> EgressPolicy {
    let (pod_selector, pod_subnet) = applied(&p.pods);
    let mut policy = EgressPolicy::new(
        &p.id.name,
        EgressPolicySpec {
            egress_gateway_name: p.gateway.clone(),
            egress_ip: egress_ip(&p.egress_ip),
            applied_to: AppliedTo {
                pod_selector,
                pod_subnet,
            },
            dest_subnet: strings(&p.dest_subnets),
            exclude_subnet: strings(&p.exclude_subnets),
            priority: p.priority,
        },
    );
    policy.metadata.namespace = p.id.namespace.clone();
    policy
}

fn cluster_policy(p: &model::Policy) -> EgressClusterPolicy {
    let (pod_selector, pod_subnet) = applied(&p.pods);
    EgressClusterPolicy::new(
        &p.id.name,
        EgressClusterPolicySpec {
            egress_gateway_name: p.gateway.clone(),
            egress_ip: egress_ip(&p.egress_ip),
            applied_to: ClusterAppliedTo {
                pod_selector,
                pod_subnet,
                namespace_selector: p.namespace_selector.as_ref().map(selector),
            },
            dest_subnet: strings(&p.dest_subnets),
            exclude_subnet: strings(&p.exclude_subnets),
            priority: p.priority,
        },
    )
}

/// How many objects of each kind, for the report.
pub fn counts(objects: &Objects) -> BTreeMap<&'static str, usize> {
    BTreeMap::from([
        ("Namespace", objects.namespaces.len()),
        ("Node", objects.nodes.len()),
        ("Pod", objects.pods.len()),
        ("EgressGateway", objects.gateways.len()),
        ("EgressPolicy", objects.policies.len()),
        ("EgressClusterPolicy", objects.cluster_policies.len()),
    ])
}

#[cfg(test)]
mod tests {
    use egressgw_api::snapshot::SnapshotBuilder;
    use egressgw_core::model::{Age, Config};

    use super::*;

    /// The objects, read back as the controller reads them, are the
    /// synthetic cluster: what the scale test loads is what the benches
    /// plan.
    #[test]
    fn the_objects_read_back_are_the_synthetic_cluster() {
        let synthetic = egressgw_benches::synthetic_cluster(10, 100, 1_000);
        let objects = Objects::of(&synthetic);
        let read = SnapshotBuilder::new(Config::default())
            .namespaces(&objects.namespaces)
            .nodes(&objects.nodes)
            .pods(&objects.pods)
            .gateways(&objects.gateways)
            .policies(&objects.policies)
            .cluster_policies(&objects.cluster_policies)
            .build();
        assert!(read.invalid.is_empty(), "invalid: {:?}", read.invalid);

        let mut expected = synthetic.clone();
        for node in &mut expected.nodes {
            node.labels.remove(OS_LABEL);
        }
        // Creation order is the API server's to give.
        for g in &mut expected.gateways {
            g.age = Age::default();
        }
        for p in expected.policies_mut() {
            p.age = Age::default();
        }
        let mut read = read;
        for g in &mut read.gateways {
            g.age = Age::default();
        }
        for p in read.policies_mut() {
            p.age = Age::default();
        }
        let by_id = |s: &Snapshot| {
            let mut p = s.policies.clone();
            p.sort_by(|a, b| a.id.cmp(&b.id));
            p
        };
        assert_eq!(read.namespaces, expected.namespaces);
        assert_eq!(read.nodes, expected.nodes);
        assert_eq!(read.pods, expected.pods);
        assert_eq!(read.gateways, expected.gateways);
        assert_eq!(by_id(&read), by_id(&expected));
        // Every kind of object is there, and the pending and host-network
        // Pods too.
        assert!(!objects.cluster_policies.is_empty() && !objects.policies.is_empty());
        assert!(synthetic.pods.iter().any(|p| p.node.is_none()));
        assert!(synthetic.pods.iter().any(|p| p.host_network));
    }
}

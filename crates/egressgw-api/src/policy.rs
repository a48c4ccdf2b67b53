//! `EgressPolicy` (namespaced) and `EgressClusterPolicy` (cluster-wide):
//! which pods leave through which gateway with which EIP.

use std::net::IpAddr;

use egressgw_core::model::{self, Allocator, EgressIpSpec, PodMatch, PolicyRef};
use egressgw_core::net::Family;
use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ObjectMeta};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::schema;
use crate::selector;
use crate::snapshot::{age, object_name};
use crate::validation::{self, FieldPath, ValidationErrors, as_v4, as_v6, non_empty};

/// Spec of an `EgressPolicy` (namespaced, short name `egp`): pods of its
/// namespace that leave the cluster through a gateway with a fixed EIP.
#[expect(
    clippy::duplicated_attributes,
    reason = "printcolumn entries repeat keys such as type_ by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "egressgw.io",
    version = "v1alpha1",
    kind = "EgressPolicy",
    plural = "egresspolicies",
    namespaced,
    shortname = "egp",
    category = "egressgw",
    status = "EgressPolicyStatus",
    derive = "PartialEq",
    doc = "Pods of one namespace that leave the cluster through an EgressGateway with a fixed egress IP.",
    printcolumn(
        name = "Gateway",
        type_ = "string",
        json_path = ".spec.egressGatewayName",
        description = "The gateway; empty means the cluster default"
    ),
    printcolumn(
        name = "IPv4 EIP",
        type_ = "string",
        json_path = ".status.eip.ipv4",
        description = "Allocated IPv4 egress IP"
    ),
    printcolumn(
        name = "IPv6 EIP",
        type_ = "string",
        json_path = ".status.eip.ipv6",
        description = "Allocated IPv6 egress IP"
    ),
    printcolumn(
        name = "Node",
        type_ = "string",
        json_path = ".status.node",
        description = "The active gateway node"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].status"#,
        description = "Status of the Ready condition"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].reason"#,
        description = "Reason of the Ready condition",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::policy_spec)]
pub struct EgressPolicySpec {
    /// The `EgressGateway` to leave through; unset or `""` means the cluster
    /// default gateway. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::object_name)]
    pub egress_gateway_name: Option<String>,
    /// Which EIP to leave with. Immutable.
    #[serde(default, rename = "egressIP")]
    pub egress_ip: EgressIp,
    /// Which pods of the namespace the policy applies to.
    pub applied_to: AppliedTo,
    /// Destinations the policy covers; empty means every destination outside
    /// the cluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::cidr_list("spec.destSubnet"))]
    pub dest_subnet: Vec<String>,
    /// Destinations taken out of `destSubnet`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::cidr_list("spec.excludeSubnet"))]
    pub exclude_subnet: Vec<String>,
    /// When several policies cover a pod and an equally specific
    /// destination, the higher priority wins. Any `int32`.
    #[serde(default)]
    #[schemars(transform = schema::int_range(schema::PRIORITY))]
    pub priority: i32,
}

/// Spec of an `EgressClusterPolicy` (cluster-scoped, short name `egcp`):
/// like an `EgressPolicy`, for pods of every namespace the namespace
/// selector matches.
#[expect(
    clippy::duplicated_attributes,
    reason = "printcolumn entries repeat keys such as type_ by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "egressgw.io",
    version = "v1alpha1",
    kind = "EgressClusterPolicy",
    plural = "egressclusterpolicies",
    shortname = "egcp",
    category = "egressgw",
    status = "EgressPolicyStatus",
    derive = "PartialEq",
    doc = "Pods of any namespace that leave the cluster through an EgressGateway with a fixed egress IP.",
    printcolumn(
        name = "Gateway",
        type_ = "string",
        json_path = ".spec.egressGatewayName",
        description = "The gateway; empty means the cluster default"
    ),
    printcolumn(
        name = "IPv4 EIP",
        type_ = "string",
        json_path = ".status.eip.ipv4",
        description = "Allocated IPv4 egress IP"
    ),
    printcolumn(
        name = "IPv6 EIP",
        type_ = "string",
        json_path = ".status.eip.ipv6",
        description = "Allocated IPv6 egress IP"
    ),
    printcolumn(
        name = "Node",
        type_ = "string",
        json_path = ".status.node",
        description = "The active gateway node"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].status"#,
        description = "Status of the Ready condition"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].reason"#,
        description = "Reason of the Ready condition",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::policy_spec)]
pub struct EgressClusterPolicySpec {
    /// The `EgressGateway` to leave through; unset or `""` means the cluster
    /// default gateway. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::object_name)]
    pub egress_gateway_name: Option<String>,
    /// Which EIP to leave with. Immutable.
    #[serde(default, rename = "egressIP")]
    pub egress_ip: EgressIp,
    /// Which pods, in which namespaces, the policy applies to.
    pub applied_to: ClusterAppliedTo,
    /// Destinations the policy covers; empty means every destination outside
    /// the cluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::cidr_list("spec.destSubnet"))]
    pub dest_subnet: Vec<String>,
    /// Destinations taken out of `destSubnet`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::cidr_list("spec.excludeSubnet"))]
    pub exclude_subnet: Vec<String>,
    /// When several policies cover a pod and an equally specific
    /// destination, the higher priority wins. Any `int32`.
    #[serde(default)]
    #[schemars(transform = schema::int_range(schema::PRIORITY))]
    pub priority: i32,
}

/// `spec.egressIP`: a pinned EIP per family, the node's own address, or an
/// EIP the allocator picks.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::egress_ip)]
pub struct EgressIp {
    /// A pinned IPv4 EIP from the gateway's pool; unset or `""` lets the
    /// allocator choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::ip_field(Family::Ipv4, "spec.egressIP.ipv4"))]
    pub ipv4: Option<String>,
    /// A pinned IPv6 EIP from the gateway's pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::ip_field(Family::Ipv6, "spec.egressIP.ipv6"))]
    pub ipv6: Option<String>,
    /// Leave with the gateway node's own address instead of an EIP.
    #[serde(default, rename = "useNodeIP")]
    pub use_node_ip: bool,
    /// How an unpinned EIP is chosen.
    #[serde(default)]
    pub allocator_policy: AllocatorPolicy,
}

/// `spec.egressIP.allocatorPolicy`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum AllocatorPolicy {
    /// Share the gateway's default EIP.
    #[default]
    #[serde(rename = "default")]
    Default,
    /// Take an EIP of its own: the first pool address no other policy holds.
    #[serde(rename = "rr")]
    RoundRobin,
}

/// `spec.appliedTo` of an `EgressPolicy`: exactly one of `podSelector` and
/// `podSubnet`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::applied_to)]
pub struct AppliedTo {
    /// Pods of the namespace whose labels match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::label_selector("spec.appliedTo.podSelector"))]
    pub pod_selector: Option<LabelSelector>,
    /// Pods whose IP lies in one of these prefixes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::pod_subnet("spec.appliedTo.podSubnet"))]
    pub pod_subnet: Option<Vec<String>>,
}

/// `spec.appliedTo` of an `EgressClusterPolicy`: exactly one of
/// `podSelector` and `podSubnet`, and which namespaces.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::applied_to)]
pub struct ClusterAppliedTo {
    /// Pods whose labels match, in the namespaces `namespaceSelector` matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::label_selector("spec.appliedTo.podSelector"))]
    pub pod_selector: Option<LabelSelector>,
    /// Pods whose IP lies in one of these prefixes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::pod_subnet("spec.appliedTo.podSubnet"))]
    pub pod_subnet: Option<Vec<String>>,
    /// Namespaces whose pods `podSelector` looks at; unset means all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::label_selector("spec.appliedTo.namespaceSelector"))]
    pub namespace_selector: Option<LabelSelector>,
}

/// Status of an `EgressPolicy` or `EgressClusterPolicy`, written by the
/// controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressPolicyStatus {
    /// The allocated EIPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eip: Option<PolicyEip>,
    /// The active gateway node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// `Allocated` (EIPs and gateway node chosen) and `Ready` (traffic
    /// leaves as the policy says).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::conditions)]
    pub conditions: Vec<Condition>,
}

/// `status.eip`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyEip {
    /// IPv4 EIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<String>,
    /// IPv6 EIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<String>,
}

/// The fields both policy kinds share, borrowed.
struct SpecView<'a> {
    egress_gateway_name: Option<&'a String>,
    egress_ip: &'a EgressIp,
    pod_selector: Option<&'a LabelSelector>,
    pod_subnet: Option<&'a Vec<String>>,
    namespace_selector: Option<&'a LabelSelector>,
    dest_subnet: &'a [String],
    exclude_subnet: &'a [String],
    priority: i32,
}

/// A validated policy spec in the planner's terms.
struct PolicyParts {
    gateway: Option<String>,
    egress_ip: EgressIpSpec,
    pods: PodMatch,
    namespace_selector: Option<egressgw_core::selector::LabelSelector>,
    dest_subnets: Vec<IpNet>,
    exclude_subnets: Vec<IpNet>,
    priority: i32,
}

impl EgressPolicySpec {
    /// Checks the spec the way admission does; returns every problem, each
    /// named by its field path.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errors = ValidationErrors::new();
        parts(&self.view(), &mut errors);
        errors.into_result()
    }

    fn view(&self) -> SpecView<'_> {
        SpecView {
            egress_gateway_name: self.egress_gateway_name.as_ref(),
            egress_ip: &self.egress_ip,
            pod_selector: self.applied_to.pod_selector.as_ref(),
            pod_subnet: self.applied_to.pod_subnet.as_ref(),
            namespace_selector: None,
            dest_subnet: &self.dest_subnet,
            exclude_subnet: &self.exclude_subnet,
            priority: self.priority,
        }
    }
}

impl EgressClusterPolicySpec {
    /// Checks the spec the way admission does; returns every problem, each
    /// named by its field path.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errors = ValidationErrors::new();
        parts(&self.view(), &mut errors);
        errors.into_result()
    }

    fn view(&self) -> SpecView<'_> {
        SpecView {
            egress_gateway_name: self.egress_gateway_name.as_ref(),
            egress_ip: &self.egress_ip,
            pod_selector: self.applied_to.pod_selector.as_ref(),
            pod_subnet: self.applied_to.pod_subnet.as_ref(),
            namespace_selector: self.applied_to.namespace_selector.as_ref(),
            dest_subnet: &self.dest_subnet,
            exclude_subnet: &self.exclude_subnet,
            priority: self.priority,
        }
    }
}

impl EgressPolicy {
    /// The policy in the planner's terms, or every problem with it.
    pub fn to_model(&self) -> Result<model::Policy, ValidationErrors> {
        let mut errors = ValidationErrors::new();
        let name = object_name(&self.metadata, &mut errors);
        let namespace = self.metadata.namespace.clone().unwrap_or_default();
        if namespace.is_empty() {
            errors.push("metadata.namespace", "must be set");
        }
        let parts = parts(&self.spec.view(), &mut errors);
        errors.into_result().map(|()| {
            let id = PolicyRef::namespaced(namespace, name);
            policy(id, parts, &self.metadata, self.status.as_ref())
        })
    }
}

impl EgressClusterPolicy {
    /// The policy in the planner's terms, or every problem with it. A policy
    /// without `namespaceSelector` applies in every namespace.
    pub fn to_model(&self) -> Result<model::Policy, ValidationErrors> {
        let mut errors = ValidationErrors::new();
        let name = object_name(&self.metadata, &mut errors);
        let parts = parts(&self.spec.view(), &mut errors);
        errors.into_result().map(|()| {
            let id = PolicyRef::cluster(name);
            policy(id, parts, &self.metadata, self.status.as_ref())
        })
    }
}

fn policy(
    id: PolicyRef,
    parts: PolicyParts,
    meta: &ObjectMeta,
    status: Option<&EgressPolicyStatus>,
) -> model::Policy {
    model::Policy {
        id,
        gateway: parts.gateway,
        egress_ip: parts.egress_ip,
        pods: parts.pods,
        namespace_selector: parts.namespace_selector,
        dest_subnets: parts.dest_subnets,
        exclude_subnets: parts.exclude_subnets,
        priority: parts.priority,
        age: age(meta),
        previous_eips: status.map(previous_eips).unwrap_or_default(),
        previous_node: status
            .and_then(|s| non_empty(s.node.as_ref()))
            .map(str::to_owned),
    }
}

/// The EIPs of the last status write. Values that do not parse are ignored:
/// the status is the controller's own record.
fn previous_eips(status: &EgressPolicyStatus) -> Vec<IpAddr> {
    status
        .eip
        .iter()
        .flat_map(|eip| [&eip.ipv4, &eip.ipv6])
        .flatten()
        .filter_map(|s| s.parse().ok())
        .collect()
}

fn parts(view: &SpecView<'_>, errors: &mut ValidationErrors) -> PolicyParts {
    let spec = FieldPath::root("spec");
    let egress_ip = egress_ip(view.egress_ip, &spec.field("egressIP"), errors);
    let applied_to = spec.field("appliedTo");
    let pods = pods(view, &applied_to, errors);
    let namespace_selector = view
        .namespace_selector
        .map(|s| selector::convert(s, &applied_to.field("namespaceSelector"), errors));
    PolicyParts {
        gateway: non_empty(view.egress_gateway_name).map(str::to_owned),
        egress_ip,
        pods,
        namespace_selector,
        dest_subnets: cidrs(view.dest_subnet, &spec.field("destSubnet"), errors),
        exclude_subnets: cidrs(view.exclude_subnet, &spec.field("excludeSubnet"), errors),
        priority: priority(view.priority, &spec.field("priority"), errors),
    }
}

/// `spec.priority` within [`schema::PRIORITY`]. With today's bounds (every
/// `int32`) a decoded spec always passes, and a larger number fails to
/// decode instead (the loader names it by the same bounds, see `strict`);
/// the check keeps `validate()` and the CRD on one constant.
fn priority(value: i32, path: &FieldPath, errors: &mut ValidationErrors) -> i32 {
    if !schema::PRIORITY.contains(f64::from(value)) {
        errors.push(path, schema::PRIORITY.out_of_range(value));
    }
    value
}

fn egress_ip(spec: &EgressIp, path: &FieldPath, errors: &mut ValidationErrors) -> EgressIpSpec {
    let mut pinned = |value: Option<&String>, family: Family, field: &str| {
        let s = non_empty(value)?;
        validation::ip_of(s, family)
            .map_err(|message| errors.push(path.field(field), message))
            .ok()
    };
    let ipv4 = pinned(spec.ipv4.as_ref(), Family::Ipv4, "ipv4");
    let ipv6 = pinned(spec.ipv6.as_ref(), Family::Ipv6, "ipv6");
    let pins_any =
        non_empty(spec.ipv4.as_ref()).is_some() || non_empty(spec.ipv6.as_ref()).is_some();
    if spec.use_node_ip && pins_any {
        errors.push(path, "useNodeIP cannot be combined with ipv4/ipv6");
    }
    EgressIpSpec {
        ipv4: ipv4.and_then(as_v4),
        ipv6: ipv6.and_then(as_v6),
        use_node_ip: spec.use_node_ip,
        allocator: match spec.allocator_policy {
            AllocatorPolicy::Default => Allocator::Default,
            AllocatorPolicy::RoundRobin => Allocator::RoundRobin,
        },
    }
}

fn pods(view: &SpecView<'_>, path: &FieldPath, errors: &mut ValidationErrors) -> PodMatch {
    match (view.pod_selector, view.pod_subnet) {
        (Some(sel), None) => {
            PodMatch::Selector(selector::convert(sel, &path.field("podSelector"), errors))
        }
        (None, Some(subnets)) => {
            let subnet_path = path.field("podSubnet");
            if subnets.is_empty() {
                errors.push(&subnet_path, "must list at least one CIDR");
            }
            PodMatch::Subnets(cidrs(subnets, &subnet_path, errors))
        }
        _ => {
            errors.push(path, "set exactly one of podSelector and podSubnet");
            PodMatch::Subnets(Vec::new())
        }
    }
}

fn cidrs(values: &[String], path: &FieldPath, errors: &mut ValidationErrors) -> Vec<IpNet> {
    values
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            validation::cidr(s)
                .map_err(|message| errors.push(path.index(i), message))
                .ok()
        })
        .collect()
}

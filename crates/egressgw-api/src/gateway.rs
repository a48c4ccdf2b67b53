//! `EgressGateway`: a group of nodes that carry egress traffic, and the EIP
//! pools they hand out.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egressgw_core::model;
use egressgw_core::net::{Family, IpPool};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::schema;
use crate::snapshot::{age, object_name};
use crate::validation::{self, FieldPath, ValidationErrors, as_v4, as_v6, non_empty};

/// Spec of an `EgressGateway` (cluster-scoped, short name `egw`): which
/// nodes may carry egress traffic, and the EIPs they SNAT to.
#[expect(
    clippy::duplicated_attributes,
    reason = "printcolumn entries repeat keys such as type_ by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "egressgw.io",
    version = "v1alpha1",
    kind = "EgressGateway",
    plural = "egressgateways",
    shortname = "egw",
    category = "egressgw",
    status = "EgressGatewayStatus",
    derive = "PartialEq",
    doc = "A group of nodes that carry egress traffic and the pools of egress IPs (EIPs) they SNAT to.",
    printcolumn(
        name = "Default",
        type_ = "boolean",
        json_path = ".spec.clusterDefault",
        description = "Whether policies that name no gateway use this one"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = r#".status.conditions[?(@.type=="Ready")].status"#,
        description = "Status of the Ready condition"
    ),
    printcolumn(
        name = "Ready Nodes",
        type_ = "integer",
        json_path = ".status.readyNodes",
        description = "Selected nodes that can carry traffic"
    ),
    printcolumn(
        name = "Nodes",
        type_ = "integer",
        json_path = ".status.selectedNodes",
        description = "Nodes the node selector matches"
    ),
    printcolumn(
        name = "Pods",
        type_ = "integer",
        json_path = ".status.pods.selected",
        description = "Pods whose traffic its nodes may carry",
        priority = 1
    ),
    printcolumn(
        name = "IPv4 Free",
        type_ = "integer",
        json_path = ".status.ipUsage.ipv4Free",
        description = "IPv4 EIPs no policy holds"
    ),
    printcolumn(
        name = "IPv4 Total",
        type_ = "integer",
        json_path = ".status.ipUsage.ipv4Total",
        description = "IPv4 EIPs in the pool"
    ),
    printcolumn(
        name = "IPv6 Free",
        type_ = "integer",
        json_path = ".status.ipUsage.ipv6Free",
        description = "IPv6 EIPs no policy holds",
        priority = 1
    ),
    printcolumn(
        name = "IPv6 Total",
        type_ = "integer",
        json_path = ".status.ipUsage.ipv6Total",
        description = "IPv6 EIPs in the pool",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EgressGatewaySpec {
    /// The nodes that may carry this gateway's traffic. Each EIP is active
    /// on one ready node among them at a time.
    pub node_selector: NodeSelector,
    /// The EIPs this gateway hands out.
    #[serde(default)]
    pub ippools: Ippools,
    /// Whether policies that name no gateway use this one. When several
    /// gateways claim it, the oldest wins and the others report it.
    #[serde(default)]
    pub cluster_default: bool,
    /// What happens to selected traffic while none of the gateway's nodes
    /// is live: `true` (the default) drops it, because a partner's
    /// allowlist should see the EIP or nothing; `false` lets it leave the
    /// normal way, with a node's own address, and says so in the policies'
    /// status.
    #[serde(default = "fail_closed_default")]
    pub fail_closed: bool,
    /// The namespaces whose EgressPolicies may use this gateway. Unset
    /// admits every namespace (what gateways did before the field
    /// existed); `{}` too. A policy of another namespace is refused with
    /// `NamespaceNotAllowed`. EgressClusterPolicies, which only cluster
    /// admins can write, are not restricted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = schema::label_selector("spec.namespaceSelector"))]
    pub namespace_selector: Option<LabelSelector>,
}

fn fail_closed_default() -> bool {
    true
}

/// `spec.nodeSelector`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSelector {
    /// Label selector of the nodes. The empty selector `{}` matches every node.
    #[schemars(transform = schema::label_selector("spec.nodeSelector.selector"))]
    pub selector: LabelSelector,
}

/// `spec.ippools`: per family, a list of single addresses (`10.0.0.5`),
/// inclusive ranges (`10.0.0.10-10.0.0.20`) and CIDRs (`10.0.1.0/28`, every
/// address of it, network and broadcast included).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = schema::ippools)]
pub struct Ippools {
    /// IPv4 EIPs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::pool(Family::Ipv4, "spec.ippools.ipv4"))]
    pub ipv4: Vec<String>,
    /// IPv6 EIPs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::pool(Family::Ipv6, "spec.ippools.ipv6"))]
    pub ipv6: Vec<String>,
    /// The IPv4 EIP that `default`-allocated policies share; the pool's first
    /// address when unset or `""`.
    #[serde(
        rename = "ipv4DefaultEIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(transform = schema::ip_field(Family::Ipv4, "spec.ippools.ipv4DefaultEIP"))]
    pub ipv4_default_eip: Option<String>,
    /// The IPv6 counterpart of `ipv4DefaultEIP`.
    #[serde(
        rename = "ipv6DefaultEIP",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(transform = schema::ip_field(Family::Ipv6, "spec.ippools.ipv6DefaultEIP"))]
    pub ipv6_default_eip: Option<String>,
}

/// Status of an `EgressGateway`, written by the controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressGatewayStatus {
    /// Every node the selector matches, with the EIPs active on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_list: Vec<GatewayNode>,
    /// How many nodes the selector matches.
    #[serde(default)]
    #[schemars(transform = schema::int_range(schema::NODE_COUNT))]
    pub selected_nodes: i32,
    /// How many of them can carry traffic.
    #[serde(default)]
    #[schemars(transform = schema::int_range(schema::NODE_COUNT))]
    pub ready_nodes: i32,
    /// Pool usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_usage: Option<IpUsage>,
    /// The Pods whose traffic the gateway's nodes may carry, as the
    /// controller publishes them in `EgressEndpointSlice`s; unset until it
    /// does (the nodes' agents then watch every Pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<GatewayPods>,
    /// `Ready`: the gateway can carry traffic (a usable pool and a ready node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = schema::conditions)]
    pub conditions: Vec<Condition>,
}

/// `status.pods` of an `EgressGateway`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayPods {
    /// How many Pods its policies select (with the Pods sharing an address
    /// with one).
    #[serde(default)]
    #[schemars(transform = schema::int_range(schema::POD_COUNT))]
    pub selected: i32,
    /// How many `EgressEndpointSlice`s hold them.
    #[serde(default)]
    #[schemars(transform = schema::int_range(schema::POD_COUNT))]
    pub slices: i32,
}

/// One selected node of a gateway.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayNode {
    /// Node name.
    pub name: String,
    /// `Ready` when the node can carry traffic, else `NotReady`.
    pub status: NodeReadiness,
    /// EIPs active on the node, each with the policies using it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eips: Vec<GatewayEip>,
}

/// Whether a gateway node can carry traffic.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum NodeReadiness {
    /// The node is ready and its agent alive.
    Ready,
    /// It is not.
    #[default]
    NotReady,
}

/// EIPs active on a gateway node: an IPv4 / IPv6 pair that the same
/// policies use, or neither for policies that leave with the node's own
/// address (`useNodeIP`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayEip {
    /// IPv4 EIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<String>,
    /// IPv6 EIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<String>,
    /// Policies using it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<PolicyReference>,
    /// The nodes that take the EIP over, in this order, when the data
    /// plane finds this node dead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub standbys: Vec<String>,
}

/// A policy named in a status: `namespace` is unset for an
/// `EgressClusterPolicy`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyReference {
    /// Policy name.
    pub name: String,
    /// Namespace of an `EgressPolicy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Pool usage totals. Counts saturate at 2^53 - 1 (the CRD's bound, see
/// `IntRange::MAX_EXACT`) for huge IPv6 pools.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpUsage {
    /// Addresses in the IPv4 pool.
    #[schemars(transform = schema::int_range(schema::ADDRESS_COUNT))]
    pub ipv4_total: i64,
    /// IPv4 addresses no policy holds.
    #[schemars(transform = schema::int_range(schema::ADDRESS_COUNT))]
    pub ipv4_free: i64,
    /// Addresses in the IPv6 pool.
    #[schemars(transform = schema::int_range(schema::ADDRESS_COUNT))]
    pub ipv6_total: i64,
    /// IPv6 addresses no policy holds.
    #[schemars(transform = schema::int_range(schema::ADDRESS_COUNT))]
    pub ipv6_free: i64,
}

/// A gateway spec in the planner's terms, as far as it converts.
#[derive(Debug, Default)]
pub(crate) struct GatewayParts {
    /// `None` when the selector has an invalid requirement.
    node_selector: Option<egressgw_core::selector::LabelSelector>,
    /// `None` when unset or invalid (an invalid one makes the gateway invalid).
    namespace_selector: Option<egressgw_core::selector::LabelSelector>,
    ipv4_pool: IpPool,
    ipv6_pool: IpPool,
    ipv4_default: Option<Ipv4Addr>,
    ipv6_default: Option<Ipv6Addr>,
}

impl EgressGatewaySpec {
    /// Checks the spec the way admission does, plus what CEL cannot express
    /// (IPv6 range order, a default EIP inside an IPv6 range). Returns every
    /// problem, each named by its field path.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errors = ValidationErrors::new();
        self.parts(&mut errors);
        errors.into_result()
    }

    /// The spec in the planner's terms; complete only if `errors` stays empty.
    pub(crate) fn parts(&self, errors: &mut ValidationErrors) -> GatewayParts {
        let spec = FieldPath::root("spec");
        let errors_before = errors.len();
        let node_selector = crate::selector::convert(
            &self.node_selector.selector,
            &spec.field("nodeSelector").field("selector"),
            errors,
        );
        let node_selector = (errors.len() == errors_before).then_some(node_selector);
        let namespace_selector = self
            .namespace_selector
            .as_ref()
            .map(|s| crate::selector::convert(s, &spec.field("namespaceSelector"), errors));
        let pools = spec.field("ippools");
        let ipv4_pool = pool(
            &self.ippools.ipv4,
            Family::Ipv4,
            &pools.field("ipv4"),
            errors,
        );
        let ipv6_pool = pool(
            &self.ippools.ipv6,
            Family::Ipv6,
            &pools.field("ipv6"),
            errors,
        );
        let ipv4_default = default_eip(
            self.ippools.ipv4_default_eip.as_ref(),
            &ipv4_pool,
            Family::Ipv4,
            &pools,
            errors,
        );
        let ipv6_default = default_eip(
            self.ippools.ipv6_default_eip.as_ref(),
            &ipv6_pool,
            Family::Ipv6,
            &pools,
            errors,
        );
        GatewayParts {
            node_selector,
            namespace_selector,
            ipv4_pool,
            ipv6_pool,
            ipv4_default: ipv4_default.and_then(as_v4),
            ipv6_default: ipv6_default.and_then(as_v6),
        }
    }
}

fn pool(
    entries: &[String],
    family: Family,
    path: &FieldPath,
    errors: &mut ValidationErrors,
) -> IpPool {
    let ranges = entries
        .iter()
        .enumerate()
        .filter_map(|(i, entry)| {
            validation::range_of(entry, family)
                .map_err(|message| errors.push(path.index(i), message))
                .ok()
        })
        .collect();
    IpPool::new(ranges)
}

fn default_eip(
    value: Option<&String>,
    pool: &IpPool,
    family: Family,
    pools: &FieldPath,
    errors: &mut ValidationErrors,
) -> Option<IpAddr> {
    let (field, list) = match family {
        Family::Ipv4 => ("ipv4DefaultEIP", "ipv4"),
        Family::Ipv6 => ("ipv6DefaultEIP", "ipv6"),
    };
    let path = pools.field(field);
    let ip = validation::ip_of(non_empty(value)?, family)
        .map_err(|message| errors.push(&path, message))
        .ok()?;
    if !pool.contains(ip) {
        errors.push(&path, format!("{ip} is not in {}", pools.field(list)));
        return None;
    }
    Some(ip)
}

impl EgressGateway {
    /// The gateway in the planner's terms.
    ///
    /// An invalid gateway converts too, because it still exists for its
    /// policies and keeps its `clusterDefault` claim: it has its name,
    /// `clusterDefault` as written, age, previous nodes and node selector
    /// (the empty selector when that does not convert), no pools and no
    /// default EIPs, and [`model::Gateway::errors`] holds every problem as
    /// `path: message`. Such a gateway carries no traffic. The planner
    /// reports its status from those errors, so it never belongs in
    /// [`model::Snapshot::invalid`] as well.
    pub fn to_model(&self) -> model::Gateway {
        let mut errors = ValidationErrors::new();
        let name = object_name(&self.metadata, &mut errors);
        let mut parts = self.spec.parts(&mut errors);
        if !errors.is_empty() {
            parts = GatewayParts {
                node_selector: parts.node_selector,
                ..GatewayParts::default()
            };
        }
        model::Gateway {
            name,
            node_selector: parts.node_selector.unwrap_or_default(),
            ipv4_pool: parts.ipv4_pool,
            ipv6_pool: parts.ipv6_pool,
            ipv4_default: parts.ipv4_default,
            ipv6_default: parts.ipv6_default,
            cluster_default: self.spec.cluster_default,
            fail_closed: self.spec.fail_closed,
            namespace_selector: parts.namespace_selector,
            age: age(&self.metadata),
            previous_nodes: self.previous_nodes(),
            errors: errors.messages(),
        }
    }

    /// Where each EIP was active at the last status write. Entries that do
    /// not parse are ignored: the status is the controller's own record.
    pub fn previous_nodes(&self) -> BTreeMap<IpAddr, String> {
        let Some(status) = &self.status else {
            return BTreeMap::new();
        };
        status
            .node_list
            .iter()
            .flat_map(|node| {
                node.eips.iter().flat_map(move |eip| {
                    [&eip.ipv4, &eip.ipv6]
                        .into_iter()
                        .flatten()
                        .filter_map(|s| s.parse::<IpAddr>().ok())
                        .map(move |ip| (ip, node.name.clone()))
                })
            })
            .collect()
    }
}

//! The planner's input: a snapshot of the cluster, already validated.
//!
//! These types carry no Kubernetes machinery. `egressgw-api` converts watched
//! objects into them; tests and benches build them directly.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::net::{Family, IpPool};
use crate::selector::LabelSelector;

/// Labels of a Kubernetes object: pairs sorted by key, each key once.
///
/// One sorted vector rather than a map: an object has a few labels, and a
/// `BTreeMap` allocates a node of eleven pairs (544 bytes) for the first
/// one. The controller keeps every Pod's labels and a gateway node's agent
/// those of every Pod its gateways publish. Lookups are binary searches;
/// building from unsorted pairs keeps the last value of a key, as inserting
/// them into a map one by one would.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Labels(Vec<(String, String)>);

impl Labels {
    /// No labels.
    pub fn new() -> Self {
        Self(Vec::new())
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&String> {
        self.position(key).ok().map(|i| &self.0[i].1)
    }

    /// Whether there is a label `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.position(key).is_ok()
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: String, value: String) -> Option<String> {
        match self.position(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        self.position(key).ok().map(|i| self.0.remove(i).1)
    }

    /// Removes every label.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// How many labels there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value of `key`, to change.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut String> {
        self.position(key).ok().map(|i| &mut self.0[i].1)
    }

    /// The same pairs as a map, as Kubernetes' objects hold them.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        self.0.iter().cloned().collect()
    }

    /// The pairs, by key.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&String, &String)> {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl fmt::Debug for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl FromIterator<(String, String)> for Labels {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(pairs: I) -> Self {
        let mut pairs: Vec<(String, String)> = pairs.into_iter().collect();
        // Stable: of equal keys, the last stays after the reverse dedup.
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs.reverse();
        pairs.dedup_by(|later, earlier| later.0 == earlier.0);
        pairs.reverse();
        pairs.shrink_to_fit();
        Self(pairs)
    }
}

impl<const N: usize> From<[(String, String); N]> for Labels {
    fn from(pairs: [(String, String); N]) -> Self {
        pairs.into_iter().collect()
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        Self(map.into_iter().collect())
    }
}

impl Extend<(String, String)> for Labels {
    fn extend<I: IntoIterator<Item = (String, String)>>(&mut self, pairs: I) {
        for (k, v) in pairs {
            self.insert(k, v);
        }
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a String, &'a String),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl IntoIterator for Labels {
    type Item = (String, String);
    type IntoIter = std::vec::IntoIter<(String, String)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// Everything the planner looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Cluster-wide settings.
    pub config: Config,
    /// All nodes.
    pub nodes: Vec<Node>,
    /// All namespaces (for cluster policies' namespace selectors).
    pub namespaces: Vec<Namespace>,
    /// All pods.
    pub pods: Vec<Pod>,
    /// All egress gateways.
    pub gateways: Vec<Gateway>,
    /// All valid egress policies, namespaced and cluster-wide. Each is
    /// shared: with the watch that converted it, and with a planner's
    /// indexes, rather than copied into each.
    pub policies: Vec<Arc<Policy>>,
    /// Tunnel identities allocated earlier (from `EgressTunnel` objects).
    pub tunnels: Vec<Tunnel>,
    /// Policies and tunnels that failed validation; they get a status and
    /// nothing else. (An invalid gateway is a [`Gateway`] with `errors`.)
    pub invalid: Vec<InvalidObject>,
    /// EIPs that an agent found answered for by another host on the
    /// segment, with who answered, as its node reports it.
    pub eips_in_use: BTreeMap<IpAddr, String>,
}

impl Snapshot {
    /// Policy `i`, to change: copied first while it is shared.
    pub fn policy_mut(&mut self, i: usize) -> Option<&mut Policy> {
        self.policies.get_mut(i).map(Arc::make_mut)
    }

    /// Every policy, to change: each copied first while it is shared.
    pub fn policies_mut(&mut self) -> impl Iterator<Item = &mut Policy> {
        self.policies.iter_mut().map(Arc::make_mut)
    }
}

/// A node as the planner needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Node name.
    pub name: String,
    /// Node labels.
    pub labels: Labels,
    /// The node's InternalIP addresses; the first of each family is its
    /// underlay (parent) address.
    pub addresses: Vec<IpAddr>,
    /// The node's ExternalIP addresses: never an EIP, and not otherwise
    /// treated as the cluster's (traffic to them may be selected).
    pub external_addresses: Vec<IpAddr>,
    /// `spec.podCIDRs`.
    pub pod_cidrs: Vec<IpNet>,
    /// Whether the node may carry traffic: its `Ready` condition is true and,
    /// once agents report, its agent is alive. New EIPs go to ready nodes
    /// only; an EIP already on a node stays there while the data plane finds
    /// the node alive (see [`crate::failover`]).
    pub ready: bool,
    /// The EIPs its agent reports holding (`EgressTunnel` status): where the
    /// data plane put them, which may be ahead of the last plan.
    pub held_eips: Vec<IpAddr>,
}

impl Node {
    /// The node's first address of `family`.
    pub fn address(&self, family: Family) -> Option<IpAddr> {
        self.addresses
            .iter()
            .copied()
            .find(|ip| Family::of(*ip) == family)
    }
}

/// A namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// Namespace name.
    pub name: String,
    /// Namespace labels.
    pub labels: Labels,
}

/// A pod that may be subject to egress policies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: Labels,
    /// `status.podIPs`; empty while the pod has none.
    pub ips: Vec<IpAddr>,
    /// `spec.nodeName`; `None` while unscheduled.
    pub node: Option<String>,
    /// Whether the pod shares its node's network namespace; such pods are
    /// never classified (their source is the node's own address).
    pub host_network: bool,
}

/// An `EgressGateway`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gateway {
    /// Name (cluster-scoped).
    pub name: String,
    /// Which nodes may carry this gateway's traffic.
    pub node_selector: LabelSelector,
    /// IPv4 EIP pool.
    pub ipv4_pool: IpPool,
    /// IPv6 EIP pool.
    pub ipv6_pool: IpPool,
    /// The EIP shared by `default`-allocated policies; the pool's first
    /// address when unset.
    pub ipv4_default: Option<Ipv4Addr>,
    /// IPv6 counterpart of `ipv4_default`.
    pub ipv6_default: Option<Ipv6Addr>,
    /// Whether policies that name no gateway use this one.
    pub cluster_default: bool,
    /// `spec.namespaceSelector`: the namespaces whose `EgressPolicy`s may
    /// use this gateway; `None` admits every namespace. Cluster policies
    /// (admin-made) are not restricted.
    pub namespace_selector: Option<LabelSelector>,
    /// `spec.failClosed`: while none of its nodes is live, selected traffic
    /// is dropped instead of leaving with a node's own address.
    pub fail_closed: bool,
    /// Creation order key: older gateways win conflicts.
    pub age: Age,
    /// Where each EIP was active at the last status write, so a recompute
    /// keeps it there while that node stays eligible.
    pub previous_nodes: BTreeMap<IpAddr, String>,
    /// Why the spec is invalid, one message per problem, each starting with
    /// the field path; empty for a valid gateway. An invalid gateway still
    /// exists for its policies (they are told it is invalid, not missing)
    /// and keeps its `cluster_default` claim, but carries no traffic.
    pub errors: Vec<String>,
}

impl Gateway {
    /// The pool of `family`.
    pub fn pool(&self, family: Family) -> &IpPool {
        match family {
            Family::Ipv4 => &self.ipv4_pool,
            Family::Ipv6 => &self.ipv6_pool,
        }
    }

    /// The default EIP of `family`: the configured one, else the pool's first address.
    pub fn default_eip(&self, family: Family) -> Option<IpAddr> {
        let configured = match family {
            Family::Ipv4 => self.ipv4_default.map(IpAddr::V4),
            Family::Ipv6 => self.ipv6_default.map(IpAddr::V6),
        };
        configured.or_else(|| self.pool(family).first())
    }
}

/// Creation order of an object: timestamp (seconds since the epoch), then
/// UID to break ties deterministically.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Age {
    /// `metadata.creationTimestamp` in seconds since the Unix epoch.
    pub created: i64,
    /// `metadata.uid`, a tie-breaker.
    pub uid: String,
}

/// Identifies a policy: `namespace/name` for an `EgressPolicy`, `name` for
/// an `EgressClusterPolicy`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyRef {
    /// `None` for a cluster policy.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

impl PolicyRef {
    /// A namespaced `EgressPolicy`.
    pub fn namespaced(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: Some(namespace.into()),
            name: name.into(),
        }
    }

    /// An `EgressClusterPolicy`.
    pub fn cluster(name: impl Into<String>) -> Self {
        Self {
            namespace: None,
            name: name.into(),
        }
    }

    /// The kind of object this refers to.
    pub fn kind(&self) -> &'static str {
        if self.namespace.is_some() {
            "EgressPolicy"
        } else {
            "EgressClusterPolicy"
        }
    }
}

impl fmt::Display for PolicyRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// How a policy's EIP is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Allocator {
    /// Share the gateway's default EIP.
    #[default]
    Default,
    /// Take an EIP of its own: the first pool address no other policy holds.
    RoundRobin,
}

/// `spec.egressIP`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressIpSpec {
    /// A pinned IPv4 EIP; must be in the gateway's pool.
    pub ipv4: Option<Ipv4Addr>,
    /// A pinned IPv6 EIP; must be in the gateway's pool.
    pub ipv6: Option<Ipv6Addr>,
    /// Leave with the gateway node's own address instead of an EIP.
    pub use_node_ip: bool,
    /// How unpinned EIPs are chosen.
    pub allocator: Allocator,
}

/// Which pods a policy applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodMatch {
    /// Pods whose labels match.
    Selector(LabelSelector),
    /// Pods whose IP lies in one of these prefixes.
    Subnets(Vec<IpNet>),
}

/// An `EgressPolicy` or `EgressClusterPolicy`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Identity.
    pub id: PolicyRef,
    /// `spec.egressGatewayName`; `None` means the cluster default gateway.
    pub gateway: Option<String>,
    /// `spec.egressIP`.
    pub egress_ip: EgressIpSpec,
    /// `spec.appliedTo.podSelector` / `podSubnet`.
    pub pods: PodMatch,
    /// `spec.appliedTo.namespaceSelector` of a cluster policy; `None` for a
    /// namespaced policy (which applies in its own namespace only) and for a
    /// cluster policy without one (all namespaces).
    pub namespace_selector: Option<LabelSelector>,
    /// `spec.destSubnet`; empty means everything outside the cluster.
    pub dest_subnets: Vec<IpNet>,
    /// `spec.excludeSubnet`.
    pub exclude_subnets: Vec<IpNet>,
    /// `spec.priority`: on equally specific destinations the higher wins.
    pub priority: i32,
    /// Creation order: on equal priority the older wins.
    pub age: Age,
    /// The EIPs in the policy's status at the last write, kept while still valid.
    pub previous_eips: Vec<IpAddr>,
    /// The gateway node in the policy's status at the last write.
    pub previous_node: Option<String>,
}

/// A node's tunnel identity as allocated earlier (an `EgressTunnel`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tunnel {
    /// The node it belongs to.
    pub node: String,
    /// Tunnel IPv4 address.
    pub ipv4: Option<Ipv4Addr>,
    /// Tunnel IPv6 address.
    pub ipv6: Option<Ipv6Addr>,
    /// MAC of the node's `egress.vxlan`.
    pub mac: Option<Mac>,
    /// Packet mark routing to this node, if it is gateway-capable.
    pub mark: Option<u32>,
}

/// A MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl serde::Serialize for Mac {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl serde::Serialize for PolicyRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl std::str::FromStr for Mac {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for byte in &mut out {
            let part = parts
                .next()
                .ok_or_else(|| format!("{s:?} is not a MAC address"))?;
            *byte =
                u8::from_str_radix(part, 16).map_err(|_| format!("{s:?} is not a MAC address"))?;
        }
        if parts.next().is_some() {
            return Err(format!("{s:?} is not a MAC address"));
        }
        Ok(Mac(out))
    }
}

/// An object that failed validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidObject {
    /// Kind, e.g. `EgressPolicy`.
    pub kind: String,
    /// Namespace, for namespaced kinds.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
    /// One message per problem, each starting with the field path.
    pub errors: Vec<String>,
}

/// kube-proxy's masquerade (0x4000) and drop (0x8000) mark bits.
pub const KUBE_PROXY_MARKS: u32 = 0x0000_c000;

/// `datapath`: what classifies pod traffic on a node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatapathChoice {
    /// The eBPF classifier where the node can run it, nftables otherwise
    /// (the agent says why, in its log and its `EgressTunnel` status).
    #[default]
    Auto,
    /// The eBPF classifier; an agent that cannot run it does not start.
    Ebpf,
    /// The nftables table alone.
    Nftables,
}

impl fmt::Display for DatapathChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DatapathChoice::Auto => "auto",
            DatapathChoice::Ebpf => "ebpf",
            DatapathChoice::Nftables => "nftables",
        })
    }
}

/// Cluster-wide settings (the agent's and controller's config file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// What classifies pod traffic on the nodes.
    pub datapath: DatapathChoice,
    /// On the eBPF datapath, TCP connections pods open go straight into
    /// the tunnel and their replies straight to the pod (the fast path);
    /// off, every packet takes the marked way through the node's routing
    /// and netfilter.
    pub ebpf_fast_path: bool,
    /// Tunnel device settings.
    pub vxlan: VxlanSettings,
    /// Whether IPv4 egress is on.
    pub enable_ipv4: bool,
    /// Whether IPv6 egress is on.
    pub enable_ipv6: bool,
    /// Tunnel addresses are allocated from here.
    pub tunnel_ipv4_subnet: Ipv4Net,
    /// Tunnel IPv6 addresses are allocated from here.
    pub tunnel_ipv6_subnet: Ipv6Net,
    /// Service CIDRs: never sent to a gateway.
    pub service_cidrs: Vec<IpNet>,
    /// Further in-cluster prefixes (e.g. a CNI's pod pools that are not
    /// node podCIDRs): never sent to a gateway.
    pub extra_cluster_cidrs: Vec<IpNet>,
    /// The mark bits egressgw owns; per-gateway-node marks live inside them.
    pub mark_mask: u32,
    /// Routing table of the gateway node with mark index 1; index `i` uses
    /// `route_table_base + i - 1`.
    pub route_table_base: u32,
    /// Priority of egressgw's `ip rule`s.
    pub rule_priority: u32,
}

/// `egress.vxlan` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanSettings {
    /// Device name.
    pub name: String,
    /// VNI.
    pub id: u32,
    /// UDP port.
    pub port: u16,
    /// Turn tx checksum offload off on the device.
    pub disable_checksum_offload: bool,
}

impl Default for VxlanSettings {
    fn default() -> Self {
        Self {
            name: "egress.vxlan".into(),
            id: 100,
            port: 7789,
            disable_checksum_offload: false,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            datapath: DatapathChoice::default(),
            ebpf_fast_path: true,
            vxlan: VxlanSettings::default(),
            enable_ipv4: true,
            enable_ipv6: false,
            tunnel_ipv4_subnet: "172.31.0.0/16".parse().expect("valid default"),
            tunnel_ipv6_subnet: "fd11::/112".parse().expect("valid default"),
            service_cidrs: vec!["10.96.0.0/12".parse().expect("valid default")],
            extra_cluster_cidrs: Vec::new(),
            mark_mask: 0xff00_0000,
            route_table_base: 3000,
            rule_priority: 3000,
        }
    }
}

impl Config {
    /// Whether egress is on for `family`.
    pub fn family_enabled(&self, family: Family) -> bool {
        match family {
            Family::Ipv4 => self.enable_ipv4,
            Family::Ipv6 => self.enable_ipv6,
        }
    }

    /// The families enabled, IPv4 first.
    pub fn enabled_families(&self) -> impl Iterator<Item = Family> + '_ {
        Family::ALL.into_iter().filter(|f| self.family_enabled(*f))
    }

    /// Checks the settings; every problem is reported, named by its key.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        if self.vxlan.name.is_empty() || self.vxlan.name.len() > 15 {
            errors.push(format!(
                "vxlan.name: {:?} must be 1 to 15 characters (a Linux interface name)",
                self.vxlan.name
            ));
        }
        if self.vxlan.id == 0 || self.vxlan.id > 0x00ff_ffff {
            errors.push(format!(
                "vxlan.id: {} must be between 1 and 16777215",
                self.vxlan.id
            ));
        }
        if self.vxlan.port == 0 {
            errors.push("vxlan.port: must not be 0".into());
        }
        if !self.enable_ipv4 && !self.enable_ipv6 {
            errors.push("enableIPv4, enableIPv6: at least one family must be enabled".into());
        }
        let shifted = self
            .mark_mask
            .checked_shr(self.mark_mask.trailing_zeros())
            .unwrap_or(0);
        if self.mark_mask.count_ones() < 2 {
            errors.push(format!(
                "mark.mask: {:#010x} needs at least two bits (gateway marks plus a reply and a local mark)",
                self.mark_mask
            ));
        } else if shifted.checked_add(1).is_some_and(|n| !n.is_power_of_two()) {
            errors.push(format!(
                "mark.mask: {:#010x} must be one contiguous run of bits",
                self.mark_mask
            ));
        }
        if self.mark_mask & KUBE_PROXY_MARKS != 0 {
            errors.push(format!(
                "mark.mask: {:#010x} overlaps kube-proxy's marks ({KUBE_PROXY_MARKS:#06x}); use higher bits",
                self.mark_mask
            ));
        }
        let last_table =
            (u64::from(self.route_table_base) + u64::from(self.mark_values())).saturating_sub(1);
        if self.route_table_base == 0 || last_table > u64::from(u32::MAX) {
            errors.push(format!(
                "route.tableBase: {} leaves no room for {} tables (one per possible gateway node)",
                self.route_table_base,
                self.mark_capacity()
            ));
        } else if u64::from(self.route_table_base) <= 255 && last_table >= 253 {
            errors.push(format!(
                "route.tableBase: tables {}..={last_table} would include the kernel's default, main or local table (253-255)",
                self.route_table_base
            ));
        }
        if !(1..=32765).contains(&self.rule_priority) {
            errors.push(format!(
                "route.rulePriority: {} must be between 1 and 32765 (after the local table's rule, before main's)",
                self.rule_priority
            ));
        }
        if self.tunnel_ipv4_subnet.prefix_len() > 30 {
            errors.push(format!(
                "tunnelIPv4Subnet: {} is too small",
                self.tunnel_ipv4_subnet
            ));
        }
        if self.tunnel_ipv6_subnet.prefix_len() > 126 {
            errors.push(format!(
                "tunnelIPv6Subnet: {} is too small",
                self.tunnel_ipv6_subnet
            ));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// How many mark values the mask holds (its bits shifted down: 255 for
    /// `0xff000000`). The two highest are reserved: see [`Config::reply_mark`]
    /// and [`Config::local_mark`].
    fn mark_values(&self) -> u32 {
        self.mark_mask
            .checked_shr(self.mark_mask.trailing_zeros())
            .unwrap_or(0)
    }

    /// How many distinct gateway-node marks fit in the mask.
    pub fn mark_capacity(&self) -> u32 {
        self.mark_values().saturating_sub(2)
    }

    /// The mark a gateway node puts on replies of connections that came out of
    /// the tunnel, so that they go back through it (every bit of the mask).
    pub fn reply_mark(&self) -> u32 {
        self.mark_mask
    }

    /// The mark of traffic classified `Local` on a gateway node: it is SNATed
    /// there without entering the tunnel.
    pub fn local_mark(&self) -> u32 {
        self.mark(self.mark_values().saturating_sub(1))
    }

    /// The table holding the routes back to the pods' nodes for replies.
    pub fn reply_table(&self) -> u32 {
        (self.route_table_base + self.mark_values()).saturating_sub(1)
    }

    /// egressgw's routing tables: one per gateway mark, then the reply table.
    pub fn tables(&self) -> std::ops::RangeInclusive<u32> {
        self.route_table_base..=self.reply_table()
    }

    /// The mark of the gateway node with index `index` (1-based).
    pub fn mark(&self, index: u32) -> u32 {
        index << self.mark_mask.trailing_zeros()
    }

    /// The mark index of `mark`, if it is one of egressgw's.
    pub fn mark_index(&self, mark: u32) -> Option<u32> {
        let index = (mark & self.mark_mask) >> self.mark_mask.trailing_zeros();
        (mark & !self.mark_mask == 0 && index != 0).then_some(index)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Operations on labels, applied to [`Labels`] and to a map.
    #[derive(Debug, Clone)]
    enum LabelOp {
        Insert(String, String),
        Remove(String),
        Extend(Vec<(String, String)>),
    }

    fn label_op() -> impl Strategy<Value = LabelOp> {
        let key = "[a-e]{1,2}";
        prop_oneof![
            (key, "[x-z]").prop_map(|(k, v)| LabelOp::Insert(k, v)),
            key.prop_map(LabelOp::Remove),
            prop::collection::vec((key, "[x-z]"), 0..5).prop_map(LabelOp::Extend),
        ]
    }

    proptest! {
        /// Labels answer as a map of the same pairs would, however they
        /// were built and changed.
        #[test]
        fn labels_behave_as_a_map(
            start in prop::collection::vec(("[a-e]{1,2}", "[x-z]"), 0..8),
            ops in prop::collection::vec(label_op(), 0..12),
        ) {
            let mut labels: Labels = start.iter().cloned().collect();
            let mut map: BTreeMap<String, String> = start.into_iter().collect();
            for op in ops {
                match op {
                    LabelOp::Insert(k, v) => {
                        prop_assert_eq!(labels.insert(k.clone(), v.clone()), map.insert(k, v));
                    }
                    LabelOp::Remove(k) => prop_assert_eq!(labels.remove(&k), map.remove(&k)),
                    LabelOp::Extend(pairs) => {
                        labels.extend(pairs.clone());
                        map.extend(pairs);
                    }
                }
                let pairs: Vec<(&String, &String)> = labels.iter().collect();
                prop_assert_eq!(pairs, map.iter().collect::<Vec<_>>());
                prop_assert_eq!(labels.len(), map.len());
                for k in ["a", "b", "cc", "e"] {
                    prop_assert_eq!(labels.get(k), map.get(k));
                    prop_assert_eq!(labels.contains_key(k), map.contains_key(k));
                }
                prop_assert_eq!(&Labels::from(map.clone()), &labels);
            }
        }
    }

    fn errors(f: impl FnOnce(&mut Config)) -> String {
        let mut c = Config::default();
        f(&mut c);
        c.validate().err().unwrap_or_default().join("\n")
    }

    #[test]
    fn the_defaults_are_valid() {
        assert_eq!(Config::default().validate(), Ok(()));
    }

    #[test]
    fn a_mask_over_kube_proxys_bits_is_rejected() {
        assert!(errors(|c| c.mark_mask = 0x0000_ff00).contains("overlaps kube-proxy's marks"));
    }

    #[test]
    fn a_split_mask_is_rejected_and_a_full_one_is_not_called_split() {
        assert!(errors(|c| c.mark_mask = 0x0f0f_0000).contains("one contiguous run"));
        assert!(!errors(|c| c.mark_mask = 0xffff_ffff).contains("contiguous"));
    }

    #[test]
    fn route_tables_may_not_reach_the_kernels_own_tables_or_overflow() {
        assert!(errors(|c| c.route_table_base = 250).contains("253-255"));
        assert!(errors(|c| c.route_table_base = u32::MAX).contains("leaves no room"));
        assert!(errors(|c| c.route_table_base = 0).contains("leaves no room"));
        assert_eq!(errors(|c| c.route_table_base = 256), "");
    }

    #[test]
    fn the_rule_priority_must_sit_between_local_and_main() {
        assert!(errors(|c| c.rule_priority = 0).contains("route.rulePriority"));
        assert!(errors(|c| c.rule_priority = 32767).contains("route.rulePriority"));
    }
}

//! The lab's names and addresses, computed from its prefix and the node and
//! gateway counts.
//!
//! Pure: nothing here touches the system. Every network namespace name starts
//! with the lab's [`Prefix`] and a dash, which is how `lab down` finds what a
//! lab left behind (and only that lab: another lab's prefix never matches),
//! and every address lies in a range that exists only inside the lab's
//! namespaces.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{bail, ensure};
use serde::{Deserialize, Serialize};

/// The prefix of a lab when `EGRESSGW_LAB_PREFIX` is not set.
pub const DEFAULT_PREFIX: &str = "egl";
/// The environment variable naming the lab to work on.
pub const PREFIX_ENV: &str = "EGRESSGW_LAB_PREFIX";
/// The longest prefix: `<prefix>-` and an 8-character suffix must fit the
/// kernel's 15-byte interface names.
pub const MAX_PREFIX_LEN: usize = 6;
/// The most nodes a lab can have: node addresses are `172.18.0.(10 + i)`.
pub const MAX_NODES: u8 = 100;

/// The underlay segment joining the control plane and the nodes.
pub const UNDERLAY_CIDR: &str = "172.18.0.0/24";
/// The underlay's router address: routed to, held by nobody.
pub const UNDERLAY_ROUTER: Ipv4Addr = Ipv4Addr::new(172, 18, 0, 1);
const UNDERLAY_PREFIX_LEN: u8 = 24;
/// The pod network: node `i` owns `10.244.i.0/24`.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The service range given to kube-apiserver (no service is ever reachable: there is no kube-proxy).
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The first address of [`SERVICE_CIDR`], which kube-apiserver gives the `kubernetes` Service.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// The external segment the target lives on (TEST-NET-2, never routed anywhere).
pub const EXTERNAL_CIDR: &str = "198.51.100.0/24";
const EXTERNAL_PREFIX_LEN: u8 = 24;
/// Addresses of the external segment that no lab host uses: room for EgressGateway pools.
pub const EXTERNAL_FREE_RANGE: &str = "198.51.100.100-198.51.100.250";

/// A dual-stack lab (`lab up --ipv6`) gives every segment an IPv6 prefix
/// beside its IPv4 one, numbered the same way: the host number of an IPv4
/// address, written in decimal, is the last group of its IPv6 sibling
/// (`172.18.0.11` and `fd00:172:18::11`). Unique local addresses inside,
/// the documentation prefix outside.
pub const UNDERLAY6_CIDR: &str = "fd00:172:18::/64";
/// The IPv6 router address of the underlay: routed to, held by nobody.
pub const UNDERLAY6_ROUTER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x172, 0x18, 0, 0, 0, 0, 1);
const LINK6_PREFIX_LEN: u8 = 64;
/// The IPv6 pod network: node `i` owns `fd00:10:244:<i>::/64`.
pub const CLUSTER6_CIDR: &str = "fd00:10:244::/48";
/// The IPv6 service range of a dual-stack lab.
pub const SERVICE6_CIDR: &str = "fd00:10:96::/112";
/// The external segment's IPv6 prefix (documentation space, never routed anywhere).
pub const EXTERNAL6_CIDR: &str = "2001:db8:100::/64";
/// The IPv6 addresses of the external segment no lab host uses.
pub const EXTERNAL6_FREE_RANGE: &str = "2001:db8:100::100-2001:db8:100::250";

/// Lab pods take host addresses `.2` up to (not including) this one of
/// their node's pod CIDR; the kubelet stand-in's Pods take the rest.
pub const LAB_POD_HOSTS_END: u8 = 128;

/// kube-apiserver's port.
pub const API_PORT: u16 = 6443;
/// The target's whoami service port.
pub const WHOAMI_PORT: u16 = 8080;
/// The target's iperf3 server port.
pub const IPERF3_PORT: u16 = 5201;
/// The port of the target's TCP echo server while a bench runs.
pub const ECHO_PORT: u16 = 5202;

/// Label that marks a node as gateway-capable.
pub const GATEWAY_LABEL: &str = "egressgw.io/gateway";

/// The pods every node gets: (namespace, app). Pod `k` of node `i` is `<app>-<i>`.
const PODS_PER_NODE: [(&str, &str); 2] = [("team-a", "web"), ("team-b", "batch")];

/// A lab's name. Its network namespaces are `<prefix>-<suffix>`, and so are
/// the plumbing interfaces it creates (inside its own namespaces only), so
/// two labs with different prefixes run side by side without sharing a name.
///
/// One to [`MAX_PREFIX_LEN`] lowercase letters and digits, starting with a
/// letter. No dash: `<a>-` can then never be the start of `<b>-...` for
/// another prefix `b`, so one lab's `down` never matches another lab's names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Prefix(String);

impl Prefix {
    /// `$EGRESSGW_LAB_PREFIX`, else `default`.
    pub fn from_env_or(default: &str) -> anyhow::Result<Self> {
        match std::env::var(PREFIX_ENV) {
            Ok(value) if !value.is_empty() => Self::new(&value),
            Ok(_) | Err(std::env::VarError::NotPresent) => Self::new(default),
            Err(std::env::VarError::NotUnicode(value)) => {
                bail!("{PREFIX_ENV} is not valid UTF-8: {value:?}")
            }
        }
    }

    pub fn new(name: &str) -> anyhow::Result<Self> {
        let valid = name.len() <= MAX_PREFIX_LEN
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        ensure!(
            valid,
            "{PREFIX_ENV}={name:?} is not a lab prefix: 1 to {MAX_PREFIX_LEN} lowercase letters \
             and digits, starting with a letter (e.g. `egx`)"
        );
        Ok(Self(name.to_owned()))
    }

    pub fn is_default(&self) -> bool {
        self.0 == DEFAULT_PREFIX
    }

    /// The name `<prefix>-<suffix>` (a namespace or an interface).
    pub fn name(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.0)
    }

    /// The lab namespace `<prefix>-<suffix>`.
    pub fn netns(&self, suffix: &str) -> Netns {
        Netns(self.name(suffix))
    }

    /// A name read back from `ip netns list`, if it is one of this lab's.
    pub fn owns(&self, name: &str) -> Option<Netns> {
        name.strip_prefix(self.0.as_str())
            .is_some_and(|rest| rest.starts_with('-'))
            .then(|| Netns(name.to_owned()))
    }
}

impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Name of a lab network namespace; always starts with its lab's prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Netns(String);

impl Netns {
    /// A name recorded in `lab.json`, taken as it is.
    pub fn parse(name: &str) -> Self {
        Self(name.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Netns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The whole lab: who lives where, with which addresses.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Topology {
    pub prefix: Prefix,
    pub underlay: Underlay,
    pub control_plane: ControlPlane,
    pub namespaces: Vec<Namespace>,
    pub nodes: Vec<Node>,
    pub pods: Vec<Pod>,
    pub target: Target,
}

/// The bridge joining the control plane and the nodes, alone in its namespace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Underlay {
    pub netns: Netns,
    pub bridge: String,
    pub cidr: String,
}

/// The namespace running etcd, kube-apiserver and kube-controller-manager.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControlPlane {
    pub netns: Netns,
    pub interface: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 underlay address, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    /// The bridge port of `interface`, in the underlay namespace.
    pub underlay_port: String,
    pub api_server: String,
}

/// A Kubernetes namespace the lab's pods live in.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Namespace {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

/// One node: a namespace on the underlay, with its pods behind a bridge.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub netns: Netns,
    /// The underlay interface (the node's "eth0").
    pub interface: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 underlay address, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    /// The bridge port of `interface`, in the underlay namespace.
    pub underlay_port: String,
    pub pod_cidr: String,
    /// The node's address on its pod bridge, the pods' default gateway.
    pub pod_gateway: Ipv4Addr,
    /// The node's IPv6 pod prefix and its address on the pod bridge, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_cidr6: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_gateway6: Option<Ipv6Addr>,
    /// The pod bridge.
    pub pod_bridge: String,
    pub labels: BTreeMap<String, String>,
    /// Gateway-capable: labelled [`GATEWAY_LABEL`] and attached to the external segment.
    pub gateway: bool,
    /// Set on gateway nodes only: their leg on the external segment.
    pub external: Option<ExternalLeg>,
}

/// A gateway node's interface on the external segment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExternalLeg {
    pub interface: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    /// The bridge port of `interface`, in the target namespace.
    pub target_port: String,
}

/// One pod: a namespace attached to its node's pod bridge by a veth.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pod {
    pub name: String,
    pub namespace: String,
    pub node: String,
    pub netns: Netns,
    pub interface: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    pub labels: BTreeMap<String, String>,
    /// The node's end of the pod's veth, in the node namespace.
    pub node_veth: String,
}

/// The external host: what pods try to reach.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Target {
    pub netns: Netns,
    pub bridge: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    pub cidr: String,
    pub whoami_port: u16,
    pub iperf3_port: u16,
    /// The port of the echo server a bench runs here (a lab brought up
    /// before it had one reads as the default).
    #[serde(default = "echo_port")]
    pub echo_port: u16,
    /// Addresses on the segment that no lab host uses (for EIP pools).
    pub free_range: String,
    /// The IPv6 addresses free for pools, in a dual-stack lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_range6: Option<String>,
}

impl Topology {
    /// The lab with `nodes` nodes, the first `gateways` of them gateway-capable.
    pub fn new(prefix: &Prefix, nodes: u8, gateways: u8) -> anyhow::Result<Self> {
        ensure!(
            (1..=MAX_NODES).contains(&nodes),
            "--nodes must be between 1 and {MAX_NODES}, not {nodes}"
        );
        ensure!(
            gateways <= nodes,
            "--gateways ({gateways}) cannot exceed --nodes ({nodes})"
        );
        let nodes: Vec<Node> = (1..=nodes)
            .map(|i| node(prefix, i, i <= gateways))
            .collect();
        let pods = nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| pods_of(prefix, i, n))
            .collect();
        Ok(Self {
            prefix: prefix.clone(),
            underlay: Underlay {
                netns: prefix.netns("underlay"),
                bridge: prefix.name("br"),
                cidr: UNDERLAY_CIDR.to_owned(),
            },
            control_plane: control_plane(prefix),
            namespaces: namespaces(),
            nodes,
            pods,
            target: target(prefix),
        })
    }

    /// Every network namespace, in creation order.
    /// The same lab with IPv6 beside IPv4 on every segment, host, pod and
    /// the target (see [`UNDERLAY6_CIDR`] for the numbering).
    pub fn with_ipv6(mut self) -> Self {
        self.control_plane.ip6 = Some(sibling6(UNDERLAY6_CIDR, self.control_plane.ip));
        for (i, node) in (1u8..).zip(&mut self.nodes) {
            node.ip6 = Some(sibling6(UNDERLAY6_CIDR, node.ip));
            let cidr = format!("fd00:10:244:{i}::/64");
            node.pod_gateway6 = Some(sibling6(&cidr, node.pod_gateway));
            node.pod_cidr6 = Some(cidr);
            if let Some(ext) = &mut node.external {
                ext.ip6 = Some(sibling6(EXTERNAL6_CIDR, ext.ip));
            }
        }
        let nodes = self.nodes.clone();
        for pod in &mut self.pods {
            let node = nodes.iter().find(|n| n.name == pod.node);
            pod.ip6 = node.and_then(|n| n.pod_ip6(pod.ip.octets()[3]));
        }
        self.target.ip6 = Some(sibling6(EXTERNAL6_CIDR, self.target.ip));
        self.target.free_range6 = Some(EXTERNAL6_FREE_RANGE.to_owned());
        self
    }

    /// Whether the lab has IPv6 beside IPv4.
    pub fn dual_stack(&self) -> bool {
        self.target.ip6.is_some()
    }

    pub fn all_netns(&self) -> Vec<&Netns> {
        let mut all = vec![
            &self.underlay.netns,
            &self.control_plane.netns,
            &self.target.netns,
        ];
        all.extend(self.nodes.iter().map(|n| &n.netns));
        all.extend(self.pods.iter().map(|p| &p.netns));
        all
    }

    /// The pods of one node.
    pub fn pods_on<'a>(&'a self, node: &'a Node) -> impl Iterator<Item = &'a Pod> {
        self.pods.iter().filter(move |p| p.node == node.name)
    }

    /// The node called `name`, or an error listing the nodes there are.
    pub fn node(&self, name: &str) -> anyhow::Result<&Node> {
        match self.nodes.iter().find(|n| n.name == name) {
            Some(node) => Ok(node),
            None => {
                let names: Vec<&str> = self.nodes.iter().map(|n| n.name.as_str()).collect();
                bail!(
                    "the lab has no node {name:?} (its nodes: {})",
                    names.join(", ")
                )
            }
        }
    }

    /// A new pod on `node`, wired like the others: the first free address of
    /// the lower half of the node's pod CIDR (`.2` to `.127`; the kubelet
    /// stand-in gives the upper half to the Pods it runs), a namespace
    /// `<prefix>-pod-<name>`, and a node-side veth named after a hash of
    /// the pod (as CNIs name theirs), so any pod name fits the 15-byte
    /// limit. A name holds no dot: the stand-in's Pod namespaces do
    /// (`<prefix>-pod-<namespace>.<name>`), so the two never meet.
    pub fn new_pod(
        &self,
        name: &str,
        namespace: &str,
        node: &Node,
        labels: BTreeMap<String, String>,
    ) -> anyhow::Result<Pod> {
        ensure!(
            !name.is_empty() && !name.contains(['.', '/']),
            "a lab pod's name {name:?} must be non-empty, without '.' or '/'"
        );
        let netns = self.prefix.netns(&format!("pod-{name}"));
        ensure!(
            !self.pods.iter().any(|p| p.name == name || p.netns == netns),
            "the lab already has a pod named {name:?} (pod names are unique in the lab: each is a namespace {netns})"
        );
        let taken: Vec<Ipv4Addr> = self.pods_on(node).map(|p| p.ip).collect();
        let [a, b, c, _] = node.pod_gateway.octets();
        let Some(ip) = (2..LAB_POD_HOSTS_END)
            .map(|host| Ipv4Addr::new(a, b, c, host))
            .find(|ip| !taken.contains(ip))
        else {
            bail!(
                "{} has no free pod address left in {}",
                node.name,
                node.pod_cidr
            );
        };
        let mut hash = super::build::Fnv1a::default();
        hash.write(format!("{namespace}/{name}").as_bytes());
        Ok(Pod {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            node: node.name.clone(),
            netns,
            interface: "eth0".to_owned(),
            ip6: node.pod_ip6(ip.octets()[3]),
            ip,
            labels,
            node_veth: self
                .prefix
                .name(&format!("{:08x}", hash.finish() & 0xffff_ffff)),
        })
    }
}

/// Address with its prefix length, as `ip addr add` takes it.
impl Node {
    /// The IPv6 sibling of the pod address with host number `host`, in a dual-stack lab.
    pub fn pod_ip6(&self, host: u8) -> Option<Ipv6Addr> {
        let cidr = self.pod_cidr6.as_deref()?;
        Some(host6(cidr, host))
    }
}

/// The address of `cidr` (an IPv6 /64 written `<prefix>::/64`) whose last
/// group reads as `host` in decimal.
fn host6(cidr: &str, host: u8) -> Ipv6Addr {
    let prefix = cidr.trim_end_matches("/64").trim_end_matches(':');
    format!("{prefix}::{host}")
        .parse()
        .unwrap_or_else(|e| panic!("{prefix}::{host} is no IPv6 address: {e}"))
}

/// The IPv6 sibling in `cidr` of an IPv4 host address: its last octet, read as decimal.
pub fn sibling6(cidr: &str, ip: Ipv4Addr) -> Ipv6Addr {
    host6(cidr, ip.octets()[3])
}

pub fn with_len(ip: Ipv4Addr, len: u8) -> String {
    format!("{ip}/{len}")
}

/// `ip` on the underlay, with the segment's prefix length.
pub fn underlay_addr(ip: Ipv4Addr) -> String {
    with_len(ip, UNDERLAY_PREFIX_LEN)
}

/// `ip` on the external segment, with the segment's prefix length.
pub fn external_addr(ip: Ipv4Addr) -> String {
    with_len(ip, EXTERNAL_PREFIX_LEN)
}

/// An IPv6 address of the lab's segments with its length (all are /64).
pub fn addr6(ip: Ipv6Addr) -> String {
    format!("{ip}/{LINK6_PREFIX_LEN}")
}

fn control_plane(prefix: &Prefix) -> ControlPlane {
    let ip = Ipv4Addr::new(172, 18, 0, 2);
    ControlPlane {
        netns: prefix.netns("cp"),
        interface: "eth0".to_owned(),
        ip,
        ip6: None,
        underlay_port: prefix.name("cp"),
        api_server: format!("https://{ip}:{API_PORT}"),
    }
}

fn namespaces() -> Vec<Namespace> {
    ["team-a", "team-b"]
        .into_iter()
        .map(|name| Namespace {
            name: name.to_owned(),
            labels: labels(&[("team", name.trim_start_matches("team-"))]),
        })
        .collect()
}

fn node(prefix: &Prefix, i: u8, gateway: bool) -> Node {
    let name = format!("node-{i}");
    let mut node_labels = labels(&[
        ("kubernetes.io/hostname", &name),
        ("kubernetes.io/os", "linux"),
    ]);
    if gateway {
        node_labels.insert(GATEWAY_LABEL.to_owned(), "true".to_owned());
    }
    Node {
        netns: prefix.netns(&name),
        interface: "eth0".to_owned(),
        ip: Ipv4Addr::new(172, 18, 0, 10 + i),
        ip6: None,
        underlay_port: prefix.name(&format!("n{i}")),
        pod_cidr: format!("10.244.{i}.0/24"),
        pod_gateway: Ipv4Addr::new(10, 244, i, 1),
        pod_cidr6: None,
        pod_gateway6: None,
        pod_bridge: "cni0".to_owned(),
        labels: node_labels,
        gateway,
        external: gateway.then(|| ExternalLeg {
            interface: "eth1".to_owned(),
            ip: Ipv4Addr::new(198, 51, 100, 10 + i),
            ip6: None,
            target_port: prefix.name(&format!("x{i}")),
        }),
        name,
    }
}

fn pods_of(prefix: &Prefix, node_index: usize, node: &Node) -> Vec<Pod> {
    let i = node_index + 1;
    PODS_PER_NODE
        .iter()
        .zip(2u8..)
        .map(|(&(namespace, app), host)| {
            let name = format!("{app}-{i}");
            let [a, b, c, _] = node.pod_gateway.octets();
            Pod {
                netns: prefix.netns(&format!("pod-{name}")),
                namespace: namespace.to_owned(),
                node: node.name.clone(),
                interface: "eth0".to_owned(),
                ip: Ipv4Addr::new(a, b, c, host),
                ip6: None,
                labels: labels(&[("app", app)]),
                node_veth: prefix.name(app),
                name,
            }
        })
        .collect()
}

fn echo_port() -> u16 {
    ECHO_PORT
}

fn target(prefix: &Prefix) -> Target {
    Target {
        netns: prefix.netns("target"),
        bridge: prefix.name("ext"),
        ip: Ipv4Addr::new(198, 51, 100, 1),
        ip6: None,
        cidr: EXTERNAL_CIDR.to_owned(),
        whoami_port: WHOAMI_PORT,
        iperf3_port: IPERF3_PORT,
        echo_port: ECHO_PORT,
        free_range: EXTERNAL_FREE_RANGE.to_owned(),
        free_range6: None,
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|&(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn egl() -> Prefix {
        Prefix::new(DEFAULT_PREFIX).unwrap()
    }

    fn interface_names(t: &Topology) -> Vec<&str> {
        let mut names = vec![
            t.underlay.bridge.as_str(),
            &t.control_plane.underlay_port,
            &t.target.bridge,
        ];
        for n in &t.nodes {
            names.extend([n.underlay_port.as_str(), &n.interface, &n.pod_bridge]);
            names.extend(n.external.iter().map(|e| e.target_port.as_str()));
        }
        names.extend(t.pods.iter().map(|p| p.node_veth.as_str()));
        names
    }

    #[test]
    fn every_namespace_carries_the_prefix_and_is_unique() {
        let t = Topology::new(&egl(), MAX_NODES, 2).unwrap();
        let all = t.all_netns();
        assert!(all.iter().all(|n| n.as_str().starts_with("egl-")));
        let mut names: Vec<_> = all.iter().map(|n| n.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    #[test]
    fn a_dual_stack_lab_numbers_its_ipv6_addresses_like_its_ipv4_ones() {
        let t = Topology::new(&egl(), MAX_NODES, 2).unwrap().with_ipv6();
        assert!(t.dual_stack());
        assert!(!Topology::new(&egl(), 3, 2).unwrap().dual_stack());
        let n = &t.nodes[99];
        assert_eq!(n.ip6.unwrap().to_string(), "fd00:172:18::110");
        assert_eq!(n.pod_cidr6.as_deref(), Some("fd00:10:244:100::/64"));
        assert_eq!(n.pod_gateway6.unwrap().to_string(), "fd00:10:244:100::1");
        let ext = t.nodes[1].external.as_ref().unwrap();
        assert_eq!(ext.ip6.unwrap().to_string(), "2001:db8:100::12");
        assert_eq!(t.pods[3].ip6.unwrap().to_string(), "fd00:10:244:2::3");
        assert_eq!(t.target.ip6.unwrap().to_string(), "2001:db8:100::1");
        let cluster: ipnet::Ipv6Net = CLUSTER6_CIDR.parse().unwrap();
        for node in &t.nodes {
            let pods: ipnet::Ipv6Net = node.pod_cidr6.as_deref().unwrap().parse().unwrap();
            assert!(cluster.contains(&pods), "{pods} is outside {CLUSTER6_CIDR}");
        }
        let free = t.target.free_range6.as_deref().unwrap();
        let (first, last) = free.split_once('-').unwrap();
        let external: ipnet::Ipv6Net = EXTERNAL6_CIDR.parse().unwrap();
        for ip in [first, last] {
            let ip: Ipv6Addr = ip.parse().unwrap();
            assert!(external.contains(&ip));
            assert!(
                t.nodes
                    .iter()
                    .all(|n| n.external.as_ref().is_none_or(|e| e.ip6 != Some(ip)))
            );
        }
        let pod = t
            .new_pod("extra", "team-a", &t.nodes[0], BTreeMap::new())
            .unwrap();
        assert_eq!(
            pod.ip6.unwrap().to_string(),
            format!("fd00:10:244:1::{}", pod.ip.octets()[3])
        );
    }

    #[test]
    fn the_default_prefix_keeps_the_names_labs_always_had() {
        let t = Topology::new(&egl(), 3, 2).unwrap();
        assert_eq!(t.control_plane.netns.as_str(), "egl-cp");
        assert_eq!(t.nodes[2].netns.as_str(), "egl-node-3");
        assert_eq!(t.pods[0].netns.as_str(), "egl-pod-web-1");
        assert_eq!(t.underlay.bridge, "egl-br");
        assert_eq!(t.pods[1].node_veth, "egl-batch");
    }

    #[test]
    fn two_prefixes_share_no_namespace_or_interface_name() {
        let a = Topology::new(&egl(), 3, 2).unwrap();
        let b = Topology::new(&Prefix::new("egx").unwrap(), 3, 2).unwrap();
        for ns in a.all_netns() {
            assert!(!b.all_netns().contains(&ns), "{ns} is in both labs");
        }
        for name in interface_names(&a) {
            if name.starts_with("egl-") {
                assert!(
                    !interface_names(&b).contains(&name),
                    "{name} is in both labs"
                );
            }
        }
    }

    #[test]
    fn a_lab_owns_only_the_names_of_its_own_prefix() {
        let egl = egl();
        assert!(egl.owns("egl-node-1").is_some());
        assert!(egl.owns("egx-node-1").is_none());
        assert!(egl.owns("eglx-node-1").is_none());
        assert!(egl.owns("egl").is_none());
        assert!(Prefix::new("eg").unwrap().owns("egl-node-1").is_none());
    }

    #[test]
    fn prefixes_that_could_match_another_labs_names_are_refused() {
        for bad in ["", "egl-x", "EGL", "1ab", "abcdefg", "e_l", "e.l"] {
            let err = Prefix::new(bad).unwrap_err().to_string();
            assert!(err.contains("EGRESSGW_LAB_PREFIX"), "{bad:?}: {err}");
        }
        for good in ["e", "egx", "lab2", "abcdef"] {
            assert!(Prefix::new(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn interface_names_fit_the_kernel_limit_at_the_largest_size() {
        let prefix = Prefix::new("abcdef").unwrap();
        let mut t = Topology::new(&prefix, MAX_NODES, MAX_NODES).unwrap();
        let node = t.nodes[99].clone();
        let added = t
            .new_pod(
                "a-pod-with-a-rather-long-name",
                "team-a",
                &node,
                BTreeMap::new(),
            )
            .unwrap();
        t.pods.push(added);
        for name in interface_names(&t) {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }

    #[test]
    fn a_new_pod_takes_the_first_free_address_of_its_node() {
        let mut t = Topology::new(&egl(), 3, 2).unwrap();
        let node = t.nodes[2].clone();
        let labels = labels(&[("app", "web")]);
        let pod = t
            .new_pod("web-new", "team-a", &node, labels.clone())
            .unwrap();
        assert_eq!(pod.ip, Ipv4Addr::new(10, 244, 3, 4));
        assert_eq!(pod.netns.as_str(), "egl-pod-web-new");
        assert_eq!(pod.node, "node-3");
        assert!(pod.node_veth.starts_with("egl-") && pod.node_veth.len() == 12);
        t.pods.push(pod);
        let again = t.new_pod("web-new", "team-b", &node, labels.clone());
        assert!(again.unwrap_err().to_string().contains("already has a pod"));
        let next = t
            .new_pod("web-next", "team-a", &node, labels.clone())
            .unwrap();
        assert_eq!(next.ip, Ipv4Addr::new(10, 244, 3, 5));
        let dotted = t.new_pod("web.next", "team-a", &node, labels);
        assert!(dotted.unwrap_err().to_string().contains("'.'"));
    }

    #[test]
    fn asking_for_a_missing_node_lists_the_nodes() {
        let t = Topology::new(&egl(), 2, 1).unwrap();
        let err = t.node("node-9").unwrap_err().to_string();
        assert!(
            err.contains("node-9") && err.contains("node-1, node-2"),
            "{err}"
        );
    }

    #[test]
    fn only_the_first_gateways_nodes_are_labelled_and_reach_the_external_segment() {
        let t = Topology::new(&egl(), 3, 2).unwrap();
        let gateways: Vec<_> = t
            .nodes
            .iter()
            .map(|n| n.labels.contains_key(GATEWAY_LABEL))
            .collect();
        assert_eq!(gateways, [true, true, false]);
        let legs: Vec<_> = t
            .nodes
            .iter()
            .map(|n| n.external.as_ref().map(|e| e.ip))
            .collect();
        assert_eq!(
            legs,
            [
                Some(Ipv4Addr::new(198, 51, 100, 11)),
                Some(Ipv4Addr::new(198, 51, 100, 12)),
                None
            ]
        );
    }

    #[test]
    fn pods_take_addresses_from_their_nodes_pod_cidr() {
        let t = Topology::new(&egl(), 2, 1).unwrap();
        let pods: Vec<_> = t
            .pods
            .iter()
            .map(|p| (p.name.as_str(), p.node.as_str(), p.ip))
            .collect();
        assert_eq!(
            pods,
            [
                ("web-1", "node-1", Ipv4Addr::new(10, 244, 1, 2)),
                ("batch-1", "node-1", Ipv4Addr::new(10, 244, 1, 3)),
                ("web-2", "node-2", Ipv4Addr::new(10, 244, 2, 2)),
                ("batch-2", "node-2", Ipv4Addr::new(10, 244, 2, 3)),
            ]
        );
        assert_eq!(t.nodes[1].pod_cidr, "10.244.2.0/24");
        assert_eq!(t.nodes[1].ip, Ipv4Addr::new(172, 18, 0, 12));
    }

    #[test]
    fn sizes_outside_the_supported_range_are_refused() {
        assert!(Topology::new(&egl(), 0, 0).is_err());
        assert!(Topology::new(&egl(), MAX_NODES + 1, 0).is_err());
        assert!(Topology::new(&egl(), 2, 3).is_err());
    }

    #[test]
    fn the_topology_reads_back_as_it_was_written() {
        let t = Topology::new(&egl(), 3, 2).unwrap();
        let text = serde_json::to_string(&t).unwrap();
        let back: Topology = serde_json::from_str(&text).unwrap();
        assert_eq!(serde_json::to_string(&back).unwrap(), text);
    }
}

//! The lab's names and addresses, computed from the node and gateway counts.
//!
//! Pure: nothing here touches the system. Every network namespace name starts
//! with [`PREFIX`], which is how `lab down` finds what a lab left behind, and
//! every address lies in a range that exists only inside the lab's namespaces.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use anyhow::ensure;
use serde::Serialize;

/// Prefix of every network namespace (and lab plumbing interface) the lab creates.
pub const PREFIX: &str = "egl-";
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
pub const EXTERNAL_FREE_RANGE: &str = "198.51.100.200-198.51.100.250";

/// kube-apiserver's port.
pub const API_PORT: u16 = 6443;
/// The target's whoami service port.
pub const WHOAMI_PORT: u16 = 8080;
/// The target's iperf3 server port.
pub const IPERF3_PORT: u16 = 5201;

/// Label that marks a node as gateway-capable.
pub const GATEWAY_LABEL: &str = "egressgw.io/gateway";

/// The pods every node gets: (namespace, app). Pod `k` of node `i` is `<app>-<i>`.
const PODS_PER_NODE: [(&str, &str); 2] = [("team-a", "web"), ("team-b", "batch")];

/// Name of a lab network namespace; always starts with [`PREFIX`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Netns(String);

impl Netns {
    /// The lab namespace `egl-<suffix>`.
    pub fn lab(suffix: &str) -> Self {
        Self(format!("{PREFIX}{suffix}"))
    }

    /// A name read back from `ip netns list`, if it is one of the lab's.
    pub fn existing(name: &str) -> Option<Self> {
        name.starts_with(PREFIX).then(|| Self(name.to_owned()))
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
#[derive(Debug, Clone, Serialize)]
pub struct Topology {
    pub underlay: Underlay,
    pub control_plane: ControlPlane,
    pub namespaces: Vec<Namespace>,
    pub nodes: Vec<Node>,
    pub pods: Vec<Pod>,
    pub target: Target,
}

/// The bridge joining the control plane and the nodes, alone in its namespace.
#[derive(Debug, Clone, Serialize)]
pub struct Underlay {
    pub netns: Netns,
    pub bridge: String,
    pub cidr: &'static str,
}

/// The namespace running etcd, kube-apiserver and kube-controller-manager.
#[derive(Debug, Clone, Serialize)]
pub struct ControlPlane {
    pub netns: Netns,
    pub interface: &'static str,
    pub ip: Ipv4Addr,
    /// The bridge port of `interface`, in the underlay namespace.
    pub underlay_port: String,
    pub api_server: String,
}

/// A Kubernetes namespace the lab's pods live in.
#[derive(Debug, Clone, Serialize)]
pub struct Namespace {
    pub name: &'static str,
    pub labels: BTreeMap<String, String>,
}

/// One node: a namespace on the underlay, with its pods behind a bridge.
#[derive(Debug, Clone, Serialize)]
pub struct Node {
    pub name: String,
    pub netns: Netns,
    /// The underlay interface (the node's "eth0").
    pub interface: &'static str,
    pub ip: Ipv4Addr,
    /// The bridge port of `interface`, in the underlay namespace.
    pub underlay_port: String,
    pub pod_cidr: String,
    /// The node's address on its pod bridge, the pods' default gateway.
    pub pod_gateway: Ipv4Addr,
    /// The pod bridge.
    pub pod_bridge: &'static str,
    pub labels: BTreeMap<String, String>,
    /// Gateway-capable: labelled [`GATEWAY_LABEL`] and attached to the external segment.
    pub gateway: bool,
    /// Set on gateway nodes only: their leg on the external segment.
    pub external: Option<ExternalLeg>,
}

/// A gateway node's interface on the external segment.
#[derive(Debug, Clone, Serialize)]
pub struct ExternalLeg {
    pub interface: &'static str,
    pub ip: Ipv4Addr,
    /// The bridge port of `interface`, in the target namespace.
    pub target_port: String,
}

/// One pod: a namespace attached to its node's pod bridge by a veth.
#[derive(Debug, Clone, Serialize)]
pub struct Pod {
    pub name: String,
    pub namespace: &'static str,
    pub node: String,
    pub netns: Netns,
    pub interface: &'static str,
    pub ip: Ipv4Addr,
    pub labels: BTreeMap<String, String>,
    /// The node's end of the pod's veth, in the node namespace.
    pub node_veth: String,
}

/// The external host: what pods try to reach.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub netns: Netns,
    pub bridge: String,
    pub ip: Ipv4Addr,
    pub cidr: &'static str,
    pub whoami_port: u16,
    pub iperf3_port: u16,
    /// Addresses on the segment that no lab host uses (for EIP pools).
    pub free_range: &'static str,
}

impl Topology {
    /// The lab with `nodes` nodes, the first `gateways` of them gateway-capable.
    pub fn new(nodes: u8, gateways: u8) -> anyhow::Result<Self> {
        ensure!(
            (1..=MAX_NODES).contains(&nodes),
            "--nodes must be between 1 and {MAX_NODES}, not {nodes}"
        );
        ensure!(
            gateways <= nodes,
            "--gateways ({gateways}) cannot exceed --nodes ({nodes})"
        );
        let nodes: Vec<Node> = (1..=nodes).map(|i| node(i, i <= gateways)).collect();
        let pods = nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| pods_of(i, n))
            .collect();
        Ok(Self {
            underlay: Underlay {
                netns: Netns::lab("underlay"),
                bridge: format!("{PREFIX}br"),
                cidr: UNDERLAY_CIDR,
            },
            control_plane: control_plane(),
            namespaces: namespaces(),
            nodes,
            pods,
            target: target(),
        })
    }

    /// Every network namespace, in creation order.
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
}

/// Address with its prefix length, as `ip addr add` takes it.
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

fn control_plane() -> ControlPlane {
    let ip = Ipv4Addr::new(172, 18, 0, 2);
    ControlPlane {
        netns: Netns::lab("cp"),
        interface: "eth0",
        ip,
        underlay_port: format!("{PREFIX}cp"),
        api_server: format!("https://{ip}:{API_PORT}"),
    }
}

fn namespaces() -> Vec<Namespace> {
    ["team-a", "team-b"]
        .into_iter()
        .map(|name| Namespace {
            name,
            labels: labels(&[("team", name.trim_start_matches("team-"))]),
        })
        .collect()
}

fn node(i: u8, gateway: bool) -> Node {
    let name = format!("node-{i}");
    let mut node_labels = labels(&[
        ("kubernetes.io/hostname", &name),
        ("kubernetes.io/os", "linux"),
    ]);
    if gateway {
        node_labels.insert(GATEWAY_LABEL.to_owned(), "true".to_owned());
    }
    Node {
        netns: Netns::lab(&name),
        interface: "eth0",
        ip: Ipv4Addr::new(172, 18, 0, 10 + i),
        underlay_port: format!("{PREFIX}n{i}"),
        pod_cidr: format!("10.244.{i}.0/24"),
        pod_gateway: Ipv4Addr::new(10, 244, i, 1),
        pod_bridge: "cni0",
        labels: node_labels,
        gateway,
        external: gateway.then(|| ExternalLeg {
            interface: "eth1",
            ip: Ipv4Addr::new(198, 51, 100, 10 + i),
            target_port: format!("{PREFIX}x{i}"),
        }),
        name,
    }
}

fn pods_of(node_index: usize, node: &Node) -> Vec<Pod> {
    let i = node_index + 1;
    PODS_PER_NODE
        .iter()
        .zip(2u8..)
        .map(|(&(namespace, app), host)| {
            let name = format!("{app}-{i}");
            let [a, b, c, _] = node.pod_gateway.octets();
            Pod {
                netns: Netns::lab(&format!("pod-{name}")),
                namespace,
                node: node.name.clone(),
                interface: "eth0",
                ip: Ipv4Addr::new(a, b, c, host),
                labels: labels(&[("app", app)]),
                node_veth: format!("{PREFIX}{app}"),
                name,
            }
        })
        .collect()
}

fn target() -> Target {
    Target {
        netns: Netns::lab("target"),
        bridge: format!("{PREFIX}ext"),
        ip: Ipv4Addr::new(198, 51, 100, 1),
        cidr: EXTERNAL_CIDR,
        whoami_port: WHOAMI_PORT,
        iperf3_port: IPERF3_PORT,
        free_range: EXTERNAL_FREE_RANGE,
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

    fn interface_names(t: &Topology) -> Vec<&str> {
        let mut names = vec![
            t.underlay.bridge.as_str(),
            &t.control_plane.underlay_port,
            &t.target.bridge,
        ];
        for n in &t.nodes {
            names.extend([n.underlay_port.as_str(), n.interface, n.pod_bridge]);
            names.extend(n.external.iter().map(|e| e.target_port.as_str()));
        }
        names.extend(t.pods.iter().map(|p| p.node_veth.as_str()));
        names
    }

    #[test]
    fn every_namespace_carries_the_prefix_and_is_unique() {
        let t = Topology::new(MAX_NODES, 2).unwrap();
        let all = t.all_netns();
        assert!(all.iter().all(|n| n.as_str().starts_with(PREFIX)));
        let mut names: Vec<_> = all.iter().map(|n| n.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    #[test]
    fn interface_names_fit_the_kernel_limit_at_the_largest_size() {
        let t = Topology::new(MAX_NODES, MAX_NODES).unwrap();
        for name in interface_names(&t) {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }

    #[test]
    fn only_the_first_gateways_nodes_are_labelled_and_reach_the_external_segment() {
        let t = Topology::new(3, 2).unwrap();
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
        let t = Topology::new(2, 1).unwrap();
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
        assert!(Topology::new(0, 0).is_err());
        assert!(Topology::new(MAX_NODES + 1, 0).is_err());
        assert!(Topology::new(2, 3).is_err());
    }
}

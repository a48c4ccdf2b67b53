//! Builds the lab's network from a [`Topology`]: namespaces, the underlay
//! bridge, node and pod plumbing, host-gw routes, the CNI-like masquerade and
//! the external segment.

use anyhow::Context;

use super::net;
use super::topology::{self, CLUSTER_CIDR, CLUSTER6_CIDR, Netns, Node, Pod, Topology, with_len};

/// Creates every namespace and link of the lab.
pub fn create(topo: &Topology) -> anyhow::Result<()> {
    for ns in topo.all_netns() {
        net::add_netns(ns).with_context(|| format!("creating network namespace {ns}"))?;
    }
    net::add_bridge(&topo.underlay.netns, &topo.underlay.bridge)
        .context("creating the underlay bridge")?;
    net::add_bridge(&topo.target.netns, &topo.target.bridge)
        .context("creating the external segment's bridge")?;
    for ns in [&topo.underlay.netns, &topo.target.netns] {
        net::bridges_without_netfilter(ns)
            .with_context(|| format!("turning br_netfilter off on the wire in {ns}"))?;
    }
    control_plane(topo).context("wiring the control plane to the underlay")?;
    target(topo).context("addressing the target")?;
    for node in &topo.nodes {
        node_links(topo, node).with_context(|| format!("wiring {}", node.name))?;
        node_routes(topo, node).with_context(|| format!("routing on {}", node.name))?;
        masquerade(node).with_context(|| format!("adding the CNI masquerade on {}", node.name))?;
        for pod in topo.pods_on(node) {
            pod_links(node, pod).with_context(|| format!("wiring pod {}", pod.name))?;
        }
    }
    Ok(())
}

/// The control plane reaches pods the way a node does (host-gw routes), so
/// kube-apiserver could call webhooks or aggregated APIs served by pods.
fn control_plane(topo: &Topology) -> anyhow::Result<()> {
    let cp = &topo.control_plane;
    uplink(topo, &cp.underlay_port, &cp.netns, &cp.interface)?;
    net::add_addr(&cp.netns, &cp.interface, &topology::underlay_addr(cp.ip))?;
    if let Some(ip6) = cp.ip6 {
        net::add_addr6(&cp.netns, &cp.interface, &topology::addr6(ip6))?;
    }
    for node in &topo.nodes {
        net::add_route(&cp.netns, &node.pod_cidr, &node.ip.to_string())?;
        if let (Some(pods), Some(via)) = (&node.pod_cidr6, node.ip6) {
            net::add_route(&cp.netns, pods, &via.to_string())?;
        }
    }
    Ok(())
}

/// A veth from the underlay bridge (port `port`) to `interface` in `ns`.
fn uplink(topo: &Topology, port: &str, ns: &Netns, interface: &str) -> anyhow::Result<()> {
    let underlay = &topo.underlay;
    net::add_veth(&underlay.netns, port, ns, interface)?;
    net::set_master(&underlay.netns, port, &underlay.bridge)
}

fn target(topo: &Topology) -> anyhow::Result<()> {
    let target = &topo.target;
    net::add_addr(
        &target.netns,
        &target.bridge,
        &topology::external_addr(target.ip),
    )?;
    match target.ip6 {
        Some(ip6) => net::add_addr6(&target.netns, &target.bridge, &topology::addr6(ip6)),
        None => Ok(()),
    }
}

fn node_links(topo: &Topology, node: &Node) -> anyhow::Result<()> {
    uplink(topo, &node.underlay_port, &node.netns, &node.interface)?;
    net::add_addr(
        &node.netns,
        &node.interface,
        &topology::underlay_addr(node.ip),
    )?;
    net::add_bridge(&node.netns, &node.pod_bridge)?;
    let pod_len = prefix_len(&node.pod_cidr);
    net::add_addr(
        &node.netns,
        &node.pod_bridge,
        &with_len(node.pod_gateway, pod_len),
    )?;
    net::sysctl(&node.netns, "net.ipv4.ip_forward", "1")?;
    if let (Some(ip6), Some(gateway6)) = (node.ip6, node.pod_gateway6) {
        net::add_addr6(&node.netns, &node.interface, &topology::addr6(ip6))?;
        net::add_addr6(&node.netns, &node.pod_bridge, &topology::addr6(gateway6))?;
        net::sysctl(&node.netns, "net.ipv6.conf.all.forwarding", "1")?;
        // `lab node down` takes links down; the kernel would flush their
        // IPv6 addresses, as a node's network configuration would not.
        net::sysctl(&node.netns, "net.ipv6.conf.all.keep_addr_on_down", "1")?;
    }
    if let Some(ext) = &node.external {
        let target = &topo.target;
        net::add_veth(&target.netns, &ext.target_port, &node.netns, &ext.interface)?;
        net::set_master(&target.netns, &ext.target_port, &target.bridge)?;
        net::add_addr(
            &node.netns,
            &ext.interface,
            &topology::external_addr(ext.ip),
        )?;
        if let Some(ip6) = ext.ip6 {
            net::add_addr6(&node.netns, &ext.interface, &topology::addr6(ip6))?;
        }
    }
    Ok(())
}

/// host-gw: every other node's pod CIDR via that node's underlay address.
///
/// A node without an external interface gets a default route through the
/// underlay's router address, which nobody holds: like a private node whose
/// default route leads nowhere, it cannot reach the target by itself, yet
/// has a route for every destination, as real nodes do (loose reverse-path
/// filtering needs one for replies coming back through the tunnel).
///
/// Also what a CNI does when a node's link comes back: the kernel drops
/// routes through a link that goes down, so `lab node up` calls this again
/// (it replaces routes that are there).
pub fn node_routes(topo: &Topology, node: &Node) -> anyhow::Result<()> {
    for other in topo.nodes.iter().filter(|o| o.name != node.name) {
        net::replace_route(&node.netns, &other.pod_cidr, &other.ip.to_string())?;
        if let (Some(pods), Some(via)) = (&other.pod_cidr6, other.ip6) {
            net::replace_route(&node.netns, pods, &via.to_string())?;
        }
    }
    if node.external.is_none() {
        net::replace_route(
            &node.netns,
            "default",
            &topology::UNDERLAY_ROUTER.to_string(),
        )?;
        if node.ip6.is_some() {
            net::replace_route(&node.netns, "::/0", &topology::UNDERLAY6_ROUTER.to_string())?;
        }
    }
    Ok(())
}

/// What CNIs such as flannel do: pod traffic leaving the pod network is
/// masqueraded to the node's address; and Calico's drop of INVALID
/// packets toward pods.
fn masquerade(node: &Node) -> anyhow::Result<()> {
    masquerade_family(node, "iptables", CLUSTER_CIDR)?;
    if node.pod_cidr6.is_some() {
        masquerade_family(node, "ip6tables", CLUSTER6_CIDR)?;
    }
    Ok(())
}

/// [`masquerade`] for one family: `program` is `iptables` or `ip6tables`.
fn masquerade_family(node: &Node, program: &str, cluster: &str) -> anyhow::Result<()> {
    #[rustfmt::skip]
    let rule = [
        "-t", "nat", "-A", "POSTROUTING",
        "-s", cluster, "!", "-d", cluster,
        "-m", "comment", "--comment", "egressgw lab: CNI masquerade",
        "-j", "MASQUERADE",
    ];
    net::exec(&node.netns, program, &rule)?;
    // And what Calico does: a packet conntrack finds INVALID on its way to
    // a pod is dropped. Replies that come back through egressgw's tunnel
    // must not look so.
    #[rustfmt::skip]
    let invalid = [
        "-A", "FORWARD", "-d", cluster,
        "-m", "conntrack", "--ctstate", "INVALID",
        "-m", "comment", "--comment", "egressgw lab: CNI drops INVALID toward pods",
        "-j", "DROP",
    ];
    net::exec(&node.netns, program, &invalid).map(drop)
}

pub fn pod_links(node: &Node, pod: &Pod) -> anyhow::Result<()> {
    net::add_veth(&node.netns, &pod.node_veth, &pod.netns, &pod.interface)?;
    net::set_master(&node.netns, &pod.node_veth, &node.pod_bridge)?;
    let addr = with_len(pod.ip, prefix_len(&node.pod_cidr));
    net::add_addr(&pod.netns, &pod.interface, &addr)?;
    net::add_route(&pod.netns, "default", &node.pod_gateway.to_string())?;
    if let (Some(ip6), Some(gateway6)) = (pod.ip6, node.pod_gateway6) {
        net::add_addr6(&pod.netns, &pod.interface, &topology::addr6(ip6))?;
        net::add_route(&pod.netns, "::/0", &gateway6.to_string())?;
    }
    Ok(())
}

fn prefix_len(cidr: &str) -> u8 {
    cidr.rsplit_once('/')
        .and_then(|(_, len)| len.parse().ok())
        .unwrap_or(32)
}

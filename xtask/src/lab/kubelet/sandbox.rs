//! A Pod's network, as a CNI gives it: the node's network namespace for
//! `hostNetwork` Pods; otherwise a namespace of its own
//! (`<prefix>-pod-<namespace>.<name>`), wired to the node's `cni0` like the
//! lab's own pods, with an address from the upper half of the node's pod
//! CIDR (`.128` to `.254`; `lab pod add` takes the lower half).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use anyhow::{Context, bail};

use crate::lab::build::Fnv1a;
use crate::lab::topology::{Netns, Node, Pod as LabPod, Prefix};
use crate::lab::{net, network};

/// The first host address the stand-in gives a Pod on a node.
pub const FIRST_HOST: u8 = 128;
/// The last one.
const LAST_HOST: u8 = 254;
/// The longest network namespace name made from a Pod's names; longer ones
/// are shortened with a hash.
const MAX_NAME: usize = 200;

/// Where a Pod's containers live on the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    pub netns: Netns,
    pub ip: Ipv4Addr,
    /// Whether the namespace is the Pod's own (made and removed by the
    /// stand-in), not the node's.
    pub owned: bool,
}

/// The network namespace name of a Pod that does not use the host network:
/// a lab pod name never holds a dot, a Kubernetes namespace never does, so
/// this never names a lab pod or another Pod.
pub fn netns_name(prefix: &Prefix, namespace: &str, name: &str) -> Netns {
    let readable = format!("pod-{namespace}.{name}");
    if readable.len() <= MAX_NAME {
        return prefix.netns(&readable);
    }
    prefix.netns(&format!("pod-{namespace}.{:016x}", hash(name)))
}

/// Whether `netns` is one of the namespaces [`netns_name`] makes.
pub fn is_pod_netns(prefix: &Prefix, netns: &str) -> bool {
    netns
        .strip_prefix(&prefix.name("pod-"))
        .is_some_and(|rest| rest.contains('.'))
}

fn hash(text: &str) -> u64 {
    let mut h = Fnv1a::default();
    h.write(text.as_bytes());
    h.finish()
}

/// The first address of `node`'s upper half that `taken` does not hold.
pub fn allocate(node: &Node, taken: &[Ipv4Addr]) -> anyhow::Result<Ipv4Addr> {
    let [a, b, c, _] = node.pod_gateway.octets();
    match (FIRST_HOST..=LAST_HOST)
        .map(|host| Ipv4Addr::new(a, b, c, host))
        .find(|ip| !taken.contains(ip))
    {
        Some(ip) => Ok(ip),
        None => bail!("{} has no free pod address left", node.name),
    }
}

/// Makes the sandbox of a Pod (`uid`) on `node`: its own namespace at `ip`,
/// or the node's for `hostNetwork`.
pub fn create(
    prefix: &Prefix,
    node: &Node,
    namespace: &str,
    name: &str,
    uid: &str,
    host_network: bool,
    taken: &BTreeMap<String, Vec<Ipv4Addr>>,
) -> anyhow::Result<Sandbox> {
    if host_network {
        return Ok(Sandbox {
            netns: node.netns.clone(),
            ip: node.ip,
            owned: false,
        });
    }
    let ip = allocate(node, taken.get(&node.name).map_or(&[][..], Vec::as_slice))?;
    let netns = netns_name(prefix, namespace, name);
    if net::netns_exists(&netns) {
        // Left by an earlier Pod of the same name that was not cleaned up.
        net::delete_netns(&netns).with_context(|| format!("removing the stale {netns}"))?;
    }
    let pod = LabPod {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        node: node.name.clone(),
        netns: netns.clone(),
        interface: "eth0".to_owned(),
        ip,
        // The stand-in's Pods are IPv4 only, also in a dual-stack lab.
        ip6: None,
        labels: BTreeMap::new(),
        node_veth: prefix.name(&format!("{:08x}", hash(uid) & 0xffff_ffff)),
    };
    net::add_netns(&netns).with_context(|| format!("creating {netns}"))?;
    if let Err(e) = network::pod_links(node, &pod) {
        let _ = net::delete_netns(&netns);
        return Err(e.context(format!("wiring {netns} to {}", node.name)));
    }
    Ok(Sandbox {
        netns,
        ip,
        owned: true,
    })
}

/// Removes a sandbox the stand-in made (the veth goes with the namespace).
pub fn remove(sandbox: &Sandbox) -> anyhow::Result<()> {
    if sandbox.owned && net::netns_exists(&sandbox.netns) {
        net::delete_netns(&sandbox.netns).with_context(|| format!("deleting {}", sandbox.netns))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::topology::Topology;

    #[test]
    fn pod_namespaces_never_name_a_lab_pod() {
        let prefix = Prefix::new("egk").unwrap();
        let ns = netns_name(&prefix, "team-a", "web-7d9f-abcde");
        assert_eq!(ns.as_str(), "egk-pod-team-a.web-7d9f-abcde");
        assert!(is_pod_netns(&prefix, ns.as_str()));
        assert!(!is_pod_netns(&prefix, "egk-pod-web-1"));
        assert!(!is_pod_netns(&prefix, "egk-node-1"));
        let long = netns_name(&prefix, "team-a", &"x".repeat(250));
        assert!(long.as_str().len() < 60 && is_pod_netns(&prefix, long.as_str()));
    }

    #[test]
    fn addresses_come_from_the_upper_half_of_the_nodes_cidr() {
        let topo = Topology::new(&Prefix::new("egk").unwrap(), 2, 1).unwrap();
        let node = &topo.nodes[1];
        assert_eq!(allocate(node, &[]).unwrap(), Ipv4Addr::new(10, 244, 2, 128));
        let taken = [Ipv4Addr::new(10, 244, 2, 128)];
        assert_eq!(
            allocate(node, &taken).unwrap(),
            Ipv4Addr::new(10, 244, 2, 129)
        );
        let all: Vec<Ipv4Addr> = (128..=254).map(|h| Ipv4Addr::new(10, 244, 2, h)).collect();
        assert!(allocate(node, &all).is_err());
    }
}

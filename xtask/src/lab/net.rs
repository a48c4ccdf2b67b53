//! Thin wrappers over `ip`, `sysctl` and `iptables`, each run inside one lab
//! namespace.
//!
//! Every function takes the [`Netns`] it acts in, and there is none for the
//! host namespace: the lab never adds a link, address or route there. Veth
//! pairs are created in one lab namespace with their peer placed straight
//! into another, so neither end ever exists in the host namespace.

use std::collections::HashSet;
use std::path::Path;

use anyhow::Context;

use super::cmd;
use super::topology::{Netns, Prefix};

fn ip(ns: &Netns, args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["-n", ns.as_str()];
    all.extend_from_slice(args);
    cmd::run("ip", &all).map(drop)
}

/// Runs `program args...` inside `ns` and returns its stdout.
pub fn exec(ns: &Netns, program: &str, args: &[&str]) -> anyhow::Result<String> {
    exec_with_input(ns, program, args, None)
}

/// Like [`exec`], feeding `input` to the program's stdin.
pub fn exec_with_input(
    ns: &Netns,
    program: &str,
    args: &[&str],
    input: Option<&str>,
) -> anyhow::Result<String> {
    let mut all = vec!["netns", "exec", ns.as_str(), program];
    all.extend_from_slice(args);
    cmd::run_with_input("ip", &all, input)
}

/// Creates `ns` with its loopback up.
pub fn add_netns(ns: &Netns) -> anyhow::Result<()> {
    cmd::run("ip", &["netns", "add", ns.as_str()])?;
    ip(ns, &["link", "set", "lo", "up"])
}

/// Deletes `ns`; its interfaces go with it.
pub fn delete_netns(ns: &Netns) -> anyhow::Result<()> {
    cmd::run("ip", &["netns", "delete", ns.as_str()]).map(drop)
}

/// The namespaces of the lab `prefix` that exist now (from `ip netns list`).
pub fn lab_netns(prefix: &Prefix) -> anyhow::Result<Vec<Netns>> {
    let list = cmd::run("ip", &["netns", "list"])?;
    Ok(list
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter_map(|name| prefix.owns(name))
        .collect())
}

/// Whether `ns` exists.
pub fn netns_exists(ns: &Netns) -> bool {
    Path::new("/run/netns").join(ns.as_str()).exists()
}

/// The pids of the processes whose network namespace is `ns`.
pub fn netns_pids(ns: &Netns) -> anyhow::Result<HashSet<u32>> {
    let out = cmd::run("ip", &["netns", "pids", ns.as_str()])?;
    out.split_whitespace()
        .map(|pid| {
            pid.parse()
                .with_context(|| format!("`ip netns pids` printed {pid:?}"))
        })
        .collect()
}

/// Creates bridge `name` in `ns`, up, with a MAC address of its own.
///
/// A bridge without one takes the lowest MAC of its ports and changes it as
/// ports come and go: a pod that resolved its gateway while a Pod's veth
/// with a lower MAC was a port keeps that MAC in its neighbour cache after
/// the veth is gone, and its frames are flooded to the other ports instead
/// of being routed (and, with `br_netfilter` loaded, masqueraded to the
/// bridge's address on the way) for the half minute it takes the cache to
/// notice. CNI bridges avoid this the same way.
pub fn add_bridge(ns: &Netns, name: &str) -> anyhow::Result<()> {
    let mac = bridge_mac(ns, name);
    ip(
        ns,
        &["link", "add", name, "address", &mac, "type", "bridge"],
    )?;
    link_up(ns, name)
}

/// Makes the bridges of `ns` switch frames only, as a switch does: where
/// `br_netfilter` is loaded (a node's CNI bridge needs it), a bridge would
/// otherwise run each frame through `ns`'s netfilter hooks too.
pub fn bridges_without_netfilter(ns: &Netns) -> anyhow::Result<()> {
    exec(
        ns,
        "sh",
        &[
            "-c",
            "for f in /proc/sys/net/bridge/bridge-nf-call-iptables \
                      /proc/sys/net/bridge/bridge-nf-call-ip6tables \
                      /proc/sys/net/bridge/bridge-nf-call-arptables; do \
               if [ -e $f ]; then echo 0 > $f || exit 1; fi; done",
        ],
    )
    .map(drop)
}

/// A locally administered unicast MAC, stable for the bridge's name.
fn bridge_mac(ns: &Netns, name: &str) -> String {
    let mut hash = super::build::Fnv1a::default();
    hash.write(format!("{ns}/{name}").as_bytes());
    let b = hash.finish().to_be_bytes();
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[3], b[4], b[5], b[6], b[7]
    )
}

/// Creates a veth pair: `name` in `ns`, `peer` in `peer_ns`; both up.
pub fn add_veth(ns: &Netns, name: &str, peer_ns: &Netns, peer: &str) -> anyhow::Result<()> {
    ip(
        ns,
        &[
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            peer_ns.as_str(),
        ],
    )?;
    link_up(ns, name)?;
    link_up(peer_ns, peer)
}

/// Attaches `link` to `bridge`, both in `ns`.
pub fn set_master(ns: &Netns, link: &str, bridge: &str) -> anyhow::Result<()> {
    ip(ns, &["link", "set", link, "master", bridge])
}

pub fn link_up(ns: &Netns, link: &str) -> anyhow::Result<()> {
    ip(ns, &["link", "set", link, "up"])
}

/// Adds `addr` (`a.b.c.d/len`) to `link`.
pub fn add_addr(ns: &Netns, link: &str, addr: &str) -> anyhow::Result<()> {
    ip(ns, &["addr", "add", addr, "dev", link])
}

/// Adds the IPv6 `addr` (`<ip>/<len>`) to `link`, usable at once: the lab
/// numbers its addresses itself, so duplicate address detection would only
/// keep them tentative for a second or two.
pub fn add_addr6(ns: &Netns, link: &str, addr: &str) -> anyhow::Result<()> {
    ip(ns, &["addr", "add", addr, "dev", link, "nodad"])
}

/// Adds a route to `dst` (a CIDR or `default`) via `gateway`.
pub fn add_route(ns: &Netns, dst: &str, gateway: &str) -> anyhow::Result<()> {
    ip(ns, &["route", "add", dst, "via", gateway])
}

/// Adds the route to `dst` via `gateway`, or replaces the one there.
pub fn replace_route(ns: &Netns, dst: &str, gateway: &str) -> anyhow::Result<()> {
    ip(ns, &["route", "replace", dst, "via", gateway])
}

/// Sets a sysctl inside `ns` (`net.*` keys are per namespace).
pub fn sysctl(ns: &Netns, key: &str, value: &str) -> anyhow::Result<()> {
    exec(ns, "sysctl", &["-q", "-w", &format!("{key}={value}")]).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_macs_are_local_unicast_stable_and_differ_by_namespace() {
        let a = bridge_mac(&Netns::parse("e2e-node-1"), "cni0");
        let b = bridge_mac(&Netns::parse("e2e-node-2"), "cni0");
        assert_ne!(a, b);
        assert!(a.starts_with("02:") && a.len() == 17, "{a}");
        assert_eq!(a, bridge_mac(&Netns::parse("e2e-node-1"), "cni0"));
    }
}

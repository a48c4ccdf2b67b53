//! The kernel dataplane with real traffic: two nodes, three pods and an
//! external target, each in a network namespace of its own (see
//! `support/netns.rs` for the picture), `egressgw apply` and `cleanup` run
//! inside the node namespaces, and TCP connections through the result.
//!
//! Needs root, `ip`, `bridge`, `nft`, `iptables-nft`, `iptables-legacy`,
//! `ethtool`, `ss` and `iperf3` (`scripts/setup.sh` installs them). Without
//! root every test prints `SKIPPED <name>: needs root` and passes. Each test
//! builds its own namespaces, so the tests run in parallel.

mod support;

use std::net::IpAddr;
use std::thread;
use std::time::Duration;

use support::cluster::{Egressgw, POOL, POOL6, Policy};
use support::have_root;
use support::netns::{
    Masquerade, NODE_A_IP, NODE_A_IP6, NODE_B_EXTERNAL_IP, NODE_B_EXTERNAL_IP6, Netns, POD_A1_IP,
    POD_A1_IP6, POD_B1_IP, POD_B1_IP6, Stack, TARGET_EXCLUDED_IP, TARGET_IP, TARGET_IP6, Topology,
};
use support::traffic::{
    SOURCE_BYTES, Server, Service, counters, download, ethtool_feature, iperf3, iperf3_client,
    iperf3_report, iperf3_result, iperf3_server, upload, whoami, whoami_from_port,
};

/// The tunnel device's default name.
const VXLAN: &str = "egress.vxlan";
/// Every key at its default but the datapath, which is named: `auto`
/// would take eBPF wherever the test's node can run it.
const DEFAULT_CONFIG: &str = "datapath: nftables\n";
/// [`DEFAULT_CONFIG`] with IPv6 egress on.
const DUAL_STACK_CONFIG: &str = "datapath: nftables\nenableIPv6: true\n";
/// The eBPF datapath (each node gets a bpf filesystem of its own).
const EBPF_CONFIG: &str = "datapath: ebpf\n";
const EBPF_DUAL_STACK_CONFIG: &str = "datapath: ebpf\nenableIPv6: true\n";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("a valid test address")
}

/// Applies the objects on the gateway node B, then on node A.
fn apply_both(topo: &Topology, policy: &Policy, config: &str) -> Egressgw {
    let gw = Egressgw::new(topo.dir(), topo.stack, policy, config);
    gw.apply_ok(&topo.node_b, "node-b");
    gw.apply_ok(&topo.node_a, "node-a");
    gw
}

/// Fails the test unless a whoami from `from` to `target_ip` is answered
/// with `expected`.
fn assert_seen_as(from: &Netns, target_ip: &str, expected: IpAddr, why: &str) {
    match whoami(from, target_ip) {
        Ok(seen) => assert_eq!(seen, expected, "{} -> {target_ip}: {why}", from.name()),
        Err(e) => panic!("{} -> {target_ip} ({why}): {e}", from.name()),
    }
}

/// The planned EIP of the test policy, checked to lie in the pool.
fn eip(gw: &Egressgw) -> IpAddr {
    let eip = gw.planned_eip();
    let (first, last) = POOL.split_once('-').expect("the pool is a range");
    let range = ip(first)..=ip(last);
    assert!(range.contains(&IpAddr::V4(eip)), "{eip} is not in {POOL}");
    IpAddr::V4(eip)
}

/// The planned IPv6 EIP of the dual-stack test policy, checked to lie in
/// the IPv6 pool.
fn eip6(gw: &Egressgw) -> IpAddr {
    let eip = gw.planned_eip6();
    let (first, last) = POOL6.split_once('-').expect("the pool is a range");
    let range = ip(first)..=ip(last);
    assert!(range.contains(&IpAddr::V6(eip)), "{eip} is not in {POOL6}");
    IpAddr::V6(eip)
}

/// pod-a1 -> pod-b1 at `pod_b1_ip` keeps the pod source (`pod_a1_ip`) and a
/// 4 MiB upload does not go through node A's tunnel.
fn assert_in_cluster_traffic_stays_out_of_the_tunnel(
    topo: &Topology,
    pod_b1_ip: &str,
    pod_a1_ip: &str,
) {
    let before = counters(&topo.node_a, VXLAN);
    assert_seen_as(
        &topo.pod_a1,
        pod_b1_ip,
        ip(pod_a1_ip),
        "pod to pod keeps the pod source",
    );
    let sent = 4 << 20;
    assert_eq!(
        upload(&topo.pod_a1, pod_b1_ip, sent),
        Ok(sent),
        "pod-a1 -> pod-b1 upload to {pod_b1_ip}"
    );
    let after = counters(&topo.node_a, VXLAN);
    // Not zero: the kernel may send IPv6 control packets (router and
    // neighbour solicitations, MLD) on a new device. Far below the upload.
    let tunnelled = after.tx_bytes.saturating_sub(before.tx_bytes);
    assert!(
        tunnelled < 64 * 1024,
        "{tunnelled} bytes left node A through {VXLAN} during a {sent}-byte in-cluster upload to {pod_b1_ip}"
    );
}

/// `apply` run again on both nodes applies nothing.
fn assert_a_second_apply_changes_nothing(topo: &Topology, gw: &Egressgw) {
    for (ns, node) in [(&topo.node_a, "node-a"), (&topo.node_b, "node-b")] {
        let second = gw.apply_ok(ns, node);
        assert!(
            second.applied.is_empty(),
            "the second apply on {node} changed things: {:#}",
            second.json
        );
    }
}

/// A download by pod-a1 from the target at `target_ip` comes back through
/// the tunnel to node A, every byte of it: node B sends it to node A's
/// tunnel port. (Node A's `egress.vxlan` sees only part of it when the
/// eBPF datapath takes fast-path packets out of the tunnel on the
/// underlay interface.)
fn assert_download_returns_through_the_tunnel(topo: &Topology, target_ip: &str) {
    let counted = TunnelToA::count(&topo.node_b);
    assert_eq!(
        download(&topo.pod_a1, target_ip),
        Ok(SOURCE_BYTES),
        "download from {target_ip}"
    );
    let returned = counted.bytes();
    assert!(
        returned >= SOURCE_BYTES as u64,
        "only {returned} bytes went through the tunnel to node A for a {SOURCE_BYTES}-byte download from {target_ip}"
    );
}

/// An nftables counter on node B of what it sends into the tunnel to node
/// A (the outer UDP packets, headers included); removed when dropped.
struct TunnelToA<'a>(&'a Netns);

impl<'a> TunnelToA<'a> {
    const TABLE: &'static str = "tunnel_to_a";

    fn count(node_b: &'a Netns) -> Self {
        let t = Self::TABLE;
        for command in [
            format!("add table ip {t}"),
            format!("add chain ip {t} out {{ type filter hook postrouting priority 0 ; }}"),
            format!("add rule ip {t} out ip daddr {NODE_A_IP} udp dport 7789 counter"),
        ] {
            node_b.run("nft", &[&command]);
        }
        TunnelToA(node_b)
    }

    fn bytes(&self) -> u64 {
        nft_counter(
            &self.0.run("nft", &["list", "table", "ip", Self::TABLE]),
            "bytes",
        )
    }
}

impl Drop for TunnelToA<'_> {
    fn drop(&mut self) {
        let _ = self
            .0
            .command("nft", &["delete", "table", "ip", Self::TABLE])
            .status();
    }
}

#[test]
fn without_egressgw_a_pod_reaches_the_target_from_its_node_ip() {
    if !have_root("without_egressgw_a_pod_reaches_the_target_from_its_node_ip") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let _pod_b1 = Server::start(&topo.pod_b1, Service::Whoami);

    let node_a = ip(NODE_A_IP);
    assert_seen_as(&topo.pod_a1, TARGET_IP, node_a, "masqueraded by node A");
    assert_seen_as(&topo.pod_a2, TARGET_IP, node_a, "masqueraded by node A");
    assert_seen_as(
        &topo.pod_a1,
        TARGET_EXCLUDED_IP,
        node_a,
        "masqueraded by node A",
    );
    let node_b = ip(NODE_B_EXTERNAL_IP);
    assert_seen_as(&topo.pod_b1, TARGET_IP, node_b, "masqueraded by node B");
    assert_seen_as(
        &topo.pod_a1,
        POD_B1_IP,
        ip(POD_A1_IP),
        "pods talk without NAT",
    );
}

/// A selected pod on node A reaches the target from the EIP, whatever
/// masquerade the CNI installed on the nodes.
fn selected_pod_leaves_from_the_eip(masquerade: Masquerade) {
    let topo = Topology::new(masquerade);
    let _target = Server::start(&topo.target, Service::Whoami);
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "selected by team-a/web");
}

#[test]
fn a_selected_pod_reaches_the_target_from_the_egress_ip() {
    if !have_root("a_selected_pod_reaches_the_target_from_the_egress_ip") {
        return;
    }
    selected_pod_leaves_from_the_eip(Masquerade::None);
}

#[test]
fn a_selected_pod_leaves_from_the_egress_ip_despite_an_iptables_nft_masquerade() {
    if !have_root("a_selected_pod_leaves_from_the_egress_ip_despite_an_iptables_nft_masquerade") {
        return;
    }
    selected_pod_leaves_from_the_eip(Masquerade::Nft);
}

#[test]
fn a_selected_pod_leaves_from_the_egress_ip_despite_an_iptables_legacy_masquerade() {
    if !have_root("a_selected_pod_leaves_from_the_egress_ip_despite_an_iptables_legacy_masquerade")
    {
        return;
    }
    selected_pod_leaves_from_the_eip(Masquerade::Legacy);
}

#[test]
fn unselected_pods_excluded_destinations_and_in_cluster_traffic_leave_the_normal_way() {
    if !have_root(
        "unselected_pods_excluded_destinations_and_in_cluster_traffic_leave_the_normal_way",
    ) {
        return;
    }
    only_selected_traffic_takes_the_tunnel(DEFAULT_CONFIG);
}

#[test]
fn with_the_ebpf_datapath_only_selected_traffic_takes_the_tunnel() {
    if !have_root("with_the_ebpf_datapath_only_selected_traffic_takes_the_tunnel") {
        return;
    }
    only_selected_traffic_takes_the_tunnel(EBPF_CONFIG);
}

fn only_selected_traffic_takes_the_tunnel(config: &str) {
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let _pod_b1 = Server::start(&topo.pod_b1, Service::Whoami);
    let _pod_b1_sink = Server::start(&topo.pod_b1, Service::Sink);
    // Every destination outside the cluster but 198.51.100.2: in-cluster
    // destinations must stay out of the tunnel because they are in-cluster,
    // not because the policy does not name them.
    let policy = Policy {
        dest_subnet: Vec::new(),
        exclude_subnet: vec!["198.51.100.2/32"],
        use_node_ip: false,
    };
    let gw = apply_both(&topo, &policy, config);
    let node_a = ip(NODE_A_IP);

    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "the policy is in force");
    assert_seen_as(&topo.pod_a2, TARGET_IP, node_a, "pod-a2 is not selected");
    assert_seen_as(
        &topo.pod_a1,
        TARGET_EXCLUDED_IP,
        node_a,
        "198.51.100.2 is excluded",
    );

    assert_in_cluster_traffic_stays_out_of_the_tunnel(&topo, POD_B1_IP, POD_A1_IP);
}

/// The packets the eBPF classifier counted for the test's policy, as the
/// next `apply` on `node` reports them; that apply changes nothing.
fn ebpf_packets(gw: &Egressgw, ns: &Netns, node: &str) -> u64 {
    policy_traffic(gw, ns, node, "ebpf").0
}

/// The packets and bytes node `node`'s `datapath` counted for team-a/web,
/// read by a one-shot apply (which must change nothing).
fn policy_traffic(gw: &Egressgw, ns: &Netns, node: &str, datapath: &str) -> (u64, u64) {
    let report = gw.apply_ok(ns, node);
    assert!(report.applied.is_empty(), "{node}: {:?}", report.applied);
    let facts = &report.json["facts"];
    assert!(
        facts["datapath"]
            .as_str()
            .is_some_and(|d| d.starts_with(datapath)),
        "{node}: {facts}"
    );
    // "N packets, M bytes"
    facts["traffic of team-a/web"]
        .as_str()
        .and_then(|t| {
            let words: Vec<&str> = t.split(' ').collect();
            Some((words.first()?.parse().ok()?, words.get(2)?.parse().ok()?))
        })
        .unwrap_or_else(|| panic!("{node}: no counter for team-a/web: {facts}"))
}

#[test]
fn with_the_ebpf_datapath_selected_pods_leave_from_the_egress_ip_and_are_counted() {
    if !have_root("with_the_ebpf_datapath_selected_pods_leave_from_the_egress_ip_and_are_counted") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let _source = Server::start(&topo.target, Service::Source);
    let gw = apply_both(&topo, &Policy::default(), EBPF_CONFIG);
    let before_a = ebpf_packets(&gw, &topo.node_a, "node-a");
    let before_b = ebpf_packets(&gw, &topo.node_b, "node-b");
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP,
        eip(&gw),
        "selected, through the tunnel",
    );
    assert_seen_as(
        &topo.pod_b1,
        TARGET_IP,
        eip(&gw),
        "selected, on the gateway node",
    );
    // The program classified them (the table would have too: the counter
    // is the proof that it was the program).
    let after_a = ebpf_packets(&gw, &topo.node_a, "node-a");
    let after_b = ebpf_packets(&gw, &topo.node_b, "node-b");
    assert!(after_a > before_a, "node-a counted {before_a} -> {after_a}");
    assert!(after_b > before_b, "node-b counted {before_b} -> {after_b}");
    // Replies come back beside the CNI's INVALID drop, and a long transfer
    // completes.
    assert_download_returns_through_the_tunnel(&topo, TARGET_IP);
    // The fast path: pod-a1's TCP connections went into the tunnel and
    // their replies to the pod without node A's netfilter (no connection
    // tracked there); pod-b1's, on the gateway node, are SNATed there.
    let tracked = topo.node_a.run(
        "conntrack",
        &["-L", "-p", "tcp", "-s", POD_A1_IP, "-d", TARGET_IP],
    );
    assert!(
        tracked.trim().is_empty(),
        "node A tracked pod-a1's connections: {tracked}"
    );
}

/// Pod-a1's connections (from `pod`) to the target's `port` at `target`
/// as node `ns`'s conntrack holds them: each one's state and the bytes it
/// counted in the original and the reply direction (`nf_conntrack_acct`
/// on).
fn tracked(ns: &Netns, pod: &str, target: &str, port: u16) -> Vec<(String, u64, u64)> {
    let port = port.to_string();
    let family = if target.contains(':') { "ipv6" } else { "ipv4" };
    let listing = ns.run(
        "conntrack",
        &[
            "-L", "-f", family, "-p", "tcp", "-s", pod, "-d", target, "--dport", &port,
        ],
    );
    listing
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let state = (*words.get(3)?).to_owned();
            let bytes: Vec<u64> = words
                .iter()
                .filter_map(|w| w.strip_prefix("bytes=")?.parse().ok())
                .collect();
            Some((state, *bytes.first()?, *bytes.get(1)?))
        })
        .collect()
}

/// The gateway fast path's fact in `report`: (held, taken over).
fn gateway_fast_path(report: &support::cluster::Reconcile) -> Option<(u64, u64)> {
    // "N connections held; T taken over, L left to the stack"
    let fact = report.json["facts"]["gateway fast path"].as_str()?;
    let words: Vec<&str> = fact
        .split([' ', ';', ','])
        .filter(|w| !w.is_empty())
        .collect();
    Some((words.first()?.parse().ok()?, words.get(3)?.parse().ok()?))
}

#[test]
fn with_the_ebpf_datapath_the_gateway_translates_established_connections_past_its_stack() {
    if !have_root(
        "with_the_ebpf_datapath_the_gateway_translates_established_connections_past_its_stack",
    ) {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    the_gateway_translates_established_connections_past_its_stack(
        &topo,
        Stack::Ipv4,
        &Policy::default(),
        EBPF_CONFIG,
        (POD_A1_IP, TARGET_IP),
    );
}

#[test]
fn with_the_ebpf_datapath_the_gateway_translates_established_ipv6_connections_past_its_stack() {
    if !have_root(
        "with_the_ebpf_datapath_the_gateway_translates_established_ipv6_connections_past_its_stack",
    ) {
        return;
    }
    let topo = Topology::dual_stack(Masquerade::Nft);
    the_gateway_translates_established_connections_past_its_stack(
        &topo,
        Stack::Dual,
        &Policy::dual_stack(),
        EBPF_DUAL_STACK_CONFIG,
        (POD_A1_IP6, TARGET_IP6),
    );
}

#[test]
fn with_the_ebpf_datapath_fast_path_packets_leave_the_tunnel_on_the_underlay() {
    if !have_root("with_the_ebpf_datapath_fast_path_packets_leave_the_tunnel_on_the_underlay") {
        return;
    }
    // IPv4 and IPv6 connections, both in the IPv4 underlay.
    let topo = Topology::dual_stack(Masquerade::Nft);
    let _target = Server::start_for(&topo.target, Service::Whoami, Stack::Dual);
    let _echo = support::process::Background::spawn(&mut topo.target.command(
        env!("CARGO_BIN_EXE_egressgw"),
        &["bench-echo", "--port", "5202"],
    ));
    let gw = apply_both(&topo, &Policy::dual_stack(), EBPF_DUAL_STACK_CONFIG);
    // The gateway's fast path takes connections over in a running agent.
    let (_agent, reports) = gw.apply_every(&topo.node_b, "node-b", 1);
    let first = reports
        .recv_timeout(Duration::from_secs(30))
        .expect("apply --every reports its first reconcile");
    assert!(first.failed.is_empty(), "{:#}", first.json);

    // 2 000 small exchanges on one connection per family: no segmentation
    // offload, every packet one frame in the tunnel. Taken out of the
    // tunnel on the underlay interfaces, they pass neither node's
    // egress.vxlan.
    const EXCHANGES: u64 = 2000;
    for (target, eip, min_headers) in [
        (TARGET_IP, eip(&gw), 20 + 20 + 5),
        (TARGET_IP6, eip6(&gw), 40 + 20 + 5),
    ] {
        assert_seen_as(&topo.pod_a1, target, eip, "selected");
        let before = (counters(&topo.node_a, VXLAN), counters(&topo.node_b, VXLAN));
        let script = format!(
            "exec 3<>/dev/tcp/{target}/5202 && for i in $(seq {EXCHANGES}); do \
             echo ping >&3 && read -r -u 3 line && [ \"$line\" = ping ] || exit 1; done"
        );
        topo.pod_a1.run("bash", &["-c", &script]);
        let after = (counters(&topo.node_a, VXLAN), counters(&topo.node_b, VXLAN));
        // Through the device, each exchange would count a packet of at
        // least the IP and TCP headers and 5 bytes at each end (the device
        // counts from the IP header).
        let through_device = EXCHANGES * min_headers;
        let at_a = after.0.rx_bytes - before.0.rx_bytes;
        let at_b = after.1.rx_bytes - before.1.rx_bytes;
        assert!(
            at_a < through_device / 10 && at_b < through_device / 10,
            "{EXCHANGES} exchanges with {target}: {at_a} bytes came in by node A's {VXLAN}, \
             {at_b} by node B's (through the device they would be {through_device} or more each)"
        );
    }
    // And each node counts what it took: node B the pods' packets it sent
    // out, node A the replies it handed to the pod (an apply adopts the
    // pinned counters).
    let _ = reports.try_iter().count();
    let at_b = reports
        .recv_timeout(Duration::from_secs(30))
        .expect("a reconcile after the exchanges");
    let at_a = gw.apply_ok(&topo.node_a, "node-a");
    for (node, report, way) in [("B", &at_b, "out"), ("A", &at_a, "to pods")] {
        let packets = tunnel_end(report, way);
        assert!(
            packets.is_some_and(|p| p >= 2 * EXCHANGES),
            "node {node}'s tunnel end counted {packets:?} packets {way} for {EXCHANGES} \
             exchanges in each family: {:#}",
            report.json["facts"]
        );
    }
}

/// The packets the tunnel end's fact in `report` counts `way` ("to pods"
/// or "out").
fn tunnel_end(report: &support::cluster::Reconcile, way: &str) -> Option<u64> {
    // "P packets (B bytes) to pods, P packets (B bytes) out, taken out ..."
    let fact = report.json["facts"]["tunnel end"].as_str()?;
    fact.split(", ")
        .find(|part| part.ends_with(way))?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// Packets the target took in so far from the address its `seen` table
/// counts.
fn target_packets_seen(topo: &Topology) -> u64 {
    nft_counter(
        &topo
            .target
            .run("nft", &["list", "chain", "ip", "seen", "input"]),
        "packets",
    )
}

/// The `packets` or `bytes` of the first counter in an nftables listing.
fn nft_counter(listing: &str, what: &str) -> u64 {
    listing
        .split_whitespace()
        .skip_while(|w| *w != what)
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {listing}"))
}

#[test]
fn with_the_ebpf_datapath_a_gateway_sends_nothing_more_from_an_eip_it_gave_up() {
    if !have_root("with_the_ebpf_datapath_a_gateway_sends_nothing_more_from_an_eip_it_gave_up") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let gw = apply_both(&topo, &Policy::default(), EBPF_CONFIG);
    let eip = eip(&gw);
    // The target counts what comes from the EIP.
    for command in [
        "add table ip seen".to_owned(),
        "add chain ip seen input { type filter hook input priority 0; }".to_owned(),
        format!("add rule ip seen input ip saddr {eip} counter"),
    ] {
        topo.target.run("nft", &[&command]);
    }
    let (agent, reports) = gw.apply_every(&topo.node_b, "node-b", 1);
    let limit = Duration::from_secs(30);
    reports.recv_timeout(limit).expect("the first reconcile");
    let _server = iperf3_server(&topo.target);
    let seconds = 8;
    let client = iperf3_client(&topo.pod_a1, TARGET_IP, seconds);
    thread::sleep(Duration::from_secs(2));
    let taken = reports
        .try_iter()
        .last()
        .or_else(|| reports.recv_timeout(limit).ok())
        .and_then(|r| gateway_fast_path(&r))
        .map(|(_, taken)| taken);
    assert!(
        taken.is_some_and(|t| t >= 1),
        "the upload was not taken over: {taken:?}"
    );
    assert!(target_packets_seen(&topo) > 0);

    // The EIP leaves the gateway's pool: the policy gets another one, and
    // node B gives the first up. The upload's connection stays bound to
    // the first in conntrack, and the gateway's guard drops what would
    // leave with it; the fast path must not send it past the guard.
    drop(agent);
    let objects = support::cluster::objects_yaml(&Policy::default(), Stack::Ipv4);
    let (first, rest) = POOL.split_once('-').expect("a range");
    assert_eq!(
        first,
        eip.to_string(),
        "the EIP is the pool's first address"
    );
    let smaller = format!("198.51.100.201-{rest}");
    assert!(objects.contains(POOL));
    std::fs::write(
        topo.dir().join("objects.yaml"),
        objects.replace(POOL, &smaller),
    )
    .expect("writing objects.yaml");
    gw.apply_ok(&topo.node_b, "node-b");
    thread::sleep(Duration::from_millis(500));
    let after_release = target_packets_seen(&topo);
    thread::sleep(Duration::from_secs(2));
    let later = target_packets_seen(&topo);
    assert_eq!(
        later,
        after_release,
        "the target took {} more packets from the EIP node B gave up",
        later - after_release
    );
    drop(client);
}

/// Pod-a1 downloads from and uploads to the target at `addresses.1`
/// through gateway node B, which runs an agent (`apply --every`): both
/// arrive whole, B's conntrack saw each connection open and close and
/// hardly any of its bytes, and the agent took them over.
fn the_gateway_translates_established_connections_past_its_stack(
    topo: &Topology,
    stack: Stack,
    policy: &Policy,
    config: &str,
    (pod, target): (&str, &str),
) {
    let _source = Server::start_for(&topo.target, Service::Source, stack);
    let _sink = Server::start_for(&topo.target, Service::Sink, stack);
    // Conntrack on the gateway node counts what passes it.
    topo.node_b.sysctl("net.netfilter.nf_conntrack_acct", "1");
    let gw = apply_both(topo, policy, config);
    // The gateway's fast path takes connections over in a running agent.
    let (agent, reports) = gw.apply_every(&topo.node_b, "node-b", 1);
    let limit = Duration::from_secs(30);
    let first = reports
        .recv_timeout(limit)
        .expect("apply --every reports its first reconcile");
    assert!(first.failed.is_empty(), "{:#}", first.json);
    assert_eq!(
        gateway_fast_path(&first).map(|(held, _)| held),
        Some(0),
        "{:#}",
        first.json
    );

    // Both directions arrive whole: the target's data to the pod, and the
    // pod's to the target, which takes only segments addressed from the
    // connection's EIP and port. First with the veths' offloads (the TCP
    // checksums are left to a device, and only the pseudo-header's part
    // is changed on the way), then with the ends computing and checking
    // every checksum themselves, so that a checksum the translation got
    // wrong loses the segment.
    for offloads in ["on", "off"] {
        for end in [&topo.pod_a1, &topo.target] {
            end.run("ethtool", &["-K", "eth0", "tx", offloads, "rx", offloads]);
        }
        assert_download_returns_through_the_tunnel(topo, target);
        assert_eq!(
            upload(&topo.pod_a1, target, SOURCE_BYTES),
            Ok(SOURCE_BYTES),
            "upload to {target}, offloads {offloads}"
        );
    }

    // Node B's conntrack saw each connection open and close (FIN and RST
    // go through the stack), and hardly any of the bytes between.
    let half = SOURCE_BYTES as u64 / 2;
    let downloads = tracked(&topo.node_b, pod, target, support::traffic::SOURCE_PORT);
    let uploads = tracked(&topo.node_b, pod, target, support::traffic::SINK_PORT);
    assert!(
        !downloads.is_empty() && !uploads.is_empty(),
        "node B tracks {downloads:?} and {uploads:?}"
    );
    for (state, original, reply) in downloads.iter().chain(&uploads) {
        assert!(
            ["TIME_WAIT", "CLOSE", "LAST_ACK", "CLOSE_WAIT", "FIN_WAIT"].contains(&state.as_str()),
            "a connection node B saw the end of is {state}: downloads {downloads:?}, uploads {uploads:?}"
        );
        assert!(
            *original < half && *reply < half,
            "node B's conntrack counted {original} and {reply} bytes of one connection: \
             its packets went through the stack (downloads {downloads:?}, uploads {uploads:?})"
        );
    }

    // The agent says so.
    thread::sleep(Duration::from_millis(1500));
    let last = reports
        .try_iter()
        .last()
        .or_else(|| reports.recv_timeout(limit).ok())
        .expect("apply --every goes on reporting");
    let (_, taken) = gateway_fast_path(&last)
        .unwrap_or_else(|| panic!("no gateway fast path fact: {:#}", last.json));
    assert!(taken >= 4, "{:#}", last.json["facts"]);
    drop(agent);
}

#[test]
fn with_the_ebpf_datapath_a_policys_counter_holds_what_iperf3_sent_and_its_headers() {
    if !have_root("with_the_ebpf_datapath_a_policys_counter_holds_what_iperf3_sent_and_its_headers")
    {
        return;
    }
    assert_the_counter_holds_what_iperf3_sent(EBPF_CONFIG, "ebpf");
}

#[test]
fn with_the_nftables_datapath_a_policys_counter_holds_what_iperf3_sent_and_its_headers() {
    if !have_root(
        "with_the_nftables_datapath_a_policys_counter_holds_what_iperf3_sent_and_its_headers",
    ) {
        return;
    }
    assert_the_counter_holds_what_iperf3_sent(DEFAULT_CONFIG, "nftables");
}

/// On `datapath` (chosen by `config`), the test policy's counter on the
/// source node rises by what a 2 s iperf3 upload of pod-a1 sent, and by no
/// more than that with its headers.
fn assert_the_counter_holds_what_iperf3_sent(config: &str, datapath: &str) {
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let gw = apply_both(&topo, &Policy::default(), config);
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "selected");
    let seconds = 2;
    let (packets_before, bytes_before) = policy_traffic(&gw, &topo.node_a, "node-a", datapath);
    let report = {
        let _server = iperf3_server(&topo.target);
        iperf3_report(iperf3_client(&topo.pod_a1, TARGET_IP, seconds), seconds)
            .unwrap_or_else(|e| panic!("iperf3 pod-a1 -> target: {e}"))
    };
    let (packets_after, bytes_after) = policy_traffic(&gw, &topo.node_a, "node-a", datapath);
    let (packets, counted) = (packets_after - packets_before, bytes_after - bytes_before);
    let end = &report["end"];
    let sent = end["sum_sent"]["bytes"]
        .as_u64()
        .expect("iperf3 reports the bytes sent");
    let received = end["sum_received"]["bytes"]
        .as_u64()
        .expect("iperf3 reports the bytes received");
    let retransmits = end["sum_sent"]["retransmits"].as_u64().unwrap_or(0);
    // What the pod sent through the classifier: the test's payload (every
    // byte the target received went by it), each packet's Ethernet (eBPF
    // only), IP and TCP headers at most once per packet counted (a segmentation offload's
    // packet carries one set for many segments), segments sent again, and
    // the control connection iperf3 opens beside the test's.
    const HEADERS: u64 = 14 + 60 + 60;
    const CONTROL: u64 = 16 * 1024;
    let most = sent + packets * HEADERS + retransmits * 1500 + CONTROL;
    eprintln!(
        "iperf3 sent {sent} bytes, the target received {received}, {retransmits} retransmits; \
         {datapath} counted {packets} packets, {counted} bytes (at most {most})"
    );
    assert!(received > 0, "iperf3 moved no data");
    assert!(
        counted >= received,
        "the counter shows {counted} bytes, fewer than the {received} the target received"
    );
    assert!(
        counted <= most,
        "the counter shows {counted} bytes in {packets} packets, more than the {sent} iperf3 sent \
         and their headers ({most})"
    );
}

#[test]
fn with_the_ebpf_datapath_cleanup_leaves_each_node_as_it_was() {
    if !have_root("with_the_ebpf_datapath_cleanup_leaves_each_node_as_it_was") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let gw = apply_both(&topo, &Policy::default(), EBPF_CONFIG);
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "selected");
    for ns in [&topo.node_a, &topo.node_b] {
        assert!(gw.has_pins(ns), "{}: the classifier is pinned", ns.name());
        gw.cleanup(ns);
        // No process holds the attachments: without their pins they are
        // gone.
        assert!(!gw.has_pins(ns), "{}: pins left after cleanup", ns.name());
    }
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP,
        ip(NODE_A_IP),
        "back to the normal way",
    );
}

#[test]
fn a_selected_pod_on_the_gateway_node_is_snatted_to_the_egress_ip() {
    if !have_root("a_selected_pod_on_the_gateway_node_is_snatted_to_the_egress_ip") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    assert_seen_as(
        &topo.pod_b1,
        TARGET_IP,
        eip(&gw),
        "pod-b1 is selected, on the gateway",
    );
}

#[test]
fn a_connection_attempt_that_left_the_normal_way_before_its_pod_was_selected_gets_through_at_once()
{
    if !have_root(
        "a_connection_attempt_that_left_the_normal_way_before_its_pod_was_selected_gets_through_at_once",
    ) {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    // The target allows the EIPs only, as a partner's allowlist does: what
    // leaves with a node's address is dropped, unanswered.
    for cmd in [
        "add table ip allowlist".to_owned(),
        "add chain ip allowlist input { type filter hook input priority 0 ; }".to_owned(),
        format!(
            "add rule ip allowlist input tcp dport 8080 ip saddr {{ {NODE_A_IP}, {NODE_B_EXTERNAL_IP} }} drop"
        ),
    ] {
        topo.target.run("nft", &[&cmd]);
    }
    // Before the policy: each pod's attempt leaves masqueraded and stays
    // unanswered, its conntrack entry on the node waiting for an answer.
    let attempts = [
        (&topo.pod_a1, 40_001, "pod-a1 on node A"),
        (&topo.pod_b1, 40_002, "pod-b1 on the gateway node B"),
    ];
    for (pod, port, what) in attempts {
        let seen = whoami_from_port(pod, TARGET_IP, port, Duration::from_millis(800));
        assert!(
            seen.is_err(),
            "{what}: the target dropped the node's address, yet saw {seen:?}"
        );
    }
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    // The same tuple again (a retransmission, or a port used again): the
    // first SYN must get through with the EIP, not stall behind the old
    // entry's masquerade binding.
    for (pod, port, what) in attempts {
        match whoami_from_port(pod, TARGET_IP, port, Duration::from_millis(800)) {
            Ok(seen) => assert_eq!(seen, eip(&gw), "{what}"),
            Err(e) => {
                panic!("{what}: the attempt from the same port after the policy stalled: {e}")
            }
        }
    }
}

#[test]
fn a_use_node_ip_policy_leaves_from_the_gateway_node_ip() {
    if !have_root("a_use_node_ip_policy_leaves_from_the_gateway_node_ip") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let policy = Policy {
        use_node_ip: true,
        ..Policy::default()
    };
    apply_both(&topo, &policy, DEFAULT_CONFIG);
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP,
        ip(NODE_B_EXTERNAL_IP),
        "useNodeIP: the gateway's own address",
    );
}

#[test]
fn replies_return_through_the_tunnel_and_a_long_transfer_completes() {
    if !have_root("replies_return_through_the_tunnel_and_a_long_transfer_completes") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _whoami = Server::start(&topo.target, Service::Whoami);
    let _source = Server::start(&topo.target, Service::Source);
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "selected by team-a/web");

    assert_download_returns_through_the_tunnel(&topo, TARGET_IP);

    let seconds = 4;
    let before = counters(&topo.node_a, VXLAN);
    let received = iperf3(&topo.pod_a1, &topo.target, TARGET_IP, seconds)
        .unwrap_or_else(|e| panic!("iperf3 pod-a1 -> target: {e}"));
    let after = counters(&topo.node_a, VXLAN);
    assert!(received > 0, "iperf3 moved no data");
    let tunnelled = after.tx_bytes.saturating_sub(before.tx_bytes);
    assert!(
        tunnelled >= received,
        "iperf3 moved {received} bytes but only {tunnelled} left node A through {VXLAN}"
    );
}

/// `egressgw bench-client` in `ns` with `args`: its exit status and the
/// JSON after its result (or interfaces) line, or its error line.
fn bench_client(ns: &Netns, args: &[&str]) -> (bool, Result<serde_json::Value, String>) {
    let mut all = vec!["bench-client"];
    all.extend_from_slice(args);
    let out = support::process::run_bounded(
        &mut ns.command(env!("CARGO_BIN_EXE_egressgw"), &all),
        Duration::from_secs(60),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let found = stdout.lines().find_map(|l| {
        l.strip_prefix("egressgw-bench-result: ")
            .or_else(|| l.strip_prefix("egressgw-bench-interfaces: "))
            .map(|json| serde_json::from_str(json).map_err(|e| format!("{e}: {json}")))
    });
    let result = found.unwrap_or_else(|| {
        Err(stdout
            .lines()
            .find_map(|l| l.strip_prefix("egressgw-bench-error: "))
            .unwrap_or(&stdout)
            .to_owned())
    });
    (out.status.success(), result)
}

#[test]
fn the_bench_client_measures_a_selected_pod_and_proves_it_left_with_the_eip() {
    if !have_root("the_bench_client_measures_a_selected_pod_and_proves_it_left_with_the_eip") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _iperf3 = support::process::Background::spawn(
        &mut topo
            .target
            .command("iperf3", &["-s", "-B", TARGET_IP, "-p", "5201"]),
    );
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    let eip = eip(&gw).to_string();
    let common = [
        "--server",
        TARGET_IP,
        "--duration",
        "1",
        "--connects",
        "20",
        "--source-wait",
        "5",
    ];

    let mut args = common.to_vec();
    args.extend(["--expect-source", &eip, "--interfaces", "eth0,nonexistent"]);
    let (ok, result) = bench_client(&topo.pod_a1, &args);
    let result = result.unwrap_or_else(|e| panic!("pod-a1's bench client: {e}"));
    assert!(ok, "pod-a1's bench client failed: {result}");
    assert_eq!(
        result["seenFrom"],
        eip.as_str(),
        "the target must see the EIP: {result}"
    );
    assert!(
        result["receivedBps"].as_f64().unwrap_or(0.0) > 0.0,
        "{result}"
    );
    assert_eq!(
        result["connectRttUs"].as_array().map(Vec::len),
        Some(20),
        "{result}"
    );
    assert_eq!(result["interfaces"][0]["name"], "eth0", "{result}");
    assert_eq!(
        result["interfaces"].as_array().map(Vec::len),
        Some(1),
        "{result}"
    );

    // pod-a2 is not selected: it leaves from node A's address, and the
    // client refuses to count that.
    let mut args = common.to_vec();
    args.extend(["--expect-source", &eip]);
    let (ok, result) = bench_client(&topo.pod_a2, &args);
    assert!(!ok, "an unselected pod's run must fail: {result:?}");
    let error = result.expect_err("no result for an unselected pod");
    assert!(
        error.contains(&format!("did not see {eip}")) && error.contains(NODE_A_IP),
        "{error}"
    );

    // Node A's tunnel, as the bench reads it back.
    let (ok, result) = bench_client(&topo.node_a, &["--interfaces-only", "--interfaces", VXLAN]);
    let result = result.unwrap_or_else(|e| panic!("node A's interfaces: {e}"));
    assert!(ok);
    assert_eq!(result[0]["name"], VXLAN, "{result}");
    assert_eq!(result[0]["txChecksum"], true, "{result}");
    assert!(result[0]["mtu"].as_u64().unwrap_or(0) > 1000, "{result}");
}

/// The tunnel's `tx-checksumming` on node A under `vxlan.disableChecksumOffload`.
fn tx_checksumming_with(disable: bool) -> String {
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let config = format!("vxlan:\n  disableChecksumOffload: {disable}\n");
    let gw = apply_both(&topo, &Policy::default(), &config);
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP,
        eip(&gw),
        "traffic flows either way",
    );
    ethtool_feature(&topo.node_a, VXLAN, "tx-checksumming")
}

#[test]
fn disabling_checksum_offload_turns_tx_checksumming_off_on_the_tunnel() {
    if !have_root("disabling_checksum_offload_turns_tx_checksumming_off_on_the_tunnel") {
        return;
    }
    assert_eq!(tx_checksumming_with(true), "off");
}

#[test]
fn tx_checksumming_stays_on_when_offload_is_not_disabled() {
    if !have_root("tx_checksumming_stays_on_when_offload_is_not_disabled") {
        return;
    }
    assert_eq!(tx_checksumming_with(false), "on");
}

#[test]
fn a_second_reconcile_in_a_row_applies_nothing() {
    if !have_root("a_second_reconcile_in_a_row_applies_nothing") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    assert_a_second_apply_changes_nothing(&topo, &gw);
}

#[test]
fn an_agent_killed_and_restarted_mid_transfer_applies_nothing_and_the_transfer_completes() {
    if !have_root(
        "an_agent_killed_and_restarted_mid_transfer_applies_nothing_and_the_transfer_completes",
    ) {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    let seconds = 5;
    let _server = iperf3_server(&topo.target);
    let before = counters(&topo.node_a, VXLAN);
    let client = iperf3_client(&topo.pod_a1, TARGET_IP, seconds);
    thread::sleep(Duration::from_millis(500));

    let report_limit = Duration::from_secs(30);
    let (agent, reports) = gw.apply_every(&topo.node_a, "node-a", 1);
    let first = reports
        .recv_timeout(report_limit)
        .expect("apply --every reports its first reconcile");
    assert!(first.failed.is_empty(), "{:#}", first.json);
    let killed = agent.kill();
    assert!(
        killed.status.code().is_none(),
        "apply --every ended by itself before SIGKILL: {}",
        String::from_utf8_lossy(&killed.stderr)
    );

    let (agent, reports) = gw.apply_every(&topo.node_a, "node-a", 1);
    for n in 1..=2 {
        let report = reports
            .recv_timeout(report_limit)
            .unwrap_or_else(|e| panic!("reconcile {n} after the restart: {e}"));
        assert!(
            report.applied.is_empty() && report.failed.is_empty(),
            "reconcile {n} after the restart changed things: {:#}",
            report.json
        );
    }
    drop(agent);

    let received = iperf3_result(client, seconds)
        .unwrap_or_else(|e| panic!("the transfer across the restart: {e}"));
    let tunnelled = counters(&topo.node_a, VXLAN)
        .tx_bytes
        .saturating_sub(before.tx_bytes);
    assert!(
        received > 0 && tunnelled >= received,
        "iperf3 moved {received} bytes, {tunnelled} through {VXLAN}"
    );
}

#[test]
fn cleanup_leaves_each_node_as_it_was_before_apply() {
    if !have_root("cleanup_leaves_each_node_as_it_was_before_apply") {
        return;
    }
    let topo = Topology::new(Masquerade::Nft);
    let _target = Server::start(&topo.target, Service::Whoami);
    let _pod_b1 = Server::start(&topo.pod_b1, Service::Whoami);
    // Traffic on the normal paths first, so the neighbour tables hold what
    // they will hold after the egress traffic too.
    assert_seen_as(&topo.pod_a1, TARGET_IP, ip(NODE_A_IP), "before apply");
    assert_seen_as(
        &topo.pod_b1,
        TARGET_IP,
        ip(NODE_B_EXTERNAL_IP),
        "before apply",
    );
    assert_seen_as(&topo.pod_a1, POD_B1_IP, ip(POD_A1_IP), "before apply");
    let nodes = [(&topo.node_a, "node-a"), (&topo.node_b, "node-b")];
    let before: Vec<String> = nodes.iter().map(|(ns, _)| ns.kernel_state()).collect();

    let gw = apply_both(&topo, &Policy::default(), DEFAULT_CONFIG);
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "while applied");
    assert_seen_as(&topo.pod_b1, TARGET_IP, eip(&gw), "while applied");
    for (ns, _) in nodes.iter().rev() {
        gw.cleanup(ns);
    }

    for ((ns, node), before) in nodes.iter().zip(&before) {
        let after = ns.kernel_state();
        assert!(
            *before == after,
            "cleanup on {node} left the kernel different from before apply:\n{}",
            line_diff(before, &after)
        );
    }
    assert_seen_as(&topo.pod_a1, TARGET_IP, ip(NODE_A_IP), "after cleanup");
}

// IPv6: the dual-stack topology (IPv6 pods, routes and masquerade beside the
// IPv4 ones, the tunnel still over the IPv4 underlay) with `enableIPv6`, an
// IPv6 pool on the gateway and an IPv6 destination in the policy.
//
// Unlike ARP, Linux answers a Neighbour Solicitation only for addresses of
// the interface it arrives on: the gateway answers for its IPv6 EIP (a /128
// on `egress.eip`) through a proxy entry on the target's segment.

/// A dual-stack topology with the CNI masquerade installed by iptables-nft,
/// a dual-stack whoami on the target, and the dual-stack policy applied on
/// both nodes.
fn dual_stack_applied() -> (Topology, Server, Egressgw) {
    let topo = Topology::dual_stack(Masquerade::Nft);
    let target = Server::start_for(&topo.target, Service::Whoami, Stack::Dual);
    let gw = apply_both(&topo, &Policy::dual_stack(), DUAL_STACK_CONFIG);
    (topo, target, gw)
}

#[test]
fn a_selected_dual_stack_pod_leaves_from_the_ipv6_egress_ip_and_the_ipv4_one() {
    if !have_root("a_selected_dual_stack_pod_leaves_from_the_ipv6_egress_ip_and_the_ipv4_one") {
        return;
    }
    let (topo, _target, gw) = dual_stack_applied();
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP6,
        eip6(&gw),
        "IPv6, selected by team-a/web",
    );
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP,
        eip(&gw),
        "IPv4, selected by team-a/web",
    );
    assert_seen_as(
        &topo.pod_b1,
        TARGET_IP6,
        eip6(&gw),
        "IPv6, pod-b1 is selected, on the gateway",
    );
}

#[test]
fn an_unselected_pods_ipv6_traffic_and_in_cluster_ipv6_traffic_leave_the_normal_way() {
    if !have_root(
        "an_unselected_pods_ipv6_traffic_and_in_cluster_ipv6_traffic_leave_the_normal_way",
    ) {
        return;
    }
    let (topo, _target, gw) = dual_stack_applied();
    let _pod_b1 = Server::start_for(&topo.pod_b1, Service::Whoami, Stack::Dual);
    let _pod_b1_sink = Server::start_for(&topo.pod_b1, Service::Sink, Stack::Dual);
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "the policy is in force");
    // Node A masquerades pod-a2 to its own underlay IPv6 address (the
    // source of its route to the target via B); B forwards that as it is,
    // since it does not come from the pod network.
    assert_seen_as(
        &topo.pod_a2,
        TARGET_IP6,
        ip(NODE_A_IP6),
        "pod-a2 is not selected: masqueraded by node A",
    );
    assert_seen_as(&topo.pod_a2, TARGET_IP, ip(NODE_A_IP), "the same over IPv4");

    assert_in_cluster_traffic_stays_out_of_the_tunnel(&topo, POD_B1_IP6, POD_A1_IP6);
}

#[test]
fn ipv6_replies_return_through_the_tunnel() {
    if !have_root("ipv6_replies_return_through_the_tunnel") {
        return;
    }
    let topo = Topology::dual_stack(Masquerade::Nft);
    let _whoami = Server::start_for(&topo.target, Service::Whoami, Stack::Dual);
    let _source = Server::start_for(&topo.target, Service::Source, Stack::Dual);
    let gw = apply_both(&topo, &Policy::dual_stack(), DUAL_STACK_CONFIG);
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP6,
        eip6(&gw),
        "selected by team-a/web",
    );

    assert_download_returns_through_the_tunnel(&topo, TARGET_IP6);
}

#[test]
fn with_the_ebpf_datapath_ipv6_connections_take_the_fast_path_and_leave_from_the_ipv6_egress_ip() {
    if !have_root(
        "with_the_ebpf_datapath_ipv6_connections_take_the_fast_path_and_leave_from_the_ipv6_egress_ip",
    ) {
        return;
    }
    let topo = Topology::dual_stack(Masquerade::Nft);
    let _whoami = Server::start_for(&topo.target, Service::Whoami, Stack::Dual);
    let _source = Server::start_for(&topo.target, Service::Source, Stack::Dual);
    let gw = apply_both(&topo, &Policy::dual_stack(), EBPF_DUAL_STACK_CONFIG);
    assert_seen_as(
        &topo.pod_a1,
        TARGET_IP6,
        eip6(&gw),
        "IPv6, through the tunnel",
    );
    assert_seen_as(
        &topo.pod_b1,
        TARGET_IP6,
        eip6(&gw),
        "IPv6, on the gateway node",
    );
    assert_seen_as(&topo.pod_a1, TARGET_IP, eip(&gw), "IPv4 beside it");
    assert_download_returns_through_the_tunnel(&topo, TARGET_IP6);
    // Both ways past node A's netfilter: it tracked none of pod-a1's IPv6
    // connections.
    let tracked = topo.node_a.run(
        "conntrack",
        &[
            "-L", "-f", "ipv6", "-p", "tcp", "-s", POD_A1_IP6, "-d", TARGET_IP6,
        ],
    );
    assert!(
        tracked.trim().is_empty(),
        "node A tracked pod-a1's IPv6 connections: {tracked}"
    );
}

#[test]
fn a_second_reconcile_in_a_row_applies_nothing_with_ipv6_enabled() {
    if !have_root("a_second_reconcile_in_a_row_applies_nothing_with_ipv6_enabled") {
        return;
    }
    let topo = Topology::dual_stack(Masquerade::Nft);
    let gw = apply_both(&topo, &Policy::dual_stack(), DUAL_STACK_CONFIG);
    assert_a_second_apply_changes_nothing(&topo, &gw);
}

#[test]
fn cleanup_leaves_each_dual_stack_node_as_it_was_before_apply() {
    if !have_root("cleanup_leaves_each_dual_stack_node_as_it_was_before_apply") {
        return;
    }
    let topo = Topology::dual_stack(Masquerade::Nft);
    let _target = Server::start_for(&topo.target, Service::Whoami, Stack::Dual);
    let _pod_b1 = Server::start_for(&topo.pod_b1, Service::Whoami, Stack::Dual);
    // Traffic on the normal paths of both families first, so the neighbour
    // tables hold what they will hold after the egress traffic too.
    let normal = [
        (&topo.pod_a1, TARGET_IP, NODE_A_IP),
        (&topo.pod_a1, TARGET_IP6, NODE_A_IP6),
        (&topo.pod_b1, TARGET_IP, NODE_B_EXTERNAL_IP),
        (&topo.pod_b1, TARGET_IP6, NODE_B_EXTERNAL_IP6),
        (&topo.pod_a1, POD_B1_IP, POD_A1_IP),
        (&topo.pod_a1, POD_B1_IP6, POD_A1_IP6),
    ];
    for (pod, target, seen) in normal {
        assert_seen_as(pod, target, ip(seen), "before apply");
    }
    let nodes = [(&topo.node_a, "node-a"), (&topo.node_b, "node-b")];
    let before: Vec<String> = nodes.iter().map(|(ns, _)| ns.kernel_state()).collect();

    let gw = apply_both(&topo, &Policy::dual_stack(), DUAL_STACK_CONFIG);
    for pod in [&topo.pod_a1, &topo.pod_b1] {
        assert_seen_as(pod, TARGET_IP, eip(&gw), "while applied");
        assert_seen_as(pod, TARGET_IP6, eip6(&gw), "while applied");
    }
    assert_seen_as(&topo.pod_a1, POD_B1_IP6, ip(POD_A1_IP6), "while applied");
    for (ns, _) in nodes.iter().rev() {
        gw.cleanup(ns);
    }

    for ((ns, node), before) in nodes.iter().zip(&before) {
        let after = ns.kernel_state();
        assert!(
            *before == after,
            "cleanup on {node} left the kernel different from before apply:\n{}",
            line_diff(before, &after)
        );
    }
    for (pod, target, seen) in &normal[..2] {
        assert_seen_as(pod, target, ip(seen), "after cleanup");
    }
}

/// node-b holds the IPv6 EIP when its segment's link goes down: the kernel
/// flushes the link's proxy neighbour entries, so the agent finds none
/// when it gives the EIP up. `proxy_ndp` must still be turned off again,
/// and cleanup leave node-b as it was (the node keeps its addresses while
/// the link is down, as a node's network configuration restores them).
#[test]
fn an_ipv6_eip_given_up_while_its_link_was_down_leaves_proxy_ndp_as_it_was() {
    if !have_root("an_ipv6_eip_given_up_while_its_link_was_down_leaves_proxy_ndp_as_it_was") {
        return;
    }
    let topo = Topology::dual_stack(Masquerade::Nft);
    topo.node_b.run(
        "sysctl",
        &["-q", "-w", "net.ipv6.conf.all.keep_addr_on_down=1"],
    );
    let before = topo.node_b.kernel_state();
    let gw = apply_both(&topo, &Policy::dual_stack(), DUAL_STACK_CONFIG);
    assert!(
        topo.node_b
            .ip(&["-6", "neigh", "show", "proxy"])
            .contains("eth1"),
        "node-b has no proxy entry for the IPv6 EIP on eth1"
    );
    topo.node_b.ip(&["link", "set", "eth1", "down"]);
    for ns in [&topo.node_a, &topo.node_b] {
        gw.cleanup(ns);
    }
    topo.node_b.ip(&["link", "set", "eth1", "up"]);
    let after = topo.node_b.kernel_state();
    let proxy_ndp = |state: &str| -> Vec<String> {
        state
            .lines()
            .filter(|l| l.contains("proxy_ndp"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        proxy_ndp(&after),
        proxy_ndp(&before),
        "node-b's proxy_ndp after cleanup:\n{}",
        line_diff(&before, &after)
    );
}

/// The lines only in `before` (`-`) and only in `after` (`+`), under the
/// section headers (`## ...`) they belong to.
fn line_diff(before: &str, after: &str) -> String {
    let only = |a: &str, b: &str, sign: char| -> Vec<String> {
        let mut section = "";
        let mut out = Vec::new();
        for line in a.lines() {
            if line.starts_with("## ") {
                section = line;
            } else if !b.lines().any(|l| l == line) {
                out.push(format!("{section}: {sign} {line}"));
            }
        }
        out
    };
    let mut lines = only(before, after, '-');
    lines.extend(only(after, before, '+'));
    lines.join("\n")
}

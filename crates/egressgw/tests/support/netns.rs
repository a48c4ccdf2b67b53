//! Network namespaces and the two-node topology the dataplane tests run on.
//!
//! ```text
//!   pod-a1 10.244.1.10 ─┐                                   ┌─ pod-b1 10.244.2.10
//!   pod-a2 10.244.1.20 ─┤ veth-a1/a2               veth-b1 ├─
//!                   node A  eth0 ── underlay ── eth0  node B  eth1 ── eth0  target
//!                   172.18.0.11/24        172.18.0.12/24  198.51.100.11/24   198.51.100.1/24
//!                   default via B                                            198.51.100.2/24
//! ```
//!
//! Host-gw routes between the nodes (each routes the other's pod CIDR via its
//! underlay address), node A's default route via B, B is the only router to
//! the external segment, and the target routes the underlay back via B. Each
//! node masquerades pod traffic leaving the pod network, as a CNI does.
//!
//! [`Topology::dual_stack`] adds IPv6 on top, in the same shape: pods
//! fd00:10:244:1::10, ::20 (A) and fd00:10:244:2::10 (B), the nodes
//! fd00:172:18::11 and ::12 on the underlay link (which still carries the
//! tunnel over IPv4), B 2001:db8:100::11/64 and the target 2001:db8:100::1/64
//! on the external link, and an `ip6tables` masquerade of fd00:10:244::/48.
//!
//! Everything lives in namespaces named `egt<pid>-<n>-<role>`, created here
//! and deleted when the [`Topology`] (or a lone [`Netns`]) drops, also after
//! a panic. Nothing is added to the host namespace: veth pairs are created in
//! one test namespace with the peer placed straight into another.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};

use super::process::run_ok;

/// Node A's underlay address (its InternalIP).
pub const NODE_A_IP: &str = "172.18.0.11";
/// Node B's underlay address (its InternalIP).
pub const NODE_B_IP: &str = "172.18.0.12";
/// Node B's address on the external segment.
pub const NODE_B_EXTERNAL_IP: &str = "198.51.100.11";
/// The target's first address.
pub const TARGET_IP: &str = "198.51.100.1";
/// The target's second address, for the excluded-destination case.
pub const TARGET_EXCLUDED_IP: &str = "198.51.100.2";
/// Pod addresses.
pub const POD_A1_IP: &str = "10.244.1.10";
/// Pod addresses.
pub const POD_A2_IP: &str = "10.244.1.20";
/// Pod addresses.
pub const POD_B1_IP: &str = "10.244.2.10";
/// The cluster's pod network, as the CNI masquerade rule names it.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

// IPv6, in a dual-stack topology only. The underlay stays IPv4 (the Node
// objects' InternalIPs, the tunnel's outer packets); the nodes also hold an
// IPv6 address on it for the host-gw routes between them.

/// Node A's IPv6 address on the underlay link.
pub const NODE_A_IP6: &str = "fd00:172:18::11";
/// Node B's IPv6 address on the underlay link.
pub const NODE_B_IP6: &str = "fd00:172:18::12";
/// The underlay link's IPv6 prefix.
pub const UNDERLAY_CIDR6: &str = "fd00:172:18::/64";
/// Node B's IPv6 address on the external segment.
pub const NODE_B_EXTERNAL_IP6: &str = "2001:db8:100::11";
/// The target's IPv6 address.
pub const TARGET_IP6: &str = "2001:db8:100::1";
/// The external segment's IPv6 prefix length.
const EXTERNAL_PREFIX6: u8 = 64;
/// Pod IPv6 addresses.
pub const POD_A1_IP6: &str = "fd00:10:244:1::10";
/// Pod IPv6 addresses.
pub const POD_A2_IP6: &str = "fd00:10:244:1::20";
/// Pod IPv6 addresses.
pub const POD_B1_IP6: &str = "fd00:10:244:2::10";
/// Node A's IPv6 pod CIDR.
pub const POD_CIDR_A6: &str = "fd00:10:244:1::/64";
/// Node B's IPv6 pod CIDR.
pub const POD_CIDR_B6: &str = "fd00:10:244:2::/64";
/// The cluster's IPv6 pod network, as the CNI masquerade rule names it.
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/48";

/// `ip netns add` mounts `/run/netns` on first use; concurrent first uses
/// race, so namespaces are created one at a time.
static CREATE: Mutex<()> = Mutex::new(());
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A named network namespace (`/run/netns/<name>`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates the namespace and brings `lo` up.
    pub fn create(name: &str) -> Self {
        {
            let _one_at_a_time = CREATE
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            run_ok(Command::new("ip").args(["netns", "add", name]));
        }
        let ns = Self {
            name: name.to_owned(),
        };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip -n <name> ARGS`; fails the test if it fails. Returns stdout.
    pub fn ip(&self, args: &[&str]) -> String {
        run_ok(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// `ip netns exec <name> PROGRAM ARGS`, not started yet.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name])
            .arg(program)
            .args(args);
        cmd
    }

    /// Runs PROGRAM ARGS inside the namespace; fails the test if it fails.
    pub fn run(&self, program: &str, args: &[&str]) -> String {
        run_ok(&mut self.command(program, args))
    }

    /// Sets a sysctl of this namespace.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.run("sysctl", &["-qw", &format!("{key}={value}")]);
    }

    /// Runs `f` on a thread that has entered this namespace and returns its
    /// result. Sockets `f` creates stay in this namespace wherever they are
    /// used afterwards.
    pub fn enter<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = Path::new("/run/netns").join(&self.name);
        let file = File::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        thread::spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("entering {}: {e}", path.display()));
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// The kernel state egressgw may touch, as text that does not change
    /// with traffic: links (without statistics or ifindexes), IPv4 and IPv6
    /// rules and routes of every table, neighbours (without their NUD state),
    /// the bridge FDB and the nftables ruleset (without counter values).
    /// Lines are sorted within each section.
    pub fn kernel_state(&self) -> String {
        let sysctls = self.run("sysctl", &["-a"]);
        let written: String = sysctls
            .lines()
            .filter(|l| l.contains(".proxy_ndp =") || l.contains(".rp_filter ="))
            .map(|l| format!("{l}\n"))
            .collect();
        let sections: [(&str, String); 10] = [
            (
                "ip -d -o link",
                normalize_links(&self.ip(&["-d", "-o", "link"])),
            ),
            ("ip rule", self.ip(&["rule"])),
            ("ip -6 rule", self.ip(&["-6", "rule"])),
            (
                "ip route show table all",
                self.ip(&["route", "show", "table", "all"]),
            ),
            (
                "ip -6 route show table all",
                self.ip(&["-6", "route", "show", "table", "all"]),
            ),
            ("ip neigh", normalize_neighbours(&self.ip(&["neigh"]))),
            (
                "ip -6 neigh",
                normalize_neighbours(&self.ip(&["-6", "neigh"])),
            ),
            ("bridge fdb", self.run("bridge", &["fdb", "show"])),
            (
                "nft list ruleset",
                normalize_nft(&self.run("nft", &["list", "ruleset"])),
            ),
            (
                "sysctl: the proxy_ndp and rp_filter egressgw writes",
                written,
            ),
        ];
        let mut out = String::new();
        for (title, text) in sections {
            let mut lines: Vec<&str> = text
                .lines()
                .map(str::trim_end)
                .filter(|l| !l.is_empty())
                .collect();
            lines.sort_unstable();
            out.push_str(&format!("## {title}\n"));
            for line in lines {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let out = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "warning: ip netns del {}: {}",
                self.name,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("warning: ip netns del {}: {e}", self.name),
        }
    }
}

/// Drops each line's ifindex (`7: `) and its peer's (`@if6`).
fn normalize_links(text: &str) -> String {
    text.lines()
        .map(|line| {
            let line = line.split_once(": ").map_or(line, |(_, rest)| rest);
            match line.split_once(':') {
                Some((name, rest)) => {
                    let name = name.split_once("@if").map_or(name, |(n, _)| n);
                    format!("{name}:{rest}\n")
                }
                None => format!("{line}\n"),
            }
        })
        .collect()
}

/// Drops the NUD state words, which change with traffic and time, and the
/// entries that carry no address (`FAILED`, `INCOMPLETE`).
fn normalize_neighbours(text: &str) -> String {
    const STATES: [&str; 5] = ["REACHABLE", "STALE", "DELAY", "PROBE", "NONE"];
    text.lines()
        .filter(|l| !l.contains("FAILED") && !l.contains("INCOMPLETE"))
        .map(|l| {
            let words: Vec<&str> = l
                .split_whitespace()
                .filter(|w| !STATES.contains(w))
                .collect();
            words.join(" ") + "\n"
        })
        .collect()
}

/// Drops counter values (`counter packets 3 bytes 180` -> `counter`).
fn normalize_nft(text: &str) -> String {
    text.lines()
        .map(|l| {
            let mut words: Vec<&str> = Vec::new();
            let mut iter = l.split_whitespace().peekable();
            while let Some(w) = iter.next() {
                words.push(w);
                if w == "counter" && iter.peek() == Some(&"packets") {
                    // packets N bytes N
                    for _ in 0..4 {
                        iter.next();
                    }
                }
            }
            words.join(" ") + "\n"
        })
        .collect()
}

/// Which tool installs the CNI-like masquerade rule on the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masquerade {
    /// No masquerade rule: pods reach the target only through egressgw.
    None,
    /// `iptables-nft` (Debian's default `iptables`).
    Nft,
    /// `iptables-legacy`.
    Legacy,
}

/// Which address families the topology carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    /// IPv4 only.
    Ipv4,
    /// IPv4 and IPv6 on every pod, route and masquerade; the underlay
    /// stays IPv4.
    Dual,
}

/// The namespaces of one test; every one of them is deleted on drop.
#[derive(Debug)]
pub struct Topology {
    /// Node A: no gateway, pods pod-a1 and pod-a2.
    pub node_a: Netns,
    /// Node B: the gateway node and the router to the external segment.
    pub node_b: Netns,
    /// Pod pod-a1 on node A.
    pub pod_a1: Netns,
    /// Pod pod-a2 on node A.
    pub pod_a2: Netns,
    /// Pod pod-b1 on node B.
    pub pod_b1: Netns,
    /// The external host.
    pub target: Netns,
    /// The address families wired.
    pub stack: Stack,
    dir: ScratchDir,
}

impl Topology {
    /// Builds the IPv4-only topology with the CNI masquerade installed by
    /// `masquerade`.
    pub fn new(masquerade: Masquerade) -> Self {
        Self::build(masquerade, Stack::Ipv4)
    }

    /// Builds the topology with IPv6 beside IPv4 (see [`Self::wire_ipv6`]),
    /// the CNI masquerade installed by `masquerade` for both families.
    pub fn dual_stack(masquerade: Masquerade) -> Self {
        Self::build(masquerade, Stack::Dual)
    }

    fn build(masquerade: Masquerade, stack: Stack) -> Self {
        let id = format!(
            "egt{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let ns = |role: &str| Netns::create(&format!("{id}-{role}"));
        let topo = Self {
            node_a: ns("nodea"),
            node_b: ns("nodeb"),
            pod_a1: ns("poda1"),
            pod_a2: ns("poda2"),
            pod_b1: ns("podb1"),
            target: ns("target"),
            stack,
            dir: ScratchDir::create(&id),
        };
        topo.wire_underlay();
        topo.wire_external();
        attach_pod(
            &topo.node_a,
            &topo.pod_a1,
            "veth-a1",
            POD_A1_IP,
            "10.244.1.1",
        );
        attach_pod(
            &topo.node_a,
            &topo.pod_a2,
            "veth-a2",
            POD_A2_IP,
            "10.244.1.1",
        );
        attach_pod(
            &topo.node_b,
            &topo.pod_b1,
            "veth-b1",
            POD_B1_IP,
            "10.244.2.1",
        );
        topo.node_a
            .ip(&["route", "add", "10.244.2.0/24", "via", NODE_B_IP]);
        topo.node_a
            .ip(&["route", "add", "default", "via", NODE_B_IP]);
        topo.node_b
            .ip(&["route", "add", "10.244.1.0/24", "via", NODE_A_IP]);
        for node in [&topo.node_a, &topo.node_b] {
            node.sysctl("net.ipv4.ip_forward", "1");
            install_masquerade(node, masquerade, false);
        }
        if stack == Stack::Dual {
            topo.wire_ipv6(masquerade);
        }
        topo.settle();
        topo
    }

    /// The IPv6 side, mirroring the IPv4 one: pod addresses (/128 on the
    /// pod, the pod gateway `::1` on the node's veth), host-gw routes between
    /// the nodes over their underlay IPv6 addresses, the target on B's
    /// external link, A's default route via B, forwarding on both nodes and
    /// the CNI masquerade for the IPv6 pod network. Every address is
    /// `nodad`, so none stays tentative.
    fn wire_ipv6(&self, masquerade: Masquerade) {
        let (a, b, t) = (&self.node_a, &self.node_b, &self.target);
        add_addr6(a, &format!("{NODE_A_IP6}/64"), "eth0");
        add_addr6(b, &format!("{NODE_B_IP6}/64"), "eth0");
        add_addr6(
            b,
            &format!("{NODE_B_EXTERNAL_IP6}/{EXTERNAL_PREFIX6}"),
            "eth1",
        );
        add_addr6(t, &format!("{TARGET_IP6}/{EXTERNAL_PREFIX6}"), "eth0");
        t.ip(&[
            "-6",
            "route",
            "add",
            UNDERLAY_CIDR6,
            "via",
            NODE_B_EXTERNAL_IP6,
        ]);
        let pods = [
            (a, &self.pod_a1, "veth-a1", POD_A1_IP6, "fd00:10:244:1::1"),
            (a, &self.pod_a2, "veth-a2", POD_A2_IP6, "fd00:10:244:1::1"),
            (b, &self.pod_b1, "veth-b1", POD_B1_IP6, "fd00:10:244:2::1"),
        ];
        for (node, pod, veth, ip, gateway) in pods {
            attach_pod6(node, pod, veth, ip, gateway);
        }
        a.ip(&["-6", "route", "add", POD_CIDR_B6, "via", NODE_B_IP6]);
        a.ip(&["-6", "route", "add", "default", "via", NODE_B_IP6]);
        b.ip(&["-6", "route", "add", POD_CIDR_A6, "via", NODE_A_IP6]);
        for node in [a, b] {
            node.sysctl("net.ipv6.conf.all.forwarding", "1");
            install_masquerade(node, masquerade, true);
        }
    }

    /// Waits until IPv6 duplicate address detection has finished on every
    /// interface: until then the kernel keeps adding link-local addresses
    /// and their `local fe80::...` routes, and a snapshot of the routes
    /// would change without anyone touching them.
    fn settle(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for ns in self.all() {
            while !ns
                .ip(&["-6", "addr", "show", "tentative"])
                .trim()
                .is_empty()
            {
                assert!(
                    Instant::now() < deadline,
                    "IPv6 addresses in {} stay tentative",
                    ns.name()
                );
                thread::sleep(Duration::from_millis(50));
            }
        }
    }

    fn all(&self) -> [&Netns; 6] {
        [
            &self.node_a,
            &self.node_b,
            &self.pod_a1,
            &self.pod_a2,
            &self.pod_b1,
            &self.target,
        ]
    }

    /// A directory for this test's files, removed on drop.
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    fn wire_underlay(&self) {
        let (a, b) = (&self.node_a, &self.node_b);
        a.ip(&[
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            b.name(),
        ]);
        a.ip(&["addr", "add", &format!("{NODE_A_IP}/24"), "dev", "eth0"]);
        b.ip(&["addr", "add", &format!("{NODE_B_IP}/24"), "dev", "eth0"]);
        a.ip(&["link", "set", "eth0", "up"]);
        b.ip(&["link", "set", "eth0", "up"]);
    }

    fn wire_external(&self) {
        let (b, t) = (&self.node_b, &self.target);
        b.ip(&[
            "link",
            "add",
            "eth1",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            t.name(),
        ]);
        b.ip(&[
            "addr",
            "add",
            &format!("{NODE_B_EXTERNAL_IP}/24"),
            "dev",
            "eth1",
        ]);
        t.ip(&["addr", "add", &format!("{TARGET_IP}/24"), "dev", "eth0"]);
        t.ip(&[
            "addr",
            "add",
            &format!("{TARGET_EXCLUDED_IP}/24"),
            "dev",
            "eth0",
        ]);
        b.ip(&["link", "set", "eth1", "up"]);
        t.ip(&["link", "set", "eth0", "up"]);
        t.ip(&["route", "add", "172.18.0.0/24", "via", NODE_B_EXTERNAL_IP]);
    }
}

/// Wires `pod` to `node` the way Calico-like CNIs do: a veth, the pod's
/// address as a /32, the node's side holding the pod gateway address, and a
/// /32 route on the node to the pod.
fn attach_pod(node: &Netns, pod: &Netns, veth: &str, ip: &str, gateway: &str) {
    node.ip(&[
        "link",
        "add",
        veth,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        pod.name(),
    ]);
    node.ip(&["addr", "add", &format!("{gateway}/32"), "dev", veth]);
    node.ip(&["link", "set", veth, "up"]);
    node.ip(&[
        "route",
        "add",
        &format!("{ip}/32"),
        "dev",
        veth,
        "scope",
        "link",
    ]);
    pod.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
    pod.ip(&["link", "set", "eth0", "up"]);
    pod.ip(&["route", "add", gateway, "dev", "eth0", "scope", "link"]);
    pod.ip(&["route", "add", "default", "via", gateway, "dev", "eth0"]);
}

/// Adds an IPv6 address without duplicate address detection.
fn add_addr6(ns: &Netns, cidr: &str, dev: &str) {
    ns.ip(&["-6", "addr", "add", cidr, "dev", dev, "nodad"]);
}

/// The IPv6 half of [`attach_pod`], on the veth it created.
fn attach_pod6(node: &Netns, pod: &Netns, veth: &str, ip: &str, gateway: &str) {
    add_addr6(node, &format!("{gateway}/128"), veth);
    node.ip(&["-6", "route", "add", &format!("{ip}/128"), "dev", veth]);
    add_addr6(pod, &format!("{ip}/128"), "eth0");
    pod.ip(&["-6", "route", "add", gateway, "dev", "eth0"]);
    pod.ip(&[
        "-6", "route", "add", "default", "via", gateway, "dev", "eth0",
    ]);
}

/// The rule flannel and most CNIs install for pod traffic leaving the pod
/// network, with `iptables` or (`ipv6`) `ip6tables` of the chosen flavour.
fn install_masquerade(node: &Netns, masquerade: Masquerade, ipv6: bool) {
    let flavour = match masquerade {
        Masquerade::None => return,
        Masquerade::Nft => "nft",
        Masquerade::Legacy => "legacy",
    };
    let (program, cidr) = if ipv6 {
        ("ip6tables", CLUSTER_CIDR6)
    } else {
        ("iptables", CLUSTER_CIDR)
    };
    let program = format!("{program}-{flavour}");
    node.run(&program, &masquerade_args(cidr));
    // Calico drops what conntrack finds INVALID on its way to a pod: replies
    // that come back through the tunnel must not look so.
    node.run(
        &program,
        &[
            "-w",
            "-A",
            "FORWARD",
            "-d",
            cidr,
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID",
            "-m",
            "comment",
            "--comment",
            "egressgw test: CNI drops INVALID toward pods",
            "-j",
            "DROP",
        ],
    );
}

/// `-t nat -A POSTROUTING -s CIDR ! -d CIDR ... -j MASQUERADE`.
fn masquerade_args(cidr: &str) -> [&str; 16] {
    [
        "-w",
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-s",
        cidr,
        "!",
        "-d",
        cidr,
        "-m",
        "comment",
        "--comment",
        "egressgw test: CNI masquerade",
        "-j",
        "MASQUERADE",
    ]
}

/// A directory under the system temp dir, removed with its files on drop.
#[derive(Debug)]
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn create(id: &str) -> Self {
        let path = std::env::temp_dir().join(id);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        Self(path)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

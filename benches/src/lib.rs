//! Synthetic clusters for the benches.
//!
//! [`synthetic_cluster`] builds a [`Snapshot`] of a given size whose shape
//! follows real clusters: a tenth of the nodes can be gateways, namespaces
//! run a handful of apps each, most policies select one app in their own
//! namespace, a few cluster policies select across namespaces, and
//! destinations range from single hosts to everything outside the cluster.
//!
//! The output depends on the three sizes only: the generator draws from a
//! fixed-seed xorshift, so a bench measures the same cluster on every run
//! and on every machine.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use egressgw_core::model::{
    Age, Allocator, Config, EgressIpSpec, Gateway, Labels, Namespace, Node, Pod, PodMatch, Policy,
    PolicyRef,
};
use egressgw_core::net::{IpPool, IpRange};
use egressgw_core::selector::{LabelSelector, Requirement};
use egressgw_core::{Plan, Snapshot};
use ipnet::{IpNet, Ipv4Net};

/// Label of nodes that may carry egress traffic.
pub const GATEWAY_LABEL: &str = "egressgw.io/gateway";

/// Label that splits gateway-capable nodes between gateways.
pub const GATEWAY_GROUP_LABEL: &str = "egressgw.io/gateway-group";

/// Apps that namespaces draw their workloads from.
const APPS: [&str; 12] = [
    "web", "api", "worker", "cache", "db", "frontend", "backend", "ingest", "search", "batch",
    "auth", "payments",
];

const ENVS: [&str; 3] = ["prod", "staging", "dev"];
const ZONES: [&str; 3] = ["zone-a", "zone-b", "zone-c"];

/// Seed of the generator; any fixed non-zero value would do.
const SEED: u64 = 0x5eed_e6e5_5a7e_0001;

/// 2026-01-01T00:00:00Z: gateways are created then, policies from two days
/// later on, a minute apart.
const EPOCH: i64 = 1_767_225_600;

/// Node underlay addresses start here (inside 172.16.0.0/12, well below the
/// default tunnel subnet 172.31.0.0/16).
const NODE_BASE: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 0);

/// Pod CIDRs are carved from here, one block per node.
const POD_BASE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 0);

/// Pod CIDRs must stay below the default service CIDR 10.96.0.0/12.
const POD_SPACE: u32 = 96 << 16;

/// Gateway pools are carved from 100.64.0.0/10, [`POOL_STRIDE`] addresses each.
const POOL_BASE: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 0);
const POOL_SPACE: u32 = 1 << 22;
const POOL_STRIDE: u32 = 512;

/// Addresses of each gateway pool: a range of 254 plus a /26.
pub const POOL_SIZE: usize = 254 + 64;

/// The tunnel device of a bench node with underlay address
/// 172.18.0.100 and tunnel address 172.31.0.1/16, as `cfg` names it.
pub fn bench_vxlan(cfg: &Config) -> egressgw_core::state::Vxlan {
    egressgw_core::state::Vxlan {
        name: cfg.vxlan.name.clone(),
        vni: cfg.vxlan.id,
        port: cfg.vxlan.port,
        local: IpAddr::V4(Ipv4Addr::new(172, 18, 0, 100)),
        mac: egressgw_core::model::Mac([2, 0, 0, 0, 0, 0]),
        ipv4: Some(Ipv4Addr::new(172, 31, 0, 1)),
        ipv6: None,
        ipv4_prefix_len: 16,
        ipv6_prefix_len: 112,
        disable_checksum_offload: false,
    }
}

/// A cluster of `nodes` nodes, `policies` egress policies and `pods` pods.
///
/// Besides those, it holds `max(1, policies / 500)` gateways (the first is
/// the cluster default), `max(1, policies / 10)` application namespaces plus
/// `kube-system`, and no tunnel allocations (a cluster seen for the first
/// time; see [`next_snapshot`] for the steady state).
///
/// # Panics
/// When `nodes` is 0, or the sizes do not fit the address plan (pod CIDRs
/// below 10.96.0.0: up to 24 576 nodes with a /24 each; pools inside
/// 100.64.0.0/10: up to 8 192 gateways).
pub fn synthetic_cluster(nodes: usize, policies: usize, pods: usize) -> Snapshot {
    synthetic_cluster_where(nodes, policies, pods, &|_| true)
}

/// [`synthetic_cluster`] keeping only the Pods `keep` takes, each dropped as
/// it is made: the cluster as an agent that watches those Pods holds it,
/// without ever holding the others.
pub fn synthetic_cluster_where(
    nodes: usize,
    policies: usize,
    pods: usize,
    keep: &dyn Fn(&Pod) -> bool,
) -> Snapshot {
    assert!(nodes > 0, "a cluster needs at least one node");
    let mut rng = Rng::new(SEED);
    let gateways = (policies / 500).max(1);
    let namespace_count = (policies / 10).max(1);

    let pod_prefix = pod_prefix_len(nodes, pods);
    let nodes = make_nodes(nodes, gateways, pod_prefix);
    let namespaces = make_namespaces(&mut rng, namespace_count);
    let pods = make_pods(&mut rng, pods, &nodes, &namespaces, keep);
    let gateways = make_gateways(gateways);
    let policies = make_policies(&mut rng, policies, &nodes, &namespaces, &gateways);

    Snapshot {
        config: Config::default(),
        nodes,
        namespaces: namespaces.into_iter().map(|ns| ns.namespace).collect(),
        pods,
        gateways,
        policies: policies.into_iter().map(Arc::new).collect(),
        tunnels: Vec::new(),
        invalid: Vec::new(),
        eips_in_use: BTreeMap::new(),
    }
}

/// The snapshot the controller sees once it has written `plan`'s status
/// back: tunnel identities allocated, each policy's EIPs and gateway node
/// recorded, each gateway's EIP placement recorded. Planning it measures the
/// steady state, where nothing moves.
pub fn next_snapshot(snapshot: &Snapshot, plan: &Plan) -> Snapshot {
    let mut next = snapshot.clone();
    egressgw_core::remember(&mut next, &plan.status);
    next
}

/// A node of `snapshot` whose agent watches its gateways' Pods besides its
/// own (`gateway`: some gateway selects it) or only its own: the second of its kind where there
/// are two, as the synthetic cluster leaves the first worker's Pods pending
/// at some sizes.
pub fn agent_node(snapshot: &Snapshot, gateway: bool) -> String {
    let of_kind: Vec<&str> = snapshot
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .filter(|n| {
            let scope = egressgw_core::pod_scope(snapshot, n);
            (scope != egressgw_core::PodScope::Node) == gateway
        })
        .collect();
    of_kind
        .get(1)
        .or(of_kind.first())
        .map(|n| (*n).to_owned())
        .expect("the synthetic cluster has nodes of each kind")
}

/// `pod` with its `app` label changed to one no policy selects, or back
/// (`away` false): a relabel that takes the Pod out of its policies' reach
/// and puts it back.
pub fn relabelled(pod: &Pod, away: bool) -> Pod {
    let mut pod = pod.clone();
    if away && let Some(app) = pod.labels.get_mut("app") {
        *app = format!("{app}-moved");
    }
    pod
}

/// Up to `count` Pods whose changes reach `node`'s state: its own Pods
/// with an address, and on a node that carries traffic, the Pods of
/// other nodes it has SNAT entries for. In a fixed order.
pub fn pods_reaching(
    snapshot: &Snapshot,
    state: &egressgw_core::state::NodeState,
    count: usize,
) -> Vec<Pod> {
    let served: std::collections::BTreeSet<IpAddr> = state.snat.iter().map(|e| e.src).collect();
    let mut pods: Vec<&Pod> = snapshot
        .pods
        .iter()
        .filter(|p| {
            !p.host_network
                && (p.node.as_deref() == Some(state.node.as_str())
                    || p.ips.iter().any(|ip| served.contains(ip)))
                && !p.ips.is_empty()
        })
        .collect();
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    // Spread over the whole list rather than the first namespaces.
    let step = (pods.len() / count.max(1)).max(1);
    pods.into_iter()
        .step_by(step)
        .take(count)
        .cloned()
        .collect()
}

/// A xorshift64* generator: plenty for picking shapes, and reproducible.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`; `n` must not be 0.
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("below n fits usize")
    }

    /// True `percent` times in a hundred.
    fn percent(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A Kubernetes-looking UID.
    fn uid(&mut self) -> String {
        let (a, b) = (self.next(), self.next());
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            b >> 52,
            b & 0xffff_ffff_ffff
        )
    }
}

fn labels<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Labels {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn v4(n: u32) -> Ipv4Addr {
    Ipv4Addr::from(n)
}

fn u32_of(n: usize) -> u32 {
    u32::try_from(n).expect("synthetic sizes fit in u32")
}

fn net(addr: Ipv4Addr, len: u8) -> Ipv4Net {
    Ipv4Net::new(addr, len).expect("prefix length at most 32")
}

/// The longest pod CIDR prefix (at most /24, as kube-controller-manager
/// hands out by default) that holds every node's share of pods.
fn pod_prefix_len(nodes: usize, pods: usize) -> u8 {
    // Network address, the CNI's gateway address, and the pods.
    let per_node = u32_of(pods.div_ceil(nodes) + 2);
    let host_bits = u8::try_from(per_node.next_power_of_two().trailing_zeros())
        .expect("at most 32 bits")
        .max(8);
    let prefix = 32 - host_bits;
    let block = 1u32 << host_bits;
    assert!(
        u64::from(block) * nodes as u64 <= u64::from(POD_SPACE),
        "{nodes} nodes of /{prefix} pod CIDRs do not fit below 10.96.0.0"
    );
    prefix
}

fn node_name(i: usize) -> String {
    format!("node-{i:05}")
}

/// Whether node `i` may be a gateway: one in ten.
fn gateway_capable(i: usize) -> bool {
    i.is_multiple_of(10)
}

fn make_nodes(count: usize, gateways: usize, pod_prefix: u8) -> Vec<Node> {
    let block = 1u32 << (32 - pod_prefix);
    (0..count)
        .map(|i| {
            let name = node_name(i);
            let mut node_labels = labels([
                ("kubernetes.io/hostname", name.as_str()),
                ("kubernetes.io/os", "linux"),
                ("topology.kubernetes.io/zone", ZONES[i % ZONES.len()]),
            ]);
            if gateway_capable(i) {
                node_labels.insert(GATEWAY_LABEL.into(), "true".into());
                node_labels.insert(GATEWAY_GROUP_LABEL.into(), group_name((i / 10) % gateways));
            }
            let index = u32_of(i);
            Node {
                addresses: vec![IpAddr::V4(v4(u32::from(NODE_BASE) + 1 + index))],
                external_addresses: Vec::new(),
                pod_cidrs: vec![IpNet::V4(net(
                    v4(u32::from(POD_BASE) + index * block),
                    pod_prefix,
                ))],
                // About one node in a hundred is NotReady, gateway nodes included.
                ready: i % 101 != 100,
                held_eips: Vec::new(),
                name,
                labels: node_labels,
            }
        })
        .collect()
}

/// A namespace and the apps that run in it.
#[derive(Debug)]
struct AppNamespace {
    namespace: Namespace,
    apps: Vec<&'static str>,
    team: String,
}

fn team_name(t: usize) -> String {
    format!("team-{t:02}")
}

fn make_namespaces(rng: &mut Rng, count: usize) -> Vec<AppNamespace> {
    // About fifty namespaces per team.
    let teams = count.div_ceil(50);
    let mut out: Vec<AppNamespace> = (0..count)
        .map(|n| {
            let name = format!("ns-{n:04}");
            let team = team_name(n % teams);
            let start = rng.below(APPS.len());
            let apps = (0..3 + rng.below(4))
                .map(|j| APPS[(start + j) % APPS.len()])
                .collect();
            AppNamespace {
                namespace: Namespace {
                    labels: labels([
                        ("kubernetes.io/metadata.name", name.as_str()),
                        ("team", team.as_str()),
                        ("env", ENVS[n % ENVS.len()]),
                    ]),
                    name,
                },
                apps,
                team,
            }
        })
        .collect();
    out.push(AppNamespace {
        namespace: Namespace {
            name: "kube-system".into(),
            labels: labels([("kubernetes.io/metadata.name", "kube-system")]),
        },
        apps: vec!["kube-proxy", "cni-agent"],
        team: "platform".into(),
    });
    out
}

/// Pods go round-robin over the nodes, so every node holds its share; their
/// namespace and app are drawn at random. One pod in fifty is a host-network
/// system pod, one in two hundred is still pending.
fn make_pods(
    rng: &mut Rng,
    count: usize,
    nodes: &[Node],
    namespaces: &[AppNamespace],
    keep: &dyn Fn(&Pod) -> bool,
) -> Vec<Pod> {
    let (system, apps) = namespaces
        .split_last()
        .expect("kube-system is always there");
    (0..count)
        .map(|p| {
            let node = &nodes[p % nodes.len()];
            let slot = u32_of(p / nodes.len());
            if p.is_multiple_of(50) {
                let app = *rng.pick(&system.apps);
                return Pod {
                    namespace: system.namespace.name.clone(),
                    name: format!("{app}-{p:06x}"),
                    labels: labels([("app", app)]),
                    ips: node.addresses.clone(),
                    node: Some(node.name.clone()),
                    host_network: true,
                };
            }
            let ns = rng.pick(apps);
            let app = *rng.pick(&ns.apps);
            let version = if rng.percent(30) { "v2" } else { "v1" };
            let pending = p % 200 == 1;
            let ips = match (pending, node.pod_cidrs.first()) {
                (false, Some(IpNet::V4(cidr))) => {
                    vec![IpAddr::V4(v4(u32::from(cidr.network()) + 2 + slot))]
                }
                _ => Vec::new(),
            };
            Pod {
                namespace: ns.namespace.name.clone(),
                name: format!("{app}-{p:06x}"),
                labels: labels([("app", app), ("version", version)]),
                ips,
                node: (!pending).then(|| node.name.clone()),
                host_network: false,
            }
        })
        .filter(|pod| keep(pod))
        .collect()
}

fn gateway_name(k: usize) -> String {
    if k == 0 {
        "default".into()
    } else {
        format!("gw-{k:03}")
    }
}

fn group_name(k: usize) -> String {
    format!("group-{k:03}")
}

/// The first address of gateway `k`'s stretch of 100.64.0.0/10.
fn pool_base(k: usize) -> u32 {
    let offset = u32_of(k) * POOL_STRIDE;
    assert!(
        offset < POOL_SPACE,
        "{k} gateways do not fit in 100.64.0.0/10"
    );
    u32::from(POOL_BASE) + offset
}

/// Gateway `k` selects the gateway-capable nodes of group `k`; its pool is
/// `x.y.z.1-x.y.z.254` plus the /26 after it, written as a CIDR. Odd gateways
/// pin their default EIP, even ones use the pool's first address.
fn make_gateways(count: usize) -> Vec<Gateway> {
    (0..count)
        .map(|k| {
            let base = pool_base(k);
            let range = IpRange::new(IpAddr::V4(v4(base + 1)), IpAddr::V4(v4(base + 254)))
                .expect("an ordered IPv4 range");
            let cidr = net(v4(base + 256), 26);
            let cidr = IpRange::new(IpAddr::V4(cidr.network()), IpAddr::V4(cidr.broadcast()))
                .expect("a prefix is an ordered range");
            Gateway {
                fail_closed: true,
                namespace_selector: None,
                name: gateway_name(k),
                node_selector: LabelSelector {
                    match_labels: labels([
                        (GATEWAY_LABEL, "true"),
                        (GATEWAY_GROUP_LABEL, group_name(k).as_str()),
                    ]),
                    match_expressions: Vec::new(),
                },
                ipv4_pool: IpPool::new(vec![range, cidr]),
                ipv6_pool: IpPool::default(),
                ipv4_default: (k % 2 == 1).then(|| v4(base + 10)),
                ipv6_default: None,
                cluster_default: k == 0,
                age: Age {
                    created: EPOCH + i64::from(u32_of(k)),
                    uid: format!("00000000-0000-4000-8000-{k:012x}"),
                },
                previous_nodes: BTreeMap::new(),
                errors: Vec::new(),
            }
        })
        .collect()
}

/// Policy `p` is a cluster policy when this holds: one in two hundred.
fn is_cluster_policy(p: usize) -> bool {
    p % 200 == 7
}

fn make_policies(
    rng: &mut Rng,
    count: usize,
    nodes: &[Node],
    namespaces: &[AppNamespace],
    gateways: &[Gateway],
) -> Vec<Policy> {
    let apps = &namespaces[..namespaces.len() - 1];
    // Pinned EIPs come from the top of each pool, one address each, so they
    // never collide with each other or with what the allocators hand out first.
    let mut pinned = vec![0u32; gateways.len()];
    (0..count)
        .map(|p| {
            let (id, pods, namespace_selector) = if is_cluster_policy(p) {
                cluster_target(rng, p, apps)
            } else {
                namespaced_target(rng, p, nodes, apps)
            };
            let gateway = if rng.percent(3) {
                None
            } else {
                Some(rng.below(gateways.len()))
            };
            let egress_ip = egress_ip(rng, gateway, &mut pinned);
            let dest_subnets = dest_subnets(rng);
            let exclude_subnets = if rng.percent(5) {
                exclude_subnets(rng, &dest_subnets)
            } else {
                Vec::new()
            };
            let priority = if rng.percent(90) {
                0
            } else {
                *rng.pick(&[10, 100, 1000])
            };
            Policy {
                id,
                gateway: gateway.map(|k| gateways[k].name.clone()),
                egress_ip,
                pods,
                namespace_selector,
                dest_subnets,
                exclude_subnets,
                priority,
                age: Age {
                    created: EPOCH + 2 * 86_400 + 60 * i64::from(u32_of(p)),
                    uid: rng.uid(),
                },
                previous_eips: Vec::new(),
                previous_node: None,
            }
        })
        .collect()
}

/// A namespaced policy: ten per namespace; most select one app, some two,
/// some a slice of one node's pod CIDR.
fn namespaced_target(
    rng: &mut Rng,
    p: usize,
    nodes: &[Node],
    namespaces: &[AppNamespace],
) -> (PolicyRef, PodMatch, Option<LabelSelector>) {
    let ns = &namespaces[p % namespaces.len()];
    let app = *rng.pick(&ns.apps);
    let roll = rng.below(100);
    let pods = if roll < 80 {
        PodMatch::Selector(LabelSelector::eq("app", app))
    } else if roll < 85 {
        let other = *rng.pick(&ns.apps);
        PodMatch::Selector(LabelSelector {
            match_labels: Labels::new(),
            match_expressions: vec![Requirement::In(
                "app".into(),
                [app.to_owned(), other.to_owned()].into(),
            )],
        })
    } else {
        PodMatch::Subnets(vec![pod_subnet(rng, nodes)])
    };
    let name = format!("{app}-egress-{p:05}");
    (PolicyRef::namespaced(&ns.namespace.name, name), pods, None)
}

/// Part of a random node's pod CIDR: the whole of it, or its first /26.. /30.
fn pod_subnet(rng: &mut Rng, nodes: &[Node]) -> IpNet {
    let node = rng.pick(nodes);
    match node.pod_cidrs.first() {
        Some(IpNet::V4(cidr)) => {
            let len = (cidr.prefix_len() + 2 * u8::try_from(rng.below(4)).expect("small")).min(30);
            IpNet::V4(net(cidr.network(), len))
        }
        Some(other) => *other,
        None => IpNet::V4(net(POD_BASE, 8)),
    }
}

/// A cluster policy: by team, by team and environment (all pods there), by
/// two teams, or by app and version across every namespace.
fn cluster_target(
    rng: &mut Rng,
    p: usize,
    namespaces: &[AppNamespace],
) -> (PolicyRef, PodMatch, Option<LabelSelector>) {
    let ns = rng.pick(namespaces);
    let app = *rng.pick(&ns.apps);
    let (pods, namespace_selector) = match p % 4 {
        0 => (
            LabelSelector::eq("app", app),
            Some(LabelSelector::eq("team", &ns.team)),
        ),
        1 => {
            let mut by_env = LabelSelector::eq("team", &ns.team);
            by_env.match_labels.insert("env".into(), "prod".into());
            (LabelSelector::default(), Some(by_env))
        }
        2 => {
            let other = &rng.pick(namespaces).team;
            let teams = LabelSelector {
                match_labels: Labels::new(),
                match_expressions: vec![Requirement::In(
                    "team".into(),
                    [ns.team.clone(), other.clone()].into(),
                )],
            };
            (LabelSelector::eq("app", app), Some(teams))
        }
        _ => {
            let mut selector = LabelSelector::eq("app", app);
            selector.match_labels.insert("version".into(), "v2".into());
            (selector, None)
        }
    };
    let id = PolicyRef::cluster(format!("{}-{app}-{p:05}", ns.team));
    (id, PodMatch::Selector(pods), namespace_selector)
}

/// Mostly the gateway's shared EIP; a fifth take one of their own, a few
/// leave with the node's address, a few pin an address.
fn egress_ip(rng: &mut Rng, gateway: Option<usize>, pinned: &mut [u32]) -> EgressIpSpec {
    let roll = rng.below(100);
    let mut spec = EgressIpSpec::default();
    if roll < 20 {
        spec.allocator = Allocator::RoundRobin;
    } else if roll < 22 {
        spec.use_node_ip = true;
    } else if let Some(k) = gateway.filter(|_| roll < 23)
        && pinned[k] < 64
    {
        // The /26 of the pool, from its top down.
        spec.ipv4 = Some(v4(pool_base(k) + 256 + 63 - pinned[k]));
        pinned[k] += 1;
    }
    spec
}

/// A prefix of length `base.len() ..= base.len() + extra` inside `base`.
fn sub_prefix(rng: &mut Rng, base: Ipv4Net, extra: u8) -> Ipv4Net {
    let len = (base.prefix_len() + u8::try_from(rng.below(usize::from(extra) + 1)).expect("small"))
        .min(32);
    let spare_bits = len - base.prefix_len();
    let index = u32::try_from(rng.next() % (1u64 << spare_bits)).expect("fits u32");
    let step = 1u64 << (32 - len);
    let offset = u32::try_from(u64::from(index) * step).expect("inside an IPv4 prefix");
    net(v4(u32::from(base.network()) + offset), len)
}

/// One destination prefix: a slice of a documentation network, a /16 of
/// 11.0.0.0/8, or a single host.
fn dest_prefix(rng: &mut Rng) -> IpNet {
    let test_nets = [
        net(Ipv4Addr::new(192, 0, 2, 0), 24),
        net(Ipv4Addr::new(198, 51, 100, 0), 24),
        net(Ipv4Addr::new(203, 0, 113, 0), 24),
    ];
    let roll = rng.below(100);
    let test_net = *rng.pick(&test_nets);
    IpNet::V4(if roll < 55 {
        sub_prefix(rng, test_net, 4)
    } else if roll < 85 {
        let second = u8::try_from(rng.below(256)).expect("an octet");
        net(Ipv4Addr::new(11, second, 0, 0), 16)
    } else {
        let host = u32::from(test_net.network()) + u32_of(rng.below(256));
        net(v4(host), 32)
    })
}

/// `spec.destSubnet`: empty (everything outside the cluster) for about one
/// policy in seven, else one to three prefixes.
fn dest_subnets(rng: &mut Rng) -> Vec<IpNet> {
    if rng.percent(15) {
        return Vec::new();
    }
    let count = 1 + usize::from(rng.percent(30)) + usize::from(rng.percent(10));
    let mut subnets: Vec<IpNet> = (0..count).map(|_| dest_prefix(rng)).collect();
    subnets.sort();
    subnets.dedup();
    subnets
}

/// `spec.excludeSubnet`: a slice of the first destination, or for a policy
/// that covers everything, a /16 of 11.0.0.0/8 or a documentation network.
fn exclude_subnets(rng: &mut Rng, dest: &[IpNet]) -> Vec<IpNet> {
    match dest.first() {
        Some(IpNet::V4(first)) if first.prefix_len() <= 28 => {
            let inner = net(first.network(), first.prefix_len() + 2);
            vec![IpNet::V4(sub_prefix(rng, inner, 2))]
        }
        Some(_) => Vec::new(),
        None => {
            let second = u8::try_from(rng.below(256)).expect("an octet");
            vec![
                IpNet::V4(net(Ipv4Addr::new(11, second, 0, 0), 16)),
                IpNet::V4(net(Ipv4Addr::new(203, 0, 113, 0), 24)),
            ]
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn same(a: &Snapshot, b: &Snapshot) -> bool {
        a.config == b.config
            && a.nodes == b.nodes
            && a.namespaces == b.namespaces
            && a.pods == b.pods
            && a.gateways == b.gateways
            && a.policies == b.policies
            && a.tunnels == b.tunnels
            && a.invalid == b.invalid
    }

    #[test]
    fn the_same_sizes_give_the_same_cluster() {
        assert!(same(
            &synthetic_cluster(20, 300, 2_000),
            &synthetic_cluster(20, 300, 2_000)
        ));
    }

    #[test]
    fn the_cluster_has_the_requested_counts() {
        let s = synthetic_cluster(100, 1_000, 10_000);
        assert_eq!(s.nodes.len(), 100);
        assert_eq!(s.policies.len(), 1_000);
        assert_eq!(s.pods.len(), 10_000);
        assert_eq!(s.gateways.len(), 2);
        // 100 application namespaces and kube-system.
        assert_eq!(s.namespaces.len(), 101);
        assert_eq!(s.gateways.iter().filter(|g| g.cluster_default).count(), 1);
        assert_eq!(
            s.nodes
                .iter()
                .filter(|n| n.labels.contains_key(GATEWAY_LABEL))
                .count(),
            10
        );
    }

    #[test]
    fn tiny_and_empty_sizes_still_make_a_cluster() {
        let s = synthetic_cluster(1, 0, 0);
        assert_eq!(
            (
                s.nodes.len(),
                s.policies.len(),
                s.pods.len(),
                s.gateways.len()
            ),
            (1, 0, 0, 1)
        );
        let s = synthetic_cluster(1, 1, 300);
        assert_eq!(s.pods.len(), 300);
    }

    #[test]
    fn every_pod_ip_is_unique_and_inside_its_nodes_pod_cidr() {
        let s = synthetic_cluster(30, 100, 9_000);
        let nodes: BTreeMap<&str, &Node> = s.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
        let mut seen = BTreeSet::new();
        for pod in s.pods.iter().filter(|p| !p.host_network) {
            for ip in &pod.ips {
                let node = nodes[pod.node.as_deref().expect("a pod with an IP is scheduled")];
                assert!(node.pod_cidrs.iter().any(|c| c.contains(ip)), "{pod:?}");
                assert!(seen.insert(*ip), "{ip} is used twice");
            }
        }
    }

    #[test]
    fn a_thousand_nodes_get_distinct_addresses_outside_the_service_cidr() {
        let s = synthetic_cluster(1_000, 10, 10);
        let service = Config::default().service_cidrs[0];
        let cidrs: BTreeSet<IpNet> = s.nodes.iter().flat_map(|n| n.pod_cidrs.clone()).collect();
        let addrs: BTreeSet<IpAddr> = s.nodes.iter().flat_map(|n| n.addresses.clone()).collect();
        assert_eq!((cidrs.len(), addrs.len()), (1_000, 1_000));
        assert!(
            cidrs
                .iter()
                .all(|c| !service.contains(c) && !c.contains(&service))
        );
        let tunnels = IpNet::V4(Config::default().tunnel_ipv4_subnet);
        assert!(addrs.iter().all(|a| !tunnels.contains(a)));
    }

    #[test]
    fn policies_name_existing_namespaces_and_gateways_and_pin_pool_addresses() {
        let s = synthetic_cluster(50, 2_000, 5_000);
        let namespaces: BTreeSet<&str> = s.namespaces.iter().map(|n| n.name.as_str()).collect();
        let gateways: BTreeMap<&str, &Gateway> =
            s.gateways.iter().map(|g| (g.name.as_str(), g)).collect();
        let mut ids = BTreeSet::new();
        for policy in &s.policies {
            assert!(ids.insert(&policy.id), "{} twice", policy.id);
            if let Some(ns) = &policy.id.namespace {
                assert!(namespaces.contains(ns.as_str()), "{}", policy.id);
            }
            let gateway = gateways[policy.gateway.as_deref().unwrap_or("default")];
            if let Some(ip) = policy.egress_ip.ipv4 {
                assert!(gateway.ipv4_pool.contains(IpAddr::V4(ip)), "{}", policy.id);
            }
            for subnet in policy.dest_subnets.iter().chain(&policy.exclude_subnets) {
                assert_eq!(*subnet, subnet.trunc(), "{} has host bits set", policy.id);
            }
        }
        assert!(s.policies.iter().any(|p| p.id.namespace.is_none()));
        assert!(
            s.policies
                .iter()
                .any(|p| matches!(p.pods, PodMatch::Subnets(_)))
        );
        assert!(s.policies.iter().any(|p| p.dest_subnets.is_empty()));
        assert!(s.policies.iter().any(|p| !p.exclude_subnets.is_empty()));
        assert!(s.policies.iter().any(|p| p.priority > 0));
        assert!(
            s.policies
                .iter()
                .any(|p| p.egress_ip.allocator == Allocator::RoundRobin)
        );
    }

    #[test]
    fn most_namespaced_app_policies_select_some_pod() {
        let s = synthetic_cluster(100, 1_000, 10_000);
        let app_policies: Vec<&Policy> = s
            .policies
            .iter()
            .filter(|p| p.id.namespace.is_some() && matches!(p.pods, PodMatch::Selector(_)))
            .map(|p| &**p)
            .collect();
        let selecting = app_policies
            .iter()
            .filter(|policy| {
                let PodMatch::Selector(selector) = &policy.pods else {
                    return false;
                };
                s.pods.iter().any(|pod| {
                    Some(&pod.namespace) == policy.id.namespace.as_ref()
                        && selector.matches(&pod.labels)
                })
            })
            .count();
        assert!(
            selecting * 10 >= app_policies.len() * 9,
            "{selecting} of {}",
            app_policies.len()
        );
    }

    #[test]
    fn pools_hold_a_few_hundred_addresses_and_do_not_overlap() {
        let s = synthetic_cluster(10, 5_000, 10);
        assert_eq!(s.gateways.len(), 10);
        let mut all = BTreeSet::new();
        for gateway in &s.gateways {
            assert_eq!(gateway.ipv4_pool.len(), POOL_SIZE as u128);
            assert!(gateway.ipv4_pool.iter().all(|ip| all.insert(ip)));
        }
    }
}

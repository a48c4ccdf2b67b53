//! Reconciling a node's kernel on a real network namespace: classification
//! entries (1k, 10k) and 100 peers, from scratch, unchanged, and with one
//! entry changed.
//!
//! Needs root: the bench moves itself into a network namespace of its own
//! (which disappears with the process) and builds an underlay link there.
//! Without root it prints why and measures nothing.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use egressgw_benches::bench_vxlan;
use egressgw_core::model::{Config, Mac, PolicyRef};
use egressgw_core::state::{Action, ClassifyEntry, NodeState, Peer, Route, Rule};
use egressgw_dataplane::netlink::Rtnetlink;
use egressgw_dataplane::nft::Nft;
use egressgw_dataplane::reconcile::Dataplane;
use ipnet::IpNet;

const PEERS: u32 = 100;

/// This node plus `PEERS` peers, every one of them a gateway, and `entries`
/// classification entries: pods of this node times 10 destination prefixes,
/// spread over the gateways.
fn node_state(cfg: &Config, entries: u32) -> NodeState {
    let v4 = |n: u32| Ipv4Addr::from(n);
    let peers: Vec<Peer> = (1..=PEERS)
        .map(|i| Peer {
            node: format!("node-{i:03}"),
            underlay: IpAddr::V4(v4(0xac12_0000 + 100 + i)),
            mac: Mac([2, 0, 0, 0, (i >> 8) as u8, i as u8]),
            ipv4: Some(v4(0xac1f_0000 + 1 + i)),
            ipv6: None,
        })
        .collect();
    let routes: Vec<Route> = peers
        .iter()
        .enumerate()
        .map(|(i, p)| Route {
            table: cfg.route_table_base + i as u32,
            gateway: p.node.clone(),
            via_ipv4: p.ipv4,
            via_ipv6: None,
        })
        .collect();
    let rules = (1..=PEERS)
        .map(|i| Rule {
            priority: cfg.rule_priority,
            mark: cfg.mark(i),
            mask: cfg.mark_mask,
            table: cfg.route_table_base + i - 1,
        })
        .collect();
    let policy = std::sync::Arc::new(PolicyRef::namespaced("bench", "p"));
    let classify = (0..entries)
        .map(|n| {
            let (pod, prefix) = (n / 10, n % 10);
            let gateway = 1 + n % PEERS;
            ClassifyEntry {
                src: IpAddr::V4(v4(0x0af4_0000 + pod)),
                dst: IpNet::new(IpAddr::V4(v4(0xc000_0000 + (prefix << 16))), 16).expect("prefix"),
                action: Action::Tunnel {
                    gateway: format!("node-{gateway:03}"),
                    mark: cfg.mark(gateway),
                },
                policy: Some(policy.clone()),
                group: None,
            }
        })
        .collect();
    NodeState {
        node: "node-000".into(),
        vxlan: Some(bench_vxlan(cfg)),
        peers,
        routes,
        rules,
        cluster_cidrs: vec!["10.244.0.0/16".parse().expect("cidr")],
        classify,
        ..NodeState::default()
    }
}

fn sh(cmd: &str) {
    let ok = Command::new("sh")
        .args(["-c", cmd])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "`{cmd}` failed");
}

fn bench(c: &mut Criterion) {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("reconcile bench skipped: needs root (it builds a network namespace)");
        return;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    sh(
        "ip link set lo up && ip link add name ul0 type veth peer name ul1 \
        && ip addr add 172.18.0.100/16 dev ul0 && ip link set ul0 up && ip link set ul1 up",
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let cfg = Config::default();
    let mut dp = rt.block_on(async {
        Dataplane::new(
            Rtnetlink::connect().expect("netlink"),
            Nft::new(),
            cfg.clone(),
        )
    });
    let mut group = c.benchmark_group("reconcile");
    group.sample_size(10);
    for entries in [1_000, 10_000] {
        let state = node_state(&cfg, entries);
        let mut changed = state.clone();
        changed.classify[0].action = Action::Tunnel {
            gateway: "node-002".into(),
            mark: cfg.mark(2),
        };
        group.bench_function(format!("fresh/{entries}-entries-{PEERS}-peers"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    rt.block_on(dp.cleanup());
                    let start = Instant::now();
                    let report = black_box(rt.block_on(dp.reconcile(&state)));
                    total += start.elapsed();
                    assert!(report.is_ok(), "{:?}", report.failed);
                }
                total
            });
        });
        rt.block_on(dp.reconcile(&state));
        group.bench_function(format!("unchanged/{entries}-entries-{PEERS}-peers"), |b| {
            b.iter(|| {
                let report = rt.block_on(dp.reconcile(&state));
                assert_eq!(report.ops(), 0, "{:?}", report.failed);
            });
        });
        group.bench_function(format!("one-change/{entries}-entries-{PEERS}-peers"), |b| {
            let mut flip = false;
            b.iter(|| {
                flip = !flip;
                let report = rt.block_on(dp.reconcile(if flip { &changed } else { &state }));
                assert!(report.is_ok(), "{:?}", report.failed);
            });
        });
        rt.block_on(dp.cleanup());
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

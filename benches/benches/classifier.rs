//! Filling the eBPF classifier's maps at scale: 10 000 policies selecting
//! 100 000 pod addresses (10 each, one destination prefix per policy), so
//! 100 000 trie entries and 10 000 counters, against 10 entries:
//!
//! - `full-sync`: a freshly loaded classifier (empty maps) made to hold it
//!   all, the agent's first reconcile on a node;
//! - `resync`: the same again, nothing to change, every later reconcile;
//! - `one-pod`: one pod address added, then removed, each sync touching
//!   that entry only (the bench checks the counts it reports).
//!
//! - `lookup-hit` / `lookup-miss`: what the program costs per packet with
//!   those maps, for a packet of a selected pod (a trie hit, counted and
//!   marked) and of a pod no policy selects, timed by the kernel itself
//!   (`BPF_PROG_TEST_RUN`, [`Classifier::trial`]): the time a pod's
//!   packet spends in the classifier, which is what the map's size could
//!   change on the datapath.
//!
//! It prints the process's resident memory as it builds the node state,
//! the desired maps and syncs them: what the classifier's side of an agent
//! costs at each size.
//!
//! Needs root and a kernel that loads the program, and the program built
//! in (the eBPF toolchain); otherwise it prints why and measures nothing.
//! The maps are not pinned: they go away with the bench.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use egressgw_benches::bench_vxlan;
use egressgw_core::model::{Config, Mac, PolicyRef};
use egressgw_core::state::{Action, ClassifyEntry, NodeState, Peer};
use egressgw_dataplane::ebpf::{Classifier, Desired, Trial, tcp_frame};
use ipnet::IpNet;

/// Pods each policy selects.
const PODS_PER_POLICY: u32 = 10;

/// `pods` pod addresses of this node, 10 per policy, each policy with a
/// destination /24 of its own and one of 10 gateways.
fn node_state(cfg: &Config, pods: u32) -> NodeState {
    let v4 = |n: u32| Ipv4Addr::from(n);
    let peers: Vec<Peer> = (1..=10u8)
        .map(|i| Peer {
            node: format!("gw-{i}"),
            underlay: IpAddr::V4(v4(0xac12_0000 + 100 + u32::from(i))),
            mac: Mac([2, 0, 0, 0, 1, i]),
            ipv4: Some(v4(0xac1f_0001 + u32::from(i))),
            ipv6: None,
        })
        .collect();
    let classify = (0..pods)
        .map(|n| {
            let policy = n / PODS_PER_POLICY;
            let gateway = 1 + policy % 10;
            ClassifyEntry {
                // 10.0.0.0/8 holds 16M pods; the policy's /24 is in 100.64/10.
                src: IpAddr::V4(v4(0x0a00_0000 + n)),
                dst: IpNet::new(IpAddr::V4(v4(0x6440_0000 + (policy << 8))), 24).expect("prefix"),
                action: Action::Tunnel {
                    gateway: format!("gw-{gateway}"),
                    mark: cfg.mark(gateway),
                },
                policy: Some(
                    PolicyRef::namespaced(format!("ns-{}", policy / 10), format!("p-{policy}"))
                        .into(),
                ),
                group: None,
            }
        })
        .collect();
    NodeState {
        node: "node-0".into(),
        vxlan: Some(bench_vxlan(cfg)),
        peers,
        cluster_cidrs: vec!["10.0.0.0/8".parse().expect("cidr")],
        classify,
        ..NodeState::default()
    }
}

/// The process's resident memory, in MiB (`VmRSS`).
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

fn bench(c: &mut Criterion) {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("classifier bench skipped: needs root (it loads the eBPF program)");
        return;
    }
    let loaded = match Classifier::load() {
        Ok(classifier) => classifier,
        Err(e) => {
            eprintln!("classifier bench skipped: {e}");
            return;
        }
    };
    drop(loaded);
    let cfg = Config::default();
    let mut group = c.benchmark_group("classifier");
    group.sample_size(10);
    // The large size first, in a process that has only loaded the program
    // once, as an agent has at its start: its memory is what the agent's
    // classifier side costs.
    for pods in [100_000u32, 10] {
        let policies = pods.div_ceil(PODS_PER_POLICY);
        let size = format!("{pods}-pods-{policies}-policies");
        // In the agent's order: the program is loaded at start, before any
        // state (the loader parses the kernel's type information, memory
        // that later allocations reuse once it is freed).
        let before = rss_mib();
        let mut synced = Classifier::load().expect("the program loads");
        let loaded = rss_mib();
        let state = node_state(&cfg, pods);
        let with_state = rss_mib();
        let desired = Desired::new(&state, &cfg);
        let with_desired = rss_mib();
        let first = synced.sync(&desired).expect("sync");
        // Every pod's entry, and the in-cluster range.
        assert_eq!(first.added, pods as usize + 1, "{first:?}");
        synced.sync(&desired).expect("sync");
        eprintln!(
            "classifier/{size}: resident memory {before:.1} MiB, {loaded:.1} MiB with the program \
             loaded, {with_state:.1} MiB with the node state built, {with_desired:.1} MiB with the \
             desired maps, {:.1} MiB after a sync and a resync",
            rss_mib()
        );
        group.bench_function(format!("full-sync/{size}"), |b| {
            b.iter_batched(
                || Classifier::load().expect("the program loads"),
                |mut fresh| black_box(fresh.sync(&desired).expect("sync")),
                BatchSize::PerIteration,
            );
        });
        group.bench_function(format!("resync/{size}"), |b| {
            b.iter(|| {
                let again = synced.sync(&desired).expect("sync");
                assert!(again.is_empty(), "{again:?}");
            });
        });
        // A selected pod's packet to its policy's destinations (the last
        // policy's, deep in the trie), and one of a pod no entry has.
        let last = state.classify.last().expect("entries");
        let dst = match last.dst {
            IpNet::V4(net) => IpAddr::V4(Ipv4Addr::from(u32::from(net.network()) + 1)),
            IpNet::V6(_) => unreachable!("the bench's entries are IPv4"),
        };
        let hit = tcp_frame(last.src, dst);
        let miss = tcp_frame(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)), dst);
        let seen = synced.trial(&hit, 1).expect("trial");
        assert_eq!(
            (seen.action, seen.mark != 0),
            (Trial::PASS, true),
            "{seen:?}"
        );
        assert_eq!(synced.trial(&miss, 1).expect("trial").mark, 0);
        for (name, frame) in [("lookup-hit", &hit), ("lookup-miss", &miss)] {
            group.bench_function(format!("{name}/{size}"), |b| {
                // The kernel's own time per run, repeated `iters` times.
                b.iter_custom(|iters| {
                    let repeat = u32::try_from(iters).unwrap_or(u32::MAX);
                    let t = synced.trial(frame, repeat).expect("trial");
                    t.per_run * repeat
                });
            });
        }
        let mut grown = state.clone();
        let mut pod = grown.classify[0].clone();
        pod.src = IpAddr::V4(Ipv4Addr::new(10, 255, 255, 254));
        grown.classify.push(pod);
        let grown = Desired::new(&grown, &cfg);
        // Criterion calls the closure again for each sample: the toggle
        // lives outside it, as the maps do.
        let mut add = true;
        group.bench_function(format!("one-pod/{size}"), |b| {
            b.iter(|| {
                let change = synced
                    .sync(if add { &grown } else { &desired })
                    .expect("sync");
                assert_eq!(
                    change.added + change.removed + change.changed,
                    1,
                    "{change:?}"
                );
                add = !add;
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

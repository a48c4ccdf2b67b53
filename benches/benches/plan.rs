//! The planner on synthetic clusters of three sizes.
//!
//! - `fresh`: a cluster seen for the first time; everything is allocated.
//! - `steady`: the same cluster after its status was written back; the
//!   controller's usual case, where nothing moves.
//! - `node`: the steady cluster planned for one worker node only, as an
//!   agent does on every reconcile.
//! - `status`: the steady cluster's allocations and status without any
//!   node's dataplane state, as the controller plans it.
//! - `agent-worker/full`, `agent-gateway/full`: an agent's [`Planner`]
//!   built from the Pods its node watches (a worker's own, a gateway
//!   node's every Pod): the whole plan of one node.
//! - `agent-worker/pod-change`, `agent-gateway/pod-change`: one Pod
//!   relabelled out of its policies' reach or back, in that planner; the
//!   Pods are ones whose change reaches the node's state.
//! - `controller/full`, `controller/pod-change`: the controller's
//!   [`Publisher`] built from every Pod (what a policy added or deleted
//!   costs it), and one selected Pod relabelled out of its policies'
//!   reach or back in it, with the status that follows.
//!
//! - `agent-worker/policy-edit`, `agent-gateway/policy-edit`,
//!   `controller/policy-edit`: one of ten policies across the list given a
//!   destination, or its old destinations back, as the policy's change
//!   (`change_policies`), in that planner or publisher (the controller's
//!   with the status after it); the changed policy is made outside the
//!   measurement.
//!
//! - `agent-worker/policy-add-delete`, `agent-gateway/policy-add-delete`:
//!   one of ten policies across the list deleted, or added back, as the
//!   policy's change, in that planner.
//! - `agent-worker/namespace-relabel`, `agent-gateway/namespace-relabel`:
//!   one of ten namespaces across the list given a label, or its old
//!   labels back, as a whole cluster (`set_cluster`); the cluster is made
//!   outside the measurement.
//!
//! Snapshots are built once per size, outside the measurement, and the
//! plan's drop is not timed.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use egressgw_benches::{agent_node, next_snapshot, pods_reaching, relabelled, synthetic_cluster};
use egressgw_core::plan::scoped;
use egressgw_core::{
    Planner, PolicyChange, Publisher, Snapshot, plan, plan_node, plan_published, plan_status,
    pod_scope,
};

/// `(nodes, policies, pods)`.
type Size = (usize, usize, usize);

const SMALL: Size = (10, 100, 1_000);
const MEDIUM: Size = (100, 1_000, 10_000);
const LARGE: Size = (1_000, 10_000, 100_000);

fn label((nodes, policies, pods): Size) -> String {
    format!("plan/{nodes}n-{policies}p-{pods}pods")
}

fn bench_size(c: &mut Criterion, size: Size, tune: impl FnOnce(&mut SizeGroup<'_>)) {
    let (nodes, policies, pods) = size;
    let fresh = synthetic_cluster(nodes, policies, pods);
    let steady = next_snapshot(&fresh, &plan(&fresh));

    let mut group = c.benchmark_group(label(size));
    group.throughput(Throughput::Elements(pods as u64));
    tune(&mut group);
    group.bench_function("fresh", |b| {
        b.iter_with_large_drop(|| plan(black_box(&fresh)));
    });
    group.bench_function("steady", |b| {
        b.iter_with_large_drop(|| plan(black_box(&steady)));
    });
    // node-00001: a plain worker (node-00000 is gateway-capable).
    group.bench_function("node", |b| {
        b.iter_with_large_drop(|| plan_node(black_box(&steady), black_box("node-00001")));
    });
    group.bench_function("status", |b| {
        b.iter_with_large_drop(|| plan_status(black_box(&steady)));
    });
    for (kind, gateway) in [("agent-worker", false), ("agent-gateway", true)] {
        bench_agent(&mut group, &steady, kind, &agent_node(&steady, gateway));
    }
    bench_controller(&mut group, &steady);
    group.finish();
}

/// The controller's publisher: built whole, and changed by one selected
/// Pod, its status planned after each change.
fn bench_controller(group: &mut SizeGroup<'_>, steady: &Snapshot) {
    group.bench_function("controller/full", |b| {
        b.iter_batched(
            || steady.clone(),
            |steady| Publisher::new(black_box(steady)),
            BatchSize::LargeInput,
        );
    });
    let mut publisher = Publisher::new(steady.clone());
    let pods: Vec<_> = {
        let selected: Vec<_> = publisher
            .gateways()
            .flat_map(|(g, _)| publisher.pods_of(g))
            .collect();
        let step = (selected.len() / 100).max(1);
        selected
            .into_iter()
            .step_by(step)
            .take(100)
            .cloned()
            .collect()
    };
    let mut turn = 0usize;
    group.bench_function("controller/pod-change", |b| {
        b.iter_with_large_drop(|| {
            let pod = &pods[turn % pods.len()];
            let away = (turn / pods.len()).is_multiple_of(2);
            publisher.set_pod(relabelled(pod, away));
            turn += 1;
            publisher.status()
        });
    });
    let edits = policy_edits(publisher.cluster());
    let mut turn = 0usize;
    group.bench_function("controller/policy-edit", |b| {
        b.iter_batched(
            || {
                let change = edits[turn % edits.len()].clone();
                turn += 1;
                change
            },
            |change| {
                publisher.change_policies([change]);
                publisher.status()
            },
            BatchSize::SmallInput,
        );
    });
}

/// Ten policies across the list, each deleted and then added back: twenty
/// changes, to be taken in turn.
fn policy_deletions(cluster: &Snapshot) -> Vec<PolicyChange> {
    let count = cluster.policies.len();
    (0..10)
        .flat_map(|k| {
            let policy = cluster.policies[k * count / 10].clone();
            [
                PolicyChange::Removed(policy.id.clone()),
                PolicyChange::Set(policy),
            ]
        })
        .collect()
}

/// Ten namespaces across the list, each given a label and then its old
/// labels back: twenty namespace lists, to be taken in turn.
fn relabels(cluster: &Snapshot) -> Vec<Vec<egressgw_core::model::Namespace>> {
    let count = cluster.namespaces.len();
    (0..10)
        .flat_map(|k| {
            let old = cluster.namespaces.clone();
            let mut new = old.clone();
            if let Some(namespace) = new.get_mut(k * count / 10) {
                namespace.labels.insert("relabelled".into(), "yes".into());
            }
            [new, old]
        })
        .collect()
}

/// Ten policies across the list, each given a destination and then its
/// old destinations back: twenty changes, to be taken in turn.
fn policy_edits(cluster: &Snapshot) -> Vec<PolicyChange> {
    let count = cluster.policies.len();
    (0..10)
        .flat_map(|k| {
            let old = cluster.policies[k * count / 10].clone();
            let mut new = old.clone();
            Arc::make_mut(&mut new)
                .dest_subnets
                .push("192.0.2.0/24".parse().expect("a prefix"));
            [PolicyChange::Set(new), PolicyChange::Set(old)]
        })
        .collect()
}

/// An agent's planner of `node` from the Pods it watches: built whole,
/// and changed by one Pod.
fn bench_agent(group: &mut SizeGroup<'_>, steady: &Snapshot, kind: &str, node: &str) {
    let published = plan_published(steady).gateway_pods;
    let own = scoped(steady, node, pod_scope(steady, node), &published);
    drop(published);
    group.bench_function(format!("{kind}/full"), |b| {
        b.iter_batched(
            || own.clone(),
            |own| Planner::new(black_box(own), node),
            BatchSize::LargeInput,
        );
    });
    let mut planner = Planner::new(own.clone(), node);
    let state = planner.state().expect("the node is planned").clone();
    let pods = pods_reaching(&own, &state, 100);
    let mut turn = 0usize;
    group.bench_function(format!("{kind}/pod-change"), |b| {
        b.iter(|| {
            let pod = &pods[turn % pods.len()];
            let away = (turn / pods.len()).is_multiple_of(2);
            planner.set_pod(relabelled(pod, away));
            turn += 1;
        });
    });
    for (name, changes) in [
        ("policy-edit", policy_edits(planner.cluster())),
        ("policy-add-delete", policy_deletions(planner.cluster())),
    ] {
        let mut turn = 0usize;
        group.bench_function(format!("{kind}/{name}"), |b| {
            b.iter_batched(
                || {
                    let change = changes[turn % changes.len()].clone();
                    turn += 1;
                    change
                },
                |change| planner.change_policies([change]),
                BatchSize::SmallInput,
            );
        });
    }
    // Nothing but the namespaces changes from here on.
    let base = planner.cluster().clone();
    let namespaces = relabels(&base);
    let mut turn = 0usize;
    group.bench_function(format!("{kind}/namespace-relabel"), |b| {
        b.iter_batched(
            || {
                let mut cluster = base.clone();
                cluster.namespaces = namespaces[turn % namespaces.len()].clone();
                turn += 1;
                cluster
            },
            |cluster| planner.set_cluster(cluster),
            BatchSize::LargeInput,
        );
    });
}

type SizeGroup<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

fn small(c: &mut Criterion) {
    bench_size(c, SMALL, |_| {});
}

fn medium(c: &mut Criterion) {
    bench_size(c, MEDIUM, |group| {
        group.sample_size(20);
        group.measurement_time(Duration::from_secs(10));
    });
}

/// Few samples of flat size: each run may take a good part of a second, and
/// the whole suite should finish in a few minutes on two cores.
fn large(c: &mut Criterion) {
    bench_size(c, LARGE, |group| {
        group.sample_size(10);
        group.sampling_mode(SamplingMode::Flat);
        group.warm_up_time(Duration::from_secs(2));
        group.measurement_time(Duration::from_secs(30));
    });
}

criterion_group!(benches, small, medium, large);
criterion_main!(benches);

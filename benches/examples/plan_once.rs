//! Plans one synthetic cluster once, whole, for one worker node (as an
//! agent does) and for its status only (as the controller does), and
//! prints how long each took and how big the plan is:
//! `cargo run --release -p egressgw-benches --example plan_once -- 1000 10000 100000`.
//! With `PLAN_ONCE_AGENT=1`, only the one worker node's plan, and the
//! process's peak memory then: what an agent holds. `PLAN_ONCE_AGENT=worker`
//! and `PLAN_ONCE_AGENT=gateway` plan a worker node and a gateway node from
//! the Pods their agents watch (`egressgw_core::pod_scope`), in a process
//! that never holds the other Pods, and print its peak memory. With
//! `PLAN_ONCE_DIGEST=1`, a digest of the whole plan, to check that a change
//! to the planner plans the same.

use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("three numbers: nodes policies pods"))
        .collect();
    let [nodes, policies, pods] = args[..] else {
        eprintln!("usage: plan_once NODES POLICIES PODS");
        std::process::exit(2);
    };
    if let Some(kind @ ("worker" | "gateway")) = std::env::var("PLAN_ONCE_AGENT").ok().as_deref() {
        scoped_agent(kind, (nodes, policies, pods));
        return;
    }
    let snapshot = egressgw_benches::synthetic_cluster(nodes, policies, pods);
    if std::env::var_os("PLAN_ONCE_DIGEST").is_some() {
        // A digest of the whole plan, to check that a change to the planner
        // plans the same.
        use std::hash::{Hash, Hasher};
        let plan = egressgw_core::plan(&snapshot);
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        format!("{plan:?}").hash(&mut hasher);
        println!(
            "{nodes} nodes, {policies} policies, {pods} pods: plan digest {:016x}",
            hasher.finish()
        );
        return;
    }
    if std::env::var_os("PLAN_ONCE_AGENT").is_some() {
        // Only what an agent plans, for its memory.
        let start = Instant::now();
        let agent = egressgw_core::plan_node(&snapshot, "node-00001");
        println!(
            "{nodes} nodes, {policies} policies, {pods} pods, one worker node: {:.2?}, {:.0} MiB at the peak",
            start.elapsed(),
            rss("VmHWM:")
        );
        drop(agent);
        return;
    }
    let start = Instant::now();
    let plan = egressgw_core::plan(&snapshot);
    let took = start.elapsed();
    let classify: usize = plan.nodes.values().map(|n| n.classify.len()).sum();
    let snat: usize = plan.nodes.values().map(|n| n.snat.len()).sum();
    println!(
        "{nodes} nodes, {policies} policies, {pods} pods: plan in {took:.2?}; {classify} classify, {snat} snat entries"
    );
    let start = Instant::now();
    let one = egressgw_core::plan_node(&snapshot, "node-00001");
    println!("  one worker node: {:.2?}", start.elapsed());
    drop(one);
    let start = Instant::now();
    let status = egressgw_core::plan_status(&snapshot);
    println!("  status only: {:.2?}", start.elapsed());
    drop(status);
    drop(plan);
    println!(
        "  memory: {:.0} MiB at the peak (the whole plan); PLAN_ONCE_AGENT=1 measures an agent's alone",
        rss("VmHWM:")
    );
}

/// Plans one node of `kind` from the Pods its agent watches; the peak
/// memory is that of a process that only ever held those Pods (the
/// agent's snapshot and plan; its watch caches are not counted here).
fn scoped_agent(kind: &str, size: (usize, usize, usize)) {
    let (nodes, policies, pods) = size;
    // The nodes and gateways alone decide which Pods a node watches.
    let shape = egressgw_benches::synthetic_cluster(nodes, policies, 0);
    // The second of its kind where there are two: the synthetic cluster
    // leaves node-00001's Pods pending at some sizes.
    let of_kind: Vec<String> = shape
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .filter(|n| {
            let scope = egressgw_core::pod_scope(&shape, n);
            (scope == egressgw_core::PodScope::Cluster) == (kind == "gateway")
        })
        .collect();
    let node = of_kind
        .get(1)
        .or(of_kind.first())
        .cloned()
        .expect("the synthetic cluster has nodes of each kind");
    let scope = egressgw_core::pod_scope(&shape, &node);
    drop(shape);
    let mut own = egressgw_benches::synthetic_cluster_where(nodes, policies, pods, &|p| {
        scope == egressgw_core::PodScope::Cluster || p.node.as_deref() == Some(node.as_str())
    });
    // The controller's placement, published: what the agent follows.
    // Placement does not depend on the Pods, so the agent's own Pods give
    // the controller's.
    let status = egressgw_core::plan_status(&own);
    egressgw_core::remember(&mut own, &status);
    drop(status);
    let start = Instant::now();
    let plan = egressgw_core::plan_node_published(&own, &node);
    println!(
        "{nodes} nodes, {policies} policies, {pods} pods, {kind} {node} ({} pods watched): \
         {:.2?}, {:.0} MiB at the peak",
        own.pods.len(),
        start.elapsed(),
        rss("VmHWM:")
    );
    drop(plan);
}

/// A `/proc/self/status` figure in MiB (`VmHWM:`: the peak resident set).
fn rss(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(key)?
                    .trim()
                    .strip_suffix(" kB")?
                    .parse::<u64>()
                    .ok()
            })
        })
        .map_or(0.0, |kib| kib as f64 / 1024.0)
}

//! Plans one synthetic cluster once, whole, for one worker node (as an
//! agent does) and for its status only (as the controller does), and
//! prints how long each took and how big the plan is:
//! `cargo run --release -p egressgw-benches --example plan_once -- 1000 10000 100000`.
//! With `PLAN_ONCE_AGENT=1`, only the one worker node's plan, and the
//! process's peak memory then: what an agent holds. `PLAN_ONCE_AGENT=worker`
//! and `PLAN_ONCE_AGENT=gateway` plan a worker node and a gateway node from
//! the Pods their agents watch (`egressgw_core::pod_scope`), in a process
//! that never holds the other Pods, and print its peak memory (a gateway
//! node's agent holds its own Pods and those the controller publishes for
//! its gateways, `egressgw_core::plan_published`). With
//! `PLAN_ONCE_DIGEST=1`, a digest of the whole plan, to check that a change
//! to the planner plans the same. With `PLAN_ONCE_CHANGES=N` beside
//! `PLAN_ONCE_AGENT=worker|gateway`, the agent's incremental planner is
//! built, N of its Pods changed one by one and policies edited, deleted
//! and added back (ten across the list, then up to five of each
//! allocator, printed apart; `PLAN_ONCE_EACH=M` takes up to M of each,
//! for a profile of them), each timed. With
//! `PLAN_ONCE_CONTROLLER=N`, the controller's `egressgw_core::Publisher`
//! is built from every Pod, N selected Pods are changed one by one, each
//! timed with the status that follows, then ten policies edited three
//! ways (a destination, the Pod selector, a copy added and deleted), each
//! timed with its status, and the peak memory printed.

use std::collections::HashSet;
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
    if let Ok(node) = std::env::var("PLAN_ONCE_LIST_PUBLISHED") {
        let whole = egressgw_benches::synthetic_cluster(nodes, policies, pods);
        let gateway_pods = egressgw_core::plan_published(&whole).gateway_pods;
        for pod in egressgw_core::gateways_selecting(&whole, &node)
            .into_iter()
            .filter_map(|g| gateway_pods.get(g))
            .flatten()
        {
            println!("{} {}", pod.namespace, pod.name);
        }
        return;
    }
    if let Some(changes) = std::env::var("PLAN_ONCE_CONTROLLER")
        .ok()
        .and_then(|n| n.parse().ok())
    {
        publisher_changes((nodes, policies, pods), changes);
        return;
    }
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

/// The Pods the controller publishes for the gateways selecting `node`
/// (namespace, name), listed by a child process of this example.
fn published_pods(node: &str, size: (usize, usize, usize)) -> HashSet<(String, String)> {
    let (nodes, policies, pods) = size;
    let out = std::process::Command::new(std::env::current_exe().expect("this example"))
        .args([nodes, policies, pods].map(|n| n.to_string()))
        .env_remove("PLAN_ONCE_AGENT")
        .env("PLAN_ONCE_LIST_PUBLISHED", node)
        .output()
        .expect("the example runs again");
    assert!(out.status.success(), "listing the published pods failed");
    String::from_utf8(out.stdout)
        .expect("names are UTF-8")
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(ns, name)| (ns.to_owned(), name.to_owned()))
        .collect()
}

/// Plans one node of `kind` from the Pods its agent watches; the peak
/// memory is that of a process that only ever held those Pods (the
/// agent's snapshot and plan; its watch caches are not counted here).
fn scoped_agent(kind: &str, size: (usize, usize, usize)) {
    let (nodes, policies, pods) = size;
    // The nodes and gateways decide which Pods a node watches; of a
    // gateway node's, which its gateways' policies select (what the
    // controller publishes), taken as names before the cluster is dropped.
    // A child process lists them, so that this one never holds the rest.
    let shape = egressgw_benches::synthetic_cluster(nodes, policies, 0);
    let node = egressgw_benches::agent_node(&shape, kind == "gateway");
    drop(shape);
    let published = published_pods(&node, size);
    let mut own = egressgw_benches::synthetic_cluster_where(nodes, policies, pods, &|p| {
        p.node.as_deref() == Some(node.as_str())
            || published.contains(&(p.namespace.clone(), p.name.clone()))
    });
    // The controller's placement, published: what the agent follows.
    // Placement does not depend on the Pods, so the agent's own Pods give
    // the controller's.
    let status = egressgw_core::plan_status(&own);
    egressgw_core::remember(&mut own, &status);
    drop(status);
    if let Some(changes) = std::env::var("PLAN_ONCE_CHANGES")
        .ok()
        .and_then(|n| n.parse().ok())
    {
        planner_changes(kind, &node, size, own, changes);
        return;
    }
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

/// An agent's [`egressgw_core::Planner`] of `node`, built from `own` (the
/// Pods it watches), then `changes` Pods whose change reaches the node's
/// state each relabelled out of their policies' reach and back, deleted
/// and added again, then ten policies edited (a destination added and
/// taken back), then ten policies deleted and added back; prints the time
/// of each kind of change and the peak
/// memory of the process, which holds the planner's copy of the objects.
fn planner_changes(
    kind: &str,
    node: &str,
    (nodes, policies, pods): (usize, usize, usize),
    own: egressgw_core::Snapshot,
    changes: usize,
) {
    use egressgw_benches::pods_reaching;
    let watched = own.pods.len();
    // The Pods to change, chosen before: the planner takes the objects.
    let state = egressgw_core::plan_node_published(&own, node).expect("the node is planned");
    let changing = pods_reaching(&own, &state, changes);
    drop(state);
    let start = Instant::now();
    let mut planner = egressgw_core::Planner::new(own, node);
    let whole = start.elapsed();
    let mut times: [Vec<std::time::Duration>; 4] = Default::default();
    for pod in &changing {
        four_changes(&mut planner, pod, &mut times, |_| {});
    }
    // Policies edited one at a time: a destination added and taken back,
    // given as a whole cluster and as the policy's change.
    let mut edits = Vec::new();
    let mut changes = Vec::new();
    let count = planner.cluster().policies.len();
    for k in 0..10.min(count) {
        for add in [true, false] {
            let mut cluster = planner.cluster().clone();
            let policy = cluster.policy_mut(k * count / 10).expect("a policy");
            if add {
                policy
                    .dest_subnets
                    .push("192.0.2.0/24".parse().expect("a prefix"));
            } else {
                policy.dest_subnets.pop();
            }
            let change = egressgw_core::PolicyChange::Set(policy.clone().into());
            let start = Instant::now();
            planner.set_cluster(cluster);
            edits.push(start.elapsed());
            // The edit undone and made again, as a change.
            let undo = egressgw_core::PolicyChange::Set(
                planner_policy_before(&planner, k * count / 10, add).into(),
            );
            planner.change_policies([undo]);
            let start = Instant::now();
            planner.change_policies([change]);
            changes.push(start.elapsed());
        }
    }
    // Namespaces relabelled one at a time and back, as a whole cluster.
    let mut relabels = Vec::new();
    let namespaces = planner.cluster().namespaces.len();
    for k in 0..10.min(namespaces) {
        for away in [true, false] {
            let mut cluster = planner.cluster().clone();
            let namespace = &mut cluster.namespaces[k * namespaces / 10];
            let before = namespace.labels.clone();
            if away {
                namespace.labels.insert("relabelled".into(), "yes".into());
            } else {
                namespace.labels.remove("relabelled");
            }
            assert_ne!(before, namespace.labels, "a relabel changes the labels");
            let start = Instant::now();
            planner.set_cluster(cluster);
            relabels.push(start.elapsed());
        }
    }
    // Policies deleted and added back one at a time, as changes: ten
    // across the list, then up to five of each allocator.
    let (mut deleted, mut added, mut reached, mut staged) = (Vec::new(), Vec::new(), 0, 0);
    for k in 0..10.min(count) {
        let policy = planner.cluster().policies[k * count / 10].clone();
        let (removal, addition, whole, restaged) = delete_and_add(&mut planner, policy);
        deleted.push(removal);
        added.push(addition);
        reached += usize::from(whole);
        staged += restaged;
    }
    let mut by_kind = String::new();
    let each = std::env::var("PLAN_ONCE_EACH")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5_usize)
        .max(1);
    for kind in ["default", "rr", "pinned", "useNodeIP"] {
        let chosen: Vec<_> = planner
            .cluster()
            .policies
            .iter()
            .filter(|p| allocator_of(p) == kind)
            .step_by(count / 5 / each + 1)
            .take(each)
            .cloned()
            .collect();
        let (mut deleted, mut added, mut staged) = (Vec::new(), Vec::new(), 0);
        for policy in chosen {
            let (removal, addition, _, restaged) = delete_and_add(&mut planner, policy);
            deleted.push(removal);
            added.push(addition);
            staged += restaged;
        }
        if !deleted.is_empty() {
            by_kind.push_str(&format!(
                "; {kind}: {} deleted {} and added back {} ({staged} staged)",
                deleted.len(),
                quantiles(&mut deleted),
                quantiles(&mut added),
            ));
        }
    }
    let [away, back, delete, add] = &mut times;
    println!(
        "{nodes} nodes, {policies} policies, {pods} pods, {kind} {node} ({watched} pods watched), \
         planner: whole {whole:.2?}; {} Pods changed: relabel {}, relabel back {}, \
         delete {}, add {}; {} policy edits: as a cluster {}, as a change {}; \
         {} namespaces relabelled and back {}; \
         {} policies deleted {} and added back {} ({reached} of them planning the node whole, \
         {staged} of the 20 changes running the stages again){by_kind}; \
         {:.0} MiB at the peak",
        changing.len(),
        quantiles(away),
        quantiles(back),
        quantiles(delete),
        quantiles(add),
        edits.len(),
        quantiles(&mut edits),
        quantiles(&mut changes),
        relabels.len() / 2,
        quantiles(&mut relabels),
        deleted.len(),
        quantiles(&mut deleted),
        quantiles(&mut added),
        rss("VmHWM:")
    );
}

/// Deletes `policy` from `planner` and adds it back, each as a change:
/// how long each took, whether either planned the node whole, and how many
/// ran the cluster-wide stages again.
fn delete_and_add(
    planner: &mut egressgw_core::Planner,
    policy: std::sync::Arc<egressgw_core::model::Policy>,
) -> (std::time::Duration, std::time::Duration, bool, usize) {
    let start = Instant::now();
    planner.change_policies([egressgw_core::PolicyChange::Removed(policy.id.clone())]);
    let deleted = start.elapsed();
    let first = planner.last_change();
    let start = Instant::now();
    planner.change_policies([egressgw_core::PolicyChange::Set(policy)]);
    let added = start.elapsed();
    let second = planner.last_change();
    (
        deleted,
        added,
        first.whole || second.whole,
        usize::from(first.staged) + usize::from(second.staged),
    )
}

/// How `policy` takes its EIPs.
fn allocator_of(policy: &egressgw_core::model::Policy) -> &'static str {
    let spec = &policy.egress_ip;
    if spec.use_node_ip {
        "useNodeIP"
    } else if spec.ipv4.is_some() || spec.ipv6.is_some() {
        "pinned"
    } else if spec.allocator == egressgw_core::model::Allocator::RoundRobin {
        "rr"
    } else {
        "default"
    }
}

/// Policy `k` of `planner` as it was before its destination was added
/// (`added`) or taken back.
fn planner_policy_before(
    planner: &egressgw_core::Planner,
    k: usize,
    added: bool,
) -> egressgw_core::model::Policy {
    let mut policy = egressgw_core::model::Policy::clone(&planner.cluster().policies[k]);
    if added {
        policy.dest_subnets.pop();
    } else {
        policy
            .dest_subnets
            .push("192.0.2.0/24".parse().expect("a prefix"));
    }
    policy
}

/// The controller's [`egressgw_core::Publisher`] of the whole cluster,
/// then `changes` selected Pods relabelled out of their policies' reach
/// and back, deleted and added again, each timed, and the status after
/// each; prints the times and the peak memory of the process.
fn publisher_changes((nodes, policies, pods): (usize, usize, usize), changes: usize) {
    let whole = egressgw_benches::synthetic_cluster(nodes, policies, pods);
    // What the controller did for each change before: plan_published.
    let start = Instant::now();
    drop(egressgw_core::plan_published(&whole));
    let published = start.elapsed();
    let start = Instant::now();
    let mut publisher = egressgw_core::Publisher::new(whole);
    let built = start.elapsed();
    let selected: Vec<egressgw_core::model::Pod> = {
        let gateways: Vec<&str> = publisher.gateways().map(|(g, _)| g).collect();
        let all: Vec<&egressgw_core::model::Pod> =
            gateways.iter().flat_map(|g| publisher.pods_of(g)).collect();
        let step = (all.len() / changes.max(1)).max(1);
        all.iter()
            .step_by(step)
            .take(changes)
            .map(|p| (*p).clone())
            .collect()
    };
    publisher.take_changed();
    let mut times: [Vec<std::time::Duration>; 4] = Default::default();
    let mut statuses = Vec::new();
    for pod in &selected {
        four_changes(&mut publisher, pod, &mut times, |p| {
            assert!(!p.take_changed().is_empty(), "a selected Pod changed");
        });
        let start = Instant::now();
        let status = publisher.status();
        statuses.push(start.elapsed());
        drop(status);
    }
    let edits = policy_edits(&mut publisher);
    let [away, back, delete, add] = &mut times;
    println!(
        "{nodes} nodes, {policies} policies, {pods} pods, controller's publisher: \
         plan_published {published:.2?}, whole {built:.2?}; {} Pods changed: relabel {}, relabel back {}, delete {}, add {}; \
         status {}; {edits}; {:.0} MiB at the peak",
        selected.len(),
        quantiles(away),
        quantiles(back),
        quantiles(delete),
        quantiles(add),
        quantiles(&mut statuses),
        rss("VmHWM:")
    );
}

/// Ten namespaced policies of `publisher`, each edited and edited back
/// three ways, each edit timed with the status after it: a destination
/// added (nothing selected otherwise), its Pod selector pointed at no Pod,
/// and a copy of it added under another name, then deleted.
fn policy_edits(publisher: &mut egressgw_core::Publisher) -> String {
    use egressgw_core::model::PodMatch;
    use egressgw_core::selector::LabelSelector;
    let count = publisher.cluster().policies.len();
    let chosen: Vec<usize> = (0..count)
        .step_by((count / 10).max(1))
        .filter(|i| publisher.cluster().policies[*i].id.namespace.is_some())
        .take(10)
        .collect();
    let mut times: [Vec<std::time::Duration>; 3] = Default::default();
    for &k in &chosen {
        let original = publisher.cluster().clone();
        let mut destination = original.clone();
        destination
            .policy_mut(k)
            .expect("a policy")
            .dest_subnets
            .push("192.0.2.0/24".parse().expect("a prefix"));
        let mut selector = original.clone();
        selector.policy_mut(k).expect("a policy").pods =
            PodMatch::Selector(LabelSelector::eq("app", "no-such-app"));
        let mut added = original.clone();
        let mut copy = egressgw_core::model::Policy::clone(&added.policies[k]);
        copy.id.name.push_str("-copy");
        copy.age.uid.push_str("-copy");
        added.policies.push(copy.into());
        for (edited, times) in [destination, selector, added].into_iter().zip(&mut times) {
            for cluster in [edited, original.clone()] {
                let start = Instant::now();
                publisher.set_cluster(cluster);
                drop(publisher.status());
                times.push(start.elapsed());
            }
        }
    }
    let [destination, selector, added] = &mut times;
    format!(
        "{} policy edits with the status after each: a destination {}, the Pod selector {}, \
         a policy added or deleted {}",
        destination.len() + selector.len() + added.len(),
        quantiles(destination),
        quantiles(selector),
        quantiles(added)
    )
}

/// A planner kept between changes: an agent's or the controller's.
trait TakesPods {
    fn set_pod(&mut self, pod: egressgw_core::model::Pod);
    fn remove_pod(&mut self, namespace: &str, name: &str);
}

impl TakesPods for egressgw_core::Planner {
    fn set_pod(&mut self, pod: egressgw_core::model::Pod) {
        egressgw_core::Planner::set_pod(self, pod);
    }
    fn remove_pod(&mut self, namespace: &str, name: &str) {
        egressgw_core::Planner::remove_pod(self, namespace, name);
    }
}

impl TakesPods for egressgw_core::Publisher {
    fn set_pod(&mut self, pod: egressgw_core::model::Pod) {
        egressgw_core::Publisher::set_pod(self, pod);
    }
    fn remove_pod(&mut self, namespace: &str, name: &str) {
        egressgw_core::Publisher::remove_pod(self, namespace, name);
    }
}

/// `pod` relabelled out of its policies' reach, back, deleted and added
/// again in `planner`, each change timed into `times` and followed by
/// `after` (not timed).
fn four_changes<P: TakesPods>(
    planner: &mut P,
    pod: &egressgw_core::model::Pod,
    times: &mut [Vec<std::time::Duration>; 4],
    mut after: impl FnMut(&mut P),
) {
    use egressgw_benches::relabelled;
    let steps: [&dyn Fn(&mut P); 4] = [
        &|p| p.set_pod(relabelled(pod, true)),
        &|p| p.set_pod(relabelled(pod, false)),
        &|p| p.remove_pod(&pod.namespace, &pod.name),
        &|p| p.set_pod(pod.clone()),
    ];
    for (step, times) in steps.iter().zip(times) {
        let start = Instant::now();
        step(planner);
        times.push(start.elapsed());
        after(planner);
    }
}

fn quantiles(times: &mut [std::time::Duration]) -> String {
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    format!("p50 {:.2?} p99 {:.2?}", at(0.5), at(0.99))
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

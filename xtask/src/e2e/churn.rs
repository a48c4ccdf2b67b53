//! 1,000 random steps of object churn, then every node's kernel must be
//! what `egressgw apply` of a dump of the objects makes it: applying that
//! dump on each node changes nothing, and the agents' next reconciles
//! apply nothing either.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use super::metrics::{sample, scrape_agent};
use super::objects::app;
use super::run::{Run, SETTLE, eventually};
use crate::lab::egressgw;

/// Steps per run.
pub const STEPS: usize = 1000;
/// How long the agents must apply nothing to count as settled.
const QUIET: std::time::Duration = std::time::Duration::from_secs(5);
/// The seed of the steps: the same run every time, and a failure can be
/// replayed.
const SEED: u64 = 0x005e_edc4;

const NAMESPACES: [&str; 2] = ["team-a", "team-b"];
const APPS: [&str; 3] = ["web", "other", "batch"];
const DESTS: [&[&str]; 4] = [
    &["198.51.100.0/24"],
    &["198.51.100.0/25"],
    &["203.0.113.0/24"],
    &[],
];
/// Node selectors a churned gateway picks from.
const NODE_SELECTORS: [(&str, &str); 3] = [
    ("egressgw.io/gateway", "true"),
    ("kubernetes.io/hostname", "node-1"),
    ("kubernetes.io/hostname", "node-2"),
];
/// The label churned on the namespaces, which cluster policies select on.
const NS_LABEL: &str = "egressgw.io/churn";

/// One step of churn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Create or replace an object (server-side apply).
    Apply(Value),
    /// Delete an object: kind, namespace, name.
    Delete(&'static str, Option<&'static str>, String),
}

/// A xorshift64 generator: reproducible steps.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        usize::try_from(self.0 % n as u64).expect("below n fits usize")
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }
}

/// `count` steps from `seed` over two gateways (`pools` are their pool
/// entries), four namespaced and two cluster policies, the `pods`
/// ((namespace, name) of the lab's pods) and the two namespaces.
pub fn steps(seed: u64, count: usize, pools: [&str; 2], pods: &[(String, String)]) -> Vec<Step> {
    let mut rng = Rng(seed | 1);
    (0..count)
        .map(|_| match rng.below(20) {
            0..=5 => {
                let ns = rng.pick(&NAMESPACES);
                let k = rng.below(2);
                Step::Apply(policy(&mut rng, ns, k))
            }
            6 | 7 => {
                let ns = rng.pick(&NAMESPACES);
                Step::Delete("egresspolicy", Some(ns), format!("churn-{}", rng.below(2)))
            }
            8..=10 => {
                let k = rng.below(2);
                Step::Apply(cluster_policy(&mut rng, k))
            }
            11 => Step::Delete(
                "egressclusterpolicy",
                None,
                format!("churn-{}", rng.below(2)),
            ),
            12 | 13 => {
                let k = rng.below(2);
                let (key, value) = rng.pick(&NODE_SELECTORS);
                Step::Apply(gateway(k, pools[k], key, value))
            }
            14 => Step::Delete("egressgateway", None, format!("churn-gw-{}", rng.below(2))),
            15..=17 if !pods.is_empty() => {
                let (ns, name) = &pods[rng.below(pods.len())];
                Step::Apply(json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": name,
                        "namespace": ns,
                        "labels": { "app": rng.pick(&APPS) },
                    },
                }))
            }
            _ => {
                let ns = rng.pick(&NAMESPACES);
                let labels = match rng.below(3) {
                    0 => json!({ NS_LABEL: "x" }),
                    1 => json!({ NS_LABEL: "y" }),
                    _ => json!({}),
                };
                Step::Apply(json!({
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": { "name": ns, "labels": labels },
                }))
            }
        })
        .collect()
}

/// The spec of policy `churn-<k>`: its gateway is `churn-gw-<k>`, since a
/// policy's gateway is immutable; the rest is drawn.
fn spec(rng: &mut Rng, k: usize) -> Value {
    json!({
        "egressGatewayName": format!("churn-gw-{k}"),
        "egressIP": { "allocatorPolicy": "default" },
        "appliedTo": app(rng.pick(&APPS)),
        "destSubnet": rng.pick(&DESTS),
        "priority": rng.below(3),
    })
}

fn policy(rng: &mut Rng, namespace: &str, k: usize) -> Value {
    json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressPolicy",
        "metadata": { "name": format!("churn-{k}"), "namespace": namespace },
        "spec": spec(rng, k),
    })
}

fn cluster_policy(rng: &mut Rng, k: usize) -> Value {
    let mut spec = spec(rng, k);
    spec["appliedTo"]["namespaceSelector"] =
        json!({ "matchLabels": { NS_LABEL: rng.pick(&["x", "y"]) } });
    json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressClusterPolicy",
        "metadata": { "name": format!("churn-{k}") },
        "spec": spec,
    })
}

fn gateway(k: usize, pool: &str, key: &str, value: &str) -> Value {
    json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressGateway",
        "metadata": { "name": format!("churn-gw-{k}") },
        "spec": {
            "clusterDefault": false,
            "nodeSelector": { "selector": { "matchLabels": { key: value } } },
            "ippools": { "ipv4": [pool] },
        },
    })
}

/// Sends `steps` in order: runs of applies as one server-side apply each,
/// deletes one by one.
fn send(run: &Run, steps: &[Step]) -> anyhow::Result<()> {
    let mut batch: Vec<&Value> = Vec::new();
    let flush = |batch: &mut Vec<&Value>| -> anyhow::Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let list = json!({ "apiVersion": "v1", "kind": "List", "items": batch });
        run.lab.kubectl.run_with_input(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=e2e-churn",
                "-f",
                "-",
            ],
            Some(&list.to_string()),
        )?;
        batch.clear();
        Ok(())
    };
    for step in steps {
        match step {
            Step::Apply(object) => batch.push(object),
            Step::Delete(kind, ns, name) => {
                flush(&mut batch)?;
                let mut args = vec!["delete", kind, name, "--ignore-not-found", "--wait=false"];
                if let Some(ns) = ns {
                    args.extend(["--namespace", ns]);
                }
                run.lab.kubectl.run(&args)?;
            }
        }
    }
    flush(&mut batch)
}

/// Every object the planner reads, as one multi-document YAML stream
/// (JSON documents), for `egressgw apply -f -`.
fn dump(run: &Run) -> anyhow::Result<String> {
    let text = run.lab.kubectl.run(&[
        "get",
        "nodes,namespaces,pods,egressgateways,egresspolicies,egressclusterpolicies,egresstunnels",
        "--all-namespaces",
        "-o",
        "json",
    ])?;
    let list: Value = serde_json::from_str(&text).context("parsing the dump")?;
    let docs: Vec<String> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(Value::to_string)
        .collect();
    Ok(docs.join("\n---\n"))
}

/// The operations `egressgw apply` of `objects` carried out on `node`,
/// run in its agent's container (its config, datapath and pins).
fn apply_on(run: &Run, node: &str, objects: &str) -> anyhow::Result<Vec<String>> {
    let out = egressgw::exec_in_agent_with_input(
        run.lab,
        node,
        &["apply", "-f", "-", "--node", node, "-o", "json"],
        objects.as_bytes(),
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .with_context(|| {
            format!(
                "egressgw apply on {node} printed no report: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    ensure!(
        out.status.success(),
        "egressgw apply on {node} failed: {report}"
    );
    Ok(report["applied"]
        .as_array()
        .into_iter()
        .flatten()
        .map(Value::to_string)
        .collect())
}

/// The sum of `egressgw_reconcile_operations_total{result="applied"}` and
/// the count of successful reconciles of `node`'s agent.
fn reconciles(run: &Run, node: &str) -> anyhow::Result<(f64, f64)> {
    let text = scrape_agent(run.lab, node)?;
    let applied = text
        .lines()
        .filter(|l| {
            l.starts_with("egressgw_reconcile_operations_total{")
                && l.contains("result=\"applied\"")
        })
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .sum();
    let ok = sample(&text, "egressgw_reconciles_total{result=\"ok\"}").unwrap_or_default();
    Ok((applied, ok))
}

/// 1,000 seeded random steps of churn (policies and cluster policies
/// created, changed and deleted; gateways created, moved between nodes and
/// deleted; the lab's pods and the two namespaces relabelled), sent as fast
/// as the API server takes them. Once the agents have settled, `egressgw
/// apply` of a dump of every object changes nothing on any node, and each
/// agent's next reconcile applies nothing.
pub fn churn_ends_with_every_node_as_planned(run: &mut Run) -> anyhow::Result<()> {
    let pool = &run.pool;
    let pools = [format!("{}-{}", pool[0], pool[1]), pool[2].to_string()];
    let pods: Vec<(String, String)> = run
        .lab
        .state
        .topology
        .pods
        .iter()
        .filter(|p| NAMESPACES.contains(&p.namespace.as_str()))
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .collect();
    // Put back afterwards: the pods' labels and the namespaces' churn label.
    let labels_before: BTreeMap<(String, String), Value> = pods
        .iter()
        .map(|(ns, name)| {
            let pod = run.get("pod", Some(ns), name)?;
            Ok((
                (ns.clone(), name.clone()),
                pod["metadata"]["labels"].clone(),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    for name in ["churn-0", "churn-1"] {
        for ns in NAMESPACES {
            run.delete_on_cleanup("egresspolicy", Some(ns), name);
        }
        run.delete_on_cleanup("egressclusterpolicy", None, name);
    }
    for k in 0..2 {
        run.delete_on_cleanup("egressgateway", None, &format!("churn-gw-{k}"));
    }
    let steps = steps(SEED, STEPS, [&pools[0], &pools[1]], &pods);
    let started = Instant::now();
    let sent = send(run, &steps);
    let took = started.elapsed();
    let checked = sent.and_then(|()| settled_as_planned(run));
    let restored = restore(run, &labels_before);
    checked?;
    restored?;
    run.note(format!(
        "{STEPS} steps sent in {:.1} s; every node as `egressgw apply` of the dump plans it, \
         and its next reconcile applied nothing",
        took.as_secs_f64()
    ));
    Ok(())
}

/// Waits until the agents are quiet (each has reconciled since the churn
/// ended, and none applied an operation for [`QUIET`]); then `egressgw
/// apply` of a dump must change nothing on any node, and each agent's next
/// reconcile must apply nothing. (`apply` changes the kernel when it finds
/// a difference: it runs once, after the agents settled, so that a second
/// run cannot pass on what the first one changed.)
fn settled_as_planned(run: &Run) -> anyhow::Result<()> {
    let nodes = run.nodes();
    let all = |run: &Run| -> Result<Vec<(f64, f64)>, String> {
        nodes
            .iter()
            .map(|node| reconciles(run, node))
            .collect::<anyhow::Result<_>>()
            .map_err(|e| format!("{e:#}"))
    };
    let ended = all(run).map_err(anyhow::Error::msg)?;
    eventually("the agents to settle", SETTLE * 2, || {
        let first = all(run)?;
        std::thread::sleep(QUIET);
        let second = all(run)?;
        let busy: Vec<String> = nodes
            .iter()
            .zip(ended.iter().zip(first.iter().zip(&second)))
            .filter(|(_, (end, (a, b)))| b.1 <= end.1 || a.0 != b.0)
            .map(|(node, (_, (a, b)))| format!("{node} ({} ops applied)", b.0 - a.0))
            .collect();
        if busy.is_empty() {
            Ok(())
        } else {
            Err(format!("still reconciling: {}", busy.join(", ")))
        }
    })?;
    let objects = dump(run)?;
    let mut changed = Vec::new();
    for node in &nodes {
        let applied = apply_on(run, node, &objects)?;
        if !applied.is_empty() {
            changed.push(format!("{node}: {}", applied.join(", ")));
        }
    }
    ensure!(
        changed.is_empty(),
        "the agents settled, yet `egressgw apply` of a dump of the objects changed {}",
        changed.join("; ")
    );
    let before = all(run).map_err(anyhow::Error::msg)?;
    // A change nothing plans from wakes every agent at once rather than at
    // its next resync (30 s).
    run.lab.kubectl.run(&[
        "annotate",
        "namespace",
        "default",
        "--overwrite",
        &format!("egressgw.io/churn-check={}", before.len()),
    ])?;
    let after = eventually("every agent to reconcile again", SETTLE * 2, || {
        let now = all(run)?;
        let waiting: Vec<&String> = nodes
            .iter()
            .zip(before.iter().zip(&now))
            .filter(|(_, ((_, ok), (_, now_ok)))| now_ok <= ok)
            .map(|(node, _)| node)
            .collect();
        if waiting.is_empty() {
            Ok(now)
        } else {
            Err(format!("no new successful reconcile on {waiting:?}"))
        }
    })?;
    for (node, ((applied, _), (now_applied, _))) in nodes.iter().zip(before.iter().zip(&after)) {
        ensure!(
            now_applied == applied,
            "{node}'s agent applied {} operation(s) in a reconcile after the dump matched",
            now_applied - applied
        );
    }
    Ok(())
}

/// Deletes the churned objects and puts the pods' and namespaces' labels
/// back as they were.
fn restore(run: &Run, labels_before: &BTreeMap<(String, String), Value>) -> anyhow::Result<()> {
    let mut steps = Vec::new();
    for name in ["churn-0", "churn-1"] {
        for ns in NAMESPACES {
            steps.push(Step::Delete("egresspolicy", Some(ns), name.to_owned()));
        }
        steps.push(Step::Delete("egressclusterpolicy", None, name.to_owned()));
    }
    for k in 0..2 {
        steps.push(Step::Delete("egressgateway", None, format!("churn-gw-{k}")));
    }
    send(run, &steps)?;
    for ((ns, name), labels) in labels_before {
        let patch = json!({ "metadata": { "labels": labels } });
        run.lab.kubectl.run(&[
            "patch",
            "pod",
            name,
            "--namespace",
            ns,
            "--type",
            "merge",
            "-p",
            &patch.to_string(),
        ])?;
    }
    for ns in NAMESPACES {
        run.lab
            .kubectl
            .run(&["label", "namespace", ns, &format!("{NS_LABEL}-")])?;
    }
    // Absent when the check did not get that far.
    let _ = run.lab.kubectl.run(&[
        "annotate",
        "namespace",
        "default",
        "egressgw.io/churn-check-",
    ]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steps_are_the_same_for_a_seed_and_cover_every_kind() {
        let pods = vec![("team-a".to_owned(), "web-1".to_owned())];
        let a = steps(
            7,
            1000,
            ["198.51.100.100-198.51.100.101", "198.51.100.102"],
            &pods,
        );
        let b = steps(
            7,
            1000,
            ["198.51.100.100-198.51.100.101", "198.51.100.102"],
            &pods,
        );
        assert_eq!(a, b);
        let kinds: std::collections::BTreeSet<String> = a
            .iter()
            .map(|s| match s {
                Step::Apply(o) => format!("apply {}", o["kind"].as_str().unwrap()),
                Step::Delete(kind, ..) => format!("delete {kind}"),
            })
            .collect();
        for kind in [
            "apply EgressPolicy",
            "apply EgressClusterPolicy",
            "apply EgressGateway",
            "apply Pod",
            "apply Namespace",
            "delete egresspolicy",
            "delete egressclusterpolicy",
            "delete egressgateway",
        ] {
            assert!(kinds.contains(kind), "no {kind} in {kinds:?}");
        }
    }
}

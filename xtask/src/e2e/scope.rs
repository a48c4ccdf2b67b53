//! What each agent watches: the Pods on its node, and every Pod only while
//! some EgressGateway selects the node.

use anyhow::{Context, ensure};
use serde_json::Value;

use super::metrics::{sample, scrape_agent};
use super::objects::{app, gateway, policy};
use super::run::{PolicyStatus, Run, SETTLE, eventually};
use super::scenarios::TEAM_A;
use super::traffic::Expect;

const GATEWAY: &str = "e2e-scope";
const TARGET_NET: &str = "198.51.100.0/24";

/// The gateway of this scenario, on `node` alone.
fn gateway_on(run: &Run, node: &str) -> Value {
    let eip = run.pool[0];
    let mut object = gateway(GATEWAY, &run.pool_range(), eip);
    object["spec"]["nodeSelector"]["selector"]["matchLabels"] =
        serde_json::json!({ "kubernetes.io/hostname": node });
    object
}

/// How many Pods the API server has: on `node`, or in the whole cluster.
fn pods_in_api(run: &Run, node: Option<&str>) -> anyhow::Result<usize> {
    let selector = node.map(|n| format!("spec.nodeName={n}"));
    let mut args = vec!["get", "pods", "--all-namespaces", "-o", "name"];
    if let Some(selector) = &selector {
        args.extend(["--field-selector", selector]);
    }
    let text = run.lab.kubectl.run(&args)?;
    Ok(text.lines().filter(|l| !l.trim().is_empty()).count())
}

/// Waits until `node`'s agent plans from the Pods of `scope` and no other,
/// and until it counts as many as the API server has there.
fn wait_scope(run: &Run, node: &str, scope: &str) -> anyhow::Result<usize> {
    let other = if scope == "node" { "cluster" } else { "node" };
    eventually(
        &format!("{node}'s agent to watch the pods of scope {scope}"),
        SETTLE,
        || {
            let text = scrape_agent(run.lab, node).map_err(|e| format!("{e:#}"))?;
            let series = |s: &str| format!("egressgw_watched_pods{{scope=\"{s}\"}}");
            let watched = sample(&text, &series(scope));
            let elsewhere = sample(&text, &series(other));
            let expected = pods_in_api(run, (scope == "node").then_some(node))
                .map_err(|e| format!("{e:#}"))?;
            match (watched, elsewhere) {
                (Some(n), Some(o)) if n as usize == expected && o == 0.0 => Ok(expected),
                _ => Err(format!(
                    "{} = {watched:?}, {} = {elsewhere:?}; the API server has {expected}",
                    series(scope),
                    series(other)
                )),
            }
        },
    )
}

/// A gateway on one gateway node: only that node's agent watches every Pod,
/// the others watch their own. Moved to the other gateway node, whose agent
/// planned from its own Pods until then, it watches every Pod, and the Pods
/// of all three nodes leave through it with the EIP.
pub fn only_nodes_a_gateway_selects_watch_every_pod(run: &mut Run) -> anyhow::Result<()> {
    let nodes = run.nodes();
    let (first, second) = run.two_gateway_nodes()?;
    let (first, second) = (&first, &second);
    let eip = run.pool[0];

    // No gateway of this run selects a node yet: every agent its own Pods.
    for node in &nodes {
        wait_scope(run, node, "node").context("before any gateway")?;
    }

    run.apply(&gateway_on(run, first))?;
    run.apply(&policy(TEAM_A, "web", GATEWAY, &app("web"), &[TARGET_NET]))?;
    let status = run.wait_policy_ready("egresspolicy", Some(TEAM_A), "web")?;
    ensure!(
        status.node.as_deref() == Some(first.as_str()),
        "the gateway selects {first} alone, yet the policy's status says {status}"
    );
    let everyone = wait_scope(run, first, "cluster")?;
    let mut watched = Vec::new();
    for node in nodes.iter().filter(|n| *n != first) {
        let own = wait_scope(run, node, "node")?;
        watched.push(format!("{node} {own}"));
    }
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))?;

    // The gateway moves to the other node.
    run.apply(&gateway_on(run, second))?;
    eventually("the policy to move to the other node", SETTLE, || {
        let status = run
            .get("egresspolicy", Some(TEAM_A), "web")
            .map(|o| PolicyStatus::of(&o))
            .map_err(|e| format!("{e:#}"))?;
        if status.node.as_deref() == Some(second.as_str()) {
            Ok(())
        } else {
            Err(format!("status: {status}"))
        }
    })?;
    wait_scope(run, second, "cluster").context("once the gateway selects it")?;
    wait_scope(run, first, "node").context("once no gateway selects it")?;
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))
        .context("through the node that watched its own pods until the gateway moved")?;
    run.note(format!(
        "pods watched: {first} (gateway) {everyone}, {}; moved to {second}, which then \
         watched {everyone} and carried web-1..3 with {eip}",
        watched.join(", ")
    ));
    Ok(())
}

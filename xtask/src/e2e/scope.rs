//! What each agent watches: the Pods on its node and, while some
//! EgressGateway selects the node, the Pods the controller publishes for
//! that gateway, not every Pod.

use anyhow::{Context, ensure};
use serde_json::Value;

use crate::lab::egressgw::NAMESPACE;

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

/// How many Pods the API server has on `node`.
fn pods_on(run: &Run, node: &str) -> anyhow::Result<usize> {
    let selector = format!("spec.nodeName={node}");
    let args = [
        "get",
        "pods",
        "--all-namespaces",
        "-o",
        "name",
        "--field-selector",
        &selector,
    ];
    let text = run.lab.kubectl.run(&args)?;
    Ok(text.lines().filter(|l| !l.trim().is_empty()).count())
}

/// The names of team-a's web Pods (the scenario's policy selects them),
/// but those on `except`: of a gateway node, those whose traffic it
/// carries from other nodes.
fn web_pods(run: &Run, except: Option<&str>) -> anyhow::Result<Vec<String>> {
    let text = run
        .lab
        .kubectl
        .run(&["get", "pods", "-n", TEAM_A, "-l", "app=web", "-o", "json"])?;
    let list: Value = serde_json::from_str(&text).context("parsing the web pods")?;
    let mut names: Vec<String> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| except.is_none() || p["spec"]["nodeName"].as_str() != except)
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}

/// The Pods the controller publishes for the scenario's gateway, by name.
fn published(run: &Run) -> anyhow::Result<Vec<String>> {
    let selector = format!("egressgw.io/gateway={GATEWAY}");
    let text = run.lab.kubectl.run(&[
        "get",
        "egressendpointslices",
        "-n",
        NAMESPACE,
        "-l",
        &selector,
        "-o",
        "json",
    ])?;
    let list: Value = serde_json::from_str(&text).context("parsing the slices")?;
    let mut names: Vec<String> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["spec"]["pods"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}

/// Waits until `node`'s agent plans from the Pods of `scope` and no other,
/// as many as it should: its own Pods, and with `gateways` the web Pods of
/// other nodes too.
fn wait_scope(run: &Run, node: &str, scope: &str) -> anyhow::Result<usize> {
    let others: Vec<&str> = ["node", "gateways", "cluster"]
        .into_iter()
        .filter(|s| *s != scope)
        .collect();
    eventually(
        &format!("{node}'s agent to watch the pods of scope {scope}"),
        SETTLE,
        || {
            let text = scrape_agent(run.lab, node).map_err(|e| format!("{e:#}"))?;
            let series = |s: &str| format!("egressgw_watched_pods{{scope=\"{s}\"}}");
            let watched = sample(&text, &series(scope));
            let elsewhere: Vec<Option<f64>> =
                others.iter().map(|s| sample(&text, &series(s))).collect();
            let mut expected = pods_on(run, node).map_err(|e| format!("{e:#}"))?;
            if scope == "gateways" {
                expected += web_pods(run, Some(node))
                    .map_err(|e| format!("{e:#}"))?
                    .len();
            }
            match watched {
                Some(n) if n as usize == expected && elsewhere.iter().all(|o| *o == Some(0.0)) => {
                    Ok(expected)
                }
                _ => Err(format!(
                    "{} = {watched:?}, the others ({others:?}) = {elsewhere:?}; it should be {expected}",
                    series(scope),
                )),
            }
        },
    )
}

/// A gateway on one gateway node: only that node's agent watches more
/// than its own Pods, and only the Pods its gateway's policy selects, as
/// the controller publishes them (not every Pod). Moved to the other
/// gateway node, whose agent planned from its own Pods until then, the
/// gateway's Pods are watched there, and the Pods of all three nodes leave
/// through it with the EIP.
pub fn only_nodes_a_gateway_selects_watch_its_pods(run: &mut Run) -> anyhow::Result<()> {
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
    let webs = web_pods(run, None)?;
    eventually("the controller to publish the web pods", SETTLE, || {
        let names = published(run).map_err(|e| format!("{e:#}"))?;
        let pods = run
            .get("egressgateway", None, GATEWAY)
            .map_err(|e| format!("{e:#}"))?["status"]["pods"]
            .clone();
        if names == webs && pods["selected"].as_u64() == Some(webs.len() as u64) {
            Ok(())
        } else {
            Err(format!(
                "published {names:?}, status.pods {pods}; web pods {webs:?}"
            ))
        }
    })?;
    let carried = wait_scope(run, first, "gateways")?;
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
    let moved = wait_scope(run, second, "gateways").context("once the gateway selects it")?;
    wait_scope(run, first, "node").context("once no gateway selects it")?;
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))
        .context("through the node that watched its own pods until the gateway moved")?;
    run.note(format!(
        "published {}; pods watched: {first} (gateway) {carried}, {}; moved to {second}, \
         which then watched {moved} and carried web-1..3 with {eip}",
        webs.join(" "),
        watched.join(", ")
    ));
    Ok(())
}

//! The scenarios of the install itself: the chart's checks, an upgrade that
//! changes a `feature` value under traffic, what the agent's own token may
//! not do, and an uninstall that leaves every node as it was.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

use super::run::{Run, SETTLE, eventually};
use super::snapshot;
use super::traffic::{Expect, Prober, Sample, Seen};
use crate::lab::egressgw::NAMESPACE;
use crate::lab::helm::{Helm, RELEASE};
use crate::lab::kubectl::Kubectl;
use crate::lab::session::Lab;

/// The agents' DaemonSet and ServiceAccount, as the chart names them for
/// the lab's release.
const AGENT: &str = "egressgw-agent";
/// The controller Deployment, as the chart names it for the lab's release.
const CONTROLLER: &str = "egressgw-controller";
/// Label selector of the agent pods.
const AGENT_PODS: &str = "app.kubernetes.io/component=agent";
/// The namespace of an install that must be refused.
const REFUSED_NAMESPACE: &str = "egressgw-refused";
/// How long a rollout of the agents may take.
const ROLLOUT: &str = "180s";

/// Where the node snapshots taken before the install are kept.
pub fn before_install_dir(lab: &Lab) -> PathBuf {
    lab.paths.egressgw().join("before-install")
}

/// Records every node's kernel state: called before the install.
pub fn snapshot_nodes(lab: &Lab) -> anyhow::Result<()> {
    let dir = before_install_dir(lab);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for node in &lab.state.topology.nodes {
        let lines = snapshot::take(&node.netns)?;
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        let path = dir.join(format!("{}.txt", node.name));
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The snapshots [`snapshot_nodes`] took, in the order of the lab's nodes.
/// The datapath the release's agents should run: what `feature.datapath`
/// says, and for `auto` eBPF, which every lab node can run.
pub fn expected_datapath(lab: &Lab) -> anyhow::Result<String> {
    Ok(datapath_of(&asked_datapath(lab)?).to_owned())
}

/// The release's `feature.datapath`.
fn asked_datapath(lab: &Lab) -> anyhow::Result<String> {
    let values = Helm::for_lab(lab).run(&[
        "get", "values", RELEASE, "-n", NAMESPACE, "-a", "-o", "json",
    ])?;
    let values: Value = serde_json::from_str(&values).context("parsing the release's values")?;
    Ok(values["feature"]["datapath"]
        .as_str()
        .unwrap_or("auto")
        .to_owned())
}

/// The datapath lab agents run for a `feature.datapath` value.
fn datapath_of(asked: &str) -> &'static str {
    if asked == "nftables" {
        "nftables"
    } else {
        "ebpf"
    }
}

fn before_install(lab: &Lab) -> anyhow::Result<Vec<BTreeSet<String>>> {
    let dir = before_install_dir(lab);
    lab.state
        .topology
        .nodes
        .iter()
        .map(|node| {
            let path = dir.join(format!("{}.txt", node.name));
            let text = fs::read_to_string(&path).with_context(|| {
                format!("reading {} (taken before the install)", path.display())
            })?;
            Ok(text.lines().map(str::to_owned).collect())
        })
        .collect()
}

/// `helm lint --strict` is clean, the rendered chart (with the optional
/// dashboard) passes the API server's own validation (`--dry-run=server`),
/// and values the schema
/// refuses fail an upgrade naming the key, leaving the release and its
/// pods as they were.
pub fn chart_is_lint_clean_and_bad_values_change_nothing(run: &mut Run) -> anyhow::Result<()> {
    let helm = Helm::for_lab(run.lab);
    let chart = Helm::chart().display().to_string();
    helm.run(&["lint", "--strict", &chart])
        .context("helm lint --strict")?;
    let version = run
        .lab
        .state
        .kubernetes_version
        .trim_start_matches('v')
        .to_owned();
    let rendered = helm.run(&[
        "template",
        RELEASE,
        &chart,
        "-n",
        NAMESPACE,
        "--include-crds",
        "--kube-version",
        &version,
        // The optional objects the lab has the API of: the dashboard's
        // ConfigMap (the Prometheus Operator's CRDs are not installed).
        "--set",
        "metrics.dashboard.enabled=true",
    ])?;
    let accepted = run
        .lab
        .kubectl
        .run_with_input(&["apply", "--dry-run=server", "-f", "-"], Some(&rendered))
        .context("kubectl apply --dry-run=server of helm template's output")?;
    let objects = accepted.lines().count();
    ensure!(objects > 10, "the API server accepted only: {accepted}");

    let revision = helm.revision(RELEASE, NAMESPACE)?;
    let pods = agent_pods(&run.lab.kubectl)?;
    let bad = [
        ("feature.vxlan.id=-1", "/feature/vxlan/id"),
        ("feature.vxlan.port=abc", "/feature/vxlan/port"),
        ("feature.vxlna.id=3", "vxlna"),
        ("agent.leaseDuration=0", "/agent/leaseDuration"),
    ];
    for (set, named) in bad {
        let out = try_upgrade(&helm, &[set])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "helm upgrade --set {set} succeeded");
        ensure!(
            stderr.contains(named),
            "helm upgrade --set {set} failed without naming {named}: {stderr}"
        );
    }
    // A fresh install with a bad value creates nothing, not even the
    // namespace it was asked to create.
    let out = helm.output(&[
        "install",
        "egressgw-refused",
        &chart,
        "-n",
        REFUSED_NAMESPACE,
        "--create-namespace",
        "--set",
        "feature.vxlan.port=abc",
    ])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.contains("/feature/vxlan/port"),
        "helm install --set feature.vxlan.port=abc: {stderr}"
    );
    let namespace = run
        .lab
        .kubectl
        .output(&["get", "namespace", REFUSED_NAMESPACE], None)?;
    ensure!(
        !namespace.status.success(),
        "the refused install created the namespace {REFUSED_NAMESPACE}"
    );
    let releases = helm.run(&["list", "-A", "-q"])?;
    ensure!(
        releases.split_whitespace().eq([RELEASE]),
        "releases after a refused install: {releases}"
    );
    ensure!(
        helm.revision(RELEASE, NAMESPACE)? == revision,
        "a refused upgrade made a new revision"
    );
    ensure!(
        agent_pods(&run.lab.kubectl)? == pods,
        "a refused upgrade replaced agent pods"
    );
    run.note(format!(
        "helm lint --strict clean; {objects} rendered objects accepted by the API server \
         (dry run); {} bad values refused naming the key, revision {revision} and the agent \
         pods unchanged; a fresh install with a bad value created nothing",
        bad.len()
    ));
    Ok(())
}

/// The agent's ServiceAccount is refused, by the real API server, what it
/// must not do: RBAC for policies, gateways and Secrets; the node
/// restriction for another node's Lease and tunnel status, and for a token
/// bound to no Pod.
pub fn agent_token_may_write_only_its_own_nodes_objects(run: &mut Run) -> anyhow::Result<()> {
    let kubectl = run.lab.kubectl.clone();
    let user = format!("system:serviceaccount:{NAMESPACE}:{AGENT}");
    let forbidden = [
        ["create", "egresspolicies.egressgw.io", "-n", "default"],
        ["delete", "egresspolicies.egressgw.io", "-n", "default"],
        ["update", "egressgateways.egressgw.io", "-n", "default"],
        [
            "delete",
            "egressclusterpolicies.egressgw.io",
            "-n",
            "default",
        ],
        ["get", "secrets", "-n", NAMESPACE],
        ["list", "secrets", "-n", "default"],
        ["delete", "leases.coordination.k8s.io", "-n", NAMESPACE],
        ["create", "leases.coordination.k8s.io", "-n", "default"],
    ];
    for check in &forbidden {
        let mut args = vec!["auth", "can-i", "--as", &user];
        args.extend_from_slice(check);
        let out = kubectl.output(&args, None)?;
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        ensure!(
            answer == "no",
            "kubectl auth can-i {} as the agent: {answer:?}",
            check.join(" ")
        );
    }

    let pods = agent_pods(&kubectl)?;
    let ((node, (pod, uid)), other) = match (pods.iter().next(), pods.keys().nth(1)) {
        (Some(first), Some(other)) => (first, other.clone()),
        _ => bail!("need two agent pods, found {pods:?}"),
    };
    let bound = Caller::new(run.lab, Some((pod, uid)))?;
    let unbound = Caller::new(run.lab, None)?;

    // The writes the agent makes, as JSON patches that change nothing: the
    // API server authorizes and admits them like any other write.
    let lease = |name: &str| {
        format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/egressgw-agent-{name}")
    };
    let tunnel_status =
        |name: &str| format!("/apis/egressgw.io/v1alpha1/egresstunnels/{name}/status");
    bound.expect("PATCH", &lease(node), 200, "")?;
    bound.expect("PATCH", &tunnel_status(node), 200, "")?;
    bound.expect("PATCH", &lease(&other), 403, "may write only the Lease")?;
    bound.expect(
        "PATCH",
        &tunnel_status(&other),
        403,
        "may write only the status of EgressTunnel",
    )?;
    bound.expect(
        "GET",
        &format!("/api/v1/namespaces/{NAMESPACE}/secrets"),
        403,
        "cannot list resource",
    )?;
    bound.expect(
        "POST",
        "/apis/egressgw.io/v1alpha1/namespaces/default/egresspolicies",
        403,
        "cannot create resource",
    )?;
    bound.expect(
        "DELETE",
        "/apis/egressgw.io/v1alpha1/egressgateways/any",
        403,
        "cannot delete resource",
    )?;
    unbound.expect("PATCH", &lease(node), 403, "not bound to a Pod")?;
    run.note(format!(
        "{} can-i checks say no; with a token bound to the agent pod on {node}: its own Lease \
         and tunnel status writable, {other}'s refused by the node restriction, Secrets, \
         policy creation and gateway deletion refused by RBAC; an unbound token of the same \
         account refused its own node's Lease",
        forbidden.len()
    ));
    Ok(())
}

/// `helm upgrade --set feature.vxlan.disableChecksumOffload=true` with
/// `feature.datapath` switched to the other datapath rolls the agents,
/// turns tx checksumming off on every node's `egress.vxlan` and puts every
/// node on that datapath; a second upgrade puts both back. Whenever the
/// nodes run nftables, no eBPF state is left pinned on any of them (the
/// classifier an eBPF agent pinned would go on classifying and translating
/// with maps nobody keeps). Traffic never leaves with another source
/// meanwhile.
pub fn upgrades_toggle_checksum_offload_and_the_datapath_and_traffic_keeps_the_eip(
    run: &mut Run,
) -> anyhow::Result<()> {
    let asked = asked_datapath(run.lab)?;
    let other = if datapath_of(&asked) == "nftables" {
        "ebpf"
    } else {
        "nftables"
    };
    let eip = super::scenarios::setup_gateway(run, "e2e-upgrade")?;
    super::scenarios::setup_web_policy(run, "e2e-upgrade")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let helm = Helm::for_lab(run.lab);
    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(240),
    );
    let begun = Instant::now();
    let steps = match toggle_both_ways(run, &helm, other, &asked) {
        Ok(steps) => steps,
        Err(e) => {
            // The scenarios after this one run on the values asked for.
            drop(prober);
            let back = agent_pods(&run.lab.kubectl).and_then(|before| {
                upgrade(
                    &helm,
                    &[
                        "feature.vxlan.disableChecksumOffload=false",
                        &format!("feature.datapath={asked}"),
                    ],
                )?;
                wait_rollout(run.lab, &before)
            });
            return Err(match back {
                Ok(()) => e,
                Err(back) => e.context(format!("putting the values back failed too: {back:#}")),
            });
        }
    };
    let samples = prober.finish();
    let wrong: Vec<&Seen> = samples
        .iter()
        .map(|s| &s.seen)
        .filter(|seen| matches!(seen, Seen::Source(ip) if *ip != eip))
        .collect();
    ensure!(
        wrong.is_empty(),
        "during the upgrades web-3 was seen with another source: {wrong:?}"
    );
    let unanswered = unanswered(&samples, eip);
    // Changing a live device's features can drop a packet in flight; a
    // SYN lost then is sent again after 1 s, past a probe's timeout. The
    // path must work once the last change is made, and then stay working.
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)?;
    for step in steps {
        run.note(step);
    }
    run.note(format!(
        "web-3 probed every 100 ms for {:.0} s through both upgrades: {} answers, all from \
         {eip}; {unanswered} unanswered (the longest gap {:.1} s)",
        begun.elapsed().as_secs_f64(),
        samples.len() - unanswered,
        longest_gap(&samples, eip).as_secs_f64()
    ));
    Ok(())
}

/// The two upgrades of
/// [`upgrades_toggle_checksum_offload_and_the_datapath_and_traffic_keeps_the_eip`]:
/// offload off and the `other` datapath, then both back (`asked`); what
/// each took.
fn toggle_both_ways(
    run: &mut Run,
    helm: &Helm,
    other: &str,
    asked: &str,
) -> anyhow::Result<Vec<String>> {
    let mut steps = Vec::new();
    for (disable, want, datapath) in [(true, "off", other), (false, "on", asked)] {
        let before = agent_pods(&run.lab.kubectl)?;
        let started = Instant::now();
        upgrade(
            helm,
            &[
                &format!("feature.vxlan.disableChecksumOffload={disable}"),
                &format!("feature.datapath={datapath}"),
            ],
        )?;
        wait_rollout(run.lab, &before)?;
        let nodes: Vec<_> = run.lab.state.topology.nodes.clone();
        let running = datapath_of(datapath);
        for node in &nodes {
            eventually(
                &format!("{} on the {running} datapath", node.name),
                SETTLE,
                || {
                    let tunnel = run
                        .get("egresstunnel", None, &node.name)
                        .map_err(|e| format!("{e:#}"))?;
                    let seen = tunnel["status"]["datapath"]["name"].as_str().unwrap_or("-");
                    let pins =
                        crate::lab::kubelet::node_bpf_path(&run.lab.paths, &node.name, "egressgw");
                    if seen != running {
                        Err(format!("its EgressTunnel reports the {seen} datapath"))
                    } else if (running == "ebpf") != pins.exists() {
                        Err(format!(
                            "{} {}",
                            pins.display(),
                            if pins.exists() {
                                "is left"
                            } else {
                                "is missing"
                            }
                        ))
                    } else {
                        Ok(())
                    }
                },
            )?;
        }
        for node in &nodes {
            eventually(
                &format!("tx-checksumming: {want} on {}'s egress.vxlan", node.name),
                SETTLE,
                || {
                    let state = tx_checksumming(&node.netns).map_err(|e| format!("{e:#}"))?;
                    if state == want {
                        Ok(())
                    } else {
                        Err(format!("tx-checksumming: {state}"))
                    }
                },
            )?;
        }
        steps.push(format!(
            "disableChecksumOffload={disable}, datapath={datapath}: agents rolled, \
             tx-checksumming {want} and the {running} datapath on {} nodes, eBPF pins {} \
             in {:.1} s",
            nodes.len(),
            if running == "ebpf" {
                "in place"
            } else {
                "gone"
            },
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(steps)
}

/// `kubectl rollout restart` of the agents, as an upgrade without a config
/// change restarts them: each stopping agent renews its Lease for its
/// restart grace, so no EIP moves and web-3's traffic through the gateway
/// is not interrupted.
pub fn agent_restarts_move_no_eip_and_lose_no_traffic(run: &mut Run) -> anyhow::Result<()> {
    let eip = super::scenarios::setup_gateway(run, "e2e-restart")?;
    let status = super::scenarios::setup_web_policy(run, "e2e-restart")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(120),
    );
    let before = agent_pods(&run.lab.kubectl)?;
    let started = Instant::now();
    run.lab.kubectl.run(&[
        "rollout",
        "restart",
        &format!("daemonset/{AGENT}"),
        "-n",
        NAMESPACE,
    ])?;
    wait_rollout(run.lab, &before)?;
    let rolled = started.elapsed();
    let samples = prober.finish();
    let unanswered = unanswered(&samples, eip);
    let after = super::run::PolicyStatus::of(&run.get("egresspolicy", Some("team-a"), "web")?);
    ensure!(
        after.node == status.node,
        "the EIP moved during the restarts: {:?} -> {:?}",
        status.node,
        after.node
    );
    // A few probes may time out on a loaded machine; an EIP that moves
    // costs seconds of them.
    ensure!(
        unanswered * 20 <= samples.len(),
        "{unanswered} of {} probes unanswered while the agents restarted (the longest gap \
         {:.1} s): more than 5 %",
        samples.len(),
        longest_gap(&samples, eip).as_secs_f64()
    );
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)?;
    run.note(format!(
        "3 agents restarted one by one in {:.1} s; the EIP stayed on {}; web-3 probed every \
         100 ms: {} answers from {eip}, {unanswered} unanswered",
        rolled.as_secs_f64(),
        status.node.as_deref().unwrap_or("?"),
        samples.len() - unanswered
    ));
    Ok(())
}

/// Probes that did not see `eip`.
fn unanswered(samples: &[Sample], eip: std::net::Ipv4Addr) -> usize {
    samples
        .iter()
        .filter(|s| !s.seen.is(&Expect::Source(eip.into())))
        .count()
}

/// The longest time between two probes that saw `eip`.
fn longest_gap(samples: &[Sample], eip: std::net::Ipv4Addr) -> Duration {
    let answered: Vec<Instant> = samples
        .iter()
        .filter(|s| s.seen.is(&Expect::Source(eip.into())))
        .map(|s| s.at)
        .collect();
    answered
        .windows(2)
        .map(|w| w[1].saturating_duration_since(w[0]))
        .max()
        .unwrap_or_default()
}

/// `helm uninstall` and deleting the CRDs leave every node's kernel state
/// exactly as it was before the install: no device, address, rule, route,
/// neighbour, FDB entry, nftables table or sysctl of egressgw's is left.
/// Runs last: egressgw is gone afterwards.
pub fn helm_uninstall_leaves_every_node_as_it_was(run: &mut Run) -> anyhow::Result<()> {
    let eip = super::scenarios::setup_gateway(run, "e2e-uninstall")?;
    super::scenarios::setup_web_policy(run, "e2e-uninstall")?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))?;
    // The objects go with their CRDs below.
    run.forget_objects();
    let started = Instant::now();
    uninstall(run.lab)?;
    let gone = started.elapsed();
    // A deleted pod's network namespace and its veth on the node go a
    // moment after the pod: the nodes must come to equal their snapshots.
    let before = before_install(run.lab)?;
    let nodes = run.lab.state.topology.nodes.clone();
    eventually("every node to be as before the install", SETTLE, || {
        let mut differences = Vec::new();
        for (node, before) in nodes.iter().zip(&before) {
            let after = snapshot::take(&node.netns).map_err(|e| format!("{e:#}"))?;
            let diff = snapshot::diff(before, &after);
            if !diff.is_empty() {
                differences.push(format!("{}:\n{diff}", node.name));
            }
        }
        if differences.is_empty() {
            Ok(())
        } else {
            Err(format!("the nodes differ:\n{}", differences.join("\n")))
        }
    })?;
    // Nor any eBPF state: no pinned map or attachment in the nodes' bpf
    // filesystems (an attachment nothing pins ended with its agent).
    for node in &nodes {
        let pins = crate::lab::kubelet::node_bpf_path(&run.lab.paths, &node.name, "egressgw");
        ensure!(
            !pins.exists(),
            "{}: {} is left after the uninstall",
            node.name,
            pins.display()
        );
    }
    // The removal may drop a packet in flight, as any change of the path
    // can: wait for the normal way, then check that it stays.
    let normal = run.normal_way("web-1")?;
    run.expect_all(&["web-1"], normal)
        .map_err(|e| e.context(network_state(run.lab, "web-1")))?;
    run.expect_steady("web-1", normal, 2)?;
    run.note(format!(
        "helm uninstall + CRDs deleted in {:.1} s; {} node snapshots (links, addresses, rules, \
         routes of every table, permanent neighbours, FDB, nftables, iptables, net.* sysctls) \
         equal to before the install, no eBPF pins; web-1 leaves the normal way",
        gone.as_secs_f64(),
        run.lab.state.topology.nodes.len()
    ));
    Ok(())
}

/// What the path from `pod` to the target looks like now, for a failure
/// message: the target's neighbours, the pod's node's links with their
/// counters, and its connection-tracking entries toward the target.
fn network_state(lab: &Lab, pod: &str) -> String {
    let topo = &lab.state.topology;
    let target = &topo.target;
    let node = topo
        .pods
        .iter()
        .find(|p| p.name == pod)
        .and_then(|p| topo.node(&p.node).ok());
    let mut out = vec![format!("the network as {pod} sees it:")];
    let mut show = |what: &str, ns: &crate::lab::topology::Netns, args: &[&str]| {
        let text = crate::lab::net::exec(ns, "ip", args).unwrap_or_else(|e| format!("{e:#}"));
        out.push(format!("{what}:\n{}", text.trim_end()));
    };
    show("the target's neighbours", &target.netns, &["neigh", "show"]);
    if let Some(node) = node {
        show(
            &format!("{}'s links", node.name),
            &node.netns,
            &["-s", "-br", "link", "show"],
        );
        show(
            &format!("{}'s routes to the target", node.name),
            &node.netns,
            &["route", "get", &target.ip.to_string()],
        );
        let conntrack = crate::lab::net::exec(
            &node.netns,
            "conntrack",
            &["-L", "-d", &target.ip.to_string()],
        )
        .unwrap_or_else(|e| format!("{e:#}"));
        let lines: Vec<&str> = conntrack.lines().take(20).collect();
        out.push(format!(
            "{}'s connections to the target (first 20):\n{}",
            node.name,
            lines.join("\n")
        ));
    }
    out.join("\n")
}

/// `helm uninstall` of the lab's release, then its CRDs deleted, once
/// egressgw's pods are gone.
pub(super) fn uninstall(lab: &Lab) -> anyhow::Result<()> {
    Helm::for_lab(lab).run(&["uninstall", RELEASE, "-n", NAMESPACE])?;
    let kubectl = &lab.kubectl;
    eventually("egressgw's pods to be gone", SETTLE, || {
        let listed = kubectl
            .run(&["get", "pods", "-n", NAMESPACE, "-o", "name"])
            .map_err(|e| format!("{e:#}"))?;
        if listed.trim().is_empty() {
            Ok(())
        } else {
            Err(format!("still {}", listed.trim()))
        }
    })?;
    kubectl.run(&[
        "delete",
        "crd",
        "-l",
        "app.kubernetes.io/part-of=egressgw",
        "--wait=true",
        "--timeout=60s",
    ])?;
    Ok(())
}

/// The agent pods: node -> (pod name, uid).
pub(super) fn agent_pods(kubectl: &Kubectl) -> anyhow::Result<BTreeMap<String, (String, String)>> {
    let text = kubectl.run(&[
        "get", "pods", "-n", NAMESPACE, "-l", AGENT_PODS, "-o", "json",
    ])?;
    let list: Value = serde_json::from_str(&text).context("parsing the pod list")?;
    let mut pods = BTreeMap::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
        pods.insert(node.to_owned(), (name.to_owned(), uid.to_owned()));
    }
    Ok(pods)
}

/// `helm upgrade` of the lab's release, keeping its values, with `sets`,
/// whatever its exit status.
fn try_upgrade(helm: &Helm, sets: &[&str]) -> anyhow::Result<std::process::Output> {
    let chart = Helm::chart().display().to_string();
    let mut args = vec![
        "upgrade",
        RELEASE,
        &chart,
        "-n",
        NAMESPACE,
        "--reuse-values",
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    helm.output(&args)
}

/// `helm upgrade` of the lab's release, keeping its values, with `sets`.
fn upgrade(helm: &Helm, sets: &[&str]) -> anyhow::Result<()> {
    let out = try_upgrade(helm, sets)?;
    ensure!(
        out.status.success(),
        "helm upgrade --set {}: {}",
        sets.join(" --set "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Waits until the agent DaemonSet has rolled out and none of `before`'s
/// pods is left.
fn wait_rollout(lab: &Lab, before: &BTreeMap<String, (String, String)>) -> anyhow::Result<()> {
    // The controllers roll too (the config's checksum is on both): the
    // cluster is settled once both rollouts are done.
    for what in [
        format!("daemonset/{AGENT}"),
        format!("deployment/{CONTROLLER}"),
    ] {
        lab.kubectl.run(&[
            "rollout",
            "status",
            &what,
            "-n",
            NAMESPACE,
            &format!("--timeout={ROLLOUT}"),
        ])?;
    }
    let after = agent_pods(&lab.kubectl)?;
    let kept: Vec<&String> = before
        .iter()
        .filter(|(node, pod)| after.get(*node) == Some(pod))
        .map(|(node, _)| node)
        .collect();
    ensure!(kept.is_empty(), "the agents of {kept:?} were not replaced");
    Ok(())
}

/// `on` or `off`: `ethtool -k egress.vxlan`'s tx-checksumming in `ns`.
fn tx_checksumming(ns: &crate::lab::topology::Netns) -> anyhow::Result<String> {
    let out = crate::lab::cmd::run(
        "ip",
        &[
            "netns",
            "exec",
            ns.as_str(),
            "ethtool",
            "-k",
            "egress.vxlan",
        ],
    )?;
    out.lines()
        .find_map(|l| l.strip_prefix("tx-checksumming: "))
        .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
        .with_context(|| format!("no tx-checksumming line in ethtool -k: {out}"))
}

/// Requests to the API server with a ServiceAccount token, by curl from
/// the control-plane namespace: exactly the request, with no lookup first.
struct Caller {
    token: String,
    server: String,
    ca: PathBuf,
    netns: String,
}

impl Caller {
    /// A caller with a token of the agent's ServiceAccount from the
    /// TokenRequest API, bound to the Pod `(name, uid)` or to nothing.
    fn new(lab: &Lab, pod: Option<(&str, &str)>) -> anyhow::Result<Self> {
        let mut create_args = vec![
            "create",
            "token",
            AGENT,
            "-n",
            NAMESPACE,
            "--duration",
            "10m",
        ];
        if let Some((name, uid)) = pod {
            create_args.extend([
                "--bound-object-kind",
                "Pod",
                "--bound-object-name",
                name,
                "--bound-object-uid",
                uid,
            ]);
        }
        let token = lab.kubectl.run(&create_args)?.trim().to_owned();
        ensure!(
            !token.is_empty(),
            "kubectl {} printed no token",
            create_args.join(" ")
        );
        Ok(Self {
            token,
            server: lab.state.api_server.clone(),
            ca: lab.paths.pki().join("ca.crt"),
            netns: lab.state.topology.control_plane.netns.to_string(),
        })
    }

    /// Sends `method path` (a no-op JSON patch for PATCH, an empty policy
    /// for POST) and checks the status code and that the answer says `why`.
    fn expect(&self, method: &str, path: &str, code: u16, why: &str) -> anyhow::Result<()> {
        let (content_type, body) = if method == "PATCH" {
            // A JSON patch that only tests the object's name: it applies,
            // changes nothing, and goes through admission like any write.
            let mut segments = path.rsplit('/');
            let name = match segments.next() {
                Some("status") => segments.next(),
                last => last,
            }
            .unwrap_or_default();
            (
                "application/json-patch+json",
                format!("[{{\"op\":\"test\",\"path\":\"/metadata/name\",\"value\":\"{name}\"}}]"),
            )
        } else {
            (
                "application/json",
                "{\"apiVersion\":\"egressgw.io/v1alpha1\",\"kind\":\"EgressPolicy\",\
                 \"metadata\":{\"name\":\"from-the-agent\"},\"spec\":{}}"
                    .to_owned(),
            )
        };
        let url = format!("{}{path}", self.server);
        let ca = self.ca.display().to_string();
        let auth = format!("Authorization: Bearer {}", self.token);
        let ctype = format!("Content-Type: {content_type}");
        let mut args = vec![
            "netns",
            "exec",
            &self.netns,
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            &ca,
            "-H",
            &auth,
            "-X",
            method,
            "-w",
            "\n%{http_code}",
        ];
        if method == "PATCH" || method == "POST" {
            args.extend(["-H", &ctype, "--data", &body]);
        }
        args.push(&url);
        let out = crate::lab::cmd::run("ip", &args)?;
        let (answer, status) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        ensure!(
            status == code.to_string() && answer.contains(why),
            "as the agent, {method} {path}: expected {code} saying {why:?}, got {status}: {answer}"
        );
        Ok(())
    }
}

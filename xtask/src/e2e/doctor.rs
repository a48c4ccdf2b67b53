//! `egressgw doctor` on a lab node: it passes on a healthy node, and names
//! each thing broken by hand there (a rule of another component on
//! egressgw's mark bits, tx checksum offload turned the other way, an
//! underlay MTU too small for the tunnel, a gateway that stops answering).

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use serde_json::Value;

use super::run::{Run, eip_holders, eventually};
use super::scenarios::{setup_gateway, setup_web_policy};
use super::traffic::Expect;
use crate::lab::egressgw::{exec_in_agent, set_node_underlay};
use crate::lab::net;
use crate::lab::session::Lab;

/// The node doctor runs on: web-3's, which sends through the gateway.
const NODE: &str = "node-3";
/// A rule another component might add on egressgw's mark bits.
const FOREIGN_RULE: [&str; 7] = [
    "rule",
    "add",
    "priority",
    "100",
    "fwmark",
    "0x1000000/0xff000000",
    "lookup",
];
const FOREIGN_TABLE: &str = "100";

/// Doctor's checks as (name, verdict, evidence).
type Checks = Vec<(String, String, String)>;

/// `egressgw doctor -o json ARGS` in the agent of `node`'s container (as
/// `kubectl exec` runs it): whether it exited zero, and the checks.
fn doctor_with(lab: &Lab, node: &str, args: &[&str]) -> anyhow::Result<(bool, Checks)> {
    let mut all = vec!["doctor", "-o", "json"];
    all.extend_from_slice(args);
    let out = exec_in_agent(lab, node, &all)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let checks: Vec<Value> = serde_json::from_str(&stdout).with_context(|| {
        format!(
            "doctor printed no checks: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let checks = checks
        .iter()
        .map(|c| {
            let field = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (field("name"), field("verdict"), field("evidence"))
        })
        .collect();
    Ok((out.status.success(), checks))
}

/// `egressgw doctor -o json` on `node`.
fn doctor(lab: &Lab, node: &str) -> anyhow::Result<(bool, Checks)> {
    doctor_with(lab, node, &[])
}

/// Doctor's verdict of the check `name`, with its evidence.
fn verdict(checks: &[(String, String, String)], name: &str) -> (String, String) {
    checks
        .iter()
        .find(|(n, ..)| n == name)
        .map(|(_, v, e)| (v.clone(), e.clone()))
        .unwrap_or_default()
}

/// Doctor passes every check on `node` (the agent's included).
pub(super) fn passes(lab: &Lab, node: &str) -> Result<(), String> {
    let (ok, checks) = doctor(lab, node).map_err(|e| format!("{e:#}"))?;
    let bad: Vec<_> = checks.iter().filter(|(_, v, _)| v != "pass").collect();
    if ok && bad.is_empty() && !checks.is_empty() {
        Ok(())
    } else {
        Err(format!("exit ok {ok}, not passed: {bad:?}"))
    }
}

/// Breaks something with `break_it`, and expects doctor to fail with the
/// check `name` failing with `words` in its evidence. The agent repairs
/// some of these at its next reconcile; a repair between the break and the
/// check is told by `broken` and tried again.
fn names(
    lab: &Lab,
    args: &[&str],
    name: &str,
    words: &str,
    mut break_it: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    for _ in 0..3 {
        break_it()?;
        let (ok, checks) = doctor_with(lab, NODE, args)?;
        let (v, evidence) = verdict(&checks, name);
        if v == "fail" && evidence.contains(words) {
            ensure!(!ok, "doctor failed check {name} and still exited zero");
            println!("    doctor names it: FAIL {name}: {evidence}");
            return Ok(());
        }
        println!("    doctor did not name it yet ({name}: {v} {evidence}); again");
    }
    bail!("doctor on {NODE} never failed check {name} with {words:?}")
}

/// A healthy node passes; a foreign rule on egressgw's mark bits, tx
/// checksum offload turned the other way on the tunnel, an underlay MTU
/// below what the tunnel needs, and a gateway node that stops answering
/// through the tunnel are each named by their check, and the node passes
/// again once they are undone.
pub fn doctor_passes_on_a_healthy_node_and_names_what_is_broken(
    run: &mut Run,
) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-doctor")?;
    setup_web_policy(run, "e2e-doctor")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let lab: &Lab = &*run.lab;
    eventually(
        "doctor to pass on a healthy node",
        Duration::from_secs(20),
        || passes(lab, NODE),
    )?;
    let node = lab.node(NODE)?.clone();
    let netns = node.netns.clone();
    let ip = |args: &[&str]| net::exec(&netns, "ip", args).map(drop);

    // The kernel takes egressgw's whole table; on the eBPF datapath the
    // program can run in the agent's container (the chart mounts the
    // host's bpf filesystem there).
    let (_, checks) = doctor_with(lab, NODE, &[])?;
    let (v, features) = verdict(&checks, "features");
    let ebpf = verdict(&checks, "datapath").1.starts_with("ebpf");
    ensure!(
        v == "pass"
            && features.contains("egressgw's table passes the kernel's check")
            && (!ebpf || features.contains("eBPF: can run")),
        "doctor, features: {v} {features}"
    );
    println!("    features: {features}");

    // How fast node-3 sends to its peers, over the underlay and through
    // the tunnel (2 s each way, to the peers' agents).
    let (_, checks) = doctor_with(lab, NODE, &["--throughput"])?;
    let (v, measured) = verdict(&checks, "throughput");
    ensure!(
        (v == "pass" || v == "warn")
            && measured.contains("Gbit/s")
            && !measured.contains("failed")
            && !measured.contains("cannot measure"),
        "doctor --throughput: {v} {measured}"
    );
    println!("    throughput ({v}): {measured}");

    // One Pod's traffic, explained: the policy, its EIP and gateway node,
    // the kernel's classification, rule and route, the counters.
    let target = lab.state.topology.target.ip.to_string();
    let web = ["--pod", "team-a/web-3", "--dst", target.as_str()];
    let (ok, checks) = doctor_with(lab, NODE, &web)?;
    let (v, matched) = verdict(&checks, "match");
    ensure!(
        ok && v == "pass"
            && matched.contains("policy team-a/web")
            && matched.contains(&eip.to_string()),
        "doctor --pod team-a/web-3: {checks:?}"
    );
    let (v, kernel) = verdict(&checks, "kernel");
    ensure!(
        v == "pass",
        "doctor --pod team-a/web-3, kernel: {v} {kernel}"
    );
    println!("    team-a/web-3: {matched}\n    kernel: {kernel}");
    let (v, counted) = verdict(&checks, "counters");
    // Both datapaths count per policy (the metrics scenario checks the
    // counts against iperf3).
    ensure!(
        v == "pass" && counted.contains("policy team-a/web"),
        "counters: {v} {counted}"
    );
    println!("    counters: {counted}");
    let batch = ["--pod", "team-b/batch-3", "--dst", target.as_str()];
    let (ok, checks) = doctor_with(lab, NODE, &batch)?;
    let (v, matched) = verdict(&checks, "match");
    ensure!(
        ok && v == "pass" && matched.contains("no policy selects"),
        "doctor --pod team-b/batch-3: {checks:?}"
    );
    // The rule for the gateway node's mark taken away: the kernel no
    // longer does what the plan says.
    let mark = kernel
        .split_whitespace()
        .skip_while(|w| *w != "fwmark")
        .nth(1)
        .context("no fwmark in the kernel check's evidence")?
        .to_owned();
    let priority = kernel
        .split_whitespace()
        .skip_while(|w| *w != "priority")
        .nth(1)
        .context("no priority in the kernel check's evidence")?
        .to_owned();
    names(lab, &web, "kernel", "no rule sends mark", || {
        ip(&["rule", "del", "priority", &priority, "fwmark", &mark])
    })?;
    eventually(
        "doctor --pod to pass once the agent restored the rule",
        Duration::from_secs(40),
        || {
            let (ok, checks) = doctor_with(lab, NODE, &web).map_err(|e| format!("{e:#}"))?;
            ok.then_some(()).ok_or(format!("{checks:?}"))
        },
    )?;

    // A rule of another component on egressgw's mark bits, before its rules.
    let mut add: Vec<&str> = FOREIGN_RULE.to_vec();
    add.push(FOREIGN_TABLE);
    let named = names(
        lab,
        &[],
        "rules",
        "priority 100 fwmark 0x01000000/0xff000000",
        || ip(&add),
    );
    let mut del = add.clone();
    del[1] = "del";
    ip(&del).context("removing the foreign rule")?;
    named?;

    // tx checksum offload turned the other way on the tunnel.
    let offloads = net::exec(&netns, "ethtool", &["-k", "egress.vxlan"])?;
    let on = offloads.lines().any(|l| l.trim() == "tx-checksumming: on");
    let (flip, back) = if on { ("off", "on") } else { ("on", "off") };
    let named = names(lab, &[], "offload", "tx-checksumming should be", || {
        net::exec(&netns, "ethtool", &["-K", "egress.vxlan", "tx", flip]).map(drop)
    });
    net::exec(&netns, "ethtool", &["-K", "egress.vxlan", "tx", back])?;
    named?;

    // An underlay too small for the tunnel's MTU.
    let mtu = |m: &str| ip(&["link", "set", &node.interface, "mtu", m]);
    let named = names(lab, &[], "tunnel", "above the", || mtu("1400"));
    mtu("1500").context("restoring the underlay's MTU")?;
    named?;
    eventually("doctor to pass again", Duration::from_secs(40), || {
        passes(lab, NODE)
    })?;

    // A network between the nodes that carries less than the nodes'
    // MTU: the switch port of the EIP holder.
    let holder = eip_holders(lab, eip)?
        .into_iter()
        .find(|n| n != NODE)
        .context("no other node holds the EIP")?;
    let gateway = lab.node(&holder)?.clone();
    let topo = &lab.state.topology;
    let port = |m: &str| {
        let args = ["link", "set", gateway.underlay_port.as_str(), "mtu", m];
        net::exec(&topo.underlay.netns, "ip", &args).map(drop)
    };
    port("1400")?;
    let named = doctor(lab, NODE).and_then(|(ok, checks)| {
        let (v, evidence) = verdict(&checks, "path");
        ensure!(
            !ok && v == "fail" && evidence.contains("1450-byte packets do not cross the tunnel"),
            "doctor on {NODE} with {holder}'s switch port at MTU 1400: path {v} {evidence}"
        );
        println!("    doctor names it: FAIL path: {evidence}");
        Ok(())
    });
    port("1500").context("restoring the switch port's MTU")?;
    named?;

    // A gateway node that stops answering through the tunnel.
    set_node_underlay(topo, &gateway, false)?;
    let named = eventually(
        &format!("doctor on {NODE} to name {holder} as not answering"),
        Duration::from_secs(10),
        || {
            let (ok, checks) = doctor(lab, NODE).map_err(|e| format!("{e:#}"))?;
            let (v, evidence) = verdict(&checks, "peers");
            if !ok && v == "fail" && evidence.contains(&holder) {
                println!("    doctor names it: FAIL peers: {evidence}");
                Ok(())
            } else {
                Err(format!("peers: {v} {evidence}"))
            }
        },
    );
    set_node_underlay(topo, &gateway, true)?;
    named?;
    eventually(
        "doctor to pass once the gateway answers again",
        Duration::from_secs(40),
        || passes(lab, NODE),
    )?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))
}

//! The promise under failures: selected traffic leaves with its EIP or not
//! at all, whatever the API server, a node, its agent or the network does.
//! Every scenario probes from pods every 20 ms and checks what the target
//! saw.

use std::net::{IpAddr, Ipv4Addr};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::json;

use super::metrics::{sample, scrape_agent};
use super::objects::{app, policy};
use super::run::{PolicyStatus, Run, SETTLE, eip_holders, eventually};
use super::scenarios::{setup_gateway, setup_web_policy};
use super::traffic::{Expect, Prober, Sample, Seen};

/// Probe interval of every scenario here.
const EVERY: Duration = Duration::from_millis(20);
/// How long the API server stays frozen in the outage scenario.
const OUTAGE: Duration = Duration::from_secs(60);
/// Failover trials whose recovery times make the table.
const TRIALS: usize = 10;
const TEAM_A: &str = "team-a";
const TARGET_NET: &str = "198.51.100.0/24";

/// The one holder of `eip` (fails while none or two hold it).
fn holder(run: &Run, eip: Ipv4Addr) -> anyhow::Result<String> {
    eventually("exactly one node to hold the EIP", SETTLE, || {
        let holders = eip_holders(run.lab, eip).map_err(|e| format!("{e:#}"))?;
        match holders.as_slice() {
            [one] => Ok(one.clone()),
            _ => Err(format!("held by {holders:?}")),
        }
    })
}

/// Samples whose source was an address other than `eip`.
fn wrong_sources(samples: &[Sample], eip: Ipv4Addr) -> Vec<String> {
    samples
        .iter()
        .filter_map(|s| match &s.seen {
            Seen::Source(ip) if *ip != eip => Some(ip.to_string()),
            _ => None,
        })
        .collect()
}

fn unanswered(samples: &[Sample]) -> usize {
    samples
        .iter()
        .filter(|s| matches!(s.seen, Seen::NoAnswer(_)))
        .count()
}

/// How long after `since` probes were answered with `eip` again: to the
/// start of the first such probe after the last one that was not, once
/// three in a row are. `None` while that has not happened, and when no
/// probe missed at all (answers that never stopped are not a recovery).
pub(super) fn back_after(
    samples: &[Sample],
    since: Instant,
    eip: impl Into<IpAddr>,
) -> Option<Duration> {
    let eip: IpAddr = eip.into();
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at >= since).collect();
    let last_bad = after
        .iter()
        .rposition(|s| !s.seen.is(&Expect::Source(eip)))?;
    let first_good = after.get(last_bad + 1)?;
    // Three good probes in a row: back, not a lucky one.
    let settled = after
        .iter()
        .skip_while(|s| s.at < first_good.at)
        .take(3)
        .filter(|s| s.seen.is(&Expect::Source(eip)))
        .count()
        == 3;
    settled.then(|| first_good.at.duration_since(since))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    // Nearest rank.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn apiserver_outage_changes_no_source_and_moves_no_eip(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-outage")?;
    setup_web_policy(run, "e2e-outage")?;
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))?;
    let held_by = holder(run, eip)?;
    let agents_before = super::run::agent_pids(run.lab)?;
    let limit = OUTAGE + Duration::from_secs(20);
    let probers: Vec<Prober> = ["web-1", "web-2", "web-3"]
        .iter()
        .map(|pod| Ok(Prober::start(run.netns(pod)?, run.target(), EVERY, limit)))
        .collect::<anyhow::Result<_>>()?;

    let pid = run.freeze("kube-apiserver", true)?;
    let frozen_at = Instant::now();
    let mut moves = Vec::new();
    while frozen_at.elapsed() < OUTAGE {
        let holders = eip_holders(run.lab, eip)?;
        if holders != [held_by.clone()] {
            moves.push(format!(
                "{:.1} s: held by {holders:?}",
                frozen_at.elapsed().as_secs_f64()
            ));
        }
        thread::sleep(Duration::from_millis(500));
    }
    run.freeze("kube-apiserver", false)?;
    // The API answers again; the agents report, nothing restarts.
    eventually("the API server to answer again", SETTLE, || {
        run.get("egresspolicy", Some(TEAM_A), "web")
            .map(drop)
            .map_err(|e| format!("{e:#}"))
    })?;
    thread::sleep(Duration::from_secs(5));
    let samples: Vec<Vec<Sample>> = probers.into_iter().map(Prober::finish).collect();
    let agents_after = super::run::agent_pids(run.lab)?;
    ensure!(
        agents_before == agents_after,
        "agents restarted during the outage: {agents_before:?} -> {agents_after:?}"
    );
    ensure!(
        moves.is_empty(),
        "the EIP moved during the outage: {moves:?}"
    );
    let mut report = Vec::new();
    for (pod, s) in ["web-1", "web-2", "web-3"].iter().zip(&samples) {
        let wrong = wrong_sources(s, eip);
        ensure!(
            wrong.is_empty(),
            "{pod}: {} of {} probes left with another source than {eip}: {:?}",
            wrong.len(),
            s.len(),
            &wrong[..wrong.len().min(5)]
        );
        report.push(format!(
            "{pod} {} probes, {} unanswered",
            s.len(),
            unanswered(s)
        ));
    }
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)?;
    run.note(format!(
        "kube-apiserver (pid {pid}) frozen for {} s: no probe with a source other than {eip} ({}); \
         the EIP stayed on {held_by}; no agent restarted",
        OUTAGE.as_secs(),
        report.join(", ")
    ));
    Ok(())
}

/// Takes the holder's links down, measures until web-3 is answered with
/// the EIP again, brings the links back and waits for the node to be seen.
fn one_failover(
    run: &mut Run,
    eip: Ipv4Addr,
    pod: &str,
) -> anyhow::Result<(String, String, Duration)> {
    let from = holder(run, eip)?;
    let prober = Prober::start(run.netns(pod)?, run.target(), EVERY, SETTLE);
    thread::sleep(Duration::from_millis(200));
    let down_at = Instant::now();
    run.node_links(&from, false)?;
    let back = eventually("traffic to come back with the EIP", SETTLE, || {
        let samples = prober.samples();
        back_after(&samples, down_at, eip).ok_or_else(|| format!("{} probes so far", samples.len()))
    })?;
    let samples = prober.finish();
    let wrong = wrong_sources(&samples, eip);
    ensure!(wrong.is_empty(), "probes left with {wrong:?}");
    let to = holder(run, eip)?;
    ensure!(to != from, "{from} still holds {eip} with its links down");
    run.node_links(&from, true)?;
    Ok((from, to, back))
}

pub fn failover_after_links_down_is_back_within_a_second(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-trials")?;
    setup_web_policy(run, "e2e-trials")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let mut times = Vec::new();
    for trial in 1..=TRIALS {
        let (from, to, back) =
            one_failover(run, eip, "web-3").with_context(|| format!("trial {trial}"))?;
        run.note(format!(
            "trial {trial}: {from} down, {eip} taken by {to}: traffic back after {:.2} s",
            back.as_secs_f64()
        ));
        times.push(back);
        // The old holder is back as a standby before the next trial.
        eventually("the old holder to answer its peers again", SETTLE, || {
            let status = run
                .get("egresstunnel", None, &from)
                .map_err(|e| format!("{e:#}"))?;
            let phase = status["status"]["phase"].as_str().unwrap_or_default();
            if phase == "Ready" {
                Ok(())
            } else {
                Err(format!("phase {phase}"))
            }
        })?;
        thread::sleep(Duration::from_millis(1500));
        ensure!(
            eip_holders(run.lab, eip)? == [to.clone()],
            "{from} came back and the EIP left {to}: a recovered node must not take it back"
        );
    }
    // web-3's node detected each failover and recovered from it: its
    // traffic went to the new holder once the old one fell silent.
    let text = scrape_agent(run.lab, "node-3")?;
    let count = |histogram: &str| sample(&text, &format!("{histogram}_count")).unwrap_or(0.0);
    let sum = |histogram: &str| sample(&text, &format!("{histogram}_sum")).unwrap_or(0.0);
    let (detection, recovery) = (
        "egressgw_failover_detection_seconds",
        "egressgw_failover_recovery_seconds",
    );
    ensure!(
        count(detection) >= TRIALS as f64 && count(recovery) >= TRIALS as f64,
        "node-3 counted {} detections and {} recoveries in {TRIALS} failovers",
        count(detection),
        count(recovery)
    );
    run.note(format!(
        "node-3's metrics: {} failovers detected after {:.2} s on average, recovered after {:.2} s",
        count(detection),
        sum(detection) / count(detection),
        sum(recovery) / count(recovery)
    ));
    times.sort_unstable();
    run.note(format!(
        "failover over {TRIALS} trials, probes every {} ms: p50 {:.2} s, p99 {:.2} s, max {:.2} s",
        EVERY.as_millis(),
        percentile(&times, 50.0).as_secs_f64(),
        percentile(&times, 99.0).as_secs_f64(),
        times.last().map_or(0.0, Duration::as_secs_f64)
    ));
    Ok(())
}

pub fn failover_works_with_the_apiserver_and_controller_frozen(
    run: &mut Run,
) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-blind")?;
    setup_web_policy(run, "e2e-blind")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    run.freeze_controllers(true)?;
    run.freeze("kube-apiserver", true)?;
    let (from, to, back) = one_failover(run, eip, "web-3")?;
    run.note(format!(
        "kube-apiserver and controllers frozen, {from} down: {eip} taken by {to}, \
         traffic back after {:.2} s",
        back.as_secs_f64()
    ));
    // Still blind: the returning node must not take the EIP back.
    thread::sleep(Duration::from_secs(2));
    let holders = eip_holders(run.lab, eip)?;
    ensure!(
        holders == [to.clone()],
        "{from} came back with the API server still frozen: {eip} is held by {holders:?}"
    );
    run.freeze("kube-apiserver", false)?;
    run.freeze_controllers(false)?;
    // The record catches up: the policy's status names the holder.
    eventually("the policy's status to name the holder", SETTLE, || {
        let status = run
            .get("egresspolicy", Some(TEAM_A), "web")
            .map(|o| PolicyStatus::of(&o))
            .map_err(|e| format!("{e:#}"))?;
        if status.node.as_deref() == Some(to.as_str()) {
            Ok(())
        } else {
            Err(format!("status: {status}"))
        }
    })?;
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)?;
    run.note(format!(
        "{from} back while blind: {to} kept {eip}; once thawed, the status named {to}"
    ));
    Ok(())
}

pub fn killed_gateway_agent_moves_nothing_and_loses_nothing(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-headless")?;
    setup_web_policy(run, "e2e-headless")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let held_by = holder(run, eip)?;
    // A lost SYN is sent again after 1 s: waiting that long for each answer
    // still shows any gap, and a slow answer on a busy machine is no gap.
    let prober = Prober::start_within(
        run.netns("web-3")?,
        run.target(),
        EVERY,
        SETTLE,
        super::traffic::PROBE_TIMEOUT,
    );
    // Past the setup's reconciles and status writes.
    thread::sleep(Duration::from_secs(2));
    let killed_at = Instant::now();
    let pid = run.kill_agent(&held_by)?;
    // Longer than any timeout that would once have moved the EIP.
    thread::sleep(Duration::from_secs(8));
    let holders = eip_holders(run.lab, eip)?;
    let (log, offset) = run.start_agent(&held_by)?;
    super::run::wait_log_line(&log, offset, "reconciled applied=", SETTLE)?;
    thread::sleep(Duration::from_millis(500));
    let samples = prober.finish();
    ensure!(
        holders == [held_by.clone()],
        "the EIP moved while only the agent of {held_by} was dead: {holders:?}"
    );
    let wrong = wrong_sources(&samples, eip);
    ensure!(wrong.is_empty(), "probes left with {wrong:?}");
    // Only what was sent while the agent was dead counts: a probe lost
    // before the kill says nothing about a dead agent.
    let lost: Vec<String> = samples
        .iter()
        .filter(|s| s.at >= killed_at)
        .filter_map(|s| match &s.seen {
            Seen::NoAnswer(why) => Some(format!(
                "{:+.2} s after the kill: {why}",
                s.at.saturating_duration_since(killed_at).as_secs_f64()
            )),
            Seen::Source(_) => None,
        })
        .collect();
    let while_dead = samples.iter().filter(|s| s.at >= killed_at).count();
    ensure!(
        lost.is_empty(),
        "{} of {while_dead} probes went unanswered while the gateway's agent was dead: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    run.note(format!(
        "agent of the gateway {held_by} (pid {pid}) SIGKILLed for 8 s and restarted: {eip} stayed, \
         {while_dead} probes from web-3 sent meanwhile all answered with it",
    ));
    Ok(())
}

pub fn failover_of_a_gateway_cut_off_from_its_peers_never_holds_the_eip_twice(
    run: &mut Run,
) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-split")?;
    setup_web_policy(run, "e2e-split")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let from = holder(run, eip)?;
    let prober = Prober::start(run.netns("web-3")?, run.target(), EVERY, SETTLE);
    thread::sleep(Duration::from_millis(200));
    let cut_at = Instant::now();
    // Cut off from the other nodes, still on the external segment with
    // the target: both sides can answer ARP there.
    run.node_underlay(&from, false)?;
    let mut doubles = Vec::new();
    let mut to = None;
    while cut_at.elapsed() < Duration::from_secs(6) {
        let holders = eip_holders(run.lab, eip)?;
        if holders.len() > 1 {
            doubles.push(format!(
                "{:.2} s: {holders:?}",
                cut_at.elapsed().as_secs_f64()
            ));
        }
        if let [one] = holders.as_slice()
            && *one != from
        {
            to = Some(one.clone());
        }
        thread::sleep(Duration::from_millis(10));
    }
    let back = back_after(&prober.samples(), cut_at, eip);
    run.node_underlay(&from, true)?;
    let mut after_return = Vec::new();
    let up_at = Instant::now();
    while up_at.elapsed() < Duration::from_secs(3) {
        let holders = eip_holders(run.lab, eip)?;
        if holders.len() != 1 {
            after_return.push(format!(
                "{:.2} s: {holders:?}",
                up_at.elapsed().as_secs_f64()
            ));
        }
        thread::sleep(Duration::from_millis(10));
    }
    let samples = prober.finish();
    ensure!(
        doubles.is_empty(),
        "{eip} was held by two nodes at once while {from} was cut off: {doubles:?}"
    );
    ensure!(
        after_return.is_empty(),
        "{eip} was not held by exactly one node after {from} came back: {after_return:?}"
    );
    let to = to.with_context(|| format!("no other node took {eip} from the cut-off {from}"))?;
    let wrong = wrong_sources(&samples, eip);
    ensure!(wrong.is_empty(), "probes left with {wrong:?}");
    let back = back.context("web-3's traffic did not come back with the EIP")?;
    run.note(format!(
        "{from} cut off from its peers but not from the target: it gave {eip} up, {to} took it; \
         never two holders (checked every 10 ms); traffic back after {:.2} s",
        back.as_secs_f64()
    ));
    Ok(())
}

pub fn a_pool_address_in_use_on_the_segment_is_refused(run: &mut Run) -> anyhow::Result<()> {
    // A working policy beside it, on its own gateway and EIP.
    let eip = setup_gateway(run, "e2e-inuse-ok")?;
    setup_web_policy(run, "e2e-inuse-ok")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let target = match run.target().ip() {
        IpAddr::V4(ip) => ip,
        IpAddr::V6(_) => bail!("the lab's target has an IPv6 address"),
    };
    let prober = Prober::start(run.netns("web-3")?, run.target(), EVERY, SETTLE);
    run.apply(&json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressGateway",
        "metadata": { "name": "e2e-inuse" },
        "spec": {
            "nodeSelector": { "selector": { "matchLabels": { "egressgw.io/gateway": "true" } } },
            "ippools": { "ipv4": [target.to_string()] },
        },
    }))?;
    run.apply(&policy(
        TEAM_A,
        "batch",
        "e2e-inuse",
        &app("batch"),
        &[TARGET_NET],
    ))?;
    let who = eventually("a node to report the EIP in use", SETTLE, || {
        let text = run
            .lab
            .kubectl
            .run(&["get", "egresstunnels", "-o", "json"])
            .map_err(|e| format!("{e:#}"))?;
        let tunnels: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        tunnels["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|t| t["status"]["eips"].as_array().cloned().unwrap_or_default())
            .find(|e| e["ip"] == target.to_string() && e["state"] == "InUse")
            .and_then(|e| e["message"].as_str().map(str::to_owned))
            .ok_or_else(|| "no tunnel reports it".to_owned())
    })?;
    thread::sleep(Duration::from_secs(2));
    let holders = eip_holders(run.lab, target)?;
    let samples = prober.finish();
    ensure!(holders.is_empty(), "{target} is held by {holders:?}");
    let wrong = wrong_sources(&samples, eip);
    ensure!(wrong.is_empty(), "probes left with {wrong:?}");
    ensure!(
        unanswered(&samples) == 0,
        "web-3's traffic to the target was disturbed: {} of {} probes unanswered",
        unanswered(&samples),
        samples.len()
    );
    run.note(format!(
        "a pool holding the target's own address {target}: no node took it ({who}); \
         web-3's {} probes through the other gateway all answered with {eip}",
        samples.len()
    ));
    Ok(())
}

pub fn fail_closed_drops_what_has_no_live_gateway_and_fail_open_says_so(
    run: &mut Run,
) -> anyhow::Result<()> {
    // A gateway on node-1 only; web-2's node has an external link of its
    // own, so traffic leaving the normal way would be seen from it.
    let eip = *run.pool.first().context("the run has no pool")?;
    let gateway = |fail_closed: bool| {
        json!({
            "apiVersion": "egressgw.io/v1alpha1",
            "kind": "EgressGateway",
            "metadata": { "name": "e2e-closed" },
            "spec": {
                "nodeSelector": { "selector": { "matchLabels": { "kubernetes.io/hostname": "node-1" } } },
                "ippools": { "ipv4": [eip.to_string()] },
                "failClosed": fail_closed,
            },
        })
    };
    run.apply(&gateway(true))?;
    setup_web_policy(run, "e2e-closed")?;
    run.expect_all(&["web-2"], Expect::Source(eip.into()))?;
    let normal = run.normal_way("web-2")?;
    let prober = Prober::start(run.netns("web-2")?, run.target(), EVERY, SETTLE);
    run.node_links("node-1", false)?;
    thread::sleep(Duration::from_secs(3));
    let samples = prober.finish();
    let wrong = wrong_sources(&samples, eip);
    ensure!(
        wrong.is_empty(),
        "failing closed, web-2's traffic left with {wrong:?} while node-1 was down"
    );
    let dropped = unanswered(&samples);
    ensure!(dropped > 0, "node-1 was down, yet every probe was answered");
    let closed_note = no_live_gateway_note(run, eip, "FailingClosed", "dropped (failClosed)")?;
    // Failing open, the same outage lets the traffic out the normal way.
    run.apply(&gateway(false))?;
    eventually(
        "failing open, web-2 to leave the normal way",
        SETTLE,
        || {
            let seen = super::traffic::whoami(
                &run.netns("web-2").map_err(|e| format!("{e:#}"))?,
                run.target(),
            );
            if seen.is(&normal) {
                Ok(())
            } else {
                Err(format!("saw {seen}"))
            }
        },
    )?;
    let open_note = no_live_gateway_note(
        run,
        eip,
        "FailingOpen",
        "node-2's own address (failClosed: false)",
    )?;
    run.node_links("node-1", true)?;
    run.expect_all(&["web-2"], Expect::Source(eip.into()))?;
    eventually("a GatewayReachable Event on the policy", SETTLE, || {
        let notes = run
            .event_notes(Some(TEAM_A), "EgressPolicy", "web", "GatewayReachable")
            .map_err(|e| format!("{e:#}"))?;
        notes
            .iter()
            .any(|n| n.contains("node node-2") && n.contains(&eip.to_string()))
            .then_some(())
            .ok_or_else(|| format!("notes: {notes:?}"))
    })?;
    run.note(format!(
        "node-1, the only gateway node, down: failing closed, {dropped} of {} probes from web-2 dropped, \
         none seen from another address; failing open, web-2 left as {normal}; Events said \
         \"{closed_note}\", then \"{open_note}\"",
        samples.len()
    ));
    Ok(())
}

/// Waits for node-2's `EgressTunnel` to list `eip` as unreachable and for
/// a `reason` Event on the policy team-a/web saying `outcome`; returns the
/// Event's note.
fn no_live_gateway_note(
    run: &Run,
    eip: Ipv4Addr,
    reason: &str,
    outcome: &str,
) -> anyhow::Result<String> {
    let fail_closed = reason == "FailingClosed";
    eventually(
        "node-2's EgressTunnel to list the EIP as unreachable",
        SETTLE,
        || {
            let tunnel = run
                .get("egresstunnel", None, "node-2")
                .map_err(|e| format!("{e:#}"))?;
            let listed = tunnel["status"]["unreachable"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            listed
                .iter()
                .any(|u| u["eip"] == eip.to_string() && u["failClosed"] == fail_closed)
                .then_some(())
                .ok_or_else(|| format!("status.unreachable: {listed:?}"))
        },
    )?;
    eventually(&format!("a {reason} Event on the policy"), SETTLE, || {
        let notes = run
            .event_notes(Some(TEAM_A), "EgressPolicy", "web", reason)
            .map_err(|e| format!("{e:#}"))?;
        notes
            .iter()
            .rev()
            .find(|n| {
                n.contains("node node-2") && n.contains(&eip.to_string()) && n.contains(outcome)
            })
            .cloned()
            .ok_or_else(|| format!("notes: {notes:?}"))
    })
}

pub fn a_gateway_without_a_snat_entry_drops_instead_of_leaking_the_node_address(
    run: &mut Run,
) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-guard")?;
    setup_web_policy(run, "e2e-guard")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let held_by = holder(run, eip)?;
    let netns = run.lab.node(&held_by)?.netns.clone();
    // The moment before a gateway's plan arrives: it gets the tunnel's
    // traffic but has no SNAT entry for it. The lab's CNI masquerade would
    // send it out with the node's address. The agent is frozen meanwhile,
    // or its next reconcile would put the entries back.
    run.freeze_agent(&held_by, true)?;
    crate::lab::cmd::run(
        "ip",
        &[
            "netns",
            "exec",
            netns.as_str(),
            "nft",
            "flush",
            "map",
            "inet",
            "egressgw",
            "snat4",
        ],
    )?;
    let web3 = run.netns("web-3")?;
    let seen: Vec<Seen> = (0..3)
        .map(|_| super::traffic::whoami(&web3, run.target()))
        .collect();
    run.freeze_agent(&held_by, false)?;
    let leaked: Vec<String> = seen
        .iter()
        .filter_map(|s| match s {
            Seen::Source(ip) => Some(ip.to_string()),
            Seen::NoAnswer(_) => None,
        })
        .collect();
    ensure!(
        leaked.is_empty(),
        "with {held_by}'s SNAT entries gone, web-3's traffic left as {leaked:?}"
    );
    // Thawed, the agent puts the entries back.
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    run.note(format!(
        "{held_by}'s SNAT entries flushed by hand (its agent frozen): web-3's 3 probes got no answer, \
         none left with another address; thawed, the agent restored them"
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, seen: Seen) -> Sample {
        Sample {
            at,
            took: Duration::from_millis(1),
            seen,
        }
    }

    #[test]
    fn traffic_is_back_at_the_first_of_three_good_probes_after_the_last_bad_one() {
        let eip = Ipv4Addr::new(198, 51, 100, 100);
        let t0 = Instant::now();
        let ms = |m| t0 + Duration::from_millis(m);
        let good = || Seen::Source(eip.into());
        let bad = || Seen::NoAnswer("timed out".into());
        let samples = vec![
            sample(ms(0), good()),
            sample(ms(20), bad()),
            sample(ms(40), good()),
            sample(ms(60), bad()),
            sample(ms(80), good()),
            sample(ms(100), good()),
        ];
        assert_eq!(back_after(&samples, t0, eip), None, "two good ones only");
        let mut more = samples.clone();
        more.push(sample(ms(120), good()));
        assert_eq!(back_after(&more, t0, eip), Some(Duration::from_millis(80)));
        // Answers that never stopped are not a recovery.
        let steady: Vec<Sample> = (0..5).map(|i| sample(ms(i * 20), good())).collect();
        assert_eq!(back_after(&steady, t0, eip), None);
        assert_eq!(
            wrong_sources(
                &[sample(
                    ms(0),
                    Seen::Source(IpAddr::from([198, 51, 100, 11]))
                )],
                eip
            ),
            vec!["198.51.100.11".to_owned()]
        );
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let times: Vec<Duration> = (1..=10).map(Duration::from_millis).collect();
        assert_eq!(percentile(&times, 50.0), Duration::from_millis(5));
        assert_eq!(percentile(&times, 99.0), Duration::from_millis(10));
    }
}

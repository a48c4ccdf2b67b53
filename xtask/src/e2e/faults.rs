//! Faults under steady state: the controllers SIGKILLed, etcd restarted,
//! the node holding the EIP rebooted. None may change the source a selected
//! pod's traffic leaves with; the first two move no allocation either.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use serde_json::Value;

use super::objects::{app, policy};
use super::run::{PolicyStatus, Run, SETTLE, eip_holders, eventually};
use super::scenarios::{TEAM_A, setup_gateway, setup_web_policy};
use super::traffic::{Expect, Prober, Sample, Seen};
use crate::lab::egressgw;

/// What the controller allocated, as the objects record it: the policy's
/// EIP and node, the gateway's EIP placement and every node's tunnel
/// identity (address, MAC, mark).
fn allocations(run: &Run, gateway: &str) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let web = run.get("egresspolicy", Some(TEAM_A), "web")?;
    out.push(format!(
        "policy team-a/web: eip {} node {}",
        web["status"]["eip"]["ipv4"], web["status"]["node"]
    ));
    let gw = run.get("egressgateway", None, gateway)?;
    out.push(format!(
        "gateway {gateway}: nodes {}",
        gw["status"]["nodeList"]
    ));
    let text = run
        .lab
        .kubectl
        .run(&["get", "egresstunnels", "-o", "json"])?;
    let tunnels: Value = serde_json::from_str(&text).context("parsing the EgressTunnels")?;
    let mut rows: Vec<String> = tunnels["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let s = &t["status"];
            format!(
                "tunnel {}: {} {} mark {}",
                t["metadata"]["name"], s["tunnel"]["ipv4"], s["tunnel"]["mac"], s["mark"]
            )
        })
        .collect();
    rows.sort();
    out.extend(rows);
    Ok(out)
}

/// What stays put across a disruption of a gateway's steady state: the
/// allocations ([`allocations`]) and the count of its `EipMoved` Events.
pub(super) struct Steady {
    gateway: &'static str,
    allocations: Vec<String>,
    moves: usize,
}

impl Steady {
    pub(super) fn record(run: &Run, gateway: &'static str) -> anyhow::Result<Self> {
        Ok(Self {
            gateway,
            allocations: allocations(run, gateway)?,
            moves: run
                .event_notes(None, "EgressGateway", gateway, "EipMoved")?
                .len(),
        })
    }

    /// After `what`: every probe of `samples` from `from` on saw `eip`,
    /// the allocations are unchanged and no EIP moved. Returns the probes
    /// and the allocations counted.
    pub(super) fn kept_across(
        &self,
        run: &Run,
        what: &str,
        (samples, from, eip): (&[Sample], Instant, std::net::Ipv4Addr),
    ) -> anyhow::Result<(usize, usize)> {
        let probes = all_with(samples, from, eip)?;
        let before = &self.allocations;
        let after = allocations(run, self.gateway)?;
        ensure!(
            after == *before,
            "allocations changed across {what}:\nbefore: {before:#?}\nafter: {after:#?}"
        );
        let moved = run.event_notes(None, "EgressGateway", self.gateway, "EipMoved")?;
        ensure!(
            moved.len() == self.moves,
            "EIPs moved across {what}: {:?}",
            &moved[self.moves..]
        );
        Ok((probes, before.len()))
    }
}

/// Every probe from `from` on saw `eip`: none unanswered, none with
/// another source.
fn all_with(samples: &[Sample], from: Instant, eip: std::net::Ipv4Addr) -> anyhow::Result<usize> {
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at >= from).collect();
    let other: Vec<String> = after
        .iter()
        .filter(|s| !s.seen.is(&Expect::Source(eip.into())))
        .map(|s| {
            format!(
                "{:.1} s: {}",
                s.at.duration_since(from).as_secs_f64(),
                s.seen
            )
        })
        .collect();
    ensure!(
        other.is_empty(),
        "{} of {} probes did not see {eip}: {}",
        other.len(),
        after.len(),
        other.join("; ")
    );
    ensure!(!after.is_empty(), "no probe ran");
    Ok(after.len())
}

/// Waits until one controller leads and has planned team-a/web again
/// (only the leader exports the objects' metrics).
fn wait_leader_planned(run: &Run) -> anyhow::Result<()> {
    eventually("a controller to lead and plan again", SETTLE * 2, || {
        let controllers = super::metrics::controllers(run.lab).map_err(|e| format!("{e:#}"))?;
        let planned = controllers.iter().any(|text| {
            super::metrics::sample(text, "egressgw_controller_leader") == Some(1.0)
                && text.contains("egressgw_policy_ready{namespace=\"team-a\",policy=\"web\"")
        });
        if planned {
            Ok(())
        } else {
            Err(format!(
                "{} controllers, none leads and has planned",
                controllers.len()
            ))
        }
    })
}

/// The controllers are SIGKILLed under steady state (both replicas: no
/// leader hands over). Until they are back, and after the new leader has
/// planned, web-3's probes every 100 ms all leave with the EIP, and every
/// allocation is what it was; no EIP moved.
pub fn killed_controllers_change_no_allocation_and_no_source(run: &mut Run) -> anyhow::Result<()> {
    const GATEWAY: &str = "e2e-kill-controller";
    let eip = setup_gateway(run, GATEWAY)?;
    setup_web_policy(run, GATEWAY)?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))?;
    let steady = Steady::record(run, GATEWAY)?;
    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(120),
    );
    let killed_at = Instant::now();
    let killed = egressgw::kill_controllers(run.lab)?;
    eventually("the controllers to run again", SETTLE, || {
        let now = egressgw::controller_pids(run.lab);
        if !now.is_empty() && now.iter().all(|p| !killed.contains(p)) {
            Ok(())
        } else {
            Err(format!("pids {now:?}, killed {killed:?}"))
        }
    })?;
    wait_leader_planned(run)?;
    let back = killed_at.elapsed();
    // A few more of the new leader's runs.
    std::thread::sleep(Duration::from_secs(3));
    let samples = prober.finish();
    let what = "the controllers' restart";
    let (probes, kept) = steady.kept_across(run, what, (&samples, killed_at, eip))?;
    run.note(format!(
        "{} controllers SIGKILLed; a new leader planned after {:.1} s; {probes} probes of \
         web-3 all from {eip}; {kept} allocations unchanged",
        killed.len(),
        back.as_secs_f64(),
    ));
    Ok(())
}

/// etcd is SIGKILLed under steady state and started again on its data.
/// Throughout, web-3's probes all leave with the EIP; afterwards every
/// allocation is what it was, and the daemons' watches see changes again:
/// team-a/web changed to another destination lets web-1's traffic to the
/// target leave the normal way.
pub fn etcd_restarted_changes_no_allocation_and_no_source(run: &mut Run) -> anyhow::Result<()> {
    const GATEWAY: &str = "e2e-etcd";
    let eip = setup_gateway(run, GATEWAY)?;
    setup_web_policy(run, GATEWAY)?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))?;
    let steady = Steady::record(run, GATEWAY)?;
    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(120),
    );
    let killed_at = Instant::now();
    egressgw::restart_control_plane(run.lab, "etcd")?;
    eventually("the API server to answer again", SETTLE * 2, || {
        run.lab
            .kubectl
            .run(&["get", "--raw", "/readyz"])
            .map(drop)
            .map_err(|e| format!("{e:#}"))
    })?;
    let back = killed_at.elapsed();
    // The daemons' watches and writes go through the API server again.
    std::thread::sleep(Duration::from_secs(5));
    let samples = prober.finish();
    let what = "the etcd restart";
    let (probes, kept) = steady.kept_across(run, what, (&samples, killed_at, eip))?;
    // A change after the restart reaches the nodes: web-1 to the target
    // is no longer selected once team-a/web covers only another network.
    run.apply(&policy(
        TEAM_A,
        "web",
        GATEWAY,
        &app("web"),
        &["203.0.113.0/24"],
    ))?;
    run.expect_normal(&["web-1"])
        .context("a policy changed after the etcd restart")?;
    run.note(format!(
        "etcd SIGKILLed and started again: the API server answered after {:.1} s; {probes} \
         probes of web-3 all from {eip}; {kept} allocations unchanged; a policy change after it \
         took effect",
        back.as_secs_f64(),
    ));
    Ok(())
}

/// The node holding the EIP reboots, as far as egressgw is concerned: its
/// agent stops, everything egressgw made in its kernel is wiped
/// (`egressgw cleanup`: tunnel, EIP, rules, routes, table, program), and
/// the agent starts again. Meanwhile web-3 (on a worker) is probed every
/// 100 ms: a probe may go unanswered, none may leave with another source.
/// Afterwards exactly one node holds the EIP, the policy's status names
/// it, web-1..3 leave with the EIP, and doctor passes on the rebooted node.
pub fn a_rebooted_eip_holder_comes_back_and_nothing_leaves_with_another_source(
    run: &mut Run,
) -> anyhow::Result<()> {
    const GATEWAY: &str = "e2e-reboot";
    let eip = setup_gateway(run, GATEWAY)?;
    let status = setup_web_policy(run, GATEWAY)?;
    let holder = status.node.clone().context("the policy has no node")?;
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))?;
    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(120),
    );
    let down_at = Instant::now();
    run.freeze_agent(&holder, true)?;
    let wiped = egressgw::exec_in_agent(run.lab, &holder, &["cleanup"])?;
    ensure!(
        wiped.status.success(),
        "egressgw cleanup on {holder} failed: {}{}",
        String::from_utf8_lossy(&wiped.stdout),
        String::from_utf8_lossy(&wiped.stderr)
    );
    let gone = eip_holders(run.lab, eip)?;
    ensure!(
        !gone.contains(&holder),
        "{holder} still has {eip} after the wipe (held by {gone:?})"
    );
    run.kill_agent(&holder)?;
    run.start_agent(&holder)?;
    let holders = eventually("exactly one node to hold the EIP", SETTLE, || {
        let holders = eip_holders(run.lab, eip).map_err(|e| format!("{e:#}"))?;
        if holders.len() == 1 {
            Ok(holders)
        } else {
            Err(format!("held by {holders:?}"))
        }
    })?;
    eventually("the policy's status to name the holder", SETTLE, || {
        let status = run
            .get("egresspolicy", Some(TEAM_A), "web")
            .map(|o| PolicyStatus::of(&o))
            .map_err(|e| format!("{e:#}"))?;
        if status.node.as_deref() == Some(holders[0].as_str()) {
            Ok(())
        } else {
            Err(format!("{} holds {eip}; status: {status}", holders[0]))
        }
    })?;
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))?;
    eventually(&format!("doctor to pass on {holder}"), SETTLE, || {
        super::doctor::passes(run.lab, &holder)
    })?;
    let back = down_at.elapsed();
    let samples = prober.finish();
    let leaked: Vec<String> = samples
        .iter()
        .filter(|s| s.at >= down_at)
        .filter_map(|s| match &s.seen {
            Seen::Source(ip) if *ip != eip => Some(format!(
                "{:.1} s: {ip}",
                s.at.duration_since(down_at).as_secs_f64()
            )),
            _ => None,
        })
        .collect();
    ensure!(
        leaked.is_empty(),
        "web-3's traffic left with another source while {holder} rebooted: {}",
        leaked.join("; ")
    );
    let unanswered = samples
        .iter()
        .filter(|s| s.at >= down_at && !s.seen.is(&Expect::Source(eip.into())))
        .count();
    run.note(format!(
        "{holder} held {eip}, was wiped and its agent restarted; {} holds it now; \
         {} probes of web-3 after the wipe, {unanswered} unanswered, none from another \
         source; all back in {:.1} s",
        holders[0],
        samples.iter().filter(|s| s.at >= down_at).count(),
        back.as_secs_f64()
    ));
    Ok(())
}

/// The agents hold EIPs where the controller published them, and nowhere
/// before it did: with the controllers frozen, a new policy's EIP is held
/// by no node; a status written by hand (as a controller of another version
/// might write it) that puts the EIP on the second gateway node, where this
/// controller would not (it picks the least loaded node, then by name),
/// is followed: that node holds the EIP and web-1..3 leave with it. Thawed,
/// the controller keeps it there.
pub fn agents_hold_eips_where_the_controller_published_them(run: &mut Run) -> anyhow::Result<()> {
    const GATEWAY: &str = "e2e-published";
    // Frozen before the gateway exists, so that no controller publishes
    // its Pods: a policy made while none runs has its Pods in no slice,
    // and a gateway node reading slices drops their traffic by design.
    // Unpublished, the gateway nodes' agents read every Pod.
    run.freeze_controllers(true)?;
    let eip = setup_gateway(run, GATEWAY)?;
    let (_, second) = run.two_gateway_nodes()?;
    let second = &second;
    run.apply(&policy(
        TEAM_A,
        "web",
        GATEWAY,
        &app("web"),
        &["198.51.100.0/24"],
    ))?;
    std::thread::sleep(Duration::from_secs(3));
    let early = eip_holders(run.lab, eip)?;
    ensure!(
        early.is_empty(),
        "{early:?} took {eip} before any controller published a node for it"
    );
    let published = serde_json::json!({ "status": { "nodeList": [{
        "name": second,
        "status": "Ready",
        "eips": [{ "ipv4": eip.to_string() }],
    }] } });
    run.lab.kubectl.run(&[
        "patch",
        "egressgateway",
        GATEWAY,
        "--subresource=status",
        "--type=merge",
        "-p",
        &published.to_string(),
    ])?;
    let status = serde_json::json!({ "status": {
        "eip": { "ipv4": eip.to_string() },
        "node": second,
    } });
    run.lab.kubectl.run(&[
        "patch",
        "egresspolicy",
        "web",
        "--namespace",
        TEAM_A,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status.to_string(),
    ])?;
    let holders = |run: &Run| eip_holders(run.lab, eip).map_err(|e| format!("{e:#}"));
    eventually(&format!("{second} to hold {eip}"), SETTLE, || {
        let now = holders(run)?;
        if now == [second.clone()] {
            Ok(())
        } else {
            Err(format!("held by {now:?}"))
        }
    })?;
    run.expect_all(&["web-1", "web-2", "web-3"], Expect::Source(eip.into()))?;
    run.freeze_controllers(false)?;
    let status = run.wait_policy_ready("egresspolicy", Some(TEAM_A), "web")?;
    ensure!(
        status.node.as_deref() == Some(second.as_str()),
        "the thawed controller moved the policy: {status}"
    );
    let now = eip_holders(run.lab, eip)?;
    ensure!(
        now == [second.clone()],
        "{eip} is held by {now:?} once the controller runs again"
    );
    run.note(format!(
        "no node held {eip} while nothing published it; {second} held it once the status \
         said so, and kept it under the thawed controller"
    ));
    Ok(())
}

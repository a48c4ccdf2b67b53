//! The scenarios: each works through the API only (kubectl) and checks the
//! result with real traffic from pod namespaces to the target, which tells
//! the source address it saw. See docs/e2e.md for what each one proves.

use std::net::Ipv4Addr;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use super::objects::{app, cluster_policy, gateway, policy};
use super::run::{PolicyStatus, Run, SETTLE, eip_holders, eventually, wait_log_line};
use super::traffic::{self, Expect, IperfRun, Prober, Sample};
use super::{failover, install, tenancy};

/// One scenario: its name (a sentence) and its body.
pub type Scenario = (&'static str, fn(&mut Run) -> anyhow::Result<()>);

/// Every scenario, in the order they run.
pub const ALL: [Scenario; 37] = [
    (
        "chart_is_lint_clean_and_bad_values_change_nothing",
        install::chart_is_lint_clean_and_bad_values_change_nothing,
    ),
    (
        "agent_token_may_write_only_its_own_nodes_objects",
        install::agent_token_may_write_only_its_own_nodes_objects,
    ),
    (
        "policy_gives_web_pods_on_every_node_the_eip",
        policy_gives_web_pods_on_every_node_the_eip,
    ),
    (
        "changing_dest_subnet_takes_effect",
        changing_dest_subnet_takes_effect,
    ),
    (
        "deleting_the_policy_lets_traffic_leave_the_normal_way",
        deleting_the_policy_lets_traffic_leave_the_normal_way,
    ),
    (
        "namespace_policy_never_touches_another_namespaces_pods",
        namespace_policy_never_touches_another_namespaces_pods,
    ),
    (
        "cluster_policy_covers_the_selected_namespaces_only",
        cluster_policy_covers_the_selected_namespaces_only,
    ),
    (
        "overlapping_policies_resolve_by_prefix_then_priority",
        overlapping_policies_resolve_by_prefix_then_priority,
    ),
    (
        "invalid_objects_are_rejected_naming_the_field",
        invalid_objects_are_rejected_naming_the_field,
    ),
    (
        "a_namespace_cannot_take_another_namespaces_eip_or_an_unadmitted_gateway",
        tenancy::a_namespace_cannot_take_another_namespaces_eip_or_an_unadmitted_gateway,
    ),
    (
        "an_undecodable_stored_policy_is_reported_and_stops_no_other",
        tenancy::an_undecodable_stored_policy_is_reported_and_stops_no_other,
    ),
    (
        "new_pod_matching_a_policy_is_covered",
        new_pod_matching_a_policy_is_covered,
    ),
    (
        "only_nodes_a_gateway_selects_watch_its_pods",
        super::scope::only_nodes_a_gateway_selects_watch_its_pods,
    ),
    (
        "metrics_count_a_policys_traffic_and_every_daemon_serves_them",
        super::metrics::metrics_count_a_policys_traffic_and_every_daemon_serves_them,
    ),
    (
        "doctor_passes_on_a_healthy_node_and_names_what_is_broken",
        super::doctor::doctor_passes_on_a_healthy_node_and_names_what_is_broken,
    ),
    (
        "killed_agent_keeps_traffic_flowing_and_restarts_without_changes",
        killed_agent_keeps_traffic_flowing_and_restarts_without_changes,
    ),
    (
        "agent_restarts_move_no_eip_and_lose_no_traffic",
        install::agent_restarts_move_no_eip_and_lose_no_traffic,
    ),
    (
        "upgrades_toggle_checksum_offload_and_the_datapath_and_traffic_keeps_the_eip",
        install::upgrades_toggle_checksum_offload_and_the_datapath_and_traffic_keeps_the_eip,
    ),
    (
        "failover_moves_the_eip_to_the_other_gateway_node",
        failover_moves_the_eip_to_the_other_gateway_node,
    ),
    // Dual-stack labs only (`--ipv6`); see `needs_dual_stack`.
    (
        "ipv6_eips_take_pods_out_and_replies_come_back_through_the_tunnel",
        super::ipv6::ipv6_eips_take_pods_out_and_replies_come_back_through_the_tunnel,
    ),
    (
        "ipv6_eip_failover_is_announced_to_the_segment",
        super::ipv6::ipv6_eip_failover_is_announced_to_the_segment,
    ),
    (
        "killed_gateway_agent_moves_nothing_and_loses_nothing",
        failover::killed_gateway_agent_moves_nothing_and_loses_nothing,
    ),
    (
        "failover_after_links_down_is_back_within_a_second",
        failover::failover_after_links_down_is_back_within_a_second,
    ),
    (
        "failover_works_with_the_apiserver_and_controller_frozen",
        failover::failover_works_with_the_apiserver_and_controller_frozen,
    ),
    (
        "failover_of_a_gateway_cut_off_from_its_peers_never_holds_the_eip_twice",
        failover::failover_of_a_gateway_cut_off_from_its_peers_never_holds_the_eip_twice,
    ),
    (
        "a_gateway_without_a_snat_entry_drops_instead_of_leaking_the_node_address",
        failover::a_gateway_without_a_snat_entry_drops_instead_of_leaking_the_node_address,
    ),
    (
        "a_pool_address_in_use_on_the_segment_is_refused",
        failover::a_pool_address_in_use_on_the_segment_is_refused,
    ),
    (
        "fail_closed_drops_what_has_no_live_gateway_and_fail_open_says_so",
        failover::fail_closed_drops_what_has_no_live_gateway_and_fail_open_says_so,
    ),
    (
        "churn_ends_with_every_node_as_planned",
        super::churn::churn_ends_with_every_node_as_planned,
    ),
    (
        "agents_hold_eips_where_the_controller_published_them",
        super::faults::agents_hold_eips_where_the_controller_published_them,
    ),
    (
        "killed_controllers_change_no_allocation_and_no_source",
        super::faults::killed_controllers_change_no_allocation_and_no_source,
    ),
    (
        "a_rebooted_eip_holder_comes_back_and_nothing_leaves_with_another_source",
        super::faults::a_rebooted_eip_holder_comes_back_and_nothing_leaves_with_another_source,
    ),
    (
        "etcd_restarted_changes_no_allocation_and_no_source",
        super::faults::etcd_restarted_changes_no_allocation_and_no_source,
    ),
    (
        "apiserver_outage_changes_no_source_and_moves_no_eip",
        failover::apiserver_outage_changes_no_source_and_moves_no_eip,
    ),
    // The last three: the bench, the uninstall (egressgw is gone
    // afterwards) and the upgrade, which installs it again.
    (
        "smoke_bench_measures_every_case_and_case_3_leaves_with_the_eip",
        super::bench::smoke_bench_measures_every_case_and_case_3_leaves_with_the_eip,
    ),
    (
        "helm_uninstall_leaves_every_node_as_it_was",
        install::helm_uninstall_leaves_every_node_as_it_was,
    ),
    // On the cluster the uninstall left: the previous release, then this build.
    (
        super::upgrade::SCENARIO,
        super::upgrade::upgrade_from_the_previous_release_moves_no_eip_and_changes_no_source,
    ),
];

/// Whether the scenario `name` needs a dual-stack lab: those of IPv6
/// (named `ipv6_...`) are left out on an IPv4 lab.
pub fn needs_dual_stack(name: &str) -> bool {
    name.starts_with("ipv6_")
}

/// The external segment, where the target lives.
pub(super) const TARGET_NET: &str = "198.51.100.0/24";
/// A network no lab host is in.
const ELSEWHERE: &str = "203.0.113.0/24";
pub(super) const TEAM_A: &str = "team-a";
pub(super) const WEB: [&str; 3] = ["web-1", "web-2", "web-3"];
const BATCH: [&str; 3] = ["batch-1", "batch-2", "batch-3"];
pub(super) const POLICY: &str = "egresspolicy";
const CLUSTER_POLICY: &str = "egressclusterpolicy";

/// Applies a gateway named `name` over the run's pool, whose first address
/// is the default EIP; returns that address.
pub(super) fn setup_gateway(run: &mut Run, name: &str) -> anyhow::Result<Ipv4Addr> {
    let eip = *run.pool.first().context("the run has no pool")?;
    let object = gateway(name, &run.pool_range(), eip);
    run.apply(&object)?;
    Ok(eip)
}

/// A team-a policy `web` for app=web pods to the target's network; waits
/// until it is Ready and returns its status.
pub(super) fn setup_web_policy(run: &mut Run, gw: &str) -> anyhow::Result<PolicyStatus> {
    run.apply(&policy(TEAM_A, "web", gw, &app("web"), &[TARGET_NET]))?;
    run.wait_policy_ready(POLICY, Some(TEAM_A), "web")
}

fn gateway_nodes(run: &Run) -> Vec<String> {
    let nodes = &run.lab.state.topology.nodes;
    nodes
        .iter()
        .filter(|n| n.gateway)
        .map(|n| n.name.clone())
        .collect()
}

fn policy_gives_web_pods_on_every_node_the_eip(run: &mut Run) -> anyhow::Result<()> {
    // Before: web-1 leaves from its node's address, web-3 cannot leave at all.
    run.expect_normal(&["web-1", "web-3"])?;
    let eip = setup_gateway(run, "e2e-basic")?;
    let status = setup_web_policy(run, "e2e-basic")?;
    ensure!(
        status.eip == Some(eip),
        "status.eip.ipv4 is {:?}, not the gateway's default EIP {eip}",
        status.eip
    );
    let node = status.node.clone().unwrap_or_default();
    ensure!(
        gateway_nodes(run).contains(&node),
        "status.node is {node:?}, not a gateway node ({:?})",
        gateway_nodes(run)
    );
    run.expect_all(&WEB, Expect::Source(eip.into()))?;
    run.note(format!(
        "team-a/web: {status}; web-1, web-2, web-3 seen as {eip}"
    ));
    let tunnels = tunnel_phases(run)?;
    ensure!(
        tunnels.len() == run.lab.state.topology.nodes.len()
            && tunnels.iter().all(|(_, phase, _)| phase == "Ready"),
        "EgressTunnels: {tunnels:?}, wanted one per node, each Ready"
    );
    let datapath = install::expected_datapath(run.lab)?;
    ensure!(
        tunnels.iter().all(|(_, _, d)| *d == datapath),
        "EgressTunnels: {tunnels:?}, wanted every node on the {datapath} datapath"
    );
    run.note(format!("every node reports the {datapath} datapath"));
    Ok(())
}

/// `status.phase` of the EgressTunnel of `node` (`-` when it has none).
fn tunnel_phase(run: &Run, node: &str) -> anyhow::Result<String> {
    let tunnel = run.get("egresstunnel", None, node)?;
    Ok(tunnel["status"]["phase"].as_str().unwrap_or("-").to_owned())
}

/// Waits until the EgressTunnel of `node` is in `phase`.
fn wait_tunnel_phase(run: &Run, node: &str, phase: &str) -> anyhow::Result<()> {
    eventually(
        &format!("EgressTunnel {node} to be {phase}"),
        SETTLE,
        || match tunnel_phase(run, node) {
            Ok(seen) if seen == phase => Ok(()),
            Ok(seen) => Err(format!("phase {seen}")),
            Err(e) => Err(format!("{e:#}")),
        },
    )
}

/// (name, status.phase) of every EgressTunnel.
/// Each EgressTunnel's name, phase and datapath.
fn tunnel_phases(run: &Run) -> anyhow::Result<Vec<(String, String, String)>> {
    let text = run
        .lab
        .kubectl
        .run(&["get", "egresstunnels", "-o", "json"])?;
    let list: Value = serde_json::from_str(&text).context("parsing the EgressTunnel list")?;
    let items = list["items"].as_array().cloned().unwrap_or_default();
    Ok(items
        .iter()
        .map(|t| {
            let name = t["metadata"]["name"].as_str().unwrap_or_default();
            let phase = t["status"]["phase"].as_str().unwrap_or("-");
            let datapath = t["status"]["datapath"]["name"].as_str().unwrap_or("-");
            (name.to_owned(), phase.to_owned(), datapath.to_owned())
        })
        .collect())
}

fn changing_dest_subnet_takes_effect(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-dest")?;
    setup_web_policy(run, "e2e-dest")?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))?;

    let mut elsewhere = policy(TEAM_A, "web", "e2e-dest", &app("web"), &[ELSEWHERE]);
    run.apply(&elsewhere)?;
    run.expect_normal(&["web-1", "web-3"])
        .context("after destSubnet changed to a network without the target")?;

    elsewhere["spec"]["destSubnet"] = json!([TARGET_NET]);
    run.apply(&elsewhere)?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))
        .context("after destSubnet changed back to the target's network")
}

fn deleting_the_policy_lets_traffic_leave_the_normal_way(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-delete")?;
    setup_web_policy(run, "e2e-delete")?;
    run.expect_all(&WEB, Expect::Source(eip.into()))?;
    run.delete(POLICY, Some(TEAM_A), "web")?;
    run.expect_normal(&WEB)
        .context("after the policy was deleted")
}

fn namespace_policy_never_touches_another_namespaces_pods(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-ns")?;
    // Every pod address of the cluster, team-b's included: only the
    // policy's own namespace may be steered all the same.
    let all_pods = json!({ "podSubnet": ["10.244.0.0/16"] });
    run.apply(&policy(
        TEAM_A,
        "everything",
        "e2e-ns",
        &all_pods,
        &[TARGET_NET],
    ))?;
    run.wait_policy_ready(POLICY, Some(TEAM_A), "everything")?;
    run.expect_all(&WEB, Expect::Source(eip.into()))?;
    run.expect_normal(&BATCH)?;
    run.expect_steady("batch-1", run.normal_way("batch-1")?, 5)
}

fn cluster_policy_covers_the_selected_namespaces_only(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-cluster")?;
    let team_b = json!({
        "namespaceSelector": { "matchLabels": { "team": "b" } },
        "podSelector": {},
    });
    run.apply(&cluster_policy(
        "e2e-team-b",
        "e2e-cluster",
        &team_b,
        &[TARGET_NET],
    ))?;
    let status = run.wait_policy_ready(CLUSTER_POLICY, None, "e2e-team-b")?;
    run.expect_all(&BATCH, Expect::Source(eip.into()))?;
    run.expect_normal(&WEB)?;
    run.note(format!(
        "e2e-team-b: {status}; batch pods seen as {eip}, web pods the normal way"
    ));
    Ok(())
}

fn overlapping_policies_resolve_by_prefix_then_priority(run: &mut Run) -> anyhow::Result<()> {
    let default_eip = setup_gateway(run, "e2e-prec")?;
    let pinned = *run.pool.last().context("the run has no pool")?;
    let mut wide = policy(TEAM_A, "wide", "e2e-prec", &app("web"), &[TARGET_NET]);
    wide["spec"]["egressIP"] = json!({ "allocatorPolicy": "rr" });
    let mut narrow = policy(
        TEAM_A,
        "narrow",
        "e2e-prec",
        &app("web"),
        &["198.51.100.0/25"],
    );
    narrow["spec"]["egressIP"] = json!({ "ipv4": pinned.to_string() });
    run.apply(&wide)?;
    run.apply(&narrow)?;
    let wide_eip = run.wait_policy_ready(POLICY, Some(TEAM_A), "wide")?.eip;
    let narrow_eip = run.wait_policy_ready(POLICY, Some(TEAM_A), "narrow")?.eip;
    let wide_eip = wide_eip.context("wide has no EIP")?;
    ensure!(
        narrow_eip == Some(pinned),
        "narrow pins {pinned} but its status says {narrow_eip:?}"
    );
    ensure!(
        wide_eip != pinned && wide_eip != default_eip,
        "wide (rr) got {wide_eip}, which is the default or the pinned EIP"
    );
    let pods = ["web-1", "web-3"];

    // The more specific destination wins, whatever the priorities.
    wide["spec"]["priority"] = json!(10);
    run.apply(&wide)?;
    run.expect_all(&pods, Expect::Source(pinned.into()))
        .context("/25 (priority 0) against /24 (priority 10): the /25 should win")?;

    // Equal prefixes: the higher priority wins.
    narrow["spec"]["destSubnet"] = json!([TARGET_NET]);
    run.apply(&narrow)?;
    run.expect_all(&pods, Expect::Source(wide_eip.into()))
        .context("two /24s, priorities 10 (wide) and 0 (narrow): wide should win")?;
    narrow["spec"]["priority"] = json!(20);
    run.apply(&narrow)?;
    run.expect_all(&pods, Expect::Source(pinned.into()))
        .context("two /24s, priorities 10 (wide) and 20 (narrow): narrow should win")?;
    run.note(format!(
        "wide (rr) {wide_eip}, narrow (pinned) {pinned}: /25 beat /24, then priority 10 beat 0, then 20 beat 10"
    ));
    Ok(())
}

fn invalid_objects_are_rejected_naming_the_field(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-valid")?;
    setup_web_policy(run, "e2e-valid")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(200),
        Duration::from_secs(60),
    );

    let mut bad_dest = policy(
        TEAM_A,
        "bad-dest",
        "e2e-valid",
        &app("web"),
        &["198.51.100.0/33"],
    );
    expect_rejected(run, &bad_dest, "spec.destSubnet")?;
    bad_dest["spec"]["destSubnet"] = json!(["not-a-cidr"]);
    expect_rejected(run, &bad_dest, "spec.destSubnet")?;
    let (first, last) = (run.pool[0], run.pool[run.pool.len() - 1]);
    let reversed = gateway("e2e-reversed", &format!("{last}-{first}"), first);
    expect_rejected(run, &reversed, "spec.ippools.ipv4")?;
    let both = json!({
        "podSelector": { "matchLabels": { "app": "web" } },
        "podSubnet": ["10.244.0.0/16"],
    });
    let both = policy(TEAM_A, "bad-applied-to", "e2e-valid", &both, &[TARGET_NET]);
    expect_rejected(run, &both, "spec.appliedTo")?;
    let mut moved = policy(TEAM_A, "web", "e2e-other", &app("web"), &[TARGET_NET]);
    moved["spec"]["egressGatewayName"] = json!("e2e-other");
    expect_rejected(run, &moved, "spec.egressGatewayName")?;

    // An integer beyond its bounds and labels Kubernetes would refuse, in
    // each kind of selector: refused at admission rather than stored as an
    // object the daemons cannot decode or a selector that matches nothing.
    let mut huge = policy(
        TEAM_A,
        "bad-priority",
        "e2e-valid",
        &app("web"),
        &[TARGET_NET],
    );
    huge["spec"]["priority"] = json!(99_999_999_999_i64);
    expect_rejected(run, &huge, "spec.priority")?;
    let bad_labels = json!({ "matchLabels": { "app web!": "x/y/z" } });
    let bad_pods = json!({ "podSelector": bad_labels });
    let bad_pods = policy(TEAM_A, "bad-labels", "e2e-valid", &bad_pods, &[TARGET_NET]);
    expect_rejected(run, &bad_pods, "spec.appliedTo.podSelector.matchLabels")?;
    let bad_namespaces = json!({
        "podSelector": {},
        "namespaceSelector": {
            "matchExpressions": [{ "key": "team a", "operator": "In", "values": ["b"] }],
        },
    });
    let bad_namespaces = cluster_policy(
        "e2e-bad-labels",
        "e2e-valid",
        &bad_namespaces,
        &[TARGET_NET],
    );
    expect_rejected(
        run,
        &bad_namespaces,
        "spec.appliedTo.namespaceSelector.matchExpressions[0].key",
    )?;
    let mut bad_nodes = gateway("e2e-bad-labels", &run.pool_range(), eip);
    bad_nodes["spec"]["nodeSelector"]["selector"] = bad_labels;
    expect_rejected(run, &bad_nodes, "spec.nodeSelector.selector.matchLabels")?;

    // Valid for the API, but its gateway does not exist.
    run.apply(&policy(
        TEAM_A,
        "orphan",
        "e2e-missing",
        &app("web"),
        &[TARGET_NET],
    ))?;
    run.wait_reason(POLICY, Some(TEAM_A), "orphan", "GatewayNotFound")?;

    let samples = prober.finish();
    let wrong: Vec<&Sample> = samples
        .iter()
        .filter(|s| !s.seen.is(&Expect::Source(eip.into())))
        .collect();
    ensure!(
        wrong.is_empty() && !samples.is_empty(),
        "web-3's traffic was disturbed: {} of {} probes did not see {eip} (first: {})",
        wrong.len(),
        samples.len(),
        wrong
            .first()
            .map_or("none".to_owned(), |s| s.seen.to_string())
    );
    run.note(format!(
        "9 objects rejected; web-3 saw {eip} in all {} probes meanwhile",
        samples.len()
    ));
    Ok(())
}

/// Applies `object`, which the API server must refuse with a message naming `field`.
fn expect_rejected(run: &mut Run, object: &Value, field: &str) -> anyhow::Result<()> {
    let message = run.apply_rejected(object)?;
    ensure!(
        message.contains(field),
        "the API server refused the object, but its message does not name {field}: {message}"
    );
    Ok(())
}

fn new_pod_matching_a_policy_is_covered(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-newpod")?;
    setup_web_policy(run, "e2e-newpod")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;
    run.add_pod("web-e2e", TEAM_A, "node-3", "app=web")?;
    run.add_pod("other-e2e", TEAM_A, "node-3", "app=other")?;
    run.expect_sources(&[
        ("web-e2e", Expect::Source(eip.into())),
        ("other-e2e", Expect::NoAnswer),
    ])
}

fn killed_agent_keeps_traffic_flowing_and_restarts_without_changes(
    run: &mut Run,
) -> anyhow::Result<()> {
    let node = "node-3";
    let eip = setup_gateway(run, "e2e-kill")?;
    setup_web_policy(run, "e2e-kill")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;

    let iperf = IperfRun::start(&run.netns("web-3")?, run.iperf3_target(), 6)?;
    thread::sleep(Duration::from_millis(1500));
    let pid = run.kill_agent(node)?;
    let result = iperf
        .finish()
        .context("iperf3 from web-3 while its node's agent was killed")?;
    ensure!(
        result.bytes_received > 0,
        "iperf3 moved no bytes: {result:?}"
    );
    // The agent is not on the packets' way: no interval goes without
    // traffic while it dies.
    let stalled: Vec<usize> = (result.interval_bytes.iter().enumerate())
        .filter(|(_, b)| **b == 0)
        .map(|(i, _)| i)
        .collect();
    ensure!(
        result.interval_bytes.len() >= 50 && stalled.is_empty(),
        "iperf3 intervals of {} s with no bytes sent: {stalled:?} of {}",
        traffic::INTERVAL,
        result.interval_bytes.len()
    );
    let (slowest, median) = result
        .interval_mbit_per_s()
        .context("iperf3 reported no intervals")?;
    run.note(format!(
        "iperf3 web-3 -> target through the gateway, agent of {node} (pid {pid}) SIGKILLed after 1.5 s: \
         {:.0} Mbit/s over {:.1} s, {} retransmits; {} intervals of {} s, slowest {slowest:.0} Mbit/s, \
         median {median:.0} Mbit/s",
        result.mbit_per_s(),
        result.seconds,
        result.retransmits,
        result.interval_bytes.len(),
        traffic::INTERVAL,
    ));

    // The cluster noticed the dead agent while the transfer went on.
    wait_tunnel_phase(run, node, "HeartbeatTimeout")
        .context("the controller should mark the killed agent's node")?;

    let (log, offset) = run.start_agent(node)?;
    let line = wait_log_line(&log, offset, "reconciled applied=", SETTLE)?;
    let (applied, failed) =
        reconcile_counts(&line).with_context(|| format!("reading the counts of {line:?}"))?;
    ensure!(
        applied == 0 && failed == 0,
        "the restarted agent's first reconcile changed the kernel: {line}"
    );
    run.note(format!(
        "{node} was HeartbeatTimeout meanwhile; the restarted agent's first reconcile: \
         applied={applied} failed={failed}"
    ));
    wait_tunnel_phase(run, node, "Ready").context("after the agent was restarted")?;
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)
}

/// `N` and `M` of a line with `reconciled applied=N failed=M`.
fn reconcile_counts(line: &str) -> Option<(u64, u64)> {
    let rest = &line[line.find("reconciled applied=")? + "reconciled applied=".len()..];
    let applied = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let failed_at = rest.find("failed=")? + "failed=".len();
    let failed = rest[failed_at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    Some((applied, failed))
}

fn failover_moves_the_eip_to_the_other_gateway_node(run: &mut Run) -> anyhow::Result<()> {
    let eip = setup_gateway(run, "e2e-failover")?;
    let status = setup_web_policy(run, "e2e-failover")?;
    let from = status.node.context("the policy has no node")?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;

    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(90),
    );
    let down_at = Instant::now();
    run.node_links(&from, false)?;
    let to = eventually("the policy to move to another node", SETTLE, || {
        let status = run
            .get(POLICY, Some(TEAM_A), "web")
            .map(|o| PolicyStatus::of(&o))
            .map_err(|e| format!("{e:#}"))?;
        match &status.node {
            Some(node) if *node != from => Ok(node.clone()),
            _ => Err(format!("status: {status}")),
        }
    })?;
    let back = eventually("web-3's traffic to come back with the EIP", SETTLE, || {
        failover::back_after(&prober.samples(), down_at, eip)
            .ok_or_else(|| summary(&prober.samples(), down_at))
    })?;
    let samples = prober.finish();
    let lost = samples
        .iter()
        .filter(|s| {
            s.at >= down_at && s.at < down_at + back && !s.seen.is(&Expect::Source(eip.into()))
        })
        .count();
    let total = samples.iter().filter(|s| s.at >= down_at).count();
    run.note(format!(
        "failover: EIP {eip} moved {from} -> {to}, traffic back after {:.1} s \
         ({lost} of {total} probes unanswered)",
        back.as_secs_f64()
    ));

    let up_at = Instant::now();
    run.node_links(&from, true)?;
    let holders = eventually("exactly one node to hold the EIP", SETTLE, || {
        let holders = eip_holders(run.lab, eip).map_err(|e| format!("{e:#}"))?;
        if holders.len() == 1 {
            Ok(holders)
        } else {
            Err(format!("held by {holders:?}"))
        }
    })?;
    let single_after = up_at.elapsed();
    // Settled: the old node's agent is back in touch; the EIP must still be
    // held once, where the status says, and the target must reach it there.
    wait_tunnel_phase(run, &from, "Ready").context("after the node came back")?;
    let holders_now = eip_holders(run.lab, eip)?;
    ensure!(
        holders_now == holders,
        "{eip} was held by {holders:?}, then by {holders_now:?} once {from}'s agent was back"
    );
    let status = PolicyStatus::of(&run.get(POLICY, Some(TEAM_A), "web")?);
    ensure!(
        status.node.as_deref() == Some(holders[0].as_str()),
        "{} holds {eip}, but the policy's status says {status}",
        holders[0]
    );
    run.expect_steady("web-3", Expect::Source(eip.into()), 5)?;
    let (target_mac, holder_mac) = neighbour_macs(run, eip, &holders[0])?;
    ensure!(
        target_mac == holder_mac,
        "the target reaches {eip} at {target_mac}, but its holder {}'s external link is {holder_mac}",
        holders[0]
    );
    run.note(format!(
        "{from} back up: {eip} held by {} alone ({:.1} s after), status.node agrees, \
         the target's ARP entry points at it, web-3 still seen as {eip}",
        holders[0],
        single_after.as_secs_f64()
    ));
    Ok(())
}

/// The MAC address the target's neighbour table has for `eip`, and the MAC
/// of `holder`'s external link.
pub(super) fn neighbour_macs(
    run: &Run,
    eip: impl Into<std::net::IpAddr>,
    holder: &str,
) -> anyhow::Result<(String, String)> {
    let eip = eip.into();
    let target = &run.lab.state.topology.target.netns;
    let node = run.lab.node(holder)?;
    let ext = node
        .external
        .as_ref()
        .context("the holder has no external link")?;
    let neigh = crate::lab::cmd::run(
        "ip",
        &["-n", target.as_str(), "neigh", "show", &eip.to_string()],
    )?;
    let target_mac = word_after(&neigh, "lladdr")
        .with_context(|| format!("the target has no neighbour entry for {eip}: {neigh:?}"))?;
    let link = crate::lab::cmd::run(
        "ip",
        &["-n", node.netns.as_str(), "link", "show", &ext.interface],
    )?;
    let holder_mac =
        word_after(&link, "link/ether").with_context(|| format!("no MAC in {link:?}"))?;
    Ok((target_mac, holder_mac))
}

/// The word following `key` in `text`.
fn word_after(text: &str, key: &str) -> Option<String> {
    let mut words = text.split_whitespace();
    words.find(|w| *w == key)?;
    words.next().map(str::to_owned)
}

/// What the prober saw since `since`, for a failure message.
fn summary(samples: &[Sample], since: Instant) -> String {
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at >= since).collect();
    match after.last() {
        None => "no probe yet".to_owned(),
        Some(last) => format!(
            "{} probes since the node went down, the last saw {} (took {} ms)",
            after.len(),
            last.seen,
            last.took.as_millis()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_counts_are_read_from_the_agents_line() {
        let line = "2026-11-02T10:00:00Z  INFO reconcile: reconciled applied=0 failed=0 took=3ms";
        assert_eq!(reconcile_counts(line), Some((0, 0)));
        assert_eq!(
            reconcile_counts("reconciled applied=12 failed=3"),
            Some((12, 3))
        );
        assert_eq!(reconcile_counts("reconciled nothing"), None);
    }

    #[test]
    fn macs_are_read_from_ip_output() {
        let neigh = "198.51.100.236 dev egx-ext lladdr 6a:1f:00:aa:bb:cc REACHABLE\n";
        assert_eq!(
            word_after(neigh, "lladdr").as_deref(),
            Some("6a:1f:00:aa:bb:cc")
        );
        let link = "5: eth1@if9: <BROADCAST,UP> mtu 1500\n    link/ether 02:00:00:00:00:01 brd ff:ff:ff:ff:ff:ff";
        assert_eq!(
            word_after(link, "link/ether").as_deref(),
            Some("02:00:00:00:00:01")
        );
        assert_eq!(
            word_after("198.51.100.236 dev egx-ext FAILED", "lladdr"),
            None
        );
    }

    #[test]
    fn scenario_names_are_unique() {
        let mut names: Vec<&str> = ALL.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
    }
}

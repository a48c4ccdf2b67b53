//! The daemons' `/metrics`, scraped as Prometheus would: from the nodes'
//! network, at each agent's node address and each controller Pod's own.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, ensure};

use super::run::{Run, eip_holders, eventually};
use super::scenarios::{TEAM_A, setup_gateway, setup_web_policy};
use super::traffic::{Expect, IperfRun};
use crate::lab::egressgw::scrape_metrics;
use crate::lab::session::Lab;
use crate::lab::topology::Netns;

/// The controllers' health port (the chart's default).
const CONTROLLER_HEALTH_PORT: u16 = 9811;
const GATEWAY: &str = "e2e-metrics";

pub(super) use crate::lab::egressgw::scrape_agent;

/// The value of the sample `name{labels}` (labels as written, in order).
pub(super) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

fn policy_bytes(text: &str, namespace: &str, policy: &str, gateway: &str) -> Option<f64> {
    sample(
        text,
        &format!(
            "egressgw_policy_bytes_total{{namespace=\"{namespace}\",policy=\"{policy}\",gateway=\"{gateway}\"}}"
        ),
    )
}

/// Every agent and controller serves `/metrics`, each agent with its Lease
/// renewals in `egressgw_api_requests_total`; after an iperf3 run from
/// web-3 through policy team-a/web, node-3's agent counts at least the
/// bytes the target received in `egressgw_policy_bytes_total` (on either
/// datapath: the eBPF program's counters or the nftables table's) and reaches
/// the gateway (`egressgw_gateway_unreachable` 0); the node holding the
/// EIP says so in `egressgw_eips_held` and counted taking it; exactly one
/// controller leads, and it alone exports the policy's readiness (1), the
/// gateway's ready nodes (2) and the objects by readiness, and counts its
/// status writes and the EIP it allocated.
pub fn metrics_count_a_policys_traffic_and_every_daemon_serves_them(
    run: &mut Run,
) -> anyhow::Result<()> {
    let eip = setup_gateway(run, GATEWAY)?;
    setup_web_policy(run, GATEWAY)?;
    run.expect_all(&["web-3"], Expect::Source(eip.into()))?;

    let nodes: Vec<String> = run
        .lab
        .state
        .topology
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    for node in &nodes {
        let text = scrape_agent(run.lab, node)?;
        ensure!(
            sample(&text, "egressgw_reconciles_total{result=\"ok\"}").is_some_and(|n| n >= 1.0),
            "the agent of {node} reports no successful reconcile:\n{text}"
        );
        ensure!(
            sample(
                &text,
                "egressgw_api_requests_total{verb=\"patch\",result=\"ok\"}"
            )
            .is_some_and(|n| n >= 1.0),
            "the agent of {node} counts no successful write to the API server:\n{text}"
        );
    }
    let controllers = controllers(run.lab)?;
    let leading: Vec<&String> = controllers
        .iter()
        .filter(|text| sample(text, "egressgw_controller_leader") == Some(1.0))
        .collect();
    ensure!(
        leading.len() == 1,
        "{} of {} controllers say they lead (want exactly one)",
        leading.len(),
        controllers.len()
    );
    // The leader speaks for the objects; the others do not.
    let leader = leading[0];
    for (series, want) in [
        (
            "egressgw_policy_ready{namespace=\"team-a\",policy=\"web\"}",
            1.0,
        ),
        ("egressgw_gateway_ready_nodes{gateway=\"e2e-metrics\"}", 2.0),
    ] {
        ensure!(
            sample(leader, series) == Some(want),
            "the leading controller exports {series} = {:?}, want {want}",
            sample(leader, series)
        );
    }
    for series in [
        "egressgw_objects{kind=\"EgressPolicy\",condition=\"true\"}",
        "egressgw_objects{kind=\"EgressGateway\",condition=\"true\"}",
        "egressgw_objects{kind=\"EgressTunnel\",condition=\"true\"}",
        "egressgw_allocations_total{kind=\"eip\",result=\"ok\"}",
        "egressgw_api_requests_total{verb=\"patch\",result=\"ok\"}",
    ] {
        ensure!(
            sample(leader, series).is_some_and(|n| n >= 1.0),
            "the leading controller exports {series} = {:?}, want at least 1",
            sample(leader, series)
        );
    }
    for family in ["egressgw_policy_ready{", "egressgw_objects{"] {
        ensure!(
            controllers
                .iter()
                .filter(|text| text.contains(family))
                .count()
                == 1,
            "more than one controller exports {family}..}}"
        );
    }

    let tunnel = run.get("egresstunnel", None, "node-3")?;
    let datapath = tunnel["status"]["datapath"]["name"]
        .as_str()
        .unwrap_or("?")
        .to_owned();
    let before = policy_bytes(&scrape_agent(run.lab, "node-3")?, TEAM_A, "web", GATEWAY);
    let iperf = IperfRun::start(&run.netns("web-3")?, run.iperf3_target(), 2)?
        .finish()
        .context("iperf3 from web-3 through team-a/web")?;
    let sent = iperf.bytes_received as f64;
    let counted = {
        let before = before.unwrap_or(0.0);
        let lab = &*run.lab;
        let after = eventually(
            "node-3's egressgw_policy_bytes_total of team-a/web to rise by what iperf3 moved",
            Duration::from_secs(20),
            || {
                let text = scrape_agent(lab, "node-3").map_err(|e| format!("{e:#}"))?;
                let now = policy_bytes(&text, TEAM_A, "web", GATEWAY).ok_or("no such series")?;
                if now - before >= sent {
                    Ok(now)
                } else {
                    Err(format!(
                        "{now} (rose by {}, iperf3 moved {sent})",
                        now - before
                    ))
                }
            },
        )?;
        format!(
            "{datapath} datapath: team-a/web counted {:.0} bytes for {sent:.0} received",
            after - before
        )
    };

    let unreachable = format!("egressgw_gateway_unreachable{{gateway=\"{GATEWAY}\"}}");
    let text = scrape_agent(run.lab, "node-3")?;
    ensure!(
        sample(&text, &unreachable) == Some(0.0),
        "node-3 sends web-3's traffic through {GATEWAY}, yet exports {unreachable} = {:?}",
        sample(&text, &unreachable)
    );
    for holder in eip_holders(run.lab, eip)? {
        let text = scrape_agent(run.lab, &holder)?;
        ensure!(
            sample(&text, "egressgw_eips_held").is_some_and(|n| n >= 1.0),
            "{holder} holds {eip} but egressgw_eips_held says {:?}",
            sample(&text, "egressgw_eips_held")
        );
        let taken: f64 = ["planned", "failover"]
            .iter()
            .filter_map(|reason| {
                sample(
                    &text,
                    &format!("egressgw_eip_takeovers_total{{reason=\"{reason}\"}}"),
                )
            })
            .sum();
        ensure!(
            taken >= 1.0,
            "{holder} took {eip} in this scenario but egressgw_eip_takeovers_total says {taken}"
        );
    }
    run.note(format!(
        "{} agents and {} controllers scraped; {counted}",
        nodes.len(),
        controllers.len()
    ));
    Ok(())
}

/// Every controller Pod's metrics (scraped in its network namespace).
pub(super) fn controllers(lab: &Lab) -> anyhow::Result<Vec<String>> {
    let all = crate::lab::net::lab_netns(&lab.paths.prefix)?;
    let controllers: Vec<&Netns> = all
        .iter()
        .filter(|ns| ns.as_str().contains("egressgw-controller"))
        .collect();
    ensure!(
        !controllers.is_empty(),
        "no controller Pod's namespace in the lab"
    );
    controllers
        .into_iter()
        .map(|ns| {
            scrape_metrics(
                ns,
                SocketAddr::from(([127, 0, 0, 1], CONTROLLER_HEALTH_PORT)),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_found_by_their_whole_series() {
        let text = "# TYPE egressgw_policy_bytes counter\n\
            egressgw_policy_bytes_total{namespace=\"team-a\",policy=\"web\",gateway=\"gw\"} 1180\n\
            egressgw_policy_bytes_total{namespace=\"team-a\",policy=\"web2\",gateway=\"gw\"} 7\n\
            egressgw_eips_held 1\n# EOF\n";
        assert_eq!(policy_bytes(text, "team-a", "web", "gw"), Some(1180.0));
        assert_eq!(policy_bytes(text, "team-a", "we", "gw"), None);
        assert_eq!(sample(text, "egressgw_eips_held"), Some(1.0));
        assert_eq!(sample(text, "egressgw_eips"), None);
    }
}

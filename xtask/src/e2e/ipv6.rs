//! The scenarios of a dual-stack lab (`cargo xtask e2e --ipv6`): IPv6 EIPs
//! beside IPv4 ones, replies through the tunnel, and an IPv6 EIP's failover
//! announced to the segment with an unsolicited Neighbour Advertisement.
//! The other scenarios run on such a lab too, with their IPv4 objects.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::thread;
use std::time::Duration;

use anyhow::{Context, ensure};

use super::objects::{app, dual_stack_gateway, policy};
use super::run::{PolicyStatus, Run, SETTLE, eip_holders, eventually};
use super::scenarios::{POLICY, TARGET_NET, TEAM_A, WEB, neighbour_macs};
use super::traffic::{Expect, IperfRun};

/// The external segment's IPv6 prefix, where the target lives.
const TARGET6_NET: &str = crate::lab::topology::EXTERNAL6_CIDR;
/// How long the reverse iperf3 run through the tunnel lasts.
const IPERF_SECONDS: u32 = 2;
/// Less than any working tunnel carries in [`IPERF_SECONDS`]: more than
/// the agents' own probes over the same tunnel in that time.
const IPERF_MIN_BYTES: u64 = 1_000_000;

/// Applies a gateway named `name` over the run's pools of both families;
/// returns its default EIPs.
fn setup_dual_stack_gateway(run: &mut Run, name: &str) -> anyhow::Result<(Ipv4Addr, Ipv6Addr)> {
    let eip = *run.pool.first().context("the run has no pool")?;
    let eip6 = *run
        .pool6
        .first()
        .context("the run has no IPv6 pool: the lab is not dual-stack (`--ipv6`)")?;
    let object = dual_stack_gateway(name, (&run.pool_range(), eip), (&run.pool6_range(), eip6));
    run.apply(&object)?;
    Ok((eip, eip6))
}

/// team-a's `web` policy to `dest`; waits until it is Ready.
fn web_policy(run: &mut Run, gw: &str, dest: &[&str]) -> anyhow::Result<PolicyStatus> {
    run.apply(&policy(TEAM_A, "web", gw, &app("web"), dest))?;
    run.wait_policy_ready(POLICY, Some(TEAM_A), "web")
}

/// The bytes `node`'s `egress.vxlan` received and sent so far.
fn tunnel_bytes(run: &Run, node: &str) -> anyhow::Result<(u64, u64)> {
    let netns = &run.lab.node(node)?.netns;
    let out = crate::lab::cmd::run(
        "ip",
        &[
            "-n",
            netns.as_str(),
            "-s",
            "-j",
            "link",
            "show",
            "egress.vxlan",
        ],
    )?;
    let links: serde_json::Value =
        serde_json::from_str(&out).with_context(|| format!("`ip -j -s link` printed {out:?}"))?;
    let stats = &links[0]["stats64"];
    let bytes = |way: &str| {
        stats[way]["bytes"]
            .as_u64()
            .with_context(|| format!("no {way} bytes for {node}'s egress.vxlan in {out}"))
    };
    Ok((bytes("rx")?, bytes("tx")?))
}

pub(super) fn ipv6_eips_take_pods_out_and_replies_come_back_through_the_tunnel(
    run: &mut Run,
) -> anyhow::Result<()> {
    let target6 = run.target6()?;
    // Before: web-1 leaves from its node's IPv6 address, web-3 cannot leave.
    let before = [
        ("web-1", run.normal_way6("web-1")?),
        ("web-3", Expect::NoAnswer),
    ];
    run.expect_sources_at(target6, &before)?;

    let (eip, eip6) = setup_dual_stack_gateway(run, "e2e-ipv6")?;
    let status = web_policy(run, "e2e-ipv6", &[TARGET_NET, TARGET6_NET])?;
    ensure!(
        status.eip6 == Some(eip6),
        "status.eip.ipv6 is {:?}, not the gateway's IPv6 default EIP {eip6}",
        status.eip6
    );
    let web6: Vec<(&str, Expect)> = WEB
        .iter()
        .map(|&p| (p, Expect::Source(eip6.into())))
        .collect();
    run.expect_sources_at(target6, &web6)?;
    run.expect_all(&WEB, Expect::Source(eip.into()))?;
    // Not selected: the batch pods leave the normal way in both families.
    let batch6 = [
        ("batch-1", run.normal_way6("batch-1")?),
        ("batch-3", Expect::NoAnswer),
    ];
    run.expect_sources_at(target6, &batch6)?;
    run.expect_normal(&["batch-1", "batch-3"])?;
    run.note(format!(
        "team-a/web: {status}; web-1, web-2, web-3 seen as {eip6} over IPv6 and {eip} over IPv4"
    ));

    // The target sends to web-3 (iperf3 -R): node-3 has no way out of its
    // own, and what web-3 receives must have come in by its tunnel.
    let (rx_before, _) = tunnel_bytes(run, "node-3")?;
    let iperf = IperfRun::start_with(
        &run.netns("web-3")?,
        run.iperf3_target6()?,
        IPERF_SECONDS,
        true,
    )?
    .finish()
    .context("iperf3 -R from web-3 to the target's IPv6 address")?;
    let (rx_after, _) = tunnel_bytes(run, "node-3")?;
    let through_tunnel = rx_after.saturating_sub(rx_before);
    ensure!(
        iperf.bytes_received >= IPERF_MIN_BYTES,
        "web-3 received only {} bytes from the target over IPv6 in {IPERF_SECONDS} s",
        iperf.bytes_received
    );
    ensure!(
        through_tunnel >= iperf.bytes_received,
        "web-3 received {} bytes from the target, but node-3's egress.vxlan only {through_tunnel}: \
         the replies did not come back through the tunnel",
        iperf.bytes_received
    );
    run.note(format!(
        "iperf3 -R over IPv6 to web-3: {:.0} Mbit/s, {} bytes received, {through_tunnel} bytes in by node-3's egress.vxlan",
        iperf.mbit_per_s(),
        iperf.bytes_received
    ));

    // IPv4 destinations only: IPv6 traffic is no longer the policy's.
    web_policy(run, "e2e-ipv6", &[TARGET_NET])?;
    let after = [
        ("web-1", run.normal_way6("web-1")?),
        ("web-3", Expect::NoAnswer),
    ];
    run.expect_sources_at(target6, &after)?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))?;
    run.note("destSubnet IPv4 only: web-1 leaves the normal way over IPv6, web-3 not at all; IPv4 keeps the EIP");
    Ok(())
}

pub(super) fn ipv6_eip_failover_is_announced_to_the_segment(run: &mut Run) -> anyhow::Result<()> {
    let target6 = run.target6()?;
    let (_, eip6) = setup_dual_stack_gateway(run, "e2e-failover6")?;
    let status = web_policy(run, "e2e-failover6", &[TARGET6_NET])?;
    let from = status.node.context("the policy has no node")?;
    run.expect_sources_at(target6, &[("web-3", Expect::Source(eip6.into()))])?;
    // The target has talked to the EIP: its neighbour entry names the holder.
    let (before, holder_mac) = neighbour_macs(run, eip6, &from)?;
    ensure!(
        before == holder_mac,
        "the target reaches {eip6} at {before}, not at its holder {from}'s {holder_mac}"
    );

    // No traffic from here on: the target sends nothing to the EIP, so it
    // has no reason to solicit its address again. Only an unsolicited
    // advertisement from the new holder can change its entry.
    run.node_links(&from, false)?;
    let to = eventually("another node to hold the IPv6 EIP alone", SETTLE, || {
        let holders = eip_holders(run.lab, eip6).map_err(|e| format!("{e:#}"))?;
        match holders.as_slice() {
            [node] if *node != from => Ok(node.clone()),
            _ => Err(format!("held by {holders:?}")),
        }
    })?;
    let seen = eventually(
        "the target's neighbour entry to name the new holder",
        Duration::from_secs(5),
        || {
            let (seen, new_mac) = neighbour_macs(run, eip6, &to).map_err(|e| format!("{e:#}"))?;
            if seen == new_mac {
                Ok(seen)
            } else {
                Err(format!(
                    "the target has {eip6} at {seen}, {to}'s external link is {new_mac}"
                ))
            }
        },
    )?;
    ensure!(seen != before, "{to} and {from} share the MAC {seen}");
    // Give a late packet time to show up, then traffic flows through the new holder.
    thread::sleep(Duration::from_millis(100));
    run.expect_sources_at(target6, &[("web-3", Expect::Source(eip6.into()))])?;
    let status = PolicyStatus::of(&run.get(POLICY, Some(TEAM_A), "web")?);
    run.note(format!(
        "{eip6} moved {from} -> {to}; with no traffic, the target's neighbour entry went from \
         {before} to {seen} by the advertisement; web-3 seen as {eip6} again; status: {status}"
    ));
    Ok(())
}

//! Human-readable rendering of a plan.

use std::fmt::Write as _;

use egressgw_core::Plan;
use egressgw_core::model::InvalidObject;
use egressgw_core::state::{Action, NodeState, SnatTo, Vxlan};
use egressgw_core::status::{ClusterStatus, Condition};

/// Renders the given nodes' states, then the status of every object.
pub fn text(plan: &Plan, nodes: &[&NodeState], invalid: &[InvalidObject]) -> String {
    let mut out = String::new();
    for state in nodes {
        node(&mut out, state);
    }
    status(&mut out, &plan.status, invalid);
    out
}

fn node(out: &mut String, s: &NodeState) {
    let _ = writeln!(out, "node {}", s.node);
    match &s.vxlan {
        Some(v) => {
            let _ = writeln!(out, "  device     {}", vxlan(v));
        }
        None => {
            let _ = writeln!(
                out,
                "  device     none (no underlay address or tunnel identity yet)"
            );
        }
    }
    section(
        out,
        "peers",
        s.peers.iter().map(|p| {
            let tunnel = join(p.ipv4.map(|i| i.to_string()), p.ipv6.map(|i| i.to_string()));
            format!(
                "{:<16} underlay {:<15} mac {}  tunnel {tunnel}",
                p.node,
                p.underlay.to_string(),
                p.mac
            )
        }),
    );
    let rule_of = |table: u32| s.rules.iter().find(|rule| rule.table == table);
    section(
        out,
        "routes",
        s.routes.iter().map(|r| {
            let via = join(
                r.via_ipv4.map(|i| i.to_string()),
                r.via_ipv6.map(|i| i.to_string()),
            );
            let fwmark = rule_of(r.table)
                .map(|rule| format!("fwmark {:#010x}/{:#010x}", rule.mark, rule.mask))
                .unwrap_or_else(|| "no rule".to_owned());
            format!(
                "{fwmark} -> table {} (gateway {}): default via {via} dev egress.vxlan",
                r.table, r.gateway
            )
        }),
    );
    section(
        out,
        "replies",
        s.replies.iter().map(|r| {
            let fwmark = rule_of(r.table)
                .map(|rule| format!("fwmark {:#010x}/{:#010x}", rule.mark, rule.mask))
                .unwrap_or_else(|| "no rule".to_owned());
            format!(
                "{fwmark} -> table {}: {:<15} via {} dev egress.vxlan (pod on {})",
                r.table,
                r.dst.to_string(),
                r.via,
                r.origin
            )
        }),
    );
    let _ = writeln!(
        out,
        "  in-cluster {}",
        s.cluster_cidrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    section(
        out,
        "classify",
        s.classify.iter().map(|e| {
            let action = match &e.action {
                Action::Bypass => "leave normally".to_owned(),
                Action::Tunnel { gateway, mark } => {
                    format!("tunnel to {gateway} (mark {mark:#010x})")
                }
                Action::Local => "SNAT here (this node is the gateway)".to_owned(),
                Action::Drop => "drop (no live gateway node, failing closed)".to_owned(),
            };
            let by = e
                .policy
                .as_ref()
                .map(|p| format!("  [{p}]"))
                .unwrap_or_default();
            format!(
                "{:<15} -> {:<18} {action}{by}",
                e.src.to_string(),
                e.dst.to_string()
            )
        }),
    );
    section(
        out,
        "snat",
        s.snat.iter().map(|e| {
            let to = match e.to {
                SnatTo::Eip(ip) => format!("SNAT to {ip}"),
                SnatTo::NodeIp => "masquerade to the node's address".to_owned(),
            };
            format!(
                "{:<15} -> {:<18} {to}  [{}, pod on {}]",
                e.src.to_string(),
                e.dst.to_string(),
                e.policy,
                e.origin
            )
        }),
    );
    section(
        out,
        "eips",
        s.eips
            .iter()
            .map(|e| format!("{} of EgressGateway {}", e.ip, e.gateway)),
    );
    section(
        out,
        "failover groups (active first, then standbys; the live ones decide)",
        s.groups.iter().map(|g| {
            let order: Vec<&str> = g.candidates.iter().map(|c| c.node.as_str()).collect();
            let closed = if g.fail_closed {
                "fail closed"
            } else {
                "fail open"
            };
            format!("{}: {} ({closed})", g.key, order.join(", "))
        }),
    );
    out.push('\n');
}

fn vxlan(v: &Vxlan) -> String {
    let addrs = join(
        v.ipv4.map(|i| format!("{i}/{}", v.ipv4_prefix_len)),
        v.ipv6.map(|i| format!("{i}/{}", v.ipv6_prefix_len)),
    );
    format!(
        "{} vni {} port {} local {} mac {} addr {addrs} mtu parent-{} checksum-offload {}",
        v.name,
        v.vni,
        v.port,
        v.local,
        v.mac,
        v.overhead(),
        if v.disable_checksum_offload {
            "off"
        } else {
            "on"
        }
    )
}

fn section(out: &mut String, title: &str, lines: impl Iterator<Item = String>) {
    let lines: Vec<String> = lines.collect();
    if lines.is_empty() {
        let _ = writeln!(out, "  {title:<10} none");
        return;
    }
    let _ = writeln!(out, "  {title}");
    for line in lines {
        let _ = writeln!(out, "    {line}");
    }
}

fn join(a: Option<String>, b: Option<String>) -> String {
    let v: Vec<String> = a.into_iter().chain(b).collect();
    if v.is_empty() {
        "-".to_owned()
    } else {
        v.join(", ")
    }
}

fn status(out: &mut String, s: &ClusterStatus, invalid: &[InvalidObject]) {
    let _ = writeln!(out, "status");
    for g in &s.gateways {
        let ready: Vec<&str> = g
            .nodes
            .iter()
            .filter(|n| n.ready)
            .map(|n| n.name.as_str())
            .collect();
        let _ = writeln!(
            out,
            "  EgressGateway {}: ready nodes [{}], ipv4 {}/{} free, ipv6 {}/{} free",
            g.gateway,
            ready.join(", "),
            g.ip_usage.ipv4_free,
            g.ip_usage.ipv4_total,
            g.ip_usage.ipv6_free,
            g.ip_usage.ipv6_total
        );
        conditions(out, &g.conditions);
    }
    for p in &s.policies {
        let eip = join(
            p.eip_ipv4.map(|i| i.to_string()),
            p.eip_ipv6.map(|i| i.to_string()),
        );
        let eip = if p.use_node_ip {
            "node IP".to_owned()
        } else {
            eip
        };
        let _ = writeln!(
            out,
            "  {} {}: eip {eip}, node {}, {} pod(s)",
            p.policy.kind(),
            p.policy,
            p.node.as_deref().unwrap_or("-"),
            p.pods
        );
        conditions(out, &p.conditions);
    }
    for o in invalid
        .iter()
        .filter(|o| !matches!(o.kind.as_str(), "EgressPolicy" | "EgressClusterPolicy"))
    {
        let name = o
            .namespace
            .as_ref()
            .map_or_else(|| o.name.clone(), |ns| format!("{ns}/{}", o.name));
        let _ = writeln!(out, "  {} {name}: invalid: {}", o.kind, o.errors.join("; "));
    }
}

fn conditions(out: &mut String, conditions: &[Condition]) {
    for c in conditions {
        let _ = writeln!(
            out,
            "    {}={} {}: {}",
            c.type_,
            if c.status { "True" } else { "False" },
            c.reason,
            c.message
        );
    }
}

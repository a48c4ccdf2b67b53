//! `egressgw doctor --pod NS/NAME --dst ADDR`: which policy decides that
//! Pod's traffic to that address, through which gateway and EIP, whether
//! this node's kernel does what the plan says, and the policy's counters.

use std::collections::BTreeMap;
use std::net::IpAddr;

use egressgw_core::model::PolicyRef;
use egressgw_core::state::{Action, ClassifyEntry, NodeState};
use egressgw_dataplane::kernel::KernelState;
use egressgw_dataplane::nft;

use super::{AgentView, Check, Verdict};

/// What the kernel classifies a packet as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classified {
    /// Marked for a gateway node's table (or the local mark).
    Mark(u32),
    /// Left alone: the normal way.
    Leave,
    /// Dropped (fail closed).
    Drop,
}

impl Classified {
    /// What an entry of the eBPF classification map says.
    pub fn of_ebpf(v: egressgw_common::Verdict) -> Self {
        match v.kind {
            egressgw_common::kind::MARK => Classified::Mark(v.mark),
            egressgw_common::kind::DROP => Classified::Drop,
            _ => Classified::Leave,
        }
    }
}

/// What doctor learned about the Pod, read once.
#[derive(Debug, Clone)]
pub struct PodFacts {
    /// `NAMESPACE/NAME`.
    pub pod: String,
    pub dst: IpAddr,
    /// The Pod's address of `dst`'s family and its node, or why not.
    pub found: Result<(IpAddr, String), String>,
    /// This node.
    pub node: String,
    /// This node's plan.
    pub plan: Option<NodeState>,
    /// The local mark (this node is the gateway).
    pub local_mark: u32,
    /// The datapath whose state was read, and what it classifies the
    /// packet as; `None` when the Pod is on another node.
    pub kernel: Option<(String, Result<Option<Classified>, String>)>,
    /// egressgw's rules and routes as read back.
    pub routing: Option<Result<KernelState, String>>,
}

/// The planned entry for `src` -> `dst`: the most specific destination
/// that holds it.
pub fn planned(state: &NodeState, src: IpAddr, dst: IpAddr) -> Option<&ClassifyEntry> {
    state
        .classify
        .iter()
        .filter(|e| e.src == src && e.dst.contains(&dst))
        .max_by_key(|e| e.dst.prefix_len())
}

/// The nftables element for `src` -> `dst`: the narrowest range that
/// holds it.
pub fn nft_classified(observed: &nft::Observed, src: IpAddr, dst: IpAddr) -> Option<Classified> {
    observed
        .classify
        .iter()
        .filter(|(k, _)| k.src == src && k.dst.contains(dst))
        .min_by_key(|(k, _)| k.dst.len())
        .map(|(_, v)| match v {
            nft::Verdict::Mark(m) => Classified::Mark(*m),
            nft::Verdict::Local => Classified::Mark(u32::MAX),
            nft::Verdict::Drop => Classified::Drop,
            nft::Verdict::Other(_) => Classified::Leave,
        })
}

/// The gateway node a mark sends to, by the plan's candidates.
fn node_of_mark(state: &NodeState, mark: u32) -> Option<&str> {
    state
        .groups
        .iter()
        .flat_map(|g| &g.candidates)
        .find(|c| c.mark == mark)
        .map(|c| c.node.as_str())
}

fn policy_name(p: &PolicyRef) -> String {
    p.to_string()
}

/// The checks of `--pod`/`--dst`: `match`, `kernel` and `counters`.
pub fn checks(p: &PodFacts, agent: &Result<AgentView, String>) -> Vec<Check> {
    let (src, pod_node) = match &p.found {
        Ok(found) => found.clone(),
        Err(e) => return vec![Check::new("match", Verdict::Fail, e.clone())],
    };
    let Some(plan) = &p.plan else {
        return vec![Check::new(
            "match",
            Verdict::Fail,
            format!("the planner has no state for node {}", p.node),
        )];
    };
    let pod = &p.pod;
    let dst = p.dst;
    if pod_node != p.node {
        return vec![
            Check::new(
                "match",
                Verdict::Skip,
                format!("{pod} ({src}) runs on {pod_node}, not on {}", p.node),
            )
            .fix(format!(
                "run doctor on {pod_node} (in its agent's container)"
            )),
        ];
    }
    let entry = planned(plan, src, dst);
    let groups: BTreeMap<u32, &egressgw_core::state::Group> =
        plan.groups.iter().map(|g| (g.id, g)).collect();
    let group = entry.and_then(|e| groups.get(&e.group?)).copied();
    // Where the agent sends the group now (failover may have moved it).
    let target: Option<Option<String>> = group.and_then(|g| {
        let view = agent.as_ref().ok()?;
        serde_json::from_value(view.status["failover"]["targets"][&g.key].clone()).ok()
    });
    let (matched, expected) = match entry {
        None => (
            Check::new(
                "match",
                Verdict::Pass,
                format!(
                    "no policy selects {pod} ({src}) to {dst}: it leaves the normal way, with this node's address"
                ),
            ),
            Classified::Leave,
        ),
        Some(e) => {
            let policy = e
                .policy
                .as_deref()
                .map_or("(an exclusion)".into(), policy_name);
            let how = match (&e.action, group) {
                (Action::Bypass, _) => (
                    format!(
                        "{dst} is excluded from policy {policy} ({}): it leaves the normal way",
                        e.dst
                    ),
                    Classified::Leave,
                ),
                (Action::Drop, Some(g)) => (
                    format!(
                        "policy {policy} ({}) sends it through EgressGateway {}, which has no live node and fails closed: it is dropped",
                        e.dst, g.gateway
                    ),
                    Classified::Drop,
                ),
                (Action::Local, Some(g)) => (
                    format!(
                        "policy {policy} ({}) sends it through EgressGateway {} with EIP {}; this node is its gateway node and SNATs it here",
                        e.dst,
                        g.gateway,
                        g.eip
                            .map_or("(the node's own address)".into(), |ip| ip.to_string())
                    ),
                    Classified::Mark(p.local_mark),
                ),
                (Action::Tunnel { gateway, mark }, Some(g)) => {
                    let now = match &target {
                        Some(Some(n)) if n != gateway => {
                            format!("; {gateway} does not answer, so the agent sends it to {n} now")
                        }
                        Some(None) => "; no candidate node answers now".into(),
                        _ => String::new(),
                    };
                    let node = match &target {
                        Some(Some(n)) => n.clone(),
                        _ => gateway.clone(),
                    };
                    let mark = g
                        .candidates
                        .iter()
                        .find(|c| c.node == node)
                        .map_or(*mark, |c| c.mark);
                    (
                        format!(
                            "policy {policy} ({}) sends it through EgressGateway {} with EIP {}, to gateway node {gateway} (mark {mark:#010x}){now}",
                            e.dst,
                            g.gateway,
                            g.eip
                                .map_or("(the node's own address)".into(), |ip| ip.to_string()),
                        ),
                        Classified::Mark(mark),
                    )
                }
                (_, None) => (
                    format!("policy {policy} ({}) has no failover group", e.dst),
                    Classified::Leave,
                ),
            };
            (
                Check::new(
                    "match",
                    Verdict::Pass,
                    format!("{pod} ({src}) to {dst}: {}", how.0),
                ),
                how.1,
            )
        }
    };
    vec![
        matched,
        kernel_check(p, plan, src, expected),
        counters(entry.and_then(|e| e.policy.as_deref()), agent),
    ]
}

fn describe(c: Classified, plan: &NodeState, local_mark: u32) -> String {
    match c {
        Classified::Leave => "left alone (the normal way)".into(),
        Classified::Drop => "dropped".into(),
        Classified::Mark(m) if m == local_mark || m == u32::MAX => {
            "marked for SNAT on this node".into()
        }
        Classified::Mark(m) => format!(
            "marked {m:#010x} (to {})",
            node_of_mark(plan, m).unwrap_or("no node this node's plan knows")
        ),
    }
}

fn kernel_check(p: &PodFacts, plan: &NodeState, src: IpAddr, expected: Classified) -> Check {
    let dst = p.dst;
    let Some((datapath, read)) = &p.kernel else {
        return Check::new("kernel", Verdict::Skip, "the kernel was not read");
    };
    let seen = match read {
        Err(e) => {
            return Check::new(
                "kernel",
                Verdict::Fail,
                format!("cannot read the {datapath} classification: {e}"),
            );
        }
        Ok(None) => Classified::Leave,
        Ok(Some(c)) => *c,
    };
    let local =
        |c: Classified| matches!(c, Classified::Mark(m) if m == p.local_mark || m == u32::MAX);
    let agrees = seen == expected || (local(seen) && local(expected));
    let said = describe(seen, plan, p.local_mark);
    if !agrees {
        return Check::new(
            "kernel",
            Verdict::Fail,
            format!(
                "the {datapath} classification has {src} -> {dst} {said}, the plan {}",
                describe(expected, plan, p.local_mark)
            ),
        )
        .fix("the agent corrects it at its next reconcile; if it stays, see the `reconcile` check and the agent's log");
    }
    // A mark needs its rule and its route.
    if let Classified::Mark(m) = seen
        && !local(seen)
    {
        let Some(Ok(k)) = &p.routing else {
            return Check::new(
                "kernel",
                Verdict::Fail,
                format!("{datapath}: {said}; cannot read the rules and routes"),
            );
        };
        let rule = k
            .rules
            .iter()
            .find(|r| r.mark == m && r.ipv6 == src.is_ipv6());
        let Some(rule) = rule else {
            return Check::new(
                "kernel",
                Verdict::Fail,
                format!("{datapath}: {said}, but no rule sends mark {m:#010x} to a table"),
            )
            .fix(
                "the agent adds it at its next reconcile; see the `rules` and `reconcile` checks",
            );
        };
        let everything = if src.is_ipv6() {
            egressgw_core::net::Family::Ipv6.everything()
        } else {
            egressgw_core::net::Family::Ipv4.everything()
        };
        let Some(via) = k.routes.get(&(rule.table, everything)) else {
            return Check::new(
                "kernel",
                Verdict::Fail,
                format!(
                    "{datapath}: {said}; {} but table {} has no route",
                    rule, rule.table
                ),
            );
        };
        return Check::new(
            "kernel",
            Verdict::Pass,
            format!(
                "{datapath}: {said}; {rule}; table {}: default via {via}",
                rule.table
            ),
        );
    }
    Check::new(
        "kernel",
        Verdict::Pass,
        format!("{datapath}: {said}, as planned"),
    )
}

fn counters(policy: Option<&PolicyRef>, agent: &Result<AgentView, String>) -> Check {
    let Some(policy) = policy else {
        return Check::new("counters", Verdict::Skip, "no policy decides this traffic");
    };
    let Ok(view) = agent else {
        return Check::new("counters", Verdict::Skip, "the agent did not answer");
    };
    let traffic = &view.status["traffic"];
    if let Some(e) = traffic["error"].as_str() {
        return Check::new(
            "counters",
            Verdict::Warn,
            format!("the agent cannot read the policies' counters: {e}"),
        );
    }
    let c = &traffic["policies"][policy.to_string()];
    if c.is_null() {
        return Check::new(
            "counters",
            Verdict::Pass,
            format!("policy {policy} has sent nothing from this node yet"),
        );
    }
    Check::new(
        "counters",
        Verdict::Pass,
        format!(
            "policy {policy} sent {} packets, {} bytes from this node (as of {})",
            c["packets"],
            c["bytes"],
            traffic["at"].as_str().unwrap_or("?")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(src: &str, dst: &str, action: Action, group: Option<u32>) -> ClassifyEntry {
        ClassifyEntry {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            action,
            policy: Some(PolicyRef::namespaced("team-a", "web").into()),
            group,
        }
    }

    const MARK1: u32 = 0x0100_0000;
    const MARK2: u32 = 0x0200_0000;

    /// web-3 on node-3, sent by team-a/web through gateway egw (EIP
    /// 198.51.100.10, nodes node-1 then node-2) to 198.51.100.0/24; the
    /// kernel as planned.
    fn healthy() -> (PodFacts, Result<AgentView, String>) {
        let mut plan = NodeState::default();
        let tunnel = Action::Tunnel {
            gateway: "node-1".into(),
            mark: MARK1,
        };
        plan.classify = vec![entry("10.244.3.2", "198.51.100.0/24", tunnel, Some(0))];
        plan.groups = vec![egressgw_core::state::Group {
            id: 0,
            key: "egw/198.51.100.10".into(),
            gateway: "egw".into(),
            eip: Some("198.51.100.10".parse().unwrap()),
            candidates: vec![
                egressgw_core::state::Candidate {
                    node: "node-1".into(),
                    mark: MARK1,
                },
                egressgw_core::state::Candidate {
                    node: "node-2".into(),
                    mark: MARK2,
                },
            ],
            fail_closed: true,
        }];
        let mut routing = KernelState::default();
        for (mark, table, via) in [(MARK1, 3000, "10.200.0.1"), (MARK2, 3001, "10.200.0.2")] {
            routing.rules.insert(egressgw_dataplane::kernel::Rule {
                ipv6: false,
                priority: 3000,
                mark,
                mask: 0xff00_0000,
                table,
            });
            routing
                .routes
                .insert((table, "0.0.0.0/0".parse().unwrap()), via.parse().unwrap());
        }
        let facts = PodFacts {
            pod: "team-a/web-3".into(),
            dst: "198.51.100.7".parse().unwrap(),
            found: Ok(("10.244.3.2".parse().unwrap(), "node-3".into())),
            node: "node-3".into(),
            plan: Some(plan),
            local_mark: 0xfe00_0000,
            kernel: Some(("ebpf".into(), Ok(Some(Classified::Mark(MARK1))))),
            routing: Some(Ok(routing)),
        };
        let agent = Ok(AgentView {
            ready: Ok(()),
            status: serde_json::json!({
                "traffic": {"at": "now", "policies": {"team-a/web": {"packets": 12, "bytes": 1180}}},
                "failover": {"targets": {"egw/198.51.100.10": "node-1"}},
            }),
        });
        (facts, agent)
    }

    fn found(checks: &[Check], name: &str) -> (Verdict, String) {
        let c = checks.iter().find(|c| c.name == name).unwrap();
        (c.verdict, c.evidence.clone())
    }

    #[test]
    fn a_selected_pods_traffic_is_explained_and_the_kernel_agrees() {
        let (facts, agent) = healthy();
        let all = checks(&facts, &agent);
        let (v, e) = found(&all, "match");
        assert_eq!(v, Verdict::Pass);
        assert!(
            e.contains("policy team-a/web (198.51.100.0/24)")
                && e.contains("EIP 198.51.100.10")
                && e.contains("gateway node node-1 (mark 0x01000000)"),
            "{e}"
        );
        let (v, e) = found(&all, "kernel");
        assert_eq!(v, Verdict::Pass, "{e}");
        assert!(
            e.contains("marked 0x01000000 (to node-1)") && e.contains("lookup 3000"),
            "{e}"
        );
        let (v, e) = found(&all, "counters");
        assert_eq!(v, Verdict::Pass);
        assert!(e.contains("12 packets, 1180 bytes"), "{e}");
    }

    #[test]
    fn the_kernel_disagreeing_with_the_plan_fails() {
        let (mut facts, agent) = healthy();
        facts.kernel = Some(("ebpf".into(), Ok(None)));
        let (v, e) = found(&checks(&facts, &agent), "kernel");
        assert_eq!(v, Verdict::Fail);
        assert!(
            e.contains("left alone") && e.contains("the plan marked 0x01000000"),
            "{e}"
        );

        let (mut facts, agent) = healthy();
        if let Some(Ok(k)) = &mut facts.routing {
            k.rules.retain(|r| r.mark != MARK1);
        }
        let (v, e) = found(&checks(&facts, &agent), "kernel");
        assert_eq!(v, Verdict::Fail);
        assert!(e.contains("no rule sends mark 0x01000000"), "{e}");
    }

    #[test]
    fn traffic_the_agent_moved_to_another_candidate_is_expected_there() {
        let (mut facts, mut agent) = healthy();
        agent.as_mut().unwrap().status["failover"]["targets"]["egw/198.51.100.10"] =
            serde_json::json!("node-2");
        // Still marked for node-1: the kernel is behind the agent.
        let (v, _) = found(&checks(&facts, &agent), "kernel");
        assert_eq!(v, Verdict::Fail);
        facts.kernel = Some(("ebpf".into(), Ok(Some(Classified::Mark(MARK2)))));
        let all = checks(&facts, &agent);
        let (v, e) = found(&all, "match");
        assert_eq!(v, Verdict::Pass);
        assert!(
            e.contains("node-1 does not answer, so the agent sends it to node-2 now"),
            "{e}"
        );
        assert_eq!(found(&all, "kernel").0, Verdict::Pass);
    }

    #[test]
    fn an_unselected_pod_or_one_on_another_node_is_said_so() {
        let (mut facts, agent) = healthy();
        facts.dst = "203.0.113.9".parse().unwrap();
        facts.kernel = Some(("nftables".into(), Ok(None)));
        let all = checks(&facts, &agent);
        let (v, e) = found(&all, "match");
        assert_eq!(v, Verdict::Pass);
        assert!(
            e.contains("no policy selects team-a/web-3 (10.244.3.2) to 203.0.113.9"),
            "{e}"
        );
        assert_eq!(found(&all, "kernel").0, Verdict::Pass);
        assert_eq!(found(&all, "counters").0, Verdict::Skip);

        let (mut facts, agent) = healthy();
        facts.found = Ok(("10.244.1.2".parse().unwrap(), "node-1".into()));
        let all = checks(&facts, &agent);
        assert_eq!(all.len(), 1);
        assert_eq!(found(&all, "match").0, Verdict::Skip);
        assert_eq!(
            all[0].fix.as_deref(),
            Some("run doctor on node-1 (in its agent's container)")
        );
    }

    #[test]
    fn the_most_specific_planned_entry_decides() {
        let mut state = NodeState::default();
        let tunnel = Action::Tunnel {
            gateway: "node-1".into(),
            mark: 0x0100_0000,
        };
        state.classify = vec![
            entry("10.244.3.2", "0.0.0.0/0", tunnel.clone(), Some(0)),
            entry("10.244.3.2", "198.51.100.0/24", tunnel, Some(0)),
            entry("10.244.3.2", "198.51.100.128/25", Action::Bypass, None),
        ];
        let src: IpAddr = "10.244.3.2".parse().unwrap();
        let at = |d: &str| planned(&state, src, d.parse().unwrap()).map(|e| e.dst.to_string());
        assert_eq!(at("198.51.100.7").as_deref(), Some("198.51.100.0/24"));
        assert_eq!(at("198.51.100.200").as_deref(), Some("198.51.100.128/25"));
        assert_eq!(at("8.8.8.8").as_deref(), Some("0.0.0.0/0"));
        assert_eq!(
            planned(
                &state,
                "10.244.3.9".parse().unwrap(),
                "8.8.8.8".parse().unwrap()
            ),
            None
        );
    }
}

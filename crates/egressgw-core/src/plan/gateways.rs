//! Stage 1: usable gateways, the cluster default, selected and eligible nodes.

use std::collections::BTreeMap;

use crate::model::{Gateway, Snapshot};
use crate::net::Family;
use crate::status::Reason;

use super::tunnels::Tunnels;

/// One gateway with what the planner learned about it.
#[derive(Debug)]
pub(super) struct GatewayInfo<'a> {
    pub gateway: &'a Gateway,
    /// Why the gateway cannot be used at all.
    pub problem: Option<(Reason, String)>,
    /// Nodes its selector matches, sorted.
    pub selected: Vec<&'a str>,
    /// Selected nodes that can carry traffic now: ready, with an underlay
    /// address and a tunnel identity with a mark. Sorted.
    pub eligible: Vec<&'a str>,
    /// A note for the status message (e.g. an ignored `clusterDefault`).
    pub note: Option<String>,
}

/// All gateways by name, and the cluster default.
#[derive(Debug)]
pub(super) struct Gateways<'a> {
    pub by_name: BTreeMap<&'a str, GatewayInfo<'a>>,
    pub default: Option<&'a str>,
}

/// Resolves validity and the default; eligibility comes with [`Gateways::with_eligibility`].
pub(super) fn resolve(snapshot: &Snapshot) -> Gateways<'_> {
    let mut by_age: Vec<&Gateway> = snapshot.gateways.iter().collect();
    by_age.sort_by(|a, b| (&a.age, &a.name).cmp(&(&b.age, &b.name)));

    let mut by_name = BTreeMap::new();
    let mut default = None;
    let mut usable: Vec<&Gateway> = Vec::new();
    for gw in by_age {
        let problem = pool_overlap(gw, &usable);
        let mut note = None;
        if problem.is_none() {
            usable.push(gw);
            if gw.cluster_default {
                match default {
                    None => default = Some(gw.name.as_str()),
                    Some(older) => {
                        note = Some(format!(
                            "clusterDefault is ignored: {older} is the older cluster default gateway"
                        ));
                    }
                }
            }
        }
        let selected = snapshot
            .nodes
            .iter()
            .filter(|n| gw.node_selector.matches(&n.labels))
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>();
        by_name.insert(
            gw.name.as_str(),
            GatewayInfo {
                gateway: gw,
                problem,
                selected: sorted(selected),
                eligible: Vec::new(),
                note,
            },
        );
    }
    Gateways { by_name, default }
}

fn pool_overlap(gw: &Gateway, older: &[&Gateway]) -> Option<(Reason, String)> {
    for family in Family::ALL {
        for range in gw.pool(family).ranges() {
            for other in older {
                if let Some(hit) = other
                    .pool(family)
                    .ranges()
                    .iter()
                    .find(|r| r.overlaps(range))
                {
                    return Some((
                        Reason::PoolOverlap,
                        format!(
                            "spec.ippools.{family}: {range} overlaps {hit} of the older gateway {}; \
                             an EIP can belong to one gateway only",
                            other.name
                        ),
                    ));
                }
            }
        }
    }
    None
}

impl<'a> Gateways<'a> {
    /// Fills in which selected nodes can carry traffic now.
    pub fn with_eligibility(mut self, snapshot: &'a Snapshot, tunnels: &Tunnels) -> Self {
        let ready: BTreeMap<&str, bool> = snapshot
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n.ready && !n.addresses.is_empty()))
            .collect();
        for info in self.by_name.values_mut() {
            if info.problem.is_some() {
                continue;
            }
            info.eligible = info
                .selected
                .iter()
                .copied()
                .filter(|n| ready.get(n).copied().unwrap_or(false) && tunnels.can_carry(n))
                .collect();
        }
        self
    }

    /// Whether `node` is selected by some usable gateway (and so needs a mark).
    pub fn is_gateway_capable(&self, node: &str) -> bool {
        self.by_name
            .values()
            .any(|g| g.problem.is_none() && g.selected.binary_search(&node).is_ok())
    }
}

fn sorted(mut v: Vec<&str>) -> Vec<&str> {
    v.sort_unstable();
    v.dedup();
    v
}

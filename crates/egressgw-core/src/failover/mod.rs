//! Failover in the data plane: a node's planned state, resolved against
//! what the node itself sees of its peers now.
//!
//! The planner gives every EIP (and every `useNodeIP` policy's family) a
//! [`Group`]: its candidate nodes, the planned active one first. Each agent
//! probes its peers through the tunnel (answered by their kernels, so a dead
//! agent on a live node is not a dead gateway) and [`resolve`]s the plan
//! with what it sees; no API server is involved:
//! - a source sends a group's traffic to the live candidate it finds
//!   holding the EIP (it asks the candidates' kernels through the tunnel,
//!   see [`View::holders`]); while none is found, to where it went last if
//!   that node lives (a recovered node does not pull traffic back), else to
//!   the first live candidate. A source that moved on a passing hiccup
//!   thus comes back to the holder instead of staying with a node that
//!   cannot send its traffic out. A candidate that finds itself the first
//!   live one claims, wherever its traffic went before: two candidates that
//!   once sent to each other (their plans disagreed for a moment) would
//!   otherwise wait for each other forever;
//! - a holder keeps its EIP while it reaches at least half of the nodes
//!   (itself included) and stays a candidate; below that it is cut off and
//!   gives the EIP up (fencing), before any other node may take it;
//! - a candidate that finds itself first among the live ones, and reaches
//!   more than half of the nodes, claims the EIP — after the agent has
//!   checked that nothing on the segment answers for it ([`Resolved::claims`]);
//! - with no live candidate, the traffic is dropped if the gateway fails
//!   closed, and leaves the normal way otherwise.
//!
//! Keeping needs half and claiming needs a majority, so two sides of a
//! partition never both hold an EIP: at most one side has a majority, and a
//! side with exactly half may keep but not claim.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use crate::state::{Action, ClassifyEntry, NodeState, OwnedEip};

/// What a node sees now.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// Peers (node names) that answered through the tunnel recently.
    pub live: &'a BTreeSet<String>,
    /// EIPs this node holds now.
    pub held: &'a BTreeSet<IpAddr>,
    /// EIPs another host on the segment answers for: never claimed.
    pub in_use: &'a BTreeSet<IpAddr>,
    /// Where each group (by [`Group::key`]) went at the last resolve.
    pub previous: &'a BTreeMap<String, String>,
    /// For each EIP, the peers found holding it just now (their kernels
    /// answered for the EIP through the tunnel).
    pub holders: &'a BTreeMap<IpAddr, BTreeSet<String>>,
}

/// How many nodes this node reaches, itself included, of how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quorum {
    /// Nodes reached, this one included.
    pub reached: usize,
    /// Nodes with a tunnel, this one included.
    pub total: usize,
}

impl Quorum {
    /// Whether a holder may keep its EIPs: it reaches at least half.
    pub fn may_keep(self) -> bool {
        2 * self.reached >= self.total
    }

    /// Whether a node may take an EIP over: it reaches more than half.
    pub fn may_claim(self) -> bool {
        2 * self.reached > self.total
    }
}

/// The outcome of [`resolve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The state to reconcile: classification sent to the live
    /// candidates, and the EIPs this node holds and keeps. The planned
    /// state itself when that is what it already says (every group's
    /// traffic goes to its first candidate, and this node holds every EIP
    /// it is the first candidate of): a node in a steady state resolves
    /// without a copy of its entries.
    pub state: Arc<NodeState>,
    /// Where each group's traffic goes now, by key: `None` when it has no
    /// live candidate (dropped or, failing open, sent the normal way).
    pub targets: BTreeMap<String, Option<String>>,
    /// EIPs this node should take over but does not hold yet. The agent
    /// checks the segment for each and, when nothing answers, adds it to
    /// [`View::held`] and resolves again.
    pub claims: Vec<IpAddr>,
    /// EIPs this node holds and gives up now, with the reason.
    pub released: Vec<(IpAddr, &'static str)>,
    /// The quorum the decisions were made with.
    pub quorum: Quorum,
}

/// Resolves `planned` (the planner's state for this node, every candidate
/// assumed alive) against `view`.
pub fn resolve(planned: &Arc<NodeState>, view: View<'_>) -> Resolved {
    let me = planned.node.as_str();
    let quorum = Quorum {
        reached: 1 + planned
            .peers
            .iter()
            .filter(|p| view.live.contains(&p.node))
            .count(),
        total: 1 + planned.peers.len(),
    };
    let alive = |node: &str| node == me || view.live.contains(node);

    let mut targets = BTreeMap::new();
    // What each group's traffic gets, by group id (ids are the groups'
    // positions, see `NodeState::groups`).
    let mut actions: Vec<Action> = Vec::with_capacity(planned.groups.len());
    let mut claims = Vec::new();
    let mut keep: BTreeMap<IpAddr, &str> = BTreeMap::new();
    for group in &planned.groups {
        let index = |node: &str| group.candidates.iter().position(|c| c.node == node);
        let mine = index(me);
        let holds = group.eip.is_some_and(|ip| view.held.contains(&ip));
        let holding = group
            .eip
            .and_then(|ip| view.holders.get(&ip))
            .filter(|nodes| !nodes.is_empty());
        let found_holder = || {
            let holding = holding?;
            let live_holder = |n: &String| n.as_str() != me && alive(n) && holding.contains(n);
            view.previous
                .get(&group.key)
                .filter(|n| live_holder(n))
                .and_then(|n| index(n))
                .or_else(|| group.candidates.iter().position(|c| live_holder(&c.node)))
        };
        // The first candidate that lives and, if it is this node, may take
        // the EIP.
        let first_live = || {
            group.candidates.iter().position(|c| {
                if c.node != me {
                    return view.live.contains(&c.node);
                }
                match group.eip {
                    Some(ip) => quorum.may_claim() && !view.in_use.contains(&ip),
                    None => true,
                }
            })
        };
        let target = if holds && mine.is_some() && quorum.may_keep() {
            mine
        } else if let Some(found) = found_holder() {
            Some(found)
        } else {
            let first = first_live();
            if first.is_some() && first == mine {
                // This node's turn: it claims, wherever the traffic went
                // before (see the module's notes).
                first
            } else {
                let sticky = view
                    .previous
                    .get(&group.key)
                    .filter(|n| n.as_str() != me && alive(n))
                    .and_then(|n| index(n));
                sticky.or(first)
            }
        };
        if target.is_some()
            && target == mine
            && let Some(ip) = group.eip
        {
            if holds {
                keep.insert(ip, &group.gateway);
            } else {
                claims.push(ip);
            }
        }
        debug_assert_eq!(usize::try_from(group.id).ok(), Some(actions.len()));
        actions.push(match target.map(|i| &group.candidates[i]) {
            Some(c) if c.node == me => Action::Local,
            Some(c) => Action::Tunnel {
                gateway: c.node.clone(),
                mark: c.mark,
            },
            None if group.fail_closed => Action::Drop,
            None => Action::Bypass,
        });
        targets.insert(
            group.key.clone(),
            target.map(|i| group.candidates[i].node.clone()),
        );
    }

    let action_of = |entry: &ClassifyEntry| {
        entry
            .group
            .and_then(|id| actions.get(usize::try_from(id).ok()?))
    };
    let eips: Vec<OwnedEip> = keep
        .iter()
        .map(|(ip, gateway)| OwnedEip {
            ip: *ip,
            gateway: (*gateway).to_owned(),
        })
        .collect();
    let unchanged = eips == planned.eips
        && planned
            .classify
            .iter()
            .all(|e| action_of(e).is_none_or(|a| *a == e.action));
    let state = if unchanged {
        Arc::clone(planned)
    } else {
        let mut state = NodeState::clone(planned);
        for entry in &mut state.classify {
            if let Some(action) = action_of(entry) {
                entry.action = action.clone();
            }
        }
        state.eips = eips;
        Arc::new(state)
    };
    let released = view
        .held
        .iter()
        .filter(|ip| !keep.contains_key(ip))
        .map(|ip| {
            let why = match planned.groups.iter().find(|g| g.eip == Some(*ip)) {
                None => "no longer planned here",
                Some(g) if !g.candidates.iter().any(|c| c.node == me) => {
                    "this node is no longer a candidate"
                }
                Some(_) => "this node reaches fewer than half of the nodes",
            };
            (*ip, why)
        })
        .collect();
    claims.sort_unstable();
    Resolved {
        state,
        targets,
        claims,
        released,
        quorum,
    }
}

#[cfg(test)]
mod tests;

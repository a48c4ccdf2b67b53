//! The agent's side of failover: probing peers through the tunnel, and
//! turning the planned state into the state to reconcile with what this
//! node sees now ([`egressgw_core::failover`] has the rules).
//!
//! Timings (defaults): a peer is probed every 100 ms and counts as dead
//! after 300 ms without an answer; the liveness view is read every 20 ms.
//! A source moves a dead gateway's traffic to the next live candidate at
//! the next read. A holder that reaches fewer than half of the nodes for
//! 300 ms gives its EIPs up; a standby needs more than half and first asks
//! the segment (ARP probes over 150 ms) whether anyone still answers for
//! the EIP, and takes it only when no one does. A holder cut off from its
//! peers therefore releases within about 300 ms + 20 ms + the reconcile,
//! while a standby sees it dead no sooner than 200 ms after the cut (its
//! last answer may be up to one interval old) and then spends 150 ms asking
//! the segment, where the old holder still answers until it has released:
//! the standby then asks again 250 ms later (every 2 s once the finding is
//! 5 s old).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use egressgw_core::failover::{self, Resolved, View};
use egressgw_core::state::NodeState;
use egressgw_dataplane::announce;
use egressgw_dataplane::probe::{HolderTarget, Prober, Target};
use tokio::sync::Notify;

/// How often the liveness view is read.
const CHECK_EVERY: Duration = Duration::from_millis(20);
/// How long the segment is asked before an EIP is taken.
pub const CLAIM_PROBE: Duration = Duration::from_millis(150);
/// How long an "in use" finding stands before the segment is asked again:
/// soon while it is fresh (an old holder releasing it during a takeover),
/// then at a slower pace (an address some other host keeps).
const IN_USE_RECHECK_FRESH: Duration = Duration::from_millis(250);
const IN_USE_RECHECK: Duration = Duration::from_secs(2);
/// How long a finding counts as fresh.
const IN_USE_FRESH: Duration = Duration::from_secs(5);

/// Probe settings (`--probe-interval`, `--probe-misses`).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct ProbeArgs {
    /// How often each peer is probed through the tunnel, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=10_000))]
    pub probe_interval_ms: u64,
    /// Probes a peer may miss in a row before it counts as dead.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub probe_misses: u32,
}

impl ProbeArgs {
    fn interval(&self) -> Duration {
        Duration::from_millis(self.probe_interval_ms)
    }

    /// How long a peer may stay silent before it counts as dead.
    pub fn down_after(&self) -> Duration {
        self.interval() * self.probe_misses
    }
}

/// The peers this node sees alive, kept current by a background task.
pub struct Liveness {
    prober: Prober,
    down_after: Duration,
    misses: u32,
    /// The live set and the holders found, as the watcher last saw them.
    seen: Mutex<(BTreeSet<String>, Holders)>,
    /// Woken whenever the set changes.
    pub changed: Notify,
}

impl Liveness {
    /// Starts probing out of `device`; [`Self::watch`] follows the result.
    pub fn start(device: &str, args: ProbeArgs) -> Arc<Self> {
        Arc::new(Liveness {
            prober: Prober::start(device, args.interval()),
            down_after: args.down_after(),
            misses: args.probe_misses,
            seen: Mutex::new((BTreeSet::new(), BTreeMap::new())),
            changed: Notify::new(),
        })
    }

    /// Wakes [`Self::changed`] whenever the live set changes: called once,
    /// runs until the process ends.
    pub async fn watch(self: Arc<Self>) {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = (self.live(), self.holders());
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *seen != now {
                let gone: Vec<&String> = seen.0.difference(&now.0).collect();
                let back: Vec<&String> = now.0.difference(&seen.0).collect();
                if !gone.is_empty() {
                    tracing::warn!(?gone, "peers stopped answering through the tunnel");
                }
                if !back.is_empty() {
                    tracing::info!(?back, "peers answer through the tunnel");
                }
                if seen.1 != now.1 {
                    tracing::info!(holders = ?now.1, "EIP holders found through the tunnel");
                }
                *seen = now;
                drop(seen);
                self.changed.notify_one();
            }
        }
    }

    /// Probes the peers of `state` [`probe_targets`] names, by their tunnel
    /// address (IPv4 first).
    pub fn follow(&self, state: &NodeState) {
        self.prober.set_targets(&probe_targets(state));
        // Which candidate holds each EIP this node sends traffic to.
        let sourced = sourced(state);
        let questions: Vec<HolderTarget> = state
            .groups
            .iter()
            .filter(|g| sourced.contains(&g.id))
            .filter_map(|g| Some((g, g.eip?)))
            .flat_map(|(g, eip)| {
                g.candidates.iter().filter_map(move |c| {
                    let peer = state.peers.iter().find(|p| p.node == c.node)?;
                    let via = match eip {
                        IpAddr::V4(_) => IpAddr::V4(peer.ipv4?),
                        IpAddr::V6(_) => IpAddr::V6(peer.ipv6?),
                    };
                    Some(HolderTarget {
                        node: c.node.clone(),
                        via,
                        mark: c.mark,
                        eip,
                    })
                })
            })
            .collect();
        self.prober.set_holder_targets(&questions);
    }

    /// What the probes show now.
    pub fn sight(&self) -> Sight {
        Sight {
            live: self.live(),
            holders: self.holders(),
            last_answers: self.last_answers(),
        }
    }

    /// For each EIP this node sends traffic to, the candidates whose
    /// kernels answered for it within the time a peer may stay silent.
    pub fn holders(&self) -> Holders {
        self.prober.holders(self.misses, self.down_after)
    }

    /// The peers alive now (a peer just added counts as alive until it
    /// has had its time to answer).
    pub fn live(&self) -> BTreeSet<String> {
        self.prober.live(self.misses, self.down_after)
    }

    /// What the probes saw of each peer probed: its last answer's age and
    /// round trip.
    pub fn seen(&self) -> BTreeMap<String, egressgw_dataplane::probe::Seen> {
        self.prober.seen()
    }

    /// How long ago each peer last answered, in milliseconds (`None`: never).
    pub fn last_answers(&self) -> BTreeMap<String, Option<u128>> {
        self.prober
            .last_answers()
            .into_iter()
            .map(|(n, d)| (n, d.map(|d| d.as_millis())))
            .collect()
    }
}

/// For each EIP, the peers found holding it.
pub type Holders = BTreeMap<IpAddr, BTreeSet<String>>;

/// What this node's probes show.
#[derive(Debug, Clone, Default)]
pub struct Sight {
    /// Peers that answer through the tunnel.
    pub live: BTreeSet<String>,
    /// For each EIP, the peers found holding it.
    pub holders: Holders,
    /// How long ago each peer last answered, in milliseconds (`None`: never).
    pub last_answers: BTreeMap<String, Option<u128>>,
}

/// An EIP found answered for by another host.
#[derive(Debug, Clone)]
pub struct InUse {
    /// Who answered (MAC and interface).
    pub by: String,
    /// When the segment was last asked.
    pub checked: Instant,
    /// When it was first found in use.
    pub found: Instant,
    /// Since when it is in use, for the status.
    pub since: k8s_openapi::jiff::Timestamp,
}

/// An EIP this node holds.
#[derive(Debug, Clone)]
pub struct Held {
    /// Since when.
    pub since: k8s_openapi::jiff::Timestamp,
    /// How it came here, for the status and the controller's Event.
    pub note: Option<String>,
}

impl InUse {
    fn recheck_every(&self) -> Duration {
        if self.found.elapsed() < IN_USE_FRESH {
            IN_USE_RECHECK_FRESH
        } else {
            IN_USE_RECHECK
        }
    }
}

/// What the agent remembers between resolves.
#[derive(Debug, Default)]
pub struct Memory {
    /// EIPs this node holds.
    pub held: BTreeMap<IpAddr, Held>,
    /// EIPs another host answers for.
    pub in_use: BTreeMap<IpAddr, InUse>,
    /// Where each group went at the last resolve.
    pub targets: BTreeMap<String, String>,
    /// Groups this node sends selected traffic to that have no live
    /// candidate, by key.
    pub unreachable: BTreeMap<String, Unreachable>,
}

/// A group of this node's selected traffic with no live candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreachable {
    pub gateway: String,
    pub eip: Option<IpAddr>,
    /// Dropped (true) or sent with the node's own address (false).
    pub fail_closed: bool,
    pub since: k8s_openapi::jiff::Timestamp,
}

/// Why this node took an EIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// The plan makes this node the EIP's active node.
    Planned,
    /// This node is a standby, and every candidate before it stopped
    /// answering through the tunnel.
    Failover,
}

impl Takeover {
    pub const ALL: [Self; 2] = [Self::Planned, Self::Failover];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Planned => "planned",
            Self::Failover => "failover",
        }
    }
}

/// Why this node gave an EIP up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The plan no longer has this node among the EIP's candidates (or no
    /// longer has the EIP).
    Planned,
    /// This node reaches fewer than half of the nodes (fencing).
    QuorumLost,
}

impl Release {
    pub const ALL: [Self; 2] = [Self::Planned, Self::QuorumLost];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Planned => "planned",
            Self::QuorumLost => "quorum_lost",
        }
    }
}

/// What [`Memory::resolve`] decided: the resolved state, and what changed
/// hands for the metrics.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The state to reconcile, the targets and the quorum.
    pub resolved: Resolved,
    /// EIPs this node took in this run.
    pub taken: Vec<(IpAddr, Takeover)>,
    /// EIPs this node gave up in this run.
    pub released: Vec<(IpAddr, Release)>,
    /// For each group of this node's selected traffic that left a node
    /// which stopped answering (for another node, or for none): how long
    /// before the move that node had last answered.
    pub detected: Vec<Duration>,
    /// For each failover this node carries out in this run (its traffic
    /// moved from a silent node to a live one, an EIP taken over from a
    /// silent node): how long ago the silent node last answered. The
    /// failover has recovered once the reconcile of this run has put it in
    /// the kernel.
    pub recovering: Vec<Duration>,
    /// Each gateway this node sends selected traffic to, and whether it
    /// has a group with no live candidate.
    pub gateways: BTreeMap<String, bool>,
}

impl Memory {
    /// Resolves `planned` against `live`, asking the segment about every
    /// EIP this node should take over (and again about those found in use
    /// a while ago) before it counts as held.
    pub async fn resolve(&mut self, planned: &Arc<NodeState>, sight: &Sight) -> Outcome {
        let started = Instant::now();
        let Sight {
            live,
            holders,
            last_answers,
        } = sight;
        let mut taken = Vec::new();
        let mut recovering = Vec::new();
        self.forget_in_use_held_by_peers(holders);
        let held: BTreeSet<IpAddr> = self.held.keys().copied().collect();
        let fresh: BTreeSet<IpAddr> = self
            .in_use
            .iter()
            .filter(|(_, u)| u.checked.elapsed() < u.recheck_every())
            .map(|(ip, _)| *ip)
            .collect();
        let first = failover::resolve(
            planned,
            View {
                live,
                held: &held,
                in_use: &fresh,
                previous: &self.targets,
                holders,
            },
        );
        for ip in &first.claims {
            let asked = tokio::task::spawn_blocking({
                let ip = *ip;
                move || announce::answered_for(ip, CLAIM_PROBE)
            })
            .await;
            match asked {
                Ok(Ok(None)) => {
                    if self.in_use.remove(ip).is_some() {
                        tracing::info!(egress_ip = %ip, "no other host answers for the EIP any more");
                    }
                    let before = planned
                        .groups
                        .iter()
                        .find(|g| g.eip == Some(*ip))
                        .and_then(|g| self.targets.get(&g.key))
                        .filter(|n| **n != planned.node);
                    let note = before.map(|old| {
                        let silent = last_answers
                            .get(old)
                            .copied()
                            .flatten()
                            .map_or_else(|| "never answered".to_owned(), |ms| format!("had not answered for {ms} ms"));
                        format!("taken over from {old}, which stopped answering its peers through the tunnel ({silent})")
                    });
                    tracing::info!(egress_ip = %ip, from = ?before, "taking the EIP: this node is its first live candidate and no host on the segment answers for it");
                    let reason = takeover_reason(planned, *ip);
                    if reason == Takeover::Failover
                        && let Some(ms) =
                            before.and_then(|old| last_answers.get(old).copied().flatten())
                    {
                        recovering.push(silence(ms) + started.elapsed());
                    }
                    taken.push((*ip, reason));
                    self.held.insert(
                        *ip,
                        Held {
                            since: k8s_openapi::jiff::Timestamp::now(),
                            note,
                        },
                    );
                }
                Ok(Ok(Some(by))) => {
                    let known = self.in_use.get(ip).is_some_and(|u| u.by == by);
                    if !known {
                        tracing::warn!(egress_ip = %ip, answered_by = by, "not taking the EIP: another host answers for it");
                    }
                    let (since, found) = self.in_use.get(ip).map_or_else(
                        || (k8s_openapi::jiff::Timestamp::now(), Instant::now()),
                        |u| (u.since, u.found),
                    );
                    self.in_use.insert(
                        *ip,
                        InUse {
                            by,
                            checked: Instant::now(),
                            found,
                            since,
                        },
                    );
                }
                Ok(Err(e)) => {
                    tracing::warn!(egress_ip = %ip, error = %e, "cannot ask the segment about the EIP; not taking it yet");
                }
                Err(e) => tracing::warn!(egress_ip = %ip, error = %e, "the segment check stopped"),
            }
        }
        let held: BTreeSet<IpAddr> = self.held.keys().copied().collect();
        let in_use: BTreeSet<IpAddr> = self.in_use.keys().copied().collect();
        let resolved = failover::resolve(
            planned,
            View {
                live,
                held: &held,
                in_use: &in_use,
                previous: &self.targets,
                holders,
            },
        );
        let mut released = Vec::new();
        for (ip, why) in &resolved.released {
            tracing::warn!(egress_ip = %ip, reason = why, "giving the EIP up");
            self.held.remove(ip);
            released.push((*ip, release_reason(planned, *ip, resolved.quorum)));
        }
        // Claims still open here were refused above; they wait for the next run.
        for (key, target) in &resolved.targets {
            let before = self.targets.get(key);
            if before != target.as_ref()
                && let Some(node) = target
            {
                tracing::info!(group = key, to = node, from = ?before, "sending the group's traffic to a new node");
            }
        }
        self.note_unreachable(planned, &resolved);
        let mut detected = Vec::new();
        for (node, moved) in silent_targets_left(planned, &self.targets, &resolved.targets, live) {
            let Some(ms) = last_answers.get(node).copied().flatten() else {
                continue;
            };
            let silent_for = silence(ms) + started.elapsed();
            detected.push(silent_for);
            if moved {
                recovering.push(silent_for);
            }
        }
        self.targets = resolved
            .targets
            .iter()
            .filter_map(|(k, t)| Some((k.clone(), t.clone()?)))
            .collect();
        // What is no longer wanted here is no longer in use for us either.
        let wanted: BTreeSet<IpAddr> = planned.groups.iter().filter_map(|g| g.eip).collect();
        self.in_use.retain(|ip, _| wanted.contains(ip));
        let gateways = gateways_in_use(planned, &self.unreachable);
        Outcome {
            resolved,
            taken,
            released,
            detected,
            recovering,
            gateways,
        }
    }

    /// An EIP found in use on the segment that a peer's kernel answers for
    /// through the tunnel is held by that peer (often the answer on the
    /// segment was its own probe while it took the EIP): it is not in use
    /// by a foreign host, and this node sends the traffic there.
    fn forget_in_use_held_by_peers(&mut self, holders: &Holders) {
        self.in_use.retain(|ip, u| {
            let peers = holders.get(ip).filter(|h| !h.is_empty());
            if let Some(peers) = peers {
                tracing::info!(egress_ip = %ip, ?peers, answered_by = u.by, "the EIP found in use is held by a node of the cluster");
            }
            peers.is_none()
        });
    }

    /// Follows which groups of this node's selected traffic have no live
    /// candidate, and says so when that changes.
    fn note_unreachable(&mut self, planned: &NodeState, resolved: &Resolved) {
        let sourced = sourced(planned);
        let mut now = BTreeMap::new();
        for group in planned.groups.iter().filter(|g| sourced.contains(&g.id)) {
            if !matches!(resolved.targets.get(&group.key), Some(None)) {
                continue;
            }
            let unreachable = match self.unreachable.remove(&group.key) {
                Some(known) if known.fail_closed == group.fail_closed => known,
                _ => {
                    let what = if group.fail_closed {
                        "dropped (failClosed)"
                    } else {
                        "sent with this node's own address (failClosed: false)"
                    };
                    tracing::warn!(
                        group = group.key,
                        "no candidate node of the group answers: its selected traffic is {what}"
                    );
                    Unreachable {
                        gateway: group.gateway.clone(),
                        eip: group.eip,
                        fail_closed: group.fail_closed,
                        since: k8s_openapi::jiff::Timestamp::now(),
                    }
                }
            };
            now.insert(group.key.clone(), unreachable);
        }
        for key in self.unreachable.keys() {
            if resolved.targets.get(key).is_some_and(Option::is_some) {
                tracing::info!(group = key, "a candidate node of the group answers again");
            }
        }
        self.unreachable = now;
    }

    /// When the loop should run again to ask the segment anew.
    pub fn recheck_in(&self) -> Option<Duration> {
        self.in_use
            .values()
            .map(|u| u.recheck_every().saturating_sub(u.checked.elapsed()))
            .min()
    }
}

/// The ids of the groups this node sends selected traffic to.
/// Whether `state`'s node is a candidate of some EIP: it holds it or may
/// take it over, which takes a quorum of all the nodes.
pub fn is_candidate(state: &NodeState) -> bool {
    state
        .groups
        .iter()
        .any(|g| g.candidates.iter().any(|c| c.node == state.node))
}

/// The peers a node probes. A candidate of some EIP probes every peer: its
/// quorum counts all the nodes. Any other node holds nothing and decides
/// only where its traffic goes, so it probes the candidates of its groups
/// alone: at a thousand nodes with twenty gateway nodes, twenty probes an
/// interval instead of a thousand.
fn probe_targets(state: &NodeState) -> Vec<Target> {
    let candidates: BTreeSet<&str> = state
        .groups
        .iter()
        .flat_map(|g| g.candidates.iter().map(|c| c.node.as_str()))
        .collect();
    let everyone = is_candidate(state);
    state
        .peers
        .iter()
        .filter(|p| everyone || candidates.contains(p.node.as_str()))
        .filter_map(|p| {
            let addr = p.ipv4.map(IpAddr::V4).or(p.ipv6.map(IpAddr::V6))?;
            Some(Target {
                node: p.node.clone(),
                addr,
            })
        })
        .collect()
}

fn sourced(planned: &NodeState) -> BTreeSet<u32> {
    planned.classify.iter().filter_map(|e| e.group).collect()
}

/// Why this node takes `ip`: its plan names it the active node (the
/// group's first candidate), or it stands in for those before it.
fn takeover_reason(planned: &NodeState, ip: IpAddr) -> Takeover {
    let first = planned
        .groups
        .iter()
        .find(|g| g.eip == Some(ip))
        .and_then(|g| g.candidates.first());
    if first.is_some_and(|c| c.node == planned.node) {
        Takeover::Planned
    } else {
        Takeover::Failover
    }
}

/// Why this node gives `ip` up, by the rule of
/// [`egressgw_core::failover::resolve`]: a candidate keeps what it holds
/// while `quorum` allows it, so a candidate that gives an EIP up lost the
/// quorum; any other node was taken off the EIP by the plan.
fn release_reason(planned: &NodeState, ip: IpAddr, quorum: failover::Quorum) -> Release {
    let candidate = planned
        .groups
        .iter()
        .filter(|g| g.eip == Some(ip))
        .any(|g| g.candidates.iter().any(|c| c.node == planned.node));
    if candidate && !quorum.may_keep() {
        Release::QuorumLost
    } else {
        Release::Planned
    }
}

/// The peers that carried a group of this node's selected traffic at the
/// last resolve (`previous`), are no longer live, and carry it no more
/// (`now`: it went to another node, or to none): one per group.
fn silent_targets_left<'a>(
    planned: &NodeState,
    previous: &'a BTreeMap<String, String>,
    now: &BTreeMap<String, Option<String>>,
    live: &BTreeSet<String>,
) -> Vec<(&'a String, bool)> {
    let sourced = sourced(planned);
    planned
        .groups
        .iter()
        .filter(|g| sourced.contains(&g.id))
        .filter_map(|g| {
            let before = previous.get(&g.key)?;
            let after = now.get(&g.key).and_then(Option::as_ref);
            let stays = after == Some(before);
            let silent = *before != planned.node && !live.contains(before);
            (silent && !stays).then_some((before, after.is_some()))
        })
        .collect()
}

/// A peer's silence as the probes report it (milliseconds).
fn silence(ms: u128) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// Each gateway of a group this node sends selected traffic to, and
/// whether one of its groups has no live candidate (`unreachable`).
fn gateways_in_use(
    planned: &NodeState,
    unreachable: &BTreeMap<String, Unreachable>,
) -> BTreeMap<String, bool> {
    let sourced = sourced(planned);
    let mut gateways = BTreeMap::new();
    for group in planned.groups.iter().filter(|g| sourced.contains(&g.id)) {
        *gateways.entry(group.gateway.clone()).or_default() |= unreachable.contains_key(&group.key);
    }
    gateways
}

#[cfg(test)]
mod tests {
    use egressgw_core::model::Mac;
    use egressgw_core::state::{Action, Candidate, ClassifyEntry, Group, Peer};

    use super::*;

    fn group(id: u32, key: &str, fail_closed: bool) -> Group {
        Group {
            id,
            key: key.to_owned(),
            gateway: "gw".to_owned(),
            eip: Some(IpAddr::from([
                198,
                51,
                100,
                100 + u8::try_from(id).unwrap(),
            ])),
            candidates: vec![Candidate {
                node: "g1".to_owned(),
                mark: 0x0100_0000,
            }],
            fail_closed,
        }
    }

    fn resolved(planned: &NodeState, dead: &[&str]) -> Resolved {
        let mut targets = BTreeMap::new();
        for g in &planned.groups {
            let live = g
                .candidates
                .iter()
                .find(|c| !dead.contains(&c.node.as_str()));
            targets.insert(g.key.clone(), live.map(|c| c.node.clone()));
        }
        Resolved {
            state: Arc::new(planned.clone()),
            targets,
            claims: Vec::new(),
            released: Vec::new(),
            quorum: failover::Quorum {
                reached: 1,
                total: 2,
            },
        }
    }

    fn candidate(node: &str) -> Candidate {
        Candidate {
            node: node.to_owned(),
            mark: 0x0100_0000,
        }
    }

    /// Node `me` with groups 0 (`gw/a`, candidates g1 then me) and 1
    /// (`gw/b`, me then g1), sending selected traffic to the `sourced` ones.
    fn two_groups(me: &str, sourced: &[u32]) -> NodeState {
        let mut a = group(0, "gw/a", true);
        a.candidates = vec![candidate("g1"), candidate(me)];
        let mut b = group(1, "gw/b", true);
        b.candidates = vec![candidate(me), candidate("g1")];
        NodeState {
            node: me.to_owned(),
            groups: vec![a, b],
            classify: sourced
                .iter()
                .map(|id| ClassifyEntry {
                    src: IpAddr::from([10, 244, 1, 5]),
                    dst: "203.0.113.0/24".parse().unwrap(),
                    action: Action::Local,
                    policy: None,
                    group: Some(*id),
                })
                .collect(),
            ..NodeState::default()
        }
    }

    fn eip(state: &NodeState, id: usize) -> IpAddr {
        state.groups[id].eip.unwrap()
    }

    /// Peers `n1` to `n<count>` but `me`, each with a tunnel address.
    fn peers(me: &str, count: u8) -> Vec<Peer> {
        (1..=count)
            .map(|i| format!("n{i}"))
            .filter(|n| n != me)
            .zip(1u8..)
            .map(|(node, i)| Peer {
                node,
                underlay: IpAddr::from([172, 18, 0, 10 + i]),
                mac: Mac([2, 0, 0, 0, 0, i]),
                ipv4: Some(std::net::Ipv4Addr::new(169, 254, 0, i)),
                ipv6: None,
            })
            .collect()
    }

    fn probed(state: &NodeState) -> Vec<String> {
        probe_targets(state).into_iter().map(|t| t.node).collect()
    }

    /// A candidate probes every peer for its quorum; a node that is none
    /// probes the candidates of its groups alone, and with no group none.
    #[test]
    fn only_candidates_probe_every_peer() {
        let mut gateway = two_groups("n1", &[]);
        gateway.peers = peers("n1", 6);
        gateway.groups[0].candidates = vec![candidate("n2"), candidate("n1")];
        gateway.groups[1].candidates = vec![candidate("n1"), candidate("n2")];
        assert!(is_candidate(&gateway));
        assert_eq!(probed(&gateway), ["n2", "n3", "n4", "n5", "n6"]);

        let mut worker = gateway.clone();
        worker.node = "n5".to_owned();
        worker.peers = peers("n5", 6);
        assert!(!is_candidate(&worker));
        assert_eq!(probed(&worker), ["n1", "n2"]);

        worker.groups.clear();
        assert!(probed(&worker).is_empty());
    }

    #[test]
    fn an_eip_is_taken_as_planned_by_its_first_candidate_and_by_failover_by_a_standby() {
        let planned = two_groups("n1", &[]);
        assert_eq!(
            takeover_reason(&planned, eip(&planned, 1)),
            Takeover::Planned
        );
        assert_eq!(
            takeover_reason(&planned, eip(&planned, 0)),
            Takeover::Failover
        );
    }

    #[test]
    fn a_candidate_gives_an_eip_up_for_the_quorum_and_any_other_node_for_the_plan() {
        let planned = two_groups("n1", &[]);
        let cut_off = failover::Quorum {
            reached: 1,
            total: 3,
        };
        let elsewhere = IpAddr::from([198, 51, 100, 200]);
        assert_eq!(
            release_reason(&planned, eip(&planned, 0), cut_off),
            Release::QuorumLost
        );
        assert_eq!(
            release_reason(&planned, elsewhere, cut_off),
            Release::Planned
        );
        let mut moved = planned.clone();
        moved.groups[0].candidates.retain(|c| c.node != "n1");
        assert_eq!(
            release_reason(&moved, eip(&moved, 0), cut_off),
            Release::Planned
        );
    }

    #[test]
    fn traffic_that_left_a_silent_node_counts_once_per_group_this_node_sources() {
        let planned = two_groups("n1", &[0]);
        let previous = BTreeMap::from([
            ("gw/a".to_owned(), "g1".to_owned()),
            ("gw/b".to_owned(), "g1".to_owned()),
        ]);
        let to = |a: Option<&str>, b: Option<&str>| {
            BTreeMap::from([
                ("gw/a".to_owned(), a.map(str::to_owned)),
                ("gw/b".to_owned(), b.map(str::to_owned)),
            ])
        };
        let live = BTreeSet::new();
        let g1 = "g1".to_owned();
        // g1 went silent: gw/a moved here (a failover to recover from);
        // gw/b is not this node's traffic.
        assert_eq!(
            silent_targets_left(&planned, &previous, &to(Some("n1"), Some("n1")), &live),
            [(&g1, true)]
        );
        // Or to no node at all: marked unreachable, nothing to recover to.
        assert_eq!(
            silent_targets_left(&planned, &previous, &to(None, None), &live),
            [(&g1, false)]
        );
        // A move away from a node that still answers is no detection.
        let live = BTreeSet::from(["g1".to_owned()]);
        assert!(silent_targets_left(&planned, &previous, &to(Some("n1"), None), &live).is_empty());
        // Traffic that went nowhere before did not leave anyone.
        let nowhere = BTreeMap::new();
        assert!(
            silent_targets_left(&planned, &nowhere, &to(None, None), &BTreeSet::new()).is_empty()
        );
    }

    #[test]
    fn every_gateway_in_use_is_listed_and_unreachable_while_one_of_its_groups_is() {
        let mut planned = two_groups("n1", &[0, 1]);
        planned.groups.push(Group {
            gateway: "other".to_owned(),
            ..group(2, "other/c", false)
        });
        let mut memory = Memory::default();
        memory.note_unreachable(&planned, &resolved(&planned, &[]));
        assert_eq!(
            gateways_in_use(&planned, &memory.unreachable),
            BTreeMap::from([("gw".to_owned(), false)])
        );
        planned.groups[0].candidates.truncate(1);
        memory.note_unreachable(&planned, &resolved(&planned, &["g1"]));
        assert_eq!(
            gateways_in_use(&planned, &memory.unreachable),
            BTreeMap::from([("gw".to_owned(), true)])
        );
    }

    #[test]
    fn an_eip_in_use_that_a_peer_holds_is_no_longer_in_use() {
        let mut memory = Memory::default();
        let ip = IpAddr::from([198, 51, 100, 169]);
        let other = IpAddr::from([198, 51, 100, 170]);
        for addr in [ip, other] {
            memory.in_use.insert(
                addr,
                InUse {
                    by: "22:e9:47:e4:b7:62 on eth1".into(),
                    checked: Instant::now(),
                    found: Instant::now(),
                    since: k8s_openapi::jiff::Timestamp::now(),
                },
            );
        }
        let mut holders = Holders::new();
        holders.insert(ip, ["node-1".to_owned()].into());
        holders.insert(other, BTreeSet::new());
        memory.forget_in_use_held_by_peers(&holders);
        assert_eq!(memory.in_use.keys().copied().collect::<Vec<_>>(), [other]);
    }

    #[test]
    fn only_groups_this_node_sends_traffic_to_are_reported_unreachable_with_their_outcome() {
        let mut planned = NodeState {
            node: "n1".to_owned(),
            groups: vec![
                group(0, "gw/a", true),
                group(1, "gw/b", false),
                group(2, "gw/c", true),
            ],
            ..NodeState::default()
        };
        // n1 sends traffic to groups 0 and 1; group 2 only passes through.
        for id in [0, 1] {
            planned.classify.push(ClassifyEntry {
                src: IpAddr::from([10, 244, 1, 5]),
                dst: "203.0.113.0/24".parse().unwrap(),
                action: Action::Local,
                policy: None,
                group: Some(id),
            });
        }
        let mut memory = Memory::default();
        memory.note_unreachable(&planned, &resolved(&planned, &["g1"]));
        let keys: Vec<&str> = memory.unreachable.keys().map(String::as_str).collect();
        assert_eq!(keys, ["gw/a", "gw/b"]);
        assert!(memory.unreachable["gw/a"].fail_closed);
        assert!(!memory.unreachable["gw/b"].fail_closed);
        let since = memory.unreachable["gw/a"].since;

        // Still down: the same finding, since when it began.
        memory.note_unreachable(&planned, &resolved(&planned, &["g1"]));
        assert_eq!(memory.unreachable["gw/a"].since, since);

        // The gateway switches to failing open: said anew.
        planned.groups[0].fail_closed = false;
        memory.note_unreachable(&planned, &resolved(&planned, &["g1"]));
        assert!(!memory.unreachable["gw/a"].fail_closed);

        // A candidate answers again: nothing is unreachable.
        memory.note_unreachable(&planned, &resolved(&planned, &[]));
        assert!(memory.unreachable.is_empty());
    }
}

//! Stage 6a: the desired dataplane state of each node.
//!
//! What the cluster-wide stages decided is first resolved into a
//! [`Serving`], owned, which says for each policy and family how its
//! traffic is carried, and what each node has before any pod. Each
//! classified pod address then adds its entries to its own node and to the
//! candidates of its traffic ([`Serving::contribute`]); an agent's
//! [`crate::Planner`] keeps the `Serving` and adds or takes back one
//! address's entries when a pod changes.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use foldhash::fast::RandomState;
use ipnet::IpNet;

use crate::model::{Config, Policy, PolicyRef, Snapshot};
use crate::net::Family;
use crate::state::{
    Action, Candidate, ClassifyEntry, Group, NodeState, OwnedEip, Peer, ReplyRoute, Route, Rule,
    SnatEntry, SnatTo, Vxlan,
};

use super::classify::{Classified, Table};
use super::placement::{Unit, failover_order, unit_for, unit_key};
use super::tunnels::Tunnels;
use super::{Stages, fi};

/// A hash map with a fast hasher, for lookups by node name within a plan.
type FoldMap<K, V> = HashMap<K, V, RandomState>;

/// How the nodes carry each policy's traffic, and each node's state before
/// its pods: what the cluster-wide stages decided, owned.
#[derive(Debug)]
pub(super) struct Serving {
    /// The nodes being built, by name: their state without pods (no
    /// classification, SNAT or reply route) and the groups they have
    /// whatever the pods (the EIPs they may take over).
    pub base: BTreeMap<String, (NodeState, Vec<Arc<Group>>)>,
    /// Per pod node: its name, shared by the entries of its pods, whether
    /// it can send each family through the tunnel, and its tunnel address
    /// of each family.
    facts: FoldMap<String, Facts>,
    /// Per policy (by index) and family: how its traffic is carried.
    policies: Vec<[Option<Served>; 2]>,
    /// The groups of EIPs, by gateway and EIP: a later frame takes over
    /// those it would build alike.
    eip_groups: FoldMap<String, FoldMap<IpAddr, Arc<Carried>>>,
    /// Per usable gateway and family ([`fi`]): the nodes that may carry
    /// its traffic, ready or not, by name. A unit placed without the stages
    /// ([`Serving::new_group`]) finds its candidates there.
    fit: FoldMap<String, [Vec<Fit>; 2]>,
    /// The reply rule, on nodes with reply routes.
    reply_rule: Rule,
    /// The reply table.
    reply_table: u32,
}

/// A pod node's name, shared by the entries of its pods; whether it can
/// send each family through the tunnel; its tunnel address of each family.
type Facts = (Arc<str>, [bool; 2], [Option<IpAddr>; 2]);

/// A node that may carry a gateway's traffic of one family.
#[derive(Debug, Clone)]
struct Fit {
    node: String,
    /// Ready to, besides: a new placement would take it.
    eligible: bool,
    mark: u32,
    /// It has an address of the family (what a `useNodeIP` policy leaves
    /// with).
    addressed: bool,
}

/// How one policy's traffic of one family is carried.
#[derive(Debug, Clone)]
pub(super) struct Served {
    /// The policy, shared with the snapshot planned.
    policy: Arc<Policy>,
    /// Its identity, shared by the entries it decides; made for the first
    /// of them (a frame is built for every change the stages read, and
    /// most policies decide no entry of the node).
    id: OnceLock<Arc<PolicyRef>>,
    fail_closed: bool,
    to: SnatTo,
    /// Its unit's failover group, `None` when no node carries it (its
    /// traffic is then dropped if the gateway fails closed, and left alone
    /// otherwise).
    group: Option<Arc<Carried>>,
}

impl Served {
    /// What its traffic leaves with.
    pub fn to(&self) -> SnatTo {
        self.to
    }

    /// Its unit's failover group; `None` when no node carries it.
    pub fn group(&self) -> Option<&Arc<Group>> {
        self.group.as_ref().map(|c| &c.group)
    }

    /// The policy's identity, shared by the entries it decides.
    fn id(&self) -> Arc<PolicyRef> {
        Arc::clone(self.id.get_or_init(|| Arc::new(self.policy.id.clone())))
    }
}

impl PartialEq for Served {
    /// Alike when they carry the traffic alike for the same policy,
    /// whatever else of the policy differs.
    fn eq(&self, other: &Self) -> bool {
        (Arc::ptr_eq(&self.policy, &other.policy) || self.policy.id == other.policy.id)
            && self.fail_closed == other.fail_closed
            && self.to == other.to
            && self.group == other.group
    }
}

/// A unit's failover group (the `id` is set per node), and which of its
/// candidates have their state built.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Carried {
    group: Arc<Group>,
    built: Vec<bool>,
}

/// One entry a classified pod address gives a node.
#[derive(Debug)]
pub(super) enum Entry {
    /// On the pod's node, with the group its decision follows.
    Classify(ClassifyEntry, Option<Arc<Group>>),
    /// On a node that may carry the traffic.
    Snat(SnatEntry),
    /// On a node that may carry the traffic of another node's pod.
    Reply(ReplyRoute),
}

/// Resolves the cluster-wide stages for the nodes' states: of every node,
/// or of `only` that one. A failover group built alike in `earlier` (the
/// last frame of the same nodes) is taken over rather than built again.
pub(super) fn serving<'a>(
    snapshot: &Snapshot,
    stages: &Stages<'a>,
    only: Option<&str>,
    earlier: Option<&Serving>,
) -> Serving {
    let Stages {
        gateways,
        tunnels,
        cluster_cidrs,
        policies: works,
        placed,
    } = stages;
    let cfg = &snapshot.config;
    let base = base_states(snapshot, tunnels, cluster_cidrs, only);
    let built: FoldMap<&str, ()> = base.iter().map(|s| (s.node.as_str(), ())).collect();
    let mut groups: FoldMap<&Unit<'a>, Arc<Carried>> = FoldMap::default();
    let mut eip_groups: FoldMap<String, FoldMap<IpAddr, Arc<Carried>>> = FoldMap::default();
    let mut keep = |gateway: &str, ip: IpAddr, carried: &Arc<Carried>| {
        let of = match eip_groups.get_mut(gateway) {
            Some(of) => of,
            None => eip_groups.entry(gateway.to_owned()).or_default(),
        };
        of.insert(ip, Arc::clone(carried));
    };
    // Every gateway candidate's mark.
    let marks: FoldMap<&str, u32> = tunnels
        .by_node
        .iter()
        .filter_map(|(node, t)| Some((node.as_str(), t.mark?)))
        .collect();
    let mark = |node: &str| *marks.get(node).expect("gateway candidates have a mark");
    for (unit, candidates) in &placed.candidates {
        let first_user = placed.users[unit][0];
        let fail_closed = works[first_user].fail_closed;
        if let Unit::Eip(gateway, ip) = unit {
            let alike = candidates
                .iter()
                .map(|node| (*node, mark(node), built.contains_key(node)));
            let kept = earlier
                .and_then(|e| e.eip_groups.get(*gateway)?.get(ip))
                .filter(|old| old.alike(fail_closed, alike));
            if let Some(old) = kept {
                keep(gateway, *ip, old);
                groups.insert(unit, Arc::clone(old));
                continue;
            }
        }
        let group = Group {
            id: 0,
            key: unit_key(unit, works),
            gateway: unit.gateway().to_owned(),
            eip: match unit {
                Unit::Eip(_, ip) => Some(*ip),
                Unit::NodeIp(..) => None,
            },
            candidates: candidates
                .iter()
                .map(|node| Candidate {
                    node: (*node).to_owned(),
                    mark: mark(node),
                })
                .collect(),
            fail_closed,
        };
        let carried = Arc::new(Carried {
            built: group
                .candidates
                .iter()
                .map(|c| built.contains_key(c.node.as_str()))
                .collect(),
            group: Arc::new(group),
        });
        if let Unit::Eip(gateway, ip) = unit {
            keep(gateway, *ip, &carried);
        }
        groups.insert(unit, carried);
    }
    let policies = works
        .iter()
        .enumerate()
        .map(|(i, w)| {
            Family::ALL.map(|family| {
                let unit = unit_for(i, w, family)?;
                Some(Served {
                    policy: Arc::clone(w.policy),
                    id: OnceLock::new(),
                    fail_closed: w.fail_closed,
                    to: w.eips[fi(family)].map_or(SnatTo::NodeIp, SnatTo::Eip),
                    group: groups.get(&unit).cloned(),
                })
            })
        })
        .collect();
    let facts = tunnels
        .by_node
        .keys()
        .map(|node| {
            let facts = (
                Arc::from(node.as_str()),
                Family::ALL.map(|f| tunnels.can_send(node, f)),
                Family::ALL.map(|f| tunnels.address(node, f)),
            );
            (node.clone(), facts)
        })
        .collect();
    let addresses: FoldMap<&str, &[IpAddr]> = snapshot
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n.addresses.as_slice()))
        .collect();
    let fit = gateways
        .by_name
        .iter()
        .filter(|(_, info)| info.problem.is_none())
        .map(|(name, info)| {
            let of = Family::ALL.map(|f| {
                info.candidates[fi(f)]
                    .iter()
                    .map(|n| Fit {
                        node: (*n).to_owned(),
                        eligible: info.eligible(n, f),
                        mark: mark(n),
                        addressed: addresses
                            .get(n)
                            .is_some_and(|a| a.iter().any(|ip| Family::of(*ip) == f)),
                    })
                    .collect()
            });
            ((*name).to_owned(), of)
        })
        .collect();
    let base = base
        .into_iter()
        .map(|mut state| {
            // A candidate of an EIP needs its group to take it over; the
            // active node owns it.
            // In the units' order, so that a base built alike is equal.
            let mut own = Vec::new();
            for unit in placed.candidates.keys() {
                let Unit::Eip(gateway, ip) = unit else {
                    continue;
                };
                let group = &groups[unit].group;
                let Some(rank) = group.candidates.iter().position(|c| c.node == state.node) else {
                    continue;
                };
                own.push(Arc::clone(group));
                if rank == 0 {
                    state.eips.push(OwnedEip {
                        ip: *ip,
                        gateway: (*gateway).to_owned(),
                    });
                }
            }
            state.eips.sort();
            state.eips.dedup();
            (state.node.clone(), (state, own))
        })
        .collect();
    Serving {
        base,
        facts,
        policies,
        eip_groups,
        fit,
        reply_rule: Rule {
            priority: cfg.rule_priority,
            mark: cfg.reply_mark(),
            mask: cfg.mark_mask,
            table: cfg.reply_table(),
        },
        reply_table: cfg.reply_table(),
    }
}

impl Carried {
    /// Whether this is the group an EIP's unit would have with the gateway
    /// failing closed or not, and these candidates: (node, mark, whether
    /// its state is built).
    fn alike<'n>(
        &self,
        fail_closed: bool,
        mut candidates: impl ExactSizeIterator<Item = (&'n str, u32, bool)>,
    ) -> bool {
        self.group.fail_closed == fail_closed
            && self.group.candidates.len() == candidates.len()
            && self
                .group
                .candidates
                .iter()
                .zip(&self.built)
                .all(|(c, built)| candidates.next() == Some((c.node.as_str(), c.mark, *built)))
    }
}

impl Serving {
    /// Whether policy `i`'s traffic is carried the same way as that of
    /// policy `j` of `other`.
    pub fn same_policy(&self, i: usize, other: &Serving, j: usize) -> bool {
        self.policies.get(i) == other.policies.get(j)
    }

    /// A policy other than `except` whose traffic of `family` leaves with
    /// the EIP `ip`: one sharing that EIP.
    pub fn user_of(&self, family: Family, ip: IpAddr, except: Option<usize>) -> Option<usize> {
        let eip = SnatTo::Eip(ip);
        (0..self.policies.len()).find(|k| {
            Some(*k) != except
                && self.policies[*k][fi(family)]
                    .as_ref()
                    .is_some_and(|s| s.to == eip)
        })
    }

    /// Whether policy `k`'s traffic of `family` has a node to go to.
    pub fn placed(&self, k: usize, family: Family) -> bool {
        self.policies[k][fi(family)]
            .as_ref()
            .is_some_and(|s| s.group.is_some())
    }

    /// How `policy` is carried in each family when its traffic is carried
    /// as that of the policy `like` says (by index).
    pub fn served_like(
        &self,
        policy: &Arc<Policy>,
        like: [Option<usize>; 2],
    ) -> [Option<Served>; 2] {
        Family::ALL.map(|f| {
            let like = self.policies[like[fi(f)]?][fi(f)].as_ref()?;
            Some(Served {
                policy: Arc::clone(policy),
                id: OnceLock::new(),
                ..like.clone()
            })
        })
    }

    /// How `policy`, of a gateway failing closed or not, is carried in a
    /// family where it leaves with `to`, by `group` (`None`: no node).
    pub fn served(
        policy: &Arc<Policy>,
        fail_closed: bool,
        to: SnatTo,
        group: Option<Arc<Carried>>,
    ) -> Served {
        Served {
            policy: Arc::clone(policy),
            id: OnceLock::new(),
            fail_closed,
            to,
            group,
        }
    }

    /// How policy `k` is carried in each family.
    pub fn served_of(&self, k: usize) -> &[Option<Served>; 2] {
        &self.policies[k]
    }

    /// The policies whose traffic of `family` leaves with the EIP `ip`,
    /// and the group that carries it (`None`: no node).
    pub fn eip_users(&self, family: Family, ip: IpAddr) -> (Vec<usize>, Option<Arc<Carried>>) {
        let eip = SnatTo::Eip(ip);
        let mut group = None;
        let users = (0..self.policies.len())
            .filter(|k| {
                let Some(served) = &self.policies[*k][fi(family)] else {
                    return false;
                };
                if served.to != eip {
                    return false;
                }
                group.clone_from(&served.group);
                true
            })
            .collect();
        (users, group)
    }

    /// Has policy `k`'s traffic of `family` carried by `group` (`None`: no
    /// node).
    pub fn regroup(&mut self, k: usize, family: Family, group: Option<Arc<Carried>>) {
        if let Some(served) = &mut self.policies[k][fi(family)] {
            served.group = group;
        }
    }

    /// The node a group's unit is active on.
    pub fn active(carried: &Carried) -> &str {
        &carried.group.candidates[0].node
    }

    /// Whether the gateway of the policies `users` (one unit's) fails
    /// closed, as the first of them carried says; `None` when there is
    /// none.
    pub fn fails_closed(&self, users: &[usize], family: Family) -> Option<bool> {
        let k = users.first()?;
        Some(self.policies[*k][fi(family)].as_ref()?.fail_closed)
    }

    /// Takes policy `out` out and puts `put` in at its index, carried as
    /// given, as `Matcher::splice` does.
    pub fn splice(&mut self, out: Option<usize>, put: Option<(usize, [Option<Served>; 2])>) {
        if let Some(out) = out {
            self.policies.remove(out);
        }
        if let Some((at, served)) = put {
            self.policies.insert(at, served);
        }
    }

    /// The group of a unit of `gateway` that the stages did not place,
    /// held by `active`: the EIP `eip`'s, or with `eip` `None` that of a
    /// `useNodeIP` policy leaving with the node's address of `families`.
    /// Its standbys are the other nodes that may carry it, as the stages
    /// order them ([`failover_order`]). `None` when `active` may not carry
    /// it.
    pub fn new_group(
        &self,
        key: String,
        gateway: &str,
        eip: Option<IpAddr>,
        families: [bool; 2],
        active: &str,
        fail_closed: bool,
    ) -> Option<Arc<Carried>> {
        let fits = self.fit.get(gateway)?;
        let used: Vec<usize> = match eip {
            Some(ip) => vec![fi(Family::of(ip))],
            None => (0..2).filter(|i| families[*i]).collect(),
        };
        let first = *used.first()?;
        // Each node that may carry every family used, with whether it is
        // not ready and its mark.
        let mut fit: Vec<(bool, &str, u32)> = Vec::new();
        'nodes: for c in &fits[first] {
            let mut ready = true;
            for u in &used {
                let of = &fits[*u];
                let Ok(at) = of.binary_search_by(|e| e.node.as_str().cmp(&c.node)) else {
                    continue 'nodes;
                };
                if eip.is_none() && !of[at].addressed {
                    continue 'nodes;
                }
                ready &= of[at].eligible;
            }
            fit.push((!ready, c.node.as_str(), c.mark));
        }
        fit.iter().find(|(_, n, _)| *n == active)?;
        let order = failover_order(&key, active, fit.iter().map(|(nr, n, _)| (*nr, *n)));
        let candidates: Vec<Candidate> = order
            .iter()
            .map(|n| Candidate {
                node: (*n).to_owned(),
                mark: fit
                    .iter()
                    .find(|(_, f, _)| f == n)
                    .map_or(0, |(_, _, m)| *m),
            })
            .collect();
        let built = candidates
            .iter()
            .map(|c| self.base.contains_key(&c.node))
            .collect();
        Some(Arc::new(Carried {
            group: Arc::new(Group {
                id: 0,
                key,
                gateway: gateway.to_owned(),
                eip,
                candidates,
                fail_closed,
            }),
            built,
        }))
    }

    /// Gives the nodes being built the EIP `ip` of `gateway`, now carried
    /// by `carried`: the candidates its group, the active node the EIP;
    /// whether any of them is built.
    pub fn add_eip(&mut self, gateway: &str, ip: IpAddr, carried: &Arc<Carried>) -> bool {
        self.eip_groups
            .entry(gateway.to_owned())
            .or_default()
            .insert(ip, Arc::clone(carried));
        let mut built = false;
        for (state, own) in self.base.values_mut() {
            let group = &carried.group;
            let Some(rank) = group.candidates.iter().position(|c| c.node == state.node) else {
                continue;
            };
            built = true;
            // In the units' order, as the stages build it.
            let at = own.partition_point(|g| (g.gateway.as_str(), g.eip) < (gateway, Some(ip)));
            own.insert(at, Arc::clone(group));
            if rank == 0 {
                state.eips.push(OwnedEip {
                    ip,
                    gateway: gateway.to_owned(),
                });
                state.eips.sort();
                state.eips.dedup();
            }
        }
        built
    }

    /// Takes the EIP `ip` of `gateway`, which no policy uses any more, out
    /// of the nodes being built; whether any of them had it.
    pub fn drop_eip(&mut self, gateway: &str, ip: IpAddr) -> bool {
        if let Some(of) = self.eip_groups.get_mut(gateway) {
            of.remove(&ip);
            if of.is_empty() {
                self.eip_groups.remove(gateway);
            }
        }
        let mut built = false;
        for (state, own) in self.base.values_mut() {
            let before = own.len();
            own.retain(|g| !(g.gateway == gateway && g.eip == Some(ip)));
            state.eips.retain(|e| !(e.ip == ip && e.gateway == gateway));
            built |= own.len() != before;
        }
        built
    }

    /// The pod nodes whose tunnel facts differ in `other`.
    pub fn nodes_changed(&self, other: &Serving) -> Vec<String> {
        let mut changed: Vec<String> = self
            .facts
            .iter()
            .filter(|(node, facts)| other.facts.get(*node) != Some(*facts))
            .map(|(node, _)| node.clone())
            .collect();
        changed.extend(
            other
                .facts
                .keys()
                .filter(|node| !self.facts.contains_key(*node))
                .cloned(),
        );
        changed
    }

    /// Whether the reply rule and table are those of `other`.
    pub fn same_replies(&self, other: &Serving) -> bool {
        self.reply_rule == other.reply_rule && self.reply_table == other.reply_table
    }
    /// Calls `to` with every entry the pod address `src` on `node`, decided
    /// by `table`, gives a node being built: its node's classification of
    /// each destination (when `here`, the pod's node is built) and, on every
    /// candidate gateway node of its traffic that is built, the SNAT and
    /// the reply route.
    pub fn contribute(
        &self,
        node: &str,
        src: IpAddr,
        table: &Table,
        here: bool,
        mut to: impl FnMut(&str, Entry),
    ) {
        let family = Family::of(src);
        let (origin, can_send, address) = match self.facts.get(node) {
            Some((name, send, address)) => {
                (Arc::clone(name), send[fi(family)], address[fi(family)])
            }
            None => (Arc::from(node), false, None),
        };
        // A node without a tunnel of this family cannot send its pods'
        // traffic to another node: those decisions are left out (or, failing
        // closed, dropped), rather than sent into a missing device.
        for (dst, decided) in table.iter() {
            let classify = |action, policy, group| {
                let entry = ClassifyEntry {
                    src,
                    dst: *dst,
                    action,
                    policy,
                    group: None,
                };
                Entry::Classify(entry, group)
            };
            let Some(w) = *decided else {
                if here {
                    to(node, classify(Action::Bypass, None, None));
                }
                continue;
            };
            let served = self.policies[w][fi(family)]
                .as_ref()
                .expect("classified policies have a unit");
            let Some(carried) = &served.group else {
                // No node at all, and the gateway fails closed.
                if here {
                    let policy = Some(served.id());
                    to(node, classify(Action::Drop, policy, None));
                }
                continue;
            };
            let group = &carried.group;
            let active = &group.candidates[0];
            let local = active.node == node;
            if !local && !can_send && !served.fail_closed {
                continue;
            }
            if here {
                let (action, group_of) = if !local && !can_send {
                    (Action::Drop, None)
                } else if local {
                    (Action::Local, Some(Arc::clone(group)))
                } else {
                    let action = Action::Tunnel {
                        gateway: active.node.clone(),
                        mark: active.mark,
                    };
                    (action, Some(Arc::clone(group)))
                };
                let policy = Some(served.id());
                to(node, classify(action, policy, group_of));
            }
            if !local && !can_send {
                continue;
            }
            // Every candidate is ready to serve this traffic: the data
            // plane may send it to any of them without a new plan.
            for (candidate, built) in group.candidates.iter().zip(&carried.built) {
                let gateway = candidate.node.as_str();
                if !built {
                    continue;
                }
                if gateway != node
                    && let Some(via) = address
                {
                    let reply = ReplyRoute {
                        dst: src,
                        via,
                        origin: Arc::clone(&origin),
                        table: self.reply_table,
                    };
                    to(gateway, Entry::Reply(reply));
                }
                let snat = SnatEntry {
                    src,
                    dst: *dst,
                    to: served.to,
                    origin: Arc::clone(&origin),
                    policy: served.id(),
                };
                to(gateway, Entry::Snat(snat));
            }
        }
    }

    /// `state` (its classification, SNAT and reply routes added to its
    /// base, unsorted) finished: the groups its classification follows and
    /// its base's, numbered by key; the reply rule where replies are
    /// routed; everything in canonical order.
    pub fn finish(
        &self,
        state: &mut NodeState,
        follows: &[Option<Arc<Group>>],
        own: &[Arc<Group>],
    ) {
        let mut groups: Vec<&Arc<Group>> = own.iter().chain(follows.iter().flatten()).collect();
        groups.sort_by(|a, b| a.key.cmp(&b.key));
        groups.dedup_by(|a, b| a.key == b.key);
        state.groups = groups
            .iter()
            .enumerate()
            .map(|(id, g)| Group {
                id: u32::try_from(id).expect("fewer than 2^32 groups"),
                ..Group::clone(g)
            })
            .collect();
        for (entry, group) in state.classify.iter_mut().zip(follows) {
            entry.group = group.as_ref().map(|g| {
                let id = groups
                    .binary_search_by(|o| o.key.cmp(&g.key))
                    .expect("every followed group is numbered");
                u32::try_from(id).expect("fewer than 2^32 groups")
            });
        }
        state.classify.sort();
        let snat = Arc::make_mut(&mut state.snat);
        snat.sort();
        snat.dedup();
        let replies = Arc::make_mut(&mut state.replies);
        replies.sort();
        replies.dedup();
        state.rules.retain(|r| *r != self.reply_rule);
        if !state.replies.is_empty() {
            state.rules.push(self.reply_rule.clone());
        }
        state.rules.sort();
    }
}

/// A node's state being built: the state, the group each classification
/// entry follows, its SNAT entries and its reply routes.
type Building = (
    NodeState,
    Vec<Option<Arc<Group>>>,
    Vec<SnatEntry>,
    Vec<ReplyRoute>,
);

/// Builds the state of the nodes `serving` was resolved for.
pub(super) fn build(serving: &Serving, classified: &Classified<'_>) -> BTreeMap<String, NodeState> {
    let index: FoldMap<&str, usize> = serving
        .base
        .keys()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    // Per node: its state, the group each classification entry follows,
    // and its SNAT entries and reply routes, shared once complete.
    let mut states: Vec<Building> = serving
        .base
        .values()
        .map(|(state, _)| (state.clone(), Vec::new(), Vec::new(), Vec::new()))
        .collect();
    for source in &classified.sources {
        let here = index.contains_key(source.node);
        serving.contribute(
            source.node,
            source.src,
            &source.table,
            here,
            |node, entry| {
                let Some(i) = index.get(node).copied() else {
                    return;
                };
                let (state, follows, snat, replies) = &mut states[i];
                match entry {
                    Entry::Classify(entry, group) => {
                        state.classify.push(entry);
                        follows.push(group);
                    }
                    Entry::Snat(entry) => snat.push(entry),
                    Entry::Reply(route) => replies.push(route),
                }
            },
        );
    }
    states
        .into_iter()
        .zip(serving.base.values())
        .map(|((mut state, follows, snat, replies), (_, own))| {
            state.snat = Arc::new(snat);
            state.replies = Arc::new(replies);
            serving.finish(&mut state, &follows, own);
            (state.node.clone(), state)
        })
        .collect()
}

/// Each node with its tunnel, peers, routes and rules, and nothing else.
fn base_states(
    snapshot: &Snapshot,
    tunnels: &Tunnels,
    cluster_cidrs: &[IpNet],
    only: Option<&str>,
) -> Vec<NodeState> {
    let cfg = &snapshot.config;
    let peers = peers(tunnels);
    let routes = routes(cfg, tunnels);
    let mut names: Vec<&str> = snapshot
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .filter(|n| only.is_none_or(|o| o == *n))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
        .iter()
        .map(|name| {
            let mut state = NodeState {
                node: (*name).to_owned(),
                vxlan: vxlan(cfg, tunnels, name),
                peers: peers.iter().filter(|p| p.node != *name).cloned().collect(),
                routes: routes
                    .iter()
                    .filter(|(r, _)| r.gateway != *name)
                    .map(|(r, _)| r.clone())
                    .collect(),
                rules: routes
                    .iter()
                    .filter(|(r, _)| r.gateway != *name)
                    .map(|(_, r)| r.clone())
                    .collect(),
                cluster_cidrs: cluster_cidrs.to_vec(),
                ..NodeState::default()
            };
            state.peers.sort();
            state.routes.sort();
            state.rules.sort();
            state
        })
        .collect()
}

fn vxlan(cfg: &Config, tunnels: &Tunnels, node: &str) -> Option<Vxlan> {
    let t = tunnels.by_node.get(node)?;
    if t.ipv4.is_none() && t.ipv6.is_none() {
        return None;
    }
    Some(Vxlan {
        name: cfg.vxlan.name.clone(),
        vni: cfg.vxlan.id,
        port: cfg.vxlan.port,
        local: t.underlay?,
        mac: t.mac,
        ipv4: t.ipv4,
        ipv6: t.ipv6,
        ipv4_prefix_len: cfg.tunnel_ipv4_subnet.prefix_len(),
        ipv6_prefix_len: cfg.tunnel_ipv6_subnet.prefix_len(),
        disable_checksum_offload: cfg.vxlan.disable_checksum_offload,
    })
}

fn peers(tunnels: &Tunnels) -> Vec<Peer> {
    tunnels
        .by_node
        .values()
        .filter_map(|t| {
            Some(Peer {
                node: t.node.clone(),
                underlay: t.underlay?,
                mac: t.mac,
                ipv4: t.ipv4,
                ipv6: t.ipv6,
            })
        })
        .collect()
}

/// A route and its rule per gateway-capable node, ordered by table.
fn routes(cfg: &Config, tunnels: &Tunnels) -> Vec<(Route, Rule)> {
    let mut out: Vec<(Route, Rule)> = tunnels
        .by_node
        .values()
        .filter(|t| tunnels.can_carry(&t.node))
        .filter_map(|t| {
            let mark = t.mark?;
            let table = cfg.route_table_base + cfg.mark_index(mark)? - 1;
            Some((
                Route {
                    table,
                    gateway: t.node.clone(),
                    via_ipv4: t.ipv4,
                    via_ipv6: t.ipv6,
                },
                Rule {
                    priority: cfg.rule_priority,
                    mark,
                    mask: cfg.mark_mask,
                    table,
                },
            ))
        })
        .collect();
    out.sort();
    out
}

/// Every in-cluster prefix, aggregated: node pod CIDRs and addresses, service
/// and extra CIDRs, and the tunnel subnets.
pub(super) fn cluster_cidrs(snapshot: &Snapshot) -> Vec<IpNet> {
    let cfg = &snapshot.config;
    let mut nets: Vec<IpNet> = snapshot
        .nodes
        .iter()
        .flat_map(|n| {
            n.pod_cidrs
                .iter()
                .copied()
                .chain(n.addresses.iter().map(|ip| Family::host(*ip)))
        })
        .chain(cfg.service_cidrs.iter().copied())
        .chain(cfg.extra_cluster_cidrs.iter().copied())
        .collect();
    if cfg.enable_ipv4 {
        nets.push(IpNet::V4(cfg.tunnel_ipv4_subnet));
    }
    if cfg.enable_ipv6 {
        nets.push(IpNet::V6(cfg.tunnel_ipv6_subnet));
    }
    let mut nets = IpNet::aggregate(&nets);
    nets.sort();
    nets
}

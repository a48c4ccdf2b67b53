//! An agent's planner that outlives a plan: one Pod's change updates only
//! the entries of that Pod's addresses.
//!
//! The cluster-wide stages (gateways, tunnel identities, EIPs, placement)
//! read no Pod. [`Planner`] runs them when anything but a Pod changes
//! and plans again the Pods their outcome reaches, but for changes that
//! leave their outcome as it was: policies edited in what they do not
//! read, namespaces relabelled where no gateway reads their labels, and
//! one policy added, deleted or replaced that shares its gateway's
//! default EIP with others. It keeps what they decided ([`Serving`]),
//! which policies select each Pod, which Pods claim each address, and the
//! compiled tables. A Pod added, changed or deleted is then matched
//! against the policies of its namespace and the cluster policies alone,
//! and only its addresses' classification, SNAT and reply entries are
//! taken out of the node's state and put back.
//!
//! The result is always what [`super::plan_node_published`] plans from the
//! same objects: a property test checks it after random changes.

use std::collections::{BTreeMap, HashMap, HashSet, hash_map};
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::{Pod, Policy, PolicyRef, Snapshot};
use crate::net::Family;
use crate::state::{ClassifyEntry, Group, NodeState, ReplyRoute, SnatEntry, SnatTo};

use super::classify::{Table, TableAt, Tables};
use super::edits::PolicyChange;
use super::matching::{Matcher, selects_alike};
use super::nodes::{self, Entry, Serving};
use super::{Placement, Stages, eips, fi, placement, stages};

/// A Pod's namespace and name.
type PodKey = (String, String);

/// A hash map with a fast hasher: the keys are the cluster's own names and
/// addresses.
type FoldMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A hash set with the same hasher.
type FoldSet<K> = HashSet<K, foldhash::fast::RandomState>;

/// One node's plan, kept up to date change by change.
#[derive(Debug)]
pub struct Planner {
    node: String,
    /// Every object but the Pods (its `pods` stay empty).
    cluster: Snapshot,
    /// The Pods, by namespace and name.
    pods: FoldMap<Arc<PodKey>, Planned>,
    /// The Pods of each namespace: a change that reaches only some
    /// namespaces visits only their Pods.
    by_namespace: FoldMap<String, FoldSet<Arc<PodKey>>>,
    frame: Frame,
    /// Per pod address: the Pods a policy steers it for, ascending. The
    /// first one's traffic is classified, as in a whole plan.
    claims: FoldMap<IpAddr, Claimants>,
    /// This node's classification entries per address, with the group
    /// each follows.
    classify: BTreeMap<IpAddr, Vec<Followed>>,
    /// The node's state; `None` while the node is not in the cluster.
    /// Shared with whoever took it last ([`Planner::shared_state`]): a
    /// change copies it only while it is, so that the node's state is held
    /// once between changes, not twice.
    state: Option<Arc<NodeState>>,
    last: LastChange,
}

/// How much of the node the last change planned again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LastChange {
    /// The node was planned whole.
    pub whole: bool,
    /// The cluster-wide stages ran again (always when whole).
    pub staged: bool,
    /// The Pods planned again: matched against the policies, or their
    /// entries taken out and put back (every Pod when whole).
    pub pods: usize,
}

/// The Pods claiming one address, ascending: almost always one.
type Claimants = Vec<Arc<PodKey>>;

/// A classification entry and the group it follows.
type Followed = (ClassifyEntry, Option<Arc<Group>>);

/// A Pod and what was planned of it.
#[derive(Debug)]
struct Planned {
    /// Shared with whoever gave it ([`PodChange::Set`]).
    pod: Arc<Pod>,
    /// The policies selecting it, ascending (none when it cannot be
    /// classified).
    selecting: Vec<usize>,
    /// Per address (as in `pod.ips`): its table, when a policy steers it.
    tables: Vec<Option<Table>>,
}

/// What a new frame changes for the Pods already planned.
#[derive(Debug, Default)]
struct FrameChanges {
    /// Every Pod is matched against the policies again (a cluster
    /// policy's selection changed).
    reselect_all: bool,
    /// The namespaces whose Pods are matched again (a namespaced
    /// policy's selection changed, or the namespace was relabelled).
    reselect: HashSet<String>,
    /// The policies whose traffic is steered or carried otherwise.
    steering: HashSet<usize>,
    /// The nodes whose tunnel facts changed: their Pods' entries change.
    nodes: HashSet<String>,
    /// The node's state without Pods changed.
    base: bool,
    /// Where the policies planned before are now, when some were added or
    /// deleted; `None` when they are the same ones in the same order.
    moved: Option<Moved>,
}

/// The policies added or deleted since the last frame, the others in the
/// same order: a Pod's policies are found again by index.
#[derive(Debug)]
struct Moved {
    /// Per policy of the last frame, by index: its index now, `None` when
    /// it was deleted.
    to_new: Vec<Option<usize>>,
    /// The policies added, by index now.
    added: Vec<usize>,
    /// The last frame's tables that the change leaves as they were, with
    /// the indexes of now, by the address of the table they replace.
    tables: FoldMap<TableAt, Table>,
    /// The Pods the policies added may select, by their keys' addresses,
    /// when they are namespaced: only those of their namespaces. `None`:
    /// any Pod (a cluster policy was added).
    reach: Option<FoldSet<*const PodKey>>,
}

/// Past this many policies added at once, the node is planned whole:
/// matching each Pod against each of them would cost more.
const MAX_ADDED: usize = 64;

impl Moved {
    /// Where each of `old` is in `new`, and which of `new` are added, when
    /// the policies kept in both are in the same order and no more than
    /// [`MAX_ADDED`] were added; `None` otherwise.
    fn between(old: &[Arc<Policy>], new: &[Arc<Policy>]) -> Option<Self> {
        let at: FoldMap<&PolicyRef, usize> =
            new.iter().enumerate().map(|(i, p)| (&p.id, i)).collect();
        let to_new: Vec<Option<usize>> = old.iter().map(|p| at.get(&p.id).copied()).collect();
        let mut kept = to_new.iter().flatten();
        let mut last = kept.next();
        for i in kept {
            if last.is_some_and(|l| l >= i) {
                return None;
            }
            last = Some(i);
        }
        if at.len() != new.len() {
            return None;
        }
        let mut was = vec![false; new.len()];
        for i in to_new.iter().flatten() {
            was[*i] = true;
        }
        let added: Vec<usize> = (0..new.len()).filter(|i| !was[*i]).collect();
        (added.len() <= MAX_ADDED).then_some(Self {
            to_new,
            added,
            tables: FoldMap::default(),
            reach: None,
        })
    }

    /// Gives `planned` the indexes of now, and the policies added that
    /// select it; whether its entries may change: a policy selecting it
    /// was deleted or added, or one of its tables was not taken over.
    fn follow(&self, matcher: &Matcher, key: &Arc<PodKey>, planned: &mut Planned) -> bool {
        let mut lost = false;
        planned.selecting.retain_mut(|i| match self.to_new[*i] {
            Some(now) => {
                *i = now;
                true
            }
            None => {
                lost = true;
                false
            }
        });
        let mut gained = false;
        let reached = self
            .reach
            .as_ref()
            .is_none_or(|pods| pods.contains(&Arc::as_ptr(key)));
        for a in self.added.iter().copied().filter(|_| reached) {
            if matcher.selects(a, &planned.pod) {
                let at = planned.selecting.partition_point(|i| *i < a);
                planned.selecting.insert(at, a);
                gained = true;
            }
        }
        if lost || gained {
            return true;
        }
        for table in planned.tables.iter_mut().flatten() {
            match self.tables.get(&Arc::as_ptr(table)) {
                Some(now) => *table = Arc::clone(now),
                None => return true,
            }
        }
        false
    }
}

impl FrameChanges {
    /// The namespaces whose Pods alone these changes can reach, ascending;
    /// `None` when they can reach any Pod: every Pod is matched again,
    /// policies were added or deleted (every Pod's indexes follow), a
    /// node's tunnel facts changed, or a cluster policy is steered
    /// otherwise. A namespaced policy selects Pods of its namespace only.
    fn namespaces(&self, matcher: &Matcher) -> Option<Vec<String>> {
        if self.reselect_all || self.moved.is_some() || !self.nodes.is_empty() {
            return None;
        }
        let mut namespaces: Vec<String> = self.reselect.iter().cloned().collect();
        for i in &self.steering {
            namespaces.push(matcher.policies[*i].id.namespace.clone()?);
        }
        namespaces.sort_unstable();
        namespaces.dedup();
        Some(namespaces)
    }

    /// Matches again the Pods `policy` may select: those of its namespace,
    /// or every Pod for a cluster policy.
    fn reselect_for(&mut self, policy: &Policy) {
        match &policy.id.namespace {
            Some(ns) => {
                self.reselect.insert(ns.clone());
            }
            None => self.reselect_all = true,
        }
    }
}

/// What the cluster-wide stages decided, owned, and the indexes that match
/// one Pod against the policies.
#[derive(Debug)]
struct Frame {
    /// The policies, and Pods matched against them.
    matcher: Matcher,
    tables: Tables,
    serving: Serving,
}

impl Frame {
    /// The frame of `node` in `cluster`; what it would build alike of
    /// `earlier` (the last frame of the node) is taken over.
    fn new(cluster: &Snapshot, node: &str, earlier: Option<&Frame>) -> Self {
        // An agent follows the published placement.
        let stages = stages(cluster, Placement::Published);
        let serving = nodes::serving(cluster, &stages, Some(node), earlier.map(|e| &e.serving));
        let Stages {
            cluster_cidrs,
            policies: works,
            ..
        } = stages;
        let tables = Tables::new(&works, &cluster_cidrs);
        let policies = works.iter().map(|w| Arc::clone(w.policy)).collect();
        Frame {
            matcher: Matcher::new(policies, &cluster.namespaces, earlier.map(|e| &e.matcher)),
            tables,
            serving,
        }
    }

    /// What changed from `old` to this frame, as far as planned Pods are
    /// concerned, taking over the tables it leaves as they were; `None`
    /// when the node must be planned whole: the policies kept are not in
    /// the same order or more than [`MAX_ADDED`] were added, the
    /// in-cluster prefixes or the reply rule changed, or `node` came or
    /// went.
    fn changes_since(&mut self, old: &Frame, node: &str) -> Option<FrameChanges> {
        let (policies, old_policies) = (&self.matcher.policies, &old.matcher.policies);
        let same_ids = policies.len() == old_policies.len()
            && policies.iter().zip(old_policies).all(|(a, b)| a.id == b.id);
        let same_node = self.serving.base.contains_key(node) == old.serving.base.contains_key(node);
        if !same_node
            || !self.tables.same_cluster(&old.tables)
            || !self.serving.same_replies(&old.serving)
        {
            return None;
        }
        let mut moved = match same_ids {
            true => None,
            false => Some(Moved::between(old_policies, policies)?),
        };
        let index_now = |j: usize| moved.as_ref().map_or(Some(j), |m| m.to_new[j]);
        let mut changes = FrameChanges::default();
        for (j, was) in old_policies.iter().enumerate() {
            let Some(i) = index_now(j) else {
                continue;
            };
            let new = &policies[i];
            if !selects_alike(new, was) {
                changes.reselect_for(new);
            }
            if new != was
                || !self.serving.same_policy(i, &old.serving, j)
                || !self.tables.same_policy(i, &old.tables, j)
            {
                changes.steering.insert(i);
            }
        }
        // The tables are taken over whether or not the policies moved: a
        // Pod planned later finds the one it shares with the others.
        let kept: Vec<Option<usize>>;
        let to_new = match &moved {
            Some(moved) => &moved.to_new,
            None => {
                kept = (0..old_policies.len()).map(Some).collect();
                &kept
            }
        };
        let adopted = self.tables.adopt(&old.tables, to_new, &changes.steering);
        if let Some(moved) = &mut moved {
            moved.tables = adopted;
        }
        changes.moved = moved;
        // A relabelled namespace may be taken or left by a cluster policy's
        // namespace selector.
        changes
            .reselect
            .extend(self.matcher.relabelled(&old.matcher));
        changes.nodes = self
            .serving
            .nodes_changed(&old.serving)
            .into_iter()
            .collect();
        changes.base = self.serving.base.get(node) != old.serving.base.get(node);
        Some(changes)
    }

    /// Takes the policies `edited` (see [`super::edits`]) in place of
    /// those of their identities, and says which Pods to plan again: the
    /// edited policies' Pods, and those of the namespaces where their
    /// selectors changed. `None`, changing nothing, when one of them is
    /// not planned.
    fn edit<'p>(
        &mut self,
        edited: impl IntoIterator<Item = &'p Arc<Policy>>,
    ) -> Option<FrameChanges> {
        let edited = edited
            .into_iter()
            .map(|p| Some((self.matcher.position(&p.id)?, p)))
            .collect::<Option<Vec<_>>>()?;
        let mut changes = FrameChanges::default();
        for (i, policy) in edited {
            let old = std::mem::replace(&mut self.matcher.policies[i], Arc::clone(policy));
            if !selects_alike(&old, policy) {
                changes.reselect_for(policy);
            }
            self.tables.edit(i, policy);
            changes.steering.insert(i);
        }
        Some(changes)
    }

    /// Takes `out` out and puts `put` in (the one policy a change took
    /// out, put in or replaced) without running the stages again, when
    /// each is a policy whose outcome of them is its own
    /// ([`eips::Sharing::default_eips`]) and every EIP it shares stays in use by
    /// another policy: what the stages decided for the others, and every
    /// EIP's node and failover order, stay as they were. Says which Pods
    /// to plan again: those `out` selected and those `put` selects.
    /// `None`, changing nothing, otherwise.
    fn swap(
        &mut self,
        cluster: &Snapshot,
        out: Option<&Arc<Policy>>,
        put: Option<&Arc<Policy>>,
    ) -> Option<FrameChanges> {
        // Read apart from the tables, which the swap changes.
        let cidrs = self.tables.cluster_cidrs().to_vec();
        let sharing = eips::Sharing::new(cluster, &cidrs);
        self.swap_shared(&sharing, out, put)
            .or_else(|| self.swap_alone(cluster, &sharing, out, put))
    }

    /// [`Frame::swap`] for policies sharing their gateway's default EIP
    /// with others.
    fn swap_shared(
        &mut self,
        sharing: &eips::Sharing<'_>,
        out: Option<&Arc<Policy>>,
        put: Option<&Arc<Policy>>,
    ) -> Option<FrameChanges> {
        let shared = |policy| sharing.default_eips(policy);
        let policies = &self.matcher.policies;
        let before = |of: &Policy| place_of(policies, of);
        let taken = taken(policies, out)?;
        // Each EIP it left stays another's.
        if let Some(out) = out {
            let alone = shared(out)?;
            for family in Family::ALL {
                if let Some(ip) = alone.eips[fi(family)] {
                    self.serving.user_of(family, ip, taken)?;
                }
            }
        }
        // Each EIP it takes is another's: carried as that one is.
        let put = match put {
            Some(put) => {
                let alone = shared(put)?;
                let mut like = [None, None];
                let mut steers = [false, false];
                for family in Family::ALL {
                    if let Some(ip) = alone.eips[fi(family)] {
                        let k = self.serving.user_of(family, ip, taken)?;
                        like[fi(family)] = Some(k);
                        steers[fi(family)] = self.serving.placed(k, family) || alone.fail_closed;
                    }
                }
                let at = before(put);
                let at = at - usize::from(taken.is_some_and(|t| t < at));
                Some((at, put, like, steers))
            }
            None => None,
        };
        let to_new = spliced(self.matcher.policies.len(), taken, put.map(|(at, ..)| at));
        let put_served = put.map(|(at, p, like, _)| (at, self.serving.served_like(p, like)));
        self.serving.splice(taken, put_served);
        let tables = self.tables.splice(
            &to_new,
            taken,
            put.map(|(at, p, _, steers)| (at, &**p, steers)),
        );
        self.matcher
            .splice(taken, put.map(|(at, p, ..)| (at, Arc::clone(p))));
        let added = put.map(|(at, ..)| at).into_iter().collect();
        Some(FrameChanges {
            moved: Some(Moved {
                to_new,
                added,
                tables,
                reach: None,
            }),
            ..FrameChanges::default()
        })
    }

    /// [`Frame::swap`] for a policy of any allocator whose outcome of the
    /// stages changes no other's ([`eips::Sharing::alone`],
    /// [`eips::Sharing::settled`]): the EIPs it takes or frees are no one
    /// else's to take, and a unit it alone uses goes to the node the
    /// controller published, with the standbys the stages would give it.
    fn swap_alone(
        &mut self,
        cluster: &Snapshot,
        sharing: &eips::Sharing<'_>,
        out: Option<&Arc<Policy>>,
        put: Option<&Arc<Policy>>,
    ) -> Option<FrameChanges> {
        let policies = &self.matcher.policies;
        let before = |of: &Policy| place_of(policies, of);
        let taken = taken(policies, out)?;
        let serving = &self.serving;
        let leaves = |k: usize| {
            serving.served_of(k).each_ref().map(|s| {
                s.as_ref().map(|s| match s.to() {
                    SnatTo::Eip(ip) => Some(ip),
                    SnatTo::NodeIp => None,
                })
            })
        };
        // The addresses that matter: those it held, pins or last held,
        // and those of its gateway's pool, which it may take.
        let mut named: Vec<IpAddr> = Vec::new();
        for policy in out.into_iter().chain(put) {
            named.extend(policy.previous_eips.iter().copied());
            let spec = &policy.egress_ip;
            named.extend(
                spec.ipv4
                    .map(IpAddr::V4)
                    .into_iter()
                    .chain(spec.ipv6.map(IpAddr::V6)),
            );
        }
        if let Some(k) = taken {
            named.extend(leaves(k).into_iter().flatten().flatten());
        }
        let pool = put.and_then(|p| sharing.gateway_of(p));
        let relevant = |ip: IpAddr| {
            named.contains(&ip)
                || pool.is_some_and(|g| {
                    let family = Family::of(ip);
                    g.pool(family).contains(ip) || g.default_eip(family) == Some(ip)
                })
        };
        let others = eips::Others::new(sharing, policies, leaves, taken, relevant);
        let owner = out.or(put)?.id.namespace.as_deref();
        let alone = match put {
            Some(put) => Some(sharing.alone(put, &others)?),
            None => None,
        };
        // Every address whose holder or last holder changes.
        let mut touched: Vec<IpAddr> = Vec::new();
        if let (Some(out), Some(k)) = (out, taken) {
            touched.extend(out.previous_eips.iter().copied());
            touched.extend(leaves(k).into_iter().flatten().flatten());
        }
        if let (Some(put), Some(alone)) = (put, &alone) {
            touched.extend(put.previous_eips.iter().copied());
            touched.extend(alone.eips.iter().flatten().copied());
            // What it takes, or keeps reserved, is held by no other (but
            // those sharing it: by default, or pinned alike).
            let gateway = alone
                .gateway
                .and_then(|g| Some(sharing.gateway(g)?.gateway));
            for family in Family::ALL {
                let Some(ip) = alone.eips[fi(family)] else {
                    continue;
                };
                let default = gateway.is_some_and(|g| g.default_eip(family) == Some(ip));
                let users = others.users(ip);
                if !default && !users.iter().all(|(_, pins)| *pins) {
                    return None;
                }
            }
            if alone.gateway.is_none()
                && put
                    .previous_eips
                    .iter()
                    .any(|ip| !others.users(*ip).is_empty())
            {
                return None;
            }
        }
        touched.sort_unstable();
        touched.dedup();
        if !touched
            .iter()
            .all(|ip| sharing.settled(*ip, owner, &others))
        {
            return None;
        }
        // Stage 4 for its units: the node published, else none.
        let mut new_eips: Vec<(String, IpAddr, Arc<nodes::Carried>)> = Vec::new();
        let put = match (put, alone) {
            (Some(put), Some(alone)) => {
                let mut served = [None, None];
                let mut steers = [false, false];
                if let Some(name) = alone.gateway {
                    let gateway = &sharing.gateway(name)?.gateway;
                    let holder = |ip: IpAddr| {
                        let mut reported =
                            cluster.nodes.iter().filter(|n| n.held_eips.contains(&ip));
                        match (reported.next(), reported.next()) {
                            (Some(node), None) => Some(node.name.as_str()),
                            _ => gateway.previous_nodes.get(&ip).map(String::as_str),
                        }
                    };
                    let node_ip = (alone.node_ip != [false, false])
                        .then(|| {
                            let key = placement::node_ip_key(name, &put.id);
                            let active = put.previous_node.as_deref()?;
                            serving.new_group(
                                key,
                                name,
                                None,
                                alone.node_ip,
                                active,
                                alone.fail_closed,
                            )
                        })
                        .flatten();
                    for family in Family::ALL {
                        let f = fi(family);
                        let (to, group) = if alone.node_ip[f] {
                            (SnatTo::NodeIp, node_ip.clone())
                        } else if let Some(ip) = alone.eips[f] {
                            if let Some((like, _)) = others.users(ip).first() {
                                let mut like_of = [None, None];
                                like_of[f] = Some(*like);
                                served[f] = serving.served_like(put, like_of)[f].take();
                                steers[f] = serving.placed(*like, family) || alone.fail_closed;
                                continue;
                            }
                            let group = holder(ip).and_then(|active| {
                                let key = placement::eip_key(name, ip);
                                let families = [family == Family::Ipv4, family == Family::Ipv6];
                                serving.new_group(
                                    key,
                                    name,
                                    Some(ip),
                                    families,
                                    active,
                                    alone.fail_closed,
                                )
                            });
                            if let Some(group) = &group {
                                new_eips.push((name.to_owned(), ip, Arc::clone(group)));
                            }
                            (SnatTo::Eip(ip), group)
                        } else {
                            continue;
                        };
                        steers[f] = group.is_some() || alone.fail_closed;
                        served[f] = Some(Serving::served(put, alone.fail_closed, to, group));
                    }
                }
                let at = before(put);
                let at = at - usize::from(taken.is_some_and(|t| t < at));
                Some((at, put, served, steers))
            }
            _ => None,
        };
        // The units it alone used go.
        let mut gone: Vec<(String, IpAddr)> = Vec::new();
        if let Some(k) = taken {
            for served in serving.served_of(k).iter().flatten() {
                if let (SnatTo::Eip(ip), Some(group)) = (served.to(), served.group())
                    && others.users(ip).is_empty()
                {
                    gone.push((group.gateway.clone(), ip));
                }
            }
        }
        let to_new = spliced(
            self.matcher.policies.len(),
            taken,
            put.as_ref().map(|(at, ..)| *at),
        );
        let mut base = false;
        for (gateway, ip) in &gone {
            base |= self.serving.drop_eip(gateway, *ip);
        }
        let steering = put.as_ref().map(|(at, p, _, steers)| (*at, &***p, *steers));
        let tables = self.tables.splice(&to_new, taken, steering);
        let added = put.as_ref().map(|(at, ..)| *at).into_iter().collect();
        let matched = put.as_ref().map(|(at, p, ..)| (*at, Arc::clone(p)));
        self.serving
            .splice(taken, put.map(|(at, _, served, _)| (at, served)));
        for (gateway, ip, group) in &new_eips {
            base |= self.serving.add_eip(gateway, *ip, group);
        }
        self.matcher.splice(taken, matched);
        Some(FrameChanges {
            base,
            moved: Some(Moved {
                to_new,
                added,
                tables,
                reach: None,
            }),
            ..FrameChanges::default()
        })
    }

    /// Follows the controller placing EIPs (`moved`, by gateway: the EIPs
    /// whose node the gateways' status names otherwise) without running
    /// the stages: each EIP in use that no single node reports holding
    /// goes to the node named, with the standbys the stages would give it,
    /// and the Pods of its policies are planned again.
    fn republish(&mut self, cluster: &Snapshot, moved: &[(String, IpAddr)]) -> FrameChanges {
        let mut changes = FrameChanges::default();
        for (name, ip) in moved {
            let family = Family::of(*ip);
            let (users, group) = self.serving.eip_users(family, *ip);
            let Some(fail_closed) = self.serving.fails_closed(&users, family) else {
                continue;
            };
            let mut reported = cluster.nodes.iter().filter(|n| n.held_eips.contains(ip));
            let holder = match (reported.next(), reported.next()) {
                (Some(node), None) => Some(node.name.as_str()),
                _ => cluster
                    .gateways
                    .iter()
                    .find(|g| g.name == *name)
                    .and_then(|g| g.previous_nodes.get(ip))
                    .map(String::as_str),
            };
            let now = holder.and_then(|active| {
                let families = [family == Family::Ipv4, family == Family::Ipv6];
                let key = placement::eip_key(name, *ip);
                self.serving
                    .new_group(key, name, Some(*ip), families, active, fail_closed)
            });
            // The same node gives the same group: the candidates and their
            // order are not in what changed.
            if now.as_deref().map(Serving::active) == group.as_deref().map(Serving::active) {
                continue;
            }
            if group.is_some() {
                changes.base |= self.serving.drop_eip(name, *ip);
            }
            if let Some(now) = &now {
                changes.base |= self.serving.add_eip(name, *ip, now);
            }
            for k in users {
                self.serving.regroup(k, family, now.clone());
                let steers = Family::ALL.map(|f| {
                    self.serving.served_of(k)[fi(f)]
                        .as_ref()
                        .is_some_and(|s| s.group().is_some() || fail_closed)
                });
                self.tables.steer(k, steers);
                changes.steering.insert(k);
            }
        }
        changes
    }

    /// Plans the Pod `key` again when `changes` reach it: matched against
    /// the policies again, or its tables found again; whether they did.
    fn replan(
        &mut self,
        changes: &FrameChanges,
        claims: &mut FoldMap<IpAddr, Claimants>,
        key: &Arc<PodKey>,
        planned: &mut Planned,
    ) -> bool {
        // The Pod itself is read only when a change may reach it by its
        // namespace or node: walking every Pod, most of the time goes to
        // reading memory.
        let pod = &planned.pod;
        let reselect = changes.reselect_all
            || (!changes.reselect.is_empty() && changes.reselect.contains(pod.namespace.as_str()));
        let mut reached = reselect
            || (!changes.nodes.is_empty()
                && pod
                    .node
                    .as_deref()
                    .is_some_and(|n| changes.nodes.contains(n)));
        if let Some(moved) = &changes.moved
            && !reselect
        {
            // Followed whether or not the Pod is reached already: its
            // policies' indexes are those of now after this.
            reached |= moved.follow(&self.matcher, key, planned);
        }
        let reached = reached
            || planned
                .selecting
                .iter()
                .any(|i| changes.steering.contains(i));
        if !reached {
            return false;
        }
        unclaim(claims, key, &planned.pod.ips);
        if reselect {
            planned.selecting = self.matcher.select(&planned.pod);
        }
        self.claim(claims, key, planned);
        true
    }

    /// Compiles the tables of `planned`'s addresses that one of its
    /// selecting policies steers, and claims those addresses for it.
    fn claim(
        &mut self,
        claims: &mut FoldMap<IpAddr, Claimants>,
        key: &Arc<PodKey>,
        planned: &mut Planned,
    ) {
        let (tables, policies) = (&mut self.tables, &self.matcher.policies);
        planned.tables.clear();
        if planned.selecting.is_empty() {
            return;
        }
        let mut active = Vec::new();
        for src in &planned.pod.ips {
            tables.active(policies, &planned.selecting, *src, &mut active);
            let table =
                (!active.is_empty()).then(|| tables.table(policies, Family::of(*src), &active));
            if table.is_some() {
                let claimed = claims.entry(*src).or_default();
                if let Err(at) = claimed.binary_search_by(|k| (**k).cmp(&**key)) {
                    claimed.insert(at, Arc::clone(key));
                }
            }
            planned.tables.push(table);
        }
    }
}

impl Planner {
    /// Plans `node` from `snapshot`, as [`super::plan_node_published`]
    /// does.
    pub fn new(mut snapshot: Snapshot, node: &str) -> Self {
        let pods = std::mem::take(&mut snapshot.pods);
        Self::with_pods(snapshot, node, pods.into_iter().map(Arc::new))
    }

    /// [`Planner::new`] with the Pods apart from `snapshot` (whose own are
    /// not read), shared with the caller rather than copied.
    pub fn with_pods(
        mut snapshot: Snapshot,
        node: &str,
        pods: impl IntoIterator<Item = Arc<Pod>>,
    ) -> Self {
        snapshot.pods = Vec::new();
        let pods = pods.into_iter();
        // A filtered iterator's lower bound is 0: its upper one sizes the
        // table once rather than growing it by doubling.
        let (low, high) = pods.size_hint();
        let frame = Frame::new(&snapshot, node, None);
        let mut planner = Planner {
            node: node.to_owned(),
            cluster: snapshot,
            pods: FoldMap::with_capacity_and_hasher(high.unwrap_or(low), Default::default()),
            by_namespace: FoldMap::default(),
            frame,
            claims: FoldMap::default(),
            classify: BTreeMap::new(),
            state: None,
            last: LastChange::default(),
        };
        for pod in pods {
            // Of two Pods of one name, the first stays, as in a whole plan.
            let key = Arc::new((pod.namespace.clone(), pod.name.clone()));
            if let hash_map::Entry::Vacant(vacant) = planner.pods.entry(Arc::clone(&key)) {
                vacant.insert(Planned {
                    pod,
                    selecting: Vec::new(),
                    tables: Vec::new(),
                });
                planner.index(key);
            }
        }
        planner.rebuild();
        planner
    }

    /// The node's state; `None` while the node is not in the cluster.
    pub fn state(&self) -> Option<&NodeState> {
        self.state.as_deref()
    }

    /// How much of the node the last change planned again.
    pub fn last_change(&self) -> LastChange {
        self.last
    }

    /// The node's state, shared rather than copied.
    pub fn shared_state(&self) -> Option<Arc<NodeState>> {
        self.state.clone()
    }

    /// Every object planned but the Pods (its `pods` are empty).
    pub fn cluster(&self) -> &Snapshot {
        &self.cluster
    }

    /// The objects planned: the cluster and the Pods.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = self.cluster.clone();
        snapshot.pods = self.pods.values().map(|p| Pod::clone(&p.pod)).collect();
        snapshot
    }

    /// Replaces every object but the Pods (the Pods of `cluster` are not
    /// read). When only policies changed, and only in their selectors,
    /// destinations, exclusions or priority, what the cluster-wide stages
    /// decided stays and the Pods those policies select, or may now
    /// select, are planned again; likewise the Pods of the namespaces
    /// relabelled, added or deleted when nothing else changed and no
    /// gateway admits namespaces by their labels. Otherwise the cluster-wide stages run
    /// again, and the Pods whose selection or entries they change are
    /// planned again (those of a policy added or deleted among them); the
    /// node as a whole when the policies kept are not in the same order,
    /// many policies were added at once, or the settings or the in-cluster
    /// prefixes changed.
    pub fn set_cluster(&mut self, mut cluster: Snapshot) {
        self.last = LastChange::default();
        cluster.pods = Vec::new();
        // Policies edited in what the stages do not read: what they
        // decided stays, and only the Pods the edits reach are planned.
        if let Some(edited) = super::edits::edited_policies(&self.cluster, &cluster)
            && let Some(changes) = self
                .frame
                .edit(edited.iter().map(|k| &cluster.policies[*k]))
        {
            self.cluster = cluster;
            self.replan(changes);
            return;
        }
        // Namespaces relabelled (or added, or deleted) where no gateway
        // reads their labels: only the Pods of those namespaces may be
        // selected otherwise.
        if super::edits::namespaces_only(&self.cluster, &cluster) {
            let changes = FrameChanges {
                reselect: self
                    .frame
                    .matcher
                    .relabel(&cluster.namespaces)
                    .into_iter()
                    .collect(),
                ..FrameChanges::default()
            };
            self.cluster = cluster;
            self.replan(changes);
            return;
        }
        // The controller placed or moved EIPs, and wrote it in the
        // gateways' status alone: only their policies' Pods are reached.
        if let Some(moved) = super::edits::published_only(&self.cluster, &cluster) {
            let changes = self.frame.republish(&cluster, &moved);
            self.cluster = cluster;
            self.replan(changes);
            return;
        }
        let same_config = cluster.config == self.cluster.config;
        self.cluster = cluster;
        self.restage(same_config);
    }

    /// Carries `changes` out on the policies, in order. Policies edited
    /// only in their selectors, destinations, exclusions or priority are
    /// taken in place, as [`Planner::set_cluster`] takes them; a policy
    /// added, deleted, or edited in what the cluster-wide stages read runs
    /// them again, but for one policy alone sharing its gateway's default
    /// EIP with others, whose own outcome of the stages changes no other
    /// policy's: it is taken out or put in where it was or goes, and only
    /// the Pods it selected or selects are planned again. The caller need
    /// not read or compare every other object.
    pub fn change_policies(&mut self, changes: impl IntoIterator<Item = PolicyChange>) {
        self.last = LastChange::default();
        let applied = super::edits::apply(&mut self.cluster, changes);
        if !applied.restage
            && let Some(changes) = self.frame.edit(&applied.edited)
        {
            self.replan(changes);
        } else if let Some((out, put)) = applied.swap()
            && let Some(changes) = self.frame.swap(&self.cluster, out.as_ref(), put.as_ref())
        {
            self.replan(changes);
        } else if applied.restage || !applied.edited.is_empty() {
            self.restage(true);
        }
    }

    /// Runs the cluster-wide stages on the cluster as it is now and plans
    /// again what their outcome changed; the node whole when it cannot
    /// tell (`same_config` false: the settings changed).
    fn restage(&mut self, same_config: bool) {
        let frame = Frame::new(&self.cluster, &self.node, Some(&self.frame));
        let old = std::mem::replace(&mut self.frame, frame);
        let changes = match same_config {
            true => self.frame.changes_since(&old, &self.node),
            false => None,
        };
        // Freed before the Pods are planned again, not after.
        drop(old);
        match changes {
            Some(changes) => self.replan(changes),
            None => self.rebuild(),
        }
        self.last.staged = true;
    }

    /// Plans again the Pods `changes` reach.
    fn replan(&mut self, mut changes: FrameChanges) {
        if let Some(moved) = &mut changes.moved {
            moved.reach = self.reach(&moved.added);
        }
        let changes = &changes;
        let mut touched = Vec::new();
        let mut pods = 0;
        let frame = &mut self.frame;
        match changes.namespaces(&frame.matcher) {
            // Only some namespaces' Pods can be reached: only they are
            // visited.
            Some(namespaces) => {
                let keys = namespaces
                    .iter()
                    .filter_map(|ns| self.by_namespace.get(ns))
                    .flatten();
                for key in keys {
                    let planned = self.pods.get_mut(key).expect("every indexed Pod is held");
                    if frame.replan(changes, &mut self.claims, key, planned) {
                        pods += 1;
                        touched.extend(planned.pod.ips.iter().copied());
                    }
                }
            }
            None => {
                for (key, planned) in &mut self.pods {
                    if frame.replan(changes, &mut self.claims, key, planned) {
                        pods += 1;
                        touched.extend(planned.pod.ips.iter().copied());
                    }
                }
            }
        }
        if changes.base {
            let base = frame.serving.base.get(&self.node).map(|(s, _)| s);
            if let (Some(state), Some(base)) = (self.state.as_mut().map(Arc::make_mut), base) {
                let mut next = base.clone();
                next.snat = std::mem::take(&mut state.snat);
                next.replies = std::mem::take(&mut state.replies);
                *state = next;
            }
        }
        self.last = LastChange {
            pods,
            ..LastChange::default()
        };
        self.refresh(touched);
    }

    /// The Pods the policies `added` (by index in the frame) may select,
    /// by their keys' addresses: those of their namespaces; `None` when one
    /// is a cluster policy.
    fn reach(&self, added: &[usize]) -> Option<FoldSet<*const PodKey>> {
        let policies = &self.frame.matcher.policies;
        let mut reach = FoldSet::default();
        for a in added {
            let namespace = policies[*a].id.namespace.as_ref()?;
            let keys = self.by_namespace.get(namespace).into_iter().flatten();
            reach.extend(keys.map(Arc::as_ptr));
        }
        Some(reach)
    }

    /// Adds `pod`, or replaces the Pod of its namespace and name.
    pub fn set_pod(&mut self, pod: Pod) {
        self.change_pods([PodChange::Set(Arc::new(pod))]);
    }

    /// Holds each of `pods` in place of the equal Pod held of its name,
    /// planning nothing: a caller that stored a Pod anew unchanged (a
    /// slice written again for another Pod) then holds the only copy. A
    /// Pod that is not the one held of its name is left out: it is a
    /// change ([`Planner::change_pods`]).
    pub fn share_pods(&mut self, pods: impl IntoIterator<Item = Arc<Pod>>) {
        for pod in pods {
            let key = (pod.namespace.clone(), pod.name.clone());
            if let Some(held) = self.pods.get_mut(&key)
                && *held.pod == *pod
            {
                held.pod = pod;
            }
        }
    }

    /// Deletes the Pod `namespace`/`name`, if there is one.
    pub fn remove_pod(&mut self, namespace: &str, name: &str) {
        self.change_pods([PodChange::Removed {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }]);
    }

    /// Carries out `changes` in order, then plans the addresses they
    /// touched once: the node's state is finished (its entries sorted)
    /// once per batch, not once per Pod.
    pub fn change_pods(&mut self, changes: impl IntoIterator<Item = PodChange>) {
        let mut touched = Vec::new();
        let mut pods = 0;
        for change in changes {
            match change {
                PodChange::Set(pod) => {
                    pods += 1;
                    let key = Arc::new((pod.namespace.clone(), pod.name.clone()));
                    touched.extend(self.forget(&key));
                    let selecting = self.frame.matcher.select(&pod);
                    let mut planned = Planned {
                        pod,
                        selecting,
                        tables: Vec::new(),
                    };
                    self.frame.claim(&mut self.claims, &key, &mut planned);
                    touched.extend(planned.pod.ips.iter().copied());
                    // A Pod replaced keeps the key it is indexed by.
                    if self.pods.insert(Arc::clone(&key), planned).is_none() {
                        self.index(key);
                    }
                }
                PodChange::Removed { namespace, name } => {
                    let key = (namespace, name);
                    touched.extend(self.forget(&key));
                    if self.pods.remove(&key).is_some() {
                        pods += 1;
                        self.unindex(&key);
                    }
                }
            }
        }
        self.last = LastChange {
            pods,
            ..LastChange::default()
        };
        if !touched.is_empty() {
            self.refresh(touched);
        }
    }

    /// Adds the Pod `key` to its namespace's.
    fn index(&mut self, key: Arc<PodKey>) {
        match self.by_namespace.get_mut(&key.0) {
            Some(pods) => {
                pods.insert(key);
            }
            None => {
                let namespace = key.0.clone();
                self.by_namespace
                    .insert(namespace, FoldSet::from_iter([key]));
            }
        }
    }

    /// Takes the Pod `key` out of its namespace's.
    fn unindex(&mut self, key: &PodKey) {
        if let Some(pods) = self.by_namespace.get_mut(&key.0) {
            pods.remove(key);
            if pods.is_empty() {
                self.by_namespace.remove(&key.0);
            }
        }
    }

    /// Takes back the claims of the Pod `key`; its addresses.
    fn forget(&mut self, key: &PodKey) -> Vec<IpAddr> {
        let Some(old) = self.pods.get(key) else {
            return Vec::new();
        };
        unclaim(&mut self.claims, key, &old.pod.ips);
        old.pod.ips.clone()
    }

    /// Everything planned again from the frame: selection, claims, state.
    fn rebuild(&mut self) {
        // Selected with the whole plan's indexes, found again by address.
        let (mut selected, _) = self.frame.matcher.select_all(
            self.pods.values().map(|p| &*p.pod),
            &self.cluster.namespaces,
        );
        self.claims.clear();
        self.claims.reserve(self.pods.len());
        self.classify.clear();
        for (key, planned) in &mut self.pods {
            let at: *const Pod = &*planned.pod;
            planned.selecting = selected.remove(&at).unwrap_or_default();
            self.frame.claim(&mut self.claims, key, planned);
        }
        self.state = self
            .frame
            .serving
            .base
            .get(&self.node)
            .map(|(state, _)| Arc::new(state.clone()));
        self.last = LastChange {
            whole: true,
            staged: true,
            pods: self.pods.len(),
        };
        self.fill();
    }

    /// Takes the entries of `addresses` out of the node's state and puts
    /// back those of each one's first claim, then finishes the state.
    fn refresh(&mut self, mut addresses: Vec<IpAddr>) {
        let Some(state) = self.state.as_mut().map(Arc::make_mut) else {
            return;
        };
        addresses.sort_unstable();
        addresses.dedup();
        let taken = |ip: &IpAddr| addresses.binary_search(ip).is_ok();
        Arc::make_mut(&mut state.snat).retain(|e| !taken(&e.src));
        Arc::make_mut(&mut state.replies).retain(|r| !taken(&r.dst));
        let mut adding = Adding::new(&self.frame.serving, &self.node, &mut self.classify);
        for src in addresses.iter().copied() {
            adding.classify.remove(&src);
            let Some(owner) = self.claims.get(&src).and_then(|c| c.first()) else {
                continue;
            };
            let planned = &self.pods[&**owner];
            let table = planned
                .pod
                .ips
                .iter()
                .position(|ip| *ip == src)
                .and_then(|i| planned.tables[i].as_ref());
            if let (Some(pod_node), Some(table)) = (planned.pod.node.as_deref(), table) {
                adding.add(pod_node, src, table);
            }
        }
        adding.finish(state);
    }

    /// Puts the entries of every claimed address into the node's state
    /// (just reset to its base), then finishes the state.
    fn fill(&mut self) {
        let Some(state) = self.state.as_mut().map(Arc::make_mut) else {
            return;
        };
        let mut adding = Adding::new(&self.frame.serving, &self.node, &mut self.classify);
        for (key, planned) in &self.pods {
            let Some(pod_node) = planned.pod.node.as_deref() else {
                continue;
            };
            for (src, table) in planned.pod.ips.iter().zip(&planned.tables) {
                let first = self.claims.get(src).and_then(|c| c.first());
                if let Some(table) = table
                    && first.is_some_and(|first| Arc::ptr_eq(first, key))
                {
                    adding.add(pod_node, *src, table);
                }
            }
        }
        adding.finish(state);
    }
}

/// Where each of `count` policies goes when the one at `out` is taken out
/// and one is put in at `put` (an index after that): `None` for the one
/// taken out.
fn spliced(count: usize, out: Option<usize>, put: Option<usize>) -> Vec<Option<usize>> {
    (0..count)
        .map(|j| {
            let j = match out {
                Some(t) if j == t => return None,
                Some(t) if j > t => j - 1,
                _ => j,
            };
            Some(match put {
                Some(at) if j >= at => j + 1,
                _ => j,
            })
        })
        .collect()
}

/// Where `of` goes among `policies`, in the stages' order: oldest first,
/// then by identity.
fn place_of(policies: &[Arc<Policy>], of: &Policy) -> usize {
    policies.partition_point(|p| (&p.age, &p.id) < (&of.age, &of.id))
}

/// The index of `out` among `policies` (`Some(None)` for none); `None`
/// when it is not there.
fn taken(policies: &[Arc<Policy>], out: Option<&Arc<Policy>>) -> Option<Option<usize>> {
    let Some(out) = out else {
        return Some(None);
    };
    let at = place_of(policies, out);
    policies.get(at).filter(|p| p.id == out.id)?;
    Some(Some(at))
}

/// A change to one Pod, for [`Planner::change_pods`].
#[derive(Debug, Clone, PartialEq)]
pub enum PodChange {
    /// A Pod added, or replacing the Pod of its namespace and name.
    Set(Arc<Pod>),
    /// The Pod of this namespace and name deleted.
    Removed { namespace: String, name: String },
}

/// Entries of classified addresses on their way into a node's state.
struct Adding<'p> {
    serving: &'p Serving,
    node: &'p str,
    classify: &'p mut BTreeMap<IpAddr, Vec<Followed>>,
    snat: Vec<SnatEntry>,
    replies: Vec<ReplyRoute>,
}

impl<'p> Adding<'p> {
    fn new(
        serving: &'p Serving,
        node: &'p str,
        classify: &'p mut BTreeMap<IpAddr, Vec<Followed>>,
    ) -> Self {
        Self {
            serving,
            node,
            classify,
            snat: Vec::new(),
            replies: Vec::new(),
        }
    }

    /// The entries of the address `src` of a pod on `pod_node`.
    fn add(&mut self, pod_node: &str, src: IpAddr, table: &Table) {
        let mut classified = Vec::new();
        let node = self.node;
        let (snat, replies) = (&mut self.snat, &mut self.replies);
        self.serving.contribute(
            pod_node,
            src,
            table,
            pod_node == node,
            |_, entry| match entry {
                Entry::Classify(entry, group) => classified.push((entry, group)),
                Entry::Snat(entry) => snat.push(entry),
                Entry::Reply(route) => replies.push(route),
            },
        );
        if !classified.is_empty() {
            self.classify.insert(src, classified);
        }
    }

    /// `state` with the entries added, finished.
    fn finish(mut self, state: &mut NodeState) {
        Arc::make_mut(&mut state.snat).append(&mut self.snat);
        Arc::make_mut(&mut state.replies).append(&mut self.replies);
        let (classify, follows): (Vec<ClassifyEntry>, Vec<Option<Arc<Group>>>) =
            self.classify.values().flatten().cloned().unzip();
        state.classify = classify;
        let own = self
            .serving
            .base
            .get(self.node)
            .map_or(&[][..], |(_, own)| own.as_slice());
        self.serving.finish(state, &follows, own);
    }
}

/// Takes back the claims of the Pod `key` on `ips`.
fn unclaim(claims: &mut FoldMap<IpAddr, Claimants>, key: &PodKey, ips: &[IpAddr]) {
    for ip in ips {
        if let Some(claimed) = claims.get_mut(ip) {
            claimed.retain(|k| **k != *key);
            if claimed.is_empty() {
                claims.remove(ip);
            }
        }
    }
}

//! The controller's side of planning, kept between reconciles: how many
//! Pods each policy selects (for the status) and which Pods each gateway's
//! nodes need ([`super::plan_published`]), updated Pod by Pod.
//!
//! [`Publisher`] keeps which policies select each Pod, the selected Pods
//! holding each address, and each gateway's Pods. A Pod added, changed or
//! deleted is matched against the policies of its namespace and the
//! cluster policies alone; the Pods sharing an address with it, before
//! and after, are published again as one group. Another object changed
//! runs the cluster-wide stages again, once, for the status too (which
//! then only takes the policies' counts). A policy added, deleted, or
//! changed in its selectors or gateway, or a namespace relabelled, selects
//! again the Pods of the namespaces it may select in, before or after;
//! every Pod, in bulk, when that is most of them.
//!
//! The result is always what [`super::plan_published`] gives for the same
//! objects: a property test checks it after random changes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::{Pod, Policy, PolicyRef, Snapshot};
use crate::status::ClusterStatus;

use super::classify::Classified;
use super::edits::PolicyChange;
use super::matching::{Matcher, selects_alike};
use super::{Placement, Published, Stages, report, stages};

/// A Pod's namespace and name.
type PodKey = (String, String);

type FoldMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type FoldSet<K> = HashSet<K, foldhash::fast::RandomState>;

/// The Pods each policy selects and each gateway's nodes need, kept up to
/// date change by change.
#[derive(Debug)]
pub struct Publisher {
    /// Every object but the Pods (its `pods` stay empty).
    cluster: Snapshot,
    matcher: Matcher,
    /// Per policy (by the matcher's index): the gateway it uses.
    gateway_of: Vec<Option<Arc<str>>>,
    /// The status of `cluster` with no Pods; [`Publisher::status`] puts
    /// the counts in.
    status: ClusterStatus,
    /// Per policy: where `status` has it.
    position: Vec<Option<usize>>,
    /// Per policy: how many Pods it selects.
    counts: Vec<usize>,
    pods: FoldMap<Arc<PodKey>, Held>,
    /// Per address: the selected Pods holding it, ascending.
    holders: FoldMap<IpAddr, Vec<Arc<PodKey>>>,
    /// Per gateway: its Pods.
    gateways: BTreeMap<String, FoldSet<Arc<PodKey>>>,
    /// Per namespace: its Pods.
    namespaces: FoldMap<String, FoldSet<Arc<PodKey>>>,
    /// The gateways whose Pods changed since [`Publisher::take_changed`].
    changed: BTreeSet<String>,
    /// Every Pod is selected again in bulk when more than this share (in
    /// percent) of them is to be selected again.
    bulk_above: usize,
}

/// [`Publisher::bulk_above`] by default: one by one, selecting a Pod again
/// costs about twice what it does in bulk.
const BULK_ABOVE: usize = 50;

/// A Pod and what was decided of it.
#[derive(Debug)]
struct Held {
    /// Shared with whoever gave it ([`Publisher::set_pod`]).
    pod: Arc<Pod>,
    /// The policies selecting it, ascending.
    selecting: Vec<usize>,
    /// The gateways it is published for, ascending.
    published: Vec<Arc<str>>,
}

impl Publisher {
    /// Plans `snapshot`, as [`super::plan_published`] does.
    pub fn new(mut snapshot: Snapshot) -> Self {
        let pods = std::mem::take(&mut snapshot.pods);
        Self::with_pods(snapshot, pods.into_iter().map(Arc::new))
    }

    /// [`Publisher::new`] with the Pods apart from `snapshot` (whose own
    /// are not read), shared with the caller rather than copied.
    pub fn with_pods(mut snapshot: Snapshot, pods: impl IntoIterator<Item = Arc<Pod>>) -> Self {
        snapshot.pods = Vec::new();
        let pods = pods.into_iter();
        let (low, high) = pods.size_hint();
        let Planned {
            matcher,
            gateway_of,
            status,
            position,
        } = planned(&snapshot);
        let mut publisher = Self {
            cluster: snapshot,
            matcher,
            gateway_of,
            status,
            position,
            counts: Vec::new(),
            pods: FoldMap::with_capacity_and_hasher(high.unwrap_or(low), Default::default()),
            holders: FoldMap::default(),
            gateways: BTreeMap::new(),
            namespaces: FoldMap::default(),
            changed: BTreeSet::new(),
            bulk_above: BULK_ABOVE,
        };
        for pod in pods {
            // Of two Pods of one name, the first stays, as in a whole plan.
            let key = Arc::new((pod.namespace.clone(), pod.name.clone()));
            if publisher.pods.contains_key(&key) {
                continue;
            }
            publisher
                .namespaces
                .entry(pod.namespace.clone())
                .or_default()
                .insert(Arc::clone(&key));
            publisher.pods.insert(
                key,
                Held {
                    pod,
                    selecting: Vec::new(),
                    published: Vec::new(),
                },
            );
        }
        publisher.reselect();
        publisher
    }

    /// Every object but the Pods (its `pods` are empty).
    pub fn cluster(&self) -> &Snapshot {
        &self.cluster
    }

    /// The objects planned: the cluster and the Pods.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = self.cluster.clone();
        snapshot.pods = self.pods.values().map(|h| Pod::clone(&h.pod)).collect();
        snapshot
    }

    /// Replaces every object but the Pods (the Pods of `cluster` are not
    /// read). The Pods of the namespaces a changed policy may select in
    /// (before or after), and of relabelled namespaces, are selected
    /// again.
    pub fn set_cluster(&mut self, mut cluster: Snapshot) {
        cluster.pods = Vec::new();
        // Policies edited in what the stages and the status do not read:
        // only their selection may change.
        if let Some(edited) = super::edits::edited_policies(&self.cluster, &cluster)
            && let Some(edits) =
                self.placed(edited.iter().map(|k| Arc::clone(&cluster.policies[*k])))
        {
            self.cluster = cluster;
            self.edit(edits);
            return;
        }
        self.cluster = cluster;
        self.restage();
    }

    /// Carries `changes` out on the policies, in order. Policies edited
    /// only in their selectors, destinations, exclusions or priority are
    /// taken in place, as [`Publisher::set_cluster`] takes them; a policy
    /// added, deleted, or edited in what the cluster-wide stages read runs
    /// them again.
    pub fn change_policies(&mut self, changes: impl IntoIterator<Item = PolicyChange>) {
        let applied = super::edits::apply(&mut self.cluster, changes);
        match self.placed(applied.edited) {
            Some(edits) if !applied.restage => self.edit(edits),
            _ => self.restage(),
        }
    }

    /// `policies`, each with the matcher's index of its identity; `None`
    /// when one is not there.
    fn placed(
        &self,
        policies: impl IntoIterator<Item = Arc<Policy>>,
    ) -> Option<Vec<(usize, Arc<Policy>)>> {
        policies
            .into_iter()
            .map(|p| Some((self.matcher.position(&p.id)?, p)))
            .collect()
    }

    /// Runs the cluster-wide stages on the cluster as it is now, and
    /// selects again the Pods their outcome may select otherwise.
    fn restage(&mut self) {
        let planned = planned(&self.cluster);
        let same =
            planned.matcher.same_selection(&self.matcher) && planned.gateway_of == self.gateway_of;
        if same {
            self.take(planned);
            return;
        }
        let moved = moved(&self.matcher, &planned.matcher);
        let namespaces = self.touched(&planned, &moved);
        if self.bulk(&namespaces) {
            self.take(planned);
            self.reselect();
        } else {
            self.reselect_in(&namespaces, planned, &moved);
        }
    }

    /// Selects Pods again one by one, never in bulk (to test that way).
    #[cfg(test)]
    pub(super) fn never_in_bulk(&mut self) {
        self.bulk_above = usize::MAX / 100;
    }

    /// Adds `pod`, or replaces the Pod of its namespace and name; an
    /// `Arc` given is held, not copied.
    pub fn set_pod(&mut self, pod: impl Into<Arc<Pod>>) {
        let pod: Arc<Pod> = pod.into();
        let key = Arc::new((pod.namespace.clone(), pod.name.clone()));
        let mut group = self.forget(&key);
        let selecting = self.matcher.select(&pod);
        for i in &selecting {
            self.counts[*i] += 1;
        }
        if !selecting.is_empty() {
            for ip in &pod.ips {
                let holders = self.holders.entry(*ip).or_default();
                if let Err(at) = holders.binary_search(&key) {
                    holders.insert(at, Arc::clone(&key));
                }
            }
        }
        self.namespaces
            .entry(pod.namespace.clone())
            .or_default()
            .insert(Arc::clone(&key));
        self.pods.insert(
            Arc::clone(&key),
            Held {
                pod,
                selecting,
                published: Vec::new(),
            },
        );
        group.push(key);
        self.settle(group);
    }

    /// Deletes the Pod `namespace`/`name`, if there is one.
    pub fn remove_pod(&mut self, namespace: &str, name: &str) {
        let key = (namespace.to_owned(), name.to_owned());
        let group = self.forget(&key);
        self.settle(group);
    }

    /// The allocations and status, as [`super::plan_status`] gives them.
    pub fn status(&self) -> ClusterStatus {
        let mut status = self.status.clone();
        for (at, pods) in self.position.iter().zip(&self.counts) {
            if let Some(at) = at {
                report::recount(&mut status.policies[*at], *pods);
            }
        }
        status
    }

    /// The gateways with Pods, by name, and how many each has.
    pub fn gateways(&self) -> impl Iterator<Item = (&str, usize)> {
        self.gateways
            .iter()
            .map(|(g, pods)| (g.as_str(), pods.len()))
    }

    /// The Pods of `gateway`, sorted by namespace and name.
    pub fn pods_of(&self, gateway: &str) -> Vec<&Pod> {
        let mut keys: Vec<&Arc<PodKey>> =
            self.gateways.get(gateway).into_iter().flatten().collect();
        keys.sort_unstable();
        keys.into_iter().map(|key| &*self.pods[key].pod).collect()
    }

    /// [`Publisher::status`] and every gateway's Pods: what
    /// [`super::plan_published`] gives.
    pub fn published(&self) -> Published<'_> {
        Published {
            status: self.status(),
            gateway_pods: self
                .gateways
                .keys()
                .map(|g| (g.clone(), self.pods_of(g)))
                .collect(),
        }
    }

    /// The gateways whose Pods changed (came, went, or changed their
    /// labels, addresses or node) since the last call.
    pub fn take_changed(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.changed)
    }

    /// Takes the Pod `key` out: its counts, its addresses, its gateways.
    /// Returns the Pods that shared an address with it, which may now be
    /// published otherwise.
    fn forget(&mut self, key: &PodKey) -> Vec<Arc<PodKey>> {
        if !self.pods.contains_key(key) {
            return Vec::new();
        }
        let mut group = self.group(key);
        let (key, old) = self.pods.remove_entry(key).expect("checked above");
        if let Some(pods) = self.namespaces.get_mut(&old.pod.namespace) {
            pods.remove(&key);
            if pods.is_empty() {
                self.namespaces.remove(&old.pod.namespace);
            }
        }
        for i in &old.selecting {
            self.counts[*i] -= 1;
        }
        for ip in &old.pod.ips {
            if let Some(holders) = self.holders.get_mut(ip) {
                holders.retain(|k| *k != key);
                if holders.is_empty() {
                    self.holders.remove(ip);
                }
            }
        }
        for gateway in old.published {
            self.unpublish(&gateway, &key);
        }
        group.retain(|k| *k != key);
        group
    }

    /// The selected Pods sharing an address with the Pod `key`, however
    /// far the sharing goes, and `key` itself.
    fn group(&self, key: &PodKey) -> Vec<Arc<PodKey>> {
        let Some((first, held)) = self.pods.get_key_value(key) else {
            return Vec::new();
        };
        // Almost always: an address of its own.
        let alone = held.selecting.is_empty()
            || held
                .pod
                .ips
                .iter()
                .all(|ip| self.holders.get(ip).is_none_or(|h| h.len() <= 1));
        if alone {
            return vec![Arc::clone(first)];
        }
        let mut seen: BTreeSet<Arc<PodKey>> = BTreeSet::from([Arc::clone(first)]);
        let mut next = vec![Arc::clone(first)];
        while let Some(at) = next.pop() {
            let held = &self.pods[&at];
            if held.selecting.is_empty() {
                continue;
            }
            for ip in &held.pod.ips {
                for other in self.holders.get(ip).into_iter().flatten() {
                    if seen.insert(Arc::clone(other)) {
                        next.push(Arc::clone(other));
                    }
                }
            }
        }
        seen.into_iter().collect()
    }

    /// The gateways of every policy selecting one of `group`, ascending.
    fn wanted(&self, group: &[Arc<PodKey>]) -> Vec<Arc<str>> {
        let mut wanted: Vec<&Arc<str>> = group
            .iter()
            .flat_map(|k| &self.pods[k].selecting)
            .filter_map(|i| self.gateway_of[*i].as_ref())
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        wanted.into_iter().cloned().collect()
    }

    /// Publishes each of `keys`, and those sharing an address with it, for
    /// the gateways of every policy selecting one of them.
    fn settle(&mut self, keys: Vec<Arc<PodKey>>) {
        let mut done: BTreeSet<Arc<PodKey>> = BTreeSet::new();
        for key in keys {
            if done.contains(&key) {
                continue;
            }
            let group = self.group(&key);
            let wanted = self.wanted(&group);
            for member in group {
                let held = self.pods.get_mut(&member).expect("a member");
                if held.published == wanted {
                    done.insert(member);
                    continue;
                }
                let old = std::mem::replace(&mut held.published, wanted.clone());
                for gateway in old.iter().filter(|g| !wanted.contains(g)) {
                    self.unpublish(gateway, &member);
                }
                for gateway in wanted.iter().filter(|g| !old.contains(g)) {
                    self.gateways
                        .entry(gateway.to_string())
                        .or_default()
                        .insert(Arc::clone(&member));
                    self.mark(gateway);
                }
                done.insert(member);
            }
        }
    }

    /// Notes that `gateway`'s Pods changed.
    fn mark(&mut self, gateway: &str) {
        if !self.changed.contains(gateway) {
            self.changed.insert(gateway.to_owned());
        }
    }

    fn unpublish(&mut self, gateway: &str, key: &PodKey) {
        if let Some(pods) = self.gateways.get_mut(gateway) {
            pods.remove(key);
            if pods.is_empty() {
                self.gateways.remove(gateway);
            }
        }
        self.mark(gateway);
    }

    /// Keeps what the stages decided of the cluster.
    fn take(&mut self, planned: Planned) {
        self.matcher = planned.matcher;
        self.gateway_of = planned.gateway_of;
        self.status = planned.status;
        self.position = planned.position;
    }

    /// The namespaces with Pods that a policy added, deleted, or changed
    /// in its selectors or gateway may select in, before or after; and
    /// those relabelled. `moved`: see [`moved`].
    fn touched(&self, planned: &Planned, moved: &[Option<usize>]) -> BTreeSet<String> {
        let (old, new) = (&self.matcher, &planned.matcher);
        let mut changed: Vec<(&Matcher, usize)> = Vec::new();
        let mut kept = vec![false; new.policies.len()];
        for (i, p) in old.policies.iter().enumerate() {
            match moved[i] {
                None => changed.push((old, i)),
                Some(j) => {
                    kept[j] = true;
                    let q = &new.policies[j];
                    if !selects_alike(p, q) || self.gateway_of[i] != planned.gateway_of[j] {
                        changed.push((old, i));
                        changed.push((new, j));
                    }
                }
            }
        }
        changed.extend((0..kept.len()).filter(|j| !kept[*j]).map(|j| (new, j)));
        let mut touched: BTreeSet<String> = old.relabelled(new).into_iter().collect();
        for ns in self.namespaces.keys() {
            if !touched.contains(ns) && changed.iter().any(|(m, i)| m.takes_namespace(*i, ns)) {
                touched.insert(ns.clone());
            }
        }
        touched
    }

    /// Takes the policies `edits` (by index) in place of the policies
    /// there, edited in what the stages do not read (`super::edits`); the
    /// Pods of the namespaces where one's selection may have changed are
    /// selected again.
    fn edit(&mut self, edits: Vec<(usize, Arc<Policy>)>) {
        let mut changed: Vec<&Policy> = Vec::new();
        for (i, policy) in &edits {
            let old = &self.matcher.policies[*i];
            if !selects_alike(old, policy) {
                changed.extend([&**old, &**policy]);
            }
        }
        let namespaces: BTreeSet<String> = self
            .namespaces
            .keys()
            .filter(|ns| {
                changed
                    .iter()
                    .any(|p| self.matcher.policy_takes_namespace(p, ns))
            })
            .cloned()
            .collect();
        let bulk = self.bulk(&namespaces);
        let keys = if bulk {
            Vec::new()
        } else {
            self.keys_in(&namespaces)
        };
        let settle = self.unselect(&keys);
        for (i, policy) in edits {
            self.matcher.policies[i] = policy;
        }
        if bulk {
            self.reselect();
        } else {
            self.select_again(&keys, settle);
        }
    }

    /// Whether the Pods of `namespaces` are most of them: selecting every
    /// Pod again in bulk then costs less than selecting those one by one.
    fn bulk(&self, namespaces: &BTreeSet<String>) -> bool {
        let pods: usize = namespaces
            .iter()
            .filter_map(|ns| self.namespaces.get(ns))
            .map(FoldSet::len)
            .sum();
        pods * 100 > self.pods.len() * self.bulk_above
    }

    /// The Pods of `namespaces`.
    fn keys_in(&self, namespaces: &BTreeSet<String>) -> Vec<Arc<PodKey>> {
        namespaces
            .iter()
            .filter_map(|ns| self.namespaces.get(ns))
            .flatten()
            .cloned()
            .collect()
    }

    /// Takes `planned`, selecting again the Pods of `namespaces` (which
    /// hold every Pod a policy that changed selects or selected), and
    /// publishing again them and the Pods sharing an address with them.
    /// `moved`: see [`moved`].
    fn reselect_in(
        &mut self,
        namespaces: &BTreeSet<String>,
        planned: Planned,
        moved: &[Option<usize>],
    ) {
        let keys = self.keys_in(namespaces);
        let settle = self.unselect(&keys);
        // The others are selected by policies that did not change: only
        // their indexes may move.
        let mut counts = vec![0; planned.matcher.policies.len()];
        for (i, n) in self.counts.iter().enumerate() {
            if let Some(j) = moved[i] {
                counts[j] += n;
            }
        }
        if moved.iter().enumerate().any(|(i, j)| *j != Some(i)) {
            for held in self.pods.values_mut() {
                held.selecting = held.selecting.iter().filter_map(|i| moved[*i]).collect();
                held.selecting.sort_unstable();
            }
        }
        self.counts = counts;
        self.take(planned);
        self.select_again(&keys, settle);
    }

    /// Takes the selection of the Pods `keys` back: their counts and
    /// their addresses' holders. Returns them and the Pods sharing an
    /// address with them, to be published again.
    fn unselect(&mut self, keys: &[Arc<PodKey>]) -> BTreeSet<Arc<PodKey>> {
        let mut settle: BTreeSet<Arc<PodKey>> = BTreeSet::new();
        for key in keys {
            settle.extend(self.group(key));
        }
        for key in keys {
            let held = self.pods.get_mut(key).expect("indexed by namespace");
            let selecting = std::mem::take(&mut held.selecting);
            for i in &selecting {
                self.counts[*i] -= 1;
            }
            if !selecting.is_empty() {
                for ip in &held.pod.ips {
                    if let Some(holders) = self.holders.get_mut(ip) {
                        holders.retain(|k| k != key);
                        if holders.is_empty() {
                            self.holders.remove(ip);
                        }
                    }
                }
            }
        }
        settle
    }

    /// Selects the Pods `keys` again with the policies as they are now,
    /// and publishes again them, the Pods sharing an address with them,
    /// and `settle`.
    fn select_again(&mut self, keys: &[Arc<PodKey>], mut settle: BTreeSet<Arc<PodKey>>) {
        for key in keys {
            let held = self.pods.get_mut(key).expect("indexed by namespace");
            held.selecting = self.matcher.select(&held.pod);
            for i in &held.selecting {
                self.counts[*i] += 1;
            }
            if !held.selecting.is_empty() {
                for ip in &held.pod.ips {
                    let holders = self.holders.entry(*ip).or_default();
                    if let Err(at) = holders.binary_search(key) {
                        holders.insert(at, Arc::clone(key));
                    }
                }
            }
        }
        for key in keys {
            settle.extend(self.group(key));
        }
        self.settle(settle.into_iter().collect());
    }

    /// Selects every Pod again, and publishes each.
    fn reselect(&mut self) {
        let (mut selected, counts) = self.matcher.select_all(
            self.pods.values().map(|h| &*h.pod),
            &self.cluster.namespaces,
        );
        self.counts = counts;
        self.holders.clear();
        for (key, held) in &mut self.pods {
            let at: *const Pod = &*held.pod;
            held.selecting = selected.remove(&at).unwrap_or_default();
            if !held.selecting.is_empty() {
                for ip in &held.pod.ips {
                    self.holders.entry(*ip).or_default().push(Arc::clone(key));
                }
            }
        }
        for holders in self.holders.values_mut() {
            holders.sort_unstable();
        }
        // Every Pod's gateways anew, in bulk; then what changed is noted.
        let mut gateways: BTreeMap<String, FoldSet<Arc<PodKey>>> = BTreeMap::new();
        let mut done: FoldSet<Arc<PodKey>> = FoldSet::default();
        let keys: Vec<Arc<PodKey>> = self.pods.keys().cloned().collect();
        for key in keys {
            if done.contains(&key) {
                continue;
            }
            let group = self.group(&key);
            let wanted = self.wanted(&group);
            let shared = group.len() > 1;
            for member in group {
                for gateway in &wanted {
                    match gateways.get_mut(&**gateway) {
                        Some(pods) => pods.insert(Arc::clone(&member)),
                        None => gateways
                            .entry(gateway.to_string())
                            .or_default()
                            .insert(Arc::clone(&member)),
                    };
                }
                self.pods.get_mut(&member).expect("a member").published = wanted.clone();
                if shared {
                    done.insert(member);
                }
            }
        }
        let old = std::mem::replace(&mut self.gateways, gateways);
        for name in old.keys().chain(self.gateways.keys()) {
            if old.get(name) != self.gateways.get(name) && !self.changed.contains(name) {
                self.changed.insert(name.clone());
            }
        }
    }
}

/// Per policy of `old`: its index among the policies of `new` (by id),
/// `None` for one deleted.
fn moved(old: &Matcher, new: &Matcher) -> Vec<Option<usize>> {
    let at: HashMap<&PolicyRef, usize> = new
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| (&p.id, i))
        .collect();
    old.policies
        .iter()
        .map(|p| at.get(&p.id).copied())
        .collect()
}

/// What the cluster-wide stages decide of a cluster, as a publisher keeps
/// it.
struct Planned {
    /// The policies as the stages order them.
    matcher: Matcher,
    /// The gateway each uses.
    gateway_of: Vec<Option<Arc<str>>>,
    /// The status with no Pods.
    status: ClusterStatus,
    /// Where `status` has each policy.
    position: Vec<Option<usize>>,
}

/// Runs the cluster-wide stages on `cluster` (whose Pods are not read).
fn planned(cluster: &Snapshot) -> Planned {
    let Stages {
        gateways,
        tunnels,
        policies,
        placed,
        ..
    } = stages(cluster, Placement::Own);
    let classified = Classified {
        sources: Vec::new(),
        pod_counts: vec![0; policies.len()],
    };
    let status = report::status(
        cluster,
        &gateways,
        &tunnels,
        &policies,
        &placed,
        &classified,
    );
    let at: HashMap<&PolicyRef, usize> = status
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| (&p.policy, i))
        .collect();
    let position = policies
        .iter()
        .map(|w| at.get(&w.policy.id).copied())
        .collect();
    let gateway_of = policies.iter().map(|w| w.gateway.map(Arc::from)).collect();
    let selecting = policies.iter().map(|w| Arc::clone(w.policy)).collect();
    Planned {
        matcher: Matcher::new(selecting, &cluster.namespaces, None),
        gateway_of,
        status,
        position,
    }
}

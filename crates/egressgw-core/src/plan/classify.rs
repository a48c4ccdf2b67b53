//! Stage 5: which pods each policy selects, and per pod address the
//! longest-prefix table that decides where its traffic goes.
//!
//! Pods that match the same set of policies share one compiled table.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::model::{Labels, Pod, PodMatch, Policy, Snapshot};
use crate::net::{Family, net_contains};
use crate::precedence::{self, Candidate};

use super::{Work, fi};

/// A compiled table: (destination prefix, deciding policy index or `None`).
pub(super) type Table = Arc<Vec<(IpNet, Option<usize>)>>;

/// The address of a compiled table, to find it by.
pub(super) type TableAt = *const Vec<(IpNet, Option<usize>)>;

/// One classified pod address.
#[derive(Debug)]
pub(super) struct Source<'a> {
    /// The pod's node.
    pub node: &'a str,
    /// The pod address.
    pub src: IpAddr,
    /// Its table.
    pub table: Table,
}

/// The result of classification.
#[derive(Debug, Default)]
pub(super) struct Classified<'a> {
    /// Pod addresses with at least one active policy, sorted by pod.
    pub sources: Vec<Source<'a>>,
    /// Per policy (by index), how many pods it selects.
    pub pod_counts: Vec<usize>,
}

/// The compiled tables of a plan, by the policies that decide them, and
/// what compiling them needs of each policy. An agent's planner keeps them
/// while the policies stay.
#[derive(Debug)]
pub(super) struct Tables {
    /// Per policy (by index): its destinations per family.
    dests: Vec<[Vec<IpNet>; 2]>,
    /// Per policy: whether the stages have it steer each family.
    steers: Vec<[bool; 2]>,
    /// Per policy: whether it steers each family at all (it steers it and
    /// has destinations in it).
    usable: Vec<[bool; 2]>,
    cluster_cidrs: Vec<IpNet>,
    /// Per family: the tables compiled so far.
    compiled: [FoldMap<Vec<usize>, Table>; 2],
}

impl Tables {
    /// Whether what compiling policy `i`'s tables needs is what it needs
    /// of policy `j` of `other`.
    pub fn same_policy(&self, i: usize, other: &Tables, j: usize) -> bool {
        self.dests.get(i) == other.dests.get(j) && self.usable.get(i) == other.usable.get(j)
    }

    /// Whether the in-cluster prefixes are those of `other`.
    pub fn same_cluster(&self, other: &Tables) -> bool {
        self.cluster_cidrs == other.cluster_cidrs
    }

    pub fn new(works: &[Work<'_>], cluster_cidrs: &[IpNet]) -> Self {
        let dests: Vec<[Vec<IpNet>; 2]> = works.iter().map(|w| expand_dests(w.policy)).collect();
        let steers: Vec<[bool; 2]> = works
            .iter()
            .map(|w| Family::ALL.map(|f| w.active(f)))
            .collect();
        let usable = steers
            .iter()
            .zip(&dests)
            .map(|(steers, dests)| usable(*steers, dests))
            .collect();
        Self {
            dests,
            steers,
            usable,
            cluster_cidrs: cluster_cidrs.to_vec(),
            compiled: Default::default(),
        }
    }

    /// Takes over the tables of `old` that none of the policies `changed`
    /// (indexes here) took part in, reading each policy index `j` of `old`
    /// as `to_new[j]`. The policies kept their order, so each table taken
    /// over is what compiling it here would give: the same table when its
    /// policies' indexes stay, a renumbered copy otherwise. A table no Pod
    /// holds any more is left behind. Returns each table taken over by the
    /// address of the table of `old` it replaces.
    pub fn adopt(
        &mut self,
        old: &Tables,
        to_new: &[Option<usize>],
        changed: &HashSet<usize>,
    ) -> FoldMap<TableAt, Table> {
        let mut adopted = FoldMap::default();
        for (compiled, old_compiled) in self.compiled.iter_mut().zip(&old.compiled) {
            for (active, table) in old_compiled {
                // Held by the old cache alone.
                if Arc::strong_count(table) == 1 {
                    continue;
                }
                let Some(now) = active
                    .iter()
                    .map(|j| to_new[*j].filter(|i| !changed.contains(i)))
                    .collect::<Option<Vec<usize>>>()
                else {
                    continue;
                };
                let taken = if now == *active {
                    Arc::clone(table)
                } else {
                    let renumbered = table.iter().map(|(net, w)| {
                        let w = w.map(|j| to_new[j].expect("its policies are all kept"));
                        (*net, w)
                    });
                    Arc::new(renumbered.collect())
                };
                adopted.insert(Arc::as_ptr(table), Arc::clone(&taken));
                compiled.insert(now, taken);
            }
        }
        adopted
    }

    /// The in-cluster prefixes.
    pub fn cluster_cidrs(&self) -> &[IpNet] {
        &self.cluster_cidrs
    }

    /// Takes policy `out` out and puts `put` in at its index, with whether
    /// the stages have it steer each family, as `Matcher::splice` does;
    /// `to_new` says where each policy was before. The tables compiled so
    /// far are taken over renumbered, as [`Tables::adopt`] takes them,
    /// and returned the same way; those `out` took part in are left.
    pub fn splice(
        &mut self,
        to_new: &[Option<usize>],
        out: Option<usize>,
        put: Option<(usize, &Policy, [bool; 2])>,
    ) -> FoldMap<TableAt, Table> {
        let mut next = Tables {
            dests: std::mem::take(&mut self.dests),
            steers: std::mem::take(&mut self.steers),
            usable: std::mem::take(&mut self.usable),
            cluster_cidrs: std::mem::take(&mut self.cluster_cidrs),
            compiled: Default::default(),
        };
        if let Some(out) = out {
            next.dests.remove(out);
            next.steers.remove(out);
            next.usable.remove(out);
        }
        if let Some((at, policy, steers)) = put {
            let dests = expand_dests(policy);
            next.usable.insert(at, usable(steers, &dests));
            next.dests.insert(at, dests);
            next.steers.insert(at, steers);
        }
        let old = std::mem::replace(self, next);
        self.adopt(&old, to_new, &HashSet::new())
    }

    /// Takes policy `i` edited in what the stages do not read (see
    /// `super::edits`): its destinations again, and none of the tables it
    /// took part in.
    pub fn edit(&mut self, i: usize, policy: &Policy) {
        self.dests[i] = expand_dests(policy);
        self.usable[i] = usable(self.steers[i], &self.dests[i]);
        for compiled in &mut self.compiled {
            compiled.retain(|active, _| !active.contains(&i));
        }
    }

    /// Has policy `i` steer each family as `steers` says (its unit got a
    /// node or lost it); the tables it took part in go.
    pub fn steer(&mut self, i: usize, steers: [bool; 2]) {
        if self.steers[i] == steers {
            return;
        }
        self.steers[i] = steers;
        self.usable[i] = usable(steers, &self.dests[i]);
        for compiled in &mut self.compiled {
            compiled.retain(|active, _| !active.contains(&i));
        }
    }

    /// Into `out`: the policies among `selecting` (ascending indexes of
    /// `policies`, the ones selecting a pod) that steer the pod's address
    /// `src`. A podSubnet policy steers only the addresses inside its
    /// subnets.
    pub fn active<P: Borrow<Policy>>(
        &self,
        policies: &[P],
        selecting: &[usize],
        src: IpAddr,
        out: &mut Vec<usize>,
    ) {
        let family = fi(Family::of(src));
        out.clear();
        out.extend(selecting.iter().copied().filter(|i| {
            self.usable[*i][family]
                && match &policies[*i].borrow().pods {
                    PodMatch::Subnets(nets) => nets.iter().any(|n| n.contains(&src)),
                    PodMatch::Selector(_) => true,
                }
        }));
    }

    /// The table of an address of `family` that the policies `active`
    /// steer, compiled once.
    pub fn table<P: Borrow<Policy>>(
        &mut self,
        policies: &[P],
        family: Family,
        active: &[usize],
    ) -> Table {
        if let Some(table) = self.compiled[fi(family)].get(active) {
            return Arc::clone(table);
        }
        let candidates: Vec<Candidate<'_>> = active
            .iter()
            .map(|i| Candidate {
                dests: &self.dests[*i][fi(family)],
                excludes: &policies[*i].borrow().exclude_subnets,
                priority: policies[*i].borrow().priority,
            })
            .collect();
        // Entries wholly inside the cluster are dead: the dataplane lets
        // in-cluster traffic pass before it classifies.
        let cluster = &self.cluster_cidrs;
        let compiled: Table = Arc::new(
            precedence::compile(family, &candidates)
                .into_iter()
                .filter(|(net, _)| !cluster.iter().any(|c| net_contains(c, net)))
                .map(|(net, w)| (net, w.map(|k| active[k])))
                .collect(),
        );
        self.compiled[fi(family)].insert(active.to_vec(), Arc::clone(&compiled));
        compiled
    }
}

/// The eligible pods, sorted by namespace and name, and which policies
/// select each.
pub(super) struct Selection<'a> {
    /// The pods.
    pub pods: Vec<&'a Pod>,
    /// Per pod: the indexes of the policies selecting it, ascending.
    pub selecting: Vec<Vec<usize>>,
    /// Per policy: how many pods it selects.
    pub counts: Vec<usize>,
}

/// Which of `pods` each of `policies` selects.
pub(super) fn select<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    policies: &[&Policy],
    namespaces: &[crate::model::Namespace],
) -> Selection<'a> {
    let pods = eligible_pods(pods);
    let no_labels = Labels::new();
    let ns_labels: HashMap<&str, &Labels> = namespaces
        .iter()
        .map(|n| (n.name.as_str(), &n.labels))
        .collect();

    let mut counts = vec![0; policies.len()];
    let mut selecting: Vec<Vec<usize>> = vec![Vec::new(); pods.all.len()];
    for (i, policy) in policies.iter().enumerate() {
        let select = |group: &Namespace<'_>| {
            group.select(&pods.all, &policy.pods, |p| {
                counts[i] += 1;
                selecting[p].push(i);
            });
        };
        match (&policy.id.namespace, &policy.namespace_selector) {
            (Some(own), _) => pods.namespace(own).into_iter().for_each(select),
            // A cluster policy looks at the namespaces its selector takes,
            // each decided once rather than per pod.
            (None, Some(selector)) => pods
                .namespaces
                .iter()
                .filter(|g| selector.matches(ns_labels.get(g.name).copied().unwrap_or(&no_labels)))
                .for_each(select),
            (None, None) => pods.namespaces.iter().for_each(select),
        }
    }
    Selection {
        pods: pods.all,
        selecting,
        counts,
    }
}

/// Selects pods and counts them, compiling no table: what the status needs.
pub(super) fn count<'a>(snapshot: &'a Snapshot, works: &[Work<'a>]) -> Classified<'a> {
    let policies: Vec<&Policy> = works.iter().map(|w| &**w.policy).collect();
    Classified {
        sources: Vec::new(),
        pod_counts: select(&snapshot.pods, &policies, &snapshot.namespaces).counts,
    }
}

/// Selects pods and compiles their tables.
pub(super) fn classify<'a>(
    snapshot: &'a Snapshot,
    works: &[Work<'a>],
    cluster_cidrs: &[IpNet],
) -> Classified<'a> {
    let policies: Vec<&Policy> = works.iter().map(|w| &**w.policy).collect();
    let selection = select(&snapshot.pods, &policies, &snapshot.namespaces);
    let mut tables = Tables::new(works, cluster_cidrs);
    let mut active: Vec<usize> = Vec::new();
    let mut sources = Vec::new();
    let mut seen: HashSet<IpAddr, foldhash::fast::RandomState> = HashSet::default();
    for (pod, selecting) in selection.pods.iter().zip(&selection.selecting) {
        for src in &pod.ips {
            tables.active(&policies, selecting, *src, &mut active);
            // An address claimed by two pods (a stale object) goes to the first.
            if active.is_empty() || !seen.insert(*src) {
                continue;
            }
            let table = tables.table(&policies, Family::of(*src), &active);
            let node = pod.node.as_deref().expect("eligible pods are scheduled");
            sources.push(Source {
                node,
                src: *src,
                table,
            });
        }
    }
    Classified {
        sources,
        pod_counts: selection.counts,
    }
}

/// Destinations per family; an empty `destSubnet` means the whole family.
fn expand_dests(policy: &Policy) -> [Vec<IpNet>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    if policy.dest_subnets.is_empty() {
        for family in Family::ALL {
            out[fi(family)].push(family.everything());
        }
    }
    for net in &policy.dest_subnets {
        out[fi(Family::of_net(*net))].push(*net);
    }
    out
}

/// Per family: whether a policy the stages have steer it, with `dests`,
/// steers any of it.
fn usable(steers: [bool; 2], dests: &[Vec<IpNet>; 2]) -> [bool; 2] {
    Family::ALL.map(|f| steers[fi(f)] && !dests[fi(f)].is_empty())
}

/// Whether a pod can be classified: scheduled, with an address, not
/// host-network.
pub(super) fn eligible(pod: &Pod) -> bool {
    pod.node.is_some() && !pod.ips.is_empty() && !pod.host_network
}

pub(super) fn selects(pods: &PodMatch, pod: &Pod) -> bool {
    match pods {
        PodMatch::Selector(s) => s.matches(&pod.labels),
        PodMatch::Subnets(nets) => pod.ips.iter().any(|ip| nets.iter().any(|n| n.contains(ip))),
    }
}

/// Pods that can be classified: scheduled, with an address, not host-network;
/// sorted by namespace and name, and grouped by namespace with a label
/// index each, so that a selector looks at the pods of its namespaces that
/// carry one of its labels rather than at every pod.
struct EligiblePods<'a> {
    all: Vec<&'a Pod>,
    /// The namespaces with eligible pods, by name.
    namespaces: Vec<Namespace<'a>>,
}

/// One namespace's eligible pods.
struct Namespace<'a> {
    name: &'a str,
    /// Its pods: indexes into [`EligiblePods::all`], ascending.
    pods: std::ops::Range<usize>,
    /// (label, value) -> its pods carrying it, ascending.
    by_label: FoldMap<(&'a str, &'a str), Vec<usize>>,
}

/// A hash map with a fast hasher: the keys are the cluster's own names,
/// and the maps live for one plan.
type FoldMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

impl EligiblePods<'_> {
    /// The namespace named `name`, if it has eligible pods.
    fn namespace(&self, name: &str) -> Option<&Namespace<'_>> {
        self.namespaces
            .binary_search_by(|g| g.name.cmp(name))
            .ok()
            .map(|i| &self.namespaces[i])
    }
}

impl Namespace<'_> {
    /// Calls `f` with the pods of this namespace that `pods` selects,
    /// ascending. A selector of labels alone is answered by the label
    /// index; anything else is checked pod by pod, among the pods carrying
    /// its labels when it has some.
    fn select(&self, all: &[&Pod], pods: &PodMatch, mut f: impl FnMut(usize)) {
        let PodMatch::Selector(selector) = pods else {
            self.pods
                .clone()
                .filter(|p| selects(pods, all[*p]))
                .for_each(f);
            return;
        };
        let mut postings: Vec<&[usize]> = selector
            .match_labels
            .iter()
            .map(|(k, v)| {
                self.by_label
                    .get(&(k.as_str(), v.as_str()))
                    .map_or(&[][..], Vec::as_slice)
            })
            .collect();
        postings.sort_by_key(|l| l.len());
        let Some((shortest, others)) = postings.split_first() else {
            self.pods
                .clone()
                .filter(|p| selector.matches(&all[*p].labels))
                .for_each(f);
            return;
        };
        let exact = selector.match_expressions.is_empty();
        for p in shortest.iter().copied() {
            let carries_all = others.iter().all(|l| l.binary_search(&p).is_ok());
            if carries_all && (exact || selector.matches(&all[p].labels)) {
                f(p);
            }
        }
    }
}

fn eligible_pods<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> EligiblePods<'a> {
    // Grouped by namespace first, then each group sorted by name: the same
    // order as sorting by both, with shorter sorts and no namespace compared
    // twice. Sorts are stable, so of two pods of one name the first stays.
    let mut by_namespace: FoldMap<&str, Vec<&Pod>> = FoldMap::default();
    let mut count = 0;
    for p in pods.into_iter().filter(|p| eligible(p)) {
        count += 1;
        by_namespace
            .entry(p.namespace.as_str())
            .or_default()
            .push(p);
    }
    let mut groups: Vec<(&str, Vec<&Pod>)> = by_namespace.into_iter().collect();
    groups.sort_unstable_by_key(|(ns, _)| *ns);
    let mut all: Vec<&Pod> = Vec::with_capacity(count);
    for (_, mut pods) in groups {
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        pods.dedup_by(|a, b| a.name == b.name);
        all.append(&mut pods);
    }
    let mut namespaces: Vec<Namespace<'_>> = Vec::new();
    for (i, p) in all.iter().enumerate() {
        let ns = p.namespace.as_str();
        match namespaces.last_mut() {
            Some(last) if last.name == ns => last.pods.end = i + 1,
            _ => namespaces.push(Namespace {
                name: ns,
                pods: i..i + 1,
                by_label: FoldMap::default(),
            }),
        }
        let group = namespaces.last_mut().expect("just pushed");
        for (k, v) in &p.labels {
            group
                .by_label
                .entry((k.as_str(), v.as_str()))
                .or_default()
                .push(i);
        }
    }
    EligiblePods { all, namespaces }
}

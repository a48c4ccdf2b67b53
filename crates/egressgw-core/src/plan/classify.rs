//! Stage 5: which pods each policy selects, and per pod address the
//! longest-prefix table that decides where its traffic goes.
//!
//! Pods that match the same set of policies share one compiled table.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::rc::Rc;

use ipnet::IpNet;

use crate::model::{Labels, Pod, PodMatch, Snapshot};
use crate::net::{Family, net_contains};
use crate::precedence::{self, Candidate};

use super::{Work, fi};

/// A compiled table: (destination prefix, deciding policy index or `None`).
pub(super) type Table = Rc<Vec<(IpNet, Option<usize>)>>;

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

/// Selects pods and compiles their tables.
pub(super) fn classify<'a>(
    snapshot: &'a Snapshot,
    works: &[Work<'a>],
    cluster_cidrs: &[IpNet],
) -> Classified<'a> {
    let pods = eligible_pods(snapshot);
    let no_labels = Labels::new();
    let ns_labels: HashMap<&str, &Labels> = snapshot
        .namespaces
        .iter()
        .map(|n| (n.name.as_str(), &n.labels))
        .collect();

    let mut pod_counts = vec![0; works.len()];
    let mut per_pod: Vec<Vec<usize>> = vec![Vec::new(); pods.all.len()];
    for (i, w) in works.iter().enumerate() {
        let policy = w.policy;
        let select = |group: &Namespace<'_>| {
            group.select(&pods.all, &policy.pods, |p| {
                pod_counts[i] += 1;
                per_pod[p].push(i);
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

    let expanded: Vec<[Vec<IpNet>; 2]> = works.iter().map(expand_dests).collect();
    // Whether each policy steers each family at all, decided once.
    let usable: Vec<[bool; 2]> = works
        .iter()
        .zip(&expanded)
        .map(|(w, dests)| Family::ALL.map(|f| w.active(f) && !dests[fi(f)].is_empty()))
        .collect();
    // Tables per family, by the policies that decide them.
    let mut cache: [FoldMap<Vec<usize>, Table>; 2] = Default::default();
    let mut active: Vec<usize> = Vec::new();
    let mut sources = Vec::new();
    let mut seen: HashSet<IpAddr, foldhash::fast::RandomState> = HashSet::default();
    for (p, pod) in pods.all.iter().enumerate() {
        for src in &pod.ips {
            let family = Family::of(*src);
            // A podSubnet policy steers only the addresses inside its subnets.
            active.clear();
            active.extend(per_pod[p].iter().copied().filter(|i| {
                usable[*i][fi(family)]
                    && match &works[*i].policy.pods {
                        PodMatch::Subnets(nets) => nets.iter().any(|n| n.contains(src)),
                        PodMatch::Selector(_) => true,
                    }
            }));
            // An address claimed by two pods (a stale object) goes to the first.
            if active.is_empty() || !seen.insert(*src) {
                continue;
            }
            let tables = &mut cache[fi(family)];
            let table = match tables.get(active.as_slice()) {
                Some(table) => Rc::clone(table),
                None => {
                    let candidates: Vec<Candidate<'_>> = active
                        .iter()
                        .map(|i| Candidate {
                            dests: &expanded[*i][fi(family)],
                            excludes: &works[*i].policy.exclude_subnets,
                            priority: works[*i].policy.priority,
                        })
                        .collect();
                    // Entries wholly inside the cluster are dead: the dataplane
                    // lets in-cluster traffic pass before it classifies.
                    let compiled: Table = Rc::new(
                        precedence::compile(family, &candidates)
                            .into_iter()
                            .filter(|(net, _)| !cluster_cidrs.iter().any(|c| net_contains(c, net)))
                            .map(|(net, w)| (net, w.map(|k| active[k])))
                            .collect(),
                    );
                    tables.insert(active.clone(), Rc::clone(&compiled));
                    compiled
                }
            };
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
        pod_counts,
    }
}

/// Destinations per family; an empty `destSubnet` means the whole family.
fn expand_dests(w: &Work<'_>) -> [Vec<IpNet>; 2] {
    let mut out = [Vec::new(), Vec::new()];
    if w.policy.dest_subnets.is_empty() {
        for family in Family::ALL {
            out[fi(family)].push(family.everything());
        }
    }
    for net in &w.policy.dest_subnets {
        out[fi(Family::of_net(*net))].push(*net);
    }
    out
}

fn selects(pods: &PodMatch, pod: &Pod) -> bool {
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

fn eligible_pods(snapshot: &Snapshot) -> EligiblePods<'_> {
    // Grouped by namespace first, then each group sorted by name: the same
    // order as sorting by both, with shorter sorts and no namespace compared
    // twice. Sorts are stable, so of two pods of one name the first stays.
    let mut by_namespace: FoldMap<&str, Vec<&Pod>> = FoldMap::default();
    for p in snapshot
        .pods
        .iter()
        .filter(|p| p.node.is_some() && !p.ips.is_empty() && !p.host_network)
    {
        by_namespace
            .entry(p.namespace.as_str())
            .or_default()
            .push(p);
    }
    let mut groups: Vec<(&str, Vec<&Pod>)> = by_namespace.into_iter().collect();
    groups.sort_unstable_by_key(|(ns, _)| *ns);
    let mut all: Vec<&Pod> = Vec::with_capacity(snapshot.pods.len());
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

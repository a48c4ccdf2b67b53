//! Stage 5: which pods each policy selects, and per pod address the
//! longest-prefix table that decides where its traffic goes.
//!
//! Pods that match the same set of policies share one compiled table.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::rc::Rc;

use ipnet::IpNet;

use crate::model::{Labels, Pod, PodMatch, Policy, Snapshot};
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
    let ns_labels: HashMap<&str, &Labels> = snapshot
        .namespaces
        .iter()
        .map(|n| (n.name.as_str(), &n.labels))
        .collect();
    let no_labels = Labels::new();

    let mut pod_counts = vec![0; works.len()];
    let mut per_pod: Vec<Vec<usize>> = vec![Vec::new(); pods.all.len()];
    for (i, w) in works.iter().enumerate() {
        // A cluster policy's namespaces, decided once rather than per pod.
        let cluster_scope: Option<HashSet<&str>> =
            match (&w.policy.id.namespace, &w.policy.namespace_selector) {
                (None, Some(selector)) => Some(
                    pods.by_namespace
                        .keys()
                        .copied()
                        .filter(|ns| {
                            selector.matches(ns_labels.get(ns).copied().unwrap_or(&no_labels))
                        })
                        .collect(),
                ),
                _ => None,
            };
        let in_scope = |ns: &str| match (&w.policy.id.namespace, &cluster_scope) {
            (Some(own), _) => own == ns,
            (None, Some(selected)) => selected.contains(ns),
            (None, None) => true,
        };
        for p in pods.candidates(w.policy, &in_scope) {
            let pod = pods.all[p];
            if in_scope(&pod.namespace) && selects(&w.policy.pods, pod) {
                pod_counts[i] += 1;
                per_pod[p].push(i);
            }
        }
    }

    let expanded: Vec<[Vec<IpNet>; 2]> = works.iter().map(expand_dests).collect();
    let mut cache: HashMap<(Family, Vec<usize>), Table> = HashMap::new();
    let mut sources = Vec::new();
    let mut seen: HashSet<IpAddr> = HashSet::new();
    for (p, pod) in pods.all.iter().enumerate() {
        for src in &pod.ips {
            let family = Family::of(*src);
            // A podSubnet policy steers only the addresses inside its subnets.
            let active: Vec<usize> = per_pod[p]
                .iter()
                .copied()
                .filter(|i| {
                    let policy = works[*i].policy;
                    works[*i].active(family)
                        && !expanded[*i][fi(family)].is_empty()
                        && match &policy.pods {
                            PodMatch::Subnets(nets) => nets.iter().any(|n| n.contains(src)),
                            PodMatch::Selector(_) => true,
                        }
                })
                .collect();
            // An address claimed by two pods (a stale object) goes to the first.
            if active.is_empty() || !seen.insert(*src) {
                continue;
            }
            let table = cache
                .entry((family, active))
                .or_insert_with_key(|(family, active)| {
                    let candidates: Vec<Candidate<'_>> = active
                        .iter()
                        .map(|i| Candidate {
                            dests: &expanded[*i][fi(*family)],
                            excludes: &works[*i].policy.exclude_subnets,
                            priority: works[*i].policy.priority,
                        })
                        .collect();
                    // Entries wholly inside the cluster are dead: the dataplane
                    // lets in-cluster traffic pass before it classifies.
                    let compiled = precedence::compile(*family, &candidates)
                        .into_iter()
                        .filter(|(net, _)| !cluster_cidrs.iter().any(|c| net_contains(c, net)))
                        .map(|(net, w)| (net, w.map(|k| active[k])))
                        .collect();
                    Rc::new(compiled)
                })
                .clone();
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
/// sorted by namespace and name, with label indexes so that a selector
/// looks at the pods carrying one of its labels rather than at every pod.
struct EligiblePods<'a> {
    all: Vec<&'a Pod>,
    by_namespace: BTreeMap<&'a str, Vec<usize>>,
    by_ns_label: HashMap<(&'a str, &'a str, &'a str), Vec<usize>>,
    by_label: HashMap<(&'a str, &'a str), Vec<usize>>,
}

impl EligiblePods<'_> {
    /// The pods `policy` may select, ascending: every pod it selects is
    /// among them (callers still check each one).
    fn candidates(&self, policy: &Policy, in_scope: &dyn Fn(&str) -> bool) -> Vec<usize> {
        let own_ns = policy.id.namespace.as_deref();
        let posting = match &policy.pods {
            PodMatch::Selector(s) if !s.match_labels.is_empty() => s
                .match_labels
                .iter()
                .map(|(k, v)| {
                    let list = match own_ns {
                        Some(ns) => self.by_ns_label.get(&(ns, k.as_str(), v.as_str())),
                        None => self.by_label.get(&(k.as_str(), v.as_str())),
                    };
                    list.map_or(&[][..], Vec::as_slice)
                })
                .min_by_key(|l| l.len()),
            _ => None,
        };
        match (posting, own_ns) {
            (Some(list), _) => list.to_vec(),
            (None, Some(ns)) => self.by_namespace.get(ns).cloned().unwrap_or_default(),
            (None, None) => self
                .by_namespace
                .iter()
                .filter(|(ns, _)| in_scope(ns))
                .flat_map(|(_, idxs)| idxs.iter().copied())
                .collect(),
        }
    }
}

fn eligible_pods(snapshot: &Snapshot) -> EligiblePods<'_> {
    let mut all: Vec<&Pod> = snapshot
        .pods
        .iter()
        .filter(|p| p.node.is_some() && !p.ips.is_empty() && !p.host_network)
        .collect();
    all.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    all.dedup_by(|a, b| a.namespace == b.namespace && a.name == b.name);
    let mut pods = EligiblePods {
        all,
        by_namespace: BTreeMap::new(),
        by_ns_label: HashMap::new(),
        by_label: HashMap::new(),
    };
    for (i, p) in pods.all.iter().enumerate() {
        pods.by_namespace
            .entry(p.namespace.as_str())
            .or_default()
            .push(i);
        for (k, v) in &p.labels {
            let ns = p.namespace.as_str();
            pods.by_ns_label
                .entry((ns, k.as_str(), v.as_str()))
                .or_default()
                .push(i);
            pods.by_label
                .entry((k.as_str(), v.as_str()))
                .or_default()
                .push(i);
        }
    }
    pods
}

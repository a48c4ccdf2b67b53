//! Matching one Pod against the policies, as a planner kept between plans
//! does for each Pod that changes ([`super::Planner`], [`super::Publisher`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::model::{Labels, Namespace, Pod, Policy, PolicyRef};

use super::classify;

/// Whether `a` and `b` select the same Pods given the same namespaces:
/// the same Pod selector or subnets, and the same namespace selector.
pub(super) fn selects_alike(a: &Policy, b: &Policy) -> bool {
    // Most often one policy, shared by both frames.
    std::ptr::eq(a, b) || (a.pods == b.pods && a.namespace_selector == b.namespace_selector)
}

/// Each namespace's labels, by name.
fn labels_of(namespaces: &[Namespace]) -> Arc<HashMap<String, Labels>> {
    Arc::new(
        namespaces
            .iter()
            .map(|n| (n.name.clone(), n.labels.clone()))
            .collect(),
    )
}

/// The namespaces labelled otherwise in `a` and `b`, or in one of the two
/// only.
fn relabelled(a: &Arc<HashMap<String, Labels>>, b: &Arc<HashMap<String, Labels>>) -> Vec<String> {
    if Arc::ptr_eq(a, b) {
        return Vec::new();
    }
    let one_way = |a: &HashMap<String, Labels>, b: &HashMap<String, Labels>| {
        a.iter()
            .filter(|(ns, labels)| b.get(*ns) != Some(*labels))
            .map(|(ns, _)| ns.clone())
            .collect::<Vec<_>>()
    };
    let mut out = one_way(a, b);
    out.extend(one_way(b, a));
    out
}

/// The policies in the stages' order, indexed by the namespaces they look
/// at.
#[derive(Debug)]
pub(super) struct Matcher {
    /// The policies, by index in the stages' order: those of the
    /// snapshot planned, shared.
    pub policies: Vec<Arc<Policy>>,
    /// Namespaced policies by namespace, ascending.
    namespaced: HashMap<String, Vec<usize>>,
    /// Cluster policies, ascending.
    cluster_wide: Vec<usize>,
    /// Shared with the matcher it was taken over from, while alike.
    namespace_labels: Arc<HashMap<String, Labels>>,
}

impl Matcher {
    /// The matcher of `policies` with `namespaces` labelled as they are;
    /// the labels of `earlier` are taken over when they are those of
    /// `namespaces`, each named once.
    pub fn new(
        policies: Vec<Arc<Policy>>,
        namespaces: &[Namespace],
        earlier: Option<&Matcher>,
    ) -> Self {
        let mut namespaced: HashMap<String, Vec<usize>> = HashMap::new();
        let mut cluster_wide = Vec::new();
        for (i, p) in policies.iter().enumerate() {
            match &p.id.namespace {
                Some(ns) => match namespaced.get_mut(ns) {
                    Some(of) => of.push(i),
                    None => {
                        namespaced.insert(ns.clone(), vec![i]);
                    }
                },
                None => cluster_wide.push(i),
            }
        }
        // Every namespace there with its labels, each named once.
        let alike = |labels: &HashMap<String, Labels>| {
            let mut named = HashSet::with_capacity(namespaces.len());
            labels.len() == namespaces.len()
                && namespaces.iter().all(|n| {
                    named.insert(n.name.as_str()) && labels.get(&n.name) == Some(&n.labels)
                })
        };
        let namespace_labels = match earlier.filter(|e| alike(&e.namespace_labels)) {
            Some(earlier) => Arc::clone(&earlier.namespace_labels),
            None => labels_of(namespaces),
        };
        Self {
            policies,
            namespaced,
            cluster_wide,
            namespace_labels,
        }
    }

    /// Whether both select the same Pods for the same policies: the same
    /// policies in the same order, with the same selectors, and the
    /// namespaces labelled alike.
    pub fn same_selection(&self, other: &Matcher) -> bool {
        self.policies.len() == other.policies.len()
            && self
                .policies
                .iter()
                .zip(&other.policies)
                .all(|(a, b)| a.id == b.id && selects_alike(a, b))
            && self.namespace_labels == other.namespace_labels
    }

    /// The namespaces labelled otherwise in `other`, or in one of the two
    /// only.
    pub fn relabelled(&self, other: &Matcher) -> Vec<String> {
        relabelled(&self.namespace_labels, &other.namespace_labels)
    }

    /// Takes the labels of `namespaces`; the namespaces labelled otherwise
    /// than before, or there before or now only.
    pub fn relabel(&mut self, namespaces: &[Namespace]) -> Vec<String> {
        let before = std::mem::replace(&mut self.namespace_labels, labels_of(namespaces));
        relabelled(&self.namespace_labels, &before)
    }

    /// Whether policy `i` may select Pods of `namespace`: a namespaced
    /// policy those of its own, a cluster policy those of the namespaces
    /// its namespace selector takes (as they are labelled here).
    pub fn takes_namespace(&self, i: usize, namespace: &str) -> bool {
        self.policy_takes_namespace(&self.policies[i], namespace)
    }

    /// Whether `policy` may select Pods of `namespace`, as
    /// [`Matcher::takes_namespace`] says of one of the policies.
    pub fn policy_takes_namespace(&self, policy: &Policy, namespace: &str) -> bool {
        match &policy.id.namespace {
            Some(own) => own == namespace,
            None => policy.namespace_selector.as_ref().is_none_or(|s| {
                let no_labels = Labels::new();
                s.matches(self.namespace_labels.get(namespace).unwrap_or(&no_labels))
            }),
        }
    }

    /// Whether policy `i` selects `pod`, as [`Matcher::select`] would say.
    pub fn selects(&self, i: usize, pod: &Pod) -> bool {
        classify::eligible(pod)
            && self.takes_namespace(i, &pod.namespace)
            && classify::selects(&self.policies[i].pods, pod)
    }

    /// Takes policy `out` out, then puts `put` in at its index, each
    /// policy after it one further on; the policies stay in the stages'
    /// order when `put` goes where the stages put it.
    pub fn splice(&mut self, out: Option<usize>, put: Option<(usize, Arc<Policy>)>) {
        if let Some(out) = out {
            let policy = self.policies.remove(out);
            self.indexes(&policy).retain(|i| *i != out);
            self.shift(|i| if i > out { i - 1 } else { i });
        }
        if let Some((at, policy)) = put {
            self.shift(|i| if i >= at { i + 1 } else { i });
            let indexes = self.indexes(&policy);
            let to = indexes.partition_point(|i| *i < at);
            indexes.insert(to, at);
            self.policies.insert(at, policy);
        }
    }

    /// The indexes of the policies looking where `policy` looks: its own
    /// namespace's, or the cluster policies.
    fn indexes(&mut self, policy: &Policy) -> &mut Vec<usize> {
        match &policy.id.namespace {
            Some(ns) => self.namespaced.entry(ns.clone()).or_default(),
            None => &mut self.cluster_wide,
        }
    }

    /// Renumbers every policy index by `to`.
    fn shift(&mut self, to: impl Fn(usize) -> usize) {
        let lists = self.namespaced.values_mut().chain([&mut self.cluster_wide]);
        for i in lists.flatten() {
            *i = to(*i);
        }
    }

    /// The index of the policy `id`.
    pub fn position(&self, id: &PolicyRef) -> Option<usize> {
        self.policies.iter().position(|p| p.id == *id)
    }

    /// The policies selecting `pod`, ascending: those of its namespace and
    /// the cluster policies whose namespace selector takes it; none for a
    /// Pod that cannot be classified.
    pub fn select(&self, pod: &Pod) -> Vec<usize> {
        if !classify::eligible(pod) {
            return Vec::new();
        }
        let no_labels = Labels::new();
        let labels = self
            .namespace_labels
            .get(&pod.namespace)
            .unwrap_or(&no_labels);
        let own = self
            .namespaced
            .get(&pod.namespace)
            .map_or(&[][..], Vec::as_slice);
        let cluster = self.cluster_wide.iter().copied().filter(|i| {
            self.policies[*i]
                .namespace_selector
                .as_ref()
                .is_none_or(|s| s.matches(labels))
        });
        let mut selecting: Vec<usize> = own
            .iter()
            .copied()
            .chain(cluster)
            .filter(|i| classify::selects(&self.policies[*i].pods, pod))
            .collect();
        selecting.sort_unstable();
        selecting
    }

    /// Which policies select each of `pods`, by the address of the Pod,
    /// with the whole plan's indexes (faster than one by one for many
    /// Pods); a Pod not in the result is selected by none. Also each
    /// policy's count.
    pub fn select_all<'a>(
        &self,
        pods: impl IntoIterator<Item = &'a Pod>,
        namespaces: &[Namespace],
    ) -> (HashMap<*const Pod, Vec<usize>>, Vec<usize>) {
        let policies: Vec<&Policy> = self.policies.iter().map(|p| &**p).collect();
        let selection = classify::select(pods, &policies, namespaces);
        let selected = selection
            .pods
            .iter()
            .map(|p| std::ptr::from_ref::<Pod>(p))
            .zip(selection.selecting)
            .collect();
        (selected, selection.counts)
    }
}

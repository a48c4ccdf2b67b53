//! An agent's [`Planner`] and the controller's [`Publisher`], fed from the
//! watch stores.
//!
//! The reconcile loop reads the stores whole (level-based), but plans only
//! what changed since its last read: a stored Pod is a new object each time
//! the API server sends a new version of it (a published one, each time
//! its slice is written), so a Pod stored where it was planned last time
//! is skipped, as is one stored anew but the same, and only new, changed
//! and deleted Pods go to the planner, in one batch. A change to the other
//! objects runs the cluster-wide stages again and plans again the Pods
//! they reach ([`Planner::set_cluster`]); another set of Pods watched plans
//! the node whole. When only policies changed, the stored policies are
//! taken the way Pods are: only those stored anew go to the planner, as
//! changes ([`Planner::change_policies`]), without converting or comparing
//! every other object. An agent's store holds its policies converted
//! already ([`Decoded::Converted`]): the planner takes each as stored,
//! shared rather than copied.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use egressgw_api::{EgressClusterPolicy, EgressPolicy};
use egressgw_core::model::PolicyRef;
use egressgw_core::state::NodeState;
use egressgw_core::{Planner, PodChange, PodScope, PolicyChange, Publisher, Snapshot};

use super::decoded::Decoded;
use super::stored::{Address, StoredPod as Pod};
use super::watch::{PolicyKind, PolicyStates};
use crate::slices::Want;

/// A plan kept between reconciles that takes changed Pods.
trait TakesPods {
    /// Takes `changes`, in order.
    fn change_pods(&mut self, changes: Vec<PodChange>);

    /// Takes `pods`, stored anew but the same as those it holds of their
    /// names, in their place if it shares them.
    fn share_pods(&mut self, pods: Vec<Arc<egressgw_core::model::Pod>>) {
        drop(pods);
    }
}

impl TakesPods for Planner {
    fn change_pods(&mut self, changes: Vec<PodChange>) {
        Planner::change_pods(self, changes);
    }

    fn share_pods(&mut self, pods: Vec<Arc<egressgw_core::model::Pod>>) {
        Planner::share_pods(self, pods);
    }
}

/// The planner of one node and what it planned from.
#[derive(Debug)]
pub struct Following {
    node: String,
    planner: Option<Planner>,
    /// Which Pods the planner was fed from.
    scope: Option<PodScope>,
    /// The stored Pods planned, by the address of the stored object. The
    /// object is kept, so that its address is not reused while it is here.
    seen: HashMap<Address, Pod>,
    /// The stored policies planned, kept the same way.
    policies: SeenPolicies,
}

/// The stored policies planned, by the address of the object ([`address`]),
/// each with its identity when it is planned (`None`: it did not decode or
/// convert, and is not).
#[derive(Debug, Default)]
struct SeenPolicies {
    namespaced: Seen<EgressPolicy>,
    cluster: Seen<EgressClusterPolicy>,
    /// Whether these are what the planner planned from.
    known: bool,
}

type Seen<K> = HashMap<usize, (Arc<Decoded<K>>, Option<PolicyRef>)>;

impl SeenPolicies {
    /// The policies of `states`, as `cluster`, made from them, plans them.
    fn of(states: PolicyStates, cluster: &Snapshot) -> Self {
        let planned: HashSet<&PolicyRef> = cluster.policies.iter().map(|p| &p.id).collect();
        Self {
            namespaced: seen_of(states.namespaced, &planned),
            cluster: seen_of(states.cluster, &planned),
            known: true,
        }
    }

    /// The changes from the policies planned to those of `states`: those
    /// stored anew, converted, and those gone. `None` when one stored anew
    /// or gone is not planned (it did not decode or convert): the cluster
    /// is then to be planned whole, and these are no longer known.
    fn changes(&mut self, states: PolicyStates) -> Option<Vec<PolicyChange>> {
        if !std::mem::replace(&mut self.known, false) {
            return None;
        }
        let (mut gone, mut set) = (Vec::new(), Vec::new());
        changes_of(&mut self.namespaced, states.namespaced, &mut gone, &mut set)?;
        changes_of(&mut self.cluster, states.cluster, &mut gone, &mut set)?;
        // A policy edited is gone at its old address and stored at a new
        // one: it is set, not deleted.
        let setting: HashSet<&PolicyRef> = set.iter().map(|p| &p.id).collect();
        gone.retain(|id| !setting.contains(id));
        self.known = true;
        let removed = gone.into_iter().map(PolicyChange::Removed);
        Some(
            removed
                .chain(set.into_iter().map(PolicyChange::Set))
                .collect(),
        )
    }
}

/// `state` by address, each with its identity when `planned` has it.
fn seen_of<K: PolicyKind>(state: Vec<Arc<Decoded<K>>>, planned: &HashSet<&PolicyRef>) -> Seen<K> {
    state
        .into_iter()
        .map(|object| {
            let id = match &*object {
                Decoded::Ok(policy) => Some(K::id_of(policy.meta())),
                Decoded::Converted { policy, .. } => Some(policy.id.clone()),
                Decoded::Undecodable { .. } => None,
            };
            let id = id.filter(|id| planned.contains(id));
            (address(&object), (object, id))
        })
        .collect()
}

/// Into `gone` and `set`: the policies `seen` has and `state` has not, and
/// those `state` has anew, converted; `seen` becomes `state`. `None` when
/// one of them is not planned, or does not convert.
fn changes_of<K: PolicyKind>(
    seen: &mut Seen<K>,
    state: Vec<Arc<Decoded<K>>>,
    gone: &mut Vec<PolicyRef>,
    set: &mut Vec<Arc<egressgw_core::model::Policy>>,
) -> Option<()> {
    let mut next = HashMap::with_capacity(state.len());
    for object in state {
        let at = address(&object);
        if let Some(entry) = seen.remove(&at) {
            next.insert(at, entry);
            continue;
        }
        let policy = match &*object {
            Decoded::Converted { policy, .. } => Arc::clone(policy),
            Decoded::Ok(policy) => Arc::new(policy.to_model().ok()?),
            Decoded::Undecodable { .. } => return None,
        };
        next.insert(at, (object, Some(policy.id.clone())));
        set.push(policy);
    }
    for (_, (_, id)) in seen.drain() {
        gone.push(id?);
    }
    *seen = next;
    Some(())
}

/// Where a stored policy's object is: the decoded object, or the policy
/// an agent converted it to, which a store may hold again in a new entry
/// when the API server sent it again with nothing an agent keeps changed
/// (see `Selection::policies`); or the entry of one that did not decode.
/// The entry kept in [`Seen`] holds the object, so that the address is not
/// reused while it is there.
fn address<K>(stored: &Arc<Decoded<K>>) -> usize {
    match &**stored {
        Decoded::Ok(object) => Arc::as_ptr(object) as usize,
        Decoded::Converted { policy, .. } => Arc::as_ptr(policy) as usize,
        Decoded::Undecodable { .. } => Arc::as_ptr(stored) as usize,
    }
}

/// How much one [`Following::update`] planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replanned {
    /// The node as a whole, from a new planner.
    Whole,
    /// Another object than a Pod changed (and this many Pods).
    Cluster(usize),
    /// Only policies changed, this many (and this many Pods).
    Policies(usize, usize),
    /// This many Pods changed, planned together (0: nothing changed).
    Pods(usize),
}

impl Following {
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_owned(),
            planner: None,
            scope: None,
            seen: HashMap::new(),
            policies: SeenPolicies::default(),
        }
    }

    /// Brings the plan up to `cluster` (every object but the Pods, its
    /// policies those of `policies`) and `pods`, the stored Pods of
    /// `scope`.
    pub fn update(
        &mut self,
        cluster: Snapshot,
        policies: PolicyStates,
        scope: PodScope,
        pods: Vec<Pod>,
    ) -> Replanned {
        let cluster = canonical(cluster);
        self.policies = SeenPolicies::of(policies, &cluster);
        let planner = match self.planner.as_mut() {
            Some(planner) if self.scope == Some(scope) => planner,
            _ => {
                self.whole(cluster, scope, pods);
                return Replanned::Whole;
            }
        };
        let cluster_changed = *planner.cluster() != cluster;
        if cluster_changed {
            planner.set_cluster(cluster);
        }
        let count = follow_pods(planner, &mut self.seen, pods);
        if cluster_changed {
            Replanned::Cluster(count)
        } else {
            Replanned::Pods(count)
        }
    }

    /// [`Following::update`] when nothing but the Pods changed since the
    /// last update: the cluster-wide objects are neither converted nor
    /// compared again. `None` when it cannot be done that way (no planner
    /// yet, or `pods` of another scope): the caller updates whole.
    pub fn update_pods(&mut self, scope: PodScope, pods: Vec<Pod>) -> Option<Replanned> {
        let planner = self
            .planner
            .as_mut()
            .filter(|_| self.scope == Some(scope))?;
        Some(Replanned::Pods(follow_pods(planner, &mut self.seen, pods)))
    }

    /// [`Following::update`] when nothing but policies and Pods changed
    /// since the last update: the stored policies are `policies`, and only
    /// those stored anew are converted. `None` when it cannot be done that
    /// way (no planner yet, `pods` of another scope, a policy that did not
    /// decode or convert stored anew or gone): the caller updates whole.
    pub fn update_policies(
        &mut self,
        policies: PolicyStates,
        scope: PodScope,
        pods: Vec<Pod>,
    ) -> Option<Replanned> {
        let planner = self
            .planner
            .as_mut()
            .filter(|_| self.scope == Some(scope))?;
        let changes = self.policies.changes(policies)?;
        let count = changes.len();
        if count > 0 {
            planner.change_policies(changes);
        }
        let pods = follow_pods(planner, &mut self.seen, pods);
        Some(Replanned::Policies(count, pods))
    }

    /// The node's state as last planned; `None` while the node is not in
    /// the cluster.
    /// Shared with the planner, not copied.
    pub fn state(&self) -> Option<Arc<NodeState>> {
        self.planner.as_ref().and_then(Planner::shared_state)
    }

    fn whole(&mut self, cluster: Snapshot, scope: PodScope, pods: Vec<Pod>) {
        let planned = pods.iter().filter_map(Pod::planned);
        self.planner = Some(Planner::with_pods(cluster, &self.node, planned));
        self.scope = Some(scope);
        self.seen = pods.into_iter().map(|p| (p.address(), p)).collect();
    }
}

/// Feeds the planner the Pods of `pods` stored anew since `seen`, and the
/// Pods gone since; returns how many.
fn follow_pods(
    planner: &mut impl TakesPods,
    seen: &mut HashMap<Address, Pod>,
    pods: Vec<Pod>,
) -> usize {
    // Every Pod stored where it was: nothing to follow, and no second map
    // of them built (the usual case of a plan made for another object).
    if pods.len() == seen.len() && pods.iter().all(|p| seen.contains_key(&p.address())) {
        return 0;
    }
    let mut next = HashMap::with_capacity(pods.len());
    let mut fresh = Vec::new();
    for pod in pods {
        let at = pod.address();
        match seen.remove(&at) {
            Some(kept) => {
                next.insert(at, kept);
            }
            None => fresh.push(pod),
        }
    }
    let (changes, same) = changes(seen, &next, &fresh);
    seen.clear();
    next.extend(fresh.into_iter().map(|p| (p.address(), p)));
    *seen = next;
    if !same.is_empty() {
        planner.share_pods(same);
    }
    let count = changes.len();
    if count > 0 {
        planner.change_pods(changes);
    }
    count
}

/// The changes from the Pods `gone` (no longer stored where they were) to
/// those stored anew, `fresh`, beside those `kept`; and the Pods of
/// `fresh` that are the same as those gone of their names, as planned.
fn changes(
    gone: &HashMap<Address, Pod>,
    kept: &HashMap<Address, Pod>,
    fresh: &[Pod],
) -> (Vec<PodChange>, Vec<Arc<egressgw_core::model::Pod>>) {
    let removed = |(namespace, name): (&str, &str)| PodChange::Removed {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    };
    let set = |pod: &Pod| match pod.planned() {
        Some(planned) => PodChange::Set(planned),
        // Finished or being deleted: it sends nothing any more.
        None => removed(pod.key()),
    };
    let gone: HashMap<(&str, &str), &Pod> = gone.values().map(|p| (p.key(), p)).collect();
    let (mut changes, mut same) = (Vec::new(), Vec::new());
    for pod in fresh {
        // The same Pod stored again (its slice written again for another
        // Pod's change) is planned already: only held anew.
        if gone.get(&pod.key()).is_some_and(|old| old.same(pod)) {
            same.extend(pod.planned());
        } else {
            changes.push(set(pod));
        }
    }
    if gone.is_empty() {
        return (changes, same);
    }
    // What is left was deleted. A name that another object still carries
    // (two sources of Pods held one name for a moment) is planned again
    // from that object, not removed.
    let replaced: HashSet<(&str, &str)> = fresh.iter().map(Pod::key).collect();
    let kept: HashMap<(&str, &str), &Pod> = kept.values().map(|p| (p.key(), p)).collect();
    for name in gone.into_keys().filter(|k| !replaced.contains(k)) {
        changes.push(match kept.get(&name) {
            Some(other) => set(other),
            None => removed(name),
        });
    }
    (changes, same)
}

/// The controller's [`Publisher`] and what it published from.
#[derive(Debug, Default)]
pub struct Publishing {
    publisher: Option<Publisher>,
    /// The stored Pods published, as [`Following`] keeps them.
    seen: HashMap<Address, Pod>,
    /// Per namespace and name: each Pod's slice entry, digested and
    /// measured once when the Pod changes.
    entries: Entries,
}

/// Slice entries' digests and sizes, by namespace, then name.
#[derive(Debug, Default)]
struct Entries(HashMap<String, HashMap<String, (u64, usize)>>);

/// The publisher fed through [`Entries`].
struct Digesting<'a>(&'a mut Publisher, &'a mut Entries);

impl Entries {
    fn insert(&mut self, pod: &egressgw_core::model::Pod) {
        let want = Want::new(pod);
        self.0
            .entry(pod.namespace.clone())
            .or_default()
            .insert(pod.name.clone(), (want.digest, want.len));
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        if let Some(names) = self.0.get_mut(namespace) {
            names.remove(name);
            if names.is_empty() {
                self.0.remove(namespace);
            }
        }
    }
}

impl TakesPods for Digesting<'_> {
    fn change_pods(&mut self, changes: Vec<PodChange>) {
        for change in changes {
            match change {
                PodChange::Set(pod) => {
                    self.1.insert(&pod);
                    self.0.set_pod(pod);
                }
                PodChange::Removed { namespace, name } => {
                    self.1.remove(&namespace, &name);
                    self.0.remove_pod(&namespace, &name);
                }
            }
        }
    }
}

impl Publishing {
    /// Brings the publisher up to `cluster` (every object but the Pods;
    /// `None`: the same as at the last update) and `pods`, every stored
    /// Pod. The first update needs a cluster.
    pub fn update(&mut self, cluster: Option<Snapshot>, pods: Vec<Pod>) -> &mut Publisher {
        let publisher = match (self.publisher.take(), cluster) {
            (Some(mut publisher), Some(cluster)) => {
                publisher.set_cluster(canonical(cluster));
                publisher
            }
            (Some(publisher), None) => publisher,
            (None, cluster) => {
                // The first time, every Pod at once, shared with the store.
                let cluster = canonical(cluster.unwrap_or_default());
                let planned: Vec<_> = pods.iter().filter_map(Pod::planned).collect();
                self.entries = Entries::default();
                for pod in &planned {
                    self.entries.insert(pod);
                }
                self.seen = pods.into_iter().map(|p| (p.address(), p)).collect();
                return self
                    .publisher
                    .insert(Publisher::with_pods(cluster, planned));
            }
        };
        let publisher = self.publisher.insert(publisher);
        follow_pods(
            &mut Digesting(publisher, &mut self.entries),
            &mut self.seen,
            pods,
        );
        publisher
    }

    /// The publisher as last updated.
    pub fn publisher(&self) -> Option<&Publisher> {
        self.publisher.as_ref()
    }

    /// `pod` (one of the publisher's) as its gateways' slices want it.
    pub fn want<'a>(&self, pod: &'a egressgw_core::model::Pod) -> Want<'a> {
        match self
            .entries
            .0
            .get(&pod.namespace)
            .and_then(|n| n.get(&pod.name))
        {
            Some((digest, len)) => Want {
                pod,
                digest: *digest,
                len: *len,
            },
            None => Want::new(pod),
        }
    }
}

/// `cluster` in a fixed order: the stores give their objects in an order
/// that may change when one of them does, and the planner's result does
/// not depend on it, so two reads of the same objects compare equal.
fn canonical(mut cluster: Snapshot) -> Snapshot {
    cluster.pods = Vec::new();
    cluster.nodes.sort_by(|a, b| a.name.cmp(&b.name));
    cluster.namespaces.sort_by(|a, b| a.name.cmp(&b.name));
    cluster.gateways.sort_by(|a, b| a.name.cmp(&b.name));
    cluster.policies.sort_by(|a, b| a.id.cmp(&b.id));
    cluster.tunnels.sort_by(|a, b| a.node.cmp(&b.node));
    cluster
        .invalid
        .sort_by(|a, b| (&a.kind, &a.namespace, &a.name).cmp(&(&b.kind, &b.namespace, &b.name)));
    cluster
}

#[cfg(test)]
mod tests {
    use super::*;
    use egressgw_api::WatchedPod;
    use egressgw_core::model::Config;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1, labels: {egress: "true"}}
spec: {podCIDRs: [10.244.1.0/24]}
status:
  addresses: [{type: InternalIP, address: 192.168.1.11}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Node
metadata: {name: n2}
spec: {podCIDRs: [10.244.2.0/24]}
status:
  addresses: [{type: InternalIP, address: 192.168.1.12}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata: {name: gw1}
spec:
  nodeSelector: {selector: {matchLabels: {egress: "true"}}}
  ippools: {ipv4: [10.6.1.1-10.6.1.2]}
  clusterDefault: true
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: p1, namespace: shop}
spec:
  appliedTo: {podSelector: {matchLabels: {app: web}}}
"#;

    /// The cluster with its allocations written back, as agents read it.
    fn cluster() -> Snapshot {
        let mut snapshot = egressgw_api::objects_from_yaml(CLUSTER)
            .unwrap()
            .into_snapshot(Config::default());
        let status = egressgw_core::plan(&snapshot).status;
        egressgw_core::remember(&mut snapshot, &status);
        snapshot
    }

    fn pod(name: &str, app: &str, node: &str, ip: &str) -> Pod {
        let yaml = format!(
            "metadata: {{name: {name}, namespace: shop, labels: {{app: {app}}}}}\n\
             spec: {{nodeName: {node}, containers: []}}\n\
             status: {{podIP: {ip}, podIPs: [{{ip: {ip}}}]}}"
        );
        Arc::new(serde_yaml::from_str::<WatchedPod>(&yaml).unwrap()).into()
    }

    /// Feeds `pods` and checks the result against the whole plan of the
    /// same objects.
    fn step(following: &mut Following, cluster: &Snapshot, pods: &[Pod]) -> Replanned {
        let replanned = following.update(
            cluster.clone(),
            PolicyStates::default(),
            PodScope::Cluster,
            pods.to_vec(),
        );
        assert_plans_the_whole(following, cluster.clone(), pods);
        replanned
    }

    /// Checks that `following` planned n1 as the whole plan of `cluster`
    /// with `pods` does.
    fn assert_plans_the_whole(following: &Following, mut cluster: Snapshot, pods: &[Pod]) {
        cluster.pods = pods
            .iter()
            .filter_map(Pod::planned)
            .map(Arc::unwrap_or_clone)
            .collect();
        let expected = egressgw_core::plan_node_published(&cluster, "n1");
        assert_eq!(following.state().as_deref(), expected.as_ref());
    }

    #[test]
    fn only_the_pods_stored_anew_are_planned_one_by_one() {
        let cluster = cluster();
        let mut following = Following::new("n1");
        let web1 = pod("web-1", "web", "n2", "10.244.2.5");
        let web2 = pod("web-2", "web", "n1", "10.244.1.5");
        let mut pods = vec![web1.clone(), web2.clone()];
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Whole);
        let snat = following.state().unwrap().snat.len();
        assert!(snat > 0, "n1 carries web-1's traffic");
        // The same stored objects: nothing to plan.
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Pods(0));
        // web-1 stored anew, out of the policy's reach: one Pod planned.
        pods[0] = pod("web-1", "db", "n2", "10.244.2.5");
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Pods(1));
        assert!(following.state().unwrap().snat.len() < snat);
        // web-2 deleted, then one of its name created again elsewhere.
        pods.truncate(1);
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Pods(1));
        pods.push(pod("web-2", "web", "n2", "10.244.2.9"));
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Pods(1));
        // Another order of the same objects plans nothing.
        pods.reverse();
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Pods(0));
        // Another object than a Pod changed.
        let mut edited = cluster.clone();
        edited.policy_mut(0).unwrap().dest_subnets = vec!["203.0.113.0/24".parse().unwrap()];
        assert_eq!(step(&mut following, &edited, &pods), Replanned::Cluster(0));
        // The same objects read in another order are the same objects.
        let mut reordered = edited.clone();
        reordered.nodes.reverse();
        assert_eq!(step(&mut following, &reordered, &pods), Replanned::Pods(0));
    }

    /// A stored policy of the cluster: `spec` (YAML flow), and the
    /// placement the controller wrote for `p1`; `converted` as an agent
    /// keeps it, else whole.
    fn stored_policy(
        name: &str,
        spec: &str,
        placed: &egressgw_core::model::Policy,
        converted: bool,
    ) -> Arc<Decoded<EgressPolicy>> {
        let eip = placed.previous_eips[0];
        let node = placed.previous_node.as_deref().unwrap();
        let yaml = format!(
            "apiVersion: egressgw.io/v1alpha1\nkind: EgressPolicy\n\
             metadata: {{name: {name}, namespace: shop}}\nspec: {spec}\n\
             status: {{eip: {{ipv4: \"{eip}\"}}, node: {node}}}"
        );
        let mut stored = Decoded::Ok(Arc::new(serde_yaml::from_str(&yaml).unwrap()));
        if converted {
            stored.convert(EgressPolicy::to_model, |_| None);
        }
        Arc::new(stored)
    }

    /// A stored policy in the planner's terms, as the agent has it or
    /// converted from the object.
    fn model_of(stored: &Arc<Decoded<EgressPolicy>>) -> Arc<egressgw_core::model::Policy> {
        match stored.converted() {
            Some(policy) => Arc::clone(policy),
            None => Arc::new(stored.ok().unwrap().to_model().unwrap()),
        }
    }

    /// Policies stored anew alone are converted and planned as changes,
    /// and the result is the whole plan's; one that does not decode or
    /// convert leaves the caller to plan whole.
    #[test]
    fn only_the_policies_stored_anew_are_converted_and_planned_as_changes() {
        policies_stored_anew_are_planned_as_changes(false);
    }

    /// As above, with the policies converted as the agent's watch
    /// converts them: the planner takes each one as it is stored.
    #[test]
    fn policies_kept_converted_are_planned_as_stored() {
        policies_stored_anew_are_planned_as_changes(true);
    }

    fn policies_stored_anew_are_planned_as_changes(converted: bool) {
        let stored_policy = |name: &str, spec: &str, placed: &egressgw_core::model::Policy| {
            stored_policy(name, spec, placed, converted)
        };
        let cluster = cluster();
        let placed = cluster.policies[0].clone();
        let web = "{appliedTo: {podSelector: {matchLabels: {app: web}}}}";
        let p1 = stored_policy("p1", web, &placed);
        assert_eq!(model_of(&p1), placed, "the stored policy is the cluster's");
        assert_eq!(p1.converted().is_some(), converted);
        let states = |policies: &[&Arc<Decoded<EgressPolicy>>]| PolicyStates {
            namespaced: policies.iter().map(|p| Arc::clone(p)).collect(),
            cluster: Vec::new(),
        };
        let pods = vec![
            pod("web-1", "web", "n2", "10.244.2.5"),
            pod("db-1", "db", "n2", "10.244.2.6"),
        ];
        let mut following = Following::new("n1");
        following.update(
            cluster.clone(),
            states(&[&p1]),
            PodScope::Cluster,
            pods.clone(),
        );
        // Checks the state against the whole plan of `policies`.
        let check = |following: &Following, policies: &[&Arc<Decoded<EgressPolicy>>]| {
            let mut whole = cluster.clone();
            whole.policies = policies.iter().map(|p| model_of(p)).collect();
            assert_plans_the_whole(following, whole, &pods);
        };
        let unchanged = following.update_policies(states(&[&p1]), PodScope::Cluster, pods.clone());
        assert_eq!(unchanged, Some(Replanned::Policies(0, 0)));
        // Stored again in a new entry, the object the same: nothing to
        // plan.
        let again = Arc::new((*p1).clone());
        assert!(!Arc::ptr_eq(&again, &p1));
        let unchanged =
            following.update_policies(states(&[&again]), PodScope::Cluster, pods.clone());
        assert_eq!(unchanged, Some(Replanned::Policies(0, 0)));
        // p1 edited (a new stored object), p2 added.
        let p1 = stored_policy(
            "p1",
            "{appliedTo: {podSelector: {matchLabels: {app: web}}}, destSubnet: [203.0.113.0/24]}",
            &placed,
        );
        let p2 = stored_policy(
            "p2",
            "{appliedTo: {podSelector: {matchLabels: {app: db}}}}",
            &placed,
        );
        let replanned =
            following.update_policies(states(&[&p2, &p1]), PodScope::Cluster, pods.clone());
        assert_eq!(replanned, Some(Replanned::Policies(2, 0)));
        check(&following, &[&p1, &p2]);
        if converted {
            // The planner holds the policies stored, not copies.
            let planned = &following.planner.as_ref().unwrap().cluster().policies;
            for p in [&p1, &p2] {
                let p = p.converted().unwrap();
                assert!(planned.iter().any(|q| Arc::ptr_eq(q, p)), "{p:?}");
            }
        }
        assert!(
            following
                .state()
                .unwrap()
                .snat
                .iter()
                .any(|e| e.src.to_string() == "10.244.2.6"),
            "p2 selects db-1"
        );
        // p2 deleted.
        let replanned = following.update_policies(states(&[&p1]), PodScope::Cluster, pods.clone());
        assert_eq!(replanned, Some(Replanned::Policies(1, 0)));
        check(&following, &[&p1]);
        // A policy that does not decode: planned whole, until then not
        // known.
        let bad = Arc::new(Decoded::Undecodable {
            meta: Box::default(),
            error: "bad".into(),
        });
        assert_eq!(
            following.update_policies(states(&[&p1, &bad]), PodScope::Cluster, pods.clone()),
            None
        );
        assert_eq!(
            following.update_policies(states(&[&p1]), PodScope::Cluster, pods.clone()),
            None
        );
        following.update(
            cluster.clone(),
            states(&[&p1]),
            PodScope::Cluster,
            pods.clone(),
        );
        let invalid = stored_policy(
            "p3",
            "{appliedTo: {podSelector: {matchLabels: {app: web}}}, destSubnet: [nonsense]}",
            &placed,
        );
        assert_eq!(
            following.update_policies(states(&[&p1, &invalid]), PodScope::Cluster, pods.clone()),
            None
        );
    }

    /// Two objects of one name for a moment (a Pod made again on this
    /// node while still published on its old one): the one that goes
    /// leaves the other planned.
    #[test]
    fn an_object_gone_leaves_another_of_its_name_planned() {
        let cluster = cluster();
        let mut following = Following::new("n1");
        let old = pod("web-1", "web", "n2", "10.244.2.5");
        let new = pod("web-1", "web", "n1", "10.244.1.7");
        let none = PolicyStates::default;
        following.update(
            cluster.clone(),
            none(),
            PodScope::Cluster,
            vec![old.clone()],
        );
        following.update(
            cluster.clone(),
            none(),
            PodScope::Cluster,
            vec![old, new.clone()],
        );
        let pods = vec![new];
        assert_eq!(step(&mut following, &cluster, &pods), Replanned::Pods(1));
        let state = following.state().unwrap();
        assert!(
            state
                .classify
                .iter()
                .any(|e| e.src.to_string() == "10.244.1.7"),
            "web-1 on n1 is still classified"
        );
    }

    /// The Pods of one slice, as a gateway node's agent reads them.
    fn published(version: &str, pods: &[(&str, &str, &str)]) -> Vec<Pod> {
        let slice = egressgw_api::EgressEndpointSlice::new(
            &format!("gw1-{version}"),
            egressgw_api::EgressEndpointSliceSpec {
                gateway: "gw1".into(),
                pods: pods
                    .iter()
                    .map(|(name, app, ip)| egressgw_api::EndpointPod {
                        namespace: "shop".into(),
                        name: (*name).into(),
                        node: "n2".into(),
                        ips: vec![(*ip).into()],
                        labels: [("app".to_owned(), (*app).to_owned())].into(),
                    })
                    .collect(),
            },
        );
        let json = serde_json::to_value(&slice).unwrap();
        let slice = Arc::new(serde_json::from_value(json).unwrap());
        (0..pods.len())
            .filter_map(|at| Pod::published(&slice, at))
            .collect()
    }

    /// A slice written again for one of its Pods plans that Pod alone:
    /// the others are read from the new slice, but are the same Pods.
    #[test]
    fn a_slice_written_again_plans_only_its_pods_that_changed() {
        let cluster = cluster();
        let mut following = Following::new("n1");
        let first = published(
            "1",
            &[
                ("web-1", "web", "10.244.2.5"),
                ("web-2", "web", "10.244.2.6"),
            ],
        );
        assert_eq!(step(&mut following, &cluster, &first), Replanned::Whole);
        let again = published(
            "2",
            &[
                ("web-1", "web", "10.244.2.5"),
                ("web-2", "db", "10.244.2.6"),
            ],
        );
        let old_web1 = first[0].planned().unwrap();
        assert_eq!(step(&mut following, &cluster, &again), Replanned::Pods(1));
        // The planner holds web-1 from the new slice: the old one goes with
        // its slice.
        drop(first);
        assert_eq!(Arc::strong_count(&old_web1), 1, "web-1 is held once");
        let fewer = published("3", &[("web-2", "db", "10.244.2.6")]);
        assert_eq!(step(&mut following, &cluster, &fewer), Replanned::Pods(1));
        assert!(following.state().unwrap().snat.is_empty());
    }

    #[test]
    fn other_pods_watched_plan_the_node_whole() {
        let cluster = cluster();
        let mut following = Following::new("n1");
        let pods = vec![pod("web-1", "web", "n1", "10.244.1.5")];
        let none = PolicyStates::default;
        following.update(cluster.clone(), none(), PodScope::Node, pods.clone());
        let replanned = following.update(cluster, none(), PodScope::Cluster, pods);
        assert_eq!(replanned, Replanned::Whole);
    }

    /// The controller's publisher takes the Pods stored anew, says which
    /// gateways' Pods changed, and publishes what the whole plan does.
    #[test]
    fn the_controllers_publisher_takes_the_pods_stored_anew() {
        fn update(
            publishing: &mut Publishing,
            cluster: Option<Snapshot>,
            pods: &[Pod],
        ) -> Vec<String> {
            let changed = publishing.update(cluster, pods.to_vec()).take_changed();
            let publisher = publishing.publisher().unwrap();
            let mut whole = publisher.cluster().clone();
            whole.pods = pods
                .iter()
                .filter_map(Pod::planned)
                .map(Arc::unwrap_or_clone)
                .collect();
            assert_eq!(publisher.published(), egressgw_core::plan_published(&whole));
            for pod in publisher.pods_of("gw1") {
                let want = publishing.want(pod);
                let fresh = Want::new(pod);
                assert_eq!((want.digest, want.len), (fresh.digest, fresh.len));
            }
            changed.into_iter().collect()
        }
        let cluster = cluster();
        let mut publishing = Publishing::default();
        let mut pods = vec![
            pod("web-1", "web", "n2", "10.244.2.5"),
            pod("db-1", "db", "n2", "10.244.2.6"),
        ];
        assert_eq!(
            update(&mut publishing, Some(cluster.clone()), &pods),
            ["gw1"]
        );
        assert!(update(&mut publishing, None, &pods).is_empty());
        // A Pod no policy selects changed: no gateway's Pods changed.
        pods[1] = pod("db-1", "db", "n1", "10.244.1.6");
        assert!(update(&mut publishing, None, &pods).is_empty());
        // One selected, one relabelled out of reach.
        pods[0] = pod("web-1", "db", "n2", "10.244.2.5");
        pods[1] = pod("db-1", "web", "n1", "10.244.1.6");
        assert_eq!(update(&mut publishing, None, &pods), ["gw1"]);
        // The policy's status written back changes no selection.
        let mut written = cluster.clone();
        written.policy_mut(0).unwrap().previous_node = Some("n2".into());
        assert!(update(&mut publishing, Some(written), &pods).is_empty());
        pods.clear();
        assert_eq!(update(&mut publishing, None, &pods), ["gw1"]);
    }

    /// The publisher holds the Pods its store converted, not copies: at
    /// its first update and as Pods change.
    #[test]
    fn the_controllers_publisher_holds_the_stored_pods() {
        let held_from = |publishing: &Publishing, stored: &Pod| {
            let stored = stored.planned().unwrap();
            let pods = publishing.publisher().unwrap().pods_of("gw1");
            pods.iter().any(|p| std::ptr::eq(*p, &*stored))
        };
        // As the controller's watch stores them.
        let converted = |name, ip| {
            let yaml = format!(
                "metadata: {{name: {name}, namespace: shop, labels: {{app: web}}}}\n\
                 spec: {{nodeName: n2, containers: []}}\n\
                 status: {{podIP: {ip}, podIPs: [{{ip: {ip}}}]}}"
            );
            let mut pod = serde_yaml::from_str::<WatchedPod>(&yaml).unwrap();
            pod.convert();
            Pod::from(Arc::new(pod))
        };
        let mut publishing = Publishing::default();
        let mut pods = vec![converted("web-1", "10.244.2.5")];
        publishing.update(Some(cluster()), pods.clone());
        assert!(held_from(&publishing, &pods[0]));
        pods.push(converted("web-2", "10.244.2.6"));
        publishing.update(None, pods.clone());
        assert!(held_from(&publishing, &pods[0]));
        assert!(held_from(&publishing, &pods[1]));
    }
}

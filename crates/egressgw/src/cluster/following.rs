//! An agent's [`Planner`] and the controller's [`Publisher`], fed from the
//! watch stores.
//!
//! The reconcile loop reads the stores whole (level-based), but plans only
//! what changed since its last read: a stored Pod is a new object each time
//! the API server sends a new version of it, so a Pod whose stored object
//! is the one planned last time is skipped, and only new, changed and
//! deleted Pods go to the planner, in one batch. A change to the other
//! objects runs the cluster-wide stages again and plans again the Pods
//! they reach ([`Planner::set_cluster`]); another set of Pods watched plans
//! the node whole.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use egressgw_api::WatchedPod as Pod;
use egressgw_core::state::NodeState;
use egressgw_core::{Planner, PodChange, PodScope, Publisher, Snapshot};

use crate::slices::Want;

/// A Pod's namespace and name.
type PodKey = (String, String);

/// A plan kept between reconciles that takes changed Pods.
trait TakesPods {
    /// Takes `changes`, in order.
    fn change_pods(&mut self, changes: Vec<PodChange>);
}

impl TakesPods for Planner {
    fn change_pods(&mut self, changes: Vec<PodChange>) {
        Planner::change_pods(self, changes);
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
    seen: HashMap<usize, (Arc<Pod>, PodKey)>,
}

/// How much one [`Following::update`] planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replanned {
    /// The node as a whole, from a new planner.
    Whole,
    /// Another object than a Pod changed (and this many Pods).
    Cluster(usize),
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
        }
    }

    /// Brings the plan up to `cluster` (every object but the Pods) and
    /// `pods`, the stored Pods of `scope`.
    pub fn update(&mut self, cluster: Snapshot, scope: PodScope, pods: Vec<Arc<Pod>>) -> Replanned {
        let cluster = canonical(cluster);
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
    pub fn update_pods(&mut self, scope: PodScope, pods: Vec<Arc<Pod>>) -> Option<Replanned> {
        let planner = self
            .planner
            .as_mut()
            .filter(|_| self.scope == Some(scope))?;
        Some(Replanned::Pods(follow_pods(planner, &mut self.seen, pods)))
    }

    /// The node's state as last planned; `None` while the node is not in
    /// the cluster.
    pub fn state(&self) -> Option<&NodeState> {
        self.planner.as_ref().and_then(Planner::state)
    }

    fn whole(&mut self, mut cluster: Snapshot, scope: PodScope, pods: Vec<Arc<Pod>>) {
        cluster.pods = pods
            .iter()
            .filter_map(|p| egressgw_api::snapshot::watched_pod(p))
            .collect();
        self.planner = Some(Planner::new(cluster, &self.node));
        self.scope = Some(scope);
        self.seen = pods
            .into_iter()
            .map(|p| (address(&p), (Arc::clone(&p), key(&p))))
            .collect();
    }
}

/// Feeds the planner the Pods of `pods` stored anew since `seen`, and the
/// Pods gone since; returns how many.
fn follow_pods(
    planner: &mut impl TakesPods,
    seen: &mut HashMap<usize, (Arc<Pod>, PodKey)>,
    pods: Vec<Arc<Pod>>,
) -> usize {
    let mut next = HashMap::with_capacity(pods.len());
    let mut changed = Vec::new();
    for pod in pods {
        let at = address(&pod);
        match seen.remove(&at) {
            Some(entry) => {
                next.insert(at, entry);
            }
            None => changed.push(pod),
        }
    }
    // What is left was deleted, or replaced by one of `changed`. A name
    // that another object still carries (two sources of Pods held one name
    // for a moment) is planned again from that object, not removed.
    let replaced: HashSet<PodKey> = changed.iter().map(|p| key(p)).collect();
    let kept: HashMap<&PodKey, &Arc<Pod>> = if seen.is_empty() {
        HashMap::new()
    } else {
        next.values().map(|(p, k)| (k, p)).collect()
    };
    let removed = |(namespace, name): PodKey| PodChange::Removed { namespace, name };
    let mut changes = Vec::new();
    for (_, (_, gone)) in seen.drain() {
        if replaced.contains(&gone) {
            continue;
        }
        changes.push(
            match kept
                .get(&gone)
                .and_then(|p| egressgw_api::snapshot::watched_pod(p))
            {
                Some(planned) => PodChange::Set(planned),
                None => removed(gone),
            },
        );
    }
    for pod in changed {
        let k = key(&pod);
        changes.push(match egressgw_api::snapshot::watched_pod(&pod) {
            Some(planned) => PodChange::Set(planned),
            // Finished or being deleted: it sends nothing any more.
            None => removed(k.clone()),
        });
        next.insert(address(&pod), (pod, k));
    }
    *seen = next;
    let count = changes.len();
    if count > 0 {
        planner.change_pods(changes);
    }
    count
}

/// The controller's [`Publisher`] and what it published from.
#[derive(Debug, Default)]
pub struct Publishing {
    publisher: Option<Publisher>,
    /// The stored Pods published, as [`Following`] keeps them.
    seen: HashMap<usize, (Arc<Pod>, PodKey)>,
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
    pub fn update(&mut self, cluster: Option<Snapshot>, pods: Vec<Arc<Pod>>) -> &mut Publisher {
        let publisher = match (self.publisher.take(), cluster) {
            (Some(mut publisher), Some(cluster)) => {
                publisher.set_cluster(canonical(cluster));
                publisher
            }
            (Some(publisher), None) => publisher,
            (None, cluster) => {
                // The first time, every Pod at once.
                let mut cluster = canonical(cluster.unwrap_or_default());
                cluster.pods = pods
                    .iter()
                    .filter_map(|p| egressgw_api::snapshot::watched_pod(p))
                    .collect();
                self.entries = Entries::default();
                for pod in &cluster.pods {
                    self.entries.insert(pod);
                }
                self.seen = pods
                    .into_iter()
                    .map(|p| (address(&p), (Arc::clone(&p), key(&p))))
                    .collect();
                return self.publisher.insert(Publisher::new(cluster));
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

fn address(pod: &Arc<Pod>) -> usize {
    Arc::as_ptr(pod) as usize
}

fn key(pod: &Pod) -> PodKey {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
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

    fn pod(name: &str, app: &str, node: &str, ip: &str) -> Arc<Pod> {
        let yaml = format!(
            "metadata: {{name: {name}, namespace: shop, labels: {{app: {app}}}}}\n\
             spec: {{nodeName: {node}, containers: []}}\n\
             status: {{podIP: {ip}, podIPs: [{{ip: {ip}}}]}}"
        );
        Arc::new(serde_yaml::from_str(&yaml).unwrap())
    }

    /// Feeds `pods` and checks the result against the whole plan of the
    /// same objects.
    fn step(following: &mut Following, cluster: &Snapshot, pods: &[Arc<Pod>]) -> Replanned {
        let replanned = following.update(cluster.clone(), PodScope::Cluster, pods.to_vec());
        let mut whole = cluster.clone();
        whole.pods = pods
            .iter()
            .filter_map(|p| egressgw_api::snapshot::watched_pod(p))
            .collect();
        let expected = egressgw_core::plan_node_published(&whole, "n1");
        assert_eq!(following.state(), expected.as_ref());
        replanned
    }

    #[test]
    fn only_the_pods_stored_anew_are_planned_one_by_one() {
        let cluster = cluster();
        let mut following = Following::new("n1");
        let web1 = pod("web-1", "web", "n2", "10.244.2.5");
        let web2 = pod("web-2", "web", "n1", "10.244.1.5");
        let mut pods = vec![Arc::clone(&web1), Arc::clone(&web2)];
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
        edited.policies[0].dest_subnets = vec!["203.0.113.0/24".parse().unwrap()];
        assert_eq!(step(&mut following, &edited, &pods), Replanned::Cluster(0));
        // The same objects read in another order are the same objects.
        let mut reordered = edited.clone();
        reordered.nodes.reverse();
        assert_eq!(step(&mut following, &reordered, &pods), Replanned::Pods(0));
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
        following.update(cluster.clone(), PodScope::Cluster, vec![Arc::clone(&old)]);
        following.update(
            cluster.clone(),
            PodScope::Cluster,
            vec![old, Arc::clone(&new)],
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

    #[test]
    fn other_pods_watched_plan_the_node_whole() {
        let cluster = cluster();
        let mut following = Following::new("n1");
        let pods = vec![pod("web-1", "web", "n1", "10.244.1.5")];
        following.update(cluster.clone(), PodScope::Node, pods.clone());
        let replanned = following.update(cluster, PodScope::Cluster, pods);
        assert_eq!(replanned, Replanned::Whole);
    }

    /// The controller's publisher takes the Pods stored anew, says which
    /// gateways' Pods changed, and publishes what the whole plan does.
    #[test]
    fn the_controllers_publisher_takes_the_pods_stored_anew() {
        fn update(
            publishing: &mut Publishing,
            cluster: Option<Snapshot>,
            pods: &[Arc<Pod>],
        ) -> Vec<String> {
            let changed = publishing.update(cluster, pods.to_vec()).take_changed();
            let publisher = publishing.publisher().unwrap();
            let mut whole = publisher.cluster().clone();
            whole.pods = pods
                .iter()
                .filter_map(|p| egressgw_api::snapshot::watched_pod(p))
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
        written.policies[0].previous_node = Some("n2".into());
        assert!(update(&mut publishing, Some(written), &pods).is_empty());
        pods.clear();
        assert_eq!(update(&mut publishing, None, &pods), ["gw1"]);
    }
}

//! The objects a daemon watches, each kept in a reflector store, and the
//! snapshot the planner takes from them.
//!
//! Watch events only update the stores and wake the daemon's reconcile
//! loop ([`Notify`]); the loop reads the stores as a whole (level-based).

use std::collections::HashSet;
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egressgw_api::ValidationErrors;
use egressgw_api::WatchedPod;
use egressgw_api::endpoints::{PublishedPod, PublishedSlice};
use egressgw_api::policy::EgressPolicyStatus;
use egressgw_api::{
    EgressClusterPolicy, EgressGateway, EgressPolicy, EgressTunnel, SnapshotBuilder,
};
use egressgw_core::model::{Config, PolicyRef};
use egressgw_core::{PodScope, Snapshot};
use futures_util::{FutureExt as _, StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, NodeCondition, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::decoded::Decoded;
use super::pods::PodStore;
use super::stored::StoredPod;

/// Reflector stores of everything the planner reads.
#[derive(Clone)]
pub struct Stores {
    pub nodes: Store<Node>,
    pub namespaces: Store<Namespace>,
    pub pods: Pods,
    pub gateways: Store<EgressGateway>,
    /// Policies are taken one by one (see [`Decoded`]): a stored one that
    /// does not decode is reported, and stops no other.
    pub policies: Store<Decoded<EgressPolicy>>,
    pub cluster_policies: Store<Decoded<EgressClusterPolicy>>,
    pub tunnels: Store<EgressTunnel>,
    /// Counts the changes of every kind but Pods: equal readings mean the
    /// same [`Stores::cluster_snapshot`].
    cluster_version: Arc<AtomicU64>,
    /// Counts the changes of policies of either kind, each counted in
    /// `cluster_version` first.
    policies_version: Arc<AtomicU64>,
}

/// How many times the stores of every kind but Pods, and those of
/// policies, have changed ([`Stores::cluster_version`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterVersion {
    all: u64,
    policies: u64,
}

/// What changed between two readings of [`Stores::cluster_version`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Changed {
    /// Nothing but Pods.
    Nothing,
    /// Policies, and nothing else but Pods.
    Policies,
    /// Objects of another kind.
    Others,
}

impl ClusterVersion {
    /// What changed from `earlier` to this reading.
    pub fn since(&self, earlier: &ClusterVersion) -> Changed {
        if self == earlier {
            Changed::Nothing
        } else if self.others() == earlier.others() {
            Changed::Policies
        } else {
            Changed::Others
        }
    }

    fn others(&self) -> u64 {
        self.all.wrapping_sub(self.policies)
    }
}

impl Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores").finish_non_exhaustive()
    }
}

impl Stores {
    /// Starts one watch per kind, cluster-wide; every change wakes `changed`.
    /// Each watch is renewed every `renew` (see [`watch`]). An agent gives
    /// its node and the release namespace: the Pods watched are then that
    /// node's, and what [`Pods::serve`] adds (see [`Pods`]); without, every
    /// Pod.
    pub fn start(
        client: &Client,
        changed: &Arc<Notify>,
        renew: Duration,
        agent: Option<(&str, &str)>,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let mut tasks = Vec::new();
        let t = &mut tasks;
        let version = Arc::new(AtomicU64::new(0));
        let policies_version = Arc::new(AtomicU64::new(0));
        let v = &[&version][..];
        // A policy's change counts in both, the whole first (see
        // `Stores::cluster_version`).
        let p = &[&version, &policies_version][..];
        // An agent plans from a policy's spec and placement alone, and
        // from whether a gateway's Pods are published, not how many; the
        // controller compares whole statuses.
        let is_agent = agent.is_some();
        // Every kind is watched whole, counted in `version`.
        macro_rules! watch {
            ($selection:expr) => {
                watch!($selection, v)
            };
            ($selection:expr, $versions:expr) => {
                watch_fields(
                    Api::all(client.clone()),
                    $selection,
                    changed,
                    $versions,
                    t,
                    renew,
                )
            };
        }
        let stores = Self {
            nodes: watch!(Selection::every()),
            namespaces: watch!(Selection::every()),
            pods: Pods::start(client, changed, t, renew, agent),
            gateways: watch!(Selection::gateways(is_agent)),
            policies: watch!(Selection::policies(is_agent), p),
            cluster_policies: watch!(Selection::policies(is_agent), p),
            tunnels: watch!(Selection::every()),
            cluster_version: Arc::clone(&version),
            policies_version,
        };
        (stores, tasks)
    }

    /// What the status of the gateway `name` says of its Pods.
    pub fn publication(&self, name: &str) -> Publication {
        let gateway = self.gateways.get(&ObjectRef::new(name));
        match gateway.as_ref().and_then(|g| g.status.as_ref()) {
            None => Publication::NoStatus,
            Some(status) if status.pods.is_some() => Publication::Published,
            Some(_) => Publication::NotPublished,
        }
    }

    /// Waits until every store holds its first complete list.
    pub async fn ready(&self) -> anyhow::Result<()> {
        let waits = [
            self.nodes.wait_until_ready().await,
            self.namespaces.wait_until_ready().await,
            self.gateways.wait_until_ready().await,
            self.policies.wait_until_ready().await,
            self.cluster_policies.wait_until_ready().await,
            self.tunnels.wait_until_ready().await,
        ];
        for wait in waits {
            wait.map_err(|_| anyhow::anyhow!("a watch stopped before its first list"))?;
        }
        self.pods
            .first
            .wait_until_listed()
            .await
            .map_err(|_| anyhow::anyhow!("the pod watch stopped before its first list"))?;
        Ok(())
    }

    /// The planner's view of the stores now. A node counts as ready only
    /// while its agent reports (see [`SnapshotBuilder::agents_required`]).
    pub fn snapshot(&self, config: Config) -> Snapshot {
        let mut snapshot = self.cluster_snapshot(config);
        snapshot.pods = self
            .pods
            .state()
            .iter()
            .filter_map(StoredPod::planned)
            .map(Arc::unwrap_or_clone)
            .collect();
        snapshot
    }

    /// How many times a store of another kind than Pods, and one of
    /// policies, has changed: read before [`Stores::cluster_snapshot`], an
    /// equal reading later means nothing but Pods changed since.
    pub fn cluster_version(&self) -> ClusterVersion {
        // The policies' count first: a policy's change counts in the whole
        // first, so a reading never misses another kind's change (it may
        // take a policy's for one, which costs a whole plan).
        let policies = self.policies_version.load(Ordering::Acquire);
        let all = self.cluster_version.load(Ordering::Acquire);
        ClusterVersion { all, policies }
    }

    /// The stored policies of both kinds, as [`Stores::cluster_snapshot_of`]
    /// takes them.
    pub fn policy_states(&self) -> PolicyStates {
        PolicyStates {
            namespaced: self.policies.state(),
            cluster: self.cluster_policies.state(),
        }
    }

    /// [`Stores::snapshot`] without the Pods.
    pub fn cluster_snapshot(&self, config: Config) -> Snapshot {
        self.cluster_snapshot_of(config, &self.policy_states())
    }

    /// [`Stores::cluster_snapshot`] with the policies of `states`.
    pub fn cluster_snapshot_of(&self, config: Config, states: &PolicyStates) -> Snapshot {
        let (policies, cluster_policies) = (&states.namespaced, &states.cluster);
        let builder = SnapshotBuilder::new(config)
            .agents_required()
            .nodes(self.nodes.state())
            .namespaces(self.namespaces.state())
            .gateways(self.gateways.state())
            .policies(policies.iter().filter_map(|p| p.ok()))
            .cluster_policies(cluster_policies.iter().filter_map(|p| p.ok()))
            .converted(policies.iter().filter_map(|p| p.converted().cloned()))
            .converted(
                cluster_policies
                    .iter()
                    .filter_map(|p| p.converted().cloned()),
            )
            .tunnels(self.tunnels.state());
        let builder = undecodable(builder, policies);
        undecodable(builder, cluster_policies).build()
    }
}

/// The stored policies of both kinds at one reading.
#[derive(Debug, Clone, Default)]
pub struct PolicyStates {
    pub namespaced: Vec<Arc<Decoded<EgressPolicy>>>,
    pub cluster: Vec<Arc<Decoded<EgressClusterPolicy>>>,
}

/// The Pods a daemon watches.
///
/// The controller watches every Pod. An agent watches the Pods on its node
/// (a `spec.nodeName` field selector). While some gateway selects its node
/// ([`egressgw_core::pod_scope`]) it also needs the Pods whose traffic
/// those gateways carry: it watches the `EgressEndpointSlice`s in which the
/// controller publishes them (a label selector on the gateways), or, while
/// no controller publishes any (one of an earlier release), every Pod. So
/// the API server streams each Pod to its own node and to the controller,
/// and each gateway's slices to that gateway's nodes, rather than every Pod
/// to every node.
#[derive(Clone)]
pub struct Pods {
    /// The watch started with the daemon.
    first: PodStore,
    /// Which Pods `first` holds.
    first_scope: PodScope,
    /// The agent's node.
    node: Option<String>,
    /// An agent's watch of every Pod or of slices, started and stopped on
    /// demand.
    on_demand: Arc<Mutex<OnDemand>>,
}

/// The Pods an agent asks for ([`Pods::serve`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wanted {
    /// Its node's.
    Node,
    /// Its node's, and those published for these gateways (sorted names).
    Gateways(Vec<String>),
    /// Every Pod.
    Cluster,
}

/// What a gateway's status says of its Pods ([`Wanted::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publication {
    /// `status.pods`: its slices hold them.
    Published,
    /// A status without `status.pods`: written by a controller that does
    /// not publish (an earlier release), or whose slice writes for it
    /// failed.
    NotPublished,
    /// No status yet: no controller has taken the gateway in.
    NoStatus,
}

impl Wanted {
    /// The Pods the agent of a node that the gateways `selecting` select
    /// (see [`egressgw_core::gateways_selecting`]) plans from: its own
    /// alone when there are none; every Pod of the cluster when a
    /// controller wrote one of their statuses without publishing its Pods
    /// (so that an upgrade from a controller that publishes nothing keeps
    /// every Pod's traffic carried); otherwise their slices. A gateway
    /// with no status yet counts as published with no Pods: the
    /// controller writes its first status with its Pods published, before
    /// any other status, and a controller that does not publish writes one
    /// without. Listing every Pod of a large cluster for the seconds
    /// between a gateway's creation and its first status would cost each
    /// of its nodes' agents far more memory than it holds otherwise, and
    /// until the controller takes the gateway in, no policy of it has an
    /// EIP to carry its Pods' traffic with.
    pub fn of(selecting: &[&str], publication: impl Fn(&str) -> Publication) -> Self {
        if selecting.is_empty() {
            Wanted::Node
        } else if selecting
            .iter()
            .any(|g| publication(g) == Publication::NotPublished)
        {
            Wanted::Cluster
        } else {
            Wanted::Gateways(selecting.iter().map(|g| (*g).to_owned()).collect())
        }
    }

    pub fn scope(&self) -> PodScope {
        match self {
            Self::Node => PodScope::Node,
            Self::Gateways(_) => PodScope::Gateways,
            Self::Cluster => PodScope::Cluster,
        }
    }
}

/// What starting a watch takes, and the watch running on demand.
struct OnDemand {
    client: Client,
    changed: Arc<Notify>,
    renew: Duration,
    /// Where the slices are (the release namespace).
    namespace: String,
    running: Option<(Running, JoinHandle<()>)>,
}

/// A watch started on demand.
enum Running {
    Cluster(PodStore),
    Gateways(Vec<String>, Store<PublishedSlice>),
}

impl Drop for OnDemand {
    fn drop(&mut self) {
        if let Some((_, task)) = self.running.take() {
            task.abort();
        }
    }
}

impl Pods {
    fn start(
        client: &Client,
        changed: &Arc<Notify>,
        tasks: &mut Vec<JoinHandle<()>>,
        renew: Duration,
        agent: Option<(&str, &str)>,
    ) -> Self {
        let (fields, first_scope) = match agent {
            Some((node, _)) => (Some(format!("spec.nodeName={node}")), PodScope::Node),
            None => (None, PodScope::Cluster),
        };
        let first = watch_pods(
            Api::all(client.clone()),
            fields.as_deref(),
            changed,
            tasks,
            renew,
        );
        Self {
            first,
            first_scope,
            node: agent.map(|(node, _)| node.to_owned()),
            on_demand: Arc::new(Mutex::new(OnDemand {
                client: client.clone(),
                changed: Arc::clone(changed),
                renew,
                namespace: agent.map(|(_, ns)| ns.to_owned()).unwrap_or_default(),
                running: None,
            })),
        }
    }

    /// The Pods watched now and which they are: those of the watch started
    /// on demand once it has listed, else the first watch's.
    pub fn scoped_state(&self) -> (PodScope, Vec<StoredPod>) {
        let on_demand = self.lock();
        match on_demand.running.as_ref().map(|(r, _)| r) {
            Some(Running::Cluster(store)) if store.listed() => (PodScope::Cluster, store.state()),
            Some(Running::Gateways(names, slices)) if listed(slices) => {
                let mut pods = self.first.state();
                let own: HashSet<(&str, &str)> = pods.iter().map(StoredPod::key).collect();
                let published = published(slices, names, self.node.as_deref(), &own);
                pods.extend(published);
                (PodScope::Gateways, pods)
            }
            _ => (self.first_scope, self.first.state()),
        }
    }

    /// The Pods of [`Pods::scoped_state`] alone.
    pub fn state(&self) -> Vec<StoredPod> {
        self.scoped_state().1
    }

    /// Asks for the Pods `wanted` says (an agent's), starting or stopping
    /// a watch of slices or of every Pod; true when
    /// [`Pods::scoped_state`] gives them now. A watch started here wakes
    /// the daemon when it has listed.
    pub fn serve(&self, wanted: &Wanted) -> bool {
        if self.first_scope == PodScope::Cluster {
            return true;
        }
        let mut on_demand = self.lock();
        let current = match on_demand.running.as_ref().map(|(r, _)| r) {
            None => Wanted::Node,
            Some(Running::Cluster(_)) => Wanted::Cluster,
            Some(Running::Gateways(names, _)) => Wanted::Gateways(names.clone()),
        };
        if current != *wanted {
            if let Some((_, task)) = on_demand.running.take() {
                task.abort();
            }
            on_demand.running = on_demand.start(wanted);
        }
        match on_demand.running.as_ref().map(|(r, _)| r) {
            None => true,
            Some(Running::Cluster(store)) => store.listed(),
            Some(Running::Gateways(_, store)) => listed(store),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OnDemand> {
        self.on_demand
            .lock()
            .expect("the pod watch lock is never poisoned")
    }
}

impl OnDemand {
    /// Starts the watch `wanted` needs besides the node's own Pods.
    fn start(&self, wanted: &Wanted) -> Option<(Running, JoinHandle<()>)> {
        let mut tasks = Vec::new();
        let running = match wanted {
            Wanted::Node => {
                tracing::info!("no gateway selects this node: watching its own pods only");
                return None;
            }
            Wanted::Cluster => {
                tracing::info!(
                    "a gateway selects this node and no controller publishes its pods: watching \
                     every pod in the cluster"
                );
                Running::Cluster(watch_pods(
                    Api::all(self.client.clone()),
                    None,
                    &self.changed,
                    &mut tasks,
                    self.renew,
                ))
            }
            Wanted::Gateways(names) => {
                tracing::info!(
                    gateways = ?names,
                    "gateways select this node: watching the pods the controller publishes for them"
                );
                let values: Vec<String> = names
                    .iter()
                    .map(|g| egressgw_api::endpoints::gateway_label(g))
                    .collect();
                let labels = format!(
                    "{} in ({})",
                    egressgw_api::endpoints::GATEWAY_LABEL,
                    values.join(",")
                );
                let selection = Selection::slices(&labels);
                Running::Gateways(
                    names.clone(),
                    watch_fields(
                        Api::namespaced(self.client.clone(), &self.namespace),
                        selection,
                        &self.changed,
                        &[],
                        &mut tasks,
                        self.renew,
                    ),
                )
            }
        };
        let task = tasks.pop().expect("watch_fields starts one task");
        Some((running, task))
    }
}

/// Whether `store` holds its first complete list.
fn listed<K: Resource<DynamicType = ()> + Clone>(store: &Store<K>) -> bool {
    matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
}

/// The Pods the `slices` of the gateways `names` publish, but those of
/// `node` and those of a name in `own` (the node's own watch has them,
/// fresher: a Pod deleted elsewhere and made again on this node under its
/// name is still published on its old node for a moment), each Pod once.
fn published(
    slices: &Store<PublishedSlice>,
    names: &[String],
    node: Option<&str>,
    own: &HashSet<(&str, &str)>,
) -> Vec<StoredPod> {
    let mut slices: Vec<Arc<PublishedSlice>> = slices
        .state()
        .into_iter()
        .filter(|s| names.binary_search(&s.spec.gateway).is_ok())
        .collect();
    // In a fixed order, so that a Pod two gateways publish is read from
    // the same slice from one read to the next.
    slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut seen: HashSet<(&str, &str)> = HashSet::new();
    let mut out = Vec::new();
    for slice in &slices {
        for (at, PublishedPod(pod)) in slice.spec.pods.iter().enumerate() {
            let name = (pod.namespace.as_str(), pod.name.as_str());
            if pod.node.as_deref() != node && !own.contains(&name) && seen.insert(name) {
                out.extend(StoredPod::published(slice, at));
            }
        }
    }
    out
}

/// Adds the objects of `objects` that did not decode as invalid ones.
fn undecodable<K: Resource<DynamicType = ()>>(
    builder: SnapshotBuilder,
    objects: &[Arc<Decoded<K>>],
) -> SnapshotBuilder {
    objects.iter().fold(builder, |b, object| match &**object {
        Decoded::Ok(_) | Decoded::Converted { .. } => b,
        Decoded::Undecodable { meta, error } => b.undecodable(
            &K::kind(&()),
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or_default(),
            error,
        ),
    })
}

/// Retries of a failed watch: 250 ms doubling up to 4 s, each with up to
/// 50 % jitter, back to 250 ms after a success. A node that lost the API for
/// a while sees the cluster again within seconds (kube's default backoff
/// waits up to 30 s).
#[derive(Debug, Clone, Copy)]
struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const MIN: Duration = Duration::from_millis(250);
    const MAX: Duration = Duration::from_secs(4);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: Self::MIN }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        // Jitter from the clock's nanoseconds spreads agents retrying at once.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Some(delay + delay.mul_f64(f64::from(nanos % 500) / 1000.0))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

/// What a kind needs to be watched into a store.
pub trait Watched:
    Trim
    + Resource<DynamicType = ()>
    + Clone
    + PartialEq
    + Debug
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Trim
        + Resource<DynamicType = ()>
        + Clone
        + PartialEq
        + Debug
        + DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Starts a reflector for `api` and returns its store. Errors are logged
/// and retried with backoff; the store keeps its last state meanwhile.
///
/// The API server ends each watch after `renew` and the watcher starts the
/// next one from where it was (no new list). The watcher also gives up on a
/// watch that has been silent for `renew` plus 5 s: a connection that died
/// while the node's network was down (no FIN ever arrives) is then replaced
/// within that time instead of leaving the store stale for minutes.
pub fn watch<K>(
    api: Api<K>,
    changed: &Arc<Notify>,
    tasks: &mut Vec<JoinHandle<()>>,
    renew: Duration,
) -> Store<K>
where
    K: Watched,
{
    watch_fields(api, Selection::every(), changed, &[], tasks, renew)
}

/// Which objects of a kind a daemon watches, and what it keeps of each.
struct Selection<'a, K> {
    /// A field selector, or every object.
    fields: Option<&'a str>,
    /// A label selector, or every object.
    labels: Option<&'a str>,
    /// Drops what the daemon does not keep ([`Trim::trim`] at least).
    trim: fn(&mut K),
    /// Whether an object sent again with nothing kept changed (see
    /// [`resent`]) is stored as the object held, not anew; only for kinds
    /// whose copy is one count more ([`Decoded`]) or shares what it holds
    /// ([`PublishedSlice`]'s Pods), and whose stored `resourceVersion` no
    /// one reads.
    keep_resent: bool,
}

impl<K> Clone for Selection<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Selection<'_, K> {}

impl<K: Trim> Selection<'_, K> {
    /// Every object, trimmed by [`Trim::trim`].
    fn every() -> Self {
        Self {
            fields: None,
            labels: None,
            trim: K::trim,
            keep_resent: false,
        }
    }
}

impl<P: PolicyKind> Selection<'_, Decoded<P>> {
    /// Every policy; an agent keeps it [`without_conditions`], and keeps
    /// the object it holds when one comes again with only its conditions
    /// changed: the controller rewrites them with every count of Pods, and
    /// the object held then stays where it is, planned already, instead
    /// of being replaced by an equal one to convert and plan again.
    fn policies(agent: bool) -> Self {
        Self {
            fields: None,
            labels: None,
            trim: if agent { as_planned } else { as_written },
            keep_resent: agent,
        }
    }
}

impl Selection<'_, EgressGateway> {
    /// Every gateway; an agent keeps whether its Pods are published, not
    /// their count, which changes with every Pod of its policies.
    fn gateways(agent: bool) -> Self {
        Self {
            fields: None,
            labels: None,
            trim: if agent { published_only } else { Trim::trim },
            keep_resent: false,
        }
    }
}

impl<'a> Selection<'a, PublishedSlice> {
    /// The slices `labels` selects. One sent again unchanged is stored as
    /// the one held: the copy shares its Pods with it, and so with the
    /// planner, which plans again only when something changed; stored
    /// anew, its Pods would be held twice until then.
    fn slices(labels: &'a str) -> Self {
        Self {
            fields: None,
            labels: Some(labels),
            trim: Trim::trim,
            keep_resent: true,
        }
    }
}

/// What an agent keeps of a gateway's `status.pods`: that it is set.
fn published_only(gateway: &mut EgressGateway) {
    gateway.trim();
    if let Some(pods) = gateway.status.as_mut().and_then(|s| s.pods.as_mut()) {
        *pods = egressgw_api::gateway::GatewayPods::default();
    }
}

/// The two policy kinds, whose statuses are of one type.
pub trait PolicyKind: Resource<DynamicType = ()> + Clone {
    fn status(&self) -> Option<&EgressPolicyStatus>;
    fn status_mut(&mut self) -> Option<&mut EgressPolicyStatus>;
    /// The policy in the planner's terms, or every problem with it.
    fn to_model(&self) -> Result<egressgw_core::model::Policy, ValidationErrors>;
    /// The identity a policy of this kind and metadata has.
    fn id_of(meta: &ObjectMeta) -> PolicyRef;
}

impl PolicyKind for EgressPolicy {
    fn status(&self) -> Option<&EgressPolicyStatus> {
        self.status.as_ref()
    }
    fn status_mut(&mut self) -> Option<&mut EgressPolicyStatus> {
        self.status.as_mut()
    }
    fn to_model(&self) -> Result<egressgw_core::model::Policy, ValidationErrors> {
        EgressPolicy::to_model(self)
    }
    fn id_of(meta: &ObjectMeta) -> PolicyRef {
        PolicyRef::namespaced(
            meta.namespace.clone().unwrap_or_default(),
            meta.name.clone().unwrap_or_default(),
        )
    }
}

impl PolicyKind for EgressClusterPolicy {
    fn status(&self) -> Option<&EgressPolicyStatus> {
        self.status.as_ref()
    }
    fn status_mut(&mut self) -> Option<&mut EgressPolicyStatus> {
        self.status.as_mut()
    }
    fn to_model(&self) -> Result<egressgw_core::model::Policy, ValidationErrors> {
        EgressClusterPolicy::to_model(self)
    }
    fn id_of(meta: &ObjectMeta) -> PolicyRef {
        PolicyRef::cluster(meta.name.clone().unwrap_or_default())
    }
}

/// What an agent keeps of a policy: the policy converted into the
/// planner's terms ([`Decoded::convert`]), which the snapshot and the
/// planner then share; one that does not convert, whole but for its
/// status's conditions. The controller rewrites the `Ready` condition's
/// message whenever the count of Pods the policy selects changes, and an
/// agent plans from the spec and the placement (`status.eip`,
/// `status.node`) alone: a Pod created anywhere would otherwise wake every
/// agent of the cluster.
fn as_planned<P: PolicyKind>(policy: &mut Decoded<P>) {
    policy.trim();
    policy.convert(P::to_model, |_| None);
    if let Some(status) = policy.ok_mut().and_then(PolicyKind::status_mut) {
        status.conditions.clear();
    }
}

/// What the controller keeps of a policy: the policy converted, as an
/// agent keeps it, with the status the controller compares its writes
/// with; one that does not convert, whole, to be reported.
fn as_written<P: PolicyKind>(policy: &mut Decoded<P>) {
    policy.trim();
    policy.convert(P::to_model, |p| p.status().cloned());
}

/// The status of a stored policy: the object's, or the one kept with the
/// policy converted.
pub fn stored_status<P: PolicyKind>(policy: &Decoded<P>) -> Option<EgressPolicyStatus> {
    match policy {
        Decoded::Ok(p) => p.status().cloned(),
        Decoded::Converted { status, .. } => status.as_deref().cloned(),
        Decoded::Undecodable { .. } => None,
    }
}

/// [`watch`] of the objects `selection` selects, kept as it trims them;
/// every change that wakes `changed` also counts in each of `versions`, in
/// order.
fn watch_fields<K>(
    api: Api<K>,
    selection: Selection<'_, K>,
    changed: &Arc<Notify>,
    versions: &[&Arc<AtomicU64>],
    tasks: &mut Vec<JoinHandle<()>>,
    renew: Duration,
) -> Store<K>
where
    K: Watched,
{
    let (store, writer) = reflector::store();
    // Whether the event just stored brought nothing the daemon keeps: set
    // before the store takes the event, read once it has.
    let unchanged = Arc::new(AtomicBool::new(false));
    let (reader, flag) = (store.clone(), Arc::clone(&unchanged));
    let (trim, keep) = (selection.trim, selection.keep_resent);
    let stream = watcher(api, watch_config(selection.fields, selection.labels, renew))
        .map_ok(move |event| {
            let (event, resent) = taken(event, &reader, trim, keep);
            flag.store(resent, Ordering::Relaxed);
            event
        })
        .backoff(WatchBackoff::default())
        .reflect(writer)
        .map_ok(move |_| unchanged.load(Ordering::Relaxed));
    wake_on_changes::<K>(stream, changed, versions, tasks);
    store
}

/// A watch of the Pods `fields` selects (every Pod: `None`) into a
/// [`PodStore`], which keeps each as the planner takes it; as [`watch`]
/// otherwise.
fn watch_pods(
    api: Api<WatchedPod>,
    fields: Option<&str>,
    changed: &Arc<Notify>,
    tasks: &mut Vec<JoinHandle<()>>,
    renew: Duration,
) -> PodStore {
    let (store, writer) = PodStore::new();
    let stream = watcher(api, watch_config(fields, None, renew))
        .backoff(WatchBackoff::default())
        .map_ok(move |event| writer.take(event));
    wake_on_changes::<WatchedPod>(stream, changed, &[], tasks);
    store
}

/// The watcher's settings for the objects `fields` and `labels` select
/// (every object: `None`): the API server ends each watch after `renew`.
fn watch_config(fields: Option<&str>, labels: Option<&str>, renew: Duration) -> watcher::Config {
    let renew = u32::try_from(renew.as_secs()).unwrap_or(u32::MAX).max(1);
    let mut config = watcher::Config::default().any_semantic().timeout(renew);
    if let Some(fields) = fields {
        config = config.fields(fields);
    }
    if let Some(labels) = labels {
        config = config.labels(labels);
    }
    config
}

/// Runs the watch `stream` (whether each event left the store unchanged),
/// waking `changed` after each event that changed it, counted first in
/// each of `versions`, in order; logs its errors.
fn wake_on_changes<K: Resource<DynamicType = ()>>(
    stream: impl futures_util::Stream<Item = Result<bool, watcher::Error>> + Send + 'static,
    changed: &Arc<Notify>,
    versions: &[&Arc<AtomicU64>],
    tasks: &mut Vec<JoinHandle<()>>,
) {
    let changed = Arc::clone(changed);
    let versions: Vec<Arc<AtomicU64>> = versions.iter().map(|v| Arc::clone(v)).collect();
    let kind = K::kind(&()).into_owned();
    tasks.push(tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(true) => {}
                Ok(false) => {
                    for version in &versions {
                        version.fetch_add(1, Ordering::Release);
                    }
                    changed.notify_one();
                }
                Err(e) => tracing::warn!(kind, error = %e, "watch failed; retrying"),
            }
        }
    }));
}

/// `event` trimmed, as the store is to take it, and whether it was
/// [`resent`]; with `keep`, an object resent is the one the store holds.
fn taken<K>(
    event: watcher::Event<K>,
    store: &Store<K>,
    trim: fn(&mut K),
    keep: bool,
) -> (watcher::Event<K>, bool)
where
    K: Resource<DynamicType = ()> + Clone + PartialEq,
{
    let mut event = event.modify(trim);
    let held = resent(store, &mut event);
    let was = held.is_some();
    if keep && let (Some(held), watcher::Event::Apply(object)) = (held, &mut event) {
        *object = Arc::unwrap_or_clone(held);
    }
    (event, was)
}

/// The object the store holds when `event` applies one with the same
/// content, but for its `resourceVersion`: the API server sent it again
/// for a change the trim dropped (a heartbeat, a Pod condition), and
/// nothing the daemon plans from changed, so the loop is not woken.
/// Objects of a new list always wake it. The two are compared without
/// copying either: the event's object takes the held one's version for
/// the comparison, and gets its own back.
fn resent<K>(store: &Store<K>, event: &mut watcher::Event<K>) -> Option<Arc<K>>
where
    K: Resource<DynamicType = ()> + Clone + PartialEq,
{
    let watcher::Event::Apply(object) = event else {
        return None;
    };
    let held = store.get(&ObjectRef::from_obj(object))?;
    let version = std::mem::replace(
        &mut object.meta_mut().resource_version,
        held.meta().resource_version.clone(),
    );
    let same = *held == *object;
    object.meta_mut().resource_version = version;
    same.then_some(held)
}

/// What a daemon keeps of a watched object: what the planner reads
/// ([`egressgw_api::snapshot`]), and the metadata a store needs. The rest
/// is dropped before the store, so it costs no memory however much of it
/// the objects carry (a Pod's containers, volumes and conditions, a Node's
/// images).
pub trait Trim: Resource {
    /// Drops managed fields and annotations, which nothing reads.
    fn trim(&mut self) {
        let meta = self.meta_mut();
        meta.managed_fields = None;
        meta.annotations = None;
    }
}

impl Trim for Namespace {}
impl Trim for PublishedSlice {}
impl Trim for egressgw_api::endpoints::WatchedSlice {}
impl Trim for EgressGateway {}
/// A tunnel keeps all but its heartbeat: the agents renew it every 30 s
/// and nothing plans from it, so at a thousand nodes it would wake every
/// daemon thirty times a second.
impl Trim for EgressTunnel {
    fn trim(&mut self) {
        let meta = self.meta_mut();
        meta.managed_fields = None;
        meta.annotations = None;
        if let Some(status) = self.status.as_mut() {
            status.last_heartbeat_time = None;
        }
    }
}
impl Trim for Lease {}
impl<K: Resource<DynamicType = ()> + Clone> Trim for Decoded<K> {}

/// A Pod is decoded with what the planner reads alone ([`WatchedPod`]);
/// of its metadata, its owners go too. What the planner takes of it is
/// then kept converted, with the name, namespace and version alone
/// ([`WatchedPod::convert`]).
impl Trim for WatchedPod {
    fn trim(&mut self) {
        let meta = self.meta_mut();
        meta.managed_fields = None;
        meta.annotations = None;
        meta.owner_references = None;
        self.convert();
    }
}

/// A Node keeps its pod CIDRs, addresses and conditions, without their
/// heartbeat times: a kubelet writes its Node's status at least every five
/// minutes to renew them, which at a thousand nodes would wake every
/// daemon three times a second for nothing it plans from.
impl Trim for Node {
    fn trim(&mut self) {
        let meta = self.meta_mut();
        meta.managed_fields = None;
        meta.annotations = None;
        self.spec = self.spec.take().map(|spec| NodeSpec {
            pod_cidr: spec.pod_cidr,
            pod_cidrs: spec.pod_cidrs,
            ..NodeSpec::default()
        });
        self.status = self.status.take().map(|status| NodeStatus {
            addresses: status.addresses,
            conditions: status.conditions.map(|conditions| {
                conditions
                    .into_iter()
                    .map(|c| NodeCondition {
                        last_heartbeat_time: None,
                        ..c
                    })
                    .collect()
            }),
            ..NodeStatus::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use egressgw_api::{EgressEndpointSlice, snapshot};
    use serde_json::json;

    use super::*;

    /// A node no gateway selects plans from its own Pods; one that
    /// gateways select, from their slices while each is published or not
    /// taken in by a controller yet; from every Pod once a controller
    /// wrote one of their statuses without publishing.
    #[test]
    fn an_agent_watches_every_pod_only_beside_a_controller_that_does_not_publish() {
        use Publication::*;
        let of = |selecting: &[&str], says: &[(&str, Publication)]| {
            Wanted::of(selecting, |name| {
                says.iter()
                    .find(|(g, _)| *g == name)
                    .map_or(NoStatus, |(_, p)| *p)
            })
        };
        let gateways =
            |names: &[&str]| Wanted::Gateways(names.iter().map(|n| (*n).to_owned()).collect());
        assert_eq!(of(&[], &[("a", NotPublished)]), Wanted::Node);
        assert_eq!(
            of(&["a", "b"], &[("a", Published), ("b", Published)]),
            gateways(&["a", "b"])
        );
        // Created a moment ago: the controller's first status publishes.
        assert_eq!(
            of(&["a", "new"], &[("a", Published)]),
            gateways(&["a", "new"])
        );
        assert_eq!(of(&["new"], &[]), gateways(&["new"]));
        // A controller of an earlier release took it in.
        assert_eq!(
            of(&["a", "old"], &[("a", Published), ("old", NotPublished)]),
            Wanted::Cluster
        );
    }

    #[test]
    fn a_reading_tells_policies_changes_from_other_kinds() {
        let read = |all, policies| ClusterVersion { all, policies };
        let planned = read(10, 4);
        assert_eq!(read(10, 4).since(&planned), Changed::Nothing);
        // A policy's change counts in both.
        assert_eq!(read(12, 6).since(&planned), Changed::Policies);
        // Another kind's, alone or beside a policy's; also a policy's read
        // while it was counted in the whole only, which looks the same.
        assert_eq!(read(11, 4).since(&planned), Changed::Others);
        assert_eq!(read(12, 5).since(&planned), Changed::Others);
    }

    fn size<T: serde::Serialize>(object: &T) -> usize {
        serde_json::to_vec(object).expect("serialisable").len()
    }

    /// A Pod as the API server sends it, decoded as the daemons keep it:
    /// what the planner reads is the same before and after the trim.
    #[test]
    fn a_trimmed_pod_plans_as_the_whole_one() {
        let mut pod: WatchedPod = serde_json::from_value(json!({
            "metadata": {
                "name": "web-1", "namespace": "team-a", "uid": "u-1",
                "labels": { "app": "web" },
                "annotations": { "note": "x".repeat(500) },
                "ownerReferences": [{ "apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": "web", "uid": "rs-1" }],
                "managedFields": [{ "manager": "kubelet", "operation": "Update",
                    "fieldsType": "FieldsV1", "fieldsV1": { "f:status": {} } }],
            },
            "spec": { "nodeName": "node-1", "containers": [{ "name": "web" }] },
            "status": { "phase": "Running", "podIPs": [{ "ip": "10.244.1.2" }] },
        }))
        .expect("a Pod");
        let planned = snapshot::watched_pod(&pod);
        let before = size(&pod);
        pod.trim();
        assert_eq!(snapshot::watched_pod(&pod), planned);
        assert!(planned.is_some());
        assert!(size(&pod) * 4 < before, "{}", size(&pod));
        // Kept converted: the planner takes the Pod the store holds.
        let stored = StoredPod::from(Arc::new(pod));
        let (a, b) = (stored.planned().unwrap(), stored.planned().unwrap());
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(Some(&*a), planned.as_ref());
    }

    #[test]
    fn a_trimmed_node_plans_as_the_whole_one() {
        let images: Vec<_> = (0..50)
            .map(|i| json!({ "names": [format!("registry/image-{i}:v1")], "sizeBytes": 1000 }))
            .collect();
        let node: Node = serde_json::from_value(json!({
            "metadata": { "name": "node-1", "labels": { "egressgw.io/gateway": "true" },
                "annotations": { "a": "b" } },
            "spec": { "podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"],
                "providerID": "lab://node-1" },
            "status": {
                "addresses": [{ "type": "InternalIP", "address": "172.18.0.11" },
                    { "type": "ExternalIP", "address": "198.51.100.11" },
                    { "type": "Hostname", "address": "node-1" }],
                "conditions": [{ "type": "Ready", "status": "True" },
                    { "type": "MemoryPressure", "status": "False" }],
                "images": images,
                "capacity": { "cpu": "2" },
                "nodeInfo": { "architecture": "amd64", "bootID": "", "containerRuntimeVersion": "",
                    "kernelVersion": "", "kubeProxyVersion": "", "kubeletVersion": "",
                    "machineID": "", "operatingSystem": "linux", "osImage": "", "systemUUID": "" },
            },
        }))
        .expect("a Node");
        let mut trimmed = node.clone();
        trimmed.trim();
        assert_eq!(snapshot::node(&trimmed), snapshot::node(&node));
        assert!(size(&trimmed) * 4 < size(&node), "{}", size(&trimmed));
    }

    /// An object sent again with nothing kept changed (a tunnel's
    /// heartbeat) wakes no one; a change the planner reads, a deletion and
    /// a new list do.
    #[test]
    fn only_objects_changed_in_what_is_kept_wake_the_loop() {
        let tunnel = |version: &str, heartbeat: &str, mark: &str| {
            let mut t: EgressTunnel = serde_json::from_value(json!({
                "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressTunnel",
                "metadata": { "name": "node-1", "resourceVersion": version },
                "spec": {},
                "status": { "mark": mark, "lastHeartbeatTime": heartbeat },
            }))
            .expect("a tunnel");
            t.trim();
            t
        };
        let (store, mut writer) = reflector::store::<EgressTunnel>();
        let first = tunnel("1", "2026-11-27T10:00:00Z", "0x26000000");
        writer.apply_watcher_event(&watcher::Event::Apply(first));
        let heartbeat = tunnel("2", "2026-11-27T10:00:30Z", "0x26000000");
        assert!(resent(&store, &mut watcher::Event::Apply(heartbeat.clone())).is_some());
        let moved = tunnel("3", "2026-11-27T10:00:30Z", "0x26000001");
        assert!(resent(&store, &mut watcher::Event::Apply(moved)).is_none());
        assert!(resent(&store, &mut watcher::Event::Delete(heartbeat.clone())).is_none());
        assert!(resent(&store, &mut watcher::Event::InitApply(heartbeat)).is_none());
        let other = tunnel("4", "2026-11-27T10:00:30Z", "0x26000000");
        let mut other = other;
        other.metadata.name = Some("node-2".into());
        assert!(resent(&store, &mut watcher::Event::Apply(other)).is_none());
    }

    /// The controller's count of a policy's Pods (its `Ready` message)
    /// wakes no agent; the placement does. The controller keeps the
    /// conditions it compares its writes with.
    #[test]
    fn a_policys_conditions_wake_no_agent() {
        let policy = |version: &str, message: &str, node: &str| -> Decoded<EgressPolicy> {
            serde_json::from_value(json!({
                "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicy",
                "metadata": { "name": "web", "namespace": "team-a", "resourceVersion": version },
                "spec": { "egressGatewayName": "gw", "destSubnet": ["198.51.100.0/24"],
                    "appliedTo": { "podSelector": { "matchLabels": { "app": "web" } } } },
                "status": { "node": node, "eip": { "ipv4": "198.51.100.200" },
                    "conditions": [{ "type": "Ready", "status": "True", "reason": "Active",
                        "message": message, "lastTransitionTime": "2026-11-27T10:00:00Z" }] },
            }))
            .expect("a policy")
        };
        let agent = Selection::<Decoded<EgressPolicy>>::policies(true).trim;
        let kept = |version: &str, message: &str, node: &str| {
            let mut p = policy(version, message, node);
            agent(&mut p);
            p
        };
        let (store, mut writer) = reflector::store::<Decoded<EgressPolicy>>();
        writer.apply_watcher_event(&watcher::Event::Apply(kept(
            "1",
            "3 pod(s) leave",
            "node-1",
        )));
        let counted = kept("2", "4 pod(s) leave", "node-1");
        assert!(resent(&store, &mut watcher::Event::Apply(counted)).is_some());
        let moved = kept("3", "4 pod(s) leave", "node-2");
        assert!(resent(&store, &mut watcher::Event::Apply(moved)).is_none());

        // An agent keeps a policy converted, and stores one resent as the
        // policy it holds; a policy changed anew. The controller takes
        // every policy anew.
        let held = || {
            let stored = store.get(&ObjectRef::new("web").within("team-a"));
            match stored.as_deref() {
                Some(Decoded::Converted { policy, .. }) => Arc::clone(policy),
                other => panic!("{other:?}"),
            }
        };
        let taken_by = |agent: bool, version: &str, node: &str| {
            let selection = Selection::<Decoded<EgressPolicy>>::policies(agent);
            let event = watcher::Event::Apply(policy(version, "5 pod(s) leave", node));
            match taken(event, &store, selection.trim, selection.keep_resent) {
                (watcher::Event::Apply(object), resent) => (object, resent),
                other => panic!("{other:?}"),
            }
        };
        let (object, resent) = taken_by(true, "4", "node-1");
        let converted = object.converted().expect("converted");
        assert!(resent && Arc::ptr_eq(converted, &held()));
        assert_eq!(converted.previous_node.as_deref(), Some("node-1"));
        let (object, resent) = taken_by(true, "5", "node-2");
        let converted = object.converted().expect("converted");
        assert!(!resent && !Arc::ptr_eq(converted, &held()));
        assert_eq!(converted.previous_node.as_deref(), Some("node-2"));
        // What it keeps of the object: its name, namespace and version.
        assert_eq!(
            *object.meta(),
            ObjectMeta {
                name: Some("web".into()),
                namespace: Some("team-a".into()),
                resource_version: Some("5".into()),
                ..ObjectMeta::default()
            }
        );
        let (object, resent) = taken_by(false, "6", "node-1");
        assert!(!resent, "the controller takes every policy anew");
        assert!(object.converted().is_some(), "{object:?}");
        // Compared with the held one, it keeps its own version.
        assert_eq!(object.meta().resource_version.as_deref(), Some("6"));

        // The controller keeps a policy converted too, with the status it
        // compares its writes with, and the uid and generation its Events
        // and conditions name.
        let controller = Selection::<Decoded<EgressPolicy>>::policies(false).trim;
        let mut written = policy("2", "4 pod(s) leave", "node-1");
        if let Some(p) = written.ok_mut() {
            p.metadata.uid = Some("u-7".into());
            p.metadata.generation = Some(3);
        }
        controller(&mut written);
        assert!(written.converted().is_some(), "{written:?}");
        let status = stored_status(&written).expect("a status");
        assert_eq!(status.conditions[0].message, "4 pod(s) leave");
        assert_eq!(status.node.as_deref(), Some("node-1"));
        assert_eq!(written.meta().uid.as_deref(), Some("u-7"));
        assert_eq!(written.meta().generation, Some(3));
        assert_eq!(
            written.object_ref(&()).uid.as_deref(),
            Some("u-7"),
            "an Event names the policy by its uid"
        );

        // A policy that does not convert is kept whole for its problems
        // to be named, without its conditions.
        let mut invalid = policy("7", "5 pod(s) leave", "node-1");
        if let Some(p) = invalid.ok_mut() {
            p.spec.dest_subnet = vec!["nonsense".into()];
        }
        let mut whole = invalid.clone();
        agent(&mut invalid);
        let Decoded::Ok(invalid) = invalid else {
            panic!("kept whole: {invalid:?}")
        };
        assert!(invalid.to_model().is_err());
        assert!(
            invalid
                .status
                .as_ref()
                .expect("a status")
                .conditions
                .is_empty()
        );
        // The controller keeps it whole with its conditions.
        controller(&mut whole);
        assert!(whole.ok().is_some(), "{whole:?}");
        assert_eq!(stored_status(&whole).expect("a status").conditions.len(), 1);
    }

    fn slice(
        name: &str,
        gateway: &str,
        version: &str,
        pods: &[(&str, &str)],
    ) -> EgressEndpointSlice {
        let mut slice = EgressEndpointSlice::new(
            name,
            egressgw_api::EgressEndpointSliceSpec {
                gateway: gateway.into(),
                pods: pods
                    .iter()
                    .map(|(pod, node)| egressgw_api::EndpointPod {
                        namespace: "team-a".into(),
                        name: (*pod).into(),
                        node: (*node).into(),
                        ips: vec![format!("10.244.{}.{}", node.len(), pod.len())],
                        labels: [("app".to_owned(), "web".to_owned())].into(),
                    })
                    .collect(),
            },
        );
        slice.metadata.namespace = Some("egressgw-system".into());
        slice.metadata.resource_version = Some(version.into());
        slice
    }

    fn names(pods: &[StoredPod]) -> Vec<&str> {
        let mut names: Vec<&str> = pods.iter().map(|p| p.key().1).collect();
        names.sort_unstable();
        names
    }

    /// The Pods of the slices of this node's gateways, each once, but its
    /// own; read again, a Pod of an unchanged slice is where it was, so
    /// the planner is fed only what changed.
    #[test]
    fn published_pods_are_read_once_each_and_in_place_while_unchanged() {
        let (store, mut writer) = reflector::store::<PublishedSlice>();
        // Decoded from the slice's JSON, as from the API server.
        let apply = |writer: &mut reflector::store::Writer<PublishedSlice>,
                     s: EgressEndpointSlice| {
            let json = serde_json::to_value(&s).expect("a slice serializes");
            let decoded = serde_json::from_value(json).expect("a slice decodes");
            writer.apply_watcher_event(&watcher::Event::Apply(decoded));
        };
        apply(
            &mut writer,
            slice(
                "gw-0",
                "gw",
                "1",
                &[("web-1", "node-1"), ("web-2", "node-2")],
            ),
        );
        apply(
            &mut writer,
            slice("gw-1", "gw", "1", &[("web-3", "node-3")]),
        );
        apply(
            &mut writer,
            slice(
                "other-0",
                "other",
                "1",
                &[("web-2", "node-2"), ("db-1", "node-3")],
            ),
        );
        // A slice of a gateway not selecting the node (a label hash shared).
        apply(
            &mut writer,
            slice("far-0", "far", "1", &[("api-1", "node-3")]),
        );
        let gateways = ["gw".to_owned(), "other".to_owned()];
        // web-9 is published on node-3 but now runs on node-1 (made again
        // there under its name): the node's own watch has it.
        apply(
            &mut writer,
            slice("other-1", "other", "1", &[("web-9", "node-3")]),
        );
        let own: HashSet<(&str, &str)> = [("team-a", "web-9")].into();
        let first = published(&store, &gateways, Some("node-1"), &own);
        assert_eq!(names(&first), ["db-1", "web-2", "web-3"]);
        let again = published(&store, &gateways, Some("node-1"), &own);
        let find = |pods: &[StoredPod], name: &str| {
            pods.iter()
                .find(|p| p.key().1 == name)
                .expect("read")
                .clone()
        };
        let same_place = |a: &[StoredPod], b: &[StoredPod], name: &str| {
            find(a, name).address() == find(b, name).address()
        };
        let same_pod =
            |a: &[StoredPod], b: &[StoredPod], name: &str| find(a, name).same(&find(b, name));
        for pod in ["db-1", "web-2", "web-3"] {
            assert!(same_place(&first, &again, pod), "{pod}");
        }
        // web-3 relabelled in a new version of its slice: read from the
        // new slice, and no longer the same Pod.
        let mut changed = slice(
            "gw-1",
            "gw",
            "2",
            &[("web-3", "node-3"), ("web-4", "node-2")],
        );
        changed.spec.pods[0]
            .labels
            .insert("tier".into(), "front".into());
        apply(&mut writer, changed.clone());
        let third = published(&store, &gateways, Some("node-1"), &own);
        assert_eq!(names(&third), ["db-1", "web-2", "web-3", "web-4"]);
        assert!(!same_place(&again, &third, "web-3"));
        assert!(!same_pod(&again, &third, "web-3"));
        assert!(same_place(&again, &third, "web-2"));
        let planned = find(&third, "web-3").planned().expect("a running pod");
        assert_eq!(
            planned.labels.get("tier").map(String::as_str),
            Some("front")
        );
        // The slice written again for web-3 alone: web-4 is read from the
        // new slice, and is the same Pod.
        changed.metadata.resource_version = Some("3".into());
        changed.spec.pods[0]
            .labels
            .insert("tier".into(), "back".into());
        apply(&mut writer, changed);
        let fourth = published(&store, &gateways, Some("node-1"), &own);
        assert!(!same_place(&third, &fourth, "web-4"));
        assert!(same_pod(&third, &fourth, "web-4"));
        assert!(!same_pod(&third, &fourth, "web-3"));
    }

    /// A slice the API server sends again with only what is trimmed
    /// changed wakes no one and is stored sharing the Pods of the one held,
    /// which the planner holds too; a slice changed is stored anew.
    #[test]
    fn a_slice_sent_again_unchanged_is_stored_sharing_the_pods_held() {
        let decoded = |s: &EgressEndpointSlice| -> PublishedSlice {
            let json = serde_json::to_value(s).expect("a slice serializes");
            serde_json::from_value(json).expect("a slice decodes")
        };
        let (store, mut writer) = reflector::store::<PublishedSlice>();
        let first = slice("gw-0", "gw", "1", &[("web-1", "node-1")]);
        writer.apply_watcher_event(&watcher::Event::Apply(decoded(&first)));
        let held = store
            .get(&ObjectRef::new("gw-0").within("egressgw-system"))
            .expect("stored");
        let selection = Selection::<PublishedSlice>::slices("egressgw.io/gateway");
        let take = |s: &EgressEndpointSlice| {
            let event = watcher::Event::Apply(decoded(s));
            match taken(event, &store, selection.trim, selection.keep_resent) {
                (watcher::Event::Apply(object), resent) => (object, resent),
                other => panic!("{other:?}"),
            }
        };
        let mut annotated = first.clone();
        annotated.metadata.resource_version = Some("2".into());
        annotated.metadata.annotations = Some([("note".to_owned(), "x".to_owned())].into());
        let (object, resent) = take(&annotated);
        assert!(resent);
        assert!(Arc::ptr_eq(&object.spec.pods[0].0, &held.spec.pods[0].0));
        let mut moved = first.clone();
        moved.metadata.resource_version = Some("3".into());
        moved.spec.pods[0].node = "node-2".into();
        let (object, resent) = take(&moved);
        assert!(!resent);
        assert!(!Arc::ptr_eq(&object.spec.pods[0].0, &held.spec.pods[0].0));
        assert_eq!(object.spec.pods[0].0.node.as_deref(), Some("node-2"));
    }

    /// A kubelet's status renewal changes only its conditions' heartbeat
    /// times: stored, it wakes no one; a node turning NotReady does.
    #[test]
    fn a_nodes_heartbeat_alone_wakes_no_one() {
        let node = |version: &str, heartbeat: &str, ready: &str| {
            let mut n: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": "node-1", "resourceVersion": version },
                "status": { "conditions": [{ "type": "Ready", "status": ready,
                    "lastHeartbeatTime": heartbeat,
                    "lastTransitionTime": "2026-11-27T09:00:00Z" }] },
            }))
            .expect("a Node");
            n.trim();
            n
        };
        let (store, mut writer) = reflector::store::<Node>();
        writer.apply_watcher_event(&watcher::Event::Apply(node(
            "1",
            "2026-11-27T10:00:00Z",
            "True",
        )));
        let renewed = node("2", "2026-11-27T10:05:00Z", "True");
        assert!(resent(&store, &mut watcher::Event::Apply(renewed)).is_some());
        let not_ready = node("3", "2026-11-27T10:05:00Z", "False");
        assert!(resent(&store, &mut watcher::Event::Apply(not_ready)).is_none());
    }
}

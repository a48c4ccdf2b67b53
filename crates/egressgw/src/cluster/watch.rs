//! The objects a daemon watches, each kept in a reflector store, and the
//! snapshot the planner takes from them.
//!
//! Watch events only update the stores and wake the daemon's reconcile
//! loop ([`Notify`]); the loop reads the stores as a whole (level-based).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use egressgw_api::{
    EgressClusterPolicy, EgressGateway, EgressPolicy, EgressTunnel, SnapshotBuilder,
};
use egressgw_core::Snapshot;
use egressgw_core::model::Config;
use futures_util::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::decoded::Decoded;

/// Reflector stores of everything the planner reads.
#[derive(Clone)]
pub struct Stores {
    pub nodes: Store<Node>,
    pub namespaces: Store<Namespace>,
    pub pods: Store<Pod>,
    pub gateways: Store<EgressGateway>,
    /// Policies are taken one by one (see [`Decoded`]): a stored one that
    /// does not decode is reported, and stops no other.
    pub policies: Store<Decoded<EgressPolicy>>,
    pub cluster_policies: Store<Decoded<EgressClusterPolicy>>,
    pub tunnels: Store<EgressTunnel>,
}

impl Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores").finish_non_exhaustive()
    }
}

impl Stores {
    /// Starts one watch per kind, cluster-wide; every change wakes `changed`.
    /// Each watch is renewed every `renew` (see [`watch`]).
    pub fn start(
        client: &Client,
        changed: &Arc<Notify>,
        renew: Duration,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let mut tasks = Vec::new();
        let t = &mut tasks;
        let stores = Self {
            nodes: watch(Api::all(client.clone()), changed, t, renew),
            namespaces: watch(Api::all(client.clone()), changed, t, renew),
            pods: watch(Api::all(client.clone()), changed, t, renew),
            gateways: watch(Api::all(client.clone()), changed, t, renew),
            policies: watch(Api::all(client.clone()), changed, t, renew),
            cluster_policies: watch(Api::all(client.clone()), changed, t, renew),
            tunnels: watch(Api::all(client.clone()), changed, t, renew),
        };
        (stores, tasks)
    }

    /// Waits until every store holds its first complete list.
    pub async fn ready(&self) -> anyhow::Result<()> {
        let waits = [
            self.nodes.wait_until_ready().await,
            self.namespaces.wait_until_ready().await,
            self.pods.wait_until_ready().await,
            self.gateways.wait_until_ready().await,
            self.policies.wait_until_ready().await,
            self.cluster_policies.wait_until_ready().await,
            self.tunnels.wait_until_ready().await,
        ];
        for wait in waits {
            wait.map_err(|_| anyhow::anyhow!("a watch stopped before its first list"))?;
        }
        Ok(())
    }

    /// The planner's view of the stores now. A node counts as ready only
    /// while its agent reports (see [`SnapshotBuilder::agents_required`]).
    pub fn snapshot(&self, config: Config) -> Snapshot {
        let policies = self.policies.state();
        let cluster_policies = self.cluster_policies.state();
        let builder = SnapshotBuilder::new(config)
            .agents_required()
            .nodes(self.nodes.state())
            .namespaces(self.namespaces.state())
            .pods(self.pods.state())
            .gateways(self.gateways.state())
            .policies(policies.iter().filter_map(|p| p.ok()))
            .cluster_policies(cluster_policies.iter().filter_map(|p| p.ok()))
            .tunnels(self.tunnels.state());
        let builder = undecodable(builder, &policies);
        undecodable(builder, &cluster_policies).build()
    }
}

/// Adds the objects of `objects` that did not decode as invalid ones.
fn undecodable<K: Resource<DynamicType = ()>>(
    builder: SnapshotBuilder,
    objects: &[Arc<Decoded<K>>],
) -> SnapshotBuilder {
    objects.iter().fold(builder, |b, object| match &**object {
        Decoded::Ok(_) => b,
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
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let changed = Arc::clone(changed);
    let kind = K::kind(&()).into_owned();
    let renew = u32::try_from(renew.as_secs()).unwrap_or(u32::MAX).max(1);
    let stream = watcher(
        api,
        watcher::Config::default().any_semantic().timeout(renew),
    )
    .map_ok(|event| {
        event.modify(|object| {
            // Nothing egressgw reads; dropping it keeps the stores small.
            let meta = object.meta_mut();
            meta.managed_fields = None;
            meta.annotations = None;
        })
    })
    .backoff(WatchBackoff::default())
    .reflect(writer);
    tasks.push(tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => changed.notify_one(),
                Err(e) => tracing::warn!(kind, error = %e, "watch failed; retrying"),
            }
        }
    }));
    store
}

//! The store of a watch of Pods: each Pod held as the planner takes it.
//!
//! A reflector store holds every object whole, keyed by a reference that
//! copies its name, namespace, version and UID. For a Pod converted at the
//! watch ([`WatchedPod::convert`]) that is about 800 bytes beside the
//! planner's Pod: the object's metadata alone is a 360-byte struct,
//! nearly all of it empty. The controller holds every Pod of the cluster,
//! its standby too. [`PodStore`] holds a converted Pod as the planner's
//! `Arc` alone, found by the namespace and name that Pod carries; only a
//! Pod the planner does not take (finished, or being deleted) is kept as
//! the watched object.
//!
//! A Pod the API server sends again with nothing the daemon keeps changed
//! (a condition, a heartbeat of its status) stays the one held: the
//! planner, which is fed what changed by where each Pod is held
//! ([`StoredPod::address`]), then finds nothing to plan. A new list keeps
//! the Pods it lists unchanged the same way, and drops those it does not
//! list once it is complete.

use std::hash::BuildHasher;
use std::sync::{Arc, RwLock};

use egressgw_api::WatchedPod;
use hashbrown::HashTable;
use kube::runtime::watcher;
use tokio::sync::watch;

use super::stored::StoredPod;
use super::watch::Trim;

/// The Pods a watch holds; clones share them. Its [`PodWriter`] fills it.
#[derive(Debug, Clone)]
pub struct PodStore {
    held: Arc<RwLock<Held>>,
    /// Whether a list was complete once; closed when the writer is gone.
    listed: watch::Receiver<bool>,
}

/// What takes a watch's events into its [`PodStore`].
#[derive(Debug)]
pub struct PodWriter {
    held: Arc<RwLock<Held>>,
    listed: watch::Sender<bool>,
}

/// The watch stopped before its first list was complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterGone;

#[derive(Debug, Default)]
struct Held {
    pods: Table,
    /// A list being received: it replaces `pods` when complete.
    listing: Option<Table>,
}

/// Stored Pods, found by their namespace and name. Each table hashes
/// with a random state of its own: the names are the cluster users'.
#[derive(Debug, Default)]
struct Table {
    pods: HashTable<StoredPod>,
    state: foldhash::fast::RandomState,
}

impl Table {
    fn hash(&self, key: (&str, &str)) -> u64 {
        self.state.hash_one(key)
    }

    fn get(&self, key: (&str, &str)) -> Option<&StoredPod> {
        self.pods.find(self.hash(key), |p| p.key() == key)
    }

    /// Holds `pod` in place of the Pod of its name; `held` instead when
    /// `pod` is the same.
    fn put(&mut self, pod: StoredPod, held: Option<&StoredPod>) {
        let pod = match held {
            Some(held) if held.same(&pod) => held.clone(),
            _ => pod,
        };
        let key = pod.key();
        let state = &self.state;
        let hash = state.hash_one(key);
        match self
            .pods
            .entry(hash, |p| p.key() == key, |p| state.hash_one(p.key()))
        {
            hashbrown::hash_table::Entry::Occupied(mut entry) => *entry.get_mut() = pod,
            hashbrown::hash_table::Entry::Vacant(entry) => {
                entry.insert(pod);
            }
        }
    }

    fn remove(&mut self, key: (&str, &str)) {
        if let Ok(entry) = self.pods.find_entry(self.hash(key), |p| p.key() == key) {
            entry.remove();
        }
    }
}

impl PodStore {
    /// An empty store, and the writer that fills it.
    pub fn new() -> (PodStore, PodWriter) {
        let held = Arc::new(RwLock::new(Held::default()));
        let (sender, listed) = watch::channel(false);
        let store = PodStore {
            held: Arc::clone(&held),
            listed,
        };
        (
            store,
            PodWriter {
                held,
                listed: sender,
            },
        )
    }

    /// Every Pod held, in no order.
    pub fn state(&self) -> Vec<StoredPod> {
        read(&self.held).pods.pods.iter().cloned().collect()
    }

    /// Whether the watch's first list is complete.
    pub fn listed(&self) -> bool {
        *self.listed.borrow()
    }

    /// Waits until the watch's first list is complete; fails when the
    /// watch stopped before.
    pub async fn wait_until_listed(&self) -> Result<(), WriterGone> {
        let mut listed = self.listed.clone();
        match listed.wait_for(|listed| *listed).await {
            Ok(_) => Ok(()),
            Err(_) => Err(WriterGone),
        }
    }
}

impl PodWriter {
    /// Takes one event of the watch, its Pod trimmed first ([`Trim`]).
    /// Returns whether it changed nothing held: the Pod sent again the
    /// same, or deleted while not held.
    pub fn take(&self, event: watcher::Event<WatchedPod>) -> bool {
        // Converted before the lock is taken.
        let stored = |mut pod: WatchedPod| {
            pod.trim();
            StoredPod::from(Arc::new(pod))
        };
        match event {
            watcher::Event::Apply(pod) => {
                let pod = stored(pod);
                let mut held = write(&self.held);
                if held.pods.get(pod.key()).is_some_and(|was| was.same(&pod)) {
                    return true;
                }
                held.pods.put(pod, None);
            }
            watcher::Event::Delete(pod) => {
                let pod = stored(pod);
                let mut held = write(&self.held);
                if held.pods.get(pod.key()).is_none() {
                    return true;
                }
                held.pods.remove(pod.key());
            }
            watcher::Event::Init => write(&self.held).listing = Some(Table::default()),
            watcher::Event::InitApply(pod) => {
                let pod = stored(pod);
                let mut held = write(&self.held);
                let Held { pods, listing } = &mut *held;
                let was = pods.get(pod.key());
                listing.get_or_insert_with(Table::default).put(pod, was);
            }
            watcher::Event::InitDone => {
                let mut held = write(&self.held);
                if let Some(listing) = held.listing.take() {
                    held.pods = listing;
                }
                drop(held);
                self.listed.send_replace(true);
            }
        }
        false
    }
}

fn read(held: &RwLock<Held>) -> std::sync::RwLockReadGuard<'_, Held> {
    held.read()
        .expect("the pod store is never left half-written")
}

fn write(held: &RwLock<Held>) -> std::sync::RwLockWriteGuard<'_, Held> {
    held.write()
        .expect("the pod store is never left half-written")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Pod as the API server sends it, at `version`.
    fn pod(name: &str, app: &str, ip: &str, version: &str) -> WatchedPod {
        let yaml = format!(
            "metadata: {{name: {name}, namespace: shop, resourceVersion: '{version}', \
             labels: {{app: {app}}}, annotations: {{a: b}}}}\n\
             spec: {{nodeName: n1, containers: []}}\n\
             status: {{phase: Running, podIP: {ip}, podIPs: [{{ip: {ip}}}]}}"
        );
        serde_yaml::from_str(&yaml).unwrap()
    }

    fn apply(pod: WatchedPod) -> watcher::Event<WatchedPod> {
        watcher::Event::Apply(pod)
    }

    fn delete(pod: WatchedPod) -> watcher::Event<WatchedPod> {
        watcher::Event::Delete(pod)
    }

    fn listed(pod: WatchedPod) -> watcher::Event<WatchedPod> {
        watcher::Event::InitApply(pod)
    }

    fn finished(name: &str) -> WatchedPod {
        let mut pod = pod(name, "web", "10.244.1.9", "1");
        pod.status.as_mut().unwrap().phase = Some("Succeeded".into());
        pod
    }

    fn held(store: &PodStore, name: &str) -> Option<StoredPod> {
        read(&store.held).pods.get(("shop", name)).cloned()
    }

    fn names(store: &PodStore) -> Vec<String> {
        let mut names: Vec<String> = store.state().iter().map(|p| p.key().1.to_owned()).collect();
        names.sort();
        names
    }

    /// A converted Pod is held as the planner's `Arc` alone; the planner
    /// takes that one, not a copy.
    #[test]
    fn a_converted_pod_is_held_as_the_planner_takes_it() {
        let (store, writer) = PodStore::new();
        assert!(!writer.take(apply(pod("web-1", "web", "10.244.1.5", "1"))));
        let stored = held(&store, "web-1").unwrap();
        let (a, b) = (stored.planned().unwrap(), stored.planned().unwrap());
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.ips, ["10.244.1.5".parse::<std::net::IpAddr>().unwrap()]);
        assert!(stored.watched().is_none(), "no object is kept beside it");
        // A finished one is kept whole, and planned as sending nothing.
        assert!(!writer.take(apply(finished("job-1"))));
        let job = held(&store, "job-1").unwrap();
        assert!(job.planned().is_none());
        assert!(job.watched().is_some());
    }

    /// A Pod sent again with only what is not kept changed stays the one
    /// held, where it is held; a change replaces it.
    #[test]
    fn a_pod_sent_again_unchanged_stays_where_it_is_held() {
        let (store, writer) = PodStore::new();
        writer.take(apply(pod("web-1", "web", "10.244.1.5", "1")));
        let first = held(&store, "web-1").unwrap().address();
        assert!(writer.take(apply(pod("web-1", "web", "10.244.1.5", "2"))));
        assert_eq!(held(&store, "web-1").unwrap().address(), first);
        assert!(!writer.take(apply(pod("web-1", "db", "10.244.1.5", "3"))));
        let now = held(&store, "web-1").unwrap();
        assert_ne!(now.address(), first);
        assert_eq!(now.planned().unwrap().labels.get("app").unwrap(), "db");
        assert_eq!(store.state().len(), 1);
    }

    /// A Pod kept whole (finished, or being deleted) sent again with only
    /// its version changed stays the one held too.
    #[test]
    fn a_pod_kept_whole_sent_again_with_a_new_version_stays_held() {
        let (store, writer) = PodStore::new();
        assert!(!writer.take(apply(finished("job-1"))));
        let first = held(&store, "job-1").unwrap().address();
        let mut again = finished("job-1");
        again.metadata.resource_version = Some("2".into());
        assert!(writer.take(apply(again)));
        assert_eq!(held(&store, "job-1").unwrap().address(), first);
        let mut failed = finished("job-1");
        failed.status.as_mut().unwrap().phase = Some("Failed".into());
        assert!(!writer.take(apply(failed)));
    }

    /// Waiting for the first list ends when it is complete, and fails when
    /// the watch stopped before it was.
    #[tokio::test]
    async fn the_first_list_is_waited_for_until_the_watch_stops() {
        let (store, writer) = PodStore::new();
        writer.take(watcher::Event::Init);
        writer.take(watcher::Event::InitDone);
        assert_eq!(store.wait_until_listed().await, Ok(()));
        let (store, writer) = PodStore::new();
        writer.take(watcher::Event::Init);
        drop(writer);
        assert_eq!(store.wait_until_listed().await, Err(WriterGone));
    }

    #[test]
    fn a_pod_deleted_is_no_longer_held() {
        let (store, writer) = PodStore::new();
        writer.take(apply(pod("web-1", "web", "10.244.1.5", "1")));
        writer.take(apply(pod("web-2", "web", "10.244.1.6", "1")));
        assert!(!writer.take(delete(pod("web-1", "web", "10.244.1.5", "2"))));
        assert_eq!(names(&store), ["web-2"]);
        // Deleted again, or never held: nothing changes.
        assert!(writer.take(delete(pod("web-1", "web", "10.244.1.5", "2"))));
    }

    /// A list replaces what is held once complete: the Pods it lists
    /// unchanged stay where they are held, the others go.
    #[test]
    fn a_new_list_keeps_its_pods_unchanged_and_drops_those_it_does_not_list() {
        let (store, writer) = PodStore::new();
        assert!(!store.listed());
        writer.take(watcher::Event::Init);
        writer.take(listed(pod("web-1", "web", "10.244.1.5", "1")));
        writer.take(listed(pod("web-2", "web", "10.244.1.6", "1")));
        // Not held before the list is complete.
        assert!(store.state().is_empty());
        assert!(!store.listed());
        writer.take(watcher::Event::InitDone);
        assert!(store.listed());
        assert_eq!(names(&store), ["web-1", "web-2"]);
        let web1 = held(&store, "web-1").unwrap().address();
        let web2 = held(&store, "web-2").unwrap().address();

        // Listed again after the watch was lost: web-1 as it was, web-2
        // changed, web-3 new, web-2's old self held until the list ends.
        writer.take(watcher::Event::Init);
        writer.take(listed(pod("web-1", "web", "10.244.1.5", "7")));
        writer.take(listed(pod("web-3", "web", "10.244.1.7", "7")));
        assert_eq!(names(&store), ["web-1", "web-2"]);
        assert_eq!(held(&store, "web-2").unwrap().address(), web2);
        writer.take(watcher::Event::InitDone);
        assert_eq!(names(&store), ["web-1", "web-3"]);
        assert_eq!(held(&store, "web-1").unwrap().address(), web1);
    }
}

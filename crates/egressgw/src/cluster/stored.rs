//! A Pod as a daemon's stores hold it: a watched Pod converted into the
//! planner's terms, a watched Pod object the planner does not take, or one
//! entry of an `EgressEndpointSlice` the controller published, decoded as
//! planned ([`PublishedSlice`]).
//!
//! The planner is fed what changed since its last read by the identity of
//! these ([`StoredPod::address`]): a store replaces an object when the API
//! server sends a new version of it, and keeps it otherwise. A published
//! Pod is read where the slice holds it, not copied out of it: a gateway
//! node's agent holds each of the Pods it carries once, in its slice,
//! shared with the planner; a watched Pod is held converted
//! ([`WatchedPod::convert`]), shared the same way.

use std::sync::Arc;

use egressgw_api::WatchedPod;
use egressgw_api::endpoints::PublishedSlice;
use egressgw_core::model;

/// One stored Pod.
#[derive(Debug, Clone)]
pub struct StoredPod(Stored);

#[derive(Debug, Clone)]
enum Stored {
    /// A Pod from a watch of Pods, converted ([`WatchedPod::convert`]).
    Converted(Arc<model::Pod>),
    /// A Pod object from a watch of Pods, not converted: it finished, or
    /// is being deleted.
    Watched(Arc<WatchedPod>),
    /// A slice and the index of one of its Pods' entries.
    Published(Arc<PublishedSlice>, usize),
}

/// Where a [`StoredPod`] is held: the same while its store keeps the
/// object, and never reused while a [`StoredPod`] keeps it alive.
pub type Address = (usize, usize);

/// A watched Pod as stored: its planner's Pod alone once converted.
impl From<Arc<WatchedPod>> for StoredPod {
    fn from(pod: Arc<WatchedPod>) -> Self {
        match &pod.converted {
            Some(converted) => Self(Stored::Converted(Arc::clone(converted))),
            None => Self(Stored::Watched(pod)),
        }
    }
}

impl StoredPod {
    /// The Pod of `slice`'s entry `at`; `None` when it has no such entry.
    pub fn published(slice: &Arc<PublishedSlice>, at: usize) -> Option<Self> {
        (at < slice.spec.pods.len()).then(|| Self(Stored::Published(Arc::clone(slice), at)))
    }

    pub fn address(&self) -> Address {
        match &self.0 {
            Stored::Converted(pod) => (Arc::as_ptr(pod) as usize, 0),
            Stored::Watched(pod) => (Arc::as_ptr(pod) as usize, 0),
            Stored::Published(slice, at) => (Arc::as_ptr(slice) as usize, *at),
        }
    }

    /// The Pod's namespace and name.
    pub fn key(&self) -> (&str, &str) {
        match &self.0 {
            Stored::Converted(pod) => (&pod.namespace, &pod.name),
            Stored::Watched(pod) => (
                pod.metadata.namespace.as_deref().unwrap_or_default(),
                pod.metadata.name.as_deref().unwrap_or_default(),
            ),
            Stored::Published(slice, at) => {
                let pod = &slice.spec.pods[*at].0;
                (&pod.namespace, &pod.name)
            }
        }
    }

    /// The Pod as the planner takes it; `None` when it sends nothing (it
    /// finished, or is being deleted). A published Pod is shared with its
    /// slice, not copied.
    pub fn planned(&self) -> Option<Arc<model::Pod>> {
        match &self.0 {
            Stored::Converted(pod) => Some(Arc::clone(pod)),
            Stored::Watched(pod) => egressgw_api::snapshot::watched_pod(pod).map(Arc::new),
            Stored::Published(slice, at) => Some(Arc::clone(&slice.spec.pods[*at].0)),
        }
    }

    /// The watched object held, when the Pod is not held converted.
    #[cfg(test)]
    pub fn watched(&self) -> Option<&WatchedPod> {
        match &self.0 {
            Stored::Watched(pod) => Some(pod),
            _ => None,
        }
    }

    /// Whether `other` holds the same Pod as this, as stored: a slice
    /// written again with this Pod's entry unchanged, say.
    pub fn same(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Stored::Converted(a), Stored::Converted(b)) => Arc::ptr_eq(a, b) || a == b,
            (Stored::Watched(a), Stored::Watched(b)) => same_but_version(a, b),
            (Stored::Published(a, i), Stored::Published(b, j)) => {
                a.spec.pods[*i] == b.spec.pods[*j]
            }
            _ => false,
        }
    }
}

/// Whether `a` and `b` are the same but for their `resourceVersion`: one
/// sent again for a change nothing keeps.
fn same_but_version(a: &WatchedPod, b: &WatchedPod) -> bool {
    if a.spec != b.spec || a.status != b.status || a.converted != b.converted {
        return false;
    }
    let mut meta = a.metadata.clone();
    meta.resource_version
        .clone_from(&b.metadata.resource_version);
    meta == b.metadata
}

//! Telling an uninstall from a restart when the agent is stopped.
//!
//! A restart, a rolling upgrade or a node drain stops the agent while its
//! DaemonSet stays; the datapath must stay too, so that traffic keeps
//! flowing. `helm uninstall` deletes the DaemonSet first, and only then do
//! its Pods get SIGTERM (the garbage collector deletes them after their
//! owner); an agent that knows its DaemonSet is gone removes everything it
//! created before it exits.
//!
//! The agent learns it two ways: a watch on its DaemonSet, open while it
//! runs (it sees the deletion even after the uninstall has also deleted the
//! agent's permissions, since a watch is authorized when it starts), and
//! one lookup when the signal comes. When neither can tell — the API server
//! unreachable, the permissions gone and the watch down — the datapath
//! stays: keeping a working datapath is the safe side of the doubt, and
//! `egressgw cleanup` removes it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Api;
use kube::runtime::watcher;

/// How long the lookup at stop may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// What one lookup of the DaemonSet found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// It exists and is not being deleted.
    Present,
    /// It exists with a deletion timestamp.
    Deleting,
    /// The API server says there is none.
    Absent,
    /// The lookup failed: unreachable, timed out, forbidden.
    Unknown(String),
}

/// Why the agent removes the datapath, or `None` to keep it.
pub fn uninstall_reason(watch_saw_deletion: bool, lookup: &Lookup) -> Option<&'static str> {
    if watch_saw_deletion {
        return Some("the watch saw the agent's DaemonSet deleted");
    }
    match lookup {
        Lookup::Absent => Some("the agent's DaemonSet no longer exists"),
        Lookup::Deleting => Some("the agent's DaemonSet is being deleted"),
        Lookup::Present | Lookup::Unknown(_) => None,
    }
}

/// The agent's DaemonSet, watched from start to stop.
#[derive(Debug)]
pub struct Owner {
    api: Api<DaemonSet>,
    name: String,
    deleted: AtomicBool,
}

impl Owner {
    /// Starts watching the DaemonSet `name` of `api`'s namespace.
    pub fn watch(api: Api<DaemonSet>, name: &str) -> Arc<Self> {
        let owner = Arc::new(Self {
            api,
            name: name.to_owned(),
            deleted: AtomicBool::new(false),
        });
        tokio::spawn(Arc::clone(&owner).follow());
        owner
    }

    async fn follow(self: Arc<Self>) {
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.name));
        let mut events = std::pin::pin!(watcher(self.api.clone(), config));
        let mut seen_in_list = false;
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Delete(_)) => self.mark_deleted("deleted"),
                Ok(watcher::Event::Apply(ds) | watcher::Event::InitApply(ds)) => {
                    seen_in_list = true;
                    if ds.metadata.deletion_timestamp.is_some() {
                        self.mark_deleted("being deleted");
                    }
                }
                Ok(watcher::Event::Init) => seen_in_list = false,
                Ok(watcher::Event::InitDone) if !seen_in_list => {
                    self.mark_deleted("absent from a fresh list");
                }
                Ok(watcher::Event::InitDone) => {}
                Err(e) => {
                    tracing::debug!(daemonset = self.name, error = %e, "DaemonSet watch failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn mark_deleted(&self, how: &str) {
        if !self.deleted.swap(true, Ordering::SeqCst) {
            tracing::info!(
                daemonset = self.name,
                "the agent's DaemonSet is {how}: the datapath goes when the agent stops"
            );
        }
    }

    /// Looks the DaemonSet up once more and says whether this stop is an
    /// uninstall, and why.
    pub async fn uninstall_reason(&self) -> Option<&'static str> {
        let lookup = match tokio::time::timeout(LOOKUP_TIMEOUT, self.api.get_opt(&self.name)).await
        {
            Ok(Ok(Some(ds))) if ds.metadata.deletion_timestamp.is_some() => Lookup::Deleting,
            Ok(Ok(Some(_))) => Lookup::Present,
            Ok(Ok(None)) => Lookup::Absent,
            Ok(Err(e)) => Lookup::Unknown(e.to_string()),
            Err(_) => Lookup::Unknown("timed out".to_owned()),
        };
        let reason = uninstall_reason(self.deleted.load(Ordering::SeqCst), &lookup);
        if reason.is_none()
            && let Lookup::Unknown(error) = &lookup
        {
            tracing::warn!(
                daemonset = self.name,
                error,
                "cannot tell an uninstall from a restart; the datapath stays (`egressgw cleanup` removes it)"
            );
        }
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_daemonset_keeps_the_datapath() {
        assert_eq!(uninstall_reason(false, &Lookup::Present), None);
    }

    #[test]
    fn an_unanswered_lookup_keeps_the_datapath() {
        assert_eq!(
            uninstall_reason(false, &Lookup::Unknown("403 Forbidden".into())),
            None
        );
    }

    #[test]
    fn a_deleted_or_deleting_daemonset_is_an_uninstall() {
        assert!(uninstall_reason(false, &Lookup::Absent).is_some());
        assert!(uninstall_reason(false, &Lookup::Deleting).is_some());
    }

    #[test]
    fn a_deletion_seen_by_the_watch_wins_over_a_failed_lookup() {
        assert!(uninstall_reason(true, &Lookup::Unknown("401 Unauthorized".into())).is_some());
    }
}

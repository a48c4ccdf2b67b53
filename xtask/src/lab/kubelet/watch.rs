//! The Pods bound to the lab's nodes, kept current by one watch per node,
//! as each kubelet watches its own node's Pods (a `spec.nodeName` field
//! selector): Pods of Nodes that are objects only (the scale test's
//! hundred thousand) never reach the stand-in. A thread per node lists
//! them, then follows `kubectl get pods --watch` and applies each event to
//! a store, which the stand-in's rounds read. When the watch ends (the API
//! restarts, say), the store is marked stale until a new list succeeds; a
//! new list replaces the store whole, so a Pod deleted meanwhile is not
//! kept. The watch is also started afresh every [`RELIST`], as informers
//! resync.
//!
//! One long-running kubectl costs next to nothing while nothing changes,
//! where listing every round kept a core busy a tenth of the time.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::Value;

use super::api::Api;
use super::pod::log;
use crate::lab::topology::Netns;

/// How often the watch is started afresh (list, then watch).
const RELIST: Duration = Duration::from_secs(300);
/// How long to wait before listing again after a failure.
const RETRY: Duration = Duration::from_secs(1);

/// What the watch thread shares with the rounds.
#[derive(Debug, Default)]
struct Store {
    /// By uid.
    pods: BTreeMap<String, Pod>,
    /// Whether `pods` follows the API: a list succeeded and its watch runs.
    synced: bool,
    /// Why it does not, when it does not.
    error: Option<String>,
}

/// A watch event as `kubectl get --watch --output-watch-events -o json`
/// prints it.
#[derive(Debug, Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    object: Value,
}

/// The Pods bound to the lab's nodes, as the API has them: a store per node.
#[derive(Debug, Clone)]
pub struct PodWatch {
    stores: Vec<Arc<Mutex<Store>>>,
}

/// How to run kubectl: the program, its kubeconfig, the namespace where
/// the API server is reachable.
#[derive(Debug, Clone)]
pub struct KubectlCommand {
    pub program: PathBuf,
    pub kubeconfig: PathBuf,
    pub netns: Netns,
}

impl KubectlCommand {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", self.netns.as_str()])
            .arg(&self.program)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args);
        command
    }
}

impl PodWatch {
    /// Starts a watch thread per node.
    pub fn start<'a>(
        api: &Api,
        kubectl: &KubectlCommand,
        nodes: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let stores = nodes
            .into_iter()
            .map(|node| {
                let store = Arc::new(Mutex::new(Store::default()));
                let shared = store.clone();
                let (api, kubectl, node) = (api.clone(), kubectl.clone(), node.to_owned());
                thread::spawn(move || follow(&api, &kubectl, &node, &shared));
                store
            })
            .collect();
        Self { stores }
    }

    /// The Pods now, or why a node's store does not follow the API.
    pub fn snapshot(&self) -> anyhow::Result<Vec<Pod>> {
        let mut pods = Vec::new();
        for store in &self.stores {
            let store = store.lock().unwrap_or_else(PoisonError::into_inner);
            if !store.synced {
                let why = store
                    .error
                    .clone()
                    .unwrap_or_else(|| "not listed yet".to_owned());
                return Err(anyhow!(why));
            }
            pods.extend(store.pods.values().cloned());
        }
        Ok(pods)
    }
}

/// List, watch, repeat, forever. A watch that ends cleanly is followed
/// by a new list at once, the store still taken as current; one that fails
/// marks the store stale until a list succeeds.
fn follow(api: &Api, kubectl: &KubectlCommand, node: &str, store: &Mutex<Store>) {
    loop {
        let result = api.bound_pods(node).and_then(|pods| {
            {
                let mut s = store.lock().unwrap_or_else(PoisonError::into_inner);
                s.pods = by_uid(pods);
                s.synced = true;
                s.error = None;
            }
            watch(kubectl, node, store)
        });
        if let Err(e) = result {
            let mut s = store.lock().unwrap_or_else(PoisonError::into_inner);
            s.synced = false;
            s.error = Some(format!("{e:#}"));
            drop(s);
            thread::sleep(RETRY);
        }
    }
}

fn by_uid(pods: Vec<Pod>) -> BTreeMap<String, Pod> {
    pods.into_iter()
        .filter_map(|p| Some((p.metadata.uid.clone()?, p)))
        .collect()
}

/// Follows one `kubectl get pods --watch` until it ends (`Ok` if kubectl
/// ended it cleanly, as the API server closes a watch after a while) or
/// has run for [`RELIST`] (`Ok`).
fn watch(kubectl: &KubectlCommand, node: &str, store: &Mutex<Store>) -> anyhow::Result<()> {
    let selector = format!("--field-selector=spec.nodeName={node}");
    let mut child = kubectl
        .command(&[
            "get",
            "pods",
            "--all-namespaces",
            &selector,
            "--watch",
            "--output-watch-events",
            "--output=json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting kubectl get pods --watch")?;
    let stdout = child.stdout.take().context("taking kubectl's output")?;
    let started = Instant::now();
    let events = serde_json::Deserializer::from_reader(BufReader::new(stdout)).into_iter::<Event>();
    for event in events {
        let event = match event {
            Ok(event) => event,
            Err(e) => return Err(ended(child, &format!("reading the watch: {e}"))),
        };
        if let Err(e) = apply(store, event) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        if started.elapsed() >= RELIST {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(());
        }
    }
    match child.wait() {
        Ok(status) if status.success() => Ok(()),
        _ => Err(ended(child, "the watch ended")),
    }
}

/// Why the watch ended: kubectl's own words, if it said any.
fn ended(mut child: Child, what: &str) -> anyhow::Error {
    let _ = child.kill();
    let output = child.wait_with_output();
    let stderr = output
        .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_owned())
        .unwrap_or_default();
    if stderr.is_empty() {
        anyhow!("{what}")
    } else {
        anyhow!("{what}: {stderr}")
    }
}

/// Applies one event to the store.
fn apply(store: &Mutex<Store>, event: Event) -> anyhow::Result<()> {
    if event.kind == "ERROR" {
        return Err(anyhow!("the watch failed: {}", event.object));
    }
    if event.kind == "BOOKMARK" {
        return Ok(());
    }
    let pod: Pod = match serde_json::from_value(event.object) {
        Ok(pod) => pod,
        Err(e) => {
            log(&format!("ignoring a watch event that is not a Pod: {e}"));
            return Ok(());
        }
    };
    let Some(uid) = pod.metadata.uid.clone() else {
        return Ok(());
    };
    let mut s = store.lock().unwrap_or_else(PoisonError::into_inner);
    if event.kind == "DELETED" {
        s.pods.remove(&uid);
    } else {
        s.pods.insert(uid, pod);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, uid: &str, phase: &str) -> Event {
        Event {
            kind: kind.to_owned(),
            object: serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": { "name": "p", "namespace": "n", "uid": uid },
                "status": { "phase": phase },
            }),
        }
    }

    fn phases(store: &Mutex<Store>) -> Vec<String> {
        let s = store.lock().unwrap();
        s.pods
            .values()
            .map(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_default()
            })
            .collect()
    }

    #[test]
    fn events_add_replace_and_remove_pods_by_uid() {
        let store = Mutex::new(Store::default());
        apply(&store, event("ADDED", "a", "Pending")).unwrap();
        apply(&store, event("ADDED", "b", "Pending")).unwrap();
        apply(&store, event("MODIFIED", "a", "Running")).unwrap();
        apply(&store, event("DELETED", "b", "Running")).unwrap();
        apply(&store, event("BOOKMARK", "c", "")).unwrap();
        assert_eq!(phases(&store), ["Running"]);
    }

    #[test]
    fn an_error_event_ends_the_watch() {
        let store = Mutex::new(Store::default());
        let error = Event {
            kind: "ERROR".to_owned(),
            object: serde_json::json!({ "kind": "Status", "message": "too old resource version" }),
        };
        assert!(
            apply(&store, error)
                .unwrap_err()
                .to_string()
                .contains("too old")
        );
    }

    #[test]
    fn a_store_that_does_not_follow_the_api_says_why() {
        let watch = PodWatch {
            stores: vec![
                Arc::new(Mutex::new(Store {
                    synced: true,
                    ..Store::default()
                })),
                Arc::new(Mutex::new(Store {
                    error: Some("connection refused".to_owned()),
                    ..Store::default()
                })),
            ],
        };
        assert!(
            watch
                .snapshot()
                .unwrap_err()
                .to_string()
                .contains("refused")
        );
    }
}

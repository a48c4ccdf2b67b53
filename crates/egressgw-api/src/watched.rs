//! [`WatchedPod`]: a Pod as the daemons keep it.
//!
//! A daemon that plans from every Pod in the cluster holds each one for as
//! long as it runs. A `k8s-openapi` [`Pod`] is 2 248 bytes before any of its
//! strings, most of it fields egressgw never reads. A [`WatchedPod`] is
//! decoded straight from the API server's JSON with the fields the planner
//! reads ([`crate::snapshot::watched_pod`]); the rest is skipped while
//! decoding and never held.
//!
//! A daemon's watch then converts it ([`WatchedPod::convert`]): it keeps
//! the Pod in the planner's terms, shared with the planner, and of the
//! object only the name, namespace and version a store needs. The
//! controller, which holds every Pod, held each twice before: the
//! object, its labels in a map, and the planner's copy.

use std::sync::Arc;

use egressgw_core::model;
use k8s_openapi::api::core::v1::{Pod, PodIP};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// A Pod's metadata, node, network mode, phase and addresses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WatchedPod {
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<WatchedPodSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<WatchedPodStatus>,
    /// The Pod in the planner's terms, once converted
    /// ([`WatchedPod::convert`]); `spec` and `status` are then dropped.
    #[serde(skip)]
    pub converted: Option<Arc<model::Pod>>,
}

impl WatchedPod {
    /// Keeps the Pod in the planner's terms alone, with the name,
    /// namespace and `resourceVersion`, when the planner takes it. A Pod
    /// it does not take (finished, or being deleted) is kept as it is.
    pub fn convert(&mut self) {
        if self.converted.is_some() {
            return;
        }
        let Some(pod) = crate::snapshot::watched_pod(self) else {
            return;
        };
        let meta = std::mem::take(&mut self.metadata);
        self.metadata = ObjectMeta {
            name: meta.name,
            namespace: meta.namespace,
            resource_version: meta.resource_version,
            ..ObjectMeta::default()
        };
        self.spec = None;
        self.status = None;
        self.converted = Some(Arc::new(pod));
    }
}

/// `spec.nodeName` and `spec.hostNetwork`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchedPodSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
}

/// `status.phase`, `status.podIP` and `status.podIPs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchedPodStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, rename = "podIP", skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    #[serde(default, rename = "podIPs", skip_serializing_if = "Option::is_none")]
    pub pod_ips: Option<Vec<PodIP>>,
}

impl k8s_openapi::Resource for WatchedPod {
    const API_VERSION: &'static str = <Pod as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Pod as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Pod as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Pod as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<&Pod> for WatchedPod {
    fn from(pod: &Pod) -> Self {
        Self {
            metadata: pod.metadata.clone(),
            spec: pod.spec.as_ref().map(|s| WatchedPodSpec {
                node_name: s.node_name.clone(),
                host_network: s.host_network,
            }),
            status: pod.status.as_ref().map(|s| WatchedPodStatus {
                phase: s.phase.clone(),
                pod_ip: s.pod_ip.clone(),
                pod_ips: s.pod_ips.clone(),
            }),
            converted: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::snapshot;

    /// A Pod as a kubelet reports it, with what a cluster adds around it.
    fn pod_json(phase: &str, host_network: bool, deleting: bool) -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "web-1", "namespace": "team-a", "uid": "u-1",
                "resourceVersion": "42",
                "labels": { "app": "web" },
                "deletionTimestamp": deleting.then_some("2026-01-01T00:00:00Z"),
            },
            "spec": {
                "nodeName": "node-1",
                "hostNetwork": host_network,
                "containers": [{ "name": "web", "image": "nginx",
                    "env": [{ "name": "A", "value": "y".repeat(500) }] }],
                "volumes": [{ "name": "data", "emptyDir": {} }],
            },
            "status": {
                "phase": phase,
                "podIP": "10.244.1.2",
                "podIPs": [{ "ip": "10.244.1.2" }, { "ip": "fd00::2" }],
                "hostIP": "172.18.0.11",
                "conditions": [{ "type": "Ready", "status": "True" }],
                "containerStatuses": [{ "name": "web", "image": "nginx", "imageID": "sha",
                    "ready": true, "restartCount": 0 }],
            },
        })
    }

    /// Decoded from the same JSON, a watched Pod plans as the whole Pod
    /// does, for every kind of Pod the planner tells apart, and takes a
    /// fraction of its memory.
    #[test]
    fn a_watched_pod_plans_as_the_whole_one() {
        for (phase, host, deleting) in [
            ("Running", false, false),
            ("Running", true, false),
            ("Pending", false, false),
            ("Succeeded", false, false),
            ("Failed", false, false),
            ("Running", false, true),
        ] {
            let text = pod_json(phase, host, deleting);
            let whole: Pod = serde_json::from_value(text.clone()).expect("a Pod");
            let watched: WatchedPod = serde_json::from_value(text).expect("a watched Pod");
            let case = format!("{phase} host={host} deleting={deleting}");
            assert_eq!(
                snapshot::watched_pod(&watched),
                snapshot::pod(&whole),
                "{case}"
            );
            assert_eq!(WatchedPod::from(&whole), watched, "{case}");
        }
        assert!(size_of::<WatchedPod>() * 4 < size_of::<Pod>());
    }

    /// Converted, a Pod the planner takes keeps what it planned from, and
    /// of the object the name, namespace and version alone; one it does
    /// not take stays as it was.
    #[test]
    fn a_converted_pod_plans_as_before_and_keeps_its_name() {
        for (phase, deleting, taken) in [
            ("Running", false, true),
            ("Pending", false, true),
            ("Succeeded", false, false),
            ("Failed", false, false),
            ("Running", true, false),
        ] {
            let case = format!("{phase} deleting={deleting}");
            let watched: WatchedPod =
                serde_json::from_value(pod_json(phase, false, deleting)).expect("a watched Pod");
            let mut converted = watched.clone();
            converted.convert();
            assert_eq!(
                snapshot::watched_pod(&converted),
                snapshot::watched_pod(&watched),
                "{case}"
            );
            if !taken {
                assert_eq!(converted, watched, "{case}");
                continue;
            }
            assert!(
                converted.spec.is_none() && converted.status.is_none(),
                "{case}"
            );
            assert_eq!(
                converted.metadata,
                ObjectMeta {
                    name: Some("web-1".into()),
                    namespace: Some("team-a".into()),
                    resource_version: Some("42".into()),
                    ..ObjectMeta::default()
                },
                "{case}"
            );
            // Converting again changes nothing.
            let again = {
                let mut again = converted.clone();
                again.convert();
                again
            };
            assert!(Arc::ptr_eq(
                again.converted.as_ref().unwrap(),
                converted.converted.as_ref().unwrap()
            ));
        }
    }

    /// A Pod with `podIP` only (an older kubelet) keeps it.
    #[test]
    fn a_single_address_is_kept() {
        let watched: WatchedPod = serde_json::from_value(json!({
            "metadata": { "name": "a", "namespace": "n" },
            "spec": { "nodeName": "node-1" },
            "status": { "phase": "Running", "podIP": "10.0.0.1" },
        }))
        .expect("a watched Pod");
        let pod = snapshot::watched_pod(&watched).expect("planned");
        assert_eq!(
            pod.ips,
            vec!["10.0.0.1".parse::<std::net::IpAddr>().unwrap()]
        );
    }
}

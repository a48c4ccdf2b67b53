//! `EgressEndpointSlice`: the Pods a gateway's nodes carry traffic of, as
//! the controller publishes them.
//!
//! A node that some `EgressGateway` selects needs, besides its own Pods,
//! every Pod whose traffic that gateway may carry (to SNAT it and route its
//! replies back). The controller watches every Pod and already selects
//! them; it writes each gateway's Pods into slices of at most
//! [`MAX_PODS`] in the release namespace, labelled [`GATEWAY_LABEL`], and
//! the agents of the gateway's nodes watch those slices instead of every
//! Pod in the cluster. See `docs/scale.md`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use egressgw_core::model;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The label naming the gateway a slice belongs to ([`gateway_label`]).
pub const GATEWAY_LABEL: &str = "egressgw.io/gateway";

/// The most Pods one slice holds.
pub const MAX_PODS: usize = 100;

/// Spec of an `EgressEndpointSlice` (namespaced, in the release namespace,
/// short name `egeps`): written by the controller alone. Not in the
/// `egressgw` category: `kubectl get egressgw` lists what users write and
/// read, not a thousand slices.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "egressgw.io",
    version = "v1alpha1",
    kind = "EgressEndpointSlice",
    plural = "egressendpointslices",
    shortname = "egeps",
    namespaced,
    derive = "PartialEq",
    doc = "Some of the Pods whose traffic an EgressGateway's nodes may carry, written by the controller for the agents of those nodes; a gateway's Pods are spread over slices of at most 100.",
    printcolumn(
        name = "Gateway",
        type_ = "string",
        json_path = ".spec.gateway",
        description = "The EgressGateway whose Pods these are"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct EgressEndpointSliceSpec {
    /// The `EgressGateway` whose Pods these are.
    #[schemars(length(min = 1, max = 253))]
    pub gateway: String,
    /// The Pods, sorted by namespace and name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub pods: Vec<EndpointPod>,
}

/// One Pod: what a gateway node plans from.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPod {
    /// The Pod's namespace.
    #[schemars(length(max = 63))]
    pub namespace: String,
    /// The Pod's name.
    #[schemars(length(max = 253))]
    pub name: String,
    /// `spec.nodeName`.
    #[schemars(length(max = 253))]
    pub node: String,
    /// `status.podIPs`.
    #[schemars(length(max = 2))]
    pub ips: Vec<String>,
    /// The Pod's labels, which the policies' selectors read.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl EndpointPod {
    /// The entry of a selected, scheduled Pod.
    pub fn of(pod: &model::Pod) -> Self {
        Self {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            node: pod.node.clone().unwrap_or_default(),
            ips: pod.ips.iter().map(IpAddr::to_string).collect(),
            labels: pod.labels.to_map(),
        }
    }

    /// The Pod as an agent plans from it: a running Pod (only those are
    /// published); an address that does not parse is left out, as from a
    /// watched Pod's status.
    pub fn planned(&self) -> model::Pod {
        model::Pod {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            labels: self
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            ips: self.ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
            node: Some(self.node.clone()),
            host_network: false,
        }
    }

    /// A digest of the whole entry, the same in every build and release:
    /// what the controller keeps of the entries it wrote ([`SliceEntry`]).
    pub fn digest(&self) -> u64 {
        egressgw_core::stable_hash(&serde_json::to_vec(self).expect("an entry serializes"))
    }

    /// The size of the entry in a slice's JSON, about.
    pub fn json_len(&self) -> usize {
        let labels: usize = self.labels.iter().map(|(k, v)| k.len() + v.len() + 6).sum();
        let ips: usize = self.ips.iter().map(|ip| ip.len() + 3).sum();
        60 + self.namespace.len() + self.name.len() + self.node.len() + ips + labels
    }
}

/// An `EgressEndpointSlice` as the controller keeps it: each Pod's
/// namespace, name and [`EndpointPod::digest`], decoded straight from the
/// API server's JSON. At a hundred thousand Pods the whole entries with
/// their labels would be hundreds of MiB held only to compare with.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct WatchedSlice {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: WatchedSliceSpec,
}

/// `spec` of a [`WatchedSlice`].
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct WatchedSliceSpec {
    #[serde(default)]
    pub gateway: String,
    #[serde(default)]
    pub pods: Vec<SliceEntry>,
}

/// One Pod of a [`WatchedSlice`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(from = "EndpointPod")]
pub struct SliceEntry {
    pub namespace: String,
    pub name: String,
    pub digest: u64,
}

impl From<EndpointPod> for SliceEntry {
    fn from(pod: EndpointPod) -> Self {
        let digest = pod.digest();
        Self {
            namespace: pod.namespace,
            name: pod.name,
            digest,
        }
    }
}

impl k8s_openapi::Resource for WatchedSlice {
    const API_VERSION: &'static str = "egressgw.io/v1alpha1";
    const GROUP: &'static str = crate::GROUP;
    const KIND: &'static str = "EgressEndpointSlice";
    const VERSION: &'static str = crate::VERSION;
    const URL_PATH_SEGMENT: &'static str = "egressendpointslices";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for WatchedSlice {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// An `EgressEndpointSlice` as a gateway node's agent keeps it: each Pod
/// decoded straight into what the planner plans from
/// ([`EndpointPod::planned`]), its labels in a sorted vector and its
/// addresses parsed, rather than as the entry's strings and map.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct PublishedSlice {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PublishedSliceSpec,
}

/// `spec` of a [`PublishedSlice`].
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct PublishedSliceSpec {
    #[serde(default)]
    pub gateway: String,
    #[serde(default)]
    pub pods: Vec<PublishedPod>,
}

/// One Pod of a [`PublishedSlice`], as planned, for the planner to share.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "EndpointPod")]
pub struct PublishedPod(pub Arc<model::Pod>);

impl From<EndpointPod> for PublishedPod {
    fn from(pod: EndpointPod) -> Self {
        Self(Arc::new(pod.planned()))
    }
}

impl k8s_openapi::Resource for PublishedSlice {
    const API_VERSION: &'static str = <WatchedSlice as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <WatchedSlice as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <WatchedSlice as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <WatchedSlice as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str =
        <WatchedSlice as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for PublishedSlice {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The value of [`GATEWAY_LABEL`] for the gateway `name`: the name itself
/// when it is a valid label value (at most 63 characters), else a hash of
/// it. A slice's `spec.gateway` says which gateway it is in either case.
pub fn gateway_label(name: &str) -> String {
    if name.len() <= 63 {
        name.to_owned()
    } else {
        format!("h-{:016x}", egressgw_core::stable_hash(name.as_bytes()))
    }
}

/// The name of a gateway's `index`th slice: `<gateway>-<index>`, the
/// gateway's name shortened (with a hash of it) when that would be too long.
pub fn slice_name(gateway: &str, index: usize) -> String {
    const KEEP: usize = 200;
    if gateway.len() <= KEEP + 20 {
        format!("{gateway}-{index}")
    } else {
        let cut = gateway
            .char_indices()
            .map(|(i, _)| i)
            .take_while(|i| *i <= KEEP)
            .last()
            .unwrap_or(0);
        let head = gateway[..cut].trim_end_matches(['-', '.']);
        format!(
            "{head}-{:016x}-{index}",
            egressgw_core::stable_hash(gateway.as_bytes())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry planned as a Pod is the Pod it was made from.
    #[test]
    fn an_entry_plans_as_its_pod() {
        let pod = model::Pod {
            namespace: "team-a".into(),
            name: "web-1".into(),
            labels: [("app".to_owned(), "web".to_owned())].into(),
            ips: vec!["10.244.1.2".parse().unwrap(), "fd00::2".parse().unwrap()],
            node: Some("node-1".into()),
            host_network: false,
        };
        let entry = EndpointPod::of(&pod);
        assert_eq!(entry.planned(), pod);
        let json = serde_json::to_string(&entry).unwrap();
        assert!(
            json.len() <= entry.json_len(),
            "{} > {}",
            json.len(),
            entry.json_len()
        );
    }

    /// A slice decoded as the controller keeps it names the same Pods,
    /// each with the digest of its whole entry, and is the type's own.
    #[test]
    fn a_watched_slice_keeps_each_pods_name_and_digest() {
        use kube::Resource as _;
        let mut entry = EndpointPod {
            namespace: "team-a".into(),
            name: "web-1".into(),
            node: "node-1".into(),
            ips: vec!["10.244.1.2".into()],
            labels: [("app".to_owned(), "web".to_owned())].into(),
        };
        let slice = EgressEndpointSlice::new(
            "gw-0",
            EgressEndpointSliceSpec {
                gateway: "gw".into(),
                pods: vec![entry.clone()],
            },
        );
        let watched: WatchedSlice =
            serde_json::from_value(serde_json::to_value(&slice).unwrap()).unwrap();
        assert_eq!(watched.spec.gateway, "gw");
        assert_eq!(
            watched.spec.pods,
            [SliceEntry {
                namespace: "team-a".into(),
                name: "web-1".into(),
                digest: entry.digest(),
            }]
        );
        entry.labels.insert("tier".into(), "front".into());
        assert_ne!(watched.spec.pods[0].digest, entry.digest());
        assert_eq!(WatchedSlice::kind(&()), EgressEndpointSlice::kind(&()));
        assert_eq!(WatchedSlice::plural(&()), EgressEndpointSlice::plural(&()));
        assert_eq!(
            WatchedSlice::api_version(&()),
            EgressEndpointSlice::api_version(&())
        );
    }

    /// A slice decoded as an agent keeps it holds each Pod as planned, and
    /// is the type's own.
    #[test]
    fn a_published_slice_holds_each_pod_as_planned() {
        use kube::Resource as _;
        let entries = vec![
            EndpointPod {
                namespace: "team-a".into(),
                name: "web-1".into(),
                node: "node-1".into(),
                ips: vec!["10.244.1.2".into(), "fd00::2".into()],
                labels: [
                    ("tier".to_owned(), "front".to_owned()),
                    ("app".to_owned(), "web".to_owned()),
                ]
                .into(),
            },
            EndpointPod {
                namespace: "team-b".into(),
                name: "db-1".into(),
                node: "node-2".into(),
                ips: vec!["10.244.2.9".into()],
                labels: BTreeMap::new(),
            },
        ];
        let slice = EgressEndpointSlice::new(
            "gw-0",
            EgressEndpointSliceSpec {
                gateway: "gw".into(),
                pods: entries.clone(),
            },
        );
        let published: PublishedSlice =
            serde_json::from_value(serde_json::to_value(&slice).unwrap()).unwrap();
        assert_eq!(published.spec.gateway, "gw");
        let pods: Vec<model::Pod> = published
            .spec
            .pods
            .into_iter()
            .map(|p| Arc::unwrap_or_clone(p.0))
            .collect();
        let planned: Vec<model::Pod> = entries.iter().map(EndpointPod::planned).collect();
        assert_eq!(pods, planned);
        assert_eq!(pods[0].labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(pods[0].ips.len(), 2);
        assert_eq!(PublishedSlice::kind(&()), EgressEndpointSlice::kind(&()));
        assert_eq!(
            PublishedSlice::plural(&()),
            EgressEndpointSlice::plural(&())
        );
        assert_eq!(
            PublishedSlice::api_version(&()),
            EgressEndpointSlice::api_version(&())
        );
    }

    #[test]
    fn names_and_labels_fit_their_limits_and_stay_apart() {
        assert_eq!(gateway_label("default"), "default");
        assert_eq!(slice_name("default", 3), "default-3");
        let long = "g".repeat(250);
        let label = gateway_label(&long);
        assert!(label.len() <= 63 && label.starts_with("h-"), "{label}");
        assert_ne!(label, gateway_label(&"g".repeat(249)));
        let name = slice_name(&long, 12);
        assert!(name.len() <= 253, "{}", name.len());
        assert!(name.ends_with("-12"));
        assert_ne!(slice_name(&long, 1), slice_name(&"g".repeat(249), 1));
    }
}

//! Objects from a YAML file (`egressgw plan -f objects.yaml`).
//!
//! The file holds any number of YAML documents, each one object or a list
//! (`kind: List`, or a typed list such as `NodeList`, as `kubectl get -o
//! yaml` prints). Documents are counted from 1 and list items from 0 in
//! error messages.
//!
//! What is read: `v1` `Node`, `Pod`, `Namespace` and every `egressgw.io/v1alpha1`
//! kind. Other objects (a `Service`, a `Deployment`) are skipped and listed
//! in [`Objects::skipped`], so a whole `kubectl get -o yaml` dump loads. An
//! unknown kind or version in the `egressgw.io` group is an error: it is
//! almost certainly a typo. Namespaced objects
//! without a namespace get `default`, as `kubectl apply` does.
//!
//! egressgw's objects are checked for fields their kind does not have, as
//! the apiserver's strict field validation does (see `strict`): each is
//! listed in [`Objects::unknown_fields`] and makes its object invalid in the
//! snapshot, so a misspelled field never silently changes what a policy
//! means. Kubernetes' own kinds are read as `k8s-openapi` reads them, which
//! skips fields it does not know.

use std::collections::BTreeSet;
use std::fmt;

use egressgw_core::model::{self, Config, Snapshot};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Location};
use crate::snapshot::SnapshotBuilder;
use crate::strict;
use crate::validation::ValidationErrors;
use crate::{EgressClusterPolicy, EgressGateway, EgressPolicy, EgressTunnel, GROUP, VERSION};

/// The objects of a file, by kind, in file order.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    /// `v1` `Node`s.
    pub nodes: Vec<Node>,
    /// `v1` `Namespace`s.
    pub namespaces: Vec<Namespace>,
    /// `v1` `Pod`s.
    pub pods: Vec<Pod>,
    /// `EgressGateway`s.
    pub gateways: Vec<EgressGateway>,
    /// `EgressPolicy`s.
    pub policies: Vec<EgressPolicy>,
    /// `EgressClusterPolicy`s.
    pub cluster_policies: Vec<EgressClusterPolicy>,
    /// `EgressTunnel`s.
    pub tunnels: Vec<EgressTunnel>,
    /// Objects of other API groups, which were left out.
    pub skipped: Vec<Skipped>,
    /// egressgw objects with fields their kind does not have.
    pub unknown_fields: Vec<UnknownFields>,
}

/// An egressgw object with fields its kind does not have. It loads, and
/// [`Objects::into_snapshot`] makes it invalid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownFields {
    /// Where it is in the file.
    pub location: Location,
    /// Its `kind`.
    pub kind: String,
    /// Its `metadata.namespace`, for namespaced kinds.
    pub namespace: Option<String>,
    /// Its `metadata.name`, or `(unnamed)`.
    pub name: String,
    /// One error per unknown field, at the field's path.
    pub errors: ValidationErrors,
}

impl fmt::Display for UnknownFields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ", self.location, self.kind)?;
        if let Some(namespace) = &self.namespace {
            write!(f, "{namespace}/")?;
        }
        write!(f, "{}: {}", self.name, self.errors)
    }
}

/// An object that was left out because egressgw does not read its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Where it is in the file.
    pub location: Location,
    /// Its `apiVersion`.
    pub api_version: String,
    /// Its `kind`.
    pub kind: String,
    /// Its `metadata.name`, if any.
    pub name: Option<String>,
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: skipped {} {} {}: egressgw does not read this kind",
            self.location,
            self.api_version,
            self.kind,
            self.name.as_deref().unwrap_or("(unnamed)")
        )
    }
}

/// Reads every object of a multi-document YAML text; see the module docs.
pub fn objects_from_yaml(text: &str) -> Result<Objects, Error> {
    let mut objects = Objects::default();
    for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document_number = i + 1;
        let value = Value::deserialize(document).map_err(|source| Error::Yaml {
            document: document_number,
            source,
        })?;
        objects.add_document(document_number, value)?;
    }
    Ok(objects)
}

impl Objects {
    /// The snapshot of these objects. Namespaces that pods or policies use
    /// but the file does not define are added without labels, so a small
    /// hand-written file needs no `Namespace` documents.
    pub fn into_snapshot(self, config: Config) -> Snapshot {
        let mut snapshot = SnapshotBuilder::new(config)
            .nodes(&self.nodes)
            .namespaces(&self.namespaces)
            .pods(&self.pods)
            .gateways(&self.gateways)
            .policies(&self.policies)
            .cluster_policies(&self.cluster_policies)
            .tunnels(&self.tunnels)
            .unknown_fields(&self.unknown_fields)
            .build();
        add_implied_namespaces(&mut snapshot);
        snapshot
    }

    fn add_document(&mut self, document: usize, mut value: Value) -> Result<(), Error> {
        if value.is_null() {
            return Ok(());
        }
        let location = Location {
            document,
            item: None,
        };
        let kind = value
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let is_list = kind == "List" || (kind.ends_with("List") && value.get("items").is_some());
        if !is_list {
            return self.add_object(location, value);
        }
        let item_kind = kind
            .strip_suffix("List")
            .filter(|k| !k.is_empty())
            .map(str::to_owned);
        let api_version = value.get("apiVersion").cloned();
        let Some(Value::Array(items)) = value.get_mut("items").map(Value::take) else {
            return Err(Error::NotAnObject {
                location,
                problem: "a list without an items array",
            });
        };
        for (i, mut item) in items.into_iter().enumerate() {
            // Typed lists (`NodeList`) may leave kind and apiVersion off their items.
            if let (Some(kind), Some(map)) = (&item_kind, item.as_object_mut()) {
                map.entry("kind")
                    .or_insert_with(|| Value::String(kind.clone()));
                if let Some(api_version) = &api_version {
                    map.entry("apiVersion")
                        .or_insert_with(|| api_version.clone());
                }
            }
            self.add_object(
                Location {
                    document,
                    item: Some(i),
                },
                item,
            )?;
        }
        Ok(())
    }

    fn add_object(&mut self, location: Location, mut value: Value) -> Result<(), Error> {
        let Some(map) = value.as_object() else {
            return Err(Error::NotAnObject {
                location,
                problem: "not a mapping",
            });
        };
        let field = |name: &str| map.get(name).and_then(Value::as_str).map(str::to_owned);
        let (Some(api_version), Some(kind)) = (field("apiVersion"), field("kind")) else {
            return Err(Error::NotAnObject {
                location,
                problem: "no apiVersion and kind",
            });
        };
        let ours = format!("{GROUP}/{VERSION}");
        match (api_version.as_str(), kind.as_str()) {
            ("v1", "Node") => {
                let node = self.decode(location, &kind, &value)?;
                self.nodes.push(node);
            }
            ("v1", "Namespace") => {
                let namespace = self.decode(location, &kind, &value)?;
                self.namespaces.push(namespace);
            }
            ("v1", "Pod") => {
                default_namespace(&mut value);
                let pod = self.decode(location, &kind, &value)?;
                self.pods.push(pod);
            }
            (v, "EgressGateway") if v == ours => {
                let gateway = self.decode(location, &kind, &value)?;
                self.gateways.push(gateway);
            }
            (v, "EgressPolicy") if v == ours => {
                default_namespace(&mut value);
                let policy = self.decode(location, &kind, &value)?;
                self.policies.push(policy);
            }
            (v, "EgressClusterPolicy") if v == ours => {
                let policy = self.decode(location, &kind, &value)?;
                self.cluster_policies.push(policy);
            }
            (v, "EgressTunnel") if v == ours => {
                let tunnel = self.decode(location, &kind, &value)?;
                self.tunnels.push(tunnel);
            }
            // The controller's output, derived from the Pods: skipped like
            // any kind the planner does not read.
            (v, _) if is_ours(v) && kind != "EgressEndpointSlice" => {
                return Err(Error::UnknownKind {
                    location,
                    api_version,
                    kind,
                });
            }
            _ => self.skipped.push(Skipped {
                location,
                name: value
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                api_version,
                kind,
            }),
        }
        Ok(())
    }

    /// Decodes an object, recording the fields its kind does not have
    /// (egressgw's kinds only, see `strict`). When it does not decode, they
    /// go into the error: a missing field is often one of them misspelled;
    /// so do its integers outside the CRD's bounds, which may be why (an
    /// object that decodes has its bounds checked by `validate()`).
    fn decode<T: DeserializeOwned>(
        &mut self,
        location: Location,
        kind: &str,
        value: &Value,
    ) -> Result<T, Error> {
        let errors = strict::unknown_fields(kind, value);
        let name = object_name(value);
        let namespace = value
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .map(str::to_owned);
        match T::deserialize(value) {
            Ok(object) => {
                if !errors.is_empty() {
                    self.unknown_fields.push(UnknownFields {
                        location,
                        kind: kind.to_owned(),
                        namespace,
                        name,
                        errors,
                    });
                }
                Ok(object)
            }
            Err(source) => {
                let mut schema_errors = errors;
                schema_errors.extend(strict::out_of_range(kind, value));
                Err(Error::Decode {
                    location,
                    kind: kind.to_owned(),
                    name,
                    schema_errors,
                    source,
                })
            }
        }
    }
}

/// Whether an object claims to be egressgw's: its API group is egressgw.io.
fn is_ours(api_version: &str) -> bool {
    api_version
        .split_once('/')
        .is_some_and(|(group, _)| group == GROUP)
}

fn default_namespace(value: &mut Value) {
    if let Some(metadata) = value.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata
            .entry("namespace")
            .or_insert_with(|| Value::String("default".into()));
    }
}

/// `metadata.name`, or `(unnamed)`.
fn object_name(value: &Value) -> String {
    value
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("(unnamed)")
        .to_owned()
}

fn add_implied_namespaces(snapshot: &mut Snapshot) {
    let mut known: BTreeSet<String> = snapshot.namespaces.iter().map(|n| n.name.clone()).collect();
    let used = snapshot.pods.iter().map(|p| p.namespace.clone()).chain(
        snapshot
            .policies
            .iter()
            .filter_map(|p| p.id.namespace.clone()),
    );
    let mut implied = Vec::new();
    for name in used {
        if known.insert(name.clone()) {
            implied.push(model::Namespace {
                name,
                labels: model::Labels::new(),
            });
        }
    }
    snapshot.namespaces.extend(implied);
}

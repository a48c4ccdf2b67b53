//! Watched objects in, the planner's [`Snapshot`] out.
//!
//! Each egressgw object is validated on the way. An invalid policy or
//! tunnel lands in [`Snapshot::invalid`] with every problem, and never
//! disturbs the valid ones. An invalid gateway stays in
//! [`Snapshot::gateways`] with its problems in [`model::Gateway::errors`]:
//! its policies must learn that it is invalid rather than missing, and its
//! `clusterDefault` claim must hold (see [`EgressGateway::to_model`]). An
//! object read from a file with fields its kind does not have is invalid
//! the same way (see [`SnapshotBuilder::unknown_fields`]).
//!
//! Kubernetes' own objects are taken as the apiserver stored them; values
//! in them that do not parse (an odd address in a node's status) are
//! skipped.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use egressgw_core::model::{self, Age, Config, InvalidObject, PolicyRef, Snapshot};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;

use crate::validation::{ValidationErrors, non_empty};
use crate::watched::WatchedPod;
use crate::{
    EgressClusterPolicy, EgressGateway, EgressPolicy, EgressTunnel, TunnelEipState, TunnelPhase,
    UnknownFields,
};

/// Builds a [`Snapshot`] from watched objects, in any order and from any
/// store: each method takes anything that borrows as the object (`&T`,
/// `Arc<T>` from a reflector store, `T`).
///
/// ```
/// # use egressgw_api::snapshot::SnapshotBuilder;
/// # use egressgw_core::model::Config;
/// # let (nodes, pods, policies): (Vec<k8s_openapi::api::core::v1::Node>, Vec<k8s_openapi::api::core::v1::Pod>, Vec<egressgw_api::EgressPolicy>) = Default::default();
/// let snapshot = SnapshotBuilder::new(Config::default())
///     .nodes(&nodes)
///     .pods(&pods)
///     .policies(&policies)
///     .build();
/// ```
#[derive(Debug, Clone, Default)]
pub struct SnapshotBuilder {
    snapshot: Snapshot,
    unavailable_agents: BTreeSet<String>,
    reporting_agents: BTreeSet<String>,
    /// Per EIP, every node that reports holding it, with since when (an
    /// old holder cut off from the API server may still report it).
    held_eips: BTreeMap<IpAddr, Vec<(String, Option<k8s_openapi::jiff::Timestamp>)>>,
    agents_required: bool,
    unknown_fields: Vec<UnknownFields>,
}

impl SnapshotBuilder {
    /// An empty snapshot with `config`.
    pub fn new(config: Config) -> Self {
        Self {
            snapshot: Snapshot {
                config,
                ..Snapshot::default()
            },
            unavailable_agents: BTreeSet::new(),
            reporting_agents: BTreeSet::new(),
            held_eips: BTreeMap::new(),
            agents_required: false,
            unknown_fields: Vec::new(),
        }
    }

    /// Counts a node as ready only while its agent reports its tunnel
    /// `Ready` (see [`Self::tunnels`]), as the controller and the agents do
    /// in a cluster: a node whose agent never came up, or stopped
    /// reporting, gets no EIPs. Without this (`egressgw plan` on a file),
    /// the Node's own `Ready` condition decides.
    pub fn agents_required(mut self) -> Self {
        self.agents_required = true;
        self
    }

    /// Adds nodes; see [`node`].
    pub fn nodes<I>(mut self, nodes: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<Node>,
    {
        let converted = nodes.into_iter().filter_map(|n| node(n.borrow()));
        self.snapshot.nodes.extend(converted);
        self
    }

    /// Adds namespaces.
    pub fn namespaces<I>(mut self, namespaces: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<Namespace>,
    {
        let converted = namespaces.into_iter().filter_map(|n| namespace(n.borrow()));
        self.snapshot.namespaces.extend(converted);
        self
    }

    /// Adds pods; finished and terminating ones are left out (see [`pod`]).
    pub fn pods<I>(mut self, pods: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<Pod>,
    {
        let converted = pods.into_iter().filter_map(|p| pod(p.borrow()));
        self.snapshot.pods.extend(converted);
        self
    }

    /// Adds gateways, invalid ones included: they carry their problems in
    /// [`model::Gateway::errors`] and never go to [`Snapshot::invalid`].
    pub fn gateways<I>(mut self, gateways: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<EgressGateway>,
    {
        let converted = gateways.into_iter().map(|g| g.borrow().to_model());
        self.snapshot.gateways.extend(converted);
        self
    }

    /// Adds namespaced policies; invalid ones go to [`Snapshot::invalid`].
    pub fn policies<I>(self, policies: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<EgressPolicy>,
    {
        self.convert_all(policies, EgressPolicy::to_model, |s, p| {
            s.policies.push(p.into());
        })
    }

    /// Adds cluster policies; invalid ones go to [`Snapshot::invalid`].
    pub fn cluster_policies<I>(self, policies: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<EgressClusterPolicy>,
    {
        self.convert_all(policies, EgressClusterPolicy::to_model, |s, p| {
            s.policies.push(p.into());
        })
    }

    /// Adds policies converted already (valid ones), shared rather than
    /// copied.
    pub fn converted<I>(mut self, policies: I) -> Self
    where
        I: IntoIterator<Item = std::sync::Arc<model::Policy>>,
    {
        self.snapshot.policies.extend(policies);
        self
    }

    /// Converts each object with `convert`, adding what converts with `add`
    /// and recording what does not as invalid.
    fn convert_all<K, M, I>(
        mut self,
        objects: I,
        convert: impl Fn(&K) -> Result<M, ValidationErrors>,
        add: impl Fn(&mut Snapshot, M),
    ) -> Self
    where
        K: Resource<DynamicType = ()>,
        I: IntoIterator,
        I::Item: Borrow<K>,
    {
        for object in objects {
            let object = object.borrow();
            match convert(object) {
                Ok(converted) => add(&mut self.snapshot, converted),
                Err(errors) => self.invalid(object, &errors),
            }
        }
        self
    }

    /// Adds tunnel identities; a tunnel whose status does not parse goes to
    /// [`Snapshot::invalid`] (the planner then allocates afresh). A tunnel
    /// in phase `Failed` or `HeartbeatTimeout` makes its node not ready.
    pub fn tunnels<I>(mut self, tunnels: I) -> Self
    where
        I: IntoIterator,
        I::Item: Borrow<EgressTunnel>,
    {
        for tunnel in tunnels {
            let tunnel = tunnel.borrow();
            let name = tunnel.metadata.name.clone().unwrap_or_default();
            match tunnel.phase() {
                Some(phase) if phase.agent_unavailable() => {
                    self.unavailable_agents.insert(name.clone());
                }
                Some(TunnelPhase::Ready) => {
                    self.reporting_agents.insert(name.clone());
                }
                _ => {}
            }
            for eip in tunnel.status.iter().flat_map(|s| &s.eips) {
                if eip.state == TunnelEipState::Held
                    && let Ok(ip) = eip.ip.parse::<IpAddr>()
                {
                    let since = eip.since.as_ref().map(|t| t.0);
                    self.held_eips
                        .entry(ip)
                        .or_default()
                        .push((name.clone(), since));
                }
            }
            for eip in tunnel.status.iter().flat_map(|s| &s.eips) {
                if eip.state == TunnelEipState::InUse
                    && let Ok(ip) = eip.ip.parse()
                {
                    let who = eip
                        .message
                        .as_deref()
                        .unwrap_or("another host answers for it");
                    self.snapshot
                        .eips_in_use
                        .insert(ip, format!("{name}: {who}"));
                }
            }

            match tunnel.to_model() {
                Ok(converted) => self.snapshot.tunnels.push(converted),
                Err(errors) => self.invalid(tunnel, &errors),
            }
        }
        self
    }

    /// Adds a stored object that did not decode as an invalid one, so that
    /// it gets a status and an Event naming it instead of being dropped.
    pub fn undecodable(
        mut self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        error: &str,
    ) -> Self {
        self.snapshot.invalid.push(InvalidObject {
            kind: kind.to_owned(),
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
            errors: vec![format!(
                "the stored object cannot be read ({error}); it was stored before a bound existed \
                 or around admission: fix or recreate it"
            )],
        });
        self
    }

    /// Makes objects with fields their kind does not have invalid, as a
    /// failed validation does, whenever they are added: a policy or tunnel
    /// goes to [`Snapshot::invalid`], a gateway carries the errors. The
    /// unknown fields come first among the object's problems.
    pub fn unknown_fields<'a, I>(mut self, objects: I) -> Self
    where
        I: IntoIterator<Item = &'a UnknownFields>,
    {
        self.unknown_fields.extend(objects.into_iter().cloned());
        self
    }

    /// The snapshot.
    pub fn build(mut self) -> Snapshot {
        for object in std::mem::take(&mut self.unknown_fields) {
            self.refuse_unknown_fields(object);
        }
        // Of the nodes reporting an EIP, the one that took it last holds
        // it; at the same moment, one whose agent is still available.
        let holders: BTreeMap<IpAddr, &str> = self
            .held_eips
            .iter()
            .filter_map(|(ip, reports)| {
                let holder = reports.iter().max_by_key(|(node, since)| {
                    (
                        *since,
                        !self.unavailable_agents.contains(node),
                        std::cmp::Reverse(node),
                    )
                })?;
                Some((*ip, holder.0.as_str()))
            })
            .collect();
        for node in &mut self.snapshot.nodes {
            node.held_eips = holders
                .iter()
                .filter(|(_, holder)| **holder == node.name)
                .map(|(ip, _)| *ip)
                .collect();
            let reporting = self.reporting_agents.contains(&node.name);
            if self.unavailable_agents.contains(&node.name) || (self.agents_required && !reporting)
            {
                node.ready = false;
            }
        }
        // Each kind's objects were added one by one, so their vectors grew
        // by doubling; a planner keeps the snapshot, at the size it holds.
        let snapshot = &mut self.snapshot;
        snapshot.nodes.shrink_to_fit();
        snapshot.namespaces.shrink_to_fit();
        snapshot.gateways.shrink_to_fit();
        snapshot.policies.shrink_to_fit();
        snapshot.tunnels.shrink_to_fit();
        self.snapshot
    }

    /// Makes `object` invalid for its unknown fields (see [`Self::unknown_fields`]).
    fn refuse_unknown_fields(&mut self, object: UnknownFields) {
        let snapshot = &mut self.snapshot;
        let mut errors = object.errors.messages();
        let kind = object.kind.as_str();
        if kind == EgressGateway::kind(&()) {
            for gateway in snapshot
                .gateways
                .iter_mut()
                .filter(|g| g.name == object.name)
            {
                gateway.errors.splice(0..0, errors.iter().cloned());
            }
            return;
        }
        if kind == EgressTunnel::kind(&()) {
            snapshot.tunnels.retain(|t| t.node != object.name);
        } else {
            let id = if kind == EgressClusterPolicy::kind(&()) {
                PolicyRef::cluster(&object.name)
            } else {
                PolicyRef::namespaced(object.namespace.clone().unwrap_or_default(), &object.name)
            };
            snapshot.policies.retain(|p| p.id != id);
        }
        let same = |i: &&mut InvalidObject| {
            i.kind == object.kind && i.namespace == object.namespace && i.name == object.name
        };
        match snapshot.invalid.iter_mut().find(same) {
            Some(invalid) => {
                errors.append(&mut invalid.errors);
                invalid.errors = errors;
            }
            None => snapshot.invalid.push(InvalidObject {
                kind: object.kind,
                namespace: object.namespace,
                name: object.name,
                errors,
            }),
        }
    }

    fn invalid<K>(&mut self, object: &K, errors: &ValidationErrors)
    where
        K: Resource<DynamicType = ()>,
    {
        let meta = object.meta();
        self.snapshot.invalid.push(InvalidObject {
            kind: K::kind(&()).into_owned(),
            namespace: meta.namespace.clone(),
            name: meta.name.clone().unwrap_or_default(),
            errors: errors.messages(),
        });
    }
}

/// A node as the planner sees it; `None` without a name.
///
/// Ready means its `Ready` condition is `True` (a node that reports no
/// conditions is not ready). Addresses are its `InternalIP`s in status
/// order, external addresses its `ExternalIP`s; pod CIDRs come from `spec.podCIDRs`, else `spec.podCIDR`.
pub fn node(node: &Node) -> Option<model::Node> {
    let name = node.metadata.name.clone()?;
    let status = node.status.as_ref();
    let addresses_of = |kind: &str| -> Vec<IpAddr> {
        status
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == kind)
            .filter_map(|a| a.address.parse::<IpAddr>().ok())
            .collect()
    };
    let spec = node.spec.as_ref();
    let pod_cidrs = spec
        .and_then(|s| s.pod_cidrs.clone())
        .filter(|cidrs| !cidrs.is_empty())
        .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c.parse::<IpNet>().ok().map(|n| n.trunc()))
        .collect();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    Some(model::Node {
        name,
        labels: labels(&node.metadata),
        addresses: addresses_of("InternalIP"),
        external_addresses: addresses_of("ExternalIP"),
        pod_cidrs,
        ready,
        held_eips: Vec::new(),
    })
}

/// A namespace as the planner sees it; `None` without a name.
pub fn namespace(namespace: &Namespace) -> Option<model::Namespace> {
    Some(model::Namespace {
        name: namespace.metadata.name.clone()?,
        labels: labels(&namespace.metadata),
    })
}

/// A pod as the planner sees it; `None` for a pod that no longer sends
/// traffic (phase `Succeeded` or `Failed`, or being deleted) and for one
/// without a name.
///
/// Its IPs come from `status.podIPs`, else `status.podIP`.
pub fn pod(pod: &Pod) -> Option<model::Pod> {
    watched_pod(&WatchedPod::from(pod))
}

/// [`pod`] of a Pod as the daemons keep it.
pub fn watched_pod(pod: &WatchedPod) -> Option<model::Pod> {
    if let Some(converted) = &pod.converted {
        return Some(model::Pod::clone(converted));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref();
    if let Some("Succeeded" | "Failed") = status.and_then(|s| s.phase.as_deref()) {
        return None;
    }
    let ips = status
        .and_then(|s| s.pod_ips.as_ref())
        .filter(|ips| !ips.is_empty())
        .map(|ips| ips.iter().map(|p| p.ip.clone()).collect::<Vec<_>>())
        .or_else(|| status.and_then(|s| s.pod_ip.clone()).map(|ip| vec![ip]))
        .unwrap_or_default()
        .iter()
        .filter_map(|ip| ip.parse::<IpAddr>().ok())
        .collect();
    let spec = pod.spec.as_ref();
    Some(model::Pod {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone()?,
        labels: labels(&pod.metadata),
        ips,
        node: spec.and_then(|s| s.node_name.clone()),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
    })
}

fn labels(meta: &ObjectMeta) -> model::Labels {
    meta.labels
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Creation order of an object: `creationTimestamp` in seconds, then UID.
/// An object not yet stored (no timestamp) sorts first.
pub(crate) fn age(meta: &ObjectMeta) -> Age {
    Age {
        created: meta
            .creation_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second()),
        uid: meta.uid.clone().unwrap_or_default(),
    }
}

/// `metadata.name`, recording an error when it is missing.
pub(crate) fn object_name(meta: &ObjectMeta, errors: &mut ValidationErrors) -> String {
    match non_empty(meta.name.as_ref()) {
        Some(name) => name.to_owned(),
        None => {
            errors.push("metadata.name", "must be set");
            String::new()
        }
    }
}

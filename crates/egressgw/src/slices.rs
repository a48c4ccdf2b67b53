//! The `EgressEndpointSlice`s the controller writes, decided apart from
//! sending them: [`plan`] is a pure function of the slices stored, the
//! gateways and the Pods each gateway's nodes need
//! ([`egressgw_core::plan_published`]).
//!
//! The stored slices are kept as [`WatchedSlice`]s: each Pod's name and a
//! digest of its entry, compared with the digest of the entry wanted. The
//! caller says which gateways it knows to be current ([`Wanted::Current`]):
//! their slices are not compared at all.
//!
//! A Pod stays in the slice that holds it while it is published (its
//! entry is rewritten in place when its labels or addresses change); new
//! Pods go to the slices with room, in name order, then to new slices.
//! A slice left empty is deleted, and so is every slice of a gateway that
//! no longer exists. Only slices whose content changes are written, so a
//! Pod created or deleted rewrites one slice, not the gateway's all.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use egressgw_api::EgressEndpointSliceSpec;
use egressgw_api::endpoints::{self, EndpointPod, MAX_PODS, WatchedSlice};
use egressgw_api::gateway::GatewayPods;
use egressgw_core::model::Pod;
use kube::ResourceExt as _;

/// The most bytes of entries a slice is given (an object must stay well
/// under the API server's request limit whatever the Pods' labels).
const MAX_BYTES: usize = 256 * 1024;

/// One write.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceWrite {
    /// Create or replace the slice `name` of the gateway of uid `owner`.
    Apply {
        name: String,
        owner: String,
        spec: EgressEndpointSliceSpec,
    },
    /// Delete the slice `name` of `gateway`.
    Delete { name: String, gateway: String },
}

impl SliceWrite {
    /// The gateway the write is for.
    pub fn gateway(&self) -> &str {
        match self {
            Self::Apply { spec, .. } => &spec.gateway,
            Self::Delete { gateway, .. } => gateway,
        }
    }
}

impl std::fmt::Display for SliceWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Apply { name, spec, .. } => write!(
                f,
                "the EgressEndpointSlice {name} ({} pod(s) of gateway {})",
                spec.pods.len(),
                spec.gateway
            ),
            Self::Delete { name, .. } => write!(f, "delete the EgressEndpointSlice {name}"),
        }
    }
}

/// A Pod wanted in its gateway's slices, with what its entry is compared
/// and placed by.
#[derive(Debug, Clone, Copy)]
pub struct Want<'a> {
    pub pod: &'a Pod,
    /// [`EndpointPod::digest`] of its entry.
    pub digest: u64,
    /// [`EndpointPod::json_len`] of its entry.
    pub len: usize,
}

impl<'a> Want<'a> {
    /// `pod`, its entry digested and measured now.
    pub fn new(pod: &'a Pod) -> Self {
        let entry = EndpointPod::of(pod);
        Self {
            pod,
            digest: entry.digest(),
            len: entry.json_len(),
        }
    }
}

/// What one gateway's slices should hold.
#[derive(Debug, Clone)]
pub enum Wanted<'a> {
    /// Its stored slices are known to hold its Pods, this many: nothing to
    /// compare or write.
    Current(usize),
    /// These Pods (none for a gateway whose policies select nothing).
    Pods(Vec<Want<'a>>),
}

/// What [`plan`] decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Planned {
    /// The writes, in order.
    pub writes: Vec<SliceWrite>,
    /// Per existing gateway: what its status says once the writes are done.
    pub published: BTreeMap<String, GatewayPods>,
}

/// The writes that make the stored `slices` hold what `wanted` says of
/// each gateway, by name; `gateways` maps every existing gateway to its
/// uid.
pub fn plan<'a>(
    slices: &[Arc<WatchedSlice>],
    gateways: &BTreeMap<String, String>,
    wanted: impl Fn(&str) -> Wanted<'a>,
) -> Planned {
    let mut by_gateway: BTreeMap<&str, Vec<&WatchedSlice>> = BTreeMap::new();
    for slice in slices {
        by_gateway
            .entry(slice.spec.gateway.as_str())
            .or_default()
            .push(slice);
    }
    let mut planned = Planned::default();
    for (gateway, stored) in &by_gateway {
        if !gateways.contains_key(*gateway) {
            planned
                .writes
                .extend(stored.iter().map(|s| SliceWrite::Delete {
                    name: s.name_any(),
                    gateway: (*gateway).to_owned(),
                }));
        }
    }
    // New slices take names no stored slice has, whichever its gateway.
    let mut taken: BTreeSet<String> = slices.iter().map(|s| s.name_any()).collect();
    let none = Vec::new();
    for (gateway, owner) in gateways {
        let stored = by_gateway.get(gateway.as_str()).unwrap_or(&none);
        let (selected, slices) = match wanted(gateway) {
            Wanted::Current(selected) => (selected, stored.len()),
            Wanted::Pods(pods) => {
                let (writes, slices) = gateway_slices(gateway, owner, stored, &pods, &mut taken);
                planned.writes.extend(writes);
                (pods.len(), slices)
            }
        };
        let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
        planned.published.insert(
            gateway.clone(),
            GatewayPods {
                selected: count(selected),
                slices: count(slices),
            },
        );
    }
    planned
}

/// One gateway's writes, and how many slices it has after them.
fn gateway_slices(
    gateway: &str,
    owner: &str,
    stored: &[&WatchedSlice],
    pods: &[Want<'_>],
    taken: &mut BTreeSet<String>,
) -> (Vec<SliceWrite>, usize) {
    let wanted: BTreeMap<(&str, &str), &Want<'_>> = pods
        .iter()
        .map(|p| ((p.pod.namespace.as_str(), p.pod.name.as_str()), p))
        .collect();
    let mut stored: Vec<&WatchedSlice> = stored.to_vec();
    stored.sort_by_key(|s| s.name_any());
    // Each stored slice keeps the wanted Pods it holds, as they are now.
    let mut placed: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut slices: Vec<(String, Vec<&Want<'_>>, Option<&WatchedSlice>)> = stored
        .iter()
        .map(|slice| {
            let kept = slice
                .spec
                .pods
                .iter()
                .filter_map(|p| {
                    let (key, pod) =
                        wanted.get_key_value(&(p.namespace.as_str(), p.name.as_str()))?;
                    placed.insert(*key).then_some(*pod)
                })
                .collect();
            (slice.name_any(), kept, Some(*slice))
        })
        .collect();
    // The others fill the slices with room, then new ones.
    let mut next_index = 0;
    let mut target = 0;
    for (key, pod) in &wanted {
        if placed.contains(key) {
            continue;
        }
        while target < slices.len() && !fits(&slices[target].1, pod) {
            target += 1;
        }
        if target == slices.len() {
            let name = loop {
                let name = endpoints::slice_name(gateway, next_index);
                next_index += 1;
                if taken.insert(name.clone()) {
                    break name;
                }
            };
            slices.push((name, Vec::new(), None));
        }
        slices[target].1.push(*pod);
    }
    let mut writes = Vec::new();
    let mut count = 0;
    for (name, mut pods, stored) in slices {
        if pods.is_empty() {
            if stored.is_some() {
                writes.push(SliceWrite::Delete {
                    name,
                    gateway: gateway.to_owned(),
                });
            }
            continue;
        }
        count += 1;
        pods.sort_by(|a, b| (&a.pod.namespace, &a.pod.name).cmp(&(&b.pod.namespace, &b.pod.name)));
        let current = stored.is_some_and(|s| {
            s.spec.gateway == gateway
                && s.spec.pods.len() == pods.len()
                && s.spec.pods.iter().zip(&pods).all(|(held, want)| {
                    held.namespace == want.pod.namespace
                        && held.name == want.pod.name
                        && held.digest == want.digest
                })
                && s.labels().get(endpoints::GATEWAY_LABEL)
                    == Some(&endpoints::gateway_label(gateway))
                && s.owner_references().iter().any(|o| o.uid == owner)
        });
        if !current {
            writes.push(SliceWrite::Apply {
                name,
                owner: owner.to_owned(),
                spec: EgressEndpointSliceSpec {
                    gateway: gateway.to_owned(),
                    pods: pods.iter().map(|w| EndpointPod::of(w.pod)).collect(),
                },
            });
        }
    }
    (writes, count)
}

/// Whether `pod` may join a slice holding `pods`: one with room, in count
/// and bytes; an empty slice takes any Pod.
fn fits(pods: &[&Want<'_>], pod: &Want<'_>) -> bool {
    if pods.is_empty() {
        return true;
    }
    let bytes: usize = pods.iter().map(|p| p.len).sum();
    pods.len() < MAX_PODS && bytes + pod.len <= MAX_BYTES
}

#[cfg(test)]
mod tests {
    use egressgw_api::EgressEndpointSlice;
    use egressgw_api::endpoints::GATEWAY_LABEL;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(ns: &str, name: &str, ip: &str) -> Pod {
        Pod {
            namespace: ns.into(),
            name: name.into(),
            node: Some("node-1".into()),
            ips: vec![ip.parse().unwrap()],
            labels: [("app".to_owned(), "web".to_owned())].into(),
            host_network: false,
        }
    }

    /// Every gateway of `wanted` compared with what is stored.
    fn all<'a>(wanted: &'a BTreeMap<String, Vec<Pod>>) -> impl Fn(&str) -> Wanted<'a> + 'a {
        move |gateway: &str| {
            let pods = wanted.get(gateway).map_or(&[][..], Vec::as_slice);
            Wanted::Pods(pods.iter().map(Want::new).collect())
        }
    }

    fn pods(n: usize) -> Vec<Pod> {
        (0..n)
            .map(|i| {
                pod(
                    "team-a",
                    &format!("web-{i:04}"),
                    &format!("10.244.{}.{}", i / 250, i % 250),
                )
            })
            .collect()
    }

    fn gateways(names: &[&str]) -> BTreeMap<String, String> {
        names
            .iter()
            .map(|n| ((*n).to_owned(), format!("uid-{n}")))
            .collect()
    }

    /// The slices after `writes`, as the API server would store them.
    fn stored(mut slices: Vec<Arc<WatchedSlice>>, writes: &[SliceWrite]) -> Vec<Arc<WatchedSlice>> {
        for write in writes {
            match write {
                SliceWrite::Delete { name, .. } => slices.retain(|s| s.name_any() != *name),
                SliceWrite::Apply { name, spec, owner } => {
                    slices.retain(|s| s.name_any() != *name);
                    let mut slice = EgressEndpointSlice::new(name, spec.clone());
                    slice.metadata = ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some(
                            [(
                                GATEWAY_LABEL.to_owned(),
                                endpoints::gateway_label(&spec.gateway),
                            )]
                            .into(),
                        ),
                        owner_references: Some(vec![OwnerReference {
                            api_version: "egressgw.io/v1alpha1".into(),
                            kind: "EgressGateway".into(),
                            name: spec.gateway.clone(),
                            uid: owner.clone(),
                            ..OwnerReference::default()
                        }]),
                        ..ObjectMeta::default()
                    };
                    let json = serde_json::to_value(&slice).expect("a slice serializes");
                    slices.push(Arc::new(serde_json::from_value(json).expect("decoded")));
                }
            }
        }
        slices
    }

    fn held(slices: &[Arc<WatchedSlice>]) -> BTreeMap<String, Vec<String>> {
        slices
            .iter()
            .map(|s| {
                let names = s.spec.pods.iter().map(|p| p.name.clone()).collect();
                (s.name_any(), names)
            })
            .collect()
    }

    #[test]
    fn a_gateways_pods_fill_slices_of_a_hundred_and_a_second_plan_writes_nothing() {
        let gws = gateways(&["gw", "idle"]);
        let wanted = BTreeMap::from([("gw".to_owned(), pods(250))]);
        let first = plan(&[], &gws, all(&wanted));
        assert_eq!(first.writes.len(), 3);
        let slices = stored(Vec::new(), &first.writes);
        let sizes: Vec<usize> = slices.iter().map(|s| s.spec.pods.len()).collect();
        assert_eq!(sizes, vec![100, 100, 50]);
        assert_eq!(
            first.published["gw"],
            GatewayPods {
                selected: 250,
                slices: 3
            }
        );
        // A gateway whose policies select nothing is published too, empty.
        assert_eq!(first.published["idle"], GatewayPods::default());
        let again = plan(&slices, &gws, all(&wanted));
        assert!(again.writes.is_empty(), "{:?}", again.writes);
    }

    #[test]
    fn a_pod_added_or_deleted_rewrites_one_slice() {
        let gws = gateways(&["gw"]);
        let mut wanted = BTreeMap::from([("gw".to_owned(), pods(250))]);
        let slices = stored(Vec::new(), &plan(&[], &gws, all(&wanted)).writes);
        let before = held(&slices);
        // One deleted from the first slice: only that slice is written.
        wanted.get_mut("gw").unwrap().remove(3);
        let deleted = plan(&slices, &gws, all(&wanted));
        assert_eq!(deleted.writes.len(), 1, "{:?}", deleted.writes);
        let slices = stored(slices, &deleted.writes);
        // One added: it goes to the slice with room, the others stay.
        wanted
            .get_mut("gw")
            .unwrap()
            .push(pod("team-b", "new", "10.245.0.1"));
        let added = plan(&slices, &gws, all(&wanted));
        assert_eq!(added.writes.len(), 1, "{:?}", added.writes);
        let slices = stored(slices, &added.writes);
        let after = held(&slices);
        assert_eq!(after["gw-1"], before["gw-1"]);
        assert!(after.values().flatten().any(|n| n == "new"));
        assert_eq!(after.values().map(Vec::len).sum::<usize>(), 250);
        // A relabelled Pod is rewritten where it is.
        let mut relabelled = wanted.clone();
        relabelled.get_mut("gw").unwrap()[150]
            .labels
            .insert("tier".into(), "front".into());
        let moved = plan(&slices, &gws, all(&relabelled));
        assert_eq!(moved.writes.len(), 1);
        let slices = stored(slices, &moved.writes);
        assert_eq!(held(&slices), after);
    }

    #[test]
    fn empty_slices_and_the_slices_of_a_deleted_gateway_go() {
        let gws = gateways(&["gw", "old"]);
        let wanted = BTreeMap::from([("gw".to_owned(), pods(150)), ("old".to_owned(), pods(10))]);
        let slices = stored(Vec::new(), &plan(&[], &gws, all(&wanted)).writes);
        assert_eq!(slices.len(), 3);
        let fewer = BTreeMap::from([("gw".to_owned(), pods(150)[..80].to_vec())]);
        let planned = plan(&slices, &gateways(&["gw"]), all(&fewer));
        let slices = stored(slices, &planned.writes);
        assert_eq!(
            held(&slices).keys().cloned().collect::<Vec<_>>(),
            vec!["gw-0".to_owned()]
        );
        assert!(!planned.published.contains_key("old"));
    }

    /// A gateway made again under its name (a new uid) gets its slices
    /// written again, owned by it, before the garbage collector takes the
    /// old owner's; and a new slice never takes a name another gateway's
    /// slice has.
    #[test]
    fn slices_follow_their_gateways_uid_and_names_stay_apart() {
        let wanted = BTreeMap::from([("gw".to_owned(), pods(10))]);
        let slices = stored(
            Vec::new(),
            &plan(&[], &gateways(&["gw"]), all(&wanted)).writes,
        );
        let mut again = gateways(&["gw"]);
        again.insert("gw".into(), "uid-gw-again".into());
        let rewritten = plan(&slices, &again, all(&wanted));
        assert!(
            matches!(rewritten.writes.as_slice(), [SliceWrite::Apply { owner, .. }] if owner == "uid-gw-again"),
            "{:?}",
            rewritten.writes
        );
        // A slice named like gw's first, holding another gateway's Pods.
        let mut other = stored(
            Vec::new(),
            &plan(&[], &gateways(&["gw"]), all(&wanted)).writes,
        );
        let json = serde_json::json!({
            "metadata": { "name": "gw-0" },
            "spec": { "gateway": "other", "pods": [] },
        });
        other[0] = Arc::new(serde_json::from_value(json).unwrap());
        let planned = plan(&other, &gateways(&["gw", "other"]), all(&wanted));
        let names: Vec<&str> = planned
            .writes
            .iter()
            .filter_map(|w| match w {
                SliceWrite::Apply { name, spec, .. } if spec.gateway == "gw" => Some(name.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(names, ["gw-1"]);
    }

    /// However large a Pod's labels, a slice stays under its byte budget
    /// (one such Pod alone in a slice at most).
    #[test]
    fn large_labels_spread_over_more_slices() {
        let big: egressgw_core::model::Labels = (0..40)
            .map(|i| (format!("key-{i}"), "v".repeat(1000)))
            .collect();
        let mut many = pods(20);
        for p in &mut many {
            p.labels.clone_from(&big);
        }
        let planned = plan(
            &[],
            &gateways(&["gw"]),
            all(&BTreeMap::from([("gw".to_owned(), many)])),
        );
        for write in &planned.writes {
            let SliceWrite::Apply { spec, .. } = write else {
                panic!("only applies")
            };
            let bytes = serde_json::to_vec(spec).unwrap().len();
            assert!(bytes <= MAX_BYTES, "{bytes}");
        }
        assert!(planned.writes.len() > 1);
    }

    /// A gateway the caller knows to be current is not compared: no write
    /// even where its slices differ, and its status counts what it says.
    #[test]
    fn a_current_gateway_is_not_compared() {
        let gws = gateways(&["gw", "other"]);
        let wanted = BTreeMap::from([("gw".to_owned(), pods(150)), ("other".to_owned(), pods(5))]);
        let slices = stored(Vec::new(), &plan(&[], &gws, all(&wanted)).writes);
        let fewer = BTreeMap::from([("gw".to_owned(), pods(120)), ("other".to_owned(), pods(4))]);
        let planned = plan(&slices, &gws, |gateway| match gateway {
            "gw" => Wanted::Current(150),
            _ => all(&fewer)(gateway),
        });
        assert!(
            planned.writes.iter().all(|w| w.gateway() == "other"),
            "{:?}",
            planned.writes
        );
        assert_eq!(planned.writes.len(), 1);
        assert_eq!(
            planned.published["gw"],
            GatewayPods {
                selected: 150,
                slices: 2
            }
        );
        assert_eq!(
            planned.published["other"],
            GatewayPods {
                selected: 4,
                slices: 1
            }
        );
    }
}

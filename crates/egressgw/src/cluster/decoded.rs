//! A watched object that may not decode.
//!
//! A list from the API server is decoded as a whole: one stored object that
//! does not fit egressgw's types (stored before a bound existed, or written
//! around admission) would fail every list and leave the whole kind's store
//! stale. [`Decoded`] takes each object on its own: what decodes is used,
//! what does not is kept with its metadata and the error, so that the
//! controller can report it by name instead of dropping it.
//!
//! A decoded object is held behind an [`Arc`]: the store copies every
//! object it takes, and that copy is then one count more, not the object's
//! every string and map again.
//!
//! A daemon keeps less of a policy: it plans from the policy converted
//! into the planner's terms, so it converts the policy as the watch takes
//! it and keeps that, with the metadata a store and an Event need and,
//! for the controller, which writes it, the status
//! ([`Decoded::Converted`]), not the object. The planner's snapshot and
//! its indexes share that one converted policy.

use std::borrow::Cow;
use std::sync::Arc;

use egressgw_api::policy::EgressPolicyStatus;
use egressgw_core::model::Policy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

/// An object of kind `K`, or what is known of one that did not decode.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded<K> {
    /// It decoded.
    Ok(Arc<K>),
    /// It decoded and converted, and only the converted policy is kept,
    /// with the object's name, namespace, version, uid and generation, and
    /// its status when asked ([`Decoded::convert`]).
    Converted {
        /// The name, namespace, `resourceVersion`, uid and generation.
        meta: Box<ObjectMeta>,
        /// The policy in the planner's terms, shared with the snapshots
        /// planned from it.
        policy: Arc<Policy>,
        /// The object's status, when kept.
        status: Option<Box<EgressPolicyStatus>>,
    },
    /// It did not: its metadata and why.
    Undecodable {
        /// The object's metadata (default when even that did not decode).
        meta: Box<ObjectMeta>,
        /// The decoding error.
        error: String,
    },
}

impl<K> Decoded<K> {
    /// The object, when it decoded.
    pub fn ok(&self) -> Option<&K> {
        match self {
            Decoded::Ok(k) => Some(k),
            Decoded::Converted { .. } | Decoded::Undecodable { .. } => None,
        }
    }

    /// The policy converted, when it was ([`Decoded::convert`]).
    pub fn converted(&self) -> Option<&Arc<Policy>> {
        match self {
            Decoded::Converted { policy, .. } => Some(policy),
            Decoded::Ok(_) | Decoded::Undecodable { .. } => None,
        }
    }

    /// Keeps only `convert`'s result, the status `status` gives, and the
    /// metadata a store and an Event need (the name, namespace,
    /// `resourceVersion`, uid and generation), when the object decoded
    /// and converts; otherwise changes nothing: an object that does not
    /// convert is kept whole, for its problems to be reported.
    pub fn convert<E>(
        &mut self,
        convert: impl FnOnce(&K) -> Result<Policy, E>,
        status: impl FnOnce(&K) -> Option<EgressPolicyStatus>,
    ) where
        K: Resource,
    {
        let Decoded::Ok(object) = self else {
            return;
        };
        let Ok(policy) = convert(object) else {
            return;
        };
        let status = status(object).map(Box::new);
        let meta = object.meta();
        let meta = ObjectMeta {
            name: meta.name.clone(),
            namespace: meta.namespace.clone(),
            resource_version: meta.resource_version.clone(),
            uid: meta.uid.clone(),
            generation: meta.generation,
            ..ObjectMeta::default()
        };
        *self = Decoded::Converted {
            meta: Box::new(meta),
            policy: Arc::new(policy),
            status,
        };
    }
}

impl<K: Clone> Decoded<K> {
    /// The object to change, when it decoded (copied first while shared).
    pub fn ok_mut(&mut self) -> Option<&mut K> {
        match self {
            Decoded::Ok(k) => Some(Arc::make_mut(k)),
            Decoded::Converted { .. } | Decoded::Undecodable { .. } => None,
        }
    }
}

impl<'de, K: DeserializeOwned> Deserialize<'de> for Decoded<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        match K::deserialize(&value) {
            Ok(object) => Ok(Decoded::Ok(Arc::new(object))),
            Err(e) => Ok(Decoded::Undecodable {
                meta: Box::new(ObjectMeta::deserialize(&value["metadata"]).unwrap_or_default()),
                error: e.to_string(),
            }),
        }
    }
}

impl<K: Resource<DynamicType = ()> + Clone> Resource for Decoded<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        match self {
            Decoded::Ok(k) => k.meta(),
            Decoded::Converted { meta, .. } | Decoded::Undecodable { meta, .. } => meta,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Decoded::Ok(k) => Arc::make_mut(k).meta_mut(),
            Decoded::Converted { meta, .. } | Decoded::Undecodable { meta, .. } => meta,
        }
    }
}

#[cfg(test)]
mod tests {
    use egressgw_api::EgressPolicy;
    use serde_json::json;

    use super::*;

    #[test]
    fn an_object_out_of_its_types_range_is_kept_with_its_name_and_error() {
        let list: Vec<Decoded<EgressPolicy>> = serde_json::from_value(json!([
            {
                "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicy",
                "metadata": { "name": "good", "namespace": "a" },
                "spec": { "appliedTo": { "podSelector": {} } },
            },
            {
                "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicy",
                "metadata": { "name": "huge", "namespace": "a" },
                "spec": { "appliedTo": { "podSelector": {} }, "priority": 99_999_999_999_u64 },
            },
        ]))
        .unwrap();
        assert!(list[0].ok().is_some());
        let Decoded::Undecodable { meta, error } = &list[1] else {
            panic!("{:?}", list[1]);
        };
        assert_eq!(meta.name.as_deref(), Some("huge"));
        assert!(error.contains("99999999999"), "{error}");
    }

    #[test]
    fn objects_decode_from_watch_events_and_lists_as_the_client_reads_them() {
        use kube::core::{ObjectList, WatchEvent};
        let policy = |name: &str, priority: u64| {
            json!({
                "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicy",
                "metadata": { "name": name, "namespace": "a", "resourceVersion": "7" },
                "spec": { "appliedTo": { "podSelector": {} }, "priority": priority },
            })
        };
        // One event per line, the type first, as the API server writes
        // it, or after the object.
        let line = format!(r#"{{"type":"MODIFIED","object":{}}}"#, policy("p", 5));
        let after = json!({ "type": "MODIFIED", "object": policy("p", 5) }).to_string();
        assert!(after.starts_with(r#"{"object""#), "{after}");
        let modified = |line: &str| match serde_json::from_str(line).unwrap() {
            WatchEvent::<Decoded<EgressPolicy>>::Modified(object) => object,
            _ => panic!("{line}"),
        };
        assert_eq!(modified(&after), modified(&line));
        let event = modified(&line);
        assert_eq!(event.ok().unwrap().spec.priority, 5);
        let text = json!({
            "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicyList",
            "metadata": { "resourceVersion": "9" },
            "items": [policy("p", 5), policy("q", 99_999_999_999)],
        })
        .to_string();
        let list: ObjectList<Decoded<EgressPolicy>> = serde_json::from_str(&text).unwrap();
        assert_eq!(list.items[0], event);
        let Decoded::Undecodable { meta, error } = &list.items[1] else {
            panic!("{:?}", list.items[1]);
        };
        assert_eq!(meta.name.as_deref(), Some("q"));
        assert!(error.contains("99999999999"), "{error}");
        // What a store keeps of an event is the same object, not a copy.
        let kept = event.clone();
        let (Decoded::Ok(a), Decoded::Ok(b)) = (&event, &kept) else {
            unreachable!()
        };
        assert!(Arc::ptr_eq(a, b));
    }
}

//! A watched object that may not decode.
//!
//! A list from the API server is decoded as a whole: one stored object that
//! does not fit egressgw's types (stored before a bound existed, or written
//! around admission) would fail every list and leave the whole kind's store
//! stale. [`Decoded`] takes each object on its own: what decodes is used,
//! what does not is kept with its metadata and the error, so that the
//! controller can report it by name instead of dropping it.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

/// An object of kind `K`, or what is known of one that did not decode.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded<K> {
    /// It decoded.
    Ok(K),
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
            Decoded::Undecodable { .. } => None,
        }
    }
}

impl<'de, K: DeserializeOwned> Deserialize<'de> for Decoded<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        match K::deserialize(&value) {
            Ok(object) => Ok(Decoded::Ok(object)),
            Err(e) => Ok(Decoded::Undecodable {
                meta: Box::new(ObjectMeta::deserialize(&value["metadata"]).unwrap_or_default()),
                error: e.to_string(),
            }),
        }
    }
}

impl<K: Resource<DynamicType = ()>> Resource for Decoded<K> {
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
            Decoded::Undecodable { meta, .. } => meta,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Decoded::Ok(k) => k.meta_mut(),
            Decoded::Undecodable { meta, .. } => meta,
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
}

//! Strict field validation of egressgw's objects, as the apiserver does it
//! for `kubectl apply` (`fieldValidation=Strict`): every field an object
//! has must be one its kind's schema declares.
//!
//! serde alone cannot tell: the kube-derived kinds and the Kubernetes types
//! they embed skip fields they do not know, so a misspelled
//! `spec.destSubnets` would be dropped and the policy would cover every
//! destination. The check walks the object against the CRD's own
//! structural schema, so it refuses exactly what the apiserver would prune:
//!
//! - under `properties`, a field that is not listed is unknown, unless the
//!   schema has `additionalProperties` or
//!   `x-kubernetes-preserve-unknown-fields: true`;
//! - an object schema without properties (`EgressTunnel`'s empty `spec`)
//!   allows no fields at all;
//! - `apiVersion`, `kind` and `metadata` are allowed at the root, and only
//!   `metadata`'s own fields (`ObjectMeta`) inside it, as the apiserver
//!   checks them; what is below those (labels, `managedFields`) is free;
//! - `status` is not checked: the controller writes it, nothing in it
//!   widens what a policy covers, and a `kubectl get -o yaml` dump from a
//!   cluster that runs another egressgw version must still load.
//!
//! The same walk finds integers outside the CRD's `minimum`/`maximum`
//! ([`out_of_range`]), which is how the loader names a number too large for
//! its Rust type, as the apiserver names it.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Map, Value, json};

use crate::validation::{IntRange, ValidationErrors};
use crate::{VERSION, crd};

/// Each kind's schema as the check reads it: the CRD's schema with the
/// root fields the apiserver adds.
static SCHEMAS: LazyLock<BTreeMap<String, Value>> = LazyLock::new(|| {
    crd::crds()
        .into_iter()
        .filter_map(|crd| {
            let version = crd.spec.versions.into_iter().find(|v| v.name == VERSION)?;
            let schema = version.schema?.open_api_v3_schema?;
            let schema = serde_json::to_value(schema).expect("a schema serializes to JSON");
            Some((crd.spec.names.kind, with_root_fields(schema)))
        })
        .collect()
});

/// Every field of `object`, one of egressgw's objects of `kind`, that the
/// kind does not have; each error's path is the field's, from the object
/// root (`spec.appliedTo.podSelector.matchLabel`). No errors for a kind
/// that is not egressgw's.
pub(crate) fn unknown_fields(kind: &str, object: &Value) -> ValidationErrors {
    let mut errors = ValidationErrors::new();
    if let Some(schema) = SCHEMAS.get(kind) {
        walk(object, schema, "", &mut errors);
    }
    errors
}

/// Every integer of `object`, one of egressgw's objects of `kind`, outside
/// the `minimum`/`maximum` its CRD sets, as the apiserver refuses it; each
/// error's path is the field's (`spec.priority`). `status` and `metadata`
/// are not checked, as for unknown fields.
///
/// The loader reports these when an object does not decode: a number too
/// large for its Rust type (`priority: 99999999999`) is otherwise only a
/// serde error without a path.
pub(crate) fn out_of_range(kind: &str, object: &Value) -> ValidationErrors {
    let mut errors = ValidationErrors::new();
    if let Some(schema) = SCHEMAS.get(kind) {
        walk_integers(object, schema, "", &mut errors);
    }
    errors
}

/// Records every integer of `value` outside the bounds its schema sets.
fn walk_integers(value: &Value, schema: &Value, path: &str, errors: &mut ValidationErrors) {
    match value {
        Value::Object(fields) => {
            for (name, field) in fields {
                let field_schema = schema
                    .get("properties")
                    .and_then(|p| p.get(name))
                    .or_else(|| schema.get("additionalProperties"));
                if let Some(field_schema) = field_schema {
                    walk_integers(field, field_schema, &child_path(path, name), errors);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk_integers(item, item_schema, &format!("{path}[{i}]"), errors);
                }
            }
        }
        Value::Number(number) => {
            let bound = |key: &str| schema.get(key).and_then(Value::as_f64);
            let (Some(min), Some(max), Some(as_float)) =
                (bound("minimum"), bound("maximum"), number.as_f64())
            else {
                return;
            };
            if !(min..=max).contains(&as_float) {
                errors.push(path, bounds_message(number, min, max));
            }
        }
        _ => {}
    }
}

/// The message of [`IntRange::out_of_range`] for bounds read back from a
/// schema, where they are floats.
fn bounds_message(number: &serde_json::Number, min: f64, max: f64) -> String {
    // The bounds came from `IntRange`s: integers that floats hold exactly.
    let range = IntRange {
        min: min as i64,
        max: max as i64,
    };
    range.out_of_range(number)
}

fn child_path(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

/// The CRD's root schema plus `apiVersion`, `kind` and `metadata`, which
/// the apiserver allows on every object; `status` free (see the module docs).
fn with_root_fields(mut schema: Value) -> Value {
    let free = json!({ "x-kubernetes-preserve-unknown-fields": true });
    let metadata_fields: Map<String, Value> = object_meta_fields()
        .into_iter()
        .map(|field| (field, free.clone()))
        .collect();
    if let Some(properties) = schema
        .as_object_mut()
        .map(|root| root.entry("properties").or_insert_with(|| json!({})))
        .and_then(Value::as_object_mut)
    {
        properties.insert("apiVersion".into(), json!({ "type": "string" }));
        properties.insert("kind".into(), json!({ "type": "string" }));
        properties.insert(
            "metadata".into(),
            json!({ "type": "object", "properties": metadata_fields }),
        );
        properties.insert("status".into(), free);
    }
    schema
}

/// The fields of `metadata`, from `ObjectMeta`'s own schema.
fn object_meta_fields() -> Vec<String> {
    let schema = schemars::schema_for!(ObjectMeta);
    schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|properties| properties.keys().cloned().collect())
        .unwrap_or_default()
}

/// Records every field of `value` that `schema` does not declare, and
/// walks into those it does. `path` is the path of `value`, `""` at the root.
fn walk(value: &Value, schema: &Value, path: &str, errors: &mut ValidationErrors) {
    match value {
        Value::Object(fields) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            let free = schema.get("x-kubernetes-preserve-unknown-fields")
                == Some(&Value::Bool(true))
                || additional == Some(&Value::Bool(true));
            for (name, field) in fields {
                let field_path = child_path(path, name);
                match properties.and_then(|p| p.get(name)) {
                    Some(field_schema) => walk(field, field_schema, &field_path, errors),
                    None => match additional {
                        Some(field_schema @ Value::Object(_)) => {
                            walk(field, field_schema, &field_path, errors);
                        }
                        _ if free => {}
                        _ => errors.push(field_path, unknown_message(name, properties)),
                    },
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk(item, item_schema, &format!("{path}[{i}]"), errors);
                }
            }
        }
        _ => {}
    }
}

/// `unknown field`, with the declared field `name` is most likely a typo of.
fn unknown_message(name: &str, known: Option<&Map<String, Value>>) -> String {
    let nearest = known
        .into_iter()
        .flat_map(Map::keys)
        .map(|candidate| (edit_distance(name, candidate), candidate))
        .filter(|(distance, _)| *distance <= 2)
        .min();
    match nearest {
        Some((_, candidate)) => format!("unknown field (did you mean {candidate}?)"),
        None => "unknown field".into(),
    }
}

/// Levenshtein distance between `a` and `b`, ignoring ASCII case.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().map(|c| c.to_ascii_lowercase()).collect();
    let b: Vec<char> = b.chars().map(|c| c.to_ascii_lowercase()).collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != cb);
            current.push(substitute.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(kind: &str, object: &Value) -> Vec<String> {
        unknown_fields(kind, object).messages()
    }

    #[test]
    fn a_misspelled_spec_field_is_unknown_with_the_field_it_resembles() {
        let policy = json!({
            "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicy",
            "metadata": {"name": "web", "namespace": "team-a"},
            "spec": {"appliedTo": {"podSubnet": ["10.244.0.0/16"]}, "destSubnets": ["203.0.113.0/24"]}
        });
        assert_eq!(
            paths("EgressPolicy", &policy),
            ["spec.destSubnets: unknown field (did you mean destSubnet?)"]
        );
    }

    #[test]
    fn fields_are_checked_at_every_depth_and_in_list_items() {
        let policy = json!({
            "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressClusterPolicy",
            "metadata": {"name": "web"},
            "spec": {
                "appliedTo": {
                    "namespaceSelector": {"matchLabel": {"team": "a"}},
                    "podSelector": {"matchExpressions": [
                        {"key": "app", "operator": "In", "values": ["web"]},
                        {"key": "tier", "operator": "Exists", "valus": []}
                    ]}
                },
                "egressIP": {"ipv4": "10.6.1.1", "allocator": "rr"}
            }
        });
        assert_eq!(
            paths("EgressClusterPolicy", &policy),
            [
                "spec.appliedTo.namespaceSelector.matchLabel: unknown field (did you mean matchLabels?)",
                "spec.appliedTo.podSelector.matchExpressions[1].valus: unknown field (did you mean values?)",
                "spec.egressIP.allocator: unknown field",
            ]
        );
    }

    #[test]
    fn map_values_are_free_and_a_top_level_typo_is_unknown() {
        let gateway = json!({
            "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressGateway",
            "metadata": {"name": "gw"},
            "spec": {"nodeSelector": {"selector": {"matchLabels": {"any-label": "x"}}}},
            "sepc": {}
        });
        assert_eq!(
            paths("EgressGateway", &gateway),
            ["sepc: unknown field (did you mean spec?)"]
        );
    }

    #[test]
    fn metadata_of_a_kubectl_dump_loads_and_a_metadata_typo_is_unknown() {
        let tunnel = json!({
            "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressTunnel",
            "metadata": {
                "name": "node-1", "uid": "1234", "resourceVersion": "42", "generation": 1,
                "creationTimestamp": "2025-01-01T00:00:00Z",
                "labels": {"a": "b"}, "annotations": {"c": "d"},
                "managedFields": [{"manager": "egressgw", "operation": "Apply",
                                   "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}],
                "lables": {"a": "b"}
            },
            "spec": {},
            "status": {"phase": "Ready", "somethingNewer": true}
        });
        assert_eq!(
            paths("EgressTunnel", &tunnel),
            ["metadata.lables: unknown field (did you mean labels?)"]
        );
    }

    #[test]
    fn an_empty_spec_schema_allows_no_fields() {
        let tunnel = json!({"kind": "EgressTunnel", "spec": {"node": "n1"}});
        assert_eq!(paths("EgressTunnel", &tunnel), ["spec.node: unknown field"]);
    }

    #[test]
    fn an_integer_beyond_its_bounds_is_named_by_its_path() {
        let policy = |priority: Value| {
            json!({
                "apiVersion": "egressgw.io/v1alpha1", "kind": "EgressPolicy",
                "metadata": {"name": "web", "namespace": "team-a", "generation": 99_999_999_999_i64},
                "spec": {"appliedTo": {"podSelector": {}}, "priority": priority},
                "status": {"conditions": [{"observedGeneration": -1}]}
            })
        };
        let messages = |priority| out_of_range("EgressPolicy", &policy(priority)).messages();
        assert_eq!(
            messages(json!(99_999_999_999_i64)),
            [
                "spec.priority: 99999999999 is out of range: must be between -2147483648 and 2147483647"
            ]
        );
        assert_eq!(
            messages(json!(-2_147_483_649_i64)),
            [
                "spec.priority: -2147483649 is out of range: must be between -2147483648 and 2147483647"
            ]
        );
        assert_eq!(
            messages(json!(18_446_744_073_709_551_615_u64)),
            [
                "spec.priority: 18446744073709551615 is out of range: must be between -2147483648 and 2147483647"
            ]
        );
        for fine in [json!(i32::MIN), json!(0), json!(i32::MAX)] {
            assert!(messages(fine.clone()).is_empty(), "{fine}");
        }
    }

    #[test]
    fn kinds_that_are_not_egressgws_are_not_checked() {
        assert!(paths("Pod", &json!({"spec": {"anything": 1}})).is_empty());
    }

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("destSubnets", "destSubnet"), 1);
        assert_eq!(edit_distance("podselector", "podSelector"), 0);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}

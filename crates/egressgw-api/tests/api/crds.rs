//! The generated CRDs: fresh on disk, and shaped so the apiserver accepts them.

use std::path::Path;

use egressgw_api::crd::{GENERATED_HEADER, crd_files, crds};
use serde_json::Value;

fn crd_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds")
}

#[test]
fn the_checked_in_crd_manifests_match_the_rust_types() {
    for file in crd_files() {
        let path = crd_dir().join(&file.file_name);
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == file.contents,
            "{} is stale or missing: run `cargo xtask gen-crds`",
            path.display()
        );
    }
}

#[test]
fn every_manifest_starts_with_the_generated_header_and_parses_back() {
    for file in crd_files() {
        assert!(file.contents.starts_with(GENERATED_HEADER));
        let parsed: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
            serde_yaml::from_str(&file.contents).unwrap();
        assert_eq!(
            format!("{}.yaml", parsed.metadata.name.unwrap()),
            file.file_name
        );
    }
}

#[test]
fn every_kind_has_its_short_name_scope_category_and_status_subresource() {
    // (kind, short name, scope, whether it has a status)
    let expected = [
        ("EgressGateway", "egw", "Cluster", true),
        ("EgressPolicy", "egp", "Namespaced", true),
        ("EgressClusterPolicy", "egcp", "Cluster", true),
        ("EgressTunnel", "egt", "Cluster", true),
        // The controller's own output, for the agents: all of it is the
        // controller's to write, and it is in no category.
        ("EgressEndpointSlice", "egeps", "Namespaced", false),
    ];
    let crds = crds();
    assert_eq!(crds.len(), expected.len());
    for (crd, (kind, short, scope, status)) in crds.iter().zip(expected) {
        assert_eq!(crd.spec.group, "egressgw.io");
        assert_eq!(crd.spec.names.kind, kind);
        assert_eq!(
            crd.spec.names.short_names,
            Some(vec![short.to_owned()]),
            "{kind}"
        );
        assert_eq!(
            crd.spec.names.categories,
            status.then(|| vec!["egressgw".to_owned()]),
            "{kind}: in the category if users read it"
        );
        assert_eq!(crd.spec.scope, scope, "{kind}");
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert_eq!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            status,
            "{kind}"
        );
    }
}

#[test]
fn policies_print_gateway_eips_node_ready_and_age() {
    for crd in &crds()[1..3] {
        let columns: Vec<(String, String)> = crd.spec.versions[0]
            .additional_printer_columns
            .iter()
            .flatten()
            .filter(|c| c.priority.unwrap_or(0) == 0)
            .map(|c| (c.name.clone(), c.json_path.clone()))
            .collect();
        let expected = [
            ("Gateway", ".spec.egressGatewayName"),
            ("IPv4 EIP", ".status.eip.ipv4"),
            ("IPv6 EIP", ".status.eip.ipv6"),
            ("Node", ".status.node"),
            ("Ready", r#".status.conditions[?(@.type=="Ready")].status"#),
            ("Age", ".metadata.creationTimestamp"),
        ]
        .map(|(n, p)| (n.to_owned(), p.to_owned()));
        assert_eq!(columns, expected, "{}", crd.spec.names.kind);
    }
}

/// Calls `visit(path, schema)` on every schema node, where `path` is the
/// JSON path of the field (`spec.ippools.ipv4`, items add nothing).
fn walk(path: &str, schema: &Value, visit: &mut dyn FnMut(&str, &Value)) {
    visit(path, schema);
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        for (name, child) in properties {
            let child_path = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            walk(&child_path, child, visit);
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(child) = schema.get(key).filter(|c| c.is_object()) {
            walk(path, child, visit);
        }
    }
}

fn schemas() -> Vec<(String, Value)> {
    crds()
        .into_iter()
        .map(|crd| {
            let schema = crd.spec.versions[0]
                .schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .map(|s| serde_json::to_value(s).expect("a schema serializes"))
                .unwrap_or(Value::Null);
            (crd.spec.names.kind, schema)
        })
        .collect()
}

#[test]
fn every_schema_node_has_a_type_and_no_unstructural_combinators() {
    for (kind, schema) in schemas() {
        assert_eq!(schema.get("type"), Some(&Value::from("object")), "{kind}");
        walk("", &schema, &mut |path, node| {
            assert!(
                node.get("type").is_some(),
                "{kind} {path}: no type in {node}"
            );
            for combinator in ["anyOf", "oneOf", "allOf", "not", "$ref"] {
                assert!(
                    node.get(combinator).is_none(),
                    "{kind} {path}: {combinator}"
                );
            }
        });
    }
}

#[test]
fn every_cel_rule_has_a_message_naming_its_field() {
    let mut rules = 0;
    for (kind, schema) in schemas() {
        walk("", &schema, &mut |path, node| {
            for rule in node
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                rules += 1;
                let message = rule
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let named = message.split(": ").next().unwrap_or_default();
                assert!(
                    !path.is_empty() && named.starts_with(path),
                    "{kind} {path}: message {message:?} does not start with the field it checks"
                );
                assert!(!message.contains('\n'), "{kind} {path}: multi-line message");
            }
        });
    }
    assert!(rules >= 20, "only {rules} rules found");
}

#[test]
fn every_spec_list_and_every_string_a_rule_reads_is_bounded() {
    for (kind, schema) in schemas() {
        walk("", &schema, &mut |path, node| {
            if path.starts_with("spec") && node.get("type") == Some(&Value::from("array")) {
                assert!(
                    node.get("maxItems").is_some(),
                    "{kind} {path}: list without maxItems"
                );
            }
            if node.get("x-kubernetes-validations").is_some()
                && node.get("type") == Some(&Value::from("string"))
            {
                assert!(
                    node.get("maxLength").is_some(),
                    "{kind} {path}: string without maxLength"
                );
            }
        });
    }
}

#[test]
fn every_integer_has_a_minimum_and_a_maximum() {
    let mut integers = Vec::new();
    for (kind, schema) in schemas() {
        walk("", &schema, &mut |path, node| {
            if node.get("type") == Some(&Value::from("integer")) {
                let bound = |key: &str| node.get(key).and_then(Value::as_f64);
                let (Some(min), Some(max)) = (bound("minimum"), bound("maximum")) else {
                    panic!("{kind} {path}: integer without minimum and maximum: {node}");
                };
                assert!(min <= max, "{kind} {path}");
                // A float64 bound beyond 2^53 is not an exact integer; the
                // apiserver turns 2^63 (i64::MAX as a float) into i64::MIN
                // and refuses every value.
                let exact = 9_007_199_254_740_991.0;
                assert!(
                    min.abs() <= exact && max.abs() <= exact,
                    "{kind} {path}: bounds {min}..{max} beyond 2^53-1"
                );
                integers.push(format!("{kind} {path}"));
            }
        });
    }
    assert!(
        integers.contains(&"EgressPolicy spec.priority".to_owned())
            && integers.contains(&"EgressGateway status.ipUsage.ipv6Total".to_owned()),
        "{integers:#?}"
    );
}

#[test]
fn a_priority_takes_every_int32_and_nothing_else() {
    for (kind, schema) in &schemas()[1..3] {
        let priority = &schema["properties"]["spec"]["properties"]["priority"];
        assert_eq!(
            (priority["minimum"].as_f64(), priority["maximum"].as_f64()),
            (Some(f64::from(i32::MIN)), Some(f64::from(i32::MAX))),
            "{kind}"
        );
    }
}

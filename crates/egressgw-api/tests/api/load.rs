//! Objects from multi-document YAML.

use egressgw_api::{Error, Location, objects_from_yaml};
use egressgw_core::model::{Config, PolicyRef, Snapshot};

const ALL_KINDS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1, labels: {egress: "true"}}
status:
  addresses: [{type: InternalIP, address: 192.168.1.11}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: web-1, namespace: shop, labels: {app: web}}
spec: {nodeName: n1, containers: []}
status: {phase: Running, podIP: 10.244.1.5}
---
apiVersion: v1
kind: Pod
metadata: {name: job-1, labels: {app: job}}
spec: {nodeName: n1, containers: []}
status: {phase: Running, podIP: 10.244.1.6}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata: {name: gw1}
spec:
  nodeSelector: {selector: {matchLabels: {egress: "true"}}}
  ippools: {ipv4: [10.6.1.1-10.6.1.9]}
  clusterDefault: true
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: p1, namespace: shop}
spec:
  appliedTo: {podSelector: {matchLabels: {app: web}}}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressClusterPolicy
metadata: {name: cp1}
spec:
  appliedTo: {podSubnet: [10.244.0.0/16]}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressTunnel
metadata: {name: n1}
spec: {}
---
# an empty document
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
---
# the controller's output: a dump of every egressgw kind has it
apiVersion: egressgw.io/v1alpha1
kind: EgressEndpointSlice
metadata: {name: default-0, namespace: egressgw-system}
spec: {gateway: default}
"#;

#[test]
fn every_kind_loads_and_other_kinds_are_skipped_with_a_note() {
    let objects = objects_from_yaml(ALL_KINDS).unwrap();
    assert_eq!(objects.nodes.len(), 1);
    assert_eq!(objects.namespaces.len(), 1);
    assert_eq!(objects.pods.len(), 2);
    assert_eq!(objects.gateways.len(), 1);
    assert_eq!(objects.policies.len(), 1);
    assert_eq!(objects.cluster_policies.len(), 1);
    assert_eq!(objects.tunnels.len(), 1);
    assert_eq!(objects.skipped.len(), 2);
    assert_eq!(
        objects.skipped[0].to_string(),
        "document 10: skipped v1 Service web: egressgw does not read this kind"
    );
    assert_eq!(
        objects.skipped[1].to_string(),
        "document 11: skipped egressgw.io/v1alpha1 EgressEndpointSlice default-0: egressgw does not read this kind"
    );
}

#[test]
fn a_namespaced_object_without_a_namespace_lands_in_default() {
    let objects = objects_from_yaml(ALL_KINDS).unwrap();
    assert_eq!(
        objects.pods[1].metadata.namespace.as_deref(),
        Some("default")
    );
}

#[test]
fn the_snapshot_of_a_file_holds_every_object_and_the_namespaces_it_implies() {
    let snapshot = objects_from_yaml(ALL_KINDS)
        .unwrap()
        .into_snapshot(Config::default());
    assert_eq!(snapshot.nodes.len(), 1);
    assert!(snapshot.nodes[0].ready);
    assert_eq!(snapshot.pods.len(), 2);
    assert_eq!(snapshot.gateways.len(), 1);
    assert_eq!(
        snapshot
            .policies
            .iter()
            .map(|p| p.id.clone())
            .collect::<Vec<_>>(),
        vec![
            PolicyRef::namespaced("shop", "p1"),
            PolicyRef::cluster("cp1")
        ]
    );
    assert_eq!(snapshot.tunnels.len(), 1);
    let namespaces: Vec<_> = snapshot
        .namespaces
        .iter()
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(namespaces, vec!["shop", "default"]);
    assert_eq!(
        snapshot.namespaces[0]
            .labels
            .get("team")
            .map(String::as_str),
        Some("a")
    );
}

#[test]
fn list_items_load_and_typed_lists_may_leave_out_kind_and_api_version() {
    let text = r#"
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: Namespace, metadata: {name: a}}
- {apiVersion: egressgw.io/v1alpha1, kind: EgressTunnel, metadata: {name: n1}, spec: {}}
---
apiVersion: v1
kind: NodeList
items:
- metadata: {name: n1}
- metadata: {name: n2}
"#;
    let objects = objects_from_yaml(text).unwrap();
    assert_eq!(objects.namespaces.len(), 1);
    assert_eq!(objects.tunnels.len(), 1);
    assert_eq!(objects.nodes.len(), 2);
}

#[test]
fn an_unknown_egressgw_kind_is_an_error_naming_its_document_and_kind() {
    let text = "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n\
                apiVersion: egressgw.io/v1alpha1\nkind: EgressPolicyy\nmetadata: {name: p}\n";
    let err = objects_from_yaml(text).unwrap_err();
    assert!(matches!(
        &err,
        Error::UnknownKind { location: Location { document: 2, item: None }, kind, .. } if kind == "EgressPolicyy"
    ));
    assert!(
        err.to_string()
            .starts_with("document 2: unknown kind EgressPolicyy in egressgw.io/v1alpha1"),
        "{err}"
    );
}

#[test]
fn a_known_kind_at_another_version_is_an_error() {
    let text = "apiVersion: egressgw.io/v1\nkind: EgressPolicy\nmetadata: {name: p}\n";
    assert!(matches!(
        objects_from_yaml(text),
        Err(Error::UnknownKind { .. })
    ));
}

#[test]
fn an_unknown_kind_inside_a_list_names_the_item() {
    let text = "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: a}}\n\
                - {apiVersion: egressgw.io/v1alpha1, kind: Gateway, metadata: {name: g}}\n";
    let err = objects_from_yaml(text).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("document 1, item 1: unknown kind Gateway"),
        "{err}"
    );
}

#[test]
fn a_yaml_syntax_error_names_the_document() {
    let text = "apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\nkind: [unclosed\n";
    let err = objects_from_yaml(text).unwrap_err();
    assert!(matches!(err, Error::Yaml { document: 2, .. }), "{err:?}");
    assert_eq!(err.to_string(), "document 2: invalid YAML");
    assert!(std::error::Error::source(&err).is_some());
}

#[test]
fn an_object_of_the_wrong_shape_names_document_kind_and_name() {
    let text = "apiVersion: egressgw.io/v1alpha1\nkind: EgressGateway\nmetadata: {name: gw1}\n\
                spec: {nodeSelector: {selector: {}}, ippools: {ipv4: 10.0.0.1}}\n";
    let err = objects_from_yaml(text).unwrap_err();
    assert_eq!(
        err.to_string(),
        "document 1: EgressGateway gw1 does not decode"
    );
    let cause = std::error::Error::source(&err)
        .map(ToString::to_string)
        .unwrap_or_default();
    assert!(cause.contains("invalid type"), "{cause}");
}

#[test]
fn a_document_that_is_not_an_object_is_an_error() {
    let err = objects_from_yaml("- just\n- a list\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "document 1: not a Kubernetes object: not a mapping"
    );
    let err = objects_from_yaml("metadata: {name: a}\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "document 1: not a Kubernetes object: no apiVersion and kind"
    );
}

#[test]
fn an_empty_file_holds_no_objects() {
    let objects = objects_from_yaml("").unwrap();
    assert!(objects.nodes.is_empty() && objects.skipped.is_empty());
    let objects = objects_from_yaml("---\n---\n").unwrap();
    assert!(objects.pods.is_empty());
}

const TYPO: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: web, namespace: team-a}
spec:
  appliedTo: {podSelector: {matchLabels: {app: web}}}
  destSubnets: ["203.0.113.0/24"]
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: db, namespace: team-a}
spec:
  appliedTo: {podSelector: {matchLabels: {app: db}}}
  destSubnet: ["198.51.100.0/24"]
"#;

fn snapshot_of(text: &str) -> Snapshot {
    objects_from_yaml(text)
        .expect("the objects load")
        .into_snapshot(Config::default())
}

#[test]
fn a_misspelled_field_is_listed_with_its_document_object_and_path() {
    let objects = objects_from_yaml(TYPO).unwrap();
    assert_eq!(objects.policies.len(), 2);
    let unknown: Vec<String> = objects
        .unknown_fields
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        unknown,
        [
            "document 2: EgressPolicy team-a/web: spec.destSubnets: unknown field (did you mean destSubnet?)"
        ]
    );
}

#[test]
fn a_policy_with_an_unknown_field_is_invalid_and_never_covers_every_destination() {
    let snapshot = snapshot_of(TYPO);
    let planned: Vec<_> = snapshot.policies.iter().map(|p| p.id.clone()).collect();
    assert_eq!(planned, [PolicyRef::namespaced("team-a", "db")]);
    assert_eq!(snapshot.invalid.len(), 1);
    assert_eq!(
        (
            snapshot.invalid[0].kind.as_str(),
            snapshot.invalid[0].name.as_str()
        ),
        ("EgressPolicy", "web")
    );
    assert_eq!(
        snapshot.invalid[0].errors,
        ["spec.destSubnets: unknown field (did you mean destSubnet?)"]
    );
}

#[test]
fn unknown_fields_come_before_the_validation_errors_of_the_same_object() {
    let text = "apiVersion: egressgw.io/v1alpha1\nkind: EgressClusterPolicy\nmetadata: {name: cp}\n\
                spec: {appliedTo: {podSubnet: [10.244.0.0/33]}, priorty: 5}\n";
    let snapshot = snapshot_of(text);
    assert!(snapshot.policies.is_empty());
    assert_eq!(snapshot.invalid.len(), 1);
    let errors = &snapshot.invalid[0].errors;
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_eq!(
        errors[0],
        "spec.priorty: unknown field (did you mean priority?)"
    );
    assert!(
        errors[1].starts_with("spec.appliedTo.podSubnet[0]"),
        "{errors:?}"
    );
}

#[test]
fn a_gateway_with_an_unknown_field_stays_known_but_invalid() {
    let text = "apiVersion: egressgw.io/v1alpha1\nkind: EgressGateway\nmetadata: {name: gw}\n\
                spec: {nodeSelector: {selector: {}}, ippools: {ipv4: [10.6.1.1], ipv4DefaultEip: 10.6.1.1}}\n";
    let snapshot = snapshot_of(text);
    assert_eq!(snapshot.gateways.len(), 1);
    assert_eq!(
        snapshot.gateways[0].errors,
        ["spec.ippools.ipv4DefaultEip: unknown field (did you mean ipv4DefaultEIP?)"]
    );
    assert!(snapshot.invalid.is_empty());
}

#[test]
fn a_tunnel_with_an_unknown_field_in_its_empty_spec_is_invalid() {
    let text = "apiVersion: egressgw.io/v1alpha1\nkind: EgressTunnel\nmetadata: {name: n1}\nspec: {node: n1}\n";
    let snapshot = snapshot_of(text);
    assert!(snapshot.tunnels.is_empty());
    assert_eq!(snapshot.invalid[0].errors, ["spec.node: unknown field"]);
}

#[test]
fn a_misspelled_required_field_is_named_in_the_decode_error() {
    let text = "apiVersion: egressgw.io/v1alpha1\nkind: EgressPolicy\nmetadata: {name: p, namespace: a}\n\
                spec: {appliedTO: {podSubnet: [10.244.0.0/16]}}\n";
    let err = objects_from_yaml(text).unwrap_err();
    assert_eq!(
        err.to_string(),
        "document 1: EgressPolicy p does not decode (spec.appliedTO: unknown field (did you mean appliedTo?))"
    );
}

#[test]
fn a_kubectl_dump_with_server_fields_and_status_loads_without_unknown_fields() {
    let text = r#"
apiVersion: v1
kind: List
items:
- apiVersion: egressgw.io/v1alpha1
  kind: EgressPolicy
  metadata:
    name: web
    namespace: team-a
    uid: 6f1c0c3e-8f5e-4a43-9d0a-0b7d6a9f1e11
    resourceVersion: "4711"
    generation: 2
    creationTimestamp: "2025-01-01T00:00:00Z"
    annotations: {kubectl.kubernetes.io/last-applied-configuration: "{}"}
    finalizers: [egressgw.io/cleanup]
    managedFields:
    - apiVersion: egressgw.io/v1alpha1
      fieldsType: FieldsV1
      fieldsV1: {"f:spec": {"f:appliedTo": {}}}
      manager: kubectl-client-side-apply
      operation: Update
      time: "2025-01-01T00:00:00Z"
  spec:
    appliedTo: {podSelector: {matchLabels: {app: web}}}
    egressIP: {allocatorPolicy: default, useNodeIP: false}
    priority: 0
  status:
    eip: {ipv4: 10.6.1.1}
    node: node-1
    conditions:
    - {type: Ready, status: "True", reason: Ready, message: "", lastTransitionTime: "2025-01-01T00:00:00Z"}
"#;
    let objects = objects_from_yaml(text).unwrap();
    assert_eq!(objects.policies.len(), 1);
    assert!(
        objects.unknown_fields.is_empty(),
        "{:?}",
        objects.unknown_fields
    );
}

#[test]
fn every_example_loads_without_unknown_fields() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples");
    let mut files = vec![];
    for dir in [examples.clone(), examples.join("lab")] {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    assert!(files.len() >= 4, "{files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let objects = objects_from_yaml(&text).unwrap();
        assert!(
            objects.unknown_fields.is_empty(),
            "{}: {:?}",
            path.display(),
            objects.unknown_fields
        );
    }
}

#[test]
fn a_priority_no_int32_holds_is_named_in_the_decode_error_as_admission_names_it() {
    let text = "apiVersion: egressgw.io/v1alpha1\nkind: EgressPolicy\nmetadata: {name: p, namespace: a}\n\
                spec: {appliedTo: {podSelector: {}}, priority: 99999999999}\n";
    let err = objects_from_yaml(text).unwrap_err();
    assert_eq!(
        err.to_string(),
        "document 1: EgressPolicy p does not decode (spec.priority: 99999999999 is out of range: must be between -2147483648 and 2147483647)"
    );
}

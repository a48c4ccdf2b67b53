//! Objects from multi-document YAML.

use egressgw_api::{Error, Location, objects_from_yaml};
use egressgw_core::model::{Config, PolicyRef};

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
    assert_eq!(objects.skipped.len(), 1);
    assert_eq!(
        objects.skipped[0].to_string(),
        "document 10: skipped v1 Service web: egressgw does not read this kind"
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

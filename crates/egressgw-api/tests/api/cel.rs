//! The CRDs' CEL rules, evaluated client-side with Kubernetes' CEL
//! libraries: every admission rule on a passing and a failing object.

use egressgw_api::tunnel::parse_mark;
use egressgw_api::{EgressClusterPolicy, EgressGateway, EgressPolicy, EgressTunnel};
use kube::CustomResourceExt;
use kube::core::cel::{ErrorKind, Validator};
use serde_json::{Value, json};

fn schema<K: CustomResourceExt>() -> Value {
    let crd = K::crd();
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("every CRD has an openAPIV3Schema");
    serde_json::to_value(schema).expect("schema serializes")
}

/// `path: message` of every failed rule; panics on a rule that does not
/// compile or evaluate, which admission would reject the same way.
fn failures<K: CustomResourceExt>(object: &Value, old: Option<&Value>) -> Vec<String> {
    match Validator::new().validate(&schema::<K>(), object, old) {
        Ok(()) => Vec::new(),
        Err(errors) => errors
            .into_vec()
            .into_iter()
            .map(|e| {
                assert_eq!(
                    e.kind,
                    ErrorKind::ValidationFailure,
                    "rule did not evaluate: {e:?}"
                );
                format!("{}: {}", e.field_path, e.message)
            })
            .collect(),
    }
}

fn object(kind: &str, spec: Value) -> Value {
    let mut object = json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": "default"},
    });
    object["spec"] = spec;
    object
}

fn gateway_failures(ippools: Value) -> Vec<String> {
    let mut spec = json!({"nodeSelector": {"selector": {}}});
    spec["ippools"] = ippools;
    failures::<EgressGateway>(&object("EgressGateway", spec), None)
}

fn policy(spec: Value) -> Value {
    object("EgressPolicy", spec)
}

fn policy_failures(spec: Value) -> Vec<String> {
    failures::<EgressPolicy>(&policy(spec), None)
}

const ENTRY_V4: &str = "spec.ippools.ipv4: each entry must be an IPv4 address, a range a-b of IPv4 addresses or an IPv4 CIDR, without spaces";
const ENTRY_V6: &str = "spec.ippools.ipv6: each entry must be an IPv6 address, a range a-b of IPv6 addresses or an IPv6 CIDR, without spaces";

#[test]
fn addresses_ranges_and_cidrs_of_the_right_family_are_admitted() {
    assert_eq!(
        gateway_failures(json!({
            "ipv4": ["10.6.1.55", "10.6.1.60-10.6.1.65", "10.6.1.70-10.6.1.80", "10.6.2.0/28"],
            "ipv6": ["fd00::1", "fd00::10-fd00::20", "fd01::/120"],
            "ipv4DefaultEIP": "10.6.1.75",
            "ipv6DefaultEIP": "fd01::5",
        })),
        Vec::<String>::new()
    );
}

#[test]
fn malformed_and_wrong_family_pool_entries_are_refused_at_admission() {
    let failures = gateway_failures(json!({
        "ipv4": ["10.0.0.300", "fd00::1", "10.0.0.1-fd00::2", "::ffff:10.0.0.1", " 10.0.0.1", "10.0.0.1-10.0.0.2-10.0.0.3"],
        "ipv6": ["10.0.0.1", "fd00::/129"],
    }));
    let expected: Vec<String> = (0..6)
        .map(|i| format!("spec.ippools.ipv4[{i}]: {ENTRY_V4}"))
        .chain((0..2).map(|i| format!("spec.ippools.ipv6[{i}]: {ENTRY_V6}")))
        .collect();
    assert_eq!(sorted(failures), sorted(expected));
}

#[test]
fn whitespace_anywhere_in_a_pool_entry_is_refused_at_admission() {
    let failures = gateway_failures(json!({
        "ipv4": [" 10.6.1.60-10.6.1.65", "10.6.1.60 - 10.6.1.65", "10.6.1.60-10.6.1.65 ", "10.6.2.0/28 ", "10.6.1.55\t"],
        "ipv6": ["fd00::1 -fd00::2", " fd01::/120"],
    }));
    let expected: Vec<String> = (0..5)
        .map(|i| format!("spec.ippools.ipv4[{i}]: {ENTRY_V4}"))
        .chain((0..2).map(|i| format!("spec.ippools.ipv6[{i}]: {ENTRY_V6}")))
        .collect();
    assert_eq!(sorted(failures), sorted(expected));
}

#[test]
fn whitespace_in_a_default_eip_egress_ip_subnet_or_tunnel_address_is_refused_at_admission() {
    assert_eq!(
        sorted(gateway_failures(json!({
            "ipv4": ["10.0.0.1"], "ipv4DefaultEIP": "10.0.0.1 ",
            "ipv6": ["fd00::1"], "ipv6DefaultEIP": " fd00::1",
        }))),
        vec![
            "spec.ippools.ipv4DefaultEIP: spec.ippools.ipv4DefaultEIP: must be an IPv4 address",
            "spec.ippools.ipv6DefaultEIP: spec.ippools.ipv6DefaultEIP: must be an IPv6 address",
        ]
    );
    assert_eq!(
        sorted(policy_failures(json!({
            "egressIP": {"ipv4": " 10.0.0.1", "ipv6": "fd00:: 1"},
            "appliedTo": {"podSubnet": ["10.244.0.0/16 "]},
            "destSubnet": [" 0.0.0.0/0"],
            "excludeSubnet": ["10.0.0.0 /8"],
        }))),
        vec![
            "spec.appliedTo.podSubnet[0]: spec.appliedTo.podSubnet: each entry must be a CIDR (address/length)",
            "spec.destSubnet[0]: spec.destSubnet: each entry must be a CIDR (address/length)",
            "spec.egressIP.ipv4: spec.egressIP.ipv4: must be an IPv4 address",
            "spec.egressIP.ipv6: spec.egressIP.ipv6: must be an IPv6 address",
            "spec.excludeSubnet[0]: spec.excludeSubnet: each entry must be a CIDR (address/length)",
        ]
    );
    let mut tunnel = object("EgressTunnel", json!({}));
    tunnel["status"] = json!({
        "tunnel": {"ipv4": "172.31.0.1 ", "parent": {"name": "eth0", "ipv4": " 192.168.1.10"}},
    });
    assert_eq!(
        failures::<EgressTunnel>(&tunnel, None),
        vec![
            "status.tunnel.ipv4: status.tunnel.ipv4: must be an IPv4 address",
            "status.tunnel.parent.ipv4: status.tunnel.parent.ipv4: must be an IPv4 address",
        ]
    );
}

/// Whether admission and `validate()` both admit (`true`) or both refuse
/// (`false`) a gateway with `ipv4` as its only pool entry; panics when they
/// disagree.
fn pool_entry_verdict(entry: &str) -> bool {
    let spec = json!({"nodeSelector": {"selector": {}}, "ippools": {"ipv4": [entry]}});
    let admitted =
        failures::<EgressGateway>(&object("EgressGateway", spec.clone()), None).is_empty();
    let parsed: egressgw_api::EgressGatewaySpec =
        serde_json::from_value(spec).expect("the spec decodes");
    let valid = parsed.validate().is_ok();
    assert_eq!(
        admitted, valid,
        "admission and validate() disagree on {entry:?}"
    );
    admitted
}

#[test]
fn admission_and_validate_agree_on_pool_entries_with_and_without_whitespace() {
    for entry in [
        "10.6.1.55",
        "10.6.1.60-10.6.1.65",
        "10.6.1.64/28",
        "10.6.1.60-10.6.1.60",
    ] {
        assert!(pool_entry_verdict(entry), "{entry:?}");
    }
    for entry in [
        " 10.6.1.60-10.6.1.65",
        "10.6.1.60-10.6.1.65 ",
        "10.6.1.60 -10.6.1.65",
        "10.6.1.60- 10.6.1.65",
        "10.6.1.60 - 10.6.1.65",
        "\t10.6.1.55",
        "10.6.1.55\n",
        "10.6.1.64 /28",
        "10.6.1.64/ 28",
        " 10.6.1.64/28",
        "10.6.1.65-10.6.1.60",
        "10.6.1.60-10.6.1.65-10.6.1.70",
        "10.6.1.1/24",
        "fd00::1",
        "",
    ] {
        assert!(!pool_entry_verdict(entry), "{entry:?}");
    }
}

#[test]
fn a_pool_cidr_with_host_bits_is_refused_at_admission() {
    assert_eq!(
        gateway_failures(json!({"ipv4": ["10.0.0.1/24"], "ipv6": ["fd00::1/64"]})),
        vec![
            "spec.ippools.ipv4[0]: spec.ippools.ipv4: a CIDR must not have host bits set (write the network address, e.g. 10.0.0.0/24)",
            "spec.ippools.ipv6[0]: spec.ippools.ipv6: a CIDR must not have host bits set (write the network address, e.g. 10.0.0.0/24)",
        ]
    );
}

#[test]
fn a_reversed_ipv4_range_is_refused_at_admission() {
    assert_eq!(
        gateway_failures(
            json!({"ipv4": ["10.0.0.1-10.0.0.1", "10.0.0.9-10.0.0.1", "9.255.255.255-10.0.0.0"]})
        ),
        vec![
            "spec.ippools.ipv4[1]: spec.ippools.ipv4: a range a-b must not be reversed: b must not be lower than a"
        ]
    );
}

#[test]
fn a_reversed_ipv6_range_passes_admission_and_is_left_to_the_controller() {
    assert_eq!(
        gateway_failures(json!({"ipv6": ["fd00::9-fd00::1"]})),
        Vec::<String>::new()
    );
}

#[test]
fn a_default_eip_outside_its_pool_is_refused_at_admission() {
    assert_eq!(
        gateway_failures(json!({
            "ipv4": ["10.0.0.1-10.0.0.9", "10.1.0.0/24", "10.2.0.1"],
            "ipv4DefaultEIP": "10.0.0.10",
            "ipv6": ["fd00::/120"],
            "ipv6DefaultEIP": "fd00::1:1",
        })),
        vec![
            "spec.ippools: spec.ippools.ipv4DefaultEIP: must be an address of spec.ippools.ipv4",
            "spec.ippools: spec.ippools.ipv6DefaultEIP: must be an address of spec.ippools.ipv6",
        ]
    );
}

#[test]
fn a_default_eip_in_a_range_a_cidr_or_equal_to_an_entry_is_admitted() {
    for default in ["10.0.0.1", "10.0.0.9", "10.1.0.255", "10.2.0.1"] {
        assert_eq!(
            gateway_failures(json!({
                "ipv4": ["10.0.0.1-10.0.0.9", "10.1.0.0/24", "10.2.0.1"],
                "ipv4DefaultEIP": default,
            })),
            Vec::<String>::new(),
            "{default}"
        );
    }
}

#[test]
fn a_default_eip_without_a_pool_or_of_the_wrong_family_is_refused() {
    assert_eq!(
        sorted(gateway_failures(
            json!({"ipv4DefaultEIP": "fd00::1", "ipv6DefaultEIP": "fd00::1"})
        )),
        vec![
            "spec.ippools.ipv4DefaultEIP: spec.ippools.ipv4DefaultEIP: must be an IPv4 address",
            "spec.ippools: spec.ippools.ipv6DefaultEIP: must be an address of spec.ippools.ipv6",
        ]
    );
}

#[test]
fn an_in_expression_without_values_is_refused_in_every_selector() {
    let expressions = json!({"matchExpressions": [
        {"key": "a", "operator": "In"},
        {"key": "b", "operator": "Exists", "values": ["x"]},
        {"key": "c", "operator": "NotIn", "values": ["x"]},
        {"key": "d", "operator": "DoesNotExist"},
    ]});
    let gateway = object(
        "EgressGateway",
        json!({"nodeSelector": {"selector": expressions}}),
    );
    let message = "spec.nodeSelector.selector.matchExpressions: In and NotIn need values; Exists and DoesNotExist take none";
    assert_eq!(
        failures::<EgressGateway>(&gateway, None),
        vec![
            format!("spec.nodeSelector.selector.matchExpressions[0]: {message}"),
            format!("spec.nodeSelector.selector.matchExpressions[1]: {message}"),
        ]
    );
    let cluster = object(
        "EgressClusterPolicy",
        json!({"appliedTo": {"podSelector": {}, "namespaceSelector": expressions}}),
    );
    assert_eq!(failures::<EgressClusterPolicy>(&cluster, None).len(), 2);
}

#[test]
fn a_complete_policy_is_admitted() {
    assert_eq!(
        policy_failures(json!({
            "egressGatewayName": "gw1",
            "egressIP": {"ipv4": "10.6.1.55", "ipv6": "fd00::1", "allocatorPolicy": "rr"},
            "appliedTo": {"podSelector": {"matchLabels": {"app": "web"}}},
            "destSubnet": ["0.0.0.0/0", "fd00::/8"],
            "excludeSubnet": ["10.0.0.0/8"],
            "priority": 10,
        })),
        Vec::<String>::new()
    );
}

#[test]
fn a_malformed_or_wrong_family_egress_ip_is_refused_at_admission() {
    assert_eq!(
        policy_failures(json!({
            "egressIP": {"ipv4": "10.0.0.300", "ipv6": "10.0.0.1"},
            "appliedTo": {"podSelector": {}},
        })),
        vec![
            "spec.egressIP.ipv4: spec.egressIP.ipv4: must be an IPv4 address",
            "spec.egressIP.ipv6: spec.egressIP.ipv6: must be an IPv6 address",
        ]
    );
}

#[test]
fn use_node_ip_with_an_explicit_ip_is_refused_at_admission() {
    assert_eq!(
        policy_failures(json!({
            "egressIP": {"ipv6": "fd00::1", "useNodeIP": true},
            "appliedTo": {"podSelector": {}},
        })),
        vec!["spec.egressIP: spec.egressIP: useNodeIP cannot be combined with ipv4/ipv6"]
    );
    assert_eq!(
        policy_failures(json!({
            "egressIP": {"ipv4": "", "useNodeIP": true},
            "appliedTo": {"podSelector": {}},
        })),
        Vec::<String>::new()
    );
}

#[test]
fn both_or_neither_pod_selector_and_pod_subnet_is_refused_at_admission() {
    let message = "spec.appliedTo: spec.appliedTo: set exactly one of podSelector and podSubnet";
    assert_eq!(
        policy_failures(json!({"appliedTo": {"podSelector": {}, "podSubnet": ["10.0.0.0/8"]}})),
        vec![message]
    );
    assert_eq!(policy_failures(json!({"appliedTo": {}})), vec![message]);
}

#[test]
fn malformed_subnets_are_refused_at_admission() {
    assert_eq!(
        policy_failures(json!({
            "appliedTo": {"podSubnet": ["10.244.1.1"]},
            "destSubnet": ["192.168.1.1/24"],
            "excludeSubnet": ["::ffff:10.0.0.0/104"],
        })),
        vec![
            "spec.appliedTo.podSubnet[0]: spec.appliedTo.podSubnet: each entry must be a CIDR (address/length)",
            "spec.destSubnet[0]: spec.destSubnet: a CIDR must not have host bits set (write the network address, e.g. 10.0.0.0/24)",
            "spec.excludeSubnet[0]: spec.excludeSubnet: each entry must be a CIDR (address/length)",
        ]
    );
}

#[test]
fn the_egress_ip_of_a_policy_cannot_change() {
    let old = policy(json!({"egressIP": {"ipv4": "10.0.0.1"}, "appliedTo": {"podSelector": {}}}));
    let new = policy(json!({"egressIP": {"ipv4": "10.0.0.2"}, "appliedTo": {"podSelector": {}}}));
    assert_eq!(
        failures::<EgressPolicy>(&new, Some(&old)),
        vec![
            "spec.egressIP: spec.egressIP: is immutable; create a new policy to change the egress IP"
        ]
    );
}

#[test]
fn the_gateway_of_a_policy_cannot_change_even_from_the_default() {
    let old = policy(json!({"appliedTo": {"podSelector": {}}}));
    let new = policy(json!({"egressGatewayName": "gw2", "appliedTo": {"podSelector": {}}}));
    assert_eq!(
        failures::<EgressPolicy>(&new, Some(&old)),
        vec![
            "spec: spec.egressGatewayName: is immutable; create a new policy to use another gateway"
        ]
    );
    let empty = policy(json!({"egressGatewayName": "", "appliedTo": {"podSelector": {}}}));
    assert_eq!(
        failures::<EgressPolicy>(&empty, Some(&old)),
        Vec::<String>::new()
    );
}

#[test]
fn a_policy_cannot_switch_between_pod_selector_and_pod_subnet_but_may_edit_either() {
    let old = policy(json!({"appliedTo": {"podSelector": {"matchLabels": {"app": "a"}}}}));
    let edited =
        policy(json!({"appliedTo": {"podSelector": {"matchLabels": {"app": "b"}}}, "priority": 3}));
    assert_eq!(
        failures::<EgressPolicy>(&edited, Some(&old)),
        Vec::<String>::new()
    );
    let switched = policy(json!({"appliedTo": {"podSubnet": ["10.0.0.0/8"]}}));
    assert_eq!(
        failures::<EgressPolicy>(&switched, Some(&old)),
        vec![
            "spec.appliedTo: spec.appliedTo: cannot switch between podSelector and podSubnet; create a new policy instead"
        ]
    );
}

#[test]
fn a_tunnel_status_with_addresses_of_the_wrong_family_is_refused() {
    let mut tunnel = object("EgressTunnel", json!({}));
    tunnel["status"] = json!({
        "tunnel": {"ipv4": "fd00::1", "ipv6": "fd00::1", "mac": "66:0a:1b:2c:3d:4e",
                   "parent": {"name": "eth0", "ipv4": "192.168.1.10", "ipv6": "192.168.1.10"}},
        "mark": "0x01000000",
        "phase": "Ready",
    });
    assert_eq!(
        failures::<EgressTunnel>(&tunnel, None),
        vec![
            "status.tunnel.ipv4: status.tunnel.ipv4: must be an IPv4 address",
            "status.tunnel.parent.ipv6: status.tunnel.parent.ipv6: must be an IPv6 address",
        ]
    );
}

/// The `pattern` of `status.mark` in the EgressTunnel CRD.
fn mark_pattern() -> String {
    schema::<EgressTunnel>()["properties"]["status"]["properties"]["mark"]["pattern"]
        .as_str()
        .expect("status.mark has a pattern")
        .to_owned()
}

#[test]
fn parse_mark_accepts_exactly_what_the_crd_pattern_accepts() {
    let pattern = mark_pattern();
    let matcher = json!({
        "type": "string",
        "x-kubernetes-validations": [{"rule": format!("self.matches('{pattern}')"), "message": "no match"}],
    });
    let alphabet = ["0", "9", "a", "f", "g", "A", "F", "+", "-", " ", "x"];
    let mut tails = vec![String::new()];
    let mut checked = 0;
    for _ in 0..3 {
        tails = tails
            .iter()
            .flat_map(|t| alphabet.iter().map(move |a| format!("{t}{a}")))
            .collect();
        for tail in &tails {
            for s in [
                format!("0x{tail}"),
                format!("0x0100000{tail}"),
                format!("+0x{tail}"),
            ] {
                let matches = Validator::new().validate(&matcher, &json!(s), None).is_ok();
                assert_eq!(parse_mark(&s).is_some(), matches, "{s:?} against {pattern}");
                checked += 1;
            }
        }
    }
    assert!(checked > 4000, "{checked}");
    assert_eq!(parse_mark("0x+1"), None);
    assert_eq!(parse_mark("0xffffffff"), Some(u32::MAX));
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

const KEY_RULE: &str = "an optional prefix (a lowercase DNS subdomain of at most 253 characters) and '/', then a name of 1 to 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or digit";
const VALUE_RULE: &str = "empty, or 1 to 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or digit";

#[test]
fn bad_label_syntax_is_refused_at_admission_in_every_selector() {
    let bad = json!({"matchLabels": {"app web!": "x/y/z"}});
    // The value's path is the client-side validator's; the apiserver
    // writes `matchLabels[app web!]`, as `validate()` does.
    let labels = |path: &str| {
        vec![
            format!(
                "{path}.matchLabels.app web!: {path}.matchLabels: every value must be a label value: {VALUE_RULE}"
            ),
            format!(
                "{path}.matchLabels: {path}.matchLabels: every key must be a label key: {KEY_RULE}"
            ),
        ]
    };
    assert_eq!(
        sorted(policy_failures(json!({"appliedTo": {"podSelector": bad}}))),
        labels("spec.appliedTo.podSelector")
    );
    let cluster = object(
        "EgressClusterPolicy",
        json!({"appliedTo": {"podSelector": {}, "namespaceSelector": bad}}),
    );
    assert_eq!(
        sorted(failures::<EgressClusterPolicy>(&cluster, None)),
        labels("spec.appliedTo.namespaceSelector")
    );
    let gateway = object("EgressGateway", json!({"nodeSelector": {"selector": bad}}));
    assert_eq!(
        sorted(failures::<EgressGateway>(&gateway, None)),
        labels("spec.nodeSelector.selector")
    );
}

#[test]
fn a_requirement_with_a_bad_key_or_value_is_refused_at_admission() {
    let expressions = json!({"matchExpressions": [
        {"key": "a/b/c", "operator": "Exists"},
        {"key": "tier", "operator": "In", "values": ["ok", "not ok"]},
    ]});
    let path = "spec.appliedTo.podSelector.matchExpressions";
    assert_eq!(
        sorted(policy_failures(
            json!({"appliedTo": {"podSelector": expressions}})
        )),
        vec![
            format!("{path}[0].key: {path}.key: must be a label key: {KEY_RULE}"),
            format!(
                "{path}[1].values[1]: {path}.values: every value must be a label value: {VALUE_RULE}"
            ),
        ]
    );
}

/// Whether admission and `validate()` both admit (`true`) or both refuse
/// (`false`) `key` as a label key, in `matchLabels` and in a requirement;
/// panics when they disagree.
fn label_key_verdict(key: &str) -> bool {
    let spec = json!({"appliedTo": {"podSelector": {
        "matchLabels": {key: "x"},
        "matchExpressions": [{"key": key, "operator": "Exists"}],
    }}});
    verdict(&spec, &format!("key {key:?}"))
}

/// Like [`label_key_verdict`], for `value` as a label value.
fn label_value_verdict(value: &str) -> bool {
    let spec = json!({"appliedTo": {"podSelector": {
        "matchLabels": {"app": value},
        "matchExpressions": [{"key": "app", "operator": "In", "values": [value]}],
    }}});
    verdict(&spec, &format!("value {value:?}"))
}

/// Whether admission (the CEL rules; `minLength`/`maxLength` are not CEL
/// and the tables stay within them) and `validate()` agree on `spec`.
fn verdict(spec: &Value, what: &str) -> bool {
    let admitted = policy_failures(spec.clone()).is_empty();
    let parsed: egressgw_api::EgressPolicySpec =
        serde_json::from_value(spec.clone()).expect("the spec decodes");
    let valid = parsed.validate().is_ok();
    assert_eq!(
        admitted, valid,
        "admission and validate() disagree on {what}"
    );
    admitted
}

#[test]
fn admission_and_validate_agree_on_label_keys() {
    let labels = vec!["a".repeat(63); 4].join(".");
    let prefix_253 = format!("{}/app", &labels[..253]);
    let prefix_254 = format!("{}/app", &labels[..254]);
    let name_63 = format!("a{}z", "-".repeat(61));
    let name_64 = format!("a{}z", "-".repeat(62));
    for key in [
        "app",
        "A",
        "9",
        "App.Name_2-x",
        "kubernetes.io/hostname",
        "node-role.kubernetes.io/control-plane",
        "0-x.y/Z",
        &name_63,
        &prefix_253,
    ] {
        assert!(label_key_verdict(key), "{key:?} should be admitted");
    }
    for key in [
        "app web!",
        " app",
        "app ",
        "-app",
        "app-",
        "_app",
        "app.",
        "ä",
        "a/b/c",
        "/app",
        "example.com/",
        "Example.com/app",
        "example_com/app",
        "example..com/app",
        "example.com-/app",
        "example.com/-app",
        "app=web",
        &name_64,
        &prefix_254,
    ] {
        assert!(!label_key_verdict(key), "{key:?} should be refused");
    }
}

#[test]
fn admission_and_validate_agree_on_label_values() {
    let value_63 = format!("a{}z", "_".repeat(61));
    let value_64 = format!("a{}z", "_".repeat(62));
    for value in ["", "web", "x", "9", "v1.2.3", "Web_App-2", &value_63] {
        assert!(label_value_verdict(value), "{value:?} should be admitted");
    }
    for value in [
        "x/y/z", " ", "web ", " web", "-web", "web-", ".web", "web.", "_web", "a b", "web!", "ü",
        "a:b", &value_64,
    ] {
        assert!(!label_value_verdict(value), "{value:?} should be refused");
    }
}

//! `validate()` on every spec: one test per rule.

use crate::fixtures::{GATEWAY, cluster_policy_spec, gateway_spec, messages, policy_spec};

fn gateway_errors(yaml: &str) -> Vec<String> {
    messages(gateway_spec(yaml).validate())
}

fn policy_errors(yaml: &str) -> Vec<String> {
    messages(policy_spec(yaml).validate())
}

fn pools(ipv4: &str, ipv6: &str) -> String {
    format!("nodeSelector: {{selector: {{}}}}\nippools: {{ipv4: {ipv4}, ipv6: {ipv6}}}\n")
}

#[test]
fn a_gateway_with_addresses_ranges_and_cidrs_is_valid() {
    assert_eq!(gateway_errors(GATEWAY), Vec::<String>::new());
}

#[test]
fn a_malformed_pool_entry_is_rejected_with_its_index() {
    assert_eq!(
        gateway_errors(&pools(r#"["10.0.0.1", "10.0.0.300"]"#, "[]")),
        vec![r#"spec.ippools.ipv4[1]: "10.0.0.300" is not an IP, a range (a-b) or a CIDR"#]
    );
}

#[test]
fn a_reversed_range_in_the_pool_is_rejected_with_its_index() {
    assert_eq!(
        gateway_errors(&pools(r#"["10.0.0.1", "10.0.0.9-10.0.0.1"]"#, "[]")),
        vec![
            r#"spec.ippools.ipv4[1]: range "10.0.0.9-10.0.0.1" is reversed: its end is lower than its start"#
        ]
    );
}

#[test]
fn a_reversed_ipv6_range_is_rejected_though_admission_cannot_order_it() {
    assert_eq!(
        gateway_errors(&pools("[]", r#"["fd00::9-fd00::1"]"#)),
        vec![
            r#"spec.ippools.ipv6[0]: range "fd00::9-fd00::1" is reversed: its end is lower than its start"#
        ]
    );
}

#[test]
fn an_address_of_the_other_family_in_a_pool_is_rejected() {
    assert_eq!(
        gateway_errors(&pools(r#"["fd00::1"]"#, r#"["10.0.0.0/24"]"#)),
        vec![
            r#"spec.ippools.ipv4[0]: "fd00::1" is not ipv4"#,
            r#"spec.ippools.ipv6[0]: "10.0.0.0/24" is not ipv6"#,
        ]
    );
}

#[test]
fn a_range_mixing_families_is_rejected() {
    assert_eq!(
        gateway_errors(&pools(r#"["10.0.0.1-fd00::1"]"#, "[]")),
        vec![r#"spec.ippools.ipv4[0]: range "10.0.0.1-fd00::1" mixes IPv4 and IPv6"#]
    );
}

#[test]
fn a_pool_cidr_with_host_bits_names_the_network_it_meant() {
    assert_eq!(
        gateway_errors(&pools(r#"["10.0.0.1/24"]"#, "[]")),
        vec![r#"spec.ippools.ipv4[0]: "10.0.0.1/24" has host bits set; did you mean 10.0.0.0/24?"#]
    );
}

#[test]
fn an_ipv4_mapped_ipv6_address_is_rejected_as_admission_does() {
    assert_eq!(
        gateway_errors(&pools("[]", r#"["::ffff:10.0.0.1"]"#)),
        vec![
            r#"spec.ippools.ipv6[0]: "::ffff:10.0.0.1" is an IPv4-mapped IPv6 address; write the IPv4 address instead"#
        ]
    );
}

#[test]
fn a_pool_entry_with_whitespace_anywhere_is_rejected_as_admission_does() {
    assert_eq!(
        gateway_errors(&pools(
            r#"[" 10.6.1.60-10.6.1.65", "10.0.0.5 - 10.0.0.7", "10.0.1.0/28 "]"#,
            r#"["fd00::1 -fd00::2"]"#
        )),
        vec![
            r#"spec.ippools.ipv4[0]: " 10.6.1.60-10.6.1.65" contains whitespace; write it without spaces"#,
            r#"spec.ippools.ipv4[1]: "10.0.0.5 - 10.0.0.7" contains whitespace; write it without spaces"#,
            r#"spec.ippools.ipv4[2]: "10.0.1.0/28 " contains whitespace; write it without spaces"#,
            r#"spec.ippools.ipv6[0]: "fd00::1 -fd00::2" contains whitespace; write it without spaces"#,
        ]
    );
}

#[test]
fn whitespace_in_a_default_eip_egress_ip_or_subnet_is_rejected_as_admission_does() {
    assert_eq!(
        gateway_errors(
            "nodeSelector: {selector: {}}\nippools: {ipv4: ['10.0.0.1'], ipv4DefaultEIP: ' 10.0.0.1'}\n"
        ),
        vec![
            r#"spec.ippools.ipv4DefaultEIP: " 10.0.0.1" contains whitespace; write it without spaces"#
        ]
    );
    assert_eq!(
        policy_errors(
            "egressIP: {ipv4: '10.0.0.1 ', ipv6: 'fd00:: 1'}\n\
             appliedTo: {podSubnet: ['10.244.0.0/16 ']}\n\
             destSubnet: [' 0.0.0.0/0']\n\
             excludeSubnet: ['10.0.0.0 /8']\n"
        ),
        vec![
            r#"spec.egressIP.ipv4: "10.0.0.1 " contains whitespace; write it without spaces"#,
            r#"spec.egressIP.ipv6: "fd00:: 1" contains whitespace; write it without spaces"#,
            r#"spec.appliedTo.podSubnet[0]: "10.244.0.0/16 " contains whitespace; write it without spaces"#,
            r#"spec.destSubnet[0]: " 0.0.0.0/0" contains whitespace; write it without spaces"#,
            r#"spec.excludeSubnet[0]: "10.0.0.0 /8" contains whitespace; write it without spaces"#,
        ]
    );
}

#[test]
fn a_default_eip_outside_its_pool_is_rejected() {
    assert_eq!(
        gateway_errors(
            "nodeSelector: {selector: {}}\nippools: {ipv4: ['10.0.0.1-10.0.0.9'], ipv4DefaultEIP: 10.0.0.99}\n"
        ),
        vec!["spec.ippools.ipv4DefaultEIP: 10.0.0.99 is not in spec.ippools.ipv4"]
    );
}

#[test]
fn a_default_eip_without_a_pool_is_rejected() {
    assert_eq!(
        gateway_errors("nodeSelector: {selector: {}}\nippools: {ipv6DefaultEIP: 'fd00::1'}\n"),
        vec!["spec.ippools.ipv6DefaultEIP: fd00::1 is not in spec.ippools.ipv6"]
    );
}

#[test]
fn a_default_eip_of_the_wrong_family_is_rejected() {
    assert_eq!(
        gateway_errors(
            "nodeSelector: {selector: {}}\nippools: {ipv4: ['10.0.0.1'], ipv4DefaultEIP: 'fd00::1'}\n"
        ),
        vec![r#"spec.ippools.ipv4DefaultEIP: "fd00::1" is not ipv4"#]
    );
}

#[test]
fn an_empty_default_eip_means_unset() {
    assert_eq!(
        gateway_errors(
            "nodeSelector: {selector: {}}\nippools: {ipv4: ['10.0.0.1'], ipv4DefaultEIP: ''}\n"
        ),
        Vec::<String>::new()
    );
}

#[test]
fn an_unknown_node_selector_operator_is_rejected_with_its_path() {
    assert_eq!(
        gateway_errors(
            "nodeSelector: {selector: {matchExpressions: [{key: zone, operator: Equals, values: [a]}]}}\n"
        ),
        vec![
            r#"spec.nodeSelector.selector.matchExpressions[0].operator: "Equals" is not one of In, NotIn, Exists, DoesNotExist"#
        ]
    );
}

#[test]
fn every_problem_of_a_gateway_is_reported_at_once() {
    let errors = gateway_errors(
        "nodeSelector: {selector: {matchExpressions: [{key: a, operator: In}]}}\n\
         ippools: {ipv4: ['x', '10.0.0.2-10.0.0.1'], ipv6: ['10.0.0.1'], ipv4DefaultEIP: '1.1.1.1'}\n",
    );
    assert_eq!(errors.len(), 5, "{errors:#?}");
}

#[test]
fn a_minimal_policy_is_valid() {
    assert_eq!(
        policy_errors("appliedTo: {podSelector: {matchLabels: {app: web}}}\n"),
        Vec::<String>::new()
    );
}

#[test]
fn a_malformed_egress_ip_is_rejected_naming_its_field() {
    assert_eq!(
        policy_errors("egressIP: {ipv4: 10.0.0.300}\nappliedTo: {podSelector: {}}\n"),
        vec![r#"spec.egressIP.ipv4: "10.0.0.300" is not an IP address"#]
    );
}

#[test]
fn an_egress_ip_of_the_wrong_family_is_rejected() {
    assert_eq!(
        policy_errors("egressIP: {ipv6: 10.0.0.1}\nappliedTo: {podSelector: {}}\n"),
        vec![r#"spec.egressIP.ipv6: "10.0.0.1" is not ipv6"#]
    );
}

#[test]
fn use_node_ip_with_an_explicit_ip_is_rejected() {
    assert_eq!(
        policy_errors(
            "egressIP: {ipv4: 10.0.0.1, useNodeIP: true}\nappliedTo: {podSelector: {}}\n"
        ),
        vec!["spec.egressIP: useNodeIP cannot be combined with ipv4/ipv6"]
    );
}

#[test]
fn use_node_ip_with_empty_addresses_is_fine() {
    assert_eq!(
        policy_errors(
            "egressIP: {ipv4: '', ipv6: '', useNodeIP: true}\nappliedTo: {podSelector: {}}\n"
        ),
        Vec::<String>::new()
    );
}

#[test]
fn both_pod_selector_and_pod_subnet_is_rejected() {
    assert_eq!(
        policy_errors("appliedTo: {podSelector: {}, podSubnet: [10.0.0.0/8]}\n"),
        vec!["spec.appliedTo: set exactly one of podSelector and podSubnet"]
    );
}

#[test]
fn neither_pod_selector_nor_pod_subnet_is_rejected() {
    assert_eq!(
        policy_errors("appliedTo: {}\n"),
        vec!["spec.appliedTo: set exactly one of podSelector and podSubnet"]
    );
}

#[test]
fn an_empty_pod_subnet_is_rejected() {
    assert_eq!(
        policy_errors("appliedTo: {podSubnet: []}\n"),
        vec!["spec.appliedTo.podSubnet: must list at least one CIDR"]
    );
}

#[test]
fn malformed_subnets_are_rejected_with_their_index() {
    assert_eq!(
        policy_errors(
            "appliedTo: {podSubnet: [10.244.0.0/16, 10.244.1.1]}\n\
             destSubnet: [0.0.0.0/0, 192.168.1.1/24]\n\
             excludeSubnet: [nope]\n"
        ),
        vec![
            r#"spec.appliedTo.podSubnet[1]: "10.244.1.1" is not a CIDR (address/length)"#,
            r#"spec.destSubnet[1]: "192.168.1.1/24" has host bits set; did you mean 192.168.1.0/24?"#,
            r#"spec.excludeSubnet[0]: "nope" is not a CIDR (address/length)"#,
        ]
    );
}

#[test]
fn a_pod_selector_with_in_but_no_values_is_rejected() {
    assert_eq!(
        policy_errors("appliedTo: {podSelector: {matchExpressions: [{key: app, operator: In}]}}\n"),
        vec![
            "spec.appliedTo.podSelector.matchExpressions[0].values: operator In needs at least one value"
        ]
    );
}

#[test]
fn a_cluster_policy_namespace_selector_is_validated() {
    let spec = cluster_policy_spec(
        "appliedTo:\n  podSelector: {}\n  namespaceSelector: {matchExpressions: [{key: team, operator: Exists, values: [a]}]}\n",
    );
    assert_eq!(
        messages(spec.validate()),
        vec![
            "spec.appliedTo.namespaceSelector.matchExpressions[0].values: operator Exists takes no values"
        ]
    );
}

#[test]
fn an_unknown_allocator_policy_does_not_decode() {
    let result: Result<egressgw_api::EgressPolicySpec, _> =
        serde_yaml::from_str("egressIP: {allocatorPolicy: random}\nappliedTo: {podSelector: {}}\n");
    let err = result.unwrap_err().to_string();
    assert!(err.contains("unknown variant `random`"), "{err}");
}

/// The rule a label key must follow, as the messages end.
const KEY_RULE: &str = "an optional prefix (a lowercase DNS subdomain of at most 253 characters) and '/', then a name of 1 to 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or digit";
/// The rule a label value must follow, as the messages end.
const VALUE_RULE: &str = "empty, or 1 to 63 letters, digits, '-', '_' or '.' that begins and ends with a letter or digit";

#[test]
fn a_pod_selector_with_bad_label_syntax_is_rejected_naming_the_map_and_the_entry() {
    assert_eq!(
        policy_errors("appliedTo: {podSelector: {matchLabels: {'app web!': 'x/y/z'}}}\n"),
        vec![
            format!(
                r#"spec.appliedTo.podSelector.matchLabels: "app web!" is not a label key: write {KEY_RULE}"#
            ),
            format!(
                r#"spec.appliedTo.podSelector.matchLabels[app web!]: "x/y/z" is not a label value: write {VALUE_RULE}"#
            ),
        ]
    );
}

#[test]
fn a_namespace_selector_with_bad_label_syntax_is_rejected() {
    let spec = cluster_policy_spec(
        "appliedTo:\n  podSelector: {}\n  namespaceSelector:\n    matchExpressions: [{key: 'team a', operator: In, values: [ok, 'not ok']}]\n",
    );
    assert_eq!(
        messages(spec.validate()),
        vec![
            format!(
                r#"spec.appliedTo.namespaceSelector.matchExpressions[0].key: "team a" is not a label key: write {KEY_RULE}"#
            ),
            format!(
                r#"spec.appliedTo.namespaceSelector.matchExpressions[0].values[1]: "not ok" is not a label value: write {VALUE_RULE}"#
            ),
        ]
    );
}

#[test]
fn a_gateway_node_selector_with_bad_label_syntax_is_rejected() {
    assert_eq!(
        gateway_errors("nodeSelector: {selector: {matchLabels: {'a/b/c': x, 'egress': '-yes'}}}\n"),
        vec![
            format!(
                r#"spec.nodeSelector.selector.matchLabels: "a/b/c" is not a label key: write {KEY_RULE}"#
            ),
            format!(
                r#"spec.nodeSelector.selector.matchLabels[egress]: "-yes" is not a label value: write {VALUE_RULE}"#
            ),
        ]
    );
}

#[test]
fn selectors_with_prefixed_keys_and_empty_values_are_valid() {
    assert_eq!(
        gateway_errors(
            "nodeSelector: {selector: {matchLabels: {'node-role.kubernetes.io/egress': '', 'kubernetes.io/os': linux}, \
             matchExpressions: [{key: topology.kubernetes.io/zone, operator: In, values: [eu-1a, '']}]}}\n"
        ),
        Vec::<String>::new()
    );
}

#[test]
fn every_int32_priority_is_valid() {
    for priority in [i32::MIN, -1, 0, 10, i32::MAX] {
        assert_eq!(
            policy_errors(&format!(
                "appliedTo: {{podSelector: {{}}}}\npriority: {priority}\n"
            )),
            Vec::<String>::new(),
            "{priority}"
        );
    }
}

//! Admission-time validation: OpenAPI limits and CEL rules
//! (`x-kubernetes-validations`) added to the derived schemas.
//!
//! Every constraint the apiserver enforces is built here, attached to a
//! field with `#[schemars(transform = ...)]`, so the admission side of the
//! API can be read in one place. The Rust side of the same checks is each
//! spec's `validate()`.
//!
//! The rules use Kubernetes' CEL IP and CIDR libraries (`isIP`, `ip`,
//! `isCIDR`, `cidr`, 1.31+) and the strings extension (`split`). No rule
//! trims a value: every address, CIDR and half of a range is checked as
//! written, and `isIP` / `isCIDR` refuse whitespace, so a value with
//! whitespace anywhere (around the dash of a range too) is refused, as the
//! Rust parsers in `validation` refuse it.
//! Lists and strings that rules walk carry `maxItems` / `maxLength`, which
//! keeps the apiserver's cost estimate within its budget.

use egressgw_core::net::Family;
use schemars::Schema;
use serde_json::{Value, json};

use crate::label;
use crate::validation::IntRange;

/// Longest pool entry: two full IPv6 addresses and a dash, with room to spare.
pub(crate) const MAX_POOL_ENTRY_LEN: u64 = 100;
/// Longest IP address text (an IPv6 address with an embedded IPv4 tail).
pub(crate) const MAX_IP_LEN: u64 = 45;
/// Longest CIDR text.
pub(crate) const MAX_CIDR_LEN: u64 = 49;
/// Most entries in an EIP pool of one family.
pub(crate) const MAX_POOL_ENTRIES: u64 = 64;
/// Most prefixes in `podSubnet`, `destSubnet`, `excludeSubnet`.
pub(crate) const MAX_SUBNETS: u64 = 64;
/// Longest object name (a DNS subdomain).
pub(crate) const MAX_NAME_LEN: u64 = 253;
/// Most labels in a selector's `matchLabels`.
pub(crate) const MAX_MATCH_LABELS: u64 = 64;
/// Most requirements in a selector's `matchExpressions`.
pub(crate) const MAX_MATCH_EXPRESSIONS: u64 = 32;
/// Most values of one requirement.
pub(crate) const MAX_REQUIREMENT_VALUES: u64 = 64;

/// `spec.priority`: every `int32`. The planner only compares priorities, so
/// every value has a meaning; a narrower range would refuse objects that
/// clusters already hold. What the bounds refuse is what the daemons cannot
/// decode (an int64 such as `99999999999`).
pub(crate) const PRIORITY: IntRange = IntRange::INT32;
/// `status.selectedNodes`, `status.readyNodes`: counts of nodes, `int32`.
pub(crate) const NODE_COUNT: IntRange = IntRange {
    min: 0,
    max: i32::MAX as i64,
};
/// `status.pods.*` of a gateway: counts of Pods and slices, `int32`.
pub(crate) const POD_COUNT: IntRange = NODE_COUNT;
/// `status.ipUsage.*`: counts of addresses, `int64`, saturating at the
/// largest (an IPv6 /64 holds more).
pub(crate) const ADDRESS_COUNT: IntRange = IntRange {
    min: 0,
    max: IntRange::MAX_EXACT,
};
/// `status.conditions[].observedGeneration`: a `metadata.generation`, 0 or
/// more as in `metav1.Condition`.
pub(crate) const GENERATION: IntRange = IntRange {
    min: 0,
    max: IntRange::MAX_EXACT,
};

/// A rule as it appears in the schema.
fn rule(rule: &str, message: &str) -> Value {
    json!({ "rule": rule, "message": message })
}

/// Appends `rules` to the schema's `x-kubernetes-validations`.
fn push_rules(schema: &mut Schema, rules: impl IntoIterator<Item = Value>) {
    let entry = schema
        .ensure_object()
        .entry("x-kubernetes-validations")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(list) = entry {
        list.extend(rules);
    }
}

fn insert(schema: &mut Schema, key: &str, value: Value) {
    schema.insert(key.to_owned(), value);
}

/// The `items` schema of an array schema.
fn items(schema: &mut Schema) -> &mut Value {
    schema
        .ensure_object()
        .entry("items")
        .or_insert_with(|| json!({ "type": "string" }))
}

fn items_push_rules(schema: &mut Schema, max_len: u64, rules: Vec<Value>) {
    let item = items(schema);
    if let Value::Object(map) = item {
        map.insert("maxLength".into(), json!(max_len));
        map.insert("x-kubernetes-validations".into(), Value::Array(rules));
    }
}

fn family_number(family: Family) -> u8 {
    match family {
        Family::Ipv4 => 4,
        Family::Ipv6 => 6,
    }
}

fn family_name(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "IPv4",
        Family::Ipv6 => "IPv6",
    }
}

/// CEL: `s` (a string expression) is an IP address of `family`.
fn is_ip_of(s: &str, family: Family) -> String {
    format!(
        "(isIP({s}) && ip({s}).family() == {})",
        family_number(family)
    )
}

/// CEL: the integer value of the IPv4 address text `s` (already known valid).
fn ipv4_value(s: &str) -> String {
    format!(
        "(int({s}.split('.')[0]) * 16777216 + int({s}.split('.')[1]) * 65536 \
         + int({s}.split('.')[2]) * 256 + int({s}.split('.')[3]))"
    )
}

/// CEL: the first / second address of the range text `s`, as written.
fn range_start(s: &str) -> String {
    format!("{s}.split('-')[0]")
}

fn range_end(s: &str) -> String {
    format!("{s}.split('-')[1]")
}

/// CEL: the range text `s` has exactly two addresses of `family`.
fn is_range_of(s: &str, family: Family) -> String {
    format!(
        "(size({s}.split('-')) == 2 && {} && {})",
        is_ip_of(&range_start(s), family),
        is_ip_of(&range_end(s), family)
    )
}

/// CEL: the pool entry `s` is an address, a range or a CIDR of `family`.
fn is_pool_entry_of(s: &str, family: Family) -> String {
    let n = family_number(family);
    format!(
        "{s}.contains('-') ? {} : ({s}.contains('/') ? (isCIDR({s}) && cidr({s}).ip().family() == {n}) : {})",
        is_range_of(s, family),
        is_ip_of(s, family),
    )
}

/// CEL: the pool entry `r` contains the address `d` (both known to be of
/// `family`). IPv6 ranges cannot be compared in CEL: they count as
/// containing, and the controller's check decides.
fn pool_entry_contains(r: &str, d: &str, family: Family) -> String {
    let by_address_or_cidr = format!(
        "({r}.contains('/') ? (isCIDR({r}) && cidr({r}).containsIP({d})) : (isIP({r}) && ip({r}) == ip({d})))"
    );
    match family {
        Family::Ipv4 => format!(
            "({r}.contains('-') ? ({} && {} <= {} && {} <= {}) : {by_address_or_cidr})",
            is_range_of(r, family),
            ipv4_value(&range_start(r)),
            ipv4_value(d),
            ipv4_value(d),
            ipv4_value(&range_end(r)),
        ),
        Family::Ipv6 => format!("({r}.contains('-') || {by_address_or_cidr})"),
    }
}

/// CEL: the string expression `s` is a label key (see `label`).
fn is_label_key(s: &str) -> String {
    format!(
        "({s}.matches('{}') && {s}.indexOf('/') <= {})",
        label::KEY_PATTERN,
        label::MAX_PREFIX_LEN
    )
}

/// CEL: the string expression `s` is a label value (see `label`).
fn is_label_value(s: &str) -> String {
    format!("{s}.matches('{}')", label::VALUE_PATTERN)
}

/// An integer field with the bounds `range`.
pub(crate) fn int_range(range: IntRange) -> impl FnMut(&mut Schema) {
    move |schema| {
        insert(schema, "minimum", json!(range.min));
        insert(schema, "maximum", json!(range.max));
    }
}

/// An optional IP address field of `family` at `path`; `""` means unset.
pub(crate) fn ip_field(family: Family, path: &'static str) -> impl FnMut(&mut Schema) {
    move |schema| {
        insert(schema, "maxLength", json!(MAX_IP_LEN));
        push_rules(
            schema,
            [rule(
                &format!("self == '' || {}", is_ip_of("self", family)),
                &format!("{path}: must be an {} address", family_name(family)),
            )],
        );
    }
}

/// An EIP pool of `family` at `path`: addresses, ranges `a-b`, CIDRs.
pub(crate) fn pool(family: Family, path: &'static str) -> impl FnMut(&mut Schema) {
    move |schema| {
        insert(schema, "maxItems", json!(MAX_POOL_ENTRIES));
        insert(schema, "x-kubernetes-list-type", json!("set"));
        let name = family_name(family);
        let mut rules = vec![
            rule(
                &is_pool_entry_of("self", family),
                &format!(
                    "{path}: each entry must be an {name} address, a range a-b of {name} addresses or an {name} CIDR, without spaces"
                ),
            ),
            rule(
                "self.contains('-') || !self.contains('/') || !isCIDR(self) || cidr(self) == cidr(self).masked()",
                &format!(
                    "{path}: a CIDR must not have host bits set (write the network address, e.g. 10.0.0.0/24)"
                ),
            ),
        ];
        if family == Family::Ipv4 {
            rules.push(rule(
                &format!(
                    "!self.contains('-') || !{} || {} <= {}",
                    is_range_of("self", family),
                    ipv4_value(&range_start("self")),
                    ipv4_value(&range_end("self")),
                ),
                &format!("{path}: a range a-b must not be reversed: b must not be lower than a"),
            ));
        }
        items_push_rules(schema, MAX_POOL_ENTRY_LEN, rules);
    }
}

/// `spec.ippools`: each default EIP must lie in its pool.
pub(crate) fn ippools(schema: &mut Schema) {
    let rules = Family::ALL.map(|family| {
        let (list, default) = match family {
            Family::Ipv4 => ("ipv4", "ipv4DefaultEIP"),
            Family::Ipv6 => ("ipv6", "ipv6DefaultEIP"),
        };
        let d = format!("self.{default}");
        rule(
            &format!(
                "!has(self.{default}) || self.{default} == '' || !{} || (has(self.{list}) && self.{list}.exists(r, {}))",
                is_ip_of(&d, family),
                pool_entry_contains("r", &d, family),
            ),
            &format!("spec.ippools.{default}: must be an address of spec.ippools.{list}"),
        )
    });
    push_rules(schema, rules);
}

/// A list of CIDRs (either family) at `path`.
pub(crate) fn cidr_list(path: &'static str) -> impl FnMut(&mut Schema) {
    move |schema| {
        insert(schema, "maxItems", json!(MAX_SUBNETS));
        insert(schema, "x-kubernetes-list-type", json!("set"));
        items_push_rules(
            schema,
            MAX_CIDR_LEN,
            vec![
                rule(
                    "isCIDR(self)",
                    &format!("{path}: each entry must be a CIDR (address/length)"),
                ),
                rule(
                    "!isCIDR(self) || cidr(self) == cidr(self).masked()",
                    &format!(
                        "{path}: a CIDR must not have host bits set (write the network address, e.g. 10.0.0.0/24)"
                    ),
                ),
            ],
        );
    }
}

/// `podSubnet`: a CIDR list that, when present, is not empty.
pub(crate) fn pod_subnet(path: &'static str) -> impl FnMut(&mut Schema) {
    let mut list = cidr_list(path);
    move |schema| {
        list(schema);
        insert(schema, "minItems", json!(1));
    }
}

/// The name of an object (a DNS subdomain); `""` means unset.
pub(crate) fn object_name(schema: &mut Schema) {
    insert(schema, "maxLength", json!(MAX_NAME_LEN));
    insert(
        schema,
        "pattern",
        json!(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$"),
    );
}

/// `spec.egressIP`: `useNodeIP` excludes explicit addresses; immutable.
pub(crate) fn egress_ip(schema: &mut Schema) {
    push_rules(
        schema,
        [
            rule(
                "!has(self.useNodeIP) || !self.useNodeIP || ((!has(self.ipv4) || self.ipv4 == '') && (!has(self.ipv6) || self.ipv6 == ''))",
                "spec.egressIP: useNodeIP cannot be combined with ipv4/ipv6",
            ),
            rule(
                "self == oldSelf",
                "spec.egressIP: is immutable; create a new policy to change the egress IP",
            ),
        ],
    );
}

/// `spec.appliedTo`: exactly one of `podSelector` / `podSubnet`, and the
/// choice cannot change.
pub(crate) fn applied_to(schema: &mut Schema) {
    push_rules(
        schema,
        [
            rule(
                "has(self.podSelector) != has(self.podSubnet)",
                "spec.appliedTo: set exactly one of podSelector and podSubnet",
            ),
            rule(
                "has(self.podSelector) == has(oldSelf.podSelector)",
                "spec.appliedTo: cannot switch between podSelector and podSubnet; create a new policy instead",
            ),
        ],
    );
}

/// `spec` of a policy: the gateway it names is immutable (unset and `""`
/// both mean the cluster default).
pub(crate) fn policy_spec(schema: &mut Schema) {
    push_rules(
        schema,
        [rule(
            "(has(self.egressGatewayName) ? self.egressGatewayName : '') == (has(oldSelf.egressGatewayName) ? oldSelf.egressGatewayName : '')",
            "spec.egressGatewayName: is immutable; create a new policy to use another gateway",
        )],
    );
}

/// A label selector at `path`, shaped like `metav1.LabelSelector` but with
/// bounded lists, an enum for the operator, and Kubernetes' label syntax
/// for every key and value (see `label`).
pub(crate) fn label_selector(path: &'static str) -> impl FnMut(&mut Schema) {
    move |schema| {
        let description = schema.get("description").cloned();
        let key_message = |field: &str, must: &str| {
            format!("{path}.{field}: {must} be a label key: {}", label::KEY_RULE)
        };
        let value_message = |field: &str, must: &str| {
            format!(
                "{path}.{field}: {must} be a label value: {}",
                label::VALUE_RULE
            )
        };
        let mut selector = Schema::try_from(json!({
                "type": "object",
                "x-kubernetes-map-type": "atomic",
                "properties": {
                    "matchLabels": {
                        "type": "object",
                        "maxProperties": MAX_MATCH_LABELS,
                        "additionalProperties": {
                            "type": "string",
                            "maxLength": label::MAX_VALUE_LEN,
                            "x-kubernetes-validations": [rule(
                                &is_label_value("self"),
                                &value_message("matchLabels", "every value must"),
                            )]
                        },
                        "description": "Labels that must all be present with these values.",
                        "x-kubernetes-validations": [rule(
                            &format!("self.all(k, {})", is_label_key("k")),
                            &key_message("matchLabels", "every key must"),
                        )]
                    },
                    "matchExpressions": {
                        "type": "array",
                        "maxItems": MAX_MATCH_EXPRESSIONS,
                        "x-kubernetes-list-type": "atomic",
                        "description": "Requirements that must all hold.",
                        "items": {
                            "type": "object",
                            "required": ["key", "operator"],
                            "properties": {
                                "key": {
                                    "type": "string",
                                    "minLength": 1,
                                    "maxLength": label::MAX_KEY_LEN,
                                    "x-kubernetes-validations": [rule(
                                        &is_label_key("self"),
                                        &key_message("matchExpressions.key", "must"),
                                    )]
                                },
                                "operator": {
                                    "type": "string",
                                    "enum": ["In", "NotIn", "Exists", "DoesNotExist"]
                                },
                                "values": {
                                    "type": "array",
                                    "maxItems": MAX_REQUIREMENT_VALUES,
                                    "x-kubernetes-list-type": "atomic",
                                    "items": {
                                        "type": "string",
                                        "maxLength": label::MAX_VALUE_LEN,
                                        "x-kubernetes-validations": [rule(
                                            &is_label_value("self"),
                                            &value_message("matchExpressions.values", "every value must"),
                                        )]
                                    }
                                }
                            },
                            "x-kubernetes-validations": [rule(
                                "(self.operator == 'In' || self.operator == 'NotIn') == (has(self.values) && size(self.values) > 0)",
                                &format!("{path}.matchExpressions: In and NotIn need values; Exists and DoesNotExist take none"),
                            )]
                        }
                    }
                }
        }))
        .expect("a JSON object is a schema");
        if let Some(description) = description {
            selector.insert("description".into(), description);
        }
        *schema = selector;
    }
}

/// A MAC address written by egressgw.
pub(crate) fn mac(schema: &mut Schema) {
    insert(schema, "pattern", json!("^([0-9a-f]{2}:){5}[0-9a-f]{2}$"));
}

/// A packet mark in hex (`0x01000000`), written by egressgw.
pub(crate) fn mark(schema: &mut Schema) {
    insert(schema, "pattern", json!("^0x[0-9a-f]{1,8}$"));
}

/// Conditions: a list keyed by `type`, as Kubernetes' own objects have,
/// with `observedGeneration` bounded.
pub(crate) fn conditions(schema: &mut Schema) {
    insert(schema, "x-kubernetes-list-type", json!("map"));
    insert(schema, "x-kubernetes-list-map-keys", json!(["type"]));
    insert(schema, "maxItems", json!(8));
    if let Some(generation) = items(schema)
        .pointer_mut("/properties/observedGeneration")
        .and_then(Value::as_object_mut)
    {
        generation.insert("minimum".into(), json!(GENERATION.min));
        generation.insert("maximum".into(), json!(GENERATION.max));
    }
}

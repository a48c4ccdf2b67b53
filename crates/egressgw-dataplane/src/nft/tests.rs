//! The table's planning against the fake, and the real `nft` in network
//! namespaces.

use egressgw_core::model::PolicyRef;
use egressgw_core::state::{ClassifyEntry, SnatEntry};

use super::*;
use crate::ops::Cause;
use crate::testns::{in_new_netns, root_or_skip, sh};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn classify(src: &str, dst: &str, action: Action) -> ClassifyEntry {
    ClassifyEntry {
        src: ip(src),
        dst: net(dst),
        action,
        policy: Some(PolicyRef::namespaced("a", "p").into()),
        group: None,
    }
}

fn tunnel(mark: u32) -> Action {
    Action::Tunnel {
        gateway: format!("g{mark:x}"),
        mark,
    }
}

fn snat(src: &str, dst: &str, to: SnatTo) -> SnatEntry {
    SnatEntry {
        src: ip(src),
        dst: net(dst),
        to,
        origin: "n2".into(),
        policy: PolicyRef::namespaced("a", "p").into(),
    }
}

/// Both families, a tunnelled default route with a bypass hole and a
/// `Local` prefix, SNAT to an EIP with a masqueraded prefix inside it.
fn state() -> NodeState {
    NodeState {
        node: "n1".into(),
        cluster_cidrs: vec![
            net("10.244.0.0/16"),
            net("10.96.0.0/12"),
            net("10.244.3.0/24"),
            net("fd00:10::/48"),
        ],
        classify: vec![
            classify("10.244.1.2", "0.0.0.0/0", tunnel(0x0100_0000)),
            classify("10.244.1.2", "203.0.113.192/26", Action::Bypass),
            classify("10.244.1.2", "198.51.100.0/24", Action::Local),
            classify("fd00:10::2", "::/0", tunnel(0x0200_0000)),
            classify("fd00:10::2", "2001:db8::/32", Action::Bypass),
        ],
        snat: vec![
            snat("10.244.2.5", "0.0.0.0/0", SnatTo::Eip(ip("192.0.2.10"))),
            snat("10.244.2.5", "198.51.100.0/24", SnatTo::NodeIp),
            snat(
                "fd00:10::5",
                "2001:db8::/32",
                SnatTo::Eip(ip("2001:db8:ff::10")),
            ),
        ]
        .into(),
        ..NodeState::default()
    }
}

fn spec() -> FirewallSpec {
    FirewallSpec::new(&state(), &Config::default())
}

fn shown(ops: &[FwOp]) -> Vec<String> {
    ops.iter().map(ToString::to_string).collect()
}

/// What the fake holds after applying `ops` to an empty kernel.
fn applied(spec: &FirewallSpec) -> FakeFirewall {
    let mut fw = FakeFirewall::default();
    let report = fw.apply(&plan(spec, None));
    assert!(report.is_ok(), "{report:?}");
    fw
}

#[test]
fn a_small_table_renders_as_one_deterministic_script() {
    let state = NodeState {
        cluster_cidrs: vec![net("10.244.0.0/16")],
        classify: vec![
            classify("10.244.1.2", "0.0.0.0/0", tunnel(0x0100_0000)),
            classify("10.244.1.2", "203.0.113.192/26", Action::Bypass),
        ],
        snat: vec![snat(
            "10.244.2.5",
            "198.51.100.0/24",
            SnatTo::Eip(ip("192.0.2.10")),
        )]
        .into(),
        ..NodeState::default()
    };
    let spec = FirewallSpec::new(&state, &Config::default());
    assert_eq!(spec.render(), spec.clone().render());
    assert_eq!(
        spec.render(),
        r#"add table inet egressgw
add map inet egressgw classify4 { type ipv4_addr . ipv4_addr : verdict; flags interval; }
add map inet egressgw classify6 { type ipv6_addr . ipv6_addr : verdict; flags interval; }
add map inet egressgw snat4 { type ipv4_addr . ipv4_addr : ipv4_addr; flags interval; }
add map inet egressgw snat6 { type ipv6_addr . ipv6_addr : ipv6_addr; flags interval; }
add set inet egressgw masq4 { type ipv4_addr . ipv4_addr; flags interval; }
add set inet egressgw masq6 { type ipv6_addr . ipv6_addr; flags interval; }
add set inet egressgw cluster4 { type ipv4_addr; flags interval; }
add set inet egressgw cluster6 { type ipv6_addr; flags interval; }
add map inet egressgw count4 { type ipv4_addr . ipv4_addr : counter; flags interval; }
add map inet egressgw count6 { type ipv6_addr . ipv6_addr : counter; flags interval; }
add chain inet egressgw mark_01000000
add rule inet egressgw mark_01000000 meta mark set meta mark & 0x00ffffff | 0x01000000 comment "6f6c06158d7f4b4e"
add rule inet egressgw mark_01000000 ct mark set ct mark & 0x00ffffff | 0x01000000 comment "aca70d19992d4876"
add chain inet egressgw local
add rule inet egressgw local meta mark set meta mark & 0x00ffffff | 0xfe000000 comment "65b5d35193d93e28"
add rule inet egressgw local ct mark set ct mark & 0x00ffffff | 0xfe000000 comment "fda798e7e8eab830"
add chain inet egressgw fail_closed
add rule inet egressgw fail_closed counter drop comment "aad7fa09e1332e50"
add chain inet egressgw gateway_guard
add rule inet egressgw gateway_guard ip daddr @cluster4 return comment "4547dd9262c4ecad"
add rule inet egressgw gateway_guard ip6 daddr @cluster6 return comment "99893f885d8ae25d"
add rule inet egressgw gateway_guard ip saddr { 192.0.2.10 } return comment "360384b49df0c9b7"
add rule inet egressgw gateway_guard ct original ip saddr . ip daddr @masq4 return comment "fc3f269bba115ebc"
add rule inet egressgw gateway_guard ct original ip6 saddr . ip6 daddr @masq6 return comment "14339918059f969c"
add rule inet egressgw gateway_guard counter drop comment "aad7fa09e1332e50"
add chain inet egressgw gateway_nat
add rule inet egressgw gateway_nat ip daddr @cluster4 return comment "4547dd9262c4ecad"
add rule inet egressgw gateway_nat ip6 daddr @cluster6 return comment "99893f885d8ae25d"
add rule inet egressgw gateway_nat ip saddr . ip daddr @masq4 masquerade comment "e8104f927ba7d946"
add rule inet egressgw gateway_nat ip6 saddr . ip6 daddr @masq6 masquerade comment "39f50008b14e0682"
add rule inet egressgw gateway_nat snat ip to ip saddr . ip daddr map @snat4 comment "97ae36449faab7f0"
add rule inet egressgw gateway_nat snat ip6 to ip6 saddr . ip6 daddr map @snat6 comment "c7ab21c5b185438a"
add chain inet egressgw prerouting { type filter hook prerouting priority -150; policy accept; }
add rule inet egressgw prerouting iifname "egress.vxlan" ct state new ct mark set ct mark & 0x00ffffff | 0xff000000 comment "c82debc54673c8f2"
add rule inet egressgw prerouting ct direction reply ct mark & 0xff000000 == 0xff000000 meta mark set meta mark & 0x00ffffff | 0xff000000 comment "eb4a0ac4441b7d57"
add rule inet egressgw prerouting ct direction reply return comment "3c7345d7f27b17db"
add rule inet egressgw prerouting ct state != new ct mark & 0xff000000 vmap { 0x01000000 : jump mark_01000000, 0xfe000000 : jump local } comment "18c66163311e2491"
add rule inet egressgw prerouting ct state != new ct mark & 0xff000000 == 0 return comment "c4304de74753e6dd"
add rule inet egressgw prerouting ct state != new ct mark & 0xff000000 == 0xff000000 return comment "8d06e14406291b4f"
add rule inet egressgw prerouting ip daddr @cluster4 return comment "4547dd9262c4ecad"
add rule inet egressgw prerouting ip6 daddr @cluster6 return comment "99893f885d8ae25d"
add rule inet egressgw prerouting counter name ip saddr . ip daddr map @count4 comment "5d2c76043023d9d8"
add rule inet egressgw prerouting counter name ip6 saddr . ip6 daddr map @count6 comment "dc25b67d7c779330"
add rule inet egressgw prerouting ip saddr . ip daddr vmap @classify4 comment "7e5e38da85c648ac"
add rule inet egressgw prerouting ip6 saddr . ip6 daddr vmap @classify6 comment "e827b1ba3d30ff44"
add chain inet egressgw postrouting_nat { type nat hook postrouting priority 90; policy accept; }
add rule inet egressgw postrouting_nat oifname "egress.vxlan" snat ip to ip saddr comment "9a2eecfdacc3452b"
add rule inet egressgw postrouting_nat oifname "egress.vxlan" snat ip6 to ip6 saddr comment "c277a8f08a85a98b"
add rule inet egressgw postrouting_nat iifname "egress.vxlan" goto gateway_nat comment "0bb4edf3f5f2768d"
add rule inet egressgw postrouting_nat meta mark & 0xff000000 == 0xfe000000 goto gateway_nat comment "bd63945cf1a3697b"
add chain inet egressgw postrouting_mark { type filter hook postrouting priority 110; policy accept; }
add rule inet egressgw postrouting_mark oifname "egress.vxlan" meta mark set meta mark & 0x00ffffff comment "a5a5f4c5e6650e08"
add rule inet egressgw postrouting_mark iifname "egress.vxlan" oifname != "egress.vxlan" jump gateway_guard comment "689bf374f71a3445"
add rule inet egressgw postrouting_mark meta mark & 0xff000000 == 0xfe000000 oifname != "egress.vxlan" jump gateway_guard comment "0b5ca3bb4a430a9f"
add counter inet egressgw policy_e620b1190468b0cb
add element inet egressgw cluster4 { 10.244.0.0/16 }
add element inet egressgw classify4 { 10.244.1.2 . 0.0.0.0-203.0.113.191 : jump mark_01000000 }
add element inet egressgw classify4 { 10.244.1.2 . 203.0.114.0-255.255.255.255 : jump mark_01000000 }
add element inet egressgw snat4 { 10.244.2.5 . 198.51.100.0/24 : 192.0.2.10 }
add element inet egressgw count4 { 10.244.1.2 . 0.0.0.0-203.0.113.191 : "policy_e620b1190468b0cb" }
add element inet egressgw count4 { 10.244.1.2 . 203.0.114.0-255.255.255.255 : "policy_e620b1190468b0cb" }
"#
    );
}

#[test]
fn an_absent_table_is_created_then_filled() {
    let ops = plan(&spec(), None);
    assert_eq!(
        ops[0].to_string(),
        "add table inet egressgw (10 sets, 9 chains)"
    );
    assert_eq!(
        shown(&ops[1..]),
        [
            "add counter policy_e620b1190468b0cb",
            "add element cluster4 { 10.96.0.0/12 }",
            "add element cluster4 { 10.244.0.0/16 }",
            "add element cluster6 { fd00:10::/48 }",
            "add element classify4 { 10.244.1.2 . 0.0.0.0-198.51.99.255 : jump mark_01000000 }",
            "add element classify4 { 10.244.1.2 . 198.51.100.0/24 : jump local }",
            "add element classify4 { 10.244.1.2 . 198.51.101.0-203.0.113.191 : jump mark_01000000 }",
            "add element classify4 { 10.244.1.2 . 203.0.114.0-255.255.255.255 : jump mark_01000000 }",
            "add element classify6 { fd00:10::2 . ::-2001:db7:ffff:ffff:ffff:ffff:ffff:ffff : jump mark_02000000 }",
            "add element classify6 { fd00:10::2 . 2001:db9::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff : jump mark_02000000 }",
            "add element snat4 { 10.244.2.5 . 0.0.0.0-198.51.99.255 : 192.0.2.10 }",
            "add element masq4 { 10.244.2.5 . 198.51.100.0/24 }",
            "add element snat4 { 10.244.2.5 . 198.51.101.0-255.255.255.255 : 192.0.2.10 }",
            "add element snat6 { fd00:10::5 . 2001:db8::/32 : 2001:db8:ff::10 }",
            "add element count4 { 10.244.1.2 . 0.0.0.0-203.0.113.191 : \"policy_e620b1190468b0cb\" }",
            "add element count4 { 10.244.1.2 . 203.0.114.0-255.255.255.255 : \"policy_e620b1190468b0cb\" }",
            "add element count6 { fd00:10::2 . ::-2001:db7:ffff:ffff:ffff:ffff:ffff:ffff : \"policy_e620b1190468b0cb\" }",
            "add element count6 { fd00:10::2 . 2001:db9::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff : \"policy_e620b1190468b0cb\" }",
        ]
    );
}

#[test]
fn an_equal_table_plans_nothing() {
    let mut fw = applied(&spec());
    let observed = fw.observe().unwrap();
    assert_eq!(plan(&spec(), observed.as_deref()), []);
}

#[test]
fn a_changed_element_value_is_deleted_then_added() {
    let mut fw = applied(&spec());
    let mut state = state();
    Arc::make_mut(&mut state.snat)[0].to = SnatTo::Eip(ip("192.0.2.11"));
    let ops = plan(
        &FirewallSpec::new(&state, &Config::default()),
        fw.observe().unwrap().as_deref(),
    );
    assert_eq!(
        shown(&ops),
        [
            "replace chain gateway_guard (7 rules)",
            "delete element snat4 { 10.244.2.5 . 0.0.0.0-198.51.99.255 }",
            "delete element snat4 { 10.244.2.5 . 198.51.101.0-255.255.255.255 }",
            "add element snat4 { 10.244.2.5 . 0.0.0.0-198.51.99.255 : 192.0.2.11 }",
            "add element snat4 { 10.244.2.5 . 198.51.101.0-255.255.255.255 : 192.0.2.11 }",
        ]
    );
    assert!(fw.apply(&ops).is_ok());
    assert_eq!(
        plan(
            &FirewallSpec::new(&state, &Config::default()),
            fw.observe().unwrap().as_deref()
        ),
        []
    );
}

#[test]
fn a_policy_taking_over_a_source_gets_a_counter_first_and_the_unused_one_goes_last() {
    let mut fw = applied(&spec());
    let (p, q) = (
        PolicyRef::namespaced("a", "p"),
        PolicyRef::namespaced("a", "q"),
    );
    let mut state = state();
    for entry in &mut state.classify {
        entry.policy = Some(q.clone().into());
    }
    let desired = FirewallSpec::new(&state, &Config::default());
    let ops = plan(&desired, fw.observe().unwrap().as_deref());
    let shown = shown(&ops);
    assert_eq!(
        shown.first(),
        Some(&format!("add counter {}", counter_name(&q)))
    );
    assert_eq!(
        shown.last(),
        Some(&format!("delete counter {}", counter_name(&p)))
    );
    // Only the count elements change: classification stays as it was.
    assert!(
        ops[1..ops.len() - 1]
            .iter()
            .all(|op| matches!(op, FwOp::Count(..))),
        "{shown:?}"
    );
    assert!(fw.apply(&ops).is_ok());
    assert_eq!(plan(&desired, fw.observe().unwrap().as_deref()), []);
    // A bypass counts in no counter, and a source selected by nothing has
    // none.
    assert!(
        !desired
            .count
            .keys()
            .any(|k| k.dst.contains(ip("203.0.113.200")))
    );
    state.classify.clear();
    let nothing = FirewallSpec::new(&state, &Config::default());
    assert!(nothing.count.is_empty() && nothing.counters.is_empty());
}

#[test]
fn a_new_gateway_mark_adds_its_chain_first_and_an_unused_one_goes_last() {
    let mut fw = applied(&spec());
    let mut state = state();
    state.classify[0].action = tunnel(0x0300_0000);
    state.classify.retain(|e| !e.src.is_ipv6());
    let desired = FirewallSpec::new(&state, &Config::default());
    let ops = plan(&desired, fw.observe().unwrap().as_deref());
    let shown = shown(&ops);
    assert_eq!(
        shown.first().map(String::as_str),
        Some("add chain mark_03000000 (2 rules)")
    );
    assert_eq!(
        shown[shown.len() - 2..],
        ["delete chain mark_01000000", "delete chain mark_02000000"]
    );
    assert!(
        shown.contains(
            &"delete element classify6 { fd00:10::2 . ::-2001:db7:ffff:ffff:ffff:ffff:ffff:ffff }"
                .to_owned()
        )
    );
    let report = fw.apply(&ops);
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(plan(&desired, fw.observe().unwrap().as_deref()), []);
}

#[test]
fn a_renamed_tunnel_device_replaces_only_the_chains_that_name_it() {
    let mut fw = applied(&spec());
    let mut cfg = Config::default();
    cfg.vxlan.name = "egw0".into();
    let ops = plan(
        &FirewallSpec::new(&state(), &cfg),
        fw.observe().unwrap().as_deref(),
    );
    assert_eq!(
        shown(&ops),
        [
            "replace chain prerouting (12 rules)",
            "replace chain postrouting_nat (4 rules)",
            "replace chain postrouting_mark (3 rules)",
        ]
    );
    assert!(ops[0].to_nft().starts_with(
        "flush chain inet egressgw prerouting\ndelete chain inet egressgw prerouting\nadd chain inet egressgw prerouting { type filter"
    ));
}

#[test]
fn a_failing_op_is_reported_and_the_others_still_land() {
    let mut fw = FakeFirewall::default();
    let ops = plan(&spec(), None);
    let bad = "add element masq4 { 10.244.2.5 . 198.51.100.0/24 }";
    let op = ops.iter().find(|op| op.to_string() == bad).unwrap();
    fw.fail.push(op.clone());
    let report = fw.apply(&ops);
    assert_eq!(report.failed.len(), 1);
    assert_eq!(report.failed[0].op.text, bad);
    assert_eq!(report.failed[0].op.kind, OpKind::Element);
    assert_eq!(
        report.failed[0].op.object,
        "masq4 { 10.244.2.5 . 198.51.100.0/24 }"
    );
    assert_eq!(report.applied.len(), ops.len() - 1);
    fw.fail.clear();
    let retry = plan(&spec(), fw.observe().unwrap().as_deref());
    assert_eq!(shown(&retry), [bad]);
}

/// `obs`'s NAT elements, as `key : nat`.
fn shown_nat(obs: &Observed) -> Vec<String> {
    obs.nat
        .iter()
        .map(|(k, v)| format!("{k} : {v:?}"))
        .collect()
}

#[test]
fn observed_elements_read_back_from_prefixes_ranges_and_addresses() {
    let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
      {"table": {"family": "inet", "name": "egressgw", "handle": 1}},
      {"map": {"family": "inet", "name": "classify4", "table": "egressgw", "type": ["ipv4_addr", "ipv4_addr"], "map": "verdict", "flags": ["interval"], "elem": [
        [{"concat": ["10.244.1.2", {"range": ["0.0.0.0", "203.0.112.255"]}]}, {"jump": {"target": "mark_01000000"}}],
        [{"concat": ["10.244.1.3", {"prefix": {"addr": "0.0.0.0", "len": 0}}]}, {"jump": {"target": "local"}}],
        [{"concat": ["10.244.1.4", "192.0.2.1"]}, {"jump": {"target": "other"}}]]}},
      {"map": {"family": "inet", "name": "snat6", "table": "egressgw", "type": ["ipv6_addr", "ipv6_addr"], "map": "ipv6_addr", "flags": ["interval"], "elem": [
        [{"concat": ["fd00::1", {"prefix": {"addr": "2001:db8::", "len": 32}}]}, "2001:db8:ffff::1"]]}},
      {"set": {"family": "inet", "name": "masq4", "table": "egressgw", "type": ["ipv4_addr", "ipv4_addr"], "flags": ["interval"], "elem": [
        {"concat": ["10.244.1.2", {"prefix": {"addr": "8.8.8.0", "len": 24}}]}]}},
      {"set": {"family": "inet", "name": "cluster4", "table": "egressgw", "type": "ipv4_addr", "flags": ["interval"], "elem": [
        {"prefix": {"addr": "10.96.0.0", "len": 12}}, "10.200.0.1", {"range": ["10.0.0.1", "10.0.0.9"]}]}},
      {"chain": {"family": "inet", "table": "egressgw", "name": "postrouting_nat", "handle": 4, "type": "nat", "hook": "postrouting", "prio": 90, "policy": "accept"}},
      {"rule": {"family": "inet", "table": "egressgw", "chain": "postrouting_nat", "handle": 24, "comment": "9a2eecfdacc3452b", "expr": []}},
      {"rule": {"family": "inet", "table": "egressgw", "chain": "postrouting_nat", "handle": 25, "expr": []}}]}"#;
    let obs = parse_table(json).unwrap();
    let classify: Vec<String> = obs
        .classify
        .iter()
        .map(|(k, v)| format!("{k} : {v}"))
        .collect();
    assert_eq!(
        classify,
        [
            "10.244.1.2 . 0.0.0.0-203.0.112.255 : jump mark_01000000",
            "10.244.1.3 . 0.0.0.0/0 : jump local",
            "10.244.1.4 . 192.0.2.1 : jump other",
        ]
    );
    assert_eq!(
        obs.classify.values().nth(2),
        Some(&Verdict::Other("other".into()))
    );
    let nat = shown_nat(&obs);
    assert_eq!(
        nat,
        [
            "10.244.1.2 . 8.8.8.0/24 : Masquerade",
            "fd00::1 . 2001:db8::/32 : Snat(2001:db8:ffff::1)"
        ]
    );
    let cluster: Vec<String> = obs.cluster.iter().map(ToString::to_string).collect();
    assert_eq!(cluster, ["10.0.0.1-10.0.0.9", "10.96.0.0/12", "10.200.0.1"]);
    assert_eq!(
        obs.chains["postrouting_nat"],
        ChainState {
            hook: Some(Hook {
                kind: "nat".into(),
                hook: "postrouting".into(),
                priority: 90
            }),
            fingerprints: vec!["9a2eecfdacc3452b".into(), String::new()],
        }
    );
    assert_eq!(
        obs.sets.iter().map(String::as_str).collect::<Vec<_>>(),
        ["classify4", "cluster4", "masq4", "snat6"]
    );
}

#[test]
fn elements_listed_before_their_sets_name_are_taken_into_that_set() {
    // nft prints a set's name before its elements; the parser takes each
    // element as it reads it, and holds those that come first until the
    // name is known.
    let json = r#"{"nftables": [
      {"map": {"elem": [[{"concat": ["10.244.1.2", {"prefix": {"addr": "192.0.2.0", "len": 24}}]}, "203.0.113.7"]],
               "family": "inet", "name": "snat4", "table": "egressgw"}},
      {"set": {"name": "masq4", "elem": [{"concat": ["10.244.1.3", {"prefix": {"addr": "0.0.0.0", "len": 0}}]}]}},
      {"counter": {"name": "policy_1", "packets": 1, "bytes": 2}}], "trailing": {"ignored": [1, 2]}}"#;
    let obs = parse_table(json).unwrap();
    let nat = shown_nat(&obs);
    assert_eq!(
        nat,
        [
            "10.244.1.2 . 192.0.2.0/24 : Snat(203.0.113.7)",
            "10.244.1.3 . 0.0.0.0/0 : Masquerade"
        ]
    );
    assert_eq!(
        obs.sets.iter().map(String::as_str).collect::<Vec<_>>(),
        ["masq4", "snat4"]
    );
    assert_eq!(obs.counters.iter().collect::<Vec<_>>(), ["policy_1"]);
}

#[test]
fn a_listing_that_is_not_nfts_json_is_an_error_naming_what_was_listed() {
    for json in [
        "",
        "[]",
        r#"{"nftables": {}}"#,
        r#"{"other": []}"#,
        r#"{"nftables": [{"set": {"name": "snat4", "elem": [1, 2"#,
        r#"{"nftables": []} {"nftables": []}"#,
    ] {
        let e = parse_table(json).expect_err(json).to_string();
        assert!(e.contains("parse list table inet egressgw"), "{json}: {e}");
        let e = parse_counters(json).expect_err(json).to_string();
        assert!(
            e.contains("parse list counters table inet egressgw"),
            "{json}: {e}"
        );
    }
    assert_eq!(
        parse_table(r#"{"nftables": []}"#).unwrap(),
        Observed::default()
    );
}

// Privileged tests: each runs in a network namespace of its own.

/// The table as the kernel holds it, read back whole (by a backend that
/// knows nothing of it yet).
fn observe_real(_nft: &mut Nft) -> Observed {
    Arc::unwrap_or_clone(Nft::new().observe().unwrap().expect("table exists"))
}

/// Asserts that the kernel holds exactly `spec`.
fn assert_holds(nft: &mut Nft, spec: &FirewallSpec) {
    let obs = observe_real(nft);
    assert_eq!(obs.classify, spec.classify);
    assert_eq!(obs.nat, spec.nat);
    assert_eq!(obs.cluster, spec.cluster);
    assert_eq!(obs.count, spec.count);
    assert_eq!(
        obs.counters,
        spec.counters.keys().cloned().collect::<BTreeSet<_>>()
    );
    let chains: BTreeMap<String, ChainState> = spec
        .chains()
        .iter()
        .map(|c| (c.name.clone(), c.state()))
        .collect();
    assert_eq!(obs.chains, chains);
    assert_eq!(plan(spec, Some(&obs)), []);
}

#[test]
fn an_applied_table_reads_back_as_desired_and_plans_nothing() {
    if !root_or_skip("an_applied_table_reads_back_as_desired_and_plans_nothing") {
        return;
    }
    in_new_netns(|| {
        let mut nft = Nft::new();
        assert_eq!(nft.observe().unwrap(), None);
        let report = nft.apply(&plan(&spec(), None));
        assert!(report.is_ok(), "{report:?}");
        assert!(report.warnings.is_empty(), "{report:?}");
        assert_holds(&mut nft, &spec());
    });
}

#[test]
fn the_kernel_checks_the_whole_table_and_keeps_nothing() {
    if !root_or_skip("the_kernel_checks_the_whole_table_and_keeps_nothing") {
        return;
    }
    in_new_netns(|| {
        let nft = Nft::new();
        assert_eq!(nft.check(&spec()).map_err(|e| e.to_string()), Ok(()));
        assert_eq!(sh("nft list tables").trim(), "");
        // Beside egressgw's own table, which it leaves alone.
        let mut real = Nft::new();
        assert!(real.apply(&plan(&spec(), None)).is_ok());
        assert_eq!(nft.check(&spec()).map_err(|e| e.to_string()), Ok(()));
        assert_eq!(sh("nft list tables").trim(), "table inet egressgw");
        // What the kernel refuses is an error: an element overlapping
        // another of the same map, in the table checked.
        let mut overlapping = spec();
        let (key, verdict) = overlapping
            .classify
            .iter()
            .next()
            .map(|(k, v)| (*k, v.clone()))
            .unwrap();
        let wider = ElemKey {
            src: key.src,
            dst: IpRange::of_net(net("0.0.0.0/1")),
        };
        overlapping.classify.insert(wider, verdict);
        let refused = nft.check(&overlapping).unwrap_err().to_string();
        assert!(refused.contains("exists"), "{refused}");
    });
}

#[test]
fn switching_the_datapath_replaces_the_prerouting_chain_and_keeps_the_elements() {
    if !root_or_skip("switching_the_datapath_replaces_the_prerouting_chain_and_keeps_the_elements")
    {
        return;
    }
    in_new_netns(|| {
        let mut nft = Nft::new();
        let ebpf = FirewallSpec::for_datapath(&state(), &Config::default(), Datapath::Ebpf);
        assert!(nft.apply(&plan(&spec(), None)).is_ok());
        let ops = plan(&ebpf, Some(&observe_real(&mut nft)));
        assert!(
            ops.iter().all(|op| !matches!(op, FwOp::Classify(..))),
            "no element changes: {:?}",
            shown(&ops)
        );
        let report = nft.apply(&ops);
        assert!(report.is_ok() && report.warnings.is_empty(), "{report:?}");
        assert_holds(&mut nft, &ebpf);
        // And back.
        let back = plan(&spec(), Some(&observe_real(&mut nft)));
        assert!(nft.apply(&back).is_ok());
        assert_holds(&mut nft, &spec());
    });
}

#[test]
fn a_changed_spec_lands_in_one_transaction_and_reads_back_as_desired() {
    if !root_or_skip("a_changed_spec_lands_in_one_transaction_and_reads_back_as_desired") {
        return;
    }
    in_new_netns(|| {
        let mut nft = Nft::new();
        assert!(nft.apply(&plan(&spec(), None)).is_ok());
        let mut state = state();
        // A wider bypass overlapping old ranges, a new mark, a dropped
        // IPv6 source, a changed EIP, a masquerade that becomes SNAT,
        // another cluster prefix and another tunnel device name.
        state.classify[1].dst = net("203.0.112.0/23");
        state.classify[2].action = tunnel(0x0300_0000);
        state.classify.retain(|e| !e.src.is_ipv6());
        // Another policy takes over the source: its counter comes, the old
        // one goes once no element names it.
        let q = Some(PolicyRef::namespaced("a", "q").into());
        state.classify[0].policy.clone_from(&q);
        state.classify[2].policy = q;
        let snat = Arc::make_mut(&mut state.snat);
        snat[0].to = SnatTo::Eip(ip("192.0.2.11"));
        snat[1].to = SnatTo::Eip(ip("192.0.2.12"));
        state.cluster_cidrs.push(net("10.245.0.0/16"));
        let mut cfg = Config::default();
        cfg.vxlan.name = "egw0".into();
        let desired = FirewallSpec::new(&state, &cfg);
        let ops = plan(&desired, Some(&observe_real(&mut nft)));
        let report = nft.apply(&ops);
        assert!(report.is_ok(), "{report:?}");
        assert!(report.warnings.is_empty(), "{report:?}");
        assert_holds(&mut nft, &desired);
        let counters: Vec<_> = nft.counters().unwrap().into_keys().collect();
        assert_eq!(
            counters,
            [counter_name(&PolicyRef::namespaced("a", "q"))],
            "{:?}",
            shown(&ops)
        );
        let listing = sh("nft list chain inet egressgw postrouting_mark");
        assert!(listing.contains("oifname \"egw0\""), "{listing}");
    });
}

#[test]
fn a_bad_op_is_reported_while_the_others_land() {
    if !root_or_skip("a_bad_op_is_reported_while_the_others_land") {
        return;
    }
    in_new_netns(|| {
        let mut nft = Nft::new();
        let key = ElemKey {
            src: ip("10.244.1.9"),
            dst: IpRange::of_net(net("192.0.2.0/24")),
        };
        let bad = FwOp::Classify(ElemChange::Add, key, Verdict::Mark(0x0a00_0000));
        let mut ops = plan(&spec(), None);
        ops.insert(ops.len() / 2, bad.clone());
        let report = nft.apply(&ops);
        assert_eq!(report.failed.len(), 1, "{report:?}");
        assert_eq!(
            report.failed[0].op.text,
            "add element classify4 { 10.244.1.9 . 192.0.2.0/24 : jump mark_0a000000 }"
        );
        assert_eq!(report.failed[0].cause, Cause::Missing);
        assert!(
            report.failed[0].error.contains("No such file or directory"),
            "{report:?}"
        );
        assert_eq!(report.applied.len(), ops.len() - 1);
        assert_eq!(report.warnings.len(), 1);
        assert_holds(&mut nft, &spec());
    });
}

#[test]
fn remove_deletes_the_table_and_leaves_the_rest_of_the_ruleset() {
    if !root_or_skip("remove_deletes_the_table_and_leaves_the_rest_of_the_ruleset") {
        return;
    }
    in_new_netns(|| {
        sh("nft add table ip other && nft add chain ip other c");
        let before = sh("nft list ruleset");
        let mut nft = Nft::new();
        assert!(!nft.remove().unwrap());
        assert!(nft.apply(&plan(&spec(), None)).is_ok());
        assert!(nft.remove().unwrap());
        assert_eq!(sh("nft list ruleset"), before);
        assert_eq!(nft.observe().unwrap(), None);
    });
}

#[test]
fn the_table_loads_beside_an_iptables_legacy_masquerade() {
    if !root_or_skip("the_table_loads_beside_an_iptables_legacy_masquerade") {
        return;
    }
    in_new_netns(|| {
        sh("iptables-legacy -t nat -A POSTROUTING -j MASQUERADE");
        let mut nft = Nft::new();
        let report = nft.apply(&plan(&spec(), None));
        assert!(report.is_ok(), "{report:?}");
        assert_holds(&mut nft, &spec());
        assert!(sh("nft list ruleset").contains("table inet egressgw"));
        assert!(sh("iptables-legacy -t nat -S POSTROUTING").contains("-j MASQUERADE"));
    });
}

/// The backend takes the table as known while the ruleset's generation is
/// the one its own last transaction left: each observation must be what a
/// full read back gives, an observation with nothing changed reads
/// nothing, and whatever someone changes by hand (a chain flushed, a map
/// flushed, an element deleted, the table deleted, another table added) is
/// seen at the next observation.
#[test]
fn what_the_backend_knows_of_the_table_is_what_the_kernel_holds() {
    if !root_or_skip("what_the_backend_knows_of_the_table_is_what_the_kernel_holds") {
        return;
    }
    in_new_netns(|| {
        let mut nft = Nft::new();
        assert_eq!(nft.observe().unwrap(), None);
        let mut state = state();
        Arc::make_mut(&mut state.snat)[0].to = SnatTo::Eip(ip("192.0.2.11"));
        state.classify.retain(|e| !e.src.is_ipv6());
        state.classify[0].action = tunnel(0x0300_0000);
        let changed = FirewallSpec::new(&state, &Config::default());
        for desired in [&spec(), &changed, &spec()] {
            let known = nft.observe().unwrap();
            assert_eq!(known, Nft::new().observe().unwrap());
            let report = nft.apply(&plan(desired, known.as_deref()));
            assert!(report.is_ok(), "{report:?}");
            assert_holds(&mut nft, desired);
            let reads = nft.reads();
            assert_eq!(plan(desired, nft.observe().unwrap().as_deref()), []);
            assert_eq!(nft.reads(), reads, "nothing changed, nothing read");
        }

        let key = *spec().classify.keys().find(|k| k.src.is_ipv4()).unwrap();
        let by_hand = [
            "nft flush chain inet egressgw postrouting_mark".to_owned(),
            "nft flush map inet egressgw snat4".to_owned(),
            format!("nft delete element inet egressgw classify4 {{ {key} }}"),
            "nft add table ip other".to_owned(),
            "nft delete table inet egressgw".to_owned(),
        ];
        for change in &by_hand {
            sh(change);
            let observed = nft.observe().unwrap();
            assert_eq!(observed, Nft::new().observe().unwrap(), "after {change}");
            let ops = plan(&spec(), observed.as_deref());
            assert_eq!(
                ops.is_empty(),
                change.contains("ip other"),
                "after {change}: {:?}",
                shown(&ops)
            );
            assert!(nft.apply(&ops).is_ok());
            assert_holds(&mut nft, &spec());
        }
    });
}

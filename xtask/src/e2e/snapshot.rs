//! The kernel state of a node namespace as text, to compare before an
//! install and after an uninstall: links, addresses, rules and routes of
//! every table, permanent neighbours, FDB entries, the nftables ruleset,
//! the iptables rules and the `net.*` sysctls.
//!
//! What traffic and time change by themselves are left out or normalised:
//! learned neighbours and FDB entries (and the multicast entries IPv6 adds
//! as it joins groups), bridge timers, rule counters, conntrack's count.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use anyhow::Context;

use crate::lab::cmd;
use crate::lab::topology::Netns;

/// What is read, each with the command that reads it.
const PARTS: [(&str, &[&str]); 11] = [
    ("links", &["ip", "-o", "link", "show"]),
    ("addresses", &["ip", "-o", "address", "show"]),
    ("ipv4 rules", &["ip", "-4", "rule", "show"]),
    ("ipv6 rules", &["ip", "-6", "rule", "show"]),
    (
        "ipv4 routes",
        &["ip", "-4", "route", "show", "table", "all"],
    ),
    (
        "ipv6 routes",
        &["ip", "-6", "route", "show", "table", "all"],
    ),
    ("neighbours", &["ip", "neigh", "show", "nud", "permanent"]),
    ("fdb", &["bridge", "fdb", "show"]),
    ("nftables", &["nft", "list", "ruleset"]),
    ("iptables", &["iptables-save"]),
    ("iptables-legacy", &["iptables-legacy-save"]),
];

/// The state of `ns`, one `[part] line` per line.
pub fn take(ns: &Netns) -> anyhow::Result<BTreeSet<String>> {
    let mut lines = BTreeSet::new();
    for (part, argv) in PARTS {
        let out = exec(ns, argv).with_context(|| format!("reading the {part} of {ns}"))?;
        lines.extend(normalise(part, &out).map(|l| format!("[{part}] {l}")));
    }
    let sysctls = exec(ns, &["sysctl", "-a", "-e", "-r", "^net\\."])
        .with_context(|| format!("reading the sysctls of {ns}"))?;
    lines.extend(normalise("sysctl", &sysctls).map(|l| format!("[sysctl] {l}")));
    Ok(lines)
}

fn exec(ns: &Netns, argv: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["netns", "exec", ns.as_str()];
    all.extend_from_slice(argv);
    cmd::run("ip", &all)
}

/// The lines of one part that describe configuration, not traffic.
fn normalise<'a>(part: &'a str, text: &'a str) -> impl Iterator<Item = String> + 'a {
    text.lines().filter_map(move |line| {
        let line = line.trim_end();
        let skip = line.is_empty()
            || line.starts_with('#')
            || (part == "fdb" && is_learned(line))
            || (part == "sysctl" && is_volatile_sysctl(line));
        (!skip).then(|| strip_counters(line))
    })
}

/// Whether an FDB line is a learned entry (traffic, aging out after a few
/// minutes), not one configured: `bridge fdb show` prints a learned entry
/// with no state (`aa:bb:cc:dd:ee:ff dev veth0 master br0`) or, when added
/// so, `dynamic`; configured ones say `permanent` or `static`.
fn is_learned(line: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    words.contains(&"dynamic") || !(words.contains(&"permanent") || words.contains(&"static"))
}

fn is_volatile_sysctl(line: &str) -> bool {
    [
        "nf_conntrack_count",
        "route.flush",
        "stable_secret",
        "neigh.default.gc",
    ]
    .iter()
    .any(|v| line.contains(v))
}

/// `counter packets 12 bytes 3400` -> `counter`, `[12:3400]` -> `[:]`.
fn strip_counters(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut words = line.split(' ').peekable();
    let mut first = true;
    while let Some(word) = words.next() {
        if (word == "packets" || word == "bytes")
            && words
                .peek()
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        {
            words.next();
            continue;
        }
        if !first {
            out.push(' ');
        }
        first = false;
        if word.starts_with('[') && word.ends_with(']') && word.contains(':') {
            out.push_str("[:]");
        } else {
            out.push_str(word);
        }
    }
    out
}

/// The differences between two snapshots: lines only before (`-`) and only
/// after (`+`); empty when they are equal.
pub fn diff(before: &BTreeSet<String>, after: &BTreeSet<String>) -> String {
    let mut out = String::new();
    for line in before.difference(after) {
        let _ = writeln!(out, "- {line}");
    }
    for line in after.difference(before) {
        let _ = writeln!(out, "+ {line}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_do_not_count_as_changes() {
        assert_eq!(
            strip_counters("  ip saddr 10.0.0.0/8 counter packets 12 bytes 3400 masquerade"),
            "  ip saddr 10.0.0.0/8 counter masquerade"
        );
        assert_eq!(
            strip_counters(":POSTROUTING ACCEPT [12:3400]"),
            ":POSTROUTING ACCEPT [:]"
        );
    }

    #[test]
    fn learned_fdb_entries_and_conntrack_counts_are_left_out() {
        let fdb: Vec<String> = normalise(
            "fdb",
            "aa:bb:cc:dd:ee:ff dev eth0 master br0\n33:33:00:00:00:01 dev eth0 self permanent\n\
             11:22:33:44:55:66 dev eth0 dynamic\n\
             02:00:00:00:00:02 dev vx0 dst 172.18.0.12 self static\n",
        )
        .collect();
        assert_eq!(
            fdb,
            [
                "33:33:00:00:00:01 dev eth0 self permanent",
                "02:00:00:00:00:02 dev vx0 dst 172.18.0.12 self static"
            ]
        );
        let sysctl: Vec<String> = normalise(
            "sysctl",
            "net.netfilter.nf_conntrack_count = 4\nnet.ipv4.ip_forward = 1\n",
        )
        .collect();
        assert_eq!(sysctl, ["net.ipv4.ip_forward = 1"]);
    }

    #[test]
    fn a_device_left_behind_shows_in_the_diff() {
        let before: BTreeSet<String> = ["[links] 1: lo".to_owned()].into();
        let mut after = before.clone();
        after.insert("[links] 7: egress.vxlan".to_owned());
        assert_eq!(diff(&before, &after), "+ [links] 7: egress.vxlan\n");
        assert_eq!(diff(&before, &before), "");
    }
}

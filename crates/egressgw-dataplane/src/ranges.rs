//! Per-source longest-prefix tables flattened into disjoint address ranges.
//!
//! nftables interval sets with concatenated keys (`src . dst`) reject
//! overlapping elements, while egressgw's classification and SNAT tables are
//! longest-prefix tables whose entries nest (`0.0.0.0/0` tunnelled with a
//! `/26` bypassed inside it). [`disjoint`] turns such a table into ranges that
//! never overlap and answer every lookup the same way.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egressgw_core::net::IpRange;
use ipnet::IpNet;

/// One disjoint destination range of one source, with its value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SrcRange<V> {
    /// The source address.
    pub src: IpAddr,
    /// The destination addresses.
    pub dst: IpRange,
    /// What packets from `src` to `dst` get.
    pub value: V,
}

/// Flattens per-source longest-prefix entries `(src, dst, value)` into
/// disjoint destination ranges.
///
/// For each source the longest destination prefix containing an address
/// decides its value; `None` is a hole (e.g. a bypassed destination carved
/// out of a wider tunnelled one) and produces no range. Guarantees:
/// - the output is sorted by source, then destination, and for one source no
///   two ranges share an address;
/// - adjacent ranges of one source with equal values are merged;
/// - looking an address up in the output gives the longest-prefix answer.
///
/// Entries whose source and destination families differ are ignored. When
/// the same `(src, dst)` appears more than once, the last entry wins.
pub fn disjoint<V: Clone + Eq>(
    entries: impl IntoIterator<Item = (IpAddr, IpNet, Option<V>)>,
) -> Vec<SrcRange<V>> {
    // One list sorted by source, then prefix, rather than a map per
    // source: a node's table has one or a few prefixes for each of tens
    // of thousands of sources. The sort is stable, so that of entries with
    // the same source and prefix the last one given is kept.
    let mut keyed: Vec<(IpAddr, Prefix, Option<V>)> = entries
        .into_iter()
        .filter(|(src, dst, _)| src.is_ipv4() == dst.addr().is_ipv4())
        .map(|(src, dst, value)| {
            let dst = dst.trunc();
            (src, (to_u128(dst.network()), dst.prefix_len()), value)
        })
        .collect();
    keyed.sort_by_key(|(src, prefix, _)| (*src, *prefix));
    let mut prefixes: Vec<(Prefix, Option<V>)> = Vec::new();
    let mut out: Vec<SrcRange<V>> = Vec::new();
    let mut keyed = keyed.into_iter().peekable();
    while let Some((src, prefix, value)) = keyed.next() {
        match prefixes.last_mut() {
            Some((last, kept)) if *last == prefix => *kept = value,
            _ => prefixes.push((prefix, value)),
        }
        if keyed.peek().is_some_and(|(next, ..)| *next == src) {
            continue;
        }
        let before = out.len();
        sweep(src, &prefixes, &mut |first, last, value: &V| {
            let (first, last) = (from_u128(src, first), from_u128(src, last));
            let same_src = out.len() > before;
            match out.last_mut() {
                Some(prev)
                    if same_src
                        && prev.value == *value
                        && to_u128(prev.dst.last()).checked_add(1) == Some(to_u128(first)) =>
                {
                    prev.dst = IpRange::new(prev.dst.first(), last).expect("ascending sweep");
                }
                _ => out.push(SrcRange {
                    src,
                    dst: IpRange::new(first, last).expect("ascending sweep"),
                    value: value.clone(),
                }),
            }
        });
        prefixes.clear();
    }
    out
}

/// A destination prefix as its network address and length: in this order,
/// a prefix comes after every prefix that encloses it.
type Prefix = (u128, u8);

/// Walks one source's prefixes in address order and calls `emit` for every
/// maximal segment covered by the same innermost prefix with a value.
///
/// `prefixes` is keyed by (network, prefix length), so a prefix comes after
/// every prefix that encloses it: prefixes nest or are disjoint, and a stack
/// of the open ones holds the innermost on top.
fn sweep<V>(src: IpAddr, prefixes: &[(Prefix, Option<V>)], emit: &mut impl FnMut(u128, u128, &V)) {
    let bits = bits(src);
    // Open prefixes: (last address, value), innermost on top.
    let mut stack: Vec<(u128, &Option<V>)> = Vec::new();
    // The first address not yet emitted or skipped; `None` past the end.
    let mut cursor: Option<u128> = Some(0);
    let mut close = |upto: u128, value: &Option<V>, cursor: &mut Option<u128>| {
        if let Some(c) = *cursor
            && c <= upto
        {
            if let Some(v) = value {
                emit(c, upto, v);
            }
            *cursor = upto.checked_add(1);
        }
    };
    for ((first, len), value) in prefixes {
        let (first, len) = (*first, *len);
        let host_bits = bits - u32::from(len);
        let last = first | low_mask(host_bits);
        while let Some(&(top_last, top_value)) = stack.last() {
            if top_last >= first {
                break;
            }
            close(top_last, top_value, &mut cursor);
            stack.pop();
        }
        match stack.last() {
            Some(&(_, top_value)) if first > 0 => close(first - 1, top_value, &mut cursor),
            _ => {}
        }
        cursor = Some(first);
        stack.push((last, value));
    }
    while let Some((top_last, top_value)) = stack.pop() {
        close(top_last, top_value, &mut cursor);
    }
}

/// The lowest `host_bits` bits set.
fn low_mask(host_bits: u32) -> u128 {
    if host_bits == 0 {
        0
    } else {
        u128::MAX >> (128 - host_bits)
    }
}

fn bits(ip: IpAddr) -> u32 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The address of `like`'s family with value `n` (saturated to 32 bits for IPv4).
fn from_u128(like: IpAddr, n: u128) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap_or(u32::MAX))),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn show<V: std::fmt::Debug>(ranges: &[SrcRange<V>]) -> Vec<String> {
        ranges
            .iter()
            .map(|r| format!("{} . {} : {:?}", r.src, r.dst, r.value))
            .collect()
    }

    /// The longest-prefix answer for `(src, dst)`, the reference `disjoint` must match.
    fn longest_prefix<V: Clone>(
        entries: &[(IpAddr, IpNet, Option<V>)],
        src: IpAddr,
        dst: IpAddr,
    ) -> Option<V> {
        entries
            .iter()
            .enumerate()
            .filter(|(_, (s, d, _))| *s == src && d.contains(&dst))
            .max_by_key(|(i, (_, d, _))| (d.prefix_len(), *i))
            .and_then(|(_, (_, _, v))| v.clone())
    }

    fn lookup<V: Clone>(ranges: &[SrcRange<V>], src: IpAddr, dst: IpAddr) -> Option<V> {
        let mut hits = ranges
            .iter()
            .filter(|r| r.src == src && r.dst.contains(dst));
        let hit = hits.next().map(|r| r.value.clone());
        assert!(
            hits.next().is_none(),
            "overlapping ranges for {src} -> {dst}"
        );
        hit
    }

    #[test]
    fn a_bypass_hole_splits_the_default_route_in_two() {
        let out = disjoint([
            (ip("10.244.1.2"), net("0.0.0.0/0"), Some("gw1")),
            (ip("10.244.1.2"), net("203.0.113.192/26"), None),
        ]);
        assert_eq!(
            show(&out),
            [
                "10.244.1.2 . 0.0.0.0-203.0.113.191 : \"gw1\"",
                "10.244.1.2 . 203.0.114.0-255.255.255.255 : \"gw1\"",
            ]
        );
    }

    #[test]
    fn a_nested_prefix_with_another_value_is_cut_out_and_equal_neighbours_merge() {
        let out = disjoint([
            (ip("10.0.0.1"), net("198.51.100.0/24"), Some(1)),
            (ip("10.0.0.1"), net("198.51.100.128/25"), Some(2)),
            (ip("10.0.0.1"), net("198.51.100.130/32"), Some(1)),
            (ip("10.0.0.1"), net("198.51.101.0/24"), Some(1)),
            (ip("10.0.0.2"), net("198.51.100.0/24"), Some(1)),
        ]);
        assert_eq!(
            show(&out),
            [
                "10.0.0.1 . 198.51.100.0/25 : 1",
                "10.0.0.1 . 198.51.100.128/31 : 2",
                "10.0.0.1 . 198.51.100.130 : 1",
                "10.0.0.1 . 198.51.100.131-198.51.100.255 : 2",
                "10.0.0.1 . 198.51.101.0/24 : 1",
                "10.0.0.2 . 198.51.100.0/24 : 1",
            ]
        );
    }

    #[test]
    fn ipv6_ranges_reach_the_top_of_the_address_space() {
        let out = disjoint([
            (ip("fd00::1"), net("::/0"), Some('t')),
            (ip("fd00::1"), net("2001:db8::/32"), Some('l')),
            (ip("fd00::1"), net("ffff::/16"), None),
        ]);
        assert_eq!(
            show(&out),
            [
                "fd00::1 . ::-2001:db7:ffff:ffff:ffff:ffff:ffff:ffff : 't'",
                "fd00::1 . 2001:db8::/32 : 'l'",
                "fd00::1 . 2001:db9::-fffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff : 't'",
            ]
        );
        assert_eq!(
            show(&disjoint([(ip("fd00::1"), net("::/0"), Some(()))])),
            ["fd00::1 . ::/0 : ()"]
        );
    }

    #[test]
    fn mixed_family_entries_are_ignored_and_the_last_duplicate_wins() {
        let out = disjoint([
            (ip("10.0.0.1"), net("2001:db8::/32"), Some(1)),
            (ip("10.0.0.1"), net("192.0.2.0/24"), Some(1)),
            (ip("10.0.0.1"), net("192.0.2.7/24"), Some(2)),
        ]);
        assert_eq!(show(&out), ["10.0.0.1 . 192.0.2.0/24 : 2"]);
    }

    #[test]
    fn ranges_display_as_an_address_a_prefix_or_a_span() {
        let r = |a: &str, b: &str| IpRange::new(ip(a), ip(b)).unwrap().to_string();
        assert_eq!(r("10.0.0.1", "10.0.0.1"), "10.0.0.1");
        assert_eq!(r("10.0.0.0", "10.0.0.255"), "10.0.0.0/24");
        assert_eq!(r("10.0.0.1", "10.0.0.2"), "10.0.0.1-10.0.0.2");
        assert_eq!(r("10.0.0.2", "10.0.0.3"), "10.0.0.2/31");
        assert_eq!(r("0.0.0.0", "255.255.255.255"), "0.0.0.0/0");
        assert!(IpRange::new(ip("10.0.0.2"), ip("10.0.0.1")).is_none());
        assert!(IpRange::new(ip("10.0.0.2"), ip("::1")).is_none());
    }

    /// Addresses inside a small window so random prefixes overlap often.
    fn v4_in_window() -> impl Strategy<Value = IpAddr> {
        (0u32..512).prop_map(|n| IpAddr::V4(Ipv4Addr::from(0xc000_0200 + n)))
    }

    fn entry() -> impl Strategy<Value = (IpAddr, IpNet, Option<u8>)> {
        (
            0u8..3,
            v4_in_window(),
            prop_oneof![0u8..=1, 20u8..=32],
            proptest::option::weighted(0.8, 0u8..3),
        )
            .prop_map(|(s, d, len, v)| {
                let src = IpAddr::V4(Ipv4Addr::new(10, 0, 0, s));
                (src, IpNet::new(d, len).unwrap().trunc(), v)
            })
    }

    proptest! {
        #[test]
        fn every_lookup_in_the_ranges_gives_the_longest_prefix_answer(
            entries in proptest::collection::vec(entry(), 0..12),
            probes in proptest::collection::vec((0u8..3, v4_in_window()), 64),
        ) {
            let out = disjoint(entries.clone());
            let mut probes = probes;
            // Probe every boundary too, where off-by-one errors live.
            for r in &out {
                for a in [r.dst.first(), r.dst.last()] {
                    let n = to_u128(a);
                    for m in [n.saturating_sub(1), n, n.saturating_add(1).min(0xffff_ffff)] {
                        if let IpAddr::V4(s) = r.src {
                            probes.push((s.octets()[3], from_u128(a, m)));
                        }
                    }
                }
            }
            for (s, dst) in probes {
                let src = IpAddr::V4(Ipv4Addr::new(10, 0, 0, s));
                prop_assert_eq!(lookup(&out, src, dst), longest_prefix(&entries, src, dst));
            }
            for pair in out.windows(2) {
                prop_assert!(pair[0] < pair[1]);
                if pair[0].src == pair[1].src {
                    prop_assert!(pair[0].dst.last() < pair[1].dst.first());
                    let adjacent = to_u128(pair[0].dst.last()) + 1 == to_u128(pair[1].dst.first());
                    prop_assert!(!(adjacent && pair[0].value == pair[1].value), "unmerged");
                }
            }
        }
    }
}

//! Which policy wins for a destination, and how that decision is compiled
//! into a longest-prefix-match table a dataplane can use as is.
//!
//! For one source, among the policies whose destinations contain an address
//! and whose exclusions do not:
//! 1. the one whose matching destination prefix is the most specific wins;
//! 2. on equal prefixes, the higher `priority` wins;
//! 3. then the older policy (the lower index: callers pass policies oldest first).
//!
//! [`winner`] states the rule address by address; [`compile`] turns it into
//! a table such that [`lookup`] (plain longest-prefix match) gives the same
//! answer for every address. The property tests hold the two together.

use std::cmp::Reverse;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::net::{Family, net_contains};

/// One policy as precedence sees it. Index in the slice = age rank (0 = oldest).
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// Destination prefixes (already expanded: "everything" is `0.0.0.0/0` / `::/0`).
    pub dests: &'a [IpNet],
    /// Excluded prefixes.
    pub excludes: &'a [IpNet],
    /// `spec.priority`.
    pub priority: i32,
}

/// The reference rule: the index of the policy that decides `addr`, if any.
pub fn winner(addr: IpAddr, candidates: &[Candidate<'_>]) -> Option<usize> {
    let host = Family::host(addr);
    best(
        candidates,
        |nets| {
            nets.iter()
                .filter(|n| n.contains(&addr))
                .map(IpNet::prefix_len)
                .max()
        },
        &host,
    )
}

/// A longest-prefix-match table for `family`: (prefix, deciding policy or
/// `None` = no policy). Redundant entries are left out; the order is by
/// prefix length, then address.
pub fn compile(family: Family, candidates: &[Candidate<'_>]) -> Vec<(IpNet, Option<usize>)> {
    let mut prefixes: Vec<IpNet> = candidates
        .iter()
        .flat_map(|c| c.dests.iter().chain(c.excludes))
        .copied()
        .filter(|n| Family::of_net(*n) == family)
        .collect();
    prefixes.sort_by_key(|n| (n.prefix_len(), n.network()));
    prefixes.dedup();

    let decided: Vec<Option<usize>> = prefixes
        .iter()
        .map(|p| {
            best(
                candidates,
                |nets| {
                    nets.iter()
                        .filter(|n| net_contains(n, p))
                        .map(IpNet::prefix_len)
                        .max()
                },
                p,
            )
        })
        .collect();

    let mut table = Vec::new();
    for (i, p) in prefixes.iter().enumerate() {
        // The parent is the longest strictly shorter prefix containing p; with
        // prefixes sorted by length it is the last such one before i.
        let parent = prefixes[..i]
            .iter()
            .rposition(|q| q.prefix_len() < p.prefix_len() && net_contains(q, p))
            .and_then(|j| decided[j]);
        if decided[i] != parent {
            table.push((*p, decided[i]));
        }
    }
    table
}

/// Longest-prefix match over a compiled table.
pub fn lookup(table: &[(IpNet, Option<usize>)], addr: IpAddr) -> Option<usize> {
    table
        .iter()
        .filter(|(n, _)| n.contains(&addr))
        .max_by_key(|(n, _)| n.prefix_len())
        .and_then(|(_, w)| *w)
}

/// The best candidate for a region: `specificity(dests)` gives the length of
/// the most specific destination prefix containing the region, if any;
/// `region` is excluded by any exclusion prefix that contains it.
fn best(
    candidates: &[Candidate<'_>],
    specificity: impl Fn(&[IpNet]) -> Option<u8>,
    region: &IpNet,
) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.excludes.iter().any(|e| net_contains(e, region)))
        .filter_map(|(i, c)| specificity(c.dests).map(|len| ((len, c.priority, Reverse(i)), i)))
        .max_by_key(|(key, _)| *key)
        .map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_most_specific_destination_wins_over_priority() {
        let (a, b) = (nets(&["10.0.0.0/8"]), nets(&["10.1.0.0/16"]));
        let c = [
            Candidate {
                dests: &a,
                excludes: &[],
                priority: 100,
            },
            Candidate {
                dests: &b,
                excludes: &[],
                priority: 0,
            },
        ];
        assert_eq!(winner(ip("10.1.2.3"), &c), Some(1));
        assert_eq!(winner(ip("10.2.2.3"), &c), Some(0));
    }

    #[test]
    fn on_equal_prefixes_the_higher_priority_wins() {
        let d = nets(&["10.0.0.0/8"]);
        let c = [
            Candidate {
                dests: &d,
                excludes: &[],
                priority: 1,
            },
            Candidate {
                dests: &d,
                excludes: &[],
                priority: 5,
            },
        ];
        assert_eq!(winner(ip("10.9.9.9"), &c), Some(1));
    }

    #[test]
    fn on_equal_prefix_and_priority_the_older_wins() {
        let d = nets(&["10.0.0.0/8"]);
        let c = [
            Candidate {
                dests: &d,
                excludes: &[],
                priority: 3,
            },
            Candidate {
                dests: &d,
                excludes: &[],
                priority: 3,
            },
        ];
        assert_eq!(winner(ip("10.9.9.9"), &c), Some(0));
    }

    #[test]
    fn an_exclusion_hands_the_hole_to_the_next_policy_not_to_nobody() {
        let (a, ax, b) = (
            nets(&["0.0.0.0/0"]),
            nets(&["10.1.0.0/16"]),
            nets(&["10.0.0.0/8"]),
        );
        let c = [
            Candidate {
                dests: &a,
                excludes: &ax,
                priority: 0,
            },
            Candidate {
                dests: &b,
                excludes: &[],
                priority: 0,
            },
        ];
        // b is more specific in 10/8 anyway; check a hole that only a covers.
        let table = compile(Family::Ipv4, &c);
        assert_eq!(lookup(&table, ip("10.1.0.1")), Some(1));
        assert_eq!(lookup(&table, ip("8.8.8.8")), Some(0));
        let only_a = [c[0]];
        let table = compile(Family::Ipv4, &only_a);
        assert_eq!(lookup(&table, ip("10.1.0.1")), None);
        assert_eq!(
            table,
            vec![(nets(&["0.0.0.0/0"])[0], Some(0)), (ax[0], None)]
        );
    }

    #[test]
    fn compile_leaves_out_entries_that_repeat_their_parent() {
        let (a, b) = (nets(&["10.0.0.0/8"]), nets(&["10.1.0.0/16"]));
        let c = [
            Candidate {
                dests: &a,
                excludes: &[],
                priority: 9,
            },
            Candidate {
                dests: &b,
                excludes: &[],
                priority: 0,
            },
            Candidate {
                dests: &a,
                excludes: &[],
                priority: 0,
            },
        ];
        let table = compile(Family::Ipv4, &c);
        assert_eq!(table, vec![(a[0], Some(0)), (b[0], Some(1))]);
    }

    fn arb_net() -> impl Strategy<Value = IpNet> {
        // A small universe (10.0.0.0/16) so prefixes nest and overlap often.
        (0u32..=0xffff, 16u8..=32).prop_map(|(low, len)| {
            let addr = std::net::Ipv4Addr::from(0x0a00_0000 | low);
            IpNet::new(IpAddr::V4(addr), len).unwrap().trunc()
        })
    }

    fn arb_policies() -> impl Strategy<Value = Vec<(Vec<IpNet>, Vec<IpNet>, i32)>> {
        prop::collection::vec(
            (
                prop::collection::vec(arb_net(), 1..4),
                prop::collection::vec(arb_net(), 0..3),
                0i32..3,
            ),
            1..6,
        )
    }

    proptest! {
        #[test]
        fn the_compiled_table_agrees_with_the_rule_for_every_address(
            policies in arb_policies(),
            probes in prop::collection::vec(0u32..=0xffff, 64),
        ) {
            let candidates: Vec<Candidate<'_>> = policies
                .iter()
                .map(|(d, e, p)| Candidate { dests: d, excludes: e, priority: *p })
                .collect();
            let table = compile(Family::Ipv4, &candidates);
            let mut keys: Vec<IpNet> = table.iter().map(|(n, _)| *n).collect();
            keys.dedup();
            prop_assert_eq!(keys.len(), table.len(), "a prefix appears twice");
            let mut probes: Vec<IpAddr> = probes
                .into_iter()
                .map(|low| IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 | low)))
                .collect();
            // Also probe every prefix boundary, where mistakes hide.
            for (n, _) in &table {
                probes.push(n.network());
                probes.push(n.broadcast());
            }
            for addr in probes {
                prop_assert_eq!(lookup(&table, addr), winner(addr, &candidates), "at {}", addr);
            }
        }
    }
}

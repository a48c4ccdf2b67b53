//! One entry point to every parser of bytes the dataplane takes from
//! outside the process: the kernel's rtnetlink, ethtool and ctnetlink
//! replies, `nft`'s JSON listings, and what the network sends (frames
//! heard on the segment while an EIP is checked, echo replies of the
//! tunnel probes). Each takes arbitrary bytes and returns; none may panic.
//! The fuzz targets in `fuzz/` call these, and the inputs they once
//! found are replayed by this module's tests.

use std::net::IpAddr;

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;

use crate::{announce, conntrack, ethtool, netlink, nft, probe};

/// Which of the kernel's replies a buffer is read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// A netlink message of rtnetlink (links, addresses, neighbours,
    /// routes, rules), decoded by the netlink crate and then read by
    /// egressgw.
    Rtnetlink,
    /// The attributes of an ethtool `FEATURES_GET` reply.
    EthtoolFeatures,
    /// A ctnetlink dump: netlink messages of conntrack entries.
    Conntrack,
    /// `nft -j list table inet egressgw`.
    NftTable,
    /// `nft -j list counters table inet egressgw`.
    NftCounters,
}

impl Reply {
    /// Every kind, in a fixed order (a fuzz input's first byte picks one).
    pub const ALL: [Reply; 5] = [
        Reply::Rtnetlink,
        Reply::EthtoolFeatures,
        Reply::Conntrack,
        Reply::NftTable,
        Reply::NftCounters,
    ];
}

/// Reads `data` as the kernel reply `kind`; returns how many things it
/// found in it (objects, features, entries), for the tests to look at.
pub fn kernel_reply(kind: Reply, data: &[u8]) -> usize {
    match kind {
        Reply::Rtnetlink => rtnetlink(data),
        Reply::EthtoolFeatures => {
            ethtool::parse_features_reply(data).map_or(0, |sets| sets.known.len())
        }
        Reply::Conntrack => conntrack::messages(data)
            .iter()
            .filter_map(|m| conntrack::parse_entry(m.payload))
            .count(),
        Reply::NftTable => {
            let text = String::from_utf8_lossy(data);
            nft::parse_table(&text).map_or(0, |o| o.classify.len() + o.nat.len() + o.count.len())
        }
        Reply::NftCounters => {
            let text = String::from_utf8_lossy(data);
            nft::parse_counters(&text).map_or(0, |c| c.len())
        }
    }
}

fn rtnetlink(data: &[u8]) -> usize {
    let Ok(message) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(data) else {
        return 0;
    };
    let NetlinkPayload::InnerMessage(inner) = message.payload else {
        return 0;
    };
    match inner {
        RouteNetlinkMessage::NewLink(link) => {
            usize::from(netlink::vxlan_of("egress.vxlan", &link).is_some())
        }
        RouteNetlinkMessage::NewAddress(address) => {
            usize::from(netlink::address_of(&address).is_some())
        }
        RouteNetlinkMessage::NewNeighbour(neighbour) => {
            let (ip, mac) = netlink::neighbour_of(&neighbour);
            usize::from(ip.is_some()) + usize::from(mac.is_some())
        }
        RouteNetlinkMessage::NewRoute(route) => {
            let _ = netlink::table_of(&route);
            usize::from(netlink::route_of(&route).is_some())
        }
        RouteNetlinkMessage::NewRule(rule) => {
            let _ = netlink::other_rule_of(&rule);
            usize::from(netlink::rule_of(&rule).is_some())
        }
        _ => 0,
    }
}

/// Which of the network's packets a buffer is read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// An Ethernet frame heard on the segment while checking whether
    /// another host answers for an IPv4 EIP (ARP).
    SegmentV4,
    /// The same for an IPv6 EIP (neighbour discovery).
    SegmentV6,
    /// What a raw ICMPv4 socket of the tunnel probes reads (with the IPv4
    /// header).
    EchoV4,
    /// What a raw ICMPv6 socket of the tunnel probes reads.
    EchoV6,
}

impl Heard {
    /// Every kind, in a fixed order.
    pub const ALL: [Heard; 4] = [
        Heard::SegmentV4,
        Heard::SegmentV6,
        Heard::EchoV4,
        Heard::EchoV6,
    ];
}

/// Reads `data` as the packet `kind`; returns whether it meant something
/// to egressgw (a conflict for the EIP, an answer to a probe).
pub fn network_packet(kind: Heard, data: &[u8]) -> bool {
    let eip4: IpAddr = IpAddr::from([198, 51, 100, 10]);
    let eip6: IpAddr = IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x10]);
    let own = [[0x02, 0, 0, 0, 0, 1]];
    match kind {
        Heard::SegmentV4 => announce::conflict(data, eip4, &own).is_some(),
        Heard::SegmentV6 => announce::conflict(data, eip6, &own).is_some(),
        Heard::EchoV4 => probe::echo_reply_from(data, false, 0x1234).is_some(),
        Heard::EchoV6 => probe::echo_reply_from(data, true, 0x1234).is_some(),
    }
}

/// Splits a fuzz input: its first byte picks one of `kinds`, the rest is
/// the data.
pub fn pick<'i, T: Copy>(kinds: &[T], input: &'i [u8]) -> Option<(T, &'i [u8])> {
    let (first, data) = input.split_first()?;
    let kind = kinds.get(usize::from(*first) % kinds.len())?;
    Some((*kind, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input the fuzz targets kept (`fuzz/regressions/<target>/`) is
    /// read again without a panic.
    #[test]
    fn what_the_fuzz_targets_found_is_read_without_a_panic() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/regressions");
        let mut replayed = 0;
        for (target, run) in [
            ("kernel_replies", replay_kernel as fn(&[u8])),
            ("network_packets", replay_network),
        ] {
            let dir = std::path::Path::new(root).join(target);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries {
                let path = entry.expect("a readable directory").path();
                run(&std::fs::read(&path).expect("a readable input"));
                replayed += 1;
            }
        }
        assert!(replayed > 0, "no regression input under {root}");
    }

    fn replay_kernel(input: &[u8]) {
        if let Some((kind, data)) = pick(&Reply::ALL, input) {
            kernel_reply(kind, data);
        }
    }

    fn replay_network(input: &[u8]) {
        if let Some((kind, data)) = pick(&Heard::ALL, input) {
            network_packet(kind, data);
        }
    }

    #[test]
    fn real_replies_are_read_as_what_they_are() {
        // An nft counters listing as nft 1.0.6 prints it.
        let counters = br#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"counter": {"family": "inet", "name": "policy_1", "table": "egressgw", "handle": 1, "packets": 3, "bytes": 180}}]}"#;
        assert_eq!(kernel_reply(Reply::NftCounters, counters), 1);
        // An echo reply of a probe to 10.0.0.2, behind its IPv4 header.
        let mut echo = vec![0x45; 20];
        echo.extend_from_slice(&[0, 0, 0, 0, 0x12, 0x34, 0, 1]);
        echo.extend_from_slice(b"egressgw");
        echo.extend_from_slice(&[10, 0, 0, 2]);
        assert!(network_packet(Heard::EchoV4, &echo));
        assert!(!network_packet(Heard::EchoV6, &echo));
        assert_eq!(
            pick(&Heard::ALL, &[5, 1, 2]),
            Some((Heard::SegmentV6, &[1, 2][..]))
        );
        assert_eq!(pick(&Heard::ALL, &[]), None);
    }
}

//! Telling the neighbours that an EIP has moved to this node.
//!
//! When a gateway node takes an EIP, the routers and hosts of the segment
//! still map it to the previous node's MAC. A gratuitous ARP (IPv4) or an
//! unsolicited Neighbour Advertisement with the override flag (IPv6), sent
//! on every interface whose subnet contains the EIP, updates those entries at
//! once instead of after they time out. Receivers only update entries they
//! already have (Linux needs `arp_accept` / `accept_untracked_na` to create
//! new ones), which is what a failover needs.
//!
//! The frames are built here byte by byte and sent through a packet socket
//! (`pnet_datalink`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use pnet_datalink::{Channel, Config, NetworkInterface};

use crate::kernel::EIP_DEVICE;
use crate::{Error, Result};

const ETHERTYPE_ARP: u16 = 0x0806;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const ARP_REQUEST: u16 = 1;
const ARP_REPLY: u16 = 2;
const IPPROTO_ICMPV6: u8 = 58;
const ICMPV6_NEIGHBOUR_SOLICITATION: u8 = 135;
const ICMPV6_NEIGHBOUR_ADVERTISEMENT: u8 = 136;
const NA_FLAG_OVERRIDE: u8 = 0x20;
const ND_OPT_TARGET_LINK_LAYER_ADDRESS: u8 = 2;
/// Shortest Ethernet frame without its FCS; shorter ARP frames are padded.
const MIN_FRAME_LEN: usize = 60;
const BROADCAST_MAC: [u8; 6] = [0xff; 6];
/// ff02::1, all nodes on the link.
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

/// Announces `ip` on every interface that is up, not loopback, not
/// [`EIP_DEVICE`](crate::kernel::EIP_DEVICE), has a MAC, and has an address whose prefix
/// (shorter than a host prefix) contains `ip`: a gratuitous ARP request and
/// reply for IPv4, an unsolicited Neighbour Advertisement to ff02::1 for IPv6.
///
/// Returns the names of the interfaces it sent on, empty when no interface's
/// subnet contains `ip`. Every eligible interface is tried; when sending
/// fails on some, each failure is logged and the first is returned.
pub fn announce(ip: IpAddr) -> Result<Vec<String>> {
    let mut sent = Vec::new();
    let mut first_error = None;
    for iface in pnet_datalink::interfaces() {
        let candidate = Candidate::of(&iface);
        let Some(mac) = candidate.announcing_mac(ip) else {
            continue;
        };
        match send(&iface, &frames(ip, mac)) {
            Ok(()) => sent.push(iface.name),
            Err(message) => {
                let error = Error::Announce {
                    ip,
                    ifname: iface.name,
                    message,
                };
                tracing::warn!(egress_ip = %ip, "{error}");
                first_error.get_or_insert(error);
            }
        }
    }
    match first_error {
        Some(error) => Err(error),
        None => Ok(sent),
    }
}

/// Who else answers for `ip` on its segment, if anyone: before a node takes
/// an EIP it asks, as RFC 5227 has a host ask before using an address and
/// RFC 4862 (duplicate address detection) before using an IPv6 one.
///
/// On every interface [`announce`] would send on, a probe is sent `PROBES`
/// times over `wait`, and every frame is read until `wait` has passed. For
/// IPv4 the probe is an ARP request with sender address 0.0.0.0; a reply
/// from `ip`, a request from `ip` (someone announcing it), or another host's
/// probe for `ip` (someone taking it right now) means it is in use. For IPv6
/// it is a Neighbour Solicitation from `::` to `ip`'s solicited-node group;
/// a Neighbour Advertisement for `ip`, or another host's solicitation from
/// `::` for `ip`, means it is in use. Either way no neighbour learns anything
/// from the probe, and the answer names the MAC and interface. `None` means
/// no answer, or no interface on the EIP's segment at all (a routed EIP).
/// When the only interfaces on the segment are down, nothing can be asked
/// and nothing should be announced: that is an error.
pub fn answered_for(ip: IpAddr, wait: std::time::Duration) -> Result<Option<String>> {
    let mut listeners = Vec::new();
    let mut down = Vec::new();
    for iface in pnet_datalink::interfaces() {
        let candidate = Candidate::of(&iface);
        let Some(mac) = candidate.announcing_mac(ip) else {
            if (Candidate {
                up: true,
                ..candidate
            })
            .announcing_mac(ip)
            .is_some()
            {
                down.push(iface.name);
            }
            continue;
        };
        let config = Config {
            read_timeout: Some(std::time::Duration::from_millis(10)),
            ..packet_config()
        };
        let (tx, rx) = match pnet_datalink::channel(&iface, config) {
            Ok(Channel::Ethernet(tx, rx)) => (tx, rx),
            Ok(_) => continue,
            Err(e) => {
                return Err(Error::Announce {
                    ip,
                    ifname: iface.name,
                    message: format!("open packet socket: {e}"),
                });
            }
        };
        listeners.push((iface.name, mac, tx, rx));
    }
    if listeners.is_empty()
        && let Some(ifname) = down.into_iter().next()
    {
        return Err(Error::Announce {
            ip,
            ifname,
            message: "the link to the EIP's segment is down".into(),
        });
    }
    // Our own probes, sent on one interface, may be heard on another.
    let own: Vec<[u8; 6]> = listeners.iter().map(|(_, mac, _, _)| *mac).collect();
    let started = std::time::Instant::now();
    let every = wait / PROBES;
    let mut sent = 0;
    while started.elapsed() < wait {
        if sent < PROBES && started.elapsed() >= every * sent {
            for (name, mac, tx, _) in &mut listeners {
                if let Some(Err(e)) = tx.send_to(&probe(*mac, ip), None) {
                    return Err(Error::Announce {
                        ip,
                        ifname: name.clone(),
                        message: format!("send: {e}"),
                    });
                }
            }
            sent += 1;
        }
        for (name, _, _, rx) in &mut listeners {
            // A timeout or a short read: nothing this round.
            let Ok(frame) = rx.next() else {
                continue;
            };
            if let Some(who) = conflict(frame, ip, &own) {
                return Ok(Some(format!("{} on {name}", format_mac(who))));
            }
        }
    }
    Ok(None)
}

/// How many probes [`answered_for`] sends.
const PROBES: u32 = 3;

/// The probe [`answered_for`] sends for `ip` from `mac`.
fn probe(mac: [u8; 6], ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(ip) => arp_probe(mac, ip),
        IpAddr::V6(ip) => dad_probe(mac, ip),
    }
}

/// An ARP probe for `ip` (RFC 5227, 2.1.1): a broadcast request with a zero
/// sender address and a zero target MAC.
fn arp_probe(mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    let mut frame = ethernet_header(BROADCAST_MAC, mac, ETHERTYPE_ARP);
    frame.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4]);
    frame.extend_from_slice(&ARP_REQUEST.to_be_bytes());
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&ip.octets());
    frame.resize(MIN_FRAME_LEN, 0);
    frame
}

/// A duplicate address detection probe for `ip` (RFC 4862, 5.4.2): a
/// Neighbour Solicitation for `ip` from the unspecified address to `ip`'s
/// solicited-node group, hop limit 255, without a source link-layer option.
fn dad_probe(mac: [u8; 6], ip: Ipv6Addr) -> Vec<u8> {
    let group = solicited_node(ip);
    let mut icmp = vec![ICMPV6_NEIGHBOUR_SOLICITATION, 0, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&ip.octets());
    let checksum = icmpv6_checksum(Ipv6Addr::UNSPECIFIED, group, &icmp);
    icmp[2..4].copy_from_slice(&checksum.to_be_bytes());
    ipv6_frame(mac, Ipv6Addr::UNSPECIFIED, group, &icmp)
}

/// ff02::1:ffXX:XXXX, the group of every address ending in `ip`'s low 24
/// bits (RFC 4291, 2.7.1).
fn solicited_node(ip: Ipv6Addr) -> Ipv6Addr {
    let o = ip.octets();
    let mut group = [0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0, 0, 0];
    group[13..].copy_from_slice(&o[13..]);
    Ipv6Addr::from(group)
}

/// The sender MAC of `frame` if it says another host uses or is taking
/// `ip`. Frames from `own` MACs (our own probes, heard again) never count.
pub(crate) fn conflict(frame: &[u8], ip: IpAddr, own: &[[u8; 6]]) -> Option<[u8; 6]> {
    let sender_mac: [u8; 6] = frame.get(6..12)?.try_into().ok()?;
    if own.contains(&sender_mac) {
        return None;
    }
    let claims = match ip {
        IpAddr::V4(ip) => arp_conflict(frame, ip)?,
        IpAddr::V6(ip) => nd_conflict(frame, ip)?,
    };
    claims.then_some(sender_mac)
}

/// Whether an ARP `frame` says a host uses or is taking `ip`: any ARP frame
/// whose sender address is `ip`, or a probe for `ip`. `None`: not ARP.
fn arp_conflict(frame: &[u8], ip: Ipv4Addr) -> Option<bool> {
    let arp = frame.get(14..42)?;
    if frame[12..14] != ETHERTYPE_ARP.to_be_bytes() || arp[0..6] != [0, 1, 0x08, 0x00, 6, 4] {
        return None;
    }
    let sender_ip = &arp[14..18];
    let target_ip = &arp[24..28];
    let op = u16::from_be_bytes([arp[6], arp[7]]);
    let claims = sender_ip == ip.octets();
    let probes = op == ARP_REQUEST && sender_ip == [0; 4] && target_ip == ip.octets();
    Some(claims || probes)
}

/// Whether a neighbour discovery `frame` says a host uses or is taking
/// `ip`: an advertisement for `ip`, or a solicitation for `ip` from the
/// unspecified address (another host's duplicate address detection).
/// `None`: not neighbour discovery.
fn nd_conflict(frame: &[u8], ip: Ipv6Addr) -> Option<bool> {
    // Ethernet 14, IPv6 header 40, ICMPv6 type, code, checksum, flags 8, target 16.
    let target = frame.get(62..78)?;
    if frame[12..14] != ETHERTYPE_IPV6.to_be_bytes()
        || frame[20] != IPPROTO_ICMPV6
        || frame[21] != 255
    {
        return None;
    }
    let source = &frame[22..38];
    let about_ip = target == ip.octets();
    Some(match frame[54] {
        ICMPV6_NEIGHBOUR_ADVERTISEMENT => about_ip,
        ICMPV6_NEIGHBOUR_SOLICITATION => about_ip && source == Ipv6Addr::UNSPECIFIED.octets(),
        _ => return None,
    })
}

fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The interfaces on the EIP's segment: up, not loopback, with a MAC and an
/// address whose prefix contains `ip` — the ones [`announce`] sends on, as
/// (name, index).
pub fn segment_interfaces(ip: IpAddr) -> Vec<(String, u32)> {
    pnet_datalink::interfaces()
        .into_iter()
        .filter(|iface| Candidate::of(iface).announcing_mac(ip).is_some())
        .map(|iface| (iface.name, iface.index))
        .collect()
}

/// The interfaces with an address whose prefix contains `ip`, up or down
/// (not loopback, not the EIP device), as (name, index): those
/// [`segment_interfaces`] gives while they are up.
pub fn subnet_interfaces(ip: IpAddr) -> Vec<(String, u32)> {
    pnet_datalink::interfaces()
        .into_iter()
        .filter(|iface| Candidate::of(iface).on_subnet(ip))
        .map(|iface| (iface.name, iface.index))
        .collect()
}

/// What [`announce`] looks at in an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Candidate {
    name: String,
    up: bool,
    loopback: bool,
    mac: Option<[u8; 6]>,
    nets: Vec<IpNet>,
}

impl Candidate {
    fn of(iface: &NetworkInterface) -> Self {
        Self {
            name: iface.name.clone(),
            up: iface.is_up(),
            loopback: iface.is_loopback(),
            mac: iface.mac.map(|m| m.octets()),
            nets: iface
                .ips
                .iter()
                .filter_map(|n| IpNet::new(n.ip(), n.prefix()).ok())
                .collect(),
        }
    }

    /// Whether an address of this interface has a prefix that contains
    /// `ip` (and it is neither loopback nor the EIP device), up or not.
    fn on_subnet(&self, ip: IpAddr) -> bool {
        let contains = |net: &IpNet| net.prefix_len() < net.max_prefix_len() && net.contains(&ip);
        !self.loopback && self.name != EIP_DEVICE && self.nets.iter().any(contains)
    }

    /// The MAC to announce `ip` with on this interface, if it is one to
    /// announce on.
    fn announcing_mac(&self, ip: IpAddr) -> Option<[u8; 6]> {
        let eligible = self.up && self.on_subnet(ip);
        self.mac.filter(|mac| eligible && *mac != [0; 6])
    }
}

fn frames(ip: IpAddr, mac: [u8; 6]) -> Vec<Vec<u8>> {
    match ip {
        IpAddr::V4(ip) => vec![
            gratuitous_arp(mac, ip, ARP_REQUEST),
            gratuitous_arp(mac, ip, ARP_REPLY),
        ],
        IpAddr::V6(ip) => vec![unsolicited_na(mac, ip)],
    }
}

/// Packet sockets on the uplink, not promiscuous: the answers to a probe
/// come to this node's MAC or to broadcast (IPv6: all-nodes), and putting
/// the uplink in promiscuous mode for every probe and announcement would
/// make its NIC take every frame on the segment, and some drivers reset
/// their receive path on each change.
fn packet_config() -> Config {
    Config {
        promiscuous: false,
        ..Config::default()
    }
}

fn send(iface: &NetworkInterface, frames: &[Vec<u8>]) -> Result<(), String> {
    let mut tx = match pnet_datalink::channel(iface, packet_config()) {
        Ok(Channel::Ethernet(tx, _)) => tx,
        Ok(_) => return Err("no Ethernet channel".to_owned()),
        Err(e) => return Err(format!("open packet socket: {e}")),
    };
    for frame in frames {
        match tx.send_to(frame, None) {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(format!("send: {e}")),
            None => return Err("send: nothing sent".to_owned()),
        }
    }
    Ok(())
}

fn ethernet_header(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    [&dst[..], &src[..], &ethertype.to_be_bytes()[..]].concat()
}

/// An Ethernet broadcast ARP frame with sender = target = `ip` and sender
/// MAC `mac`; a request carries a zero target MAC (RFC 5227), a reply the
/// sender's (RFC 2002, 4.6). Padded to the shortest Ethernet frame.
fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr, op: u16) -> Vec<u8> {
    let target_mac = if op == ARP_REQUEST { [0; 6] } else { mac };
    let mut frame = ethernet_header(BROADCAST_MAC, mac, ETHERTYPE_ARP);
    frame.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4]); // Ethernet, IPv4, lengths
    frame.extend_from_slice(&op.to_be_bytes());
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ip.octets());
    frame.extend_from_slice(&target_mac);
    frame.extend_from_slice(&ip.octets());
    frame.resize(MIN_FRAME_LEN, 0);
    frame
}

/// An unsolicited Neighbour Advertisement (RFC 4861, 4.4) for `ip` from
/// `ip` to ff02::1: override flag, not solicited, not router, hop limit 255,
/// target link-layer address option `mac`.
fn unsolicited_na(mac: [u8; 6], ip: Ipv6Addr) -> Vec<u8> {
    let mut icmp = vec![
        ICMPV6_NEIGHBOUR_ADVERTISEMENT,
        0,
        0,
        0,
        NA_FLAG_OVERRIDE,
        0,
        0,
        0,
    ];
    icmp.extend_from_slice(&ip.octets());
    icmp.extend_from_slice(&[ND_OPT_TARGET_LINK_LAYER_ADDRESS, 1]);
    icmp.extend_from_slice(&mac);
    let checksum = icmpv6_checksum(ip, ALL_NODES, &icmp);
    icmp[2..4].copy_from_slice(&checksum.to_be_bytes());

    ipv6_frame(mac, ip, ALL_NODES, &icmp)
}

/// An Ethernet frame from `mac` carrying an IPv6 packet from `src` to the
/// multicast group `dst` with ICMPv6 `icmp`, hop limit 255 (as neighbour
/// discovery requires).
fn ipv6_frame(mac: [u8; 6], src: Ipv6Addr, dst: Ipv6Addr, icmp: &[u8]) -> Vec<u8> {
    let mut frame = ethernet_header(multicast_mac(dst), mac, ETHERTYPE_IPV6);
    frame.extend_from_slice(&[0x60, 0, 0, 0]); // version 6, class 0, flow 0
    frame.extend_from_slice(&u16::try_from(icmp.len()).unwrap_or(u16::MAX).to_be_bytes());
    frame.extend_from_slice(&[IPPROTO_ICMPV6, 255]);
    frame.extend_from_slice(&src.octets());
    frame.extend_from_slice(&dst.octets());
    frame.extend_from_slice(icmp);
    frame
}

/// 33:33 and the low 32 bits of an IPv6 multicast group (RFC 2464, 7).
fn multicast_mac(group: Ipv6Addr) -> [u8; 6] {
    let o = group.octets();
    [0x33, 0x33, o[12], o[13], o[14], o[15]]
}

/// The ICMPv6 checksum of `message` (its checksum field zero) with the
/// IPv6 pseudo-header (RFC 8200, 8.1).
fn icmpv6_checksum(src: Ipv6Addr, dst: Ipv6Addr, message: &[u8]) -> u16 {
    let len = u32::try_from(message.len()).unwrap_or(u32::MAX);
    let pseudo = [
        &src.octets()[..],
        &dst.octets()[..],
        &len.to_be_bytes()[..],
        &[0, 0, 0, IPPROTO_ICMPV6][..],
    ]
    .concat();
    let sum = ones_complement_sum(&pseudo) + ones_complement_sum(message);
    !fold(sum)
}

/// Sum of big-endian 16-bit words, an odd last byte padded with zero.
fn ones_complement_sum(bytes: &[u8]) -> u32 {
    bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum()
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    u16::try_from(sum).unwrap_or(u16::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testns::{in_new_netns, links_up, root_or_skip, sh};

    const MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];

    #[test]
    fn an_arp_probe_asks_for_the_eip_without_a_sender_address() {
        let frame = arp_probe(MAC, "198.51.100.7".parse().unwrap());
        assert_eq!(frame.len(), MIN_FRAME_LEN);
        assert_eq!(&frame[28..32], &[0; 4], "sender address 0.0.0.0");
        assert_eq!(&frame[38..42], &[198, 51, 100, 7]);
        // Our own probe, seen again on the wire, is no conflict.
        assert_eq!(
            conflict(&frame, "198.51.100.7".parse().unwrap(), &[MAC]),
            None
        );
        // Another host's probe for the same address is.
        let other = [2, 0, 0, 0, 0, 9];
        let theirs = arp_probe(other, "198.51.100.7".parse().unwrap());
        assert_eq!(
            conflict(&theirs, "198.51.100.7".parse().unwrap(), &[MAC]),
            Some(other)
        );
        // A host answering for it is.
        let reply = gratuitous_arp(other, "198.51.100.7".parse().unwrap(), ARP_REPLY);
        assert_eq!(
            conflict(&reply, "198.51.100.7".parse().unwrap(), &[MAC]),
            Some(other)
        );
        assert_eq!(
            conflict(&reply, "198.51.100.8".parse().unwrap(), &[MAC]),
            None
        );
    }

    #[test]
    fn a_dad_probe_solicits_the_eip_from_the_unspecified_address() {
        let ip: Ipv6Addr = "2001:db8::12:3456".parse().unwrap();
        let frame = dad_probe(MAC, ip);
        let group: Ipv6Addr = "ff02::1:ff12:3456".parse().unwrap();
        assert_eq!(solicited_node(ip), group);
        assert_eq!(frame[..6], [0x33, 0x33, 0xff, 0x12, 0x34, 0x56]);
        assert_eq!(frame[12..14], [0x86, 0xdd]);
        assert_eq!(frame[18..20], [0, 24], "payload length");
        assert_eq!(frame[20..22], [58, 255], "ICMPv6, hop limit 255");
        assert_eq!(frame[22..38], [0; 16], "source ::");
        assert_eq!(frame[38..54], group.octets());
        assert_eq!(frame[54], ICMPV6_NEIGHBOUR_SOLICITATION);
        assert_eq!(frame[62..78], ip.octets(), "target");
        assert_eq!(frame.len(), 78, "no link-layer address option");
        assert_eq!(
            icmpv6_checksum(Ipv6Addr::UNSPECIFIED, group, &frame[54..]),
            0
        );
        let ip = IpAddr::V6(ip);
        // Our own probe, heard again, is no conflict; another host's is.
        assert_eq!(conflict(&frame, ip, &[MAC]), None);
        let other = [2, 0, 0, 0, 0, 9];
        assert_eq!(
            conflict(
                &dad_probe(other, "2001:db8::12:3456".parse().unwrap()),
                ip,
                &[MAC]
            ),
            Some(other)
        );
        // A host advertising it is; an advertisement of another address is not.
        assert_eq!(
            conflict(
                &unsolicited_na(other, "2001:db8::12:3456".parse().unwrap()),
                ip,
                &[MAC]
            ),
            Some(other)
        );
        assert_eq!(
            conflict(
                &unsolicited_na(other, "2001:db8::7".parse().unwrap()),
                ip,
                &[MAC]
            ),
            None
        );
        // Ordinary address resolution (a solicitation with a source
        // address) asks for it without claiming it.
        let mut resolving = dad_probe(other, "2001:db8::12:3456".parse().unwrap());
        resolving[22..38].copy_from_slice(&"2001:db8::11".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(conflict(&resolving, ip, &[MAC]), None);
        // ARP frames say nothing about an IPv6 address, and the reverse.
        let arp = arp_probe(other, "198.51.100.7".parse().unwrap());
        assert_eq!(conflict(&arp, ip, &[MAC]), None);
        assert_eq!(
            conflict(&frame, "198.51.100.7".parse().unwrap(), &[MAC]),
            None
        );
    }

    #[test]
    fn gratuitous_arp_request_has_the_eip_as_sender_and_target() {
        let frame = gratuitous_arp(MAC, Ipv4Addr::new(198, 51, 100, 200), ARP_REQUEST);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[0xff; 6][..], &MAC, &[0x08, 0x06],
            &[0, 1, 0x08, 0x00, 6, 4, 0, 1],
            &MAC, &[198, 51, 100, 200],
            &[0; 6], &[198, 51, 100, 200],
            &[0; 18],
        ]
        .concat();
        assert_eq!(frame, expected);
    }

    #[test]
    fn gratuitous_arp_reply_carries_the_mac_as_target_too() {
        let frame = gratuitous_arp(MAC, Ipv4Addr::new(198, 51, 100, 200), ARP_REPLY);
        assert_eq!(frame.len(), MIN_FRAME_LEN);
        assert_eq!(frame[20..22], [0, 2]);
        assert_eq!(frame[32..38], MAC);
    }

    #[test]
    fn unsolicited_na_is_an_override_advertisement_to_all_nodes() {
        let ip: Ipv6Addr = "2001:db8::200".parse().unwrap();
        let frame = unsolicited_na(MAC, ip);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[0x33, 0x33, 0, 0, 0, 1][..], &MAC, &[0x86, 0xdd],
            &[0x60, 0, 0, 0, 0, 32, 58, 255],
            &ip.octets(), &ALL_NODES.octets(),
            // checksum computed independently of this module
            &[136, 0, 0xf5, 0x23, 0x20, 0, 0, 0],
            &ip.octets(),
            &[2, 1], &MAC,
        ]
        .concat();
        assert_eq!(frame, expected);
    }

    #[test]
    fn icmpv6_checksum_verifies_to_zero_over_the_whole_message() {
        let ip: Ipv6Addr = "fe80::1".parse().unwrap();
        let frame = unsolicited_na(MAC, ip);
        let icmp = &frame[54..];
        assert_eq!(icmpv6_checksum(ip, ALL_NODES, icmp), 0);
        // an odd length is padded with a zero byte
        assert_eq!(ones_complement_sum(&[1, 2, 3]), 0x0102 + 0x0300);
    }

    fn candidate(name: &str, nets: &[&str]) -> Candidate {
        Candidate {
            name: name.to_owned(),
            up: true,
            loopback: false,
            mac: Some(MAC),
            nets: nets.iter().map(|n| n.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn only_up_interfaces_whose_subnet_contains_the_eip_announce_it() {
        let ip: IpAddr = "198.51.100.200".parse().unwrap();
        let eth = candidate("eth0", &["198.51.100.11/24", "2001:db8::11/64"]);
        assert_eq!(eth.announcing_mac(ip), Some(MAC));
        assert_eq!(eth.announcing_mac("203.0.113.1".parse().unwrap()), None);
        assert_eq!(
            eth.announcing_mac("2001:db8::200".parse().unwrap()),
            Some(MAC)
        );

        let down = Candidate {
            up: false,
            ..eth.clone()
        };
        let lo = Candidate {
            loopback: true,
            ..eth.clone()
        };
        let no_mac = Candidate {
            mac: None,
            ..eth.clone()
        };
        let zero_mac = Candidate {
            mac: Some([0; 6]),
            ..eth.clone()
        };
        let holder = candidate(EIP_DEVICE, &["198.51.100.11/24"]);
        let host_route_only = candidate("dummy0", &["198.51.100.200/32"]);
        for c in [down, lo, no_mac, zero_mac, holder, host_route_only] {
            assert_eq!(c.announcing_mac(ip), None, "{c:?}");
        }
    }

    #[test]
    fn ipv4_eips_get_a_request_and_a_reply_ipv6_eips_one_advertisement() {
        assert_eq!(frames("192.0.2.1".parse().unwrap(), MAC).len(), 2);
        assert_eq!(frames("2001:db8::1".parse().unwrap(), MAC).len(), 1);
    }

    fn mac_of(ifname: &str) -> [u8; 6] {
        let iface = pnet_datalink::interfaces()
            .into_iter()
            .find(|i| i.name == ifname);
        iface.and_then(|i| i.mac).unwrap().octets()
    }

    /// Announces `ip` and returns the first frame `b` receives that `wanted`
    /// accepts, waiting at most 2 s.
    fn announce_and_capture(ip: IpAddr, wanted: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        let b = pnet_datalink::interfaces()
            .into_iter()
            .find(|i| i.name == "b")
            .unwrap();
        let config = Config {
            read_timeout: Some(Duration::from_millis(200)),
            ..Config::default()
        };
        let Ok(Channel::Ethernet(_, mut rx)) = pnet_datalink::channel(&b, config) else {
            panic!("no packet socket on b");
        };
        assert_eq!(announce(ip).unwrap(), vec!["a".to_owned()]);
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(frame) = rx.next()
                && wanted(frame)
            {
                return Some(frame.to_vec());
            }
        }
        None
    }

    fn veth_pair_with(addr: &str) {
        sh("ip link add name a type veth peer name b");
        sh(&format!("ip addr add {addr} dev a"));
        links_up(&["a", "b"]);
    }

    #[test]
    fn gratuitous_arp_for_the_eip_reaches_the_segment() {
        if !root_or_skip("gratuitous_arp_for_the_eip_reaches_the_segment") {
            return;
        }
        in_new_netns(|| {
            veth_pair_with("198.51.100.11/24");
            let mac = mac_of("a");
            let eip = [198, 51, 100, 200];
            let frame = announce_and_capture(IpAddr::from(eip), |f| {
                f.len() >= 42 && f[12..14] == [0x08, 0x06] && f[20..22] == [0, 1]
            })
            .expect("a gratuitous ARP request on b within 2 s");
            assert_eq!(frame[..6], BROADCAST_MAC);
            assert_eq!(frame[6..12], mac);
            assert_eq!(frame[22..28], mac, "sender MAC");
            assert_eq!(frame[28..32], eip, "sender IP");
            assert_eq!(frame[38..42], eip, "target IP");
        });
    }

    #[test]
    fn unsolicited_na_for_the_eip_reaches_the_segment() {
        if !root_or_skip("unsolicited_na_for_the_eip_reaches_the_segment") {
            return;
        }
        in_new_netns(|| {
            veth_pair_with("2001:db8::11/64 nodad");
            let mac = mac_of("a");
            let eip: Ipv6Addr = "2001:db8::200".parse().unwrap();
            let frame = announce_and_capture(IpAddr::V6(eip), |f| {
                f.len() >= 86 && f[12..14] == [0x86, 0xdd] && f[20] == 58 && f[54] == 136
            })
            .expect("a neighbour advertisement on b within 2 s");
            assert_eq!(frame[6..12], mac);
            assert_eq!(frame[21], 255, "hop limit");
            assert_eq!(frame[38..54], ALL_NODES.octets());
            assert_eq!(frame[58], NA_FLAG_OVERRIDE, "flags");
            assert_eq!(frame[62..78], eip.octets(), "target");
            assert_eq!(frame[80..86], mac, "target link-layer address");
            assert_eq!(icmpv6_checksum(eip, ALL_NODES, &frame[54..]), 0);
        });
    }

    #[test]
    fn an_eip_outside_every_subnet_is_announced_nowhere() {
        if !root_or_skip("an_eip_outside_every_subnet_is_announced_nowhere") {
            return;
        }
        in_new_netns(|| {
            veth_pair_with("198.51.100.11/24");
            assert_eq!(
                announce("203.0.113.7".parse().unwrap()).unwrap(),
                Vec::<String>::new()
            );
            assert_eq!(
                announce("2001:db8:1::7".parse().unwrap()).unwrap(),
                Vec::<String>::new()
            );
        });
    }
}

#[cfg(test)]
mod kernel_tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testns::{in_new_netns, links_up, root_or_skip, sh};

    /// Gives `b` an address and a stale neighbour entry for `eip` pointing to
    /// a wrong MAC, announces `eip`, and waits up to 2 s for `b`'s kernel to
    /// point the entry at `a`'s MAC.
    fn neighbour_of_b_moves_to_a(b_addr: &str, eip: &str) {
        sh("ip link add name a type veth peer name b");
        sh(&format!("ip addr add {b_addr} dev b"));
        links_up(&["a", "b"]);
        let prefix = b_addr.split_once('/').map(|(_, p)| p).unwrap_or_default();
        let a_addr = if eip.contains(':') {
            "2001:db8::11"
        } else {
            "198.51.100.11"
        };
        sh(&format!("ip addr add {a_addr}/{prefix} dev a nodad"));
        sh(&format!(
            "ip neigh replace {eip} lladdr 02:00:00:00:00:99 dev b nud stale"
        ));
        let a = pnet_datalink::interfaces()
            .into_iter()
            .find(|i| i.name == "a");
        let a_mac = a.and_then(|i| i.mac).unwrap().to_string();
        // Linux ignores a new link-layer address within locktime (1 s) of
        // the last update unless the ARP is gratuitous; wait it out anyway.
        std::thread::sleep(Duration::from_millis(1100));
        // b's subnet contains the EIP too, so b announces it to a as well.
        assert!(
            announce(eip.parse().unwrap())
                .unwrap()
                .contains(&"a".to_owned())
        );
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let neigh = sh(&format!("ip neigh show {eip} dev b"));
            if neigh.contains(&a_mac) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "b still has {neigh:?}, wanted {a_mac}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn a_neighbour_with_a_stale_arp_entry_learns_the_new_mac() {
        if !root_or_skip("a_neighbour_with_a_stale_arp_entry_learns_the_new_mac") {
            return;
        }
        in_new_netns(|| neighbour_of_b_moves_to_a("198.51.100.12/24", "198.51.100.200"));
    }

    #[test]
    fn a_neighbour_with_a_stale_ndp_entry_learns_the_new_mac() {
        if !root_or_skip("a_neighbour_with_a_stale_ndp_entry_learns_the_new_mac") {
            return;
        }
        in_new_netns(|| neighbour_of_b_moves_to_a("2001:db8::12/64 nodad", "2001:db8::200"));
    }

    /// `a` is on the segment with `a_addr`; `b` holds `taken` with a host
    /// prefix, so that egressgw does not count it on the segment and it
    /// plays the other host, whose kernel answers for (IPv6: defends) its
    /// address. `taken` is found answered for by `b`'s MAC, `free` is not.
    fn another_host_answers(a_addr: &str, taken: &str, free: &str) {
        sh("ip link add name a type veth peer name b");
        sh(&format!("ip addr add {a_addr} dev a"));
        let nodad = if taken.contains(':') { " nodad" } else { "" };
        sh(&format!("ip addr add {taken} dev b{nodad}"));
        links_up(&["a", "b"]);
        let b_mac = pnet_datalink::interfaces()
            .into_iter()
            .find(|i| i.name == "b")
            .and_then(|i| i.mac)
            .unwrap()
            .to_string();
        let wait = Duration::from_millis(300);
        let taken = taken.split('/').next().unwrap();
        let answer = answered_for(taken.parse().unwrap(), wait).unwrap();
        let answer = answer.unwrap_or_else(|| panic!("b answers for {taken}"));
        assert!(answer.contains(&b_mac), "{answer}");
        assert_eq!(answered_for(free.parse().unwrap(), wait).unwrap(), None);
    }

    #[test]
    fn an_address_another_host_answers_for_is_found_and_a_free_one_is_not() {
        if !root_or_skip("an_address_another_host_answers_for_is_found_and_a_free_one_is_not") {
            return;
        }
        in_new_netns(|| {
            another_host_answers("198.51.100.11/24", "198.51.100.1/32", "198.51.100.200");
        });
    }

    #[test]
    fn an_ipv6_address_another_host_holds_is_found_by_its_advertisement() {
        if !root_or_skip("an_ipv6_address_another_host_holds_is_found_by_its_advertisement") {
            return;
        }
        in_new_netns(|| {
            another_host_answers("2001:db8::11/64 nodad", "2001:db8::1/128", "2001:db8::200");
        });
    }
}

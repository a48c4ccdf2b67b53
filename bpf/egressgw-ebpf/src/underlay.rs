//! The tunnel's end on the underlay interface: a fast-path connection's
//! packet arriving in the tunnel is taken out of it here, on the underlay
//! interface's ingress, and goes on at once (to its pod on the source
//! node, translated and out on a gateway node), instead of through the
//! node's IP and UDP stack and the VXLAN device first. Everything else
//! (other connections, segmentation offloads, frames that differ from the
//! node's tunnel in any field) goes to the device as before.

use aya_ebpf::bindings::TC_ACT_SHOT;
use aya_ebpf::bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC;
use aya_ebpf::bindings::{BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6};
use aya_ebpf::programs::TcContext;
use egressgw_common::{Underlay, tunnel_end};

use crate::{
    ETH_HLEN, ETH_P_IP, ETH_P_IPV6, FLOWS4, FLOWS6, IPV6_HLEN, TUNNEL_END, UNDERLAY, add, gateway,
    plain_ipv4, tcp4_at, tcp6_at, to_pod,
};

const IPPROTO_UDP: u8 = 17;
/// `skb->pkt_type` of a frame addressed to this host.
const PACKET_HOST: u32 = 0;
/// The outer IPv4 header (no options) and IPv6 header (no extension
/// headers).
const IPV4_HLEN: usize = 20;
/// The VXLAN header's first byte: only the "VNI is valid" flag.
const VXLAN_FLAGS: u8 = 0x08;
/// The inner EtherTypes, as they are on the wire.
const INNER_IPV4: [u8; 2] = [0x08, 0x00];
const INNER_IPV6: [u8; 2] = [0x86, 0xdd];

pub(crate) fn underlay(ctx: &TcContext) -> Option<i32> {
    if gateway::tagged(ctx) {
        return None;
    }
    // SAFETY: `skb` is the context the kernel passed in.
    let (gso_size, pkt_type) = unsafe { ((*ctx.skb.skb).gso_size, (*ctx.skb.skb).pkt_type) };
    // A segmentation offload keeps its tunnel's type, which only the
    // device's own decapsulation clears; a frame for another host is not
    // the node's to take.
    if gso_size != 0 || pkt_type != PACKET_HOST {
        return None;
    }
    let tunnel = *UNDERLAY.get(0)?;
    let outer_ipv6 = match ctx.skb.protocol() {
        ETH_P_IP if tunnel.on == 4 => false,
        ETH_P_IPV6 if tunnel.on == 6 => true,
        _ => return None,
    };
    let udp = outer(ctx, &tunnel, outer_ipv6)?;
    let vxlan = udp + 8;
    let port: [u8; 2] = ctx.load(udp + 2).ok()?;
    let flags: u8 = ctx.load(vxlan).ok()?;
    let vni: [u8; 4] = ctx.load(vxlan + 4).ok()?;
    let inner_eth = vxlan + 8;
    let inner_dst: [u8; 6] = ctx.load(inner_eth).ok()?;
    let inner_type: [u8; 2] = ctx.load(inner_eth + 12).ok()?;
    if port != tunnel.port || flags != VXLAN_FLAGS || vni != tunnel.vni || inner_dst != tunnel.mac {
        return None;
    }
    // What comes off: the outer IP, UDP and VXLAN headers and the inner
    // Ethernet header (the outer Ethernet header stays, rewritten on the
    // way on).
    let inner_ip = inner_eth + ETH_HLEN;
    let off = (inner_ip - ETH_HLEN) as i32;
    let ip_len = ctx.len().saturating_sub(inner_ip as u32);
    if inner_type == INNER_IPV4 {
        let (flow, tcp_flags, headers) = tcp4_at(ctx, inner_ip)?;
        let change = if outer_ipv6 {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV4
        } else {
            0
        };
        // A source node: a reply of a connection a pod opened here.
        // SAFETY: the value is copied out at once.
        if let Some(pod) = unsafe { FLOWS4.get(flow.reversed()) }.copied() {
            if !decap(ctx, off, change, inner_type)? {
                return Some(TC_ACT_SHOT);
            }
            add(ctx, &TUNNEL_END, tunnel_end::TO_POD);
            return to_pod(ctx, pod).or(Some(TC_ACT_SHOT));
        }
        // A gateway node: a pod's packet of a connection taken over.
        if !gateway::takes4(ctx, inner_ip, flow, tcp_flags, ip_len) {
            return None;
        }
        if !decap(ctx, off, change, inner_type)? {
            return Some(TC_ACT_SHOT);
        }
        add(ctx, &TUNNEL_END, tunnel_end::OUT);
        // The checks passed a moment ago; should the connection have gone
        // since, the packet, out of its tunnel, cannot go on.
        gateway::out4(ctx, flow, tcp_flags, headers).or(Some(TC_ACT_SHOT))
    } else if inner_type == INNER_IPV6 {
        let (flow, tcp_flags, headers) = tcp6_at(ctx, inner_ip)?;
        let change = if outer_ipv6 {
            0
        } else {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV6
        };
        // SAFETY: as above.
        if let Some(pod) = unsafe { FLOWS6.get(flow.reversed()) }.copied() {
            if !decap(ctx, off, change, inner_type)? {
                return Some(TC_ACT_SHOT);
            }
            add(ctx, &TUNNEL_END, tunnel_end::TO_POD);
            return to_pod(ctx, pod).or(Some(TC_ACT_SHOT));
        }
        if !gateway::takes6(ctx, inner_ip, flow, tcp_flags, ip_len) {
            return None;
        }
        if !decap(ctx, off, change, inner_type)? {
            return Some(TC_ACT_SHOT);
        }
        add(ctx, &TUNNEL_END, tunnel_end::OUT);
        gateway::out6(ctx, flow, tcp_flags, headers).or(Some(TC_ACT_SHOT))
    } else {
        None
    }
}

/// Where the UDP header starts if the outer IP header is plain (IPv4
/// without options and not fragmented, IPv6 without extension headers),
/// carries UDP and is addressed to the node's underlay address.
fn outer(ctx: &TcContext, tunnel: &Underlay, ipv6: bool) -> Option<usize> {
    if ipv6 {
        let next: u8 = ctx.load(ETH_HLEN + 6).ok()?;
        let dst: [u8; 16] = ctx.load(ETH_HLEN + 24).ok()?;
        (next == IPPROTO_UDP && dst == tunnel.addr).then_some(ETH_HLEN + IPV6_HLEN)
    } else {
        let dst: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
        let ours = dst[..] == tunnel.addr[..4];
        (plain_ipv4(ctx, ETH_HLEN)? == IPPROTO_UDP && ours).then_some(ETH_HLEN + IPV4_HLEN)
    }
}

/// Takes the tunnel's `off` bytes of headers off behind the outer Ethernet
/// header, which then carries the inner packet's `ethertype`; `change`:
/// the flag that makes the kernel take the inner IP version for the
/// packet's. `None` if the kernel refused (nothing changed: the device
/// decapsulates the frame), `Some(false)` if the headers came off but the
/// EtherType could not be written (the packet cannot go on).
fn decap(ctx: &TcContext, off: i32, change: u32, ethertype: [u8; 2]) -> Option<bool> {
    ctx.adjust_room(-off, BPF_ADJ_ROOM_MAC, u64::from(change))
        .ok()?;
    Some(ctx.store(12, &ethertype, 0).is_ok())
}

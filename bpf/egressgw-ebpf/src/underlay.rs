//! The tunnel's end on the underlay interface: a fast-path connection's
//! packet arriving in the tunnel is taken out of it here, on the underlay
//! interface's ingress, and goes on at once (to its pod on the source
//! node, translated and out on a gateway node), instead of through the
//! node's IP and UDP stack and the VXLAN device first. Everything else
//! (other connections, segmentation offloads, frames that differ from the
//! node's tunnel in any field) goes to the device as before.

use aya_ebpf::bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC;
use aya_ebpf::bindings::{
    BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, TC_ACT_REDIRECT, TC_ACT_SHOT,
};
use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::TcContext;
use egressgw_common::{DEVICE_AFTER_OFFLOAD_NS, Underlay, eip_key4, tunnel_end};

use crate::{
    ETH_HLEN, ETH_P_IP, ETH_P_IPV6, FLOWS4, FLOWS6, IPV4_PLAIN, IPV6_HLEN, OFFLOADED4, OFFLOADED6,
    PEERS, TUNNEL_END, UNDERLAY, add, gateway, tcp4_at, tcp6_at, to_pod,
};

const IPPROTO_UDP: u8 = 17;
/// `skb->pkt_type` of a frame addressed to this host.
const PACKET_HOST: u32 = 0;
/// The outer IPv4 header (no options).
const IPV4_HLEN: usize = 20;
/// The VXLAN header's first word: only the "VNI is valid" flag.
const VXLAN_FLAGS: [u8; 4] = [0x08, 0, 0, 0];
/// The inner EtherTypes, as they are on the wire.
const INNER_IPV4: [u8; 2] = [0x08, 0x00];
const INNER_IPV6: [u8; 2] = [0x86, 0xdd];
/// The ECN field's "congestion experienced": the device carries it over
/// to the inner packet.
const ECN_CE: u8 = 3;
/// How often, at most, a connection's entry in `OFFLOADED4`/`6` is
/// written (a write per offload would bounce it between CPUs).
const OFFLOADED_EVERY_NS: u64 = 1_000_000;

pub(crate) fn underlay(ctx: &TcContext) -> Option<i32> {
    // SAFETY: `skb` is the context the kernel passed in.
    let (gso_size, pkt_type) = unsafe { ((*ctx.skb.skb).gso_size, (*ctx.skb.skb).pkt_type) };
    // A frame for another host is not the node's to take.
    if pkt_type != PACKET_HOST || gateway::tagged(ctx) {
        return None;
    }
    let tunnel = *UNDERLAY.get(0)?;
    let outer_ipv6 = match ctx.skb.protocol() {
        ETH_P_IP if tunnel.on == 4 => false,
        ETH_P_IPV6 if tunnel.on == 6 => true,
        _ => return None,
    };
    // A segmentation offload's lengths are the whole offload's.
    let offload = gso_size != 0;
    let udp = outer(ctx, &tunnel, outer_ipv6, offload)?;
    // UDP, VXLAN and the inner Ethernet header, in one load.
    let headers: [u8; 8 + 8 + ETH_HLEN] = ctx.load(udp).ok()?;
    let udp_len = u32::from(u16::from_be_bytes([headers[4], headers[5]]));
    let inner_eth = udp + 16;
    let inner_type = [headers[28], headers[29]];
    if headers[2..4] != tunnel.port
        || headers[8..12] != VXLAN_FLAGS
        || headers[12..16] != tunnel.vni
        || headers[16..22] != tunnel.mac
        || !(offload || udp_len == ctx.len() - udp as u32)
    {
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
        // A segmentation offload keeps its tunnel's type, which only the
        // device's own decapsulation clears: it goes there, and so do
        // the connection's next frames for a while, since the device
        // hands the offload on later than this program would them.
        if offload {
            offloaded(&OFFLOADED4, flow);
            return None;
        }
        if lately_offloaded(&OFFLOADED4, flow) {
            return None;
        }
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
            return counted(ctx, tunnel_end::TO_POD, to_pod(ctx, pod));
        }
        // A gateway node: a pod's packet of a connection taken over.
        if !gateway::takes4(ctx, inner_ip, flow, tcp_flags, ip_len) {
            return None;
        }
        if !decap(ctx, off, change, inner_type)? {
            return Some(TC_ACT_SHOT);
        }
        // The checks passed a moment ago; should the connection have gone
        // since, the packet, out of its tunnel, cannot go on.
        counted(
            ctx,
            tunnel_end::OUT,
            gateway::out4(ctx, flow, tcp_flags, headers, true),
        )
    } else if inner_type == INNER_IPV6 {
        let (flow, tcp_flags, headers) = tcp6_at(ctx, inner_ip)?;
        if offload {
            offloaded(&OFFLOADED6, flow);
            return None;
        }
        if lately_offloaded(&OFFLOADED6, flow) {
            return None;
        }
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
            return counted(ctx, tunnel_end::TO_POD, to_pod(ctx, pod));
        }
        if !gateway::takes6(ctx, inner_ip, flow, tcp_flags, ip_len) {
            return None;
        }
        if !decap(ctx, off, change, inner_type)? {
            return Some(TC_ACT_SHOT);
        }
        counted(
            ctx,
            tunnel_end::OUT,
            gateway::out6(ctx, flow, tcp_flags, headers, true),
        )
    } else {
        None
    }
}

/// Where the UDP header starts if the outer IP header is plain (IPv4
/// without options and not fragmented, IPv6 without extension headers),
/// carries UDP, comes from another node's underlay address to this
/// node's, is as long as the frame (but for an `offload`) and carries no
/// congestion mark.
fn outer(ctx: &TcContext, tunnel: &Underlay, ipv6: bool, offload: bool) -> Option<usize> {
    let len = ctx.len();
    if ipv6 {
        let ip: [u8; IPV6_HLEN] = ctx.load(ETH_HLEN).ok()?;
        let payload = u32::from(u16::from_be_bytes([ip[4], ip[5]]));
        let whole = offload || payload == len - (ETH_HLEN + IPV6_HLEN) as u32;
        let plain = ip[6] == IPPROTO_UDP && (ip[1] >> 4) & 3 != ECN_CE && whole;
        let mut src = [0u8; 16];
        src.copy_from_slice(&ip[8..24]);
        (plain && ip[24..40] == tunnel.addr && peer(src)).then_some(ETH_HLEN + IPV6_HLEN)
    } else {
        let ip: [u8; IPV4_HLEN] = ctx.load(ETH_HLEN).ok()?;
        let total = u32::from(u16::from_be_bytes([ip[2], ip[3]]));
        let whole = offload || total == len - ETH_HLEN as u32;
        // No options, no more fragments, no offset.
        let plain = ip[0] == IPV4_PLAIN && ip[6] & 0x3f == 0 && ip[7] == 0 && ip[9] == IPPROTO_UDP;
        let ours = ip[16..20] == tunnel.addr[..4];
        let src = [ip[12], ip[13], ip[14], ip[15]];
        (plain && ip[1] & 3 != ECN_CE && whole && ours && peer(eip_key4(src)))
            .then_some(ETH_HLEN + IPV4_HLEN)
    }
}

/// Whether `addr` (IPv6, or IPv4 mapped) is another node's underlay
/// address.
fn peer(addr: [u8; 16]) -> bool {
    PEERS.get_ptr(addr).is_some()
}

/// `bpf_ktime_get_ns` now.
fn now() -> u64 {
    // SAFETY: a helper call without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// Writes down that a segmentation offload of `flow` went to the device.
fn offloaded<K>(map: &LruHashMap<K, u64>, flow: K) {
    let now = now();
    // SAFETY: the value is copied out at once.
    let last = unsafe { map.get(&flow) }.copied();
    if last.is_none_or(|at| now.wrapping_sub(at) >= OFFLOADED_EVERY_NS) {
        let _ = map.insert(&flow, now, 0);
    }
}

/// Whether a segmentation offload of `flow` went to the device less than
/// [`DEVICE_AFTER_OFFLOAD_NS`] ago.
fn lately_offloaded<K>(map: &LruHashMap<K, u64>, flow: K) -> bool {
    // SAFETY: the value is copied out at once.
    unsafe { map.get(&flow) }
        .copied()
        .is_some_and(|at| now().wrapping_sub(at) < DEVICE_AFTER_OFFLOAD_NS)
}

/// Counts a packet taken out of the tunnel in `slot` if it went on
/// (`done`: redirected); one that did not cannot go on.
fn counted(ctx: &TcContext, slot: u32, done: Option<i32>) -> Option<i32> {
    match done {
        Some(action) if action == TC_ACT_REDIRECT => {
            add(ctx, &TUNNEL_END, slot);
            Some(action)
        }
        _ => Some(TC_ACT_SHOT),
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

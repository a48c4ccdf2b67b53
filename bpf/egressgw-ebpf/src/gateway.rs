//! The gateway's fast path: translating a pod's connection as the
//! gateway node's conntrack did, after it did, and sending it straight on.

use aya_ebpf::bindings::{BPF_F_PSEUDO_HDR, TC_ACT_SHOT};
use aya_ebpf::helpers::generated::{bpf_csum_diff, bpf_ktime_get_ns};
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::TcContext;
use egressgw_common::{
    Flow4, Flow6, Handshake4, Handshake6, Learned, Pending4, Pending6, REPORT_EVERY_NS,
    SEEN_EVERY_NS, eip_key4, switch,
};

use crate::{
    EIPS, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IP4_CSUM, IP4_DST, IP4_SRC, IP4_TTL, IP6_DST, IP6_HOPS,
    IP6_SRC, LEARNED, NAT_IN4, NAT_IN6, NAT_OUT4, NAT_OUT6, PENDING4, PENDING6, REPORTED4,
    REPORTED6, SWITCHES, TCP_ACK, TCP_CSUM, TCP_FIN, TCP_RST, TCP_SYN, TCP4, TCP6, redirect, tcp4,
    tcp6,
};

/// Whether this node learns translations (a gateway node with the
/// gateway's fast path on).
fn learning() -> bool {
    SWITCHES.get(switch::GATEWAY).is_some_and(|on| *on != 0)
}

/// What the stack must see: the connection opening or closing. Such a
/// packet also ends what the fast path holds of the connection: after a
/// close, and before a new connection under the same addresses and ports
/// (its SYN, and its SYN-ACK, pass here first), which may belong to
/// another pod.
fn for_the_stack(flags: u8) -> bool {
    flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0
}

/// A packet that carries nothing but an acknowledgement.
fn pure_ack(flags: u8, headers: u32, ip_payload: u32) -> bool {
    flags & (TCP_SYN | TCP_FIN | TCP_RST | TCP_ACK) == TCP_ACK && headers == ip_payload
}

/// The sequence and acknowledgement numbers of the TCP header at `tcp`.
fn seq_ack(ctx: &TcContext, tcp: usize) -> Option<([u8; 4], [u8; 4])> {
    Some((ctx.load(tcp + 4).ok()?, ctx.load(tcp + 8).ok()?))
}

/// The Ethernet header of the way back: to where the packet came from,
/// from where it was sent to.
fn reversed_l2(ctx: &TcContext) -> Option<[u8; 14]> {
    let dst: [u8; 6] = ctx.load(0).ok()?;
    let src: [u8; 6] = ctx.load(6).ok()?;
    let ethertype: [u8; 2] = ctx.load(12).ok()?;
    let mut l2 = [0u8; 14];
    l2[..6].copy_from_slice(&src);
    l2[6..12].copy_from_slice(&dst);
    l2[12..].copy_from_slice(&ethertype);
    Some(l2)
}

/// `bpf_ktime_get_ns` now.
fn now() -> u64 {
    // SAFETY: a helper call without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// Writes down that the connection carried a packet now, at most every
/// [`SEEN_EVERY_NS`] (a write per packet would bounce the entry between
/// CPUs).
fn seen(at: &mut u64) {
    let now = now();
    if now.wrapping_sub(*at) >= SEEN_EVERY_NS {
        *at = now;
    }
}

/// Whether the node holds `eip` (IPv4 mapped, or IPv6): a connection of
/// an EIP the node gave up goes back to the stack, whose guard drops it.
fn held(eip: [u8; 16]) -> bool {
    EIPS.get_ptr(eip).is_some()
}

/// Whether the frame carries a VLAN tag the device did not take off yet
/// (on a VLAN's parent device): it belongs to the VLAN device's traffic.
pub(crate) fn tagged(ctx: &TcContext) -> bool {
    // SAFETY: `skb` is the context the kernel passed in.
    unsafe { (*ctx.skb.skb).vlan_present != 0 }
}

/// Whether the packet fits `mtu`: the IP packet, or for a segmentation
/// offload each segment (`headers`: IP and TCP headers' length).
fn fits(ctx: &TcContext, mtu: u32, headers: u32) -> bool {
    // SAFETY: `skb` is the context the kernel passed in.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    let ip_len = if gso_size == 0 {
        ctx.len().saturating_sub(ETH_HLEN as u32)
    } else {
        headers + gso_size
    };
    ip_len <= mtu
}

/// After the checks, the rewrite: a failure half-way leaves a packet
/// that must not go on.
fn finish(done: Option<()>, ifindex: u32) -> Option<i32> {
    match done {
        Some(()) => redirect(ifindex),
        None => Some(TC_ACT_SHOT),
    }
}

/// A pod's packet out of the tunnel (`flow` as it carries it): translated
/// and sent out as its connection's first packets were, or remembered for
/// learning; `None`: it goes through the stack. `decapsulated`: the packet
/// was taken out of the tunnel on the underlay, not by the tunnel device:
/// it is not remembered (its interface and Ethernet header are not the
/// tunnel's), and `None` means it cannot go on.
#[inline(always)]
pub(crate) fn out4(
    ctx: &TcContext,
    flow: Flow4,
    flags: u8,
    headers: u32,
    decapsulated: bool,
) -> Option<i32> {
    if !learning() {
        return None;
    }
    if for_the_stack(flags) {
        forget_out4(flow);
        return None;
    }
    let Some(nat) = NAT_OUT4.get_ptr_mut(flow) else {
        if decapsulated {
            return None;
        }
        let total: [u8; 2] = ctx.load(ETH_HLEN + 2).ok()?;
        if pure_ack(flags, headers, u32::from(u16::from_be_bytes(total))) {
            remember4(ctx, flow)?;
        }
        return None;
    };
    // SAFETY: the entry stays valid for the program's run (RCU); only its
    // `seen` is written.
    let nat = unsafe { &mut *nat };
    if !held(eip_key4(nat.addr)) {
        forget_out4(flow);
        return None;
    }
    let ttl: u8 = ctx.load(IP4_TTL).ok()?;
    if ttl <= 1 || !fits(ctx, nat.mtu, headers) {
        return None;
    }
    seen(&mut nat.seen);
    finish(
        rewrite4(
            ctx, IP4_SRC, TCP4, flow.src, nat.addr, flow.sport, nat.port, ttl, &nat.l2,
        ),
        nat.ifindex,
    )
}

/// Whether [`out4`] translates the packet `flow` names once it is out of
/// the tunnel (`ip`: where its IPv4 header is now, `ip_len`: its length):
/// the same checks, made before the tunnel's headers come off, since a
/// packet taken out of the tunnel here cannot go to the stack any more.
pub(crate) fn takes4(ctx: &TcContext, ip: usize, flow: Flow4, flags: u8, ip_len: u32) -> bool {
    if !learning() || for_the_stack(flags) {
        return false;
    }
    // SAFETY: the value is copied out at once.
    let Some(nat) = (unsafe { NAT_OUT4.get(flow) }).copied() else {
        return false;
    };
    let ttl: u8 = ctx.load(ip + 8).unwrap_or(0);
    held(eip_key4(nat.addr)) && ttl > 1 && ip_len <= nat.mtu
}

/// [`takes4`] for IPv6 ([`out6`]).
pub(crate) fn takes6(ctx: &TcContext, ip: usize, flow: Flow6, flags: u8, ip_len: u32) -> bool {
    if !learning() || for_the_stack(flags) {
        return false;
    }
    // SAFETY: the value is copied out at once.
    let Some(nat) = (unsafe { NAT_OUT6.get(flow) }).copied() else {
        return false;
    };
    let hops: u8 = ctx.load(ip + 7).unwrap_or(0);
    held(nat.addr) && hops > 1 && ip_len <= nat.mtu
}

/// [`out4`] for IPv6.
#[inline(always)]
pub(crate) fn out6(
    ctx: &TcContext,
    flow: Flow6,
    flags: u8,
    headers: u32,
    decapsulated: bool,
) -> Option<i32> {
    if !learning() {
        return None;
    }
    if for_the_stack(flags) {
        forget_out6(flow);
        return None;
    }
    let Some(nat) = NAT_OUT6.get_ptr_mut(flow) else {
        if decapsulated {
            return None;
        }
        let payload: [u8; 2] = ctx.load(ETH_HLEN + 4).ok()?;
        let tcp_len = headers - crate::IPV6_HLEN as u32;
        if pure_ack(flags, tcp_len, u32::from(u16::from_be_bytes(payload))) {
            remember6(ctx, flow)?;
        }
        return None;
    };
    // SAFETY: as in `out4`.
    let nat = unsafe { &mut *nat };
    if !held(nat.addr) {
        forget_out6(flow);
        return None;
    }
    let hops: u8 = ctx.load(IP6_HOPS).ok()?;
    if hops <= 1 || !fits(ctx, nat.mtu, headers) {
        return None;
    }
    seen(&mut nat.seen);
    finish(
        rewrite6(
            ctx, IP6_SRC, TCP6, flow.src, nat.addr, flow.sport, nat.port, hops, &nat.l2,
        ),
        nat.ifindex,
    )
}

/// A reply arriving from outside (`flow` as it carries it): translated
/// back and sent into the tunnel toward the pod's node when its
/// connection's translation is known; `None`: it goes through the stack.
fn in4(ctx: &TcContext) -> Option<i32> {
    let (flow, flags, headers) = tcp4(ctx)?;
    if for_the_stack(flags) {
        forget_in4(flow);
        return None;
    }
    let nat = NAT_IN4.get_ptr_mut(flow)?;
    // SAFETY: as in `out4`.
    let nat = unsafe { &mut *nat };
    if !held(eip_key4(flow.dst)) {
        forget_in4(flow);
        return None;
    }
    let ttl: u8 = ctx.load(IP4_TTL).ok()?;
    if ttl <= 1 || !fits(ctx, nat.mtu, headers) {
        return None;
    }
    seen(&mut nat.seen);
    finish(
        rewrite4(
            ctx,
            IP4_DST,
            TCP4 + 2,
            flow.dst,
            nat.addr,
            flow.dport,
            nat.port,
            ttl,
            &nat.l2,
        ),
        nat.ifindex,
    )
}

/// [`in4`] for IPv6.
fn in6(ctx: &TcContext) -> Option<i32> {
    let (flow, flags, headers) = tcp6(ctx)?;
    if for_the_stack(flags) {
        forget_in6(flow);
        return None;
    }
    let nat = NAT_IN6.get_ptr_mut(flow)?;
    // SAFETY: as in `out4`.
    let nat = unsafe { &mut *nat };
    if !held(flow.dst) {
        forget_in6(flow);
        return None;
    }
    let hops: u8 = ctx.load(IP6_HOPS).ok()?;
    if hops <= 1 || !fits(ctx, nat.mtu, headers) {
        return None;
    }
    seen(&mut nat.seen);
    finish(
        rewrite6(
            ctx,
            IP6_DST,
            TCP6 + 2,
            flow.dst,
            nat.addr,
            flow.dport,
            nat.port,
            hops,
            &nat.l2,
        ),
        nat.ifindex,
    )
}

/// On a gateway node's external interfaces' ingress; `None`: left alone.
pub(crate) fn nat_in(ctx: &TcContext) -> Option<i32> {
    if !learning() || tagged(ctx) {
        return None;
    }
    match ctx.skb.protocol() {
        ETH_P_IP => in4(ctx),
        ETH_P_IPV6 => in6(ctx),
        _ => None,
    }
}

/// On a gateway node's external interfaces' egress: a remembered pod's
/// packet leaving translated tells the agent the translation.
pub(crate) fn learn(ctx: &TcContext) -> Option<()> {
    if !learning() || tagged(ctx) {
        return None;
    }
    match ctx.skb.protocol() {
        ETH_P_IP => learn4(ctx),
        ETH_P_IPV6 => learn6(ctx),
        _ => None,
    }
}

/// An IPv4 address where [`Learned`] holds addresses.
fn wide(addr: [u8; 4]) -> [u8; 16] {
    let mut out = [0; 16];
    out[..4].copy_from_slice(&addr);
    out
}

#[inline(never)]
fn learn4(ctx: &TcContext) -> Option<()> {
    let (flow, flags, _) = tcp4(ctx)?;
    if for_the_stack(flags) {
        return None;
    }
    // Translated to an address other than the node's EIPs (a policy
    // leaving with the node's address): not taken over.
    EIPS.get_ptr(eip_key4(flow.src))?;
    let (seq, ack) = seq_ack(ctx, TCP4)?;
    let key = Handshake4 {
        remote: flow.dst,
        seq,
        ack,
        rport: flow.dport,
        _pad: [0; 2],
    };
    // SAFETY: the entry stays valid for the program's run (RCU).
    let pending = unsafe { &*PENDING4.get_ptr(key)? };
    let pod = Flow4 {
        src: pending.pod,
        dst: flow.dst,
        sport: pending.port,
        dport: flow.dport,
    };
    reported(&REPORTED4, pod)?;
    let out_l2: [u8; 14] = ctx.load(0).ok()?;
    // The record is written straight into the ring buffer: the stacks of
    // a program's calls together have 512 bytes.
    let mut entry = LEARNED.reserve::<Learned>(0)?;
    let at = entry.as_mut_ptr();
    // SAFETY: `at` is the reserved record, ours until it is submitted;
    // every field is written, each a plain integer or byte array.
    unsafe {
        (*at).family = 4;
        // SAFETY: `skb` is the context the kernel passed in.
        (*at).out_ifindex = (*ctx.skb.skb).ifindex;
        (*at).tunnel_ifindex = pending.ifindex;
        (*at).pod = wide(pending.pod);
        (*at).remote = wide(flow.dst);
        (*at).eip = wide(flow.src);
        (*at).pod_port = pending.port;
        (*at).remote_port = flow.dport;
        (*at).eip_port = flow.sport;
        (*at).out_l2 = out_l2;
        (*at).tunnel_l2 = pending.l2;
        (*at)._pad = [0; 2];
    }
    entry.submit(0);
    let _ = PENDING4.remove(key);
    Some(())
}

#[inline(never)]
fn learn6(ctx: &TcContext) -> Option<()> {
    let (flow, flags, _) = tcp6(ctx)?;
    if for_the_stack(flags) {
        return None;
    }
    EIPS.get_ptr(flow.src)?;
    let (seq, ack) = seq_ack(ctx, TCP6)?;
    let key = Handshake6 {
        remote: flow.dst,
        seq,
        ack,
        rport: flow.dport,
        _pad: [0; 2],
    };
    // SAFETY: the entry stays valid for the program's run (RCU).
    let pending = unsafe { &*PENDING6.get_ptr(key)? };
    let pod = Flow6 {
        src: pending.pod,
        dst: flow.dst,
        sport: pending.port,
        dport: flow.dport,
    };
    reported(&REPORTED6, pod)?;
    let out_l2: [u8; 14] = ctx.load(0).ok()?;
    let mut entry = LEARNED.reserve::<Learned>(0)?;
    let at = entry.as_mut_ptr();
    // SAFETY: as in `learn4`.
    unsafe {
        (*at).family = 6;
        // SAFETY: `skb` is the context the kernel passed in.
        (*at).out_ifindex = (*ctx.skb.skb).ifindex;
        (*at).tunnel_ifindex = pending.ifindex;
        (*at).pod = pending.pod;
        (*at).remote = flow.dst;
        (*at).eip = flow.src;
        (*at).pod_port = pending.port;
        (*at).remote_port = flow.dport;
        (*at).eip_port = flow.sport;
        (*at).out_l2 = out_l2;
        (*at).tunnel_l2 = pending.l2;
        (*at)._pad = [0; 2];
    }
    entry.submit(0);
    let _ = PENDING6.remove(key);
    Some(())
}

/// Whether the connection `pod` may be reported now (and then notes the
/// report): once per [`REPORT_EVERY_NS`], so that a connection the agent
/// does not take over (one closing, whose pod's ACKs keep coming) does not
/// flood the ring buffer.
#[inline(always)]
fn reported<F: 'static>(reports: &LruHashMap<F, u64>, pod: F) -> Option<()> {
    let now = now();
    // SAFETY: the value is copied out at once.
    if let Some(at) = unsafe { reports.get(&pod) }.copied()
        && now.wrapping_sub(at) < REPORT_EVERY_NS
    {
        return None;
    }
    reports.insert(pod, now, 0).ok()
}

/// Remembers a pod's pure ACK out of the tunnel, by what the SNAT keeps.
fn remember4(ctx: &TcContext, flow: Flow4) -> Option<()> {
    let (seq, ack) = seq_ack(ctx, TCP4)?;
    let key = Handshake4 {
        remote: flow.dst,
        seq,
        ack,
        rport: flow.dport,
        _pad: [0; 2],
    };
    let pending = Pending4 {
        pod: flow.src,
        port: flow.sport,
        l2: reversed_l2(ctx)?,
        // SAFETY: `skb` is the context the kernel passed in.
        ifindex: unsafe { (*ctx.skb.skb).ifindex },
    };
    PENDING4.insert(key, pending, 0).ok()
}

/// [`remember4`] for IPv6.
fn remember6(ctx: &TcContext, flow: Flow6) -> Option<()> {
    let (seq, ack) = seq_ack(ctx, TCP6)?;
    let key = Handshake6 {
        remote: flow.dst,
        seq,
        ack,
        rport: flow.dport,
        _pad: [0; 2],
    };
    let pending = Pending6 {
        pod: flow.src,
        port: flow.sport,
        l2: reversed_l2(ctx)?,
        // SAFETY: `skb` is the context the kernel passed in.
        ifindex: unsafe { (*ctx.skb.skb).ifindex },
    };
    PENDING6.insert(key, pending, 0).ok()
}

/// Forgets what `this` holds under `flow`, and the other direction of the
/// same connection in `other`, under the key `other_key` makes of it.
#[inline(always)]
fn forget<F: 'static, N: Copy + 'static>(
    this: &LruHashMap<F, N>,
    other: &LruHashMap<F, N>,
    flow: F,
    other_key: impl FnOnce(&F, &N) -> F,
) {
    // SAFETY: the value is copied out at once.
    if let Some(nat) = unsafe { this.get(&flow) }.copied() {
        let _ = other.remove(other_key(&flow, &nat));
        let _ = this.remove(flow);
    }
}

/// Forgets both directions of a closing connection, by its pod's side.
fn forget_out4(flow: Flow4) {
    forget(&NAT_OUT4, &NAT_IN4, flow, |f, nat| Flow4 {
        src: f.dst,
        dst: nat.addr,
        sport: f.dport,
        dport: nat.port,
    });
}

/// [`forget_out4`] for IPv6.
fn forget_out6(flow: Flow6) {
    forget(&NAT_OUT6, &NAT_IN6, flow, |f, nat| Flow6 {
        src: f.dst,
        dst: nat.addr,
        sport: f.dport,
        dport: nat.port,
    });
}

/// Forgets both directions of a closing connection, by its remote side.
fn forget_in4(flow: Flow4) {
    forget(&NAT_IN4, &NAT_OUT4, flow, |f, nat| Flow4 {
        src: nat.addr,
        dst: f.src,
        sport: nat.port,
        dport: f.sport,
    });
}

/// [`forget_in4`] for IPv6.
fn forget_in6(flow: Flow6) {
    forget(&NAT_IN6, &NAT_OUT6, flow, |f, nat| Flow6 {
        src: nat.addr,
        dst: f.src,
        sport: nat.port,
        dport: f.sport,
    });
}

/// Rewrites an IPv4 TCP packet's address at `addr_at` and port at
/// `port_at` (source or destination), with both checksums, takes one from
/// its TTL and writes the Ethernet header `l2`.
#[expect(
    clippy::too_many_arguments,
    reason = "inlined: a BPF call takes at most five arguments"
)]
#[inline(always)]
fn rewrite4(
    ctx: &TcContext,
    addr_at: usize,
    port_at: usize,
    old: [u8; 4],
    new: [u8; 4],
    old_port: [u8; 2],
    new_port: [u8; 2],
    ttl: u8,
    l2: &[u8; 14],
) -> Option<()> {
    let csum = TCP4 + TCP_CSUM;
    let (from, to) = (
        u64::from(u32::from_ne_bytes(old)),
        u64::from(u32::from_ne_bytes(new)),
    );
    ctx.l4_csum_replace(csum, from, to, u64::from(BPF_F_PSEUDO_HDR) | 4)
        .ok()?;
    ctx.l3_csum_replace(IP4_CSUM, from, to, 4).ok()?;
    ctx.store(addr_at, &new, 0).ok()?;
    port(ctx, csum, port_at, old_port, new_port)?;
    let protocol: u8 = ctx.load(IP4_TTL + 1).ok()?;
    let (from, to) = (
        u64::from(u16::from_ne_bytes([ttl, protocol])),
        u64::from(u16::from_ne_bytes([ttl - 1, protocol])),
    );
    ctx.l3_csum_replace(IP4_CSUM, from, to, 2).ok()?;
    ctx.store(IP4_TTL, &(ttl - 1), 0).ok()?;
    ctx.store(0, l2, 0).ok()
}

/// [`rewrite4`] for IPv6 (no header checksum; the hop limit).
#[expect(
    clippy::too_many_arguments,
    reason = "inlined: a BPF call takes at most five arguments"
)]
#[inline(always)]
fn rewrite6(
    ctx: &TcContext,
    addr_at: usize,
    port_at: usize,
    old: [u8; 16],
    new: [u8; 16],
    old_port: [u8; 2],
    new_port: [u8; 2],
    hops: u8,
    l2: &[u8; 14],
) -> Option<()> {
    let csum = TCP6 + TCP_CSUM;
    let mut from = words(old);
    let mut to = words(new);
    // SAFETY: both arrays live for the call and are 16 bytes long.
    let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
    if diff < 0 {
        return None;
    }
    // Size 0: `to` is a checksum difference. (On a packet whose checksum
    // the device completed, `skb->csum` is then updated as for IPv4: it is
    // not needed again, since the packet only leaves by another device,
    // out of the tunnel or of the uplink, never back up a stack.)
    ctx.l4_csum_replace(csum, 0, diff as u64, u64::from(BPF_F_PSEUDO_HDR))
        .ok()?;
    ctx.store(addr_at, &new, 0).ok()?;
    port(ctx, csum, port_at, old_port, new_port)?;
    ctx.store(IP6_HOPS, &(hops - 1), 0).ok()?;
    ctx.store(0, l2, 0).ok()
}

/// Rewrites a port, with the TCP checksum.
fn port(ctx: &TcContext, csum: usize, at: usize, old: [u8; 2], new: [u8; 2]) -> Option<()> {
    if old == new {
        return Some(());
    }
    let (from, to) = (
        u64::from(u16::from_ne_bytes(old)),
        u64::from(u16::from_ne_bytes(new)),
    );
    ctx.l4_csum_replace(csum, from, to, 2).ok()?;
    ctx.store(at, &new, 0).ok()
}

/// An IPv6 address as the four words `bpf_csum_diff` sums.
fn words(addr: [u8; 16]) -> [u32; 4] {
    let mut out = [0u32; 4];
    for (i, word) in out.iter_mut().enumerate() {
        *word = u32::from_ne_bytes([
            addr[4 * i],
            addr[4 * i + 1],
            addr[4 * i + 2],
            addr[4 * i + 3],
        ]);
    }
    out
}

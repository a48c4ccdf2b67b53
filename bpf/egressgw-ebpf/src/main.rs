//! The eBPF datapath's classifier, on TC ingress of the interfaces pod
//! traffic enters a node by.
//!
//! For every IPv4 or IPv6 packet: a destination inside the cluster is left
//! alone; otherwise (source, destination) is looked up in the
//! classification trie (longest prefix, see `egressgw-common`). A hit is
//! counted in its policy's per-CPU counter and then, by its verdict, the
//! packet gets its gateway's mark (the policy routes and the firewall do
//! the rest), is dropped (no live gateway, failing closed), or is left
//! alone. Everything else passes untouched.
//!
//! The fast path: a TCP connection a pod opens (its SYN is seen here) to a
//! destination classified to a tunnel whose gateway is known is remembered,
//! and its packets go straight out of the tunnel device, addressed to the
//! gateway's tunnel MAC, past the node's routing and netfilter; on the
//! tunnel device's ingress, `egressgw_reply` hands the connection's
//! replies straight to the pod's interface, addressed with the MACs its
//! first packet carried. A packet too big for the tunnel, IPv4 with
//! options or fragments, IPv6 with extension headers and every other
//! protocol take the marked way, where the kernel does what it must (ICMP
//! "too big", conntrack).
//!
//! The gateway's fast path: on a gateway node, conntrack SNATs a pod's
//! connection as it always did, and the program learns the translation
//! from the stack itself: a pod's pure ACK coming out of the tunnel is
//! remembered by what the SNAT does not change (remote address and port,
//! sequence and acknowledgement numbers), and when the same packet leaves
//! an external interface translated (`egressgw_learn`), the translation
//! is handed to the agent ([`LEARNED`]). The agent makes conntrack's entry
//! liberal about TCP windows (as the kernel's flowtable does) and fills
//! the NAT maps; from then on the connection's packets are translated
//! here and sent straight out (`egressgw_reply` on the tunnel's ingress,
//! `egressgw_nat_in` on the external interfaces' ingress). SYN, FIN and
//! RST, and one packet every 30 s, go through the stack, so that
//! conntrack sees the connection open and close and keeps its entry.

#![no_std]
#![no_main]

mod gateway;
mod underlay;

use aya_ebpf::bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC};
use aya_ebpf::helpers::generated::bpf_redirect;
use aya_ebpf::macros::{classifier, map};
use aya_ebpf::maps::lpm_trie::Key;
use aya_ebpf::maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf};
use aya_ebpf::programs::TcContext;
use egressgw_common::{
    CLASSIFY_MAX, CLUSTER_MAX, COUNTERS_MAX, Counter, Dst4, Dst6, EIPS_MAX, FLOWS_MAX, Flow4,
    Flow6, Handshake4, Handshake6, Key4, Key6, LEARNED_BYTES, LOOKUP4_BITS, LOOKUP6_BITS, NAT_MAX,
    Nat4, Nat6, OFFLOADED_MAX, PEERS_MAX, PENDING_MAX, Pending4, Pending6, PodLink, SWITCHES_MAX,
    TUNNELS_MAX, Tunnel, Underlay, Verdict, kind, tunnel_end,
};

// The names are egressgw-common's constants; the macro wants literals.
#[map(name = "EGRESSGW_CLASSIFY4")]
static CLASSIFY4: LpmTrie<Key4, Verdict> = LpmTrie::with_max_entries(CLASSIFY_MAX, 0);
#[map(name = "EGRESSGW_CLASSIFY6")]
static CLASSIFY6: LpmTrie<Key6, Verdict> = LpmTrie::with_max_entries(CLASSIFY_MAX, 0);
#[map(name = "EGRESSGW_CLUSTER4")]
static CLUSTER4: LpmTrie<Dst4, u32> = LpmTrie::with_max_entries(CLUSTER_MAX, 0);
#[map(name = "EGRESSGW_CLUSTER6")]
static CLUSTER6: LpmTrie<Dst6, u32> = LpmTrie::with_max_entries(CLUSTER_MAX, 0);
#[map(name = "EGRESSGW_COUNTERS")]
static COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(COUNTERS_MAX, 0);
#[map(name = "EGRESSGW_TUNNELS")]
static TUNNELS: HashMap<u32, Tunnel> = HashMap::with_max_entries(TUNNELS_MAX, 0);
#[map(name = "EGRESSGW_FLOWS4")]
static FLOWS4: LruHashMap<Flow4, PodLink> = LruHashMap::with_max_entries(FLOWS_MAX, 0);
#[map(name = "EGRESSGW_FLOWS6")]
static FLOWS6: LruHashMap<Flow6, PodLink> = LruHashMap::with_max_entries(FLOWS_MAX, 0);

#[map(name = "EGRESSGW_NAT_OUT4")]
static NAT_OUT4: LruHashMap<Flow4, Nat4> = LruHashMap::with_max_entries(NAT_MAX, 0);
#[map(name = "EGRESSGW_NAT_IN4")]
static NAT_IN4: LruHashMap<Flow4, Nat4> = LruHashMap::with_max_entries(NAT_MAX, 0);
#[map(name = "EGRESSGW_NAT_OUT6")]
static NAT_OUT6: LruHashMap<Flow6, Nat6> = LruHashMap::with_max_entries(NAT_MAX, 0);
#[map(name = "EGRESSGW_NAT_IN6")]
static NAT_IN6: LruHashMap<Flow6, Nat6> = LruHashMap::with_max_entries(NAT_MAX, 0);
#[map(name = "EGRESSGW_PENDING4")]
static PENDING4: LruHashMap<Handshake4, Pending4> = LruHashMap::with_max_entries(PENDING_MAX, 0);
#[map(name = "EGRESSGW_PENDING6")]
static PENDING6: LruHashMap<Handshake6, Pending6> = LruHashMap::with_max_entries(PENDING_MAX, 0);
#[map(name = "EGRESSGW_LEARNED")]
static LEARNED: RingBuf = RingBuf::with_byte_size(LEARNED_BYTES, 0);
#[map(name = "EGRESSGW_REPORTED4")]
static REPORTED4: LruHashMap<Flow4, u64> = LruHashMap::with_max_entries(PENDING_MAX, 0);
#[map(name = "EGRESSGW_REPORTED6")]
static REPORTED6: LruHashMap<Flow6, u64> = LruHashMap::with_max_entries(PENDING_MAX, 0);
#[map(name = "EGRESSGW_EIPS")]
static EIPS: HashMap<[u8; 16], u32> = HashMap::with_max_entries(EIPS_MAX, 0);
#[map(name = "EGRESSGW_SWITCHES")]
static SWITCHES: Array<u32> = Array::with_max_entries(SWITCHES_MAX, 0);
#[map(name = "EGRESSGW_UNDERLAY")]
static UNDERLAY: Array<Underlay> = Array::with_max_entries(1, 0);
#[map(name = "EGRESSGW_PEERS")]
static PEERS: HashMap<[u8; 16], u32> = HashMap::with_max_entries(PEERS_MAX, 0);
#[map(name = "EGRESSGW_OFFLOADED4")]
static OFFLOADED4: LruHashMap<Flow4, u64> = LruHashMap::with_max_entries(OFFLOADED_MAX, 0);
#[map(name = "EGRESSGW_OFFLOADED6")]
static OFFLOADED6: LruHashMap<Flow6, u64> = LruHashMap::with_max_entries(OFFLOADED_MAX, 0);
#[map(name = "EGRESSGW_TUNNEL_END")]
static TUNNEL_END: PerCpuArray<Counter> = PerCpuArray::with_max_entries(tunnel_end::SLOTS, 0);

/// Ethernet header length: where the IP header starts on the interfaces
/// the program attaches to.
const ETH_HLEN: usize = 14;
/// `skb->protocol` values, in network byte order as the field holds them.
const ETH_P_IP: u32 = (0x0800u16).to_be() as u32;
const ETH_P_IPV6: u32 = (0x86ddu16).to_be() as u32;
/// An IPv4 header without options: version 4, 5 words.
const IPV4_PLAIN: u8 = 0x45;
/// The IPv6 header's length; extension headers are not parsed.
const IPV6_HLEN: usize = 40;
const IPPROTO_TCP: u8 = 6;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
/// Where the IPv4 header's fields are, without options.
const IP4_TTL: usize = ETH_HLEN + 8;
const IP4_CSUM: usize = ETH_HLEN + 10;
const IP4_SRC: usize = ETH_HLEN + 12;
const IP4_DST: usize = ETH_HLEN + 16;
const TCP4: usize = ETH_HLEN + 20;
/// And the IPv6 header's.
const IP6_HOPS: usize = ETH_HLEN + 7;
const IP6_SRC: usize = ETH_HLEN + 8;
const IP6_DST: usize = ETH_HLEN + 24;
const TCP6: usize = ETH_HLEN + IPV6_HLEN;
/// The TCP checksum's offset in its header.
const TCP_CSUM: usize = 16;
/// `TC_ACT_REDIRECT`, what `bpf_redirect` returns on success.
const TC_ACT_REDIRECT: i64 = 7;

#[classifier]
pub fn egressgw_classify(ctx: TcContext) -> i32 {
    classify(&ctx).unwrap_or(TC_ACT_OK)
}

#[classifier]
pub fn egressgw_reply(ctx: TcContext) -> i32 {
    reply(&ctx).unwrap_or(TC_ACT_OK)
}

// On an uplink other programs may follow (another CNI's, a host
// firewall's): what the two leave alone goes on to them (`TC_ACT_UNSPEC`,
// TCX's "next").
#[classifier]
pub fn egressgw_nat_in(ctx: TcContext) -> i32 {
    gateway::nat_in(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[classifier]
pub fn egressgw_underlay(ctx: TcContext) -> i32 {
    underlay::underlay(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[classifier]
pub fn egressgw_learn(ctx: TcContext) -> i32 {
    let _ = gateway::learn(&ctx);
    TC_ACT_UNSPEC
}

/// A reply of a fast-path connection goes straight out of the pod's
/// interface, from the MAC the pod sent to, to the pod's MAC; on a gateway
/// node a pod's packet of a connection whose translation is known is
/// translated and sent straight out; everything else passes.
fn reply(ctx: &TcContext) -> Option<i32> {
    // SAFETY: the values are copied out at once; the maps are not changed
    // through these references.
    match ctx.skb.protocol() {
        ETH_P_IP => {
            let (flow, flags, headers) = tcp4(ctx)?;
            if let Some(pod) = unsafe { FLOWS4.get(flow.reversed()) } {
                return to_pod(ctx, *pod);
            }
            gateway::out4(ctx, flow, flags, headers, false)
        }
        ETH_P_IPV6 => {
            let (flow, flags, headers) = tcp6(ctx)?;
            if let Some(pod) = unsafe { FLOWS6.get(flow.reversed()) } {
                return to_pod(ctx, *pod);
            }
            gateway::out6(ctx, flow, flags, headers, false)
        }
        _ => None,
    }
}

/// Sends a reply to the pod `pod` names.
fn to_pod(ctx: &TcContext, pod: PodLink) -> Option<i32> {
    ctx.store(0, &pod.pod_mac, 0).ok()?;
    ctx.store(6, &pod.node_mac, 0).ok()?;
    redirect(pod.ifindex)
}

/// `bpf_redirect` to `ifindex`'s egress; `None` if it refused.
fn redirect(ifindex: u32) -> Option<i32> {
    // SAFETY: a helper call with no pointer arguments.
    let done = unsafe { bpf_redirect(ifindex, 0) };
    (done == TC_ACT_REDIRECT).then_some(done as i32)
}

/// The ports, the TCP flags and the length of the TCP header at `tcp`.
fn tcp_at(ctx: &TcContext, tcp: usize) -> Option<([u8; 2], [u8; 2], u8, u32)> {
    // Up to the flags, in one load.
    let h: [u8; 14] = ctx.load(tcp).ok()?;
    Some(([h[0], h[1]], [h[2], h[3]], h[13], u32::from(h[12] >> 4) * 4))
}

/// The connection, the TCP flags and the length of the IP and TCP headers
/// of a plain (no options, not fragmented) IPv4 TCP packet.
fn tcp4(ctx: &TcContext) -> Option<(Flow4, u8, u32)> {
    tcp4_at(ctx, ETH_HLEN)
}

/// [`tcp4`] of the IPv4 header at `ip`.
#[inline(always)]
fn tcp4_at(ctx: &TcContext, ip: usize) -> Option<(Flow4, u8, u32)> {
    let h: [u8; 20] = ctx.load(ip).ok()?;
    // No options, no more fragments, no offset: the whole packet.
    if h[0] != IPV4_PLAIN || h[6] & 0x3f != 0 || h[7] != 0 || h[9] != IPPROTO_TCP {
        return None;
    }
    let (sport, dport, flags, tcp_len) = tcp_at(ctx, ip + 20)?;
    let flow = Flow4 {
        src: [h[12], h[13], h[14], h[15]],
        dst: [h[16], h[17], h[18], h[19]],
        sport,
        dport,
    };
    Some((flow, flags, 20 + tcp_len))
}

/// The same for an IPv6 TCP packet without extension headers.
fn tcp6(ctx: &TcContext) -> Option<(Flow6, u8, u32)> {
    tcp6_at(ctx, ETH_HLEN)
}

/// [`tcp6`] of the IPv6 header at `ip`.
#[inline(always)]
fn tcp6_at(ctx: &TcContext, ip: usize) -> Option<(Flow6, u8, u32)> {
    let next: u8 = ctx.load(ip + 6).ok()?;
    if next != IPPROTO_TCP {
        return None;
    }
    let src: [u8; 16] = ctx.load(ip + 8).ok()?;
    let dst: [u8; 16] = ctx.load(ip + 24).ok()?;
    let (sport, dport, flags, tcp_len) = tcp_at(ctx, ip + IPV6_HLEN)?;
    let flow = Flow6 {
        src,
        dst,
        sport,
        dport,
    };
    Some((flow, flags, IPV6_HLEN as u32 + tcp_len))
}

/// Remembers a connection whose SYN this is, with how its replies reach
/// the pod, when it takes the fast path (`fast`); `None` for a packet of a
/// connection not remembered (it keeps the marked way).
fn remember<K>(
    ctx: &TcContext,
    flows: &LruHashMap<K, PodLink>,
    flow: K,
    flags: u8,
    fast: bool,
) -> Option<()> {
    let syn = flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    if !fast {
        if syn {
            // Opened on the marked way: its replies come back through the
            // stack, and a connection remembered earlier under the same
            // addresses and ports (another pod's, before the fast path was
            // switched off or its gateway left) must not take them.
            let _ = flows.remove(&flow);
        }
        return None;
    }
    if syn {
        // SAFETY: `skb` is the context the kernel passed in.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        let pod = PodLink {
            ifindex,
            pod_mac: ctx.load(6).ok()?,
            node_mac: ctx.load(0).ok()?,
        };
        flows.insert(flow, pod, 0).ok()
    } else {
        // Opened before the fast path knew it: it keeps the marked way.
        flows.get_ptr(flow).map(|_| ())
    }
}

/// Sends a packet classified to `mark` straight into the tunnel when it
/// belongs to a TCP connection the pod opened here and fits the tunnel;
/// `None`: take the marked way.
fn fast_path(ctx: &TcContext, verdict: &Verdict, ipv6: bool) -> Option<i32> {
    // SAFETY: the value is copied out at once.
    let tunnel = unsafe { TUNNELS.get(verdict.mark) }.copied();
    let fast = tunnel.is_some();
    let headers = if ipv6 {
        let (flow, flags, headers) = tcp6(ctx)?;
        remember(ctx, &FLOWS6, flow, flags, fast)?;
        headers
    } else {
        let (flow, flags, headers) = tcp4(ctx)?;
        remember(ctx, &FLOWS4, flow, flags, fast)?;
        headers
    };
    let tunnel = tunnel?;
    // What goes out of the tunnel per packet: the IP packet, or for a
    // segmentation offload each segment's headers and payload.
    // SAFETY: `skb` is the context the kernel passed in.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    let ip_len = if gso_size == 0 {
        ctx.len().saturating_sub(ETH_HLEN as u32)
    } else {
        headers + gso_size
    };
    if ip_len > tunnel.mtu {
        return None;
    }
    ctx.store(0, &tunnel.dmac, 0).ok()?;
    ctx.store(6, &tunnel.smac, 0).ok()?;
    // The tunnel routes the outer packet with the inner packet's mark: none
    // of egressgw's bits may go with it (a table that saw the frame first
    // may have set them), or the outer packet would be routed into the
    // tunnel again.
    // SAFETY: `skb` is the context the kernel passed in.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark & !verdict.mask);
    redirect(tunnel.ifindex)
}

/// The verdict for `ctx`'s packet; `None` when it cannot be read (left alone).
fn classify(ctx: &TcContext) -> Option<i32> {
    let (verdict, ipv6) = match ctx.skb.protocol() {
        ETH_P_IP => {
            let src: [u8; 4] = ctx.load(ETH_HLEN + 12).ok()?;
            let dst: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
            if CLUSTER4.get(Key::new(32, Dst4 { dst })).is_some() {
                return Some(TC_ACT_OK);
            }
            let verdict = *CLASSIFY4.get(Key::new(LOOKUP4_BITS, Key4 { src, dst }))?;
            (verdict, false)
        }
        ETH_P_IPV6 => {
            let src: [u8; 16] = ctx.load(ETH_HLEN + 8).ok()?;
            let dst: [u8; 16] = ctx.load(ETH_HLEN + 24).ok()?;
            if CLUSTER6.get(Key::new(128, Dst6 { dst })).is_some() {
                return Some(TC_ACT_OK);
            }
            let verdict = *CLASSIFY6.get(Key::new(LOOKUP6_BITS, Key6 { src, dst }))?;
            (verdict, true)
        }
        _ => return Some(TC_ACT_OK),
    };
    count(ctx, &verdict);
    if verdict.kind == kind::MARK
        && let Some(done) = fast_path(ctx, &verdict, ipv6)
    {
        return Some(done);
    }
    Some(act(ctx, &verdict))
}

/// Counts the packet in the verdict's counter.
fn count(ctx: &TcContext, verdict: &Verdict) {
    add(ctx, &COUNTERS, verdict.counter);
}

/// Counts the packet in slot `index` of `counters`.
fn add(ctx: &TcContext, counters: &PerCpuArray<Counter>, index: u32) {
    if let Some(counter) = counters.get_ptr_mut(index) {
        // SAFETY: the pointer is this CPU's slot of the array, valid for the
        // program's run; TC programs are not preempted on their CPU.
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += u64::from(ctx.len());
        }
    }
}

/// Marks, drops or leaves the packet alone, as the verdict says.
fn act(ctx: &TcContext, verdict: &Verdict) -> i32 {
    match verdict.kind {
        kind::MARK => {
            // SAFETY: `skb` is the context the kernel passed in.
            let mark = unsafe { (*ctx.skb.skb).mark };
            ctx.set_mark((mark & !verdict.mask) | (verdict.mark & verdict.mask));
            TC_ACT_OK
        }
        kind::DROP => TC_ACT_SHOT,
        _ => TC_ACT_OK,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

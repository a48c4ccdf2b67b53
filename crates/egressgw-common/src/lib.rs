//! What the eBPF classifier (`bpf/egressgw-ebpf`) and the agent share: the
//! names of the maps, and the layout of their keys and values.
//!
//! The classifier looks a packet's (source, destination) up in a
//! longest-prefix-match trie. A key is the source address followed by the
//! destination address, and its prefix length counts bits over both: an
//! entry for pod `s` and destination network `d/n` has the prefix length
//! `32 + n` (IPv4) or `128 + n` (IPv6), so the source always matches
//! exactly and the most specific destination wins. A lookup uses the
//! packet's full addresses (`64` or `256` bits). Addresses are in network
//! byte order: the trie matches the most significant bits first.
//!
//! Every type is `#[repr(C)]` with no implicit padding, so both sides agree
//! on its bytes.

#![no_std]

/// The IPv4 classification trie.
pub const CLASSIFY4: &str = "EGRESSGW_CLASSIFY4";
/// The IPv6 classification trie.
pub const CLASSIFY6: &str = "EGRESSGW_CLASSIFY6";
/// In-cluster destinations (IPv4), keyed by destination alone
/// ([`Dst4`]): traffic to them is never classified.
pub const CLUSTER4: &str = "EGRESSGW_CLUSTER4";
/// In-cluster destinations (IPv6), keyed by [`Dst6`].
pub const CLUSTER6: &str = "EGRESSGW_CLUSTER6";
/// How many in-cluster ranges each cluster trie holds at most.
pub const CLUSTER_MAX: u32 = 4096;
/// Per-policy traffic counters, per CPU, indexed by [`Verdict::counter`].
pub const COUNTERS: &str = "EGRESSGW_COUNTERS";

/// How many entries each classification trie holds at most.
pub const CLASSIFY_MAX: u32 = 1 << 20;
/// How many counters there are; index 0 counts what no policy claims.
pub const COUNTERS_MAX: u32 = 1 << 14;

/// The classifier program's name in the object.
pub const PROGRAM: &str = "egressgw_classify";
/// The program on the tunnel device's ingress that hands replies of
/// fast-path connections straight to their pod.
pub const REPLY_PROGRAM: &str = "egressgw_reply";

/// Per tunnel mark, where the fast path sends a packet ([`Tunnel`]),
/// keyed by the mark (`u32`).
pub const TUNNELS: &str = "EGRESSGW_TUNNELS";
/// How many tunnel marks the fast path knows at most.
pub const TUNNELS_MAX: u32 = 1024;
/// The TCP connections pods opened on the fast path ([`Flow4`] ->
/// [`PodLink`], where and how their replies reach the pod), least recently
/// used first out.
pub const FLOWS4: &str = "EGRESSGW_FLOWS4";
/// The same for IPv6 ([`Flow6`] -> [`PodLink`]).
pub const FLOWS6: &str = "EGRESSGW_FLOWS6";
/// How many fast-path connections are remembered, per family.
pub const FLOWS_MAX: u32 = 1 << 17;

/// Prefix length of an IPv4 lookup: source and destination, every bit.
pub const LOOKUP4_BITS: u32 = 64;
/// Prefix length of an IPv6 lookup.
pub const LOOKUP6_BITS: u32 = 256;

/// The data of an IPv4 trie key: source, then destination.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
}

/// The data of an IPv6 trie key: source, then destination.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
}

/// The data of an IPv4 in-cluster key.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dst4 {
    pub dst: [u8; 4],
}

/// The data of an IPv6 in-cluster key.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dst6 {
    pub dst: [u8; 16],
}

/// What the classifier does with a packet: [`Verdict::kind`] values.
pub mod kind {
    /// Leave the packet alone (in-cluster or excluded destinations, and
    /// sources that fail open with no live gateway).
    pub const LEAVE: u32 = 0;
    /// Set [`super::Verdict::mark`] under [`super::Verdict::mask`]: the
    /// policy routes and the firewall do the rest.
    pub const MARK: u32 = 1;
    /// Drop it: no live gateway and the gateway fails closed.
    pub const DROP: u32 = 2;
}

/// The value of a trie entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// One of [`kind`].
    pub kind: u32,
    /// The mark to set (gateway or local mark).
    pub mark: u32,
    /// The bits of the packet mark that are egressgw's.
    pub mask: u32,
    /// Which counter counts the packet.
    pub counter: u32,
}

/// Where the fast path sends a packet classified to a tunnel mark: out of
/// the tunnel device, from its MAC to the gateway node's tunnel MAC (the
/// device's forwarding entry for that MAC names the gateway's underlay
/// address).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tunnel {
    /// The tunnel device's interface index.
    pub ifindex: u32,
    /// Its MTU: a bigger packet takes the marked way, where the kernel
    /// answers "too big".
    pub mtu: u32,
    /// Its MAC.
    pub smac: [u8; 6],
    /// The gateway node's tunnel MAC.
    pub dmac: [u8; 6],
}

/// A pod's TCP connection, as its packets carry it: pod address and port,
/// remote address and port (network byte order).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

impl Flow4 {
    /// The connection as its replies carry it.
    #[must_use]
    pub const fn reversed(self) -> Self {
        Flow4 {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
        }
    }
}

/// An IPv6 pod's TCP connection, as [`Flow4`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
}

impl Flow6 {
    /// The connection as its replies carry it.
    #[must_use]
    pub const fn reversed(self) -> Self {
        Flow6 {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
        }
    }
}

/// How a fast-path connection's replies reach its pod: out of the
/// interface its packets came in by, addressed as they were, the other way
/// round. The addresses are the connection's first packet's, so neither a
/// neighbour lookup nor a bridge is needed on the way back (on a bridge
/// CNI the interface is the pod's port of the bridge).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodLink {
    /// The interface's index.
    pub ifindex: u32,
    /// The pod's MAC (the first packet's source).
    pub pod_mac: [u8; 6],
    /// The node's MAC the pod sent to (the first packet's destination).
    pub node_mac: [u8; 6],
}

/// The gateway's fast path: per connection that the gateway node's
/// conntrack SNATed to one of its EIPs, how its packets are translated
/// and where they go, learned from the stack's own translation
/// ([`Learned`]). Keyed by the connection as its pod's packets come out
/// of the tunnel ([`Flow4`]: pod, remote, ports) -> [`Nat4`].
pub const NAT_OUT4: &str = "EGRESSGW_NAT_OUT4";
/// The same, keyed by the connection as its replies arrive from outside
/// (remote, EIP, ports) -> [`Nat4`].
pub const NAT_IN4: &str = "EGRESSGW_NAT_IN4";
/// [`NAT_OUT4`] for IPv6 ([`Flow6`] -> [`Nat6`]).
pub const NAT_OUT6: &str = "EGRESSGW_NAT_OUT6";
/// [`NAT_IN4`] for IPv6.
pub const NAT_IN6: &str = "EGRESSGW_NAT_IN6";
/// How many connections the gateway's fast path holds, per family and
/// direction.
pub const NAT_MAX: u32 = 1 << 17;
/// A pod's packet that came out of the tunnel on a gateway node, waiting
/// to be seen again leaving the node translated ([`Handshake4`] ->
/// [`Pending4`]).
pub const PENDING4: &str = "EGRESSGW_PENDING4";
/// The same for IPv6 ([`Handshake6`] -> [`Pending6`]).
pub const PENDING6: &str = "EGRESSGW_PENDING6";
/// How many packets wait, per family.
pub const PENDING_MAX: u32 = 1 << 14;
/// The translations the stack made, for the agent to take over
/// ([`Learned`]), a ring buffer.
pub const LEARNED: &str = "EGRESSGW_LEARNED";
/// The ring buffer's size in bytes.
pub const LEARNED_BYTES: u32 = 1 << 18;
/// The EIPs this node holds, while the gateway's fast path is on: only a
/// translation to one of them is learned. Keyed by [`eip_key`] -> `u32`
/// (unused).
pub const EIPS: &str = "EGRESSGW_EIPS";
/// How many EIPs a node holds at most, for the gateway's fast path.
pub const EIPS_MAX: u32 = 4096;

/// An address as [`EIPS`] holds it: IPv6, or IPv4 mapped into IPv6
/// (`::ffff:a.b.c.d`).
#[must_use]
pub const fn eip_key4(addr: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, addr[0], addr[1], addr[2], addr[3],
    ]
}

/// Switches (an array of `u32`, indexed by [`switch`]).
pub const SWITCHES: &str = "EGRESSGW_SWITCHES";
/// How many switches there are.
pub const SWITCHES_MAX: u32 = 4;
/// The indexes of [`SWITCHES`].
pub mod switch {
    /// Non-zero on a gateway node with the gateway's fast path on: its
    /// pods' packets out of the tunnel are remembered ([`super::PENDING4`])
    /// and their translations learned.
    pub const GATEWAY: u32 = 0;
}
/// How often, in nanoseconds, the program writes down that a gateway's
/// fast-path connection carried a packet ([`Nat4::seen`]) at most.
pub const SEEN_EVERY_NS: u64 = 1_000_000_000;
/// The connections whose translation the program reported to the agent
/// lately ([`Flow4`], as its pod's packets carry it -> `bpf_ktime_get_ns`
/// of the report): one report per connection per [`REPORT_EVERY_NS`].
pub const REPORTED4: &str = "EGRESSGW_REPORTED4";
/// [`REPORTED4`] for IPv6 ([`Flow6`] -> `u64`).
pub const REPORTED6: &str = "EGRESSGW_REPORTED6";
/// How long after a report the same connection is reported again at the
/// earliest (if the agent did not take it over: it was closing, or the
/// ring buffer was full).
pub const REPORT_EVERY_NS: u64 = 1_000_000_000;

/// The program on a gateway node's external interfaces' ingress that
/// sends replies of fast-path connections straight into the tunnel.
pub const NAT_IN_PROGRAM: &str = "egressgw_nat_in";
/// The program on their egress that learns the stack's translations.
pub const LEARN_PROGRAM: &str = "egressgw_learn";

/// The program on the tunnel's underlay interface's ingress that takes
/// fast-path connections' packets out of the tunnel itself.
pub const UNDERLAY_PROGRAM: &str = "egressgw_underlay";
/// What that program takes as the node's tunnel ([`Underlay`], one entry).
pub const UNDERLAY: &str = "EGRESSGW_UNDERLAY";
/// The other nodes' underlay addresses (IPv6, or IPv4 mapped as
/// [`eip_key4`] maps it -> unused): the only sources the tunnel's end
/// takes frames from.
pub const PEERS: &str = "EGRESSGW_PEERS";
/// How many peers there can be.
pub const PEERS_MAX: u32 = 1 << 14;
/// Connections ([`Flow4`]/[`Flow6`], as the tunnel's frames carry them)
/// a segmentation offload of which went to the tunnel device lately
/// (`bpf_ktime_get_ns` of the last one): their other frames go there
/// too for [`DEVICE_AFTER_OFFLOAD_NS`], so that none overtakes one still
/// queued in the device.
pub const OFFLOADED4: &str = "EGRESSGW_OFFLOADED4";
/// [`OFFLOADED4`] for IPv6 connections.
pub const OFFLOADED6: &str = "EGRESSGW_OFFLOADED6";
/// How many connections [`OFFLOADED4`] and [`OFFLOADED6`] each remember.
pub const OFFLOADED_MAX: u32 = 1 << 16;
/// See [`OFFLOADED4`].
pub const DEVICE_AFTER_OFFLOAD_NS: u64 = 100_000_000;
/// What that program took out of the tunnel, per CPU ([`Counter`]), by
/// where it went: [`tunnel_end::TO_POD`] and [`tunnel_end::OUT`].
pub const TUNNEL_END: &str = "EGRESSGW_TUNNEL_END";

/// The slots of [`TUNNEL_END`].
pub mod tunnel_end {
    /// Replies handed to their pod on the node that opened the connection.
    pub const TO_POD: u32 = 0;
    /// Pods' packets translated and sent out on a gateway node.
    pub const OUT: u32 = 1;
    /// How many slots there are.
    pub const SLOTS: u32 = 2;
}

/// The tunnel as this node's kernel receives it: VXLAN to the node's
/// underlay address. A frame that matches it in every field, is not a
/// segmentation offload and belongs to a fast-path connection is
/// decapsulated by `egressgw_underlay`; every other frame goes to the
/// tunnel device as before.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Underlay {
    /// The node's underlay address: the outer destination (an IPv4
    /// address in the first 4 bytes, the rest 0).
    pub addr: [u8; 16],
    /// The VXLAN UDP port, in network byte order.
    pub port: [u8; 2],
    /// The tunnel device's MAC: the inner destination.
    pub mac: [u8; 6],
    /// The second word of the VXLAN header: the VNI (3 bytes, network
    /// byte order), then a reserved byte (0).
    pub vni: [u8; 4],
    /// The underlay's IP version (4 or 6), where the program decapsulates
    /// (the fast path is on); 0: off.
    pub on: u32,
}

/// How one direction of a gateway's fast-path connection is translated:
/// the address and port written in place of the source (out: the EIP) or
/// destination (in: the pod), the Ethernet header written in front, and
/// the interface it leaves by.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nat4 {
    pub addr: [u8; 4],
    pub port: [u8; 2],
    /// Destination MAC, source MAC, EtherType.
    pub l2: [u8; 14],
    pub ifindex: u32,
    /// The interface's MTU when the connection was learned: a bigger
    /// packet goes through the stack, which answers "too big".
    pub mtu: u32,
    pub _pad: [u8; 4],
    /// `bpf_ktime_get_ns` when the program last translated a packet of it,
    /// written at most every [`SEEN_EVERY_NS`]: the agent keeps
    /// conntrack's entry of a connection in use alive, and forgets one
    /// that is not.
    pub seen: u64,
}

/// [`Nat4`] for IPv6.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nat6 {
    pub addr: [u8; 16],
    pub port: [u8; 2],
    pub l2: [u8; 14],
    pub ifindex: u32,
    pub mtu: u32,
    pub seen: u64,
}

/// What identifies a pod's packet on both sides of the gateway's SNAT:
/// what the SNAT does not change (the remote address and port, the TCP
/// sequence and acknowledgement numbers).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake4 {
    pub remote: [u8; 4],
    pub seq: [u8; 4],
    pub ack: [u8; 4],
    pub rport: [u8; 2],
    pub _pad: [u8; 2],
}

/// [`Handshake4`] for IPv6.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake6 {
    pub remote: [u8; 16],
    pub seq: [u8; 4],
    pub ack: [u8; 4],
    pub rport: [u8; 2],
    pub _pad: [u8; 2],
}

/// A pod's packet as it came out of the tunnel: its address and port, the
/// tunnel device, and the Ethernet header its replies need (to the MAC
/// it came from, from the MAC it was sent to).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending4 {
    pub pod: [u8; 4],
    pub port: [u8; 2],
    pub l2: [u8; 14],
    pub ifindex: u32,
}

/// [`Pending4`] for IPv6.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending6 {
    pub pod: [u8; 16],
    pub port: [u8; 2],
    pub l2: [u8; 14],
    pub ifindex: u32,
}

/// A translation the gateway node's stack made, seen as the translated
/// packet left: the pod's connection (`pod`, `pod_port` to `remote`,
/// `remote_port`) leaves as `eip`, `eip_port`, out of `out_ifindex` with
/// the Ethernet header `out_l2`; its replies go into the tunnel
/// (`tunnel_ifindex`) with `tunnel_l2`. IPv4 addresses fill the first 4
/// bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Learned {
    /// 4 or 6.
    pub family: u32,
    pub out_ifindex: u32,
    pub tunnel_ifindex: u32,
    pub pod: [u8; 16],
    pub remote: [u8; 16],
    pub eip: [u8; 16],
    pub pod_port: [u8; 2],
    pub remote_port: [u8; 2],
    pub eip_port: [u8; 2],
    pub out_l2: [u8; 14],
    pub tunnel_l2: [u8; 14],
    pub _pad: [u8; 2],
}

impl Learned {
    /// The record as the ring buffer holds it (its bytes in memory order);
    /// `None` when there are too few.
    #[must_use]
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        /// The next `N` bytes of `rest`, taken off it.
        fn take<const N: usize>(rest: &mut &[u8]) -> Option<[u8; N]> {
            let (field, tail) = rest.split_first_chunk::<N>()?;
            *rest = tail;
            Some(*field)
        }
        let rest = &mut &bytes[..];
        Some(Learned {
            family: u32::from_ne_bytes(take(rest)?),
            out_ifindex: u32::from_ne_bytes(take(rest)?),
            tunnel_ifindex: u32::from_ne_bytes(take(rest)?),
            pod: take(rest)?,
            remote: take(rest)?,
            eip: take(rest)?,
            pod_port: take(rest)?,
            remote_port: take(rest)?,
            eip_port: take(rest)?,
            out_l2: take(rest)?,
            tunnel_l2: take(rest)?,
            _pad: [0; 2],
        })
    }
}

/// Packets and bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

// No implicit padding: the sizes are the sums of the fields.
const _: () = {
    assert!(size_of::<Nat4>() == 40);
    assert!(size_of::<Nat6>() == 48);
    assert!(size_of::<Handshake4>() == 16);
    assert!(size_of::<Handshake6>() == 28);
    assert!(size_of::<Pending4>() == 24);
    assert!(size_of::<Pending6>() == 36);
    assert!(size_of::<Learned>() == 96);
    assert!(size_of::<Underlay>() == 32);
};

// aya's `Pod` is an unsafe marker trait: each implementation promises a
// `Copy`, `#[repr(C)]` type without padding, for which any bytes are a
// valid value. This is the project's only unsafe code outside the eBPF
// program.
#[cfg(feature = "user")]
#[allow(unsafe_code)]
mod user {
    // SAFETY: each type is `Copy`, `#[repr(C)]`, made of integers and byte
    // arrays only, without padding: every bit pattern is a value.
    unsafe impl aya::Pod for super::Key4 {}
    unsafe impl aya::Pod for super::Key6 {}
    unsafe impl aya::Pod for super::Dst4 {}
    unsafe impl aya::Pod for super::Dst6 {}
    unsafe impl aya::Pod for super::Verdict {}
    unsafe impl aya::Pod for super::Counter {}
    unsafe impl aya::Pod for super::Tunnel {}
    unsafe impl aya::Pod for super::Flow4 {}
    unsafe impl aya::Pod for super::Flow6 {}
    unsafe impl aya::Pod for super::PodLink {}
    unsafe impl aya::Pod for super::Nat4 {}
    unsafe impl aya::Pod for super::Nat6 {}
    unsafe impl aya::Pod for super::Handshake4 {}
    unsafe impl aya::Pod for super::Handshake6 {}
    unsafe impl aya::Pod for super::Pending4 {}
    unsafe impl aya::Pod for super::Pending6 {}
    unsafe impl aya::Pod for super::Learned {}
    unsafe impl aya::Pod for super::Underlay {}
}

#[cfg(test)]
mod tests {
    use super::Learned;

    #[test]
    fn a_learned_record_is_read_field_by_field_and_a_short_one_not_at_all() {
        // The record as the program writes it: three u32 in memory order,
        // then the byte arrays in declaration order.
        let mut bytes = [0u8; 96];
        bytes[..4].copy_from_slice(&4u32.to_ne_bytes());
        bytes[4..8].copy_from_slice(&7u32.to_ne_bytes());
        bytes[8..12].copy_from_slice(&9u32.to_ne_bytes());
        bytes[12..16].copy_from_slice(&[10, 244, 1, 2]);
        bytes[28..32].copy_from_slice(&[198, 51, 100, 1]);
        bytes[44..48].copy_from_slice(&[198, 51, 100, 240]);
        bytes[60..66].copy_from_slice(&[0x9c, 0x40, 0x1f, 0x91, 0x9c, 0x41]);
        bytes[66] = 0xaa;
        bytes[80] = 0xbb;
        let learned = Learned::decode(&bytes).expect("a whole record");
        assert_eq!(
            (learned.family, learned.out_ifindex, learned.tunnel_ifindex),
            (4, 7, 9)
        );
        assert_eq!(learned.pod[..4], [10, 244, 1, 2]);
        assert_eq!(learned.remote[..4], [198, 51, 100, 1]);
        assert_eq!(learned.eip[..4], [198, 51, 100, 240]);
        assert_eq!(
            (learned.pod_port, learned.remote_port, learned.eip_port),
            ([0x9c, 0x40], [0x1f, 0x91], [0x9c, 0x41])
        );
        assert_eq!((learned.out_l2[0], learned.tunnel_l2[0]), (0xaa, 0xbb));
        assert_eq!(Learned::decode(&bytes[..93]), None);
    }
}

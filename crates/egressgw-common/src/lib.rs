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

/// Packets and bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

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
}

//! Forgetting unanswered connections of sources that were just classified,
//! over ctnetlink.
//!
//! A connection attempt that left the normal way before its source was
//! classified (a pod's SYN while its policy was being applied) leaves a
//! conntrack entry behind, bound to the normal way's NAT (a CNI's
//! MASQUERADE) and waiting for an answer that may never come: 120 s for a
//! TCP SYN, and for as long as a UDP sender keeps sending. The next packet
//! of that tuple (the SYN's retransmission, a UDP sender's next datagram,
//! a new connection that happens to reuse the source port) is classified
//! now, but the entry's NAT binding no longer fits its path: the kernel
//! drops it where the output interface changed, and a gateway node's guard
//! drops it where the binding would send it out with the node's address.
//! Nothing leaves with the wrong address, but the connection stalls.
//!
//! So after a reconcile classifies a source anew (or sends it elsewhere),
//! the entries of that source and destination range that never saw an
//! answer are deleted: the next packet starts a fresh entry that follows
//! the classification. Answered connections are left alone: they keep the
//! path they started on, as classification promises.
//!
//! It also makes single TCP entries liberal ([`Ctnetlink::set_liberal`]),
//! as the kernel's flowtable does with the connections it offloads:
//! conntrack stops checking their TCP window. A connection whose middle
//! part bypassed conntrack (the eBPF fast path) comes back with sequence
//! numbers its entry never saw; were it strict, its next tracked packet
//! (its FIN, say) would be out of window, hence invalid: a `ct state
//! invalid` rule drops it, and let through it would leave without its NAT.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::{fmt, net};

use netlink_packet_core::{
    NLA_F_NESTED, NLA_HEADER_SIZE, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR,
    NetlinkBuffer, NlasIterator,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::libc::ENOENT;

use crate::nft::ElemKey;

// nfnetlink and ctnetlink numbers (linux/netfilter/nfnetlink*.h); the
// netlink ones come from netlink-packet-core.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
pub(crate) const AF_UNSPEC: u8 = 0;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IPPROTO_TCP: u8 = 6;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_STATUS: u16 = 3;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;
/// `IPS_SEEN_REPLY`: the connection has seen a packet in the reply direction.
const IPS_SEEN_REPLY: u32 = 1 << 1;
/// `IP_CT_TCP_FLAG_BE_LIBERAL` (linux/netfilter/nf_conntrack_tcp.h), a flag
/// of one direction: its packets are not checked against the TCP window.
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;
/// `TCP_CONNTRACK_ESTABLISHED`: conntrack's state of an open connection.
pub const TCP_ESTABLISHED: u8 = 3;

/// Netlink header length.
const NLMSG_HDR: usize = 16;
/// `struct nfgenmsg` length.
pub(crate) const NFGENMSG: usize = 4;

/// One conntrack entry, as much of it as deciding and deleting need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Address family (`AF_INET`, `AF_INET6`).
    family: u8,
    /// Original direction's source and destination.
    src: IpAddr,
    dst: IpAddr,
    /// `CTA_STATUS` bits.
    status: u32,
    /// The attributes that name the entry for a delete, as they came:
    /// the original tuple, the id and the zone.
    name: Vec<u8>,
}

impl Entry {
    /// Whether the connection has never seen an answer.
    fn unanswered(&self) -> bool {
        self.status & IPS_SEEN_REPLY == 0
    }
}

/// Deletes the unanswered entries whose original source and destination
/// fall under one of `keys`; returns how many went. Entries that vanish
/// meanwhile do not count and are no error.
pub fn forget_unanswered(keys: &[ElemKey]) -> io::Result<usize> {
    if keys.is_empty() {
        return Ok(0);
    }
    let mut ct = Ctnetlink::open()?;
    let stale: Vec<Entry> = ct
        .dump()?
        .into_iter()
        .filter(|e| e.unanswered() && matches(keys, e))
        .collect();
    let mut forgotten = 0;
    for entry in &stale {
        let seq = ct.next_seq();
        match ct.request(&delete_message(entry, seq), seq) {
            Ok(_) => forgotten += 1,
            Err(e) if e.raw_os_error() == Some(ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(forgotten)
}

/// Whether `entry` belongs to one of `keys`.
fn matches(keys: &[ElemKey], entry: &Entry) -> bool {
    keys.iter()
        .any(|k| k.src == entry.src && k.dst.contains(entry.dst))
}

/// Sets `IP_CT_TCP_FLAG_BE_LIBERAL` on both directions of one entry, over a
/// socket of its own: [`Ctnetlink::set_liberal`], which a run of them
/// should use instead.
pub fn set_liberal(tuple: &TcpTuple) -> io::Result<bool> {
    Ctnetlink::open()
        .map_err(|e| named(tuple, e))?
        .set_liberal(tuple)
}

/// A TCP connection as conntrack first saw it: the original tuple of its
/// entry, before any NAT of the entry applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TcpTuple {
    /// Source address of the connection's first packet.
    pub src: IpAddr,
    /// Its destination address, of the source's family.
    pub dst: IpAddr,
    /// Its source port.
    pub sport: u16,
    /// Its destination port.
    pub dport: u16,
}

impl fmt::Display for TcpTuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tcp {} -> {}",
            net::SocketAddr::new(self.src, self.sport),
            net::SocketAddr::new(self.dst, self.dport)
        )
    }
}

/// A failed request about one entry, and the entry.
#[derive(Debug, thiserror::Error)]
#[error("conntrack entry {tuple}: {source}")]
struct TupleError {
    tuple: TcpTuple,
    #[source]
    source: io::Error,
}

/// `e`, of the same kind, naming `tuple`.
fn named(tuple: &TcpTuple, e: io::Error) -> io::Error {
    io::Error::new(
        e.kind(),
        TupleError {
            tuple: *tuple,
            source: e,
        },
    )
}

/// What conntrack holds of a TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Translation {
    /// Its TCP state (`TCP_CONNTRACK_*`, e.g. [`TCP_ESTABLISHED`]).
    pub state: Option<u8>,
    /// The connection as its replies carry it.
    pub reply: Option<TcpTuple>,
    /// Seconds until the entry times out, unless a packet comes first.
    pub timeout: Option<u32>,
}

/// A ctnetlink socket in the network namespace of the thread that opened
/// it, for a run of requests; one at a time.
#[derive(Debug)]
pub struct Ctnetlink {
    socket: Socket,
    /// The last request's sequence number.
    seq: u32,
}

impl Ctnetlink {
    /// Opens a socket; requests that change entries need `CAP_NET_ADMIN`.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self { socket, seq: 0 })
    }

    /// Sets `IP_CT_TCP_FLAG_BE_LIBERAL` on both directions of the zone-0
    /// entry whose original tuple is `tuple`, and nothing else of it (its
    /// state, its other flags, its NAT and timeout stay): from then on
    /// conntrack accepts the connection's packets whatever their sequence
    /// and acknowledgement numbers, as it does with a connection the
    /// flowtable offloaded, and keeps tracking its state (a FIN still
    /// closes it). The flag stays for the entry's life; setting it again
    /// changes nothing.
    ///
    /// `Ok(false)`: there is no such entry (it expired, was deleted, or
    /// the connection was never tracked). Errors name the tuple.
    pub fn set_liberal(&mut self, tuple: &TcpTuple) -> io::Result<bool> {
        let seq = self.next_seq();
        match liberal_message(tuple, seq).and_then(|msg| self.request(&msg, seq)) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(ENOENT) => Ok(false),
            Err(e) => Err(named(tuple, e)),
        }
    }

    /// What conntrack holds of the zone-0 entry whose original tuple is
    /// `tuple`: its TCP state (`TCP_CONNTRACK_*`), its reply tuple (the
    /// connection as its replies carry it: after a SNAT, to the address
    /// and port it was translated to) and its timeout; `None` when there
    /// is no such entry.
    pub fn translation(&mut self, tuple: &TcpTuple) -> io::Result<Option<Translation>> {
        let Some(entry) = self.get(tuple)? else {
            return Ok(None);
        };
        let attrs = &entry[NFGENMSG..];
        let state = find(
            attrs,
            &[CTA_PROTOINFO, CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE],
        )
        .and_then(|v| v.first().copied());
        let reply = (|| {
            let (src, dst) = addresses(find(attrs, &[CTA_TUPLE_REPLY, CTA_TUPLE_IP])?);
            let port = |kind| {
                let v = find(attrs, &[CTA_TUPLE_REPLY, CTA_TUPLE_PROTO, kind])?;
                Some(u16::from_be_bytes(v.get(..2)?.try_into().ok()?))
            };
            Some(TcpTuple {
                src: src?,
                dst: dst?,
                sport: port(CTA_PROTO_SRC_PORT)?,
                dport: port(CTA_PROTO_DST_PORT)?,
            })
        })();
        let timeout = find(attrs, &[CTA_TIMEOUT]).and_then(be_u32);
        Ok(Some(Translation {
            state,
            reply,
            timeout,
        }))
    }

    /// Sets the timeout of the zone-0 entry whose original tuple is
    /// `tuple` to `seconds` from now, and nothing else of it: what a
    /// packet through conntrack would do for a connection in use.
    /// `Ok(false)`: there is no such entry. Errors name the tuple.
    pub fn set_timeout(&mut self, tuple: &TcpTuple, seconds: u32) -> io::Result<bool> {
        let seq = self.next_seq();
        let (family, orig) = tuple_attr(tuple)?;
        let msg = message(
            IPCTNL_MSG_CT_NEW,
            NLM_F_REQUEST | NLM_F_ACK,
            family,
            seq,
            &[orig, attr(CTA_TIMEOUT, &seconds.to_be_bytes())].concat(),
        );
        match self.request(&msg, seq) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(ENOENT) => Ok(false),
            Err(e) => Err(named(tuple, e)),
        }
    }

    /// The zone-0 entry whose original tuple is `tuple`, as ctnetlink
    /// sends it (with its `nfgenmsg`); `None` when there is none.
    fn get(&mut self, tuple: &TcpTuple) -> io::Result<Option<Vec<u8>>> {
        let (family, orig) = tuple_attr(tuple)?;
        let seq = self.next_seq();
        let get = message(
            IPCTNL_MSG_CT_GET,
            NLM_F_REQUEST | NLM_F_ACK,
            family,
            seq,
            &orig,
        );
        match self.request(&get, seq) {
            Ok(answers) => Ok(answers.into_iter().next().filter(|a| a.len() >= NFGENMSG)),
            Err(e) if e.raw_os_error() == Some(ENOENT) => Ok(None),
            Err(e) => Err(named(tuple, e)),
        }
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Every conntrack entry of every family.
    fn dump(&mut self) -> io::Result<Vec<Entry>> {
        let seq = self.next_seq();
        self.socket.send(
            &message(
                IPCTNL_MSG_CT_GET,
                NLM_F_REQUEST | NLM_F_DUMP,
                AF_UNSPEC,
                seq,
                &[],
            ),
            0,
        )?;
        let mut entries = Vec::new();
        loop {
            let (buf, _) = self.socket.recv_from_full()?;
            for msg in messages(&buf) {
                if msg.seq != seq {
                    continue;
                }
                match msg.kind {
                    NLMSG_DONE => return Ok(entries),
                    NLMSG_ERROR => match error_code(msg.payload) {
                        0 => {}
                        code => return Err(io::Error::from_raw_os_error(code)),
                    },
                    _ => entries.extend(parse_entry(msg.payload)),
                }
            }
        }
    }

    /// Sends `msg`, whose sequence number is `seq` and which asks for an
    /// acknowledgement, and waits for it; returns the payloads of the
    /// answers that came before it.
    fn request(&self, msg: &[u8], seq: u32) -> io::Result<Vec<Vec<u8>>> {
        self.socket.send(msg, 0)?;
        let mut answers = Vec::new();
        loop {
            let (buf, _) = self.socket.recv_from_full()?;
            for m in messages(&buf) {
                if m.seq != seq {
                    continue;
                }
                if m.kind == NLMSG_ERROR {
                    return match error_code(m.payload) {
                        0 => Ok(answers),
                        code => Err(io::Error::from_raw_os_error(code)),
                    };
                }
                answers.push(m.payload.to_vec());
            }
        }
    }
}

/// The value of the attribute at `path` (attribute types, outermost
/// first) under `buf`.
fn find<'a>(buf: &'a [u8], path: &[u16]) -> Option<&'a [u8]> {
    let Some((&first, rest)) = path.split_first() else {
        return Some(buf);
    };
    let (_, value, _) = attrs(buf).into_iter().find(|a| a.0 == first)?;
    find(value, rest)
}

fn delete_message(entry: &Entry, seq: u32) -> Vec<u8> {
    message(
        IPCTNL_MSG_CT_DELETE,
        NLM_F_REQUEST | NLM_F_ACK,
        entry.family,
        seq,
        &entry.name,
    )
}

/// The request that sets `BE_LIBERAL` on both directions of `tuple`'s
/// entry. `IPCTNL_MSG_CT_NEW` without `NLM_F_CREATE` changes an existing
/// entry (`ENOENT` when there is none) in what the request carries and
/// nothing else; the kernel's TCP part takes the flags without a state
/// (`nlattr_to_tcp`), and changes only the bits of their masks.
fn liberal_message(tuple: &TcpTuple, seq: u32) -> io::Result<Vec<u8>> {
    let (family, orig) = tuple_attr(tuple)?;
    // struct nf_ct_tcp_flags { __u8 flags; __u8 mask; }
    let flags = [IP_CT_TCP_FLAG_BE_LIBERAL; 2];
    let protoinfo = nested(
        CTA_PROTOINFO,
        &[nested(
            CTA_PROTOINFO_TCP,
            &[
                attr(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, &flags),
                attr(CTA_PROTOINFO_TCP_FLAGS_REPLY, &flags),
            ],
        )],
    );
    Ok(message(
        IPCTNL_MSG_CT_NEW,
        NLM_F_REQUEST | NLM_F_ACK,
        family,
        seq,
        &[orig, protoinfo].concat(),
    ))
}

/// `CTA_TUPLE_ORIG` naming `tuple`, and the address family the request
/// carrying it must say.
fn tuple_attr(tuple: &TcpTuple) -> io::Result<(u8, Vec<u8>)> {
    let (family, ips) = match (tuple.src, tuple.dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => (
            AF_INET,
            [
                attr(CTA_IP_V4_SRC, &src.octets()),
                attr(CTA_IP_V4_DST, &dst.octets()),
            ],
        ),
        (IpAddr::V6(src), IpAddr::V6(dst)) => (
            AF_INET6,
            [
                attr(CTA_IP_V6_SRC, &src.octets()),
                attr(CTA_IP_V6_DST, &dst.octets()),
            ],
        ),
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "source and destination of different address families",
            ));
        }
    };
    let ports = nested(
        CTA_TUPLE_PROTO,
        &[
            attr(CTA_PROTO_NUM, &[IPPROTO_TCP]),
            attr(CTA_PROTO_SRC_PORT, &tuple.sport.to_be_bytes()),
            attr(CTA_PROTO_DST_PORT, &tuple.dport.to_be_bytes()),
        ],
    );
    let orig = nested(CTA_TUPLE_ORIG, &[nested(CTA_TUPLE_IP, &ips), ports]);
    Ok((family, orig))
}

/// One netlink attribute: header, `value`, padding to 4 bytes.
fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = NLA_HEADER_SIZE + value.len();
    let mut out = Vec::with_capacity(align(len));
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(align(len), 0);
    out
}

/// A nested attribute holding `parts`.
fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
    attr(kind | NLA_F_NESTED, &parts.concat())
}

/// A ctnetlink request: header, `nfgenmsg`, attributes.
fn message(kind: u16, flags: u16, family: u8, seq: u32, attrs: &[u8]) -> Vec<u8> {
    nfnl_message(NFNL_SUBSYS_CTNETLINK, kind, flags, family, seq, attrs)
}

/// An nfnetlink request of `subsystem`: header, `nfgenmsg`, attributes.
pub(crate) fn nfnl_message(
    subsystem: u16,
    kind: u16,
    flags: u16,
    family: u8,
    seq: u32,
    attrs: &[u8],
) -> Vec<u8> {
    let len = NLMSG_HDR + NFGENMSG + attrs.len();
    let mut out = vec![0; len];
    let mut header = NetlinkBuffer::new(&mut out);
    header.set_length(u32::try_from(len).unwrap_or(u32::MAX));
    header.set_message_type((subsystem << 8) | kind);
    header.set_flags(flags);
    header.set_sequence_number(seq);
    // nfgenmsg: family, version 0, resource id 0.
    out[NLMSG_HDR] = family;
    out[NLMSG_HDR + NFGENMSG..].copy_from_slice(attrs);
    out
}

/// One netlink message of a buffer.
pub(crate) struct Msg<'a> {
    pub(crate) kind: u16,
    pub(crate) seq: u32,
    pub(crate) payload: &'a [u8],
}

/// The messages of `buf`; stops at the first malformed one.
pub(crate) fn messages(buf: &[u8]) -> Vec<Msg<'_>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while let Ok(msg) = NetlinkBuffer::new_checked(rest) {
        let len = msg.length() as usize;
        out.push(Msg {
            kind: msg.message_type(),
            seq: msg.sequence_number(),
            payload: msg.payload(),
        });
        rest = &rest[align(len).min(rest.len())..];
    }
    out
}

/// The (positive) errno of an `NLMSG_ERROR` payload; 0 is an acknowledgement.
pub(crate) fn error_code(payload: &[u8]) -> i32 {
    payload.get(..4).map_or(nix::libc::EIO, |b| {
        -i32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    })
}

const fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// The attributes of `buf`: (type without flags, payload, the whole
/// attribute as it came); stops at the first malformed one.
pub(crate) fn attrs(buf: &[u8]) -> Vec<(u16, &[u8], &[u8])> {
    NlasIterator::new(buf)
        .map_while(Result::ok)
        .map(|nla| {
            let (kind, len) = (nla.kind(), usize::from(nla.length()));
            let whole = &nla.into_inner()[..len];
            (kind, &whole[NLA_HEADER_SIZE..], whole)
        })
        .collect()
}

/// An entry from a `IPCTNL_MSG_CT_NEW` message of a dump.
pub(crate) fn parse_entry(payload: &[u8]) -> Option<Entry> {
    let (&family, body) = (payload.first()?, payload.get(NFGENMSG..)?);
    let mut src = None;
    let mut dst = None;
    let mut status = None;
    let mut name = Vec::new();
    for (kind, value, whole) in attrs(body) {
        match kind {
            CTA_TUPLE_ORIG => {
                for (k, ip, _) in attrs(value) {
                    if k == CTA_TUPLE_IP {
                        (src, dst) = addresses(ip);
                    }
                }
                push_attr(&mut name, whole);
            }
            CTA_STATUS => status = be_u32(value),
            CTA_ID | CTA_ZONE => push_attr(&mut name, whole),
            _ => {}
        }
    }
    Some(Entry {
        family,
        src: src?,
        dst: dst?,
        status: status?,
        name,
    })
}

/// Copies an attribute as it came, padded to 4 bytes.
fn push_attr(out: &mut Vec<u8>, whole: &[u8]) {
    out.extend_from_slice(whole);
    out.resize(align(out.len()), 0);
}

fn addresses(tuple_ip: &[u8]) -> (Option<IpAddr>, Option<IpAddr>) {
    let mut src = None;
    let mut dst = None;
    for (kind, value, _) in attrs(tuple_ip) {
        let ip = match value.len() {
            4 => <[u8; 4]>::try_from(value)
                .ok()
                .map(|b| IpAddr::V4(Ipv4Addr::from(b))),
            16 => <[u8; 16]>::try_from(value)
                .ok()
                .map(|b| IpAddr::V6(Ipv6Addr::from(b))),
            _ => None,
        };
        match kind {
            CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = ip,
            CTA_IP_V4_DST | CTA_IP_V6_DST => dst = ip,
            _ => {}
        }
    }
    (src, dst)
}

pub(crate) fn be_u32(value: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(value.get(..4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use egressgw_core::net::IpRange;

    use super::*;

    /// A dump message as the kernel sends it for a TCP entry.
    fn dumped(src: Ipv4Addr, dst: Ipv4Addr, status: u32) -> Vec<u8> {
        let orig = nested(
            CTA_TUPLE_ORIG,
            &[
                nested(
                    CTA_TUPLE_IP,
                    &[
                        attr(CTA_IP_V4_SRC, &src.octets()),
                        attr(CTA_IP_V4_DST, &dst.octets()),
                    ],
                ),
                nested(
                    2,
                    &[
                        attr(1, &[6]),
                        attr(2, &40001u16.to_be_bytes()),
                        attr(3, &8080u16.to_be_bytes()),
                    ],
                ),
            ],
        );
        let body = [
            orig,
            nested(2, &[]),
            attr(CTA_STATUS, &status.to_be_bytes()),
            attr(8, &0u32.to_be_bytes()),
            attr(CTA_ID, &7u32.to_be_bytes()),
        ]
        .concat();
        message(0, 0x2, 2, 1, &body)
    }

    #[test]
    fn a_dumped_entry_is_read_and_named_for_its_delete() {
        let buf = dumped(
            Ipv4Addr::new(10, 244, 3, 2),
            Ipv4Addr::new(198, 51, 100, 1),
            0x8, // IPS_SRC_NAT, no reply seen
        );
        let msgs = messages(&buf);
        assert_eq!(msgs.len(), 1);
        let entry = parse_entry(msgs[0].payload).unwrap();
        assert_eq!(entry.family, 2);
        assert_eq!(entry.src, "10.244.3.2".parse::<IpAddr>().unwrap());
        assert_eq!(entry.dst, "198.51.100.1".parse::<IpAddr>().unwrap());
        assert!(entry.unanswered());
        // The delete carries the original tuple and the id, nothing else.
        let del = delete_message(&entry, 9);
        let m = messages(&del);
        let kinds: Vec<u16> = attrs(&m[0].payload[NFGENMSG..])
            .iter()
            .map(|a| a.0)
            .collect();
        assert_eq!(kinds, vec![CTA_TUPLE_ORIG, CTA_ID]);
        assert_eq!(
            m[0].kind,
            (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
        );
        assert_eq!(m[0].seq, 9);
    }

    #[test]
    fn only_entries_under_a_key_match() {
        let entry = parse_entry(
            messages(&dumped(
                Ipv4Addr::new(10, 244, 3, 2),
                Ipv4Addr::new(198, 51, 100, 1),
                IPS_SEEN_REPLY,
            ))[0]
                .payload,
        )
        .unwrap();
        assert!(!entry.unanswered());
        let key = |src: &str, net: &str| ElemKey {
            src: src.parse().unwrap(),
            dst: IpRange::of_net(net.parse().unwrap()),
        };
        assert!(matches(&[key("10.244.3.2", "198.51.100.0/24")], &entry));
        assert!(!matches(&[key("10.244.3.3", "198.51.100.0/24")], &entry));
        assert!(!matches(&[key("10.244.3.2", "203.0.113.0/24")], &entry));
    }

    #[test]
    fn malformed_input_is_cut_short_not_trusted() {
        assert!(messages(&[0xff; 10]).is_empty());
        let mut buf = dumped(Ipv4Addr::LOCALHOST, Ipv4Addr::LOCALHOST, 0);
        buf[0] = 200; // longer than the buffer
        assert!(messages(&buf).is_empty());
        assert!(parse_entry(&[2, 0, 0, 0, 8, 0, 1, 0xff]).is_none());
        assert_eq!(error_code(&[]), nix::libc::EIO);
    }

    fn tuple(src: &str, sport: u16, dst: &str, dport: u16) -> TcpTuple {
        TcpTuple {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            sport,
            dport,
        }
    }

    #[test]
    fn the_liberal_request_names_the_original_tuple_and_sets_one_flag_per_direction() {
        let msg = liberal_message(&tuple("10.0.0.1", 40000, "192.0.2.1", 80), 7).unwrap();
        let header = NetlinkBuffer::new_checked(&msg[..]).unwrap();
        assert_eq!(
            header.message_type(),
            (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW
        );
        // Request and acknowledge; no NLM_F_CREATE: an existing entry only.
        assert_eq!(header.flags(), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(header.sequence_number(), 7);
        assert_eq!(msg[NLMSG_HDR..NLMSG_HDR + NFGENMSG], [AF_INET, 0, 0, 0]);
        // Attribute headers are (length, type) in host order: little-endian here.
        #[rustfmt::skip]
        let want: [u8; 76] = [
            0x34, 0, 1, 0x80,               // CTA_TUPLE_ORIG, nested
              0x14, 0, 1, 0x80,             //   CTA_TUPLE_IP, nested
                8, 0, 1, 0, 10, 0, 0, 1,    //     CTA_IP_V4_SRC
                8, 0, 2, 0, 192, 0, 2, 1,   //     CTA_IP_V4_DST
              0x1c, 0, 2, 0x80,             //   CTA_TUPLE_PROTO, nested
                5, 0, 1, 0, 6, 0, 0, 0,     //     CTA_PROTO_NUM: TCP, padded
                6, 0, 2, 0, 0x9c, 0x40, 0, 0, //   CTA_PROTO_SRC_PORT: 40000, big-endian
                6, 0, 3, 0, 0, 80, 0, 0,    //     CTA_PROTO_DST_PORT: 80
            0x18, 0, 4, 0x80,               // CTA_PROTOINFO, nested
              0x14, 0, 1, 0x80,             //   CTA_PROTOINFO_TCP, nested
                6, 0, 4, 0, 8, 8, 0, 0,     //     FLAGS_ORIGINAL: flags, mask
                6, 0, 5, 0, 8, 8, 0, 0,     //     FLAGS_REPLY
        ];
        if cfg!(target_endian = "little") {
            assert_eq!(msg[NLMSG_HDR + NFGENMSG..], want);
        }
        assert_eq!(usize::try_from(header.length()).unwrap(), msg.len());
        assert_eq!(msg.len(), NLMSG_HDR + NFGENMSG + want.len());
    }

    #[test]
    fn an_ipv6_tuple_is_named_with_ipv6_attributes() {
        let msg = liberal_message(&tuple("fd00::1", 1, "2001:db8::1", 443), 1).unwrap();
        assert_eq!(msg[NLMSG_HDR], AF_INET6);
        let body = &msg[NLMSG_HDR + NFGENMSG..];
        let ips = find(body, &[CTA_TUPLE_ORIG, CTA_TUPLE_IP]).unwrap();
        let src = find(ips, &[CTA_IP_V6_SRC]).unwrap();
        assert_eq!(src, "fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        let dst = find(ips, &[CTA_IP_V6_DST]).unwrap();
        assert_eq!(dst, "2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        let dport = find(body, &[CTA_TUPLE_ORIG, CTA_TUPLE_PROTO, CTA_PROTO_DST_PORT]);
        assert_eq!(dport, Some(&443u16.to_be_bytes()[..]));
    }

    #[test]
    fn a_tuple_mixing_families_is_refused_before_it_is_sent_and_named() {
        let mixed = tuple("10.0.0.1", 1, "2001:db8::1", 2);
        let err = liberal_message(&mixed, 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        // A netlink socket of no privilege; nothing is sent on it.
        let err = Ctnetlink::open().unwrap().set_liberal(&mixed).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(
            err.to_string()
                .starts_with("conntrack entry tcp 10.0.0.1:1 -> [2001:db8::1]:2: "),
            "{err}"
        );
    }

    /// The TCP flags of `tuple`'s entry, original and reply direction, as
    /// a ctnetlink get reads them; `None` when there is no such entry.
    fn tcp_flags(ct: &mut Ctnetlink, tuple: &TcpTuple) -> Option<[u8; 2]> {
        let answer = ct
            .get(tuple)
            .unwrap_or_else(|e| panic!("get {tuple}: {e}"))?;
        let entry = &answer[NFGENMSG..];
        let flags = |kind| {
            let value = find(entry, &[CTA_PROTOINFO, CTA_PROTOINFO_TCP, kind]);
            *value
                .and_then(<[u8]>::first)
                .expect("the entry's TCP flags")
        };
        Some([
            flags(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL),
            flags(CTA_PROTOINFO_TCP_FLAGS_REPLY),
        ])
    }

    /// The real kernel, in network namespaces of the tests' own.
    mod kernel {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::time::Duration;

        use super::*;
        use crate::testns::{in_new_netns, root_or_skip, sh};

        const LIBERAL: u8 = IP_CT_TCP_FLAG_BE_LIBERAL;
        /// How long any one read, write or connect may wait.
        const PATIENCE: Duration = Duration::from_secs(5);

        /// Makes conntrack track the namespace's connections (a rule with
        /// `ct state` in it does), drops the packets it finds invalid, and
        /// lets those of a connection whose server port is in the set
        /// `bypass` skip it, as the eBPF fast path does.
        fn track_connections() {
            sh("nft -f - <<'EOF'
table inet egwct {
    set bypass { type inet_service; }
    chain skip {
        type filter hook output priority raw; policy accept;
        tcp dport @bypass notrack
        tcp sport @bypass notrack
    }
    chain invalid {
        type filter hook output priority filter; policy accept;
        ct state invalid counter drop
    }
}
EOF");
        }

        /// A connection to `listener`: its client end and its server end,
        /// each giving up on a read or write after [`PATIENCE`].
        fn connect(listener: &TcpListener) -> (TcpStream, TcpStream) {
            let to = listener.local_addr().unwrap();
            let client = TcpStream::connect_timeout(&to, PATIENCE).unwrap();
            // Connected, hence queued: the accept returns at once.
            let (server, _) = listener.accept().unwrap();
            for end in [&client, &server] {
                end.set_read_timeout(Some(PATIENCE)).unwrap();
                end.set_write_timeout(Some(PATIENCE)).unwrap();
            }
            (client, server)
        }

        /// The original tuple of the connection whose client end is `client`.
        fn original_tuple(client: &TcpStream) -> TcpTuple {
            let (local, peer) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
            TcpTuple {
                src: local.ip(),
                dst: peer.ip(),
                sport: local.port(),
                dport: peer.port(),
            }
        }

        /// Sends `bytes` bytes from `from` and reads them at `to`, a chunk
        /// at a time so that neither end waits for the other.
        fn carry(mut from: &TcpStream, mut to: &TcpStream, bytes: usize) {
            let chunk = [0x5a; 16 * 1024];
            let mut read = vec![0; chunk.len()];
            for _ in 0..bytes.div_ceil(chunk.len()) {
                from.write_all(&chunk).unwrap();
                to.read_exact(&mut read).unwrap();
            }
        }

        /// Whether one byte sent from `from` reaches `to` within `within`.
        fn arrives(mut from: &TcpStream, mut to: &TcpStream, within: Duration) -> bool {
            from.write_all(b"x").unwrap();
            to.set_read_timeout(Some(within)).unwrap();
            let got = match to.read(&mut [0]) {
                Ok(n) => n == 1,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    false
                }
                Err(e) => panic!("read: {e}"),
            };
            to.set_read_timeout(Some(PATIENCE)).unwrap();
            got
        }

        #[test]
        fn a_connections_translation_is_read_and_its_timeout_set() {
            if !root_or_skip("a_connections_translation_is_read_and_its_timeout_set") {
                return;
            }
            in_new_netns(|| {
                track_connections();
                let mut ct = Ctnetlink::open().unwrap();
                for lo in ["127.0.0.1", "::1"] {
                    let listener = TcpListener::bind((lo, 0)).unwrap();
                    let (client, server) = connect(&listener);
                    carry(&client, &server, 1);
                    let tuple = original_tuple(&client);
                    let found = ct.translation(&tuple).unwrap().expect("tracked");
                    assert_eq!(found.state, Some(TCP_ESTABLISHED), "{tuple}");
                    // No NAT: the replies carry the tuple the other way round.
                    let reply = TcpTuple {
                        src: tuple.dst,
                        dst: tuple.src,
                        sport: tuple.dport,
                        dport: tuple.sport,
                    };
                    assert_eq!(found.reply, Some(reply), "{tuple}");
                    for seconds in [1234, 98_765] {
                        assert!(ct.set_timeout(&tuple, seconds).unwrap(), "{tuple}");
                        let answer = ct.get(&tuple).unwrap().unwrap();
                        let left = find(&answer[NFGENMSG..], &[CTA_TIMEOUT])
                            .and_then(be_u32)
                            .expect("a timeout");
                        assert!(
                            left <= seconds && left + 5 >= seconds,
                            "{tuple}: {left} s left after setting {seconds}"
                        );
                    }
                    drop((client, server));
                }
                let gone = TcpTuple {
                    src: "127.0.0.1".parse().unwrap(),
                    dst: "127.0.0.1".parse().unwrap(),
                    sport: 1,
                    dport: 2,
                };
                assert_eq!(ct.translation(&gone).unwrap(), None);
                assert!(!ct.set_timeout(&gone, 60).unwrap());
            });
        }

        #[test]
        fn a_tracked_connection_is_made_liberal_in_both_directions_and_only_then() {
            if !root_or_skip(
                "a_tracked_connection_is_made_liberal_in_both_directions_and_only_then",
            ) {
                return;
            }
            in_new_netns(|| {
                track_connections();
                let mut ct = Ctnetlink::open().unwrap();
                for lo in ["127.0.0.1", "::1"] {
                    let listener = TcpListener::bind((lo, 0)).unwrap();
                    let (client, server) = connect(&listener);
                    carry(&client, &server, 1);
                    let tuple = original_tuple(&client);
                    let before = tcp_flags(&mut ct, &tuple).expect("conntrack tracks it");
                    assert_eq!(before.map(|f| f & LIBERAL), [0, 0], "{tuple}: {before:?}");
                    assert!(ct.set_liberal(&tuple).unwrap(), "{tuple}");
                    let after = tcp_flags(&mut ct, &tuple).unwrap();
                    assert_eq!(
                        after.map(|f| f & LIBERAL),
                        [LIBERAL; 2],
                        "{tuple}: {after:?}"
                    );
                    // Again: nothing to change, and no error.
                    assert!(set_liberal(&tuple).unwrap(), "{tuple}");
                }
            });
        }

        #[test]
        fn a_tuple_without_an_entry_is_reported_missing() {
            if !root_or_skip("a_tuple_without_an_entry_is_reported_missing") {
                return;
            }
            in_new_netns(|| {
                track_connections();
                for lo in ["127.0.0.1", "::1"] {
                    let missing = tuple(lo, 1, lo, 2);
                    assert!(!set_liberal(&missing).unwrap(), "{missing}");
                    assert!(!Ctnetlink::open().unwrap().set_liberal(&missing).unwrap());
                }
            });
        }

        /// Two connections carry data in both directions past conntrack
        /// (notrack, as the eBPF fast path would), far beyond the window
        /// their entries last saw, then come back to it: the one made
        /// liberal carries on to its FIN; the other stalls, its packets
        /// invalid and dropped, which is what the first was spared.
        #[test]
        fn a_liberal_connection_carries_on_after_bypassing_conntrack_and_a_strict_one_stalls() {
            if !root_or_skip(
                "a_liberal_connection_carries_on_after_bypassing_conntrack_and_a_strict_one_stalls",
            ) {
                return;
            }
            in_new_netns(|| {
                track_connections();
                let listener = TcpListener::bind("127.0.0.1:0").unwrap();
                let port = listener.local_addr().unwrap().port();
                let strict = connect(&listener);
                let liberal = connect(&listener);
                for (client, server) in [&strict, &liberal] {
                    carry(client, server, 1024);
                    carry(server, client, 1024);
                }
                sh(&format!("nft add element inet egwct bypass {{ {port} }}"));
                for (client, server) in [&strict, &liberal] {
                    carry(client, server, 16 << 20);
                    carry(server, client, 16 << 20);
                }
                sh(&format!(
                    "nft delete element inet egwct bypass {{ {port} }}"
                ));

                let mut ct = Ctnetlink::open().unwrap();
                assert!(ct.set_liberal(&original_tuple(&liberal.0)).unwrap());
                let (client, server) = &liberal;
                assert!(arrives(client, server, PATIENCE), "client to server");
                assert!(arrives(server, client, PATIENCE), "server to client");
                client.shutdown(Shutdown::Write).unwrap();
                assert_eq!((&*server).read(&mut [0]).unwrap(), 0, "the FIN arrives");

                let (client, server) = &strict;
                assert!(
                    !arrives(client, server, Duration::from_secs(1)),
                    "a strict connection back from the bypass stalls"
                );
                let drops = sh("nft list chain inet egwct invalid");
                assert!(!drops.contains("packets 0 "), "{drops}");
            });
        }
    }
}

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

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{
    NLA_HEADER_SIZE, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NetlinkBuffer,
    NlasIterator,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::nft::ElemKey;

// nfnetlink and ctnetlink numbers (linux/netfilter/nfnetlink*.h); the
// netlink ones come from netlink-packet-core.
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
pub(crate) const AF_UNSPEC: u8 = 0;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_STATUS: u16 = 3;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
/// `IPS_SEEN_REPLY`: the connection has seen a packet in the reply direction.
const IPS_SEEN_REPLY: u32 = 1 << 1;

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
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let stale: Vec<Entry> = dump(&socket)?
        .into_iter()
        .filter(|e| e.unanswered() && matches(keys, e))
        .collect();
    let mut forgotten = 0;
    for (seq, entry) in (2..).zip(&stale) {
        match request(&socket, &delete_message(entry, seq), seq) {
            Ok(()) => forgotten += 1,
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOENT) => {}
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

/// Every conntrack entry of every family.
fn dump(socket: &Socket) -> io::Result<Vec<Entry>> {
    let seq = 1;
    socket.send(
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
        let (buf, _) = socket.recv_from_full()?;
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

/// Sends `msg` and waits for its acknowledgement.
fn request(socket: &Socket, msg: &[u8], seq: u32) -> io::Result<()> {
    socket.send(msg, 0)?;
    loop {
        let (buf, _) = socket.recv_from_full()?;
        for m in messages(&buf) {
            if m.seq == seq && m.kind == NLMSG_ERROR {
                return match error_code(m.payload) {
                    0 => Ok(()),
                    code => Err(io::Error::from_raw_os_error(code)),
                };
            }
        }
    }
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
    use netlink_packet_core::NLA_F_NESTED;

    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&u16::try_from(4 + value.len()).unwrap().to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(align(out.len()), 0);
        out
    }

    fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
        attr(kind | NLA_F_NESTED, &parts.concat())
    }

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
}

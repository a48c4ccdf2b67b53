//! The ruleset's generation: the kernel counts every nftables transaction
//! it commits in a network namespace, whoever sends it (`NFT_MSG_GETGEN`).
//! While it stays where egressgw's own last transaction left it, nothing
//! in the ruleset changed since.

use std::io;

use netlink_packet_core::{NLM_F_REQUEST, NLMSG_ERROR};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::conntrack::{AF_UNSPEC, NFGENMSG, attrs, be_u32, error_code, messages, nfnl_message};

// linux/netfilter/nfnetlink.h and nf_tables.h.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;

/// The generation of the caller's network namespace's ruleset.
pub fn generation() -> io::Result<u32> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let seq = 1;
    let request = nfnl_message(
        NFNL_SUBSYS_NFTABLES,
        NFT_MSG_GETGEN,
        NLM_F_REQUEST,
        AF_UNSPEC,
        seq,
        &[],
    );
    socket.send(&request, 0)?;
    loop {
        let (buf, _) = socket.recv_from_full()?;
        for msg in messages(&buf) {
            if msg.seq != seq {
                continue;
            }
            if msg.kind == NLMSG_ERROR {
                match error_code(msg.payload) {
                    0 => continue,
                    code => return Err(io::Error::from_raw_os_error(code)),
                }
            }
            if msg.kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
                return parse_generation(msg.payload).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidData, "NFT_MSG_NEWGEN without its id")
                });
            }
        }
    }
}

/// The generation in a `NFT_MSG_NEWGEN` payload (`nfgenmsg`, attributes).
pub(crate) fn parse_generation(payload: &[u8]) -> Option<u32> {
    attrs(payload.get(NFGENMSG..)?)
        .into_iter()
        .find(|(kind, _, _)| *kind == NFTA_GEN_ID)
        .and_then(|(_, value, _)| be_u32(value))
}

/// The generation after the one `generation` committed.
pub(crate) fn next(generation: u32) -> u32 {
    // The kernel skips 0.
    match generation.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_generation_message_gives_its_id() {
        // nfgenmsg, then NFTA_GEN_ID 0x01020304, NFTA_GEN_PROC_PID 7.
        let payload = [
            0, 0, 0x03, 0x04, 8, 0, 1, 0, 1, 2, 3, 4, 8, 0, 2, 0, 0, 0, 0, 7,
        ];
        assert_eq!(parse_generation(&payload), Some(0x0102_0304));
        assert_eq!(parse_generation(&payload[..6]), None);
        assert_eq!(next(u32::MAX), 1);
        assert_eq!(next(41), 42);
    }
}

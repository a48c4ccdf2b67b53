//! Which peers are alive, seen through the tunnel itself.
//!
//! A [`Prober`] sends an ICMP echo request to every peer's tunnel address
//! at a fixed interval, out of the tunnel device only, and records when
//! each peer last answered. The peer's kernel answers, not its agent: a node
//! whose agent is down but whose network works is alive, and a node whose
//! tunnel is broken is not. One thread per family sends and receives; the
//! agent reads [`Prober::live`] as often as it likes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
/// Marks egressgw's echo payloads.
const MAGIC: &[u8] = b"egressgw";

/// A peer to probe: its node name and its tunnel address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// The peer node.
    pub node: String,
    /// Its address on the tunnel.
    pub addr: IpAddr,
}

#[derive(Debug)]
struct Shared {
    /// Targets and when each was added (a new target is given one
    /// `down_after` to answer before it counts as dead).
    targets: Mutex<BTreeMap<IpAddr, (String, Instant)>>,
    /// When each address last answered.
    answered: Mutex<BTreeMap<IpAddr, Instant>>,
    stop: AtomicBool,
}

/// Probes peers through the tunnel device until dropped.
#[derive(Debug)]
pub struct Prober {
    shared: Arc<Shared>,
}

impl Prober {
    /// Starts probing out of `device` every `interval`. Sockets that cannot
    /// be opened yet (no device, no address) are retried every interval, so
    /// the prober can start before the tunnel exists.
    pub fn start(device: &str, interval: Duration) -> Self {
        let shared = Arc::new(Shared {
            targets: Mutex::new(BTreeMap::new()),
            answered: Mutex::new(BTreeMap::new()),
            stop: AtomicBool::new(false),
        });
        // The echo identifier: distinguishes this agent's replies from
        // other pings on the node. Truncation is intended.
        #[allow(clippy::cast_possible_truncation)]
        let ident = (std::process::id() & 0xffff) as u16;
        for ipv6 in [false, true] {
            let shared = Arc::clone(&shared);
            let device = device.to_owned();
            let name = if ipv6 { "probe-ipv6" } else { "probe-ipv4" };
            let spawned = thread::Builder::new()
                .name(name.into())
                .spawn(move || run(&shared, &device, ipv6, ident, interval));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start the {name} thread");
            }
        }
        Prober { shared }
    }

    /// Replaces the set of peers to probe.
    pub fn set_targets(&self, targets: &[Target]) {
        let mut current = lock(&self.shared.targets);
        let now = Instant::now();
        let old = std::mem::take(&mut *current);
        for t in targets {
            let since = old
                .get(&t.addr)
                .filter(|(node, _)| *node == t.node)
                .map_or(now, |(_, since)| *since);
            current.insert(t.addr, (t.node.clone(), since));
        }
    }

    /// The peers that answered within `down_after`, and those added less
    /// than `down_after` ago that have not answered yet.
    pub fn live(&self, down_after: Duration) -> BTreeSet<String> {
        let targets = lock(&self.shared.targets);
        let answered = lock(&self.shared.answered);
        targets
            .iter()
            .filter(|(addr, (_, added))| {
                let last = answered.get(addr).copied().unwrap_or(*added).max(*added);
                last.elapsed() < down_after
            })
            .map(|(_, (node, _))| node.clone())
            .collect()
    }

    /// How long ago each peer last answered (`None`: never).
    pub fn last_answers(&self) -> BTreeMap<String, Option<Duration>> {
        let targets = lock(&self.shared.targets);
        let answered = lock(&self.shared.answered);
        targets
            .iter()
            .map(|(addr, (node, _))| (node.clone(), answered.get(addr).map(Instant::elapsed)))
            .collect()
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The probing loop of one family.
fn run(shared: &Shared, device: &str, ipv6: bool, ident: u16, interval: Duration) {
    let mut socket: Option<Socket> = None;
    let mut seq: u16 = 0;
    let mut next_send = Instant::now();
    let mut buf = [0u8; 1500];
    let mut warned = false;
    while !shared.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= next_send {
            next_send = now + interval;
            let targets: Vec<IpAddr> = lock(&shared.targets)
                .keys()
                .copied()
                .filter(|a| a.is_ipv6() == ipv6)
                .collect();
            if targets.is_empty() {
                thread::sleep(interval);
                continue;
            }
            if socket.is_none() {
                match open(device, ipv6) {
                    Ok(s) => {
                        socket = Some(s);
                        warned = false;
                    }
                    Err(e) => {
                        if !warned {
                            tracing::warn!(device, error = %e, "cannot open the probe socket yet; retrying");
                            warned = true;
                        }
                        thread::sleep(interval);
                        continue;
                    }
                }
            }
            seq = seq.wrapping_add(1);
            let mut failed = false;
            for addr in targets {
                let request = echo_request(ident, seq, addr);
                if let Some(s) = &socket
                    && s.send_to(&request, &SockAddr::from(SocketAddr::new(addr, 0)))
                        .is_err()
                {
                    failed = true;
                }
            }
            if failed {
                // The device may have been replaced: bind afresh next time.
                socket = None;
            }
        }
        let Some(s) = &socket else {
            thread::sleep(next_send.saturating_duration_since(Instant::now()));
            continue;
        };
        let wait = next_send
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        if s.set_read_timeout(Some(wait)).is_err() {
            socket = None;
            continue;
        }
        let Ok(len) = (&*s).read(&mut buf) else {
            continue;
        };
        if let Some(from) = echo_reply_from(&buf[..len], ipv6, ident) {
            let targets = lock(&shared.targets);
            if targets.contains_key(&from) {
                lock(&shared.answered).insert(from, Instant::now());
            }
        }
    }
}

/// A raw ICMP socket bound to `device`.
fn open(device: &str, ipv6: bool) -> std::io::Result<Socket> {
    let (domain, protocol) = if ipv6 {
        (Domain::IPV6, Protocol::ICMPV6)
    } else {
        (Domain::IPV4, Protocol::ICMPV4)
    };
    let socket = Socket::new(domain, Type::RAW, Some(protocol))?;
    socket.bind_device(Some(device.as_bytes()))?;
    Ok(socket)
}

/// An echo request with this agent's identifier, carrying the address it
/// is sent to: the reply echoes it back, which tells whom the reply is from
/// without reading the source address. The kernel fills in the ICMPv6
/// checksum; the ICMPv4 one is computed here.
fn echo_request(ident: u16, seq: u16, to: IpAddr) -> Vec<u8> {
    let kind = if to.is_ipv6() {
        ICMPV6_ECHO_REQUEST
    } else {
        ICMP_ECHO_REQUEST
    };
    let mut packet = vec![kind, 0, 0, 0];
    packet.extend_from_slice(&ident.to_be_bytes());
    packet.extend_from_slice(&seq.to_be_bytes());
    packet.extend_from_slice(MAGIC);
    match to {
        IpAddr::V4(a) => packet.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => packet.extend_from_slice(&a.octets()),
    }
    if to.is_ipv4() {
        let sum = checksum(&packet);
        packet[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    packet
}

/// The peer an echo reply to this agent comes from, if `packet` is one
/// (with its IPv4 header for ICMPv4, as raw IPv4 sockets deliver it).
fn echo_reply_from(packet: &[u8], ipv6: bool, ident: u16) -> Option<IpAddr> {
    let icmp = if ipv6 {
        packet
    } else {
        let header = usize::from(packet.first()? & 0x0f) * 4;
        packet.get(header..)?
    };
    let reply = if ipv6 {
        ICMPV6_ECHO_REPLY
    } else {
        ICMP_ECHO_REPLY
    };
    if icmp.len() < 8 || icmp[0] != reply || icmp[4..6] != ident.to_be_bytes() {
        return None;
    }
    let payload = icmp[8..].strip_prefix(MAGIC)?;
    if ipv6 {
        let octets: [u8; 16] = payload.get(..16)?.try_into().ok()?;
        Some(IpAddr::from(octets))
    } else {
        let octets: [u8; 4] = payload.get(..4)?.try_into().ok()?;
        Some(IpAddr::from(octets))
    }
}

/// The Internet checksum (RFC 1071).
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    #[allow(clippy::cast_possible_truncation)]
    let folded = sum as u16;
    !folded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_icmpv4_echo_request_checksums_to_zero() {
        let packet = echo_request(0x1234, 7, "10.0.0.2".parse().unwrap());
        assert_eq!(packet[0], ICMP_ECHO_REQUEST);
        assert_eq!(checksum(&packet), 0);
        assert_eq!(&packet[4..8], &[0x12, 0x34, 0, 7]);
    }

    #[test]
    fn only_echo_replies_with_this_agents_identifier_count_and_name_the_peer() {
        let peer: IpAddr = "10.0.0.2".parse().unwrap();
        let mut echoed = echo_request(0x1234, 1, peer);
        echoed[0] = ICMP_ECHO_REPLY;
        let mut reply = vec![0x45; 20];
        reply.extend_from_slice(&echoed);
        assert_eq!(echo_reply_from(&reply, false, 0x1234), Some(peer));
        assert_eq!(echo_reply_from(&reply, false, 0x4321), None);
        let mut request = vec![0x45; 20];
        request.extend_from_slice(&echo_request(0x1234, 1, peer));
        assert_eq!(echo_reply_from(&request, false, 0x1234), None);
        let peer6: IpAddr = "fd00::2".parse().unwrap();
        let mut v6 = echo_request(0x1234, 1, peer6);
        v6[0] = ICMPV6_ECHO_REPLY;
        assert_eq!(echo_reply_from(&v6, true, 0x1234), Some(peer6));
    }
}

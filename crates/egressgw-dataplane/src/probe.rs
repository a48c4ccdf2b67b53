//! Which peers are alive, seen through the tunnel itself.
//!
//! A [`Prober`] sends an ICMP echo request to every peer's tunnel address
//! at a fixed interval, out of the tunnel device only, and records when
//! each peer last answered. The peer's kernel answers, not its agent: a node
//! whose agent is down but whose network works is alive, and a node whose
//! tunnel is broken is not. One thread per family sends and receives; the
//! agent reads [`Prober::live`] as often as it likes.
//!
//! It also asks, for each EIP a source node sends traffic to, which of the
//! EIP's candidate nodes holds it ([`Prober::holders`]): an echo request to
//! the EIP itself, routed to the candidate by the candidate's gateway mark
//! (the policy route egressgw already has) with a TTL (hop limit) of 1. A
//! candidate that holds the EIP delivers it locally and its kernel answers;
//! one that does not would have to forward it, which a TTL of 1 forbids.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// A holder question: does `node` (tunnel address `via`, gateway mark
/// `mark`) hold `eip`?
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct HolderTarget {
    /// The candidate node.
    pub node: String,
    /// Its address on the tunnel, in the EIP's family.
    pub via: IpAddr,
    /// Its gateway mark: the policy route to it.
    pub mark: u32,
    /// The EIP.
    pub eip: IpAddr,
}

/// What the probes saw of one peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    /// How long ago it last answered (`None`: never).
    pub last_answer: Option<Duration>,
    /// The round trip of the last probe it answered, from sending the
    /// request to reading the reply (`None`: none answered yet).
    pub round_trip: Option<Duration>,
}

/// A moment in a family's probing: when, and how many rounds of probes
/// had been sent then.
#[derive(Debug, Clone, Copy)]
struct Moment {
    at: Instant,
    round: u64,
}

#[derive(Debug)]
struct Shared {
    /// Targets and when each was added (a new target is given its time to
    /// answer before it counts as dead).
    targets: Mutex<BTreeMap<IpAddr, (String, Moment)>>,
    /// When each address last answered.
    answered: Mutex<BTreeMap<IpAddr, Moment>>,
    /// The round trip of each address's last answered probe.
    round_trips: Mutex<BTreeMap<IpAddr, Duration>>,
    /// Holder questions, and when each (tunnel address, EIP) was last
    /// answered.
    holder_targets: Mutex<Vec<HolderTarget>>,
    held: Mutex<BTreeMap<(IpAddr, IpAddr), Moment>>,
    /// Rounds of probes sent so far, per family (IPv4, IPv6).
    rounds: [AtomicU64; 2],
    stop: AtomicBool,
}

impl Shared {
    fn now(&self, addr: IpAddr) -> Moment {
        Moment {
            at: Instant::now(),
            round: self.rounds[usize::from(addr.is_ipv6())].load(Ordering::Relaxed),
        }
    }

    /// Whether `since` is too long ago: `misses` rounds of probes have gone
    /// out since *and* `down_after` has passed. Counting rounds as well as
    /// time means a prober that could not run (the process stopped, the
    /// machine overloaded) finds no peer dead for its own silence.
    fn silent_since(&self, addr: IpAddr, since: Moment, misses: u32, down_after: Duration) -> bool {
        let now = self.now(addr);
        now.round.saturating_sub(since.round) >= u64::from(misses)
            && since.at.elapsed() >= down_after
    }
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
            round_trips: Mutex::new(BTreeMap::new()),
            holder_targets: Mutex::new(Vec::new()),
            held: Mutex::new(BTreeMap::new()),
            rounds: [AtomicU64::new(0), AtomicU64::new(0)],
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
        let old = std::mem::take(&mut *current);
        for t in targets {
            let since = old
                .get(&t.addr)
                .filter(|(node, _)| *node == t.node)
                .map_or_else(|| self.shared.now(t.addr), |(_, since)| *since);
            current.insert(t.addr, (t.node.clone(), since));
        }
    }

    /// The peers that are not silent: a peer is silent once `misses` rounds
    /// of probes have gone out since it last answered (or was added) and
    /// `down_after` has passed.
    pub fn live(&self, misses: u32, down_after: Duration) -> BTreeSet<String> {
        let targets = lock(&self.shared.targets);
        let answered = lock(&self.shared.answered);
        targets
            .iter()
            .filter(|(addr, (_, added))| {
                let last = answered
                    .get(addr)
                    .filter(|a| a.at > added.at)
                    .unwrap_or(added);
                !self.shared.silent_since(**addr, *last, misses, down_after)
            })
            .map(|(_, (node, _))| node.clone())
            .collect()
    }

    /// Replaces the holder questions.
    pub fn set_holder_targets(&self, targets: &[HolderTarget]) {
        let mut current = lock(&self.shared.holder_targets);
        *current = targets.to_vec();
        current.sort();
        current.dedup();
        lock(&self.shared.held)
            .retain(|(via, eip), _| current.iter().any(|t| t.via == *via && t.eip == *eip));
    }

    /// For each EIP asked about, the nodes that answered for it and are not
    /// silent since (as [`Self::live`] counts it).
    pub fn holders(&self, misses: u32, down_after: Duration) -> BTreeMap<IpAddr, BTreeSet<String>> {
        let targets = lock(&self.shared.holder_targets);
        let held = lock(&self.shared.held);
        let mut holders: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
        for t in targets.iter() {
            if held
                .get(&(t.via, t.eip))
                .is_some_and(|at| !self.shared.silent_since(t.eip, *at, misses, down_after))
            {
                holders.entry(t.eip).or_default().insert(t.node.clone());
            }
        }
        holders
    }

    /// How long ago each peer last answered (`None`: never).
    pub fn last_answers(&self) -> BTreeMap<String, Option<Duration>> {
        self.seen()
            .into_iter()
            .map(|(node, seen)| (node, seen.last_answer))
            .collect()
    }

    /// What the probes saw of each peer.
    pub fn seen(&self) -> BTreeMap<String, Seen> {
        let targets = lock(&self.shared.targets);
        let answered = lock(&self.shared.answered);
        let round_trips = lock(&self.shared.round_trips);
        targets
            .iter()
            .map(|(addr, (node, _))| {
                let seen = Seen {
                    last_answer: answered.get(addr).map(|a| a.at.elapsed()),
                    round_trip: round_trips.get(addr).copied(),
                };
                (node.clone(), seen)
            })
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
    // Holder questions go out of a socket of their own: TTL 1, the mark
    // set per question.
    let mut asking: Option<Socket> = None;
    let mut seq: u16 = 0;
    // The probe each target was sent last: its sequence number and when.
    let mut sent: BTreeMap<IpAddr, (u16, Instant)> = BTreeMap::new();
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
            let questions: Vec<HolderTarget> = lock(&shared.holder_targets)
                .iter()
                .filter(|t| t.eip.is_ipv6() == ipv6 && t.via.is_ipv6() == ipv6)
                .cloned()
                .collect();
            if targets.is_empty() {
                thread::sleep(interval);
                continue;
            }
            // A round counts whether or not its probes can be sent: a
            // tunnel device that is gone is a tunnel that does not work.
            shared.rounds[usize::from(ipv6)].fetch_add(1, Ordering::Relaxed);
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
            sent.retain(|addr, _| targets.contains(addr));
            for addr in targets {
                let request = echo_request(ident, seq, &[addr]);
                let Some(s) = &socket else { continue };
                let at = Instant::now();
                if s.send_to(&request, &SockAddr::from(SocketAddr::new(addr, 0)))
                    .is_err()
                {
                    failed = true;
                } else {
                    sent.insert(addr, (seq, at));
                }
            }
            if failed {
                // The device may have been replaced: bind afresh next time.
                socket = None;
                asking = None;
            }
            if !questions.is_empty() && asking.is_none() {
                asking = open_asking(device, ipv6).ok();
            }
            if let Some(a) = &asking {
                for q in &questions {
                    let request = echo_request(ident, seq, &[q.via, q.eip]);
                    // A question that cannot be sent (no route for the mark
                    // yet) is a question not answered.
                    let _ = a.set_mark(q.mark).and_then(|()| {
                        a.send_to(&request, &SockAddr::from(SocketAddr::new(q.eip, 0)))
                    });
                }
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
        let read_at = Instant::now();
        let Some((answered_seq, addrs)) = echo_reply_from(&buf[..len], ipv6, ident) else {
            continue;
        };
        match addrs.as_slice() {
            [from] => {
                let targets = lock(&shared.targets);
                if targets.contains_key(from) {
                    lock(&shared.answered).insert(*from, shared.now(*from));
                    // Only an answer to the last probe sent times a round
                    // trip: a late answer to an earlier one would not.
                    if let Some((last, at)) = sent.get(from)
                        && *last == answered_seq
                    {
                        lock(&shared.round_trips).insert(*from, read_at - *at);
                    }
                }
            }
            [via, eip] => {
                let asked = lock(&shared.holder_targets)
                    .iter()
                    .any(|t| t.via == *via && t.eip == *eip);
                if asked {
                    lock(&shared.held).insert((*via, *eip), shared.now(*eip));
                }
            }
            _ => {}
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

/// The socket for holder questions: raw ICMP out of `device`, TTL (hop
/// limit) 1, a small receive buffer (the probe socket reads the answers).
fn open_asking(device: &str, ipv6: bool) -> std::io::Result<Socket> {
    let socket = open(device, ipv6)?;
    if ipv6 {
        socket.set_unicast_hops_v6(1)?;
    } else {
        socket.set_ttl_v4(1)?;
    }
    socket.set_recv_buffer_size(1)?;
    Ok(socket)
}

/// Whether `dst` answers an IPv4 echo request of `size` bytes (the whole
/// IP packet) sent with Don't Fragment, out of `device` when given: a
/// path that cannot carry packets that large drops it, or says so with an
/// ICMP error, and either way no echo reply comes back within `timeout`.
/// A packet above the MTU of its route (the device's, or a smaller one a
/// router on the way reported, which the kernel remembers for a while) is
/// refused before it leaves: also no answer. Sends `tries` requests, one
/// at a time, and stops at the first answer.
pub fn answers_unfragmented(
    dst: std::net::Ipv4Addr,
    size: u16,
    device: Option<&str>,
    tries: u8,
    timeout: Duration,
) -> std::io::Result<bool> {
    const IP_HEADER: u16 = 20;
    let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))?;
    if let Some(device) = device {
        socket.bind_device(Some(device.as_bytes()))?;
    }
    socket.set_header_included_v4(true)?;
    // Not the prober's identifier: its answers are not ours.
    let ident = (std::process::id() as u16) ^ 0x5eed;
    let to = SockAddr::from(SocketAddr::new(IpAddr::V4(dst), 0));
    let mut buf = vec![0u8; usize::from(size) + 64];
    for seq in 0..u16::from(tries) {
        let mut icmp = echo_request(ident, seq, &[IpAddr::V4(dst)]);
        let padding = usize::from(size.saturating_sub(IP_HEADER)).saturating_sub(icmp.len());
        icmp.extend(std::iter::repeat_n(0u8, padding));
        icmp[2..4].fill(0);
        let sum = checksum(&icmp);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        let total = u16::try_from(usize::from(IP_HEADER) + icmp.len()).unwrap_or(u16::MAX);
        // Version 4, 20-byte header; DF; TTL 64; ICMP. The kernel fills in
        // the source address, the identification and the header checksum.
        let mut packet = vec![0x45, 0];
        packet.extend_from_slice(&total.to_be_bytes());
        packet.extend_from_slice(&[0, 0, 0x40, 0, 64, 1, 0, 0, 0, 0, 0, 0]);
        packet.extend_from_slice(&dst.octets());
        packet.extend_from_slice(&icmp);
        match socket.send_to(&packet, &to) {
            Err(e) if e.raw_os_error() == Some(nix::libc::EMSGSIZE) => return Ok(false),
            sent => sent?,
        };
        let deadline = Instant::now() + timeout;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            socket.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
            let Ok(len) = (&socket).read(&mut buf) else {
                break;
            };
            if is_reply(&buf[..len], dst, ident, seq) {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Whether `packet` (an IPv4 packet, as raw sockets deliver it) is the
/// echo reply of `dst` to request `ident`/`seq`.
fn is_reply(packet: &[u8], dst: std::net::Ipv4Addr, ident: u16, seq: u16) -> bool {
    let header = usize::from(packet.first().map_or(0, |b| b & 0x0f)) * 4;
    let (Some(from), Some(icmp)) = (packet.get(12..16), packet.get(header..)) else {
        return false;
    };
    from == dst.octets()
        && icmp.len() >= 8
        && icmp[0] == ICMP_ECHO_REPLY
        && icmp[4..6] == ident.to_be_bytes()
        && icmp[6..8] == seq.to_be_bytes()
}

/// An echo request with this agent's identifier, carrying `body`: the
/// address it is sent to (a peer probe) or the tunnel address of the
/// candidate and the EIP (a holder question). The reply echoes it back,
/// which tells whom the reply is from without reading the source address.
/// The kernel fills in the ICMPv6 checksum; the ICMPv4 one is computed here.
fn echo_request(ident: u16, seq: u16, body: &[IpAddr]) -> Vec<u8> {
    let ipv6 = body.first().is_some_and(IpAddr::is_ipv6);
    let kind = if ipv6 {
        ICMPV6_ECHO_REQUEST
    } else {
        ICMP_ECHO_REQUEST
    };
    let mut packet = vec![kind, 0, 0, 0];
    packet.extend_from_slice(&ident.to_be_bytes());
    packet.extend_from_slice(&seq.to_be_bytes());
    packet.extend_from_slice(MAGIC);
    for addr in body {
        match addr {
            IpAddr::V4(a) => packet.extend_from_slice(&a.octets()),
            IpAddr::V6(a) => packet.extend_from_slice(&a.octets()),
        }
    }
    if !ipv6 {
        let sum = checksum(&packet);
        packet[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    packet
}

/// The sequence number and the addresses an echo reply to this agent
/// carries, if `packet` is one (with its IPv4 header for ICMPv4, as raw
/// IPv4 sockets deliver it): the peer it answers for, or the candidate and
/// EIP of a holder question.
pub(crate) fn echo_reply_from(packet: &[u8], ipv6: bool, ident: u16) -> Option<(u16, Vec<IpAddr>)> {
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
    let width = if ipv6 { 16 } else { 4 };
    if payload.is_empty() || payload.len() % width != 0 || payload.len() > 2 * width {
        return None;
    }
    let seq = u16::from_be_bytes([icmp[6], icmp[7]]);
    let addrs = payload
        .chunks(width)
        .map(|c| {
            if ipv6 {
                <[u8; 16]>::try_from(c).ok().map(IpAddr::from)
            } else {
                <[u8; 4]>::try_from(c).ok().map(IpAddr::from)
            }
        })
        .collect::<Option<Vec<_>>>()?;
    Some((seq, addrs))
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
        let packet = echo_request(0x1234, 7, &["10.0.0.2".parse().unwrap()]);
        assert_eq!(packet[0], ICMP_ECHO_REQUEST);
        assert_eq!(checksum(&packet), 0);
        assert_eq!(&packet[4..8], &[0x12, 0x34, 0, 7]);
    }

    #[test]
    fn only_echo_replies_with_this_agents_identifier_count_and_name_the_peer() {
        let peer: IpAddr = "10.0.0.2".parse().unwrap();
        let mut echoed = echo_request(0x1234, 1, &[peer]);
        echoed[0] = ICMP_ECHO_REPLY;
        let mut reply = vec![0x45; 20];
        reply.extend_from_slice(&echoed);
        assert_eq!(
            echo_reply_from(&reply, false, 0x1234),
            Some((1, vec![peer]))
        );
        assert_eq!(echo_reply_from(&reply, false, 0x4321), None);
        let mut request = vec![0x45; 20];
        request.extend_from_slice(&echo_request(0x1234, 1, &[peer]));
        assert_eq!(echo_reply_from(&request, false, 0x1234), None);
        let peer6: IpAddr = "fd00::2".parse().unwrap();
        let mut v6 = echo_request(0x1234, 1, &[peer6]);
        v6[0] = ICMPV6_ECHO_REPLY;
        assert_eq!(echo_reply_from(&v6, true, 0x1234), Some((1, vec![peer6])));
        // A holder question's answer names the candidate and the EIP.
        let eip: IpAddr = "198.51.100.100".parse().unwrap();
        let mut answer = echo_request(0x1234, 2, &[peer, eip]);
        answer[0] = ICMP_ECHO_REPLY;
        let mut packet = vec![0x45; 20];
        packet.extend_from_slice(&answer);
        assert_eq!(
            echo_reply_from(&packet, false, 0x1234),
            Some((2, vec![peer, eip]))
        );
    }

    #[test]
    fn a_peer_is_silent_only_after_rounds_went_out_unanswered_and_time_passed() {
        let shared = Shared {
            targets: Mutex::new(BTreeMap::new()),
            answered: Mutex::new(BTreeMap::new()),
            round_trips: Mutex::new(BTreeMap::new()),
            holder_targets: Mutex::new(Vec::new()),
            held: Mutex::new(BTreeMap::new()),
            rounds: [AtomicU64::new(10), AtomicU64::new(0)],
            stop: AtomicBool::new(false),
        };
        let peer: IpAddr = "10.0.0.2".parse().unwrap();
        let long_ago = Moment {
            at: Instant::now().checked_sub(Duration::from_secs(5)).unwrap(),
            round: 10,
        };
        let misses = 3;
        let down_after = Duration::from_millis(300);
        // The prober itself could not run: no probe went out since.
        assert!(!shared.silent_since(peer, long_ago, misses, down_after));
        shared.rounds[0].store(12, Ordering::Relaxed);
        assert!(!shared.silent_since(peer, long_ago, misses, down_after));
        shared.rounds[0].store(13, Ordering::Relaxed);
        assert!(shared.silent_since(peer, long_ago, misses, down_after));
        // Rounds went out quickly, but not yet for long enough.
        let just_now = Moment {
            at: Instant::now(),
            round: 10,
        };
        assert!(!shared.silent_since(peer, just_now, misses, down_after));
        // IPv6 peers count IPv6 rounds.
        let peer6: IpAddr = "fd00::2".parse().unwrap();
        let long_ago6 = Moment {
            round: 0,
            ..long_ago
        };
        assert!(!shared.silent_since(peer6, long_ago6, misses, down_after));
    }

    /// A path that cannot carry a packet whole drops a Don't-Fragment
    /// probe of that size, and answers a smaller one; a probe above the
    /// sending device's MTU is refused before it leaves. Two namespaces
    /// joined by a veth whose far end has the smaller MTU (a switch port),
    /// and a router behind it whose next link has a smaller MTU still,
    /// which would fragment the probe were it not for Don't Fragment.
    #[test]
    fn a_dont_fragment_probe_larger_than_the_path_goes_unanswered() {
        use crate::testns::{in_new_netns, root_or_skip, sh};
        if !root_or_skip("a_dont_fragment_probe_larger_than_the_path_goes_unanswered") {
            return;
        }
        in_new_netns(|| {
            let peer = format!("egwpmtu{}", std::process::id() % 100_000);
            let far = format!("{peer}f");
            sh(&format!("ip netns add {peer} && ip netns add {far}"));
            let result = std::panic::catch_unwind(|| {
                sh(&format!(
                    "ip link add name pm type veth peer name pm netns {peer}"
                ));
                sh("ip addr add 10.98.0.1/24 dev pm && ip link set pm up");
                sh("ip route add 10.97.0.0/24 via 10.98.0.2");
                sh(&format!(
                    "ip -n {peer} addr add 10.98.0.2/24 dev pm && ip -n {peer} link set pm up && \
                     ip -n {peer} link set lo up && ip -n {peer} link set pm mtu 1400 && \
                     ip netns exec {peer} sysctl -qw net.ipv4.ip_forward=1 && \
                     ip -n {peer} link add name far type veth peer name far netns {far} && \
                     ip -n {peer} addr add 10.97.0.1/24 dev far && ip -n {peer} link set far mtu 1300 up && \
                     ip -n {far} addr add 10.97.0.2/24 dev far && ip -n {far} link set far mtu 1300 up && \
                     ip -n {far} route add default via 10.97.0.1"
                ));
                let wait = Duration::from_millis(300);
                let probe = |dst: &str, size| {
                    answers_unfragmented(dst.parse().unwrap(), size, Some("pm"), 3, wait)
                };
                let near = "10.98.0.2";
                assert!(probe(near, 100).unwrap(), "a small probe is answered");
                assert!(
                    probe(near, 1400).unwrap(),
                    "one the path carries is answered"
                );
                assert!(!probe(near, 1500).unwrap(), "one it cannot carry is not");
                assert!(
                    !probe(near, 1600).unwrap(),
                    "one above the device's MTU is not sent"
                );
                // The router would fragment 1400 bytes for its 1300-byte
                // link, and does not: the probe says Don't Fragment.
                assert!(probe("10.97.0.2", 1300).unwrap(), "through the router");
                assert!(
                    !probe("10.97.0.2", 1400).unwrap(),
                    "not fragmented on the way"
                );
            });
            sh(&format!("ip netns del {peer}; ip netns del {far}"));
            if let Err(e) = result {
                std::panic::resume_unwind(e);
            }
        });
    }

    /// A holder question is answered by the candidate's kernel only when
    /// the candidate holds the EIP: a node that would have to forward it
    /// drops it (TTL 1). Two namespaces joined by a veth play the source
    /// and the candidate; the mark routes the question as egressgw's
    /// policy route does.
    #[test]
    fn only_the_candidate_holding_the_eip_answers_a_holder_question() {
        use crate::testns::{in_new_netns, root_or_skip, sh};
        if !root_or_skip("only_the_candidate_holding_the_eip_answers_a_holder_question") {
            return;
        }
        in_new_netns(|| {
            // The peer (the candidate) and, behind it on the external
            // segment, another host that may hold the EIP instead.
            let peer = format!("egwprobe{}", std::process::id() % 100_000);
            let other = format!("{peer}o");
            sh(&format!("ip netns add {peer} && ip netns add {other}"));
            let result = std::panic::catch_unwind(|| {
                sh(&format!(
                    "ip link add name vx type veth peer name vx netns {peer}"
                ));
                sh("sysctl -qw net.ipv4.conf.all.rp_filter=0");
                sh("ip addr add 10.99.0.1/24 dev vx && ip link set vx up");
                sh(&format!(
                    "ip -n {peer} addr add 10.99.0.2/24 dev vx && ip -n {peer} link set vx up && \
                     ip -n {peer} link set lo up && \
                     ip netns exec {peer} sysctl -qw net.ipv4.ip_forward=1 && \
                     ip -n {peer} link add name ext type veth peer name ext netns {other} && \
                     ip -n {peer} addr add 198.51.100.2/24 dev ext && ip -n {peer} link set ext up && \
                     ip -n {other} addr add 198.51.100.100/24 dev ext && ip -n {other} link set ext up && \
                     ip -n {other} route add default via 198.51.100.2"
                ));
                sh("ip rule add fwmark 0x01000000/0xff000000 table 100 priority 100");
                sh("ip route add default via 10.99.0.2 dev vx onlink table 100");
                let prober = Prober::start("vx", Duration::from_millis(20));
                prober.set_targets(&[Target {
                    node: "peer".into(),
                    addr: "10.99.0.2".parse().unwrap(),
                }]);
                let eip: IpAddr = "198.51.100.100".parse().unwrap();
                prober.set_holder_targets(&[HolderTarget {
                    node: "peer".into(),
                    via: "10.99.0.2".parse().unwrap(),
                    mark: 0x0100_0000,
                    eip,
                }]);
                let within = Duration::from_millis(200);
                let misses = 3;
                let holds = || {
                    prober
                        .holders(misses, within)
                        .get(&eip)
                        .is_some_and(|n| n.contains("peer"))
                };
                let wait_for = |want: bool| {
                    let deadline = Instant::now() + Duration::from_secs(3);
                    while holds() != want {
                        if Instant::now() > deadline {
                            return false;
                        }
                        thread::sleep(Duration::from_millis(20));
                    }
                    true
                };
                thread::sleep(Duration::from_millis(500));
                assert!(
                    prober.live(misses, within).contains("peer"),
                    "the peer answers its probes"
                );
                // And its answers time the round trip.
                let seen = prober.seen()["peer"];
                assert!(
                    seen.round_trip.is_some_and(|rtt| rtt > Duration::ZERO),
                    "{seen:?}"
                );
                // The other host answers for the EIP, but the question
                // never reaches it: the peer does not forward it.
                assert!(!holds(), "the peer does not hold the EIP");
                sh(&format!(
                    "ip -n {other} addr del 198.51.100.100/24 dev ext && \
                     ip -n {peer} addr add 198.51.100.100/32 dev ext"
                ));
                assert!(wait_for(true), "the peer holds the EIP now");
                sh(&format!(
                    "ip -n {peer} addr del 198.51.100.100/32 dev ext && \
                     ip -n {other} addr add 198.51.100.100/24 dev ext && \
                     ip -n {other} route replace default via 198.51.100.2"
                ));
                assert!(wait_for(false), "the peer gave the EIP up");
                thread::sleep(Duration::from_millis(300));
                assert!(
                    !holds(),
                    "the other host's answers never count for the peer"
                );
            });
            sh(&format!("ip netns del {peer}; ip netns del {other}"));
            if let Err(e) = result {
                std::panic::resume_unwind(e);
            }
        });
    }
}

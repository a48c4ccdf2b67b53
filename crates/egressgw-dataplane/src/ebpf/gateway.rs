//! The gateway's fast path, the agent's side: it takes over the
//! translations the program saw the gateway node's stack make.
//!
//! For each one ([`common::Learned`]) the learner checks that the address
//! the connection left with is one of the node's EIPs, makes conntrack's
//! entry of the connection liberal about TCP windows (the packets the
//! program translates pass conntrack by, so its idea of the windows falls
//! behind: the flowtable of the kernel does the same when it offloads a
//! connection), and only then fills the two NAT maps. A connection whose
//! entry is gone, or whose address is not an EIP of the node, stays on the
//! stack's way.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use aya::maps::{HashMap as AyaHashMap, Map, MapData, RingBuf};
use egressgw_common as common;
use egressgw_common::{Flow4, Flow6, Learned, Nat4, Nat6};

use super::{EbpfError, failed};
use crate::conntrack::{Ctnetlink, TcpTuple};

/// How long the learner waits for a record before it looks whether it
/// should stop, or sweep.
const POLL: Duration = Duration::from_millis(100);
/// How often the learner sweeps the connections it holds.
const SWEEP: Duration = Duration::from_secs(30);
/// Conntrack's timeout for an established TCP connection in this network
/// namespace, read at each sweep; the kernel's default if it cannot be.
const ESTABLISHED_TIMEOUT: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established";
const ESTABLISHED_DEFAULT: u32 = 432_000;

/// What the learner did, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Learning {
    /// Connections taken over by the gateway's fast path.
    pub taken: u64,
    /// Translations not taken: not to one of the node's EIPs (any more),
    /// conntrack held the connection translated otherwise, or a step
    /// failed. Connections learned again as they close (conntrack no
    /// longer holds them open) are not counted.
    pub left: u64,
    /// Connections held: as the last sweep (every 30 s) counted them,
    /// and those taken over since; ones closed since are still in.
    pub held: u64,
}

#[derive(Debug, Default)]
struct Counts {
    taken: AtomicU64,
    left: AtomicU64,
    /// Connections held at the last sweep, and taken since.
    held: AtomicU64,
}

/// The thread that takes learned translations over.
#[derive(Debug)]
pub(crate) struct Learner {
    /// The node's EIPs; held while a translation is taken over and while
    /// the set changes, so that no connection of an EIP the node gave up
    /// is taken over after its connections were forgotten.
    /// `None` until the first sync: the pinned maps an agent adopts may
    /// hold connections of EIPs the node no longer has.
    eips: Arc<Mutex<Option<BTreeSet<IpAddr>>>>,
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
    thread: Option<JoinHandle<()>>,
}

/// The NAT maps, as the learner and the classifier each hold them.
pub(crate) struct NatMaps {
    out4: AyaHashMap<MapData, Flow4, Nat4>,
    in4: AyaHashMap<MapData, Flow4, Nat4>,
    out6: AyaHashMap<MapData, Flow6, Nat6>,
    in6: AyaHashMap<MapData, Flow6, Nat6>,
}

impl std::fmt::Debug for NatMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NatMaps")
    }
}

/// A second handle on the map `name` of `ebpf`.
fn reopen(ebpf: &aya::Ebpf, name: &str) -> Result<Map, EbpfError> {
    let what = format!("opening the map {name}");
    let map = ebpf
        .map(name)
        .ok_or_else(|| failed(what.clone())("the object has no such map".into()))?;
    let (Map::LruHashMap(data) | Map::HashMap(data) | Map::Array(data)) = map else {
        return Err(failed(what)("not a hash map or an array".into()));
    };
    let id = data
        .info()
        .map_err(|e| e.to_string())
        .map_err(failed(what.clone()))?
        .id();
    let data = MapData::from_id(id)
        .map_err(|e| e.to_string())
        .map_err(failed(what.clone()))?;
    Map::from_map_data(data)
        .map_err(|e| e.to_string())
        .map_err(failed(what))
}

impl NatMaps {
    pub(crate) fn open(ebpf: &aya::Ebpf) -> Result<Self, EbpfError> {
        fn hash<K: aya::Pod, V: aya::Pod>(
            ebpf: &aya::Ebpf,
            name: &str,
        ) -> Result<AyaHashMap<MapData, K, V>, EbpfError> {
            AyaHashMap::try_from(reopen(ebpf, name)?)
                .map_err(|e| e.to_string())
                .map_err(failed(format!("opening the map {name}")))
        }
        Ok(NatMaps {
            out4: hash(ebpf, common::NAT_OUT4)?,
            in4: hash(ebpf, common::NAT_IN4)?,
            out6: hash(ebpf, common::NAT_OUT6)?,
            in6: hash(ebpf, common::NAT_IN6)?,
        })
    }

    /// Forgets every connection that leaves with an address not in
    /// `eips`, both directions; returns how many.
    pub(crate) fn forget_unless(&mut self, eips: &BTreeSet<IpAddr>) -> usize {
        let (_, gone) = self.retain(|held| eips.contains(&held.eip.0));
        gone
    }

    /// Keeps the connections `keep` says yes to and forgets the others,
    /// both directions, then the reply sides whose pod side is gone (one
    /// pushed out of its map alone); returns how many connections were
    /// kept and how many forgotten.
    fn retain(&mut self, mut keep: impl FnMut(&Held) -> bool) -> (usize, usize) {
        let (kept4, gone4) =
            retain_family(&mut self.out4, &mut self.in4, back4, pod_side4, &mut keep);
        let (kept6, gone6) =
            retain_family(&mut self.out6, &mut self.in6, back6, pod_side6, &mut keep);
        (kept4 + kept6, gone4 + gone6)
    }

    /// How many connections the gateway's fast path holds (a walk over
    /// the maps).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.out4.keys().flatten().count() + self.out6.keys().flatten().count()
    }

    /// Keeps conntrack's entry of every connection held alive while the
    /// connection carries packets past it, and forgets the connections
    /// conntrack no longer holds as they were taken over: conntrack sees
    /// none of their packets but the first and the last, so its timeout
    /// would run out under a connection in use (or, with data it saw
    /// unacknowledged, within minutes), and a connection it forgot (timed
    /// out while idle, deleted by hand) may have its EIP and port given
    /// to another. Both directions of a held connection are checked with
    /// its pod's side; a reply side whose pod side is gone goes. Returns
    /// how many connections are held after the sweep.
    pub(crate) fn sweep(&mut self, conntrack: &mut Ctnetlink, now: u64, active: Duration) -> u64 {
        let timeout = std::fs::read_to_string(ESTABLISHED_TIMEOUT)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(ESTABLISHED_DEFAULT);
        let active = u64::try_from(active.as_nanos()).unwrap_or(u64::MAX);
        let (kept, _) = self.retain(|held| {
            let in_use = now.saturating_sub(held.seen) < active;
            keep(conntrack, &held.tuple, held.eip, in_use, timeout)
        });
        u64::try_from(kept).unwrap_or(u64::MAX)
    }

    /// Takes `learned` over: both directions into the maps.
    fn take(&mut self, learned: &Learned, now: u64) -> Result<(), String> {
        match learned.family {
            4 => {
                let (out, nat) = out4(learned, now);
                self.in4
                    .insert(back4(&out, &nat), in4(learned, now), 0)
                    .map_err(|e| e.to_string())?;
                self.out4.insert(out, nat, 0).map_err(|e| e.to_string())
            }
            6 => {
                let (out, nat) = out6(learned, now);
                self.in6
                    .insert(back6(&out, &nat), in6(learned, now), 0)
                    .map_err(|e| e.to_string())?;
                self.out6.insert(out, nat, 0).map_err(|e| e.to_string())
            }
            other => Err(format!("address family {other}")),
        }
    }

    /// Whether both directions of `learned`'s connection are held (one
    /// may have been pushed out of its map alone).
    fn holds(&self, learned: &Learned) -> bool {
        match learned.family {
            4 => {
                let (out, nat) = out4(learned, 0);
                self.out4.get(&out, 0).is_ok() && self.in4.get(&back4(&out, &nat), 0).is_ok()
            }
            6 => {
                let (out, nat) = out6(learned, 0);
                self.out6.get(&out, 0).is_ok() && self.in6.get(&back6(&out, &nat), 0).is_ok()
            }
            _ => false,
        }
    }
}

fn v4(bytes: &[u8; 16]) -> [u8; 4] {
    [bytes[0], bytes[1], bytes[2], bytes[3]]
}

/// The pod's side: the connection as its packets come out of the tunnel,
/// and their translation.
fn out4(l: &Learned, now: u64) -> (Flow4, Nat4) {
    let flow = Flow4 {
        src: v4(&l.pod),
        dst: v4(&l.remote),
        sport: l.pod_port,
        dport: l.remote_port,
    };
    let nat = Nat4 {
        addr: v4(&l.eip),
        port: l.eip_port,
        l2: l.out_l2,
        ifindex: l.out_ifindex,
        mtu: mtu_of(l.out_ifindex),
        _pad: [0; 4],
        seen: now,
    };
    (flow, nat)
}

/// The replies' translation.
fn in4(l: &Learned, now: u64) -> Nat4 {
    Nat4 {
        addr: v4(&l.pod),
        port: l.pod_port,
        l2: l.tunnel_l2,
        ifindex: l.tunnel_ifindex,
        mtu: mtu_of(l.tunnel_ifindex),
        _pad: [0; 4],
        seen: now,
    }
}

fn out6(l: &Learned, now: u64) -> (Flow6, Nat6) {
    let flow = Flow6 {
        src: l.pod,
        dst: l.remote,
        sport: l.pod_port,
        dport: l.remote_port,
    };
    let nat = Nat6 {
        addr: l.eip,
        port: l.eip_port,
        l2: l.out_l2,
        ifindex: l.out_ifindex,
        mtu: mtu_of(l.out_ifindex),
        seen: now,
    };
    (flow, nat)
}

fn in6(l: &Learned, now: u64) -> Nat6 {
    Nat6 {
        addr: l.pod,
        port: l.pod_port,
        l2: l.tunnel_l2,
        ifindex: l.tunnel_ifindex,
        mtu: mtu_of(l.tunnel_ifindex),
        seen: now,
    }
}

/// The replies' key: as they arrive from the remote, to the EIP.
fn back4(out: &Flow4, nat: &Nat4) -> Flow4 {
    Flow4 {
        src: out.dst,
        dst: nat.addr,
        sport: out.dport,
        dport: nat.port,
    }
}

fn back6(out: &Flow6, nat: &Nat6) -> Flow6 {
    Flow6 {
        src: out.dst,
        dst: nat.addr,
        sport: out.dport,
        dport: nat.port,
    }
}

/// A held connection, whatever its family.
struct Held {
    /// Its pod's side, as conntrack's original tuple.
    tuple: TcpTuple,
    /// The EIP and port it leaves with.
    eip: (IpAddr, u16),
    /// When the program last translated a packet of it.
    seen: u64,
}

/// [`NatMaps::retain`] for one family: `out` and `back_of` its pod's
/// side and the reply side's key, `inn` and `pod_of` the reply side and
/// the pod side's key.
fn retain_family<F, N>(
    out: &mut AyaHashMap<MapData, F, N>,
    inn: &mut AyaHashMap<MapData, F, N>,
    back_of: fn(&F, &N) -> F,
    pod_of: fn(&F, &N) -> F,
    keep: &mut impl FnMut(&Held) -> bool,
) -> (usize, usize)
where
    F: aya::Pod + Flow,
    N: aya::Pod + Translation,
{
    let (mut kept, mut gone) = (0, 0);
    let held: Vec<(F, N)> = out.iter().flatten().collect();
    for (flow, nat) in held {
        let connection = Held {
            tuple: flow.tuple(),
            eip: nat.to(),
            seen: nat.seen(),
        };
        if keep(&connection) {
            kept += 1;
        } else {
            let _ = inn.remove(&back_of(&flow, &nat));
            let _ = out.remove(&flow);
            gone += 1;
        }
    }
    let replies: Vec<(F, N)> = inn.iter().flatten().collect();
    for (flow, nat) in replies {
        if out.get(&pod_of(&flow, &nat), 0).is_err() {
            let _ = inn.remove(&flow);
        }
    }
    (kept, gone)
}

/// A connection key of either family.
trait Flow {
    /// As conntrack's original tuple (for a pod's side).
    fn tuple(&self) -> TcpTuple;
}

impl Flow for Flow4 {
    fn tuple(&self) -> TcpTuple {
        tcp(self.src.into(), self.dst.into(), self.sport, self.dport)
    }
}

impl Flow for Flow6 {
    fn tuple(&self) -> TcpTuple {
        tcp(self.src.into(), self.dst.into(), self.sport, self.dport)
    }
}

/// A translation of either family.
trait Translation {
    /// The address and port it writes.
    fn to(&self) -> (IpAddr, u16);
    fn seen(&self) -> u64;
}

impl Translation for Nat4 {
    fn to(&self) -> (IpAddr, u16) {
        (self.addr.into(), u16::from_be_bytes(self.port))
    }
    fn seen(&self) -> u64 {
        self.seen
    }
}

impl Translation for Nat6 {
    fn to(&self) -> (IpAddr, u16) {
        (self.addr.into(), u16::from_be_bytes(self.port))
    }
    fn seen(&self) -> u64 {
        self.seen
    }
}

/// The pod side's key of a reply side.
fn pod_side4(flow: &Flow4, nat: &Nat4) -> Flow4 {
    Flow4 {
        src: nat.addr,
        dst: flow.src,
        sport: nat.port,
        dport: flow.sport,
    }
}

fn pod_side6(flow: &Flow6, nat: &Nat6) -> Flow6 {
    Flow6 {
        src: nat.addr,
        dst: flow.src,
        sport: nat.port,
        dport: flow.sport,
    }
}

/// A TCP tuple of addresses and ports as packets carry them.
fn tcp(src: IpAddr, dst: IpAddr, sport: [u8; 2], dport: [u8; 2]) -> TcpTuple {
    TcpTuple {
        src,
        dst,
        sport: u16::from_be_bytes(sport),
        dport: u16::from_be_bytes(dport),
    }
}

/// Whether a held connection stays held: conntrack still holds it open
/// and translated as it was taken over (`translated`: the EIP and port);
/// one in use (`in_use`) gets conntrack's timeout for an established
/// connection (`timeout`) from now, as its packets would give it.
fn keep(
    conntrack: &mut Ctnetlink,
    tuple: &TcpTuple,
    translated: (IpAddr, u16),
    in_use: bool,
    timeout: u32,
) -> bool {
    let open = match conntrack.translation(tuple) {
        Ok(Some(found)) => {
            found.state == Some(crate::conntrack::TCP_ESTABLISHED)
                && found
                    .reply
                    .is_some_and(|r| (r.dst, r.dport) == translated && r.src == tuple.dst)
        }
        Ok(None) => false,
        // Kept: the next sweep asks again.
        Err(_) => return true,
    };
    if open && in_use {
        return conntrack.set_timeout(tuple, timeout).unwrap_or(true);
    }
    open
}

/// The connection as conntrack's original tuple holds it.
fn tuple(l: &Learned) -> Option<TcpTuple> {
    let (src, dst) = match l.family {
        4 => (
            IpAddr::from(Ipv4Addr::from(v4(&l.pod))),
            IpAddr::from(Ipv4Addr::from(v4(&l.remote))),
        ),
        6 => (
            IpAddr::from(Ipv6Addr::from(l.pod)),
            IpAddr::from(Ipv6Addr::from(l.remote)),
        ),
        _ => return None,
    };
    Some(TcpTuple {
        src,
        dst,
        sport: u16::from_be_bytes(l.pod_port),
        dport: u16::from_be_bytes(l.remote_port),
    })
}

/// The address a learned connection left with.
fn eip(l: &Learned) -> Option<IpAddr> {
    match l.family {
        4 => Some(IpAddr::from(Ipv4Addr::from(v4(&l.eip)))),
        6 => Some(IpAddr::from(Ipv6Addr::from(l.eip))),
        _ => None,
    }
}

/// The MTU of the interface with index `ifindex` now; 0 (every packet
/// through the stack) when it is gone.
fn mtu_of(ifindex: u32) -> u32 {
    nix::net::if_::if_indextoname(ifindex)
        .ok()
        .and_then(|name| super::device_mtu(&name.to_string_lossy()))
        .unwrap_or(0)
}

/// `bpf_ktime_get_ns`'s clock now.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_nsec()).unwrap_or(0)
    })
}

impl Learner {
    /// Starts the learner on `ebpf`'s ring buffer and NAT maps. Conntrack
    /// is spoken to in the network namespace of the calling thread.
    pub(crate) fn start(ebpf: &mut aya::Ebpf) -> Result<Self, EbpfError> {
        let ring = ebpf
            .take_map(common::LEARNED)
            .ok_or_else(|| failed("opening the ring buffer")("the object has none".into()))?;
        let mut ring = RingBuf::try_from(ring)
            .map_err(|e| e.to_string())
            .map_err(failed("opening the ring buffer"))?;
        let mut maps = NatMaps::open(ebpf)?;
        let mut conntrack = Ctnetlink::open()
            .map_err(|e| e.to_string())
            .map_err(failed("opening a ctnetlink socket"))?;
        let eips = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Counts::default());
        let thread = {
            let (eips, stop, counts) = (Arc::clone(&eips), Arc::clone(&stop), Arc::clone(&counts));
            std::thread::Builder::new()
                .name("egressgw-learn".into())
                .spawn(move || {
                    let mut swept = std::time::Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        if swept.elapsed() >= SWEEP {
                            let held = maps.sweep(&mut conntrack, monotonic_ns(), SWEEP);
                            counts.held.store(held, Ordering::Relaxed);
                            swept = std::time::Instant::now();
                        }
                        let mut fds = [nix::poll::PollFd::new(
                            ring.as_fd(),
                            nix::poll::PollFlags::POLLIN,
                        )];
                        let timeout = nix::poll::PollTimeout::try_from(POLL)
                            .unwrap_or(nix::poll::PollTimeout::NONE);
                        if nix::poll::poll(&mut fds, timeout).is_err() {
                            std::thread::sleep(POLL);
                        }
                        while let Some(item) = ring.next() {
                            let Some(learned) = Learned::decode(&item) else {
                                continue;
                            };
                            drop(item);
                            match take(&eips, &mut maps, &mut conntrack, &learned) {
                                Taken::Now => {
                                    counts.held.fetch_add(1, Ordering::Relaxed);
                                    counts.taken.fetch_add(1, Ordering::Relaxed)
                                }
                                Taken::Before | Taken::Closed => 0,
                                Taken::Not => counts.left.fetch_add(1, Ordering::Relaxed),
                            };
                        }
                    }
                })
                .map_err(|e| e.to_string())
                .map_err(failed("starting the gateway fast path's learner"))?
        };
        Ok(Learner {
            eips,
            stop,
            counts,
            thread: Some(thread),
        })
    }

    /// Makes `eips` the node's EIPs and forgets the connections of any
    /// other address; returns how many were forgotten.
    pub(crate) fn set_eips(&self, eips: &BTreeSet<IpAddr>, maps: &mut NatMaps) -> usize {
        let mut held = self
            .eips
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let gone = match held.as_ref() {
            Some(before) if before.is_subset(eips) => 0,
            _ => maps.forget_unless(eips),
        };
        *held = Some(eips.clone());
        gone
    }

    pub(crate) fn learning(&self) -> Learning {
        Learning {
            taken: self.counts.taken.load(Ordering::Relaxed),
            left: self.counts.left.load(Ordering::Relaxed),
            held: self.counts.held.load(Ordering::Relaxed),
        }
    }
}

/// What became of a learned translation.
enum Taken {
    /// Taken over now.
    Now,
    /// Taken over already (the same connection learned twice).
    Before,
    /// Closed, or closing: conntrack no longer holds it open (a pod's
    /// last ACK is learned too).
    Closed,
    /// Left to the stack.
    Not,
}

/// Takes one learned translation over, if the node holds its EIP and
/// conntrack holds its connection open.
fn take(
    eips: &Mutex<Option<BTreeSet<IpAddr>>>,
    maps: &mut NatMaps,
    conntrack: &mut Ctnetlink,
    learned: &Learned,
) -> Taken {
    let held = eips
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (Some(eip), Some(tuple)) = (eip(learned), tuple(learned)) else {
        return Taken::Not;
    };
    if !held.as_ref().is_some_and(|held| held.contains(&eip)) {
        return Taken::Not;
    }
    if maps.holds(learned) {
        return Taken::Before;
    }
    // A pod's last ACK of a closed connection is learned too: only an
    // open connection is taken over. And only as conntrack translated it:
    // the record may be older than the connection now under its tuple.
    let translated = (eip, u16::from_be_bytes(learned.eip_port));
    let remote = (tuple.dst, tuple.dport);
    let open = match conntrack.translation(&tuple) {
        Ok(None) => return Taken::Closed,
        Ok(Some(found)) if found.state != Some(crate::conntrack::TCP_ESTABLISHED) => {
            return Taken::Closed;
        }
        Ok(Some(found)) => Ok(found
            .reply
            .is_some_and(|r| (r.dst, r.dport) == translated && (r.src, r.sport) == remote)),
        Err(e) => Err(e.to_string()),
    };
    let done = open
        .and_then(|open| {
            if open {
                conntrack.set_liberal(&tuple).map_err(|e| e.to_string())
            } else {
                Ok(false)
            }
        })
        .and_then(|found| {
            if found {
                maps.take(learned, monotonic_ns()).map(|()| true)
            } else {
                Ok(false)
            }
        });
    match done {
        Ok(true) => Taken::Now,
        Ok(false) => Taken::Not,
        Err(e) => {
            tracing::debug!(error = %e, "the gateway's fast path left a connection to the stack");
            Taken::Not
        }
    }
}

impl Drop for Learner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod kernel_tests {
    use super::*;
    use crate::ebpf::{Classifier, Desired};
    use crate::testns::{in_new_netns, root_or_skip};

    fn learned(pod: [u8; 4], port: u16, eip: [u8; 4]) -> Learned {
        let mut l = Learned {
            family: 4,
            out_ifindex: 1,
            tunnel_ifindex: 1,
            pod: [0; 16],
            remote: [0; 16],
            eip: [0; 16],
            pod_port: port.to_be_bytes(),
            remote_port: 443u16.to_be_bytes(),
            eip_port: port.to_be_bytes(),
            out_l2: [0; 14],
            tunnel_l2: [0; 14],
            _pad: [0; 2],
        };
        l.pod[..4].copy_from_slice(&pod);
        l.remote[..4].copy_from_slice(&[198, 51, 100, 1]);
        l.eip[..4].copy_from_slice(&eip);
        l
    }

    fn switch(classifier: &Classifier) -> u32 {
        let map = classifier.ebpf.map(common::SWITCHES).unwrap();
        let switches: aya::maps::Array<_, u32> = aya::maps::Array::try_from(map).unwrap();
        switches.get(&common::switch::GATEWAY, 0).unwrap()
    }

    #[test]
    fn an_eip_the_node_gives_up_takes_its_connections_off_the_fast_path() {
        if !root_or_skip("an_eip_the_node_gives_up_takes_its_connections_off_the_fast_path") {
            return;
        }
        in_new_netns(|| {
            let (e1, e2) = ([198, 51, 100, 240], [198, 51, 100, 241]);
            let mut classifier = Classifier::load().unwrap();
            let mut desired = Desired {
                eips: [IpAddr::from(e1), IpAddr::from(e2)].into(),
                ..Desired::default()
            };
            classifier.sync(&desired).unwrap();
            assert_eq!(switch(&classifier), 1, "on while the node holds EIPs");
            let (_, maps) = classifier.gateway.as_mut().unwrap();
            let (a, b) = (
                learned([10, 244, 1, 5], 40000, e1),
                learned([10, 244, 1, 6], 40001, e2),
            );
            maps.take(&a, 0).unwrap();
            maps.take(&b, 0).unwrap();
            assert_eq!(maps.len(), 2);

            // e2 goes: its connection with it, both ways.
            desired.eips = [IpAddr::from(e1)].into();
            classifier.sync(&desired).unwrap();
            let (_, maps) = classifier.gateway.as_mut().unwrap();
            assert!(maps.holds(&a) && !maps.holds(&b));
            let replies: Vec<Flow4> = maps.in4.keys().flatten().collect();
            assert_eq!(replies.len(), 1, "{replies:?}");
            assert_eq!(replies[0].dst, e1);

            // No EIP at all: off, and nothing held.
            desired.eips.clear();
            classifier.sync(&desired).unwrap();
            assert_eq!(switch(&classifier), 0);
            let (_, maps) = classifier.gateway.as_mut().unwrap();
            assert_eq!(maps.len(), 0);
            assert_eq!(maps.in4.keys().flatten().count(), 0);
        });
    }

    #[test]
    fn a_sweep_keeps_what_conntrack_holds_open_alive_and_forgets_the_rest() {
        if !root_or_skip("a_sweep_keeps_what_conntrack_holds_open_alive_and_forgets_the_rest") {
            return;
        }
        in_new_netns(|| {
            use std::io::{Read, Write};
            // Conntrack tracks what a rule of a table asks it about.
            crate::testns::sh(
                "nft add table inet t && \
                 nft add chain inet t o '{ type filter hook output priority 0; }' && \
                 nft add rule inet t o ct state established,related accept",
            );
            crate::testns::sh("ip link set lo up");
            let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
            let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (mut server, _) = listener.accept().unwrap();
            client.write_all(b"x").unwrap();
            server.read_exact(&mut [0u8; 1]).unwrap();
            server.write_all(b"y").unwrap();
            client.read_exact(&mut [0u8; 1]).unwrap();
            let (local, peer) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
            let tuple = TcpTuple {
                src: local.ip(),
                dst: peer.ip(),
                sport: local.port(),
                dport: peer.port(),
            };
            // Untranslated: the connection leaves "as" the client's address
            // and port, which stand in for an EIP and its port here.
            let mut real = learned([127, 0, 0, 1], local.port(), [127, 0, 0, 1]);
            real.remote[..4].copy_from_slice(&[127, 0, 0, 1]);
            real.remote_port = peer.port().to_be_bytes();
            let gone = learned([10, 244, 1, 9], 40000, [198, 51, 100, 240]);
            let mut classifier = Classifier::load().unwrap();
            let (_, maps) = classifier.gateway.as_mut().unwrap();
            let mut ct = Ctnetlink::open().unwrap();
            let timeout =
                |ct: &mut Ctnetlink| ct.translation(&tuple).unwrap().unwrap().timeout.unwrap();
            let now = monotonic_ns();
            maps.take(&real, now).unwrap();
            maps.take(&gone, now).unwrap();
            assert!(ct.set_timeout(&tuple, 100).unwrap());

            // In use: kept, with an established connection's timeout.
            assert_eq!(maps.sweep(&mut ct, now, SWEEP), 1);
            assert!(maps.holds(&real) && !maps.holds(&gone));
            assert!(timeout(&mut ct) > 1000, "{} s", timeout(&mut ct));
            // Idle: kept while conntrack holds it open, its timeout left.
            assert!(ct.set_timeout(&tuple, 100).unwrap());
            let later = now + 3_600_000_000_000;
            assert_eq!(maps.sweep(&mut ct, later, SWEEP), 1);
            assert!(timeout(&mut ct) <= 100);
            // Taken over as another translation than conntrack's: forgotten.
            let mut other = real;
            other.eip_port = 1u16.to_be_bytes();
            maps.take(&other, now).unwrap();
            assert_eq!(maps.sweep(&mut ct, now, SWEEP), 0);
            assert!(!maps.holds(&real) && !maps.holds(&other));
            // Closed: forgotten.
            maps.take(&real, now).unwrap();
            drop(client);
            drop(server);
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(maps.sweep(&mut ct, now, SWEEP), 0);
            assert!(!maps.holds(&real));
            assert_eq!(maps.in4.keys().flatten().count(), 0);
        });
    }

    #[test]
    fn a_restarted_classifier_forgets_adopted_connections_of_eips_the_node_no_longer_holds() {
        if !root_or_skip(
            "a_restarted_classifier_forgets_adopted_connections_of_eips_the_node_no_longer_holds",
        ) {
            return;
        }
        in_new_netns(|| {
            crate::ebpf::kernel_tests::private_bpffs();
            let dir = std::path::Path::new(crate::ebpf::PIN_DIR);
            let (e1, e2) = ([198, 51, 100, 240], [198, 51, 100, 241]);
            let mut desired = Desired {
                eips: [IpAddr::from(e1), IpAddr::from(e2)].into(),
                ..Desired::default()
            };
            {
                let mut first = Classifier::load_pinned(dir).unwrap();
                first.sync(&desired).unwrap();
                let (_, maps) = first.gateway.as_mut().unwrap();
                maps.take(&learned([10, 244, 1, 5], 40000, e1), 0).unwrap();
                maps.take(&learned([10, 244, 1, 6], 40001, e2), 0).unwrap();
            }
            // e2 moved while no agent ran.
            desired.eips = [IpAddr::from(e1)].into();
            let mut second = Classifier::load_pinned(dir).unwrap();
            second.sync(&desired).unwrap();
            let (_, maps) = second.gateway.as_mut().unwrap();
            assert!(maps.holds(&learned([10, 244, 1, 5], 40000, e1)));
            assert!(!maps.holds(&learned([10, 244, 1, 6], 40001, e2)));
            assert_eq!(maps.len(), 1);
            drop(second);
            Classifier::remove_pins(dir).unwrap();
        });
    }
}

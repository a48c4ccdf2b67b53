//! Stage 2: a tunnel identity per node — tunnel IPs, MAC, and a mark for
//! gateway-capable nodes. An identity allocated earlier is kept while it is
//! still valid and unique; new ones take the lowest free value, so the
//! result does not depend on the order nodes arrive in.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::model::{Mac, Node, Snapshot, Tunnel};
use crate::net::Family;
use crate::status::TunnelAllocation;

use super::gateways::Gateways;

/// Tunnel identities by node name.
#[derive(Debug, Default)]
pub(super) struct Tunnels {
    pub by_node: BTreeMap<String, TunnelAllocation>,
}

impl Tunnels {
    /// Whether `node` has what it takes to be an active gateway: a mark and
    /// a tunnel address to route to.
    pub fn can_carry(&self, node: &str) -> bool {
        self.by_node.get(node).is_some_and(|t| {
            t.mark.is_some() && t.underlay.is_some() && (t.ipv4.is_some() || t.ipv6.is_some())
        })
    }

    /// Whether pods on `node` can send `family` traffic through the tunnel:
    /// the node has an underlay address and a tunnel address of that family.
    pub fn can_send(&self, node: &str, family: Family) -> bool {
        self.by_node.get(node).is_some_and(|t| {
            t.underlay.is_some()
                && match family {
                    Family::Ipv4 => t.ipv4.is_some(),
                    Family::Ipv6 => t.ipv6.is_some(),
                }
        })
    }

    /// The tunnel address of `node` in `family`, if it has one.
    pub fn address(&self, node: &str, family: Family) -> Option<IpAddr> {
        let t = self.by_node.get(node)?;
        match family {
            Family::Ipv4 => t.ipv4.map(IpAddr::V4),
            Family::Ipv6 => t.ipv6.map(IpAddr::V6),
        }
    }
}

/// What a node keeps from its previous identity: IPv4, IPv6 (as numbers), MAC, mark index.
type Kept = (Option<u128>, Option<u128>, Option<Mac>, Option<u128>);

/// Allocates tunnel identities for every node of the snapshot.
pub(super) fn allocate(snapshot: &Snapshot, gateways: &Gateways<'_>) -> Tunnels {
    let cfg = &snapshot.config;
    let mut nodes: Vec<&Node> = snapshot.nodes.iter().collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    nodes.dedup_by(|a, b| a.name == b.name);
    let previous: BTreeMap<&str, &Tunnel> = snapshot
        .tunnels
        .iter()
        .map(|t| (t.node.as_str(), t))
        .collect();

    // Pass 1: keep what was allocated before, first come (by node name) first served.
    let mut v4 = Pool::new(
        u128::from(u32::from(cfg.tunnel_ipv4_subnet.network())),
        u128::from(u32::from(cfg.tunnel_ipv4_subnet.broadcast())),
    );
    let mut v6 = Pool::new(
        u128::from(cfg.tunnel_ipv6_subnet.network()),
        u128::from(cfg.tunnel_ipv6_subnet.broadcast()),
    );
    let mut marks = Pool::new(0, u128::from(cfg.mark_capacity()) + 1);
    let mut macs: HashSet<Mac> = HashSet::new();
    // Nodes a usable gateway selects, found once.
    let capable: HashSet<&str, foldhash::fast::RandomState> = gateways
        .by_name
        .values()
        .filter(|g| g.problem.is_none())
        .flat_map(|g| g.selected.iter().copied())
        .collect();
    let mut kept: BTreeMap<&str, Kept> = BTreeMap::new();
    for node in &nodes {
        let prev = previous.get(node.name.as_str());
        let keep_v4 = prev
            .and_then(|t| t.ipv4)
            .map(|ip| u128::from(u32::from(ip)))
            .filter(|n| cfg.enable_ipv4 && v4.claim(*n));
        let keep_v6 = prev
            .and_then(|t| t.ipv6)
            .map(u128::from)
            .filter(|n| cfg.enable_ipv6 && v6.claim(*n));
        let keep_mac = prev.and_then(|t| t.mac).filter(|m| macs.insert(*m));
        let keep_mark = prev
            .and_then(|t| t.mark)
            .and_then(|m| cfg.mark_index(m))
            .map(u128::from)
            .filter(|i| capable.contains(node.name.as_str()) && marks.claim(*i));
        kept.insert(node.name.as_str(), (keep_v4, keep_v6, keep_mac, keep_mark));
    }

    // Pass 2: fill the gaps with the lowest free values.
    let mut by_node = BTreeMap::new();
    for node in &nodes {
        let (keep_v4, keep_v6, keep_mac, keep_mark) = kept[node.name.as_str()];
        let ipv4 = if cfg.enable_ipv4 {
            keep_v4.or_else(|| v4.next_free())
        } else {
            None
        };
        let ipv6 = if cfg.enable_ipv6 {
            keep_v6.or_else(|| v6.next_free())
        } else {
            None
        };
        let mark = if capable.contains(node.name.as_str()) {
            keep_mark.or_else(|| marks.next_free())
        } else {
            None
        };
        let mac = keep_mac.unwrap_or_else(|| derive_mac(&node.name, &mut macs));
        by_node.insert(
            node.name.clone(),
            TunnelAllocation {
                node: node.name.clone(),
                ipv4: ipv4
                    .map(|n| Ipv4Addr::from(u32::try_from(n).expect("inside an IPv4 subnet"))),
                ipv6: ipv6.map(Ipv6Addr::from),
                mac,
                mark: mark.map(|i| cfg.mark(u32::try_from(i).expect("inside the mark mask"))),
                underlay: underlay(node),
            },
        );
    }
    Tunnels { by_node }
}

/// The node's underlay address: its first IPv4 InternalIP, else its first IPv6 one.
fn underlay(node: &Node) -> Option<IpAddr> {
    node.address(Family::Ipv4)
        .or_else(|| node.address(Family::Ipv6))
}

/// A locally administered unicast MAC derived from the node name, so it is
/// the same on every run; a collision moves on to the next candidate.
fn derive_mac(name: &str, taken: &mut HashSet<Mac>) -> Mac {
    let mut salt = 0u64;
    loop {
        let h = mix(name.bytes(), salt).to_be_bytes();
        let mac = Mac([(h[0] & 0xfc) | 0x02, h[1], h[2], h[3], h[4], h[5]]);
        if taken.insert(mac) {
            return mac;
        }
        salt += 1;
    }
}

/// FNV-1a over `bytes`, then a splitmix64 finaliser so that similar names
/// (`node-1`, `node-2`) give unrelated values: the same in every release.
pub(super) fn mix(bytes: impl IntoIterator<Item = u8>, salt: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The free values strictly between `low` and `high` (the subnet's network and
/// broadcast addresses, or 0 and one past the last mark index).
#[derive(Debug)]
struct Pool {
    low: u128,
    high: u128,
    used: HashSet<u128>,
    cursor: u128,
}

impl Pool {
    fn new(low: u128, high: u128) -> Self {
        Self {
            low,
            high,
            used: HashSet::new(),
            cursor: low + 1,
        }
    }

    /// Claims `n` if it is inside and free.
    fn claim(&mut self, n: u128) -> bool {
        n > self.low && n < self.high && self.used.insert(n)
    }

    /// Claims and returns the lowest free value.
    fn next_free(&mut self) -> Option<u128> {
        while self.cursor < self.high {
            let n = self.cursor;
            self.cursor += 1;
            if self.used.insert(n) {
                return Some(n);
            }
        }
        None
    }
}

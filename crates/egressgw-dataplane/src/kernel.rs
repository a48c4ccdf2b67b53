//! The routing side of a node as kernel objects — `egress.vxlan`, its
//! addresses, neighbour and FDB entries, policy rules, routes and the EIP
//! device — desired and observed, and the operations between them.
//!
//! [`plan`] is pure: it compares a [`Desired`] with a [`KernelState`] read
//! back by a [`Netlink`](crate::netlink::Netlink) backend. Only objects inside
//! egressgw's own range are ever observed, so only those can be removed: the
//! two devices by name, rules at egressgw's priority whose mask is egressgw's
//! mark mask, and routes in egressgw's tables.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use egressgw_core::model::{Config, Mac};
use egressgw_core::net::Family;
use egressgw_core::state::NodeState;
use ipnet::IpNet;
use serde::Serialize;

use crate::ops::{Change, Op, OpKind, Operation, diff};

/// The device that holds the EIPs a gateway node owns.
pub const EIP_DEVICE: &str = "egress.eip";

/// What egressgw may touch: device names, rule priority, mark mask, tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// The tunnel device.
    pub vxlan: String,
    /// The EIP device.
    pub eip_device: String,
    /// Priority of egressgw's rules.
    pub rule_priority: u32,
    /// egressgw's mark bits.
    pub mark_mask: u32,
    /// egressgw's routing tables.
    pub tables: std::ops::RangeInclusive<u32>,
}

impl Scope {
    /// The scope `cfg` gives.
    pub fn new(cfg: &Config) -> Self {
        Scope {
            vxlan: cfg.vxlan.name.clone(),
            eip_device: EIP_DEVICE.to_owned(),
            rule_priority: cfg.rule_priority,
            mark_mask: cfg.mark_mask,
            tables: cfg.tables(),
        }
    }

    /// Whether a rule belongs to egressgw.
    pub fn owns_rule(&self, rule: &Rule) -> bool {
        rule.priority == self.rule_priority
            && rule.mask == self.mark_mask
            && self.tables.contains(&rule.table)
    }
}

/// The attributes of `egress.vxlan` that the kernel cannot change in place:
/// a difference recreates the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VxlanIdentity {
    /// VNI.
    pub vni: u32,
    /// UDP destination port.
    pub port: u16,
    /// Parent interface index.
    pub parent: u32,
    /// Local underlay address.
    pub local: IpAddr,
    /// Source-address learning (always off when egressgw creates it).
    pub learning: bool,
}

/// The attributes of `egress.vxlan` corrected in place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VxlanSettings {
    /// Device MAC.
    pub mac: Mac,
    /// MTU.
    pub mtu: u32,
    /// Administratively up.
    pub up: bool,
}

/// `egress.vxlan` as desired or observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VxlanLink {
    /// Device name.
    pub name: String,
    /// Set at creation only.
    pub identity: VxlanIdentity,
    /// Adjustable.
    pub settings: VxlanSettings,
}

/// A rule `fwmark <mark>/<mask> lookup <table> priority <priority>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Rule {
    /// IPv6 rather than IPv4.
    pub ipv6: bool,
    /// Priority.
    pub priority: u32,
    /// Mark value.
    pub mark: u32,
    /// Mark mask.
    pub mask: u32,
    /// Table.
    pub table: u32,
}

/// A route `<dst> via <via> dev egress.vxlan onlink table <table>`, keyed by
/// table and destination.
pub type RouteKey = (u32, IpNet);

/// What the parent interface looks like, found from the underlay address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Parent {
    /// Interface name.
    pub name: String,
    /// Interface index.
    pub index: u32,
    /// Its MTU.
    pub mtu: u32,
}

/// The kernel objects egressgw owns on a node, as read back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct KernelState {
    /// `egress.vxlan`, if present.
    pub vxlan: Option<VxlanLink>,
    /// Addresses on `egress.vxlan`.
    pub vxlan_addrs: BTreeSet<IpNet>,
    /// `rp_filter` of `egress.vxlan` (IPv4).
    pub rp_filter: Option<u8>,
    /// Whether tx checksum offload is on on `egress.vxlan`.
    pub tx_checksum: Option<bool>,
    /// The device's effective offloads as text (reported, not planned on).
    pub offloads: Option<String>,
    /// What could not be read (an old kernel without ethtool netlink, ...):
    /// reported as warnings; nothing is planned on an unknown value.
    pub unreadable: Vec<String>,
    /// Permanent neighbour entries on `egress.vxlan`: tunnel IP -> MAC.
    pub neighbours: BTreeMap<IpAddr, Mac>,
    /// FDB entries on `egress.vxlan`: MAC -> peer underlay address.
    pub fdb: BTreeMap<Mac, IpAddr>,
    /// egressgw's rules.
    pub rules: BTreeSet<Rule>,
    /// Routes in egressgw's tables -> gateway.
    pub routes: BTreeMap<RouteKey, IpAddr>,
    /// Whether the EIP device exists (and is up).
    pub eip_device: Option<bool>,
    /// Addresses on the EIP device.
    pub eips: BTreeSet<IpAddr>,
    /// IPv6 EIPs without a proxy neighbour entry on every interface of their
    /// segment (Linux answers neighbour solicitations only for addresses of
    /// the receiving interface, or for proxy entries).
    pub unproxied: BTreeSet<IpAddr>,
}

/// The kernel objects a node should have.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Desired {
    /// `egress.vxlan`, unless the node has no tunnel identity yet.
    pub vxlan: Option<VxlanLink>,
    /// Tunnel addresses.
    pub vxlan_addrs: BTreeSet<IpNet>,
    /// Whether tx checksum offload should be on.
    pub tx_checksum: bool,
    /// Neighbour entries.
    pub neighbours: BTreeMap<IpAddr, Mac>,
    /// FDB entries.
    pub fdb: BTreeMap<Mac, IpAddr>,
    /// Rules.
    pub rules: BTreeSet<Rule>,
    /// Routes.
    pub routes: BTreeMap<RouteKey, IpAddr>,
    /// EIPs to own.
    pub eips: BTreeSet<IpAddr>,
}

/// Loose reverse-path filtering: decapsulated packets carry pod sources the
/// main table routes elsewhere.
pub const RP_FILTER_LOOSE: u8 = 2;

impl Desired {
    /// The kernel objects `state` asks for, with `egress.vxlan` on `parent`
    /// (the interface holding the underlay address; `None` when none does, in
    /// which case no device is desired and the caller reports why).
    pub fn new(state: &NodeState, cfg: &Config, parent: Option<&Parent>) -> Self {
        let mut d = Desired {
            tx_checksum: !cfg.vxlan.disable_checksum_offload,
            ..Desired::default()
        };
        if let (Some(v), Some(parent)) = (&state.vxlan, parent) {
            d.vxlan = Some(VxlanLink {
                name: v.name.clone(),
                identity: VxlanIdentity {
                    vni: v.vni,
                    port: v.port,
                    parent: parent.index,
                    local: v.local,
                    learning: false,
                },
                settings: VxlanSettings {
                    mac: v.mac,
                    mtu: parent.mtu.saturating_sub(v.overhead()),
                    up: true,
                },
            });
            d.tx_checksum = !v.disable_checksum_offload;
            if let Some(ip) = v.ipv4 {
                d.vxlan_addrs
                    .extend(IpNet::new(ip.into(), v.ipv4_prefix_len).ok());
            }
            if let Some(ip) = v.ipv6 {
                d.vxlan_addrs
                    .extend(IpNet::new(ip.into(), v.ipv6_prefix_len).ok());
            }
            for p in &state.peers {
                for ip in [p.ipv4.map(IpAddr::V4), p.ipv6.map(IpAddr::V6)]
                    .into_iter()
                    .flatten()
                {
                    d.neighbours.insert(ip, p.mac);
                }
                d.fdb.insert(p.mac, p.underlay);
            }
            for r in &state.routes {
                if let Some(via) = r.via_ipv4 {
                    d.routes
                        .insert((r.table, Family::Ipv4.everything()), via.into());
                }
                if let Some(via) = r.via_ipv6 {
                    d.routes
                        .insert((r.table, Family::Ipv6.everything()), via.into());
                }
            }
            for r in state.replies.iter() {
                d.routes.insert((r.table, Family::host(r.dst)), r.via);
            }
            for rule in &state.rules {
                let families: BTreeSet<bool> = d
                    .routes
                    .iter()
                    .filter(|((table, _), _)| *table == rule.table)
                    .map(|(_, via)| via.is_ipv6())
                    .collect();
                for ipv6 in families {
                    d.rules.insert(Rule {
                        ipv6,
                        priority: rule.priority,
                        mark: rule.mark,
                        mask: rule.mask,
                        table: rule.table,
                    });
                }
            }
        }
        d.eips = state.eips.iter().map(|e| e.ip).collect();
        d
    }
}

/// One change to the kernel's routing side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "op")]
pub enum KernelOp {
    /// Create `egress.vxlan`.
    CreateVxlan(VxlanLink),
    /// Delete `egress.vxlan` (before recreating it, or when no longer wanted).
    DeleteVxlan {
        /// Device name.
        name: String,
    },
    /// Correct MAC, MTU and up state in place.
    SetVxlan {
        /// Device name.
        name: String,
        /// Desired settings.
        settings: VxlanSettings,
    },
    /// Set `rp_filter` of the device.
    SetRpFilter {
        /// Device name.
        name: String,
        /// Value.
        value: u8,
    },
    /// Turn tx checksum offload on or off.
    SetTxChecksum {
        /// Device name.
        name: String,
        /// On or off.
        on: bool,
    },
    /// Add an address to a device.
    AddAddr {
        /// Device name.
        dev: String,
        /// Address and prefix.
        net: IpNet,
    },
    /// Remove an address from a device.
    DelAddr {
        /// Device name.
        dev: String,
        /// Address and prefix.
        net: IpNet,
    },
    /// Add or replace a permanent neighbour entry.
    SetNeighbour {
        /// Tunnel IP.
        ip: IpAddr,
        /// MAC.
        mac: Mac,
    },
    /// Remove a neighbour entry.
    DelNeighbour {
        /// Tunnel IP.
        ip: IpAddr,
        /// MAC.
        mac: Mac,
    },
    /// Add or replace an FDB entry.
    SetFdb {
        /// MAC.
        mac: Mac,
        /// Peer underlay address.
        dst: IpAddr,
    },
    /// Remove an FDB entry.
    DelFdb {
        /// MAC.
        mac: Mac,
        /// Peer underlay address.
        dst: IpAddr,
    },
    /// Add or replace a route.
    SetRoute {
        /// Table.
        table: u32,
        /// Destination.
        dst: IpNet,
        /// Gateway (a tunnel IP, onlink).
        via: IpAddr,
    },
    /// Remove a route.
    DelRoute {
        /// Table.
        table: u32,
        /// Destination.
        dst: IpNet,
        /// Gateway.
        via: IpAddr,
    },
    /// Add a rule.
    AddRule(Rule),
    /// Remove a rule.
    DelRule(Rule),
    /// Create the EIP device (a dummy).
    CreateEipDevice {
        /// Device name.
        name: String,
    },
    /// Bring the EIP device up.
    SetEipDeviceUp {
        /// Device name.
        name: String,
    },
    /// Delete the EIP device.
    DeleteEipDevice {
        /// Device name.
        name: String,
    },
    /// Take an EIP: the address on the EIP device, then announced.
    AddEip {
        /// Device name.
        dev: String,
        /// The EIP.
        ip: IpAddr,
    },
    /// Answer neighbour solicitations for an IPv6 EIP on its segment again.
    ProxyEip {
        /// The EIP.
        ip: IpAddr,
    },
    /// Give an EIP up.
    DelEip {
        /// Device name.
        dev: String,
        /// The EIP.
        ip: IpAddr,
    },
}

impl KernelOp {
    /// Whether the op takes something away (run after the firewall changed).
    pub fn is_removal(&self) -> bool {
        matches!(
            self,
            KernelOp::DeleteVxlan { .. }
                | KernelOp::DelAddr { .. }
                | KernelOp::DelNeighbour { .. }
                | KernelOp::DelFdb { .. }
                | KernelOp::DelRoute { .. }
                | KernelOp::DelRule(_)
                | KernelOp::DeleteEipDevice { .. }
                | KernelOp::DelEip { .. }
        )
    }
}

impl fmt::Display for KernelOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use KernelOp::*;
        match self {
            CreateVxlan(l) => write!(
                f,
                "create link {} type vxlan id {} dstport {} local {} dev #{} nolearning address {} mtu {}",
                l.name,
                l.identity.vni,
                l.identity.port,
                l.identity.local,
                l.identity.parent,
                l.settings.mac,
                l.settings.mtu
            ),
            DeleteVxlan { name } => write!(f, "delete link {name}"),
            SetVxlan { name, settings } => write!(
                f,
                "set link {name} address {} mtu {}{}",
                settings.mac,
                settings.mtu,
                if settings.up { " up" } else { "" }
            ),
            SetRpFilter { name, value } => {
                write!(f, "set sysctl net.ipv4.conf.{name}.rp_filter={value}")
            }
            SetTxChecksum { name, on } => {
                write!(
                    f,
                    "set features {name} tx-checksumming {}",
                    if *on { "on" } else { "off" }
                )
            }
            AddAddr { dev, net } => write!(f, "add address {net} dev {dev}"),
            DelAddr { dev, net } => write!(f, "delete address {net} dev {dev}"),
            SetNeighbour { ip, mac } => {
                write!(f, "replace neighbour {ip} lladdr {mac} nud permanent")
            }
            DelNeighbour { ip, mac } => write!(f, "delete neighbour {ip} lladdr {mac}"),
            SetFdb { mac, dst } => write!(f, "replace fdb {mac} dst {dst} self permanent"),
            DelFdb { mac, dst } => write!(f, "delete fdb {mac} dst {dst}"),
            SetRoute { table, dst, via } => {
                write!(f, "replace route {dst} via {via} onlink table {table}")
            }
            DelRoute { table, dst, via } => write!(f, "delete route {dst} via {via} table {table}"),
            AddRule(r) => write!(f, "add {r}"),
            DelRule(r) => write!(f, "delete {r}"),
            CreateEipDevice { name } => write!(f, "create link {name} type dummy"),
            SetEipDeviceUp { name } => write!(f, "set link {name} up"),
            DeleteEipDevice { name } => write!(f, "delete link {name}"),
            AddEip { dev, ip } => write!(f, "add eip {ip} dev {dev} and announce it"),
            ProxyEip { ip } => write!(f, "add proxy neighbour {ip} on its segment"),
            DelEip { dev, ip } => write!(f, "delete eip {ip} dev {dev}"),
        }
    }
}

impl Operation for KernelOp {
    fn op(&self) -> Op {
        use KernelOp::*;
        let (kind, object) = match self {
            CreateVxlan(l) => (OpKind::Link, l.name.clone()),
            DeleteVxlan { name }
            | SetVxlan { name, .. }
            | CreateEipDevice { name }
            | SetEipDeviceUp { name }
            | DeleteEipDevice { name } => (OpKind::Link, name.clone()),
            SetRpFilter { name, .. } => (OpKind::Sysctl, name.clone()),
            SetTxChecksum { name, .. } => (OpKind::Offload, name.clone()),
            AddAddr { dev, net } | DelAddr { dev, net } => {
                (OpKind::Address, format!("{net} dev {dev}"))
            }
            SetNeighbour { ip, .. } | DelNeighbour { ip, .. } => {
                (OpKind::Neighbour, ip.to_string())
            }
            SetFdb { mac, .. } | DelFdb { mac, .. } => (OpKind::Fdb, mac.to_string()),
            SetRoute { table, dst, .. } | DelRoute { table, dst, .. } => {
                (OpKind::Route, format!("{dst} table {table}"))
            }
            AddRule(r) | DelRule(r) => (OpKind::Rule, r.object()),
            AddEip { ip, .. } | ProxyEip { ip } | DelEip { ip, .. } => {
                (OpKind::Eip, ip.to_string())
            }
        };
        Op::new(kind, object, self.to_string())
    }
}

impl Rule {
    /// The rule as an object: its family, priority and mark, which tell
    /// it from every other rule egressgw keeps (the table it looks up may
    /// change under it).
    pub fn object(&self) -> String {
        format!(
            "{} priority {} fwmark {:#010x}/{:#010x}",
            if self.ipv6 { "ipv6" } else { "ipv4" },
            self.priority,
            self.mark,
            self.mask
        )
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rule{} priority {} fwmark {:#010x}/{:#010x} lookup {}",
            if self.ipv6 { " -6" } else { "" },
            self.priority,
            self.mark,
            self.mask,
            self.table
        )
    }
}

/// The operations that turn `observed` into `desired`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelPlan {
    /// Device creations (a recreation is a deletion and a creation), to run
    /// first; the rest refers to the devices, so it is planned again after.
    pub devices: Vec<KernelOp>,
    /// Additions and changes, then removals (rules before routes, routes
    /// before neighbours), device removals last.
    pub rest: Vec<KernelOp>,
}

impl KernelPlan {
    /// Every op, in order.
    pub fn ops(&self) -> impl Iterator<Item = &KernelOp> {
        self.devices.iter().chain(&self.rest)
    }
}

/// The operations that turn `observed` into `desired`, in the order to run
/// them.
pub fn plan(desired: &Desired, observed: &KernelState, scope: &Scope) -> KernelPlan {
    let mut ops = Planned::default();
    let vx = &scope.vxlan;
    let vxlan_present = ops.tunnel_device(desired, observed, vx);
    // Objects on a device that is about to be (re)created are planned on the
    // next pass, once it exists.
    if vxlan_present && desired.vxlan.is_some() {
        ops.on_tunnel(desired, observed, vx);
    } else {
        // Without the device its routes are gone with it; stale ones in our
        // tables (on another device) are still ours to remove.
        for ((table, dst), via) in &observed.routes {
            ops.removes.push(KernelOp::DelRoute {
                table: *table,
                dst: *dst,
                via: *via,
            });
        }
    }
    ops.rules(desired, observed, vxlan_present);
    ops.eips(desired, observed, &scope.eip_device);
    KernelPlan {
        devices: ops.first,
        rest: ops
            .adds
            .into_iter()
            .chain(ops.removes)
            .chain(ops.last)
            .collect(),
    }
}

/// A plan on its way: device changes first, then additions and changes,
/// then removals, then devices to delete.
#[derive(Default)]
struct Planned {
    first: Vec<KernelOp>,
    adds: Vec<KernelOp>,
    removes: Vec<KernelOp>,
    last: Vec<KernelOp>,
}

impl Planned {
    /// The tunnel device: recreated on identity drift, its settings
    /// adjusted in place. Returns whether it is there to put things on.
    fn tunnel_device(&mut self, desired: &Desired, observed: &KernelState, vx: &str) -> bool {
        match (&desired.vxlan, &observed.vxlan) {
            (Some(d), None) => {
                self.first.push(KernelOp::CreateVxlan(d.clone()));
                false
            }
            (Some(d), Some(o)) if d.identity != o.identity => {
                self.first.push(KernelOp::DeleteVxlan { name: vx.into() });
                self.first.push(KernelOp::CreateVxlan(d.clone()));
                false
            }
            (Some(d), Some(o)) => {
                if d.settings != o.settings {
                    self.adds.push(KernelOp::SetVxlan {
                        name: vx.into(),
                        settings: d.settings.clone(),
                    });
                }
                true
            }
            (None, Some(_)) => {
                self.last.push(KernelOp::DeleteVxlan { name: vx.into() });
                false
            }
            (None, None) => false,
        }
    }

    /// What sits on an existing tunnel device: its reverse-path filter and
    /// offload, its addresses, neighbours, FDB entries and routes.
    fn on_tunnel(&mut self, desired: &Desired, observed: &KernelState, vx: &str) {
        if observed.rp_filter.is_some_and(|v| v != RP_FILTER_LOOSE) {
            self.adds.push(KernelOp::SetRpFilter {
                name: vx.into(),
                value: RP_FILTER_LOOSE,
            });
        }
        if observed
            .tx_checksum
            .is_some_and(|on| on != desired.tx_checksum)
        {
            self.adds.push(KernelOp::SetTxChecksum {
                name: vx.into(),
                on: desired.tx_checksum,
            });
        }
        let as_map = |s: &BTreeSet<IpNet>| s.iter().map(|n| (*n, ())).collect::<BTreeMap<_, _>>();
        for c in diff(
            &as_map(&desired.vxlan_addrs),
            &as_map(&observed.vxlan_addrs),
        ) {
            let dev = vx.to_owned();
            match c {
                Change::Add(net, ()) => self.adds.push(KernelOp::AddAddr { dev, net }),
                Change::Remove(net, ()) => self.removes.push(KernelOp::DelAddr { dev, net }),
                Change::Change(..) => {}
            }
        }
        for c in diff(&desired.neighbours, &observed.neighbours) {
            match c {
                Change::Add(ip, mac) | Change::Change(ip, _, mac) => {
                    self.adds.push(KernelOp::SetNeighbour { ip, mac });
                }
                Change::Remove(ip, mac) => self.removes.push(KernelOp::DelNeighbour { ip, mac }),
            }
        }
        for c in diff(&desired.fdb, &observed.fdb) {
            match c {
                Change::Add(mac, dst) => self.adds.push(KernelOp::SetFdb { mac, dst }),
                Change::Change(mac, old, dst) => {
                    self.adds.push(KernelOp::SetFdb { mac, dst });
                    self.removes.push(KernelOp::DelFdb { mac, dst: old });
                }
                Change::Remove(mac, dst) => self.removes.push(KernelOp::DelFdb { mac, dst }),
            }
        }
        for c in diff(&desired.routes, &observed.routes) {
            match c {
                Change::Add((table, dst), via) | Change::Change((table, dst), _, via) => {
                    self.adds.push(KernelOp::SetRoute { table, dst, via });
                }
                Change::Remove((table, dst), via) => {
                    self.removes.push(KernelOp::DelRoute { table, dst, via });
                }
            }
        }
    }

    /// Rules go in after their routes (only while the tunnel is there) and
    /// out before them.
    fn rules(&mut self, desired: &Desired, observed: &KernelState, vxlan_present: bool) {
        if vxlan_present {
            for r in desired.rules.difference(&observed.rules) {
                self.adds.push(KernelOp::AddRule(*r));
            }
        }
        let stale = observed
            .rules
            .difference(&desired.rules)
            .map(|r| KernelOp::DelRule(*r));
        self.removes.splice(0..0, stale);
    }

    /// EIPs: their device exists while there is something to hold.
    fn eips(&mut self, desired: &Desired, observed: &KernelState, dev: &str) {
        match (desired.eips.is_empty(), observed.eip_device) {
            (false, None) => self
                .first
                .push(KernelOp::CreateEipDevice { name: dev.into() }),
            (false, Some(up)) => {
                if !up {
                    self.adds
                        .push(KernelOp::SetEipDeviceUp { name: dev.into() });
                }
                for ip in desired.eips.difference(&observed.eips) {
                    self.adds.push(KernelOp::AddEip {
                        dev: dev.into(),
                        ip: *ip,
                    });
                }
                for ip in observed.unproxied.intersection(&desired.eips) {
                    self.adds.push(KernelOp::ProxyEip { ip: *ip });
                }
                for ip in observed.eips.difference(&desired.eips) {
                    self.removes.push(KernelOp::DelEip {
                        dev: dev.into(),
                        ip: *ip,
                    });
                }
            }
            (true, Some(_)) => self
                .last
                .push(KernelOp::DeleteEipDevice { name: dev.into() }),
            (true, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testns::node_state;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn parent() -> Parent {
        Parent {
            name: "eth0".into(),
            index: 2,
            mtu: 9000,
        }
    }

    fn desired() -> Desired {
        Desired::new(&node_state(false), &Config::default(), Some(&parent()))
    }

    /// What the kernel holds once `desired` is applied.
    fn applied(d: &Desired) -> KernelState {
        KernelState {
            vxlan: d.vxlan.clone(),
            vxlan_addrs: d.vxlan_addrs.clone(),
            rp_filter: Some(RP_FILTER_LOOSE),
            tx_checksum: Some(d.tx_checksum),
            neighbours: d.neighbours.clone(),
            fdb: d.fdb.clone(),
            rules: d.rules.clone(),
            routes: d.routes.clone(),
            ..KernelState::default()
        }
    }

    fn scope() -> Scope {
        Scope::new(&Config::default())
    }

    #[test]
    fn the_mtu_leaves_room_for_the_encapsulation() {
        assert_eq!(desired().vxlan.unwrap().settings.mtu, 9000 - 50);
    }

    #[test]
    fn a_kernel_that_matches_plans_nothing() {
        let d = desired();
        assert_eq!(plan(&d, &applied(&d), &scope()), KernelPlan::default());
    }

    #[test]
    fn a_new_parent_recreates_the_device_first() {
        let d = desired();
        let mut k = applied(&d);
        k.vxlan.as_mut().unwrap().identity.parent = 7;
        let p = plan(&d, &k, &scope());
        assert!(matches!(p.devices[0], KernelOp::DeleteVxlan { .. }));
        assert!(matches!(p.devices[1], KernelOp::CreateVxlan(_)));
    }

    #[test]
    fn values_that_cannot_be_read_are_left_alone() {
        let d = desired();
        let mut k = applied(&d);
        k.rp_filter = None;
        k.tx_checksum = None;
        assert!(plan(&d, &k, &scope()).rest.is_empty());
    }

    #[test]
    fn a_foreign_route_in_an_egressgw_table_is_replaced() {
        let d = desired();
        let mut k = applied(&d);
        let default: IpNet = "0.0.0.0/0".parse().unwrap();
        k.routes.insert((3000, default), ip("0.0.0.0"));
        let p = plan(&d, &k, &scope());
        assert_eq!(
            p.rest,
            vec![KernelOp::SetRoute {
                table: 3000,
                dst: default,
                via: ip("172.31.0.2"),
            }]
        );
    }

    #[test]
    fn an_ipv6_eip_that_lost_its_proxy_entry_gets_it_back() {
        let mut d = desired();
        let eip = ip("2001:db8::200");
        d.eips.insert(eip);
        let mut k = applied(&d);
        k.eip_device = Some(true);
        k.eips.insert(eip);
        k.unproxied.insert(eip);
        assert_eq!(
            plan(&d, &k, &scope()).rest,
            vec![KernelOp::ProxyEip { ip: eip }]
        );
    }

    #[test]
    fn only_rules_at_egressgws_priority_mask_and_tables_are_owned() {
        let s = scope();
        let ours = Rule {
            ipv6: false,
            priority: 3000,
            mark: 0x0100_0000,
            mask: 0xff00_0000,
            table: 3000,
        };
        assert!(s.owns_rule(&ours));
        assert!(!s.owns_rule(&Rule {
            priority: 100,
            ..ours
        }));
        assert!(!s.owns_rule(&Rule {
            mask: 0xffff_ffff,
            ..ours
        }));
        assert!(!s.owns_rule(&Rule { table: 254, ..ours }));
    }
}

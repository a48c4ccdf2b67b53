//! The nftables backend: classification, identity SNAT, gateway SNAT and
//! mark hygiene in one table of egressgw's own, `inet egressgw`.
//!
//! [`FirewallSpec`] is what the table should hold, computed from a node's
//! [`NodeState`]; [`Firewall::observe`] reads what it holds; [`plan`] turns
//! the difference into [`FwOp`]s; [`Firewall::apply`] runs them as one
//! atomic `nft -f -` transaction. Nothing is flushed on start: when the
//! kernel already holds the desired table, the plan is empty.
//!
//! The table (see [`FirewallSpec::render`] for the exact text):
//! - `classify4`/`classify6`: `src . dst-range : jump <chain>` — per tunnel
//!   mark a chain `mark_<8 hex>` that sets the mark (keeping bits outside the
//!   mask), and `local` for traffic this node SNATs itself. Bypassed
//!   destinations are holes: no element.
//! - `snat4`/`snat6` (`src . dst-range : eip`), `masq4`/`masq6` (`src .
//!   dst-range`, for `useNodeIP`), `cluster4`/`cluster6` (in-cluster
//!   prefixes: never classified, never SNATed).
//! - `prerouting` (filter, mangle priority): saves the reply mark on
//!   connections that come out of the tunnel, puts it on their replies, and
//!   classifies original-direction traffic.
//! - `postrouting_nat` (nat, priority 90 = srcnat - 10, before iptables'
//!   srcnat): identity SNAT for packets entering the tunnel, so a CNI's later
//!   MASQUERADE cannot rewrite the pod source (the first NAT binding of a
//!   connection wins); `gateway_nat` SNATs what came out of the tunnel or was
//!   classified `local`.
//! - `postrouting_mark` (filter, priority 110): clears egressgw's mark bits
//!   on packets leaving through the tunnel, because the VXLAN driver routes
//!   the outer packet with the inner packet's mark.
//!
//! Every rule carries a comment holding a fingerprint of its text, so that
//! [`plan`] can tell a changed chain from an unchanged one without parsing
//! nft's rewritten form of the rules back (nft 1.0.6 prints
//! `meta mark & 0x00ffffff | 0x01000000` as `meta mark & 0x01ffffff |
//! 0x01000000`, and `ct mark & 0xff000000 == 0xff000000` as
//! `ct mark 0xff000000/8`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};

use egressgw_core::model::Config;
use egressgw_core::net::IpRange;
use egressgw_core::state::{Action, NodeState, SnatTo};
use ipnet::IpNet;
use serde_json::Value;

use crate::ops::{Change, Report, diff};
use crate::ranges::disjoint;
use crate::{Error, Result};

/// The table's family.
pub const FAMILY: &str = "inet";
/// The table's name.
pub const TABLE: &str = "egressgw";

/// Priority of `prerouting` (`mangle`).
const PRIO_MANGLE: i32 = -150;
/// Priority of `postrouting_nat`: `srcnat - 10`, before iptables' srcnat.
const PRIO_NAT: i32 = 90;
/// Priority of `postrouting_mark`: `srcnat + 10`, after every NAT decision.
const PRIO_MARK: i32 = 110;

/// Where a classify element sends a packet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    /// `jump mark_<8 hex>`: set this tunnel mark.
    Mark(u32),
    /// `jump local`: set the local mark, SNAT on this node.
    Local,
    /// `jump fail_closed`: drop; the gateway has no live node and fails
    /// closed.
    Drop,
    /// A jump to a chain egressgw does not write, found in the kernel; it is
    /// only ever deleted.
    Other(String),
}

impl Verdict {
    /// The chain the verdict jumps to.
    pub fn chain(&self) -> String {
        match self {
            Verdict::Mark(mark) => mark_chain(*mark),
            Verdict::Local => "local".into(),
            Verdict::Drop => FAIL_CLOSED.into(),
            Verdict::Other(chain) => chain.clone(),
        }
    }

    fn parse(chain: &str) -> Self {
        if chain == "local" {
            return Verdict::Local;
        }
        if chain == FAIL_CLOSED {
            return Verdict::Drop;
        }
        chain
            .strip_prefix("mark_")
            .filter(|hex| hex.len() == 8)
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .filter(|mark| mark_chain(*mark) == chain)
            .map_or_else(|| Verdict::Other(chain.into()), Verdict::Mark)
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "jump {}", self.chain())
    }
}

/// The chain that drops what fails closed.
const FAIL_CLOSED: &str = "fail_closed";

fn mark_chain(mark: u32) -> String {
    format!("mark_{mark:08x}")
}

/// How a gateway node translates a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Nat {
    /// SNAT to this EIP (`snat4`/`snat6`).
    Snat(IpAddr),
    /// Masquerade to the node's address (`masq4`/`masq6`).
    Masquerade,
}

/// The key of a concatenated element: `src . dst-range`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ElemKey {
    /// Pod source address.
    pub src: IpAddr,
    /// Destination addresses.
    pub dst: IpRange,
}

impl fmt::Display for ElemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} . {}", self.src, self.dst)
    }
}

/// A base chain's hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    /// `filter` or `nat`.
    pub kind: String,
    /// `prerouting`, `postrouting`, ...
    pub hook: String,
    /// Numeric priority.
    pub priority: i32,
}

/// A chain as egressgw writes it: its hook (for base chains) and its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Chain name.
    pub name: String,
    /// `None` for a regular chain (a jump target).
    pub hook: Option<Hook>,
    /// Rule texts, without the fingerprint comment.
    pub rules: Vec<String>,
}

impl Chain {
    fn regular(name: impl Into<String>, rules: Vec<String>) -> Self {
        Self {
            name: name.into(),
            hook: None,
            rules,
        }
    }

    fn base(name: &str, kind: &str, hook: &str, priority: i32, rules: Vec<String>) -> Self {
        Self {
            name: name.into(),
            hook: Some(Hook {
                kind: kind.into(),
                hook: hook.into(),
                priority,
            }),
            rules,
        }
    }

    /// What [`Firewall::observe`] reads back for this chain.
    pub fn state(&self) -> ChainState {
        ChainState {
            hook: self.hook.clone(),
            fingerprints: self.rules.iter().map(|r| fingerprint(r)).collect(),
        }
    }

    /// `add chain ...` followed by `add rule ...` lines.
    fn render_add(&self) -> String {
        let mut out = format!("add chain {FAMILY} {TABLE} {}", self.name);
        if let Some(h) = &self.hook {
            out += &format!(
                " {{ type {} hook {} priority {}; policy accept; }}",
                h.kind, h.hook, h.priority
            );
        }
        out.push('\n');
        for rule in &self.rules {
            out += &format!(
                "add rule {FAMILY} {TABLE} {} {}\n",
                self.name,
                with_comment(rule)
            );
        }
        out
    }
}

/// A rule's text with its fingerprint comment.
fn with_comment(rule: &str) -> String {
    format!("{rule} comment \"{}\"", fingerprint(rule))
}

/// FNV-1a (64 bit) of a rule's text, in hex: stable across Rust releases,
/// unlike `DefaultHasher`.
fn fingerprint(rule: &str) -> String {
    let hash = rule.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// A set or map of the table; its declaration never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetDecl {
    /// `set` or `map`.
    pub kind: &'static str,
    /// Name.
    pub name: &'static str,
    /// The declaration's body.
    pub body: &'static str,
}

/// Every set and map of the table.
pub const SETS: [SetDecl; 8] = [
    SetDecl {
        kind: "map",
        name: "classify4",
        body: "type ipv4_addr . ipv4_addr : verdict; flags interval;",
    },
    SetDecl {
        kind: "map",
        name: "classify6",
        body: "type ipv6_addr . ipv6_addr : verdict; flags interval;",
    },
    SetDecl {
        kind: "map",
        name: "snat4",
        body: "type ipv4_addr . ipv4_addr : ipv4_addr; flags interval;",
    },
    SetDecl {
        kind: "map",
        name: "snat6",
        body: "type ipv6_addr . ipv6_addr : ipv6_addr; flags interval;",
    },
    SetDecl {
        kind: "set",
        name: "masq4",
        body: "type ipv4_addr . ipv4_addr; flags interval;",
    },
    SetDecl {
        kind: "set",
        name: "masq6",
        body: "type ipv6_addr . ipv6_addr; flags interval;",
    },
    SetDecl {
        kind: "set",
        name: "cluster4",
        body: "type ipv4_addr; flags interval;",
    },
    SetDecl {
        kind: "set",
        name: "cluster6",
        body: "type ipv6_addr; flags interval;",
    },
];

impl SetDecl {
    fn render(&self) -> String {
        format!(
            "add {} {FAMILY} {TABLE} {} {{ {} }}\n",
            self.kind, self.name, self.body
        )
    }
}

/// What egressgw's nftables table should hold on one node.
///
/// Elements are kept in canonical form: per source, disjoint destination
/// ranges with adjacent equal values merged (see [`disjoint`]), exactly what
/// [`Firewall::observe`] reads back, so a second plan is empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirewallSpec {
    /// The tunnel device.
    pub vxlan: String,
    /// egressgw's mark bits.
    pub mask: u32,
    /// Mark of replies that go back through the tunnel.
    pub reply_mark: u32,
    /// Mark of traffic classified `Local`.
    pub local_mark: u32,
    /// Tunnel marks that classify elements jump to (one chain each).
    pub marks: BTreeSet<u32>,
    /// In-cluster destinations, both families, disjoint.
    pub cluster: BTreeSet<IpRange>,
    /// `classify4` / `classify6` elements.
    pub classify: BTreeMap<ElemKey, Verdict>,
    /// `snat4` / `snat6` / `masq4` / `masq6` elements.
    pub nat: BTreeMap<ElemKey, Nat>,
    /// The EIPs this node SNATs to: what tunnelled traffic may leave with.
    pub eips: BTreeSet<IpAddr>,
}

/// A disjoint range as an element key and its value.
fn keyed<V>(r: crate::ranges::SrcRange<V>) -> (ElemKey, V) {
    (
        ElemKey {
            src: r.src,
            dst: r.dst,
        },
        r.value,
    )
}

impl FirewallSpec {
    /// The table `state` needs. The tunnel device is `state.vxlan`'s, or the
    /// configured name while the node has none.
    pub fn new(state: &NodeState, cfg: &Config) -> Self {
        let classify: BTreeMap<ElemKey, Verdict> = disjoint(state.classify.iter().map(|e| {
            let verdict = match &e.action {
                Action::Bypass => None,
                Action::Tunnel { mark, .. } => Some(Verdict::Mark(*mark)),
                Action::Local => Some(Verdict::Local),
                Action::Drop => Some(Verdict::Drop),
            };
            (e.src, e.dst, verdict)
        }))
        .into_iter()
        .map(keyed)
        .collect();
        let nat = disjoint(state.snat.iter().map(|e| {
            let nat = match e.to {
                SnatTo::Eip(ip) => Nat::Snat(ip),
                SnatTo::NodeIp => Nat::Masquerade,
            };
            (e.src, e.dst, Some(nat))
        }))
        .into_iter()
        .map(keyed)
        .collect();
        let cluster = disjoint(state.cluster_cidrs.iter().map(|net| {
            let any = match net {
                IpNet::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpNet::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            (any, *net, Some(()))
        }))
        .into_iter()
        .map(|r| r.dst)
        .collect();
        let eips = state
            .snat
            .iter()
            .filter_map(|e| match e.to {
                SnatTo::Eip(ip) => Some(ip),
                SnatTo::NodeIp => None,
            })
            .collect();
        let marks = classify
            .values()
            .filter_map(|v| match v {
                Verdict::Mark(m) => Some(*m),
                _ => None,
            })
            .collect();
        Self {
            vxlan: state
                .vxlan
                .as_ref()
                .map_or_else(|| cfg.vxlan.name.clone(), |v| v.name.clone()),
            mask: cfg.mark_mask,
            reply_mark: cfg.reply_mark(),
            local_mark: cfg.local_mark(),
            marks,
            cluster,
            classify,
            nat,
            eips,
        }
    }

    /// Every chain, jump targets first, in a fixed order.
    pub fn chains(&self) -> Vec<Chain> {
        let keep = !self.mask;
        // The packet's mark routes it; the connection's mark makes the
        // decision stick for the connection's life (restored below).
        let set_mark = |mark: u32| {
            vec![
                format!("meta mark set meta mark & {keep:#010x} | {mark:#010x}"),
                format!("ct mark set ct mark & {keep:#010x} | {mark:#010x}"),
            ]
        };
        let vx = &self.vxlan;
        let (mask, reply, local) = (self.mask, self.reply_mark, self.local_mark);
        let restore = self
            .marks
            .iter()
            .map(|m| format!("{m:#010x} : jump {}", mark_chain(*m)))
            .chain([format!("{local:#010x} : jump local")])
            .collect::<Vec<_>>()
            .join(", ");
        let mut chains: Vec<Chain> = self
            .marks
            .iter()
            .map(|m| Chain::regular(mark_chain(*m), set_mark(*m)))
            .collect();
        chains.push(Chain::regular("local", set_mark(local)));
        chains.push(Chain::regular(FAIL_CLOSED, vec!["counter drop".into()]));
        // What a gateway sends out for others leaves with the address it
        // was meant to, or not at all: a connection that came out of the
        // tunnel, or was classified `local`, and was not translated to one
        // of this node's EIPs (no SNAT entry yet: a moment during a
        // failover, a plan that has not arrived here) is dropped after NAT,
        // never let out with a pod's or, through a CNI's masquerade, the
        // node's address. `useNodeIP` entries are meant to leave with the
        // node's address.
        let mut guard = vec![
            "ip daddr @cluster4 return".to_owned(),
            "ip6 daddr @cluster6 return".to_owned(),
        ];
        for (v6, proto) in [(false, "ip"), (true, "ip6")] {
            let eips: Vec<String> = self
                .eips
                .iter()
                .filter(|ip| ip.is_ipv6() == v6)
                .map(ToString::to_string)
                .collect();
            if !eips.is_empty() {
                guard.push(format!("{proto} saddr {{ {} }} return", eips.join(", ")));
            }
        }
        guard.push("ct original ip saddr . ip daddr @masq4 return".into());
        guard.push("ct original ip6 saddr . ip6 daddr @masq6 return".into());
        guard.push("counter drop".into());
        chains.push(Chain::regular("gateway_guard", guard));

        chains.push(Chain::regular(
            "gateway_nat",
            vec![
                "ip daddr @cluster4 return".into(),
                "ip6 daddr @cluster6 return".into(),
                "ip saddr . ip daddr @masq4 masquerade".into(),
                "ip6 saddr . ip6 daddr @masq6 masquerade".into(),
                "snat ip to ip saddr . ip daddr map @snat4".into(),
                "snat ip6 to ip6 saddr . ip6 daddr map @snat6".into(),
            ],
        ));
        chains.push(Chain::base(
            "prerouting",
            "filter",
            "prerouting",
            PRIO_MANGLE,
            vec![
                format!(
                    "iifname \"{vx}\" ct state new ct mark set ct mark & {keep:#010x} | {reply:#010x}"
                ),
                format!(
                    "ct direction reply ct mark & {mask:#010x} == {reply:#010x} \
                     meta mark set meta mark & {keep:#010x} | {reply:#010x}"
                ),
                "ct direction reply return".into(),
                // Classified once, when the connection starts: a policy that
                // changes later never moves an open connection (its NAT
                // binding could not follow).
                format!("ct state != new ct mark & {mask:#010x} vmap {{ {restore} }}"),
                // A connection whose gateway is no longer in use (its node
                // died) is classified again, like a new one: it follows the
                // failover instead of leaving unmarked.
                format!("ct state != new ct mark & {mask:#010x} == 0 return"),
                format!("ct state != new ct mark & {mask:#010x} == {reply:#010x} return"),
                "ip daddr @cluster4 return".into(),
                "ip6 daddr @cluster6 return".into(),
                "ip saddr . ip daddr vmap @classify4".into(),
                "ip6 saddr . ip6 daddr vmap @classify6".into(),
            ],
        ));
        chains.push(Chain::base(
            "postrouting_nat",
            "nat",
            "postrouting",
            PRIO_NAT,
            vec![
                format!("oifname \"{vx}\" snat ip to ip saddr"),
                format!("oifname \"{vx}\" snat ip6 to ip6 saddr"),
                format!("iifname \"{vx}\" goto gateway_nat"),
                format!("meta mark & {mask:#010x} == {local:#010x} goto gateway_nat"),
            ],
        ));
        chains.push(Chain::base(
            "postrouting_mark",
            "filter",
            "postrouting",
            PRIO_MARK,
            vec![
                format!("oifname \"{vx}\" meta mark set meta mark & {keep:#010x}"),
                format!("iifname \"{vx}\" oifname != \"{vx}\" jump gateway_guard"),
                format!(
                    "meta mark & {mask:#010x} == {local:#010x} oifname != \"{vx}\" jump gateway_guard"
                ),
            ],
        ));
        chains
    }

    /// The whole table as one nft script: what [`plan`] against an absent
    /// table applies. Deterministic.
    pub fn render(&self) -> String {
        script(&plan(self, None))
    }
}

/// The table as read back from the kernel, in the same canonical form as
/// [`FirewallSpec`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Names of the sets and maps.
    pub sets: BTreeSet<String>,
    /// Chains by name.
    pub chains: BTreeMap<String, ChainState>,
    /// `cluster4` / `cluster6` elements.
    pub cluster: BTreeSet<IpRange>,
    /// `classify4` / `classify6` elements.
    pub classify: BTreeMap<ElemKey, Verdict>,
    /// `snat4` / `snat6` / `masq4` / `masq6` elements.
    pub nat: BTreeMap<ElemKey, Nat>,
}

/// A chain as read back: its hook and its rules' fingerprints (a rule
/// without egressgw's comment reads as an empty fingerprint, which never
/// matches, so a chain someone edited is rewritten).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChainState {
    /// `None` for a regular chain.
    pub hook: Option<Hook>,
    /// One per rule, in order.
    pub fingerprints: Vec<String>,
}

/// Add or delete one element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemChange {
    /// `add element`.
    Add,
    /// `delete element`.
    Delete,
}

impl fmt::Display for ElemChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ElemChange::Add => "add",
            ElemChange::Delete => "delete",
        })
    }
}

/// One change to the table. Structure ops (table, sets, chains) and the
/// element ops of each concern are separate kinds, so that one concern can
/// move to another backend: classification ([`FwOp::Classify`]) is the part
/// an eBPF classifier takes over, NAT and cluster sets stay in nftables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FwOp {
    /// Create the table with its sets, maps and chains (no elements).
    CreateTable {
        /// Sets and maps.
        sets: Vec<SetDecl>,
        /// Chains with their rules.
        chains: Vec<Chain>,
    },
    /// Add a missing set or map.
    AddSet(SetDecl),
    /// Add a missing chain with its rules.
    AddChain(Chain),
    /// Rewrite a chain whose hook or rules differ: a regular chain is
    /// flushed and refilled (jumps to it stay valid), a base chain is
    /// deleted and recreated (its hook may change). Same transaction, so
    /// packets see the old chain or the new one.
    ReplaceChain(Chain),
    /// Delete a chain egressgw no longer needs (after the elements that jump
    /// to it).
    DeleteChain(String),
    /// Add or delete an in-cluster range.
    Cluster(ElemChange, IpRange),
    /// Add or delete a classify element.
    Classify(ElemChange, ElemKey, Verdict),
    /// Add or delete a SNAT or masquerade element.
    Nat(ElemChange, ElemKey, Nat),
}

fn family_suffix(ip: IpAddr) -> char {
    if ip.is_ipv4() { '4' } else { '6' }
}

impl FwOp {
    /// The set or map an element op changes.
    fn set_name(&self) -> Option<String> {
        Some(match self {
            FwOp::Cluster(_, r) => format!("cluster{}", family_suffix(r.first())),
            FwOp::Classify(_, k, _) => format!("classify{}", family_suffix(k.src)),
            FwOp::Nat(_, k, Nat::Snat(_)) => format!("snat{}", family_suffix(k.src)),
            FwOp::Nat(_, k, Nat::Masquerade) => format!("masq{}", family_suffix(k.src)),
            _ => return None,
        })
    }

    /// The element as nft writes it, with its value when adding.
    fn element(&self) -> Option<String> {
        Some(match self {
            FwOp::Cluster(_, r) => r.to_string(),
            FwOp::Classify(ElemChange::Add, k, v) => format!("{k} : {v}"),
            FwOp::Nat(ElemChange::Add, k, Nat::Snat(to)) => format!("{k} : {to}"),
            FwOp::Classify(_, k, _) | FwOp::Nat(_, k, _) => k.to_string(),
            _ => return None,
        })
    }

    /// The nft commands of this op, one per line.
    pub fn to_nft(&self) -> String {
        match self {
            FwOp::CreateTable { sets, chains } => {
                let mut out = format!("add table {FAMILY} {TABLE}\n");
                out.extend(sets.iter().map(SetDecl::render));
                out.extend(chains.iter().map(Chain::render_add));
                out
            }
            FwOp::AddSet(set) => set.render(),
            FwOp::AddChain(chain) => chain.render_add(),
            FwOp::ReplaceChain(chain) => {
                let name = &chain.name;
                let mut out = format!("flush chain {FAMILY} {TABLE} {name}\n");
                if chain.hook.is_some() {
                    out += &format!("delete chain {FAMILY} {TABLE} {name}\n");
                    out += &chain.render_add();
                } else {
                    out.extend(chain.rules.iter().map(|r| {
                        format!("add rule {FAMILY} {TABLE} {name} {}\n", with_comment(r))
                    }));
                }
                out
            }
            FwOp::DeleteChain(name) => format!(
                "flush chain {FAMILY} {TABLE} {name}\ndelete chain {FAMILY} {TABLE} {name}\n"
            ),
            FwOp::Cluster(change, _) | FwOp::Classify(change, ..) | FwOp::Nat(change, ..) => {
                format!(
                    "{change} element {FAMILY} {TABLE} {} {{ {} }}\n",
                    self.set_name().unwrap_or_default(),
                    self.element().unwrap_or_default()
                )
            }
        }
    }
}

impl fmt::Display for FwOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FwOp::CreateTable { sets, chains } => write!(
                f,
                "add table {FAMILY} {TABLE} ({} sets, {} chains)",
                sets.len(),
                chains.len()
            ),
            FwOp::AddSet(set) => write!(f, "add {} {}", set.kind, set.name),
            FwOp::AddChain(c) => write!(f, "add chain {} ({} rules)", c.name, c.rules.len()),
            FwOp::ReplaceChain(c) => {
                write!(f, "replace chain {} ({} rules)", c.name, c.rules.len())
            }
            FwOp::DeleteChain(name) => write!(f, "delete chain {name}"),
            FwOp::Cluster(change, ..) | FwOp::Classify(change, ..) | FwOp::Nat(change, ..) => {
                write!(
                    f,
                    "{change} element {} {{ {} }}",
                    self.set_name().unwrap_or_default(),
                    self.element().unwrap_or_default()
                )
            }
        }
    }
}

/// The nft script of `ops`, in order.
fn script(ops: &[FwOp]) -> String {
    ops.iter().map(FwOp::to_nft).collect()
}

/// The ops that turn `observed` (`None`: no table) into `desired`, in an
/// order one transaction accepts: structure first, then element deletions
/// (interval sets reject an added element that overlaps one not yet
/// deleted, even in the same transaction), then element additions, then
/// chain deletions (a chain cannot go while elements jump to it). A changed
/// element value is a deletion plus an addition. Equal states plan nothing.
pub fn plan(desired: &FirewallSpec, observed: Option<&Observed>) -> Vec<FwOp> {
    let chains = desired.chains();
    let empty = Observed::default();
    let mut ops = Vec::new();
    let observed = match observed {
        None => {
            ops.push(FwOp::CreateTable {
                sets: SETS.to_vec(),
                chains: chains.clone(),
            });
            &empty
        }
        Some(o) => {
            ops.extend(
                SETS.iter()
                    .filter(|s| !o.sets.contains(s.name))
                    .map(|s| FwOp::AddSet(*s)),
            );
            for chain in &chains {
                match o.chains.get(&chain.name) {
                    None => ops.push(FwOp::AddChain(chain.clone())),
                    Some(state) if *state != chain.state() => {
                        ops.push(FwOp::ReplaceChain(chain.clone()));
                    }
                    Some(_) => {}
                }
            }
            o
        }
    };
    let mut adds = Vec::new();
    let cluster_desired = desired.cluster.iter().map(|r| (*r, ())).collect();
    let cluster_observed = observed.cluster.iter().map(|r| (*r, ())).collect();
    for change in diff(&cluster_desired, &cluster_observed) {
        split(change, &mut ops, &mut adds, |c, r, ()| FwOp::Cluster(c, r));
    }
    for change in diff(&desired.classify, &observed.classify) {
        split(change, &mut ops, &mut adds, FwOp::Classify);
    }
    for change in diff(&desired.nat, &observed.nat) {
        split(change, &mut ops, &mut adds, FwOp::Nat);
    }
    ops.extend(adds);
    let wanted: BTreeSet<&str> = chains.iter().map(|c| c.name.as_str()).collect();
    ops.extend(
        observed
            .chains
            .keys()
            .filter(|name| !wanted.contains(name.as_str()))
            .map(|name| FwOp::DeleteChain(name.clone())),
    );
    ops
}

/// Deletions go to `deletes`, additions to `adds`; a change is both.
fn split<K, V>(
    change: Change<K, V>,
    deletes: &mut Vec<FwOp>,
    adds: &mut Vec<FwOp>,
    op: impl Fn(ElemChange, K, V) -> FwOp,
) where
    K: Clone,
{
    match change {
        Change::Add(k, v) => adds.push(op(ElemChange::Add, k, v)),
        Change::Remove(k, v) => deletes.push(op(ElemChange::Delete, k, v)),
        Change::Change(k, old, new) => {
            deletes.push(op(ElemChange::Delete, k.clone(), old));
            adds.push(op(ElemChange::Add, k, new));
        }
    }
}

/// egressgw's nftables table, as a reconcile sees it.
///
/// A future eBPF classifier (TC on the pod-facing side, reading an LPM map
/// keyed by source and destination prefix) takes over only the
/// [`FwOp::Classify`] ops: the reconcile would hand those to the BPF
/// backend's map writer and the rest (NAT, cluster sets, mark hygiene) to
/// this one, whose spec then has no classify elements and whose
/// `prerouting` chain keeps only the reply-mark rules. Keeping classify ops
/// a kind of their own is what makes that split a filter, not a rewrite.
pub trait Firewall {
    /// Reads the table; `None` when it does not exist.
    fn observe(&mut self) -> Result<Option<Observed>>;

    /// Applies `ops` in one transaction; when that fails, applies each op in
    /// a transaction of its own so every failure is reported with its op
    /// and the other ops still land.
    fn apply(&mut self, ops: &[FwOp]) -> Report;

    /// Deletes the table; returns whether it existed.
    fn remove(&mut self) -> Result<bool>;

    /// Deletes the conntrack entries under `keys` that never saw an answer
    /// (see [`crate::conntrack`]); returns how many went.
    fn forget_unanswered(&mut self, keys: &[ElemKey]) -> std::io::Result<usize>;
}

/// The real backend: runs the `nft` binary in the caller's network
/// namespace.
#[derive(Debug, Clone)]
pub struct Nft {
    binary: String,
}

impl Default for Nft {
    fn default() -> Self {
        Self::new()
    }
}

impl Nft {
    /// Uses `nft` from `PATH`.
    pub fn new() -> Self {
        Self::with_binary("nft")
    }

    /// Uses the `nft` binary at `path`.
    pub fn with_binary(path: impl Into<String>) -> Self {
        Self {
            binary: path.into(),
        }
    }

    /// Runs `nft <args>` with `stdin` as input; returns stdout.
    fn run(&self, what: &str, args: &[&str], stdin: &str) -> Result<String> {
        let err = |message: String| Error::Nft {
            what: what.into(),
            message,
        };
        let mut child = Command::new(&self.binary)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| err(format!("spawn {}: {e}", self.binary)))?;
        if let Some(mut input) = child.stdin.take() {
            input
                .write_all(stdin.as_bytes())
                .map_err(|e| err(format!("write script: {e}")))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| err(format!("wait: {e}")))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(err(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
        }
    }

    /// Runs one transaction.
    fn transaction(&self, what: &str, ops: &[FwOp]) -> Result<()> {
        self.run(what, &["-f", "-"], &script(ops)).map(drop)
    }
}

/// Whether an `nft` error says the table does not exist.
fn is_missing(e: &Error) -> bool {
    // Not "spawn nft: No such file or directory": a missing binary is an error.
    matches!(e, Error::Nft { message, .. }
        if message.contains("No such file or directory") && !message.starts_with("spawn "))
}

impl Firewall for Nft {
    fn forget_unanswered(&mut self, keys: &[ElemKey]) -> std::io::Result<usize> {
        crate::conntrack::forget_unanswered(keys)
    }

    fn observe(&mut self) -> Result<Option<Observed>> {
        let what = format!("list table {FAMILY} {TABLE}");
        match self.run(&what, &["-j", "list", "table", FAMILY, TABLE], "") {
            Ok(json) => parse_table(&json).map(Some),
            Err(e) if is_missing(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn apply(&mut self, ops: &[FwOp]) -> Report {
        let mut report = Report::default();
        if ops.is_empty() {
            return report;
        }
        match self.transaction("transaction", ops) {
            Ok(()) => {
                for op in ops {
                    report.record(op, Ok::<(), Error>(()));
                }
            }
            Err(e) => {
                report.warn(format!(
                    "nftables transaction of {} ops failed, applying them one by one: {e}",
                    ops.len()
                ));
                for op in ops {
                    let result = self.transaction(&op.to_string(), std::slice::from_ref(op));
                    report.record(op, result.map_err(|e| e.detail()));
                }
            }
        }
        report
    }

    fn remove(&mut self) -> Result<bool> {
        let what = format!("delete table {FAMILY} {TABLE}");
        match self.run(&what, &["delete", "table", FAMILY, TABLE], "") {
            Ok(_) => Ok(true),
            Err(e) if is_missing(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Parses `nft -j list table inet egressgw` into canonical form.
///
/// Interval elements come back as a plain address, a `prefix` object or a
/// `range` object (nft prints a range that is exactly one prefix as the
/// prefix); all three become an [`IpRange`]. Elements egressgw cannot
/// read (a source that is not one address) are skipped with a warning.
pub fn parse_table(json: &str) -> Result<Observed> {
    let bad = |message: String| Error::Nft {
        what: format!("parse list table {FAMILY} {TABLE}"),
        message,
    };
    let root: Value = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    let items = root
        .get("nftables")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no \"nftables\" array".into()))?;
    let mut obs = Observed::default();
    for item in items {
        if let Some(set) = item.get("set").or_else(|| item.get("map")) {
            parse_set(set, &mut obs);
        } else if let Some(chain) = item.get("chain") {
            let name = str_field(chain, "name");
            let hook = chain.get("hook").map(|h| Hook {
                kind: str_field(chain, "type"),
                hook: h.as_str().unwrap_or_default().into(),
                priority: chain
                    .get("prio")
                    .and_then(Value::as_i64)
                    .and_then(|p| i32::try_from(p).ok())
                    .unwrap_or_default(),
            });
            obs.chains.entry(name).or_default().hook = hook;
        } else if let Some(rule) = item.get("rule") {
            obs.chains
                .entry(str_field(rule, "chain"))
                .or_default()
                .fingerprints
                .push(str_field(rule, "comment"));
        }
    }
    Ok(obs)
}

fn str_field(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn parse_set(set: &Value, obs: &mut Observed) {
    let name = str_field(set, "name");
    let elems = set
        .get("elem")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for elem in &elems {
        // A map element is `[key, value]`; an element with options is
        // wrapped in `{"elem": {"val": ...}}`.
        let (key, value) = match elem.as_array().map(Vec::as_slice) {
            Some([k, v]) => (k, Some(v)),
            _ => (elem, None),
        };
        let key = key.pointer("/elem/val").unwrap_or(key);
        if name.starts_with("cluster") {
            match parse_range(key) {
                Some(r) => {
                    obs.cluster.insert(r);
                }
                None => tracing::warn!(set = %name, elem = %elem, "unreadable element"),
            }
            continue;
        }
        let Some(k) = parse_concat(key) else {
            tracing::warn!(set = %name, elem = %elem, "unreadable element");
            continue;
        };
        match (name.as_str(), value) {
            ("classify4" | "classify6", Some(v)) => {
                let target = ["jump", "goto"]
                    .iter()
                    .find_map(|kind| v.pointer(&format!("/{kind}/target")))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                obs.classify.insert(k, Verdict::parse(target));
            }
            ("snat4" | "snat6", Some(v)) => {
                if let Some(to) = v.as_str().and_then(|s| s.parse().ok()) {
                    obs.nat.insert(k, Nat::Snat(to));
                }
            }
            ("masq4" | "masq6", None) => {
                obs.nat.insert(k, Nat::Masquerade);
            }
            _ => {}
        }
    }
    obs.sets.insert(name);
}

/// `{"concat": [src, dst]}` with a single-address source.
fn parse_concat(key: &Value) -> Option<ElemKey> {
    match key.get("concat")?.as_array()?.as_slice() {
        [src, dst] => {
            let src = parse_range(src)?;
            (src.first() == src.last()).then_some(())?;
            Some(ElemKey {
                src: src.first(),
                dst: parse_range(dst)?,
            })
        }
        _ => None,
    }
}

/// `"10.0.0.1"`, `{"prefix": {"addr": .., "len": ..}}` or `{"range": [a, b]}`.
fn parse_range(v: &Value) -> Option<IpRange> {
    if let Some(s) = v.as_str() {
        return Some(IpRange::single(s.parse().ok()?));
    }
    if let Some(p) = v.get("prefix") {
        let addr: IpAddr = p.get("addr")?.as_str()?.parse().ok()?;
        let len = u8::try_from(p.get("len")?.as_u64()?).ok()?;
        return Some(IpRange::of_net(IpNet::new(addr, len).ok()?));
    }
    match v.get("range")?.as_array()?.as_slice() {
        [a, b] => IpRange::new(a.as_str()?.parse().ok()?, b.as_str()?.parse().ok()?),
        _ => None,
    }
}

/// An in-memory table for reconcile tests without root. It keeps what the
/// ops describe and fails like the kernel does on the mistakes a planner
/// can make (adding what exists, deleting what does not, deleting a chain
/// that elements jump to, touching a missing table); ops whose display is
/// in `fail` fail on purpose.
#[derive(Debug, Clone, Default)]
pub struct FakeFirewall {
    /// The table, `None` when absent.
    pub table: Option<Observed>,
    /// Ops (by their display) that fail.
    pub fail: BTreeSet<String>,
    /// How many `apply` calls carried at least one op.
    pub transactions: usize,
    /// The keys whose unanswered connections were to be forgotten.
    pub forgotten: Vec<ElemKey>,
}

impl FakeFirewall {
    fn apply_one(&mut self, op: &FwOp) -> Result<(), String> {
        if self.fail.contains(&op.to_string()) {
            return Err("injected failure".into());
        }
        if let FwOp::CreateTable { sets, chains } = op {
            if self.table.is_some() {
                return Err("File exists".into());
            }
            self.table = Some(Observed {
                sets: sets.iter().map(|s| s.name.to_owned()).collect(),
                chains: chains.iter().map(|c| (c.name.clone(), c.state())).collect(),
                ..Observed::default()
            });
            return Ok(());
        }
        let t = self.table.as_mut().ok_or("No such file or directory")?;
        let exists = |present: bool, change: ElemChange| match (present, change) {
            (true, ElemChange::Add) => Err("File exists"),
            (false, ElemChange::Delete) => Err("No such file or directory"),
            _ => Ok(()),
        };
        match op {
            FwOp::CreateTable { .. } => {}
            FwOp::AddSet(s) => {
                t.sets.insert(s.name.to_owned());
            }
            FwOp::AddChain(c) | FwOp::ReplaceChain(c) => {
                t.chains.insert(c.name.clone(), c.state());
            }
            FwOp::DeleteChain(name) => {
                if t.classify.values().any(|v| v.chain() == *name) {
                    return Err("Device or resource busy".into());
                }
                t.chains.remove(name).ok_or("No such file or directory")?;
            }
            FwOp::Cluster(change, r) => {
                exists(t.cluster.contains(r), *change)?;
                match change {
                    ElemChange::Add => t.cluster.insert(*r),
                    ElemChange::Delete => t.cluster.remove(r),
                };
            }
            FwOp::Classify(change, k, v) => {
                exists(t.classify.contains_key(k), *change)?;
                if *change == ElemChange::Add && !t.chains.contains_key(&v.chain()) {
                    return Err("No such file or directory".into());
                }
                match change {
                    ElemChange::Add => t.classify.insert(*k, v.clone()),
                    ElemChange::Delete => t.classify.remove(k),
                };
            }
            FwOp::Nat(change, k, v) => {
                exists(t.nat.contains_key(k), *change)?;
                match change {
                    ElemChange::Add => t.nat.insert(*k, *v),
                    ElemChange::Delete => t.nat.remove(k),
                };
            }
        }
        Ok(())
    }
}

impl Firewall for FakeFirewall {
    fn forget_unanswered(&mut self, keys: &[ElemKey]) -> std::io::Result<usize> {
        self.forgotten.extend_from_slice(keys);
        Ok(keys.len())
    }

    fn observe(&mut self) -> Result<Option<Observed>> {
        Ok(self.table.clone())
    }

    fn apply(&mut self, ops: &[FwOp]) -> Report {
        let mut report = Report::default();
        if !ops.is_empty() {
            self.transactions += 1;
        }
        for op in ops {
            let result = self.apply_one(op);
            report.record(op, result);
        }
        report
    }

    fn remove(&mut self) -> Result<bool> {
        Ok(self.table.take().is_some())
    }
}

#[cfg(test)]
mod tests {
    use egressgw_core::model::PolicyRef;
    use egressgw_core::state::{ClassifyEntry, SnatEntry};

    use super::*;
    use crate::testns::{in_new_netns, root_or_skip, sh};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn classify(src: &str, dst: &str, action: Action) -> ClassifyEntry {
        ClassifyEntry {
            src: ip(src),
            dst: net(dst),
            action,
            policy: Some(PolicyRef::namespaced("a", "p")),
            group: None,
        }
    }

    fn tunnel(mark: u32) -> Action {
        Action::Tunnel {
            gateway: format!("g{mark:x}"),
            mark,
        }
    }

    fn snat(src: &str, dst: &str, to: SnatTo) -> SnatEntry {
        SnatEntry {
            src: ip(src),
            dst: net(dst),
            to,
            origin: "n2".into(),
            policy: PolicyRef::namespaced("a", "p"),
        }
    }

    /// Both families, a tunnelled default route with a bypass hole and a
    /// `Local` prefix, SNAT to an EIP with a masqueraded prefix inside it.
    fn state() -> NodeState {
        NodeState {
            node: "n1".into(),
            cluster_cidrs: vec![
                net("10.244.0.0/16"),
                net("10.96.0.0/12"),
                net("10.244.3.0/24"),
                net("fd00:10::/48"),
            ],
            classify: vec![
                classify("10.244.1.2", "0.0.0.0/0", tunnel(0x0100_0000)),
                classify("10.244.1.2", "203.0.113.192/26", Action::Bypass),
                classify("10.244.1.2", "198.51.100.0/24", Action::Local),
                classify("fd00:10::2", "::/0", tunnel(0x0200_0000)),
                classify("fd00:10::2", "2001:db8::/32", Action::Bypass),
            ],
            snat: vec![
                snat("10.244.2.5", "0.0.0.0/0", SnatTo::Eip(ip("192.0.2.10"))),
                snat("10.244.2.5", "198.51.100.0/24", SnatTo::NodeIp),
                snat(
                    "fd00:10::5",
                    "2001:db8::/32",
                    SnatTo::Eip(ip("2001:db8:ff::10")),
                ),
            ],
            ..NodeState::default()
        }
    }

    fn spec() -> FirewallSpec {
        FirewallSpec::new(&state(), &Config::default())
    }

    fn shown(ops: &[FwOp]) -> Vec<String> {
        ops.iter().map(ToString::to_string).collect()
    }

    /// What the fake holds after applying `ops` to an empty kernel.
    fn applied(spec: &FirewallSpec) -> FakeFirewall {
        let mut fw = FakeFirewall::default();
        let report = fw.apply(&plan(spec, None));
        assert!(report.is_ok(), "{report:?}");
        fw
    }

    #[test]
    fn a_small_table_renders_as_one_deterministic_script() {
        let state = NodeState {
            cluster_cidrs: vec![net("10.244.0.0/16")],
            classify: vec![
                classify("10.244.1.2", "0.0.0.0/0", tunnel(0x0100_0000)),
                classify("10.244.1.2", "203.0.113.192/26", Action::Bypass),
            ],
            snat: vec![snat(
                "10.244.2.5",
                "198.51.100.0/24",
                SnatTo::Eip(ip("192.0.2.10")),
            )],
            ..NodeState::default()
        };
        let spec = FirewallSpec::new(&state, &Config::default());
        assert_eq!(spec.render(), spec.clone().render());
        assert_eq!(
            spec.render(),
            r#"add table inet egressgw
add map inet egressgw classify4 { type ipv4_addr . ipv4_addr : verdict; flags interval; }
add map inet egressgw classify6 { type ipv6_addr . ipv6_addr : verdict; flags interval; }
add map inet egressgw snat4 { type ipv4_addr . ipv4_addr : ipv4_addr; flags interval; }
add map inet egressgw snat6 { type ipv6_addr . ipv6_addr : ipv6_addr; flags interval; }
add set inet egressgw masq4 { type ipv4_addr . ipv4_addr; flags interval; }
add set inet egressgw masq6 { type ipv6_addr . ipv6_addr; flags interval; }
add set inet egressgw cluster4 { type ipv4_addr; flags interval; }
add set inet egressgw cluster6 { type ipv6_addr; flags interval; }
add chain inet egressgw mark_01000000
add rule inet egressgw mark_01000000 meta mark set meta mark & 0x00ffffff | 0x01000000 comment "6f6c06158d7f4b4e"
add rule inet egressgw mark_01000000 ct mark set ct mark & 0x00ffffff | 0x01000000 comment "aca70d19992d4876"
add chain inet egressgw local
add rule inet egressgw local meta mark set meta mark & 0x00ffffff | 0xfe000000 comment "65b5d35193d93e28"
add rule inet egressgw local ct mark set ct mark & 0x00ffffff | 0xfe000000 comment "fda798e7e8eab830"
add chain inet egressgw fail_closed
add rule inet egressgw fail_closed counter drop comment "aad7fa09e1332e50"
add chain inet egressgw gateway_guard
add rule inet egressgw gateway_guard ip daddr @cluster4 return comment "4547dd9262c4ecad"
add rule inet egressgw gateway_guard ip6 daddr @cluster6 return comment "99893f885d8ae25d"
add rule inet egressgw gateway_guard ip saddr { 192.0.2.10 } return comment "360384b49df0c9b7"
add rule inet egressgw gateway_guard ct original ip saddr . ip daddr @masq4 return comment "fc3f269bba115ebc"
add rule inet egressgw gateway_guard ct original ip6 saddr . ip6 daddr @masq6 return comment "14339918059f969c"
add rule inet egressgw gateway_guard counter drop comment "aad7fa09e1332e50"
add chain inet egressgw gateway_nat
add rule inet egressgw gateway_nat ip daddr @cluster4 return comment "4547dd9262c4ecad"
add rule inet egressgw gateway_nat ip6 daddr @cluster6 return comment "99893f885d8ae25d"
add rule inet egressgw gateway_nat ip saddr . ip daddr @masq4 masquerade comment "e8104f927ba7d946"
add rule inet egressgw gateway_nat ip6 saddr . ip6 daddr @masq6 masquerade comment "39f50008b14e0682"
add rule inet egressgw gateway_nat snat ip to ip saddr . ip daddr map @snat4 comment "97ae36449faab7f0"
add rule inet egressgw gateway_nat snat ip6 to ip6 saddr . ip6 daddr map @snat6 comment "c7ab21c5b185438a"
add chain inet egressgw prerouting { type filter hook prerouting priority -150; policy accept; }
add rule inet egressgw prerouting iifname "egress.vxlan" ct state new ct mark set ct mark & 0x00ffffff | 0xff000000 comment "c82debc54673c8f2"
add rule inet egressgw prerouting ct direction reply ct mark & 0xff000000 == 0xff000000 meta mark set meta mark & 0x00ffffff | 0xff000000 comment "eb4a0ac4441b7d57"
add rule inet egressgw prerouting ct direction reply return comment "3c7345d7f27b17db"
add rule inet egressgw prerouting ct state != new ct mark & 0xff000000 vmap { 0x01000000 : jump mark_01000000, 0xfe000000 : jump local } comment "18c66163311e2491"
add rule inet egressgw prerouting ct state != new ct mark & 0xff000000 == 0 return comment "c4304de74753e6dd"
add rule inet egressgw prerouting ct state != new ct mark & 0xff000000 == 0xff000000 return comment "8d06e14406291b4f"
add rule inet egressgw prerouting ip daddr @cluster4 return comment "4547dd9262c4ecad"
add rule inet egressgw prerouting ip6 daddr @cluster6 return comment "99893f885d8ae25d"
add rule inet egressgw prerouting ip saddr . ip daddr vmap @classify4 comment "7e5e38da85c648ac"
add rule inet egressgw prerouting ip6 saddr . ip6 daddr vmap @classify6 comment "e827b1ba3d30ff44"
add chain inet egressgw postrouting_nat { type nat hook postrouting priority 90; policy accept; }
add rule inet egressgw postrouting_nat oifname "egress.vxlan" snat ip to ip saddr comment "9a2eecfdacc3452b"
add rule inet egressgw postrouting_nat oifname "egress.vxlan" snat ip6 to ip6 saddr comment "c277a8f08a85a98b"
add rule inet egressgw postrouting_nat iifname "egress.vxlan" goto gateway_nat comment "0bb4edf3f5f2768d"
add rule inet egressgw postrouting_nat meta mark & 0xff000000 == 0xfe000000 goto gateway_nat comment "bd63945cf1a3697b"
add chain inet egressgw postrouting_mark { type filter hook postrouting priority 110; policy accept; }
add rule inet egressgw postrouting_mark oifname "egress.vxlan" meta mark set meta mark & 0x00ffffff comment "a5a5f4c5e6650e08"
add rule inet egressgw postrouting_mark iifname "egress.vxlan" oifname != "egress.vxlan" jump gateway_guard comment "689bf374f71a3445"
add rule inet egressgw postrouting_mark meta mark & 0xff000000 == 0xfe000000 oifname != "egress.vxlan" jump gateway_guard comment "0b5ca3bb4a430a9f"
add element inet egressgw cluster4 { 10.244.0.0/16 }
add element inet egressgw classify4 { 10.244.1.2 . 0.0.0.0-203.0.113.191 : jump mark_01000000 }
add element inet egressgw classify4 { 10.244.1.2 . 203.0.114.0-255.255.255.255 : jump mark_01000000 }
add element inet egressgw snat4 { 10.244.2.5 . 198.51.100.0/24 : 192.0.2.10 }
"#
        );
    }

    #[test]
    fn an_absent_table_is_created_then_filled() {
        let ops = plan(&spec(), None);
        assert_eq!(
            ops[0].to_string(),
            "add table inet egressgw (8 sets, 9 chains)"
        );
        assert_eq!(
            shown(&ops[1..]),
            [
                "add element cluster4 { 10.96.0.0/12 }",
                "add element cluster4 { 10.244.0.0/16 }",
                "add element cluster6 { fd00:10::/48 }",
                "add element classify4 { 10.244.1.2 . 0.0.0.0-198.51.99.255 : jump mark_01000000 }",
                "add element classify4 { 10.244.1.2 . 198.51.100.0/24 : jump local }",
                "add element classify4 { 10.244.1.2 . 198.51.101.0-203.0.113.191 : jump mark_01000000 }",
                "add element classify4 { 10.244.1.2 . 203.0.114.0-255.255.255.255 : jump mark_01000000 }",
                "add element classify6 { fd00:10::2 . ::-2001:db7:ffff:ffff:ffff:ffff:ffff:ffff : jump mark_02000000 }",
                "add element classify6 { fd00:10::2 . 2001:db9::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff : jump mark_02000000 }",
                "add element snat4 { 10.244.2.5 . 0.0.0.0-198.51.99.255 : 192.0.2.10 }",
                "add element masq4 { 10.244.2.5 . 198.51.100.0/24 }",
                "add element snat4 { 10.244.2.5 . 198.51.101.0-255.255.255.255 : 192.0.2.10 }",
                "add element snat6 { fd00:10::5 . 2001:db8::/32 : 2001:db8:ff::10 }",
            ]
        );
    }

    #[test]
    fn an_equal_table_plans_nothing() {
        let mut fw = applied(&spec());
        let observed = fw.observe().unwrap();
        assert_eq!(plan(&spec(), observed.as_ref()), []);
    }

    #[test]
    fn a_changed_element_value_is_deleted_then_added() {
        let mut fw = applied(&spec());
        let mut state = state();
        state.snat[0].to = SnatTo::Eip(ip("192.0.2.11"));
        let ops = plan(
            &FirewallSpec::new(&state, &Config::default()),
            fw.observe().unwrap().as_ref(),
        );
        assert_eq!(
            shown(&ops),
            [
                "replace chain gateway_guard (7 rules)",
                "delete element snat4 { 10.244.2.5 . 0.0.0.0-198.51.99.255 }",
                "delete element snat4 { 10.244.2.5 . 198.51.101.0-255.255.255.255 }",
                "add element snat4 { 10.244.2.5 . 0.0.0.0-198.51.99.255 : 192.0.2.11 }",
                "add element snat4 { 10.244.2.5 . 198.51.101.0-255.255.255.255 : 192.0.2.11 }",
            ]
        );
        assert!(fw.apply(&ops).is_ok());
        assert_eq!(
            plan(
                &FirewallSpec::new(&state, &Config::default()),
                fw.observe().unwrap().as_ref()
            ),
            []
        );
    }

    #[test]
    fn a_new_gateway_mark_adds_its_chain_first_and_an_unused_one_goes_last() {
        let mut fw = applied(&spec());
        let mut state = state();
        state.classify[0].action = tunnel(0x0300_0000);
        state.classify.retain(|e| !e.src.is_ipv6());
        let desired = FirewallSpec::new(&state, &Config::default());
        let ops = plan(&desired, fw.observe().unwrap().as_ref());
        let shown = shown(&ops);
        assert_eq!(
            shown.first().map(String::as_str),
            Some("add chain mark_03000000 (2 rules)")
        );
        assert_eq!(
            shown[shown.len() - 2..],
            ["delete chain mark_01000000", "delete chain mark_02000000"]
        );
        assert!(shown.contains(&"delete element classify6 { fd00:10::2 . ::-2001:db7:ffff:ffff:ffff:ffff:ffff:ffff }".to_owned()));
        let report = fw.apply(&ops);
        assert!(report.is_ok(), "{report:?}");
        assert_eq!(plan(&desired, fw.observe().unwrap().as_ref()), []);
    }

    #[test]
    fn a_renamed_tunnel_device_replaces_only_the_chains_that_name_it() {
        let mut fw = applied(&spec());
        let mut cfg = Config::default();
        cfg.vxlan.name = "egw0".into();
        let ops = plan(
            &FirewallSpec::new(&state(), &cfg),
            fw.observe().unwrap().as_ref(),
        );
        assert_eq!(
            shown(&ops),
            [
                "replace chain prerouting (10 rules)",
                "replace chain postrouting_nat (4 rules)",
                "replace chain postrouting_mark (3 rules)",
            ]
        );
        assert!(ops[0].to_nft().starts_with(
            "flush chain inet egressgw prerouting\ndelete chain inet egressgw prerouting\nadd chain inet egressgw prerouting { type filter"
        ));
    }

    #[test]
    fn a_failing_op_is_reported_and_the_others_still_land() {
        let mut fw = FakeFirewall::default();
        let ops = plan(&spec(), None);
        let bad = "add element masq4 { 10.244.2.5 . 198.51.100.0/24 }";
        fw.fail.insert(bad.into());
        let report = fw.apply(&ops);
        assert_eq!(report.failed.len(), 1);
        assert_eq!(report.failed[0].op, bad);
        assert_eq!(report.applied.len(), ops.len() - 1);
        fw.fail.clear();
        let retry = plan(&spec(), fw.observe().unwrap().as_ref());
        assert_eq!(shown(&retry), [bad]);
    }

    #[test]
    fn observed_elements_read_back_from_prefixes_ranges_and_addresses() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
          {"table": {"family": "inet", "name": "egressgw", "handle": 1}},
          {"map": {"family": "inet", "name": "classify4", "table": "egressgw", "type": ["ipv4_addr", "ipv4_addr"], "map": "verdict", "flags": ["interval"], "elem": [
            [{"concat": ["10.244.1.2", {"range": ["0.0.0.0", "203.0.112.255"]}]}, {"jump": {"target": "mark_01000000"}}],
            [{"concat": ["10.244.1.3", {"prefix": {"addr": "0.0.0.0", "len": 0}}]}, {"jump": {"target": "local"}}],
            [{"concat": ["10.244.1.4", "192.0.2.1"]}, {"jump": {"target": "other"}}]]}},
          {"map": {"family": "inet", "name": "snat6", "table": "egressgw", "type": ["ipv6_addr", "ipv6_addr"], "map": "ipv6_addr", "flags": ["interval"], "elem": [
            [{"concat": ["fd00::1", {"prefix": {"addr": "2001:db8::", "len": 32}}]}, "2001:db8:ffff::1"]]}},
          {"set": {"family": "inet", "name": "masq4", "table": "egressgw", "type": ["ipv4_addr", "ipv4_addr"], "flags": ["interval"], "elem": [
            {"concat": ["10.244.1.2", {"prefix": {"addr": "8.8.8.0", "len": 24}}]}]}},
          {"set": {"family": "inet", "name": "cluster4", "table": "egressgw", "type": "ipv4_addr", "flags": ["interval"], "elem": [
            {"prefix": {"addr": "10.96.0.0", "len": 12}}, "10.200.0.1", {"range": ["10.0.0.1", "10.0.0.9"]}]}},
          {"chain": {"family": "inet", "table": "egressgw", "name": "postrouting_nat", "handle": 4, "type": "nat", "hook": "postrouting", "prio": 90, "policy": "accept"}},
          {"rule": {"family": "inet", "table": "egressgw", "chain": "postrouting_nat", "handle": 24, "comment": "9a2eecfdacc3452b", "expr": []}},
          {"rule": {"family": "inet", "table": "egressgw", "chain": "postrouting_nat", "handle": 25, "expr": []}}]}"#;
        let obs = parse_table(json).unwrap();
        let classify: Vec<String> = obs
            .classify
            .iter()
            .map(|(k, v)| format!("{k} : {v}"))
            .collect();
        assert_eq!(
            classify,
            [
                "10.244.1.2 . 0.0.0.0-203.0.112.255 : jump mark_01000000",
                "10.244.1.3 . 0.0.0.0/0 : jump local",
                "10.244.1.4 . 192.0.2.1 : jump other",
            ]
        );
        assert_eq!(
            obs.classify.values().nth(2),
            Some(&Verdict::Other("other".into()))
        );
        let nat: Vec<String> = obs
            .nat
            .iter()
            .map(|(k, v)| format!("{k} : {v:?}"))
            .collect();
        assert_eq!(
            nat,
            [
                "10.244.1.2 . 8.8.8.0/24 : Masquerade",
                "fd00::1 . 2001:db8::/32 : Snat(2001:db8:ffff::1)"
            ]
        );
        let cluster: Vec<String> = obs.cluster.iter().map(ToString::to_string).collect();
        assert_eq!(cluster, ["10.0.0.1-10.0.0.9", "10.96.0.0/12", "10.200.0.1"]);
        assert_eq!(
            obs.chains["postrouting_nat"],
            ChainState {
                hook: Some(Hook {
                    kind: "nat".into(),
                    hook: "postrouting".into(),
                    priority: 90
                }),
                fingerprints: vec!["9a2eecfdacc3452b".into(), String::new()],
            }
        );
        assert_eq!(
            obs.sets.iter().map(String::as_str).collect::<Vec<_>>(),
            ["classify4", "cluster4", "masq4", "snat6"]
        );
    }

    // Privileged tests: each runs in a network namespace of its own.

    fn observe_real(nft: &mut Nft) -> Observed {
        nft.observe().unwrap().expect("table exists")
    }

    /// Asserts that the kernel holds exactly `spec`.
    fn assert_holds(nft: &mut Nft, spec: &FirewallSpec) {
        let obs = observe_real(nft);
        assert_eq!(obs.classify, spec.classify);
        assert_eq!(obs.nat, spec.nat);
        assert_eq!(obs.cluster, spec.cluster);
        let chains: BTreeMap<String, ChainState> = spec
            .chains()
            .iter()
            .map(|c| (c.name.clone(), c.state()))
            .collect();
        assert_eq!(obs.chains, chains);
        assert_eq!(plan(spec, Some(&obs)), []);
    }

    #[test]
    fn an_applied_table_reads_back_as_desired_and_plans_nothing() {
        if !root_or_skip("an_applied_table_reads_back_as_desired_and_plans_nothing") {
            return;
        }
        in_new_netns(|| {
            let mut nft = Nft::new();
            assert_eq!(nft.observe().unwrap(), None);
            let report = nft.apply(&plan(&spec(), None));
            assert!(report.is_ok(), "{report:?}");
            assert!(report.warnings.is_empty(), "{report:?}");
            assert_holds(&mut nft, &spec());
        });
    }

    #[test]
    fn a_changed_spec_lands_in_one_transaction_and_reads_back_as_desired() {
        if !root_or_skip("a_changed_spec_lands_in_one_transaction_and_reads_back_as_desired") {
            return;
        }
        in_new_netns(|| {
            let mut nft = Nft::new();
            assert!(nft.apply(&plan(&spec(), None)).is_ok());
            let mut state = state();
            // A wider bypass overlapping old ranges, a new mark, a dropped
            // IPv6 source, a changed EIP, a masquerade that becomes SNAT,
            // another cluster prefix and another tunnel device name.
            state.classify[1].dst = net("203.0.112.0/23");
            state.classify[2].action = tunnel(0x0300_0000);
            state.classify.retain(|e| !e.src.is_ipv6());
            state.snat[0].to = SnatTo::Eip(ip("192.0.2.11"));
            state.snat[1].to = SnatTo::Eip(ip("192.0.2.12"));
            state.cluster_cidrs.push(net("10.245.0.0/16"));
            let mut cfg = Config::default();
            cfg.vxlan.name = "egw0".into();
            let desired = FirewallSpec::new(&state, &cfg);
            let ops = plan(&desired, Some(&observe_real(&mut nft)));
            let report = nft.apply(&ops);
            assert!(report.is_ok(), "{report:?}");
            assert!(report.warnings.is_empty(), "{report:?}");
            assert_holds(&mut nft, &desired);
            let listing = sh("nft list chain inet egressgw postrouting_mark");
            assert!(listing.contains("oifname \"egw0\""), "{listing}");
        });
    }

    #[test]
    fn a_bad_op_is_reported_while_the_others_land() {
        if !root_or_skip("a_bad_op_is_reported_while_the_others_land") {
            return;
        }
        in_new_netns(|| {
            let mut nft = Nft::new();
            let key = ElemKey {
                src: ip("10.244.1.9"),
                dst: IpRange::of_net(net("192.0.2.0/24")),
            };
            let bad = FwOp::Classify(ElemChange::Add, key, Verdict::Mark(0x0a00_0000));
            let mut ops = plan(&spec(), None);
            ops.insert(ops.len() / 2, bad.clone());
            let report = nft.apply(&ops);
            assert_eq!(report.failed.len(), 1, "{report:?}");
            assert_eq!(
                report.failed[0].op,
                "add element classify4 { 10.244.1.9 . 192.0.2.0/24 : jump mark_0a000000 }"
            );
            assert!(
                report.failed[0].error.contains("No such file or directory"),
                "{report:?}"
            );
            assert_eq!(report.applied.len(), ops.len() - 1);
            assert_eq!(report.warnings.len(), 1);
            assert_holds(&mut nft, &spec());
        });
    }

    #[test]
    fn remove_deletes_the_table_and_leaves_the_rest_of_the_ruleset() {
        if !root_or_skip("remove_deletes_the_table_and_leaves_the_rest_of_the_ruleset") {
            return;
        }
        in_new_netns(|| {
            sh("nft add table ip other && nft add chain ip other c");
            let before = sh("nft list ruleset");
            let mut nft = Nft::new();
            assert!(!nft.remove().unwrap());
            assert!(nft.apply(&plan(&spec(), None)).is_ok());
            assert!(nft.remove().unwrap());
            assert_eq!(sh("nft list ruleset"), before);
            assert_eq!(nft.observe().unwrap(), None);
        });
    }

    #[test]
    fn the_table_loads_beside_an_iptables_legacy_masquerade() {
        if !root_or_skip("the_table_loads_beside_an_iptables_legacy_masquerade") {
            return;
        }
        in_new_netns(|| {
            sh("iptables-legacy -t nat -A POSTROUTING -j MASQUERADE");
            let mut nft = Nft::new();
            let report = nft.apply(&plan(&spec(), None));
            assert!(report.is_ok(), "{report:?}");
            assert_holds(&mut nft, &spec());
            assert!(sh("nft list ruleset").contains("table inet egressgw"));
            assert!(sh("iptables-legacy -t nat -S POSTROUTING").contains("-j MASQUERADE"));
        });
    }
}

//! What the table should hold: [`FirewallSpec`], its chains, sets and
//! element types.

use super::*;

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

    pub(super) fn parse(chain: &str) -> Self {
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
pub(super) const FAIL_CLOSED: &str = "fail_closed";

pub(super) fn mark_chain(mark: u32) -> String {
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
    pub(super) fn regular(name: impl Into<String>, rules: Vec<String>) -> Self {
        Self {
            name: name.into(),
            hook: None,
            rules,
        }
    }

    pub(super) fn base(
        name: &str,
        kind: &str,
        hook: &str,
        priority: i32,
        rules: Vec<String>,
    ) -> Self {
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
    pub(super) fn render_add(&self) -> String {
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
pub(super) fn with_comment(rule: &str) -> String {
    format!("{rule} comment \"{}\"", fingerprint(rule))
}

/// FNV-1a (64 bit) of a rule's text, in hex: stable across Rust releases,
/// unlike `DefaultHasher`.
pub(super) fn fingerprint(rule: &str) -> String {
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
pub const SETS: [SetDecl; 10] = [
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
    SetDecl {
        kind: "map",
        name: "count4",
        body: "type ipv4_addr . ipv4_addr : counter; flags interval;",
    },
    SetDecl {
        kind: "map",
        name: "count6",
        body: "type ipv6_addr . ipv6_addr : counter; flags interval;",
    },
];

/// The name of `policy`'s counter object: `policy_` and a fingerprint of
/// `namespace/name` (object names are limited in length and characters;
/// [`FirewallSpec::counters`] maps them back).
pub fn counter_name(policy: &PolicyRef) -> String {
    format!("policy_{}", fingerprint(&policy.to_string()))
}

impl SetDecl {
    pub(super) fn render(&self) -> String {
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
    /// What classifies: this table, or the eBPF program with this table
    /// keeping the decisions per connection.
    pub datapath: Datapath,
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
    /// `count4` / `count6` elements: which policy's counter a selected
    /// packet counts in (the table classifies; empty beside the eBPF
    /// program, which counts itself).
    pub count: BTreeMap<ElemKey, String>,
    /// The counter objects, by name, with the policy each counts.
    pub counters: BTreeMap<String, PolicyRef>,
}

/// A disjoint range as an element key and its value.
pub(super) fn keyed<V>(r: crate::ranges::SrcRange<V>) -> (ElemKey, V) {
    (
        ElemKey {
            src: r.src,
            dst: r.dst,
        },
        r.value,
    )
}

/// The classifier's part of the table: how `prerouting` classifies, the
/// `classify4`/`classify6` elements, and what counts per policy. A
/// [`crate::classify::PodClassifier`] gives it; it lands in the table's one
/// transaction with SNAT and steering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classifying {
    /// Whose `prerouting` chain: the table's alone, or the one that takes
    /// the eBPF program's mark first.
    pub datapath: Datapath,
    /// `classify4` / `classify6` elements.
    pub classify: BTreeMap<ElemKey, Verdict>,
    /// `count4` / `count6` elements: which policy's counter a selected
    /// packet counts in.
    pub count: BTreeMap<ElemKey, String>,
    /// The counter objects, by name, with the policy each counts.
    pub counters: BTreeMap<String, PolicyRef>,
}

impl Classifying {
    /// The table classifies and counts `state`'s entries
    /// ([`Datapath::Nftables`]).
    pub fn by_table(state: &NodeState) -> Self {
        // Each selected source and destination counts in its policy's
        // counter, with the same precedence as classification: a bypass is
        // a hole here too.
        let count: BTreeMap<ElemKey, String> = disjoint(state.classify.iter().map(|e| {
            let counted = match e.action {
                Action::Bypass => None,
                Action::Tunnel { .. } | Action::Local | Action::Drop => {
                    e.policy.as_deref().map(counter_name)
                }
            };
            (e.src, e.dst, counted)
        }))
        .into_iter()
        .map(keyed)
        .collect();
        let used: BTreeSet<&String> = count.values().collect();
        let counters = state
            .classify
            .iter()
            .filter(|e| e.action != Action::Bypass)
            .filter_map(|e| e.policy.as_deref())
            .map(|p| (counter_name(p), p))
            .filter(|(name, _)| used.contains(name))
            .map(|(name, p)| (name, p.clone()))
            .collect();
        Self {
            datapath: Datapath::Nftables,
            classify: classify_elements(state),
            count,
            counters,
        }
    }

    /// Beside the eBPF program ([`Datapath::Ebpf`]): the table keeps
    /// `state`'s classification as a backstop for an interface the program
    /// is not on yet, and counts nothing (the program counts).
    pub fn beside_program(state: &NodeState) -> Self {
        Self {
            datapath: Datapath::Ebpf,
            classify: classify_elements(state),
            count: BTreeMap::new(),
            counters: BTreeMap::new(),
        }
    }

    /// The part `datapath`'s classifier gives for `state`.
    pub fn for_datapath(state: &NodeState, datapath: Datapath) -> Self {
        match datapath {
            Datapath::Nftables => Self::by_table(state),
            Datapath::Ebpf => Self::beside_program(state),
        }
    }
}

/// `state`'s classification entries as `classify4`/`classify6` elements:
/// disjoint, the most specific entry deciding, a bypass a hole.
fn classify_elements(state: &NodeState) -> BTreeMap<ElemKey, Verdict> {
    disjoint(state.classify.iter().map(|e| {
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
    .collect()
}

impl FirewallSpec {
    /// The table `state` needs when the table classifies
    /// ([`Datapath::Nftables`]).
    pub fn new(state: &NodeState, cfg: &Config) -> Self {
        Self::with(state, cfg, Classifying::by_table(state))
    }

    /// The table `state` needs beside `datapath`'s classifier.
    pub fn for_datapath(state: &NodeState, cfg: &Config, datapath: Datapath) -> Self {
        Self::with(state, cfg, Classifying::for_datapath(state, datapath))
    }

    /// The table `state` needs, with `classifying` as the classifier's
    /// part. The tunnel device is `state.vxlan`'s, or the configured name
    /// while the node has none.
    pub fn with(state: &NodeState, cfg: &Config, classifying: Classifying) -> Self {
        let Classifying {
            datapath,
            classify,
            count,
            counters,
        } = classifying;
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
            datapath,
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
            count,
            counters,
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
        let prerouting = match self.datapath {
            Datapath::Nftables => vec![
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
                // Every selected packet, of a new connection or not, counts
                // in its policy's counter (a bypass has no element).
                "counter name ip saddr . ip daddr map @count4".into(),
                "counter name ip6 saddr . ip6 daddr map @count6".into(),
                "ip saddr . ip daddr vmap @classify4".into(),
                "ip6 saddr . ip6 daddr vmap @classify6".into(),
            ],
            // The program marked the packet (or not) before this hook. What
            // needs the connection stays here: replies, a decision that
            // sticks, failing closed; and the maps stay as a backstop for
            // an interface the program is not attached to yet (a pod's
            // veth that was just created), so that no selected packet
            // leaves unclassified.
            Datapath::Ebpf => {
                let clear = format!("meta mark set meta mark & {keep:#010x}");
                vec![
                    format!(
                        "iifname \"{vx}\" ct state new ct mark set ct mark & {keep:#010x} | {reply:#010x}"
                    ),
                    format!(
                        "ct direction reply ct mark & {mask:#010x} == {reply:#010x} \
                         meta mark set meta mark & {keep:#010x} | {reply:#010x} return"
                    ),
                    // A pod's replies to connections that came in leave the
                    // way they came, whatever the program marked.
                    format!("ct direction reply {clear} return"),
                    // A connection that started before its pod was selected
                    // keeps its path.
                    format!("ct state != new ct mark & {mask:#010x} == 0 {clear} return"),
                    format!("ct state != new ct mark & {mask:#010x} == {reply:#010x} return"),
                    // The program's decision sticks to the connection, and
                    // nothing else is looked at.
                    format!(
                        "meta mark & {mask:#010x} vmap {{ {} }}",
                        restore.replace(": jump ", ": goto ")
                    ),
                    // Unmarked: as on the nftables datapath.
                    format!("ct state != new ct mark & {mask:#010x} vmap {{ {restore} }}"),
                    "ip daddr @cluster4 return".into(),
                    "ip6 daddr @cluster6 return".into(),
                    "ip saddr . ip daddr vmap @classify4".into(),
                    "ip6 saddr . ip6 daddr vmap @classify6".into(),
                ]
            }
        };
        chains.push(Chain::base(
            "prerouting",
            "filter",
            "prerouting",
            PRIO_MANGLE,
            prerouting,
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

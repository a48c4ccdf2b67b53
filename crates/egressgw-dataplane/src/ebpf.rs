//! The eBPF classifier (`bpf/egressgw-ebpf`): loaded from the object built
//! into this binary, attached on TC ingress of the interfaces pod traffic
//! enters a node by, filled from the planner's classification entries, and
//! read back for its per-policy counters. The map layout is
//! `egressgw-common`'s.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aya::maps::lpm_trie::Key;
use aya::maps::{HashMap as AyaHashMap, LpmTrie, MapData, PerCpuArray};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{self, SchedClassifierLink, SchedClassifierLinkId};
use aya::programs::{SchedClassifier, TcAttachType, TestRun, TestRunOptions};
use aya::util::KernelVersion;
use egressgw_common as common;
use egressgw_common::{
    Counter, Dst4, Dst6, Flow4, Flow6, Handshake4, Handshake6, Key4, Key6, Nat4, Nat6, Pending4,
    Pending6, PodLink, Tunnel, Underlay, Verdict,
};
use egressgw_core::model::{Config, PolicyRef};
use egressgw_core::state::{Action, NodeState};
use ipnet::IpNet;

use crate::ops::{Op, OpKind};

mod gateway;

pub use gateway::Learning;

/// The object built into this binary, if it was built with one.
pub fn object() -> Option<&'static [u8]> {
    #[cfg(egressgw_ebpf)]
    {
        Some(aya::include_bytes_aligned!(concat!(
            env!("OUT_DIR"),
            "/egressgw-ebpf"
        )))
    }
    #[cfg(not(egressgw_ebpf))]
    {
        None
    }
}

/// What went wrong with the eBPF classifier, naming the object concerned.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// This binary carries no program.
    #[error(
        "this build of egressgw carries no eBPF program (it was built without the eBPF toolchain or with AYA_BUILD_SKIP=1)"
    )]
    NotBuilt,
    /// A step failed.
    #[error("{what}: {message}")]
    Failed {
        /// The step and its object.
        what: String,
        /// What aya or the kernel said.
        message: String,
    },
}

impl crate::ops::Failed for EbpfError {
    fn message(&self) -> String {
        self.to_string()
    }
}

fn failed(what: impl Into<String>) -> impl FnOnce(String) -> EbpfError {
    let what = what.into();
    move |message| EbpfError::Failed { what, message }
}

/// Where the agent pins the classifier's maps and attachments.
pub const PIN_DIR: &str = "/sys/fs/bpf/egressgw";

/// Every map of the programs, by name.
const MAPS: [&str; 20] = [
    common::CLASSIFY4,
    common::CLASSIFY6,
    common::CLUSTER4,
    common::CLUSTER6,
    common::COUNTERS,
    common::TUNNELS,
    common::FLOWS4,
    common::FLOWS6,
    common::NAT_OUT4,
    common::NAT_IN4,
    common::NAT_OUT6,
    common::NAT_IN6,
    common::PENDING4,
    common::PENDING6,
    common::LEARNED,
    common::EIPS,
    common::SWITCHES,
    common::UNDERLAY,
    common::PEERS,
    common::TUNNEL_END,
];

/// A map's shape as this build's program declares it: key and value size
/// in bytes, and how many entries it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    key: u32,
    value: u32,
    max_entries: u32,
}

/// The shape this build's program expects of map `name`.
fn shape(name: &str) -> Option<Shape> {
    fn size<T>() -> u32 {
        u32::try_from(size_of::<T>()).unwrap_or(u32::MAX)
    }
    let (key, value, max_entries) = match name {
        common::CLASSIFY4 => (size::<Key<Key4>>(), size::<Verdict>(), common::CLASSIFY_MAX),
        common::CLASSIFY6 => (size::<Key<Key6>>(), size::<Verdict>(), common::CLASSIFY_MAX),
        common::CLUSTER4 => (size::<Key<Dst4>>(), size::<u32>(), common::CLUSTER_MAX),
        common::CLUSTER6 => (size::<Key<Dst6>>(), size::<u32>(), common::CLUSTER_MAX),
        common::COUNTERS => (size::<u32>(), size::<Counter>(), common::COUNTERS_MAX),
        common::TUNNELS => (size::<u32>(), size::<Tunnel>(), common::TUNNELS_MAX),
        common::FLOWS4 => (size::<Flow4>(), size::<PodLink>(), common::FLOWS_MAX),
        common::FLOWS6 => (size::<Flow6>(), size::<PodLink>(), common::FLOWS_MAX),
        common::NAT_OUT4 | common::NAT_IN4 => (size::<Flow4>(), size::<Nat4>(), common::NAT_MAX),
        common::NAT_OUT6 | common::NAT_IN6 => (size::<Flow6>(), size::<Nat6>(), common::NAT_MAX),
        common::PENDING4 => (
            size::<Handshake4>(),
            size::<Pending4>(),
            common::PENDING_MAX,
        ),
        common::PENDING6 => (
            size::<Handshake6>(),
            size::<Pending6>(),
            common::PENDING_MAX,
        ),
        common::LEARNED => (0, 0, common::LEARNED_BYTES),
        common::EIPS => (size::<[u8; 16]>(), size::<u32>(), common::EIPS_MAX),
        common::SWITCHES => (size::<u32>(), size::<u32>(), common::SWITCHES_MAX),
        common::UNDERLAY => (size::<u32>(), size::<Underlay>(), 1),
        common::PEERS => (size::<[u8; 16]>(), size::<u32>(), common::PEERS_MAX),
        common::TUNNEL_END => (size::<u32>(), size::<Counter>(), common::tunnel_end::SLOTS),
        _ => return None,
    };
    Some(Shape {
        key,
        value,
        max_entries,
    })
}

/// Unpins the maps in `dir` whose shape is not the one this build's
/// program declares (an agent of another version pinned them): adopting
/// one would fail the program's load. The program still attached keeps
/// its map until it is swapped; the new map starts empty and is filled by
/// the next sync. Returns the names of the maps replaced.
fn unpin_reshaped(dir: &Path) -> Result<Vec<&'static str>, EbpfError> {
    let mut replaced = Vec::new();
    for name in MAPS {
        let pin = dir.join(name);
        if !pin.exists() {
            continue;
        }
        let wanted = shape(name);
        let found = aya::maps::MapInfo::from_pin(&pin).ok().map(|info| Shape {
            key: info.key_size(),
            value: info.value_size(),
            max_entries: info.max_entries(),
        });
        if found.is_none() || found != wanted {
            std::fs::remove_file(&pin)
                .map_err(|e| e.to_string())
                .map_err(failed(format!(
                    "removing the map pinned at {} (its shape is {found:?}, this build's {wanted:?})",
                    pin.display()
                )))?;
            replaced.push(name);
        }
    }
    Ok(replaced)
}

/// Which program an attachment runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    /// `egressgw_classify`, on the interfaces pod traffic enters by.
    Classify,
    /// `egressgw_reply`, on the tunnel device.
    Reply,
    /// `egressgw_nat_in`, on a gateway node's external interfaces' ingress.
    NatIn,
    /// `egressgw_learn`, on their egress.
    Learn,
    /// `egressgw_underlay`, on the tunnel's underlay interface's ingress.
    Underlay,
}

impl Role {
    const ALL: [Role; 5] = [
        Role::Classify,
        Role::Reply,
        Role::NatIn,
        Role::Learn,
        Role::Underlay,
    ];

    fn program(self) -> &'static str {
        match self {
            Role::Classify => common::PROGRAM,
            Role::Reply => common::REPLY_PROGRAM,
            Role::NatIn => common::NAT_IN_PROGRAM,
            Role::Learn => common::LEARN_PROGRAM,
            Role::Underlay => common::UNDERLAY_PROGRAM,
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Role::Learn => TcAttachType::Egress,
            _ => TcAttachType::Ingress,
        }
    }

    /// The start of the names of its pinned attachments.
    fn pin_prefix(self) -> &'static str {
        match self {
            Role::Classify => "link-ingress-",
            Role::Reply => "reply-ingress-",
            Role::NatIn => "nat-ingress-",
            Role::Learn => "learn-egress-",
            Role::Underlay => "underlay-ingress-",
        }
    }

    fn describe(self, iface: &str) -> String {
        match self {
            Role::Classify => format!("the eBPF classifier on {iface}"),
            Role::Reply => format!("the eBPF reply path on {iface}"),
            Role::NatIn => format!("the gateway's eBPF fast path on {iface}'s ingress"),
            Role::Learn => format!("the gateway's eBPF learner on {iface}'s egress"),
            Role::Underlay => format!("the eBPF tunnel end on {iface}"),
        }
    }
}

/// Where a pinned attachment of `role` to `iface` (index `ifindex`) lives
/// in the pin directory. The index is part of the name: an interface
/// deleted and created again under the same name (a pod's veth after a
/// sandbox restart) is a new interface, and the old attachment is dead.
/// A bpf filesystem refuses names with a dot; interface names never hold a
/// colon, so a dot is written as one.
fn link_pin(dir: &Path, role: Role, iface: &str, ifindex: u32) -> PathBuf {
    let name = iface.replace('.', ":");
    dir.join(format!("{}{ifindex}-{name}", role.pin_prefix()))
}

/// The attachments of `role` pinned in `dir`: (interface, index) -> pin.
fn pinned_links(dir: &Path, role: Role) -> BTreeMap<(String, u32), PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let (index, iface) = name.strip_prefix(role.pin_prefix())?.split_once('-')?;
            Some(((iface.replace(':', "."), index.parse().ok()?), entry.path()))
        })
        .collect()
}

/// The MTU of interface `iface` now, if it exists.
fn device_mtu(iface: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// An EIP as the gateway's EIPs map holds it.
fn eip_key(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => common::eip_key4(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The index of interface `iface` now, if it exists.
fn ifindex(iface: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(iface).ok()
}

/// A policy, shared by its entries.
pub type SharedPolicy = Arc<PolicyRef>;

/// The classifier's maps as a node's state asks for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// (source, destination) -> what to do, and the policy that counts it
    /// (shared by the policy's entries: at 100 000 entries a copy each
    /// would cost megabytes).
    pub classify: BTreeMap<(IpAddr, IpNet), (Verdict, Option<SharedPolicy>)>,
    /// In-cluster destinations.
    pub cluster: BTreeSet<IpNet>,
    /// The tunnel device, for the fast path; `None` while the node has none.
    pub tunnel: Option<String>,
    /// Per tunnel mark, the fast path's MACs: the tunnel device's and the
    /// gateway node's. Empty when the fast path is off (`ebpf.fastPath`):
    /// then every packet takes the marked way.
    pub tunnels: BTreeMap<u32, ([u8; 6], [u8; 6])>,
    /// The EIPs this node holds, when the fast path is on: the gateway's
    /// fast path takes over connections that leave with one of them.
    /// Empty: it is off.
    pub eips: BTreeSet<IpAddr>,
    /// The tunnel as the node receives it, when the fast path is on:
    /// fast-path connections' packets are taken out of it on the underlay
    /// interface. `None`: the device does it all.
    pub underlay: Option<Underlay>,
    /// The other nodes' underlay addresses, while `underlay` is on: the
    /// only sources it takes frames from.
    pub peers: BTreeSet<IpAddr>,
}

impl Desired {
    /// What `state` asks of the classifier under `cfg`'s marks. The
    /// verdicts' counters are left at 0: [`Classifier::sync`] gives each
    /// policy its own.
    pub fn new(state: &NodeState, cfg: &Config) -> Self {
        let classify = state
            .classify
            .iter()
            .map(|e| {
                let (kind, mark) = match &e.action {
                    Action::Bypass => (common::kind::LEAVE, 0),
                    Action::Tunnel { mark, .. } => (common::kind::MARK, *mark),
                    Action::Local => (common::kind::MARK, cfg.local_mark()),
                    // Failing closed is decided in nftables, which knows a
                    // connection's direction: a pod's replies to a
                    // connection that came in from the destination still
                    // leave. Here the range only has to be held against a
                    // wider entry that marks.
                    Action::Drop => (common::kind::LEAVE, 0),
                };
                let verdict = Verdict {
                    kind,
                    mark,
                    mask: cfg.mark_mask,
                    counter: 0,
                };
                ((e.src, e.dst.trunc()), (verdict, e.policy.clone()))
            })
            .collect();
        let mut tunnels = BTreeMap::new();
        if let Some(vxlan) = state.vxlan.as_ref().filter(|_| cfg.ebpf_fast_path) {
            for e in &state.classify {
                if let Action::Tunnel { gateway, mark } = &e.action
                    && let Some(peer) = state.peers.iter().find(|p| p.node == *gateway)
                {
                    tunnels.insert(*mark, (vxlan.mac.0, peer.mac.0));
                }
            }
        }
        Desired {
            classify,
            cluster: state.cluster_cidrs.iter().map(IpNet::trunc).collect(),
            tunnel: state.vxlan.as_ref().map(|v| v.name.clone()),
            tunnels,
            eips: if cfg.ebpf_fast_path && state.vxlan.is_some() {
                state.eips.iter().map(|e| e.ip).collect()
            } else {
                BTreeSet::new()
            },
            underlay: state
                .vxlan
                .as_ref()
                .filter(|_| cfg.ebpf_fast_path)
                .map(|v| {
                    let [_, a, b, c] = v.vni.to_be_bytes();
                    let mut addr = [0u8; 16];
                    let on = match v.local {
                        IpAddr::V4(local) => {
                            addr[..4].copy_from_slice(&local.octets());
                            4
                        }
                        IpAddr::V6(local) => {
                            addr = local.octets();
                            6
                        }
                    };
                    Underlay {
                        addr,
                        port: v.port.to_be_bytes(),
                        mac: v.mac.0,
                        vni: [a, b, c, 0],
                        on,
                    }
                }),
            peers: if cfg.ebpf_fast_path && state.vxlan.is_some() {
                state.peers.iter().map(|p| p.underlay).collect()
            } else {
                BTreeSet::new()
            },
        }
    }
}

/// What a [`Classifier::sync`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Synced {
    pub added: usize,
    pub changed: usize,
    pub removed: usize,
}

impl Synced {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        *self == Synced::default()
    }
}

/// A hash map of addresses (IPv6, or IPv4 mapped) -> unused, as a set:
/// the gateway's EIPs, the tunnel's end's peers.
struct AddressSet<'a> {
    map: AyaHashMap<&'a mut MapData, [u8; 16], u32>,
    /// Its keys when opened.
    present: BTreeSet<[u8; 16]>,
    what: &'static str,
}

impl<'a> AddressSet<'a> {
    fn open(ebpf: &'a mut aya::Ebpf, name: &str, what: &'static str) -> Result<Self, EbpfError> {
        let map: AyaHashMap<_, [u8; 16], u32> = AyaHashMap::try_from(
            ebpf.map_mut(name)
                .ok_or_else(|| failed(what)("the object has no such map".into()))?,
        )
        .map_err(|e| e.to_string())
        .map_err(failed(what))?;
        let present = map.keys().flatten().collect();
        Ok(Self { map, present, what })
    }

    /// Removes the keys not in `wanted`.
    fn remove_all_but(
        &mut self,
        wanted: &BTreeSet<[u8; 16]>,
        synced: &mut Synced,
    ) -> Result<(), EbpfError> {
        for key in self.present.difference(wanted) {
            self.map
                .remove(key)
                .map_err(|e| e.to_string())
                .map_err(failed(self.what))?;
            synced.removed += 1;
        }
        Ok(())
    }

    /// Adds the keys of `wanted` it did not have.
    fn add(&mut self, wanted: &BTreeSet<[u8; 16]>, synced: &mut Synced) -> Result<(), EbpfError> {
        for key in wanted.difference(&self.present) {
            self.map
                .insert(key, 0, 0)
                .map_err(|e| e.to_string())
                .map_err(failed(self.what))?;
            synced.added += 1;
        }
        Ok(())
    }
}

/// One attachment of the program.
#[derive(Debug, PartialEq, Eq)]
struct Attached {
    /// The interface's index when the program was attached.
    ifindex: u32,
    /// The attachment this process manages (it ends with it), or `None`
    /// for a pinned one.
    link: Option<SchedClassifierLinkId>,
}

/// What the classification and in-cluster maps hold, as the last sync left
/// them: the next sync compares with this instead of reading every entry
/// back (at 100 000 entries the read-back is most of a sync's time).
#[derive(Debug, Default)]
struct Known {
    classify: Entries,
    cluster: BTreeSet<IpNet>,
    /// Syncs since the maps were last read back.
    syncs: u32,
}

/// An IPv4 entry's key as the trie holds it: source, destination network,
/// destination prefix length.
type Key4Parts = ([u8; 4], [u8; 4], u8);
/// An IPv6 entry's.
type Key6Parts = ([u8; 16], [u8; 16], u8);

/// Classification entries and their verdicts, each family in a vector
/// sorted by key: at 100 000 entries a third of what a map keyed by
/// `(IpAddr, IpNet)` costs, since every IPv4 entry would pay for an IPv6
/// key there.
#[derive(Debug, Default)]
struct Entries {
    v4: Vec<(Key4Parts, Verdict)>,
    v6: Vec<(Key6Parts, Verdict)>,
}

impl Entries {
    fn get(&self, src: IpAddr, dst: IpNet) -> Option<&Verdict> {
        fn find<'a, K: Ord>(v: &'a [(K, Verdict)], key: &K) -> Option<&'a Verdict> {
            let at = v.binary_search_by(|(k, _)| k.cmp(key)).ok()?;
            v.get(at).map(|(_, verdict)| verdict)
        }
        match (src, dst) {
            (IpAddr::V4(s), IpNet::V4(d)) => find(
                &self.v4,
                &(s.octets(), d.network().octets(), d.prefix_len()),
            ),
            (IpAddr::V6(s), IpNet::V6(d)) => find(
                &self.v6,
                &(s.octets(), d.network().octets(), d.prefix_len()),
            ),
            _ => None,
        }
    }

    /// Adds an entry; [`Entries::sort`] before the next `get`.
    fn push(&mut self, src: IpAddr, dst: IpNet, verdict: Verdict) {
        match (src, dst) {
            (IpAddr::V4(s), IpNet::V4(d)) => self
                .v4
                .push(((s.octets(), d.network().octets(), d.prefix_len()), verdict)),
            (IpAddr::V6(s), IpNet::V6(d)) => self
                .v6
                .push(((s.octets(), d.network().octets(), d.prefix_len()), verdict)),
            _ => {}
        }
    }

    fn sort(&mut self) {
        self.v4.sort_unstable_by_key(|(key, _)| *key);
        self.v6.sort_unstable_by_key(|(key, _)| *key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    /// Every entry's (source, destination).
    fn keys(&self) -> impl Iterator<Item = (IpAddr, IpNet)> + '_ {
        let v4 = self.v4.iter().filter_map(|((s, d, len), _)| {
            let dst = ipnet::Ipv4Net::new((*d).into(), *len).ok()?;
            Some((IpAddr::from(*s), IpNet::V4(dst)))
        });
        let v6 = self.v6.iter().filter_map(|((s, d, len), _)| {
            let dst = ipnet::Ipv6Net::new((*d).into(), *len).ok()?;
            Some((IpAddr::from(*s), IpNet::V6(dst)))
        });
        v4.chain(v6)
    }
}

/// A sync reads the maps back at least every this many syncs (and always
/// the first time, and after a failure or a change made outside a sync),
/// so that a change it did not make is undone within that many.
const READ_BACK_EVERY: u32 = 20;

/// The loaded classifier and where it is attached.
#[derive(Debug)]
pub struct Classifier {
    ebpf: aya::Ebpf,
    /// Where the programs are attached, by program and interface.
    attached: BTreeMap<(Role, String), Attached>,
    /// Each policy's counter.
    counters: BTreeMap<PolicyRef, u32>,
    /// Where maps and attachments are pinned, if they are.
    pins: Option<PathBuf>,
    /// The maps' entries as the last sync left them; `None`: read them.
    known: Option<Known>,
    /// The gateway's fast path: the learner and the NAT maps; `None` where
    /// it could not start (the node then leaves every connection to the
    /// stack).
    gateway: Option<(gateway::Learner, gateway::NatMaps)>,
    /// The gateway switch as the last sync wrote it.
    learning: Option<bool>,
    /// The tunnel's end as the last sync wrote it, while it is on.
    underlay: Option<Underlay>,
}

impl Classifier {
    /// Loads the program and creates its maps (empty); everything goes
    /// away with this value.
    pub fn load() -> Result<Self, EbpfError> {
        Self::load_with(aya::EbpfLoader::new(), None)
    }

    /// Loads the program with its maps pinned in `dir` (on a bpf
    /// filesystem, e.g. `/sys/fs/bpf/egressgw`): maps already pinned there
    /// are adopted with their entries and counters, so a restarted agent
    /// finds the state its predecessor left, and [`Self::attach`] pins its
    /// attachments there too, so that traffic keeps being classified
    /// between two agents.
    pub fn load_pinned(dir: &Path) -> Result<Self, EbpfError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| e.to_string())
            .map_err(failed(format!(
                "creating the pin directory {}",
                dir.display()
            )))?;
        for name in unpin_reshaped(dir)? {
            tracing::info!(map = name, dir = %dir.display(), "a pinned map of another shape was replaced");
        }
        let mut loader = aya::EbpfLoader::new();
        for name in MAPS {
            loader.map_pin_path(name, dir.join(name));
        }
        Self::load_with(loader, Some(dir.to_owned()))
    }

    /// [`Self::load_pinned`] for an agent: first checks that `dir` is on a
    /// bpf filesystem, so that a missing mount is named as such (without
    /// one, pins would be impossible, or lost on the agent's restart).
    pub fn open(dir: &Path) -> Result<Self, EbpfError> {
        object().ok_or(EbpfError::NotBuilt)?;
        let on_bpffs = |p: &Path| {
            nix::sys::statfs::statfs(p)
                .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
        };
        let mount = if dir.exists() {
            dir
        } else {
            dir.parent().unwrap_or(dir)
        };
        if !on_bpffs(mount) {
            return Err(failed(format!("pinning in {}", dir.display()))(format!(
                "{} is not on a bpf filesystem (mount one there: \
                 `mount -t bpf bpf /sys/fs/bpf`; the Helm chart mounts the host's)",
                mount.display()
            )));
        }
        Self::load_pinned(dir)
    }

    fn load_with(
        mut loader: aya::EbpfLoader<'_>,
        pins: Option<PathBuf>,
    ) -> Result<Self, EbpfError> {
        let object = object().ok_or(EbpfError::NotBuilt)?;
        let mut ebpf = loader
            .load(object)
            .map_err(|e| e.to_string())
            .map_err(failed("loading the eBPF object"))?;
        for role in Role::ALL {
            program(&mut ebpf, role)?
                .load()
                .map_err(|e| format!("{e:#}"))
                .map_err(failed(format!("loading the program {}", role.program())))?;
        }
        let gateway = match gateway::Learner::start(&mut ebpf)
            .and_then(|learner| Ok((learner, gateway::NatMaps::open(&ebpf)?)))
        {
            Ok(both) => Some(both),
            Err(e) => {
                tracing::warn!(error = %e, "the gateway's eBPF fast path is off");
                None
            }
        };
        Ok(Classifier {
            ebpf,
            attached: BTreeMap::new(),
            counters: BTreeMap::new(),
            pins,
            known: None,
            gateway,
            learning: None,
            underlay: None,
        })
    }

    /// Attaches the classifier on TC ingress of `iface` (TCX where the
    /// kernel has it, clsact otherwise) and returns whether the interface
    /// was without it: attaching twice does nothing, taking a pinned
    /// attachment over is no change to the interface, and an interface
    /// that was deleted and created again under its name gets a new
    /// attachment. Loaded with pins on a kernel with TCX, the attachment is
    /// pinned, and one that an earlier agent pinned is taken over in place:
    /// the kernel swaps the program atomically, with no moment
    /// unclassified.
    pub fn attach(&mut self, iface: &str) -> Result<bool, EbpfError> {
        self.attach_as(Role::Classify, iface)
    }

    /// Detaches the classifier from `iface`, pinned or not.
    pub fn detach(&mut self, iface: &str) -> Result<(), EbpfError> {
        self.detach_as(Role::Classify, iface)
    }

    fn attach_as(&mut self, role: Role, iface: &str) -> Result<bool, EbpfError> {
        let what = format!("attaching {}", role.describe(iface));
        let index =
            ifindex(iface).ok_or_else(|| failed(what.clone())("no such interface".into()))?;
        let key = (role, iface.to_owned());
        match self.attached.get(&key) {
            Some(a) if a.ifindex == index => return Ok(false),
            Some(_) => self.detach_as(role, iface)?,
            None => {}
        }
        let tcx = KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        if let (Some(dir), true) = (&self.pins, tcx) {
            let pin = link_pin(dir, role, iface, index);
            // Attachments pinned for an earlier interface of this name are
            // dead: they go.
            for ((name, i), stale) in pinned_links(dir, role) {
                if name == iface && i != index {
                    unpin_link(&stale)?;
                }
            }
            let prog = program(&mut self.ebpf, role)?;
            let taken_over = pin.exists();
            if taken_over {
                let old = PinnedLink::from_pin(&pin)
                    .map_err(|e| e.to_string())
                    .map_err(failed(format!("{what}: reading {}", pin.display())))?;
                let link = SchedClassifierLink::try_from(FdLink::from(old))
                    .map_err(|e| e.to_string())
                    .map_err(failed(format!("{what}: {}", pin.display())))?;
                // The pin stays and now leads to this program.
                let id = prog
                    .attach_to_link(link)
                    .map_err(|e| format!("{e:#}"))
                    .map_err(failed(what.clone()))?;
                drop(prog.take_link(id));
            } else {
                let id = prog
                    .attach(iface, role.attach_type())
                    .map_err(|e| format!("{e:#}"))
                    .map_err(failed(what.clone()))?;
                let link = prog
                    .take_link(id)
                    .map_err(|e| format!("{e:#}"))
                    .map_err(failed(what.clone()))?;
                FdLink::try_from(link)
                    .map_err(|e| e.to_string())
                    .map_err(failed(what.clone()))?
                    .pin(&pin)
                    .map_err(|e| e.to_string())
                    .map_err(failed(format!("{what}: pinning at {}", pin.display())))?;
            }
            let attached = Attached {
                ifindex: index,
                link: None,
            };
            self.attached.insert(key, attached);
            return Ok(!taken_over);
        }
        if !tcx {
            // An existing clsact qdisc is fine.
            let _ = tc::qdisc_add_clsact(iface);
        }
        let id = program(&mut self.ebpf, role)?
            .attach(iface, role.attach_type())
            .map_err(|e| format!("{e:#}"))
            .map_err(failed(what))?;
        let attached = Attached {
            ifindex: index,
            link: Some(id),
        };
        self.attached.insert(key, attached);
        Ok(true)
    }

    /// Detaches `role`'s program from `iface`, pinned or not. An interface
    /// that is gone took its attachment with it; only the pin is left to
    /// remove.
    fn detach_as(&mut self, role: Role, iface: &str) -> Result<(), EbpfError> {
        if let Some(dir) = &self.pins {
            for ((name, _), pin) in pinned_links(dir, role) {
                if name == iface {
                    unpin_link(&pin)?;
                }
            }
        }
        let Some(Attached {
            ifindex: index,
            link: Some(id),
        }) = self.attached.remove(&(role, iface.to_owned()))
        else {
            return Ok(());
        };
        let result = program(&mut self.ebpf, role)?.detach(id);
        if ifindex(iface) != Some(index) {
            return Ok(());
        }
        result
            .map_err(|e| format!("{e:#}"))
            .map_err(failed(format!("detaching {}", role.describe(iface))))
    }

    /// Makes the classifier attached to exactly the interfaces in `pods`,
    /// the reply path to `tunnel` (the tunnel device, when it exists), and
    /// the gateway's fast path to `external` (a gateway node's interfaces
    /// on its EIPs' segments): attaches where it is missing (or the interface is a new one under an
    /// old name) and detaches where it is no longer wanted, including
    /// attachments a predecessor pinned for interfaces now gone. Returns
    /// each change made or tried.
    pub fn follow(
        &mut self,
        pods: &BTreeSet<String>,
        tunnel: Option<&str>,
        external: &BTreeSet<String>,
        underlay: Option<&str>,
    ) -> Vec<(Op, Result<(), EbpfError>)> {
        let tunnel: BTreeSet<String> = tunnel.into_iter().map(str::to_owned).collect();
        let underlay: BTreeSet<String> = underlay.into_iter().map(str::to_owned).collect();
        let mut done = self.follow_as(Role::Classify, pods);
        done.extend(self.follow_as(Role::Reply, &tunnel));
        done.extend(self.follow_as(Role::NatIn, external));
        done.extend(self.follow_as(Role::Learn, external));
        done.extend(self.follow_as(Role::Underlay, &underlay));
        done
    }

    /// The interfaces `role` is on now: attached by this agent, or pinned
    /// by a predecessor.
    fn on(&self, role: Role) -> BTreeSet<String> {
        let mut present: BTreeSet<String> = self
            .attached
            .keys()
            .filter(|(r, _)| *r == role)
            .map(|(_, iface)| iface.clone())
            .collect();
        if let Some(dir) = &self.pins {
            present.extend(pinned_links(dir, role).into_keys().map(|(iface, _)| iface));
        }
        present
    }

    /// The interface the tunnel's end is on now, if any.
    pub fn underlay_now(&self) -> Option<String> {
        self.on(Role::Underlay).into_iter().next()
    }

    fn follow_as(
        &mut self,
        role: Role,
        wanted: &BTreeSet<String>,
    ) -> Vec<(Op, Result<(), EbpfError>)> {
        let mut done = Vec::new();
        let present = self.on(role);
        for iface in present.difference(wanted) {
            let result = self.detach_as(role, iface);
            let op = Op::new(
                OpKind::Program,
                iface.clone(),
                format!("detach {}", role.describe(iface)),
            );
            done.push((op, result));
        }
        for iface in wanted {
            let op = Op::new(
                OpKind::Program,
                iface.clone(),
                format!("attach {}", role.describe(iface)),
            );
            match self.attach_as(role, iface) {
                Ok(false) => {}
                Ok(true) => done.push((op, Ok(()))),
                Err(e) => done.push((op, Err(e))),
            }
        }
        done
    }

    /// Removes everything pinned in `dir`: detaches every pinned
    /// attachment, then drops every pinned map (so that no program is left
    /// running on maps nobody can reach), then the directory. Returns
    /// whether there was anything; what is not there is no error.
    ///
    /// Only files are removed, no `bpf()` call is made: an agent on the
    /// nftables datapath runs without `CAP_BPF` and `CAP_SYS_ADMIN`, and a
    /// container runtime's default seccomp profile refuses `bpf()` to such
    /// a process. Removing an attachment's pin drops its last reference
    /// once the agent that made it is gone, and the kernel detaches it.
    pub fn remove_pins(dir: &Path) -> Result<bool, EbpfError> {
        let entries: Vec<(PathBuf, bool)> = match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .flatten()
                .map(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let link = Role::ALL.iter().any(|r| name.starts_with(r.pin_prefix()));
                    (entry.path(), link)
                })
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(failed(format!("reading {}", dir.display()))(e.to_string())),
        };
        let (links, maps): (Vec<_>, Vec<_>) = entries.into_iter().partition(|(_, link)| *link);
        for (path, _) in links.iter().chain(&maps) {
            std::fs::remove_file(path)
                .map_err(|e| e.to_string())
                .map_err(failed(format!("removing {}", path.display())))?;
        }
        std::fs::remove_dir(dir)
            .map(|()| true)
            .map_err(|e| e.to_string())
            .map_err(failed(format!("removing {}", dir.display())))
    }

    /// Makes the maps hold `desired`, changing only the entries that
    /// differ: a second sync with the same state changes nothing, and one
    /// pod added touches only its entries. Each policy keeps its counter
    /// for as long as it has entries; after a restart it takes the
    /// counter its entries already carry, so counts go on where they were.
    /// It compares with what the last sync wrote, and reads the maps back
    /// the first time, after a failure or a change made outside a sync, and
    /// every [`READ_BACK_EVERY`] syncs, undoing changes it did not make.
    pub fn sync(&mut self, desired: &Desired) -> Result<Synced, EbpfError> {
        let mut synced = Synced::default();
        // First, and whatever fails after it: an EIP the node gave up is
        // not translated to a moment longer.
        self.sync_gateway(desired, &mut synced)?;
        // Taken: a failure on the way leaves none, and the next sync reads
        // the maps back.
        let mut known = match self.known.take() {
            Some(known) if known.syncs < READ_BACK_EVERY => known,
            _ => Known {
                classify: self.entries()?,
                cluster: self.cluster()?,
                syncs: 0,
            },
        };
        for index in self.assign_counters(desired, &known.classify) {
            self.zero_counter(index)?;
        }
        // What the maps hold after this sync, built as it goes.
        let mut next = Entries::default();
        let v4 = desired.classify.keys().filter(|(s, _)| s.is_ipv4()).count();
        next.v4.reserve_exact(v4);
        next.v6.reserve_exact(desired.classify.len() - v4);
        for (&(src, dst), (verdict, policy)) in &desired.classify {
            let verdict = Verdict {
                counter: policy
                    .as_deref()
                    .and_then(|p| self.counters.get(p).copied())
                    .unwrap_or(0),
                ..*verdict
            };
            next.push(src, dst, verdict);
            match known.classify.get(src, dst) {
                Some(v) if *v == verdict => continue,
                Some(_) => synced.changed += 1,
                None => synced.added += 1,
            }
            self.classify_entry(src, dst, Some(verdict))?;
        }
        let stale: Vec<(IpAddr, IpNet)> = known
            .classify
            .keys()
            .filter(|key| !desired.classify.contains_key(key))
            .collect();
        for (src, dst) in stale {
            self.classify_entry(src, dst, None)?;
            synced.removed += 1;
        }
        next.sort();
        known.classify = next;
        let (missing, extra): (Vec<IpNet>, Vec<IpNet>) = (
            desired
                .cluster
                .difference(&known.cluster)
                .copied()
                .collect(),
            known
                .cluster
                .difference(&desired.cluster)
                .copied()
                .collect(),
        );
        for net in missing {
            self.cluster_entry(net, true)?;
            known.cluster.insert(net);
            synced.added += 1;
        }
        for net in extra {
            self.cluster_entry(net, false)?;
            known.cluster.remove(&net);
            synced.removed += 1;
        }
        self.sync_tunnels(desired, &mut synced)?;
        self.sync_underlay(desired, &mut synced)?;
        known.syncs += 1;
        self.known = Some(known);
        Ok(synced)
    }

    /// The gateway's fast path: on while the node holds EIPs and the fast
    /// path is on, and holding only connections of the node's EIPs.
    fn sync_gateway(&mut self, desired: &Desired, synced: &mut Synced) -> Result<(), EbpfError> {
        let on = !desired.eips.is_empty() && self.gateway.is_some();
        let eips = if on {
            desired.eips.clone()
        } else {
            BTreeSet::new()
        };
        // EIPs the node gave up stop being learned first, then their
        // connections are forgotten; new ones are learned last.
        let wanted: BTreeSet<[u8; 16]> = eips.iter().map(|ip| eip_key(*ip)).collect();
        let mut set = AddressSet::open(
            &mut self.ebpf,
            common::EIPS,
            "filling the gateway's EIPs map",
        )?;
        set.remove_all_but(&wanted, synced)?;
        if let Some((learner, maps)) = &mut self.gateway {
            synced.removed += learner.set_eips(&eips, maps);
        }
        set.add(&wanted, synced)?;
        if self.learning != Some(on) {
            let what = format!(
                "switching the gateway's eBPF fast path {}",
                if on { "on" } else { "off" }
            );
            let mut switches: aya::maps::Array<_, u32> = aya::maps::Array::try_from(
                self.ebpf
                    .map_mut(common::SWITCHES)
                    .ok_or_else(|| failed(what.clone())("the object has no switches".into()))?,
            )
            .map_err(|e| e.to_string())
            .map_err(failed(what.clone()))?;
            // After a restart the pinned switch may already be as wanted.
            if switches.get(&common::switch::GATEWAY, 0).ok() != Some(u32::from(on)) {
                switches
                    .set(common::switch::GATEWAY, u32::from(on), 0)
                    .map_err(|e| e.to_string())
                    .map_err(failed(what))?;
                synced.changed += 1;
            }
            self.learning = Some(on);
        }
        Ok(())
    }

    /// What the gateway's fast path learned and holds: connections taken
    /// over since the start, left to the stack, and held now.
    pub fn gateway_learning(&self) -> Option<Learning> {
        if self.learning != Some(true) {
            return None;
        }
        let (learner, _) = self.gateway.as_ref()?;
        Some(learner.learning())
    }

    /// The tunnel's end on the underlay interface: the peers it takes
    /// frames from, then what it takes as the node's tunnel, or off.
    fn sync_underlay(&mut self, desired: &Desired, synced: &mut Synced) -> Result<(), EbpfError> {
        let peers = if desired.underlay.is_some() {
            desired.peers.iter().map(|ip| eip_key(*ip)).collect()
        } else {
            BTreeSet::new()
        };
        let mut set = AddressSet::open(
            &mut self.ebpf,
            common::PEERS,
            "filling the tunnel's end's peers",
        )?;
        set.remove_all_but(&peers, synced)?;
        set.add(&peers, synced)?;
        let wanted = desired.underlay.unwrap_or_default();
        let what = "the tunnel's end on the underlay";
        let mut map: aya::maps::Array<_, Underlay> = aya::maps::Array::try_from(
            self.ebpf
                .map_mut(common::UNDERLAY)
                .ok_or_else(|| failed(what)("the object has no such map".into()))?,
        )
        .map_err(|e| e.to_string())
        .map_err(failed(what))?;
        if map.get(&0, 0).ok() != Some(wanted) {
            map.set(0, wanted, 0)
                .map_err(|e| e.to_string())
                .map_err(failed(what))?;
            synced.changed += 1;
        }
        self.underlay = desired.underlay;
        Ok(())
    }

    /// The fast path's tunnel entries: `desired`'s, with the tunnel
    /// device's index now (none while the device does not exist).
    fn sync_tunnels(&mut self, desired: &Desired, synced: &mut Synced) -> Result<(), EbpfError> {
        let device = desired
            .tunnel
            .as_deref()
            .and_then(|name| Some((ifindex(name)?, device_mtu(name)?)));
        let wanted: BTreeMap<u32, Tunnel> = match device {
            Some((ifindex, mtu)) => desired
                .tunnels
                .iter()
                .map(|(mark, (smac, dmac))| {
                    let tunnel = Tunnel {
                        ifindex,
                        mtu,
                        smac: *smac,
                        dmac: *dmac,
                    };
                    (*mark, tunnel)
                })
                .collect(),
            None => BTreeMap::new(),
        };
        let what = "the fast path's tunnels";
        let mut map: AyaHashMap<&mut MapData, u32, Tunnel> = self.map(common::TUNNELS)?;
        let current: BTreeMap<u32, Tunnel> = map
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())
            .map_err(failed(what))?;
        for (mark, tunnel) in &wanted {
            match current.get(mark) {
                Some(t) if t == tunnel => continue,
                Some(_) => synced.changed += 1,
                None => synced.added += 1,
            }
            map.insert(mark, tunnel, 0)
                .map_err(|e| e.to_string())
                .map_err(failed(format!("tunnel of mark {mark:#010x}")))?;
        }
        for mark in current.keys().filter(|m| !wanted.contains_key(m)) {
            map.remove(mark)
                .map_err(|e| e.to_string())
                .map_err(failed(format!("tunnel of mark {mark:#010x}")))?;
            synced.removed += 1;
        }
        Ok(())
    }

    /// Gives every policy of `desired` a counter: the one it has, else the
    /// one its entries carry in the maps already (a restart), else a free
    /// one. Policies without entries give theirs back. Returns the free
    /// ones handed out: they still hold what an earlier policy counted.
    fn assign_counters(&mut self, desired: &Desired, current: &Entries) -> Vec<u32> {
        let wanted: BTreeSet<&PolicyRef> = desired
            .classify
            .values()
            .filter_map(|(_, p)| p.as_deref())
            .collect();
        self.counters.retain(|p, _| wanted.contains(p));
        let mut taken: BTreeSet<u32> = self.counters.values().copied().collect();
        // First the counters the maps already carry (a restart), so that a
        // new policy never takes one an old policy is about to adopt...
        for (key, (_, policy)) in &desired.classify {
            let Some(policy) = policy.as_deref() else {
                continue;
            };
            if self.counters.contains_key(policy) {
                continue;
            }
            if let Some(c) = current.get(key.0, key.1).map(|v| v.counter)
                && c != 0
                && taken.insert(c)
            {
                self.counters.insert(policy.clone(), c);
            }
        }
        // ...then the lowest free ones for the rest, in one pass.
        let mut free = (1..common::COUNTERS_MAX).filter(|c| !taken.contains(c));
        let mut fresh = Vec::new();
        for policy in wanted {
            if !self.counters.contains_key(policy)
                && let Some(c) = free.next()
            {
                self.counters.insert(policy.clone(), c);
                fresh.push(c);
            }
        }
        fresh
    }

    /// Sets counter `index` to zero on every CPU.
    fn zero_counter(&mut self, index: u32) -> Result<(), EbpfError> {
        let what = format!("zeroing counter {index}");
        let cpus = aya::util::nr_cpus()
            .map_err(|(_, e)| e.to_string())
            .map_err(failed(what.clone()))?;
        let zeros = aya::maps::PerCpuValues::try_from(vec![Counter::default(); cpus])
            .map_err(|e| e.to_string())
            .map_err(failed(what.clone()))?;
        let mut array: PerCpuArray<&mut MapData, Counter> = self.map(common::COUNTERS)?;
        array
            .set(index, zeros, 0)
            .map_err(|e| e.to_string())
            .map_err(failed(what))
    }

    /// Each policy's counter, summed over every CPU.
    pub fn policy_counters(&self) -> Result<BTreeMap<PolicyRef, Counter>, EbpfError> {
        self.counters
            .iter()
            .map(|(p, index)| Ok((p.clone(), self.counter(*index)?)))
            .collect()
    }

    /// The classification entries in the maps.
    fn entries(&mut self) -> Result<Entries, EbpfError> {
        let mut out = Entries::default();
        let read =
            |e: aya::maps::MapError| failed("reading the classification entries")(e.to_string());
        for item in &self.trie4(common::CLASSIFY4)? {
            let (key, verdict) = item.map_err(read)?;
            let data = key.data();
            let len = u8::try_from(key.prefix_len().saturating_sub(32)).unwrap_or(32);
            out.v4.push(((data.src, data.dst, len), verdict));
        }
        for item in &self.trie6(common::CLASSIFY6)? {
            let (key, verdict) = item.map_err(read)?;
            let data = key.data();
            let len = u8::try_from(key.prefix_len().saturating_sub(128)).unwrap_or(128);
            out.v6.push(((data.src, data.dst, len), verdict));
        }
        out.sort();
        Ok(out)
    }

    /// The in-cluster ranges in the maps.
    fn cluster(&mut self) -> Result<BTreeSet<IpNet>, EbpfError> {
        let mut out = BTreeSet::new();
        let read = |e: aya::maps::MapError| failed("reading the in-cluster ranges")(e.to_string());
        let trie: LpmTrie<&mut MapData, Dst4, u32> = self.map(common::CLUSTER4)?;
        for key in trie.keys() {
            let key = key.map_err(read)?;
            let len = u8::try_from(key.prefix_len()).unwrap_or(32);
            if let Ok(net) = ipnet::Ipv4Net::new(key.data().dst.into(), len) {
                out.insert(IpNet::V4(net));
            }
        }
        let trie: LpmTrie<&mut MapData, Dst6, u32> = self.map(common::CLUSTER6)?;
        for key in trie.keys() {
            let key = key.map_err(read)?;
            let len = u8::try_from(key.prefix_len()).unwrap_or(128);
            if let Ok(net) = ipnet::Ipv6Net::new(key.data().dst.into(), len) {
                out.insert(IpNet::V6(net));
            }
        }
        Ok(out)
    }

    /// Classifies traffic from `src` to `dst` with `verdict`. The next
    /// [`Self::sync`] reads the maps back.
    pub fn insert(&mut self, src: IpAddr, dst: IpNet, verdict: Verdict) -> Result<(), EbpfError> {
        self.known = None;
        self.classify_entry(src, dst, Some(verdict))
    }

    /// Removes the entry for `src` and `dst`. The next [`Self::sync`] reads
    /// the maps back.
    pub fn remove(&mut self, src: IpAddr, dst: IpNet) -> Result<(), EbpfError> {
        self.known = None;
        self.classify_entry(src, dst, None)
    }

    /// Sets (`Some`) or removes (`None`) the entry for `src` and `dst`.
    fn classify_entry(
        &mut self,
        src: IpAddr,
        dst: IpNet,
        verdict: Option<Verdict>,
    ) -> Result<(), EbpfError> {
        let what = format!("classify entry {src} . {dst}");
        match (src, dst) {
            (IpAddr::V4(s), IpNet::V4(d)) => {
                let mut trie = self.trie4(common::CLASSIFY4)?;
                let key = key4(s.octets(), d);
                set_entry(&mut trie, &key, verdict)
            }
            (IpAddr::V6(s), IpNet::V6(d)) => {
                let mut trie = self.trie6(common::CLASSIFY6)?;
                let key = key6(s.octets(), d);
                set_entry(&mut trie, &key, verdict)
            }
            _ => {
                return Err(failed(what)(
                    "source and destination of different families".into(),
                ));
            }
        }
        .map_err(|e| e.to_string())
        .map_err(failed(what))
    }

    /// Marks `net` as inside the cluster: never classified.
    pub fn insert_cluster(&mut self, net: IpNet) -> Result<(), EbpfError> {
        self.known = None;
        self.cluster_entry(net, true)
    }

    /// Removes `net` from the in-cluster ranges.
    pub fn remove_cluster(&mut self, net: IpNet) -> Result<(), EbpfError> {
        self.known = None;
        self.cluster_entry(net, false)
    }

    fn cluster_entry(&mut self, net: IpNet, present: bool) -> Result<(), EbpfError> {
        let what = format!("in-cluster range {net}");
        let len = u32::from(net.prefix_len());
        match net {
            IpNet::V4(n) => {
                let mut trie: LpmTrie<&mut MapData, Dst4, u32> = self.map(common::CLUSTER4)?;
                let key = Key::new(
                    len,
                    Dst4 {
                        dst: n.network().octets(),
                    },
                );
                set_entry(&mut trie, &key, present.then_some(1))
            }
            IpNet::V6(n) => {
                let mut trie: LpmTrie<&mut MapData, Dst6, u32> = self.map(common::CLUSTER6)?;
                let key = Key::new(
                    len,
                    Dst6 {
                        dst: n.network().octets(),
                    },
                );
                set_entry(&mut trie, &key, present.then_some(1))
            }
        }
        .map_err(|e| e.to_string())
        .map_err(failed(what))
    }

    /// Counter `index` summed over every CPU.
    pub fn counter(&self, index: u32) -> Result<Counter, EbpfError> {
        self.summed(common::COUNTERS, index)
    }

    /// What the tunnel's end on the underlay took out of the tunnel since
    /// its maps were created (they outlive agents): `None` while it is not
    /// on or not attached (the fast path off, or no tunnel yet).
    pub fn tunnel_end(&self) -> Option<Result<TunnelEnd, EbpfError>> {
        self.underlay?;
        if !self
            .attached
            .keys()
            .any(|(role, _)| *role == Role::Underlay)
        {
            return None;
        }
        Some((|| {
            Ok(TunnelEnd {
                to_pods: self.summed(common::TUNNEL_END, common::tunnel_end::TO_POD)?,
                out: self.summed(common::TUNNEL_END, common::tunnel_end::OUT)?,
            })
        })())
    }

    /// Slot `index` of the per-CPU counters `name`, summed over every CPU.
    fn summed(&self, name: &str, index: u32) -> Result<Counter, EbpfError> {
        let what = format!("counter {index} of {name}");
        let map = self
            .ebpf
            .map(name)
            .ok_or_else(|| failed(what.clone())("the object has no such map".into()))?;
        let array: PerCpuArray<&MapData, Counter> = PerCpuArray::try_from(map)
            .map_err(|e| e.to_string())
            .map_err(failed(what.clone()))?;
        let per_cpu = array
            .get(&index, 0)
            .map_err(|e| e.to_string())
            .map_err(failed(what))?;
        Ok(per_cpu.iter().fold(Counter::default(), |sum, c| Counter {
            packets: sum.packets + c.packets,
            bytes: sum.bytes + c.bytes,
        }))
    }

    /// Runs the classify program on `frame` (an Ethernet frame as a pod
    /// sends it, e.g. [`tcp_frame`]'s) in the kernel, `repeat` times, with
    /// nothing sent anywhere (`BPF_PROG_TEST_RUN`): what the program does
    /// with such a packet, from the maps as they are, and what one run
    /// costs. The entry's counter counts every run, as for a real packet.
    pub fn trial(&mut self, frame: &[u8], repeat: u32) -> Result<Trial, EbpfError> {
        self.trial_of(Role::Classify, frame, repeat)
    }

    /// The same with the reply program (`egressgw_reply`, on the tunnel
    /// device): a frame arriving through the tunnel.
    pub fn trial_reply(&mut self, frame: &[u8], repeat: u32) -> Result<Trial, EbpfError> {
        self.trial_of(Role::Reply, frame, repeat)
    }

    /// The same with the tunnel's end (`egressgw_underlay`, on the
    /// underlay interface): a frame arriving from the underlay as one
    /// segmentation offload of `gso_size` (0: none); also the frame as the
    /// program left it.
    pub fn trial_underlay(
        &mut self,
        frame: &[u8],
        gso_size: u32,
    ) -> Result<(Trial, Vec<u8>), EbpfError> {
        let mut out = vec![0u8; frame.len()];
        let mut ctx = [0u8; SKB_CONTEXT];
        ctx[SKB_GSO_SIZE..SKB_GSO_SIZE + 4].copy_from_slice(&gso_size.to_ne_bytes());
        let (trial, len) = self.run(Role::Underlay, frame, &ctx, Some(&mut out), 1)?;
        out.truncate(len);
        Ok((trial, out))
    }

    fn trial_of(&mut self, role: Role, frame: &[u8], repeat: u32) -> Result<Trial, EbpfError> {
        // No mark, no interface.
        let ctx = [0u8; SKB_CONTEXT];
        Ok(self.run(role, frame, &ctx, None, repeat)?.0)
    }

    /// Runs `role`'s program on `frame` with `ctx_in` as its `struct
    /// __sk_buff` (its size on current kernels; older ones take a longer
    /// context as long as the rest is zero); the frame as the program left
    /// it goes to `out` and its length is returned.
    fn run(
        &mut self,
        role: Role,
        frame: &[u8],
        ctx_in: &[u8; SKB_CONTEXT],
        out: Option<&mut [u8]>,
        repeat: u32,
    ) -> Result<(Trial, usize), EbpfError> {
        let what = format!("a trial run of {}", role.program());
        let mut ctx_out = [0u8; SKB_CONTEXT];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = out;
        opts.ctx_in = Some(ctx_in);
        opts.ctx_out = Some(&mut ctx_out);
        opts.repeat = repeat.max(1);
        let result = program(&mut self.ebpf, role)?
            .test_run(opts)
            .map_err(|e| e.to_string())
            .map_err(failed(what))?;
        let mark = ctx_out
            .get(SKB_MARK..SKB_MARK + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_ne_bytes);
        let trial = Trial {
            // The kernel hands the program's `int` back as it is.
            action: i32::from_ne_bytes(result.return_value.to_ne_bytes()),
            mark,
            per_run: result.duration,
        };
        Ok((trial, result.data_size_out as usize))
    }

    fn trie4(&mut self, name: &str) -> Result<LpmTrie<&mut MapData, Key4, Verdict>, EbpfError> {
        self.map(name)
    }

    fn trie6(&mut self, name: &str) -> Result<LpmTrie<&mut MapData, Key6, Verdict>, EbpfError> {
        self.map(name)
    }

    fn map<'a, T>(&'a mut self, name: &str) -> Result<T, EbpfError>
    where
        T: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
    {
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or_else(|| failed(format!("map {name}"))("the object has no such map".into()))?;
        T::try_from(map)
            .map_err(|e| e.to_string())
            .map_err(failed(format!("map {name}")))
    }
}

/// What the classify program did with a packet in a [`Classifier::trial`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trial {
    /// The TC action it returned: [`Trial::PASS`], [`Trial::DROP`],
    /// [`Trial::REDIRECT`] (the fast path) or [`Trial::UNSPEC`].
    pub action: i32,
    /// The packet's mark afterwards (it came in with none).
    pub mark: u32,
    /// The kernel's time for one run, averaged over the repeats.
    pub per_run: Duration,
}

impl Trial {
    /// `TC_ACT_UNSPEC`: the program let the packet go on as if it was not
    /// there (the tunnel's end: to the tunnel device).
    pub const UNSPEC: i32 = -1;
    /// `TC_ACT_OK`: the packet goes on (marked or not).
    pub const PASS: i32 = 0;
    /// `TC_ACT_SHOT`: dropped.
    pub const DROP: i32 = 2;
    /// `TC_ACT_REDIRECT`: sent on by the program itself.
    pub const REDIRECT: i32 = 7;
}

/// What the tunnel's end on the underlay took out of the tunnel: packets,
/// and bytes as they went on (the inner packet behind an Ethernet header).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TunnelEnd {
    /// Replies handed to their pod, on the node that opened the connection.
    pub to_pods: Counter,
    /// Pods' packets translated and sent out, on a gateway node.
    pub out: Counter,
}

/// Bytes of `struct __sk_buff`, the context of a TC program's trial run.
const SKB_CONTEXT: usize = 192;
/// Where its `mark` is (after `len` and `pkt_type`).
const SKB_MARK: usize = 8;
/// Where its `gso_size` is.
const SKB_GSO_SIZE: usize = 176;

/// An Ethernet frame of a TCP packet from `src` to `dst` (both of one
/// family), ports 40000 to 443, ACK set and SYN not: a packet of an open
/// connection, which the fast path does not start to remember. For
/// [`Classifier::trial`]; checksums are left zero (the program reads none).
///
/// # Panics
///
/// When `src` and `dst` are of different families.
#[must_use]
pub fn tcp_frame(src: IpAddr, dst: IpAddr) -> Vec<u8> {
    tcp_packet(src, dst, 40000, 443, TCP_ACK)
}

#[cfg(test)]
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

/// An Ethernet frame of a TCP packet with these ports and flags.
fn tcp_packet(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1];
    let tcp = {
        let mut h = vec![0u8; 20];
        h[0..2].copy_from_slice(&sport.to_be_bytes());
        h[2..4].copy_from_slice(&dport.to_be_bytes());
        h[12] = 5 << 4; // data offset: 5 words
        h[13] = flags;
        h[14..16].copy_from_slice(&64240u16.to_be_bytes());
        h
    };
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            frame.extend(0x0800u16.to_be_bytes());
            let total = u16::try_from(20 + tcp.len()).unwrap_or(u16::MAX);
            frame.extend([0x45, 0]);
            frame.extend(total.to_be_bytes());
            frame.extend([0, 0, 0x40, 0, 64, 6, 0, 0]); // DF, TTL 64, TCP
            frame.extend(s.octets());
            frame.extend(d.octets());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            frame.extend(0x86ddu16.to_be_bytes());
            let payload = u16::try_from(tcp.len()).unwrap_or(u16::MAX);
            frame.extend([0x60, 0, 0, 0]);
            frame.extend(payload.to_be_bytes());
            frame.extend([6, 64]); // TCP, hop limit 64
            frame.extend(s.octets());
            frame.extend(d.octets());
        }
        _ => panic!("tcp_frame: {src} and {dst} are of different families"),
    }
    frame.extend(tcp);
    frame
}

/// Sets (`Some`) or removes (`None`) a trie entry.
fn set_entry<K: aya::Pod, V: aya::Pod>(
    trie: &mut LpmTrie<&mut MapData, K, V>,
    key: &Key<K>,
    value: Option<V>,
) -> Result<(), aya::maps::MapError> {
    match value {
        Some(v) => trie.insert(key, v, 0),
        None => trie.remove(key),
    }
}

/// Removes a pinned attachment: with its pin and its last descriptor gone,
/// the kernel detaches it.
fn unpin_link(pin: &Path) -> Result<(), EbpfError> {
    if !pin.exists() {
        return Ok(());
    }
    let what = format!("detaching the attachment pinned at {}", pin.display());
    PinnedLink::from_pin(pin)
        .map_err(|e| e.to_string())
        .map_err(failed(what.clone()))?
        .unpin()
        .map(drop)
        .map_err(|e| e.to_string())
        .map_err(failed(what))
}

fn program(ebpf: &mut aya::Ebpf, role: Role) -> Result<&mut SchedClassifier, EbpfError> {
    let what = format!("program {}", role.program());
    ebpf.program_mut(role.program())
        .ok_or_else(|| failed(what.clone())("the object has no such program".into()))?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())
        .map_err(failed(what))
}

/// What the classification map pinned in `dir` says for a packet from
/// `src` to `dst` (the kernel's own longest-prefix lookup), read without
/// loading the program or changing anything; `None` when no entry covers
/// the pair.
pub fn lookup_pinned(dir: &Path, src: IpAddr, dst: IpAddr) -> Result<Option<Verdict>, EbpfError> {
    let name = if src.is_ipv4() {
        common::CLASSIFY4
    } else {
        common::CLASSIFY6
    };
    let pin = dir.join(name);
    let what = format!("looking up {src} -> {dst} in {}", pin.display());
    let data = MapData::from_pin(&pin)
        .map_err(|e| e.to_string())
        .map_err(failed(what.clone()))?;
    let map = aya::maps::Map::LpmTrie(data);
    let found = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let trie: LpmTrie<MapData, Key4, Verdict> = LpmTrie::try_from(map)
                .map_err(|e| e.to_string())
                .map_err(failed(what.clone()))?;
            trie.get(&key4(s.octets(), ipnet::Ipv4Net::from(d)), 0)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let trie: LpmTrie<MapData, Key6, Verdict> = LpmTrie::try_from(map)
                .map_err(|e| e.to_string())
                .map_err(failed(what.clone()))?;
            trie.get(&key6(s.octets(), ipnet::Ipv6Net::from(d)), 0)
        }
        _ => {
            return Err(failed(what)(
                "the addresses are of different families".into(),
            ));
        }
    };
    match found {
        Ok(v) => Ok(Some(v)),
        Err(aya::maps::MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(failed(what)(e.to_string())),
    }
}

/// The trie key of source `src` and destination network `dst`.
fn key4(src: [u8; 4], dst: ipnet::Ipv4Net) -> Key<Key4> {
    Key::new(
        32 + u32::from(dst.prefix_len()),
        Key4 {
            src,
            dst: dst.network().octets(),
        },
    )
}

fn key6(src: [u8; 16], dst: ipnet::Ipv6Net) -> Key<Key6> {
    Key::new(
        128 + u32::from(dst.prefix_len()),
        Key6 {
            src,
            dst: dst.network().octets(),
        },
    )
}

#[cfg(test)]
mod tests {
    use egressgw_common::kind;
    use egressgw_core::state::ClassifyEntry;

    use super::*;

    #[test]
    fn the_fast_path_knows_each_tunnel_mark_by_its_gateways_mac() {
        use egressgw_core::state::ClassifyEntry;
        let cfg = Config::default();
        let mut state = crate::testns::node_state(false);
        let entry = |gateway: &str, mark: u32| ClassifyEntry {
            src: "10.244.1.5".parse().unwrap(),
            dst: "198.51.100.0/24".parse().unwrap(),
            action: Action::Tunnel {
                gateway: gateway.into(),
                mark,
            },
            policy: None,
            group: None,
        };
        // "b" is a peer; "c" is not (yet): no fast path to it, the marked
        // way only.
        state.classify = vec![entry("b", cfg.mark(1)), entry("c", cfg.mark(2))];
        let desired = Desired::new(&state, &cfg);
        assert_eq!(desired.tunnel.as_deref(), Some("egress.vxlan"));
        assert_eq!(
            desired.tunnels,
            BTreeMap::from([(cfg.mark(1), ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]))])
        );
        let marked_way_only = Config {
            ebpf_fast_path: false,
            ..cfg.clone()
        };
        assert!(Desired::new(&state, &marked_way_only).tunnels.is_empty());
        state.vxlan = None;
        assert!(Desired::new(&state, &cfg).tunnels.is_empty());
    }

    #[test]
    fn entries_are_found_by_source_and_destination_and_give_their_keys_back() {
        let v = |counter| Verdict {
            kind: kind::MARK,
            mark: 1,
            mask: 0xff,
            counter,
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let mut entries = Entries::default();
        entries.push(ip("10.0.0.9"), net("0.0.0.0/0"), v(3));
        entries.push(ip("10.0.0.2"), net("198.51.100.0/24"), v(1));
        entries.push(ip("10.0.0.2"), net("198.51.100.0/25"), v(2));
        entries.push(ip("fd00::2"), net("2001:db8::/64"), v(4));
        entries.sort();
        assert_eq!(
            entries.get(ip("10.0.0.2"), net("198.51.100.0/24")),
            Some(&v(1))
        );
        assert_eq!(
            entries.get(ip("10.0.0.2"), net("198.51.100.0/25")),
            Some(&v(2))
        );
        assert_eq!(entries.get(ip("10.0.0.9"), net("0.0.0.0/0")), Some(&v(3)));
        assert_eq!(
            entries.get(ip("fd00::2"), net("2001:db8::/64")),
            Some(&v(4))
        );
        assert_eq!(entries.get(ip("10.0.0.2"), net("198.51.100.0/26")), None);
        assert_eq!(entries.get(ip("10.0.0.3"), net("198.51.100.0/24")), None);
        assert_eq!(entries.get(ip("10.0.0.2"), net("2001:db8::/64")), None);
        let keys: BTreeSet<(IpAddr, IpNet)> = entries.keys().collect();
        assert_eq!(keys.len(), 4);
        assert!(keys.contains(&(ip("10.0.0.9"), net("0.0.0.0/0"))));
        assert!(keys.contains(&(ip("fd00::2"), net("2001:db8::/64"))));
    }

    #[test]
    fn the_desired_maps_follow_the_node_state() {
        let cfg = Config::default();
        let entry = |dst: &str, action: Action| ClassifyEntry {
            src: "10.244.1.5".parse().unwrap(),
            dst: dst.parse().unwrap(),
            action,
            policy: Some(PolicyRef::namespaced("team-a", "web").into()),
            group: None,
        };
        let state = NodeState {
            classify: vec![
                entry(
                    "198.51.100.7/24",
                    Action::Tunnel {
                        gateway: "b".into(),
                        mark: cfg.mark(1),
                    },
                ),
                entry("203.0.113.0/24", Action::Local),
                entry("192.0.2.0/24", Action::Drop),
                entry("198.51.100.2/32", Action::Bypass),
            ],
            cluster_cidrs: vec!["10.96.0.1/16".parse().unwrap()],
            ..NodeState::default()
        };
        let desired = Desired::new(&state, &cfg);
        let got = |dst: &str| {
            let key = ("10.244.1.5".parse().unwrap(), dst.parse().unwrap());
            desired.classify[&key].0
        };
        // Host bits are cut off, as the trie keeps only the prefix.
        assert_eq!(got("198.51.100.0/24").kind, kind::MARK);
        assert_eq!(got("198.51.100.0/24").mark, cfg.mark(1));
        assert_eq!(got("203.0.113.0/24").mark, cfg.local_mark());
        // Failing closed is nftables' job (it knows the direction); the
        // range is held against wider entries.
        assert_eq!(got("192.0.2.0/24").kind, kind::LEAVE);
        assert_eq!(got("198.51.100.2/32").kind, kind::LEAVE);
        assert!(
            desired
                .classify
                .values()
                .all(|(v, _)| v.mask == cfg.mark_mask)
        );
        assert_eq!(
            desired.cluster,
            BTreeSet::from(["10.96.0.0/16".parse().unwrap()])
        );
    }
}

#[cfg(test)]
mod kernel_tests {
    use std::net::UdpSocket;

    use egressgw_common::kind;

    use super::*;
    use crate::testns::{in_new_netns, links_up, root_or_skip, sh};

    const POD: &str = "10.244.1.5";
    const OTHER_POD: &str = "10.244.1.6";
    const MARK: u32 = 0x0100_0000;
    const MASK: u32 = 0xff00_0000;

    /// `a` plays the pod's side, `b` the node's: what leaves `a` enters `b`,
    /// where the classifier sits. nftables counts, per mark, what enters
    /// by `b` after the classifier.
    fn wire() {
        sh("ip link add name a type veth peer name b");
        sh(&format!(
            "ip addr add {POD}/32 dev a && ip addr add {OTHER_POD}/32 dev a"
        ));
        links_up(&["a", "b"]);
        let b_mac =
            sh("ip -o link show dev b | sed -n 's/.*link\\/ether \\([0-9a-f:]*\\).*/\\1/p'");
        for dst in ["198.51.100.1", "198.51.100.2", "203.0.113.1", "10.96.0.10"] {
            sh(&format!("ip route add {dst}/32 dev a"));
            sh(&format!(
                "ip neigh replace {dst} lladdr {} dev a nud permanent",
                b_mac.trim()
            ));
        }
        sh("nft add table ip seen");
        sh("nft 'add chain ip seen pre { type filter hook prerouting priority -300 ; }'");
        sh(&format!(
            "nft add rule ip seen pre iifname b meta mark and {MASK:#x} == {MARK:#x} counter comment marked"
        ));
        sh(&format!(
            "nft add rule ip seen pre iifname b meta mark and {MASK:#x} == 0 counter comment unmarked"
        ));
    }

    /// How many packets the rule with `comment` counted.
    fn seen(comment: &str) -> u64 {
        let out = sh("nft list chain ip seen pre");
        out.lines()
            .find(|l| l.contains(&format!("comment \"{comment}\"")))
            .and_then(|l| l.split("packets ").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no counter {comment} in {out}"))
    }

    /// Sends `n` datagrams from `src` to `dst`.
    fn send(src: &str, dst: &str, n: usize) {
        let socket = UdpSocket::bind((src.parse::<IpAddr>().unwrap(), 0)).unwrap();
        for _ in 0..n {
            socket
                .send_to(b"egressgw", (dst.parse::<IpAddr>().unwrap(), 9))
                .unwrap();
        }
    }

    /// Gives the calling thread a mount namespace of its own with a fresh
    /// bpf filesystem on /sys/fs/bpf: its pins go away with the thread.
    pub(super) fn private_bpffs() {
        use nix::sched::{CloneFlags, unshare};
        unshare(CloneFlags::CLONE_FS | CloneFlags::CLONE_NEWNS).expect("unshare(CLONE_NEWNS)");
        sh("mount --make-rprivate / && mount -t bpf bpf /sys/fs/bpf");
    }

    fn verdict(kind: u32, counter: u32) -> Verdict {
        Verdict {
            kind,
            mark: MARK,
            mask: MASK,
            counter,
        }
    }

    #[test]
    fn the_classifier_marks_counts_drops_and_leaves_alone_by_longest_prefix() {
        if !root_or_skip("the_classifier_marks_counts_drops_and_leaves_alone_by_longest_prefix") {
            return;
        }
        in_new_netns(|| {
            wire();
            let mut classifier = Classifier::load().expect("the program loads");
            classifier.attach("b").expect("the program attaches");
            let net = |s: &str| s.parse::<IpNet>().unwrap();
            let pod: IpAddr = POD.parse().unwrap();
            classifier
                .insert(pod, net("198.51.100.0/24"), verdict(kind::MARK, 7))
                .unwrap();
            // More specific: excluded.
            classifier
                .insert(pod, net("198.51.100.2/32"), verdict(kind::LEAVE, 8))
                .unwrap();
            classifier
                .insert(pod, net("0.0.0.0/0"), verdict(kind::MARK, 9))
                .unwrap();
            classifier.insert_cluster(net("10.96.0.0/16")).unwrap();

            send(POD, "198.51.100.1", 5);
            assert_eq!(
                seen("marked"),
                5,
                "the pod's traffic to 198.51.100.1 gets the mark"
            );
            let c7 = classifier.counter(7).unwrap();
            assert_eq!(c7.packets, 5);
            assert!(c7.bytes >= 5 * (14 + 20 + 8 + 8), "{c7:?}");

            send(POD, "198.51.100.2", 3);
            assert_eq!(seen("marked"), 5, "the /32 exclusion wins over the /24");
            assert_eq!(classifier.counter(8).unwrap().packets, 3);

            send(POD, "10.96.0.10", 2);
            assert_eq!(seen("marked"), 5, "in-cluster destinations are left alone");
            assert_eq!(classifier.counter(9).unwrap().packets, 0, "and not counted");

            send(OTHER_POD, "198.51.100.1", 4);
            assert_eq!(seen("marked"), 5, "another pod is not selected");
            assert_eq!(seen("unmarked"), 3 + 2 + 4);

            // A drop verdict: nothing enters.
            classifier
                .insert(pod, net("198.51.100.0/24"), verdict(kind::DROP, 7))
                .unwrap();
            let before = seen("unmarked") + seen("marked");
            send(POD, "198.51.100.1", 4);
            assert_eq!(
                seen("unmarked") + seen("marked"),
                before,
                "dropped at the classifier"
            );
            assert_eq!(classifier.counter(7).unwrap().packets, 5 + 4);

            // Removed: left alone again.
            classifier.remove(pod, net("198.51.100.0/24")).unwrap();
            classifier.remove(pod, net("0.0.0.0/0")).unwrap();
            let unmarked = seen("unmarked");
            send(POD, "198.51.100.1", 1);
            assert_eq!(seen("unmarked"), unmarked + 1);
            classifier.detach("b").unwrap();
        });
    }

    #[test]
    fn a_trial_run_says_what_the_program_does_with_a_packet() {
        if !root_or_skip("a_trial_run_says_what_the_program_does_with_a_packet") {
            return;
        }
        in_new_netns(|| {
            let mut classifier = Classifier::load().expect("the program loads");
            let net = |s: &str| s.parse::<IpNet>().unwrap();
            let ip = |s: &str| s.parse::<IpAddr>().unwrap();
            let pod = ip(POD);
            let pod6 = ip("fd00:10:244:1::5");
            for (dst, kind, counter) in [
                ("198.51.100.0/24", kind::MARK, 7),
                ("198.51.100.2/32", kind::LEAVE, 8),
                ("203.0.113.0/24", kind::DROP, 9),
            ] {
                classifier
                    .insert(pod, net(dst), verdict(kind, counter))
                    .unwrap();
            }
            classifier
                .insert(pod6, net("2001:db8::/64"), verdict(kind::MARK, 10))
                .unwrap();
            classifier.insert_cluster(net("10.96.0.0/16")).unwrap();
            let mut trial = |src: IpAddr, dst: &str| {
                let t = classifier.trial(&tcp_frame(src, ip(dst)), 1).unwrap();
                (t.action, t.mark)
            };
            assert_eq!(trial(pod, "198.51.100.1"), (Trial::PASS, MARK));
            assert_eq!(trial(pod, "198.51.100.2"), (Trial::PASS, 0), "excluded");
            assert_eq!(trial(pod, "203.0.113.1"), (Trial::DROP, 0));
            assert_eq!(trial(pod, "10.96.0.10"), (Trial::PASS, 0), "in-cluster");
            assert_eq!(trial(ip(OTHER_POD), "198.51.100.1"), (Trial::PASS, 0));
            assert_eq!(trial(pod6, "2001:db8::1"), (Trial::PASS, MARK));
            assert_eq!(trial(pod6, "2001:db8:1::1"), (Trial::PASS, 0));
            // Each run counts, as a packet would.
            classifier
                .trial(&tcp_frame(pod, ip("198.51.100.1")), 1000)
                .unwrap();
            assert_eq!(classifier.counter(7).unwrap().packets, 1 + 1000);
            assert_eq!(classifier.counter(9).unwrap().packets, 1);
        });
    }

    #[test]
    fn a_connection_opened_the_marked_way_gets_its_replies_through_the_stack() {
        if !root_or_skip("a_connection_opened_the_marked_way_gets_its_replies_through_the_stack") {
            return;
        }
        in_new_netns(|| {
            let mut classifier = loaded_beside_a_tunnel();
            let (pod, remote) = (
                POD.parse::<IpAddr>().unwrap(),
                "198.51.100.1".parse().unwrap(),
            );
            let mut desired = Desired {
                classify: BTreeMap::from([(
                    (pod, "198.51.100.0/24".parse().unwrap()),
                    (verdict(kind::MARK, 0), None),
                )]),
                tunnel: Some("t0".into()),
                tunnels: BTreeMap::from([(MARK, ([2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 4]))]),
                ..Desired::default()
            };
            classifier.sync(&desired).unwrap();
            let syn = tcp_packet(pod, remote, 40000, 443, TCP_SYN);
            let reply = tcp_packet(remote, pod, 443, 40000, TCP_SYN | TCP_ACK);
            assert_eq!(
                classifier.trial(&syn, 1).unwrap().action,
                Trial::REDIRECT,
                "the SYN takes the fast path"
            );
            assert_eq!(
                classifier.trial_reply(&reply, 1).unwrap().action,
                Trial::REDIRECT,
                "and so does its reply"
            );
            // The fast path off (or the gateway not known): a new
            // connection under the same addresses and ports, e.g. of a
            // new pod that got the old one's address, takes the marked way,
            // and its replies must not go to the interface the earlier
            // connection was remembered with.
            desired.tunnels.clear();
            classifier.sync(&desired).unwrap();
            let marked = classifier.trial(&syn, 1).unwrap();
            assert_eq!((marked.action, marked.mark), (Trial::PASS, MARK));
            assert_eq!(
                classifier.trial_reply(&reply, 1).unwrap().action,
                Trial::PASS,
                "the reply goes through the stack"
            );
        });
    }

    /// In a test's network namespace: a veth pair t0/t1 up, standing for
    /// the tunnel device, with this namespace's sysfs mounted (the
    /// tunnel's MTU is read from there), and the program loaded.
    fn loaded_beside_a_tunnel() -> Classifier {
        use nix::sched::{CloneFlags, unshare};
        unshare(CloneFlags::CLONE_FS | CloneFlags::CLONE_NEWNS).expect("unshare(CLONE_NEWNS)");
        sh("mount --make-rprivate / && mount -t sysfs sysfs /sys");
        sh("ip link add name t0 type veth peer name t1");
        links_up(&["t0", "t1"]);
        Classifier::load().expect("the program loads")
    }

    /// Waits up to 2 s for `iface`'s ingress to have no program: the
    /// kernel lets go of an attachment whose pin is gone a moment later
    /// (after an RCU grace period).
    fn assert_detached(iface: &str) {
        let detached = (0..200).any(|_| {
            let (_, programs) = SchedClassifier::query_tcx(iface, TcAttachType::Ingress).unwrap();
            programs.is_empty() || {
                std::thread::sleep(Duration::from_millis(10));
                false
            }
        });
        assert!(
            detached,
            "{iface}: still attached 2 s after its pin was removed"
        );
    }

    /// A VXLAN frame as the underlay brings it: to `mac` (the outer
    /// destination) and `dst`:`port` (from an address of the same family),
    /// with `flags` and `vni` in the VXLAN header, around `inner` (an
    /// Ethernet frame).
    fn vxlan(mac: [u8; 6], dst: IpAddr, port: u16, flags: u8, vni: u32, inner: &[u8]) -> Vec<u8> {
        let mut frame = mac.to_vec();
        frame.extend([0x02, 0, 0, 0, 0, 9]);
        let udp_len = u16::try_from(8 + 8 + inner.len()).unwrap();
        match dst {
            IpAddr::V4(dst) => {
                frame.extend([0x08, 0x00, 0x45, 0]);
                frame.extend((20 + udp_len).to_be_bytes());
                frame.extend([0, 0, 0x40, 0, 64, 17, 0, 0]); // DF, TTL 64, UDP
                frame.extend([192, 0, 2, 2]);
                frame.extend(dst.octets());
            }
            IpAddr::V6(dst) => {
                frame.extend([0x86, 0xdd, 0x60, 0, 0, 0]);
                frame.extend(udp_len.to_be_bytes());
                frame.extend([17, 64]); // UDP, hop limit 64
                frame.extend(
                    "2001:db8:ff::2"
                        .parse::<std::net::Ipv6Addr>()
                        .unwrap()
                        .octets(),
                );
                frame.extend(dst.octets());
            }
        }
        frame.extend(50000u16.to_be_bytes());
        frame.extend(port.to_be_bytes());
        frame.extend(udp_len.to_be_bytes());
        frame.extend([0, 0]); // no UDP checksum (the program reads none)
        let [_, a, b, c] = vni.to_be_bytes();
        frame.extend([flags, 0, 0, 0, a, b, c, 0]);
        frame.extend(inner);
        frame
    }

    #[test]
    fn the_tunnels_end_takes_only_its_own_tunnels_fast_path_frames_out_of_it() {
        if !root_or_skip("the_tunnels_end_takes_only_its_own_tunnels_fast_path_frames_out_of_it") {
            return;
        }
        in_new_netns(|| {
            let mut classifier = loaded_beside_a_tunnel();
            let ip = |s: &str| s.parse::<IpAddr>().unwrap();
            let (pod, remote) = (ip(POD), ip("198.51.100.1"));
            let (pod6, remote6) = (ip("fd00:10:244:1::5"), ip("2001:db8::1"));
            // A trial run's frame arrives on the namespace's loopback device,
            // whose address is all zeros: the frame is for this host.
            let host = [0u8; 6];
            let (addr, addr6) = (ip("192.0.2.1"), ip("2001:db8:ff::1"));
            let (port, vni) = (4789u16, 0x00ab_cdef_u32);
            let tunnel_mac = [0x02, 0, 0, 0, 0, 2];
            let underlay = |addr: IpAddr| {
                let (octets, on) = match addr {
                    IpAddr::V4(a) => {
                        let mut o = [0u8; 16];
                        o[..4].copy_from_slice(&a.octets());
                        (o, 4)
                    }
                    IpAddr::V6(a) => (a.octets(), 6),
                };
                Some(Underlay {
                    addr: octets,
                    port: port.to_be_bytes(),
                    mac: tunnel_mac,
                    vni: [0xab, 0xcd, 0xef, 0],
                    on,
                })
            };
            let mut desired = Desired {
                classify: BTreeMap::from([
                    (
                        (pod, "198.51.100.0/24".parse().unwrap()),
                        (verdict(kind::MARK, 0), None),
                    ),
                    (
                        (pod6, "2001:db8::/64".parse().unwrap()),
                        (verdict(kind::MARK, 0), None),
                    ),
                ]),
                tunnel: Some("t0".into()),
                tunnels: BTreeMap::from([(MARK, ([2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 4]))]),
                underlay: underlay(addr),
                // vxlan()'s sources.
                peers: BTreeSet::from([ip("192.0.2.2"), ip("2001:db8:ff::2")]),
                ..Desired::default()
            };
            classifier.sync(&desired).unwrap();
            // Attached, as an agent attaches it: the counts are shown.
            let none = BTreeSet::new();
            for (op, result) in classifier.follow(&none, None, &none, Some("t1")) {
                result.unwrap_or_else(|e| panic!("{op:?}: {e}"));
            }
            for (src, dst) in [(pod, remote), (pod6, remote6)] {
                let syn = tcp_packet(src, dst, 40000, 443, TCP_SYN);
                assert_eq!(classifier.trial(&syn, 1).unwrap().action, Trial::REDIRECT);
            }
            // The replies, as the gateway sends them into the tunnel: to the
            // tunnel device's MAC (tcp_packet's destination).
            let reply = tcp_packet(remote, pod, 443, 40000, TCP_SYN | TCP_ACK);
            let reply6 = tcp_packet(remote6, pod6, 443, 40000, TCP_SYN | TCP_ACK);
            assert_eq!(reply[..6], tunnel_mac);
            let to_pods = std::cell::Cell::new(0);
            let taken = |classifier: &mut Classifier, frame: &[u8], inner: &[u8], what: &str| {
                let (trial, out) = classifier.trial_underlay(frame, 0).unwrap();
                assert_eq!(trial.action, Trial::REDIRECT, "{what}: to its pod");
                assert_eq!(
                    out.len(),
                    inner.len(),
                    "{what}: the tunnel's headers came off"
                );
                assert_eq!(
                    out[12..],
                    inner[12..],
                    "{what}: the inner packet as it was sent"
                );
                to_pods.set(to_pods.get() + 1);
                let counted = classifier.tunnel_end().unwrap().unwrap();
                assert_eq!(counted.to_pods.packets, to_pods.get(), "{what}: counted");
            };
            let ours = vxlan(host, addr, port, 0x08, vni, &reply);
            taken(&mut classifier, &ours, &reply, "IPv4 in IPv4");
            let ours6 = vxlan(host, addr, port, 0x08, vni, &reply6);
            taken(&mut classifier, &ours6, &reply6, "IPv6 in IPv4");
            let bytes = classifier.tunnel_end().unwrap().unwrap().to_pods.bytes;
            assert_eq!(bytes, (reply.len() + reply6.len()) as u64);

            let mut other_mac = reply.clone();
            other_mac[5] = 0x22;
            let mut other_flow = reply.clone();
            other_flow[14 + 20 + 2..14 + 20 + 4].copy_from_slice(&40001u16.to_be_bytes());
            let mut not_ip = reply.clone();
            not_ip[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
            // The outer IPv4 header at 14, UDP at 34, VXLAN at 42.
            let changed = |at: usize, bytes: &[u8]| {
                let mut frame = ours.clone();
                frame[at..at + bytes.len()].copy_from_slice(bytes);
                frame
            };
            let total = u16::from_be_bytes([ours[16], ours[17]]);
            let udp_len = u16::from_be_bytes([ours[38], ours[39]]);
            for (what, frame, gso) in [
                ("another source", changed(26, &[192, 0, 2, 7]), 0),
                ("outer IPv4 options", changed(14, &[0x46]), 0),
                ("an outer fragment", changed(20, &[0x20, 0]), 0),
                ("congestion experienced", changed(15, &[3]), 0),
                (
                    "another outer length",
                    changed(16, &(total - 1).to_be_bytes()),
                    0,
                ),
                (
                    "another UDP length",
                    changed(38, &(udp_len - 1).to_be_bytes()),
                    0,
                ),
                ("other VXLAN bits", changed(43, &[0x01]), 0),
                (
                    "another VNI",
                    vxlan(host, addr, port, 0x08, vni + 1, &reply),
                    0,
                ),
                (
                    "another UDP port",
                    vxlan(host, addr, 8472, 0x08, vni, &reply),
                    0,
                ),
                (
                    "other VXLAN flags",
                    vxlan(host, addr, port, 0x88, vni, &reply),
                    0,
                ),
                (
                    "another address",
                    vxlan(host, ip("192.0.2.9"), port, 0x08, vni, &reply),
                    0,
                ),
                (
                    "another host's frame",
                    vxlan([2, 0, 0, 0, 0, 7], addr, port, 0x08, vni, &reply),
                    0,
                ),
                (
                    "another inner MAC",
                    vxlan(host, addr, port, 0x08, vni, &other_mac),
                    0,
                ),
                (
                    "not IP inside",
                    vxlan(host, addr, port, 0x08, vni, &not_ip),
                    0,
                ),
                (
                    "a connection not on the fast path",
                    vxlan(host, addr, port, 0x08, vni, &other_flow),
                    0,
                ),
                (
                    "the other family outside",
                    vxlan(host, addr6, port, 0x08, vni, &reply),
                    0,
                ),
                ("a segmentation offload", ours.clone(), 1400),
            ] {
                let (trial, out) = classifier.trial_underlay(&frame, gso).unwrap();
                assert_eq!(trial.action, Trial::UNSPEC, "{what}: to the tunnel device");
                assert_eq!(out, frame, "{what}: untouched");
            }
            assert_eq!(classifier.tunnel_end().unwrap().unwrap().to_pods.packets, 2);

            // After a segmentation offload of the connection went to the
            // device, its next frames go there too for a while.
            let (trial, _) = classifier.trial_underlay(&ours, 1400).unwrap();
            assert_eq!(trial.action, Trial::UNSPEC, "the offload");
            let (trial, _) = classifier.trial_underlay(&ours, 0).unwrap();
            assert_eq!(trial.action, Trial::UNSPEC, "right after it");
            let (trial, _) = classifier.trial_underlay(&ours6, 0).unwrap();
            assert_eq!(trial.action, Trial::REDIRECT, "another connection");
            to_pods.set(to_pods.get() + 1);
            std::thread::sleep(Duration::from_nanos(common::DEVICE_AFTER_OFFLOAD_NS));
            taken(&mut classifier, &ours, &reply, "a while after it");

            // A gateway node: a pod's packet of a connection taken over
            // is translated and sent out; with anything amiss it goes to
            // the device, untouched.
            let eip: IpAddr = ip("203.0.113.7");
            desired.eips = BTreeSet::from([eip]);
            classifier.sync(&desired).unwrap();
            let other_pod = ip(OTHER_POD);
            let upload = tcp_packet(other_pod, remote, 41000, 443, TCP_ACK);
            let flow = Flow4 {
                src: [10, 244, 1, 6],
                dst: [198, 51, 100, 1],
                sport: 41000u16.to_be_bytes(),
                dport: 443u16.to_be_bytes(),
            };
            let ip_len = u32::try_from(upload.len() - 14).unwrap();
            let nat = |mtu: u32| Nat4 {
                addr: [203, 0, 113, 7],
                port: 61000u16.to_be_bytes(),
                l2: [2, 0, 0, 0, 0, 0x11, 2, 0, 0, 0, 0, 0x12, 0x08, 0x00],
                ifindex: 1,
                mtu,
                _pad: [0; 4],
                seen: 0,
            };
            let take = |classifier: &mut Classifier, nat: Option<Nat4>| {
                let mut map: AyaHashMap<&mut MapData, Flow4, Nat4> =
                    classifier.map(common::NAT_OUT4).unwrap();
                match nat {
                    Some(nat) => map.insert(flow, nat, 0).unwrap(),
                    None => map.remove(&flow).unwrap(),
                }
            };
            let ours_out = vxlan(host, addr, port, 0x08, vni, &upload);
            let untouched = |classifier: &mut Classifier, frame: &[u8], what: &str| {
                let (trial, out) = classifier.trial_underlay(frame, 0).unwrap();
                assert_eq!(trial.action, Trial::UNSPEC, "{what}: to the tunnel device");
                assert_eq!(out, frame, "{what}: untouched");
            };
            untouched(&mut classifier, &ours_out, "not taken over");
            take(&mut classifier, Some(nat(ip_len - 1)));
            untouched(&mut classifier, &ours_out, "too big for the way out");
            take(&mut classifier, Some(nat(ip_len)));
            let mut last_hop = upload.clone();
            last_hop[22] = 1;
            let syn = tcp_packet(other_pod, remote, 41000, 443, TCP_SYN);
            for (what, inner) in [("TTL 1", &last_hop), ("a SYN", &syn)] {
                untouched(
                    &mut classifier,
                    &vxlan(host, addr, port, 0x08, vni, inner),
                    what,
                );
            }
            let (trial, out) = classifier.trial_underlay(&ours_out, 0).unwrap();
            assert_eq!(trial.action, Trial::REDIRECT, "out, translated");
            assert_eq!(out.len(), upload.len());
            assert_eq!(out[..14], nat(0).l2, "the way out's Ethernet header");
            assert_eq!(out[26..30], [203, 0, 113, 7], "from the EIP");
            assert_eq!(out[34..36], 61000u16.to_be_bytes(), "from its port");
            assert_eq!(out[22], 63, "TTL");
            let counted = classifier.tunnel_end().unwrap().unwrap();
            assert_eq!(counted.out.packets, 1);
            assert_eq!(counted.out.bytes, upload.len() as u64);
            // The EIP given up: the connection goes back to the stack.
            take(&mut classifier, Some(nat(ip_len)));
            desired.eips.clear();
            classifier.sync(&desired).unwrap();
            untouched(&mut classifier, &ours_out, "an EIP the node gave up");
            assert_eq!(classifier.tunnel_end().unwrap().unwrap().out.packets, 1);

            // An IPv6 underlay.
            desired.underlay = underlay(addr6);
            classifier.sync(&desired).unwrap();
            taken(
                &mut classifier,
                &vxlan(host, addr6, port, 0x08, vni, &reply),
                &reply,
                "IPv4 in IPv6",
            );
            taken(
                &mut classifier,
                &vxlan(host, addr6, port, 0x08, vni, &reply6),
                &reply6,
                "IPv6 in IPv6",
            );
            for (what, frame) in [
                ("the other family outside", ours.clone()),
                (
                    "another address",
                    vxlan(host, ip("2001:db8:ff::9"), port, 0x08, vni, &reply),
                ),
            ] {
                let (trial, out) = classifier.trial_underlay(&frame, 0).unwrap();
                assert_eq!(trial.action, Trial::UNSPEC, "{what}: to the tunnel device");
                assert_eq!(out, frame, "{what}: untouched");
            }

            // Off (e.g. the fast path turned off): every frame to the device.
            desired.underlay = None;
            classifier.sync(&desired).unwrap();
            assert!(classifier.tunnel_end().is_none(), "no counts while off");
            let (trial, out) = classifier.trial_underlay(&ours, 0).unwrap();
            assert_eq!((trial.action, out), (Trial::UNSPEC, ours));
        });
    }

    #[test]
    fn a_restarted_classifier_adopts_the_pinned_state_and_swaps_the_program_in_place() {
        if !root_or_skip(
            "a_restarted_classifier_adopts_the_pinned_state_and_swaps_the_program_in_place",
        ) {
            return;
        }
        in_new_netns(|| {
            private_bpffs();
            wire();
            let dir = Path::new(PIN_DIR);
            let pod: IpAddr = POD.parse().unwrap();
            let first = {
                let mut c = Classifier::load_pinned(dir).expect("the program loads with pins");
                c.attach("b").unwrap();
                c.insert(
                    pod,
                    "198.51.100.0/24".parse().unwrap(),
                    verdict(kind::MARK, 7),
                )
                .unwrap();
                send(POD, "198.51.100.1", 3);
                assert_eq!(seen("marked"), 3);
                c
            };
            // The agent is gone: what it pinned keeps classifying.
            drop(first);
            send(POD, "198.51.100.1", 2);
            assert_eq!(seen("marked"), 5, "classified while no agent runs");

            // The next agent finds the entries and counters, and takes the
            // attachment over: one program on the interface, never none.
            let mut second = Classifier::load_pinned(dir).unwrap();
            assert_eq!(second.counter(7).unwrap().packets, 5, "counters adopted");
            second.attach("b").unwrap();
            let (_, programs) = SchedClassifier::query_tcx("b", TcAttachType::Ingress).unwrap();
            assert_eq!(programs.len(), 1, "the program was swapped, not added");
            // Known as attached (pinned): a second attach does nothing.
            assert!(
                second
                    .attached
                    .get(&(Role::Classify, "b".to_owned()))
                    .is_some_and(|a| a.link.is_none())
            );
            assert!(!second.attach("b").unwrap());
            send(POD, "198.51.100.1", 2);
            assert_eq!(seen("marked"), 7);
            assert_eq!(second.counter(7).unwrap().packets, 7);

            // Cleanup detaches and unpins everything.
            drop(second);
            Classifier::remove_pins(dir).unwrap();
            assert!(!dir.exists());
            assert_detached("b");
            send(POD, "198.51.100.1", 1);
            assert_eq!(seen("marked"), 7, "no longer classified");
        });
    }

    #[test]
    fn the_pinned_classification_is_looked_up_by_longest_prefix_without_loading() {
        if !root_or_skip("the_pinned_classification_is_looked_up_by_longest_prefix_without_loading")
        {
            return;
        }
        in_new_netns(|| {
            private_bpffs();
            let dir = Path::new(PIN_DIR);
            let pod: IpAddr = POD.parse().unwrap();
            let mut c = Classifier::load_pinned(dir).unwrap();
            c.insert(
                pod,
                "198.51.100.0/24".parse().unwrap(),
                verdict(kind::MARK, 7),
            )
            .unwrap();
            c.insert(
                pod,
                "198.51.100.128/25".parse().unwrap(),
                verdict(kind::LEAVE, 0),
            )
            .unwrap();
            let ip = |s: &str| s.parse::<IpAddr>().unwrap();
            let look = |dst: &str| lookup_pinned(dir, pod, ip(dst)).unwrap().map(|v| v.kind);
            assert_eq!(look("198.51.100.7"), Some(kind::MARK));
            assert_eq!(
                look("198.51.100.200"),
                Some(kind::LEAVE),
                "the longer prefix"
            );
            assert_eq!(look("203.0.113.1"), None);
            assert_eq!(
                lookup_pinned(dir, ip("10.244.9.9"), ip("198.51.100.7")).unwrap(),
                None,
                "another source"
            );
            drop(c);
            Classifier::remove_pins(dir).unwrap();
            assert!(
                lookup_pinned(dir, pod, ip("198.51.100.7")).is_err(),
                "no pins, no map"
            );
        });
    }

    #[test]
    fn a_pinned_map_of_another_shape_is_replaced_and_the_rest_adopted() {
        if !root_or_skip("a_pinned_map_of_another_shape_is_replaced_and_the_rest_adopted") {
            return;
        }
        in_new_netns(|| {
            private_bpffs();
            let dir = Path::new(PIN_DIR);
            let pod: IpAddr = POD.parse().unwrap();
            let mut first = Classifier::load_pinned(dir).unwrap();
            first
                .insert(
                    pod,
                    "198.51.100.0/24".parse().unwrap(),
                    verdict(kind::MARK, 7),
                )
                .unwrap();
            drop(first);
            // An agent of another version left a flow map of another shape
            // (here: the in-cluster trie's, under the flow map's name).
            let flows = dir.join(common::FLOWS4);
            std::fs::remove_file(&flows).unwrap();
            std::fs::rename(dir.join(common::CLUSTER4), &flows).unwrap();

            let mut second =
                Classifier::load_pinned(dir).expect("loads, replacing the map of another shape");
            let info = aya::maps::MapInfo::from_pin(&flows).unwrap();
            assert_eq!(
                (info.key_size(), info.value_size()),
                (size_of::<Flow4>() as u32, size_of::<PodLink>() as u32)
            );
            assert_eq!(
                second.entries().unwrap().len(),
                1,
                "the maps of the right shape are adopted with their entries"
            );
            drop(second);
            Classifier::remove_pins(dir).unwrap();
        });
    }

    #[test]
    fn sync_changes_only_what_differs_and_a_restart_changes_nothing() {
        if !root_or_skip("sync_changes_only_what_differs_and_a_restart_changes_nothing") {
            return;
        }
        in_new_netns(|| {
            private_bpffs();
            wire();
            let dir = Path::new(PIN_DIR);
            let net = |s: &str| s.parse::<IpNet>().unwrap();
            let pod: IpAddr = POD.parse().unwrap();
            let web = PolicyRef::namespaced("team-a", "web");
            let db = PolicyRef::namespaced("team-a", "db");
            let mut desired = Desired::default();
            desired.classify.insert(
                (pod, net("198.51.100.0/24")),
                (verdict(kind::MARK, 0), Some(web.clone().into())),
            );
            desired.classify.insert(
                (pod, net("198.51.100.2/32")),
                (verdict(kind::LEAVE, 0), None),
            );
            desired.classify.insert(
                (OTHER_POD.parse().unwrap(), net("203.0.113.0/24")),
                (verdict(kind::MARK, 0), Some(db.clone().into())),
            );
            desired.cluster.insert(net("10.96.0.0/16"));

            let mut first = Classifier::load_pinned(dir).unwrap();
            first.attach("b").unwrap();
            let synced = first.sync(&desired).unwrap();
            assert_eq!((synced.added, synced.changed, synced.removed), (4, 0, 0));
            assert!(
                first.sync(&desired).unwrap().is_empty(),
                "a second sync changes nothing"
            );
            send(POD, "198.51.100.1", 3);
            send(POD, "10.96.0.10", 1);
            assert_eq!(seen("marked"), 3);
            assert_eq!(first.policy_counters().unwrap()[&web].packets, 3);
            assert_eq!(first.policy_counters().unwrap()[&db].packets, 0);
            send(OTHER_POD, "203.0.113.1", 2);
            assert_eq!(first.policy_counters().unwrap()[&db].packets, 2);

            // A restarted agent: same state, nothing to change, the
            // policies' counts go on.
            drop(first);
            let mut second = Classifier::load_pinned(dir).unwrap();
            second.attach("b").unwrap();
            assert!(
                second.sync(&desired).unwrap().is_empty(),
                "a restart changes no entry"
            );
            send(POD, "198.51.100.1", 2);
            assert_eq!(second.policy_counters().unwrap()[&web].packets, 5);

            // One entry changes, one goes: only they are touched.
            desired.classify.insert(
                (pod, net("198.51.100.0/24")),
                (verdict(kind::DROP, 0), Some(web.clone().into())),
            );
            desired
                .classify
                .remove(&(OTHER_POD.parse().unwrap(), net("203.0.113.0/24")));
            desired.cluster.clear();
            let synced = second.sync(&desired).unwrap();
            assert_eq!((synced.added, synced.changed, synced.removed), (0, 1, 2));
            let before = seen("marked") + seen("unmarked");
            send(POD, "198.51.100.1", 2);
            assert_eq!(seen("marked") + seen("unmarked"), before, "now dropped");
            assert!(!second.policy_counters().unwrap().contains_key(&db));

            // A new policy may get db's counter back, but not its counts.
            let cache = PolicyRef::namespaced("team-a", "cache");
            desired.classify.insert(
                (OTHER_POD.parse().unwrap(), net("203.0.113.0/24")),
                (verdict(kind::MARK, 0), Some(cache.clone().into())),
            );
            second.sync(&desired).unwrap();
            assert_eq!(second.policy_counters().unwrap()[&cache].packets, 0);
            send(OTHER_POD, "203.0.113.1", 1);
            assert_eq!(second.policy_counters().unwrap()[&cache].packets, 1);

            // An entry removed behind its back (here by another loader of
            // the pinned maps) is back within READ_BACK_EVERY syncs, and
            // nothing else is touched on the way.
            let mut other = Classifier::load_pinned(dir).unwrap();
            other
                .remove(OTHER_POD.parse().unwrap(), net("203.0.113.0/24"))
                .unwrap();
            drop(other);
            let mut restored_after = None;
            for n in 1..=READ_BACK_EVERY {
                let synced = second.sync(&desired).unwrap();
                if !synced.is_empty() {
                    assert_eq!((synced.added, synced.changed, synced.removed), (1, 0, 0));
                    restored_after = Some(n);
                    break;
                }
            }
            assert!(
                restored_after.is_some(),
                "the removed entry never came back"
            );
            send(OTHER_POD, "203.0.113.1", 1);
            assert_eq!(second.policy_counters().unwrap()[&cache].packets, 2);
            drop(second);
            Classifier::remove_pins(dir).unwrap();
        });
    }

    #[test]
    fn cleanup_detaches_the_pinned_classifier_and_removes_its_pins() {
        if !root_or_skip("cleanup_detaches_the_pinned_classifier_and_removes_its_pins") {
            return;
        }
        in_new_netns(|| {
            private_bpffs();
            wire();
            let mut c = Classifier::load_pinned(Path::new(PIN_DIR)).unwrap();
            c.attach("b").unwrap();
            c.insert(
                POD.parse().unwrap(),
                "198.51.100.0/24".parse().unwrap(),
                verdict(kind::MARK, 7),
            )
            .unwrap();
            drop(c);
            send(POD, "198.51.100.1", 1);
            assert_eq!(seen("marked"), 1, "pinned: classified with no agent");

            let report = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let mut dp = crate::reconcile::Dataplane::new(
                        crate::fake::FakeNetlink::default(),
                        crate::nft::FakeFirewall::default(),
                        Config::default(),
                    )
                    .with_ebpf_pins(PIN_DIR);
                    dp.cleanup().await
                });
            assert!(report.is_ok(), "{:?}", report.failed);
            assert!(
                report.applied.iter().any(|op| op.text.contains(PIN_DIR)),
                "{:?}",
                report.applied
            );
            assert!(!Path::new(PIN_DIR).exists());
            assert_detached("b");
            send(POD, "198.51.100.1", 1);
            assert_eq!(seen("marked"), 1, "no longer classified");
        });
    }
}

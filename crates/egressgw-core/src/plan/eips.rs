//! Stage 3: each policy's gateway and EIPs.
//!
//! Rules, in the order they are applied:
//! 1. The gateway is the named one, or the cluster default when none is named.
//! 2. `useNodeIP` takes no EIP.
//! 3. A pinned EIP must lie in the gateway's pool of its family, must not be
//!    the gateway's shared default EIP, and must be free or already its
//!    owner's: an address belongs to the namespace (or, for cluster
//!    policies, the cluster) whose policies held it at the last status, else
//!    to the oldest policy that asks for it. A policy of another owner is
//!    refused (`EipTaken`) and never moves it.
//! 4. `default` shares the gateway's default EIP.
//! 5. `rr` takes an EIP of its own: its previous one while still free, else
//!    the first pool address that no pinned or `rr` policy holds and that is
//!    not the default EIP. Pinned policies are served first, then `rr`
//!    policies keeping their EIP, then new `rr` policies oldest first.

use std::collections::{HashMap, HashSet};

use foldhash::fast::RandomState;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::model::{Allocator, Gateway, Labels, Policy, PolicyRef, Snapshot};
use crate::net::Family;
use crate::status::Reason;

use super::gateways::Gateways;
use super::{Work, fi};

/// A hash map with a fast hasher: the keys are addresses and names.
type FoldMap<K, V> = HashMap<K, V, RandomState>;

/// The cluster's own addresses, which are never EIPs.
struct Own<'s> {
    /// The in-cluster prefixes.
    cluster: &'s [IpNet],
    /// Nodes' ExternalIPs, each of the first node that has it.
    external: FoldMap<IpAddr, &'s str>,
}

impl<'s> Own<'s> {
    fn new(snapshot: &'s Snapshot, cluster: &'s [IpNet]) -> Self {
        let mut external: FoldMap<IpAddr, &str> = FoldMap::default();
        for node in &snapshot.nodes {
            for ip in &node.external_addresses {
                external.entry(*ip).or_insert(&node.name);
            }
        }
        Self { cluster, external }
    }

    /// Whether `ip` is the cluster's: in its prefixes, or a node's
    /// ExternalIP.
    fn holds(&self, ip: IpAddr) -> bool {
        self.cluster.iter().any(|net| net.contains(&ip)) || self.external.contains_key(&ip)
    }

    /// Whose `ip` is, said for a status message, when it is the cluster's.
    fn whose(&self, ip: IpAddr) -> Option<String> {
        if let Some(net) = self.cluster.iter().find(|net| net.contains(&ip)) {
            return Some(format!(
                "lies in {net}, one of the cluster's own prefixes (pod, service, node or tunnel \
                 addresses)"
            ));
        }
        self.external
            .get(&ip)
            .map(|node| format!("is node {node}'s ExternalIP"))
    }
}

/// What stage 3 gives a policy that shares its gateway's default EIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SharingDefault {
    /// Whether the gateway fails closed.
    pub fail_closed: bool,
    /// Its EIP per family ([`fi`]): the gateway's default one, `None` for
    /// a family the gateway has no pool of.
    pub eips: [Option<IpAddr>; 2],
}

/// What stage 3 for one policy alone reads of a cluster
/// ([`Sharing::default_eips`]), built once for the policies of one change.
pub(super) struct Sharing<'a> {
    gateways: Gateways<'a>,
    namespaces: FoldMap<&'a str, &'a Labels>,
    families: Vec<Family>,
    own: Own<'a>,
}

impl<'a> Sharing<'a> {
    /// `cluster`: the in-cluster prefixes of `snapshot`.
    pub(super) fn new(snapshot: &'a Snapshot, cluster: &'a [IpNet]) -> Self {
        Self {
            gateways: super::gateways::validity(snapshot),
            namespaces: namespace_labels(snapshot),
            families: snapshot.config.enabled_families().collect(),
            own: Own::new(snapshot, cluster),
        }
    }

    /// Stage 3 for `policy` alone, when its outcome is its own: it uses
    /// the default allocator (no pinned address, not `useNodeIP`), is
    /// allocated without failure, and its last status named no address
    /// but its gateway's default EIPs. Such a policy holds, grants and
    /// reserves no address, so it changes no other policy's outcome, and
    /// no other policy changes its own. `None` for any other policy.
    pub(super) fn default_eips(&self, policy: &'a Arc<Policy>) -> Option<SharingDefault> {
        let spec = &policy.egress_ip;
        if spec.allocator != Allocator::Default
            || spec.use_node_ip
            || spec.ipv4.is_some()
            || spec.ipv6.is_some()
        {
            return None;
        }
        let work = resolve_gateway(policy, &self.gateways, &self.namespaces);
        if work.failure.is_some() {
            return None;
        }
        let gw = self.gateways.by_name[work.gateway?].gateway;
        if check_pools(&work, gw, &self.families).is_some() {
            return None;
        }
        let mut eips = [None, None];
        for family in &self.families {
            let ip = gw.default_eip(*family);
            // Inside its own pool, which no usable gateway's overlaps: no
            // other gateway's policy can hold or pin it.
            if ip.is_some_and(|ip| self.own.holds(ip) || !gw.pool(*family).contains(ip)) {
                return None;
            }
            eips[fi(*family)] = ip;
        }
        let named = |ip: &IpAddr| eips.contains(&Some(*ip));
        policy
            .previous_eips
            .iter()
            .all(named)
            .then_some(SharingDefault {
                fail_closed: work.fail_closed,
                eips,
            })
    }
}

/// What stage 3 gives one policy alone ([`Sharing::alone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Alone<'a> {
    /// The gateway it uses; `None` when it failed.
    pub gateway: Option<&'a str>,
    /// Whether its gateway fails closed.
    pub fail_closed: bool,
    /// Its EIP per family ([`fi`]).
    pub eips: [Option<IpAddr>; 2],
    /// Families it leaves with the node's address (`useNodeIP`).
    pub node_ip: [bool; 2],
}

/// Who holds, pins and last held each address, among every policy but
/// one: what stage 3 gave the others, read back from what is carried.
#[derive(Debug, Default)]
pub(super) struct Others<'a> {
    /// Per address: the owners of the other policies pinning it (a
    /// namespace; `None` for a cluster policy).
    pins: FoldMap<IpAddr, Vec<Option<&'a str>>>,
    /// Per address: the owners of the other policies whose last status
    /// named it.
    previous: FoldMap<IpAddr, Vec<Option<&'a str>>>,
    /// The addresses the others hold, pinned or `rr`.
    held: HashSet<IpAddr, RandomState>,
    /// The addresses the others that cannot be served last held: kept
    /// reserved for them, unless what they failed on came after the
    /// reservation (a pin refused, a pool exhausted).
    reserved: HashSet<IpAddr, RandomState>,
    /// Per address: the others (by index) whose traffic leaves with it,
    /// each with whether it pins it.
    users: FoldMap<IpAddr, Vec<(usize, bool)>>,
    /// The gateways an `rr` policy of which holds no address its last
    /// status named, or cannot be served: one policy more or less may move
    /// its EIP.
    unsettled: HashSet<&'a str, RandomState>,
}

impl<'a> Others<'a> {
    /// From `policies` (stage 3's order) and per policy the EIPs its
    /// traffic leaves with (`None` in both families: it could not be
    /// allocated), every policy but the one at `except`; of the addresses
    /// only those `relevant` says, but which gateways are unsettled of all.
    pub(super) fn new(
        sharing: &Sharing<'a>,
        policies: &'a [Arc<Policy>],
        eips: impl Fn(usize) -> [Option<Option<IpAddr>>; 2],
        except: Option<usize>,
        relevant: impl Fn(IpAddr) -> bool,
    ) -> Self {
        let mut others = Others::default();
        for (k, policy) in policies.iter().enumerate() {
            if Some(k) == except {
                continue;
            }
            let owner = policy.id.namespace.as_deref();
            let spec = &policy.egress_ip;
            for family in Family::ALL {
                if let Some(ip) = pinned(policy, family).filter(|ip| relevant(*ip)) {
                    others.pins.entry(ip).or_default().push(owner);
                }
            }
            for ip in policy.previous_eips.iter().filter(|ip| relevant(**ip)) {
                others.previous.entry(*ip).or_default().push(owner);
            }
            let leaves = eips(k);
            let rr = spec.allocator == Allocator::RoundRobin && !spec.use_node_ip;
            let gateway = policy.gateway.as_deref().or(sharing.gateways.default);
            if leaves == [None, None] {
                let previous = policy.previous_eips.iter().copied();
                others.reserved.extend(previous.filter(|ip| relevant(*ip)));
                if rr && let Some(gateway) = gateway {
                    others.unsettled.insert(gateway);
                }
                continue;
            }
            for family in Family::ALL {
                let Some(Some(ip)) = leaves[fi(family)] else {
                    continue;
                };
                let pins = pinned(policy, family).is_some() && !spec.use_node_ip;
                if rr && !pins && !policy.previous_eips.contains(&ip) {
                    others.unsettled.extend(gateway);
                }
                if !relevant(ip) {
                    continue;
                }
                others.users.entry(ip).or_default().push((k, pins));
                if pins || rr {
                    others.held.insert(ip);
                }
            }
        }
        others
    }

    /// The others whose traffic leaves with `ip`, each with whether it
    /// pins it.
    pub(super) fn users(&self, ip: IpAddr) -> &[(usize, bool)] {
        self.users.get(&ip).map_or(&[], Vec::as_slice)
    }
}

impl<'a> Sharing<'a> {
    /// The gateway `policy` names, or the cluster default, when there is
    /// one.
    pub(super) fn gateway_of(&self, policy: &Policy) -> Option<&Gateway> {
        let name = policy.gateway.as_deref().or(self.gateways.default)?;
        Some(self.gateways.by_name.get(name)?.gateway)
    }

    /// The gateway `name`, when there is one.
    pub(super) fn gateway(&self, name: &str) -> Option<&super::gateways::GatewayInfo<'a>> {
        self.gateways.by_name.get(name)
    }

    /// Stage 3 for `policy` alone, the others' outcome of it being what
    /// `others` says, when that holds whichever of them is older: `None`
    /// when the outcome may depend on their order (an address it last held
    /// is held by another; it pins an address another owner pins or last
    /// held).
    pub(super) fn alone(&self, policy: &'a Arc<Policy>, others: &Others<'_>) -> Option<Alone<'a>> {
        let mut w = resolve_gateway(policy, &self.gateways, &self.namespaces);
        let failed = Alone {
            gateway: None,
            fail_closed: w.fail_closed,
            eips: [None, None],
            node_ip: [false, false],
        };
        if w.failure.is_some() {
            return Some(failed);
        }
        let gw = self.gateways.by_name[w.gateway?].gateway;
        let families = &self.families;
        if check_pools(&w, gw, families).is_some()
            || families
                .iter()
                .any(|f| in_cluster(&w, gw, *f, &self.own).is_some())
        {
            return Some(failed);
        }
        let spec = &policy.egress_ip;
        let owner = policy.id.namespace.as_deref();
        let mut held: HashSet<IpAddr, RandomState> = HashSet::default();
        for family in families {
            let slot = fi(*family);
            if spec.use_node_ip {
                w.node_ip[slot] = true;
            } else if let Some(ip) = pinned(policy, *family) {
                if gw.default_eip(*family) == Some(ip) {
                    return Some(failed);
                }
                let another = |of: &FoldMap<IpAddr, Vec<Option<&str>>>| {
                    of.get(&ip).is_some_and(|os| os.iter().any(|o| *o != owner))
                };
                if another(&others.pins) || another(&others.previous) {
                    return None;
                }
                held.insert(ip);
                w.eips[slot] = Some(ip);
            } else if spec.allocator == Allocator::Default {
                w.eips[slot] = gw.default_eip(*family);
            }
        }
        if spec.allocator == Allocator::RoundRobin && !spec.use_node_ip {
            // Another `rr` policy of the gateway may get its EIP after
            // this one or before it, by age.
            if others.unsettled.contains(gw.name.as_str()) {
                return None;
            }
            // Whether `ip` is free; `None` when that depends on why another
            // policy failed.
            let free = |ip: &IpAddr, family: Family, held: &HashSet<IpAddr, RandomState>| {
                if Some(*ip) == gw.default_eip(family)
                    || held.contains(ip)
                    || others.held.contains(ip)
                    || self.own.holds(*ip)
                {
                    return Some(false);
                }
                (!others.reserved.contains(ip)).then_some(true)
            };
            // Its previous EIPs first, as the stages' first pass takes
            // them; one another holds may be that one's by age alone.
            for family in families {
                let slot = fi(*family);
                if w.eips[slot].is_some() || gw.pool(*family).is_empty() {
                    continue;
                }
                let mut previous = policy.previous_eips.iter().filter(|ip| {
                    Family::of(**ip) == *family
                        && gw.pool(*family).contains(**ip)
                        && Some(**ip) != gw.default_eip(*family)
                        && !self.own.holds(**ip)
                });
                if let Some(ip) = previous.next() {
                    if !free(ip, *family, &held)? {
                        return None;
                    }
                    held.insert(*ip);
                    w.eips[slot] = Some(*ip);
                }
            }
            for family in families {
                let slot = fi(*family);
                if w.eips[slot].is_some() || gw.pool(*family).is_empty() {
                    continue;
                }
                let mut choice = None;
                for ip in gw.pool(*family).iter() {
                    if free(&ip, *family, &held)? {
                        choice = Some(ip);
                        break;
                    }
                }
                match choice {
                    Some(ip) => {
                        held.insert(ip);
                        w.eips[slot] = Some(ip);
                    }
                    None => return Some(failed),
                }
            }
        }
        Some(Alone {
            gateway: w.gateway,
            fail_closed: w.fail_closed,
            eips: w.eips,
            node_ip: w.node_ip,
        })
    }

    /// Whether the stages' outcome for the others stays as it is when the
    /// address `ip` is taken, freed, or named by a status of `owner`'s
    /// policy: no other owner pins it or last held it, and every `rr`
    /// policy of the gateway whose pool holds it keeps its own EIP. An
    /// address a gateway shares by default is never pinned or handed out,
    /// so it always does.
    pub(super) fn settled(&self, ip: IpAddr, owner: Option<&str>, others: &Others<'_>) -> bool {
        let family = Family::of(ip);
        let usable = self
            .gateways
            .by_name
            .values()
            .filter(|info| info.problem.is_none());
        let mut of_pool = None;
        for info in usable {
            if info.gateway.pool(family).contains(ip) {
                if info.gateway.default_eip(family) == Some(ip) {
                    return true;
                }
                of_pool = Some(info.gateway.name.as_str());
            }
        }
        let another = |of: &FoldMap<IpAddr, Vec<Option<&str>>>| {
            of.get(&ip).is_some_and(|os| os.iter().any(|o| *o != owner))
        };
        !another(&others.pins)
            && !another(&others.previous)
            && of_pool.is_none_or(|g| !others.unsettled.contains(g))
    }
}

/// Each namespace's labels, by name.
fn namespace_labels(snapshot: &Snapshot) -> FoldMap<&str, &Labels> {
    snapshot
        .namespaces
        .iter()
        .map(|n| (n.name.as_str(), &n.labels))
        .collect()
}

/// Resolves gateways and allocates EIPs for every valid policy; the result
/// is sorted oldest first.
pub(super) fn allocate<'a>(
    snapshot: &'a Snapshot,
    gateways: &Gateways<'a>,
    cluster: &[IpNet],
) -> Vec<Work<'a>> {
    let own = Own::new(snapshot, cluster);
    let mut policies: Vec<&Arc<Policy>> = snapshot.policies.iter().collect();
    // Oldest first (a stable sort, quick on policies already in that
    // order), then one policy per identity: its oldest copy.
    policies.sort_by(|a, b| (&a.age, &a.id).cmp(&(&b.age, &b.id)));
    let mut seen: HashSet<&PolicyRef, RandomState> =
        HashSet::with_capacity_and_hasher(policies.len(), RandomState::default());
    policies.retain(|p| seen.insert(&p.id));
    drop(seen);
    let namespaces = namespace_labels(snapshot);
    let mut works: Vec<Work<'a>> = policies
        .into_iter()
        .map(|p| resolve_gateway(p, gateways, &namespaces))
        .collect();

    let families: Vec<Family> = snapshot.config.enabled_families().collect();
    for w in works.iter_mut().filter(|w| w.failure.is_none()) {
        let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
        w.failure = check_pools(w, gw, &families)
            .or_else(|| families.iter().find_map(|f| in_cluster(w, gw, *f, &own)));
    }

    // Addresses a pinned or rr policy owns. Usable gateways' pools do not
    // overlap, so an address names its gateway. A policy that cannot be
    // served now keeps its previous EIPs reserved, so it gets them back
    // once it can, instead of finding them handed to another policy.
    let mut held: HashSet<IpAddr, RandomState> = HashSet::default();
    for w in works.iter_mut().filter(|w| w.failure.is_some()) {
        w.reserved.clone_from(&w.policy.previous_eips);
        held.extend(w.reserved.iter().copied());
    }
    // Who owned each address at the last status write.
    let mut owners: FoldMap<IpAddr, Vec<Option<&str>>> = FoldMap::default();
    for w in &works {
        for ip in &w.policy.previous_eips {
            owners
                .entry(*ip)
                .or_default()
                .push(w.policy.id.namespace.as_deref());
        }
    }
    // Pins are granted oldest first; an address granted to one owner is
    // refused to the others.
    let mut granted: FoldMap<IpAddr, Option<&str>> = FoldMap::default();
    for w in works.iter_mut().filter(|w| w.failure.is_none()) {
        let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
        let owner = w.policy.id.namespace.as_deref();
        for family in &families {
            let Some(ip) = pinned(w.policy, *family) else {
                continue;
            };
            if w.policy.egress_ip.use_node_ip {
                continue;
            }
            if gw.default_eip(*family) == Some(ip) {
                w.failure = Some((
                    Reason::EipTaken,
                    format!(
                        "spec.egressIP.{family}: {ip} is EgressGateway {}'s default EIP, shared by \
                         every policy that allocates with `default`; use allocatorPolicy default to \
                         share it, or pin another address",
                        gw.name
                    ),
                ));
                break;
            }
            let other = granted
                .get(&ip)
                .copied()
                .filter(|o| *o != owner)
                .or_else(|| {
                    owners
                        .get(&ip)
                        .filter(|os| !os.contains(&owner))
                        .and_then(|os| os.first().copied())
                });
            if let Some(other) = other {
                let whose = other.map_or_else(
                    || "a cluster policy".to_owned(),
                    |ns| format!("namespace {ns}"),
                );
                w.failure = Some((
                    Reason::EipTaken,
                    format!(
                        "spec.egressIP.{family}: {ip} is in use by {whose}; a policy may pin only \
                         an address that is free or already its own namespace's"
                    ),
                ));
                break;
            }
            granted.insert(ip, owner);
        }
    }
    for w in works.iter_mut().filter(|w| w.failure.is_none()) {
        let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
        for family in &families {
            if w.policy.egress_ip.use_node_ip {
                w.node_ip[fi(*family)] = true;
            } else if let Some(ip) = pinned(w.policy, *family) {
                held.insert(ip);
                w.eips[fi(*family)] = Some(ip);
            } else if w.policy.egress_ip.allocator == Allocator::Default {
                w.eips[fi(*family)] = gw.default_eip(*family);
            }
        }
    }
    for keep_previous in [true, false] {
        for w in works.iter_mut().filter(|w| w.failure.is_none()) {
            if w.policy.egress_ip.allocator == Allocator::RoundRobin
                && !w.policy.egress_ip.use_node_ip
            {
                let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
                round_robin(w, gw, &families, &mut held, keep_previous, &own);
            }
        }
    }
    for w in &mut works {
        if w.failure.is_some() {
            w.eips = [None, None];
            w.node_ip = [false, false];
        }
    }
    works
}

/// Gives an rr policy an EIP of its own in each family that still lacks
/// one: its previous EIP on the first pass, the first free pool address on
/// the second. A policy that cannot get every family gets none, and frees
/// what it took.
fn round_robin(
    w: &mut Work<'_>,
    gw: &Gateway,
    families: &[Family],
    held: &mut HashSet<IpAddr, RandomState>,
    keep_previous: bool,
    own: &Own<'_>,
) {
    for family in families {
        let slot = fi(*family);
        if w.eips[slot].is_some()
            || pinned(w.policy, *family).is_some()
            || gw.pool(*family).is_empty()
        {
            continue;
        }
        let default = gw.default_eip(*family);
        let free = |ip: &IpAddr| Some(*ip) != default && !held.contains(ip) && !own.holds(*ip);
        let choice = if keep_previous {
            let mut previous = w.policy.previous_eips.iter();
            previous
                .find(|ip| {
                    Family::of(**ip) == *family && gw.pool(*family).contains(**ip) && free(ip)
                })
                .copied()
        } else {
            gw.pool(*family).iter().find(free)
        };
        if let Some(ip) = choice {
            held.insert(ip);
            w.eips[slot] = Some(ip);
        } else if !keep_previous {
            for f in families.iter().filter(|f| pinned(w.policy, **f).is_none()) {
                if let Some(ip) = w.eips[fi(*f)].take() {
                    held.remove(&ip);
                }
            }
            w.failure = Some((
                Reason::PoolExhausted,
                format!(
                    "spec.egressIP.allocatorPolicy: rr needs an {family} EIP of its own, \
                     but every address of gateway {}'s pool is taken; add addresses to \
                     spec.ippools.{family} or use allocatorPolicy default",
                    gw.name
                ),
            ));
            return;
        }
    }
}

fn resolve_gateway<'a>(
    policy: &'a Arc<Policy>,
    gateways: &Gateways<'a>,
    namespaces: &FoldMap<&str, &Labels>,
) -> Work<'a> {
    let mut work = Work {
        policy,
        gateway: None,
        failure: None,
        eips: [None, None],
        node_ip: [false, false],
        nodes: [None, None],
        reserved: Vec::new(),
        fail_closed: false,
    };
    let name = match (&policy.gateway, gateways.default) {
        (Some(name), _) => name.as_str(),
        (None, Some(default)) => default,
        (None, None) => {
            work.failure = Some((
                Reason::NoDefaultGateway,
                "spec.egressGatewayName is empty and no EgressGateway has clusterDefault: true; \
                 name a gateway or mark one as the cluster default"
                    .into(),
            ));
            return work;
        }
    };
    match gateways.by_name.get_key_value(name) {
        None => {
            work.failure = Some((
                Reason::GatewayNotFound,
                format!("spec.egressGatewayName: EgressGateway {name:?} does not exist"),
            ));
        }
        Some((key, info)) => {
            work.gateway = Some(key);
            work.fail_closed = info.gateway.fail_closed;
            if let Some((_, why)) = &info.problem {
                work.failure = Some((
                    Reason::GatewayInvalid,
                    format!("EgressGateway {name} is not usable: {why}"),
                ));
            } else if let (Some(ns), Some(selector)) =
                (&policy.id.namespace, &info.gateway.namespace_selector)
            {
                let empty = Labels::new();
                let labels = namespaces.get(ns.as_str()).copied().unwrap_or(&empty);
                if !selector.matches(labels) {
                    work.failure = Some((
                        Reason::NamespaceNotAllowed,
                        format!(
                            "spec.egressGatewayName: EgressGateway {name} does not admit namespace \
                             {ns} (its spec.namespaceSelector does not match the namespace's labels); \
                             ask the gateway's owner, or use another gateway"
                        ),
                    ));
                }
            }
        }
    }
    work
}

/// Checks pinned EIPs against the pools and that the gateway can serve the policy at all.
fn check_pools(w: &Work<'_>, gw: &Gateway, families: &[Family]) -> Option<(Reason, String)> {
    for family in Family::ALL {
        if let Some(ip) = pinned(w.policy, family)
            && !gw.pool(family).contains(ip)
        {
            return Some((
                Reason::EipNotInPool,
                format!(
                    "spec.egressIP.{family}: {ip} is not in EgressGateway {}'s pool spec.ippools.{family}",
                    gw.name
                ),
            ));
        }
    }
    let usable = w.policy.egress_ip.use_node_ip || families.iter().any(|f| !gw.pool(*f).is_empty());
    (!usable).then(|| {
        let enabled = families
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        (
            Reason::NoPool,
            format!(
                "EgressGateway {} has no EIP pool for the enabled families ({enabled})",
                gw.name
            ),
        )
    })
}

/// Why the EIP `w` would take in `family` (pinned, or its gateway's
/// default one) cannot be one: it is the cluster's own.
fn in_cluster(
    w: &Work<'_>,
    gw: &Gateway,
    family: Family,
    own: &Own<'_>,
) -> Option<(Reason, String)> {
    let pinned = pinned(w.policy, family);
    let ip = match pinned {
        Some(ip) => ip,
        None if w.policy.egress_ip.allocator == Allocator::Default
            && !w.policy.egress_ip.use_node_ip =>
        {
            gw.default_eip(family)?
        }
        None => return None,
    };
    let whose = own.whose(ip)?;
    let field = match pinned {
        Some(_) => format!("spec.egressIP.{family}"),
        None => format!(
            "the default EIP of EgressGateway {} (spec.ippools.{family}DefaultEIP, else the \
             pool's first address)",
            gw.name
        ),
    };
    Some((
        Reason::EipInCluster,
        format!("{field}: {ip} {whose}; an EIP must be an address only egressgw uses"),
    ))
}

fn pinned(policy: &Policy, family: Family) -> Option<IpAddr> {
    match family {
        Family::Ipv4 => policy.egress_ip.ipv4.map(IpAddr::V4),
        Family::Ipv6 => policy.egress_ip.ipv6.map(IpAddr::V6),
    }
}

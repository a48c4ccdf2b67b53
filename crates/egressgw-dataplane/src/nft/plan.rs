//! The table as read back ([`Observed`]) and the ops that turn it into a
//! [`FirewallSpec`] ([`plan`]).

use super::*;

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
    /// `count4` / `count6` elements: the counter each names.
    pub count: BTreeMap<ElemKey, String>,
    /// Names of the counter objects.
    pub counters: BTreeSet<String>,
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
/// element ops of each concern are separate kinds: classification
/// ([`FwOp::Classify`]) is what tells which sources were sent somewhere
/// new (see [`crate::conntrack`]).
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
    /// Add a policy's counter object.
    AddCounter(String),
    /// Delete a counter object no policy uses any more (after the elements
    /// that name it).
    DeleteCounter(String),
    /// Add or delete a count element: which counter a source and
    /// destination count in.
    Count(ElemChange, ElemKey, String),
}

pub(super) fn family_suffix(ip: IpAddr) -> char {
    if ip.is_ipv4() { '4' } else { '6' }
}

impl FwOp {
    /// The set or map an element op changes.
    pub(super) fn set_name(&self) -> Option<String> {
        Some(match self {
            FwOp::Cluster(_, r) => format!("cluster{}", family_suffix(r.first())),
            FwOp::Classify(_, k, _) => format!("classify{}", family_suffix(k.src)),
            FwOp::Nat(_, k, Nat::Snat(_)) => format!("snat{}", family_suffix(k.src)),
            FwOp::Nat(_, k, Nat::Masquerade) => format!("masq{}", family_suffix(k.src)),
            FwOp::Count(_, k, _) => format!("count{}", family_suffix(k.src)),
            _ => return None,
        })
    }

    /// The element as nft writes it, with its value when adding.
    pub(super) fn element(&self) -> Option<String> {
        Some(match self {
            FwOp::Cluster(_, r) => r.to_string(),
            FwOp::Classify(ElemChange::Add, k, v) => format!("{k} : {v}"),
            FwOp::Nat(ElemChange::Add, k, Nat::Snat(to)) => format!("{k} : {to}"),
            FwOp::Count(ElemChange::Add, k, counter) => format!("{k} : \"{counter}\""),
            FwOp::Classify(_, k, _) | FwOp::Nat(_, k, _) | FwOp::Count(_, k, _) => k.to_string(),
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
            FwOp::AddCounter(name) => format!("add counter {FAMILY} {TABLE} {name}\n"),
            FwOp::DeleteCounter(name) => format!("delete counter {FAMILY} {TABLE} {name}\n"),
            FwOp::Cluster(change, _)
            | FwOp::Classify(change, ..)
            | FwOp::Nat(change, ..)
            | FwOp::Count(change, ..) => {
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
            FwOp::AddCounter(name) => write!(f, "add counter {name}"),
            FwOp::DeleteCounter(name) => write!(f, "delete counter {name}"),
            FwOp::Cluster(change, ..)
            | FwOp::Classify(change, ..)
            | FwOp::Nat(change, ..)
            | FwOp::Count(change, ..) => {
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

impl Operation for FwOp {
    fn op(&self) -> Op {
        let (kind, object) = match self {
            FwOp::CreateTable { .. } => (OpKind::Table, format!("{FAMILY} {TABLE}")),
            FwOp::AddSet(set) => (OpKind::Set, set.name.to_string()),
            FwOp::AddChain(c) | FwOp::ReplaceChain(c) => (OpKind::Chain, c.name.clone()),
            FwOp::DeleteChain(name) => (OpKind::Chain, name.clone()),
            FwOp::AddCounter(name) | FwOp::DeleteCounter(name) => (OpKind::Counter, name.clone()),
            FwOp::Cluster(_, r) => (
                OpKind::Element,
                format!("{} {{ {r} }}", self.set_name().unwrap_or_default()),
            ),
            FwOp::Classify(_, k, _) | FwOp::Nat(_, k, _) | FwOp::Count(_, k, _) => (
                OpKind::Element,
                format!("{} {{ {k} }}", self.set_name().unwrap_or_default()),
            ),
        };
        Op::new(kind, object, self.to_string())
    }
}

/// The nft script of `ops`, in order.
pub(super) fn script(ops: &[FwOp]) -> String {
    ops.iter().map(FwOp::to_nft).collect()
}

/// The ops that turn `observed` (`None`: no table) into `desired`, in an
/// order one transaction accepts: structure first, then element deletions
/// (interval sets reject an added element that overlaps one not yet
/// deleted, even in the same transaction), then element additions, then
/// chain deletions (a chain cannot go while elements jump to it). A changed
/// element value is a deletion plus an addition. Counter objects are added
/// with the structure and deleted last (an element may name one until its
/// deletion). Equal states plan nothing.
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
    ops.extend(
        desired
            .counters
            .keys()
            .filter(|name| !observed.counters.contains(*name))
            .map(|name| FwOp::AddCounter(name.clone())),
    );
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
    for change in diff(&desired.count, &observed.count) {
        split(change, &mut ops, &mut adds, FwOp::Count);
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
    ops.extend(
        observed
            .counters
            .iter()
            .filter(|name| !desired.counters.contains_key(*name))
            .map(|name| FwOp::DeleteCounter(name.clone())),
    );
    ops
}

/// Deletions go to `deletes`, additions to `adds`; a change is both.
pub(super) fn split<K, V>(
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

/// Carries `op` out on `table` (`None`: absent) as the kernel does, failing
/// as it fails on the mistakes a planner can make (adding what exists,
/// deleting what does not, deleting a chain that elements jump to or a
/// counter that elements name, touching a missing table).
pub(super) fn carry_out(table: &mut Option<Observed>, op: &FwOp) -> Result<(), String> {
    if let FwOp::CreateTable { sets, chains } = op {
        if table.is_some() {
            return Err("File exists".into());
        }
        *table = Some(Observed {
            sets: sets.iter().map(|s| s.name.to_owned()).collect(),
            chains: chains.iter().map(|c| (c.name.clone(), c.state())).collect(),
            ..Observed::default()
        });
        return Ok(());
    }
    let t = table.as_mut().ok_or("No such file or directory")?;
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
        FwOp::AddCounter(name) => {
            exists(t.counters.contains(name), ElemChange::Add)?;
            t.counters.insert(name.clone());
        }
        FwOp::DeleteCounter(name) => {
            if t.count.values().any(|c| c == name) {
                return Err("Device or resource busy".into());
            }
            exists(t.counters.contains(name), ElemChange::Delete)?;
            t.counters.remove(name);
        }
        FwOp::Count(change, k, counter) => {
            exists(t.count.contains_key(k), *change)?;
            if *change == ElemChange::Add && !t.counters.contains(counter) {
                return Err("No such file or directory".into());
            }
            match change {
                ElemChange::Add => t.count.insert(*k, counter.clone()),
                ElemChange::Delete => t.count.remove(k),
            };
        }
    }
    Ok(())
}

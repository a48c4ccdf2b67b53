//! [`FakeFirewall`]: the table in memory.

use super::*;

/// An in-memory table for reconcile tests without root. It keeps what the
/// ops describe and fails like the kernel does on the mistakes a planner
/// can make (adding what exists, deleting what does not, deleting a chain
/// that elements jump to, touching a missing table); the ops in `fail`
/// fail on purpose.
#[derive(Debug, Clone, Default)]
pub struct FakeFirewall {
    /// The table, `None` when absent.
    pub table: Option<Observed>,
    /// Ops that fail.
    pub fail: Vec<FwOp>,
    /// How many `apply` calls carried at least one op.
    pub transactions: usize,
    /// The keys whose unanswered connections were to be forgotten.
    pub forgotten: Vec<ElemKey>,
    /// What the counter objects have counted, by name (an existing counter
    /// missing here reads as zero).
    pub counted: BTreeMap<String, Counter>,
}

impl FakeFirewall {
    pub(super) fn apply_one(&mut self, op: &FwOp) -> Result<(), String> {
        if self.fail.contains(op) {
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
                self.counted.remove(name);
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

    fn counters(&self) -> Result<BTreeMap<String, Counter>> {
        let Some(table) = &self.table else {
            return Ok(BTreeMap::new());
        };
        Ok(table
            .counters
            .iter()
            .map(|name| {
                let counted = self.counted.get(name).copied().unwrap_or_default();
                (name.clone(), counted)
            })
            .collect())
    }

    fn remove(&mut self) -> Result<bool> {
        self.counted.clear();
        Ok(self.table.take().is_some())
    }
}

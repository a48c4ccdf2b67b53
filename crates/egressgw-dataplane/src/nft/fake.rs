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
    /// Whether reading the table fails.
    pub fail_observe: bool,
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
        carry_out(&mut self.table, op)?;
        if let FwOp::DeleteCounter(name) = op {
            self.counted.remove(name);
        }
        Ok(())
    }
}

impl Firewall for FakeFirewall {
    fn forget_unanswered(&mut self, keys: &[ElemKey]) -> std::io::Result<usize> {
        self.forgotten.extend_from_slice(keys);
        Ok(keys.len())
    }

    fn observe(&mut self) -> Result<Option<Arc<Observed>>> {
        if self.fail_observe {
            return Err(Error::Nft {
                what: format!("list table {FAMILY} {TABLE}"),
                message: "injected failure".into(),
            });
        }
        Ok(self.table.clone().map(Arc::new))
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

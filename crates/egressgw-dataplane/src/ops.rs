//! What a reconcile did: the operations it applied and the ones that failed.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// The outcome of one reconcile.
#[derive(Debug, Default, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Operations carried out, as `ip`/`nft`-like text
    /// (`add rule fwmark 0x01000000/0xff000000 lookup 3000`).
    pub applied: Vec<String>,
    /// Operations that failed, each with its object and the kernel's answer.
    pub failed: Vec<Failure>,
    /// Things that work but deserve attention (an old kernel with checksum
    /// offload on, an EIP with no interface to announce it on, ...).
    pub warnings: Vec<String>,
    /// Facts read back after applying, for status and `doctor`
    /// (e.g. `tx-checksumming: off`).
    pub facts: BTreeMap<String, String>,
}

/// One failed operation.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    /// The operation and its object.
    pub op: String,
    /// Why it failed.
    pub error: String,
}

impl Report {
    /// How many operations were planned (applied or failed).
    pub fn ops(&self) -> usize {
        self.applied.len() + self.failed.len()
    }

    /// Whether every planned operation succeeded.
    pub fn is_ok(&self) -> bool {
        self.failed.is_empty()
    }

    /// Records the outcome of `op`.
    pub fn record<E: fmt::Display>(&mut self, op: impl fmt::Display, result: Result<(), E>) {
        match result {
            Ok(()) => {
                tracing::info!(op = %op, "applied");
                self.applied.push(op.to_string());
            }
            Err(e) => {
                tracing::warn!(op = %op, error = %e, "failed");
                self.failed.push(Failure {
                    op: op.to_string(),
                    error: e.to_string(),
                });
            }
        }
    }

    /// Adds a warning.
    pub fn warn(&mut self, message: impl Into<String>) {
        let message = message.into();
        tracing::warn!("{message}");
        self.warnings.push(message);
    }

    /// Folds `other` into this report.
    pub fn merge(&mut self, other: Report) {
        self.applied.extend(other.applied);
        self.failed.extend(other.failed);
        self.warnings.extend(other.warnings);
        self.facts.extend(other.facts);
    }
}

/// Add, change or remove: what a diff of two keyed collections asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<K, V> {
    /// Present only in the desired state.
    Add(K, V),
    /// Present on both sides with different values: `(key, observed, desired)`.
    Change(K, V, V),
    /// Present only in the observed state.
    Remove(K, V),
}

/// The changes that turn `observed` into `desired`: additions and changes in
/// key order, then removals, so new paths exist before old ones go.
pub fn diff<K: Ord + Clone, V: PartialEq + Clone>(
    desired: &BTreeMap<K, V>,
    observed: &BTreeMap<K, V>,
) -> Vec<Change<K, V>> {
    let mut out: Vec<Change<K, V>> = desired
        .iter()
        .filter_map(|(k, d)| match observed.get(k) {
            None => Some(Change::Add(k.clone(), d.clone())),
            Some(o) if o != d => Some(Change::Change(k.clone(), o.clone(), d.clone())),
            Some(_) => None,
        })
        .collect();
    out.extend(
        observed
            .iter()
            .filter(|(k, _)| !desired.contains_key(*k))
            .map(|(k, o)| Change::Remove(k.clone(), o.clone())),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_adds_changes_then_removes() {
        let desired = BTreeMap::from([(1, "a"), (2, "b"), (3, "c")]);
        let observed = BTreeMap::from([(0, "z"), (2, "x"), (3, "c")]);
        assert_eq!(
            diff(&desired, &observed),
            vec![
                Change::Add(1, "a"),
                Change::Change(2, "x", "b"),
                Change::Remove(0, "z"),
            ]
        );
    }

    #[test]
    fn diff_of_equal_maps_is_empty() {
        let m = BTreeMap::from([(1, 1), (2, 2)]);
        assert!(diff(&m, &m).is_empty());
    }

    #[test]
    fn report_counts_applied_and_failed_ops() {
        let mut r = Report::default();
        r.record("add a", Ok::<(), String>(()));
        r.record("add b", Err("EEXIST"));
        assert_eq!(r.ops(), 2);
        assert!(!r.is_ok());
        assert_eq!(r.failed[0].op, "add b");
        assert_eq!(r.failed[0].error, "EEXIST");
    }
}

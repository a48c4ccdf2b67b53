//! What a reconcile did: the operations it applied and the ones that failed.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// What an operation changes: the metrics label and the first thing a
/// person reading a report looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    /// A network device: the tunnel or the EIP device.
    Link,
    /// An address on the tunnel.
    Address,
    /// A neighbour entry (a peer's tunnel IP to its MAC).
    Neighbour,
    /// A forwarding-database entry (a peer's MAC to its underlay address).
    Fdb,
    /// A route in one of egressgw's tables.
    Route,
    /// A policy-routing rule.
    Rule,
    /// A sysctl.
    Sysctl,
    /// A device's offload feature.
    Offload,
    /// An egress IP taken or given up.
    Eip,
    /// The nftables table.
    Table,
    /// An nftables chain.
    Chain,
    /// An nftables set or map.
    Set,
    /// An element of an nftables set or map.
    Element,
    /// A policy's nftables counter object.
    Counter,
    /// An eBPF program attached or detached.
    Program,
    /// The eBPF classifier's map entries.
    Map,
    /// Connection-tracking entries.
    Conntrack,
    /// Reading the kernel's state back (a failure here stops the part of
    /// the reconcile that needed it).
    Read,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 18] = [
        OpKind::Link,
        OpKind::Address,
        OpKind::Neighbour,
        OpKind::Fdb,
        OpKind::Route,
        OpKind::Rule,
        OpKind::Sysctl,
        OpKind::Offload,
        OpKind::Eip,
        OpKind::Table,
        OpKind::Chain,
        OpKind::Set,
        OpKind::Element,
        OpKind::Counter,
        OpKind::Program,
        OpKind::Map,
        OpKind::Conntrack,
        OpKind::Read,
    ];

    /// The kind as metrics and logs write it.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Link => "link",
            OpKind::Address => "address",
            OpKind::Neighbour => "neighbour",
            OpKind::Fdb => "fdb",
            OpKind::Route => "route",
            OpKind::Rule => "rule",
            OpKind::Sysctl => "sysctl",
            OpKind::Offload => "offload",
            OpKind::Eip => "eip",
            OpKind::Table => "table",
            OpKind::Chain => "chain",
            OpKind::Set => "set",
            OpKind::Element => "element",
            OpKind::Counter => "counter",
            OpKind::Program => "program",
            OpKind::Map => "map",
            OpKind::Conntrack => "conntrack",
            OpKind::Read => "read",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One operation as a report keeps it: its kind, the object it concerns
/// (`egress.vxlan`, `ipv4 priority 100`, `classify4 { 10.244.1.2 . 0.0.0.0/0 }`)
/// and the whole of it as `ip`/`nft`-like text
/// (`add rule priority 100 fwmark 0x01000000/0xff000000 lookup 3000`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Op {
    /// What it changes.
    pub kind: OpKind,
    /// The object it concerns.
    pub object: String,
    /// The operation.
    pub text: String,
}

impl Op {
    /// An operation of `kind` on `object`, described by `text`.
    pub fn new(kind: OpKind, object: impl Into<String>, text: impl Into<String>) -> Self {
        Op {
            kind,
            object: object.into(),
            text: text.into(),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Anything a report can record as an [`Op`].
pub trait Operation {
    /// The operation as a report keeps it.
    fn op(&self) -> Op;
}

impl Operation for Op {
    fn op(&self) -> Op {
        self.clone()
    }
}

impl<T: Operation + ?Sized> Operation for &T {
    fn op(&self) -> Op {
        (**self).op()
    }
}

/// Why an operation failed, as far as the kernel's answer tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// The object exists already (another component made it, or a race).
    Exists,
    /// Something the operation needs is not there (a device, a table, an
    /// entry to remove).
    Missing,
    /// Not allowed (a capability missing, a read-only sysctl).
    Denied,
    /// The kernel or the device does not support it.
    Unsupported,
    /// The object is in use.
    Busy,
    /// The kernel rejected the request as invalid.
    Invalid,
    /// Anything else; the message says what.
    Other,
}

impl Cause {
    /// The cause of an operating-system error.
    pub fn of_io(e: &std::io::Error) -> Cause {
        use nix::errno::Errno;
        if let Some(code) = e.raw_os_error() {
            return match Errno::from_raw(code) {
                Errno::EEXIST => Cause::Exists,
                Errno::ENOENT | Errno::ESRCH | Errno::ENODEV | Errno::EADDRNOTAVAIL => {
                    Cause::Missing
                }
                Errno::EPERM | Errno::EACCES | Errno::EROFS => Cause::Denied,
                Errno::EOPNOTSUPP | Errno::EAFNOSUPPORT | Errno::EPROTONOSUPPORT => {
                    Cause::Unsupported
                }
                Errno::EBUSY => Cause::Busy,
                Errno::EINVAL | Errno::ERANGE => Cause::Invalid,
                _ => Cause::Other,
            };
        }
        match e.kind() {
            std::io::ErrorKind::AlreadyExists => Cause::Exists,
            std::io::ErrorKind::NotFound => Cause::Missing,
            std::io::ErrorKind::PermissionDenied => Cause::Denied,
            std::io::ErrorKind::Unsupported => Cause::Unsupported,
            std::io::ErrorKind::InvalidInput => Cause::Invalid,
            _ => Cause::Other,
        }
    }

    /// The cause a tool's message names with the C library's words
    /// (`nft` prints `strerror`).
    pub fn of_message(message: &str) -> Cause {
        const WORDS: &[(&str, Cause)] = &[
            ("File exists", Cause::Exists),
            ("No such file or directory", Cause::Missing),
            ("No such device", Cause::Missing),
            ("No such process", Cause::Missing),
            ("Operation not permitted", Cause::Denied),
            ("Permission denied", Cause::Denied),
            ("Operation not supported", Cause::Unsupported),
            ("Device or resource busy", Cause::Busy),
            ("Invalid argument", Cause::Invalid),
        ];
        WORDS
            .iter()
            .find(|(words, _)| message.contains(words))
            .map_or(Cause::Other, |(_, cause)| *cause)
    }

    /// The cause as metrics and logs write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Exists => "exists",
            Cause::Missing => "missing",
            Cause::Denied => "denied",
            Cause::Unsupported => "unsupported",
            Cause::Busy => "busy",
            Cause::Invalid => "invalid",
            Cause::Other => "other",
        }
    }
}

/// An error a report can record: what it says beside the operation's
/// object, and its cause.
pub trait Failed {
    /// What went wrong (the object is named by the operation).
    fn message(&self) -> String;
    /// Why, as far as it tells.
    fn cause(&self) -> Cause {
        Cause::of_message(&self.message())
    }
}

impl Failed for String {
    fn message(&self) -> String {
        self.clone()
    }
}

impl Failed for &str {
    fn message(&self) -> String {
        (*self).to_owned()
    }
}

impl Failed for std::convert::Infallible {
    fn message(&self) -> String {
        match *self {}
    }
}

/// The outcome of one reconcile.
#[derive(Debug, Default, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Operations carried out.
    pub applied: Vec<Op>,
    /// Operations that failed, each with the kernel's answer.
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
    /// The operation.
    pub op: Op,
    /// Why it failed, as far as the kernel's answer tells.
    pub cause: Cause,
    /// What the kernel (or the tool) said.
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

    /// Records the outcome of `op`. Nothing is logged here: whoever runs
    /// the reconcile logs the report once.
    pub fn record<E: Failed>(&mut self, op: impl Operation, result: Result<(), E>) {
        let op = op.op();
        match result {
            Ok(()) => self.applied.push(op),
            Err(e) => self.failed.push(Failure {
                op,
                cause: e.cause(),
                error: e.message(),
            }),
        }
    }

    /// Records that `op` was carried out.
    pub fn done(&mut self, op: impl Operation) {
        self.applied.push(op.op());
    }

    /// Adds a warning.
    pub fn warn(&mut self, message: impl Into<String>) {
        self.warnings.push(message.into());
    }

    /// Folds `other` into this report.
    pub fn merge(&mut self, other: Report) {
        self.applied.extend(other.applied);
        self.failed.extend(other.failed);
        self.warnings.extend(other.warnings);
        self.facts.extend(other.facts);
    }

    /// Applied and failed operations counted by kind: `(applied, failed)`.
    pub fn by_kind(&self) -> BTreeMap<OpKind, (u64, u64)> {
        let mut out: BTreeMap<OpKind, (u64, u64)> = BTreeMap::new();
        for op in &self.applied {
            out.entry(op.kind).or_default().0 += 1;
        }
        for f in &self.failed {
            out.entry(f.op.kind).or_default().1 += 1;
        }
        out
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
    fn report_counts_applied_and_failed_ops_by_kind_and_keeps_the_cause() {
        let mut r = Report::default();
        r.record(Op::new(OpKind::Route, "a", "add a"), Ok::<(), String>(()));
        r.record(
            Op::new(OpKind::Rule, "b", "add b"),
            Err("Error: Could not process rule: File exists"),
        );
        r.done(Op::new(OpKind::Rule, "c", "add c"));
        assert_eq!(r.ops(), 3);
        assert!(!r.is_ok());
        assert_eq!(r.failed[0].op.text, "add b");
        assert_eq!(r.failed[0].cause, Cause::Exists);
        assert_eq!(
            r.by_kind(),
            BTreeMap::from([(OpKind::Route, (1, 0)), (OpKind::Rule, (1, 1))])
        );
    }

    #[test]
    fn every_kind_is_listed_once_under_a_name_of_its_own() {
        let names: std::collections::BTreeSet<&str> =
            OpKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), OpKind::ALL.len());
        let kinds: std::collections::BTreeSet<OpKind> = OpKind::ALL.into_iter().collect();
        assert_eq!(kinds.len(), OpKind::ALL.len());
    }

    #[test]
    fn causes_come_from_the_errno_or_the_c_librarys_words() {
        let io = |code| std::io::Error::from_raw_os_error(code);
        assert_eq!(Cause::of_io(&io(nix::libc::EEXIST)), Cause::Exists);
        assert_eq!(Cause::of_io(&io(nix::libc::ESRCH)), Cause::Missing);
        assert_eq!(Cause::of_io(&io(nix::libc::EPERM)), Cause::Denied);
        assert_eq!(Cause::of_io(&io(nix::libc::EOPNOTSUPP)), Cause::Unsupported);
        assert_eq!(Cause::of_io(&io(nix::libc::EIO)), Cause::Other);
        assert_eq!(
            Cause::of_message("Error: Could not process rule: No such file or directory"),
            Cause::Missing
        );
        assert_eq!(Cause::of_message("syntax error"), Cause::Other);
    }
}

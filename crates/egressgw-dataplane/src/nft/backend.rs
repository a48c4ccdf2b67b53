//! The [`Firewall`] seam and its real backend, the `nft` binary, with the
//! parser of its JSON listing.

use super::*;

/// egressgw's nftables table, as a reconcile sees it. On the eBPF datapath
/// the table keeps its classification as a backstop and gets a prerouting
/// chain of its own ([`crate::classify`]).
pub trait Firewall {
    /// Reads the table; `None` when it does not exist. What is read is
    /// shared with the backend, which may keep it for the next reading:
    /// dropped before [`Firewall::apply`], it is changed in place rather
    /// than copied.
    fn observe(&mut self) -> Result<Option<Arc<Observed>>>;

    /// Applies `ops` in one transaction; when that fails, applies each op in
    /// a transaction of its own so every failure is reported with its op
    /// and the other ops still land.
    fn apply(&mut self, ops: &[FwOp]) -> Report;

    /// Deletes the table; returns whether it existed.
    fn remove(&mut self) -> Result<bool>;

    /// Deletes the conntrack entries under `keys` that never saw an answer
    /// (see [`crate::conntrack`]); returns how many went.
    fn forget_unanswered(&mut self, keys: &[ElemKey]) -> std::io::Result<usize>;

    /// The packets and bytes of each counter object, by name (none when
    /// the table does not exist).
    fn counters(&self) -> Result<BTreeMap<String, Counter>>;
}

/// How long the real backend trusts what it knows of the table without
/// reading it back ([`Nft`]).
pub const READ_BACK_EVERY: Duration = Duration::from_secs(30);

/// The real backend: runs the `nft` binary in the caller's network
/// namespace.
///
/// Reading the table back costs what its elements do: at 17 000 SNAT
/// entries, `nft -j list table` takes a quarter of a second and prints
/// 1.5 MB of JSON. So the backend keeps what it read last, changed by the
/// transactions it carried out since, with the ruleset's
/// [`generation`](super::generation) they left: the kernel counts every
/// transaction committed in the namespace, whoever sends it. While the
/// generation is the one it knows, nothing in the ruleset changed and
/// [`Firewall::observe`] reads nothing back. A transaction of anyone else
/// (an element or a chain of this table edited by hand, the table deleted,
/// any other table changed), a transaction of its own that another one
/// came between or that failed, and [`READ_BACK_EVERY`] past the last
/// read, each make the next observation read everything back.
#[derive(Debug, Clone)]
pub struct Nft {
    binary: String,
    known: Option<Known>,
    /// How many times the table was read back whole.
    reads: u64,
}

/// The table as last read back, with what was applied since, and the
/// ruleset's generation then.
#[derive(Debug, Clone)]
struct Known {
    table: Option<Arc<Observed>>,
    generation: u32,
    read: Instant,
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
            known: None,
            reads: 0,
        }
    }

    /// How many times the table was read back whole.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// Reads the table back whole.
    fn read(&mut self) -> Result<Option<Arc<Observed>>> {
        self.reads += 1;
        let what = format!("list table {FAMILY} {TABLE}");
        match self.run(&what, &["-j", "list", "table", FAMILY, TABLE], "") {
            Ok(json) => parse_table(&json).map(|table| Some(Arc::new(table))),
            Err(e) if is_missing(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Carries `ops`, committed in the kernel from generation `before` to
    /// `after`, out on what is known; forgets it instead when another
    /// transaction may have come between.
    fn applied(&mut self, ops: &[FwOp], before: Option<u32>, after: Option<u32>) {
        let Some(known) = &mut self.known else {
            return;
        };
        let alone = before == Some(known.generation) && after == before.map(generation::next);
        if !alone {
            self.known = None;
            return;
        }
        let mut table = known.table.take().map(Arc::unwrap_or_clone);
        for op in ops {
            if let Err(e) = carry_out(&mut table, op) {
                tracing::debug!(op = %op, error = e, "the table is read back next");
                self.known = None;
                return;
            }
        }
        known.table = table.map(Arc::new);
        known.generation = after.expect("alone");
    }

    /// Runs `nft <args>` with `stdin` as input; returns stdout.
    pub(super) fn run(&self, what: &str, args: &[&str], stdin: &str) -> Result<String> {
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
            // Taken as it is, not copied: a listing of the table can be
            // megabytes.
            Ok(String::from_utf8(out.stdout)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
        } else {
            Err(err(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
        }
    }

    /// Asks the kernel whether it takes `spec`'s whole table, creating
    /// nothing: the table, under the name `egressgw_check`, goes to the
    /// kernel in a check-only transaction (`nft -c`), which the kernel
    /// validates expression by expression and then aborts.
    pub fn check(&self, spec: &FirewallSpec) -> Result<()> {
        let table = format!("{FAMILY} {TABLE}");
        let script: String = spec
            .render()
            .lines()
            .map(|line| {
                let renamed = match line.strip_suffix(table.as_str()) {
                    Some(head) => format!("{head}{table}_check"),
                    None => line.replacen(&format!("{table} "), &format!("{table}_check "), 1),
                };
                renamed + "\n"
            })
            .collect();
        self.run("check the table", &["-c", "-f", "-"], &script)
            .map(drop)
    }

    /// Runs one transaction.
    pub(super) fn transaction(&self, what: &str, ops: &[FwOp]) -> Result<()> {
        self.run(what, &["-f", "-"], &script(ops)).map(drop)
    }
}

/// Whether an `nft` error says the table does not exist.
pub(super) fn is_missing(e: &Error) -> bool {
    // Not "spawn nft: No such file or directory": a missing binary is an error.
    matches!(e, Error::Nft { message, .. }
        if message.contains("No such file or directory") && !message.starts_with("spawn "))
}

impl Firewall for Nft {
    fn forget_unanswered(&mut self, keys: &[ElemKey]) -> std::io::Result<usize> {
        crate::conntrack::forget_unanswered(keys)
    }

    fn observe(&mut self) -> Result<Option<Arc<Observed>>> {
        let now = generation().ok();
        if let Some(known) = &self.known
            && now == Some(known.generation)
            && known.read.elapsed() < READ_BACK_EVERY
        {
            return Ok(known.table.clone());
        }
        // What was known goes before the table is read again, not after:
        // the two are never held at once.
        self.known = None;
        let table = self.read()?;
        self.known = now.map(|generation| Known {
            table: table.clone(),
            generation,
            read: Instant::now(),
        });
        Ok(table)
    }

    fn apply(&mut self, ops: &[FwOp]) -> Report {
        let mut report = Report::default();
        if ops.is_empty() {
            return report;
        }
        let before = generation().ok();
        match self.transaction("transaction", ops) {
            Ok(()) => {
                for op in ops {
                    report.done(op);
                }
                self.applied(ops, before, generation().ok());
            }
            Err(e) => {
                self.known = None;
                report.warn(format!(
                    "nftables transaction of {} ops failed, applying them one by one: {e}",
                    ops.len()
                ));
                for op in ops {
                    let result = self.transaction(&op.to_string(), std::slice::from_ref(op));
                    report.record(op, result);
                }
            }
        }
        report
    }

    fn counters(&self) -> Result<BTreeMap<String, Counter>> {
        let what = format!("list counters table {FAMILY} {TABLE}");
        let args = ["-j", "list", "counters", "table", FAMILY, TABLE];
        match self.run(&what, &args, "") {
            Ok(json) => parse_counters(&json),
            Err(e) if is_missing(&e) => Ok(BTreeMap::new()),
            Err(e) => Err(e),
        }
    }

    fn remove(&mut self) -> Result<bool> {
        self.known = None;
        let what = format!("delete table {FAMILY} {TABLE}");
        match self.run(&what, &["delete", "table", FAMILY, TABLE], "") {
            Ok(_) => Ok(true),
            Err(e) if is_missing(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

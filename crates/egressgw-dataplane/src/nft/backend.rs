//! The [`Firewall`] seam and its real backend, the `nft` binary, with the
//! parser of its JSON listing.

use super::*;

/// egressgw's nftables table, as a reconcile sees it. On the eBPF datapath
/// the table keeps its classification as a backstop and gets a prerouting
/// chain of its own ([`crate::classify`]).
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
    table: Option<Observed>,
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
    fn read(&mut self) -> Result<Option<Observed>> {
        self.reads += 1;
        let what = format!("list table {FAMILY} {TABLE}");
        match self.run(&what, &["-j", "list", "table", FAMILY, TABLE], "") {
            Ok(json) => parse_table(&json).map(Some),
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
        for op in ops {
            if let Err(e) = carry_out(&mut known.table, op) {
                tracing::debug!(op = %op, error = e, "the table is read back next");
                self.known = None;
                return;
            }
        }
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
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
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

    fn observe(&mut self) -> Result<Option<Observed>> {
        let now = generation().ok();
        if let Some(known) = &self.known
            && now == Some(known.generation)
            && known.read.elapsed() < READ_BACK_EVERY
        {
            return Ok(known.table.clone());
        }
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

/// Parses `nft -j list table inet egressgw` into canonical form.
///
/// Interval elements come back as a plain address, a `prefix` object or a
/// `range` object (nft prints a range that is exactly one prefix as the
/// prefix); all three become an [`IpRange`]. Elements egressgw cannot
/// read (a source that is not one address) are skipped with a warning.
pub fn parse_table(json: &str) -> Result<Observed> {
    let items = listing(json, "table")?;
    let mut obs = Observed::default();
    for item in items {
        if let Some(set) = item.get("set").or_else(|| item.get("map")) {
            parse_set(set, &mut obs);
        } else if let Some(counter) = item.get("counter") {
            obs.counters.insert(str_field(counter, "name"));
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

/// Parses `nft -j list counters table inet egressgw`: each counter
/// object's packets and bytes, by name.
pub fn parse_counters(json: &str) -> Result<BTreeMap<String, Counter>> {
    Ok(listing(json, "counters table")?
        .iter()
        .filter_map(|item| item.get("counter"))
        .map(|c| {
            let number = |key: &str| c.get(key).and_then(Value::as_u64).unwrap_or_default();
            let counter = Counter {
                packets: number("packets"),
                bytes: number("bytes"),
            };
            (str_field(c, "name"), counter)
        })
        .collect())
}

/// The items of `nft -j list <what> inet egressgw`.
fn listing(json: &str, what: &str) -> Result<Vec<Value>> {
    let bad = |message: String| Error::Nft {
        what: format!("parse list {what} {FAMILY} {TABLE}"),
        message,
    };
    let mut root: Value = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    match root.get_mut("nftables").map(Value::take) {
        Some(Value::Array(items)) => Ok(items),
        _ => Err(bad("no \"nftables\" array".into())),
    }
}

pub(super) fn str_field(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

pub(super) fn parse_set(set: &Value, obs: &mut Observed) {
    let name = str_field(set, "name");
    let elems = set.get("elem").and_then(Value::as_array);
    for elem in elems.into_iter().flatten() {
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
            ("count4" | "count6", Some(v)) => {
                if let Some(counter) = v.as_str() {
                    obs.count.insert(k, counter.to_owned());
                }
            }
            _ => {}
        }
    }
    obs.sets.insert(name);
}

/// `{"concat": [src, dst]}` with a single-address source.
pub(super) fn parse_concat(key: &Value) -> Option<ElemKey> {
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
pub(super) fn parse_range(v: &Value) -> Option<IpRange> {
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

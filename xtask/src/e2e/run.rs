//! What a scenario works with: the lab, its objects through kubectl, traffic
//! checks that poll until a deadline, and a list of things to undo when the
//! scenario ends, whatever its outcome.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use serde_json::Value;

use super::traffic::{self, Expect};
use crate::lab::session::Lab;
use crate::lab::topology::{ExternalLeg, Netns};
use crate::lab::{egressgw, pods};

/// Field manager of everything the e2e tests apply.
const FIELD_MANAGER: &str = "egressgw-e2e";
/// How often a condition is checked again while waiting for it.
const POLL: Duration = Duration::from_millis(200);
/// How long traffic and status get to reach what a scenario expects.
pub const SETTLE: Duration = Duration::from_secs(30);

/// Something a scenario changed that must be undone at its end.
#[derive(Debug, Clone)]
pub enum Undo {
    /// Delete an object: `kind`, namespace (none for cluster-scoped), name.
    Object(&'static str, Option<String>, String),
    /// Delete a pod `lab pod add` made.
    Pod(String),
    /// Set a node's links up again.
    NodeUp(String),
    /// Start a node's agent again, if it is not running.
    Agent(String),
    /// Thaw a frozen control-plane process.
    Thaw(String),
    /// Thaw the frozen controller pods.
    ThawControllers,
    /// Thaw a node's frozen agent.
    ThawAgent(String),
    /// Set a node's underlay link up again.
    UnderlayUp(String),
}

/// One scenario's run.
#[derive(Debug)]
pub struct Run<'a> {
    pub lab: &'a mut Lab,
    /// The addresses this scenario's gateway may use: its own slice of the
    /// free range, so no scenario sees another's EIP.
    pub pool: Vec<Ipv4Addr>,
    /// The IPv6 siblings of `pool` in a dual-stack lab, else none.
    pub pool6: Vec<Ipv6Addr>,
    undo: Vec<Undo>,
    notes: Vec<String>,
}

impl<'a> Run<'a> {
    pub fn new(lab: &'a mut Lab, pool: Vec<Ipv4Addr>, pool6: Vec<Ipv6Addr>) -> Self {
        Self {
            lab,
            pool,
            pool6,
            undo: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Forgets the objects this run applied, for a scenario that removes
    /// them some other way (with their CRDs).
    pub fn forget_objects(&mut self) {
        self.undo.retain(|u| !matches!(u, Undo::Object(..)));
    }

    /// A line printed under the scenario's result: a measurement, a count.
    pub fn note(&mut self, text: impl Into<String>) {
        self.notes.push(text.into());
    }

    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The pool as a range entry, `first-last`.
    pub fn pool_range(&self) -> String {
        range(&self.pool)
    }

    /// The IPv6 pool as a range entry (empty in a single-stack lab).
    pub fn pool6_range(&self) -> String {
        range(&self.pool6)
    }

    pub fn target(&self) -> SocketAddr {
        let t = &self.lab.state.topology.target;
        SocketAddr::from((t.ip, t.whoami_port))
    }

    pub fn iperf3_target(&self) -> SocketAddr {
        let t = &self.lab.state.topology.target;
        SocketAddr::from((t.ip, t.iperf3_port))
    }

    /// The target's IPv6 whoami service: an error in a single-stack lab.
    pub fn target6(&self) -> anyhow::Result<SocketAddr> {
        let t = &self.lab.state.topology.target;
        let ip6 = t.ip6.context("the lab is not dual-stack (`--ipv6`)")?;
        Ok(SocketAddr::from((ip6, t.whoami_port)))
    }

    /// The target's IPv6 iperf3 server.
    pub fn iperf3_target6(&self) -> anyhow::Result<SocketAddr> {
        let t = &self.lab.state.topology.target;
        Ok(SocketAddr::new(self.target6()?.ip(), t.iperf3_port))
    }

    // ---- objects ----

    /// Server-side applies `object` (written as YAML) and remembers to delete it.
    pub fn apply(&mut self, object: &Value) -> anyhow::Result<()> {
        let undo = undo_of(object)?;
        if !self.undo.iter().any(|u| same(u, &undo)) {
            self.undo.push(undo);
        }
        let yaml = serde_yaml::to_string(object).context("writing the object as YAML")?;
        let args = [
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager",
            FIELD_MANAGER,
            "-f",
            "-",
        ];
        self.lab
            .kubectl
            .run_with_input(&args, Some(&yaml))
            .map(drop)
            .with_context(|| format!("applying {}", describe(object)))
    }

    /// Remembers to delete an object something other than [`Run::apply`]
    /// may create.
    pub fn delete_on_cleanup(&mut self, kind: &'static str, namespace: Option<&str>, name: &str) {
        let undo = Undo::Object(kind, namespace.map(str::to_owned), name.to_owned());
        if !self.undo.iter().any(|u| same(u, &undo)) {
            self.undo.push(undo);
        }
    }

    /// Applies `object`, expecting the API server to refuse it; returns its
    /// error message. Fails if the object was accepted (and deletes it).
    pub fn apply_rejected(&mut self, object: &Value) -> anyhow::Result<String> {
        let yaml = serde_yaml::to_string(object).context("writing the object as YAML")?;
        let args = [
            "apply",
            "--server-side",
            "--field-manager",
            FIELD_MANAGER,
            "-f",
            "-",
        ];
        let output = self.lab.kubectl.output(&args, Some(&yaml))?;
        if output.status.success() {
            self.undo.push(undo_of(object)?);
            bail!("the API server accepted {}:\n{yaml}", describe(object));
        }
        Ok(String::from_utf8_lossy(&output.stderr).trim().to_owned())
    }

    /// Deletes an object and waits until it is gone.
    pub fn delete(
        &mut self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> anyhow::Result<()> {
        let mut args = vec!["delete", kind, name, "--ignore-not-found", "--timeout=30s"];
        if let Some(ns) = namespace {
            args.extend(["--namespace", ns]);
        }
        self.lab
            .kubectl
            .run(&args)
            .map(drop)
            .with_context(|| format!("deleting {kind} {name}"))
    }

    /// An object as JSON.
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> anyhow::Result<Value> {
        let mut args = vec!["get", kind, name, "-o", "json"];
        if let Some(ns) = namespace {
            args.extend(["--namespace", ns]);
        }
        let text = self.lab.kubectl.run(&args)?;
        serde_json::from_str(&text).with_context(|| format!("parsing {kind} {name}"))
    }

    /// The notes of the Events (`events.k8s.io/v1`) with `reason` about
    /// the object `kind`/`name` in `namespace` (cluster-scoped objects'
    /// Events are in `default`), oldest first.
    pub fn event_notes(
        &self,
        namespace: Option<&str>,
        kind: &str,
        name: &str,
        reason: &str,
    ) -> anyhow::Result<Vec<String>> {
        let text = self.lab.kubectl.run(&[
            "get",
            "events.events.k8s.io",
            "--namespace",
            namespace.unwrap_or("default"),
            "-o",
            "json",
        ])?;
        let list: Value = serde_json::from_str(&text).context("parsing the Event list")?;
        let mut events: Vec<(String, String)> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| {
                e["reason"] == reason
                    && e["regarding"]["kind"] == kind
                    && e["regarding"]["name"] == name
            })
            .map(|e| {
                let at = e["eventTime"].as_str().unwrap_or_default().to_owned();
                (at, e["note"].as_str().unwrap_or_default().to_owned())
            })
            .collect();
        events.sort();
        Ok(events.into_iter().map(|(_, note)| note).collect())
    }

    // ---- the lab ----

    pub fn add_pod(
        &mut self,
        name: &str,
        namespace: &str,
        node: &str,
        labels: &str,
    ) -> anyhow::Result<()> {
        self.undo.push(Undo::Pod(name.to_owned()));
        let labels = pods::parse_labels(labels)?;
        pods::add(self.lab, name, namespace, node, labels).map(drop)
    }

    pub fn node_links(&mut self, node: &str, up: bool) -> anyhow::Result<()> {
        if !up {
            self.undo.push(Undo::NodeUp(node.to_owned()));
        }
        egressgw::set_node_links(&self.lab.state.topology, self.lab.node(node)?, up).map(drop)
    }

    /// Sets only `node`'s underlay link up or down (see
    /// [`egressgw::set_node_underlay`]).
    pub fn node_underlay(&mut self, node: &str, up: bool) -> anyhow::Result<()> {
        if !up {
            self.undo.push(Undo::UnderlayUp(node.to_owned()));
        }
        egressgw::set_node_underlay(&self.lab.state.topology, self.lab.node(node)?, up)
    }

    /// Freezes or thaws a control-plane process (`kube-apiserver`).
    pub fn freeze(&mut self, process: &str, frozen: bool) -> anyhow::Result<u32> {
        if frozen {
            self.undo.push(Undo::Thaw(process.to_owned()));
        }
        egressgw::freeze_control_plane(self.lab, process, frozen)
    }

    /// Freezes or thaws the egressgw controller pods.
    pub fn freeze_controllers(&mut self, frozen: bool) -> anyhow::Result<Vec<u32>> {
        if frozen {
            self.undo.push(Undo::ThawControllers);
        }
        egressgw::freeze_controllers(self.lab, frozen)
    }

    /// Freezes or thaws the agent of `node` (its kernel state stays).
    pub fn freeze_agent(&mut self, node: &str, frozen: bool) -> anyhow::Result<u32> {
        if frozen {
            self.undo.push(Undo::ThawAgent(node.to_owned()));
        }
        egressgw::freeze_agent(self.lab, node, frozen)
    }

    pub fn kill_agent(&mut self, node: &str) -> anyhow::Result<u32> {
        self.undo.push(Undo::Agent(node.to_owned()));
        egressgw::kill_agent(self.lab, node)
    }

    /// Lets a node's killed agent run again; returns its log and where the
    /// new process's output starts in it.
    pub fn start_agent(&mut self, node: &str) -> anyhow::Result<(std::path::PathBuf, u64)> {
        egressgw::start_agent(self.lab, node)
    }

    /// The lab's nodes, by name.
    pub fn nodes(&self) -> Vec<String> {
        let nodes = &self.lab.state.topology.nodes;
        nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// The lab's first two gateway-capable nodes.
    pub fn two_gateway_nodes(&self) -> anyhow::Result<(String, String)> {
        let nodes = &self.lab.state.topology.nodes;
        let gateways: Vec<&str> = nodes
            .iter()
            .filter(|n| n.gateway)
            .map(|n| n.name.as_str())
            .collect();
        match gateways.as_slice() {
            [first, second, ..] => Ok(((*first).to_owned(), (*second).to_owned())),
            _ => bail!("the lab needs two gateway nodes, it has {gateways:?}"),
        }
    }

    pub fn netns(&self, pod: &str) -> anyhow::Result<Netns> {
        self.lab.pod_netns(pod).cloned()
    }

    // ---- traffic ----

    /// What the target sees from `pod` when no policy covers it: its node's
    /// external address on a gateway node, no answer elsewhere.
    pub fn normal_way(&self, pod: &str) -> anyhow::Result<Expect> {
        let external = self.pods_external_leg(pod)?;
        Ok(external.map_or(Expect::NoAnswer, |e| Expect::Source(e.ip.into())))
    }

    /// [`Run::normal_way`] for IPv6: its node's external IPv6 address, or no answer.
    pub fn normal_way6(&self, pod: &str) -> anyhow::Result<Expect> {
        let external = self.pods_external_leg(pod)?;
        Ok(match external {
            Some(e) => Expect::Source(e.ip6.context("the lab is not dual-stack")?.into()),
            None => Expect::NoAnswer,
        })
    }

    /// The external leg of `pod`'s node, if it has one.
    fn pods_external_leg(&self, pod: &str) -> anyhow::Result<Option<&ExternalLeg>> {
        let topo = &self.lab.state.topology;
        let pod = topo
            .pods
            .iter()
            .find(|p| p.name == pod)
            .with_context(|| format!("the lab has no pod {pod}"))?;
        Ok(topo.node(&pod.node)?.external.as_ref())
    }

    /// Polls whoami from every pod of `expected` (in parallel) until each
    /// sees what it should, at once; fails after `SETTLE` with what each saw last.
    pub fn expect_sources(&self, expected: &[(&str, Expect)]) -> anyhow::Result<()> {
        self.expect_sources_at(self.target(), expected)
    }

    /// [`Run::expect_sources`] against whoami at `target` (e.g. [`Run::target6`]).
    pub fn expect_sources_at(
        &self,
        target: SocketAddr,
        expected: &[(&str, Expect)],
    ) -> anyhow::Result<()> {
        let netns: Vec<Netns> = expected
            .iter()
            .map(|(pod, _)| self.netns(pod))
            .collect::<anyhow::Result<_>>()?;
        let refs: Vec<&Netns> = netns.iter().collect();
        eventually("the target to see the expected sources", SETTLE, || {
            let seen = traffic::whoami_all(&refs, target);
            let wrong: Vec<String> = expected
                .iter()
                .zip(&seen)
                .filter(|((_, want), got)| !got.is(want))
                .map(|((pod, want), got)| format!("{pod}: wanted {want}, saw {got}"))
                .collect();
            if wrong.is_empty() {
                Ok(())
            } else {
                Err(wrong.join("; "))
            }
        })
    }

    /// [`Run::expect_sources`] with the same expectation for several pods.
    pub fn expect_all(&self, pods: &[&str], expected: Expect) -> anyhow::Result<()> {
        let pairs: Vec<(&str, Expect)> = pods.iter().map(|p| (*p, expected)).collect();
        self.expect_sources(&pairs)
    }

    /// Every pod in `pods` leaves the normal way.
    pub fn expect_normal(&self, pods: &[&str]) -> anyhow::Result<()> {
        let pairs: Vec<(&str, Expect)> = pods
            .iter()
            .map(|p| self.normal_way(p).map(|e| (*p, e)))
            .collect::<anyhow::Result<_>>()?;
        self.expect_sources(&pairs)
    }

    /// `count` probes in a row from `pod`, each of which must see `expected`
    /// (for "stays so", after [`Run::expect_sources`] said "became so").
    pub fn expect_steady(&self, pod: &str, expected: Expect, count: usize) -> anyhow::Result<()> {
        let netns = self.netns(pod)?;
        for i in 1..=count {
            let seen = traffic::whoami(&netns, self.target());
            if !seen.is(&expected) {
                bail!("{pod}: probe {i} of {count} saw {seen}, wanted {expected}");
            }
        }
        Ok(())
    }

    // ---- status ----

    /// Waits until the policy is `Ready=True` with an IPv4 EIP and a node;
    /// returns them.
    pub fn wait_policy_ready(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> anyhow::Result<PolicyStatus> {
        eventually(&format!("{kind} {name} to be Ready"), SETTLE, || {
            let object = self
                .get(kind, namespace, name)
                .map_err(|e| format!("{e:#}"))?;
            let status = PolicyStatus::of(&object);
            match (&status.ready, status.eip, &status.node) {
                (Some((true, _)), Some(_), Some(_)) => Ok(status),
                _ => Err(format!("status: {status}")),
            }
        })
    }

    /// Waits until the policy's condition `kind` has reason `reason`.
    pub fn wait_reason(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        reason: &str,
    ) -> anyhow::Result<Value> {
        eventually(&format!("{kind} {name} to report {reason}"), SETTLE, || {
            let object = self
                .get(kind, namespace, name)
                .map_err(|e| format!("{e:#}"))?;
            let conditions = object["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if conditions.iter().any(|c| c["reason"] == reason) {
                Ok(object)
            } else {
                Err(format!("conditions: {}", Value::Array(conditions)))
            }
        })
    }

    /// Undoes what the scenario changed, last first; keeps going past
    /// failures and returns them all.
    pub fn clean_up(&mut self) -> Vec<anyhow::Error> {
        let mut errors = Vec::new();
        while let Some(undo) = self.undo.pop() {
            let result = match &undo {
                Undo::Object(kind, ns, name) => self.delete(kind, ns.as_deref(), name),
                Undo::Pod(name) => match pods::delete(self.lab, name) {
                    Err(e) if e.to_string().contains("has no pod named") => Ok(()),
                    other => other.map(drop),
                },
                Undo::NodeUp(node) => self.node_links(node, true),
                Undo::Agent(node) => restart_if_dead(self.lab, node),
                Undo::Thaw(process) => {
                    egressgw::freeze_control_plane(self.lab, process, false).map(drop)
                }
                Undo::ThawControllers => egressgw::freeze_controllers(self.lab, false).map(drop),
                Undo::ThawAgent(node) => egressgw::freeze_agent(self.lab, node, false).map(drop),
                Undo::UnderlayUp(node) => self.node_underlay(node, true),
            };
            if let Err(e) = result {
                errors.push(e.context(format!("cleaning up ({undo:?})")));
            }
        }
        errors
    }
}

/// `first-last` of `pool`, or nothing for an empty one.
fn range<T: std::fmt::Display>(pool: &[T]) -> String {
    match (pool.first(), pool.last()) {
        (Some(first), Some(last)) => format!("{first}-{last}"),
        _ => String::new(),
    }
}

fn restart_if_dead(lab: &Lab, node: &str) -> anyhow::Result<()> {
    egressgw::release_agent(lab, node)
}

/// What a policy's status says.
#[derive(Debug, Clone)]
pub struct PolicyStatus {
    pub eip: Option<Ipv4Addr>,
    pub eip6: Option<Ipv6Addr>,
    pub node: Option<String>,
    /// The `Ready` condition: (status is True, reason).
    pub ready: Option<(bool, String)>,
}

impl PolicyStatus {
    pub fn of(object: &Value) -> Self {
        let status = &object["status"];
        let ready = status["conditions"]
            .as_array()
            .and_then(|all| all.iter().find(|c| c["type"] == "Ready"))
            .map(|c| {
                (
                    c["status"] == "True",
                    c["reason"].as_str().unwrap_or_default().to_owned(),
                )
            });
        Self {
            eip: status["eip"]["ipv4"].as_str().and_then(|s| s.parse().ok()),
            eip6: status["eip"]["ipv6"].as_str().and_then(|s| s.parse().ok()),
            node: status["node"]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
            ready,
        }
    }
}

impl std::fmt::Display for PolicyStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut eip = self.eip.map_or("-".to_owned(), |e| e.to_string());
        if let Some(eip6) = self.eip6 {
            eip = format!("{eip} and {eip6}");
        }
        let ready = self.ready.as_ref().map_or("-".to_owned(), |(ok, reason)| {
            format!("{}/{reason}", if *ok { "True" } else { "False" })
        });
        write!(
            f,
            "eip {eip}, node {}, Ready {ready}",
            self.node.as_deref().unwrap_or("-")
        )
    }
}

/// Calls `check` every [`POLL`] until it returns `Ok`, or fails after
/// `timeout` with the last thing it saw.
pub fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> anyhow::Result<T> {
    let begun = Instant::now();
    loop {
        let last = match check() {
            Ok(value) => return Ok(value),
            Err(last) => last,
        };
        if begun.elapsed() > timeout {
            return Err(anyhow!(
                "waited {:.0}s for {what}; last seen: {last}",
                timeout.as_secs_f64()
            ));
        }
        thread::sleep(POLL);
    }
}

/// `Kind namespace/name` of an object, for messages.
fn describe(object: &Value) -> String {
    let meta = &object["metadata"];
    let name = meta["name"].as_str().unwrap_or("?");
    let kind = object["kind"].as_str().unwrap_or("?");
    match meta["namespace"].as_str() {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

fn undo_of(object: &Value) -> anyhow::Result<Undo> {
    let kind = match object["kind"].as_str() {
        Some("EgressGateway") => "egressgateway",
        Some("EgressPolicy") => "egresspolicy",
        Some("EgressClusterPolicy") => "egressclusterpolicy",
        other => bail!("the e2e tests do not apply objects of kind {other:?}"),
    };
    let meta = &object["metadata"];
    let name = meta["name"]
        .as_str()
        .context("an object without metadata.name")?;
    Ok(Undo::Object(
        kind,
        meta["namespace"].as_str().map(str::to_owned),
        name.to_owned(),
    ))
}

fn same(a: &Undo, b: &Undo) -> bool {
    matches!((a, b), (Undo::Object(k1, n1, m1), Undo::Object(k2, n2, m2)) if k1 == k2 && n1 == n2 && m1 == m2)
}

/// The first line of `text` in the lab log `path` from byte `offset` on
/// that contains `needle`, waiting up to `timeout` for it.
pub fn wait_log_line(
    path: &std::path::Path,
    offset: u64,
    needle: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    eventually(
        &format!("{needle:?} in {}", path.display()),
        timeout,
        || {
            let text = std::fs::read(path).map_err(|e| e.to_string())?;
            let start = usize::try_from(offset)
                .unwrap_or(usize::MAX)
                .min(text.len());
            let tail = String::from_utf8_lossy(&text[start..]);
            tail.lines()
                .find(|l| l.contains(needle))
                .map(str::to_owned)
                .ok_or_else(|| {
                    let last: Vec<&str> = tail.lines().rev().take(3).collect();
                    format!("not yet; the log ends with {last:?}")
                })
        },
    )
}

/// Which gateway nodes hold `eip` on their `egress.eip` device now.
pub fn eip_holders(lab: &Lab, eip: impl Into<IpAddr>) -> anyhow::Result<Vec<String>> {
    let eip: IpAddr = eip.into();
    let family = if eip.is_ipv4() { "-4" } else { "-6" };
    let mut holders = Vec::new();
    for node in lab.state.topology.nodes.iter().filter(|n| n.gateway) {
        let out = crate::lab::cmd::run(
            "ip",
            &["-n", node.netns.as_str(), "-br", family, "addr", "show"],
        )?;
        let holds = out.lines().any(|line| {
            let mut words = line.split_whitespace();
            let device = words.next().unwrap_or_default();
            device == "egress.eip"
                && words
                    .skip(1)
                    .any(|a| a.split('/').next() == Some(&eip.to_string()))
        });
        if holds {
            holders.push(node.name.clone());
        }
    }
    Ok(holders)
}

/// The pids of every agent pod's container, by pod name: what changes when
/// an agent restarts.
pub fn agent_pids(lab: &Lab) -> anyhow::Result<Vec<(String, Option<u32>)>> {
    let mut pids: Vec<(String, Option<u32>)> = crate::lab::kubelet::records(&lab.paths)
        .into_iter()
        .filter(|r| r.name.starts_with("egressgw-agent-"))
        .map(|r| (r.name.clone(), r.containers.first().and_then(|c| c.pid)))
        .collect();
    pids.sort();
    ensure!(!pids.is_empty(), "no agent pod is running");
    Ok(pids)
}

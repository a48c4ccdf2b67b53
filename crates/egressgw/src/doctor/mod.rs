//! `egressgw doctor`: checks this node's part of egress, each with a
//! verdict, the evidence and what to do. It reads the kernel (the tunnel,
//! its offloads and its parent's, reverse-path filtering, forwarding,
//! other components' policy rules, the path's MTU to each peer) and the
//! agent's `/status` on this node (readiness, the last reconcile, the
//! datapath, the peers' probes), and changes nothing. With `--pod`/`--dst` it also explains one Pod's
//! traffic ([`pod`]). docs/operations.md lists the checks.

pub mod features;
pub mod pod;
pub mod throughput;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use egressgw_core::model::Config;
use egressgw_dataplane::ethtool::{self, Offloads};
use egressgw_dataplane::kernel::{Parent, Scope, VxlanLink};
use egressgw_dataplane::netlink::{Netlink, OtherRule};
use serde::Serialize;

use crate::ReportOutput;
use crate::dataplane::KernelArgs;

/// Options of `egressgw doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    kernel: KernelArgs,
    /// Config file the agent runs with; without it, the settings the
    /// agent reports, or the defaults when no agent answers.
    #[arg(long, value_name = "FILE", env = "EGRESSGW_CONFIG")]
    config: Option<PathBuf>,
    /// The agent's health endpoint on this node.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9812")]
    agent: SocketAddr,
    /// Explain this Pod's traffic (`NAMESPACE/NAME`) to `--dst`: the policy
    /// that decides it, its gateway and EIP, whether this node's kernel
    /// agrees, and the policy's counters. Reads the objects from the API
    /// server; the Pod must run on this node.
    #[arg(long, value_name = "NAMESPACE/NAME", requires = "dst")]
    pod: Option<String>,
    /// The destination the Pod sends to (with `--pod`).
    #[arg(long, value_name = "ADDR", requires = "pod")]
    dst: Option<IpAddr>,
    /// This node's name (the chart sets NODE_NAME in the agent's container).
    #[arg(long, value_name = "NODE", env = "NODE_NAME")]
    node: Option<String>,
    /// Kubeconfig file, for `--pod`; without it, the in-cluster service
    /// account (or `~/.kube/config`).
    #[arg(long, value_name = "FILE", env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Also measure how fast this node sends to up to three peers over the
    /// underlay and through the tunnel (2 s each way, to the peer agent's
    /// health port) and compare the two.
    #[arg(long)]
    throughput: bool,
    /// Output format: text for people, json for tools.
    #[arg(short, long, value_enum, default_value_t = ReportOutput::Text)]
    output: ReportOutput,
}

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// As it should be.
    Pass,
    /// Could not be checked here (the evidence says why).
    Skip,
    /// Works, but deserves attention.
    Warn,
    /// Breaks egress, or will.
    Fail,
}

impl Verdict {
    fn word(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Skip => "SKIP",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One check: its name, verdict, evidence and what to do.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Stable name (`tunnel`, `offload`, ...).
    pub name: &'static str,
    /// What it found.
    pub verdict: Verdict,
    /// What it saw.
    pub evidence: String,
    /// What to do, when something is to be done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn new(name: &'static str, verdict: Verdict, evidence: impl Into<String>) -> Self {
        Check {
            name,
            verdict,
            evidence: evidence.into(),
            fix: None,
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// The settings the checks compare against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    /// The tunnel device.
    pub vxlan: String,
    /// Whether tx checksum offload should be on on the tunnel.
    pub tx_checksum: bool,
    /// The priority of egressgw's rules.
    pub rule_priority: u32,
    /// The mark bits egressgw uses.
    pub mark_mask: u32,
}

impl Settings {
    /// What egressgw may touch, by these settings.
    fn scope(&self) -> Scope {
        Scope {
            vxlan: self.vxlan.clone(),
            rule_priority: self.rule_priority,
            mark_mask: self.mark_mask,
            ..Scope::new(&Config::default())
        }
    }

    /// The settings of `config`.
    pub fn of(config: &Config) -> Self {
        Settings {
            vxlan: config.vxlan.name.clone(),
            tx_checksum: !config.vxlan.disable_checksum_offload,
            rule_priority: config.rule_priority,
            mark_mask: config.mark_mask,
        }
    }
}

/// What the agent on this node says.
#[derive(Debug, Clone)]
pub struct AgentView {
    /// `Err(why)` while not ready.
    pub ready: Result<(), String>,
    /// Its `/status`.
    pub status: serde_json::Value,
}

/// Everything the checks look at, read once.
#[derive(Debug, Clone)]
pub struct Facts {
    pub settings: Settings,
    /// The agent, or why it could not be asked.
    pub agent: Result<AgentView, String>,
    /// The tunnel device as read back, or why it could not be read.
    pub tunnel: Result<Option<VxlanLink>, String>,
    /// The interface holding the tunnel's local address.
    pub parent: Option<Parent>,
    pub tunnel_offloads: Option<Result<Offloads, String>>,
    pub parent_offloads: Option<Result<Offloads, String>>,
    /// Whether this kernel sends bad checksums with VXLAN and SNAT when
    /// tx checksum offload is on.
    pub checksum_bug: bool,
    /// `net.ipv4.conf.{all,<tunnel>}.rp_filter`.
    pub rp_filter: (Option<u8>, Option<u8>),
    /// `net.ipv4.ip_forward`, `net.ipv6.conf.all.forwarding`.
    pub forwarding: (Option<u8>, Option<u8>),
    /// Rules that are not egressgw's.
    pub other_rules: Result<Vec<OtherRule>, String>,
    /// What Don't-Fragment probes to each peer found.
    pub paths: Vec<PathSeen>,
    /// What the kernel and this build offer (`None`: not asked).
    pub features: Option<features::Features>,
}

/// Whether a peer answers small and full-size packets sent whole: over
/// the underlay to its address, and through the tunnel to its tunnel
/// address. Each is `(small answered, full size answered)`.
#[derive(Debug, Clone)]
pub struct PathSeen {
    pub tunnel: Ipv4Addr,
    pub underlay: Ipv4Addr,
    /// The full sizes: the parent's MTU, the tunnel's MTU.
    pub sizes: (u16, u16),
    pub over_underlay: Result<(bool, bool), String>,
    pub through_tunnel: Result<(bool, bool), String>,
}

/// Runs every check and prints them; fails when one fails.
pub(crate) fn run(args: &DoctorArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let checks = runtime.block_on(async {
        let facts = gather(args).await?;
        let mut all = checks(&facts);
        if args.throughput {
            let peers: Vec<_> = facts.paths.iter().map(|p| (p.tunnel, p.underlay)).collect();
            let measured = throughput::measure(&peers, args.agent.port()).await;
            all.push(throughput::check(&measured));
        }
        if let (Some(pod), Some(dst)) = (&args.pod, args.dst) {
            let seen = gather_pod(args, &facts, pod, dst).await?;
            all.extend(pod::checks(&seen, &facts.agent));
        }
        anyhow::Ok(all)
    })?;
    let text = match args.output {
        ReportOutput::Json => serde_json::to_string_pretty(&checks)? + "\n",
        ReportOutput::Text => render(&checks),
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush().context("writing the checks")?;
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    anyhow::ensure!(failed == 0, "{failed} check(s) failed");
    Ok(())
}

fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        out += &format!("{}  {:<11} {}\n", c.verdict.word(), c.name, c.evidence);
        if let Some(fix) = &c.fix {
            out += &format!("      {:<11} -> {fix}\n", "");
        }
    }
    let count = |v| checks.iter().filter(|c| c.verdict == v).count();
    out += &format!(
        "{} check(s): {} passed, {} warned, {} failed, {} skipped\n",
        checks.len(),
        count(Verdict::Pass),
        count(Verdict::Warn),
        count(Verdict::Fail),
        count(Verdict::Skip)
    );
    out
}

async fn gather(args: &DoctorArgs) -> anyhow::Result<Facts> {
    let agent = ask_agent(args.agent).await;
    let settings = match &args.config {
        Some(path) => Settings::of(&crate::load_config(Some(path))?),
        None => agent
            .as_ref()
            .ok()
            .and_then(|a| serde_json::from_value(a.status["settings"].clone()).ok())
            .unwrap_or_else(|| Settings::of(&Config::default())),
    };
    let scope = settings.scope();
    let mut netlink = args.kernel.netlink()?;
    let observed = netlink.observe(&scope).await.map_err(|e| e.to_string());
    let tunnel = observed
        .as_ref()
        .map(|k| k.vxlan.clone())
        .map_err(Clone::clone);
    let parent = match &tunnel {
        Ok(Some(link)) => netlink.parent(link.identity.local).await.ok().flatten(),
        _ => None,
    };
    let paths = match (&observed, &tunnel, &parent) {
        (Ok(k), Ok(Some(link)), Some(parent)) => {
            let sizes = (
                u16::try_from(parent.mtu).unwrap_or(u16::MAX),
                u16::try_from(tunnel_mtu(link, parent)).unwrap_or(u16::MAX),
            );
            let peers = path_peers(k);
            let device = link.name.clone();
            tokio::task::spawn_blocking(move || probe_paths(&peers, &device, sizes))
                .await
                .unwrap_or_default()
        }
        _ => Vec::new(),
    };
    let offloads = |dev: String| async move {
        ethtool::read_offloads(&dev)
            .await
            .map_err(|e| e.to_string())
    };
    let tunnel_offloads = match &tunnel {
        Ok(Some(link)) => Some(offloads(link.name.clone()).await),
        _ => None,
    };
    let parent_offloads = match &parent {
        Some(p) => Some(offloads(p.name.clone()).await),
        None => None,
    };
    let pins = args.kernel.bpf_pins.clone();
    let features = tokio::task::spawn_blocking(move || features::gather(&pins))
        .await
        .ok();
    let sysctl = |path: &str| read_sysctl(&args.kernel.sysctl_net, path);
    Ok(Facts {
        rp_filter: (
            sysctl("ipv4/conf/all/rp_filter"),
            sysctl(&format!("ipv4/conf/{}/rp_filter", settings.vxlan)),
        ),
        forwarding: (
            sysctl("ipv4/ip_forward"),
            sysctl("ipv6/conf/all/forwarding"),
        ),
        other_rules: netlink.other_rules(&scope).await.map_err(|e| e.to_string()),
        checksum_bug: ethtool::kernel_has_vxlan_snat_checksum_bug(),
        settings,
        agent,
        tunnel,
        parent,
        tunnel_offloads,
        parent_offloads,
        paths,
        features,
    })
}

/// At most this many peers are probed for their path.
const PATH_PEERS: usize = 16;
/// How long a path probe waits for its answer, and how often it asks.
const PATH_WAIT: Duration = Duration::from_millis(500);
const PATH_TRIES: u8 = 2;
/// The size of a probe any path carries.
const SMALL: u16 = 100;

/// The IPv4 peers of the tunnel as the kernel has them: (tunnel address,
/// underlay address), from the neighbour and FDB entries egressgw wrote.
fn path_peers(k: &egressgw_dataplane::kernel::KernelState) -> Vec<(Ipv4Addr, Ipv4Addr)> {
    k.neighbours
        .iter()
        .filter_map(|(ip, mac)| match (ip, k.fdb.get(mac)?) {
            (IpAddr::V4(tunnel), IpAddr::V4(underlay)) => Some((*tunnel, *underlay)),
            _ => None,
        })
        .take(PATH_PEERS)
        .collect()
}

/// Probes each peer at once: small and full-size packets, with Don't
/// Fragment, over the underlay (`sizes.0`, the parent's MTU) and through
/// the tunnel (`sizes.1`, the tunnel's).
fn probe_paths(peers: &[(Ipv4Addr, Ipv4Addr)], device: &str, sizes: (u16, u16)) -> Vec<PathSeen> {
    use egressgw_dataplane::probe::answers_unfragmented as answers;
    std::thread::scope(|s| {
        let running: Vec<_> = peers
            .iter()
            .map(|&(tunnel, underlay)| {
                s.spawn(move || {
                    let ask = |dst, size, dev| {
                        answers(dst, size, dev, PATH_TRIES, PATH_WAIT).map_err(|e| e.to_string())
                    };
                    PathSeen {
                        tunnel,
                        underlay,
                        sizes,
                        over_underlay: ask(underlay, SMALL, None)
                            .and_then(|small| Ok((small, ask(underlay, sizes.0, None)?))),
                        through_tunnel: ask(tunnel, SMALL, Some(device))
                            .and_then(|small| Ok((small, ask(tunnel, sizes.1, Some(device))?))),
                    }
                })
            })
            .collect();
        running.into_iter().filter_map(|t| t.join().ok()).collect()
    })
}

/// What `--pod`/`--dst` need: the objects (listed from the API server),
/// this node's plan of them, and what this node's kernel classifies the
/// Pod's packet to `dst` as.
async fn gather_pod(
    args: &DoctorArgs,
    facts: &Facts,
    pod: &str,
    dst: IpAddr,
) -> anyhow::Result<pod::PodFacts> {
    let (namespace, name) = pod
        .split_once('/')
        .with_context(|| format!("--pod {pod}: write NAMESPACE/NAME"))?;
    let node = args
        .node
        .clone()
        .context("--pod needs this node's name: --node NODE (or NODE_NAME)")?;
    let config = match &args.config {
        Some(path) => crate::load_config(Some(path))?,
        None => Config::default(),
    };
    let client = crate::cluster::client(args.kubeconfig.as_deref()).await?;
    let changed = std::sync::Arc::new(tokio::sync::Notify::new());
    let (stores, tasks) =
        crate::cluster::watch::Stores::start(&client, &changed, Duration::from_secs(600), None);
    let listed = tokio::time::timeout(Duration::from_secs(20), stores.ready()).await;
    let snapshot = stores.snapshot(config.clone());
    for task in tasks {
        task.abort();
    }
    listed
        .context("the API server did not list the objects within 20 s")?
        .context("listing the objects")?;
    let family = if dst.is_ipv4() { "IPv4" } else { "IPv6" };
    let found = snapshot
        .pods
        .iter()
        .find(|p| p.namespace == namespace && p.name == name)
        .ok_or_else(|| format!("there is no Pod {pod}"))
        .and_then(|p| {
            let ip = p
                .ips
                .iter()
                .find(|ip| ip.is_ipv4() == dst.is_ipv4())
                .ok_or_else(|| format!("Pod {pod} has no {family} address yet"))?;
            let on = p
                .node
                .clone()
                .ok_or_else(|| format!("Pod {pod} is not scheduled yet"))?;
            Ok((*ip, on))
        });
    let plan = egressgw_core::plan_node(&snapshot, &node)
        .nodes
        .get(&node)
        .cloned();
    let datapath = facts
        .agent
        .as_ref()
        .ok()
        .and_then(|a| a.status["datapath"]["name"].as_str().map(str::to_owned))
        .unwrap_or_else(|| {
            let pinned = args
                .kernel
                .bpf_pins
                .join(egressgw_common::CLASSIFY4)
                .exists();
            if pinned { "ebpf" } else { "nftables" }.to_owned()
        });
    let (kernel, routing) = match &found {
        Ok((src, on)) if *on == node => {
            let read = if datapath == "ebpf" {
                egressgw_dataplane::ebpf::lookup_pinned(&args.kernel.bpf_pins, *src, dst)
                    .map(|v| v.map(pod::Classified::of_ebpf))
                    .map_err(|e| e.to_string())
            } else {
                use egressgw_dataplane::nft::Firewall as _;
                egressgw_dataplane::nft::Nft::new()
                    .observe()
                    .map(|o| o.and_then(|o| pod::nft_classified(&o, *src, dst)))
                    .map_err(|e| e.to_string())
            };
            let mut netlink = args.kernel.netlink()?;
            let routing = netlink
                .observe(&facts.settings.scope())
                .await
                .map_err(|e| e.to_string());
            (Some((datapath, read)), Some(routing))
        }
        _ => (None, None),
    };
    Ok(pod::PodFacts {
        pod: pod.to_owned(),
        dst,
        found,
        node,
        plan,
        local_mark: config.local_mark(),
        kernel,
        routing,
    })
}

fn read_sysctl(dir: &Path, path: &str) -> Option<u8> {
    std::fs::read_to_string(dir.join(path))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The agent's `/readyz` and `/status`, within two seconds.
async fn ask_agent(addr: SocketAddr) -> Result<AgentView, String> {
    let ask = async {
        let (code, why) = http_get(addr, "/readyz").await?;
        let (_, status) = http_get(addr, "/status").await?;
        let status: serde_json::Value =
            serde_json::from_str(&status).map_err(|e| format!("/status is not JSON: {e}"))?;
        let ready = if code == 200 {
            Ok(())
        } else {
            let why = why.trim();
            Err(why.strip_prefix("not ready: ").unwrap_or(why).to_owned())
        };
        Ok(AgentView { ready, status })
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .unwrap_or_else(|_| Err("no answer within 2 s".into()))
        .map_err(|e: String| format!("the agent's endpoint {addr}: {e}"))
}

/// `GET path` over HTTP/1.1: the status code and the body.
async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, addr.to_string())
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .map_err(|e| e.to_string())?;
    send(addr, request).await
}

/// Sends `request` to `addr` over HTTP/1.1: the status code and the body.
async fn send<B>(addr: SocketAddr, request: hyper::Request<B>) -> Result<(u16, String), String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use http_body_util::BodyExt as _;
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let code = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// Every check, in the order a person would go through them.
pub fn checks(f: &Facts) -> Vec<Check> {
    vec![
        agent(f),
        datapath(f),
        features(f),
        reconcile(f),
        tunnel(f),
        offload(f),
        parent_offload(f),
        rp_filter(f),
        forwarding(f),
        rules(f),
        peers(f),
        path(f),
    ]
}

fn path(f: &Facts) -> Check {
    if f.paths.is_empty() {
        return Check::new("path", Verdict::Skip, "no IPv4 peer of the tunnel to probe");
    }
    let mut broken = Vec::new();
    let mut narrow = Vec::new();
    let mut silent = Vec::new();
    let mut whole = 0;
    for p in &f.paths {
        let (underlay, tunnel) = match (&p.over_underlay, &p.through_tunnel) {
            (Ok(u), Ok(t)) => (*u, *t),
            (Err(e), _) | (_, Err(e)) => {
                silent.push(format!("{} (cannot probe: {e})", p.underlay));
                continue;
            }
        };
        match (underlay, tunnel) {
            ((false, _), (false, _)) => silent.push(format!("{} (no answer at all)", p.underlay)),
            (_, (true, false)) => broken.push(format!(
                "{}-byte packets do not cross the tunnel to {} (at {}), smaller ones do",
                p.sizes.1, p.tunnel, p.underlay
            )),
            ((true, false), _) => narrow.push(format!(
                "{}-byte packets do not reach {} whole over the underlay",
                p.sizes.0, p.underlay
            )),
            _ => whole += 1,
        }
    }
    let fix = "make the network between the nodes carry packets of the parent interface's MTU \
               (a switch, VPC or VPN with a smaller MTU), or lower the parent's MTU: the \
               tunnel's follows it";
    if !broken.is_empty() {
        return Check::new("path", Verdict::Fail, broken.join("; ")).fix(fix);
    }
    if !narrow.is_empty() {
        return Check::new("path", Verdict::Warn, narrow.join("; ")).fix(fix);
    }
    let (parent, tunnel) = f.paths[0].sizes;
    let mut evidence = format!(
        "{whole} peer(s) answer {parent}-byte packets over the underlay and {tunnel}-byte \
         packets through the tunnel, unfragmented"
    );
    if !silent.is_empty() {
        evidence += &format!(
            "; not probed: {} (see the `peers` check)",
            silent.join(", ")
        );
    }
    Check::new("path", Verdict::Pass, evidence)
}

const AGENT_FIX: &str = "kubectl -n <namespace> logs the agent Pod of this node";

fn agent(f: &Facts) -> Check {
    match &f.agent {
        Err(e) => Check::new(
            "agent",
            Verdict::Warn,
            format!("{e}; the kernel checks below still run"),
        )
        .fix("run doctor inside the agent's container (kubectl exec), or pass --agent"),
        Ok(AgentView {
            ready: Ok(()),
            status,
        }) => Check::new(
            "agent",
            Verdict::Pass,
            format!(
                "ready on node {} after {} reconcile(s)",
                status["node"].as_str().unwrap_or("?"),
                status["reconciles"]
            ),
        ),
        Ok(AgentView {
            ready: Err(why), ..
        }) => Check::new("agent", Verdict::Fail, format!("not ready: {why}")).fix(AGENT_FIX),
    }
}

fn datapath(f: &Facts) -> Check {
    let Ok(view) = &f.agent else {
        return Check::new("datapath", Verdict::Skip, "the agent did not answer");
    };
    let d = &view.status["datapath"];
    match d["name"].as_str() {
        Some(name) => Check::new(
            "datapath",
            Verdict::Pass,
            format!(
                "{name}: {}",
                d["reason"].as_str().unwrap_or("no reason given")
            ),
        ),
        None => Check::new(
            "datapath",
            Verdict::Skip,
            "the agent reports no datapath yet",
        ),
    }
}

fn features(f: &Facts) -> Check {
    let Some(found) = &f.features else {
        return Check::new("features", Verdict::Skip, "the kernel was not asked");
    };
    let datapath = f.agent.as_ref().ok().and_then(|view| {
        let d = &view.status["datapath"];
        Some((
            d["name"].as_str()?,
            d["reason"].as_str().unwrap_or_default(),
        ))
    });
    features::check(found, datapath)
}

fn reconcile(f: &Facts) -> Check {
    let Ok(view) = &f.agent else {
        return Check::new("reconcile", Verdict::Skip, "the agent did not answer");
    };
    let last = &view.status["last"];
    let Some(applied) = last["applied"].as_array() else {
        return Check::new("reconcile", Verdict::Skip, "no reconcile yet");
    };
    let failed = last["failed"].as_array().cloned().unwrap_or_default();
    let warnings = last["warnings"].as_array().cloned().unwrap_or_default();
    if !failed.is_empty() {
        let first: Vec<String> = failed
            .iter()
            .take(3)
            .map(|f| {
                format!(
                    "{} [{}]: {}",
                    f["op"]["text"].as_str().unwrap_or("?"),
                    f["cause"].as_str().unwrap_or("?"),
                    f["error"].as_str().unwrap_or("?")
                )
            })
            .collect();
        return Check::new(
            "reconcile",
            Verdict::Fail,
            format!("{} operation(s) failed: {}", failed.len(), first.join("; ")),
        )
        .fix(AGENT_FIX);
    }
    if !warnings.is_empty() {
        let text: Vec<&str> = warnings.iter().filter_map(|w| w.as_str()).collect();
        return Check::new("reconcile", Verdict::Warn, text.join("; "));
    }
    Check::new(
        "reconcile",
        Verdict::Pass,
        format!(
            "the last reconcile applied every operation ({} this time)",
            applied.len()
        ),
    )
}

/// The MTU the tunnel should have on `parent`.
fn tunnel_mtu(link: &VxlanLink, parent: &Parent) -> u32 {
    let overhead = if link.identity.local.is_ipv4() {
        50
    } else {
        70
    };
    parent.mtu.saturating_sub(overhead)
}

fn tunnel(f: &Facts) -> Check {
    let name = &f.settings.vxlan;
    let link = match &f.tunnel {
        Err(e) => return Check::new("tunnel", Verdict::Fail, format!("cannot read {name}: {e}")),
        Ok(None) => {
            return Check::new("tunnel", Verdict::Fail, format!("there is no {name}"))
                .fix("the agent creates it once the controller allocated this node's EgressTunnel: check both are running");
        }
        Ok(Some(link)) => link,
    };
    let s = &link.settings;
    let mut seen = format!(
        "{name}: VNI {}, port {}, local {}, mtu {}",
        link.identity.vni, link.identity.port, link.identity.local, s.mtu
    );
    if !s.up {
        return Check::new("tunnel", Verdict::Fail, seen + ", down").fix(format!(
            "ip link set {name} up (the agent does at its next reconcile)"
        ));
    }
    let Some(parent) = &f.parent else {
        return Check::new(
            "tunnel",
            Verdict::Fail,
            format!("{seen}; no interface holds its local address"),
        )
        .fix("the node's underlay address moved: the agent follows it once the Node's address says so");
    };
    let want = tunnel_mtu(link, parent);
    seen += &format!(", parent {} (mtu {})", parent.name, parent.mtu);
    if s.mtu > want {
        Check::new(
            "tunnel",
            Verdict::Fail,
            format!("{seen}: the tunnel's mtu is above the {want} its parent can carry, so large packets are dropped"),
        )
        .fix(format!("ip link set {name} mtu {want} (the agent sets it at its next reconcile)"))
    } else if s.mtu < want {
        Check::new(
            "tunnel",
            Verdict::Warn,
            format!("{seen}: below the {want} its parent allows, which costs throughput"),
        )
        .fix(format!(
            "ip link set {name} mtu {want} (the agent sets it at its next reconcile)"
        ))
    } else {
        Check::new("tunnel", Verdict::Pass, seen)
    }
}

fn offload(f: &Facts) -> Check {
    let name = &f.settings.vxlan;
    let Some(read) = &f.tunnel_offloads else {
        return Check::new("offload", Verdict::Skip, format!("there is no {name}"));
    };
    let o = match read {
        Ok(o) => o,
        Err(e) => {
            return Check::new(
                "offload",
                Verdict::Skip,
                format!("cannot read {name}'s offloads: {e}"),
            );
        }
    };
    let want = f.settings.tx_checksum;
    let on_off = |b: bool| if b { "on" } else { "off" };
    let seen = format!("{name}: {}", o.summary());
    if o.tx_checksum != want {
        let key = format!("feature.vxlan.disableChecksumOffload is {}", !want);
        return Check::new(
            "offload",
            Verdict::Fail,
            format!("{seen}; tx-checksumming should be {} ({key})", on_off(want)),
        )
        .fix(format!(
            "ethtool -K {name} tx {} (the agent sets it at its next reconcile; if it stays {}, the driver refuses the change)",
            on_off(want),
            on_off(o.tx_checksum)
        ));
    }
    if o.tx_checksum && f.checksum_bug {
        return Check::new(
            "offload",
            Verdict::Warn,
            format!(
                "{seen}; this kernel (older than 5.7) can send bad checksums with VXLAN and SNAT"
            ),
        )
        .fix("set feature.vxlan.disableChecksumOffload=true");
    }
    Check::new("offload", Verdict::Pass, seen)
}

fn parent_offload(f: &Facts) -> Check {
    let (Some(parent), Some(read)) = (&f.parent, &f.parent_offloads) else {
        return Check::new("parent", Verdict::Skip, "no parent interface found");
    };
    let o = match read {
        Ok(o) => o,
        Err(e) => {
            return Check::new(
                "parent",
                Verdict::Skip,
                format!("cannot read {}'s offloads: {e}", parent.name),
            );
        }
    };
    let seen = format!("{}: {}", parent.name, o.summary());
    let off: Vec<&str> = [
        ("tx-checksumming", o.tx_checksum),
        ("tcp-segmentation-offload", o.tcp_segmentation),
        ("generic-segmentation-offload", o.generic_segmentation),
    ]
    .into_iter()
    .filter(|(_, on)| !on)
    .map(|(name, _)| name)
    .collect();
    if off.is_empty() {
        return Check::new("parent", Verdict::Pass, seen);
    }
    Check::new(
        "parent",
        Verdict::Warn,
        format!(
            "{seen}; with {} off the CPU does that work for every tunnelled packet, \
             and throughput through the tunnel drops",
            off.join(", ")
        ),
    )
    .fix(format!("ethtool -K {} tx on tso on gso on", parent.name))
}

fn rp_filter(f: &Facts) -> Check {
    let name = &f.settings.vxlan;
    let (all, dev) = f.rp_filter;
    let (Some(all), Some(dev)) = (all, dev) else {
        return Check::new(
            "rp-filter",
            Verdict::Skip,
            format!("cannot read net.ipv4.conf.{{all,{name}}}.rp_filter"),
        );
    };
    // The kernel uses the larger of the two.
    let effective = all.max(dev);
    let seen = format!("net.ipv4.conf.all.rp_filter={all}, net.ipv4.conf.{name}.rp_filter={dev}");
    if effective == 1 {
        Check::new(
            "rp-filter",
            Verdict::Fail,
            format!("{seen}: strict, so decapsulated packets from pods of other nodes are dropped"),
        )
        .fix(format!(
            "sysctl -w net.ipv4.conf.{name}.rp_filter=2 (the agent sets it at its next reconcile)"
        ))
    } else {
        Check::new("rp-filter", Verdict::Pass, seen)
    }
}

fn forwarding(f: &Facts) -> Check {
    match f.forwarding {
        (Some(0), _) => Check::new(
            "forwarding",
            Verdict::Fail,
            "net.ipv4.ip_forward=0: this node forwards no pod traffic",
        )
        .fix("sysctl -w net.ipv4.ip_forward=1 (the CNI normally sets it)"),
        (Some(v4), v6) => Check::new(
            "forwarding",
            Verdict::Pass,
            format!(
                "net.ipv4.ip_forward={v4}, net.ipv6.conf.all.forwarding={}",
                v6.map_or("?".into(), |v| v.to_string())
            ),
        ),
        (None, _) => Check::new(
            "forwarding",
            Verdict::Skip,
            "cannot read net.ipv4.ip_forward",
        ),
    }
}

/// The main, default and local tables: a rule looking them up sends
/// traffic the normal way.
fn is_standard_table(table: u32) -> bool {
    matches!(table, 253..=255)
}

fn rules(f: &Facts) -> Check {
    let rules = match &f.other_rules {
        Ok(rules) => rules,
        Err(e) => {
            return Check::new(
                "rules",
                Verdict::Skip,
                format!("cannot list the rules: {e}"),
            );
        }
    };
    let ours = f.settings.rule_priority;
    let mask = f.settings.mark_mask;
    let earlier = |r: &&OtherRule| r.priority <= ours;
    let stealing: Vec<String> = rules
        .iter()
        .filter(earlier)
        .filter(|r| r.mark.is_some_and(|(_, m)| m & mask != 0) && !r.selective)
        .map(ToString::to_string)
        .collect();
    if !stealing.is_empty() {
        return Check::new(
            "rules",
            Verdict::Fail,
            format!(
                "{} rule(s) of another component match egressgw's mark bits {mask:#010x} \
                 at or before its priority {ours}: {}",
                stealing.len(),
                stealing.join("; ")
            ),
        )
        .fix(format!(
            "give egressgw mark bits no other component uses (feature.markMask) or move \
             that component's rules after priority {ours}"
        ));
    }
    let catch_all: Vec<String> = rules
        .iter()
        .filter(earlier)
        .filter(|r| {
            r.mark.is_none() && !r.selective && r.table.is_some_and(|t| !is_standard_table(t))
        })
        .map(ToString::to_string)
        .collect();
    if !catch_all.is_empty() {
        return Check::new(
            "rules",
            Verdict::Warn,
            format!(
                "rule(s) before egressgw's (priority {ours}) look up another table for every \
                 packet; a route there to an egress destination sends pods' traffic around \
                 the tunnel: {}",
                catch_all.join("; ")
            ),
        );
    }
    Check::new(
        "rules",
        Verdict::Pass,
        format!(
            "{} rule(s) of other components, none before priority {ours} on mark bits {mask:#010x}",
            rules.len()
        ),
    )
}

fn peers(f: &Facts) -> Check {
    let Ok(view) = &f.agent else {
        return Check::new("peers", Verdict::Skip, "the agent did not answer");
    };
    let failover = &view.status["failover"];
    let answers: BTreeMap<String, Option<u64>> =
        serde_json::from_value(failover["peers"].clone()).unwrap_or_default();
    if answers.is_empty() {
        return Check::new("peers", Verdict::Pass, "this node probes no peer");
    }
    let live: Vec<String> = serde_json::from_value(failover["live"].clone()).unwrap_or_default();
    let dead: Vec<String> = answers
        .iter()
        .filter(|(peer, _)| !live.contains(peer))
        .map(|(peer, ms)| match ms {
            Some(ms) => format!("{peer} (last answer {:.1} s ago)", *ms as f64 / 1000.0),
            None => format!("{peer} (never answered)"),
        })
        .collect();
    if dead.is_empty() {
        let round_trips: BTreeMap<String, u64> =
            serde_json::from_value(failover["roundTripsMicros"].clone()).unwrap_or_default();
        let peers: Vec<String> = live
            .iter()
            .map(|peer| match round_trips.get(peer) {
                Some(us) => format!("{peer} (round trip {:.2} ms)", *us as f64 / 1000.0),
                None => peer.clone(),
            })
            .collect();
        return Check::new(
            "peers",
            Verdict::Pass,
            format!(
                "every peer answers through {}: {}",
                f.settings.vxlan,
                peers.join(", ")
            ),
        );
    }
    Check::new(
        "peers",
        Verdict::Fail,
        format!(
            "{} of {} peer(s) do not answer through {}: {}",
            dead.len(),
            answers.len(),
            f.settings.vxlan,
            dead.join(", ")
        ),
    )
    .fix("check that those nodes are up, their agents run, and the tunnel's UDP port passes between the nodes' addresses")
}

#[cfg(test)]
mod tests {
    use egressgw_core::model::Mac;
    use egressgw_dataplane::kernel::{VxlanIdentity, VxlanSettings};

    use super::*;

    fn healthy() -> Facts {
        let offloads = Offloads {
            tx_checksum: true,
            scatter_gather: true,
            tcp_segmentation: true,
            generic_segmentation: true,
            generic_receive: true,
            features: BTreeMap::new(),
        };
        Facts {
            settings: Settings::of(&Config::default()),
            agent: Ok(AgentView {
                ready: Ok(()),
                status: serde_json::json!({
                    "node": "node-1",
                    "reconciles": 4,
                    "datapath": {"name": "ebpf", "reason": "datapath: auto, and this node runs the eBPF classifier"},
                    "last": {"applied": [], "failed": [], "warnings": []},
                    "failover": {"peers": {"node-2": 40, "node-3": 90}, "roundTripsMicros": {"node-2": 180}, "live": ["node-2", "node-3"]},
                }),
            }),
            tunnel: Ok(Some(VxlanLink {
                name: "egress.vxlan".into(),
                identity: VxlanIdentity {
                    vni: 100,
                    port: 7789,
                    parent: 2,
                    local: "172.18.0.11".parse().unwrap(),
                    learning: false,
                },
                settings: VxlanSettings {
                    mac: Mac([0x66, 0, 0, 0, 0, 1]),
                    mtu: 1450,
                    up: true,
                },
            })),
            parent: Some(Parent {
                name: "eth0".into(),
                index: 2,
                mtu: 1500,
            }),
            tunnel_offloads: Some(Ok(offloads.clone())),
            parent_offloads: Some(Ok(offloads)),
            checksum_bug: false,
            rp_filter: (Some(1), Some(2)),
            forwarding: (Some(1), Some(1)),
            other_rules: Ok(vec![OtherRule {
                ipv6: false,
                priority: 0,
                table: Some(255),
                mark: None,
                selective: false,
            }]),
            paths: vec![PathSeen {
                tunnel: "172.31.0.1".parse().unwrap(),
                underlay: "172.18.0.11".parse().unwrap(),
                sizes: (1500, 1450),
                over_underlay: Ok((true, true)),
                through_tunnel: Ok((true, true)),
            }],
            features: Some(features::Features {
                release: "6.18.44".into(),
                nftables: Ok(()),
                program: true,
                bpffs: Ok(()),
                tcx: true,
            }),
        }
    }

    fn verdict(checks: &[Check], name: &str) -> (Verdict, String) {
        let c = checks.iter().find(|c| c.name == name).unwrap();
        (c.verdict, c.evidence.clone())
    }

    #[test]
    fn a_healthy_node_passes_every_check() {
        let checks = checks(&healthy());
        let not_passed: Vec<_> = checks
            .iter()
            .filter(|c| c.verdict != Verdict::Pass)
            .collect();
        assert!(not_passed.is_empty(), "{not_passed:#?}");
        assert!(
            render(&checks).ends_with("12 check(s): 12 passed, 0 warned, 0 failed, 0 skipped\n")
        );
        let (_, peers) = verdict(&checks, "peers");
        assert!(
            peers.ends_with("node-2 (round trip 0.18 ms), node-3"),
            "{peers}"
        );
    }

    /// A check's name, the verdict and words it should give, and what
    /// breaks the facts.
    type Case = (&'static str, Verdict, &'static str, fn(&mut Facts));

    #[test]
    fn each_broken_thing_is_named_by_its_check() {
        let cases: Vec<Case> = vec![
            (
                "features",
                Verdict::Fail,
                "the kernel refuses egressgw's nftables table: Error: Could not process rule",
                |f| {
                    f.features.as_mut().unwrap().nftables =
                        Err("Error: Could not process rule: No such file or directory".into());
                },
            ),
            (
                "agent",
                Verdict::Fail,
                "not ready: the last reconcile failed",
                |f| {
                    f.agent.as_mut().unwrap().ready =
                        Err("the last reconcile failed: 1 operation(s)".into());
                },
            ),
            (
                "reconcile",
                Verdict::Fail,
                "add rule priority 3000 [exists]: File exists",
                |f| {
                    f.agent.as_mut().unwrap().status["last"]["failed"] = serde_json::json!([
                        {"op": {"kind": "rule", "object": "x", "text": "add rule priority 3000"}, "cause": "exists", "error": "File exists"}
                    ]);
                },
            ),
            ("tunnel", Verdict::Fail, "there is no egress.vxlan", |f| {
                f.tunnel = Ok(None);
            }),
            (
                "tunnel",
                Verdict::Fail,
                "above the 1350 its parent can carry",
                |f| {
                    f.parent.as_mut().unwrap().mtu = 1400;
                },
            ),
            (
                "offload",
                Verdict::Fail,
                "tx-checksumming should be on",
                |f| {
                    f.tunnel_offloads = Some(Ok(Offloads {
                        tx_checksum: false,
                        ..f.tunnel_offloads.clone().unwrap().unwrap()
                    }));
                },
            ),
            (
                "parent",
                Verdict::Warn,
                "with tcp-segmentation-offload off",
                |f| {
                    f.parent_offloads = Some(Ok(Offloads {
                        tcp_segmentation: false,
                        ..f.parent_offloads.clone().unwrap().unwrap()
                    }));
                },
            ),
            ("rp-filter", Verdict::Fail, "strict", |f| {
                f.rp_filter = (Some(1), Some(0));
            }),
            ("forwarding", Verdict::Fail, "ip_forward=0", |f| {
                f.forwarding = (Some(0), Some(1));
            }),
            (
                "rules",
                Verdict::Fail,
                "rule priority 100 fwmark 0x01000000/0x0f000000 lookup 7",
                |f| {
                    f.other_rules.as_mut().unwrap().push(OtherRule {
                        ipv6: false,
                        priority: 100,
                        table: Some(7),
                        mark: Some((0x0100_0000, 0x0f00_0000)),
                        selective: false,
                    });
                },
            ),
            ("rules", Verdict::Warn, "rule priority 50 lookup 100", |f| {
                f.other_rules.as_mut().unwrap().push(OtherRule {
                    ipv6: false,
                    priority: 50,
                    table: Some(100),
                    mark: None,
                    selective: false,
                });
            }),
            (
                "path",
                Verdict::Fail,
                "1450-byte packets do not cross the tunnel to 172.31.0.1",
                |f| f.paths[0].through_tunnel = Ok((true, false)),
            ),
            (
                "path",
                Verdict::Warn,
                "1500-byte packets do not reach 172.18.0.11 whole",
                |f| f.paths[0].over_underlay = Ok((true, false)),
            ),
            (
                "peers",
                Verdict::Fail,
                "node-3 (last answer 2.5 s ago)",
                |f| {
                    f.agent.as_mut().unwrap().status["failover"] = serde_json::json!({"peers": {"node-2": 40, "node-3": 2500}, "live": ["node-2"]});
                },
            ),
        ];
        for (name, want, words, breaks) in cases {
            let mut facts = healthy();
            breaks(&mut facts);
            let checks = checks(&facts);
            let (verdict, evidence) = verdict(&checks, name);
            assert_eq!(verdict, want, "{name}: {evidence}");
            assert!(
                evidence.contains(words),
                "{name}: {evidence:?} lacks {words:?}"
            );
            let others: Vec<_> = checks
                .iter()
                .filter(|c| c.name != name && c.verdict != Verdict::Pass)
                .collect();
            assert!(others.is_empty(), "{name} broke others too: {others:#?}");
        }
    }

    #[test]
    fn marks_outside_egressgws_bits_and_rules_after_it_are_no_conflict() {
        let mut facts = healthy();
        let rules = facts.other_rules.as_mut().unwrap();
        // Cilium-like: its own mark bits.
        rules.push(OtherRule {
            ipv6: false,
            priority: 9,
            table: Some(2004),
            mark: Some((0x200, 0xf00)),
            selective: false,
        });
        // After egressgw's rules.
        rules.push(OtherRule {
            ipv6: false,
            priority: 32000,
            table: Some(7),
            mark: Some((0x0100_0000, 0xff00_0000)),
            selective: false,
        });
        assert_eq!(verdict(&checks(&facts), "rules").0, Verdict::Pass);
    }

    #[test]
    fn without_an_agent_the_kernel_checks_still_run() {
        let mut facts = healthy();
        facts.agent = Err("the agent's endpoint 127.0.0.1:9812: connection refused".into());
        let checks = checks(&facts);
        assert_eq!(verdict(&checks, "agent").0, Verdict::Warn);
        for name in ["datapath", "reconcile", "peers"] {
            assert_eq!(verdict(&checks, name).0, Verdict::Skip, "{name}");
        }
        for name in ["tunnel", "offload", "rp-filter", "rules"] {
            assert_eq!(verdict(&checks, name).0, Verdict::Pass, "{name}");
        }
    }
}

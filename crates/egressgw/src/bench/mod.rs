//! `egressgw bench`: the reference system's three iperf3 cases, run as
//! Kubernetes objects in the user's cluster (or the lab), interleaved,
//! with a table, a JSON file of every sample and a chart. See
//! docs/bench.md.

pub mod chart;
pub mod client;
pub mod echo;
mod objects;
mod offload;
mod report;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use egressgw_api::{EgressGateway, EgressPolicy, EgressTunnel};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, LogParams, PostParams};
use serde::Serialize;
use serde_json::Value;

use self::client::{ClientResult, ERROR_PREFIX, INTERFACES_PREFIX, Interface, RESULT_PREFIX};
use self::objects::{Run, Setup};
use self::offload::Agents;
use self::report::{BenchDatapath, Case, Sample, Variant};

/// The tunnel device, as the agents name it by default.
const TUNNEL: &str = "egress.vxlan";
/// How long the bench waits for its policy, a Pod to start, a namespace to go.
const WAIT: Duration = Duration::from_secs(120);
/// A guess at what each run costs besides its traffic (Pod start, the
/// handshakes, deletion), for the progress estimate.
const RUN_OVERHEAD: Duration = Duration::from_secs(5);

/// Which tx checksum offload states `egress.vxlan` is measured in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OffloadArg {
    /// As the agents are configured; nothing is switched.
    Current,
    /// On, then off (cases 2 and 3; case 1 does not use the tunnel).
    Both,
    /// On.
    On,
    /// Off.
    Off,
}

/// Which datapaths the cases are measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatapathArg {
    /// As the agents are configured; nothing is switched.
    Current,
    /// eBPF (with its fast path) and nftables, alternating each repeat
    /// (the configured one first), so that both see the same machine.
    Both,
    /// eBPF with its fast path, eBPF the marked way only, and nftables,
    /// alternating each repeat.
    All,
    /// eBPF with its fast path.
    Ebpf,
    /// eBPF, every packet the marked way (`ebpf.fastPath` off).
    EbpfMarked,
    /// nftables.
    Nftables,
}

/// `egressgw bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Kubeconfig file; without it, the in-cluster config or ~/.kube/config.
    #[arg(long, value_name = "FILE", env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The node the clients run on (cases 1 and 2 in its network
    /// namespace, case 3 in a Pod there). Not the gateway node.
    #[arg(long, value_name = "NODE", required_unless_present = "cleanup")]
    pub source_node: Option<String>,
    /// The EgressGateway case 3 leaves through; the server of cases 1 and 2
    /// runs on the node that holds the bench policy's EIP.
    #[arg(long, value_name = "NAME", required_unless_present = "cleanup")]
    pub gateway: Option<String>,
    /// An iperf3 server outside the cluster (`iperf3 -s`), the target of case 3.
    #[arg(long, value_name = "ADDR[:PORT]", required_unless_present = "cleanup")]
    pub target: Option<String>,
    /// Seconds of traffic per run.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=600))]
    pub duration: u32,
    /// Runs of each case (interleaved: 1, 2, 3, 1, 2, 3, ...).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Parallel streams per run (iperf3 `-P`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=128))]
    pub streams: u32,
    /// Also measure the other direction (iperf3 `-R`: the server sends).
    #[arg(long)]
    pub reverse: bool,
    /// tx checksum offload on `egress.vxlan` to measure with; switching it
    /// rolls the agents (restored afterwards).
    #[arg(long, value_enum, default_value_t = OffloadArg::Current)]
    pub offload: OffloadArg,
    /// The datapath (`feature.datapath`) to measure with; switching it
    /// rolls the agents (restored afterwards). Not together with a switched
    /// `--offload`.
    #[arg(long, value_enum, default_value_t = DatapathArg::Current)]
    pub datapath: DatapathArg,
    /// Port of the iperf3 server on the gateway node (host network).
    #[arg(long, default_value_t = 5201)]
    pub port: u16,
    /// Port of a TCP echo server at the target (`egressgw bench-echo`):
    /// each run then also times round trips of small messages, and the
    /// bench runs an echo server on the gateway node on this port for
    /// cases 1 and 2. Without it, only handshakes are timed.
    #[arg(long, value_name = "PORT")]
    pub echo_port: Option<u16>,
    /// Pin the clients to the first CPU and the gateway node's echo server
    /// to the second (e.g. `0,1`), so that round trips do not move between
    /// CPUs. The target's echo server is pinned where it runs.
    #[arg(long, value_name = "CLIENT,SERVER", value_parser = parse_cpus)]
    pub cpus: Option<(usize, usize)>,
    /// The namespace the bench creates for its objects (and deletes).
    #[arg(long, default_value = "egressgw-bench")]
    pub namespace: String,
    /// Labels for that namespace, e.g. to match the gateway's
    /// `spec.namespaceSelector`.
    #[arg(long, value_name = "KEY=VALUE,...", value_delimiter = ',')]
    pub namespace_labels: Vec<String>,
    /// Where egressgw is installed (its agent DaemonSet and config).
    #[arg(long, value_name = "NAMESPACE", default_value = "egressgw-system")]
    pub egressgw_namespace: String,
    /// Image of the bench's Pods (egressgw and iperf3); default: the
    /// agents' image, already on every node.
    #[arg(long)]
    pub image: Option<String>,
    /// Write every sample and the environment to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Write a bar chart of the results to this SVG file.
    #[arg(long, value_name = "FILE")]
    pub chart: Option<PathBuf>,
    /// Only remove what an earlier bench left (its namespace, a switched
    /// offload), then exit.
    #[arg(long)]
    pub cleanup: bool,
}

/// Runs the bench; removes what it created whatever happens, Ctrl-C included.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(bench(args))
}

async fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    let client = crate::cluster::client(args.kubeconfig.as_deref()).await?;
    if args.cleanup {
        return cleanup(&client, args).await;
    }
    refuse_leftovers(&client, args).await?;
    let mut bench = Bench::new(client.clone(), args).await?;
    let outcome = tokio::select! {
        outcome = bench.measure() => outcome,
        () = crate::cluster::shutdown_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    progress("removing the bench's objects (Ctrl-C again to leave them)");
    let cleaned = tokio::select! {
        cleaned = cleanup(&client, args) => cleaned,
        () = crate::cluster::shutdown_signal() => Err(anyhow::anyhow!(
            "interrupted again: the bench's objects may be left; remove them with \
             `egressgw bench --cleanup`"
        )),
    };
    let (placed, samples) = outcome?;
    cleaned?;
    bench.report(&placed, &samples)
}

fn progress(line: &str) {
    eprintln!("bench: {line}");
}

/// Fails when a previous bench's objects are still there, saying how to
/// remove them.
async fn refuse_leftovers(client: &kube::Client, args: &BenchArgs) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    if let Some(ns) = namespaces.get_opt(&args.namespace).await? {
        let ours = ns
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(objects::PART_OF.0))
            .is_some_and(|v| v == objects::PART_OF.1);
        if ours {
            bail!(
                "namespace {0} exists: a previous bench's objects are still there. Remove them \
                 with `egressgw bench --cleanup` (or `kubectl delete namespace {0}`)",
                args.namespace
            );
        }
        bail!(
            "namespace {} exists and is not the bench's (no label {}={}): give another --namespace",
            args.namespace,
            objects::PART_OF.0,
            objects::PART_OF.1
        );
    }
    let agents = offload::find_agents(client, &args.egressgw_namespace).await?;
    if offload::read_config(client, &agents).await?.1.is_some() {
        bail!(
            "ConfigMap {}/{} still has the offload setting a previous bench switched \
             (annotation {}): restore it with `egressgw bench --cleanup`",
            agents.namespace,
            agents.configmap,
            offload::ORIGINAL_ANNOTATION
        );
    }
    Ok(())
}

/// Deletes the bench's namespace (and so all its objects) and waits until
/// it is gone; restores the agents' config if a bench switched it.
async fn cleanup(client: &kube::Client, args: &BenchArgs) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut errors = Vec::new();
    let ours = namespaces
        .get_opt(&args.namespace)
        .await?
        .is_some_and(|ns| {
            ns.metadata.labels.is_some_and(|l| {
                l.get(objects::PART_OF.0)
                    .is_some_and(|v| v == objects::PART_OF.1)
            })
        });
    if ours {
        match namespaces
            .delete(&args.namespace, &DeleteParams::background())
            .await
        {
            Ok(_) => {
                let gone = wait_for("the bench's namespace to go", WAIT, || async {
                    Ok(namespaces
                        .get_opt(&args.namespace)
                        .await?
                        .is_none()
                        .then_some(()))
                })
                .await;
                if let Err(e) = gone {
                    errors.push(e);
                }
            }
            Err(e) => errors.push(anyhow::anyhow!(
                "deleting namespace {}: {e}",
                args.namespace
            )),
        }
    }
    if let Err(e) = restore_offload(client, args).await {
        errors.push(e);
    }
    match errors
        .into_iter()
        .reduce(|a, b| a.context(format!("{b:#}")))
    {
        Some(e) => Err(e.context("removing what the bench created")),
        None => Ok(()),
    }
}

async fn restore_offload(client: &kube::Client, args: &BenchArgs) -> anyhow::Result<()> {
    // Nothing installed there: nothing a bench could have switched.
    let Ok(agents) = offload::find_agents(client, &args.egressgw_namespace).await else {
        return Ok(());
    };
    if let (_, Some(original)) = offload::read_config(client, &agents).await? {
        offload::apply(client, &agents, &original, None, &progress).await?;
    }
    Ok(())
}

/// Polls `check` every 500 ms until it gives a value, for at most `limit`.
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if start.elapsed() > limit {
            bail!("timed out after {} s waiting for {what}", limit.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the bench found and made.
struct Bench<'a> {
    client: kube::Client,
    args: &'a BenchArgs,
    setup: Setup,
    target: SocketAddr,
    agents: Agents,
    started: Instant,
    environment: BTreeMap<String, Value>,
}

/// Where the bench's traffic goes, once the policy is allocated.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
struct Placed {
    eip: IpAddr,
    gateway_node: String,
    gateway_ip: IpAddr,
    gateway_tunnel: IpAddr,
    source_ip: IpAddr,
    source_tunnel: IpAddr,
    /// The underlay interface of each node's tunnel.
    source_parent: Option<String>,
    gateway_parent: Option<String>,
}

impl<'a> Bench<'a> {
    async fn new(client: kube::Client, args: &'a BenchArgs) -> anyhow::Result<Self> {
        let source_node = args
            .source_node
            .clone()
            .context("--source-node is needed")?;
        let gateway = args.gateway.clone().context("--gateway is needed")?;
        let target = parse_target(args.target.as_deref().context("--target is needed")?)?;
        let nodes: Api<Node> = Api::all(client.clone());
        nodes
            .get_opt(&source_node)
            .await?
            .with_context(|| format!("--source-node {source_node}: no such Node"))?;
        let gateways: Api<EgressGateway> = Api::all(client.clone());
        gateways
            .get_opt(&gateway)
            .await?
            .with_context(|| format!("--gateway {gateway}: no such EgressGateway"))?;
        let agents = offload::find_agents(&client, &args.egressgw_namespace).await?;
        let namespace_labels = args
            .namespace_labels
            .iter()
            .map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .with_context(|| format!("--namespace-labels {kv}: want KEY=VALUE"))
            })
            .collect::<anyhow::Result<_>>()?;
        if args.datapath != DatapathArg::Current && args.offload != OffloadArg::Current {
            bail!("--datapath and --offload both switch the agents: measure one of them at a time");
        }
        let runs = 2 * runs_per_phase(args);
        let setup = Setup {
            namespace: args.namespace.clone(),
            namespace_labels,
            image: args.image.clone().unwrap_or_else(|| agents.image.clone()),
            source_node,
            gateway,
            target: target.ip(),
            port: args.port,
            echo_port: args.echo_port,
            cpus: args.cpus,
            duration: args.duration,
            streams: args.streams,
            // Every run at its Pod's own deadline, and the rollouts.
            deadline_seconds: runs * (u64::from(args.duration) + 90) + 1200,
        };
        Ok(Bench {
            client,
            args,
            setup,
            target,
            agents,
            started: Instant::now(),
            environment: BTreeMap::new(),
        })
    }

    /// Everything up to the report: objects, phases, runs.
    async fn measure(&mut self) -> anyhow::Result<(Placed, Vec<Sample>)> {
        let placed = self.prepare().await?;
        let (config, _) = offload::read_config(&self.client, &self.agents).await?;
        let configured_on = !offload::offload_disabled(&config)?;
        let configured_datapath = offload::datapath(&config)?;
        let phases = if self.args.datapath == DatapathArg::Current {
            phases(self.args.offload, Some(configured_on), self.args.repeat)
        } else {
            datapath_phases(self.args.datapath, configured_datapath, self.args.repeat)
        };
        let total = phases
            .iter()
            .map(|p| self.runs(&placed, p, None, None).len() as u64)
            .sum();
        let mut samples = Vec::new();
        let mut done = 0;
        for phase in phases {
            if phase.switch {
                let new = match (phase.switch_to, phase.datapath) {
                    (Some(on), _) => offload::with_offload_disabled(&config, !on)?,
                    (None, Some(datapath)) => offload::with_datapath(&config, datapath)?,
                    (None, None) => bail!("a switch to no state"),
                };
                offload::apply(&self.client, &self.agents, &new, Some(&config), &progress).await?;
            }
            let offload = self.read_back(&placed, &phase).await?;
            let datapath = self.read_datapath(&phase).await?;
            for run in self.runs(&placed, &phase, offload, datapath) {
                done += 1;
                let sample = self.run_one(&run, done, total).await?;
                check_offload(&sample, phase.switch_to)?;
                samples.push(sample);
            }
        }
        Ok((placed, samples))
    }

    /// The datapath the source node's agent reports (its EgressTunnel's
    /// `status.datapath`): the one the phase's runs are filed under. Fails
    /// when a switched phase finds another one than it switched to.
    async fn read_datapath(&self, phase: &Phase) -> anyhow::Result<Option<BenchDatapath>> {
        let node = &self.setup.source_node;
        let tunnels: Api<EgressTunnel> = Api::all(self.client.clone());
        let wanted = phase.datapath;
        let last = RefCell::new(None::<BenchDatapath>);
        let last_ref = &last;
        let seen = wait_for(
            &format!("the agent of {node} to report its datapath"),
            Duration::from_secs(60),
            || async {
                let tunnel = tunnels.get(node).await?;
                let seen = tunnel
                    .status
                    .and_then(|s| s.datapath)
                    .and_then(|d| BenchDatapath::reported(&d.name, d.fast_path));
                *last_ref.borrow_mut() = seen;
                Ok(match wanted {
                    None => Some(seen),
                    Some(w) => (seen == Some(w)).then_some(seen),
                })
            },
        )
        .await;
        match seen {
            Ok(seen) => Ok(seen),
            Err(e) => bail!(
                "{e:#}: the agents were switched to {}, but {node} reports {}",
                wanted.map_or("-".into(), |w| w.to_string()),
                last.borrow().map_or("nothing".into(), |d| d.to_string())
            ),
        }
    }

    /// Creates the namespace, the policy and the server; finds the nodes'
    /// addresses.
    async fn prepare(&mut self) -> anyhow::Result<Placed> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(objects::namespace(&self.setup)?)?,
            )
            .await
            .with_context(|| format!("creating namespace {}", self.setup.namespace))?;
        let policies: Api<EgressPolicy> =
            Api::namespaced(self.client.clone(), &self.setup.namespace);
        policies
            .create(
                &PostParams::default(),
                &serde_json::from_value(objects::policy(&self.setup)?)?,
            )
            .await
            .with_context(|| {
                format!(
                    "creating EgressPolicy {}/{}",
                    self.setup.namespace,
                    objects::POLICY
                )
            })?;
        progress(&format!(
            "EgressPolicy {}/{} created; waiting for its EIP and gateway node",
            self.setup.namespace,
            objects::POLICY
        ));
        let (eip, gateway_node) = self.wait_policy(&policies).await?;
        if gateway_node == self.setup.source_node {
            bail!(
                "--source-node {} holds the bench policy's EIP {eip} for gateway {}: \
                 its traffic would not cross the tunnel; pick a node that is not this gateway's",
                self.setup.source_node,
                self.setup.gateway
            );
        }
        let source_node = self.setup.source_node.clone();
        let (source_ip, source_tunnel, source_parent) = self.node_addresses(&source_node).await?;
        let (gateway_ip, gateway_tunnel, gateway_parent) =
            self.node_addresses(&gateway_node).await?;
        let placed = Placed {
            eip,
            gateway_node: gateway_node.clone(),
            gateway_ip,
            gateway_tunnel,
            source_ip,
            source_tunnel,
            source_parent,
            gateway_parent,
        };
        progress(&format!(
            "source {} ({source_ip}, tunnel {source_tunnel}) -> gateway {gateway_node} \
             ({gateway_ip}, tunnel {gateway_tunnel}), EIP {eip}, target {}",
            self.setup.source_node, self.target
        ));
        self.start_server(&gateway_node).await?;
        Ok(placed)
    }

    /// The policy's EIP and active gateway node, once it is Ready.
    async fn wait_policy(&self, policies: &Api<EgressPolicy>) -> anyhow::Result<(IpAddr, String)> {
        let last = RefCell::new(String::from("no status yet"));
        let last_ref = &last;
        let found = wait_for(
            "the bench's EgressPolicy to be Ready",
            WAIT,
            move || async move {
                let policy = policies.get(objects::POLICY).await?;
                let status = policy.status.unwrap_or_default();
                let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
                if let Some(c) = ready {
                    *last_ref.borrow_mut() =
                        format!("Ready={} {}: {}", c.status, c.reason, c.message);
                }
                let eip = status.eip.and_then(|e| e.ipv4.or(e.ipv6));
                Ok(match (ready, eip, status.node) {
                    (Some(c), Some(eip), Some(node)) if c.status == "True" => Some((eip, node)),
                    _ => None,
                })
            },
        )
        .await;
        let (eip, node) = found.with_context(|| format!("the policy says: {}", last.borrow()))?;
        let eip = eip
            .parse()
            .with_context(|| format!("the policy's EIP {eip}"))?;
        Ok((eip, node))
    }

    /// A node's InternalIP, its tunnel address and the tunnel's underlay
    /// interface (from its EgressTunnel); notes the node's environment.
    async fn node_addresses(
        &mut self,
        node: &str,
    ) -> anyhow::Result<(IpAddr, IpAddr, Option<String>)> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let n = nodes
            .get(node)
            .await
            .with_context(|| format!("reading Node {node}"))?;
        let status = n.status.unwrap_or_default();
        let internal = status
            .addresses
            .iter()
            .flatten()
            .find(|a| a.type_ == "InternalIP")
            .with_context(|| format!("Node {node} has no InternalIP"))?
            .address
            .parse()
            .with_context(|| format!("Node {node}'s InternalIP"))?;
        let info = status.node_info.map(|i| {
            serde_json::json!({
                "kernel": i.kernel_version, "osImage": i.os_image,
                "containerRuntime": i.container_runtime_version, "kubelet": i.kubelet_version,
                "architecture": i.architecture,
            })
        });
        let capacity = status.capacity.map(|c| {
            serde_json::json!({
                "cpu": c.get("cpu").map(|q| q.0.clone()),
                "memory": c.get("memory").map(|q| q.0.clone()),
            })
        });
        self.environment.insert(
            format!("node.{node}"),
            serde_json::json!({ "internalIP": internal, "nodeInfo": info, "capacity": capacity }),
        );
        let tunnels: Api<EgressTunnel> = Api::all(self.client.clone());
        let tunnel = tunnels
            .get_opt(node)
            .await?
            .and_then(|t| t.status)
            .and_then(|s| s.tunnel)
            .with_context(|| {
                format!("EgressTunnel {node} has no status.tunnel: is its agent running?")
            })?;
        let address = tunnel
            .ipv4
            .or(tunnel.ipv6)
            .with_context(|| format!("EgressTunnel {node} has no tunnel address yet"))?
            .parse()
            .with_context(|| format!("EgressTunnel {node}'s tunnel address"))?;
        Ok((internal, address, tunnel.parent.and_then(|p| p.name)))
    }

    async fn start_server(&self, gateway_node: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.setup.namespace);
        let pod = serde_json::from_value(objects::server_pod(&self.setup, gateway_node)?)?;
        pods.create(&PostParams::default(), &pod)
            .await
            .context("creating the iperf3 server Pod")?;
        progress(&format!(
            "iperf3 server starting on {gateway_node} (port {})",
            self.setup.port
        ));
        let last = RefCell::new(String::new());
        let (last_ref, pods) = (&last, &pods);
        wait_for(
            "the iperf3 server Pod to be ready",
            WAIT,
            move || async move {
                let pod = pods.get(objects::SERVER_POD).await?;
                *last_ref.borrow_mut() = pod_state(&pod);
                if matches!(pod_phase(&pod), "Failed" | "Succeeded") {
                    bail!("the iperf3 server Pod stopped: {}", pod_state(&pod));
                }
                Ok(pod_ready(&pod).then_some(()))
            },
        )
        .await
        .with_context(|| format!("iperf3 server: {}", last.borrow()))
    }

    /// The tunnel's tx checksum offload on both nodes at the start of a
    /// phase (read with ethtool netlink in their network namespaces): the
    /// state the phase's runs are filed under. Fails when a switched phase
    /// finds another state than it switched to.
    async fn read_back(&mut self, placed: &Placed, phase: &Phase) -> anyhow::Result<Option<bool>> {
        let mut states = Vec::new();
        let source = self.setup.source_node.clone();
        for (role, node, parent) in [
            ("source", &source, &placed.source_parent),
            ("gateway", &placed.gateway_node, &placed.gateway_parent),
        ] {
            let interfaces = self
                .node_interfaces(node, role, &phase.tag(), parent.as_deref())
                .await?;
            let state = tunnel_offload(&interfaces);
            self.environment.insert(
                format!("interfaces.{}.{role}.{node}", phase.tag()),
                serde_json::to_value(&interfaces)?,
            );
            if let (Some(wanted), Some(seen)) = (phase.switch_to, state)
                && wanted != seen
            {
                bail!(
                    "tx checksum offload on {TUNNEL} of {node} is {}, but the agents were switched to {}",
                    on_off(seen),
                    on_off(wanted)
                );
            }
            states.push(state);
        }
        if states[0] != states[1] {
            progress(&format!(
                "warning: tx checksum offload on {TUNNEL} differs: source {}, gateway {}",
                states[0].map_or("unknown", on_off),
                states[1].map_or("unknown", on_off)
            ));
        }
        Ok(states[0].or(phase.switch_to))
    }

    /// A node's tunnel and its parent, read in its network namespace.
    async fn node_interfaces(
        &self,
        node: &str,
        role: &str,
        phase: &str,
        parent: Option<&str>,
    ) -> anyhow::Result<Vec<Interface>> {
        let name = format!("interfaces-{role}-{phase}");
        let pod = objects::interfaces_pod(&self.setup, &name, node, parent)?;
        let log = self.run_pod(&name, pod, 60).await?;
        let line = log
            .lines()
            .find_map(|l| l.strip_prefix(INTERFACES_PREFIX))
            .with_context(|| format!("Pod {name} printed no interfaces: {}", tail(&log)))?;
        serde_json::from_str(line).with_context(|| format!("Pod {name}'s interfaces"))
    }

    /// The runs of one phase, interleaved: each repeat runs every case
    /// forward, then (with --reverse) every case in reverse.
    fn runs(
        &self,
        placed: &Placed,
        phase: &Phase,
        offload: Option<bool>,
        datapath: Option<BenchDatapath>,
    ) -> Vec<Run<'static>> {
        let mut runs = Vec::new();
        let directions: &[bool] = if self.args.reverse {
            &[false, true]
        } else {
            &[false]
        };
        for repeat in phase.repeats.clone() {
            for &reverse in directions {
                for case in Case::ALL {
                    if phase.only_tunnel && !case.uses_tunnel() {
                        continue;
                    }
                    let variant = Variant {
                        reverse,
                        offload,
                        datapath,
                    };
                    runs.push(self.run_of(placed, phase, case, variant, repeat));
                }
            }
        }
        runs
    }

    fn run_of(
        &self,
        placed: &Placed,
        phase: &Phase,
        case: Case,
        variant: Variant,
        repeat: u32,
    ) -> Run<'static> {
        let (server, port, bind, expect_source) = match case {
            Case::NodeToNode => (placed.gateway_ip, self.setup.port, None, None),
            Case::TunnelToTunnel => (
                placed.gateway_tunnel,
                self.setup.port,
                Some(placed.source_tunnel),
                None,
            ),
            Case::PodToTarget => (self.target.ip(), self.target.port(), None, Some(placed.eip)),
        };
        Run {
            case,
            variant,
            phase: phase.name,
            repeat,
            server,
            server_port: port,
            bind,
            expect_source,
            parent: placed.source_parent.clone(),
        }
    }

    /// Runs one client Pod and reads its result.
    async fn run_one(&self, run: &Run<'_>, done: u64, total: u64) -> anyhow::Result<Sample> {
        let name = run.pod_name();
        let elapsed = self.started.elapsed();
        let estimate = (u64::from(self.args.duration) + RUN_OVERHEAD.as_secs()) * total;
        progress(&format!(
            "[{done}/{total}] case {} {}, {}, {}, repeat {}/{} (elapsed {}, about {} in all)",
            run.case.number(),
            run.case.label(),
            run.variant.direction(),
            match run.phase {
                "on" | "off" => format!("offload {}", run.phase),
                "cur" => "as configured".to_owned(),
                datapath => format!("datapath {datapath}"),
            },
            run.repeat,
            self.args.repeat,
            clock(elapsed.as_secs()),
            clock(estimate.max(elapsed.as_secs())),
        ));
        let pod = objects::client_pod(&self.setup, run)?;
        let log = self
            .run_pod(&name, pod, u64::from(self.args.duration) + 120)
            .await?;
        let result = parse_log(&name, &log)?;
        progress(&format!(
            "    {:.2} Gbit/s received, {} retransmits{}",
            result.received_bps / 1e9,
            result.retransmits.map_or("?".into(), |r| r.to_string()),
            result
                .seen_from
                .as_deref()
                .map_or(String::new(), |s| format!(", the target saw {s}")),
        ));
        Ok(Sample {
            case: run.case,
            variant: run.variant,
            repeat: run.repeat,
            pod: name,
            result,
        })
    }

    /// Creates a Pod, waits for it to finish (at most `limit_s`), returns
    /// its log and deletes it.
    async fn run_pod(&self, name: &str, pod: Value, limit_s: u64) -> anyhow::Result<String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.setup.namespace);
        pods.create(&PostParams::default(), &serde_json::from_value(pod)?)
            .await
            .with_context(|| format!("creating Pod {name}"))?;
        let last = RefCell::new(String::new());
        let (last_ref, pods_ref) = (&last, &pods);
        let limit = Duration::from_secs(limit_s);
        let finished = wait_for(
            &format!("Pod {name} to finish"),
            limit,
            move || async move {
                let pod = pods_ref.get(name).await?;
                *last_ref.borrow_mut() = pod_state(&pod);
                Ok(matches!(pod_phase(&pod), "Succeeded" | "Failed")
                    .then(|| pod_phase(&pod).to_owned()))
            },
        )
        .await;
        let last = last.into_inner();
        let params = LogParams {
            container: Some(objects::CLIENT_CONTAINER.to_owned()),
            ..LogParams::default()
        };
        let log = pods.logs(name, &params).await;
        let _ = pods.delete(name, &DeleteParams::background()).await;
        let phase = finished.with_context(|| format!("Pod {name}: {last}"))?;
        let log = log.with_context(|| format!("reading Pod {name}'s log"))?;
        if phase == "Failed" {
            let why = log
                .lines()
                .find_map(|l| l.strip_prefix(ERROR_PREFIX))
                .map_or_else(|| format!("{last}; log: {}", tail(&log)), str::to_owned);
            bail!("Pod {name} failed: {why}");
        }
        Ok(log)
    }

    /// Prints the table; writes the JSON and the chart when asked.
    fn report(&self, placed: &Placed, samples: &[Sample]) -> anyhow::Result<()> {
        let rows = report::summarize(samples);
        let heading = format!(
            "egressgw bench: {} -> {} (gateway {}, EIP {}) -> target {}; {} x {} s, {} stream(s)",
            self.setup.source_node,
            placed.gateway_node,
            self.setup.gateway,
            placed.eip,
            self.target,
            self.args.repeat,
            self.args.duration,
            self.args.streams,
        );
        let load = samples.last().and_then(|s| s.result.load_average.clone());
        println!("\n{heading}");
        if let Some(load) = &load {
            println!(
                "load average on {} at the end: {load}",
                self.setup.source_node
            );
        }
        println!();
        print!("{}", report::table(&rows));
        if let Some(path) = &self.args.output {
            let document = serde_json::json!({
                "version": 1,
                "egressgwVersion": env!("CARGO_PKG_VERSION"),
                "settings": {
                    "sourceNode": self.setup.source_node, "gateway": self.setup.gateway,
                    "target": self.target.to_string(), "duration": self.args.duration,
                    "repeat": self.args.repeat, "streams": self.args.streams,
                    "reverse": self.args.reverse, "image": self.setup.image,
                },
                "placement": placed,
                "environment": self.environment,
                "summary": rows,
                "samples": samples,
            });
            std::fs::write(path, serde_json::to_string_pretty(&document)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
            println!("every sample: {}", path.display());
        }
        if let Some(path) = &self.args.chart {
            let kernel = self
                .environment
                .get(&format!("node.{}", self.setup.source_node))
                .and_then(|n| n.pointer("/nodeInfo/kernel"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            let subtitle = format!(
                "{} -> {} -> target; Linux {kernel}; {} x {} s, {} stream(s); load {}",
                self.setup.source_node,
                placed.gateway_node,
                self.args.repeat,
                self.args.duration,
                self.args.streams,
                load.as_deref().unwrap_or("?"),
            );
            let chart = report::chart(
                &rows,
                "egressgw: iperf3 throughput (received, median, min-max)",
                &subtitle,
            );
            std::fs::write(path, chart::render_svg(&chart)?)
                .with_context(|| format!("writing {}", path.display()))?;
            println!("chart: {}", path.display());
        }
        Ok(())
    }
}

/// One state of the agents (offload, datapath) the cases run in.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Phase {
    /// `on`, `off`, `ebpf`, `nft` or `cur`, for Pod names.
    name: &'static str,
    /// The offload state to switch to (`None`: as configured).
    switch_to: Option<bool>,
    /// The datapath to switch to (`None`: as configured).
    datapath: Option<BenchDatapath>,
    /// The agents must be switched first.
    switch: bool,
    /// A phase that only exists to measure the tunnel in another state.
    only_tunnel: bool,
    /// The repeats it runs.
    repeats: std::ops::RangeInclusive<u32>,
}

impl Phase {
    /// The name, with the first repeat where phases of one name alternate.
    fn tag(&self) -> String {
        if self.datapath.is_some() {
            format!("{}-r{}", self.name, self.repeats.start())
        } else {
            self.name.to_owned()
        }
    }
}

/// The phases for `--offload`, given the configured state (`Some(on)`):
/// that state first, so that no switch is made that is not needed.
fn phases(arg: OffloadArg, configured_on: Option<bool>, repeat: u32) -> Vec<Phase> {
    let phase = |on: bool, only_tunnel: bool| Phase {
        name: if on { "on" } else { "off" },
        switch_to: Some(on),
        datapath: None,
        switch: configured_on != Some(on),
        only_tunnel,
        repeats: 1..=repeat,
    };
    match arg {
        OffloadArg::Current => {
            vec![Phase {
                name: "cur",
                switch_to: None,
                datapath: None,
                switch: false,
                only_tunnel: false,
                repeats: 1..=repeat,
            }]
        }
        OffloadArg::On => vec![phase(true, false)],
        OffloadArg::Off => vec![phase(false, false)],
        OffloadArg::Both => {
            let first = configured_on.unwrap_or(true);
            vec![phase(first, false), phase(!first, true)]
        }
    }
}

/// The phases for `--datapath`, given the configured datapath: `both` and
/// `all` alternate each repeat, the configured datapath first (for `auto`,
/// eBPF, and then every phase switches: `auto` runs eBPF only where it
/// can, and only a switch makes it sure), each phase switching away from
/// the one before.
fn datapath_phases(arg: DatapathArg, configured: Option<BenchDatapath>, repeat: u32) -> Vec<Phase> {
    let name = |d: BenchDatapath| match d {
        BenchDatapath::Ebpf => "ebpf",
        BenchDatapath::EbpfMarked => "mark",
        BenchDatapath::Nftables => "nft",
    };
    let mut order = match arg {
        DatapathArg::Current => return phases(OffloadArg::Current, None, repeat),
        DatapathArg::Ebpf => vec![BenchDatapath::Ebpf],
        DatapathArg::EbpfMarked => vec![BenchDatapath::EbpfMarked],
        DatapathArg::Nftables => vec![BenchDatapath::Nftables],
        DatapathArg::Both => vec![BenchDatapath::Ebpf, BenchDatapath::Nftables],
        DatapathArg::All => vec![
            BenchDatapath::Ebpf,
            BenchDatapath::EbpfMarked,
            BenchDatapath::Nftables,
        ],
    };
    let first = configured.unwrap_or(BenchDatapath::Ebpf);
    if let Some(at) = order.iter().position(|d| *d == first) {
        order.rotate_left(at);
    }
    let mut current = configured;
    let mut out = Vec::new();
    for r in 1..=repeat {
        for &d in &order {
            out.push(Phase {
                name: name(d),
                switch_to: None,
                datapath: Some(d),
                switch: current != Some(d),
                only_tunnel: false,
                repeats: r..=r,
            });
            current = Some(d);
        }
    }
    if order.len() == 1 {
        // One datapath: one phase over every repeat.
        let mut one = out.swap_remove(0);
        one.repeats = 1..=repeat;
        return vec![one];
    }
    out
}

fn runs_per_phase(args: &BenchArgs) -> u64 {
    u64::from(args.repeat) * if args.reverse { 2 } else { 1 } * Case::ALL.len() as u64
}

/// A run in a switched phase must have seen the state it was switched to
/// on the source node's tunnel (case 3's Pod does not see it).
fn check_offload(sample: &Sample, wanted: Option<bool>) -> anyhow::Result<()> {
    let (Some(wanted), Some(seen)) = (wanted, tunnel_offload(&sample.result.interfaces)) else {
        return Ok(());
    };
    if wanted != seen {
        bail!(
            "{}: tx checksum offload on {TUNNEL} is {}, but the agents were switched to {}",
            sample.pod,
            on_off(seen),
            on_off(wanted)
        );
    }
    Ok(())
}

fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

fn tunnel_offload(interfaces: &[Interface]) -> Option<bool> {
    interfaces
        .iter()
        .find(|i| i.name == TUNNEL)
        .and_then(|i| i.tx_checksum)
}

/// `ADDR[:PORT]` (IPv6 as `[ADDR]:PORT`), port 5201 by default.
/// `--cpus CLIENT,SERVER`.
fn parse_cpus(text: &str) -> Result<(usize, usize), String> {
    let parse = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| format!("{text:?}: want two CPU numbers, CLIENT,SERVER (e.g. 0,1)"))
    };
    let (client, server) = text
        .split_once(',')
        .ok_or_else(|| format!("{text:?}: want CLIENT,SERVER (e.g. 0,1)"))?;
    Ok((parse(client)?, parse(server)?))
}

fn parse_target(text: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let ip: IpAddr = text
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .with_context(|| format!("--target {text}: want ADDR or ADDR:PORT (an IP address)"))?;
    Ok(SocketAddr::new(ip, 5201))
}

/// The run's result from its Pod's log.
fn parse_log(pod: &str, log: &str) -> anyhow::Result<ClientResult> {
    let line = log
        .lines()
        .find_map(|l| l.strip_prefix(RESULT_PREFIX))
        .with_context(|| format!("Pod {pod} printed no result: {}", tail(log)))?;
    serde_json::from_str(line).with_context(|| format!("Pod {pod}'s result"))
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
    if tail.is_empty() {
        "(empty)".into()
    } else {
        tail
    }
}

fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The phase and, where a container waits or stopped, why.
fn pod_state(pod: &Pod) -> String {
    let mut state = pod_phase(pod).to_owned();
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    for c in statuses.into_iter().flatten() {
        let why = c.state.as_ref().and_then(|s| {
            if let Some(w) = &s.waiting {
                Some(format!(
                    "waiting: {} {}",
                    w.reason.as_deref().unwrap_or(""),
                    w.message.as_deref().unwrap_or("")
                ))
            } else {
                s.terminated.as_ref().map(|t| {
                    format!(
                        "exited {} {}",
                        t.exit_code,
                        t.reason.as_deref().unwrap_or("")
                    )
                })
            }
        });
        if let Some(why) = why {
            state.push_str(&format!(", {}: {}", c.name, why.trim()));
        }
    }
    if let Some(message) = pod.status.as_ref().and_then(|s| s.message.as_deref()) {
        state.push_str(&format!(" ({message})"));
    }
    state
}

/// `m:ss`.
fn clock(seconds: u64) -> String {
    format!("{}:{:02}", seconds / 60, seconds % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_take_a_default_port() {
        assert_eq!(
            parse_target("198.51.100.1").unwrap().to_string(),
            "198.51.100.1:5201"
        );
        assert_eq!(parse_target("198.51.100.1:5301").unwrap().port(), 5301);
        assert_eq!(parse_target("[2001:db8::1]:7").unwrap().port(), 7);
        assert_eq!(parse_target("2001:db8::1").unwrap().port(), 5201);
        let err = parse_target("target.example").unwrap_err();
        assert!(err.to_string().contains("--target target.example"), "{err}");
    }

    #[test]
    fn both_offload_states_start_with_the_configured_one_and_switch_once() {
        let p = phases(OffloadArg::Both, Some(false), 5);
        assert_eq!(p.iter().map(|p| p.name).collect::<Vec<_>>(), ["off", "on"]);
        assert!(!p[0].only_tunnel && p[1].only_tunnel);
        assert!(!p[0].switch && p[1].switch);
        assert!(phases(OffloadArg::On, Some(false), 5)[0].switch);
        assert!(!phases(OffloadArg::Off, Some(false), 5)[0].switch);
        assert_eq!(
            phases(OffloadArg::Current, Some(true), 5)[0].switch_to,
            None
        );
    }

    #[test]
    fn both_datapaths_alternate_each_repeat_starting_with_the_configured_one() {
        let p = datapath_phases(DatapathArg::Both, None, 3);
        let names: Vec<&str> = p.iter().map(|p| p.name).collect();
        assert_eq!(names, ["ebpf", "nft", "ebpf", "nft", "ebpf", "nft"]);
        // auto runs eBPF where it can, but only a switch makes it sure.
        assert!(p.iter().all(|p| p.switch));
        assert!(p.iter().all(|p| p.repeats.start() == p.repeats.end()));
        let p = datapath_phases(DatapathArg::Both, Some(BenchDatapath::Nftables), 2);
        assert_eq!(p[0].name, "nft");
        assert!(!p[0].switch, "already nftables");
        let one = datapath_phases(DatapathArg::Ebpf, Some(BenchDatapath::Ebpf), 4);
        assert_eq!(one.len(), 1);
        assert!(!one[0].switch);
        assert_eq!(one[0].repeats, 1..=4);
        let all = datapath_phases(DatapathArg::All, Some(BenchDatapath::EbpfMarked), 2);
        let names: Vec<&str> = all.iter().map(|p| p.name).collect();
        assert_eq!(names, ["mark", "nft", "ebpf", "mark", "nft", "ebpf"]);
        assert!(!all[0].switch && all[1..].iter().all(|p| p.switch));
        assert_eq!(all[0].datapath, Some(BenchDatapath::EbpfMarked));
    }

    #[test]
    fn a_pod_log_gives_its_result_or_says_what_it_printed() {
        let err = parse_log("c1-fwd-on-r1", "iperf3: boom\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("c1-fwd-on-r1 printed no result: iperf3: boom"),
            "{err}"
        );
    }

    #[test]
    fn clocks_read_as_minutes_and_seconds() {
        assert_eq!(clock(75), "1:15");
    }
}

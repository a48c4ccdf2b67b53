//! `lab deploy` and `lab agent`: egressgw in the lab, installed the way a
//! cluster gets it: `helm install` of the chart through the API. The
//! DaemonSet and Deployment controllers create the Pods, the scheduler
//! binds them, and the lab's kubelet stand-in runs them (with their own
//! ServiceAccounts, capabilities and volumes) from an "image" the lab
//! registers for the egressgw binary it deploys (`images.json`).

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

use super::build::Fnv1a;
use super::helm::{Helm, RELEASE};
use super::images::{Image, KnownImages};
use super::kubelet::{self, Record};
use super::session::Lab;
use super::state::{Deployment, Paths};
use super::topology::{Node, SERVICE_CIDR, SERVICE6_CIDR, Topology};
use super::up::step;
use super::{cmd, probe, process};

/// The Kubernetes namespace egressgw is installed in.
pub const NAMESPACE: &str = "egressgw-system";
/// The agents' health port (the chart's default).
pub const AGENT_HEALTH_PORT: u16 = 9812;
/// The image repository under which the lab registers the binary it deploys.
pub const LAB_IMAGE: &str = "lab.egressgw.io/egressgw";
/// Where the chart's containers find the binary.
const IMAGE_BINARY: &str = "/usr/local/bin/egressgw";
/// iperf3, in the image and on the machine (Debian's package, which
/// `scripts/lab-deps.sh` installs).
const IMAGE_IPERF3: &str = "/usr/bin/iperf3";
/// The agent DaemonSet and the controller Deployment, as the chart names them.
const AGENT_DAEMONSET: &str = "egressgw-agent";
const CONTROLLER_DEPLOYMENT: &str = "egressgw-controller";
/// How long the rollout may take.
const ROLLOUT_TIMEOUT: &str = "180s";
/// How long the agents get to become ready once their pods run.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a held agent gets to run again once released.
const RESTART_TIMEOUT: Duration = Duration::from_secs(30);
/// Field manager of the CRDs the lab applies.
const FIELD_MANAGER: &str = "egressgw-lab";

/// What `lab deploy` was asked for.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DeployArgs {
    /// The egressgw binary [default: `egressgw` beside this xtask binary,
    /// i.e. target/debug/egressgw].
    #[arg(long, value_name = "PATH")]
    pub egressgw: Option<PathBuf>,
    /// More Helm values files, after the lab's own (`helm -f`).
    #[arg(short = 'f', long = "values", value_name = "FILE")]
    pub values: Vec<PathBuf>,
    /// Helm values on the command line (`helm --set`), e.g.
    /// `feature.vxlan.disableChecksumOffload=true`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The chart to install [default: deploy/helm/egressgw], e.g. a
    /// previous release's (`cargo xtask previous`).
    #[arg(long, value_name = "DIR")]
    pub chart: Option<PathBuf>,
}

impl DeployArgs {
    /// The chart to install.
    fn chart(&self) -> PathBuf {
        self.chart.clone().unwrap_or_else(Helm::chart)
    }
}

/// Registers the binary as an image, installs or upgrades the chart, and
/// waits until every agent is ready. Run again, it upgrades the release
/// (with a new binary, if it was rebuilt: its image tag is its hash).
pub fn deploy(args: &DeployArgs, paths: &Paths) -> anyhow::Result<()> {
    let mut lab = Lab::open(paths)?;
    let binary = find_binary(args.egressgw.as_deref())?;
    println!(
        "deploying egressgw ({}) to the lab {} with helm",
        binary.display(),
        paths.prefix
    );
    let dir = paths.egressgw();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (copy, tag) = step("the egressgw binary as an image", || {
        register_image(paths, &binary, &dir)
    })?;
    let dual_stack = lab.state.topology.dual_stack();
    let values = step("the lab's values", || write_values(&tag, dual_stack, &dir))?;
    step(
        "the CRDs (server-side apply; helm never upgrades them)",
        || apply_crds(&lab, &args.chart()),
    )?;
    let helm = Helm::for_lab(&lab);
    step(&format!("helm upgrade --install {RELEASE}"), || {
        install(&helm, &values, args)
    })?;
    lab.state.egressgw = Some(Deployment {
        binary: copy,
        config: values,
        namespace: NAMESPACE.to_owned(),
        controller_health: String::new(),
        agent_health_port: AGENT_HEALTH_PORT,
        set: args.set.clone(),
    });
    lab.save()?;
    step("rollout of the agents and the controller", || rollout(&lab))?;
    step("waiting until every agent is ready", || wait_ready(&lab))?;
    print_usage(&lab);
    Ok(())
}

/// The binary to deploy: the one given, else `egressgw` beside the running
/// xtask (both are built into the same target directory).
pub fn find_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(path) => path.to_path_buf(),
        None => {
            let exe = std::env::current_exe().context("finding the xtask binary")?;
            exe.with_file_name("egressgw")
        }
    };
    ensure!(
        path.is_file(),
        "no egressgw binary at {}: build it with `cargo build -p egressgw` (or pass --egressgw PATH)",
        path.display()
    );
    Ok(path)
}

/// Copies the binary under a name from its content's hash (pods of an
/// older deploy keep running theirs until they are replaced) and registers
/// it as `LAB_IMAGE:<hash>`. Returns the copy and the tag.
fn register_image(paths: &Paths, binary: &Path, dir: &Path) -> anyhow::Result<(PathBuf, String)> {
    let bytes = fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let mut hash = Fnv1a::default();
    hash.write(&bytes);
    let tag = format!("dev-{:016x}", hash.finish());
    let copy = dir.join(format!("egressgw-{tag}"));
    if !copy.is_file() {
        let tmp = copy.with_extension("new");
        fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", tmp.display()))?;
        fs::rename(&tmp, &copy).with_context(|| format!("moving {} into place", copy.display()))?;
    }
    let mut image = Image::of_binary(&copy, IMAGE_BINARY);
    // The image carries iperf3 for `egressgw bench`, as the Containerfile's does.
    image
        .binaries
        .insert(IMAGE_IPERF3.to_owned(), PathBuf::from(IMAGE_IPERF3));
    KnownImages::register(paths, &format!("{LAB_IMAGE}:{tag}"), image)?;
    Ok((copy, tag))
}

/// The values the lab needs: its image, never pulled, and its service
/// ranges; in a dual-stack lab, IPv6 egress too.
fn write_values(tag: &str, dual_stack: bool, dir: &Path) -> anyhow::Result<PathBuf> {
    let (services, ipv6) = match dual_stack {
        true => (format!("{SERVICE_CIDR}, {SERVICE6_CIDR}"), "true"),
        false => (SERVICE_CIDR.to_owned(), "false"),
    };
    let text = format!(
        "# Values of the lab's egressgw release (written by `cargo xtask lab deploy`).\n\
         image:\n  repository: {LAB_IMAGE}\n  tag: {tag}\n  pullPolicy: Never\n\
         feature:\n  # Traffic to the service ranges never goes to a gateway.\n\
         \x20 serviceCIDRs: [{services}]\n\
         \x20 enableIPv6: {ipv6}\n"
    );
    let path = dir.join("values.yaml");
    fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn apply_crds(lab: &Lab, chart: &Path) -> anyhow::Result<()> {
    let crds = chart.join("crds").display().to_string();
    lab.kubectl
        .run(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager",
            FIELD_MANAGER,
            "-f",
            &crds,
        ])
        .context("applying the CRDs")?;
    lab.kubectl
        .run(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "-f",
            &crds,
        ])
        .context("waiting for the CRDs to be Established")
        .map(drop)
}

fn install(helm: &Helm, values: &Path, args: &DeployArgs) -> anyhow::Result<()> {
    let chart = args.chart().display().to_string();
    let values = values.display().to_string();
    let extra: Vec<String> = args
        .values
        .iter()
        .map(|v| v.display().to_string())
        .collect();
    let mut argv = vec![
        "upgrade",
        "--install",
        RELEASE,
        &chart,
        "-n",
        NAMESPACE,
        "--create-namespace",
        "-f",
        &values,
    ];
    for file in &extra {
        argv.extend(["-f", file]);
    }
    for set in &args.set {
        argv.extend(["--set", set]);
    }
    helm.run(&argv).map(drop)
}

fn rollout(lab: &Lab) -> anyhow::Result<()> {
    let timeout = format!("--timeout={ROLLOUT_TIMEOUT}");
    for what in [
        format!("daemonset/{AGENT_DAEMONSET}"),
        format!("deployment/{CONTROLLER_DEPLOYMENT}"),
    ] {
        lab.kubectl
            .run(&["rollout", "status", &what, "-n", NAMESPACE, &timeout])
            .with_context(|| {
                format!(
                    "{what} did not roll out; the stand-in's log: {}",
                    lab.paths.logs().join("kubelet.log").display()
                )
            })?;
    }
    Ok(())
}

/// Polls every agent's `/readyz` from inside its node until all answer 200.
fn wait_ready(lab: &Lab) -> anyhow::Result<()> {
    let begun = Instant::now();
    loop {
        let waiting: Vec<String> = lab
            .state
            .topology
            .nodes
            .iter()
            .filter_map(|node| {
                let addr = SocketAddr::from((node.ip, AGENT_HEALTH_PORT));
                match probe::http_status(&node.netns, addr, "/readyz", Duration::from_secs(1)) {
                    Ok(200) => None,
                    Ok(code) => Some(format!("agent on {} (/readyz answers {code})", node.name)),
                    Err(e) => Some(format!("agent on {} ({e:#})", node.name)),
                }
            })
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        if begun.elapsed() > READY_TIMEOUT {
            bail!(
                "not ready after {}s: {}; logs in {}",
                READY_TIMEOUT.as_secs(),
                waiting.join(", "),
                lab.paths.logs().join("pods").display()
            );
        }
        thread::sleep(Duration::from_millis(250));
    }
}

fn print_usage(lab: &Lab) {
    let kubectl = lab.state.kubectl.display();
    println!(
        "\negressgw is up: release {RELEASE} in {NAMESPACE}, an agent on each of {} nodes",
        lab.state.topology.nodes.len()
    );
    println!("pods:       {kubectl} get pods -n {NAMESPACE} -o wide");
    println!(
        "logs:       {}/{NAMESPACE}_*/*.log",
        lab.paths.logs().join("pods").display()
    );
    println!("objects:    {kubectl} get egressgw -A -o wide");
    println!("examples:   {kubectl} apply -f deploy/examples/lab/");
    println!("status:     {}", lab.command("lab status"));
}

/// `lab agent kill|start NODE`.
#[derive(Debug, clap::Subcommand)]
pub enum AgentCommand {
    /// SIGKILL the agent of NODE, as if it crashed, and hold it down: the
    /// kubelet stand-in does not restart it until `agent start`.
    Kill { node: String },
    /// Let the agent of NODE run again (the stand-in restarts it).
    Start { node: String },
}

/// How long a daemon gets to serve `/metrics`.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// `GET /metrics` at `addr` from `ns`: its body, after checking that it is
/// a whole OpenMetrics exposition.
pub fn scrape_metrics(ns: &super::topology::Netns, addr: SocketAddr) -> anyhow::Result<String> {
    let (code, body) = probe::http_get(ns, addr, "/metrics", SCRAPE_TIMEOUT)?;
    ensure!(
        code == 200,
        "GET /metrics on {addr} in {ns} answered {code}"
    );
    ensure!(
        body.ends_with("# EOF\n"),
        "GET /metrics on {addr} in {ns} is not a whole exposition: {}",
        body.chars().rev().take(80).collect::<String>()
    );
    Ok(body)
}

/// The metrics of `node`'s agent, scraped at its node address.
pub fn scrape_agent(lab: &Lab, node: &str) -> anyhow::Result<String> {
    let n = lab.node(node)?;
    scrape_metrics(&n.netns, SocketAddr::from((n.ip, AGENT_HEALTH_PORT)))
}

pub fn agent(command: &AgentCommand, paths: &Paths) -> anyhow::Result<()> {
    let lab = Lab::open(paths)?;
    match command {
        AgentCommand::Kill { node } => {
            let pid = kill_agent(&lab, node)?;
            println!("killed the agent of {node} (pid {pid}, SIGKILL); held until `agent start`");
        }
        AgentCommand::Start { node } => {
            let (log, _) = start_agent(&lab, node)?;
            println!("the agent of {node} runs again (log {})", log.display());
        }
    }
    Ok(())
}

/// Runs the agent of `node`'s own program with `args` inside its
/// container, as `kubectl exec` would: in its mount, network and UTS
/// namespaces, with its environment. Returns the output, whatever the
/// exit status.
pub fn exec_in_agent(lab: &Lab, node: &str, args: &[&str]) -> anyhow::Result<std::process::Output> {
    exec_in_agent_with_input(lab, node, args, &[])
}

/// [`exec_in_agent`] with `input` on the program's standard input.
pub fn exec_in_agent_with_input(
    lab: &Lab,
    node: &str,
    args: &[&str],
    input: &[u8],
) -> anyhow::Result<std::process::Output> {
    let pid = agent_pid(lab, node)?;
    let read = |what: &str| {
        fs::read(format!("/proc/{pid}/{what}"))
            .with_context(|| format!("reading /proc/{pid}/{what} of the agent of {node}"))
    };
    let split = |bytes: Vec<u8>| -> Vec<String> {
        bytes
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect()
    };
    let program = split(read("cmdline")?)
        .into_iter()
        .next()
        .with_context(|| format!("the agent of {node} has no command line"))?;
    let env = split(read("environ")?);
    kubelet::enter_container(pid)
        .arg(&program)
        .args(args)
        .env_clear()
        .envs(env.iter().filter_map(|kv| kv.split_once('=')))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            // Written from a thread: a program that prints before it has
            // read everything must not block the writer.
            let stdin = child.stdin.take();
            let input = input.to_vec();
            let writer = thread::spawn(move || {
                use std::io::Write as _;
                stdin.map_or(Ok(()), |mut s| s.write_all(&input))
            });
            let output = child.wait_with_output();
            let _ = writer.join();
            output
        })
        .with_context(|| format!("running {program} {args:?} in the agent of {node}"))
}

/// The process of the agent of `node`'s container.
fn agent_pid(lab: &Lab, node: &str) -> anyhow::Result<u32> {
    agent_pod(lab, node)?
        .containers
        .first()
        .and_then(|c| c.pid)
        .with_context(|| format!("the agent of {node} is not running"))
}

/// The agent pod of `node`, as the stand-in runs it.
fn agent_pod(lab: &Lab, node: &str) -> anyhow::Result<Record> {
    lab.node(node)?;
    kubelet::records(&lab.paths)
        .into_iter()
        .find(|r| r.namespace == NAMESPACE && r.node == node && is_agent_pod(&r.name))
        .with_context(|| {
            format!(
                "no agent pod runs on {node}: is egressgw deployed (`{}`)?",
                lab.command("lab deploy")
            )
        })
}

fn is_agent_pod(name: &str) -> bool {
    name.strip_prefix(AGENT_DAEMONSET)
        .is_some_and(|rest| rest.starts_with('-'))
}

/// SIGKILLs the agent of `node` and holds it down; returns its pid.
pub fn kill_agent(lab: &Lab, node: &str) -> anyhow::Result<u32> {
    let pod = agent_pod(lab, node)?;
    let container = pod
        .containers
        .first()
        .with_context(|| format!("the agent pod {} has no container", pod.name))?;
    let pid = container
        .pid
        .with_context(|| format!("the agent of {node} is not running ({})", container.state))?;
    kubelet::hold(&lab.paths, &pod.namespace, &pod.name)?;
    process::kill_now(pid).with_context(|| format!("killing the agent of {node}"))?;
    Ok(pid)
}

/// Releases the agent of `node` and waits until it runs again. Returns its
/// log and where the new process's output starts in it.
pub fn start_agent(lab: &Lab, node: &str) -> anyhow::Result<(PathBuf, u64)> {
    let pod = agent_pod(lab, node)?;
    let container = pod
        .containers
        .first()
        .with_context(|| format!("the agent pod {} has no container", pod.name))?;
    let log = container.log.clone();
    let offset = fs::metadata(&log).map_or(0, |m| m.len());
    let old = container.pid;
    kubelet::release(&lab.paths, &pod.namespace, &pod.name)?;
    let begun = Instant::now();
    loop {
        let now = agent_pod(lab, node)?;
        let pid = now.containers.first().and_then(|c| c.pid);
        if pid.is_some() && pid != old && pid.is_some_and(process::alive) {
            return Ok((log, offset));
        }
        ensure!(
            begun.elapsed() < RESTART_TIMEOUT,
            "the agent of {node} did not run again within {}s; see {}",
            RESTART_TIMEOUT.as_secs(),
            lab.paths.logs().join("kubelet.log").display()
        );
        thread::sleep(Duration::from_millis(200));
    }
}

/// Releases the agent of `node` if `agent kill` holds it.
pub fn release_agent(lab: &Lab, node: &str) -> anyhow::Result<()> {
    let pod = agent_pod(lab, node)?;
    kubelet::release(&lab.paths, &pod.namespace, &pod.name)
}

/// `lab node down|up NODE`.
#[derive(Debug, clap::Subcommand)]
pub enum NodeCommand {
    /// Set NODE's underlay and external links down: to the rest of the
    /// cluster, the node has failed (its processes keep running).
    Down { node: String },
    /// Set them up again.
    Up { node: String },
}

pub fn node(command: &NodeCommand, paths: &Paths) -> anyhow::Result<()> {
    let lab = Lab::open(paths)?;
    let (name, up) = match command {
        NodeCommand::Down { node } => (node, false),
        NodeCommand::Up { node } => (node, true),
    };
    let links = set_node_links(&lab.state.topology, lab.node(name)?, up)?;
    let word = if up { "up" } else { "down" };
    println!("{name}: {} {word}", links.join(" and "));
    Ok(())
}

/// Sets the node's underlay link and, on gateway nodes, its external link
/// up or down, inside the node's namespace; on the way up, restores the
/// node's host-gw routes, which the kernel dropped with the links. Returns
/// the links' names.
pub fn set_node_links(topo: &Topology, node: &Node, up: bool) -> anyhow::Result<Vec<String>> {
    let mut links = vec![node.interface.clone()];
    links.extend(node.external.iter().map(|e| e.interface.clone()));
    let state = if up { "up" } else { "down" };
    for link in &links {
        cmd::run(
            "ip",
            &["-n", node.netns.as_str(), "link", "set", link, state],
        )
        .with_context(|| format!("setting {link} of {} {state}", node.name))?;
    }
    if up {
        super::network::node_routes(topo, node)
            .with_context(|| format!("restoring the routes of {}", node.name))?;
    }
    Ok(links)
}

/// Freezes (SIGSTOP) or thaws (SIGCONT) the lab's control-plane process
/// `name` (`kube-apiserver`, `etcd`, ...): frozen, it holds its connections
/// and answers nothing, as a hung or partitioned API server does. Returns
/// its pid.
pub fn freeze_control_plane(lab: &Lab, name: &str, frozen: bool) -> anyhow::Result<u32> {
    let record = lab
        .state
        .processes
        .iter()
        .find(|p| p.name == name)
        .with_context(|| format!("the lab runs no {name}"))?;
    signal(record.pid, frozen).with_context(|| format!("signalling {name}"))?;
    Ok(record.pid)
}

/// SIGKILLs a control-plane process (`etcd`, `kube-apiserver`, ...) and
/// starts it again the same way once it is gone; records the new pid.
pub fn restart_control_plane(lab: &mut Lab, name: &str) -> anyhow::Result<u32> {
    let index = lab
        .state
        .processes
        .iter()
        .position(|p| p.name == name)
        .with_context(|| format!("the lab runs no {name}"))?;
    let record = lab.state.processes[index].clone();
    process::kill_now(record.pid).with_context(|| format!("killing {name}"))?;
    let started = process::start_again(&lab.paths, &record)
        .with_context(|| format!("starting {name} again"))?;
    lab.state.processes[index] = started.record.clone();
    lab.save()?;
    Ok(started.record.pid)
}

/// The pids of every controller pod's processes.
pub fn controller_pids(lab: &Lab) -> Vec<u32> {
    kubelet::records(&lab.paths)
        .into_iter()
        .filter(|r| {
            r.namespace == NAMESPACE
                && r.name
                    .strip_prefix(CONTROLLER_DEPLOYMENT)
                    .is_some_and(|rest| rest.starts_with('-'))
        })
        .flat_map(|r| r.containers.into_iter().filter_map(|c| c.pid))
        .collect()
}

/// SIGKILLs every controller pod's processes (the kubelet stand-in starts
/// them again, as a kubelet restarts a crashed container). Returns their pids.
pub fn kill_controllers(lab: &Lab) -> anyhow::Result<Vec<u32>> {
    let pids = controller_pids(lab);
    ensure!(!pids.is_empty(), "no controller pod is running");
    for pid in &pids {
        process::kill_now(*pid).with_context(|| format!("killing controller pid {pid}"))?;
    }
    Ok(pids)
}

/// Freezes or thaws every controller pod's processes. Returns their pids.
pub fn freeze_controllers(lab: &Lab, frozen: bool) -> anyhow::Result<Vec<u32>> {
    let pids = controller_pids(lab);
    ensure!(!pids.is_empty(), "no controller pod is running");
    for pid in &pids {
        signal(*pid, frozen).with_context(|| format!("signalling controller pid {pid}"))?;
    }
    Ok(pids)
}

/// Freezes (SIGSTOP) or thaws (SIGCONT) the agent of `node`; returns its pid.
pub fn freeze_agent(lab: &Lab, node: &str, frozen: bool) -> anyhow::Result<u32> {
    let pid = agent_pid(lab, node)?;
    signal(pid, frozen).with_context(|| format!("signalling the agent of {node} (pid {pid})"))?;
    Ok(pid)
}

fn signal(pid: u32, frozen: bool) -> anyhow::Result<()> {
    let sig = if frozen { "STOP" } else { "CONT" };
    cmd::run("kill", &["-s", sig, &pid.to_string()]).map(drop)
}

/// Sets only the node's underlay link up or down: the node is cut off from
/// the other nodes but, on a gateway node, still on the external segment.
pub fn set_node_underlay(topo: &Topology, node: &Node, up: bool) -> anyhow::Result<()> {
    let state = if up { "up" } else { "down" };
    cmd::run(
        "ip",
        &[
            "-n",
            node.netns.as_str(),
            "link",
            "set",
            &node.interface,
            state,
        ],
    )
    .with_context(|| format!("setting {} of {} {state}", node.interface, node.name))?;
    if up {
        super::network::node_routes(topo, node)
            .with_context(|| format!("restoring the routes of {}", node.name))?;
    }
    Ok(())
}

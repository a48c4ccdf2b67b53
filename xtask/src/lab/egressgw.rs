//! `lab deploy` and `lab agent`: egressgw's controller and agents in the lab.
//!
//! The controller runs in the control-plane namespace, one agent in each node
//! namespace (as a DaemonSet pod with `hostNetwork: true` would), all with the
//! lab's admin kubeconfig and one config file. They are lab processes like
//! etcd: recorded in `lab.json`, logged under `logs/`, stopped by `lab down`.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

use super::process::{self, Started};
use super::session::Lab;
use super::state::{Deployment, Paths, ProcessRecord};
use super::topology::{Netns, Node, SERVICE_CIDR, Topology};
use super::up::step;
use super::{cmd, probe};

/// The Kubernetes namespace of egressgw's Leases.
pub const NAMESPACE: &str = "egressgw-system";
/// The controller's health port (its default).
pub const CONTROLLER_HEALTH_PORT: u16 = 9811;
/// The agents' health port (their default).
pub const AGENT_HEALTH_PORT: u16 = 9812;
/// The process name of the controller in `lab.json`.
pub const CONTROLLER: &str = "egressgw-controller";
/// How long the daemons get to become ready after they start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the CRDs get to be served.
const CRD_TIMEOUT: &str = "60s";
/// Field manager of what the lab applies.
const FIELD_MANAGER: &str = "egressgw-lab";

/// The process name of the agent of `node` in `lab.json`.
pub fn agent_name(node: &str) -> String {
    format!("egressgw-agent-{node}")
}

/// What `lab deploy` was asked for.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DeployArgs {
    /// The egressgw binary [default: `egressgw` beside this xtask binary,
    /// i.e. target/debug/egressgw].
    #[arg(long, value_name = "PATH")]
    pub egressgw: Option<PathBuf>,
    /// Config file for every daemon [default: one the lab writes, with the
    /// lab's service CIDR].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Installs the CRDs and the namespace, starts the controller and one agent
/// per node, and waits until they are ready. Run again, it replaces the
/// running daemons (with a new binary, if it was rebuilt).
pub fn deploy(args: &DeployArgs, paths: &Paths) -> anyhow::Result<()> {
    let mut lab = Lab::open(paths)?;
    let binary = find_binary(args.egressgw.as_deref())?;
    println!(
        "deploying egressgw ({}) to the lab {}",
        binary.display(),
        paths.prefix
    );
    stop_running(&mut lab)?;
    let dir = paths.egressgw();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    step("CRDs and the namespace", || install_api(&lab))?;
    let deployment = step("the egressgw binary and its config", || {
        Ok(Deployment {
            binary: copy_binary(&binary, &dir.join("egressgw"))?,
            config: write_config(args.config.as_deref(), &dir.join("config.yaml"))?,
            namespace: NAMESPACE.to_owned(),
            controller_health: SocketAddr::from((Ipv4Addr::LOCALHOST, CONTROLLER_HEALTH_PORT))
                .to_string(),
            agent_health_port: AGENT_HEALTH_PORT,
        })
    })?;
    lab.state.egressgw = Some(deployment.clone());
    let mut started = step("controller and agents", || start_all(&lab, &deployment))?;
    for s in &started {
        lab.state.set_process(s.record.clone());
    }
    lab.save()?;
    step("waiting until they are ready", || {
        wait_ready(&lab, &deployment, &mut started)
    })?;
    print_usage(&lab);
    Ok(())
}

/// The binary to deploy: the one given, else `egressgw` beside the running
/// xtask (both are built into the same target directory).
fn find_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
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

/// A copy the daemons run, so a rebuild of the workspace does not change
/// the program under them (and `agent start` starts the same one again).
fn copy_binary(from: &Path, to: &Path) -> anyhow::Result<PathBuf> {
    // Replacing a running executable in place fails (ETXTBSY): write a new file.
    let tmp = to.with_extension("new");
    fs::copy(from, &tmp)
        .with_context(|| format!("copying {} to {}", from.display(), tmp.display()))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", tmp.display()))?;
    fs::rename(&tmp, to).with_context(|| format!("moving {} into place", to.display()))?;
    Ok(to.to_path_buf())
}

/// The config every daemon reads: the given file (copied), or one naming the
/// lab's service range as in-cluster.
fn write_config(given: Option<&Path>, to: &Path) -> anyhow::Result<PathBuf> {
    let text = match given {
        Some(path) => {
            fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => format!(
            "# egressgw's config in the lab (written by `cargo xtask lab deploy`).\n\
             # Traffic to the service range never goes to a gateway.\n\
             serviceCIDRs: [{SERVICE_CIDR}]\n"
        ),
    };
    fs::write(to, text).with_context(|| format!("writing {}", to.display()))?;
    Ok(to.to_path_buf())
}

/// Applies the CRDs and the namespace, and waits until the CRDs are served.
fn install_api(lab: &Lab) -> anyhow::Result<()> {
    let crds = crate::workspace_root().join("deploy").join("crds");
    let crds = crds.display().to_string();
    let kubectl = &lab.kubectl;
    kubectl
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
    let namespace = format!(
        "{{\"apiVersion\": \"v1\", \"kind\": \"Namespace\", \"metadata\": {{\"name\": \"{NAMESPACE}\"}}}}"
    );
    kubectl
        .run_with_input(
            &[
                "apply",
                "--server-side",
                "--field-manager",
                FIELD_MANAGER,
                "-f",
                "-",
            ],
            Some(&namespace),
        )
        .with_context(|| format!("creating the namespace {NAMESPACE}"))?;
    let timeout = format!("--timeout={CRD_TIMEOUT}");
    kubectl
        .run(&["wait", "--for=condition=Established", &timeout, "-f", &crds])
        .context("waiting for the CRDs to be Established")
        .map(drop)
}

/// Stops the egressgw daemons a previous `deploy` started, and forgets them.
fn stop_running(lab: &mut Lab) -> anyhow::Result<()> {
    let (ours, others): (Vec<ProcessRecord>, Vec<ProcessRecord>) = lab
        .state
        .processes
        .drain(..)
        .partition(|p| p.name.starts_with("egressgw-"));
    lab.state.processes = others;
    let running: Vec<u32> = ours
        .iter()
        .map(|p| p.pid)
        .filter(|&p| process::alive(p))
        .collect();
    if !running.is_empty() {
        println!("  stopping the running egressgw daemons (pids {running:?})");
        let survivors = process::stop_all(&running);
        ensure!(survivors.is_empty(), "pids {survivors:?} survived SIGKILL");
    }
    lab.save()
}

fn start_all(lab: &Lab, deployment: &Deployment) -> anyhow::Result<Vec<Started>> {
    let topo = &lab.state.topology;
    let mut started = vec![process::start(
        &lab.paths,
        &topo.control_plane.netns,
        CONTROLLER,
        &deployment.binary,
        &controller_args(lab, deployment),
    )?];
    for node in &topo.nodes {
        started.push(process::start(
            &lab.paths,
            &node.netns,
            &agent_name(&node.name),
            &deployment.binary,
            &agent_args(lab, deployment, node),
        )?);
    }
    Ok(started)
}

fn common_args(lab: &Lab, deployment: &Deployment) -> Vec<String> {
    vec![
        "--kubeconfig".to_owned(),
        lab.state.kubeconfig.display().to_string(),
        "--config".to_owned(),
        deployment.config.display().to_string(),
        "--namespace".to_owned(),
        deployment.namespace.clone(),
    ]
}

fn controller_args(lab: &Lab, deployment: &Deployment) -> Vec<String> {
    let mut args = vec!["controller".to_owned()];
    args.extend(common_args(lab, deployment));
    args.extend([
        "--identity".to_owned(),
        lab.paths.prefix.name("controller"),
        "--health-addr".to_owned(),
        format!("0.0.0.0:{CONTROLLER_HEALTH_PORT}"),
    ]);
    args
}

fn agent_args(lab: &Lab, deployment: &Deployment, node: &Node) -> Vec<String> {
    let mut args = vec!["agent".to_owned(), "--node".to_owned(), node.name.clone()];
    args.extend(common_args(lab, deployment));
    args.extend([
        "--health-addr".to_owned(),
        format!("0.0.0.0:{}", deployment.agent_health_port),
    ]);
    args
}

/// One daemon to wait for: where its health endpoint is, from where.
struct Probe<'a> {
    name: String,
    netns: &'a Netns,
    addr: SocketAddr,
    path: &'static str,
}

fn probes<'a>(lab: &'a Lab, deployment: &Deployment) -> Vec<Probe<'a>> {
    let topo = &lab.state.topology;
    let mut all = vec![Probe {
        name: "controller".to_owned(),
        netns: &topo.control_plane.netns,
        addr: SocketAddr::from((Ipv4Addr::LOCALHOST, CONTROLLER_HEALTH_PORT)),
        path: "/healthz",
    }];
    all.extend(topo.nodes.iter().map(|node| Probe {
        name: format!("agent on {}", node.name),
        netns: &node.netns,
        addr: SocketAddr::from((node.ip, deployment.agent_health_port)),
        path: "/readyz",
    }));
    all
}

/// Polls every daemon's health endpoint (from inside its namespace) until
/// all answer 200, printing who is still waited for every few seconds.
/// Fails early, with the end of its log, if a daemon exits.
fn wait_ready(lab: &Lab, deployment: &Deployment, started: &mut [Started]) -> anyhow::Result<()> {
    let probes = probes(lab, deployment);
    let begun = Instant::now();
    let mut last_report = begun;
    loop {
        for process in started.iter_mut() {
            process.check_running()?;
        }
        let waiting: Vec<String> = probes
            .iter()
            .filter_map(|p| {
                match probe::http_status(p.netns, p.addr, p.path, Duration::from_secs(1)) {
                    Ok(200) => None,
                    Ok(code) => Some(format!("{} ({} answers {code})", p.name, p.path)),
                    Err(e) => Some(format!("{} ({e:#})", p.name)),
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
                lab.paths.logs().display()
            );
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            print!(
                "\n    {:.0}s, waiting for: {} ... ",
                begun.elapsed().as_secs_f64(),
                waiting.join(", ")
            );
            last_report = Instant::now();
        }
        thread::sleep(Duration::from_millis(250));
    }
}

fn print_usage(lab: &Lab) {
    let logs = lab.paths.logs();
    println!(
        "\negressgw is up: a controller and {} agents",
        lab.state.topology.nodes.len()
    );
    println!("logs:       {}/egressgw-*.log", logs.display());
    println!(
        "objects:    {} get egressgw -A -o wide",
        lab.state.kubectl.display()
    );
    println!(
        "examples:   {} apply -f deploy/examples/lab/",
        lab.state.kubectl.display()
    );
    println!("status:     {}", lab.command("lab status"));
}

/// `lab agent kill|start NODE`.
#[derive(Debug, clap::Subcommand)]
pub enum AgentCommand {
    /// SIGKILL the agent of NODE: no cleanup, as if it crashed.
    Kill { node: String },
    /// Start the agent of NODE again, as `deploy` started it.
    Start { node: String },
}

pub fn agent(command: &AgentCommand, paths: &Paths) -> anyhow::Result<()> {
    let mut lab = Lab::open(paths)?;
    match command {
        AgentCommand::Kill { node } => {
            let pid = kill_agent(&lab, node)?;
            println!("killed the agent of {node} (pid {pid}, SIGKILL)");
        }
        AgentCommand::Start { node } => {
            let (started, _) = start_agent(&mut lab, node)?;
            println!(
                "started the agent of {node} (pid {}, log {})",
                started.record.pid,
                started.record.log.display()
            );
        }
    }
    Ok(())
}

/// SIGKILLs the agent of `node`; returns its pid.
pub fn kill_agent(lab: &Lab, node: &str) -> anyhow::Result<u32> {
    lab.node(node)?;
    let record = agent_record(lab, node)?;
    ensure!(
        process::alive(record.pid),
        "the agent of {node} (pid {}) is not running: `{}` starts it",
        record.pid,
        lab.command(&format!("lab agent start {node}"))
    );
    process::kill_now(record.pid).with_context(|| format!("killing the agent of {node}"))?;
    Ok(record.pid)
}

/// Starts the agent of `node` again with the arguments it had; records the
/// new pid. Returns the process and where its output starts in the log.
pub fn start_agent(lab: &mut Lab, node: &str) -> anyhow::Result<(Started, u64)> {
    lab.node(node)?;
    let record = agent_record(lab, node)?.clone();
    ensure!(
        !process::alive(record.pid),
        "the agent of {node} is running (pid {}): `{}` first",
        record.pid,
        lab.command(&format!("lab agent kill {node}"))
    );
    let (started, offset) = process::restart(&lab.paths, &record)
        .with_context(|| format!("starting the agent of {node}"))?;
    lab.state.set_process(started.record.clone());
    lab.save()?;
    Ok((started, offset))
}

fn agent_record<'a>(lab: &'a Lab, node: &str) -> anyhow::Result<&'a ProcessRecord> {
    lab.state.process(&agent_name(node)).with_context(|| {
        format!(
            "egressgw is not deployed in this lab: `{}`",
            lab.command("lab deploy")
        )
    })
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

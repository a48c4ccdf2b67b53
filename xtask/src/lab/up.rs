//! `lab up`: builds (or finds) the control plane, then creates the lab step by
//! step. If a step fails, everything made so far is torn down again (unless
//! `--keep-on-failure`) and the error names the step.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;

use super::build::{self, Binaries, KUBERNETES_VERSION};
use super::kubectl::Kubectl;
use super::process::{self, Started};
use super::state::{LAB_JSON_VERSION, LabState, Paths};
use super::topology::{CLUSTER_CIDR, CLUSTER6_CIDR, KUBERNETES_SERVICE_IP, Pod, Topology};
use super::{certs, cluster, controlplane, down, kubelet, net, network, preflight, target};

/// What `lab up` was asked for.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Number of nodes (1-100).
    #[arg(long, default_value_t = 3)]
    pub nodes: u8,
    /// How many of the nodes (the first ones) are gateway-capable: labelled
    /// `egressgw.io/gateway=true` and attached to the external segment.
    #[arg(long, default_value_t = 2)]
    pub gateways: u8,
    /// Dual stack: IPv6 beside IPv4 on every segment, node, pod and the
    /// target, and an IPv6 service range.
    #[arg(long)]
    pub ipv6: bool,
    /// On failure, leave what was made for inspection instead of removing it.
    #[arg(long)]
    pub keep_on_failure: bool,
}

pub fn up(args: &UpArgs, paths: &Paths) -> anyhow::Result<()> {
    preflight::check()?;
    let mut topo = Topology::new(&paths.prefix, args.nodes, args.gateways)?;
    if args.ipv6 {
        topo = topo.with_ipv6();
    }
    refuse_leftovers(paths)?;
    let bins = build::ensure(paths)?;
    let started = Instant::now();
    println!(
        "creating the lab {} in {}",
        paths.prefix,
        paths.lab.display()
    );
    let mut processes = Vec::new();
    match create(&topo, paths, &bins, &mut processes) {
        Ok(state) => {
            println!("lab up in {:.1}s\n", started.elapsed().as_secs_f64());
            print_usage(&state, &topo, paths);
            Ok(())
        }
        Err(e) => {
            after_failure(args.keep_on_failure, paths, &mut processes);
            Err(e)
        }
    }
}

/// Shows the end of every log, then removes what was made unless asked to keep it.
fn after_failure(keep: bool, paths: &Paths, processes: &mut [Started]) {
    show_logs(processes);
    if keep {
        eprintln!("left as it is for inspection; remove it with `cargo xtask lab down`");
        return;
    }
    eprintln!("removing what was made...");
    if let Err(cleanup) = down::teardown(paths) {
        eprintln!("cleanup failed too: {cleanup:#}\nrun `cargo xtask lab down`");
    }
    processes.iter_mut().for_each(Started::reap);
}

/// A lab that is up, or the remains of one, must be taken down first: `up`
/// would otherwise clean up someone else's lab when it fails.
fn refuse_leftovers(paths: &Paths) -> anyhow::Result<()> {
    let netns = net::lab_netns(&paths.prefix).context("listing network namespaces")?;
    anyhow::ensure!(
        netns.is_empty() && !paths.any_present(),
        "a lab is up or left over ({} namespaces named {}-*, state in {}): run `{}` first",
        netns.len(),
        paths.prefix,
        paths.lab.display(),
        paths.command("lab down")
    );
    Ok(())
}

fn create(
    topo: &Topology,
    paths: &Paths,
    bins: &Binaries,
    processes: &mut Vec<Started>,
) -> anyhow::Result<LabState> {
    step("state directory", || paths.create())?;
    step("network namespaces, links and routes", || {
        network::create(topo)
    })?;
    let cp_ip = topo.control_plane.ip;
    let pki = step("certificates and tokens", || {
        certs::create(&paths.pki(), cp_ip, KUBERNETES_SERVICE_IP, &topo.nodes)
    })?;
    let kubectl = Kubectl::new(bins, paths, topo);
    step(
        "etcd, kube-apiserver, kube-controller-manager, kube-scheduler",
        || {
            let started = controlplane::start(topo, paths, bins, &pki);
            started.map(|s| processes.extend(s))
        },
    )?;
    step("namespaces, nodes and pods in the API", || {
        cluster::register(&kubectl, topo)
    })?;
    step("target services (whoami, iperf3)", || {
        let mut started = target::start(topo, paths)?;
        let listening = target::wait_listening(topo, &mut started);
        processes.extend(started);
        listening
    })?;
    let mut state = step("lab.json and the kubectl wrapper", || {
        write_state(topo, paths, bins, &kubectl, processes)
    })?;
    step("kubelet stand-in", || {
        let started = kubelet::start(paths)?;
        state.set_process(started.record.clone());
        processes.push(started);
        state.write(paths)
    })?;
    Ok(state)
}

/// Runs one step, printing its name and how long it took.
pub fn step<T>(name: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    print!("  {name} ... ");
    let _ = std::io::stdout().flush();
    let started = Instant::now();
    let result = f();
    match &result {
        Ok(_) => println!("ok ({:.1}s)", started.elapsed().as_secs_f64()),
        Err(_) => println!("FAILED"),
    }
    result.with_context(|| format!("failed at: {name}"))
}

fn write_state(
    topo: &Topology,
    paths: &Paths,
    bins: &Binaries,
    kubectl: &Kubectl,
    processes: &[Started],
) -> anyhow::Result<LabState> {
    let state = LabState {
        version: LAB_JSON_VERSION,
        dir: paths.lab.clone(),
        kubernetes_version: KUBERNETES_VERSION.to_owned(),
        bin_dir: bins.dir.clone(),
        helm: bins.helm.clone(),
        images: super::images::KnownImages::path(paths),
        kubeconfig: paths.kubeconfig(),
        kubectl: kubectl.write_wrapper(&paths.kubectl_wrapper())?,
        api_server: topo.control_plane.api_server.clone(),
        cluster_cidr: cidrs(CLUSTER_CIDR, topo.dual_stack().then_some(CLUSTER6_CIDR)),
        service_cidr: controlplane::service_cidrs(topo).join(","),
        netns: topo.all_netns().iter().map(ToString::to_string).collect(),
        processes: processes.iter().map(|p| p.record.clone()).collect(),
        egressgw: None,
        topology: topo.clone(),
    };
    state.write(paths)?;
    Ok(state)
}

/// `v4`, and `v6` after a comma when there is one.
fn cidrs(v4: &str, v6: Option<&str>) -> String {
    v6.map_or_else(|| v4.to_owned(), |v6| format!("{v4},{v6}"))
}

fn show_logs(processes: &[Started]) {
    for p in processes {
        let log = &p.record.log;
        eprintln!("--- the end of {} ({}):", p.record.name, log.display());
        eprintln!("{}", process::log_tail(log, 10));
    }
}

fn print_usage(state: &LabState, topo: &Topology, paths: &Paths) {
    print_access(state, topo);
    println!("helm:       {}", state.helm.display());
    println!(
        "pods:       the kubelet stand-in runs Pods whose image {} names (`{}`)",
        state.images.display(),
        paths.command("lab image add")
    );
    print_hosts(topo);
    println!("egressgw:   {}", paths.command("lab deploy"));
    println!("status:     {}", paths.command("lab status"));
    println!("check:      {}", paths.command("lab selftest"));
    println!("remove:     {}", paths.command("lab down"));
}

fn print_access(state: &LabState, topo: &Topology) {
    let (cp, kubeconfig) = (&topo.control_plane, state.kubeconfig.display());
    println!("state:      {}", state.dir.join("lab.json").display());
    println!(
        "api server: {} (Kubernetes {})",
        state.api_server, state.kubernetes_version
    );
    println!("kubeconfig: {kubeconfig}");
    println!(
        "kubectl:    {} get nodes,pods -A -o wide",
        state.kubectl.display()
    );
    let bin = state.bin_dir.display();
    println!(
        "            (or: ip netns exec {} {bin}/kubectl --kubeconfig {kubeconfig} ...)",
        cp.netns
    );
}

fn print_hosts(topo: &Topology) {
    println!("\nnodes:");
    for node in &topo.nodes {
        let ext = node
            .external
            .as_ref()
            .map(|e| format!(", external {}", e.ip));
        let (name, ns, ip, pods) = (&node.name, &node.netns, node.ip, &node.pod_cidr);
        println!(
            "  {name:<8} netns {ns:<12} {ip}  pods {pods}{}",
            ext.unwrap_or_default()
        );
        if let (Some(ip6), Some(pods6)) = (node.ip6, &node.pod_cidr6) {
            let ext6 = node.external.as_ref().and_then(|e| e.ip6);
            let ext6 = ext6
                .map(|ip| format!(", external {ip}"))
                .unwrap_or_default();
            println!("  {:<8} {:<18} {ip6}  pods {pods6}{ext6}", "", "");
        }
    }
    let t = &topo.target;
    let (ns, ip, whoami, iperf3) = (&t.netns, t.ip, t.whoami_port, t.iperf3_port);
    let ip6 = t.ip6.map(|ip6| format!(" and {ip6}")).unwrap_or_default();
    println!("\ntarget:     netns {ns} at {ip}{ip6} (whoami :{whoami}, iperf3 :{iperf3})");
    let on_gateway = |p: &&Pod| topo.nodes.iter().any(|n| n.name == p.node && n.gateway);
    if let Some(pod) = topo.pods.iter().find(on_gateway) {
        let pod_ns = &pod.netns;
        println!(
            "try:        ip netns exec {pod_ns} bash -c 'exec 3<>/dev/tcp/{ip}/{whoami}; cat <&3'"
        );
    }
}

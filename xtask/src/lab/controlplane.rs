//! Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler
//! in the control-plane namespace and waits until the API answers `/readyz`.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::build::Binaries;
use super::certs::Pki;
use super::kubectl::Kubectl;
use super::process::{self, Started};
use super::state::Paths;
use super::topology::{SERVICE_CIDR, SERVICE6_CIDR, Topology};

/// How long kube-apiserver gets to become ready (it takes about 2 s here).
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// etcd's client URL, on the control plane's loopback only.
const ETCD_CLIENT: &str = "http://127.0.0.1:2379";
const ETCD_PEER: &str = "http://127.0.0.1:2380";

/// Writes the kubeconfigs, starts the four components and waits for the API.
/// Returns the started processes, etcd first.
pub fn start(
    topo: &Topology,
    paths: &Paths,
    bins: &Binaries,
    pki: &Pki,
) -> anyhow::Result<Vec<Started>> {
    let api = &topo.control_plane.api_server;
    write_kubeconfig(&paths.kubeconfig(), api, pki, "admin", &pki.admin_token)?;
    let kcm_config = paths.pki().join("controller-manager.kubeconfig");
    let kcm_token = &pki.controller_manager_token;
    write_kubeconfig(&kcm_config, api, pki, "kube-controller-manager", kcm_token)?;
    let scheduler_config = paths.pki().join("scheduler.kubeconfig");
    write_kubeconfig(
        &scheduler_config,
        api,
        pki,
        "kube-scheduler",
        &pki.scheduler_token,
    )?;

    let ns = &topo.control_plane.netns;
    let mut started = vec![
        process::start(paths, ns, "etcd", &bins.etcd(), &etcd_args(paths))?,
        process::start(
            paths,
            ns,
            "kube-apiserver",
            &bins.apiserver(),
            &apiserver_args(topo, pki),
        )?,
    ];
    let kubectl = Kubectl::new(bins, paths, topo);
    wait_ready(&kubectl, &mut started).context("waiting for kube-apiserver's /readyz")?;
    let kcm_args = controller_manager_args(&kcm_config, &pki.ca_cert());
    let kcm = process::start(
        paths,
        ns,
        "kube-controller-manager",
        &bins.controller_manager(),
        &kcm_args,
    )?;
    started.push(kcm);
    let scheduler = process::start(
        paths,
        ns,
        "kube-scheduler",
        &bins.scheduler(),
        &scheduler_args(&scheduler_config),
    )?;
    started.push(scheduler);
    Ok(started)
}

/// A kubeconfig for `user` with a bearer token, trusting the lab's CA.
fn write_kubeconfig(
    path: &Path,
    server: &str,
    pki: &Pki,
    user: &str,
    token: &str,
) -> anyhow::Result<()> {
    let ca = pki.ca_cert();
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: egressgw-lab
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {user}
  user:
    token: {token}
contexts:
- name: egressgw-lab
  context:
    cluster: egressgw-lab
    user: {user}
current-context: egressgw-lab
",
        ca = ca.display()
    );
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn args(pairs: &[(&str, &str)]) -> Vec<String> {
    pairs
        .iter()
        .map(|(flag, value)| format!("--{flag}={value}"))
        .collect()
}

fn etcd_args(paths: &Paths) -> Vec<String> {
    let data = paths.etcd_data();
    args(&[
        ("name", "lab"),
        ("data-dir", &data.display().to_string()),
        ("listen-client-urls", ETCD_CLIENT),
        ("advertise-client-urls", ETCD_CLIENT),
        ("listen-peer-urls", ETCD_PEER),
        ("initial-advertise-peer-urls", ETCD_PEER),
        ("initial-cluster", &format!("lab={ETCD_PEER}")),
        ("listen-metrics-urls", "http://127.0.0.1:2381"),
        ("unsafe-no-fsync", "true"),
        ("log-level", "warn"),
    ])
}

fn apiserver_args(topo: &Topology, pki: &Pki) -> Vec<String> {
    let cp = &topo.control_plane;
    let path = |p: PathBuf| p.display().to_string();
    let services = service_cidrs(topo).join(",");
    args(&[
        ("etcd-servers", ETCD_CLIENT),
        ("bind-address", "0.0.0.0"),
        ("advertise-address", &cp.ip.to_string()),
        ("secure-port", &super::topology::API_PORT.to_string()),
        ("tls-cert-file", &path(pki.apiserver_cert())),
        ("tls-private-key-file", &path(pki.apiserver_key())),
        ("client-ca-file", &path(pki.ca_cert())),
        ("token-auth-file", &path(pki.tokens())),
        ("authorization-mode", "RBAC"),
        (
            "service-account-issuer",
            "https://kubernetes.default.svc.cluster.local",
        ),
        ("service-account-key-file", &path(pki.sa_pub())),
        ("service-account-signing-key-file", &path(pki.sa_key())),
        ("service-cluster-ip-range", &services),
        // No kube-proxy: the kubernetes Service needs no endpoints.
        ("endpoint-reconciler-type", "none"),
        // pods/log goes to the kubelet stand-in on the node's InternalIP
        // (the Hostname address names no host), with a client certificate
        // it requires, and a serving certificate it verifies.
        ("kubelet-preferred-address-types", "InternalIP"),
        (
            "kubelet-client-certificate",
            &path(pki.kubelet_client_cert()),
        ),
        ("kubelet-client-key", &path(pki.kubelet_client_key())),
        ("kubelet-certificate-authority", &path(pki.ca_cert())),
        ("allow-privileged", "true"),
        ("profiling", "false"),
    ])
}

/// The service ranges: IPv4's, and IPv6's in a dual-stack lab.
pub fn service_cidrs(topo: &Topology) -> Vec<&'static str> {
    let mut cidrs = vec![SERVICE_CIDR];
    if topo.dual_stack() {
        cidrs.push(SERVICE6_CIDR);
    }
    cidrs
}

/// The controllers a lab cluster needs (names as in v1.34's
/// `cmd/kube-controller-manager/names`): cascading deletes and namespace
/// deletion; DaemonSets, Deployments and their ReplicaSets, so Kubernetes
/// itself makes the Pods a chart asks for; and what gives Pods their
/// ServiceAccount token volume: the `default` ServiceAccount of every
/// namespace and the `kube-root-ca.crt` ConfigMap (the lab's CA). No HTTPS
/// endpoint (nothing scrapes it).
pub const CONTROLLERS: [&str; 7] = [
    "garbage-collector-controller",
    "namespace-controller",
    "daemonset-controller",
    "deployment-controller",
    "replicaset-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
];

fn controller_manager_args(kubeconfig: &Path, ca: &Path) -> Vec<String> {
    args(&[
        ("kubeconfig", &kubeconfig.display().to_string()),
        ("controllers", &CONTROLLERS.join(",")),
        ("root-ca-file", &ca.display().to_string()),
        ("secure-port", "0"),
        ("leader-elect", "false"),
        ("profiling", "false"),
    ])
}

/// The default scheduler, as `system:kube-scheduler`; one instance, so no
/// leader election; no HTTPS endpoint.
fn scheduler_args(kubeconfig: &Path) -> Vec<String> {
    args(&[
        ("kubeconfig", &kubeconfig.display().to_string()),
        ("secure-port", "0"),
        ("leader-elect", "false"),
        ("profiling", "false"),
    ])
}

/// Polls `/readyz` until it answers `ok`, failing early if a process exits.
fn wait_ready(kubectl: &Kubectl, started: &mut [Started]) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut last_error = String::new();
    while Instant::now() < deadline {
        for process in started.iter_mut() {
            process.check_running()?;
        }
        match kubectl.run(&["get", "--raw", "/readyz"]) {
            Ok(out) if out.trim() == "ok" => return Ok(()),
            Ok(out) => last_error = out,
            Err(e) => last_error = format!("{e:#}"),
        }
        thread::sleep(Duration::from_millis(250));
    }
    bail!("not ready after {}s: {last_error}", READY_TIMEOUT.as_secs())
}

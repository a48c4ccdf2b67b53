//! `cargo xtask lab selftest`: checks, on the running lab, that Pods are made,
//! placed and run as in a cluster: a DaemonSet and a 2-replica Deployment
//! applied with kubectl become Running and Ready through
//! kube-controller-manager, kube-scheduler and the kubelet stand-in; their
//! processes get exactly the identity, capabilities, environment, volumes and
//! ServiceAccount token their spec asks for; a failing liveness probe
//! restarts a container; a deleted Pod gets SIGTERM, goes, and is replaced;
//! a Pod with an unknown image stays Pending and says why; a kubectl in a Pod
//! authenticates as its ServiceAccount, bound to its Pod and node; `kubectl
//! logs` reads what a container printed through the API server and the
//! stand-in's kubelet API (the current run, `--previous`, `-f` until the
//! container stops); nothing is left on the machine's filesystem.
//!
//! It works in a namespace of its own (`lab-selftest`), removed at the end
//! (unless `--keep`), and exits non-zero naming each check that failed.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::{Value, json};

use super::images::{Image, KnownImages};
use super::kubectl::Kubectl;
use super::kubelet::api::Api;
use super::kubelet::caps::CapSet;
use super::probe::in_netns;
use super::session::Lab;
use super::state::Paths;
use super::topology::Netns;

const NAMESPACE: &str = "lab-selftest";
const ACCOUNT: &str = "selftest";
const TESTPOD_IMAGE: &str = "lab.egressgw.io/testpod:selftest";
const KUBECTL_IMAGE: &str = "lab.egressgw.io/kubectl:selftest";
const UNKNOWN_IMAGE: &str = "lab.egressgw.io/not-registered:1";
/// The DaemonSet's port on each node's address (`hostNetwork`).
const AGENT_PORT: u16 = 18080;
/// The Deployment's port on each Pod's address.
const WEB_PORT: u16 = 8080;
const GREETING: &str = "hello from a ConfigMap";
/// A mountPath whose top-level directory the machine does not have.
const TOP_LEVEL: &str = "/lab-selftest-data";
/// mountPaths the selftest's Pods use that must not appear on the machine.
const MOUNT_PATHS: [&str; 4] = [
    "/run/secrets",
    "/etc/selftest",
    "/var/lib/testpod",
    TOP_LEVEL,
];

/// `lab selftest`.
#[derive(Debug, Clone, clap::Args)]
pub struct SelftestArgs {
    /// How long each wait may take, in seconds.
    #[arg(long, default_value_t = 90)]
    pub timeout: u64,
    /// Leave the namespace `lab-selftest` and its Pods for inspection.
    #[arg(long)]
    pub keep: bool,
}

#[derive(Deserialize)]
struct Items<T> {
    items: Vec<T>,
}

pub fn run(args: &SelftestArgs, paths: &Paths) -> anyhow::Result<()> {
    let lab = Lab::open(paths)?;
    let test = Selftest {
        lab: &lab,
        timeout: Duration::from_secs(args.timeout),
    };
    let host_had = MOUNT_PATHS.map(|p| Path::new(p).exists());
    println!(
        "lab selftest on the lab {} (namespace {NAMESPACE})",
        paths.prefix
    );
    test.setup()?;
    let mut failed = Vec::new();
    let mut check = |name: &str, result: anyhow::Result<String>| match result {
        Ok(detail) => println!("  ok    {name}: {detail}"),
        Err(e) => {
            println!("  FAIL  {name}: {e:#}");
            failed.push(name.to_owned());
        }
    };
    check(
        "a DaemonSet pod runs on every node",
        test.daemonset_everywhere(),
    );
    check(
        "a Deployment's 2 replicas become Ready",
        test.deployment_ready(),
    );
    check(
        "the DaemonSet pod runs as its spec says",
        test.agent_as_specified(),
    );
    check(
        "the Deployment pod runs as its spec says",
        test.web_as_specified(),
    );
    check(
        "kubectl logs reads a container's output through the API server",
        test.logs(),
    );
    check(
        "an unknown image stays Pending and says so",
        test.unknown_image_pending(),
    );
    check(
        "kubectl in a Pod is its ServiceAccount, bound to Pod and node",
        test.whoami(),
    );
    check(
        "a failing liveness probe restarts the container",
        test.liveness_restarts(),
    );
    check(
        "kubectl logs --previous reads the run before a restart",
        test.previous_logs(),
    );
    check(
        "a deleted Pod gets SIGTERM (kubectl logs -f shows it, then ends), goes, and is replaced",
        test.deletion_replaces(),
    );
    let left: Vec<&str> = MOUNT_PATHS
        .into_iter()
        .zip(host_had)
        .filter(|(p, had)| !had && Path::new(p).exists())
        .map(|(p, _)| p)
        .collect();
    check(
        "no mountPath was made on the machine",
        if left.is_empty() {
            Ok(format!("none of {} on the host", MOUNT_PATHS.join(", ")))
        } else {
            Err(anyhow::anyhow!("left on the host: {left:?}"))
        },
    );
    if args.keep {
        println!(
            "kept namespace {NAMESPACE}: `{}` removes it",
            lab.command("lab down")
        );
    } else {
        check(
            "removing the namespace stops and deletes every Pod",
            test.teardown(),
        );
    }
    ensure!(
        failed.is_empty(),
        "lab selftest: {} checks failed: {}",
        failed.len(),
        failed.join("; ")
    );
    println!("lab selftest: all checks passed");
    Ok(())
}

struct Selftest<'a> {
    lab: &'a Lab,
    timeout: Duration,
}

impl Selftest<'_> {
    fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.lab.kubectl.run(args)
    }

    /// Registers the images and applies the objects.
    fn setup(&self) -> anyhow::Result<()> {
        let paths = &self.lab.paths;
        let exe = std::env::current_exe().context("finding the xtask binary")?;
        let copy = paths.run().join("xtask-testpod");
        super::kubelet::copy_executable(&exe, &copy)?;
        let mut testpod = Image::of_binary(&copy, "/usr/local/bin/testpod");
        testpod.entrypoint = vec![
            copy.display().to_string(),
            "lab".to_owned(),
            "testpod".to_owned(),
        ];
        KnownImages::register(paths, TESTPOD_IMAGE, testpod)?;
        let kubectl = self.lab.state.bin_dir.join("kubectl");
        KnownImages::register(
            paths,
            KUBECTL_IMAGE,
            Image::of_binary(&kubectl, "/usr/local/bin/kubectl"),
        )?;
        let objects = json!({ "apiVersion": "v1", "kind": "List", "items": objects() });
        self.lab
            .kubectl
            .run_with_input(&["apply", "-f", "-"], Some(&objects.to_string()))
            .context("applying the selftest's objects")?;
        Ok(())
    }

    fn pods(&self, selector: &str) -> anyhow::Result<Vec<Pod>> {
        let out = self.kubectl(&["get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json"])?;
        Ok(serde_json::from_str::<Items<Pod>>(&out)?.items)
    }

    fn pod(&self, name: &str) -> anyhow::Result<Option<Pod>> {
        Api::new(self.lab.kubectl.clone()).optional("pod", NAMESPACE, name)
    }

    /// Polls `f` until it returns `Some`, or fails with what it last said.
    fn wait_for<T>(
        &self,
        what: &str,
        mut f: impl FnMut() -> anyhow::Result<Option<T>>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + self.timeout;
        let mut last = String::from("nothing yet");
        loop {
            match f() {
                Ok(Some(found)) => return Ok(found),
                Ok(None) => {}
                Err(e) => last = format!("{e:#}"),
            }
            if Instant::now() >= deadline {
                bail!(
                    "{what}: not after {}s (last: {last})",
                    self.timeout.as_secs()
                );
            }
            thread::sleep(Duration::from_millis(500));
        }
    }

    fn ready_pods(&self, selector: &str, count: usize) -> anyhow::Result<Vec<Pod>> {
        self.wait_for(&format!("{count} Ready pods {selector}"), || {
            let pods = self.pods(selector)?;
            let ready: Vec<Pod> = pods
                .into_iter()
                .filter(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
                .collect();
            if ready.len() == count {
                return Ok(Some(ready));
            }
            bail!("{} of {count} ready", ready.len())
        })
    }

    fn daemonset_everywhere(&self) -> anyhow::Result<String> {
        let nodes = self.lab.state.topology.nodes.len();
        let pods = self.ready_pods("app=testpod-agent", nodes)?;
        let mut on: Vec<String> = pods.iter().map(|p| node_of(p).to_owned()).collect();
        on.sort();
        on.dedup();
        ensure!(
            on.len() == nodes,
            "pods on {on:?}, not one on each of {nodes} nodes"
        );
        Ok(format!("Running and Ready on {}", on.join(", ")))
    }

    fn deployment_ready(&self) -> anyhow::Result<String> {
        let pods = self.ready_pods("app=testpod-web", 2)?;
        let ips: Vec<String> = pods.iter().map(|p| pod_ip(p).to_owned()).collect();
        Ok(format!("Ready at {}", ips.join(" and ")))
    }

    fn info(&self, netns: &Netns, addr: SocketAddr) -> anyhow::Result<Value> {
        let (code, body) = http_get(netns, addr, "/info")?;
        ensure!(code == 200, "GET /info on {addr}: {code}");
        serde_json::from_str(&body).context("parsing /info")
    }

    fn agent_as_specified(&self) -> anyhow::Result<String> {
        let pod = self
            .ready_pods("app=testpod-agent", self.lab.state.topology.nodes.len())?
            .remove(0);
        let node = self.lab.node(node_of(&pod))?.clone();
        let addr = SocketAddr::from((node.ip, AGENT_PORT));
        let info = self.info(&self.lab.state.topology.control_plane.netns, addr)?;
        let name = pod.metadata.name.clone().unwrap_or_default();
        let caps = CapSet::from_mask(u64::from_str_radix(
            info["cap_eff"].as_str().unwrap_or(""),
            16,
        )?);
        let wanted = ["NET_ADMIN", "NET_RAW"];
        ensure!(
            caps.names().eq(wanted),
            "effective capabilities {:?}, wanted {wanted:?}",
            caps.names().collect::<Vec<_>>()
        );
        ensure!(
            info["cap_bnd"] == info["cap_eff"],
            "bounding set {} is not the effective {}",
            info["cap_bnd"],
            info["cap_eff"]
        );
        ensure!(
            info["cap_amb"] == "0000000000000000" && info["cap_inh"] == "0000000000000000",
            "inheritable or ambient capabilities: {info}"
        );
        ensure!(
            info["no_new_privs"] == "1",
            "no_new_privs is {}",
            info["no_new_privs"]
        );
        ensure!(
            info["started_with_blocked_signals"] == "0000000000000000",
            "the program started with signals blocked: {} (SIGTERM would never reach it)",
            info["started_with_blocked_signals"]
        );
        ensure!(
            info["root_read_only"] == true,
            "the root filesystem is writable"
        );
        ensure!(
            info["writable"]["/tmp"] == false,
            "/tmp is writable under readOnlyRootFilesystem"
        );
        ensure!(info["uid"] == "0", "uid {}", info["uid"]);
        ensure!(
            info["hostname"] == node.name.as_str(),
            "hostname {} on a hostNetwork pod of {}",
            info["hostname"],
            node.name
        );
        let env = &info["env"];
        for (k, v) in [
            ("POD_NAME", name.as_str()),
            ("NODE_NAME", node.name.as_str()),
            ("POD_IP", &node.ip.to_string()),
            ("POD_NAMESPACE", NAMESPACE),
            ("SERVICE_ACCOUNT", ACCOUNT),
            (
                "KUBERNETES_SERVICE_HOST",
                &self.lab.state.topology.control_plane.ip.to_string(),
            ),
            ("KUBERNETES_SERVICE_PORT", "6443"),
            ("POD_UID", pod.metadata.uid.as_deref().unwrap_or_default()),
        ] {
            ensure!(env[k] == v, "env {k}={}, wanted {v}", env[k]);
        }
        ensure!(
            env["CPU_MILLIS"]
                .as_str()
                .is_some_and(|v| v.parse::<u32>().is_ok_and(|n| n >= 1000)),
            "CPU_MILLIS={}",
            env["CPU_MILLIS"]
        );
        let files = &info["files"];
        ensure!(
            files["/etc/selftest/greeting"] == GREETING,
            "the ConfigMap volume holds {}",
            files["/etc/selftest/greeting"]
        );
        ensure!(
            files["/var/run/secrets/kubernetes.io/serviceaccount/namespace"] == NAMESPACE,
            "the token volume's namespace file holds {}",
            files["/var/run/secrets/kubernetes.io/serviceaccount/namespace"]
        );
        ensure!(
            files["/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"]
                .as_str()
                .is_some_and(|c| c.contains("BEGIN CERTIFICATE")),
            "no CA in the token volume"
        );
        let claims = &info["token_claims"];
        let sub = format!("system:serviceaccount:{NAMESPACE}:{ACCOUNT}");
        ensure!(
            claims["sub"] == sub.as_str(),
            "token subject {}, wanted {sub}",
            claims["sub"]
        );
        let k8s = &claims["kubernetes.io"];
        ensure!(
            k8s["pod"]["name"] == name.as_str(),
            "token bound to pod {}, not {name}",
            k8s["pod"]["name"]
        );
        ensure!(
            k8s["node"]["name"] == node.name.as_str(),
            "token bound to node {}, not {}",
            k8s["node"]["name"],
            node.name
        );
        Ok(format!(
            "{name} on {}: uid 0, capabilities {wanted:?} only (bounding too), no_new_privs, read-only root, downward-API env, ConfigMap and token volumes, token bound to pod and node",
            node.name
        ))
    }

    fn web_as_specified(&self) -> anyhow::Result<String> {
        let pod = self.ready_pods("app=testpod-web", 2)?.remove(0);
        let ip: std::net::Ipv4Addr = pod_ip(&pod).parse().context("the pod's IP")?;
        ensure!(
            ip.octets()[3] >= super::topology::LAB_POD_HOSTS_END,
            "pod IP {ip} is not in the stand-in's range"
        );
        let info = self.info(
            &self.lab.state.topology.control_plane.netns,
            SocketAddr::from((ip, WEB_PORT)),
        )?;
        ensure!(
            info["uid"] == "65534" && info["gid"] == "65534",
            "uid {} gid {}",
            info["uid"],
            info["gid"]
        );
        ensure!(
            info["groups"]
                .as_str()
                .is_some_and(|g| g.split_whitespace().any(|x| x == "2000")),
            "groups {} lack the fsGroup",
            info["groups"]
        );
        ensure!(
            info["cap_eff"] == "0000000000000000",
            "a non-root process has capabilities {}",
            info["cap_eff"]
        );
        ensure!(
            info["root_read_only"] == false,
            "the root filesystem is read-only"
        );
        let name = pod.metadata.name.clone().unwrap_or_default();
        ensure!(
            info["hostname"] == name.as_str(),
            "hostname {}",
            info["hostname"]
        );
        ensure!(
            info["env"]["POD_IP"] == ip.to_string().as_str(),
            "env POD_IP={}",
            info["env"]["POD_IP"]
        );
        ensure!(
            info["writable"]["/var/lib/testpod"] == true,
            "the emptyDir is not writable by uid 65534"
        );
        ensure!(
            info["writable"][TOP_LEVEL] == true,
            "the emptyDir at {TOP_LEVEL} is not writable"
        );
        Ok(format!(
            "{name} at {ip} in its own network namespace: uid/gid 65534, fsGroup 2000, no capabilities, hostname = pod name, emptyDirs at /var/lib/testpod and {TOP_LEVEL}"
        ))
    }

    /// `kubectl logs` of the DaemonSet's container is exactly what it printed
    /// since it started (its log file after the last start), `--tail` and
    /// `--limit-bytes` cut it; a container the Pod lacks and `--previous`
    /// of a container that never restarted fail, saying so.
    fn logs(&self) -> anyhow::Result<String> {
        let nodes = self.lab.state.topology.nodes.len();
        let pod = self.ready_pods("app=testpod-agent", nodes)?.remove(0);
        let name = pod.metadata.name.clone().unwrap_or_default();
        let printed = current_run(&self.log_of(&pod, "agent"), "agent");
        ensure!(
            printed.contains("testpod: listening on"),
            "its log file holds no output of the current run: {printed:?}"
        );
        let logs = |extra: &[&str]| {
            let mut args = vec!["logs", "-n", NAMESPACE, &name, "-c", "agent"];
            args.extend_from_slice(extra);
            self.kubectl(&args)
        };
        let got = logs(&[])?;
        ensure!(
            got == printed,
            "kubectl logs printed {got:?}, the container {printed:?}"
        );
        let last = printed.lines().last().unwrap_or_default();
        let tail = logs(&["--tail=1"])?;
        ensure!(
            tail.trim_end() == last,
            "--tail=1 printed {tail:?}, not the last line {last:?}"
        );
        let limited = logs(&["--limit-bytes=7"])?;
        ensure!(
            printed.as_bytes().get(..7) == Some(limited.as_bytes()),
            "--limit-bytes=7 printed {limited:?}"
        );
        let wrong = self.failure(&["logs", "-n", NAMESPACE, &name, "-c", "nope"])?;
        let wanted = format!("container nope is not valid for pod {name}");
        ensure!(
            wrong.contains(&wanted),
            "kubectl logs -c nope said {wrong:?}, not {wanted:?}"
        );
        let previous =
            self.failure(&["logs", "-n", NAMESPACE, &name, "-c", "agent", "--previous"])?;
        let wanted = format!("previous terminated container \"agent\" in pod \"{name}\" not found");
        ensure!(
            previous.contains(&wanted),
            "kubectl logs --previous said {previous:?}, not {wanted:?}"
        );
        Ok(format!(
            "{name}: {} bytes as printed, --tail=1 and --limit-bytes=7 cut them; -c nope: {wrong:?}; --previous: {previous:?}",
            got.len()
        ))
    }

    /// Runs kubectl expecting it to fail; what it said.
    fn failure(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.lab.kubectl.output(args, None)?;
        ensure!(
            !out.status.success(),
            "kubectl {} succeeded: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout)
        );
        Ok(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }

    /// `kubectl logs --previous` of the container the liveness probe
    /// restarted is the run that broke; the current run starts afresh.
    fn previous_logs(&self) -> anyhow::Result<String> {
        let restarted = self
            .pods("app=testpod-web")?
            .into_iter()
            .find(|p| restart_count(p) >= 1)
            .context("no web Pod has restarted")?;
        let name = restarted.metadata.name.clone().unwrap_or_default();
        let logs = |extra: &[&str]| {
            let mut args = vec!["logs", "-n", NAMESPACE, &name, "-c", "web"];
            args.extend_from_slice(extra);
            self.kubectl(&args)
        };
        let broke = "testpod: /healthz fails from now on";
        let previous = logs(&["--previous"])?;
        ensure!(
            previous.contains(broke),
            "--previous printed {previous:?}, without {broke:?}"
        );
        let current = logs(&[])?;
        ensure!(
            current.contains("testpod: listening on") && !current.contains(broke),
            "the current run printed {current:?}"
        );
        Ok(format!(
            "{name} (restartCount {}): --previous shows {broke:?}, the current run does not",
            restart_count(&restarted)
        ))
    }

    fn unknown_image_pending(&self) -> anyhow::Result<String> {
        self.wait_for("the unknown image's Pod to say why it waits", || {
            let Some(pod) = self.pod("unknown-image")? else {
                bail!("the pod is missing");
            };
            let status = pod.status.clone().unwrap_or_default();
            let waiting = status
                .container_statuses
                .iter()
                .flatten()
                .find_map(|c| c.state.as_ref()?.waiting.clone());
            let phase = status.phase.unwrap_or_default();
            match waiting {
                Some(w)
                    if w.reason.as_deref() == Some("ErrImageNeverPull") && phase == "Pending" =>
                {
                    let message = w.message.unwrap_or_default();
                    ensure!(
                        message.contains(UNKNOWN_IMAGE),
                        "the message does not name the image: {message}"
                    );
                    Ok(Some(format!("Pending, ErrImageNeverPull: {message}")))
                }
                other => bail!("phase {phase}, waiting {other:?}"),
            }
        })
    }

    fn whoami(&self) -> anyhow::Result<String> {
        let pod = self.wait_for("the whoami Pod to succeed", || {
            let pod = self.pod("whoami")?.context("the pod is missing")?;
            let phase = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            match phase.as_str() {
                "Succeeded" => Ok(Some(pod)),
                "Failed" => Err(anyhow::anyhow!(
                    "the pod failed: {}",
                    self.log_of(&pod, "kubectl")
                )),
                _ => bail!("phase {phase}"),
            }
        })?;
        let log = self.log_of(&pod, "kubectl");
        let start = log.find('{').context("no JSON in the log")?;
        let review: Value =
            serde_json::from_str(&log[start..]).with_context(|| format!("parsing {log}"))?;
        let user = &review["status"]["userInfo"];
        let wanted = format!("system:serviceaccount:{NAMESPACE}:{ACCOUNT}");
        ensure!(
            user["username"] == wanted.as_str(),
            "kubectl authenticated as {}",
            user["username"]
        );
        let node = node_of(&pod);
        let extra = &user["extra"]["authentication.kubernetes.io/node-name"][0];
        ensure!(extra == node, "node-name claim {extra}, not {node}");
        let pod_name = &user["extra"]["authentication.kubernetes.io/pod-name"][0];
        ensure!(pod_name == "whoami", "pod-name claim {pod_name}");
        Ok(format!(
            "{wanted} with node-name {node} and pod-name whoami"
        ))
    }

    fn liveness_restarts(&self) -> anyhow::Result<String> {
        let pod = self.ready_pods("app=testpod-web", 2)?.remove(0);
        let name = pod.metadata.name.clone().unwrap_or_default();
        let ip: std::net::Ipv4Addr = pod_ip(&pod).parse()?;
        let cp = &self.lab.state.topology.control_plane.netns;
        http_get(cp, SocketAddr::from((ip, WEB_PORT)), "/break")?;
        self.wait_for(&format!("{name} to restart and be Ready again"), || {
            let pod = self.pod(&name)?.context("the pod is gone")?;
            let restarts = restart_count(&pod);
            ensure!(restarts >= 1, "restartCount {restarts}");
            Ok(is_ready(&pod).then(|| format!("{name}: restartCount {restarts}, Ready again")))
        })
    }

    fn deletion_replaces(&self) -> anyhow::Result<String> {
        let before = self.ready_pods("app=testpod-web", 2)?;
        let victim = before[0].clone();
        let name = victim.metadata.name.clone().unwrap_or_default();
        let netns = super::kubelet::pod_netns(&self.lab.state.topology.prefix, NAMESPACE, &name);
        let follow_args = ["logs", "-f", "-n", NAMESPACE, &name, "-c", "web"];
        let mut follow = Follow::start(&self.lab.kubectl, &follow_args)?;
        follow.wait_for("testpod: listening on", self.timeout)?;
        self.kubectl(&["delete", "pod", &name, "-n", NAMESPACE, "--wait=false"])?;
        self.wait_for(&format!("{name} to be gone from the API"), || {
            Ok(self.pod(&name)?.is_none().then_some(()))
        })?;
        let log = self.log_of(&victim, "web");
        ensure!(
            log.contains("testpod: SIGTERM received"),
            "its log does not show SIGTERM:\n{log}"
        );
        let followed = follow.wait_end(Duration::from_secs(15))?;
        ensure!(
            followed.contains("testpod: SIGTERM received"),
            "kubectl logs -f printed {followed:?}, not the SIGTERM"
        );
        ensure!(
            !super::net::netns_exists(&netns),
            "its network namespace {netns} is still there"
        );
        let after = self.ready_pods("app=testpod-web", 2)?;
        let names: Vec<String> = after
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        ensure!(!names.contains(&name), "{name} is still listed");
        Ok(format!(
            "{name} stopped by SIGTERM (kubectl logs -f showed it and ended), deleted, its netns removed; now {}",
            names.join(", ")
        ))
    }

    fn teardown(&self) -> anyhow::Result<String> {
        self.kubectl(&["delete", "namespace", NAMESPACE, "--wait=false"])?;
        self.wait_for("the namespace to be gone", || {
            let out = self.kubectl(&[
                "get",
                "namespace",
                NAMESPACE,
                "--ignore-not-found",
                "-o",
                "name",
            ])?;
            Ok(out.trim().is_empty().then_some(()))
        })?;
        let paths = &self.lab.paths;
        for image in [TESTPOD_IMAGE, KUBECTL_IMAGE] {
            KnownImages::unregister(paths, image)?;
        }
        let left = super::kubelet::records(paths);
        let ours: Vec<String> = left
            .iter()
            .filter(|r| r.namespace == NAMESPACE)
            .map(|r| r.name.clone())
            .collect();
        ensure!(ours.is_empty(), "the stand-in still runs {ours:?}");
        Ok("namespace gone, no selftest Pod left in the stand-in".to_owned())
    }

    /// A container's log, as the stand-in writes it.
    fn log_of(&self, pod: &Pod, container: &str) -> String {
        let m = &pod.metadata;
        let dir = format!(
            "{}_{}_{}",
            m.namespace.as_deref().unwrap_or_default(),
            m.name.as_deref().unwrap_or_default(),
            m.uid.as_deref().unwrap_or_default()
        );
        let path: PathBuf = self
            .lab
            .paths
            .logs()
            .join("pods")
            .join(dir)
            .join(format!("{container}.log"));
        fs::read_to_string(&path).unwrap_or_else(|e| format!("<{}: {e}>", path.display()))
    }
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn restart_count(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| {
            s.container_statuses
                .as_ref()?
                .first()
                .map(|c| c.restart_count)
        })
        .unwrap_or(0)
}

/// What a container printed since it last started: its log file after the
/// last start marker.
fn current_run(log: &str, container: &str) -> String {
    super::kubelet::logs::runs(log.as_bytes(), container)
        .last()
        .map(|run| log[run.clone()].to_owned())
        .unwrap_or_default()
}

/// A `kubectl logs -f` running, its output read line by line by a thread;
/// killed when dropped.
struct Follow {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Follow {
    fn start(kubectl: &Kubectl, args: &[&str]) -> anyhow::Result<Self> {
        let mut child = kubectl.spawn(args)?;
        let stdout = child.stdout.take().context("kubectl's output")?;
        let (sender, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            lines,
            seen: Vec::new(),
        })
    }

    /// Waits until it printed a line holding `text`.
    fn wait_for(&mut self, text: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.seen.iter().any(|l| l.contains(text)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => bail!(
                    "kubectl logs -f printed no {text:?} (it printed {:?})",
                    self.seen
                ),
            }
        }
        Ok(())
    }

    /// Waits for it to end by itself, successfully, within `timeout`;
    /// everything it printed.
    fn wait_end(mut self, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => bail!(
                    "kubectl logs -f did not end within {}s of the container's end (it printed {:?})",
                    timeout.as_secs(),
                    self.seen
                ),
            }
        }
        let status = self.child.wait().context("waiting for kubectl logs -f")?;
        ensure!(status.success(), "kubectl logs -f ended with {status}");
        Ok(self.seen.join("\n"))
    }
}

impl Drop for Follow {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn node_of(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default()
}

fn pod_ip(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .unwrap_or_default()
}

/// `GET path` on `addr` from `netns`: status code and body.
fn http_get(netns: &Netns, addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    in_netns(netns, || {
        let timeout = Duration::from_secs(2);
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no status line")?;
        Ok((code, body.to_owned()))
    })
}

/// The selftest's objects: its namespace, ServiceAccount, ConfigMap, a
/// DaemonSet and a Deployment of the test program, a Pod of an unknown
/// image, and a Pod running `kubectl auth whoami`.
fn objects() -> Vec<Value> {
    let field = |name: &str, path: &str| json!({ "name": name, "valueFrom": { "fieldRef": { "fieldPath": path } } });
    let probe = |port: Value| json!({ "httpGet": { "path": "/healthz", "port": port }, "periodSeconds": 1, "failureThreshold": 2 });
    let meta = |name: &str| json!({ "name": name, "namespace": NAMESPACE });
    vec![
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NAMESPACE } }),
        json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(ACCOUNT) }),
        json!({ "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("selftest-config"), "data": { "greeting": GREETING } }),
        json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta("testpod-agent"),
            "spec": {
                "selector": { "matchLabels": { "app": "testpod-agent" } },
                "template": {
                    "metadata": { "labels": { "app": "testpod-agent" } },
                    "spec": {
                        "serviceAccountName": ACCOUNT,
                        "hostNetwork": true,
                        "terminationGracePeriodSeconds": 5,
                        "tolerations": [{ "operator": "Exists" }],
                        "containers": [{
                            "name": "agent",
                            "image": TESTPOD_IMAGE,
                            "args": [
                                "--listen", format!("$(POD_IP):{AGENT_PORT}"),
                                "--show", "/etc/selftest/greeting",
                                "--show", "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
                                "--show", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                                "--write", "/tmp",
                            ],
                            "env": [
                                field("POD_NAME", "metadata.name"),
                                field("POD_NAMESPACE", "metadata.namespace"),
                                field("POD_UID", "metadata.uid"),
                                field("NODE_NAME", "spec.nodeName"),
                                field("SERVICE_ACCOUNT", "spec.serviceAccountName"),
                                field("POD_IP", "status.podIP"),
                                { "name": "CPU_MILLIS", "valueFrom": { "resourceFieldRef": { "resource": "limits.cpu", "divisor": "1m" } } },
                            ],
                            "securityContext": {
                                "capabilities": { "drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"] },
                                "readOnlyRootFilesystem": true,
                                "allowPrivilegeEscalation": false,
                            },
                            "volumeMounts": [{ "name": "config", "mountPath": "/etc/selftest" }],
                            "readinessProbe": probe(json!(AGENT_PORT)),
                            "livenessProbe": probe(json!(AGENT_PORT)),
                        }],
                        "volumes": [{ "name": "config", "configMap": {
                            "name": "selftest-config",
                            "items": [{ "key": "greeting", "path": "greeting", "mode": 0o440 }],
                        } }],
                    },
                },
            },
        }),
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta("testpod-web"),
            "spec": {
                "replicas": 2,
                "selector": { "matchLabels": { "app": "testpod-web" } },
                "template": {
                    "metadata": { "labels": { "app": "testpod-web" } },
                    "spec": {
                        "serviceAccountName": ACCOUNT,
                        "terminationGracePeriodSeconds": 10,
                        "securityContext": { "runAsUser": 65534, "runAsGroup": 65534, "fsGroup": 2000 },
                        "containers": [{
                            "name": "web",
                            "image": TESTPOD_IMAGE,
                            "args": [
                                "--listen", format!("0.0.0.0:{WEB_PORT}"),
                                "--write", "/var/lib/testpod",
                                "--write", TOP_LEVEL,
                            ],
                            "env": [field("POD_IP", "status.podIP")],
                            "ports": [{ "name": "http", "containerPort": WEB_PORT }],
                            "readinessProbe": probe(json!("http")),
                            "livenessProbe": probe(json!("http")),
                            "volumeMounts": [
                                { "name": "scratch", "mountPath": "/var/lib/testpod" },
                                { "name": "top", "mountPath": TOP_LEVEL },
                            ],
                        }],
                        "volumes": [{ "name": "scratch", "emptyDir": {} }, { "name": "top", "emptyDir": {} }],
                    },
                },
            },
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": meta("unknown-image"),
            "spec": { "containers": [{ "name": "app", "image": UNKNOWN_IMAGE }] },
        }),
        json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": meta("whoami"),
            "spec": {
                "serviceAccountName": ACCOUNT,
                "restartPolicy": "Never",
                "securityContext": { "runAsUser": 65534, "runAsGroup": 65534 },
                "containers": [{
                    "name": "kubectl",
                    "image": KUBECTL_IMAGE,
                    "command": ["kubectl"],
                    "args": ["auth", "whoami", "-o", "json"],
                    "securityContext": { "readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false },
                }],
            },
        }),
    ]
}

//! The lab's kubelet stand-in: `cargo xtask lab kubelet`, started by
//! `lab up` (process `kubelet` in `lab.json`, log `logs/kubelet.log`),
//! stopped by `lab down`.
//!
//! It runs the Pods that Kubernetes binds to the lab's nodes (by the
//! scheduler, or `spec.nodeName`), as processes, for the images it knows
//! ([`crate::lab::images`]); see docs/lab.md for what it honours. It is
//! level-based: every round (a second) it takes the Pods bound to a node
//! from a store a watch keeps current ([`watch`]), compares them with what
//! runs, and acts (start, restart, probe, stop, report status); while the
//! API does not answer, what runs goes on.
//! It writes `kubelet/pods.json` (what it runs, with pids) for `lab status`,
//! and serves kubelet's container-log API on each node's address
//! ([`server`]), so `kubectl logs` works.
//!
//! The lab's own pods (the network namespaces `lab up` and `lab pod add`
//! make, image `egressgw-lab/netns:none`) are left alone.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::images::KnownImages;
use super::kubectl::Kubectl;
use super::process::{self, Started};
use super::state::{LabState, Paths};
use super::topology::{API_PORT, Node};

pub mod api;
pub mod caps;
mod container;
mod ctr;
mod env;
mod hold;
pub mod logs;
mod pod;
mod probes;
mod quantity;
mod record;
mod sandbox;
mod server;
pub mod shim;
mod status;
mod volumes;
mod watch;

/// Where `path` (relative to `/sys/fs/bpf`) is in the bpf filesystem of
/// lab node `node`.
pub fn node_bpf_path(paths: &Paths, node: &str, path: &str) -> PathBuf {
    volumes::node_bpf_path(&record::nodes_dir(paths).join(node).join("hostpath"), path)
}

pub use hold::{hold, release};
pub use pod::LAB_POD_IMAGE;
pub use probes::enter as enter_container;
pub use record::Record;
pub use sandbox::{is_pod_netns, netns_name as pod_netns};
pub use server::KUBELET_PORT;

/// The name of the stand-in's process in `lab.json` (and of its log).
pub const PROCESS: &str = "kubelet";
/// How often the stand-in looks at the API.
const ROUND: Duration = Duration::from_secs(1);

/// `<lab>/kubelet/pods.json`: the Pods the stand-in runs, for `lab status`.
pub fn records_path(paths: &Paths) -> PathBuf {
    paths.lab.join("kubelet").join("pods.json")
}

/// The Pods the stand-in runs now, as it last wrote them.
pub fn records(paths: &Paths) -> Vec<Record> {
    fs::read_to_string(records_path(paths))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// Starts the stand-in on the host (it makes network namespaces, so it
/// cannot live inside one): a copy of this program, so rebuilding the
/// workspace does not change it under the lab. Fails, with the end of its
/// log, if it does not stay up.
pub fn start(paths: &Paths) -> anyhow::Result<Started> {
    shim::check_tools()?;
    let exe = std::env::current_exe().context("finding the xtask binary")?;
    let copy = paths.run().join("xtask-kubelet");
    copy_executable(&exe, &copy)?;
    let args = ["lab", "kubelet"].map(String::from);
    let mut started = process::start_on_host(paths, PROCESS, &copy, &args)?;
    thread::sleep(Duration::from_millis(500));
    started.check_running()?;
    Ok(started)
}

/// Copies a program to `to`, replacing one that may be running there (a
/// new file renamed into place: writing into a running executable fails).
pub fn copy_executable(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    let tmp = to.with_extension("new");
    fs::copy(from, &tmp)
        .with_context(|| format!("copying {} to {}", from.display(), tmp.display()))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", tmp.display()))?;
    fs::rename(&tmp, to).with_context(|| format!("moving {} into place", to.display()))
}

/// Runs the stand-in until SIGTERM or SIGINT.
pub fn serve(paths: &Paths) -> anyhow::Result<()> {
    // Blocked here, read from a signalfd between rounds; threads started
    // later inherit the mask, and so do children (std does not reset it):
    // the container shim unblocks everything before the program runs.
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGTERM);
    stop.add(Signal::SIGINT);
    stop.thread_block().context("blocking SIGTERM")?;
    let signals =
        SignalFd::with_flags(&stop, SfdFlags::SFD_NONBLOCK).context("opening a signalfd")?;

    shim::check_tools()?;
    let state = LabState::require(paths)?;
    let cp = &state.topology.control_plane;
    let kubectl = watch::KubectlCommand {
        program: state.bin_dir.join("kubectl"),
        kubeconfig: paths.kubeconfig(),
        netns: cp.netns.clone(),
    };
    let api = api::Api::new(Kubectl::at(
        &kubectl.program,
        &kubectl.kubeconfig,
        &cp.netns,
    ));
    let nodes: BTreeMap<String, Node> = state
        .topology
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.clone()))
        .collect();
    let watch = watch::PodWatch::start(&api, &kubectl, nodes.keys().map(String::as_str));
    let shim = std::env::current_exe().context("finding this program")?;
    let logs = server::Shared::default();
    if let Err(e) = server::start(&paths.pki(), &state.topology.nodes, &logs) {
        pod::log(&format!(
            "the kubelet API is not served (no `kubectl logs`): {e:#}"
        ));
    }
    record::clean_up_after_previous(paths);
    fs::create_dir_all(record::pods_dir(paths)).context("creating the pods directory")?;
    let (cpu, memory) = machine();
    pod::log(&format!(
        "kubelet stand-in for nodes [{}]: images from {}, containers run by {} lab container-shim",
        nodes.keys().cloned().collect::<Vec<_>>().join(" "),
        KnownImages::path(paths).display(),
        shim.display()
    ));
    let mut run = Runner {
        workers: BTreeMap::new(),
        last_pods: Vec::new(),
        last_error: None,
    };
    let mut images = KnownImages::default();
    loop {
        if let Ok(Some(info)) = signals.read_signal() {
            pod::log(&format!(
                "signal {}: exiting (the containers keep running; `lab down` stops them)",
                info.ssi_signo
            ));
            return Ok(());
        }
        let started = Instant::now();
        run.load_images(paths, &mut images);
        let mut ctx = pod::Ctx {
            paths,
            prefix: &state.topology.prefix,
            api: &api,
            images: &images,
            nodes: &nodes,
            cpu,
            memory,
            api_host: cp.ip.to_string(),
            api_port: API_PORT,
            shim: shim.clone(),
            online: true,
        };
        run.round(&watch, &mut ctx);
        logs.publish(run.directory());
        run.write_records(paths);
        thread::sleep(ROUND.saturating_sub(started.elapsed()));
    }
}

/// The stand-in's state between rounds.
#[derive(Debug)]
struct Runner {
    /// By Pod uid.
    workers: BTreeMap<String, pod::PodWorker>,
    /// The Pods the API listed last.
    last_pods: Vec<k8s_openapi::api::core::v1::Pod>,
    /// The last error said, so a lasting one is said once.
    last_error: Option<String>,
}

impl Runner {
    fn say_once(&mut self, error: String) {
        if self.last_error.as_deref() != Some(error.as_str()) {
            pod::log(&error);
            self.last_error = Some(error);
        }
    }

    fn load_images(&mut self, paths: &Paths, images: &mut KnownImages) {
        match KnownImages::load(paths) {
            Ok(loaded) => *images = loaded,
            Err(e) => self.say_once(format!("keeping the images known before: {e:#}")),
        }
    }

    fn taken(&self) -> pod::Taken {
        let mut taken = pod::Taken::new();
        for w in self.workers.values() {
            if let Some(s) = w.sandbox.as_ref().filter(|s| s.owned) {
                taken.entry(w.node.clone()).or_default().push(s.ip);
            }
        }
        taken
    }

    fn round(&mut self, watch: &watch::PodWatch, ctx: &mut pod::Ctx<'_>) {
        match watch.snapshot() {
            Ok(pods) => {
                self.last_pods = pods;
                if self.last_error.take().is_some() {
                    pod::log("the API answers again");
                }
            }
            Err(e) => {
                ctx.online = false;
                self.say_once(format!(
                    "the Pods are not known now (the API may be restarting; the Pods seen last go on): {e:#}"
                ));
            }
        }
        let pods = std::mem::take(&mut self.last_pods);
        self.sync_all(&pods, ctx);
        self.last_pods = pods;
    }

    fn sync_all(&mut self, pods: &[k8s_openapi::api::core::v1::Pod], ctx: &pod::Ctx<'_>) {
        let ours: BTreeMap<String, &k8s_openapi::api::core::v1::Pod> = pods
            .iter()
            .filter(|p| {
                let node = p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .unwrap_or_default();
                ctx.nodes.contains_key(node) && !pod::is_lab_pod(p)
            })
            .filter_map(|p| Some((p.metadata.uid.clone()?, p)))
            .collect();
        for (uid, p) in &ours {
            if self.workers.contains_key(uid) || !ctx.online {
                continue;
            }
            let Some(key) = pod::PodKey::of(p) else {
                continue;
            };
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded" | "Failed")) {
                // Finished before this stand-in started: nothing runs; a
                // deletion only needs the final delete.
                if p.metadata.deletion_timestamp.is_some()
                    && let Err(e) = ctx.api.final_delete(&key.namespace, &key.name, &key.uid)
                {
                    pod::log(&format!("{key}: final delete failed: {e:#}"));
                }
                continue;
            }
            pod::log(&format!(
                "{key}: bound to {}, uid {uid}",
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default()
            ));
            self.workers
                .insert(uid.clone(), pod::PodWorker::new(key, p, ctx.paths));
        }
        let mut taken = self.taken();
        for (uid, worker) in &mut self.workers {
            worker.sync(ours.get(uid).copied(), ctx, &mut taken);
        }
        self.workers.retain(|_, w| !w.finished);
    }

    /// What the kubelet API serves after this round: the Pods it runs and
    /// the lab's own pods.
    fn directory(&self) -> logs::Directory {
        let mut directory = logs::Directory::default();
        for w in self.workers.values() {
            directory.add_pod(&w.key.namespace, &w.key.name, w.logs());
        }
        for p in self.last_pods.iter().filter(|p| pod::is_lab_pod(p)) {
            let (Some(namespace), Some(name), Some(spec)) =
                (&p.metadata.namespace, &p.metadata.name, &p.spec)
            else {
                continue;
            };
            let node = spec.node_name.as_deref().unwrap_or_default();
            let containers = spec.containers.iter().map(|c| c.name.clone()).collect();
            directory.add_lab_pod(namespace, name, node, containers);
        }
        directory
    }

    fn write_records(&self, paths: &Paths) {
        let records: Vec<Record> = self.workers.values().map(pod::PodWorker::record).collect();
        let path = records_path(paths);
        let Ok(text) = serde_json::to_string_pretty(&records) else {
            return;
        };
        if fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            let tmp = path.with_extension("json.new");
            if fs::write(&tmp, &text)
                .and_then(|()| fs::rename(&tmp, &path))
                .is_err()
            {
                pod::log(&format!("could not write {}", path.display()));
            }
        }
    }
}

/// The machine's cores and memory (bytes), which every lab node reports
/// as its capacity.
pub fn machine() -> (f64, f64) {
    let cpus = thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let kib: f64 = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(1_048_576.0);
    #[expect(clippy::cast_precision_loss, reason = "a core count fits an f64")]
    (cpus as f64, kib * 1024.0)
}

/// `lab container-shim SPEC`: runs one container (never returns on success).
pub fn container_shim(spec: &std::path::Path) -> ! {
    match shim::run(spec) {
        Ok(()) => shim::fail(&anyhow::anyhow!("the program returned without exec")),
        Err(e) => shim::fail(&e),
    }
}

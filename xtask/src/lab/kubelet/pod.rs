//! One Pod the stand-in runs: its sandbox, volumes and containers, what it
//! does each round (start, restart, probe, stop), and the status it reports.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, anyhow};
use k8s_openapi::api::core::v1::{Container, Pod};

use super::api::Api;
use super::container::{Input, VolumeSource, runtime_spec};
use super::ctr::{Ctr, FIRST_BACKOFF, Phase, Process};
use super::env::{Objects, PodFacts, kubernetes_service};
use super::logs::{self, ContainerLogs, PodLogs};
use super::probes::{Kind, Prober, Target};
use super::record::{ContainerRecord, Record, nodes_dir, pods_dir, start_ticks};
use super::sandbox::{self, Sandbox};
use super::status::{self, PodView};
use super::volumes::{self, Tokens};
use crate::lab::images::KnownImages;
use crate::lab::state::Paths;
use crate::lab::topology::{Node, Prefix};

/// kubelet's shortest grace period for stopping a container.
const MIN_GRACE: Duration = Duration::from_secs(2);
/// How often ConfigMaps and Secrets of a running Pod's volumes are read again.
const VOLUME_RESYNC: Duration = Duration::from_secs(60);
/// The image the lab's own pods name: network namespaces that `lab up` and
/// `lab pod add` manage, never run by the stand-in.
pub const LAB_POD_IMAGE: &str = "egressgw-lab/netns:none";

/// What every Pod worker shares in one round.
#[derive(Debug)]
pub struct Ctx<'a> {
    pub paths: &'a Paths,
    pub prefix: &'a Prefix,
    pub api: &'a Api,
    pub images: &'a KnownImages,
    pub nodes: &'a BTreeMap<String, Node>,
    /// The machine's cores and memory (bytes): every node's allocatable.
    pub cpu: f64,
    pub memory: f64,
    /// The API server as nodes reach it.
    pub api_host: String,
    pub api_port: u16,
    /// The program that runs containers (`lab container-shim`).
    pub shim: PathBuf,
    /// Whether the API answered this round. When it does not, running
    /// Pods go on (exits collected, restarts, probes) on the last Pods
    /// seen, and nothing is written to the API.
    pub online: bool,
}

/// Pod addresses in use, by node.
pub type Taken = BTreeMap<String, Vec<Ipv4Addr>>;

/// A Pod's identity.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl PodKey {
    pub fn of(pod: &Pod) -> Option<Self> {
        Some(Self {
            namespace: pod.metadata.namespace.clone()?,
            name: pod.metadata.name.clone()?,
            uid: pod.metadata.uid.clone()?,
        })
    }
}

/// Whether the stand-in leaves `pod` alone: a lab pod (a network namespace
/// managed by `lab up` / `lab pod add`), or a Pod on a node not the lab's.
pub fn is_lab_pod(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.containers
            .iter()
            .all(|c| c.image.as_deref() == Some(LAB_POD_IMAGE))
    })
}

/// The volumes as written, and when to refresh what.
#[derive(Debug)]
struct Volumes {
    sources: BTreeMap<String, VolumeSource>,
    tokens: Tokens,
    /// When each token is due for renewal (80 % of its lifetime).
    renew: BTreeMap<(String, usize), SystemTime>,
    payloads: BTreeMap<String, volumes::Payload>,
    objects: Objects,
    synced: Instant,
}

/// One Pod, as the stand-in runs it.
#[derive(Debug)]
pub struct PodWorker {
    pub key: PodKey,
    pub node: String,
    dir: PathBuf,
    log_dir: PathBuf,
    pub sandbox: Option<Sandbox>,
    volumes: Option<Volumes>,
    init: Vec<Ctr>,
    containers: Vec<Ctr>,
    start_time: Option<SystemTime>,
    terminating: bool,
    /// The last grace period the Pod asked for.
    grace: Duration,
    /// Why the Pod cannot start yet (sandbox, volumes), last said.
    blocked: Option<String>,
    /// Done: stopped, cleaned up and deleted from the API.
    pub finished: bool,
    /// The Pod finished and its own network namespace is gone.
    sandbox_released: bool,
    /// Held by [`super::hold`]: nothing starts.
    held: bool,
    restart_policy: String,
    phase: String,
}

impl PodWorker {
    pub fn new(key: PodKey, pod: &Pod, paths: &Paths) -> Self {
        let spec = pod.spec.clone().unwrap_or_default();
        let dir = pods_dir(paths).join(&key.uid);
        let log_dir = paths
            .logs()
            .join("pods")
            .join(format!("{}_{}_{}", key.namespace, key.name, key.uid));
        Self {
            node: spec.node_name.clone().unwrap_or_default(),
            dir,
            log_dir,
            sandbox: None,
            volumes: None,
            init: spec
                .init_containers
                .iter()
                .flatten()
                .map(Ctr::new)
                .collect(),
            containers: spec.containers.iter().map(Ctr::new).collect(),
            start_time: None,
            terminating: false,
            grace: grace_of(pod),
            blocked: None,
            finished: false,
            sandbox_released: false,
            held: false,
            restart_policy: spec
                .restart_policy
                .clone()
                .unwrap_or_else(|| "Always".to_owned()),
            phase: "Pending".to_owned(),
            key,
        }
    }

    /// The Pod's log file of `container`.
    pub fn log_path(&self, container: &str) -> PathBuf {
        self.log_dir.join(format!("{container}.log"))
    }

    /// One round: `pod` is the Pod as the API has it now (`None` once it is
    /// gone from the API).
    pub fn sync(&mut self, pod: Option<&Pod>, ctx: &Ctx<'_>, taken: &mut Taken) {
        self.reap();
        let Some(pod) = pod.filter(|p| p.metadata.deletion_timestamp.is_none()) else {
            if let Some(p) = pod {
                self.grace = grace_of(p);
            }
            self.terminate(pod.is_some(), ctx);
            return;
        };
        self.grace = grace_of(pod);
        let prepared = if ctx.online {
            self.prepare(pod, ctx, taken)
        } else {
            self.sandbox.is_some() && self.volumes.is_some() && self.blocked.is_none()
        };
        let held = super::hold::is_held(ctx.paths, &self.key.namespace, &self.key.name);
        if held != self.held {
            self.held = held;
            log(&format!(
                "{}: {}",
                self.key,
                if held {
                    "held: no container starts again until released"
                } else {
                    "released"
                }
            ));
            for c in self.init.iter_mut().chain(self.containers.iter_mut()) {
                c.next_start = Instant::now();
            }
        }
        if prepared && !self.sandbox_released {
            if !held {
                self.run_containers(pod, ctx);
            }
            self.probe();
        }
        if ctx.online {
            self.write_status(pod, ctx);
        }
        self.release_when_finished();
    }

    /// A Pod that has finished (Succeeded or Failed: nothing will run in it
    /// again) gives its network namespace and address back, as kubelet
    /// stops the sandbox of a finished Pod; its status keeps the address.
    fn release_when_finished(&mut self) {
        let finished = matches!(self.phase.as_str(), "Succeeded" | "Failed");
        let Some(sandbox) = self.sandbox.as_ref().filter(|s| s.owned) else {
            return;
        };
        if !finished || self.sandbox_released {
            return;
        }
        match sandbox::remove(sandbox) {
            Ok(()) => {
                log(&format!(
                    "{}: finished; removed its sandbox {}",
                    self.key, sandbox.netns
                ));
                self.sandbox_released = true;
            }
            Err(e) => log(&format!("{}: removing the sandbox: {e:#}", self.key)),
        }
    }

    /// Collects the containers that exited, and kills those whose grace
    /// period ran out.
    fn reap(&mut self) {
        let (terminating, policy) = (self.terminating, self.restart_policy.clone());
        let init = self.init.iter_mut().map(|c| (true, c));
        for (is_init, c) in init.chain(self.containers.iter_mut().map(|c| (false, c))) {
            c.collect(&self.key, terminating, &policy, is_init);
        }
    }

    /// Images known, sandbox made, volumes written: whether containers may run.
    fn prepare(&mut self, pod: &Pod, ctx: &Ctx<'_>, taken: &mut Taken) -> bool {
        let mut unknown = false;
        for c in self.init.iter_mut().chain(self.containers.iter_mut()) {
            if c.ever_started || ctx.images.get(&c.image).is_some() {
                continue;
            }
            unknown = true;
            let message = format!(
                "image {:?} is not known to the egressgw lab (it runs only the images in {})",
                c.image,
                KnownImages::path(ctx.paths).display()
            );
            if !matches!(&c.phase, Phase::Waiting { reason, .. } if reason == "ErrImageNeverPull") {
                log(&format!(
                    "{}: {}: {message}; the Pod stays Pending",
                    self.key, c.name
                ));
            }
            c.phase = Phase::Waiting {
                reason: "ErrImageNeverPull".to_owned(),
                message: Some(message),
            };
        }
        if unknown {
            return false;
        }
        let ready = self
            .ensure_sandbox(pod, ctx, taken)
            .and_then(|()| self.ensure_volumes(pod, ctx));
        match ready {
            Ok(()) => {
                self.blocked = None;
                true
            }
            Err(e) => {
                let why = format!("{e:#}");
                if self.blocked.as_deref() != Some(why.as_str()) {
                    log(&format!("{}: cannot start yet: {why}", self.key));
                }
                for c in self.init.iter_mut().chain(self.containers.iter_mut()) {
                    if !c.ever_started {
                        c.phase = Phase::Waiting {
                            reason: "ContainerCreating".to_owned(),
                            message: Some(why.clone()),
                        };
                    }
                }
                self.blocked = Some(why);
                false
            }
        }
    }

    fn ensure_sandbox(
        &mut self,
        pod: &Pod,
        ctx: &Ctx<'_>,
        taken: &mut Taken,
    ) -> anyhow::Result<()> {
        if self.sandbox.is_some() {
            return Ok(());
        }
        let node = ctx
            .nodes
            .get(&self.node)
            .with_context(|| format!("node {:?} is not a lab node", self.node))?;
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network) == Some(true);
        let k = &self.key;
        let made = sandbox::create(
            ctx.prefix,
            node,
            &k.namespace,
            &k.name,
            &k.uid,
            host_network,
            taken,
        )?;
        log(&format!(
            "{k}: sandbox on {}: netns {} ip {}",
            node.name, made.netns, made.ip
        ));
        if made.owned {
            taken.entry(node.name.clone()).or_default().push(made.ip);
        }
        self.sandbox = Some(made);
        self.start_time = Some(SystemTime::now());
        fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        fs::create_dir_all(&self.log_dir)
            .with_context(|| format!("creating {}", self.log_dir.display()))?;
        self.save_record();
        Ok(())
    }

    fn facts<'p>(&self, pod: &'p Pod, ctx: &Ctx<'_>) -> PodFacts<'p> {
        let host_ip = ctx
            .nodes
            .get(&self.node)
            .map(|n| n.ip.to_string())
            .unwrap_or_default();
        PodFacts {
            pod,
            host_ip,
            pod_ip: self
                .sandbox
                .as_ref()
                .map(|s| s.ip.to_string())
                .unwrap_or_default(),
            node_cpu: ctx.cpu,
            node_memory: ctx.memory,
        }
    }

    /// Writes the volumes the first time, then renews tokens when due and
    /// rereads ConfigMaps and Secrets every [`VOLUME_RESYNC`].
    fn ensure_volumes(&mut self, pod: &Pod, ctx: &Ctx<'_>) -> anyhow::Result<()> {
        let now = SystemTime::now();
        let due = match &self.volumes {
            None => true,
            Some(v) => v.synced.elapsed() >= VOLUME_RESYNC || v.renew.values().any(|t| *t <= now),
        };
        if !due {
            return Ok(());
        }
        let namespace = self.key.namespace.clone();
        let objects = fetch_objects(ctx.api, &namespace, pod)?;
        let (mut tokens, mut renew) = self
            .volumes
            .as_ref()
            .map(|v| (v.tokens.clone(), v.renew.clone()))
            .unwrap_or_default();
        let account = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".to_owned());
        for (volume, index, projection) in volumes::token_projections(pod) {
            let slot = (volume.clone(), index);
            if renew.get(&slot).is_some_and(|t| *t > now) {
                continue;
            }
            let seconds = projection.expiration_seconds.unwrap_or(3600);
            let token = ctx.api.request_token(
                &namespace,
                &account,
                projection.audience.as_deref().filter(|a| !a.is_empty()),
                seconds,
                &self.key.name,
                &self.key.uid,
            )?;
            let lifetime = token.expires.duration_since(now).unwrap_or_default();
            renew.insert(slot.clone(), now + lifetime.mul_f64(0.8));
            if tokens.insert(slot, token.token).is_some() {
                log(&format!(
                    "{}: renewed the token of volume {volume}",
                    self.key
                ));
            }
        }
        let facts = self.facts(pod, ctx);
        let mut sources = BTreeMap::new();
        let mut payloads = self
            .volumes
            .as_ref()
            .map(|v| v.payloads.clone())
            .unwrap_or_default();
        let node_root = nodes_dir(ctx.paths).join(&self.node).join("hostpath");
        for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            let dir = self.dir.join("volumes").join(&volume.name);
            let context = || format!("volume {:?}", volume.name);
            let source = match volumes::kind(volume) {
                volumes::Kind::Files => {
                    let files = volumes::payload(volume, &facts, &objects, &tokens)
                        .with_context(context)?;
                    if payloads.get(&volume.name) != Some(&files) {
                        let group = pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.security_context.as_ref())
                            .and_then(|c| c.fs_group);
                        let group = group.and_then(|g| u32::try_from(g).ok());
                        volumes::write_atomic(&dir, &files, group).with_context(context)?;
                        payloads.insert(volume.name.clone(), files);
                    }
                    VolumeSource {
                        path: dir,
                        read_only: true,
                    }
                }
                volumes::Kind::EmptyDir => {
                    volumes::empty_dir(&dir).with_context(context)?;
                    VolumeSource {
                        path: dir,
                        read_only: false,
                    }
                }
                volumes::Kind::HostPath(path, type_) => VolumeSource {
                    path: volumes::host_path(&node_root, &path, &type_).with_context(context)?,
                    read_only: false,
                },
                volumes::Kind::Unsupported(what) => {
                    return Err(anyhow!("{}: the lab does not support {what}", context()));
                }
            };
            sources.insert(volume.name.clone(), source);
        }
        self.volumes = Some(Volumes {
            sources,
            tokens,
            renew,
            payloads,
            objects,
            synced: Instant::now(),
        });
        Ok(())
    }

    /// Starts what is due: init containers one after the other, then the
    /// Pod's containers.
    fn run_containers(&mut self, pod: &Pod, ctx: &Ctx<'_>) {
        let spec = pod.spec.clone().unwrap_or_default();
        let init_specs: Vec<Container> = spec.init_containers.clone().unwrap_or_default();
        for (i, init) in init_specs.iter().enumerate().take(self.init.len()) {
            if self.init[i].succeeded() {
                continue;
            }
            if self.init[i].running().is_none() && self.due(&self.init[i]) {
                let started = self.start(pod, init, ctx, true, i);
                self.init[i] = started;
                self.save_record();
            }
            return;
        }
        let mut any = false;
        for i in 0..self.containers.len() {
            if self.containers[i].running().is_none() && self.due(&self.containers[i]) {
                let started = self.start(pod, &spec.containers[i], ctx, false, i);
                self.containers[i] = started;
                any = true;
            }
        }
        if any {
            self.save_record();
        }
    }

    /// Whether a container that is not running should start now.
    fn due(&self, c: &Ctr) -> bool {
        match &c.phase {
            Phase::Running(_) | Phase::Terminated(_) => false,
            Phase::Waiting { .. } => Instant::now() >= c.next_start,
        }
    }

    /// Starts container `c`; returns its new state (which says why, if it
    /// could not start).
    fn start(&mut self, pod: &Pod, c: &Container, ctx: &Ctx<'_>, init: bool, index: usize) -> Ctr {
        let list = if init {
            &mut self.init
        } else {
            &mut self.containers
        };
        let mut ctr = std::mem::replace(&mut list[index], Ctr::new(c));
        match self.spawn(pod, c, ctx, &mut ctr) {
            Ok(()) => {}
            Err((reason, e)) => {
                let message = format!("{e:#}");
                let same =
                    matches!(&ctr.phase, Phase::Waiting { message: Some(m), .. } if *m == message);
                if !same {
                    log(&format!("{}: {}: {reason}: {message}", self.key, c.name));
                }
                ctr.phase = Phase::Waiting {
                    reason: reason.to_owned(),
                    message: Some(message),
                };
                ctr.next_start = Instant::now() + FIRST_BACKOFF;
            }
        }
        ctr
    }

    fn spawn(
        &self,
        pod: &Pod,
        c: &Container,
        ctx: &Ctx<'_>,
        ctr: &mut Ctr,
    ) -> Result<(), (&'static str, anyhow::Error)> {
        let config_error = |e| ("CreateContainerConfigError", e);
        let image = ctx.images.get(&ctr.image).ok_or_else(|| {
            (
                "ErrImageNeverPull",
                anyhow!("image {:?} is no longer known", ctr.image),
            )
        })?;
        let (Some(sandbox), Some(volumes)) = (&self.sandbox, &self.volumes) else {
            return Err(("ContainerCreating", anyhow!("the sandbox is not ready")));
        };
        let facts = self.facts(pod, ctx);
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network) == Some(true);
        let hostname = if host_network {
            self.node.clone()
        } else {
            pod.spec
                .as_ref()
                .and_then(|s| s.hostname.clone())
                .unwrap_or_else(|| self.key.name.chars().take(63).collect())
        };
        let service_env = kubernetes_service(&ctx.api_host, ctx.api_port);
        let spec = runtime_spec(&Input {
            facts: &facts,
            objects: &volumes.objects,
            container: c,
            image,
            volumes: &volumes.sources,
            netns: sandbox.netns.as_str(),
            hostname: &hostname,
            service_env: &service_env,
        })
        .map_err(config_error)?;
        let mut spec = spec;
        let scratch = self.dir.join(format!("{}.root", c.name));
        fs::create_dir_all(&scratch).map_err(|e| config_error(e.into()))?;
        spec.scratch = Some(scratch);
        let spec_path = self.dir.join(format!("{}.json", c.name));
        let text = serde_json::to_string_pretty(&spec).map_err(|e| config_error(e.into()))?;
        fs::write(&spec_path, text).map_err(|e| config_error(e.into()))?;
        let log_path = self.log_path(&c.name);
        let mut out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| config_error(e.into()))?;
        // One write, so a reader following the file never sees half a marker.
        let _ = out.write_all(
            logs::marker(
                &c.name,
                ctr.restarts + u32::from(ctr.ever_started),
                &crate::lab::cluster::rfc3339(SystemTime::now()),
            )
            .as_bytes(),
        );
        let err = out.try_clone().map_err(|e| config_error(e.into()))?;
        let child = Command::new(&ctx.shim)
            .args(["lab", "container-shim"])
            .arg(&spec_path)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| {
                (
                    "StartError",
                    anyhow::Error::from(e).context("starting the container shim"),
                )
            })?;
        let pid = child.id();
        if ctr.ever_started {
            ctr.restarts += 1;
        }
        ctr.ever_started = true;
        ctr.image_id = format!("egressgw-lab://{}", spec.argv[0]);
        let since = Instant::now();
        let probe = |kind, p: &Option<k8s_openapi::api::core::v1::Probe>| {
            p.clone().map(|p| Prober::new(kind, p, since))
        };
        ctr.readiness = probe(Kind::Readiness, &c.readiness_probe);
        ctr.liveness = probe(Kind::Liveness, &c.liveness_probe);
        ctr.startup = probe(Kind::Startup, &c.startup_probe);
        ctr.exec_argv = [&c.readiness_probe, &c.liveness_probe, &c.startup_probe]
            .into_iter()
            .flatten()
            .find_map(|p| p.exec.as_ref()?.command.clone())
            .and_then(|command| image.argv(&command, &[]).ok());
        log(&format!(
            "{}: {}: started pid {pid} in {} ({})",
            self.key,
            c.name,
            sandbox.netns,
            spec.argv.join(" ")
        ));
        ctr.spec = Some(spec);
        ctr.phase = Phase::Running(Process {
            child,
            pid,
            started_at: SystemTime::now(),
            since,
            stopping: None,
            killed: false,
        });
        Ok(())
    }

    /// Runs the probes; a failed liveness or startup probe stops the
    /// container, which then restarts by its policy.
    fn probe(&mut self) {
        let Some(sandbox) = self.sandbox.clone() else {
            return;
        };
        let key = self.key.clone();
        let grace = self.grace;
        for c in &mut self.containers {
            let Some(p) = c.running() else {
                continue;
            };
            let target = Target {
                netns: sandbox.netns.clone(),
                ip: sandbox.ip,
                ports: c.ports.clone(),
                exec: c.spec.clone().map(|s| (p.pid, s)),
                exec_argv: c.exec_argv.clone(),
            };
            let now = Instant::now();
            let mut kill = None;
            if let Some(startup) = &mut c.startup
                && startup.result != Some(true)
            {
                if startup.tick(now, &target) == Some(false) {
                    kill = Some(("startup", startup.last_failure.clone()));
                }
            } else {
                for prober in [&mut c.readiness, &mut c.liveness].into_iter().flatten() {
                    match prober.tick(now, &target) {
                        Some(false) if prober.kind == Kind::Liveness => {
                            kill = Some(("liveness", prober.last_failure.clone()));
                        }
                        Some(ready) if prober.kind == Kind::Readiness => {
                            log(&format!(
                                "{key}: {}: readiness probe {}",
                                c.name,
                                if ready { "succeeded" } else { "failed" }
                            ));
                        }
                        _ => {}
                    }
                }
            }
            if let Some((which, why)) = kill
                && c.stop(grace)
            {
                log(&format!(
                    "{key}: {}: {which} probe failed ({}); SIGTERM, will be restarted",
                    c.name,
                    why.unwrap_or_default()
                ));
            }
        }
    }

    /// The Pod is being deleted (or is gone from the API): stop every
    /// container (SIGTERM, SIGKILL after the grace period), then remove the
    /// sandbox and the Pod's files, then delete the Pod for good.
    fn terminate(&mut self, in_api: bool, ctx: &Ctx<'_>) {
        if !self.terminating {
            self.terminating = true;
            let grace = self.grace;
            let mut stopped = Vec::new();
            for c in self.init.iter_mut().chain(self.containers.iter_mut()) {
                if c.stop(grace) {
                    stopped.push(c.name.clone());
                }
                if let Phase::Waiting { .. } = c.phase {
                    c.phase = Phase::Waiting {
                        reason: "Terminating".to_owned(),
                        message: None,
                    };
                }
            }
            log(&format!(
                "{}: deleted{}: SIGTERM to [{}], SIGKILL after {}s",
                self.key,
                if in_api { "" } else { " from the API" },
                stopped.join(" "),
                grace.as_secs()
            ));
        }
        let running = self
            .init
            .iter()
            .chain(&self.containers)
            .any(|c| c.running().is_some());
        if running {
            return;
        }
        if let Some(sandbox) = self.sandbox.as_ref().filter(|_| !self.sandbox_released)
            && let Err(e) = sandbox::remove(sandbox)
        {
            log(&format!("{}: removing the sandbox: {e:#}", self.key));
            return;
        }
        if self.dir.exists()
            && let Err(e) = fs::remove_dir_all(&self.dir)
        {
            log(&format!(
                "{}: removing {}: {e}",
                self.key,
                self.dir.display()
            ));
        }
        if in_api {
            if !ctx.online {
                return;
            }
            let k = &self.key;
            if let Err(e) = ctx.api.final_delete(&k.namespace, &k.name, &k.uid) {
                log(&format!(
                    "{k}: the final delete failed (tried again next round): {e:#}"
                ));
                return;
            }
        }
        log(&format!(
            "{}: stopped and cleaned up; the Pod is gone",
            self.key
        ));
        self.finished = true;
    }

    fn view(&self, ctx: &Ctx<'_>, pod: &Pod) -> PodView {
        let host_ip = ctx
            .nodes
            .get(&self.node)
            .map(|n| n.ip.to_string())
            .unwrap_or_default();
        PodView {
            host_ip,
            pod_ip: self.sandbox.as_ref().map(|s| s.ip.to_string()),
            start_time: self.start_time,
            init: self.init.iter().map(Ctr::view).collect(),
            containers: self.containers.iter().map(Ctr::view).collect(),
            restart_policy: self.restart_policy.clone(),
            readiness_gates: pod
                .spec
                .iter()
                .flat_map(|s| s.readiness_gates.iter().flatten())
                .map(|g| g.condition_type.clone())
                .collect(),
        }
    }

    /// Writes the Pod's status when it differs from the API's.
    fn write_status(&mut self, pod: &Pod, ctx: &Ctx<'_>) {
        let view = self.view(ctx, pod);
        let current = pod
            .status
            .as_ref()
            .and_then(|s| serde_json::to_value(s).ok());
        let desired = status::build(&view, current.as_ref(), SystemTime::now());
        let phase = desired["phase"].as_str().unwrap_or_default().to_owned();
        if phase != self.phase {
            log(&format!("{}: phase {phase}", self.key));
            self.phase = phase;
            self.save_record();
        }
        if !status::differs(&desired, current.as_ref()) {
            return;
        }
        let k = &self.key;
        if let Err(e) = ctx.api.patch_status(&k.namespace, &k.name, &desired) {
            log(&format!(
                "{k}: writing the status failed (tried again next round): {e:#}"
            ));
        }
    }

    /// What `lab status` shows, and a restarted stand-in cleans up.
    pub fn record(&self) -> Record {
        let containers = self
            .init
            .iter()
            .chain(&self.containers)
            .map(|c| ContainerRecord {
                name: c.name.clone(),
                state: match &c.phase {
                    Phase::Waiting { reason, .. } => format!("waiting ({reason})"),
                    Phase::Running(p) if p.stopping.is_some() => "stopping".to_owned(),
                    Phase::Running(_) => "running".to_owned(),
                    Phase::Terminated(t) => format!("terminated ({})", t.exit_code),
                },
                pid: c.running().map(|p| p.pid),
                start_ticks: c.running().and_then(|p| start_ticks(p.pid)),
                restarts: c.restarts,
                ready: c.ready(),
                log: self.log_path(&c.name),
            })
            .collect();
        Record {
            namespace: self.key.namespace.clone(),
            name: self.key.name.clone(),
            uid: self.key.uid.clone(),
            node: self.node.clone(),
            netns: self
                .sandbox
                .as_ref()
                .map(|s| s.netns.to_string())
                .unwrap_or_default(),
            owned_netns: self.sandbox.as_ref().is_some_and(|s| s.owned),
            ip: self
                .sandbox
                .as_ref()
                .map(|s| s.ip.to_string())
                .unwrap_or_default(),
            phase: self.phase.clone(),
            containers,
        }
    }

    /// What the kubelet API serves of this Pod's logs.
    pub fn logs(&self) -> PodLogs {
        let containers = self
            .init
            .iter()
            .chain(&self.containers)
            .map(|c| {
                let logs = ContainerLogs {
                    path: self.log_path(&c.name),
                    state: c.log_state(),
                    pid: c.running().map(|p| p.pid),
                };
                (c.name.clone(), logs)
            })
            .collect();
        PodLogs {
            node: self.node.clone(),
            terminating: self.terminating,
            containers,
        }
    }

    fn save_record(&self) {
        if !self.dir.exists() {
            return;
        }
        let path = self.dir.join("state.json");
        if let Ok(text) = serde_json::to_string_pretty(&self.record()) {
            let _ = fs::write(path, text);
        }
    }
}

/// The grace period of a Pod being deleted (or to be deleted): the one its
/// deletion set, else its spec's, else 30 s; never under [`MIN_GRACE`].
fn grace_of(pod: &Pod) -> Duration {
    let secs = pod
        .metadata
        .deletion_grace_period_seconds
        .or(pod
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds))
        .unwrap_or(30);
    Duration::from_secs(u64::try_from(secs).unwrap_or(0)).max(MIN_GRACE)
}

/// The ConfigMaps and Secrets `pod` refers to, as they are now.
fn fetch_objects(api: &Api, namespace: &str, pod: &Pod) -> anyhow::Result<Objects> {
    let (config_maps, secrets) = volumes::references(pod);
    let mut objects = Objects::default();
    for name in config_maps {
        if let Some(found) = api.config_map(namespace, &name)? {
            objects.config_maps.insert(name, found);
        }
    }
    for name in secrets {
        if let Some(found) = api.secret(namespace, &name)? {
            objects.secrets.insert(name, found);
        }
    }
    Ok(objects)
}

/// One line of the stand-in's log.
pub fn log(line: &str) {
    println!("{} {line}", crate::lab::cluster::rfc3339(SystemTime::now()));
}

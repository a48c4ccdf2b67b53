//! The scale test's steps against the lab's API server, and its report.
//!
//! The client runs in the control plane's network namespace (where the
//! API server listens) on a runtime of one thread: the API server and etcd,
//! on the same two cores, are what the load waits for.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::fs;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use egressgw_api::EgressGateway;
use egressgw_api::policy::{EgressClusterPolicy, EgressPolicy};
use futures_util::{StreamExt as _, stream};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::ScaleArgs;
use super::objects::{self, Objects};
use crate::lab::egressgw::scrape_agent;
use crate::lab::kubelet;
use crate::lab::probe;
use crate::lab::session::Lab;
use crate::lab::topology::Node as LabNode;

/// Probe Pods take host addresses `.20` to `.119` of the worker's pod CIDR:
/// inside the lab pods' part of it, above the lab's own Pods.
pub const MAX_PROBES: usize = 100;
const FIRST_PROBE_HOST: u8 = 20;

const PROBE_NAMESPACE: &str = "scale-probe";
const PROBE_APP: &str = "probe";
/// The destination looked up for a probe Pod: TEST-NET-1, which the probe
/// policy covers. Only looked up in the map, never sent to.
const PROBE_DST: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

/// How long the controller gets to write every status after the load.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How long one probe Pod's entry gets to appear.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Requests the API server turned away for now (429, 5xx, or a Pod whose
/// namespace's ServiceAccount is not made yet) are retried this often.
const RETRIES: u32 = 200;
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// The label that puts nodes in a synthetic gateway's group.
const GROUP_LABEL: &str = "egressgw.io/gateway-group";

/// What one run measured.
#[derive(Debug, Default)]
pub struct Report {
    sizes: String,
    objects: BTreeMap<&'static str, usize>,
    /// Per kind: objects created, requests, seconds.
    loads: Vec<(&'static str, usize, usize, f64)>,
    load_seconds: f64,
    /// Seconds from the end of the load until every policy's status was
    /// current, and from its start.
    converged_after_load: f64,
    converged_from_start: f64,
    /// Status writes of egressgw's kinds the API server took from the load's
    /// start to convergence.
    status_writes: BTreeMap<String, f64>,
    /// Watch events (count, bytes) the API server sent per resource over
    /// the same time.
    watch_events: BTreeMap<String, (f64, f64)>,
    /// Per agent: the Pods it watches, its plans, its reconciles and
    /// their mean time, as it reports them.
    watched: Vec<(String, String)>,
    /// Per process, its memory.
    memory: Vec<Memory>,
    /// Seconds from each probe Pod's creation to its entry, and from its
    /// address in the API to its entry.
    probe_created: Vec<f64>,
    probe_addressed: Vec<f64>,
    /// Seconds from each probe Pod's creation to its SNAT entry on the
    /// gateway node, which learns of it from the controller's slices.
    probe_gateway: Vec<f64>,
    load_average: String,
}

pub fn run(lab: &Lab, args: &ScaleArgs) -> anyhow::Result<Report> {
    let topo = &lab.state.topology;
    let gateway_node = topo
        .nodes
        .iter()
        .find(|n| n.gateway)
        .context("the scale lab has no gateway-capable node")?;
    let worker = topo
        .nodes
        .iter()
        .find(|n| !n.gateway)
        .context("the scale lab has no node that is not a gateway")?
        .clone();

    let synthetic = egressgw_benches::synthetic_cluster(args.nodes, args.policies, args.pods);
    let group = synthetic
        .gateways
        .iter()
        .find(|g| g.cluster_default)
        .and_then(|g| g.node_selector.match_labels.get(GROUP_LABEL))
        .context("the synthetic cluster's default gateway selects no group")?
        .clone();
    lab.kubectl
        .run(&[
            "label",
            "node",
            &gateway_node.name,
            &format!("{GROUP_LABEL}={group}"),
            "--overwrite",
        ])
        .with_context(|| format!("putting {} in gateway group {group}", gateway_node.name))?;
    let objects = Objects::of(&synthetic);
    let mut report = Report {
        sizes: format!(
            "{} nodes, {} policies, {} pods",
            args.nodes, args.policies, args.pods
        ),
        objects: objects::counts(&objects),
        ..Report::default()
    };
    println!(
        "loading {} (objects only) into the API server of lab {}",
        report.sizes, lab.paths.prefix
    );
    let kubeconfig = lab.paths.kubeconfig();
    let pins = kubelet::node_bpf_path(&lab.paths, &worker.name, "egressgw");
    let steps = Steps {
        lab,
        objects,
        concurrency: args.concurrency.max(1),
        probes: args.probes,
        worker,
        gateway: gateway_node.clone(),
        pins,
    };
    probe::in_netns(&topo.control_plane.netns, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the client's runtime")?;
        runtime.block_on(async {
            let client = client(&kubeconfig).await?;
            steps.run(&client, &mut report).await
        })
    })?;
    report.load_average = fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    Ok(report)
}

async fn client(kubeconfig: &Path) -> anyhow::Result<Client> {
    let file = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let mut config = kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .context("using the lab's kubeconfig")?;
    config.read_timeout = Some(Duration::from_secs(120));
    Client::try_from(config).context("building the client")
}

struct Steps<'a> {
    lab: &'a Lab,
    objects: Objects,
    concurrency: usize,
    probes: usize,
    worker: LabNode,
    gateway: LabNode,
    pins: PathBuf,
}

impl Steps<'_> {
    async fn run(&self, client: &Client, report: &mut Report) -> anyhow::Result<()> {
        let before = Metrics::read(client).await?;
        let start = Instant::now();
        self.load(client, report).await?;
        report.load_seconds = start.elapsed().as_secs_f64();
        println!(
            "loaded in {:.0} s; waiting for every policy's status",
            report.load_seconds
        );
        let loaded = Instant::now();
        converge(
            client,
            self.objects.policies.len() + self.objects.cluster_policies.len(),
        )
        .await?;
        report.converged_after_load = loaded.elapsed().as_secs_f64();
        report.converged_from_start = start.elapsed().as_secs_f64();
        let after = Metrics::read(client).await?;
        report.status_writes = after.status_writes().minus(&before.status_writes());
        report.watch_events = after.watch_events(&before);
        self.probes(client, report).await?;
        // After the probes: a gateway node's agent reads its Pods from the
        // slices the controller writes with the statuses, a moment later.
        report.watched = self.watched();
        report.memory = memory();
        Ok(())
    }

    async fn load(&self, client: &Client, report: &mut Report) -> anyhow::Result<()> {
        let c = self.concurrency;
        let o = &self.objects;
        let loads = &mut report.loads;
        loads.push(create_all(client, "Namespace", &o.namespaces, false, c).await?);
        service_accounts(client, o.namespaces.len()).await?;
        loads.push(create_all(client, "Node", &o.nodes, true, c).await?);
        loads.push(create_all(client, "EgressGateway", &o.gateways, false, c).await?);
        loads.push(create_all(client, "EgressPolicy", &o.policies, false, c).await?);
        let cluster_policies = &o.cluster_policies;
        loads.push(create_all(client, "EgressClusterPolicy", cluster_policies, false, c).await?);
        loads.push(create_all(client, "Pod", &o.pods, true, c).await?);
        Ok(())
    }

    /// The agents' own count of the Pods they watch, of their plans and
    /// of their reconciles.
    fn watched(&self) -> Vec<(String, String)> {
        self.lab
            .state
            .topology
            .nodes
            .iter()
            .map(|n| {
                let text = scrape_agent(self.lab, &n.name).unwrap_or_default();
                let scopes = samples(&text, "egressgw_watched_pods")
                    .into_iter()
                    .map(|(labels, v)| {
                        format!(
                            "{} ({})",
                            v,
                            labels.get("scope").map_or("?", String::as_str)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                let one = |name: &str| samples(&text, name).first().map_or(0.0, |s| s.1);
                let count = one("egressgw_reconcile_duration_seconds_count");
                let sum = one("egressgw_reconcile_duration_seconds_sum");
                let plans = one("egressgw_plans_total");
                let mean = if count > 0.0 {
                    sum / count * 1_000.0
                } else {
                    f64::NAN
                };
                let row = format!("{scopes} | {plans:.0} | {count:.0} | {mean:.1}");
                (n.name.clone(), row)
            })
            .collect()
    }

    /// Creates the probe policy, then one probe Pod at a time on the
    /// worker, each timed until the worker's classification map has its
    /// entry; removes them all afterwards.
    async fn probes(&self, client: &Client, report: &mut Report) -> anyhow::Result<()> {
        if self.probes == 0 {
            return Ok(());
        }
        ensure!(
            self.pins.exists(),
            "{} has no pinned eBPF maps at {}: the scale test times Pods into the eBPF datapath's map",
            self.worker.name,
            self.pins.display()
        );
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(PROBE_NAMESPACE.into()),
                ..Default::default()
            },
            ..Namespace::default()
        };
        create(&namespaces, &ns).await?;
        service_account(client, PROBE_NAMESPACE).await?;
        let policies: Api<EgressPolicy> = Api::namespaced(client.clone(), PROBE_NAMESPACE);
        let policy: EgressPolicy = serde_json::from_value(json!({
            "apiVersion": "egressgw.io/v1alpha1",
            "kind": "EgressPolicy",
            "metadata": { "name": PROBE_APP, "namespace": PROBE_NAMESPACE },
            "spec": {
                "appliedTo": { "podSelector": { "matchLabels": { "app": PROBE_APP } } },
                "destSubnet": ["192.0.2.0/24"],
            },
        }))?;
        create(&policies, &policy).await?;
        converge(
            client,
            self.objects.policies.len() + self.objects.cluster_policies.len() + 1,
        )
        .await?;
        println!(
            "timing {} Pods on {} into its kernel",
            self.probes, self.worker.name
        );
        let result = self.time_probes(client, report).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), PROBE_NAMESPACE);
        let _ = pods
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        let _ = namespaces
            .delete(PROBE_NAMESPACE, &DeleteParams::default())
            .await;
        result
    }

    async fn time_probes(&self, client: &Client, report: &mut Report) -> anyhow::Result<()> {
        let cidr: ipnet::Ipv4Net = self
            .worker
            .pod_cidr
            .parse()
            .with_context(|| format!("{}'s pod CIDR", self.worker.name))?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), PROBE_NAMESPACE);
        for i in 0..self.probes {
            let host = u32::from(FIRST_PROBE_HOST) + u32::try_from(i)?;
            let ip = IpAddr::V4(Ipv4Addr::from(u32::from(cidr.network()) + host));
            let name = format!("probe-{i:03}");
            let pod: Pod = serde_json::from_value(json!({
                "metadata": { "name": name, "labels": { "app": PROBE_APP } },
                "spec": {
                    "nodeName": self.worker.name,
                    "containers": [{ "name": "main", "image": kubelet::LAB_POD_IMAGE }],
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 0,
                },
                "status": {
                    "phase": "Running",
                    "podIP": ip.to_string(),
                    "podIPs": [{ "ip": ip.to_string() }],
                },
            }))?;
            let created = Instant::now();
            create(&pods, &pod).await?;
            patch_status(&pods, &pod).await?;
            let addressed = Instant::now();
            loop {
                let found = egressgw_dataplane::ebpf::lookup_pinned(&self.pins, ip, PROBE_DST)
                    .map_err(|e| anyhow!("{e}"))?;
                if found.is_some() {
                    break;
                }
                if addressed.elapsed() > PROBE_TIMEOUT {
                    bail!(
                        "Pod {PROBE_NAMESPACE}/{name} ({ip}) has no entry in {}'s kernel after {} s",
                        self.worker.name,
                        PROBE_TIMEOUT.as_secs()
                    );
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            report.probe_created.push(created.elapsed().as_secs_f64());
            report
                .probe_addressed
                .push(addressed.elapsed().as_secs_f64());
            while !self.gateway_snats(ip)? {
                if addressed.elapsed() > PROBE_TIMEOUT {
                    bail!(
                        "Pod {PROBE_NAMESPACE}/{name} ({ip}) has no SNAT entry on {} after {} s",
                        self.gateway.name,
                        PROBE_TIMEOUT.as_secs()
                    );
                }
                // Each look reads the whole table into nft first: rarely
                // enough to leave the gateway's agent its CPU.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            report.probe_gateway.push(created.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// Whether the gateway node's nftables SNAT map has `ip`'s entry for
    /// the probe destination (one element looked up, not the map listed).
    fn gateway_snats(&self, ip: IpAddr) -> anyhow::Result<bool> {
        let element = format!("{{ {ip} . {PROBE_DST} }}");
        let status = std::process::Command::new("ip")
            .args(["netns", "exec", self.gateway.netns.as_str()])
            .args([
                "nft", "get", "element", "inet", "egressgw", "snat4", &element,
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .context("running nft get element on the gateway node")?;
        Ok(status.success())
    }
}

/// Creates `objects` with `concurrency` requests in flight (and writes
/// their status, with `status`). Returns the kind, the objects, the
/// requests and the seconds taken.
async fn create_all<K>(
    client: &Client,
    kind: &'static str,
    objects: &[K],
    status: bool,
    concurrency: usize,
) -> anyhow::Result<(&'static str, usize, usize, f64)>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + fmt::Debug + Loaded,
{
    let started = Instant::now();
    let mut requests = 0;
    let mut done = stream::iter(objects)
        .map(|object| async move {
            let api = object.api(client);
            create(&api, object).await?;
            let mut sent = 1;
            if status && object.has_status() {
                patch_status(&api, object).await?;
                sent += 1;
            }
            anyhow::Ok(sent)
        })
        .buffer_unordered(concurrency);
    let mut count = 0usize;
    while let Some(result) = done.next().await {
        requests += result?;
        count += 1;
        if count.is_multiple_of(10_000) {
            println!(
                "  {kind}: {count} of {} in {:.0} s",
                objects.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("  {kind}: {count} in {seconds:.1} s");
    Ok((kind, count, requests, seconds))
}

/// What the loader needs of a kind: where its objects go, and whether it
/// writes their status after creating them (the API server drops a status
/// sent with the object).
pub trait Loaded: Sized {
    fn api(&self, client: &Client) -> Api<Self>;
    fn has_status(&self) -> bool {
        false
    }
    fn status_patch(&self) -> serde_json::Value {
        json!({})
    }
}

/// Kinds whose objects are cluster-wide, and namespaced ones.
macro_rules! cluster_api {
    () => {
        fn api(&self, client: &Client) -> Api<Self> {
            Api::all(client.clone())
        }
    };
}
macro_rules! namespaced_api {
    () => {
        fn api(&self, client: &Client) -> Api<Self> {
            Api::namespaced(
                client.clone(),
                self.metadata.namespace.as_deref().unwrap_or("default"),
            )
        }
    };
}

impl Loaded for Namespace {
    cluster_api!();
}
impl Loaded for EgressGateway {
    cluster_api!();
}
impl Loaded for EgressClusterPolicy {
    cluster_api!();
}
impl Loaded for EgressPolicy {
    namespaced_api!();
}

impl Loaded for Node {
    cluster_api!();
    fn has_status(&self) -> bool {
        self.status.is_some()
    }
    fn status_patch(&self) -> serde_json::Value {
        json!({ "status": self.status })
    }
}

impl Loaded for Pod {
    namespaced_api!();
    fn has_status(&self) -> bool {
        // A pending Pod without an address has the status the API server gives it.
        self.status
            .as_ref()
            .is_some_and(|s| s.pod_ips.is_some() || s.phase.as_deref() != Some("Pending"))
    }
    fn status_patch(&self) -> serde_json::Value {
        json!({ "status": self.status })
    }
}

/// Whether a failed request is worth sending again.
fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(status) => {
            status.code == 429
                || status.code >= 500
                // The ServiceAccount admission plugin, before the
                // ServiceAccount controller made the namespace's `default`.
                || (status.code == 403 && status.message.contains("service account"))
        }
        _ => true,
    }
}

async fn retrying<T, F, Fut>(what: impl Fn() -> String, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if transient(&e) && tries < RETRIES => {
                tries += 1;
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Err(e) => return Err(anyhow::Error::new(e).context(what())),
        }
    }
}

/// Creates `object`; one that exists already counts as created.
async fn create<K>(api: &Api<K>, object: &K) -> anyhow::Result<()>
where
    K: Resource + Clone + Serialize + DeserializeOwned + fmt::Debug,
{
    let what = || format!("creating {}", object.name_any());
    let params = PostParams::default();
    let created = retrying(what, || api.create(&params, object)).await;
    match created {
        Ok(_) => Ok(()),
        Err(e)
            if e.downcast_ref::<kube::Error>()
                .is_some_and(|k| matches!(k, kube::Error::Api(s) if s.code == 409)) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

async fn patch_status<K>(api: &Api<K>, object: &K) -> anyhow::Result<()>
where
    K: Resource + Clone + Serialize + DeserializeOwned + fmt::Debug + Loaded,
{
    let name = object.name_any();
    let patch = Patch::Merge(object.status_patch());
    let params = PatchParams::default();
    let what = || format!("writing the status of {name}");
    retrying(what, || api.patch_status(&name, &params, &patch))
        .await
        .map(drop)
}

/// Waits until the ServiceAccount controller has made `default` in
/// `count` namespaces (the Pods need it), or a minute has passed.
async fn service_accounts(client: &Client, count: usize) -> anyhow::Result<()> {
    let accounts: Api<ServiceAccount> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let made = accounts
            .list_metadata(&ListParams::default().fields("metadata.name=default"))
            .await
            .context("listing ServiceAccounts")?
            .items
            .len();
        if made >= count || Instant::now() > deadline {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn service_account(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let deadline = Instant::now() + Duration::from_secs(60);
    while accounts.get_opt("default").await?.is_none() {
        ensure!(
            Instant::now() < deadline,
            "namespace {namespace} has no default ServiceAccount after a minute"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Whether `conditions` were written for `generation`.
fn current(conditions: &[Condition], generation: Option<i64>) -> bool {
    !conditions.is_empty()
        && conditions
            .iter()
            .all(|c| c.observed_generation == generation)
}

/// Waits until `expected` policies (namespaced and cluster) each have a
/// status written for their generation.
async fn converge(client: &Client, expected: usize) -> anyhow::Result<()> {
    let started = Instant::now();
    let policies: Api<EgressPolicy> = Api::all(client.clone());
    let cluster: Api<EgressClusterPolicy> = Api::all(client.clone());
    let mut last = 0;
    loop {
        let mut done = 0;
        let mut total = 0;
        for p in list_all(&policies).await? {
            total += 1;
            let conditions = p.status.as_ref().map_or(&[][..], |s| &s.conditions);
            done += usize::from(current(conditions, p.metadata.generation));
        }
        for p in list_all(&cluster).await? {
            total += 1;
            let conditions = p.status.as_ref().map_or(&[][..], |s| &s.conditions);
            done += usize::from(current(conditions, p.metadata.generation));
        }
        if total >= expected && done == total {
            return Ok(());
        }
        if done / 1_000 != last / 1_000 {
            println!(
                "  {done} of {total} policies have their status ({:.0} s)",
                started.elapsed().as_secs_f64()
            );
        }
        last = done;
        if started.elapsed() > CONVERGE_TIMEOUT {
            bail!(
                "{done} of {total} policies have a status for their generation after {} s",
                CONVERGE_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Every object of `api`, listed in pages.
async fn list_all<K>(api: &Api<K>) -> anyhow::Result<Vec<K>>
where
    K: Resource + Clone + DeserializeOwned + fmt::Debug,
{
    let mut items = Vec::new();
    let mut params = ListParams::default().limit(2_000);
    loop {
        let page = api.list(&params).await.context("listing")?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}

/// The API server's own metrics.
struct Metrics(String);

impl Metrics {
    async fn read(client: &Client) -> anyhow::Result<Self> {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .context("a request for /metrics")?;
        let text = client
            .request_text(request)
            .await
            .context("reading the API server's /metrics")?;
        Ok(Self(text))
    }

    /// Status writes of egressgw's kinds, per resource.
    fn status_writes(&self) -> Sums {
        let mut sums = Sums::default();
        for (labels, v) in samples(&self.0, "apiserver_request_total") {
            let resource = labels.get("resource").map_or("", String::as_str);
            let verb = labels.get("verb").map_or("", String::as_str);
            if labels.get("subresource").map(String::as_str) == Some("status")
                && labels.get("group").map(String::as_str) == Some("egressgw.io")
                && matches!(verb, "PATCH" | "APPLY" | "PUT" | "UPDATE")
            {
                *sums.0.entry(resource.to_owned()).or_default() += v;
            }
        }
        sums
    }

    /// Watch events (count, bytes) sent per resource since `before`.
    fn watch_events(&self, before: &Self) -> BTreeMap<String, (f64, f64)> {
        let per = |m: &Self, name: &str| {
            let mut sums = Sums::default();
            for (labels, v) in samples(&m.0, name) {
                let resource = labels
                    .get("resource")
                    .or_else(|| labels.get("kind"))
                    .cloned()
                    .unwrap_or_default();
                *sums.0.entry(resource).or_default() += v;
            }
            sums
        };
        let events = per(self, "apiserver_watch_events_total")
            .minus(&per(before, "apiserver_watch_events_total"));
        let bytes = per(self, "apiserver_watch_events_sizes_sum")
            .minus(&per(before, "apiserver_watch_events_sizes_sum"));
        // The kinds the load and egressgw's daemons move; the API server's
        // own objects see a handful of events each.
        events
            .into_iter()
            .filter(|(_, n)| *n >= 100.0)
            .map(|(r, n)| {
                let b = bytes.get(&r).copied().unwrap_or(0.0);
                (r, (n, b))
            })
            .collect()
    }
}

#[derive(Debug, Default)]
struct Sums(BTreeMap<String, f64>);

impl Sums {
    fn minus(self, before: &Sums) -> BTreeMap<String, f64> {
        self.0
            .into_iter()
            .map(|(k, v)| {
                let was = before.0.get(&k).copied().unwrap_or(0.0);
                (k, v - was)
            })
            .collect()
    }
}

/// The samples of metric `name` in a Prometheus text exposition: labels
/// and value.
fn samples(text: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(rest) => {
                    let (labels, value) = rest.split_once("} ")?;
                    (labels, value)
                }
                None => ("", rest.strip_prefix(' ')?),
            };
            let value: f64 = value.split_whitespace().next()?.parse().ok()?;
            Some((parse_labels(labels), value))
        })
        .collect()
}

fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let Some(end) = after.find('"') else {
            break;
        };
        labels.insert(
            key.trim_start_matches(',').to_owned(),
            after[..end].to_owned(),
        );
        rest = &after[end + 1..];
    }
    labels
}

/// One process's memory, in MiB, from `/proc/<pid>/status`.
#[derive(Debug)]
struct Memory {
    what: String,
    /// Resident now (`VmRSS`).
    rss: f64,
    /// Of it, pages of files (`RssFile`): the binary's own code and data,
    /// shared with every process running it.
    file: f64,
    /// The most it was resident at once (`VmHWM`).
    peak: f64,
}

/// The memory of egressgw's daemons and the API server and etcd.
fn memory() -> Vec<Memory> {
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = Path::new("/proc").join(pid.to_string());
        let Ok(cmdline) = fs::read(dir.join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let program = args
            .first()
            .and_then(|a| a.rsplit('/').next())
            .unwrap_or_default();
        let what = if program.starts_with("egressgw") {
            match args.get(1).map(String::as_str) {
                Some("agent") => {
                    let node = environ(&dir, "NODE_NAME").unwrap_or_else(|| "?".into());
                    format!("agent on {node}")
                }
                Some("controller") => format!("controller (pid {pid})"),
                _ => continue,
            }
        } else if program == "kube-apiserver" || program == "etcd" {
            program.to_owned()
        } else {
            continue;
        };
        let Ok(status) = fs::read_to_string(dir.join("status")) else {
            continue;
        };
        let kib = |field: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        found.push(Memory {
            what,
            rss: kib("VmRSS:") / 1024.0,
            file: kib("RssFile:") / 1024.0,
            peak: kib("VmHWM:") / 1024.0,
        });
    }
    found.sort_by(|a, b| a.what.cmp(&b.what));
    found
}

fn environ(dir: &Path, name: &str) -> Option<String> {
    let text = fs::read(dir.join("environ")).ok()?;
    text.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix(&format!("{name}=")).map(str::to_owned)
    })
}

/// The `q` quantile of `values` (nearest rank), in milliseconds.
fn quantile_ms(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    // Nearest rank: the smallest value with at least q of them at or below.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] * 1_000.0
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nscale: {} (load average after: {})",
            self.sizes, self.load_average
        );
        let _ = writeln!(
            out,
            "\n| loaded | objects | requests | seconds | requests/s |"
        );
        let _ = writeln!(out, "| --- | --- | --- | --- | --- |");
        for (kind, count, requests, seconds) in &self.loads {
            #[allow(clippy::cast_precision_loss)]
            let rate = *requests as f64 / seconds.max(1e-9);
            let _ = writeln!(
                out,
                "| {kind} | {count} | {requests} | {seconds:.1} | {rate:.0} |"
            );
        }
        let writes: f64 = self.status_writes.values().sum();
        let _ = writeln!(out, "\n| controller | |\n| --- | --- |");
        let _ = writeln!(out, "| load | {:.0} s |", self.load_seconds);
        let _ = writeln!(
            out,
            "| every policy's status current | {:.0} s after the load ({:.0} s after its start) |",
            self.converged_after_load, self.converged_from_start
        );
        let _ = writeln!(
            out,
            "| status writes | {writes:.0} ({:.0}/s from the load's start) |",
            writes / self.converged_from_start.max(1e-9)
        );
        for (resource, n) in &self.status_writes {
            let _ = writeln!(out, "| status writes, {resource} | {n:.0} |");
        }
        let _ = writeln!(
            out,
            "\n| watch events sent, load to convergence | events | MiB |\n| --- | --- | --- |"
        );
        for (resource, (n, bytes)) in &self.watch_events {
            let _ = writeln!(out, "| {resource} | {n:.0} | {:.1} |", bytes / 1_048_576.0);
        }
        let _ = writeln!(
            out,
            "\n| agent | Pods watched (scope) | plans | reconciles | mean reconcile ms |\n| --- | --- | --- | --- | --- |"
        );
        for (node, watched) in &self.watched {
            let _ = writeln!(out, "| {node} | {watched} |");
        }
        let _ = writeln!(
            out,
            "\n| process | RSS MiB | of it, file pages MiB | peak MiB |\n| --- | --- | --- | --- |"
        );
        for m in &self.memory {
            let _ = writeln!(
                out,
                "| {} | {:.0} | {:.0} | {:.0} |",
                m.what, m.rss, m.file, m.peak
            );
        }
        if !self.probe_created.is_empty() {
            let _ = writeln!(
                out,
                "\n| {} Pods, one at a time, to their kernel entry | p50 ms | p99 ms | max ms |\n| --- | --- | --- | --- |",
                self.probe_created.len()
            );
            for (what, values) in [
                ("from the create request", &self.probe_created),
                ("from the address written", &self.probe_addressed),
                (
                    "from the create request to the gateway's SNAT entry",
                    &self.probe_gateway,
                ),
            ] {
                let _ = writeln!(
                    out,
                    "| {what} | {:.1} | {:.1} | {:.1} |",
                    quantile_ms(values, 0.5),
                    quantile_ms(values, 0.99),
                    quantile_ms(values, 1.0)
                );
            }
        }
        let _ = writeln!(out, "\nobjects: {:?}", self.objects);
        f.write_str(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_with_their_labels() {
        let text = "# HELP x\n\
            apiserver_request_total{code=\"201\",group=\"egressgw.io\",resource=\"egresspolicies\",subresource=\"status\",verb=\"PATCH\"} 12\n\
            apiserver_request_total{code=\"200\",group=\"\",resource=\"pods\",subresource=\"\",verb=\"LIST\"} 3\n\
            apiserver_request_totals 9\n\
            egressgw_watched_pods{scope=\"cluster\"} 100000\n";
        let found = samples(text, "apiserver_request_total");
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].0["resource"], "egresspolicies");
        assert_eq!(found[0].1, 12.0);
        let writes = Metrics(text.to_owned())
            .status_writes()
            .minus(&Sums::default());
        assert_eq!(
            writes,
            BTreeMap::from([("egresspolicies".to_owned(), 12.0)])
        );
        assert_eq!(
            samples(text, "egressgw_watched_pods")[0].0["scope"],
            "cluster"
        );
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(|v| f64::from(v) / 1_000.0).collect();
        assert_eq!(quantile_ms(&values, 0.5), 50.0);
        assert_eq!(quantile_ms(&values, 0.99), 99.0);
        assert_eq!(quantile_ms(&values, 1.0), 100.0);
    }
}

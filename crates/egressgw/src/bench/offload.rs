//! Switching tx checksum offload on `egress.vxlan`, or the datapath, for the
//! bench: through the config the agents read (the chart's ConfigMap,
//! `feature` keys), then a rolling restart of the agents, as `helm upgrade
//! --set feature.vxlan.disableChecksumOffload=...` would do it. The original
//! config is kept in an annotation of the ConfigMap until it is restored,
//! so `egressgw bench --cleanup` can restore it after a crash.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use egressgw_core::model::DatapathChoice;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::json;

use super::report::BenchDatapath;

/// The ConfigMap key the chart writes the config to.
const CONFIG_KEY: &str = "config.yaml";
/// The annotation holding the config as it was before the bench.
pub const ORIGINAL_ANNOTATION: &str = "egressgw.io/bench-original-config";
/// The Pod template annotation whose change rolls the agents.
const ROLL_ANNOTATION: &str = "egressgw.io/bench-config";
/// How long an agent rollout may take.
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(300);

/// The agents of one egressgw install: their DaemonSet and ConfigMap.
#[derive(Debug, Clone)]
pub struct Agents {
    pub namespace: String,
    pub daemonset: String,
    pub configmap: String,
    /// The agent container's image.
    pub image: String,
}

/// Finds the agent DaemonSet (the chart's labels) and the ConfigMap it
/// mounts as `config`.
pub async fn find_agents(client: &kube::Client, namespace: &str) -> anyhow::Result<Agents> {
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    let list = api
        .list(
            &ListParams::default()
                .labels("app.kubernetes.io/part-of=egressgw,app.kubernetes.io/component=agent"),
        )
        .await
        .with_context(|| format!("listing egressgw's agent DaemonSet in namespace {namespace}"))?;
    let ds = match list.items.as_slice() {
        [one] => one,
        [] => bail!(
            "no egressgw agent DaemonSet in namespace {namespace} \
             (labels app.kubernetes.io/part-of=egressgw, component=agent): \
             is egressgw installed there? (--egressgw-namespace)"
        ),
        _ => bail!("more than one egressgw agent DaemonSet in namespace {namespace}"),
    };
    let name = ds.metadata.name.clone().unwrap_or_default();
    let spec = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref());
    let image = spec
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .with_context(|| format!("DaemonSet {namespace}/{name} has no container image"))?;
    let configmap = spec
        .and_then(|s| s.volumes.as_ref())
        .and_then(|v| v.iter().find(|v| v.name == "config"))
        .and_then(|v| v.config_map.as_ref())
        .map(|c| c.name.clone())
        .with_context(|| format!("DaemonSet {namespace}/{name} mounts no ConfigMap as `config`"))?;
    Ok(Agents {
        namespace: namespace.to_owned(),
        daemonset: name,
        configmap,
        image,
    })
}

/// Whether the config turns tx checksum offload off
/// (`vxlan.disableChecksumOffload`, default false).
pub fn offload_disabled(config: &str) -> anyhow::Result<bool> {
    let doc: serde_yaml::Value =
        serde_yaml::from_str(config).context("parsing the agents' config")?;
    Ok(doc
        .get("vxlan")
        .and_then(|v| v.get("disableChecksumOffload"))
        .and_then(serde_yaml::Value::as_bool)
        .unwrap_or(false))
}

/// The config with `vxlan.disableChecksumOffload` set to `disabled`.
pub fn with_offload_disabled(config: &str, disabled: bool) -> anyhow::Result<String> {
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(config).context("parsing the agents' config")?;
    if doc.is_null() {
        doc = serde_yaml::Value::Mapping(serde_yaml::Mapping::new());
    }
    let root = doc
        .as_mapping_mut()
        .context("the agents' config is not a mapping")?;
    let vxlan = root
        .entry("vxlan".into())
        .or_insert_with(|| serde_yaml::Value::Mapping(serde_yaml::Mapping::new()));
    let vxlan = vxlan
        .as_mapping_mut()
        .context("the agents' config: `vxlan` is not a mapping")?;
    vxlan.insert("disableChecksumOffload".into(), disabled.into());
    serde_yaml::to_string(&doc).context("writing the agents' config")
}

/// The datapath the config asks for (`datapath`, default `auto`; on eBPF
/// `ebpf.fastPath`, default on); `None` for `auto`, which runs eBPF only
/// where the node can.
pub fn datapath(config: &str) -> anyhow::Result<Option<BenchDatapath>> {
    let doc: serde_yaml::Value =
        serde_yaml::from_str(config).context("parsing the agents' config")?;
    let choice: DatapathChoice = match doc.get("datapath") {
        None => DatapathChoice::default(),
        Some(v) => serde_yaml::from_value(v.clone()).context("the agents' config: `datapath`")?,
    };
    let fast_path = match doc.get("ebpf").and_then(|e| e.get("fastPath")) {
        None => true,
        Some(v) => {
            serde_yaml::from_value(v.clone()).context("the agents' config: `ebpf.fastPath`")?
        }
    };
    Ok(match (choice, fast_path) {
        (DatapathChoice::Auto, _) => None,
        (DatapathChoice::Nftables, _) => Some(BenchDatapath::Nftables),
        (DatapathChoice::Ebpf, true) => Some(BenchDatapath::Ebpf),
        (DatapathChoice::Ebpf, false) => Some(BenchDatapath::EbpfMarked),
    })
}

/// The config with `datapath` (and on eBPF `ebpf.fastPath`) set for
/// `datapath`; every other key is kept.
pub fn with_datapath(config: &str, datapath: BenchDatapath) -> anyhow::Result<String> {
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(config).context("parsing the agents' config")?;
    if doc.is_null() {
        doc = serde_yaml::Value::Mapping(serde_yaml::Mapping::new());
    }
    let top = doc
        .as_mapping_mut()
        .context("the agents' config is not a mapping")?;
    top.insert("datapath".into(), datapath.choice().to_string().into());
    if let Some(fast_path) = datapath.fast_path() {
        let ebpf = top
            .entry("ebpf".into())
            .or_insert_with(|| serde_yaml::Value::Mapping(serde_yaml::Mapping::new()))
            .as_mapping_mut()
            .context("the agents' config: `ebpf` is not a mapping")?;
        ebpf.insert("fastPath".into(), fast_path.into());
    }
    serde_yaml::to_string(&doc).context("writing the agents' config")
}

/// The config the agents read now, and the one from before the bench if a
/// bench changed it and did not restore it.
pub async fn read_config(
    client: &kube::Client,
    agents: &Agents,
) -> anyhow::Result<(String, Option<String>)> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &agents.namespace);
    let cm = api.get(&agents.configmap).await.with_context(|| {
        format!(
            "reading ConfigMap {}/{}",
            agents.namespace, agents.configmap
        )
    })?;
    let config = cm
        .data
        .as_ref()
        .and_then(|d| d.get(CONFIG_KEY))
        .cloned()
        .with_context(|| {
            format!(
                "ConfigMap {}/{} has no {CONFIG_KEY}",
                agents.namespace, agents.configmap
            )
        })?;
    let original = cm
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_ANNOTATION))
        .cloned();
    Ok((config, original))
}

/// Writes `config` (keeping `original` in the annotation, or removing the
/// annotation with `None`) and rolls the agents, waiting until every one
/// runs the new config and is ready.
pub async fn apply(
    client: &kube::Client,
    agents: &Agents,
    config: &str,
    original: Option<&str>,
    progress: &dyn Fn(&str),
) -> anyhow::Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &agents.namespace);
    let patch = json!({
        "metadata": { "annotations": { ORIGINAL_ANNOTATION: original } },
        "data": { CONFIG_KEY: config },
    });
    cms.patch(
        &agents.configmap,
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .with_context(|| {
        format!(
            "writing ConfigMap {}/{}",
            agents.namespace, agents.configmap
        )
    })?;
    let offload = if offload_disabled(config)? {
        "off"
    } else {
        "on"
    };
    let datapath = datapath(config)?.map_or_else(|| "auto".to_owned(), |d| d.to_string());
    // Each config its own value, so that every switch rolls the agents;
    // back to the chart's config, the template goes back to the chart's too.
    let roll = original.map(|_| format!("offload-{offload}-datapath-{datapath}"));
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), &agents.namespace);
    let patch = json!({ "spec": { "template": { "metadata": { "annotations": { ROLL_ANNOTATION: roll } } } } });
    ds.patch(
        &agents.daemonset,
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .with_context(|| {
        format!(
            "rolling DaemonSet {}/{}",
            agents.namespace, agents.daemonset
        )
    })?;
    progress(&format!(
        "tx checksum offload {offload}, datapath {datapath}: rolling the agents ({}/{})",
        agents.namespace, agents.daemonset
    ));
    wait_rollout(&ds, agents).await
}

/// Waits until the DaemonSet's controller has seen its latest spec and
/// every scheduled Pod is updated and available.
async fn wait_rollout(api: &Api<DaemonSet>, agents: &Agents) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let ds = api.get(&agents.daemonset).await.with_context(|| {
            format!(
                "reading DaemonSet {}/{}",
                agents.namespace, agents.daemonset
            )
        })?;
        let generation = ds.metadata.generation.unwrap_or(0);
        let status = ds.status.unwrap_or_default();
        let desired = status.desired_number_scheduled;
        let done = status.observed_generation.unwrap_or(0) >= generation
            && status.updated_number_scheduled.unwrap_or(0) == desired
            && status.number_available.unwrap_or(0) == desired
            && status.number_unavailable.unwrap_or(0) == 0;
        if done {
            return Ok(());
        }
        if start.elapsed() > ROLLOUT_TIMEOUT {
            bail!(
                "the agents' rollout did not finish within {} s: {} of {desired} updated, {} available",
                ROLLOUT_TIMEOUT.as_secs(),
                status.updated_number_scheduled.unwrap_or(0),
                status.number_available.unwrap_or(0)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offload_switch_keeps_every_other_key() {
        let config = "vxlan:\n  id: 100\n  port: 4789\nenableIPv4: true\n";
        assert!(!offload_disabled(config).unwrap());
        let off = with_offload_disabled(config, true).unwrap();
        assert!(offload_disabled(&off).unwrap());
        assert!(
            off.contains("id: 100") && off.contains("enableIPv4: true"),
            "{off}"
        );
        let on = with_offload_disabled(&off, false).unwrap();
        assert!(!offload_disabled(&on).unwrap());
    }

    #[test]
    fn the_datapath_switch_keeps_every_other_key() {
        let config = "vxlan:\n  id: 100\ndatapath: auto\n";
        assert_eq!(
            datapath(config).unwrap(),
            None,
            "auto: eBPF only where it can"
        );
        let nft = with_datapath(config, BenchDatapath::Nftables).unwrap();
        assert_eq!(datapath(&nft).unwrap(), Some(BenchDatapath::Nftables));
        assert!(nft.contains("id: 100"), "{nft}");
        let marked = with_datapath(&nft, BenchDatapath::EbpfMarked).unwrap();
        assert_eq!(datapath(&marked).unwrap(), Some(BenchDatapath::EbpfMarked));
        let fast = with_datapath(&marked, BenchDatapath::Ebpf).unwrap();
        assert_eq!(datapath(&fast).unwrap(), Some(BenchDatapath::Ebpf));
        assert!(fast.contains("id: 100"), "{fast}");
        assert_eq!(datapath("").unwrap(), None);
        assert_eq!(
            datapath("datapath: nftables\nebpf:\n  fastPath: false\n").unwrap(),
            Some(BenchDatapath::Nftables)
        );
        assert!(datapath("datapath: xdp").is_err());
        assert!(datapath("ebpf:\n  fastPath: maybe").is_err());
    }

    #[test]
    fn an_empty_config_gets_the_vxlan_key() {
        let off = with_offload_disabled("", true).unwrap();
        assert!(offload_disabled(&off).unwrap(), "{off}");
    }
}

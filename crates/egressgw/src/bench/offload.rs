//! Switching tx checksum offload on `egress.vxlan`, or the datapath, for the
//! bench: through the config the agents read (the chart's ConfigMap,
//! `feature` keys), then a rolling restart of the agents, as `helm upgrade
//! --set feature.vxlan.disableChecksumOffload=...` would do it. The original
//! config is kept in an annotation of the ConfigMap until it is restored,
//! so `egressgw bench --cleanup` can restore it after a crash.
//!
//! The bench writes only over what it expects there: the config it read
//! at its start, or its own last write (kept in another annotation). A
//! config someone else changed while the bench ran (`kubectl edit`, an
//! upgrade with `--force-conflicts`) stops the bench before its next
//! switch, and is left as they wrote it by the restore, which says what
//! the config from before the bench was.
//!
//! Restoring also hands the config key back to whoever owned it before
//! (the ConfigMap's `managedFields`): Helm 4 applies server-side, and a
//! key last written by the bench would make its next `helm upgrade` that
//! changes the config fail with a conflict.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use egressgw_core::model::DatapathChoice;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, ObjectMeta};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::report::BenchDatapath;

/// The ConfigMap key the chart writes the config to.
const CONFIG_KEY: &str = "config.yaml";
/// The annotation holding the config as it was before the bench.
pub const ORIGINAL_ANNOTATION: &str = "egressgw.io/bench-original-config";
/// The annotation holding who owned the config key before the bench (its
/// `managedFields` entries, as JSON [`ConfigOwner`]s), for the restore to
/// hand it back to them.
const OWNERS_ANNOTATION: &str = "egressgw.io/bench-original-owners";
/// The annotation holding the config as the bench last wrote it: what the
/// next write expects to find.
const WRITTEN_ANNOTATION: &str = "egressgw.io/bench-written-config";
/// The field manager of the bench's writes.
const FIELD_MANAGER: &str = "egressgw-bench";
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

/// Whether the config the ConfigMap holds (`live`) is the one the bench
/// expects there: its own last write (`written`), or before its first
/// switch the config it read at its start (`original`). A switched
/// config left by a bench that did not record its writes is taken as
/// unchanged.
fn unchanged(live: Option<&str>, written: Option<&str>, original: Option<&str>) -> bool {
    written
        .or(original)
        .is_none_or(|expected| live == Some(expected))
}

/// Writes `config` (keeping `original` in the annotation, or removing the
/// annotation with `None` and handing the config key back to its owners
/// from before the bench) and rolls the agents, waiting until every one
/// runs the new config and is ready. Writes nothing over a config someone
/// else changed meanwhile: a switch fails, a restore leaves it and says so.
pub async fn apply(
    client: &kube::Client,
    agents: &Agents,
    config: &str,
    original: Option<&str>,
    progress: &dyn Fn(&str),
) -> anyhow::Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &agents.namespace);
    let config = write_config(&cms, agents, config, original, progress).await?;
    let config = config.as_str();
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
    ds.patch(&agents.daemonset, &writes(), &Patch::Merge(&patch))
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

/// Writes `config` into the ConfigMap (see [`apply`]) unless someone else
/// changed it since the bench's last write; returns the config the agents
/// are to run: `config`, or on a restore over such a change, theirs.
async fn write_config(
    cms: &Api<ConfigMap>,
    agents: &Agents,
    config: &str,
    original: Option<&str>,
    progress: &dyn Fn(&str),
) -> anyhow::Result<String> {
    let what = format!("ConfigMap {}/{}", agents.namespace, agents.configmap);
    let live = cms
        .get(&agents.configmap)
        .await
        .with_context(|| format!("reading {what}"))?;
    let annotation = |key: &str| {
        live.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(String::as_str)
    };
    let recorded = annotation(OWNERS_ANNOTATION);
    let live_config = live
        .data
        .as_ref()
        .and_then(|d| d.get(CONFIG_KEY))
        .map(String::as_str);
    let written = annotation(WRITTEN_ANNOTATION);
    if !unchanged(live_config, written, original) {
        if original.is_some() {
            bail!(
                "{what} changed while the bench ran (its {CONFIG_KEY} is not what the bench \
                 left there): not switching over it; `egressgw bench --cleanup` removes the \
                 bench's annotations and leaves the config as it is"
            );
        }
        leave_changed(cms, &live.metadata, &what, config, progress).await?;
        return Ok(live_config.unwrap_or(config).to_owned());
    }
    let owners = match (original, recorded) {
        // The first switch: record who owns the key now.
        (Some(_), None) => Some(serde_json::to_string(&config_owners(
            live.metadata.managed_fields.as_deref().unwrap_or_default(),
        ))?),
        // Later switches keep the first one's record.
        (Some(_), Some(recorded)) => Some(recorded.to_owned()),
        (None, _) => None,
    };
    // The resource version makes the write fail if anything changed since
    // the read above.
    let patch = json!({
        "metadata": {
            "resourceVersion": live.metadata.resource_version,
            "annotations": {
                ORIGINAL_ANNOTATION: original,
                OWNERS_ANNOTATION: owners,
                WRITTEN_ANNOTATION: original.map(|_| config),
            },
        },
        "data": { CONFIG_KEY: config },
    });
    let written = cms
        .patch(&agents.configmap, &writes(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("writing {what}"))?;
    if original.is_none()
        && let Some(recorded) = recorded
    {
        hand_back(cms, written.metadata, &what, recorded).await?;
    }
    Ok(config.to_owned())
}

/// The restore over a config someone else changed since the bench's last
/// write: their config stays and keeps its owners; the bench's
/// annotations go (and [`apply`] rolls the agents back to the chart's Pod
/// template).
/// `original` is the config from before the bench, told to the user.
async fn leave_changed(
    cms: &Api<ConfigMap>,
    live: &ObjectMeta,
    what: &str,
    original: &str,
    progress: &dyn Fn(&str),
) -> anyhow::Result<()> {
    let patch = json!({ "metadata": {
        "resourceVersion": live.resource_version,
        "annotations": {
            ORIGINAL_ANNOTATION: null,
            OWNERS_ANNOTATION: null,
            WRITTEN_ANNOTATION: null,
        },
    } });
    let name = live.name.as_deref().unwrap_or_default();
    cms.patch(name, &writes(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("removing the bench's annotations from {what}"))?;
    progress(&format!(
        "{what} was changed by someone else after the bench switched it: left as they \
         wrote it, not restored; the config from before the bench was:\n{original}"
    ));
    Ok(())
}

/// The bench's writes, under its own field manager.
fn writes() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

/// One owner of the config key: a `managedFields` entry's identity.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConfigOwner {
    manager: String,
    operation: String,
    api_version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    subresource: String,
}

impl ConfigOwner {
    fn of(entry: &ManagedFieldsEntry) -> Self {
        let text = |s: &Option<String>| s.clone().unwrap_or_default();
        Self {
            manager: text(&entry.manager),
            operation: text(&entry.operation),
            api_version: text(&entry.api_version),
            subresource: text(&entry.subresource),
        }
    }
}

/// Whether `entry` owns the config key.
fn owns_config(entry: &ManagedFieldsEntry) -> bool {
    entry
        .fields_v1
        .as_ref()
        .and_then(|f| f.0.get("f:data"))
        .and_then(|d| d.get(format!("f:{CONFIG_KEY}")))
        .is_some()
}

/// Who owns the config key among `entries`.
fn config_owners(entries: &[ManagedFieldsEntry]) -> Vec<ConfigOwner> {
    entries
        .iter()
        .filter(|e| owns_config(e))
        .map(ConfigOwner::of)
        .collect()
}

/// `entries` with the config key owned by `owners` alone: taken from every
/// other entry (one left owning nothing goes), given to each of `owners`
/// (an entry made for one that has none left). `None` when that is how
/// it is already.
fn config_owned_by(
    entries: &[ManagedFieldsEntry],
    owners: &[ConfigOwner],
) -> Option<Vec<ManagedFieldsEntry>> {
    let key = format!("f:{CONFIG_KEY}");
    let mut result = Vec::new();
    for entry in entries {
        let owner = owners.contains(&ConfigOwner::of(entry));
        if owner == owns_config(entry) {
            result.push(entry.clone());
            continue;
        }
        let mut entry = entry.clone();
        let fields = entry.fields_v1.get_or_insert_with(|| FieldsV1(json!({})));
        if !fields.0.is_object() {
            fields.0 = json!({});
        }
        let top = fields.0.as_object_mut().expect("an object");
        if owner {
            let data = top.entry("f:data").or_insert_with(|| json!({}));
            if !data.is_object() {
                *data = json!({});
            }
            data.as_object_mut()
                .expect("an object")
                .insert(key.clone(), json!({}));
        } else {
            if let Some(data) = top.get_mut("f:data").and_then(|d| d.as_object_mut()) {
                data.remove(&key);
                if data.is_empty() {
                    top.remove("f:data");
                }
            }
            if top.is_empty() {
                continue;
            }
        }
        result.push(entry);
    }
    for owner in owners {
        if !result.iter().any(|e| ConfigOwner::of(e) == *owner) {
            result.push(ManagedFieldsEntry {
                api_version: Some(owner.api_version.clone()),
                fields_type: Some("FieldsV1".to_owned()),
                fields_v1: Some(FieldsV1(json!({ "f:data": { key.clone(): {} } }))),
                manager: Some(owner.manager.clone()),
                operation: Some(owner.operation.clone()),
                subresource: (!owner.subresource.is_empty()).then(|| owner.subresource.clone()),
                time: None,
            });
        }
    }
    (result != entries).then_some(result)
}

/// Hands the config key back to the owners `recorded` (the owners
/// annotation's text) names: the bench's writes made it the key's owner,
/// and an owner that applies server-side (Helm 4) would otherwise find
/// its next change refused as a conflict with the bench.
/// `written` is the ConfigMap's metadata as the restoring write left it.
async fn hand_back(
    cms: &Api<ConfigMap>,
    written: ObjectMeta,
    what: &str,
    recorded: &str,
) -> anyhow::Result<()> {
    let owners: Vec<ConfigOwner> = serde_json::from_str(recorded).with_context(|| {
        format!(
            "{what}: annotation {OWNERS_ANNOTATION} is not a list of owners; the config is \
             restored, but its next `helm upgrade` may need --force-conflicts"
        )
    })?;
    if owners.is_empty() {
        return Ok(());
    }
    let entries = written.managed_fields.unwrap_or_default();
    let Some(entries) = config_owned_by(&entries, &owners) else {
        return Ok(());
    };
    // Setting managedFields replaces them; the resource version makes
    // sure nothing changed since the write.
    let patch = json!({ "metadata": {
        "managedFields": entries,
        "resourceVersion": written.resource_version,
    } });
    let name = written.name.as_deref().unwrap_or_default();
    cms.patch(name, &writes(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("handing {what}'s {CONFIG_KEY} back to its owners"))?;
    Ok(())
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

    fn entry(manager: &str, operation: &str, fields: serde_json::Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            api_version: Some("v1".to_owned()),
            fields_type: Some("FieldsV1".to_owned()),
            fields_v1: Some(FieldsV1(fields)),
            manager: Some(manager.to_owned()),
            operation: Some(operation.to_owned()),
            subresource: None,
            time: None,
        }
    }

    /// The ConfigMap's fields as Helm 4 applies them, and as they are after
    /// the bench wrote the config.
    fn helm_and_bench() -> (Vec<ManagedFieldsEntry>, Vec<ManagedFieldsEntry>) {
        let labels = json!({ "f:metadata": { "f:labels": { "f:app.kubernetes.io/name": {} } } });
        let mut helm_before = labels.clone();
        helm_before["f:data"] = json!({ "f:config.yaml": {} });
        let before = vec![entry("helm", "Apply", helm_before)];
        let after = vec![
            entry("helm", "Apply", labels),
            entry(
                FIELD_MANAGER,
                "Update",
                json!({ "f:data": { "f:config.yaml": {} } }),
            ),
        ];
        (before, after)
    }

    #[test]
    fn restoring_hands_the_config_back_to_its_owner_from_before() {
        let (before, after) = helm_and_bench();
        let owners = config_owners(&before);
        assert_eq!(owners.len(), 1);
        assert_eq!(owners[0].manager, "helm");
        assert!(config_owners(&after).iter().all(|o| o.manager != "helm"));
        // Through the annotation and back.
        let recorded = serde_json::to_string(&owners).unwrap();
        let owners: Vec<ConfigOwner> = serde_json::from_str(&recorded).unwrap();
        let handed = config_owned_by(&after, &owners).expect("a change");
        assert_eq!(handed, before, "helm owns the key again, the bench nothing");
        assert_eq!(
            config_owned_by(&handed, &owners),
            None,
            "nothing more to do"
        );
    }

    #[test]
    fn handing_back_keeps_what_else_the_bench_owns_and_makes_a_missing_owner() {
        let (_, mut after) = helm_and_bench();
        after[1].fields_v1 = Some(FieldsV1(json!({
            "f:data": { "f:config.yaml": {}, "f:other": {} },
        })));
        let gone = ConfigOwner {
            manager: "kubectl-client-side-apply".to_owned(),
            operation: "Update".to_owned(),
            api_version: "v1".to_owned(),
            subresource: String::new(),
        };
        let handed = config_owned_by(&after, std::slice::from_ref(&gone)).expect("a change");
        assert_eq!(handed.len(), 3, "{handed:?}");
        assert_eq!(handed[0], after[0], "helm's entry untouched");
        assert_eq!(
            handed[1].fields_v1.as_ref().unwrap().0,
            json!({ "f:data": { "f:other": {} } }),
            "the bench keeps the key it wrote besides"
        );
        assert_eq!(ConfigOwner::of(&handed[2]), gone);
        assert!(owns_config(&handed[2]));
        assert_eq!(config_owners(&handed), vec![gone]);
    }

    #[test]
    fn the_bench_writes_only_over_what_it_expects_there() {
        let (chart, switched, edited) = ("a: 1\n", "a: 2\n", "a: 3\n");
        // The first switch expects the config read at the start.
        assert!(unchanged(Some(chart), None, Some(chart)));
        assert!(!unchanged(Some(edited), None, Some(chart)));
        // Later switches and the restore expect the bench's last write.
        assert!(unchanged(Some(switched), Some(switched), Some(chart)));
        assert!(unchanged(Some(switched), Some(switched), None));
        assert!(!unchanged(Some(edited), Some(switched), Some(chart)));
        assert!(!unchanged(Some(edited), Some(switched), None));
        assert!(!unchanged(None, Some(switched), None), "the key removed");
        // Left by a bench that kept no record of its writes: restored.
        assert!(unchanged(Some(edited), None, None));
    }

    #[test]
    fn an_empty_config_gets_the_vxlan_key() {
        let off = with_offload_disabled("", true).unwrap();
        assert!(offload_disabled(&off).unwrap(), "{off}");
    }
}

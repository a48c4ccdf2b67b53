//! A Pod's volumes on this machine.
//!
//! `configMap`, `secret`, `downwardAPI` and `projected` volumes are
//! directories written the way kubelet's atomic writer writes them: the files
//! in a timestamped directory `..<time>`, a symlink `..data` to it, and one
//! symlink per top-level name into `..data`; an update writes a new
//! directory and swaps `..data` with a rename, so a reader never sees half
//! of an update (ServiceAccount tokens are refreshed this way). `emptyDir`
//! is an empty directory (mode 0777). `hostPath` is the node's: each lab
//! node has a directory of its own for host paths, except for the
//! machine's kernel interfaces (`/proc`, `/sys`, `/dev`, `/lib/modules`),
//! which are the real ones, and `/sys/fs/bpf`, which is a bpf filesystem
//! of the node's own (eBPF state pinned there is per node, as on a real
//! one; `lab down` unmounts it).
//!
//! Everything lives under the Pod's directory in the lab (`kubelet/pods/<uid>`)
//! or the node's (`kubelet/nodes/<node>`), never elsewhere on the machine.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{
    DownwardAPIVolumeFile, KeyToPath, Pod, ServiceAccountTokenProjection, Volume,
};

use super::env::{Objects, PodFacts, Source, format_map};

/// The mode of a file a volume does not give one for (0644, kubelet's default).
const DEFAULT_MODE: u32 = 0o644;
/// The bpf filesystem: each node has one of its own.
const BPF_FS: &str = "/sys/fs/bpf";

/// Where `path` under the node's bpf filesystem is, for a node whose host
/// paths are in `node_root`.
pub fn node_bpf_path(node_root: &Path, path: &str) -> PathBuf {
    node_root
        .join(BPF_FS.trim_start_matches('/'))
        .join(path.trim_start_matches('/'))
}
/// Host paths that are the machine's own, not the node's.
const MACHINE_PATHS: [&str; 5] = ["/proc", "/sys", "/dev", "/lib/modules", "/usr/lib/modules"];

/// The files of a volume: relative path -> (contents, mode).
pub type Payload = BTreeMap<String, (Vec<u8>, u32)>;

/// The tokens a Pod's projected volumes hold: (volume, source index) -> token.
pub type Tokens = BTreeMap<(String, usize), String>;

/// What a volume needs before it can be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Files the lab writes (configMap, secret, downwardAPI, projected).
    Files,
    EmptyDir,
    /// A path on the node: `(path, type)`.
    HostPath(String, String),
    /// Anything else (persistent volumes, CSI, ...): not supported.
    Unsupported(&'static str),
}

pub fn kind(volume: &Volume) -> Kind {
    if volume.config_map.is_some()
        || volume.secret.is_some()
        || volume.downward_api.is_some()
        || volume.projected.is_some()
    {
        Kind::Files
    } else if volume.empty_dir.is_some() {
        Kind::EmptyDir
    } else if let Some(host) = &volume.host_path {
        Kind::HostPath(host.path.clone(), host.type_.clone().unwrap_or_default())
    } else if volume.persistent_volume_claim.is_some() {
        Kind::Unsupported("persistentVolumeClaim")
    } else if volume.csi.is_some() {
        Kind::Unsupported("csi")
    } else {
        Kind::Unsupported("this volume type")
    }
}

/// The ServiceAccount token projections of a Pod: (volume, source index, projection).
pub fn token_projections(pod: &Pod) -> Vec<(String, usize, ServiceAccountTokenProjection)> {
    let volumes = pod.spec.iter().flat_map(|s| s.volumes.iter().flatten());
    volumes
        .filter_map(|v| Some((v.name.clone(), v.projected.as_ref()?)))
        .flat_map(|(name, projected)| {
            let sources = projected.sources.iter().flatten().enumerate();
            sources
                .filter_map(|(i, s)| Some((name.clone(), i, s.service_account_token.clone()?)))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The names of the ConfigMaps and Secrets a Pod's volumes and
/// environments refer to.
pub fn references(pod: &Pod) -> (Vec<String>, Vec<String>) {
    let (mut cms, mut secrets) = (Vec::new(), Vec::new());
    let Some(spec) = &pod.spec else {
        return (cms, secrets);
    };
    for v in spec.volumes.iter().flatten() {
        cms.extend(v.config_map.as_ref().map(|c| c.name.clone()));
        secrets.extend(v.secret.as_ref().and_then(|s| s.secret_name.clone()));
        for s in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
            cms.extend(s.config_map.as_ref().map(|c| c.name.clone()));
            secrets.extend(s.secret.as_ref().map(|c| c.name.clone()));
        }
    }
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    for c in containers {
        for from in c.env_from.iter().flatten() {
            cms.extend(from.config_map_ref.as_ref().map(|r| r.name.clone()));
            secrets.extend(from.secret_ref.as_ref().map(|r| r.name.clone()));
        }
        for from in c.env.iter().flatten().filter_map(|e| e.value_from.as_ref()) {
            cms.extend(from.config_map_key_ref.as_ref().map(|r| r.name.clone()));
            secrets.extend(from.secret_key_ref.as_ref().map(|r| r.name.clone()));
        }
    }
    for list in [&mut cms, &mut secrets] {
        list.sort();
        list.dedup();
    }
    (cms, secrets)
}

/// The files of a `configMap`, `secret`, `downwardAPI` or `projected`
/// volume. A missing ConfigMap, Secret or key that is not optional is an
/// error naming it.
pub fn payload(
    volume: &Volume,
    facts: &PodFacts<'_>,
    objects: &Objects,
    tokens: &Tokens,
) -> anyhow::Result<Payload> {
    let mut files = Payload::new();
    let mut add = |source, name: &str, optional, items: &Option<Vec<KeyToPath>>, mode| {
        let keys = Keys {
            source,
            name,
            optional: optional == Some(true),
            items: items.as_deref(),
            mode,
        };
        project(&mut files, objects, &keys)
    };
    let mode_or_default = |mode: Option<i32>| mode.map_or(DEFAULT_MODE, mode_bits);
    if let Some(cm) = &volume.config_map {
        let mode = mode_or_default(cm.default_mode);
        add(Source::ConfigMap, &cm.name, cm.optional, &cm.items, mode)?;
    }
    if let Some(secret) = &volume.secret {
        let name = secret.secret_name.clone().unwrap_or_default();
        let mode = mode_or_default(secret.default_mode);
        add(Source::Secret, &name, secret.optional, &secret.items, mode)?;
    }
    let mode = mode_or_default(volume.projected.as_ref().and_then(|p| p.default_mode));
    let sources = volume
        .projected
        .iter()
        .flat_map(|p| p.sources.iter().flatten());
    for source in sources.clone() {
        if let Some(cm) = &source.config_map {
            add(Source::ConfigMap, &cm.name, cm.optional, &cm.items, mode)?;
        }
        if let Some(secret) = &source.secret {
            add(
                Source::Secret,
                &secret.name,
                secret.optional,
                &secret.items,
                mode,
            )?;
        }
    }
    for (i, source) in sources.enumerate() {
        if let Some(token) = &source.service_account_token {
            let value = tokens
                .get(&(volume.name.clone(), i))
                .with_context(|| format!("no token requested for {}", token.path))?;
            files.insert(token.path.clone(), (value.clone().into_bytes(), mode));
        }
        if let Some(downward) = &source.downward_api {
            downward_files(&mut files, facts, downward.items.iter().flatten(), mode)?;
        }
    }
    if let Some(downward) = &volume.downward_api {
        let mode = mode_or_default(downward.default_mode);
        downward_files(&mut files, facts, downward.items.iter().flatten(), mode)?;
    }
    for path in files.keys() {
        check_relative(path)?;
    }
    Ok(files)
}

/// The keys of one ConfigMap or Secret a volume projects.
#[derive(Debug)]
struct Keys<'a> {
    source: Source,
    name: &'a str,
    optional: bool,
    /// The keys to project and where (all keys, at their names, if none).
    items: Option<&'a [KeyToPath]>,
    mode: u32,
}

/// The API gives modes as decimal or octal numbers in an i32.
fn mode_bits(mode: i32) -> u32 {
    u32::try_from(mode).unwrap_or(DEFAULT_MODE) & 0o7777
}

/// Adds the keys of a ConfigMap or Secret to `files`.
fn project(files: &mut Payload, objects: &Objects, keys: &Keys<'_>) -> anyhow::Result<()> {
    let what = format!("{} {:?}", keys.source, keys.name);
    let Some(mut entries) = objects.entries(keys.source, keys.name) else {
        ensure!(keys.optional, "{what} not found");
        return Ok(());
    };
    match keys.items {
        None | Some([]) => {
            for (key, data) in entries {
                files.insert(key, (data, keys.mode));
            }
        }
        Some(items) => {
            for item in items {
                match entries.remove(&item.key) {
                    Some(data) => {
                        let mode = item.mode.map_or(keys.mode, mode_bits);
                        files.insert(item.path.clone(), (data, mode));
                    }
                    None if keys.optional => {}
                    None => bail!("{what} has no key {:?}", item.key),
                }
            }
        }
    }
    Ok(())
}

fn downward_files<'a>(
    files: &mut Payload,
    facts: &PodFacts<'_>,
    items: impl Iterator<Item = &'a DownwardAPIVolumeFile>,
    mode: u32,
) -> anyhow::Result<()> {
    for item in items {
        let value = if let Some(field) = &item.field_ref {
            match field.field_path.as_str() {
                "metadata.labels" => format_map(facts.pod.metadata.labels.as_ref()),
                "metadata.annotations" => format_map(facts.pod.metadata.annotations.as_ref()),
                path => facts.field(path)?,
            }
        } else if let Some(r) = &item.resource_field_ref {
            let spec = facts.pod.spec.as_ref().context("the pod has no spec")?;
            let name = r.container_name.as_deref().unwrap_or_default();
            let container = spec
                .containers
                .iter()
                .find(|c| c.name == name)
                .with_context(|| format!("downwardAPI {}: no container {name:?}", item.path))?;
            let divisor = r.divisor.as_ref().map(|d| d.0.as_str());
            facts.resource(container, &r.resource, divisor)?
        } else {
            bail!(
                "downwardAPI {}: neither fieldRef nor resourceFieldRef",
                item.path
            );
        };
        let item_mode = item.mode.map_or(mode, mode_bits);
        files.insert(item.path.clone(), (value.into_bytes(), item_mode));
    }
    Ok(())
}

/// A file path inside a volume: relative, without `..`.
fn check_relative(path: &str) -> anyhow::Result<()> {
    let p = Path::new(path);
    let ok = !path.is_empty()
        && p.components().all(|c| matches!(c, Component::Normal(_)))
        && !path.starts_with("..");
    ensure!(
        ok,
        "volume file path {path:?} must be relative, without '..'"
    );
    Ok(())
}

/// Writes `files` into `dir` as kubelet's atomic writer does; a `group`
/// (the Pod's `fsGroup`) owns the files and may read them.
pub fn write_atomic(dir: &Path, files: &Payload, group: Option<u32>) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let data_dir_name = format!("..{}_{:09}", stamp.as_secs(), stamp.subsec_nanos());
    let data_dir = dir.join(&data_dir_name);
    fs::create_dir(&data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    for (path, (data, mode)) in files {
        let file = data_dir.join(path);
        if let Some(parent) = file.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        fs::write(&file, data).with_context(|| format!("writing {}", file.display()))?;
        let mut mode = *mode;
        if let Some(gid) = group {
            chgrp(&file, gid)?;
            mode |= 0o040;
        }
        fs::set_permissions(&file, fs::Permissions::from_mode(mode))
            .with_context(|| format!("setting the mode of {}", file.display()))?;
    }
    fs::set_permissions(&data_dir, fs::Permissions::from_mode(0o755))?;
    let tmp = dir.join("..data_tmp");
    let _ = fs::remove_file(&tmp);
    symlink(&data_dir_name, &tmp).with_context(|| format!("linking {}", tmp.display()))?;
    fs::rename(&tmp, dir.join("..data")).context("swapping ..data")?;
    let top: Vec<String> = files
        .keys()
        .filter_map(|p| p.split('/').next().map(str::to_owned))
        .collect();
    for name in &top {
        let link = dir.join(name);
        if fs::symlink_metadata(&link).is_err() {
            symlink(Path::new("..data").join(name), &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    remove_stale(dir, &data_dir_name, &top)
}

/// Removes older data directories and links to names no longer there.
fn remove_stale(dir: &Path, keep: &str, top: &[String]) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir)?.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == keep || name == "..data" {
            continue;
        }
        let path = entry.path();
        if name.starts_with("..") {
            let _ = fs::remove_dir_all(&path);
        } else if !top.contains(&name) {
            let _ = fs::remove_file(&path);
        }
    }
    Ok(())
}

fn chgrp(path: &Path, gid: u32) -> anyhow::Result<()> {
    nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
        .with_context(|| format!("giving {} to group {gid}", path.display()))
}

/// An `emptyDir`: a directory anyone in the Pod may write, as kubelet makes it.
pub fn empty_dir(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o777))
        .with_context(|| format!("opening up {}", dir.display()))
}

/// The source of a `hostPath` volume on `node_root` (the node's directory
/// for host paths), created as its `type` asks. Kernel interfaces are the
/// machine's own and are never created.
pub fn host_path(node_root: &Path, path: &str, type_: &str) -> anyhow::Result<PathBuf> {
    ensure!(path.starts_with('/'), "hostPath {path:?} is not absolute");
    check_relative(path.trim_start_matches('/')).or_else(|_| {
        ensure!(path == "/", "hostPath {path:?} contains '..'");
        Ok(())
    })?;
    if let Some(rest) = path.strip_prefix(BPF_FS)
        && (rest.is_empty() || rest.starts_with('/'))
    {
        let mount = node_bpf_path(node_root, "");
        node_bpffs(&mount)?;
        return Ok(mount.join(rest.trim_start_matches('/')));
    }
    let machine = MACHINE_PATHS
        .iter()
        .any(|m| path == *m || path.starts_with(&format!("{m}/")));
    if machine {
        let real = PathBuf::from(path);
        ensure!(real.exists(), "hostPath {path}: not on this machine");
        return Ok(real);
    }
    let local = node_root.join(path.trim_start_matches('/'));
    match type_ {
        "" | "DirectoryOrCreate" if !local.exists() => {
            fs::create_dir_all(&local).with_context(|| format!("creating {}", local.display()))?;
            fs::set_permissions(&local, fs::Permissions::from_mode(0o755))?;
        }
        "FileOrCreate" if !local.exists() => {
            if let Some(parent) = local.parent() {
                fs::create_dir_all(parent)?;
            }
            fs::write(&local, b"").with_context(|| format!("creating {}", local.display()))?;
            fs::set_permissions(&local, fs::Permissions::from_mode(0o644))?;
        }
        "Directory" => ensure!(
            local.is_dir(),
            "hostPath {path}: no such directory on the node"
        ),
        "File" => ensure!(local.is_file(), "hostPath {path}: no such file on the node"),
        _ => {}
    }
    Ok(local)
}

/// Mounts a bpf filesystem at `dir` unless one is there.
fn node_bpffs(dir: &Path) -> anyhow::Result<()> {
    use nix::sys::statfs::{BPF_FS_MAGIC, statfs};
    if statfs(dir).is_ok_and(|fs| fs.filesystem_type() == BPF_FS_MAGIC) {
        return Ok(());
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    nix::mount::mount(
        Some("bpf"),
        dir,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .with_context(|| format!("mounting a bpf filesystem at {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        ConfigMap, ConfigMapProjection, ConfigMapVolumeSource, DownwardAPIProjection,
        ObjectFieldSelector, PodSpec, ProjectedVolumeSource, VolumeProjection,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("p".to_owned()),
                namespace: Some("team-a".to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec::default()),
            status: None,
        }
    }

    fn facts(pod: &Pod) -> PodFacts<'_> {
        PodFacts {
            pod,
            host_ip: String::new(),
            pod_ip: String::new(),
            node_cpu: 1.0,
            node_memory: 1.0,
        }
    }

    fn root_ca() -> Objects {
        let mut objects = Objects::default();
        let data = BTreeMap::from([("ca.crt".to_owned(), "PEM".to_owned())]);
        objects.config_maps.insert(
            "kube-root-ca.crt".to_owned(),
            ConfigMap {
                data: Some(data),
                ..ConfigMap::default()
            },
        );
        objects
    }

    /// The volume the ServiceAccount admission plugin adds to every Pod.
    fn kube_api_access() -> Volume {
        let item = |key: &str| KeyToPath {
            key: key.to_owned(),
            path: key.to_owned(),
            mode: None,
        };
        Volume {
            name: "kube-api-access-abcde".to_owned(),
            projected: Some(ProjectedVolumeSource {
                default_mode: Some(420),
                sources: Some(vec![
                    VolumeProjection {
                        service_account_token: Some(ServiceAccountTokenProjection {
                            audience: None,
                            expiration_seconds: Some(3607),
                            path: "token".to_owned(),
                        }),
                        ..VolumeProjection::default()
                    },
                    VolumeProjection {
                        config_map: Some(ConfigMapProjection {
                            name: "kube-root-ca.crt".to_owned(),
                            items: Some(vec![item("ca.crt")]),
                            optional: None,
                        }),
                        ..VolumeProjection::default()
                    },
                    VolumeProjection {
                        downward_api: Some(DownwardAPIProjection {
                            items: Some(vec![DownwardAPIVolumeFile {
                                path: "namespace".to_owned(),
                                field_ref: Some(ObjectFieldSelector {
                                    field_path: "metadata.namespace".to_owned(),
                                    api_version: Some("v1".to_owned()),
                                }),
                                ..DownwardAPIVolumeFile::default()
                            }]),
                        }),
                        ..VolumeProjection::default()
                    },
                ]),
            }),
            ..Volume::default()
        }
    }

    #[test]
    fn the_service_account_volume_holds_token_ca_and_namespace() {
        let pod = pod();
        let volume = kube_api_access();
        let tokens = Tokens::from([(("kube-api-access-abcde".to_owned(), 0), "jwt".to_owned())]);
        let files = payload(&volume, &facts(&pod), &root_ca(), &tokens).unwrap();
        let text = |k: &str| String::from_utf8(files[k].0.clone()).unwrap();
        assert_eq!(text("token"), "jwt");
        assert_eq!(text("ca.crt"), "PEM");
        assert_eq!(text("namespace"), "team-a");
        assert!(files.values().all(|(_, mode)| *mode == 0o644));
    }

    #[test]
    fn a_missing_root_ca_configmap_fails_the_volume() {
        let pod = pod();
        let tokens = Tokens::from([(("kube-api-access-abcde".to_owned(), 0), "jwt".to_owned())]);
        let err = payload(
            &kube_api_access(),
            &facts(&pod),
            &Objects::default(),
            &tokens,
        );
        assert!(err.unwrap_err().to_string().contains("kube-root-ca.crt"));
    }

    #[test]
    fn configmap_items_choose_keys_paths_and_modes() {
        let pod = pod();
        let volume = Volume {
            name: "config".to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: "kube-root-ca.crt".to_owned(),
                default_mode: Some(0o600),
                items: Some(vec![KeyToPath {
                    key: "ca.crt".to_owned(),
                    path: "certs/ca.pem".to_owned(),
                    mode: Some(0o400),
                }]),
                optional: None,
            }),
            ..Volume::default()
        };
        let files = payload(&volume, &facts(&pod), &root_ca(), &Tokens::new()).unwrap();
        assert_eq!(files["certs/ca.pem"], (b"PEM".to_vec(), 0o400));
        assert_eq!(files.len(), 1);
    }

    #[test]
    fn paths_leaving_the_volume_are_refused() {
        assert!(check_relative("../etc/passwd").is_err());
        assert!(check_relative("/etc/passwd").is_err());
        assert!(check_relative("a/../../b").is_err());
        assert!(check_relative("..data").is_err());
        assert!(check_relative("a/b.txt").is_ok());
    }

    #[test]
    fn token_projections_are_found_by_volume_and_index() {
        let mut pod = pod();
        if let Some(spec) = pod.spec.as_mut() {
            spec.volumes = Some(vec![kube_api_access()]);
        }
        let found = token_projections(&pod);
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].0.as_str(), found[0].1),
            ("kube-api-access-abcde", 0)
        );
        assert_eq!(found[0].2.expiration_seconds, Some(3607));
        assert_eq!(references(&pod).0, ["kube-root-ca.crt"]);
    }

    #[test]
    fn an_update_swaps_the_data_and_drops_old_names() {
        let dir = std::env::temp_dir().join(format!("egressgw-volume-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let first = Payload::from([
            ("token".to_owned(), (b"one".to_vec(), 0o644)),
            ("old".to_owned(), (b"x".to_vec(), 0o644)),
        ]);
        write_atomic(&dir, &first, None).unwrap();
        assert_eq!(fs::read(dir.join("token")).unwrap(), b"one");
        let second = Payload::from([("token".to_owned(), (b"two".to_vec(), 0o600))]);
        write_atomic(&dir, &second, None).unwrap();
        assert_eq!(fs::read(dir.join("token")).unwrap(), b"two");
        assert!(fs::symlink_metadata(dir.join("old")).is_err());
        let data_dirs = fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                let name = name.to_string_lossy();
                name.starts_with("..") && name != "..data"
            })
            .count();
        assert_eq!(data_dirs, 1);
        let mode = fs::metadata(dir.join("token"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn host_paths_live_under_the_node_except_kernel_interfaces() {
        let root =
            std::env::temp_dir().join(format!("egressgw-hostpath-test-{}", std::process::id()));
        let local = host_path(&root, "/var/run/egressgw", "DirectoryOrCreate").unwrap();
        assert_eq!(local, root.join("var/run/egressgw"));
        assert!(local.is_dir());
        assert_eq!(
            host_path(&root, "/proc", "").unwrap(),
            PathBuf::from("/proc")
        );
        assert!(host_path(&root, "/missing", "Directory").is_err());
        assert!(host_path(&root, "/a/../b", "").is_err());
        fs::remove_dir_all(&root).unwrap();
    }
}

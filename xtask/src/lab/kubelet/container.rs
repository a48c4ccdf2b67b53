//! What the lab's container runtime is asked to run: a [`RuntimeSpec`],
//! computed from a Pod's container (pure), then carried out by the shim
//! ([`super::shim`]). It plays the part of an OCI runtime config.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, ensure};
use k8s_openapi::api::core::v1::{Container, PodSecurityContext, SecurityContext};
use serde::{Deserialize, Serialize};

use super::caps;
use super::env::{Env, Objects, PodFacts, container_env};
use crate::lab::images::Image;

/// The `PATH` of a container whose Pod sets none (a typical image's).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One container, ready to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSpec {
    /// `namespace/pod/container`, for messages.
    pub name: String,
    /// The network namespace (`/run/netns/<netns>`): the node's for
    /// `hostNetwork`, the Pod's otherwise.
    pub netns: String,
    /// The UTS hostname (the Pod's, or the node's for `hostNetwork`).
    pub hostname: String,
    /// Volume mounts, parents before children.
    pub mounts: Vec<MountSpec>,
    /// `readOnlyRootFilesystem`: everything but the volumes and the kernel
    /// interfaces (`/proc`, `/sys`, `/dev`) is read-only.
    pub read_only_root: bool,
    /// `privileged`: every capability, `/sys` and `/proc` writable.
    pub privileged: bool,
    pub working_dir: Option<String>,
    /// An empty directory of the lab, for mirroring `/` when a `mountPath`
    /// needs a top-level directory the machine does not have.
    #[serde(default)]
    pub scratch: Option<PathBuf>,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (`supplementalGroups` and `fsGroup`).
    pub groups: Vec<u32>,
    /// The bounding (and, for root, permitted and effective) capability set.
    pub capabilities: Vec<String>,
    /// `allowPrivilegeEscalation: false`.
    pub no_new_privs: bool,
    /// The program (a path on this machine) and its arguments.
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// A volume mounted into a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountSpec {
    /// The volume's directory (or file, with `subPath`) on this machine.
    pub source: PathBuf,
    /// The `mountPath`.
    pub target: String,
    pub read_only: bool,
}

/// A Pod's volume as the runtime mounts it.
#[derive(Debug, Clone)]
pub struct VolumeSource {
    pub path: PathBuf,
    /// Files the lab writes (ConfigMap, Secret, downward API, projected):
    /// always mounted read-only, as kubelet does.
    pub read_only: bool,
}

/// Everything a container's spec is computed from.
#[derive(Debug)]
pub struct Input<'a> {
    pub facts: &'a PodFacts<'a>,
    pub objects: &'a Objects,
    pub container: &'a Container,
    pub image: &'a Image,
    pub volumes: &'a BTreeMap<String, VolumeSource>,
    pub netns: &'a str,
    pub hostname: &'a str,
    /// The `kubernetes` service variables.
    pub service_env: &'a [(String, String)],
}

/// The spec of one container; an error says why it cannot start
/// (kubelet's `CreateContainerConfigError`).
pub fn runtime_spec(input: &Input<'_>) -> anyhow::Result<RuntimeSpec> {
    let pod = input.facts.pod;
    let c = input.container;
    let pod_context = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let context = c.security_context.as_ref();
    let (uid, gid, groups) = identity(pod_context, context)?;
    let mut base = vec![
        ("PATH".to_owned(), DEFAULT_PATH.to_owned()),
        ("HOSTNAME".to_owned(), input.hostname.to_owned()),
        (
            "HOME".to_owned(),
            if uid == 0 { "/root" } else { "/" }.to_owned(),
        ),
    ];
    base.extend(input.service_env.iter().cloned());
    let env = container_env(input.facts, input.objects, c, &base)?;
    let command = expand_all(&env, c.command.as_deref());
    let args = expand_all(&env, c.args.as_deref());
    let argv = input
        .image
        .argv(&command, &args)
        .with_context(|| format!("image {:?}", c.image.clone().unwrap_or_default()))?;
    let capabilities = caps::of(context)?;
    let privileged = context.and_then(|s| s.privileged) == Some(true);
    Ok(RuntimeSpec {
        name: format!(
            "{}/{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default(),
            c.name
        ),
        netns: input.netns.to_owned(),
        hostname: input.hostname.to_owned(),
        mounts: mounts(c, input.volumes, &env)?,
        read_only_root: context.and_then(|s| s.read_only_root_filesystem) == Some(true),
        privileged,
        working_dir: c.working_dir.clone().filter(|d| !d.is_empty()),
        scratch: None,
        uid,
        gid,
        groups,
        capabilities: capabilities.names().map(str::to_owned).collect(),
        no_new_privs: context.and_then(|s| s.allow_privilege_escalation) == Some(false),
        argv,
        env: env.vars().to_vec(),
    })
}

fn expand_all(env: &Env, words: Option<&[String]>) -> Vec<String> {
    words
        .unwrap_or_default()
        .iter()
        .map(|w| env.expand(w))
        .collect()
}

/// uid, gid and supplementary groups: the container's settings over the
/// Pod's; root (the image default) when neither says.
fn identity(
    pod: Option<&PodSecurityContext>,
    container: Option<&SecurityContext>,
) -> anyhow::Result<(u32, u32, Vec<u32>)> {
    let pick = |c: Option<i64>, p: Option<i64>| c.or(p).unwrap_or(0);
    let uid = pick(
        container.and_then(|c| c.run_as_user),
        pod.and_then(|p| p.run_as_user),
    );
    let gid = pick(
        container.and_then(|c| c.run_as_group),
        pod.and_then(|p| p.run_as_group),
    );
    let non_root = container
        .and_then(|c| c.run_as_non_root)
        .or(pod.and_then(|p| p.run_as_non_root))
        == Some(true);
    ensure!(
        !(non_root && uid == 0),
        "container has runAsNonRoot and image will run as root (set runAsUser)"
    );
    let id = |v: i64| u32::try_from(v).with_context(|| format!("{v} is not a valid uid or gid"));
    let mut groups: Vec<u32> = pod
        .and_then(|p| p.supplemental_groups.clone())
        .unwrap_or_default()
        .into_iter()
        .chain(pod.and_then(|p| p.fs_group))
        .map(id)
        .collect::<anyhow::Result<_>>()?;
    groups.sort_unstable();
    groups.dedup();
    Ok((id(uid)?, id(gid)?, groups))
}

/// The container's volume mounts, parents first (as container runtimes
/// order them).
fn mounts(
    c: &Container,
    volumes: &BTreeMap<String, VolumeSource>,
    env: &Env,
) -> anyhow::Result<Vec<MountSpec>> {
    let mut mounts = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        let volume = volumes
            .get(&m.name)
            .with_context(|| format!("volumeMount {:?}: no such volume in the pod", m.name))?;
        let sub_path = match (&m.sub_path, &m.sub_path_expr) {
            (Some(p), _) if !p.is_empty() => p.clone(),
            (_, Some(expr)) if !expr.is_empty() => env.expand(expr),
            _ => String::new(),
        };
        ensure!(
            !sub_path.starts_with('/') && !sub_path.split('/').any(|part| part == ".."),
            "volumeMount {:?}: subPath {sub_path:?} must stay inside the volume",
            m.name
        );
        ensure!(
            m.mount_path.starts_with('/'),
            "volumeMount {:?}: mountPath {:?} is not absolute",
            m.name,
            m.mount_path
        );
        let source = if sub_path.is_empty() {
            volume.path.clone()
        } else {
            volume.path.join(&sub_path)
        };
        mounts.push(MountSpec {
            source,
            target: m.mount_path.clone(),
            read_only: volume.read_only || m.read_only == Some(true),
        });
    }
    mounts.sort_by_key(|m| m.target.trim_end_matches('/').matches('/').count());
    Ok(mounts)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{Capabilities, EnvVar, Pod, PodSpec, VolumeMount};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pod(context: Option<PodSecurityContext>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("agent-x1".to_owned()),
                namespace: Some("egressgw-system".to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                security_context: context,
                node_name: Some("node-1".to_owned()),
                ..PodSpec::default()
            }),
            status: None,
        }
    }

    fn agent() -> Container {
        Container {
            name: "agent".to_owned(),
            image: Some("egressgw:test".to_owned()),
            args: Some(vec!["agent".to_owned(), "--node=$(NODE_NAME)".to_owned()]),
            env: Some(vec![EnvVar {
                name: "NODE_NAME".to_owned(),
                value: Some("node-1".to_owned()),
                value_from: None,
            }]),
            security_context: Some(SecurityContext {
                capabilities: Some(Capabilities {
                    add: Some(vec!["NET_ADMIN".to_owned(), "NET_RAW".to_owned()]),
                    drop: Some(vec!["ALL".to_owned()]),
                }),
                read_only_root_filesystem: Some(true),
                allow_privilege_escalation: Some(false),
                ..SecurityContext::default()
            }),
            volume_mounts: Some(vec![
                VolumeMount {
                    name: "config".to_owned(),
                    mount_path: "/etc/egressgw/extra".to_owned(),
                    ..VolumeMount::default()
                },
                VolumeMount {
                    name: "scratch".to_owned(),
                    mount_path: "/etc/egressgw".to_owned(),
                    sub_path: Some("etc".to_owned()),
                    ..VolumeMount::default()
                },
            ]),
            ..Container::default()
        }
    }

    fn spec_of(pod: &Pod, container: &Container) -> anyhow::Result<RuntimeSpec> {
        let facts = PodFacts {
            pod,
            host_ip: "172.18.0.11".to_owned(),
            pod_ip: "172.18.0.11".to_owned(),
            node_cpu: 2.0,
            node_memory: 1e9,
        };
        let image = Image::of_binary(
            std::path::Path::new("/lab/egressgw"),
            "/usr/local/bin/egressgw",
        );
        let volumes = BTreeMap::from([
            (
                "config".to_owned(),
                VolumeSource {
                    path: PathBuf::from("/lab/pods/u/volumes/config"),
                    read_only: true,
                },
            ),
            (
                "scratch".to_owned(),
                VolumeSource {
                    path: PathBuf::from("/lab/pods/u/volumes/scratch"),
                    read_only: false,
                },
            ),
        ]);
        let service = super::super::env::kubernetes_service("172.18.0.2", 6443);
        runtime_spec(&Input {
            facts: &facts,
            objects: &Objects::default(),
            container,
            image: &image,
            volumes: &volumes,
            netns: "egk-node-1",
            hostname: "node-1",
            service_env: &service,
        })
    }

    #[test]
    fn an_unprivileged_agent_gets_only_the_capabilities_it_asks_for() {
        let spec = spec_of(&pod(None), &agent()).unwrap();
        assert_eq!(spec.capabilities, ["NET_ADMIN", "NET_RAW"]);
        assert!(spec.read_only_root && spec.no_new_privs && !spec.privileged);
        assert_eq!((spec.uid, spec.gid), (0, 0));
        assert_eq!(spec.argv, ["/lab/egressgw", "agent", "--node=node-1"]);
        assert_eq!(spec.name, "egressgw-system/agent-x1/agent");
    }

    #[test]
    fn mounts_come_parents_first_with_sub_paths_and_read_only_files() {
        let spec = spec_of(&pod(None), &agent()).unwrap();
        let targets: Vec<&str> = spec.mounts.iter().map(|m| m.target.as_str()).collect();
        assert_eq!(targets, ["/etc/egressgw", "/etc/egressgw/extra"]);
        assert_eq!(
            spec.mounts[0].source,
            PathBuf::from("/lab/pods/u/volumes/scratch/etc")
        );
        assert!(!spec.mounts[0].read_only && spec.mounts[1].read_only);
    }

    #[test]
    fn the_environment_has_the_api_server_defaults_and_the_pods_values() {
        let spec = spec_of(&pod(None), &agent()).unwrap();
        let get = |k: &str| {
            spec.env
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("KUBERNETES_SERVICE_HOST"), Some("172.18.0.2"));
        assert_eq!(get("NODE_NAME"), Some("node-1"));
        assert_eq!(get("HOSTNAME"), Some("node-1"));
        assert_eq!(get("HOME"), Some("/root"));
        assert!(get("PATH").is_some());
    }

    #[test]
    fn the_containers_user_wins_over_the_pods_and_groups_are_merged() {
        let pod_context = PodSecurityContext {
            run_as_user: Some(1000),
            run_as_group: Some(1000),
            supplemental_groups: Some(vec![5, 6]),
            fs_group: Some(2000),
            ..PodSecurityContext::default()
        };
        let mut container = agent();
        if let Some(sc) = container.security_context.as_mut() {
            sc.run_as_user = Some(65534);
        }
        let spec = spec_of(&pod(Some(pod_context)), &container).unwrap();
        assert_eq!(
            (spec.uid, spec.gid, spec.groups.clone()),
            (65534, 1000, vec![5, 6, 2000])
        );
        let env_home = spec
            .env
            .iter()
            .find(|(n, _)| n == "HOME")
            .map(|(_, v)| v.clone());
        assert_eq!(env_home.as_deref(), Some("/"));
    }

    #[test]
    fn run_as_non_root_refuses_root() {
        let mut container = agent();
        if let Some(sc) = container.security_context.as_mut() {
            sc.run_as_non_root = Some(true);
        }
        let err = spec_of(&pod(None), &container).unwrap_err().to_string();
        assert!(err.contains("runAsNonRoot"), "{err}");
    }

    #[test]
    fn a_sub_path_leaving_its_volume_is_refused() {
        let mut container = agent();
        if let Some(mounts) = container.volume_mounts.as_mut() {
            mounts[1].sub_path = Some("../../etc".to_owned());
        }
        assert!(spec_of(&pod(None), &container).is_err());
    }

    #[test]
    fn a_mount_of_a_volume_the_pod_lacks_names_it() {
        let mut container = agent();
        if let Some(mounts) = container.volume_mounts.as_mut() {
            mounts[0].name = "nope".to_owned();
        }
        let err = spec_of(&pod(None), &container).unwrap_err().to_string();
        assert!(err.contains("\"nope\""), "{err}");
    }
}

//! A container's environment and command line as kubelet computes them:
//! the `kubernetes` service variables, `envFrom`, then `env` (downward-API
//! `fieldRef` and `resourceFieldRef`, ConfigMap and Secret keys), each value
//! expanded with `$(VAR)` against what came before; then `command` and
//! `args` expanded against the result.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, Pod, Secret};

use super::quantity::Quantity;

/// What a Pod's downward API can see, besides its spec.
#[derive(Debug, Clone)]
pub struct PodFacts<'a> {
    pub pod: &'a Pod,
    pub host_ip: String,
    pub pod_ip: String,
    /// The node's allocatable cpu (cores) and memory (bytes): the value of
    /// a limit that is not set.
    pub node_cpu: f64,
    pub node_memory: f64,
}

/// The ConfigMaps and Secrets of the Pod's namespace that it refers to, as
/// fetched; absent ones are missing.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    pub config_maps: BTreeMap<String, ConfigMap>,
    pub secrets: BTreeMap<String, Secret>,
}

/// Which kind of object holds keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    ConfigMap,
    Secret,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::ConfigMap => "configmap",
            Self::Secret => "secret",
        })
    }
}

impl Objects {
    /// Every key of ConfigMap or Secret `name` with its value (text and
    /// binary data alike); `None` if there is no such object.
    pub fn entries(&self, source: Source, name: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        match source {
            Source::ConfigMap => {
                let cm = self.config_maps.get(name)?;
                let text = cm
                    .data
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()));
                let binary = cm
                    .binary_data
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.0.clone()));
                Some(text.chain(binary).collect())
            }
            Source::Secret => {
                let secret = self.secrets.get(name)?;
                let text = secret
                    .string_data
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()));
                let data = secret
                    .data
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.0.clone()));
                Some(text.chain(data).collect())
            }
        }
    }

    /// The value of `key` in ConfigMap or Secret `name`.
    pub fn key(&self, source: Source, name: &str, key: &str) -> Option<Vec<u8>> {
        self.entries(source, name)?.remove(key)
    }
}

impl PodFacts<'_> {
    fn metadata_map(&self, which: &str) -> Option<&BTreeMap<String, String>> {
        match which {
            "labels" => self.pod.metadata.labels.as_ref(),
            _ => self.pod.metadata.annotations.as_ref(),
        }
    }

    /// The value of a downward-API field path (`metadata.name`,
    /// `metadata.labels['app']`, `status.podIP`, ...).
    pub fn field(&self, path: &str) -> anyhow::Result<String> {
        let meta = &self.pod.metadata;
        let spec = self.pod.spec.as_ref();
        let value = match path {
            "metadata.name" => meta.name.clone(),
            "metadata.namespace" => meta.namespace.clone(),
            "metadata.uid" => meta.uid.clone(),
            "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
            "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
            "status.hostIP" | "status.hostIPs" => Some(self.host_ip.clone()),
            "status.podIP" | "status.podIPs" => Some(self.pod_ip.clone()),
            "metadata.labels" | "metadata.annotations" => {
                let which = path.trim_start_matches("metadata.");
                Some(format_map(self.metadata_map(which)))
            }
            other => {
                let Some((which, key)) = subscript(other) else {
                    bail!("unsupported fieldRef {other:?}");
                };
                self.metadata_map(which).and_then(|m| m.get(key)).cloned()
            }
        };
        Ok(value.unwrap_or_default())
    }

    /// The value of a `resourceFieldRef` of `container` (`limits.cpu`,
    /// `requests.memory`, ...), divided by `divisor` and rounded up.
    pub fn resource(
        &self,
        container: &Container,
        resource: &str,
        divisor: Option<&str>,
    ) -> anyhow::Result<String> {
        let (kind, name) = resource
            .split_once('.')
            .with_context(|| format!("unsupported resourceFieldRef {resource:?}"))?;
        let resources = container.resources.as_ref();
        let limits = resources.and_then(|r| r.limits.as_ref());
        let requests = resources.and_then(|r| r.requests.as_ref());
        let set = match kind {
            "limits" => limits.and_then(|l| l.get(name)),
            "requests" => requests
                .and_then(|r| r.get(name))
                .or(limits.and_then(|l| l.get(name))),
            _ => bail!("unsupported resourceFieldRef {resource:?}"),
        };
        let cpu = name == "cpu";
        let value = match set {
            Some(q) => Quantity::parse(&q.0)?,
            // No limit: the node's allocatable, as kubelet reports it.
            None if kind == "limits" && cpu => Quantity::parse(&self.node_cpu.to_string())?,
            None if kind == "limits" => Quantity::parse(&self.node_memory.to_string())?,
            None => Quantity::parse("0")?,
        };
        let divisor = Quantity::parse(divisor.unwrap_or("1"))?;
        Ok(value.divided_by(divisor, cpu)?.to_string())
    }
}

/// `labels['key']` -> (`labels`, `key`).
fn subscript(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("metadata.")?;
    let (which, key) = rest.split_once("['")?;
    let key = key.strip_suffix("']")?;
    matches!(which, "labels" | "annotations").then_some((which, key))
}

/// Labels or annotations as the downward API writes them: `k="v"` lines, sorted.
pub fn format_map(map: Option<&BTreeMap<String, String>>) -> String {
    map.into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v:?}\n"))
        .collect()
}

/// Expands `$(VAR)` with `vars`; `$$` is a literal `$`; an undefined
/// variable is left as written (Kubernetes' rules).
pub fn expand(text: &str, vars: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match vars(name) {
                Some(value) => out.push_str(&value),
                None => out.push_str(&format!("$({name})")),
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// An ordered environment where a later value replaces an earlier one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Env(Vec<(String, String)>);

impl Env {
    pub fn set(&mut self, name: &str, value: String) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value,
            None => self.0.push((name.to_owned(), value)),
        }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn vars(&self) -> &[(String, String)] {
        &self.0
    }

    /// Expands `$(VAR)` references with this environment.
    pub fn expand(&self, text: &str) -> String {
        expand(text, &|name| self.get(name).map(str::to_owned))
    }
}

/// The environment of `container`: `base` (the `kubernetes` service
/// variables), then `envFrom`, then `env`. A reference to a missing
/// ConfigMap, Secret or key that is not optional is an error naming it.
pub fn container_env(
    facts: &PodFacts<'_>,
    objects: &Objects,
    container: &Container,
    base: &[(String, String)],
) -> anyhow::Result<Env> {
    let mut env = Env::default();
    for (name, value) in base {
        env.set(name, value.clone());
    }
    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        let config_map = from
            .config_map_ref
            .as_ref()
            .map(|r| (Source::ConfigMap, &r.name, r.optional));
        let secret = from
            .secret_ref
            .as_ref()
            .map(|r| (Source::Secret, &r.name, r.optional));
        for (source, name, optional) in config_map.into_iter().chain(secret) {
            let Some(entries) = objects.entries(source, name) else {
                if optional == Some(true) {
                    continue;
                }
                bail!("{source} {name:?} not found");
            };
            for (k, v) in entries {
                env.set(
                    &format!("{prefix}{k}"),
                    String::from_utf8_lossy(&v).into_owned(),
                );
            }
        }
    }
    for var in container.env.iter().flatten() {
        if let Some(value) = value_of(facts, objects, container, var, &env)? {
            env.set(&var.name, value);
        }
    }
    Ok(env)
}

/// One `env` entry's value; `None` for an optional reference that is missing.
fn value_of(
    facts: &PodFacts<'_>,
    objects: &Objects,
    container: &Container,
    var: &EnvVar,
    env: &Env,
) -> anyhow::Result<Option<String>> {
    let Some(from) = &var.value_from else {
        return Ok(Some(env.expand(var.value.as_deref().unwrap_or_default())));
    };
    let context = || format!("env {}", var.name);
    if let Some(field) = &from.field_ref {
        return facts
            .field(&field.field_path)
            .map(Some)
            .with_context(context);
    }
    if let Some(r) = &from.resource_field_ref {
        let target = match r.container_name.as_deref() {
            Some(name) if !name.is_empty() => find_container(facts.pod, name)?,
            _ => container,
        };
        let divisor = r.divisor.as_ref().map(|d| d.0.as_str());
        return facts
            .resource(target, &r.resource, divisor)
            .map(Some)
            .with_context(context);
    }
    let config_map = from
        .config_map_key_ref
        .as_ref()
        .map(|k| (Source::ConfigMap, &k.name, &k.key, k.optional));
    let secret = from
        .secret_key_ref
        .as_ref()
        .map(|k| (Source::Secret, &k.name, &k.key, k.optional));
    if let Some((source, name, key, optional)) = config_map.or(secret) {
        return match objects.key(source, name, key) {
            Some(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
            None if optional == Some(true) => Ok(None),
            None => bail!("{}: key {key:?} of {source} {name:?} not found", context()),
        };
    }
    bail!("{}: unsupported valueFrom", context())
}

fn find_container<'a>(pod: &'a Pod, name: &str) -> anyhow::Result<&'a Container> {
    let spec = pod.spec.as_ref().context("the pod has no spec")?;
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == name)
        .with_context(|| format!("no container {name:?} in the pod"))
}

/// The variables Kubernetes gives every container for the `kubernetes`
/// Service, pointing at the API server as the node reaches it (the lab has
/// no kube-proxy, so the Service's cluster IP leads nowhere).
pub fn kubernetes_service(host: &str, port: u16) -> Vec<(String, String)> {
    let url = format!("tcp://{host}:{port}");
    let prefix = format!("KUBERNETES_PORT_{port}_TCP");
    [
        ("KUBERNETES_SERVICE_HOST".to_owned(), host.to_owned()),
        ("KUBERNETES_SERVICE_PORT".to_owned(), port.to_string()),
        ("KUBERNETES_SERVICE_PORT_HTTPS".to_owned(), port.to_string()),
        ("KUBERNETES_PORT".to_owned(), url.clone()),
        (prefix.clone(), url),
        (format!("{prefix}_PROTO"), "tcp".to_owned()),
        (format!("{prefix}_PORT"), port.to_string()),
        (format!("{prefix}_ADDR"), host.to_owned()),
    ]
    .into()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        EnvVarSource, ObjectFieldSelector, PodSpec, ResourceFieldSelector, ResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity as Q;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("agent-x1".to_owned()),
                namespace: Some("egressgw-system".to_owned()),
                uid: Some("0000-1111".to_owned()),
                labels: Some(BTreeMap::from([("app".to_owned(), "agent".to_owned())])),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-1".to_owned()),
                service_account_name: Some("egressgw-agent".to_owned()),
                ..PodSpec::default()
            }),
            status: None,
        }
    }

    fn facts(pod: &Pod) -> PodFacts<'_> {
        PodFacts {
            pod,
            host_ip: "172.18.0.11".to_owned(),
            pod_ip: "10.244.1.130".to_owned(),
            node_cpu: 2.0,
            node_memory: 8.0 * 1024.0 * 1024.0 * 1024.0,
        }
    }

    fn field_var(name: &str, path: &str) -> EnvVar {
        EnvVar {
            name: name.to_owned(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: path.to_owned(),
                    api_version: None,
                }),
                ..EnvVarSource::default()
            }),
            value: None,
        }
    }

    fn plain(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.to_owned(),
            value: Some(value.to_owned()),
            value_from: None,
        }
    }

    #[test]
    fn downward_api_fields_resolve_from_the_pod_and_its_node() {
        let pod = pod();
        let f = facts(&pod);
        let read = |path: &str| f.field(path).unwrap();
        assert_eq!(read("metadata.name"), "agent-x1");
        assert_eq!(read("metadata.namespace"), "egressgw-system");
        assert_eq!(read("metadata.uid"), "0000-1111");
        assert_eq!(read("spec.nodeName"), "node-1");
        assert_eq!(read("spec.serviceAccountName"), "egressgw-agent");
        assert_eq!(read("status.hostIP"), "172.18.0.11");
        assert_eq!(read("status.podIP"), "10.244.1.130");
        assert_eq!(read("metadata.labels['app']"), "agent");
        assert_eq!(read("metadata.labels"), "app=\"agent\"\n");
        assert!(f.field("spec.containers").is_err());
    }

    #[test]
    fn env_values_expand_earlier_variables_and_keep_unknown_ones() {
        let pod = pod();
        let container = Container {
            name: "agent".to_owned(),
            env: Some(vec![
                field_var("NODE_NAME", "spec.nodeName"),
                plain("WHERE", "$(NODE_NAME)/$(MISSING)/$$(NODE_NAME)"),
            ]),
            ..Container::default()
        };
        let base = kubernetes_service("172.18.0.2", 6443);
        let env = container_env(&facts(&pod), &Objects::default(), &container, &base).unwrap();
        assert_eq!(env.get("NODE_NAME"), Some("node-1"));
        assert_eq!(env.get("WHERE"), Some("node-1/$(MISSING)/$(NODE_NAME)"));
        assert_eq!(env.get("KUBERNETES_SERVICE_HOST"), Some("172.18.0.2"));
        assert_eq!(env.get("KUBERNETES_SERVICE_PORT"), Some("6443"));
    }

    #[test]
    fn expansion_follows_kubernetes_rules() {
        let vars = |name: &str| (name == "A").then(|| "x".to_owned());
        assert_eq!(expand("$(A)-$(B)", &vars), "x-$(B)");
        assert_eq!(expand("$$(A) $$ $", &vars), "$(A) $ $");
        assert_eq!(expand("$(A", &vars), "$(A");
        assert_eq!(expand("no refs", &vars), "no refs");
    }

    #[test]
    fn resource_fields_fall_back_to_the_nodes_allocatable() {
        let pod = pod();
        let f = facts(&pod);
        let mut container = Container::default();
        assert_eq!(f.resource(&container, "limits.cpu", None).unwrap(), "2");
        assert_eq!(
            f.resource(&container, "limits.memory", Some("1Mi"))
                .unwrap(),
            "8192"
        );
        container.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([("cpu".to_owned(), Q("250m".to_owned()))])),
            ..ResourceRequirements::default()
        });
        assert_eq!(
            f.resource(&container, "limits.cpu", Some("1m")).unwrap(),
            "250"
        );
        assert_eq!(
            f.resource(&container, "requests.cpu", Some("1m")).unwrap(),
            "250"
        );
        let _ = ResourceFieldSelector::default();
    }

    #[test]
    fn a_missing_configmap_key_is_an_error_unless_optional() {
        let pod = pod();
        let mut var = EnvVar {
            name: "LEVEL".to_owned(),
            value: None,
            value_from: Some(EnvVarSource {
                config_map_key_ref: Some(k8s_openapi::api::core::v1::ConfigMapKeySelector {
                    name: "cfg".to_owned(),
                    key: "level".to_owned(),
                    optional: None,
                }),
                ..EnvVarSource::default()
            }),
        };
        let container = |var: &EnvVar| Container {
            env: Some(vec![var.clone()]),
            ..Container::default()
        };
        let err = container_env(&facts(&pod), &Objects::default(), &container(&var), &[]);
        assert!(err.unwrap_err().to_string().contains("\"cfg\""));
        if let Some(from) = var.value_from.as_mut()
            && let Some(key) = from.config_map_key_ref.as_mut()
        {
            key.optional = Some(true);
        }
        let env = container_env(&facts(&pod), &Objects::default(), &container(&var), &[]).unwrap();
        assert_eq!(env.get("LEVEL"), None);
        let mut objects = Objects::default();
        objects.config_maps.insert(
            "cfg".to_owned(),
            ConfigMap {
                data: Some(BTreeMap::from([("level".to_owned(), "debug".to_owned())])),
                ..ConfigMap::default()
            },
        );
        let env = container_env(&facts(&pod), &objects, &container(&var), &[]).unwrap();
        assert_eq!(env.get("LEVEL"), Some("debug"));
    }
}

//! Registers the lab in the API as kubelet would: Namespaces, Nodes (with
//! addresses, pod CIDR and a Ready condition) and Pods (bound to their node,
//! Running, with their addresses).
//!
//! Objects go in with one server-side `kubectl apply`, their status with a
//! second one on the status subresource (`--subresource=status`), as kubelet
//! writes it.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde_json::{Value, json};

use super::build::KUBERNETES_VERSION;
use super::kubectl::Kubectl;
use super::topology::{Namespace, Node, Pod, Topology};

/// Field manager of everything the lab writes.
const FIELD_MANAGER: &str = "egressgw-lab";
/// The one container of every lab pod.
const CONTAINER: &str = "app";
/// Never pulled or run: a lab pod is a network namespace, not a container.
const IMAGE: &str = "egressgw-lab/netns:none";

/// Creates the namespaces, nodes and pods, then sets their status.
pub fn register(kubectl: &Kubectl, topo: &Topology) -> anyhow::Result<()> {
    apply(kubectl, &objects(topo), None).context("creating namespaces, nodes and pods")?;
    let node_info = NodeInfo::of_this_machine();
    apply(kubectl, &statuses(topo, &node_info), Some("status"))
        .context("setting the status of nodes and pods")
}

/// Registers one more pod on `node`, as kubelet would: the Pod, then its status.
pub fn register_pod(kubectl: &Kubectl, added: &Pod, node: &Node) -> anyhow::Result<()> {
    apply(kubectl, &pod(added), None)
        .with_context(|| format!("creating pod {}/{}", added.namespace, added.name))?;
    apply(
        kubectl,
        &pod_status(added, &node.ip.to_string()),
        Some("status"),
    )
    .with_context(|| {
        format!(
            "setting the status of pod {}/{}",
            added.namespace, added.name
        )
    })
}

/// Deletes a pod from the API; it is gone at once (grace period 0), and it
/// is no error if it was gone already.
pub fn unregister_pod(kubectl: &Kubectl, gone: &Pod) -> anyhow::Result<()> {
    kubectl
        .run(&[
            "delete",
            "pod",
            "--namespace",
            &gone.namespace,
            &gone.name,
            "--ignore-not-found",
            "--wait=false",
        ])
        .map(drop)
        .with_context(|| format!("deleting pod {}/{}", gone.namespace, gone.name))
}

/// Every object as one `v1` List.
fn objects(topo: &Topology) -> Value {
    let items: Vec<Value> = topo
        .namespaces
        .iter()
        .map(namespace)
        .chain(topo.nodes.iter().map(node))
        .chain(topo.pods.iter().map(pod))
        .collect();
    list(&items)
}

/// The status of every node and pod as one `v1` List.
fn statuses(topo: &Topology, info: &NodeInfo) -> Value {
    let now = rfc3339(SystemTime::now());
    let nodes = topo.nodes.iter().map(|n| node_status(n, info, &now));
    let pods = topo.pods.iter().map(|p| {
        let node = topo.nodes.iter().find(|n| n.name == p.node);
        pod_status(p, &node.map(|n| n.ip.to_string()).unwrap_or_default())
    });
    list(&nodes.chain(pods).collect::<Vec<_>>())
}

fn list(items: &[Value]) -> Value {
    json!({ "apiVersion": "v1", "kind": "List", "items": items })
}

/// `t` as `YYYY-MM-DDThh:mm:ssZ` (UTC), the form of `metav1.Time`.
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s) = (rest / 3600, rest / 60 % 60, rest % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}Z")
}

/// Days since 1970-01-01 to (year, month, day); Howard Hinnant's algorithm.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// What kubelet reports about its machine, as far as the lab has one.
#[derive(Debug, Clone)]
struct NodeInfo {
    kernel: String,
    architecture: &'static str,
}

impl NodeInfo {
    fn of_this_machine() -> Self {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        Self {
            kernel: kernel.trim().to_owned(),
            architecture,
        }
    }
}

fn namespace(ns: &Namespace) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": ns.name, "labels": ns.labels },
    })
}

fn node(node: &Node) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": node.name, "labels": node.labels },
        "spec": { "podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr] },
    })
}

fn pod(pod: &Pod) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": pod.name, "namespace": pod.namespace, "labels": pod.labels },
        "spec": {
            "nodeName": pod.node,
            "containers": [{ "name": CONTAINER, "image": IMAGE }],
            "terminationGracePeriodSeconds": 0,
        },
    })
}

fn node_status(node: &Node, info: &NodeInfo, now: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": node.name },
        "status": {
            "addresses": [
                { "type": "InternalIP", "address": node.ip.to_string() },
                { "type": "Hostname", "address": node.name },
            ],
            "conditions": [{
                "type": "Ready",
                "status": "True",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
                "reason": "LabNodeReady",
                "message": "the egressgw lab plays kubelet for this node",
            }],
            "nodeInfo": {
                "kubeletVersion": KUBERNETES_VERSION,
                "osImage": "egressgw lab (network namespace)",
                "operatingSystem": "linux",
                "architecture": info.architecture,
                "kernelVersion": info.kernel,
                "containerRuntimeVersion": "none://",
                // Required fields with nothing real behind them.
                "machineID": "", "systemUUID": "", "bootID": "", "kubeProxyVersion": "",
            },
        },
    })
}

fn pod_status(pod: &Pod, host_ip: &str) -> Value {
    let ip = pod.ip.to_string();
    let ready = ["Initialized", "ContainersReady", "Ready"]
        .map(|kind| json!({ "type": kind, "status": "True" }));
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": pod.name, "namespace": pod.namespace },
        "status": {
            "phase": "Running",
            "hostIP": host_ip,
            "hostIPs": [{ "ip": host_ip }],
            "podIP": ip,
            "podIPs": [{ "ip": ip }],
            "conditions": ready,
            "containerStatuses": [{
                "name": CONTAINER,
                "image": IMAGE,
                "imageID": "",
                "ready": true,
                "started": true,
                "restartCount": 0,
                "state": { "running": {} },
            }],
        },
    })
}

/// Server-side apply of `objects` (to their `subresource`, if given).
fn apply(kubectl: &Kubectl, objects: &Value, subresource: Option<&str>) -> anyhow::Result<()> {
    let input = objects.to_string();
    let subresource = subresource.map(|s| format!("--subresource={s}"));
    let mut args = vec![
        "apply",
        "--server-side",
        "--field-manager",
        FIELD_MANAGER,
        "-f",
        "-",
    ];
    args.extend(subresource.as_deref());
    kubectl.run_with_input(&args, Some(&input)).map(drop)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::lab::topology::Prefix;

    #[test]
    fn objects_hold_every_namespace_node_and_pod_once() {
        let topo = Topology::new(&Prefix::new("egl").unwrap(), 3, 2).unwrap();
        let list = objects(&topo);
        let kinds: Vec<&str> = list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["kind"].as_str().unwrap())
            .collect();
        let count = |k| kinds.iter().filter(|&&x| x == k).count();
        assert_eq!((count("Namespace"), count("Node"), count("Pod")), (2, 3, 6));
    }

    #[test]
    fn gateway_nodes_carry_the_gateway_label_and_their_pod_cidr() {
        let topo = Topology::new(&Prefix::new("egl").unwrap(), 2, 1).unwrap();
        let gw = node(&topo.nodes[0]);
        assert_eq!(gw["metadata"]["labels"]["egressgw.io/gateway"], "true");
        assert_eq!(gw["spec"]["podCIDR"], "10.244.1.0/24");
        assert!(
            node(&topo.nodes[1])["metadata"]["labels"]
                .get("egressgw.io/gateway")
                .is_none()
        );
    }

    #[test]
    fn times_are_written_as_kubernetes_writes_them() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let leap_day = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3_723);
        assert_eq!(rfc3339(leap_day), "2000-02-29T01:02:03Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_798_761_599);
        assert_eq!(rfc3339(t), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn pod_status_reports_its_address_and_its_nodes() {
        let topo = Topology::new(&Prefix::new("egl").unwrap(), 1, 1).unwrap();
        let status = pod_status(&topo.pods[0], "172.18.0.11");
        assert_eq!(status["metadata"]["name"], "web-1");
        assert_eq!(status["status"]["podIPs"][0]["ip"], "10.244.1.2");
        assert_eq!(status["status"]["hostIP"], "172.18.0.11");
        assert_eq!(status["status"]["phase"], "Running");
    }
}

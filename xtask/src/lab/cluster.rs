//! Registers the lab in the API as kubelet would: Namespaces, Nodes (with
//! addresses, pod CIDR, capacity and a Ready condition) and the lab's own
//! pods (network namespaces bound to their node, Running, with their
//! addresses).
//!
//! Objects go in with one server-side `kubectl apply`, their status with a
//! second one on the status subresource (`--subresource=status`); a Node's
//! status with a merge patch, as kubelet writes it. Pods are created once the ServiceAccount controller has made
//! their namespace's `default` ServiceAccount, which the ServiceAccount
//! admission plugin requires.

use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::build::KUBERNETES_VERSION;
use super::kubectl::Kubectl;
use super::topology::{Namespace, Node, Pod, Topology};

/// Field manager of everything the lab writes.
const FIELD_MANAGER: &str = "egressgw-lab";
/// The one container of every lab pod.
const CONTAINER: &str = "app";
/// Never pulled or run: a lab pod is a network namespace, not a container.
/// The kubelet stand-in leaves Pods of this image alone.
const IMAGE: &str = super::kubelet::LAB_POD_IMAGE;
/// How long the ServiceAccount controller gets to make a namespace's
/// `default` ServiceAccount.
const SERVICE_ACCOUNT_TIMEOUT: Duration = Duration::from_secs(60);
/// The pods a node takes, as kubelet's default `--max-pods`.
const MAX_PODS: u32 = 110;

/// Creates the namespaces and nodes, then the pods (once their namespaces'
/// ServiceAccounts exist), then sets the status of nodes and pods.
pub fn register(kubectl: &Kubectl, topo: &Topology) -> anyhow::Result<()> {
    let namespaces = topo.namespaces.iter().map(namespace);
    let nodes = topo.nodes.iter().map(node);
    let items: Vec<Value> = namespaces.chain(nodes).collect();
    apply(kubectl, &list(&items), None).context("creating namespaces and nodes")?;
    let node_info = NodeInfo::of_this_machine();
    let now = rfc3339(SystemTime::now());
    for n in &topo.nodes {
        let status = node_status(n, &node_info, &now);
        patch_status(kubectl, "node", &n.name, &status)
            .with_context(|| format!("setting the status of {}", n.name))?;
        untaint(kubectl, &n.name)?;
    }
    for ns in &topo.namespaces {
        wait_for_service_account(kubectl, &ns.name)?;
    }
    let pods: Vec<Value> = topo.pods.iter().map(pod).collect();
    apply(kubectl, &list(&pods), None).context("creating pods")?;
    apply(kubectl, &statuses(topo), Some("status")).context("setting the status of pods")
}

/// Removes the taints of a new node: the API server's `TaintNodesByCondition`
/// admission gives every new Node `node.kubernetes.io/not-ready:NoSchedule`,
/// which kube-controller-manager's node-lifecycle controller lifts once the
/// node reports Ready. The lab does not run that controller (it would want
/// node heartbeats, and evict Pods when they stop), so it lifts the taint
/// itself, as soon as the node is Ready.
fn untaint(kubectl: &Kubectl, node: &str) -> anyhow::Result<()> {
    kubectl
        .run(&[
            "patch",
            "node",
            node,
            "--type=merge",
            "--patch",
            r#"{"spec":{"taints":null}}"#,
        ])
        .map(drop)
        .with_context(|| format!("removing the not-ready taint of {node}"))
}

/// Waits until namespace `ns` has its `default` ServiceAccount (made by
/// kube-controller-manager's ServiceAccount controller).
pub fn wait_for_service_account(kubectl: &Kubectl, ns: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + SERVICE_ACCOUNT_TIMEOUT;
    loop {
        let found = kubectl.run(&[
            "get",
            "serviceaccount",
            "default",
            "--namespace",
            ns,
            "--ignore-not-found",
            "-o",
            "name",
        ]);
        match found {
            Ok(out) if !out.trim().is_empty() => return Ok(()),
            _ if Instant::now() >= deadline => bail!(
                "namespace {ns} has no `default` ServiceAccount after {}s: is \
                 kube-controller-manager's serviceaccount-controller running? (logs/kube-controller-manager.log)",
                SERVICE_ACCOUNT_TIMEOUT.as_secs()
            ),
            _ => thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Registers one more pod on `node`, as kubelet would: the Pod, then its status.
pub fn register_pod(kubectl: &Kubectl, added: &Pod, node: &Node) -> anyhow::Result<()> {
    wait_for_service_account(kubectl, &added.namespace)?;
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

/// The status of every lab pod as one `v1` List.
fn statuses(topo: &Topology) -> Value {
    let pods = topo.pods.iter().map(|p| {
        let node = topo.nodes.iter().find(|n| n.name == p.node);
        pod_status(p, &node.map(|n| n.ip.to_string()).unwrap_or_default())
    });
    list(&pods.collect::<Vec<_>>())
}

fn list(items: &[Value]) -> Value {
    json!({ "apiVersion": "v1", "kind": "List", "items": items })
}

/// `t` as `YYYY-MM-DDThh:mm:ssZ` (UTC), the form of `metav1.Time`.
pub fn rfc3339(t: SystemTime) -> String {
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
    /// Cores, as Kubernetes writes a cpu quantity.
    cpu: String,
    /// Memory, in KiB as kubelet writes it (`16384000Ki`).
    memory: String,
}

impl NodeInfo {
    fn of_this_machine() -> Self {
        let (cpu, memory) = super::kubelet::machine();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        #[expect(clippy::cast_possible_truncation, reason = "whole cores and KiB")]
        let (cpu, memory) = (cpu as u64, memory as u64 / 1024);
        Self {
            kernel: kernel.trim().to_owned(),
            architecture,
            cpu: cpu.to_string(),
            memory: format!("{memory}Ki"),
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
    let pod_cidrs: Vec<&str> = std::iter::once(node.pod_cidr.as_str())
        .chain(node.pod_cidr6.as_deref())
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": node.name, "labels": node.labels },
        "spec": { "podCIDR": node.pod_cidr, "podCIDRs": pod_cidrs },
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
            // A network namespace runs no program that could use a token.
            "automountServiceAccountToken": false,
        },
    })
}

/// A node's status: addresses, capacity (the machine's cores and memory,
/// 110 pods, as the scheduler needs to place Pods), conditions (Ready, no
/// pressure: no taint keeps DaemonSet or other Pods off it) and node info.
fn node_status(node: &Node, info: &NodeInfo, now: &str) -> Value {
    let capacity = json!({ "cpu": info.cpu, "memory": info.memory, "pods": MAX_PODS.to_string() });
    let condition = |kind: &str, status: &str, reason: &str, message: &str| {
        json!({
            "type": kind,
            "status": status,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
            "reason": reason,
            "message": message,
        })
    };
    let mut addresses = vec![json!({ "type": "InternalIP", "address": node.ip.to_string() })];
    if let Some(ip6) = node.ip6 {
        addresses.push(json!({ "type": "InternalIP", "address": ip6.to_string() }));
    }
    addresses.push(json!({ "type": "Hostname", "address": node.name }));
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": node.name },
        "status": {
            "addresses": addresses,
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "the lab does not measure memory pressure"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "the lab does not measure disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "the lab does not measure PID pressure"),
                condition("Ready", "True", "LabNodeReady", "the egressgw lab plays kubelet for this node"),
            ],
            "daemonEndpoints": { "kubeletEndpoint": { "Port": super::kubelet::KUBELET_PORT } },
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
    let ips: Vec<Value> = std::iter::once(ip.clone())
        .chain(pod.ip6.map(|ip6| ip6.to_string()))
        .map(|ip| json!({ "ip": ip }))
        .collect();
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
            "podIPs": ips,
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

/// A merge patch of an object's status, the way kubelet writes a Node's:
/// server-side apply keys `status.addresses` by `type`, which a dual-stack
/// node's two `InternalIP` addresses share.
fn patch_status(kubectl: &Kubectl, kind: &str, name: &str, object: &Value) -> anyhow::Result<()> {
    let body = json!({ "status": object["status"] }).to_string();
    let args = [
        "patch",
        kind,
        name,
        "--subresource=status",
        "--type=merge",
        "--field-manager",
        FIELD_MANAGER,
        "-p",
        &body,
    ];
    kubectl.run(&args).map(drop)
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
    fn nodes_report_capacity_the_scheduler_can_place_pods_on() {
        let topo = Topology::new(&Prefix::new("egl").unwrap(), 1, 1).unwrap();
        let info = NodeInfo {
            kernel: "6.18".to_owned(),
            architecture: "amd64",
            cpu: "2".to_owned(),
            memory: "16384000Ki".to_owned(),
        };
        let status = &node_status(&topo.nodes[0], &info, "2026-11-23T00:00:00Z")["status"];
        assert_eq!(status["allocatable"]["cpu"], "2");
        assert_eq!(status["allocatable"]["memory"], "16384000Ki");
        assert_eq!(status["allocatable"]["pods"], "110");
        let ready = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready");
        assert_eq!(ready.unwrap()["status"], "True");
    }

    #[test]
    fn lab_pods_are_never_run_and_get_no_token() {
        let topo = Topology::new(&Prefix::new("egl").unwrap(), 1, 1).unwrap();
        let p = pod(&topo.pods[0]);
        assert_eq!(
            p["spec"]["containers"][0]["image"],
            super::super::kubelet::LAB_POD_IMAGE
        );
        assert_eq!(p["spec"]["automountServiceAccountToken"], false);
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

    #[test]
    fn a_dual_stack_lab_gives_pods_and_nodes_both_families() {
        let topo = Topology::new(&Prefix::new("egl").unwrap(), 1, 1)
            .unwrap()
            .with_ipv6();
        let status = pod_status(&topo.pods[0], "172.18.0.11");
        assert_eq!(status["status"]["podIP"], "10.244.1.2");
        assert_eq!(status["status"]["podIPs"][1]["ip"], "fd00:10:244:1::2");
        let spec = node(&topo.nodes[0]);
        assert_eq!(
            spec["spec"]["podCIDRs"],
            json!(["10.244.1.0/24", "fd00:10:244:1::/64"])
        );
        let info = NodeInfo {
            kernel: String::new(),
            architecture: "amd64",
            cpu: "2".to_owned(),
            memory: "1Ki".to_owned(),
        };
        let addresses = &node_status(&topo.nodes[0], &info, "now")["status"]["addresses"];
        assert_eq!(addresses[0]["address"], "172.18.0.11");
        assert_eq!(addresses[1]["address"], "fd00:172:18::11");
    }
}

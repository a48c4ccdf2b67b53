//! The Kubernetes objects of the test cluster, and `egressgw` run on them.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use super::netns::{
    NODE_A_IP, NODE_B_IP, Netns, POD_A1_IP, POD_A1_IP6, POD_A2_IP, POD_A2_IP6, POD_B1_IP,
    POD_B1_IP6, POD_CIDR_A6, POD_CIDR_B6, Stack,
};
use super::process::{Background, describe, run_bounded};

/// The policy's name as `egressgw plan` reports it.
pub const POLICY: &str = "team-a/web";
/// The gateway's pool.
pub const POOL: &str = "198.51.100.200-198.51.100.210";
/// The gateway's IPv6 pool (dual-stack objects only), on the target's link.
pub const POOL6: &str = "2001:db8:100::200-2001:db8:100::210";
/// How long one `apply` or `cleanup` may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// The binary under test.
fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_egressgw")
}

/// The `EgressPolicy` `team-a/web`: it selects the pods labelled `app: web`
/// (pod-a1 on node A and pod-b1 on node B); pod-a2 (`app: batch`) is never
/// selected.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `spec.destSubnet`; empty means every destination outside the cluster.
    pub dest_subnet: Vec<&'static str>,
    /// `spec.excludeSubnet`.
    pub exclude_subnet: Vec<&'static str>,
    /// `spec.egressIP.useNodeIP`.
    pub use_node_ip: bool,
}

impl Policy {
    /// The default policy with the target's IPv6 prefix as a second
    /// destination.
    pub fn dual_stack() -> Self {
        Self {
            dest_subnet: vec!["198.51.100.0/24", "2001:db8:100::/64"],
            ..Self::default()
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            dest_subnet: vec!["198.51.100.0/24"],
            exclude_subnet: Vec::new(),
            use_node_ip: false,
        }
    }
}

/// Nodes, the namespace, pods, the gateway and `policy`, as YAML documents;
/// with [`Stack::Dual`] the nodes have dual-stack pod CIDRs, the pods an IPv6
/// address each and the gateway an IPv6 pool too.
pub fn objects_yaml(policy: &Policy, stack: Stack) -> String {
    let dual = stack == Stack::Dual;
    let v6 = |ip: &'static str| dual.then_some(ip);
    let mut y = String::new();
    y += &node("node-a", NODE_A_IP, "10.244.1.0/24", v6(POD_CIDR_A6), false);
    y += &node("node-b", NODE_B_IP, "10.244.2.0/24", v6(POD_CIDR_B6), true);
    y += "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: team-a\n  labels:\n    kubernetes.io/metadata.name: team-a\n";
    y += &pod(
        "pod-a1",
        "web",
        "node-a",
        NODE_A_IP,
        POD_A1_IP,
        v6(POD_A1_IP6),
    );
    y += &pod(
        "pod-a2",
        "batch",
        "node-a",
        NODE_A_IP,
        POD_A2_IP,
        v6(POD_A2_IP6),
    );
    y += &pod(
        "pod-b1",
        "web",
        "node-b",
        NODE_B_IP,
        POD_B1_IP,
        v6(POD_B1_IP6),
    );
    let ipv6_pool = if dual {
        format!("\n    ipv6:\n      - {POOL6}")
    } else {
        String::new()
    };
    let _ = write!(
        y,
        "---
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata:
  name: egress
spec:
  nodeSelector:
    selector:
      matchLabels:
        egressgw.io/gateway: \"true\"
  ippools:
    ipv4:
      - {POOL}{ipv6_pool}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata:
  name: web
  namespace: team-a
spec:
  egressGatewayName: egress
  egressIP:
    useNodeIP: {}
  appliedTo:
    podSelector:
      matchLabels:
        app: web
  destSubnet: {}
  excludeSubnet: {}
",
        policy.use_node_ip,
        flow_list(&policy.dest_subnet),
        flow_list(&policy.exclude_subnet),
    );
    y
}

fn flow_list(items: &[&str]) -> String {
    format!("[{}]", items.join(", "))
}

fn node(name: &str, ip: &str, pod_cidr: &str, pod_cidr6: Option<&str>, gateway: bool) -> String {
    let gateway_label = if gateway {
        "\n    egressgw.io/gateway: \"true\""
    } else {
        ""
    };
    let pod_cidr6 = pod_cidr6.map_or_else(String::new, |c| format!("\n    - {c}"));
    format!(
        "---
apiVersion: v1
kind: Node
metadata:
  name: {name}
  labels:
    kubernetes.io/hostname: {name}
    kubernetes.io/os: linux{gateway_label}
spec:
  podCIDR: {pod_cidr}
  podCIDRs:
    - {pod_cidr}{pod_cidr6}
status:
  addresses:
    - type: InternalIP
      address: {ip}
    - type: Hostname
      address: {name}
  conditions:
    - type: Ready
      status: \"True\"
"
    )
}

fn pod(name: &str, app: &str, node: &str, host_ip: &str, ip: &str, ip6: Option<&str>) -> String {
    let ip6 = ip6.map_or_else(String::new, |ip| format!("\n    - ip: {ip}"));
    format!(
        "---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: team-a
  labels:
    app: {app}
spec:
  nodeName: {node}
  containers:
    - name: main
      image: registry.example.com/{app}:1
status:
  phase: Running
  hostIP: {host_ip}
  podIP: {ip}
  podIPs:
    - ip: {ip}{ip6}
"
    )
}

/// The outcome of one reconcile, as `apply -o json` prints it.
#[derive(Debug)]
pub struct Reconcile {
    /// `applied`: the ops carried out, by their text.
    pub applied: Vec<String>,
    /// `failed`: the ops that failed, with their errors.
    pub failed: Vec<serde_json::Value>,
    /// The whole object.
    pub json: serde_json::Value,
}

impl Reconcile {
    fn parse(json: serde_json::Value) -> Self {
        let applied = json["applied"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|v| {
                        v["text"]
                            .as_str()
                            .map_or_else(|| v.to_string(), str::to_owned)
                    })
                    .collect()
            })
            .unwrap_or_else(|| panic!("no `applied` list in {json}"));
        let failed = json["failed"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| panic!("no `failed` list in {json}"));
        Self {
            applied,
            failed,
            json,
        }
    }
}

/// `egressgw` with this test's objects and config file.
#[derive(Debug)]
pub struct Egressgw {
    objects: PathBuf,
    config: PathBuf,
    /// Per node namespace, a directory for the eBPF classifier's pins: on
    /// a bpf filesystem of its own (mounted here, unmounted on drop) when
    /// the config asks for the eBPF datapath; never the host's.
    bpf_root: PathBuf,
    /// Whether the config asks for the eBPF datapath.
    ebpf: bool,
    /// The bpf filesystems mounted.
    mounted: std::sync::Mutex<std::collections::BTreeSet<PathBuf>>,
}

impl Drop for Egressgw {
    fn drop(&mut self) {
        let mounted = self
            .mounted
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        for dir in mounted {
            // Pinned attachments and maps go with the filesystem.
            let _ = Command::new("umount").arg("-l").arg(&dir).status();
        }
    }
}

impl Egressgw {
    /// Writes `objects.yaml` (from `policy`, for the families of `stack`)
    /// and `config.yaml` (`config`, YAML with the Helm chart's `feature`
    /// keys) into `dir`.
    pub fn new(dir: &Path, stack: Stack, policy: &Policy, config: &str) -> Self {
        let objects = dir.join("objects.yaml");
        let config_path = dir.join("config.yaml");
        std::fs::write(&objects, objects_yaml(policy, stack)).expect("writing objects.yaml");
        std::fs::write(&config_path, config).expect("writing config.yaml");
        Self {
            objects,
            config: config_path,
            bpf_root: dir.join("bpf"),
            ebpf: config.contains("datapath: ebpf"),
            mounted: std::sync::Mutex::default(),
        }
    }

    /// The pin directory of the node in `ns`.
    fn pins(&self, ns: &Netns) -> String {
        let root = self.bpf_root.join(ns.name());
        std::fs::create_dir_all(&root).expect("creating a pin directory");
        let mut mounted = self.mounted.lock().expect("not poisoned");
        if self.ebpf && !mounted.contains(&root) {
            let status = Command::new("mount")
                .args(["-t", "bpf", "bpf"])
                .arg(&root)
                .status()
                .expect("running mount");
            assert!(
                status.success(),
                "mounting a bpf filesystem at {}",
                root.display()
            );
            mounted.insert(root.clone());
        }
        path_str(&root.join("egressgw")).to_owned()
    }

    /// Whether anything is pinned for the node in `ns`.
    pub fn has_pins(&self, ns: &Netns) -> bool {
        Path::new(&self.pins(ns)).exists()
    }

    fn args<'a>(&'a self, subcommand: &'a str, node: Option<&'a str>) -> Vec<&'a str> {
        let mut args = vec![subcommand];
        if subcommand != "cleanup" {
            args.extend(["-f", path_str(&self.objects)]);
        }
        if let Some(node) = node {
            args.extend(["--node", node]);
        }
        args.extend(["--config", path_str(&self.config), "-o", "json"]);
        args
    }

    /// The IPv4 EIP `egressgw plan` allocates to [`POLICY`].
    pub fn planned_eip(&self) -> Ipv4Addr {
        self.planned("eip_ipv4")
    }

    /// The IPv6 EIP `egressgw plan` allocates to [`POLICY`].
    pub fn planned_eip6(&self) -> Ipv6Addr {
        self.planned("eip_ipv6")
    }

    /// The address in `field` of [`POLICY`]'s status in `plan -o json`.
    fn planned<T: std::str::FromStr>(&self, field: &str) -> T {
        let mut cmd = Command::new(binary());
        cmd.args(self.args("plan", None))
            .env_remove("EGRESSGW_CONFIG");
        let out = run_bounded(&mut cmd, RUN_LIMIT);
        let out = checked(&cmd, out);
        let json: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("plan -o json prints JSON");
        let policy = json["status"]["policies"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["policy"] == POLICY))
            .unwrap_or_else(|| panic!("no status for {POLICY} in the plan: {json}"));
        policy[field]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{POLICY} has no {field} in the plan: {policy}"))
    }

    /// One `apply -o json` for `node` inside `ns`; returns its exit status
    /// and its report.
    pub fn apply(&self, ns: &Netns, node: &str) -> (Output, Reconcile) {
        let pins = self.pins(ns);
        let mut args = self.args("apply", Some(node));
        args.extend(["--bpf-pins", &pins]);
        let mut cmd = ns.command(binary(), &args);
        cmd.env_remove("EGRESSGW_CONFIG");
        let out = run_bounded(&mut cmd, RUN_LIMIT);
        let mut objects = serde_json::Deserializer::from_slice(&out.stdout).into_iter();
        let report = match objects.next() {
            Some(Ok(v)) => Reconcile::parse(v),
            other => panic!(
                "`{}` printed no JSON report ({other:?}; {}): {}{}",
                describe(&cmd),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        (out, report)
    }

    /// [`Self::apply`], failing the test unless it succeeded with no failed op.
    pub fn apply_ok(&self, ns: &Netns, node: &str) -> Reconcile {
        let (out, report) = self.apply(ns, node);
        assert!(
            out.status.success() && report.failed.is_empty(),
            "apply for {node} in {} failed ({}): {:#}\nstderr: {}",
            ns.name(),
            out.status,
            report.json,
            String::from_utf8_lossy(&out.stderr)
        );
        report
    }

    /// Starts `apply --every SECONDS -o json` for `node` inside `ns`; each
    /// reconcile's report arrives on the returned channel.
    pub fn apply_every(
        &self,
        ns: &Netns,
        node: &str,
        seconds: u32,
    ) -> (Background, Receiver<Reconcile>) {
        let secs = seconds.to_string();
        let pins = self.pins(ns);
        let mut args = self.args("apply", Some(node));
        args.extend(["--every", &secs, "--bpf-pins", &pins]);
        let mut cmd = ns.command(binary(), &args);
        cmd.env_remove("EGRESSGW_CONFIG");
        let (tx, rx) = mpsc::channel();
        let child = Background::spawn_with(&mut cmd, move |stdout| {
            for value in serde_json::Deserializer::from_reader(stdout).into_iter() {
                match value {
                    Ok(v) => {
                        if tx.send(Reconcile::parse(v)).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        eprintln!("apply --every printed something that is not JSON: {e}");
                        break;
                    }
                }
            }
            Vec::new()
        });
        (child, rx)
    }

    /// `cleanup -o json` inside `ns`; fails the test unless it succeeds.
    pub fn cleanup(&self, ns: &Netns) -> Output {
        let pins = self.pins(ns);
        let mut args = self.args("cleanup", None);
        args.extend(["--bpf-pins", &pins]);
        let mut cmd = ns.command(binary(), &args);
        cmd.env_remove("EGRESSGW_CONFIG");
        let out = run_bounded(&mut cmd, RUN_LIMIT);
        checked(&cmd, out)
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

fn checked(cmd: &Command, out: Output) -> Output {
    assert!(
        out.status.success(),
        "`{}` failed ({}): {}{}",
        describe(cmd),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

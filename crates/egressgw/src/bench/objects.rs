//! The Kubernetes objects the bench creates: the manifests of
//! `deploy/bench/` (what a user applies to run the cases by hand), with
//! their `${VARIABLES}` filled in. Every one carries [`PART_OF`] and lives
//! in the bench's own namespace, so deleting that namespace removes them
//! all.

use std::collections::BTreeMap;
use std::net::IpAddr;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::report::{Case, Variant};

/// The label every bench object carries, and its value.
pub const PART_OF: (&str, &str) = ("app.kubernetes.io/part-of", "egressgw-bench");
/// The label that selects case 3's Pods for the bench's policy (in
/// `policy.yaml` and `client-pod.yaml`).
#[cfg(test)]
const CASE3_LABEL: (&str, &str) = ("egressgw.io/bench-case", "pod-to-target");
/// The bench's EgressPolicy.
pub const POLICY: &str = "egressgw-bench";
/// The iperf3 server Pod on the gateway node.
pub const SERVER_POD: &str = "iperf3-server";
/// The container of the client Pods.
pub const CLIENT_CONTAINER: &str = "bench";

const NAMESPACE_YAML: &str = include_str!("../../../../deploy/bench/namespace.yaml");
const POLICY_YAML: &str = include_str!("../../../../deploy/bench/policy.yaml");
const SERVER_YAML: &str = include_str!("../../../../deploy/bench/server.yaml");
const CLIENT_NODE_YAML: &str = include_str!("../../../../deploy/bench/client-node.yaml");
const CLIENT_POD_YAML: &str = include_str!("../../../../deploy/bench/client-pod.yaml");

/// What the objects need to know.
#[derive(Debug, Clone)]
pub struct Setup {
    pub namespace: String,
    /// Labels for the namespace besides [`PART_OF`] (to match a gateway's
    /// namespace selector).
    pub namespace_labels: BTreeMap<String, String>,
    pub image: String,
    pub source_node: String,
    pub gateway: String,
    /// The target, for the policy's `destSubnet`.
    pub target: IpAddr,
    /// Port of the iperf3 server on the gateway node.
    pub port: u16,
    /// Port of the echo servers (the target's, and the one the bench runs
    /// on the gateway node): round trips are timed when there is one.
    pub echo_port: Option<u16>,
    /// CPUs of the clients and of the gateway node's echo server.
    pub cpus: Option<(usize, usize)>,
    /// Seconds of traffic per run.
    pub duration: u32,
    pub streams: u32,
    /// An upper bound on the whole bench, for the server's deadline.
    pub deadline_seconds: u64,
}

impl Setup {
    /// A run Pod's deadline: iperf3's run, the wait for the EIP, the round
    /// trips and a margin.
    fn run_deadline(&self) -> u64 {
        u64::from(self.duration) + 90
    }
}

/// `template` with each `${NAME}` replaced, parsed. Fails on a variable
/// left without a value.
fn fill(template: &str, vars: &[(&str, String)]) -> anyhow::Result<Value> {
    let mut text = template.to_owned();
    for (name, value) in vars {
        text = text.replace(&format!("${{{name}}}"), value);
    }
    if let Some(at) = text.find("${") {
        let rest = &text[at..];
        let var = rest.split('}').next().unwrap_or(rest);
        bail!("a bench manifest has no value for {var}}}");
    }
    serde_yaml::from_str(&text).context("parsing a bench manifest")
}

/// The namespace, with the extra labels.
pub fn namespace(setup: &Setup) -> anyhow::Result<Value> {
    let mut ns = fill(NAMESPACE_YAML, &[("NAMESPACE", setup.namespace.clone())])?;
    if let Some(labels) = ns["metadata"]["labels"].as_object_mut() {
        for (k, v) in &setup.namespace_labels {
            labels.insert(k.clone(), Value::String(v.clone()));
        }
    }
    Ok(ns)
}

/// The policy that sends case 3's Pods to the target through the gateway.
pub fn policy(setup: &Setup) -> anyhow::Result<Value> {
    let prefix = if setup.target.is_ipv4() { 32 } else { 128 };
    fill(
        POLICY_YAML,
        &[
            ("NAMESPACE", setup.namespace.clone()),
            ("GATEWAY", setup.gateway.clone()),
            ("TARGET_CIDR", format!("{}/{prefix}", setup.target)),
        ],
    )
}

/// The iperf3 server on the gateway node, in its network namespace, on
/// every address (the node's and the tunnel's), for the whole bench.
pub fn server_pod(setup: &Setup, gateway_node: &str) -> anyhow::Result<Value> {
    let mut pod = fill(
        SERVER_YAML,
        &[
            ("NAMESPACE", setup.namespace.clone()),
            ("GATEWAY_NODE", gateway_node.to_owned()),
            ("DEADLINE", setup.deadline_seconds.to_string()),
            ("IMAGE", setup.image.clone()),
            ("PORT", setup.port.to_string()),
        ],
    )?;
    // The round trips' echo server beside iperf3: the same image and
    // restrictions, its own command.
    if let Some(port) = setup.echo_port {
        let containers = pod["spec"]["containers"]
            .as_array_mut()
            .context("a bench server manifest without containers")?;
        let mut echo = containers
            .first()
            .cloned()
            .context("a bench server manifest without a container")?;
        let mut command = vec![
            "egressgw".to_owned(),
            "bench-echo".to_owned(),
            "--port".to_owned(),
            port.to_string(),
        ];
        if let Some((_, cpu)) = setup.cpus {
            command.extend(["--cpu".to_owned(), cpu.to_string()]);
        }
        echo["name"] = json!("echo");
        echo["command"] = json!(command);
        echo["readinessProbe"]["tcpSocket"]["port"] = json!(port);
        if let Some(obj) = echo.as_object_mut() {
            obj.remove("volumeMounts");
        }
        containers.push(echo);
    }
    Ok(pod)
}

/// One run's Pod: `egressgw bench-client` against the server of `case`.
#[derive(Debug)]
pub struct Run<'a> {
    pub case: Case,
    pub variant: Variant,
    /// The offload phase as configured (`on`, `off`, `cur`), for the name.
    pub phase: &'a str,
    pub repeat: u32,
    /// Where case `case` connects to.
    pub server: IpAddr,
    pub server_port: u16,
    /// Local address to send from (case 2: the tunnel's).
    pub bind: Option<IpAddr>,
    /// The EIP case 3 must leave with.
    pub expect_source: Option<IpAddr>,
    /// The tunnel's underlay interface on the source node.
    pub parent: Option<String>,
}

impl Run<'_> {
    /// `c2-rev-off-r3`.
    pub fn pod_name(&self) -> String {
        let dir = if self.variant.reverse { "rev" } else { "fwd" };
        format!(
            "c{}-{dir}-{}-r{}",
            self.case.number(),
            self.phase,
            self.repeat
        )
    }
}

/// The Pod of one run: hostNetwork on the source node for cases 1 and 2
/// (`client-node.yaml`), a normal Pod there, selected by the bench's
/// policy, for case 3 (`client-pod.yaml`).
pub fn client_pod(setup: &Setup, run: &Run<'_>) -> anyhow::Result<Value> {
    let mut vars = vec![
        ("NAME", run.pod_name()),
        ("NAMESPACE", setup.namespace.clone()),
        ("SOURCE_NODE", setup.source_node.clone()),
        ("RUN_DEADLINE", setup.run_deadline().to_string()),
        ("IMAGE", setup.image.clone()),
        ("DURATION", setup.duration.to_string()),
        ("STREAMS", setup.streams.to_string()),
    ];
    let template = if run.case == Case::PodToTarget {
        let eip = run.expect_source.context("case 3 without an EIP")?;
        vars.extend([
            ("TARGET", run.server.to_string()),
            ("TARGET_PORT", run.server_port.to_string()),
            ("EIP", eip.to_string()),
        ]);
        CLIENT_POD_YAML
    } else {
        vars.extend([
            ("SERVER", run.server.to_string()),
            ("PORT", run.server_port.to_string()),
            ("PARENT", run.parent.clone().unwrap_or_default()),
        ]);
        CLIENT_NODE_YAML
    };
    let mut pod = fill(template, &vars)?;
    let args = pod["spec"]["containers"][0]["args"]
        .as_array_mut()
        .context("a bench client manifest without args")?;
    if run.variant.reverse {
        args.push(json!("--reverse"));
    }
    if let Some(bind) = run.bind {
        args.extend([json!("--bind"), json!(bind.to_string())]);
    }
    if let Some(port) = setup.echo_port {
        args.extend([json!("--echo-port"), json!(port.to_string())]);
    }
    if let Some((cpu, _)) = setup.cpus {
        args.extend([json!("--cpu"), json!(cpu.to_string())]);
    }
    Ok(pod)
}

/// A Pod that only reports a node's tunnel and its parent (their MTU and
/// offloads): `client-node.yaml` with `--interfaces-only`.
pub fn interfaces_pod(
    setup: &Setup,
    name: &str,
    node: &str,
    parent: Option<&str>,
) -> anyhow::Result<Value> {
    let mut pod = fill(
        CLIENT_NODE_YAML,
        &[
            ("NAME", name.to_owned()),
            ("NAMESPACE", setup.namespace.clone()),
            ("SOURCE_NODE", node.to_owned()),
            ("RUN_DEADLINE", "60".to_owned()),
            ("IMAGE", setup.image.clone()),
            ("SERVER", String::new()),
            ("PORT", String::new()),
            ("DURATION", String::new()),
            ("STREAMS", String::new()),
            ("PARENT", parent.unwrap_or_default().to_owned()),
        ],
    )?;
    let interfaces = format!("egress.vxlan,{}", parent.unwrap_or_default());
    pod["spec"]["containers"][0]["args"] = json!([
        "--interfaces-only",
        "--interfaces",
        interfaces.trim_end_matches(',')
    ]);
    Ok(pod)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> Setup {
        Setup {
            namespace: "egressgw-bench".into(),
            namespace_labels: BTreeMap::from([("team".into(), "bench".into())]),
            image: "ghcr.io/egressgw/egressgw:0.1.0".into(),
            source_node: "node-3".into(),
            gateway: "default".into(),
            target: "198.51.100.1".parse().unwrap(),
            port: 5201,
            echo_port: None,
            cpus: None,
            duration: 10,
            streams: 1,
            deadline_seconds: 600,
        }
    }

    /// The client container's args.
    fn args_of(pod: &Value) -> Vec<&str> {
        pod["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect()
    }

    /// A forward run of `case` against `server`, as configured, repeat 1.
    fn run(case: Case, server: &str) -> Run<'static> {
        Run {
            case,
            variant: Variant {
                reverse: false,
                offload: None,
                datapath: None,
            },
            phase: "cur",
            repeat: 1,
            server: server.parse().unwrap(),
            server_port: 5201,
            bind: None,
            expect_source: None,
            parent: None,
        }
    }

    #[test]
    fn with_an_echo_port_the_server_runs_an_echo_server_and_the_clients_time_round_trips() {
        let echoing = Setup {
            echo_port: Some(5202),
            cpus: Some((0, 1)),
            ..setup()
        };
        assert_eq!(
            server_pod(&setup(), "node-1").unwrap()["spec"]["containers"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        let pod = server_pod(&echoing, "node-1").unwrap();
        let echo = &pod["spec"]["containers"][1];
        assert_eq!(echo["name"], "echo");
        assert_eq!(
            echo["command"],
            json!(["egressgw", "bench-echo", "--port", "5202", "--cpu", "1"])
        );
        assert_eq!(echo["readinessProbe"]["tcpSocket"]["port"], 5202);
        assert_eq!(echo["securityContext"]["runAsNonRoot"], true);
        let run = Run {
            expect_source: Some("198.51.100.200".parse().unwrap()),
            ..run(Case::PodToTarget, "198.51.100.1")
        };
        let pod = client_pod(&echoing, &run).unwrap();
        let args = args_of(&pod);
        assert!(
            args.windows(2).any(|w| w == ["--echo-port", "5202"]),
            "{args:?}"
        );
        assert!(args.windows(2).any(|w| w == ["--cpu", "0"]), "{args:?}");
    }

    #[test]
    fn case_3_runs_in_the_pod_network_selected_by_the_policy() {
        let s = setup();
        let run = Run {
            variant: Variant {
                reverse: true,
                offload: Some(false),
                datapath: None,
            },
            phase: "off",
            repeat: 2,
            expect_source: Some("198.51.100.100".parse().unwrap()),
            ..run(Case::PodToTarget, &s.target.to_string())
        };
        let pod = client_pod(&s, &run).unwrap();
        assert_eq!(pod["metadata"]["name"], "c3-rev-off-r2");
        assert_eq!(pod["spec"]["hostNetwork"], false);
        assert_eq!(pod["spec"]["nodeName"], "node-3");
        assert_eq!(pod["metadata"]["labels"][CASE3_LABEL.0], CASE3_LABEL.1);
        let policy = policy(&s).unwrap();
        assert_eq!(
            policy["spec"]["appliedTo"]["podSelector"]["matchLabels"][CASE3_LABEL.0],
            CASE3_LABEL.1
        );
        assert_eq!(policy["spec"]["destSubnet"][0], "198.51.100.1/32");
        let command = args_of(&pod);
        assert!(
            command
                .windows(2)
                .any(|w| w == ["--expect-source", "198.51.100.100"]),
            "{command:?}"
        );
        assert!(command.contains(&"--reverse"));
    }

    #[test]
    fn cases_1_and_2_run_on_the_node_network() {
        let s = setup();
        let run = Run {
            bind: Some("10.6.0.3".parse().unwrap()),
            parent: Some("eth0".into()),
            ..run(Case::TunnelToTunnel, "10.6.0.1")
        };
        let pod = client_pod(&s, &run).unwrap();
        assert_eq!(pod["spec"]["hostNetwork"], true);
        assert!(pod["metadata"]["labels"].get(CASE3_LABEL.0).is_none());
        assert_eq!(pod["spec"]["activeDeadlineSeconds"], 100);
        let args = &pod["spec"]["containers"][0]["args"];
        assert_eq!(args[1], "10.6.0.1");
        assert_eq!(args[9], "egress.vxlan,eth0");
        assert_eq!(args[10], "--bind");
        let interfaces =
            interfaces_pod(&s, "interfaces-gateway-on", "node-1", Some("eth0")).unwrap();
        assert_eq!(interfaces["spec"]["nodeName"], "node-1");
        assert_eq!(
            interfaces["spec"]["containers"][0]["args"][2],
            "egress.vxlan,eth0"
        );
    }

    #[test]
    fn the_namespace_is_labelled_for_the_gateway_and_pod_security() {
        let ns = namespace(&setup()).unwrap();
        assert_eq!(ns["metadata"]["labels"]["team"], "bench");
        assert_eq!(ns["metadata"]["labels"][PART_OF.0], PART_OF.1);
        assert_eq!(
            ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
            "privileged"
        );
    }

    #[test]
    fn the_server_listens_on_the_port_for_the_whole_bench() {
        let pod = server_pod(&setup(), "node-1").unwrap();
        assert_eq!(pod["spec"]["nodeName"], "node-1");
        assert_eq!(pod["spec"]["activeDeadlineSeconds"], 600);
        assert_eq!(
            pod["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["port"],
            5201
        );
    }
}

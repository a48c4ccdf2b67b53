//! `egressgw plan` as a user runs it.

#![expect(clippy::unwrap_used, reason = "a failed step fails the test")]
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn egressgw(args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_egressgw"));
    cmd.args(args)
        .current_dir(repo())
        .env_remove("EGRESSGW_CONFIG");
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("egressgw runs");
    if let Some(text) = stdin {
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Compares `actual` with `tests/golden/<name>`; `UPDATE_GOLDEN=1` rewrites it.
fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        expected == actual,
        "{} differs from the output; if the change is intended, run UPDATE_GOLDEN=1 cargo test -p egressgw\n--- output ---\n{actual}",
        path.display()
    );
}

#[test]
fn the_example_cluster_plans_as_recorded() {
    let out = egressgw(&["plan", "-f", "deploy/examples/cluster.yaml"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    golden("cluster.txt", &stdout(&out));
}

#[test]
fn node_filter_prints_only_that_node() {
    let out = egressgw(
        &[
            "plan",
            "-f",
            "deploy/examples/cluster.yaml",
            "--node",
            "node-1",
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("node node-1\n"));
    assert!(!text.contains("node node-2\n"), "{text}");
}

#[test]
fn an_unknown_node_is_an_error_listing_the_known_ones() {
    let out = egressgw(
        &[
            "plan",
            "-f",
            "deploy/examples/cluster.yaml",
            "--node",
            "nope",
        ],
        None,
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("--node nope: no such Node") && err.contains("node-1"),
        "{err}"
    );
}

#[test]
fn json_output_is_machine_readable() {
    let out = egressgw(
        &["plan", "-f", "deploy/examples/cluster.yaml", "-o", "json"],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["nodes"].as_object().unwrap().len() >= 3);
    assert!(
        v["status"]["policies"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["conditions"].is_array())
    );
}

const BROKEN: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1, labels: {egress: "true"}}
spec: {podCIDR: 10.244.1.0/24}
status:
  addresses: [{type: InternalIP, address: 172.18.0.11}]
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: a, labels: {app: web}}
spec: {nodeName: n1, containers: [{name: c, image: x}]}
status: {phase: Running, podIP: 10.244.1.5}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressGateway
metadata: {name: gw}
spec:
  clusterDefault: true
  nodeSelector: {selector: {matchLabels: {egress: "true"}}}
  ippools: {ipv4: ["198.51.100.10"]}
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: good, namespace: a}
spec:
  appliedTo: {podSelector: {matchLabels: {app: web}}}
  destSubnet: ["203.0.113.0/24"]
---
apiVersion: egressgw.io/v1alpha1
kind: EgressPolicy
metadata: {name: bad, namespace: a}
spec:
  appliedTo: {podSelector: {matchLabels: {app: web}}}
  destSubnet: ["203.0.113.0/33"]
"#;

#[test]
fn an_invalid_policy_is_reported_by_field_and_the_valid_one_still_plans() {
    let out = egressgw(&["plan", "-f", "-", "--skip-invalid"], Some(BROKEN));
    assert!(out.status.success(), "{}", stderr(&out));
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(
        err.contains("warning: EgressPolicy a/bad is invalid and is ignored")
            && err.contains("spec.destSubnet[0]"),
        "{err}"
    );
    assert!(
        text.contains("10.244.1.5      -> 203.0.113.0/24     SNAT here"),
        "{text}"
    );
    assert!(text.contains("EgressPolicy a/bad: eip -, node -, 0 pod(s)\n    Allocated=False Invalid: spec.destSubnet[0]"), "{text}");
}

#[test]
fn an_invalid_policy_fails_the_plan_after_printing_it() {
    let out = egressgw(&["plan", "-f", "-"], Some(BROKEN));
    assert!(!out.status.success());
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(
        err.contains("error: EgressPolicy a/bad is invalid")
            && err.contains("1 invalid object(s) in -")
            && err.contains("--skip-invalid"),
        "{err}"
    );
    assert!(text.contains("Invalid: spec.destSubnet[0]"), "{text}");
}

#[test]
fn a_misspelled_field_fails_the_plan_and_the_policy_covers_nothing() {
    let typo = BROKEN.replace(
        "  destSubnet: [\"203.0.113.0/33\"]",
        "  destSubnets: [\"198.51.100.0/24\"]",
    );
    let out = egressgw(&["plan", "-f", "-"], Some(&typo));
    assert!(!out.status.success());
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(
        err.contains(
            "error: EgressPolicy a/bad is invalid: spec.destSubnets: unknown field (did you mean destSubnet?)"
        ),
        "{err}"
    );
    assert!(!text.contains("0.0.0.0/0"), "{text}");
    assert!(
        text.contains("Invalid: spec.destSubnets: unknown field"),
        "{text}"
    );
}

#[test]
fn every_example_plans_without_a_warning() {
    for file in [
        "deploy/examples/cluster.yaml",
        "deploy/examples/gateway.yaml",
        "deploy/examples/policy.yaml",
        "deploy/examples/cluster-policy.yaml",
    ] {
        let out = egressgw(&["plan", "-f", file], None);
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("warning") && !stderr(&out).contains("error"),
            "{file}: {}",
            stderr(&out)
        );
    }
}

#[test]
fn unreadable_yaml_names_the_document() {
    let out = egressgw(
        &["plan", "-f", "-"],
        Some("apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\nkey: [unclosed\n"),
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("document 2"), "{}", stderr(&out));
}

#[test]
fn a_config_file_changes_the_device() {
    let dir = std::env::temp_dir().join(format!("egressgw-plan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.yaml");
    std::fs::write(
        &cfg,
        "vxlan: {id: 4242, port: 4789, disableChecksumOffload: true}\n",
    )
    .unwrap();
    let out = egressgw(
        &[
            "plan",
            "-f",
            "deploy/examples/cluster.yaml",
            "--config",
            cfg.to_str().unwrap(),
        ],
        None,
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("vni 4242 port 4789")
            && stdout(&out).contains("checksum-offload off")
    );
}

//! The bench's smoke run: `egressgw bench` as a user runs it, against the
//! lab, with every case and variant once for 2 s. It proves the bench
//! works end to end (its Pods run, their logs are read, offload is
//! switched and read back, everything is removed), not how fast anything
//! is: no number is compared with another.

use anyhow::{Context, bail, ensure};
use serde_json::Value;

use super::objects;
use super::run::Run;
use crate::lab::Echo;
use crate::lab::session::Lab;

/// The bench's gateway in this scenario.
const GATEWAY: &str = "bench-smoke";
/// The non-gateway node the bench's clients run on.
const SOURCE: &str = "node-3";

/// `egressgw bench --repeat 1 --duration 2 --reverse --offload both
/// --echo-port ...`: every case produced a number and round trips with the
/// echo servers in every variant; case 3 left through the tunnel
/// (the source node's `egress.vxlan` sent at least what cases 2 and 3 sent
/// forward) with the EIP (the target's iperf3 saw it); offload
/// was off where it was switched off; nothing of the bench is left, and
/// the agents' config key is owned by whoever owned it before (Helm: its
/// next server-side upgrade would otherwise conflict with the bench).
/// Then `egressgw bench --cleanup` over a config a bench left switched:
/// an edit made after the bench's last write is kept, the bench's own
/// write is restored and handed back to Helm.
pub fn smoke_bench_measures_every_case_and_case_3_leaves_with_the_eip(
    run: &mut Run,
) -> anyhow::Result<()> {
    let eip = *run.pool.first().context("no pool")?;
    run.apply(&objects::gateway(GATEWAY, &run.pool_range(), eip))?;
    let output =
        std::env::temp_dir().join(format!("egressgw-bench-smoke-{}.json", std::process::id()));
    let sent_before = tunnel_tx_bytes(run.lab, SOURCE)?;
    let (owners_before, _) = config_owners(run.lab)?;
    let result = bench(run.lab, &output);
    let sent_after = tunnel_tx_bytes(run.lab, SOURCE)?;
    let text = std::fs::read_to_string(&output);
    let _ = std::fs::remove_file(&output);
    result?;
    let doc: Value =
        serde_json::from_str(&text.with_context(|| format!("reading {}", output.display()))?)?;
    let samples = doc["samples"].as_array().context("no samples")?;
    let expected_runs = 3 * 2 + 2 * 2;
    ensure!(
        samples.len() == expected_runs,
        "{} samples, expected {expected_runs}",
        samples.len()
    );
    let placement_eip = doc["placement"]["eip"].as_str().unwrap_or_default();
    ensure!(
        placement_eip == eip.to_string(),
        "the bench's EIP is {placement_eip}, the gateway's pool starts at {eip}"
    );
    // Bytes the source node sent forward through its tunnel: case 2's
    // and, if it took the tunnel, case 3's.
    let (mut case2_sent, mut case3_sent) = (0.0, 0.0);
    for s in samples {
        let what = format!("{} ({})", s["pod"], s["case"]);
        let received = s["result"]["receivedBps"].as_f64().unwrap_or(0.0);
        ensure!(received > 0.0, "{what}: no throughput ({received} bit/s)");
        let rtts = s["result"]["connectRttUs"].as_array().map_or(0, Vec::len);
        ensure!(rtts > 0, "{what}: no handshakes timed");
        // The echo servers: the target's, and the one the bench runs on
        // the gateway node for cases 1 and 2.
        let round_trips = s["result"]["roundTripUs"].as_array().map_or(0, Vec::len);
        ensure!(
            round_trips > 0,
            "{what}: no round trips with the echo server"
        );
        let forward_bytes = if s["variant"]["reverse"] == false {
            s["result"]["sentBps"].as_f64().unwrap_or(0.0) * 2.0 / 8.0
        } else {
            0.0
        };
        if s["case"] == "podToTarget" {
            let seen = s["result"]["seenFrom"].as_str().unwrap_or("nothing");
            ensure!(
                seen == placement_eip,
                "{what}: the target saw {seen}, not the EIP {placement_eip}"
            );
            case3_sent += forward_bytes;
        } else if s["case"] == "tunnelToTunnel" {
            case2_sent += forward_bytes;
        }
        let offload = &s["variant"]["offload"];
        ensure!(
            offload.is_boolean(),
            "{what}: offload state not read back ({offload})"
        );
    }
    let off = samples
        .iter()
        .filter(|s| s["variant"]["offload"] == false)
        .count();
    ensure!(
        off == 4,
        "{off} samples with offload off, expected 4 (cases 2 and 3, both directions)"
    );
    let tunnel_sent = sent_after.saturating_sub(sent_before) as f64;
    // iperf3's rate times its 2 s, a little under what it really sent.
    ensure!(
        tunnel_sent >= (case2_sent + case3_sent) * 0.9,
        "{SOURCE}'s egress.vxlan sent {tunnel_sent} bytes, less than cases 2 and 3 did forward \
         ({case2_sent} + {case3_sent}): case 3 did not take the tunnel"
    );
    let left = run.lab.kubectl.run(&[
        "get",
        "namespace",
        "egressgw-bench",
        "--ignore-not-found",
        "-o",
        "name",
    ])?;
    ensure!(
        left.trim().is_empty(),
        "the bench left its namespace: {left}"
    );
    let (owners_after, annotations) = config_owners(run.lab)?;
    ensure!(
        owners_before.iter().any(|o| o.starts_with("helm ")),
        "before the bench Helm did not own the agents' config: {owners_before:?}"
    );
    ensure!(
        owners_after == owners_before,
        "the agents' config was owned by {owners_before:?} before the bench and by \
         {owners_after:?} after it"
    );
    ensure!(
        !annotations.contains("egressgw.io/bench-"),
        "the bench left its annotations on the agents' ConfigMap: {annotations}"
    );
    run.note(format!(
        "{} runs; case 3 left with {placement_eip}; cases 2 and 3 sent {:.0} + {:.0} MB forward, \
         {SOURCE}'s tunnel {:.0} MB",
        samples.len(),
        case2_sent / 1e6,
        case3_sent / 1e6,
        tunnel_sent / 1e6
    ));
    cleanup_keeps_an_edit_and_restores_its_own_write(run, &owners_before)
}

/// What `egressgw bench --cleanup` does with a ConfigMap a bench left
/// switched: when someone edited the config after the bench's last write,
/// it keeps their edit, says so and removes only its annotations; when
/// not, it restores the config from before and hands the key back to
/// `owners` (Helm).
fn cleanup_keeps_an_edit_and_restores_its_own_write(
    run: &mut Run,
    owners: &[String],
) -> anyhow::Result<()> {
    let chart = config(run.lab)?;
    let edited = format!("{chart}\n# edited while a bench ran\n");
    let recorded: Vec<Value> = owners
        .iter()
        .filter_map(|o| o.split_once(' '))
        .map(|(manager, operation)| {
            serde_json::json!({ "manager": manager, "operation": operation, "apiVersion": "v1" })
        })
        .collect();
    let left_switched = |live: &str, written: &str| -> anyhow::Result<()> {
        let patch = serde_json::json!({
            "metadata": { "annotations": {
                "egressgw.io/bench-original-config": chart,
                "egressgw.io/bench-written-config": written,
                "egressgw.io/bench-original-owners": serde_json::to_string(&recorded)?,
            } },
            "data": { "config.yaml": live },
        });
        let name = format!("{}-config", crate::lab::helm::RELEASE);
        run.lab.kubectl.run(&[
            "-n",
            crate::lab::egressgw::NAMESPACE,
            "patch",
            "configmap",
            &name,
            "--type",
            "merge",
            "-p",
            &patch.to_string(),
        ])?;
        Ok(())
    };

    // Edited after the bench's last write ("offload off"): kept.
    left_switched(&edited, &format!("{chart}\n# offload off\n"))?;
    let said = bench_cleanup(run.lab)?;
    ensure!(
        said.contains("left as they wrote it"),
        "the cleanup did not say it kept the edit:\n{said}"
    );
    ensure!(
        config(run.lab)? == edited,
        "the cleanup overwrote a config edited after the bench's last write"
    );
    let (_, annotations) = config_owners(run.lab)?;
    ensure!(
        !annotations.contains("egressgw.io/bench-"),
        "the cleanup left the bench's annotations: {annotations}"
    );

    // Left as the bench wrote it: restored, and Helm owns the key again.
    left_switched(&edited, &edited)?;
    bench_cleanup(run.lab)?;
    ensure!(
        config(run.lab)? == chart,
        "the cleanup did not restore the config from before the bench"
    );
    let (owners_after, annotations) = config_owners(run.lab)?;
    ensure!(
        owners_after == owners,
        "after the cleanup the agents' config is owned by {owners_after:?}, not {owners:?}"
    );
    ensure!(
        !annotations.contains("egressgw.io/bench-"),
        "the cleanup left the bench's annotations: {annotations}"
    );
    run.note("`bench --cleanup` kept a config edited after the bench's write, and restored one it wrote (owned by Helm again)");
    Ok(())
}

/// The agents' ConfigMap, with its `managedFields`.
fn agents_configmap(lab: &Lab) -> anyhow::Result<Value> {
    let text = lab.kubectl.run(&[
        "-n",
        crate::lab::egressgw::NAMESPACE,
        "get",
        "configmap",
        &format!("{}-config", crate::lab::helm::RELEASE),
        "-o",
        "json",
        "--show-managed-fields",
    ])?;
    serde_json::from_str(&text).context("the agents' ConfigMap")
}

/// The agents' config as the ConfigMap holds it.
fn config(lab: &Lab) -> anyhow::Result<String> {
    agents_configmap(lab)?["data"]["config.yaml"]
        .as_str()
        .map(str::to_owned)
        .context("the agents' ConfigMap has no config.yaml")
}

/// Runs `egressgw bench --cleanup` as a user would; what it printed.
fn bench_cleanup(lab: &Lab) -> anyhow::Result<String> {
    let binary = lab.egressgw_binary()?;
    let kubeconfig = lab.paths.kubeconfig();
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            lab.state.topology.control_plane.netns.as_str(),
        ])
        .arg(binary)
        .args(["bench", "--cleanup", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .context("running egressgw bench --cleanup")?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    ensure!(
        out.status.success(),
        "egressgw bench --cleanup failed ({}):\n{said}",
        out.status
    );
    Ok(said)
}

/// Runs the deployed `egressgw bench` in the control plane's namespace.
fn bench(lab: &Lab, output: &std::path::Path) -> anyhow::Result<()> {
    let binary = lab.egressgw_binary()?;
    let topo = &lab.state.topology;
    let target = format!("{}:{}", topo.target.ip, topo.target.iperf3_port);
    let echo_port = topo.target.echo_port.to_string();
    let cpus = format!("0,{}", crate::lab::target_echo_cpu());
    let kubeconfig = lab.paths.kubeconfig();
    let args: Vec<String> = ["netns", "exec", topo.control_plane.netns.as_str()]
        .into_iter()
        .map(str::to_owned)
        .chain([
            binary.display().to_string(),
            "bench".into(),
            "--kubeconfig".into(),
            kubeconfig.display().to_string(),
        ])
        .chain(
            [
                "--source-node",
                SOURCE,
                "--gateway",
                GATEWAY,
                "--target",
                &target,
                "--echo-port",
                &echo_port,
                "--cpus",
                &cpus,
                "--duration",
                "2",
                "--repeat",
                "1",
                "--reverse",
                "--offload",
                "both",
                "--output",
            ]
            .map(str::to_owned),
        )
        .chain([output.display().to_string()])
        .collect();
    let echo = Echo::start(topo, &lab.paths, binary)?;
    let out = std::process::Command::new("ip")
        .args(&args)
        .output()
        .context("running egressgw bench");
    drop(echo);
    let out = out?;
    if !out.status.success() {
        bail!(
            "egressgw bench failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(())
}

/// Who owns the agents' config key (`manager operation` of each
/// `managedFields` entry that holds it), and the ConfigMap's annotations.
fn config_owners(lab: &Lab) -> anyhow::Result<(Vec<String>, String)> {
    let cm = agents_configmap(lab)?;
    let owners = cm["metadata"]["managedFields"]
        .as_array()
        .context("the agents' ConfigMap has no managedFields")?
        .iter()
        .filter(|e| !e["fieldsV1"]["f:data"]["f:config.yaml"].is_null())
        .map(|e| format!("{} {}", e["manager"], e["operation"]).replace('"', ""))
        .collect();
    Ok((owners, cm["metadata"]["annotations"].to_string()))
}

/// Bytes `node`'s `egress.vxlan` has sent.
fn tunnel_tx_bytes(lab: &Lab, node: &str) -> anyhow::Result<u64> {
    let netns = lab.node(node)?.netns.as_str().to_owned();
    let text = crate::lab::cmd::run(
        "ip",
        &[
            "netns",
            "exec",
            &netns,
            "cat",
            "/sys/class/net/egress.vxlan/statistics/tx_bytes",
        ],
    )?;
    text.trim()
        .parse()
        .with_context(|| format!("{node}'s egress.vxlan tx_bytes: {text}"))
}

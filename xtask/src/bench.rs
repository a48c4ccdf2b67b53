//! `cargo xtask bench`: `egressgw bench` on the lab. Brings the lab up if
//! none is (or uses the running one), installs egressgw from the chart,
//! makes sure a gateway exists for the bench, and runs `egressgw bench`
//! in the control plane's namespace with the lab's kubeconfig: its Pods
//! run on the lab's nodes through the kubelet stand-in, and case 3's
//! target is the lab's target host (`iperf3 -s`).

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::Context;
use serde_json::json;

use crate::lab::Echo;
use crate::lab::egressgw::{DeployArgs, deploy, find_binary};
use crate::lab::session::Lab;
use crate::lab::state::{LabState, Paths};
use crate::lab::up::{UpArgs, up};

/// The gateway the bench uses unless `--gateway` names another.
const GATEWAY: &str = "bench";
/// Its pool: the top of the lab's free range, which the e2e scenarios and
/// the demo leave alone.
const POOL: &str = "198.51.100.240-198.51.100.249";

/// `cargo xtask bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The egressgw binary to deploy and run [default: target/debug/egressgw].
    #[arg(long, value_name = "PATH")]
    egressgw: Option<PathBuf>,
    /// `egressgw bench`'s flags (`--duration 2 --repeat 1 --output r.json`,
    /// see `egressgw bench --help`); `--source-node` (the last node, not a
    /// gateway), `--gateway` (`bench`, made if missing), `--target` (the
    /// lab's iperf3 server) and `--kubeconfig` default to the lab's.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "FLAGS"
    )]
    flags: Vec<String>,
}

pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let paths = Paths::from_env()?;
    if LabState::read(&paths)?.is_none() {
        println!("no lab {} is up: bringing one up", paths.prefix);
        up(
            &UpArgs {
                nodes: 3,
                gateways: 2,
                ipv6: false,
                keep_on_failure: false,
            },
            &paths,
        )?;
    }
    let binary = find_binary(args.egressgw.as_deref())?;
    deploy(
        &DeployArgs {
            egressgw: Some(binary.clone()),
            ..DeployArgs::default()
        },
        &paths,
    )?;
    let lab = Lab::open(&paths)?;
    if !given(&args.flags, "--gateway") {
        ensure_gateway(&lab)?;
    }
    let command = bench_command(&lab, &binary, &args.flags)?;
    let echo = Echo::start(&lab.state.topology, &lab.paths, &binary)?;
    println!("running: {}", command.join(" "));
    let status = Command::new(&command[0])
        .args(&command[1..])
        .status()
        .with_context(|| format!("running {}", command[0]));
    drop(echo);
    let status = status?;
    Ok(if status.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Whether `flags` hold `--name` (as `--name VALUE` or `--name=VALUE`).
fn given(flags: &[String], name: &str) -> bool {
    flags.iter().any(|f| {
        f == name
            || f.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

/// The bench's gateway, on the gateway-capable nodes.
fn ensure_gateway(lab: &Lab) -> anyhow::Result<()> {
    let gateway = json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressGateway",
        "metadata": { "name": GATEWAY },
        "spec": {
            "nodeSelector": { "selector": { "matchLabels": { "egressgw.io/gateway": "true" } } },
            "ippools": { "ipv4": [POOL] },
        },
    });
    let yaml = serde_yaml::to_string(&gateway)?;
    let args = [
        "apply",
        "--server-side",
        "--field-manager",
        "egressgw-lab-bench",
        "-f",
        "-",
    ];
    lab.kubectl
        .run_with_input(&args, Some(&yaml))
        .with_context(|| format!("applying EgressGateway {GATEWAY}"))?;
    Ok(())
}

/// `ip netns exec <cp> egressgw bench` with the lab's defaults before the
/// flags given.
fn bench_command(
    lab: &Lab,
    binary: &std::path::Path,
    flags: &[String],
) -> anyhow::Result<Vec<String>> {
    let topo = &lab.state.topology;
    let source = topo.nodes.iter().rev().find(|n| !n.gateway).context(
        "the lab has no node that is not a gateway: bring it up with more --nodes than --gateways",
    )?;
    let target = format!("{}:{}", topo.target.ip, topo.target.iperf3_port);
    let echo_port = topo.target.echo_port.to_string();
    // The clients on the first CPU, the echo servers on the second (the
    // target's runs there, `Echo`): round trips stay on their CPUs.
    let cpus = format!("0,{}", crate::lab::target_echo_cpu());
    let kubeconfig = lab.paths.kubeconfig().display().to_string();
    let mut command: Vec<String> = ["ip", "netns", "exec", topo.control_plane.netns.as_str()]
        .map(str::to_owned)
        .to_vec();
    command.extend([binary.display().to_string(), "bench".to_owned()]);
    for (flag, value) in [
        ("--kubeconfig", kubeconfig.as_str()),
        ("--source-node", source.name.as_str()),
        ("--gateway", GATEWAY),
        ("--target", target.as_str()),
        ("--echo-port", echo_port.as_str()),
        ("--cpus", cpus.as_str()),
    ] {
        if !given(flags, flag) {
            command.extend([flag.to_owned(), value.to_owned()]);
        }
    }
    command.extend(flags.iter().cloned());
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_count_as_given_in_both_spellings() {
        let flags = [
            "--gateway=x".to_owned(),
            "--repeat".to_owned(),
            "1".to_owned(),
        ];
        assert!(given(&flags, "--gateway"));
        assert!(given(&flags, "--repeat"));
        assert!(!given(&flags, "--gateway-x"));
        assert!(!given(&flags, "--target"));
    }
}

//! The target's services: whoami (served by a copy of this binary) and an
//! iperf3 server, both bound to the target's address only (and a second
//! of each on its IPv6 address in a dual-stack lab); and, while a bench runs, the
//! deployed egressgw's TCP echo server.

use std::fs;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::net;
use super::process::{self, Started};
use super::state::Paths;
use super::topology::Topology;

/// How long the target's services get to listen.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// The CPU the echo server runs on: the second, where there is one (the
/// bench pins its clients to the first).
pub fn echo_cpu() -> usize {
    thread::available_parallelism().map_or(0, |n| usize::from(n.get() > 1))
}

/// `egressgw bench-echo` in the target's namespace, for the bench's round
/// trips, pinned to [`echo_cpu`]: listening when this is returned, killed
/// when it is dropped.
#[derive(Debug)]
pub struct Echo(Started);

impl Echo {
    /// Starts `egressgw` (the binary the lab deployed) as the echo server.
    pub fn start(topo: &Topology, paths: &Paths, egressgw: &Path) -> anyhow::Result<Self> {
        let target = &topo.target;
        let args = [
            "bench-echo".to_owned(),
            "--port".to_owned(),
            target.echo_port.to_string(),
            "--cpu".to_owned(),
            echo_cpu().to_string(),
        ];
        let mut echo = Echo(process::start(
            paths,
            &target.netns,
            "echo",
            egressgw,
            &args,
        )?);
        let port = format!(":{}", target.echo_port);
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        loop {
            echo.0.check_running()?;
            let listening = net::exec(&target.netns, "ss", &["-H", "-l", "-t", "-n"])?;
            if listening
                .lines()
                .filter_map(|l| l.split_whitespace().nth(3))
                .any(|local| local.ends_with(&port))
            {
                return Ok(echo);
            }
            if Instant::now() > deadline {
                bail!(
                    "the echo server does not listen on port {} after {}s",
                    target.echo_port,
                    LISTEN_TIMEOUT.as_secs()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        if let Err(e) = process::kill_now(self.0.record.pid) {
            eprintln!("stopping the echo server: {e:#}");
        }
        self.0.reap();
    }
}

/// Starts whoami and `iperf3 -s` in the target namespace.
pub fn start(topo: &Topology, paths: &Paths) -> anyhow::Result<Vec<Started>> {
    let target = &topo.target;
    let whoami = whoami_binary(paths)?;
    let listen = format!("{}:{}", target.ip, target.whoami_port);
    let whoami_args = ["lab", "whoami", "--listen", &listen].map(String::from);
    let iperf3_args = [
        "-s",
        "-B",
        &target.ip.to_string(),
        "-p",
        &target.iperf3_port.to_string(),
    ]
    .map(String::from);
    let mut started = vec![
        process::start(paths, &target.netns, "whoami", &whoami, &whoami_args)?,
        process::start(
            paths,
            &target.netns,
            "iperf3",
            &PathBuf::from("iperf3"),
            &iperf3_args,
        )?,
    ];
    if let Some(ip6) = target.ip6 {
        let listen = SocketAddr::from((ip6, target.whoami_port)).to_string();
        let args = ["lab", "whoami", "--listen", &listen].map(String::from);
        started.push(process::start(
            paths,
            &target.netns,
            "whoami6",
            &whoami,
            &args,
        )?);
        let (ip6, port) = (ip6.to_string(), target.iperf3_port.to_string());
        let args = ["-s", "-B", &ip6, "-p", &port].map(String::from);
        let iperf3 = PathBuf::from("iperf3");
        started.push(process::start(
            paths,
            &target.netns,
            "iperf3-6",
            &iperf3,
            &args,
        )?);
    }
    Ok(started)
}

/// A copy of the running xtask binary in the lab directory, so the service
/// outlives a rebuild or `cargo clean` of the workspace.
fn whoami_binary(paths: &Paths) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding the xtask binary")?;
    let copy = paths.run().join("xtask-whoami");
    fs::copy(&exe, &copy)
        .with_context(|| format!("copying {} to {}", exe.display(), copy.display()))?;
    fs::set_permissions(&copy, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", copy.display()))?;
    Ok(copy)
}

/// Waits until the target listens on its whoami and iperf3 ports.
pub fn wait_listening(topo: &Topology, started: &mut [Started]) -> anyhow::Result<()> {
    let target = &topo.target;
    let mut wanted: Vec<String> = [target.whoami_port, target.iperf3_port]
        .iter()
        .map(|&p| SocketAddr::from((target.ip, p)).to_string())
        .collect();
    if let Some(ip6) = target.ip6 {
        wanted.extend(
            [target.whoami_port, target.iperf3_port]
                .map(|p| SocketAddr::from((ip6, p)).to_string()),
        );
    }
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    loop {
        for process in started.iter_mut() {
            process.check_running()?;
        }
        let listening = net::exec(&target.netns, "ss", &["-H", "-l", "-t", "-n"])?;
        let local: Vec<&str> = listening
            .lines()
            .filter_map(|l| l.split_whitespace().nth(3))
            .collect();
        if wanted.iter().all(|w| local.contains(&w.as_str())) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the target does not listen on {} after {}s",
                wanted.join(" and "),
                LISTEN_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
}

//! What a bench Pod runs (`egressgw bench-client`): one iperf3 run against
//! one server, the TCP handshake round trips to it, and what the node's
//! interfaces looked like, printed as one result line the runner finds in
//! the Pod's log.
//!
//! The egressgw image carries iperf3, so the bench needs no other image:
//! the nodes already have it, for the agents.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::echo;

/// The prefix of the line that carries a run's result.
pub const RESULT_PREFIX: &str = "egressgw-bench-result: ";
/// The prefix of the line that carries `--interfaces-only`'s report.
pub const INTERFACES_PREFIX: &str = "egressgw-bench-interfaces: ";
/// The prefix of the line that says why a run failed.
pub const ERROR_PREFIX: &str = "egressgw-bench-error: ";

/// `egressgw bench-client`: what one bench Pod runs.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// The iperf3 server.
    #[arg(long, value_name = "ADDR", required_unless_present = "interfaces_only")]
    pub server: Option<IpAddr>,
    /// Its port.
    #[arg(long, default_value_t = 5201)]
    pub port: u16,
    /// Send from this local address (iperf3 `-B`), e.g. the tunnel's.
    #[arg(long, value_name = "ADDR")]
    pub bind: Option<IpAddr>,
    /// Seconds of traffic.
    #[arg(long, default_value_t = 10)]
    pub duration: u32,
    /// Parallel streams (iperf3 `-P`).
    #[arg(long, default_value_t = 1)]
    pub streams: u32,
    /// The server sends, the client receives (iperf3 `-R`).
    #[arg(long)]
    pub reverse: bool,
    /// The source address the server must see (the EIP): the client waits
    /// until it does before it measures, and fails when the measured run
    /// came from another.
    #[arg(long, value_name = "ADDR")]
    pub expect_source: Option<IpAddr>,
    /// TCP handshakes to time after the run.
    #[arg(long, default_value_t = 200)]
    pub connects: u32,
    /// The server's TCP echo port (`egressgw bench-echo`): time round
    /// trips of small messages on one connection after the run.
    #[arg(long, value_name = "PORT")]
    pub echo_port: Option<u16>,
    /// Round trips to time against the echo server.
    #[arg(long, default_value_t = 2000)]
    pub round_trips: u32,
    /// Run on this CPU only (the round trips' client is pinned).
    #[arg(long, value_name = "CPU")]
    pub cpu: Option<usize>,
    /// Interfaces whose MTU and offloads to report (those that exist here).
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub interfaces: Vec<String>,
    /// Only report the interfaces (a line starting with
    /// `egressgw-bench-interfaces: `), measure nothing.
    #[arg(long)]
    pub interfaces_only: bool,
    /// How long to wait, in seconds, for the server to see the expected
    /// source (a new Pod is classified a moment after it has its address).
    #[arg(long, default_value_t = 30, hide = true)]
    pub source_wait: u64,
    /// The iperf3 program.
    #[arg(long, default_value = "iperf3", hide = true)]
    pub iperf3: PathBuf,
}

/// What one bench Pod measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClientResult {
    /// Bits per second the sender sent.
    pub sent_bps: f64,
    /// Bits per second the receiver received.
    pub received_bps: f64,
    /// TCP retransmits of the sender, where iperf3 knows them.
    pub retransmits: Option<u64>,
    /// The client's local address of the measured connection.
    pub local: String,
    /// The source address the server saw (from its own output).
    pub seen_from: Option<String>,
    /// TCP handshake round trips, in microseconds.
    pub connect_rtt_us: Vec<u64>,
    /// Round trips of small messages on one connection to the echo server,
    /// in microseconds (none without an echo port).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub round_trip_us: Vec<u64>,
    /// CPU use (percent) of the client's and the server's host, as iperf3
    /// reports it.
    pub cpu: Option<Cpu>,
    /// The interfaces asked for that exist in the Pod's network namespace.
    pub interfaces: Vec<Interface>,
    /// The node's load average (1, 5, 15 min) after the run.
    #[serde(default)]
    pub load_average: Option<String>,
    /// iperf3's `end` section, as it printed it.
    pub iperf3_end: Value,
}

/// iperf3's `cpu_utilization_percent`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Cpu {
    /// The client's host, all processes.
    pub host_total: f64,
    /// The server's host, all processes.
    pub remote_total: f64,
}

/// An interface of the Pod's network namespace.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    pub name: String,
    pub mtu: Option<u32>,
    /// `ethtool -k`'s tx-checksumming, read with ethtool netlink.
    pub tx_checksum: Option<bool>,
    /// The offloads in `ethtool -k`'s words.
    pub offloads: Option<String>,
}

/// Runs the client: prints the result line, or the error line and fails.
pub fn run(args: &ClientArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if args.interfaces_only {
        let interfaces = runtime.block_on(read_interfaces(&args.interfaces));
        println!("{INTERFACES_PREFIX}{}", serde_json::to_string(&interfaces)?);
        return Ok(());
    }
    let outcome = runtime.block_on(measure(args));
    match outcome {
        Ok(result) => {
            println!("{RESULT_PREFIX}{}", serde_json::to_string(&result)?);
            Ok(())
        }
        Err(e) => {
            println!("{ERROR_PREFIX}{e:#}");
            Err(e)
        }
    }
}

async fn measure(args: &ClientArgs) -> anyhow::Result<ClientResult> {
    let server = args.server.context("--server is needed")?;
    if let Some(cpu) = args.cpu {
        echo::pin(cpu)?;
    }
    let interfaces = read_interfaces(&args.interfaces).await;
    if let Some(expected) = args.expect_source {
        wait_for_source(args, server, expected).await?;
    }
    let json = iperf3(args, server, &["-t", &args.duration.to_string()]).await?;
    let mut result = parse_iperf3(&json)?;
    if let Some(expected) = args.expect_source
        && result.seen_from.as_deref() != Some(expected.to_string().as_str())
    {
        bail!(
            "the server saw the measured run from {}, not from {expected}",
            result
                .seen_from
                .as_deref()
                .unwrap_or("an address it did not report")
        );
    }
    result.connect_rtt_us = connect_rtts(args, server).await?;
    if let Some(port) = args.echo_port {
        let echo = SocketAddr::new(server, port);
        result.round_trip_us = echo::round_trips(echo, args.bind, args.round_trips).await?;
    }
    result.load_average = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    result.interfaces = interfaces;
    Ok(result)
}

/// Runs small iperf3 tests until the server reports `expected` as their
/// source: a Pod is classified a moment after it gets its address.
async fn wait_for_source(
    args: &ClientArgs,
    server: IpAddr,
    expected: IpAddr,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let limit = Duration::from_secs(args.source_wait);
    let mut last = String::from("no answer yet");
    while start.elapsed() < limit {
        // Once each time: a busy server is tried again here, within the
        // wait's own bound.
        match iperf3_once(args, server, &["-n", "64K"])
            .await
            .and_then(|j| parse_iperf3(&j))
        {
            Ok(r) if r.seen_from.as_deref() == Some(expected.to_string().as_str()) => {
                return Ok(());
            }
            Ok(r) => {
                last = format!(
                    "the server saw {}",
                    r.seen_from.as_deref().unwrap_or("an unreported address")
                );
            }
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    bail!(
        "the server did not see {expected} as the source within {} s ({last}): \
         is the Pod selected by the bench's policy, and is the policy Ready?",
        args.source_wait
    )
}

/// How long a run waits for a server still busy with another test: an
/// iperf3 server takes one test at a time, and one that just ended (or
/// whose client vanished) may refuse the next for a moment.
const BUSY_WAIT: Duration = Duration::from_secs(20);

/// Runs iperf3 with `extra` arguments and returns its JSON, failing with
/// iperf3's own error when it reports one; tries again while the server
/// says it is busy, for [`BUSY_WAIT`] at most. Killed when it overruns.
async fn iperf3(args: &ClientArgs, server: IpAddr, extra: &[&str]) -> anyhow::Result<Value> {
    let start = Instant::now();
    loop {
        match iperf3_once(args, server, extra).await {
            Err(e) if server_busy(&e) && start.elapsed() < BUSY_WAIT => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            result => return result,
        }
    }
}

/// Whether iperf3 failed because its server was running another test.
fn server_busy(error: &anyhow::Error) -> bool {
    format!("{error:#}").contains("server is busy")
}

/// One iperf3 run: see [`iperf3`].
async fn iperf3_once(args: &ClientArgs, server: IpAddr, extra: &[&str]) -> anyhow::Result<Value> {
    let mut command = tokio::process::Command::new(&args.iperf3);
    command
        .args(["-c", &server.to_string(), "-p", &args.port.to_string()])
        .args(["-J", "--get-server-output", "--connect-timeout", "3000"])
        .args(["-P", &args.streams.to_string()])
        .args(extra)
        .kill_on_drop(true);
    if args.reverse {
        command.arg("-R");
    }
    if let Some(bind) = args.bind {
        command.args(["-B", &bind.to_string()]);
    }
    let limit = Duration::from_secs(u64::from(args.duration) + 30);
    let output = tokio::time::timeout(limit, command.output())
        .await
        .with_context(|| format!("iperf3 did not finish within {} s", limit.as_secs()))?
        .with_context(|| format!("running {}", args.iperf3.display()))?;
    let json: Value = serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "iperf3 printed no JSON (exit status {}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )
    })?;
    if let Some(error) = json.get("error").and_then(Value::as_str) {
        bail!("iperf3: {error}");
    }
    Ok(json)
}

/// The result of one iperf3 `-J --get-server-output` run (the connect
/// round trips and interfaces are left empty).
pub fn parse_iperf3(json: &Value) -> anyhow::Result<ClientResult> {
    let end = json.get("end").context("iperf3's JSON has no `end`")?;
    let bps = |section: &str| {
        end.pointer(&format!("/{section}/bits_per_second"))
            .and_then(Value::as_f64)
            .with_context(|| format!("iperf3's JSON has no end.{section}.bits_per_second"))
    };
    let cpu = end.get("cpu_utilization_percent").and_then(|c| {
        Some(Cpu {
            host_total: c.get("host_total")?.as_f64()?,
            remote_total: c.get("remote_total")?.as_f64()?,
        })
    });
    Ok(ClientResult {
        sent_bps: bps("sum_sent")?,
        received_bps: bps("sum_received")?,
        retransmits: end.pointer("/sum_sent/retransmits").and_then(Value::as_u64),
        local: json
            .pointer("/start/connected/0/local_host")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        seen_from: seen_from(json),
        connect_rtt_us: Vec::new(),
        round_trip_us: Vec::new(),
        cpu,
        interfaces: Vec::new(),
        load_average: None,
        iperf3_end: end.clone(),
    })
}

/// The address the server accepted the test from, from its JSON output
/// (a server run with `-J`) or its text (`Accepted connection from ADDR,
/// port N`).
fn seen_from(json: &Value) -> Option<String> {
    if let Some(host) = json
        .pointer("/server_output_json/start/accepted_connection/host")
        .and_then(Value::as_str)
    {
        return Some(host.to_owned());
    }
    let text = json.get("server_output_text")?.as_str()?;
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("Accepted connection from ")?;
        Some(rest.split(',').next()?.trim().to_owned())
    })
}

/// A TCP socket of `server`'s family, bound to `bind` when given.
pub fn socket_to(
    server: SocketAddr,
    bind: Option<IpAddr>,
) -> anyhow::Result<tokio::net::TcpSocket> {
    let socket = match server {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .context("opening a socket")?;
    if let Some(bind) = bind {
        socket
            .bind(SocketAddr::new(bind, 0))
            .with_context(|| format!("binding to {bind}"))?;
    }
    Ok(socket)
}

/// Times `args.connects` TCP handshakes to the server, 5 ms apart, each
/// closed at once: the time from the SYN to the server's answer (a SYN-ACK,
/// or a reset while no socket listens), one round trip through the path.
async fn connect_rtts(args: &ClientArgs, server: IpAddr) -> anyhow::Result<Vec<u64>> {
    let server = SocketAddr::new(server, args.port);
    let mut rtts = Vec::with_capacity(args.connects as usize);
    for _ in 0..args.connects {
        let socket = socket_to(server, args.bind)?;
        let start = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(3), socket.connect(server))
            .await
            .with_context(|| format!("connecting to {server}: no answer within 3 s"))?;
        // A reset answers the SYN as well as a SYN-ACK does: iperf3's server
        // closes its listening socket for a moment after every test (and
        // resets what waited in its queue).
        match answer {
            Ok(stream) => drop(stream),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
                ) => {}
            Err(e) => return Err(e).with_context(|| format!("connecting to {server}")),
        }
        rtts.push(u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(rtts)
}

/// MTU and offloads of each named interface that exists here.
async fn read_interfaces(names: &[String]) -> Vec<Interface> {
    let mut found = Vec::new();
    for name in names {
        let sys = PathBuf::from("/sys/class/net").join(name);
        if !sys.exists() {
            continue;
        }
        let mtu = std::fs::read_to_string(sys.join("mtu"))
            .ok()
            .and_then(|m| m.trim().parse().ok());
        let offloads = egressgw_dataplane::ethtool::read_offloads(name).await.ok();
        found.push(Interface {
            name: name.clone(),
            mtu,
            tx_checksum: offloads.as_ref().map(|o| o.tx_checksum),
            offloads: offloads.map(|o| o.summary()),
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(server_output: Value) -> Value {
        let mut json = serde_json::json!({
            "start": {"connected": [{"local_host": "10.244.3.130", "remote_host": "198.51.100.1"}]},
            "end": {
                "sum_sent": {"bits_per_second": 9.0e9, "retransmits": 12},
                "sum_received": {"bits_per_second": 8.9e9},
                "cpu_utilization_percent": {"host_total": 40.5, "remote_total": 20.25}
            }
        });
        if let (Some(map), Value::Object(extra)) = (json.as_object_mut(), server_output) {
            map.extend(extra);
        }
        json
    }

    #[test]
    fn a_run_is_read_from_iperf3_json_with_the_source_the_text_server_saw() {
        let json = sample(serde_json::json!({"server_output_text":
            "-----\nAccepted connection from 198.51.100.200, port 41234\n[  5] local ..."}));
        let r = parse_iperf3(&json).unwrap();
        assert_eq!((r.sent_bps, r.received_bps), (9.0e9, 8.9e9));
        assert_eq!(r.retransmits, Some(12));
        assert_eq!(r.local, "10.244.3.130");
        assert_eq!(r.seen_from.as_deref(), Some("198.51.100.200"));
        assert_eq!(
            r.cpu,
            Some(Cpu {
                host_total: 40.5,
                remote_total: 20.25
            })
        );
    }

    #[test]
    fn a_json_server_reports_the_source_in_its_accepted_connection() {
        let json = sample(serde_json::json!({"server_output_json":
            {"start": {"accepted_connection": {"host": "2001:db8::7", "port": 5}}}}));
        assert_eq!(
            parse_iperf3(&json).unwrap().seen_from.as_deref(),
            Some("2001:db8::7")
        );
    }

    #[test]
    fn a_run_without_server_output_has_no_source() {
        let r = parse_iperf3(&sample(Value::Null)).unwrap();
        assert_eq!(r.seen_from, None);
    }

    /// Client arguments running `iperf3` (a stand-in) against a server.
    fn client_args(iperf3: &std::path::Path) -> ClientArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ClientArgs,
        }
        let iperf3 = iperf3.display().to_string();
        let argv = ["bench-client", "--server", "192.0.2.1", "--iperf3", &iperf3];
        <Cli as clap::Parser>::parse_from(argv).args
    }

    /// A directory of its own for one test, empty.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("egressgw-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A stand-in for iperf3 in `dir`: its first `busy` runs print what a
    /// busy server makes iperf3 print, later ones `then`; it counts its
    /// runs in `dir/runs`.
    fn stand_in(dir: &std::path::Path, busy: u32, then: &Value) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(dir.join("then.json"), then.to_string()).unwrap();
        let script = format!(
            "#!/bin/sh\n\
             n=$(cat {dir}/runs 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {dir}/runs\n\
             if [ $n -le {busy} ]; then\n\
             echo '{{\"error\": \"the server is busy running a test. try again later\"}}'\n\
             exit 1\n\
             fi\n\
             cat {dir}/then.json\n",
            dir = dir.display()
        );
        let path = dir.join("iperf3");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn runs(dir: &std::path::Path) -> u32 {
        std::fs::read_to_string(dir.join("runs"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[tokio::test]
    async fn a_run_waits_for_a_server_busy_with_another_test() {
        let dir = scratch("busy-server");
        let args = client_args(&stand_in(&dir, 2, &sample(Value::Null)));
        let json = iperf3(&args, args.server.unwrap(), &["-t", "1"])
            .await
            .unwrap();
        assert_eq!(parse_iperf3(&json).unwrap().received_bps, 8.9e9);
        assert_eq!(runs(&dir), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn another_error_of_iperf3_fails_the_run_at_once() {
        let dir = scratch("refused");
        let refused =
            serde_json::json!({"error": "unable to connect to server: Connection refused"});
        let args = client_args(&stand_in(&dir, 0, &refused));
        let err = iperf3(&args, args.server.unwrap(), &["-t", "1"])
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "iperf3: unable to connect to server: Connection refused"
        );
        assert_eq!(runs(&dir), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn json_without_an_end_is_an_error() {
        let err = parse_iperf3(&serde_json::json!({"start": {}})).unwrap_err();
        assert!(err.to_string().contains("no `end`"), "{err}");
    }
}

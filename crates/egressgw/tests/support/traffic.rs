//! Real traffic: small TCP services and clients that run on threads inside
//! a namespace, iperf3, and interface counters. Every run is bounded in
//! size and time.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::netns::{Netns, Stack};
use super::process::{Background, run_bounded};

/// Port of the whoami service (answers with the peer address it saw).
pub const WHOAMI_PORT: u16 = 8080;
/// Port of the source service (sends [`SOURCE_BYTES`] and closes).
pub const SOURCE_PORT: u16 = 8081;
/// Port of the sink service (reads to EOF, answers with the byte count).
pub const SINK_PORT: u16 = 8082;
/// Port of iperf3.
pub const IPERF3_PORT: u16 = 5201;
/// What the source service sends per connection.
pub const SOURCE_BYTES: usize = 8 << 20;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(15);

/// What a [`Server`] does with each connection.
#[derive(Debug, Clone, Copy)]
pub enum Service {
    /// Writes the peer's address and a newline, then closes.
    Whoami,
    /// Writes [`SOURCE_BYTES`] bytes, then closes.
    Source,
    /// Reads to EOF, then writes the byte count and a newline.
    Sink,
}

impl Service {
    fn port(self) -> u16 {
        match self {
            Self::Whoami => WHOAMI_PORT,
            Self::Source => SOURCE_PORT,
            Self::Sink => SINK_PORT,
        }
    }
}

/// A TCP service listening on every address of a namespace; stops on drop.
#[derive(Debug)]
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts `service` on its port in `ns`, for IPv4 only.
    pub fn start(ns: &Netns, service: Service) -> Self {
        Self::start_for(ns, service, Stack::Ipv4)
    }

    /// Starts `service` on its port in `ns`, for the families of `stack`:
    /// [`Stack::Dual`] listens on `[::]`, which takes IPv4 connections too
    /// (`net.ipv6.bindv6only` is 0 in a new namespace); their peers, seen
    /// as `::ffff:a.b.c.d`, are reported as the IPv4 address.
    pub fn start_for(ns: &Netns, service: Service, stack: Stack) -> Self {
        let port = service.port();
        let any: IpAddr = match stack {
            Stack::Ipv4 => Ipv4Addr::UNSPECIFIED.into(),
            Stack::Dual => Ipv6Addr::UNSPECIFIED.into(),
        };
        let listener = ns
            .enter(move || TcpListener::bind((any, port)))
            .unwrap_or_else(|e| panic!("listening on :{port} in {}: {e}", ns.name()));
        listener
            .set_nonblocking(true)
            .expect("a listener can be made non-blocking");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        thread::spawn(move || serve(stream, peer, service));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => {
                        eprintln!("accept on :{port}: {e}");
                        thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut stream: TcpStream, peer: SocketAddr, service: Service) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    // The client sees a failure as a short or missing answer.
    let _ = match service {
        Service::Whoami => writeln!(stream, "{}", peer.ip().to_canonical()),
        Service::Source => send_bytes(&mut stream, SOURCE_BYTES),
        Service::Sink => {
            let n = std::io::copy(&mut stream, &mut std::io::sink());
            n.and_then(|n| writeln!(stream, "{n}"))
        }
    };
}

fn send_bytes(stream: &mut TcpStream, mut n: usize) -> std::io::Result<()> {
    let chunk = [0x5a_u8; 64 * 1024];
    while n > 0 {
        let len = n.min(chunk.len());
        stream.write_all(&chunk[..len])?;
        n -= len;
    }
    Ok(())
}

/// Connects from inside `ns`, with connect and I/O timeouts.
fn connect(ns: &Netns, ip: &str, port: u16) -> Result<TcpStream, String> {
    let addr = SocketAddr::new(ip.parse().expect("a valid test address"), port);
    let stream = ns
        .enter(move || TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT))
        .map_err(|e| format!("connecting from {} to {addr}: {e}", ns.name()))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
        .map_err(|e| format!("setting timeouts: {e}"))?;
    Ok(stream)
}

/// Asks the whoami service at `ip` from `ns`: the source address it saw.
pub fn whoami(ns: &Netns, ip: &str) -> Result<IpAddr, String> {
    let mut stream = connect(ns, ip, WHOAMI_PORT)?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .map_err(|e| format!("reading whoami from {ip} in {}: {e}", ns.name()))?;
    answer
        .trim()
        .parse()
        .map_err(|e| format!("whoami from {ip} answered {answer:?}: {e}"))
}

/// [`whoami`] from a fixed source port, giving up after `timeout`: shorter
/// than TCP's first retransmission (1 s), it asks whether the first SYN
/// got through.
pub fn whoami_from_port(
    ns: &Netns,
    ip: &str,
    port: u16,
    timeout: Duration,
) -> Result<IpAddr, String> {
    let dst = SocketAddr::new(ip.parse().expect("a valid test address"), WHOAMI_PORT);
    let src = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
    let stream = ns
        .enter(move || -> std::io::Result<TcpStream> {
            let socket = socket2::Socket::new(
                socket2::Domain::IPV4,
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            socket.set_reuse_address(true)?;
            socket.bind(&src.into())?;
            socket.connect_timeout(&dst.into(), timeout)?;
            Ok(socket.into())
        })
        .map_err(|e| format!("connecting from {} port {port} to {dst}: {e}", ns.name()))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| format!("setting timeouts: {e}"))?;
    let mut answer = String::new();
    (&stream)
        .read_to_string(&mut answer)
        .map_err(|e| format!("reading whoami from {ip} in {}: {e}", ns.name()))?;
    answer
        .trim()
        .parse()
        .map_err(|e| format!("whoami from {ip} answered {answer:?}: {e}"))
}

/// Downloads from the source service at `ip`; returns the bytes received.
pub fn download(ns: &Netns, ip: &str) -> Result<usize, String> {
    let mut stream = connect(ns, ip, SOURCE_PORT)?;
    let n = std::io::copy(&mut stream, &mut std::io::sink())
        .map_err(|e| format!("downloading from {ip} in {}: {e}", ns.name()))?;
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

/// Sends `bytes` bytes to the sink service at `ip`; returns the count the
/// sink confirmed.
pub fn upload(ns: &Netns, ip: &str, bytes: usize) -> Result<usize, String> {
    let mut stream = connect(ns, ip, SINK_PORT)?;
    send_bytes(&mut stream, bytes).map_err(|e| format!("uploading to {ip}: {e}"))?;
    stream
        .shutdown(Shutdown::Write)
        .map_err(|e| format!("closing the upload to {ip}: {e}"))?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .map_err(|e| format!("reading the sink's count from {ip}: {e}"))?;
    answer
        .trim()
        .parse()
        .map_err(|e| format!("the sink at {ip} answered {answer:?}: {e}"))
}

/// Byte counters of one interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

/// The counters of `dev` in `ns` (`ip -s -j link show`).
pub fn counters(ns: &Netns, dev: &str) -> Counters {
    let text = ns.ip(&["-s", "-j", "link", "show", "dev", dev]);
    let json: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("parsing `ip -s -j link show dev {dev}`: {e}: {text}"));
    let stats = &json[0]["stats64"];
    let get = |dir: &str| {
        stats[dir]["bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("no {dir} bytes for {dev} in {}: {text}", ns.name()))
    };
    Counters {
        rx_bytes: get("rx"),
        tx_bytes: get("tx"),
    }
}

/// Starts a one-shot iperf3 server (`iperf3 -s -1`) in `ns` and waits until
/// it listens.
pub fn iperf3_server(ns: &Netns) -> Background {
    let port = IPERF3_PORT.to_string();
    let server = Background::spawn(&mut ns.command("iperf3", &["-s", "-1", "-p", &port]));
    let deadline = Instant::now() + Duration::from_secs(10);
    let filter = format!("sport = :{IPERF3_PORT}");
    while ns.run("ss", &["-Hltn", &filter]).trim().is_empty() {
        assert!(
            Instant::now() < deadline,
            "iperf3 in {} does not listen",
            ns.name()
        );
        thread::sleep(Duration::from_millis(20));
    }
    server
}

/// Starts an iperf3 TCP client in `ns` towards `ip`, for `seconds`, with JSON
/// output; finish it with [`iperf3_result`].
pub fn iperf3_client(ns: &Netns, ip: &str, seconds: u32) -> Background {
    let port = IPERF3_PORT.to_string();
    let secs = seconds.to_string();
    Background::spawn(&mut ns.command(
        "iperf3",
        &[
            "-c",
            ip,
            "-p",
            &port,
            "-t",
            &secs,
            "-J",
            "--connect-timeout",
            "5000",
        ],
    ))
}

/// Waits for an iperf3 client and returns the bytes the server received, or
/// what went wrong.
pub fn iperf3_result(client: Background, seconds: u32) -> Result<u64, String> {
    let json = iperf3_report(client, seconds)?;
    json["end"]["sum_received"]["bytes"]
        .as_u64()
        .ok_or_else(|| format!("iperf3 reported no received bytes: {json}"))
}

/// Waits for an iperf3 client and returns its JSON report, or what went
/// wrong.
pub fn iperf3_report(client: Background, seconds: u32) -> Result<serde_json::Value, String> {
    let out = client.finish(Duration::from_secs(u64::from(seconds) + 30));
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        format!(
            "iperf3 printed no JSON ({e}): {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(error) = json.get("error") {
        return Err(format!("iperf3: {error}"));
    }
    if !out.status.success() {
        return Err(format!("iperf3 exited with {}: {text}", out.status));
    }
    Ok(json)
}

/// Runs iperf3 in `ns` to a fresh one-shot server in `server_ns`.
pub fn iperf3(ns: &Netns, server_ns: &Netns, ip: &str, seconds: u32) -> Result<u64, String> {
    let _server = iperf3_server(server_ns);
    iperf3_result(iperf3_client(ns, ip, seconds), seconds)
}

/// `ethtool -k DEV` in `ns`: the value of `feature` (`on`/`off`), with any
/// `[fixed]` or `[requested ...]` note dropped.
pub fn ethtool_feature(ns: &Netns, dev: &str, feature: &str) -> String {
    let out = run_bounded(
        &mut ns.command("ethtool", &["-k", dev]),
        super::process::SETUP_LIMIT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ethtool -k {dev} in {} failed: {text}{}",
        ns.name(),
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = format!("{feature}:");
    text.lines()
        .find_map(|l| l.trim().strip_prefix(&prefix))
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {feature} in ethtool -k {dev}: {text}"))
        .to_owned()
}

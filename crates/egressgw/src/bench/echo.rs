//! The bench's round trips: a TCP echo server (`egressgw bench-echo`, on
//! the gateway node for cases 1 and 2 and at the target for case 3) and
//! the client's ping-pong against it. One small message goes out, the
//! client waits for it to come back, and sends the next: each exchange is
//! one round trip through the path, on one open connection, so the time
//! is the path's and not a handshake's.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;

/// Bytes per message: a small request, as a database query's.
pub const MESSAGE: usize = 64;
/// Exchanges before the timed ones (the connection and caches warm up).
const WARMUP: u32 = 100;
/// How long one exchange may take before the run fails.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(3);

/// `egressgw bench-echo`.
#[derive(Debug, Clone, clap::Args)]
pub struct EchoArgs {
    /// Port to listen on (every address, IPv4 and IPv6).
    #[arg(long, default_value_t = 5202)]
    pub port: u16,
    /// Run on this CPU only.
    #[arg(long, value_name = "CPU")]
    pub cpu: Option<usize>,
}

/// Serves until killed: each connection gets back what it sends.
pub fn serve(args: &EchoArgs) -> anyhow::Result<()> {
    if let Some(cpu) = args.cpu {
        pin(cpu)?;
    }
    let listen = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), args.port);
    let listener = TcpListener::bind(listen)
        .or_else(|_| TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], args.port))))
        .with_context(|| format!("listening on port {}", args.port))?;
    println!("bench-echo: listening on port {}", args.port);
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                thread::spawn(move || {
                    if let Err(e) = echo(stream) {
                        eprintln!("bench-echo: {e:#}");
                    }
                });
            }
            Err(e) => eprintln!("bench-echo: accepting a connection: {e}"),
        }
    }
    Ok(())
}

fn echo(mut stream: TcpStream) -> anyhow::Result<()> {
    let peer = stream.peer_addr().context("reading the peer address")?;
    stream.set_nodelay(true).context("setting TCP_NODELAY")?;
    let mut buf = [0u8; 4096];
    loop {
        let n = stream
            .read(&mut buf)
            .with_context(|| format!("reading from {peer}"))?;
        if n == 0 {
            return Ok(());
        }
        stream
            .write_all(&buf[..n])
            .with_context(|| format!("answering {peer}"))?;
    }
}

/// Keeps this thread (and the threads it starts) on `cpu`.
pub fn pin(cpu: usize) -> anyhow::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)
        .with_context(|| format!("CPU {cpu} is beyond what a CPU set holds"))?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .with_context(|| format!("pinning to CPU {cpu}"))
}

/// `count` timed exchanges of [`MESSAGE`] bytes with the echo server at
/// `server`, after a warm-up, from `bind` when given: each one's round
/// trip in microseconds. The exchanges block on the socket (no runtime
/// between the kernel and the clock).
pub async fn round_trips(
    server: SocketAddr,
    bind: Option<IpAddr>,
    count: u32,
) -> anyhow::Result<Vec<u64>> {
    let stream = connect(server, bind).await?.into_std()?;
    stream
        .set_nonblocking(false)
        .context("making the socket blocking")?;
    tokio::task::spawn_blocking(move || exchange(stream, server, count))
        .await
        .context("the round trips' thread")?
}

fn exchange(mut stream: TcpStream, server: SocketAddr, count: u32) -> anyhow::Result<Vec<u64>> {
    stream.set_nodelay(true).context("setting TCP_NODELAY")?;
    stream
        .set_read_timeout(Some(EXCHANGE_TIMEOUT))
        .context("setting a read timeout")?;
    let message = [0x5a_u8; MESSAGE];
    let mut answer = [0u8; MESSAGE];
    let mut times = Vec::with_capacity(count as usize);
    for i in 0..WARMUP + count {
        let start = Instant::now();
        stream
            .write_all(&message)
            .with_context(|| format!("sending to the echo server at {server}"))?;
        stream.read_exact(&mut answer).with_context(|| {
            format!(
                "reading the echo of {server}: no answer within {} s",
                EXCHANGE_TIMEOUT.as_secs()
            )
        })?;
        if i >= WARMUP {
            times.push(u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX));
        }
    }
    anyhow::ensure!(
        answer == message,
        "the echo server at {server} answered with other bytes than it was sent"
    );
    Ok(times)
}

async fn connect(
    server: SocketAddr,
    bind: Option<IpAddr>,
) -> anyhow::Result<tokio::net::TcpStream> {
    let socket = super::client::socket_to(server, bind)?;
    let what = || {
        format!(
            "connecting to the echo server at {server} (run `egressgw bench-echo --port {}` \
             there, or leave out --echo-port)",
            server.port()
        )
    };
    tokio::time::timeout(EXCHANGE_TIMEOUT, socket.connect(server))
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {} s", EXCHANGE_TIMEOUT.as_secs()))
        .with_context(what)?
        .with_context(what)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_ping_pong_against_the_echo_server_times_each_exchange() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || echo(listener.accept().unwrap().0));
        let times = runtime().block_on(round_trips(addr, None, 50)).unwrap();
        assert_eq!(times.len(), 50);
        assert!(times.iter().all(|t| *t < 3_000_000), "{times:?}");
    }

    #[test]
    fn no_echo_server_is_named_with_what_to_do() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let err = runtime().block_on(round_trips(addr, None, 1)).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("egressgw bench-echo --port"), "{text}");
        assert!(text.contains(&addr.to_string()), "{text}");
    }
}

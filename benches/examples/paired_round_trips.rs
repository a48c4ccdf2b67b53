//! Paired round trips: what one path adds to another's round trip,
//! measured so that the machine's drift cancels out (docs/ebpf.md, "The
//! round trip, paired").
//!
//! `paired_round_trips CPU COUNT NETNS=ADDR:PORT NETNS=ADDR:PORT...`
//!
//! Opens one TCP connection per argument, each from inside the named
//! network namespace (`/run/netns/NETNS`) to an echo server
//! (`egressgw bench-echo`), then, pinned to `CPU`, times `COUNT` rounds:
//! in each round one 64-byte exchange on every connection, the order
//! rotating from round to round. A round's exchanges are microseconds
//! apart, so whatever slows the machine down (a neighbour on the host,
//! a CPU's frequency) slows them alike; the difference to the first
//! connection's exchange of the same round is what its path adds. Prints,
//! per connection, the median and 10th percentile of its round trip and
//! the median of the per-round differences with the first (with the
//! quartiles), in µs.
//!
//! Run it as root on the lab's host. With the echo servers on the same
//! CPU as this client, a round trip is the CPU time of the path and two
//! task switches (no wake-up of another CPU); on another CPU, it includes
//! the wake-ups.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::Instant;

use nix::sched::{CloneFlags, CpuSet, sched_setaffinity, setns};
use nix::unistd::Pid;

/// Bytes per exchange, as the bench's round trips.
const MESSAGE: usize = 64;
/// Rounds before the timed ones.
const WARMUP: usize = 200;

type Error = Box<dyn std::error::Error>;

/// A connection from `netns` to `server`. The thread stays in `netns`
/// afterwards; sockets keep the namespace they were made in.
fn connect(netns: &str, server: SocketAddr) -> Result<TcpStream, Error> {
    let path = format!("/run/netns/{netns}");
    let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| format!("entering {path}: {e}"))?;
    let stream = TcpStream::connect(server).map_err(|e| format!("{server} from {netns}: {e}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// One exchange, in nanoseconds.
fn exchange(stream: &mut TcpStream) -> Result<u64, Error> {
    let message = [0x5a_u8; MESSAGE];
    let mut answer = [0_u8; MESSAGE];
    let start = Instant::now();
    stream.write_all(&message)?;
    stream.read_exact(&mut answer)?;
    let took = start.elapsed();
    if answer != message {
        return Err("the echo server answered with other bytes".into());
    }
    Ok(u64::try_from(took.as_nanos())?)
}

/// The `q` quantile of sorted `v`, in µs.
fn quantile<T: Copy + Into<f64>>(v: &[T], q: f64) -> f64 {
    let at = ((v.len() - 1) as f64 * q).round() as usize;
    v[at].into() / 1000.0
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: paired_round_trips CPU COUNT NETNS=ADDR:PORT NETNS=ADDR:PORT...";
    let [cpu, count, paths @ ..] = args.as_slice() else {
        return Err(usage.into());
    };
    if paths.len() < 2 {
        return Err(usage.into());
    }
    let count: usize = count.parse()?;
    let mut set = CpuSet::new();
    set.set(cpu.parse()?)?;
    sched_setaffinity(Pid::from_raw(0), &set)?;
    let mut streams = Vec::new();
    for path in paths {
        let (netns, server) = path.split_once('=').ok_or(usage)?;
        streams.push(connect(netns, server.parse()?)?);
    }
    let n = streams.len();
    let mut times = vec![Vec::with_capacity(count); n];
    for round in 0..WARMUP + count {
        let mut this = vec![0_u64; n];
        for k in 0..n {
            let i = (round + k) % n;
            this[i] = exchange(&mut streams[i])?;
        }
        if round >= WARMUP {
            for (t, took) in times.iter_mut().zip(this) {
                t.push(took);
            }
        }
    }
    for (i, path) in paths.iter().enumerate() {
        let mut diffs: Vec<i32> = times[i]
            .iter()
            .zip(&times[0])
            .map(|(t, base)| i32::try_from(i64::try_from(*t)? - i64::try_from(*base)?))
            .collect::<Result<_, _>>()
            .map_err(|_| "a round trip of more than 2 s")?;
        diffs.sort_unstable();
        let mut own = times[i].clone();
        own.sort_unstable();
        let own: Vec<u32> = own
            .into_iter()
            .map(|t| u32::try_from(t).unwrap_or(u32::MAX))
            .collect();
        println!(
            "{path}: p50 {:.1} p10 {:.1} µs; added to the first: p50 {:+.2} (quartiles {:+.2} to {:+.2}) µs",
            quantile(&own, 0.5),
            quantile(&own, 0.1),
            quantile(&diffs, 0.5),
            quantile(&diffs, 0.25),
            quantile(&diffs, 0.75),
        );
    }
    Ok(())
}

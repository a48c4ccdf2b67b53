//! Paired round trips: what one path adds to another's round trip,
//! measured so that the machine's drift hits both alike (docs/ebpf.md,
//! "The round trip, paired").
//!
//! `paired_round_trips CPU COUNT NETNS=ADDR:PORT NETNS=ADDR:PORT...`
//!
//! Opens one TCP connection per argument, each from inside the named
//! network namespace (`/run/netns/NETNS`) to an echo server
//! (`egressgw bench-echo`), then, pinned to `CPU`, times `COUNT` rounds:
//! in each round one 64-byte exchange on every connection, in an order
//! that changes from round to round (every rotation, forwards and
//! backwards: for three connections every order, so each follows each
//! other as often). A round's exchanges are microseconds apart, so
//! whatever slows the machine down (a neighbour on the host, a CPU's
//! frequency) slows them alike; the difference to the first connection's
//! exchange of the same round is what its path adds. Prints,
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
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, CpuSet, sched_setaffinity, setns};
use nix::unistd::Pid;

/// Bytes per exchange, as the bench's round trips.
const MESSAGE: usize = 64;
/// Rounds before the timed ones.
const WARMUP: usize = 200;
/// How long a connection or an exchange may take before the run fails.
const TIMEOUT: Duration = Duration::from_secs(3);

type Error = Box<dyn std::error::Error>;

/// A connection from `netns` to `server`. The thread stays in `netns`
/// afterwards; sockets keep the namespace they were made in.
fn connect(netns: &str, server: SocketAddr) -> Result<TcpStream, Error> {
    let path = format!("/run/netns/{netns}");
    let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| format!("entering {path}: {e}"))?;
    let stream = TcpStream::connect_timeout(&server, TIMEOUT).map_err(|e| {
        format!("{server} from {netns}: {e} (is `egressgw bench-echo` listening there?)")
    })?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    Ok(stream)
}

/// One exchange, in µs.
fn exchange(stream: &mut TcpStream) -> Result<f64, Error> {
    let message = [0x5a_u8; MESSAGE];
    let mut answer = [0_u8; MESSAGE];
    let start = Instant::now();
    stream.write_all(&message)?;
    stream.read_exact(&mut answer)?;
    let took = start.elapsed();
    if answer != message {
        return Err("the echo server answered with other bytes".into());
    }
    Ok(took.as_secs_f64() * 1e6)
}

/// The `q` quantile (nearest rank) of `v`, sorted in place.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    let at = ((v.len() - 1) as f64 * q).round() as usize;
    v[at]
}

/// Which connection round `round`'s `k`-th exchange is on, of `n`: the
/// rotations forwards, then backwards.
fn order(round: usize, k: usize, n: usize) -> usize {
    let start = round % n;
    if (round / n).is_multiple_of(2) {
        (start + k) % n
    } else {
        (start + n - k) % n
    }
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
    if count == 0 {
        return Err("COUNT must be at least 1".into());
    }
    let mut set = CpuSet::new();
    set.set(cpu.parse()?)?;
    sched_setaffinity(Pid::from_raw(0), &set)?;
    let mut streams = Vec::new();
    for path in paths {
        let (netns, server) = path.split_once('=').ok_or(usage)?;
        streams.push(connect(netns, server.parse()?)?);
    }
    let n = streams.len();
    let mut times: Vec<Vec<f64>> = (0..n).map(|_| Vec::with_capacity(count)).collect();
    for round in 0..WARMUP + count {
        let mut this = vec![0.0; n];
        for k in 0..n {
            let i = order(round, k, n);
            this[i] = exchange(&mut streams[i])?;
        }
        if round >= WARMUP {
            for (t, took) in times.iter_mut().zip(this) {
                t.push(took);
            }
        }
    }
    for (i, path) in paths.iter().enumerate() {
        let mut diffs: Vec<f64> = times[i].iter().zip(&times[0]).map(|(t, b)| t - b).collect();
        let mut own = times[i].clone();
        println!(
            "{path}: p50 {:.1} p10 {:.1} µs; added to the first: p50 {:+.2} (quartiles {:+.2} to {:+.2}) µs",
            quantile(&mut own, 0.5),
            quantile(&mut own, 0.1),
            quantile(&mut diffs, 0.5),
            quantile(&mut diffs, 0.25),
            quantile(&mut diffs, 0.75),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::order;

    #[test]
    fn three_connections_take_every_order_and_follow_each_other_alike() {
        let orders: Vec<Vec<usize>> = (0..6)
            .map(|r| (0..3).map(|k| order(r, k, 3)).collect())
            .collect();
        let mut sorted = orders.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 6, "{orders:?}");
        let mut follows = [[0; 3]; 3];
        for o in &orders {
            for w in o.windows(2) {
                follows[w[1]][w[0]] += 1;
            }
        }
        for (a, row) in follows.iter().enumerate() {
            for (b, count) in row.iter().enumerate() {
                assert_eq!(*count, if a == b { 0 } else { 2 }, "{orders:?}");
            }
        }
    }
}

//! Real traffic from pod namespaces to the target: whoami probes (what
//! source address the target saw), a background prober that records every
//! answer with its time, and bounded iperf3 runs.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::lab::probe;
use crate::lab::topology::Netns;

/// How long one probe may take to connect, and then to read the answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1000);
/// The same for a [`Prober`] that probes every 100 ms: a lost SYN is
/// retransmitted only after a second, so a longer wait would only blur the
/// measurement.
pub const FAST_PROBE_TIMEOUT: Duration = Duration::from_millis(300);

/// What one probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// The target answered: it saw this source address.
    Source(IpAddr),
    /// No answer (unreachable, timed out, reset), or an answer that is not an address.
    NoAnswer(String),
}

impl Seen {
    pub fn is(&self, expected: &Expect) -> bool {
        match (self, expected) {
            (Seen::Source(seen), Expect::Source(want)) => seen == want,
            (Seen::NoAnswer(_), Expect::NoAnswer) => true,
            _ => false,
        }
    }
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Seen::Source(ip) => write!(f, "{ip}"),
            Seen::NoAnswer(why) => write!(f, "no answer ({why})"),
        }
    }
}

/// What a probe should see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Source(IpAddr),
    NoAnswer,
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expect::Source(ip) => write!(f, "{ip}"),
            Expect::NoAnswer => f.write_str("no answer"),
        }
    }
}

/// One connection from `netns` to whoami at `target`: the source address it saw.
pub fn whoami(netns: &Netns, target: SocketAddr) -> Seen {
    whoami_within(netns, target, PROBE_TIMEOUT)
}

/// [`whoami`] with its own timeout for connecting, and for reading.
pub fn whoami_within(netns: &Netns, target: SocketAddr, timeout: Duration) -> Seen {
    match probe::read_reply(netns, target, timeout) {
        Ok(text) => match text.parse() {
            Ok(ip) => Seen::Source(ip),
            Err(_) => Seen::NoAnswer(format!("answered {text:?}")),
        },
        Err(e) => Seen::NoAnswer(format!("{:#}", e.root_cause())),
    }
}

/// [`whoami`] from several namespaces at once (each probe on its own thread).
pub fn whoami_all(netns: &[&Netns], target: SocketAddr) -> Vec<Seen> {
    thread::scope(|scope| {
        let probes: Vec<_> = netns
            .iter()
            .map(|ns| scope.spawn(move || whoami(ns, target)))
            .collect();
        probes
            .into_iter()
            .map(|p| {
                p.join()
                    .unwrap_or_else(|_| Seen::NoAnswer("the probe panicked".to_owned()))
            })
            .collect()
    })
}

/// One probe of a [`Prober`]: when it started, how long it took, what it saw.
#[derive(Debug, Clone)]
pub struct Sample {
    pub at: Instant,
    pub took: Duration,
    pub seen: Seen,
}

/// Probes whoami from one namespace every `interval` (each probe waiting at
/// most [`FAST_PROBE_TIMEOUT`]) on a thread of its own, until stopped (or
/// for at most `limit`), keeping every sample.
#[derive(Debug)]
pub struct Prober {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    thread: Option<JoinHandle<()>>,
}

impl Prober {
    pub fn start(netns: Netns, target: SocketAddr, interval: Duration, limit: Duration) -> Self {
        Self::start_within(netns, target, interval, limit, FAST_PROBE_TIMEOUT)
    }

    /// [`Self::start`] with its own timeout per probe: where a slow answer
    /// on a loaded machine must not count as a lost one.
    pub fn start_within(
        netns: Netns,
        target: SocketAddr,
        interval: Duration,
        limit: Duration,
        timeout: Duration,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, samples) = (Arc::clone(&stop), Arc::clone(&samples));
            thread::spawn(move || {
                let begun = Instant::now();
                while !stop.load(Ordering::Relaxed) && begun.elapsed() < limit {
                    let at = Instant::now();
                    let seen = whoami_within(&netns, target, timeout);
                    let sample = Sample {
                        at,
                        took: at.elapsed(),
                        seen,
                    };
                    if let Ok(mut all) = samples.lock() {
                        all.push(sample);
                    }
                    thread::sleep(interval.saturating_sub(at.elapsed()));
                }
            })
        };
        Self {
            stop,
            samples,
            thread: Some(thread),
        }
    }

    /// The samples so far.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Stops probing; every sample taken.
    pub fn finish(mut self) -> Vec<Sample> {
        self.halt();
        self.samples()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The result of a bounded iperf3 run.
#[derive(Debug)]
pub struct Iperf {
    pub bytes_received: u64,
    pub seconds: f64,
    pub retransmits: u64,
    /// The bytes sent in each reporting interval ([`INTERVAL`]), in order;
    /// a last, shorter interval is left out.
    pub interval_bytes: Vec<u64>,
}

/// iperf3's reporting interval (`-i`), in seconds.
pub const INTERVAL: f64 = 0.1;

impl Iperf {
    pub fn mbit_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes_received as f64 * 8.0 / self.seconds / 1e6
        } else {
            0.0
        }
    }

    /// The slowest and the median interval, in Mbit/s.
    pub fn interval_mbit_per_s(&self) -> Option<(f64, f64)> {
        let mut sorted = self.interval_bytes.clone();
        sorted.sort_unstable();
        let rate = |b: u64| b as f64 * 8.0 / INTERVAL / 1e6;
        Some((rate(*sorted.first()?), rate(sorted[sorted.len() / 2])))
    }
}

/// A running `iperf3 -c` in a pod namespace, its JSON report collected at the end.
#[derive(Debug)]
pub struct IperfRun {
    child: std::process::Child,
    deadline: Instant,
}

impl IperfRun {
    /// Starts `iperf3 -c target -t seconds -J` in `netns`. The run is
    /// bounded: [`IperfRun::finish`] kills it if it outlives `seconds` + 15 s.
    pub fn start(netns: &Netns, target: SocketAddr, seconds: u32) -> anyhow::Result<Self> {
        Self::start_with(netns, target, seconds, false)
    }

    /// [`IperfRun::start`]; `reverse` has the target send (`-R`).
    pub fn start_with(
        netns: &Netns,
        target: SocketAddr,
        seconds: u32,
        reverse: bool,
    ) -> anyhow::Result<Self> {
        let child = Command::new("ip")
            .args(["netns", "exec", netns.as_str(), "iperf3", "-J"])
            .args(reverse.then_some("-R"))
            .args(["-i", &INTERVAL.to_string()])
            .args(["-c", &target.ip().to_string()])
            .args(["-p", &target.port().to_string()])
            .args(["-t", &seconds.to_string(), "--connect-timeout", "3000"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting iperf3 in {netns}"))?;
        Ok(Self {
            child,
            deadline: Instant::now() + Duration::from_secs(u64::from(seconds) + 15),
        })
    }

    /// Waits for the run to end (killing it past its deadline) and reads its report.
    pub fn finish(mut self) -> anyhow::Result<Iperf> {
        while self.child.try_wait()?.is_none() {
            if Instant::now() > self.deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("iperf3 did not end in time: killed");
            }
            thread::sleep(Duration::from_millis(100));
        }
        let output = self
            .child
            .wait_with_output()
            .context("reading iperf3's output")?;
        let report: Value = serde_json::from_slice(&output.stdout).with_context(|| {
            format!(
                "iperf3 printed no JSON report (exit {}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )
        })?;
        parse_report(&report)
    }
}

/// The received bytes of an iperf3 JSON report; an error if it reports one.
fn parse_report(report: &Value) -> anyhow::Result<Iperf> {
    if let Some(error) = report.get("error") {
        bail!("iperf3 reported an error: {error}");
    }
    let received = &report["end"]["sum_received"];
    let Some(bytes_received) = received["bytes"].as_u64() else {
        bail!("iperf3's report has no end.sum_received.bytes");
    };
    let interval_bytes = report["intervals"]
        .as_array()
        .map(|all| {
            all.iter()
                .map(|i| &i["sum"])
                .filter(|sum| sum["seconds"].as_f64().unwrap_or(0.0) >= INTERVAL * 0.9)
                .filter_map(|sum| sum["bytes"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    Ok(Iperf {
        bytes_received,
        interval_bytes,
        seconds: received["seconds"].as_f64().unwrap_or(0.0),
        retransmits: report["end"]["sum_sent"]["retransmits"]
            .as_u64()
            .unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_iperf3_report_gives_bytes_and_rate() {
        let report = json!({"end": {
            "sum_sent": {"bytes": 1_000_000, "retransmits": 3},
            "sum_received": {"bytes": 750_000, "seconds": 6.0},
        }});
        let run = parse_report(&report).unwrap();
        assert_eq!(run.bytes_received, 750_000);
        assert_eq!(run.retransmits, 3);
        assert!((run.mbit_per_s() - 1.0).abs() < 1e-9);
        assert!(run.interval_bytes.is_empty());
        assert_eq!(run.interval_mbit_per_s(), None);
    }

    #[test]
    fn the_intervals_of_an_iperf3_report_leave_out_a_short_last_one() {
        let interval =
            |bytes: u64, seconds: f64| json!({"sum": {"bytes": bytes, "seconds": seconds}});
        let report = json!({
            "intervals": [interval(125_000, 0.1), interval(0, 0.1), interval(250_000, 0.1), interval(7, 0.02)],
            "end": {"sum_sent": {"bytes": 1}, "sum_received": {"bytes": 1, "seconds": 0.32}},
        });
        let run = parse_report(&report).unwrap();
        assert_eq!(run.interval_bytes, [125_000, 0, 250_000]);
        let (slowest, median) = run.interval_mbit_per_s().unwrap();
        assert!(slowest.abs() < 1e-9);
        assert!((median - 10.0).abs() < 1e-9);
    }

    #[test]
    fn an_iperf3_error_fails_the_run() {
        let report = json!({"error": "unable to connect to server", "end": {}});
        let err = parse_report(&report).unwrap_err().to_string();
        assert!(err.contains("unable to connect"), "{err}");
        assert!(parse_report(&json!({"end": {}})).is_err());
    }

    #[test]
    fn only_the_expected_answer_counts() {
        let ip = IpAddr::from([198, 51, 100, 200]);
        assert!(Seen::Source(ip).is(&Expect::Source(ip)));
        assert!(!Seen::Source(ip).is(&Expect::NoAnswer));
        assert!(!Seen::NoAnswer("timed out".into()).is(&Expect::Source(ip)));
        assert!(Seen::NoAnswer("timed out".into()).is(&Expect::NoAnswer));
    }
}

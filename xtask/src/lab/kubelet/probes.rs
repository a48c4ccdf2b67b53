//! Readiness, liveness and startup probes, run as kubelet runs them:
//! `httpGet` and `tcpSocket` from inside the Pod's network namespace (the
//! node's for `hostNetwork`), `exec` inside the container's namespaces with
//! its identity; every `periodSeconds` after `initialDelaySeconds`, each
//! attempt bounded by `timeoutSeconds`, the result flipping after
//! `successThreshold` or `failureThreshold` attempts in a row.
//!
//! An attempt runs on a thread of its own, so a slow probe never holds up
//! the stand-in's round; its outcome is collected on a later round.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Probe;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::container::RuntimeSpec;
use crate::lab::probe::in_netns;
use crate::lab::topology::Netns;

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Readiness,
    Liveness,
    Startup,
}

/// Where a probe reaches its container.
#[derive(Debug, Clone)]
pub struct Target {
    pub netns: Netns,
    pub ip: Ipv4Addr,
    /// The container's named ports.
    pub ports: BTreeMap<String, u16>,
    /// For `exec` probes: the container's main pid and its spec.
    pub exec: Option<(u32, RuntimeSpec)>,
    /// For `exec` probes: the command resolved in the container's image.
    pub exec_argv: Option<Vec<String>>,
}

/// One probe of one container.
#[derive(Debug)]
pub struct Prober {
    pub kind: Kind,
    probe: Probe,
    successes: u32,
    failures: u32,
    /// The current result; `None` until the thresholds decide one.
    pub result: Option<bool>,
    next: Instant,
    in_flight: Option<Receiver<Result<(), String>>>,
    /// Why the last attempt failed.
    pub last_failure: Option<String>,
}

/// A probe's timing fields, with Kubernetes' defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

impl Timing {
    pub fn of(probe: &Probe) -> Self {
        let secs = |v: Option<i32>, default: u64| {
            Duration::from_secs(v.and_then(|v| u64::try_from(v).ok()).unwrap_or(default))
        };
        let count = |v: Option<i32>, default: u32| {
            v.and_then(|v| u32::try_from(v).ok())
                .filter(|v| *v > 0)
                .unwrap_or(default)
        };
        Self {
            initial_delay: secs(probe.initial_delay_seconds, 0),
            period: secs(probe.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: secs(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
            success_threshold: count(probe.success_threshold, 1),
            failure_threshold: count(probe.failure_threshold, 3),
        }
    }
}

impl Prober {
    /// A probe of a container that started at `started`.
    pub fn new(kind: Kind, probe: Probe, started: Instant) -> Self {
        let timing = Timing::of(&probe);
        Self {
            kind,
            probe,
            successes: 0,
            failures: 0,
            result: None,
            next: started + timing.initial_delay,
            in_flight: None,
            last_failure: None,
        }
    }

    /// Collects a finished attempt and starts the next one when it is due.
    /// Returns the new result when it changed.
    pub fn tick(&mut self, now: Instant, target: &Target) -> Option<bool> {
        let before = self.result;
        if let Some(rx) = &self.in_flight {
            match rx.try_recv() {
                Ok(outcome) => {
                    self.in_flight = None;
                    self.record(outcome);
                }
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Disconnected) => {
                    self.in_flight = None;
                    self.record(Err("the probe's thread ended".to_owned()));
                }
            }
        }
        if self.in_flight.is_none() && now >= self.next {
            let timing = Timing::of(&self.probe);
            self.next = now + timing.period;
            let (tx, rx) = mpsc::channel();
            let (probe, target) = (self.probe.clone(), target.clone());
            thread::spawn(move || {
                let outcome =
                    attempt(&probe, &target, timing.timeout).map_err(|e| format!("{e:#}"));
                let _ = tx.send(outcome);
            });
            self.in_flight = Some(rx);
        }
        (self.result != before).then_some(self.result).flatten()
    }

    /// Counts one attempt's outcome against the thresholds.
    pub fn record(&mut self, outcome: Result<(), String>) {
        let timing = Timing::of(&self.probe);
        match outcome {
            Ok(()) => {
                self.successes += 1;
                self.failures = 0;
                self.last_failure = None;
                if self.successes >= timing.success_threshold {
                    self.result = Some(true);
                }
            }
            Err(why) => {
                self.failures += 1;
                self.successes = 0;
                self.last_failure = Some(why);
                if self.failures >= timing.failure_threshold {
                    self.result = Some(false);
                }
            }
        }
    }
}

/// One probe attempt, blocking for at most about `timeout`.
fn attempt(probe: &Probe, target: &Target, timeout: Duration) -> anyhow::Result<()> {
    if let Some(http) = &probe.http_get {
        let port = port(&http.port, &target.ports)?;
        let host = http
            .host
            .as_deref()
            .filter(|h| !h.is_empty())
            .map_or(Ok(target.ip), str::parse)
            .context("httpGet host is not an IPv4 address")?;
        let addr = SocketAddr::from((host, port));
        if http.scheme.as_deref() == Some("HTTPS") {
            // No TLS client here: an HTTPS probe checks that the port accepts.
            return connect(&target.netns, addr, timeout);
        }
        let path = http
            .path
            .as_deref()
            .filter(|p| !p.is_empty())
            .unwrap_or("/");
        let code = http_get(&target.netns, addr, path, timeout)?;
        anyhow::ensure!(
            (200..400).contains(&code),
            "HTTP probe failed with statuscode: {code}"
        );
        return Ok(());
    }
    if let Some(tcp) = &probe.tcp_socket {
        let port = port(&tcp.port, &target.ports)?;
        let host = tcp
            .host
            .as_deref()
            .filter(|h| !h.is_empty())
            .map_or(Ok(target.ip), str::parse)
            .context("tcpSocket host is not an IPv4 address")?;
        return connect(&target.netns, SocketAddr::from((host, port)), timeout);
    }
    if probe.exec.is_some() {
        return exec(target, timeout);
    }
    bail!("unsupported probe (the lab runs httpGet, tcpSocket and exec probes)")
}

/// `GET path` from `netns` (HTTP/1.1, `Connection: close`, as kubelet's
/// prober sends it): the status code. The request goes out in one write,
/// and the status line is read however the server splits its answer.
fn http_get(netns: &Netns, addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<u16> {
    in_netns(netns, || {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("dial tcp {addr}"))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.34\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        stream
            .write_all(request.as_bytes())
            .with_context(|| format!("sending GET {path} to {addr}"))?;
        let mut head = Vec::new();
        let mut chunk = [0u8; 256];
        while !head.contains(&b'\n') && head.len() < 4096 {
            let n = stream
                .read(&mut chunk)
                .with_context(|| format!("reading the answer to GET {path} from {addr}"))?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&chunk[..n]);
        }
        status_code(&head).with_context(|| format!("GET {path} on {addr}"))
    })
}

/// The status code of an HTTP status line (`HTTP/1.1 200 OK`).
fn status_code(head: &[u8]) -> anyhow::Result<u16> {
    let text = String::from_utf8_lossy(head);
    let line = text.lines().next().unwrap_or_default();
    let mut words = line.split_whitespace();
    match (words.next(), words.next().map(str::parse)) {
        (Some(version), Some(Ok(code))) if version.starts_with("HTTP/") => Ok(code),
        _ => bail!("not an HTTP response: {line:?}"),
    }
}

fn connect(netns: &Netns, addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    in_netns(netns, || {
        TcpStream::connect_timeout(&addr, timeout)
            .map(drop)
            .with_context(|| format!("dial tcp {addr}"))
    })
}

/// A probe's port: a number, or the name of one of the container's ports.
pub fn port(port: &IntOrString, named: &BTreeMap<String, u16>) -> anyhow::Result<u16> {
    match port {
        IntOrString::Int(n) => {
            u16::try_from(*n).with_context(|| format!("port {n} is out of range"))
        }
        IntOrString::String(name) => match name.parse() {
            Ok(n) => Ok(n),
            Err(_) => named
                .get(name)
                .copied()
                .with_context(|| format!("the container has no port named {name:?}")),
        },
    }
}

/// `nsenter` into the mount, network and UTS namespaces, root and working
/// directory of the container process `pid`; the program and its
/// arguments follow.
pub fn enter(pid: u32) -> Command {
    let mut command = Command::new("nsenter");
    command.args(["--target", &pid.to_string()]);
    command.args(["--mount", "--net", "--uts", "--root", "--wd", "--"]);
    command
}

/// `exec`: the command in the container's mount, network and UTS
/// namespaces, with its identity and environment (`nsenter`, then
/// `setpriv`); success is exit status 0 within the timeout.
fn exec(target: &Target, timeout: Duration) -> anyhow::Result<()> {
    let (Some((pid, spec)), Some(argv)) = (&target.exec, &target.exec_argv) else {
        bail!("exec probe: the container is not running");
    };
    let mut spec = spec.clone();
    spec.argv.clone_from(argv);
    let setpriv = super::shim::privileges(std::path::Path::new("setpriv"), &spec);
    let mut command = enter(*pid);
    command
        .arg(setpriv.get_program())
        .args(setpriv.get_args())
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = command.spawn().context("starting nsenter")?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            anyhow::ensure!(status.success(), "command {argv:?} exited with {status}");
            return Ok(());
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("command {argv:?} timed out after {}s", timeout.as_secs());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(success: i32, failure: i32) -> Probe {
        Probe {
            success_threshold: Some(success),
            failure_threshold: Some(failure),
            ..Probe::default()
        }
    }

    #[test]
    fn defaults_are_kubernetes_defaults() {
        let t = Timing::of(&Probe::default());
        assert_eq!(t.period, Duration::from_secs(10));
        assert_eq!(t.timeout, Duration::from_secs(1));
        assert_eq!((t.success_threshold, t.failure_threshold), (1, 3));
        assert_eq!(t.initial_delay, Duration::ZERO);
    }

    #[test]
    fn the_result_flips_only_after_the_thresholds() {
        let mut p = Prober::new(Kind::Liveness, probe(2, 3), Instant::now());
        p.record(Ok(()));
        assert_eq!(p.result, None);
        p.record(Ok(()));
        assert_eq!(p.result, Some(true));
        p.record(Err("refused".to_owned()));
        p.record(Err("refused".to_owned()));
        assert_eq!(p.result, Some(true));
        p.record(Err("refused".to_owned()));
        assert_eq!(p.result, Some(false));
        assert_eq!(p.last_failure.as_deref(), Some("refused"));
        p.record(Ok(()));
        assert_eq!(p.result, Some(false), "one success is not enough here");
    }

    #[test]
    fn the_status_code_is_read_from_the_status_line() {
        assert_eq!(
            status_code(b"HTTP/1.1 200 OK\r\nContent-Length: 2").unwrap(),
            200
        );
        assert_eq!(status_code(b"HTTP/1.0 503 X\r\n").unwrap(), 503);
        assert!(status_code(b"HTTP/1.0 ").is_err());
        assert!(status_code(b"SSH-2.0-OpenSSH").is_err());
    }

    #[test]
    fn named_ports_resolve_through_the_containers_ports() {
        let named = BTreeMap::from([("health".to_owned(), 9812)]);
        assert_eq!(
            port(&IntOrString::String("health".to_owned()), &named).unwrap(),
            9812
        );
        assert_eq!(port(&IntOrString::Int(8080), &named).unwrap(), 8080);
        assert_eq!(
            port(&IntOrString::String("8081".to_owned()), &named).unwrap(),
            8081
        );
        assert!(port(&IntOrString::String("metrics".to_owned()), &named).is_err());
        assert!(port(&IntOrString::Int(70_000), &named).is_err());
    }
}

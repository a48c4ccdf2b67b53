//! The stand-in's kubelet API: HTTPS on port [`KUBELET_PORT`] of each
//! node's InternalIP, inside the node's network namespace, where
//! kube-apiserver sends `pods/log` (`kubectl logs`). It serves
//! `GET /containerLogs/{namespace}/{pod}/{container}` from the log files of
//! the containers the stand-in runs ([`super::logs`] decides what), and
//! nothing else.
//!
//! TLS with the node's serving certificate ([`certs::kubelet_serving_in`]);
//! a client must show a certificate of the lab's CA for client use, which
//! only kube-apiserver's kubelet client certificate is. A thread per node
//! listens (it entered the node's network namespace, and so do the
//! threads it starts), a thread per connection answers; every answer ends
//! its connection.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use nix::sched::{CloneFlags, setns};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection, StreamOwned};

use super::logs::{
    Budget, ContainerLogs, Directory, LogQuery, LogState, Refusal, RequestLine, Target,
};
use super::pod::log;
use crate::lab::certs;
use crate::lab::topology::{Netns, Node};

/// kubelet's port, which the lab's Nodes report as their kubelet endpoint.
pub const KUBELET_PORT: u16 = 10250;
/// How often a follow looks for more output.
const POLL: Duration = Duration::from_millis(250);
/// How long a read or a write on a connection may block.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest request head read.
const MAX_HEAD: usize = 16 * 1024;
/// The most a follow reads of a log file at once.
const MAX_READ: u64 = 1 << 20;
/// How long a listener waits for its address to be free (a stand-in that
/// was just stopped may still hold it).
const BIND_TRIES: u32 = 10;

type Tls = StreamOwned<ServerConnection, TcpStream>;

/// The Pods' logs as the stand-in's last round left them, shared with the
/// server's threads.
#[derive(Debug, Clone, Default)]
pub struct Shared(Arc<Mutex<Directory>>);

impl Shared {
    /// Replaces what the server knows.
    pub fn publish(&self, directory: Directory) {
        *self.lock() = directory;
    }

    fn lock(&self) -> MutexGuard<'_, Directory> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the container `target` names on `node` still runs the
    /// process `pid`.
    fn still_running(&self, node: &str, target: &Target, pid: Option<u32>) -> bool {
        self.lock()
            .find(node, target)
            .is_ok_and(|c| c.state == LogState::Running && c.pid == pid)
    }
}

/// Serves the kubelet API of each of `nodes` from a thread of its own;
/// returns once their TLS configurations (from the pki directory `pki`)
/// are loaded. A listener that cannot start says so in the log.
pub fn start(pki: &Path, nodes: &[Node], shared: &Shared) -> anyhow::Result<()> {
    let ca = certs::ca_cert_in(pki);
    for node in nodes {
        let (cert, key) = certs::kubelet_serving_in(pki, &node.name);
        let config = tls_config(&ca, &cert, &key)
            .with_context(|| format!("the TLS configuration of {}'s kubelet API", node.name))?;
        let (node, shared) = (node.clone(), shared.clone());
        thread::Builder::new()
            .name(format!("kubelet-api-{}", node.name))
            .spawn(move || listen(&node, &config, &shared))
            .context("starting a listener thread")?;
    }
    Ok(())
}

/// Serving `cert` (with `key`) to clients that show a certificate of the
/// CA `ca`, for client use: without one, the handshake fails.
fn tls_config(ca: &Path, cert: &Path, key: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for der in pem_certs(ca)? {
        roots
            .add(der)
            .with_context(|| format!("trusting {}", ca.display()))?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .context("making the client certificate verifier")?;
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| anyhow!("reading {}: {e}", key.display()))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(pem_certs(cert)?, key)
        .with_context(|| format!("serving {}", cert.display()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The certificates of a PEM file.
fn pem_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| anyhow!("reading {}: {e}", path.display()))?;
    ensure!(!certs.is_empty(), "{} holds no certificate", path.display());
    Ok(certs)
}

/// Listens on `node`'s address in its network namespace and answers each
/// connection on a thread of its own.
fn listen(node: &Node, config: &Arc<ServerConfig>, shared: &Shared) {
    let addr = SocketAddr::from((node.ip, KUBELET_PORT));
    let listener = match bind_in(&node.netns, addr) {
        Ok(listener) => listener,
        Err(e) => {
            log(&format!(
                "{}: the kubelet API is not served (no `kubectl logs`): {e:#}",
                node.name
            ));
            return;
        }
    };
    log(&format!(
        "{}: kubelet API (container logs) on https://{addr} in {}",
        node.name, node.netns
    ));
    for tcp in listener.incoming().filter_map(Result::ok) {
        let (config, shared, name) = (config.clone(), shared.clone(), node.name.clone());
        let spawned = thread::Builder::new()
            .name(format!("kubelet-api-{name}-conn"))
            .spawn(move || {
                if let Err(e) = connection(tcp, config, &name, &shared) {
                    log(&format!("{name}: kubelet API: {e:#}"));
                }
            });
        if let Err(e) = spawned {
            log(&format!(
                "{}: kubelet API: no thread for a connection: {e}",
                node.name
            ));
        }
    }
}

/// Enters `netns` (this thread, for good) and listens on `addr` there.
fn bind_in(netns: &Netns, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let path = Path::new("/run/netns").join(netns.as_str());
    let handle = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    setns(&handle, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("entering network namespace {netns}"))?;
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr) {
            Ok(listener) => return Ok(listener),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < BIND_TRIES => {
                tries += 1;
                thread::sleep(Duration::from_secs(1));
            }
            Err(e) => return Err(e).with_context(|| format!("listening on {addr} in {netns}")),
        }
    }
}

/// One connection: the TLS handshake, one request, its answer.
fn connection(
    tcp: TcpStream,
    config: Arc<ServerConfig>,
    node: &str,
    shared: &Shared,
) -> anyhow::Result<()> {
    let peer = tcp.peer_addr().context("the client's address")?;
    tcp.set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| tcp.set_write_timeout(Some(IO_TIMEOUT)))
        .context("setting socket timeouts")?;
    let tls = ServerConnection::new(config).context("starting TLS")?;
    let mut tls = StreamOwned::new(tls, tcp);
    let head = read_head(&mut tls).with_context(|| format!("the request of {peer}"))?;
    let line = RequestLine::parse(&head);
    let shown = line
        .as_ref()
        .map_or_else(|| "a malformed request".to_owned(), RequestLine::to_string);
    let status = match &line {
        Some(line) => answer(&mut tls, line, node, shared),
        None => refuse(
            &mut tls,
            &Refusal::bad_request("malformed HTTP request".to_owned()),
        ),
    };
    tls.conn.send_close_notify();
    let _ = tls.flush();
    match status {
        Ok(code) => log(&format!("{node}: kubelet API: {shown} from {peer}: {code}")),
        // The client went while it was being answered: a follow it stopped.
        Err(e) => log(&format!(
            "{node}: kubelet API: {shown} from {peer}: ended: {e}"
        )),
    }
    Ok(())
}

/// Reads the request head (up to the empty line); the TLS handshake is
/// made on the first read.
fn read_head(tls: &mut Tls) -> anyhow::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 2048];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        ensure!(head.len() <= MAX_HEAD, "its head is over {MAX_HEAD} bytes");
        let n = tls.read(&mut buf)?;
        ensure!(
            n > 0,
            "the client closed the connection before its request ended"
        );
        head.extend_from_slice(&buf[..n]);
    }
    Ok(head)
}

/// Answers one request; the status sent.
fn answer(tls: &mut Tls, line: &RequestLine, node: &str, shared: &Shared) -> io::Result<u16> {
    let reading = match reading(line, node, shared) {
        Ok(reading) => reading,
        Err(refusal) => return refuse(tls, &refusal),
    };
    let text = read_all(&reading.logs.path)?;
    let (target, query, logs) = (&reading.target, &reading.query, &reading.logs);
    let runs = super::logs::runs(&text, &target.container);
    let index = match super::logs::pick_run(
        &logs.state,
        runs.len(),
        query.previous,
        &target.container,
        &target.pod,
    ) {
        Ok(index) => index,
        Err(refusal) => return refuse(tls, &refusal),
    };
    let run = runs[index].clone();
    let tail = query.tail_lines.map_or(0, |n| {
        super::logs::tail_start(&text[run.clone()], u64::try_from(n).unwrap_or(0))
    });
    let mut budget = Budget::new(query.limit_bytes);
    let mut out = Chunked::start(tls)?;
    out.send(budget.take(&text[run.start + tail..run.end]))?;
    let live = query.follow && logs.state == LogState::Running && index + 1 == runs.len();
    if live && !budget.spent() {
        let at_line_start = run.end == 0 || text[run.end - 1] == b'\n';
        let from = Position {
            offset: run.end as u64,
            at_line_start,
        };
        follow(&mut out, &reading, from, budget, node, shared)?;
    }
    out.finish()?;
    Ok(200)
}

/// A request the log API serves: which container, how, and its log.
#[derive(Debug)]
struct Reading {
    target: Target,
    query: LogQuery,
    logs: ContainerLogs,
}

/// What `line` asks for, checked in kubelet's order: the path, the
/// method, the query, the Pod and the container, the stream.
fn reading(line: &RequestLine, node: &str, shared: &Shared) -> Result<Reading, Refusal> {
    let target = Target::parse(&line.path).ok_or_else(Refusal::no_such_path)?;
    if line.method != "GET" {
        return Err(Refusal::method_not_allowed());
    }
    let query = LogQuery::parse(&line.query)?;
    let logs = shared.lock().find(node, &target)?.clone();
    query.check_stream()?;
    Ok(Reading {
        target,
        query,
        logs,
    })
}

/// Where a follow is in a log file.
#[derive(Debug, Clone, Copy)]
struct Position {
    offset: u64,
    /// Whether the byte before `offset` ended a line.
    at_line_start: bool,
}

/// Sends what the container adds to its log until it stops (or starts
/// again: the next run's marker), the budget is spent, or the client goes.
fn follow(
    out: &mut Chunked<'_>,
    reading: &Reading,
    mut at: Position,
    mut budget: Budget,
    node: &str,
    shared: &Shared,
) -> io::Result<()> {
    let (target, logs) = (&reading.target, &reading.logs);
    loop {
        thread::sleep(POLL);
        // Asked before reading: what a container wrote before it stopped
        // is read after.
        let running = shared.still_running(node, target, logs.pid);
        let data = read_from(&logs.path, at.offset)?;
        let part = super::logs::run_part(&data, at.at_line_start, &target.container);
        out.send(budget.take(&data[..part]))?;
        if part < data.len() || budget.spent() || !running {
            return Ok(());
        }
        if let Some(last) = data.last() {
            at.at_line_start = *last == b'\n';
            at.offset += data.len() as u64;
        } else if out.client_gone() {
            return Ok(());
        }
    }
}

/// A log file's contents; none if it does not exist (yet).
fn read_all(path: &Path) -> io::Result<Vec<u8>> {
    match std::fs::read(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        other => other,
    }
}

/// What a log file holds from `offset` on (at most [`MAX_READ`] bytes).
fn read_from(path: &Path, offset: u64) -> io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    file.seek(SeekFrom::Start(offset))?;
    let mut data = Vec::new();
    file.take(MAX_READ).read_to_end(&mut data)?;
    Ok(data)
}

/// Answers with kubelet's refusal: its status and text.
fn refuse(tls: &mut Tls, refusal: &Refusal) -> io::Result<u16> {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        refusal.status,
        reason(refusal.status),
        refusal.message.len()
    );
    tls.write_all(head.as_bytes())?;
    tls.write_all(refusal.message.as_bytes())?;
    tls.flush()?;
    Ok(refusal.status)
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        422 => "Unprocessable Entity",
        _ => "Error",
    }
}

/// A `200 OK` answer in chunks, each sent as soon as it is written (a
/// follow's output reaches the client as the container writes it).
struct Chunked<'a> {
    tls: &'a mut Tls,
}

impl<'a> Chunked<'a> {
    fn start(tls: &'a mut Tls) -> io::Result<Self> {
        tls.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        )?;
        tls.flush()?;
        Ok(Self { tls })
    }

    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        // An empty chunk would end the answer.
        if data.is_empty() {
            return Ok(());
        }
        write!(self.tls, "{:x}\r\n", data.len())?;
        self.tls.write_all(data)?;
        self.tls.write_all(b"\r\n")?;
        self.tls.flush()
    }

    fn finish(self) -> io::Result<()> {
        self.tls.write_all(b"0\r\n\r\n")?;
        self.tls.flush()
    }

    /// Whether the client closed the connection (or broke it), looked at
    /// without waiting.
    fn client_gone(&mut self) -> bool {
        let tls = &mut *self.tls;
        if tls.sock.set_nonblocking(true).is_err() {
            return true;
        }
        let gone = loop {
            match tls.conn.read_tls(&mut tls.sock) {
                Ok(0) => break true,
                Ok(_) => match tls.conn.process_new_packets() {
                    Ok(state) if state.peer_has_closed() => break true,
                    Ok(_) => {}
                    Err(_) => break true,
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                Err(_) => break true,
            }
        };
        gone || tls.sock.set_nonblocking(false).is_err()
    }
}

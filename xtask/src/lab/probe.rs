//! Talking to services from inside a lab namespace, without starting a
//! process: a thread enters the namespace (`setns`), so every socket it opens
//! belongs there, as if a program in that namespace had opened it. Cheap
//! enough to probe every 100 ms.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::thread;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use nix::sched::{CloneFlags, setns};

use super::topology::Netns;

/// Runs `f` on a thread of its own that has joined `ns`. Only that thread
/// changes namespace; it ends when `f` returns.
pub fn in_netns<T: Send>(
    ns: &Netns,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    let path = Path::new("/run/netns").join(ns.as_str());
    let handle = File::open(&path)
        .with_context(|| format!("opening {} (is the lab up?)", path.display()))?;
    thread::scope(|scope| {
        scope
            .spawn(move || {
                setns(&handle, CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("entering network namespace {ns}"))?;
                f()
            })
            .join()
            .map_err(|_| anyhow!("the thread working in {ns} panicked"))?
    })
}

/// Connects to `addr` from `ns` and reads everything the server sends until
/// it closes: for whoami, the client address it saw. Connecting and reading
/// each take at most `timeout`.
pub fn read_reply(ns: &Netns, addr: SocketAddr, timeout: Duration) -> anyhow::Result<String> {
    in_netns(ns, || {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_read_timeout(Some(timeout))?;
        let mut reply = String::new();
        stream
            .read_to_string(&mut reply)
            .with_context(|| format!("reading the answer of {addr}"))?;
        Ok(reply.trim().to_owned())
    })
}

/// `GET path` on `addr` from `ns` (HTTP/1.0); the response's status code.
pub fn http_status(
    ns: &Netns,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> anyhow::Result<u16> {
    http_get(ns, addr, path, timeout).map(|(code, _)| code)
}

/// `GET path` on `addr` from `ns` (HTTP/1.0, so the server closes when
/// done): the status code and the body.
pub fn http_get(
    ns: &Netns,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> anyhow::Result<(u16, String)> {
    in_netns(ns, || {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")
            .with_context(|| format!("sending GET {path} to {addr}"))?;
        let mut response = Vec::new();
        stream
            .read_to_end(&mut response)
            .with_context(|| format!("reading the answer to GET {path} from {addr}"))?;
        let code = status_code(&response).with_context(|| format!("GET {path} on {addr}"))?;
        let text = String::from_utf8_lossy(&response);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        Ok((code, body.to_owned()))
    })
}

/// The status code of an HTTP status line (`HTTP/1.1 200 OK`).
fn status_code(head: &[u8]) -> anyhow::Result<u16> {
    let text = String::from_utf8_lossy(head);
    let mut words = text.split_whitespace();
    match (words.next(), words.next().map(str::parse)) {
        (Some(version), Some(Ok(code))) if version.starts_with("HTTP/") => Ok(code),
        _ => bail!(
            "not an HTTP response: {:?}",
            text.lines().next().unwrap_or("")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_code_is_read_from_the_status_line() {
        assert_eq!(status_code(b"HTTP/1.1 200 OK\r\n").unwrap(), 200);
        assert_eq!(
            status_code(b"HTTP/1.0 503 Service Unavailable").unwrap(),
            503
        );
        assert!(status_code(b"SSH-2.0-OpenSSH").is_err());
        assert!(status_code(b"").is_err());
    }
}

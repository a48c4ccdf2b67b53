//! `cargo xtask lab testpod`: the program `lab selftest` runs in its Pods.
//! An HTTP/1.0 server that reports what it runs as, so the selftest can
//! check from outside what the kubelet stand-in gave it:
//!
//! - `GET /healthz`: 200, or 500 once `/break` was asked (a liveness probe
//!   then restarts it);
//! - `GET /break`: makes `/healthz` fail from now on;
//! - `GET /info`: JSON with its uid, gids, capability sets, `NoNewPrivs`,
//!   hostname, whether `/` is read-only, its environment, the contents of
//!   the `--show` files, the signal mask it started with, whether it can
//!   write in the `--write` directories
//!   (a file made and removed at once), and the claims of its
//!   ServiceAccount token.
//!
//! On SIGTERM it says so on stdout and exits 0.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;

use anyhow::Context;
use base64::Engine;
use nix::sys::signal::{SigSet, Signal};
use serde_json::{Value, json};

/// Where kube-rs and client-go read a Pod's ServiceAccount token.
pub const TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// `lab testpod`.
#[derive(Debug, Clone, clap::Args)]
pub struct TestpodArgs {
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// A file whose contents `/info` reports (repeatable).
    #[arg(long)]
    pub show: Vec<PathBuf>,
    /// A directory `/info` reports as writable or not (repeatable).
    #[arg(long)]
    pub write: Vec<PathBuf>,
}

/// The signal mask the program started with (`SigBlk` of
/// `/proc/self/status`), before it blocks SIGTERM to wait for it.
static STARTED_WITH_MASK: OnceLock<String> = OnceLock::new();

pub fn serve(args: &TestpodArgs) -> anyhow::Result<()> {
    let _ = STARTED_WITH_MASK.set(status_field("SigBlk"));
    let mut term = SigSet::empty();
    term.add(Signal::SIGTERM);
    term.thread_block().context("blocking SIGTERM")?;
    thread::spawn(move || {
        if term.wait().is_ok() {
            println!("testpod: SIGTERM received, exiting");
            let _ = std::io::stdout().flush();
            std::process::exit(0);
        }
    });
    let listener =
        TcpListener::bind(args.listen).with_context(|| format!("listening on {}", args.listen))?;
    println!("testpod: listening on {}", args.listen);
    let broken = Arc::new(AtomicBool::new(false));
    for stream in listener.incoming().filter_map(Result::ok) {
        let (broken, args) = (broken.clone(), args.clone());
        thread::spawn(move || {
            if let Err(e) = answer(stream, &broken, &args) {
                eprintln!("testpod: {e:#}");
            }
        });
    }
    Ok(())
}

fn answer(stream: TcpStream, broken: &AtomicBool, args: &TestpodArgs) -> anyhow::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
    // The rest of the request, so closing does not reset the connection.
    let mut header = String::new();
    while reader.read_line(&mut header)? > 2 {
        header.clear();
    }
    let (code, body) = match path.as_str() {
        "/healthz" if broken.load(Ordering::SeqCst) => (500, "broken\n".to_owned()),
        "/healthz" => (200, "ok\n".to_owned()),
        "/break" => {
            broken.store(true, Ordering::SeqCst);
            println!("testpod: /healthz fails from now on");
            (200, "broken from now on\n".to_owned())
        }
        "/info" => (200, info(args).to_string()),
        _ => (404, "not found\n".to_owned()),
    };
    let response = format!(
        "HTTP/1.0 {code} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = stream;
    stream.write_all(response.as_bytes())?;
    Ok(())
}

/// A field of `/proc/self/status`.
fn status_field(name: &str) -> String {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// What the process runs as and sees.
fn info(args: &TestpodArgs) -> Value {
    let field = status_field;
    let first = |name: &str| {
        field(name)
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_owned()
    };
    let writable: BTreeMap<String, bool> = args
        .write
        .iter()
        .map(|dir| {
            let probe = dir.join(format!(".testpod-{}", std::process::id()));
            let ok = fs::write(&probe, b"").is_ok();
            let _ = fs::remove_file(&probe);
            (dir.display().to_string(), ok)
        })
        .collect();
    let files: BTreeMap<String, String> = args
        .show
        .iter()
        .map(|p| {
            let text = fs::read_to_string(p).unwrap_or_else(|e| format!("<{e}>"));
            (p.display().to_string(), text)
        })
        .collect();
    let read_only = nix::sys::statvfs::statvfs("/")
        .is_ok_and(|s| s.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
    json!({
        "uid": first("Uid"),
        "gid": first("Gid"),
        "groups": field("Groups"),
        "cap_inh": field("CapInh"),
        "cap_prm": field("CapPrm"),
        "cap_eff": field("CapEff"),
        "cap_bnd": field("CapBnd"),
        "cap_amb": field("CapAmb"),
        "no_new_privs": field("NoNewPrivs"),
        "started_with_blocked_signals": STARTED_WITH_MASK.get(),
        "hostname": fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim(),
        "root_read_only": read_only,
        "env": std::env::vars().collect::<BTreeMap<_, _>>(),
        "files": files,
        "writable": writable,
        "token_claims": fs::read_to_string(TOKEN).ok().and_then(|t| claims(&t)),
    })
}

/// The claims of a JWT (its middle part), unverified.
pub fn claims(token: &str) -> Option<Value> {
    let payload = token.trim().split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_claims_are_read_from_the_middle_part() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"sub":"system:serviceaccount:a:b"}"#);
        let token = format!("eyJhbGciOiJFUzI1NiJ9.{payload}.c2ln");
        assert_eq!(claims(&token).unwrap()["sub"], "system:serviceaccount:a:b");
        assert!(claims("not a token").is_none());
    }
}

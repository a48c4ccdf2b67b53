//! `cargo xtask lab echo --listen ADDR:PORT`: the target's TCP echo
//! service, for `egressgw bench`'s round trips. Each connection gets back
//! what it sends, at once (no Nagle delay), until it closes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;

use anyhow::Context;

/// Serves forever (until killed), on `cpu` when given.
pub fn serve(listen: SocketAddr, cpu: Option<usize>) -> anyhow::Result<()> {
    if let Some(cpu) = cpu {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu).with_context(|| format!("CPU {cpu}"))?;
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
            .with_context(|| format!("pinning to CPU {cpu}"))?;
    }
    let listener = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    println!("echo: listening on {listen}");
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                thread::spawn(move || {
                    if let Err(e) = echo(stream) {
                        eprintln!("echo: {e:#}");
                    }
                });
            }
            Err(e) => eprintln!("echo: accepting a connection: {e}"),
        }
    }
    Ok(())
}

fn echo(mut stream: TcpStream) -> anyhow::Result<()> {
    let peer = stream.peer_addr().context("reading the peer address")?;
    stream.set_nodelay(true).context("setting TCP_NODELAY")?;
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => stream
                .write_all(&buf[..n])
                .with_context(|| format!("answering {peer}"))?,
            Err(e) => return Err(e).with_context(|| format!("reading from {peer}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_gets_back_what_it_sends() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || echo(listener.accept().unwrap().0));
        let mut client = TcpStream::connect(addr).unwrap();
        for message in [&b"ping"[..], &[7u8; 64][..]] {
            client.write_all(message).unwrap();
            let mut back = vec![0u8; message.len()];
            client.read_exact(&mut back).unwrap();
            assert_eq!(back, message);
        }
        drop(client);
        server.join().unwrap().unwrap();
    }
}

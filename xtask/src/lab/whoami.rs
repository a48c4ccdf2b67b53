//! `cargo xtask lab whoami --listen ADDR:PORT`: the target's TCP service.
//! It answers every connection with the source address it saw (one line,
//! the IP alone) and closes it, so a client learns how it was NATed.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};

use anyhow::Context;

/// Serves forever (until killed).
pub fn serve(listen: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    println!("whoami: listening on {listen}");
    for stream in listener.incoming() {
        match stream.context("accepting a connection").and_then(answer) {
            Ok(peer) => println!("whoami: answered {peer}"),
            Err(e) => eprintln!("whoami: {e:#}"),
        }
    }
    Ok(())
}

fn answer(mut stream: TcpStream) -> anyhow::Result<SocketAddr> {
    let peer = stream.peer_addr().context("reading the peer address")?;
    writeln!(stream, "{}", peer.ip()).with_context(|| format!("answering {peer}"))?;
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::thread;

    use super::*;

    #[test]
    fn a_client_reads_back_its_own_source_address() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = thread::spawn(move || answer(listener.accept().unwrap().0).unwrap());
        let mut reply = String::new();
        TcpStream::connect(addr)
            .unwrap()
            .read_to_string(&mut reply)
            .unwrap();
        assert_eq!(reply, "127.0.0.1\n");
        assert_eq!(server.join().unwrap().ip().to_string(), "127.0.0.1");
    }
}

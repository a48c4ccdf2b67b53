//! A minimal HTTP endpoint for probes: `GET /healthz` answers 200 while the
//! process runs, `GET /readyz` 200 once the daemon says it is ready (503
//! before), `GET /status` the daemon's last report as JSON.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// What the endpoint reports; shared with the daemon.
#[derive(Debug, Default)]
pub struct Health {
    state: Mutex<(bool, serde_json::Value)>,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0 = ready;
    }

    pub fn set_status(&self, status: serde_json::Value) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = status;
    }

    fn get(&self) -> (bool, serde_json::Value) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Binds `addr` and serves probes until the process ends.
pub async fn serve(addr: SocketAddr, health: Arc<Health>) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the health endpoint to {addr}"))?;
    tracing::info!(%addr, "health endpoint listening");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let health = Arc::clone(&health);
            tokio::spawn(async move {
                // A probe that stalls is dropped; it never blocks others.
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    answer(stream, &health),
                )
                .await;
            });
        }
    });
    Ok(())
}

async fn answer(mut stream: TcpStream, health: &Health) -> std::io::Result<()> {
    let mut buf = [0u8; 1024];
    let n = stream.read(&mut buf).await?;
    let request = String::from_utf8_lossy(&buf[..n]);
    let path = request.split_whitespace().nth(1).unwrap_or("/");
    let (ready, status) = health.get();
    let (code, body) = match path {
        "/healthz" => ("200 OK", "ok\n".to_owned()),
        "/readyz" if ready => ("200 OK", "ready\n".to_owned()),
        "/readyz" => ("503 Service Unavailable", "not ready\n".to_owned()),
        "/status" => ("200 OK", format!("{status:#}\n")),
        _ => ("404 Not Found", "not found\n".to_owned()),
    };
    let response = format!(
        "HTTP/1.1 {code}\r\ncontent-length: {}\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

//! The daemons' HTTP endpoint: `GET /livez` (and `/healthz`, its older
//! name) answers 200 while the daemon's loop runs (a daemon that beats
//! and then stops beating for [`Health::expect_beats`]'s time gets 503);
//! `/readyz` 200 while the daemon says it is ready, 503 with the reason
//! otherwise; `/status` the daemon's last report as JSON; `/metrics` its
//! metrics in the OpenMetrics text format, which Prometheus scrapes
//! (docs/operations.md lists them). An agent also takes `POST /sink`: it
//! reads the body and says how many bytes came in how long, which is how
//! `egressgw doctor --throughput` on another node measures the way here
//! (one at a time, at most [`SINK_LIMIT`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The content type of `/metrics`.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long one `POST /sink` may last.
pub const SINK_LIMIT: Duration = Duration::from_secs(10);

/// What the endpoint reports; shared with the daemon.
#[derive(Debug)]
pub struct Health {
    state: Mutex<Said>,
    /// The daemon's metrics, registered before the endpoint starts.
    registry: Registry,
    /// Taken by the one `POST /sink` running; `None`: no sink here.
    sink: Option<tokio::sync::Semaphore>,
}

#[derive(Debug)]
struct Said {
    /// `Err(why)` while not ready.
    ready: Result<(), String>,
    status: serde_json::Value,
    /// The loop's last beat, and how long it may go without one.
    beat: Option<(Instant, Duration)>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new(Registry::default())
    }
}

impl Health {
    /// Not ready, no status yet, and `registry`'s metrics.
    pub fn new(registry: Registry) -> Self {
        Self {
            state: Mutex::new(Said {
                ready: Err("starting".into()),
                status: serde_json::Value::Null,
                beat: None,
            }),
            registry,
            sink: None,
        }
    }

    /// Also takes `POST /sink` (an agent).
    pub fn with_sink(mut self) -> Self {
        self.sink = Some(tokio::sync::Semaphore::new(1));
        self
    }

    fn said(&self) -> std::sync::MutexGuard<'_, Said> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ready (`Ok`), or not and why.
    pub fn set_ready(&self, ready: Result<(), String>) {
        self.said().ready = ready;
    }

    pub fn set_status(&self, status: serde_json::Value) {
        self.said().status = status;
    }

    /// From now on `/livez` fails once the loop goes `within` without a
    /// [`Self::beat`].
    pub fn expect_beats(&self, within: Duration) {
        self.said().beat = Some((Instant::now(), within));
    }

    /// The loop is alive.
    pub fn beat(&self) {
        if let Some((at, _)) = &mut self.said().beat {
            *at = Instant::now();
        }
    }

    fn live(&self) -> Result<(), String> {
        match self.said().beat {
            Some((at, within)) if at.elapsed() > within => Err(format!(
                "the loop has not run for {} s",
                at.elapsed().as_secs()
            )),
            _ => Ok(()),
        }
    }

    fn ready(&self) -> Result<(), String> {
        self.said().ready.clone()
    }

    fn status(&self) -> serde_json::Value {
        self.said().status.clone()
    }
}

/// Binds `addr` and serves the endpoint until the process ends; returns
/// the address bound (port 0 picks one).
pub async fn serve(addr: SocketAddr, health: Arc<Health>) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the health endpoint to {addr}"))?;
    let bound = listener
        .local_addr()
        .context("reading the health endpoint's address")?;
    tracing::info!(addr = %bound, "health endpoint listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(health)).await {
            tracing::error!(error = %e, "the health endpoint stopped");
        }
    });
    Ok(bound)
}

fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/sink", axum::routing::post(sink))
        .with_state(health)
}

async fn live(State(health): State<Arc<Health>>) -> (StatusCode, String) {
    match health.live() {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not live: {why}\n"),
        ),
    }
}

async fn ready(State(health): State<Arc<Health>>) -> (StatusCode, String) {
    match health.ready() {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Reads the body for at most [`SINK_LIMIT`] and answers
/// `{"bytes": N, "seconds": S}`: what arrived, from the first byte to the
/// last.
async fn sink(State(health): State<Arc<Health>>, body: axum::body::Body) -> Response {
    use futures_util::StreamExt as _;
    let Some(one) = &health.sink else {
        return (StatusCode::NOT_FOUND, "no sink here\n").into_response();
    };
    let Ok(_running) = one.try_acquire() else {
        return (StatusCode::TOO_MANY_REQUESTS, "a measurement is running\n").into_response();
    };
    let mut data = body.into_data_stream();
    let mut bytes: u64 = 0;
    let mut first: Option<Instant> = None;
    let mut last = Instant::now();
    let deadline = tokio::time::Instant::now() + SINK_LIMIT;
    while let Ok(Some(Ok(chunk))) = tokio::time::timeout_at(deadline, data.next()).await {
        last = Instant::now();
        first.get_or_insert(last);
        bytes += chunk.len() as u64;
    }
    let seconds = first.map_or(0.0, |f| (last - f).as_secs_f64());
    let body = serde_json::json!({ "bytes": bytes, "seconds": seconds }).to_string();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn status(State(health): State<Arc<Health>>) -> Response {
    let body = format!("{:#}\n", health.status());
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn metrics(State(health): State<Arc<Health>>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &health.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the metrics could not be encoded\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// `GET path` over a fresh connection: the status line and the body.
    async fn get(addr: SocketAddr, path: &str) -> (String, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let status = head.lines().next().unwrap_or_default().to_owned();
        (status, body.to_owned())
    }

    #[tokio::test]
    async fn probes_status_and_metrics_answer_as_the_daemon_says() {
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        registry.register("egressgw_test_things", "Things counted.", counter.clone());
        counter.inc_by(3);
        let health = Arc::new(Health::new(registry));
        let addr = serve("127.0.0.1:0".parse().unwrap(), Arc::clone(&health))
            .await
            .unwrap();

        assert!(get(addr, "/livez").await.0.contains(" 200 "));
        assert!(get(addr, "/healthz").await.0.contains(" 200 "));
        let (status, body) = get(addr, "/readyz").await;
        assert!(status.contains(" 503 "), "{status}");
        assert_eq!(body, "not ready: starting\n");
        health.set_ready(Ok(()));
        assert!(get(addr, "/readyz").await.0.contains(" 200 "));
        health.set_ready(Err("gateway egw: no candidate node answers".into()));
        let (status, body) = get(addr, "/readyz").await;
        assert!(status.contains(" 503 "), "{status}");
        assert_eq!(body, "not ready: gateway egw: no candidate node answers\n");

        // A loop that beats is live while it beats.
        health.expect_beats(Duration::from_millis(200));
        assert!(get(addr, "/livez").await.0.contains(" 200 "));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = get(addr, "/livez").await;
        assert!(status.contains(" 503 "), "{status}");
        assert!(
            body.starts_with("not live: the loop has not run for"),
            "{body}"
        );
        health.beat();
        assert!(get(addr, "/livez").await.0.contains(" 200 "));

        health.set_status(serde_json::json!({"node": "node-1"}));
        let (_, body) = get(addr, "/status").await;
        let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(parsed["node"], "node-1");

        let (status, body) = get(addr, "/metrics").await;
        assert!(status.contains(" 200 "), "{status}");
        assert!(
            body.contains("# TYPE egressgw_test_things counter"),
            "{body}"
        );
        assert!(body.contains("egressgw_test_things_total 3"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
        assert!(get(addr, "/nothing").await.0.contains(" 404 "));
    }
}

//! `egressgw doctor --throughput`: how fast this node sends to a peer over
//! the underlay and through the tunnel, each for a bounded time, to the
//! peer agent's `POST /sink`; and the ratio of the two. A tunnel far
//! slower than its underlay usually means offloads are off (the `offload`
//! and `parent` checks say which) or packets are fragmented (`path`).

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use http_body_util::StreamBody;
use hyper::body::{Bytes, Frame};

use super::{Check, Verdict};

/// How long each way is measured.
pub const SEND_FOR: Duration = Duration::from_secs(2);
/// At most this many peers are measured, one after the other.
pub const PEERS: usize = 3;
/// Below this share of its underlay's rate the tunnel is worth a look.
const RATIO_WARN: f64 = 0.5;

/// One peer's two measurements, in bit/s.
#[derive(Debug, Clone)]
pub struct Measured {
    pub underlay: Ipv4Addr,
    pub tunnel: Ipv4Addr,
    pub over_underlay: Result<f64, String>,
    pub through_tunnel: Result<f64, String>,
}

/// Sends as much as one connection carries for `time` to `POST /sink` at
/// `addr`; the rate the far end counted, in bit/s.
pub async fn push(addr: SocketAddr, time: Duration) -> Result<f64, String> {
    let chunk = Bytes::from(vec![0u8; 256 * 1024]);
    let until = Instant::now() + time;
    let frames = futures_util::stream::unfold((), move |()| {
        let chunk = chunk.clone();
        async move { (Instant::now() < until).then(|| (Ok::<_, Infallible>(Frame::data(chunk)), ())) }
    });
    let request = hyper::Request::post("/sink")
        .header(hyper::header::HOST, addr.to_string())
        .body(StreamBody::new(frames))
        .map_err(|e| e.to_string())?;
    let limit = time + crate::cluster::health::SINK_LIMIT;
    let (code, body) = tokio::time::timeout(limit, super::send(addr, request))
        .await
        .map_err(|_| format!("no answer within {} s", limit.as_secs()))??;
    if code != 200 {
        return Err(format!("{addr} answered {code}: {}", body.trim()));
    }
    let counted: serde_json::Value =
        serde_json::from_str(&body).map_err(|e| format!("{addr}: {e}"))?;
    let bytes = counted["bytes"].as_u64().unwrap_or(0);
    let seconds = counted["seconds"].as_f64().unwrap_or(0.0);
    if bytes == 0 || seconds <= 0.0 {
        return Err(format!("{addr} received nothing"));
    }
    Ok(bytes as f64 * 8.0 / seconds)
}

/// Measures each peer (tunnel address, underlay address) at the agents'
/// health `port`: first over the underlay, then through the tunnel.
pub async fn measure(peers: &[(Ipv4Addr, Ipv4Addr)], port: u16) -> Vec<Measured> {
    let mut out = Vec::new();
    for &(tunnel, underlay) in peers.iter().take(PEERS) {
        let over_underlay = push(SocketAddr::from((underlay, port)), SEND_FOR).await;
        let through_tunnel = push(SocketAddr::from((tunnel, port)), SEND_FOR).await;
        out.push(Measured {
            underlay,
            tunnel,
            over_underlay,
            through_tunnel,
        });
    }
    out
}

fn gbits(rate: f64) -> String {
    format!("{:.2} Gbit/s", rate / 1e9)
}

/// The `throughput` check of what [`measure`] found.
pub fn check(measured: &[Measured]) -> Check {
    if measured.is_empty() {
        return Check::new(
            "throughput",
            Verdict::Skip,
            "no IPv4 peer of the tunnel to measure",
        );
    }
    let mut seen = Vec::new();
    let mut verdict = Verdict::Pass;
    for m in measured {
        let line = match (&m.over_underlay, &m.through_tunnel) {
            (Ok(u), Ok(t)) => {
                let ratio = t / u;
                if ratio < RATIO_WARN {
                    verdict = verdict.max(Verdict::Warn);
                }
                format!(
                    "to {} (tunnel {}): underlay {}, tunnel {} ({ratio:.2} of it)",
                    m.underlay,
                    m.tunnel,
                    gbits(*u),
                    gbits(*t)
                )
            }
            (Ok(u), Err(e)) => {
                verdict = Verdict::Fail;
                format!(
                    "to {}: underlay {}, tunnel failed: {e}",
                    m.underlay,
                    gbits(*u)
                )
            }
            (Err(e), _) => {
                verdict = verdict.max(Verdict::Warn);
                format!("to {}: cannot measure ({e})", m.underlay)
            }
        };
        seen.push(line);
    }
    let check = Check::new("throughput", verdict, seen.join("; "));
    match verdict {
        Verdict::Pass | Verdict::Skip => check,
        _ => check.fix(format!(
            "a tunnel under {RATIO_WARN} of its underlay: see the `offload`, `parent` and `path` \
             checks; a peer that cannot be measured runs an agent without /sink or blocks its \
             health port"
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cluster::health::{self, Health};

    fn measured(u: Result<f64, String>, t: Result<f64, String>) -> Measured {
        Measured {
            underlay: "172.18.0.11".parse().unwrap(),
            tunnel: "172.31.0.1".parse().unwrap(),
            over_underlay: u,
            through_tunnel: t,
        }
    }

    #[test]
    fn a_tunnel_far_below_its_underlay_is_worth_a_look() {
        let c = check(&[measured(Ok(9.4e9), Ok(9.1e9))]);
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.evidence,
            "to 172.18.0.11 (tunnel 172.31.0.1): underlay 9.40 Gbit/s, tunnel 9.10 Gbit/s (0.97 of it)"
        );
        assert_eq!(
            check(&[measured(Ok(8.9e9), Ok(2.5e9))]).verdict,
            Verdict::Warn
        );
        let failed = check(&[measured(Ok(8.9e9), Err("connection refused".into()))]);
        assert_eq!(failed.verdict, Verdict::Fail);
        assert!(
            failed
                .evidence
                .contains("tunnel failed: connection refused")
        );
        assert_eq!(check(&[]).verdict, Verdict::Skip);
    }

    #[tokio::test]
    async fn the_sink_counts_what_one_sender_pushes_and_turns_a_second_away() {
        let health = Arc::new(Health::default().with_sink());
        let addr = health::serve("127.0.0.1:0".parse().unwrap(), health)
            .await
            .unwrap();
        let (first, second) = tokio::join!(push(addr, Duration::from_millis(600)), async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            push(addr, Duration::from_millis(100)).await
        });
        let rate = first.unwrap();
        assert!(rate > 1e6, "{rate} bit/s over loopback");
        let refused = second.unwrap_err();
        assert!(refused.contains("answered 429"), "{refused}");
        // Without a sink (a controller): nothing to measure.
        let plain = health::serve("127.0.0.1:0".parse().unwrap(), Arc::new(Health::default()))
            .await
            .unwrap();
        let err = push(plain, Duration::from_millis(50)).await.unwrap_err();
        assert!(err.contains("answered 404"), "{err}");
    }
}

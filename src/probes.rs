//! `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`, and `/poke`,
//! where peers say the change counter moved (`worker::pokes`).

use crate::lease::ClockGauge;
use crate::metrics::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;

/// Liveness and readiness, set by the worker.
#[derive(Debug)]
pub struct Health {
    ready: AtomicBool,
    draining: AtomicBool,
    /// The lease store's reachability flag (see `LeaseStore::reachability`).
    store_ok: Arc<AtomicBool>,
    /// This clock against DynamoDB's, and how far apart they may be.
    clock: Arc<ClockGauge>,
    max_clock_skew: Duration,
}

impl Health {
    pub fn new(
        store_ok: Arc<AtomicBool>,
        clock: Arc<ClockGauge>,
        max_clock_skew: Duration,
    ) -> Self {
        Self {
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            store_ok,
            clock,
            max_clock_skew,
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Once draining, never ready again.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Why the worker is not ready to acquire streams, if it is not: not
    /// started, draining, DynamoDB not answering, or the clock too far off.
    pub fn not_ready(&self) -> Option<String> {
        if !self.ready.load(Ordering::SeqCst) {
            return Some("not started".into());
        }
        if self.draining.load(Ordering::SeqCst) {
            return Some("draining".into());
        }
        if !self.store_ok.load(Ordering::SeqCst) {
            return Some("DynamoDB is not answering".into());
        }
        match self.clock.bounds() {
            Some(b) if b.exceeds(self.max_clock_skew) => Some(format!(
                "this clock is off DynamoDB's by {} to {} ms, beyond --max-clock-skew {:?}",
                b.low, b.high, self.max_clock_skew
            )),
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.not_ready().is_none()
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    /// Set by `/poke`, taken by the worker's next quiet pass.
    doorbell: Arc<AtomicBool>,
}

/// Binds the probe and metrics listener. `[::]` is dual-stack on Linux (the
/// kernel's default `bindv6only=0`), so one address serves IPv4, IPv6 and
/// dual-stack clusters alike; where the node has no IPv6 at all, binding it
/// fails and the IPv4 wildcard on the same port is used instead.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Ok(listener) => Ok(listener),
        Err(e) if addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) => {
            let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, addr.port()));
            tracing::warn!(%addr, error = %e, fallback = %v4, "no IPv6 here; listening on IPv4 only");
            TcpListener::bind(v4).await
        }
        Err(e) => Err(e),
    }
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    doorbell: Arc<AtomicBool>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(AppState {
        metrics,
        health,
        doorbell,
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .route("/poke", post(poke_handler))
        .with_state(state)
}

/// A peer moved the change counter. Nothing is read from the request: the
/// worker reads the counter itself, so a poke from anyone costs one read.
async fn poke_handler(State(state): State<AppState>) -> StatusCode {
    state.doorbell.store(true, Ordering::Release);
    state.metrics.worker.pokes_received.inc();
    StatusCode::NO_CONTENT
}

/// OpenMetrics when the scraper asks for it (Prometheus does), classic
/// Prometheus text otherwise.
async fn metrics_handler(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    if wants_openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            state.metrics.encode(),
        )
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            state.metrics.encode_prometheus_text(),
        )
    }
}

async fn ready_handler(State(state): State<AppState>) -> impl IntoResponse {
    match state.health.not_ready() {
        None => (StatusCode::OK, "ready\n".to_string()),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chart binds `[::]`: probes and scrapes over IPv4 and IPv6 both reach it.
    #[tokio::test]
    async fn the_ipv6_wildcard_serves_ipv4_and_ipv6_clients() {
        let listener = bind("[::]:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepting = tokio::spawn(async move {
            for _ in 0..2 {
                listener.accept().await.unwrap();
            }
        });
        tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .expect("an IPv4 client connects");
        tokio::net::TcpStream::connect((Ipv6Addr::LOCALHOST, port))
            .await
            .expect("an IPv6 client connects");
        accepting.await.unwrap();
    }

    /// A peer's poke rings the doorbell the worker's next quiet pass takes,
    /// and is counted; only a POST does.
    #[tokio::test]
    async fn a_poke_rings_the_doorbell_and_only_a_post_does() {
        crate::support::install_crypto_provider();
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let health = Arc::new(Health::new(
            Arc::default(),
            Arc::default(),
            Duration::from_secs(1),
        ));
        let doorbell = Arc::new(AtomicBool::new(false));
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(serve(
            listener,
            metrics.clone(),
            health,
            doorbell.clone(),
            stop.clone().cancelled_owned(),
        ));
        let client = reqwest::Client::new();
        let url = format!("http://{addr}/poke");
        let got = client.get(&url).send().await.unwrap().status();
        assert_eq!(got.as_u16(), 405);
        assert!(!doorbell.load(Ordering::Acquire), "a GET rang the doorbell");
        let posted = client.post(&url).send().await.unwrap().status();
        assert_eq!(posted.as_u16(), 204);
        assert!(doorbell.load(Ordering::Acquire));
        assert_eq!(metrics.worker.pokes_received.get(), 1);
        stop.cancel();
        server.await.unwrap().unwrap();
    }
}

//! `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`.

use crate::lease::ClockGauge;
use crate::metrics::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
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
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(AppState { metrics, health });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
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

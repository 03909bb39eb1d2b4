//! `/metrics`, `/healthz` and `/readyz` on `--metrics-addr`.

use crate::metrics::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::net::TcpListener;

/// Liveness and readiness, set by the worker.
#[derive(Debug)]
pub struct Health {
    ready: AtomicBool,
    draining: AtomicBool,
    /// The lease store's reachability flag (see `LeaseStore::reachability`).
    store_ok: Arc<AtomicBool>,
}

impl Health {
    pub fn new(store_ok: Arc<AtomicBool>) -> Self {
        Self {
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            store_ok,
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Once draining, never ready again.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Ready to acquire streams: started, not draining, and DynamoDB answering.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
            && !self.draining.load(Ordering::SeqCst)
            && self.store_ok.load(Ordering::SeqCst)
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
    if state.health.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

//! An HTTP proxy in front of a DynamoDB-compatible server that can cut a worker
//! off (requests hang, as in a partition) or throttle it (a share of requests
//! answered with `ProvisionedThroughputExceededException`, as DynamoDB does).

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use rand::Rng;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DynamoFault {
    Pass,
    /// Requests hang until the mode changes, then fail.
    Blackhole,
    /// This fraction of requests (0.0..=1.0) is throttled.
    Throttle(f64),
}

struct ProxyState {
    target: String,
    client: reqwest::Client,
    mode: watch::Receiver<DynamoFault>,
    throttled: AtomicU64,
}

/// A running proxy; stops when dropped.
pub struct DynamoFaultProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<DynamoFault>,
    state: Arc<ProxyState>,
    task: JoinHandle<()>,
}

impl Drop for DynamoFaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DynamoFaultProxy {
    pub async fn start(listen: SocketAddr, target: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (mode, receiver) = watch::channel(DynamoFault::Pass);
        let state = Arc::new(ProxyState {
            target: target.trim_end_matches('/').to_string(),
            client: reqwest::Client::new(),
            mode: receiver,
            throttled: AtomicU64::new(0),
        });
        let app = Router::new().fallback(forward).with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            mode,
            state,
            task,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, fault: DynamoFault) {
        self.mode.send_replace(fault);
    }

    /// Requests answered with a throttling error so far.
    pub fn throttled(&self) -> u64 {
        self.state.throttled.load(Ordering::SeqCst)
    }
}

async fn forward(
    State(state): State<Arc<ProxyState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mode = *state.mode.borrow();
    match mode {
        DynamoFault::Blackhole => {
            let mut changes = state.mode.clone();
            let _ = changes.changed().await;
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        DynamoFault::Throttle(share) if rand::rng().random_bool(share.clamp(0.0, 1.0)) => {
            state.throttled.fetch_add(1, Ordering::SeqCst);
            let body = r#"{"__type":"com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException","message":"The level of configured provisioned throughput for the table was exceeded (injected by the test proxy)"}"#;
            return (
                StatusCode::BAD_REQUEST,
                [("content-type", "application/x-amz-json-1.0")],
                body,
            )
                .into_response();
        }
        _ => {}
    }
    let mut request = state.client.post(&state.target).body(body);
    for (name, value) in &headers {
        if name != "host" && name != "content-length" {
            request = request.header(name, value);
        }
    }
    match request.send().await {
        Ok(resp) => {
            let status = resp.status();
            let mut out = HeaderMap::new();
            for (name, value) in resp.headers() {
                if name != "content-length" && name != "transfer-encoding" {
                    out.insert(name.clone(), value.clone());
                }
            }
            let bytes = resp.bytes().await.unwrap_or_default();
            (status, out, bytes).into_response()
        }
        Err(_) => StatusCode::BAD_GATEWAY.into_response(),
    }
}

//! Sinks for tests: the product's verifying sink, a fault proxy in front of it
//! (outages, slow answers, a plain 409), and a sink that only counts.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
pub use tether::cli::demo::sink::{StreamLog, VerifyingSink};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the sink proxy does to each request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SinkFault {
    Pass,
    /// Answer HTTP 503 without forwarding (an outage).
    Unavailable,
    /// Forward after this long (a slow sink).
    Slow(Duration),
    /// Forward after this long, and keep doing so after the client hung up
    /// (as real servers do: a request that arrived is processed, whether or
    /// not anyone waits for the answer).
    SlowAfterHangUp(Duration),
    /// Answer a plain HTTP 409, without the fenced signal (a sink that
    /// reports duplicates that way).
    PlainConflict,
}

struct ProxyState {
    target: String,
    client: reqwest::Client,
    fault: watch::Receiver<SinkFault>,
    refused: AtomicU64,
    /// The `traceparent` header of every request, in arrival order.
    traceparents: std::sync::Mutex<Vec<String>>,
}

/// An HTTP proxy in front of a sink that injects faults.
pub struct SinkProxy {
    pub addr: SocketAddr,
    fault: watch::Sender<SinkFault>,
    state: Arc<ProxyState>,
    task: JoinHandle<()>,
}

impl Drop for SinkProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SinkProxy {
    pub async fn start(listen: SocketAddr, target: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (fault, rx) = watch::channel(SinkFault::Pass);
        let state = Arc::new(ProxyState {
            target,
            client: reqwest::Client::new(),
            fault: rx,
            refused: AtomicU64::new(0),
            traceparents: std::sync::Mutex::default(),
        });
        let app = Router::new().fallback(forward).with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            fault,
            state,
            task,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    pub fn set(&self, fault: SinkFault) {
        self.fault.send_replace(fault);
    }

    /// The `traceparent` header of every request that carried one.
    pub fn traceparents(&self) -> Vec<String> {
        self.state
            .traceparents
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default()
    }

    /// Requests answered with an injected failure so far.
    pub fn refused(&self) -> u64 {
        self.state.refused.load(Ordering::SeqCst)
    }
}

async fn forward(
    State(state): State<Arc<ProxyState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok())
        && let Ok(mut seen) = state.traceparents.lock()
    {
        seen.push(tp.to_string());
    }
    let fault = *state.fault.borrow();
    match fault {
        SinkFault::Unavailable => {
            state.refused.fetch_add(1, Ordering::SeqCst);
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        SinkFault::PlainConflict => {
            state.refused.fetch_add(1, Ordering::SeqCst);
            return StatusCode::CONFLICT.into_response();
        }
        SinkFault::Slow(d) => tokio::time::sleep(d).await,
        SinkFault::SlowAfterHangUp(d) => {
            // The processing is its own task: the handler's future is dropped
            // when the client hangs up, the task is not.
            let state = state.clone();
            let processing = tokio::spawn(async move {
                tokio::time::sleep(d).await;
                pass_on(&state, &headers, body).await
            });
            return processing
                .await
                .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response());
        }
        SinkFault::Pass => {}
    }
    pass_on(&state, &headers, body).await
}

/// Forwards the request to the sink and its answer back.
async fn pass_on(state: &ProxyState, headers: &HeaderMap, body: Bytes) -> Response {
    let mut request = state.client.post(&state.target).body(body);
    if let Some(ct) = headers.get("content-type") {
        request = request.header("content-type", ct);
    }
    crate::relay::relay(request.send().await).await
}

/// A sink that acknowledges everything and only counts messages (for
/// throughput runs, where recording each one would be the bottleneck).
pub struct CountingSink {
    pub addr: SocketAddr,
    messages: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for CountingSink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(serde::Deserialize)]
struct Counted {
    messages: Vec<serde::de::IgnoredAny>,
}

impl CountingSink {
    pub async fn start(listen: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let messages = Arc::new(AtomicU64::new(0));
        let app = Router::new().fallback({
            let messages = messages.clone();
            move |body: Bytes| {
                let messages = messages.clone();
                async move {
                    match serde_json::from_slice::<Counted>(&body) {
                        Ok(c) => {
                            messages.fetch_add(c.messages.len() as u64, Ordering::Relaxed);
                            StatusCode::OK
                        }
                        Err(_) => StatusCode::BAD_REQUEST,
                    }
                }
            }
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr,
            messages,
            task,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    pub fn messages(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }
}

//! The demo's sink: an HTTP sink that verifies what it receives — which
//! sequence numbers arrived (gaps, duplicates), under which fencing token
//! (deliveries from an owner already superseded), and when. It can act as a
//! fencing-aware sink: refusing stale tokens with the contract's fenced signal.

use crate::sink::FENCED_HEADER;
use crate::support::lock;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[derive(Deserialize)]
struct Payload {
    connection: String,
    worker: String,
    token: u64,
    messages: Vec<PayloadMessage>,
}

#[derive(Deserialize)]
struct PayloadMessage {
    seq: u64,
}

/// What one stream received.
#[derive(Clone, Debug, Default)]
pub struct StreamLog {
    /// seq → number of times delivered.
    pub seqs: BTreeMap<u64, u32>,
    /// Highest fencing token seen.
    pub max_token: u64,
    /// Messages applied although their token was lower than one already
    /// applied (a stale delivery).
    pub stale_messages: u64,
    /// Messages with such a token that were refused with the fenced signal
    /// (only while refusing stale tokens): not applied, so not stale.
    pub refused_stale: u64,
    /// (arrival, token, worker) of each accepted batch.
    pub batches: Vec<(Instant, u64, String)>,
}

impl StreamLog {
    /// Sequence numbers missing between `first` and the highest delivered.
    pub fn gaps(&self, first: u64) -> Vec<u64> {
        let Some((&max, _)) = self.seqs.last_key_value() else {
            return Vec::new();
        };
        (first..=max)
            .filter(|s| !self.seqs.contains_key(s))
            .collect()
    }

    pub fn max_seq(&self) -> Option<u64> {
        self.seqs.last_key_value().map(|(s, _)| *s)
    }

    pub fn duplicates(&self) -> u64 {
        self.seqs
            .values()
            .map(|n| u64::from(n.saturating_sub(1)))
            .sum()
    }
}

#[derive(Default)]
struct SinkState {
    streams: Mutex<HashMap<String, StreamLog>>,
    reject_stale: AtomicBool,
    requests: AtomicU64,
    messages: AtomicU64,
}

/// A running verifying sink; stops when dropped.
pub struct VerifyingSink {
    pub addr: SocketAddr,
    state: Arc<SinkState>,
    task: JoinHandle<()>,
}

impl Drop for VerifyingSink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl VerifyingSink {
    pub async fn start(listen: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(SinkState::default());
        let app = Router::new()
            .route("/", post(receive))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, state, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Refuse deliveries carrying a superseded token with the fenced signal
    /// (HTTP 409 and `Tether-Fenced: true`), as a fencing-aware sink does.
    pub fn set_reject_stale(&self, reject: bool) {
        self.state.reject_stale.store(reject, Ordering::SeqCst);
    }

    /// Messages accepted so far.
    pub fn messages(&self) -> u64 {
        self.state.messages.load(Ordering::SeqCst)
    }

    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    pub fn log(&self, connection: &str) -> StreamLog {
        lock(&self.state.streams)
            .get(connection)
            .cloned()
            .unwrap_or_default()
    }

    pub fn logs(&self) -> HashMap<String, StreamLog> {
        lock(&self.state.streams).clone()
    }

    /// Messages refused as stale across all streams (while refusing).
    pub fn refused_stale(&self) -> u64 {
        lock(&self.state.streams)
            .values()
            .map(|l| l.refused_stale)
            .sum()
    }

    /// Stale messages applied across all streams.
    pub fn stale_messages(&self) -> u64 {
        lock(&self.state.streams)
            .values()
            .map(|l| l.stale_messages)
            .sum()
    }
}

async fn receive(
    State(state): State<Arc<SinkState>>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    state.requests.fetch_add(1, Ordering::SeqCst);
    let Ok(payload) = serde_json::from_slice::<Payload>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut streams = lock(&state.streams);
    let log = streams.entry(payload.connection).or_default();
    if payload.token < log.max_token {
        if state.reject_stale.load(Ordering::SeqCst) {
            log.refused_stale += payload.messages.len() as u64;
            return (StatusCode::CONFLICT, [(FENCED_HEADER, "true")]).into_response();
        }
        log.stale_messages += payload.messages.len() as u64;
    }
    state
        .messages
        .fetch_add(payload.messages.len() as u64, Ordering::SeqCst);
    log.max_token = log.max_token.max(payload.token);
    for m in &payload.messages {
        *log.seqs.entry(m.seq).or_insert(0) += 1;
    }
    log.batches
        .push((Instant::now(), payload.token, payload.worker));
    StatusCode::OK.into_response()
}

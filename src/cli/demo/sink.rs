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
    /// The message as a JSON value (`dataFormat: json`); absent when it
    /// travels as a string in `data`.
    #[serde(default)]
    json: Option<serde_json::Value>,
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
    /// Messages that arrived as JSON values (`dataFormat: json`).
    pub carried_as_json: u64,
    /// Of those, messages whose own `seq` is not the envelope's: the demo's
    /// feeds number their messages at `/seq`, so the value must carry it.
    pub json_mismatched: u64,
    /// Messages with such a token that were refused with the fenced signal
    /// (only while refusing stale tokens): not applied, so not stale.
    pub refused_stale: u64,
    /// (arrival, token, worker) of each accepted batch.
    pub batches: Vec<(Instant, u64, String)>,
    /// (token, sequence numbers) of each applied batch, in order: what a
    /// verifier keyed by the stream's identity splits at the first token of
    /// each later identity.
    pub applied: Vec<(u64, Vec<u64>)>,
}

impl StreamLog {
    /// Sequence numbers missing between `first` and the highest delivered.
    pub fn gaps(&self, first: u64) -> Vec<u64> {
        missing(&self.seqs, first)
    }

    pub fn max_seq(&self) -> Option<u64> {
        self.seqs.last_key_value().map(|(s, _)| *s)
    }

    pub fn duplicates(&self) -> u64 {
        repeats(&self.seqs)
    }

    /// The stream's sequence numbers split by identity: a resource deleted
    /// and created again under the same name is a new stream whose feed may
    /// start again, and its tokens start above every earlier one. `floors`
    /// are the first token of each later identity, ascending; identity `k`
    /// holds the batches whose token is at or above `k` floors. seq → times
    /// applied, per identity.
    pub fn by_identity(&self, floors: &[u64]) -> Vec<BTreeMap<u64, u32>> {
        let mut identities = vec![BTreeMap::new(); floors.len() + 1];
        for (token, seqs) in &self.applied {
            let k = floors.iter().filter(|f| token >= f).count();
            for s in seqs {
                *identities[k].entry(*s).or_insert(0) += 1;
            }
        }
        identities
    }

    /// Per identity (see [`StreamLog::by_identity`]): the sequence numbers
    /// missing between `first` and the highest that identity delivered.
    pub fn gaps_by_identity(&self, first: u64, floors: &[u64]) -> Vec<Vec<u64>> {
        self.by_identity(floors)
            .iter()
            .map(|seqs| missing(seqs, first))
            .collect()
    }

    /// Per identity, as [`StreamLog::duplicates`] is for the whole name.
    pub fn duplicates_by_identity(&self, floors: &[u64]) -> u64 {
        self.by_identity(floors).iter().map(repeats).sum()
    }
}

/// seq → times applied: the numbers missing between `first` and the highest.
fn missing(seqs: &BTreeMap<u64, u32>, first: u64) -> Vec<u64> {
    let Some((&max, _)) = seqs.last_key_value() else {
        return Vec::new();
    };
    (first..=max).filter(|s| !seqs.contains_key(s)).collect()
}

/// seq → times applied: deliveries beyond the first of each number.
fn repeats(seqs: &BTreeMap<u64, u32>) -> u64 {
    seqs.values().map(|n| u64::from(n.saturating_sub(1))).sum()
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
        if let Some(value) = &m.json {
            log.carried_as_json += 1;
            if value.get("seq").and_then(serde_json::Value::as_u64) != Some(m.seq) {
                log.json_mismatched += 1;
            }
        }
    }
    log.batches
        .push((Instant::now(), payload.token, payload.worker));
    log.applied.push((
        payload.token,
        payload.messages.iter().map(|m| m.seq).collect(),
    ));
    StatusCode::OK.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream replaced under its name: the old identity delivered 0..=9
    /// with tokens 1 and 2; the new one (tokens from 4) should start again
    /// at 0, but resumed at 10 as if it had inherited the old checkpoint.
    /// Keyed by name, nothing is missing; keyed by identity, 0..=9 are.
    #[test]
    fn a_new_identity_that_skips_its_beginning_shows_gaps_only_keyed_by_identity() {
        let mut log = StreamLog::default();
        for (token, seqs) in [(1, 0..5), (2, 5..10), (4, 10..15)] {
            let seqs: Vec<u64> = seqs.collect();
            for s in &seqs {
                *log.seqs.entry(*s).or_insert(0) += 1;
            }
            log.applied.push((token, seqs));
        }
        assert_eq!(log.gaps(0), Vec::<u64>::new());
        let gaps = log.gaps_by_identity(0, &[3]);
        assert_eq!(gaps[0], Vec::<u64>::new());
        assert_eq!(gaps[1], (0..10).collect::<Vec<u64>>());
        // Started again at 0, as it must: no gaps in either identity.
        log.applied[2] = (4, (0..5).collect());
        assert_eq!(log.gaps_by_identity(0, &[3]), vec![Vec::<u64>::new(); 2]);
    }
}

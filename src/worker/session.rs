//! One upstream WebSocket session: connect, subscribe, read, batch, deliver,
//! keep alive, and reconnect with jittered backoff, until stopped, aborted,
//! fenced, or refused for good.
//!
//! Delivery is in line with reading: while a batch is delivered (or retried
//! against a failing sink) nothing more is read from the socket, which is the
//! backpressure the stream contract asks for.

use super::delivery::{Delivery, Undelivered};
use super::fence::Fence;
use super::kinesis_scope::KinesisStreams;
use super::policy::HostPolicy;
use super::progress::StreamProgress;
use super::transport::{CONNECT_TIMEOUT, ConnectError, Dialer, Ws, resume_url};
use crate::crd::StreamConnectionSpec;
use crate::lease::{Phase, RetryPolicy, StreamKey, now_ms};
use crate::metrics::WorkerMetrics;
use crate::sink::{Message, Sink, SinkClients};
use base64::Engine;
use futures::{SinkExt, StreamExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Bound on a close handshake before the socket is simply dropped.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Reconnect backoff: first step and cap (full jitter).
pub const RECONNECT_BACKOFF: RetryPolicy = RetryPolicy {
    first_delay: Duration::from_millis(250),
    max_delay: Duration::from_secs(30),
    deadline: Duration::MAX,
};
/// A session that lasted this long resets the reconnect backoff.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// What a session serves.
pub struct SessionConfig {
    pub key: StreamKey,
    /// `namespace/name`, as sink payloads name the stream.
    pub connection: String,
    /// The owning incarnation, as sink payloads name the worker.
    pub worker: Arc<str>,
    /// The fencing token, sent with every sink payload.
    pub token: u64,
    /// Shared with the stream's holder.
    pub spec: Arc<StreamConnectionSpec>,
    /// The stream's one session slot, held for the session's whole life: a
    /// session that was aborted is dropped (its socket closed) only when the
    /// runtime next runs its task, so the next session of the stream waits
    /// for this to be released rather than for the abort to be requested.
    pub turn: tokio::sync::OwnedSemaphorePermit,
}

/// What a session needs from its worker.
#[derive(Clone)]
pub struct SessionDeps {
    pub dialer: Dialer,
    pub sinks: Arc<SinkClients>,
    pub sink_policy: HostPolicy,
    /// Which Kinesis streams each namespace may write to.
    pub kinesis_streams: KinesisStreams,
    pub metrics: Arc<WorkerMetrics>,
    pub fence: Arc<Fence>,
}

/// How a session ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// Asked to stop: the batch was flushed and a normal close frame sent.
    Stopped,
    /// Asked to abort: closed at once, nothing more delivered.
    Aborted,
    /// The worker's fence closed: nothing more delivered.
    Fenced,
    /// The sink refused our fencing token: somebody newer owns the stream.
    SinkFenced,
    /// A permanent refusal (host policy): not retried until the spec changes.
    Failed(String),
}

/// Cancellation handles: `stop` drains gracefully, `abort` does not.
#[derive(Clone, Default)]
pub struct SessionControl {
    pub stop: CancellationToken,
    pub abort: CancellationToken,
}

/// Why a connected session ended.
enum PumpEnd {
    Ended(SessionEnd),
    Disconnected { kind: &'static str, message: String },
}

impl From<Undelivered> for SessionEnd {
    fn from(u: Undelivered) -> Self {
        match u {
            Undelivered::Aborted => Self::Aborted,
            Undelivered::Fenced => Self::Fenced,
            Undelivered::SinkFenced => Self::SinkFenced,
        }
    }
}

/// Keeps the connected-sessions gauge honest whatever way a session ends.
struct ActiveGuard(Arc<WorkerMetrics>);

impl ActiveGuard {
    fn new(metrics: &Arc<WorkerMetrics>) -> Self {
        metrics.sessions_connected.inc();
        Self(metrics.clone())
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.sessions_connected.dec();
    }
}

/// What a held stream runs while the worker's fence is open. The product runs
/// a WebSocket session ([`WebSocketSessions`]); the benchmarks' lease-only
/// scale runs plug in a session that holds nothing, so one machine can hold
/// the leases of 100,000 streams.
pub trait Sessions: Send + Sync + 'static {
    fn start(
        &self,
        cfg: SessionConfig,
        progress: Arc<StreamProgress>,
        deps: Arc<SessionDeps>,
        ctl: SessionControl,
    ) -> tokio::task::JoinHandle<SessionEnd>;
}

/// Upstream WebSocket sessions.
pub struct WebSocketSessions;

impl Sessions for WebSocketSessions {
    fn start(
        &self,
        cfg: SessionConfig,
        progress: Arc<StreamProgress>,
        deps: Arc<SessionDeps>,
        ctl: SessionControl,
    ) -> tokio::task::JoinHandle<SessionEnd> {
        // The session's span: the parent of its connects and sink batches.
        let span = tracing::info_span!("session", stream = %cfg.key, token = cfg.token, worker = %cfg.worker);
        tokio::spawn(run(cfg, progress, deps, ctl).instrument(span))
    }
}

/// Runs the session until it is stopped, aborted, fenced, or refused for good.
pub async fn run(
    cfg: SessionConfig,
    progress: Arc<StreamProgress>,
    deps: Arc<SessionDeps>,
    ctl: SessionControl,
) -> SessionEnd {
    if let Err(message) = sink_allowed(&cfg.spec, &cfg.key.namespace, &deps).await {
        deps.metrics
            .session_errors
            .get_or_create(&[("kind", "sink_policy")])
            .inc();
        tracing::warn!(stream = %cfg.key, %message, "sink refused by host policy; not connecting");
        progress.update_status(|s| {
            s.phase = Phase::Failed;
            s.reason = Some("SinkNotAllowed".into());
            s.message = Some(message.clone());
            s.connected_since_ms = None;
        });
        return SessionEnd::Failed(message);
    }
    let sink = Sink::from_spec(&cfg.spec.sink, &cfg.key.namespace, &deps.sinks);
    let mut attempt = 0u32;
    loop {
        if ctl.abort.is_cancelled() {
            return SessionEnd::Aborted;
        }
        if ctl.stop.is_cancelled() {
            return SessionEnd::Stopped;
        }
        if !deps.fence.is_valid() {
            return SessionEnd::Fenced;
        }
        let checkpoint = progress.acked();
        progress.update_status(|s| s.phase = Phase::Connecting);
        let url = resume_url(&cfg.spec.url, cfg.spec.initial_url.as_deref(), checkpoint);
        let host = url::Url::parse(&url)
            .ok()
            .and_then(|u| u.host_str().map(str::to_string))
            .unwrap_or_default();
        if let Some(at) = deps.dialer.connect_limit.reserve(&host)
            && at > Instant::now()
        {
            deps.metrics.connects_paced.inc();
            tokio::select! {
                _ = sleep_until(at) => {}
                _ = ctl.abort.cancelled() => return SessionEnd::Aborted,
                _ = ctl.stop.cancelled() => return SessionEnd::Stopped,
                _ = deps.fence.closed() => return SessionEnd::Fenced,
            }
        }
        let connected = tokio::select! {
            // Boxed: TLS and handshake state is large and only needed while connecting.
            r = timeout(CONNECT_TIMEOUT, Box::pin(deps.dialer.dial(&cfg.key, &cfg.spec, &url).instrument(
                tracing::info_span!("connect", host = %host, resume_from = checkpoint.map(|c| c as i64).unwrap_or(-1))
            ))) => r.unwrap_or(Err(ConnectError::Timeout)),
            _ = ctl.abort.cancelled() => return SessionEnd::Aborted,
            _ = ctl.stop.cancelled() => return SessionEnd::Stopped,
            _ = deps.fence.closed() => return SessionEnd::Fenced,
        };
        let (kind, reason, message) = match connected {
            Ok(ws) => {
                let started = Instant::now();
                progress.update_status(|s| {
                    s.phase = Phase::Connected;
                    s.reason = None;
                    s.message = None;
                    s.connected_since_ms = Some(now_ms());
                });
                tracing::info!(stream = %cfg.key, token = cfg.token, checkpoint = ?checkpoint, "session connected");
                let active = ActiveGuard::new(&deps.metrics);
                let end = pump(ws, &cfg, &progress, &deps, &sink, &ctl, checkpoint).await;
                drop(active);
                match end {
                    PumpEnd::Ended(end) => return end,
                    PumpEnd::Disconnected { kind, message } => {
                        if started.elapsed() >= STABLE_SESSION {
                            attempt = 0;
                        }
                        (kind, "Disconnected", message)
                    }
                }
            }
            Err(e) if e.is_permanent() => {
                let message = e.message();
                deps.metrics
                    .session_errors
                    .get_or_create(&[("kind", e.kind())])
                    .inc();
                tracing::warn!(stream = %cfg.key, %message, "stream refused by host policy; not dialling");
                progress.update_status(|s| {
                    s.phase = Phase::Failed;
                    s.reason = Some(e.reason().into());
                    s.message = Some(message.clone());
                    s.connected_since_ms = None;
                });
                return SessionEnd::Failed(message);
            }
            Err(e) => (e.kind(), e.reason(), e.message()),
        };
        deps.metrics
            .session_errors
            .get_or_create(&[("kind", kind)])
            .inc();
        deps.metrics.reconnects.inc();
        let delay = RECONNECT_BACKOFF.delay(attempt);
        attempt = attempt.saturating_add(1);
        tracing::warn!(stream = %cfg.key, kind, %message, retry_in = ?delay, "session ended; reconnecting");
        progress.update_status(|s| {
            s.phase = Phase::Backoff;
            s.reason = Some(reason.into());
            s.message = Some(message.clone());
            s.connected_since_ms = None;
            s.reconnects += 1;
        });
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = ctl.abort.cancelled() => return SessionEnd::Aborted,
            _ = ctl.stop.cancelled() => return SessionEnd::Stopped,
            _ = deps.fence.closed() => return SessionEnd::Fenced,
        }
    }
}

/// Refuses a sink the policy forbids, before anything is read for it: an
/// HTTP or NATS server outside the sink host policy, a Kinesis stream outside
/// `--kinesis-streams`. Only permanent refusals count: a name that does not
/// resolve yet is the delivery path's to retry (the HTTP client's resolver
/// applies the same policy).
async fn sink_allowed(
    spec: &StreamConnectionSpec,
    namespace: &str,
    deps: &SessionDeps,
) -> Result<(), String> {
    if let Some(kinesis) = &spec.sink.kinesis
        && !deps.kinesis_streams.allows(namespace, &kinesis.stream_name)
    {
        return Err(format!(
            "sink kinesis stream '{}' is not in --kinesis-streams for namespace {namespace}",
            kinesis.stream_name
        ));
    }
    let Some(url) = spec.sink.http.as_ref().map(|h| &h.url).or(spec
        .sink
        .nats
        .as_ref()
        .map(|n| &n.url))
    else {
        return Ok(());
    };
    let parsed = url::Url::parse(url).map_err(|e| format!("sink URL: {e}"))?;
    match deps.sink_policy.resolve(&parsed).await {
        Err(e) if e.is_permanent() => Err(format!("sink {url}: {e}")),
        _ => Ok(()),
    }
}

/// Reads messages and delivers them until the session ends.
async fn pump(
    mut ws: Ws,
    cfg: &SessionConfig,
    progress: &StreamProgress,
    deps: &SessionDeps,
    sink: &Sink,
    ctl: &SessionControl,
    checkpoint: Option<u64>,
) -> PumpEnd {
    let delivery = Delivery {
        connection: &cfg.connection,
        worker: &cfg.worker,
        token: cfg.token,
        sink,
        fence: &deps.fence,
        progress,
        metrics: &deps.metrics,
        abort: &ctl.abort,
    };
    for text in &cfg.spec.subscribe {
        if let Err(e) = ws.send(WsMessage::Text(text.clone().into())).await {
            return PumpEnd::Disconnected {
                kind: "subscribe",
                message: format!("sending subscribe message failed: {e}"),
            };
        }
    }
    let pointer = cfg.spec.sequence.as_ref().map(|s| s.pointer.as_str());
    let max_batch = sink.max_batch();
    let linger = sink.linger();
    let ping_every = Duration::from_secs(cfg.spec.keepalive.interval_seconds.into());
    let pong_timeout = Duration::from_secs(cfg.spec.keepalive.timeout_seconds.into());
    let mut ping_timer = tokio::time::interval_at(Instant::now() + ping_every, ping_every);
    let mut last_heard = Instant::now();
    let mut high_water = checkpoint;
    let mut batch: Vec<Message> = Vec::new();
    let mut flush_at: Option<Instant> = None;

    loop {
        let linger_elapsed = async {
            match flush_at {
                Some(at) => sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let mut flush_now = false;
        let mut ended: Option<PumpEnd> = None;
        tokio::select! {
            biased;
            _ = ctl.abort.cancelled() => {
                Box::pin(close(&mut ws, CloseCode::Away)).await;
                return PumpEnd::Ended(SessionEnd::Aborted);
            }
            _ = deps.fence.closed() => {
                // Nothing more may be delivered: drop the batch (it will be
                // replayed from the checkpoint) and close at once.
                Box::pin(close(&mut ws, CloseCode::Away)).await;
                return PumpEnd::Ended(SessionEnd::Fenced);
            }
            _ = ctl.stop.cancelled() => {
                let flushed = Box::pin(delivery.deliver(&mut batch)).await;
                let code = if flushed.is_ok() { CloseCode::Normal } else { CloseCode::Away };
                Box::pin(close(&mut ws, code)).await;
                return PumpEnd::Ended(flushed.map_or_else(SessionEnd::from, |()| SessionEnd::Stopped));
            }
            _ = linger_elapsed => flush_now = true,
            _ = ping_timer.tick() => {
                if last_heard.elapsed() > ping_every + pong_timeout {
                    ended = Some(PumpEnd::Disconnected {
                        kind: "keepalive",
                        message: format!("no pong within {pong_timeout:?}"),
                    });
                } else if let Err(e) = ws.send(WsMessage::Ping(Vec::new().into())).await {
                    ended = Some(PumpEnd::Disconnected { kind: "io", message: e.to_string() });
                }
            }
            frame = ws.next() => {
                last_heard = Instant::now();
                match frame {
                    Some(Ok(WsMessage::Text(text))) => {
                        deps.metrics.messages_received.inc();
                        deps.metrics.bytes_received.inc_by(text.len() as u64);
                        match sequence_of(&text, pointer, &mut high_water) {
                            Ok(Some(seq)) => batch.push(Message { seq, data: text.to_string() }),
                            Ok(None) => {} // a replay of something already acknowledged
                            Err(why) => {
                                deps.metrics.session_errors.get_or_create(&[("kind", "sequence")]).inc();
                                tracing::warn!(stream = %cfg.key, %why, "message without a usable sequence number skipped");
                            }
                        }
                    }
                    Some(Ok(WsMessage::Binary(bytes))) => {
                        deps.metrics.messages_received.inc();
                        deps.metrics.bytes_received.inc_by(bytes.len() as u64);
                        if pointer.is_some() {
                            deps.metrics.session_errors.get_or_create(&[("kind", "sequence")]).inc();
                            tracing::warn!(stream = %cfg.key, "binary message cannot carry a JSON sequence number; skipped");
                        } else {
                            let seq = next_counter(&mut high_water);
                            let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
                            batch.push(Message { seq, data });
                        }
                    }
                    Some(Ok(WsMessage::Close(frame))) => {
                        let why = frame.map(|f| format!("{} {}", u16::from(f.code), f.reason)).unwrap_or_default();
                        ended = Some(PumpEnd::Disconnected { kind: "closed", message: format!("upstream closed the session {why}").trim().to_string() });
                    }
                    Some(Ok(_)) => {} // ping (answered by tungstenite), pong, raw frame
                    Some(Err(e)) => {
                        let kind = match &e {
                            tungstenite::Error::Capacity(_) => "too_large",
                            tungstenite::Error::Protocol(_) | tungstenite::Error::Utf8(_) => "malformed",
                            _ => "io",
                        };
                        ended = Some(PumpEnd::Disconnected { kind, message: e.to_string() });
                    }
                    None => ended = Some(PumpEnd::Disconnected { kind: "closed", message: "connection closed".into() }),
                }
                if batch.len() >= max_batch || (!batch.is_empty() && linger.is_zero()) {
                    flush_now = true;
                } else if !batch.is_empty() && flush_at.is_none() {
                    flush_at = Some(Instant::now() + linger);
                }
            }
        }
        // Deliver what was read before reacting to a disconnect: it is already
        // in hand, and delivering it saves a replay.
        if (flush_now || ended.is_some()) && !batch.is_empty() {
            if let Err(u) = Box::pin(delivery.deliver(&mut batch)).await {
                Box::pin(close(&mut ws, CloseCode::Away)).await;
                return PumpEnd::Ended(u.into());
            }
            flush_at = None;
            // We did not read while delivering; do not mistake that for a dead peer.
            last_heard = Instant::now();
        }
        if let Some(end) = ended {
            Box::pin(close(&mut ws, CloseCode::Away)).await;
            return end;
        }
    }
}

async fn close(ws: &mut Ws, code: CloseCode) {
    let frame = CloseFrame {
        code,
        reason: "".into(),
    };
    let _ = timeout(CLOSE_TIMEOUT, ws.close(Some(frame))).await;
}

/// The next counter value: 0 with no checkpoint, else one past it.
fn next_counter(high_water: &mut Option<u64>) -> u64 {
    let next = high_water.map_or(0, |h| h + 1);
    *high_water = Some(next);
    next
}

/// The sequence number of a message: from the JSON pointer, or the next
/// counter value. `Ok(None)` for a replay at or below what was already taken;
/// with no checkpoint, every sequence number (0 included) is new.
pub fn sequence_of(
    text: &str,
    pointer: Option<&str>,
    high_water: &mut Option<u64>,
) -> Result<Option<u64>, String> {
    let Some(pointer) = pointer else {
        return Ok(Some(next_counter(high_water)));
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let seq = value
        .pointer(pointer)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("no unsigned integer at {pointer}"))?;
    if high_water.is_some_and(|h| seq <= h) {
        return Ok(None);
    }
    *high_water = Some(seq);
    Ok(Some(seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_sequences_start_at_zero_and_continue_from_a_checkpoint() {
        let mut none = None;
        assert_eq!(sequence_of("x", None, &mut none), Ok(Some(0)));
        assert_eq!(sequence_of("y", None, &mut none), Ok(Some(1)));
        let mut hw = Some(41);
        assert_eq!(sequence_of("x", None, &mut hw), Ok(Some(42)));
    }

    #[test]
    fn a_zero_based_feed_delivers_sequence_zero_without_a_checkpoint() {
        let mut hw = None;
        assert_eq!(
            sequence_of(r#"{"seq":0}"#, Some("/seq"), &mut hw),
            Ok(Some(0))
        );
        assert_eq!(sequence_of(r#"{"seq":0}"#, Some("/seq"), &mut hw), Ok(None));
        let mut zero = Some(0);
        assert_eq!(
            sequence_of(r#"{"seq":0}"#, Some("/seq"), &mut zero),
            Ok(None),
            "checkpoint 0 means 0 was delivered"
        );
    }

    #[test]
    fn pointer_sequences_skip_replays_and_reject_messages_without_one() {
        let mut hw = Some(10);
        assert_eq!(sequence_of(r#"{"seq":9}"#, Some("/seq"), &mut hw), Ok(None));
        assert_eq!(
            sequence_of(r#"{"seq":11}"#, Some("/seq"), &mut hw),
            Ok(Some(11))
        );
        assert_eq!(
            sequence_of(r#"{"m":{"n":12}}"#, Some("/m/n"), &mut hw),
            Ok(Some(12))
        );
        assert!(sequence_of(r#"{"seq":"13"}"#, Some("/seq"), &mut hw).is_err());
        assert!(sequence_of("not json", Some("/seq"), &mut hw).is_err());
        assert_eq!(hw, Some(12));
    }
}

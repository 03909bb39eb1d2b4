//! One upstream WebSocket session: connect, subscribe, read, batch, deliver,
//! keep alive, and reconnect with jittered backoff, until stopped, aborted,
//! fenced, or refused for good.
//!
//! Delivery is in line with reading: while a batch is delivered (or retried
//! against a failing sink) nothing more is read from the socket, which is the
//! backpressure the stream contract asks for.

use super::delivery::{Delivery, Undelivered};
use super::progress::StreamProgress;
use super::provenance::{Origin, Provenance, Unverified};
use super::sequence::{SequencePointer, Unsequenced, next_counter, sequence_of};
use super::socket::Ws;
use super::transport::{CONNECT_TIMEOUT, ConnectError, Dialer, resume_url};
use crate::crd::{DataFormat, StreamConnectionSpec};
use crate::egress::HostPolicy;
use crate::egress::KinesisStreams;
use crate::lease::{Phase, StreamKey, now_ms};
use crate::metrics::WorkerMetrics;
use crate::sink::{Pending, Sink, SinkClients};
use crate::support::RetryPolicy;
use crate::worker::fence::Fence;
use base64::Engine;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Bound on a close handshake before the socket is simply dropped.
pub(super) const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Reconnect backoff: first step and cap (full jitter).
pub(super) const RECONNECT_BACKOFF: RetryPolicy = RetryPolicy {
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
    /// The resource the item says it came from (checked in operator mode).
    pub origin: Origin,
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
    /// Which items may be served at all (operator mode: this installation's
    /// resources only).
    pub provenance: Arc<Provenance>,
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
pub(crate) struct WebSocketSessions;

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
// Not an async fn on purpose (an async fn keeps its arguments twice):
// clippy's suggestion would undo it.
#[allow(clippy::manual_async_fn)]
pub(super) fn run(
    cfg: SessionConfig,
    progress: Arc<StreamProgress>,
    deps: Arc<SessionDeps>,
    ctl: SessionControl,
) -> impl Future<Output = SessionEnd> + Send {
    // An `async` block, not an `async fn`, so the arguments are kept once
    // (an async fn keeps them as passed and again as locals).
    async move {
        // Held until the future is dropped, after every socket it opened.
        // An async block captures only the fields it reads; the body happens
        // to pass the whole config to `pump`, but the turn must not depend on
        // that, or a later change could drop it when the future is made and
        // let the stream's next session connect before this one closed.
        let _turn = &cfg.turn;
        // Before anything is dialled or any secret resolved for it.
        if let Some(end) = Box::pin(verified_origin(&cfg, &progress, &deps, &ctl)).await {
            return end;
        }
        // Boxed: a name lookup's state is only needed before the first connect.
        if let Err(message) = Box::pin(sink_allowed(&cfg.spec, &cfg.key.namespace, &deps)).await {
            return refuse(
                &cfg,
                &progress,
                &deps,
                Refusal {
                    kind: "sink_policy",
                    reason: "SinkNotAllowed",
                    what: "sink refused by host policy; not connecting",
                    message,
                },
            );
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
            let checkpoint = progress.checkpoint();
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
            // The socket stays here, and the session's read loop borrows it: moved
            // into the loop it was kept twice for the session's whole life.
            let mut connected = tokio::select! {
                // Boxed: TLS and handshake state is large and only needed while connecting.
                r = timeout(CONNECT_TIMEOUT, Box::pin(deps.dialer.dial(&cfg.key, &cfg.spec, &url).instrument(
                    tracing::info_span!("connect", host = %host, resume_from = checkpoint.map(|c| c as i64).unwrap_or(-1))
                ))) => r.unwrap_or(Err(ConnectError::Timeout)),
                _ = ctl.abort.cancelled() => return SessionEnd::Aborted,
                _ = ctl.stop.cancelled() => return SessionEnd::Stopped,
                _ = deps.fence.closed() => return SessionEnd::Fenced,
            };
            let (kind, reason, message) = match &mut connected {
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
                    return refuse(
                        &cfg,
                        &progress,
                        &deps,
                        Refusal {
                            kind: e.kind(),
                            reason: e.reason(),
                            what: "stream refused by host policy; not dialling",
                            message: e.message(),
                        },
                    );
                }
                Err(e) => (e.kind(), e.reason(), e.message()),
            };
            // Closed before the backoff, as when the read loop owned it.
            drop(connected);
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
}

/// A refusal for good: counted, logged, and the stream's status until its
/// spec changes.
struct Refusal {
    /// The `session_errors` metric's kind.
    kind: &'static str,
    /// The status reason.
    reason: &'static str,
    /// The log line.
    what: &'static str,
    message: String,
}

fn refuse(
    cfg: &SessionConfig,
    progress: &StreamProgress,
    deps: &SessionDeps,
    refusal: Refusal,
) -> SessionEnd {
    let Refusal {
        kind,
        reason,
        what,
        message,
    } = refusal;
    deps.metrics
        .session_errors
        .get_or_create(&[("kind", kind)])
        .inc();
    tracing::warn!(stream = %cfg.key, %message, "{what}");
    progress.update_status(|s| {
        s.phase = Phase::Failed;
        s.reason = Some(reason.into());
        s.message = Some(message.clone());
        s.connected_since_ms = None;
    });
    SessionEnd::Failed(message)
}

/// Waits until the item's origin is verified; `Some` ends the session (the
/// origin is refused for good, or the session was stopped meanwhile).
async fn verified_origin(
    cfg: &SessionConfig,
    progress: &StreamProgress,
    deps: &SessionDeps,
    ctl: &SessionControl,
) -> Option<SessionEnd> {
    let mut attempt = 0u32;
    loop {
        let message = match deps.provenance.check(&cfg.key, &cfg.origin).await {
            Ok(()) => return None,
            Err(Unverified::Refused(message)) => {
                return Some(refuse(
                    cfg,
                    progress,
                    deps,
                    Refusal {
                        kind: "provenance",
                        reason: "UnverifiedOrigin",
                        what: "item not from a resource of this installation; not serving it",
                        message,
                    },
                ));
            }
            Err(Unverified::Unavailable(message)) => message,
        };
        let delay = RECONNECT_BACKOFF.delay(attempt);
        attempt = attempt.saturating_add(1);
        tracing::warn!(stream = %cfg.key, %message, retry_in = ?delay, "cannot verify the stream's resource yet");
        progress.update_status(|s| {
            s.phase = Phase::Backoff;
            s.reason = Some("OriginUnverified".into());
            s.message = Some(message.clone());
        });
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = ctl.abort.cancelled() => return Some(SessionEnd::Aborted),
            _ = ctl.stop.cancelled() => return Some(SessionEnd::Stopped),
            _ = deps.fence.closed() => return Some(SessionEnd::Fenced),
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
    ws: &mut Ws,
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
    let ping_every = Duration::from_secs(cfg.spec.keepalive.interval_seconds.into());
    let pong_timeout = Duration::from_secs(cfg.spec.keepalive.timeout_seconds.into());
    // The session's waits are made once and polled again on every turn of
    // the loop: made anew per message, each re-registered with its token,
    // watch channel or timer, which cost more than reading the message.
    let aborted = ctl.abort.cancelled();
    let fenced = deps.fence.closed();
    let stopped = ctl.stop.cancelled();
    tokio::pin!(aborted, fenced, stopped);
    // Bounded like the keepalive ping, and raced against the session's ends:
    // an upstream that reads nothing would otherwise hold the write, and the
    // session with it, for good.
    let subscribed = tokio::select! {
        biased;
        _ = &mut aborted => {
            Box::pin(close(ws, CloseCode::Away)).await;
            return PumpEnd::Ended(SessionEnd::Aborted);
        }
        _ = &mut fenced => return PumpEnd::Ended(SessionEnd::Fenced),
        _ = &mut stopped => {
            // Nothing was read yet, so nothing is left to deliver.
            Box::pin(close(ws, CloseCode::Normal)).await;
            return PumpEnd::Ended(SessionEnd::Stopped);
        }
        sent = timeout(pong_timeout, subscribe(ws, &cfg.spec.subscribe)) => sent,
    };
    match subscribed {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return PumpEnd::Disconnected {
                kind: "subscribe",
                message: format!("sending subscribe message failed: {e}"),
            };
        }
        Err(_) => {
            return PumpEnd::Disconnected {
                kind: "subscribe",
                message: format!("the upstream took no subscribe message within {pong_timeout:?}"),
            };
        }
    }
    let pointer = cfg
        .spec
        .sequence
        .as_ref()
        .map(|s| SequencePointer::new(&s.pointer));
    let max_batch = sink.max_batch();
    let linger = sink.linger();
    let mut ping_timer = tokio::time::interval_at(Instant::now() + ping_every, ping_every);
    let mut last_heard = Instant::now();
    let mut intake = Intake {
        key: &cfg.key,
        pointer: pointer.as_ref(),
        json_only: sink.data_format() == DataFormat::Json,
        high_water: checkpoint,
        batch: delivery.new_batch(),
        received: 0,
        bytes: 0,
    };
    let linger_timer = tokio::time::sleep_until(Instant::now());
    tokio::pin!(linger_timer);
    let mut lingering = false;

    loop {
        let mut flush_now = false;
        let mut ended: Option<PumpEnd> = None;
        tokio::select! {
            biased;
            _ = &mut aborted => {
                Box::pin(close(ws, CloseCode::Away)).await;
                return PumpEnd::Ended(SessionEnd::Aborted);
            }
            _ = &mut fenced => {
                // Nothing more may be delivered: drop the batch (it will be
                // replayed from the checkpoint) and close at once, without
                // waiting for a close handshake: the fence margin is for the
                // socket to be gone, not for the upstream to answer.
                return PumpEnd::Ended(SessionEnd::Fenced);
            }
            _ = &mut stopped => {
                let flushed = Box::pin(delivery.deliver(&mut intake.batch)).await;
                let code = if flushed.is_ok() { CloseCode::Normal } else { CloseCode::Away };
                Box::pin(close(ws, code)).await;
                return PumpEnd::Ended(flushed.map_or_else(SessionEnd::from, |()| SessionEnd::Stopped));
            }
            _ = &mut linger_timer, if lingering => flush_now = true,
            _ = ping_timer.tick() => {
                if last_heard.elapsed() > ping_every + pong_timeout {
                    ended = Some(PumpEnd::Disconnected {
                        kind: "keepalive",
                        message: format!("no pong within {pong_timeout:?}"),
                    });
                } else {
                    // Bounded: an upstream that reads nothing (its socket full of
                    // our answers to its pings) would hold the write, and with
                    // it the session, for good.
                    match timeout(pong_timeout, ws.send(WsMessage::Ping(Vec::new().into()))).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => ended = Some(PumpEnd::Disconnected { kind: "io", message: e.to_string() }),
                        Err(_) => ended = Some(PumpEnd::Disconnected {
                            kind: "keepalive",
                            message: format!("the upstream took no ping within {pong_timeout:?}"),
                        }),
                    }
                }
            }
            end = std::future::poll_fn(|cx| intake.drain(ws, cx, max_batch, &deps.metrics)) => {
                last_heard = Instant::now();
                ended = end;
                intake.count(&deps.metrics);
                let batched = intake.batch.len();
                if batched >= max_batch || (batched > 0 && linger.is_zero()) {
                    flush_now = true;
                } else if batched > 0 && !lingering {
                    linger_timer.as_mut().reset(Instant::now() + linger);
                    lingering = true;
                }
            }
        }
        // Deliver what was read before reacting to a disconnect: it is already
        // in hand, and delivering it saves a replay.
        if (flush_now || ended.is_some()) && !intake.batch.is_empty() {
            // A full batch says more is waiting: its buffers are kept for the
            // next (an HTTP body sent goes with its request; the next is
            // reserved at its size). A partial one (the linger ran out) lets
            // them go, so an idle session holds none.
            let busy = intake.batch.len() >= max_batch;
            if let Err(u) = Box::pin(delivery.deliver(&mut intake.batch)).await {
                // Fenced: the socket goes at once (see above).
                if !matches!(u, Undelivered::Fenced) {
                    Box::pin(close(ws, CloseCode::Away)).await;
                }
                return PumpEnd::Ended(u.into());
            }
            lingering = false;
            if !busy {
                intake.batch.release();
            }
            // We did not read while delivering; do not mistake that for a dead peer.
            last_heard = Instant::now();
        }
        if let Some(end) = ended {
            Box::pin(close(ws, CloseCode::Away)).await;
            return end;
        }
    }
}

/// What a session has read and not yet delivered, and how it numbers it.
struct Intake<'a> {
    key: &'a StreamKey,
    pointer: Option<&'a SequencePointer>,
    /// The sink carries messages as JSON values: a message that is not JSON
    /// every parser takes is skipped (`sequence_of` checks).
    json_only: bool,
    high_water: Option<u64>,
    /// Read and not yet delivered (each text copied out of its frame, or
    /// for the HTTP sink written into the body as its entry).
    batch: Pending,
    /// Messages and bytes read since the counters were last advanced.
    received: u64,
    bytes: u64,
}

impl Intake<'_> {
    /// Takes every frame that has already arrived, up to a batch, in one
    /// turn of the session's loop: ready once at least one was taken (`Some`
    /// when the session is over), pending while none has arrived. The
    /// socket is polled with the loop's own waker every time: polled with
    /// another (a no-op waker, as `now_or_never` does), each poll swapped
    /// the waker registered with the socket and swapped it back on the next
    /// turn, about 5% of a saturated worker's CPU.
    fn drain(
        &mut self,
        ws: &mut Ws,
        cx: &mut std::task::Context<'_>,
        max_batch: usize,
        metrics: &WorkerMetrics,
    ) -> std::task::Poll<Option<PumpEnd>> {
        let mut taken = 0;
        loop {
            let std::task::Poll::Ready(frame) = ws.poll_next(cx) else {
                return if taken == 0 {
                    std::task::Poll::Pending
                } else {
                    std::task::Poll::Ready(None)
                };
            };
            taken += 1;
            if let Some(end) = self.take(frame, metrics) {
                return std::task::Poll::Ready(Some(end));
            }
            if self.batch.len() >= max_batch || taken > max_batch {
                return std::task::Poll::Ready(None);
            }
        }
    }

    /// Takes one frame into the batch; `Some` when the session is over.
    fn take(
        &mut self,
        frame: Option<Result<WsMessage, tungstenite::Error>>,
        metrics: &WorkerMetrics,
    ) -> Option<PumpEnd> {
        match frame {
            Some(Ok(WsMessage::Text(text))) => {
                self.received += 1;
                self.bytes += text.len() as u64;
                match sequence_of(&text, self.pointer, &mut self.high_water, self.json_only) {
                    Ok(Some(seq)) => self.batch.push(seq, &text),
                    Ok(None) => {} // a replay of something already acknowledged
                    Err(Unsequenced::NotEmbeddable(seq)) => self.not_json(seq, metrics),
                    Err(Unsequenced::Unusable(why)) => {
                        metrics
                            .session_errors
                            .get_or_create(&[("kind", "sequence")])
                            .inc();
                        tracing::warn!(stream = %self.key, %why, "message without a usable sequence number skipped");
                    }
                }
                None
            }
            Some(Ok(WsMessage::Binary(bytes))) => {
                self.received += 1;
                self.bytes += bytes.len() as u64;
                if self.json_only && self.pointer.is_none() {
                    let seq = next_counter(&mut self.high_water);
                    self.not_json(Some(seq), metrics);
                } else if self.pointer.is_some() {
                    metrics
                        .session_errors
                        .get_or_create(&[("kind", "sequence")])
                        .inc();
                    tracing::warn!(stream = %self.key, "binary message cannot carry a JSON sequence number; skipped");
                } else {
                    let seq = next_counter(&mut self.high_water);
                    let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
                    self.batch.push(seq, &data);
                }
                None
            }
            Some(Ok(WsMessage::Close(frame))) => {
                let why = frame
                    .map(|f| format!("{} {}", u16::from(f.code), f.reason))
                    .unwrap_or_default();
                Some(PumpEnd::Disconnected {
                    kind: "closed",
                    message: format!("upstream closed the session {why}")
                        .trim()
                        .to_string(),
                })
            }
            Some(Ok(_)) => None, // ping (answered by tungstenite), pong, raw frame
            Some(Err(tungstenite::Error::Protocol(
                tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
            ))) => Some(PumpEnd::Disconnected {
                // Nothing it sent was wrong: not `malformed`.
                kind: "dropped",
                message: "the upstream ended the connection without a close frame".into(),
            }),
            Some(Err(e)) => {
                let kind = match &e {
                    tungstenite::Error::Capacity(_) => "too_large",
                    tungstenite::Error::Protocol(_) | tungstenite::Error::Utf8(_) => "malformed",
                    _ => "io",
                };
                Some(PumpEnd::Disconnected {
                    kind,
                    message: e.to_string(),
                })
            }
            None => Some(PumpEnd::Disconnected {
                kind: "closed",
                message: "connection closed".into(),
            }),
        }
    }

    /// A message the sink cannot take as JSON: skipped, counted and logged.
    fn not_json(&self, seq: Option<u64>, metrics: &WorkerMetrics) {
        metrics
            .session_errors
            .get_or_create(&[("kind", "not_json")])
            .inc();
        tracing::warn!(stream = %self.key, ?seq, "message is not JSON and the sink takes messages as JSON (dataFormat: json); skipped");
    }

    /// Advances the worker's received counters by what was read since last time.
    fn count(&mut self, metrics: &WorkerMetrics) {
        metrics.messages_received.inc_by(self.received);
        metrics.bytes_received.inc_by(self.bytes);
        (self.received, self.bytes) = (0, 0);
    }
}

/// Sends the spec's subscribe messages, in order.
async fn subscribe(ws: &mut Ws, messages: &[String]) -> Result<(), tungstenite::Error> {
    for text in messages {
        ws.send(WsMessage::Text(text.clone().into())).await?;
    }
    Ok(())
}

async fn close(ws: &mut Ws, code: CloseCode) {
    let frame = CloseFrame {
        code,
        reason: "".into(),
    };
    let _ = timeout(CLOSE_TIMEOUT, ws.close(frame)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secrets::SecretSource;
    use crate::worker::stream::ConnectLimiter;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tokio::sync::Semaphore;

    fn deps() -> Arc<SessionDeps> {
        crate::install_crypto_provider();
        let policy = HostPolicy::new(["*"]);
        Arc::new(SessionDeps {
            dialer: Dialer {
                policy: policy.clone(),
                tls: crate::worker::stream::tls_config(None).unwrap(),
                secrets: SecretSource::Standalone,
                connect_limit: ConnectLimiter::new(0.0, 0),
            },
            sinks: Arc::new(SinkClients::new(
                reqwest::Client::new(),
                SecretSource::Standalone,
                "test".into(),
                policy.clone(),
            )),
            sink_policy: policy,
            kinesis_streams: KinesisStreams::new(["*"]),
            metrics: Arc::new(WorkerMetrics::default()),
            provenance: Arc::new(Provenance::AnyItem),
            fence: Arc::new(Fence::new(
                Duration::from_secs(10),
                crate::worker::fence::Sent::now(),
            )),
        })
    }

    /// Stream `ns/s`'s first session (token 1) with `spec`, holding a turn of `slot`.
    fn config(spec: serde_json::Value, slot: Arc<Semaphore>) -> SessionConfig {
        let spec: StreamConnectionSpec = serde_json::from_value(spec).unwrap();
        SessionConfig {
            key: StreamKey::new("ns", "s"),
            connection: "ns/s".into(),
            worker: "w".into(),
            token: 1,
            spec: Arc::new(spec),
            origin: Origin::default(),
            turn: slot.try_acquire_owned().unwrap(),
        }
    }

    /// The turn is what makes a stream's next session wait until this one's
    /// socket is closed (an aborted task is dropped later, when the runtime
    /// gets to it). It only works if the session's future owns it from the
    /// moment it is made until it is dropped.
    #[tokio::test]
    async fn a_session_keeps_its_streams_turn_until_it_is_dropped() {
        let slot = Arc::new(Semaphore::new(1));
        let cfg = config(
            serde_json::json!({"url": "ws://127.0.0.1:9/s", "sink": {"log": {}}}),
            slot.clone(),
        );
        let progress = Arc::new(StreamProgress::new(None, None));
        let session = run(cfg, progress, deps(), SessionControl::default());
        assert_eq!(
            slot.available_permits(),
            0,
            "the session's future gave its turn back before it ran"
        );
        drop(session);
        assert_eq!(slot.available_permits(), 1, "dropped: the turn is free");
    }

    /// An upstream on a loopback socket that does `after_handshake` with
    /// each connection it accepts: its URL, and how many it accepted.
    async fn upstream<F, Fut>(after_handshake: F) -> (String, Arc<AtomicUsize>)
    where
        F: Fn(tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>) -> Fut
            + Send
            + Sync
            + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}/s", listener.local_addr().unwrap());
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        let after_handshake = Arc::new(after_handshake);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, SeqCst);
                let after_handshake = after_handshake.clone();
                tokio::spawn(async move {
                    if let Ok(ws) = tokio_tungstenite::accept_async(socket).await {
                        after_handshake(ws).await;
                    }
                });
            }
        });
        (url, connections)
    }

    /// Runs stream `ns/s` with `spec` until `done` holds of the session's
    /// metrics and connections (at most 20 s), then aborts it.
    async fn run_until(
        spec: serde_json::Value,
        connections: &AtomicUsize,
        done: impl Fn(&WorkerMetrics, usize) -> bool,
    ) -> Arc<SessionDeps> {
        let deps = deps();
        let cfg = config(spec, Arc::new(Semaphore::new(1)));
        let progress = Arc::new(StreamProgress::new(None, None));
        let session = tokio::spawn(run(cfg, progress, deps.clone(), SessionControl::default()));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(&deps.metrics, connections.load(SeqCst)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        session.abort();
        deps
    }

    fn errors(metrics: &WorkerMetrics, kind: &'static str) -> u64 {
        metrics
            .session_errors
            .get_or_create(&[("kind", kind)])
            .get()
    }

    /// An upstream that floods pings and reads nothing fills the socket with
    /// their answers; the keepalive ping then cannot be written. The session
    /// gives up within the pong timeout and dials again, rather than waiting
    /// on the write for good (and reading nothing meanwhile).
    #[tokio::test]
    async fn a_keepalive_ping_the_upstream_does_not_take_ends_the_session() {
        use futures::SinkExt;
        let (url, connections) = upstream(|mut ws| async move {
            // Pings with the largest payload a control frame may carry, as
            // fast as the socket takes them; nothing is ever read.
            while ws
                .send(WsMessage::Ping(vec![7u8; 125].into()))
                .await
                .is_ok()
            {}
        })
        .await;
        let spec = serde_json::json!({
            "url": url,
            "sink": {"log": {}},
            "keepalive": {"intervalSeconds": 1, "timeoutSeconds": 1},
        });
        run_until(spec, &connections, |_, dialled| dialled >= 2).await;
        assert!(
            connections.load(SeqCst) >= 2,
            "the session never gave up on a ping the upstream would not take"
        );
    }

    /// An upstream that holds each connection open and reads nothing after
    /// the handshake.
    async fn deaf_upstream() -> (String, Arc<AtomicUsize>) {
        upstream(|ws| async move {
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(ws);
        })
        .await
    }

    /// A spec for `url` whose subscribe message is larger than the socket's
    /// buffers, with the keepalive's interval and timeout in seconds.
    fn subscribing(url: &str, interval: u32, timeout: u32) -> serde_json::Value {
        serde_json::json!({
            "url": url,
            "sink": {"log": {}},
            "subscribe": ["x".repeat(32 << 20)],
            "keepalive": {"intervalSeconds": interval, "timeoutSeconds": timeout},
        })
    }

    /// Subscribe messages larger than the socket's buffers, to an upstream
    /// that reads nothing after the handshake: the session gives up within
    /// the keepalive timeout (counted as `subscribe`) and dials again, rather
    /// than waiting on the write for good.
    #[tokio::test]
    async fn subscribe_messages_the_upstream_does_not_take_end_the_session() {
        let (url, connections) = deaf_upstream().await;
        let spec = subscribing(&url, 1, 1);
        let deps = run_until(spec, &connections, |m, dialled| {
            dialled >= 2 && errors(m, "subscribe") >= 1
        })
        .await;
        assert!(
            connections.load(SeqCst) >= 2,
            "the session never gave up on subscribe messages the upstream would not take"
        );
        assert!(errors(&deps.metrics, "subscribe") >= 1);
    }

    /// A stop asked for while subscribe messages wait on an upstream that
    /// reads nothing ends the session at once, not after the keepalive
    /// timeout.
    #[tokio::test]
    async fn a_stop_while_subscribing_ends_the_session_at_once() {
        let (url, connections) = deaf_upstream().await;
        let cfg = config(subscribing(&url, 60, 600), Arc::new(Semaphore::new(1)));
        let progress = Arc::new(StreamProgress::new(None, None));
        let ctl = SessionControl::default();
        let session = tokio::spawn(run(cfg, progress, deps(), ctl.clone()));
        while connections.load(SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Long enough for the subscribe message to fill the socket.
        tokio::time::sleep(Duration::from_millis(500)).await;
        ctl.stop.cancel();
        let end = timeout(Duration::from_secs(5), session).await;
        assert_eq!(
            end.expect("still subscribing 5 s after the stop").unwrap(),
            SessionEnd::Stopped
        );
    }

    /// An upstream that ends the TCP connection without a close frame is
    /// counted as `dropped`, not as a malformed stream: nothing it sent was
    /// wrong, and operators look for different causes.
    #[tokio::test]
    async fn a_connection_ended_without_a_close_frame_is_counted_as_dropped() {
        let (url, connections) = upstream(|ws| async move {
            // The TCP connection closes with no close frame sent.
            drop(ws.into_inner());
        })
        .await;
        let spec = serde_json::json!({"url": url, "sink": {"log": {}}});
        let deps = run_until(spec, &connections, |m, _| errors(m, "dropped") >= 1).await;
        assert!(
            errors(&deps.metrics, "dropped") >= 1,
            "dropped {}, malformed {}, io {}",
            errors(&deps.metrics, "dropped"),
            errors(&deps.metrics, "malformed"),
            errors(&deps.metrics, "io")
        );
        assert_eq!(errors(&deps.metrics, "malformed"), 0);
    }

    /// A sink that takes messages as JSON values is given only JSON. With a
    /// counter (no pointer), text that is not JSON and binary messages are
    /// skipped and counted, each using up its number so the count still
    /// follows the upstream's messages; with the default format all go.
    #[test]
    fn a_json_sink_is_given_only_json_and_a_skipped_message_keeps_its_number() {
        let key = StreamKey::new("ns", "s");
        let metrics = WorkerMetrics::default();
        let frames = || {
            [
                WsMessage::Text(r#"{"a":1}"#.into()),
                WsMessage::Text("not json".into()),
                WsMessage::Text(r#"{"a":"#.into()),
                WsMessage::Binary(vec![1u8, 2].into()),
                // Grammatical, but no parser builds it: a lone surrogate.
                WsMessage::Text(r#"{"x":"\ud800"}"#.into()),
                WsMessage::Text(" [1, \"x\"] ".into()),
            ]
        };
        for json_only in [true, false] {
            let mut intake = Intake {
                key: &key,
                pointer: None,
                json_only,
                high_water: Some(9),
                batch: Pending::default(),
                received: 0,
                bytes: 0,
            };
            for frame in frames() {
                assert!(intake.take(Some(Ok(frame)), &metrics).is_none());
            }
            let taken: Vec<(u64, String)> = intake
                .batch
                .iter()
                .map(|m| (m.seq, m.data.to_string()))
                .collect();
            if json_only {
                assert_eq!(
                    taken,
                    vec![(10, r#"{"a":1}"#.into()), (15, " [1, \"x\"] ".into())]
                );
            } else {
                assert_eq!(taken.len(), 6, "{taken:?}");
            }
        }
        let skipped = || {
            metrics
                .session_errors
                .get_or_create(&[("kind", "not_json")])
                .get()
        };
        assert_eq!(skipped(), 4);
        // With a pointer too: the sequence number is found, the message is
        // still not one to embed.
        let pointer = SequencePointer::new("/seq");
        let mut intake = Intake {
            key: &key,
            pointer: Some(&pointer),
            json_only: true,
            high_water: None,
            batch: Pending::default(),
            received: 0,
            bytes: 0,
        };
        for text in [
            r#"{"seq":1,"x":"\ud800"}"#,
            r#"{"seq":2,"x":1e400}"#,
            r#"{"seq":3}"#,
        ] {
            assert!(
                intake
                    .take(Some(Ok(WsMessage::Text(text.into()))), &metrics)
                    .is_none()
            );
        }
        let seqs: Vec<u64> = intake.batch.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, vec![3]);
        assert_eq!(skipped(), 6);
    }
}

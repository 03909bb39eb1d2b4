//! One upstream WebSocket session: connect (policy-checked), subscribe, read,
//! batch, deliver to the sink, keepalive, and reconnect with jittered backoff.
//!
//! Delivery is in-line with reading: while a batch is being delivered (or
//! retried against a failing sink) nothing more is read from the socket, which
//! is the backpressure the stream contract asks for. Before every delivery the
//! session checks its lease's fence (DESIGN.md property 1b).

use super::fence::Fence;
use super::policy::{HostPolicy, PolicyError};
use super::secrets::SecretSource;
use super::transport::Transport;
use crate::crd::StreamConnectionSpec;
use crate::lease::RetryPolicy;
use crate::lease::{SessionStatus, StreamKey, now_ms};
use crate::metrics::WorkerMetrics;
use crate::sink::{Batch, Message, Sink, SinkError};
use base64::Engine;
use futures::{SinkExt, StreamExt};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};
use tokio_util::sync::CancellationToken;
use url::Url;

/// Read buffer per session. tungstenite's default (128 KiB) dominates an idle
/// session's memory; 4 KiB costs a few more reads for large messages only.
pub const READ_BUFFER_BYTES: usize = 4 * 1024;
/// Bound on TCP connect + TLS + WebSocket handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on a close handshake before the socket is simply dropped.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Reconnect backoff: first step and cap (full jitter).
pub const RECONNECT_BACKOFF: RetryPolicy = RetryPolicy {
    first_delay: Duration::from_millis(250),
    max_delay: Duration::from_secs(30),
    deadline: Duration::MAX,
};
/// Sink retry backoff: first step and cap (full jitter).
pub const SINK_BACKOFF: RetryPolicy = RetryPolicy {
    first_delay: Duration::from_millis(100),
    max_delay: Duration::from_secs(5),
    deadline: Duration::MAX,
};
/// A session that lasted this long resets the reconnect backoff.
const STABLE_SESSION: Duration = Duration::from_secs(30);

type Ws = WebSocketStream<Transport>;

/// State shared between a session and the task that holds its lease.
#[derive(Debug)]
pub struct SessionShared {
    pub fence: Fence,
    /// Highest sequence number the sink acknowledged: the checkpoint.
    acked: AtomicU64,
    status: Mutex<SessionStatus>,
    status_dirty: AtomicBool,
    /// Signalled when the phase changes, so the holder writes it early.
    phase_changed: tokio::sync::Notify,
}

impl SessionShared {
    pub fn new(fence: Fence, checkpoint: u64) -> Self {
        Self {
            fence,
            acked: AtomicU64::new(checkpoint),
            status: Mutex::new(SessionStatus {
                phase: "Pending".into(),
                ..SessionStatus::default()
            }),
            status_dirty: AtomicBool::new(true),
            phase_changed: tokio::sync::Notify::new(),
        }
    }

    /// Resolves after the next phase change (or at once if one is pending).
    pub async fn phase_changed(&self) {
        self.phase_changed.notified().await;
    }

    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::SeqCst)
    }

    fn ack(&self, seq: u64) {
        self.acked.fetch_max(seq, Ordering::SeqCst);
    }

    fn lock_status(&self) -> std::sync::MutexGuard<'_, SessionStatus> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the status; the next renewal writes it.
    pub fn update_status(&self, change: impl FnOnce(&mut SessionStatus)) {
        let mut status = self.lock_status();
        let before = status.clone();
        change(&mut status);
        if *status != before {
            self.status_dirty.store(true, Ordering::SeqCst);
        }
        if status.phase != before.phase {
            self.phase_changed.notify_one();
        }
    }

    /// The status, if it changed since the last call (which marks it written).
    pub fn take_status(&self) -> Option<SessionStatus> {
        self.status_dirty
            .swap(false, Ordering::SeqCst)
            .then(|| self.lock_status().clone())
    }

    /// Marks the status as not yet written (after a failed renewal).
    pub fn status_unwritten(&self) {
        self.status_dirty.store(true, Ordering::SeqCst);
    }

    pub fn status(&self) -> SessionStatus {
        self.lock_status().clone()
    }
}

/// What a session needs from its stream.
pub struct SessionConfig {
    pub key: StreamKey,
    pub connection: String,
    pub worker_id: Arc<str>,
    /// The lease's fencing token, sent with every sink payload.
    pub token: u64,
    pub url_template: String,
    pub spec: StreamConnectionSpec,
}

/// What a session needs from its worker.
#[derive(Clone)]
pub struct SessionDeps {
    pub policy: HostPolicy,
    pub tls: Arc<rustls::ClientConfig>,
    pub http: reqwest::Client,
    pub metrics: Arc<WorkerMetrics>,
    pub secrets: SecretSource,
}

/// How a session ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// Asked to stop: the batch was flushed and a normal close frame sent.
    Stopped,
    /// Asked to abort: closed at once, nothing more delivered.
    Aborted,
    /// The fence closed: nothing more delivered.
    Fenced,
    /// The sink refused our fencing token: somebody newer owns the stream.
    SinkFenced,
    /// A permanent failure (refused host): not retried until the spec changes.
    Failed(String),
}

/// Cancellation handles for a session: `stop` drains gracefully, `abort` does not.
#[derive(Clone, Default)]
pub struct SessionControl {
    pub stop: CancellationToken,
    pub abort: CancellationToken,
}

enum ConnectError {
    Policy(PolicyError),
    Header(String),
    Io(String),
    Tls(String),
    Handshake(tungstenite::Error),
    Timeout,
}

impl ConnectError {
    fn kind(&self) -> &'static str {
        match self {
            Self::Policy(_) => "host_policy",
            Self::Header(_) => "header_reference",
            Self::Io(_) => "connect",
            Self::Tls(_) => "tls",
            Self::Handshake(_) => "handshake",
            Self::Timeout => "connect_timeout",
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Self::Policy(_) => "HostRefused",
            Self::Header(_) => "HeaderUnavailable",
            Self::Tls(_) => "TLSError",
            Self::Handshake(_) => "HandshakeFailed",
            _ => "ConnectFailed",
        }
    }

    fn message(&self) -> String {
        match self {
            Self::Policy(e) => e.to_string(),
            Self::Header(e) => e.clone(),
            Self::Io(e) | Self::Tls(e) => e.clone(),
            Self::Handshake(e) => e.to_string(),
            Self::Timeout => format!("no handshake within {CONNECT_TIMEOUT:?}"),
        }
    }
}

/// Why a connected session ended.
enum PumpEnd {
    Stopped,
    Aborted,
    Fenced,
    SinkFenced,
    Disconnected { kind: &'static str, message: String },
}

/// Keeps the active-connections gauge honest whatever way a session ends.
struct ActiveGuard(Arc<WorkerMetrics>);

impl ActiveGuard {
    fn new(metrics: &Arc<WorkerMetrics>) -> Self {
        metrics.active_connections.inc();
        Self(metrics.clone())
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active_connections.dec();
    }
}

/// Runs the session until it is stopped, aborted, fenced, or fails permanently.
pub async fn run(
    cfg: SessionConfig,
    shared: Arc<SessionShared>,
    deps: SessionDeps,
    ctl: SessionControl,
) -> SessionEnd {
    let sink = Sink::from_spec(&cfg.spec.sink, &deps.http);
    let mut attempt = 0u32;
    loop {
        if ctl.abort.is_cancelled() {
            return SessionEnd::Aborted;
        }
        if ctl.stop.is_cancelled() {
            return SessionEnd::Stopped;
        }
        if !shared.fence.is_valid() {
            return SessionEnd::Fenced;
        }
        let checkpoint = shared.acked();
        shared.update_status(|s| s.phase = "Connecting".into());
        let connected = tokio::select! {
            // Boxed: TLS and handshake state is large and only needed while connecting.
            r = timeout(CONNECT_TIMEOUT, Box::pin(connect(&cfg, &deps, checkpoint))) => r.unwrap_or(Err(ConnectError::Timeout)),
            _ = ctl.abort.cancelled() => return SessionEnd::Aborted,
            _ = ctl.stop.cancelled() => return SessionEnd::Stopped,
        };
        let error = match connected {
            Ok(ws) => {
                let started = Instant::now();
                shared.update_status(|s| {
                    s.phase = "Connected".into();
                    s.reason = None;
                    s.message = None;
                    s.connected_since_ms = Some(now_ms());
                });
                tracing::info!(stream = %cfg.key, token = cfg.token, checkpoint, "session connected");
                let active = ActiveGuard::new(&deps.metrics);
                let end = pump(ws, &cfg, &shared, &deps, &sink, &ctl, checkpoint).await;
                drop(active);
                match end {
                    PumpEnd::Stopped => return SessionEnd::Stopped,
                    PumpEnd::Aborted => return SessionEnd::Aborted,
                    PumpEnd::Fenced => return SessionEnd::Fenced,
                    PumpEnd::SinkFenced => return SessionEnd::SinkFenced,
                    PumpEnd::Disconnected { kind, message } => {
                        if started.elapsed() >= STABLE_SESSION {
                            attempt = 0;
                        }
                        (kind, "Disconnected", message)
                    }
                }
            }
            Err(ConnectError::Policy(e)) if e.is_permanent() => {
                let message = e.to_string();
                deps.metrics
                    .session_errors
                    .get_or_create(&[("kind", "host_policy")])
                    .inc();
                tracing::warn!(stream = %cfg.key, %message, "stream refused by host policy; not dialling");
                shared.update_status(|s| {
                    s.phase = "Failed".into();
                    s.reason = Some("HostRefused".into());
                    s.message = Some(message.clone());
                    s.connected_since_ms = None;
                });
                return SessionEnd::Failed(message);
            }
            Err(e) => (e.kind(), e.reason(), e.message()),
        };
        let (kind, reason, message) = error;
        deps.metrics
            .session_errors
            .get_or_create(&[("kind", kind)])
            .inc();
        deps.metrics.reconnects.inc();
        let delay = RECONNECT_BACKOFF.delay(attempt);
        attempt = attempt.saturating_add(1);
        tracing::warn!(stream = %cfg.key, kind, %message, retry_in = ?delay, "session ended; reconnecting");
        shared.update_status(|s| {
            s.phase = "Backoff".into();
            s.reason = Some(reason.into());
            s.message = Some(message.clone());
            s.connected_since_ms = None;
            s.reconnects += 1;
        });
        tokio::select! {
            _ = sleep(delay) => {}
            _ = ctl.abort.cancelled() => return SessionEnd::Aborted,
            _ = ctl.stop.cancelled() => return SessionEnd::Stopped,
        }
    }
}

async fn connect(
    cfg: &SessionConfig,
    deps: &SessionDeps,
    checkpoint: u64,
) -> Result<Ws, ConnectError> {
    let text = cfg
        .url_template
        .replace("{last_seq}", &checkpoint.to_string());
    let url = Url::parse(&text).map_err(|e| ConnectError::Io(format!("invalid URL: {e}")))?;
    let addrs = deps
        .policy
        .resolve(&url)
        .await
        .map_err(ConnectError::Policy)?;
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(ConnectError::Handshake)?;
    for header in &cfg.spec.headers {
        let value = deps
            .secrets
            .resolve(&cfg.key.namespace, &header.value_from)
            .await
            .map_err(ConnectError::Header)?;
        let name = tungstenite::http::HeaderName::from_bytes(header.name.as_bytes())
            .map_err(|_| ConnectError::Header(format!("invalid header name {}", header.name)))?;
        let mut value = HeaderValue::from_str(&value).map_err(|_| {
            ConnectError::Header(format!("value of header {} is not valid", header.name))
        })?;
        // Keeps the value out of any Debug output of the request.
        value.set_sensitive(true);
        request.headers_mut().insert(name, value);
    }
    let mut last_error = String::from("no address");
    let mut tcp = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last_error = format!("{addr}: {e}"),
        }
    }
    let tcp = tcp.ok_or(ConnectError::Io(last_error))?;
    let _ = tcp.set_nodelay(true);
    let limits = &cfg.spec.limits;
    let config = WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(0)
        .max_message_size(Some(limits.max_message_bytes as usize))
        .max_frame_size(Some(limits.max_frame_bytes as usize));
    // TLS is done here rather than inside tungstenite so a certificate or
    // protocol failure is reported as a TLS error, not a generic I/O one.
    let stream = if url.scheme() == "wss" {
        let host = url
            .host_str()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| ConnectError::Tls(format!("invalid TLS server name {host}: {e}")))?;
        let tls = tokio_rustls::TlsConnector::from(deps.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| ConnectError::Tls(format!("TLS handshake with {host} failed: {e}")))?;
        Transport::Tls(Box::new(tls))
    } else {
        Transport::Plain(tcp)
    };
    let (ws, _response) =
        tokio_tungstenite::client_async_with_config(request, stream, Some(config))
            .await
            .map_err(ConnectError::Handshake)?;
    Ok(ws)
}

/// The TLS client configuration every session shares: Mozilla's roots (webpki)
/// plus any CA certificates in `ca_file`, verification always on, ring as the
/// provider.
pub fn tls_config(ca_file: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("cannot read --ca-file {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "--ca-file {} holds no certificates",
                path.display()
            ));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| format!("--ca-file {}: {e}", path.display()))?;
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS setup failed: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

/// Reads messages and delivers them until the session ends.
async fn pump(
    mut ws: Ws,
    cfg: &SessionConfig,
    shared: &SessionShared,
    deps: &SessionDeps,
    sink: &Sink,
    ctl: &SessionControl,
    checkpoint: u64,
) -> PumpEnd {
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
                return PumpEnd::Aborted;
            }
            _ = ctl.stop.cancelled() => {
                if let Err(end) = Box::pin(deliver(&mut batch, cfg, shared, deps, sink, ctl)).await {
                    Box::pin(close(&mut ws, CloseCode::Away)).await;
                    return end;
                }
                Box::pin(close(&mut ws, CloseCode::Normal)).await;
                return PumpEnd::Stopped;
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
                            high_water += 1;
                            let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
                            batch.push(Message { seq: high_water, data });
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
        // Deliver what was read before reacting to a disconnect: it is already in
        // hand, and delivering it saves a replay.
        if (flush_now || ended.is_some()) && !batch.is_empty() {
            if let Err(end) = Box::pin(deliver(&mut batch, cfg, shared, deps, sink, ctl)).await {
                Box::pin(close(&mut ws, CloseCode::Away)).await;
                return end;
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

/// Delivers `batch` until the sink acknowledges it, then advances the checkpoint.
/// Retries with backoff (the caller is not reading meanwhile: backpressure).
async fn deliver(
    batch: &mut Vec<Message>,
    cfg: &SessionConfig,
    shared: &SessionShared,
    deps: &SessionDeps,
    sink: &Sink,
    ctl: &SessionControl,
) -> Result<(), PumpEnd> {
    let Some(last) = batch.last().map(|m| m.seq) else {
        return Ok(());
    };
    let mut attempt = 0u32;
    loop {
        if ctl.abort.is_cancelled() {
            return Err(PumpEnd::Aborted);
        }
        // Property 1b: never deliver on a lease whose renewal is not recent enough.
        if !shared.fence.is_valid() {
            return Err(PumpEnd::Fenced);
        }
        let payload = Batch {
            connection: &cfg.connection,
            worker: &cfg.worker_id,
            token: cfg.token,
            messages: batch,
        };
        let sent = Instant::now();
        let result = tokio::select! {
            // Boxed: the HTTP client's future only lives during a delivery.
            r = Box::pin(sink.deliver(&payload)) => r,
            _ = ctl.abort.cancelled() => return Err(PumpEnd::Aborted),
        };
        deps.metrics
            .sink_batch_seconds
            .observe(sent.elapsed().as_secs_f64());
        match result {
            Ok(()) => {
                deps.metrics
                    .sink_batches
                    .get_or_create(&[("sink", sink.kind()), ("result", "ok")])
                    .inc();
                deps.metrics.messages_delivered.inc_by(batch.len() as u64);
                shared.ack(last);
                if attempt > 0 {
                    tracing::info!(stream = %cfg.key, attempts = attempt + 1, "sink accepted the batch again");
                    shared.update_status(|s| {
                        s.reason = None;
                        s.message = None;
                    });
                }
                batch.clear();
                return Ok(());
            }
            Err(SinkError::Fenced) => {
                deps.metrics
                    .sink_batches
                    .get_or_create(&[("sink", sink.kind()), ("result", "fenced")])
                    .inc();
                return Err(PumpEnd::SinkFenced);
            }
            Err(e) => {
                deps.metrics
                    .sink_batches
                    .get_or_create(&[("sink", sink.kind()), ("result", e.category())])
                    .inc();
                let delay = SINK_BACKOFF.delay(attempt);
                if attempt.is_multiple_of(20) {
                    tracing::warn!(stream = %cfg.key, error = %e, attempt, "sink delivery failed; holding the batch and pausing reads");
                }
                shared.update_status(|s| {
                    s.reason = Some("SinkUnavailable".into());
                    s.message = Some(e.to_string());
                });
                attempt = attempt.saturating_add(1);
                tokio::select! {
                    _ = sleep(delay) => {}
                    _ = ctl.abort.cancelled() => return Err(PumpEnd::Aborted),
                }
            }
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

/// The sequence number of a message: from the JSON pointer, or the next counter
/// value. `Ok(None)` for a replay at or below what was already taken.
pub fn sequence_of(
    text: &str,
    pointer: Option<&str>,
    high_water: &mut u64,
) -> Result<Option<u64>, String> {
    let Some(pointer) = pointer else {
        *high_water += 1;
        return Ok(Some(*high_water));
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let seq = value
        .pointer(pointer)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("no unsigned integer at {pointer}"))?;
    if seq <= *high_water {
        return Ok(None);
    }
    *high_water = seq;
    Ok(Some(seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_sequences_continue_from_the_checkpoint() {
        let mut hw = 41;
        assert_eq!(sequence_of("x", None, &mut hw), Ok(Some(42)));
        assert_eq!(sequence_of("y", None, &mut hw), Ok(Some(43)));
    }

    #[test]
    fn pointer_sequences_skip_replays_and_reject_messages_without_one() {
        let mut hw = 10;
        assert_eq!(sequence_of(r#"{"seq":9}"#, Some("/seq"), &mut hw), Ok(None));
        assert_eq!(
            sequence_of(r#"{"seq":10}"#, Some("/seq"), &mut hw),
            Ok(None)
        );
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
        assert_eq!(hw, 12);
    }

    #[test]
    fn status_changes_are_written_once() {
        let shared = SessionShared::new(Fence::new(Duration::from_secs(1), Instant::now()), 0);
        assert!(
            shared.take_status().is_some(),
            "initial Pending status is unwritten"
        );
        assert!(shared.take_status().is_none());
        shared.update_status(|s| s.phase = "Pending".into());
        assert!(
            shared.take_status().is_none(),
            "no change, nothing to write"
        );
        shared.update_status(|s| s.phase = "Connected".into());
        assert_eq!(
            shared.take_status().map(|s| s.phase),
            Some("Connected".into())
        );
    }
}

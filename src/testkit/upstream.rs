//! A WebSocket upstream that emits `{"seq":N,...}` messages with increasing
//! `seq` per stream, replays from `?after=N`, pings its clients (and drops those
//! that stop answering, as real feeds do), and records each session's open and
//! close instants, so tests can detect overlapping sessions.

use futures::{SinkExt, StreamExt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{Instant, interval};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};

/// How often the upstream pings clients. Short, so a paused client is dropped
/// well within a test's lease, as a real feed's keepalive would.
const PING_INTERVAL: Duration = Duration::from_secs(1);
/// A client silent this long is dropped (it is dead or paused).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);
/// Idle sessions (rate 0, for memory benchmarks) ping like a typical production
/// feed instead, so ten thousand of them are not a ping flood.
const IDLE_PING_INTERVAL: Duration = Duration::from_secs(15);
const IDLE_CLIENT_TIMEOUT: Duration = Duration::from_secs(45);

/// Misbehaviour to inject for one stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Behavior {
    Normal,
    /// Refuse the handshake with HTTP 503.
    Reject,
    /// Send a text frame that is not UTF-8.
    Malformed,
    /// Send one message of this many bytes.
    Oversized(usize),
}

/// One recorded session.
#[derive(Clone, Debug)]
pub struct SessionRecord {
    pub id: u64,
    pub stream: String,
    pub after: u64,
    pub opened: Instant,
    pub closed: Option<Instant>,
    pub first_sent: Option<Instant>,
    /// Last seq sent on this session.
    pub last_sent: u64,
    /// The `Authorization` header the client sent, if any (test data only).
    pub authorization: Option<String>,
}

#[derive(Default)]
struct State {
    sessions: Mutex<Vec<SessionRecord>>,
    behaviors: Mutex<HashMap<String, Behavior>>,
    next_id: AtomicU64,
}

/// A running test upstream; stops when dropped.
pub struct TestUpstream {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestUpstream {
    /// Starts on `listen` emitting `rate` messages per second per session
    /// (`0`: idle sessions that only exchange pings).
    pub async fn start(listen: SocketAddr, rate: u32) -> std::io::Result<Self> {
        Self::start_with(listen, rate, None).await
    }

    /// Like [`TestUpstream::start`], serving `wss://` with this certificate
    /// chain and key (DER), for measuring TLS sessions.
    pub async fn start_tls(
        listen: SocketAddr,
        rate: u32,
        chain: Vec<rustls::pki_types::CertificateDer<'static>>,
        key: rustls::pki_types::PrivateKeyDer<'static>,
    ) -> std::io::Result<Self> {
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
        .map_err(std::io::Error::other)?;
        Self::start_with(
            listen,
            rate,
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
        )
        .await
    }

    async fn start_with(
        listen: SocketAddr,
        rate: u32,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let period = (rate > 0).then(|| Duration::from_secs_f64(1.0 / f64::from(rate)));
        let task = tokio::spawn({
            let state = state.clone();
            async move {
                while let Ok((socket, _)) = listener.accept().await {
                    let _ = socket.set_nodelay(true);
                    let state = state.clone();
                    match tls.clone() {
                        None => {
                            tokio::spawn(serve(socket, state, period));
                        }
                        Some(acceptor) => {
                            tokio::spawn(async move {
                                if let Ok(stream) = acceptor.accept(socket).await {
                                    serve(stream, state, period).await;
                                }
                            });
                        }
                    }
                }
            }
        });
        Ok(Self { addr, state, task })
    }

    /// The URL a stream uses, with the `{last_seq}` placeholder.
    pub fn url(&self, stream: &str) -> String {
        format!("ws://{}/{stream}?after={{last_seq}}", self.addr)
    }

    pub fn set_behavior(&self, stream: &str, behavior: Behavior) {
        self.state
            .behaviors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(stream.to_string(), behavior);
    }

    /// Every session so far, in opening order.
    pub fn sessions(&self) -> Vec<SessionRecord> {
        self.state
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sessions of one stream.
    pub fn sessions_of(&self, stream: &str) -> Vec<SessionRecord> {
        self.sessions()
            .into_iter()
            .filter(|s| s.stream == stream)
            .collect()
    }

    /// Streams with an open session right now, and how many each.
    pub fn open_sessions(&self) -> HashMap<String, usize> {
        let mut open = HashMap::new();
        for s in self.sessions().into_iter().filter(|s| s.closed.is_none()) {
            *open.entry(s.stream).or_insert(0) += 1;
        }
        open
    }

    /// Pairs of sessions of one stream that were open at the same time.
    pub fn overlaps(&self) -> Vec<(SessionRecord, SessionRecord)> {
        let sessions = self.sessions();
        let mut by_stream: HashMap<&str, Vec<&SessionRecord>> = HashMap::new();
        for s in &sessions {
            by_stream.entry(&s.stream).or_default().push(s);
        }
        let mut out = Vec::new();
        for list in by_stream.values() {
            for (i, a) in list.iter().enumerate() {
                for b in &list[i + 1..] {
                    let a_end = a.closed.unwrap_or_else(far_future);
                    let b_end = b.closed.unwrap_or_else(far_future);
                    if a.opened < b_end && b.opened < a_end {
                        out.push(((*a).clone(), (*b).clone()));
                    }
                }
            }
        }
        out
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86400 * 365)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

async fn serve<S>(socket: S, state: Arc<State>, period: Option<Duration>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut target: Option<(String, u64, Option<String>)> = None;
    let behaviors = state.behaviors.clone_inner();
    // tungstenite's callback signature fixes the error type.
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        let stream = req.uri().path().trim_start_matches('/').to_string();
        let after = req
            .uri()
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("after=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if behaviors.get(&stream) == Some(&Behavior::Reject) {
            let mut refuse = ErrorResponse::new(Some("unavailable".into()));
            *refuse.status_mut() =
                tokio_tungstenite::tungstenite::http::StatusCode::SERVICE_UNAVAILABLE;
            return Err(refuse);
        }
        let authorization = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        target = Some((stream, after, authorization));
        Ok(resp)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(socket, callback).await else {
        return;
    };
    let Some((stream, after, authorization)) = target else {
        return;
    };
    let behavior = lock(&state.behaviors)
        .get(&stream)
        .cloned()
        .unwrap_or(Behavior::Normal);
    let id = state.next_id.fetch_add(1, Ordering::SeqCst);
    let index = {
        let mut sessions = lock(&state.sessions);
        sessions.push(SessionRecord {
            id,
            stream: stream.clone(),
            after,
            opened: Instant::now(),
            closed: None,
            first_sent: None,
            last_sent: after,
            authorization,
        });
        sessions.len() - 1
    };
    let mut seq = after;
    // Idle sessions tick once a day: effectively never.
    let mut tick = interval(period.unwrap_or(Duration::from_secs(86_400)));
    if period.is_none() {
        tick.tick().await;
    }
    let (ping_every, client_timeout) = match period {
        Some(_) => (PING_INTERVAL, CLIENT_TIMEOUT),
        None => (IDLE_PING_INTERVAL, IDLE_CLIENT_TIMEOUT),
    };
    let mut ping = interval(ping_every);
    let mut last_heard = Instant::now();
    match behavior {
        Behavior::Malformed => {
            let header = FrameHeader {
                opcode: OpCode::Data(Data::Text),
                ..FrameHeader::default()
            };
            let frame = Frame::from_payload(header, vec![0xff, 0xfe, 0xfd].into());
            let _ = ws.send(Message::Frame(frame)).await;
        }
        Behavior::Oversized(n) => {
            let _ = ws.send(Message::Text("x".repeat(n).into())).await;
        }
        _ => {}
    }
    loop {
        tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                let text = format!(r#"{{"seq":{seq},"stream":"{stream}","payload":"message {seq} of {stream}"}}"#);
                // A client that stopped reading (paused, or applying backpressure)
                // eventually fills the socket buffers; give up on it then.
                if !matches!(tokio::time::timeout(CLIENT_TIMEOUT, ws.send(Message::Text(text.into()))).await, Ok(Ok(()))) {
                    break;
                }
                let mut sessions = lock(&state.sessions);
                let s = &mut sessions[index];
                s.first_sent.get_or_insert_with(Instant::now);
                s.last_sent = seq;
            }
            _ = ping.tick() => {
                if last_heard.elapsed() > client_timeout {
                    break;
                }
                if !matches!(tokio::time::timeout(CLIENT_TIMEOUT, ws.send(Message::Ping(Vec::new().into()))).await, Ok(Ok(()))) {
                    break;
                }
            }
            frame = ws.next() => match frame {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => last_heard = Instant::now(),
            }
        }
    }
    // Record the close before the socket is torn down, so a successor's open can
    // never be recorded earlier than this session's close when they did not overlap.
    lock(&state.sessions)[index].closed = Some(Instant::now());
    drop(ws);
}

trait CloneInner<T> {
    fn clone_inner(&self) -> T;
}

impl<T: Clone> CloneInner<T> for Mutex<T> {
    fn clone_inner(&self) -> T {
        lock(self).clone()
    }
}

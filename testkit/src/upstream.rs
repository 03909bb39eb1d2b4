//! Upstreams for tests: the product's demo feed (replaying, recording every
//! session) over plain TCP or TLS, and a feed that misbehaves on purpose.

use futures::SinkExt;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tether::cli::demo::feed::Feed;
pub use tether::cli::demo::feed::{FeedOptions, SessionRecord};
use tether::support::lock;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};

/// The replaying, recording upstream.
pub type TestUpstream = Feed;

/// A feed at `rate` messages per second per session, first sequence number 1.
pub async fn start(listen: SocketAddr, rate: u32) -> std::io::Result<Feed> {
    Feed::start(
        listen,
        FeedOptions {
            rate,
            ..FeedOptions::default()
        },
    )
    .await
}

/// A TLS server configuration for a test upstream with this certificate
/// chain and key (DER).
pub fn server_config(
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> std::io::Result<Arc<rustls::ServerConfig>> {
    rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
        .map(Arc::new)
        .map_err(std::io::Error::other)
}

/// The same feed over TLS with this certificate chain and key (DER).
pub struct TlsUpstream {
    pub feed: Feed,
    task: JoinHandle<()>,
    accepted: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TlsUpstream {
    pub async fn start(
        listen: SocketAddr,
        options: FeedOptions,
        chain: Vec<rustls::pki_types::CertificateDer<'static>>,
        key: rustls::pki_types::PrivateKeyDer<'static>,
    ) -> std::io::Result<Self> {
        let acceptor = tokio_rustls::TlsAcceptor::from(server_config(chain, key)?);
        let listener = TcpListener::bind(listen).await?;
        let feed = Feed::detached(listener.local_addr()?, options);
        let serving = feed.handle();
        let accepted: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>> = Arc::default();
        let accepts = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                lock(&accepts).push(tokio::time::Instant::now());
                let _ = socket.set_nodelay(true);
                let acceptor = acceptor.clone();
                let serving = serving.clone();
                tokio::spawn(async move {
                    if let Ok(stream) = acceptor.accept(socket).await {
                        serving.serve(stream).await;
                    }
                });
            }
        });
        Ok(Self {
            feed,
            task,
            accepted,
        })
    }

    /// When each TCP connection arrived (before TLS), in order: what an
    /// upstream's connect-rate limit counts.
    pub fn accepted(&self) -> Vec<tokio::time::Instant> {
        lock(&self.accepted).clone()
    }

    /// The `wss://` URL a stream uses, with the `{last_seq}` placeholder.
    pub fn url(&self, stream: &str) -> String {
        format!("wss://{}/{stream}?after={{last_seq}}", self.feed.addr)
    }
}

/// A throwaway certificate for `names` and its key.
pub fn self_signed(
    names: &[&str],
) -> (
    rcgen::CertifiedKey<rcgen::KeyPair>,
    rustls::pki_types::PrivateKeyDer<'static>,
) {
    let certified =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("a self-signed certificate can always be made");
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    (certified, key)
}

/// How a misbehaving stream misbehaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Misbehavior {
    /// Refuse the handshake with HTTP 503.
    Reject,
    /// Send a text frame that is not UTF-8.
    Malformed,
    /// Send one message of this many bytes.
    Oversized(usize),
}

/// An upstream whose streams misbehave, each its own way; counts sessions.
pub struct FaultyUpstream {
    pub addr: SocketAddr,
    behaviors: Arc<Mutex<HashMap<String, Misbehavior>>>,
    sessions: Arc<Mutex<HashMap<String, usize>>>,
    task: JoinHandle<()>,
}

impl Drop for FaultyUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultyUpstream {
    pub async fn start(listen: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let behaviors: Arc<Mutex<HashMap<String, Misbehavior>>> = Arc::default();
        let sessions: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let task = tokio::spawn({
            let behaviors = behaviors.clone();
            let sessions = sessions.clone();
            async move {
                while let Ok((socket, _)) = listener.accept().await {
                    tokio::spawn(misbehave(socket, behaviors.clone(), sessions.clone()));
                }
            }
        });
        Ok(Self {
            addr,
            behaviors,
            sessions,
            task,
        })
    }

    pub fn set(&self, stream: &str, behavior: Misbehavior) {
        lock(&self.behaviors).insert(stream.to_string(), behavior);
    }

    pub fn url(&self, stream: &str) -> String {
        format!("ws://{}/{stream}?after={{last_seq}}", self.addr)
    }

    /// WebSocket sessions accepted for `stream`.
    pub fn sessions(&self, stream: &str) -> usize {
        lock(&self.sessions).get(stream).copied().unwrap_or(0)
    }
}

async fn misbehave(
    socket: tokio::net::TcpStream,
    behaviors: Arc<Mutex<HashMap<String, Misbehavior>>>,
    sessions: Arc<Mutex<HashMap<String, usize>>>,
) {
    let mut stream = String::new();
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        stream = req.uri().path().trim_start_matches('/').to_string();
        if lock(&behaviors).get(&stream) == Some(&Misbehavior::Reject) {
            let mut refuse = ErrorResponse::new(Some("unavailable".into()));
            *refuse.status_mut() =
                tokio_tungstenite::tungstenite::http::StatusCode::SERVICE_UNAVAILABLE;
            return Err(refuse);
        }
        Ok(resp)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(socket, callback).await else {
        return;
    };
    *lock(&sessions).entry(stream.clone()).or_insert(0) += 1;
    let behavior = lock(&behaviors).get(&stream).cloned();
    match behavior {
        Some(Misbehavior::Malformed) => {
            let header = FrameHeader {
                opcode: OpCode::Data(Data::Text),
                ..FrameHeader::default()
            };
            let frame = Frame::from_payload(header, vec![0xff, 0xfe, 0xfd].into());
            let _ = ws.send(Message::Frame(frame)).await;
        }
        Some(Misbehavior::Oversized(n)) => {
            let _ = ws.send(Message::Text("x".repeat(n).into())).await;
        }
        _ => {}
    }
    // Hold the session until the client goes away.
    use futures::StreamExt;
    while let Some(Ok(_)) = ws.next().await {}
}

/// One session of a [`CloseIgnoringUpstream`].
#[derive(Clone, Debug)]
pub struct RawSession {
    pub opened: tokio::time::Instant,
    /// When the client's end of the TCP connection was seen closed.
    pub closed: Option<tokio::time::Instant>,
}

/// An upstream that never answers a WebSocket close frame (nor anything the
/// client sends): after the handshake, written by hand, it sends
/// `{"seq": n}` every 50 ms, resuming after `?after=`, and reads only to see
/// the client's socket go. A client that waits for a close handshake waits in
/// vain; what the upstream records is when the connection really ended.
pub struct CloseIgnoringUpstream {
    pub addr: SocketAddr,
    sessions: Arc<Mutex<HashMap<String, Vec<RawSession>>>>,
    task: JoinHandle<()>,
}

impl Drop for CloseIgnoringUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl CloseIgnoringUpstream {
    pub async fn start(listen: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let sessions: Arc<Mutex<HashMap<String, Vec<RawSession>>>> = Arc::default();
        let task = tokio::spawn({
            let sessions = sessions.clone();
            async move {
                while let Ok((socket, _)) = listener.accept().await {
                    tokio::spawn(serve_ignoring_close(socket, sessions.clone()));
                }
            }
        });
        Ok(Self {
            addr,
            sessions,
            task,
        })
    }

    pub fn url(&self, stream: &str) -> String {
        format!("ws://{}/{stream}?after={{last_seq}}", self.addr)
    }

    pub fn sessions(&self, stream: &str) -> Vec<RawSession> {
        lock(&self.sessions)
            .get(stream)
            .cloned()
            .unwrap_or_default()
    }

    /// Pairs of sessions of one stream that were open at the same time:
    /// (stream, index of the earlier, index of the later).
    pub fn overlaps(&self) -> Vec<(String, usize, usize)> {
        let mut found = Vec::new();
        for (stream, sessions) in lock(&self.sessions).iter() {
            for (i, a) in sessions.iter().enumerate() {
                for (j, b) in sessions.iter().enumerate().skip(i + 1) {
                    if a.closed.is_none_or(|c| c > b.opened) {
                        found.push((stream.clone(), i, j));
                    }
                }
            }
        }
        found
    }
}

async fn serve_ignoring_close(
    mut socket: tokio::net::TcpStream,
    sessions: Arc<Mutex<HashMap<String, Vec<RawSession>>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = socket.set_nodelay(true);
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let request = String::from_utf8_lossy(&request).to_string();
    let target = request.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let stream = path.trim_start_matches('/').to_string();
    let after: u64 = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("after="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let Some(key) = request.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("sec-websocket-key")
            .then(|| value.trim().to_string())
    }) else {
        return;
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
    );
    if socket.write_all(response.as_bytes()).await.is_err() {
        return;
    }
    let index = {
        let mut all = lock(&sessions);
        let list = all.entry(stream.clone()).or_default();
        list.push(RawSession {
            opened: tokio::time::Instant::now(),
            closed: None,
        });
        list.len() - 1
    };
    let (mut reader, mut writer) = socket.into_split();
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
    let mut seq = after;
    loop {
        tokio::select! {
            read = reader.read(&mut buf) => {
                // Whatever the client sends (its close frame included) goes
                // unanswered; only the end of the connection counts.
                if matches!(read, Ok(0) | Err(_)) {
                    break;
                }
            }
            _ = tick.tick() => {
                seq += 1;
                let payload = format!("{{\"seq\":{seq}}}");
                let mut frame = vec![0x81, payload.len() as u8];
                frame.extend_from_slice(payload.as_bytes());
                if writer.write_all(&frame).await.is_err() {
                    break;
                }
            }
        }
    }
    if let Some(s) = lock(&sessions)
        .get_mut(&stream)
        .and_then(|l| l.get_mut(index))
    {
        s.closed = Some(tokio::time::Instant::now());
    }
}

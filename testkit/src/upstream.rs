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

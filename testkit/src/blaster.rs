//! A saturating upstream for throughput benchmarks. After the WebSocket
//! handshake it writes text frames as fast as the socket takes them, 64 KiB
//! of frames per write, numbered from one past the `after` the client asked
//! for. The demo feed sends, flushes and records one message at a time, so at
//! full speed it, not the client under test, would be the bottleneck.
//!
//! It never reads after the handshake: a client's pings and close frames wait
//! in the socket (a measurement window is seconds; a closed client ends the
//! session with a write error).

use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};

/// Bytes of frames built per write.
const WRITE_BYTES: usize = 64 * 1024;

pub struct Blaster {
    pub addr: SocketAddr,
    scheme: &'static str,
    task: JoinHandle<()>,
}

impl Drop for Blaster {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Blaster {
    /// Serves `ws://` (no `tls`) or `wss://` on `listen`; every message is
    /// `{"seq":N,"payload":"…"}` padded to about `message_bytes`.
    pub async fn start(
        listen: SocketAddr,
        message_bytes: usize,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let scheme = if tls.is_some() { "wss" } else { "ws" };
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let _ = socket.set_nodelay(true);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    match acceptor {
                        Some(a) => {
                            if let Ok(s) = a.accept(socket).await {
                                blast(s, message_bytes).await;
                            }
                        }
                        None => blast(socket, message_bytes).await,
                    }
                });
            }
        });
        Ok(Self { addr, scheme, task })
    }

    /// A stream's URL, with the `{last_seq}` placeholder.
    pub fn url(&self, stream: &str) -> String {
        format!(
            "{}://{}/{stream}?after={{last_seq}}",
            self.scheme, self.addr
        )
    }
}

// tungstenite's handshake callback returns its own (large) error response type.
#[allow(clippy::result_large_err)]
async fn blast<S: AsyncRead + AsyncWrite + Unpin>(socket: S, message_bytes: usize) {
    let mut query = String::new();
    let handshake = tokio_tungstenite::accept_hdr_async(socket, |req: &Request, resp: Response| {
        query = req.uri().query().unwrap_or_default().to_string();
        Ok(resp)
    })
    .await;
    let Ok(mut ws) = handshake else { return };
    let after = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("after="))
        .and_then(|a| a.parse::<u64>().ok());
    let mut seq = after.map_or(1, |a| a + 1);
    let padding = "x".repeat(message_bytes.saturating_sub(32));
    let mut frames = Vec::with_capacity(WRITE_BYTES + message_bytes + 16);
    let mut text = String::with_capacity(message_bytes + 32);
    let socket = ws.get_mut();
    loop {
        frames.clear();
        while frames.len() < WRITE_BYTES {
            text.clear();
            use std::fmt::Write;
            let _ = write!(text, r#"{{"seq":{seq},"payload":"{padding}"}}"#);
            seq += 1;
            push_text_frame(&mut frames, text.as_bytes());
        }
        if socket.write_all(&frames).await.is_err() || socket.flush().await.is_err() {
            return;
        }
    }
}

/// An unmasked (server-to-client), final text frame.
fn push_text_frame(out: &mut Vec<u8>, payload: &[u8]) {
    out.push(0x81);
    match payload.len() {
        n @ 0..=125 => out.push(n as u8),
        n @ 126..=65_535 => {
            out.push(126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(payload);
}

//! A session's socket: its transport (plain TCP or boxed TLS) and the
//! WebSocket over it, tungstenite driven by the session's own task.
//!
//! tungstenite reads and writes through `std::io`; an async runtime has to
//! turn "not ready" into `WouldBlock` and wake the task when the socket is
//! ready. tokio-tungstenite does it by registering the polling task's waker
//! in two atomic waker slots on every poll, which is once per message read:
//! about 30 ns of the ~570 a saturated worker spends on a message (`perf`,
//! bench/README.md). A session's socket is only ever polled by its own task,
//! so here it keeps that task's waker and clones it again only when another
//! one polls it; the transport registers the waker with the runtime only
//! when it has nothing to read. Otherwise this behaves as tokio-tungstenite's
//! stream and sink do: reads answer pings, a write that would block is queued
//! and flushed, and a closed connection ends the reads; closing answers the
//! upstream's close frame if it closed first (tokio-tungstenite's `close`
//! left that answer unsent).

use std::io::{self, Read, Write};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::client::ClientHandshake;
use tokio_tungstenite::tungstenite::handshake::{HandshakeError, MidHandshake};
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error, Message, WebSocket};

/// Plain TCP, or TLS boxed (tokio-tungstenite's `MaybeTlsStream` stores the
/// TLS state inline, about 1.3 KiB per `ws://` session).
pub(super) enum Transport {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// An open WebSocket session to an upstream.
pub struct Ws {
    socket: WebSocket<TaskIo>,
    /// The connection closed or failed: reads end (as a fused stream).
    ended: bool,
}

impl Ws {
    /// The client handshake over an open transport, begun at the first poll
    /// (so the transport is polled with this task's waker from the start)
    /// and resumed on each wake-up.
    pub(super) async fn handshake(
        request: impl IntoClientRequest,
        transport: Transport,
        config: WebSocketConfig,
    ) -> Result<Self, Error> {
        let mut start = Some((request, transport));
        let mut interrupted: Option<MidHandshake<ClientHandshake<TaskIo>>> = None;
        std::future::poll_fn(|cx| {
            let attempt = match (start.take(), interrupted.take()) {
                (Some((request, transport)), _) => {
                    let io = TaskIo {
                        transport,
                        waker: cx.waker().clone(),
                    };
                    tokio_tungstenite::tungstenite::client::client_with_config(
                        request,
                        io,
                        Some(config),
                    )
                }
                (None, Some(mut mid)) => {
                    mid.get_mut().get_mut().follow(cx);
                    mid.handshake()
                }
                (None, None) => panic!("handshake polled after completion"),
            };
            match attempt {
                Ok((socket, _)) => Poll::Ready(Ok(Self::open(socket))),
                Err(HandshakeError::Failure(e)) => Poll::Ready(Err(e)),
                Err(HandshakeError::Interrupted(mid)) => {
                    interrupted = Some(mid);
                    Poll::Pending
                }
            }
        })
        .await
    }

    fn open(socket: WebSocket<TaskIo>) -> Self {
        Self {
            socket,
            ended: false,
        }
    }

    /// The next message, as `Stream::poll_next` would give it: `None` once
    /// the connection is closed, and after an error.
    pub(super) fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Message, Error>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        self.socket.get_mut().follow(cx);
        match self.socket.read() {
            Ok(message) => Poll::Ready(Some(Ok(message))),
            Err(e) if would_block(&e) => Poll::Pending,
            Err(e) => {
                self.ended = true;
                if matches!(e, Error::AlreadyClosed | Error::ConnectionClosed) {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Err(e)))
                }
            }
        }
    }

    /// Writes `message` and flushes it (and anything queued before it).
    pub(super) async fn send(&mut self, message: Message) -> Result<(), Error> {
        let mut message = Some(message);
        std::future::poll_fn(|cx| {
            self.socket.get_mut().follow(cx);
            if let Some(message) = message.take() {
                match self.socket.write(message) {
                    // Queued; the flush below goes on with it.
                    Err(e) if would_block(&e) => {}
                    Err(e) => return Poll::Ready(Err(e)),
                    Ok(()) => {}
                }
            }
            flushed(self.socket.flush())
        })
        .await
    }

    /// Closes the session from this side: sends `frame`, or, when the
    /// upstream closed first, the answer to its close frame that the read
    /// queued, and flushes it. The upstream's answer is not waited for (the
    /// socket is dropped afterwards).
    pub(super) async fn close(&mut self, frame: CloseFrame) -> Result<(), Error> {
        let mut frame = Some(frame);
        std::future::poll_fn(|cx| {
            self.socket.get_mut().follow(cx);
            // tungstenite's `close` queues the frame only while the session
            // is open, and flushes whatever is queued either way (a write of
            // a close message after the upstream's close is refused instead,
            // the answer left unsent).
            flushed(match frame.take() {
                Some(frame) => self.socket.close(Some(frame)),
                None => self.socket.flush(),
            })
        })
        .await
    }
}

/// A flush's outcome as a poll: done (a connection closed meanwhile
/// included, as tokio-tungstenite's sink takes it), or still to go on.
fn flushed(result: Result<(), Error>) -> Poll<Result<(), Error>> {
    match result {
        Ok(()) | Err(Error::ConnectionClosed) => Poll::Ready(Ok(())),
        Err(e) if would_block(&e) => Poll::Pending,
        Err(e) => Poll::Ready(Err(e)),
    }
}

fn would_block(e: &Error) -> bool {
    matches!(e, Error::Io(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// The transport seen through `std::io`, polled with the waker of the task
/// that last polled the session.
struct TaskIo {
    transport: Transport,
    waker: Waker,
}

impl TaskIo {
    /// Wakes `cx`'s task from now on (a clone only when the task changed).
    fn follow(&mut self, cx: &Context<'_>) {
        if !self.waker.will_wake(cx.waker()) {
            self.waker.clone_from(cx.waker());
        }
    }

    fn poll<T>(
        &mut self,
        op: impl FnOnce(Pin<&mut Transport>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> io::Result<T> {
        let mut cx = Context::from_waker(&self.waker);
        match op(Pin::new(&mut self.transport), &mut cx) {
            Poll::Ready(result) => result,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl Read for TaskIo {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut buf = ReadBuf::new(buf);
        self.poll(|t, cx| t.poll_read(cx, &mut buf))?;
        Ok(buf.filled().len())
    }
}

impl Write for TaskIo {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.poll(|t, cx| t.poll_write(cx, buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.poll(|t, cx| t.poll_flush(cx))
    }
}

#[cfg(test)]
mod tests {
    //! Against a server written out byte by byte on a real loopback socket,
    //! so each test decides where the client finds nothing to read (or no
    //! room to write) and must be woken to go on.
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::time::{sleep, timeout};
    use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{CloseCode, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};

    const PAUSE: Duration = Duration::from_millis(30);
    const BOUND: Duration = Duration::from_secs(10);

    /// The server's side of a test connection: plain TCP or TLS.
    trait Peer: AsyncRead + AsyncWrite + Unpin + Send {}
    impl<T: AsyncRead + AsyncWrite + Unpin + Send> Peer for T {}
    type Server = Box<dyn Peer>;

    /// How the test server answers.
    #[derive(Default)]
    struct Answer {
        /// TLS with a throwaway certificate the client trusts.
        tls: bool,
        /// Bytes sent in the same write as the end of the handshake's answer.
        with_the_101: Vec<u8>,
    }

    /// A client connected to a server that answers the handshake in two
    /// writes with a pause between them; the server's side of the socket.
    async fn connected() -> (Ws, Server) {
        connected_with(Answer::default()).await
    }

    async fn connected_with(answer: Answer) -> (Ws, Server) {
        crate::install_crypto_provider();
        let (certified, key) = tether_testkit::upstream::self_signed(&["localhost"]);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let url = format!("ws://localhost:{}/feed", addr.port());
        let server_tls = answer.tls.then(|| {
            let config = rustls::ServerConfig::builder()
                .with_no_client_auth()
                .with_single_cert(vec![certified.cert.der().clone()], key)
                .unwrap();
            tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
        });
        let server = async {
            let (socket, _) = listener.accept().await.unwrap();
            let mut socket: Server = match server_tls {
                Some(acceptor) => Box::new(acceptor.accept(socket).await.unwrap()),
                None => Box::new(socket),
            };
            let mut request = Vec::new();
            while !request.ends_with(b"\r\n\r\n") {
                let mut byte = [0u8; 1];
                socket.read_exact(&mut byte).await.unwrap();
                request.push(byte[0]);
            }
            let request = String::from_utf8(request).unwrap();
            let key = request
                .lines()
                .find_map(|l| l.strip_prefix("Sec-WebSocket-Key: "))
                .expect("a key")
                .trim()
                .to_string();
            let mut response = format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n\r\n",
                derive_accept_key(key.as_bytes())
            )
            .into_bytes();
            response.extend_from_slice(&answer.with_the_101);
            let (first, rest) = response.split_at(20);
            socket.write_all(first).await.unwrap();
            socket.flush().await.unwrap();
            sleep(PAUSE).await;
            socket.write_all(rest).await.unwrap();
            socket.flush().await.unwrap();
            socket
        };
        let client_tls = answer.tls.then(|| {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(certified.cert.der().clone()).unwrap();
            let config = rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth();
            tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        });
        // The client runs on a task of its own, so only its socket wakes it.
        let client = tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let transport = match client_tls {
                Some(connector) => {
                    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                    Transport::Tls(Box::new(connector.connect(name, tcp).await.unwrap()))
                }
                None => Transport::Plain(tcp),
            };
            Ws::handshake(url.as_str(), transport, WebSocketConfig::default()).await
        });
        let socket = timeout(BOUND, server).await.expect("the server answered");
        let ws = timeout(BOUND, client)
            .await
            .expect("the handshake finished")
            .unwrap();
        (ws.expect("the handshake succeeded"), socket)
    }

    /// An unmasked server frame, written by tungstenite's frame encoder.
    fn frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let header = FrameHeader {
            opcode: OpCode::from(opcode),
            ..FrameHeader::default()
        };
        Frame::from_payload(header, payload.to_vec().into())
            .format(&mut out)
            .unwrap();
        out
    }

    /// Reads one (masked) client frame: opcode and payload.
    async fn client_frame(socket: &mut Server) -> (u8, Vec<u8>) {
        let mut head = [0u8; 2];
        socket.read_exact(&mut head).await.unwrap();
        assert_eq!(head[1] & 0x80, 0x80, "client frames are masked");
        let len = match head[1] & 0x7f {
            126 => u64::from(socket.read_u16().await.unwrap()),
            127 => socket.read_u64().await.unwrap(),
            n => u64::from(n),
        };
        let mut mask = [0u8; 4];
        socket.read_exact(&mut mask).await.unwrap();
        let mut payload = vec![0u8; len as usize];
        socket.read_exact(&mut payload).await.unwrap();
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
        (head[0] & 0x0f, payload)
    }

    /// The next message. No timer of its own: run on a task of its own and
    /// bounded from outside, nothing but the socket can wake it.
    async fn next(ws: &mut Ws) -> Option<Result<Message, Error>> {
        std::future::poll_fn(|cx| ws.poll_next(cx)).await
    }

    /// A message that arrives in pieces, with the client finding nothing to
    /// read between them, is read whole once the last piece is in; a ping is
    /// answered while reading; the end of the connection ends the reads.
    #[tokio::test]
    async fn reads_go_on_when_the_rest_arrives_and_pings_are_answered() {
        reads_go_on(Answer::default()).await;
    }

    /// The same through TLS: what wakes the reader is the TCP socket under
    /// rustls, which may hold a record it has not yet given out.
    #[tokio::test]
    async fn reads_go_on_through_tls() {
        reads_go_on(Answer {
            tls: true,
            ..Answer::default()
        })
        .await;
    }

    /// A first frame that comes in the same segment as the end of the
    /// handshake's answer is read (tungstenite keeps what followed the 101).
    #[tokio::test]
    async fn a_frame_sent_with_the_handshakes_answer_is_read() {
        for tls in [false, true] {
            let (mut ws, _server) = connected_with(Answer {
                tls,
                with_the_101: frame(0x1, b"right away"),
            })
            .await;
            let first = timeout(BOUND, tokio::spawn(async move { next(&mut ws).await }))
                .await
                .expect("the first frame was read without another wake-up")
                .unwrap();
            assert_eq!(
                first.unwrap().unwrap(),
                Message::Text("right away".into()),
                "tls: {tls}"
            );
        }
    }

    async fn reads_go_on(answer: Answer) {
        let (mut ws, mut server) = connected_with(answer).await;
        // Larger than the read buffer (128 KiB by default), in three pieces.
        let text = "x".repeat(200_000);
        let bytes = frame(0x1, text.as_bytes());
        let feeder = async {
            for piece in bytes.chunks(bytes.len() / 3 + 1) {
                server.write_all(piece).await.unwrap();
                server.flush().await.unwrap();
                sleep(PAUSE).await;
            }
            server
                .write_all(&frame(0x9, b"are you there"))
                .await
                .unwrap();
            server
                .write_all(&frame(0x1, b"after the ping"))
                .await
                .unwrap();
            server.flush().await.unwrap();
            let answer = client_frame(&mut server).await;
            (server, answer)
        };
        // The reader runs on a task of its own, so only its socket wakes it.
        let reader = tokio::spawn(async move {
            let first = next(&mut ws).await;
            let ping = next(&mut ws).await;
            let second = next(&mut ws).await;
            (ws, first, ping, second)
        });
        let (mut server, answer) = timeout(BOUND, feeder).await.expect("the pong came");
        let (mut ws, first, ping, second) = timeout(BOUND, reader)
            .await
            .expect("woken for every message")
            .unwrap();
        assert_eq!(first.unwrap().unwrap(), Message::Text(text.into()));
        assert!(matches!(ping, Some(Ok(Message::Ping(_)))), "{ping:?}");
        assert_eq!(
            second.unwrap().unwrap(),
            Message::Text("after the ping".into())
        );
        assert_eq!(answer, (0xA, b"are you there".to_vec()), "the pong");
        server.shutdown().await.unwrap();
        drop(server);
        let (end, after) = timeout(
            BOUND,
            tokio::spawn(async move { (next(&mut ws).await, next(&mut ws).await) }),
        )
        .await
        .expect("woken by the connection's end")
        .unwrap();
        assert!(
            matches!(end, None | Some(Err(_))),
            "the connection's end ends the reads: {end:?}"
        );
        assert!(after.is_none(), "and they stay ended");
    }

    /// An upstream that closes first gets its close frame answered when the
    /// session closes (its code echoed, as RFC 6455 asks), not a refusal.
    #[tokio::test]
    async fn closing_after_the_upstream_did_answers_its_close_frame() {
        let (mut ws, mut server) = connected().await;
        let mut close = 1000u16.to_be_bytes().to_vec();
        close.extend_from_slice(b"done");
        server.write_all(&frame(0x8, &close)).await.unwrap();
        let closed = timeout(
            BOUND,
            tokio::spawn(async move {
                let read = next(&mut ws).await;
                let closed = ws
                    .close(CloseFrame {
                        code: CloseCode::Away,
                        reason: "".into(),
                    })
                    .await;
                (read, closed)
            }),
        )
        .await
        .expect("the close was read and answered")
        .unwrap();
        assert!(
            matches!(closed.0, Some(Ok(Message::Close(_)))),
            "{:?}",
            closed.0
        );
        assert!(closed.1.is_ok(), "{:?}", closed.1);
        let answer = timeout(BOUND, client_frame(&mut server))
            .await
            .expect("an answer came");
        assert_eq!(answer.0, 0x8, "a close frame");
        assert_eq!(
            answer.1[..2],
            1000u16.to_be_bytes(),
            "the upstream's code echoed"
        );
    }

    /// A message larger than the socket's buffers waits for the peer to read
    /// (the write would block) and is then written whole; a close frame
    /// follows with its code.
    #[tokio::test]
    async fn a_write_that_would_block_finishes_once_the_peer_reads() {
        let (mut ws, mut server) = connected().await;
        let text = "y".repeat(32 << 20);
        let expected = text.clone();
        // The sender runs on a task of its own, so only its socket wakes it.
        let sender = tokio::spawn(async move {
            let blocked = {
                let mut send = std::pin::pin!(ws.send(Message::Text(text.into())));
                let blocked = futures::poll!(send.as_mut()).is_pending();
                send.await?;
                blocked
            };
            Ok::<_, Error>((ws, blocked))
        });
        let message = timeout(BOUND, client_frame(&mut server))
            .await
            .expect("the whole message came");
        let (mut ws, blocked) = timeout(BOUND, sender)
            .await
            .expect("the write finished once the peer read")
            .unwrap()
            .unwrap();
        assert!(
            blocked,
            "the socket took the whole message at once: the test needs a larger one"
        );
        assert_eq!(message.0, 0x1);
        assert!(message.1 == expected.as_bytes(), "the whole text, in order");
        ws.close(CloseFrame {
            code: CloseCode::Away,
            reason: "".into(),
        })
        .await
        .unwrap();
        let close = timeout(BOUND, client_frame(&mut server)).await.unwrap();
        assert_eq!(close.0, 0x8);
        assert_eq!(close.1, 1001u16.to_be_bytes(), "code 1001 (going away)");
    }
}

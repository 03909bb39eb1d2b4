//! The demo's feed: a WebSocket upstream that emits `{"seq":N,...}` messages
//! with increasing `seq` per stream, replays from `?after=N` (from its first
//! sequence number when `after` is empty or absent), pings its clients and
//! drops those that stop answering (as real feeds do), and records each
//! session's open and close instants, so overlapping sessions can be counted.
//! The test kit serves it over TLS and adds misbehaving feeds of its own.

use crate::support::lock;
use futures::{SinkExt, StreamExt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{Instant, interval};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};

/// How often the feed pings clients. Short, so a paused client is dropped
/// well within a test's lease, as a real feed's keepalive would.
const PING_INTERVAL: Duration = Duration::from_secs(1);
/// A client silent this long is dropped (it is dead or paused).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);
/// Idle sessions (rate 0, for memory benchmarks) ping like a typical
/// production feed instead, so ten thousand of them are not a ping flood.
const IDLE_PING_INTERVAL: Duration = Duration::from_secs(15);
const IDLE_CLIENT_TIMEOUT: Duration = Duration::from_secs(45);

/// How a feed behaves.
#[derive(Clone, Copy, Debug)]
pub struct FeedOptions {
    /// Messages per second per session (0: idle sessions that only exchange pings).
    pub rate: u32,
    /// The first sequence number of every stream (0 for a zero-based feed).
    pub first_seq: u64,
    /// Light traffic instead of `rate`: one message per session this often,
    /// with the idle feed's keepalive (the memory benchmark's "a message every
    /// few seconds").
    pub message_every: Option<Duration>,
    /// Keep a duplicate of each plain session's socket to order a session's
    /// close before its successor's open (what overlap checks need). It
    /// costs a file descriptor per session: the memory benchmark, which
    /// holds ten thousand and checks no overlaps, turns it off.
    pub order_closes: bool,
}

impl Default for FeedOptions {
    fn default() -> Self {
        Self {
            rate: 10,
            first_seq: 1,
            message_every: None,
            order_closes: true,
        }
    }
}

/// One recorded session.
#[derive(Clone, Debug)]
pub struct SessionRecord {
    pub id: u64,
    pub stream: String,
    /// The `after` the client asked for (`None`: no checkpoint).
    pub after: Option<u64>,
    pub opened: Instant,
    pub closed: Option<Instant>,
    pub first_sent: Option<Instant>,
    /// Last seq sent on this session.
    pub last_sent: Option<u64>,
    /// The `Authorization` header the client sent, if any (test data only).
    pub authorization: Option<String>,
}

#[derive(Default)]
struct State {
    sessions: Mutex<Vec<SessionRecord>>,
    next_id: AtomicU64,
    /// Per open plain-TCP session (by id), a duplicate of its socket, so a
    /// successor can tell whether the client already hung up.
    probes: Mutex<HashMap<u64, std::os::fd::OwnedFd>>,
}

/// A running feed; stops when dropped.
pub struct Feed {
    pub addr: SocketAddr,
    options: FeedOptions,
    state: Arc<State>,
    task: Option<JoinHandle<()>>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

impl Feed {
    /// Serves plain `ws://` on `listen`.
    pub async fn start(listen: SocketAddr, options: FeedOptions) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let mut feed = Self::detached(listener.local_addr()?, options);
        let serving = feed.handle();
        let order_closes = options.order_closes;
        feed.task = Some(tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let _ = socket.set_nodelay(true);
                let probe = order_closes
                    .then(|| std::os::fd::AsFd::as_fd(&socket).try_clone_to_owned().ok())
                    .flatten();
                tokio::spawn(serving.clone().serve_probed(socket, probe));
            }
        }));
        Ok(feed)
    }

    /// A feed that accepts nothing itself: connections are handed to it with
    /// [`FeedHandle::serve`] (e.g. after a TLS handshake).
    pub fn detached(addr: SocketAddr, options: FeedOptions) -> Self {
        Self {
            addr,
            options,
            state: Arc::new(State::default()),
            task: None,
        }
    }

    /// Something that serves connections for this feed.
    pub fn handle(&self) -> FeedHandle {
        FeedHandle {
            state: self.state.clone(),
            options: self.options,
        }
    }

    /// The URL a stream uses, with the `{last_seq}` placeholder.
    pub fn url(&self, stream: &str) -> String {
        format!("ws://{}/{stream}?after={{last_seq}}", self.addr)
    }

    /// Every session so far, in opening order.
    pub fn sessions(&self) -> Vec<SessionRecord> {
        lock(&self.state.sessions).clone()
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
        let far = Instant::now() + Duration::from_secs(86400 * 365);
        let mut out = Vec::new();
        for list in by_stream.values() {
            for (i, a) in list.iter().enumerate() {
                for b in &list[i + 1..] {
                    if a.opened < b.closed.unwrap_or(far) && b.opened < a.closed.unwrap_or(far) {
                        out.push(((*a).clone(), (*b).clone()));
                    }
                }
            }
        }
        out
    }
}

/// Serves connections for one feed.
#[derive(Clone)]
pub struct FeedHandle {
    state: Arc<State>,
    options: FeedOptions,
}

impl FeedHandle {
    /// Serves one connection (a WebSocket handshake, then the stream).
    pub async fn serve<S>(self, socket: S)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.serve_probed(socket, None).await
    }

    /// [`serve`](Self::serve), with a duplicate of the connection's socket.
    /// The close of a session is recorded when its task sees the client hang
    /// up; a successor's handshake may be recorded first although the client
    /// had closed before reconnecting (tasks run in any order). With probes,
    /// a new session first asks the kernel whether its predecessors' clients
    /// have already hung up, and records those closes first: ordering by what
    /// the client did, not by which task ran first.
    async fn serve_probed<S>(self, socket: S, probe: Option<std::os::fd::OwnedFd>)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut target: Option<(String, Option<u64>, Option<String>)> = None;
        // tungstenite's callback signature fixes the error type.
        #[allow(clippy::result_large_err)]
        let callback = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
            let stream = req.uri().path().trim_start_matches('/').to_string();
            let after = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("after=")))
                .and_then(|v| v.parse().ok());
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
        let id = self.state.next_id.fetch_add(1, Ordering::SeqCst);
        let index = {
            let mut sessions = lock(&self.state.sessions);
            let now = Instant::now();
            let probes = lock(&self.state.probes);
            for earlier in sessions
                .iter_mut()
                .filter(|s| s.stream == stream && s.closed.is_none())
            {
                if probes.get(&earlier.id).is_some_and(hung_up) {
                    earlier.closed = Some(now);
                }
            }
            drop(probes);
            if let Some(probe) = probe {
                lock(&self.state.probes).insert(id, probe);
            }
            sessions.push(SessionRecord {
                id,
                stream: stream.clone(),
                after,
                opened: Instant::now(),
                closed: None,
                first_sent: None,
                last_sent: None,
                authorization,
            });
            sessions.len() - 1
        };
        let mut next = after.map_or(self.options.first_seq, |a| a + 1);
        let period = self.options.message_every.or_else(|| {
            (self.options.rate > 0)
                .then(|| Duration::from_secs_f64(1.0 / f64::from(self.options.rate)))
        });
        // Idle sessions tick once a day: effectively never.
        let mut tick = interval(period.unwrap_or(Duration::from_secs(86_400)));
        if period.is_none() {
            tick.tick().await;
        }
        let (ping_every, client_timeout) = match period {
            Some(_) if self.options.message_every.is_none() => (PING_INTERVAL, CLIENT_TIMEOUT),
            _ => (IDLE_PING_INTERVAL, IDLE_CLIENT_TIMEOUT),
        };
        let mut ping = interval(ping_every);
        let mut last_heard = Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let seq = next;
                    next += 1;
                    let text = format!(r#"{{"seq":{seq},"stream":"{stream}","payload":"message {seq} of {stream}"}}"#);
                    // A client that stopped reading (paused, or applying
                    // backpressure) eventually fills the socket buffers; give up then.
                    if !matches!(tokio::time::timeout(CLIENT_TIMEOUT, ws.send(Message::Text(text.into()))).await, Ok(Ok(()))) {
                        break;
                    }
                    let mut sessions = lock(&self.state.sessions);
                    let s = &mut sessions[index];
                    s.first_sent.get_or_insert_with(Instant::now);
                    s.last_sent = Some(seq);
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
        // Record the close before the socket is torn down (unless a successor
        // already found the client gone and recorded it earlier).
        lock(&self.state.sessions)[index]
            .closed
            .get_or_insert_with(Instant::now);
        lock(&self.state.probes).remove(&id);
        drop(ws);
    }
}

/// Whether the client of `socket` has hung up (its FIN or reset arrived),
/// asked of the kernel without reading anything.
fn hung_up(socket: &std::os::fd::OwnedFd) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd;
    // Linux's POLLRDHUP (the peer shut down its writing half), which nix does
    // not name. Only it is asked for, and the kernel adds POLLHUP and POLLERR
    // on its own, so any event at all means the client is gone. The count is
    // what is read: nix's `revents()` is `None` whenever a flag it does not
    // name is set, which is exactly the case here.
    let rdhup = PollFlags::from_bits_retain(0x2000);
    let mut fds = [PollFd::new(socket.as_fd(), rdhup)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    /// What orders a session's close before its successor's open: a client
    /// that closed cleanly (FIN) or with unread data (reset) reads as gone.
    #[test]
    fn a_client_that_closed_reads_as_hung_up_and_a_live_one_does_not() {
        for unread in [false, true] {
            let (mut client, mut server) = pair();
            let probe = server.as_fd().try_clone_to_owned().unwrap();
            server.write_all(b"for the client").unwrap();
            if !unread {
                let mut buf = [0u8; 14];
                client.read_exact(&mut buf).unwrap();
            }
            assert!(!hung_up(&probe), "a connected client is not gone");
            drop(client);
            let gone = std::time::Instant::now() + Duration::from_secs(2);
            while !hung_up(&probe) {
                assert!(
                    std::time::Instant::now() < gone,
                    "a client that closed (unread data: {unread}) never read as gone"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

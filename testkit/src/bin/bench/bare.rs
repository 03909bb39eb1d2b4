//! The memory floor: a bare client process holding WebSocket sessions with
//! tokio-tungstenite (+ tokio-rustls for `wss://`) and tether's own buffer
//! settings and TLS configuration, and nothing else. Run as
//! `bench bare-sessions URL_TEMPLATE [CA_FILE]`; it reads a target count per
//! line on stdin, opens sessions `bare-<i>` up to it in one burst, reads every
//! message, and answers `open N` once all N are connected. A line `count`
//! answers `count M`: the text messages read so far (the throughput
//! benchmark's bare read loop).
//!
//! With `TETHER_BENCH_FORWARD_TO=<sink URL>` it is the forwarding floor
//! instead: the simplest correct forwarder written plainly. Each session
//! reads, batches like tether's HTTP sink (up to [`FORWARD_BATCH`] messages,
//! [`FORWARD_LINGER`] after the first), and POSTs each batch as
//! `{"messages":[<message>,...]}` with the messages as they arrived (no
//! sequence number found, no token, no escaping, no checkpoint), waiting for
//! the answer before reading on. `count` then answers what the sink
//! acknowledged.

use futures::StreamExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tether::worker::{READ_BUFFER_BYTES, tls_config};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// The forwarding floor's batch: the throughput benchmark's tether spec.
pub const FORWARD_BATCH: usize = 500;
pub const FORWARD_LINGER: Duration = Duration::from_millis(5);
/// Where the forwarding floor POSTs (unset: the bare read loop).
pub const FORWARD_TO_ENV: &str = "TETHER_BENCH_FORWARD_TO";

pub async fn run(template: &str, ca: Option<&str>) -> anyhow::Result<()> {
    let tls = tls_config(ca.map(std::path::Path::new)).map_err(anyhow::Error::msg)?;
    let forward = std::env::var(FORWARD_TO_ENV).ok().map(|url| Forward {
        url,
        client: reqwest::Client::new(),
    });
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut open = 0usize;
    let mut stdout = tokio::io::stdout();
    let read = Arc::new(AtomicU64::new(0));
    while let Some(line) = lines.next_line().await? {
        if line.trim() == "count" {
            let answer = format!("count {}\n", read.load(Ordering::Relaxed));
            stdout.write_all(answer.as_bytes()).await?;
            stdout.flush().await?;
            continue;
        }
        let target: usize = line.trim().parse()?;
        let connects: Vec<_> = (open..target)
            .map(|i| {
                let url = template.replace("{name}", &format!("bare-{i:05}"));
                tokio::spawn(session(url, tls.clone(), read.clone(), forward.clone()))
            })
            .collect();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<anyhow::Result<()>>(target.max(1));
        for c in connects {
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(c.await.unwrap_or_else(|e| Err(e.into()))).await;
            });
        }
        drop(tx);
        while let Some(connected) = rx.recv().await {
            connected?;
        }
        open = target;
        stdout
            .write_all(format!("open {open}\n").as_bytes())
            .await?;
        stdout.flush().await?;
    }
    Ok(())
}

/// Connects, then reads in a task of its own for as long as the process
/// lives, counting text messages in `read`.
async fn session(
    url: String,
    tls: Arc<rustls::ClientConfig>,
    read: Arc<AtomicU64>,
    forward: Option<Forward>,
) -> anyhow::Result<()> {
    let parsed = url::Url::parse(&url)?;
    let host = parsed.host_str().unwrap_or_default().to_string();
    let port = parsed.port_or_known_default().unwrap_or(80);
    let tcp = TcpStream::connect((host.as_str(), port)).await?;
    tcp.set_nodelay(true)?;
    let config = WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(0);
    if parsed.scheme() == "wss" {
        let name = rustls::pki_types::ServerName::try_from(host)?;
        let stream = tokio_rustls::TlsConnector::from(tls)
            .connect(name, tcp)
            .await?;
        let (ws, _) =
            tokio_tungstenite::client_async_with_config(url, stream, Some(config)).await?;
        match forward {
            Some(f) => tokio::spawn(f.run(ws, read)),
            None => tokio::spawn(ws.for_each(move |m| count(m, &read))),
        };
    } else {
        let (ws, _) = tokio_tungstenite::client_async_with_config(url, tcp, Some(config)).await?;
        match forward {
            Some(f) => tokio::spawn(f.run(ws, read)),
            None => tokio::spawn(ws.for_each(move |m| count(m, &read))),
        };
    }
    Ok(())
}

/// The forwarding floor's sink.
#[derive(Clone)]
struct Forward {
    url: String,
    client: reqwest::Client,
}

impl Forward {
    /// Read, batch, POST, wait for the answer, read on; counts what the sink
    /// acknowledged in `acked`.
    async fn run<S>(self, mut ws: S, acked: Arc<AtomicU64>)
    where
        S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
    {
        loop {
            let mut body = Vec::with_capacity(64 * 1024);
            body.extend_from_slice(b"{\"messages\":[");
            let mut n = 0usize;
            let mut linger = None;
            while n < FORWARD_BATCH {
                let next = match linger {
                    None => ws.next().await,
                    Some(until) => match tokio::time::timeout_at(until, ws.next()).await {
                        Ok(next) => next,
                        Err(_) => break,
                    },
                };
                match next {
                    Some(Ok(Message::Text(text))) => {
                        if n > 0 {
                            body.push(b',');
                        }
                        body.extend_from_slice(text.as_bytes());
                        n += 1;
                        linger.get_or_insert_with(|| tokio::time::Instant::now() + FORWARD_LINGER);
                    }
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => return,
                }
            }
            body.extend_from_slice(b"]}");
            let sent = self
                .client
                .post(&self.url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await;
            match sent {
                Ok(r) if r.status().is_success() => {
                    acked.fetch_add(n as u64, Ordering::Relaxed);
                }
                _ => return,
            }
        }
    }
}

fn count(
    message: Result<Message, tokio_tungstenite::tungstenite::Error>,
    read: &AtomicU64,
) -> std::future::Ready<()> {
    if matches!(message, Ok(Message::Text(_))) {
        read.fetch_add(1, Ordering::Relaxed);
    }
    std::future::ready(())
}

/// The bench's side of a `bench bare-sessions` process: a line asked on its
/// stdin, a line answered on its stdout.
pub struct BareClient {
    child: tokio::process::Child,
    stdin: tokio::sync::Mutex<tokio::process::ChildStdin>,
    lines: tokio::sync::Mutex<tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>>,
}

impl BareClient {
    /// Starts the client for `template` (trusting `ca` for `wss://`), on
    /// `cpu` alone when given (`taskset`).
    pub fn spawn(template: &str, ca: Option<&str>, cpu: Option<usize>) -> anyhow::Result<Self> {
        Self::spawn_forwarding(template, ca, cpu, None)
    }

    /// As [`BareClient::spawn`]; with `forward_to`, the forwarding floor
    /// posting to that sink.
    pub fn spawn_forwarding(
        template: &str,
        ca: Option<&str>,
        cpu: Option<usize>,
        forward_to: Option<&str>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let exe = std::env::current_exe()?;
        let mut cmd = match cpu {
            Some(cpu) => {
                let mut c = tokio::process::Command::new("taskset");
                c.arg("-c").arg(cpu.to_string()).arg(exe);
                c
            }
            None => tokio::process::Command::new(exe),
        };
        cmd.arg("bare-sessions").arg(template);
        if let Some(ca) = ca {
            cmd.arg(ca);
        }
        if let Some(sink) = forward_to {
            cmd.env(FORWARD_TO_ENV, sink);
        }
        let mut child = cmd
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().context("bare client stdin")?;
        let stdout = child.stdout.take().context("bare client stdout")?;
        Ok(Self {
            child,
            stdin: tokio::sync::Mutex::new(stdin),
            lines: tokio::sync::Mutex::new(tokio::io::BufReader::new(stdout).lines()),
        })
    }

    pub fn pid(&self) -> anyhow::Result<u32> {
        anyhow::Context::context(self.child.id(), "bare client pid")
    }

    /// Opens sessions up to `target` in one burst and waits until all are open.
    pub async fn open(&self, target: usize) -> anyhow::Result<()> {
        let answer = self.ask(&target.to_string()).await?;
        anyhow::ensure!(answer == format!("open {target}"), "bare client: {answer}");
        Ok(())
    }

    /// Text messages read so far, over all sessions.
    pub async fn count(&self) -> anyhow::Result<u64> {
        let answer = self.ask("count").await?;
        anyhow::Context::with_context(
            answer.strip_prefix("count ").and_then(|c| c.parse().ok()),
            || format!("bare client: {answer}"),
        )
    }

    async fn ask(&self, line: &str) -> anyhow::Result<String> {
        let mut stdin = self.stdin.lock().await;
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        let answer = self.lines.lock().await.next_line().await?;
        Ok(answer.unwrap_or_default())
    }
}

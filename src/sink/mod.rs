//! Sinks: where a stream's messages go. A sink acknowledges a batch, refuses
//! part of it, or fails it; the checkpoint only ever advances past
//! acknowledged messages, and every payload carries the fencing token.

mod clients;
mod encode;
mod http;
mod kinesis;
mod log;
mod nats;

pub use clients::SinkClients;
pub use encode::{batch_json, record_json};
pub use http::{FENCED_HEADER, HttpSink};
pub use kinesis::KinesisSink;
pub use log::LogSink;
pub use nats::{CONNECTION_HEADER, NatsSink, SEQ_HEADER, TOKEN_HEADER, WORKER_HEADER};

use crate::crd::SinkSpec;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// One message read from an upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub seq: u64,
    /// The text as it arrived, sharing the frame's buffer: nothing is copied
    /// between the socket and the sink's encoder.
    pub data: Text,
}

/// Message text: UTF-8 in shared bytes (tungstenite's own text type).
pub use tokio_tungstenite::tungstenite::Utf8Bytes as Text;

/// The payload every sink receives. `token` is the lease's fencing token, so a
/// sink can reject deliveries from an owner that has been superseded. Its
/// JSON is written by `encode`.
#[derive(Debug)]
pub struct Batch<'a> {
    pub connection: &'a str,
    pub worker: &'a str,
    pub token: u64,
    pub messages: &'a [Message],
}

#[derive(Debug, Error)]
pub enum SinkError {
    #[error("sink answered HTTP {status}")]
    Status { status: u16 },
    #[error("sink refused the fencing token (HTTP 409, Tether-Fenced: true): a newer owner exists")]
    Fenced,
    #[error("sink unreachable: {0}")]
    Transport(String),
    #[error("sink throttled the request: {0}")]
    Throttled(String),
    #[error("sink refused the request: {0}")]
    Refused(String),
    /// Some messages were accepted and some not: `failed` are the refused
    /// ones' indices in the batch, ascending. Only those are sent again.
    #[error("sink refused {} of {total} messages: {detail}", failed.len())]
    Partial {
        failed: Vec<usize>,
        total: usize,
        detail: String,
    },
    #[error("cannot write to standard output: {0}")]
    Io(#[from] std::io::Error),
}

impl SinkError {
    /// A fixed label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Status { .. } => "status",
            Self::Fenced => "fenced",
            Self::Transport(_) => "transport",
            Self::Throttled(_) => "throttled",
            Self::Refused(_) => "refused",
            Self::Partial { .. } => "partial",
            Self::Io(_) => "io",
        }
    }
}

/// The log sink writes what it has at once, up to 64 lines.
const LOG_BATCHING: Batching = Batching {
    max_batch: 64,
    linger: Duration::ZERO,
    timeout: Duration::MAX,
};

/// How a batching sink groups messages: most per batch, how long a partial
/// batch waits for more, and the bound on one request.
#[derive(Clone, Copy, Debug)]
pub struct Batching {
    pub max_batch: usize,
    pub linger: Duration,
    pub timeout: Duration,
}

impl Batching {
    pub fn new(max_batch: u32, linger_ms: u32, timeout_seconds: u32) -> Self {
        Self {
            max_batch: max_batch.max(1) as usize,
            linger: Duration::from_millis(linger_ms.into()),
            timeout: Duration::from_secs(timeout_seconds.max(1).into()),
        }
    }
}

/// A configured sink.
pub enum Sink {
    Http(HttpSink),
    Log(LogSink),
    Kinesis(KinesisSink),
    // Boxed: its settings are large and the enum lives in every session.
    Nats(Box<NatsSink>),
}

impl Sink {
    /// Builds the sink a spec asks for, sharing the worker's clients. The
    /// spec has been validated, so exactly one sink is set; `log` is the
    /// fallback. Nothing is dialled here: connections open at delivery, so a
    /// sink that is down is retried like any failed delivery.
    pub fn from_spec(spec: &SinkSpec, namespace: &str, clients: &Arc<SinkClients>) -> Self {
        if let Some(http) = &spec.http {
            Self::Http(HttpSink::new(clients.http.clone(), http))
        } else if let Some(kinesis) = &spec.kinesis {
            Self::Kinesis(KinesisSink::new(clients.clone(), kinesis))
        } else if let Some(nats) = &spec.nats {
            Self::Nats(Box::new(NatsSink::new(clients.clone(), namespace, nats)))
        } else {
            Self::Log(LogSink)
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Http(_) => "http",
            Self::Log(_) => "log",
            Self::Kinesis(_) => "kinesis",
            Self::Nats(_) => "nats",
        }
    }

    /// How this sink batches (the log sink: up to 64 lines at once, no wait).
    pub fn batching(&self) -> Batching {
        match self {
            Self::Http(s) => s.batching,
            Self::Log(_) => LOG_BATCHING,
            Self::Kinesis(s) => s.batching,
            Self::Nats(s) => s.batching,
        }
    }

    /// How long after sending a request the sink may still apply it: its
    /// timeout, which the sink contract asks sinks not to outlive (a sink
    /// that checks tokens needs no such promise). `None` for the log sink,
    /// which writes before it returns.
    pub fn settle_bound(&self) -> Option<Duration> {
        match self {
            Self::Log(_) => None,
            _ => Some(self.batching().timeout),
        }
    }

    /// Most messages per batch.
    pub fn max_batch(&self) -> usize {
        self.batching().max_batch
    }

    /// How long a partial batch waits for more messages.
    pub fn linger(&self) -> Duration {
        self.batching().linger
    }

    /// Delivers one batch; `Ok` means the sink acknowledged all of it.
    pub async fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        match self {
            Self::Http(s) => s.deliver(batch).await,
            Self::Log(s) => s.deliver(batch),
            Self::Kinesis(s) => s.deliver(batch).await,
            Self::Nats(s) => s.deliver(batch).await,
        }
    }
}

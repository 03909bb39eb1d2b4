//! Sinks: where a stream's messages go. A sink acknowledges a batch or fails it;
//! the checkpoint only ever advances past acknowledged messages.

mod http;
mod log;

pub use http::{FENCED_HEADER, HttpSink};
pub use log::LogSink;

use crate::crd::SinkSpec;
use serde::Serialize;
use std::time::Duration;
use thiserror::Error;

/// One message read from an upstream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    pub seq: u64,
    pub data: String,
}

/// The payload every sink receives. `token` is the lease's fencing token, so a
/// sink can reject deliveries from an owner that has been superseded.
#[derive(Debug, Serialize)]
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
            Self::Io(_) => "io",
        }
    }
}

/// A configured sink.
pub enum Sink {
    Http(HttpSink),
    Log(LogSink),
}

impl Sink {
    /// Builds the sink a spec asks for, sharing the worker's HTTP client.
    /// The spec has been validated, so exactly one sink is set; `log` is the fallback.
    pub fn from_spec(spec: &SinkSpec, client: &reqwest::Client) -> Self {
        match &spec.http {
            Some(http) => Self::Http(HttpSink::new(client.clone(), http)),
            None => Self::Log(LogSink),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Http(_) => "http",
            Self::Log(_) => "log",
        }
    }

    /// Most messages per batch.
    pub fn max_batch(&self) -> usize {
        match self {
            Self::Http(s) => s.max_batch(),
            Self::Log(_) => 64,
        }
    }

    /// How long a partial batch waits for more messages.
    pub fn linger(&self) -> Duration {
        match self {
            Self::Http(s) => s.linger(),
            Self::Log(_) => Duration::ZERO,
        }
    }

    /// Delivers one batch; `Ok` means the sink acknowledged all of it.
    pub async fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        match self {
            Self::Http(s) => s.deliver(batch).await,
            Self::Log(s) => s.deliver(batch),
        }
    }
}

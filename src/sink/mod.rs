//! Sinks: where a stream's messages go. A sink acknowledges a batch, refuses
//! part of it, or fails it; the checkpoint only ever advances past
//! acknowledged messages, and every payload carries the fencing token.

mod batch;
mod clients;
mod encode;
mod http;
mod json_bytes;
mod kinesis;
mod log;
mod nats;

use batch::LOG_BATCHING;
pub use batch::{Batch, Batching, Message, Messages, Pending, SinkError};
pub use clients::SinkClients;
pub use encode::{batch_json, record_json};
pub use http::{FENCED_HEADER, HttpSink};
pub use kinesis::KinesisSink;
pub use log::LogSink;
pub use nats::{CONNECTION_HEADER, NatsSink, SEQ_HEADER, TOKEN_HEADER, WORKER_HEADER};

use crate::crd::{DataFormat, SinkSpec};
use std::sync::Arc;
use std::time::Duration;

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

    /// How messages travel: a sink that takes them as JSON values is given
    /// only messages that are JSON (the session checks).
    pub fn data_format(&self) -> DataFormat {
        match self {
            Self::Http(s) => s.data_format,
            Self::Kinesis(s) => s.data_format,
            Self::Log(_) | Self::Nats(_) => DataFormat::String,
        }
    }

    /// An empty batch for this sink's deliveries from `connection` by
    /// `worker` under `token`: the HTTP sink's is written as its body while
    /// the messages arrive ([`Pending::http_body`]), each message copied or
    /// escaped once, straight from its frame, as a plain forwarder copies
    /// it; the others hold texts.
    pub fn new_batch(&self, connection: &str, worker: &str, token: u64) -> Pending {
        match self {
            Self::Http(s) => Pending::http_body(connection, worker, token, s.data_format),
            _ => Pending::default(),
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

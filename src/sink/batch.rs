//! What a sink is given and what it answers: one batch of messages under a
//! fencing token, how batches are sized and bounded, and the ways a delivery
//! fails. Every sink shares these; none owns them.

use bytes::{Bytes, BytesMut};
use std::time::Duration;
use thiserror::Error;

/// One message read from an upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub seq: u64,
    pub data: Text,
}

/// Message text: UTF-8 in shared bytes. Only built from `str`s, so always
/// UTF-8, without checking it again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Text(Bytes);

impl Text {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes, shared, for a sink whose payload is the raw text.
    pub fn to_bytes(&self) -> Bytes {
        self.0.clone()
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Self(Bytes::from(s.into_bytes()))
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self(Bytes::copy_from_slice(s.as_bytes()))
    }
}

/// Where a session keeps the text of messages read and not yet delivered:
/// each message is copied out of the frame into a block shared by the batch.
/// Keeping the frame itself (it shares the socket's read buffer) left that
/// buffer shared, so tungstenite allocated and zeroed a new one on every
/// refill: allocator work and `memset` that cost more than the copy.
#[derive(Debug, Default)]
pub struct TextArena(BytesMut);

impl TextArena {
    /// The least a new block holds: a few small messages' worth, so a busy
    /// session allocates once per dozens of messages and a quiet one little.
    const BLOCK: usize = 8 * 1024;

    pub fn copy(&mut self, text: &str) -> Text {
        if self.0.capacity() < text.len() {
            // A new block: the full one stays alive as long as its messages.
            self.0.reserve(text.len().max(Self::BLOCK));
        }
        self.0.extend_from_slice(text.as_bytes());
        Text(self.0.split().freeze())
    }

    /// Lets the block go once nothing in it is waiting: an idle session
    /// keeps none.
    pub fn release(&mut self) {
        self.0 = BytesMut::new();
    }
}

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
    #[error("sink answered HTTP {status}{}", redirect_note(.status))]
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
pub(super) const LOG_BATCHING: Batching = Batching {
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

/// Redirects are not followed (a `Location` would bypass the host policy):
/// a 3xx says so, so the stream's status tells the user what to change.
fn redirect_note(status: &u16) -> &'static str {
    if (300..400).contains(status) {
        " (a redirect: sinks are not redirected; give the sink's final URL)"
    } else {
        ""
    }
}

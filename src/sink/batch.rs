//! What a sink is given and what it answers: one batch of messages under a
//! fencing token, how batches are sized and bounded, and the ways a delivery
//! fails. Every sink shares these; none owns them.

use std::time::Duration;
use thiserror::Error;

/// One message read from an upstream, as a sink sees it: its sequence
/// number and its text, borrowed from the session's [`Pending`] messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    pub seq: u64,
    pub data: &'a str,
}

/// The messages a session has read and not yet delivered: their texts one
/// after another in one buffer, and per message its sequence number and
/// where its text lies. Nothing per message is allocated or reference
/// counted: keeping each message as shared bytes (a `Bytes` split off a
/// block, dropped once delivered) cost a saturated session more than
/// copying its text did, and keeping the frames themselves kept the socket's
/// read buffer shared, so tungstenite allocated and zeroed a new one on
/// every refill.
#[derive(Debug, Default)]
pub struct Pending {
    text: String,
    entries: Vec<Entry>,
    /// Bytes the last batch held, reserved at once by the next one's first
    /// message: a busy session's buffer is not grown (and copied) step by
    /// step, and an idle one's stays small.
    last_bytes: usize,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    seq: u64,
    start: usize,
    end: usize,
}

impl Pending {
    /// The least the buffer starts with: a few small messages' worth.
    const FIRST_RESERVE: usize = 1024;

    pub fn push(&mut self, seq: u64, text: &str) {
        if self.text.capacity() == 0 {
            self.text
                .reserve(self.last_bytes.max(text.len()).max(Self::FIRST_RESERVE));
        }
        let start = self.text.len();
        self.text.push_str(text);
        self.entries.push(Entry {
            seq,
            start,
            end: self.text.len(),
        });
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `i`th message.
    ///
    /// # Panics
    /// When there are `i` messages or fewer.
    pub fn get(&self, i: usize) -> Message<'_> {
        self.message(&self.entries[i])
    }

    pub fn first(&self) -> Option<Message<'_>> {
        self.entries.first().map(|e| self.message(e))
    }

    pub fn last(&self) -> Option<Message<'_>> {
        self.entries.last().map(|e| self.message(e))
    }

    pub fn iter(&self) -> Messages<'_> {
        Messages {
            pending: self,
            entries: self.entries.iter(),
        }
    }

    /// Bytes of text held (what the messages' texts add up to, or more when
    /// some were dropped by [`Pending::keep_only`]).
    pub fn text_bytes(&self) -> usize {
        self.text.len()
    }

    /// Keeps only the messages at `indices` (ascending), in order: a sink
    /// that took the others is given these again. Their text stays where it
    /// is until the batch is cleared.
    pub fn keep_only(&mut self, indices: &[usize]) {
        let mut index = 0;
        self.entries.retain(|_| {
            let keep = indices.binary_search(&index).is_ok();
            index += 1;
            keep
        });
    }

    /// Empties the batch and keeps the buffers for the next one (a busy
    /// session).
    pub fn clear(&mut self) {
        if !self.text.is_empty() {
            self.last_bytes = self.text.len();
        }
        self.text.clear();
        self.entries.clear();
    }

    /// Empties the batch and lets the buffers go: an idle session keeps none.
    pub fn release(&mut self) {
        self.clear();
        self.text = String::new();
        self.entries = Vec::new();
    }

    fn message(&self, e: &Entry) -> Message<'_> {
        Message {
            seq: e.seq,
            data: &self.text[e.start..e.end],
        }
    }
}

impl<'a> IntoIterator for &'a Pending {
    type Item = Message<'a>;
    type IntoIter = Messages<'a>;

    fn into_iter(self) -> Messages<'a> {
        self.iter()
    }
}

impl<'a> FromIterator<Message<'a>> for Pending {
    fn from_iter<I: IntoIterator<Item = Message<'a>>>(messages: I) -> Self {
        let mut pending = Self::default();
        for m in messages {
            pending.push(m.seq, m.data);
        }
        pending
    }
}

/// The messages of a [`Pending`] batch, in order.
pub struct Messages<'a> {
    pending: &'a Pending,
    entries: std::slice::Iter<'a, Entry>,
}

impl<'a> Iterator for Messages<'a> {
    type Item = Message<'a>;

    fn next(&mut self) -> Option<Message<'a>> {
        self.entries.next().map(|e| self.pending.message(e))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.entries.size_hint()
    }
}

impl ExactSizeIterator for Messages<'_> {}

/// The payload every sink receives. `token` is the lease's fencing token, so a
/// sink can reject deliveries from an owner that has been superseded. Its
/// JSON is written by `encode`.
#[derive(Debug)]
pub struct Batch<'a> {
    pub connection: &'a str,
    pub worker: &'a str,
    pub token: u64,
    pub messages: &'a Pending,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn of(messages: &[(u64, &str)]) -> Pending {
        messages
            .iter()
            .map(|&(seq, data)| Message { seq, data })
            .collect()
    }

    fn all(pending: &Pending) -> Vec<(u64, String)> {
        pending
            .iter()
            .map(|m| (m.seq, m.data.to_string()))
            .collect()
    }

    #[test]
    fn messages_come_back_in_order_with_their_text() {
        let texts = ["", "a", "é, 漢字, 😀", r#"{"seq":3}"#];
        let pending = of(&[(7, texts[0]), (8, texts[1]), (9, texts[2]), (3, texts[3])]);
        assert_eq!(pending.len(), 4);
        assert_eq!(pending.iter().len(), 4);
        assert_eq!(
            all(&pending),
            vec![
                (7, String::new()),
                (8, "a".into()),
                (9, texts[2].into()),
                (3, texts[3].into())
            ]
        );
        assert_eq!(pending.first().map(|m| m.seq), Some(7));
        assert_eq!(pending.last().map(|m| m.data), Some(texts[3]));
        assert_eq!(pending.get(2).data, texts[2]);
        assert_eq!(
            pending.text_bytes(),
            texts.iter().map(|t| t.len()).sum::<usize>()
        );
    }

    #[test]
    fn a_partial_retry_keeps_exactly_the_refused_messages_in_order() {
        let mut pending = of(&[(1, "one"), (2, "two"), (3, "three"), (4, "four")]);
        pending.keep_only(&[1, 3]);
        assert_eq!(all(&pending), vec![(2, "two".into()), (4, "four".into())]);
        pending.keep_only(&[1]);
        assert_eq!(all(&pending), vec![(4, "four".into())]);
        pending.keep_only(&[]);
        assert!(pending.is_empty());
    }

    #[test]
    fn a_batch_cleared_keeps_its_buffer_and_one_released_lets_it_go() {
        let mut pending = of(&[(1, &"x".repeat(5000))]);
        pending.clear();
        assert!(pending.is_empty());
        assert!(pending.text.capacity() >= 5000, "kept for a busy session");
        pending.push(2, "y");
        assert_eq!(all(&pending), vec![(2, "y".into())]);
        pending.release();
        assert_eq!(pending.text.capacity(), 0, "an idle session holds nothing");
        assert_eq!(pending.entries.capacity(), 0);
        // The next batch reserves what the last one held, at once.
        pending.push(3, "z");
        assert!((1..5000).contains(&pending.text.capacity()));
        assert_eq!(all(&pending), vec![(3, "z".into())]);
        pending.push(4, &"w".repeat(3000));
        pending.clear();
        pending.release();
        pending.push(5, "v");
        assert!(pending.text.capacity() >= 3001, "what the last batch held");
    }
}

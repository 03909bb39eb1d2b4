//! What a sink is given and what it answers: one batch of messages under a
//! fencing token, how batches are sized and bounded, and the ways a delivery
//! fails. Every sink shares these; none owns them.

use super::json_bytes;
use crate::crd::DataFormat;
use bytes::Bytes;
use std::time::Duration;
use thiserror::Error;

/// One message read from an upstream, as a sink sees it: its sequence
/// number and its text, borrowed from the session's [`Pending`] messages
/// (in a batch written as an HTTP body, its entry in that body).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    pub seq: u64,
    pub data: &'a str,
}

/// The messages a session has read and not yet delivered, and per message
/// its sequence number and where it lies. Nothing per message is allocated
/// or reference counted: keeping each message as shared bytes (a `Bytes`
/// split off a block, dropped once delivered) cost a saturated session more
/// than copying its text did, and keeping the frames themselves kept the
/// socket's read buffer shared, so tungstenite allocated and zeroed a new
/// one on every refill.
///
/// A batch holds its messages' texts one after another, or the HTTP
/// request body itself ([`Pending::http_body`]), each message written into
/// it as its entry straight from its frame: a text copied into the batch
/// and copied again into a body at delivery was the one copy per message a
/// plain forwarder does not make. Which one a sink's batches use is
/// `Sink::new_batch`'s choice.
#[derive(Debug, Default)]
pub struct Pending {
    text: String,
    entries: Vec<Entry>,
    /// Bytes the last batch held (its texts, or its whole body), reserved at
    /// once by the next one's first message (a body a quarter more): a busy
    /// session's buffer is not grown (and copied) step by step, and an idle
    /// one's stays small.
    last_bytes: usize,
    /// Set when the batch is written as the HTTP sink's body.
    body: Option<Box<Body>>,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    seq: u64,
    start: usize,
    end: usize,
}

/// An HTTP body written as its messages arrive.
#[derive(Debug)]
struct Body {
    /// Everything before the first entry (the stream, the worker, the token).
    head: Box<[u8]>,
    format: DataFormat,
    /// The body so far: the head and the entries, comma-separated.
    bytes: Vec<u8>,
    /// The finished body ([`Pending::seal`]), shared with a request in
    /// flight; `bytes` is empty meanwhile.
    sealed: Option<Bytes>,
}

impl Body {
    fn held(&self) -> &[u8] {
        self.sealed.as_deref().unwrap_or(&self.bytes)
    }
}

impl Pending {
    /// The least the buffer starts with: a few small messages' worth.
    const FIRST_RESERVE: usize = 1024;

    /// A batch written as the HTTP sink's body, `{"connection":…,"worker":…,
    /// "token":…,"messages":[…]}`, each message an entry in `format`. Its
    /// messages' [`Message::data`] is their entry, not their text.
    pub fn http_body(connection: &str, worker: &str, token: u64, format: DataFormat) -> Self {
        Self {
            body: Some(Box::new(Body {
                head: json_bytes::body_head(connection, worker, token).into_boxed_slice(),
                format,
                bytes: Vec::new(),
                sealed: None,
            })),
            ..Self::default()
        }
    }

    pub fn push(&mut self, seq: u64, text: &str) {
        let (start, end) = match self.body.as_deref_mut() {
            None => {
                if self.text.capacity() == 0 {
                    self.text
                        .reserve(self.last_bytes.max(text.len()).max(Self::FIRST_RESERVE));
                }
                let start = self.text.len();
                self.text.push_str(text);
                (start, self.text.len())
            }
            Some(body) => {
                // Added to after it was sealed (no session does that): the
                // body is opened again, so what is sent next holds every
                // message the batch does.
                if let Some(sealed) = body.sealed.take() {
                    body.bytes = Vec::from(sealed);
                    body.bytes
                        .truncate(body.bytes.len() - json_bytes::BODY_TAIL.len());
                }
                if body.bytes.is_empty() {
                    // A quarter more than the last body held (or this
                    // message), and with the default format the escaper's
                    // room for this message: a busy session's body is not
                    // copied into a larger buffer near its end. (The body is
                    // sent from this buffer, so the spare room is held while
                    // it is in flight.)
                    let entries = (self.last_bytes + self.last_bytes / 4)
                        .max(text.len() + 64)
                        .max(Self::FIRST_RESERVE);
                    let room = match body.format {
                        DataFormat::String => json_bytes::escape_room(text.len()),
                        DataFormat::Json => 0,
                    };
                    body.bytes.reserve(body.head.len() + entries + room);
                    body.bytes.extend_from_slice(&body.head);
                } else {
                    body.bytes.push(b',');
                }
                let start = body.bytes.len();
                json_bytes::push_entry(&mut body.bytes, seq, text, body.format);
                (start, body.bytes.len())
            }
        };
        self.entries.push(Entry { seq, start, end });
    }

    /// Finishes a batch written as a body, for delivery: [`Pending::body`]
    /// answers from now until the batch is cleared or a partial retry
    /// changes it. Nothing for a batch of texts, or when already sealed.
    pub fn seal(&mut self) {
        if let Some(body) = self.body.as_deref_mut()
            && body.sealed.is_none()
            && !self.entries.is_empty()
        {
            let mut bytes = std::mem::take(&mut body.bytes);
            bytes.extend_from_slice(json_bytes::BODY_TAIL);
            self.last_bytes = bytes.len();
            // The buffer itself, not a copy.
            body.sealed = Some(Bytes::from(bytes));
        }
    }

    /// The finished HTTP body of a sealed batch ([`Pending::seal`]).
    pub fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()?.sealed.as_ref()
    }

    /// A copy of the body a batch written as one holds, finished, sealed or
    /// not (`None` for a batch of texts).
    pub fn body_copy(&self) -> Option<Vec<u8>> {
        let body = self.body.as_deref()?;
        if let Some(sealed) = &body.sealed {
            return Some(sealed.to_vec());
        }
        let mut out = if self.entries.is_empty() {
            body.head.to_vec()
        } else {
            body.bytes.clone()
        };
        out.extend_from_slice(json_bytes::BODY_TAIL);
        Some(out)
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
    /// some were dropped by [`Pending::keep_only`]); a batch written as a
    /// body holds none (its size is its body's).
    pub fn text_bytes(&self) -> usize {
        self.text.len()
    }

    /// Keeps only the messages at `indices` (ascending), in order: a sink
    /// that took the others is given these again. Texts stay where they are
    /// until the batch is cleared; a body is written again with the kept
    /// entries alone (and sealed again before it is sent).
    pub fn keep_only(&mut self, indices: &[usize]) {
        let mut index = 0;
        self.entries.retain(|_| {
            let keep = indices.binary_search(&index).is_ok();
            index += 1;
            keep
        });
        let Some(body) = self.body.as_deref_mut() else {
            return;
        };
        let old = body
            .sealed
            .take()
            .map_or_else(|| std::mem::take(&mut body.bytes), Vec::from);
        body.bytes = Vec::with_capacity(old.len());
        for (i, e) in self.entries.iter_mut().enumerate() {
            if i == 0 {
                body.bytes.extend_from_slice(&body.head);
            } else {
                body.bytes.push(b',');
            }
            let start = body.bytes.len();
            body.bytes.extend_from_slice(&old[e.start..e.end]);
            (e.start, e.end) = (start, body.bytes.len());
        }
    }

    /// Empties the batch and keeps the buffers for the next one (a busy
    /// session). A body sent is not kept: it belongs to the request until
    /// that is done with it, and the next is reserved at its size at once.
    pub fn clear(&mut self) {
        match self.body.as_deref_mut() {
            None if !self.text.is_empty() => self.last_bytes = self.text.len(),
            None => {}
            Some(body) => {
                if !body.bytes.is_empty() {
                    self.last_bytes = body.bytes.len();
                }
                body.sealed = None;
                body.bytes.clear();
            }
        }
        self.text.clear();
        self.entries.clear();
    }

    /// Empties the batch and lets the buffers go: an idle session keeps none.
    pub fn release(&mut self) {
        self.clear();
        self.text = String::new();
        self.entries = Vec::new();
        if let Some(body) = self.body.as_deref_mut() {
            body.bytes = Vec::new();
        }
    }

    fn message(&self, e: &Entry) -> Message<'_> {
        let data = match &self.body {
            None => &self.text[e.start..e.end],
            // Entries are JSON written from text, so UTF-8 throughout.
            Some(body) => std::str::from_utf8(&body.held()[e.start..e.end]).unwrap_or_default(),
        };
        Message { seq: e.seq, data }
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

    /// The body a session's HTTP batch is written as, against the body
    /// `batch_json` writes from the same messages held as texts.
    fn body_of_texts(messages: &[(u64, &str)], format: DataFormat) -> Vec<u8> {
        let texts = of(messages);
        let batch = Batch {
            connection: "ns/na\"me",
            worker: "w-1\\x",
            token: u64::MAX,
            messages: &texts,
        };
        crate::sink::batch_json(&batch, format)
    }

    fn as_body(messages: &[(u64, &str)], format: DataFormat) -> Pending {
        let mut pending = Pending::http_body("ns/na\"me", "w-1\\x", u64::MAX, format);
        for &(seq, text) in messages {
            pending.push(seq, text);
        }
        pending
    }

    #[test]
    fn a_batch_written_as_its_body_is_the_body_of_its_texts() {
        let strings = crate::sink::json_bytes::tests::strings();
        let as_strings: Vec<(u64, &str)> = strings
            .iter()
            .enumerate()
            .map(|(i, s)| (i as u64 * 1_000_003, s.as_str()))
            .collect();
        let values = [
            r#"{"seq":1,"payload":"a \"quoted\" \\ value"}"#,
            r#" [1, 2.5e3, null, true, "\u00e9 é 😀"] "#,
            "17",
            r#"{"nested":{"deep":[{"x":"\n"}]},"seq":18446744073709551615}"#,
        ];
        let as_values: Vec<(u64, &str)> = values.iter().map(|&v| (3, v)).collect();
        for (format, messages) in [
            (DataFormat::String, &as_strings[..]),
            (DataFormat::Json, &as_values[..]),
        ] {
            let mut pending = Pending::http_body("ns/na\"me", "w-1\\x", u64::MAX, format);
            // Several batches in turn through the same one, as a session's.
            for some in [messages, &messages[..1], messages, &messages[2..3]] {
                for &(seq, text) in some {
                    pending.push(seq, text);
                }
                assert_eq!(pending.len(), some.len());
                assert_eq!(pending.body(), None, "not before it is sealed");
                pending.seal();
                pending.seal();
                let body = pending.body().expect("sealed").clone();
                assert_eq!(&body[..], &body_of_texts(some, format)[..], "{format:?}");
                assert_eq!(pending.last().map(|m| m.seq), some.last().map(|m| m.0));
                pending.clear();
                assert!(pending.is_empty() && pending.body().is_none());
                // The request that was sent keeps its body.
                assert_eq!(&body[..], &body_of_texts(some, format)[..]);
            }
            pending.release();
            pending.push(5, messages[0].1);
            pending.seal();
            assert_eq!(
                &pending.body().unwrap()[..],
                &body_of_texts(&[(5, messages[0].1)], format)[..]
            );
        }
    }

    #[test]
    fn a_body_sealed_is_its_buffer_and_the_next_one_is_not_grown_while_written() {
        let text = r#"{"seq":1,"payload":"a \"quoted\" value, then some more text to fill it"}"#;
        let mut pending = Pending::http_body("ns/name", "w-1", 7, DataFormat::String);
        for round in 0..3 {
            pending.push(0, text);
            let first = pending.body.as_ref().unwrap().bytes.as_ptr();
            for seq in 1..150 {
                pending.push(seq, text);
            }
            let buffer = pending.body.as_ref().unwrap().bytes.as_ptr();
            if round > 0 {
                assert_eq!(first, buffer, "reserved at the last body's size");
            }
            pending.seal();
            assert_eq!(
                pending.body().unwrap().as_ptr(),
                buffer,
                "sealed without a copy"
            );
            pending.clear();
        }
        pending.release();
        assert_eq!(pending.body.as_ref().unwrap().bytes.capacity(), 0);
        assert_eq!(
            pending.entries.capacity(),
            0,
            "an idle session holds nothing"
        );
    }

    #[test]
    fn a_partial_retry_of_a_body_sends_the_refused_entries_alone() {
        let messages = [(1, "one"), (2, "t\"wo"), (3, "three"), (4, "four")];
        for sealed in [false, true] {
            let mut pending = as_body(&messages, DataFormat::String);
            if sealed {
                pending.seal();
            }
            pending.keep_only(&[1, 3]);
            assert_eq!(pending.body(), None, "sealed again before it is sent");
            pending.seal();
            assert_eq!(
                &pending.body().unwrap()[..],
                &body_of_texts(&[messages[1], messages[3]], DataFormat::String)[..]
            );
            pending.keep_only(&[1]);
            pending.seal();
            assert_eq!(
                &pending.body().unwrap()[..],
                &body_of_texts(&[messages[3]], DataFormat::String)[..]
            );
            assert_eq!(pending.get(0).seq, 4);
        }
    }

    /// A message added after the batch was sealed (no session does that)
    /// is in the body sent next, as every message the batch holds is; and
    /// the body's copy is the body, sealed or not.
    #[test]
    fn a_body_added_to_after_it_was_sealed_holds_every_message() {
        let messages = [(1, "one"), (2, "t\"wo"), (3, "three")];
        let mut pending = as_body(&messages[..2], DataFormat::String);
        assert_eq!(
            pending.body_copy().unwrap(),
            body_of_texts(&messages[..2], DataFormat::String)
        );
        pending.seal();
        pending.push(messages[2].0, messages[2].1);
        assert_eq!(pending.body(), None);
        let whole = body_of_texts(&messages, DataFormat::String);
        assert_eq!(pending.body_copy().unwrap(), whole);
        pending.seal();
        assert_eq!(&pending.body().unwrap()[..], &whole[..]);
        assert_eq!(pending.body_copy().unwrap(), whole);
        assert_eq!(pending.get(2).seq, 3);
        let empty = Pending::http_body("ns/na\"me", "w-1\\x", u64::MAX, DataFormat::Json);
        assert_eq!(
            empty.body_copy().unwrap(),
            body_of_texts(&[], DataFormat::Json)
        );
    }

    /// Copied as a value, a message needs no room for escaping: a 1 MiB
    /// value's body holds about its size.
    #[test]
    fn a_body_of_values_keeps_no_room_for_escaping() {
        let value = format!("\"{}\"", "0123456789abcdef".repeat(64 * 1024));
        let pending = as_body(&[(1, &value)], DataFormat::Json);
        let held = pending.body.as_ref().unwrap().bytes.capacity();
        assert!(
            held < value.len() + 1024,
            "{held} bytes held for a {}-byte value",
            value.len()
        );
    }

    /// The escaper's room is bounded (`json_bytes::push_str`): a 1 MiB
    /// message's body is not several times its size while in flight.
    #[test]
    fn a_long_message_does_not_make_a_body_many_times_its_size() {
        let text = "0123456789abcdef".repeat(64 * 1024);
        let mut pending = as_body(&[(1, &text)], DataFormat::String);
        let held = pending.body.as_ref().unwrap().bytes.capacity();
        assert!(
            held < 2 * text.len(),
            "{held} bytes held for a {}-byte message",
            text.len()
        );
        pending.seal();
        let body = pending.body().unwrap();
        assert!(body.len() > text.len() && body.len() < text.len() + 1024);
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

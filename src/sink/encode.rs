//! The JSON the sinks send, written straight into a buffer: the HTTP batch
//! body and the self-describing record of log lines and Kinesis records.
//!
//! The bytes are exactly what `serde_json` writes for the same values (the
//! tests hold it to that), but the message text — almost all of every
//! payload — is escaped by a SIMD escaper ([`push_str`]): a saturated
//! session spent a fifth of its CPU in `serde_json`'s byte-at-a-time string
//! escaper, and a record no longer builds a `serde_json::Value` (a map and a
//! copy of the text) per message. With [`DataFormat::Json`] the text is not
//! escaped at all: the session has checked it is JSON, so it is copied in as
//! a value.
//! Integers go through `itoa`, not `core::fmt` (a few percent of a
//! saturated session).

use super::batch::{Batch, Message};
use crate::crd::DataFormat;

/// `{"connection":…,"worker":…,"token":…,"messages":[{"seq":…,"data":…},…]}`,
/// the HTTP sink's body (the stream contract's field order); with
/// [`DataFormat::Json`] each entry is `{"seq":…,"json":…}`.
pub fn batch_json(batch: &Batch<'_>, format: DataFormat) -> Vec<u8> {
    let text = batch.messages.text_bytes() + 32 * batch.messages.len();
    let room = escape_room(batch, format, batch.messages.iter());
    let mut out = Vec::with_capacity(text + 128 + room);
    out.extend_from_slice(br#"{"connection":"#);
    push_str(&mut out, batch.connection);
    out.extend_from_slice(br#","worker":"#);
    push_str(&mut out, batch.worker);
    out.extend_from_slice(br#","token":"#);
    push_u64(&mut out, batch.token);
    out.extend_from_slice(br#","messages":["#);
    for (i, m) in batch.messages.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"seq":"#);
        push_u64(&mut out, m.seq);
        push_data(&mut out, &m, format);
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    out
}

/// One message as a self-describing record (log lines, Kinesis records): the
/// stream, the owner and its token travel with the data. Keys in sorted
/// order, as a `serde_json::Value` map writes them.
pub fn record_json(batch: &Batch<'_>, message: &Message, format: DataFormat) -> Vec<u8> {
    let room = escape_room(batch, format, std::iter::once(*message));
    let mut out = Vec::with_capacity(message.data.len() + batch.connection.len() + 96 + room);
    out.extend_from_slice(br#"{"connection":"#);
    push_str(&mut out, batch.connection);
    // `data` and `json` both sort between `connection` and `seq`.
    push_data(&mut out, message, format);
    out.extend_from_slice(br#","seq":"#);
    push_u64(&mut out, message.seq);
    out.extend_from_slice(br#","token":"#);
    push_u64(&mut out, batch.token);
    out.extend_from_slice(br#","worker":"#);
    push_str(&mut out, batch.worker);
    out.push(b'}');
    // A record is held until its request is answered (a Kinesis batch holds
    // up to 500): the escaper's room is given back, in place.
    out.shrink_to_fit();
    out
}

/// `,"data":<the text as a string>` or `,"json":<the text>`.
fn push_data(out: &mut Vec<u8>, message: &Message, format: DataFormat) {
    match format {
        DataFormat::String => {
            out.extend_from_slice(br#","data":"#);
            push_str(out, message.data);
        }
        DataFormat::Json => {
            out.extend_from_slice(br#","json":"#);
            out.extend_from_slice(message.data.as_bytes());
        }
    }
}

fn push_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// Appends `text` as a JSON string, escaped as `serde_json` escapes it.
///
/// The escaping is `json-escape-simd`'s (sonic-rs's kernel alone: sixteen
/// or thirty-two bytes at a time, as the CPU allows, chosen at run time). It
/// replaced an eight-byte word scanner written here: on the bench's 195-byte
/// messages 50 ns against 70, on plain text 18 against 58; 7% slower (309
/// against 290 ns) on a message of a dozen short strings, where every block
/// holds a quote (bench/README.md, "The escaper from a library").
///
/// It reserves six times the text's length past the end before it writes,
/// so a text longer than [`SIMD_ESCAPE_MAX`] is escaped by `serde_json`,
/// which reserves nothing ahead: a 1 MiB message (the default limit) would
/// otherwise hold 6 MiB more while its batch is in flight.
fn push_str(out: &mut Vec<u8>, text: &str) {
    if text.len() <= SIMD_ESCAPE_MAX {
        json_escape_simd::escape_into(text, out);
    } else {
        // Writing a string into a `Vec` cannot fail.
        serde_json::to_writer(&mut *out, text).unwrap_or_default();
    }
}

/// The longest text [`push_str`] gives the SIMD escaper: what it reserves
/// ahead stays under 100 KiB.
const SIMD_ESCAPE_MAX: usize = 16 * 1024;

/// The most [`push_str`] reserves past the end of the buffer (the SIMD
/// escaper's bound) for the longest text it is given in a payload: the
/// batch's names, and `messages` when they travel as strings (as values
/// they are copied). A payload sized with it is not reallocated for the room
/// alone; text that grows a lot when escaped (many quotes) can still outgrow
/// it, as it could before.
fn escape_room<'a>(
    batch: &Batch<'_>,
    format: DataFormat,
    messages: impl Iterator<Item = Message<'a>>,
) -> usize {
    let longest = match format {
        DataFormat::String => messages.map(|m| m.data.len()).max(),
        DataFormat::Json => None,
    };
    let len = longest
        .unwrap_or_default()
        .max(batch.connection.len())
        .max(batch.worker.len());
    len.min(SIMD_ESCAPE_MAX) * 6 + 35
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::batch::Pending;

    fn strings() -> Vec<String> {
        let mut all: Vec<String> = [
            "",
            "plain ascii text that is longer than one word",
            r#"{"seq":1,"payload":"a \"quoted\" \\ value"}"#,
            "tabs\tnew\nlines\r\u{8}\u{c}",
            "é, 漢字, 😀 and \u{7f} pass through",
            "1234567\"",
            "\"1234567",
            "12345678\\",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        // Every control byte and every special character at every offset of a word.
        for b in (0u8..0x20).chain([b'"', b'\\', b'/', 0x7f]) {
            // Offsets across sixteen-, thirty-two- and sixty-four-byte blocks.
            for offset in (0..10)
                .chain(12..20)
                .chain(28..36)
                .chain(60..68)
                .chain([127, 128])
            {
                let mut s = "x".repeat(offset);
                s.push(char::from(b));
                s.push_str("tail beyond a word");
                all.push(s);
            }
        }
        // Either side of the longest text the SIMD escaper is given.
        for len in [SIMD_ESCAPE_MAX - 1, SIMD_ESCAPE_MAX, SIMD_ESCAPE_MAX + 1] {
            let mut s = "a\"b\\c\nd\u{1}é".repeat(len / 8 + 1);
            s.truncate(s.floor_char_boundary(len));
            all.push(s);
        }
        all
    }

    /// `push_str` writes `s` byte for byte as `serde_json` writes it.
    fn escapes_as_serde_json(s: &str) {
        let mut out = Vec::new();
        push_str(&mut out, s);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            serde_json::to_string(s).unwrap(),
            "{s:?}"
        );
    }

    #[test]
    fn strings_are_escaped_byte_for_byte_as_serde_json_escapes_them() {
        for s in strings() {
            escapes_as_serde_json(&s);
        }
    }

    /// One character that needs escaping at every offset of a long clean
    /// text, and two of them at every gap, so that every block of every
    /// width the SIMD escaper loads (and its tail) holds one somewhere.
    #[test]
    fn escapes_at_every_offset_and_gap_of_a_long_text() {
        let clean = "abcdefghijklmnopqrstuvwxyz0123456789é".repeat(8);
        let clean: String = clean.chars().take(300).collect();
        for special in ['"', '\\', '\n', '\u{1}', '\u{1f}'] {
            for at in 0..=clean.chars().count() {
                let mut s: String = clean.chars().take(at).collect();
                s.push(special);
                s.extend(clean.chars().skip(at));
                escapes_as_serde_json(&s);
            }
        }
        for first in [0, 13, 31, 63, 127] {
            for gap in 0..140 {
                let mut s: String = clean.chars().take(first).collect();
                s.push('"');
                s.extend(clean.chars().skip(first).take(gap));
                s.push('\\');
                s.extend(clean.chars().skip(first + gap));
                escapes_as_serde_json(&s);
            }
        }
    }

    /// Random mixes of plain text, spaces, escapes and multi-byte
    /// characters (a space just after a control byte is what a borrow in
    /// the word test flags by mistake).
    #[test]
    fn random_strings_are_escaped_as_serde_json_escapes_them() {
        const PIECES: &[&str] = &[
            "a", " ", "!", "\"", "\\", "\n", "\u{1}", "\u{1f}", "é", "漢", "😀", "\u{7f}", "/",
            "xyzw1234",
        ];
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..5_000 {
            let len = (next() % 100) as usize;
            let s: String = (0..len)
                .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
                .collect();
            escapes_as_serde_json(&s);
        }
    }

    /// The HTTP body as `serde_json` writes it, in the contract's field order:
    /// the reference the direct encoder is held to.
    #[derive(serde::Serialize)]
    struct Body<'a> {
        connection: &'a str,
        worker: &'a str,
        token: u64,
        messages: Vec<Entry<'a>>,
    }

    #[derive(serde::Serialize)]
    struct Entry<'a> {
        seq: u64,
        data: &'a str,
    }

    #[test]
    fn bodies_and_records_are_what_serde_json_writes() {
        let texts = strings();
        let all: Vec<Message> = texts
            .iter()
            .enumerate()
            .map(|(i, s)| Message {
                seq: i as u64 * 1_000_003,
                data: s,
            })
            .collect();
        for some in [&all[..], &all[..1], &[]] {
            let messages: &Pending = &some.iter().copied().collect();
            let batch = Batch {
                connection: "ns/na\"me",
                worker: "w-1\\x",
                token: u64::MAX,
                messages,
            };
            let reference = Body {
                connection: batch.connection,
                worker: batch.worker,
                token: batch.token,
                messages: messages
                    .iter()
                    .map(|m| Entry {
                        seq: m.seq,
                        data: m.data,
                    })
                    .collect(),
            };
            assert_eq!(
                String::from_utf8(batch_json(&batch, DataFormat::String)).unwrap(),
                serde_json::to_string(&reference).unwrap()
            );
            for m in messages {
                let by_value = serde_json::json!({
                    "connection": batch.connection,
                    "worker": batch.worker,
                    "token": batch.token,
                    "seq": m.seq,
                    "data": m.data,
                });
                let record = record_json(&batch, &m, DataFormat::String);
                // Held until answered: no room left over from escaping.
                assert_eq!(record.capacity(), record.len());
                assert_eq!(String::from_utf8(record).unwrap(), by_value.to_string());
            }
        }
    }

    /// A long message is escaped without the SIMD escaper's room ahead: the
    /// body of a 1 MiB message (the default limit) is not several times its
    /// size while the batch is in flight.
    #[test]
    fn a_long_message_does_not_make_its_body_many_times_its_size() {
        let text = "0123456789abcdef".repeat(64 * 1024);
        let messages: Pending = [Message {
            seq: 1,
            data: &text,
        }]
        .into_iter()
        .collect();
        let batch = Batch {
            connection: "ns/name",
            worker: "w-1",
            token: 1,
            messages: &messages,
        };
        let body = batch_json(&batch, DataFormat::String);
        assert!(body.len() > text.len());
        assert!(
            body.capacity() < text.len() * 2,
            "{} bytes held for a {}-byte message",
            body.capacity(),
            text.len()
        );
        let record = record_json(&batch, &messages.get(0), DataFormat::String);
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&record).unwrap()["data"],
            text.as_str()
        );
        // As a value it is copied, not escaped: no room is kept for escaping.
        let value = format!("\"{text}\"");
        let messages: Pending = [Message {
            seq: 1,
            data: &value,
        }]
        .into_iter()
        .collect();
        let body = batch_json(
            &Batch {
                messages: &messages,
                ..batch
            },
            DataFormat::Json,
        );
        assert!(
            body.capacity() < value.len() + 1024,
            "{} bytes held for a {}-byte value",
            body.capacity(),
            value.len()
        );
    }

    /// With `json`, each message is its own text, verbatim, as a value: the
    /// body parses to the same document as one built from the parsed
    /// messages, and the text of each message appears in it byte for byte.
    #[test]
    fn json_data_is_the_message_itself() {
        let texts = [
            r#"{"seq":1,"payload":"a \"quoted\" \\ value"}"#,
            r#" [1, 2.5e3, null, true, "\u00e9 é 😀"] "#,
            "17",
            r#""a string""#,
            r#"{"nested":{"deep":[{"x":"\n"}]},"seq":18446744073709551615}"#,
        ];
        let messages: Pending = texts
            .iter()
            .enumerate()
            .map(|(i, t)| Message {
                seq: i as u64,
                data: t,
            })
            .collect();
        let batch = Batch {
            connection: "ns/na\"me",
            worker: "w-1",
            token: 7,
            messages: &messages,
        };
        let body = String::from_utf8(batch_json(&batch, DataFormat::Json)).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
        let expected = serde_json::json!({
            "connection": batch.connection,
            "worker": batch.worker,
            "token": 7,
            "messages": messages.iter().map(|m| serde_json::json!({
                "seq": m.seq,
                "json": serde_json::from_str::<serde_json::Value>(m.data).unwrap(),
            })).collect::<Vec<_>>(),
        });
        assert_eq!(parsed, expected);
        for (m, t) in messages.iter().zip(texts) {
            assert!(body.contains(&format!(r#"{{"seq":{},"json":{t}}}"#, m.seq)));
            let record = String::from_utf8(record_json(&batch, &m, DataFormat::Json)).unwrap();
            assert_eq!(
                record,
                format!(
                    r#"{{"connection":"ns/na\"me","json":{t},"seq":{},"token":7,"worker":"w-1"}}"#,
                    m.seq
                )
            );
            let value: serde_json::Value = serde_json::from_str(&record).unwrap();
            assert_eq!(
                value["json"],
                serde_json::from_str::<serde_json::Value>(t).unwrap()
            );
        }
    }
}

//! The JSON the sinks send, written straight into a buffer: the HTTP batch
//! body and the self-describing record of log lines and Kinesis records.
//!
//! The bytes are exactly what `serde_json` writes for the same values (the
//! tests hold it to that), but the message text — almost all of every
//! payload — is escaped eight bytes at a time: a saturated session spent a
//! fifth of its CPU in `serde_json`'s byte-at-a-time string escaper, and a
//! record no longer builds a `serde_json::Value` (a map and a copy of the
//! text) per message.

use super::batch::{Batch, Message};
use std::io::Write;

/// `{"connection":…,"worker":…,"token":…,"messages":[{"seq":…,"data":…},…]}`,
/// the HTTP sink's body (the stream contract's field order).
pub fn batch_json(batch: &Batch<'_>) -> Vec<u8> {
    let text: usize = batch.messages.iter().map(|m| m.data.len() + 32).sum();
    let mut out = Vec::with_capacity(text + 128);
    out.extend_from_slice(br#"{"connection":"#);
    push_str(&mut out, batch.connection);
    out.extend_from_slice(br#","worker":"#);
    push_str(&mut out, batch.worker);
    let _ = write!(out, r#","token":{},"messages":["#, batch.token);
    for (i, m) in batch.messages.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let _ = write!(out, r#"{{"seq":{},"data":"#, m.seq);
        push_str(&mut out, &m.data);
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    out
}

/// One message as a self-describing record (log lines, Kinesis records): the
/// stream, the owner and its token travel with the data. Keys in sorted
/// order, as a `serde_json::Value` map writes them.
pub fn record_json(batch: &Batch<'_>, message: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.data.len() + batch.connection.len() + 96);
    out.extend_from_slice(br#"{"connection":"#);
    push_str(&mut out, batch.connection);
    out.extend_from_slice(br#","data":"#);
    push_str(&mut out, &message.data);
    let _ = write!(
        out,
        r#","seq":{},"token":{},"worker":"#,
        message.seq, batch.token
    );
    push_str(&mut out, batch.worker);
    out.push(b'}');
    out
}

/// Appends `s` as a JSON string, escaped as `serde_json` escapes it.
fn push_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut clean = 0; // start of the bytes not yet copied
    let mut i = 0;
    while i < bytes.len() {
        if let Some(word) = bytes.get(i..i + 8) {
            let word = u64::from_le_bytes(word.try_into().unwrap_or_default());
            if !word_needs_escape(word) {
                i += 8;
                continue;
            }
        }
        let b = bytes[i];
        if let Some(escape) = escape_of(b) {
            out.extend_from_slice(&bytes[clean..i]);
            match escape {
                Escape::Short(c) => out.extend_from_slice(&[b'\\', c]),
                Escape::Unicode => {
                    const HEX: &[u8; 16] = b"0123456789abcdef";
                    out.extend_from_slice(b"\\u00");
                    out.extend_from_slice(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
                }
            }
            clean = i + 1;
        }
        i += 1;
    }
    out.extend_from_slice(&bytes[clean..]);
    out.push(b'"');
}

enum Escape {
    Short(u8),
    Unicode,
}

fn escape_of(b: u8) -> Option<Escape> {
    Some(match b {
        b'"' => Escape::Short(b'"'),
        b'\\' => Escape::Short(b'\\'),
        b'\n' => Escape::Short(b'n'),
        b'\r' => Escape::Short(b'r'),
        b'\t' => Escape::Short(b't'),
        0x08 => Escape::Short(b'b'),
        0x0c => Escape::Short(b'f'),
        0x00..=0x1f => Escape::Unicode,
        _ => return None,
    })
}

/// Whether any of the eight bytes is `"`, `\` or a control byte (< 0x20).
fn word_needs_escape(w: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // A byte is zero in `x` ⇔ its high bit is set here (exact, no false
    // negatives; a false positive only sends the word to the byte loop).
    let has_zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGHS;
    let below_space = w.wrapping_sub(ONES * 0x20) & !w & HIGHS;
    (below_space | has_zero(w ^ (ONES * u64::from(b'"'))) | has_zero(w ^ (ONES * u64::from(b'\\'))))
        != 0
}

#[cfg(test)]
mod tests {
    use super::*;

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
            for offset in 0..10 {
                let mut s = "x".repeat(offset);
                s.push(char::from(b));
                s.push_str("tail beyond a word");
                all.push(s);
            }
        }
        all
    }

    #[test]
    fn strings_are_escaped_byte_for_byte_as_serde_json_escapes_them() {
        for s in strings() {
            let mut out = Vec::new();
            push_str(&mut out, &s);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(&s).unwrap(),
                "{s:?}"
            );
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
        let messages: Vec<Message> = strings()
            .into_iter()
            .enumerate()
            .map(|(i, s)| Message {
                seq: i as u64 * 1_000_003,
                data: s.into(),
            })
            .collect();
        for messages in [&messages[..], &messages[..1], &[]] {
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
                        data: &m.data,
                    })
                    .collect(),
            };
            assert_eq!(
                String::from_utf8(batch_json(&batch)).unwrap(),
                serde_json::to_string(&reference).unwrap()
            );
            for m in messages {
                let by_value = serde_json::json!({
                    "connection": batch.connection,
                    "worker": batch.worker,
                    "token": batch.token,
                    "seq": m.seq,
                    "data": m.data.as_str(),
                });
                assert_eq!(
                    String::from_utf8(record_json(&batch, m)).unwrap(),
                    by_value.to_string()
                );
            }
        }
    }
}

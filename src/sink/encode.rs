//! The JSON payloads the sinks send: a whole batch as the HTTP sink's body
//! (when the batch holds texts: a session's HTTP batch is written as its
//! body while the messages arrive, `Pending`), and one message as the
//! self-describing record of log lines and Kinesis records. Both are put
//! together from `json_bytes`, byte for byte what `serde_json` writes for
//! the same values; a record builds no `serde_json::Value` (a map and a copy
//! of the text) per message.

use super::batch::{Batch, Message};
use super::json_bytes::{
    BODY_TAIL, body_head, escape_room, push_data, push_entry, push_str, push_u64,
};
use crate::crd::DataFormat;

/// `{"connection":…,"worker":…,"token":…,"messages":[{"seq":…,"data":…},…]}`,
/// the HTTP sink's body (the stream contract's field order); with
/// [`DataFormat::Json`] each entry is `{"seq":…,"json":…}`.
/// A batch written as its body as the messages arrived (`Pending::http_body`,
/// whose format is its own) is copied as it is.
pub fn batch_json(batch: &Batch<'_>, format: DataFormat) -> Vec<u8> {
    if let Some(body) = batch.messages.body_copy() {
        return body;
    }
    let head = body_head(batch.connection, batch.worker, batch.token);
    let text = batch.messages.text_bytes() + 32 * batch.messages.len();
    let room = message_room(format, batch.messages.iter());
    let mut out = Vec::with_capacity(head.len() + text + BODY_TAIL.len() + room);
    out.extend_from_slice(&head);
    for (i, m) in batch.messages.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_entry(&mut out, m.seq, m.data, format);
    }
    out.extend_from_slice(BODY_TAIL);
    out
}

/// One message as a self-describing record (log lines, Kinesis records): the
/// stream, the owner and its token travel with the data. Keys in sorted
/// order, as a `serde_json::Value` map writes them.
pub fn record_json(batch: &Batch<'_>, message: &Message, format: DataFormat) -> Vec<u8> {
    let room = message_room(format, std::iter::once(*message))
        .max(escape_room(batch.connection.len().max(batch.worker.len())));
    let mut out = Vec::with_capacity(message.data.len() + batch.connection.len() + 96 + room);
    out.extend_from_slice(br#"{"connection":"#);
    push_str(&mut out, batch.connection);
    // `data` and `json` both sort between `connection` and `seq`.
    push_data(&mut out, message.data, format);
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

/// The escaper's room ahead for the longest of `messages` when they travel
/// as strings (as values they are copied, and need none).
fn message_room<'a>(format: DataFormat, messages: impl Iterator<Item = Message<'a>>) -> usize {
    match format {
        DataFormat::String => escape_room(messages.map(|m| m.data.len()).max().unwrap_or_default()),
        DataFormat::Json => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::batch::Pending;
    use crate::sink::json_bytes::tests::strings;

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

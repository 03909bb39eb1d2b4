//! JSON written straight into a byte buffer: strings escaped as
//! `serde_json` escapes them, integers, and the pieces of the HTTP sink's
//! body (its head, one entry per message, its tail). The payloads are put
//! together from these by `encode` (a whole batch, a record) and by
//! `Pending` (a body written as its messages arrive); this module knows
//! nothing of batches, so both can use it.
//!
//! The bytes are exactly what `serde_json` writes for the same values (the
//! tests hold them to that), but the message text (almost all of every
//! payload) is escaped by a SIMD escaper ([`push_str`]): a saturated
//! session spent a fifth of its CPU in `serde_json`'s byte-at-a-time string
//! escaper. Integers go through `itoa`, not `core::fmt` (a few percent of a
//! saturated session).

use crate::crd::DataFormat;

/// What ends the HTTP body: the `messages` array and the object.
pub(super) const BODY_TAIL: &[u8] = b"]}";

/// `{"connection":…,"worker":…,"token":…,"messages":[`: the HTTP body up to
/// its first entry, in the stream contract's field order.
pub(super) fn body_head(connection: &str, worker: &str, token: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + escape_room(connection.len().max(worker.len())));
    out.extend_from_slice(br#"{"connection":"#);
    push_str(&mut out, connection);
    out.extend_from_slice(br#","worker":"#);
    push_str(&mut out, worker);
    out.extend_from_slice(br#","token":"#);
    push_u64(&mut out, token);
    out.extend_from_slice(br#","messages":["#);
    out.shrink_to_fit();
    out
}

/// One entry of the body's `messages`: `{"seq":…,"data":…}`, or with
/// [`DataFormat::Json`] `{"seq":…,"json":…}`.
pub(super) fn push_entry(out: &mut Vec<u8>, seq: u64, text: &str, format: DataFormat) {
    out.extend_from_slice(br#"{"seq":"#);
    push_u64(out, seq);
    push_data(out, text, format);
    out.push(b'}');
}

/// `,"data":<the text as a string>` or `,"json":<the text>`. With
/// [`DataFormat::Json`] the text is not escaped at all: the session has
/// checked it is JSON every consumer's parser takes, so it is copied in as
/// a value.
pub(super) fn push_data(out: &mut Vec<u8>, text: &str, format: DataFormat) {
    match format {
        DataFormat::String => {
            out.extend_from_slice(br#","data":"#);
            push_str(out, text);
        }
        DataFormat::Json => {
            out.extend_from_slice(br#","json":"#);
            out.extend_from_slice(text.as_bytes());
        }
    }
}

pub(super) fn push_u64(out: &mut Vec<u8>, n: u64) {
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
pub(super) fn push_str(out: &mut Vec<u8>, text: &str) {
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

/// The most [`push_str`] reserves past the end of the buffer for a text of
/// `len` bytes (the SIMD escaper's bound). A buffer sized with it is not
/// reallocated for the room alone; text that grows a lot when escaped (many
/// quotes) can still outgrow it.
pub(super) fn escape_room(len: usize) -> usize {
    len.min(SIMD_ESCAPE_MAX) * 6 + 35
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Texts with every character that needs escaping at every offset
    /// across the escaper's blocks, multi-byte characters, and lengths
    /// either side of the longest text the SIMD escaper is given.
    pub(in crate::sink) fn strings() -> Vec<String> {
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
}

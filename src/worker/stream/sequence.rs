//! Sequence numbers of upstream messages: from an RFC 6901 JSON pointer into
//! each text message, or a counter continuing from the checkpoint.
//!
//! The pointer is resolved while the message is parsed: the parser descends
//! only into the object member or array element the pointer names and skips
//! everything else without building it. Building a `serde_json::Value` for
//! every message (maps, a `String` per key and per string) was a third of a
//! saturated session's CPU. The answers are `Value::pointer(..).as_u64()`'s.
//!
//! How much of the text must be JSON depends on the sink ([`Check`]): all
//! of it, as values every parser takes, for a sink that embeds messages as
//! JSON; with the default format (messages carried as strings) only the text
//! up to the end of the number, which most messages let [`leading_u64`]
//! read from their first bytes. Read that way, of duplicate keys the first
//! counts (a `Value` keeps the last, which cannot be known without reading
//! to the end).

use super::sequence_prefix::leading_u64;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::cell::Cell;
use std::fmt;

/// A pointer parsed once per session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SequencePointer {
    text: String,
    /// `None`: not a pointer into a document (it does not start with `/`),
    /// so no message has a sequence number at it.
    tokens: Option<Vec<Token>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Token {
    /// The reference token, `~1` and `~0` decoded.
    key: String,
    /// The token as an array index, by `Value::pointer`'s rule (decimal,
    /// no sign, no leading zero).
    index: Option<usize>,
}

impl SequencePointer {
    pub(super) fn new(pointer: &str) -> Self {
        let tokens = if pointer.is_empty() {
            Some(Vec::new())
        } else {
            pointer.strip_prefix('/').map(|rest| {
                rest.split('/')
                    .map(|t| {
                        let key = t.replace("~1", "/").replace("~0", "~");
                        let leading_zero = key.starts_with('0') && key.len() > 1;
                        let index = (!key.starts_with('+') && !leading_zero)
                            .then(|| key.parse().ok())
                            .flatten();
                        Token { key, index }
                    })
                    .collect()
            })
        };
        Self {
            text: pointer.to_string(),
            tokens,
        }
    }

    /// The unsigned integer at the pointer in `text`; `Ok(None)` when the
    /// document has none there, `Err` when `text` is not JSON as far as
    /// `check` asks.
    pub(super) fn u64_in(
        &self,
        text: &str,
        check: Check,
    ) -> Result<Option<u64>, serde_json::Error> {
        match check {
            Check::Embeddable => self.parse(text, Skip::Values(MAX_EMBEDDED_DEPTH), Of::Last),
            Check::Grammar => self.parse(text, Skip::Grammar, Of::Last),
            Check::UpToValue => {
                let keys = self.tokens.as_deref().filter(|t| !t.is_empty());
                if let Some(seq) =
                    keys.and_then(|t| leading_u64(text, t.iter().map(|t| t.key.as_str())))
                {
                    return Ok(Some(seq));
                }
                self.parsed_up_to_value(text)
            }
        }
    }

    /// [`Check::UpToValue`] by serde_json alone. A whole parse is the
    /// cheaper one when the text is JSON; when it is not, a second one stops
    /// at the value (rare).
    fn parsed_up_to_value(&self, text: &str) -> Result<Option<u64>, serde_json::Error> {
        self.parse(text, Skip::Grammar, Of::First).or_else(|e| {
            let answer = Cell::new(None);
            let _ = self.parse(
                text,
                Skip::Grammar,
                Of::FirstThenStop {
                    text,
                    answer: &answer,
                },
            );
            answer.get().ok_or(e)
        })
    }

    /// One serde_json pass.
    fn parse(&self, text: &str, skip: Skip, of: Of) -> Result<Option<u64>, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        let found = match &self.tokens {
            Some(tokens) => At { tokens, skip, of }.deserialize(&mut de)?,
            None => {
                skip.value(&mut de)?;
                None
            }
        };
        match of {
            // Not stopped: no value at the pointer, or the whole document
            // was the value (an empty pointer).
            Of::FirstThenStop { answer, .. } => answer.set(Some(found)),
            Of::First | Of::Last => de.end()?,
        }
        Ok(found)
    }
}

/// Which of duplicate keys counts, and whether the pass ends at its value.
#[derive(Clone, Copy)]
enum Of<'a> {
    /// The last, as in a `Value`: what a consumer's parser keeps.
    Last,
    /// The first: what can be found without reading further.
    First,
    /// The first, and the pass over `text` ends at the end of its value
    /// (its answer put in `answer`), by way of an error, so what follows is
    /// not read; but something must follow (see [`Ending`]).
    FirstThenStop {
        text: &'a str,
        answer: &'a Cell<Option<Option<u64>>>,
    },
}

/// The value at the end of the pointer, in a pass that stops there: its
/// answer, or an error when it runs to the end of the text (a number there
/// may have been cut short; serde_json would take it as whole).
struct Ending<'a> {
    text: &'a str,
}

impl<'de> DeserializeSeed<'de> for Ending<'_> {
    type Value = Option<u64>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<u64>, D::Error> {
        let raw = <&serde_json::value::RawValue>::deserialize(de)?;
        let end = |s: &str| s.as_bytes().as_ptr_range().end;
        if end(raw.get()) == end(self.text) {
            return Err(serde::de::Error::custom(
                "the text ends with the value, which may have been cut short",
            ));
        }
        Ok(serde_json::from_str::<serde_json::Value>(raw.get())
            .ok()
            .and_then(|v| v.as_u64()))
    }
}

/// How much of a message must be JSON for its sequence number to count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Check {
    /// All of it, as values every parser takes ([`is_embeddable_json`],
    /// checked in the same pass): for a sink that embeds messages as JSON.
    Embeddable,
    /// All of it, by the grammar (serde_json's skipping).
    Grammar,
    /// Up to the end of the value at the pointer; what follows is not read.
    /// The sink carries the message as a string, whatever follows.
    UpToValue,
}

/// Why a message has no sequence number to go by.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unsequenced {
    /// Not a value every parser takes, for a sink that embeds messages as
    /// values; the counter value it used up, if it was numbered so.
    NotEmbeddable(Option<u64>),
    /// Not JSON, or no unsigned integer at the pointer.
    Unusable(String),
}

/// The sequence number of a message: at the pointer, or the next counter
/// value. `Ok(None)` for a replay at or below what was already taken; with no
/// checkpoint, every sequence number (0 included) is new.
/// With `embeddable`, the text must also be a value every parser takes: with
/// a pointer that is checked in the parse that finds the number, with a
/// counter on its own, after the number is used up (the counter follows the
/// upstream's messages, taken or not).
pub(super) fn sequence_of(
    text: &str,
    pointer: Option<&SequencePointer>,
    high_water: &mut Option<u64>,
    embeddable: bool,
) -> Result<Option<u64>, Unsequenced> {
    let Some(pointer) = pointer else {
        let seq = next_counter(high_water);
        if embeddable && !is_embeddable_json(text) {
            return Err(Unsequenced::NotEmbeddable(Some(seq)));
        }
        return Ok(Some(seq));
    };
    let check = if embeddable {
        Check::Embeddable
    } else {
        Check::UpToValue
    };
    let seq = match pointer.u64_in(text, check) {
        Ok(found) => found,
        // Refused by the stricter check alone: said apart (rare, so the
        // second parse costs nothing that matters).
        Err(_) if embeddable && pointer.u64_in(text, Check::Grammar).is_ok() => {
            return Err(Unsequenced::NotEmbeddable(None));
        }
        Err(e) => return Err(Unsequenced::Unusable(format!("not JSON: {e}"))),
    }
    .ok_or_else(|| Unsequenced::Unusable(format!("no unsigned integer at {}", pointer.text)))?;
    if high_water.is_some_and(|h| seq <= h) {
        return Ok(None);
    }
    *high_water = Some(seq);
    Ok(Some(seq))
}

/// Deepest nesting a message embedded as a JSON value may have: consumers'
/// parsers commonly stop at 128 levels (serde_json does), and the body adds
/// up to three around the message.
pub(super) const MAX_EMBEDDED_DEPTH: u32 = 120;

/// Whether `text` is a JSON document that JSON parsers take as a value, for a
/// sink that embeds messages as values: what the grammar allows (serde_json's
/// skipping checks only that) and also no number out of range, no lone
/// surrogate escape, no nesting beyond [`MAX_EMBEDDED_DEPTH`]. A message a
/// consumer's parser refuses would make the whole batch refused, again and
/// again. Checked without building the value.
fn is_embeddable_json(text: &str) -> bool {
    let mut de = serde_json::Deserializer::from_str(text);
    Embeddable(MAX_EMBEDDED_DEPTH).deserialize(&mut de).is_ok() && de.end().is_ok()
}

/// Visits every value as a parser building it would (numbers converted,
/// strings unescaped), `.0` levels of nesting still allowed.
struct Embeddable(u32);

impl<'de> DeserializeSeed<'de> for Embeddable {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Embeddable {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let inner = self.nested()?;
        while seq.next_element_seed(Embeddable(inner))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let inner = self.nested()?;
        while map.next_key_seed(Embeddable(inner))?.is_some() {
            map.next_value_seed(Embeddable(inner))?;
        }
        Ok(())
    }
}

impl Embeddable {
    fn nested<E: serde::de::Error>(&self) -> Result<u32, E> {
        self.0
            .checked_sub(1)
            .ok_or_else(|| E::custom("nested too deeply to embed"))
    }
}

/// The next counter value: 0 with no checkpoint, else one past it.
pub(super) fn next_counter(high_water: &mut Option<u64>) -> u64 {
    let next = high_water.map_or(0, |h| h + 1);
    *high_water = Some(next);
    next
}

/// How the parts of a document off the pointer's path are checked: by the
/// grammar only (serde_json's skipping), or as values every parser takes,
/// with the nesting still allowed.
#[derive(Clone, Copy)]
enum Skip {
    Grammar,
    Values(u32),
}

impl Skip {
    /// The check one level further in.
    fn nested<E: serde::de::Error>(self) -> Result<Self, E> {
        match self {
            Self::Grammar => Ok(Self::Grammar),
            Self::Values(depth) => Embeddable(depth).nested().map(Self::Values),
        }
    }

    fn value<'de, D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        match self {
            Self::Grammar => IgnoredAny::deserialize(de).map(|_| ()),
            Self::Values(depth) => Embeddable(depth).deserialize(de),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Skip {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        self.value(de)
    }
}

/// The value at the remaining tokens of the pointer, as an unsigned integer.
struct At<'p> {
    tokens: &'p [Token],
    skip: Skip,
    of: Of<'p>,
}

impl<'p> At<'p> {
    /// The seed for the member or element this one names.
    fn next<E: serde::de::Error>(&self) -> Result<(At<'p>, Skip), E> {
        let skip = self.skip.nested()?;
        let next = At {
            tokens: self.tokens.get(1..).unwrap_or_default(),
            skip,
            of: self.of,
        };
        Ok((next, skip))
    }

    /// In a pass that stops at the value, the seed for it when this level
    /// names it.
    fn ending(&self) -> Option<Ending<'p>> {
        match self.of {
            Of::FirstThenStop { text, .. } if self.tokens.len() == 1 => Some(Ending { text }),
            _ => None,
        }
    }

    /// `found`, the value the pointer names; the pass ends here if it is to.
    fn found<E: serde::de::Error>(&self, found: Option<u64>) -> Result<Option<u64>, E> {
        match self.of {
            Of::FirstThenStop { answer, .. } => {
                answer.set(Some(found));
                Err(E::custom("stopped at the sequence number"))
            }
            Of::First | Of::Last => Ok(found),
        }
    }
}

impl<'de> DeserializeSeed<'de> for At<'_> {
    type Value = Option<u64>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<u64>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for At<'_> {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_u64<E>(self, v: u64) -> Result<Option<u64>, E> {
        Ok(self.tokens.is_empty().then_some(v))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Option<u64>, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<u64>, A::Error> {
        let (next, skip) = self.next()?;
        let key = self.tokens.first().map(|t| t.key.as_str());
        let first = !matches!(self.of, Of::Last);
        let mut found = None;
        // Reading for the first of duplicate keys, later ones are skipped.
        while let Some(hit) =
            map.next_key_seed(KeyIs(key.filter(|_| !(first && found.is_some()))))?
        {
            if hit {
                let value = match self.ending() {
                    Some(ending) => map.next_value_seed(ending)?,
                    None => map.next_value_seed(At { ..next })?,
                };
                found = Some(self.found(value)?);
            } else {
                map.next_value_seed(skip)?;
            }
        }
        Ok(found.flatten())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<u64>, A::Error> {
        let (next, skip) = self.next()?;
        let wanted = self.tokens.first().and_then(|t| t.index);
        let mut found = None;
        let mut i = 0;
        loop {
            if Some(i) == wanted {
                let value = match self.ending() {
                    Some(ending) => seq.next_element_seed(ending)?,
                    None => seq.next_element_seed(At { ..next })?,
                };
                match value {
                    Some(value) => found = self.found(value)?,
                    None => return Ok(found),
                }
            } else if seq.next_element_seed(skip)?.is_none() {
                return Ok(found);
            }
            i += 1;
        }
    }
}

/// Whether an object key is the pointer's next token (`None`: the pointer
/// ends here, so no key is followed), read without allocating when the key
/// has no escapes.
struct KeyIs<'p>(Option<&'p str>);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<bool, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<bool, E> {
        Ok(self.0 == Some(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::stream::sequence_prefix::number_and_end;

    #[test]
    fn only_json_every_parser_takes_is_embedded() {
        for good in [
            r#"{"a":[1,2.5,-3,1e300,"\u00e9\ud83d\ude00",null,true]}"#,
            " 17 ",
            r#""s""#,
        ] {
            assert!(is_embeddable_json(good), "{good}");
        }
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(is_embeddable_json(&deep(MAX_EMBEDDED_DEPTH as usize)));
        for bad in [
            r#"{"x":"\ud800"}"#.to_string(),
            r#"{"x":"\udc00"}"#.into(),
            "1e400".into(),
            "[1,]".into(),
            "{} x".into(),
            "\"a\u{1}b\"".into(),
            r#""\q""#.into(),
            "".into(),
            "\u{feff}{}".into(),
            deep(MAX_EMBEDDED_DEPTH as usize + 1),
        ] {
            assert!(!is_embeddable_json(&bad), "{bad:?}");
        }
        // With a pointer the same check is made in the parse that finds the
        // number, and a refusal by it alone is told apart.
        let seq = SequencePointer::new("/seq");
        let mut hw = None;
        for (doc, expected) in [
            (
                r#"{"x":"\ud800","seq":1}"#,
                Err(Unsequenced::NotEmbeddable(None)),
            ),
            (
                r#"{"seq":2,"x":[1e400]}"#,
                Err(Unsequenced::NotEmbeddable(None)),
            ),
            (r#"{"seq":3,"x":"\ud83d\ude00"}"#, Ok(Some(3))),
        ] {
            assert_eq!(
                sequence_of(doc, Some(&seq), &mut hw, true),
                expected,
                "{doc}"
            );
            // By the grammar alone, each has its number.
            assert!(seq.u64_in(doc, Check::Grammar).unwrap().is_some(), "{doc}");
        }
        let nested = format!(r#"{{"seq":4,"x":{}}}"#, deep(MAX_EMBEDDED_DEPTH as usize));
        assert_eq!(
            sequence_of(&nested, Some(&seq), &mut hw, true),
            Err(Unsequenced::NotEmbeddable(None)),
            "the object itself is one level"
        );
        assert!(matches!(
            sequence_of("{", Some(&seq), &mut hw, true),
            Err(Unsequenced::Unusable(_))
        ));
    }

    #[test]
    fn counter_sequences_start_at_zero_and_continue_from_a_checkpoint() {
        let mut none = None;
        assert_eq!(sequence_of("x", None, &mut none, false), Ok(Some(0)));
        assert_eq!(sequence_of("y", None, &mut none, false), Ok(Some(1)));
        let mut hw = Some(41);
        assert_eq!(sequence_of("x", None, &mut hw, false), Ok(Some(42)));
    }

    #[test]
    fn a_zero_based_feed_delivers_sequence_zero_without_a_checkpoint() {
        let seq = SequencePointer::new("/seq");
        let mut hw = None;
        assert_eq!(
            sequence_of(r#"{"seq":0}"#, Some(&seq), &mut hw, false),
            Ok(Some(0))
        );
        assert_eq!(
            sequence_of(r#"{"seq":0}"#, Some(&seq), &mut hw, false),
            Ok(None)
        );
        let mut zero = Some(0);
        assert_eq!(
            sequence_of(r#"{"seq":0}"#, Some(&seq), &mut zero, false),
            Ok(None),
            "checkpoint 0 means 0 was delivered"
        );
    }

    #[test]
    fn pointer_sequences_skip_replays_and_reject_messages_without_one() {
        let (seq, nested) = (SequencePointer::new("/seq"), SequencePointer::new("/m/n"));
        let mut hw = Some(10);
        assert_eq!(
            sequence_of(r#"{"seq":9}"#, Some(&seq), &mut hw, false),
            Ok(None)
        );
        assert_eq!(
            sequence_of(r#"{"seq":11}"#, Some(&seq), &mut hw, false),
            Ok(Some(11))
        );
        assert_eq!(
            sequence_of(r#"{"m":{"n":12}}"#, Some(&nested), &mut hw, false),
            Ok(Some(12))
        );
        assert!(sequence_of(r#"{"seq":"13"}"#, Some(&seq), &mut hw, false).is_err());
        assert!(sequence_of("not json", Some(&seq), &mut hw, false).is_err());
        assert_eq!(hw, Some(12));
        // Carried as a string, a message broken after its number is
        // delivered; embedded as JSON, it cannot be.
        let broken = r#"{"seq":13,"x":"#;
        assert!(sequence_of(broken, Some(&seq), &mut hw.clone(), true).is_err());
        assert_eq!(
            sequence_of(broken, Some(&seq), &mut hw, false),
            Ok(Some(13))
        );
    }

    const CHECKS: [Check; 3] = [Check::Grammar, Check::Embeddable, Check::UpToValue];

    /// The streaming lookup gives `Value::pointer(..).as_u64()`'s answer, and
    /// refuses what `serde_json` refuses (all of it with the whole-text
    /// checks, up to the value with [`Check::UpToValue`]), over documents
    /// and pointers chosen for the corners: escapes, arrays and index rules,
    /// numbers that are not unsigned integers, nesting, invalid and trailing
    /// text. (Duplicate keys are the next test's.)
    #[test]
    fn the_streaming_lookup_agrees_with_value_pointer() {
        let documents = [
            r#"{"seq":7}"#,
            r#"{"seq":7,"seq":8}"#,
            r#"{"seq":{"n":1},"seq":2}"#,
            r#"{"seq":2,"seq":{"n":1}}"#,
            r#"{"a/b":3,"m~n":4,"":5,"a":{"":6}}"#,
            r#"{"a":[10,11,{"b":12}],"b":[[1,2],[3,4]]}"#,
            r#"[5,6,7]"#,
            r#"{"seq":-1}"#,
            r#"{"seq":-0}"#,
            r#"{"seq":1.0}"#,
            r#"{"seq":18446744073709551615}"#,
            r#"{"seq":18446744073709551616}"#,
            r#"{"seq":1e3}"#,
            r#"{"seq":"12"}"#,
            r#"{"seq":null,"x":true}"#,
            r#"{"x":"a \"quoted\" \\ string \u00e9 \ud83d\ude00","seq":9}"#,
            r#"{"se\u0071":13}"#,
            r#"{"deep":{"er":{"est":[0,{"seq":14}]}}}"#,
            r#"{"a":1,"b":"two","c":true,"d":null,"e":-1.5e-3,"seq":16}"#,
            "42",
            r#"{"seq":1} trailing"#,
            r#"{"seq":1,}"#,
            r#"{"seq":1"#,
            r#"{"seq":12 "#,
            r#"{"seq":12x"#,
            r#"{"seq":01}"#,
            r#"{"x":[1,2,],"seq":1}"#,
            r#"{"x":"unterminated}"#,
            "",
            "not json",
            r#"  {"seq" : 15 }  "#,
            "\u{feff}{\"seq\":1}",
        ];
        let pointers = [
            "",
            "/seq",
            "/seq/n",
            "/a~1b",
            "/m~0n",
            "/",
            "/a/",
            "/a/0",
            "/a/1",
            "/a/2/b",
            "/a/3",
            "/a/01",
            "/a/+1",
            "/a/-",
            "/b/1/0",
            "/0",
            "/2",
            "/00",
            "/deep/er/est/1/seq",
            "/x",
            "seq",
            "/seq/0",
        ];
        // Not JSON, but JSON up to the end of the number the pointer names
        // (`{"seq":1` is not: the number may go on).
        let up_to_value = [
            (r#"{"seq":1} trailing"#, "/seq", 1),
            (r#"{"seq":1,}"#, "/seq", 1),
            (r#"{"seq":12 "#, "/seq", 12),
            (r#"{"seq":12x"#, "/seq", 12),
            (r#"{"x":[1,2,],"seq":1}"#, "/x/0", 1),
            (r#"{"x":[1,2,],"seq":1}"#, "/x/1", 2),
        ];
        // Not JSON up to the value either.
        let refused = [
            (r#"{"seq":1"#, "/seq"),
            (r#"{"seq":01}"#, "/seq"),
            (r#"{"x":[1,2,],"seq":1}"#, "/seq"),
            (r#"{"x":[1,2,],"seq":1}"#, "/x"),
        ];
        let refused_whole = [
            "",
            "not json",
            r#"{"x":"unterminated}"#,
            "\u{feff}{\"seq\":1}",
        ];
        for doc in documents {
            let value: Result<serde_json::Value, _> = serde_json::from_str(doc);
            let duplicates = doc.matches(r#""seq":"#).count() > 1;
            for p in pointers {
                for check in CHECKS {
                    let found = SequencePointer::new(p).u64_in(doc, check);
                    let lenient = up_to_value.iter().find(|(d, at, _)| *d == doc && *at == p);
                    match (&value, check, lenient) {
                        // The first of duplicates counts: the next test's.
                        (Ok(_), Check::UpToValue, _) if duplicates => {}
                        (Ok(v), _, _) => assert_eq!(
                            found.ok(),
                            Some(v.pointer(p).and_then(serde_json::Value::as_u64)),
                            "document {doc:?}, pointer {p:?}, {check:?}"
                        ),
                        (Err(_), Check::UpToValue, Some((.., seq))) => {
                            assert_eq!(found.ok(), Some(Some(*seq)), "{doc:?} at {p:?}");
                        }
                        (Err(_), Check::UpToValue, None)
                            if !refused.contains(&(doc, p)) && !refused_whole.contains(&doc) =>
                        {
                            // No number there: the value is something else,
                            // or the text before it is not JSON.
                            assert!(
                                matches!(found, Ok(None) | Err(_)),
                                "{doc:?} at {p:?}: {found:?}"
                            );
                        }
                        (Err(_), _, _) => {
                            assert!(
                                found.is_err(),
                                "{doc:?} is not JSON ({check:?}, {p:?}): {found:?}"
                            )
                        }
                    }
                }
            }
        }
    }

    /// Read up to the number, of duplicate keys the first counts: it is the
    /// one found without reading further. (Checked whole, the last counts,
    /// as in a `Value`: the test above.)
    #[test]
    fn read_up_to_the_number_the_first_of_duplicate_keys_counts() {
        let cases = [
            (r#"{"seq":7,"seq":8}"#, "/seq", Some(7)),
            (r#"{"seq":{"n":1},"seq":2}"#, "/seq", None),
            (r#"{"seq":{"n":1},"seq":2}"#, "/seq/n", Some(1)),
            (r#"{"seq":2,"seq":{"n":1}}"#, "/seq", Some(2)),
            (r#"{"seq":2,"seq":{"n":1}}"#, "/seq/n", None),
            (r#"{"m":{"n":3},"m":{"n":4}}"#, "/m/n", Some(3)),
            (r#"{"se\u0071":5,"seq":6}"#, "/seq", Some(5)),
            (r#"{"seq":7,"seq":8,"x":"#, "/seq", Some(7)),
        ];
        for (doc, p, expected) in cases {
            assert_eq!(
                SequencePointer::new(p)
                    .u64_in(doc, Check::UpToValue)
                    .unwrap(),
                expected,
                "{doc} {p}"
            );
        }
    }

    /// Nesting serde_json refuses (128 levels) is refused read up to the
    /// number too; the read leaves deep pointers to serde_json.
    #[test]
    fn nesting_serde_json_refuses_is_refused_however_it_is_read() {
        for (levels, accepted) in [(100, true), (101, true), (127, true), (128, false)] {
            let pointer = SequencePointer::new(&"/a".repeat(levels));
            let text = format!("{}1{}", r#"{"a":"#.repeat(levels), "}".repeat(levels));
            assert_eq!(
                leading_u64(&text, std::iter::repeat_n("a", levels)),
                (levels <= 100).then_some(1),
                "{levels} levels"
            );
            for check in CHECKS {
                let found = pointer.u64_in(&text, check);
                // Embedded, the body's own levels come on top.
                let embeddable = levels <= MAX_EMBEDDED_DEPTH as usize;
                let accepted = accepted && (check != Check::Embeddable || embeddable);
                assert_eq!(
                    found.is_ok(),
                    accepted,
                    "{levels} levels, {check:?}: {found:?}"
                );
            }
        }
    }

    /// Whenever the read of the text before the number answers, serde_json
    /// gives the same answer, and the text up to where the read says the
    /// number ends, closed, is a JSON document with that number at the
    /// pointer (a check that shares no code with either): over generated
    /// documents (plain and escaped strings, numbers of every form,
    /// literals, nesting, whitespace, keys that need `~0` and `~1`) and every
    /// one-byte deletion, substitution and insertion of them. The read must
    /// also answer for the shapes it is for, or it saves nothing.
    #[test]
    fn the_read_before_the_number_agrees_with_serde_json() {
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        const KEYS: &[&str] = &[
            "seq",
            "a",
            "m",
            "n",
            "0",
            "a/b",
            "m~n",
            "",
            r#"se\u0071"#,
            "x y",
            "é",
        ];
        const SCALARS: &[&str] = &[
            "0",
            "7",
            "01",
            "-3",
            "-0",
            "1.5",
            "1.",
            "1e3",
            "2E-2",
            "1e",
            "-",
            "1000000",
            "18446744073709551615",
            "18446744073709551616",
            "123456789012345678901234567890",
            r#""s""#,
            r#""a\"b""#,
            r#""é""#,
            "\"\u{7f}\"",
            "true",
            "false",
            "null",
            "tru",
            "nul",
            r#""""#,
        ];
        const SPACE: &[&str] = &["", "", "", " ", "\n\t", "\r "];
        const BYTES: &[&str] = &[
            "\"", "}", "{", ",", ":", "1", "0", "-", "+", "e", "E", ".", " ", "\t", "x", "t", "\\",
            "[", "]", "\u{1}", "\u{7f}", "é",
        ];
        fn member(next: &mut impl FnMut(usize) -> usize, depth: usize) -> String {
            let space = SPACE[next(SPACE.len())];
            let key = KEYS[next(KEYS.len())];
            format!("{space}\"{key}\"{space}:{}", value(next, depth + 1))
        }
        fn value(next: &mut impl FnMut(usize) -> usize, depth: usize) -> String {
            let space = SPACE[next(SPACE.len())];
            match next(if depth > 3 { 1 } else { 4 }) {
                0 | 1 => format!("{space}{}{space}", SCALARS[next(SCALARS.len())]),
                2 => {
                    let members: Vec<String> = (0..next(4)).map(|_| member(next, depth)).collect();
                    format!("{space}{{{}}}{space}", members.join(","))
                }
                _ => {
                    let items: Vec<String> = (0..next(3)).map(|_| value(next, depth + 1)).collect();
                    format!("{space}[{}]{space}", items.join(","))
                }
            }
        }
        let pointers: Vec<SequencePointer> = [
            "/seq", "/m/n", "/a", "/m/seq", "/0", "/a~1b", "/m~0n", "/", "/a/m/n",
        ]
        .into_iter()
        .map(SequencePointer::new)
        .collect();
        let (mut answered, mut checked) = (0, 0);
        for _ in 0..1_200 {
            let members: Vec<String> = (0..1 + next(4)).map(|_| member(&mut next, 0)).collect();
            let doc = format!("{{{}}}", members.join(","));
            let mut variants = vec![doc.clone()];
            for (at, c) in doc.char_indices() {
                let mut deleted = doc.clone();
                deleted.replace_range(at..at + c.len_utf8(), "");
                let mut swapped = doc.clone();
                swapped.replace_range(at..at + c.len_utf8(), BYTES[next(BYTES.len())]);
                let mut inserted = doc.clone();
                inserted.insert_str(at, BYTES[next(BYTES.len())]);
                variants.extend([deleted, swapped, inserted]);
            }
            for text in &variants {
                for pointer in &pointers {
                    let keys: Vec<&str> = pointer
                        .tokens
                        .as_deref()
                        .unwrap()
                        .iter()
                        .map(|t| t.key.as_str())
                        .collect();
                    let Some((seq, end)) = number_and_end(text, keys.iter().copied()) else {
                        continue;
                    };
                    answered += 1;
                    assert_eq!(
                        pointer.parsed_up_to_value(text).ok(),
                        Some(Some(seq)),
                        "{text:?} at {}",
                        pointer.text
                    );
                    let closed = format!("{}{}", &text[..end], "}".repeat(keys.len()));
                    let value: serde_json::Value = serde_json::from_str(&closed)
                        .unwrap_or_else(|e| panic!("{closed:?} from {text:?}: {e}"));
                    assert_eq!(
                        value
                            .pointer(&pointer.text)
                            .and_then(serde_json::Value::as_u64),
                        Some(seq),
                        "{closed:?} from {text:?}"
                    );
                    assert!(end < text.len(), "something follows the number in {text:?}");
                }
                checked += 1;
            }
        }
        assert!(checked > 100_000, "{checked} texts");
        assert!(answered > 5_000, "the read answered only {answered} times");
        let bench = r#"{"seq":1000123,"payload":"xxxxxxxx"}"#;
        assert_eq!(leading_u64(bench, ["seq"]), Some(1_000_123));
        let feed = r#"{"type":"trade","price":1.5e2,"ok":true,"data":{"id":"x","seq":9},"x":[1]}"#;
        assert_eq!(leading_u64(feed, ["data", "seq"]), Some(9));
    }
}

//! Packed checkpoints as stored, in two forms, and slot pages.
//!
//! A worker writes the acknowledged sequence numbers of its busy streams into
//! its own items with every heartbeat (`worker::incarnation::checkpoints`).
//! DynamoDB bills a write by the size of the whole item, so what one entry
//! costs is what decides the bill:
//!
//! - **By name** (0.3 and earlier): `"<namespace>/<name>": "<seq>:<token>"` in
//!   the `checkpoints` map, ~30 bytes. Every release reads it.
//! - **By slot**: a number the writer gave the stream, and how far its
//!   sequence number is from the one it started the slot at, as two varints
//!   in one binary attribute: 3 or 4 bytes. What a slot stands for (stream,
//!   token, base) is written once, in the writer's slot pages, before any
//!   entry names it.
//!
//! Why this cannot resume a stream past what was acknowledged: a slot is
//! never given twice by one incarnation and what it stands for never changes
//! once written, so every entry that names a slot, in any item, whenever
//! written, was a true acknowledged checkpoint of that stream under that
//! token. A page that is missing, older or newer than the entries only loses
//! entries (a takeover then replays from the stream's own item), and merging
//! everything found by the highest (token, seq) stays true.

use super::codec::{Item, attr, s};
use super::keys::StreamKey;
use super::record::{Checkpoint, Checkpoints, PackedShard, SlotEntry, SlotPage};
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use prost::encoding::{decode_varint, encode_varint, encoded_len_varint};

/// First byte of a slotted attribute: the encoding's version. A reader that
/// meets another version takes no entry from it (it only costs a replay).
const SLOTTED_VERSION: u8 = 1;

/// Slots per page: a page is rewritten whenever one of its slots comes or
/// goes, so pages stay small (~10 KB) and a worker's long-lived slots are
/// not rewritten for a newcomer's.
pub const SLOTS_PER_PAGE: u64 = 256;

/// The page slot `slot` lives in.
pub fn page_of(slot: u64) -> u32 {
    (slot / SLOTS_PER_PAGE) as u32
}

impl PackedShard {
    pub fn is_empty(&self) -> bool {
        self.named.is_empty() && self.slotted.is_empty()
    }

    /// The map attribute of the named entries, if any.
    pub fn named_value(&self) -> Option<AttributeValue> {
        (!self.named.is_empty()).then(|| {
            AttributeValue::M(
                self.named
                    .iter()
                    .map(|(k, c)| (k.to_string(), checkpoint_value(c)))
                    .collect(),
            )
        })
    }

    /// The binary attribute of the slotted entries, if any.
    pub fn slotted_value(&self) -> Option<AttributeValue> {
        (!self.slotted.is_empty())
            .then(|| AttributeValue::B(Blob::new(encode_slotted(&self.slotted))))
    }
}

/// Both forms of packed entries an item carries. Named entries that do not
/// parse are skipped, and a slotted attribute that does not decode whole is
/// taken as empty: a checkpoint only ever saves a replay.
pub(super) fn packed_shard(item: &Item) -> PackedShard {
    let named = match item.get(attr::CHECKPOINTS) {
        Some(AttributeValue::M(map)) => map
            .iter()
            .filter_map(|(name, value)| {
                let key = StreamKey::parse(name)?;
                let (seq, token) = value.as_s().ok()?.split_once(':')?;
                Some((
                    key,
                    Checkpoint {
                        seq: seq.parse().ok()?,
                        token: token.parse().ok()?,
                    },
                ))
            })
            .collect(),
        _ => Vec::new(),
    };
    let slotted = match item.get(attr::SLOTTED_CHECKPOINTS) {
        Some(AttributeValue::B(blob)) => decode_slotted(blob.as_ref()).unwrap_or_default(),
        _ => Vec::new(),
    };
    PackedShard { named, slotted }
}

/// One named entry as stored: `"<seq>:<token>"`.
fn checkpoint_value(c: &Checkpoint) -> AttributeValue {
    s(format!("{}:{}", c.seq, c.token))
}

/// Bytes one named entry adds to its item (DynamoDB counts name and value).
pub fn named_size(key: &StreamKey, c: &Checkpoint) -> usize {
    // name + value text + a few bytes of map overhead
    key.namespace.len() + key.name.len() + 1 + digits(c.seq) + digits(c.token) + 1 + 3
}

/// Bytes one slotted entry adds at most (its slot is stored as the distance
/// from the previous one, which is never more than the slot itself).
pub fn slotted_size(slot: u64, delta: i64) -> usize {
    encoded_len_varint(slot) + encoded_len_varint(zigzag(delta))
}

fn digits(v: u64) -> usize {
    v.checked_ilog10().map_or(1, |d| d as usize + 1)
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Version byte, then per entry in slot order: the distance from the
/// previous slot and the zigzagged delta, each a varint.
fn encode_slotted(entries: &[(u64, i64)]) -> Vec<u8> {
    let mut sorted = entries.to_vec();
    sorted.sort_unstable();
    let mut out = Vec::with_capacity(1 + sorted.len() * 4);
    out.push(SLOTTED_VERSION);
    let mut previous = 0;
    for (slot, delta) in sorted {
        encode_varint(slot - previous, &mut out);
        encode_varint(zigzag(delta), &mut out);
        previous = slot;
    }
    out
}

fn decode_slotted(mut bytes: &[u8]) -> Option<Vec<(u64, i64)>> {
    let (&version, rest) = bytes.split_first()?;
    if version != SLOTTED_VERSION {
        return None;
    }
    bytes = rest;
    let mut entries = Vec::new();
    let mut slot = 0u64;
    while !bytes.is_empty() {
        slot = slot.checked_add(decode_varint(&mut bytes).ok()?)?;
        let delta = unzigzag(decode_varint(&mut bytes).ok()?);
        entries.push((slot, delta));
    }
    Some(entries)
}

/// A slot page as stored: `"<slot>": "<token>:<base>:<namespace>/<name>"`.
pub(super) fn slot_page_value(page: &SlotPage) -> AttributeValue {
    AttributeValue::M(
        page.iter()
            .map(|(slot, e)| {
                (
                    slot.to_string(),
                    s(format!("{}:{}:{}", e.token, e.base, e.key)),
                )
            })
            .collect(),
    )
}

/// A slot page item's slots; entries that do not parse are skipped.
pub(super) fn slot_page(item: &Item) -> SlotPage {
    let Some(AttributeValue::M(map)) = item.get(attr::SLOTS) else {
        return SlotPage::new();
    };
    map.iter()
        .filter_map(|(slot, value)| {
            let mut parts = value.as_s().ok()?.splitn(3, ':');
            let token = parts.next()?.parse().ok()?;
            let base = parts.next()?.parse().ok()?;
            let key = StreamKey::parse(parts.next()?)?;
            Some((slot.parse().ok()?, SlotEntry { key, token, base }))
        })
        .collect()
}

/// Every checkpoint the shards carry, slotted ones through `slots`: the
/// highest (token, seq) per stream. Entries naming a slot not in `slots`
/// are left out.
pub(super) fn resolve<'a>(
    shards: impl IntoIterator<Item = &'a PackedShard>,
    slots: &SlotPage,
) -> Checkpoints {
    let mut all = Checkpoints::new();
    let mut keep = |key: &StreamKey, c: Checkpoint| {
        let entry = all.entry(key.clone()).or_insert(c);
        if (c.token, c.seq) > (entry.token, entry.seq) {
            *entry = c;
        }
    };
    for shard in shards {
        for (key, c) in &shard.named {
            keep(key, *c);
        }
        for (slot, delta) in &shard.slotted {
            let Some(e) = slots.get(slot) else { continue };
            let Some(seq) = e.base.checked_add_signed(*delta) else {
                continue;
            };
            keep(
                &e.key,
                Checkpoint {
                    seq,
                    token: e.token,
                },
            );
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(pairs: Vec<(&str, AttributeValue)>) -> Item {
        pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    #[test]
    fn named_entries_round_trip_and_garbage_is_skipped() {
        let a = StreamKey::new("ns", "a");
        let c = Checkpoint { seq: 41, token: 7 };
        let shard = PackedShard {
            named: vec![(a.clone(), c)],
            slotted: vec![],
        };
        let mut value = match shard.named_value() {
            Some(AttributeValue::M(m)) => m,
            other => panic!("{other:?}"),
        };
        value.insert("ns/b".into(), s("x:y"));
        let parsed = packed_shard(&item(vec![(attr::CHECKPOINTS, AttributeValue::M(value))]));
        assert_eq!(parsed.named, vec![(a.clone(), c)]);
        assert_eq!(named_size(&a, &c), 4 + 2 + 1 + 1 + 3);
        assert_eq!(PackedShard::default().named_value(), None);
    }

    #[test]
    fn slotted_entries_round_trip_in_a_few_bytes_each() {
        let entries = vec![(300, 5), (2, -3), (0, 0), (70_000, i64::MAX), (1, i64::MIN)];
        let shard = PackedShard {
            named: vec![],
            slotted: entries.clone(),
        };
        let value = shard.slotted_value().unwrap();
        let parsed = packed_shard(&item(vec![(attr::SLOTTED_CHECKPOINTS, value)]));
        let mut expected = entries;
        expected.sort_unstable();
        assert_eq!(parsed.slotted, expected);
        // A hundred busy streams: slots 0..100, a few thousand messages each.
        let busy: Vec<(u64, i64)> = (0..100).map(|i| (i, 4_000 + i as i64)).collect();
        assert!(encode_slotted(&busy).len() <= 1 + 100 * 3);
        let bound: usize = busy.iter().map(|(s, d)| slotted_size(*s, *d)).sum();
        assert!(encode_slotted(&busy).len() <= 1 + bound);
    }

    #[test]
    fn a_slotted_attribute_that_does_not_decode_whole_yields_nothing() {
        let good = encode_slotted(&[(1, 1), (2, 2)]);
        let truncated = &good[..good.len() - 1];
        let mut continued = good.clone();
        continued.push(0x80); // a varint that never ends
        let mut other_version = good.clone();
        other_version[0] = 2;
        for bytes in [truncated, &continued[..], &other_version[..], &[][..]] {
            let parsed = packed_shard(&item(vec![(
                attr::SLOTTED_CHECKPOINTS,
                AttributeValue::B(Blob::new(bytes.to_vec())),
            )]));
            assert!(parsed.slotted.is_empty(), "{bytes:?}");
        }
    }

    #[test]
    fn slot_pages_round_trip_and_garbage_is_skipped() {
        let mut page = SlotPage::new();
        page.insert(
            3,
            SlotEntry {
                key: StreamKey::new("ns", "a:b"),
                token: 9,
                base: 1_000,
            },
        );
        let mut value = match slot_page_value(&page) {
            AttributeValue::M(m) => m,
            other => panic!("{other:?}"),
        };
        value.insert("4".into(), s("nine:1:ns/c"));
        value.insert("x".into(), s("1:1:ns/c"));
        let parsed = slot_page(&item(vec![(attr::SLOTS, AttributeValue::M(value))]));
        assert_eq!(parsed, page);
    }

    #[test]
    fn resolving_takes_the_highest_true_entry_and_drops_unknown_slots() {
        let a = StreamKey::new("ns", "a");
        let b = StreamKey::new("ns", "b");
        let mut slots = SlotPage::new();
        slots.insert(
            0,
            SlotEntry {
                key: a.clone(),
                token: 4,
                base: 100,
            },
        );
        // A rebased slot of the same stream under the same token.
        slots.insert(
            5,
            SlotEntry {
                key: a.clone(),
                token: 4,
                base: 150,
            },
        );
        slots.insert(
            6,
            SlotEntry {
                key: b.clone(),
                token: 2,
                base: u64::MAX,
            },
        );
        let shards = [
            PackedShard {
                named: vec![(a.clone(), Checkpoint { seq: 140, token: 4 })],
                slotted: vec![(0, 45), (7, 1_000), (6, 1)],
            },
            PackedShard {
                named: vec![],
                slotted: vec![(5, -2)],
            },
        ];
        let all = resolve(&shards, &slots);
        assert_eq!(all[&a], Checkpoint { seq: 148, token: 4 });
        // b's delta overflows: no entry rather than a wrapped one.
        assert!(!all.contains_key(&b));
        assert_eq!(all.len(), 1);
        // Without its page, a slotted entry is nothing.
        let named_only = resolve(&shards, &SlotPage::new());
        assert_eq!(named_only[&a], Checkpoint { seq: 140, token: 4 });
    }
}

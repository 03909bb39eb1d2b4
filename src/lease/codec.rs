//! Attribute names and the translation between DynamoDB items and the
//! protocol's records. Nothing here sends a request.

use super::keys::{Incarnation, StreamKey};
use super::record::{
    DesiredState, FleetEntry, InboxEntry, OwnerRequests, PodIdentity, StreamRecord, WorkerRecord,
    WorkerState,
};
use super::session_status::{Phase, ReleaseReason, SessionStatus};
use aws_sdk_dynamodb::types::AttributeValue;
use std::collections::HashMap;

/// A DynamoDB item.
pub type Item = HashMap<String, AttributeValue>;

/// Attribute names. The seed's (first block) keep their names and meaning for a
/// person reading the table; renaming any of them breaks users.
pub mod attr {
    pub const PK: &str = "Pk";
    pub const DESIRED_STATE: &str = "desired_state";
    pub const WS_URL: &str = "ws_url";
    pub const LEASE_OWNER: &str = "lease_owner";
    pub const LEASE_EXPIRES_AT_MS: &str = "lease_expires_at_ms";
    pub const LAST_SEQ: &str = "last_seq";
    pub const LEASE_COUNTER: &str = "lease_counter";
    pub const SPEC: &str = "spec";
    pub const GENERATION: &str = "generation";
    pub const UID: &str = "uid";
    // Added by tether.
    pub const HOLDER: &str = "holder";
    pub const RESOURCE_CREATED_MS: &str = "resource_created_ms";
    pub const INSTALLATION: &str = "installation";
    /// Partition key of the `by_change` index: `<installation>#<shard>`,
    /// written by the controller's mirror (absent on standalone items, which
    /// therefore stay out of the index).
    pub const CHANGE_SHARD: &str = "change_shard";
    /// Sort key of the `by_change` index: when the item last changed (the
    /// writer's wall clock), stamped on every stream write by the one builder.
    pub const CHANGED_AT_MS: &str = "changed_at_ms";
    /// Counts the item's writes (with `changed_at_ms`): tells two changes in
    /// one millisecond apart.
    pub const CHANGE_SEQ: &str = "change_seq";
    pub const PHASE: &str = "phase";
    pub const STATUS_REASON: &str = "status_reason";
    pub const STATUS_MESSAGE: &str = "status_message";
    pub const CONNECTED_SINCE_MS: &str = "connected_since_ms";
    pub const RECONNECTS: &str = "reconnects";
    pub const SERVED_GENERATION: &str = "served_generation";
    /// What the owner's session has acted on: `{reconnect, move}` (a map,
    /// empty when neither was asked).
    pub const SERVED_REQUESTS: &str = "served_requests";
    pub const RELEASED_AT_MS: &str = "released_at_ms";
    /// On a worker item: this incarnation moves the change counter
    /// (`lease::changes`), so peers may read it instead of querying.
    pub const ANNOUNCES_CHANGES: &str = "announces_changes";
    /// On a worker item: where peers poke it (`host:port`), when it has one.
    pub const POKE_ADDR: &str = "poke_addr";
    /// On a worker item: this incarnation pokes its peers after it moves the
    /// change counter (workers of earlier releases do not).
    pub const POKES_PEERS: &str = "pokes_peers";
    pub const RELEASE_REASON: &str = "release_reason";
    pub const CREATED_AT_MS: &str = "created_at_ms";
    pub const ACQUIRED_AT_MS: &str = "acquired_at_ms";
    pub const DELETED_AT_MS: &str = "deleted_at_ms";
    pub const RECONNECT_REQUEST: &str = "reconnect_request";
    pub const MOVE_REQUEST: &str = "move_request";
    // Worker items.
    pub const INCARNATION: &str = "incarnation";
    /// The roster item's set of enrolled incarnations.
    pub const ROSTER: &str = "incarnations";
    pub const WORKER_STATE: &str = "worker_state";
    pub const HEARTBEAT_VERSION: &str = "heartbeat_version";
    pub const HEARTBEAT_AT_MS: &str = "heartbeat_at_ms";
    /// Heartbeat plus lease, wall clock: for people (`tether get`), never
    /// compared by the protocol.
    pub const ALIVE_UNTIL_MS: &str = "alive_until_ms";
    pub const HELD: &str = "held_streams";
    pub const POD_UID: &str = "pod_uid";
    pub const POD_CONTAINER: &str = "pod_container";
    pub const RESTART_COUNT: &str = "restart_count";
    pub const CHECKPOINTS: &str = "checkpoints";
    pub const CHECKPOINT_SHARDS: &str = "checkpoint_shards";
    /// Slotted checkpoint entries (binary, `lease::packed`).
    pub const SLOTTED_CHECKPOINTS: &str = "slotted_checkpoints";
    /// On a worker item: the numbers of the slot pages its entries name.
    pub const SLOT_PAGES: &str = "slot_pages";
    /// On a slot page item: what each slot stands for.
    pub const SLOTS: &str = "slots";
    /// On a slot page item: its writer's number for this write (they only
    /// grow), so a late earlier write or delete cannot undo a later write.
    pub const PAGE_WRITE: &str = "page_write";
    /// On a worker item: this incarnation reads slotted checkpoints.
    pub const READS_SLOTS: &str = "reads_slots";
    pub const CHANGED_STREAMS: &str = "changed_streams";
    /// Set when a worker starts draining (projected: peers stop counting it).
    pub const DRAINING_AT_MS: &str = "draining_at_ms";
    /// DynamoDB TTL attribute (epoch seconds) of worker and checkpoint items.
    pub const EXPIRES_AT: &str = "expires_at";
}

/// `served_requests` as written with a status.
pub fn served_requests_value(requests: &OwnerRequests) -> AttributeValue {
    AttributeValue::M(
        [
            ("reconnect", &requests.reconnect),
            ("move", &requests.move_away),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), s(v.clone()?))))
        .collect(),
    )
}

/// Attributes the `by_change` index carries besides its keys: enough for the
/// controller to tell a change it has not read yet (`change_seq`) and, for
/// the garbage collector, which resource wrote the item (`uid`) and whether
/// it is a tombstone already (`deleted_at_ms`), without reading the item.
pub const CHANGE_INDEX_ATTRIBUTES: [&str; 3] = [attr::UID, attr::CHANGE_SEQ, attr::DELETED_AT_MS];

/// Attributes the `by_holder` index carries besides its keys: what an acquirer
/// needs to classify and compare-and-swap a candidate, and what the fleet
/// query needs. None of them changes while an item stays in one partition, so
/// the index is written only when ownership (or a worker's state) changes.
pub const HOLDER_INDEX_ATTRIBUTES: [&str; 10] = [
    attr::DESIRED_STATE,
    attr::LEASE_COUNTER,
    attr::LEASE_EXPIRES_AT_MS,
    attr::LEASE_OWNER,
    attr::RELEASED_AT_MS,
    attr::RELEASE_REASON,
    attr::CREATED_AT_MS,
    attr::DELETED_AT_MS,
    attr::WORKER_STATE,
    attr::DRAINING_AT_MS,
];

pub fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

/// An item's `Pk`, if it has a string one.
pub(super) fn pk_of(item: &Item) -> Option<&str> {
    item.get(attr::PK)
        .and_then(|v| v.as_s().ok())
        .map(String::as_str)
}

/// The key of the item `pk` names (for a batch read).
pub(super) fn key_item(pk: &str) -> Item {
    Item::from([(attr::PK.to_string(), s(pk))])
}

/// Why an item could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub pk: String,
    pub detail: String,
}

struct Reader<'a> {
    item: &'a Item,
    pk: String,
}

impl<'a> Reader<'a> {
    fn new(item: &'a Item) -> Result<Self, Malformed> {
        let pk = pk_of(item).map(str::to_owned).ok_or_else(|| Malformed {
            pk: "?".into(),
            detail: "missing Pk".into(),
        })?;
        Ok(Self { item, pk })
    }

    fn bad(&self, detail: impl Into<String>) -> Malformed {
        Malformed {
            pk: self.pk.clone(),
            detail: detail.into(),
        }
    }

    fn string(&self, name: &str) -> Option<String> {
        self.item.get(name).and_then(|v| v.as_s().ok()).cloned()
    }

    /// A non-empty string (empty strings stand for "none" in single-SET writes).
    fn text(&self, name: &str) -> Option<String> {
        self.string(name).filter(|s| !s.is_empty())
    }

    /// A number that must parse when present (protocol fields).
    fn number(&self, name: &str) -> Result<Option<u64>, Malformed> {
        match self.item.get(name) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(v) => v
                .as_n()
                .ok()
                .and_then(|s| s.parse::<i128>().ok())
                .map(|x| Some(x.clamp(0, u64::MAX as i128) as u64))
                .ok_or_else(|| self.bad(format!("{name} is not a number"))),
        }
    }

    fn signed(&self, name: &str) -> Result<Option<i64>, Malformed> {
        match self.item.get(name) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(v) => v
                .as_n()
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .map(Some)
                .ok_or_else(|| self.bad(format!("{name} is not an integer"))),
        }
    }

    /// A number that only informs people: unreadable counts as absent.
    fn soft_number(&self, name: &str) -> Option<u64> {
        self.number(name).ok().flatten()
    }
}

/// A stream item. Errors name the item and the field, so one bad item can be
/// skipped and reported while the rest are served.
pub fn stream_record(item: &Item) -> Result<StreamRecord, Malformed> {
    let r = Reader::new(item)?;
    let key =
        StreamKey::from_pk(&r.pk).ok_or_else(|| r.bad("Pk is not CONN#<namespace>/<name>"))?;
    let deleted_at_ms = r.number(attr::DELETED_AT_MS)?;
    let desired_state = match r.string(attr::DESIRED_STATE) {
        Some(text) => DesiredState::parse(&text)
            .ok_or_else(|| r.bad(format!("desired_state '{text}' is not STARTED or STOPPED")))?,
        // A tombstone keeps only the fencing token.
        None if deleted_at_ms.is_some() => DesiredState::Stopped,
        None => return Err(r.bad("desired_state is missing")),
    };
    // Kept as text: whoever serves the stream decodes it, and an undecodable
    // spec is that stream's status, not an unreadable item. The seed stored a
    // string too; a map (hand-written items) is printed as the same JSON.
    let spec = match item.get(attr::SPEC) {
        Some(AttributeValue::S(text)) => Some(text.clone()),
        Some(AttributeValue::M(map)) => Some(attr_map_to_json(map).to_string()),
        _ => None,
    };
    let status = r
        .text(attr::PHASE)
        .and_then(|p| Phase::parse(&p))
        .map(|phase| SessionStatus {
            phase,
            reason: r.text(attr::STATUS_REASON),
            message: r.text(attr::STATUS_MESSAGE),
            connected_since_ms: r.soft_number(attr::CONNECTED_SINCE_MS).filter(|ms| *ms > 0),
            reconnects: r.soft_number(attr::RECONNECTS).unwrap_or(0),
        });
    Ok(StreamRecord {
        key,
        desired_state,
        ws_url: r.string(attr::WS_URL).unwrap_or_default(),
        spec,
        generation: r.signed(attr::GENERATION)?.unwrap_or(0),
        uid: r.text(attr::UID),
        resource_created_ms: r.soft_number(attr::RESOURCE_CREATED_MS),
        installation: r.text(attr::INSTALLATION),
        change_shard: r.text(attr::CHANGE_SHARD),
        change_seq: r.soft_number(attr::CHANGE_SEQ).unwrap_or(0),
        lease_owner: r.text(attr::LEASE_OWNER),
        lease_expires_at_ms: r.number(attr::LEASE_EXPIRES_AT_MS)?.unwrap_or(0),
        lease_counter: r.number(attr::LEASE_COUNTER)?.unwrap_or(0),
        checkpoint: r.number(attr::LAST_SEQ)?,
        holder: r.text(attr::HOLDER),
        released_at_ms: r.soft_number(attr::RELEASED_AT_MS),
        release_reason: r
            .text(attr::RELEASE_REASON)
            .and_then(|t| ReleaseReason::parse(&t)),
        created_at_ms: r.soft_number(attr::CREATED_AT_MS),
        deleted_at_ms,
        served_generation: r.signed(attr::SERVED_GENERATION).ok().flatten(),
        served_requests: match item.get(attr::SERVED_REQUESTS) {
            Some(AttributeValue::M(m)) => {
                let text = |k: &str| m.get(k).and_then(|v| v.as_s().ok()).cloned();
                Some(OwnerRequests {
                    reconnect: text("reconnect"),
                    move_away: text("move"),
                })
            }
            _ => None,
        },
        status,
        requests: OwnerRequests {
            reconnect: r.text(attr::RECONNECT_REQUEST),
            move_away: r.text(attr::MOVE_REQUEST),
        },
    })
}

/// A worker item.
pub fn worker_record(item: &Item) -> Result<WorkerRecord, Malformed> {
    let r = Reader::new(item)?;
    let incarnation =
        Incarnation::from_pk(&r.pk).ok_or_else(|| r.bad("Pk is not WORKER#<incarnation>"))?;
    let state = r
        .string(attr::WORKER_STATE)
        .and_then(|s| WorkerState::parse(&s))
        .ok_or_else(|| r.bad("worker_state is not LIVE, DEAD or LEFT"))?;
    let pod = match (r.text(attr::POD_UID), r.text(attr::POD_CONTAINER)) {
        (Some(uid), Some(container)) => Some(PodIdentity {
            uid,
            container,
            restart_count: r.soft_number(attr::RESTART_COUNT).unwrap_or(0) as u32,
        }),
        _ => None,
    };
    let changed_streams = match item.get(attr::CHANGED_STREAMS) {
        Some(AttributeValue::Ss(names)) => {
            names.iter().filter_map(|n| InboxEntry::parse(n)).collect()
        }
        _ => Vec::new(),
    };
    Ok(WorkerRecord {
        state,
        heartbeat_version: r.number(attr::HEARTBEAT_VERSION)?.unwrap_or(0),
        heartbeat_at_ms: r.soft_number(attr::HEARTBEAT_AT_MS).unwrap_or(0),
        alive_until_ms: r.soft_number(attr::ALIVE_UNTIL_MS).unwrap_or(0),
        held: r.soft_number(attr::HELD).unwrap_or(0),
        started_at_ms: r.soft_number(attr::CREATED_AT_MS).unwrap_or(0),
        released_at_ms: r.soft_number(attr::RELEASED_AT_MS),
        pod,
        checkpoint_shards: r.soft_number(attr::CHECKPOINT_SHARDS).unwrap_or(0) as u32,
        slot_pages: match item.get(attr::SLOT_PAGES) {
            Some(AttributeValue::Ns(pages)) => {
                pages.iter().filter_map(|p| p.parse().ok()).collect()
            }
            _ => Vec::new(),
        },
        changed_streams,
        announces_changes: matches!(
            item.get(attr::ANNOUNCES_CHANGES),
            Some(AttributeValue::Bool(true))
        ),
        reads_slots: matches!(
            item.get(attr::READS_SLOTS),
            Some(AttributeValue::Bool(true))
        ),
        // Unparsable: no poke, as from a worker that gave no address.
        poke_addr: r.text(attr::POKE_ADDR).and_then(|a| a.parse().ok()),
        pokes_peers: matches!(
            item.get(attr::POKES_PEERS),
            Some(AttributeValue::Bool(true))
        ),
        incarnation,
    })
}

/// A worker as the fleet query returns it.
pub fn fleet_entry(item: &Item) -> Result<FleetEntry, Malformed> {
    let r = Reader::new(item)?;
    let incarnation =
        Incarnation::from_pk(&r.pk).ok_or_else(|| r.bad("Pk is not WORKER#<incarnation>"))?;
    let state = r
        .string(attr::WORKER_STATE)
        .and_then(|s| WorkerState::parse(&s))
        .ok_or_else(|| r.bad("worker_state is not LIVE, DEAD or LEFT"))?;
    Ok(FleetEntry {
        incarnation,
        state,
        released_at_ms: r.soft_number(attr::RELEASED_AT_MS),
        started_at_ms: r.soft_number(attr::CREATED_AT_MS),
        draining: r.soft_number(attr::DRAINING_AT_MS).is_some(),
    })
}

pub fn attr_map_to_json(map: &HashMap<String, AttributeValue>) -> serde_json::Value {
    fn one(v: &AttributeValue) -> serde_json::Value {
        match v {
            AttributeValue::S(s) => serde_json::Value::String(s.clone()),
            AttributeValue::N(n) => serde_json::from_str(n).unwrap_or(serde_json::Value::Null),
            AttributeValue::Bool(b) => serde_json::Value::Bool(*b),
            AttributeValue::M(m) => attr_map_to_json(m),
            AttributeValue::L(l) => serde_json::Value::Array(l.iter().map(one).collect()),
            _ => serde_json::Value::Null,
        }
    }
    serde_json::Value::Object(map.iter().map(|(k, v)| (k.clone(), one(v))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(pairs: &[(&str, AttributeValue)]) -> Item {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn a_stream_item_without_a_checkpoint_reads_as_none_not_zero() {
        let r = stream_record(&item(&[
            (attr::PK, s("CONN#a/b")),
            (attr::DESIRED_STATE, s("STARTED")),
            (attr::LEASE_EXPIRES_AT_MS, n(0)),
        ]))
        .unwrap();
        assert_eq!(r.checkpoint, None);
        let r = stream_record(&item(&[
            (attr::PK, s("CONN#a/b")),
            (attr::DESIRED_STATE, s("STARTED")),
            (attr::LAST_SEQ, n(0)),
        ]))
        .unwrap();
        assert_eq!(r.checkpoint, Some(0));
    }

    #[test]
    fn bad_items_are_named_with_the_field_that_is_wrong() {
        let e = stream_record(&item(&[
            (attr::PK, s("CONN#a/b/c")),
            (attr::DESIRED_STATE, s("STARTED")),
        ]))
        .unwrap_err();
        assert!(e.detail.contains("Pk"), "{e:?}");
        let e = stream_record(&item(&[
            (attr::PK, s("CONN#a/b")),
            (attr::DESIRED_STATE, s("STARTED")),
            (attr::LAST_SEQ, s("seven")),
        ]))
        .unwrap_err();
        assert_eq!(e.pk, "CONN#a/b");
        assert!(e.detail.contains("last_seq"), "{e:?}");
    }
}

//! Names in the table: stream keys, worker incarnations, and the partition-key
//! values of the `by_holder` index. Every string the protocol compares is built
//! here, so a prefix is spelled once.

use serde::Serialize;
use std::fmt;

/// Prefix of every stream item's partition key, as in the seed table.
pub const STREAM_PK_PREFIX: &str = "CONN#";
/// Prefix of worker incarnation items.
pub const WORKER_PK_PREFIX: &str = "WORKER#";
/// Prefix of a worker's extra checkpoint shards.
pub const CHECKPOINT_PK_PREFIX: &str = "CKPT#";
/// Partition-key prefix of a worker's slot pages.
pub(super) const SLOT_PAGE_PK_PREFIX: &str = "SLOTS#";
/// Partition key of the roster item (every incarnation that may own streams).
pub(super) const ROSTER_PK: &str = "ROSTER#WORKERS";
/// `holder` of every worker item: the fleet is one query of this partition.
pub const FLEET_HOLDER: &str = "WORKERS";
/// `holder` prefix of STARTED streams nobody owns.
pub const UNOWNED_HOLDER_PREFIX: &str = "UNOWNED#";
/// How many `holder` partitions unowned streams (and each owner's streams) are
/// spread over. A burst of releases or acquisitions then divides over this many
/// partition-key values, each under DynamoDB's 1,000 write units per second.
/// Changing it needs a table migration: readers must query every shard.
pub const HOLDER_SHARDS: u32 = 8;
/// How many `change_shard` partitions of the `by_change` index one
/// installation's streams spread over. Every stream write moves the item's
/// sort key, which the index pays as a delete and an insert (2 write units),
/// and each partition-key value takes at most 1,000 write units per second:
/// 32 shards carry 16,000 stream writes per second, a cold start of 100,000
/// streams in a minute (mirror, acquire, connecting, connected: ~6,700 a
/// second) with room. The controller reads every shard each pass (32 small
/// queries). Changing it needs a table migration.
pub(super) const CHANGE_SHARDS: u32 = 32;
/// Separator between a worker id and its incarnation suffix (never in an id).
const INCARNATION_SEPARATOR: char = '~';

/// The identity of one stream: `namespace/name`, stored as `CONN#namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct StreamKey {
    pub namespace: String,
    pub name: String,
}

impl StreamKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// Parses `namespace/name`, or a bare `name` in the `default` namespace.
    pub fn parse(s: &str) -> Option<Self> {
        let (ns, name) = match s.split_once('/') {
            Some((ns, name)) => (ns, name),
            None => ("default", s),
        };
        if ns.is_empty() || name.is_empty() || name.contains('/') {
            return None;
        }
        Some(Self::new(ns, name))
    }

    /// The table's partition key value for this stream.
    pub fn pk(&self) -> String {
        format!("{STREAM_PK_PREFIX}{}/{}", self.namespace, self.name)
    }

    /// The inverse of [`StreamKey::pk`]; `None` for items that are not streams
    /// or whose name is not `namespace/name`.
    pub fn from_pk(pk: &str) -> Option<Self> {
        Self::parse(pk.strip_prefix(STREAM_PK_PREFIX)?)
    }

    /// Which of the [`HOLDER_SHARDS`] partitions this stream lives in: a stable
    /// hash (FNV-1a), the same on every worker and every version.
    pub fn shard(&self) -> u32 {
        self.hash() % HOLDER_SHARDS
    }

    fn hash(&self) -> u32 {
        let mut hash: u32 = 0x811c_9dc5;
        for byte in self.to_string().bytes() {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
        hash
    }

    /// `change_shard` value of this stream in `installation`'s part of the
    /// `by_change` index.
    pub fn change_shard(&self, installation: &str) -> String {
        change_shard(installation, self.hash() % CHANGE_SHARDS)
    }

    /// `holder` value while STARTED and unowned.
    pub fn unowned_holder(&self) -> String {
        unowned_holder(self.shard())
    }
}

impl fmt::Display for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `change_shard` partition `shard` of `installation`'s streams.
pub(super) fn change_shard(installation: &str, shard: u32) -> String {
    format!("{installation}#{shard}")
}

/// `holder` partition `shard` of the unowned streams.
pub fn unowned_holder(shard: u32) -> String {
    format!("{UNOWNED_HOLDER_PREFIX}{shard}")
}

/// Whether `id` may be used as a worker id: letters, digits, `.`, `_`, `-`, at
/// most 128 characters (pod names and host names fit).
pub fn valid_worker_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// One process's identity as an owner: the configured worker id plus a random
/// suffix drawn at start. Two processes started with the same worker id (a
/// copied environment variable, host networking) are still two owners, so a
/// read-back can never mistake the other's write for its own.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Incarnation(String);

impl Incarnation {
    /// A fresh incarnation of `worker_id` (64 random bits).
    pub fn new(worker_id: &str) -> Self {
        Self(format!(
            "{worker_id}{INCARNATION_SEPARATOR}{:016x}",
            rand::random::<u64>()
        ))
    }

    /// Parses a stored `lease_owner`; `None` for owners written by version 1,
    /// which had no incarnation suffix.
    pub fn parse(s: &str) -> Option<Self> {
        let (id, suffix) = s.split_once(INCARNATION_SEPARATOR)?;
        (valid_worker_id(id) && !suffix.is_empty()).then(|| Self(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The configured worker id this incarnation belongs to.
    pub fn worker_id(&self) -> &str {
        worker_id_of(&self.0)
    }

    /// Partition key of this incarnation's worker item.
    pub fn pk(&self) -> String {
        format!("{WORKER_PK_PREFIX}{}", self.0)
    }

    /// Partition key of checkpoint shard `n` (n ≥ 1; shard 0 is in the worker item).
    pub fn checkpoint_pk(&self, n: u32) -> String {
        format!("{CHECKPOINT_PK_PREFIX}{}#{n}", self.0)
    }

    /// Partition key of slot page `n` (`lease::packed`).
    pub fn slot_page_pk(&self, n: u32) -> String {
        format!("{SLOT_PAGE_PK_PREFIX}{}#{n}", self.0)
    }

    /// `holder` value of `key` while this incarnation owns it.
    pub fn holder_of(&self, key: &StreamKey) -> String {
        self.holder(key.shard())
    }

    /// `holder` partition `shard` of this incarnation's streams.
    pub fn holder(&self, shard: u32) -> String {
        format!("{}#{shard}", self.0)
    }

    /// The inverse of [`Incarnation::pk`].
    pub fn from_pk(pk: &str) -> Option<Self> {
        Self::parse(pk.strip_prefix(WORKER_PK_PREFIX)?)
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The worker id part of a stored owner (the whole string for version-1 owners).
pub fn worker_id_of(owner: &str) -> &str {
    owner
        .split_once(INCARNATION_SEPARATOR)
        .map_or(owner, |(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_keys_round_trip_through_the_partition_key() {
        let key = StreamKey::new("prod", "meeting-42");
        assert_eq!(key.pk(), "CONN#prod/meeting-42");
        assert_eq!(StreamKey::from_pk(&key.pk()), Some(key));
        assert_eq!(StreamKey::from_pk("WORKER#w1"), None);
        assert_eq!(StreamKey::from_pk("CONN#a/b/c"), None);
    }

    #[test]
    fn bare_names_live_in_the_default_namespace() {
        assert_eq!(
            StreamKey::parse("feed"),
            Some(StreamKey::new("default", "feed"))
        );
        assert_eq!(StreamKey::parse("a/b/c"), None);
        assert_eq!(StreamKey::parse("/b"), None);
    }

    #[test]
    fn two_incarnations_of_one_worker_id_never_collide() {
        let a = Incarnation::new("pod-0");
        let b = Incarnation::new("pod-0");
        assert_ne!(a, b);
        assert_eq!(a.worker_id(), "pod-0");
        assert_eq!(Incarnation::parse(a.as_str()), Some(a.clone()));
        assert_eq!(Incarnation::from_pk(&a.pk()), Some(a.clone()));
        assert_eq!(Incarnation::parse("pod-0"), None, "version-1 owner");
        assert_eq!(worker_id_of("pod-0"), "pod-0");
    }

    #[test]
    fn shards_are_stable_and_spread() {
        let key = StreamKey::new("ns", "feed");
        assert_eq!(key.shard(), key.clone().shard());
        let mut seen = std::collections::HashSet::new();
        for i in 0..200 {
            seen.insert(StreamKey::new("ns", format!("s{i}")).shard());
        }
        assert_eq!(seen.len(), HOLDER_SHARDS as usize);
    }

    #[test]
    fn worker_ids_exclude_the_separators() {
        assert!(valid_worker_id("tether-7d9f-abc.x_1"));
        assert!(!valid_worker_id("a~b"));
        assert!(!valid_worker_id("a#b"));
        assert!(!valid_worker_id(""));
    }
}

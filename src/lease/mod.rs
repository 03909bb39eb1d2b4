//! The lease store: who owns which stream, guarded by DynamoDB conditional writes.
//!
//! Every write here is a single conditional write (or a query), and every lost
//! condition is a typed outcome rather than an error: losing a race is the normal
//! way a fleet learns that somebody else owns a stream. Errors are reserved for
//! things an operator has to act on (missing table, bad credentials, an endpoint
//! that does not answer).

mod dynamo;
mod error;
pub mod retry;

pub use dynamo::{LeaseStore, MEMBER_PARTITION, Member, StoreConfig, TABLE_GSI};
pub use error::StoreError;
pub use retry::RetryPolicy;

use serde::Serialize;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Prefix of every stream item's partition key, as in the seed table.
pub const STREAM_PK_PREFIX: &str = "CONN#";

/// Wall-clock milliseconds since the epoch: the unit of `lease_expires_at_ms`.
///
/// Lease expiry is compared across machines, so it has to be wall-clock time;
/// the local safety checks (fencing) use the monotonic clock instead.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

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

    /// The inverse of [`StreamKey::pk`]; `None` for items that are not streams.
    pub fn from_pk(pk: &str) -> Option<Self> {
        Self::parse(pk.strip_prefix(STREAM_PK_PREFIX)?)
    }
}

impl fmt::Display for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Desired state of a stream as the control plane declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DesiredState {
    Started,
    Stopped,
}

impl DesiredState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "STARTED",
            Self::Stopped => "STOPPED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "STARTED" => Some(Self::Started),
            "STOPPED" => Some(Self::Stopped),
            _ => None,
        }
    }
}

/// One stream item as stored in the table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StreamRecord {
    pub key: StreamKey,
    pub desired_state: DesiredState,
    pub ws_url: String,
    /// The rest of the spec as JSON (sink, sequence pointer, keepalive, header refs).
    pub spec: Option<serde_json::Value>,
    pub generation: i64,
    pub lease_owner: Option<String>,
    /// `0` means released (or never owned).
    pub lease_expires_at_ms: u64,
    pub lease_counter: u64,
    pub last_seq: Option<u64>,
    /// When the last owner released the stream gracefully (wall-clock ms).
    pub released_at_ms: Option<u64>,
    /// When the control plane first wrote the item (wall-clock ms).
    pub created_at_ms: Option<u64>,
    /// Session status the owner reports along with its heartbeats.
    pub status: Option<SessionStatus>,
}

impl StreamRecord {
    /// The owner, if its lease has not lapsed at `now_ms`.
    pub fn live_owner(&self, now_ms: u64) -> Option<&str> {
        match &self.lease_owner {
            Some(owner) if self.lease_expires_at_ms > now_ms => Some(owner),
            _ => None,
        }
    }
}

/// What the owning worker reports about its session; written only by the owner,
/// under the same owner + counter guard as a renewal.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SessionStatus {
    pub phase: String,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub connected_since_ms: Option<u64>,
    pub reconnects: u64,
}

/// A lease a worker holds: the fencing token is `counter`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub key: StreamKey,
    pub owner: String,
    pub counter: u64,
    pub expires_at_ms: u64,
}

/// Result of [`LeaseStore::acquire`].
#[derive(Clone, Debug, PartialEq)]
pub enum AcquireOutcome {
    /// We own it now; `record` is the item after the write.
    Acquired {
        lease: Lease,
        record: Box<StreamRecord>,
    },
    /// Somebody else holds a live lease.
    Held { owner: String, expires_at_ms: u64 },
    /// The stream is STOPPED: nobody should serve it.
    NotStarted,
    /// The item no longer exists.
    Gone,
}

/// Result of the owner-guarded writes (renew, checkpoint, release).
#[derive(Clone, Debug, PartialEq)]
pub enum OwnerWrite<T> {
    /// The write happened while we still owned the lease.
    Done(T),
    /// The lease is no longer ours (taken over, deleted, or released): nothing changed.
    Lost,
}

impl<T> OwnerWrite<T> {
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Lost)
    }
}

/// Desired state written by the control plane (controller or `tether apply`).
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredStream {
    pub key: StreamKey,
    pub desired_state: DesiredState,
    pub ws_url: String,
    pub spec: serde_json::Value,
    pub generation: i64,
}

/// Result of [`LeaseStore::upsert_desired`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpsertOutcome {
    /// The item now carries this generation's desired state.
    Applied,
    /// The table already holds a newer generation; nothing was written.
    StaleGeneration { stored: i64 },
}

/// How long a lease lasts from a given instant, in wall-clock ms.
pub fn expiry_from(now_ms: u64, lease_duration: Duration) -> u64 {
    now_ms.saturating_add(lease_duration.as_millis() as u64)
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
    fn a_released_lease_has_no_live_owner() {
        let record = StreamRecord {
            key: StreamKey::new("d", "s"),
            desired_state: DesiredState::Started,
            ws_url: "ws://x".into(),
            spec: None,
            generation: 1,
            lease_owner: Some("w1".into()),
            lease_expires_at_ms: 0,
            lease_counter: 3,
            last_seq: Some(9),
            released_at_ms: None,
            created_at_ms: None,
            status: None,
        };
        assert_eq!(record.live_owner(1), None);
        let held = StreamRecord {
            lease_expires_at_ms: 100,
            ..record
        };
        assert_eq!(held.live_owner(99), Some("w1"));
        assert_eq!(held.live_owner(100), None);
    }
}
